// Glue kernels of the whole-model forward (dataplane/src/cuda/model.rs): embedding
// gather, residual add (alone and fused with the next RMSNorm), GDN input preparation
// (q/k L2-norm, v/z copies, g and β in one launch), attention input preparation
// (projection split, q/k RMSNorm and RoPE in one launch) and output gate, SwiGLU, the host-routed MoE gather /
// scatter, and generic (any head dim) fallbacks of the gated delta rule recurrence and
// of causal attention for head dims the tuned kernels are not built for (the tiny
// golden models: dk = dv = 16, head_dim = 32). All math in fp32; T is float or bf16.
// Every kernel uses a grid-stride loop or checks its bounds, so any grid size is safe.

#define GRID_STRIDE(idx, total) \
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < (total); idx += (size_t)gridDim.x * blockDim.x)

// x[t, :] = table[tokens[t], :]; table: [vocab, h]; x: [t, h]. An id ≥ vocab gives zeros
// (the host refuses such ids before launching).
template <typename T>
__device__ void embed_gather_impl(const T* table, const unsigned int* tokens, T* x, int t, int h, int vocab) {
    GRID_STRIDE(idx, (size_t)t * h) {
        const size_t r = idx / h, c = idx % h;
        const unsigned int id = tokens[r];
        x[idx] = id < (unsigned int)vocab ? table[(size_t)id * h + c] : from_f<T>(0.f);
    }
}

// x += y over n elements.
template <typename T>
__device__ void add_inplace_impl(T* x, const T* y, size_t n) {
    GRID_STRIDE(idx, n) { x[idx] = from_f<T>(to_f(x[idx]) + to_f(y[idx])); }
}

// GDN q/k: mixed: [t, cd] (q_all | k_all | v_all after conv + SiLU), head j < hk of the
// q part → q[t, j, :] = x · rsqrt(Σx² + eps) · q_scale; head j ≥ hk → k[t, j − hk, :]
// = x · rsqrt(Σx² + eps). Blocks (t, j < 2·hk) of gdn_prep, block a multiple of 32 (≤ 1024).
template <typename T>
__device__ void gdn_qk_impl(const T* mixed, T* q, T* k, int hk, int dk, int cd, float q_scale, float eps) {
    __shared__ float sh[32];
    const int tok = blockIdx.x, j = blockIdx.y;
    const bool is_q = j < hk;
    const int head = is_q ? j : j - hk;
    const T* src = mixed + (size_t)tok * cd + (size_t)j * dk;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float v = to_f(src[i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = 1.f / sqrtf(ss + eps);
    T* dst = (is_q ? q : k) + ((size_t)tok * hk + head) * dk;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        float val = to_f(src[i]) * r;  // as the CPU: normalise, then scale q
        if (is_q) val *= q_scale;
        dst[i] = from_f<T>(val);
    }
}

__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// Residual add fused with the next zero-centred RMSNorm (add_inplace then rmsnorm_* mode 1
// in one launch): x[row] += y[row] (rounded to T, as add_inplace), then
// r[row] = (1 + w) · x · rsqrt(mean(x²) + eps). One block per row of width d; the host
// uses rmsnorm_*'s block size for d, so the sum of squares reduces in the same order.
template <typename T>
__device__ void add_rmsnorm_impl(T* x, const T* y, const float* w, T* r, int d, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * d;
    float ss = 0.f;
    // Rows of up to AR_PT elements per thread (hidden sizes up to 2048 at 256 threads):
    // all loads first, kept in registers for the second pass. The same elements per thread
    // in the same order as the loop below, so the same sums (one load at a time, as below,
    // left a one-row launch latency-bound: 8.6 µs for 2048 elements on the H200).
    constexpr int AR_PT = 8;
    if (d <= AR_PT * (int)blockDim.x) {
        float xv[AR_PT], yv[AR_PT];
#pragma unroll
        for (int k = 0; k < AR_PT; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < d) {
                xv[k] = to_f(x[base + i]);
                yv[k] = to_f(y[base + i]);
            }
        }
#pragma unroll
        for (int k = 0; k < AR_PT; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < d) {
                const T s = from_f<T>(xv[k] + yv[k]);
                x[base + i] = s;
                xv[k] = to_f(s);
                ss += xv[k] * xv[k];
            }
        }
        ss = block_sum(ss, sh);
        const float rs = 1.f / sqrtf(ss / (float)d + eps);
#pragma unroll
        for (int k = 0; k < AR_PT; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < d) r[base + i] = from_f<T>(xv[k] * rs * (1.f + w[i]));
        }
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const T s = from_f<T>(to_f(x[base + i]) + to_f(y[base + i]));
        x[base + i] = s;
        const float v = to_f(s);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float rs = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f(x[base + i]) * rs;  // this thread's own write above
        v *= (1.f + w[i]);
        r[base + i] = from_f<T>(v);
    }
}

