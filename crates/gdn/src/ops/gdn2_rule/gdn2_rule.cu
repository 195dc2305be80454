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

// =============================================================================================
// Chunked forward (issue 17): the algorithm of cpu.rs on the GPU, chunk C = 64 rows, per-channel
// decay handled in sub-chunks of 16 rows so that no exponential overflows. Dk, Dv <= 128.
//
// Within a chunk of l <= 64 rows (rows >= l are zero rows with g = 0) with start state S0, per
// key channel c: Gam = inclusive cumsum of g over the chunk's rows (summed in f64, kept as
// hi + lo f32 so that a difference of two rows is accurate), gd(i, j) = e^(Gam_i - Gam_j),
// Kb = B * K, eg = e^Gam, ed = e^(Gam_63 - Gam) (Gam_63 = Gam_{l-1}: padding rows add 0):
//
//   M_ij = sum_c Kb_ic gd_c(i, j) K_jc   (j < i)       A_ij = sum_c Q_ic gd_c(i, j) K_jc  (j <= i)
//   T  = (I + M)^-1,   U = T (W * V),   Wm = T (Kb * eg)
//   D  = U - Wm S0,    O = scale ((Q * eg) S0 + A D),   S1 = Diag(eg_63) S0 + (K * ed)^T D
//
// M and A by 16-row sub-chunks (I = row block, J = column block):
//   - diagonal blocks (J = I): elementwise, the exponent Gam_i - Gam_j <= 0 taken first;
//   - J < I: with ref_I = 16 I - 1 (the row before block I) and r_J = 16 J + 15 (J's last row),
//     gd(i, j) = e^(Gam_i - Gam_ref_I) * e^(Gam_ref_I - Gam_r_J) * e^(Gam_r_J - Gam_j), three
//     factors in [0, 1] (j <= r_J <= ref_I < i): the strip A[I, 0..16I) is the product of
//     Qup_I = Q_I * e^(Gam_I - Gam_ref_I) and (Kdn * c_IJ)^T, Kdn_j = K_j e^(Gam_r_J - Gam_j),
//     c_IJ = e^(Gam_ref_I - Gam_r_J) (a vector over channels; 1 for J = I - 1). Same for M with
//     Kbup. Nothing overflows; what underflows is negligible next to what is kept.
//   - T by 16x16 blocks: diagonal blocks by substitution (one thread per column), then block rows
//     I = 1..3: T_IJ = -T_II sum_{K=J}^{I-1} M_IK T_KJ.
//
// Kernels (256 threads, dynamic shared memory):
//   g2c_prep   per (chunk, value head): Gam, M, A, T, U, Wm; writes U, Wm, A, Qg = Q * eg,
//              Kd = K * ed, eg_63 to fp32 workspaces (rows >= l zero)
//   g2c_scan   per (sequence, value head, V tile of BV = 16 or 32 columns): walks the chunks with
//              the state tile S [Dk, BV] fp32 in shared memory: stores h[c] = S, D = U - Wm S,
//              then S = eg_63 * S + Kd^T D; the next chunk's Wm, Kd, U, eg_63 are fetched with
//              cp.async while the current one computes (double buffer); final state
//   g2c_out    per (chunk, value head, 64 columns): O = scale (Qg h[c] + A D)
// fp32 FMAs throughout (both storage types), fixed summation orders, no atomics: bitwise
// reproducible. Offsets 64-bit.

#define G2C_C 64
#define G2C_MAXD 128
#define G2C_NT 256
// Row stride of T in shared memory (float4-aligned rows).
#define G2C_LT 68

__device__ __forceinline__ void g2c_cp16(void* s, const void* g) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g));
}
__device__ __forceinline__ void g2c_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void g2c_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Workspace geometry of one (chunk, value head) `cj`: U [64][dv], Wm, Qg, Kd [64][dk],
// A [64][64], eg_63 [dk], h [dk][dv], D [64][dv].

template <typename TQ, typename T>
__device__ void g2c_prep(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                         const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                         const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                         int dk, int dv, float* __restrict__ ws_u, float* __restrict__ ws_wm,
                         float* __restrict__ ws_qg, float* __restrict__ ws_kd, float* __restrict__ ws_a,
                         float* __restrict__ ws_egl, float* __restrict__ ws_t) {
    extern __shared__ __align__(16) float g2c_sm[];
    const int tid = threadIdx.x;
    const i64 cj = blockIdx.x;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const int kh = j / (hv_n / hk_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int LX = (dk > dv ? dk : dv) + 1;
    const int MX = G2C_C * (LX > G2C_LT ? LX : G2C_LT);  // T [64][G2C_LT] lives in one of these
    float* sGh = g2c_sm;            // Gam hi; later T-solve scratch
    float* sGl = sGh + MX;          // Gam lo
    float* sQ = sGl + MX;           // Q, then Qup; later T [64][G2C_LT]
    float* sK = sQ + MX;            // K, then Kdn; later W * V
    float* sKb = sK + MX;           // Kb, then Kbup
    float* sX = sKb + MX;           // Kb * eg
    float* sM = sX + MX;            // M [64][65]
    float* sC = sM + G2C_C * 65;    // c_IJ [6][dk]
    float* sT = sQ;
    const i64 ck = cj * G2C_C * (i64)dk, cv = cj * G2C_C * (i64)dv;
    float* a_out = ws_a + cj * G2C_C * G2C_C;

    // 1. Rows (zero at or after l) and Gam.
    for (int idx = tid; idx < G2C_C * dk; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        float qv = 0.f, kv = 0.f, bv = 0.f;
        if (i < l) {
            const i64 t = t0 + i;
            const i64 kr = (t * hk_n + kh) * dk + x;
            qv = ld(q, kr);
            kv = ld(k, kr);
            bv = ld(b, (t * hv_n + j) * dk + x);
        }
        sQ[i * LX + x] = qv;
        sK[i * LX + x] = kv;
        sKb[i * LX + x] = bv * kv;
    }
    if (tid < dk) {
        double acc = 0.0;
        for (int i = 0; i < G2C_C; ++i) {
            if (i < l) acc += (double)g[((t0 + i) * hv_n + j) * dk + tid];
            const float hi = (float)acc;
            sGh[i * LX + tid] = hi;
            sGl[i * LX + tid] = (float)(acc - (double)hi);
        }
    }
    // Upper triangle of A is zero.
    for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) {
        if ((idx & 63) > (idx >> 6)) a_out[idx] = 0.f;
    }
    __syncthreads();
#define G2C_GD(i, jj, x) \
    expf((sGh[(i) * LX + (x)] - sGh[(jj) * LX + (x)]) + (sGl[(i) * LX + (x)] - sGl[(jj) * LX + (x)]))

    // 2. Diagonal 16x16 blocks of A and M, one block row I at a time: thread (il, xs) =
    //    (tid / 16, tid % 16) keeps row i's Q, Kb, Gam on channels xs + 16 p in registers and walks
    //    j <= i (a warp holds rows il & ~1 and il | 1 and walks to the larger; the other row's
    //    extra steps are discarded); the 16 channel slices of a row (one half-warp) are summed by
    //    shuffles in a fixed order.
    {
        const int il = tid >> 4, xs = tid & 15;
        const int np = dk >> 4;  // channels per thread, <= 8
        for (int I = 0; I < 4; ++I) {
            const int i = 16 * I + il;
            float qi[8], kbi[8], ghi[8], gli[8];
#pragma unroll
            for (int p = 0; p < 8; ++p) {
                qi[p] = kbi[p] = ghi[p] = gli[p] = 0.f;
                if (p < np) {
                    const int x = xs + 16 * p;
                    qi[p] = sQ[i * LX + x];
                    kbi[p] = sKb[i * LX + x];
                    ghi[p] = sGh[i * LX + x];
                    gli[p] = sGl[i * LX + x];
                }
            }
            for (int jl = 0; jl <= (il | 1); ++jl) {
                const int jj = 16 * I + jl;
                float sa = 0.f, sm = 0.f;
                if (jl <= il) {
#pragma unroll
                    for (int p = 0; p < 8; ++p) {
                        if (p < np) {
                            const int x = xs + 16 * p;
                            const float e = (jl == il)
                                                ? 1.f
                                                : expf((ghi[p] - sGh[jj * LX + x]) + (gli[p] - sGl[jj * LX + x]));
                            const float kk = e * sK[jj * LX + x];
                            sa += qi[p] * kk;
                            sm += kbi[p] * kk;
                        }
                    }
                }
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) {
                    sa += __shfl_xor_sync(0xffffffffu, sa, o);
                    sm += __shfl_xor_sync(0xffffffffu, sm, o);
                }
                if (xs == 0 && jl <= il) {
                    a_out[i * G2C_C + jj] = sa;
                    sM[i * 65 + jj] = (jl < il) ? sm : 0.f;
                }
            }
        }
    }
    __syncthreads();

    // 3. Kd = K * ed, stored transposed ([dk][64]: the scan reads it along the rows), before K is
    //    overwritten below.
    for (int idx = tid; idx < G2C_C * dk; idx += G2C_NT) {
        const int x = idx >> 6, i = idx & 63;
        ws_kd[ck + idx] = sK[i * LX + x] * G2C_GD(G2C_C - 1, i, x);
    }
    __syncthreads();
    //    Per-element factors (read Gam of other rows; each thread rewrites only its own
    //    elements of Q, K, Kb, so the in-place updates do not race).
    for (int idx = tid; idx < G2C_C * dk; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        const int I = i >> 4;
        const float eg = expf(sGh[i * LX + x] + sGl[i * LX + x]);
        const float kv = sK[i * LX + x], qv = sQ[i * LX + x], kbv = sKb[i * LX + x];
        ws_qg[ck + (i64)i * dk + x] = qv * eg;
        sX[i * LX + x] = kbv * eg;
        const float up = (I == 0) ? eg : G2C_GD(i, 16 * I - 1, x);
        sQ[i * LX + x] = qv * up;
        sKb[i * LX + x] = kbv * up;
        sK[i * LX + x] = kv * G2C_GD(16 * I + 15, i, x);
    }
    for (int idx = tid; idx < 6 * dk; idx += G2C_NT) {
        const int p = idx / dk, x = idx - p * dk;
        // p = I (I - 1) / 2 + J for J < I.
        const int I = p < 1 ? 1 : (p < 3 ? 2 : 3);
        const int J = p - I * (I - 1) / 2;
        sC[p * dk + x] = (J == I - 1) ? 1.f : G2C_GD(16 * I - 1, 16 * J + 15, x);
    }
    if (tid < dk) ws_egl[cj * dk + tid] = expf(sGh[(G2C_C - 1) * LX + tid] + sGl[(G2C_C - 1) * LX + tid]);
    __syncthreads();
#undef G2C_GD

    // 4. Strips below the diagonal blocks: rows of block I against columns [0, 16 I), from
    //    Kl = Kdn * c_IJ (built per I in Gam-lo's space, free now).
    {
        const int il = tid >> 4, jl = tid & 15;
        float* sKl = sGl;
        for (int I = 1; I < 4; ++I) {
            const float* cI = sC + (I * (I - 1) / 2) * dk;
            for (int idx = tid; idx < 16 * I * dk; idx += G2C_NT) {
                const int jj = idx / dk, x = idx - jj * dk;
                sKl[jj * LX + x] = sK[jj * LX + x] * cI[(jj >> 4) * dk + x];
            }
            __syncthreads();
            const int i = 16 * I + il;
            float sa[3] = {0.f, 0.f, 0.f}, sm[3] = {0.f, 0.f, 0.f};
            for (int x = 0; x < dk; ++x) {
                const float qv = sQ[i * LX + x], kbv = sKb[i * LX + x];
#pragma unroll
                for (int m = 0; m < 3; ++m) {
                    if (m < I) {
                        const float kk = sKl[(16 * m + jl) * LX + x];
                        sa[m] += qv * kk;
                        sm[m] += kbv * kk;
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                if (m < I) {
                    a_out[i * G2C_C + 16 * m + jl] = sa[m];
                    sM[i * 65 + 16 * m + jl] = sm[m];
                }
            }
            __syncthreads();
        }
    }

    // 5. W * V into sK's space; T's diagonal blocks (thread = column) into sT (Q's space).
    for (int idx = tid; idx < G2C_C * dv; idx += G2C_NT) {
        const int i = idx / dv, y = idx - i * dv;
        float wv = 0.f;
        if (i < l) {
            const i64 r = ((t0 + i) * hv_n + j) * dv + y;
            wv = ld(w, r) * ld(v, r);
        }
        sK[i * LX + y] = wv;
    }
    if (tid < G2C_C) {
        const int I = tid >> 4, cl = tid & 15, x = tid;
        for (int il = 0; il < 16; ++il) {
            const int i = 16 * I + il;
            float tv;
            if (il < cl) {
                tv = 0.f;
            } else if (il == cl) {
                tv = 1.f;
            } else {
                float s = 0.f;
                for (int jl = cl; jl < il; ++jl) s += sM[i * 65 + 16 * I + jl] * sT[(16 * I + jl) * G2C_LT + x];
                tv = -s;
            }
            sT[i * G2C_LT + x] = tv;
        }
    }
    __syncthreads();
    float* sY = sGh;  // scratch [16][48]
    for (int I = 1; I < 4; ++I) {
        const int n = 16 * I;
        for (int idx = tid; idx < 16 * n; idx += G2C_NT) {
            const int il = idx / n, x = idx - il * n;
            const int J = x >> 4;
            float s = 0.f;
            for (int y = 16 * J; y < n; ++y) s += sM[(n + il) * 65 + y] * sT[y * G2C_LT + x];
            sY[il * 48 + x] = s;
        }
        __syncthreads();
        for (int idx = tid; idx < 16 * n; idx += G2C_NT) {
            const int il = idx / n, x = idx - il * n;
            float s = 0.f;
            for (int kl = 0; kl <= il; ++kl) s += sT[(n + il) * G2C_LT + n + kl] * sY[kl * 48 + x];
            sT[(n + il) * G2C_LT + x] = -s;
        }
        __syncthreads();
    }

    // T for the chunked backward (when asked for): [64][64], zero above the diagonal (those
    // entries of sT are never written: they hold stale Q). T is complete (synced above).
    if (ws_t) {
        for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) {
            const int i = idx >> 6, x = idx & 63;
            ws_t[cj * G2C_C * G2C_C + idx] = x <= i ? sT[i * G2C_LT + x] : 0.f;
        }
    }

    // 6. U = T (W * V), Wm = T (Kb * eg). T is lower triangular: rows of block rb read columns
    //    < 16 (rb + 1) only (the blocks above the diagonal are never written). Warp w: rows
    //    16 (w & 3) .. + 15, columns y0 + 32 (w >> 2) + lane; T rows read as float4 broadcasts.
    {
        const int warp = tid >> 5, lane = tid & 31, rb = warp & 3;
        for (int mat = 0; mat < 2; ++mat) {
            const int D = mat ? dk : dv;
            const float* X = mat ? sX : sK;
            float* outp = mat ? ws_wm + ck : ws_u + cv;
            for (int y0 = 0; y0 < D; y0 += 64) {
                const int y = y0 + 32 * (warp >> 2) + lane;
                const bool ok = y < D;
                float acc[16];
#pragma unroll
                for (int m = 0; m < 16; ++m) acc[m] = 0.f;
                for (int jj = 0; jj < 16 * (rb + 1); jj += 4) {
                    float xv[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) xv[u] = ok ? X[(jj + u) * LX + y] : 0.f;
#pragma unroll
                    for (int m = 0; m < 16; ++m) {
                        const float4 t4 = *reinterpret_cast<const float4*>(sT + (16 * rb + m) * G2C_LT + jj);
                        acc[m] += t4.x * xv[0];
                        acc[m] += t4.y * xv[1];
                        acc[m] += t4.z * xv[2];
                        acc[m] += t4.w * xv[3];
                    }
                }
                if (ok) {
#pragma unroll
                    for (int m = 0; m < 16; ++m) outp[(i64)(16 * rb + m) * D + y] = acc[m];
                }
            }
        }
    }
}

// Shared memory of g2c_prep (floats): 6 * 64 * max(max(dk, dv) + 1, 68) + 64 * 65 + 6 * dk
// (cuda.rs computes the same).

#ifdef G2B_TC_MODULE
// ---------------------------------------------------------------------------------------------
// g2c_prep8 (issue 17, opt-in: GDN_RULE2_PREP=v8): g2c_prep's outputs (U, Wm, Qg, Kd^T, A,
// e^Gam_L, optionally T) with the block products on TF32 tensor cores and 108,544 B of shared
// memory (two CTAs of 8 warps per SM). Only in the module gdn2_rule_tc (mma_tf32.cuh).
//
// Numerics (what changes against g2c_prep):
//   - Gam is kept per 16-row block relative to the row before the block (Gr_i = Gam_i -
//     Gam_ref_I, the block's own f64 cumsum rounded to f32) plus per-channel f64 constants
//     (P_I = Gam_ref_I, Gam_L - P_I, c_IJ = e^(P_I - P_{J+1})) instead of Gam as hi + lo: a
//     difference of two rows of one block is a difference of two bounded f32 numbers; every
//     exponent is still a difference taken before expf and never positive (mathematically).
//   - the diagonal 16x16 blocks of A and M stay elementwise fp32 (e^(Gr_i - Gr_j) q_i k_j);
//   - the strips below them (Qup_I diag(c_IJ) Kdn_J^T, same with Kbup) and U = T (W * V),
//     Wm = T (Kb * e^Gam) run as 3xTF32 mma.sync m16n8k8 (each fp32 operand split into a TF32
//     hi and a TF32 lo; hi hi + lo hi + hi lo, fp32 accumulation: ~2^-21 relative per product,
//     the f32 tests' 5e-6 bound holds; plain TF32 would be ~5e-4). bf16 m16n8k16 hi + lo
//     (prep7's choice) gives ~2^-16, too coarse for the f32 storage path's contract.
//   - c_IJ is applied to the A fragment (Qup, Kbup) per channel when it is loaded.
//   - T = (I + M)^-1 stays fp32 CUDA-core (diagonal blocks by substitution with the column in
//     registers, block rows below as in g2c_prep).
//   - Gam, P_I, Gam_L - P_I are kept in base 2 (times log2(e), in f64 before the rounding to
//     f32) and every factor is exp2f of a difference: same accuracy as expf of the base-e
//     difference (one f32 rounding of the argument, <= 2 ulp exp2f), fewer instructions.
// Channels are processed in halves of 64 (Dk <= 128): Gam, the diagonal blocks, Qg, Kd^T and
// the strips are per channel or sums over channels, so each half is independent; the diagonal
// and strip sums are accumulated in registers across the halves in a fixed order.
// Shared memory (floats): R0 X half 0 [64][72] | R1 Q, then M [64][68] | R2 K, then T [64][68]
// | R3 Kb [64][68], then W*V columns 0..63 [64][72] | R4 g, Gam, then X half 1 [64][72] | R5
// constants, then W*V columns 64..127 [64][72]. cuda.rs prep8_smem computes the same.
// Fixed orders, no atomics: bitwise reproducible.

#define G2P8_L68 68
#define G2P8_L72 72
#define G2P8_R68 (64 * G2P8_L68)
#define G2P8_R72 (64 * G2P8_L72)
// log2(e): Gam is kept in base-2 units (scaled in f64 before rounding), so every factor is one
// exp2f (the hardware ex2 plus a denormal fix-up) instead of expf's range reduction.
#define G2P8_L2E 1.4426950408889634

__device__ __forceinline__ float4 g2p8_ld4(const float* p, i64 i) { return *reinterpret_cast<const float4*>(p + i); }
__device__ __forceinline__ float4 g2p8_ld4(const bf16_t* p, i64 i) {
    const uint2 u = *reinterpret_cast<const uint2*>(p + i);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ float4 g2p8_mul4(float4 a, float4 b) {
    return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}
__device__ __forceinline__ void g2p8_split(float x, unsigned& hi, unsigned& lo) {
    const float h = to_tf32(x);
    hi = __float_as_uint(h);
    lo = tf32u(x - h);
}

struct G2P8A {
    unsigned h[4], l[4];
};

// Stores of prep8's outputs in fp32 (g2c_prep8_*) or bf16 (g2c_prep8h_*: the fused forward's
// mma operands, rounded to nearest even).
__device__ __forceinline__ void g2p8_st4(float* p, i64 i, float4 v) { *reinterpret_cast<float4*>(p + i) = v; }
__device__ __forceinline__ void g2p8_st4(bf16_t* p, i64 i, float4 v) {
    uint2 u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u.x) : "f"(v.y), "f"(v.x));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u.y) : "f"(v.w), "f"(v.z));
    *reinterpret_cast<uint2*>(p + i) = u;
}
__device__ __forceinline__ void g2p8_st2(float* p, i64 i, float a, float b) {
    *reinterpret_cast<float2*>(p + i) = make_float2(a, b);
}
__device__ __forceinline__ void g2p8_st2(bf16_t* p, i64 i, float a, float b) {
    unsigned u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(b), "f"(a));
    *reinterpret_cast<unsigned*>(p + i) = u;
}

// A fragment (16 x 8, row-major at p, row stride ld), each column k scaled by sc[k] if sc. F1:
// the TF32 hi part only (g2c_prep8 with one TF32 product, F1 below).
template <bool F1 = false>
__device__ __forceinline__ void g2p8_fa(G2P8A& f, const float* p, int ld, const float* sc) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float v[4] = {p[g * ld + t], p[(g + 8) * ld + t], p[g * ld + t + 4], p[(g + 8) * ld + t + 4]};
    if (sc) {
        const float s0 = sc[t], s1 = sc[t + 4];
        v[0] *= s0;
        v[1] *= s0;
        v[2] *= s1;
        v[3] *= s1;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        if (F1) f.h[r] = tf32u(v[r]);
        else g2p8_split(v[r], f.h[r], f.l[r]);
    }
}

// c += a b in 3xTF32: small terms first. F1: one TF32 product (a's and b's hi parts).
template <bool F1 = false>
__device__ __forceinline__ void g2p8_mma3(float (&c)[4], const G2P8A& a, float b0, float b1) {
    if (F1) {
        mma_tf32(c, a.h[0], a.h[1], a.h[2], a.h[3], tf32u(b0), tf32u(b1));
        return;
    }
    unsigned bh0, bl0, bh1, bl1;
    g2p8_split(b0, bh0, bl0);
    g2p8_split(b1, bh1, bl1);
    mma_tf32(c, a.h[0], a.h[1], a.h[2], a.h[3], bl0, bl1);
    mma_tf32(c, a.l[0], a.l[1], a.l[2], a.l[3], bh0, bh1);
    mma_tf32(c, a.h[0], a.h[1], a.h[2], a.h[3], bh0, bh1);
}

