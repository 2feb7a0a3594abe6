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
//
// The warp-specialised kernel (attn_flash_wg3_*) adds, emulated from the PTX ISA
// ("mbarrier", "cp.async.mbarrier.arrive", "bar.sync / bar.arrive", "setmaxnreg",
// "fence.proxy.async"):
// * mbarrier objects (kept beside shared memory, keyed by address): init (count), arrive,
//   cp.async.mbarrier.arrive.noinc (the thread's pending cp.async land at that instruction,
//   then one arrival), try_wait.parity (succeeds iff the parity of the current, incomplete
//   phase differs from the operand; the phase waited for is then "current − 1"). A thread
//   that completes a phase yields at once, so the waiters (e.g. the producer refilling a
//   stage) run before it goes on. Left over at the end of a block: a partial phase fails.
// * every shared byte landed through cp.async.mbarrier.arrive carries the tag (mbarrier,
//   phase); a wgmma reading it needs every thread of its warpgroup to have waited for
//   exactly that phase of that mbarrier and to have run fence.proxy.async after the wait
//   (a later or earlier phase fails: read before the data was waited for / wrong parity,
//   or a stage refilled before its readers were done);
// * per shared byte, the wgmma that read it and have not yet been retired by all 128
//   threads of their warpgroup (wait_group): a copy landing on such a byte fails (a stage
//   overwritten while a wgmma still reads it, e.g. released before the wait_group);
// * named barriers 1..15: bar.sync (waits) and bar.arrive (does not) with a thread count
//   that must be a multiple of 32 and agree within a generation; arrivals left pending at
//   the end of a block fail;
// * setmaxnreg.{inc,dec}: the count must be a multiple of 8 in [24, 256], the same in all
//   128 threads of the warpgroup, .dec not above / .inc not below the current count; a
//   per-block pool starts at threads · (65536 / threads rounded down to 8, at most 255)
//   registers (the launch bound's entry count) minus the allocation, .inc waits for the pool;
// * spin waits take part in the deadlock check (emu.h).
#pragma once
#include <map>
#include <memory>

#include "emu.h"

#define FW_HOST_EMULATOR 1
#define __grid_constant__

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
    std::vector<unsigned> addrs;  // shared bytes read (first byte of each bf16)
    int retired = 0;              // threads that retired it (wait_group)
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
    std::vector<long> waited, pfenced;               // per mbarrier id: phase last waited for (at the last proxy fence)
    int regs = 0;                                    // setmaxnreg count (0: entry count)
};

constexpr long EMU_NEVER = -1000000;

struct EmuMbar {
    int id = 0;
    int expected = 0, pending = 0;
    long phase = 0;  // completed phases
    long tx = 0;     // transaction count (bytes) of the current phase: expect_tx adds, complete_tx subtracts
};

struct EmuWgRegs {
    EmuBarrier bar;
    int val[128];
    int cur = 0;
    bool granted = false;
};

struct EmuWgGroup {
    EmuBarrier bar;
    uint64_t dep[128][8];
    std::map<uint64_t, std::shared_ptr<EmuWgOp>> ops;
    EmuWgRegs regs;
};

inline std::vector<EmuWgThread> emu_wg_th;
inline std::vector<EmuWgGroup> emu_wg_grp;
inline std::vector<int> emu_wg_dirty;  // per shared byte: thread whose generic write is unfenced, or -1
inline unsigned emu_smem_shift = 0;    // extra offset of the dynamic shared memory base (alignment test)
inline long emu_wg_count = 0;
inline std::map<unsigned, EmuMbar> emu_mbar;           // by shared address
inline std::vector<int> emu_wg_tag_bar;                // per shared byte: mbarrier id of its landing, or -1
inline std::vector<long> emu_wg_tag_ph;                // ... and the phase
inline std::vector<char> emu_wg_tag_async;             // ... and whether it landed through the async proxy (TMA)
inline std::vector<int> emu_wg_readers;                // per shared byte: wgmma in flight reading it
inline int emu_land_bar = -1;                          // tag of the copies landing now
inline long emu_land_ph = 0;
inline EmuBarrier emu_named[16];
inline long emu_reg_pool = 0;

