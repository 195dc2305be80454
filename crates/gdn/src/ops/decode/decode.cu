// Inference kernels over a pool of cache slots (see ops/decode/mod.rs for the math and layouts).
//
//   copy_rows    row copies between row-major matrices by index pairs (gather / scatter of
//                cached states and conv rows); a pair with a negative index is skipped.
//   decode_pre   one decode token per row: causal conv over the slot's cached W-1 rows + the new
//                row, SiLU, the window shifted in place, and the gates (GDN or GDN2).
//   decode_rule  one decode token per row: the recurrent state of (slot, value head) read once,
//                decayed, S^T k and S^T q summed in the same pass, the state updated and written
//                back in place; o = scale (S'^T q + u (k.q)).
//
// No atomics: every sum runs in a fixed order, so reruns are bitwise equal.

// ---- copy_rows: dst[dr, d_off + c] = src[sr, s_off + c] for each pair (sr, dr), c < width.
// Grid: one block per (pair, 256-column chunk), flat.
template <typename T>
__device__ void copy_rows(const T* __restrict__ src, long long s_ld, long long s_off, T* __restrict__ dst,
                          long long d_ld, long long d_off, long long width, const int* __restrict__ pairs,
                          long long chunks) {
    long long p = blockIdx.x / chunks, ch = blockIdx.x % chunks;
    long long c = ch * blockDim.x + threadIdx.x;
    int sr = pairs[2 * p], dr = pairs[2 * p + 1];
    if (sr < 0 || dr < 0 || c >= width) return;
    dst[(long long)dr * d_ld + d_off + c] = src[(long long)sr * s_ld + s_off + c];
}

extern "C" __global__ void copy_rows_f32(const float* src, long long s_ld, long long s_off, float* dst,
                                         long long d_ld, long long d_off, long long width, const int* pairs,
                                         long long chunks) {
    copy_rows(src, s_ld, s_off, dst, d_ld, d_off, width, pairs, chunks);
}
extern "C" __global__ void copy_rows_bf16(const bf16_t* src, long long s_ld, long long s_off, bf16_t* dst,
                                          long long d_ld, long long d_off, long long width, const int* pairs,
                                          long long chunks) {
    copy_rows(src, s_ld, s_off, dst, d_ld, d_off, width, pairs, chunks);
}

__device__ __forceinline__ float dec_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float dec_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---- decode_pre: thread per (row, output column); columns [0, cd) are the conv channels
// (q | k | v), then the gates: GDN [g (hv) | beta (hv)], GDN2 [g (qk) | b (qk) | w (vd)].
// Grid: one block per (row, 256-column chunk), flat. A row whose slot is outside [0, nslots)
// (padding: -1) writes zero outputs and touches no window.
template <typename T>
__device__ void decode_pre(const T* __restrict__ proj, long long pd, int qkv_off, int g0, int g1, int g2,
                           T* __restrict__ conv, const int* __restrict__ slots, int nslots,
                           const float* __restrict__ conv_w, const float* __restrict__ conv_b, int has_bias,
                           const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                           float* __restrict__ q, float* __restrict__ k, float* __restrict__ v,
                           float* __restrict__ g, float* __restrict__ b, float* __restrict__ w, int hk, int hv,
                           int dk, int dv, int width, int gdn2, long long chunks) {
    const long long row = blockIdx.x / chunks;
    const int col = (int)((blockIdx.x % chunks) * blockDim.x + threadIdx.x);
    const int qk = hk * dk, vd = hv * dv, cd = 2 * qk + vd;
    const int gw = gdn2 ? 2 * qk + vd : 2 * hv;
    if (col >= cd + gw) return;
    const int slot = slots[row];
    const bool pad = slot < 0 || slot >= nslots;
    const T* pr = proj + row * pd;
    if (col < cd) {
        float out = 0.f;
        if (!pad) {
            T* win = conv + (long long)slot * (width - 1) * cd + col;
            const float* wc = conv_w + (long long)col * width;
            float acc = has_bias ? conv_b[col] : 0.f;
            for (int j = 0; j < width - 1; ++j) acc += wc[j] * ld(win, (long long)j * cd);
            const T xr = pr[qkv_off + col];
            acc += wc[width - 1] * ld(pr, qkv_off + col);
            // Shift the window: oldest row out, this token's raw row in (same storage, exact).
            for (int j = 0; j + 1 < width - 1; ++j) win[(long long)j * cd] = win[(long long)(j + 1) * cd];
            if (width > 1) win[(long long)(width - 2) * cd] = xr;
            out = acc * dec_sigmoid(acc);
        }
        if (col < qk) q[row * qk + col] = out;
        else if (col < 2 * qk) k[row * qk + col - qk] = out;
        else v[row * vd + col - 2 * qk] = out;
        return;
    }
    const int j = col - cd;
    if (!gdn2) {
        if (j < hv) {
            g[row * hv + j] = pad ? 0.f : -expf(a_log[j]) * dec_softplus(ld(pr, g1 + j) + dt_bias[j]);
        } else {
            const int h = j - hv;
            b[row * hv + h] = pad ? 0.f : dec_sigmoid(ld(pr, g0 + h));
        }
    } else {
        if (j < qk) {
            g[row * qk + j] = pad ? 0.f : -expf(a_log[j / dk]) * dec_softplus(ld(pr, g0 + j) + dt_bias[j]);
        } else if (j < 2 * qk) {
            const int c = j - qk;
            b[row * qk + c] = pad ? 0.f : dec_sigmoid(ld(pr, g1 + c));
        } else {
            const int c = j - 2 * qk;
            w[row * vd + c] = pad ? 0.f : dec_sigmoid(ld(pr, g2 + c));
        }
    }
}