// TO: the storage of Wm, Qg, Kd^T and A (float: g2c_prep8_*; bf16_t: g2c_prep8h_*, the fused
// forward's operands; U, e^Gam_L and T stay fp32). F1 (g2c_prep8hf_* / g2c_prep8htf_*, opt-in
// GDN_RULE2_PREP8=f1, bf16 outputs only): the strips and U / Wm as one TF32 product instead of
// 3xTF32 (~2^-11 relative per product against ~2^-21; the outputs are rounded to bf16, 2^-9).
template <typename TQ, typename T, typename TO, bool F1 = false>
__device__ void g2c_prep8(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                          const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                          const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                          int dk, int dv, float* __restrict__ ws_u, TO* __restrict__ ws_wm,
                          TO* __restrict__ ws_qg, TO* __restrict__ ws_kd, TO* __restrict__ ws_a,
                          float* __restrict__ ws_egl, float* __restrict__ ws_t) {
    extern __shared__ __align__(16) float g2c_sm[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
    const i64 cj = blockIdx.x;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const int kh = j / (hv_n / hk_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    float* sX0 = g2c_sm;               // R0
    float* sQ = sX0 + G2P8_R72;        // R1
    float* sK = sQ + G2P8_R68;         // R2
    float* sKb = sK + G2P8_R68;        // R3
    float* sG = sKb + G2P8_R72;        // R4
    float* sR5 = sG + G2P8_R72;        // R5
    double* sS = reinterpret_cast<double*>(sR5);  // [4][64] block sums of g (f64)
    float* sP = sR5 + 512;                        // [4][64] P_I = Gam_ref_I
    float* sDl = sP + 256;                        // [4][64] Gam_L - P_I
    float* sCc = sDl + 256;                       // [6][64] c_IJ, p = I (I - 1) / 2 + J
    float* sM = sQ;
    float* sT = sK;
    float* sWV0 = sKb;
    float* sWV1 = sR5;
    const i64 ck = cj * G2C_C * (i64)dk, cv = cj * G2C_C * (i64)dv;
    TO* a_out = ws_a + cj * G2C_C * G2C_C;

    // Diagonal-block pairs of this thread (p = tid + 256 r < 544: block I = p / 136, then
    // (il, jl) with jl <= il) and its three strip tiles, accumulated over the channel halves.
    float da[3] = {0.f, 0.f, 0.f}, dm[3] = {0.f, 0.f, 0.f};
    float sacc[3][4];
#pragma unroll
    for (int s = 0; s < 3; ++s) sacc[s][0] = sacc[s][1] = sacc[s][2] = sacc[s][3] = 0.f;

    const int nh = (dk + 63) >> 6;
    for (int h = 0; h < nh; ++h) {
        const int x0 = 64 * h, hw = min(64, dk - x0), nv = hw >> 2;
        if (h) __syncthreads();  // the previous half's strips have read Q, K, Kb
        // 1. Rows of this half (zero at or after l): every load of the thread issued first.
        {
            float4 qa[4], ka[4], ba[4], ga[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int idx = tid + G2C_NT * r;
                const int i = idx / nv, x = 4 * (idx - i * nv);
                const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
                qa[r] = ka[r] = ba[r] = ga[r] = z;
                if (idx < 64 * nv && i < l) {
                    const i64 t = t0 + i;
                    const i64 kr = (t * hk_n + kh) * dk + x0 + x, vr = (t * hv_n + j) * dk + x0 + x;
                    qa[r] = g2p8_ld4(q, kr);
                    ka[r] = g2p8_ld4(k, kr);
                    ba[r] = g2p8_ld4(b, vr);
                    ga[r] = g2p8_ld4(g, vr);
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int idx = tid + G2C_NT * r;
                const int i = idx / nv, x = 4 * (idx - i * nv);
                if (idx < 64 * nv) {
                    *reinterpret_cast<float4*>(sQ + i * G2P8_L68 + x) = qa[r];
                    *reinterpret_cast<float4*>(sK + i * G2P8_L68 + x) = ka[r];
                    *reinterpret_cast<float4*>(sKb + i * G2P8_L68 + x) = g2p8_mul4(ba[r], ka[r]);
                    *reinterpret_cast<float4*>(sG + i * G2P8_L72 + x) = ga[r];
                }
            }
        }
        __syncthreads();
        // 2. Gam per 16-row block relative to the row before it (f64 sums), in place of g;
        //    the block sums, then the per-channel constants.
        {
            const int x = tid & 63, I = tid >> 6;
            if (x < hw) {
                double acc = 0.0;
                for (int il = 0; il < 16; ++il) {
                    float* pg = sG + (16 * I + il) * G2P8_L72 + x;
                    acc += (double)*pg;
                    *pg = (float)(acc * G2P8_L2E);
                }
                sS[I * 64 + x] = acc;
            }
        }
        __syncthreads();
        if (tid < hw) {
            const int x = tid;
            double P[5];
            P[0] = 0.0;
#pragma unroll
            for (int I = 0; I < 4; ++I) P[I + 1] = P[I] + sS[I * 64 + x];
#pragma unroll
            for (int I = 0; I < 4; ++I) {
                sP[I * 64 + x] = (float)(P[I] * G2P8_L2E);
                sDl[I * 64 + x] = (float)((P[4] - P[I]) * G2P8_L2E);
            }
#pragma unroll
            for (int I = 1; I < 4; ++I) {
#pragma unroll
                for (int J = 0; J < I; ++J)
                    sCc[(I * (I - 1) / 2 + J) * 64 + x] =
                        (J == I - 1) ? 1.f : exp2f((float)((P[I] - P[J + 1]) * G2P8_L2E));
            }
            ws_egl[cj * dk + x0 + x] = exp2f((float)(P[4] * G2P8_L2E));
        }
        __syncthreads();
        // 3. Diagonal 16x16 blocks of A and M, elementwise: a thread per (i, j) pair walks the
        //    half's channels (float4), e^(Gr_i - Gr_j) with both relative to the same row.
#pragma unroll
        for (int r = 0; r < 3; ++r) {
            const int p = tid + G2C_NT * r;
            if (p < 544) {
                const int I = p / 136, qq = p - 136 * I;
                int il = (int)((sqrtf(8.f * qq + 1.f) - 1.f) * 0.5f);
                while ((il + 1) * (il + 2) / 2 <= qq) ++il;
                while (il * (il + 1) / 2 > qq) --il;
                const int jl = qq - il * (il + 1) / 2;
                const int i = 16 * I + il, jj = 16 * I + jl;
                const bool same = il == jl;
                float sa = da[r], sm = dm[r];
                for (int x = 0; x < hw; x += 4) {
                    const float4 qi = *reinterpret_cast<const float4*>(sQ + i * G2P8_L68 + x);
                    const float4 bi = *reinterpret_cast<const float4*>(sKb + i * G2P8_L68 + x);
                    const float4 kj = *reinterpret_cast<const float4*>(sK + jj * G2P8_L68 + x);
                    const float4 gi = *reinterpret_cast<const float4*>(sG + i * G2P8_L72 + x);
                    const float4 gj = *reinterpret_cast<const float4*>(sG + jj * G2P8_L72 + x);
                    const float e0 = same ? 1.f : exp2f(gi.x - gj.x), e1 = same ? 1.f : exp2f(gi.y - gj.y);
                    const float e2 = same ? 1.f : exp2f(gi.z - gj.z), e3 = same ? 1.f : exp2f(gi.w - gj.w);
                    const float k0 = e0 * kj.x, k1 = e1 * kj.y, k2 = e2 * kj.z, k3 = e3 * kj.w;
                    sa += qi.x * k0;
                    sm += bi.x * k0;
                    sa += qi.y * k1;
                    sm += bi.y * k1;
                    sa += qi.z * k2;
                    sm += bi.z * k2;
                    sa += qi.w * k3;
                    sm += bi.w * k3;
                }
                da[r] = sa;
                dm[r] = sm;
            }
        }
        __syncthreads();
        // 4. Kd^T = (K e^(Gam_L - Gam))^T to memory and Kdn = K e^(Gam_rJ - Gam) in place: warp
        //    tiles of 8 rows x 4 channels (32-byte runs of Kd^T, conflict-free K reads).
        for (int tile = warp; tile < 8 * nv; tile += 8) {
            const int i = 8 * (tile & 7) + (lane & 7), x = 4 * (tile >> 3) + (lane >> 3), I = i >> 4;
            const float kv = sK[i * G2P8_L68 + x], gi = sG[i * G2P8_L72 + x];
            st(ws_kd, ck + (i64)(x0 + x) * G2C_C + i, kv * exp2f(sDl[I * 64 + x] - gi));
            sK[i * G2P8_L68 + x] = kv * exp2f(sG[(16 * I + 15) * G2P8_L72 + x] - gi);
        }
        __syncthreads();
        // 5. Qg = Q e^Gam to memory; Qup = Q e^Gr, Kbup = Kb e^Gr in place; X = Kb e^Gam (half
        //    0 into R0, half 1 in place of Gam).
        {
            float* sXh = h ? sG : sX0;
            for (int idx = tid; idx < 64 * nv; idx += G2C_NT) {
                const int i = idx / nv, x = 4 * (idx - i * nv), I = i >> 4;
                const float4 q4 = *reinterpret_cast<const float4*>(sQ + i * G2P8_L68 + x);
                const float4 b4 = *reinterpret_cast<const float4*>(sKb + i * G2P8_L68 + x);
                const float4 g4 = *reinterpret_cast<const float4*>(sG + i * G2P8_L72 + x);
                const float4 p4 = *reinterpret_cast<const float4*>(sP + I * 64 + x);
                const float4 eg = make_float4(exp2f(p4.x + g4.x), exp2f(p4.y + g4.y), exp2f(p4.z + g4.z),
                                              exp2f(p4.w + g4.w));
                const float4 up = make_float4(exp2f(g4.x), exp2f(g4.y), exp2f(g4.z), exp2f(g4.w));
                g2p8_st4(ws_qg, ck + (i64)i * dk + x0 + x, g2p8_mul4(q4, eg));
                *reinterpret_cast<float4*>(sQ + i * G2P8_L68 + x) = g2p8_mul4(q4, up);
                *reinterpret_cast<float4*>(sKb + i * G2P8_L68 + x) = g2p8_mul4(b4, up);
                *reinterpret_cast<float4*>(sXh + i * G2P8_L72 + x) = g2p8_mul4(b4, eg);
            }
        }
        __syncthreads();
        // 6. Strips below the diagonal blocks on tensor cores: warp w owns tiles 3 w .. 3 w + 2 of
        //    the 24 (matrix A or M, block row I, 8-column tile nt < 2 I); A operand Qup_I (or
        //    Kbup_I) with c_IJ per channel, B operand Kdn rows (stored [n][k]).
#pragma unroll
        for (int s = 0; s < 3; ++s) {
            const int tau = 3 * warp + s, mat = tau & 1, rest = tau >> 1;
            const int I = rest < 2 ? 1 : (rest < 6 ? 2 : 3), nt = rest - I * (I - 1), J = nt >> 1;
            const float* pa = (mat ? sKb : sQ) + 16 * I * G2P8_L68;
            const float* pb = sK + (8 * nt + g8) * G2P8_L68 + t4;
            const float* cc = (J == I - 1) ? nullptr : sCc + (I * (I - 1) / 2 + J) * 64;
            for (int k0 = 0; k0 < hw; k0 += 8) {
                G2P8A fa;
                g2p8_fa<F1>(fa, pa + k0, G2P8_L68, cc ? cc + k0 : nullptr);
                g2p8_mma3<F1>(sacc[s], fa, pb[k0], pb[k0 + 4]);
            }
        }
    }
    __syncthreads();

    // 7. A to memory, M into R1: strips from the mma accumulators, diagonal pairs, zero above.
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const int tau = 3 * warp + s, mat = tau & 1, rest = tau >> 1;
        const int I = rest < 2 ? 1 : (rest < 6 ? 2 : 3), nt = rest - I * (I - 1);
        const int i = 16 * I + g8, y = 8 * nt + 2 * t4;
        if (mat) {
            sM[i * G2P8_L68 + y] = sacc[s][0];
            sM[i * G2P8_L68 + y + 1] = sacc[s][1];
            sM[(i + 8) * G2P8_L68 + y] = sacc[s][2];
            sM[(i + 8) * G2P8_L68 + y + 1] = sacc[s][3];
        } else {
            g2p8_st2(a_out, i * G2C_C + y, sacc[s][0], sacc[s][1]);
            g2p8_st2(a_out, (i + 8) * G2C_C + y, sacc[s][2], sacc[s][3]);
        }
    }
#pragma unroll
    for (int r = 0; r < 3; ++r) {
        const int p = tid + G2C_NT * r;
        if (p < 544) {
            const int I = p / 136, qq = p - 136 * I;
            int il = (int)((sqrtf(8.f * qq + 1.f) - 1.f) * 0.5f);
            while ((il + 1) * (il + 2) / 2 <= qq) ++il;
            while (il * (il + 1) / 2 > qq) --il;
            const int jl = qq - il * (il + 1) / 2;
            const int i = 16 * I + il, jj = 16 * I + jl;
            st(a_out, i * G2C_C + jj, da[r]);
            sM[i * G2P8_L68 + jj] = (jl < il) ? dm[r] : 0.f;
        }
    }
    for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) {
        if ((idx & 63) > (idx >> 6)) st(a_out, idx, 0.f);
    }
    __syncthreads();

    // 8. T's diagonal blocks (warps 0-1: a thread per column, the column in registers) while
    //    warps 2-7 stage W * V (columns < 64 into R3, the rest into R5), loads issued in fours.
    if (tid < G2C_C) {
        const int I = tid >> 4, cl = tid & 15, x = tid;
        float tc[16];
#pragma unroll
        for (int il = 0; il < 16; ++il) {
            const int i = 16 * I + il;
            float s = 0.f;
#pragma unroll
            for (int jl = 0; jl < il; ++jl) {
                if (jl >= cl) s += sM[i * G2P8_L68 + 16 * I + jl] * tc[jl];
            }
            tc[il] = il < cl ? 0.f : (il == cl ? 1.f : -s);
            sT[i * G2P8_L68 + x] = tc[il];
        }
    } else {
        const int nv = dv >> 2, n = G2C_C * nv;
        for (int base = tid - G2C_C; base < n; base += 4 * (G2C_NT - G2C_C)) {
            float4 wa[4], va[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int idx = base + r * (G2C_NT - G2C_C);
                const int i = idx / nv, y = 4 * (idx - i * nv);
                wa[r] = va[r] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (idx < n && i < l) {
                    const i64 rr = ((t0 + i) * hv_n + j) * dv + y;
                    wa[r] = g2p8_ld4(w, rr);
                    va[r] = g2p8_ld4(v, rr);
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int idx = base + r * (G2C_NT - G2C_C);
                const int i = idx / nv, y = 4 * (idx - i * nv);
                if (idx < n) {
                    float* dst = y < 64 ? sWV0 + i * G2P8_L72 + y : sWV1 + i * G2P8_L72 + (y - 64);
                    *reinterpret_cast<float4*>(dst) = g2p8_mul4(wa[r], va[r]);
                }
            }
        }
    }
    __syncthreads();
    //    Block rows I = 1..3 below the diagonal: T_IJ = -T_II sum_{K=J}^{I-1} M_IK T_KJ (fp32),
    //    the partial sums Y in T's unused rows 0..15, columns 16..63.
    float* sY = sT + 16;
    for (int I = 1; I < 4; ++I) {
        const int n = 16 * I;
        for (int idx = tid; idx < 16 * n; idx += G2C_NT) {
            const int il = idx / n, x = idx - il * n;
            const int J = x >> 4;
            float s = 0.f;
            for (int y = 16 * J; y < n; ++y) s += sM[(n + il) * G2P8_L68 + y] * sT[y * G2P8_L68 + x];
            sY[il * G2P8_L68 + x] = s;
        }
        __syncthreads();
        for (int idx = tid; idx < 16 * n; idx += G2C_NT) {
            const int il = idx / n, x = idx - il * n;
            float s = 0.f;
            for (int kl = 0; kl <= il; ++kl) s += sT[(n + il) * G2P8_L68 + n + kl] * sY[kl * G2P8_L68 + x];
            sT[(n + il) * G2P8_L68 + x] = -s;
        }
        __syncthreads();
    }
    if (ws_t) {
        for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) {
            const int i = idx >> 6, x = idx & 63;
            ws_t[cj * G2C_C * G2C_C + idx] = x <= i ? sT[i * G2P8_L68 + x] : 0.f;
        }
    }

    // 9. U = T (W * V), Wm = T X on tensor cores. Warp w: matrix w & 1 (U, Wm), columns
    //    64 ((w >> 1) & 1) .. + 63, row blocks {0, 3} (w < 4) or {1, 2}: 10 k steps per warp.
    //    T's row block rb reads k < 16 (rb + 1) only (blocks above the diagonal never read).
    {
        const int mat = warp & 1, ch = (warp >> 1) & 1;
        const int D = mat ? dk : dv, y0 = 64 * ch;
        const int ntl = y0 < D ? min(64, D - y0) >> 3 : 0;
        const float* Bb = mat ? (ch ? sG : sX0) : (ch ? sWV1 : sWV0);
#pragma unroll
        for (int pr = 0; pr < 2; ++pr) {
            const int rb = warp < 4 ? (pr ? 3 : 0) : (pr ? 2 : 1);
            if (ntl == 0) continue;
            float acc[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
            for (int k0 = 0; k0 < 16 * (rb + 1); k0 += 8) {
                G2P8A fa;
                g2p8_fa<F1>(fa, sT + 16 * rb * G2P8_L68 + k0, G2P8_L68, nullptr);
                const float* pb = Bb + (k0 + t4) * G2P8_L72 + g8;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    if (nt < ntl) g2p8_mma3<F1>(acc[nt], fa, pb[8 * nt], pb[4 * G2P8_L72 + 8 * nt]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                if (nt < ntl) {
                    const int i = 16 * rb + g8, y = y0 + 8 * nt + 2 * t4;
                    if (mat) {
                        g2p8_st2(ws_wm, ck + (i64)i * D + y, acc[nt][0], acc[nt][1]);
                        g2p8_st2(ws_wm, ck + (i64)(i + 8) * D + y, acc[nt][2], acc[nt][3]);
                    } else {
                        g2p8_st2(ws_u, cv + (i64)i * D + y, acc[nt][0], acc[nt][1]);
                        g2p8_st2(ws_u, cv + (i64)(i + 8) * D + y, acc[nt][2], acc[nt][3]);
                    }
                }
            }
        }
    }
}

#define G2C8_ENTRIES(TQ, T, S)                                                                                \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 2)                                                   \
        g2c_prep8_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,           \
                      const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float* ws_u,       \
                      float* ws_wm, float* ws_qg, float* ws_kd, float* ws_a, float* ws_egl, float* ws_t) {    \
        g2c_prep8<TQ, T, float>(q, k, v, g, b, w, ch_t0, ch_len, hk, hv, dk, dv, ws_u, ws_wm, ws_qg, ws_kd,   \
                                ws_a, ws_egl, ws_t);                                                          \
    }

// g2c_prep8h_*: the same kernel writing Wm, Qg, Kd^T and A in bf16 for g2f_fwd8 (no T).
#define G2C8H_ENTRIES(TQ, T, S)                                                                               \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 2)                                                   \
        g2c_prep8h_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,          \
                       const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float* ws_u,      \
                       bf16_t* ws_wm, bf16_t* ws_qg, bf16_t* ws_kd, bf16_t* ws_a, float* ws_egl) {            \
        g2c_prep8<TQ, T, bf16_t>(q, k, v, g, b, w, ch_t0, ch_len, hk, hv, dk, dv, ws_u, ws_wm, ws_qg, ws_kd,  \
                                 ws_a, ws_egl, nullptr);                                                      \
    }

// g2c_prep8ht_*: g2c_prep8h writing T too (fp32), for backward v5.
#define G2C8HT_ENTRIES(TQ, T, S)                                                                              \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 2)                                                   \
        g2c_prep8ht_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,         \
                        const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float* ws_u,     \
                        bf16_t* ws_wm, bf16_t* ws_qg, bf16_t* ws_kd, bf16_t* ws_a, float* ws_egl,             \
                        float* ws_t) {                                                                        \
        g2c_prep8<TQ, T, bf16_t>(q, k, v, g, b, w, ch_t0, ch_len, hk, hv, dk, dv, ws_u, ws_wm, ws_qg, ws_kd,  \
                                 ws_a, ws_egl, ws_t);                                                         \
    }

// g2c_prep8hf_* / g2c_prep8htf_*: g2c_prep8h / g2c_prep8ht with one TF32 product (F1).
#define G2C8F_ENTRIES(TQ, T, S)                                                                               \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 2)                                                   \
        g2c_prep8hf_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,         \
                        const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float* ws_u,     \
                        bf16_t* ws_wm, bf16_t* ws_qg, bf16_t* ws_kd, bf16_t* ws_a, float* ws_egl) {           \
        g2c_prep8<TQ, T, bf16_t, true>(q, k, v, g, b, w, ch_t0, ch_len, hk, hv, dk, dv, ws_u, ws_wm, ws_qg,   \
                                       ws_kd, ws_a, ws_egl, nullptr);                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 2)                                                   \
        g2c_prep8htf_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,        \
                         const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float* ws_u,    \
                         bf16_t* ws_wm, bf16_t* ws_qg, bf16_t* ws_kd, bf16_t* ws_a, float* ws_egl,            \
                         float* ws_t) {                                                                       \
        g2c_prep8<TQ, T, bf16_t, true>(q, k, v, g, b, w, ch_t0, ch_len, hk, hv, dk, dv, ws_u, ws_wm, ws_qg,   \
                                       ws_kd, ws_a, ws_egl, ws_t);                                            \
    }

G2C8_ENTRIES(float, float, f32)
G2C8_ENTRIES(bf16_t, bf16_t, bf16)
G2C8_ENTRIES(float, bf16_t, bf16n)
G2C8H_ENTRIES(bf16_t, bf16_t, bf16)
G2C8H_ENTRIES(float, bf16_t, bf16n)
G2C8HT_ENTRIES(bf16_t, bf16_t, bf16)
G2C8HT_ENTRIES(float, bf16_t, bf16n)
G2C8F_ENTRIES(bf16_t, bf16_t, bf16)
G2C8F_ENTRIES(float, bf16_t, bf16n)

// ---------------------------------------------------------------------------------------------
// g2f_fwd8 (issue 17, opt-in: GDN_RULE2_FWD=v8): the chunked forward's scan and output fused on
// bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), after g2c_prep8h (Wm, Qg, Kd^T, A
// in bf16; U, e^Gam_L fp32). The GDN rule's gdr_fwd6 (V6Lean) design with GDN2's chunk step:
// per (sequence, value head, V tile of BV = 16 NW columns), NW warps; warp w keeps S^T for the
// tile's columns 16 w .. 16 w + 15 (16 x DK, fp32) in registers as m16n8 accumulator fragments.
// Per chunk (operands in shared memory, chunk c + NS - 1's loads in flight by cp.async):
//   X   = S0^T Wm^T                   (16 x 64)   A operand: S0^T as bf16
//   P   = S0^T Qg^T                   (16 x 64)   same A operand (the output's first product)
//   D^T = U^T - X                     (fp32, from the U tile; then bf16)
//   S^T = S0^T diag(e^Gam_L) + D^T Kd            (B operand Kd^T rows: [DK][64] bf16)
//   O^T = scale (P + D^T A^T)         (A's 16 x 16 blocks above the diagonal skipped)
// GDN2 against GDN's step: the state decay is per key channel (a per-column scale of S^T's
// fragments by e^Gam_L[x], x = 8 nt + 2t + (c & 1)) and already inside Kd = K e^(Gam_L - Gam) and
// Qg = Q e^Gam (prep), so the step takes no exponential and D is not rescaled. Rows >= l of U,
// Wm, Qg, Kd and A are zero in the workspaces (prep), so D's rows >= l are zero; o rows >= l are
// not stored. The chunk-start states h and D never reach memory (the chunked backward recomputes
// them with g2c_prep / g2c_scan). Numerics: state and accumulation fp32; the operands of the
// five products are bf16 (S0, D, Wm, Qg, Kd, A); no exponent at all; fixed orders, no atomics.
// Helpers: copies of gated_delta_rule.cu's v6 primitives (pack_bf16, mma_bf16, ldmatrix,
// cp.async), prefixed g2f_, kept here so that the gated_delta_rule module is untouched (a later
// clean-up may move both to ops/common).
// PTX fragment maps (g = lane / 4, t = lane % 4), m16n8k16 .bf16:
//   A (16 x 16, row): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)
//   B (16 x 8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t + 8.., n g)
//   C (16 x 8):       c0, c1 = (g, 2t), (g, 2t + 1); c2, c3 = (g + 8, 2t), (g + 8, 2t + 1)

__device__ __forceinline__ unsigned g2f_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void g2f_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned g2f_saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void g2f_ldsm4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(g2f_saddr(p)));
}
__device__ __forceinline__ void g2f_cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void g2f_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void g2f_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Named barriers (SPLIT): the producer arrives without waiting, the consumer waits; `n` threads
// in all (a multiple of 32); orders the shared-memory accesses before it.
__device__ __forceinline__ void g2f_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void g2f_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ unsigned g2f_dyn_smem() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// One pipeline stage of g2f_fwd8 (bytes; every region 16-byte aligned; rows padded by 16 bytes
// so that ldmatrix's 8 row addresses fall in 8 different bank groups). cuda.rs
// (fwd8_stage_bytes) computes STAGE with the same formula.
template <int DK, int NW>
struct G2F8 {
    static constexpr int BV = 16 * NW;
    static constexpr int NT = 32 * NW;
    static constexpr int LK = DK + 8;      // bf16 row stride of Wm, Qg
    static constexpr int LT = G2C_C + 8;   // bf16 row stride of Kd^T and A
    static constexpr int LU = BV + 4;      // fp32 row stride of U
    static constexpr int WM_OFF = 0;
    static constexpr int QG_OFF = WM_OFF + G2C_C * LK * 2;
    static constexpr int KT_OFF = QG_OFF + G2C_C * LK * 2;
    static constexpr int A_OFF = KT_OFF + DK * LT * 2;
    static constexpr int U_OFF = A_OFF + G2C_C * LT * 2;
    static constexpr int E_OFF = U_OFF + G2C_C * LU * 4;
    static constexpr int STAGE = E_OFF + DK * 4;
};

// S^T's accumulator fragments (g2f_fwd8's state, g2b_dscan8's state gradient: a warp's 16
// columns x NT8 * 8 rows) against a row-major [rows][dv] state at p (the warp's first column):
// element (nt, c) of lane (g, t) is row 8 nt + 2t + (c & 1), column g + 8 (c >> 1). (g2f_fwd8's
// own h0 / fin loops spell the same map out: this helper changes their PTX, and that kernel is
// a GPU-measured default.)
__device__ __forceinline__ i64 g2f_frag_off(int nt, int c, int dv) {
    const int lane = threadIdx.x & 31;
    return (i64)(8 * nt + 2 * (lane & 3) + (c & 1)) * dv + (lane >> 2) + 8 * (c >> 1);
}
// The fragments from p (fp32), or zeros where p is null.
template <int NT8>
__device__ __forceinline__ void g2f_frags_ld(float (&f)[NT8][4], const float* p, int dv) {
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) f[nt][c] = p ? p[g2f_frag_off(nt, c, dv)] : 0.f;
}
// The fragments to p (fp32, or bf16 rounded to nearest even).
template <int NT8, typename T>
__device__ __forceinline__ void g2f_frags_st(T* p, const float (&f)[NT8][4], int dv) {
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) st(p, g2f_frag_off(nt, c, dv), f[nt][c]);
}

// One chunk's operands into a stage (all threads, one cp.async group): Wm, Qg [64][DK], Kd^T
// [DK][64], A [64][64] (bf16, contiguous per chunk-head), the CTA's U tile [64][BV] (fp32, row
// stride dv) and e^Gam_L [DK]. Thread tid always copies the same 16-byte column piece of rows
// tid / (pieces per row) + (rows per pass) m: shared offsets are immediates from one base. NTH
// threads 0 .. NTH - 1 (`tid`) share the copies: the whole CTA of 32 NW threads, or with SPLIT
// the 32 NW threads of the output warps.
// !LOADQ (g2f_hrec8): Qg is not copied (the recompute has no output product).
template <int DK, int NW, int NTH, bool LOADQ = true>
__device__ __forceinline__ void g2f_load_stage(int tid, char* st, const bf16_t* wm, const bf16_t* qg,
                                               const bf16_t* kt, const bf16_t* a, const float* u, i64 urow,
                                               const float* egl) {
    typedef G2F8<DK, NW> L;
    const unsigned sb = g2f_saddr(st);
    {
        constexpr int CPR = DK / 8, RPP = NTH / CPR;
        static_assert(NTH % CPR == 0 && G2C_C % RPP == 0, "whole rows per pass");
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const int go = i0 * DK + x;
#pragma unroll
        for (int m = 0; m < G2C_C / RPP; ++m) {
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            g2f_cp16(sr + L::WM_OFF, wm + go + RPP * m * DK);
            if (LOADQ) g2f_cp16(sr + L::QG_OFF, qg + go + RPP * m * DK);
        }
    }
    {
        constexpr int RPT = NTH / 8;  // Kd^T and A: 8 pieces per row
        const int i0 = tid >> 3, x = (tid & 7) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LT + x) * 2);
        const int go = i0 * G2C_C + x;
#pragma unroll
        for (int m = 0; m < DK / RPT; ++m)
            g2f_cp16(so + L::KT_OFF + (unsigned)(RPT * m * L::LT * 2), kt + go + RPT * m * G2C_C);
#pragma unroll
        for (int m = 0; m < G2C_C / RPT; ++m)
            g2f_cp16(so + L::A_OFF + (unsigned)(RPT * m * L::LT * 2), a + go + RPT * m * G2C_C);
    }
    {
        constexpr int UPR = L::BV / 4, RPU = NTH / UPR;  // 8 rows per pass
        static_assert(G2C_C % RPU == 0, "whole rows per pass");
        const int i0 = tid / UPR, x = (tid % UPR) * 4;
        const unsigned so = sb + L::U_OFF + (unsigned)((i0 * L::LU + x) * 4);
        const float* gu = u + i0 * urow + x;
        const i64 step = RPU * urow;
#pragma unroll
        for (int m = 0; m < G2C_C / RPU; ++m) {
            g2f_cp16(so + (unsigned)(RPU * m * L::LU * 4), gu);
            gu += step;
        }
    }
    if (tid < DK / 4) g2f_cp16(sb + L::E_OFF + tid * 16, egl + tid * 4);
    g2f_commit();
}

