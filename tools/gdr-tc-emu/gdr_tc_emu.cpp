// Host-emulated run of the bf16 tensor-core GDR kernels (dataplane/kernels/gdr_tc.cu)
// against an fp64 token recurrence, for checking fragment layouts, indexing and the
// chunk algebra without a GPU (it does not model timing, cp.async asynchrony or memory
// races). Build and run: tools/gdr-tc-emu/run.sh [T [g_lo g_hi]].
// Prints the relative L2 errors of output, final state and T_C.
#include "emu.h"
#include <cstdio>
#include <random>
#include <cstdlib>
uint4 tc_sm[16384];  // dynamic shared memory (blocks run one at a time)
#include "gdr_tc.cu"

struct Case { int t, hk, hv; float glo, ghi; bool trans; };

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
    emu_launch(hv, nt, 256, [&] { gdr_prep_tc2_bf16(kb.data(), vb.data(), g.data(), beta.data(), gcum.data(), Wf.data(), Ktf.data(), Uf.data(), T, hk, hv); });
    const int ny = (128 + (cs.trans ? 128 : 0)) / 32;
    emu_launch(hv, ny, 64, [&] { gdr_state_tc_bf16_32(Wf.data(), Ktf.data(), Uf.data(), gcum.data(), st.data(), cs.trans ? tr.data() : nullptr, Hsf.data(), T); });
    emu_launch(hv, nt, 256, [&] { gdr_output_tc2_bf16(qb.data(), kb.data(), gcum.data(), Uf.data(), Hsf.data(), ob.data(), T, hk, hv); });
    std::vector<float> of(ob.size());
    for (size_t i = 0; i < ob.size(); ++i) of[i] = emu_bf2f(ob[i].b);
    const double eo = rel(O, of), es = rel(S, st);
    double et = 0; double tn = 0;
    if (cs.trans) { et = rel(TC, tr); for (double x : TC) tn += x * x; tn = std::sqrt(tn); }
    printf("T=%d Hk=%d Hv=%d g in [%g,%g] trans=%d: out %.2e state %.2e T_C %.2e (|T_C| %.2e)\n", T, hk, hv, cs.glo, cs.ghi, cs.trans, eo, es, et, tn);
    return (eo < 1e-2 && es < 1e-2 && et < 2e-2) ? 0 : 1;
}

int main(int argc, char** argv) {
    std::vector<Case> cases = {
        {1, 2, 4, -2.f, 0.f, true}, {63, 2, 4, -0.1f, 0.f, false}, {64, 2, 4, -0.1f, 0.f, true},
        {65, 2, 4, -1e-3f, 0.f, true}, {200, 2, 4, -20.f, -5.f, true}, {200, 1, 2, -0.05f, 0.f, true},
    };
    if (argc > 3) cases = {{atoi(argv[1]), 1, 2, (float)atof(argv[2]), (float)atof(argv[3]), true}};
    else if (argc > 1) cases = {{atoi(argv[1]), 2, 4, -0.05f, 0.f, true}};
    int bad = 0;
    for (size_t i = 0; i < cases.size(); ++i) bad += run(cases[i], 100 + i);
    printf("%d failing\n", bad);
    return bad;
}
