// Tensor-core flash attention for bf16 (attn::prefill_flash in cuda/attn.rs). Same contract
// as attn_prefill_* (attn.cu) and the CPU reference model::attention:
//   q: [tq, nh, HD] bf16, q_pos: [tq] i64; k, v: [n_kv, nkv, HD] bf16, kv_pos: [n_kv] i64 in
//   any order with any values; o: [tq, nh, HD] bf16. Query i of head h attends to key j of kv
//   head h / (nh / nkv) iff kv_pos[j] <= q_pos[i]; scale HD^-0.5; a query that sees no key
//   gets zeros.
//
// The method is FlashAttention-2 (T. Dao, 2023, Algorithm 1), written from the paper for this
// layout: each CTA owns a tile of BR queries of one head (BR / 16 warps × 16 rows; BR = 128
// or 64) and streams the key/value tiles of BC keys (64 or 32) through shared memory
// (cp.async, two stages: tile j + 1 is in flight while tile j is multiplied). Per tile and
// warp:
//   S = Q Kᵀ            mma.sync m16n8k16 bf16 → fp32, fragments by ldmatrix;
//   online softmax      fp32, in the log2 domain (scores times HD^-0.5 · log2 e, exp2);
//   O = diag(c) O + P V P rounded to bf16 straight from the S accumulators (the m16n8 C
//                       layout of two adjacent key octets is the m16k16 A layout), V
//                       fragments by ldmatrix.trans; O stays in fp32 registers.
// O is divided by the row sums once, after the last tile.
//
// Masking is by positions, not indices. attn_flash_tiles(_suffix) first reduce kv_pos per key tile to
// (min, max) and the suffix minimum over the following tiles; a CTA knows the (min, max) of
// its query positions, so it skips a tile whose smallest position exceeds its largest query
// position (no query sees any key), runs a tile whose largest position is at most its
// smallest query position (and that holds BC real keys) without a mask, and masks the
// rest per element (kv_pos[j] <= q_pos[i]). For a causal prefill at positions 0..T that
// skips every tile above the diagonal and masks only the two tiles on it.
//
// Split KV (for grids too small to fill the device: short query spans over long caches):
// gridDim.y = nsplit > 1 splits the key tiles of each (query tile, head) into nsplit
// contiguous ranges; each CTA writes its unnormalised fp32 O, its row maxima m (log2
// domain) and row sums l to a workspace, and attn_flash_combine merges the splits.
//
// Shared memory (dynamic, bytes; W = BR / 16 warps; LD = HD + 8 elements, a 16-byte pad per
// row so that the eight row addresses of an ldmatrix phase fall on distinct bank quads):
//   sQP [BR] i64 | sKP [2][BC] i64 | sRed [2][W] i64 | sQ [BR][LD] bf16 |
//   sK [2][BC][LD] bf16 | sV [2][BC][LD] bf16
// = (BR + 2·BC + 2·W)·8 + (BR + 4·BC)·LD·2 (attn.rs: flash_smem_bytes); 128 × 64 tiles:
// 204 928 for HD 256, 106 624 for HD 128, 57 472 for HD 64; 64 × 32 at HD 256: 102 464.
//
// Instances attn_flash_bf16_{HD}_{BR}x{BC}: HD 64: 128x64; HD 128: 128x64, 64x64;
// HD 256: 128x64, 64x32, 128x32 (attn.rs picks one per head dim; gpu_bench times them all).
#define FA_PAD 8
#define FA_TILE_THREADS 1024
#define FA_MAX_SPLIT 64
#define FA_I64_MAX 0x7fffffffffffffffLL
#define FA_I64_MIN (-0x7fffffffffffffffLL - 1)