// Grid: N * Hv * (dv / BV) CTAs of 32 NW threads (64 NW with SPLIT); dynamic shared memory NS *
// G2F8<DK, NW>::STAGE (+ 6 KiB per warp pair with SPLIT); a launch with less writes nothing (the
// tests see the poisoned output). Workspaces from g2c_prep8h (chunk-head cb = chunk * Hv + value
// head): wm, qg [cb][64][DK], kt [cb][DK][64], a [cb][64][64] bf16; u [cb][64][dv], egl [cb][DK]
// fp32. o [tokens][Hv][dv] bf16; states [N][Hv][DK][dv] fp32.
// SPLIT (g2f_fwd8x_*): warps 0 .. NW - 1 run the chain (X, D, the state update), warps NW ..
// 2 NW - 1 the output of the same columns (P = S0^T Qg^T, D^T A^T, the stores), on other
// schedulers: the chain warp posts S0^T's bf16 fragments (then D^T's) to shared memory and
// arrives at named barrier 1 (then 2); its output warp waits there (bar.sync), reads them and
// computes. The output warps also issue every cp.async of the stages. The chain's step shrinks
// from 212 to 128 mma and has no load to issue. Same products in the same order: the same bits
// as without SPLIT.
// HREC (g2f_hrec8_*, backward v5's recompute): no output; the chunk-start states h[c] = S0
// (bf16, [cb][DK][dv]) and D (bf16, [cb][64][dv]) stored for the backward instead (fin unused).
template <int DK, int NW, int NS, bool SPLIT, bool HREC = false>
__device__ void g2f_fwd8(const bf16_t* __restrict__ wm_ws, const bf16_t* __restrict__ qg_ws,
                         const bf16_t* __restrict__ kt_ws, const bf16_t* __restrict__ a_ws,
                         const float* __restrict__ u_ws, const float* __restrict__ egl_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hv_n, int dv, float scale,
                         const float* __restrict__ h0, bf16_t* __restrict__ o, float* __restrict__ fin,
                         bf16_t* __restrict__ h_ws = nullptr, bf16_t* __restrict__ d_ws = nullptr) {
    static_assert(!(HREC && SPLIT), "the recompute runs unsplit");
    typedef G2F8<DK, NW> L;
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    constexpr int NTH = SPLIT ? 2 * L::NT : L::NT;  // the CTA's threads
    constexpr int XB = SPLIT ? NW * 6144 : 0;  // S0^T (4 KiB) and D^T (2 KiB) fragments per warp
    if (g2f_dyn_smem() < (unsigned)(NS * L::STAGE + XB)) return;
    extern __shared__ __align__(16) float g2c_sm[];
    char* sm = reinterpret_cast<char*>(g2c_sm);
    const int nvt = dv / L::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r = lane & 7;
    const bool chain = !SPLIT || warp < NW;  // runs the chain (and, without SPLIT, the output)
    const int cw = SPLIT ? warp % NW : warp;  // the warp's column group
    const i64 col0 = (i64)vt * L::BV;         // the CTA's first state column
    const int wc0 = 16 * cw;                  // the warp's first column inside the tile
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 vrow = (i64)hv_n * dv;
    // SPLIT: the fragments exchanged, [column group][register / 4][lane] as uint4.
    uint4* xs = reinterpret_cast<uint4*>(sm + NS * L::STAGE) + cw * 8 * 32 + lane;
    uint4* xd = reinterpret_cast<uint4*>(sm + NS * L::STAGE + NW * 4096) + cw * 4 * 32 + lane;

    // s[nt][c] = S[8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)] (S^T's accumulator fragments)
    float s[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = (h0 && chain)
                           ? h0[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                           : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    // The copies: every thread (plain) or the output warps' (SPLIT; the chain warps issue none,
    // their cp.async waits return at once and the __syncthreads after the output warps' waits
    // publishes the stage to them).
    auto issue = [&](i64 c, int stage) {
        if (SPLIT && chain) return;
        const i64 cb = c * hv_n + hv;
        g2f_load_stage<DK, NW, L::NT, !HREC>(SPLIT ? (int)threadIdx.x - L::NT : (int)threadIdx.x, sm + stage * L::STAGE,
                                      wm_ws + cb * G2C_C * DK, qg_ws + cb * G2C_C * DK, kt_ws + cb * DK * G2C_C,
                                      a_ws + cb * G2C_C * G2C_C, u_ws + cb * G2C_C * dv + col0, (i64)dv,
                                      egl_ws + cb * DK);
    };
#pragma unroll
    for (int p = 0; p < NS - 1; ++p) {
        if (c_beg + p < c_end) issue(c_beg + p, p);
        else g2f_commit();
    }
    for (i64 c = c_beg; c < c_end; ++c) {
        const int stg = (int)((c - c_beg) % NS);
        g2f_wait<NS - 2>();  // chunk c's group (only the NS - 2 newer may pend)
        // Stage stg (chunk c) is complete and visible to all; every warp is done with the stage
        // of chunk c - 1 (and, SPLIT, with the fragments of chunk c - 1), which now receives
        // chunk c + NS - 1.
        __syncthreads();
        if (c + NS - 1 < c_end) issue(c + NS - 1, (int)((c + NS - 1 - c_beg) % NS));
        else g2f_commit();
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::WM_OFF);
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::QG_OFF);
        const bf16_t* sKt = reinterpret_cast<const bf16_t*>(sp + L::KT_OFF);
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const float* sU = reinterpret_cast<const float*>(sp + L::U_OFF) + wc0;
        const float* sE = reinterpret_cast<const float*>(sp + L::E_OFF);
        const int l = ch_len[c];
        const i64 t0 = ch_t0[c];

        if constexpr (HREC) {
            // h[c] = S0 (bf16)
            g2f_frags_st(h_ws + (c * hv_n + hv) * (i64)DK * dv + col0 + wc0, s, dv);
        }
        // S0^T as bf16 A fragments.
        unsigned sa[DK / 16][4];
        if (chain) {
#pragma unroll
            for (int ks = 0; ks < DK / 16; ++ks) {
                sa[ks][0] = g2f_pack(s[2 * ks][0], s[2 * ks][1]);
                sa[ks][1] = g2f_pack(s[2 * ks][2], s[2 * ks][3]);
                sa[ks][2] = g2f_pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
                sa[ks][3] = g2f_pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
            }
            if (SPLIT) {
#pragma unroll
                for (int ks = 0; ks < DK / 16; ++ks) xs[ks * 32] = make_uint4(sa[ks][0], sa[ks][1], sa[ks][2], sa[ks][3]);
                g2f_bar_arrive(1, NTH);
            }
        } else {
            g2f_bar_sync(1, NTH);
#pragma unroll
            for (int ks = 0; ks < DK / 16; ++ks) {
                const uint4 v4 = xs[ks * 32];
                sa[ks][0] = v4.x;
                sa[ks][1] = v4.y;
                sa[ks][2] = v4.z;
                sa[ks][3] = v4.w;
            }
        }
        // X = S0^T Wm^T (chain) and P = S0^T Qg^T (output) (16 x 64 each, n8 tiles over the
        // chunk rows); without SPLIT interleaved: two independent accumulator sets.
        float x[8][4], oacc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) x[j][cc] = oacc[j][cc] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks)
#pragma unroll
            for (int jp = 0; jp < 4; ++jp) {
                const int off = (16 * jp + 8 * (mi >> 1) + r) * L::LK + 16 * ks + 8 * (mi & 1);
                if (chain) {
                    unsigned bw[4];
                    g2f_ldsm4(bw, sW + off);
                    g2f_mma(x[2 * jp], sa[ks], bw[0], bw[1]);
                    g2f_mma(x[2 * jp + 1], sa[ks], bw[2], bw[3]);
                }
                if (!HREC && (!SPLIT || !chain)) {
                    unsigned bq[4];
                    g2f_ldsm4(bq, sQ + off);
                    g2f_mma(oacc[2 * jp], sa[ks], bq[0], bq[1]);
                    g2f_mma(oacc[2 * jp + 1], sa[ks], bq[2], bq[3]);
                }
            }
        // D^T = U^T - X as bf16 A fragments over the chunk rows (k steps of 16): fragment
        // x[j][c] is (state column g + 8 (c >> 1), chunk row 8 j + 2t + (c & 1)).
        unsigned da[4][4];
        if (chain) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        const int v = g + 8 * rr;
                        const float d0 = sU[i0 * L::LU + v] - x[j][2 * rr];
                        const float d1 = sU[(i0 + 1) * L::LU + v] - x[j][2 * rr + 1];
                        da[kk][rr + 2 * h] = g2f_pack(d0, d1);
                        if constexpr (HREC) {
                            bf16_t* dc = d_ws + (c * hv_n + hv) * (i64)G2C_C * dv + col0 + wc0 + v;
                            st(dc, (i64)i0 * dv, d0);
                            st(dc, (i64)(i0 + 1) * dv, d1);
                        }
                    }
                }
            if (SPLIT) {
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) xd[kk * 32] = make_uint4(da[kk][0], da[kk][1], da[kk][2], da[kk][3]);
                g2f_bar_arrive(2, NTH);
            }
            // S^T <- S0^T diag(e^Gam_L) + D^T Kd: B[k = row i][n = channel x] = Kd^T[x][i], a
            // row-major read of Kd^T.
#pragma unroll
            for (int nt = 0; nt < DK / 8; ++nt) {
                const float2 e = *reinterpret_cast<const float2*>(sE + 8 * nt + 2 * t);
                s[nt][0] *= e.x;
                s[nt][1] *= e.y;
                s[nt][2] *= e.x;
                s[nt][3] *= e.y;
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int np = 0; np < DK / 16; ++np) {
                    unsigned bk[4];
                    g2f_ldsm4(bk, sKt + (16 * np + 8 * (mi >> 1) + r) * L::LT + 16 * kk + 8 * (mi & 1));
                    g2f_mma(s[2 * np], da[kk], bk[0], bk[1]);
                    g2f_mma(s[2 * np + 1], da[kk], bk[2], bk[3]);
                }
        } else {
            g2f_bar_sync(2, NTH);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const uint4 v4 = xd[kk * 32];
                da[kk][0] = v4.x;
                da[kk][1] = v4.y;
                da[kk][2] = v4.z;
                da[kk][3] = v4.w;
            }
        }
        if (!HREC && (!SPLIT || !chain)) {
            // O^T = scale (P + D^T A^T): A lower triangular, only the 16 x 16 blocks on or below
            // the diagonal.
#pragma unroll
            for (int jp = 0; jp < 4; ++jp)
#pragma unroll
                for (int kk = 0; kk <= jp; ++kk) {
                    unsigned ba[4];
                    g2f_ldsm4(ba, sA + (16 * jp + 8 * (mi >> 1) + r) * L::LT + 16 * kk + 8 * (mi & 1));
                    g2f_mma(oacc[2 * jp], da[kk], ba[0], ba[1]);
                    g2f_mma(oacc[2 * jp + 1], da[kk], ba[2], ba[3]);
                }
            bf16_t* oc = o + t0 * vrow + (i64)hv * dv + col0 + wc0 + g;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) {
                    const int i = 8 * j + 2 * t + (cc & 1);
                    if (i < l) st(oc, (i64)i * vrow + 8 * (cc >> 1), scale * oacc[j][cc]);
                }
        }
    }
    if (!HREC && fin && chain) {
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                fin[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
}

// g2f_fwd8_d{DK}_w{NW}: two stages; g2f_fwd8s3_*: three (Dk 128 with 1 or 2 warps fit);
// g2f_fwd8x*: SPLIT (2 NW warps: NW chain + NW output; NW <= 4 for the registers).
#define G2F8_ENTRY(NAME, NS, DK, NW, SPLIT)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * NW * (1 + SPLIT), 1) NAME##_d##DK##_w##NW(              \
        const bf16_t* wm, const bf16_t* qg, const bf16_t* kt, const bf16_t* a, const float* u,                \
        const float* egl, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hv, int dv, float scale, \
        const float* h0, bf16_t* o, float* fin) {                                                             \
        g2f_fwd8<DK, NW, NS, (SPLIT != 0)>(wm, qg, kt, a, u, egl, seq_ch, ch_t0, ch_len, hv, dv, scale, h0, o, \
                                           fin);                                                              \
    }

G2F8_ENTRY(g2f_fwd8, 2, 64, 1, 0)
G2F8_ENTRY(g2f_fwd8, 2, 64, 2, 0)
G2F8_ENTRY(g2f_fwd8, 2, 64, 4, 0)
G2F8_ENTRY(g2f_fwd8, 2, 64, 8, 0)
G2F8_ENTRY(g2f_fwd8, 2, 128, 1, 0)
G2F8_ENTRY(g2f_fwd8, 2, 128, 2, 0)
G2F8_ENTRY(g2f_fwd8, 2, 128, 4, 0)
G2F8_ENTRY(g2f_fwd8, 2, 128, 8, 0)
G2F8_ENTRY(g2f_fwd8s3, 3, 128, 1, 0)
G2F8_ENTRY(g2f_fwd8s3, 3, 128, 2, 0)
G2F8_ENTRY(g2f_fwd8x, 2, 64, 1, 1)
G2F8_ENTRY(g2f_fwd8x, 2, 64, 2, 1)
G2F8_ENTRY(g2f_fwd8x, 2, 64, 4, 1)
G2F8_ENTRY(g2f_fwd8x, 2, 128, 1, 1)
G2F8_ENTRY(g2f_fwd8x, 2, 128, 2, 1)
G2F8_ENTRY(g2f_fwd8x, 2, 128, 4, 1)
G2F8_ENTRY(g2f_fwd8xs3, 3, 128, 1, 1)
G2F8_ENTRY(g2f_fwd8xs3, 3, 128, 2, 1)

// g2f_hrec8{,s3}_d{DK}_w{NW}: g2f_fwd8 with HREC (backward v5's recompute of h and D).
#define G2H8_ENTRY(NAME, NS, DK, NW)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) NAME##_d##DK##_w##NW(                            \
        const bf16_t* wm, const bf16_t* qg, const bf16_t* kt, const bf16_t* a, const float* u,                \
        const float* egl, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hv, int dv,             \
        const float* h0, bf16_t* h_ws, bf16_t* d_ws) {                                                        \
        g2f_fwd8<DK, NW, NS, false, true>(wm, qg, kt, a, u, egl, seq_ch, ch_t0, ch_len, hv, dv, 1.f, h0,      \
                                          nullptr, nullptr, h_ws, d_ws);                                      \
    }

G2H8_ENTRY(g2f_hrec8, 2, 64, 1)
G2H8_ENTRY(g2f_hrec8, 2, 64, 2)
G2H8_ENTRY(g2f_hrec8, 2, 64, 4)
G2H8_ENTRY(g2f_hrec8, 2, 64, 8)
G2H8_ENTRY(g2f_hrec8, 2, 128, 1)
G2H8_ENTRY(g2f_hrec8, 2, 128, 2)
G2H8_ENTRY(g2f_hrec8, 2, 128, 4)
G2H8_ENTRY(g2f_hrec8, 2, 128, 8)
G2H8_ENTRY(g2f_hrec8s3, 3, 128, 1)
G2H8_ENTRY(g2f_hrec8s3, 3, 128, 2)
#endif  // G2B_TC_MODULE

// Issues the cp.async copies of chunk `cj`'s scan operands into B: Wm [64][dk], Kd^T [dk][64],
// the U tile [64][BV] (columns tile * BV ..), eg_63 [dk]; one commit group.
template <int BV>
__device__ __forceinline__ void g2c_fetch(float* B, i64 cj, int tile, int dk, int dv, const float* __restrict__ ws_u,
                                          const float* __restrict__ ws_wm, const float* __restrict__ ws_kd,
                                          const float* __restrict__ ws_egl) {
    const int tid = threadIdx.x;
    const float* wm = ws_wm + cj * G2C_C * (i64)dk;
    const float* kd = ws_kd + cj * G2C_C * (i64)dk;
    const int n4 = G2C_C * dk / 4;
    for (int e = tid; e < n4; e += G2C_NT) {
        g2c_cp16(B + 4 * e, wm + 4 * e);
        g2c_cp16(B + G2C_C * dk + 4 * e, kd + 4 * e);
    }
    const float* u = ws_u + cj * G2C_C * (i64)dv + tile * BV;
    for (int e = tid; e < G2C_C * BV / 4; e += G2C_NT) {
        const int r = e / (BV / 4), q4 = e - r * (BV / 4);
        g2c_cp16(B + 2 * G2C_C * dk + r * BV + 4 * q4, u + (i64)r * dv + 4 * q4);
    }
    for (int e = tid; e < dk / 4; e += G2C_NT)
        g2c_cp16(B + 2 * G2C_C * dk + G2C_C * BV + 4 * e, ws_egl + cj * dk + 4 * e);
    g2c_commit();
}

// Sequential scan over the chunks of one (sequence, value head, V tile of BV columns).
template <int BV>
__device__ void g2c_scan(const float* __restrict__ ws_u, const float* __restrict__ ws_wm,
                         const float* __restrict__ ws_kd, const float* __restrict__ ws_egl,
                         const i64* __restrict__ chf, int hv_n, int dk, int dv, const float* __restrict__ h0,
                         float* __restrict__ ws_h, float* __restrict__ ws_d, float* __restrict__ fin) {
    extern __shared__ __align__(16) float g2c_sm[];
    constexpr int RS = G2C_NT / BV;  // row groups
    const int tid = threadIdx.x;
    const int ntile = dv / BV;
    const int tile = blockIdx.x % ntile;
    const int j = (blockIdx.x / ntile) % hv_n;
    const i64 n = blockIdx.x / ntile / hv_n;
    const int col = tid % BV, r0 = tid / BV;
    const int y = tile * BV + col;  // this thread's state column
    const int buf = 2 * G2C_C * dk + G2C_C * BV + dk;  // one chunk's operands
    float* sS = g2c_sm + 2 * buf;                        // [dk][BV]
    float* sD = sS + dk * BV;                            // [64][BV]
    const i64 sbase = (n * hv_n + j) * (i64)dk * dv;
    for (int x = r0; x < dk; x += RS) sS[x * BV + col] = h0 ? h0[sbase + (i64)x * dv + y] : 0.f;
    const i64 c0 = chf[n], nch = chf[n + 1] - c0;
    if (nch > 0) g2c_fetch<BV>(g2c_sm, c0 * hv_n + j, tile, dk, dv, ws_u, ws_wm, ws_kd, ws_egl);
    for (i64 ci = 0; ci < nch; ++ci) {
        if (ci + 1 < nch) {
            g2c_fetch<BV>(g2c_sm + ((ci + 1) & 1) * buf, (c0 + ci + 1) * hv_n + j, tile, dk, dv, ws_u, ws_wm, ws_kd,
                          ws_egl);
            g2c_wait<1>();
        } else {
            g2c_wait<0>();
        }
        __syncthreads();
        const float* B = g2c_sm + (ci & 1) * buf;
        const float* sW = B;
        const float* sKd = B + G2C_C * dk;  // Kd^T [dk][64]
        const float* sU = B + 2 * G2C_C * dk;
        const float* sE = sU + G2C_C * BV;
        const i64 cj = (c0 + ci) * hv_n + j;
        // D = U - Wm S.
        {
            float acc[G2C_C / RS];
#pragma unroll
            for (int m = 0; m < G2C_C / RS; ++m) acc[m] = 0.f;
            for (int x = 0; x < dk; ++x) {
                const float s = sS[x * BV + col];
#pragma unroll
                for (int m = 0; m < G2C_C / RS; ++m) acc[m] += sW[(r0 + m * RS) * dk + x] * s;
            }
            float* dg = ws_d + cj * G2C_C * (i64)dv + y;
#pragma unroll
            for (int m = 0; m < G2C_C / RS; ++m) {
                const int r = r0 + m * RS;
                const float d = sU[r * BV + col] - acc[m];
                sD[r * BV + col] = d;
                dg[(i64)r * dv] = d;
            }
        }
        __syncthreads();
        // h[c] = S; S = eg_63 * S + Kd^T D.
        {
            float* hg = ws_h + cj * (i64)dk * dv + y;
            for (int x = r0; x < dk; x += RS) {
                const float s = sS[x * BV + col];
                hg[(i64)x * dv] = s;
                float acc = sE[x] * s;
                for (int i = 0; i < G2C_C; ++i) acc += sKd[x * G2C_C + i] * sD[i * BV + col];
                sS[x * BV + col] = acc;
            }
        }
        __syncthreads();
    }
    if (fin) {
        for (int x = r0; x < dk; x += RS) fin[sbase + (i64)x * dv + y] = sS[x * BV + col];
    }
}

// Shared memory of g2c_scan (floats): 2 (2 * 64 dk + 64 BV + dk) + dk BV + 64 BV.

