// The rule's inputs of a GDN layer in one op (see mod.rs): causal depthwise conv1d + SiLU over
// the [q | k | v] section of the in_proj output, per-key-head L2 norm of q and k (caller-side),
// and the GDN gates, read in place from the in_proj output (row stride ld, section offsets).
// fp32 math; the raw conv outputs are rounded to the storage type before the norm reads them (as
// when the separate ops stored them), and backward rounds d(raw output) the same way.
//
// Two sets of kernels. The streaming ones (prep_fwd_w{W}n{NC}, prep_bwd_w{W}n{NC}, below; cuda.rs
// picks them for conv widths 2..4, head sizes multiples of 4 up to 256 and 4-aligned rows, the
// layer's shapes): one warp walks consecutive tokens of one head with 4 channels per lane, the
// conv window and weights in registers, the norm's sums by warp shuffles; backward is one pass
// (statistics, d(pre), dx and the weight-gradient partials), walking tokens downwards. The
// general ones (any shape): forward one warp per (segment, token), tokens fastest; segments are
// the Hk q heads, the Hk k heads, then the Hv v heads; the warp of v head j also computes the
// gates of head j. Backward: (1) with the norm, one warp per (token, q/k head) recomputes the
// raw output and stores rstd and <dqn, y rstd>; (2) one block per tile of PREP_TT tokens x 32
// channels (as conv1d's backward) recomputes the pre-activation, forms d(pre), writes d(conv
// input) into d(in_proj output) and per-tile partial sums of the weight/bias gradients. Both:
// (3) the gates' backward with per-chunk partial sums; (4) partials summed in order. No
// atomics: every result is bitwise reproducible. Shared conv helpers (cv_*): ops/common/conv.cuh.

#define PREP_TT 128  // tokens per tile of the conv backward (rows per partial of dw, dbias)
#define PREP_RB 256  // rows per partial of the gates' parameter gradients (crate::ops::REDUCE_BLOCK)
#define PREP_L2_EPS 1e-6f

__device__ __forceinline__ float prep_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float prep_softplus_grad(float x) {
    if (x > 20.f) return 1.f;
    float z = expf(x);
    return z / (z + 1.f);
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
            st(beta, i, cv_sigmoid(ld(x, t * xld + boff + j)));
        }
    }
    if (t >= used) {
        for (int c = lane; c < D; c += 32) {
            st(out, ob + c, 0.f);
            if (l2n) st(outn, ob + c, 0.f);
        }
        return;
    }
    long long start = cu[cv_seq_of(cu, nseq, t)];
    float ss = 0.f;
    for (int c = lane; c < D; c += 32) {
        float y = cv_silu(prep_pre(x, xld, xoff, w, bias, has_bias, W, t, start, c0 + c));
        st(out, ob + c, y);
        float yr = cv_rnd(out, y);
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
    long long start = cu[cv_seq_of(cu, nseq, t)];
    float ss = 0.f;
    for (int c = lane; c < dk; c += 32) {
        float yr = cv_rnd(x, cv_silu(prep_pre(x, xld, xoff, w, bias, has_bias, W, t, start, c0 + c)));
        ss += yr * yr;
    }
    float r = 1.f / sqrtf(warp_sum(ss) + PREP_L2_EPS);
    float d = 0.f;
    for (int c = lane; c < dk; c += 32) {
        float yr = cv_rnd(x, cv_silu(prep_pre(x, xld, xoff, w, bias, has_bias, W, t, start, c0 + c)));
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
            int s = cv_seq_of(cu, nseq, t);
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
                    float yr = cv_rnd(dx, cv_silu(pre));
                    gy = cv_rnd(dx, r * (dn - (yr * r) * st_d[si]));
                } else {
                    gy = dn;
                }
            } else {
                gy = ld(dvv, t * vd + (c - 2 * qk));
            }
            v = gy * cv_silu_grad(pre);
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
            float s = cv_sigmoid(ld(x, r * xld + boff + j));
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

