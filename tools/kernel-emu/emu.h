// Host emulation of the CUDA features the flash-attention kernel (dataplane/kernels/flash.cu)
// uses, for checking its index and fragment arithmetic on a machine without a GPU.
//
// Every CUDA thread of a block is a ucontext fiber on one OS thread; blocks run one after
// the other. Warp collectives (shuffle, ballot, ldmatrix, mma.sync) and __syncthreads are
// rendezvous points: a fiber deposits its operands, waits until all participants arrived,
// then computes its own result from everybody's operands, following the PTX ISA fragment
// definitions (written out below as explicit matrices, independent of the kernel's own
// index formulas). cp.async copies are queued per thread and performed at wait_group (or at
// issue with EMU_EAGER_CP=1), shared memory is poisoned with 0xFF (bf16 NaN) before each
// block, so reading a tile before it landed, or never written, shows up as NaN.
//
// Not a performance model, and not a memory-model checker beyond the above.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

using std::max;
using std::min;

struct emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
struct float2 {
    float x, y;
};
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int __ffs(int x) { return x == 0 ? 0 : __builtin_ctz((unsigned)x) + 1; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

// ---- bf16 --------------------------------------------------------------------------------
struct __nv_bfloat16 {
    uint16_t x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.x << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

// ---- fibers ------------------------------------------------------------------------------
struct EmuBarrier {
    int count = 0;
    int expected = 0;
    uint64_t gen = 0;
};

struct EmuThread {
    ucontext_t ctx;
    std::vector<char> stack;
    emu_dim3 tidx;
    bool done = false;
    bool spun = false;  // returned to the scheduler from a spin wait whose condition was false
    EmuBarrier* waiting = nullptr;
    uint64_t wait_gen = 0;
    struct Cp {
        unsigned dst;
        const void* src;
        int bytes;
        bool zero;
    };
    std::vector<Cp> pending;
    std::vector<size_t> groups;  // end index in `pending` of each committed cp.async group
};

struct EmuWarp {
    EmuBarrier bar;
    uint64_t slot[2][32][16];
    int op[2][32];
};

struct EmuState {
    ucontext_t sched;
    std::vector<EmuThread> th;
    std::vector<EmuWarp> warps;
    EmuBarrier block_bar;
    EmuThread* cur = nullptr;
    std::vector<unsigned char> smem;
    bool eager_cp = false;
    std::function<void()> body;
};
inline EmuState emu;
inline emu_dim3 blockIdx, blockDim, gridDim;
#define threadIdx (emu.cur->tidx)
inline unsigned char* emu_dyn_smem = nullptr;
// Hooks for extensions (emu_wg.h): at the start of each block (thread count), when a
// thread's kernel body returns, and after a cp.async copy landed in shared memory.
inline std::function<void(unsigned)> emu_block_hook;
inline std::function<void()> emu_exit_hook;
// Called once per block after every thread finished (leftover-state checks).
inline std::function<void()> emu_block_end_hook;
// Bumped by every change of synchronisation state (barrier / mbarrier arrivals): a pass of
// the scheduler in which no thread ran except spin waits that failed, and the epoch did not
// move, is a deadlock.
inline uint64_t emu_epoch = 0;
inline void (*emu_cp_hook)(unsigned dst, int bytes) = nullptr;

[[noreturn]] inline void emu_fail(const char* what) {  // _Exit: no destructors on a fiber stack
    std::fprintf(stderr, "EMU ERROR: %s (thread %u, block %u,%u)\n", what, emu.cur ? emu.cur->tidx.x : 0u,
                 blockIdx.x, blockIdx.y);
    std::fflush(nullptr);
    std::_Exit(3);
}

inline void emu_yield() { swapcontext(&emu.cur->ctx, &emu.sched); }

inline void emu_arrive(EmuBarrier& b) {
    ++emu_epoch;
    if (++b.count == b.expected) {
        b.count = 0;
        ++b.gen;
        return;
    }
    emu.cur->waiting = &b;
    emu.cur->wait_gen = b.gen;
    while (b.gen == emu.cur->wait_gen) emu_yield();
    emu.cur->waiting = nullptr;
}

inline void __syncthreads() { emu_arrive(emu.block_bar); }

// Spin wait (mbarrier try_wait loops, register pool): yields until cond() holds.
template <typename F>
inline void emu_spin(F cond) {
    while (!cond()) {
        emu.cur->spun = true;
        emu_yield();
    }
}

static void emu_fiber_entry() {
    emu.body();
    if (emu_exit_hook) emu_exit_hook();
    emu.cur->done = true;
    swapcontext(&emu.cur->ctx, &emu.sched);
}

// Runs `kernel` for every block of `grid` with `threads` threads and `dyn` bytes of dynamic
// shared memory.
inline void emu_launch(emu_dim3 grid, unsigned threads, size_t dyn, std::function<void()> kernel) {
    gridDim = grid;
    blockDim = emu_dim3{threads, 1, 1};
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = emu_dim3{bx, by, 0};
            emu.smem.assign(dyn + 16, 0xff);
            emu_dyn_smem = emu.smem.data();
            emu.th.assign(threads, EmuThread{});
            emu.warps.assign((threads + 31) / 32, EmuWarp{});
            for (auto& w : emu.warps) w.bar.expected = 32;
            if (emu_block_hook) emu_block_hook(threads);
            emu.block_bar = EmuBarrier{};
            emu.block_bar.expected = (int)threads;
            emu.body = kernel;
            for (unsigned t = 0; t < threads; ++t) {
                EmuThread& f = emu.th[t];
                f.tidx = emu_dim3{t, 0, 0};
                f.stack.resize(256 << 10);
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = f.stack.data();
                f.ctx.uc_stack.ss_size = f.stack.size();
                f.ctx.uc_link = nullptr;
                makecontext(&f.ctx, emu_fiber_entry, 0);
            }
            // EMU_SCHED=rev|rand: threads resume in reverse or shuffled order between
            // barriers (the default is 0..N-1), so that a same-phase write and read by
            // different warps shows up whichever warp runs first.
            static unsigned emu_rng = 12345u;
            const char* sched = getenv("EMU_SCHED");
            std::vector<size_t> order(threads);
            for (size_t i = 0; i < threads; ++i) order[i] = i;
            if (sched && sched[0] == 'r' && sched[1] == 'e') std::reverse(order.begin(), order.end());
            size_t left = threads;
            while (left) {
                bool progress = false;
                left = 0;
                if (sched && sched[0] == 'r' && sched[1] == 'a') {
                    // shuffle by warps (keeps warp-collective behaviour realistic) and threads
                    for (size_t i = threads - 1; i > 0; --i) {
                        emu_rng = emu_rng * 1103515245u + 12345u;
                        std::swap(order[i], order[(emu_rng >> 8) % (i + 1)]);
                    }
                }
                for (size_t oi = 0; oi < threads; ++oi) {
                    auto& f = emu.th[order[oi]];
                    if (f.done) continue;
                    if (f.waiting && f.waiting->gen == f.wait_gen) {
                        ++left;
                        continue;
                    }
                    emu.cur = &f;
                    const uint64_t ep = emu_epoch;
                    f.spun = false;
                    swapcontext(&emu.sched, &f.ctx);
                    if (!f.spun || emu_epoch != ep) progress = true;
                    if (!f.done) ++left;
                    if (f.done && !f.pending.empty()) emu_fail("thread exited with cp.async in flight");
                }
                if (left && !progress) {
                    emu.cur = nullptr;
                    emu_fail("deadlock: every live thread waits at a barrier that cannot complete");
                }
            }
            emu.cur = nullptr;
            if (emu_block_end_hook) emu_block_end_hook();
        }
    }
}