// All GDN inputs in one launch (the q/k L2 norm, the v and z column copies, the gates): grid
// (t, 2·hk + nvz), nvz ≥ 1. Blocks y < 2·hk are gdn_qk's (q/k L2 norm per head); blocks
// y ≥ 2·hk copy the token's v (mixed columns 2·hk·dk ..) and z (proj columns cd ..), and
// block y = 2·hk computes its gates from proj columns cd + vd .. (β = sigmoid(b),
// g = neg_a · softplus(a + dt_bias)).
// mixed: [t, cd]; proj: [t, n_in]; q, k: [t, hk, dk]; v, z: [t, vd]; g, beta: [t, hv].
template <typename T>
__device__ void gdn_prep_impl(const T* mixed, const T* proj, T* q, T* k, T* v, T* z, float* g, float* beta,
                              const float* neg_a, const float* dt_bias, int hk, int dk, int cd, int n_in, int vd,
                              int hv, float q_scale, float eps) {
    if ((int)blockIdx.y < 2 * hk) {
        gdn_qk_impl<T>(mixed, q, k, hk, dk, cd, q_scale, eps);
        return;
    }
    // Blocks y = 2·hk .. gridDim.y − 1 share the token's v and z copies (one block for all
    // of them left a one-token launch latency-bound: 26 µs on the H200); the first of them
    // also computes the gates.
    const size_t tok = blockIdx.x;
    const int b = (int)blockIdx.y - 2 * hk, nb = (int)gridDim.y - 2 * hk;
    const T* mrow = mixed + tok * cd + (size_t)2 * hk * dk;
    const T* prow = proj + tok * n_in;
    for (int i = b * blockDim.x + threadIdx.x; i < vd; i += nb * blockDim.x) {
        v[tok * vd + i] = mrow[i];
        z[tok * vd + i] = prow[cd + i];
    }
    if (b != 0) return;
    const T* gates = prow + cd + vd;
    for (int h = threadIdx.x; h < hv; h += blockDim.x) {
        beta[tok * hv + h] = sigmoid_f(to_f(gates[h]));
        g[tok * hv + h] = neg_a[h] * softplus_f(to_f(gates[hv + h]) + dt_bias[h]);
    }
}

// All attention inputs in one launch (projection split, the q/k zero-centred RMSNorms and the
// q/k RoPE) from the fused projection row [qw | nkv·hd | nkv·hd], qw = nh·hd·(1 + gated),
// per query head [q(hd) | gate(hd)] when gated. grid (t, nh + 2·nkv), 128 threads (256
// for hd > 512, as rmsnorm_*), dynamic shared memory (hd + 32) floats.
// Block y < nh: query head y (gate copied when gated); y < nh + nkv: key head; else value
// head (copied). A q/k head is normalised (w = q_norm or k_norm, [hd]), rounded to T — as
// rmsnorm_* stores it — and then rotated as rope_* does (first `rot` dims, NeoX halves,
// angle (float)pos[tok] · inv_freq[i]; rot = 0: no rotation, inv_freq may be null).
// q, gate: [t, nh, hd]; k, v: [t, nkv, hd]; pos: [t] i64.
template <typename T>
__device__ void attn_prep_impl(const T* qkv, const float* q_norm, const float* k_norm, const i64* pos,
                               const float* inv_freq, int rot, T* q, T* gate, T* k, T* v, int nh, int nkv,
                               int hd, int gated, float eps) {
    extern __shared__ float ap_sm[];
    float* nv = ap_sm;        // [hd] normed values (after rounding to T)
    float* red = ap_sm + hd;  // [32]
    const size_t tok = blockIdx.x;
    const int y = blockIdx.y;
    const int qw = nh * hd * (gated ? 2 : 1), kw = nkv * hd;
    const T* row = qkv + tok * (size_t)(qw + 2 * kw);
    if (y >= nh + nkv) {
        const int kh = y - nh - nkv;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) v[(tok * nkv + kh) * hd + i] = row[qw + kw + kh * hd + i];
        return;
    }
    const bool is_q = y < nh;
    const int head = is_q ? y : y - nh;
    const T* src = is_q ? row + (size_t)head * (gated ? 2 * hd : hd) : row + qw + (size_t)head * hd;
    const float* w = is_q ? q_norm : k_norm;
    if (is_q && gated) {
        for (int i = threadIdx.x; i < hd; i += blockDim.x) gate[(tok * nh + head) * hd + i] = src[hd + i];
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        const float x = to_f(src[i]);
        ss += x * x;
    }
    ss = block_sum(ss, red);
    const float r = 1.f / sqrtf(ss / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float x = to_f(src[i]) * r;
        x *= (1.f + w[i]);
        nv[i] = to_f(from_f<T>(x));
    }
    __syncthreads();
    T* dst = is_q ? q + (tok * nh + head) * hd : k + (tok * nkv + head) * hd;
    const int half = rot / 2;
    const i64 p = pos[tok];
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = nv[i];
        if (i < rot) {
            const int j = i < half ? i : i - half;
            float sn, cs;
            sincosf((float)p * inv_freq[j], &sn, &cs);
            o = i < half ? nv[i] * cs - nv[i + half] * sn : nv[i] * cs + nv[j] * sn;
        }
        dst[i] = from_f<T>(o);
    }
}

