// Gated delta rule (Gated DeltaNet core), CPU reference: dataplane/src/linear/gdr.rs.
//
// Layouts (time-major, like FLA and the CPU backend):
//   q, k: [T, Hk, dk] (q L2-normalised and scaled by dk^-0.5, k L2-normalised)
//   v:    [T, Hv, dv];  g, beta: [T, Hv] fp32 (g = log decay ≤ 0);  o: [T, Hv, dv]
//   state: [Hv, dk, dv] fp32 K-major, in/out.  Value head h reads key head h / (Hv/Hk).
// Recurrence: S ← e^{g}S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq.

// ---------------------------------------------------------------------------------------
// Token-by-token recurrence (one-token decode, or any T). grid (Hv, ceil(dv/32)),
// block 128 = 4 warps. Lane = value column j; warp w holds rows [w·DK/4, (w+1)·DK/4) of
// the state column in registers.
template <typename T, int DK>
__device__ void gdr_recurrent_impl(const T* q, const T* k, const T* v, const float* g, const float* beta,
                                   float* state, T* out, int t_len, int hk, int hv, int dv) {
    constexpr int NR = DK / 4;
    const int h = blockIdx.x, kh = h / (hv / hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = blockIdx.y * 32 + lane;
    const bool jv = j < dv;
    __shared__ float ks[DK], qs[DK], part[4][32];
    float* st = state + (size_t)h * DK * dv;
    float s[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) s[r] = jv ? st[(size_t)(w * NR + r) * dv + j] : 0.f;
    for (int t = 0; t < t_len; ++t) {
        __syncthreads();
        for (int i = threadIdx.x; i < DK; i += blockDim.x) {
            ks[i] = to_f(k[((size_t)t * hk + kh) * DK + i]);
            qs[i] = to_f(q[((size_t)t * hk + kh) * DK + i]);
        }
        __syncthreads();
        const float dec = expf(g[(size_t)t * hv + h]), b = beta[(size_t)t * hv + h];
        float p = 0.f;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            s[r] *= dec;
            p += s[r] * ks[w * NR + r];
        }
        part[w][lane] = p;
        __syncthreads();
        const float kv = part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane];
        const float vj = jv ? to_f(v[((size_t)t * hv + h) * dv + j]) : 0.f;
        const float u = b * (vj - kv);
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            s[r] += ks[w * NR + r] * u;
            o += s[r] * qs[w * NR + r];
        }
        __syncthreads();
        part[w][lane] = o;
        __syncthreads();
        if (w == 0 && jv)
            out[((size_t)t * hv + h) * dv + j] = from_f<T>(part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane]);
    }
    if (jv) {
#pragma unroll
        for (int r = 0; r < NR; ++r) st[(size_t)(w * NR + r) * dv + j] = s[r];
    }
}

#define GDR_REC(S, T, DK)                                                                             \
    extern "C" __global__ void __launch_bounds__(128) gdr_recurrent_##S##_##DK(                       \
        const T* q, const T* k, const T* v, const float* g, const float* beta, float* state, T* out,  \
        int t_len, int hk, int hv, int dv) {                                                          \
        gdr_recurrent_impl<T, DK>(q, k, v, g, beta, state, out, t_len, hk, hv, dv);                   \
    }
GDR_REC(f32, float, 64)
GDR_REC(f32, float, 128)
GDR_REC(f32, float, 256)
GDR_REC(bf16, bf16, 64)
GDR_REC(bf16, bf16, 128)
GDR_REC(bf16, bf16, 256)

// One decode token for each of B sequences whose states live in separate buffers: row b
// reads q, k [b, Hk, dk], v [b, Hv, dv], g, beta [b, Hv], writes out [b, Hv, dv], and
// advances the state at address states[b] ([Hv, dk, dv] fp32). grid (Hv, ceil(dv/32), B),
// block 128; each row is exactly gdr_recurrent_* with T = 1.
#define GDR_REC_ROWS(S, T, DK)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) gdr_recurrent_rows_##S##_##DK(                  \
        const T* q, const T* k, const T* v, const float* g, const float* beta,                        \
        const unsigned long long* states, T* out, int hk, int hv, int dv) {                           \
        const size_t b = blockIdx.z;                                                                  \
        gdr_recurrent_impl<T, DK>(q + b * hk * DK, k + b * hk * DK, v + b * hv * dv, g + b * hv,      \
                                  beta + b * hv, reinterpret_cast<float*>(states[b]),                 \
                                  out + b * hv * dv, 1, hk, hv, dv);                                  \
    }
