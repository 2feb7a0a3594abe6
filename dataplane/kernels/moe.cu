// Mixture-of-experts FFN kernels (Qwen3-Next / Qwen3.5 sparse MoE block) and SwiGLU.
// Host side: dataplane/src/cuda/moe.rs. CPU reference: model::moe_forward, mlp_forward.
//
// Pipeline of one MoE forward over t tokens (n = t·k routed rows):
//   router GEMM (cuBLAS, fp32 out)  logits [t, ld]
//   moe_route      softmax + top-k per token           → topk_idx [t, k], topk_w [t, k]
//   moe_plan       per-expert counts/offsets, grouped-GEMM tile list, permutation
//                  (rows grouped by expert, within an expert in (token, slot) order)
//                                                      → perm_tok [n], slot_pos [n]
//   moe_gemm_gu    grouped GEMM x[perm]·W_gu[e]ᵀ with SwiGLU epilogue → act [n, I] (T)
//   moe_gemm_down  grouped GEMM act·W_down[e]ᵀ          → y [n, hidden] (fp32)
//   moe_combine    out[tok] = Σ_j w_j · y[slot_pos[tok, j]] (+ σ(g)·shared[tok]), fixed order

// ---------------------------------------------------------------------------------------
// SwiGLU: out[r, j] = silu(gu[r, j]) · gu[r, I + j]; gu: [rows, 2I] (gate then up), out: [rows, I].
template <typename T>
__device__ void swiglu_impl(const T* gu, T* out, i64 rows, int inter) {
    const i64 n = rows * (i64)inter;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / inter;
        const int j = (int)(i - r * inter);
        const float g = to_f(gu[r * 2 * inter + j]);
        const float u = to_f(gu[r * 2 * inter + inter + j]);
        out[i] = from_f<T>(silu_f(g) * u);
    }
}

// ---------------------------------------------------------------------------------------
// Routing, one warp per token. logits: [t, ld] fp32, the first E columns are the router
// logits. p = softmax(logits[:E]); the k largest p are chosen in descending order, ties to
// the lower expert index (as the CPU sort); weights p_j, or p_j / Σ_top p when `norm`.
// E ≤ 32·MOE_EPL, k ≤ 32 (checked on the host).
#define MOE_EPL 16
extern "C" __global__ void moe_route(const float* __restrict__ logits, int ld, int t, int E, int k,
                                     int norm, int* __restrict__ topk_idx,
                                     float* __restrict__ topk_w) {
    const int warp = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= t) return;  // whole warps exit together (blockDim a multiple of 32)
    const float* row = logits + (i64)warp * ld;
    float p[MOE_EPL];
    float m = NEG_INF;
#pragma unroll
    for (int q = 0; q < MOE_EPL; ++q) {
        const int e = lane + 32 * q;
        p[q] = e < E ? row[e] : NEG_INF;
        m = fmaxf(m, p[q]);
    }
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < MOE_EPL; ++q) {
        const int e = lane + 32 * q;
        if (e < E) {
            p[q] = expf(p[q] - m);
            s += p[q];
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int q = 0; q < MOE_EPL; ++q) {
        const int e = lane + 32 * q;
        p[q] = e < E ? p[q] / s : -3.f;
    }
    float sum = 0.f, my_w = 0.f;
    int my_e = 0;
    for (int j = 0; j < k; ++j) {
        float bv = -2.f;
        int be = 0x7fffffff;
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) {
            if (p[q] > bv) {  // q ascending → lower index wins ties within a lane
                bv = p[q];
                be = lane + 32 * q;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ov > bv || (ov == bv && oe < be)) {
                bv = ov;
                be = oe;
            }
        }
        if (be >= E) {  // only NaN left: a valid index with weight 0
            be = 0;
            bv = 0.f;
        }
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q)
            if (lane + 32 * q == be) p[q] = -3.f;
        sum += bv;
        if (lane == j) {
            my_e = be;
            my_w = bv;
        }
    }
    if (lane < k) {
        topk_idx[(i64)warp * k + lane] = my_e;
        topk_w[(i64)warp * k + lane] = norm ? my_w / sum : my_w;
    }
}