inline void emu_wg_init() {
    emu_block_hook = [](unsigned threads) {
        emu_wg_th.assign(threads, EmuWgThread{});
        emu_wg_grp.clear();
        emu_wg_grp.resize((threads + 127) / 128);
        for (auto& g : emu_wg_grp) g.bar.expected = 128;
        emu_wg_dirty.assign(emu.smem.size(), -1);
        emu_wg_tag_bar.assign(emu.smem.size(), -1);
        emu_wg_tag_ph.assign(emu.smem.size(), 0);
        emu_wg_tag_async.assign(emu.smem.size(), 0);
        emu_wg_readers.assign(emu.smem.size(), 0);
        emu_mbar.clear();
        for (auto& b : emu_named) b = EmuBarrier{};
        int r0 = std::min(255u, (65536u / threads) & ~7u);
        emu_reg_pool = 65536 - (long)threads * r0;
        for (auto& t : emu_wg_th) t.regs = r0;
        for (auto& g : emu_wg_grp) {
            g.regs.bar = EmuBarrier{};
            g.regs.bar.expected = 128;
            g.regs.cur = r0;
            g.regs.granted = false;
        }
    };
    emu_block_end_hook = [] {
        for (auto& m : emu_mbar)
            if (m.second.pending != m.second.expected || m.second.tx != 0) {
                std::fprintf(stderr, "EMU ERROR: mbarrier %u (id %d) left with a partial phase: %d of %d arrivals, "
                             "transaction count %ld (block %u,%u)\n", m.first, m.second.id,
                             m.second.expected - m.second.pending, m.second.expected, m.second.tx, blockIdx.x,
                             blockIdx.y);
                std::exit(3);
            }
        for (int i = 1; i < 16; ++i)
            if (emu_named[i].count) {
                std::fprintf(stderr, "EMU ERROR: named barrier %d left with %d pending arrivals (block %u,%u)\n", i,
                             emu_named[i].count, blockIdx.x, blockIdx.y);
                std::exit(3);
            }
    };
    emu_exit_hook = [] {
        if (emu_wg_th.empty()) return;
        auto& t = emu_wg_th[threadIdx.x];
        if (!t.open.empty() || !t.groups.empty()) emu_fail("thread exited with wgmma in flight");
    };
    emu_cp_hook = [](unsigned dst, int bytes) {
        if (emu_wg_th.empty()) return;
        for (int b = 0; b < bytes; ++b)
            if (emu_wg_readers[dst + b])
                emu_fail("shared memory overwritten while a wgmma reading it is in flight (not yet retired by "
                         "every thread of its warpgroup)");
        if (emu_land_bar >= 0) {  // landed through cp.async.mbarrier.arrive: tagged, no proxy fence by the writer
            for (int b = 0; b < bytes; ++b) {
                emu_wg_dirty[dst + b] = -1;
                emu_wg_tag_bar[dst + b] = emu_land_bar;
                emu_wg_tag_ph[dst + b] = emu_land_ph;
                emu_wg_tag_async[dst + b] = 0;
            }
            return;
        }
        for (int b = 0; b < bytes; ++b) emu_wg_dirty[dst + b] = (int)threadIdx.x, emu_wg_tag_bar[dst + b] = -1;
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
    t.pfenced = t.waited;
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

// At issue (record = true): the operand addresses are recorded (in-flight readers) and
// checked against the mbarrier tags: every thread of the issuing warpgroup `wg` must have
// waited for the tagged phase and fenced after it.
inline void emu_wg_fetch(EmuWgOp& op, float (*A)[16], std::vector<float>& B, int wg = -1) {
    std::vector<long> cons;
    auto at = [&](unsigned a) {
        if (wg >= 0) {
            op.addrs.push_back(a);
            for (unsigned b = a; b < a + 2 && b < emu_wg_tag_bar.size(); ++b) {
                const int id0 = emu_wg_tag_bar[b];
                if (id0 < 0) continue;
                // TMA data (async proxy, like the wgmma read): the mbarrier wait suffices;
                // cp.async data (generic proxy): the wait and a fence.proxy.async after it.
                const bool async = emu_wg_tag_async[b];
                const int id = 2 * id0 + async;
                if ((int)cons.size() <= id) cons.resize(id + 1, EMU_NEVER - 1);
                if (cons[id] == EMU_NEVER - 1) {
                    long v = EMU_NEVER - 2;
                    for (int l = 0; l < 128; ++l) {
                        const auto& f = async ? emu_wg_th[wg * 128 + l].waited : emu_wg_th[wg * 128 + l].pfenced;
                        const long x = (int)f.size() > id0 ? f[id0] : EMU_NEVER;
                        if (l == 0) v = x;
                        else if (x != v) v = EMU_NEVER - 3;
                    }
                    cons[id] = v;
                }
                const long ph = emu_wg_tag_ph[b];
                if (cons[id] == EMU_NEVER - 3)
                    emu_fail("wgmma operand: the threads of the warpgroup waited for different phases of its mbarrier");
                if (cons[id] < ph) {
                    std::fprintf(stderr, "(mbarrier id %d: data of phase %ld, warpgroup waited+fenced phase %ld)\n", id0, ph, cons[id]);
                    emu_fail("wgmma reads shared memory filled under an mbarrier phase its warpgroup has not waited for "
                             "(or not fenced with fence.proxy.async after the wait)");
                }
                if (cons[id] > ph) {
                    std::fprintf(stderr, "(mbarrier id %d: data of phase %ld, warpgroup waited+fenced phase %ld)\n", id0, ph, cons[id]);
                    emu_fail("wgmma reads shared memory older than the mbarrier phase its warpgroup waited for");
                }
            }
        }
        return emu_wg_elem(a);
    };
    if (!op.rs)
        for (int m = 0; m < 64; ++m)
            for (int k = 0; k < 16; ++k) A[m][k] = at(emu_wg_addr(op.da, m, k, false));
    B.assign((size_t)16 * op.n, 0.f);
    for (int k = 0; k < 16; ++k)
        for (int nn = 0; nn < op.n; ++nn) B[(size_t)k * op.n + nn] = at(emu_wg_addr(op.db, nn, k, op.tb != 0));
    if (wg >= 0)
        for (unsigned a : op.addrs) ++emu_wg_readers[a], ++emu_wg_readers[a + 1];
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
        emu_wg_fetch(*op, op->A, op->B, (int)(t / 128));
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
    if (++op.retired == 128) {
        for (unsigned a : op.addrs) --emu_wg_readers[a], --emu_wg_readers[a + 1];
        op.addrs.clear();
    }
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
inline void fw_wgmma_ss_n80(float* d, unsigned long long da, unsigned long long db, int scale_d) {
    emu_wg_issue(80, false, da, nullptr, db, 0, scale_d, d);
}
inline void fw_wgmma_rs_n256(float* d, const unsigned* a, unsigned long long db) {
    emu_wg_issue(256, true, 0, a, db, 1, 1, d);
}
inline void fw_wgmma_rs_n128(float* d, const unsigned* a, unsigned long long db) {
    emu_wg_issue(128, true, 0, a, db, 1, 1, d);
}

// ---- warp specialisation (attn_flash_wg3_*) -------------------------------------------------
inline void fw_cp_async8z(unsigned dst, const void* src, bool ok) {
    EmuThread::Cp c{dst, src, 8, !ok};
    emu.cur->pending.push_back(c);
}

inline EmuMbar& emu_mbar_at(unsigned bar) {
    auto it = emu_mbar.find(bar);
    if (it == emu_mbar.end()) emu_fail("mbarrier used before mbarrier.init");
    return it->second;
}

inline void fw_mbar_init(unsigned bar, unsigned count) {
    if (bar % 8 || bar + 8 > emu.smem.size()) emu_fail("mbarrier address misaligned / out of range");
    if (emu_mbar.count(bar)) emu_fail("mbarrier initialised twice");
    if (count < 1 || count > (1u << 20) - 1) emu_fail("mbarrier count out of range");
    EmuMbar m;
    m.id = (int)emu_mbar.size();
    m.expected = m.pending = (int)count;
    emu_mbar[bar] = m;
    std::memset(emu_dyn_smem + bar, 0x5a, 8);  // the object's bytes: opaque
}

inline void fw_mbar_init_fence() {}

// The phase completes when every expected arrival came and the transaction count is back
// at zero (PTX ISA "mbarrier": phase completion with tx-count).
inline void emu_mbar_maybe_complete(EmuMbar& m) {
    if (m.pending == 0 && m.tx == 0) {
        m.pending = m.expected;
        ++m.phase;
        emu_yield();  // waiters first
    }
}

inline void emu_mbar_arrive(EmuMbar& m) {
    ++emu_epoch;
    if (m.pending <= 0) emu_fail("mbarrier arrival beyond its expected count");
    --m.pending;
    emu_mbar_maybe_complete(m);
}

inline void fw_mbar_arrive(unsigned bar) { emu_mbar_arrive(emu_mbar_at(bar)); }

inline void fw_mbar_wait(unsigned bar, unsigned parity) {
    EmuMbar& m = emu_mbar_at(bar);
    if (parity > 1) emu_fail("mbarrier parity not 0 / 1");
    emu_spin([&] { return (unsigned)(m.phase & 1) != parity; });
    auto& w = emu_wg_th[threadIdx.x].waited;
    if ((int)w.size() <= m.id) w.resize(m.id + 1, EMU_NEVER);
    w[m.id] = m.phase - 1;
}

inline void fw_cp_mbar_arrive(unsigned bar) {
    EmuMbar& m = emu_mbar_at(bar);
    emu_land_bar = m.id;
    emu_land_ph = m.phase;
    for (auto& c : emu.cur->pending) emu_do_cp(c);
    emu.cur->pending.clear();
    emu_land_bar = -1;
    emu_mbar_arrive(m);
}

inline void emu_named_check(int id, int count) {
    if (id < 1 || id > 15) emu_fail("named barrier id not in 1..15");
    if (count <= 0 || count % 32 || count > (int)blockDim.x) emu_fail("named barrier thread count not a multiple of 32");
    EmuBarrier& b = emu_named[id];
    if (b.count == 0) b.expected = count;
    else if (b.expected != count) emu_fail("named barrier used with different thread counts in one generation");
}

inline void fw_bar_sync(int id, int count) {
    emu_named_check(id, count);
    emu_arrive(emu_named[id]);
}

inline void fw_bar_arrive(int id, int count) {
    emu_named_check(id, count);
    EmuBarrier& b = emu_named[id];
    ++emu_epoch;
    if (++b.count == b.expected) {
        b.count = 0;
        ++b.gen;
    }
}

inline void emu_setmaxnreg(int n, bool inc) {
    if (n < 24 || n > 256 || n % 8) emu_fail("setmaxnreg count not a multiple of 8 in [24, 256]");
    const unsigned t = threadIdx.x;
    EmuWgGroup& g = emu_wg_grp[t / 128];
    if (blockDim.x % 128) emu_fail("setmaxnreg in a block that is not whole warpgroups");
    g.regs.val[t % 128] = inc ? n : -n;
    emu_arrive(g.regs.bar);
    for (int l = 0; l < 128; ++l)
        if (g.regs.val[l] != g.regs.val[t % 128]) emu_fail("setmaxnreg differs within a warpgroup");
    auto& me = emu_wg_th[t];
    if (inc && n < me.regs) emu_fail("setmaxnreg.inc below the current count");
    if (!inc && n > me.regs) emu_fail("setmaxnreg.dec above the current count");
    const long delta = 128L * (n - g.regs.cur);
    if (!inc) {
        if (t % 128 == 0) emu_reg_pool -= delta, g.regs.cur = n;
    } else {
        emu_spin([&] {
            if (g.regs.granted) return true;
            if (emu_reg_pool >= delta) {
                emu_reg_pool -= delta;
                g.regs.cur = n;
                g.regs.granted = true;
                ++emu_epoch;
                return true;
            }
            return false;
        });
    }
    me.regs = n;
}
template <int N>
inline void fw_setmaxnreg_inc() {
    emu_setmaxnreg(N, true);
}
template <int N>
inline void fw_setmaxnreg_dec() {
    emu_setmaxnreg(N, false);
}

// ---- TMA (attn_flash_wg3tma_*) ----------------------------------------------------------
// Emulated from the CUDA driver API (cuTensorMapEncodeTiled: parameter requirements) and
// the PTX ISA ("Tensors": tiled mode, bounding box, out-of-bound elements zero-filled,
// swizzle modes; "cp.async.bulk.tensor" with .mbarrier::complete_tx::bytes; "mbarrier":
// expect-tx and tx-count). The emulated map keeps its parameters in the opaque words;
// a copy lands at once, as the 16-byte chunks of the 128-byte swizzle of the destination's
// absolute shared address (chunk bits [4,7) ^= bits [7,10)), tagged with the mbarrier and
// its current phase and marked as async-proxy data (a wgmma needs its warpgroup's wait
// for that phase, no fence.proxy.async), then completes the box's bytes on the mbarrier
// (out-of-bound elements count: the box is always whole).
struct alignas(64) FwTmap {
    unsigned long long opaque[16];
};
constexpr unsigned long long EMU_TMAP_MAGIC = 0x544d4150454d55ull;

// cuTensorMapEncodeTiled for what the kernels use: rank 2, element size esize bytes,
// interleave none, element strides 1, swizzle 0 (none) or 3 (128 B). Returns false (the
// driver's CUDA_ERROR_INVALID_VALUE) where the documented requirements fail.
inline bool emu_tmap_encode_tiled(FwTmap* m, int esize, const void* base, const unsigned long long dim[2],
                                  const unsigned long long stride1, const unsigned box[2], int swizzle) {
    if ((uintptr_t)m % 64 || (uintptr_t)base % 16) return false;
    if (!dim[0] || !dim[1] || dim[0] > (1ull << 32) || dim[1] > (1ull << 32)) return false;
    if (stride1 % 16 || stride1 >= (1ull << 40)) return false;
    if (!box[0] || !box[1] || box[0] > 256 || box[1] > 256 || (box[0] * esize) % 16) return false;
    if (swizzle == 3 && box[0] * esize > 128) return false;
    std::memset(m, 0, sizeof *m);
    m->opaque[0] = EMU_TMAP_MAGIC;
    m->opaque[1] = (unsigned long long)(uintptr_t)base;
    m->opaque[2] = dim[0];
    m->opaque[3] = dim[1];
    m->opaque[4] = stride1;
    m->opaque[5] = box[0];
    m->opaque[6] = box[1];
    m->opaque[7] = (unsigned long long)esize;
    m->opaque[8] = (unsigned long long)swizzle;
    return true;
}

inline void fw_tma_prefetch(const FwTmap* m) {
    if (m->opaque[0] != EMU_TMAP_MAGIC) emu_fail("prefetch.tensormap of a tensor map that was not encoded");
}

inline void fw_mbar_expect_tx(unsigned bar, unsigned bytes) {
    EmuMbar& m = emu_mbar_at(bar);
    if (bytes >= (1u << 20)) emu_fail("expect_tx count out of range");
    m.tx += bytes;
    emu_mbar_arrive(m);
}

inline void fw_tma_load_2d(unsigned dst, const FwTmap* map, int c0, int c1, unsigned bar) {
    if (map->opaque[0] != EMU_TMAP_MAGIC) emu_fail("TMA with a tensor map that was not encoded");
    EmuMbar& m = emu_mbar_at(bar);
    const char* base = (const char*)(uintptr_t)map->opaque[1];
    const long long d0 = (long long)map->opaque[2], d1 = (long long)map->opaque[3];
    const unsigned long long st1 = map->opaque[4];
    const int b0 = (int)map->opaque[5], b1 = (int)map->opaque[6], es = (int)map->opaque[7];
    const int swz = (int)map->opaque[8];
    const int rowb = b0 * es;
    if (swz != 3 || rowb != 128) emu_fail("TMA: only 128-byte swizzle with 128-byte box rows is emulated");
    if (dst % 1024) emu_fail("TMA destination not 1024-byte aligned (128-byte swizzle atom)");
    const unsigned bytes = (unsigned)(rowb * b1);
    if (dst + bytes > emu.smem.size()) emu_fail("TMA destination out of shared memory");
    emu_land_bar = m.id;
    emu_land_ph = m.phase;
    for (int r = 0; r < b1; ++r)
        for (int ch = 0; ch < rowb / 16; ++ch) {
            const unsigned a = dst + (unsigned)(r * rowb + ch * 16);
            const unsigned sa = a ^ (((a >> 7) & 7) << 4);
            unsigned char buf[16];
            for (int e = 0; e < 16 / es; ++e) {
                const long long g0 = (long long)c0 + ch * (16 / es) + e, g1 = (long long)c1 + r;
                if (g0 < 0 || g0 >= d0 || g1 < 0 || g1 >= d1)
                    std::memset(buf + e * es, 0, es);
                else
                    std::memcpy(buf + e * es, base + (size_t)g1 * st1 + (size_t)g0 * es, es);
            }
            std::memcpy(emu_dyn_smem + sa, buf, 16);
            if (emu_cp_hook) emu_cp_hook(sa, 16);
            for (int b = 0; b < 16; ++b) emu_wg_tag_async[sa + b] = 1;
        }
    emu_land_bar = -1;
    ++emu_epoch;
    m.tx -= bytes;
    if (m.tx < 0 && m.pending == m.expected)
        emu_fail("TMA completed more bytes than the phase expects (expect_tx count too small)");
    emu_mbar_maybe_complete(m);
}
