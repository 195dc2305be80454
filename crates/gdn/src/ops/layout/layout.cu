// Layout helpers of the layer: copy a block of columns between row-major matrices
// (in_proj's output split into sections, and gradients put back).
template <typename T>
__device__ void copy_cols(const T* src, long long scols, long long s0, T* dst, long long dcols, long long d0,
                          long long rows, long long w) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * w) return;
    long long r = i / w, c = i % w;
    dst[r * dcols + d0 + c] = src[r * scols + s0 + c];
}

extern "C" __global__ void copy_cols_f32(const float* src, long long scols, long long s0, float* dst, long long dcols,
                                         long long d0, long long rows, long long w) {
    copy_cols(src, scols, s0, dst, dcols, d0, rows, w);
}

extern "C" __global__ void copy_cols_bf16(const bf16_t* src, long long scols, long long s0, bf16_t* dst,
                                          long long dcols, long long d0, long long rows, long long w) {
    copy_cols(src, scols, s0, dst, dcols, d0, rows, w);
}

// GDN2: repeat key-head rows [n, Hk, D] to value heads [n, Hv, D] (value head j reads key head
// j / (Hv/Hk)), and sum value-head rows back to key heads, the group in head order (fp32 sums).
template <typename T>
__device__ void repeat_heads(const T* src, T* dst, long long n, int hk, int hv, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * hv * d) return;
    long long t = i / ((long long)hv * d);
    int j = (int)((i / d) % hv), c = (int)(i % d);
    dst[i] = src[(t * hk + j / (hv / hk)) * d + c];
}

template <typename T>
__device__ void sum_heads(const T* src, T* dst, long long n, int hk, int hv, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * hk * d) return;
    long long t = i / ((long long)hk * d);
    int h = (int)((i / d) % hk), c = (int)(i % d), r = hv / hk;
    float s = 0.f;
    for (int j = 0; j < r; ++j) s += ld(src, (t * hv + (long long)h * r + j) * d + c);
    st(dst, i, s);
}

extern "C" __global__ void repeat_heads_f32(const float* src, float* dst, long long n, int hk, int hv, int d) {
    repeat_heads(src, dst, n, hk, hv, d);
}
extern "C" __global__ void repeat_heads_bf16(const bf16_t* src, bf16_t* dst, long long n, int hk, int hv, int d) {
    repeat_heads(src, dst, n, hk, hv, d);
}
extern "C" __global__ void sum_heads_f32(const float* src, float* dst, long long n, int hk, int hv, int d) {
    sum_heads(src, dst, n, hk, hv, d);
}
extern "C" __global__ void sum_heads_bf16(const bf16_t* src, bf16_t* dst, long long n, int hk, int hv, int d) {
    sum_heads(src, dst, n, hk, hv, d);
}