// ---- warp collectives ----------------------------------------------------------------------
enum { OP_SHFL = 1, OP_BALLOT, OP_LDSM, OP_LDSM_T, OP_MMA };

// Deposits n words, waits for the warp, returns the buffer everybody deposited into.
inline uint64_t (*emu_collect(int op, const uint64_t* in, int n))[16] {
    const unsigned t = threadIdx.x;
    EmuWarp& w = emu.warps[t / 32];
    const int buf = (int)(w.bar.gen & 1);
    for (int i = 0; i < n; ++i) w.slot[buf][t % 32][i] = in[i];
    w.op[buf][t % 32] = op;
    emu_arrive(w.bar);
    for (int l = 0; l < 32; ++l)
        if (w.op[buf][l] != op) emu_fail("divergent warp collective");
    return w.slot[buf];
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    if (mask != 0xffffffffu) emu_fail("partial shuffle mask");
    static_assert(sizeof(T) <= 8, "shuffle of a wide type");
    uint64_t in = 0;
    std::memcpy(&in, &v, sizeof(T));
    auto s = emu_collect(OP_SHFL, &in, 1);
    T out;
    std::memcpy(&out, &s[(threadIdx.x % 32) ^ lane_mask][0], sizeof(T));
    return out;
}

inline unsigned __ballot_sync(unsigned mask, bool p) {
    if (mask != 0xffffffffu) emu_fail("partial ballot mask");
    uint64_t in = p;
    auto s = emu_collect(OP_BALLOT, &in, 1);
    unsigned r = 0;
    for (int l = 0; l < 32; ++l)
        if (s[l][0]) r |= 1u << l;
    return r;
}

