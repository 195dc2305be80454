// Output norm then gate: y = norm(o) * silu(z) per row of dv values (rows = tokens * heads), one
// [dv] weight shared by all heads. One warp per row, fp32 math. z (and dz) are read (written) in
// place in a buffer of zld values per token, from column zoff, hpt heads per token (the in_proj
// output and its gradient). dw, db: two-stage, fixed-order sums over rows (chunks of GN_RB rows,
// then chunks in order); no atomics.

#define GN_RB 256  // rows per partial (crate::ops::REDUCE_BLOCK)

__device__ __forceinline__ float gn_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gn_silu(float x) { return x * gn_sigmoid(x); }
__device__ __forceinline__ float gn_silu_grad(float x) {
    float s = gn_sigmoid(x);
    return s * (1.f + x * (1.f - s));
}

// Start of row `row`'s z values: rows are (token, head) pairs, `hpt` heads per token, z read in
// place from a buffer of `zld` values per token starting at column `zoff`.
__device__ __forceinline__ long long gn_zrow(long long row, long long zld, int zoff, int hpt, int dim) {
    long long t = row / hpt;
    return t * zld + zoff + (row - t * hpt) * (long long)dim;
}

template <typename T>
__device__ __forceinline__ void gn_fwd_impl(const T* __restrict__ o, const T* __restrict__ z,
                                            const float* __restrict__ w, const float* __restrict__ b, int has_b,
                                            T* __restrict__ y, float* __restrict__ rstd_out,
                                            float* __restrict__ mean_out, long long rows, int dim, int layer,
                                            float eps, int zc, long long zld, int zoff, int hpt) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* orow = o + row * dim;
    const T* zr = z + gn_zrow(row, zld, zoff, hpt, dim);
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

// One row of the backward: dz = dy * norm(o) * silu'(z) (written in place at z's position in
// dz's buffer), dn = dy * silu(z), do = norm backward of dn. With `acc` (shared memory of this
// warp, [2][dim]), adds the row's dn * xhat and dn to the lane's own columns.
template <typename T>
__device__ __forceinline__ void gn_bwd_row(const T* __restrict__ o, const T* __restrict__ z,
                                           const float* __restrict__ w, const float* __restrict__ b, int has_b,
                                           const float* __restrict__ rstd_in, const float* __restrict__ mean_in,
                                           const T* __restrict__ dy, T* __restrict__ d_o, T* __restrict__ dz,
                                           long long row, int dim, int layer, int zc, long long zld, int zoff, int hpt,
                                           int lane, float* acc) {
    long long base = row * dim;
    long long zb = gn_zrow(row, zld, zoff, hpt, dim);
    float mean = layer ? mean_in[row] : 0.f;
    float rstd = rstd_in[row];
    float s1 = 0.f, s2 = 0.f;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float xhat = (ld(o, base + i) - mean) * rstd;
        float n = xhat * g;
        if (has_b) n += b[i];
        float zv = ld(z, zb + i), d = ld(dy, base + i);
        st(dz, zb + i, d * n * gn_silu_grad(zv));
        float dn = d * gn_silu(zv);
        float dxh = dn * g;
        s1 += dxh;
        s2 += dxh * xhat;
        if (acc) {
            acc[i] += dn * xhat;
            acc[dim + i] += dn;
        }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    float m1 = layer ? s1 / (float)dim : 0.f;
    float m2 = s2 / (float)dim;
    for (int i = lane; i < dim; i += 32) {
        float g = zc ? 1.f + w[i] : w[i];
        float xhat = (ld(o, base + i) - mean) * rstd;
        float dn = ld(dy, base + i) * gn_silu(ld(z, zb + i));
        st(d_o, base + i, rstd * (dn * g - m1 - xhat * m2));
    }
}

