// Deterministic random weights on the device (GpuModel::random). The generator and
// distributions are specified in dataplane/src/random.rs; the host computes the
// per-tensor key and the f32 scale, so that every element here is a pure function of
// (key, index) and equals the CPU `random::sym_value` / `neg_a_value` bit for bit.

__device__ __forceinline__ unsigned long long splitmix_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// 24 uniform bits of element i: mix(key + (i + 1)·φ) >> 40.
__device__ __forceinline__ unsigned int bits24(unsigned long long key, unsigned long long i) {
    return (unsigned int)(splitmix_mix(key + (i + 1ull) * 0x9E3779B97F4A7C15ull) >> 40);
}

// out[off + i] = (2m − (2^24 − 1)) · scale for i < n (symmetric uniform, bound
// scale·2^24). One exactly rounded multiply of exact operands.
template <typename T>
__device__ void init_sym(T* out, i64 off, i64 n, unsigned long long key, float scale) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int s = 2 * (int)bits24(key, (unsigned long long)i) - ((1 << 24) - 1);
        out[off + i] = from_f<T>(__fmul_rn((float)s, scale));
    }
}

extern "C" __global__ void init_sym_f32(float* out, i64 off, i64 n, unsigned long long key, float scale) {
    init_sym<float>(out, off, n, key, scale);
}
extern "C" __global__ void init_sym_bf16(bf16* out, i64 off, i64 n, unsigned long long key, float scale) {
    init_sym<bf16>(out, off, n, key, scale);
}

// out[i] = −fma(15, m·2^-24, 1): the stored −A of the GDN decay (A_log = ln A,
// A ∈ [1, 16)).
extern "C" __global__ void init_neg_a_f32(float* out, i64 n, unsigned long long key) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float u = (float)bits24(key, (unsigned long long)i) * (1.0f / 16777216.0f);
        out[i] = -__fmaf_rn(15.0f, u, 1.0f);
    }
}

// out[i] = v for i < n.
extern "C" __global__ void fill_f32(float* out, i64 n, float v) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = v;
}

// Checkpoint dtype conversion on the device (GpuModel::load): dst[i] = src[i] in the
// model's type for i < n, src as stored in safetensors (bf16 / f16 as raw 16-bit
// words, f32). Widening is exact; narrowing to bf16 rounds to nearest-even
// (`__float2bfloat16_rn`, as the host `half::bf16::from_f32`).
__device__ __forceinline__ float bf16_bits_to_f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
// IEEE binary16 → f32 in integer arithmetic (exact; no cuda_fp16.h needed).
__device__ __forceinline__ float f16_bits_to_f(unsigned short h) {
    const unsigned int s = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int e = ((unsigned int)h >> 10) & 0x1fu, m = (unsigned int)h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m · 2^-24
        const float v = (float)m * 5.9604644775390625e-8f;
        return s ? -v : v;
    }
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));  // inf / NaN
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}

extern "C" __global__ void convert_bf16_f32(const unsigned short* src, float* dst, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = bf16_bits_to_f(src[i]);
}
extern "C" __global__ void convert_f16_f32(const unsigned short* src, float* dst, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = f16_bits_to_f(src[i]);
}
extern "C" __global__ void convert_f16_bf16(const unsigned short* src, bf16* dst, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16_rn(f16_bits_to_f(src[i]));
}
extern "C" __global__ void convert_f32_bf16(const float* src, bf16* dst, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16_rn(src[i]);
}
