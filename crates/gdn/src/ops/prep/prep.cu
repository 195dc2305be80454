// The rule's inputs of a GDN layer in one op (see mod.rs): causal depthwise conv1d + SiLU over
// the [q | k | v] section of the in_proj output, per-key-head L2 norm of q and k (caller-side),
// and the GDN gates, read in place from the in_proj output (row stride ld, section offsets).
// fp32 math; the raw conv outputs are rounded to the storage type before the norm reads them (as
// when the separate ops stored them), and backward rounds d(raw output) the same way.
//
// Forward: one warp per (segment, token), tokens fastest; segments are the Hk q heads, the Hk k heads, then the Hv
// v heads; the warp of v head j also computes the gates of head j. Backward: (1) with the norm, one
// warp per (token, q/k head) recomputes the raw output and stores rstd and <dqn, y rstd>; (2) one
// block per tile of PREP_TT tokens x 32 channels (as conv1d's backward) recomputes the
// pre-activation, forms d(pre), writes d(conv input) into d(in_proj output) and per-tile partial
// sums of the weight/bias gradients; (3) the gates' backward with per-chunk partial sums; (4)
// partials summed in order. No atomics: every result is bitwise reproducible.

#define PREP_TT 128  // tokens per tile of the conv backward (rows per partial of dw, dbias)
#define PREP_RB 256  // rows per partial of the gates' parameter gradients (crate::ops::REDUCE_BLOCK)
#define PREP_L2_EPS 1e-6f

__device__ __forceinline__ float prep_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float prep_silu(float x) { return x * prep_sigmoid(x); }
__device__ __forceinline__ float prep_silu_grad(float x) {
    float s = prep_sigmoid(x);
    return s * (1.f + x * (1.f - s));
}
__device__ __forceinline__ float prep_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float prep_softplus_grad(float x) {
    if (x > 20.f) return 1.f;
    float z = expf(x);
    return z / (z + 1.f);
}
// A value as the storage type holds it.
__device__ __forceinline__ float prep_rnd(const float*, float v) { return v; }
__device__ __forceinline__ float prep_rnd(const bf16_t*, float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Index s of the sequence holding token t (< cu[nseq]): cu[s] <= t < cu[s + 1].
__device__ __forceinline__ int prep_seq_of(const long long* __restrict__ cu, int nseq, long long t) {
    int lo = 0, hi = nseq;
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (cu[mid] <= t) lo = mid;
        else hi = mid;
    }
    return lo;
}

// Pre-activation of channel ch at token t (sequence start `start`): bias, then taps in order.
template <typename T>
__device__ __forceinline__ float prep_pre(const T* __restrict__ x, long long xld, int xoff, const float* __restrict__ w,
                                          const float* __restrict__ bias, int has_bias, int W, long long t,
                                          long long start, int ch) {
    float pre = has_bias ? bias[ch] : 0.f;
    for (int k = 0; k < W; k++) {
        long long back = W - 1 - k;
        if (t - back >= start) pre += w[(long long)ch * W + k] * ld(x, (t - back) * xld + xoff + ch);
    }
    return pre;
}

template <typename T>
__device__ __forceinline__ void prep_fwd_impl(const T* __restrict__ x, long long xld, int xoff, int boff, int aoff,
                                              const float* __restrict__ w, const float* __restrict__ bias,
                                              int has_bias, const float* __restrict__ a_log,
                                              const float* __restrict__ dt_bias, const long long* __restrict__ cu,
                                              int nseq, long long used, long long tokens, int hk, int hv, int dk,
                                              int dv, int W, int l2, T* q, T* k, T* v, T* qn, T* kn,
                                              float* __restrict__ g, T* __restrict__ beta) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int nseg = 2 * hk + hv;
    if (row >= tokens * nseg) return;
    // Token fastest: the 8 warps of a block take 8 consecutive tokens of one head, so the conv
    // taps (rows t-W+1 .. t) they share are read from L1 rather than L2.
    int s = (int)(row / tokens);
    long long t = row - (long long)s * tokens;
    int qk = hk * dk, vd = hv * dv;
    int D, c0, l2n;
    T* out;
    T* outn;
    long long ob;
    if (s < hk) {
        D = dk; c0 = s * dk; out = q; outn = qn; ob = t * qk + (long long)s * dk; l2n = l2;
    } else if (s < 2 * hk) {
        D = dk; c0 = qk + (s - hk) * dk; out = k; outn = kn; ob = t * qk + (long long)(s - hk) * dk; l2n = l2;
    } else {
        int j = s - 2 * hk;
        D = dv; c0 = 2 * qk + j * dv; out = v; outn = v; ob = t * vd + (long long)j * dv; l2n = 0;
        if (lane == 0) {
            // The gates of head j, on every row (padding included), as the gates op.
            long long i = t * hv + j;
            g[i] = -expf(a_log[j]) * prep_softplus(ld(x, t * xld + aoff + j) + dt_bias[j]);
            st(beta, i, prep_sigmoid(ld(x, t * xld + boff + j)));
        }
    }
    if (t >= used) {
        for (int c = lane; c < D; c += 32) {
            st(out, ob + c, 0.f);
            if (l2n) st(outn, ob + c, 0.f);
        }
        return;
    }
    long long start = cu[prep_seq_of(cu, nseq, t)];
    float ss = 0.f;
    for (int c = lane; c < D; c += 32) {
        float y = prep_silu(prep_pre(x, xld, xoff, w, bias, has_bias, W, t, start, c0 + c));
        st(out, ob + c, y);
        float yr = prep_rnd(out, y);
        ss += yr * yr;
    }
    if (l2n) {
        float r = 1.f / sqrtf(warp_sum(ss) + PREP_L2_EPS);
        for (int c = lane; c < D; c += 32) st(outn, ob + c, ld(out, ob + c) * r);
    }
}

