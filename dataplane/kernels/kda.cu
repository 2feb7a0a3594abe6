// Kimi Delta Attention (KDA, the linear layers of Kimi-Linear) on the GPU: input
// preparation, forget gate, the recurrence (a per-token kernel, the GPU reference and
// the decode step, and a chunked WY prefill that can also build the span transition
// T_C), and the sigmoid-gated output RMSNorm. Host side: dataplane/src/cuda/kda.rs and kimi.rs.
// CPU references: mixers/kda/{layer,naive,chunk}.rs.
//
// Layouts (time-major, as the CPU): q, k [T, Hk, dk]; v [T, Hv, dv]; log decays
// g [T, Hv, dk] fp32 (≤ 0); beta [T, Hv] fp32; state [Hv, dk, dv] fp32 K-major;
// transition [Hv, dk, dk] fp32 row-major (T[i][j] multiplies state row j into row i).

// Input preparation of one span. mixed: [T, 3·H·d] (conv + SiLU of q|k|v); proj:
// [T, n_in] (rows q|k|v [3·H·d], f_a [d], g_a [d], b [H]). Writes q, k [T, H, d]
// (each head L2-normalised x·rsqrt(Σx² + eps); q also times `scale`), v [T, H, d],
// fa, ga [T, d] and beta [T, H] = sigmoid(b).
// Grid (T, 2H + 1), block a multiple of 32: blocks y < 2H normalise one head of q
// (y < H) or k; block 2H copies the rest of the token.
template <typename T>
__device__ void kda_prep_impl(const T* mixed, const T* proj, T* q, T* k, T* v, T* fa, T* ga, float* beta,
                              int nh, int d, int n_in, float scale, float eps) {
    __shared__ float sh[32];
    const int t = blockIdx.x, y = blockIdx.y;
    const int wd = nh * d;
    const T* m = mixed + (size_t)t * 3 * wd;
    if (y < 2 * nh) {
        const int which = y / nh, h = y % nh;
        const T* src = m + (size_t)which * wd + (size_t)h * d;
        float ss = 0.f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            const float x = to_f(src[i]);
            ss += x * x;
        }
        ss = block_sum(ss, sh);
        const float r = 1.f / sqrtf(ss + eps);
        T* dst = (which == 0 ? q : k) + (size_t)t * wd + (size_t)h * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float x = to_f(src[i]) * r;
            if (which == 0) x *= scale;
            dst[i] = from_f<T>(x);
        }
        return;
    }
    const T* p = proj + (size_t)t * n_in + 3 * (size_t)wd;
    for (int i = threadIdx.x; i < wd; i += blockDim.x) v[(size_t)t * wd + i] = m[2 * (size_t)wd + i];
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        fa[(size_t)t * d + i] = p[i];
        ga[(size_t)t * d + i] = p[d + i];
    }
    for (int i = threadIdx.x; i < nh; i += blockDim.x) {
        const float b = to_f(p[2 * d + i]);
        beta[(size_t)t * nh + i] = 1.f / (1.f + expf(-b));
    }
}

__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Forget gate: g[i] = neg_a[(i % wd) / d] · softplus(fb[i] + dt_bias[i % wd]) over
// n = T·wd entries (fb: [T, wd], the f_b projection; g fp32). Grid-stride.
template <typename T>
__device__ void kda_gate_impl(const T* fb, const float* neg_a, const float* dt_bias, float* g, long long n,
                              int wd, int d) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i % wd);
        g[i] = neg_a[j / d] * softplus_f(to_f(fb[i]) + dt_bias[j]);
    }
}

