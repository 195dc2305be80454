// AdamW update over fp32 buffers, with the CPU's arithmetic exactly: every operation a
// round-to-nearest intrinsic (no fused multiply-add), in the order of ops/adamw/cpu.rs.
// And the sums of squares of the global gradient norm: per buffer, SS_BLOCKS blocks each add a
// grid-strided share in f64 (fixed per-thread order, fixed tree over the block), then one thread per
// buffer adds its block partials in order. No atomics.

#define SS_BLOCKS 256

extern "C" __global__ void __launch_bounds__(256)
    adamw_step(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, const float* __restrict__ g,
               long long n, float b1, float omb1, float b2, float omb2, float step_size, float bc2_sqrt, float eps,
               float wd, int has_scale, float scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float gg = has_scale ? __fmul_rn(g[i], scale) : g[i];
        float pp = p[i];
        pp = __fsub_rn(pp, __fmul_rn(wd, pp));
        float mm = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gg));
        float vv = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(omb2, gg), gg));
        float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), bc2_sqrt), eps);
        pp = __fsub_rn(pp, __fdiv_rn(__fmul_rn(step_size, mm), den));
        p[i] = pp;
        m[i] = mm;
        v[i] = vv;
    }
}

extern "C" __global__ void __launch_bounds__(256)
    sumsq_part(const float* __restrict__ x, long long n, double* __restrict__ part, int k) {
    __shared__ double sh[256];
    double s = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        double d = (double)x[i];
        s = __dadd_rn(s, __dmul_rn(d, d));
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if (threadIdx.x < o) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + o]);
        __syncthreads();
    }
    if (threadIdx.x == 0) part[(long long)k * SS_BLOCKS + blockIdx.x] = sh[0];
}

extern "C" __global__ void __launch_bounds__(256)
    sumsq_final(const double* __restrict__ part, int nbuf, double* __restrict__ out) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= nbuf) return;
    double s = 0.0;
    for (int b = 0; b < SS_BLOCKS; b++) s = __dadd_rn(s, part[(long long)k * SS_BLOCKS + b]);
    out[k] = s;
}
