// Chunked Kimi Delta Attention (KDA) prefill on tensor cores: bf16 q/k/v, fp32 state,
// dk = dv = 128.
//
// Same contract as kda_chunked_bf16 of kda.cu (which stays the f32 path, the path of
// other head sizes and the T_C build); CPU references: mixers/kda/{naive,chunk}.rs.
// Host side: dataplane/src/cuda/kda.rs (`chunked_tc`). Host emulation against an fp64
// recurrence: tools/kernel-emu/run.sh kda-tc.
//
// Recurrence per value head (g_t ∈ R^128 per-channel log decay ≤ 0, β_t scalar):
//   S ← diag(e^{g_t}) S;  u_t = β_t (v_t − Sᵀ k_t);  S += k_t u_tᵀ;  o_t = Sᵀ q_t.
// Chunked in the WY / UT-transform form of Yang et al. 2024 ("Parallelizing Linear
// Transformers with the Delta Rule over Sequence Length"), as gdr_tc.cu but with a
// vector decay. Per chunk of 64 tokens with chunk-initial state S and chunk-local
// cumulative log decay G_i = Σ_{s≤i} g_s (a vector; kept here in log2 units, all
// exponentials are exp2f):
//   A_ij = Σ_a k_ia k_ja e^{G_ia − G_ja}          (j < i)      L = diag(β) A,  M = (I + L)⁻¹
//   W  = M diag(β) (K ⊙ e^G),  U = M diag(β) V                  (prep, parallel over chunks)
//   Ũ  = U − W S;  S' = diag(e^{G_last}) S + K̃ᵀ Ũ,  K̃_j = k_j ⊙ e^{G_last − G_j}  (state)
//   P_ij = Σ_a q_ia k_ja e^{G_ia − G_ja}          (j ≤ i)
//   O  = (Q ⊙ e^G) S + P Ũ                                      (output, parallel)
// Every factor above is ≤ 1 (G is non-increasing), so nothing overflows; factors that
// underflow to 0 stand for contributions below fp32 range. A and P are the only places
// where the pairwise factor e^{G_i − G_j} has to be split to run on tensor cores: with
// sub-chunks of 16 rows, an off-diagonal 16×16 block (I > J) is computed as
//   (X_I ⊙ e^{G − G_r}) (K_J ⊙ e^{G_r − G})ᵀ,   r = 16·I (the first row of sub-chunk I),
// both operands ≤ |x| elementwise (i ≥ r > j), rounded to bf16 (X = K for A, Q for P);
// the four diagonal blocks are computed exactly in fp32 (SIMT, one exponential per
// channel and pair), so no reference point is needed inside a sub-chunk (a strong
// decay, e.g. g = −5 per token, would overflow any factored form there).
// M is solved in fp32 (diagonal 16×16 blocks by forward substitution, the off-diagonal
// blocks on tensor cores with hi/lo-split bf16 operands), as gdr_tc.cu. bf16-rounded
// intermediates: the scaled operands of A and P off their diagonal blocks, K ⊙ e^G, W,
// U, K̃, Ũ, the per-chunk state snapshots, P, Q ⊙ e^G.
//
// Fragment tiles ("F-tiles") as gdr_tc.cu (see its header): a 16×16 bf16 block is 32
// lanes × uint4, A order {X[g][2q..], X[g+8][2q..], X[g][2q+8..], X[g+8][2q+8..]} or B
// order {X[g][2q..], X[g][2q+8..], X[g+8][2q..], X[g+8][2q+8..]} (g = lane/4, q = lane%4).
// Per (value head h, chunk n), tile = h·NT + n:
//   Wf  [tile][4 i-blocks][8 c-blocks]   W, B order           (64 × 128)   16 KiB
//   Ktf [tile][8 c-blocks][4 i-blocks]   K̃ᵀ, B order          (128 × 64)   16 KiB
//   Uf  [tile][8 j-blocks][4 i-blocks]   Uᵀ then Ũᵀ, A order  (128 × 64)   16 KiB
//   Hsf [tile][8 j-blocks][8 c-blocks]   chunk-initial Sᵀ, A order (128 × 128) 32 KiB
//   dl  [tile][128] fp32                 e^{G_last} per key channel
// Rows of a partial last chunk are zero in W, U, K̃ (their β and k are zero; their g is
// taken as 0, so G_last is the G of the last token).
//
// Three kernels: kda_prep_tc_bf16 (grid (Hv, NT), 256 threads, KT_PREP_SMEM bytes),
// kda_state_tc_bf16 (grid (Hv, 4), 64 threads, KT_STATE_SMEM bytes; sequential over the
// chunks), kda_output_tc_bf16 (grid (Hv, NT), 256 threads, KT_OUT_SMEM bytes).
//
// Layouts of the inputs and outputs (as kda.cu): q, k [T, Hk, 128] bf16, v [T, Hv, 128]
// bf16, g [T, Hv, 128] fp32 (natural-log decays ≤ 0), beta [T, Hv] fp32, state
// [Hv, 128, 128] fp32 K-major (S[a][c], a = key channel), o [T, Hv, 128] bf16. Value
// head h reads key head h / (Hv/Hk).

#define KT_CH 64     // chunk length
#define KT_D 128     // dk = dv
#define KT_LD 136    // bf16 row stride of the 64×128 staging tiles (272 B)
#define KT_GLD 136   // fp32 row stride of the 64×128 G tile (float2 fragment loads conflict-free)
#define KT_MLD 72    // fp32 row stride of L / M
#define KT_ALD 72    // bf16 row stride of P
#define KT_LOG2E 1.4426950408889634f