inline uint16_t emu_smem16(unsigned addr) {
    if (addr % 2 || addr + 2 > emu.smem.size()) emu_fail("shared address out of range");
    uint16_t x;
    std::memcpy(&x, emu_dyn_smem + addr, 2);
    return x;
}

// ---- device primitives of flash.cu ----------------------------------------------------------
inline unsigned fa_smem_u32(const void* p) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    if (c < emu_dyn_smem || c >= emu_dyn_smem + emu.smem.size()) emu_fail("fa_smem_u32 of a non-shared pointer");
    return (unsigned)(c - emu_dyn_smem);
}

inline void emu_do_cp(const EmuThread::Cp& c) {
    if (c.dst % c.bytes || c.dst + c.bytes > emu.smem.size()) emu_fail("cp.async destination");
    if (c.zero)
        std::memset(emu_dyn_smem + c.dst, 0, c.bytes);
    else {
        if ((uintptr_t)c.src % c.bytes) emu_fail("cp.async source misaligned");
        std::memcpy(emu_dyn_smem + c.dst, c.src, c.bytes);
    }
    if (emu_cp_hook) emu_cp_hook(c.dst, c.bytes);
}

inline void fa_cp_async16(unsigned dst, const void* src, bool ok) {
    EmuThread::Cp c{dst, src, 16, !ok};
    if (emu.eager_cp)
        emu_do_cp(c);
    else
        emu.cur->pending.push_back(c);
}
inline void fa_cp_async8(unsigned dst, const void* src) {
    EmuThread::Cp c{dst, src, 8, false};
    if (emu.eager_cp)
        emu_do_cp(c);
    else
        emu.cur->pending.push_back(c);
}
inline void fa_cp_commit() {}
inline void fa_cp_wait_all() {
    for (auto& c : emu.cur->pending) emu_do_cp(c);
    emu.cur->pending.clear();
    emu.cur->groups.clear();
}