// Scan with 32 state columns per block, register-blocked (Dv a multiple of 32): lane = state
// column; shared operands read as float4 (Wm and Kd^T rows broadcast to the warp, the state and
// D transposed per column). D = U - Wm S: warp w computes rows 16 (w & 3) .. + 15 over half of
// the channels (w >> 2), the two halves summed in a fixed order; S = eg_63 * S + Kd^T D: warp w
// updates channels w * dk/8 .. + dk/8.
__device__ void g2c_scan_f(const float* __restrict__ ws_u, const float* __restrict__ ws_wm,
                           const float* __restrict__ ws_kdt, const float* __restrict__ ws_egl,
                           const i64* __restrict__ chf, int hv_n, int dk, int dv, const float* __restrict__ h0,
                           float* __restrict__ ws_h, float* __restrict__ ws_d, float* __restrict__ fin) {
    extern __shared__ __align__(16) float g2c_sm[];
    constexpr int BV = 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ntile = dv / BV;
    const int tile = blockIdx.x % ntile;
    const int j = (blockIdx.x / ntile) % hv_n;
    const i64 n = blockIdx.x / ntile / hv_n;
    const int y = tile * BV + lane;
    const int LS = dk + 4;          // row stride of the transposed state
    const int LD = G2C_C + 4;       // row stride of the transposed D
    const int buf = 2 * G2C_C * dk + G2C_C * BV + dk;
    float* sSt = g2c_sm + 2 * buf;  // [BV][LS]: S transposed
    float* sDt = sSt + BV * LS;     // [BV][LD]: D transposed
    float* sP = sDt + BV * LD;      // [64][BV]: second half of Wm S
    const int xr = dk >> 3;         // channels per warp in the update
    const i64 sbase = (n * hv_n + j) * (i64)dk * dv;
    for (int x = warp; x < dk; x += 8) sSt[lane * LS + x] = h0 ? h0[sbase + (i64)x * dv + y] : 0.f;
    const i64 c0 = chf[n], nch = chf[n + 1] - c0;
    if (nch > 0) g2c_fetch<BV>(g2c_sm, c0 * hv_n + j, tile, dk, dv, ws_u, ws_wm, ws_kdt, ws_egl);
    for (i64 ci = 0; ci < nch; ++ci) {
        if (ci + 1 < nch) {
            g2c_fetch<BV>(g2c_sm + ((ci + 1) & 1) * buf, (c0 + ci + 1) * hv_n + j, tile, dk, dv, ws_u, ws_wm, ws_kdt,
                          ws_egl);
            g2c_wait<1>();
        } else {
            g2c_wait<0>();
        }
        __syncthreads();
        const float* B = g2c_sm + (ci & 1) * buf;
        const float* sW = B;                    // [64][dk]
        const float* sKt = B + G2C_C * dk;      // [dk][64]
        const float* sU = B + 2 * G2C_C * dk;   // [64][BV]
        const float* sE = sU + G2C_C * BV;      // [dk]
        const i64 cj = (c0 + ci) * hv_n + j;
        // D = U - Wm S.
        {
            const int rb = warp & 3, half = warp >> 2;
            const int xa = half * (dk >> 1), xb = xa + (dk >> 1);
            float acc[16];
#pragma unroll
            for (int m = 0; m < 16; ++m) acc[m] = 0.f;
            for (int x = xa; x < xb; x += 4) {
                const float4 s4 = *reinterpret_cast<const float4*>(sSt + lane * LS + x);
#pragma unroll
                for (int m = 0; m < 16; ++m) {
                    const float4 w4 = *reinterpret_cast<const float4*>(sW + (16 * rb + m) * dk + x);
                    acc[m] += w4.x * s4.x;
                    acc[m] += w4.y * s4.y;
                    acc[m] += w4.z * s4.z;
                    acc[m] += w4.w * s4.w;
                }
            }
            if (half == 1) {
#pragma unroll
                for (int m = 0; m < 16; ++m) sP[(16 * rb + m) * BV + lane] = acc[m];
            }
            __syncthreads();
            if (half == 0) {
                float* dg = ws_d + cj * G2C_C * (i64)dv + y;
#pragma unroll
                for (int m = 0; m < 16; ++m) {
                    const int r = 16 * rb + m;
                    const float d = sU[r * BV + lane] - (acc[m] + sP[r * BV + lane]);
                    sDt[lane * LD + r] = d;
                    dg[(i64)r * dv] = d;
                }
            }
        }
        __syncthreads();
        // h[c] = S; S = eg_63 * S + Kd^T D.
        {
            const int xa = warp * xr;
            float acc[16];
            float* hg = ws_h + cj * (i64)dk * dv + y;
#pragma unroll
            for (int m = 0; m < 16; ++m) {
                acc[m] = 0.f;
                if (m < xr) {
                    const float s = sSt[lane * LS + xa + m];
                    hg[(i64)(xa + m) * dv] = s;
                    acc[m] = sE[xa + m] * s;
                }
            }
            for (int i = 0; i < G2C_C; i += 4) {
                const float4 d4 = *reinterpret_cast<const float4*>(sDt + lane * LD + i);
#pragma unroll
                for (int m = 0; m < 16; ++m) {
                    if (m < xr) {
                        const float4 k4 = *reinterpret_cast<const float4*>(sKt + (xa + m) * G2C_C + i);
                        acc[m] += k4.x * d4.x;
                        acc[m] += k4.y * d4.y;
                        acc[m] += k4.z * d4.z;
                        acc[m] += k4.w * d4.w;
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < 16; ++m)
                if (m < xr) sSt[lane * LS + xa + m] = acc[m];
        }
        __syncthreads();
    }
    if (fin) {
        for (int x = warp; x < dk; x += 8) fin[sbase + (i64)x * dv + y] = sSt[lane * LS + x];
    }
}

// O = scale (Qg h[c] + A D) for one (chunk, value head, 64 columns). Warp w computes rows
// 16 (w & 3) .. + 15 of columns 32 (w >> 2) + lane; Qg and A rows are read as float4 broadcasts,
// h and D transposed per column (float4 along the reduction).
template <typename T>
__device__ void g2c_out(const float* __restrict__ ws_qg, const float* __restrict__ ws_a,
                        const float* __restrict__ ws_h, const float* __restrict__ ws_d,
                        const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hv_n, int dk, int dv,
                        float scale, T* __restrict__ o) {
    extern __shared__ __align__(16) float g2c_sm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ntile = (dv + 63) / 64;
    const int tile = blockIdx.x % ntile;
    const i64 cj = blockIdx.x / ntile;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int y0 = tile * 64;
    const int nc = min(64, dv - y0);
    const int LH = dk + 4, LD = G2C_C + 4;
    float* sQg = g2c_sm;              // [64][dk]
    float* sA = sQg + G2C_C * dk;     // [64][64]
    float* sHt = sA + G2C_C * G2C_C;  // [64 columns][LH]: h transposed
    float* sDt = sHt + 64 * LH;       // [64 columns][LD]: D transposed
    const float* qg = ws_qg + cj * G2C_C * (i64)dk;
    const float* a = ws_a + cj * G2C_C * G2C_C;
    for (int e = tid; e < G2C_C * dk / 4; e += G2C_NT)
        reinterpret_cast<float4*>(sQg)[e] = reinterpret_cast<const float4*>(qg)[e];
    for (int e = tid; e < G2C_C * G2C_C / 4; e += G2C_NT)
        reinterpret_cast<float4*>(sA)[e] = reinterpret_cast<const float4*>(a)[e];
    const float* h = ws_h + cj * (i64)dk * dv + y0;
    const float* d = ws_d + cj * G2C_C * (i64)dv + y0;
    for (int e = tid; e < dk * 64; e += G2C_NT) {
        const int x = e >> 6, cc = e & 63;
        sHt[cc * LH + x] = cc < nc ? h[(i64)x * dv + cc] : 0.f;
    }
    for (int e = tid; e < G2C_C * 64; e += G2C_NT) {
        const int r = e >> 6, cc = e & 63;
        sDt[cc * LD + r] = cc < nc ? d[(i64)r * dv + cc] : 0.f;
    }
    __syncthreads();
    const int r0 = 16 * (warp & 3), col = 32 * (warp >> 2) + lane;
    float acc[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) acc[m] = 0.f;
    for (int x = 0; x < dk; x += 4) {
        const float4 h4 = *reinterpret_cast<const float4*>(sHt + col * LH + x);
#pragma unroll
        for (int m = 0; m < 16; ++m) {
            const float4 q4 = *reinterpret_cast<const float4*>(sQg + (r0 + m) * dk + x);
            acc[m] += q4.x * h4.x;
            acc[m] += q4.y * h4.y;
            acc[m] += q4.z * h4.z;
            acc[m] += q4.w * h4.w;
        }
    }
    for (int jj = 0; jj < G2C_C; jj += 4) {
        const float4 d4 = *reinterpret_cast<const float4*>(sDt + col * LD + jj);
#pragma unroll
        for (int m = 0; m < 16; ++m) {
            const float4 a4 = *reinterpret_cast<const float4*>(sA + (r0 + m) * G2C_C + jj);
            acc[m] += a4.x * d4.x;
            acc[m] += a4.y * d4.y;
            acc[m] += a4.z * d4.z;
            acc[m] += a4.w * d4.w;
        }
    }
    if (col < nc) {
#pragma unroll
        for (int m = 0; m < 16; ++m) {
            const int r = r0 + m;
            if (r < l) st(o, ((t0 + r) * hv_n + j) * (i64)dv + y0 + col, scale * acc[m]);
        }
    }
}

// Shared memory of g2c_out (floats): 64 dk + 64 * 64 + 64 (dk + 4) + 64 * 68.

#define G2C_ENTRIES(TQ, T, S)                                                                                 \
    extern "C" __global__ void __launch_bounds__(G2_NT)                                                       \
        g2c_prep_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,            \
                     const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float* ws_u,        \
                     float* ws_wm, float* ws_qg, float* ws_kd, float* ws_a, float* ws_egl, float* ws_t) {     \
        g2c_prep<TQ, T>(q, k, v, g, b, w, ch_t0, ch_len, hk, hv, dk, dv, ws_u, ws_wm, ws_qg, ws_kd, ws_a,     \
                        ws_egl, ws_t);                                                                        \
    }

G2C_ENTRIES(float, float, f32)
G2C_ENTRIES(bf16_t, bf16_t, bf16)
G2C_ENTRIES(float, bf16_t, bf16n)

extern "C" __global__ void __launch_bounds__(G2_NT)
    g2c_scan16(const float* ws_u, const float* ws_wm, const float* ws_kd, const float* ws_egl, const i64* chf,
               int hv, int dk, int dv, const float* h0, float* ws_h, float* ws_d, float* fin) {
    g2c_scan<16>(ws_u, ws_wm, ws_kd, ws_egl, chf, hv, dk, dv, h0, ws_h, ws_d, fin);
}

extern "C" __global__ void __launch_bounds__(G2_NT, 1)
    g2c_scan32(const float* ws_u, const float* ws_wm, const float* ws_kd, const float* ws_egl, const i64* chf,
               int hv, int dk, int dv, const float* h0, float* ws_h, float* ws_d, float* fin) {
    g2c_scan_f(ws_u, ws_wm, ws_kd, ws_egl, chf, hv, dk, dv, h0, ws_h, ws_d, fin);
}

extern "C" __global__ void __launch_bounds__(G2_NT)
    g2c_out_f32(const float* ws_qg, const float* ws_a, const float* ws_h, const float* ws_d, const i64* ch_t0,
                const int* ch_len, int hv, int dk, int dv, float scale, float* o) {
    g2c_out<float>(ws_qg, ws_a, ws_h, ws_d, ch_t0, ch_len, hv, dk, dv, scale, o);
}

extern "C" __global__ void __launch_bounds__(G2_NT)
    g2c_out_bf16(const float* ws_qg, const float* ws_a, const float* ws_h, const float* ws_d, const i64* ch_t0,
                 const int* ch_len, int hv, int dk, int dv, float scale, bf16_t* o) {
    g2c_out<bf16_t>(ws_qg, ws_a, ws_h, ws_d, ch_t0, ch_len, hv, dk, dv, scale, o);
}

// =============================================================================================
// Chunked backward (issue 17; the default, GDN_RULE2_BWD=recurrent selects the recurrence). The derivation is cpu.rs's
// chunk_backward; every product is fp32 (FMAs, fixed orders), no atomics, bitwise reproducible.
// Dk, Dv <= 128 like the chunked forward.
//
// Recompute: g2c_prep (U, Wm, Qg, Kd^T, A, eg_63 and, for the backward, T = (I + M)^-1) and
// g2c_scan (chunk-start states h[c] = S0 and D = U - Wm S0). Then, per chunk with end-state
// gradient dS1 (l valid rows; the padding rows of every operand are zero):
//
//   g2b_dscan  per (sequence, value head, V tile of BV = 32 or 16 columns), chunks in reverse with
//              dS [Dk, BV] in shared memory: stores dh[c] = dS1, then
//                dD  = Kd dS1 + A^T (scale dO)                        (stored, [64, Dv])
//                dS0 = Diag(eg_63) dS1 + Qg^T (scale dO) - Wm^T dD    (carried; dh0 at the end)
//   g2b_grad   per (chunk, value head), from S0, dS1, D, dD, T and the inputs:
//                dKd = D dS1^T, dQg = scale dO S0^T, dWm = -dD S0^T    ([64, Dk], global scratch)
//                dA = scale dO D^T, dT = dD Wv^T + dWm Kbg^T            ([64, 64], shared)
//                dWv = T^T dD -> dw = dWv * v, dv = dWv * w
//                dKbg = T^T dWm, dM = -T^T dT T^T
//              then per element (i, c) the Gram gradients at fixed decay, directly with
//              E_ijc = e^(Gam_ic - Gam_jc) (exponent <= 0 for j <= i: no sub-chunk split needed):
//                dQa_ic  = sum_{j<i} dA_ij E_ijc K_jc      dKbm_ic = sum_{j<i} dM_ij E_ijc K_jc
//                dKg_ic  = sum_{r>i} E_ric (dA_ri Q_rc + dM_ri Kb_rc)
//              (the diagonal terms j = i, E = 1, add dA_ii K_i to dq and dA_ii Q_i to dk and
//              cancel in dGam), and with eg = e^Gam, ed = e^(Gam_63 - Gam):
//                dq   = eg dQg + dQa + dA_ii K             dKb = eg dKbg + dKbm,  db = dKb K
//                dk   = ed dKd + dKg + dA_ii Q + dKb B
//                dGam = dQg Qg + dKbg Kbg + Q dQa + Kb dKbm - K dKg - dKd Kd
//                       (+ eg_63 <S0_c, dS1_c> + sum_i dKd_ic Kd_ic on the last valid row)
//                dg   = reverse cumulative sum of dGam over the chunk's rows, per channel
//              dq, dk per value head (fp32); gated_delta_rule's gdr_reduce_qk sums the GVA group
//              in head order and applies the l2 norm's backward.
// The products run as 64 x 64 output tiles (g2b_tile: 16x16 threads, 4x4 elements each, operands
// staged through shared memory in 32-deep slices), fp32 FMAs; opt-in (GDN_RULE2_GRAD=tc, bf16
// storage) g2b_grad_tc_* runs them on TF32 tensor cores (g2b_tile_tc), the rest unchanged; those
// kernels live in the module gdn2_rule_tc (this file with G2B_TC_MODULE defined).

// Shared memory of g2b_dscan (floats): 3 * 64 dk + 64 * 64 + dk + 2 * 64 BV + dk BV.
template <int BV, typename T>
__device__ void g2b_dscan(const float* __restrict__ ws_kd, const float* __restrict__ ws_a,
                          const float* __restrict__ ws_qg, const float* __restrict__ ws_wm,
                          const float* __restrict__ ws_egl, const T* __restrict__ d_o, const i64* __restrict__ chf,
                          const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hv_n, int dk, int dv,
                          float scale, const float* __restrict__ dht, float* __restrict__ ws_dh,
                          float* __restrict__ ws_dd, float* __restrict__ dh0) {
    extern __shared__ __align__(16) float g2c_sm[];
    constexpr int RS = G2C_NT / BV;        // row groups
    constexpr int NX = G2C_MAXD / RS;      // state rows per thread, at most
    constexpr int NR = G2C_C / RS;         // dD rows per thread
    const int tid = threadIdx.x, col = tid % BV, r0 = tid / BV;
    const int ntile = dv / BV;
    const int tile = blockIdx.x % ntile;
    const int j = (blockIdx.x / ntile) % hv_n;
    const i64 n = blockIdx.x / ntile / hv_n;
    const int y = tile * BV + col;
    const int nx = dk / RS;
    float* sKt = g2c_sm;                 // Kd^T [dk][64]
    float* sQg = sKt + G2C_C * dk;       // [64][dk]
    float* sW = sQg + G2C_C * dk;        // Wm [64][dk]
    float* sA = sW + G2C_C * dk;         // [64][64]
    float* sE = sA + G2C_C * G2C_C;      // eg_63 [dk]
    float* sO = sE + dk;                 // scale dO [64][BV]
    float* sDD = sO + G2C_C * BV;        // dD [64][BV]
    float* sS = sDD + G2C_C * BV;        // dS [dk][BV]
    const i64 sn = (i64)dk * dv;
    const i64 sbase = (n * hv_n + j) * sn;
    for (int x = r0; x < dk; x += RS) sS[x * BV + col] = dht ? dht[sbase + (i64)x * dv + y] : 0.f;
    const i64 c0 = chf[n], nch = chf[n + 1] - c0;
    for (i64 ci = nch - 1; ci >= 0; --ci) {
        const i64 c = c0 + ci;
        const i64 cj = c * hv_n + j;
        const i64 t0 = ch_t0[c];
        const int l = ch_len[c];
        __syncthreads();  // the previous chunk's reads of the operands and writes of sS are done
        {
            const float4* kd4 = reinterpret_cast<const float4*>(ws_kd + cj * G2C_C * (i64)dk);
            const float4* qg4 = reinterpret_cast<const float4*>(ws_qg + cj * G2C_C * (i64)dk);
            const float4* wm4 = reinterpret_cast<const float4*>(ws_wm + cj * G2C_C * (i64)dk);
            const float4* a4 = reinterpret_cast<const float4*>(ws_a + cj * G2C_C * G2C_C);
            for (int e = tid; e < G2C_C * dk / 4; e += G2C_NT) {
                reinterpret_cast<float4*>(sKt)[e] = kd4[e];
                reinterpret_cast<float4*>(sQg)[e] = qg4[e];
                reinterpret_cast<float4*>(sW)[e] = wm4[e];
            }
            for (int e = tid; e < G2C_C * G2C_C / 4; e += G2C_NT) reinterpret_cast<float4*>(sA)[e] = a4[e];
            for (int e = tid; e < dk; e += G2C_NT) sE[e] = ws_egl[cj * dk + e];
            for (int e = tid; e < G2C_C * BV; e += G2C_NT) {
                const int r = e / BV, cc = e - r * BV;
                sO[e] = r < l ? scale * ld(d_o, ((t0 + r) * hv_n + j) * (i64)dv + tile * BV + cc) : 0.f;
            }
            // dh[c] = dS1 (this thread's own elements of sS).
            float* dh = ws_dh + cj * sn + y;
            for (int x = r0; x < dk; x += RS) dh[(i64)x * dv] = sS[x * BV + col];
        }
        __syncthreads();
        // dD = Kd dS1 + A^T (scale dO): rows r0 + RS m.
        {
            float acc[NR];
#pragma unroll
            for (int m = 0; m < NR; ++m) acc[m] = 0.f;
            for (int x = 0; x < dk; ++x) {
                const float s = sS[x * BV + col];
#pragma unroll
                for (int m = 0; m < NR; ++m) acc[m] += sKt[x * G2C_C + r0 + RS * m] * s;
            }
            for (int r = 0; r < G2C_C; ++r) {
                const float o = sO[r * BV + col];
#pragma unroll
                for (int m = 0; m < NR; ++m) acc[m] += sA[r * G2C_C + r0 + RS * m] * o;
            }
            float* dd = ws_dd + cj * G2C_C * (i64)dv + y;
#pragma unroll
            for (int m = 0; m < NR; ++m) {
                const int i = r0 + RS * m;
                sDD[i * BV + col] = acc[m];
                dd[(i64)i * dv] = acc[m];
            }
        }
        __syncthreads();
        // dS0 = eg_63 dS1 + Qg^T (scale dO) - Wm^T dD: rows r0 + RS m.
        float acc[NX];
#pragma unroll
        for (int m = 0; m < NX; ++m) {
            const int x = r0 + RS * m;
            acc[m] = m < nx ? sE[x] * sS[x * BV + col] : 0.f;
        }
        for (int i = 0; i < G2C_C; ++i) {
            const float o = sO[i * BV + col], d = sDD[i * BV + col];
#pragma unroll
            for (int m = 0; m < NX; ++m) {
                if (m < nx) {
                    const int x = r0 + RS * m;
                    acc[m] += sQg[i * dk + x] * o;
                    acc[m] -= sW[i * dk + x] * d;
                }
            }
        }
        __syncthreads();  // every read of sS is done
#pragma unroll
        for (int m = 0; m < NX; ++m)
            if (m < nx) sS[(r0 + RS * m) * BV + col] = acc[m];
    }
    if (dh0) {
        // This thread's own elements of sS (written by it above, or loaded at the start).
        for (int x = r0; x < dk; x += RS) dh0[sbase + (i64)x * dv + y] = sS[x * BV + col];
    }
}

#define G2B_KT 32
#define G2B_LD 65
#define G2B_STAGE (2 * G2B_KT * G2B_LD)
#define G2B_LM 65

// acc (64 x 64 tile, thread (ty, tx) = (tid / 16, tid % 16) holds element (ty + 16 m, tx + 16 n)
// in acc[m][n]) += sum_{k < kdim} fa(i, k) fb(k, j). AKF / BKF: whether k is the operand's
// fastest-varying index in memory (which staging order coalesces). The operands are staged in
// `stage` (G2B_STAGE floats) 32 k at a time, the next slice's loads issued into registers before
// the current slice's FMAs; ends with a barrier (the stage is free again, and an epilogue may then
// overwrite the operands).
template <bool AKF, bool BKF, class FA, class FB>
__device__ __forceinline__ void g2b_tile(float (&acc)[4][4], int kdim, FA fa, FB fb, float* stage) {
    constexpr int NL = (G2B_KT * G2C_C) / G2C_NT;  // elements of each operand a thread stages
    const int tid = threadIdx.x;
    float* sa = stage;
    float* sb = stage + G2B_KT * G2B_LD;
    const int tx = tid & 15, ty = tid >> 4;
    float ra[NL], rb[NL];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int r = 0; r < NL; ++r) {
            const int e = tid + r * G2C_NT;
            const int i = AKF ? e / G2B_KT : (e & 63), k = AKF ? e % G2B_KT : (e >> 6);
            ra[r] = (k0 + k < kdim) ? fa(i, k0 + k) : 0.f;
            const int jj = BKF ? e / G2B_KT : (e & 63), kb = BKF ? e % G2B_KT : (e >> 6);
            rb[r] = (k0 + kb < kdim) ? fb(k0 + kb, jj) : 0.f;
        }
    };
    fetch(0);
    for (int k0 = 0; k0 < kdim; k0 += G2B_KT) {
#pragma unroll
        for (int r = 0; r < NL; ++r) {
            const int e = tid + r * G2C_NT;
            const int i = AKF ? e / G2B_KT : (e & 63), k = AKF ? e % G2B_KT : (e >> 6);
            sa[k * G2B_LD + i] = ra[r];
            const int jj = BKF ? e / G2B_KT : (e & 63), kb = BKF ? e % G2B_KT : (e >> 6);
            sb[kb * G2B_LD + jj] = rb[r];
        }
        __syncthreads();
        if (k0 + G2B_KT < kdim) fetch(k0 + G2B_KT);
#pragma unroll 8
        for (int k = 0; k < G2B_KT; ++k) {
            float a[4], b[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) a[m] = sa[k * G2B_LD + ty + 16 * m];
#pragma unroll
            for (int nn = 0; nn < 4; ++nn) b[nn] = sb[k * G2B_LD + tx + 16 * nn];
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int nn = 0; nn < 4; ++nn) acc[m][nn] = fmaf(a[m], b[nn], acc[m][nn]);
        }
        __syncthreads();
    }
}

// out[64][nc] = sum_{k < kdim} fa(i, k) fb(k, j), delivered as fe(i, j, value), in column tiles of
// 64; ends with a barrier (the outputs are visible to the block). An output may overwrite an
// operand only when nc <= 64 (one tile: every operand read precedes the epilogue).
template <bool AKF, bool BKF, class FA, class FB, class FE>
__device__ __forceinline__ void g2b_mm(int nc, int kdim, FA fa, FB fb, FE fe, float* stage) {
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    for (int n0 = 0; n0 < nc; n0 += 64) {
        float acc[4][4];
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int nn = 0; nn < 4; ++nn) acc[m][nn] = 0.f;
        g2b_tile<AKF, BKF>(
            acc, kdim, fa, [&](int k, int jj) { return n0 + jj < nc ? fb(k, n0 + jj) : 0.f; }, stage);
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int nn = 0; nn < 4; ++nn) {
                const int jj = n0 + tx + 16 * nn;
                if (jj < nc) fe(ty + 16 * m, jj, acc[m][nn]);
            }
    }
    __syncthreads();
}

// g2b_grad's products: G2bMm<false>::run is g2b_mm; G2bMm<true>::run (module gdn2_rule_tc only,
// see G2B_TC_MODULE) is g2b_mm_tc, the tensor-core twin.
template <bool TC>
struct G2bMm {
    template <bool AKF, bool BKF, class FA, class FB, class FE>
    __device__ static __forceinline__ void run(int nc, int kdim, FA fa, FB fb, FE fe, float* stage) {
        g2b_mm<AKF, BKF>(nc, kdim, fa, fb, fe, stage);
    }
};

#ifdef G2B_TC_MODULE
// Only in the module gdn2_rule_tc (this file compiled with G2B_TC_MODULE defined and
// ops/common/mma_tf32.cuh prepended, backend/kernels.rs), so the default module gdn2_rule is
// compiled from exactly the code it had before (its PTX unchanged).
//
// The tensor-core twin of g2b_tile (g2b_grad_tc_*, bf16 storage, GDN_RULE2_GRAD=tc): the same
// contract with TF32 mma.sync m16n8k8 (operands rounded to TF32 when staged, fp32 accumulation)
// and the accumulators in mma layout: warp w owns rows 16 (w & 3) .. +16 and columns
// 32 (w >> 2) .. +32 (four 16x8 tiles), acc[nt][e] is C-fragment element e of tile nt, i.e.
// element (16 (w & 3) + g + 8 (e >> 1), 32 (w >> 2) + 8 nt + 2 t + (e & 1)), g = lane / 4,
// t = lane % 4. Staging (G2B_STAGE_TC floats): A row-major [64][KT + 4]; B
// [64 cols][KT + 4] when k is its fastest index, else [KT][64 + 8] (the GDN rule's tile_mma
// layouts: conflict-free fragment reads). Same register prefetch of the next slice as g2b_tile.
#define G2B_LA (G2B_KT + 4)
#define G2B_LBK (G2C_C + 8)
#define G2B_STAGE_TC (2 * G2C_C * G2B_LA)
template <bool AKF, bool BKF, class FA, class FB>
__device__ __forceinline__ void g2b_tile_tc(float (&acc)[4][4], int kdim, FA fa, FB fb, float* stage) {
    constexpr int NL = (G2B_KT * G2C_C) / G2C_NT;
    const int tid = threadIdx.x;
    float* sa = stage;
    float* sb = stage + G2C_C * G2B_LA;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3), c0 = 32 * (warp >> 2);
    float ra[NL], rb[NL];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int r = 0; r < NL; ++r) {
            const int e = tid + r * G2C_NT;
            const int i = AKF ? e / G2B_KT : (e & 63), k = AKF ? e % G2B_KT : (e >> 6);
            ra[r] = (k0 + k < kdim) ? fa(i, k0 + k) : 0.f;
            const int jj = BKF ? e / G2B_KT : (e & 63), kb = BKF ? e % G2B_KT : (e >> 6);
            rb[r] = (k0 + kb < kdim) ? fb(k0 + kb, jj) : 0.f;
        }
    };
    fetch(0);
    for (int k0 = 0; k0 < kdim; k0 += G2B_KT) {
#pragma unroll
        for (int r = 0; r < NL; ++r) {
            const int e = tid + r * G2C_NT;
            const int i = AKF ? e / G2B_KT : (e & 63), k = AKF ? e % G2B_KT : (e >> 6);
            sa[i * G2B_LA + k] = to_tf32(ra[r]);
            const int jj = BKF ? e / G2B_KT : (e & 63), kb = BKF ? e % G2B_KT : (e >> 6);
            if (BKF)
                sb[jj * G2B_LA + kb] = to_tf32(rb[r]);
            else
                sb[kb * G2B_LBK + jj] = to_tf32(rb[r]);
        }
        __syncthreads();
        if (k0 + G2B_KT < kdim) fetch(k0 + G2B_KT);
#pragma unroll
        for (int kk = 0; kk < G2B_KT; kk += 8) {
            const float* pa = sa + (r0 + g) * G2B_LA + kk + t;
            const unsigned a0 = __float_as_uint(pa[0]), a1 = __float_as_uint(pa[8 * G2B_LA]);
            const unsigned a2 = __float_as_uint(pa[4]), a3 = __float_as_uint(pa[8 * G2B_LA + 4]);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int col = c0 + 8 * nt + g;
                unsigned b0, b1;
                if (BKF) {
                    b0 = __float_as_uint(sb[col * G2B_LA + kk + t]);
                    b1 = __float_as_uint(sb[col * G2B_LA + kk + t + 4]);
                } else {
                    b0 = __float_as_uint(sb[(kk + t) * G2B_LBK + col]);
                    b1 = __float_as_uint(sb[(kk + t + 4) * G2B_LBK + col]);
                }
                mma_tf32(acc[nt], a0, a1, a2, a3, b0, b1);
            }
        }
        __syncthreads();
    }
}

// g2b_mm with g2b_tile_tc (stage of G2B_STAGE_TC floats); the same contract.
template <bool AKF, bool BKF, class FA, class FB, class FE>
__device__ __forceinline__ void g2b_mm_tc(int nc, int kdim, FA fa, FB fb, FE fe, float* stage) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = 16 * (warp & 3) + (lane >> 2), c0 = 32 * (warp >> 2) + 2 * (lane & 3);
    for (int n0 = 0; n0 < nc; n0 += 64) {
        float acc[4][4];
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int nn = 0; nn < 4; ++nn) acc[m][nn] = 0.f;
        g2b_tile_tc<AKF, BKF>(
            acc, kdim, fa, [&](int k, int jj) { return n0 + jj < nc ? fb(k, n0 + jj) : 0.f; }, stage);
        // acc[nt][e]: row r0 + 8 (e >> 1), column c0 + 8 nt + (e & 1) of the tile.
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int jj = n0 + c0 + 8 * nt + (e & 1);
                if (jj < nc) fe(r0 + 8 * (e >> 1), jj, acc[nt][e]);
            }
    }
    __syncthreads();
}

template <>
struct G2bMm<true> {
    template <bool AKF, bool BKF, class FA, class FB, class FE>
    __device__ static __forceinline__ void run(int nc, int kdim, FA fa, FB fb, FE fe, float* stage) {
        g2b_mm_tc<AKF, BKF>(nc, kdim, fa, fb, fe, stage);
    }
};
#endif  // G2B_TC_MODULE