// ---------------------------------------------------------------------------------------
// Warp-level primitives (inline PTX) and the dynamic shared memory. HYPIC_HOST_EMU: a
// host build (tools/kernel-emu/kda_tc_emu.cpp) supplies its own.
#ifndef HYPIC_HOST_EMU
// c += a·b, m16n8k16, row.col, bf16 in, fp32 accumulate. a: A fragment (4 regs), b0/b1:
// B fragment (k 2q..2q+1 / 2q+8.. of column g).
__device__ __forceinline__ void kt_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ldmatrix .x4 .trans: lane l gives the address of row (l & 7) of 8×8 matrix (l >> 3);
// register i of lane (g, q) receives elements (row 2q, column g) (low half) and
// (2q+1, g) (high) of matrix i.
__device__ __forceinline__ void kt_ldsm_x4_trans(unsigned* f, const bf16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                 : "r"(a)
                 : "memory");
}
// ldmatrix .x4 (no transpose): register i of lane (g, q) receives elements (row g,
// columns 2q, 2q+1) of matrix i.
__device__ __forceinline__ void kt_ldsm_x4(unsigned* f, const bf16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                 : "r"(a)
                 : "memory");
}
// Prefetch of the 128-byte line holding p into L2.
__device__ __forceinline__ void kt_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
// 16-byte asynchronous global → shared copy (cp.async.cg), commit of the copies issued
// so far as one group, wait until at most N groups are pending.
__device__ __forceinline__ void kt_cp16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void kt_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kt_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
extern __shared__ uint4 kt_sm[];
#endif

