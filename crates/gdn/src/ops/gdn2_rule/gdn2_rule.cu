// CUDA GDN2 rule (per-key-channel decay g, erase gate b, write gate w), forward and backward.
// A token-by-token recurrence (no chunked WY form): simple and correct, not fast.
//
//   g2_fwd      per (sequence, value head, V tile of 32 columns): walks the tokens with the
//               state tile [Dk, 32] in registers (thread: column = lane, rows warp + 8 i),
//               writes o and the final state.
//   g2_bwd      same blocks: walks the tokens forward storing the state at the start of every
//               64-token chunk (ckpt), then the chunks in reverse: recomputes the chunk's states
//               (into the block's own `loc` workspace), then backpropagates token by token.
//               dv, dw are whole per block (the tile owns its columns); dq, dk, dg, db are sums
//               over all Dv columns, written as per-tile fp32 partials.
//   g2_reduce   sums the per-tile partials in tile order (zero on padding rows); dq, dk then go
//               through gated_delta_rule's gdr_reduce_qk (GVA sum, l2 norm backward).
//
// No atomics, fixed reduction orders: bitwise reproducible. fp32 math, offsets 64-bit.

#define G2_NT 256
#define G2_MAXD 256
// Rows per thread: Dk / 8 (8 warps), at most 256 / 8.
#define G2_NR 32
#define G2_CK 64

typedef long long i64;

struct G2Geo {
    int tile, j, kh, lane, rg, c, nr;
    bool cv;
    i64 n;
};

__device__ __forceinline__ G2Geo g2_geo(int hk_n, int hv_n, int dk, int dv) {
    G2Geo G;
    const int ntile = (dv + 31) / 32;
    G.tile = blockIdx.x % ntile;
    G.j = (blockIdx.x / ntile) % hv_n;
    G.n = (i64)(blockIdx.x / ntile / hv_n);
    G.kh = G.j / (hv_n / hk_n);
    G.lane = threadIdx.x & 31;
    G.rg = threadIdx.x >> 5;
    G.c = G.tile * 32 + G.lane;
    G.cv = G.c < dv;
    G.nr = dk / 8;
    return G;
}

// Shared rows of one token.
struct G2Rows {
    float* q;
    float* k;
    float* a;   // exp(g)
    float* b;
    float* bk;  // b * k
    float* v;
    float* w;
    float* d_o;
};

template <typename TQ, typename T>
__device__ __forceinline__ void g2_load(const G2Geo& G, G2Rows R, const TQ* q, const TQ* k, const T* v,
                                        const float* g, const T* b, const T* w, const T* d_o, i64 t,
                                        int hk_n, int hv_n, int dk, int dv) {
    for (int x = threadIdx.x; x < dk; x += G2_NT) {
        const i64 kr = (t * hk_n + G.kh) * dk + x, gr = (t * hv_n + G.j) * dk + x;
        const float kv = ld(k, kr), bv = ld(b, gr);
        if (q) R.q[x] = ld(q, kr);
        R.k[x] = kv;
        R.a[x] = expf(g[gr]);
        R.b[x] = bv;
        R.bk[x] = bv * kv;
    }
    if (threadIdx.x < 32) {
        const int cc = G.tile * 32 + threadIdx.x;
        const i64 vr = (t * hv_n + G.j) * dv + cc;
        const bool ok = cc < dv;
        R.v[threadIdx.x] = ok ? ld(v, vr) : 0.f;
        R.w[threadIdx.x] = ok ? ld(w, vr) : 0.f;
        if (d_o) R.d_o[threadIdx.x] = ok ? ld(d_o, vr) : 0.f;
    }
}

#define G2_SHARED                                                                 \
    __shared__ float s_q[G2_MAXD], s_k[G2_MAXD], s_a[G2_MAXD], s_b[G2_MAXD];      \
    __shared__ float s_bk[G2_MAXD], s_v[32], s_w[32], s_do[32], s_red[8][32];     \
    G2Rows R = {s_q, s_k, s_a, s_b, s_bk, s_v, s_w, s_do};