// Shared memory of g2b_grad (floats): 5 * 64 dk + 3 * 64 * 65 + 2 * 32 * 65 (G2B_STAGE), with TC
// 5 * 64 dk + 3 * 64 * 65 + 2 * 64 * 36 (G2B_STAGE_TC).
// Global scratch per (chunk, value head): 4 * 64 dk floats (dKd, dQg, dWm then dGam, dKbg).
template <bool TC, typename TQ, typename T>
__device__ void g2b_grad(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                         const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                         const T* __restrict__ d_o, const i64* __restrict__ ch_t0, const int* __restrict__ ch_len,
                         int hk_n, int hv_n, int dk, int dv, float scale, const float* __restrict__ ws_h,
                         const float* __restrict__ ws_d, const float* __restrict__ ws_dh,
                         const float* __restrict__ ws_dd, const float* __restrict__ ws_t, float* ws_g,
                         float* __restrict__ dq_s, float* __restrict__ dk_s, T* __restrict__ dv_out,
                         T* __restrict__ dw_out, float* __restrict__ dg_out, T* __restrict__ db_out) {
    extern __shared__ __align__(16) float g2c_sm[];
    const int tid = threadIdx.x;
    const i64 cj = blockIdx.x;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const int kh = j / (hv_n / hk_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int ck = G2C_C * dk;
    float* sQ = g2c_sm;                  // [64][dk] (rows >= l zero)
    float* sK = sQ + ck;                 // [64][dk]
    float* sKb = sK + ck;                // B * K [64][dk]
    float* sGh = sKb + ck;               // Gam hi [64][dk] (rows >= l repeat row l - 1)
    float* sGl = sGh + ck;               // Gam lo
    float* sT = sGl + ck;                // T [64][65]
    float* sDA = sT + G2C_C * G2B_LM;    // dA [64][65]
    float* sX = sDA + G2C_C * G2B_LM;    // dT, then T^T dT, then dM [64][65]
    float* stage = sX + G2C_C * G2B_LM;  // G2B_STAGE (G2B_STAGE_TC with TC)
    float* gKd = ws_g + cj * 4 * (i64)ck;  // dKd [64][dk]
    float* gQg = gKd + ck;                 // dQg
    float* gWm = gQg + ck;                 // dWm, then dGam
    float* gKbg = gWm + ck;                // dKbg
    const i64 sn = (i64)dk * dv;
    const float* S0 = ws_h + cj * sn;                  // [dk][dv]
    const float* dS1 = ws_dh + cj * sn;                // [dk][dv]
    const float* Dm = ws_d + cj * G2C_C * (i64)dv;     // [64][dv]
    const float* dDm = ws_dd + cj * G2C_C * (i64)dv;   // [64][dv]
    const i64 vrow = (t0 * hv_n + j) * (i64)dv;        // row 0 of v, w, dO
    const i64 vstride = (i64)hv_n * dv;

    // 0. Rows, Gam (the same f64 sums as g2c_prep), T.
    for (int idx = tid; idx < ck; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        float qv = 0.f, kv = 0.f, bv = 0.f;
        if (i < l) {
            const i64 t = t0 + i;
            const i64 kr = (t * hk_n + kh) * dk + x;
            qv = ld(q, kr);
            kv = ld(k, kr);
            bv = ld(b, (t * hv_n + j) * dk + x);
        }
        sQ[idx] = qv;
        sK[idx] = kv;
        sKb[idx] = bv * kv;
    }
    if (tid < dk) {
        double acc = 0.0;
        for (int i = 0; i < G2C_C; ++i) {
            if (i < l) acc += (double)g[((t0 + i) * hv_n + j) * dk + tid];
            const float hi = (float)acc;
            sGh[i * dk + tid] = hi;
            sGl[i * dk + tid] = (float)(acc - (double)hi);
        }
    }
    {
        const float* tg = ws_t + cj * G2C_C * G2C_C;
        for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) sT[(idx >> 6) * G2B_LM + (idx & 63)] = tg[idx];
    }
    __syncthreads();
    auto dO = [&](int i, int y) -> float { return i < l ? ld(d_o, vrow + i * vstride + y) : 0.f; };

    // 1. dKd = D dS1^T, dQg = scale dO S0^T, dWm = -dD S0^T ([64][dk], reductions over Dv).
    G2bMm<TC>::template run<true, true>(
        dk, dv, [&](int i, int y) { return Dm[(i64)i * dv + y]; },
        [&](int y, int x) { return dS1[(i64)x * dv + y]; }, [&](int i, int x, float a) { gKd[i * dk + x] = a; },
        stage);
    G2bMm<TC>::template run<true, true>(
        dk, dv, dO, [&](int y, int x) { return S0[(i64)x * dv + y]; },
        [&](int i, int x, float a) { gQg[i * dk + x] = scale * a; }, stage);
    G2bMm<TC>::template run<true, true>(
        dk, dv, [&](int i, int y) { return dDm[(i64)i * dv + y]; },
        [&](int y, int x) { return S0[(i64)x * dv + y]; }, [&](int i, int x, float a) { gWm[i * dk + x] = -a; },
        stage);
    // 2. dA = scale dO D^T, dT = dD Wv^T ([64][64]).
    G2bMm<TC>::template run<true, true>(
        G2C_C, dv, dO, [&](int y, int jj) { return Dm[(i64)jj * dv + y]; },
        [&](int i, int jj, float a) { sDA[i * G2B_LM + jj] = scale * a; }, stage);
    G2bMm<TC>::template run<true, true>(
        G2C_C, dv, [&](int i, int y) { return dDm[(i64)i * dv + y]; },
        [&](int y, int jj) {
            if (jj >= l) return 0.f;
            const i64 o = vrow + jj * vstride + y;
            return ld(w, o) * ld(v, o);
        },
        [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = a; }, stage);
    // 3. dWv = T^T dD: dw = dWv * v, dv = dWv * w (valid rows).
    G2bMm<TC>::template run<false, false>(
        dv, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; },
        [&](int r, int y) { return dDm[(i64)r * dv + y]; },
        [&](int i, int y, float a) {
            if (i < l) {
                const i64 o = vrow + i * vstride + y;
                st(dw_out, o, a * ld(v, o));
                st(dv_out, o, a * ld(w, o));
            }
        },
        stage);
    // 4. dT += dWm Kbg^T (Kbg = Kb e^Gam), dKbg = T^T dWm.
    G2bMm<TC>::template run<true, true>(
        G2C_C, dk, [&](int i, int x) { return gWm[i * dk + x]; },
        [&](int x, int jj) { return sKb[jj * dk + x] * expf(sGh[jj * dk + x] + sGl[jj * dk + x]); },
        [&](int i, int jj, float a) { sX[i * G2B_LM + jj] += a; }, stage);
    G2bMm<TC>::template run<false, false>(
        dk, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; }, [&](int r, int x) { return gWm[r * dk + x]; },
        [&](int i, int x, float a) { gKbg[i * dk + x] = a; }, stage);
    // 5. dM = -T^T dT T^T, in place in sX (one tile each: the epilogues follow every read).
    G2bMm<TC>::template run<false, false>(
        G2C_C, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; },
        [&](int r, int jj) { return sX[r * G2B_LM + jj]; }, [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = a; },
        stage);
    G2bMm<TC>::template run<true, true>(
        G2C_C, G2C_C, [&](int i, int r) { return sX[i * G2B_LM + r]; },
        [&](int r, int jj) { return sT[jj * G2B_LM + r]; }, [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = -a; },
        stage);

    // 6. Per element: the Gram gradients, dq, dk, db; dGam into gWm (each thread rewrites only
    //    its own elements of gWm, which nobody else reads in this step).
    for (int idx = tid; idx < ck; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        if (i >= l) {
            gWm[idx] = 0.f;
            continue;
        }
        const float ghi = sGh[idx], gli = sGl[idx];
        const float qi = sQ[idx], ki = sK[idx], kbi = sKb[idx];
        float dqa = 0.f, dkbm = 0.f;
        for (int jj = 0; jj < i; ++jj) {
            const int o = jj * dk + x;
            const float ek = expf((ghi - sGh[o]) + (gli - sGl[o])) * sK[o];
            dqa += sDA[i * G2B_LM + jj] * ek;
            dkbm += sX[i * G2B_LM + jj] * ek;
        }
        float dkg = 0.f;
        for (int r = i + 1; r < l; ++r) {
            const int o = r * dk + x;
            const float e = expf((sGh[o] - ghi) + (sGl[o] - gli));
            dkg += e * (sDA[r * G2B_LM + i] * sQ[o] + sX[r * G2B_LM + i] * sKb[o]);
        }
        const float eg = expf(ghi + gli);
        const float ed = expf((sGh[(G2C_C - 1) * dk + x] - ghi) + (sGl[(G2C_C - 1) * dk + x] - gli));
        const float dkd = gKd[idx], dqg = gQg[idx], dkbg = gKbg[idx];
        const float daii = sDA[i * G2B_LM + i];
        const float kd = ki * ed;
        gWm[idx] = dqg * (qi * eg) + dkbg * (kbi * eg) + qi * dqa + kbi * dkbm - ki * dkg - dkd * kd;
        const i64 orow = ((t0 + i) * hv_n + j) * (i64)dk + x;
        const float dkb = eg * dkbg + dkbm;
        dq_s[orow] = eg * dqg + dqa + daii * ki;
        dk_s[orow] = ed * dkd + dkg + daii * qi + dkb * ld(b, orow);
        st(db_out, orow, dkb * ki);
    }
    __syncthreads();
    // 7. dg: the last valid row's extra terms, then the reverse cumulative sum per channel.
    if (tid < dk) {
        const int x = tid;
        const float gh63 = sGh[(G2C_C - 1) * dk + x], gl63 = sGl[(G2C_C - 1) * dk + x];
        float ex = 0.f;
        for (int i = 0; i < l; ++i) {
            const int o = i * dk + x;
            const float ed = expf((gh63 - sGh[o]) + (gl63 - sGl[o]));
            ex += gKd[o] * (sK[o] * ed);
        }
        float sd = 0.f;
        for (int y = 0; y < dv; ++y) sd += S0[(i64)x * dv + y] * dS1[(i64)x * dv + y];
        float acc = expf(gh63 + gl63) * sd + ex;
        for (int i = l - 1; i >= 0; --i) {
            acc += gWm[i * dk + x];
            dg_out[((t0 + i) * hv_n + j) * (i64)dk + x] = acc;
        }
    }
}

#define G2B_DSCAN(BV, T, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 1)                                                   \
        g2b_dscan##BV##_##S(const float* ws_kd, const float* ws_a, const float* ws_qg, const float* ws_wm,    \
                            const float* ws_egl, const T* d_o, const i64* chf, const i64* ch_t0,              \
                            const int* ch_len, int hv, int dk, int dv, float scale, const float* dht,         \
                            float* ws_dh, float* ws_dd, float* dh0) {                                         \
        g2b_dscan<BV, T>(ws_kd, ws_a, ws_qg, ws_wm, ws_egl, d_o, chf, ch_t0, ch_len, hv, dk, dv, scale, dht,  \
                         ws_dh, ws_dd, dh0);                                                                  \
    }

G2B_DSCAN(16, float, f32)
G2B_DSCAN(32, float, f32)
G2B_DSCAN(16, bf16_t, bf16)
G2B_DSCAN(32, bf16_t, bf16)

#define G2B_GRAD(TC, TQ, T, S)                                                                                \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 1)                                                   \
        g2b_grad_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,            \
                     const T* d_o, const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv,       \
                     float scale, const float* ws_h, const float* ws_d, const float* ws_dh,                   \
                     const float* ws_dd, const float* ws_t, float* ws_g, float* dq_s, float* dk_s,            \
                     T* dv_out, T* dw_out, float* dg_out, T* db_out) {                                        \
        g2b_grad<TC, TQ, T>(q, k, v, g, b, w, d_o, ch_t0, ch_len, hk, hv, dk, dv, scale, ws_h, ws_d, ws_dh,   \
                            ws_dd, ws_t, ws_g, dq_s, dk_s, dv_out, dw_out, dg_out, db_out);                   \
    }

G2B_GRAD(false, float, float, f32)
G2B_GRAD(false, bf16_t, bf16_t, bf16)
G2B_GRAD(false, float, bf16_t, bf16n)
#ifdef G2B_TC_MODULE
// GDN_RULE2_GRAD=tc: the products on TF32 tensor cores (bf16 storage only; module gdn2_rule_tc).
G2B_GRAD(true, bf16_t, bf16_t, tc_bf16)
G2B_GRAD(true, float, bf16_t, tc_bf16n)
#endif

#ifdef G2B_TC_MODULE
// =============================================================================================
// Backward v2 (opt-in GDN_RULE2_BWD=v2; module gdn2_rule_tc only, so gdn2_rule's PTX is unchanged;
// bench/notes/h-g2bw.md). Same math and workspaces as the chunked backward above.
//
//   g2b_dscan32p  g2b_dscan<32> with the operand loads overlapped with the math: chunk c's Kd^T
//                 and A (group 1) are fetched by cp.async while chunk c + 1 (the previous step of
//                 the reverse walk) computes dS0, its Qg, Wm, eg_63 (group 2) while chunk c itself
//                 computes dD, and the next scale dO tile is read into registers during dS0 (two
//                 sO buffers). Each thread owns contiguous rows (dD rows NR r0 .., state rows
//                 nx r0 ..) so the Kd^T, A, Qg, Wm rows are float4 broadcasts (a third of
//                 g2b_dscan's shared-load instructions). Every element's FMAs are g2b_dscan's, in
//                 its order: the same bits.
//   g2b_grad2     g2b_grad<true> (TF32 block products) with: the scratch epilogues (dKd, dQg, dWm,
//                 dKbg) stored as float2 pairs (full 32-byte sectors); <S0_c, dS1_c> for dg read
//                 coalesced (one warp per channel row, a fixed shuffle tree) instead of one thread
//                 walking a row (87.5% of those sectors wasted: most of ncu's excessive sectors);
//                 the Gram step's exponentials as ex2.approx of the (hi + lo) difference times
//                 log2 e (one MUFU op instead of expf's ~8 instructions).

template <int BV, typename T>
__device__ void g2b_dscan_pp(const float* __restrict__ ws_kd, const float* __restrict__ ws_a,
                             const float* __restrict__ ws_qg, const float* __restrict__ ws_wm,
                             const float* __restrict__ ws_egl, const T* __restrict__ d_o,
                             const i64* __restrict__ chf, const i64* __restrict__ ch_t0,
                             const int* __restrict__ ch_len, int hv_n, int dk, int dv, float scale,
                             const float* __restrict__ dht, float* __restrict__ ws_dh, float* __restrict__ ws_dd,
                             float* __restrict__ dh0) {
    extern __shared__ __align__(16) float g2c_sm[];
    constexpr int RS = G2C_NT / BV;
    constexpr int NX = G2C_MAXD / RS;
    constexpr int NR = G2C_C / RS;
    constexpr int NO = G2C_C * BV / G2C_NT;  // dO elements a thread prefetches
    const int tid = threadIdx.x, col = tid % BV, r0 = tid / BV;
    const int ntile = dv / BV;
    const int tile = blockIdx.x % ntile;
    const int j = (blockIdx.x / ntile) % hv_n;
    const i64 n = blockIdx.x / ntile / hv_n;
    const int y = tile * BV + col;
    const int nx = dk / RS;
    float* sKt = g2c_sm;                 // Kd^T [dk][64]   (group 1)
    float* sQg = sKt + G2C_C * dk;       // [64][dk]        (group 2)
    float* sW = sQg + G2C_C * dk;        // Wm [64][dk]     (group 2)
    float* sA = sW + G2C_C * dk;         // [64][64]        (group 1)
    float* sE = sA + G2C_C * G2C_C;      // eg_63 [dk]      (group 2)
    float* sO0 = sE + dk;                // scale dO [2][64][BV]
    float* sDD = sO0 + 2 * G2C_C * BV;   // dD [64][BV]
    float* sS = sDD + G2C_C * BV;        // dS [dk][BV]
    const i64 sn = (i64)dk * dv;
    const i64 sbase = (n * hv_n + j) * sn;
    // Thread (r0, col) owns the state rows nx r0 .. + nx of column col (loaded, stored as dh,
    // updated and stored as dh0 by it alone).
    for (int x = nx * r0; x < nx * r0 + nx; ++x) sS[x * BV + col] = dht ? dht[sbase + (i64)x * dv + y] : 0.f;
    const i64 c0 = chf[n], nch = chf[n + 1] - c0;
    auto issue1 = [&](i64 cj) {
        const float* kd = ws_kd + cj * G2C_C * (i64)dk;
        const float* a = ws_a + cj * G2C_C * G2C_C;
        for (int e = tid; e < G2C_C * dk / 4; e += G2C_NT) g2c_cp16(sKt + 4 * e, kd + 4 * e);
        for (int e = tid; e < G2C_C * G2C_C / 4; e += G2C_NT) g2c_cp16(sA + 4 * e, a + 4 * e);
        g2c_commit();
    };
    auto issue2 = [&](i64 cj) {
        const float* qg = ws_qg + cj * G2C_C * (i64)dk;
        const float* wm = ws_wm + cj * G2C_C * (i64)dk;
        for (int e = tid; e < G2C_C * dk / 4; e += G2C_NT) {
            g2c_cp16(sQg + 4 * e, qg + 4 * e);
            g2c_cp16(sW + 4 * e, wm + 4 * e);
        }
        for (int e = tid; e < dk / 4; e += G2C_NT) g2c_cp16(sE + 4 * e, ws_egl + cj * dk + 4 * e);
        g2c_commit();
    };
    // scale dO of chunk c (rows >= l zero), this thread's elements tid + 256 m of the tile.
    auto fetch_o = [&](i64 c, float (&ro)[NO]) {
        const i64 t0 = ch_t0[c];
        const int l = ch_len[c];
#pragma unroll
        for (int m = 0; m < NO; ++m) {
            const int e = tid + G2C_NT * m;
            const int r = e / BV, cc = e - r * BV;
            ro[m] = r < l ? scale * ld(d_o, ((t0 + r) * hv_n + j) * (i64)dv + tile * BV + cc) : 0.f;
        }
    };
    if (nch > 0) {
        const i64 cj = (c0 + nch - 1) * hv_n + j;
        issue1(cj);
        issue2(cj);
        float ro[NO];
        fetch_o(c0 + nch - 1, ro);
#pragma unroll
        for (int m = 0; m < NO; ++m) sO0[tid + G2C_NT * m] = ro[m];
    }
    int p = 0;
    for (i64 ci = nch - 1; ci >= 0; --ci) {
        const i64 c = c0 + ci;
        const i64 cj = c * hv_n + j;
        float* sO = sO0 + p * G2C_C * BV;
        g2c_wait<1>();    // group 1 of chunk c (Kd^T, A) has landed for this thread
        __syncthreads();  // ... for every thread; sS and sO of the previous step are written
        {
            float* dh = ws_dh + cj * sn + y;
            for (int x = nx * r0; x < nx * r0 + nx; ++x) dh[(i64)x * dv] = sS[x * BV + col];
        }
        // dD = Kd dS1 + A^T (scale dO): rows NR r0 + m (contiguous: float4 broadcasts of the
        // Kd^T and A rows); each element's FMAs in g2b_dscan's order.
        {
            float acc[NR];
#pragma unroll
            for (int m = 0; m < NR; ++m) acc[m] = 0.f;
            for (int x = 0; x < dk; ++x) {
                const float s = sS[x * BV + col];
                const float4* kt = reinterpret_cast<const float4*>(sKt + x * G2C_C + NR * r0);
#pragma unroll
                for (int m4 = 0; m4 < NR / 4; ++m4) {
                    const float4 kv = kt[m4];
                    acc[4 * m4] += kv.x * s;
                    acc[4 * m4 + 1] += kv.y * s;
                    acc[4 * m4 + 2] += kv.z * s;
                    acc[4 * m4 + 3] += kv.w * s;
                }
            }
            for (int r = 0; r < G2C_C; ++r) {
                const float o = sO[r * BV + col];
                const float4* ar = reinterpret_cast<const float4*>(sA + r * G2C_C + NR * r0);
#pragma unroll
                for (int m4 = 0; m4 < NR / 4; ++m4) {
                    const float4 av = ar[m4];
                    acc[4 * m4] += av.x * o;
                    acc[4 * m4 + 1] += av.y * o;
                    acc[4 * m4 + 2] += av.z * o;
                    acc[4 * m4 + 3] += av.w * o;
                }
            }
            float* dd = ws_dd + cj * G2C_C * (i64)dv + y;
#pragma unroll
            for (int m = 0; m < NR; ++m) {
                const int i = NR * r0 + m;
                sDD[i * BV + col] = acc[m];
                dd[(i64)i * dv] = acc[m];
            }
        }
        float ro[NO];
        if (ci > 0) fetch_o(c - 1, ro);
        g2c_wait<0>();    // group 2 of chunk c (Qg, Wm, eg_63)
        __syncthreads();  // ... for every thread; sDD written; every read of sKt, sA done
        if (ci > 0) issue1(cj - hv_n);
        // dS0 = eg_63 dS1 + Qg^T (scale dO) - Wm^T dD: rows nx r0 + m (contiguous: float4
        // broadcasts of the Qg and Wm rows where nx % 4 == 0); each element's FMAs in
        // g2b_dscan's order.
        float acc[NX];
#pragma unroll
        for (int m = 0; m < NX; ++m) {
            const int x = nx * r0 + m;
            acc[m] = m < nx ? sE[x] * sS[x * BV + col] : 0.f;
        }
        if ((nx & 3) == 0) {
            for (int i = 0; i < G2C_C; ++i) {
                const float o = sO[i * BV + col], d = sDD[i * BV + col];
                const float4* qr = reinterpret_cast<const float4*>(sQg + i * dk + nx * r0);
                const float4* wr = reinterpret_cast<const float4*>(sW + i * dk + nx * r0);
#pragma unroll
                for (int m4 = 0; m4 < NX / 4; ++m4) {
                    if (4 * m4 < nx) {
                        const float4 qv = qr[m4], wv = wr[m4];
                        acc[4 * m4] += qv.x * o;
                        acc[4 * m4] -= wv.x * d;
                        acc[4 * m4 + 1] += qv.y * o;
                        acc[4 * m4 + 1] -= wv.y * d;
                        acc[4 * m4 + 2] += qv.z * o;
                        acc[4 * m4 + 2] -= wv.z * d;
                        acc[4 * m4 + 3] += qv.w * o;
                        acc[4 * m4 + 3] -= wv.w * d;
                    }
                }
            }
        } else {
            for (int i = 0; i < G2C_C; ++i) {
                const float o = sO[i * BV + col], d = sDD[i * BV + col];
#pragma unroll
                for (int m = 0; m < NX; ++m) {
                    if (m < nx) {
                        const int x = nx * r0 + m;
                        acc[m] += sQg[i * dk + x] * o;
                        acc[m] -= sW[i * dk + x] * d;
                    }
                }
            }
        }
        if (ci > 0) {
            float* sOn = sO0 + (p ^ 1) * G2C_C * BV;  // last read in the previous step
#pragma unroll
            for (int m = 0; m < NO; ++m) sOn[tid + G2C_NT * m] = ro[m];
        }
        __syncthreads();  // every read of sS, sQg, sW, sE is done
        if (ci > 0) issue2(cj - hv_n);
#pragma unroll
        for (int m = 0; m < NX; ++m)
            if (m < nx) sS[(nx * r0 + m) * BV + col] = acc[m];
        p ^= 1;
    }
    if (dh0) {
        for (int x = nx * r0; x < nx * r0 + nx; ++x) dh0[sbase + (i64)x * dv + y] = sS[x * BV + col];
    }
}

#define G2B_DSCANP(BV, T, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 1)                                                   \
        g2b_dscan##BV##p_##S(const float* ws_kd, const float* ws_a, const float* ws_qg, const float* ws_wm,   \
                             const float* ws_egl, const T* d_o, const i64* chf, const i64* ch_t0,             \
                             const int* ch_len, int hv, int dk, int dv, float scale, const float* dht,        \
                             float* ws_dh, float* ws_dd, float* dh0) {                                        \
        g2b_dscan_pp<BV, T>(ws_kd, ws_a, ws_qg, ws_wm, ws_egl, d_o, chf, ch_t0, ch_len, hv, dk, dv, scale,    \
                            dht, ws_dh, ws_dd, dh0);                                                          \
    }

G2B_DSCANP(32, float, f32)
G2B_DSCANP(32, bf16_t, bf16)
G2B_DSCANP(16, float, f32)
G2B_DSCANP(16, bf16_t, bf16)

// g2b_mm_tc with the epilogue delivered as column pairs: fe2(i, jj, a(i, jj), a(i, jj + 1)),
// jj even (nc even). Same products, same values as g2b_mm_tc.
template <bool AKF, bool BKF, class FA, class FB, class FE2>
__device__ __forceinline__ void g2b_mm_tc2(int nc, int kdim, FA fa, FB fb, FE2 fe2, float* stage) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = 16 * (warp & 3) + (lane >> 2), c0 = 32 * (warp >> 2) + 2 * (lane & 3);
    for (int n0 = 0; n0 < nc; n0 += 64) {
        float acc[4][4];
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int nn = 0; nn < 4; ++nn) acc[m][nn] = 0.f;
        g2b_tile_tc<AKF, BKF>(
            acc, kdim, fa, [&](int k, int jj) { return n0 + jj < nc ? fb(k, n0 + jj) : 0.f; }, stage);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int jj = n0 + c0 + 8 * nt;
                if (jj < nc) fe2(r0 + 8 * h, jj, acc[nt][2 * h], acc[nt][2 * h + 1]);
            }
    }
    __syncthreads();
}

__device__ __forceinline__ float g2b_ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// e^((gh_a - gh_b) + (gl_a - gl_b)) through ex2.approx (the exponent <= 0 where it is used).
#define G2B_E2(gha, ghb, gla, glb) g2b_ex2((((gha) - (ghb)) + ((gla) - (glb))) * 1.4426950408889634f)

