// Chunked Lightning attention prefill on tensor cores, bf16 q/k/v, fp32 state, bf16 output
// (the linear layers of Ring-linear-2.0 in a bf16 model). Host side:
// dataplane/src/cuda/lightning.rs (`chunked_tc`). Reference: lt_chunk of lightning.cu (fp32
// SIMT, same contract) and the CPU mixers/lightning/{naive,chunk}.rs.
//
// Recurrence per head h with the constant decay γ = exp(g_h) (g_h ≤ 0):
//   S_t = γ·S_{t−1} + k_t v_tᵀ,   o_t = scale·S_tᵀ q_t.
// Per chunk of L ≤ 64 tokens from the chunk-initial state S₀ (i, j chunk-local):
//   o_i   = scale·γ^{i+1}·q_i S₀ + Σ_{j≤i} scale·γ^{i−j}(q_i·k_j) v_j
//   S_new = γ^L S₀ + Σ_{j<L} k_j (γ^{L−1−j} v_j)ᵀ
// One block per (head, 16 value columns); the chunks run in order inside the block, the
// next chunks' q/k/v tiles loading (cp.async, LTC_ST stages) while the current one is
// computed. Four warps; warp w owns chunk rows 16w..16w+15 for the output and state rows
// 32w..32w+31 for the update. Every product is an mma.sync m16n8k16 (bf16 operands, fp32
// accumulation): P = Q Kᵀ (causal key tiles only), P V, Q S₀, and Kᵀ Ṽ. The state lives in
// fp32 registers; its bf16 copy (for Q S₀) is double-buffered in shared memory so one
// barrier per chunk suffices. bf16-rounded intermediates (as FLA's chunk kernels): P, the
// bf16 copy of S₀, and Ṽ = γ^{L−1−j} v_j. Decay powers γ^n = exp(n·g_h) from double
// precision, rounded once (as lt_chunk).
//
// Split form (the same results bit for bit): lt_scores_tc_bf16 computes every chunk's masked
// scores P at once (one block per chunk and head; the state plays no part in them) into a
// fragment-ordered buffer, and lt_chunk_pre_tc_bf16 runs the chunk loop with P copied in
// beside the tiles, so the sequential part does only P V, Q S₀ and the state update.
//
// Two-pass form (the default; FLA's cut, with states kept every 128 tokens): lt_states_tc_bf16
// runs only the state recurrence, one block per (head, 16 value columns), 128-token steps in
// order with LTC_SST pipeline stages, and stores the bf16 state before each step; then
// lt_out_tc_bf16 computes every 128-token block's output at once (one block per block and
// head, all 128 value columns): o_i = scale·γ^{i+1}·q_i S_b + Σ_{j≤i} scale·γ^{i−j}(q_i·k_j) v_j
// with S_b the stored state. The sequential part reads only k and v; the state's bf16 copies
// (H · ⌈t/128⌉ · 32 KiB) carry it to the parallel part.
//
// Layouts: q, k [t, H, 128], v and o [t, H, 128] bf16, token-major; log_decay [H] fp32;
// state [H, 128, 128] fp32 K-major (S[h][key][value]), advanced in place. o = null: a
// state-only pass (q not read). Needs 16-byte aligned q, k, v. Grid (H, 128 / 16),
// blockDim 128, dynamic shared memory LTC_SMEM bytes.

#define LTC_C 64     // chunk length
#define LTC_D 128    // dk = dv
#define LTC_BV 16    // value columns per block
#define LTC_LDQ 136  // bf16 row stride of the Q and K tiles: 272 B (ldmatrix rows 16-B aligned,
                     // the 8 rows of one ldmatrix phase on distinct banks)