// Sigmoid-gated RMSNorm, one block per row of width d:
// y = w · x · rsqrt(mean(x²) + eps) · sigmoid(gate). x, gate, y: [rows, d]; w: [d].
template <typename T>
__device__ void kda_gated_norm_impl(const T* x, const T* gate, const float* w, T* y, int d, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = to_f(x[base + i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = to_f(x[base + i]) * r * w[i];
        const float s = 1.f / (1.f + expf(-to_f(gate[base + i])));
        y[base + i] = from_f<T>(v * s);
    }
}

// The KDA recurrence token by token (the GPU reference and the decode step), the
// same operation order as mixers/kda/naive.rs:
//   S ← diag(exp g_t) S;  u = β_t (v_t − Sᵀ k_t);  S += k_t uᵀ;  o_t = Sᵀ q_t.
// Grid (Hv, ceil(dv / blockDim.x)); one thread per state column; state in global memory.
template <typename T>
__device__ void kda_recurrent_impl(const T* q, const T* k, const T* v, const float* g, const float* beta,
                                   float* state, T* out, int t_len, int hk, int hv, int dk, int dv) {
    const int h = blockIdx.x, kh = h / (hv / hk);
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= dv) return;
    float* st = state + (size_t)h * dk * dv;
    for (int t = 0; t < t_len; ++t) {
        const T* kt = k + ((size_t)t * hk + kh) * dk;
        const T* qt = q + ((size_t)t * hk + kh) * dk;
        const float* gt = g + ((size_t)t * hv + h) * dk;
        const float b = beta[(size_t)t * hv + h];
        float kv = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float s = st[(size_t)i * dv + j] * expf(gt[i]);
            st[(size_t)i * dv + j] = s;
            kv += to_f(kt[i]) * s;
        }
        const float u = b * (to_f(v[((size_t)t * hv + h) * dv + j]) - kv);
        float o = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float s = st[(size_t)i * dv + j] + to_f(kt[i]) * u;
            st[(size_t)i * dv + j] = s;
            o += to_f(qt[i]) * s;
        }
        out[((size_t)t * hv + h) * dv + j] = from_f<T>(o);
    }
}

// Floats of chunked-kernel workspace per head (see kda_chunked_impl).
__host__ __device__ __forceinline__ size_t kda_ws_per_head(int chunk, int dk, int dv, int with_trans) {
    return (size_t)chunk * dk * 2 + (size_t)chunk * chunk * 2 + (size_t)chunk * dv +
           (with_trans ? (size_t)dk * dk * 2 : 0);
}

