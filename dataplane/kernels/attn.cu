// Causal GQA attention prefill over KV placed at arbitrary positions (CPU reference:
// model::attention). Query t of head h attends to every cached key j of kv head
// h / (H/Hkv) with kv_pos[j] ≤ q_pos[t]; scale = head_dim^-0.5; fp32 online softmax.
//   q: [Tq, H, HD]; k, v: [N, Hkv, HD]; q_pos: [Tq] i64; kv_pos: [N] i64; o: [Tq, H, HD].
// A query with no visible key gets o = 0.
// grid (ceil(Tq/16), H), block 128 = 4 warps; each warp owns 4 queries; keys in tiles
// of 32 (lane = key for the scores, lane = output column for P·V).
#define AQ 16
#define AK 32
#define QPW 4

template <typename T, int HD>
__device__ void attn_prefill_impl(const T* q, const T* k, const T* v, const i64* q_pos, const i64* kv_pos,
                                  T* o, int tq, int n_kv, int nh, int nkv, float scale) {
    constexpr int LK = HD + 4;
    constexpr int NE = HD / 32;
    extern __shared__ float sm[];
    float* Qs = sm;              // [AQ][HD]
    float* Ks = Qs + AQ * HD;    // [AK][LK]
    float* Vs = Ks + AK * LK;    // [AK][HD]
    __shared__ i64 kp[AK];
    __shared__ i64 qp[AQ];
    const int h = blockIdx.y, kh = h / (nh / nkv), q0 = blockIdx.x * AQ;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    for (int idx = tid; idx < AQ * HD; idx += blockDim.x) {
        const int i = idx / HD, d = idx % HD;
        Qs[idx] = (q0 + i < tq) ? to_f(q[((size_t)(q0 + i) * nh + h) * HD + d]) * scale : 0.f;
    }
    if (tid < AQ) qp[tid] = (q0 + tid < tq) ? q_pos[q0 + tid] : (i64)(-0x7fffffffffffffffLL);
    __syncthreads();
    i64 qmax = qp[0];
    for (int i = 1; i < AQ; ++i) qmax = qp[i] > qmax ? qp[i] : qmax;
    float m[QPW], l[QPW], acc[QPW][NE];
#pragma unroll
    for (int a = 0; a < QPW; ++a) {
        m[a] = NEG_INF;
        l[a] = 0.f;
#pragma unroll
        for (int e = 0; e < NE; ++e) acc[a][e] = 0.f;
    }
    for (int j0 = 0; j0 < n_kv; j0 += AK) {
        __syncthreads();
        if (tid < AK) kp[tid] = (j0 + tid < n_kv) ? kv_pos[j0 + tid] : (i64)0x7fffffffffffffffLL;
        __syncthreads();
        // Skip a tile no query of this block can see.
        const int visible = __syncthreads_or(tid < AK && kp[tid] <= qmax);
        if (!visible) continue;
        for (int idx = tid; idx < AK * HD; idx += blockDim.x) {
            const int j = idx / HD, d = idx % HD;
            const bool ok = j0 + j < n_kv;
            const size_t src = ((size_t)(j0 + j) * nkv + kh) * HD + d;
            Ks[j * LK + d] = ok ? to_f(k[src]) : 0.f;
            Vs[j * HD + d] = ok ? to_f(v[src]) : 0.f;
        }
        __syncthreads();
        float s[QPW];
#pragma unroll
        for (int a = 0; a < QPW; ++a) s[a] = 0.f;
        for (int d = 0; d < HD; d += 4) {
            const float4 kv4 = *reinterpret_cast<const float4*>(Ks + lane * LK + d);
#pragma unroll
            for (int a = 0; a < QPW; ++a) {
                const float4 qv = *reinterpret_cast<const float4*>(Qs + (w * QPW + a) * HD + d);
                s[a] += qv.x * kv4.x + qv.y * kv4.y + qv.z * kv4.z + qv.w * kv4.w;
            }
        }
        float p[QPW];
#pragma unroll
        for (int a = 0; a < QPW; ++a) {
            const bool ok = kp[lane] <= qp[w * QPW + a];
            const float sa = ok ? s[a] : NEG_INF;
            const float mn = fmaxf(m[a], warp_max(sa));
            // mn == -inf: nothing visible yet for this query; keep everything at zero.
            const float pa = (mn == NEG_INF || !ok) ? 0.f : expf(sa - mn);
            const float corr = (m[a] == NEG_INF) ? 0.f : expf(m[a] - mn);
            l[a] = l[a] * corr + warp_sum(pa);
#pragma unroll
            for (int e = 0; e < NE; ++e) acc[a][e] *= corr;
            m[a] = mn;
            p[a] = pa;
        }
        for (int j = 0; j < AK; ++j) {
            float vv[NE];
#pragma unroll
            for (int e = 0; e < NE; ++e) vv[e] = Vs[j * HD + lane + 32 * e];
#pragma unroll
            for (int a = 0; a < QPW; ++a) {
                const float pj = __shfl_sync(0xffffffffu, p[a], j);
#pragma unroll
                for (int e = 0; e < NE; ++e) acc[a][e] += pj * vv[e];
            }
        }
    }
#pragma unroll
    for (int a = 0; a < QPW; ++a) {
        const int qi = q0 + w * QPW + a;
        if (qi < tq) {
            const float inv = l[a] > 0.f ? 1.f / l[a] : 0.f;
#pragma unroll
            for (int e = 0; e < NE; ++e)
                o[((size_t)qi * nh + h) * HD + lane + 32 * e] = from_f<T>(acc[a][e] * inv);
        }
    }
}

