// Runs the flash-attention kernels of dataplane/kernels/flash.cu (the real source, see
// run.sh) in the host emulator of emu.h against a double-precision reference of the
// attention contract (model::attention). Small shapes only: one fiber per CUDA thread.
#include "emu.h"

typedef long long i64;
#include "gen_flash.inc"

#include <random>
#include <string>

struct Result {
    double rel = 0, max_rel = 0;
    bool ok = true;
};

static int g_fail = 0;

typedef void (*FlashKernel)(const bf16*, const bf16*, const bf16*, const i64*, const i64*, const i64*, bf16*,
                            float*, float*, int, int, int, int, float);

// The instance for head dim hd and tiles br × bc (as attn.rs names them).
static FlashKernel kernel_for(int hd, int br, int bc) {
    if (hd == 64 && br == 128 && bc == 64) return attn_flash_bf16_64_128x64;
    if (hd == 128 && br == 128 && bc == 64) return attn_flash_bf16_128_128x64;
    if (hd == 128 && br == 64 && bc == 64) return attn_flash_bf16_128_64x64;
    if (hd == 256 && br == 128 && bc == 64) return attn_flash_bf16_256_128x64;
    if (hd == 256 && br == 64 && bc == 32) return attn_flash_bf16_256_64x32;
    if (hd == 256 && br == 128 && bc == 32) return attn_flash_bf16_256_128x32;
    std::fprintf(stderr, "no instance %d %dx%d\n", hd, br, bc);
    std::exit(2);
}

static void run_case(const std::string& name, const std::vector<i64>& q_pos, const std::vector<i64>& kv_pos,
                     int nh, int nkv, int hd, int nsplit, unsigned seed, int br = 128, int bc = 64) {
    const int tq = (int)q_pos.size(), n = (int)kv_pos.size();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    auto rnd = [&](size_t len) {
        std::vector<__nv_bfloat16> v(len);
        for (auto& x : v) x = __float2bfloat16_rn(U(rng));
        return v;
    };
    auto q = rnd((size_t)tq * nh * hd), k = rnd((size_t)n * nkv * hd), v = rnd((size_t)n * nkv * hd);
    // Reference in double on the bf16 inputs.
    std::vector<double> want((size_t)tq * nh * hd, 0.0);
    const double scale = 1.0 / std::sqrt((double)hd);
    for (int t = 0; t < tq; ++t)
        for (int h = 0; h < nh; ++h) {
            const int kh = h / (nh / nkv);
            std::vector<double> s(n);
            double m = -INFINITY;
            for (int j = 0; j < n; ++j) {
                if (kv_pos[j] > q_pos[t]) {
                    s[j] = -INFINITY;
                    continue;
                }
                double d = 0;
                for (int c = 0; c < hd; ++c)
                    d += (double)__bfloat162float(q[((size_t)t * nh + h) * hd + c]) *
                         (double)__bfloat162float(k[((size_t)j * nkv + kh) * hd + c]);
                s[j] = d * scale;
                m = std::max(m, s[j]);
            }
            if (m == -INFINITY) continue;
            double l = 0;
            for (int j = 0; j < n; ++j) {
                s[j] = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m);
                l += s[j];
            }
            for (int j = 0; j < n; ++j)
                if (s[j] != 0.0)
                    for (int c = 0; c < hd; ++c)
                        want[((size_t)t * nh + h) * hd + c] +=
                            s[j] / l * (double)__bfloat162float(v[((size_t)j * nkv + kh) * hd + c]);
        }
    // Device side.
    const int ntk = (n + bc - 1) / bc;
    std::vector<i64> tiles(3 * std::max(ntk, 1), -77);
    std::vector<i64> kvp = n ? kv_pos : std::vector<i64>{0};
    if (ntk > 0) {
        emu_launch({(unsigned)((ntk + 7) / 8), 1, 1}, 256, 0, [&] { attn_flash_tiles(kvp.data(), n, bc, tiles.data()); });
        emu_launch({1, 1, 1}, FA_TILE_THREADS, 0, [&] { attn_flash_tiles_suffix(ntk, tiles.data()); });
    }
    for (int t = 0; t < ntk; ++t) {
        i64 mn = INT64_MAX, mx = INT64_MIN, sm = INT64_MAX;
        for (int j = t * bc; j < std::min(n, (t + 1) * bc); ++j) mn = std::min(mn, kv_pos[j]), mx = std::max(mx, kv_pos[j]);
        for (int j = t * bc; j < n; ++j) sm = std::min(sm, kv_pos[j]);
        if (tiles[t] != mn || tiles[ntk + t] != mx || tiles[2 * ntk + t] != sm) {
            std::printf("FAIL %s: tile summary %d wrong\n", name.c_str(), t);
            ++g_fail;
            return;
        }
    }
    std::vector<__nv_bfloat16> o((size_t)tq * nh * hd, __nv_bfloat16{0xffff});
    const size_t rows = (size_t)tq * nh;
    std::vector<float> wo(nsplit > 1 ? rows * hd * nsplit : 1, NAN), wml(nsplit > 1 ? rows * 2 * nsplit : 1, NAN);
    const int nqt = (tq + br - 1) / br;
    const size_t smem = (size_t)(br + 2 * bc + 2 * (br / 16)) * 8 + (size_t)(br + 4 * bc) * (hd + FA_PAD) * 2;
    const float sl2 = (float)(scale * 1.4426950408889634);
    const FlashKernel f = kernel_for(hd, br, bc);
    emu_launch({(unsigned)(nqt * nh), (unsigned)nsplit, 1}, 2 * br, smem, [&] {
        f(q.data(), k.data(), v.data(), q_pos.data(), kvp.data(), tiles.data(), o.data(), wo.data(), wml.data(), tq, n,
          nh, nkv, sl2);
    });
    if (nsplit > 1)
        emu_launch({(unsigned)rows, 1, 1}, 128, 0,
                   [&] { attn_flash_combine_bf16(wo.data(), wml.data(), o.data(), (int)rows, hd, nsplit); });
    // Compare.
    double num = 0, den = 0, maxd = 0, maxw = 0;
    bool nan = false, zero_bad = false;
    for (int t = 0; t < tq; ++t) {
        bool sees = false;
        for (int j = 0; j < n; ++j) sees |= kv_pos[j] <= q_pos[t];
        for (size_t c = 0; c < (size_t)nh * hd; ++c) {
            const double got = __bfloat162float(o[(size_t)t * nh * hd + c]);
            const double w = want[(size_t)t * nh * hd + c];
            if (std::isnan(got)) nan = true;
            if (!sees && got != 0.0) zero_bad = true;
            num += (got - w) * (got - w);
            den += w * w;
            maxd = std::max(maxd, std::fabs(got - w));
            maxw = std::max(maxw, std::fabs(w));
        }
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num), mrel = maxw > 0 ? maxd / maxw : maxd;
    const bool pass = !nan && !zero_bad && rel <= 4e-3 && mrel <= 4e-2;
    std::printf("%s %s: %d/%d x %d, %dx%d tiles, tq=%d n_kv=%d split %d: rel %.2e max rel %.2e%s%s\n",
                pass ? "ok  " : "FAIL", name.c_str(), nh, nkv, hd, br, bc, tq, n, nsplit, rel, mrel, nan ? " NaN" : "",
                zero_bad ? " nonzero-for-blind-query" : "");
    if (!pass) ++g_fail;
}

