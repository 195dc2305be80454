// Probes of the wgmma primitives (ops/common/wgmma.cuh): one warpgroup computes
// C[64][N] = A B (bf16 operands, fp32 accumulation) from global memory through shared memory
// in the SW128 layout, every operand majorness, so tests/gpu_wgmma.rs can check the layout,
// the descriptors and the accumulator fragment mapping against the exact product.
//   TA 0: A stored [64][kdim] (K-major); 1: A stored [kdim][64] (M-major).
//   TB 0: B stored [N][kdim] (K-major); 1: B stored [kdim][N] (N-major).
// NB: B's stored width (N, or 64 with N = 32: the product uses B's columns 32 .. 63, so a
// descriptor starts in the middle of a panel). lbo_* / sbo_*: when nonzero, replace the descriptors' leading / stride byte offsets (the
// test's search for the right encoding when the header's is wrong). kdim: 16 .. 128, % 16.

template <int N, int TA, int TB, int NB>
__device__ void wg_probe(const bf16_t* a, const bf16_t* b, float* c, int kdim, int lbo_a, int sbo_a, int lbo_b,
                         int sbo_b) {
    __shared__ __align__(1024) unsigned char sm[64 * 128 * 2 + 128 * 128 * 2];
    unsigned char* sa = sm;
    unsigned char* sb = sm + 64 * 128 * 2;
    const int tid = threadIdx.x;
    // zero the tiles (so padding columns of a kdim < 64 panel read as 0)
    for (int e = tid; e < (int)sizeof(sm) / 4; e += blockDim.x) reinterpret_cast<unsigned*>(sm)[e] = 0u;
    __syncthreads();
    const int kp = (kdim + 63) / 64 * 64;  // the K extent the panels cover
    for (int e = tid; e < 64 * kdim; e += blockDim.x) {
        int m, k;
        if (TA) { k = e / 64; m = e % 64; } else { m = e / kdim; k = e % kdim; }
        const bf16_t x = a[TA ? k * 64 + m : m * kdim + k];
        const unsigned o = TA ? wg_tile(kp, k, m) : wg_tile(64, m, k);
        *reinterpret_cast<bf16_t*>(sa + o) = x;
    }
    for (int e = tid; e < NB * kdim; e += blockDim.x) {
        int n, k;
        if (TB) { k = e / NB; n = e % NB; } else { n = e / kdim; k = e % kdim; }
        const bf16_t x = b[TB ? k * NB + n : n * kdim + k];
        const unsigned o = TB ? wg_tile(kp, k, n) : wg_tile(NB, n, k);
        *reinterpret_cast<bf16_t*>(sb + o) = x;
    }
    wg_fence_proxy();
    __syncthreads();
    const unsigned ba = acp_smem(sa), bb = acp_smem(sb);
    const unsigned long long off_mask = ~((0x3FFFull << 16) | (0x3FFFull << 32));
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
    wg_fence();
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        unsigned long long da = TA ? wg_desc_mn(ba, kp, k0, 0) : wg_desc_k(ba, 64, k0);
        constexpr int n0 = NB - N;  // B's first column used
        unsigned long long db = TB ? wg_desc_mn(bb + n0 * 2, kp, k0, 0) : wg_desc_k(bb + n0 * 128, NB, k0);
        if (lbo_a | sbo_a)
            da = (da & off_mask) | ((unsigned long long)((lbo_a >> 4) & 0x3FFF) << 16) |
                 ((unsigned long long)((sbo_a >> 4) & 0x3FFF) << 32);
        if (lbo_b | sbo_b)
            db = (db & off_mask) | ((unsigned long long)((lbo_b >> 4) & 0x3FFF) << 16) |
                 ((unsigned long long)((sbo_b >> 4) & 0x3FFF) << 32);
        wg_mma<TA, TB>(d, da, db, 1);
    }
    wg_commit();
    wg_wait<0>();
    wg_hold(d);
    const int w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int r = 16 * w + g, col = 8 * j + 2 * t;
        c[r * N + col] = d[4 * j];
        c[r * N + col + 1] = d[4 * j + 1];
        c[(r + 8) * N + col] = d[4 * j + 2];
        c[(r + 8) * N + col + 1] = d[4 * j + 3];
    }
}

#define WG_PROBE_ENTRY(N, TA, TB, NB)                                                                 \
    extern "C" __global__ void __launch_bounds__(128, 1) wg_probe_n##N##_a##TA##_b##TB##_w##NB(        \
        const bf16_t* a, const bf16_t* b, float* c, int kdim, int lbo_a, int sbo_a, int lbo_b, int sbo_b) { \
        wg_probe<N, TA, TB, NB>(a, b, c, kdim, lbo_a, sbo_a, lbo_b, sbo_b);                          \
    }

WG_PROBE_ENTRY(64, 0, 0, 64)
WG_PROBE_ENTRY(64, 0, 1, 64)
WG_PROBE_ENTRY(64, 1, 0, 64)
WG_PROBE_ENTRY(64, 1, 1, 64)
WG_PROBE_ENTRY(128, 0, 0, 128)
WG_PROBE_ENTRY(128, 0, 1, 128)
WG_PROBE_ENTRY(128, 1, 0, 128)
WG_PROBE_ENTRY(128, 1, 1, 128)
WG_PROBE_ENTRY(32, 0, 0, 64)
WG_PROBE_ENTRY(32, 0, 1, 64)
WG_PROBE_ENTRY(32, 1, 0, 64)
WG_PROBE_ENTRY(32, 1, 1, 64)
