// Token embedding: the gather y[r] = E[tok_r] (fp32 weight, stored in the activation type), and its
// backward per vocabulary row: dE[v] = (accumulate ? dE[v] : 0) + dy[p0] + dy[p1] + ... over the
// positions of token v in increasing order (CSR built on the host). One block per vocabulary row,
// threads over columns; each element is a sequential sum in a fixed order: no atomics.

template <typename T>
__device__ __forceinline__ void emb_fwd_impl(const unsigned int* __restrict__ ids, const float* __restrict__ w,
                                             T* __restrict__ y, long long n, int h, int vocab) {
    long long total = n * h;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / h;
        int c = (int)(i - r * h);
        unsigned int t = ids[r];
        float v = t < (unsigned int)vocab ? w[(long long)t * h + c] : __int_as_float(0x7fc00000);
        st(y, i, v);
    }
}

template <typename T>
__device__ __forceinline__ void emb_bwd_impl(const int* __restrict__ off, const int* __restrict__ pos,
                                             const T* __restrict__ dy, float* __restrict__ de, int h, int accumulate) {
    long long v = blockIdx.x;
    int p0 = off[v], p1 = off[v + 1];
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
        float a = accumulate ? de[v * h + c] : 0.f;
        for (int p = p0; p < p1; p++) a = __fadd_rn(a, ld(dy, (long long)pos[p] * h + c));
        de[v * h + c] = a;
    }
}

#define EMB_KERNELS(S, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
        emb_fwd_##S(const unsigned int* ids, const float* w, T* y, long long n, int h, int vocab) {      \
        emb_fwd_impl<T>(ids, w, y, n, h, vocab);                                                         \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
        emb_bwd_##S(const int* off, const int* pos, const T* dy, float* de, int h, int accumulate) {     \
        emb_bwd_impl<T>(off, pos, dy, de, h, accumulate);                                                \
    }

EMB_KERNELS(f32, float)
EMB_KERNELS(bf16, bf16_t)
