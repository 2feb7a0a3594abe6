// Runs the wgmma flash-attention kernels of dataplane/kernels/flash_wg.cu (the real source,
// see run.sh: `run.sh wg`) in the host emulator of emu.h + emu_wg.h against a
// double-precision reference of the attention contract (model::attention). The key tile
// summaries and the split merge are flash.cu's kernels, as in attn::prefill_flash_wg.
// Usage: flash_wg_emu [quick] [basic|wg3tmal|wg3tmalb80|all] (default all):
// attn_flash_wg_bf16_* (256 threads) and / or the warp-specialised attn_flash_wg3tmal_bf16_*
// (384 threads, K/V by TMA, 64-key tiles) and attn_flash_wg3tmalb80_bf16_* (80-key tiles).
#include "emu_wg.h"

typedef long long i64;
#include "gen_flash.inc"
#include "gen_flash_wg.inc"

#include <random>
#include <string>

static int g_fail = 0;
static int g_variant = 0;  // 0: attn_flash_wg_*, 1: attn_flash_wg3tmal_*, 2: attn_flash_wg3tmalb80_*
static const char* const g_vname[] = {"wg ", "wg3tmal", "wg3tmalb80"};
static double g_worst_rel = 0, g_worst_mrel = 0;

typedef void (*FlashKernel)(const bf16*, const bf16*, const bf16*, const i64*, const i64*, const i64*, bf16*,
                            float*, float*, int, int, int, int, float);
typedef void (*FlashTmaKernel)(const bf16*, const bf16*, const bf16*, const i64*, const i64*, const i64*, bf16*,
                               float*, float*, int, int, int, int, float, const FwTmap, const FwTmap);

