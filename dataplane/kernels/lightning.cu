// Lightning attention (the linear layers of Ring-linear-2.0). Host side:
// dataplane/src/cuda/lightning.rs. CPU reference: mixers/lightning/{naive,chunk,layer}.rs.
//
// Per layer, after the fused projection proj = x·[query_key_value | g_proj]ᵀ ([t, 4W] in T,
// columns q | k | v | gate, W = H·d):
//   lt_prep_*       optional SiLU on q|k|v, per-head RMSNorm of q and k (zero-centred weights),
//                   fp32 NeoX partial RoPE at the tokens' positions → q, k, v fp32 [t, H, d]
//                   (lt_prep_bf16_bf16: bf16, for the tensor-core prefill of lightning_tc.cu)
//   lt_recurrent    the token-by-token recurrence (the GPU reference; decode):
//                     S_t = γ_h·S_{t−1} + k_t v_tᵀ,  o_t = scale·S_tᵀ q_t
//   lt_chunk        the chunked prefill (intra-chunk attention with the decay mask, inter-chunk
//                   state), the same recurrence; or a state-only pass (o = null)
//   lt_out_*        group RMSNorm g_norm of o (fp32; bf16 in lt_out_bf16_bf16), times
//                   sigmoid(gate) → [t, W] in T (then `dense`)
// PIC helpers: lt_rotate_state (RoPE R(b) on the key axis of a state), lt_scalar_apply
// (S ← T_h·S + B or S + B).
// Layouts: q, k [t, H, dk], v and o [t, H, dv], state [H, dk, dv] K-major, all fp32.

// ---------------------------------------------------------------------------------------
// Prep, one block per (token, part·H + head), part 0 = q, 1 = k, 2 = v. Dynamic shared
// memory: (d + 32) floats. blockDim: a multiple of 32. Outputs in O (fp32 or bf16).
template <typename T, typename O>
__device__ void lt_prep_impl(const T* __restrict__ proj, int ld, const float* __restrict__ q_norm,
                             const float* __restrict__ k_norm, const i64* __restrict__ pos,
                             const float* __restrict__ inv_freq, int rot, int silu, O* __restrict__ q,
                             O* __restrict__ k, O* __restrict__ v, int H, int d, float eps) {
    extern __shared__ float lp_sm[];
    float* nv = lp_sm;       // [d]
    float* red = lp_sm + d;  // [32]
    const size_t tok = blockIdx.x;
    const int part = blockIdx.y / H, head = blockIdx.y % H;
    const T* src = proj + tok * (size_t)ld + (size_t)part * H * d + (size_t)head * d;
    const size_t o = (tok * H + head) * (size_t)d;
    if (part == 2) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float x = to_f(src[i]);
            if (silu) x = silu_f(x);
            v[o + i] = from_f<O>(x);
        }
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float x = to_f(src[i]);
        if (silu) x = silu_f(x);
        nv[i] = x;
        ss += x * x;
    }
    ss = block_sum(ss, red);
    const float r = 1.f / sqrtf(ss / (float)d + eps);
    const float* w = part == 0 ? q_norm : k_norm;
    for (int i = threadIdx.x; i < d; i += blockDim.x) nv[i] = nv[i] * r * (1.f + w[i]);
    __syncthreads();
    O* dst = (part == 0 ? q : k) + o;
    const int half = rot / 2;
    const i64 p = pos[tok];
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float x = nv[i];
        if (i < rot) {
            const int j = i < half ? i : i - half;
            float sn, cs;
            sincosf((float)p * inv_freq[j], &sn, &cs);
            x = i < half ? nv[i] * cs - nv[i + half] * sn : nv[i] * cs + nv[j] * sn;
        }
        dst[i] = from_f<O>(x);
    }
}