// ---------------------------------------------------------------------------------------
// Small helpers.
__device__ __forceinline__ unsigned kt_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float2 kt_unpack(unsigned u) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&u);
    return __bfloat1622float2(v);
}
__device__ __forceinline__ unsigned kt_ld32(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }
__device__ __forceinline__ float2 kt_ldf2(const float* p) { return *reinterpret_cast<const float2*>(p); }
// F-tile block (B order) of the transpose of the 16×16 block of a row-major bf16 matrix
// X at rows k0.., columns m0.. (Xᵀ rows m0.., columns k0..).
__device__ __forceinline__ void kt_ldsm_t(unsigned* f, const bf16* X, int ld, int k0, int m0, int lane) {
    const int mi = lane >> 3, r = lane & 7;
    kt_ldsm_x4_trans(f, X + (k0 + r + 8 * (mi & 1)) * ld + m0 + 8 * (mi >> 1));
}
// mma A fragment of the 16×16 block of a row-major bf16 matrix X at (r0, c0).
__device__ __forceinline__ void kt_ldsm_a(unsigned* f, const bf16* X, int ld, int r0, int c0, int lane) {
    kt_ldsm_x4(f, X + (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + c0 + 8 * (lane >> 4));
}
// F-tile block (B order) from two accumulator n8 tiles (columns 0–7 in c0, 8–15 in c1).
__device__ __forceinline__ uint4 kt_acc_tile(const float* c0, const float* c1) {
    return make_uint4(kt_pack(c0[0], c0[1]), kt_pack(c1[0], c1[1]), kt_pack(c0[2], c0[3]), kt_pack(c1[2], c1[3]));
}
// F-tile block (A order) / mma A fragment from the same two accumulator tiles.
__device__ __forceinline__ void kt_acc_afrag(unsigned* a, const float* c0, const float* c1) {
    a[0] = kt_pack(c0[0], c0[1]);
    a[1] = kt_pack(c0[2], c0[3]);
    a[2] = kt_pack(c1[0], c1[1]);
    a[3] = kt_pack(c1[2], c1[3]);
}
// bf16 hi/lo split of two floats: hi = bf16(a, b), lo = bf16(a − hi, b − hi).
__device__ __forceinline__ void kt_split(float a, float b, unsigned& hi, unsigned& lo) {
    hi = kt_pack(a, b);
    const float2 h = kt_unpack(hi);
    lo = kt_pack(a - h.x, b - h.y);
}
// c += a·b to ~fp32 accuracy from split operands (hi·hi + hi·lo + lo·hi).
__device__ __forceinline__ void kt_mma3(float* c, const unsigned* ah, const unsigned* al, unsigned bh0, unsigned bh1,
                                        unsigned bl0, unsigned bl1) {
    kt_mma(c, al, bh0, bh1);
    kt_mma(c, ah, bl0, bl1);
    kt_mma(c, ah, bh0, bh1);
}

// Rows [t0, t0 + len) of one head of a [T, H, 128] bf16 tensor into a 64×128 shared tile
// (row stride KT_LD) by cp.async (the caller commits and waits); rows ≥ len are zeroed
// by plain stores. 256 threads.
__device__ __forceinline__ void kt_load_rows(bf16* dst, const bf16* src, int t0, int len, int nh, int hd, int tid) {
#pragma unroll
    for (int it = 0; it < 4; ++it) {
        const int idx = tid + 256 * it, i = idx >> 4, c8 = idx & 15;
        if (i < len)
            kt_cp16(dst + i * KT_LD + c8 * 8, src + ((size_t)(t0 + i) * nh + hd) * KT_D + c8 * 8);
        else
            *reinterpret_cast<uint4*>(dst + i * KT_LD + c8 * 8) = make_uint4(0u, 0u, 0u, 0u);
    }
}
// The chunk's g rows of head h ([T, Hv, 128] fp32) into a 64×128 fp32 tile (row stride
// KT_GLD) by cp.async; rows ≥ len are zeroed. 256 threads.
__device__ __forceinline__ void kt_load_g(float* dst, const float* g, int t0, int len, int hv, int h, int tid) {
#pragma unroll
    for (int it = 0; it < 8; ++it) {
        const int idx = tid + 256 * it, i = idx >> 5, c4 = idx & 31;
        if (i < len)
            kt_cp16(dst + i * KT_GLD + 4 * c4, g + ((size_t)(t0 + i) * hv + h) * KT_D + 4 * c4);
        else
            *reinterpret_cast<uint4*>(dst + i * KT_GLD + 4 * c4) = make_uint4(0u, 0u, 0u, 0u);
    }
}
// In place over the loaded g tile: Gs[i][c] = log2(e) · Σ_{s≤i} g_s[c] (two halves of
// 32 rows scanned in parallel, then the second half offset by the first's total).
// 256 threads; contains (and ends with) barriers.
__device__ __forceinline__ void kt_scan_g(float* Gs, int tid) {
    const int c = tid & 127, r0 = (tid >> 7) * 32;
    float s = 0.f;
    for (int i = r0; i < r0 + 32; ++i) {
        s += Gs[i * KT_GLD + c] * KT_LOG2E;
        Gs[i * KT_GLD + c] = s;
    }
    __syncthreads();
    const float base = Gs[31 * KT_GLD + c];
    for (int i = 32 + 16 * (tid >> 7); i < 48 + 16 * (tid >> 7); ++i) Gs[i * KT_GLD + c] += base;
    __syncthreads();
}

// Sum over the warp of the 16 per-lane values p[0..15] (a transposing butterfly: 15
// shuffles): lane l returns the total of p[(l >> 1) & 15].
__device__ __forceinline__ float kt_reduce16(const float* p, int lane) {
    float q[8], r[4], u[2];
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
#pragma unroll
    for (int s = 0; s < 8; ++s) q[s] = (b4 ? p[s + 8] : p[s]) + __shfl_xor_sync(0xffffffffu, b4 ? p[s] : p[s + 8], 16);
#pragma unroll
    for (int s = 0; s < 4; ++s) r[s] = (b3 ? q[s + 4] : q[s]) + __shfl_xor_sync(0xffffffffu, b3 ? q[s] : q[s + 4], 8);
#pragma unroll
    for (int s = 0; s < 2; ++s) u[s] = (b2 ? r[s + 2] : r[s]) + __shfl_xor_sync(0xffffffffu, b2 ? r[s] : r[s + 2], 4);
    const float x = (b1 ? u[1] : u[0]) + __shfl_xor_sync(0xffffffffu, b1 ? u[0] : u[1], 2);
    return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

// Row i of a diagonal 16×16 block, exactly in fp32: lane l returns
//   Σ_a x_ia k_ja 2^{G_ia − G_ja},   j = (i & ~15) + (l >> 1) & 15,
// for j < i (INCL: j ≤ i), 0 for the other j. X, K: bf16 [64][KT_LD]; G [64][KT_GLD]
// (log2 units). Lane channels 2l, 2l+1, 64+2l, 65+2l.
template <bool INCL>
__device__ __forceinline__ float kt_diag_row(const bf16* Xs, const bf16* Ks, const float* Gs, int i, int lane) {
    const int i0 = i & ~15, n = (i & 15) + (INCL ? 1 : 0);
    const float2 x0 = kt_unpack(kt_ld32(Xs + i * KT_LD + 2 * lane));
    const float2 x1 = kt_unpack(kt_ld32(Xs + i * KT_LD + 64 + 2 * lane));
    const float2 g0 = kt_ldf2(Gs + i * KT_GLD + 2 * lane), g1 = kt_ldf2(Gs + i * KT_GLD + 64 + 2 * lane);
    float p[16];
#pragma unroll
    for (int s = 0; s < 16; ++s) {
        p[s] = 0.f;
        if (s < n) {  // warp-uniform
            const int j = i0 + s;
            const float2 k0 = kt_unpack(kt_ld32(Ks + j * KT_LD + 2 * lane));
            const float2 k1 = kt_unpack(kt_ld32(Ks + j * KT_LD + 64 + 2 * lane));
            const float2 h0 = kt_ldf2(Gs + j * KT_GLD + 2 * lane), h1 = kt_ldf2(Gs + j * KT_GLD + 64 + 2 * lane);
            p[s] = x0.x * k0.x * exp2f(g0.x - h0.x) + x0.y * k0.y * exp2f(g0.y - h0.y) +
                   x1.x * k1.x * exp2f(g1.x - h1.x) + x1.y * k1.y * exp2f(g1.y - h1.y);
        }
    }
    return kt_reduce16(p, lane);
}
// The diagonal rows handled by warp w (of 8): row offsets w and 15 − w of every
// sub-chunk (equal work per warp).
__device__ __forceinline__ int kt_diag_rowsel(int w, int m) { return 16 * (m >> 1) + ((m & 1) ? 15 - w : w); }

// Off-diagonal 16×16 block (I, J), I > J, on tensor cores with the sub-chunk reference
// r = 16·I: acc[nt] (n-tile nt = columns 16J + 8nt..) = (X_I ⊙ 2^{G − G_r}) (K_J ⊙ 2^{G_r − G})ᵀ,
// operands scaled in fp32 and rounded to bf16 as they are loaded.
__device__ __forceinline__ void kt_offdiag(float (*acc)[4], const bf16* Xs, const bf16* Ks, const float* Gs, int I,
                                           int J, int lane) {
    const int gq = lane >> 2, tq = lane & 3, r = 16 * I;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 2
    for (int kc = 0; kc < KT_D / 16; ++kc) {
        const int a = 16 * kc + 2 * tq;
        float2 gr[2];
        gr[0] = kt_ldf2(Gs + r * KT_GLD + a);
        gr[1] = kt_ldf2(Gs + r * KT_GLD + a + 8);
        unsigned A[4];
#pragma unroll
        for (int cc = 0; cc < 2; ++cc)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = r + gq + 8 * hh, c = a + 8 * cc;
                const float2 x = kt_unpack(kt_ld32(Xs + i * KT_LD + c));
                const float2 gi = kt_ldf2(Gs + i * KT_GLD + c);
                A[hh + 2 * cc] = kt_pack(x.x * exp2f(gi.x - gr[cc].x), x.y * exp2f(gi.y - gr[cc].y));
            }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int j = 16 * J + 8 * nt + gq;
            unsigned b[2];
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const int c = a + 8 * cc;
                const float2 kx = kt_unpack(kt_ld32(Ks + j * KT_LD + c));
                const float2 gj = kt_ldf2(Gs + j * KT_GLD + c);
                b[cc] = kt_pack(kx.x * exp2f(gr[cc].x - gj.x), kx.y * exp2f(gr[cc].y - gj.y));
            }
            kt_mma(acc[nt], A, b[0], b[1]);
        }
    }
}
// Block (I, J) of off-diagonal block index w < 6: (1,0) (2,0) (2,1) (3,0) (3,1) (3,2).
__device__ __forceinline__ void kt_offdiag_ij(int w, int& I, int& J) {
    I = w < 1 ? 1 : (w < 3 ? 2 : 3);
    J = w - I * (I - 1) / 2;
}