#define LTC_LDV 24   // bf16 row stride of the V and S tiles: 48 B (same properties)
#define LTC_QK_ELEMS (LTC_C * LTC_LDQ)
#define LTC_V_ELEMS (LTC_C * LTC_LDV)
#define LTC_S_ELEMS (LTC_D * LTC_LDV)
// Q[2], K[2], V[2], S[2] (bf16), then the decay powers pw[0..LTC_C] (fp32).
// Pipeline stages of the chunk loop: chunks n+1 .. n+LTC_ST−1 load while n computes. The
// host (lightning.rs TC_STAGES) sizes shared memory for the same value.
#ifndef LTC_ST
#define LTC_ST 2
#endif
#define LTC_SMEM ((LTC_ST * (2 * LTC_QK_ELEMS + LTC_V_ELEMS) + 2 * LTC_S_ELEMS) * 2 + (LTC_C + 1) * 4)
// lt_chunk_pre_tc_bf16: LTC_SMEM rounded up to 16 bytes, then the score fragments [LTC_ST][16 · 32] uint4.
#define LTC_PRE_SMEM (((LTC_SMEM + 15) / 16) * 16 + LTC_ST * 512 * 16)
// lt_scores_tc_bf16: one Q and one K tile, the decay powers.
#define LTC_SCORES_SMEM (2 * LTC_QK_ELEMS * 2 + (LTC_C + 1) * 4)
// Two-pass form: tokens per step of lt_states_tc_bf16 and per block of lt_out_tc_bf16 (the
// stored states are those at multiples of LTC_CB).
#define LTC_CB 128
// Pipeline stages of lt_states_tc_bf16 (steps n+1 .. n+LTC_SST−1 load while n computes; the
// host's TC_STATE_STAGES sizes shared memory for the same value).
#ifndef LTC_SST
#define LTC_SST 3
#endif
// lt_states_tc_bf16: per stage a 128-token K tile (row stride LTC_LDQ) and V tile (LTC_LDV),
// then the decay powers γ^0..γ^LTC_CB.
#define LTC_STATES_SMEM (LTC_SST * LTC_CB * (LTC_LDQ + LTC_LDV) * 2 + (LTC_CB + 1) * 4)
// lt_out_tc_bf16: the Q, K, V and state tiles [LTC_CB][LTC_LDQ] bf16, the decay powers.
#define LTC_OUT_SMEM (4 * LTC_CB * LTC_LDQ * 2 + (LTC_CB + 1) * 4)

// ---------------------------------------------------------------------------------------
// Warp-level primitives (inline PTX). HYPIC_HOST_EMU: a host build supplies its own.
#ifndef HYPIC_HOST_EMU
__device__ __forceinline__ unsigned ltc_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes global → shared, bypassing L1; ok = false writes 16 zero bytes (src not read).
__device__ __forceinline__ void ltc_cp16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void ltc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ltc_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void ltc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8×8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8. Register i
// of lane (g = l / 4, q = l % 4) receives (row g, columns 2q, 2q+1) of matrix i; with .trans
// (row 2q, column g) and (row 2q+1, column g). Lower column / row in the low half.
__device__ __forceinline__ void ltc_ldsm(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ltc_ldsm_t(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// c (16×8 fp32) += a (16×16 bf16, row) · b (16×8 bf16, col). g = lane / 4, q = lane % 4:
// a = {A[g][2q..], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..]}, b = {B[2q..][g], B[2q+8..][g]},
// c = {C[g][2q], C[g][2q+1], C[g+8][2q], C[g+8][2q+1]}.
__device__ __forceinline__ void ltc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 → one bf16 pair (lo in the low half), and back.
__device__ __forceinline__ unsigned ltc_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ float ltc_lo(unsigned x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float ltc_hi(unsigned x) { return __uint_as_float(x & 0xffff0000u); }
#endif

// The masked, decayed score fragments of warp w for its chunk rows 16w..16w+15: pa[ks]
// is the mma A fragment (keys 16ks..16ks+15, ks ≤ w) of P_ij = scale·γ^{i−j}(q_i·k_j)
// for j ≤ i, else 0, rounded to bf16. qf: the warp's Q rows as A fragments over the key
// dim; Kb: the chunk's K tile (row stride LTC_LDQ); pw: γ^0..γ^LTC_C.
__device__ __forceinline__ void ltc_scores(const unsigned (*qf)[4], const bf16* Kb, const float* pw, float scale,
                                           unsigned (*pa)[4]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int g = lane >> 2, qd = lane & 3, lm = lane >> 3, lr = lane & 7;
    // P = Q Kᵀ over key tiles 0..2w+1 (the later ones are masked out entirely).
    float p[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
#pragma unroll
    for (int np = 0; np < 4; ++np) {
        if (np > w) break;  // warp-uniform
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            unsigned kf[4];
            ltc_ldsm(kf, ltc_smem(Kb + (16 * np + 8 * (lm >> 1) + lr) * LTC_LDQ + 16 * ks + 8 * (lm & 1)));
            ltc_mma(p[2 * np], qf[ks], kf[0], kf[1]);
            ltc_mma(p[2 * np + 1], qf[ks], kf[2], kf[3]);
        }
    }
    // Causal mask and decay: P_ij · scale·γ^{i−j} for j ≤ i, else 0.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = 16 * w + g + (e >> 1) * 8, j = 8 * nt + 2 * qd + (e & 1);
            p[nt][e] = j <= i ? p[nt][e] * (pw[i - j] * scale) : 0.f;
        }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        pa[ks][0] = ltc_pack(p[2 * ks][0], p[2 * ks][1]);
        pa[ks][1] = ltc_pack(p[2 * ks][2], p[2 * ks][3]);
        pa[ks][2] = ltc_pack(p[2 * ks + 1][0], p[2 * ks + 1][1]);
        pa[ks][3] = ltc_pack(p[2 * ks + 1][2], p[2 * ks + 1][3]);
    }
}

// Q rows 16w..16w+15 of a Q tile as A fragments over the key dim (8 steps of 16).
__device__ __forceinline__ void ltc_q_frags(const bf16* Qb, unsigned (*qf)[4]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, lm = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
        ltc_ldsm(qf[ks], ltc_smem(Qb + (16 * w + 8 * (lm & 1) + lr) * LTC_LDQ + 16 * ks + 8 * (lm >> 1)));
}

// The block's state tile in fp32 registers: sacc[mt][nt] holds state rows 32w + 16mt + g
// (and + 8), value columns cb + 8nt + 2qd (and + 1) of one head's S ([128][128] fp32,
// K-major). LOAD: read it from S; else write it back.
template <bool LOAD>
__device__ __forceinline__ void ltc_state_io(float* S, float (&sacc)[2][2][4], int cb) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, qd = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int r = 32 * w + 16 * mt + g, c = cb + 8 * nt + 2 * qd;
            float* p[4] = {S + (size_t)r * LTC_D + c, S + (size_t)r * LTC_D + c + 1, S + (size_t)(r + 8) * LTC_D + c,
                           S + (size_t)(r + 8) * LTC_D + c + 1};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (LOAD) sacc[mt][nt][e] = *p[e];
                else *p[e] = sacc[mt][nt][e];
            }
        }
}