// o *= sigmoid(gate) over n elements.
template <typename T>
__device__ void mul_sigmoid_impl(T* o, const T* gate, size_t n) {
    GRID_STRIDE(idx, n) { o[idx] = from_f<T>(to_f(o[idx]) * sigmoid_f(to_f(gate[idx]))); }
}

// act[r, j] = silu(gu[r, j]) · gu[r, inter + j]; gu: [rows, 2·inter]; act: [rows, inter].
template <typename T>
__device__ void swiglu_impl(const T* gu, T* act, int rows, int inter) {
    GRID_STRIDE(idx, (size_t)rows * inter) {
        const size_t r = idx / inter, j = idx % inter;
        const float gte = to_f(gu[r * 2 * inter + j]), up = to_f(gu[r * 2 * inter + inter + j]);
        act[idx] = from_f<T>(silu_f(gte) * up);
    }
}

// MoE gather: xe[n, :] = x[rows[n], :]; x: [t, h]; rows: [m] i32; xe: [m, h].
template <typename T>
__device__ void gather_rows_impl(const T* x, const int* rows, T* xe, int m, int h) {
    GRID_STRIDE(idx, (size_t)m * h) {
        const size_t n = idx / h, c = idx % h;
        xe[idx] = x[(size_t)rows[n] * h + c];
    }
}

// MoE scatter: out[rows[n], :] += wgt[n] · y[n, :]; rows distinct within one launch.
template <typename T>
__device__ void scatter_add_rows_impl(T* out, const int* rows, const float* wgt, const T* y, int m, int h) {
    GRID_STRIDE(idx, (size_t)m * h) {
        const size_t n = idx / h, c = idx % h;
        T* o = out + (size_t)rows[n] * h + c;
        *o = from_f<T>(to_f(*o) + to_f(from_f<T>(to_f(y[idx]) * wgt[n])));
    }
}

// Shared expert: out[r, :] += sigmoid(gl[r]) · y[r, :]; gl: [rows] (the [rows, 1] gate).
template <typename T>
__device__ void add_gated_rows_impl(T* out, const T* gl, const T* y, int rows, int h) {
    GRID_STRIDE(idx, (size_t)rows * h) {
        const size_t r = idx / h;
        const float s = sigmoid_f(to_f(gl[r]));
        out[idx] = from_f<T>(to_f(out[idx]) + to_f(from_f<T>(s * to_f(y[idx]))));
    }
}

