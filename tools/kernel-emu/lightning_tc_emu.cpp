// Runs the tensor-core Lightning prefill (lt_chunk_tc_bf16 of dataplane/kernels/lightning_tc.cu,
// the real source, see run.sh `lightning-tc`) in the host emulator of emu.h, against the
// recurrence S_t = γ_h S_{t−1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t in double precision on the
// same bf16 inputs: outputs and final states within bf16 tolerance at lengths around the
// chunk edges, from a random initial state, for weak and strong decays; a state-only pass
// (o = null) leaves the same final state bit for bit, and the split form (lt_scores_tc_bf16
// then lt_chunk_pre_tc_bf16) gives the fused kernel's output and state bit for bit. The
// two-pass form (lt_states_tc_bf16, then lt_out_tc_bf16) within the same bounds, its
// state-only pass equal to it bit for bit.
#define HYPIC_HOST_EMU
#include "emu.h"

inline unsigned ltc_smem(const void* p) { return fa_smem_u32(p); }
inline void ltc_cp16(unsigned dst, const void* src, bool ok) { fa_cp_async16(dst, src, ok); }
// Exact wait_group semantics (emu.h): a wait that is too weak leaves the chunk's tiles
// stale, and the checks fail.
inline void ltc_cp_commit() { emu_cp_commit_group(); }
inline void ltc_cp_wait_all() { fa_cp_wait_all(); }
template <int N>
inline void ltc_cp_wait() {
    emu_cp_wait_group(N);
}
inline void ltc_ldsm(unsigned* r, unsigned addr) { emu_ldsm(r, addr, false); }
inline void ltc_ldsm_t(unsigned* r, unsigned addr) { emu_ldsm(r, addr, true); }
inline void ltc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const unsigned b[2] = {b0, b1};
    fa_mma(c, a, b);
}
inline unsigned ltc_pack(float lo, float hi) { return fa_pack(lo, hi); }
inline float ltc_lo(unsigned x) { return emu_lo(x); }
inline float ltc_hi(unsigned x) { return emu_hi(x); }

struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

#include "gen_lightning_tc.inc"

#include <cstring>
#include <random>
#include <string>

static int g_fail = 0;

static void check(bool ok, const std::string& what) {
    std::printf("  %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++g_fail;
}

// ‖a − b‖₂ / ‖b‖₂.
static double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
    double n = 0, d = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i])) return NAN;
        d += (a[i] - b[i]) * (a[i] - b[i]);
        n += b[i] * b[i];
    }
    return std::sqrt(d / std::max(n, 1e-300));
}

// max |a − b| / max |b|.
static double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
    double m = 0, d = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i])) return NAN;
        m = std::max(m, std::fabs(b[i]));
        d = std::max(d, std::fabs(a[i] - b[i]));
    }
    return d / std::max(m, 1e-300);
}

static std::vector<bf16> rnd_bf16(size_t n, std::mt19937& r, float lo, float hi) {
    std::uniform_real_distribution<float> U(lo, hi);
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16_rn(U(r));
    return v;
}

enum Form { FUSED, SPLIT, TWO_PASS };

// The fused kernel, the split form (lt_scores_tc_bf16, then lt_chunk_pre_tc_bf16; o
// required) or the two-pass form (lt_states_tc_bf16, then lt_out_tc_bf16 when o is given).
static void run_kernel(int t, int H, const std::vector<bf16>& q, const std::vector<bf16>& k,
                       const std::vector<bf16>& v, const std::vector<float>& ld, float scale,
                       std::vector<float>& st, std::vector<bf16>* o, Form form = FUSED) {
    // A misaligned or short tile read lands outside these buffers' 16-byte pieces; the
    // emulator checks cp.async alignment.
    if (form == TWO_PASS) {
        const int nb = (t + LTC_CB - 1) / LTC_CB;
        // States never written read as NaN.
        std::vector<bf16> hs(o ? (size_t)H * nb * LTC_D * LTC_D : 0, __float2bfloat16_rn(NAN));
        emu_launch(emu_dim3{(unsigned)H, LTC_D / LTC_BV, 1}, 128, LTC_STATES_SMEM, [&] {
            lt_states_tc_bf16(k.data(), v.data(), ld.data(), st.data(), o ? hs.data() : nullptr, t, H);
        });
        if (o)
            emu_launch(emu_dim3{(unsigned)nb, (unsigned)H, 1}, 256, LTC_OUT_SMEM, [&] {
                lt_out_tc_bf16(q.data(), k.data(), v.data(), hs.data(), ld.data(), scale, o->data(), t, H);
            });
        return;
    }
    if (form == FUSED) {
        emu_launch(emu_dim3{(unsigned)H, LTC_D / LTC_BV, 1}, 128, LTC_SMEM, [&] {
            lt_chunk_tc_bf16(q.data(), k.data(), v.data(), ld.data(), scale, st.data(), o ? o->data() : nullptr, t,
                             H);
        });
        return;
    }
    const int nch = (t + LTC_C - 1) / LTC_C;
    // Unwritten fragments (ks > w) hold a NaN pattern: reading one would show.
    std::vector<uint4> pf((size_t)H * nch * 512, uint4{0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u});
    emu_launch(emu_dim3{(unsigned)nch, (unsigned)H, 1}, 128, LTC_SCORES_SMEM,
               [&] { lt_scores_tc_bf16(q.data(), k.data(), ld.data(), scale, pf.data(), t, H); });
    emu_launch(emu_dim3{(unsigned)H, LTC_D / LTC_BV, 1}, 128, LTC_PRE_SMEM, [&] {
        lt_chunk_pre_tc_bf16(q.data(), k.data(), v.data(), pf.data(), ld.data(), scale, st.data(), o->data(), t, H);
    });
}