#define ATTN(S, T, HD)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_##S##_##HD(                        \
        const T* q, const T* k, const T* v, const i64* q_pos, const i64* kv_pos, T* o, int tq,        \
        int n_kv, int nh, int nkv, float scale) {                                                     \
        attn_prefill_impl<T, HD>(q, k, v, q_pos, kv_pos, o, tq, n_kv, nh, nkv, scale);                \
    }
ATTN(f32, float, 64)
ATTN(f32, float, 128)
ATTN(f32, float, 256)
ATTN(bf16, bf16, 64)
ATTN(bf16, bf16, 128)
ATTN(bf16, bf16, 256)

// ---------------------------------------------------------------------------------------
// Row softmax of the GEMM-based fast path (attn::prefill_fast in cuda/attn.rs).
//   s: [rows, ld] fp32 scores, already scaled by hd^-0.5 (cuBLAS alpha); row r holds the
//      scores of query q0 + (r % qb) (rows are [batch][qb] with any batch count) against
//      keys 0..n_kv; columns n_kv..ld are padding and are neither read nor written.
//   p: [rows, ld] T: p[r][j] = exp(s - m) / l over the keys with kv_pos[j] ≤ q_pos[q],
//      0 for masked keys; a row that sees no key is all zeros.
// grid (rows), block ASM_THREADS; fp32 online (max, sum) per thread, merged per block.
#define ASM_THREADS 256

__device__ __forceinline__ void asm_merge(float& m, float& l, float m2, float l2) {
    const float mn = fmaxf(m, m2);
    if (mn == NEG_INF) {
        m = mn;
        l = 0.f;
        return;
    }
    l = (m == NEG_INF ? 0.f : l * expf(m - mn)) + (m2 == NEG_INF ? 0.f : l2 * expf(m2 - mn));
    m = mn;
}

template <typename T>
__device__ void attn_softmax_impl(const float* s, T* p, const i64* q_pos, const i64* kv_pos, int qb,
                                  int q0, int n_kv, int ld) {
    __shared__ float sm_m[ASM_THREADS / 32];
    __shared__ float sm_l[ASM_THREADS / 32];
    const size_t r = blockIdx.x;
    const i64 qp = q_pos[q0 + (int)(r % (size_t)qb)];
    const float* sr = s + r * (size_t)ld;
    T* pr = p + r * (size_t)ld;
    float m = NEG_INF, l = 0.f;
    for (int j = threadIdx.x; j < n_kv; j += blockDim.x) {
        if (kv_pos[j] <= qp) {
            const float x = sr[j];
            if (x > m) {
                l = (m == NEG_INF ? 0.f : l * expf(m - x)) + 1.f;
                m = x;
            } else {
                l += expf(x - m);
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
        asm_merge(m, l, m2, l2);
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sm_m[w] = m;
        sm_l[w] = l;
    }
    __syncthreads();
    m = NEG_INF;
    l = 0.f;
    for (int i = 0; i < nw; ++i) asm_merge(m, l, sm_m[i], sm_l[i]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int j = threadIdx.x; j < n_kv; j += blockDim.x) {
        const bool ok = kv_pos[j] <= qp && l > 0.f;
        pr[j] = from_f<T>(ok ? expf(sr[j] - m) * inv : 0.f);
    }
}

#define ATTN_SOFTMAX(S, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(ASM_THREADS) attn_softmax_##S(                       \
        const float* s, T* p, const i64* q_pos, const i64* kv_pos, int qb, int q0, int n_kv, int ld) { \
        attn_softmax_impl<T>(s, p, q_pos, kv_pos, qb, q0, n_kv, ld);                                   \
    }
ATTN_SOFTMAX(f32, float)
ATTN_SOFTMAX(bf16, bf16)

// Key limits of the query blocks of attn::prefill_fast: lim[b] = 1 + the largest j with
// kv_pos[j] ≤ max(q_pos[b·qb .. min(tq, (b+1)·qb))), 0 when there is none. Keys at
// j ≥ lim[b] are masked for every query of block b, so its GEMMs stop there.
// grid (ceil(tq/qb)), block 256.
__device__ __forceinline__ i64 i64_max(i64 a, i64 b) { return a > b ? a : b; }

extern "C" __global__ void __launch_bounds__(256) attn_block_limits(const i64* q_pos, const i64* kv_pos, int tq,
                                                                    int n_kv, int qb, int* lim) {
    __shared__ i64 sq[32];
    __shared__ int sj[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int q0 = blockIdx.x * qb, q1 = min(tq, q0 + qb);
    i64 m = (i64)(-0x7fffffffffffffffLL - 1);
    for (int i = q0 + threadIdx.x; i < q1; i += blockDim.x) m = i64_max(m, q_pos[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = i64_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) sq[w] = m;
    __syncthreads();
    i64 qmax = sq[0];
    for (int i = 1; i < nw; ++i) qmax = i64_max(qmax, sq[i]);
    int jm = -1;
    for (int j = threadIdx.x; j < n_kv; j += blockDim.x)
        if (kv_pos[j] <= qmax) jm = j;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) jm = max(jm, __shfl_xor_sync(0xffffffffu, jm, o));
    if (lane == 0) sj[w] = jm;
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = sj[0];
        for (int i = 1; i < nw; ++i) r = max(r, sj[i]);
        lim[blockIdx.x] = r + 1;
    }
}