// State update over NKS key steps of 16 (a chunk or step of L ≤ 16·NKS tokens):
// S ← γ^L S + Kᵀ Ṽ with Ṽ_j = γ^{L−1−j} v_j (0 past L). vf: the V tile as B operands
// (k = key, n = the block's value columns 0–7 then 8–15), scaled to Ṽ in place; Kb: the K
// tile (row stride LTC_LDQ); pw: γ^0..γ^L.
template <int NKS>
__device__ __forceinline__ void ltc_state_update(float (&sacc)[2][2][4], unsigned (&vf)[NKS][4], const bf16* Kb,
                                                 const float* pw, int L) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, qd = lane & 3, lm = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int j = 16 * ks + 2 * qd + (r & 1) * 8;
            const float f0 = j < L ? pw[L - 1 - j] : 0.f;
            const float f1 = j + 1 < L ? pw[L - 2 - j] : 0.f;
            vf[ks][r] = ltc_pack(ltc_lo(vf[ks][r]) * f0, ltc_hi(vf[ks][r]) * f1);
        }
    const float dl = pw[L];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[mt][nt][e] *= dl;
#pragma unroll
        for (int ks = 0; ks < NKS; ++ks) {
            // Kᵀ rows 32w + 16mt.. as an A operand over keys 16ks..: the transposes of
            // K's 8×8 blocks (keys, channels) (0, 0), (0, 8), (8, 0), (8, 8).
            unsigned kf[4];
            ltc_ldsm_t(kf, ltc_smem(Kb + (16 * ks + 8 * (lm >> 1) + lr) * LTC_LDQ + 32 * w + 16 * mt + 8 * (lm & 1)));
            ltc_mma(sacc[mt][0], kf, vf[ks][0], vf[ks][1]);
            ltc_mma(sacc[mt][1], kf, vf[ks][2], vf[ks][3]);
        }
    }
}

