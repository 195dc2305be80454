// Inference kernels over a pool of cache slots (see ops/decode/mod.rs for the math and layouts).
//
//   copy_rows    row copies between row-major matrices by index pairs (gather / scatter of
//                cached states and conv rows); a pair with a negative index is skipped;
//                copy_rows_cvt_* convert between fp32 and bf16 (bf16 cache states).
//   decode_pre   one decode token per row: causal conv over the slot's cached W-1 rows + the new
//                row, SiLU, the window shifted in place, and the gates (GDN or GDN2).
//   decode_rule  one decode token per row: the recurrent state of (slot, value head) read once,
//                decayed, S^T k and S^T q summed in the same pass, the state updated and written
//                back in place; o = scale (S'^T q + u (k.q)). The state is fp32 or bf16 in
//                memory (fp32 in registers; bf16 rounded to nearest even when stored).
//                decode_rule_pipe: the same per item, a grid of resident blocks looping over the
//                items with the next item's state tile loading while the current one computes.
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

// Converting row copies (fp32 <-> bf16 cache states), same grid as copy_rows.
template <typename TS, typename TD>
__device__ void copy_rows_cvt(const TS* __restrict__ src, long long s_ld, long long s_off, TD* __restrict__ dst,
                              long long d_ld, long long d_off, long long width, const int* __restrict__ pairs,
                              long long chunks) {
    long long p = blockIdx.x / chunks, ch = blockIdx.x % chunks;
    long long c = ch * blockDim.x + threadIdx.x;
    int sr = pairs[2 * p], dr = pairs[2 * p + 1];
    if (sr < 0 || dr < 0 || c >= width) return;
    st(dst, (long long)dr * d_ld + d_off + c, ld(src, (long long)sr * s_ld + s_off + c));
}