// ---------------------------------------------------------------------------------------------
// Streaming kernels (the layer's shapes): conv width W <= 4, head sizes multiples of 4 up to
// 128 * NC, rows and the qkv section 4-aligned. One warp walks PREP_FT (forward) or PREP_BT
// (backward) consecutive tokens of one head (segment); lane l holds channels 4 (l + 32 n) .. +3
// of the head (n < NC), loaded and stored 4 at a time. The conv window (the W - 1 previous x
// rows, and in backward the W - 1 next d(pre) rows) stays in registers, the weights too; the
// head's L2 norm is a warp shuffle sum per token. Grid: (token tiles of 8 warps, segments).

#define PREP_FT 32  // tokens per warp, forward (the gates: one token per lane)
#define PREP_BT 64  // tokens per warp, backward (8 warps: 512 tokens per partial of dw, dbias)

// Segment s of the 2 Hk + Hv: q heads, k heads, v heads. c0: first conv channel; D: its width;
// col: its first column in the [n, stride] output (or gradient) of its part.
struct PrepSeg {
    int part, h, c0, D, stride, col;
};
__device__ __forceinline__ PrepSeg prep_seg(int s, int hk, int hv, int dk, int dv) {
    int qk = hk * dk;
    PrepSeg g;
    if (s < hk) {
        g.part = 0; g.h = s; g.c0 = s * dk; g.D = dk; g.stride = qk; g.col = s * dk;
    } else if (s < 2 * hk) {
        g.part = 1; g.h = s - hk; g.c0 = qk + g.h * dk; g.D = dk; g.stride = qk; g.col = g.h * dk;
    } else {
        g.part = 2; g.h = s - 2 * hk; g.c0 = 2 * qk + g.h * dv; g.D = dv; g.stride = hv * dv; g.col = g.h * dv;
    }
    return g;
}

// The lane's weights [n][k][i] and bias [n][i] (0 where the lane has no channel).
template <int W, int NC>
__device__ __forceinline__ void prep_lane_params(const float* __restrict__ w, const float* __restrict__ bias,
                                                 int has_bias, int c0, int D, int lane, float (&wr)[NC][W][4],
                                                 float (&br)[NC][4]) {
#pragma unroll
    for (int n = 0; n < NC; n++) {
        int cl = (lane + 32 * n) * 4;
        bool on = cl < D;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            long long c = (long long)c0 + cl + i;
#pragma unroll
            for (int k = 0; k < W; k++) wr[n][k][i] = on ? w[c * W + k] : 0.f;
            br[n][i] = (on && has_bias) ? bias[c] : 0.f;
        }
    }
}