// The sequential chunk loop. PRE: the score fragments come from lt_scores_tc_bf16 (pf,
// [H][n_chunks][16][32] uint4, copied with the chunk's tiles) instead of being computed here.
template <bool PRE>
__device__ __forceinline__ void ltc_chunk_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                               const bf16* __restrict__ v, const uint4* __restrict__ pf,
                                               const float* __restrict__ log_decay, float scale,
                                               float* __restrict__ state, bf16* __restrict__ o, int t, int H) {
    extern __shared__ __align__(16) unsigned char ltc_sm[];
    bf16* Qs = reinterpret_cast<bf16*>(ltc_sm);  // [LTC_ST][LTC_C][LTC_LDQ]
    bf16* Ks = Qs + LTC_ST * LTC_QK_ELEMS;       // [LTC_ST][LTC_C][LTC_LDQ]
    bf16* Vs = Ks + LTC_ST * LTC_QK_ELEMS;       // [LTC_ST][LTC_C][LTC_LDV]
    bf16* Ss = Vs + LTC_ST * LTC_V_ELEMS;        // [2][LTC_D][LTC_LDV]
    float* pw = reinterpret_cast<float*>(Ss + 2 * LTC_S_ELEMS);
    uint4* Ps = reinterpret_cast<uint4*>(ltc_sm + ((LTC_SMEM + 15) / 16) * 16);  // PRE: [LTC_ST][16 · 32]
    const int h = blockIdx.x, cb = blockIdx.y * LTC_BV;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, qd = lane & 3;
    // ldmatrix addressing: this lane's matrix and row within it.
    const int lm = lane >> 3, lr = lane & 7;
    const bool want_o = o != nullptr;
    const double gl = (double)log_decay[h];
    for (int n = tid; n <= LTC_C; n += 128) pw[n] = (float)exp(gl * (double)n);

    // Chunk tiles at token s into buffer b; rows past the end are zero.
    auto load = [&](int s, int b) {
        const int L = min(LTC_C, t - s);
        for (int e = tid; e < LTC_C * 16; e += 128) {
            const int i = e >> 4, p = e & 15;
            const bool ok = i < L;
            const size_t src = ((size_t)(ok ? s + i : s) * H + h) * LTC_D + p * 8;
            const int dst = b * LTC_QK_ELEMS + i * LTC_LDQ + p * 8;
            ltc_cp16(ltc_smem(Ks + dst), k + src, ok);
            if (want_o) ltc_cp16(ltc_smem(Qs + dst), q + src, ok);
        }
        {
            const int i = tid >> 1, p = tid & 1;
            const bool ok = i < L;
            const size_t src = ((size_t)(ok ? s + i : s) * H + h) * LTC_D + cb + p * 8;
            ltc_cp16(ltc_smem(Vs + b * LTC_V_ELEMS + i * LTC_LDV + p * 8), v + src, ok);
        }
        if (PRE && want_o) {
            const uint4* src = pf + ((size_t)h * ((t + LTC_C - 1) / LTC_C) + s / LTC_C) * 512;
            for (int e = tid; e < 512; e += 128) ltc_cp16(ltc_smem(Ps + b * 512 + e), src + e, true);
        }
        ltc_cp_commit();
    };

    // The state in registers: sacc[mt][nt] is the accumulator tile of state rows
    // 32w + 16mt (+8) + g, value columns 8nt + 2qd (+1) of this block.
    float sacc[2][2][4];
    float* S = state + (size_t)h * LTC_D * LTC_D;
    ltc_state_io<true>(S, sacc, cb);
    // bf16 copy of the state into S buffer b (the B operand of Q S₀).
    auto store_s = [&](int b) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int r = 32 * w + 16 * mt + g, c = 8 * nt + 2 * qd;
                bf16* d = Ss + b * LTC_S_ELEMS;
                *reinterpret_cast<unsigned*>(d + r * LTC_LDV + c) = ltc_pack(sacc[mt][nt][0], sacc[mt][nt][1]);
                *reinterpret_cast<unsigned*>(d + (r + 8) * LTC_LDV + c) =
                    ltc_pack(sacc[mt][nt][2], sacc[mt][nt][3]);
            }
    };

    const int nch = (t + LTC_C - 1) / LTC_C;
    if (nch == 0) return;  // nothing copied, nothing to write back
    // One commit group per chunk (empty past the end), so that at chunk n exactly
    // LTC_ST − 2 groups are newer than n's own: waiting until at most that many are
    // pending lands it.
