// Runs the batched decode kernels of the Gated DeltaNet layers — gdr_recurrent_rows_* of
// dataplane/kernels/gdr.cu and conv1d_update_rows_* of conv.cu, the real sources (run.sh
// `gdn-rows`) — in the host emulator of emu.h, against the one-sequence kernels they
// batch (gdr_recurrent_* with one token, conv1d_update_*), run row by row on separate
// buffers: every output and every state must be equal bit for bit.
#include "emu.h"

#include "gen_gdn_rows.inc"

#include <cstring>
#include <random>
#include <string>

static int g_fail = 0;

static void check(bool ok, const std::string& what) {
    std::printf("  %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++g_fail;
}

template <typename T>
static std::vector<T> rnd(size_t n, unsigned seed, float lo, float hi) {
    std::mt19937 r(seed);
    std::uniform_real_distribution<float> U(lo, hi);
    std::vector<T> v(n);
    for (auto& x : v) x = from_f<T>(U(r));
    return v;
}

template <typename T>
static bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Launch over a 3-D grid (emu_launch covers x and y; z by repeated launches).
static void launch3(emu_dim3 g, unsigned threads, std::function<void()> k) {
    for (unsigned z = 0; z < std::max(1u, g.z); ++z)
        emu_launch(emu_dim3{g.x, g.y, 1}, threads, 0, [&, z] {
            blockIdx.z = z;
            gridDim.z = g.z;
            k();
        });
}

using RecFn = void (*)(const void*, const void*, const void*, const float*, const float*, float*, void*,
                       int, int, int, int);

template <typename T, int DK>
static void gdr_case(const char* name, int bsz, int hk, int hv, int dv,
                     void (*single)(const T*, const T*, const T*, const float*, const float*, float*, T*, int, int,
                                    int, int),
                     void (*rows)(const T*, const T*, const T*, const float*, const float*,
                                  const unsigned long long*, T*, int, int, int)) {
    const size_t qn = (size_t)hk * DK, vn = (size_t)hv * dv, sn = (size_t)hv * DK * dv;
    auto q = rnd<T>(bsz * qn, 1, -0.2f, 0.2f), k = rnd<T>(bsz * qn, 2, -0.2f, 0.2f);
    auto v = rnd<T>(bsz * vn, 3, -1.f, 1.f);
    auto g = rnd<float>(bsz * hv, 4, -0.5f, 0.f), beta = rnd<float>(bsz * hv, 5, 0.05f, 1.f);
    std::vector<std::vector<float>> s_one, s_rows;
    for (int b = 0; b < bsz; ++b) {
        s_one.push_back(rnd<float>(sn, 10 + b, -1.f, 1.f));
        s_rows.push_back(s_one.back());
    }
    std::vector<T> o_one(bsz * vn), o_rows(bsz * vn, from_f<T>(7.f));
    const emu_dim3 grid{(unsigned)hv, (unsigned)((dv + 31) / 32), 1};
    for (int b = 0; b < bsz; ++b)
        launch3(grid, 128, [&] {
            single(&q[b * qn], &k[b * qn], &v[b * vn], &g[b * hv], &beta[b * hv], s_one[b].data(), &o_one[b * vn],
                   1, hk, hv, dv);
        });
    std::vector<unsigned long long> table;
    for (auto& s : s_rows) table.push_back((unsigned long long)(uintptr_t)s.data());
    launch3(emu_dim3{grid.x, grid.y, (unsigned)bsz}, 128, [&] {
        rows(q.data(), k.data(), v.data(), g.data(), beta.data(), table.data(), o_rows.data(), hk, hv, dv);
    });
    bool states = true;
    for (int b = 0; b < bsz; ++b) states = states && same_bits(s_one[b], s_rows[b]);
    check(same_bits(o_one, o_rows), std::string(name) + ": outputs of " + std::to_string(bsz) +
                                        " rows = one-token kernel per row (bitwise)");
    check(states, std::string(name) + ": states = one-token kernel per row (bitwise)");
}

template <typename T>
static void conv_case(const char* name, int bsz, int c, int kk, int stride) {
    auto x = rnd<T>((size_t)bsz * stride, 21, -1.f, 1.f);
    auto w = rnd<float>((size_t)c * kk, 22, -0.5f, 0.5f);
    std::vector<std::vector<float>> t_one, t_rows;
    for (int b = 0; b < bsz; ++b) {
        t_one.push_back(rnd<float>((size_t)c * (kk - 1), 30 + b, -1.f, 1.f));
        t_rows.push_back(t_one.back());
    }
    std::vector<T> y_one((size_t)bsz * c), y_rows((size_t)bsz * c, from_f<T>(7.f));
    const emu_dim3 grid{(unsigned)((c + 255) / 256), 1, 1};
    for (int b = 0; b < bsz; ++b)
        emu_launch(grid, 256, 0, [&] {
            if constexpr (sizeof(T) == 4)
                conv1d_update_f32((const float*)&x[(size_t)b * stride], w.data(), t_one[b].data(),
                                  (float*)&y_one[(size_t)b * c], c, kk, 1);
            else
                conv1d_update_bf16((const bf16*)&x[(size_t)b * stride], w.data(), t_one[b].data(),
                                   (bf16*)&y_one[(size_t)b * c], c, kk, 1);
        });
    std::vector<unsigned long long> table;
    for (auto& t : t_rows) table.push_back((unsigned long long)(uintptr_t)t.data());
    emu_launch(emu_dim3{grid.x, (unsigned)bsz, 1}, 256, 0, [&] {
        if constexpr (sizeof(T) == 4)
            conv1d_update_rows_f32((const float*)x.data(), stride, w.data(), table.data(), (float*)y_rows.data(), c,
                                   kk, 1);
        else
            conv1d_update_rows_bf16((const bf16*)x.data(), stride, w.data(), table.data(), (bf16*)y_rows.data(), c,
                                    kk, 1);
    });
    bool tails = true;
    for (int b = 0; b < bsz; ++b) tails = tails && same_bits(t_one[b], t_rows[b]);
    check(same_bits(y_one, y_rows), std::string(name) + ": outputs of " + std::to_string(bsz) +
                                        " rows = one-sequence update per row (bitwise)");
    check(tails, std::string(name) + ": tails = one-sequence update per row (bitwise)");
}

int main() {
    std::printf("gdr_recurrent_rows_* against gdr_recurrent_* (T = 1) row by row\n");
    gdr_case<float, 64>("f32 dk 64, Hk 2, Hv 4, dv 40", 3, 2, 4, 40, gdr_recurrent_f32_64, gdr_recurrent_rows_f32_64);
    gdr_case<bf16, 128>("bf16 dk 128, Hk 1, Hv 2, dv 33", 4, 1, 2, 33, gdr_recurrent_bf16_128,
                        gdr_recurrent_rows_bf16_128);
    std::printf("conv1d_update_rows_* against conv1d_update_* row by row\n");
    conv_case<float>("f32 C 300, K 4, stride 310", 3, 300, 4, 310);
    conv_case<bf16>("bf16 C 70, K 4, stride 70", 2, 70, 4, 70);
    if (g_fail) {
        std::printf("%d check(s) FAILED\n", g_fail);
        return 1;
    }
    std::printf("all checks passed\n");
    return 0;
}