// Backward without the weight-gradient partials (they come from gn_bwd_part_impl): one warp per
// row (rows wider than the fused kernel's shared memory holds).
template <typename T>
__device__ __forceinline__ void gn_bwd_dx_impl(const T* __restrict__ o, const T* __restrict__ z,
                                               const float* __restrict__ w, const float* __restrict__ b, int has_b,
                                               const float* __restrict__ rstd_in, const float* __restrict__ mean_in,
                                               const T* __restrict__ dy, T* __restrict__ d_o, T* __restrict__ dz,
                                               long long rows, int dim, int layer, int zc, long long zld, int zoff,
                                               int hpt) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    gn_bwd_row(o, z, w, b, has_b, rstd_in, mean_in, dy, d_o, dz, row, dim, layer, zc, zld, zoff, hpt, lane,
               (float*)0);
}

// Backward with the weight-gradient partials fused: one block per chunk of GN_RB rows; warp wp
// takes rows r0 + wp, r0 + wp + 8, ... in order and adds dn * xhat, dn to its own [2][dim] slice
// of shared memory (each lane only its own columns: no races); then the 8 slices are summed in
// warp order into part[chunk][2][dim]. Dynamic shared memory: 8 * 2 * dim floats.
template <typename T>
__device__ __forceinline__ void gn_bwd_fused_impl(const T* __restrict__ o, const T* __restrict__ z,
                                                  const float* __restrict__ w, const float* __restrict__ b,
                                                  int has_b, const float* __restrict__ rstd_in,
                                                  const float* __restrict__ mean_in, const T* __restrict__ dy,
                                                  T* __restrict__ d_o, T* __restrict__ dz, float* __restrict__ part,
                                                  long long rows, int dim, int layer, int zc, long long zld, int zoff,
                                                  int hpt) {
    extern __shared__ float gn_acc[];
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* acc = gn_acc + (long long)wp * 2 * dim;
    for (int i = lane; i < 2 * dim; i += 32) acc[i] = 0.f;
    __syncwarp();
    long long chunk = blockIdx.x;
    long long r0 = chunk * GN_RB, r1 = min(r0 + GN_RB, rows);
    for (long long row = r0 + wp; row < r1; row += nw)
        gn_bwd_row(o, z, w, b, has_b, rstd_in, mean_in, dy, d_o, dz, row, dim, layer, zc, zld, zoff, hpt, lane,
                   acc);
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * dim; i += blockDim.x) {
        float s = gn_acc[i];
        for (int v = 1; v < nw; v++) s += gn_acc[(long long)v * 2 * dim + i];
        part[chunk * 2 * dim + i] = s;
    }
}

// Stage 1 of dw = sum_rows dn * xhat, db = sum_rows dn (dn = dy * silu(z)) for rows wider than the
// fused kernel takes. part: [chunk][2][dim].
template <typename T>
__device__ __forceinline__ void gn_bwd_part_impl(const T* __restrict__ o, const T* __restrict__ z,
                                                 const float* __restrict__ rstd_in,
                                                 const float* __restrict__ mean_in, const T* __restrict__ dy,
                                                 float* __restrict__ part, long long rows, int dim, int layer,
                                                 long long zld, int zoff, int hpt) {
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
            float dn = ld(dy, i) * gn_silu(ld(z, gn_zrow(r, zld, zoff, hpt, dim) + c));
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
                           float* rstd, float* mean, long long rows, int dim, int layer, float eps, int zc, \
                           long long zld, int zoff, int hpt) {                                             \
        gn_fwd_impl<T>(o, z, w, b, has_b, y, rstd, mean, rows, dim, layer, eps, zc, zld, zoff, hpt);       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_bwd_dx_##S(const T* o, const T* z, const float* w, const float* b, int has_b,           \
                              const float* rstd, const float* mean, const T* dy, T* d_o, T* dz,            \
                              long long rows, int dim, int layer, int zc, long long zld, int zoff, int hpt) { \
        gn_bwd_dx_impl<T>(o, z, w, b, has_b, rstd, mean, dy, d_o, dz, rows, dim, layer, zc, zld, zoff, hpt); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_bwd_fused_##S(const T* o, const T* z, const float* w, const float* b, int has_b,        \
                                 const float* rstd, const float* mean, const T* dy, T* d_o, T* dz,         \
                                 float* part, long long rows, int dim, int layer, int zc, long long zld,   \
                                 int zoff, int hpt) {                                                      \
        gn_bwd_fused_impl<T>(o, z, w, b, has_b, rstd, mean, dy, d_o, dz, part, rows, dim, layer, zc, zld,  \
                             zoff, hpt);                                                                   \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_bwd_part_##S(const T* o, const T* z, const float* rstd, const float* mean, const T* dy, \
                                float* part, long long rows, int dim, int layer, long long zld, int zoff,  \
                                int hpt) {                                                                 \
        gn_bwd_part_impl<T>(o, z, rstd, mean, dy, part, rows, dim, layer, zld, zoff, hpt);                 \
    }