GDR_REC_ROWS(f32, float, 64)
GDR_REC_ROWS(f32, float, 128)
GDR_REC_ROWS(f32, float, 256)
GDR_REC_ROWS(bf16, bf16, 64)
GDR_REC_ROWS(bf16, bf16, 128)
GDR_REC_ROWS(bf16, bf16, 256)

// ---------------------------------------------------------------------------------------
// Chunked (WY) prefill, chunk 64, dk = dv = 128, in three kernels (same algebra as
// gdr::chunked; per chunk with chunk-local cumulative log decay G):
//   A  gdr_prep:   L = strictly-lower(β_i e^{G_i−G_j} k_i·k_j); solve (I+L)[W|U] =
//                  [diag(βe^G)K | diag(β)V]  →  W [Hv,T,dk], U [Hv,T,dv], gcum [Hv,T]
//                  (parallel over chunks × heads)
//   B  gdr_state:  per head, chunks in order:  Hs[n] = S;  Ũ = U − W S (in place in U);
//                  S ← e^{G_c}S + K̃ᵀŨ,  K̃_i = e^{G_c−G_i}k_i.  Optional extra column
//                  blocks carry the transition T (a state with U = 0), giving T_C.
//                  (parallel over heads × 32-column blocks)
//   C  gdr_output: O = diag(e^G) Q Hs[n] + (QKᵀ ⊙ e^{G_i−G_m})_{m≤i} Ũ
//                  (parallel over chunks × heads)
#define CH 64
#define DKC 128
#define DVC 128
#define LDX (DKC + DVC + 1)
#define LDT 132

#define NTH 256
// Below this magnitude transition entries are flushed to 0 after every chunk, as the
// CPU reference does (linear::gdr FLUSH_UNIT = 2^-40): a fully decayed T_C is exactly 0.
#define FLUSH_UNIT 9.094947e-13f