#pragma unroll
    for (int i = 0; i < LTC_ST - 1; ++i) {
        if (i < nch) load(i * LTC_C, i);
        else ltc_cp_commit();
    }
    store_s(0);
    for (int n = 0; n < nch; ++n) {
        const int s = n * LTC_C, L = min(LTC_C, t - s), b = n % LTC_ST, sb = n & 1;
        ltc_cp_wait<LTC_ST - 2>();
        // Chunk n's tiles, S₀'s bf16 copy and (n = 0) pw are visible; every warp is done
        // with chunk n − 1, so its stage may be refilled (with chunk n + LTC_ST − 1).
        __syncthreads();
        if (n + LTC_ST - 1 < nch) load(s + (LTC_ST - 1) * LTC_C, (n + LTC_ST - 1) % LTC_ST);
        else ltc_cp_commit();
        const bf16* Qb = Qs + b * LTC_QK_ELEMS;
        const bf16* Kb = Ks + b * LTC_QK_ELEMS;
        const bf16* Vb = Vs + b * LTC_V_ELEMS;
        // V as B operands (k = key j, n = value column): vf[ks] = {b0, b1} of columns
        // 0–7, then of columns 8–15, keys 16ks..16ks+15.
        unsigned vf[4][4];
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            ltc_ldsm_t(vf[ks], ltc_smem(Vb + (16 * ks + 8 * (lm & 1) + lr) * LTC_LDV + 8 * (lm >> 1)));

        if (want_o) {
            const bf16* Sb = Ss + sb * LTC_S_ELEMS;
            unsigned qf[8][4];
            ltc_q_frags(Qb, qf);
            unsigned pa[4][4];
            if (PRE) {
#pragma unroll
                for (int ks = 0; ks < 4; ++ks) {
                    if (ks > w) break;
                    const uint4 x = Ps[b * 512 + (4 * w + ks) * 32 + lane];
                    pa[ks][0] = x.x, pa[ks][1] = x.y, pa[ks][2] = x.z, pa[ks][3] = x.w;
                }
            } else {
                ltc_scores(qf, Kb, pw, scale, pa);
            }
            // Intra-chunk part P V and inter-chunk part Q S₀.
            float oi[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            float oq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                if (ks > w) break;  // warp-uniform: keys past the warp's rows
                ltc_mma(oi[0], pa[ks], vf[ks][0], vf[ks][1]);
                ltc_mma(oi[1], pa[ks], vf[ks][2], vf[ks][3]);
            }
#pragma unroll
            for (int ks = 0; ks < 8; ++ks) {
                unsigned sf[4];
                ltc_ldsm_t(sf, ltc_smem(Sb + (16 * ks + 8 * (lm & 1) + lr) * LTC_LDV + 8 * (lm >> 1)));
                ltc_mma(oq[0], qf[ks], sf[0], sf[1]);
                ltc_mma(oq[1], qf[ks], sf[2], sf[3]);
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = 16 * w + g + 8 * hf;
                if (i >= L) continue;
                const float a = pw[i + 1] * scale;
                bf16* dst = o + ((size_t)(s + i) * H + h) * LTC_D + cb + 2 * qd;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const float x0 = oi[nt][2 * hf] + a * oq[nt][2 * hf];
                    const float x1 = oi[nt][2 * hf + 1] + a * oq[nt][2 * hf + 1];
                    *reinterpret_cast<unsigned*>(dst + 8 * nt) = ltc_pack(x0, x1);
                }
            }
        }

        ltc_state_update<4>(sacc, vf, Kb, pw, L);
        store_s(sb ^ 1);
    }
    ltc_cp_wait_all();  // only empty groups can be pending here
    ltc_state_io<false>(S, sacc, cb);
}

extern "C" __global__ void __launch_bounds__(128)
    lt_chunk_tc_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                     const float* __restrict__ log_decay, float scale, float* __restrict__ state,
                     bf16* __restrict__ o, int t, int H) {
    ltc_chunk_impl<false>(q, k, v, nullptr, log_decay, scale, state, o, t, H);
}

// The split form, second launch: the chunk loop with the score fragments of
// lt_scores_tc_bf16 (pf); o must not be null. Dynamic shared memory LTC_SMEM + 16 KiB.
extern "C" __global__ void __launch_bounds__(128)
    lt_chunk_pre_tc_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                         const uint4* __restrict__ pf, const float* __restrict__ log_decay, float scale,
                         float* __restrict__ state, bf16* __restrict__ o, int t, int H) {
    ltc_chunk_impl<true>(q, k, v, pf, log_decay, scale, state, o, t, H);
}

