// Chunked gated delta rule prefill on tensor cores, bf16 q/k/v (fp32 state).
//
// Same contract and algebra as the fp32 SIMT kernels of gdr.cu (which stay the f32
// path and the reference); CPU reference: dataplane/src/linear/gdr.rs. Host side:
// dataplane/src/cuda/gdr.rs (selects these kernels for bf16 inputs).
//
// Algorithm: Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
// Delta Rule" (the recurrence S_t = e^{g_t}(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ),
// chunked with the WY / UT-transform form of Yang et al. 2024, "Parallelizing Linear
// Transformers with the Delta Rule over Sequence Length". Per chunk of 64 tokens, with
// chunk-local cumulative log decay G_i = Σ_{j≤i} g_j and chunk-initial state S:
//   L  = strictly-lower(β_i e^{G_i−G_j} k_i·k_j),  M = (I + L)⁻¹
//   W  = M diag(β e^G) K,  U = M diag(β) V          (prep, parallel over chunks)
//   Ũ  = U − W S;  S' = e^{G_c} S + K̃ᵀ Ũ,  K̃_i = e^{G_c−G_i} k_i   (state, sequential)
//   O  = diag(e^G) Q S + (Q Kᵀ ⊙ e^{G_i−G_m})_{m≤i} Ũ                (output, parallel)
// All products run as mma.sync m16n8k16 (bf16 operands, fp32 accumulation); the state S
// is accumulated in fp32 registers and rounded to bf16 only as an mma operand; M is
// solved in fp32. bf16-rounded intermediates (as FLA's kernels): W, U, K̃, Ũ, the
// per-chunk state snapshots, P. Relative L2 error against the fp64 recurrence in the
// host emulation (tools/gdr-tc-emu): 2–5e-3 on output and state for T ≤ 4096, T_C up to
// ~1.3e-2 at T = 4096 (rounding errors of all chunks add up in the product).
//
// Fragment tiles ("F-tiles"). A 16×16 bf16 block X is stored as 32 lanes × uint4, lane
// (g = lane/4, q = lane%4) holding four bf16 pairs (low half = lower column), in one of
// two orders:
//   A order { X[g][2q..2q+1], X[g+8][2q..], X[g][2q+8..], X[g+8][2q+8..] } — the mma A
//           fragment of X; as a B operand (X rows = n, columns = k) n-tile 0 (rows 0–7)
//           is (.x, .z) and n-tile 1 is (.y, .w);
//   B order { X[g][2q..2q+1], X[g][2q+8..], X[g+8][2q..], X[g+8][2q+8..] } — B operands
//           (.x, .y) and (.z, .w) as loaded (register pairs, no moves).
// Two adjacent n8 accumulator tiles (columns 0–7, 8–15) of an m16 tile pack into either
// without data movement between lanes. An R×C matrix is a row-major grid of such blocks
// (block (rb, cb) at ((rb·C/16 + cb)·32 + lane) uint4s). Per (value head h, chunk n),
// "tile" = h·NT + n:
//   Wf  [tile][4 i-blocks][8 c-blocks]   W, B order           (64 × 128)   16 KiB
//   Ktf [tile][8 c-blocks][4 i-blocks]   K̃ᵀ, B order          (128 × 64)   16 KiB
//   Uf  [tile][8 j-blocks][4 i-blocks]   Uᵀ then Ũᵀ, A order  (128 × 64)   16 KiB
//   Hsf [tile][8 j-blocks][8 c-blocks]   chunk-initial Sᵀ, A order (128 × 128) 32 KiB
// (W and K̃ᵀ are B operands of the sequential state kernel; Ũᵀ and Sᵀ are produced there
// as A fragments, and read as B operands by the parallel output kernel.)
//   gcum [Hv][NT·64] fp32 G (rows past the sequence end repeat the last G)
// Rows of a partial last chunk are zero in W, U, K̃ (their β and k are zero).
//
// Three kernels: A' gdr_prep_tc2_bf16 (M in place, off-diagonal blocks on tensor cores
// with hi/lo-split operands, 53 KiB, ≤ 64 registers), B gdr_state_tc_bf16_32 and C'
// gdr_output_tc2_bf16 (≤ 64 registers, P shared through shared memory). Earlier versions
// measured beside them (A: M solved in fp32 SIMT; B with 64 value columns per block or
// split over the state rows; C with 128 registers) were retired.
//
// Layouts of the inputs and outputs (as gdr.cu): q, k [T, Hk, 128] bf16, v [T, Hv, 128]
// bf16, g, beta [T, Hv] fp32, state [Hv, 128, 128] fp32 K-major, trans [Hv, 128, 128]
// fp32 row-major, o [T, Hv, 128] bf16. Value head h reads key head h / (Hv/Hk).

#define TC_CH 64     // chunk length
#define TC_D 128     // dk = dv
#define TC_LD 136    // bf16 row stride of 64×128 staging tiles: 272 B (ldmatrix rows 16-B
                     // aligned; 32-bit fragment loads and ldmatrix phases conflict-free)
#define TC_ALD 72    // bf16 row stride of the 64×64 staging tiles (144 B, same properties)
#define TC_FLUSH 9.094947e-13f  // transition entries below 2^-40 → 0 (linear::gdr FLUSH_UNIT)