template <typename T>
__device__ void gdr_prep_impl(const T* k, const T* v, const float* g, const float* beta, float* gcum,
                              float* W, float* U, int t_len, int hk, int hv) {
    extern __shared__ float sm[];
    float* X = sm;               // [CH][LDX]  K | V, then the scaled right-hand sides
    float* L = X + CH * LDX;     // [CH][CH] transposed: L[j·CH + i] = L_ij
    float* G = L + CH * CH;      // [CH]
    float* Bt = G + CH;          // [CH]
    float* Eb = Bt + CH;         // [CH]  β_i e^{G_i}
    const int n = blockIdx.x, h = blockIdx.y, kh = h / (hv / hk), tid = threadIdx.x;
    const int t0 = n * CH, len = min(CH, t_len - t0);
    if (tid < 32) {
        // Inclusive scan of g over the chunk (2 tokens per lane).
        const int i0 = 2 * tid, i1 = 2 * tid + 1;
        float a = i0 < len ? g[(size_t)(t0 + i0) * hv + h] : 0.f;
        float b = i1 < len ? g[(size_t)(t0 + i1) * hv + h] : 0.f;
        float s = a + b;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            float y = __shfl_up_sync(0xffffffffu, s, o);
            if (tid >= o) s += y;
        }
        const float b0 = i0 < len ? beta[(size_t)(t0 + i0) * hv + h] : 0.f;
        const float b1 = i1 < len ? beta[(size_t)(t0 + i1) * hv + h] : 0.f;
        G[i1] = s;
        G[i0] = s - b;
        Bt[i0] = b0;
        Bt[i1] = b1;
        Eb[i0] = b0 * expf(s - b);
        Eb[i1] = b1 * expf(s);
    }
    // All loads of the chunk issued before any is used (compile-time trip counts).
    {
        float kx[CH * DKC / NTH], vx[CH * DVC / NTH];
#pragma unroll
        for (int it = 0; it < CH * DKC / NTH; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            kx[it] = i < len ? to_f(k[((size_t)(t0 + i) * hk + kh) * DKC + c]) : 0.f;
        }
#pragma unroll
        for (int it = 0; it < CH * DVC / NTH; ++it) {
            const int idx = tid + it * NTH, i = idx / DVC, c = idx % DVC;
            vx[it] = i < len ? to_f(v[((size_t)(t0 + i) * hv + h) * DVC + c]) : 0.f;
        }
#pragma unroll
        for (int it = 0; it < CH * DKC / NTH; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            X[i * LDX + c] = kx[it];
        }
#pragma unroll
        for (int it = 0; it < CH * DVC / NTH; ++it) {
            const int idx = tid + it * NTH, i = idx / DVC, c = idx % DVC;
            X[i * LDX + DKC + c] = vx[it];
        }
    }
    __syncthreads();
    if (tid < len) gcum[(size_t)h * t_len + t0 + tid] = G[tid];
    // L in 4×4 register tiles; tiles strictly above the diagonal are zero.
    {
        const int ti = tid >> 4, tj = tid & 15;
        float acc[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) acc[a][b] = 0.f;
        if (tj <= ti) {
#pragma unroll 4
            for (int c = 0; c < DKC; ++c) {
                float xi[4], xj[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) xi[a] = X[(ti * 4 + a) * LDX + c];
#pragma unroll
                for (int b = 0; b < 4; ++b) xj[b] = X[(tj * 4 + b) * LDX + c];
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) acc[a][b] += xi[a] * xj[b];
            }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int i = ti * 4 + a, j = tj * 4 + b;
                L[j * CH + i] = j < i ? Bt[i] * expf(G[i] - G[j]) * acc[a][b] : 0.f;  // transposed
            }
    }
    __syncthreads();
    // Forward substitution, one right-hand-side column per thread, 16 rows at a time:
    // contributions of earlier row blocks from the solved rows in X (one shared load per
    // row, transposed L read as float4), then the 16×16 block in registers.
    for (int col = tid; col < DKC + DVC; col += NTH) {
        const bool isk = col < DKC;
        float* dst = isk ? W + ((size_t)h * t_len + t0) * DKC + col
                         : U + ((size_t)h * t_len + t0) * DVC + (col - DKC);
        const int ld = isk ? DKC : DVC;
#pragma unroll 1
        for (int bb = 0; bb < CH / 16; ++bb) {
            const int r0 = bb * 16;
            float acc[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) acc[r] = (isk ? Eb[r0 + r] : Bt[r0 + r]) * X[(r0 + r) * LDX + col];
            for (int m = 0; m < r0; ++m) {
                const float xm = X[m * LDX + col];
                const float4* lt = reinterpret_cast<const float4*>(L + m * CH + r0);
#pragma unroll
                for (int q4 = 0; q4 < 4; ++q4) {
                    const float4 l = lt[q4];
                    acc[4 * q4 + 0] -= l.x * xm;
                    acc[4 * q4 + 1] -= l.y * xm;
                    acc[4 * q4 + 2] -= l.z * xm;
                    acc[4 * q4 + 3] -= l.w * xm;
                }
            }
#pragma unroll
            for (int r = 0; r < 16; ++r) {
#pragma unroll
                for (int r2 = 0; r2 < r; ++r2) acc[r] -= L[(r0 + r2) * CH + r0 + r] * acc[r2];
                X[(r0 + r) * LDX + col] = acc[r];
                if (r0 + r < len) dst[(size_t)(r0 + r) * ld] = acc[r];
            }
        }
    }
}

