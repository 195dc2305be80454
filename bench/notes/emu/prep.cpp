// Host emulator of the prep variants sessions 18 and 19 added to gdr_prep7's template (see
// extract.py): runs the kernel's own code (256 std::threads per CTA, immediate cp.async) and
// checks each new flag path bit for bit against the GPU-tested ones on the same inputs:
// - gdr_prep8o (TOUT): A, gam, the normalized bf16 q / k, the fp32 T and the packed T equal
//   gdr_prep8's; T diag(beta) hi / lo equal prep8's T times beta split as p8_pfrag splits it;
// - gdr_prep8to (TIN + TOUT, reading prep8's packed T): everything prep8o writes, equal;
// - gdr_prep8ow / 8tow (TOUT + TW): W equal prep8's, T diag(beta) (in U's bytes) prep8o's, A
//   and gam equal;
// - the prep9 (GVA: one CTA per key head over its value heads) twin of each, equal to prep8's.
// Exit status 0 when every comparison is bitwise equal and nothing is left unwritten.
#include "base.h"
#include "sync.h"
#include "warp.h"
#define GDR_NT 256
#include "h/prep.h"

// One prep run's outputs (poisoned before: NaN floats, 0x7fc0 bf16). U's buffer holds at least
// 64 x 64 floats per (chunk, value head): TW puts T diag(beta) hi + lo there (as cuda.rs sizes it).
struct PO {
    std::vector<float> qn, kn, gam, t, u, tp; std::vector<bf16_t> qnb, knb, w, a;
    PO(size_t nq, size_t chh, int dk, int dv, bool pt_w) :
        qn(nq, NAN), kn(nq, NAN), gam(chh * 64, NAN), t(chh * 64 * 64, NAN), u(chh * 64 * (size_t)std::max(dv, 64), NAN),
        tp(chh * 2560, NAN), qnb(nq, 0x7fc0), knb(nq, 0x7fc0), w(chh * (pt_w ? 2 * 64 * 64 : 64 * (size_t)dk), 0x7fc0),
        a(chh * 64 * 64, 0x7fc0) {}
};

template <class T> static size_t ndiff(const std::vector<T>& x, const std::vector<T>& y, size_t n = 0) {
    if (!n) n = x.size();
    size_t d = 0;
    for (size_t i = 0; i < n; ++i) d += std::memcmp(&x[i], &y[i], sizeof(T)) != 0;
    return d;
}

template <int DK, bool GVA, bool TIN, bool TOUT, bool TW>
void prep_run(int hk, int hv, int dv, const std::vector<i64>& t0, const std::vector<int>& len,
              const std::vector<bf16_t>& q, const std::vector<bf16_t>& k, const std::vector<bf16_t>& v,
              const std::vector<float>& g, const std::vector<bf16_t>& beta, PO& o, float* tp, bool keep_t) {
    const int nch = (int)len.size();
    g_dyn = 1u << 20;
    launch(GVA ? nch * hk : nch * hv, 256, [&] {
        gdr_prep7<DK, true, true, true, GVA, TIN, TOUT, TW>(
            q.data(), k.data(), v.data(), g.data(), beta.data(), t0.data(), len.data(), hk, hv, dv, o.qn.data(),
            o.qnb.data(), o.kn.data(), o.knb.data(), o.gam.data(), keep_t ? o.t.data() : nullptr, o.w.data(),
            TW ? reinterpret_cast<float*>(o.u.data()) : o.u.data(), o.a.data(), tp);
    });
}

