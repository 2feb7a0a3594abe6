// Glue kernels of the GPU PIC engine (dataplane/src/cuda/pic.rs): the generic
// transition build of the gated delta rule and fp32 state arithmetic.

// Dense segment transition of the gated delta rule, any dk, by the token recurrence:
// for t < t_len, trans[h] ← T_t · trans[h] with T_t = exp(g_t) (I − β_t k_t k_tᵀ)
// (the state recurrence with all writes v_t = 0, the same operation order as
// linear::gdr::recurrent). Set trans to the identity first to obtain T_C.
// k: [t_len, hk, dk] (T); g, beta: [t_len, hv] fp32; trans: [hv, dk, dk] fp32
// row-major, in place. Grid (hv, ceil(dk / blockDim.x)); one thread per column of T
// (columns evolve independently).
template <typename T>
__device__ void pic_transition_impl(const T* k, const float* g, const float* beta, float* trans, int t_len,
                                    int hk, int hv, int dk) {
    const int h = blockIdx.x, kh = h / (hv / hk);
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= dk) return;
    float* tr = trans + (size_t)h * dk * dk;
    for (int t = 0; t < t_len; ++t) {
        const T* kt = k + ((size_t)t * hk + kh) * dk;
        const float dec = expf(g[(size_t)t * hv + h]), b = beta[(size_t)t * hv + h];
        float kv = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float s = tr[(size_t)i * dk + j] * dec;
            tr[(size_t)i * dk + j] = s;
            kv += s * to_f(kt[i]);
        }
        const float u = b * (0.f - kv);
        for (int i = 0; i < dk; ++i) tr[(size_t)i * dk + j] += to_f(kt[i]) * u;
    }
}

extern "C" __global__ void pic_transition_f32(const float* k, const float* g, const float* beta, float* trans,
                                              int t_len, int hk, int hv, int dk) {
    pic_transition_impl<float>(k, g, beta, trans, t_len, hk, hv, dk);
}
extern "C" __global__ void pic_transition_bf16(const bf16* k, const float* g, const float* beta, float* trans,
                                               int t_len, int hk, int hv, int dk) {
    pic_transition_impl<bf16>(k, g, beta, trans, t_len, hk, hv, dk);
}

// x ← a·x + b·y over n fp32 elements (grid-stride).
extern "C" __global__ void pic_axpby_f32(float* x, const float* y, float a, float b, unsigned long long n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        x[i] = a * x[i] + b * y[i];
    }
}

// pos[i] = p0 + i for i < n.
extern "C" __global__ void pic_iota_i64(i64* pos, i64 p0, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) pos[i] = p0 + i;
}
