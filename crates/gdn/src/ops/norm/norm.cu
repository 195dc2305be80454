// Pre-norm (RMSNorm / LayerNorm) over the last dimension: forward and backward.
//
// Row kernels run one warp per row (8 rows per 256-thread block); all math is fp32 whatever the
// storage type. The parameter gradients dw, db are two-stage, fixed-order sums over rows (no
// atomics): stage 1 writes one partial per chunk of NORM_RB rows (rows of a chunk summed by 8
// lanes in a fixed interleave, then the 8 lanes in order), stage 2 sums the chunks in order.
// Same inputs, same bits, on any GPU.

#define NORM_RB 256  // rows per partial (crate::ops::REDUCE_BLOCK)

// y = (x - mean) * rstd * g (+ b), g = w or 1 + w; writes rstd and (LayerNorm) mean per row.
template <typename T>
__device__ __forceinline__ void norm_fwd_impl(const T* __restrict__ x, const float* __restrict__ w,
                                              const float* __restrict__ b, int has_b, T* __restrict__ y,
                                              float* __restrict__ rstd_out, float* __restrict__ mean_out,
                                              long long rows, int dim, int layer, float eps, int zc) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;  // whole warp
    const T* xr = x + row * dim;
    float mean = 0.f;
    // The loops are unrolled so that each lane has 8 loads in flight before its first add: a
    // row is one warp, so with few rows (decode: 1-64) the loads' latency is the kernel's time.
    // The adds stay in i order: the same bits as the plain loops.
    if (layer) {
        float s = 0.f;
#pragma unroll 8
        for (int i = lane; i < dim; i += 32) s += ld(xr, i);
        mean = warp_sum(s) / (float)dim;
    }
    float ss = 0.f;
#pragma unroll 8
    for (int i = lane; i < dim; i += 32) {
        float v = ld(xr, i) - mean;
        ss += v * v;
    }
    float rstd = 1.f / sqrtf(warp_sum(ss) / (float)dim + eps);
    T* yr = y + row * dim;
#pragma unroll 8
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float v = (ld(xr, i) - mean) * rstd * g;
        if (has_b) v += b[i];
        st(yr, i, v);
    }
    if (lane == 0) {
        rstd_out[row] = rstd;
        if (layer) mean_out[row] = mean;
    }
}

// dx = rstd * (dy*g - mean(dy*g) [LayerNorm] - xhat * mean(dy*g*xhat)).
template <typename T>
__device__ __forceinline__ void norm_bwd_dx_impl(const T* __restrict__ x, const float* __restrict__ w,
                                                 const float* __restrict__ rstd_in,
                                                 const float* __restrict__ mean_in, const T* __restrict__ dy,
                                                 T* __restrict__ dx, long long rows, int dim, int layer, int zc) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * dim;
    const T* dyr = dy + row * dim;
    float mean = layer ? mean_in[row] : 0.f;
    float rstd = rstd_in[row];
    float s1 = 0.f, s2 = 0.f;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float xhat = (ld(xr, i) - mean) * rstd;
        float d = ld(dyr, i) * g;
        s1 += d;
        s2 += d * xhat;
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    float m1 = layer ? s1 / (float)dim : 0.f;
    float m2 = s2 / (float)dim;
    T* dxr = dx + row * dim;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float xhat = (ld(xr, i) - mean) * rstd;
        st(dxr, i, rstd * (ld(dyr, i) * g - m1 - xhat * m2));
    }
}

// Stage 1 of dw = sum_rows dy * xhat, db = sum_rows dy. Block (32 columns x 8 lanes), grid
// (chunks of NORM_RB rows, column tiles). part: [chunk][2][dim].
template <typename T>
__device__ __forceinline__ void norm_bwd_part_impl(const T* __restrict__ x, const float* __restrict__ rstd_in,
                                                   const float* __restrict__ mean_in, const T* __restrict__ dy,
                                                   float* __restrict__ part, long long rows, int dim, int layer) {
    __shared__ float sw[8][33], sb[8][33];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    int c = blockIdx.y * 32 + tx;
    long long chunk = blockIdx.x;
    long long r0 = chunk * NORM_RB, r1 = min(r0 + NORM_RB, rows);
    float aw = 0.f, ab = 0.f;
    if (c < dim) {
        for (long long r = r0 + ty; r < r1; r += 8) {
            float mean = layer ? mean_in[r] : 0.f;
            float xhat = (ld(x, r * dim + c) - mean) * rstd_in[r];
            float d = ld(dy, r * dim + c);
            aw += d * xhat;
            ab += d;
        }
    }
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && c < dim) {
        float a = sw[0][tx], bb = sb[0][tx];
        for (int l = 1; l < 8; l++) {
            a += sw[l][tx];
            bb += sb[l][tx];
        }
        part[(chunk * 2) * dim + c] = a;
        part[(chunk * 2 + 1) * dim + c] = bb;
    }
}

#define NORM_KERNELS(S, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        norm_fwd_##S(const T* x, const float* w, const float* b, int has_b, T* y, float* rstd, float* mean, \
                     long long rows, int dim, int layer, float eps, int zc) {                              \
        norm_fwd_impl<T>(x, w, b, has_b, y, rstd, mean, rows, dim, layer, eps, zc);                        \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        norm_bwd_dx_##S(const T* x, const float* w, const float* rstd, const float* mean, const T* dy,     \
                        T* dx, long long rows, int dim, int layer, int zc) {                               \
        norm_bwd_dx_impl<T>(x, w, rstd, mean, dy, dx, rows, dim, layer, zc);                               \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        norm_bwd_part_##S(const T* x, const float* rstd, const float* mean, const T* dy, float* part,      \
                          long long rows, int dim, int layer) {                                            \
        norm_bwd_part_impl<T>(x, rstd, mean, dy, part, rows, dim, layer);                                  \
    }

NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, bf16_t)

// Stage 2: out0[c] = sum_k part[k][0][c], out1[c] = sum_k part[k][1][c] (k in order).
extern "C" __global__ void norm_sum_parts(const float* __restrict__ part, long long chunks, int dim,
                                          float* __restrict__ out0, float* __restrict__ out1, int has_out1) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    float a = 0.f, b = 0.f;
    for (long long k = 0; k < chunks; k++) {
        a += part[(k * 2) * dim + c];
        b += part[(k * 2 + 1) * dim + c];
    }
    out0[c] = a;
    if (has_out1) out1[c] = b;
}
