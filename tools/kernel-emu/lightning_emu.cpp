// Runs the Lightning attention kernels (dataplane/kernels/lightning.cu) and the general MoE
// router (moe_route_rule of dataplane/kernels/moe.cu) — the real sources, see run.sh
// `lightning` — in the host emulator of emu.h, against references transcribed from the CPU
// backend (mixers/lightning/{naive,layer}.rs, lightning::rotate_state,
// router::RouterConfig::route). Small shapes only: one fiber per CUDA thread.
#include "emu.h"

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

#include "gen_lightning.inc"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

static int g_fail = 0;

static void check(bool ok, const std::string& what) {
    std::printf("  %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++g_fail;
}

static double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return INFINITY;
    double m = 1, d = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i]) || std::isnan(b[i])) return NAN;
        m = std::max(m, (double)std::fabs(b[i]));
        d = std::max(d, (double)std::fabs(a[i] - b[i]));
    }
    return d / m;
}

static std::vector<float> rnd(size_t n, unsigned seed, float lo = -0.5f, float hi = 0.5f) {
    std::mt19937 r(seed);
    std::uniform_real_distribution<float> U(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = U(r);
    return v;
}

// Launch over a 3-D grid (emu_launch covers x and y; z by repeated launches).
static void launch3(emu_dim3 g, unsigned threads, size_t dyn, std::function<void()> k) {
    for (unsigned z = 0; z < std::max(1u, g.z); ++z)
        emu_launch(emu_dim3{g.x, g.y, 1}, threads, dyn, [&, z] {
            blockIdx.z = z;
            k();
        });
}

// CPU naive recurrence (mixers/lightning/naive.rs).
static std::vector<float> naive(int t, int h, int dk, int dv, const std::vector<float>& q,
                                const std::vector<float>& k, const std::vector<float>& v,
                                const std::vector<float>& g, float scale, std::vector<float>& s) {
    std::vector<float> o((size_t)t * h * dv, 0.f);
    for (int hi = 0; hi < h; ++hi) {
        const float decay = std::exp(g[hi]);
        float* S = &s[(size_t)hi * dk * dv];
        for (int ti = 0; ti < t; ++ti) {
            const size_t row = (size_t)ti * h + hi;
            for (int i = 0; i < dk; ++i)
                for (int j = 0; j < dv; ++j) S[i * dv + j] = S[i * dv + j] * decay + k[row * dk + i] * v[row * dv + j];
            for (int i = 0; i < dk; ++i) {
                const float qs = q[row * dk + i] * scale;
                for (int j = 0; j < dv; ++j) o[row * dv + j] += qs * S[i * dv + j];
            }
        }
    }
    return o;
}

static size_t chunk_smem(int dk) { return 4 * (2 * LT_C * (dk + 1) + LT_C * LT_BV + LT_C * LT_C + dk * LT_BV + LT_C + 1); }

static void recurrence_cases() {
    for (auto [h, d] : std::vector<std::pair<int, int>>{{3, 16}, {2, 40}, {1, 128}}) {
        std::vector<float> g(h);
        for (int i = 0; i < h; ++i) g[i] = -0.02f - 0.7f * i;
        const float scale = 1.f / std::sqrt((float)d);
        for (int t : {1, 2, 15, 16, 17, 31, 32, 33, 65, 100}) {
            if (d == 128 && t > 40) continue;
            auto q = rnd((size_t)t * h * d, 1 + t), k = rnd((size_t)t * h * d, 2 + t), v = rnd((size_t)t * h * d, 3 + t);
            auto s0 = rnd((size_t)h * d * d, 4);
            auto s_ref = s0;
            auto o_ref = naive(t, h, d, d, q, k, v, g, scale, s_ref);
            // Per-token kernel.
            auto s1 = s0;
            std::vector<float> o1((size_t)t * h * d, NAN);
            launch3(emu_dim3{(unsigned)h, (unsigned)((d + 63) / 64), 1}, 64, 0,
                    [&] { lt_recurrent(q.data(), k.data(), v.data(), g.data(), scale, s1.data(), o1.data(), t, h, d, d); });
            // One-pass chunked kernel, and its state-only pass.
            auto s2 = s0, s3 = s0;
            std::vector<float> o2((size_t)t * h * d, NAN);
            const unsigned tiles = (unsigned)((d + LT_BV - 1) / LT_BV);
            launch3(emu_dim3{(unsigned)h, tiles, 1}, 256, chunk_smem(d),
                    [&] { lt_chunk(q.data(), k.data(), v.data(), g.data(), scale, s2.data(), o2.data(), t, h, d, d); });
            launch3(emu_dim3{(unsigned)h, tiles, 1}, 256, chunk_smem(d),
                    [&] { lt_chunk(q.data(), k.data(), v.data(), g.data(), scale, s3.data(), nullptr, t, h, d, d); });
            // Two-pass (one slab).
            auto s4 = s0;
            std::vector<float> o4((size_t)t * h * d, NAN);
            const int nch = (t + LT_C - 1) / LT_C;
            std::vector<float> hs((size_t)nch * h * d * d, NAN);
            launch3(emu_dim3{(unsigned)h, tiles, 1}, 256, chunk_smem(d),
                    [&] { lt_chunk_states(k.data(), v.data(), g.data(), s4.data(), hs.data(), t, h, d, d); });
            launch3(emu_dim3{(unsigned)nch, (unsigned)h, tiles}, 256, chunk_smem(d), [&] {
                lt_chunk_out(q.data(), k.data(), v.data(), g.data(), scale, hs.data(), o4.data(), t, h, d, d);
            });
            const double e1 = std::max(max_rel(o1, o_ref), max_rel(s1, s_ref));
            const double e2 = std::max(max_rel(o2, o_ref), max_rel(s2, s_ref));
            const bool so = s3 == s2, two = o4 == o2 && s4 == s2;
            char buf[256];
            std::snprintf(buf, sizeof buf,
                          "H %d d %d t %d: per-token vs CPU %.2e, chunked vs CPU %.2e, state-only %s, two-pass %s", h, d, t,
                          e1, e2, so ? "equal" : "DIFFERS", two ? "bit-identical" : "DIFFERS");
            check(e1 <= 1e-6 && e2 <= 2e-5 && so && two, buf);
        }
    }
}

// The projection-side kernels: prep (SiLU, q/k RMSNorm, RoPE), output norm and gate,
// state rotation, scalar apply.
static void glue_cases() {
    const int t = 5, H = 3, d = 16, rot = 8, W = H * d, ld = 4 * W, groups = 2;
    const float eps = 1e-6f;
    auto proj = rnd((size_t)t * ld, 21, -2.f, 2.f);
    auto qn = rnd(d, 22), kn = rnd(d, 23), gn = rnd(W, 24, 0.5f, 1.5f);
    std::vector<i64> pos = {0, 1, 7, 100, 4000};
    std::vector<float> inv(rot / 2);
    for (int i = 0; i < rot / 2; ++i) inv[i] = (float)(1.0 / std::pow(10000.0, (2.0 * i) / rot));
    for (int silu : {0, 1}) {
        std::vector<float> q((size_t)t * W, NAN), k((size_t)t * W, NAN), v((size_t)t * W, NAN);
        emu_launch(emu_dim3{(unsigned)t, (unsigned)(3 * H), 1}, 32, (d + 32) * 4, [&] {
            lt_prep_f32(proj.data(), ld, qn.data(), kn.data(), pos.data(), inv.data(), rot, silu, q.data(), k.data(),
                        v.data(), H, d, eps);
        });
        // Reference (layer.rs mix: SiLU, zero-centred RMSNorm, Rope::apply).
        std::vector<float> rq(q.size()), rk(k.size()), rv(v.size());
        for (int ti = 0; ti < t; ++ti)
            for (int part = 0; part < 3; ++part)
                for (int hh = 0; hh < H; ++hh) {
                    float x[64];
                    for (int i = 0; i < d; ++i) {
                        float a = proj[(size_t)ti * ld + part * W + hh * d + i];
                        x[i] = silu ? a / (1.f + std::exp(-a)) : a;
                    }
                    float* dst = (part == 0 ? rq.data() : part == 1 ? rk.data() : rv.data()) + ((size_t)ti * H + hh) * d;
                    if (part < 2) {
                        float ms = 0;
                        for (int i = 0; i < d; ++i) ms += x[i] * x[i];
                        const float r = 1.f / std::sqrt(ms / d + eps);
                        const float* w = part == 0 ? qn.data() : kn.data();
                        for (int i = 0; i < d; ++i) x[i] = x[i] * r * (1.f + w[i]);
                        for (int i = 0; i < rot / 2; ++i) {
                            const float a = (float)pos[ti] * inv[i], c = std::cos(a), s = std::sin(a);
                            const float x1 = x[i], x2 = x[i + rot / 2];
                            x[i] = x1 * c - x2 * s;
                            x[i + rot / 2] = x2 * c + x1 * s;
                        }
                    }
                    std::copy(x, x + d, dst);
                }
        const double e = std::max({max_rel(q, rq), max_rel(k, rk), max_rel(v, rv)});
        check(e <= 1e-5, "prep silu " + std::to_string(silu) + ": max-rel " + std::to_string(e));
    }
    // Output: group norm and gate.
    auto o = rnd((size_t)t * W, 25, -1.f, 1.f);
    std::vector<float> y((size_t)t * W, NAN), ry(y.size());
    emu_launch(emu_dim3{(unsigned)t, (unsigned)groups, 1}, 128, 0,
               [&] { lt_out_f32(o.data(), proj.data(), ld, 3 * W, gn.data(), y.data(), W, groups, eps); });
    const int gs = W / groups;
    for (int ti = 0; ti < t; ++ti)
        for (int gi = 0; gi < groups; ++gi) {
            float ms = 0;
            for (int i = 0; i < gs; ++i) ms += o[(size_t)ti * W + gi * gs + i] * o[(size_t)ti * W + gi * gs + i];
            const float r = 1.f / std::sqrt(ms / gs + eps);
            for (int i = 0; i < gs; ++i) {
                const int c = gi * gs + i;
                const float gate = proj[(size_t)ti * ld + 3 * W + c];
                ry[(size_t)ti * W + c] = o[(size_t)ti * W + c] * r * gn[c] * (1.f / (1.f + std::exp(-gate)));
            }
        }
    check(max_rel(y, ry) <= 1e-5, "group norm and gate: max-rel " + std::to_string(max_rel(y, ry)));
    // State rotation (lightning::rotate_state: Rope::apply on every key-axis column).
    for (i64 b : {1LL, 37LL, 4000LL}) {
        const int dk = 16, dv = 12;
        auto s = rnd((size_t)H * dk * dv, 26), want = s;
        for (int hh = 0; hh < H; ++hh)
            for (int j = 0; j < dv; ++j)
                for (int i = 0; i < rot / 2; ++i) {
                    float* S = &want[(size_t)hh * dk * dv];
                    const float a = (float)b * inv[i], c = std::cos(a), sn = std::sin(a);
                    const float x1 = S[i * dv + j], x2 = S[(i + rot / 2) * dv + j];
                    S[i * dv + j] = x1 * c - x2 * sn;
                    S[(i + rot / 2) * dv + j] = x2 * c + x1 * sn;
                }
        emu_launch(emu_dim3{2, 1, 1}, 256, 0, [&] { lt_rotate_state(s.data(), H, dk, dv, b, inv.data(), rot); });
        check(max_rel(s, want) <= 2e-6, "rotate_state b " + std::to_string(b) + ": max-rel " + std::to_string(max_rel(s, want)));
    }
    for (int nv : {0, 1}) {
        const int per = 20;
        auto s = rnd((size_t)H * per, 27), bb = rnd((size_t)H * per, 28), tr = rnd(H, 29, 0.f, 1.f);
        auto want = s;
        for (int i = 0; i < H * per; ++i) want[i] = nv ? want[i] + bb[i] : tr[i / per] * want[i] + bb[i];
        emu_launch(emu_dim3{1, 1, 1}, 256, 0, [&] { lt_scalar_apply(s.data(), tr.data(), bb.data(), H, per, nv); });
        check(s == want, std::string("scalar apply naive ") + std::to_string(nv));
    }
}

// router::RouterConfig::route, transcribed.
struct Rule {
    bool sigmoid;
    int n_group, topk_group;
    float dropped, scale;
    bool renorm_single;
};
static std::vector<std::pair<int, float>> route_ref(const Rule& r, const float* logits, const float* bias, int E, int k,
                                                    bool norm) {
    std::vector<float> s(logits, logits + E);
    if (r.sigmoid) {
        for (auto& x : s) x = 1.f / (1.f + std::exp(-x));
    } else {
        float m = -INFINITY, z = 0;
        for (float x : s) m = std::max(m, x);
        for (auto& x : s) z += (x = std::exp(x - m));
        for (auto& x : s) x /= z;
    }
    std::vector<float> c = s;
    if (bias)
        for (int e = 0; e < E; ++e) c[e] += bias[e];
    if (r.n_group > 1) {
        const int per = E / r.n_group;
        std::vector<float> gs(r.n_group);
        for (int g = 0; g < r.n_group; ++g) {
            std::vector<float> v(c.begin() + g * per, c.begin() + (g + 1) * per);
            std::sort(v.begin(), v.end(), std::greater<float>());
            gs[g] = v.size() >= 2 ? v[0] + v[1] : v[0];
        }
        std::vector<int> order(r.n_group);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gs[a] > gs[b]; });
        for (int j = r.topk_group; j < r.n_group; ++j)
            for (int e = order[j] * per; e < (order[j] + 1) * per; ++e) c[e] = r.dropped;
    }
    std::vector<int> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return c[a] > c[b]; });
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += s[idx[j]];
    const bool renorm = norm && (!r.sigmoid || k > 1 || r.renorm_single);
    std::vector<std::pair<int, float>> out;
    for (int j = 0; j < k; ++j) out.push_back({idx[j], (renorm ? s[idx[j]] / sum : s[idx[j]]) * r.scale});
    return out;
}