// Generic gated delta rule recurrence (any dk, dv), the fallback of gdr_recurrent_*:
// per token S ← e^g S; u = β (v − Sᵀk); S ← S + k uᵀ; o = Sᵀ q. Column j of S depends
// only on column j, so one thread owns one column (state read and written in global
// memory, fp32). grid (hv, ceil(dv / blockDim)), q, k: [t, hk, dk]; v, o: [t, hv, dv];
// g, beta: [t, hv]; state: [hv, dk, dv].
template <typename T>
__device__ void gdr_generic_impl(const T* q, const T* k, const T* v, const float* g, const float* beta,
                                 float* state, T* out, int t_len, int hk, int hv, int dk, int dv) {
    const int h = blockIdx.x, kh = h / (hv / hk);
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= dv) return;
    float* st = state + (size_t)h * dk * dv;
    for (int t = 0; t < t_len; ++t) {
        const T* kt = k + ((size_t)t * hk + kh) * dk;
        const T* qt = q + ((size_t)t * hk + kh) * dk;
        const float dec = expf(g[(size_t)t * hv + h]), b = beta[(size_t)t * hv + h];
        float kv = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float s = st[(size_t)i * dv + j] * dec;
            st[(size_t)i * dv + j] = s;
            kv += s * to_f(kt[i]);
        }
        const float u = b * (to_f(v[((size_t)t * hv + h) * dv + j]) - kv);
        float o = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float s = st[(size_t)i * dv + j] + to_f(kt[i]) * u;
            st[(size_t)i * dv + j] = s;
            o += s * to_f(qt[i]);
        }
        out[((size_t)t * hv + h) * dv + j] = from_f<T>(o);
    }
}

// Generic causal GQA attention (any head dim ≤ 1024), the fallback of attn_prefill_*:
// one block per (query, head); keys in tiles of ATG_TILE with a block-wide online
// softmax. Same contract as attn_prefill_*: q: [tq, nh, hd]; k, v: [n_kv, nkv, hd];
// q_pos: [tq]; kv_pos: [n_kv]; o: [tq, nh, hd]; keys with kv_pos > q_pos are masked;
// no visible key → zeros. Dynamic shared memory: (2·hd + ATG_TILE + 32) floats.
#define ATG_TILE 256
template <typename T>
__device__ void attn_generic_impl(const T* q, const T* k, const T* v, const i64* q_pos, const i64* kv_pos, T* o,
                                  int n_kv, int nh, int nkv, int hd, float scale) {
    extern __shared__ float sm[];
    float* qs = sm;            // [hd]
    float* acc = qs + hd;      // [hd]
    float* ps = acc + hd;      // [ATG_TILE]
    float* red = ps + ATG_TILE; // [32]
    const int tq_i = blockIdx.x, h = blockIdx.y, kh = h / (nh / nkv);
    const i64 p = q_pos[tq_i];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        qs[d] = to_f(q[((size_t)tq_i * nh + h) * hd + d]) * scale;
        acc[d] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    __syncthreads();
    for (int j0 = 0; j0 < n_kv; j0 += ATG_TILE) {
        const int nt = min(ATG_TILE, n_kv - j0);
        float tmax = NEG_INF;
        for (int jj = threadIdx.x; jj < nt; jj += blockDim.x) {
            const int j = j0 + jj;
            float s = NEG_INF;
            if (kv_pos[j] <= p) {
                const T* kr = k + ((size_t)j * nkv + kh) * hd;
                s = 0.f;
                for (int d = 0; d < hd; ++d) s += qs[d] * to_f(kr[d]);
            }
            ps[jj] = s;
            tmax = fmaxf(tmax, s);
        }
        // block max
        tmax = warp_max(tmax);
        __syncthreads();
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = tmax;
        __syncthreads();
        float bm = NEG_INF;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) bm = fmaxf(bm, red[w]);
        __syncthreads();
        const float mn = fmaxf(m, bm);
        if (mn == NEG_INF) continue;  // nothing visible yet (uniform across the block)
        const float corr = (m == NEG_INF) ? 0.f : expf(m - mn);
        float psum = 0.f;
        for (int jj = threadIdx.x; jj < nt; jj += blockDim.x) {
            const float e = ps[jj] == NEG_INF ? 0.f : expf(ps[jj] - mn);
            ps[jj] = e;
            psum += e;
        }
        psum = block_sum(psum, red);
        __syncthreads();
        l = l * corr + psum;
        m = mn;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float a = acc[d] * corr;
            for (int jj = 0; jj < nt; ++jj) {
                const float pj = ps[jj];
                if (pj != 0.f) a += pj * to_f(v[((size_t)(j0 + jj) * nkv + kh) * hd + d]);
            }
            acc[d] = a;
        }
        __syncthreads();
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) o[((size_t)tq_i * nh + h) * hd + d] = from_f<T>(acc[d] * inv);
}