extern "C" __global__ void copy_rows_cvt_f32_bf16(const float* src, long long s_ld, long long s_off, bf16_t* dst,
                                                  long long d_ld, long long d_off, long long width,
                                                  const int* pairs, long long chunks) {
    copy_rows_cvt(src, s_ld, s_off, dst, d_ld, d_off, width, pairs, chunks);
}
extern "C" __global__ void copy_rows_cvt_bf16_f32(const bf16_t* src, long long s_ld, long long s_off, float* dst,
                                                  long long d_ld, long long d_off, long long width,
                                                  const int* pairs, long long chunks) {
    copy_rows_cvt(src, s_ld, s_off, dst, d_ld, d_off, width, pairs, chunks);
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

// ---- decode_rule: one item = (row, value head, tile of BV = 8 C value columns), 128 threads.
// Thread (tx = tid % 8, ty = tid / 8) holds columns c0 .. c0+C-1 (c0 = tile*BV + C tx) of key rows
// ty, ty+16, ..., ty+16(R-1): the state tile is loaded once (16-byte loads when the row stride
// allows: fp32 4 values, bf16 8 (C = 8) or 4 values in 8 bytes (C = 4)) into fp32 registers,
// decayed, reduced over its rows, reduced over the 16 row groups in order through shared memory,
// updated and stored (plain 16-byte stores: `st.global.cs` cost 16-52 bytes of spills). q, k of the
// key head (l2-normalized in the block when asked) sit in shared memory.
// GDN: S' = exp(g) S, u = beta (v - S'^T k), S = S' + k u^T.
// GDN2: S' = diag(exp(g)) S, u = w v - S'^T (b k), S = S' + k u^T.
// Both: o = scale S^T q = scale (S'^T q + u (k.q)).
// decode_rule_r{R}_c{C}_{o}_{s}: one block per item. decode_rule_pipe_r{R}_c4_{o}_{s}: a grid of
// resident blocks, block b taking items b, b + grid, ...; the next item's tile is loaded into a
// second register set before the current one is computed, so a block always has loads in flight.
// Per item the arithmetic is the same code in the same order: both kernels give the same bits.
#define DEC_THREADS 128
#define DEC_MAXDK 256

template <int C>
struct DecSmem {
    float sk[DEC_MAXDK], sq[DEC_MAXDK], skb[DEC_MAXDK], sa[DEC_MAXDK];
    float red_p[16][8 * C], red_q[16][8 * C];
    float su[8 * C];
};

// 16-byte (or 8-byte) vector accesses of C consecutive state values.
template <int C>
__device__ __forceinline__ void dec_ldv(const float* p, float* r) {
#pragma unroll
    for (int j4 = 0; j4 < C / 4; ++j4) {
        const float4 t = *reinterpret_cast<const float4*>(p + 4 * j4);
        r[4 * j4 + 0] = t.x;
        r[4 * j4 + 1] = t.y;
        r[4 * j4 + 2] = t.z;
        r[4 * j4 + 3] = t.w;
    }
}
__device__ __forceinline__ float dec_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float dec_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned int dec_pack(float a, float b) {
    return (unsigned int)f32_to_bf16(a) | ((unsigned int)f32_to_bf16(b) << 16);
}
template <int C>
__device__ __forceinline__ void dec_ldv(const bf16_t* p, float* r) {
    if (C == 8) {
        const uint4 t = *reinterpret_cast<const uint4*>(p);
        r[0] = dec_lo(t.x); r[1] = dec_hi(t.x); r[2] = dec_lo(t.y); r[3] = dec_hi(t.y);
        r[4] = dec_lo(t.z); r[5] = dec_hi(t.z); r[6] = dec_lo(t.w); r[7] = dec_hi(t.w);
    } else {
        const uint2 t = *reinterpret_cast<const uint2*>(p);
        r[0] = dec_lo(t.x); r[1] = dec_hi(t.x); r[2] = dec_lo(t.y); r[3] = dec_hi(t.y);
    }
}
template <int C>
__device__ __forceinline__ void dec_stv(float* p, const float* r) {
#pragma unroll
    for (int j4 = 0; j4 < C / 4; ++j4)
        *reinterpret_cast<float4*>(p + 4 * j4) = make_float4(r[4 * j4], r[4 * j4 + 1], r[4 * j4 + 2], r[4 * j4 + 3]);
}
template <int C>
__device__ __forceinline__ void dec_stv(bf16_t* p, const float* r) {
    if (C == 8)
        *reinterpret_cast<uint4*>(p) =
            make_uint4(dec_pack(r[0], r[1]), dec_pack(r[2], r[3]), dec_pack(r[4], r[5]), dec_pack(r[6], r[7]));
    else
        *reinterpret_cast<uint2*>(p) = make_uint2(dec_pack(r[0], r[1]), dec_pack(r[2], r[3]));
}

// Values per vector access of the state type: the row stride must be a multiple for the vector path.
template <int C, typename TS>
__device__ __forceinline__ int dec_vec_mult() { return sizeof(TS) == 4 ? 4 : C; }

// The item's coordinates.
struct DecItem {
    long long row;
    int h, tile, slot;
};
__device__ __forceinline__ DecItem dec_item(long long it, int vtiles, int hv, const int* __restrict__ slots) {
    DecItem d;
    d.tile = (int)(it % vtiles);
    d.h = (int)((it / vtiles) % hv);
    d.row = it / ((long long)vtiles * hv);
    d.slot = slots[d.row];
    return d;
}

// Load the thread's part of an item's state tile (S: the (slot, head) state) into registers.
template <int R, int C, typename TS>
__device__ __forceinline__ void dec_load(float (&s)[R][C], const TS* __restrict__ S, int ty, int c0, int dk, int dv) {
    const bool vec = (dv % dec_vec_mult<C, TS>()) == 0 && c0 + C - 1 < dv;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r < dk && vec) {
            dec_ldv<C>(S + (long long)r * dv + c0, s[i]);
        } else {
#pragma unroll
            for (int j = 0; j < C; ++j) s[i][j] = (r < dk && c0 + j < dv) ? ld(S, (long long)r * dv + c0 + j) : 0.f;
        }
    }
}

