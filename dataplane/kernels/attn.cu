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

// attn_prefill_* with the key count read from the device (*n_kv_dev): the same blocks
// and the same arithmetic, for a launch recorded once in a CUDA graph and replayed while
// the cache grows (attn::prefill_dev).
#define ATTN_DEV(S, T, HD)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_dev_##S##_##HD(                    \
        const T* q, const T* k, const T* v, const i64* q_pos, const i64* kv_pos, T* o, int tq,        \
        const int* n_kv_dev, int nh, int nkv, float scale) {                                          \
        attn_prefill_impl<T, HD>(q, k, v, q_pos, kv_pos, o, tq, *n_kv_dev, nh, nkv, scale);           \
    }
ATTN_DEV(f32, float, 64)
ATTN_DEV(f32, float, 128)
ATTN_DEV(f32, float, 256)
ATTN_DEV(bf16, bf16, 64)
ATTN_DEV(bf16, bf16, 128)
ATTN_DEV(bf16, bf16, 256)

// One row appended to a KV cache at the row index *n_kv_dev − 1 read from the device
// (attn::kv_append_dev): k, v: [row] → K, V: [cap, row] at that row; pos: [1] → P.
template <typename T>
__device__ void kv_append_dev_impl(const T* k, const T* v, const i64* pos, T* K, T* V, i64* P,
                                   const int* n_kv_dev, int row) {
    const size_t at = (size_t)(*n_kv_dev - 1);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < row; i += gridDim.x * blockDim.x) {
        K[at * row + i] = k[i];
        V[at * row + i] = v[i];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) P[at] = pos[0];
}
extern "C" __global__ void kv_append_dev_f32(const float* k, const float* v, const i64* pos, float* K,
                                             float* V, i64* P, const int* n, int row) {
    kv_append_dev_impl<float>(k, v, pos, K, V, P, n, row);
}
extern "C" __global__ void kv_append_dev_bf16(const bf16* k, const bf16* v, const i64* pos, bf16* K,
                                              bf16* V, i64* P, const int* n, int row) {
    kv_append_dev_impl<bf16>(k, v, pos, K, V, P, n, row);
}

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

// Decode attention (split over the keys, "flash-decoding"): one query token over n_kv
// cached keys at arbitrary positions (key j is visible iff kv_pos[j] <= q_pos[0]; CPU
// reference: model::attention). q: [1, nh, HD] bf16; k, v: [n_kv, nkv, HD] bf16.
// grid (nkv, nsplit), block 32·G with G = nh / nkv ≤ 8: warp w serves query head
// kh·G + w and reads kv head kh's keys [j0, j1) (the split's contiguous range), so the G
// query heads of a group read each K/V row from L1/L2 after the first. Lane l holds
// dims [l·VEC, l·VEC + VEC) (VEC = HD / 32) of its query row and of its accumulator.
// Per step DK keys: their positions, K and V rows loaded together (one memory round trip),
// the partial dot products, one butterfly per key (every lane gets the score), the online
// softmax update in the log2 domain (scale_log2 = HD^-0.5 · log2 e), the value rows. Output: the split workspace wo [nsplit][nh][HD] (unnormalised fp32,
// zeros when the split saw no key) and wml [nsplit][nh][2] (m in the log2 domain, l), merged
// by attn_decode_combine_bf16. The prefill kernels spend a 64- or 128-row query tile on
// this one row (33 µs per layer at 4k keys on the H200).
#define DK 8