template <typename T, int W, int NC>
__device__ __forceinline__ void prep_fwd_vec_impl(const T* __restrict__ x, long long xld, int xoff, int boff,
                                                  int aoff, const float* __restrict__ w,
                                                  const float* __restrict__ bias, int has_bias,
                                                  const float* __restrict__ a_log,
                                                  const float* __restrict__ dt_bias, const long long* __restrict__ cu,
                                                  int nseq, long long used, long long tokens, int hk, int hv, int dk,
                                                  int dv, int l2, T* q, T* k, T* v, T* qn, T* kn,
                                                  float* __restrict__ g, T* __restrict__ beta) {
    const int H = W - 1;
    int lane = threadIdx.x & 31;
    long long t0 = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * PREP_FT;
    if (t0 >= tokens) return;
    long long t1 = min(t0 + PREP_FT, tokens);
    PrepSeg sg = prep_seg(blockIdx.y, hk, hv, dk, dv);
    T* out = sg.part == 0 ? q : sg.part == 1 ? k : v;
    T* outn = sg.part == 0 ? qn : kn;
    int l2n = l2 && sg.part < 2;
    if (sg.part == 2) {
        // The gates of head h, one token per lane, on every row (padding included), as the gates op.
        long long t = t0 + lane;
        if (t < t1) {
            int j = sg.h;
            long long i = t * hv + j;
            g[i] = -expf(a_log[j]) * prep_softplus(ld(x, t * xld + aoff + j) + dt_bias[j]);
            st(beta, i, cv_sigmoid(ld(x, t * xld + boff + j)));
        }
    }
    float wr[NC][W][4], br[NC][4];
    prep_lane_params<W, NC>(w, bias, has_bias, sg.c0, sg.D, lane, wr, br);
    bool on[NC];
#pragma unroll
    for (int n = 0; n < NC; n++) on[n] = (lane + 32 * n) * 4 < sg.D;
    const T* xs = x + xoff + sg.c0 + lane * 4;  // the lane's first channel at token 0
    // xw[n][k]: x[t - H + k] (0 outside the sequence); k = H is the current token.
    float xw[NC][W][4];
    long long end = 0;
    cv4raw<T> nx[NC];
#pragma unroll
    for (int n = 0; n < NC; n++) nx[n] = cv_zero4raw<T>();
    if (t0 < used) {
        int s = cv_seq_of(cu, nseq, t0);
        long long start = cu[s];
        end = cu[s + 1];
#pragma unroll
        for (int n = 0; n < NC; n++) {
#pragma unroll
            for (int kk = 0; kk < H; kk++) {
                long long tt = t0 - H + kk;
                cv4 a;
                if (on[n] && tt >= start) a = cv_ld4(xs, tt * xld + 128 * n);
                else a.v[0] = a.v[1] = a.v[2] = a.v[3] = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) xw[n][kk][i] = a.v[i];
            }
            if (on[n]) nx[n] = cv_ldraw4(xs, t0 * xld + 128 * n);
        }
    }
    long long ob0 = sg.col + lane * 4;
    for (long long t = t0; t < t1; t++) {
        long long ob = t * sg.stride + ob0;
        if (t >= used) {  // padding: every later token too
            float z[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int n = 0; n < NC; n++) {
                if (!on[n]) continue;
                cv_st4(out, ob + 128 * n, z);
                if (l2n) cv_st4(outn, ob + 128 * n, z);
            }
            continue;
        }
        if (t >= end) {  // a new sequence starts at t: no history
            int s = cv_seq_of(cu, nseq, t);
            end = cu[s + 1];
#pragma unroll
            for (int n = 0; n < NC; n++)
#pragma unroll
                for (int kk = 0; kk < H; kk++)
#pragma unroll
                    for (int i = 0; i < 4; i++) xw[n][kk][i] = 0.f;
        }
        cv4 cur[NC];
#pragma unroll
        for (int n = 0; n < NC; n++) {
            cur[n] = cv_unpack4(nx[n]);
            if (on[n] && t + 1 < t1 && t + 1 < used) nx[n] = cv_ldraw4(xs, (t + 1) * xld + 128 * n);
        }
        float yr[NC][4];
        float ss = 0.f;
#pragma unroll
        for (int n = 0; n < NC; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                xw[n][H][i] = on[n] ? cur[n].v[i] : 0.f;
                float pre = br[n][i];
#pragma unroll
                for (int kk = 0; kk < W; kk++) pre += wr[n][kk][i] * xw[n][kk][i];
                yr[n][i] = cv_rnd(out, cv_silu(pre));
                ss += yr[n][i] * yr[n][i];
            }
            if (on[n]) cv_st4(out, ob + 128 * n, yr[n]);
        }
        if (l2n) {
            float r = 1.f / sqrtf(warp_sum(ss) + PREP_L2_EPS);
#pragma unroll
            for (int n = 0; n < NC; n++) {
                float o[4];
#pragma unroll
                for (int i = 0; i < 4; i++) o[i] = yr[n][i] * r;
                if (on[n]) cv_st4(outn, ob + 128 * n, o);
            }
        }
#pragma unroll
        for (int n = 0; n < NC; n++)
#pragma unroll
            for (int kk = 0; kk < H; kk++)
