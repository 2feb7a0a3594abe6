// Host emulation of the Hopper features of dataplane/kernels/flash_wg.cu (on top of emu.h):
// warpgroup MMA (wgmma.mma_async with shared-memory matrix descriptors, A from shared memory
// or registers), wgmma.fence / commit_group / wait_group, fence.proxy.async, plus the
// cp.async / exp2 / pack primitives under their fw_ names.
//
// Written from the PTX ISA ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate
// Instructions": Matrix Descriptor Format, Shared Memory Matrix Layout with the 128-byte
// swizzle, Register Fragments of m64nNk16), independently of the kernel's own index
// formulas:
// * descriptor bits: [0,14) start >> 4, [16,30) LBO >> 4, [32,46) SBO >> 4, [49,52) base
//   offset, [62,64) swizzle mode (1 = 128 B; the only mode emulated, anything else fails);
// * element (mn, k) of a K-major operand (trans 0): start + (mn % 8)·128 + (mn / 8)·SBO +
//   2k; of an MN-major operand (trans 1): start + (mn % 64)·2 + (mn / 64)·LBO +
//   (k % 8)·128 + (k / 8)·SBO; then the 128-byte swizzle of the absolute address:
//   bits [4,7) ^= bits [7,10);
// * accumulator element i of thread t (warp x = (t % 128) / 32, lane l):
//   row 16x + l/4 + 8·((i % 4) / 2), column 8·(i / 4) + 2·(l % 4) + i % 2;
// * register A element: register r of thread t holds row 16x + l/4 + 8·(r % 2), columns
//   8·(r / 2) + 2·(l % 4) (low half) and + 1 (high half).
//
// Asynchrony is checked, not just computed: an mma_async is a warpgroup rendezvous (all
// 128 threads, identical descriptors / scale-d, else "divergent"); its operands are read
// from shared memory at issue AND again when it executes (at the wait_group that retires
// its group) and must not differ (shared memory overwritten while in flight); the thread's
// accumulators are snapshotted at issue and set to NaN until the op executes (reading them
// before wait_group shows as NaN; writing them is caught); register A is compared at
// execution with its value at issue; an mma_async needs a wgmma.fence since the thread's
// last wait_group; an operand byte written by cp.async and not yet followed by the
// writer's fence.proxy.async fails; a thread that exits with uncommitted or pending wgmma
// fails.
#pragma once
#include <map>
#include <memory>

#include "emu.h"

#define FW_HOST_EMULATOR 1

struct EmuWgOp {
    int n = 0;          // N of m64nNk16
    bool rs = false;    // A from registers
    int scale_d = 1;
    unsigned long long da = 0, db = 0;
    int tb = 0;         // trans-b
    float A[64][16];
    std::vector<float> B;  // [16][n]
    std::vector<float> Bexec;
    bool checked = false;
    uint32_t areg[128][4];
};

struct EmuWgPending {
    std::shared_ptr<EmuWgOp> op;
    float* acc;
    const unsigned* aptr;
    std::vector<float> snap;  // accumulators at issue (used when not chained)
    bool chained;
};

struct EmuWgThread {
    bool fenced = false;
    std::vector<EmuWgPending> open;                  // issued, not committed
    std::vector<std::vector<EmuWgPending>> groups;   // committed, oldest first
    uint64_t seq = 0;                                // wgmma issued so far
    std::vector<std::pair<unsigned, int>> dirty;     // cp.async writes since the last proxy fence
};

struct EmuWgGroup {
    EmuBarrier bar;
    uint64_t dep[128][8];
    std::map<uint64_t, std::shared_ptr<EmuWgOp>> ops;
};

inline std::vector<EmuWgThread> emu_wg_th;
inline std::vector<EmuWgGroup> emu_wg_grp;
inline std::vector<int> emu_wg_dirty;  // per shared byte: thread whose generic write is unfenced, or -1
inline unsigned emu_smem_shift = 0;    // extra offset of the dynamic shared memory base (alignment test)
inline long emu_wg_count = 0;

inline void emu_wg_init() {
    emu_block_hook = [](unsigned threads) {
        emu_wg_th.assign(threads, EmuWgThread{});
        emu_wg_grp.clear();
        emu_wg_grp.resize((threads + 127) / 128);
        for (auto& g : emu_wg_grp) g.bar.expected = 128;
        emu_wg_dirty.assign(emu.smem.size(), -1);
    };
    emu_exit_hook = [] {
        if (emu_wg_th.empty()) return;
        auto& t = emu_wg_th[threadIdx.x];
        if (!t.open.empty() || !t.groups.empty()) emu_fail("thread exited with wgmma in flight");
    };
    emu_cp_hook = [](unsigned dst, int bytes) {
        if (emu_wg_th.empty()) return;
        for (int b = 0; b < bytes; ++b) emu_wg_dirty[dst + b] = (int)threadIdx.x;
        emu_wg_th[threadIdx.x].dirty.push_back({dst, bytes});
    };
}

