// Output norm then gate: y = norm(o) * silu(z) per row of dv values (rows = tokens * heads), one
// [dv] weight shared by all heads. One warp per row, fp32 math. dw, db: two-stage, fixed-order
// sums over rows (chunks of GN_RB rows, then chunks in order); no atomics.

#define GN_RB 256  // rows per partial (crate::ops::REDUCE_BLOCK)

__device__ __forceinline__ float gn_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gn_silu(float x) { return x * gn_sigmoid(x); }
__device__ __forceinline__ float gn_silu_grad(float x) {
    float s = gn_sigmoid(x);
    return s * (1.f + x * (1.f - s));
}

template <typename T>
__device__ __forceinline__ void gn_fwd_impl(const T* __restrict__ o, const T* __restrict__ z,
                                            const float* __restrict__ w, const float* __restrict__ b, int has_b,
                                            T* __restrict__ y, float* __restrict__ rstd_out,
                                            float* __restrict__ mean_out, long long rows, int dim, int layer,
                                            float eps, int zc) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* orow = o + row * dim;
    const T* zr = z + row * dim;
    float mean = 0.f;
    if (layer) {
        float s = 0.f;
        for (int i = lane; i < dim; i += 32) s += ld(orow, i);
        mean = warp_sum(s) / (float)dim;
    }
    float ss = 0.f;
    for (int i = lane; i < dim; i += 32) {
        float v = ld(orow, i) - mean;
        ss += v * v;
    }
    float rstd = 1.f / sqrtf(warp_sum(ss) / (float)dim + eps);
    T* yr = y + row * dim;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float n = (ld(orow, i) - mean) * rstd * g;
        if (has_b) n += b[i];
        st(yr, i, n * gn_silu(ld(zr, i)));
    }
    if (lane == 0) {
        rstd_out[row] = rstd;
        if (layer) mean_out[row] = mean;
    }
}

// dz = dy * norm(o) * silu'(z); dn = dy * silu(z); do = norm backward of dn.
template <typename T>
__device__ __forceinline__ void gn_bwd_dx_impl(const T* __restrict__ o, const T* __restrict__ z,
                                               const float* __restrict__ w, const float* __restrict__ b, int has_b,
                                               const float* __restrict__ rstd_in, const float* __restrict__ mean_in,
                                               const T* __restrict__ dy, T* __restrict__ d_o, T* __restrict__ dz,
                                               long long rows, int dim, int layer, int zc) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    long long base = row * dim;
    float mean = layer ? mean_in[row] : 0.f;
    float rstd = rstd_in[row];
    float s1 = 0.f, s2 = 0.f;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float xhat = (ld(o, base + i) - mean) * rstd;
        float n = xhat * g;
        if (has_b) n += b[i];
        float zv = ld(z, base + i), d = ld(dy, base + i);
        st(dz, base + i, d * n * gn_silu_grad(zv));
        float dxh = d * gn_silu(zv) * g;
        s1 += dxh;
        s2 += dxh * xhat;
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    float m1 = layer ? s1 / (float)dim : 0.f;
    float m2 = s2 / (float)dim;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float xhat = (ld(o, base + i) - mean) * rstd;
        float dn = ld(dy, base + i) * gn_silu(ld(z, base + i));
        st(d_o, base + i, rstd * (dn * g - m1 - xhat * m2));
    }
}

// Stage 1 of dw = sum_rows dn * xhat, db = sum_rows dn (dn = dy * silu(z)). part: [chunk][2][dim].
template <typename T>
__device__ __forceinline__ void gn_bwd_part_impl(const T* __restrict__ o, const T* __restrict__ z,
                                                 const float* __restrict__ rstd_in,
                                                 const float* __restrict__ mean_in, const T* __restrict__ dy,
                                                 float* __restrict__ part, long long rows, int dim, int layer) {
    __shared__ float sw[8][33], sb[8][33];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    int c = blockIdx.y * 32 + tx;
    long long chunk = blockIdx.x;
    long long r0 = chunk * GN_RB, r1 = min(r0 + GN_RB, rows);
    float aw = 0.f, ab = 0.f;
    if (c < dim) {
        for (long long r = r0 + ty; r < r1; r += 8) {
            long long i = r * dim + c;
            float mean = layer ? mean_in[r] : 0.f;
            float xhat = (ld(o, i) - mean) * rstd_in[r];
            float dn = ld(dy, i) * gn_silu(ld(z, i));
            aw += dn * xhat;
            ab += dn;
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

#define GN_KERNELS(S, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_fwd_##S(const T* o, const T* z, const float* w, const float* b, int has_b, T* y,        \
                           float* rstd, float* mean, long long rows, int dim, int layer, float eps, int zc) { \
        gn_fwd_impl<T>(o, z, w, b, has_b, y, rstd, mean, rows, dim, layer, eps, zc);                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_bwd_dx_##S(const T* o, const T* z, const float* w, const float* b, int has_b,           \
                              const float* rstd, const float* mean, const T* dy, T* d_o, T* dz,            \
                              long long rows, int dim, int layer, int zc) {                                \
        gn_bwd_dx_impl<T>(o, z, w, b, has_b, rstd, mean, dy, d_o, dz, rows, dim, layer, zc);               \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_bwd_part_##S(const T* o, const T* z, const float* rstd, const float* mean, const T* dy, \
                                float* part, long long rows, int dim, int layer) {                         \
        gn_bwd_part_impl<T>(o, z, rstd, mean, dy, part, rows, dim, layer);                                 \
    }

GN_KERNELS(f32, float)
GN_KERNELS(bf16, bf16_t)

// Stage 2: out0[c] = sum_k part[k][0][c], out1[c] = sum_k part[k][1][c] (k in order).
extern "C" __global__ void gated_norm_sum_parts(const float* __restrict__ part, long long chunks, int dim,
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
