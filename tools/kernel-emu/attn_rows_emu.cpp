// Runs the batched decode-attention kernels — kv_append_rows_*, attn_decode_rows_bf16_*
// and attn_decode_combine_rows_bf16 of dataplane/kernels/attn.cu, the real source (run.sh
// `attn-rows`) — in the host emulator of emu.h, against the one-sequence kernels they
// batch, run sequence by sequence on separate buffers: kv_append_dev_*, then
// attn_decode_dev_bf16_* over a grid sized for the cache's capacity (the CUDA-graph
// form) and attn_decode_bf16_* over the plan's splits (the eager form), each with its
// combine. Outputs and caches must be equal bit for bit.
#include "emu.h"

struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
inline void __trap() {
    std::fprintf(stderr, "__trap\n");
    std::abort();
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return float2{__bfloat162float(h.x), __bfloat162float(h.y)};
}

#include "gen_attn_rows.inc"

#include <cstring>
#include <random>
#include <string>

static int g_fail = 0;

static void check(bool ok, const std::string& what) {
    std::printf("  %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++g_fail;
}

static std::vector<bf16> rnd(size_t n, unsigned seed, float lo, float hi) {
    std::mt19937 r(seed);
    std::uniform_real_distribution<float> U(lo, hi);
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16_rn(U(r));
    return v;
}

template <typename T>
static bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Launch over a 3-D grid (emu_launch covers x and y; z by repeated launches).
static void launch3(emu_dim3 g, unsigned threads, size_t dyn, std::function<void()> k) {
    for (unsigned z = 0; z < std::max(1u, g.z); ++z)
        emu_launch(emu_dim3{g.x, g.y, 1}, threads, dyn, [&, z] {
            blockIdx.z = z;
            gridDim.z = g.z;
            k();
        });
}

static int plan(int n) { return std::max(1, std::min((n + 63) / 64, 128)); }

struct Cache {
    std::vector<bf16> k, v;
    std::vector<i64> p;
    int len, cap;
};

using DecodeFn = void (*)(const bf16*, const i64*, const bf16*, const bf16*, const i64*, float*, float*, int, int,
                          int, float);
using DecodeDevFn = void (*)(const bf16*, const i64*, const bf16*, const bf16*, const i64*, float*, float*,
                             const int*, int, int, float);
using DecodeRowsFn = void (*)(const bf16*, const i64*, const unsigned long long*, const int*, float*, float*, int,
                              int, float, int, int);

// One case: sequences with the given lengths before the step and capacities.
template <int HD>
static void attn_case(const char* name, const std::vector<int>& lens, const std::vector<int>& caps, int nh, int nkv,
                      DecodeFn eager, DecodeDevFn dev, DecodeRowsFn rows) {
    const int bsz = (int)lens.size(), row = nkv * HD, G = nh / nkv;
    const float scale_log2 = 1.f / std::sqrt((float)HD) * 1.4426950408889634f;
    auto q = rnd((size_t)bsz * nh * HD, 1, -1.f, 1.f);
    auto kn = rnd((size_t)bsz * row, 2, -1.f, 1.f), vn = rnd((size_t)bsz * row, 3, -1.f, 1.f);
    std::vector<i64> qpos(bsz);
    std::vector<Cache> one, many;
    for (int b = 0; b < bsz; ++b) {
        Cache c{rnd((size_t)caps[b] * row, 10 + b, -1.f, 1.f), rnd((size_t)caps[b] * row, 40 + b, -1.f, 1.f),
                std::vector<i64>(caps[b]), lens[b], caps[b]};
        // Positions out of order, a few in the query's future (masked), as a PIC composition has.
        for (int j = 0; j < caps[b]; ++j) c.p[j] = (i64)((j * 37 + b * 11) % (lens[b] + 5));
        qpos[b] = lens[b] + 1;
        one.push_back(c);
        many.push_back(c);
    }
    std::vector<int> n_after(bsz);
    for (int b = 0; b < bsz; ++b) n_after[b] = lens[b] + 1;
    // One sequence at a time: the append, then the graph form and the eager form.
    std::vector<bf16> o_dev((size_t)bsz * nh * HD), o_eager((size_t)bsz * nh * HD);
    for (int b = 0; b < bsz; ++b) {
        Cache& c = one[b];
        const int n = n_after[b];
        emu_launch(emu_dim3{(unsigned)std::min((row + 255) / 256, 64), 1, 1}, 256, 0, [&] {
            kv_append_dev_bf16(&kn[(size_t)b * row], &vn[(size_t)b * row], &qpos[b], c.k.data(), c.v.data(),
                               c.p.data(), &n, row);
        });
        const int sd = plan(c.cap);
        std::vector<float> wo((size_t)sd * nh * HD), wml((size_t)sd * nh * 2);
        emu_launch(emu_dim3{(unsigned)nkv, (unsigned)sd, 1}, 32 * G, 0, [&] {
            dev(&q[(size_t)b * nh * HD], &qpos[b], c.k.data(), c.v.data(), c.p.data(), wo.data(), wml.data(), &n, nh,
                nkv, scale_log2);
        });
        emu_launch(emu_dim3{(unsigned)nh, 1, 1}, HD, 128 * 4, [&] {
            attn_decode_combine_dev_bf16(wo.data(), wml.data(), &o_dev[(size_t)b * nh * HD], nh, HD, &n);
        });
        const int se = plan(n);
        std::vector<float> wo2((size_t)se * nh * HD), wml2((size_t)se * nh * 2);
        emu_launch(emu_dim3{(unsigned)nkv, (unsigned)se, 1}, 32 * G, 0, [&] {
            eager(&q[(size_t)b * nh * HD], &qpos[b], c.k.data(), c.v.data(), c.p.data(), wo2.data(), wml2.data(), n,
                  nh, nkv, scale_log2);
        });
        emu_launch(emu_dim3{(unsigned)nh, 1, 1}, HD, se * 4, [&] {
            attn_decode_combine_bf16(wo2.data(), wml2.data(), &o_eager[(size_t)b * nh * HD], nh, HD, se);
        });
    }
    // All sequences in one launch each.
    // The graph's sizing: grid and packed workspace from the capacities.
    std::vector<unsigned long long> tbl(3 * bsz);
    int S = 1, total = 0;
    for (int b = 0; b < bsz; ++b) {
        tbl[b] = (unsigned long long)(uintptr_t)many[b].k.data();
        tbl[bsz + b] = (unsigned long long)(uintptr_t)many[b].v.data();
        tbl[2 * bsz + b] = (unsigned long long)(uintptr_t)many[b].p.data();
        S = std::max(S, plan(many[b].cap));
        total += plan(many[b].cap);
    }
    emu_launch(emu_dim3{(unsigned)std::min((row + 255) / 256, 64), (unsigned)bsz, 1}, 256, 0, [&] {
        kv_append_rows_bf16(kn.data(), vn.data(), qpos.data(), tbl.data(), n_after.data(), row, bsz);
    });
    std::vector<float> wo((size_t)total * nh * HD, 7.f), wml((size_t)total * nh * 2, 7.f);
    launch3(emu_dim3{(unsigned)nkv, (unsigned)S, (unsigned)bsz}, 32 * G, 0, [&] {
        rows(q.data(), qpos.data(), tbl.data(), n_after.data(), wo.data(), wml.data(), nh, nkv, scale_log2, bsz,
             total);
    });
    std::vector<bf16> o_rows((size_t)bsz * nh * HD, __float2bfloat16_rn(7.f));
    emu_launch(emu_dim3{(unsigned)nh, (unsigned)bsz, 1}, HD, 128 * 4, [&] {
        attn_decode_combine_rows_bf16(wo.data(), wml.data(), o_rows.data(), nh, HD, n_after.data(), total);
    });
    bool caches = true;
    for (int b = 0; b < bsz; ++b)
        caches = caches && same_bits(one[b].k, many[b].k) && same_bits(one[b].v, many[b].v) &&
                 same_bits(one[b].p, many[b].p);
    std::string what = std::string(name) + ", " + std::to_string(bsz) + " sequences";
    // Every sequence's output is finite and not zero (a check of equal zeros proves nothing).
    bool live = true;
    for (int b = 0; b < bsz; ++b) {
        float mx = 0.f;
        for (int i = 0; i < nh * HD; ++i) {
            const float x = __bfloat162float(o_dev[(size_t)b * nh * HD + i]);
            live = live && std::isfinite(x);
            mx = std::max(mx, std::fabs(x));
        }
        live = live && mx > 0.f;
    }
    check(live, what + ": every sequence's reference output is finite and non-zero");
    check(same_bits(o_dev, o_eager), what + ": one-sequence graph form = eager form (bitwise)");
    check(same_bits(o_rows, o_dev), what + ": batched outputs = one-sequence kernels per row (bitwise)");
    check(caches, what + ": batched KV append = one-sequence append per row (bitwise)");
}

int main() {
    std::printf("kv_append_rows_bf16 + attn_decode_rows_bf16_* + attn_decode_combine_rows_bf16 against the one-sequence "
                "kernels\n");
    // Lengths before the step; capacities ≥ length + 1. 1 key, one split, several
    // splits, a capacity with more splits than the length needs.
    attn_case<128>("hd 128, 4 heads / 2 kv heads", {0, 70, 150, 5}, {16, 80, 160, 300}, 4, 2, attn_decode_bf16_128,
                   attn_decode_dev_bf16_128, attn_decode_rows_bf16_128);
    attn_case<256>("hd 256, 2 heads / 1 kv head", {40, 130}, {64, 131}, 2, 1, attn_decode_bf16_256,
                   attn_decode_dev_bf16_256, attn_decode_rows_bf16_256);
    // The largest group (8 query heads per kv head) and a cache past the plan's cap of
    // 128 splits (8192 keys), beside a short one: packed ranges of very different sizes.
    if (!std::getenv("EMU_QUICK"))
        attn_case<128>("hd 128, 8 heads / 1 kv head, 8.3k keys", {3, 8300}, {16, 8320}, 8, 1, attn_decode_bf16_128,
                       attn_decode_dev_bf16_128, attn_decode_rows_bf16_128);
    if (g_fail) {
        std::printf("%d check(s) FAILED\n", g_fail);
        return 1;
    }
    std::printf("all checks passed\n");
    return 0;
}
