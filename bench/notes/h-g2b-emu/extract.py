# Builds h/kern.h: the chunked GDN2 backward's device code (g2b_dscan, g2b_grad) from
# gdn2_rule.cu as host C++, each CUDA thread a std::thread, __syncthreads a std::barrier (see
# h-g2b.md). Run from this folder: python3 extract.py && g++ -std=c++20 -O2 -pthread -w
# main.cpp -o h/main && python3 drive.py
import os
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu')).read()
body = src[src.index('// Chunked backward (issue 17'):src.index('#define G2B_DSCAN(')]
# The forward's prep (T for the backward, and the workspaces the backward reads).
prep = src[src.index('// Workspace geometry of one (chunk, value head)'):src.index('// Shared memory of g2c_prep (floats)')]
# ... and the scan (h[c], D), its cp.async copies done at once (the waits and commits no-ops).
scan = src[src.index('// Issues the cp.async copies of chunk'):src.index('// O = scale (Qg h[c] + A D)')]
# Backward v2 (h-g2bw): g2b_dscan_pp and g2b_grad2 (ex2.approx as exp2; float2 stores).
v2a = src[src.index('// Backward v2 (opt-in'):src.index('#define G2B_DSCANP(')]
v2b = src[src.index('// g2b_mm_tc with the epilogue delivered'):src.index('#define G2B_GRAD2(')]
v2b = v2b.replace('asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));', 'r = std::exp2(x);')
# Backward v3's gradient kernel (h-g2g3): g2b_grad3.
v3 = src[src.index("// Backward v3's gradient kernel"):src.index('#define G2B_GRAD3(')]
# Backward v4's gradient kernel (h-g2g4): g2b_grad4 on bf16 mma.sync / ldmatrix models (below).
v4 = src[src.index("// Backward v4's gradient kernel"):src.index('#define G2B_GRAD4(')]
v4 = v4[:v4.index('__device__ __forceinline__ void g4_ldsm4t')] + 'inline void g4_ldsm4t(unsigned (&r)[4], const void* p) { ldsm_any(r, p, true); }\n' + v4[v4.index('__device__ __forceinline__ float g4_bf'):]
# Backward v5 (h-g2g4): g2c_prep8 (T and the bf16 workspaces), g2f_fwd8 with HREC (h, D), g2b_dscan8.
p8 = src[src.index('// g2c_prep8 (issue 17'):src.index('#define G2C8_ENTRIES(')]
p8 = p8[:p8.index('// Stores of prep8')] + p8[p8.index('// A fragment (16 x 8, row-major at p'):]
f8 = src[src.index('// g2f_fwd8 (issue 17'):src.index('// g2f_fwd8_d{DK}_w{NW}: two stages')]
f8 = f8[:f8.index('__device__ __forceinline__ unsigned g2f_pack')] + f8[f8.index('// One pipeline stage of g2f_fwd8'):]
d8 = src[src.index('// Backward v5 (opt-in'):src.index('// g2b_dscan8{,s3}_d{DK}_w{NW}.')]
d8 = d8[:d8.index('__device__ __forceinline__ void g2d8_cp16z')] + d8[d8.index('// One chunk\'s operands into a stage (all NT threads'):]
body = prep + scan + body + v2a + v2b + v3 + p8 + v4 + f8 + d8
pre = r'''
#include <barrier>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>
#include <algorithm>
#include <cstring>
using std::min;
typedef long long i64;
struct D3 { int x; };
thread_local D3 threadIdx, blockIdx;
std::barrier<>* g_bar;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__
#define __align__(n)
#define G2C_C 64
#define G2C_MAXD 128
#define G2C_NT 256
#define G2C_LT 68
float g2c_sm_store[70000] __attribute__((aligned(16)));
struct float4 { float x, y, z, w; };
inline float ld(const float* p, i64 i) { return p[i]; }
inline void g2c_cp16(void* s, const void* g) { std::memcpy(s, g, 16); }
inline void g2c_commit() {}
template <int N> inline void g2c_wait() {}
// Warp shuffles: each warp exchanges through a buffer between two warp-wide barriers.
float warp_buf[8][32];
std::barrier<>* warp_bar[8];
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int t = threadIdx.x, w = t >> 5, l = t & 31;
    warp_buf[w][l] = v;
    warp_bar[w]->arrive_and_wait();
    const float r = warp_buf[w][l ^ o];
    warp_bar[w]->arrive_and_wait();
    return r;
}
inline void st(float* p, i64 i, float v) { p[i] = v; }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#define G2B_TC_MODULE 1
// TF32 tensor cores (g2b_grad_tc, h-g2tc): cvt.rna.tf32.f32 as bit arithmetic (round the 13 low
// mantissa bits to nearest, ties away from zero; EMU_TF32_EXACT=1 keeps the value, to check the
// indexing at fp32 accuracy), and mma.sync m16n8k8 as a scalar model of its fragment layouts
// (g = lane / 4, t = lane % 4): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4);
// b0 (t, g), b1 (t + 4, g); c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
// Each lane posts its fragments, a warp barrier, each lane computes its own C elements from
// every lane's, a warp barrier.
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; std::memcpy(&x, &u, 4); return x; }
static const bool tf32_exact = std::getenv("EMU_TF32_EXACT") != nullptr;
inline float to_tf32(float x) {
    if (tf32_exact) return x;
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    return __uint_as_float(u);
}
float mma_a[8][32][4], mma_b[8][32][2];
inline void mma_tf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    mma_a[w][l][0] = __uint_as_float(a0); mma_a[w][l][1] = __uint_as_float(a1);
    mma_a[w][l][2] = __uint_as_float(a2); mma_a[w][l][3] = __uint_as_float(a3);
    mma_b[w][l][0] = __uint_as_float(b0); mma_b[w][l][1] = __uint_as_float(b1);
    warp_bar[w]->arrive_and_wait();
    auto A = [&](int r, int k) { return mma_a[w][(r & 7) * 4 + (k & 3)][(r >> 3) + 2 * (k >> 2)]; };
    auto B = [&](int k, int n) { return mma_b[w][n * 4 + (k & 3)][k >> 2]; };
    for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
        float s = c[e];
        for (int k = 0; k < 8; ++k) s += A(r, k) * B(k, n);
        c[e] = s;
    }
    warp_bar[w]->arrive_and_wait();
}

// g2b_grad4 (h-g2g4): bf16 tiles, ldmatrix (plain and .trans) and mma.sync m16n8k16 bf16 as scalar
// models of their fragment layouts (as h-g2f-emu's), __syncthreads_or, shfl_down / shfl.
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
typedef unsigned short bf16_t;
inline bf16_t f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
inline float bf16_to_f32(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }
inline unsigned g2f_pack(float lo, float hi) { return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16); }
inline unsigned g2f_saddr(const void* p) { return (unsigned)((const char*)p - (const char*)g2c_sm_store); }
const void* ldsm_p[8][32];
// ldmatrix.x4: lane 8m + r gives the address of row r of 8x8 matrix m; register m of lane
// (g, t) receives row g, elements 2t, 2t + 1 (.trans: rows 2t, 2t + 1, element g).
inline void ldsm_any(unsigned (&r)[4], const void* p, bool tr) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    ldsm_p[w][l] = p;
    warp_bar[w]->arrive_and_wait();
    for (int m = 0; m < 4; ++m) {
        if (!tr) std::memcpy(&r[m], (const char*)ldsm_p[w][8 * m + g] + 4 * t, 4);
        else {
            bf16_t lo, hi;
            std::memcpy(&lo, (const char*)ldsm_p[w][8 * m + 2 * t] + 2 * g, 2);
            std::memcpy(&hi, (const char*)ldsm_p[w][8 * m + 2 * t + 1] + 2 * g, 2);
            r[m] = (unsigned)lo | ((unsigned)hi << 16);
        }
    }
    warp_bar[w]->arrive_and_wait();
}
inline void g2f_ldsm4(unsigned (&r)[4], const void* p) { ldsm_any(r, p, false); }
unsigned mmb_a[8][32][4], mmb_b[8][32][2];
inline float bfh(unsigned u, int hi) { return __uint_as_float(hi ? (u & 0xffff0000u) : (u << 16)); }
inline void g2f_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) mmb_a[w][l][i] = a[i];
    mmb_b[w][l][0] = b0; mmb_b[w][l][1] = b1;
    warp_bar[w]->arrive_and_wait();
    auto A = [&](int r, int k) { const int kk = k & 7; return bfh(mmb_a[w][(r & 7) * 4 + (kk >> 1)][(r >> 3) + 2 * (k >> 3)], kk & 1); };
    auto B = [&](int k, int n) { const int kk = k & 7; return bfh(mmb_b[w][n * 4 + (kk >> 1)][k >> 3], kk & 1); };
    for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
        float s = c[e];
        for (int k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
        c[e] = s;
    }
    warp_bar[w]->arrive_and_wait();
}
int sync_or_acc;
inline int __syncthreads_or(int p) {
    if (threadIdx.x == 0) sync_or_acc = 0;
    g_bar->arrive_and_wait();
    if (p) __atomic_store_n(&sync_or_acc, 1, __ATOMIC_SEQ_CST);
    g_bar->arrive_and_wait();
    const int r = __atomic_load_n(&sync_or_acc, __ATOMIC_SEQ_CST);
    g_bar->arrive_and_wait();
    return r;
}
inline float shfl_any(float v, int src) {
    const int t = threadIdx.x, w = t >> 5, l = t & 31;
    warp_buf[w][l] = v;
    warp_bar[w]->arrive_and_wait();
    const float r = warp_buf[w][src & 31];
    warp_bar[w]->arrive_and_wait();
    return r;
}
inline float __shfl_down_sync(unsigned, float v, int d) {
    const int l = threadIdx.x & 31;
    return shfl_any(v, l + d < 32 ? l + d : l);
}
inline float __shfl_sync(unsigned, float v, int s) { return shfl_any(v, s); }
// Backward v5 (h-g2g4): g2c_prep8's and g2f_fwd8's primitives (as h-g2f-emu's), g2b_dscan8's
// zero-filling copy.
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline unsigned tf32u(float x) { return __float_as_uint(to_tf32(x)); }
inline void st(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }
inline float ld(const bf16_t* p, i64 i) { return bf16_to_f32(p[i]); }
inline void g2p8_st4(float* p, i64 i, float4 v) { p[i] = v.x; p[i + 1] = v.y; p[i + 2] = v.z; p[i + 3] = v.w; }
inline void g2p8_st4(bf16_t* p, i64 i, float4 v) { st(p, i, v.x); st(p, i + 1, v.y); st(p, i + 2, v.z); st(p, i + 3, v.w); }
inline void g2p8_st2(float* p, i64 i, float a, float b) { p[i] = a; p[i + 1] = b; }
inline void g2p8_st2(bf16_t* p, i64 i, float a, float b) { st(p, i, a); st(p, i + 1, b); }
inline void g2f_cp16(unsigned dst, const void* src) { std::memcpy((char*)g2c_sm_store + dst, src, 16); }
inline void g2d8_cp16z(unsigned dst, const void* src, bool valid) {
    if (valid) std::memcpy((char*)g2c_sm_store + dst, src, 16);
    else std::memset((char*)g2c_sm_store + dst, 0, 16);
}
inline void g2f_commit() {}
template <int N> inline void g2f_wait() {}
inline unsigned g2f_dyn_smem() { return sizeof(g2c_sm_store); }
std::barrier<>* nbar[3];
inline void g2f_bar_arrive(int id, int) { (void)nbar[id]->arrive(); }
inline void g2f_bar_sync(int id, int) { nbar[id]->arrive_and_wait(); }
'''
body = body.replace('extern __shared__ __align__(16) float g2c_sm[];', 'float* g2c_sm = g2c_sm_store;')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(pre + body)