// ---- primitives of flash_wg.cu ----------------------------------------------------------
inline unsigned fw_smem_u32(const void* p) { return fa_smem_u32(p); }
inline void fw_cp_async16(unsigned dst, const void* src, bool ok) { fa_cp_async16(dst, src, ok); }
inline void fw_cp_async8(unsigned dst, const void* src) { fa_cp_async8(dst, src); }
inline void fw_cp_commit() {}
inline void fw_cp_wait_all() { fa_cp_wait_all(); }
inline float fw_exp2(float x) { return fa_exp2(x); }
inline unsigned fw_pack(float lo, float hi) { return fa_pack(lo, hi); }

inline void fw_fence_proxy_async() {
    auto& t = emu_wg_th[threadIdx.x];
    for (auto& d : t.dirty)
        for (int b = 0; b < d.second; ++b)
            if (emu_wg_dirty[d.first + b] == (int)threadIdx.x) emu_wg_dirty[d.first + b] = -1;
    t.dirty.clear();
}

inline void fw_wgmma_fence() { emu_wg_th[threadIdx.x].fenced = true; }

// bf16 element at a shared byte address (the operand fetch of the async proxy).
inline float emu_wg_elem(unsigned addr) {
    if (addr >= emu.smem.size()) emu_fail("wgmma operand address out of range");
    if (emu_wg_dirty[addr] >= 0 || emu_wg_dirty[addr + 1] >= 0)
        emu_fail("wgmma reads shared memory written by cp.async without fence.proxy.async");
    return __bfloat162float(__nv_bfloat16{emu_smem16(addr)});
}

// Address of element (mn, k), k < 16, of the operand described by desc; mn_major: trans = 1.
inline unsigned emu_wg_addr(unsigned long long desc, int mn, int k, bool mn_major) {
    const unsigned start = (unsigned)(desc & 0x3fff) << 4;
    const unsigned lbo = (unsigned)((desc >> 16) & 0x3fff) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3fff) << 4;
    const unsigned base_off = (unsigned)((desc >> 49) & 7);
    const unsigned mode = (unsigned)(desc >> 62);
    if (mode != 1) emu_fail("wgmma descriptor: only the 128-byte swizzle (mode 1) is emulated");
    if (base_off != 0) emu_fail("wgmma descriptor: base offset != 0 not emulated");
    if (desc & ((3ull << 14) | (3ull << 30) | (7ull << 46) | (0x3ffull << 52)))
        emu_fail("wgmma descriptor: reserved bits set");
    unsigned a;
    if (!mn_major)
        a = start + (mn % 8) * 128 + (mn / 8) * sbo + 2 * k;
    else
        a = start + (mn % 64) * 2 + (mn / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo;
    return a ^ (((a >> 7) & 7) << 4);
}

inline void emu_wg_fetch(EmuWgOp& op, float (*A)[16], std::vector<float>& B) {
    if (!op.rs)
        for (int m = 0; m < 64; ++m)
            for (int k = 0; k < 16; ++k) A[m][k] = emu_wg_elem(emu_wg_addr(op.da, m, k, false));
    B.assign((size_t)16 * op.n, 0.f);
    for (int k = 0; k < 16; ++k)
        for (int nn = 0; nn < op.n; ++nn) B[(size_t)k * op.n + nn] = emu_wg_elem(emu_wg_addr(op.db, nn, k, op.tb != 0));
}

// Accumulator element i of lane-in-warpgroup t: (row, column).
inline void emu_wg_acc_rc(int t, int i, int& row, int& col) {
    const int x = t / 32, l = t % 32;
    row = 16 * x + l / 4 + 8 * ((i % 4) / 2);
    col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
}