// Shared memory: as g2b_grad<true>. Global scratch per (chunk, value head): 4 * 64 dk floats.
template <typename TQ, typename T>
__device__ void g2b_grad2(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                          const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                          const T* __restrict__ d_o, const i64* __restrict__ ch_t0, const int* __restrict__ ch_len,
                          int hk_n, int hv_n, int dk, int dv, float scale, const float* __restrict__ ws_h,
                          const float* __restrict__ ws_d, const float* __restrict__ ws_dh,
                          const float* __restrict__ ws_dd, const float* __restrict__ ws_t, float* ws_g,
                          float* __restrict__ dq_s, float* __restrict__ dk_s, T* __restrict__ dv_out,
                          T* __restrict__ dw_out, float* __restrict__ dg_out, T* __restrict__ db_out) {
    extern __shared__ __align__(16) float g2c_sm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 cj = blockIdx.x;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const int kh = j / (hv_n / hk_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int ck = G2C_C * dk;
    float* sQ = g2c_sm;
    float* sK = sQ + ck;
    float* sKb = sK + ck;
    float* sGh = sKb + ck;
    float* sGl = sGh + ck;
    float* sT = sGl + ck;
    float* sDA = sT + G2C_C * G2B_LM;
    float* sX = sDA + G2C_C * G2B_LM;
    float* stage = sX + G2C_C * G2B_LM;  // G2B_STAGE_TC; after the products <S0_c, dS1_c> [dk]
    float* gKd = ws_g + cj * 4 * (i64)ck;
    float* gQg = gKd + ck;
    float* gWm = gQg + ck;
    float* gKbg = gWm + ck;
    const i64 sn = (i64)dk * dv;
    const float* S0 = ws_h + cj * sn;
    const float* dS1 = ws_dh + cj * sn;
    const float* Dm = ws_d + cj * G2C_C * (i64)dv;
    const float* dDm = ws_dd + cj * G2C_C * (i64)dv;
    const i64 vrow = (t0 * hv_n + j) * (i64)dv;
    const i64 vstride = (i64)hv_n * dv;

    for (int idx = tid; idx < ck; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        float qv = 0.f, kv = 0.f, bv = 0.f;
        if (i < l) {
            const i64 t = t0 + i;
            const i64 kr = (t * hk_n + kh) * dk + x;
            qv = ld(q, kr);
            kv = ld(k, kr);
            bv = ld(b, (t * hv_n + j) * dk + x);
        }
        sQ[idx] = qv;
        sK[idx] = kv;
        sKb[idx] = bv * kv;
    }
    if (tid < dk) {
        double acc = 0.0;
        for (int i = 0; i < G2C_C; ++i) {
            if (i < l) acc += (double)g[((t0 + i) * hv_n + j) * dk + tid];
            const float hi = (float)acc;
            sGh[i * dk + tid] = hi;
            sGl[i * dk + tid] = (float)(acc - (double)hi);
        }
    }
    {
        const float* tg = ws_t + cj * G2C_C * G2C_C;
        for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) sT[(idx >> 6) * G2B_LM + (idx & 63)] = tg[idx];
    }
    __syncthreads();
    auto dO = [&](int i, int y) -> float { return i < l ? ld(d_o, vrow + i * vstride + y) : 0.f; };
    auto st2 = [](float* p, float a0, float a1) { *reinterpret_cast<float2*>(p) = make_float2(a0, a1); };

    // 1. dKd = D dS1^T, dQg = scale dO S0^T, dWm = -dD S0^T.
    g2b_mm_tc2<true, true>(
        dk, dv, [&](int i, int y) { return Dm[(i64)i * dv + y]; },
        [&](int y, int x) { return dS1[(i64)x * dv + y]; },
        [&](int i, int x, float a0, float a1) { st2(gKd + i * dk + x, a0, a1); }, stage);
    g2b_mm_tc2<true, true>(
        dk, dv, dO, [&](int y, int x) { return S0[(i64)x * dv + y]; },
        [&](int i, int x, float a0, float a1) { st2(gQg + i * dk + x, scale * a0, scale * a1); }, stage);
    g2b_mm_tc2<true, true>(
        dk, dv, [&](int i, int y) { return dDm[(i64)i * dv + y]; },
        [&](int y, int x) { return S0[(i64)x * dv + y]; },
        [&](int i, int x, float a0, float a1) { st2(gWm + i * dk + x, -a0, -a1); }, stage);
    // 2. dA = scale dO D^T, dT = dD Wv^T.
    g2b_mm_tc<true, true>(
        G2C_C, dv, dO, [&](int y, int jj) { return Dm[(i64)jj * dv + y]; },
        [&](int i, int jj, float a) { sDA[i * G2B_LM + jj] = scale * a; }, stage);
    g2b_mm_tc<true, true>(
        G2C_C, dv, [&](int i, int y) { return dDm[(i64)i * dv + y]; },
        [&](int y, int jj) {
            if (jj >= l) return 0.f;
            const i64 o = vrow + jj * vstride + y;
            return ld(w, o) * ld(v, o);
        },
        [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = a; }, stage);
    // 3. dWv = T^T dD: dw = dWv * v, dv = dWv * w (valid rows).
    g2b_mm_tc<false, false>(
        dv, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; },
        [&](int r, int y) { return dDm[(i64)r * dv + y]; },
        [&](int i, int y, float a) {
            if (i < l) {
                const i64 o = vrow + i * vstride + y;
                st(dw_out, o, a * ld(v, o));
                st(dv_out, o, a * ld(w, o));
            }
        },
        stage);
    // 4. dT += dWm Kbg^T, dKbg = T^T dWm.
    g2b_mm_tc<true, true>(
        G2C_C, dk, [&](int i, int x) { return gWm[i * dk + x]; },
        [&](int x, int jj) { return sKb[jj * dk + x] * expf(sGh[jj * dk + x] + sGl[jj * dk + x]); },
        [&](int i, int jj, float a) { sX[i * G2B_LM + jj] += a; }, stage);
    g2b_mm_tc2<false, false>(
        dk, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; }, [&](int r, int x) { return gWm[r * dk + x]; },
        [&](int i, int x, float a0, float a1) { st2(gKbg + i * dk + x, a0, a1); }, stage);
    // 5. dM = -T^T dT T^T, in place in sX.
    g2b_mm_tc<false, false>(
        G2C_C, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; },
        [&](int r, int jj) { return sX[r * G2B_LM + jj]; }, [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = a; },
        stage);
    g2b_mm_tc<true, true>(
        G2C_C, G2C_C, [&](int i, int r) { return sX[i * G2B_LM + r]; },
        [&](int r, int jj) { return sT[jj * G2B_LM + r]; }, [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = -a; },
        stage);
    // <S0_c, dS1_c> per channel c: warp w takes rows w, w + 8, ..; lane sums y = lane + 32 m in
    // order, then a fixed shuffle tree.
    float* sSD = stage;
    for (int x = warp; x < dk; x += G2C_NT / 32) {
        float sd = 0.f;
        for (int y = lane; y < dv; y += 32) sd += S0[(i64)x * dv + y] * dS1[(i64)x * dv + y];
        sd = warp_sum(sd);
        if (lane == 0) sSD[x] = sd;
    }

    // 6. Per element: the Gram gradients, dq, dk, db; dGam into gWm.
    for (int idx = tid; idx < ck; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        if (i >= l) {
            gWm[idx] = 0.f;
            continue;
        }
        const float ghi = sGh[idx], gli = sGl[idx];
        const float qi = sQ[idx], ki = sK[idx], kbi = sKb[idx];
        float dqa = 0.f, dkbm = 0.f;
        for (int jj = 0; jj < i; ++jj) {
            const int o = jj * dk + x;
            const float ek = G2B_E2(ghi, sGh[o], gli, sGl[o]) * sK[o];
            dqa += sDA[i * G2B_LM + jj] * ek;
            dkbm += sX[i * G2B_LM + jj] * ek;
        }
        float dkg = 0.f;
        for (int r = i + 1; r < l; ++r) {
            const int o = r * dk + x;
            const float e = G2B_E2(sGh[o], ghi, sGl[o], gli);
            dkg += e * (sDA[r * G2B_LM + i] * sQ[o] + sX[r * G2B_LM + i] * sKb[o]);
        }
        const float eg = expf(ghi + gli);
        const float ed = expf((sGh[(G2C_C - 1) * dk + x] - ghi) + (sGl[(G2C_C - 1) * dk + x] - gli));
        const float dkd = gKd[idx], dqg = gQg[idx], dkbg = gKbg[idx];
        const float daii = sDA[i * G2B_LM + i];
        const float kd = ki * ed;
        gWm[idx] = dqg * (qi * eg) + dkbg * (kbi * eg) + qi * dqa + kbi * dkbm - ki * dkg - dkd * kd;
        const i64 orow = ((t0 + i) * hv_n + j) * (i64)dk + x;
        const float dkb = eg * dkbg + dkbm;
        dq_s[orow] = eg * dqg + dqa + daii * ki;
        dk_s[orow] = ed * dkd + dkg + daii * qi + dkb * ld(b, orow);
        st(db_out, orow, dkb * ki);
    }
    __syncthreads();
    // 7. dg.
    if (tid < dk) {
        const int x = tid;
        const float gh63 = sGh[(G2C_C - 1) * dk + x], gl63 = sGl[(G2C_C - 1) * dk + x];
        float ex = 0.f;
        for (int i = 0; i < l; ++i) {
            const int o = i * dk + x;
            const float ed = expf((gh63 - sGh[o]) + (gl63 - sGl[o]));
            ex += gKd[o] * (sK[o] * ed);
        }
        float acc = expf(gh63 + gl63) * sSD[x] + ex;
        for (int i = l - 1; i >= 0; --i) {
            acc += gWm[i * dk + x];
            dg_out[((t0 + i) * hv_n + j) * (i64)dk + x] = acc;
        }
    }
}

#define G2B_GRAD2(TQ, T, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 1)                                                   \
        g2b_grad2_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,           \
                      const T* d_o, const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv,      \
                      float scale, const float* ws_h, const float* ws_d, const float* ws_dh,                  \
                      const float* ws_dd, const float* ws_t, float* ws_g, float* dq_s, float* dk_s,           \
                      T* dv_out, T* dw_out, float* dg_out, T* db_out) {                                       \
        g2b_grad2<TQ, T>(q, k, v, g, b, w, d_o, ch_t0, ch_len, hk, hv, dk, dv, scale, ws_h, ws_d, ws_dh,      \
                         ws_dd, ws_t, ws_g, dq_s, dk_s, dv_out, dw_out, dg_out, db_out);                      \
    }

G2B_GRAD2(bf16_t, bf16_t, bf16)
G2B_GRAD2(float, bf16_t, bf16n)
#endif  // G2B_TC_MODULE (backward v2)

#ifdef G2B_TC_MODULE
// =============================================================================================
// Backward v3's gradient kernel (opt-in GDN_RULE2_BWD=v3, or GDN_RULE2_GRAD=v3 with v2; module
// gdn2_rule_tc only; bench/notes/h-g2g3.md). g2b_grad2 with the Gram step (step 6) by 16-row
// blocks, the factorisation g2c_prep8 uses for A and M:
//
//   Gam is kept per 16-row block I relative to the row before the block, in base 2 (Gr_i =
//   log2(e) (Gam_i - P_I), the block's own f64 cumsum rounded to f32), with per-channel f64
//   constants P_I (= Gam of row 16 I - 1), Gam_63 - P_I and c_IJ = e^(P_I - P_{J+1}) (J < I,
//   1 for J = I - 1), instead of g2b_grad2's hi + lo Gam. For i in block I > J >= j's block:
//     e^(Gam_i - Gam_j) = Eup_i c_IJ Edn_j,  Eup_i = 2^Gr_i,  Edn_j = 2^(Gr_{16J+15} - Gr_j),
//   every factor <= 1 (no exponent is positive, as before). So
//     dQa_I  = Eup_I (.) sum_{J<I} c_IJ (.) (dA_IJ Kdn_J)      Kdn_J = K_J (.) Edn_J
//     dKbm_I = Eup_I (.) sum_{J<I} c_IJ (.) (dM_IJ Kdn_J)
//     dKg_J  = Edn_J (.) sum_{I>J} c_IJ (.) (dA_IJ^T Qup_I + dM_IJ^T Kbup_I),  Qup = Q (.) Eup
//   ((.) per channel: c_IJ scales the product's columns, Eup / Edn its rows), the 6 block pairs
//   as 3xTF32 mma.sync m16n8k8 (operands split into a TF32 hi and lo; hi hi + lo hi + hi lo,
//   fp32 accumulation: ~2^-21 relative per product, near the fp32 elementwise sums it replaces),
//   Kdn / Qup / Kbup formed as the B fragments are loaded (one ex2 per operand element). Only the
//   diagonal 16x16 blocks stay elementwise (e^(Gr_i - Gr_j), one ex2 per (i, j, channel) pair
//   of a block: 16 per element instead of ~63). Warp w owns the 8-channel column tiles w, w + 8
//   (of Dk / 8) and for each the C fragments of all 64 rows: the diagonal sums, the combination
//   and the epilogue (dq, dk, db, dGam) run in the mma layout, each lane on its own 16 elements
//   (rows 16 I + g, + 8; channels 8 nt + 2 t, + 1), stored as pairs. The other exponentials
//   (Kbg in step 4, e^Gam, e^(Gam_63 - Gam), e^Gam_63) are exp2f of a (P_I + Gr) difference as
//   in g2c_prep8. Steps 1-5 and 7 are g2b_grad2's. Fixed orders, no atomics.
// Shared memory: as g2b_grad2 (the hi + lo slot holds the per-channel constants, 15 dk floats).

// The 3xTF32 split (hi = TF32 of x, lo = TF32 of the rest).
__device__ __forceinline__ void g2g3_split(float x, unsigned& hi, unsigned& lo) {
    const float h = to_tf32(x);
    hi = __float_as_uint(h);
    lo = __float_as_uint(to_tf32(x - h));
}
struct G2g3F {
    unsigned h[4], l[4];
};
// A fragment (16 x 8) of the row-major matrix at p (row stride ld): (g, t), (g + 8, t), (g, t + 4),
// (g + 8, t + 4); with TR the transposed matrix's fragment (element (r, k) read at p[k * ld + r]).
template <bool TR>
__device__ __forceinline__ void g2g3_fa(G2g3F& f, const float* p, int ld) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float v[4];
    if (TR) {
        v[0] = p[t * ld + g];
        v[1] = p[t * ld + g + 8];
        v[2] = p[(t + 4) * ld + g];
        v[3] = p[(t + 4) * ld + g + 8];
    } else {
        v[0] = p[g * ld + t];
        v[1] = p[(g + 8) * ld + t];
        v[2] = p[g * ld + t + 4];
        v[3] = p[(g + 8) * ld + t + 4];
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) g2g3_split(v[r], f.h[r], f.l[r]);
}
// c += a b in 3xTF32 (B fragment pre-split: bh, bl = {b0, b1}); small terms first.
__device__ __forceinline__ void g2g3_mma3(float (&c)[4], const G2g3F& a, const unsigned (&bh)[2],
                                          const unsigned (&bl)[2]) {
    mma_tf32(c, a.h[0], a.h[1], a.h[2], a.h[3], bl[0], bl[1]);
    mma_tf32(c, a.l[0], a.l[1], a.l[2], a.l[3], bh[0], bh[1]);
    mma_tf32(c, a.h[0], a.h[1], a.h[2], a.h[3], bh[0], bh[1]);
}
__device__ __forceinline__ float2 g2g3_ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ void g2g3_st2(float* p, float a0, float a1) {
    *reinterpret_cast<float2*>(p) = make_float2(a0, a1);
}
#define G2G3_L2E 1.4426950408889634

template <typename TQ, typename T>
__device__ void g2b_grad3(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                          const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                          const T* __restrict__ d_o, const i64* __restrict__ ch_t0, const int* __restrict__ ch_len,
                          int hk_n, int hv_n, int dk, int dv, float scale, const float* __restrict__ ws_h,
                          const float* __restrict__ ws_d, const float* __restrict__ ws_dh,
                          const float* __restrict__ ws_dd, const float* __restrict__ ws_t, float* ws_g,
                          float* __restrict__ dq_s, float* __restrict__ dk_s, T* __restrict__ dv_out,
                          T* __restrict__ dw_out, float* __restrict__ dg_out, T* __restrict__ db_out) {
    extern __shared__ __align__(16) float g2c_sm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g8 = lane >> 2, t4 = lane & 3;
    const i64 cj = blockIdx.x;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const int kh = j / (hv_n / hk_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int ck = G2C_C * dk;
    float* sQ = g2c_sm;
    float* sK = sQ + ck;
    float* sKb = sK + ck;
    float* sG = sKb + ck;  // Gr (base 2, per 16-row block) [64][dk]; rows >= l repeat row l - 1
    float* sCo = sG + ck;  // per-channel constants (below) in g2b_grad2's Gam lo slot
    float* sT = sCo + ck;
    float* sDA = sT + G2C_C * G2B_LM;
    float* sX = sDA + G2C_C * G2B_LM;
    float* stage = sX + G2C_C * G2B_LM;  // G2B_STAGE_TC; after the products <S0_c, dS1_c> [dk]
    float* sP = sCo;                     // [4][dk] P_I (base 2)
    float* sDl = sP + 4 * dk;            // [4][dk] Gam_63 - P_I (base 2)
    float* sCc = sDl + 4 * dk;           // [6][dk] c_IJ, pair p = I (I - 1) / 2 + J
    float* sEl = sCc + 6 * dk;           // [dk] e^Gam_63
    float* gKd = ws_g + cj * 4 * (i64)ck;
    float* gQg = gKd + ck;
    float* gWm = gQg + ck;
    float* gKbg = gWm + ck;
    const i64 sn = (i64)dk * dv;
    const float* S0 = ws_h + cj * sn;
    const float* dS1 = ws_dh + cj * sn;
    const float* Dm = ws_d + cj * G2C_C * (i64)dv;
    const float* dDm = ws_dd + cj * G2C_C * (i64)dv;
    const i64 vrow = (t0 * hv_n + j) * (i64)dv;
    const i64 vstride = (i64)hv_n * dv;

    for (int idx = tid; idx < ck; idx += G2C_NT) {
        const int i = idx / dk, x = idx - i * dk;
        float qv = 0.f, kv = 0.f, bv = 0.f;
        if (i < l) {
            const i64 t = t0 + i;
            const i64 kr = (t * hk_n + kh) * dk + x;
            qv = ld(q, kr);
            kv = ld(k, kr);
            bv = ld(b, (t * hv_n + j) * dk + x);
        }
        sQ[idx] = qv;
        sK[idx] = kv;
        sKb[idx] = bv * kv;
    }
    // Gam per 16-row block (f64 sums, as g2c_prep8), the per-channel constants.
    if (tid < dk) {
        const int x = tid;
        double P[5];
        P[0] = 0.0;
#pragma unroll
        for (int I = 0; I < 4; ++I) {
            double acc = 0.0;
            for (int il = 0; il < 16; ++il) {
                const int i = 16 * I + il;
                if (i < l) acc += (double)g[((t0 + i) * hv_n + j) * dk + x];
                sG[i * dk + x] = (float)(acc * G2G3_L2E);
            }
            P[I + 1] = P[I] + acc;
        }
#pragma unroll
        for (int I = 0; I < 4; ++I) {
            sP[I * dk + x] = (float)(P[I] * G2G3_L2E);
            sDl[I * dk + x] = (float)((P[4] - P[I]) * G2G3_L2E);
        }
#pragma unroll
        for (int I = 1; I < 4; ++I)
#pragma unroll
            for (int J = 0; J < I; ++J)
                sCc[(I * (I - 1) / 2 + J) * dk + x] =
                    (J == I - 1) ? 1.f : exp2f((float)((P[I] - P[J + 1]) * G2G3_L2E));
        sEl[x] = exp2f((float)(P[4] * G2G3_L2E));
    }
    {
        const float* tg = ws_t + cj * G2C_C * G2C_C;
        for (int idx = tid; idx < G2C_C * G2C_C; idx += G2C_NT) sT[(idx >> 6) * G2B_LM + (idx & 63)] = tg[idx];
    }
    __syncthreads();
    auto dO = [&](int i, int y) -> float { return i < l ? ld(d_o, vrow + i * vstride + y) : 0.f; };
    auto st2 = [](float* p, float a0, float a1) { *reinterpret_cast<float2*>(p) = make_float2(a0, a1); };

    // 1. dKd = D dS1^T, dQg = scale dO S0^T, dWm = -dD S0^T.
    g2b_mm_tc2<true, true>(
        dk, dv, [&](int i, int y) { return Dm[(i64)i * dv + y]; },
        [&](int y, int x) { return dS1[(i64)x * dv + y]; },
        [&](int i, int x, float a0, float a1) { st2(gKd + i * dk + x, a0, a1); }, stage);
    g2b_mm_tc2<true, true>(
        dk, dv, dO, [&](int y, int x) { return S0[(i64)x * dv + y]; },
        [&](int i, int x, float a0, float a1) { st2(gQg + i * dk + x, scale * a0, scale * a1); }, stage);
    g2b_mm_tc2<true, true>(
        dk, dv, [&](int i, int y) { return dDm[(i64)i * dv + y]; },
        [&](int y, int x) { return S0[(i64)x * dv + y]; },
        [&](int i, int x, float a0, float a1) { st2(gWm + i * dk + x, -a0, -a1); }, stage);
    // 2. dA = scale dO D^T, dT = dD Wv^T.
    g2b_mm_tc<true, true>(
        G2C_C, dv, dO, [&](int y, int jj) { return Dm[(i64)jj * dv + y]; },
        [&](int i, int jj, float a) { sDA[i * G2B_LM + jj] = scale * a; }, stage);
    g2b_mm_tc<true, true>(
        G2C_C, dv, [&](int i, int y) { return dDm[(i64)i * dv + y]; },
        [&](int y, int jj) {
            if (jj >= l) return 0.f;
            const i64 o = vrow + jj * vstride + y;
            return ld(w, o) * ld(v, o);
        },
        [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = a; }, stage);
    // 3. dWv = T^T dD: dw = dWv * v, dv = dWv * w (valid rows).
    g2b_mm_tc<false, false>(
        dv, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; },
        [&](int r, int y) { return dDm[(i64)r * dv + y]; },
        [&](int i, int y, float a) {
            if (i < l) {
                const i64 o = vrow + i * vstride + y;
                st(dw_out, o, a * ld(v, o));
                st(dv_out, o, a * ld(w, o));
            }
        },
        stage);
    // 4. dT += dWm Kbg^T (Kbg = Kb e^Gam = Kb 2^(P_I + Gr)), dKbg = T^T dWm.
    g2b_mm_tc<true, true>(
        G2C_C, dk, [&](int i, int x) { return gWm[i * dk + x]; },
        [&](int x, int jj) { return sKb[jj * dk + x] * exp2f(sP[(jj >> 4) * dk + x] + sG[jj * dk + x]); },
        [&](int i, int jj, float a) { sX[i * G2B_LM + jj] += a; }, stage);
    g2b_mm_tc2<false, false>(
        dk, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; }, [&](int r, int x) { return gWm[r * dk + x]; },
        [&](int i, int x, float a0, float a1) { st2(gKbg + i * dk + x, a0, a1); }, stage);
    // 5. dM = -T^T dT T^T, in place in sX.
    g2b_mm_tc<false, false>(
        G2C_C, G2C_C, [&](int i, int r) { return sT[r * G2B_LM + i]; },
        [&](int r, int jj) { return sX[r * G2B_LM + jj]; }, [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = a; },
        stage);
    g2b_mm_tc<true, true>(
        G2C_C, G2C_C, [&](int i, int r) { return sX[i * G2B_LM + r]; },
        [&](int r, int jj) { return sT[jj * G2B_LM + r]; }, [&](int i, int jj, float a) { sX[i * G2B_LM + jj] = -a; },
        stage);
    // <S0_c, dS1_c> per channel (g2b_grad2's).
    float* sSD = stage;
    for (int x = warp; x < dk; x += G2C_NT / 32) {
        float sd = 0.f;
        for (int y = lane; y < dv; y += 32) sd += S0[(i64)x * dv + y] * dS1[(i64)x * dv + y];
        sd = warp_sum(sd);
        if (lane == 0) sSD[x] = sd;
    }

    // 6. The Gram step by 16-row blocks (header): warp w, column tiles nt = w, w + 8, ...
    for (int nt = warp; nt < dk / 8; nt += G2C_NT / 32) {
        const int xn = 8 * nt + g8;      // this lane's B-fragment channel
        const int xa = 8 * nt + 2 * t4;  // this lane's C-fragment channels xa, xa + 1
        float aq[3][4], am[3][4], ag[3][4];
#pragma unroll
        for (int u = 0; u < 3; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) aq[u][e] = am[u][e] = ag[u][e] = 0.f;
        // (a) dQa_I, dKbm_I (I = 1..3) below the diagonal blocks: B = Kdn_J (k = row j of block J).
#pragma unroll
        for (int J = 0; J < 3; ++J) {
            unsigned bh[2][2], bl[2][2];
            const float gend = sG[(16 * J + 15) * dk + xn];
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int o = (16 * J + 8 * ks + t4 + 4 * hh) * dk + xn;
                    g2g3_split(sK[o] * g2b_ex2(gend - sG[o]), bh[ks][hh], bl[ks][hh]);
                }
#pragma unroll
            for (int I = J + 1; I < 4; ++I) {
                float tq[4] = {0.f, 0.f, 0.f, 0.f}, tm[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < 2; ++ks) {
                    G2g3F fa;
                    g2g3_fa<false>(fa, sDA + 16 * I * G2B_LM + 16 * J + 8 * ks, G2B_LM);
                    g2g3_mma3(tq, fa, bh[ks], bl[ks]);
                    g2g3_fa<false>(fa, sX + 16 * I * G2B_LM + 16 * J + 8 * ks, G2B_LM);
                    g2g3_mma3(tm, fa, bh[ks], bl[ks]);
                }
                if (J == I - 1) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        aq[I - 1][e] += tq[e];
                        am[I - 1][e] += tm[e];
                    }
                } else {
                    const float* cc = sCc + (I * (I - 1) / 2 + J) * dk + xa;
                    const float c0 = cc[0], c1 = cc[1];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float ce = (e & 1) ? c1 : c0;
                        aq[I - 1][e] = fmaf(ce, tq[e], aq[I - 1][e]);
                        am[I - 1][e] = fmaf(ce, tm[e], am[I - 1][e]);
                    }
                }
            }
        }
        // (b) dKg_J (J = 0..2): B = Qup_I, Kbup_I (k = row r of block I), A = dA_IJ^T, dM_IJ^T.
#pragma unroll
        for (int I = 1; I < 4; ++I) {
            unsigned qh[2][2], ql[2][2], kh_[2][2], kl_[2][2];
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int o = (16 * I + 8 * ks + t4 + 4 * hh) * dk + xn;
                    const float e = g2b_ex2(sG[o]);
                    g2g3_split(sQ[o] * e, qh[ks][hh], ql[ks][hh]);
                    g2g3_split(sKb[o] * e, kh_[ks][hh], kl_[ks][hh]);
                }
#pragma unroll
            for (int J = 0; J < I; ++J) {
                float tg[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < 2; ++ks) {
                    G2g3F fa;
                    g2g3_fa<true>(fa, sDA + (16 * I + 8 * ks) * G2B_LM + 16 * J, G2B_LM);
                    g2g3_mma3(tg, fa, qh[ks], ql[ks]);
                    g2g3_fa<true>(fa, sX + (16 * I + 8 * ks) * G2B_LM + 16 * J, G2B_LM);
                    g2g3_mma3(tg, fa, kh_[ks], kl_[ks]);
                }
                if (J == I - 1) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) ag[J][e] += tg[e];
                } else {
                    const float* cc = sCc + (I * (I - 1) / 2 + J) * dk + xa;
                    const float c0 = cc[0], c1 = cc[1];
#pragma unroll
                    for (int e = 0; e < 4; ++e) ag[J][e] = fmaf((e & 1) ? c1 : c0, tg[e], ag[J][e]);
                }
            }
        }
        // (c) Per block I: the diagonal block's sums elementwise (rows ia = 16 I + g, ib = ia + 8,
        //     channels xa, xa + 1; one ex2 per (row, row of the block, channel)), then the
        //     combination with the off-diagonal sums and the epilogue.
