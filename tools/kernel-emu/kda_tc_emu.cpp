// Runs the tensor-core KDA prefill kernels of dataplane/kernels/kda_tc.cu — the real
// source, see run.sh `kda-tc` — in the host emulator of emu.h (one fiber per CUDA thread,
// mma.sync / ldmatrix / cp.async per the PTX fragment definitions), against a
// double-precision token recurrence (S ← diag(e^g) S; u = β (v − Sᵀk); S += k uᵀ;
// o = Sᵀq) on the same bf16-rounded inputs, from a random initial state. Prints the
// relative L2 errors of the output and of the final state per case (and, for
// information, the max-relative errors) and fails above the bounds below. Small head counts only (1–2 value heads, dk = dv = 128).
// EMU_QUICK=1: the cases up to T = 128 only.
#define HYPIC_HOST_EMU
#include "emu.h"

struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    return float2{__bfloat162float(v.x), __bfloat162float(v.y)};
}
// __syncwarp: a rendezvous of the warp's 32 fibers.
inline void __syncwarp() { emu_arrive(emu.warps[threadIdx.x / 32].bar); }

// The kernel's primitives (its `#ifndef HYPIC_HOST_EMU` block) on emu.h.
inline void kt_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const unsigned b[2] = {b0, b1};
    fa_mma(c, a, b);
}
inline void kt_ldsm_x4_trans(unsigned* f, const void* p) { fa_ldsm_x4_t(f, fa_smem_u32(p)); }
inline void kt_ldsm_x4(unsigned* f, const void* p) { fa_ldsm_x4(f, fa_smem_u32(p)); }
inline void kt_prefetch_l2(const void*) {}
inline void kt_cp16(void* smem, const void* gmem) { fa_cp_async16(fa_smem_u32(smem), gmem, true); }
// Exact wait_group semantics (emu.h).
inline void kt_cp_commit() { emu_cp_commit_group(); }
template <int N>
inline void kt_cp_wait() {
    emu_cp_wait_group(N);
}
#define kt_sm (reinterpret_cast<uint4*>(emu_dyn_smem))

#include "gen_kda_tc.inc"

#include <random>
#include <string>

static int g_fail = 0;

enum Decay { MILD, MIXED, STRONG, WIDE };
static const char* decay_name(Decay d) {
    return d == MILD ? "g in [-0.1,0]" : d == MIXED ? "mixed (10% -5)" : d == STRONG ? "g = -5..-4" : "g in [-8,0]";
}

struct Case {
    int t, hk, hv;
    Decay decay;
};

static double rel(const std::vector<double>& ref, const std::vector<float>& x) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (std::isnan(x[i]) || std::isinf(x[i])) return NAN;
        const double d = x[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}

// max|x − ref| / max(1, max|ref|) (the metric of dataplane/tests/cuda_kimi.rs).
static double max_rel(const std::vector<double>& ref, const std::vector<float>& x) {
    double m = 1, d = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (std::isnan(x[i])) return NAN;
        m = std::max(m, std::fabs(ref[i]));
        d = std::max(d, std::fabs(x[i] - ref[i]));
    }
    return d / m;
}