// One step on the thread's state rows: S = a S; e = S^T bk; delta = w v - e; S += k delta^T.
// Rows already in shared memory. Returns delta (of the thread's column). Syncs inside.
__device__ __forceinline__ float g2_step(const G2Geo& G, const G2Rows& R, float (&S)[G2_NR],
                                         float (*red)[32]) {
    float e = 0.f;
#pragma unroll
    for (int i = 0; i < G2_NR; ++i) {
        if (i < G.nr) {
            const int x = G.rg + 8 * i;
            S[i] *= R.a[x];
            e += S[i] * R.bk[x];
        }
    }
    red[G.rg][G.lane] = e;
    __syncthreads();
    float ee = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) ee += red[r][G.lane];
    const float delta = R.w[G.lane] * R.v[G.lane] - ee;
#pragma unroll
    for (int i = 0; i < G2_NR; ++i) {
        if (i < G.nr) S[i] += R.k[G.rg + 8 * i] * delta;
    }
    return delta;
}

template <typename TQ, typename T>
__device__ void g2_fwd(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                       const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                       const i64* __restrict__ cu, int hk_n, int hv_n, int dk, int dv, float scale,
                       const float* __restrict__ h0, T* __restrict__ o, float* __restrict__ fin) {
    G2_SHARED
    const G2Geo G = g2_geo(hk_n, hv_n, dk, dv);
    const i64 sbase = (G.n * hv_n + G.j) * (i64)dk * dv;
    float S[G2_NR];
#pragma unroll
    for (int i = 0; i < G2_NR; ++i)
        S[i] = (i < G.nr && G.cv && h0) ? h0[sbase + (i64)(G.rg + 8 * i) * dv + G.c] : 0.f;
    const i64 t0 = cu[G.n], t1 = cu[G.n + 1];
    for (i64 t = t0; t < t1; ++t) {
        __syncthreads();
        g2_load<TQ, T>(G, R, q, k, v, g, b, w, (const T*)nullptr, t, hk_n, hv_n, dk, dv);
        __syncthreads();
        g2_step(G, R, S, s_red);
        float oo = 0.f;
#pragma unroll
        for (int i = 0; i < G2_NR; ++i) {
            if (i < G.nr) oo += S[i] * R.q[G.rg + 8 * i];
        }
        __syncthreads();
        s_red[G.rg][G.lane] = oo;
        __syncthreads();
        if (G.rg == 0 && G.cv) {
            float s = 0.f;
#pragma unroll
            for (int r = 0; r < 8; ++r) s += s_red[r][G.lane];
            st(o, (t * hv_n + G.j) * dv + G.c, s * scale);
        }
    }
    if (fin && G.cv) {
#pragma unroll
        for (int i = 0; i < G2_NR; ++i)
            if (i < G.nr) fin[sbase + (i64)(G.rg + 8 * i) * dv + G.c] = S[i];
    }
}