// ---------------------------------------------------------------------------------------
// kda_prep_tc_bf16: grid (Hv, NT) (value heads fastest: heads sharing a key head read
// its K chunk back to back), block 256 (8 warps), KT_PREP_SMEM bytes of shared memory.
// Per (chunk, head): G (log2 units); L = diag(β) A (diagonal blocks exact in fp32, the
// six off-diagonal blocks on tensor cores); M = (I + L)⁻¹ in place of L (as gdr_tc.cu:
// M_ab, a ≥ b, stored row-major at block position (b, a)); K̃ᵀ; K ⊙ e^G in place of K;
// W = (M diag(β)) (K ⊙ e^G) and Uᵀ = Vᵀ (M diag(β))ᵀ on tensor cores. Writes Wf, Ktf,
// Uf (F-tiles) and dl = e^{G_last}.
#define KT_PREP_SMEM (2 * KT_CH * KT_LD * 2 + KT_CH * KT_GLD * 4 + KT_CH * KT_MLD * 4 + KT_CH * 4)
extern "C" __global__ void __launch_bounds__(256, 2)
    kda_prep_tc_bf16(const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ g,
                     const float* __restrict__ beta, uint4* __restrict__ Wf, uint4* __restrict__ Ktf,
                     uint4* __restrict__ Uf, float* __restrict__ dl, int t_len, int hk, int hv) {
    bf16* Ks = reinterpret_cast<bf16*>(kt_sm);                // [64][KT_LD] K, then K ⊙ e^G
    bf16* Vs = Ks + KT_CH * KT_LD;                             // [64][KT_LD]
    float* Gs = reinterpret_cast<float*>(Vs + KT_CH * KT_LD);  // [64][KT_GLD]
    float* Ls = Gs + KT_CH * KT_GLD;                           // [64][KT_MLD] L, then M
    float* Bt = Ls + KT_CH * KT_MLD;                           // [64] β
    const int h = blockIdx.x, n = blockIdx.y, kh = h / (hv / hk), tid = threadIdx.x;
    const int lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int nt = (t_len + KT_CH - 1) / KT_CH;
    const int t0 = n * KT_CH, len = min(KT_CH, t_len - t0);
    const size_t tile = (size_t)h * nt + n;
    // K and g (first group), V (second group: first read by the U product).
    kt_load_rows(Ks, k, t0, len, hk, kh, tid);
    kt_load_g(Gs, g, t0, len, hv, h, tid);
    kt_cp_commit();
    kt_load_rows(Vs, v, t0, len, hv, h, tid);
    kt_cp_commit();
    if (tid < KT_CH) Bt[tid] = tid < len ? beta[(size_t)(t0 + tid) * hv + h] : 0.f;
    kt_cp_wait<1>();
    __syncthreads();
    kt_scan_g(Gs, tid);
    if (tid < KT_D) dl[tile * KT_D + tid] = exp2f(Gs[(KT_CH - 1) * KT_GLD + tid]);
    // L: diagonal blocks (every warp, 8 rows each), then the off-diagonal blocks (warps 0–5).
#pragma unroll 1
    for (int m = 0; m < 8; ++m) {
        const int i = kt_diag_rowsel(w, m);
        const float x = kt_diag_row<false>(Ks, Ks, Gs, i, lane);
        if (!(lane & 1)) Ls[i * KT_MLD + (i & ~15) + (lane >> 1)] = Bt[i] * x;
    }
    if (w < 6) {
        int I, J;
        kt_offdiag_ij(w, I, J);
        float acc[2][4];
        kt_offdiag(acc, Ks, Ks, Gs, I, J, lane);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = 16 * I + gq + 8 * hh;
            const float bi = Bt[i];
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2)
                *reinterpret_cast<float2*>(Ls + i * KT_MLD + 16 * J + 8 * nt2 + 2 * tq) =
                    make_float2(bi * acc[nt2][2 * hh], bi * acc[nt2][2 * hh + 1]);
        }
    }
    __syncthreads();
    if (tid < KT_CH) {
        // M_bb = (I + L_bb)⁻¹: thread solves column c of diagonal block b by forward
        // substitution and writes it over L_bb once the block's 16 lanes have read L_bb.
        const int o = 16 * (tid >> 4), c = tid & 15;
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            float s = r == c ? 1.f : 0.f;
#pragma unroll
            for (int r2 = 0; r2 < r; ++r2) s -= Ls[(o + r) * KT_MLD + o + r2] * x[r2];
            x[r] = s;
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 16; ++r) Ls[(o + r) * KT_MLD + o + c] = x[r];
    } else {
        // K̃ᵀ (warps 2–7 over the 8 c-blocks): K̃_ic = k_ic 2^{G_last,c − G_ic}.
        for (int cb = w - 2; cb < KT_D / 16; cb += 6) {
            uint4* dst = Ktf + (tile * 32 + cb * 4) * 32 + lane;
            const int c0 = 16 * cb + gq, c1 = c0 + 8;
            const float l0 = Gs[(KT_CH - 1) * KT_GLD + c0], l1 = Gs[(KT_CH - 1) * KT_GLD + c1];
#pragma unroll
            for (int ib = 0; ib < 4; ++ib) {
                unsigned f[4];
                kt_ldsm_t(f, Ks, KT_LD, 16 * ib, 16 * cb, lane);  // F(Kᵀ block (cb, ib))
                const int i0 = 16 * ib + 2 * tq;  // .x: (c0; i0, i0+1) .y: (c0; i0+8, +9) .z/.w: c1
                const float2 x0 = kt_unpack(f[0]), x1 = kt_unpack(f[1]), x2 = kt_unpack(f[2]), x3 = kt_unpack(f[3]);
                dst[ib * 32] = make_uint4(
                    kt_pack(x0.x * exp2f(l0 - Gs[i0 * KT_GLD + c0]), x0.y * exp2f(l0 - Gs[(i0 + 1) * KT_GLD + c0])),
                    kt_pack(x1.x * exp2f(l0 - Gs[(i0 + 8) * KT_GLD + c0]), x1.y * exp2f(l0 - Gs[(i0 + 9) * KT_GLD + c0])),
                    kt_pack(x2.x * exp2f(l1 - Gs[i0 * KT_GLD + c1]), x2.y * exp2f(l1 - Gs[(i0 + 1) * KT_GLD + c1])),
                    kt_pack(x3.x * exp2f(l1 - Gs[(i0 + 8) * KT_GLD + c1]),
                            x3.y * exp2f(l1 - Gs[(i0 + 9) * KT_GLD + c1])));
            }
        }
    }
    __syncthreads();
    // Off-diagonal blocks of M by distance d; warp j < 4 − d computes M_ij, i = j + d
    // (as gdr_tc.cu). Warps 3–7 meanwhile (round 1) turn K into K ⊙ e^G in place.
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
                const float* mb = Ls + (16 * j + 2 * tq) * KT_MLD + 16 * kb + gq;
                unsigned ah[4], al[4];
                kt_split(mb[0], mb[KT_MLD], ah[0], al[0]);
                kt_split(mb[8], mb[KT_MLD + 8], ah[1], al[1]);
                kt_split(mb[8 * KT_MLD], mb[9 * KT_MLD], ah[2], al[2]);
                kt_split(mb[8 * KT_MLD + 8], mb[9 * KT_MLD + 8], ah[3], al[3]);
                // B = L_ikᵀ: n-tile nt2 (X rows 8·nt2 + g).