static void router_cases() {
    struct Case {
        const char* name;
        Rule r;
        int E, k;
        bool norm;
        float bscale;
    };
    std::vector<Case> cases = {
        {"ring-fixture", {true, 4, 2, 0.f, 2.5f, false}, 8, 2, true, 0.1f},
        {"ring-mini", {true, 8, 4, 0.f, 2.5f, false}, 256, 8, true, 0.1f},
        {"ungrouped", {true, 1, 1, 0.f, 2.5f, false}, 64, 6, false, 0.1f},
        {"negative-bias", {true, 4, 1, 0.f, 2.5f, false}, 32, 4, true, -2.f},
        {"kimi-like", {true, 8, 4, -INFINITY, 1.f, true}, 256, 8, true, -2.f},
        {"kimi-single", {true, 8, 4, -INFINITY, 1.f, true}, 64, 1, true, 0.1f},
        {"softmax-scaled", {false, 1, 1, 0.f, 1.5f, false}, 128, 8, true, 0.f},
        {"odd-E", {true, 5, 3, 0.f, 1.f, false}, 45, 7, true, 0.3f},
    };
    for (auto& cs : cases) {
        const int t = 40, E = cs.E, k = cs.k;
        auto logits = rnd((size_t)t * E, 77, -4.f, 4.f);
        auto bias = rnd(E, 5);
        for (auto& b : bias) b *= cs.bscale;
        const float* bp = cs.bscale != 0.f ? bias.data() : nullptr;
        std::vector<int> idx((size_t)t * k, -1);
        std::vector<float> w((size_t)t * k, NAN);
        emu_launch(emu_dim3{(unsigned)((t * 32 + 255) / 256), 1, 1}, 256, 0, [&] {
            moe_route_rule(logits.data(), E, t, E, k, cs.norm, cs.r.sigmoid, bp, cs.r.n_group, cs.r.topk_group,
                           cs.r.dropped, cs.r.renorm_single, cs.r.scale, idx.data(), w.data());
        });
        int bad = 0;
        double wmax = 0;
        for (int ti = 0; ti < t; ++ti) {
            auto want = route_ref(cs.r, &logits[(size_t)ti * E], bp, E, k, cs.norm);
            for (int j = 0; j < k; ++j) {
                if (idx[(size_t)ti * k + j] != want[j].first) ++bad;
                wmax = std::max(wmax, (double)std::fabs(w[(size_t)ti * k + j] - want[j].second) /
                                          std::max(1e-6, (double)std::fabs(want[j].second)));
            }
        }
        char buf[200];
        std::snprintf(buf, sizeof buf, "router %s (E %d, top-%d): %d of %d choices differ, weights max-rel %.2e", cs.name, E,
                      k, bad, t * k, wmax);
        check(bad == 0 && wmax <= 1e-6, buf);
    }
}

int main() {
    std::printf("lightning kernels (emulated)\n");
    recurrence_cases();
    glue_cases();
    std::printf("router (emulated)\n");
    router_cases();
    std::printf("%s: %d failure(s)\n", g_fail ? "FAIL" : "ok", g_fail);
    return g_fail ? 1 : 0;
}
