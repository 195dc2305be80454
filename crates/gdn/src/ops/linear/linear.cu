// Linear's only kernel of its own: the bf16 copy of the fp32 master weight fed to cuBLASLt
// (round to nearest even). The GEMMs themselves are cuBLASLt calls (ops/linear/cuda.rs).
extern "C" __global__ void __launch_bounds__(256) cast_f32_bf16(const float* __restrict__ x, bf16_t* __restrict__ y,
                                                               long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = f32_to_bf16(x[i]);
}
