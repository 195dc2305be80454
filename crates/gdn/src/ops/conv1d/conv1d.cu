// Causal depthwise conv1d + SiLU over packed sequences, fp32 math.
//
// x: [tokens, xld] read at columns xoff .. xoff + ch (the in_proj output in place; xld = ch,
// xoff = 0 for a dense input); dx written at the same columns of a buffer shaped like x; y, dy:
// [tokens, ch]; w: [ch, W] fp32; bias: [ch] fp32 (optional); cu: the int64 sequence
// boundaries (nseq + 1 values, cu[nseq] = used). Zero history at every sequence start; padding
// rows (t >= used) get y = 0 and dx = 0 and add nothing to dw, dbias.
//
// Backward recomputes the pre-activation from x. One block handles a tile of CONV_TT tokens x 32
// channels (8 lanes of 32 channels): the tile's x (with a W-1 halo on both sides) and dpre (with
// a W-1 halo after) live in shared memory, so each token's dpre is computed once per tile and dx
// reads it from there. dw, dbias: per tile, lanes summed in a fixed order, then tiles summed in
// order by a second kernel; no atomics.

#define CONV_TT 128  // tokens per tile = rows per partial of dw, dbias

// The activation, its derivative and the sequence of a token: ops/common/conv.cuh (cv_*).

template <typename T>
__device__ __forceinline__ void conv_fwd_impl(const T* __restrict__ x, const float* __restrict__ w,
                                              const float* __restrict__ bias, int has_bias,
                                              const long long* __restrict__ cu, int nseq, long long used,
                                              long long tokens, int ch, int W, T* __restrict__ y, long long xld,
                                              int xoff) {
    long long n = tokens * ch;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / ch;
        int c = (int)(i - t * ch);
        if (t >= used) {
            st(y, i, 0.f);
            continue;
        }
        long long start = cu[cv_seq_of(cu, nseq, t)];
        float pre = has_bias ? bias[c] : 0.f;
        for (int k = 0; k < W; k++) {
            long long back = W - 1 - k;
            if (t - back >= start) pre += w[(long long)c * W + k] * ld(x, (t - back) * xld + xoff + c);
        }
        st(y, i, cv_silu(pre));
    }
}