#pragma unroll
                for (int i = 0; i < 4; i++) xw[n][kk][i] = xw[n][kk + 1][i];
    }
}

// Backward in one pass per warp, tokens in decreasing order from t1 + W - 2 (the halo after
// the tile: d(pre) there feeds dx of the tile's last tokens) down to t0. Per token: the
// pre-activation from the x window, with the norm its rstd r and <dn, y r> (warp sums), d(raw
// output) rounded to the storage type, d(pre) into the d(pre) window, dx from that window, and
// the lane's running sums of the weight/bias gradients. The block's 8 warps (consecutive
// tiles of one head) add theirs in order into part [tile][W + 1][conv_dim].
template <typename T, int W, int NC>
__device__ __forceinline__ void prep_bwd_vec_impl(const T* __restrict__ x, long long xld, int xoff,
                                                  const float* __restrict__ w, const float* __restrict__ bias,
                                                  int has_bias, const long long* __restrict__ cu, int nseq,
                                                  long long used, long long tokens, int hk, int hv, int dk, int dv,
                                                  int l2, const T* __restrict__ dq, const T* __restrict__ dkk,
                                                  const T* __restrict__ dvv, T* __restrict__ dx,
                                                  float* __restrict__ part, float* red) {
    const int H = W - 1;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    long long t0 = ((long long)blockIdx.x * 8 + wid) * PREP_BT;
    long long t1 = min(t0 + PREP_BT, tokens);
    PrepSeg sg = prep_seg(blockIdx.y, hk, hv, dk, dv);
    const T* gsrc = sg.part == 0 ? dq : sg.part == 1 ? dkk : dvv;
    int normed = l2 && sg.part < 2;
    const int ch = 2 * hk * dk + hv * dv;
    float wr[NC][W][4], br[NC][4];
    prep_lane_params<W, NC>(w, bias, has_bias, sg.c0, sg.D, lane, wr, br);
    bool on[NC];
#pragma unroll
    for (int n = 0; n < NC; n++) on[n] = (lane + 32 * n) * 4 < sg.D;
    const T* xs = x + xoff + sg.c0 + lane * 4;
    T* dxs = dx + xoff + sg.c0 + lane * 4;
    const T* gs = gsrc + sg.col + lane * 4;
    float acc[NC][W + 1][4];
#pragma unroll
    for (int n = 0; n < NC; n++)
#pragma unroll
        for (int kk = 0; kk <= W; kk++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[n][kk][i] = 0.f;
    if (t0 < t1) {
        // xw[n][k] = x[t - H + k] (0 outside t's sequence), dw[n][b] = d(pre)[t + b] (0 outside).
        float xw[NC][W][4], dpw[NC][W][4];
#pragma unroll
        for (int n = 0; n < NC; n++)
#pragma unroll
            for (int kk = 0; kk < W; kk++)
#pragma unroll
                for (int i = 0; i < 4; i++) xw[n][kk][i] = dpw[n][kk][i] = 0.f;
        long long top = t1 + H - 1;
        if (top >= tokens) top = tokens - 1;
        long long start = 0x7fffffffffffffffLL;  // no window yet
        int s = 0;
        if (used > 0) s = cv_seq_of(cu, nseq, min(top, used - 1));
        cv4raw<T> px[NC], pg[NC];  // prefetched x[t - H] and the gradient row of t
#pragma unroll
        for (int n = 0; n < NC; n++) px[n] = pg[n] = cv_zero4raw<T>();
        if (top < used) {
#pragma unroll
            for (int n = 0; n < NC; n++) {
                if (!on[n]) continue;
                if (top - H >= 0) px[n] = cv_ldraw4(xs, (top - H) * xld + 128 * n);
                pg[n] = cv_ldraw4(gs, top * sg.stride + 128 * n);
            }
        }
        for (long long t = top; t >= t0; t--) {
            float dp[NC][4];
            cv4 cx[NC], cg[NC];  // this token's (valid below used), then the next one's prefetched
#pragma unroll
            for (int n = 0; n < NC; n++) {
                cx[n] = cv_unpack4(px[n]);
                cg[n] = cv_unpack4(pg[n]);
                if (on[n] && t - 1 >= t0 && t - 1 < used) {
                    if (t - 1 - H >= 0) px[n] = cv_ldraw4(xs, (t - 1 - H) * xld + 128 * n);
                    pg[n] = cv_ldraw4(gs, (t - 1) * sg.stride + 128 * n);
                }
            }
            if (t >= used) {  // padding: d(pre) = 0
#pragma unroll
                for (int n = 0; n < NC; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) dp[n][i] = 0.f;
            } else {
                if (t < start) {
                    // first token of the walk below used, or the walk crossed into an earlier
                    // sequence: reload the x window, forget the later sequence's d(pre)
                    if (start != 0x7fffffffffffffffLL) {
                        while (t < cu[s]) s--;
                    }
                    start = cu[s];
#pragma unroll
                    for (int n = 0; n < NC; n++) {
#pragma unroll
                        for (int kk = 0; kk < W; kk++) {
                            long long tt = t - H + kk;
                            cv4 a;
                            if (on[n] && tt >= start) a = cv_ld4(xs, tt * xld + 128 * n);
                            else a.v[0] = a.v[1] = a.v[2] = a.v[3] = 0.f;
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                xw[n][kk][i] = a.v[i];
                                dpw[n][kk][i] = 0.f;
                            }
                        }
                    }
                } else {
                    bool in = t - H >= start;
#pragma unroll
                    for (int n = 0; n < NC; n++) {
#pragma unroll
                        for (int kk = H; kk > 0; kk--)
#pragma unroll
                            for (int i = 0; i < 4; i++) xw[n][kk][i] = xw[n][kk - 1][i];
#pragma unroll
                        for (int i = 0; i < 4; i++) xw[n][0][i] = (on[n] && in) ? cx[n].v[i] : 0.f;
                    }
                }
                float pre[NC][4], sgm[NC][4], yr[NC][4], gn[NC][4];
                float ss = 0.f;
#pragma unroll
                for (int n = 0; n < NC; n++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float p = br[n][i];
#pragma unroll
                        for (int kk = 0; kk < W; kk++) p += wr[n][kk][i] * xw[n][kk][i];
                        pre[n][i] = p;
                        sgm[n][i] = cv_sigmoid(p);
                        gn[n][i] = on[n] ? cg[n].v[i] : 0.f;
                        if (normed) {
                            yr[n][i] = cv_rnd(x, p * sgm[n][i]);
                            ss += yr[n][i] * yr[n][i];
                        }
                    }
                }
                if (normed) {
                    float r = 1.f / sqrtf(warp_sum(ss) + PREP_L2_EPS);
                    float d = 0.f;
#pragma unroll
                    for (int n = 0; n < NC; n++)
#pragma unroll
                        for (int i = 0; i < 4; i++) d += gn[n][i] * (yr[n][i] * r);
                    d = warp_sum(d);
#pragma unroll
                    for (int n = 0; n < NC; n++)
#pragma unroll
                        for (int i = 0; i < 4; i++) gn[n][i] = cv_rnd(x, r * (gn[n][i] - (yr[n][i] * r) * d));
                }
#pragma unroll
                for (int n = 0; n < NC; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float sv = sgm[n][i];
                        dp[n][i] = gn[n][i] * (sv * (1.f + pre[n][i] * (1.f - sv)));
                    }
            }
            // the d(pre) window moves down one token: dpw[b] = d(pre)[t + b]
#pragma unroll
            for (int n = 0; n < NC; n++) {
#pragma unroll
                for (int b = H; b > 0; b--)
#pragma unroll
                    for (int i = 0; i < 4; i++) dpw[n][b][i] = dpw[n][b - 1][i];
#pragma unroll
                for (int i = 0; i < 4; i++) dpw[n][0][i] = dp[n][i];
            }
            if (t < t1) {
                // dx[t] = sum_k w[k] d(pre)[t + W - 1 - k]; the lane's weight/bias sums
#pragma unroll
                for (int n = 0; n < NC; n++) {
                    float o[4];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float a = 0.f;
#pragma unroll
                        for (int kk = 0; kk < W; kk++) a += wr[n][kk][i] * dpw[n][H - kk][i];
                        o[i] = t < used ? a : 0.f;
                        if (t < used) {
#pragma unroll
                            for (int kk = 0; kk < W; kk++) acc[n][kk][i] += dp[n][i] * xw[n][kk][i];
                            acc[n][W][i] += dp[n][i];
                        }
                    }
                    if (on[n]) cv_st4(dxs, t * xld + 128 * n, o);
                }
            }
        }
    }
    // red [8][W + 1][NC * 128]: the warps' sums, then added in warp order.
    const int RW = NC * 128;
