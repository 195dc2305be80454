// 4-wide vector loads/stores of either storage type and the bf16 rounding of a value as
// stored, for the streaming kernels (prep, gated_norm): a lane moves 4 consecutive values in one
// 16-byte (f32) or 8-byte (bf16) access. Prepended after common.cuh by backend/kernels.rs.
#pragma once

// f32 -> bf16 bits, round to nearest even: one instruction where the GPU has it (sm_80+), the
// bit arithmetic of common.cuh elsewhere. The two agree on every non-NaN value.
__device__ __forceinline__ bf16_t cv_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    return f32_to_bf16(f);
#endif
}

// A value as the storage type holds it.
__device__ __forceinline__ float cv_rnd(const float*, float v) { return v; }
__device__ __forceinline__ float cv_rnd(const bf16_t*, float v) { return bf16_to_f32(cv_to_bf16(v)); }

// Four consecutive values at p[i] (i a multiple of 4, p 16-byte aligned): one 16-byte (f32) or
// 8-byte (bf16) access.
struct cv4 {
    float v[4];
};
__device__ __forceinline__ cv4 cv_ld4(const float* __restrict__ p, long long i) {
    float4 a = *reinterpret_cast<const float4*>(p + i);
    cv4 r;
    r.v[0] = a.x;
    r.v[1] = a.y;
    r.v[2] = a.z;
    r.v[3] = a.w;
    return r;
}
__device__ __forceinline__ cv4 cv_ld4(const bf16_t* __restrict__ p, long long i) {
    uint2 a = *reinterpret_cast<const uint2*>(p + i);
    cv4 r;
    r.v[0] = __uint_as_float(a.x << 16);
    r.v[1] = __uint_as_float(a.x & 0xffff0000u);
    r.v[2] = __uint_as_float(a.y << 16);
    r.v[3] = __uint_as_float(a.y & 0xffff0000u);
    return r;
}
// The same four values as loaded, unconverted (a prefetch holds these: 2 registers for bf16).
template <typename T>
struct cv4raw;
template <>
struct cv4raw<float> {
    float4 r;
};
template <>
struct cv4raw<bf16_t> {
    uint2 r;
};
__device__ __forceinline__ cv4raw<float> cv_ldraw4(const float* __restrict__ p, long long i) {
    return cv4raw<float>{*reinterpret_cast<const float4*>(p + i)};
}
__device__ __forceinline__ cv4raw<bf16_t> cv_ldraw4(const bf16_t* __restrict__ p, long long i) {
    return cv4raw<bf16_t>{*reinterpret_cast<const uint2*>(p + i)};
}
__device__ __forceinline__ cv4 cv_unpack4(cv4raw<float> a) {
    cv4 r;
    r.v[0] = a.r.x;
    r.v[1] = a.r.y;
    r.v[2] = a.r.z;
    r.v[3] = a.r.w;
    return r;
}
__device__ __forceinline__ cv4 cv_unpack4(cv4raw<bf16_t> a) {
    cv4 r;
    r.v[0] = __uint_as_float(a.r.x << 16);
    r.v[1] = __uint_as_float(a.r.x & 0xffff0000u);
    r.v[2] = __uint_as_float(a.r.y << 16);
    r.v[3] = __uint_as_float(a.r.y & 0xffff0000u);
    return r;
}
template <typename T>
__device__ __forceinline__ cv4raw<T> cv_zero4raw() {
    cv4raw<T> z;
    memset(&z, 0, sizeof(z));
    return z;
}

__device__ __forceinline__ void cv_st4(float* p, long long i, const float* v) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void cv_st4(bf16_t* p, long long i, const float* v) {
    uint2 a;
    a.x = (unsigned int)cv_to_bf16(v[0]) | ((unsigned int)cv_to_bf16(v[1]) << 16);
    a.y = (unsigned int)cv_to_bf16(v[2]) | ((unsigned int)cv_to_bf16(v[3]) << 16);
    *reinterpret_cast<uint2*>(p + i) = a;
}
