// Softmax cross-entropy with ignored rows (target -100), forward and backward.
//
// Forward, one 256-thread block per row: the row max and its first index (ties: the smaller index),
// the exponent sum sum_j exp((double)(l_j - max)) in f64, reduced over the block in a fixed tree
// order; lse = max + log(sum) and the row's loss lse - l[t] in f64. Optionally the softmax
// p_j = exp((double)l_j - lse), stored in the logits' type (zero rows where the target is ignored).
// Per-row losses and flags then go through one block (ce_sum) that adds them in a fixed order. No
// atomics: same inputs, same bits.

#define CE_IGNORE (-100)
#define CE_THREADS 256

template <typename T>
__device__ __forceinline__ void ce_fwd_impl(const T* __restrict__ logits, const int* __restrict__ targets,
                                            T* __restrict__ probs, int keep, double* __restrict__ row_loss,
                                            int* __restrict__ row_flag, long long rows, int vocab) {
    __shared__ float smax[CE_THREADS];
    __shared__ int sarg[CE_THREADS];
    __shared__ double ssum[CE_THREADS];
    long long r = blockIdx.x;
    if (r >= rows) return;
    int tid = threadIdx.x;
    int t = targets[r];
    const T* l = logits + r * vocab;
    if (t == CE_IGNORE) {
        if (keep)
            for (int j = tid; j < vocab; j += CE_THREADS) st(probs, r * vocab + j, 0.f);
        if (tid == 0) {
            row_loss[r] = 0.0;
            row_flag[r] = 0;
        }
        return;
    }
    // max and first arg max: each thread over its strided columns in increasing order
    float m = __int_as_float(0xff800000);
    int arg = vocab;
    for (int j = tid; j < vocab; j += CE_THREADS) {
        float v = ld(l, j);
        if (arg == vocab || v > m) {
            m = v;
            arg = j;
        }
    }
    smax[tid] = m;
    sarg[tid] = arg;
    __syncthreads();
    for (int s = CE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            float m2 = smax[tid + s];
            int a2 = sarg[tid + s];
            // take the other side when it is larger, or equal with a smaller index
            if (a2 < vocab && (sarg[tid] == vocab || m2 > smax[tid] || (m2 == smax[tid] && a2 < sarg[tid]))) {
                smax[tid] = m2;
                sarg[tid] = a2;
            }
        }
        __syncthreads();
    }
    m = smax[0];
    arg = sarg[0];
    double s = 0.0;
    for (int j = tid; j < vocab; j += CE_THREADS) s += exp((double)__fsub_rn(ld(l, j), m));
    ssum[tid] = s;
    __syncthreads();
    for (int k = CE_THREADS / 2; k > 0; k >>= 1) {
        if (tid < k) ssum[tid] = ssum[tid] + ssum[tid + k];
        __syncthreads();
    }
    double lse = (double)m + log(ssum[0]);
    if (keep)
        for (int j = tid; j < vocab; j += CE_THREADS) st(probs, r * vocab + j, (float)exp((double)ld(l, j) - lse));
    if (tid == 0) {
        bool ok = t >= 0 && t < vocab;
        row_loss[r] = ok ? lse - (double)ld(l, t) : __longlong_as_double(0x7ff8000000000000LL);
        row_flag[r] = 1 + (ok && arg == t ? 1 : 0);
    }
}

#define CE_KERNELS(S, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(CE_THREADS)                                              \
        ce_fwd_##S(const T* logits, const int* targets, T* probs, int keep, double* row_loss, int* row_flag, \
                   long long rows, int vocab) {                                                           \
        ce_fwd_impl<T>(logits, targets, probs, keep, row_loss, row_flag, rows, vocab);                    \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                     \
        ce_bwd_##S(const T* probs, const int* targets, T* d, long long rows, int vocab, float inv) {      \
        long long n = rows * vocab;                                                                       \
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                       \
             i += (long long)gridDim.x * blockDim.x) {                                                    \
            long long r = i / vocab;                                                                      \
            int j = (int)(i - r * vocab);                                                                 \
            int t = targets[r];                                                                           \
            float v = 0.f;                                                                                \
            if (t != CE_IGNORE) {                                                                         \
                v = __fmul_rn(ld(probs, i), inv);                                                         \
                if (j == t) v = __fsub_rn(v, inv);                                                        \
            }                                                                                             \
            st(d, i, v);                                                                                  \
        }                                                                                                 \
    }

CE_KERNELS(f32, float)
CE_KERNELS(bf16, bf16_t)

// The statistics: out[0] = sum of row losses (f64), out[1] = target rows, out[2] = correct rows.
// One block: thread i adds rows i, i + 256, ... in order; then a fixed tree over the threads.
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    ce_sum(const double* __restrict__ row_loss, const int* __restrict__ row_flag, long long rows,
           double* __restrict__ out) {
    __shared__ double sl[CE_THREADS];
    __shared__ long long sc[CE_THREADS], sk[CE_THREADS];
    int tid = threadIdx.x;
    double l = 0.0;
    long long c = 0, k = 0;
    for (long long r = tid; r < rows; r += CE_THREADS) {
        int f = row_flag[r];
        if (f > 0) {
            l += row_loss[r];
            c += 1;
            k += (f == 2);
        }
    }
    sl[tid] = l;
    sc[tid] = c;
    sk[tid] = k;
    __syncthreads();
    for (int s = CE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            sl[tid] = sl[tid] + sl[tid + s];
            sc[tid] += sc[tid + s];
            sk[tid] += sk[tid + s];
        }
        __syncthreads();
    }
    if (tid == 0) {
        out[0] = sl[0];
        out[1] = (double)sc[0];
        out[2] = (double)sk[0];
    }
}
