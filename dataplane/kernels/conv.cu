// Depthwise causal conv1d (GDN short convolution) with a cached tail.
// x: [T, x_stride] (channel c of token t at x[t·x_stride + c], so the conv can read the
// q|k|v columns of a wider projection row directly); w: [C, K] fp32; tail: [C, K−1] fp32,
// the previous K−1 inputs of each channel, oldest first; y: [T, C].
// y[t, c] = act(Σ_j w[c, j] · in(t − (K−1) + j, c)), in(τ < 0) read from the tail,
// act = SiLU when `silu` != 0 else identity.

template <typename T>
__device__ __forceinline__ float conv_in(const T* x, int x_stride, const float* tail, int km1, int tau,
                                         int c) {
    return tau >= 0 ? to_f(x[(size_t)tau * x_stride + c]) : tail[(size_t)c * km1 + (km1 + tau)];
}

// Prefill: one thread per (t, c). The tail is left unchanged (see conv1d_tail_*).
template <typename T>
__device__ void conv1d_prefill_impl(const T* x, int x_stride, const float* w, const float* tail, T* y,
                                    int t_len, int C, int K, int silu) {
    const size_t total = (size_t)t_len * C;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int c = (int)(idx % C), t = (int)(idx / C);
        float acc = 0.f;
        for (int j = 0; j < K; ++j) acc += w[(size_t)c * K + j] * conv_in(x, x_stride, tail, K - 1, t - (K - 1) + j, c);
        y[idx] = from_f<T>(silu ? silu_f(acc) : acc);
    }
}

// After a prefill of T tokens: tail ← the last K−1 inputs (old tail entries when T < K−1).
// One thread per channel; reads everything before writing, so it is safe in place.
template <typename T>
__device__ void conv1d_tail_impl(const T* x, int x_stride, float* tail, int t_len, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float nt[16];
    const int km1 = K - 1;
    for (int j = 0; j < km1 && j < 16; ++j) nt[j] = conv_in(x, x_stride, tail, km1, t_len - km1 + j, c);
    for (int j = 0; j < km1 && j < 16; ++j) tail[(size_t)c * km1 + j] = nt[j];
}

// One-token decode update (causal_conv1d_update): y = act(conv over [tail, x]), then the
// tail shifts left by one and x is appended. x: [x_stride] row; y: [C].
template <typename T>
__device__ void conv1d_update_impl(const T* x, const float* w, float* tail, T* y, int C, int K, int silu) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int km1 = K - 1;
    float* tc = tail + (size_t)c * km1;
    const float xc = to_f(x[c]);
    float acc = w[(size_t)c * K + km1] * xc;
    for (int j = 0; j < km1; ++j) acc += w[(size_t)c * K + j] * tc[j];
    for (int j = 0; j + 1 < km1; ++j) tc[j] = tc[j + 1];
    if (km1 > 0) tc[km1 - 1] = xc;
    y[c] = from_f<T>(silu ? silu_f(acc) : acc);
}

#define CONV(S, T)                                                                                  \
    extern "C" __global__ void conv1d_prefill_##S(const T* x, int x_stride, const float* w,         \
                                                  const float* tail, T* y, int t_len, int C, int K, \
                                                  int silu) {                                       \
        conv1d_prefill_impl<T>(x, x_stride, w, tail, y, t_len, C, K, silu);                        \
    }                                                                                               \
    extern "C" __global__ void conv1d_tail_##S(const T* x, int x_stride, float* tail, int t_len,    \
                                               int C, int K) {                                      \
        conv1d_tail_impl<T>(x, x_stride, tail, t_len, C, K);                                        \
    }                                                                                               \
    extern "C" __global__ void conv1d_update_##S(const T* x, const float* w, float* tail, T* y,     \
                                                 int C, int K, int silu) {                          \
        conv1d_update_impl<T>(x, w, tail, y, C, K, silu);                                           \
    }                                                                                               \
    /* One decode token for each of B sequences: row b reads x + b·x_stride, updates the    */     \
    /* tail at address tails[b] ([C, K−1] fp32) and writes y + b·C. grid (ceil(C/256), B).  */     \
    extern "C" __global__ void conv1d_update_rows_##S(const T* x, int x_stride, const float* w,     \
                                                      const unsigned long long* tails, T* y, int C, \
                                                      int K, int silu) {                            \
        const size_t b = blockIdx.y;                                                                \
        conv1d_update_impl<T>(x + b * x_stride, w, reinterpret_cast<float*>(tails[b]), y + b * C,   \
                              C, K, silu);                                                          \
    }
CONV(f32, float)
CONV(bf16, bf16)
