// Skinny GEMM for the decode projections (issue 14): y[m, n] = sum_k x[m, k] W[n, k] for few
// token rows m (M <= 8 NT <= 64), bf16 x [M, K] and W [N, K] (row-major, PyTorch's layout), fp32
// accumulation, bf16 y [M, N] (round to nearest even). The weights are the bytes: each weight
// byte is loaded once, 16 bytes per lane per load, straight into registers (no shared-memory
// staging), one chunk of SK_U 32-wide k steps loading while the previous chunk multiplies.
//
// Tensor cores, "swapped": the weight rows are the M side of mma.sync.m16n8k16 (16 rows per warp
// tile) and the tokens the N side (8 per tile, NT tiles), so a batch of 1..8 tokens wastes
// nothing on the weight side. Within a 32-wide k step lane (g = lane / 4, t = lane % 4) loads
// W[row g][8t .. 8t+8), W[row g+8][8t .. 8t+8) and, per token tile, x[token g][8t .. 8t+8): one
// 16-byte load each. The two MMAs of the step take the first and the second half of those 8
// values as their fragments: k is permuted within the step the same way for W and for x, so the
// products are the same, only which MMA sums which k (a fixed choice) changes.
//
// CTA: WM x WS warps. Warp (wm, ws) takes the 16 rows slab*16WM + 16wm.. of W and the ws-th of WS
// equal k ranges of this CTA's k range; the flat grid of slabs x S CTAs (blockIdx.x = split *
// slabs + slab) gives CTA `split` of a slab one of S equal k ranges of K (split-K across CTAs). Sums, all in fixed orders (no atomics in any sum):
//  - each warp: its k steps in order, accumulated in the MMA's fp32 accumulators;
//  - the CTA: warp ws = 0 adds the partials of ws = 1, 2, .. in order (shared memory);
//  - S > 1: each CTA writes its fp32 partial tile to `part`; the CTA that finishes last (a counter
//    per slab, the only atomic: it picks who sums, not what is summed) adds the S partials in
//    split order 0, 1, .. and writes y, then puts the counter back to 0 for the next launch.
// So the bits of y depend on (M, N, K, the plan), never on timing: reruns are bitwise equal.
//
// Rows >= N and tokens >= M read a valid row (the last) and are never stored.

#define SK_U 4  // 32-wide k steps per chunk: a lane has 2 SK_U 16-byte weight loads in flight

__device__ __forceinline__ uint4 sk_ldw(const bf16_t* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ uint4 sk_ldx(const bf16_t* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// d += A B: A 16x16 bf16 (row), B 16x8 bf16 (col), fp32 accumulators.
__device__ __forceinline__ void sk_mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                       unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp's 16 rows x (8 NT) tokens over `nchunk` chunks of SK_U 32-wide k steps starting at k0.
// acc[nt * 4 + c]: c 0, 1 row g, tokens nt*8 + 2t, +1; c 2, 3 row g + 8, same tokens.
// NORM: also the sums s1 = sum x, s2 = sum x^2 of this lane's x values of the token tiles nt with
// nt % WM == wm (each tile's sums made by one warp of each k range), in k order; slot nt / WM
// (0 or 1: the host gives NORM plans WM >= NT / 2).
template <int NT, bool NORM>
__device__ __forceinline__ void sk_warp(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, int M, int N,
                                        int K, int r0, int k0, int nchunk, float* acc, int WM, int wm, float* s1,
                                        float* s2) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ra = min(r0 + g, N - 1), rb = min(r0 + g + 8, N - 1);
    const bf16_t* wa = w + (long long)ra * K + k0 + 8 * t;
    const bf16_t* wb = w + (long long)rb * K + k0 + 8 * t;
    const bf16_t* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = x + (long long)min(nt * 8 + g, M - 1) * K + k0 + 8 * t;
#pragma unroll
    for (int i = 0; i < 4 * NT; i++) acc[i] = 0.f;
    s1[0] = s2[0] = s1[1] = s2[1] = 0.f;
    // A ring of SK_U steps in registers: step u of chunk c + 1 loads as soon as step u of chunk c
    // has been taken out, so 2 SK_U loads stay in flight while the MMAs run.
    uint4 cur[SK_U][2];
#pragma unroll
    for (int u = 0; u < SK_U; u++) {
        cur[u][0] = sk_ldw(wa + 32 * u);
        cur[u][1] = sk_ldw(wb + 32 * u);
    }
    for (int c = 0; c < nchunk; c++) {
        const int kc = c * (32 * SK_U), kn = kc + 32 * SK_U;
        const bool more = c + 1 < nchunk;
#pragma unroll
        for (int u = 0; u < SK_U; u++) {
            const uint4 a = cur[u][0], b = cur[u][1];
            if (more) {
                cur[u][0] = sk_ldw(wa + kn + 32 * u);
                cur[u][1] = sk_ldw(wb + kn + 32 * u);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 xv = sk_ldx(xr[nt] + kc + 32 * u);
                sk_mma(acc + 4 * nt, a.x, b.x, a.y, b.y, xv.x, xv.y);
                sk_mma(acc + 4 * nt, a.z, b.z, a.w, b.w, xv.z, xv.w);
                if (NORM && nt % WM == wm) {
                    const unsigned q[4] = {xv.x, xv.y, xv.z, xv.w};
                    float p1 = nt < WM ? s1[0] : s1[1], p2 = nt < WM ? s2[0] : s2[1];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float lo = __uint_as_float(q[i] << 16), hi = __uint_as_float(q[i] & 0xffff0000u);
                        p1 += lo;
                        p2 += lo * lo;
                        p1 += hi;
                        p2 += hi * hi;
                    }
                    if (nt < WM) {
                        s1[0] = p1;
                        s2[0] = p2;
                    } else {
                        s1[1] = p1;
                        s2[1] = p2;
                    }
                }
            }
        }
    }
}