// ---------------------------------------------------------------------------------------
// Routing with the general rule (crate::router::RouterConfig::route), one warp per token:
// scores s = sigmoid(logits[:E]) (`sigmoid_scores`) or softmax(logits[:E]); selection on
// c = s + bias (bias may be null); with n_group > 1 the experts form n_group contiguous
// groups, each scored by the sum of its two largest c (its one c when a group holds one
// expert), and only the topk_group best groups (ties to the lower group) stay eligible, the
// others' c set to `dropped`; the k largest c are chosen (ties to the lower index). Weights:
// the unbiased s_j, divided by Σ_top s (summed in selection order) when norm and (softmax,
// k > 1 or renorm_single), then times `scale`. E ≤ 32·MOE_EPL, k ≤ 32, n_group ≤ 32.
__device__ __forceinline__ bool moe_better(float v1, int i1, float v2, int i2) {
    return i1 != 0x7fffffff && (i2 == 0x7fffffff || v1 > v2 || (v1 == v2 && i1 < i2));
}
extern "C" __global__ void moe_route_rule(const float* __restrict__ logits, int ld, int t, int E, int k,
                                          int norm, int sigmoid_scores, const float* __restrict__ bias,
                                          int n_group, int topk_group, float dropped, int renorm_single,
                                          float scale, int* __restrict__ topk_idx,
                                          float* __restrict__ topk_w) {
    const int warp = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= t) return;  // whole warps exit together (blockDim a multiple of 32)
    const float* row = logits + (i64)warp * ld;
    float s[MOE_EPL], c[MOE_EPL];
    if (sigmoid_scores) {
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) {
            const int e = lane + 32 * q;
            s[q] = e < E ? 1.f / (1.f + expf(-row[e])) : 0.f;
        }
    } else {
        float m = NEG_INF;
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) {
            const int e = lane + 32 * q;
            s[q] = e < E ? row[e] : NEG_INF;
            m = fmaxf(m, s[q]);
        }
        m = warp_max(m);
        float z = 0.f;
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) {
            const int e = lane + 32 * q;
            if (e < E) {
                s[q] = expf(s[q] - m);
                z += s[q];
            }
        }
        z = warp_sum(z);
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) s[q] = lane + 32 * q < E ? s[q] / z : 0.f;
    }