// The split form, first launch: every chunk's score fragments at once, one block per
// (chunk, head) (grid (n_chunks, H), 128 threads, dynamic shared memory LTC_SCORES_SMEM):
// pf[h][n][4w + ks][lane] = the A fragment pa[ks] of warp w (ks ≤ w; the others are not
// written), as ltc_scores computes it in the fused kernel.
extern "C" __global__ void __launch_bounds__(128)
    lt_scores_tc_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const float* __restrict__ log_decay,
                      float scale, uint4* __restrict__ pf, int t, int H) {
    extern __shared__ __align__(16) unsigned char ltc_sm[];
    bf16* Qb = reinterpret_cast<bf16*>(ltc_sm);  // [LTC_C][LTC_LDQ]
    bf16* Kb = Qb + LTC_QK_ELEMS;                // [LTC_C][LTC_LDQ]
    float* pw = reinterpret_cast<float*>(Kb + LTC_QK_ELEMS);
    const int n = blockIdx.x, h = blockIdx.y, nch = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int s = n * LTC_C, L = min(LTC_C, t - s);
    const double gl = (double)log_decay[h];
    for (int e = tid; e <= LTC_C; e += 128) pw[e] = (float)exp(gl * (double)e);
    for (int e = tid; e < LTC_C * 16; e += 128) {
        const int i = e >> 4, p = e & 15;
        const bool ok = i < L;
        const size_t src = ((size_t)(ok ? s + i : s) * H + h) * LTC_D + p * 8;
        ltc_cp16(ltc_smem(Kb + i * LTC_LDQ + p * 8), k + src, ok);
        ltc_cp16(ltc_smem(Qb + i * LTC_LDQ + p * 8), q + src, ok);
    }
    ltc_cp_commit();
    ltc_cp_wait_all();
    __syncthreads();
    unsigned qf[8][4], pa[4][4];
    ltc_q_frags(Qb, qf);
    ltc_scores(qf, Kb, pw, scale, pa);
    uint4* dst = pf + ((size_t)h * nch + n) * 512;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        if (ks > w) break;
        dst[(4 * w + ks) * 32 + lane] = make_uint4(pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3]);
    }
}

