// Partial NeoX-style rotary embedding, in place (ops::Rope::apply).
// x: [n_tok, n_heads, head_dim]; the first `rot` dims of every head are rotated:
//   x1 = x[..rot/2], x2 = x[rot/2..rot]:  x1' = x1·cos − x2·sin,  x2' = x2·cos + x1·sin
// with angle = (float)(pos[tok] + pos_offset) · inv_freq[i] (fp32, like HF and the CPU).
// pos may be null (then the position of every token is pos_offset): re-rotation of
// cached keys by R(b − a) is this kernel with pos = null and pos_offset = b − a.
// inv_freq: [rot/2] fp32 (θ^(−2i/rot), computed on the host exactly like ops::Rope).
template <typename T>
__device__ void rope_impl(T* x, const i64* pos, i64 pos_offset, const float* inv_freq, int n_tok,
                          int n_heads, int head_dim, int rot) {
    const int half = rot / 2;
    const size_t total = (size_t)n_tok * n_heads * half;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const size_t th = idx / half;
        const size_t tok = th / n_heads;
        const i64 p = (pos ? pos[tok] : 0) + pos_offset;
        const float a = (float)p * inv_freq[i];
        float s, c;
        sincosf(a, &s, &c);
        const size_t b = th * head_dim;
        const float x1 = to_f(x[b + i]), x2 = to_f(x[b + i + half]);
        x[b + i] = from_f<T>(x1 * c - x2 * s);
        x[b + i + half] = from_f<T>(x2 * c + x1 * s);
    }
}

#define ROPE(S, T)                                                                            \
    extern "C" __global__ void rope_##S(T* x, const i64* pos, i64 pos_offset,                 \
                                        const float* inv_freq, int n_tok, int n_heads,        \
                                        int head_dim, int rot) {                              \
        rope_impl<T>(x, pos, pos_offset, inv_freq, n_tok, n_heads, head_dim, rot);            \
    }
ROPE(f32, float)
ROPE(bf16, bf16)