// ---------------------------------------------------------------------------------------
// Output: one block per (token, group); y = g_norm · o / rms_group(o) · sigmoid(gate).
// o: [t, W] in O (fp32 or bf16); gate: column `gate_col` of proj (row stride ld) in T;
// y: [t, W] in T.
template <typename T, typename O>
__device__ void lt_out_impl(const O* __restrict__ o, const T* __restrict__ proj, int ld, int gate_col,
                            const float* __restrict__ g_norm, T* __restrict__ y, int W, int groups,
                            float eps) {
    __shared__ float red[32];
    const size_t tok = blockIdx.x;
    const int gs = W / groups, c0 = blockIdx.y * gs;
    const O* x = o + tok * (size_t)W + c0;
    float ss = 0.f;
    for (int i = threadIdx.x; i < gs; i += blockDim.x) ss += to_f(x[i]) * to_f(x[i]);
    ss = block_sum(ss, red);
    const float r = 1.f / sqrtf(ss / (float)gs + eps);
    const T* g = proj + tok * (size_t)ld + gate_col + c0;
    for (int i = threadIdx.x; i < gs; i += blockDim.x) {
        const float a = to_f(x[i]) * r * g_norm[c0 + i];
        y[tok * (size_t)W + c0 + i] = from_f<T>(a * (1.f / (1.f + expf(-to_f(g[i])))));
    }
}

#define LT_KERNELS(S, T, O)                                                                                 \
    extern "C" __global__ void lt_prep_##S(const T* proj, int ld, const float* q_norm, const float* k_norm, \
                                           const i64* pos, const float* inv_freq, int rot, int silu,        \
                                           O* q, O* k, O* v, int H, int d, float eps) {                     \
        lt_prep_impl<T, O>(proj, ld, q_norm, k_norm, pos, inv_freq, rot, silu, q, k, v, H, d, eps);        \
    }                                                                                                       \
    extern "C" __global__ void lt_out_##S(const O* o, const T* proj, int ld, int gate_col,                  \
                                          const float* g_norm, T* y, int W, int groups, float eps) {        \
        lt_out_impl<T, O>(o, proj, ld, gate_col, g_norm, y, W, groups, eps);                                \
    }
LT_KERNELS(f32, float, float)
LT_KERNELS(bf16, bf16, float)
LT_KERNELS(bf16_bf16, bf16, bf16)

// ---------------------------------------------------------------------------------------
// Token-by-token recurrence (the reference; decode). grid (H, ceil(dv / blockDim.x)); one
// thread per state column j, the column kept in global memory. log_decay: [H] (g_h ≤ 0).
extern "C" __global__ void lt_recurrent(const float* __restrict__ q, const float* __restrict__ k,
                                        const float* __restrict__ v, const float* __restrict__ log_decay,
                                        float scale, float* __restrict__ state, float* __restrict__ o, int t,
                                        int H, int dk, int dv) {
    const int h = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= dv) return;
    const float decay = expf(log_decay[h]);
    float* S = state + (size_t)h * dk * dv;
    for (int ti = 0; ti < t; ++ti) {
        const size_t row = (size_t)ti * H + h;
        const float* kt = k + row * dk;
        const float* qt = q + row * dk;
        const float vj = v[row * dv + j];
        float acc = 0.f;
        for (int i = 0; i < dk; ++i) {
            const float s = __fadd_rn(__fmul_rn(S[(size_t)i * dv + j], decay), __fmul_rn(kt[i], vj));
            S[(size_t)i * dv + j] = s;
            acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(qt[i], scale), s));
        }
        o[row * dv + j] = acc;
    }
}

