// g2c_prep8 against g2c_prep on the host (h/kern.h from extract.py): every output written (NaN
// poison), RMS-relative and max-relative differences per output. EMU_TF32_EXACT=1 makes the TF32
// rounding exact (isolates indexing from precision).
#include "h/kern.h"
#include <random>
template <class F> void launch(int grid, F f) {
    for (int b = 0; b < grid; ++b) {
        std::fill(g2c_sm_store, g2c_sm_store + 70000, std::nanf(""));
        std::barrier<> bar(256); g_bar = &bar;
        std::vector<std::barrier<>*> wb; for (int i = 0; i < 8; ++i) { wb.push_back(new std::barrier<>(32)); warp_bar[i] = wb.back(); }
        std::vector<std::thread> th;
        for (int t = 0; t < 256; ++t) th.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& x : th) x.join();
        for (auto* x : wb) delete x;
    }
}
struct Shape { const char* name; int hk, hv, dk, dv; std::vector<int> lens; bool strong; };
int main() {
    std::vector<Shape> cases = {
        {"d128/128 GVA2 T150", 1, 2, 128, 128, {150}, false},
        {"d128/128 T100+1 strong", 1, 1, 128, 128, {100, 1}, true},
        {"d64/48 GVA2 T70", 2, 4, 64, 48, {70}, false},
        {"d48/128 T65 strong", 1, 1, 48, 128, {65}, true},
        {"d128/64 T64+33", 1, 1, 128, 64, {64, 33}, false},
        {"d16/32 T20", 1, 1, 16, 32, {20}, false},
    };
    int bad = 0;
    for (auto& C : cases) {
        std::mt19937 rng(7);
        std::normal_distribution<float> nd;
        std::uniform_real_distribution<float> ud(0.f, 1.f);
        int T = 0; for (int l : C.lens) T += l;
        std::vector<i64> t0; std::vector<int> len;
        { int s = 0; for (int l : C.lens) { for (int c = 0; c < l; c += 64) { t0.push_back(s + c); len.push_back(std::min(64, l - c)); } s += l; } }
        const int chunks = (int)t0.size(), hk = C.hk, hv = C.hv, dk = C.dk, dv = C.dv;
        std::vector<float> q(T * hk * dk), k(T * hk * dk), v(T * hv * dv), g(T * hv * dk), b(T * hv * dk), w(T * hv * dv);
        for (auto* x : {&q, &k}) {
            for (auto& a : *x) a = nd(rng);
            for (int r = 0; r < T * hk; ++r) { float s = 0; for (int c = 0; c < dk; ++c) s += (*x)[r * dk + c] * (*x)[r * dk + c]; s = 1.f / std::sqrt(s); for (int c = 0; c < dk; ++c) (*x)[r * dk + c] *= s; }
        }
        for (auto& a : v) a = nd(rng);
        for (size_t i = 0; i < g.size(); ++i) {
            float z = nd(rng), ls = -std::log1p(std::exp(-z));
            g[i] = !C.strong ? ls : ((i % dk) % 2 == 0 ? 20.f * ls - 10.f : ls / 20.f);
        }
        for (auto& a : b) a = ud(rng);
        for (auto& a : w) a = ud(rng);
        const int ch = chunks * hv;
        const float NaN = std::nanf("");
        std::vector<std::vector<float>> o1, o8;
        for (int which = 0; which < 2; ++which) {
            std::vector<float> u(ch * 64 * dv, NaN), wm(ch * 64 * dk, NaN), qg(ch * 64 * dk, NaN), kd(ch * 64 * dk, NaN), a(ch * 64 * 64, NaN), egl(ch * dk, NaN), t(ch * 64 * 64, NaN);
            launch(ch, [&] {
                if (which == 0) g2c_prep<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), t0.data(), len.data(), hk, hv, dk, dv, u.data(), wm.data(), qg.data(), kd.data(), a.data(), egl.data(), t.data());
                else g2c_prep8<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), t0.data(), len.data(), hk, hv, dk, dv, u.data(), wm.data(), qg.data(), kd.data(), a.data(), egl.data(), t.data());
            });
            (which ? o8 : o1) = {u, wm, qg, kd, a, egl, t};
        }
        const char* names[] = {"u", "wm", "qg", "kd", "a", "egl", "t"};
        printf("%-26s", C.name);
        for (int f = 0; f < 7; ++f) {
            double num = 0, den = 0, mx = 0, mr = 0; long nonfin = 0;
            for (size_t i = 0; i < o1[f].size(); ++i) {
                const double x = o8[f][i], r = o1[f][i];
                if (!std::isfinite(x) || !std::isfinite(r)) { ++nonfin; continue; }
                num += (x - r) * (x - r); den += r * r; mx = std::max(mx, std::fabs(x - r)); mr = std::max(mr, std::fabs(r));
            }
            const double rms = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
            printf(" %s=%.1e/%.1e%s", names[f], rms, mr > 0 ? mx / mr : mx, nonfin ? " NONFINITE" : "");
            if (nonfin || !(rms <= 2e-5)) ++bad;
        }
        printf("\n");
    }
    printf("%s\n", bad ? "FAIL" : "ok");
    return bad != 0;
}
