#include "h/kern.h"
#include <type_traits>
template <class T> std::vector<T> rd(const std::string& n) {
    FILE* f = fopen(("h/" + n + ".bin").c_str(), "rb"); if (!f) { fprintf(stderr, "no %s\n", n.c_str()); exit(1); }
    fseek(f, 0, SEEK_END); long sz = ftell(f); fseek(f, 0, SEEK_SET);
    std::vector<T> v(sz / sizeof(T)); if (fread(v.data(), 1, sz, f) != (size_t)sz) exit(2); fclose(f); return v;
}
template <class T> void wr(const std::string& n, const std::vector<T>& v) {
    FILE* f = fopen(("h/out_" + n + ".bin").c_str(), "wb"); fwrite(v.data(), sizeof(T), v.size(), f); fclose(f);
}
template <class F> void launch(int grid, F f) {
    for (int b = 0; b < grid; ++b) {
        std::barrier<> bar(256); g_bar = &bar;
        std::vector<std::barrier<>*> wb; for (int i = 0; i < 8; ++i) { wb.push_back(new std::barrier<>(32)); warp_bar[i] = wb.back(); }
        std::vector<std::thread> th;
        for (int t = 0; t < 256; ++t) th.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& x : th) x.join();
        for (auto* x : wb) delete x;
    }
}
template <class F> void launch_n(int grid, int nt, F f) {
    for (int b = 0; b < grid; ++b) {
        std::memset(g2c_sm_store, 0xff, sizeof(g2c_sm_store));
        std::barrier<> bar(nt); g_bar = &bar;
        std::vector<std::barrier<>*> wb; for (int i = 0; i < nt / 32; ++i) { wb.push_back(new std::barrier<>(32)); warp_bar[i] = wb.back(); }
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t) th.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& x : th) x.join();
        for (auto* x : wb) delete x;
    }
}
// Backward v5 (h-g2g4): g2f_fwd8 with HREC (h, D) and g2b_dscan8 at width NW, Dk DK.
template <int DK, int NW> void v5_scans(int grid, const bf16_t* wm, const bf16_t* qg, const bf16_t* kt, const bf16_t* a, const float* u, const float* egl, const bf16_t* dob, const i64* chf, const i64* t0, const int* len, int hv, int dv, float scale, const float* h0, const float* dht, bf16_t* h_, bf16_t* d_, bf16_t* dh_, bf16_t* dd_, float* dh0) {
    constexpr int NS = (DK == 128 && NW <= 2) ? 3 : 2;
    launch_n(grid, 32 * NW, [&] { g2f_fwd8<DK, NW, NS, false, true>(wm, qg, kt, a, u, egl, chf, t0, len, hv, dv, 1.f, h0, nullptr, nullptr, h_, d_); });
    launch_n(grid, 32 * NW, [&] { g2b_dscan8<DK, NW, NS>(kt, a, qg, wm, egl, dob, chf, t0, len, hv, dv, scale, dht, dh_, dd_, dh0); });
}
int main() {
    auto dims = rd<int>("dims");
    int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], nseq = dims[4], chunks = dims[5], tokens = dims[6], has_dht = dims[7];
    float scale = rd<float>("scale")[0];
    auto q = rd<float>("q"), k = rd<float>("k"), v = rd<float>("v"), g = rd<float>("g"), b = rd<float>("b"), w = rd<float>("w"), d_o = rd<float>("do");
    auto chf = rd<i64>("chf"), t0 = rd<i64>("t0"); auto len = rd<int>("len");
    auto kd = rd<float>("ws_kd"), a = rd<float>("ws_a"), qg = rd<float>("ws_qg"), wm = rd<float>("ws_wm"), egl = rd<float>("ws_egl");
    auto hh = rd<float>("ws_h"), dd_ = rd<float>("ws_d"), tt = rd<float>("ws_t"), dht = rd<float>("dht");
    const float NaN = std::nanf("");
    int ch = chunks * hv;
    auto chain_impl = [&](const std::string& pre, std::vector<float>& kd_c, std::vector<float>& a_c, std::vector<float>& qg_c, std::vector<float>& wm_c, std::vector<float>& egl_c, std::vector<float>& hh_c, std::vector<float>& dd_c, std::vector<float>& tt_c) {
    std::vector<float> ws_dh(ch * dk * dv, NaN), ws_dd(ch * 64 * dv, NaN), dh0(nseq * hv * dk * dv, NaN);
    int bv = dv % 32 == 0 ? 32 : 16;
    launch(nseq * hv * (dv / bv), [&] {
        if (std::getenv("EMU_V2")) {
            if (bv == 32) g2b_dscan_pp<32, float>(kd_c.data(), a_c.data(), qg_c.data(), wm_c.data(), egl_c.data(), d_o.data(), chf.data(), t0.data(), len.data(), hv, dk, dv, scale, has_dht ? dht.data() : nullptr, ws_dh.data(), ws_dd.data(), dh0.data());
            else g2b_dscan_pp<16, float>(kd_c.data(), a_c.data(), qg_c.data(), wm_c.data(), egl_c.data(), d_o.data(), chf.data(), t0.data(), len.data(), hv, dk, dv, scale, has_dht ? dht.data() : nullptr, ws_dh.data(), ws_dd.data(), dh0.data());
        } else if (bv == 32) g2b_dscan<32, float>(kd_c.data(), a_c.data(), qg_c.data(), wm_c.data(), egl_c.data(), d_o.data(), chf.data(), t0.data(), len.data(), hv, dk, dv, scale, has_dht ? dht.data() : nullptr, ws_dh.data(), ws_dd.data(), dh0.data());
        else g2b_dscan<16, float>(kd_c.data(), a_c.data(), qg_c.data(), wm_c.data(), egl_c.data(), d_o.data(), chf.data(), t0.data(), len.data(), hv, dk, dv, scale, has_dht ? dht.data() : nullptr, ws_dh.data(), ws_dd.data(), dh0.data());
    });
    std::vector<float> ws_g(ch * 4 * 64 * dk, NaN), dqs(tokens * hv * dk, NaN), dks(tokens * hv * dk, NaN), dvo(tokens * hv * dv, NaN), dwo(tokens * hv * dv, NaN), dg(tokens * hv * dk, NaN), db(tokens * hv * dk, NaN);
    launch(ch, [&] {
        if (std::getenv("EMU_V4")) g2b_grad4<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, hh_c.data(), dd_c.data(), ws_dh.data(), ws_dd.data(), tt_c.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data());
        else if (std::getenv("EMU_V3")) g2b_grad3<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, hh_c.data(), dd_c.data(), ws_dh.data(), ws_dd.data(), tt_c.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data());
        else if (std::getenv("EMU_V2")) g2b_grad2<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, hh_c.data(), dd_c.data(), ws_dh.data(), ws_dd.data(), tt_c.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data());
        else if (std::getenv("EMU_TC")) g2b_grad<true, float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, hh_c.data(), dd_c.data(), ws_dh.data(), ws_dd.data(), tt_c.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data());
        else g2b_grad<false, float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, hh_c.data(), dd_c.data(), ws_dh.data(), ws_dd.data(), tt_c.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data());
    });
    wr(pre + "dh0", dh0); wr(pre + "dqs", dqs); wr(pre + "dks", dks); wr(pre + "dv", dvo); wr(pre + "dw", dwo); wr(pre + "dg", dg); wr(pre + "db", db); wr(pre + "ws_dh", ws_dh); wr(pre + "ws_dd", ws_dd);
    };
    auto chain = [&](std::vector<float>& a1, std::vector<float>& a2, std::vector<float>& a3, std::vector<float>& a4, std::vector<float>& a5, std::vector<float>& a6, std::vector<float>& a7, std::vector<float>& a8) { chain_impl("c_", a1, a2, a3, a4, a5, a6, a7, a8); };
    auto rd_h0 = rd<float>("h0");
    {
        // g2c_prep (the forward's) with the T output, compared with the model by drive.py.
        std::vector<float> u(ch * 64 * dv, NaN), wm_(ch * 64 * dk, NaN), qg_(ch * 64 * dk, NaN), kd_(ch * 64 * dk, NaN), a_(ch * 64 * 64, NaN), egl_(ch * dk, NaN), t_(ch * 64 * 64, NaN);
        launch(ch, [&] {
            g2c_prep<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), t0.data(), len.data(), hk, hv, dk, dv, u.data(), wm_.data(), qg_.data(), kd_.data(), a_.data(), egl_.data(), t_.data());
        });
        // The whole chain on the emulated workspaces: g2c_scan (BV as cuda.rs's scan_bv), then
        // g2b_dscan and g2b_grad below on its h and D (outputs "c_*").
        std::vector<float> h_(ch * dk * dv, NaN), d_(ch * 64 * dv, NaN);
        const int sbv = dv % 32 == 0 ? 32 : 16;
        launch(nseq * hv * (dv / sbv), [&] {
            if (sbv == 32) g2c_scan_f(u.data(), wm_.data(), kd_.data(), egl_.data(), chf.data(), hv, dk, dv, has_dht ? rd_h0.data() : nullptr, h_.data(), d_.data(), nullptr);
            else g2c_scan<16>(u.data(), wm_.data(), kd_.data(), egl_.data(), chf.data(), hv, dk, dv, has_dht ? rd_h0.data() : nullptr, h_.data(), d_.data(), nullptr);
        });
        wr("p_ws_h", h_); wr("p_ws_d", d_);
        chain(kd_, a_, qg_, wm_, egl_, h_, d_, t_);
        wr("p_ws_wm", wm_); wr("p_ws_qg", qg_); wr("p_ws_kd", kd_); wr("p_ws_a", a_); wr("p_ws_egl", egl_); wr("p_ws_t", t_);
    }
    if (std::getenv("EMU_V5") && (dk == 64 || dk == 128) && dv % 16 == 0 && chunks > 0) {
        // Backward v5: g2c_prep8 (bf16 Wm, Qg, Kd^T, A; fp32 U, e^Gam_L, T) -> g2f_fwd8<HREC> (h, D)
        // -> g2b_dscan8 (dh, dD, dh0) -> g2b_grad4<bf16 workspaces>; its outputs replace "c_*".
        const bf16_t BN = 0xffff;
        std::vector<float> u(ch * 64 * dv, NaN), egl_(ch * dk, NaN), t_(ch * 64 * 64, NaN);
        std::vector<bf16_t> wm_(ch * 64 * dk, BN), qg_(ch * 64 * dk, BN), kt_(ch * 64 * dk, BN), a_(ch * 64 * 64, BN);
        launch(ch, [&] { g2c_prep8<float, float, bf16_t>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), t0.data(), len.data(), hk, hv, dk, dv, u.data(), wm_.data(), qg_.data(), kt_.data(), a_.data(), egl_.data(), t_.data()); });
        int nw = dv % 32 == 0 ? 2 : 1;
        if (const char* e = std::getenv("EMU_NW")) {
            const int f = std::atoi(e);
            if ((f == 1 || f == 2 || f == 4 || f == 8) && dv % (16 * f) == 0) nw = f;
        }
        std::vector<bf16_t> h_(ch * dk * dv, BN), d_(ch * 64 * dv, BN), dh_(ch * dk * dv, BN), dd_(ch * 64 * dv, BN), dob(d_o.size());
        for (size_t i = 0; i < d_o.size(); ++i) dob[i] = f32_to_bf16(d_o[i]);
        std::vector<float> dh0(nseq * hv * dk * dv, NaN);
        const int grid = nseq * hv * (dv / (16 * nw));
        const float* h0p = has_dht ? rd_h0.data() : nullptr;
        const float* dhtp = has_dht ? dht.data() : nullptr;
        auto go = [&](auto dkc, auto nwc) { v5_scans<decltype(dkc)::value, decltype(nwc)::value>(grid, wm_.data(), qg_.data(), kt_.data(), a_.data(), u.data(), egl_.data(), dob.data(), chf.data(), t0.data(), len.data(), hv, dv, scale, h0p, dhtp, h_.data(), d_.data(), dh_.data(), dd_.data(), dh0.data()); };
        using I64 = std::integral_constant<int, 64>; using I128 = std::integral_constant<int, 128>;
        using W1 = std::integral_constant<int, 1>; using W2 = std::integral_constant<int, 2>;
        using W4 = std::integral_constant<int, 4>; using W8 = std::integral_constant<int, 8>;
        if (dk == 64) { if (nw == 1) go(I64{}, W1{}); else if (nw == 2) go(I64{}, W2{}); else if (nw == 4) go(I64{}, W4{}); else go(I64{}, W8{}); }
        else { if (nw == 1) go(I128{}, W1{}); else if (nw == 2) go(I128{}, W2{}); else if (nw == 4) go(I128{}, W4{}); else go(I128{}, W8{}); }
        std::vector<float> ws_g(ch * 4 * 64 * dk, NaN), dqs(tokens * hv * dk, NaN), dks(tokens * hv * dk, NaN), dvo(tokens * hv * dv, NaN), dwo(tokens * hv * dv, NaN), dg(tokens * hv * dk, NaN), db(tokens * hv * dk, NaN);
        launch(ch, [&] { g2b_grad4<float, float, bf16_t>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, h_.data(), d_.data(), dh_.data(), dd_.data(), t_.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data()); });
        auto f32v = [](const std::vector<bf16_t>& x) { std::vector<float> y(x.size()); for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_f32(x[i]); return y; };
        wr("c_dh0", dh0); wr("c_dqs", dqs); wr("c_dks", dks); wr("c_dv", dvo); wr("c_dw", dwo); wr("c_dg", dg); wr("c_db", db); wr("c_ws_dh", f32v(dh_)); wr("c_ws_dd", f32v(dd_));
        wr("p_ws_h", f32v(h_)); wr("p_ws_d", f32v(d_)); wr("p_ws_t", t_);
    }
    chain_impl("", kd, a, qg, wm, egl, hh, dd_, tt);
    return 0;
}