// grid (Hv, DVC/32 [+ DKC/32 when trans != null]), block 256.
// state: [Hv, DKC, DVC] in/out; trans: [Hv, DKC, DKC] in/out (the caller sets I for a
// fresh segment); Hs: [NT, Hv, DKC, DVC] chunk-initial states (written).
// The next chunk's W, U, k and G are loaded into registers while this chunk computes.
#define SW (CH * DKC / 4 / NTH)   // float4 of W per thread (8)
#define SU (CH * 32 / NTH)        // U entries per thread (8)
#define SK (CH * DKC / NTH)       // k entries per thread (32)
template <typename T>
__device__ void gdr_state_impl(const T* k, const float* gcum, const float* W, float* U, float* state,
                               float* trans, float* Hs, int t_len, int hk, int hv) {
    extern __shared__ float sm[];
    float* Ws = sm;                 // [CH][LDT]
    float* Ks = Ws + CH * LDT;      // [CH][LDT]  K̃
    float* S = Ks + CH * LDT;       // [DKC][32]
    float* Ut = S + DKC * 32;       // [CH][32]
    float* G = Ut + CH * 32;        // [CH]
    const int h = blockIdx.x, kh = h / (hv / hk), tid = threadIdx.x;
    const int lane = tid & 31, ty = tid >> 5;
    const int nvb = DVC / 32;
    const bool is_t = blockIdx.y >= nvb;
    const int col0 = (is_t ? blockIdx.y - nvb : blockIdx.y) * 32;
    const int ncols = is_t ? DKC : DVC;
    float* mat = is_t ? trans + (size_t)h * DKC * DKC : state + (size_t)h * DKC * DVC;
    for (int idx = tid; idx < DKC * 32; idx += NTH) {
        const int c = idx >> 5, j = idx & 31;
        S[idx] = mat[(size_t)c * ncols + col0 + j];
    }
    const int nt = (t_len + CH - 1) / CH;
    float4 wr[SW];
    float ur[SU];
    T kr[SK];
    float gr = 0.f;
    auto fetch = [&](int n) {
        const int t0 = n * CH, len = min(CH, t_len - t0);
#pragma unroll
        for (int it = 0; it < SW; ++it) {
            const int idx = tid + it * NTH, i = idx / (DKC / 4), c4 = idx % (DKC / 4);
            wr[it] = i < len ? *reinterpret_cast<const float4*>(W + ((size_t)h * t_len + t0 + i) * DKC + c4 * 4)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int it = 0; it < SU; ++it) {
            const int idx = tid + it * NTH, i = idx >> 5, j = idx & 31;
            ur[it] = (!is_t && i < len) ? U[((size_t)h * t_len + t0 + i) * DVC + col0 + j] : 0.f;
        }
#pragma unroll
        for (int it = 0; it < SK; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            kr[it] = i < len ? k[((size_t)(t0 + i) * hk + kh) * DKC + c] : from_f<T>(0.f);
        }
        gr = (tid < len) ? gcum[(size_t)h * t_len + t0 + tid] : 0.f;
    };
    fetch(0);
    for (int n = 0; n < nt; ++n) {
        const int t0 = n * CH, len = min(CH, t_len - t0);
#pragma unroll
        for (int it = 0; it < SW; ++it) {
            const int idx = tid + it * NTH, i = idx / (DKC / 4), c4 = idx % (DKC / 4);
            *reinterpret_cast<float4*>(Ws + i * LDT + c4 * 4) = wr[it];
        }
#pragma unroll
        for (int it = 0; it < SU; ++it) Ut[tid + it * NTH] = ur[it];
#pragma unroll
        for (int it = 0; it < SK; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            Ks[i * LDT + c] = to_f(kr[it]);
        }
        if (tid < CH) G[tid] = gr;
        __syncthreads();
        if (n + 1 < nt) fetch(n + 1);
        const float gl = G[len - 1];
#pragma unroll
        for (int it = 0; it < SK; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            Ks[i * LDT + c] *= expf(gl - G[i]);
        }
        if (!is_t && Hs) {
            float* hs = Hs + ((size_t)n * hv + h) * DKC * DVC + col0;
#pragma unroll 4
            for (int idx = tid; idx < DKC * 32; idx += NTH) {
                const int c = idx >> 5, j = idx & 31;
                hs[(size_t)c * DVC + j] = S[idx];
            }
        }
        // Ũ = U − W S: warp ty owns rows ty·8 .. ty·8+7, lane = column.
        {
            float acc[8];
#pragma unroll
            for (int r = 0; r < 8; ++r) acc[r] = Ut[(ty * 8 + r) * 32 + lane];
#pragma unroll 4
            for (int c = 0; c < DKC; c += 4) {
                const float s0 = S[(c + 0) * 32 + lane], s1 = S[(c + 1) * 32 + lane];
                const float s2 = S[(c + 2) * 32 + lane], s3 = S[(c + 3) * 32 + lane];
#pragma unroll
                for (int r = 0; r < 8; ++r) {
                    const float4 wv = *reinterpret_cast<const float4*>(Ws + (ty * 8 + r) * LDT + c);
                    acc[r] -= wv.x * s0 + wv.y * s1 + wv.z * s2 + wv.w * s3;
                }
            }
            __syncthreads();  // Ks scaled; every thread done reading Ut rows it does not own
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const int i = ty * 8 + r;
                Ut[i * 32 + lane] = acc[r];
                if (!is_t && i < len) U[((size_t)h * t_len + t0 + i) * DVC + col0 + lane] = acc[r];
            }
        }
        __syncthreads();
        // S ← e^{G_c} S + K̃ᵀ Ũ: warp ty owns rows ty·16 .. ty·16+15 of the column block.
        {
            const float eg = expf(gl);
            float acc[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) acc[r] = eg * S[(ty * 16 + r) * 32 + lane];
#pragma unroll 4
            for (int i = 0; i < CH; ++i) {
                const float u = Ut[i * 32 + lane];
#pragma unroll
                for (int q4 = 0; q4 < 4; ++q4) {
                    const float4 kv = *reinterpret_cast<const float4*>(Ks + i * LDT + ty * 16 + q4 * 4);
                    acc[q4 * 4 + 0] += kv.x * u;
                    acc[q4 * 4 + 1] += kv.y * u;
                    acc[q4 * 4 + 2] += kv.z * u;
                    acc[q4 * 4 + 3] += kv.w * u;
                }
            }
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                float a = acc[r];
                if (is_t && fabsf(a) < FLUSH_UNIT) a = 0.f;
                S[(ty * 16 + r) * 32 + lane] = a;
            }
        }
        __syncthreads();
    }
    for (int idx = tid; idx < DKC * 32; idx += NTH) {
        const int c = idx >> 5, j = idx & 31;
        mat[(size_t)c * ncols + col0 + j] = S[idx];
    }
}

