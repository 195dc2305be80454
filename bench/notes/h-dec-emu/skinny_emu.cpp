// Host emulator of ops/linear/skinny.cu (issue 14, branch h-dec): the kernel's index arithmetic
// (fragment loads with the in-step k permutation, row / token clamps, in-CTA k ranges, split-K
// partial layout and the last CTA's ordered sum) run per (CTA, warp, lane) on the CPU, with a
// scalar model of mma.sync.m16n8k16.row.col (fragment layouts from the PTX ISA), against a plain
// double-precision y = x W^T of the same bf16 values. Build: g++ -O2 -std=c++17 skinny_emu.cpp.
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>
#include <cstring>
#include <algorithm>

static float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
struct U4 { uint32_t w[4]; };
static U4 ld8(const std::vector<uint16_t>& a, long long i) {  // 8 bf16 at a[i..i+8)
    U4 r; for (int j = 0; j < 4; j++) r.w[j] = a[i + 2 * j] | ((uint32_t)a[i + 2 * j + 1] << 16); return r;
}
static float lo(uint32_t v) { return bf(v & 0xffff); }
static float hi(uint32_t v) { return bf(v >> 16); }

// One warp-wide mma: A regs a[lane][4], B regs b[lane][2], D d[lane][4] (PTX ISA fragment layouts).
static void mma(float d[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        int g = l >> 2, t = l & 3;
        A[g][2 * t] = lo(a[l][0]); A[g][2 * t + 1] = hi(a[l][0]);
        A[g + 8][2 * t] = lo(a[l][1]); A[g + 8][2 * t + 1] = hi(a[l][1]);
        A[g][2 * t + 8] = lo(a[l][2]); A[g][2 * t + 9] = hi(a[l][2]);
        A[g + 8][2 * t + 8] = lo(a[l][3]); A[g + 8][2 * t + 9] = hi(a[l][3]);
        B[2 * t][g] = lo(b[l][0]); B[2 * t + 1][g] = hi(b[l][0]);
        B[2 * t + 8][g] = lo(b[l][1]); B[2 * t + 9][g] = hi(b[l][1]);
    }
    float D[16][8];
    for (int i = 0; i < 16; i++) for (int j = 0; j < 8; j++) { float s = 0; for (int k = 0; k < 16; k++) s += A[i][k] * B[k][j]; D[i][j] = s; }
    for (int l = 0; l < 32; l++) {
        int g = l >> 2, t = l & 3;
        d[l][0] += D[g][2 * t]; d[l][1] += D[g][2 * t + 1]; d[l][2] += D[g + 8][2 * t]; d[l][3] += D[g + 8][2 * t + 1];
    }
}

struct Plan { int nt, wm, ws, slabs, splits, nchunk; };
const int U = 4;

// The host plan (ops/linear/cuda.rs skinny_plan), replicated.
static bool plan_of(int m, int n, int k, int sms, Plan& p, bool one_split = false) {
    if (m < 1 || m > 64 || k % 128) return false;
    int nt = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
    int maxw = nt == 8 ? 12 : 16, mt = (n + 15) / 16, steps = k / 128;
    int wm = std::min(std::max((mt + sms - 1) / sms, std::max(nt / 2, 1)), maxw);
    int slabs = (mt + wm - 1) / wm, want = one_split ? 1 : std::min(std::max(sms / slabs, 1), 8), s = want;
    while (steps % s) s--;
    int per = steps / s, w = std::min(maxw / wm, 8);
    while (per % w) w--;
    p = {nt, wm, w, slabs, s, per / w};
    return true;
}

// The norm folded in (skinny_norm_t*): layer (LayerNorm) or RMSNorm, eps, c1 / c2 row constants
// (c2 may be empty); W is then the folded weight. Only plans with splits 1.
struct Norm { bool on = false, layer = false; float eps = 1e-5f; std::vector<float> c1, c2; };

