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