// Block: 256 threads = 32 channels (tx) x 8 lanes (ty). Grid: (tiles of CONV_TT tokens, channel
// tiles of 32). Dynamic shared memory: see conv_bwd_smem in cuda.rs. part: [tile][W + 1][ch]
// (taps 0..W-1, then the bias).
template <typename T>
__device__ __forceinline__ void conv_bwd_impl(const T* __restrict__ x, const float* __restrict__ w,
                                              const float* __restrict__ bias, int has_bias,
                                              const long long* __restrict__ cu, int nseq, long long used,
                                              long long tokens, int ch, int W, const T* __restrict__ dy,
                                              T* __restrict__ dx, float* __restrict__ part, long long xld, int xoff) {
    extern __shared__ __align__(16) unsigned char conv_smem[];
    const int H = W - 1;
    const int NS = CONV_TT + H;       // tokens with a start: t0 .. t0 + TT + H - 1
    const int NX = CONV_TT + 2 * H;   // x rows: t0 - H .. t0 + TT + H - 1
    long long* sst = (long long*)conv_smem;  // [NS] sequence start (-1: padding)
    long long* sen = sst + NS;               // [TT] sequence end
    float* xs = (float*)(sen + CONV_TT);     // [NX][32]
    float* dps = xs + NX * 32;               // [NS][32]
    float* red = dps + NS * 32;              // [8][32]
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    int c = blockIdx.y * 32 + tx;
    long long tile = blockIdx.x;
    long long t0 = tile * CONV_TT;

    for (int j = threadIdx.x; j < NS; j += blockDim.x) {
        long long t = t0 + j;
        if (t < used) {
            int s = cv_seq_of(cu, nseq, t);
            sst[j] = cu[s];
            if (j < CONV_TT) sen[j] = cu[s + 1];
        } else {
            sst[j] = -1;
            if (j < CONV_TT) sen[j] = -1;
        }
    }
    for (int j = ty; j < NX; j += 8) {
        long long t = t0 - H + j;
        xs[j * 32 + tx] = (t >= 0 && t < used && c < ch) ? ld(x, t * xld + xoff + c) : 0.f;
    }
    __syncthreads();
    // dpre = dy * silu'(pre) for the tile's tokens and the H after it; 0 on padding.
    for (int j = ty; j < NS; j += 8) {
        long long t = t0 + j;
        float v = 0.f;
        if (c < ch && t < used) {
            long long start = sst[j];
            float pre = has_bias ? bias[c] : 0.f;
            for (int k = 0; k < W; k++) {
                long long back = W - 1 - k;
                if (t - back >= start) pre += w[(long long)c * W + k] * xs[(j + k) * 32 + tx];
            }
            v = ld(dy, t * ch + c) * cv_silu_grad(pre);
        }
        dps[j * 32 + tx] = v;
    }
    __syncthreads();
    // dx[t] = sum_k w[c, k] dpre[t + back] (same sequence).
    for (int j = ty; j < CONV_TT; j += 8) {
        long long t = t0 + j;
        if (t >= tokens || c >= ch) continue;
        float acc = 0.f;
        if (t < used) {
            long long end = sen[j];
            for (int k = 0; k < W; k++) {
                int back = W - 1 - k;
                if (t + back < end) acc += w[(long long)c * W + k] * dps[(j + back) * 32 + tx];
            }
        }
        st(dx, t * xld + xoff + c, acc);
    }
    // partials: tap k: sum_t dpre[t] x[t - back]; k == W: sum_t dpre[t].
    for (int k = 0; k <= W; k++) {
        float acc = 0.f;
        for (int j = ty; j < CONV_TT; j += 8) {
            long long t = t0 + j;
            if (t < used) {
                if (k == W) acc += dps[j * 32 + tx];
                else if (t - (W - 1 - k) >= sst[j]) acc += dps[j * 32 + tx] * xs[(j + k) * 32 + tx];
            }
        }
        red[ty * 32 + tx] = acc;
        __syncthreads();
        if (ty == 0 && c < ch) {
            float s = red[tx];
            for (int l = 1; l < 8; l++) s += red[l * 32 + tx];
            part[(tile * (W + 1) + k) * ch + c] = s;
        }
        __syncthreads();
    }
}

#define CONV_KERNELS(S, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        conv1d_silu_fwd_##S(const T* x, const float* w, const float* bias, int has_bias, const long long* cu, \
                            int nseq, long long used, long long tokens, int ch, int W, T* y, long long xld, \
                            int xoff) {                                                                    \
        conv_fwd_impl<T>(x, w, bias, has_bias, cu, nseq, used, tokens, ch, W, y, xld, xoff);               \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        conv1d_silu_bwd_##S(const T* x, const float* w, const float* bias, int has_bias, const long long* cu, \
                            int nseq, long long used, long long tokens, int ch, int W, const T* dy, T* dx,  \
                            float* part, long long xld, int xoff) {                                        \
        conv_bwd_impl<T>(x, w, bias, has_bias, cu, nseq, used, tokens, ch, W, dy, dx, part, xld, xoff);    \
    }

CONV_KERNELS(f32, float)
CONV_KERNELS(bf16, bf16_t)

// Stage 2, one thread per (k, c): tiles summed in order. dw[c, k] for k < W, dbias[c] for k == W.
extern "C" __global__ void conv1d_sum_parts(const float* __restrict__ part, long long tiles, int ch, int W,
                                            float* __restrict__ dw, float* __restrict__ dbias, int has_bias) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long n = (long long)(W + 1) * ch;
    if (i >= n) return;
    int k = (int)(i / ch), c = (int)(i - (long long)k * ch);
    float s = 0.f;
    for (long long tl = 0; tl < tiles; tl++) s += part[(tl * (W + 1) + k) * ch + c];
    if (k < W) dw[(long long)c * W + k] = s;
    else if (has_bias) dbias[c] = s;
}