static std::vector<uint16_t> run(const std::vector<uint16_t>& x, const std::vector<uint16_t>& W, int M, int N, int K, Plan p,
                                 const Norm& nm = Norm()) {
    std::vector<uint16_t> y((size_t)M * N, 0x7fc0);  // poisoned
    const int TILE = 4 * p.nt * 32;
    std::vector<float> part((size_t)p.splits * p.slabs * p.wm * TILE, NAN);
    std::vector<int> counters(p.slabs, 0);
    for (int blk = 0; blk < p.slabs * p.splits; blk++) {
        int slab = blk % p.slabs, split = blk / p.slabs;
        std::vector<std::vector<float>> red((p.ws) * p.wm, std::vector<float>(TILE));
        std::vector<std::vector<float>> accw(p.wm * p.ws, std::vector<float>(TILE));
        std::vector<float> sst(2 * p.ws * 8 * p.nt, NAN);  // [ws][2][8 nt]
        for (int warp = 0; warp < p.wm * p.ws; warp++) {
            int wm = warp % p.wm, ws = warp / p.wm;
            int r0 = slab * 16 * p.wm + 16 * wm, kw = p.nchunk * 32 * U, k0 = (split * p.ws + ws) * kw;
            float acc[8][32][4] = {};
            float s1[32][2] = {}, s2[32][2] = {};
            for (int c = 0; c < p.nchunk; c++)
                for (int u = 0; u < U; u++) {
                    int kk = k0 + c * 32 * U + 32 * u;
                    uint32_t a[2][32][4], b[8][2][32][2];
                    for (int l = 0; l < 32; l++) {
                        int g = l >> 2, t = l & 3;
                        int ra = std::min(r0 + g, N - 1), rb = std::min(r0 + g + 8, N - 1);
                        U4 A = ld8(W, (long long)ra * K + kk + 8 * t), B = ld8(W, (long long)rb * K + kk + 8 * t);
                        a[0][l][0] = A.w[0]; a[0][l][1] = B.w[0]; a[0][l][2] = A.w[1]; a[0][l][3] = B.w[1];
                        a[1][l][0] = A.w[2]; a[1][l][1] = B.w[2]; a[1][l][2] = A.w[3]; a[1][l][3] = B.w[3];
                        for (int nt = 0; nt < p.nt; nt++) {
                            U4 X = ld8(x, (long long)std::min(nt * 8 + g, M - 1) * K + kk + 8 * t);
                            b[nt][0][l][0] = X.w[0]; b[nt][0][l][1] = X.w[1];
                            b[nt][1][l][0] = X.w[2]; b[nt][1][l][1] = X.w[3];
                        }
                    }
                    for (int nt = 0; nt < p.nt; nt++) {
                        mma(acc[nt], a[0], b[nt][0]); mma(acc[nt], a[1], b[nt][1]);
                        if (nm.on && nt % p.wm == wm) {
                            int j = nt < p.wm ? 0 : 1;
                            for (int l = 0; l < 32; l++) {
                                uint32_t q[4] = {b[nt][0][l][0], b[nt][0][l][1], b[nt][1][l][0], b[nt][1][l][1]};
                                for (int i = 0; i < 4; i++) { float lo_ = lo(q[i]), hi_ = hi(q[i]);
                                    s1[l][j] += lo_; s2[l][j] += lo_ * lo_; s1[l][j] += hi_; s2[l][j] += hi_ * hi_; }
                            }
                        }
                    }
                }
            for (int l = 0; l < 32; l++) for (int nt = 0; nt < p.nt; nt++) for (int c = 0; c < 4; c++)
                accw[warp][(nt * 4 + c) * 32 + l] = acc[nt][l][c];
            if (nm.on)
                for (int nt = 0; nt < p.nt; nt++) {
                    if (nt % p.wm != wm) continue;
                    int j = nt < p.wm ? 0 : 1;
                    for (int g = 0; g < 8; g++) {  // the xor-1, xor-2 butterfly, lane t = 0's value
                        int l0 = 4 * g;
                        float a01 = s1[l0][j] + s1[l0 + 1][j], a23 = s1[l0 + 2][j] + s1[l0 + 3][j];
                        float b01 = s2[l0][j] + s2[l0 + 1][j], b23 = s2[l0 + 2][j] + s2[l0 + 3][j];
                        sst[(2 * ws) * 8 * p.nt + nt * 8 + g] = a01 + a23;
                        sst[(2 * ws + 1) * 8 * p.nt + nt * 8 + g] = b01 + b23;
                    }
                }
        }
        // in-CTA sum, ws order
        for (int wm = 0; wm < p.wm; wm++)
            for (int v = 1; v < p.ws; v++)
                for (int j = 0; j < TILE; j++) accw[wm][j] += accw[v * p.wm + wm][j];
        auto store = [&](int wm, const std::vector<float>& acc) {
            int r0 = slab * 16 * p.wm + 16 * wm;
            for (int l = 0; l < 32; l++) { int g = l >> 2, t = l & 3;
                for (int nt = 0; nt < p.nt; nt++) for (int c = 0; c < 4; c++) {
                    int r = r0 + g + (c >= 2 ? 8 : 0), tok = nt * 8 + 2 * t + (c & 1);
                    if (r < N && tok < M) {
                        float v = acc[(nt * 4 + c) * 32 + l];
                        if (nm.on) {
                            float a = 0, b = 0;
                            for (int w = 0; w < p.ws; w++) { a += sst[(2 * w) * 8 * p.nt + tok]; b += sst[(2 * w + 1) * 8 * p.nt + tok]; }
                            float mu = nm.layer ? a / (float)K : 0.f, var = std::max(b / (float)K - mu * mu, 0.f);
                            float rs = 1.f / sqrtf(var + nm.eps);
                            v = nm.layer ? rs * (v - mu * nm.c1[r]) : rs * v;
                            if (!nm.c2.empty()) v += nm.c2[r];
                        }
                        y[(size_t)tok * N + r] = tobf(v);
                    }
                } }
        };
        if (p.splits == 1) { for (int wm = 0; wm < p.wm; wm++) store(wm, accw[wm]); continue; }
        for (int wm = 0; wm < p.wm; wm++)
            for (int j = 0; j < TILE; j++) part[(((size_t)split * p.slabs + slab) * p.wm + wm) * TILE + j] = accw[wm][j];
        if (++counters[slab] != p.splits) continue;
        counters[slab] = 0;
        for (int wm = 0; wm < p.wm; wm++) {
            std::vector<float> acc(TILE, 0.f);
            for (int sp = 0; sp < p.splits; sp++)
                for (int j = 0; j < TILE; j++) acc[j] += part[(((size_t)sp * p.slabs + slab) * p.wm + wm) * TILE + j];
            store(wm, acc);
        }
    }
    return y;
}

