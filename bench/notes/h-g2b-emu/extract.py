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
body = prep + scan + body
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
'''
body = body.replace('extern __shared__ __align__(16) float g2c_sm[];', 'float* g2c_sm = g2c_sm_store;')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(pre + body)