#define MODEL_KERNELS(S, T)                                                                                   \
    extern "C" __global__ void embed_gather_##S(const T* table, const unsigned int* tokens, T* x, int t, int h, \
                                                int vocab) {                                                  \
        embed_gather_impl<T>(table, tokens, x, t, h, vocab);                                                  \
    }                                                                                                         \
    extern "C" __global__ void add_inplace_##S(T* x, const T* y, size_t n) { add_inplace_impl<T>(x, y, n); }  \
    extern "C" __global__ void add_rmsnorm_##S(T* x, const T* y, const float* w, T* r, int d, float eps) {     \
        add_rmsnorm_impl<T>(x, y, w, r, d, eps);                                                              \
    }                                                                                                         \
    extern "C" __global__ void gdn_prep_##S(const T* mixed, const T* proj, T* q, T* k, T* v, T* z, float* g,  \
                                            float* beta, const float* neg_a, const float* dt_bias, int hk,    \
                                            int dk, int cd, int n_in, int vd, int hv, float q_scale,          \
                                            float eps) {                                                      \
        gdn_prep_impl<T>(mixed, proj, q, k, v, z, g, beta, neg_a, dt_bias, hk, dk, cd, n_in, vd, hv, q_scale, \
                         eps);                                                                                \
    }                                                                                                         \
    extern "C" __global__ void attn_prep_##S(const T* qkv, const float* q_norm, const float* k_norm,          \
                                             const i64* pos, const float* inv_freq, int rot, T* q, T* gate,   \
                                             T* k, T* v, int nh, int nkv, int hd, int gated, float eps) {     \
        attn_prep_impl<T>(qkv, q_norm, k_norm, pos, inv_freq, rot, q, gate, k, v, nh, nkv, hd, gated, eps);   \
    }                                                                                                         \
    extern "C" __global__ void mul_sigmoid_##S(T* o, const T* gate, size_t n) { mul_sigmoid_impl<T>(o, gate, n); } \
    extern "C" __global__ void swiglu_##S(const T* gu, T* act, int rows, int inter) {                         \
        swiglu_impl<T>(gu, act, rows, inter);                                                                 \
    }                                                                                                         \
    extern "C" __global__ void gather_rows_##S(const T* x, const int* rows, T* xe, int m, int h) {            \
        gather_rows_impl<T>(x, rows, xe, m, h);                                                               \
    }                                                                                                         \
    extern "C" __global__ void scatter_add_rows_##S(T* out, const int* rows, const float* wgt, const T* y,    \
                                                    int m, int h) {                                           \
        scatter_add_rows_impl<T>(out, rows, wgt, y, m, h);                                                    \
    }                                                                                                         \
    extern "C" __global__ void add_gated_rows_##S(T* out, const T* gl, const T* y, int rows, int h) {         \
        add_gated_rows_impl<T>(out, gl, y, rows, h);                                                          \
    }                                                                                                         \
    extern "C" __global__ void gdr_generic_##S(const T* q, const T* k, const T* v, const float* g,           \
                                               const float* beta, float* state, T* out, int t_len, int hk,    \
                                               int hv, int dk, int dv) {                                      \
        gdr_generic_impl<T>(q, k, v, g, beta, state, out, t_len, hk, hv, dk, dv);                             \
    }                                                                                                         \
    extern "C" __global__ void attn_generic_##S(const T* q, const T* k, const T* v, const i64* q_pos,         \
                                                const i64* kv_pos, T* o, int n_kv, int nh, int nkv, int hd,   \
                                                float scale) {                                                \
        attn_generic_impl<T>(q, k, v, q_pos, kv_pos, o, n_kv, nh, nkv, hd, scale);                            \
    }
MODEL_KERNELS(f32, float)
MODEL_KERNELS(bf16, bf16)

// attn_generic_* with the key count read from the device (*n_kv_dev): the same blocks
// and arithmetic, for a launch recorded once in a CUDA graph of the decode step and
// replayed while the cache grows (cuda/graph.rs).
#define ATTN_GENERIC_DEV(S, T)                                                                                \
    extern "C" __global__ void attn_generic_dev_##S(const T* q, const T* k, const T* v, const i64* q_pos,     \
                                                    const i64* kv_pos, T* o, const int* n_kv_dev, int nh,     \
                                                    int nkv, int hd, float scale) {                           \
        attn_generic_impl<T>(q, k, v, q_pos, kv_pos, o, *n_kv_dev, nh, nkv, hd, scale);                       \
    }
ATTN_GENERIC_DEV(f32, float)
ATTN_GENERIC_DEV(bf16, bf16)