#pragma unroll
        for (int I = 0; I < 4; ++I) {
            float gi[2][2];
            {
                const float2 ga = g2g3_ld2(sG + (16 * I + g8) * dk + xa);
                const float2 gb = g2g3_ld2(sG + (16 * I + g8 + 8) * dk + xa);
                gi[0][0] = ga.x;
                gi[0][1] = ga.y;
                gi[1][0] = gb.x;
                gi[1][1] = gb.y;
            }
            float dqa[2][2], dkbm[2][2], dkg[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) dqa[h][e] = dkbm[h][e] = dkg[h][e] = 0.f;
#pragma unroll 4
            for (int jl = 0; jl < 16; ++jl) {
                const int r = 16 * I + jl;
                const float2 gr = g2g3_ld2(sG + r * dk + xa), kr = g2g3_ld2(sK + r * dk + xa);
                const float2 qr = g2g3_ld2(sQ + r * dk + xa), br = g2g3_ld2(sKb + r * dk + xa);
                const float grv[2] = {gr.x, gr.y}, krv[2] = {kr.x, kr.y}, qrv[2] = {qr.x, qr.y},
                            brv[2] = {br.x, br.y};
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int il = g8 + 8 * h, i = 16 * I + il;
                    const bool below = jl < il, above = jl > il;
                    const float da_ij = sDA[i * G2B_LM + r], dm_ij = sX[i * G2B_LM + r];
                    const float da_ri = sDA[r * G2B_LM + i], dm_ri = sX[r * G2B_LM + i];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float ex = g2b_ex2(below ? gi[h][e] - grv[e] : grv[e] - gi[h][e]);
                        const float ek = below ? ex * krv[e] : 0.f;
                        const float eq = above ? ex : 0.f;
                        dqa[h][e] = fmaf(da_ij, ek, dqa[h][e]);
                        dkbm[h][e] = fmaf(dm_ij, ek, dkbm[h][e]);
                        dkg[h][e] = fmaf(eq, da_ri * qrv[e] + dm_ri * brv[e], dkg[h][e]);
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 16 * I + g8 + 8 * h;
                float* gw = gWm + i * dk + xa;
                if (i >= l) {
                    g2g3_st2(gw, 0.f, 0.f);
                    continue;
                }
                const float2 gend = g2g3_ld2(sG + (16 * I + 15) * dk + xa);
                const float2 pI = g2g3_ld2(sP + I * dk + xa), dI = g2g3_ld2(sDl + I * dk + xa);
                const float2 q2 = g2g3_ld2(sQ + i * dk + xa), k2 = g2g3_ld2(sK + i * dk + xa);
                const float2 b2 = g2g3_ld2(sKb + i * dk + xa);
                const float2 kd2 = g2g3_ld2(gKd + i * dk + xa), qg2 = g2g3_ld2(gQg + i * dk + xa);
                const float2 kbg2 = g2g3_ld2(gKbg + i * dk + xa);
                const float daii = sDA[i * G2B_LM + i];
                const i64 orow = ((t0 + i) * hv_n + j) * (i64)dk + xa;
                float dgam[2], dqo[2], dko[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float gie = gi[h][e];
                    const float qi = e ? q2.y : q2.x, ki = e ? k2.y : k2.x, kbi = e ? b2.y : b2.x;
                    const float ge = e ? gend.y : gend.x, pe = e ? pI.y : pI.x, de = e ? dI.y : dI.x;
                    const float dkd = e ? kd2.y : kd2.x, dqg = e ? qg2.y : qg2.x, dkbg = e ? kbg2.y : kbg2.x;
                    float sq = dqa[h][e], sm = dkbm[h][e], sg = dkg[h][e];
                    if (I > 0) {
                        const float eu = g2b_ex2(gie);
                        sq = fmaf(eu, aq[I > 0 ? I - 1 : 0][2 * h + e], sq);
                        sm = fmaf(eu, am[I > 0 ? I - 1 : 0][2 * h + e], sm);
                    }
                    if (I < 3) sg = fmaf(g2b_ex2(ge - gie), ag[I < 3 ? I : 0][2 * h + e], sg);
                    const float eg = exp2f(pe + gie);
                    const float ed = exp2f(de - gie);
                    const float kd = ki * ed;
                    dgam[e] = dqg * (qi * eg) + dkbg * (kbi * eg) + qi * sq + kbi * sm - ki * sg - dkd * kd;
                    const float dkb = eg * dkbg + sm;
                    dqo[e] = eg * dqg + sq + daii * ki;
                    dko[e] = ed * dkd + sg + daii * qi + dkb * ld(b, orow + e);
                    st(db_out, orow + e, dkb * ki);
                }
                g2g3_st2(gw, dgam[0], dgam[1]);
                g2g3_st2(dq_s + orow, dqo[0], dqo[1]);
                g2g3_st2(dk_s + orow, dko[0], dko[1]);
            }
        }
    }
    __syncthreads();
    // 7. dg (g2b_grad2's, with the block-relative Gam).
    if (tid < dk) {
        const int x = tid;
        float ex = 0.f;
        for (int i = 0; i < l; ++i) {
            const int o = i * dk + x;
            const float ed = exp2f(sDl[(i >> 4) * dk + x] - sG[o]);
            ex += gKd[o] * (sK[o] * ed);
        }
        float acc = sEl[x] * sSD[x] + ex;
        for (int i = l - 1; i >= 0; --i) {
            acc += gWm[i * dk + x];
            dg_out[((t0 + i) * hv_n + j) * (i64)dk + x] = acc;
        }
    }
}

#define G2B_GRAD3(TQ, T, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 1)                                                   \
        g2b_grad3_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,           \
                      const T* d_o, const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv,      \
                      float scale, const float* ws_h, const float* ws_d, const float* ws_dh,                  \
                      const float* ws_dd, const float* ws_t, float* ws_g, float* dq_s, float* dk_s,           \
                      T* dv_out, T* dw_out, float* dg_out, T* db_out) {                                       \
        g2b_grad3<TQ, T>(q, k, v, g, b, w, d_o, ch_t0, ch_len, hk, hv, dk, dv, scale, ws_h, ws_d, ws_dh,      \
                         ws_dd, ws_t, ws_g, dq_s, dk_s, dv_out, dw_out, dg_out, db_out);                      \
    }

G2B_GRAD3(bf16_t, bf16_t, bf16)
G2B_GRAD3(float, bf16_t, bf16n)
// =============================================================================================
// Backward v4's gradient kernel (opt-in GDN_RULE2_BWD=v4; module gdn2_rule_tc only;
// bench/notes/h-g2g4.md). v3's math (the same workspaces, the same per-16-row-block Gam and
// constants, the same epilogue formulas) rebuilt around bf16 tensor cores fed from shared memory:
//
//   - every block product is mma.sync m16n8k16 bf16 (fp32 accumulation) with ldmatrix operands
//     from bf16 tiles (row stride 136 / 72 elements: conflict-free), instead of g2b_mm_tc's
//     per-element staging of fp32 operands read from global memory through lambdas;
//   - the operands are staged once, vectorized: phase A (D, dD, dO, W*V, S0, dS1 as bf16, and
//     <S0_c, dS1_c> from the same fp32 loads), then phase C (Q, K, B, Gam) in the same region;
//   - the diagonal 16x16 blocks of the Gram step on tensor cores too, through the block's middle
//     row m = 16 I + 7 (e^(Gam_i - Gam_j) = 2^(Gr_i - Gr_m) 2^(Gr_m - Gr_j)), where every
//     block's decay is at most 2^64 per channel (|Gr_{16I+15}| <= 64, every factor in
//     [2^-64, 2^64]: no overflow, no underflow); otherwise (strong gates) v3's elementwise sums;
//   - dA and dM stored with their upper triangle and diagonal zeroed (the Gram step's masks come
//     free), dA_ii kept apart in fp32;
//   - dg's reverse cumulative sum in registers (shuffles over the warp's rows), no scratch.
//
// Numerics: the operands of every product are bf16 (FLA's chunk kernels' choice), accumulation
// fp32; Gam (f64 sums, f32 in base 2), the exponentials and the epilogue fp32. Fixed orders, no
// atomics: bitwise reproducible. Dk, Dv multiples of 16 (else v3).
//
// Warp tiling of the block products: warp w owns the 16-row tile (w & 3) and the 16-column pairs
// (w >> 2), (w >> 2) + 2, ... of the output. Gram step and epilogue: warp w owns the 8-channel
// tiles nt = w, w + 8, ... (all 64 rows), as v3.

// The largest decay (base 2) of one 16-row block for the diagonal blocks on tensor cores.
#ifndef G4_SAFE
#define G4_SAFE 64.0
#endif
#define G4_LD 136  // bf16 row stride of the [*][dk] and [*][dv] tiles (272 B)
#define G4_LS 72   // bf16 row stride of the [64][64] tiles (144 B)
#define G4_LG 136  // fp32 row stride of Gr and dKbg
// Shared memory (bytes): persistent part, then a region used by phase A, then by phase C.
#define G4_T 0
#define G4_DA (G4_T + 64 * G4_LS * 2)
#define G4_DM (G4_DA + 64 * G4_LS * 2)
#define G4_X (G4_DM + 64 * G4_LS * 2)
#define G4_WM (G4_X + 64 * G4_LS * 2)
#define G4_DAD (G4_WM + 64 * G4_LD * 2)
#define G4_SD (G4_DAD + 64 * 4)
#define G4_CO (G4_SD + 128 * 4)
#define G4_R (G4_CO + 15 * 128 * 4)
#define G4_TILE (64 * G4_LD * 2)  // 17408
#define G4_STILE (128 * G4_LD * 2)  // 34816
#define G4_SMEM (G4_R + 4 * G4_TILE + 2 * G4_STILE + 128 * 32 * 4)

__device__ __forceinline__ void g4_ldsm4t(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(g2f_saddr(p)));
}
__device__ __forceinline__ float g4_bf(const bf16_t* p) { return bf16_to_f32(*p); }

// A fragment (16 x 16) of A[m0.., k0..]: ATR = stored as [k][m] (lda: stored row stride).
template <bool ATR>
__device__ __forceinline__ void g4_fa(unsigned (&a)[4], const bf16_t* A, int lda, int m0, int k0) {
    const int lane = threadIdx.x & 31, q = lane >> 3;
    if (ATR)
        g4_ldsm4t(a, A + (k0 + (lane & 7) + ((q >> 1) << 3)) * lda + m0 + ((q & 1) << 3));
    else
        g2f_ldsm4(a, A + (m0 + (lane & 15)) * lda + k0 + ((lane >> 4) << 3));
}
// B fragments of two 8-column tiles (b[0], b[1] for columns n0.., b[2], b[3] for n0 + 8..) of
// B[k0.., n0..]: BTR = stored as [k][n], else as [n][k].
template <bool BTR>
__device__ __forceinline__ void g4_fb(unsigned (&b)[4], const bf16_t* B, int ldb, int k0, int n0) {
    const int lane = threadIdx.x & 31, q = lane >> 3;
    if (BTR)
        g4_ldsm4t(b, B + (k0 + (lane & 7) + ((q & 1) << 3)) * ldb + n0 + ((q >> 1) << 3));
    else
        g2f_ldsm4(b, B + (n0 + (lane & 7) + ((q >> 1) << 3)) * ldb + k0 + ((q & 1) << 3));
}
// acc[pp][h] += A[16 (w & 3).., :K] B[:K, 16 p + 8 h..] for the warp's column pairs
// p = (w >> 2) + 2 pp < np (MP of them at most).
template <int MP, bool ATR, bool BTR>
__device__ __forceinline__ void g4_mm(float (&acc)[MP][2][4], const bf16_t* A, int lda, const bf16_t* B, int ldb,
                                      int np, int K) {
    const int warp = threadIdx.x >> 5, m0 = 16 * (warp & 3), pb = warp >> 2;
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned a[4];
        g4_fa<ATR>(a, A, lda, m0, k0);
#pragma unroll
        for (int pp = 0; pp < MP; ++pp) {
            const int p = pb + 2 * pp;
            if (p < np) {
                unsigned b[4];
                g4_fb<BTR>(b, B, ldb, k0, 16 * p);
                g2f_mma(acc[pp][0], a, b[0], b[1]);
                g2f_mma(acc[pp][1], a, b[2], b[3]);
            }
        }
    }
}
template <int MP>
__device__ __forceinline__ void g4_zero(float (&acc)[MP][2][4]) {
#pragma unroll
    for (int pp = 0; pp < MP; ++pp)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[pp][h][e] = 0.f;
}
// Calls f(i, c, v0, v1) for the warp's accumulator pairs: row i, columns c, c + 1.
template <int MP, class F>
__device__ __forceinline__ void g4_each(const float (&acc)[MP][2][4], int np, F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = 16 * (warp & 3) + (lane >> 2), c0 = 2 * (lane & 3), pb = warp >> 2;
#pragma unroll
    for (int pp = 0; pp < MP; ++pp) {
        const int p = pb + 2 * pp;
        if (p < np) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
                    f(r0 + 8 * hr, 16 * p + 8 * h + c0, acc[pp][h][2 * hr], acc[pp][h][2 * hr + 1]);
        }
    }
}
// B fragment (16 x 8) built from per-element values: b0 = (k 2t, 2t + 1), b1 = (k 2t + 8, 2t + 9)
// of column g; f(k) gives B[k][g].
// Split in two (hi = the bf16 rounding, lo = the bf16 rounding of the rest: ~2^-17 relative
// together): {hi b0, hi b1, lo b0, lo b1}.
template <class F>
__device__ __forceinline__ void g4_fb_elem(unsigned (&b)[4], F f) {
    const int t = threadIdx.x & 3;
    float x[4] = {f(2 * t), f(2 * t + 1), f(2 * t + 8), f(2 * t + 9)}, r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = x[u] - bf16_to_f32(f32_to_bf16(x[u]));
    b[0] = g2f_pack(x[0], x[1]);
    b[1] = g2f_pack(x[2], x[3]);
    b[2] = g2f_pack(r[0], r[1]);
    b[3] = g2f_pack(r[2], r[3]);
}
// c += a (b_hi + b_lo): the small part first.
__device__ __forceinline__ void g4_mma2(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[4]) {
    g2f_mma(c, a, b[2], b[3]);
    g2f_mma(c, a, b[0], b[1]);
}

// N float4 values one thread stages for one element group.
template <int N>
struct G4R4 {
    float4 v[N];
};
// Staging in batches of 4 element groups per thread (e = tid + 256 m < n), every load of a batch
// (ld(e) -> G4R4) issued before its first store (st(e, r)): one memory latency per batch.
template <class L, class S>
__device__ __forceinline__ void g4_stage(int n, L ld, S st) {
    for (int e0 = threadIdx.x; e0 < n; e0 += 4 * G2C_NT) {
        decltype(ld(0)) r[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (e0 + u * G2C_NT < n) r[u] = ld(e0 + u * G2C_NT);
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (e0 + u * G2C_NT < n) st(e0 + u * G2C_NT, r[u]);
    }
}

// WS: the storage of h, D, dh, dD (fp32: g2b_grad4_*, after g2c_scan / g2b_dscan*p; bf16:
// g2b_grad4w_*, backward v5's g2f_hrec8 / g2b_dscan8).
template <typename TQ, typename T, typename WS>
__device__ void g2b_grad4(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                          const float* __restrict__ g, const T* __restrict__ b, const T* __restrict__ w,
                          const T* __restrict__ d_o, const i64* __restrict__ ch_t0, const int* __restrict__ ch_len,
                          int hk_n, int hv_n, int dk, int dv, float scale, const WS* __restrict__ ws_h,
                          const WS* __restrict__ ws_d, const WS* __restrict__ ws_dh,
                          const WS* __restrict__ ws_dd, const float* __restrict__ ws_t, float* ws_g,
                          float* __restrict__ dq_s, float* __restrict__ dk_s, T* __restrict__ dv_out,
                          T* __restrict__ dw_out, float* __restrict__ dg_out, T* __restrict__ db_out) {
    extern __shared__ __align__(16) float g2c_sm[];
    unsigned char* sm = reinterpret_cast<unsigned char*>(g2c_sm);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g8 = lane >> 2, t4 = lane & 3;
    const i64 cj = blockIdx.x;
    const i64 c = cj / hv_n;
    const int j = (int)(cj % hv_n);
    const int kh = j / (hv_n / hk_n);
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    bf16_t* sT = reinterpret_cast<bf16_t*>(sm + G4_T);
    bf16_t* sDA = reinterpret_cast<bf16_t*>(sm + G4_DA);
    bf16_t* sDM = reinterpret_cast<bf16_t*>(sm + G4_DM);
    bf16_t* sX = reinterpret_cast<bf16_t*>(sm + G4_X);
    bf16_t* sWm = reinterpret_cast<bf16_t*>(sm + G4_WM);
    float* sDAd = reinterpret_cast<float*>(sm + G4_DAD);
    float* sSD = reinterpret_cast<float*>(sm + G4_SD);
    float* sP = reinterpret_cast<float*>(sm + G4_CO);  // [4][128] P_I (base 2)
    float* sDl = sP + 4 * 128;                          // [4][128] Gam_63 - P_I (base 2)
    float* sCc = sDl + 4 * 128;                         // [6][128] c_IJ, pair I (I - 1) / 2 + J
    float* sEl = sCc + 6 * 128;                         // [128] e^Gam_63
    unsigned char* R = sm + G4_R;
    // Phase A tiles.
    bf16_t* sD = reinterpret_cast<bf16_t*>(R);
    bf16_t* sDD = reinterpret_cast<bf16_t*>(R + G4_TILE);
    bf16_t* sO = reinterpret_cast<bf16_t*>(R + 2 * G4_TILE);
    bf16_t* sWv = reinterpret_cast<bf16_t*>(R + 3 * G4_TILE);
    bf16_t* sS0 = reinterpret_cast<bf16_t*>(R + 4 * G4_TILE);
    bf16_t* sS1 = reinterpret_cast<bf16_t*>(R + 4 * G4_TILE + G4_STILE);
    float* sSDp = reinterpret_cast<float*>(R + 4 * G4_TILE + 2 * G4_STILE);
    // Phase C tiles (the same region).
    bf16_t* sQ = reinterpret_cast<bf16_t*>(R);
    bf16_t* sK = reinterpret_cast<bf16_t*>(R + G4_TILE);
    bf16_t* sB = reinterpret_cast<bf16_t*>(R + 2 * G4_TILE);
    bf16_t* sKbg = reinterpret_cast<bf16_t*>(R + 3 * G4_TILE);
    float* sG = reinterpret_cast<float*>(R + 4 * G4_TILE);                 // Gr [64][G4_LG]
    float* sKBG = reinterpret_cast<float*>(R + 4 * G4_TILE + G4_STILE);    // dKbg [64][G4_LG]
    const int ck = G2C_C * dk;
    float* gKd = ws_g + cj * 2 * (i64)ck;
    float* gQg = gKd + ck;
    const i64 sn = (i64)dk * dv;
    const WS* S0 = ws_h + cj * sn;
    const WS* dS1 = ws_dh + cj * sn;
    const WS* Dm = ws_d + cj * G2C_C * (i64)dv;
    const WS* dDm = ws_dd + cj * G2C_C * (i64)dv;
    const i64 vrow = (t0 * hv_n + j) * (i64)dv;
    const i64 vstride = (i64)hv_n * dv;
    const int v4 = dv / 4;

    // ---- Phase A staging: D, dD, dO, W * V, T, S0, dS1 as bf16; <S0_c, dS1_c> partials.
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
    g4_stage(
        G2C_C * v4,
        [&](int e) {
            const int i = e / v4, y = 4 * (e - i * v4);
            G4R4<5> r;
            r.v[0] = g2p8_ld4(Dm, (i64)i * dv + y);
            r.v[1] = g2p8_ld4(dDm, (i64)i * dv + y);
            r.v[2] = r.v[3] = r.v[4] = z4;
            if (i < l) {
                const i64 off = vrow + i * vstride + y;
                r.v[2] = g2p8_ld4(d_o, off);
                r.v[3] = g2p8_ld4(w, off);
                r.v[4] = g2p8_ld4(v, off);
            }
            return r;
        },
        [&](int e, const G4R4<5>& r) {
            const int i = e / v4, y = 4 * (e - i * v4);
            g2p8_st4(sD, i * G4_LD + y, r.v[0]);
            g2p8_st4(sDD, i * G4_LD + y, r.v[1]);
            g2p8_st4(sO, i * G4_LD + y, r.v[2]);
            g2p8_st4(sWv, i * G4_LD + y, g2p8_mul4(r.v[3], r.v[4]));
        });
    g4_stage(
        dk * v4,
        [&](int e) {
            const int x = e / v4, y = 4 * (e - x * v4);
            G4R4<2> r;
            r.v[0] = g2p8_ld4(S0, (i64)x * dv + y);
            r.v[1] = g2p8_ld4(dS1, (i64)x * dv + y);
            return r;
        },
        [&](int e, const G4R4<2>& r) {
            const int x = e / v4, y = 4 * (e - x * v4);
            const float4 a = r.v[0], c = r.v[1];
            g2p8_st4(sS0, x * G4_LD + y, a);
            g2p8_st4(sS1, x * G4_LD + y, c);
            sSDp[e] = a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w;
        });
    {
        const float* tg = ws_t + cj * G2C_C * G2C_C;
        for (int e = tid; e < G2C_C * G2C_C / 4; e += G2C_NT) {
            const int i = e >> 4, r = 4 * (e & 15);
            g2p8_st4(sT, i * G4_LS + r, g2p8_ld4(tg, (i64)4 * e));
        }
    }
    __syncthreads();

    // ---- Phase A products (K = dv), and dWv = T^T dD.
    const int npk = dk / 16, npv = dv / 16;
    float accT[2][2][4];  // dT = dD (W V)^T, then += dWm Kbg^T (phase B)
    {
        float acc[4][2][4];
        // dQg = scale dO S0^T -> global scratch.
        g4_zero(acc);
        g4_mm<4, false, false>(acc, sO, G4_LD, sS0, G4_LD, npk, dv);
        g4_each(acc, npk, [&](int i, int x, float a0, float a1) {
            g2g3_st2(gQg + i * dk + x, scale * a0, scale * a1);
        });
        // dWm = -dD S0^T -> bf16 tile.
        g4_zero(acc);
        g4_mm<4, false, false>(acc, sDD, G4_LD, sS0, G4_LD, npk, dv);
        g4_each(acc, npk, [&](int i, int x, float a0, float a1) { g2p8_st2(sWm, i * G4_LD + x, -a0, -a1); });
        // dKd = D dS1^T -> global scratch.
        g4_zero(acc);
        g4_mm<4, false, false>(acc, sD, G4_LD, sS1, G4_LD, npk, dv);
        g4_each(acc, npk, [&](int i, int x, float a0, float a1) { g2g3_st2(gKd + i * dk + x, a0, a1); });
        // dWv = T^T dD: dw = dWv * v, dv = dWv * w (valid rows).
        g4_zero(acc);
        g4_mm<4, true, true>(acc, sT, G4_LS, sDD, G4_LD, npv, G2C_C);
        g4_each(acc, npv, [&](int i, int y, float a0, float a1) {
            if (i < l) {
                const i64 o = vrow + i * vstride + y;
                st(dw_out, o, a0 * ld(v, o));
                st(dw_out, o + 1, a1 * ld(v, o + 1));
                st(dv_out, o, a0 * ld(w, o));
                st(dv_out, o + 1, a1 * ld(w, o + 1));
            }
        });
    }
    {
        // dA = scale dO D^T: strictly lower part as bf16, the diagonal fp32.
        float acc[2][2][4];
        g4_zero(acc);
        g4_mm<2, false, false>(acc, sO, G4_LD, sD, G4_LD, 4, dv);
        g4_each(acc, 4, [&](int i, int jj, float a0, float a1) {
            a0 *= scale;
            a1 *= scale;
            if (jj == i) sDAd[i] = a0;
            if (jj + 1 == i) sDAd[i] = a1;
            g2p8_st2(sDA, i * G4_LS + jj, jj < i ? a0 : 0.f, jj + 1 < i ? a1 : 0.f);
        });
        g4_zero(accT);
        g4_mm<2, false, false>(accT, sDD, G4_LD, sWv, G4_LD, 4, dv);
    }
    if (tid < dk) {
        float sd = 0.f;
        for (int y = 0; y < v4; ++y) sd += sSDp[tid * v4 + y];
        sSD[tid] = sd;
    }
    __syncthreads();  // the region is free

    // ---- Phase C staging: Q, K, B as bf16, g (fp32) into sG; Gam per 16-row block in place.
    {
        const int k4 = dk / 4;
        g4_stage(
            G2C_C * k4,
            [&](int e) {
                const int i = e / k4, x = 4 * (e - i * k4);
                G4R4<4> r;
                r.v[0] = r.v[1] = r.v[2] = r.v[3] = z4;
                if (i < l) {
                    const i64 t = t0 + i;
                    const i64 kr = (t * hk_n + kh) * dk + x, vr = (t * hv_n + j) * dk + x;
                    r.v[0] = g2p8_ld4(q, kr);
                    r.v[1] = g2p8_ld4(k, kr);
                    r.v[2] = g2p8_ld4(b, vr);
                    r.v[3] = g2p8_ld4(g, vr);
                }
                return r;
            },
            [&](int e, const G4R4<4>& r) {
                const int i = e / k4, x = 4 * (e - i * k4);
                g2p8_st4(sQ, i * G4_LD + x, r.v[0]);
                g2p8_st4(sK, i * G4_LD + x, r.v[1]);
                g2p8_st4(sB, i * G4_LD + x, r.v[2]);
                *reinterpret_cast<float4*>(sG + i * G4_LG + x) = r.v[3];
            });
    }
    __syncthreads();
    int ok = 1;
    if (tid < dk) {
        const int x = tid;
        double P[5];
        P[0] = 0.0;
#pragma unroll
        for (int I = 0; I < 4; ++I) {
            double acc = 0.0;
            for (int il = 0; il < 16; ++il) {
                const int i = 16 * I + il;
                acc += (double)sG[i * G4_LG + x];  // rows >= l hold 0
                sG[i * G4_LG + x] = (float)(acc * G2G3_L2E);
            }
            P[I + 1] = P[I] + acc;
            if (!(acc * G2G3_L2E >= -G4_SAFE)) ok = 0;
        }
#pragma unroll
        for (int I = 0; I < 4; ++I) {
            sP[I * 128 + x] = (float)(P[I] * G2G3_L2E);
            sDl[I * 128 + x] = (float)((P[4] - P[I]) * G2G3_L2E);
        }
#pragma unroll
        for (int I = 1; I < 4; ++I)
#pragma unroll
            for (int J = 0; J < I; ++J)
                sCc[(I * (I - 1) / 2 + J) * 128 + x] =
                    (J == I - 1) ? 1.f : exp2f((float)((P[I] - P[J + 1]) * G2G3_L2E));
        sEl[x] = exp2f((float)(P[4] * G2G3_L2E));
    }
    const bool safe = !__syncthreads_or(!ok);
    // Kbg = B K e^Gam (bf16), the B operand of dT += dWm Kbg^T.
    for (int e = tid; e < ck; e += G2C_NT) {
        const int i = e / dk, x = e - i * dk;
        sKbg[i * G4_LD + x] = f32_to_bf16(g4_bf(sB + i * G4_LD + x) * g4_bf(sK + i * G4_LD + x) *
                                          exp2f(sP[(i >> 4) * 128 + x] + sG[i * G4_LG + x]));
    }
    __syncthreads();

    // ---- Phase B: dT += dWm Kbg^T -> sX; dKbg = T^T dWm -> sKBG; X = T^T dT; dM = -X T^T.
    g4_mm<2, false, false>(accT, sWm, G4_LD, sKbg, G4_LD, 4, dk);
    g4_each(accT, 4, [&](int i, int jj, float a0, float a1) { g2p8_st2(sX, i * G4_LS + jj, a0, a1); });
    {
        float acc[4][2][4];
        g4_zero(acc);
        g4_mm<4, true, true>(acc, sT, G4_LS, sWm, G4_LD, npk, G2C_C);
        g4_each(acc, npk, [&](int i, int x, float a0, float a1) {
            *reinterpret_cast<float2*>(sKBG + i * G4_LG + x) = make_float2(a0, a1);
        });
    }
    __syncthreads();
    {
        float acc[2][2][4];
        g4_zero(acc);
        g4_mm<2, true, true>(acc, sT, G4_LS, sX, G4_LS, 4, G2C_C);
        __syncthreads();  // every read of dT is done
        g4_each(acc, 4, [&](int i, int jj, float a0, float a1) { g2p8_st2(sX, i * G4_LS + jj, a0, a1); });
        __syncthreads();
        g4_zero(acc);
        g4_mm<2, false, false>(acc, sX, G4_LS, sT, G4_LS, 4, G2C_C);
        g4_each(acc, 4, [&](int i, int jj, float a0, float a1) {
            g2p8_st2(sDM, i * G4_LS + jj, jj < i ? -a0 : 0.f, jj + 1 < i ? -a1 : 0.f);
        });
    }
    __syncthreads();

    // ---- Phase C: the Gram step by 16-row blocks and the epilogue, per 8-channel tile.
    for (int nt = warp; nt < dk / 8; nt += G2C_NT / 32) {
        const int xn = 8 * nt + g8;      // this lane's B-fragment channel
        const int xa = 8 * nt + 2 * t4;  // this lane's C-fragment channels xa, xa + 1
        auto G = [&](int r, int x) { return sG[r * G4_LG + x]; };
        auto Kf = [&](int r, int x) { return g4_bf(sK + r * G4_LD + x); };
        auto Qf = [&](int r, int x) { return g4_bf(sQ + r * G4_LD + x); };
        auto Kbf = [&](int r, int x) { return g4_bf(sB + r * G4_LD + x) * g4_bf(sK + r * G4_LD + x); };
        float aq[3][4], am[3][4], ag[3][4];
#pragma unroll
        for (int u = 0; u < 3; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) aq[u][e] = am[u][e] = ag[u][e] = 0.f;
        // (a) dQa_I, dKbm_I below the diagonal blocks: B = Kdn_J.
#pragma unroll
        for (int J = 0; J < 3; ++J) {
            const float gend = G(16 * J + 15, xn);
            unsigned bk[4];
            g4_fb_elem(bk, [&](int kk) {
                const int r = 16 * J + kk;
                return Kf(r, xn) * g2b_ex2(gend - G(r, xn));
            });
#pragma unroll
            for (int I = J + 1; I < 4; ++I) {
                float tq[4] = {0.f, 0.f, 0.f, 0.f}, tm[4] = {0.f, 0.f, 0.f, 0.f};
                unsigned a[4];
                g4_fa<false>(a, sDA, G4_LS, 16 * I, 16 * J);
                g4_mma2(tq, a, bk);
                g4_fa<false>(a, sDM, G4_LS, 16 * I, 16 * J);
                g4_mma2(tm, a, bk);
                const float c0 = sCc[(I * (I - 1) / 2 + J) * 128 + xa], c1 = sCc[(I * (I - 1) / 2 + J) * 128 + xa + 1];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float ce = (e & 1) ? c1 : c0;
                    aq[I - 1][e] = fmaf(ce, tq[e], aq[I - 1][e]);
                    am[I - 1][e] = fmaf(ce, tm[e], am[I - 1][e]);
                }
            }
        }
        // (b) dKg_J: B = Qup_I, Kbup_I; A = dA_IJ^T, dM_IJ^T.
#pragma unroll
        for (int I = 1; I < 4; ++I) {
            unsigned qb[4], kb[4];
            g4_fb_elem(qb, [&](int kk) { return Qf(16 * I + kk, xn) * g2b_ex2(G(16 * I + kk, xn)); });
            g4_fb_elem(kb, [&](int kk) { return Kbf(16 * I + kk, xn) * g2b_ex2(G(16 * I + kk, xn)); });
#pragma unroll
            for (int J = 0; J < I; ++J) {
                float tg[4] = {0.f, 0.f, 0.f, 0.f};
                unsigned a[4];
                g4_fa<true>(a, sDA, G4_LS, 16 * J, 16 * I);
                g4_mma2(tg, a, qb);
                g4_fa<true>(a, sDM, G4_LS, 16 * J, 16 * I);
                g4_mma2(tg, a, kb);
                const float c0 = sCc[(I * (I - 1) / 2 + J) * 128 + xa], c1 = sCc[(I * (I - 1) / 2 + J) * 128 + xa + 1];
#pragma unroll
                for (int e = 0; e < 4; ++e) ag[J][e] = fmaf((e & 1) ? c1 : c0, tg[e], ag[J][e]);
            }
        }
        // (c) per block I: the diagonal block's sums, the combination, the epilogue.
        float dgam[8][2], exv[2] = {0.f, 0.f};
#pragma unroll
        for (int I = 0; I < 4; ++I) {
            float gi[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) gi[h][e] = G(16 * I + g8 + 8 * h, xa + e);
            float dqa[2][2], dkbm[2][2], dkg[2][2];
            if (safe) {
                // Through the middle row m: Kdn' = K 2^(Gr_m - Gr), Qup' = Q 2^(Gr - Gr_m).
                const int m = 16 * I + 7;
                const float gmn = G(m, xn);
                unsigned kd[4], qu[4], ku[4];
                g4_fb_elem(kd, [&](int kk) { return Kf(16 * I + kk, xn) * g2b_ex2(gmn - G(16 * I + kk, xn)); });
                g4_fb_elem(qu, [&](int kk) { return Qf(16 * I + kk, xn) * g2b_ex2(G(16 * I + kk, xn) - gmn); });
                g4_fb_elem(ku, [&](int kk) { return Kbf(16 * I + kk, xn) * g2b_ex2(G(16 * I + kk, xn) - gmn); });
                float tq[4] = {0.f, 0.f, 0.f, 0.f}, tm[4] = {0.f, 0.f, 0.f, 0.f}, tg[4] = {0.f, 0.f, 0.f, 0.f};
                unsigned a[4];
                g4_fa<false>(a, sDA, G4_LS, 16 * I, 16 * I);
                g4_mma2(tq, a, kd);
                g4_fa<false>(a, sDM, G4_LS, 16 * I, 16 * I);
                g4_mma2(tm, a, kd);
                g4_fa<true>(a, sDA, G4_LS, 16 * I, 16 * I);
                g4_mma2(tg, a, qu);
                g4_fa<true>(a, sDM, G4_LS, 16 * I, 16 * I);
                g4_mma2(tg, a, ku);
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float gm = G(m, xa + e);
                        const float eu = g2b_ex2(gi[h][e] - gm), ed = g2b_ex2(gm - gi[h][e]);
                        dqa[h][e] = eu * tq[2 * h + e];
                        dkbm[h][e] = eu * tm[2 * h + e];
                        dkg[h][e] = ed * tg[2 * h + e];
                    }
            } else {
                // v3's elementwise sums (every exponent <= 0).
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e) dqa[h][e] = dkbm[h][e] = dkg[h][e] = 0.f;
                for (int jl = 0; jl < 16; ++jl) {
                    const int r = 16 * I + jl;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int il = g8 + 8 * h, i = 16 * I + il;
                        const bool below = jl < il, above = jl > il;
                        const float da_ij = g4_bf(sDA + i * G4_LS + r), dm_ij = g4_bf(sDM + i * G4_LS + r);
                        const float da_ri = g4_bf(sDA + r * G4_LS + i), dm_ri = g4_bf(sDM + r * G4_LS + i);
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float grv = G(r, xa + e);
                            const float ex = g2b_ex2(below ? gi[h][e] - grv : grv - gi[h][e]);
                            const float ek = below ? ex * Kf(r, xa + e) : 0.f;
                            const float eq = above ? ex : 0.f;
                            dqa[h][e] = fmaf(da_ij, ek, dqa[h][e]);
                            dkbm[h][e] = fmaf(dm_ij, ek, dkbm[h][e]);
                            dkg[h][e] = fmaf(eq, da_ri * Qf(r, xa + e) + dm_ri * Kbf(r, xa + e), dkg[h][e]);
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 16 * I + g8 + 8 * h;
                if (i >= l) {
                    dgam[2 * I + h][0] = dgam[2 * I + h][1] = 0.f;
                    continue;
                }
                const float2 kd2 = g2g3_ld2(gKd + i * dk + xa), qg2 = g2g3_ld2(gQg + i * dk + xa);
                const float2 kbg2 = g2g3_ld2(sKBG + i * G4_LG + xa);
                const float daii = sDAd[i];
                const i64 orow = ((t0 + i) * hv_n + j) * (i64)dk + xa;
                float dqo[2], dko[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int x = xa + e;
                    const float gie = gi[h][e];
                    const float qi = Qf(i, x), ki = Kf(i, x), bi = g4_bf(sB + i * G4_LD + x), kbi = bi * ki;
                    const float ge = G(16 * I + 15, x), pe = sP[I * 128 + x], de = sDl[I * 128 + x];
                    const float dkd = e ? kd2.y : kd2.x, dqg = e ? qg2.y : qg2.x, dkbg = e ? kbg2.y : kbg2.x;
                    float sq = dqa[h][e], smm = dkbm[h][e], sg = dkg[h][e];
                    if (I > 0) {
                        const float eu = g2b_ex2(gie);
                        sq = fmaf(eu, aq[I > 0 ? I - 1 : 0][2 * h + e], sq);
                        smm = fmaf(eu, am[I > 0 ? I - 1 : 0][2 * h + e], smm);
                    }
                    if (I < 3) sg = fmaf(g2b_ex2(ge - gie), ag[I < 3 ? I : 0][2 * h + e], sg);
                    const float eg = exp2f(pe + gie);
                    const float ed = exp2f(de - gie);
                    const float kd = ki * ed;
                    dgam[2 * I + h][e] =
                        dqg * (qi * eg) + dkbg * (kbi * eg) + qi * sq + kbi * smm - ki * sg - dkd * kd;
                    exv[e] += dkd * kd;
                    const float dkb = eg * dkbg + smm;
                    dqo[e] = eg * dqg + sq + daii * ki;
                    dko[e] = ed * dkd + sg + daii * qi + dkb * bi;
                    st(db_out, orow + e, dkb * ki);
                }
                g2g3_st2(dq_s + orow, dqo[0], dqo[1]);
                g2g3_st2(dk_s + orow, dko[0], dko[1]);
            }
        }
        // dg = e^Gam_63 <S0_c, dS1_c> + sum_i dKd_i Kd_i + (reverse cumulative sum of dGam),
        // rows 8 s + g8 (s = 2 I + h) of channels xa, xa + 1, in registers.
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float ex = exv[e];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) ex += __shfl_xor_sync(0xffffffffu, ex, o);
            const float cst = sEl[xa + e] * sSD[xa + e] + ex;
            float suf = 0.f;