template <int VEC>
__device__ __forceinline__ void ld_bf16_vec(const bf16* __restrict__ p, float* f) {
    if constexpr (VEC == 8) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 t = __bfloat1622float2(h[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    } else {
        static_assert(VEC == 4, "HD 128 or 256");
        const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float2 t = __bfloat1622float2(h[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    }
}

template <int HD>
__device__ void attn_decode_impl(const bf16* __restrict__ q, const i64* __restrict__ q_pos,
                                 const bf16* __restrict__ k, const bf16* __restrict__ v,
                                 const i64* __restrict__ kv_pos, float* __restrict__ wo, float* __restrict__ wml,
                                 int n_kv, int nh, int nkv, float scale_log2, int nsplit) {
    constexpr int VEC = HD / 32;
    const int kh = blockIdx.x, G = nh / nkv;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = kh * G + w;
    const int per = (n_kv + nsplit - 1) / nsplit;
    const int j0 = min(n_kv, (int)blockIdx.y * per), j1 = min(n_kv, j0 + per);
    const i64 qp = q_pos[0];
    float qv[VEC], acc[VEC];
    ld_bf16_vec<VEC>(q + (size_t)h * HD + lane * VEC, qv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
    float m = NEG_INF, l = 0.f;
    for (int j = j0; j < j1; j += DK) {
        float s[DK], kv[DK][VEC], vv[DK][VEC];
        i64 kp[DK];
#pragma unroll
        for (int u = 0; u < DK; ++u) {
            const int jj = min(j + u, j1 - 1);  // past the range: a valid row, masked below
            kp[u] = __ldg(kv_pos + jj);
            ld_bf16_vec<VEC>(k + ((size_t)jj * nkv + kh) * HD + lane * VEC, kv[u]);
            ld_bf16_vec<VEC>(v + ((size_t)jj * nkv + kh) * HD + lane * VEC, vv[u]);
        }
#pragma unroll
        for (int u = 0; u < DK; ++u) {
            float d = 0.f;
#pragma unroll
            for (int e = 0; e < VEC; ++e) d = fmaf(qv[e], kv[u][e], d);
            s[u] = d;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < DK; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], off);
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < DK; ++u) {
            const bool ok = j + u < j1 && kp[u] <= qp;
            s[u] = ok ? s[u] * scale_log2 : NEG_INF;
            mx = fmaxf(mx, s[u]);
        }
        if (mx == NEG_INF) continue;  // nothing visible yet (same values in every lane)
        const float c = exp2f(m - mx);  // m = -inf → 0
        float ps = 0.f;
#pragma unroll
        for (int u = 0; u < DK; ++u) {
            s[u] = exp2f(s[u] - mx);
            ps += s[u];
        }
        l = l * c + ps;
        m = mx;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float a = acc[e] * c;
#pragma unroll
            for (int u = 0; u < DK; ++u) a = fmaf(s[u], vv[u][e], a);
            acc[e] = a;
        }
    }
    const size_t r = (size_t)blockIdx.y * nh + h;
#pragma unroll
    for (int e = 0; e < VEC; ++e) wo[r * HD + lane * VEC + e] = acc[e];
    if (lane == 0) {
        wml[r * 2] = m;
        wml[r * 2 + 1] = l;
    }
}

#define ATTN_DECODE(HD)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        attn_decode_bf16_##HD(const bf16* q, const i64* q_pos, const bf16* k, const bf16* v, const i64* kv_pos, \
                              float* wo, float* wml, int n_kv, int nh, int nkv, float scale_log2) {           \
        attn_decode_impl<HD>(q, q_pos, k, v, kv_pos, wo, wml, n_kv, nh, nkv, scale_log2, gridDim.y);         \
    }
ATTN_DECODE(128)
ATTN_DECODE(256)

// The split plan of attn::decode for n_kv keys (split = None): at least
// DECODE_KEYS_PER_SPLIT keys per range, at most DECODE_PLAN_MAX_SPLIT ranges.
#define DECODE_KEYS_PER_SPLIT 64
#define DECODE_PLAN_MAX_SPLIT 128
__device__ __forceinline__ int decode_plan_splits(int n_kv) {
    const int s = min((n_kv + DECODE_KEYS_PER_SPLIT - 1) / DECODE_KEYS_PER_SPLIT, DECODE_PLAN_MAX_SPLIT);
    return max(s, 1);
}