#pragma unroll
    for (int q = 0; q < MOE_EPL; ++q) {
        const int e = lane + 32 * q;
        c[q] = e < E ? s[q] + (bias ? bias[e] : 0.f) : NEG_INF;
    }
    if (n_group > 1) {
        const int per = E / n_group;
        float my_gs = NEG_INF;
        for (int g = 0; g < n_group; ++g) {
            float a1 = NEG_INF, a2 = NEG_INF;
#pragma unroll
            for (int q = 0; q < MOE_EPL; ++q) {
                const int e = lane + 32 * q;
                if (e < E && e / per == g) {
                    const float x = c[q];
                    if (x > a1) {
                        a2 = a1;
                        a1 = x;
                    } else if (x > a2) {
                        a2 = x;
                    }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float b1 = __shfl_xor_sync(0xffffffffu, a1, o);
                const float b2 = __shfl_xor_sync(0xffffffffu, a2, o);
                const float hi = fmaxf(a1, b1);
                a2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
                a1 = hi;
            }
            const float gs = per >= 2 ? a1 + a2 : a1;
            if (lane == g) my_gs = gs;
        }
        unsigned keep = 0u;
        for (int j = 0; j < topk_group; ++j) {
            float bv = my_gs;
            int bi = (lane < n_group && !((keep >> lane) & 1u)) ? lane : 0x7fffffff;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (moe_better(ov, oi, bv, bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
            if (bi != 0x7fffffff) keep |= 1u << bi;
        }
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) {
            const int e = lane + 32 * q;
            if (e < E && !((keep >> (e / per)) & 1u)) c[q] = dropped;
        }
    }
    unsigned taken = 0u;
    float sum = 0.f, my_s = 0.f;
    int my_e = 0;
    for (int j = 0; j < k; ++j) {
        float bv = NEG_INF, bs = 0.f;
        int be = 0x7fffffff;
#pragma unroll
        for (int q = 0; q < MOE_EPL; ++q) {
            const int e = lane + 32 * q;
            if (e < E && !((taken >> q) & 1u) && moe_better(c[q], e, bv, be)) {
                bv = c[q];
                be = e;
                bs = s[q];
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            const float os = __shfl_xor_sync(0xffffffffu, bs, o);
            if (moe_better(ov, oe, bv, be)) {
                bv = ov;
                be = oe;
                bs = os;
            }
        }
        if (be == 0x7fffffff) {  // nothing left (k > E is refused on the host)
            be = 0;
            bs = 0.f;
        } else if ((be & 31) == lane) {
            taken |= 1u << (be >> 5);
        }
        sum += bs;
        if (lane == j) {
            my_e = be;
            my_s = bs;
        }
    }
    if (lane < k) {
        const bool renorm = norm && (!sigmoid_scores || k > 1 || renorm_single);
        const float w = renorm ? my_s / sum : my_s;
        topk_idx[(i64)warp * k + lane] = my_e;
        topk_w[(i64)warp * k + lane] = w * scale;
    }
}

// ---------------------------------------------------------------------------------------
// Plan, one block per expert e (dynamic shared memory: E ints). Every block histograms
// all n = t·k assignments (integer atomics in shared memory: exact), so it knows
//   counts[e], offsets[e] = Σ_{e'<e} counts[e'], and its tile range in the tile list
//   (tiles of `bm` rows: tile_off[e] = Σ_{e'<e} ceil(counts[e'] / bm)).
// It writes its tiles (tile_e, tile_r0) and, scanning the assignments in order, the
// permutation: row pos = offsets[e] + rank of the assignment among expert e's, so rows of
// one expert are in (token, slot) order. perm_tok[pos] = token, slot_pos[a] = pos.
// Deterministic (no order-dependent atomics). blockDim: a multiple of 32, ≤ 1024.
extern "C" __global__ void moe_plan(const int* __restrict__ topk_idx, int n, int k, int E, int bm,
                                    int* __restrict__ counts, int* __restrict__ offsets,
                                    int* __restrict__ tile_e, int* __restrict__ tile_r0,
                                    int* __restrict__ num_tiles, int* __restrict__ perm_tok,
                                    int* __restrict__ slot_pos) {
    extern __shared__ int hist[];
    __shared__ int warp_cnt[32];
    __shared__ int s_off, s_toff;
    const int e = blockIdx.x;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int i = threadIdx.x; i < E; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += blockDim.x) atomicAdd(&hist[topk_idx[a]], 1);
    __syncthreads();
    // Offsets: per-thread partial sums over e' < e, then a warp/block reduction (ints).
    int po = 0, pt = 0;
    for (int q = threadIdx.x; q < e; q += blockDim.x) {
        po += hist[q];
        pt += (hist[q] + bm - 1) / bm;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        po += __shfl_xor_sync(0xffffffffu, po, o);
        pt += __shfl_xor_sync(0xffffffffu, pt, o);
    }
    __shared__ int red_o[32], red_t[32];
    if (lane == 0) {
        red_o[w] = po;
        red_t[w] = pt;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int a = 0, b = 0;
        for (int q = 0; q < nw; ++q) {
            a += red_o[q];
            b += red_t[q];
        }
        s_off = a;
        s_toff = b;
        counts[e] = hist[e];
        offsets[e] = a;
        if (e == E - 1) *num_tiles = b + (hist[e] + bm - 1) / bm;
    }
    __syncthreads();
    const int cnt = hist[e], off = s_off, toff = s_toff;
    for (int i = threadIdx.x; i * bm < cnt; i += blockDim.x) {
        tile_e[toff + i] = e;
        tile_r0[toff + i] = i * bm;
    }
    if (cnt == 0) return;
    int base = 0;
    for (int a0 = 0; a0 < n; a0 += blockDim.x) {
        const int a = a0 + threadIdx.x;
        const bool match = a < n && topk_idx[a] == e;
        const unsigned bal = __ballot_sync(0xffffffffu, match);
        if (lane == 0) warp_cnt[w] = __popc(bal);
        __syncthreads();
        int before = 0, tot = 0;
        for (int q = 0; q < nw; ++q) {
            const int c = warp_cnt[q];
            before += q < w ? c : 0;
            tot += c;
        }
        if (match) {
            const int pos = off + base + before + __popc(bal & ((1u << lane) - 1u));
            perm_tok[pos] = a / k;
            slot_pos[a] = pos;
        }
        base += tot;
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// Grouped GEMM, fp32 accumulation, shared-memory tiles of GBM rows × GBN columns × GBK,
// 256 threads, each a 4×4 register tile (rows ty + 16i, columns tx + 16j). One launch
// covers all experts: blockIdx.x indexes the tile list of moe_plan (blocks past
// *num_tiles exit), blockIdx.y the column tile.
//   MODE 0 (gate_up + SwiGLU): A row r of the tile = x[perm_tok[pos]] ([*, K = hidden]),
//     W = W_gu[e] ([2N, K], gate rows then up rows, N = I). The block's GBN columns are
//     GBN/2 gate rows c0 + c and the matching up rows N + c0 + c (c0 = blockIdx.y·GBN/2);
//     epilogue act[pos, c0 + c] = silu(gate) · up, stored as T ([n, N]).
//   MODE 1 (down): A row = act[pos] ([*, K = I]), W = W_down[e] ([N = hidden, K]);
//     y[pos, n0 + c] stored fp32 ([n, N]).
#define GBM 64
#define GBN 64
#define GBK 16
template <typename T, int MODE>
__device__ void moe_gemm_impl(const T* __restrict__ A, const int* __restrict__ perm_tok,
                              const T* __restrict__ W, T* __restrict__ act, float* __restrict__ y,
                              const int* __restrict__ counts, const int* __restrict__ offsets,
                              const int* __restrict__ tile_e, const int* __restrict__ tile_r0,
                              const int* __restrict__ num_tiles, int K, int N) {
    const int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    const int e = tile_e[tile], r0 = tile_r0[tile];
    const int base = offsets[e] + r0;
    const int rows = min(GBM, counts[e] - r0);
    __shared__ float As[GBK][GBM + 4];
    __shared__ float Bs[GBK][GBN + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    // Loader: thread → (tile row / column lr, k offset lk .. lk+3).
    const int lr = tid >> 2, lk = (tid & 3) * 4;
    const T* arp = nullptr;
    if (lr < rows) {
        const i64 src = MODE == 0 ? (i64)perm_tok[base + lr] : (i64)(base + lr);
        arp = A + src * K;
    }
    const i64 nw_rows = MODE == 0 ? 2 * (i64)N : (i64)N;
    const T* We = W + (i64)e * nw_rows * K;
    const T* wrp = nullptr;
    if (MODE == 0) {
        const int j = blockIdx.y * (GBN / 2) + (lr & (GBN / 2 - 1));
        if (j < N) wrp = We + (lr < GBN / 2 ? (i64)j : (i64)N + j) * K;
    } else {
        const int j = blockIdx.y * GBN + lr;
        if (j < N) wrp = We + (i64)j * K;
    }
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += GBK) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int kk = k0 + lk + q;
            As[lk + q][lr] = (arp && kk < K) ? to_f(arp[kk]) : 0.f;
            Bs[lk + q][lr] = (wrp && kk < K) ? to_f(wrp[kk]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GBK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i;
        if (r >= rows) continue;
        const i64 pos = base + r;
        if (MODE == 0) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int c = blockIdx.y * (GBN / 2) + tx + 16 * j;  // up partner: acc[i][j + 2]
                if (c < N) act[pos * N + c] = from_f<T>(silu_f(acc[i][j]) * acc[i][j + 2]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = blockIdx.y * GBN + tx + 16 * j;
                if (c < N) y[pos * N + c] = acc[i][j];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Grouped GEMM on tensor cores (bf16 in, fp32 accumulation): mma.sync.m16n8k16 from PTX.
// Same tile list, modes and outputs as moe_gemm_impl; tiles of TBM = 64 rows × TBN = 64
// columns × TBK = 32, 128 threads = 4 warps in 2 (rows) × 2 (columns), each warp 32 rows
// × four n8 column groups. Requires K % 32 == 0 and N % 32 == 0 (checked on the host;
// other shapes use the SIMT kernel). Global → register prefetch of the next k-slab while
// the current one is multiplied from shared memory.
//   Column groups of warp wn: MODE 0 → gate columns wn·16 + {0, 8} and the matching up
//   columns 32 + wn·16 + {0, 8} (so acc[i][j] pairs with acc[i][j + 2] in the SwiGLU
//   epilogue); MODE 1 → wn·32 + {0, 8, 16, 24}.
#define TBM 64
#define TBN 64
#define TBK 32
#define TLD (TBK + 8)  // shared row stride (bf16): 80 bytes, conflict-free fragment loads

__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int MODE>
__device__ __forceinline__ int tc_col(int wn, int j) {
    return MODE == 0 ? (j < 2 ? wn * 16 + j * 8 : 32 + wn * 16 + (j - 2) * 8) : wn * 32 + j * 8;
}

template <int MODE>
__device__ void moe_gemm_tc_impl(const bf16* __restrict__ A, const int* __restrict__ perm_tok,
                                 const bf16* __restrict__ W, bf16* __restrict__ act,
                                 float* __restrict__ y, const int* __restrict__ counts,
                                 const int* __restrict__ offsets, const int* __restrict__ tile_e,
                                 const int* __restrict__ tile_r0, const int* __restrict__ num_tiles,
                                 int K, int N) {
    const int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    const int e = tile_e[tile], r0 = tile_r0[tile];
    const int base = offsets[e] + r0;
    const int rows = min(TBM, counts[e] - r0);
    __shared__ __align__(16) bf16 As[TBM * TLD];
    __shared__ __align__(16) bf16 Bs[TBN * TLD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int g = lane >> 2, tq = lane & 3;
    const i64 nw_rows = MODE == 0 ? 2 * (i64)N : (i64)N;
    const bf16* We = W + (i64)e * nw_rows * K;
    // Loader: 64 rows × 4 chunks of 8 bf16 per operand = 256 chunks, two per thread.
    const bf16* asrc[2];
    const bf16* bsrc[2];
    int soff[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int c = tid + 128 * q;
        const int r = c >> 2, kc = (c & 3) * 8;
        soff[q] = r * TLD + kc;
        asrc[q] = nullptr;
        if (r < rows) {
            const i64 src = MODE == 0 ? (i64)perm_tok[base + r] : (i64)(base + r);
            asrc[q] = A + src * K + kc;
        }
        bsrc[q] = nullptr;
        if (MODE == 0) {
            const int j = blockIdx.y * (TBN / 2) + (r & (TBN / 2 - 1));
            if (j < N) bsrc[q] = We + (r < TBN / 2 ? (i64)j : (i64)N + j) * K + kc;
        } else {
            const int j = blockIdx.y * TBN + r;
            if (j < N) bsrc[q] = We + (i64)j * K + kc;
        }
    }
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
    const uint4 z4 = make_uint4(0u, 0u, 0u, 0u);
    uint4 ra[2], rb[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        ra[q] = asrc[q] ? *reinterpret_cast<const uint4*>(asrc[q]) : z4;
        rb[q] = bsrc[q] ? *reinterpret_cast<const uint4*>(bsrc[q]) : z4;
    }
    for (int k0 = 0; k0 < K; k0 += TBK) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            *reinterpret_cast<uint4*>(&As[soff[q]]) = ra[q];
            *reinterpret_cast<uint4*>(&Bs[soff[q]]) = rb[q];
        }
        __syncthreads();
        if (k0 + TBK < K) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                ra[q] = asrc[q] ? *reinterpret_cast<const uint4*>(asrc[q] + k0 + TBK) : z4;
                rb[q] = bsrc[q] ? *reinterpret_cast<const uint4*>(bsrc[q] + k0 + TBK) : z4;
            }
        }
#pragma unroll
        for (int kk = 0; kk < TBK; kk += 16) {
            unsigned af[2][4], bfr[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bf16* p0 = &As[(wm * 32 + i * 16 + g) * TLD + kk + 2 * tq];
                af[i][0] = *reinterpret_cast<const unsigned*>(p0);
                af[i][1] = *reinterpret_cast<const unsigned*>(p0 + 8 * TLD);
                af[i][2] = *reinterpret_cast<const unsigned*>(p0 + 8);
                af[i][3] = *reinterpret_cast<const unsigned*>(p0 + 8 * TLD + 8);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bf16* p0 = &Bs[(tc_col<MODE>(wn, j) + g) * TLD + kk + 2 * tq];
                bfr[j][0] = *reinterpret_cast<const unsigned*>(p0);
                bfr[j][1] = *reinterpret_cast<const unsigned*>(p0 + 8);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], af[i], bfr[j]);
        }
        __syncthreads();
    }
    // Epilogue from the accumulator layout: acc[i][j][h·2 + v] is tile row
    // wm·32 + i·16 + g + 8h, tile column tc_col(wn, j) + 2·tq + v.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * 32 + i * 16 + g + 8 * h;
            if (r >= rows) continue;
            const i64 pos = base + r;
            if (MODE == 0) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int c = blockIdx.y * (TBN / 2) + wn * 16 + j * 8 + 2 * tq;
                    if (c < N) {
                        const float a0 = silu_f(acc[i][j][2 * h]) * acc[i][j + 2][2 * h];
                        const float a1 = silu_f(acc[i][j][2 * h + 1]) * acc[i][j + 2][2 * h + 1];
                        *reinterpret_cast<__nv_bfloat162*>(&act[pos * N + c]) =
                            __floats2bfloat162_rn(a0, a1);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = blockIdx.y * TBN + tc_col<MODE>(wn, j) + 2 * tq;
                    if (c < N)
                        *reinterpret_cast<float2*>(&y[pos * N + c]) =
                            make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
    moe_gemm_gu_tc_bf16(const bf16* x, const int* perm_tok, const bf16* w, bf16* act,
                        const int* counts, const int* offsets, const int* tile_e,
                        const int* tile_r0, const int* num_tiles, int K, int N) {
    moe_gemm_tc_impl<0>(x, perm_tok, w, act, nullptr, counts, offsets, tile_e, tile_r0, num_tiles,
                        K, N);
}
extern "C" __global__ void __launch_bounds__(128)
    moe_gemm_down_tc_bf16(const bf16* act, const bf16* w, float* y, const int* counts,
                          const int* offsets, const int* tile_e, const int* tile_r0,
                          const int* num_tiles, int K, int N) {
    moe_gemm_tc_impl<1>(act, nullptr, w, nullptr, y, counts, offsets, tile_e, tile_r0, num_tiles,
                        K, N);
}

// ---------------------------------------------------------------------------------------
// Large-tile grouped GEMM on tensor cores (bf16 in, fp32 accumulation), for many routed
// rows (prefill). Same tile list (built with bm = LBM), modes and outputs as
// moe_gemm_tc_impl, but tiles of LBM = 128 rows × LBN = 128 columns × LBK = 32, 256 threads
// = 8 warps in 2 (rows) × 4 (columns), each warp 64 rows × four n8 column groups, and the
// operands staged through a LSTAGES-deep ring of cp.async copies in dynamic shared memory
// (LSTAGES · (LBM + LBN) · LLD bf16), so two k-slabs are in flight while one is multiplied.
// Each expert's weight tile is read once per 128 gathered rows (twice as few passes over
// the weights as the 64-row kernel). Requires K % 32 == 0 (checked on the host).
//   Column groups of warp wn: MODE 0 → gate columns wn·16 + {0, 8} and the matching up
//   columns 64 + wn·16 + {0, 8} (acc[i][j] pairs with acc[i][j + 2] in the SwiGLU epilogue);
//   MODE 1 → wn·32 + {0, 8, 16, 24}.
#define LBM 128
#define LBN 128
#define LBK 32
#define LLD (LBK + 8)  // shared row stride (bf16): 80 bytes, conflict-free fragment loads
#define LSTAGES 3
#define LSTAGE_ELEMS ((LBM + LBN) * LLD)

__device__ __forceinline__ unsigned moe_smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 16-byte global → shared copy; `ok == false` writes zeros and reads nothing.
__device__ __forceinline__ void moe_cp_async16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void moe_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N_PENDING>
__device__ __forceinline__ void moe_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N_PENDING) : "memory");
}

template <int MODE>
__device__ __forceinline__ int tcl_col(int wn, int j) {
    return MODE == 0 ? (j < 2 ? wn * 16 + j * 8 : 64 + wn * 16 + (j - 2) * 8) : wn * 32 + j * 8;
}

template <int MODE>
__device__ void moe_gemm_tcl_impl(const bf16* __restrict__ A, const int* __restrict__ perm_tok,
                                  const bf16* __restrict__ W, bf16* __restrict__ act,
                                  float* __restrict__ y, const int* __restrict__ counts,
                                  const int* __restrict__ offsets, const int* __restrict__ tile_e,
                                  const int* __restrict__ tile_r0,
                                  const int* __restrict__ num_tiles, int K, int N) {
    extern __shared__ __align__(16) unsigned char moe_dyn_smem[];
    bf16* sm = reinterpret_cast<bf16*>(moe_dyn_smem);
    const int tile = blockIdx.x;
    if (tile >= *num_tiles) return;
    const int e = tile_e[tile], r0 = tile_r0[tile];
    const int base = offsets[e] + r0;
    const int rows = min(LBM, counts[e] - r0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int g = lane >> 2, tq = lane & 3;
    const i64 nw_rows = MODE == 0 ? 2 * (i64)N : (i64)N;
    const bf16* We = W + (i64)e * nw_rows * K;
    // Loader: per operand 128 rows × 4 chunks of 8 bf16 = 512 chunks, two per thread.
    const bf16* asrc[2];
    const bf16* bsrc[2];
    int soff[2];
    bool aok[2], bok[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int c = tid + 256 * q;
        const int r = c >> 2, kc = (c & 3) * 8;
        soff[q] = r * LLD + kc;
        aok[q] = r < rows;
        const i64 src = !aok[q] ? 0 : MODE == 0 ? (i64)perm_tok[base + r] : (i64)(base + r);
        asrc[q] = A + src * K + kc;
        i64 wrow;
        if (MODE == 0) {
            const int j = blockIdx.y * (LBN / 2) + (r & (LBN / 2 - 1));
            bok[q] = j < N;
            wrow = r < LBN / 2 ? (i64)j : (i64)N + j;
        } else {
            const int j = blockIdx.y * LBN + r;
            bok[q] = j < N;
            wrow = j;
        }
        bsrc[q] = We + (bok[q] ? wrow : 0) * K + kc;
    }
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
    const int KT = K / LBK;
#pragma unroll
    for (int s = 0; s < LSTAGES - 1; ++s) {
        if (s < KT) {
            bf16* sa = sm + s * LSTAGE_ELEMS;
            bf16* sb = sa + LBM * LLD;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                moe_cp_async16(moe_smem_u32(sa + soff[q]), asrc[q] + s * LBK, aok[q]);
                moe_cp_async16(moe_smem_u32(sb + soff[q]), bsrc[q] + s * LBK, bok[q]);
            }
        }
        moe_cp_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        // Slab kt has landed (at most LSTAGES − 2 younger groups pending); the barrier
        // also tells every thread that slab kt − 1's stage is free for slab kt + 2.
        moe_cp_wait<LSTAGES - 2>();
        __syncthreads();
        const int nk = kt + LSTAGES - 1;
        if (nk < KT) {
            bf16* sa = sm + (nk % LSTAGES) * LSTAGE_ELEMS;
            bf16* sb = sa + LBM * LLD;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                moe_cp_async16(moe_smem_u32(sa + soff[q]), asrc[q] + nk * LBK, aok[q]);
                moe_cp_async16(moe_smem_u32(sb + soff[q]), bsrc[q] + nk * LBK, bok[q]);
            }
        }
        moe_cp_commit();
        const bf16* sa = sm + (kt % LSTAGES) * LSTAGE_ELEMS;
        const bf16* sb = sa + LBM * LLD;
#pragma unroll
        for (int kk = 0; kk < LBK; kk += 16) {
            unsigned af[4][4], bfr[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const bf16* p0 = &sa[(wm * 64 + i * 16 + g) * LLD + kk + 2 * tq];
                af[i][0] = *reinterpret_cast<const unsigned*>(p0);
                af[i][1] = *reinterpret_cast<const unsigned*>(p0 + 8 * LLD);
                af[i][2] = *reinterpret_cast<const unsigned*>(p0 + 8);
                af[i][3] = *reinterpret_cast<const unsigned*>(p0 + 8 * LLD + 8);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bf16* p0 = &sb[(tcl_col<MODE>(wn, j) + g) * LLD + kk + 2 * tq];
                bfr[j][0] = *reinterpret_cast<const unsigned*>(p0);
                bfr[j][1] = *reinterpret_cast<const unsigned*>(p0 + 8);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], af[i], bfr[j]);
        }
    }
    moe_cp_wait<0>();
    // Epilogue from the accumulator layout: acc[i][j][h·2 + v] is tile row
    // wm·64 + i·16 + g + 8h, tile column tcl_col(wn, j) + 2·tq + v.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * 64 + i * 16 + g + 8 * h;
            if (r >= rows) continue;
            const i64 pos = base + r;
            if (MODE == 0) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int c = blockIdx.y * (LBN / 2) + wn * 16 + j * 8 + 2 * tq;
                    if (c < N) {
                        const float a0 = silu_f(acc[i][j][2 * h]) * acc[i][j + 2][2 * h];
                        const float a1 = silu_f(acc[i][j][2 * h + 1]) * acc[i][j + 2][2 * h + 1];
                        *reinterpret_cast<__nv_bfloat162*>(&act[pos * N + c]) =
                            __floats2bfloat162_rn(a0, a1);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = blockIdx.y * LBN + tcl_col<MODE>(wn, j) + 2 * tq;
                    if (c < N)
                        *reinterpret_cast<float2*>(&y[pos * N + c]) =
                            make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2)
    moe_gemm_gu_tcl_bf16(const bf16* x, const int* perm_tok, const bf16* w, bf16* act,
                         const int* counts, const int* offsets, const int* tile_e,
                         const int* tile_r0, const int* num_tiles, int K, int N) {
    moe_gemm_tcl_impl<0>(x, perm_tok, w, act, nullptr, counts, offsets, tile_e, tile_r0,
                         num_tiles, K, N);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_gemm_down_tcl_bf16(const bf16* act, const bf16* w, float* y, const int* counts,
                           const int* offsets, const int* tile_e, const int* tile_r0,
                           const int* num_tiles, int K, int N) {
    moe_gemm_tcl_impl<1>(act, nullptr, w, nullptr, y, counts, offsets, tile_e, tile_r0,
                         num_tiles, K, N);
}

// ---------------------------------------------------------------------------------------
// Small-batch path (few routed rows, e.g. decode): one block per routed row a (token
// a / k, expert topk_idx[a], output row slot_pos[a]), GV_WARPS warps, each warp a few
// output columns; lanes stream 8-element (16-byte for bf16) chunks of the weight rows,
// so the expert weights are read once per routed row at full width. The input row is
// staged in shared memory as fp32 (dynamic, K floats). Requires K % 8 == 0.
//   gate_up: act[pos, j] = silu(x·W_gu[e][j]) · (x·W_gu[e][N + j]), GV_COLS_GU columns/warp
//   down:    y[pos, j] = act[pos]·W_down[e][j] (fp32), GV_COLS_DN columns/warp
#define GV_WARPS 8
#define GV_COLS_GU 2
#define GV_COLS_DN 4

__device__ __forceinline__ void load8(const bf16* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 v = __bfloat1622float2(h[q]);
        f[2 * q] = v.x;
        f[2 * q + 1] = v.y;
    }
}
__device__ __forceinline__ void load8(const float* p, float* f) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

