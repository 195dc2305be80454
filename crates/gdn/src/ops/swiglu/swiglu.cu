// SwiGLU: a = silu(gate) * up over u = [gate | up] rows, and its backward. Elementwise, fp32 math
// (expf, IEEE division), one thread per output element of a [rows, f] grid-stride loop.

__device__ __forceinline__ float swiglu_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

template <typename T>
__device__ __forceinline__ void swiglu_fwd_impl(const T* __restrict__ u, T* __restrict__ a, long long rows, int f) {
    long long n = rows * f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / f;
        int j = (int)(i - r * f);
        float g = ld(u, r * 2 * f + j), up = ld(u, r * 2 * f + f + j);
        st(a, i, g * swiglu_sigmoid(g) * up);
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd_impl(const T* __restrict__ u, const T* __restrict__ da, T* __restrict__ du,
                                                long long rows, int f) {
    long long n = rows * f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / f;
        int j = (int)(i - r * f);
        float g = ld(u, r * 2 * f + j), up = ld(u, r * 2 * f + f + j), d = ld(da, i);
        float s = swiglu_sigmoid(g);
        st(du, r * 2 * f + f + j, d * (g * s));
        st(du, r * 2 * f + j, d * up * s * (1.f + g * (1.f - s)));
    }
}

#define SWIGLU_KERNELS(S, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) swiglu_fwd_##S(const T* u, T* a, long long rows, \
                                                                      int f) {                        \
        swiglu_fwd_impl<T>(u, a, rows, f);                                                            \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) swiglu_bwd_##S(const T* u, const T* da, T* du,  \
                                                                      long long rows, int f) {        \
        swiglu_bwd_impl<T>(u, da, du, rows, f);                                                       \
    }

SWIGLU_KERNELS(f32, float)
SWIGLU_KERNELS(bf16, bf16_t)