GN_KERNELS(f32, float)
GN_KERNELS(bf16, bf16_t)

// ---------------------------------------------------------------------------------------------
// Streaming kernels (rows of dim <= 128 * NC values, dim a multiple of 4, z's row stride and
// offset 4-aligned, fewer than 2^32 rows; cuda.rs picks them): one warp per row, lane l holds values
// 4 (l + 32 n) .. +3 (n < NC) in registers, loaded and stored 4 at a time; each input is read
// once, sigmoid(z) once per value.

// Start of row `row`'s z values (as gn_zrow) by 32-bit division (cuda.rs takes these kernels
// for fewer than 2^32 rows only).
__device__ __forceinline__ long long gn_zrow_fast(long long row, long long zld, int zoff, int hpt, int dim) {
    long long t = (long long)((unsigned int)row / (unsigned int)hpt);
    return t * zld + zoff + (row - t * hpt) * (long long)dim;
}

template <typename T, int NC>
__device__ __forceinline__ void gn_fwd_vec_impl(const T* __restrict__ o, const T* __restrict__ z,
                                                const float* __restrict__ w, const float* __restrict__ b,
                                                int has_b, T* __restrict__ y, float* __restrict__ rstd_out,
                                                float* __restrict__ mean_out, long long rows, int dim, int layer,
                                                float eps, int zc, long long zld, int zoff, int hpt) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* orow = o + row * dim + lane * 4;
    const T* zr = z + gn_zrow_fast(row, zld, zoff, hpt, dim) + lane * 4;
    bool on[NC];
    cv4 ov[NC], zv[NC];
#pragma unroll
    for (int n = 0; n < NC; n++) {
        on[n] = (lane + 32 * n) * 4 < dim;
        if (on[n]) {
            ov[n] = cv_ld4(orow, 128 * n);
            zv[n] = cv_ld4(zr, 128 * n);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) ov[n].v[i] = zv[n].v[i] = 0.f;
        }
    }
    float mean = 0.f;
    if (layer) {
        float s = 0.f;
#pragma unroll
        for (int n = 0; n < NC; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) s += ov[n].v[i];
        mean = warp_sum(s) / (float)dim;
    }
    float ss = 0.f;
#pragma unroll
    for (int n = 0; n < NC; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v = ov[n].v[i] - mean;
            if (on[n]) ss += v * v;
        }
    float rstd = 1.f / sqrtf(warp_sum(ss) / (float)dim + eps);
    T* yr = y + row * dim + lane * 4;
#pragma unroll
    for (int n = 0; n < NC; n++) {
        if (!on[n]) continue;
        int c = lane * 4 + 128 * n;
        float4 wv = *reinterpret_cast<const float4*>(w + c);
        float4 bv = has_b ? *reinterpret_cast<const float4*>(b + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        float wa[4] = {wv.x, wv.y, wv.z, wv.w}, ba[4] = {bv.x, bv.y, bv.z, bv.w}, out[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float g = zc ? 1.f + wa[i] : wa[i];
            float nv = (ov[n].v[i] - mean) * rstd * g;
            if (has_b) nv += ba[i];
            out[i] = nv * gn_silu(zv[n].v[i]);
        }
        cv_st4(yr, 128 * n, out);
    }
    if (lane == 0) {
        rstd_out[row] = rstd;
        if (layer) mean_out[row] = mean;
    }
}