#pragma unroll
    for (int n = 0; n < NC; n++)
#pragma unroll
        for (int kk = 0; kk <= W; kk++)
#pragma unroll
            for (int i = 0; i < 4; i++) red[(wid * (W + 1) + kk) * RW + (lane + 32 * n) * 4 + i] = acc[n][kk][i];
    __syncthreads();
    long long tile = blockIdx.x;
    for (int e = threadIdx.x; e < (W + 1) * sg.D; e += blockDim.x) {
        int kk = e / sg.D, cl = e - kk * sg.D;
        float sum = red[kk * RW + cl];
        for (int l = 1; l < 8; l++) sum += red[(l * (W + 1) + kk) * RW + cl];
        part[(tile * (W + 1) + kk) * ch + sg.c0 + cl] = sum;
    }
}

#define PREP_VEC_KERNELS(S, T, W, NC, MB)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, MB)                                                  \
        prep_fwd_w##W##n##NC##_##S(const T* x, long long xld, int xoff, int boff, int aoff, const float* w, \
                                   const float* bias, int has_bias, const float* a_log, const float* dt_bias, \
                                   const long long* cu, int nseq, long long used, long long tokens, int hk,  \
                                   int hv, int dk, int dv, int l2, T* q, T* k, T* v, T* qn, T* kn, float* g,  \
                                   T* beta) {                                                              \
        prep_fwd_vec_impl<T, W, NC>(x, xld, xoff, boff, aoff, w, bias, has_bias, a_log, dt_bias, cu, nseq,   \
                                    used, tokens, hk, hv, dk, dv, l2, q, k, v, qn, kn, g, beta);           \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        prep_bwd_w##W##n##NC##_##S(const T* x, long long xld, int xoff, const float* w, const float* bias,   \
                                   int has_bias, const long long* cu, int nseq, long long used,            \
                                   long long tokens, int hk, int hv, int dk, int dv, int l2, const T* dq,   \
                                   const T* dkk, const T* dvv, T* dx, float* part) {                       \
        __shared__ __align__(16) float red[8 * (W + 1) * NC * 128];                                        \
        prep_bwd_vec_impl<T, W, NC>(x, xld, xoff, w, bias, has_bias, cu, nseq, used, tokens, hk, hv, dk, dv, \
                                    l2, dq, dkk, dvv, dx, part, red);                                      \
    }

// MB: the forward's blocks per SM (a register cap without spills).
#define PREP_VEC_ALL(W, NC, MB)               \
    PREP_VEC_KERNELS(f32, float, W, NC, MB)   \
    PREP_VEC_KERNELS(bf16, bf16_t, W, NC, MB)
PREP_VEC_ALL(2, 1, 4)
PREP_VEC_ALL(3, 1, 4)
PREP_VEC_ALL(4, 1, 3)
PREP_VEC_ALL(2, 2, 2)
PREP_VEC_ALL(3, 2, 2)
PREP_VEC_ALL(4, 2, 2)

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