// Backward (1): per (token, q/k head) row, rstd of the stored raw output and <dn, y rstd>.
template <typename T>
__device__ __forceinline__ void prep_bwd_stats_impl(const T* __restrict__ x, long long xld, int xoff,
                                                    const float* __restrict__ w, const float* __restrict__ bias,
                                                    int has_bias, const long long* __restrict__ cu, int nseq,
                                                    long long used, long long tokens, int hk, int dk, int W,
                                                    const T* __restrict__ dq, const T* __restrict__ dkk,
                                                    float* __restrict__ st_r, float* __restrict__ st_d) {
    long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int nseg = 2 * hk;
    if (row >= tokens * nseg) return;
    int s = (int)(row / tokens);  // token fastest, as in the forward
    long long t = row - (long long)s * tokens;
    long long si = t * nseg + s;  // stats are stored [token][2 Hk]
    if (t >= used) {
        if (lane == 0) {
            st_r[si] = 0.f;
            st_d[si] = 0.f;
        }
        return;
    }
    int qk = hk * dk;
    int part = s >= hk, h = s - part * hk;
    int c0 = part * qk + h * dk;
    const T* dn = (part ? dkk : dq) + t * qk + (long long)h * dk;
    long long start = cu[prep_seq_of(cu, nseq, t)];
    float ss = 0.f;
    for (int c = lane; c < dk; c += 32) {
        float yr = prep_rnd(x, prep_silu(prep_pre(x, xld, xoff, w, bias, has_bias, W, t, start, c0 + c)));
        ss += yr * yr;
    }
    float r = 1.f / sqrtf(warp_sum(ss) + PREP_L2_EPS);
    float d = 0.f;
    for (int c = lane; c < dk; c += 32) {
        float yr = prep_rnd(x, prep_silu(prep_pre(x, xld, xoff, w, bias, has_bias, W, t, start, c0 + c)));
        d += ld(dn, c) * (yr * r);
    }
    d = warp_sum(d);
    if (lane == 0) {
        st_r[si] = r;
        st_d[si] = d;
    }
}