#pragma unroll
                for (int nt2 = 0; nt2 < 2; ++nt2) {
                    const float* lb = Ls + (16 * i + 8 * nt2 + gq) * KT_MLD + 16 * kb + 2 * tq;
                    const float2 l0 = kt_ldf2(lb), l1 = kt_ldf2(lb + 8);
                    unsigned bh0, bl0, bh1, bl1;
                    kt_split(l0.x, l0.y, bh0, bl0);
                    kt_split(l1.x, l1.y, bh1, bl1);
                    kt_mma3(xt[nt2], ah, al, bh0, bh1, bl0, bl1);
                }
            }
            // M_ij = −M_ii X: A = M_ii (block (i, i)), B = X from the accumulators of Xᵀ.
            const float* db = Ls + (16 * i + gq) * KT_MLD + 16 * i + 2 * tq;
            unsigned ah[4], al[4];
            {
                const float2 d0 = kt_ldf2(db), d1 = kt_ldf2(db + 8 * KT_MLD);
                const float2 d2 = kt_ldf2(db + 8), d3 = kt_ldf2(db + 8 * KT_MLD + 8);
                kt_split(d0.x, d0.y, ah[0], al[0]);
                kt_split(d1.x, d1.y, ah[1], al[1]);
                kt_split(d2.x, d2.y, ah[2], al[2]);
                kt_split(d3.x, d3.y, ah[3], al[3]);
            }
            float mo[2][4];
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2) {
#pragma unroll
                for (int e = 0; e < 4; ++e) mo[nt2][e] = 0.f;
                unsigned bh0, bl0, bh1, bl1;
                kt_split(xt[0][2 * nt2], xt[0][2 * nt2 + 1], bh0, bl0);
                kt_split(xt[1][2 * nt2], xt[1][2 * nt2 + 1], bh1, bl1);
                kt_mma3(mo[nt2], ah, al, bh0, bh1, bl0, bl1);
            }
            float* ob = Ls + (16 * j + gq) * KT_MLD + 16 * i + 2 * tq;
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2) {
                *reinterpret_cast<float2*>(ob + 8 * nt2) = make_float2(-mo[nt2][0], -mo[nt2][1]);
                *reinterpret_cast<float2*>(ob + 8 * KT_MLD + 8 * nt2) = make_float2(-mo[nt2][2], -mo[nt2][3]);
            }
        } else if (d == 1) {
            // K ⊙ e^G (bf16, in place; K is no longer read as K).
            for (int idx = tid - 96; idx < KT_CH * KT_D / 2; idx += 160) {
                const int i = idx >> 6, c = 2 * (idx & 63);
                unsigned* p = reinterpret_cast<unsigned*>(Ks + i * KT_LD + c);
                const float2 x = kt_unpack(*p), gi = kt_ldf2(Gs + i * KT_GLD + c);
                *p = kt_pack(x.x * exp2f(gi.x), x.y * exp2f(gi.y));
            }
        }
        if (d == 3) kt_cp_wait<0>();  // V, before the barrier that precedes W and U
        __syncthreads();
    }
    // W = M diag(β) (K ⊙ e^G): warp rows 16·mt.., columns 64·ch.. (c-blocks 4·ch..);
    // A fragments from M_{mt,kk} (block (kk, mt)) scaled by β of the columns.
    {
        const int mt = w & 3, ch = w >> 2;
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            if (kk <= mt) {
                const float* mb = Ls + (16 * kk + gq) * KT_MLD + 16 * mt + 2 * tq;
                const float2 e0 = kt_ldf2(Bt + 16 * kk + 2 * tq), e1 = kt_ldf2(Bt + 16 * kk + 2 * tq + 8);
                const float2 m0 = kt_ldf2(mb), m1 = kt_ldf2(mb + 8 * KT_MLD);
                const float2 m2 = kt_ldf2(mb + 8), m3 = kt_ldf2(mb + 8 * KT_MLD + 8);
                const unsigned a[4] = {kt_pack(m0.x * e0.x, m0.y * e0.y), kt_pack(m1.x * e0.x, m1.y * e0.y),
                                       kt_pack(m2.x * e1.x, m2.y * e1.y), kt_pack(m3.x * e1.x, m3.y * e1.y)};
#pragma unroll
                for (int qb = 0; qb < 4; ++qb) {
                    unsigned b[4];
                    kt_ldsm_t(b, Ks, KT_LD, 16 * kk, 16 * (4 * ch + qb), lane);  // F((K ⊙ e^G)ᵀ block)
                    kt_mma(acc[2 * qb], a, b[0], b[1]);
                    kt_mma(acc[2 * qb + 1], a, b[2], b[3]);
                }
            }
        }
        uint4* dst = Wf + (tile * 32 + mt * 8 + 4 * ch) * 32 + lane;