// One live item, its tile in `s`: steps 2-6 (q/k, reductions, u and o, the update stored).
template <int R, int C, typename TS, typename TO>
__device__ __forceinline__ void dec_body(float (&s)[R][C], TS* __restrict__ S, const DecItem& it,
                                         const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, const float* __restrict__ g,
                                         const float* __restrict__ bb, const float* __restrict__ w,
                                         TO* __restrict__ o, int hk, int hv, int dk, int dv, float scale, int l2norm,
                                         int gdn2, DecSmem<C>& sm) {
    constexpr int BV = 8 * C;
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const int c0 = it.tile * BV + tx * C;
    const long long row = it.row;
    const int h = it.h;
    const long long orow = (row * hv + h) * dv;
    // The item's scalars and this thread's value column, loaded now (beside the state tile's and
    // q/k's loads) rather than after the barriers below, where each would be one more dependent
    // round trip in the block's chain: GDN's decay g and beta, v and GDN2's w of column tid.
    const float g_h = gdn2 ? 0.f : g[row * hv + h];
    const int my_col = it.tile * BV + tid;
    const bool has_col = tid < BV && my_col < dv;
    const float v_c = has_col ? v[orow + my_col] : 0.f;
    const float bw_c = has_col ? (gdn2 ? w[orow + my_col] : bb[row * hv + h]) : 0.f;
    // 2. q, k of the key head (and GDN2's per-channel decay) into shared memory.
    const int kh = h / (hv / hk);
    const long long kb = (row * hk + kh) * dk;
    for (int c = tid; c < dk; c += DEC_THREADS) {
        sm.sq[c] = q[kb + c];
        sm.sk[c] = k[kb + c];
        sm.sa[c] = gdn2 ? expf(g[kb + c]) : 0.f;
        if (gdn2) sm.skb[c] = bb[kb + c];
    }
    __syncthreads();
    // 3. The l2 norms' reciprocals and k.q, each computed by every warp from shared memory
    // (lane-strided sums, then the xor butterfly: every lane of every warp holds the same bits),
    // so no barrier is needed after them; normalized values are formed where they are read
    // (x * r, the same rounding as storing them normalized). Without the in-kernel norm r = 1.
    const int lane = tid & 31;
    float rk = 1.f, rq = 1.f;
    if (l2norm) {
        float ak = 0.f, aq = 0.f;
        for (int c = lane; c < dk; c += 32) {
            ak += sm.sk[c] * sm.sk[c];
            aq += sm.sq[c] * sm.sq[c];
        }
        rk = 1.f / sqrtf(warp_sum(ak) + 1e-6f);
        rq = 1.f / sqrtf(warp_sum(aq) + 1e-6f);
    }
    float kq = 0.f;
    for (int c = lane; c < dk; c += 32) kq += (sm.sk[c] * rk) * (sm.sq[c] * rq);
    kq = warp_sum(kq);
    // 4. Decay, and the partial sums of S'^T (k or b k) and S'^T q over this thread's rows.
    const float a_h = gdn2 ? 1.f : expf(g_h);
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
            const float kn = sm.sk[r] * rk;
            const float a = gdn2 ? sm.sa[r] : a_h, kr = gdn2 ? sm.skb[r] * kn : kn, qr = sm.sq[r] * rq;
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
        sm.red_p[ty][tx * C + j] = pp[j];
        sm.red_q[ty][tx * C + j] = pq[j];
    }
    __syncthreads();
    // 5. Row groups summed in order; u and o per column.
    if (tid < BV) {
        float p = 0.f, qq = 0.f;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            p += sm.red_p[t][tid];
            qq += sm.red_q[t][tid];
        }
        float u = 0.f;
        if (has_col) {
            u = gdn2 ? bw_c * v_c - p : bw_c * (v_c - p);
            st(o, orow + my_col, scale * (qq + u * kq));
        }
        sm.su[tid] = u;
    }
    __syncthreads();
    // 6. S = S' + k u^T, stored in place.
    const bool vec = (dv % dec_vec_mult<C, TS>()) == 0 && c0 + C - 1 < dv;
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r >= dk) continue;
        const float kr = sm.sk[r] * rk;
#pragma unroll
        for (int j = 0; j < C; ++j) s[i][j] += kr * sm.su[tx * C + j];
        if (vec) {
            dec_stv<C>(S + (long long)r * dv + c0, s[i]);
        } else {
#pragma unroll
            for (int j = 0; j < C; ++j)
                if (c0 + j < dv) st(S, (long long)r * dv + c0 + j, s[i][j]);
        }
    }
}

// Padding (a slot outside [0, nslots)): zero output, no state touched.
template <int C, typename TO>
__device__ __forceinline__ void dec_pad(const DecItem& it, TO* __restrict__ o, int hv, int dv) {
    constexpr int BV = 8 * C;
    const int tid = threadIdx.x;
    const long long orow = (it.row * hv + it.h) * dv;
    if (tid < BV && it.tile * BV + tid < dv) st(o, orow + it.tile * BV + tid, 0.f);
}