__device__ __forceinline__ i64 fa_min64(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 fa_max64(i64 a, i64 b) { return a > b ? a : b; }

// <device-primitives> (PTX; the host emulator in tools/kernel-emu replaces this block)
__device__ __forceinline__ unsigned fa_smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global → shared, bypassing L1; ok = false writes 16 zero bytes (src not read).
__device__ __forceinline__ void fa_cp_async16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void fa_cp_async8(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void fa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void fa_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8×8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8; register i of
// lane l holds row l / 4, columns 2(l % 4), 2(l % 4) + 1 of matrix i (.trans: the transpose).
__device__ __forceinline__ void fa_ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void fa_ldsm_x4_t(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c (16×8 fp32) += a (16×16 bf16, row) · b (16×8 bf16, col). With g = lane / 4, t = lane % 4:
// a = {A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]}, b = {B[2t..][g], B[2t+8..][g]},
// c = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}; a pair's lower column in the low half.
__device__ __forceinline__ void fa_mma(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 2^x (ex2.approx: 2 ulp; -inf → +0).
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned fa_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
// </device-primitives>

// ---------------------------------------------------------------------------------------
// Key tile summary for key tiles of bc ≤ 64 keys: tiles = [3][ntk] i64, ntk = ceil(n_kv / bc):
//   tiles[t] = min, tiles[ntk + t] = max of kv_pos over the real keys of tile t;
//   tiles[2 ntk + t] = min over tiles t..ntk-1 of their minima (suffix minimum).
// attn_flash_tiles: grid ceil(ntk / 8), block 256, one warp per tile (n_kv ≥ 1); then
// attn_flash_tiles_suffix: one block of FA_TILE_THREADS.
extern "C" __global__ void __launch_bounds__(256)
    attn_flash_tiles(const i64* kv_pos, int n_kv, int bc, i64* tiles) {
    const int ntk = (n_kv + bc - 1) / bc;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (t >= ntk) return;  // whole warps leave together
    const int j0 = t * bc, j1 = min(n_kv, j0 + bc);
    i64 mn = FA_I64_MAX, mx = FA_I64_MIN;
    for (int j = j0 + lane; j < j1; j += 32) {
        const i64 p = kv_pos[j];
        mn = fa_min64(mn, p);
        mx = fa_max64(mx, p);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        mn = fa_min64(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fa_max64(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (lane == 0) {
        tiles[t] = mn;
        tiles[ntk + t] = mx;
    }
}

extern "C" __global__ void __launch_bounds__(FA_TILE_THREADS) attn_flash_tiles_suffix(int ntk, i64* tiles) {
    __shared__ i64 cm[FA_TILE_THREADS];
    const i64* tmin = tiles;
    i64* smin = tiles + 2 * ntk;
    const int tid = threadIdx.x;
    // Thread i owns tiles [a, b); scan the per-thread minima, then each thread walks its
    // own tiles backwards.
    const int per = (ntk + FA_TILE_THREADS - 1) / FA_TILE_THREADS;
    const int a = min(ntk, tid * per), b = min(ntk, a + per);
    i64 c = FA_I64_MAX;
    for (int t = a; t < b; ++t) c = fa_min64(c, tmin[t]);
    cm[tid] = c;
    __syncthreads();
    for (int off = 1; off < FA_TILE_THREADS; off <<= 1) {
        const i64 x = tid + off < FA_TILE_THREADS ? cm[tid + off] : FA_I64_MAX;
        __syncthreads();
        cm[tid] = fa_min64(cm[tid], x);
        __syncthreads();
    }
    i64 run = tid + 1 < FA_TILE_THREADS ? cm[tid + 1] : FA_I64_MAX;
    for (int t = b - 1; t >= a; --t) {
        run = fa_min64(run, tmin[t]);
        smin[t] = run;
    }
}

// First tile in [j, je) that some query of the CTA can see (tmin ≤ qmax), or je. Every warp
// computes the same answer (uniform control flow, no barrier needed).
__device__ __forceinline__ int fa_next_tile(const i64* tmin, const i64* smin, int j, int je, i64 qmax,
                                            int lane) {
    while (j < je) {
        if (smin[j] > qmax) return je;  // nothing visible at or after j
        const int jj = j + lane;
        const unsigned hit = __ballot_sync(0xffffffffu, jj < je && tmin[jj] <= qmax);
        if (hit) return j + __ffs((int)hit) - 1;
        j += 32;
    }
    return je;
}

// grid (ceil(tq / BR) · nh, nsplit), block 2·BR threads. blockIdx.x → (query tile, head):
// heads fastest, so the nh / nkv heads that share a kv head run side by side and reuse its
// K/V tiles from L2; query tiles from the last (for a causal prefill the longest) to the
// first. nsplit = 1: o gets the normalised output. nsplit > 1: split s = blockIdx.y covers
// key tiles [s·per, (s+1)·per), per = ceil(ntk / nsplit), and writes
//   wo [nsplit][tq·nh][HD] fp32 (unnormalised O), wml [nsplit][tq·nh][2] fp32 (m, l).
template <int HD, int BR, int BC>
__device__ __forceinline__ void attn_flash_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                const bf16* __restrict__ v, const i64* __restrict__ q_pos,
                                                const i64* __restrict__ kv_pos, const i64* __restrict__ tiles,
                                                bf16* __restrict__ o, float* __restrict__ wo,
                                                float* __restrict__ wml, int tq, int n_kv, int nh, int nkv,
                                                float scale_log2) {
    constexpr int W = BR / 16;          // warps, 16 query rows each
    constexpr int THREADS = 32 * W;
    constexpr int LD = HD + FA_PAD;     // shared row stride, elements
    constexpr int CH = HD / 8;          // 16-byte chunks per row
    constexpr int NT = HD / 8;          // n8 column tiles of O
    constexpr int ST = BC / 8;          // n8 key tiles of S
    static_assert(BR % 16 == 0 && BC % 16 == 0 && BC <= THREADS, "tile shape");
    static_assert((BR * CH) % THREADS == 0 && (BC * CH) % THREADS == 0, "loader shape");
    static_assert(((BR + 2 * BC + 2 * W) * 8) % 16 == 0, "sQ alignment");
    extern __shared__ __align__(16) unsigned char fa_smem[];
    i64* sQP = reinterpret_cast<i64*>(fa_smem);
    i64* sKP = sQP + BR;
    i64* sRed = sKP + 2 * BC;
    bf16* sQ = reinterpret_cast<bf16*>(sRed + 2 * W);
    bf16* sK = sQ + BR * LD;
    bf16* sV = sK + 2 * BC * LD;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nqt = (tq + BR - 1) / BR;
    const int qt = nqt - 1 - (int)(blockIdx.x / (unsigned)nh);
    const int h = (int)(blockIdx.x % (unsigned)nh);
    const int kh = h / (nh / nkv);
    const int q0 = qt * BR;
    const int ntk = (n_kv + BC - 1) / BC;
    const int nsplit = gridDim.y;
    const int per = (ntk + nsplit - 1) / nsplit;
    const int jb = min(ntk, (int)blockIdx.y * per), je = min(ntk, jb + per);
    const i64* tmin = tiles;
    const i64* tmax = tiles + ntk;
    const i64* smin = tiles + 2 * ntk;

    // Q tile → shared (rows past tq are zeros); query positions (rows past tq: I64_MIN, so
    // a masked tile hides every key from them) and their min / max over the real rows.
#pragma unroll
    for (int i = 0; i < BR * CH / THREADS; ++i) {
        const int c = tid + i * THREADS;
        const int r = c / CH, cc = c % CH;
        const bool ok = q0 + r < tq;
        const bf16* src = q + (ok ? ((size_t)(q0 + r) * nh + h) * HD + cc * 8 : 0);
        fa_cp_async16(fa_smem_u32(sQ + r * LD + cc * 8), src, ok);
    }
    fa_cp_commit();
    i64 mn = FA_I64_MAX, mx = FA_I64_MIN;
    if (tid < BR) {
        const bool ok = q0 + tid < tq;
        const i64 p = ok ? q_pos[q0 + tid] : FA_I64_MIN;
        sQP[tid] = p;
        if (ok) {
            mn = p;
            mx = p;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        mn = fa_min64(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fa_max64(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (lane == 0) {
        sRed[warp] = mn;
        sRed[W + warp] = mx;
    }
    __syncthreads();
    i64 qmin = sRed[0], qmax = sRed[W];
#pragma unroll
    for (int w = 1; w < W; ++w) {
        qmin = fa_min64(qmin, sRed[w]);
        qmax = fa_max64(qmax, sRed[W + w]);
    }
    // This thread's two rows (accumulator rows g and g + 8 of its warp).
    const int row0 = warp * 16 + (lane >> 2);
    const i64 qp0 = sQP[row0], qp1 = sQP[row0 + 8];
    // A warp whose 16 rows are all past tq skips the arithmetic (not the loads / barriers).
    const bool active = q0 + warp * 16 < tq;

    // Key/value tile j → stage st (rows past n_kv are zeros; their positions I64_MAX).
    auto load_kv = [&](int j, int st) {
        const int j0 = j * BC;
        bf16* dk = sK + st * BC * LD;
        bf16* dv = sV + st * BC * LD;
#pragma unroll
        for (int i = 0; i < BC * CH / THREADS; ++i) {
            const int c = tid + i * THREADS;
            const int r = c / CH, cc = c % CH;
            const bool ok = j0 + r < n_kv;
            const size_t off = ok ? ((size_t)(j0 + r) * nkv + kh) * HD + cc * 8 : 0;
            fa_cp_async16(fa_smem_u32(dk + r * LD + cc * 8), k + off, ok);
            fa_cp_async16(fa_smem_u32(dv + r * LD + cc * 8), v + off, ok);
        }
        if (tid < BC) {
            i64* d = sKP + st * BC + tid;
            if (j0 + tid < n_kv)
                fa_cp_async8(fa_smem_u32(d), kv_pos + j0 + tid);
            else
                *d = FA_I64_MAX;
        }
    };

    // Per-lane byte offsets of the ldmatrix row addresses (m = lane / 8 picks the matrix):
    //   Q (A of S = Q Kᵀ): matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15), row-block first;
    //   K (B, stored [key][d]): (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), …
    //     → b of key octet 2np in regs 0-1, of 2np + 1 in regs 2-3;
    //   V (B of O = P V, stored [key][d], .trans): (keys 0-7 | 8-15) × (d 0-7 | 8-15), key
    //     block first → b of column octet 2np in regs 0-1, of 2np + 1 in regs 2-3.
    const int lr = lane & 7, lm = lane >> 3;
    const unsigned q_off = (unsigned)(((warp * 16 + lr + (lm & 1) * 8) * LD + (lm >> 1) * 8) * 2);
    const unsigned k_off = (unsigned)(((lr + (lm >> 1) * 8) * LD + (lm & 1) * 8) * 2);
    const unsigned v_off = (unsigned)(((lr + (lm & 1) * 8) * LD + (lm >> 1) * 8) * 2);
    const unsigned sQa = fa_smem_u32(sQ), sKa = fa_smem_u32(sK), sVa = fa_smem_u32(sV);

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    int j = fa_next_tile(tmin, smin, jb, je, qmax, lane);
    if (j < je) load_kv(j, 0);
    fa_cp_commit();
    fa_cp_wait_all();
    __syncthreads();
    int st = 0;
    while (j < je) {
        const int jn = fa_next_tile(tmin, smin, j + 1, je, qmax, lane);
        if (jn < je) load_kv(jn, st ^ 1);  // stage st ^ 1 was released by the last barrier
        fa_cp_commit();
        const int nvalid = n_kv - j * BC;  // real keys in this tile (≥ 1)
        const bool full = nvalid >= BC && tmax[j] <= qmin;
        if (active) {
            // S = Q Kᵀ (raw scores), 16 rows × BC keys per warp.
            float s[ST][4];
#pragma unroll
            for (int n = 0; n < ST; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const unsigned kb = sKa + (unsigned)(st * BC * LD * 2);
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[4];
                fa_ldsm_x4(a, sQa + q_off + kk * 32);
#pragma unroll
                for (int np = 0; np < BC / 16; ++np) {
                    unsigned b[4];
                    fa_ldsm_x4(b, kb + k_off + np * 16 * LD * 2 + kk * 32);
                    fa_mma(s[2 * np], a, b);
                    fa_mma(s[2 * np + 1], a, b + 2);
                }
            }
            // Scale into the log2 domain; mask by positions unless the tile is fully visible.
            const i64* kp = sKP + st * BC;
#pragma unroll
            for (int n = 0; n < ST; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
                if (!full) {
                    const int c = n * 8 + 2 * (lane & 3);
                    const i64 p0 = kp[c], p1 = kp[c + 1];
                    const bool v0 = c < nvalid, v1 = c + 1 < nvalid;
                    if (!v0 || p0 > qp0) s[n][0] = NEG_INF;
                    if (!v1 || p1 > qp0) s[n][1] = NEG_INF;
                    if (!v0 || p0 > qp1) s[n][2] = NEG_INF;
                    if (!v1 || p1 > qp1) s[n][3] = NEG_INF;
                }
            }
            // Online softmax for rows g (m0, l0) and g + 8 (m1, l1); a row's four lanes
            // (lane / 4 equal) share its maximum; l stays a per-lane partial sum.
            float r0 = NEG_INF, r1 = NEG_INF;
#pragma unroll
            for (int n = 0; n < ST; ++n) {
                r0 = fmaxf(r0, fmaxf(s[n][0], s[n][1]));
                r1 = fmaxf(r1, fmaxf(s[n][2], s[n][3]));
            }
            r0 = fmaxf(r0, __shfl_xor_sync(0xffffffffu, r0, 1));
            r0 = fmaxf(r0, __shfl_xor_sync(0xffffffffu, r0, 2));
            r1 = fmaxf(r1, __shfl_xor_sync(0xffffffffu, r1, 1));
            r1 = fmaxf(r1, __shfl_xor_sync(0xffffffffu, r1, 2));
            const float n0 = fmaxf(m0, r0), n1 = fmaxf(m1, r1);
            // Subtract 0 while a row has seen nothing (n = -inf): p = 2^-inf = 0, no NaN.
            const float b0 = n0 == NEG_INF ? 0.f : n0, b1 = n1 == NEG_INF ? 0.f : n1;
            const float c0 = fa_exp2(m0 - b0), c1 = fa_exp2(m1 - b1);
            m0 = n0;
            m1 = n1;
            float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
            for (int n = 0; n < ST; ++n) {
                s[n][0] = fa_exp2(s[n][0] - b0);
                s[n][1] = fa_exp2(s[n][1] - b0);
                s[n][2] = fa_exp2(s[n][2] - b1);
                s[n][3] = fa_exp2(s[n][3] - b1);
                ls0 += s[n][0] + s[n][1];
                ls1 += s[n][2] + s[n][3];
            }
            l0 = l0 * c0 + ls0;
            l1 = l1 * c1 + ls1;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                acc[n][0] *= c0;
                acc[n][1] *= c0;
                acc[n][2] *= c1;
                acc[n][3] *= c1;
            }
            // O += P V: P (bf16) from the accumulators of key octets 2kk, 2kk + 1.
            const unsigned vb = sVa + (unsigned)(st * BC * LD * 2);
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                unsigned a[4];
                a[0] = fa_pack(s[2 * kk][0], s[2 * kk][1]);
                a[1] = fa_pack(s[2 * kk][2], s[2 * kk][3]);
                a[2] = fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int np = 0; np < HD / 16; ++np) {
                    unsigned b[4];
                    fa_ldsm_x4_t(b, vb + v_off + kk * 16 * LD * 2 + np * 32);
                    fa_mma(acc[2 * np], a, b);
                    fa_mma(acc[2 * np + 1], a, b + 2);
                }
            }
        }
        fa_cp_wait_all();
        __syncthreads();  // tile jn landed for everyone; stage st free for the next load
        j = jn;
        st ^= 1;
    }

    // Row sums over the four lanes of each row.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int g0 = q0 + row0, g1 = g0 + 8;  // global query rows
    const int col = 2 * (lane & 3);
    if (nsplit == 1) {
        const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
        if (g0 < tq) {
            bf16* d = o + ((size_t)g0 * nh + h) * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<__nv_bfloat162*>(d + n * 8) =
                    __floats2bfloat162_rn(acc[n][0] * i0, acc[n][1] * i0);
        }
        if (g1 < tq) {
            bf16* d = o + ((size_t)g1 * nh + h) * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<__nv_bfloat162*>(d + n * 8) =
                    __floats2bfloat162_rn(acc[n][2] * i1, acc[n][3] * i1);
        }
    } else {
        const size_t rows = (size_t)tq * nh;
        const size_t sp = (size_t)blockIdx.y * rows;
        if (g0 < tq) {
            const size_t r = sp + (size_t)g0 * nh + h;
            float* d = wo + r * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<float2*>(d + n * 8) = make_float2(acc[n][0], acc[n][1]);
            if ((lane & 3) == 0) *reinterpret_cast<float2*>(wml + r * 2) = make_float2(m0, l0);
        }
        if (g1 < tq) {
            const size_t r = sp + (size_t)g1 * nh + h;
            float* d = wo + r * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<float2*>(d + n * 8) = make_float2(acc[n][2], acc[n][3]);
            if ((lane & 3) == 0) *reinterpret_cast<float2*>(wml + r * 2) = make_float2(m1, l1);
        }
    }
}

// MINB: CTAs per multiprocessor the register budget is sized for (shared memory permitting).
#define ATTN_FLASH(HD, BR, BC, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(2 * BR, MINB) attn_flash_bf16_##HD##_##BR##x##BC(   \
        const bf16* q, const bf16* k, const bf16* v, const i64* q_pos, const i64* kv_pos,             \
        const i64* tiles, bf16* o, float* wo, float* wml, int tq, int n_kv, int nh, int nkv,          \
        float scale_log2) {                                                                           \
        attn_flash_impl<HD, BR, BC>(q, k, v, q_pos, kv_pos, tiles, o, wo, wml, tq, n_kv, nh, nkv,     \
                                    scale_log2);                                                      \
    }
ATTN_FLASH(64, 128, 64, 2)
ATTN_FLASH(128, 128, 64, 2)
ATTN_FLASH(128, 64, 64, 2)
ATTN_FLASH(256, 128, 64, 1)
ATTN_FLASH(256, 64, 32, 2)
ATTN_FLASH(256, 128, 32, 1)

// Merge of the nsplit partial results of attn_flash_bf16_* (gridDim.y = nsplit):
// o[r] = Σ_s 2^(m_s − M) O_s / Σ_s 2^(m_s − M) l_s with M = max_s m_s, over the rows
// r = t·nh + h; a row no split saw anything for (every m_s = -inf) gets zeros.
// grid (tq·nh), block 128; nsplit ≤ FA_MAX_SPLIT.
extern "C" __global__ void __launch_bounds__(128)
    attn_flash_combine_bf16(const float* wo, const float* wml, bf16* o, int rows, int hd, int nsplit) {
    __shared__ float sw[FA_MAX_SPLIT];
    __shared__ float sinv;
    const size_t r = blockIdx.x;
    const int tid = threadIdx.x;
    if (tid < 32) {
        float mm = NEG_INF;
        for (int s = tid; s < nsplit; s += 32) mm = fmaxf(mm, wml[((size_t)s * rows + r) * 2]);
        mm = warp_max(mm);
        float ll = 0.f;
        for (int s = tid; s < nsplit; s += 32) {
            const float m = wml[((size_t)s * rows + r) * 2];
            const float w = m == NEG_INF ? 0.f : exp2f(m - mm);
            sw[s] = w;
            ll += w * wml[((size_t)s * rows + r) * 2 + 1];
        }
        ll = warp_sum(ll);
        if (tid == 0) sinv = ll > 0.f ? 1.f / ll : 0.f;
    }
    __syncthreads();
    const float inv = sinv;
    for (int c = tid; c < hd; c += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < nsplit; ++s) {
            const float w = sw[s];
            if (w != 0.f) a += w * wo[((size_t)s * rows + r) * hd + c];
        }
        o[r * hd + c] = __float2bfloat16_rn(a * inv);
    }
}