// Exact cp.async.commit_group / wait_group N: the calling thread's pending copies split
// into committed groups; waiting lands all but the newest N groups (uncommitted copies
// stay pending), so a wait that is too weak leaves stale shared memory. No-ops in eager
// mode (copies already landed).
inline void emu_cp_commit_group() {
    if (!emu.eager_cp) emu.cur->groups.push_back(emu.cur->pending.size());
}
inline void emu_cp_wait_group(int n) {
    if (emu.eager_cp) return;
    auto& gr = emu.cur->groups;
    auto& p = emu.cur->pending;
    if ((int)gr.size() <= n) return;
    const size_t upto = gr[gr.size() - n - 1];
    for (size_t i = 0; i < upto; ++i) emu_do_cp(p[i]);
    p.erase(p.begin(), p.begin() + upto);
    std::vector<size_t> rest;
    for (size_t i = gr.size() - n; i < gr.size(); ++i) rest.push_back(gr[i] - upto);
    gr = rest;
}

// ldmatrix .x4: lane l supplies the address of row l % 8 of matrix l / 8. Without .trans,
// register i of lane l = matrix i, row l / 4, columns 2 (l % 4) (low half) and + 1 (high);
// with .trans it is the same position of the transposed matrix: elements (row 2 (l % 4),
// column l / 4) (low) and (row 2 (l % 4) + 1, column l / 4) (high).
inline void emu_ldsm(unsigned* r, unsigned addr, bool trans) {
    uint64_t in = addr;
    auto s = emu_collect(trans ? OP_LDSM_T : OP_LDSM, &in, 1);
    const int l = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) {
        auto at = [&](int row, int col) { return emu_smem16((unsigned)s[8 * i + row][0] + 2 * col); };
        uint16_t lo, hi;
        if (!trans) {
            lo = at(l / 4, 2 * (l % 4));
            hi = at(l / 4, 2 * (l % 4) + 1);
        } else {
            lo = at(2 * (l % 4), l / 4);
            hi = at(2 * (l % 4) + 1, l / 4);
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
}
inline void fa_ldsm_x4(unsigned* r, unsigned addr) { emu_ldsm(r, addr, false); }
inline void fa_ldsm_x4_t(unsigned* r, unsigned addr) { emu_ldsm(r, addr, true); }

inline float emu_lo(unsigned x) { return __bfloat162float(__nv_bfloat16{(uint16_t)(x & 0xffff)}); }
inline float emu_hi(unsigned x) { return __bfloat162float(__nv_bfloat16{(uint16_t)(x >> 16)}); }

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 from the PTX ISA fragment figures
// (g = lane / 4, t = lane % 4):
//   A 16×16: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..);
//   B 16×8 (k × n): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g);
//   C/D 16×8: c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1).
inline void fa_mma(float* c, const unsigned* a, const unsigned* b) {
    uint64_t in[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    auto s = emu_collect(OP_MMA, in, 6);
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; ++L) {
        const int g = L / 4, t = L % 4;
        const unsigned a0 = (unsigned)s[L][0], a1 = (unsigned)s[L][1], a2 = (unsigned)s[L][2],
                       a3 = (unsigned)s[L][3], b0 = (unsigned)s[L][4], b1 = (unsigned)s[L][5];
        A[g][2 * t] = emu_lo(a0), A[g][2 * t + 1] = emu_hi(a0);
        A[g + 8][2 * t] = emu_lo(a1), A[g + 8][2 * t + 1] = emu_hi(a1);
        A[g][2 * t + 8] = emu_lo(a2), A[g][2 * t + 9] = emu_hi(a2);
        A[g + 8][2 * t + 8] = emu_lo(a3), A[g + 8][2 * t + 9] = emu_hi(a3);
        B[2 * t][g] = emu_lo(b0), B[2 * t + 1][g] = emu_hi(b0);
        B[2 * t + 8][g] = emu_lo(b1), B[2 * t + 9][g] = emu_hi(b1);
    }
    const int l = threadIdx.x % 32, g = l / 4, t = l % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
        double d = c[e];
        for (int kk = 0; kk < 16; ++kk) d += (double)A[row][kk] * (double)B[kk][col];
        c[e] = (float)d;
    }
}

inline float fa_exp2(float x) { return std::exp2(x); }

inline unsigned fa_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    unsigned u;
    std::memcpy(&u, &h, 4);
    return u;
}