template <typename T, int MODE>
__device__ void moe_gemv_impl(const T* __restrict__ A, const int* __restrict__ topk_idx,
                              const int* __restrict__ slot_pos, int k, const T* __restrict__ W,
                              T* __restrict__ act, float* __restrict__ y, int K, int N) {
    constexpr int COLS = MODE == 0 ? GV_COLS_GU : GV_COLS_DN;
    extern __shared__ float xs[];
    const int a = blockIdx.x;
    const int e = topk_idx[a], pos = slot_pos[a];
    const T* xr = A + (MODE == 0 ? (i64)(a / k) : (i64)pos) * K;
    for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = to_f(xr[i]);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 nw_rows = MODE == 0 ? 2 * (i64)N : (i64)N;
    const T* We = W + (i64)e * nw_rows * K;
    const int c0 = (blockIdx.y * GV_WARPS + warp) * COLS;
    float s0[COLS], s1[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) s0[c] = s1[c] = 0.f;
    // Two steps unrolled: more weight loads in flight per lane (the sum order per column
    // is unchanged).
#pragma unroll 2
    for (int kc = lane * 8; kc < K; kc += 256) {
        const float4 xa = *reinterpret_cast<const float4*>(&xs[kc]);
        const float4 xb = *reinterpret_cast<const float4*>(&xs[kc + 4]);
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int j = c0 + c;
            if (j < N) {
                float wv[8];
                load8(We + (i64)j * K + kc, wv);
#pragma unroll
                for (int q = 0; q < 8; ++q) s0[c] = fmaf(wv[q], xv[q], s0[c]);
                if (MODE == 0) {
                    load8(We + ((i64)N + j) * K + kc, wv);
#pragma unroll
                    for (int q = 0; q < 8; ++q) s1[c] = fmaf(wv[q], xv[q], s1[c]);
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        s0[c] = warp_sum(s0[c]);
        if (MODE == 0) s1[c] = warp_sum(s1[c]);
    }
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int j = c0 + c;
            if (j >= N) continue;
            if (MODE == 0) act[(i64)pos * N + j] = from_f<T>(silu_f(s0[c]) * s1[c]);
            else y[(i64)pos * N + j] = s0[c];
        }
    }
}