template <int R, int C, typename TS, typename TO>
__device__ void decode_rule(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                            const float* __restrict__ g, const float* __restrict__ bb, const float* __restrict__ w,
                            TS* __restrict__ state, const int* __restrict__ slots, int nslots, TO* __restrict__ o,
                            int hk, int hv, int dk, int dv, float scale, int l2norm, int gdn2) {
    __shared__ DecSmem<C> sm;
    const int vtiles = (dv + 8 * C - 1) / (8 * C);
    const DecItem it = dec_item(blockIdx.x, vtiles, hv, slots);
    if (it.slot < 0 || it.slot >= nslots) {
        dec_pad<C>(it, o, hv, dv);
        return;
    }
    TS* S = state + ((long long)it.slot * hv + it.h) * dk * dv;
    const int tid = threadIdx.x;
    const int c0 = it.tile * 8 * C + (tid & 7) * C;
    // 1. The state tile, first, so its loads are in flight during the q/k work.
    float s[R][C];
    dec_load<R, C>(s, S, tid >> 3, c0, dk, dv);
    dec_body<R, C>(s, S, it, q, k, v, g, bb, w, o, hk, hv, dk, dv, scale, l2norm, gdn2, sm);
}

template <int R, int C, typename TS, typename TO>
__device__ void decode_rule_pipe(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, const float* __restrict__ g,
                                 const float* __restrict__ bb, const float* __restrict__ w, TS* __restrict__ state,
                                 const int* __restrict__ slots, int nslots, TO* __restrict__ o, int hk, int hv,
                                 int dk, int dv, float scale, int l2norm, int gdn2, long long items) {
    __shared__ DecSmem<C> sm;
    const int vtiles = (dv + 8 * C - 1) / (8 * C);
    const int tid = threadIdx.x, ty = tid >> 3, txc = (tid & 7) * C;
    long long i = blockIdx.x;
    if (i >= items) return;
    DecItem cur = dec_item(i, vtiles, hv, slots);
    bool cur_live = cur.slot >= 0 && cur.slot < nslots;
    float s[R][C];
    if (cur_live) dec_load<R, C>(s, state + ((long long)cur.slot * hv + cur.h) * dk * dv, ty, cur.tile * 8 * C + txc, dk, dv);
    for (; i < items; i += gridDim.x) {
        // The next item's tile into the second register set, before this one computes.
        const long long j = i + gridDim.x;
        DecItem nx = cur;
        bool nx_live = false;
        float sn[R][C];
        if (j < items) {
            nx = dec_item(j, vtiles, hv, slots);
            nx_live = nx.slot >= 0 && nx.slot < nslots;
            if (nx_live)
                dec_load<R, C>(sn, state + ((long long)nx.slot * hv + nx.h) * dk * dv, ty, nx.tile * 8 * C + txc, dk, dv);
        }
        if (cur_live) {
            TS* S = state + ((long long)cur.slot * hv + cur.h) * dk * dv;
            dec_body<R, C>(s, S, cur, q, k, v, g, bb, w, o, hk, hv, dk, dv, scale, l2norm, gdn2, sm);
        } else {
            dec_pad<C>(cur, o, hv, dv);
        }
        // Everyone is done with this item's shared memory before the next one writes it.
        __syncthreads();
        cur = nx;
        cur_live = nx_live;
        if (nx_live) {
#pragma unroll
            for (int a = 0; a < R; ++a)
#pragma unroll
                for (int b = 0; b < C; ++b) s[a][b] = sn[a][b];
        }
    }
}

// Blocks per SM asked of the register allocator (ptxas -v, sm_90a, no spills). 4 columns per
// thread: 8 up to R = 4 (64 registers), 6 for R = 8 (Dk 65..128: 80 registers; 8 blocks spilled
// 60 bytes), 3 for R = 16. 8 columns per thread (twice the bytes in flight per thread, half the
// blocks and half the per-block q/k work per byte): 8 / 6 / 4 / 2 for R <= 2 / 4 / 8 / 16.
// Pipelined (two register sets of R x 4): 4 blocks per SM at R = 8.
#define DECODE_RULE(R, C, OS, TO, SS, TS, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, MINB) decode_rule_r##R##_c##C##_##OS##_##SS(     \
        const float* q, const float* k, const float* v, const float* g, const float* bb, const float* w,          \
        TS* state, const int* slots, int nslots, TO* o, int hk, int hv, int dk, int dv, float scale, int l2norm,  \
        int gdn2) {                                                                                                \
        decode_rule<R, C, TS, TO>(q, k, v, g, bb, w, state, slots, nslots, o, hk, hv, dk, dv, scale, l2norm,    \
                                  gdn2);                                                                           \
    }
