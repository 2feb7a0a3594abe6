// Greedy argmax and seeded temperature / top-k / top-p sampling, one block per row of
// logits [rows, vocab] fp32. Host side and the exact definition: dataplane/src/cuda/sample.rs.
typedef unsigned long long u64;

#define IDX_NONE 0x7fffffff
#define NEG_INF_D (__longlong_as_double(0xfff0000000000000ll))

// Monotone map of a float to a 32-bit key (the order of f32::total_cmp: -0 < +0).
__device__ __forceinline__ unsigned f2key(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key2f(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// SplitMix64 finaliser.
__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Gumbel noise of token i for (seed, step): u = (h >> 11 + 0.5) · 2⁻⁵³ ∈ (0, 1),
// g = −ln(−ln u), h = mix64(mix64(mix64(seed) ^ step) ^ i). Independent of the row.
__device__ __forceinline__ double gumbel(u64 seed, u64 step, int i) {
    const u64 h = mix64(mix64(mix64(seed) ^ step) ^ (u64)(unsigned)i);
    const double u = ((double)(h >> 11) + 0.5) * 1.1102230246251565e-16;
    return -log(-log(u));
}

// Block-wide (value desc, index asc) argmax over per-thread candidates (v, i); "nothing"
// is (−inf or lower, IDX_NONE). All threads get the result. blockDim a multiple of 32.
__device__ void block_argmax_d(double& bv, int& bi) {
    __shared__ double sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        sv[w] = bv;
        si[w] = bi;
    }
    __syncthreads();
    if (w == 0) {
        bv = lane < nw ? sv[lane] : NEG_INF_D;
        bi = lane < nw ? si[lane] : IDX_NONE;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const double ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            sv[0] = bv;
            si[0] = bi;
        }
    }
    __syncthreads();
    bv = sv[0];
    bi = si[0];
    __syncthreads();
}

// Index of the largest logit of `row`, lowest index on ties, NaN never chosen; 0 when no
// entry is above −inf (as sampling::argmax).
__device__ int row_argmax(const float* row, int vocab) {
    double bv = NEG_INF_D;
    int bi = IDX_NONE;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if ((double)v > bv) {  // i ascending per thread: first (lowest) index wins ties
            bv = v;
            bi = i;
        }
    }
    block_argmax_d(bv, bi);
    return bi == IDX_NONE ? 0 : bi;
}

extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab,
                                       unsigned* __restrict__ out) {
    const int r = row_argmax(logits + (i64)blockIdx.x * vocab, vocab);
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)r;
}

__device__ u64 block_sum_u64(u64 v) {
    __shared__ u64 sh[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    u64 t = 0;
    for (int q = 0; q < nw; ++q) t += sh[q];
    __syncthreads();
    return t;
}

// Radix select, descending: over the elements i < n with weight wf(i) > 0 (u64), finds the
// 32-bit key K with W(key > K) < target ≤ W(key ≥ K), where W sums the weights (target
// ≥ 1 and ≤ the total). Returns K; *gt = W(key > K), *eq = W(key == K). Four passes of 8
// bits; integer atomics only, so the result does not depend on thread timing.
template <typename KeyF, typename WF>
__device__ unsigned select_desc(int n, KeyF keyf, WF wf, u64 target, u64* gt_out, u64* eq_out) {
    __shared__ u64 hist[256];
    __shared__ int s_bin;
    __shared__ u64 s_gt, s_eq;
    unsigned prefix = 0, mask = 0;
    u64 gt = 0, eq = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u64 wgt = wf(i);
            if (wgt == 0) continue;
            const unsigned key = keyf(i);
            if ((key & mask) != prefix) continue;
            atomicAdd(&hist[(key >> shift) & 255u], wgt);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 acc = gt;
            int b = 255;
            for (; b > 0; --b) {
                if (acc + hist[b] >= target) break;
                acc += hist[b];
            }
            s_bin = b;
            s_gt = acc;
            s_eq = hist[b];
        }
        __syncthreads();
        prefix |= (unsigned)s_bin << shift;
        mask |= 255u << shift;
        gt = s_gt;
        eq = s_eq;
        __syncthreads();
    }
    *gt_out = gt;
    *eq_out = eq;
    return prefix;
}

// Fixed-point scale of the top-p masses (2^40).
#define MASS_ONE 1099511627776.0