#define MOE_GEMV(S, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                \
        moe_gemv_gu_##S(const T* x, const int* topk_idx, const int* slot_pos, int k,           \
                        const T* w, T* act, int K, int N) {                                    \
        moe_gemv_impl<T, 0>(x, topk_idx, slot_pos, k, w, act, nullptr, K, N);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                \
        moe_gemv_down_##S(const T* act, const int* topk_idx, const int* slot_pos, int k,       \
                          const T* w, float* y, int K, int N) {                                \
        moe_gemv_impl<T, 1>(act, topk_idx, slot_pos, k, w, nullptr, y, K, N);                  \
    }
MOE_GEMV(f32, float)
MOE_GEMV(bf16, bf16)

// ---------------------------------------------------------------------------------------
// Combine in token order: out[tok, h] = Σ_{j<k} w[tok, j] · y[slot_pos[tok, j], h]
// (+ σ(logits[tok, gate_col]) · shared[tok, h] when `shared` is non-null), summed in slot
// order j = 0..k-1 then the shared term: deterministic, no atomics.
template <typename T>
__device__ void moe_combine_impl(const float* __restrict__ y, const int* __restrict__ slot_pos,
                                 const float* __restrict__ topk_w, int k, const T* __restrict__ shared,
                                 const float* __restrict__ logits, int ld, int gate_col,
                                 T* __restrict__ out, int t, int H) {
    const i64 n = (i64)t * H;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 tok = i / H;
        const int h = (int)(i - tok * H);
        float acc = 0.f;
        for (int j = 0; j < k; ++j)
            acc += topk_w[tok * k + j] * y[(i64)slot_pos[tok * k + j] * H + h];
        if (shared) {
            if (gate_col < 0) {
                acc += to_f(shared[i]);  // ungated shared expert (Ring-linear, Kimi-Linear)
            } else {
                const float g = logits[tok * ld + gate_col];
                acc += (1.f / (1.f + expf(-g))) * to_f(shared[i]);
            }
        }
        out[i] = from_f<T>(acc);
    }
}