// Chunked KDA prefill in the WY form with per-channel decays (mixers/kda/chunk.rs),
// one block per value head, chunks of `chunk` tokens. Per chunk of n tokens from S₀,
// γ_i = Σ_{s≤i} g_s and E_ij = exp(γ_i − γ_j) per channel (pairwise, never factored):
//   A_ij = −β_i Σ_d k_id k_jd E_ijd (j < i),   QK_ij = Σ_d q_id k_jd E_ijd (j ≤ i)
//   U = (I − A)⁻¹ (β v),  W = (I − A)⁻¹ (β k ⊙ exp γ)      (forward substitution)
//   V' = U − W S₀
//   o_i = (q_i ⊙ exp γ_i)ᵀ S₀ + Σ_{j≤i} QK_ij V'_j
//   S₁ = diag(exp γ_n) S₀ + K̃ᵀ V',  K̃_j = k_j ⊙ exp(γ_n − γ_j)
//   T ← (diag(exp γ_n) − K̃ᵀ W) T                            (when `trans` is given)
// ws: [Hv, kda_ws_per_head] fp32 scratch (γ [n, dk], W [n, dk], A and QK [n, n],
// U/V' [n, dv], then with trans two [dk, dk]). trans may be null.
template <typename T>
__device__ void kda_chunked_impl(const T* q, const T* k, const T* v, const float* g, const float* beta,
                                 float* state, T* out, float* trans, float* ws, int t_len, int hk, int hv,
                                 int dk, int dv, int chunk) {
    const int h = blockIdx.x, kh = h / (hv / hk);
    const int tid = threadIdx.x, nt = blockDim.x;
    float* S = state + (size_t)h * dk * dv;
    float* Tm = trans ? trans + (size_t)h * dk * dk : nullptr;
    float* base = ws + (size_t)h * kda_ws_per_head(chunk, dk, dv, trans != nullptr);
    float* gam = base;
    float* W = gam + (size_t)chunk * dk;
    float* A = W + (size_t)chunk * dk;
    float* QK = A + (size_t)chunk * chunk;
    float* U = QK + (size_t)chunk * chunk;
    float* tc = U + (size_t)chunk * dv;
    float* tn = tc + (size_t)dk * dk;
    for (int c0 = 0; c0 < t_len; c0 += chunk) {
        const int n = min(chunk, t_len - c0);
        // γ: in-chunk cumulative log decay.
        for (int a = tid; a < dk; a += nt) {
            float cum = 0.f;
            for (int i = 0; i < n; ++i) {
                cum += g[((size_t)(c0 + i) * hv + h) * dk + a];
                gam[(size_t)i * dk + a] = cum;
            }
        }
        __syncthreads();
        // A (strictly lower, with its minus sign) and QK (lower with the diagonal).
        for (int idx = tid; idx < n * n; idx += nt) {
            const int i = idx / n, j = idx % n;
            float sq = 0.f, sk = 0.f;
            if (j <= i) {
                const T* qi = q + ((size_t)(c0 + i) * hk + kh) * dk;
                const T* ki = k + ((size_t)(c0 + i) * hk + kh) * dk;
                const T* kj = k + ((size_t)(c0 + j) * hk + kh) * dk;
                for (int a = 0; a < dk; ++a) {
                    const float w = to_f(kj[a]) * expf(gam[(size_t)i * dk + a] - gam[(size_t)j * dk + a]);
                    sq += to_f(qi[a]) * w;
                    sk += to_f(ki[a]) * w;
                }
            }
            QK[idx] = sq;
            A[idx] = j < i ? -beta[(size_t)(c0 + i) * hv + h] * sk : 0.f;
        }
        __syncthreads();
        // U = (I − A)⁻¹ (β v), W = (I − A)⁻¹ (β k ⊙ exp γ): one thread per column.
        for (int col = tid; col < dv + dk; col += nt) {
            for (int i = 0; i < n; ++i) {
                const float b = beta[(size_t)(c0 + i) * hv + h];
                float acc;
                if (col < dv) {
                    acc = b * to_f(v[((size_t)(c0 + i) * hv + h) * dv + col]);
                    for (int j = 0; j < i; ++j) acc += A[(size_t)i * n + j] * U[(size_t)j * dv + col];
                    U[(size_t)i * dv + col] = acc;
                } else {
                    const int a = col - dv;
                    acc = b * to_f(k[((size_t)(c0 + i) * hk + kh) * dk + a]) * expf(gam[(size_t)i * dk + a]);
                    for (int j = 0; j < i; ++j) acc += A[(size_t)i * n + j] * W[(size_t)j * dk + a];
                    W[(size_t)i * dk + a] = acc;
                }
            }
        }
        __syncthreads();
        // V' = U − W S₀ (in place of U).
        for (int idx = tid; idx < n * dv; idx += nt) {
            const int i = idx / dv, c = idx % dv;
            float s = 0.f;
            for (int a = 0; a < dk; ++a) s += W[(size_t)i * dk + a] * S[(size_t)a * dv + c];
            U[idx] -= s;
        }
        __syncthreads();
        // o = (q ⊙ exp γ) S₀ + QK V'.
        for (int idx = tid; idx < n * dv; idx += nt) {
            const int i = idx / dv, c = idx % dv;
            const T* qi = q + ((size_t)(c0 + i) * hk + kh) * dk;
            float o = 0.f;
            for (int a = 0; a < dk; ++a) o += to_f(qi[a]) * expf(gam[(size_t)i * dk + a]) * S[(size_t)a * dv + c];
            for (int j = 0; j <= i; ++j) o += QK[(size_t)i * n + j] * U[(size_t)j * dv + c];
            out[((size_t)(c0 + i) * hv + h) * dv + c] = from_f<T>(o);
        }
        __syncthreads();
        // S₁ = diag(exp γ_n) S₀ + K̃ᵀ V' (each element reads only its own old value).
        const float* last = gam + (size_t)(n - 1) * dk;
        for (int idx = tid; idx < dk * dv; idx += nt) {
            const int a = idx / dv, c = idx % dv;
            float s = expf(last[a]) * S[idx];
            for (int j = 0; j < n; ++j)
                s += to_f(k[((size_t)(c0 + j) * hk + kh) * dk + a]) * expf(last[a] - gam[(size_t)j * dk + a]) *
                     U[(size_t)j * dv + c];
            S[idx] = s;
        }
        if (Tm) {
            // tc = diag(exp γ_n) − K̃ᵀ W, then T ← tc · T.
            for (int idx = tid; idx < dk * dk; idx += nt) {
                const int a = idx / dk, b = idx % dk;
                float s = 0.f;
                for (int j = 0; j < n; ++j)
                    s += to_f(k[((size_t)(c0 + j) * hk + kh) * dk + a]) * expf(last[a] - gam[(size_t)j * dk + a]) *
                         W[(size_t)j * dk + b];
                tc[idx] = (a == b ? expf(last[a]) : 0.f) - s;
            }
            __syncthreads();
            for (int idx = tid; idx < dk * dk; idx += nt) {
                const int a = idx / dk, b = idx % dk;
                float s = 0.f;
                for (int x = 0; x < dk; ++x) s += tc[(size_t)a * dk + x] * Tm[(size_t)x * dk + b];
                tn[idx] = s;
            }
            __syncthreads();
            for (int idx = tid; idx < dk * dk; idx += nt) Tm[idx] = tn[idx];
        }
        __syncthreads();
    }
}