// grid (NT, Hv), block 256.
template <typename T>
__device__ void gdr_output_impl(const T* q, const T* k, const float* gcum, const float* U, const float* Hs,
                                T* out, int t_len, int hk, int hv) {
    extern __shared__ float sm[];
    float* Qs = sm;               // [CH][LDT]
    float* Bs = Qs + CH * LDT;    // [CH][LDT] K, then 32-row tiles [32][DVC] of Hs / Ũ
    float* P = Bs + CH * LDT;     // [CH][CH+1]
    float* G = P + CH * (CH + 1); // [CH]
    const int n = blockIdx.x, h = blockIdx.y, kh = h / (hv / hk), tid = threadIdx.x;
    const int lane = tid & 31, ty = tid >> 5;
    const int t0 = n * CH, len = min(CH, t_len - t0);
    if (tid < CH) G[tid] = tid < len ? gcum[(size_t)h * t_len + t0 + tid] : 0.f;
    {
        float qx[CH * DKC / NTH], kx[CH * DKC / NTH];
#pragma unroll
        for (int it = 0; it < CH * DKC / NTH; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            const size_t src = ((size_t)(t0 + i) * hk + kh) * DKC + c;
            qx[it] = i < len ? to_f(q[src]) : 0.f;
            kx[it] = i < len ? to_f(k[src]) : 0.f;
        }
#pragma unroll
        for (int it = 0; it < CH * DKC / NTH; ++it) {
            const int idx = tid + it * NTH, i = idx / DKC, c = idx % DKC;
            Qs[i * LDT + c] = qx[it];
            Bs[i * LDT + c] = kx[it];
        }
    }
    __syncthreads();
    // P = (Q Kᵀ ⊙ e^{G_i − G_m}) masked to m ≤ i: rows ty·8+r, columns lane, lane+32.
    {
        float acc[8][2];
#pragma unroll
        for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = 0.f;
#pragma unroll 2
        for (int c = 0; c < DKC; c += 4) {
            const float4 k0 = *reinterpret_cast<const float4*>(Bs + lane * LDT + c);
            const float4 k1 = *reinterpret_cast<const float4*>(Bs + (lane + 32) * LDT + c);
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const float4 qv = *reinterpret_cast<const float4*>(Qs + (ty * 8 + r) * LDT + c);
                acc[r][0] += qv.x * k0.x + qv.y * k0.y + qv.z * k0.z + qv.w * k0.w;
                acc[r][1] += qv.x * k1.x + qv.y * k1.y + qv.z * k1.z + qv.w * k1.w;
            }
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int i = ty * 8 + r;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = lane + 32 * e;
                P[i * (CH + 1) + m] = (m <= i && i < len) ? acc[r][e] * expf(G[i] - G[m]) : 0.f;
            }
        }
    }
    __syncthreads();
    float acc[8][4];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] = 0.f;
    // Q · Hs[n], 32 rows of Hs at a time.
    const float* hs = Hs + ((size_t)n * hv + h) * DKC * DVC;
    for (int c0 = 0; c0 < DKC; c0 += 32) {
        {
            float4 hx[32 * DVC / 4 / NTH];
#pragma unroll
            for (int it = 0; it < 32 * DVC / 4 / NTH; ++it)
                hx[it] = reinterpret_cast<const float4*>(hs + (size_t)c0 * DVC)[tid + it * NTH];
#pragma unroll
            for (int it = 0; it < 32 * DVC / 4 / NTH; ++it) reinterpret_cast<float4*>(Bs)[tid + it * NTH] = hx[it];
        }
        __syncthreads();
#pragma unroll 2
        for (int cc = 0; cc < 32; cc += 4) {
            float sv[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int e = 0; e < 4; ++e) sv[a][e] = Bs[(cc + a) * DVC + lane + 32 * e];
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const float4 qv = *reinterpret_cast<const float4*>(Qs + (ty * 8 + r) * LDT + c0 + cc);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc[r][e] += qv.x * sv[0][e] + qv.y * sv[1][e] + qv.z * sv[2][e] + qv.w * sv[3][e];
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const float eg = expf(G[ty * 8 + r]);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] *= eg;
    }
    // + P Ũ, 32 rows of Ũ at a time.
    const float* ub = U + ((size_t)h * t_len + t0) * DVC;
    for (int m0 = 0; m0 < CH; m0 += 32) {
        {
            float4 ux[32 * DVC / 4 / NTH];
#pragma unroll
            for (int it = 0; it < 32 * DVC / 4 / NTH; ++it) {
                const int idx = tid + it * NTH, m = idx / (DVC / 4);
                ux[it] = (m0 + m < len) ? reinterpret_cast<const float4*>(ub + (size_t)m0 * DVC)[idx]
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int it = 0; it < 32 * DVC / 4 / NTH; ++it) reinterpret_cast<float4*>(Bs)[tid + it * NTH] = ux[it];
        }
        __syncthreads();
#pragma unroll 4
        for (int mm = 0; mm < 32; ++mm) {
            float uv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) uv[e] = Bs[mm * DVC + lane + 32 * e];
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const float p = P[(ty * 8 + r) * (CH + 1) + m0 + mm];
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[r][e] += p * uv[e];
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const int i = ty * 8 + r;
        if (i < len) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                out[((size_t)(t0 + i) * hv + h) * DVC + lane + 32 * e] = from_f<T>(acc[r][e]);
        }
    }
}