int main() {
    struct Case { int M, N, K; } cases[] = {
        {1, 776, 256}, {5, 776, 256}, {5, 256, 256}, {3, 1280, 256}, {13, 100, 384}, {33, 300, 512},
        {64, 2048, 4096}, {64, 12352, 2048}, {8, 2048, 4096}, {1, 12352, 2048}, {40, 2048, 1024}, {64, 40, 128}};
    uint64_t z = 1;
    auto rnd = [&]() { z = z * 6364136223846793005ull + 1442695040888963407ull; return ((z >> 40) / (double)(1 << 24)) * 2 - 1; };
    int bad = 0;
    for (auto cs : cases) {
        Plan p;
        if (!plan_of(cs.M, cs.N, cs.K, 132, p)) { printf("no plan %d %d %d\n", cs.M, cs.N, cs.K); bad++; continue; }
        if (cs.M * (long long)cs.N * cs.K > 3e8) {  // the big shapes: plan only (the scalar mma model is slow)
            printf("M %2d N %5d K %4d plan nt %d wm %d ws %d slabs %d splits %d nchunk %d (CTAs %d, warps/CTA %d)\n", cs.M, cs.N, cs.K,
                   p.nt, p.wm, p.ws, p.slabs, p.splits, p.nchunk, p.slabs * p.splits, p.wm * p.ws);
            continue;
        }
        std::vector<uint16_t> x((size_t)cs.M * cs.K), W((size_t)cs.N * cs.K);
        for (auto& v : x) v = tobf((float)rnd());
        for (auto& v : W) v = tobf((float)(rnd() * 0.05));
        auto y = run(x, W, cs.M, cs.N, cs.K, p);
        double worst = 0;
        for (int m = 0; m < cs.M; m++) for (int n = 0; n < cs.N; n++) {
            double s = 0, sa = 0;
            for (int k = 0; k < cs.K; k++) { double t = (double)bf(x[(size_t)m * cs.K + k]) * bf(W[(size_t)n * cs.K + k]); s += t; sa += fabs(t); }
            double got = bf(y[(size_t)m * cs.N + n]);
            double e = fabs(got - s) / (fabs(s) * std::ldexp(1.0, -8) + 1e-4 * sa + 1e-30);
            if (!(e <= 1.0)) { if (bad < 5) printf("  bad m %d n %d got %g want %g\n", m, n, got, s); bad++; }
            worst = std::max(worst, e);
        }
        printf("M %2d N %5d K %4d plan nt %d wm %d ws %d slabs %d splits %d nchunk %d: worst error / bound %.3f\n", cs.M, cs.N, cs.K,
               p.nt, p.wm, p.ws, p.slabs, p.splits, p.nchunk, worst);
    }
    // A plan with splits > 1 and ws > 1 on a small shape (forced), to cover both sums at once.
    {
        int M = 20, N = 70, K = 1024; Plan p = {4, 2, 2, 3, 2, 2};
        std::vector<uint16_t> x((size_t)M * K), W((size_t)N * K);
        for (auto& v : x) v = tobf((float)rnd());
        for (auto& v : W) v = tobf((float)(rnd() * 0.05));
        auto y = run(x, W, M, N, K, p);
        double worst = 0;
        for (int m = 0; m < M; m++) for (int n = 0; n < N; n++) {
            double s = 0, sa = 0;
            for (int k = 0; k < K; k++) { double t = (double)bf(x[(size_t)m * K + k]) * bf(W[(size_t)n * K + k]); s += t; sa += fabs(t); }
            double e = fabs(bf(y[(size_t)m * N + n]) - s) / (fabs(s) * std::ldexp(1.0, -8) + 1e-4 * sa + 1e-30);
            if (!(e <= 1.0)) bad++;
            worst = std::max(worst, e);
        }
        printf("forced plan splits 2 ws 2 wm 2 (M 20 N 70 K 1024): worst error / bound %.3f\n", worst);
    }
    // The input norm folded in: LayerNorm with bias (zero-centered gamma), LayerNorm, RMSNorm,
    // against the f64 product of the norm's exact output (x - mean) rstd g + b with the bf16
    // weight (what the unfolded path rounds to bf16 before its GEMM). Bound per element:
    // 2^-7 |ref| + 3 2^-8 sqrt(sum_k t_k^2) (t_k the products: the bf16 rounding of W' or of the
    // normalized x, independent per k) + 1e-4 sum_k |t_k|.
    struct NC { int M, N, K; bool layer, bias, zc; float mean_shift; } ncs[] = {
        {5, 776, 256, true, true, true, 0.3f}, {64, 300, 512, true, false, false, 0.0f}, {1, 100, 256, false, false, true, 0.0f},
        {33, 130, 384, false, false, false, 0.5f}, {16, 64, 2048, true, true, false, 2.0f}};
    for (auto c : ncs) {
        Plan p;
        plan_of(c.M, c.N, c.K, 132, p, true);
        if (p.splits != 1 || 2 * p.wm < p.nt) { printf("norm case M %d N %d K %d: plan does not take the norm\n", c.M, c.N, c.K); continue; }
        std::vector<uint16_t> x((size_t)c.M * c.K);
        for (auto& v : x) v = tobf((float)rnd() + c.mean_shift);
        std::vector<float> Wf((size_t)c.N * c.K), gw(c.K), bb(c.K);
        for (auto& v : Wf) v = (float)(rnd() * 0.05);
        for (auto& v : gw) v = (float)(rnd() * 0.5 + (c.zc ? 0.0 : 1.0));
        for (auto& v : bb) v = (float)(rnd() * 0.1);
        // the fold (skinny_fold): W' = bf16(W g), c1 = sum W', c2 = sum W b (fp32, lane-strided then butterfly)
        std::vector<uint16_t> Wp((size_t)c.N * c.K);
        Norm nm; nm.on = true; nm.layer = c.layer; nm.eps = 1e-5f; nm.c1.resize(c.N); if (c.bias) nm.c2.resize(c.N);
        for (int n = 0; n < c.N; n++) {
            float la[32] = {}, lb[32] = {};
            for (int k = 0; k < c.K; k++) {
                float g = c.zc ? 1.f + gw[k] : gw[k];
                uint16_t q = tobf(Wf[(size_t)n * c.K + k] * g);
                Wp[(size_t)n * c.K + k] = q;
                la[k % 32] += bf(q);
                if (c.bias) lb[k % 32] += Wf[(size_t)n * c.K + k] * bb[k];
            }
            for (int o = 16; o > 0; o >>= 1) for (int l = 0; l < 32; l++) if (!(l & o)) { la[l] += la[l + o]; lb[l] += lb[l + o]; }
            nm.c1[n] = la[0];
            if (c.bias) nm.c2[n] = lb[0];
        }
        auto y = run(x, Wp, c.M, c.N, c.K, p, nm);
        double worst = 0;
        for (int m = 0; m < c.M; m++) {
            double mu = 0, var = 0;
            for (int k = 0; k < c.K; k++) mu += bf(x[(size_t)m * c.K + k]);
            mu = c.layer ? mu / c.K : 0;
            for (int k = 0; k < c.K; k++) { double d = bf(x[(size_t)m * c.K + k]) - mu; var += d * d; }
            double rs = 1 / sqrt(var / c.K + 1e-5);
            for (int n = 0; n < c.N; n++) {
                double s = 0, sa = 0, s2 = 0;
                for (int k = 0; k < c.K; k++) {
                    double g = c.zc ? 1.0 + gw[k] : gw[k];
                    double xn = (bf(x[(size_t)m * c.K + k]) - mu) * rs * g + (c.bias ? bb[k] : 0.0);
                    double t = xn * bf(tobf(Wf[(size_t)n * c.K + k]));
                    s += t; sa += fabs(t); s2 += t * t;
                }
                double got = bf(y[(size_t)m * c.N + n]);
                double e = fabs(got - s) / (fabs(s) * std::ldexp(1.0, -7) + 3 * std::ldexp(1.0, -8) * sqrt(s2) + 1e-4 * sa + 1e-30);
                if (!(e <= 1.0)) { if (bad < 5) printf("  bad norm m %d n %d got %g want %g\n", m, n, got, s); bad++; }
                worst = std::max(worst, e);
            }
        }
        printf("norm folded (%s%s%s, mean shift %.1f) M %2d N %4d K %4d plan nt %d wm %d ws %d: worst error / bound %.3f\n",
               c.layer ? "LayerNorm" : "RMSNorm", c.bias ? " + bias" : "", c.zc ? ", zero-centered" : "", c.mean_shift, c.M, c.N, c.K,
               p.nt, p.wm, p.ws, worst);
    }
    printf(bad ? "FAILED (%d)\n" : "all within bounds\n", bad);
    return bad != 0;
}