// ---------------------------------------------------------------------------------------
// Chunked prefill. One block per (head h = blockIdx.x, value-column tile blockIdx.y of LT_BV
// columns); the chunks of LT_C tokens run in order. Per chunk (start s, length L ≤ LT_C,
// γ = exp(g_h), i, j chunk-local):
//   o_i   = scale·(γ^{i+1} S₀ᵀ q_i + Σ_{j≤i} γ^{i−j} (q_i·k_j) v_j)
//   S_new = γ^L S₀ + Σ_j γ^{L−1−j} k_j v_jᵀ
// the powers γ^n = exp(n·g_h) from double precision, rounded once (as chunk.rs). With
// o = null only the state is advanced. Dynamic shared memory (floats):
//   Q, K [LT_C][dk + 1], V [LT_C][LT_BV], A [LT_C][LT_C], S [dk][LT_BV], pw [LT_C + 1].
// blockDim: 256.
#define LT_C 32
#define LT_BV 32
extern "C" __global__ void lt_chunk(const float* __restrict__ q, const float* __restrict__ k,
                                    const float* __restrict__ v, const float* __restrict__ log_decay,
                                    float scale, float* __restrict__ state, float* __restrict__ o, int t, int H,
                                    int dk, int dv) {
    extern __shared__ float lc_sm[];
    const int ldq = dk + 1;
    float* Qs = lc_sm;
    float* Ks = Qs + LT_C * ldq;
    float* Vs = Ks + LT_C * ldq;
    float* As = Vs + LT_C * LT_BV;
    float* Ss = As + LT_C * LT_C;
    float* pw = Ss + dk * LT_BV;
    const int h = blockIdx.x, c0 = blockIdx.y * LT_BV;
    const int nc = min(LT_BV, dv - c0);
    const int tid = threadIdx.x, nt = blockDim.x;
    const double g = (double)log_decay[h];
    for (int n = tid; n <= LT_C; n += nt) pw[n] = (float)exp(g * (double)n);
    float* S = state + (size_t)h * dk * dv;
    for (int e = tid; e < dk * LT_BV; e += nt) {
        const int r = e / LT_BV, c = e % LT_BV;
        Ss[e] = c < nc ? S[(size_t)r * dv + c0 + c] : 0.f;
    }
    __syncthreads();
    for (int s = 0; s < t; s += LT_C) {
        const int L = min(LT_C, t - s);
        for (int e = tid; e < LT_C * dk; e += nt) {
            const int i = e / dk, r = e % dk;
            const size_t row = (size_t)(s + i) * H + h;
            Ks[i * ldq + r] = i < L ? k[row * dk + r] : 0.f;
            if (o) Qs[i * ldq + r] = i < L ? q[row * dk + r] : 0.f;
        }
        for (int e = tid; e < LT_C * LT_BV; e += nt) {
            const int i = e / LT_BV, c = e % LT_BV;
            Vs[e] = (i < L && c < nc) ? v[((size_t)(s + i) * H + h) * dv + c0 + c] : 0.f;
        }
        __syncthreads();
        if (o) {
            for (int e = tid; e < LT_C * LT_C; e += nt) {
                const int i = e / LT_C, j = e % LT_C;
                float a = 0.f;
                if (j <= i && i < L) {
                    float dot = 0.f;
                    for (int r = 0; r < dk; ++r) dot = __fadd_rn(dot, __fmul_rn(Qs[i * ldq + r], Ks[j * ldq + r]));
                    a = __fmul_rn(__fmul_rn(dot, pw[i - j]), scale);
                }
                As[e] = a;
            }
            __syncthreads();
            for (int e = tid; e < LT_C * LT_BV; e += nt) {
                const int i = e / LT_BV, c = e % LT_BV;
                if (i >= L || c >= nc) continue;
                const float ai = __fmul_rn(pw[i + 1], scale);
                float acc = 0.f;
                for (int r = 0; r < dk; ++r)
                    acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(Qs[i * ldq + r], ai), Ss[r * LT_BV + c]));
                for (int j = 0; j <= i; ++j) acc = __fadd_rn(acc, __fmul_rn(As[i * LT_C + j], Vs[j * LT_BV + c]));
                o[((size_t)(s + i) * H + h) * dv + c0 + c] = acc;
            }
            __syncthreads();
        }
        const float dl = pw[L];
        for (int e = tid; e < dk * LT_BV; e += nt) {
            const int r = e / LT_BV, c = e % LT_BV;
            float x = __fmul_rn(Ss[e], dl);
            for (int j = 0; j < L; ++j)
                x = __fadd_rn(x, __fmul_rn(__fmul_rn(Ks[j * ldq + r], pw[L - 1 - j]), Vs[j * LT_BV + c]));
            Ss[e] = x;
        }
        __syncthreads();
    }
    for (int e = tid; e < dk * LT_BV; e += nt) {
        const int r = e / LT_BV, c = e % LT_BV;
        if (c < nc) S[(size_t)r * dv + c0 + c] = Ss[e];
    }
}