// fp32 states: C = 4 and 8; bf16 states: C = 8 (one 16-byte access per row of a thread).
#define DECODE_RULE_TYPES(R, C, MINB)                       \
    DECODE_RULE(R, C, f32, float, f32, float, MINB)         \
    DECODE_RULE(R, C, bf16, bf16_t, f32, float, MINB)
#define DECODE_RULE_TYPES_BF16S(R, MINB)                    \
    DECODE_RULE(R, 8, f32, float, bf16, bf16_t, MINB)       \
    DECODE_RULE(R, 8, bf16, bf16_t, bf16, bf16_t, MINB)
DECODE_RULE_TYPES(2, 4, 8)
DECODE_RULE_TYPES(4, 4, 8)
DECODE_RULE_TYPES(8, 4, 6)
DECODE_RULE_TYPES(16, 4, 3)
DECODE_RULE_TYPES(2, 8, 8)
DECODE_RULE_TYPES(4, 8, 6)
DECODE_RULE_TYPES(8, 8, 4)
DECODE_RULE_TYPES(16, 8, 2)
DECODE_RULE_TYPES_BF16S(2, 8)
DECODE_RULE_TYPES_BF16S(4, 6)
DECODE_RULE_TYPES_BF16S(8, 4)
DECODE_RULE_TYPES_BF16S(16, 2)

#define DECODE_RULE_PIPE(R, OS, TO, SS, TS, MINB)                                                                \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, MINB) decode_rule_pipe_r##R##_c4_##OS##_##SS(    \
        const float* q, const float* k, const float* v, const float* g, const float* bb, const float* w,          \
        TS* state, const int* slots, int nslots, TO* o, int hk, int hv, int dk, int dv, float scale, int l2norm,  \
        int gdn2, long long items) {                                                                               \
        decode_rule_pipe<R, 4, TS, TO>(q, k, v, g, bb, w, state, slots, nslots, o, hk, hv, dk, dv, scale, l2norm, \
                                       gdn2, items);                                                               \
    }
// Pipelined: fp32 states, Dk 33..128.
DECODE_RULE_PIPE(4, f32, float, f32, float, 5)
DECODE_RULE_PIPE(4, bf16, bf16_t, f32, float, 5)
DECODE_RULE_PIPE(8, f32, float, f32, float, 4)
DECODE_RULE_PIPE(8, bf16, bf16_t, f32, float, 4)

// ---- Programmatic dependent launch (issue 14, opt-in: GDN_DECODE_PDL=1 / CachePool::set_pdl).
// The same kernels, launched with cudaLaunchAttributeProgrammaticStreamSerialization
// (backend::launch::launch_pdl): a kernel may start while the one before it on the stream is
// still running, and `griddepcontrol.wait` blocks until that one has finished and its writes are
// visible. Every kernel here waits before it touches anything the step's earlier kernels write
// (or read), then lets its own dependents launch (`launch_dependents`, after the wait: so a kernel
// two places later in the chain never starts before this one's predecessor finished, whatever
// the predecessor's own trigger). decode_rule_pdl issues its state tile's loads before the wait:
// within a step nothing but this kernel touches the states, and the kernel before its predecessor
// (decode_pre_pdl's predecessor, the in_proj GEMM) has finished by then (decode_pre_pdl triggers
// only after its own wait), as has everything queued before the step (the step's first kernel is
// an ordinary launch, or waits first). The slot indices are written by the host before the step.
// Without PDL (an ordinary launch, or an architecture below sm_90) the waits return at once and
// the triggers do nothing. Per item the arithmetic is the plain kernels' code: the same bits.
__device__ __forceinline__ void dec_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void dec_pdl_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define DECODE_PRE_PDL(SFX, T)                                                                                   \
    extern "C" __global__ void decode_pre_pdl_##SFX(                                                             \
        const T* proj, long long pd, int qkv_off, int g0, int g1, int g2, T* conv, const int* slots, int nslots,   \
        const float* conv_w, const float* conv_b, int has_bias, const float* a_log, const float* dt_bias,          \
        float* q, float* k, float* v, float* g, float* b, float* w, int hk, int hv, int dk, int dv, int width,     \
        int gdn2, long long chunks) {                                                                              \
        dec_pdl_wait();                                                                                            \
        dec_pdl_launch();                                                                                          \
        decode_pre(proj, pd, qkv_off, g0, g1, g2, conv, slots, nslots, conv_w, conv_b, has_bias, a_log, dt_bias, \
                   q, k, v, g, b, w, hk, hv, dk, dv, width, gdn2, chunks);                                       \
    }