// Backward with the weight-gradient partials: one block per chunk of GN_RB rows; warp wp takes
// rows r0 + wp, r0 + wp + 8, ... in order and keeps its dn * xhat, dn sums in registers; the 8
// warps' sums are added in warp order into part[chunk][2][dim] (red: [8][2][NC * 128]).
template <typename T, int NC>
__device__ __forceinline__ void gn_bwd_vec_impl(const T* __restrict__ o, const T* __restrict__ z,
                                                const float* __restrict__ w, const float* __restrict__ b,
                                                int has_b, const float* __restrict__ rstd_in,
                                                const float* __restrict__ mean_in, const T* __restrict__ dy,
                                                T* __restrict__ d_o, T* __restrict__ dz, float* __restrict__ part,
                                                long long rows, int dim, int layer, int zc, long long zld, int zoff,
                                                int hpt, float* red) {
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    bool on[NC];
    float g[NC][4], bb[NC][4], aw[NC][4], ab[NC][4];
#pragma unroll
    for (int n = 0; n < NC; n++) {
        int c = lane * 4 + 128 * n;
        on[n] = c < dim;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float wv = on[n] ? w[c + i] : 0.f;
            g[n][i] = zc ? 1.f + wv : wv;
            bb[n][i] = (on[n] && has_b) ? b[c + i] : 0.f;
            aw[n][i] = ab[n][i] = 0.f;
        }
    }
    const float inv_dim = 1.f / (float)dim;  // the row loop multiplies (no division call there)
    long long chunk = blockIdx.x;
    long long r0 = chunk * GN_RB, r1 = min(r0 + GN_RB, rows);
    for (long long row = r0 + wp; row < r1; row += 8) {
        long long base = row * dim + lane * 4;
        long long zb = gn_zrow_fast(row, zld, zoff, hpt, dim) + lane * 4;
        float mean = layer ? mean_in[row] : 0.f;
        float rstd = rstd_in[row];
        cv4 ov[NC], zv[NC], dv[NC];
#pragma unroll
        for (int n = 0; n < NC; n++) {
            if (on[n]) {
                ov[n] = cv_ld4(o, base + 128 * n);
                zv[n] = cv_ld4(z, zb + 128 * n);
                dv[n] = cv_ld4(dy, base + 128 * n);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) ov[n].v[i] = zv[n].v[i] = dv[n].v[i] = 0.f;
            }
        }
        float xh[NC][4], dn[NC][4];
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int n = 0; n < NC; n++) {
            float dzo[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float xhat = (ov[n].v[i] - mean) * rstd;
                float nv = xhat * g[n][i];
                if (has_b) nv += bb[n][i];
                float zz = zv[n].v[i], d = dv[n].v[i];
                float sg = gn_sigmoid(zz);
                dzo[i] = d * nv * (sg * (1.f + zz * (1.f - sg)));
                float e = d * (zz * sg);
                float dxh = e * g[n][i];
                s1 += dxh;
                s2 += dxh * xhat;
                aw[n][i] += e * xhat;
                ab[n][i] += e;
                xh[n][i] = xhat;
                dn[n][i] = e;
            }
            if (on[n]) cv_st4(dz, zb + 128 * n, dzo);
        }
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
        float m1 = layer ? s1 * inv_dim : 0.f;
        float m2 = s2 * inv_dim;
#pragma unroll
        for (int n = 0; n < NC; n++) {
            float out[4];
#pragma unroll
            for (int i = 0; i < 4; i++) out[i] = rstd * (dn[n][i] * g[n][i] - m1 - xh[n][i] * m2);
            if (on[n]) cv_st4(d_o, base + 128 * n, out);
        }
    }
    const int RW = NC * 128;
#pragma unroll
    for (int n = 0; n < NC; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = lane * 4 + 128 * n + i;
            red[(wp * 2) * RW + c] = aw[n][i];
            red[(wp * 2 + 1) * RW + c] = ab[n][i];
        }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * dim; i += blockDim.x) {
        int k = i >= dim, c = i - k * dim;
        float s = red[k * RW + c];
        for (int v = 1; v < 8; v++) s += red[(v * 2 + k) * RW + c];
        part[chunk * 2 * dim + i] = s;
    }
}

