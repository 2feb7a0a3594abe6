// RMSNorm variants, one block per row of width d (fp32 math, output in the input type).
//   mode 0: y = w · x · rsqrt(mean(x²) + eps)                 (plain, ops::rms_norm)
//   mode 1: y = (1 + w) · x · rsqrt(mean(x²) + eps)           (zero-centred, Qwen3NextRMSNorm)
//   mode 2: y = w · x · rsqrt(mean(x²) + eps) · silu(z)       (gated, Qwen3NextRMSNormGated)
// x, z, y: [rows, d] row-major; w: [d] fp32. z may be null unless mode 2. y may alias x.
template <typename T>
__device__ void rmsnorm_impl(const T* x, const T* z, const float* w, T* y, int d, float eps, int mode) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f(x[base + i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f(x[base + i]) * r;
        float wi = w[i];
        if (mode == 1) v *= (1.f + wi);
        else v *= wi;
        if (mode == 2) v *= silu_f(to_f(z[base + i]));
        y[base + i] = from_f<T>(v);
    }
}

#define RMSNORM(S, T)                                                                          \
    extern "C" __global__ void rmsnorm_##S(const T* x, const T* z, const float* w, T* y, int d, \
                                           float eps, int mode) {                              \
        rmsnorm_impl<T>(x, z, w, y, d, eps, mode);                                             \
    }
RMSNORM(f32, float)
RMSNORM(bf16, bf16)