// ---------------------------------------------------------------------------------------
// Warp-level primitives (inline PTX). HYPIC_HOST_EMU: a host build supplies its own.
#ifndef HYPIC_HOST_EMU
// c += a·b, m16n8k16, row.col, bf16 in, fp32 accumulate. a: A fragment (4 regs), b0/b1:
// B fragment (k 2q..2q+1 / 2q+8.. of column g).
__device__ __forceinline__ void tc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane l gives the address of row
// (l & 7) of 8×8 matrix (l >> 3) (16 contiguous bytes); register i of lane (g, q)
// receives elements (row 2q, column g) (low half) and (2q+1, g) (high) of matrix i.
__device__ __forceinline__ void tc_ldsm_x4_trans(unsigned* f, const bf16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                 : "r"(a)
                 : "memory");
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (no transpose): lane l gives the address of
// row (l & 7) of 8×8 matrix (l >> 3); register i of lane (g, q) receives elements
// (row g, columns 2q, 2q+1) of matrix i.
__device__ __forceinline__ void tc_ldsm_x4(unsigned* f, const bf16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                 : "r"(a)
                 : "memory");
}
// Prefetch of the 128-byte line holding p into L2.
__device__ __forceinline__ void tc_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// Asynchronous global → shared copies: 16 bytes bypassing L1 (cp.async.cg), 4 bytes
// (cp.async.ca); commit of the copies issued so far as one group; wait until at most
// N groups are pending.
__device__ __forceinline__ void tc_cp16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void tc_cp4(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// Dynamic shared memory of all kernels (carved per kernel).
extern __shared__ uint4 tc_sm[];

// ---------------------------------------------------------------------------------------
// Small helpers.
__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float2 tc_unpack(unsigned u) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&u);
    return __bfloat1622float2(v);
}
__device__ __forceinline__ unsigned tc_ld32(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }
// F-tile block (B order) of the transpose of a 16×16 block of a row-major bf16 matrix X
// in shared memory: rows m0..m0+15 of Xᵀ (columns of X), columns k0..k0+15 of Xᵀ (rows
// of X). The four 8×8 matrices at X rows/columns (k0, m0), (k0+8, m0), (k0, m0+8),
// (k0+8, m0+8) give .x, .y, .z, .w.
__device__ __forceinline__ void tc_ldsm_t(unsigned* f, const bf16* X, int ld, int k0, int m0, int lane) {
    const int mi = lane >> 3, r = lane & 7;
    tc_ldsm_x4_trans(f, X + (k0 + r + 8 * (mi & 1)) * ld + m0 + 8 * (mi >> 1));
}
// mma A fragment of the 16×16 block of a row-major bf16 matrix X at (r0, c0) (plain
// 32-bit loads): { X[g][2q..], X[g+8][2q..], X[g][2q+8..], X[g+8][2q+8..] }.
__device__ __forceinline__ void tc_frag(unsigned* f, const bf16* X, int ld, int r0, int c0, int lane) {
    const bf16* p = X + (r0 + (lane >> 2)) * ld + c0 + 2 * (lane & 3);
    f[0] = tc_ld32(p);
    f[1] = tc_ld32(p + 8 * ld);
    f[2] = tc_ld32(p + 8);
    f[3] = tc_ld32(p + 8 * ld + 8);
}
// mma A fragment of the 16×16 block of a row-major bf16 matrix X at (r0, c0) by one
// ldmatrix (as tc_frag): matrices (r0, c0), (r0+8, c0), (r0, c0+8), (r0+8, c0+8).
__device__ __forceinline__ void tc_ldsm_a(unsigned* f, const bf16* X, int ld, int r0, int c0, int lane) {
    tc_ldsm_x4(f, X + (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + c0 + 8 * (lane >> 4));
}
// F-tile block (B order) from two accumulator n8 tiles (columns 0–7 in c0, 8–15 in c1)
// of one m16 tile.
__device__ __forceinline__ uint4 tc_acc_tile(const float* c0, const float* c1) {
    return make_uint4(tc_pack(c0[0], c0[1]), tc_pack(c1[0], c1[1]), tc_pack(c0[2], c0[3]), tc_pack(c1[2], c1[3]));
}
// F-tile block (A order) / mma A fragment from the same two accumulator tiles.
__device__ __forceinline__ void tc_acc_afrag(unsigned* a, const float* c0, const float* c1) {
    a[0] = tc_pack(c0[0], c0[1]);
    a[1] = tc_pack(c0[2], c0[3]);
    a[2] = tc_pack(c1[0], c1[1]);
    a[3] = tc_pack(c1[2], c1[3]);
}
// Loads rows [t0, t0 + len) of one head of a [T, H, 128] bf16 tensor into a 64×128 shared
// tile (row stride TC_LD); rows ≥ len are zero. 256 threads.
__device__ __forceinline__ void tc_load_rows(bf16* dst, const bf16* src, int t0, int len, int nh, int hd, int tid) {
    uint4 x[4];
#pragma unroll
    for (int it = 0; it < 4; ++it) {
        const int idx = tid + 256 * it, i = idx >> 4, c8 = idx & 15;
        x[it] = i < len ? *reinterpret_cast<const uint4*>(src + ((size_t)(t0 + i) * nh + hd) * TC_D + c8 * 8)
                        : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int it = 0; it < 4; ++it) {
        const int idx = tid + 256 * it, i = idx >> 4, c8 = idx & 15;
        *reinterpret_cast<uint4*>(dst + i * TC_LD + c8 * 8) = x[it];
    }
}

// tc_load_rows by cp.async (no staging registers; the caller commits and waits): rows
// ≥ len are zeroed by plain stores.
__device__ __forceinline__ void tc_load_rows_async(bf16* dst, const bf16* src, int t0, int len, int nh, int hd,
                                                   int tid) {
#pragma unroll
    for (int it = 0; it < 4; ++it) {
        const int idx = tid + 256 * it, i = idx >> 4, c8 = idx & 15;
        if (i < len)
            tc_cp16(dst + i * TC_LD + c8 * 8, src + ((size_t)(t0 + i) * nh + hd) * TC_D + c8 * 8);
        else
            *reinterpret_cast<uint4*>(dst + i * TC_LD + c8 * 8) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// ---------------------------------------------------------------------------------------
// A' gdr_prep_tc2_bf16: grid (Hv, NT) (value heads fastest: the heads sharing a key head
// read its K chunk back to back, from L2), block 256 (8 warps). Per (chunk, head): G, β;
// L from K Kᵀ (mma); M = (I + L)⁻¹; W = (M diag(βe^G)) K and Uᵀ = Vᵀ (M diag(β))ᵀ (mma);
// K̃ᵀ. Writes gcum, Wf, Ktf, Uf. In 53 KiB of shared memory and ≤ 64 registers per
// thread, so that four blocks share an SM. One fp32 64×64 buffer (row stride
// TC_MLD) holds L in its lower blocks; M = (I + L)⁻¹ is solved into the same buffer:
// M_ab (16×16 block, a ≥ b) is stored row-major at block position (b, a) — the diagonal
// blocks over L_aa, the off-diagonal ones in the unused upper triangle — so no L block is
// overwritten while still needed and no second buffer is needed. W and U take their
// mma fragments of M diag(βe^G) and M diag(β) straight from the fp32 M (no bf16 copies).
// The off-diagonal blocks run on tensor cores with operands split into bf16 hi + lo
// (three mma per product: hi·hi + hi·lo + lo·hi, ~16 significant bits, fp32
// accumulation): round d = 1, 2, 3, warp j computes M_ij (i = j + d) as
//   Xᵀ = Σ_{k=j}^{i−1} M_kjᵀ L_ikᵀ  (accumulators),  M_ij = −M_ii X  (X as B fragments),
// one barrier per round. Warps 2–7 write K̃ᵀ while warps 0–1 solve the
// 16×16 diagonal blocks.
#define TC_MLD 72  // fp32 row stride of L / M (float2 fragment loads and stores conflict-free)
#define TC_PREP2_SMEM (2 * TC_CH * TC_LD * 2 + TC_CH * TC_MLD * 4 + 3 * TC_CH * 4)

// bf16 hi/lo split of two floats (a, b): hi = bf16(a, b), lo = bf16(a − hi, b − hi).
__device__ __forceinline__ void tc_split(float a, float b, unsigned& hi, unsigned& lo) {
    hi = tc_pack(a, b);
    const float2 h = tc_unpack(hi);
    lo = tc_pack(a - h.x, b - h.y);
}
// c += a·b to ~fp32 accuracy from split operands (hi·hi + hi·lo + lo·hi).
__device__ __forceinline__ void tc_mma3(float* c, const unsigned* ah, const unsigned* al, unsigned bh0, unsigned bh1,
                                        unsigned bl0, unsigned bl1) {
    tc_mma(c, al, bh0, bh1);
    tc_mma(c, ah, bl0, bl1);
    tc_mma(c, ah, bh0, bh1);
}

extern "C" __global__ void __launch_bounds__(256, 4)
    gdr_prep_tc2_bf16(const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g,
                      const float* __restrict__ beta, float* __restrict__ gcum, uint4* __restrict__ Wf,
                      uint4* __restrict__ Ktf, uint4* __restrict__ Uf, int t_len, int hk, int hv) {
    bf16* Ks = reinterpret_cast<bf16*>(tc_sm);                // [64][TC_LD]
    bf16* Vs = Ks + TC_CH * TC_LD;                             // [64][TC_LD]
    float* Ls = reinterpret_cast<float*>(Vs + TC_CH * TC_LD);  // [64][TC_MLD] L, then M
    float* G = Ls + TC_CH * TC_MLD;                            // [64]
    float* Bt = G + TC_CH;                                     // [64] β
    float* Eb = Bt + TC_CH;                                    // [64] β e^G
    const int h = blockIdx.x, n = blockIdx.y, kh = h / (hv / hk), tid = threadIdx.x;
    const int lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int nt = (t_len + TC_CH - 1) / TC_CH;
    const int t0 = n * TC_CH, len = min(TC_CH, t_len - t0);
    const size_t tile = (size_t)h * nt + n;
    // K and V by cp.async, two groups (V is first read by the U product).
    tc_load_rows_async(Ks, k, t0, len, hk, kh, tid);
    tc_cp_commit();
    tc_load_rows_async(Vs, v, t0, len, hv, h, tid);
    tc_cp_commit();
    if (w == 0) {
        // Inclusive scan of g over the chunk (2 tokens per lane; zero past the end).
        const int i0 = 2 * lane, i1 = i0 + 1;
        const float a = i0 < len ? g[(size_t)(t0 + i0) * hv + h] : 0.f;
        const float b = i1 < len ? g[(size_t)(t0 + i1) * hv + h] : 0.f;
        float s = a + b;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        const float b0 = i0 < len ? beta[(size_t)(t0 + i0) * hv + h] : 0.f;
        const float b1 = i1 < len ? beta[(size_t)(t0 + i1) * hv + h] : 0.f;
        G[i0] = s - b;
        G[i1] = s;
        Bt[i0] = b0;
        Bt[i1] = b1;
        Eb[i0] = b0 * expf(s - b);
        Eb[i1] = b1 * expf(s);
    }
    tc_cp_wait<1>();  // K landed (V may still be in flight until the W / U products)
    __syncthreads();
    if (tid < TC_CH) gcum[tile * TC_CH + tid] = G[tid];
    // L = β_i e^{G_i−G_m} (K Kᵀ)_im for m < i (0 for m ≥ i in the diagonal blocks).
    // Warp: rows 16·mt.., n-tiles 4·nh..4·nh+3 (those with some m ≤ i).
    {
        const int mt = w >> 1, nh = w & 1;
        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < TC_D / 16; ++kc) {
            unsigned a[4];
            tc_frag(a, Ks, TC_LD, 16 * mt, 16 * kc, lane);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int nt8 = 4 * nh + j;
                if (nt8 <= 2 * mt + 1) {  // warp-uniform
                    const bf16* p = Ks + (8 * nt8 + gq) * TC_LD + 16 * kc + 2 * tq;
                    tc_mma(acc[j], a, tc_ld32(p), tc_ld32(p + 8));
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int nt8 = 4 * nh + j;
            if (nt8 <= 2 * mt + 1) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int i = 16 * mt + gq + 8 * hh, m = 8 * nt8 + 2 * tq;
                    const float bi = Bt[i], gi = G[i];
                    float2 x;
                    x.x = m < i ? bi * expf(gi - G[m]) * acc[j][2 * hh] : 0.f;
                    x.y = m + 1 < i ? bi * expf(gi - G[m + 1]) * acc[j][2 * hh + 1] : 0.f;
                    *reinterpret_cast<float2*>(Ls + i * TC_MLD + m) = x;
                }
            }
        }
    }
    __syncthreads();
    if (tid < TC_CH) {
        // M_bb = (I + L_bb)⁻¹: thread solves column c of diagonal block b by forward
        // substitution and writes it over L_bb once the block's 16 lanes (one half-warp)
        // have read L_bb. Blocks (0, 1) in warp 0 and (2, 3) in warp 1: two addresses
        // 16 banks apart per load.
        const int o = 16 * (tid >> 4), c = tid & 15;
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            float s = r == c ? 1.f : 0.f;
#pragma unroll
            for (int r2 = 0; r2 < r; ++r2) s -= Ls[(o + r) * TC_MLD + o + r2] * x[r2];
            x[r] = s;
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 16; ++r) Ls[(o + r) * TC_MLD + o + c] = x[r];
    } else {
        // K̃ᵀ (warps 2–7 over the 8 c-blocks): K̃_i = e^{G_last − G_i} k_i.
        const float gl = G[TC_CH - 1];
        for (int cb = w - 2; cb < TC_D / 16; cb += 6) {
            uint4* dst = Ktf + (tile * 32 + cb * 4) * 32 + lane;
#pragma unroll
            for (int ib = 0; ib < 4; ++ib) {
                unsigned f[4];
                tc_ldsm_t(f, Ks, TC_LD, 16 * ib, 16 * cb, lane);  // F(Kᵀ block (cb, ib))
                const int i0 = 16 * ib + 2 * tq;                   // .x/.z: i0, i0+1; .y/.w: i0+8, i0+9
                const float s0 = expf(gl - G[i0]), s1 = expf(gl - G[i0 + 1]);
                const float s2 = expf(gl - G[i0 + 8]), s3 = expf(gl - G[i0 + 9]);
                const float2 x0 = tc_unpack(f[0]), x1 = tc_unpack(f[1]), x2 = tc_unpack(f[2]), x3 = tc_unpack(f[3]);
                dst[ib * 32] = make_uint4(tc_pack(x0.x * s0, x0.y * s1), tc_pack(x1.x * s2, x1.y * s3),
                                          tc_pack(x2.x * s0, x2.y * s1), tc_pack(x3.x * s2, x3.y * s3));
            }
        }
    }
    __syncthreads();
    // Off-diagonal blocks by distance d; warp j < 4 − d computes M_ij, i = j + d. Reads
    // L_ik (block (i, k)), M_kj (block (j, k)) for k − j < d and M_ii; writes block (j, i).
#pragma unroll 1
    for (int d = 1; d < 4; ++d) {
        if (w < 4 - d) {
            const int j = w, i = j + d;
            float xt[2][4];
#pragma unroll
            for (int e = 0; e < 4; ++e) xt[0][e] = xt[1][e] = 0.f;
#pragma unroll 1
            for (int kb = j; kb < i; ++kb) {
                // A = M_kjᵀ: {M[2q][g], M[2q+1][g]}, (g+8), (2q+8), both.
                const float* mb = Ls + (16 * j + 2 * tq) * TC_MLD + 16 * kb + gq;
                unsigned ah[4], al[4];
                tc_split(mb[0], mb[TC_MLD], ah[0], al[0]);
                tc_split(mb[8], mb[TC_MLD + 8], ah[1], al[1]);
                tc_split(mb[8 * TC_MLD], mb[9 * TC_MLD], ah[2], al[2]);
                tc_split(mb[8 * TC_MLD + 8], mb[9 * TC_MLD + 8], ah[3], al[3]);
                // B = L_ikᵀ: n-tile nt (X rows 8·nt + g): {L[8nt+g][2q..]}, {L[8nt+g][2q+8..]}.
#pragma unroll
                for (int nt2 = 0; nt2 < 2; ++nt2) {
                    const float* lb = Ls + (16 * i + 8 * nt2 + gq) * TC_MLD + 16 * kb + 2 * tq;
                    const float2 l0 = *reinterpret_cast<const float2*>(lb);
                    const float2 l1 = *reinterpret_cast<const float2*>(lb + 8);
                    unsigned bh0, bl0, bh1, bl1;
                    tc_split(l0.x, l0.y, bh0, bl0);
                    tc_split(l1.x, l1.y, bh1, bl1);
                    tc_mma3(xt[nt2], ah, al, bh0, bh1, bl0, bl1);
                }
            }
            // M_ij = −M_ii X: A = M_ii (row-major fp32 at block (i, i)), B = X from the
            // accumulators of Xᵀ (n-tile 0: X columns g → xt[·][0..1]; 1: g+8 → [2..3]).
            const float* db = Ls + (16 * i + gq) * TC_MLD + 16 * i + 2 * tq;
            unsigned ah[4], al[4];
            {
                const float2 d0 = *reinterpret_cast<const float2*>(db);
                const float2 d1 = *reinterpret_cast<const float2*>(db + 8 * TC_MLD);
                const float2 d2 = *reinterpret_cast<const float2*>(db + 8);
                const float2 d3 = *reinterpret_cast<const float2*>(db + 8 * TC_MLD + 8);
                tc_split(d0.x, d0.y, ah[0], al[0]);
                tc_split(d1.x, d1.y, ah[1], al[1]);
                tc_split(d2.x, d2.y, ah[2], al[2]);
                tc_split(d3.x, d3.y, ah[3], al[3]);
            }
            float mo[2][4];
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2) {
#pragma unroll
                for (int e = 0; e < 4; ++e) mo[nt2][e] = 0.f;
                unsigned bh0, bl0, bh1, bl1;
                tc_split(xt[0][2 * nt2], xt[0][2 * nt2 + 1], bh0, bl0);
                tc_split(xt[1][2 * nt2], xt[1][2 * nt2 + 1], bh1, bl1);
                tc_mma3(mo[nt2], ah, al, bh0, bh1, bl0, bl1);
            }
            float* ob = Ls + (16 * j + gq) * TC_MLD + 16 * i + 2 * tq;
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2) {
                *reinterpret_cast<float2*>(ob + 8 * nt2) = make_float2(-mo[nt2][0], -mo[nt2][1]);
                *reinterpret_cast<float2*>(ob + 8 * TC_MLD + 8 * nt2) = make_float2(-mo[nt2][2], -mo[nt2][3]);
            }
        }
        if (d == 3) tc_cp_wait<0>();  // V, before the barrier that precedes W and U
        __syncthreads();
    }
    // W = M diag(βe^G) K: warp rows 16·mt.., columns 64·ch.. (c-blocks 4·ch..4·ch+3);
    // A fragments from M_{mt,kk} (block (kk, mt)) scaled by βe^G of the columns.
    {
        const int mt = w & 3, ch = w >> 2;
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            if (kk <= mt) {
                const float* mb = Ls + (16 * kk + gq) * TC_MLD + 16 * mt + 2 * tq;
                const float2 e0 = *reinterpret_cast<const float2*>(Eb + 16 * kk + 2 * tq);
                const float2 e1 = *reinterpret_cast<const float2*>(Eb + 16 * kk + 2 * tq + 8);
                const float2 m0 = *reinterpret_cast<const float2*>(mb);
                const float2 m1 = *reinterpret_cast<const float2*>(mb + 8 * TC_MLD);
                const float2 m2 = *reinterpret_cast<const float2*>(mb + 8);
                const float2 m3 = *reinterpret_cast<const float2*>(mb + 8 * TC_MLD + 8);
                const unsigned a[4] = {tc_pack(m0.x * e0.x, m0.y * e0.y), tc_pack(m1.x * e0.x, m1.y * e0.y),
                                       tc_pack(m2.x * e1.x, m2.y * e1.y), tc_pack(m3.x * e1.x, m3.y * e1.y)};
#pragma unroll
                for (int qb = 0; qb < 4; ++qb) {
                    unsigned b[4];
                    tc_ldsm_t(b, Ks, TC_LD, 16 * kk, 16 * (4 * ch + qb), lane);  // F(Kᵀ block)
                    tc_mma(acc[2 * qb], a, b[0], b[1]);
                    tc_mma(acc[2 * qb + 1], a, b[2], b[3]);
                }
            }
        }
        uint4* dst = Wf + (tile * 32 + mt * 8 + 4 * ch) * 32 + lane;