// The two tile-summary kernels alone over a long cache of random positions (many blocks,
// more tiles than the suffix kernel has threads).
static void tiles_only(int n, int bc, unsigned seed) {
    std::mt19937_64 rng(seed);
    std::vector<i64> kv(n);
    for (auto& p : kv) p = (i64)(rng() % 1000000) - 500000;
    const int ntk = (n + bc - 1) / bc;
    std::vector<i64> tiles(3 * ntk, -77);
    emu_launch({(unsigned)((ntk + 7) / 8), 1, 1}, 256, 0, [&] { attn_flash_tiles(kv.data(), n, bc, tiles.data()); });
    emu_launch({1, 1, 1}, FA_TILE_THREADS, 0, [&] { attn_flash_tiles_suffix(ntk, tiles.data()); });
    i64 sm = INT64_MAX;
    int bad = 0;
    for (int t = ntk - 1; t >= 0; --t) {
        i64 mn = INT64_MAX, mx = INT64_MIN;
        for (int j = t * bc; j < std::min(n, (t + 1) * bc); ++j) mn = std::min(mn, kv[j]), mx = std::max(mx, kv[j]);
        sm = std::min(sm, mn);
        bad += tiles[t] != mn || tiles[ntk + t] != mx || tiles[2 * ntk + t] != sm;
    }
    std::printf("%s tile summary: n_kv=%d bc=%d (%d tiles): %d wrong\n", bad ? "FAIL" : "ok  ", n, bc, ntk, bad);
    if (bad) ++g_fail;
}

static std::vector<i64> range(i64 a, i64 b) {
    std::vector<i64> v;
    for (i64 i = a; i < b; ++i) v.push_back(i);
    return v;
}