// attn_decode_bf16_* with the key count read from the device (*n_kv_dev; attn::decode_dev):
// the grid is sized for the cache's capacity (gridDim.y ≥ the plan's splits for any length
// up to it); the ranges of decode_plan_splits(n_kv) are those attn::decode picks for n_kv
// keys, and blocks past them exit without writing.
#define ATTN_DECODE_DEV(HD)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        attn_decode_dev_bf16_##HD(const bf16* q, const i64* q_pos, const bf16* k, const bf16* v,             \
                                  const i64* kv_pos, float* wo, float* wml, const int* n_kv_dev, int nh,     \
                                  int nkv, float scale_log2) {                                               \
        const int n_kv = *n_kv_dev;                                                                          \
        const int ns = decode_plan_splits(n_kv);                                                             \
        if ((int)blockIdx.y >= ns) return;                                                                   \
        attn_decode_impl<HD>(q, q_pos, k, v, kv_pos, wo, wml, n_kv, nh, nkv, scale_log2, ns);                \
    }
ATTN_DECODE_DEV(128)
ATTN_DECODE_DEV(256)

// Merge of attn_decode_bf16_*'s splits: o[h] = Σ_s 2^(m_s − M) O_s / Σ_s 2^(m_s − M) l_s
// (M = max_s m_s); a head no split saw anything for gets zeros. grid (nh), block hd (one
// column per thread), dynamic shared memory nsplit floats (the split weights). The split
// outputs are finite (zeros for a split without a visible key), so every split is summed
// without a branch, eight loads in flight.
__device__ __forceinline__ void attn_decode_combine_impl(const float* wo, const float* wml, bf16* o, int nh,
                                                         int hd, int nsplit) {
    extern __shared__ float dw[];
    __shared__ float sinv;
    const size_t r = blockIdx.x;
    const int tid = threadIdx.x;
    if (tid < 32) {
        float mm = NEG_INF;
        for (int s = tid; s < nsplit; s += 32) mm = fmaxf(mm, wml[((size_t)s * nh + r) * 2]);
        mm = warp_max(mm);
        float ll = 0.f;
        for (int s = tid; s < nsplit; s += 32) {
            const float m = wml[((size_t)s * nh + r) * 2];
            const float wgt = m == NEG_INF ? 0.f : exp2f(m - mm);
            dw[s] = wgt;
            ll += wgt * wml[((size_t)s * nh + r) * 2 + 1];
        }
        ll = warp_sum(ll);
        if (tid == 0) sinv = ll > 0.f ? 1.f / ll : 0.f;
    }
    __syncthreads();
    const float inv = sinv;
    for (int c = tid; c < hd; c += blockDim.x) {
        float a = 0.f;
#pragma unroll 8
        for (int s = 0; s < nsplit; ++s) a = fmaf(dw[s], wo[((size_t)s * nh + r) * hd + c], a);
        o[r * hd + c] = __float2bfloat16_rn(a * inv);
    }
}

extern "C" __global__ void __launch_bounds__(256)
    attn_decode_combine_bf16(const float* wo, const float* wml, bf16* o, int nh, int hd, int nsplit) {
    attn_decode_combine_impl(wo, wml, o, nh, hd, nsplit);
}

// attn_decode_combine_bf16 over the splits attn_decode_dev_bf16_* used for *n_kv_dev keys
// (dynamic shared memory for DECODE_PLAN_MAX_SPLIT floats).
extern "C" __global__ void __launch_bounds__(256)
    attn_decode_combine_dev_bf16(const float* wo, const float* wml, bf16* o, int nh, int hd, const int* n_kv_dev) {
    attn_decode_combine_impl(wo, wml, o, nh, hd, decode_plan_splits(*n_kv_dev));
}

// ---------------------------------------------------------------------------------------
// The attention layers of a batched decode step, B sequences in one launch each
// (attn::kv_append_rows, attn::decode_rows). Each sequence has its own KV cache, found
// through an address table tbl: [3, B] u64 — the B key-cache, the B value-cache, then the
// B position-cache addresses — and its own key count n_kv[b] (the length after the
// append). Per sequence, the same blocks and the same arithmetic as kv_append_dev_* and
// attn_decode_dev_bf16_* / attn_decode_combine_dev_bf16, so the outputs are those of the
// one-sequence kernels bit for bit.