#pragma unroll
        for (int qb = 0; qb < 4; ++qb) dst[qb * 32] = tc_acc_tile(acc[2 * qb], acc[2 * qb + 1]);
    }
    // Uᵀ = Vᵀ (M diag(β))ᵀ: warp = j-block w (rows of Uᵀ), all 64 i; B fragments of rows
    // i = 8·nt8 + g of M diag(β) from M_{nt8/2,kk} (block (kk, nt8/2)); nt8 ≥ 2·kk only.
    {
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned f[4];
            tc_ldsm_t(f, Vs, TC_LD, 16 * kk, 16 * w, lane);  // F(Vᵀ block (w, kk))
            const unsigned a[4] = {f[0], f[2], f[1], f[3]};
            const float2 e0 = *reinterpret_cast<const float2*>(Bt + 16 * kk + 2 * tq);
            const float2 e1 = *reinterpret_cast<const float2*>(Bt + 16 * kk + 2 * tq + 8);
#pragma unroll
            for (int nt8 = 0; nt8 < 8; ++nt8) {
                if (nt8 >= 2 * kk) {
                    const float* mb = Ls + (16 * kk + 8 * (nt8 & 1) + gq) * TC_MLD + 16 * (nt8 >> 1) + 2 * tq;
                    const float2 m0 = *reinterpret_cast<const float2*>(mb);
                    const float2 m1 = *reinterpret_cast<const float2*>(mb + 8);
                    tc_mma(acc[nt8], a, tc_pack(m0.x * e0.x, m0.y * e0.y), tc_pack(m1.x * e1.x, m1.y * e1.y));
                }
            }
        }
        uint4* dst = Uf + (tile * 32 + w * 4) * 32 + lane;