#define DECODE_PRE(SFX, T)                                                                                       \
    extern "C" __global__ void decode_pre_##SFX(                                                                 \
        const T* proj, long long pd, int qkv_off, int g0, int g1, int g2, T* conv, const int* slots, int nslots,   \
        const float* conv_w, const float* conv_b, int has_bias, const float* a_log, const float* dt_bias,          \
        float* q, float* k, float* v, float* g, float* b, float* w, int hk, int hv, int dk, int dv, int width,     \
        int gdn2, long long chunks) {                                                                              \
        decode_pre(proj, pd, qkv_off, g0, g1, g2, conv, slots, nslots, conv_w, conv_b, has_bias, a_log, dt_bias, \
                   q, k, v, g, b, w, hk, hv, dk, dv, width, gdn2, chunks);                                       \
    }
DECODE_PRE(f32, float)
DECODE_PRE(bf16, bf16_t)

// ---- decode_rule: one block of 128 threads per (row, value head, tile of 8 C value columns).
// Thread (tx = tid % 8, ty = tid / 8) holds columns c0 .. c0+C-1 (c0 = tile*8C + C tx) of key rows
// ty, ty+16, ..., ty+16(R-1): the state tile is loaded once (16-byte loads when Dv % 4 == 0) into
// registers, decayed, reduced over its rows, reduced over the 16 row groups in order through
// shared memory, updated and stored. q, k of the key head (l2-normalized in the block when asked)
// sit in shared memory. GDN: S' = exp(g) S, u = beta (v - S'^T k), S = S' + k u^T.
// GDN2: S' = diag(exp(g)) S, u = w v - S'^T (b k), S = S' + k u^T. Both: o = scale S^T q
// = scale (S'^T q + u (k.q)).
#define DEC_THREADS 128
#define DEC_MAXDK 256

// C columns per thread (4 or 8): a block covers BV = 8 C value columns.
template <int R, int C, typename TO>
__device__ void decode_rule(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                            const float* __restrict__ g, const float* __restrict__ bb, const float* __restrict__ w,
                            float* __restrict__ state, const int* __restrict__ slots, int nslots, TO* __restrict__ o,
                            int hk, int hv, int dk, int dv, float scale, int l2norm, int gdn2) {
    constexpr int BV = 8 * C;
    __shared__ float sk[DEC_MAXDK], sq[DEC_MAXDK], skb[DEC_MAXDK], sa[DEC_MAXDK];
    __shared__ float red_p[16][BV], red_q[16][BV];
    __shared__ float su[BV], sred[3];
    const int vtiles = (dv + BV - 1) / BV;
    const long long blk = blockIdx.x;
    const int tile = (int)(blk % vtiles);
    const int h = (int)((blk / vtiles) % hv);
    const long long row = blk / ((long long)vtiles * hv);
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const int c0 = tile * BV + tx * C;
    const long long orow = (row * hv + h) * dv;
    const int slot = slots[row];
    if (slot < 0 || slot >= nslots) {
        // Padding: zero output, no state touched.
        if (tid < BV && tile * BV + tid < dv) st(o, orow + tile * BV + tid, 0.f);
        return;
    }
    float* S = state + ((long long)slot * hv + h) * dk * dv;
    const bool vec = (dv & 3) == 0 && c0 + C - 1 < dv;
    // 1. The state tile, first, so its loads are in flight during the q/k work below.
    float s[R][C];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r < dk && vec) {
#pragma unroll
            for (int j4 = 0; j4 < C / 4; ++j4) {
                const float4 t = *reinterpret_cast<const float4*>(S + (long long)r * dv + c0 + 4 * j4);
                s[i][4 * j4 + 0] = t.x;
                s[i][4 * j4 + 1] = t.y;
                s[i][4 * j4 + 2] = t.z;
                s[i][4 * j4 + 3] = t.w;
            }
        } else {
#pragma unroll
            for (int j = 0; j < C; ++j) s[i][j] = (r < dk && c0 + j < dv) ? S[(long long)r * dv + c0 + j] : 0.f;
        }
    }
    // 2. q, k of the key head (and GDN2's per-channel decay) into shared memory.
    const int kh = h / (hv / hk);
    const long long kb = (row * hk + kh) * dk;
    for (int c = tid; c < dk; c += DEC_THREADS) {
        sq[c] = q[kb + c];
        sk[c] = k[kb + c];
        sa[c] = gdn2 ? expf(g[kb + c]) : 0.f;
    }
    __syncthreads();
    const int wid = tid >> 5, lane = tid & 31;
    if (l2norm) {
        // Warp 0: sum k^2, warp 1: sum q^2, lane-strided then the fixed butterfly.
        if (wid < 2) {
            const float* x = wid == 0 ? sk : sq;
            float acc = 0.f;
            for (int c = lane; c < dk; c += 32) acc += x[c] * x[c];
            acc = warp_sum(acc);
            if (lane == 0) sred[wid] = 1.f / sqrtf(acc + 1e-6f);
        }
        __syncthreads();
        for (int c = tid; c < dk; c += DEC_THREADS) {
            sk[c] *= sred[0];
            sq[c] *= sred[1];
        }
        __syncthreads();
    }
    // 3. k.q (warp 0) and the key the prediction reads (GDN2: b k).
    if (wid == 0) {
        float acc = 0.f;
        for (int c = lane; c < dk; c += 32) acc += sk[c] * sq[c];
        acc = warp_sum(acc);
        if (lane == 0) sred[2] = acc;
    }
    for (int c = tid; c < dk; c += DEC_THREADS) skb[c] = gdn2 ? bb[kb + c] * sk[c] : sk[c];
    __syncthreads();
    // 4. Decay, and the partial sums of S'^T (k or b k) and S'^T q over this thread's rows.
    const float a_h = gdn2 ? 1.f : expf(g[row * hv + h]);
    float pp[C], pq[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
        pp[j] = 0.f;
        pq[j] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r < dk) {
            const float a = gdn2 ? sa[r] : a_h, kr = skb[r], qr = sq[r];
#pragma unroll
            for (int j = 0; j < C; ++j) {
                s[i][j] *= a;
                pp[j] += s[i][j] * kr;
                pq[j] += s[i][j] * qr;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < C; ++j) {
        red_p[ty][tx * C + j] = pp[j];
        red_q[ty][tx * C + j] = pq[j];
    }
    __syncthreads();
    // 5. Row groups summed in order; u and o per column.
    if (tid < BV) {
        float p = 0.f, qq = 0.f;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            p += red_p[t][tid];
            qq += red_q[t][tid];
        }
        const int col = tile * BV + tid;
        float u = 0.f;
        if (col < dv) {
            const float vv = v[orow + col];
            u = gdn2 ? w[orow + col] * vv - p : bb[row * hv + h] * (vv - p);
            st(o, orow + col, scale * (qq + u * sred[2]));
        }
        su[tid] = u;
    }
    __syncthreads();
    // 6. S = S' + k u^T, stored in place.
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r >= dk) continue;
        const float kr = sk[r];