// kv_append_dev_* for row b = blockIdx.y: k, v: [B, row]; pos: [B]; tbl as above.
template <typename T>
__device__ __forceinline__ void kv_append_rows_impl(const T* k, const T* v, const i64* pos,
                                                    const unsigned long long* tbl, const int* n_kv, int row,
                                                    int bsz) {
    const int b = blockIdx.y;
    if (n_kv[b] < 1) __trap();  // the caller's contract: the length after the append
    kv_append_dev_impl<T>(k + (size_t)b * row, v + (size_t)b * row, pos + b, (T*)tbl[b], (T*)tbl[bsz + b],
                          (i64*)tbl[2 * bsz + b], n_kv + b, row);
}
extern "C" __global__ void kv_append_rows_f32(const float* k, const float* v, const i64* pos,
                                              const unsigned long long* tbl, const int* n_kv, int row, int bsz) {
    kv_append_rows_impl<float>(k, v, pos, tbl, n_kv, row, bsz);
}
extern "C" __global__ void kv_append_rows_bf16(const bf16* k, const bf16* v, const i64* pos,
                                               const unsigned long long* tbl, const int* n_kv, int row, int bsz) {
    kv_append_rows_impl<bf16>(k, v, pos, tbl, n_kv, row, bsz);
}

// Where sequence b's splits start in the packed workspace of attn_decode_rows_bf16_*:
// the splits of the sequences before it, decode_plan_splits(n_kv[j]) each (so a batch
// of mixed lengths takes what its sequences would take one by one).
__device__ __forceinline__ size_t decode_rows_base(const int* n_kv, int b) {
    size_t base = 0;
    for (int j = 0; j < b; ++j) base += (size_t)decode_plan_splits(n_kv[j]);
    return base;
}

// attn_decode_dev_bf16_* for sequence b = blockIdx.z: q: [B, nh, HD]; q_pos: [B];
// wo: [total][nh][HD], wml: [total][nh][2], packed: sequence b's ns_b =
// decode_plan_splits(n_kv[b]) splits start at decode_rows_base (Σ_b ns_b ≤ total);
// gridDim.y is at least every ns_b and ranges past ns_b exit.
#define ATTN_DECODE_ROWS(HD)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                        \
        attn_decode_rows_bf16_##HD(const bf16* q, const i64* q_pos, const unsigned long long* tbl,            \
                                   const int* n_kv, float* wo, float* wml, int nh, int nkv, float scale_log2, \
                                   int bsz, int total) {                                                     \
        const int b = blockIdx.z;                                                                            \
        const int n = n_kv[b];                                                                               \
        const int ns = decode_plan_splits(n);                                                                \
        const size_t at = decode_rows_base(n_kv, b);                                                         \
        /* the caller's contract: a length after the append, a grid and a workspace for the plan */          \
        if (n < 1 || ns > (int)gridDim.y || at + ns > (size_t)total) __trap();                               \
        if ((int)blockIdx.y >= ns) return;                                                                   \
        attn_decode_impl<HD>(q + (size_t)b * nh * HD, q_pos + b, (const bf16*)tbl[b],                        \
                             (const bf16*)tbl[bsz + b], (const i64*)tbl[2 * bsz + b],                        \
                             wo + at * nh * HD, wml + at * nh * 2, n, nh, nkv, scale_log2, ns);              \
    }
ATTN_DECODE_ROWS(128)
ATTN_DECODE_ROWS(256)

// attn_decode_combine_dev_bf16 for sequence b = blockIdx.y: wo, wml as attn_decode_rows_*
// (packed), o: [B, nh, hd]; dynamic shared memory for DECODE_PLAN_MAX_SPLIT floats.
extern "C" __global__ void __launch_bounds__(256)
    attn_decode_combine_rows_bf16(const float* wo, const float* wml, bf16* o, int nh, int hd,
                                  const int* n_kv, int total) {
    const int b = blockIdx.y;
    const size_t at = decode_rows_base(n_kv, b);
    if (n_kv[b] < 1 || at + decode_plan_splits(n_kv[b]) > (size_t)total) __trap();
    attn_decode_combine_impl(wo + at * nh * hd, wml + at * nh * 2, o + (size_t)b * nh * hd, nh, hd,
                             decode_plan_splits(n_kv[b]));
}
