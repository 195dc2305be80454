// acc += x, elementwise: one f32 addition per element (bf16: loaded as f32, rounded once).
template <typename T>
__device__ __forceinline__ void add_assign_impl(T* __restrict__ acc, const T* __restrict__ x, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        st(acc, i, __fadd_rn(ld(acc, i), ld(x, i)));
}

extern "C" __global__ void __launch_bounds__(256) add_assign_f32(float* acc, const float* x, long long n) {
    add_assign_impl<float>(acc, x, n);
}
extern "C" __global__ void __launch_bounds__(256) add_assign_bf16(bf16_t* acc, const bf16_t* x, long long n) {
    add_assign_impl<bf16_t>(acc, x, n);
}