#pragma unroll
        for (int ib = 0; ib < 4; ++ib) {
            unsigned a[4];
            tc_acc_afrag(a, acc[2 * ib], acc[2 * ib + 1]);
            dst[ib * 32] = make_uint4(a[0], a[1], a[2], a[3]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// B  gdr_state_tc_bf16_32 (BV = 32 value columns per block): grid (Hv, (128 [+ 128 with
// trans]) / BV), block NW = BV/16 warps. Sequential over the chunks of one head. Warp w owns 16 columns j of the state
// (block jb = blockIdx.y·NW + w over [state columns | transition columns]) as Sᵀ rows:
// fp32 accumulators sacc (16 n-tiles over the 128 rows c of S), so the chunk step is
//   sa  = bf16(Sᵀ) as A fragments (packed from the accumulators, no shared memory)
//   Hs[n] = sa                                   (snapshot, F-tiles)
//   Ũᵀ  = Uᵀ − Sᵀ Wᵀ                              (64 mma; Ũ written over U)
//   Sᵀ  ← e^{G_c} Sᵀ + Ũᵀ K̃                        (64 mma, Ũᵀ packed from accumulators)
// The chunk's W and K̃ᵀ (32 KiB, shared by the CTA's warps), the CTA's Uᵀ slice and G_c
// stream through a TC_STAGES-deep cp.async ring in shared memory (chunk n+STAGES−1 is
// requested while chunk n computes; one barrier per chunk). Transition blocks
// (trans != null, jb ≥ 8; TRANS) run the same step with U = 0 and no writes, flushing
// |T| < 2^-40 to 0 after every chunk.
#define TC_STAGES 3
// uint4 per ring stage: W 1024 | K̃ᵀ 1024 | Uᵀ slice NW·128 | G_c 1. Shared memory of the
// kernel: TC_STAGES · TC_STAGE_U4(NW) · 16 bytes (108 KiB for BV = 32, so that two blocks
// share an SM when the transition doubles the grid to 256 blocks at Hv = 32).
#define TC_STAGE_U4(NW) (2048 + (NW) * 128 + 1)
template <int NW, bool TRANS>
__device__ __forceinline__ void gdr_state_tc_run(const uint4* __restrict__ Wf, const uint4* __restrict__ Ktf,
                                                 uint4* Uf, const float* __restrict__ gcum, float* mat,
                                                 uint4* Hsf, int jb0, int col0, int nt, size_t hb) {
    constexpr int SU = TC_STAGE_U4(NW);
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int gq = lane >> 2, tq = lane & 3, jb = jb0 + w;
    // sacc[ct][e] = Sᵀ[j0 + 8(e>>1)][8ct + 2tq + (e&1)] = mat[c][j], j0 = col0 + 16w + gq.
    const int j0 = col0 + 16 * w + gq;
    float sacc[16][4];
#pragma unroll
    for (int ct = 0; ct < 16; ++ct)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[ct][e] = mat[(size_t)(8 * ct + 2 * tq + (e & 1)) * TC_D + j0 + 8 * (e >> 1)];
    // Requests chunk n into its ring stage (an empty group past the end keeps the group
    // count uniform for the wait).
    auto issue = [&](int n) {
        if (n < nt) {
            uint4* dst = tc_sm + (n % TC_STAGES) * SU;
            const uint4* ws = Wf + (hb + n) * 1024;
            const uint4* ks = Ktf + (hb + n) * 1024;
#pragma unroll
            for (int it = 0; it < 1024 / (NW * 32); ++it) {
                const int i = tid + it * NW * 32;
                tc_cp16(dst + i, ws + i);
                tc_cp16(dst + 1024 + i, ks + i);
            }
            if (!TRANS) {
                const uint4* us = Uf + ((hb + n) * 32 + jb0 * 4) * 32;
#pragma unroll
                for (int it = 0; it < 4; ++it) tc_cp16(dst + 2048 + tid + it * NW * 32, us + tid + it * NW * 32);
            }
            if (tid == 0) tc_cp4(dst + 2048 + NW * 128, gcum + (hb + n) * TC_CH + TC_CH - 1);
        }
        tc_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) issue(s);
    for (int n = 0; n < nt; ++n) {
        tc_cp_wait<TC_STAGES - 2>();
        __syncthreads();  // chunk n landed for all threads; stage (n−1) % STAGES is free
        issue(n + TC_STAGES - 1);
        const uint4* Ws = tc_sm + (n % TC_STAGES) * SU;
        const uint4* Kts = Ws + 1024;
        const float eg = expf(*reinterpret_cast<const float*>(Ws + 2048 + NW * 128));
        unsigned sa[8][4];
#pragma unroll
        for (int kc = 0; kc < 8; ++kc) tc_acc_afrag(sa[kc], sacc[2 * kc], sacc[2 * kc + 1]);
        if (!TRANS) {
            uint4* hs = Hsf + ((hb + n) * 64 + jb * 8) * 32 + lane;
#pragma unroll
            for (int kc = 0; kc < 8; ++kc) hs[kc * 32] = make_uint4(sa[kc][0], sa[kc][1], sa[kc][2], sa[kc][3]);
        }
        // (W S)ᵀ = Sᵀ Wᵀ: n-tiles over the chunk's 64 rows i.
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < 8; ++kc)
#pragma unroll
            for (int ib = 0; ib < 4; ++ib) {
                const uint4 f = Ws[(ib * 8 + kc) * 32 + lane];
                tc_mma(acc[2 * ib], sa[kc], f.x, f.y);
                tc_mma(acc[2 * ib + 1], sa[kc], f.z, f.w);
            }
        // Ũᵀ = Uᵀ − (W S)ᵀ, as bf16 A fragments (Uᵀ is A order too).
        unsigned ua[4][4];
#pragma unroll
        for (int ib = 0; ib < 4; ++ib) {
            const uint4 uc = TRANS ? make_uint4(0u, 0u, 0u, 0u) : Ws[2048 + (w * 4 + ib) * 32 + lane];
            const float2 u0 = tc_unpack(uc.x), u1 = tc_unpack(uc.y);
            const float2 u2 = tc_unpack(uc.z), u3 = tc_unpack(uc.w);
            const float* a0 = acc[2 * ib];
            const float* a1 = acc[2 * ib + 1];
            ua[ib][0] = tc_pack(u0.x - a0[0], u0.y - a0[1]);
            ua[ib][1] = tc_pack(u1.x - a0[2], u1.y - a0[3]);
            ua[ib][2] = tc_pack(u2.x - a1[0], u2.y - a1[1]);
            ua[ib][3] = tc_pack(u3.x - a1[2], u3.y - a1[3]);
            if (!TRANS)
                Uf[((hb + n) * 32 + jb * 4 + ib) * 32 + lane] = make_uint4(ua[ib][0], ua[ib][1], ua[ib][2], ua[ib][3]);
        }
        // Sᵀ ← e^{G_c} Sᵀ + Ũᵀ K̃.
#pragma unroll
        for (int ct = 0; ct < 16; ++ct)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[ct][e] *= eg;
#pragma unroll
        for (int ib = 0; ib < 4; ++ib)
#pragma unroll
            for (int cb = 0; cb < 8; ++cb) {
                const uint4 f = Kts[(cb * 4 + ib) * 32 + lane];
                tc_mma(sacc[2 * cb], ua[ib], f.x, f.y);
                tc_mma(sacc[2 * cb + 1], ua[ib], f.z, f.w);
            }
        if (TRANS) {
#pragma unroll
            for (int ct = 0; ct < 16; ++ct)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (fabsf(sacc[ct][e]) < TC_FLUSH) sacc[ct][e] = 0.f;
        }
    }
    tc_cp_wait<0>();  // the empty trailing groups
#pragma unroll
    for (int ct = 0; ct < 16; ++ct)
#pragma unroll
        for (int e = 0; e < 4; ++e) mat[(size_t)(8 * ct + 2 * tq + (e & 1)) * TC_D + j0 + 8 * (e >> 1)] = sacc[ct][e];
}

template <int NW>
__device__ __forceinline__ void gdr_state_tc_impl(const uint4* Wf, const uint4* Ktf, uint4* Uf, const float* gcum,
                                                  float* state, float* trans, uint4* Hsf, int t_len) {
    const int h = blockIdx.x, jb0 = blockIdx.y * NW;
    const int nt = (t_len + TC_CH - 1) / TC_CH;
    const size_t hb = (size_t)h * nt;
    if (jb0 >= TC_D / 16)  // CTA-uniform (NW divides 8): transition columns
        gdr_state_tc_run<NW, true>(Wf, Ktf, Uf, gcum, trans + (size_t)h * TC_D * TC_D, Hsf, jb0,
                                   16 * jb0 - TC_D, nt, hb);
    else
        gdr_state_tc_run<NW, false>(Wf, Ktf, Uf, gcum, state + (size_t)h * TC_D * TC_D, Hsf, jb0, 16 * jb0, nt,
                                    hb);
}

#define GDR_STATE_TC(BV)                                                                              \
    extern "C" __global__ void __launch_bounds__(BV * 2, 1) gdr_state_tc_bf16_##BV(                   \
        const uint4* Wf, const uint4* Ktf, uint4* Uf, const float* gcum, float* state, float* trans,  \
        uint4* Hsf, int t_len) {                                                                      \
        gdr_state_tc_impl<BV / 16>(Wf, Ktf, Uf, gcum, state, trans, Hsf, t_len);                      \
    }