#pragma unroll
            for (int s = 7; s >= 0; --s) {
                float x = dgam[s][e];
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) {
                    const float y = __shfl_down_sync(0xffffffffu, x, 4 * o);
                    if (g8 + o < 8) x += y;
                }
                const float tot = __shfl_sync(0xffffffffu, x, t4);
                const int i = 8 * s + g8;
                if (i < l) dg_out[((t0 + i) * hv_n + j) * (i64)dk + xa + e] = x + suf + cst;
                suf += tot;
            }
        }
    }
}

#define G2B_GRAD4(NAME, TQ, T, WS, S)                                                                         \
    extern "C" __global__ void __launch_bounds__(G2C_NT, 1)                                                   \
        NAME##_##S(const TQ* q, const TQ* k, const T* v, const float* g, const T* b, const T* w,              \
                   const T* d_o, const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv,         \
                   float scale, const WS* ws_h, const WS* ws_d, const WS* ws_dh, const WS* ws_dd,             \
                   const float* ws_t, float* ws_g, float* dq_s, float* dk_s, T* dv_out, T* dw_out,            \
                   float* dg_out, T* db_out) {                                                                \
        g2b_grad4<TQ, T, WS>(q, k, v, g, b, w, d_o, ch_t0, ch_len, hk, hv, dk, dv, scale, ws_h, ws_d, ws_dh,  \
                             ws_dd, ws_t, ws_g, dq_s, dk_s, dv_out, dw_out, dg_out, db_out);                  \
    }

G2B_GRAD4(g2b_grad4, bf16_t, bf16_t, float, bf16)
G2B_GRAD4(g2b_grad4, float, bf16_t, float, bf16n)
G2B_GRAD4(g2b_grad4w, bf16_t, bf16_t, bf16_t, bf16)
G2B_GRAD4(g2b_grad4w, float, bf16_t, bf16_t, bf16n)

// =============================================================================================
// Backward v5 (opt-in GDN_RULE2_BWD=v5; bench/notes/h-g2g4.md): the recompute and the reverse
// scan on bf16 tensor cores too, every workspace the gradient kernel reads in bf16:
//   g2c_prep8ht  g2c_prep8h (Wm, Qg, Kd^T, A bf16; U, e^Gam_L fp32) writing T (fp32)
//   g2f_hrec8    g2f_fwd8 with HREC: h[c] = S0 and D stored (bf16), no output
//   g2b_dscan8   below: dh[c] = dS1 and dD stored (bf16), dh0 (fp32)
//   g2b_grad4w   g2b_grad4 reading h, D, dh, dD in bf16 (its tiles were bf16 already)
//
// g2b_dscan8: g2f_fwd8's design run backwards. Per (sequence, value head, V tile of BV = 16 NW
// state columns), NW warps; warp w keeps dS^T for the tile's columns 16 w .. 16 w + 15 (16 x DK,
// fp32) in registers as m16n8 accumulator fragments (ds[nt][c] = dS[8 nt + 2t + (c & 1)][column
// g + 8 (c >> 1)]). Chunks in reverse; per chunk (operands in shared memory, the chunk NS - 1
// steps later in flight by cp.async; the dO tile's rows >= l zero-filled):
//   dh[c] = dS1                                   (stored, bf16)
//   dD^T  = dS1^T Kd^T + scale dO^T A   (16 x 64) (stored, bf16; then bf16 A fragments)
//   dS^T <- dS1^T diag(e^Gam_L) + scale dO^T Qg - dD^T Wm
// A fragments of dS1^T from the accumulators (as g2f_fwd8's S0^T), of dO^T by ldmatrix.trans of
// the dO tile; B operands by ldmatrix.trans of Kd^T, A, Qg, Wm (stored [k][n]); A's 16 x 16
// blocks above the diagonal skipped. Rows >= l of Kd, A, Qg, Wm are zero (prep), so dD's are.
// Numerics: state fp32; operands bf16; fixed orders, no atomics.
template <int DK, int NW>
struct G2D8 {
    static constexpr int BV = 16 * NW;
    static constexpr int NT = 32 * NW;
    static constexpr int LK = DK + 8;     // bf16 row stride of Qg, Wm
    static constexpr int LT = G2C_C + 8;  // bf16 row stride of Kd^T and A
    static constexpr int LO = BV + 8;     // bf16 row stride of the dO tile
    static constexpr int KT_OFF = 0;
    static constexpr int A_OFF = KT_OFF + DK * LT * 2;
    static constexpr int QG_OFF = A_OFF + G2C_C * LT * 2;
    static constexpr int WM_OFF = QG_OFF + G2C_C * LK * 2;
    static constexpr int O_OFF = WM_OFF + G2C_C * LK * 2;
    static constexpr int E_OFF = O_OFF + G2C_C * LO * 2;
    static constexpr int STAGE = E_OFF + DK * 4;
};

// cp.async of 16 bytes, zero-filled (nothing read) where !valid.
__device__ __forceinline__ void g2d8_cp16z(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// One chunk's operands into a stage (all NT threads, one cp.async group): Kd^T [DK][64], A
// [64][64], Qg, Wm [64][DK] (bf16, contiguous per chunk-head), the dO tile [64][BV] (bf16, row
// stride ostride from orow0; rows >= l zero) and e^Gam_L [DK] (fp32).
template <int DK, int NW>
__device__ __forceinline__ void g2d8_load(char* st, const bf16_t* kt, const bf16_t* a, const bf16_t* qg,
                                          const bf16_t* wm, const float* egl, const bf16_t* d_o, i64 orow0,
                                          i64 ostride, int l) {
    typedef G2D8<DK, NW> L;
    const int tid = threadIdx.x;
    const unsigned sb = g2f_saddr(st);
    for (int e = tid; e < DK * 8; e += L::NT) {
        const int r = e >> 3, x = (e & 7) * 8;
        g2f_cp16(sb + L::KT_OFF + (unsigned)((r * L::LT + x) * 2), kt + r * G2C_C + x);
    }
    for (int e = tid; e < G2C_C * 8; e += L::NT) {
        const int r = e >> 3, x = (e & 7) * 8;
        g2f_cp16(sb + L::A_OFF + (unsigned)((r * L::LT + x) * 2), a + r * G2C_C + x);
    }
    constexpr int PK = DK / 8;
    for (int e = tid; e < G2C_C * PK; e += L::NT) {
        const int r = e / PK, x = (e % PK) * 8;
        g2f_cp16(sb + L::QG_OFF + (unsigned)((r * L::LK + x) * 2), qg + r * DK + x);
        g2f_cp16(sb + L::WM_OFF + (unsigned)((r * L::LK + x) * 2), wm + r * DK + x);
    }
    constexpr int PO = L::BV / 8;
    for (int e = tid; e < G2C_C * PO; e += L::NT) {
        const int r = e / PO, x = (e % PO) * 8;
        const bool ok = r < l;
        g2d8_cp16z(sb + L::O_OFF + (unsigned)((r * L::LO + x) * 2), d_o + orow0 + (ok ? r : 0) * ostride + x, ok);
    }
    if (tid < DK / 4) g2f_cp16(sb + L::E_OFF + tid * 16, egl + tid * 4);
    g2f_commit();
}

// Grid: N * Hv * (dv / BV) CTAs of 32 NW threads; dynamic shared memory NS * G2D8<DK, NW>::STAGE
// (a launch with less writes nothing). Workspaces from g2c_prep8ht (chunk-head cb = chunk * Hv +
// value head); d_o [tokens][Hv][dv] bf16; dht, dh0 [N][Hv][DK][dv] fp32; dh_ws [cb][DK][dv],
// dd_ws [cb][64][dv] bf16.
template <int DK, int NW, int NS>
__device__ void g2b_dscan8(const bf16_t* __restrict__ kt_ws, const bf16_t* __restrict__ a_ws,
                           const bf16_t* __restrict__ qg_ws, const bf16_t* __restrict__ wm_ws,
                           const float* __restrict__ egl_ws, const bf16_t* __restrict__ d_o,
                           const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                           const int* __restrict__ ch_len, int hv_n, int dv, float scale,
                           const float* __restrict__ dht, bf16_t* __restrict__ dh_ws, bf16_t* __restrict__ dd_ws,
                           float* __restrict__ dh0) {
    typedef G2D8<DK, NW> L;
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    if (g2f_dyn_smem() < (unsigned)(NS * L::STAGE)) return;
    extern __shared__ __align__(16) float g2c_sm[];
    char* sm = reinterpret_cast<char*>(g2c_sm);
    const int nvt = dv / L::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 col0 = (i64)vt * L::BV;
    const int wc0 = 16 * warp;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 vrow = (i64)hv_n * dv;

    float ds[DK / 8][4];
    g2f_frags_ld(ds, dht ? dht + st_base + col0 + wc0 : nullptr, dv);

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1], nch = c_end - c_beg;
    auto issue = [&](i64 c, int stage) {
        const i64 cb = c * hv_n + hv;
        g2d8_load<DK, NW>(sm + stage * L::STAGE, kt_ws + cb * DK * G2C_C, a_ws + cb * G2C_C * G2C_C,
                          qg_ws + cb * G2C_C * DK, wm_ws + cb * G2C_C * DK, egl_ws + cb * DK, d_o,
                          ch_t0[c] * vrow + (i64)hv * dv + col0, vrow, ch_len[c]);
    };
    // Step u handles chunk c_end - 1 - u.
#pragma unroll
    for (int p = 0; p < NS - 1; ++p) {
        if (p < nch) issue(c_end - 1 - p, p);
        else g2f_commit();
    }
    for (i64 u = 0; u < nch; ++u) {
        const i64 c = c_end - 1 - u;
        const int stg = (int)(u % NS);
        g2f_wait<NS - 2>();
        __syncthreads();  // stage stg is complete for all; every warp is done with step u - 1's
        if (u + NS - 1 < nch) issue(c - (NS - 1), (int)((u + NS - 1) % NS));
        else g2f_commit();
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sKt = reinterpret_cast<const bf16_t*>(sp + L::KT_OFF);
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::QG_OFF);
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::WM_OFF);
        const bf16_t* sO = reinterpret_cast<const bf16_t*>(sp + L::O_OFF);
        const float* sE = reinterpret_cast<const float*>(sp + L::E_OFF);
        const i64 cb = c * hv_n + hv;

        // dh[c] = dS1 (bf16), and dS1^T as bf16 A fragments.
        g2f_frags_st(dh_ws + cb * (i64)DK * dv + col0 + wc0, ds, dv);
        unsigned sa[DK / 16][4];
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            sa[ks][0] = g2f_pack(ds[2 * ks][0], ds[2 * ks][1]);
            sa[ks][1] = g2f_pack(ds[2 * ks][2], ds[2 * ks][3]);
            sa[ks][2] = g2f_pack(ds[2 * ks + 1][0], ds[2 * ks + 1][1]);
            sa[ks][3] = g2f_pack(ds[2 * ks + 1][2], ds[2 * ks + 1][3]);
        }
        // dO^T as A fragments (k = chunk rows).
        unsigned oa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) g4_fa<true>(oa[kk], sO, L::LO, wc0, 16 * kk);
        // dD^T = dS1^T Kd^T + scale dO^T A by 16 chunk rows: stored, and as A fragments.
        unsigned da[4][4];
        bf16_t* dd = dd_ws + cb * (i64)G2C_C * dv + col0 + wc0 + g;
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
            float pr[2][2][4];  // dS1^T Kd^T, dO^T A (two n-tiles each)
            g4_zero(pr);
#pragma unroll
            for (int ks = 0; ks < DK / 16; ++ks) {
                unsigned bk[4];
                g4_fb<true>(bk, sKt, L::LT, 16 * ks, 16 * jp);
                g2f_mma(pr[0][0], sa[ks], bk[0], bk[1]);
                g2f_mma(pr[0][1], sa[ks], bk[2], bk[3]);
            }
#pragma unroll
            for (int kk = jp; kk < 4; ++kk) {
                unsigned ba[4];
                g4_fb<true>(ba, sA, L::LT, 16 * kk, 16 * jp);
                g2f_mma(pr[1][0], oa[kk], ba[0], ba[1]);
                g2f_mma(pr[1][1], oa[kk], ba[2], ba[3]);
            }
            float d[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    d[h][e] = pr[0][h][e] + scale * pr[1][h][e];
                    // (state column g + 8 (e >> 1), chunk row 16 jp + 8 h + 2t + (e & 1))
                    st(dd, (i64)(16 * jp + 8 * h + 2 * t + (e & 1)) * dv + 8 * (e >> 1), d[h][e]);
                }
            da[jp][0] = g2f_pack(d[0][0], d[0][1]);
            da[jp][1] = g2f_pack(d[0][2], d[0][3]);
            da[jp][2] = g2f_pack(d[1][0], d[1][1]);
            da[jp][3] = g2f_pack(d[1][2], d[1][3]);
        }
        // dS^T <- dS1^T diag(e^Gam_L) + scale dO^T Qg - dD^T Wm.
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt) {
            const float2 e = *reinterpret_cast<const float2*>(sE + 8 * nt + 2 * t);
            ds[nt][0] *= e.x;
            ds[nt][1] *= e.y;
            ds[nt][2] *= e.x;
            ds[nt][3] *= e.y;
        }
#pragma unroll
        for (int np = 0; np < DK / 16; ++np) {
            float pr[2][2][4];  // dO^T Qg, dD^T Wm (two n-tiles each)
            g4_zero(pr);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                unsigned bq[4], bw[4];
                g4_fb<true>(bq, sQ, L::LK, 16 * kk, 16 * np);
                g2f_mma(pr[0][0], oa[kk], bq[0], bq[1]);
                g2f_mma(pr[0][1], oa[kk], bq[2], bq[3]);
                g4_fb<true>(bw, sW, L::LK, 16 * kk, 16 * np);
                g2f_mma(pr[1][0], da[kk], bw[0], bw[1]);
                g2f_mma(pr[1][1], da[kk], bw[2], bw[3]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[2 * np + h][e] += scale * pr[0][h][e] - pr[1][h][e];
        }
    }
    if (dh0) g2f_frags_st(dh0 + st_base + col0 + wc0, ds, dv);
}

// g2b_dscan8{,s3}_d{DK}_w{NW}.
#define G2D8_ENTRY(NAME, NS, DK, NW)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) NAME##_d##DK##_w##NW(                            \
        const bf16_t* kt, const bf16_t* a, const bf16_t* qg, const bf16_t* wm, const float* egl,              \
        const bf16_t* d_o, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hv, int dv,            \
        float scale, const float* dht, bf16_t* dh_ws, bf16_t* dd_ws, float* dh0) {                            \
        g2b_dscan8<DK, NW, NS>(kt, a, qg, wm, egl, d_o, seq_ch, ch_t0, ch_len, hv, dv, scale, dht, dh_ws,     \
                               dd_ws, dh0);                                                                   \
    }

G2D8_ENTRY(g2b_dscan8, 2, 64, 1)
G2D8_ENTRY(g2b_dscan8, 2, 64, 2)
G2D8_ENTRY(g2b_dscan8, 2, 64, 4)
G2D8_ENTRY(g2b_dscan8, 2, 64, 8)
G2D8_ENTRY(g2b_dscan8, 2, 128, 1)
G2D8_ENTRY(g2b_dscan8, 2, 128, 2)
G2D8_ENTRY(g2b_dscan8, 2, 128, 4)
G2D8_ENTRY(g2b_dscan8, 2, 128, 8)
G2D8_ENTRY(g2b_dscan8s3, 3, 128, 1)
G2D8_ENTRY(g2b_dscan8s3, 3, 128, 2)

#endif  // G2B_TC_MODULE (backward v3's gradient kernel)