// ---------------------------------------------------------------------------------------
// Two-pass form, first launch: the state recurrence alone. Grid (H, 128 / LTC_BV), 128
// threads, dynamic shared memory LTC_STATES_SMEM. Warp w owns state rows 32w..32w+31 of the
// block's 16 value columns (as the chunk loop above). hs: [H][⌈t/LTC_CB⌉][128][128] bf16,
// hs[h][b] = the state before token LTC_CB·b (hs[h][0] the initial state), or null (only the
// final state). state [H][128][128] fp32 advanced in place. Needs 16-byte aligned k, v.
extern "C" __global__ void __launch_bounds__(128)
    lt_states_tc_bf16(const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ log_decay,
                      float* __restrict__ state, bf16* __restrict__ hs, int t, int H) {
    extern __shared__ __align__(16) unsigned char ltc_sm[];
    bf16* Ks = reinterpret_cast<bf16*>(ltc_sm);   // [LTC_SST][LTC_CB][LTC_LDQ]
    bf16* Vs = Ks + LTC_SST * LTC_CB * LTC_LDQ;   // [LTC_SST][LTC_CB][LTC_LDV]
    float* pw = reinterpret_cast<float*>(Vs + LTC_SST * LTC_CB * LTC_LDV);
    const int h = blockIdx.x, cb = blockIdx.y * LTC_BV;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, qd = lane & 3, lm = lane >> 3, lr = lane & 7;
    const double gl = (double)log_decay[h];
    for (int n = tid; n <= LTC_CB; n += 128) pw[n] = (float)exp(gl * (double)n);

    // Step tiles at token s into stage b; rows past the end are zero.
    auto load = [&](int s, int b) {
        const int L = min(LTC_CB, t - s);
        for (int e = tid; e < LTC_CB * 16; e += 128) {
            const int i = e >> 4, p = e & 15;
            const bool ok = i < L;
            const size_t src = ((size_t)(ok ? s + i : s) * H + h) * LTC_D + p * 8;
            ltc_cp16(ltc_smem(Ks + (b * LTC_CB + i) * LTC_LDQ + p * 8), k + src, ok);
        }
        for (int e = tid; e < LTC_CB * 2; e += 128) {
            const int i = e >> 1, p = e & 1;
            const bool ok = i < L;
            const size_t src = ((size_t)(ok ? s + i : s) * H + h) * LTC_D + cb + p * 8;
            ltc_cp16(ltc_smem(Vs + (b * LTC_CB + i) * LTC_LDV + p * 8), v + src, ok);
        }
        ltc_cp_commit();
    };

    float sacc[2][2][4];
    float* S = state + (size_t)h * LTC_D * LTC_D;
    ltc_state_io<true>(S, sacc, cb);
    const int nst = (t + LTC_CB - 1) / LTC_CB;
    if (nst == 0) return;
    // One commit group per step (empty past the end), as the chunk loop above.
#pragma unroll
    for (int i = 0; i < LTC_SST - 1; ++i) {
        if (i < nst) load(i * LTC_CB, i);
        else ltc_cp_commit();
    }
    for (int n = 0; n < nst; ++n) {
        const int s = n * LTC_CB, L = min(LTC_CB, t - s), b = n % LTC_SST;
        if (hs) {
            // The bf16 state before this step, for lt_out_tc_bf16.
            bf16* d = hs + (((size_t)h * nst + n) * LTC_D) * LTC_D + cb;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int r = 32 * w + 16 * mt + g, c = 8 * nt + 2 * qd;
                    *reinterpret_cast<unsigned*>(d + (size_t)r * LTC_D + c) =
                        ltc_pack(sacc[mt][nt][0], sacc[mt][nt][1]);
                    *reinterpret_cast<unsigned*>(d + (size_t)(r + 8) * LTC_D + c) =
                        ltc_pack(sacc[mt][nt][2], sacc[mt][nt][3]);
                }
        }
        ltc_cp_wait<LTC_SST - 2>();
        // Step n's tiles (and, n = 0, pw) are visible; every warp is done with step n − 1,
        // so its stage may be refilled (with step n + LTC_SST − 1).
        __syncthreads();
        if (n + LTC_SST - 1 < nst) load(s + (LTC_SST - 1) * LTC_CB, (n + LTC_SST - 1) % LTC_SST);
        else ltc_cp_commit();
        const bf16* Kb = Ks + b * LTC_CB * LTC_LDQ;
        const bf16* Vb = Vs + b * LTC_CB * LTC_LDV;
        // S ← γ^L S + Kᵀ Ṽ, Ṽ_j = γ^{L−1−j} v_j (0 past the step's end), over 8 key steps of 16.
        unsigned vf[8][4];
#pragma unroll
        for (int ks = 0; ks < 8; ++ks)
            ltc_ldsm_t(vf[ks], ltc_smem(Vb + (16 * ks + 8 * (lm & 1) + lr) * LTC_LDV + 8 * (lm >> 1)));
        ltc_state_update<8>(sacc, vf, Kb, pw, L);
    }
    ltc_cp_wait_all();  // only empty groups can be pending here
    ltc_state_io<false>(S, sacc, cb);
}