GDR_STATE_TC(32)

// ---------------------------------------------------------------------------------------
// C' gdr_output_tc2_bf16: grid (Hv, NT) (value heads fastest: Q and K chunks of a key head
// are read back to back), block 256 (8 warps), TC_OUT_SMEM bytes of shared memory; per
// (chunk, head) the output rows O = diag(e^G) Q S + P Ũ of the chunk, with S (snapshot)
// and Ũ read as B fragments from their (A-order) F-tiles in global memory. ≤ 64 registers
// per thread so that four blocks share an SM; each warp reads distinct Hs / Ũ fragments.
// The block's Hs and Ũ tiles (48 KiB) are prefetched into L2 at entry. Then
//   P = (Q Kᵀ ⊙ e^{G_i−G_m})_{m≤i}, warp rows 16·(w >> 1).., n-tiles 4·(w & 1)..,
//       written as bf16 [64][TC_ALD] over K;
//   O = e^{G_i} (Q S) + P Ũ, warp = value columns 16·w.. for all 64 rows (A fragments of
//       Q and P by ldmatrix from shared memory, B fragments one uint4 per k-block).
#define TC_OUT_SMEM (2 * TC_CH * TC_LD * 2 + TC_CH * 4)
extern "C" __global__ void __launch_bounds__(256, 4)
    gdr_output_tc2_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const float* __restrict__ gcum,
                        const uint4* __restrict__ Uf, const uint4* __restrict__ Hsf, bf16* __restrict__ out,
                        int t_len, int hk, int hv) {
    bf16* Qs = reinterpret_cast<bf16*>(tc_sm);  // [64][TC_LD]
    bf16* Ks = Qs + TC_CH * TC_LD;               // [64][TC_LD] K, then P [64][TC_ALD]
    bf16* Ps = Ks;
    float* G = reinterpret_cast<float*>(Ks + TC_CH * TC_LD);
    const int h = blockIdx.x, n = blockIdx.y, kh = h / (hv / hk), tid = threadIdx.x;
    const int lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int nt = (t_len + TC_CH - 1) / TC_CH;
    const int t0 = n * TC_CH, len = min(TC_CH, t_len - t0);
    const size_t tile = (size_t)h * nt + n;
    tc_prefetch_l2(reinterpret_cast<const char*>(Hsf + tile * 2048) + 128 * tid);
    if (tid < 128) tc_prefetch_l2(reinterpret_cast<const char*>(Uf + tile * 1024) + 128 * tid);
    tc_load_rows(Qs, q, t0, len, hk, kh, tid);
    tc_load_rows(Ks, k, t0, len, hk, kh, tid);
    if (tid < TC_CH) G[tid] = gcum[tile * TC_CH + tid];
    __syncthreads();
    {
        const int mt = w >> 1, nh = w & 1;
        float p[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0.f;
        if (2 * mt + 1 >= 4 * nh) {  // warp-uniform: some tile has m ≤ i
#pragma unroll
            for (int kc = 0; kc < TC_D / 16; ++kc) {
                unsigned a[4];
                tc_ldsm_a(a, Qs, TC_LD, 16 * mt, 16 * kc, lane);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int nt8 = 4 * nh + j;
                    if (nt8 <= 2 * mt + 1) {
                        const bf16* pk = Ks + (8 * nt8 + gq) * TC_LD + 16 * kc + 2 * tq;
                        tc_mma(p[j], a, tc_ld32(pk), tc_ld32(pk + 8));
                    }
                }
            }
        }
        __syncthreads();  // K no longer read: P goes over it
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int nt8 = 4 * nh + j;
            if (nt8 <= 2 * mt + 1) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int i = 16 * mt + gq + 8 * hh, m = 8 * nt8 + 2 * tq;
                    const float gi = G[i];
                    const float x0 = m <= i ? p[j][2 * hh] * expf(gi - G[m]) : 0.f;
                    const float x1 = m + 1 <= i ? p[j][2 * hh + 1] * expf(gi - G[m + 1]) : 0.f;
                    *reinterpret_cast<unsigned*>(Ps + i * TC_ALD + m) = tc_pack(x0, x1);
                }
            }
        }
    }
    __syncthreads();
    float o[4][2][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][0][e] = o[mt][1][e] = 0.f;
    // O = Q S: B fragments of S (Sᵀ snapshot block (w, kc), A order: n-tile 0 = (.x, .z)).
    const uint4* hs = Hsf + (tile * 64 + w * 8) * 32 + lane;
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) {
        const uint4 f = hs[kc * 32];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            unsigned a[4];
            tc_ldsm_a(a, Qs, TC_LD, 16 * mt, 16 * kc, lane);
            tc_mma(o[mt][0], a, f.x, f.z);
            tc_mma(o[mt][1], a, f.y, f.w);
        }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
        const float e0 = expf(G[16 * mt + gq]), e1 = expf(G[16 * mt + gq + 8]);
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
            o[mt][nb][0] *= e0;
            o[mt][nb][1] *= e0;
            o[mt][nb][2] *= e1;
            o[mt][nb][3] *= e1;
        }
    }
    // O += P Ũ: Ũ block (w, kk) as B fragments; P rows 16·mt.. for mt ≥ kk.
    const uint4* uf = Uf + (tile * 32 + w * 4) * 32 + lane;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const uint4 f = uf[kk * 32];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            if (mt >= kk) {
                unsigned a[4];
                tc_ldsm_a(a, Ps, TC_ALD, 16 * mt, 16 * kk, lane);
                tc_mma(o[mt][0], a, f.x, f.z);
                tc_mma(o[mt][1], a, f.y, f.w);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = 16 * mt + gq + 8 * hh;
            if (i < len) {
                bf16* dst = out + ((size_t)(t0 + i) * hv + h) * TC_D + 16 * w + 2 * tq;
#pragma unroll
                for (int nb = 0; nb < 2; ++nb)
                    *reinterpret_cast<__nv_bfloat162*>(dst + 8 * nb) =
                        __floats2bfloat162_rn(o[mt][nb][2 * hh], o[mt][nb][2 * hh + 1]);
            }
        }
}