// One block per row; see sample.rs for the definition of the draw.
extern "C" __global__ void __launch_bounds__(1024)
    sample_rows(const float* __restrict__ logits, int vocab, const float* __restrict__ temps,
                const int* __restrict__ topks, const float* __restrict__ topps,
                const u64* __restrict__ seeds, const u64* __restrict__ steps,
                unsigned* __restrict__ out) {
    __shared__ float sh[32];
    const int row = blockIdx.x;
    const float* L = logits + (i64)row * vocab;
    const float temp = temps[row];
    const int top_k = topks[row];
    const float top_p = topps[row];
    if (!(temp > 0.f) || top_k == 1) {
        const int r = row_argmax(L, vocab);
        if (threadIdx.x == 0) out[row] = (unsigned)r;
        return;
    }
    // Finite count and max logit m over finite l_i. Keys, masses and scores use l_i
    // and (l_i − m) / T rather than s_i = l_i / T: the same order and values for T > 0,
    // but l_i / T at a tiny T would round the gaps between logits away.
    float m = NEG_INF;
    int n_fin_local = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = L[i];
        if (isfinite(l)) {
            ++n_fin_local;
            m = fmaxf(m, l);
        }
    }
    const int n_fin = (int)(block_sum_u64((u64)n_fin_local));
    m = warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = m;
    __syncthreads();
    {
        float t = NEG_INF;
        for (int q = 0; q < (int)(blockDim.x >> 5); ++q) t = fmaxf(t, sh[q]);
        m = t;
    }
    __syncthreads();
    if (n_fin == 0 || !isfinite(m)) {  // nothing finite, or the scaling overflowed
        const int r = row_argmax(L, vocab);
        if (threadIdx.x == 0) out[row] = (unsigned)r;
        return;
    }
    auto alive = [&](int i) -> bool { return isfinite(L[i]); };
    auto skey = [&](int i) -> unsigned { return f2key(L[i]); };

    // Top-k: key threshold kk and index cut for ties at the threshold.
    unsigned kk = 0;
    int cut_k = IDX_NONE;
    if (top_k > 0 && top_k < n_fin) {
        u64 gt, eq;
        kk = select_desc(
            vocab, skey, [&](int i) -> u64 { return alive(i) ? 1ull : 0ull; }, (u64)top_k, &gt, &eq);
        const u64 r = (u64)top_k - gt;  // 1 ≤ r ≤ eq
        if (r < eq) {
            const unsigned kcap = kk;
            u64 g2, e2;
            const unsigned ik = select_desc(
                vocab, [&](int i) -> unsigned { return ~(unsigned)i; },
                [&](int i) -> u64 { return (alive(i) && skey(i) == kcap) ? 1ull : 0ull; }, r, &g2,
                &e2);
            cut_k = (int)(~ik);
        }
    }
    const unsigned kk_c = kk;
    const int cut_k_c = cut_k;
    auto in_k = [&](int i) -> bool {
        if (!alive(i)) return false;
        const unsigned key = skey(i);
        return key > kk_c || (key == kk_c && i <= cut_k_c);
    };

    // Top-p over the top-k set: fixed-point masses q_i = rint(exp((l_i − m) / T) / Z · 2^40).
    unsigned kp = 0;
    int cut_p = IDX_NONE;
    if (top_p < 1.f) {
        float z = 0.f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (in_k(i)) z += expf((L[i] - m) / temp);
        z = block_sum(z, sh);
        __syncthreads();
        auto qf = [&](float l) -> u64 {
            return (u64)rint((double)(expf((l - m) / temp) / z) * MASS_ONE);
        };
        auto wq = [&](int i) -> u64 { return in_k(i) ? qf(L[i]) : 0ull; };
        u64 qloc = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) qloc += wq(i);
        const u64 qtot = block_sum_u64(qloc);
        u64 target = top_p > 0.f ? (u64)ceil((double)top_p * (double)qtot) : 1ull;
        if (target < 1) target = 1;
        if (target > qtot) target = qtot;
        if (target >= 1 && qtot > 0) {
            u64 gt, eq;
            kp = select_desc(vocab, skey, wq, target, &gt, &eq);
            const u64 q_eq = qf(key2f(kp));
            const u64 c_eq = q_eq > 0 ? eq / q_eq : 1;
            const u64 r = q_eq > 0 ? (target - gt + q_eq - 1) / q_eq : 1;  // elements needed
            if (r < c_eq) {
                const unsigned kcap = kp;
                u64 g2, e2;
                const unsigned ik = select_desc(
                    vocab, [&](int i) -> unsigned { return ~(unsigned)i; },
                    [&](int i) -> u64 { return (in_k(i) && skey(i) == kcap) ? 1ull : 0ull; }, r,
                    &g2, &e2);
                cut_p = (int)(~ik);
            }
        }
    }
    const unsigned kp_c = kp;
    const int cut_p_c = cut_p;

    // Gumbel-max over the kept set.
    const u64 seed = seeds[row], step = steps[row];
    double bv = NEG_INF_D;
    int bi = IDX_NONE;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (!in_k(i)) continue;
        const unsigned key = f2key(L[i]);
        if (!(key > kp_c || (key == kp_c && i <= cut_p_c))) continue;
        // argmax (l/T + g) computed as argmax (l + T·g): the same order for T > 0,
        // but l/T at a tiny T loses the gaps between logits to fp32 rounding.
        const double score = (double)L[i] + (double)temp * gumbel(seed, step, i);
        if (score > bv) {
            bv = score;
            bi = i;
        }
    }
    block_argmax_d(bv, bi);
    if (threadIdx.x == 0) out[row] = (unsigned)(bi == IDX_NONE ? 0 : bi);
}

// Logits kept in the model's element type widened to fp32 for the samplers above
// (bf16 -> f32 is exact: the bits shifted into the upper half).
extern "C" __global__ void widen_f32_f32(const float* __restrict__ src, float* __restrict__ dst,
                                        i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
extern "C" __global__ void widen_bf16_f32(const unsigned short* __restrict__ src,
                                         float* __restrict__ dst, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __uint_as_float((unsigned)src[i] << 16);
}