// Two-pass form, second launch: the outputs of every 128-token block at once. Grid
// (⌈t/LTC_CB⌉, H), 256 threads, dynamic shared memory LTC_OUT_SMEM. Warp w owns the block's
// rows 16w..16w+15 and all 128 value columns: acc = γ^{i+1}·scale · Q S_b (S_b = hs[h][b] of
// lt_states_tc_bf16), then acc += P V over the key tiles 0..w (P as in ltc_scores, over up
// to 127 positions back). The tiles land in three cp.async groups (Q and S, K, V) so the
// products start while the later ones load. Needs 16-byte aligned q, k, v, hs.
extern "C" __global__ void __launch_bounds__(256, 1)
    lt_out_tc_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                   const bf16* __restrict__ hs, const float* __restrict__ log_decay, float scale,
                   bf16* __restrict__ o, int t, int H) {
    extern __shared__ __align__(16) unsigned char ltc_sm[];
    bf16* Qs = reinterpret_cast<bf16*>(ltc_sm);  // [LTC_CB][LTC_LDQ] each
    bf16* Ss = Qs + LTC_CB * LTC_LDQ;
    bf16* Ks = Ss + LTC_CB * LTC_LDQ;
    bf16* Vs = Ks + LTC_CB * LTC_LDQ;
    float* pw = reinterpret_cast<float*>(Vs + LTC_CB * LTC_LDQ);
    const int b = blockIdx.x, h = blockIdx.y, nb = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, qd = lane & 3, lm = lane >> 3, lr = lane & 7;
    const int s = b * LTC_CB, L = min(LTC_CB, t - s);
    const double gl = (double)log_decay[h];
    for (int n = tid; n <= LTC_CB; n += 256) pw[n] = (float)exp(gl * (double)n);

    // Token rows of x into tile X (zero past the end); one commit group per call.
    auto load_rows = [&](const bf16* x, bf16* X) {
        for (int e = tid; e < LTC_CB * 16; e += 256) {
            const int i = e >> 4, p = e & 15;
            const bool ok = i < L;
            const size_t src = ((size_t)(ok ? s + i : s) * H + h) * LTC_D + p * 8;
            ltc_cp16(ltc_smem(X + i * LTC_LDQ + p * 8), x + src, ok);
        }
    };
    load_rows(q, Qs);
    {
        const bf16* src = hs + (((size_t)h * nb + b) * LTC_D) * LTC_D;
        for (int e = tid; e < LTC_D * 16; e += 256) {
            const int r = e >> 4, p = e & 15;
            ltc_cp16(ltc_smem(Ss + r * LTC_LDQ + p * 8), src + (size_t)r * LTC_D + p * 8, true);
        }
    }
    ltc_cp_commit();
    load_rows(k, Ks);
    ltc_cp_commit();
    load_rows(v, Vs);
    ltc_cp_commit();

    ltc_cp_wait<2>();  // Q and S
    __syncthreads();
    unsigned qf[8][4];
    ltc_q_frags(Qs, qf);
    // acc[nt]: rows 16w + g (+8), value columns 8nt + 2qd (+1).
    float acc[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
#pragma unroll
        for (int np = 0; np < 8; ++np) {
            unsigned sf[4];
            ltc_ldsm_t(sf, ltc_smem(Ss + (16 * ks + 8 * (lm & 1) + lr) * LTC_LDQ + 16 * np + 8 * (lm >> 1)));
            ltc_mma(acc[2 * np], qf[ks], sf[0], sf[1]);
            ltc_mma(acc[2 * np + 1], qf[ks], sf[2], sf[3]);
        }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const float a = pw[16 * w + g + 8 * hf + 1] * scale;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
            acc[nt][2 * hf] *= a;
            acc[nt][2 * hf + 1] *= a;
        }
    }

    ltc_cp_wait<1>();  // K
    __syncthreads();
    // P over key tiles kt ≤ w (16 keys each): the A fragments pa[kt], masked and decayed.
    unsigned pa[8][4];
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
        if (kt > w) break;  // warp-uniform
        float p[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            unsigned kf[4];
            ltc_ldsm(kf, ltc_smem(Ks + (16 * kt + 8 * (lm >> 1) + lr) * LTC_LDQ + 16 * ks + 8 * (lm & 1)));
            ltc_mma(p[0], qf[ks], kf[0], kf[1]);
            ltc_mma(p[1], qf[ks], kf[2], kf[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = 16 * w + g + (e >> 1) * 8, j = 16 * kt + 8 * nt + 2 * qd + (e & 1);
                p[nt][e] = j <= i ? p[nt][e] * (pw[i - j] * scale) : 0.f;
            }
        pa[kt][0] = ltc_pack(p[0][0], p[0][1]);
        pa[kt][1] = ltc_pack(p[0][2], p[0][3]);
        pa[kt][2] = ltc_pack(p[1][0], p[1][1]);
        pa[kt][3] = ltc_pack(p[1][2], p[1][3]);
    }

    ltc_cp_wait<0>();  // V
    __syncthreads();
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
        if (kt > w) break;
#pragma unroll
        for (int np = 0; np < 8; ++np) {
            unsigned vf[4];
            ltc_ldsm_t(vf, ltc_smem(Vs + (16 * kt + 8 * (lm & 1) + lr) * LTC_LDQ + 16 * np + 8 * (lm >> 1)));
            ltc_mma(acc[2 * np], pa[kt], vf[0], vf[1]);
            ltc_mma(acc[2 * np + 1], pa[kt], vf[2], vf[3]);
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int i = 16 * w + g + 8 * hf;
        if (i >= L) continue;
        bf16* dst = o + ((size_t)(s + i) * H + h) * LTC_D + 2 * qd;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt)
            *reinterpret_cast<unsigned*>(dst + 8 * nt) = ltc_pack(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
    }
}