// Stores a warp's 16 x 8NT tile of sums as bf16 into y [M, N]. NORM (the input norm folded in):
// y = rstd (acc - mean c1[row]) (+ c2[row]) with the token's mean (LayerNorm; 0 for RMSNorm) and
// rstd from the per-k-range sums in `sst` ([WS][2][8 NT], added in k-range order).
template <int NT, bool NORM>
__device__ __forceinline__ void sk_store(bf16_t* __restrict__ y, int M, int N, int K, int r0, const float* acc,
                                         const float* sst, int WS, int layer, float eps,
                                         const float* __restrict__ c1, const float* __restrict__ c2) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float mean[2 * NT], rstd[2 * NT];
    if (NORM) {
#pragma unroll
        for (int i = 0; i < 2 * NT; i++) {
            const int tok = (i >> 1) * 8 + 2 * t + (i & 1);
            float a = 0.f, b = 0.f;
            for (int v = 0; v < WS; v++) {
                a += sst[(2 * v) * 8 * NT + tok];
                b += sst[(2 * v + 1) * 8 * NT + tok];
            }
            const float mu = layer ? a / (float)K : 0.f;
            const float var = fmaxf(b / (float)K - mu * mu, 0.f);
            mean[i] = mu;
            rstd[i] = 1.f / sqrtf(var + eps);
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int r = r0 + g + (c >= 2 ? 8 : 0), tok = nt * 8 + 2 * t + (c & 1);
            if (r < N && tok < M) {
                float v = acc[4 * nt + c];
                if (NORM) {
                    const int i = 2 * nt + (c & 1);
                    v = layer ? rstd[i] * (v - mean[i] * c1[r]) : rstd[i] * v;
                    if (c2) v += c2[r];
                }
                y[(long long)tok * N + r] = f32_to_bf16(v);
            }
        }
}

// Grid slabs S (slabs = ceil(N / (16 WM))), block 32 WM WS threads, dynamic shared memory
// (WS - 1) WM 128 NT floats + 16 bytes. K = S WS nchunk 32 SK_U (the host's plan).
// part: S slabs WM 128 NT floats (S > 1); counters: `slabs` zeros (S > 1), left zero.
// NORM (S = 1 only, the host checks): x is the norm's raw input, W the weight with the norm's
// scale folded in, c1 / c2 its row constants (see skinny_norm_t* below); shared memory has
// 2 WS 8 NT floats more.
template <int NT, bool NORM>
__device__ __forceinline__ void skinny_impl(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                            bf16_t* __restrict__ y, float* __restrict__ part,
                                            unsigned* __restrict__ counters, int M, int N, int K, int WM, int WS,
                                            int nchunk, int slabs, int S, int layer, float eps,
                                            const float* __restrict__ c1, const float* __restrict__ c2) {
    extern __shared__ __align__(16) float sk_red[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WM, ws = warp / WM;
    const int slab = blockIdx.x % slabs, split = blockIdx.x / slabs;
    const int r0 = slab * 16 * WM + 16 * wm;
    const int kw = nchunk * 32 * SK_U;
    const int k0 = (split * WS + ws) * kw;
    float acc[4 * NT], s1[2], s2[2];
    sk_warp<NT, NORM>(x, w, M, N, K, r0, k0, nchunk, acc, WM, wm, s1, s2);
    const int TILE = 4 * NT * 32;  // floats of one warp's tile, lane-major: [j][lane]
    float* sst = sk_red + (WS - 1) * WM * TILE + 4;  // NORM: [WS][2][8 NT] token sums
    if (NORM) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            if (nt % WM != wm) continue;
            float a = nt < WM ? s1[0] : s1[1], b = nt < WM ? s2[0] : s2[1];
            a += __shfl_xor_sync(0xffffffffu, a, 1);
            b += __shfl_xor_sync(0xffffffffu, b, 1);
            a += __shfl_xor_sync(0xffffffffu, a, 2);
            b += __shfl_xor_sync(0xffffffffu, b, 2);
            if (t == 0) {
                sst[(2 * ws) * 8 * NT + nt * 8 + g] = a;
                sst[(2 * ws + 1) * 8 * NT + nt * 8 + g] = b;
            }
        }
    }
    if (WS > 1 || NORM) {
        if (ws > 0) {
            float* dst = sk_red + ((ws - 1) * WM + wm) * TILE;
#pragma unroll
            for (int j = 0; j < 4 * NT; j++) dst[j * 32 + lane] = acc[j];
        }
        __syncthreads();
        if (ws == 0) {
            for (int v = 1; v < WS; v++) {
                const float* src = sk_red + ((v - 1) * WM + wm) * TILE;
#pragma unroll
                for (int j = 0; j < 4 * NT; j++) acc[j] += src[j * 32 + lane];
            }
        }
    }
    if (S == 1) {
        if (ws == 0) sk_store<NT, NORM>(y, M, N, K, r0, acc, sst, WS, layer, eps, c1, c2);
        return;
    }
    float* mine = part + (((long long)split * slabs + slab) * WM + wm) * TILE;
    if (ws == 0) {
#pragma unroll
        for (int j = 0; j < 4 * NT; j++) mine[j * 32 + lane] = acc[j];
    }
    __threadfence();
    __syncthreads();
    unsigned* flag = reinterpret_cast<unsigned*>(sk_red + (WS - 1) * WM * TILE);
    if (threadIdx.x == 0) {
        const unsigned done = atomicAdd(counters + slab, 1u);
        const unsigned last = done == (unsigned)(S - 1);
        if (last) counters[slab] = 0u;  // ready for the next launch (nobody else touches it now)
        *flag = last;
    }
    __syncthreads();
    if (*flag == 0u || ws != 0) return;
    __threadfence();