// Output and final-state errors of one form against the reference, checked.
static void check_form(const char* name, int t, int H, const std::vector<float>& ld, const std::vector<bf16>& o,
                       const std::vector<float>& st, const std::vector<double>& oref, const std::vector<double>& S) {
    std::vector<double> og(o.size()), sg(st.begin(), st.end());
    for (size_t i = 0; i < o.size(); ++i) og[i] = __bfloat162float(o[i]);
    const double eo = rel_l2(og, oref), eo_max = max_rel(og, oref), es = rel_l2(sg, S);
    char buf[240];
    std::snprintf(buf, sizeof buf, "%s t=%d H=%d g=(%.3g, %.3g): output rel L2 %.2e (max %.2e), state rel L2 %.2e",
                  name, t, H, ld[0], ld[H - 1], eo, eo_max, es);
    check(eo < 1.5e-2 && eo_max < 3e-2 && es < 1e-2, buf);
}

static void case_(int t, int H, const std::vector<float>& ld, unsigned seed) {
    const int D = LTC_D;
    std::mt19937 r(seed);
    const float qs = 1.f / std::sqrt((float)D);
    auto q = rnd_bf16((size_t)t * H * D, r, -1.f, 1.f);
    auto k = rnd_bf16((size_t)t * H * D, r, -qs * 1.7f, qs * 1.7f);
    auto v = rnd_bf16((size_t)t * H * D, r, -1.f, 1.f);
    std::vector<float> s0((size_t)H * D * D);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    for (auto& x : s0) x = U(r);
    const float scale = qs;

    // Reference in double on the bf16 inputs.
    std::vector<double> S(s0.begin(), s0.end()), oref((size_t)t * H * D);
    for (int h = 0; h < H; ++h) {
        const double gm = std::exp((double)ld[h]);
        double* Sh = &S[(size_t)h * D * D];
        for (int ti = 0; ti < t; ++ti) {
            const size_t row = (size_t)ti * H + h;
            for (int a = 0; a < D; ++a)
                for (int c = 0; c < D; ++c)
                    Sh[a * D + c] = gm * Sh[a * D + c] +
                                    (double)__bfloat162float(k[row * D + a]) * (double)__bfloat162float(v[row * D + c]);
            for (int c = 0; c < D; ++c) {
                double acc = 0;
                for (int a = 0; a < D; ++a) acc += (double)__bfloat162float(q[row * D + a]) * Sh[a * D + c];
                oref[row * D + c] = scale * acc;
            }
        }
    }

    std::vector<float> st = s0;
    std::vector<bf16> o((size_t)t * H * D, __float2bfloat16_rn(NAN));
    run_kernel(t, H, q, k, v, ld, scale, st, &o);
    check_form("fused", t, H, ld, o, st, oref, S);

    std::vector<float> st2 = s0;
    run_kernel(t, H, q, k, v, ld, scale, st2, nullptr);
    check(std::memcmp(st2.data(), st.data(), st.size() * 4) == 0,
          "t=" + std::to_string(t) + ": state-only pass leaves the same state, bit for bit");

    std::vector<float> st3 = s0;
    std::vector<bf16> o3((size_t)t * H * D, __float2bfloat16_rn(NAN));
    run_kernel(t, H, q, k, v, ld, scale, st3, &o3, SPLIT);
    check(std::memcmp(st3.data(), st.data(), st.size() * 4) == 0 &&
              std::memcmp(o3.data(), o.data(), o.size() * sizeof(bf16)) == 0,
          "t=" + std::to_string(t) + ": split form (scores, then the chunk loop) = fused, bit for bit");

    std::vector<float> st4 = s0;
    std::vector<bf16> o4((size_t)t * H * D, __float2bfloat16_rn(NAN));
    run_kernel(t, H, q, k, v, ld, scale, st4, &o4, TWO_PASS);
    check_form("two-pass", t, H, ld, o4, st4, oref, S);
    std::vector<float> st5 = s0;
    run_kernel(t, H, q, k, v, ld, scale, st5, nullptr, TWO_PASS);
    check(std::memcmp(st5.data(), st4.data(), st4.size() * 4) == 0,
          "t=" + std::to_string(t) + ": two-pass state-only pass (no stored states) leaves the same state, bit for bit");
}

int main() {
    // EMU_EAGER_CP=1: cp.async copies land when issued (with EMU_SCHED=rev|rand, emu.h,
    // a buffer refilled while another warp still reads it shows up).
    emu.eager_cp = std::getenv("EMU_EAGER_CP") && std::atoi(std::getenv("EMU_EAGER_CP"));
    std::printf("lt_chunk_tc_bf16 against the double-precision recurrence\n");
    // ALiBi-like slopes (weak and strong), and a head with a very strong decay.
    const std::vector<float> weak = {-0.0039f, -0.25f};
    const std::vector<float> strong = {-3.0f, -0.7f};
    unsigned seed = 1;
    // EMU_QUICK=1 (the reordered and three-stage runs): the chunk and step edges only.
    const char* quick = std::getenv("EMU_QUICK");
    const bool q = quick && *quick == '1';
    std::vector<int> lens = q ? std::vector<int>{1, 16, 17, 64, 65, 128, 129, 257}
                              : std::vector<int>{1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 333};
    for (int t : lens) case_(t, 2, weak, seed++);
    for (int t : q ? std::vector<int>{17, 130} : std::vector<int>{17, 64, 130, 300}) case_(t, 2, strong, seed++);
    case_(70, 3, {-0.01f, -0.1f, -1.0f}, seed++);
    if (g_fail) {
        std::printf("%d check(s) failed\n", g_fail);
        return 1;
    }
    std::printf("all ok\n");
    return 0;
}
