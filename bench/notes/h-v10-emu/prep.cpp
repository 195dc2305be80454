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
#include <barrier>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>
typedef long long i64;
typedef unsigned short bf16_t;
struct D3 { int x; };
thread_local D3 threadIdx, blockIdx;
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __CUDA_ARCH__ 900
#define GDR_C 64
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
alignas(16) float gdr_smem[232448 / 4];
unsigned g_dyn;
inline unsigned dyn_smem_bytes() { return g_dyn; }
inline unsigned smem_addr(const void* p) { return (unsigned)((const char*)p - (const char*)gdr_smem); }
inline void cp_async16_s(unsigned dst, const void* src, unsigned n) {
    if (n) std::memcpy((char*)gdr_smem + dst, src, 16); else std::memset((char*)gdr_smem + dst, 0, 16);
}
inline void cp_async16(void* dst, const void* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}
template <int N> inline void cp_async_wait_group() {}
std::barrier<>* g_block; std::barrier<>* g_pair[8]; std::barrier<>* g_warp[16];
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline void pair_bar(int id) { g_pair[id]->arrive_and_wait(); }
inline float bf(bf16_t x) { unsigned u = (unsigned)x << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float bf16_to_f32(bf16_t x) { return bf(x); }
inline bf16_t f32_to_bf16(float f) { unsigned u; std::memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); return (bf16_t)(u >> 16); }
inline unsigned pack_bf16(float lo, float hi) { return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16); }
inline void st_ws(float* p, i64 i, float v) { p[i] = v; }
inline void st_ws(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
struct WX { const void* addr[32]; unsigned sa[32]; float fx[32]; unsigned a[32][4], b[32][2]; };
WX g_wx[16];
inline void wbar() { g_warp[threadIdx.x >> 5]->arrive_and_wait(); }
inline void __syncwarp() { wbar(); }
inline void ldsm_x4(unsigned (&r)[4], const void* p) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.addr[l] = p; wbar();
    for (int m = 0; m < 4; ++m) r[m] = ((const unsigned*)W.addr[8 * m + g])[t];
    wbar();
}
inline void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.addr[l] = p; wbar();
    for (int m = 0; m < 4; ++m) {
        const bf16_t* r0 = (const bf16_t*)W.addr[8 * m + 2 * t];
        const bf16_t* r1 = (const bf16_t*)W.addr[8 * m + 2 * t + 1];
        r[m] = (unsigned)r0[g] | ((unsigned)r1[g] << 16);
    }
    wbar();
}
// stmatrix.m8n8.x4.trans: lanes 8m .. 8m + 7 give the shared addresses of matrix m's 8 rows;
// register m of lane (g, t) holds elements (g, 2t), (g, 2t + 1), stored at (2t, g), (2t + 1, g).
inline void stsm_x4_t(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.sa[l] = a; wbar();
    const unsigned r[4] = {r0, r1, r2, r3};
    for (int m = 0; m < 4; ++m) {
        bf16_t* p0 = (bf16_t*)((char*)gdr_smem + W.sa[8 * m + 2 * t]);
        bf16_t* p1 = (bf16_t*)((char*)gdr_smem + W.sa[8 * m + 2 * t + 1]);
        p0[g] = (bf16_t)(r[m] & 0xffffu);
        p1[g] = (bf16_t)(r[m] >> 16);
    }
    wbar();
}
inline void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) W.a[l][i] = a[i];
    W.b[l][0] = b0; W.b[l][1] = b1; wbar();
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; ++L) {
        const int gg = L >> 2, tt = L & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = gg + 8 * (i & 1), k = 2 * tt + 8 * (i >> 1);
            A[row][k] = bf(W.a[L][i] & 0xffff); A[row][k + 1] = bf(W.a[L][i] >> 16);
        }
        for (int i = 0; i < 2; ++i) {
            const int k = 2 * tt + 8 * i;
            B[k][gg] = bf(W.b[L][i] & 0xffff); B[k + 1][gg] = bf(W.b[L][i] >> 16);
        }
    }
    wbar();
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double s = 0; for (int k = 0; k < 16; ++k) s += (double)A[row][k] * B[k][col];
        c[i] = (float)(c[i] + s);
    }
}
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float ld(const bf16_t* p, i64 i) { return bf(p[i]); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31;
    W.fx[l] = v; wbar(); const float r = W.fx[l ^ m]; wbar(); return r;
}
// stmatrix.m8n8.x4 (not transposed): lanes 8m .. 8m + 7 give the addresses of matrix m's rows;
// register m of lane (g, t) holds row g's elements 2t, 2t + 1 (4 bytes at row address + 4t).
inline void stsm_x4(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.sa[l] = a; wbar();
    const unsigned r[4] = {r0, r1, r2, r3};
    for (int m = 0; m < 4; ++m) std::memcpy((char*)gdr_smem + W.sa[8 * m + g] + 4 * t, &r[m], 4);
    wbar();
}
#define GDR_NT 256
#include "h/prep.h"

template <class F> void launch(int grid, int nt, F f) {
    for (int b = 0; b < grid; ++b) {
        std::barrier<> blk(nt); g_block = &blk;
        std::vector<std::barrier<>*> wb;
        for (int i = 0; i < nt / 32; ++i) { wb.push_back(new std::barrier<>(32)); g_warp[i] = wb.back(); }
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t) th.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& x : th) x.join();
        for (auto* x : wb) delete x;
    }
}

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