#pragma unroll
        for (int qb = 0; qb < 4; ++qb) dst[qb * 32] = kt_acc_tile(acc[2 * qb], acc[2 * qb + 1]);
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
            kt_ldsm_t(f, Vs, KT_LD, 16 * kk, 16 * w, lane);  // F(Vᵀ block (w, kk))
            const unsigned a[4] = {f[0], f[2], f[1], f[3]};
            const float2 e0 = kt_ldf2(Bt + 16 * kk + 2 * tq), e1 = kt_ldf2(Bt + 16 * kk + 2 * tq + 8);
#pragma unroll
            for (int nt8 = 0; nt8 < 8; ++nt8) {
                if (nt8 >= 2 * kk) {
                    const float* mb = Ls + (16 * kk + 8 * (nt8 & 1) + gq) * KT_MLD + 16 * (nt8 >> 1) + 2 * tq;
                    const float2 m0 = kt_ldf2(mb), m1 = kt_ldf2(mb + 8);
                    kt_mma(acc[nt8], a, kt_pack(m0.x * e0.x, m0.y * e0.y), kt_pack(m1.x * e1.x, m1.y * e1.y));
                }
            }
        }
        uint4* dst = Uf + (tile * 32 + w * 4) * 32 + lane;
#pragma unroll
        for (int ib = 0; ib < 4; ++ib) {
            unsigned a[4];
            kt_acc_afrag(a, acc[2 * ib], acc[2 * ib + 1]);
            dst[ib * 32] = make_uint4(a[0], a[1], a[2], a[3]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// kda_state_tc_bf16: grid (Hv, 128 / 32), block 64 (KT_NW = 2 warps), KT_STATE_SMEM bytes.
// Sequential over the chunks of one head (as gdr_state_tc_bf16_32). Warp w owns 16 value
// columns j of the state as Sᵀ rows: fp32 accumulators sacc (16 n-tiles over the 128
// key channels c), so the chunk step is
//   sa  = bf16(Sᵀ) as A fragments;  Hs[n] = sa (snapshot)
//   Ũᵀ  = Uᵀ − Sᵀ Wᵀ                     (64 mma; Ũ written over U)
//   Sᵀ  ← Sᵀ diag(e^{G_last}) + Ũᵀ K̃      (64 mma)
// The chunk's W and K̃ᵀ, the CTA's Uᵀ slice and dl stream through a KT_STAGES-deep
// cp.async ring (chunk n+STAGES−1 requested while chunk n computes; one barrier per chunk).
#define KT_STAGES 3
#define KT_NW 2
#define KT_STAGE_U4 (2048 + KT_NW * 128 + 32)  // W | K̃ᵀ | Uᵀ slice | dl (uint4)
#define KT_STATE_SMEM (KT_STAGES * KT_STAGE_U4 * 16)
extern "C" __global__ void __launch_bounds__(KT_NW * 32, 1)
    kda_state_tc_bf16(const uint4* __restrict__ Wf, const uint4* __restrict__ Ktf, uint4* Uf,
                      const float* __restrict__ dl, float* state, uint4* __restrict__ Hsf, int t_len) {
    const int h = blockIdx.x, jb0 = blockIdx.y * KT_NW;
    const int nt = (t_len + KT_CH - 1) / KT_CH;
    const size_t hb = (size_t)h * nt;
    float* mat = state + (size_t)h * KT_D * KT_D;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int gq = lane >> 2, tq = lane & 3, jb = jb0 + w;
    // sacc[ct][e] = Sᵀ[j0 + 8(e>>1)][8ct + 2tq + (e&1)] = mat[c][j], j0 = 16·jb + gq.
    const int j0 = 16 * jb + gq;
    float sacc[16][4];
#pragma unroll
    for (int ct = 0; ct < 16; ++ct)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[ct][e] = mat[(size_t)(8 * ct + 2 * tq + (e & 1)) * KT_D + j0 + 8 * (e >> 1)];
    // Requests chunk n into its ring stage (an empty group past the end keeps the group
    // count uniform for the wait).
    auto issue = [&](int n) {
        if (n < nt) {
            uint4* dst = kt_sm + (n % KT_STAGES) * KT_STAGE_U4;
            const uint4* ws = Wf + (hb + n) * 1024;
            const uint4* ks = Ktf + (hb + n) * 1024;
#pragma unroll
            for (int it = 0; it < 1024 / (KT_NW * 32); ++it) {
                const int i = tid + it * KT_NW * 32;
                kt_cp16(dst + i, ws + i);
                kt_cp16(dst + 1024 + i, ks + i);
            }
            const uint4* us = Uf + ((hb + n) * 32 + jb0 * 4) * 32;
#pragma unroll
            for (int it = 0; it < 4; ++it) kt_cp16(dst + 2048 + tid + it * KT_NW * 32, us + tid + it * KT_NW * 32);
            if (tid < 32) kt_cp16(dst + 2048 + KT_NW * 128 + tid, reinterpret_cast<const uint4*>(dl + (hb + n) * KT_D) + tid);
        }
        kt_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < KT_STAGES - 1; ++s) issue(s);
    for (int n = 0; n < nt; ++n) {
        kt_cp_wait<KT_STAGES - 2>();
        __syncthreads();  // chunk n landed for all threads; stage (n−1) % STAGES is free
        issue(n + KT_STAGES - 1);
        const uint4* Ws = kt_sm + (n % KT_STAGES) * KT_STAGE_U4;
        const uint4* Kts = Ws + 1024;
        const float* dls = reinterpret_cast<const float*>(Ws + 2048 + KT_NW * 128);
        unsigned sa[8][4];
#pragma unroll
        for (int kc = 0; kc < 8; ++kc) kt_acc_afrag(sa[kc], sacc[2 * kc], sacc[2 * kc + 1]);
        {
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
                kt_mma(acc[2 * ib], sa[kc], f.x, f.y);
                kt_mma(acc[2 * ib + 1], sa[kc], f.z, f.w);
            }
        // Ũᵀ = Uᵀ − (W S)ᵀ, as bf16 A fragments (Uᵀ is A order too).
        unsigned ua[4][4];
#pragma unroll
        for (int ib = 0; ib < 4; ++ib) {
            const uint4 uc = Ws[2048 + (w * 4 + ib) * 32 + lane];
            const float2 u0 = kt_unpack(uc.x), u1 = kt_unpack(uc.y);
            const float2 u2 = kt_unpack(uc.z), u3 = kt_unpack(uc.w);
            const float* a0 = acc[2 * ib];
            const float* a1 = acc[2 * ib + 1];
            ua[ib][0] = kt_pack(u0.x - a0[0], u0.y - a0[1]);
            ua[ib][1] = kt_pack(u1.x - a0[2], u1.y - a0[3]);
            ua[ib][2] = kt_pack(u2.x - a1[0], u2.y - a1[1]);
            ua[ib][3] = kt_pack(u3.x - a1[2], u3.y - a1[3]);
            Uf[((hb + n) * 32 + jb * 4 + ib) * 32 + lane] = make_uint4(ua[ib][0], ua[ib][1], ua[ib][2], ua[ib][3]);
        }
        // Sᵀ ← Sᵀ diag(e^{G_last}) + Ũᵀ K̃ (channel c = 8ct + 2tq + (e & 1)).
#pragma unroll
        for (int ct = 0; ct < 16; ++ct) {
            const float2 dc = kt_ldf2(dls + 8 * ct + 2 * tq);
            sacc[ct][0] *= dc.x;
            sacc[ct][1] *= dc.y;
            sacc[ct][2] *= dc.x;
            sacc[ct][3] *= dc.y;
        }
#pragma unroll
        for (int ib = 0; ib < 4; ++ib)
#pragma unroll
            for (int cb = 0; cb < 8; ++cb) {
                const uint4 f = Kts[(cb * 4 + ib) * 32 + lane];
                kt_mma(sacc[2 * cb], ua[ib], f.x, f.y);
                kt_mma(sacc[2 * cb + 1], ua[ib], f.z, f.w);
            }
    }
    kt_cp_wait<0>();  // the empty trailing groups
#pragma unroll
    for (int ct = 0; ct < 16; ++ct)
#pragma unroll
        for (int e = 0; e < 4; ++e) mat[(size_t)(8 * ct + 2 * tq + (e & 1)) * KT_D + j0 + 8 * (e >> 1)] = sacc[ct][e];
}

// ---------------------------------------------------------------------------------------
// kda_output_tc_bf16: grid (Hv, NT) (value heads fastest), block 256 (8 warps),
// KT_OUT_SMEM bytes. Per (chunk, head): G; P (diagonal blocks exact in fp32, the six
// off-diagonal blocks on tensor cores) as bf16 [64][KT_ALD]; Q ⊙ e^G in place of Q; then
//   O = (Q ⊙ e^G) S + P Ũ, warp = value columns 16·w.. for all 64 rows, with S (snapshot)
// and Ũ read as B fragments from their (A-order) F-tiles (prefetched into L2 at entry).
#define KT_OUT_SMEM (2 * KT_CH * KT_LD * 2 + KT_CH * KT_GLD * 4 + KT_CH * KT_ALD * 2)
extern "C" __global__ void __launch_bounds__(256, 2)
    kda_output_tc_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const float* __restrict__ g,
                       const uint4* __restrict__ Uf, const uint4* __restrict__ Hsf, bf16* __restrict__ out,
                       int t_len, int hk, int hv) {
    bf16* Qs = reinterpret_cast<bf16*>(kt_sm);                // [64][KT_LD] Q, then Q ⊙ e^G
    bf16* Ks = Qs + KT_CH * KT_LD;                             // [64][KT_LD]
    float* Gs = reinterpret_cast<float*>(Ks + KT_CH * KT_LD);  // [64][KT_GLD]
    bf16* Ps = reinterpret_cast<bf16*>(Gs + KT_CH * KT_GLD);   // [64][KT_ALD]
    const int h = blockIdx.x, n = blockIdx.y, kh = h / (hv / hk), tid = threadIdx.x;
    const int lane = tid & 31, w = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int nt = (t_len + KT_CH - 1) / KT_CH;
    const int t0 = n * KT_CH, len = min(KT_CH, t_len - t0);
    const size_t tile = (size_t)h * nt + n;
    kt_prefetch_l2(reinterpret_cast<const char*>(Hsf + tile * 2048) + 128 * tid);
    if (tid < 128) kt_prefetch_l2(reinterpret_cast<const char*>(Uf + tile * 1024) + 128 * tid);
    kt_load_rows(Qs, q, t0, len, hk, kh, tid);
    kt_load_rows(Ks, k, t0, len, hk, kh, tid);
    kt_load_g(Gs, g, t0, len, hv, h, tid);
    kt_cp_commit();
    kt_cp_wait<0>();
    __syncthreads();
    kt_scan_g(Gs, tid);
    // P: diagonal blocks (every warp, 8 rows each; zeros above the diagonal), then the
    // off-diagonal blocks (warps 0–5). Blocks above the diagonal are never read.
#pragma unroll 1
    for (int m = 0; m < 8; ++m) {
        const int i = kt_diag_rowsel(w, m);
        const float x = kt_diag_row<true>(Qs, Ks, Gs, i, lane);
        if (!(lane & 1)) Ps[i * KT_ALD + (i & ~15) + (lane >> 1)] = __float2bfloat16_rn(x);
    }
    if (w < 6) {
        int I, J;
        kt_offdiag_ij(w, I, J);
        float acc[2][4];
        kt_offdiag(acc, Qs, Ks, Gs, I, J, lane);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = 16 * I + gq + 8 * hh;
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2)
                *reinterpret_cast<unsigned*>(Ps + i * KT_ALD + 16 * J + 8 * nt2 + 2 * tq) =
                    kt_pack(acc[nt2][2 * hh], acc[nt2][2 * hh + 1]);
        }
    }
    __syncthreads();
    // Q ⊙ e^G in place.
    for (int idx = tid; idx < KT_CH * KT_D / 2; idx += 256) {
        const int i = idx >> 6, c = 2 * (idx & 63);
        unsigned* p = reinterpret_cast<unsigned*>(Qs + i * KT_LD + c);
        const float2 x = kt_unpack(*p), gi = kt_ldf2(Gs + i * KT_GLD + c);
        *p = kt_pack(x.x * exp2f(gi.x), x.y * exp2f(gi.y));
    }
    __syncthreads();
    float o[4][2][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][0][e] = o[mt][1][e] = 0.f;
    // O = (Q ⊙ e^G) S: B fragments of S (Sᵀ snapshot block (w, kc), A order: n-tile 0 = (.x, .z)).
    const uint4* hs = Hsf + (tile * 64 + w * 8) * 32 + lane;
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) {
        const uint4 f = hs[kc * 32];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            unsigned a[4];
            kt_ldsm_a(a, Qs, KT_LD, 16 * mt, 16 * kc, lane);
            kt_mma(o[mt][0], a, f.x, f.z);
            kt_mma(o[mt][1], a, f.y, f.w);
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
                kt_ldsm_a(a, Ps, KT_ALD, 16 * mt, 16 * kk, lane);
                kt_mma(o[mt][0], a, f.x, f.z);
                kt_mma(o[mt][1], a, f.y, f.w);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = 16 * mt + gq + 8 * hh;
            if (i < len) {
                bf16* dst = out + ((size_t)(t0 + i) * hv + h) * KT_D + 16 * w + 2 * tq;
#pragma unroll
                for (int nb = 0; nb < 2; ++nb)
                    *reinterpret_cast<__nv_bfloat162*>(dst + 8 * nb) =
                        __floats2bfloat162_rn(o[mt][nb][2 * hh], o[mt][nb][2 * hh + 1]);
            }
        }
}