int main(int argc, char** argv) {
    emu.eager_cp = getenv("EMU_EAGER_CP") && atoi(getenv("EMU_EAGER_CP"));
    const bool quick = argc > 1 && std::string(argv[1]) == "quick";
    // Causal prefill at 0..T, T not a tile multiple; GQA 2:1 and 1:1.
    for (int T : {1, 17, 200}) {
        run_case("causal", range(0, T), range(0, T), 4, 2, 64, 1, 1 + T);
        run_case("causal", range(0, T), range(0, T), 2, 1, 128, 1, 2 + T);
        if (!quick || T < 100) run_case("causal", range(0, T), range(0, T), 2, 1, 256, 1, 3 + T);
    }
    // Seam: cached segments out of order with a gap, an 8-query window after them, scattered
    // queries (one at -3 sees nothing, one at 100000 sees everything).
    std::vector<i64> kv = range(0, 40), seg = range(1000, 1077), seg2 = range(200, 261);
    kv.insert(kv.end(), seg.begin(), seg.end());
    kv.insert(kv.end(), seg2.begin(), seg2.end());
    std::vector<i64> qs = range(1077, 1085);
    for (i64 p : {5LL, 230LL, 1050LL, 100000LL, -3LL}) qs.push_back(p);
    run_case("seam", qs, kv, 4, 2, 64, 1, 11);
    run_case("seam", qs, kv, 2, 1, 256, 1, 12);
    run_case("seam split", qs, kv, 2, 1, 128, 2, 13);
    // Window appended after the cache (as GpuModel does): 100 queries over cache + window.
    std::vector<i64> kv2 = kv, w = range(1077, 1177);
    kv2.insert(kv2.end(), w.begin(), w.end());
    run_case("seam window", w, kv2, 2, 1, 128, 1, 14);
    // Permutations of 0..150 on both sides.
    {
        std::vector<i64> kp(150), qp(150);
        for (int i = 0; i < 150; ++i) kp[i] = (i * 7919) % 150, qp[i] = (i * 13) % 150;
        run_case("shuffled", qp, kp, 2, 1, 64, 1, 21);
        run_case("shuffled split", qp, kp, 2, 1, 64, 3, 22);
    }
    // Two query tiles, the second with 2 rows (7 of its 8 warps idle); split KV with more
    // splits than tiles (empty splits).
    run_case("causal 130", range(0, 130), range(0, 130), 2, 1, 64, 1, 31);
    run_case("causal 130 split", range(0, 130), range(0, 130), 2, 1, 64, 5, 32);
    // Queries that see no key at all, keys in reverse order; extreme positions.
    run_case("blind", range(-40, 30), [] { auto r = range(0, 50); std::reverse(r.begin(), r.end()); return r; }(),
             2, 1, 64, 1, 41);
    run_case("extremes", {INT64_MAX, INT64_MIN, 0, 5}, {INT64_MIN, 3, INT64_MAX, 7, 0}, 2, 1, 64, 1, 42);
    // Empty cache: zeros.
    run_case("empty cache", range(0, 20), {}, 2, 1, 64, 1, 51);
    // Visible tiles far apart (tiles 1..38 hold positions above every query: the tile
    // search crosses a 32-tile window), and the suffix-minimum early exit.
    {
        std::vector<i64> kvs = range(0, 64);
        for (int t = 1; t < 39; ++t) {
            auto r = range(10000 + 64 * t, 10000 + 64 * t + 64);
            kvs.insert(kvs.end(), r.begin(), r.end());
        }
        auto tail = range(64, 100);
        kvs.insert(kvs.end(), tail.begin(), tail.end());
        run_case("sparse tiles", {100, 5000, 30, 63}, kvs, 2, 1, 64, 1, 71);
        run_case("sparse tiles split", {100, 5000, 30, 63}, kvs, 2, 1, 128, 4, 72);
    }
    tiles_only(70001, 64, 73);
    tiles_only(5000, 32, 74);
    // The other tile shapes: 64 × 64 at HD 128, 64 × 32 and 128 × 32 at HD 256.
    run_case("causal", range(0, 150), range(0, 150), 2, 1, 128, 1, 61, 64, 64);
    run_case("seam split", qs, kv, 2, 1, 128, 3, 62, 64, 64);
    run_case("causal", range(0, 100), range(0, 100), 2, 1, 256, 1, 63, 64, 32);
    run_case("seam", qs, kv, 2, 1, 256, 2, 64, 64, 32);
    if (!quick) run_case("causal", range(0, 150), range(0, 150), 2, 1, 256, 1, 65, 128, 32);
    run_case("blind", range(-40, 30), range(0, 50), 2, 1, 256, 1, 66, 128, 32);
    std::printf("%s: %d failure(s)\n", g_fail ? "FAILED" : "passed", g_fail);
    return g_fail ? 1 : 0;
}
