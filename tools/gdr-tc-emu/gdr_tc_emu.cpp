// Host-emulated run of the bf16 tensor-core GDR kernels (dataplane/kernels/gdr_tc.cu)
// against an fp64 token recurrence, for checking fragment layouts, indexing and the
// chunk algebra without a GPU (it does not model timing, cp.async asynchrony or memory
// races). Build and run: tools/gdr-tc-emu/run.sh [T g_lo g_hi [BV]].
// Prints the relative L2 errors of output, final state and T_C.
#include "emu.h"
#include <cstdio>
#include <random>
#include <cstdlib>
uint4 tc_sm[16384];  // dynamic shared memory (blocks run one at a time)
#include "gdr_tc.cu"

struct Case { int t, hk, hv; float glo, ghi; bool trans; int bv; };

static double rel(const std::vector<double>& ref, const std::vector<float>& x) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) { double d = x[i] - ref[i]; num += d * d; den += ref[i] * ref[i]; if (std::isnan(x[i])) return NAN; }
    return std::sqrt(num / std::max(den, 1e-300));
}

int run(const Case& cs, unsigned seed) {
    const int T = cs.t, hk = cs.hk, hv = cs.hv, D = 128, nt = (T + 63) / 64;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u01(0.f, 1.f), um(-1.f, 1.f);
    auto unit = [&](std::vector<float>& x, int rows, float scale) {
        x.resize((size_t)rows * D);
        for (int r = 0; r < rows; ++r) { double n = 0; for (int c = 0; c < D; ++c) { x[r * D + c] = um(rng); n += x[r*D+c]*x[r*D+c]; }
            for (int c = 0; c < D; ++c) x[r * D + c] = emu_bf2f(emu_f2bf(x[r * D + c] * scale / std::sqrt(n))); }
    };
    std::vector<float> q, k, v((size_t)T * hv * D), g((size_t)T * hv), beta((size_t)T * hv), s0((size_t)hv * D * D);
    unit(q, T * hk, 1.f / std::sqrt(128.f)); unit(k, T * hk, 1.f);
    for (auto& x : v) x = emu_bf2f(emu_f2bf(um(rng)));
    for (auto& x : g) x = cs.glo + (cs.ghi - cs.glo) * u01(rng);
    for (auto& x : beta) x = 0.01f + 0.99f * u01(rng);
    for (auto& x : s0) x = um(rng);
    auto tob = [](const std::vector<float>& x) { std::vector<bf16> y(x.size()); for (size_t i = 0; i < x.size(); ++i) y[i] = bf16{emu_f2bf(x[i])}; return y; };
    std::vector<bf16> qb = tob(q), kb = tob(k), vb = tob(v), ob((size_t)T * hv * D, bf16{0x7fc0});
    // Reference (fp64 recurrence), and T_C from the identity with zero writes.
    std::vector<double> S(s0.begin(), s0.end()), O((size_t)T * hv * D), TC((size_t)hv * D * D, 0.0);
    for (int h = 0; h < hv; ++h) for (int i = 0; i < D; ++i) TC[(size_t)h * D * D + i * D + i] = 1.0;
    std::vector<double> kv(D);
    for (int h = 0; h < hv; ++h) {
        const int kh = h / (hv / hk);
        double* s = &S[(size_t)h * D * D]; double* tc = &TC[(size_t)h * D * D];
        for (int t = 0; t < T; ++t) {
            const float* kt = &k[((size_t)t * hk + kh) * D]; const float* qt = &q[((size_t)t * hk + kh) * D];
            const double e = std::exp((double)g[(size_t)t * hv + h]), b = beta[(size_t)t * hv + h];
            for (int j = 0; j < D * D; ++j) { s[j] *= e; tc[j] *= e; }
            std::fill(kv.begin(), kv.end(), 0.0);
            for (int i = 0; i < D; ++i) for (int j = 0; j < D; ++j) kv[j] += s[i * D + j] * kt[i];
            for (int j = 0; j < D; ++j) kv[j] = b * (v[((size_t)t * hv + h) * D + j] - kv[j]);
            for (int i = 0; i < D; ++i) for (int j = 0; j < D; ++j) s[i * D + j] += kt[i] * kv[j];
            std::fill(kv.begin(), kv.end(), 0.0);
            for (int i = 0; i < D; ++i) for (int j = 0; j < D; ++j) kv[j] += tc[i * D + j] * kt[i];
            for (int i = 0; i < D; ++i) for (int j = 0; j < D; ++j) tc[i * D + j] -= b * kt[i] * kv[j];
            for (int j = 0; j < D; ++j) { double o = 0; for (int i = 0; i < D; ++i) o += s[i * D + j] * qt[i]; O[((size_t)t * hv + h) * D + j] = o; }
        }
    }
    // Kernels.
    std::vector<float> gcum((size_t)hv * nt * 64, NAN);
    std::vector<uint4> Wf((size_t)hv * nt * 1024), Ktf(Wf.size()), Uf(Wf.size()), Hsf(2 * Wf.size());
    std::memset(Wf.data(), 0xff, Wf.size() * 16); std::memset(Ktf.data(), 0xff, Ktf.size() * 16);
    std::memset(Uf.data(), 0xff, Uf.size() * 16); std::memset(Hsf.data(), 0xff, Hsf.size() * 16);
    std::vector<float> st = s0, tr((size_t)hv * D * D, 0.f);
    for (int h = 0; h < hv; ++h) for (int i = 0; i < D; ++i) tr[(size_t)h * D * D + i * D + i] = 1.f;
    // EMU_PREP=1: gdr_prep_tc_bf16; otherwise gdr_prep_tc2_bf16 (the default kernel).
    static const bool prep1 = getenv("EMU_PREP") && atoi(getenv("EMU_PREP")) == 1;
    if (prep1) emu_launch(nt, hv, 256, [&] { gdr_prep_tc_bf16(kb.data(), vb.data(), g.data(), beta.data(), gcum.data(), Wf.data(), Ktf.data(), Uf.data(), T, hk, hv); });
    else emu_launch(hv, nt, 256, [&] { gdr_prep_tc2_bf16(kb.data(), vb.data(), g.data(), beta.data(), gcum.data(), Wf.data(), Ktf.data(), Uf.data(), T, hk, hv); });
    if (!prep1) {
        // Both prep kernels on the same inputs: relative L2 distance of their W, K̃ᵀ, Uᵀ
        // (bf16 rounding of M diag(·) and of the products; gcum must match exactly).
        std::vector<float> gc1(gcum.size());
        std::vector<uint4> W1(Wf.size()), K1(Wf.size()), U1(Wf.size());
        emu_launch(nt, hv, 256, [&] { gdr_prep_tc_bf16(kb.data(), vb.data(), g.data(), beta.data(), gc1.data(), W1.data(), K1.data(), U1.data(), T, hk, hv); });
        auto dist = [](const std::vector<uint4>& a, const std::vector<uint4>& b) {
            double num = 0, den = 0;
            const uint16_t* x = (const uint16_t*)a.data(); const uint16_t* y = (const uint16_t*)b.data();
            for (size_t i = 0; i < a.size() * 8; ++i) { double d = (double)emu_bf2f(x[i]) - emu_bf2f(y[i]); num += d * d; den += (double)emu_bf2f(y[i]) * emu_bf2f(y[i]); }
            return std::sqrt(num / std::max(den, 1e-300));
        };
        printf("  prep2 vs prep1: W %.2e K~ %.2e U %.2e gcum %s\n", dist(Wf, W1), dist(Ktf, K1), dist(Uf, U1),
               std::memcmp(gc1.data(), gcum.data(), gcum.size() * 4) ? "DIFFERS" : "same");
    }
    const int ny = (128 + (cs.trans ? 128 : 0)) / cs.bv;
    // EMU_SPLIT=1: the BV 32 cases run gdr_state_tc_bf16_32s (4 warps, c split in halves).
    static const bool split = getenv("EMU_SPLIT") && atoi(getenv("EMU_SPLIT")) == 1;
    if (split && cs.bv == 32)
        emu_launch(hv, ny, 128, [&] { gdr_state_tc_bf16_32s(Wf.data(), Ktf.data(), Uf.data(), gcum.data(), st.data(), cs.trans ? tr.data() : nullptr, Hsf.data(), T); });
    else emu_launch(hv, ny, cs.bv * 2, [&] {
        if (cs.bv == 32) gdr_state_tc_bf16_32(Wf.data(), Ktf.data(), Uf.data(), gcum.data(), st.data(), cs.trans ? tr.data() : nullptr, Hsf.data(), T);
        else gdr_state_tc_bf16_64(Wf.data(), Ktf.data(), Uf.data(), gcum.data(), st.data(), cs.trans ? tr.data() : nullptr, Hsf.data(), T);
    });
    // EMU_OUT=1: gdr_output_tc_bf16 only; otherwise gdr_output_tc2_bf16 (the default),
    // and its distance to gdr_output_tc_bf16 on the same inputs.
    static const bool out1 = getenv("EMU_OUT") && atoi(getenv("EMU_OUT")) == 1;
    std::vector<bf16> ob1(ob.size(), bf16{0x7fc0});
    emu_launch(nt, hv, 256, [&] { gdr_output_tc_bf16(qb.data(), kb.data(), gcum.data(), Uf.data(), Hsf.data(), ob1.data(), T, hk, hv); });
    if (out1) ob = ob1;
    else emu_launch(hv, nt, 256, [&] { gdr_output_tc2_bf16(qb.data(), kb.data(), gcum.data(), Uf.data(), Hsf.data(), ob.data(), T, hk, hv); });
    std::vector<float> of(ob.size()), of1(ob.size());
    for (size_t i = 0; i < ob.size(); ++i) of[i] = emu_bf2f(ob[i].b), of1[i] = emu_bf2f(ob1[i].b);
    if (!out1) {
        std::vector<double> r1(of1.begin(), of1.end());
        printf("  output2 vs output1: %.2e\n", rel(r1, of));
    }
    const double eo = rel(O, of), es = rel(S, st);
    double et = 0; double tn = 0;
    if (cs.trans) { et = rel(TC, tr); for (double x : TC) tn += x * x; tn = std::sqrt(tn); }
    printf("prep%d out%d%s T=%d Hk=%d Hv=%d g in [%g,%g] trans=%d BV=%d: out %.2e state %.2e T_C %.2e (|T_C| %.2e)\n", prep1 ? 1 : 2, out1 ? 1 : 2, split && cs.bv == 32 ? " split" : "", T, hk, hv, cs.glo, cs.ghi, cs.trans, cs.bv, eo, es, et, tn);
    return (eo < 1e-2 && es < 1e-2 && et < 2e-2) ? 0 : 1;
}

int main(int argc, char** argv) {
    std::vector<Case> cases = {
        {1, 2, 4, -2.f, 0.f, true, 32}, {63, 2, 4, -0.1f, 0.f, false, 64}, {64, 2, 4, -0.1f, 0.f, true, 32},
        {65, 2, 4, -1e-3f, 0.f, true, 64}, {200, 2, 4, -20.f, -5.f, true, 32}, {200, 1, 2, -0.05f, 0.f, true, 64},
    };
    if (argc > 3) cases = {{atoi(argv[1]), 1, 2, (float)atof(argv[2]), (float)atof(argv[3]), true, argc > 4 ? atoi(argv[4]) : 32}};
    else if (argc > 1) cases = {{atoi(argv[1]), 2, 4, -0.05f, 0.f, true, 32}};
    int bad = 0;
    for (size_t i = 0; i < cases.size(); ++i) bad += run(cases[i], 100 + i);
    printf("%d failing\n", bad);
    return bad;
}