#define MOE_KERNELS(S, T)                                                                      \
    extern "C" __global__ void swiglu_##S(const T* gu, T* out, i64 rows, int inter) {         \
        swiglu_impl<T>(gu, out, rows, inter);                                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        moe_gemm_gu_##S(const T* x, const int* perm_tok, const T* w, T* act,                   \
                        const int* counts, const int* offsets, const int* tile_e,              \
                        const int* tile_r0, const int* num_tiles, int K, int N) {              \
        moe_gemm_impl<T, 0>(x, perm_tok, w, act, nullptr, counts, offsets, tile_e, tile_r0,    \
                            num_tiles, K, N);                                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        moe_gemm_down_##S(const T* act, const T* w, float* y, const int* counts,               \
                          const int* offsets, const int* tile_e, const int* tile_r0,           \
                          const int* num_tiles, int K, int N) {                                \
        moe_gemm_impl<T, 1>(act, nullptr, w, nullptr, y, counts, offsets, tile_e, tile_r0,     \
                            num_tiles, K, N);                                                  \
    }                                                                                          \
    extern "C" __global__ void moe_combine_##S(const float* y, const int* slot_pos,           \
                                               const float* topk_w, int k, const T* shared,    \
                                               const float* logits, int ld, int gate_col,      \
                                               T* out, int t, int H) {                         \
        moe_combine_impl<T>(y, slot_pos, topk_w, k, shared, logits, ld, gate_col, out, t, H); \
    }
MOE_KERNELS(f32, float)
MOE_KERNELS(bf16, bf16)