#define GN_VEC_KERNELS(S, T, NC)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_fwd_v##NC##_##S(const T* o, const T* z, const float* w, const float* b, int has_b, T* y, \
                                   float* rstd, float* mean, long long rows, int dim, int layer, float eps, \
                                   int zc, long long zld, int zoff, int hpt) {                             \
        gn_fwd_vec_impl<T, NC>(o, z, w, b, has_b, y, rstd, mean, rows, dim, layer, eps, zc, zld, zoff, hpt); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_bwd_v##NC##_##S(const T* o, const T* z, const float* w, const float* b, int has_b,      \
                                   const float* rstd, const float* mean, const T* dy, T* d_o, T* dz,       \
                                   float* part, long long rows, int dim, int layer, int zc, long long zld, \
                                   int zoff, int hpt) {                                                    \
        __shared__ __align__(16) float red[8 * 2 * NC * 128];                                              \
        gn_bwd_vec_impl<T, NC>(o, z, w, b, has_b, rstd, mean, dy, d_o, dz, part, rows, dim, layer, zc, zld, \
                               zoff, hpt, red);                                                            \
    }

GN_VEC_KERNELS(f32, float, 1)
GN_VEC_KERNELS(bf16, bf16_t, 1)
GN_VEC_KERNELS(f32, float, 2)
GN_VEC_KERNELS(bf16, bf16_t, 2)

// Stage 2, one block per column c: thread i sums chunks i, i + blockDim, ... in order, then the
// block sums the threads in a fixed tree (block_sum): out0[c] = sum_k part[k][0][c],
// out1[c] = sum_k part[k][1][c]. (One thread per column looping over every chunk took ~1 ms at
// 4096 chunks: 128 threads in all, each a serial chain of 8192 loads.)
extern "C" __global__ void __launch_bounds__(256) gated_norm_sum_parts(const float* __restrict__ part,
                                                                       long long chunks, int dim,
                                                                       float* __restrict__ out0,
                                                                       float* __restrict__ out1, int has_out1) {
    __shared__ float sh[32];
    int c = blockIdx.x;
    float a = 0.f, b = 0.f;
    for (long long k = threadIdx.x; k < chunks; k += blockDim.x) {
        a += part[(k * 2) * dim + c];
        b += part[(k * 2 + 1) * dim + c];
    }
    a = block_sum(a, sh);
    b = block_sum(b, sh);
    if (threadIdx.x == 0) {
        out0[c] = a;
        if (has_out1) out1[c] = b;
    }
}

// ---- The streaming forward for a programmatic dependent launch (issue 14, the decode step's
// opt-in GDN_DECODE_PDL=1): wait for the kernel before it on the stream (the decode rule that
// writes o) before touching memory, then let the next kernel launch. Otherwise gated_norm_fwd_v*:
// the same bits. Without PDL (an ordinary launch, below sm_90) the wait and the trigger do nothing.
__device__ __forceinline__ void gn_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define GN_VEC_PDL_KERNELS(S, T, NC)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        gated_norm_fwd_pdl_v##NC##_##S(const T* o, const T* z, const float* w, const float* b, int has_b,  \
                                       T* y, float* rstd, float* mean, long long rows, int dim, int layer,  \
                                       float eps, int zc, long long zld, int zoff, int hpt) {              \
        gn_pdl_enter();                                                                                    \
        gn_fwd_vec_impl<T, NC>(o, z, w, b, has_b, y, rstd, mean, rows, dim, layer, eps, zc, zld, zoff, hpt); \
    }

GN_VEC_PDL_KERNELS(f32, float, 1)
GN_VEC_PDL_KERNELS(bf16, bf16_t, 1)
GN_VEC_PDL_KERNELS(f32, float, 2)
GN_VEC_PDL_KERNELS(bf16, bf16_t, 2)
