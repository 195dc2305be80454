# Builds h/kern.h: g2c_prep8 (with its bf16 outputs, g2c_prep8h) and g2f_fwd8 (the fused GDN2
# forward) from gdn2_rule.cu as host C++: each CUDA thread a std::thread, __syncthreads a
# std::barrier, cp.async a memcpy (waits and commits no-ops: a chunk's stage is complete when it is
# issued, and the pipeline's stage reuse is still exercised: a stage overwritten too early shows as
# wrong results), mma.sync m16n8k16 bf16 and ldmatrix x4 scalar models of their fragment layouts
# (exchanged through per-warp buffers between warp barriers), mma.sync m16n8k8 TF32 from
# ../h-g2b-emu. Run from this folder:
#   python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
import os
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu')).read()
p8 = src[src.index('// g2c_prep8 (issue 17'):src.index('#define G2C8_ENTRIES(')]
# bf16 stores of prep8 (inline PTX): replaced by host shims below.
p8 = p8[:p8.index('// Stores of prep8')] + p8[p8.index('// A fragment (16 x 8, row-major at p'):]
f8 = src[src.index('// g2f_fwd8 (issue 17'):src.index('// g2f_fwd8_d{DK}_w{NW}: two stages')]
f8 = f8[:f8.index('__device__ __forceinline__ unsigned g2f_pack')] + f8[f8.index('// One pipeline stage of g2f_fwd8'):]
pre = open(os.path.join(here, '../h-g2b-emu/extract.py')).read()
pre = pre[pre.index("pre = r'''") + len("pre = r'''"):pre.index("'''\nbody = body.replace")]
pre = pre.replace('float g2c_sm_store[70000]', 'float g2c_sm_store[60000]')
# h-g2b-emu's own bf16 / ldmatrix / mma shims (for g2b_grad4) duplicate the ones below: cut them.
if '// g2b_grad4 (h-g2g4)' in pre:
    pre = pre[:pre.index('// g2b_grad4 (h-g2g4)')]
pre += r'''
struct float2 { float x, y; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline unsigned tf32u(float x) { return __float_as_uint(to_tf32(x)); }
typedef unsigned short bf16_t;
inline bf16_t f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
inline float bf16_to_f32(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }
inline void st(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }
// prep8's stores (g2p8_st4 / g2p8_st2), fp32 and bf16 (cvt.rn.bf16x2: round to nearest even).
inline void g2p8_st4(float* p, i64 i, float4 v) { p[i] = v.x; p[i + 1] = v.y; p[i + 2] = v.z; p[i + 3] = v.w; }
inline void g2p8_st4(bf16_t* p, i64 i, float4 v) { st(p, i, v.x); st(p, i + 1, v.y); st(p, i + 2, v.z); st(p, i + 3, v.w); }
inline void g2p8_st2(float* p, i64 i, float a, float b) { p[i] = a; p[i + 1] = b; }
inline void g2p8_st2(bf16_t* p, i64 i, float a, float b) { st(p, i, a); st(p, i + 1, b); }
inline float exp2f_(float x) { return std::exp2(x); }
// g2f_fwd8's primitives.
inline unsigned g2f_pack(float lo, float hi) { return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16); }
inline unsigned g2f_saddr(const void* p) { return (unsigned)((const char*)p - (const char*)g2c_sm_store); }
inline void g2f_cp16(unsigned dst, const void* src) { std::memcpy((char*)g2c_sm_store + dst, src, 16); }
inline void g2f_commit() {}
template <int N> inline void g2f_wait() {}
inline unsigned g2f_dyn_smem() { return sizeof(g2c_sm_store); }
// Named barriers 1, 2 (SPLIT): bar.arrive = arrive without waiting, bar.sync = arrive and wait.
std::barrier<>* nbar[3];
inline void g2f_bar_arrive(int id, int) { (void)nbar[id]->arrive(); }
inline void g2f_bar_sync(int id, int) { nbar[id]->arrive_and_wait(); }
const void* ldsm_p[8][32];
// ldmatrix.x4 (no .trans): lane 8m + r gives the address of row r of 8x8 matrix m; register m of
// lane (g = l / 4, t = l % 4) receives row g, elements 2t, 2t + 1 of matrix m.
inline void g2f_ldsm4(unsigned (&r)[4], const void* p) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    ldsm_p[w][l] = p;
    warp_bar[w]->arrive_and_wait();
    for (int m = 0; m < 4; ++m) std::memcpy(&r[m], (const char*)ldsm_p[w][8 * m + g] + 4 * t, 4);
    warp_bar[w]->arrive_and_wait();
}
// mma.sync m16n8k16 bf16 (PTX fragments; low half = smaller k): a0 (g, 2t..), a1 (g + 8, 2t..),
// a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..); b0 (k 2t.., n g), b1 (k 2t + 8.., n g); c as m16n8k8.
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
'''
# The borrowed prelude (h-g2b-emu's) may already define float2 (it grows with its kernels).
if pre.count("struct float2 {") > 1:
    pre = pre.replace("struct float2 { float x, y; };\nstruct uint2", "struct uint2")
    pre = pre.replace("inline float2 make_float2(float a, float b) { return {a, b}; }\n", "")
body = p8 + f8
body = body.replace('extern __shared__ __align__(16) float g2c_sm[];', 'float* g2c_sm = g2c_sm_store;')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(pre + body)