DECODE_PRE_PDL(f32, float)
DECODE_PRE_PDL(bf16, bf16_t)

// decode_rule (one block per item) with the state tile loaded before the wait.
template <int R, int C, typename TS, typename TO>
__device__ void decode_rule_pdl(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, const float* __restrict__ g,
                                const float* __restrict__ bb, const float* __restrict__ w, TS* __restrict__ state,
                                const int* __restrict__ slots, int nslots, TO* __restrict__ o, int hk, int hv,
                                int dk, int dv, float scale, int l2norm, int gdn2) {
    __shared__ DecSmem<C> sm;
    const int vtiles = (dv + 8 * C - 1) / (8 * C);
    const DecItem it = dec_item(blockIdx.x, vtiles, hv, slots);
    const bool live = it.slot >= 0 && it.slot < nslots;
    TS* S = state + ((long long)(live ? it.slot : 0) * hv + it.h) * dk * dv;
    const int tid = threadIdx.x;
    const int c0 = it.tile * 8 * C + (tid & 7) * C;
    float s[R][C];
    if (live) dec_load<R, C>(s, S, tid >> 3, c0, dk, dv);
    dec_pdl_wait();
    dec_pdl_launch();
    if (!live) {
        dec_pad<C>(it, o, hv, dv);
        return;
    }
    dec_body<R, C>(s, S, it, q, k, v, g, bb, w, o, hk, hv, dk, dv, scale, l2norm, gdn2, sm);
}

#define DECODE_RULE_PDL(R, C, OS, TO, SS, TS, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, MINB) decode_rule_pdl_r##R##_c##C##_##OS##_##SS( \
        const float* q, const float* k, const float* v, const float* g, const float* bb, const float* w,          \
        TS* state, const int* slots, int nslots, TO* o, int hk, int hv, int dk, int dv, float scale, int l2norm,  \
        int gdn2) {                                                                                                \
        decode_rule_pdl<R, C, TS, TO>(q, k, v, g, bb, w, state, slots, nslots, o, hk, hv, dk, dv, scale, l2norm, \
                                      gdn2);                                                                       \
    }
#define DECODE_RULE_PDL_TYPES(R, C, MINB)                   \
    DECODE_RULE_PDL(R, C, f32, float, f32, float, MINB)     \
    DECODE_RULE_PDL(R, C, bf16, bf16_t, f32, float, MINB)
#define DECODE_RULE_PDL_TYPES_BF16S(R, MINB)                \
    DECODE_RULE_PDL(R, 8, f32, float, bf16, bf16_t, MINB)   \
    DECODE_RULE_PDL(R, 8, bf16, bf16_t, bf16, bf16_t, MINB)
DECODE_RULE_PDL_TYPES(2, 4, 8)
DECODE_RULE_PDL_TYPES(4, 4, 8)
DECODE_RULE_PDL_TYPES(8, 4, 6)
DECODE_RULE_PDL_TYPES(16, 4, 3)
DECODE_RULE_PDL_TYPES(2, 8, 8)
DECODE_RULE_PDL_TYPES(4, 8, 6)
DECODE_RULE_PDL_TYPES(8, 8, 4)
DECODE_RULE_PDL_TYPES(16, 8, 2)
DECODE_RULE_PDL_TYPES_BF16S(2, 8)
DECODE_RULE_PDL_TYPES_BF16S(4, 6)
DECODE_RULE_PDL_TYPES_BF16S(8, 4)
DECODE_RULE_PDL_TYPES_BF16S(16, 2)