// ---------------------------------------------------------------------------------------
// RoPE on the key axis of a state: per head h and column j, the pairs (S[h][i][j],
// S[h][i + rot/2][j]) for i < rot/2 rotate by the angle (float)b · inv_freq[i]
// (mixers::lightning::rotate_state). state: [H, dk, dv].
extern "C" __global__ void lt_rotate_state(float* __restrict__ state, int H, int dk, int dv, i64 b,
                                           const float* __restrict__ inv_freq, int rot) {
    const int half = rot / 2;
    const size_t n = (size_t)H * half * dv;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const int j = (int)(e % dv);
        const size_t hi = e / dv;
        const int i = (int)(hi % half);
        const size_t h = hi / half;
        float sn, cs;
        sincosf((float)b * inv_freq[i], &sn, &cs);
        float* S = state + h * (size_t)dk * dv;
        const float x1 = S[(size_t)i * dv + j], x2 = S[(size_t)(i + half) * dv + j];
        S[(size_t)i * dv + j] = x1 * cs - x2 * sn;
        S[(size_t)(i + half) * dv + j] = x2 * cs + x1 * sn;
    }
}

// S ← T_h·S + B (naive = 0) or S + B (naive = 1), per head h of `per_head` elements.
extern "C" __global__ void lt_scalar_apply(float* __restrict__ state, const float* __restrict__ trans,
                                           const float* __restrict__ b, int H, i64 per_head, int naive) {
    const size_t n = (size_t)H * per_head;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const float s = state[e];
        state[e] = naive ? s + b[e] : __fadd_rn(__fmul_rn(trans[e / per_head], s), b[e]);
    }
}

// ---------------------------------------------------------------------------------------
// The chunked prefill in two launches (same math and roundings as lt_chunk, whose
// reference it is tested against): lt_chunk_states runs the chunks of one slab in order
// per (head, value tile), storing the state at the start of each chunk into
// hs [n_chunks, H, dk, dv] and leaving the final state in `state`; lt_chunk_out then
// computes every chunk's outputs in parallel, one block per (chunk, head, value tile),
// from its starting state. Shared memory as lt_chunk. blockDim: 256.
extern "C" __global__ void lt_chunk_states(const float* __restrict__ k, const float* __restrict__ v,
                                           const float* __restrict__ log_decay, float* __restrict__ state,
                                           float* __restrict__ hs, int t, int H, int dk, int dv) {
    extern __shared__ float lc_sm[];
    const int ldq = dk + 1;
    float* Ks = lc_sm + LT_C * ldq;
    float* Vs = Ks + LT_C * ldq;
    float* Ss = Vs + LT_C * LT_BV + LT_C * LT_C;
    float* pw = Ss + dk * LT_BV;
    const int h = blockIdx.x, c0 = blockIdx.y * LT_BV;
    const int nc = min(LT_BV, dv - c0);
    const int tid = threadIdx.x, nt = blockDim.x;
    const double g = (double)log_decay[h];
    for (int n = tid; n <= LT_C; n += nt) pw[n] = (float)exp(g * (double)n);
    float* S = state + (size_t)h * dk * dv;
    for (int e = tid; e < dk * LT_BV; e += nt) {
        const int r = e / LT_BV, c = e % LT_BV;
        Ss[e] = c < nc ? S[(size_t)r * dv + c0 + c] : 0.f;
    }
    __syncthreads();
    for (int s = 0; s < t; s += LT_C) {
        const int L = min(LT_C, t - s);
        float* H0 = hs + ((size_t)(s / LT_C) * H + h) * dk * dv;
        for (int e = tid; e < dk * LT_BV; e += nt) {
            const int r = e / LT_BV, c = e % LT_BV;
            if (c < nc) H0[(size_t)r * dv + c0 + c] = Ss[e];
        }
        for (int e = tid; e < LT_C * dk; e += nt) {
            const int i = e / dk, r = e % dk;
            Ks[i * ldq + r] = i < L ? k[((size_t)(s + i) * H + h) * dk + r] : 0.f;
        }
        for (int e = tid; e < LT_C * LT_BV; e += nt) {
            const int i = e / LT_BV, c = e % LT_BV;
            Vs[e] = (i < L && c < nc) ? v[((size_t)(s + i) * H + h) * dv + c0 + c] : 0.f;
        }
        __syncthreads();
        const float dl = pw[L];
        for (int e = tid; e < dk * LT_BV; e += nt) {
            const int r = e / LT_BV, c = e % LT_BV;
            float x = __fmul_rn(Ss[e], dl);
            for (int j = 0; j < L; ++j)
                x = __fadd_rn(x, __fmul_rn(__fmul_rn(Ks[j * ldq + r], pw[L - 1 - j]), Vs[j * LT_BV + c]));
            Ss[e] = x;
        }
        __syncthreads();
    }
    for (int e = tid; e < dk * LT_BV; e += nt) {
        const int r = e / LT_BV, c = e % LT_BV;
        if (c < nc) S[(size_t)r * dv + c0 + c] = Ss[e];
    }
}