#define GDR_CHUNK(S, T)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) gdr_prep_##S(                                   \
        const T* k, const T* v, const float* g, const float* beta, float* gcum, float* W, float* U,   \
        int t_len, int hk, int hv) {                                                                  \
        gdr_prep_impl<T>(k, v, g, beta, gcum, W, U, t_len, hk, hv);                                   \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 2) gdr_state_##S(                                  \
        const T* k, const float* gcum, const float* W, float* U, float* state, float* trans,          \
        float* Hs, int t_len, int hk, int hv) {                                                       \
        gdr_state_impl<T>(k, gcum, W, U, state, trans, Hs, t_len, hk, hv);                            \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gdr_output_##S(                                 \
        const T* q, const T* k, const float* gcum, const float* U, const float* Hs, T* out,           \
        int t_len, int hk, int hv) {                                                                  \
        gdr_output_impl<T>(q, k, gcum, U, Hs, out, t_len, hk, hv);                                   \
    }
GDR_CHUNK(f32, float)
GDR_CHUNK(bf16, bf16)

// Sets trans [Hv, d, d] to Hv identity matrices.
extern "C" __global__ void set_identity(float* trans, int hv, int d) {
    const size_t total = (size_t)hv * d * d;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t r = idx % ((size_t)d * d);
        trans[idx] = (r / d == r % d) ? 1.f : 0.f;
    }
}