template <typename TQ, typename T>
__device__ void g2_bwd(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                       const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                       const T* __restrict__ d_o, const i64* __restrict__ cu, const i64* __restrict__ chf,
                       i64 tokens, int hk_n, int hv_n, int dk, int dv, float scale,
                       const float* __restrict__ h0, const float* __restrict__ dht, float* __restrict__ ckpt,
                       float* __restrict__ loc, float* __restrict__ dq_p, float* __restrict__ dk_p,
                       float* __restrict__ dg_p, float* __restrict__ db_p, T* __restrict__ dv_out,
                       T* __restrict__ dw_out, float* __restrict__ dh0) {
    G2_SHARED
    const G2Geo G = g2_geo(hk_n, hv_n, dk, dv);
    const i64 sn = (i64)dk * dv;
    const i64 sbase = (G.n * hv_n + G.j) * sn;
    const i64 t0 = cu[G.n], t1 = cu[G.n + 1];
    float* lb = loc + (i64)blockIdx.x * G2_CK * dk * 32;
    float S[G2_NR];
    // Phase 1: chunk-start states.
#pragma unroll
    for (int i = 0; i < G2_NR; ++i)
        S[i] = (i < G.nr && G.cv && h0) ? h0[sbase + (i64)(G.rg + 8 * i) * dv + G.c] : 0.f;
    for (i64 t = t0; t < t1; ++t) {
        if ((t - t0) % G2_CK == 0 && G.cv) {
            float* cp = ckpt + ((chf[G.n] + (t - t0) / G2_CK) * hv_n + G.j) * sn;
#pragma unroll
            for (int i = 0; i < G2_NR; ++i)
                if (i < G.nr) cp[(i64)(G.rg + 8 * i) * dv + G.c] = S[i];
        }
        __syncthreads();
        g2_load<TQ, T>(G, R, (const TQ*)nullptr, k, v, g, b, w, (const T*)nullptr, t, hk_n, hv_n, dk, dv);
        __syncthreads();
        g2_step(G, R, S, s_red);
    }
    // Phase 2: chunks in reverse.
    float dS[G2_NR];
#pragma unroll
    for (int i = 0; i < G2_NR; ++i)
        dS[i] = (i < G.nr && G.cv && dht) ? dht[sbase + (i64)(G.rg + 8 * i) * dv + G.c] : 0.f;
    const i64 len = t1 - t0;
    const i64 nch = (len + G2_CK - 1) / G2_CK;
    const i64 pstride = tokens * hv_n * (i64)dk;  // one tile's partials
    for (i64 ci = nch - 1; ci >= 0; --ci) {
        const i64 ct0 = t0 + ci * G2_CK;
        const int cl = (int)min((i64)G2_CK, t1 - ct0);
        const float* cp = ckpt + ((chf[G.n] + ci) * hv_n + G.j) * sn;
#pragma unroll
        for (int i = 0; i < G2_NR; ++i) S[i] = (i < G.nr && G.cv) ? cp[(i64)(G.rg + 8 * i) * dv + G.c] : 0.f;
        for (int u = 0; u < cl; ++u) {
#pragma unroll
            for (int i = 0; i < G2_NR; ++i)
                if (i < G.nr) lb[((i64)u * dk + G.rg + 8 * i) * 32 + G.lane] = S[i];
            __syncthreads();
            g2_load<TQ, T>(G, R, (const TQ*)nullptr, k, v, g, b, w, (const T*)nullptr, ct0 + u, hk_n, hv_n,
                           dk, dv);
            __syncthreads();
            g2_step(G, R, S, s_red);
        }
        for (int u = cl - 1; u >= 0; --u) {
            const i64 t = ct0 + u;
            __syncthreads();
            g2_load<TQ, T>(G, R, q, k, v, g, b, w, d_o, t, hk_n, hv_n, dk, dv);
            __syncthreads();
            float prev[G2_NR];
            float e = 0.f;
#pragma unroll
            for (int i = 0; i < G2_NR; ++i) {
                prev[i] = 0.f;
                if (i < G.nr) {
                    const int x = G.rg + 8 * i;
                    prev[i] = lb[((i64)u * dk + x) * 32 + G.lane];
                    e += R.a[x] * prev[i] * R.bk[x];
                }
            }
            s_red[G.rg][G.lane] = e;
            __syncthreads();
            float ee = 0.f;
#pragma unroll
            for (int r = 0; r < 8; ++r) ee += s_red[r][G.lane];
            const float delta = R.w[G.lane] * R.v[G.lane] - ee;
            const float doc = R.d_o[G.lane];
            float pdd = 0.f;
            const i64 prow = ((i64)G.tile * pstride) + (t * hv_n + G.j) * (i64)dk;
#pragma unroll
            for (int i = 0; i < G2_NR; ++i) {
                if (i < G.nr) {
                    const int x = G.rg + 8 * i;
                    const float cur = R.a[x] * prev[i] + R.k[x] * delta;
                    dS[i] += scale * R.q[x] * doc;
                    const float dqx = warp_sum(cur * doc) * scale;
                    if (G.lane == 0) dq_p[prow + x] = dqx;
                    pdd += dS[i] * R.k[x];
                }
            }
            __syncthreads();
            s_red[G.rg][G.lane] = pdd;
            __syncthreads();
            float dd = 0.f;
#pragma unroll
            for (int r = 0; r < 8; ++r) dd += s_red[r][G.lane];
            if (G.rg == 0 && G.cv) {
                const i64 vr = (t * hv_n + G.j) * dv + G.c;
                st(dw_out, vr, dd * R.v[G.lane]);
                st(dv_out, vr, dd * R.w[G.lane]);
            }
            const float de = -dd;
#pragma unroll
            for (int i = 0; i < G2_NR; ++i) {
                if (i < G.nr) {
                    const int x = G.rg + 8 * i;
                    const float a = R.a[x];
                    const float sp = a * prev[i];
                    const float dk1 = warp_sum(dS[i] * delta);
                    const float dbk = warp_sum(sp * de);
                    const float dsp = dS[i] + R.bk[x] * de;
                    const float dgx = a * warp_sum(dsp * prev[i]);
                    dS[i] = a * dsp;
                    if (G.lane == 0) {
                        dk_p[prow + x] = dk1 + dbk * R.b[x];
                        db_p[prow + x] = dbk * R.k[x];
                        dg_p[prow + x] = dgx;
                    }
                }
            }
        }
    }
    if (dh0 && G.cv) {
#pragma unroll
        for (int i = 0; i < G2_NR; ++i)
            if (i < G.nr) dh0[sbase + (i64)(G.rg + 8 * i) * dv + G.c] = dS[i];
    }
}

