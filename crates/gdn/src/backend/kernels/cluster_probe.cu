// Probe of a thread-block cluster's fixed-order reduction through distributed shared memory
// (sm_90): the step the fused reverse scan + gradients kernel would run per chunk
// (bench/notes/fused-bwd-plan.md). A cluster of 4 CTAs (128 threads each) = a head's four
// column CTAs; each CTA holds a 64 x 128 fp32 partial per step (small integers from the step,
// its rank and the element, so every sum is exact), writes it to its own shared memory, and
// after one cluster barrier CTA r sums rows 16 r .. 16 r + 15 of the four partials in rank
// order 0 .. 3 (fixed: deterministic) into its running sums. Two buffers by step parity: a
// buffer is rewritten two steps later, after every CTA has passed the next step's barrier, so
// one barrier per step suffices. `read` 0: the barriers only (the probe's floor).
// out: [clusters][64][128], CTA r's rows 16 r .. 16 r + 15 of the running sums.
// tests/gpu_cluster.rs checks the sums exactly; bench_rule `cluster` times a step.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CL_PROBE_DIMS __cluster_dims__(4, 1, 1)
#else
#define CL_PROBE_DIMS
#endif

// The partial's element e (row e / 128, column e % 128) of CTA `rank` at `step`: in [-2, 2].
__device__ __forceinline__ float cl_probe_val(int step, int rank, int e) {
    return (float)((step * 7 + rank * 3 + e * 5 + (e >> 7)) % 5 - 2);
}

extern "C" __global__ void CL_PROBE_DIMS __launch_bounds__(128, 1)
    cl_probe(float* __restrict__ out, int steps, int read) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) float cl_buf[];  // 2 x 64 x 128 fp32
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int tid = threadIdx.x;
    const unsigned cluster = blockIdx.x / 4;
    // this thread's 16 elements of the CTA's quarter (rows 16 rank ..): 4 float4 at e4 = tid + 128 u
    float acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    for (int s = 0; s < steps; ++s) {
        float* b = cl_buf + (s & 1) * 64 * 128;
        // the partial: 2048 float4 over 128 threads
#pragma unroll 4
        for (int u = 0; u < 16; ++u) {
            const int e = 4 * (tid + 128 * u);
            float4 v;
            v.x = cl_probe_val(s, (int)rank, e);
            v.y = cl_probe_val(s, (int)rank, e + 1);
            v.z = cl_probe_val(s, (int)rank, e + 2);
            v.w = cl_probe_val(s, (int)rank, e + 3);
            *reinterpret_cast<float4*>(b + e) = v;
        }
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
        if (read) {
            const unsigned local = (unsigned)__cvta_generic_to_shared(b + 16 * 128 * rank);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                unsigned remote;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(q));
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    float4 v;
                    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                                 : "r"(remote + 16u * (unsigned)(tid + 128 * u)));
                    acc[4 * u] += v.x;
                    acc[4 * u + 1] += v.y;
                    acc[4 * u + 2] += v.z;
                    acc[4 * u + 3] += v.w;
                }
            }
        }
    }
    // no CTA leaves while another may still read its shared memory
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    float* o = out + (size_t)cluster * 64 * 128 + 16 * 128 * rank;
#pragma unroll
    for (int u = 0; u < 4; ++u)
        *reinterpret_cast<float4*>(o + 4 * (tid + 128 * u)) =
            make_float4(acc[4 * u], acc[4 * u + 1], acc[4 * u + 2], acc[4 * u + 3]);
#endif
}