#pragma unroll
        for (int j = 0; j < C; ++j) s[i][j] += kr * su[tx * C + j];
        if (vec) {
#pragma unroll
            for (int j4 = 0; j4 < C / 4; ++j4)
                *reinterpret_cast<float4*>(S + (long long)r * dv + c0 + 4 * j4) =
                    make_float4(s[i][4 * j4], s[i][4 * j4 + 1], s[i][4 * j4 + 2], s[i][4 * j4 + 3]);
        } else {
#pragma unroll
            for (int j = 0; j < C; ++j)
                if (c0 + j < dv) S[(long long)r * dv + c0 + j] = s[i][j];
        }
    }
}

// Blocks per SM asked of the register allocator (ptxas -v, sm_90a, no spills). 4 columns per
// thread: 8 up to R = 4 (64 registers), 6 for R = 8 (Dk 65..128: 80 registers; 8 blocks spilled
// 60 bytes), 3 for R = 16. 8 columns per thread (twice the bytes in flight per thread, half the
// blocks and half the per-block q/k work per byte): 8 / 6 / 4 / 2 for R <= 2 / 4 / 8 / 16.
#define DECODE_RULE(R, C, SFX, TO, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, MINB) decode_rule_r##R##_c##C##_##SFX(             \
        const float* q, const float* k, const float* v, const float* g, const float* bb, const float* w,          \
        float* state, const int* slots, int nslots, TO* o, int hk, int hv, int dk, int dv, float scale,           \
        int l2norm, int gdn2) {                                                                                    \
        decode_rule<R, C, TO>(q, k, v, g, bb, w, state, slots, nslots, o, hk, hv, dk, dv, scale, l2norm, gdn2);  \
    }
#define DECODE_RULE_TYPES(R, C, MINB)           \
    DECODE_RULE(R, C, f32, float, MINB)         \
    DECODE_RULE(R, C, bf16, bf16_t, MINB)
DECODE_RULE_TYPES(1, 4, 8)
DECODE_RULE_TYPES(2, 4, 8)
DECODE_RULE_TYPES(4, 4, 8)
DECODE_RULE_TYPES(8, 4, 6)
DECODE_RULE_TYPES(16, 4, 3)
DECODE_RULE_TYPES(1, 8, 8)
DECODE_RULE_TYPES(2, 8, 8)
DECODE_RULE_TYPES(4, 8, 6)
DECODE_RULE_TYPES(8, 8, 4)
DECODE_RULE_TYPES(16, 8, 2)
