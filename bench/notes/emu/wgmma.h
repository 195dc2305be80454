// wgmma (sm_90a warpgroup MMA) on the host, for the extracted kernels that call wgmma.cuh's
// wrappers (grad10.cpp): wg_mma<TA, TB>(d, da, db, acc) for m64nNk16 bf16 -> fp32 (N = 2 R for
// d[R]), wg_fence / wg_commit / wg_wait / wg_fence_proxy / wg_hold as no-ops (the emulated
// product is complete when wg_mma returns, and the shared-memory model has one proxy).
// Needs base.h (threadIdx, gdr_smem, g_dyn).
//
// Written from the PTX ISA, not from wgmma.cuh's functions (those build the descriptors this
// decodes, so a descriptor or layout slip in the kernel shows up here as wrong products):
// - matrix descriptor: bits 0-13 start address >> 4, 16-29 leading byte offset (LBO) >> 4, 32-45
//   stride byte offset (SBO) >> 4, 49-51 base offset, 62-63 layout (1: 128-byte swizzle, the
//   only one accepted here; base offset 0 required);
// - canonical SW128 layouts (bytes; the swizzle XORs address bits 4-6 with bits 7-9 of the
//   whole shared-window address): K-major (transpose flag 0: A stored [m][k], B stored [n][k])
//   element (mn, k) of a k16 step at start + (mn % 8) 128 + (mn / 8) SBO + 2 k (LBO unused);
//   MN-major (flag 1: A [k][m], B [k][n]) at start + 2 (mn % 64) + (mn / 64) LBO + (k % 8) 128 +
//   (k / 8) SBO;
// - accumulator fragment of m64nNk16 (warp w = (tid / 32) % 4 of the warpgroup, g = lane / 4,
//   t = lane % 4): d[4 j + c] = D(16 w + g + 8 (c / 2), 8 j + 2 t + c % 2).
// Numerics: each k16 step's 16-term sum in f64, added to the fp32 accumulator with one rounding
// (warp.h's mma.sync model): a fixed order, so two kernels that issue the same products on the
// same operands get the same bits, as on the GPU.
// Each thread computes its own fragment elements from shared memory at the call (no exchange,
// no implicit warpgroup barrier: a warp that reads a tile before another warp of its warpgroup
// wrote it gets what is there). An element with the bits 0xffff (the poison grad10.cpp writes into
// released buffers; never a value of the kernels' data) is reported through g_wg_report, as is a
// descriptor that is not SW128 / base offset 0 or an address beyond the launch's shared memory;
// g_wg_access, when set, vets each element's address (one report per thread and product).
#pragma once
inline void (*g_wg_report)(const char* what, unsigned addr) = nullptr;
inline void (*g_wg_issue)() = nullptr;  // called as each thread issues a wgmma (grad10.cpp: random delays)
// called on each operand element's address: false when the reading thread may not read it
// (grad10.cpp: a buffer it does not hold), reported by the hook itself
inline bool (*g_wg_access)(unsigned addr) = nullptr;

struct WgOp { unsigned start, lbo, sbo; };
inline WgOp wg_decode(unsigned long long d) {
    WgOp o{(unsigned)(d & 0x3FFFu) << 4, (unsigned)((d >> 16) & 0x3FFFu) << 4, (unsigned)((d >> 32) & 0x3FFFu) << 4};
    if (((d >> 62) != 1 || ((d >> 49) & 7) != 0) && g_wg_report) g_wg_report("descriptor not SW128 with base offset 0", o.start);
    return o;
}
// Shared-window byte address of operand element (mn, k), k < 16, of a k16 step.
inline unsigned wg_addr(const WgOp& o, int mn_major, int mn, int k) {
    const unsigned a = mn_major ? o.start + 2u * (mn & 63) + (unsigned)(mn >> 6) * o.lbo + 128u * (k & 7) + (unsigned)(k >> 3) * o.sbo
                                : o.start + 128u * (mn & 7) + (unsigned)(mn >> 3) * o.sbo + 2u * k;
    return a ^ (((a >> 7) & 7u) << 4);
}
inline float wg_ld(unsigned a, bool& bad) {
    if (a + 2 > g_dyn) {
        if (g_wg_report) g_wg_report("operand address beyond the shared memory", a);
        bad = true;
        return NAN;
    }
    if (g_wg_access && !bad && !g_wg_access(a)) bad = true;
    bf16_t x;
    std::memcpy(&x, (const char*)gdr_smem + a, 2);
    if (x == 0xffff && !bad) {
        bad = true;
        if (g_wg_report) g_wg_report("operand element poisoned (released or never written)", a);
    }
    return bf(x);
}
template <int TA, int TB, int R>
inline void wg_mma(float (&d)[R], unsigned long long da, unsigned long long db, int acc) {
    constexpr int N = 2 * R;
    static_assert(N == 16 || N == 32 || N == 64 || N == 128, "m64nNk16: N 16, 32, 64, 128");
    if (g_wg_issue) g_wg_issue();
    const WgOp A = wg_decode(da), B = wg_decode(db);
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
    bool bad = false;
    float a[2][16];
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 16; ++k) a[h][k] = wg_ld(wg_addr(A, TA, 16 * w + g + 8 * h, k), bad);
    for (int j = 0; j < N / 8; ++j)
        for (int c = 0; c < 2; ++c) {
            const int n = 8 * j + 2 * t + c;
            float b[16];
            for (int k = 0; k < 16; ++k) b[k] = wg_ld(wg_addr(B, TB, n, k), bad);
            for (int h = 0; h < 2; ++h) {
                double s = 0;
                for (int k = 0; k < 16; ++k) s += (double)a[h][k] * b[k];
                float& x = d[4 * j + 2 * h + c];
                x = (float)((acc ? (double)x : 0.0) + s);
            }
        }
}
inline void wg_fence() {}
inline void wg_commit() {}
template <int N> inline void wg_wait() {}
inline void wg_fence_proxy() {}
template <int R> inline void wg_hold(float (&)[R]) {}