inline void emu_wg_issue(int n, bool rs, unsigned long long da, const unsigned* a, unsigned long long db, int tb,
                         int scale_d, float* d) {
    const unsigned t = threadIdx.x;
    auto& me = emu_wg_th[t];
    if (!me.fenced) emu_fail("wgmma.mma_async without wgmma.fence since the last wait_group");
    EmuWgGroup& g = emu_wg_grp[t / 128];
    const uint64_t seq = me.seq++;
    uint64_t* dep = g.dep[t % 128];
    dep[0] = (uint64_t)n | ((uint64_t)rs << 16) | ((uint64_t)tb << 17) | ((uint64_t)(scale_d != 0) << 18);
    dep[1] = da;
    dep[2] = db;
    dep[3] = seq;
    for (int r = 0; r < 4; ++r) dep[4 + r] = rs ? a[r] : 0;
    emu_arrive(g.bar);
    // Everybody arrived; the first thread of the warpgroup to get here builds the op.
    auto it = g.ops.find(seq);
    std::shared_ptr<EmuWgOp> op;
    if (it == g.ops.end()) {
        for (int l = 0; l < 128; ++l)
            if (g.dep[l][0] != dep[0] || g.dep[l][1] != dep[1] || g.dep[l][2] != dep[2] || g.dep[l][3] != seq)
                emu_fail("divergent wgmma.mma_async in a warpgroup");
        op = std::make_shared<EmuWgOp>();
        op->n = n, op->rs = rs, op->scale_d = scale_d != 0, op->da = da, op->db = db, op->tb = tb;
        for (int l = 0; l < 128; ++l)
            for (int r = 0; r < 4; ++r) op->areg[l][r] = (uint32_t)g.dep[l][4 + r];
        if (rs)
            for (int l = 0; l < 128; ++l)
                for (int r = 0; r < 4; ++r) {
                    const int x = l / 32, ln = l % 32;
                    const int row = 16 * x + ln / 4 + 8 * (r % 2), col = 8 * (r / 2) + 2 * (ln % 4);
                    op->A[row][col] = emu_lo(op->areg[l][r]);
                    op->A[row][col + 1] = emu_hi(op->areg[l][r]);
                }
        emu_wg_fetch(*op, op->A, op->B);
        g.ops[seq] = op;
        ++emu_wg_count;
    } else {
        op = it->second;
    }
    // Drop ops every thread of the warpgroup has fetched (keeps the map small).
    if (t % 128 == 127 && seq >= 1) g.ops.erase(g.ops.begin(), g.ops.lower_bound(seq > 64 ? seq - 64 : 0));
    EmuWgPending p;
    p.op = op;
    p.acc = d;
    p.aptr = rs ? a : nullptr;
    p.chained = false;
    for (auto& q : me.open) p.chained |= q.acc == d;
    for (auto& gr : me.groups)
        for (auto& q : gr) p.chained |= q.acc == d;
    const int cnt = n / 2;
    if (!p.chained) {
        p.snap.assign(d, d + cnt);
        for (int i = 0; i < cnt; ++i) d[i] = NAN;
    }
    me.open.push_back(std::move(p));
}

inline void fw_wgmma_commit() {
    auto& me = emu_wg_th[threadIdx.x];
    me.groups.push_back(std::move(me.open));
    me.open.clear();
}

inline void emu_wg_exec(EmuWgPending& p) {
    EmuWgOp& op = *p.op;
    if (!op.checked) {  // operands again, as read at completion
        float A2[64][16];
        emu_wg_fetch(op, A2, op.Bexec);
        // Bitwise (poisoned, never-written shared memory reads as NaN on both occasions).
        if (std::memcmp(op.Bexec.data(), op.B.data(), op.B.size() * sizeof(float)))
            emu_fail("wgmma B operand in shared memory changed while the wgmma was in flight");
        if (!op.rs && std::memcmp(A2, op.A, sizeof A2))
            emu_fail("wgmma A operand in shared memory changed while the wgmma was in flight");
        op.checked = true;
    }
    const int t = threadIdx.x % 128, cnt = op.n / 2;
    if (p.aptr)
        for (int r = 0; r < 4; ++r)
            if (p.aptr[r] != op.areg[t][r]) emu_fail("wgmma register A modified while the wgmma was in flight");
    float* d = p.acc;
    if (!p.chained)
        for (int i = 0; i < cnt; ++i) {
            if (!std::isnan(d[i])) emu_fail("wgmma accumulator written while the wgmma was in flight");
            d[i] = p.snap[i];
        }
    for (int i = 0; i < cnt; ++i) {
        int row, col;
        emu_wg_acc_rc(t, i, row, col);
        double s = op.scale_d ? (double)d[i] : 0.0;
        for (int k = 0; k < 16; ++k) s += (double)op.A[row][k] * (double)op.B[(size_t)k * op.n + col];
        d[i] = (float)s;
    }
}

template <int N, int NR>
inline void fw_wgmma_wait(float*) {
    auto& me = emu_wg_th[threadIdx.x];
    while ((int)me.groups.size() > N) {
        for (auto& p : me.groups.front()) emu_wg_exec(p);
        me.groups.erase(me.groups.begin());
    }
    me.fenced = false;
}

inline void fw_wgmma_ss_n64(float* d, unsigned long long da, unsigned long long db, int scale_d) {
    emu_wg_issue(64, false, da, nullptr, db, 0, scale_d, d);
}
inline void fw_wgmma_rs_n256(float* d, const unsigned* a, unsigned long long db) {
    emu_wg_issue(256, true, 0, a, db, 1, 1, d);
}
inline void fw_wgmma_rs_n128(float* d, const unsigned* a, unsigned long long db) {
    emu_wg_issue(128, true, 0, a, db, 1, 1, d);
}