// Sums of the per-tile partials, in tile order; zero on padding rows.
template <typename T>
__device__ void g2_reduce(const float* __restrict__ dq_p, const float* __restrict__ dk_p,
                          const float* __restrict__ dg_p, const float* __restrict__ db_p, int tiles, i64 tokens,
                          i64 used, int hv_n, int dk, float* __restrict__ dq, float* __restrict__ dk_out,
                          float* __restrict__ dg, T* __restrict__ db) {
    const i64 i = (i64)blockIdx.x * G2_NT + threadIdx.x;
    const i64 n = tokens * hv_n * (i64)dk;
    if (i >= n) return;
    const i64 t = i / ((i64)hv_n * dk);
    float a = 0.f, bq = 0.f, c = 0.f, d = 0.f;
    if (t < used) {
        for (int p = 0; p < tiles; ++p) {
            a += dq_p[p * n + i];
            bq += dk_p[p * n + i];
            c += dg_p[p * n + i];
            d += db_p[p * n + i];
        }
    }
    dq[i] = a;
    dk_out[i] = bq;
    dg[i] = c;
    st(db, i, d);
}

#define G2_ENTRIES(TQ, T, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(G2_NT)                                                       \
        g2_fwd_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w, const i64* cu, \
                   int hk, int hv, int dk, int dv, float scale, const float* h0, T* o, float* fin) {          \
        g2_fwd<TQ, T>(q, k, v, g, b, w, cu, hk, hv, dk, dv, scale, h0, o, fin);                              \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(G2_NT)                                                       \
        g2_bwd_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w, const T* d_o, \
                   const i64* cu, const i64* chf, i64 tokens, int hk, int hv, int dk, int dv, float scale,    \
                   const float* h0, const float* dht, float* ckpt, float* loc, float* dq_p, float* dk_p,      \
                   float* dg_p, float* db_p, T* dv_out, T* dw_out, float* dh0) {                              \
        g2_bwd<TQ, T>(q, k, v, g, b, w, d_o, cu, chf, tokens, hk, hv, dk, dv, scale, h0, dht, ckpt, loc, dq_p, \
                      dk_p, dg_p, db_p, dv_out, dw_out, dh0);                                                 \
    }

G2_ENTRIES(float, float, f32)
G2_ENTRIES(bf16_t, bf16_t, bf16)
G2_ENTRIES(float, bf16_t, bf16n)

extern "C" __global__ void __launch_bounds__(G2_NT)
    g2_reduce_f32(const float* dq_p, const float* dk_p, const float* dg_p, const float* db_p, int tiles,
                  i64 tokens, i64 used, int hv, int dk, float* dq, float* dk_out, float* dg, float* db) {
    g2_reduce<float>(dq_p, dk_p, dg_p, db_p, tiles, tokens, used, hv, dk, dq, dk_out, dg, db);
}

extern "C" __global__ void __launch_bounds__(G2_NT)
    g2_reduce_bf16(const float* dq_p, const float* dk_p, const float* dg_p, const float* db_p, int tiles,
                   i64 tokens, i64 used, int hv, int dk, float* dq, float* dk_out, float* dg, bf16_t* db) {
    g2_reduce<bf16_t>(dq_p, dk_p, dg_p, db_p, tiles, tokens, used, hv, dk, dq, dk_out, dg, db);
}