static void run_case(const std::string& name, const std::vector<i64>& q_pos, const std::vector<i64>& kv_pos,
                     int nh, int nkv, int hd, int nsplit, unsigned seed) {
    const int br = 128, bc = g_variant == 2 ? 80 : 64;
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
    // attn.rs: flash_wg_smem_bytes / flash_wg3_smem_bytes (stages: 2, or 3 at HD 128).
    const size_t st3 = hd == 256 ? 2 : 3;
    const size_t smem = g_variant == 0
                            ? 1024 + (size_t)(hd / 64) * (br + 4 * bc) * 128 + (size_t)(br + 2 * bc + 16) * 8
                            : 1024 + (size_t)(hd / 64) * (br + 2 * st3 * bc) * 128 + (size_t)(st3 * bc + 48) * 8;
    if (smem > 232448) {
        std::printf("FAIL %s: %zu bytes of shared memory exceed the 232 448 of a CTA\n", name.c_str(), smem);
        ++g_fail;
        return;
    }
    const float sl2 = (float)(scale * 1.4426950408889634);
    // attn.rs: encode_kv_map. K and V viewed as [n_kv rows][nkv·hd bf16], boxes of 64 × 64
    // with the 128-byte swizzle; no key: zeroed maps (the kernel issues no copy).
    FwTmap mk{}, mv{};
    if (g_variant >= 1 && n > 0) {
        const unsigned long long dim[2] = {(unsigned long long)nkv * hd, (unsigned long long)n};
        const unsigned box[2] = {64, (unsigned)bc};
        if (!emu_tmap_encode_tiled(&mk, 2, k.data(), dim, (unsigned long long)nkv * hd * 2, box, 3) ||
            !emu_tmap_encode_tiled(&mv, 2, v.data(), dim, (unsigned long long)nkv * hd * 2, box, 3)) {
            std::printf("FAIL %s: tensor map encoding rejected\n", name.c_str());
            ++g_fail;
            return;
        }
    }
    const FlashTmaKernel ft = g_variant == 2 ? (hd == 256 ? attn_flash_wg3tmalb80_bf16_256 : attn_flash_wg3tmalb80_bf16_128)
                                             : (hd == 256 ? attn_flash_wg3tmal_bf16_256 : attn_flash_wg3tmal_bf16_128);
    const FlashKernel f = hd == 256 ? attn_flash_wg_bf16_256 : attn_flash_wg_bf16_128;
    const unsigned threads = g_variant == 0 ? 256 : 384;
    const long ops0 = emu_wg_count;
    emu_launch({(unsigned)(nqt * nh), (unsigned)nsplit, 1}, threads, smem + emu_smem_shift, [&] {
        if (g_variant >= 1)
            ft(q.data(), k.data(), v.data(), q_pos.data(), kvp.data(), tiles.data(), o.data(), wo.data(), wml.data(), tq,
               n, nh, nkv, sl2, mk, mv);
        else
            f(q.data(), k.data(), v.data(), q_pos.data(), kvp.data(), tiles.data(), o.data(), wo.data(), wml.data(), tq,
              n, nh, nkv, sl2);
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
    std::printf("%s %s %s: %d/%d x %d, tq=%d n_kv=%d split %d: rel %.2e max rel %.2e (%ld wgmma)%s%s\n",
                pass ? "ok  " : "FAIL", g_vname[g_variant], name.c_str(), nh, nkv, hd, tq, n, nsplit, rel, mrel, emu_wg_count - ops0,
                nan ? " NaN" : "", zero_bad ? " nonzero-for-blind-query" : "");
    g_worst_rel = std::max(g_worst_rel, rel);
    g_worst_mrel = std::max(g_worst_mrel, mrel);
    if (!pass) ++g_fail;
}

static std::vector<i64> range(i64 a, i64 b) {
    std::vector<i64> v;
    for (i64 i = a; i < b; ++i) v.push_back(i);
    return v;
}

static void wg_case(const std::string& name, const std::vector<i64>& q_pos, const std::vector<i64>& kv_pos, int nh,
                    int nkv, int hd, int nsplit, unsigned seed) {
    emu_wg_init();
    run_case(name, q_pos, kv_pos, nh, nkv, hd, nsplit, seed);
}

static void all_cases(bool quick) {
    // Causal prefill at 0..T (T not always a tile multiple), GQA 16/2 and 8/1, HD 256.
    wg_case("causal", range(0, 64), range(0, 64), 16, 2, 256, 1, 1);
    wg_case("causal", range(0, 200), range(0, 200), 8, 1, 256, 1, 2);
    wg_case("causal", range(0, 333), range(0, 333), 2, 1, 256, 1, 3);
    if (!quick) {
        wg_case("causal", range(0, 512), range(0, 512), 16, 2, 256, 1, 4);
        wg_case("causal", range(0, 257), range(0, 257), 8, 1, 256, 1, 5);
    }
    // HD 128.
    wg_case("causal", range(0, 150), range(0, 150), 8, 1, 128, 1, 6);
    if (!quick) wg_case("causal", range(0, 384), range(0, 384), 16, 2, 128, 1, 7);
    // Seam: cached segments out of order with a gap, an 8-query window after them, scattered
    // queries (one at -3 sees nothing, one at 100000 sees everything).
    std::vector<i64> kv = range(0, 40), seg = range(1000, 1077), seg2 = range(200, 261);
    kv.insert(kv.end(), seg.begin(), seg.end());
    kv.insert(kv.end(), seg2.begin(), seg2.end());
    std::vector<i64> qs = range(1077, 1085);
    for (i64 p : {5LL, 230LL, 1050LL, 100000LL, -3LL}) qs.push_back(p);
    wg_case("seam", qs, kv, 16, 2, 256, 1, 11);
    wg_case("seam", qs, kv, 2, 1, 128, 1, 12);
    wg_case("seam split", qs, kv, 2, 1, 256, 2, 13);
    // Window appended after the cache (as GpuModel does): 100 queries over cache + window.
    std::vector<i64> kv2 = kv, w = range(1077, 1177);
    kv2.insert(kv2.end(), w.begin(), w.end());
    wg_case("seam window", w, kv2, 8, 1, 256, 1, 14);
    // Permutations on both sides.
    {
        std::vector<i64> kp(150), qp(150);
        for (int i = 0; i < 150; ++i) kp[i] = (i * 7919) % 150, qp[i] = (i * 13) % 150;
        wg_case("shuffled", qp, kp, 2, 1, 256, 1, 21);
        wg_case("shuffled split", qp, kp, 2, 1, 128, 3, 22);
    }
    // Queries that see no key at all, keys in reverse order; extreme positions; empty cache.
    wg_case("blind", range(-40, 30), [] { auto r = range(0, 50); std::reverse(r.begin(), r.end()); return r; }(), 2, 1,
            256, 1, 41);
    wg_case("extremes", {INT64_MAX, INT64_MIN, 0, 5}, {INT64_MIN, 3, INT64_MAX, 7, 0}, 2, 1, 256, 1, 42);
    wg_case("empty cache", range(0, 20), {}, 2, 1, 256, 1, 51);
    // Two query tiles, the second with 2 rows (one warpgroup entirely past tq); split KV with
    // more splits than tiles (empty splits).
    wg_case("causal 130", range(0, 130), range(0, 130), 2, 1, 256, 1, 31);
    wg_case("causal 130 split", range(0, 130), range(0, 130), 2, 1, 128, 5, 32);
    // Visible tiles far apart (the tile search crosses a 32-tile window).
    {
        std::vector<i64> kvs = range(0, 64);
        for (int t = 1; t < 39; ++t) {
            auto r = range(10000 + 64 * t, 10000 + 64 * t + 64);
            kvs.insert(kvs.end(), r.begin(), r.end());
        }
        auto tail = range(64, 100);
        kvs.insert(kvs.end(), tail.begin(), tail.end());
        wg_case("sparse tiles", {100, 5000, 30, 63}, kvs, 2, 1, 256, 1, 71);
    }
    // Many visible tiles at HD 128 with a split (the 3-stage ring wraps several times).
    if (!quick) wg_case("causal split", range(0, 700), range(0, 700), 2, 1, 128, 2, 81);
}

int main(int argc, char** argv) {
    const bool eager = getenv("EMU_EAGER_CP") && atoi(getenv("EMU_EAGER_CP"));
    if (getenv("EMU_SMEM_SHIFT")) emu_smem_shift = (unsigned)atoi(getenv("EMU_SMEM_SHIFT"));
    bool quick = false;
    std::string which = "all";
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "quick") quick = true;
        else which = a;
    }
    if (which != "basic" && which != "wg3tmal" && which != "wg3tmalb80" && which != "all") {
        std::fprintf(stderr, "unknown variant '%s' (basic|wg3tmal|wg3tmalb80|all)\n", which.c_str());
        return 2;
    }
    if (which == "basic" || which == "all") {
        g_variant = 0;
        emu.eager_cp = eager;
        all_cases(quick);
    }
    // The producer's copies land at its cp.async.mbarrier.arrive (EMU_EAGER_CP does not apply).
    if (which == "wg3tmal" || which == "all") {
        g_variant = 1;
        emu.eager_cp = false;
        all_cases(quick);
    }
    if (which == "wg3tmalb80" || which == "all") {
        g_variant = 2;
        emu.eager_cp = false;
        all_cases(quick);
    }
    std::printf("%s: %d failure(s); worst rel %.2e, worst max rel %.2e (%ld wgmma emulated)\n",
                g_fail ? "FAILED" : "passed", g_fail, g_worst_rel, g_worst_mrel, emu_wg_count);
    return g_fail ? 1 : 0;
}