static float bfr(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

static void run(const Case& cs, unsigned seed, double tol_out, double tol_state) {
    const int T = cs.t, hk = cs.hk, hv = cs.hv, D = 128, nt = (T + 63) / 64;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u01(0.f, 1.f), um(-1.f, 1.f);
    // Unit-norm rows (times scale), rounded to bf16.
    auto unit = [&](std::vector<float>& x, size_t rows, float scale) {
        x.resize(rows * D);
        for (size_t r = 0; r < rows; ++r) {
            double n = 0;
            for (int c = 0; c < D; ++c) {
                x[r * D + c] = um(rng);
                n += (double)x[r * D + c] * x[r * D + c];
            }
            for (int c = 0; c < D; ++c) x[r * D + c] = bfr((float)(x[r * D + c] * scale / std::sqrt(n)));
        }
    };
    std::vector<float> q, k, v((size_t)T * hv * D), g((size_t)T * hv * D), beta((size_t)T * hv), s0((size_t)hv * D * D);
    unit(q, (size_t)T * hk, 1.f / std::sqrt(128.f));
    unit(k, (size_t)T * hk, 1.f);
    for (auto& x : v) x = bfr(um(rng));
    for (auto& x : g) {
        switch (cs.decay) {
        case MILD: x = -0.1f * u01(rng); break;
        case MIXED: x = u01(rng) < 0.1f ? -5.f : -0.1f * u01(rng); break;
        case STRONG: x = -4.f - u01(rng); break;
        case WIDE: x = -8.f * u01(rng); break;
        }
    }
    for (auto& x : beta) x = 0.01f + 0.98f * u01(rng);
    for (auto& x : s0) x = um(rng);
    std::vector<bf16> qb(q.size()), kb(k.size()), vb(v.size()), ob((size_t)T * hv * D, bf16{0x7fc0});
    for (size_t i = 0; i < q.size(); ++i) qb[i] = __float2bfloat16_rn(q[i]);
    for (size_t i = 0; i < k.size(); ++i) kb[i] = __float2bfloat16_rn(k[i]);
    for (size_t i = 0; i < v.size(); ++i) vb[i] = __float2bfloat16_rn(v[i]);
    // Reference: the fp64 recurrence.
    std::vector<double> S(s0.begin(), s0.end()), O((size_t)T * hv * D), kv(D);
    for (int h = 0; h < hv; ++h) {
        const int kh = h / (hv / hk);
        double* s = &S[(size_t)h * D * D];
        for (int t = 0; t < T; ++t) {
            const float* kt = &k[((size_t)t * hk + kh) * D];
            const float* qt = &q[((size_t)t * hk + kh) * D];
            const float* gt = &g[((size_t)t * hv + h) * D];
            const double b = beta[(size_t)t * hv + h];
            for (int a = 0; a < D; ++a) {
                const double e = std::exp((double)gt[a]);
                for (int c = 0; c < D; ++c) s[a * D + c] *= e;
            }
            std::fill(kv.begin(), kv.end(), 0.0);
            for (int a = 0; a < D; ++a)
                for (int c = 0; c < D; ++c) kv[c] += s[a * D + c] * kt[a];
            for (int c = 0; c < D; ++c) kv[c] = b * (v[((size_t)t * hv + h) * D + c] - kv[c]);
            for (int a = 0; a < D; ++a)
                for (int c = 0; c < D; ++c) s[a * D + c] += kt[a] * kv[c];
            for (int c = 0; c < D; ++c) {
                double o = 0;
                for (int a = 0; a < D; ++a) o += s[a * D + c] * qt[a];
                O[((size_t)t * hv + h) * D + c] = o;
            }
        }
    }
    // Kernels (scratch poisoned: a fragment never written reads as bf16 NaN).
    const size_t tiles = (size_t)hv * nt;
    std::vector<uint4> Wf(tiles * 1024), Ktf(tiles * 1024), Uf(tiles * 1024), Hsf(tiles * 2048);
    std::vector<float> dl(tiles * D, NAN), st = s0;
    for (auto* b : {&Wf, &Ktf, &Uf, &Hsf}) std::memset(b->data(), 0xff, b->size() * sizeof(uint4));
    emu_launch(emu_dim3{(unsigned)hv, (unsigned)nt, 1}, 256, KT_PREP_SMEM, [&] {
        kda_prep_tc_bf16(kb.data(), vb.data(), g.data(), beta.data(), Wf.data(), Ktf.data(), Uf.data(), dl.data(), T,
                         hk, hv);
    });
    emu_launch(emu_dim3{(unsigned)hv, 128 / (16 * KT_NW), 1}, 32 * KT_NW, KT_STATE_SMEM, [&] {
        kda_state_tc_bf16(Wf.data(), Ktf.data(), Uf.data(), dl.data(), st.data(), Hsf.data(), T);
    });
    emu_launch(emu_dim3{(unsigned)hv, (unsigned)nt, 1}, 256, KT_OUT_SMEM, [&] {
        kda_output_tc_bf16(qb.data(), kb.data(), g.data(), Uf.data(), Hsf.data(), ob.data(), T, hk, hv);
    });
    std::vector<float> of(ob.size());
    for (size_t i = 0; i < ob.size(); ++i) of[i] = __bfloat162float(ob[i]);
    const double eo = rel(O, of), es = rel(S, st);
    const bool ok = eo <= tol_out && es <= tol_state;
    std::printf("  %s T=%-4d Hk=%d Hv=%d %-15s: out %.2e state %.2e (max-rel out %.2e state %.2e)\n",
                ok ? "ok  " : "FAIL", T, hk, hv, decay_name(cs.decay), eo, es, max_rel(O, of), max_rel(S, st));
    std::fflush(stdout);
    if (!ok) ++g_fail;
}

int main() {
    // EMU_EAGER_CP=1: cp.async copies land when issued (with EMU_SCHED=rev|rand, emu.h,
    // a buffer refilled while another warp still reads it shows up).
    emu.eager_cp = std::getenv("EMU_EAGER_CP") && std::atoi(std::getenv("EMU_EAGER_CP"));
    const bool quick = std::getenv("EMU_QUICK") != nullptr;
    std::vector<Case> cases;
    for (int t : {1, 15, 16, 17, 63, 64, 65, 128, 200, 300}) cases.push_back({t, 2, 2, MILD});
    for (int t : {17, 65, 128, 300}) cases.push_back({t, 1, 2, MIXED});
    for (int t : {16, 64, 65, 200}) cases.push_back({t, 2, 2, STRONG});
    for (int t : {65, 300}) cases.push_back({t, 1, 2, WIDE});
    cases.push_back({1000, 1, 2, MIXED});
    // Bounds: twice the bf16 noise the kernels show here (the output is rounded to bf16;
    // W, U, K̃, Ũ, the state snapshots, P and Q ⊙ e^G are bf16 operands, see kda_tc.cu).
    const double tol_out = 6e-3, tol_state = 6e-3;
    std::printf("kda_tc.cu (prep, state, output) against the fp64 recurrence: relative L2 errors\n");
    unsigned seed = 1;
    for (const Case& c : cases) {
        if (quick && c.t > 128) continue;
        run(c, seed++, tol_out, tol_state);
    }
    std::printf("%s\n", g_fail ? "kda-tc: FAILED" : "kda-tc: all cases within bounds");
    return g_fail ? 1 : 0;
}
