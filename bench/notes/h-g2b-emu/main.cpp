#include "h/kern.h"
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
        std::vector<std::thread> th;
        for (int t = 0; t < 256; ++t) th.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& x : th) x.join();
    }
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
    std::vector<float> ws_dh(ch * dk * dv, NaN), ws_dd(ch * 64 * dv, NaN), dh0(nseq * hv * dk * dv, NaN);
    int bv = dv % 32 == 0 ? 32 : 16;
    launch(nseq * hv * (dv / bv), [&] {
        if (bv == 32) g2b_dscan<32, float>(kd.data(), a.data(), qg.data(), wm.data(), egl.data(), d_o.data(), chf.data(), t0.data(), len.data(), hv, dk, dv, scale, has_dht ? dht.data() : nullptr, ws_dh.data(), ws_dd.data(), dh0.data());
        else g2b_dscan<16, float>(kd.data(), a.data(), qg.data(), wm.data(), egl.data(), d_o.data(), chf.data(), t0.data(), len.data(), hv, dk, dv, scale, has_dht ? dht.data() : nullptr, ws_dh.data(), ws_dd.data(), dh0.data());
    });
    std::vector<float> ws_g(ch * 4 * 64 * dk, NaN), dqs(tokens * hv * dk, NaN), dks(tokens * hv * dk, NaN), dvo(tokens * hv * dv, NaN), dwo(tokens * hv * dv, NaN), dg(tokens * hv * dk, NaN), db(tokens * hv * dk, NaN);
    launch(ch, [&] {
        g2b_grad<float, float>(q.data(), k.data(), v.data(), g.data(), b.data(), w.data(), d_o.data(), t0.data(), len.data(), hk, hv, dk, dv, scale, hh.data(), dd_.data(), ws_dh.data(), ws_dd.data(), tt.data(), ws_g.data(), dqs.data(), dks.data(), dvo.data(), dwo.data(), dg.data(), db.data());
    });
    wr("dh0", dh0); wr("dqs", dqs); wr("dks", dks); wr("dv", dvo); wr("dw", dwo); wr("dg", dg); wr("db", db); wr("ws_dh", ws_dh); wr("ws_dd", ws_dd);
    return 0;
}