extern "C" __global__ void lt_chunk_out(const float* __restrict__ q, const float* __restrict__ k,
                                        const float* __restrict__ v, const float* __restrict__ log_decay,
                                        float scale, const float* __restrict__ hs, float* __restrict__ o, int t,
                                        int H, int dk, int dv) {
    extern __shared__ float lc_sm[];
    const int ldq = dk + 1;
    float* Qs = lc_sm;
    float* Ks = Qs + LT_C * ldq;
    float* Vs = Ks + LT_C * ldq;
    float* As = Vs + LT_C * LT_BV;
    float* Ss = As + LT_C * LT_C;
    float* pw = Ss + dk * LT_BV;
    const int chunk = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * LT_BV;
    const int s = chunk * LT_C;
    const int L = min(LT_C, t - s);
    const int nc = min(LT_BV, dv - c0);
    const int tid = threadIdx.x, nt = blockDim.x;
    const double g = (double)log_decay[h];
    for (int n = tid; n <= LT_C; n += nt) pw[n] = (float)exp(g * (double)n);
    const float* H0 = hs + ((size_t)chunk * H + h) * dk * dv;
    for (int e = tid; e < dk * LT_BV; e += nt) {
        const int r = e / LT_BV, c = e % LT_BV;
        Ss[e] = c < nc ? H0[(size_t)r * dv + c0 + c] : 0.f;
    }
    for (int e = tid; e < LT_C * dk; e += nt) {
        const int i = e / dk, r = e % dk;
        const size_t row = (size_t)(s + i) * H + h;
        Ks[i * ldq + r] = i < L ? k[row * dk + r] : 0.f;
        Qs[i * ldq + r] = i < L ? q[row * dk + r] : 0.f;
    }
    for (int e = tid; e < LT_C * LT_BV; e += nt) {
        const int i = e / LT_BV, c = e % LT_BV;
        Vs[e] = (i < L && c < nc) ? v[((size_t)(s + i) * H + h) * dv + c0 + c] : 0.f;
    }
    __syncthreads();
    for (int e = tid; e < LT_C * LT_C; e += nt) {
        const int i = e / LT_C, j = e % LT_C;
        float a = 0.f;
        if (j <= i && i < L) {
            float dot = 0.f;
            for (int r = 0; r < dk; ++r) dot = __fadd_rn(dot, __fmul_rn(Qs[i * ldq + r], Ks[j * ldq + r]));
            a = __fmul_rn(__fmul_rn(dot, pw[i - j]), scale);
        }
        As[e] = a;
    }
    __syncthreads();
    for (int e = tid; e < LT_C * LT_BV; e += nt) {
        const int i = e / LT_BV, c = e % LT_BV;
        if (i >= L || c >= nc) continue;
        const float ai = __fmul_rn(pw[i + 1], scale);
        float acc = 0.f;
        for (int r = 0; r < dk; ++r) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(Qs[i * ldq + r], ai), Ss[r * LT_BV + c]));
        for (int j = 0; j <= i; ++j) acc = __fadd_rn(acc, __fmul_rn(As[i * LT_C + j], Vs[j * LT_BV + c]));
        o[((size_t)(s + i) * H + h) * dv + c0 + c] = acc;
    }
}