#define KDA_KERNELS(S, T)                                                                                     \
    extern "C" __global__ void kda_prep_##S(const T* mixed, const T* proj, T* q, T* k, T* v, T* fa, T* ga,   \
                                            float* beta, int nh, int d, int n_in, float scale, float eps) {   \
        kda_prep_impl<T>(mixed, proj, q, k, v, fa, ga, beta, nh, d, n_in, scale, eps);                        \
    }                                                                                                         \
    extern "C" __global__ void kda_gate_##S(const T* fb, const float* neg_a, const float* dt_bias, float* g,  \
                                            long long n, int wd, int d) {                                     \
        kda_gate_impl<T>(fb, neg_a, dt_bias, g, n, wd, d);                                                    \
    }                                                                                                         \
    extern "C" __global__ void kda_gated_norm_##S(const T* x, const T* gate, const float* w, T* y, int d,     \
                                                  float eps) {                                                \
        kda_gated_norm_impl<T>(x, gate, w, y, d, eps);                                                        \
    }                                                                                                         \
    extern "C" __global__ void kda_recurrent_##S(const T* q, const T* k, const T* v, const float* g,          \
                                                 const float* beta, float* state, T* out, int t_len, int hk,  \
                                                 int hv, int dk, int dv) {                                    \
        kda_recurrent_impl<T>(q, k, v, g, beta, state, out, t_len, hk, hv, dk, dv);                           \
    }                                                                                                         \
    extern "C" __global__ void kda_chunked_##S(const T* q, const T* k, const T* v, const float* g,            \
                                               const float* beta, float* state, T* out, float* trans,         \
                                               float* ws, int t_len, int hk, int hv, int dk, int dv,          \
                                               int chunk) {                                                   \
        kda_chunked_impl<T>(q, k, v, g, beta, state, out, trans, ws, t_len, hk, hv, dk, dv, chunk);           \
    }
KDA_KERNELS(f32, float)
KDA_KERNELS(bf16, bf16)