#pragma unroll
    for (int j = 0; j < 4 * NT; j++) acc[j] = 0.f;
    for (int sp = 0; sp < S; sp++) {
        const float* src = part + (((long long)sp * slabs + slab) * WM + wm) * TILE;
#pragma unroll
        for (int j = 0; j < 4 * NT; j++) acc[j] += __ldcg(src + j * 32 + lane);
    }
    sk_store<NT, false>(y, M, N, K, r0, acc, sst, WS, 0, 0.f, c1, c2);
}

// Launch bounds: 512 threads (16 warps) for NT <= 4; NT = 8 takes at most 384 (12 warps: its
// 4 x 8 accumulators spilled at 128 registers).
#define SKINNY(NT, MAXT)                                                                                          \
    extern "C" __global__ void __launch_bounds__(MAXT) skinny_gemm_t##NT(                                         \
        const bf16_t* x, const bf16_t* w, bf16_t* y, float* part, unsigned* counters, int M, int N, int K, int WM, \
        int WS, int nchunk, int slabs, int S) {                                                                   \
        skinny_impl<NT, false>(x, w, y, part, counters, M, N, K, WM, WS, nchunk, slabs, S, 0, 0.f, 0, 0);         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MAXT) skinny_norm_t##NT(                                         \
        const bf16_t* x, const bf16_t* w, bf16_t* y, int M, int N, int K, int WM, int WS, int nchunk, int slabs,  \
        int layer, float eps, const float* c1, const float* c2) {                                                 \
        skinny_impl<NT, true>(x, w, y, 0, 0, M, N, K, WM, WS, nchunk, slabs, 1, layer, eps, c1, c2);              \
    }
SKINNY(1, 512)
SKINNY(2, 512)
SKINNY(4, 512)
SKINNY(8, 384)

// The input norm folded into a weight (for skinny_norm_t*): norm(x) W^T with norm(x) = (x - mean)
// rstd g + b (RMSNorm: mean 0, no b), g = w or 1 + w (zero-centered), equals
// rstd (x W'^T - mean c1) + c2 per token with W' = W diag(g) (bf16, rounded once from the fp32
// master), c1[n] = sum_k W'[n, k] (of the rounded values), c2[n] = sum_k W[n, k] b[k].
// One warp per row n, lane-strided k, then the warp's fixed butterfly. g, b: [K].
extern "C" __global__ void __launch_bounds__(256) skinny_fold(const float* __restrict__ w, const float* __restrict__ gw,
                                                              int zc, const float* __restrict__ b, int has_b,
                                                              bf16_t* __restrict__ wf, float* __restrict__ c1,
                                                              float* __restrict__ c2, int N, int K) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const float* wr = w + (long long)row * K;
    bf16_t* fr = wf + (long long)row * K;
    float a = 0.f, bb = 0.f;
    for (int k = lane; k < K; k += 32) {
        const float gk = zc ? 1.f + gw[k] : gw[k];
        const bf16_t q = f32_to_bf16(wr[k] * gk);
        fr[k] = q;
        a += bf16_to_f32(q);
        if (has_b) bb += wr[k] * b[k];
    }
    a = warp_sum(a);
    bb = warp_sum(bb);
    if (lane == 0) {
        c1[row] = a;
        if (has_b) c2[row] = bb;
    }
}