template <int DK>
int run(int hk, int hv, int dv, std::vector<int> lens, unsigned seed) {
    std::mt19937 rng(seed); std::normal_distribution<float> nd; std::uniform_real_distribution<float> ud(0.05f, 0.95f);
    std::vector<i64> t0; std::vector<int> len; i64 tok = 0;
    for (int L : lens) { for (int s = 0; s < L; s += 64) { t0.push_back(tok + s); len.push_back(std::min(64, L - s)); } tok += L; }
    const int nch = (int)len.size(); const size_t chh = (size_t)nch * hv, nq = (size_t)tok * hk * DK;
    auto rb = [&](size_t n, float sc) { std::vector<bf16_t> x(n); for (auto& y : x) y = f32_to_bf16(sc * nd(rng)); return x; };
    std::vector<bf16_t> q = rb(nq + 1, 1.f), k = rb(nq + 1, 1.f), v = rb((size_t)tok * hv * dv + 1, 1.f), beta((size_t)tok * hv + 1);
    std::vector<float> g((size_t)tok * hv + 1);
    for (auto& x : beta) x = f32_to_bf16(ud(rng));
    for (auto& x : g) x = -std::log1p(std::exp(-nd(rng))) * 0.3f;  // log-sigmoid scaled: (-inf, 0)
    // the GPU-tested references: prep8 solving (writes the packed T), then the variants
    PO base(nq, chh, DK, dv, false), o(nq, chh, DK, dv, true), to(nq, chh, DK, dv, true), ow(nq, chh, DK, dv, false),
        tow(nq, chh, DK, dv, false);
    prep_run<DK, false, false, false, false>(hk, hv, dv, t0, len, q, k, v, g, beta, base, base.tp.data(), true);
    int bad = 0;
    auto rep = [&](const char* name, size_t d) {
        printf("  %-40s %zu differ%s\n", name, d, d ? "  <- FAIL" : "");
        bad += d != 0;
    };
    // T diag(beta) hi / lo from prep8's T and the inputs' beta, split as p8_pfrag does
    std::vector<bf16_t> ptref(chh * 8192);
    for (int c = 0; c < nch; ++c) for (int h = 0; h < hv; ++h) {
        const size_t cb = (size_t)c * hv + h;
        for (int i = 0; i < 64; ++i) for (int m = 0; m < 64; ++m) {
            const float bm = m < len[c] ? bf(beta[(t0[c] + m) * hv + h]) : 0.f;
            const float x = m <= i ? base.t[cb * 4096 + i * 64 + m] * bm : 0.f;
            const bf16_t hi = f32_to_bf16(x);
            ptref[cb * 8192 + i * 64 + m] = hi;
            ptref[cb * 8192 + 4096 + i * 64 + m] = f32_to_bf16(x - bf(hi));
        }
    }
    auto same_common = [&](const char* tag, const PO& x, bool t_too) {
        char b[96];
        snprintf(b, sizeof b, "%s A", tag); rep(b, ndiff(x.a, base.a));
        snprintf(b, sizeof b, "%s gam", tag); rep(b, ndiff(x.gam, base.gam));
        snprintf(b, sizeof b, "%s q, k (bf16, normalized)", tag); rep(b, ndiff(x.qnb, base.qnb) + ndiff(x.knb, base.knb));
        if (t_too) { snprintf(b, sizeof b, "%s T, packed T", tag); rep(b, ndiff(x.t, base.t) + ndiff(x.tp, base.tp)); }
    };
    for (int gva = 0; gva < 2; ++gva) {
        if (gva && hv == hk) continue;
        printf("prep%d d%d hk%d hv%d dv%d lens", gva ? 9 : 8, DK, hk, hv, dv);
        for (int L : lens) printf(" %d", L);
        printf(":\n");
        PO o(nq, chh, DK, dv, true), to(nq, chh, DK, dv, true), ow(nq, chh, DK, dv, false), tow(nq, chh, DK, dv, false);
        std::vector<float> tpin = base.tp;
        if (gva) {
            prep_run<DK, true, false, true, false>(hk, hv, dv, t0, len, q, k, v, g, beta, o, o.tp.data(), true);
            prep_run<DK, true, true, true, false>(hk, hv, dv, t0, len, q, k, v, g, beta, to, tpin.data(), false);
            prep_run<DK, true, false, true, true>(hk, hv, dv, t0, len, q, k, v, g, beta, ow, ow.tp.data(), true);
            prep_run<DK, true, true, true, true>(hk, hv, dv, t0, len, q, k, v, g, beta, tow, tpin.data(), false);
        } else {
            prep_run<DK, false, false, true, false>(hk, hv, dv, t0, len, q, k, v, g, beta, o, o.tp.data(), true);
            prep_run<DK, false, true, true, false>(hk, hv, dv, t0, len, q, k, v, g, beta, to, tpin.data(), false);
            prep_run<DK, false, false, true, true>(hk, hv, dv, t0, len, q, k, v, g, beta, ow, ow.tp.data(), true);
            prep_run<DK, false, true, true, true>(hk, hv, dv, t0, len, q, k, v, g, beta, tow, tpin.data(), false);
        }
        same_common("o", o, true);
        rep("o T diag(beta) hi / lo", ndiff(o.w, ptref));
        same_common("to", to, false);
        rep("to T diag(beta) hi / lo", ndiff(to.w, ptref));
        same_common("ow", ow, true);
        rep("ow W", ndiff(ow.w, base.w));
        std::vector<bf16_t> pt_ow(chh * 8192), pt_tow(chh * 8192);
        std::memcpy(pt_ow.data(), ow.u.data(), pt_ow.size() * 2);
        std::memcpy(pt_tow.data(), tow.u.data(), pt_tow.size() * 2);
        rep("ow T diag(beta) hi / lo (U's bytes)", ndiff(pt_ow, ptref));
        same_common("tow", tow, false);
        rep("tow W", ndiff(tow.w, base.w));
        rep("tow T diag(beta) hi / lo (U's bytes)", ndiff(pt_tow, ptref));
    }
    return bad;
}

int main() {
    setvbuf(stdout, nullptr, _IONBF, 0);
    const int only = getenv("ONLY") ? atoi(getenv("ONLY")) : -1;
    int bad = 0, idx = 0;
#define RUN(...) if (only < 0 || only == idx) bad += __VA_ARGS__; ++idx
    RUN(run<128>(1, 2, 128, {130}, 1));      // GVA 2: prep9's head loop; a partial chunk
    RUN(run<64>(2, 2, 48, {1, 65}, 2));      // 1-token and ragged chunks, Dv 48
    RUN(run<128>(1, 4, 64, {64}, 3));        // GVA 4
    printf("%s: %d differing comparisons\n", bad ? "FAIL" : "all ok", bad);
    return bad ? 1 : 0;
}
