// The emulators' common ground (main.cpp, prep.cpp, fwd10.cpp): CUDA's names for host C++, the
// shared memory, bf16 conversions (round to nearest even, as pack_bf16 / f32_to_bf16 on the GPU).
#pragma once
#include <barrier>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
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
std::barrier<>* g_warp[16];  // one per warp of the running CTA (warp.h)
inline float bf(bf16_t x) { unsigned u = (unsigned)x << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float bf16_to_f32(bf16_t x) { return bf(x); }
inline bf16_t f32_to_bf16(float f) { unsigned u; std::memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); return (bf16_t)(u >> 16); }
inline unsigned pack_bf16(float lo, float hi) { return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16); }
inline void st(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }
inline void st_ws(float* p, i64 i, float v) { p[i] = v; }
inline void st_ws(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float ld(const bf16_t* p, i64 i) { return bf(p[i]); }
