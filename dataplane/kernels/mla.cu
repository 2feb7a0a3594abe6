// Latent attention (MLA without RoPE, Kimi-Linear's full-attention layers; CPU
// mixers/mla.rs): the kernels around the generic attention kernel of model.cu
// (host side: dataplane/src/cuda/kimi.rs).

// Latent rows of a span: rows[t] = [rmsnorm(kv_a[:r]) · w | kv_a[r:row]], kv_a the
// columns off.. of proj [T, n_in]; rows: [T, row]; w: [r]. One block per token.
template <typename T>
__device__ void mla_rows_impl(const T* proj, int n_in, int off, const float* w, T* rows, int r, int row,
                              float eps) {
    __shared__ float sh[32];
    const int t = blockIdx.x;
    const T* x = proj + (size_t)t * n_in + off;
    float ss = 0.f;
    for (int i = threadIdx.x; i < r; i += blockDim.x) {
        const float v = to_f(x[i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float rs = 1.f / sqrtf(ss / (float)r + eps);
    for (int i = threadIdx.x; i < row; i += blockDim.x)
        rows[(size_t)t * row + i] = i < r ? from_f<T>(to_f(x[i]) * rs * w[i]) : x[i];
}

// Absorbed queries qa [T, H, row]: for c < r, fix · Σ_n q_nope[t,h,n] · w_uk[h,n,c];
// for c ≥ r, fix · q_rot[t,h,c − r]. q: the first H·(nope + rope) columns of proj
// [T, n_in], per head q_nope | q_rot; w_uk: [H, nope, r]. Grid-stride over T·H·row.
template <typename T>
__device__ void mla_absorb_q_impl(const T* proj, int n_in, const T* w_uk, T* qa, int t_len, int nh, int nope,
                                  int rope, int r, float fix) {
    const int row = r + rope, qkd = nope + rope;
    const long long total = (long long)t_len * nh * row;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(idx % row);
        const int h = (int)((idx / row) % nh);
        const int t = (int)(idx / ((long long)row * nh));
        const T* qs = proj + (size_t)t * n_in + (size_t)h * qkd;
        float y;
        if (c < r) {
            y = 0.f;
            const T* uk = w_uk + (size_t)h * nope * r + c;
            for (int n = 0; n < nope; ++n) y += to_f(qs[n]) * to_f(uk[(size_t)n * r]);
        } else {
            y = to_f(qs[nope + c - r]);
        }
        qa[idx] = from_f<T>(y * fix);
    }
}

// Value expansion o [T, H, vd]: o[t,h,e] = Σ_{c<r} w_uv[h,e,c] · lat[t,h,c], lat
// [T, H, row] (the attention output over latent rows); w_uv: [H, vd, r].
template <typename T>
__device__ void mla_expand_impl(const T* lat, const T* w_uv, T* o, int t_len, int nh, int vd, int r, int row) {
    const long long total = (long long)t_len * nh * vd;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int e = (int)(idx % vd);
        const long long th = idx / vd;
        const int h = (int)(th % nh);
        const T* l = lat + (size_t)th * row;
        const T* uv = w_uv + ((size_t)h * vd + e) * r;
        float y = 0.f;
        for (int c = 0; c < r; ++c) y += to_f(uv[c]) * to_f(l[c]);
        o[idx] = from_f<T>(y);
    }
}

#define MLA_KERNELS(S, T)                                                                                     \
    extern "C" __global__ void mla_rows_##S(const T* proj, int n_in, int off, const float* w, T* rows,       \
                                            int r, int row, float eps) {                                      \
        mla_rows_impl<T>(proj, n_in, off, w, rows, r, row, eps);                                              \
    }                                                                                                         \
    extern "C" __global__ void mla_absorb_q_##S(const T* proj, int n_in, const T* w_uk, T* qa, int t_len,    \
                                                int nh, int nope, int rope, int r, float fix) {               \
        mla_absorb_q_impl<T>(proj, n_in, w_uk, qa, t_len, nh, nope, rope, r, fix);                            \
    }                                                                                                         \
    extern "C" __global__ void mla_expand_##S(const T* lat, const T* w_uv, T* o, int t_len, int nh, int vd,  \
                                              int r, int row) {                                               \
        mla_expand_impl<T>(lat, w_uv, o, t_len, nh, vd, r, row);                                              \
    }
MLA_KERNELS(f32, float)
MLA_KERNELS(bf16, bf16)
