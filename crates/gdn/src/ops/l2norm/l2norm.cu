// Per-row L2 normalization (FLA's convention): rstd = 1 / sqrt(sum(x^2) + 1e-6), y = x * rstd.
// Backward: dx = rstd * (dy - y <dy, y>), y = x * rstd recomputed in fp32. One warp per row.

#define L2_EPS 1e-6f

template <typename T>
__device__ __forceinline__ float l2_row_rstd(const T* __restrict__ xr, int dim, int lane) {
    float ss = 0.f;
    for (int i = lane; i < dim; i += 32) {
        float v = ld(xr, i);
        ss += v * v;
    }
    return 1.f / sqrtf(warp_sum(ss) + L2_EPS);
}

template <typename T>
__device__ __forceinline__ void l2_fwd_impl(const T* __restrict__ x, T* __restrict__ y, float* __restrict__ rstd_out,
                                            long long rows, int dim, int write_y) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * dim;
    float r = l2_row_rstd(xr, dim, lane);
    if (write_y) {
        T* yr = y + row * dim;
        for (int i = lane; i < dim; i += 32) st(yr, i, ld(xr, i) * r);
    }
    if (lane == 0) rstd_out[row] = r;
}

template <typename T>
__device__ __forceinline__ void l2_bwd_impl(const T* __restrict__ x, const float* __restrict__ rstd_in,
                                            const T* __restrict__ dy, T* __restrict__ dx, long long rows, int dim) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    long long base = row * dim;
    float r = rstd_in[row];
    float d = 0.f;
    for (int i = lane; i < dim; i += 32) d += ld(dy, base + i) * (ld(x, base + i) * r);
    d = warp_sum(d);
    for (int i = lane; i < dim; i += 32) st(dx, base + i, r * (ld(dy, base + i) - (ld(x, base + i) * r) * d));
}

#define L2_KERNELS(S, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        l2norm_fwd_##S(const T* x, T* y, float* rstd, long long rows, int dim, int write_y) {              \
        l2_fwd_impl<T>(x, y, rstd, rows, dim, write_y);                                                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        l2norm_bwd_##S(const T* x, const float* rstd, const T* dy, T* dx, long long rows, int dim) {       \
        l2_bwd_impl<T>(x, rstd, dy, dx, rows, dim);                                                        \
    }

L2_KERNELS(f32, float)
L2_KERNELS(bf16, bf16_t)
