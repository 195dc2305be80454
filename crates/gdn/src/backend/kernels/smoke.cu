// A tiny kernel used to check the toolchain end to end: y = a * x + y (f32), and a bf16 round trip.
extern "C" __global__ void axpy_f32(const float* x, float* y, float a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void bf16_round_trip(const float* x, bf16_t* y, float* z, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { y[i] = f32_to_bf16(x[i]); z[i] = bf16_to_f32(y[i]); }
}
