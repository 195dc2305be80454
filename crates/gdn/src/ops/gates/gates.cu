// Gates of GDN and GDN2, fp32 math.
//
// Decay: g[t, j] = -exp(A_log[j / group]) * softplus(x[t, j] + dt_bias[j]) over x [rows, cols]
// (GDN: cols = heads, group = 1, dt_bias per head; GDN2: cols = key_heads * dk, group = dk,
// dt_bias per channel). softplus is PyTorch's (threshold 20). Sigmoid gates: y = 1 / (1 + exp(-x)).
// Parameter gradients dA_log, ddt_bias: two-stage, fixed-order sums over rows (chunks of GATES_RB
// rows; 8 lanes per column in a fixed interleave, then lanes in order, then chunks in order).

#define GATES_RB 256  // rows per partial (crate::ops::REDUCE_BLOCK)

__device__ __forceinline__ float gates_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gates_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float gates_softplus_grad(float x) {
    if (x > 20.f) return 1.f;
    float z = expf(x);
    return z / (z + 1.f);
}

template <typename T>
__device__ __forceinline__ void decay_fwd_impl(const T* __restrict__ x, const float* __restrict__ a_log,
                                               const float* __restrict__ dt_bias, float* __restrict__ g,
                                               long long n, int cols, int group) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        int j = (int)(i % cols);
        float na = -expf(a_log[j / group]);
        g[i] = na * gates_softplus(ld(x, i) + dt_bias[j]);
    }
}

// Stage 1 of the decay backward: dx (elementwise) and per chunk of rows the partial sums
// [g * dg | dx] per column. Block (32 columns x 8 lanes), grid (chunks, column tiles).
// part: [chunk][2][cols].
template <typename T>
__device__ __forceinline__ void decay_bwd_impl(const T* __restrict__ x, const float* __restrict__ a_log,
                                               const float* __restrict__ dt_bias, const float* __restrict__ dg,
                                               T* __restrict__ dx, float* __restrict__ part, long long rows,
                                               int cols, int group) {
    __shared__ float sa[8][33], sd[8][33];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    int c = blockIdx.y * 32 + tx;
    long long chunk = blockIdx.x;
    long long r0 = chunk * GATES_RB, r1 = min(r0 + GATES_RB, rows);
    float pa = 0.f, pd = 0.f;
    if (c < cols) {
        float na = -expf(a_log[c / group]);
        float bias = dt_bias[c];
        for (long long r = r0 + ty; r < r1; r += 8) {
            long long i = r * cols + c;
            float v = ld(x, i) + bias;
            float gv = na * gates_softplus(v);
            float d = na * gates_softplus_grad(v) * dg[i];
            st(dx, i, d);
            pa += gv * dg[i];
            pd += d;
        }
    }
    sa[ty][tx] = pa;
    sd[ty][tx] = pd;
    __syncthreads();
    if (ty == 0 && c < cols) {
        float a = sa[0][tx], d = sd[0][tx];
        for (int l = 1; l < 8; l++) {
            a += sa[l][tx];
            d += sd[l][tx];
        }
        part[(chunk * 2) * cols + c] = a;
        part[(chunk * 2 + 1) * cols + c] = d;
    }
}

template <typename T>
__device__ __forceinline__ void sigmoid_fwd_impl(const T* __restrict__ x, T* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        st(y, i, gates_sigmoid(ld(x, i)));
}

// dx = dy * y * (1 - y), from the output y.
template <typename T>
__device__ __forceinline__ void sigmoid_bwd_impl(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                                                 long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float yv = ld(y, i);
        st(dx, i, ld(dy, i) * yv * (1.f - yv));
    }
}

// dx = dy * s * (1 - s), s = sigmoid(x) recomputed in fp32.
template <typename T>
__device__ __forceinline__ void sigmoid_bwd_x_impl(const T* __restrict__ x, const T* __restrict__ dy,
                                                   T* __restrict__ dx, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = gates_sigmoid(ld(x, i));
        st(dx, i, ld(dy, i) * s * (1.f - s));
    }
}

#define GATES_KERNELS(S, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        decay_fwd_##S(const T* x, const float* a_log, const float* dt_bias, float* g, long long n, int cols, \
                      int group) {                                                                         \
        decay_fwd_impl<T>(x, a_log, dt_bias, g, n, cols, group);                                           \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        decay_bwd_##S(const T* x, const float* a_log, const float* dt_bias, const float* dg, T* dx,        \
                      float* part, long long rows, int cols, int group) {                                  \
        decay_bwd_impl<T>(x, a_log, dt_bias, dg, dx, part, rows, cols, group);                             \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) sigmoid_fwd_##S(const T* x, T* y, long long n) {     \
        sigmoid_fwd_impl<T>(x, y, n);                                                                      \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        sigmoid_bwd_##S(const T* y, const T* dy, T* dx, long long n) {                                     \
        sigmoid_bwd_impl<T>(y, dy, dx, n);                                                                 \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        sigmoid_bwd_x_##S(const T* x, const T* dy, T* dx, long long n) {                                   \
        sigmoid_bwd_x_impl<T>(x, dy, dx, n);                                                               \
    }

GATES_KERNELS(f32, float)
GATES_KERNELS(bf16, bf16_t)

// Stage 2 of the decay backward, one thread per output: ddt_bias[c] = sum_k part[k][1][c];
// dA_log[h] = sum_k sum_{c in head h} part[k][0][c]. Chunks in order, columns in order.
extern "C" __global__ void decay_sum_parts(const float* __restrict__ part, long long chunks, int cols, int group,
                                           float* __restrict__ da_log, float* __restrict__ ddt) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int heads = cols / group;
    if (i < cols) {
        float s = 0.f;
        for (long long k = 0; k < chunks; k++) s += part[(k * 2 + 1) * cols + i];
        ddt[i] = s;
    } else if (i < cols + heads) {
        int h = i - cols;
        float s = 0.f;
        for (long long k = 0; k < chunks; k++)
            for (int c = h * group; c < (h + 1) * group; c++) s += part[(k * 2) * cols + c];
        da_log[h] = s;
    }
}