// Backward (2). Block: 256 threads = 32 channels (tx) x 8 lanes (ty). Grid: (tiles of PREP_TT
// tokens, channel tiles of 32). Dynamic shared memory as conv1d's backward. part:
// [tile][W + 1][conv_dim] (taps 0..W-1, then the bias).
template <typename T>
__device__ __forceinline__ void prep_bwd_impl(const T* __restrict__ x, long long xld, int xoff,
                                              const float* __restrict__ w, const float* __restrict__ bias,
                                              int has_bias, const long long* __restrict__ cu, int nseq,
                                              long long used, long long tokens, int hk, int hv, int dk, int dv,
                                              int W, int l2, const float* __restrict__ st_r,
                                              const float* __restrict__ st_d, const T* __restrict__ dq,
                                              const T* __restrict__ dkk, const T* __restrict__ dvv,
                                              T* __restrict__ dx, float* __restrict__ part) {
    extern __shared__ __align__(16) unsigned char prep_smem[];
    const int H = W - 1;
    const int NS = PREP_TT + H;
    const int NX = PREP_TT + 2 * H;
    const int qk = hk * dk, vd = hv * dv, ch = 2 * qk + vd;
    // Per token of the tile (32-bit, so the tap loops do no 64-bit arithmetic):
    int* hb = (int*)prep_smem;          // [NS] taps back still in the sequence: min(t - start, H); -1: padding
    int* fb = hb + NS;                  // [TT] taps forward still in the sequence: min(end - 1 - t, H); -1: padding
    float* wsm = (float*)(fb + PREP_TT);  // [W][32] the block's conv weights
    float* xs = wsm + W * 32;           // [NX][32]
    float* dps = xs + NX * 32;          // [NS][32]
    float* red = dps + NS * 32;         // [8][32]
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    int c = blockIdx.y * 32 + tx;
    long long tile = blockIdx.x;
    long long t0 = tile * PREP_TT;

    for (int j = threadIdx.x; j < NS; j += blockDim.x) {
        long long t = t0 + j;
        if (t < used) {
            int s = prep_seq_of(cu, nseq, t);
            hb[j] = (int)min(t - cu[s], (long long)H);
            if (j < PREP_TT) fb[j] = (int)min(cu[s + 1] - 1 - t, (long long)H);
        } else {
            hb[j] = -1;
            if (j < PREP_TT) fb[j] = -1;
        }
    }
    for (int k = ty; k < W; k += 8) wsm[k * 32 + tx] = c < ch ? w[(long long)c * W + k] : 0.f;
    for (int j = ty; j < NX; j += 8) {
        long long t = t0 - H + j;
        xs[j * 32 + tx] = (t >= 0 && t < used && c < ch) ? ld(x, t * xld + xoff + c) : 0.f;
    }
    __syncthreads();
    // dpre = d(raw output) * silu'(pre) for the tile's tokens and the H after it; 0 on padding.
    // Tap k reads token t - back, back = W - 1 - k: in the sequence iff back <= hb.
    for (int j = ty; j < NS; j += 8) {
        long long t = t0 + j;
        float v = 0.f;
        if (c < ch && t < used) {
            int h = hb[j];
            float pre = has_bias ? bias[c] : 0.f;
            for (int k = 0; k < W; k++) {
                if (W - 1 - k <= h) pre += wsm[k * 32 + tx] * xs[(j + k) * 32 + tx];
            }
            float gy;
            if (c < 2 * qk) {
                int pq = c >= qk, cc = c - pq * qk;
                float dn = ld(pq ? dkk : dq, t * qk + cc);
                if (l2) {
                    long long si = t * (2 * hk) + pq * hk + cc / dk;
                    float r = st_r[si];
                    float yr = prep_rnd(dx, prep_silu(pre));
                    gy = prep_rnd(dx, r * (dn - (yr * r) * st_d[si]));
                } else {
                    gy = dn;
                }
            } else {
                gy = ld(dvv, t * vd + (c - 2 * qk));
            }
            v = gy * prep_silu_grad(pre);
        }
        dps[j * 32 + tx] = v;
    }
    __syncthreads();
    // dx[t] = sum_k w[c, k] dpre[t + back] (same sequence: back <= fb).
    for (int j = ty; j < PREP_TT; j += 8) {
        long long t = t0 + j;
        if (t >= tokens || c >= ch) continue;
        float acc = 0.f;
        int f = fb[j];  // -1 on padding: no taps, dx = 0
        for (int k = 0; k < W; k++) {
            int back = W - 1 - k;
            if (back <= f) acc += wsm[k * 32 + tx] * dps[(j + back) * 32 + tx];
        }
        st(dx, t * xld + xoff + c, acc);
    }
    // partials: tap k: sum_t dpre[t] x[t - back] (back <= hb); k == W: sum_t dpre[t].
    for (int k = 0; k <= W; k++) {
        float acc = 0.f;
        for (int j = ty; j < PREP_TT; j += 8) {
            int h = hb[j];  // -1 on padding (t >= used): nothing
            if (h >= 0) {
                if (k == W) acc += dps[j * 32 + tx];
                else if (W - 1 - k <= h) acc += dps[j * 32 + tx] * xs[(j + k) * 32 + tx];
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

// Backward (3): d alpha = -exp(A_log) softplus'(alpha + dt_bias) dg and d b = dbeta s (1 - s),
// written into d(in_proj output); per chunk of PREP_RB rows the partial sums [g dg | d alpha] per
// head. Block (32 heads x 8 lanes), grid (chunks, head tiles). gpart: [chunk][2][hv].
template <typename T>
__device__ __forceinline__ void prep_gates_bwd_impl(const T* __restrict__ x, long long xld, int boff, int aoff,
                                                    const float* __restrict__ a_log,
                                                    const float* __restrict__ dt_bias, const float* __restrict__ dg,
                                                    const T* __restrict__ dbeta, T* __restrict__ dx,
                                                    float* __restrict__ gpart, long long rows, int hv) {
    __shared__ float sa[8][33], sd[8][33];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    int j = blockIdx.y * 32 + tx;
    long long chunk = blockIdx.x;
    long long r0 = chunk * PREP_RB, r1 = min(r0 + PREP_RB, rows);
    float pa = 0.f, pd = 0.f;
    if (j < hv) {
        float na = -expf(a_log[j]);
        float b = dt_bias[j];
        for (long long r = r0 + ty; r < r1; r += 8) {
            long long i = r * hv + j;
            float v = ld(x, r * xld + aoff + j) + b;
            float gv = na * prep_softplus(v);
            float d = na * prep_softplus_grad(v) * dg[i];
            st(dx, r * xld + aoff + j, d);
            pa += gv * dg[i];
            pd += d;
            float s = prep_sigmoid(ld(x, r * xld + boff + j));
            st(dx, r * xld + boff + j, ld(dbeta, i) * s * (1.f - s));
        }
    }
    sa[ty][tx] = pa;
    sd[ty][tx] = pd;
    __syncthreads();
    if (ty == 0 && j < hv) {
        float a = sa[0][tx], d = sd[0][tx];
        for (int l = 1; l < 8; l++) {
            a += sa[l][tx];
            d += sd[l][tx];
        }
        gpart[(chunk * 2) * hv + j] = a;
        gpart[(chunk * 2 + 1) * hv + j] = d;
    }
}

#define PREP_KERNELS(S, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        prep_fwd_##S(const T* x, long long xld, int xoff, int boff, int aoff, const float* w,               \
                     const float* bias, int has_bias, const float* a_log, const float* dt_bias,            \
                     const long long* cu, int nseq, long long used, long long tokens, int hk, int hv, int dk, \
                     int dv, int W, int l2, T* q, T* k, T* v, T* qn, T* kn, float* g, T* beta) {           \
        prep_fwd_impl<T>(x, xld, xoff, boff, aoff, w, bias, has_bias, a_log, dt_bias, cu, nseq, used, tokens, \
                         hk, hv, dk, dv, W, l2, q, k, v, qn, kn, g, beta);                                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        prep_bwd_stats_##S(const T* x, long long xld, int xoff, const float* w, const float* bias,          \
                           int has_bias, const long long* cu, int nseq, long long used, long long tokens,  \
                           int hk, int dk, int W, const T* dq, const T* dkk, float* st_r, float* st_d) {   \
        prep_bwd_stats_impl<T>(x, xld, xoff, w, bias, has_bias, cu, nseq, used, tokens, hk, dk, W, dq, dkk, \
                               st_r, st_d);                                                                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        prep_bwd_##S(const T* x, long long xld, int xoff, const float* w, const float* bias, int has_bias,   \
                     const long long* cu, int nseq, long long used, long long tokens, int hk, int hv, int dk, \
                     int dv, int W, int l2, const float* st_r, const float* st_d, const T* dq, const T* dkk, \
                     const T* dvv, T* dx, float* part) {                                                   \
        prep_bwd_impl<T>(x, xld, xoff, w, bias, has_bias, cu, nseq, used, tokens, hk, hv, dk, dv, W, l2,    \
                         st_r, st_d, dq, dkk, dvv, dx, part);                                              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        prep_gates_bwd_##S(const T* x, long long xld, int boff, int aoff, const float* a_log,                \
                           const float* dt_bias, const float* dg, const T* dbeta, T* dx, float* gpart,     \
                           long long rows, int hv) {                                                       \
        prep_gates_bwd_impl<T>(x, xld, boff, aoff, a_log, dt_bias, dg, dbeta, dx, gpart, rows, hv);         \
    }

PREP_KERNELS(f32, float)
PREP_KERNELS(bf16, bf16_t)

// Backward (4a), one thread per (k, c): tiles summed in order. dw[c, k] for k < W, dbias[c] for
// k == W.
extern "C" __global__ void prep_conv_sum_parts(const float* __restrict__ part, long long tiles, int ch, int W,
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

// Backward (4b), one thread per output: dA_log[j] = sum_chunks gpart[.][0][j], ddt_bias[j] =
// sum_chunks gpart[.][1][j], chunks in order.
extern "C" __global__ void prep_gates_sum_parts(const float* __restrict__ gpart, long long chunks, int hv,
                                                float* __restrict__ da_log, float* __restrict__ ddt) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * hv) return;
    int which = i / hv, j = i - which * hv;
    float s = 0.f;
    for (long long k = 0; k < chunks; k++) s += gpart[(k * 2 + which) * hv + j];
    if (which == 0) da_log[j] = s;
    else ddt[j] = s;
}
