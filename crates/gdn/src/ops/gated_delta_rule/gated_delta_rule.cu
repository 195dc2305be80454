// The chunked gated delta rule (GDN), forward and backward. f32 storage: fp32 FMAs throughout
// (the verification path). bf16 storage: the products run on tensor cores (mma.sync TF32,
// fp32 accumulation; states and workspaces stay fp32), see tile_mma and the scans.
//
// Same algorithm and notation as cpu.rs (chunk C = 64 rows, `gam` = cumsum of g inside the
// chunk, Gamma_ij = exp(gam_i - gam_j), `l` = valid rows of the chunk, L = l - 1):
//
//   M  = strict_lower(diag(beta) K K^T * Gamma),  T = (I + M)^-1
//   U  = T diag(beta) V,  W = T diag(beta e^gam) K,   D = U - W S0
//   O  = scale (diag(e^gam) Q S0 + lower_incl(Q K^T * Gamma) D)
//   S1 = e^gam_L S0 + (diag(e^(gam_L - gam)) K)^T D
//
// Kernels (all launches 256 threads; grids are flat over x so no axis limit is hit):
//   gdr_l2norm     rows of q / k normalized in the kernel (x * rsqrt(sum x^2 + 1e-6)), kept fp32
//   gdr_prep       per (chunk, value head): gam, M, T (forward substitution), W, U
//   gdr_scan_fwd   per (sequence, value head, V tile of 16 or 32 columns): walks the chunks,
//                  D = U - W S, stores the chunk-start states h[c] and D, updates S; final state.
//                  A chunk's global reads are all issued at its start (16-byte loads, 16 in
//                  flight per thread): the scans are latency-bound
//   gdr_output     per (chunk, value head): O
//   gdr_dd_local   per (chunk, value head): dD = scale A^T dO (the intra-chunk part)
//   gdr_scan_bwd   per (sequence, value head, V tile), chunks in reverse: dh[c] (gradient of the
//                  chunk's end state), dD += Kd dS, dS <- e^gam_L dS + scale Qg^T dO - W^T dD; dh0
//   gdr_grad       per (chunk, value head): every other gradient, following cpu.rs chunk_backward;
//                  dq, dk as per-value-head fp32 partials
//   gdr_reduce_qk  sums the partials over the GVA group in a fixed order, through the l2 norm,
//                  writes dq, dk (zero on padding rows)
//
// No atomics: every output element is written by one thread, every reduction has a fixed order,
// so results are bitwise reproducible. Offsets are 64-bit.

#define GDR_C 64
#define GDR_NT 256
// Staging tiles of the block GEMM: KT reduction rows of 64 (+1 pad) floats, for A and B (the
// tensor-core path lays them out differently in the same space: see tile_mma).
#define GDR_KT 32
#define GDR_LD 65
#define GDR_STAGE (2 * GDR_C * (GDR_KT + 4))
#define GDR_MAT (GDR_C * GDR_LD)

typedef long long i64;

extern __shared__ __align__(16) float gdr_smem[];

// Whether the chunk-parallel GEMMs of a storage type run on tensor cores: bf16 storage uses TF32
// mma (operands rounded to 10 mantissa bits, fp32 accumulation); f32 storage, which exists to
// verify against the CPU op, keeps exact fp32 FMAs.
template <typename T> __device__ constexpr bool tc_of() { return sizeof(T) == 2; }

// ---------------------------------------------------------------------------------------------
// Block GEMM on one 64x64 output tile: acc += sum_k fa(row, k) * fb(k, col) for k < kdim.
// fa / fb return the operands (masking is theirs). AKF / BKF: whether k is the fastest-varying
// index of the operand in memory (coalescing). Which 16 elements of the tile a thread holds in
// acc depends on TC; only tile_epi interprets acc.
//   TC false: fp32 FMAs, element (ty + 16 m, tx + 16 n) in acc[m][n].
//   TC true: mma.sync m16n8k8 TF32; warp w owns rows 16 (w & 3) .. +16 and columns
//            32 (w >> 2) .. +32 (four 16x8 tiles); acc[nt][c] is C-fragment element c of tile nt.

__device__ __forceinline__ void tile_zero(float (&acc)[4][4]) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n) acc[m][n] = 0.f;
}

__device__ __forceinline__ float to_tf32(float x) {
    unsigned u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
    return __uint_as_float(u);
}

__device__ __forceinline__ unsigned tf32u(float x) { return __float_as_uint(to_tf32(x)); }

// c += a b on one m16n8k8 TF32 tile (PTX fragment layouts; g = lane / 4, t = lane % 4):
// a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (t, g), b1 (t + 4, g);
// c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
__device__ __forceinline__ void mma_tf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A fragment (16 x 8, rounded to TF32) of a row-major matrix in shared memory: p points at
// element (g, t) of the tile, ld is the row stride.
struct FragA {
    unsigned a0, a1, a2, a3;
};
__device__ __forceinline__ FragA frag_a_rows(const float* p, int ld) {
    return {tf32u(p[0]), tf32u(p[8 * ld]), tf32u(p[4]), tf32u(p[8 * ld + 4])};
}
// The same for the transpose of a row-major matrix: p points at stored element (t, g).
__device__ __forceinline__ FragA frag_a_cols(const float* p, int ld) {
    return {tf32u(p[0]), tf32u(p[8]), tf32u(p[4 * ld]), tf32u(p[4 * ld + 8])};
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], FragA a, unsigned b0, unsigned b1) {
    mma_tf32(c, a.a0, a.a1, a.a2, a.a3, b0, b1);
}

template <bool TC, bool AKF, bool BKF, class FA, class FB>
__device__ __forceinline__ void tile_mma(float (&acc)[4][4], int kdim, FA fa, FB fb, float* stage) {
    const int tid = threadIdx.x;
    if (!TC) {
        float* sa = stage;
        float* sb = stage + GDR_KT * GDR_LD;
        const int tx = tid & 15, ty = tid >> 4;
        for (int k0 = 0; k0 < kdim; k0 += GDR_KT) {
#pragma unroll
            for (int r = 0; r < (GDR_KT * GDR_C) / GDR_NT; ++r) {
                int e = tid + r * GDR_NT;
                int i, k;
                if (AKF) { k = e % GDR_KT; i = e / GDR_KT; } else { i = e & 63; k = e >> 6; }
                sa[k * GDR_LD + i] = (k0 + k < kdim) ? fa(i, k0 + k) : 0.f;
                int j, kb;
                if (BKF) { kb = e % GDR_KT; j = e / GDR_KT; } else { j = e & 63; kb = e >> 6; }
                sb[kb * GDR_LD + j] = (k0 + kb < kdim) ? fb(k0 + kb, j) : 0.f;
            }
            __syncthreads();
#pragma unroll 8
            for (int k = 0; k < GDR_KT; ++k) {
                float a[4], b[4];
#pragma unroll
                for (int m = 0; m < 4; ++m) a[m] = sa[k * GDR_LD + ty + 16 * m];
#pragma unroll
                for (int n = 0; n < 4; ++n) b[n] = sb[k * GDR_LD + tx + 16 * n];
#pragma unroll
                for (int m = 0; m < 4; ++m)
#pragma unroll
                    for (int n = 0; n < 4; ++n) acc[m][n] = fmaf(a[m], b[n], acc[m][n]);
            }
            __syncthreads();
        }
        return;
    }
    // Tensor cores. A is staged row-major [64][KT + 4] (bank-conflict-free fragment reads); B is
    // staged [64 cols][KT + 4] when k is its fastest index, else [KT][64 + 8] (both conflict-free
    // for the stores of their layout and for the fragment reads). Operands are rounded to TF32
    // when staged.
    constexpr int LA = GDR_KT + 4, LBT = GDR_KT + 4, LBK = GDR_C + 8;
    float* sa = stage;
    float* sb = stage + GDR_C * LA;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3), c0 = 32 * (warp >> 2);
    for (int k0 = 0; k0 < kdim; k0 += GDR_KT) {
#pragma unroll
        for (int r = 0; r < (GDR_KT * GDR_C) / GDR_NT; ++r) {
            int e = tid + r * GDR_NT;
            int i, k;
            if (AKF) { k = e % GDR_KT; i = e / GDR_KT; } else { i = e & 63; k = e >> 6; }
            sa[i * LA + k] = to_tf32((k0 + k < kdim) ? fa(i, k0 + k) : 0.f);
            int j, kb;
            if (BKF) {
                kb = e % GDR_KT; j = e / GDR_KT;
                sb[j * LBT + kb] = to_tf32((k0 + kb < kdim) ? fb(k0 + kb, j) : 0.f);
            } else {
                j = e & 63; kb = e >> 6;
                sb[kb * LBK + j] = to_tf32((k0 + kb < kdim) ? fb(k0 + kb, j) : 0.f);
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GDR_KT; kk += 8) {
            const float* pa = sa + (r0 + g) * LA + kk + t;
            unsigned a0 = __float_as_uint(pa[0]), a1 = __float_as_uint(pa[8 * LA]);
            unsigned a2 = __float_as_uint(pa[4]), a3 = __float_as_uint(pa[8 * LA + 4]);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int col = c0 + 8 * nt + g;
                unsigned b0, b1;
                if (BKF) {
                    b0 = __float_as_uint(sb[col * LBT + kk + t]);
                    b1 = __float_as_uint(sb[col * LBT + kk + t + 4]);
                } else {
                    b0 = __float_as_uint(sb[(kk + t) * LBK + col]);
                    b1 = __float_as_uint(sb[(kk + t + 4) * LBK + col]);
                }
                mma_tf32(acc[nt], a0, a1, a2, a3, b0, b1);
            }
        }
        __syncthreads();
    }
}

template <bool TC, class F>
__device__ __forceinline__ void tile_epi(const float (&acc)[4][4], F f) {
    if (!TC) {
        const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n) f(ty + 16 * m, tx + 16 * n, acc[m][n]);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = 32 * (warp >> 2) + 2 * t;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(r0 + 8 * (c >> 1), c0 + 8 * nt + (c & 1), acc[nt][c]);
}

// Sum over a warp's lanes of f(x) for x = lane, lane + 32, ... < n (fixed order).
template <class F>
__device__ __forceinline__ float warp_row_dot(int n, F f) {
    const int lane = threadIdx.x & 31;
    float s = 0.f;
    for (int x = lane; x < n; x += 32) s += f(x);
    return warp_sum(s);
}

// Chunk geometry shared by the chunk-parallel kernels.
struct ChunkGeo {
    i64 c;   // global chunk id
    int hv;  // value head
    int kh;  // key head
    i64 t0;  // first token
    int l;   // valid rows
};

__device__ __forceinline__ ChunkGeo chunk_geo(const i64* ch_t0, const int* ch_len, int hv_n, int ratio) {
    ChunkGeo g;
    i64 b = blockIdx.x;
    g.hv = (int)(b % hv_n);
    g.c = b / hv_n;
    g.kh = g.hv / ratio;
    g.t0 = ch_t0[g.c];
    g.l = ch_len[g.c];
    return g;
}

// gam (cumsum of the chunk's g, as saved by gdr_prep) and derived vectors into shared memory.
// Rows >= l get gam 0 (never used unmasked).
__device__ __forceinline__ void load_gam(const float* gam_ws, i64 base64, int l, float* s_gam,
                                         float* s_eg, float* s_ed) {
    int i = threadIdx.x;
    if (i < GDR_C) s_gam[i] = gam_ws[base64 + i];
    __syncthreads();
    if (i < GDR_C) {
        float gl = s_gam[l - 1];
        s_eg[i] = i < l ? expf(s_gam[i]) : 0.f;
        if (s_ed) s_ed[i] = i < l ? expf(gl - s_gam[i]) : 0.f;
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// L2 norm of rows (one warp per row): y = x * rstd, rstd = 1 / sqrt(sum x^2 + 1e-6).
template <typename TI, typename TO>
__device__ void gdr_l2norm(const TI* __restrict__ x, TO* __restrict__ y, i64 rows, int d) {
    i64 row = (i64)blockIdx.x * (GDR_NT / 32) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const TI* xr = x + row * d;
    float ss = warp_row_dot(d, [&](int c) { float v = ld(xr, c); return v * v; });
    float r = 1.f / sqrtf(ss + 1e-6f);
    for (int c = threadIdx.x & 31; c < d; c += 32) st(y, row * d + c, ld(xr, c) * r);
}

// ---------------------------------------------------------------------------------------------
// Per (chunk, value head): gam, M, T = (I+M)^-1, W, U (fp32 workspaces, 64 rows per chunk,
// rows >= l zero). T is stored only when t_ws is not null (backward). W is stored as TW: fp32 for
// the v5 kernels, bf16 for the v6 forward (which rounds it to bf16 as an mma operand anyway).
// SK (v6): the chunk's K and V rows are first copied to shared memory (16-byte loads, all in
// flight at once; rows >= l zero) and every product stages from there, instead of each 32-deep
// slice of each product waiting on its own global loads. Extra dynamic shared memory:
// 64 dk sizeof(TQ) + 64 dv sizeof(T) bytes after the usual layout.
template <typename TE>
__device__ __forceinline__ void rows_to_smem(TE* dst, const TE* src, i64 stride, int n, int l) {
    const int per = n * (int)sizeof(TE) / 16;  // 16-byte pieces per row (n * sizeof(TE) % 16 == 0)
#pragma unroll 8
    for (int e = threadIdx.x; e < GDR_C * per; e += GDR_NT) {
        const int i = e / per, p = e - i * per;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (i < l) x = reinterpret_cast<const uint4*>(src + i * stride)[p];
        reinterpret_cast<uint4*>(dst + i * n)[p] = x;
    }
}

template <typename TQ, typename T, typename TW = float, bool SK = false>
__device__ void gdr_prep(const TQ* __restrict__ k, const T* __restrict__ v, const float* __restrict__ g,
                         const T* __restrict__ beta, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dk, int dv,
                         float* __restrict__ gam_ws, float* __restrict__ t_ws, TW* __restrict__ w_ws,
                         float* __restrict__ u_ws) {
    constexpr bool TC = tc_of<T>();
    const int ratio = hv_n / hk_n;
    ChunkGeo G = chunk_geo(ch_t0, ch_len, hv_n, ratio);
    const int l = G.l, tid = threadIdx.x;
    const i64 cb = G.c * hv_n + G.hv;  // chunk-head index
    float* stage = gdr_smem;
    float* sM = stage + GDR_STAGE;
    float* sT = sM + GDR_MAT;
    float* s_gam = sT + GDR_MAT;
    float* s_beta = s_gam + GDR_C;
    float* s_bge = s_beta + GDR_C;
    i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const TQ* kg = k + G.t0 * krow + (i64)G.kh * dk;
    const T* vg = v + G.t0 * vrow + (i64)G.hv * dv;
    // K and V rows as the products read them: global (v5) or the shared copies (SK).
    TQ* s_k = reinterpret_cast<TQ*>(s_bge + GDR_C);
    T* s_v = reinterpret_cast<T*>(s_k + GDR_C * dk);
    if (SK) {
        rows_to_smem(s_k, kg, krow, dk, l);
        rows_to_smem(s_v, vg, vrow, dv, l);
    }
    const TQ* kc = SK ? s_k : kg;
    const T* vc = SK ? s_v : vg;
    if (SK) {
        krow = dk;
        vrow = dv;
    }

    if (tid < GDR_C) {
        s_beta[tid] = tid < l ? ld(beta, (G.t0 + tid) * hv_n + G.hv) : 0.f;
        s_gam[tid] = tid < l ? g[(G.t0 + tid) * hv_n + G.hv] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
        for (int i = 0; i < l; ++i) { acc += s_gam[i]; s_gam[i] = acc; }
    }
    __syncthreads();
    if (tid < GDR_C) {
        s_bge[tid] = tid < l ? s_beta[tid] * expf(s_gam[tid]) : 0.f;
        gam_ws[cb * GDR_C + tid] = s_gam[tid];
    }

    // M_ij = beta_i (k_i . k_j) Gamma_ij, j < i.
    {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, dk, [&](int i, int x) { return i < l ? ld(kc, i * krow + x) : 0.f; },
            [&](int x, int j) { return j < l ? ld(kc, j * krow + x) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int j, float a) {
            sM[i * GDR_LD + j] = (j < i && i < l) ? s_beta[i] * a * expf(s_gam[i] - s_gam[j]) : 0.f;
        });
    }
    __syncthreads();
    // T = (I+M)^-1 by 16 x 16 blocks (short dependency chains): the diagonal blocks by forward
    // substitution (column c by thread c), then the blocks below the diagonal block-row by
    // block-row, T_ab = -T_aa X_ab with X_ab = sum_{b <= k < a} M_ak T_kb.
    for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
        int i = e >> 6, c = e & 63;
        if ((c >> 4) > (i >> 4)) sT[i * GDR_LD + c] = 0.f;
    }
    if (tid < GDR_C) {
        const int c = tid, b0 = tid & ~15;
        for (int i = b0; i < b0 + 16; ++i) {
            float t;
            if (i < c) t = 0.f;
            else if (i == c) t = 1.f;
            else {
                t = 0.f;
                for (int j = c; j < i; ++j) t -= sM[i * GDR_LD + j] * sT[j * GDR_LD + c];
            }
            sT[i * GDR_LD + c] = t;
        }
    }
    __syncthreads();
    float* sX = stage;  // X_ab for b < a: [b][16][16]
    for (int a = 1; a < 4; ++a) {
        for (int e = tid; e < a * 256; e += GDR_NT) {
            int b = e >> 8, i = 16 * a + ((e >> 4) & 15), col = 16 * b + (e & 15);
            float x = 0.f;
            for (int j = 16 * b; j < 16 * a; ++j) x += sM[i * GDR_LD + j] * sT[j * GDR_LD + col];
            sX[e] = x;
        }
        __syncthreads();
        for (int e = tid; e < a * 256; e += GDR_NT) {
            int b = e >> 8, i = 16 * a + ((e >> 4) & 15), col = 16 * b + (e & 15);
            float y = 0.f;
            for (int j = 0; j < 16; ++j) y -= sT[i * GDR_LD + 16 * a + j] * sX[(b << 8) + (j << 4) + (e & 15)];
            sT[i * GDR_LD + col] = y;
        }
        __syncthreads();
    }
    if (t_ws) {
        for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT)
            t_ws[cb * (GDR_C * GDR_C) + e] = sT[(e >> 6) * GDR_LD + (e & 63)];
    }
    // W = T diag(beta e^gam) K, U = T diag(beta) V.
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int i, int m) { return sT[i * GDR_LD + m]; },
            [&](int m, int x) { return (m < l && j0 + x < dk) ? s_bge[m] * ld(kc, m * krow + j0 + x) : 0.f; },
            stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (j0 + x < dk) st(w_ws, (cb * GDR_C + i) * dk + j0 + x, a);
        });
    }
    for (int j0 = 0; j0 < dv; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int i, int m) { return sT[i * GDR_LD + m]; },
            [&](int m, int x) { return (m < l && j0 + x < dv) ? s_beta[m] * ld(vc, m * vrow + j0 + x) : 0.f; },
            stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (j0 + x < dv) u_ws[(cb * GDR_C + i) * dv + j0 + x] = a;
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Sequential scans over the chunks of one (sequence, value head, V tile of BV columns).
// Thread layout: 4 consecutive columns per thread, TPR = BV/4 threads per row.

template <int BV>
struct ScanLayout {
    static constexpr int TPR = BV / 4;
    static constexpr int RP = GDR_NT / TPR;  // rows per pass
    static constexpr int RPT = GDR_C / RP;   // rows per thread in a 64-row matrix
};

// Four consecutive values (index a multiple of 4, so the access is aligned) as fp32.
__device__ __forceinline__ float4 ld4(const float* p, i64 i) { return *reinterpret_cast<const float4*>(p + i); }
__device__ __forceinline__ float4 ld4(const bf16_t* p, i64 i) {
    uint2 u = *reinterpret_cast<const uint2*>(p + i);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

// Two 64-row matrices of n (a multiple of 4) values per row from global memory (row strides ra,
// rb; rows >= la / lb read as zero) into shared memory (row stride ld, a multiple of 4), with up
// to 16 16-byte loads per thread in flight before the first store.
template <typename TA, typename TB>
__device__ __forceinline__ void load_rows2(float* da, const TA* sa, i64 ra, int la, float* db, const TB* sb,
                                           i64 rb, int lb, int ld, int n) {
    const int n4 = n >> 2;
    const int total = GDR_C * n4;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int e0 = threadIdx.x; e0 < total; e0 += GDR_NT * 8) {
        float4 a[8], b[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int e = e0 + u * GDR_NT;
            int i = e / n4, x = (e - i * n4) * 4;
            a[u] = (e < total && i < la) ? ld4(sa, i * ra + x) : z;
            b[u] = (e < total && i < lb) ? ld4(sb, i * rb + x) : z;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int e = e0 + u * GDR_NT;
            if (e < total) {
                int i = e / n4, x = (e - i * n4) * 4;
                *reinterpret_cast<float4*>(da + i * ld + x) = a[u];
                *reinterpret_cast<float4*>(db + i * ld + x) = b[u];
            }
        }
    }
}

template <typename TA>
__device__ __forceinline__ void load_rows1(float* da, const TA* sa, i64 ra, int la, int ld, int n) {
    const int n4 = n >> 2;
    const int total = GDR_C * n4;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int e0 = threadIdx.x; e0 < total; e0 += GDR_NT * 8) {
        float4 a[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int e = e0 + u * GDR_NT;
            int i = e / n4, x = (e - i * n4) * 4;
            a[u] = (e < total && i < la) ? ld4(sa, i * ra + x) : z;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int e = e0 + u * GDR_NT;
            if (e < total) {
                int i = e / n4, x = (e - i * n4) * 4;
                *reinterpret_cast<float4*>(da + i * ld + x) = a[u];
            }
        }
    }
}

// X = A S for the scans: A [64][ldw] (rows of a chunk) times the state tile S [dk][BV + 8] in
// shared memory. TC: warp w holds the 16 x 8 tiles (row tile w % 4, column tiles
// (w / 4) * BV/16 ...) of X as mma C fragments; else thread (r0, c4) holds rows r0 + m RP,
// columns c4 .. c4 + 3.
template <int BV>
__device__ __forceinline__ void scan_rows_tc(float (&acc)[BV / 16][4], const float* a, int ldw, const float* s,
                                             int dk) {
    constexpr int LDS = BV + 8, NCT = BV / 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int rt = warp & 3, ct0 = (warp >> 2) * NCT;
#pragma unroll
    for (int nt = 0; nt < NCT; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
    for (int k0 = 0; k0 < dk; k0 += 8) {
        FragA fa = frag_a_rows(a + (16 * rt + g) * ldw + k0 + t, ldw);
#pragma unroll
        for (int nt = 0; nt < NCT; ++nt) {
            const float* pb = s + (k0 + t) * LDS + 8 * (ct0 + nt) + g;
            mma_tf32(acc[nt], fa, tf32u(pb[0]), tf32u(pb[4 * LDS]));
        }
    }
}

template <int BV>
__device__ __forceinline__ void scan_rows_fma(float (&acc)[ScanLayout<BV>::RPT][4], const float* a, int ldw,
                                              const float* s, int dk) {
    typedef ScanLayout<BV> Lay;
    constexpr int LDS = BV + 8;
    const int c4 = (threadIdx.x % Lay::TPR) * 4, r0 = threadIdx.x / Lay::TPR;
#pragma unroll
    for (int m = 0; m < Lay::RPT; ++m)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[m][q] = 0.f;
    for (int kk = 0; kk < dk; ++kk) {
        float4 s4 = *reinterpret_cast<const float4*>(&s[kk * LDS + c4]);
#pragma unroll
        for (int m = 0; m < Lay::RPT; ++m) {
            float w = a[(r0 + m * Lay::RP) * ldw + kk];
            acc[m][0] = fmaf(w, s4.x, acc[m][0]);
            acc[m][1] = fmaf(w, s4.y, acc[m][1]);
            acc[m][2] = fmaf(w, s4.z, acc[m][2]);
            acc[m][3] = fmaf(w, s4.w, acc[m][3]);
        }
    }
}

// Forward scan. Per chunk: h[c] = S; D = U - W S (stored); S = e^gam_L S + K^T (e^(gam_L-gam) D).
// All global reads of a chunk (gam, W, K, this thread's U) are issued together at its start.
// S (fp32) stays in shared memory. TC (bf16 storage): both products on tensor cores (TF32
// operands, fp32 accumulation; S itself is never rounded); else fp32 FMAs.
template <typename TQ, typename T, int BV>
__device__ void gdr_scan_fwd(const TQ* __restrict__ k, const float* __restrict__ gam_ws,
                             const float* __restrict__ w_ws, const float* __restrict__ u_ws,
                             const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                             const int* __restrict__ ch_len, int hk_n, int hv_n, int dk, int dv,
                             const float* __restrict__ h0, float* __restrict__ h_ws,
                             float* __restrict__ d_ws, float* __restrict__ fin) {
    typedef ScanLayout<BV> Lay;
    constexpr bool TC = tc_of<T>();
    constexpr int LDS = BV + 8;        // row stride of sS and sD (conflict-free mma B fragments)
    constexpr int NCT = BV / 16;       // TC: column tiles per warp of D = U - W S
    const int nvt = dv / BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int ldw = dk + 4;
    float* sS = gdr_smem;              // [dk][LDS]
    float* sW = sS + dk * LDS;         // [64][dk+4]
    float* sK = sW + GDR_C * ldw;      // [64][dk+4]
    float* sD = sK + GDR_C * ldw;      // [64][LDS]: e^(gam_L - gam_i) D_i
    float* s_gam = sD + GDR_C * LDS;   // [64]
    const int c4 = (tid % Lay::TPR) * 4, r0 = tid / Lay::TPR;
    const int rt = warp & 3, ct0 = (warp >> 2) * NCT;  // TC: this warp's tiles of D
    const i64 col0 = (i64)vt * BV;
    const i64 st_base = (n * hv_n + hv) * (i64)dk * dv;
    const i64 krow = (i64)hk_n * dk;

    for (int e = tid; e < dk * BV; e += GDR_NT) {
        int kk = e / BV, cc = e % BV;
        sS[kk * LDS + cc] = h0 ? h0[st_base + (i64)kk * dv + col0 + cc] : 0.f;
    }
    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    for (i64 c = c_beg; c < c_end; ++c) {
        const i64 cb = c * hv_n + hv;
        const int l = ch_len[c];
        const TQ* kc = k + ch_t0[c] * krow + (i64)kh * dk;
        __syncthreads();  // previous chunk done with sS/sW/sK/sD/s_gam
        if (tid < GDR_C) s_gam[tid] = gam_ws[cb * GDR_C + tid];
        float4 u4[TC ? 1 : Lay::RPT];
        float2 u2[TC ? NCT : 1][2];
        if (TC) {
#pragma unroll
            for (int nt = 0; nt < NCT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    u2[nt][h] = *reinterpret_cast<const float2*>(
                        u_ws + (cb * GDR_C + 16 * rt + g + 8 * h) * dv + col0 + 8 * (ct0 + nt) + 2 * t);
        } else {
#pragma unroll
            for (int m = 0; m < Lay::RPT; ++m)
                u4[m] = ld4(u_ws, (cb * GDR_C + r0 + m * Lay::RP) * dv + col0 + c4);
        }
        if (h_ws) {
            for (int e = tid; e < dk * BV; e += GDR_NT) {
                int kk = e / BV, cc = e % BV;
                h_ws[cb * (i64)dk * dv + (i64)kk * dv + col0 + cc] = sS[kk * LDS + cc];
            }
        }
        load_rows2(sW, w_ws + cb * GDR_C * dk, (i64)dk, GDR_C, sK, kc, krow, l, ldw, dk);
        __syncthreads();
        const float gl = s_gam[l - 1];
        // D = U - W S (64 x BV).
        if (TC) {
            float acc[NCT][4];
            scan_rows_tc<BV>(acc, sW, ldw, sS, dk);
#pragma unroll
            for (int nt = 0; nt < NCT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int i = 16 * rt + g + 8 * h, cc = 8 * (ct0 + nt) + 2 * t;
                    float ed = i < l ? expf(gl - s_gam[i]) : 0.f;
                    float2 d = make_float2(u2[nt][h].x - acc[nt][2 * h], u2[nt][h].y - acc[nt][2 * h + 1]);
                    *reinterpret_cast<float2*>(d_ws + (cb * GDR_C + i) * dv + col0 + cc) = d;
                    *reinterpret_cast<float2*>(&sD[i * LDS + cc]) = make_float2(ed * d.x, ed * d.y);
                }
        } else {
            float acc[Lay::RPT][4];
            scan_rows_fma<BV>(acc, sW, ldw, sS, dk);
#pragma unroll
            for (int m = 0; m < Lay::RPT; ++m) {
                int i = r0 + m * Lay::RP;
                float ed = i < l ? expf(gl - s_gam[i]) : 0.f;
                float4 d = make_float4(u4[m].x - acc[m][0], u4[m].y - acc[m][1], u4[m].z - acc[m][2],
                                       u4[m].w - acc[m][3]);
                *reinterpret_cast<float4*>(d_ws + (cb * GDR_C + i) * dv + col0 + c4) = d;
                *reinterpret_cast<float4*>(&sD[i * LDS + c4]) =
                    make_float4(ed * d.x, ed * d.y, ed * d.z, ed * d.w);
            }
        }
        __syncthreads();
        // S = e^gam_L S + K^T sD.
        const float egl = expf(gl);
        if (TC) {
            for (int rt2 = warp; rt2 < dk / 16; rt2 += GDR_NT / 32) {
                float acc[BV / 8][4] = {};
#pragma unroll
                for (int k0 = 0; k0 < GDR_C; k0 += 8) {
                    FragA fa = frag_a_cols(sK + (k0 + t) * ldw + 16 * rt2 + g, ldw);
#pragma unroll
                    for (int nt = 0; nt < BV / 8; ++nt) {
                        const float* pb = sD + (k0 + t) * LDS + 8 * nt + g;
                        mma_tf32(acc[nt], fa, tf32u(pb[0]), tf32u(pb[4 * LDS]));
                    }
                }
#pragma unroll
                for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float* sp = &sS[(16 * rt2 + g + 8 * (q >> 1)) * LDS + 8 * nt + 2 * t + (q & 1)];
                        *sp = egl * *sp + acc[nt][q];
                    }
            }
        } else {
            for (int kk = r0; kk < dk; kk += Lay::RP) {
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
                for (int i = 0; i < GDR_C; ++i) {
                    float kv = sK[i * ldw + kk];
                    float4 d4 = *reinterpret_cast<const float4*>(&sD[i * LDS + c4]);
                    a0 = fmaf(kv, d4.x, a0);
                    a1 = fmaf(kv, d4.y, a1);
                    a2 = fmaf(kv, d4.z, a2);
                    a3 = fmaf(kv, d4.w, a3);
                }
                float* sp = &sS[kk * LDS + c4];
                sp[0] = egl * sp[0] + a0;
                sp[1] = egl * sp[1] + a1;
                sp[2] = egl * sp[2] + a2;
                sp[3] = egl * sp[3] + a3;
            }
        }
    }
    __syncthreads();
    if (fin) {
        for (int e = tid; e < dk * BV; e += GDR_NT) {
            int kk = e / BV, cc = e % BV;
            fin[st_base + (i64)kk * dv + col0 + cc] = sS[kk * LDS + cc];
        }
    }
}

// dS walks the chunks in reverse. On entry to chunk c, dS is the gradient w.r.t. the state at
// the chunk's end: stored as dh[c]; dD = dD_loc + e^(gam_L - gam) K dS;
// dS <- e^gam_L dS + Q^T (scale e^gam dO) - W^T dD. TC as in gdr_scan_fwd.
template <typename TQ, typename T, int BV>
__device__ void gdr_scan_bwd(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ d_o,
                             const float* __restrict__ gam_ws, const float* __restrict__ w_ws,
                             const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                             const int* __restrict__ ch_len, int hk_n, int hv_n, int dk, int dv, float scale,
                             const float* __restrict__ dht, float* __restrict__ dh_ws,
                             float* __restrict__ dd_ws, float* __restrict__ dh0) {
    typedef ScanLayout<BV> Lay;
    constexpr bool TC = tc_of<T>();
    constexpr int LDS = BV + 8;
    constexpr int NCT = BV / 16;
    const int nvt = dv / BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int ldw = dk + 4;
    float* sS = gdr_smem;              // dS [dk][LDS]
    float* sA = sS + dk * LDS;         // [64][dk+4]: K, then Q
    float* sW = sA + GDR_C * ldw;      // [64][dk+4]
    float* sD = sW + GDR_C * ldw;      // dD [64][LDS]
    float* sO = sD + GDR_C * LDS;      // scale e^gam dO [64][LDS]
    float* s_gam = sO + GDR_C * LDS;
    const int c4 = (tid % Lay::TPR) * 4, r0 = tid / Lay::TPR;
    const int rt = warp & 3, ct0 = (warp >> 2) * NCT;
    const i64 col0 = (i64)vt * BV;
    const i64 st_base = (n * hv_n + hv) * (i64)dk * dv;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);

    for (int e = tid; e < dk * BV; e += GDR_NT) {
        int kk = e / BV, cc = e % BV;
        sS[kk * LDS + cc] = dht ? dht[st_base + (i64)kk * dv + col0 + cc] : 0.f;
    }
    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    for (i64 c = c_end - 1; c >= c_beg; --c) {
        const i64 cb = c * hv_n + hv;
        const int l = ch_len[c];
        const i64 t0 = ch_t0[c];
        const TQ* kc = k + t0 * krow + (i64)kh * dk;
        const TQ* qc = q + t0 * krow + (i64)kh * dk;
        const T* oc = d_o + t0 * vrow + (i64)hv * dv + col0;
        __syncthreads();
        if (tid < GDR_C) s_gam[tid] = gam_ws[cb * GDR_C + tid];
        float4 o4[TC ? 1 : Lay::RPT], dl4[TC ? 1 : Lay::RPT];
        float2 dl2[TC ? NCT : 1][2];
        if (TC) {
#pragma unroll
            for (int nt = 0; nt < NCT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    dl2[nt][h] = *reinterpret_cast<const float2*>(
                        dd_ws + (cb * GDR_C + 16 * rt + g + 8 * h) * dv + col0 + 8 * (ct0 + nt) + 2 * t);
        } else {
#pragma unroll
            for (int m = 0; m < Lay::RPT; ++m) {
                int i = r0 + m * Lay::RP;
                o4[m] = i < l ? ld4(oc, i * vrow + c4) : z;
                dl4[m] = ld4(dd_ws, (cb * GDR_C + i) * dv + col0 + c4);
            }
        }
        for (int e = tid; e < dk * BV; e += GDR_NT) {
            int kk = e / BV, cc = e % BV;
            dh_ws[cb * (i64)dk * dv + (i64)kk * dv + col0 + cc] = sS[kk * LDS + cc];
        }
        load_rows2(sA, kc, krow, l, sW, w_ws + cb * GDR_C * dk, (i64)dk, GDR_C, ldw, dk);
        __syncthreads();
        const float gl = s_gam[l - 1];
        // dD = dD_loc + e^(gam_L - gam) K dS ; sO = scale e^gam dO.
        if (TC) {
            for (int e = tid; e < GDR_C * (BV / 4); e += GDR_NT) {
                int i = e / (BV / 4), cc = (e % (BV / 4)) * 4;
                float so = i < l ? scale * expf(s_gam[i]) : 0.f;
                float4 o = i < l ? ld4(oc, i * vrow + cc) : z;
                *reinterpret_cast<float4*>(&sO[i * LDS + cc]) = make_float4(so * o.x, so * o.y, so * o.z, so * o.w);
            }
            float acc[NCT][4];
            scan_rows_tc<BV>(acc, sA, ldw, sS, dk);
#pragma unroll
            for (int nt = 0; nt < NCT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int i = 16 * rt + g + 8 * h, cc = 8 * (ct0 + nt) + 2 * t;
                    float ed = i < l ? expf(gl - s_gam[i]) : 0.f;
                    float2 d = make_float2(dl2[nt][h].x + ed * acc[nt][2 * h], dl2[nt][h].y + ed * acc[nt][2 * h + 1]);
                    *reinterpret_cast<float2*>(&sD[i * LDS + cc]) = d;
                    *reinterpret_cast<float2*>(dd_ws + (cb * GDR_C + i) * dv + col0 + cc) = d;
                }
        } else {
            float acc[Lay::RPT][4];
            scan_rows_fma<BV>(acc, sA, ldw, sS, dk);
#pragma unroll
            for (int m = 0; m < Lay::RPT; ++m) {
                int i = r0 + m * Lay::RP;
                float ed = i < l ? expf(gl - s_gam[i]) : 0.f;
                float so = i < l ? scale * expf(s_gam[i]) : 0.f;
                float4 d = make_float4(dl4[m].x + ed * acc[m][0], dl4[m].y + ed * acc[m][1],
                                       dl4[m].z + ed * acc[m][2], dl4[m].w + ed * acc[m][3]);
                *reinterpret_cast<float4*>(&sD[i * LDS + c4]) = d;
                *reinterpret_cast<float4*>(dd_ws + (cb * GDR_C + i) * dv + col0 + c4) = d;
                *reinterpret_cast<float4*>(&sO[i * LDS + c4]) =
                    make_float4(so * o4[m].x, so * o4[m].y, so * o4[m].z, so * o4[m].w);
            }
        }
        __syncthreads();
        load_rows1(sA, qc, krow, l, ldw, dk);
        __syncthreads();
        // dS = e^gam_L dS + Q^T sO - W^T dD.
        const float egl = expf(gl);
        if (TC) {
            for (int rt2 = warp; rt2 < dk / 16; rt2 += GDR_NT / 32) {
                float aq[BV / 8][4] = {}, aw[BV / 8][4] = {};
#pragma unroll
                for (int k0 = 0; k0 < GDR_C; k0 += 8) {
                    FragA fq = frag_a_cols(sA + (k0 + t) * ldw + 16 * rt2 + g, ldw);
                    FragA fw = frag_a_cols(sW + (k0 + t) * ldw + 16 * rt2 + g, ldw);
#pragma unroll
                    for (int nt = 0; nt < BV / 8; ++nt) {
                        const float* po = sO + (k0 + t) * LDS + 8 * nt + g;
                        const float* pd = sD + (k0 + t) * LDS + 8 * nt + g;
                        mma_tf32(aq[nt], fq, tf32u(po[0]), tf32u(po[4 * LDS]));
                        mma_tf32(aw[nt], fw, tf32u(pd[0]), tf32u(pd[4 * LDS]));
                    }
                }
#pragma unroll
                for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) {
                        float* sp = &sS[(16 * rt2 + g + 8 * (qq >> 1)) * LDS + 8 * nt + 2 * t + (qq & 1)];
                        *sp = egl * *sp + (aq[nt][qq] - aw[nt][qq]);
                    }
            }
        } else {
            for (int kk = r0; kk < dk; kk += Lay::RP) {
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
                for (int i = 0; i < GDR_C; ++i) {
                    float qv = sA[i * ldw + kk], wv = sW[i * ldw + kk];
                    float4 o = *reinterpret_cast<const float4*>(&sO[i * LDS + c4]);
                    float4 d4 = *reinterpret_cast<const float4*>(&sD[i * LDS + c4]);
                    a0 = fmaf(qv, o.x, a0) - wv * d4.x;
                    a1 = fmaf(qv, o.y, a1) - wv * d4.y;
                    a2 = fmaf(qv, o.z, a2) - wv * d4.z;
                    a3 = fmaf(qv, o.w, a3) - wv * d4.w;
                }
                float* sp = &sS[kk * LDS + c4];
                sp[0] = egl * sp[0] + a0;
                sp[1] = egl * sp[1] + a1;
                sp[2] = egl * sp[2] + a2;
                sp[3] = egl * sp[3] + a3;
            }
        }
    }
    __syncthreads();
    if (dh0) {
        for (int e = tid; e < dk * BV; e += GDR_NT) {
            int kk = e / BV, cc = e % BV;
            dh0[st_base + (i64)kk * dv + col0 + cc] = sS[kk * LDS + cc];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A = lower_incl(Q K^T * Gamma) of a chunk into sA (64 x 64).
template <bool TC, typename TQ>
__device__ __forceinline__ void chunk_qk(const TQ* qc, const TQ* kc, i64 krow, int dk, int l, const float* s_gam,
                                        float* sA, float* stage) {
    float acc[4][4];
    tile_zero(acc);
    tile_mma<TC, true, true>(
        acc, dk, [&](int i, int x) { return i < l ? ld(qc, i * krow + x) : 0.f; },
        [&](int x, int j) { return j < l ? ld(kc, j * krow + x) : 0.f; }, stage);
    tile_epi<TC>(acc, [&](int i, int j, float a) {
        sA[i * GDR_LD + j] = (j <= i && i < l) ? a * expf(s_gam[i] - s_gam[j]) : 0.f;
    });
}

// O = scale (diag(e^gam) Q h[c] + A D).
template <typename TQ, typename T>
__device__ void gdr_output(const TQ* __restrict__ q, const TQ* __restrict__ k, const float* __restrict__ gam_ws,
                           const float* __restrict__ h_ws, const float* __restrict__ d_ws,
                           const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                           int dk, int dv, float scale, T* __restrict__ o) {
    constexpr bool TC = tc_of<T>();
    ChunkGeo G = chunk_geo(ch_t0, ch_len, hv_n, hv_n / hk_n);
    const int l = G.l;
    const i64 cb = G.c * hv_n + G.hv;
    float* stage = gdr_smem;
    float* sA = stage + GDR_STAGE;
    float* s_gam = sA + GDR_MAT;
    float* s_eg = s_gam + GDR_C;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const TQ* qc = q + G.t0 * krow + (i64)G.kh * dk;
    const TQ* kc = k + G.t0 * krow + (i64)G.kh * dk;
    T* oc = o + G.t0 * vrow + (i64)G.hv * dv;
    const float* hc = h_ws + cb * (i64)dk * dv;
    const float* dc = d_ws + cb * GDR_C * (i64)dv;
    load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, nullptr);
    chunk_qk<TC>(qc, kc, krow, dk, l, s_gam, sA, stage);
    __syncthreads();
    for (int j0 = 0; j0 < dv; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, dk, [&](int i, int x) { return i < l ? s_eg[i] * ld(qc, i * krow + x) : 0.f; },
            [&](int x, int j) { return j0 + j < dv ? hc[(i64)x * dv + j0 + j] : 0.f; }, stage);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int i, int m) { return sA[i * GDR_LD + m]; },
            [&](int m, int j) { return j0 + j < dv ? dc[(i64)m * dv + j0 + j] : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int j, float a) {
            if (i < l && j0 + j < dv) st(oc, i * vrow + j0 + j, scale * a);
        });
    }
}

// dD_loc = scale A^T dO (written to dd_ws; gdr_scan_bwd adds Kd dS).
template <typename TQ, typename T>
__device__ void gdr_dd_local(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ d_o,
                             const float* __restrict__ gam_ws, const i64* __restrict__ ch_t0,
                             const int* __restrict__ ch_len, int hk_n, int hv_n, int dk, int dv, float scale,
                             float* __restrict__ dd_ws) {
    constexpr bool TC = tc_of<T>();
    ChunkGeo G = chunk_geo(ch_t0, ch_len, hv_n, hv_n / hk_n);
    const int l = G.l;
    const i64 cb = G.c * hv_n + G.hv;
    float* stage = gdr_smem;
    float* sA = stage + GDR_STAGE;
    float* s_gam = sA + GDR_MAT;
    float* s_eg = s_gam + GDR_C;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const TQ* qc = q + G.t0 * krow + (i64)G.kh * dk;
    const TQ* kc = k + G.t0 * krow + (i64)G.kh * dk;
    const T* oc = d_o + G.t0 * vrow + (i64)G.hv * dv;
    load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, nullptr);
    chunk_qk<TC>(qc, kc, krow, dk, l, s_gam, sA, stage);
    __syncthreads();
    for (int j0 = 0; j0 < dv; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int m, int i) { return sA[i * GDR_LD + m]; },
            [&](int i, int j) { return (i < l && j0 + j < dv) ? ld(oc, i * vrow + j0 + j) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int m, int j, float a) {
            if (j0 + j < dv) dd_ws[(cb * GDR_C + m) * dv + j0 + j] = scale * a;
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Every gradient of one chunk except the state recursion (done by the scans), following
// cpu.rs chunk_backward. Inputs: s0 = h[c] (start state), ds = dh[c] (gradient of the end state),
// D, dD (complete), T, gam. W's workspace is reused for dW, U's for dVb. TH: the element type of
// h and dh (fp32 in v5; bf16 with the v6 backward's bf16 states, gdr_grad_h16_*).
template <typename TQ, typename T, typename TH = float>
__device__ void gdr_grad(const TQ* __restrict__ q, const TQ* __restrict__ k, const T* __restrict__ v,
                         const T* __restrict__ beta, const T* __restrict__ d_o, const float* __restrict__ gam_ws,
                         const float* __restrict__ t_ws, const TH* __restrict__ h_ws,
                         const TH* __restrict__ dh_ws, const float* __restrict__ d_ws,
                         const float* __restrict__ dd_ws, float* __restrict__ dw_ws, float* __restrict__ dvb_ws,
                         float* __restrict__ dkb_ws, const i64* __restrict__ ch_t0, const int* __restrict__ ch_len,
                         int hk_n, int hv_n, int dk, int dv, float scale, float* __restrict__ dq_part,
                         float* __restrict__ dk_part, T* __restrict__ dv_out, float* __restrict__ dg,
                         T* __restrict__ dbeta) {
    constexpr bool TC = tc_of<T>();
    ChunkGeo G = chunk_geo(ch_t0, ch_len, hv_n, hv_n / hk_n);
    const int l = G.l, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 cb = G.c * hv_n + G.hv;
    float* stage = gdr_smem;
    float* sT = stage + GDR_STAGE;
    float* sA = sT + GDR_MAT;    // A, then dT
    float* sP = sA + GDR_MAT;    // K K^T
    float* sE = sP + GDR_MAT;    // dA * A, then T^T dT, then dP (symmetric)
    float* sG = sE + GDR_MAT;    // dA * Gamma, then dM
    float* s_gam = sG + GDR_MAT;
    float* s_eg = s_gam + GDR_C;
    float* s_ed = s_eg + GDR_C;
    float* s_beta = s_ed + GDR_C;
    float* s_dgam = s_beta + GDR_C;
    float* s_db = s_dgam + GDR_C;
    float* s_tmp = s_db + GDR_C;
    float* s_red = s_tmp + GDR_C;  // 32 floats for block_sum
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const i64 prow = (i64)hv_n * dk;  // row stride of the fp32 partials [tokens, Hv, Dk]
    const TQ* qc = q + G.t0 * krow + (i64)G.kh * dk;
    const TQ* kc = k + G.t0 * krow + (i64)G.kh * dk;
    const T* vc = v + G.t0 * vrow + (i64)G.hv * dv;
    const T* oc = d_o + G.t0 * vrow + (i64)G.hv * dv;
    float* dqc = dq_part + G.t0 * prow + (i64)G.hv * dk;
    float* dkc = dk_part + G.t0 * prow + (i64)G.hv * dk;
    const TH* s0 = h_ws + cb * (i64)dk * dv;
    const TH* ds = dh_ws + cb * (i64)dk * dv;
    const float* Dm = d_ws + cb * GDR_C * (i64)dv;
    const float* dD = dd_ws + cb * GDR_C * (i64)dv;
    float* dW = dw_ws + cb * GDR_C * (i64)dk;
    float* dVb = dvb_ws + cb * GDR_C * (i64)dv;
    float* dKb = dkb_ws + cb * GDR_C * (i64)dk;

    load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, s_ed);
    if (tid < GDR_C) {
        s_beta[tid] = tid < l ? ld(beta, (G.t0 + tid) * hv_n + G.hv) : 0.f;
        s_dgam[tid] = 0.f;
        s_db[tid] = 0.f;
    }
    for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT)
        sT[(e >> 6) * GDR_LD + (e & 63)] = t_ws[cb * (GDR_C * GDR_C) + e];
    const float gl = s_gam[l - 1];
    const float egl = expf(gl);
    auto gamma = [&](int i, int j) { return expf(s_gam[i] - s_gam[j]); };
    auto kld = [&](int i, int x) { return i < l ? ld(kc, i * krow + x) : 0.f; };
    auto qld = [&](int i, int x) { return i < l ? ld(qc, i * krow + x) : 0.f; };

    // A and P = K K^T.
    chunk_qk<TC>(qc, kc, krow, dk, l, s_gam, sA, stage);
    {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(acc, dk, kld, [&](int x, int j) { return kld(j, x); }, stage);
        tile_epi<TC>(acc, [&](int i, int j, float a) { sP[i * GDR_LD + j] = a; });
    }
    __syncthreads();
    // dA = scale dO D^T (j <= i): E = dA * A (for dgam), G = dA * Gamma.
    {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, dv, [&](int i, int c) { return i < l ? ld(oc, i * vrow + c) : 0.f; },
            [&](int c, int j) { return Dm[(i64)j * dv + c]; }, stage);
        tile_epi<TC>(acc, [&](int i, int j, float a) {
            bool in = j <= i && i < l;
            float x = scale * a;
            sE[i * GDR_LD + j] = in ? x * sA[i * GDR_LD + j] : 0.f;
            sG[i * GDR_LD + j] = in ? x * gamma(i, j) : 0.f;
        });
    }
    __syncthreads();
    if (tid < GDR_C) {
        float rs = 0.f, cs = 0.f;
        for (int j = 0; j < GDR_C; ++j) rs += sE[tid * GDR_LD + j];
        for (int i = 0; i < GDR_C; ++i) cs += sE[i * GDR_LD + tid];
        s_dgam[tid] += rs - cs;
    }
    // dq = e^gam (scale dO S0^T) ; dgam_i += <dq_i, q_i> ; dq += G K.
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, dv, [&](int i, int c) { return i < l ? ld(oc, i * vrow + c) : 0.f; },
            [&](int c, int x) { return j0 + x < dk ? ld(s0, (i64)(j0 + x) * dv + c) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (i < l && j0 + x < dk) dqc[i * prow + j0 + x] = s_eg[i] * (scale * a);
        });
    }
    __syncthreads();
    for (int i = warp; i < l; i += GDR_NT / 32) {
        float s = warp_row_dot(dk, [&](int x) { return dqc[i * prow + x] * ld(qc, i * krow + x); });
        if (lane == 0) s_dgam[i] += s;
    }
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int i, int j) { return sG[i * GDR_LD + j]; },
            [&](int j, int x) { return j0 + x < dk ? kld(j, j0 + x) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (i < l && j0 + x < dk) dqc[i * prow + j0 + x] += a;
        });
    }
    // dk = e^(gam_L - gam) (D dS^T) ; t_i = <dk_i, k_i>: dgam_L += sum t, dgam_i -= t_i ;
    // dgam_L += e^gam_L <S0, dS> ; dk += G^T Q.
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, dv, [&](int i, int c) { return Dm[(i64)i * dv + c]; },
            [&](int c, int x) { return j0 + x < dk ? ld(ds, (i64)(j0 + x) * dv + c) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (i < l && j0 + x < dk) dkc[i * prow + j0 + x] = s_ed[i] * a;
        });
    }
    __syncthreads();
    for (int i = warp; i < GDR_C; i += GDR_NT / 32) {
        float s = i < l ? warp_row_dot(dk, [&](int x) { return dkc[i * prow + x] * ld(kc, i * krow + x); }) : 0.f;
        if (lane == 0) s_tmp[i] = s;
    }
    float sds;
    {
        float p = 0.f;
        const i64 nn = (i64)dk * dv;
        for (i64 e = tid; e < nn; e += GDR_NT) p += ld(s0, e) * ld(ds, e);
        sds = block_sum(p, s_red);  // synchronizes
    }
    if (tid < GDR_C) {
        float d = s_dgam[tid] - s_tmp[tid];
        if (tid == l - 1) {
            float t = 0.f;
            for (int i = 0; i < GDR_C; ++i) t += s_tmp[i];
            d += egl * sds + t;
        }
        s_dgam[tid] = d;
    }
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int j, int i) { return sG[i * GDR_LD + j]; },
            [&](int i, int x) { return j0 + x < dk ? qld(i, j0 + x) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int j, int x, float a) {
            if (j < l && j0 + x < dk) dkc[j * prow + j0 + x] += a;
        });
    }
    // dW = -dD S0^T.
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, dv, [&](int i, int c) { return dD[(i64)i * dv + c]; },
            [&](int c, int x) { return j0 + x < dk ? ld(s0, (i64)(j0 + x) * dv + c) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (j0 + x < dk) dW[(i64)i * dk + j0 + x] = -a;
        });
    }
    __syncthreads();
    // dT = dD Vb^T + dW Kb^T (into sA).
    {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, dv, [&](int i, int c) { return dD[(i64)i * dv + c]; },
            [&](int c, int j) { return j < l ? s_beta[j] * ld(vc, j * vrow + c) : 0.f; }, stage);
        tile_mma<TC, true, true>(
            acc, dk, [&](int i, int x) { return dW[(i64)i * dk + x]; },
            [&](int x, int j) { return j < l ? (s_beta[j] * s_eg[j]) * ld(kc, j * krow + x) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int j, float a) { sA[i * GDR_LD + j] = a; });
    }
    // dVb = T^T dD ; dKb = T^T dW.
    for (int j0 = 0; j0 < dv; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int m, int i) { return sT[i * GDR_LD + m]; },
            [&](int i, int c) { return j0 + c < dv ? dD[(i64)i * dv + j0 + c] : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int m, int c, float a) {
            if (j0 + c < dv) dVb[(i64)m * dv + j0 + c] = a;
        });
    }
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int m, int i) { return sT[i * GDR_LD + m]; },
            [&](int i, int x) { return j0 + x < dk ? dW[(i64)i * dk + j0 + x] : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int m, int x, float a) {
            if (j0 + x < dk) dKb[(i64)m * dk + j0 + x] = a;
        });
    }
    __syncthreads();
    // v: dv = beta dVb, dbeta += <dVb, v>. Kb: dk += beta e^gam dKb, d = <dKb, k>,
    // dbeta += e^gam d, dgam += beta e^gam d.
    for (int i = warp; i < l; i += GDR_NT / 32) {
        float sv = warp_row_dot(dv, [&](int c) { return dVb[(i64)i * dv + c] * ld(vc, i * vrow + c); });
        float sk = warp_row_dot(dk, [&](int x) { return dKb[(i64)i * dk + x] * ld(kc, i * krow + x); });
        const float b = s_beta[i], bge = b * s_eg[i];
        for (int c = lane; c < dv; c += 32) st(dv_out, (G.t0 + i) * vrow + (i64)G.hv * dv + c, b * dVb[(i64)i * dv + c]);
        for (int x = lane; x < dk; x += 32) dkc[i * prow + x] += bge * dKb[(i64)i * dk + x];
        if (lane == 0) {
            s_db[i] += sv + s_eg[i] * sk;
            s_dgam[i] += bge * sk;
        }
    }
    __syncthreads();
    // dM = -T^T dT T^T: tmp = T^T dT (into sE), dM = -(tmp T^T) (into sG).
    {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int m, int i) { return sT[i * GDR_LD + m]; },
            [&](int i, int n) { return sA[i * GDR_LD + n]; }, stage);
        tile_epi<TC>(acc, [&](int m, int n, float a) { sE[m * GDR_LD + n] = a; });
    }
    __syncthreads();
    {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, true>(
            acc, GDR_C, [&](int m, int p) { return sE[m * GDR_LD + p]; },
            [&](int p, int n) { return sT[n * GDR_LD + p]; }, stage);
        tile_epi<TC>(acc, [&](int m, int n, float a) { sG[m * GDR_LD + n] = -a; });
    }
    __syncthreads();
    // M_ij = beta_i P_ij Gamma_ij (j < i): dbeta_i += sum_j dM_ij P_ij Gamma_ij ;
    // f = dM_ij beta_i P_ij Gamma_ij: dgam_i += f, dgam_j -= f ; dP_ij = dM_ij beta_i Gamma_ij.
    if (tid < GDR_C) {
        const int i = tid;
        float db = 0.f, fr = 0.f, fc = 0.f;
        if (i < l) {
            for (int j = 0; j < i; ++j) {
                float x = sG[i * GDR_LD + j];
                float pg = sP[i * GDR_LD + j] * gamma(i, j);
                db += x * pg;
                fr += x * s_beta[i] * pg;
            }
            for (int m = i + 1; m < l; ++m) {
                fc += sG[m * GDR_LD + i] * s_beta[m] * (sP[m * GDR_LD + i] * gamma(m, i));
            }
        }
        s_db[i] += db;
        s_dgam[i] += fr - fc;
    }
    for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
        int i = e >> 6, j = e & 63;
        float d = 0.f;
        if (j < i && i < l) d = sG[i * GDR_LD + j] * s_beta[i] * gamma(i, j);
        else if (i < j && j < l) d = sG[j * GDR_LD + i] * s_beta[j] * gamma(j, i);
        sE[i * GDR_LD + j] = d;
    }
    __syncthreads();
    // dk += dP_sym K.
    for (int j0 = 0; j0 < dk; j0 += 64) {
        float acc[4][4];
        tile_zero(acc);
        tile_mma<TC, true, false>(
            acc, GDR_C, [&](int i, int j) { return sE[i * GDR_LD + j]; },
            [&](int j, int x) { return j0 + x < dk ? kld(j, j0 + x) : 0.f; }, stage);
        tile_epi<TC>(acc, [&](int i, int x, float a) {
            if (i < l && j0 + x < dk) dkc[i * prow + j0 + x] += a;
        });
    }
    // gam = cumsum(g): dg_j = sum_{i >= j} dgam_i.
    if (tid == 0) {
        float acc = 0.f;
        for (int i = l - 1; i >= 0; --i) {
            acc += s_dgam[i];
            dg[(G.t0 + i) * hv_n + G.hv] = acc;
        }
    }
    if (tid < l) st(dbeta, (G.t0 + tid) * hv_n + G.hv, s_db[tid]);
}

// dq, dk [tokens, Hk, Dk]: the sum over the GVA group of the per-value-head partials (in head
// order), through the l2 norm when it is in the kernel (y = x rstd recomputed in fp32 from the
// raw input). One warp per (token, key head) row; rows at or after `used` get 0.
template <typename T>
__device__ void gdr_reduce_qk(const T* __restrict__ q, const T* __restrict__ k, const float* __restrict__ dq_part,
                              const float* __restrict__ dk_part, i64 tokens, i64 used, int hk_n, int hv_n, int dk,
                              int l2norm, T* __restrict__ dq, T* __restrict__ dk_out) {
    i64 row = (i64)blockIdx.x * (GDR_NT / 32) + (threadIdx.x >> 5);
    if (row >= tokens * hk_n) return;
    const int lane = threadIdx.x & 31;
    const i64 t = row / hk_n;
    const int kh = (int)(row % hk_n);
    const int ratio = hv_n / hk_n;
    for (int which = 0; which < 2; ++which) {
        const T* x = which == 0 ? q : k;
        const float* part = which == 0 ? dq_part : dk_part;
        T* out = which == 0 ? dq : dk_out;
        float dy[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int c = lane + 32 * u;
            float s = 0.f;
            if (c < dk && t < used) {
                for (int j = 0; j < ratio; ++j) s += part[(t * hv_n + (i64)kh * ratio + j) * dk + c];
            }
            dy[u] = s;
        }
        if (l2norm && t < used) {
            float ss = 0.f;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                int c = lane + 32 * u;
                if (c < dk) { float xv = ld(x, row * dk + c); ss += xv * xv; }
            }
            float rstd = 1.f / sqrtf(warp_sum(ss) + 1e-6f);
            float d = 0.f;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                int c = lane + 32 * u;
                if (c < dk) d += dy[u] * (ld(x, row * dk + c) * rstd);
            }
            d = warp_sum(d);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                int c = lane + 32 * u;
                if (c < dk) dy[u] = rstd * (dy[u] - (ld(x, row * dk + c) * rstd) * d);
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int c = lane + 32 * u;
            if (c < dk) st(out, row * dk + c, dy[u]);
        }
    }
}

// =============================================================================================
// v6 forward (issue 13, stage A): bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation),
// ldmatrix fragments, cp.async double buffering, the scan and the output fused so the chunk
// states never reach memory. bf16 storage only (the f32 verification path keeps v5).
//
//   gdr_l2norm2   normalized q / k rows in fp32 (prep's K K^T, qk6's Q K^T) and in bf16 (gdr_fwd6)
//   gdr_prep6     gdr_prep with W stored in bf16 (U, gam fp32, as before)
//   gdr_qk6       per (chunk, value head): A = lower_incl(Q K^T * Gamma) in bf16 (computed as v5's
//                 gdr_output does, TF32 products: a q.k that cancels keeps its accuracy)
//   gdr_fwd6      per (sequence, value head, V tile of BV = 16 NW columns), NW warps; warp w owns
//                 the tile's columns 16 w .. 16 w + 15 and keeps their S^T (16 x DK, fp32) in
//                 registers as m16n8 accumulator fragments. Per chunk (operands in shared memory,
//                 the next chunk's loads in flight):
//                   X   = S^T W^T                 (16 x 64)        A operand: S^T as bf16
//                   D^T = U^T - X                 (fp32, from the U tile)
//                   S^T = e^gam_L S^T + (D^T diag(e^(gam_L - gam))) K          A: D~^T as bf16
//                   O^T = scale (S0^T Q^T diag(e^gam) + D^T A^T)          A: S0^T, D^T as bf16
//                 An accumulator fragment (rows g, g + 8; columns 2t, 2t + 1 of two adjacent
//                 n8 tiles) is exactly the A fragment of the next product (FlashAttention-2's
//                 register reuse), so the serial chain S -> D -> S never leaves the registers.
//                 Each column of S evolves independently, so the V split is exact.
//   gdr_chain6    one CTA, `steps` dependent chunk steps of the same chain on operands resident
//                 in shared memory (the scan's latency floor; bench only)
//
// PTX fragment maps used (g = lane / 4, t = lane % 4), m16n8k16 .bf16:
//   A (16 x 16, row): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)
//   B (16 x 8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t + 8.., n g)
//   C (16 x 8):       c0, c1 = (g, 2t), (g, 2t + 1); c2, c3 = (g + 8, 2t), (g + 8, 2t + 1)
// Each 32-bit register holds the element of the smaller k (or column) in its low half.
// ldmatrix .x4: lanes 8m .. 8m + 7 give the row addresses of 8x8 matrix m; register m of a lane
// receives row g, elements 2t, 2t + 1 of matrix m (with .trans: elements (2t, g), (2t + 1, g)).

// Two fp32 as a bf16x2 register (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A D / dD workspace element (gdr_hrec6 / gdr_bwd6 / gdr_bwd8 and their bf16 "b" variants): fp32
// as is, or rounded to nearest even by one cvt (the bits pack_bf16 gives).
__device__ __forceinline__ void st_ws(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st_ws(bf16_t* p, i64 i, float v) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    p[i] = r;
}

// c += a b, m16n8k16, bf16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// 16 bytes global -> shared, asynchronous; `valid` false writes 16 zero bytes (reads nothing).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    unsigned n = valid ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Wait until at most N of this thread's most recent cp.async groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ unsigned dyn_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Layout of one pipeline stage of gdr_fwd6 (bytes; every region 16-byte aligned, rows padded
// so that ldmatrix's 8 row addresses fall in 8 different 16-byte bank groups). cuda.rs
// (v6_stage_bytes) computes STAGE with the same formula.
template <int DK, int NW>
struct V6 {
    static constexpr int BV = 16 * NW;
    static constexpr int NT = 32 * NW;
    static constexpr int LK = DK + 8;       // bf16 row stride of W, K, Q
    static constexpr int LA = GDR_C + 8;    // bf16 row stride of A
    static constexpr int LU = BV + 4;       // fp32 row stride of U (conflict-free C-layout reads)
    static constexpr int W_OFF = 0;
    static constexpr int K_OFF = W_OFF + GDR_C * LK * 2;
    static constexpr int Q_OFF = K_OFF + GDR_C * LK * 2;
    static constexpr int A_OFF = Q_OFF + GDR_C * LK * 2;
    static constexpr int U_OFF = A_OFF + GDR_C * LA * 2;
    static constexpr int G_OFF = U_OFF + GDR_C * LU * 4;
    static constexpr int STAGE = G_OFF + GDR_C * 4;
};

// Issue one chunk's loads into a stage (all threads of the CTA), as one cp.async group: W
// (64 x DK bf16, rows >= l are zero in the workspace), K and Q rows (rows >= l zero-filled,
// never read: they may belong to the next sequence or lie past the buffer), A (64 x 64 bf16),
// the CTA's U tile (64 x BV fp32) and gam (64 fp32).
template <int DK, int NW>
__device__ __forceinline__ void v6_load_stage(char* st, const bf16_t* wc, const bf16_t* kc, const bf16_t* qc,
                                              i64 krow, int l, const bf16_t* ac, const float* uc, i64 urow,
                                              const float* gc) {
    typedef V6<DK, NW> L;
    const int tid = threadIdx.x;
    constexpr int CPR = DK / 8;  // 16-byte pieces per row of W, K, Q
    for (int e = tid; e < GDR_C * CPR; e += L::NT) {
        const int i = e / CPR, x = (e % CPR) * 8;
        const bool ok = i < l;
        const i64 r = ok ? i : 0;
        cp_async16(st + L::W_OFF + (i * L::LK + x) * 2, wc + (i64)i * DK + x, true);
        cp_async16(st + L::K_OFF + (i * L::LK + x) * 2, kc + r * krow + x, ok);
        cp_async16(st + L::Q_OFF + (i * L::LK + x) * 2, qc + r * krow + x, ok);
    }
    for (int e = tid; e < GDR_C * 8; e += L::NT) {
        const int i = e >> 3, x = (e & 7) * 8;
        cp_async16(st + L::A_OFF + (i * L::LA + x) * 2, ac + i * GDR_C + x, true);
    }
    constexpr int UPR = L::BV / 4;
    for (int e = tid; e < GDR_C * UPR; e += L::NT) {
        const int i = e / UPR, x = (e % UPR) * 4;
        cp_async16(st + L::U_OFF + (i * L::LU + x) * 4, uc + (i64)i * urow + x, true);
    }
    if (tid < GDR_C / 4) cp_async16(st + L::G_OFF + tid * 16, gc + tid * 4, true);
    cp_async_commit();
}

// cp.async of 16 bytes to a shared-memory address given as a 32-bit shared-window offset;
// `n` 16 or 0 (0 reads nothing and writes 16 zero bytes).
__device__ __forceinline__ void cp_async16_s(unsigned dst, const void* src, unsigned n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}

// v6_load_stage with the per-thread addresses computed once per chunk (gdr_fwd6 with LOADS 3):
// thread tid always copies the same 16-byte column piece of the rows tid / CPR + RPP m, so
// every shared-memory offset and W / A / gam offset is a compile-time constant from one base,
// and K, Q, U advance by one runtime row step per pass. Same bytes to the same places as
// v6_load_stage (rows >= l of K, Q zero-filled).
template <int DK, int NW>
__device__ __forceinline__ void v6_load_stage_lean(char* st, const bf16_t* wc, const bf16_t* kc, const bf16_t* qc,
                                                   i64 krow, int l, const bf16_t* ac, const float* uc, i64 urow,
                                                   const float* gc) {
    typedef V6<DK, NW> L;
    const int tid = threadIdx.x;
    const unsigned sb = smem_addr(st);
    constexpr int CPR = DK / 8;       // 16-byte pieces per row of W, K, Q
    constexpr int RPP = L::NT / CPR;  // rows per pass
    static_assert(L::NT % CPR == 0 && GDR_C % RPP == 0, "whole rows per pass");
    {
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const bf16_t* gw = wc + i0 * DK + x;
        const bf16_t* gk = kc + i0 * krow + x;
        const bf16_t* gq = qc + i0 * krow + x;
        const i64 step = RPP * krow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPP; ++m) {
            const bool ok = i0 + RPP * m < l;
            const unsigned n = ok ? 16u : 0u;
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            cp_async16_s(sr + L::W_OFF, gw + RPP * m * DK, 16u);
            cp_async16_s(sr + L::K_OFF, ok ? gk : kc, n);
            cp_async16_s(sr + L::Q_OFF, ok ? gq : qc, n);
            gk += step;
            gq += step;
        }
    }
    {
        constexpr int RPA = L::NT / 8;  // A: 8 pieces per row
        const int i0 = tid >> 3, x = (tid & 7) * 8;
        const unsigned so = sb + L::A_OFF + (unsigned)((i0 * L::LA + x) * 2);
        const bf16_t* ga = ac + i0 * GDR_C + x;
#pragma unroll
        for (int m = 0; m < GDR_C / RPA; ++m)
            cp_async16_s(so + (unsigned)(RPA * m * L::LA * 2), ga + RPA * m * GDR_C, 16u);
    }
    {
        constexpr int UPR = L::BV / 4;   // U: 16-byte pieces per row of the tile
        constexpr int RPU = L::NT / UPR;  // 8 rows per pass
        const int i0 = tid / UPR, x = (tid % UPR) * 4;
        const unsigned so = sb + L::U_OFF + (unsigned)((i0 * L::LU + x) * 4);
        const float* gu = uc + i0 * urow + x;
        const i64 step = RPU * urow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPU; ++m) {
            cp_async16_s(so + (unsigned)(RPU * m * L::LU * 4), gu, 16u);
            gu += step;
        }
    }
    if (tid < GDR_C / 4) cp_async16_s(sb + L::G_OFF + tid * 16, gc + tid * 4, 16u);
    cp_async_commit();
}

// Hopper bulk copies (the TMA engine, 1-D, sm_90): a copy of `bytes` (multiple of 16, 16-byte
// aligned ends) global -> shared completes on an mbarrier by its byte count. Only compiled for
// sm_90+ (the sm_80 build of the module keeps the symbols: the bodies are empty there and the
// Rust side never selects them below sm_90).
__device__ __forceinline__ void mbar_init(void* bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void fence_mbar_init() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory accesses before later async-proxy (bulk
// copy) accesses of the same memory.
__device__ __forceinline__ void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(void* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, void* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
#endif
}
// Wait until the barrier's phase with parity `parity` has completed (acquire: the bulk copies'
// data is visible to this thread afterwards).
__device__ __forceinline__ void mbar_wait(void* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    }
#endif
}

// The same stage as v6_load_stage, by bulk copies issued from warp 0 (one row each: the stage's
// rows are padded, the sources are not contiguous in general), completing on `bar`. K, Q rows
// >= l are not copied: they keep finite data of an earlier chunk (or the zeros the kernel
// starts with), which only meets zero coefficients (D~ rows >= l are 0; O rows >= l are not
// stored). Call from warp 0 only.
template <int DK, int NW>
__device__ __forceinline__ void v6_bulk_stage(char* st, void* bar, const bf16_t* wc, const bf16_t* kc,
                                              const bf16_t* qc, i64 krow, int l, const bf16_t* ac,
                                              const float* uc, i64 urow, const float* gc) {
    typedef V6<DK, NW> L;
    const int lane = threadIdx.x & 31;
    constexpr unsigned RK = DK * 2, RA = GDR_C * 2, RU = L::BV * 4;
    if (lane == 0) {
        const unsigned bytes = GDR_C * RK + 2u * (unsigned)l * RK + GDR_C * RA + GDR_C * RU + GDR_C * 4;
        mbar_expect_tx(bar, bytes);
    }
    __syncwarp();
    fence_proxy_async();
    for (int i = lane; i < GDR_C; i += 32) {
        bulk_g2s(st + L::W_OFF + i * L::LK * 2, wc + (i64)i * DK, RK, bar);
        if (i < l) {
            bulk_g2s(st + L::K_OFF + i * L::LK * 2, kc + (i64)i * krow, RK, bar);
            bulk_g2s(st + L::Q_OFF + i * L::LK * 2, qc + (i64)i * krow, RK, bar);
        }
        bulk_g2s(st + L::A_OFF + i * L::LA * 2, ac + i * GDR_C, RA, bar);
        bulk_g2s(st + L::U_OFF + i * L::LU * 4, uc + (i64)i * urow, RU, bar);
    }
    if (lane == 0) bulk_g2s(st + L::G_OFF, gc, GDR_C * 4, bar);
}

// S^T (16 x DK fp32 accumulator fragments) as bf16 A fragments, one per 16-deep k step.
template <int DK>
__device__ __forceinline__ void v6_s_frags(const float (&s)[DK / 8][4], unsigned (&sa)[DK / 16][4]) {
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
        sa[ks][0] = pack_bf16(s[2 * ks][0], s[2 * ks][1]);
        sa[ks][1] = pack_bf16(s[2 * ks][2], s[2 * ks][3]);
        sa[ks][2] = pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        sa[ks][3] = pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
}

// x (16 x 64, 8 n8 tiles over the chunk rows i) += sa (16 x DK) times M^T, where M (64 x DK,
// bf16, row stride ld) is in shared memory: B[k][n] = M[n][k] is a row-major read of M.
template <int DK>
__device__ __forceinline__ void v6_mul_rows_t(float (&x)[8][4], const unsigned (&sa)[DK / 16][4],
                                              const bf16_t* m, int ld) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks)
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
            unsigned b[4];
            ldsm_x4(b, m + (16 * jp + 8 * (mi >> 1) + r) * ld + 16 * ks + 8 * (mi & 1));
            mma_bf16(x[2 * jp], sa[ks], b[0], b[1]);
            mma_bf16(x[2 * jp + 1], sa[ks], b[2], b[3]);
        }
}

// One chunk step of the chain for this warp: D^T = U^T - S^T W^T, then S^T <- e^gl S^T +
// (D^T diag(ed)) K. Leaves S0^T (the chunk-start state) as bf16 A fragments in `sa` and D^T
// (unscaled) in `da`, for the output. `u` is the CTA's U tile (fp32, row stride lu) offset to
// this warp's first column; s_gam the chunk's gam; l the valid rows. SD (gdr_hrec6): D (fp32,
// before its rounding to bf16) is also stored, D[i][v] at dst[i * ldd + v] for the warp's 16
// columns v (all 64 rows: rows >= l are 0); TD bf16: rounded to nearest even (gdr_hrec6b).
template <int DK, bool SD = false, typename TD = float>
__device__ __forceinline__ void v6_chain_step(float (&s)[DK / 8][4], unsigned (&sa)[DK / 16][4],
                                              unsigned (&da)[4][4], const bf16_t* sw, const bf16_t* sk,
                                              int lk, const float* u, int lu, const float* s_gam, int l,
                                              TD* dst = nullptr, i64 ldd = 0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, mi = lane >> 3, r = lane & 7;
    v6_s_frags<DK>(s, sa);
    float x[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) x[j][c] = 0.f;
    v6_mul_rows_t<DK>(x, sa, sw, lk);
    const float gl = s_gam[l - 1];
    unsigned dsa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
            const float e0 = i0 < l ? __expf(gl - s_gam[i0]) : 0.f;
            const float e1 = i0 + 1 < l ? __expf(gl - s_gam[i0 + 1]) : 0.f;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int v = g + 8 * rr;
                const float d0 = u[i0 * lu + v] - x[j][2 * rr];
                const float d1 = u[(i0 + 1) * lu + v] - x[j][2 * rr + 1];
                if (SD) {
                    st_ws(dst, (i64)i0 * ldd + v, d0);
                    st_ws(dst, (i64)(i0 + 1) * ldd + v, d1);
                }
                da[kk][rr + 2 * h] = pack_bf16(d0, d1);
                dsa[kk][rr + 2 * h] = pack_bf16(e0 * d0, e1 * d1);
            }
        }
    const float egl = __expf(gl);
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] *= egl;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < DK / 16; ++np) {
            unsigned b[4];
            ldsm_x4_t(b, sk + (16 * kk + 8 * (mi & 1) + r) * lk + 16 * np + 8 * (mi >> 1));
            mma_bf16(s[2 * np], dsa[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], dsa[kk], b[2], b[3]);
        }
}

// Forward, scan and output fused (see the v6 header above). Grid: N * Hv * (dv / BV) CTAs of
// 32 NW threads, dynamic shared memory 2 * V6<DK, NW>::STAGE. q, k are bf16 (the normalized
// copies with the in-kernel norm), W bf16, U fp32, A bf16 (gdr_qk6), gam fp32 (gdr_prep6).
// LOADS: 0 cp.async (sm_80+), 1 bulk copies on mbarriers (sm_90), 2 diagnostic (benchmarks
// only, wrong results): cp.async for the first NS chunks, then every chunk reuses their stages;
// 3 cp.async with the addresses computed once per chunk (v6_load_stage_lean: the same bytes).
// NS: pipeline stages (2 or 3): chunk c + NS - 1 is in flight while chunk c computes. Dynamic
// shared memory: NS * STAGE (+ 32 bytes of mbarriers with LOADS 1).
template <int DK, int NW, int LOADS, int NS>
__device__ void gdr_fwd6(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const float* __restrict__ gam_ws, const bf16_t* __restrict__ w_ws,
                         const float* __restrict__ u_ws, const bf16_t* __restrict__ a_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                         const float* __restrict__ h0, bf16_t* __restrict__ o, float* __restrict__ fin) {
    typedef V6<DK, NW> L;
    // A launch with too little shared memory writes nothing (tests see the poisoned output).
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    if (dyn_smem_bytes() < (unsigned)(NS * L::STAGE) + (LOADS == 1 ? 32u : 0u)) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    // LOADS 1: NS mbarriers after the stages; the stages start zeroed (see v6_bulk_stage).
    char* bars = sm + NS * L::STAGE;
    if (LOADS == 1) {
        for (int e = threadIdx.x; e < NS * L::STAGE / 16; e += L::NT)
            reinterpret_cast<uint4*>(sm)[e] = make_uint4(0u, 0u, 0u, 0u);
        fence_proxy_async();
        if (threadIdx.x == 0) {
            for (int i = 0; i < NS; ++i) mbar_init(bars + 8 * i, 1);
            fence_mbar_init();
        }
        __syncthreads();
    }
    const int nvt = dv / L::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 col0 = (i64)vt * L::BV;       // the CTA's first state column
    const int wc0 = 16 * warp;              // this warp's first column inside the tile
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;

    // s[nt][c] = S[8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage) {
        const i64 cb = c * hv_n + hv;
        const i64 t0 = ch_t0[c];
        if (LOADS == 1) {
            if (warp == 0)
                v6_bulk_stage<DK, NW>(sm + stage * L::STAGE, bars + 8 * stage,
                                      w_ws + cb * GDR_C * DK, k + t0 * krow + (i64)kh * DK,
                                      q + t0 * krow + (i64)kh * DK, krow, ch_len[c], a_ws + cb * GDR_C * GDR_C,
                                      u_ws + cb * GDR_C * dv + col0, (i64)dv, gam_ws + cb * GDR_C);
        } else if (LOADS == 3) {
            v6_load_stage_lean<DK, NW>(sm + stage * L::STAGE, w_ws + cb * GDR_C * DK,
                                       k + t0 * krow + (i64)kh * DK, q + t0 * krow + (i64)kh * DK, krow,
                                       ch_len[c], a_ws + cb * GDR_C * GDR_C, u_ws + cb * GDR_C * dv + col0,
                                       (i64)dv, gam_ws + cb * GDR_C);
        } else if (LOADS == 0 || c < c_beg + NS) {
            v6_load_stage<DK, NW>(sm + stage * L::STAGE, w_ws + cb * GDR_C * DK, k + t0 * krow + (i64)kh * DK,
                                  q + t0 * krow + (i64)kh * DK, krow, ch_len[c], a_ws + cb * GDR_C * GDR_C,
                                  u_ws + cb * GDR_C * dv + col0, (i64)dv, gam_ws + cb * GDR_C);
        } else {
            cp_async_commit();  // an empty group keeps the group count of wait_group right
        }
    };
    // Prologue: chunks c_beg .. c_beg + NS - 2 in flight (cp.async: one group each, empty
    // groups past the sequence's end).
#pragma unroll
    for (int p = 0; p < NS - 1; ++p) {
        if (c_beg + p < c_end) issue(c_beg + p, p);
        else if (LOADS != 1) cp_async_commit();
    }
    const int mi = lane >> 3, r = lane & 7;
    for (i64 c = c_beg; c < c_end; ++c) {
        const int stg = (int)((c - c_beg) % NS);
        if (LOADS == 1)
            mbar_wait(bars + 8 * stg, (unsigned)(((c - c_beg) / NS) & 1));
        else
            cp_async_wait_group<NS - 2>();  // chunk c's group (only the NS - 2 newer may pend)
        // Stage stg (chunk c) is complete and visible to all; every warp is done with stage
        // (c - 1) % NS (chunk c - 1), which now receives chunk c + NS - 1.
        __syncthreads();
        if (c + NS - 1 < c_end) issue(c + NS - 1, (int)((c + NS - 1 - c_beg) % NS));
        else if (LOADS != 1) cp_async_commit();
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF);
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF);
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF);
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const float* sU = reinterpret_cast<const float*>(sp + L::U_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const int l = ch_len[c];
        const i64 t0 = ch_t0[c];

        unsigned sa[DK / 16][4], da[4][4];
        v6_chain_step<DK>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, l);

        // O^T = S0^T Q^T, scaled by e^gam per chunk row, + D^T A^T (A lower triangular: only
        // the 16 x 16 blocks on or below the diagonal).
        float oacc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) oacc[j][cc] = 0.f;
        v6_mul_rows_t<DK>(oacc, sa, sQ, L::LK);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i0 = 8 * j + 2 * t;
            const float e0 = i0 < l ? __expf(sG[i0]) : 0.f;
            const float e1 = i0 + 1 < l ? __expf(sG[i0 + 1]) : 0.f;
            oacc[j][0] *= e0;
            oacc[j][1] *= e1;
            oacc[j][2] *= e0;
            oacc[j][3] *= e1;
        }
#pragma unroll
        for (int jp = 0; jp < 4; ++jp)
#pragma unroll
            for (int kk = 0; kk <= jp; ++kk) {
                unsigned bb[4];
                ldsm_x4(bb, sA + (16 * jp + 8 * (mi >> 1) + r) * L::LA + 16 * kk + 8 * (mi & 1));
                mma_bf16(oacc[2 * jp], da[kk], bb[0], bb[1]);
                mma_bf16(oacc[2 * jp + 1], da[kk], bb[2], bb[3]);
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
    if (fin) {
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                fin[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
}

// Chain microbenchmark: one CTA of NW warps runs `steps` dependent chunk steps of gdr_fwd6's
// chain (no output unless OUT) on one chunk's operands (W, K bf16 [64][DK]; U fp32 [64][16 NW];
// gam fp32 [64]) loaded once, then writes S [DK][16 NW] (fp32) to `out`.
template <int DK, int NW, bool OUT>
__device__ void gdr_chain6(const bf16_t* __restrict__ w, const bf16_t* __restrict__ kk,
                           const bf16_t* __restrict__ a, const float* __restrict__ u,
                           const float* __restrict__ gam, int steps, float* __restrict__ out) {
    typedef V6<DK, NW> L;
    if (dyn_smem_bytes() < (unsigned)L::STAGE) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r = lane & 7;
    const int wc0 = 16 * warp;
    v6_load_stage<DK, NW>(sm, w, kk, kk, (i64)DK, GDR_C, a, u, (i64)L::BV, gam);
    cp_async_wait_all();
    __syncthreads();
    const bf16_t* sW = reinterpret_cast<const bf16_t*>(sm + L::W_OFF);
    const bf16_t* sK = reinterpret_cast<const bf16_t*>(sm + L::K_OFF);
    const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sm + L::Q_OFF);
    const bf16_t* sA = reinterpret_cast<const bf16_t*>(sm + L::A_OFF);
    const float* sU = reinterpret_cast<const float*>(sm + L::U_OFF);
    const float* sG = reinterpret_cast<const float*>(sm + L::G_OFF);
    float s[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] = 0.f;
    float osum = 0.f;
    for (int step = 0; step < steps; ++step) {
        unsigned sa[DK / 16][4], da[4][4];
        v6_chain_step<DK>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, GDR_C);
        if (OUT) {
            float oacc[8][4];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) oacc[j][cc] = 0.f;
            v6_mul_rows_t<DK>(oacc, sa, sQ, L::LK);
#pragma unroll
            for (int jp = 0; jp < 4; ++jp)
#pragma unroll
                for (int k2 = 0; k2 <= jp; ++k2) {
                    unsigned bb[4];
                    ldsm_x4(bb, sA + (16 * jp + 8 * (mi >> 1) + r) * L::LA + 16 * k2 + 8 * (mi & 1));
                    mma_bf16(oacc[2 * jp], da[k2], bb[0], bb[1]);
                    mma_bf16(oacc[2 * jp + 1], da[k2], bb[2], bb[3]);
                }
#pragma unroll
            for (int j = 0; j < 8; ++j) osum += oacc[j][0] + oacc[j][1] + oacc[j][2] + oacc[j][3];
        }
    }
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            out[(8 * nt + 2 * t + (c & 1)) * L::BV + wc0 + g + 8 * (c >> 1)] = s[nt][c] + 0.f * osum;
}

// A = lower_incl(Q K^T * Gamma) of a chunk, rounded to bf16 (rows >= l zero): gdr_output's
// first product, on its own.
template <typename TQ, typename T>
__device__ void gdr_qk6(const TQ* __restrict__ q, const TQ* __restrict__ k, const float* __restrict__ gam_ws,
                        const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                        int dk, bf16_t* __restrict__ a_ws) {
    constexpr bool TC = tc_of<T>();
    ChunkGeo G = chunk_geo(ch_t0, ch_len, hv_n, hv_n / hk_n);
    const int l = G.l;
    const i64 cb = G.c * hv_n + G.hv;
    float* stage = gdr_smem;
    float* sA = stage + GDR_STAGE;
    float* s_gam = sA + GDR_MAT;
    float* s_eg = s_gam + GDR_C;
    const i64 krow = (i64)hk_n * dk;
    // The chunk's Q and K rows are copied to shared memory first (one round trip, rows >= l
    // zero; 64 dk sizeof(TQ) bytes each after the usual layout), then staged from there.
    TQ* s_q = reinterpret_cast<TQ*>(s_eg + GDR_C);
    TQ* s_k = s_q + GDR_C * dk;
    rows_to_smem(s_q, q + G.t0 * krow + (i64)G.kh * dk, krow, dk, l);
    rows_to_smem(s_k, k + G.t0 * krow + (i64)G.kh * dk, krow, dk, l);
    load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, nullptr);
    chunk_qk<TC>(s_q, s_k, (i64)dk, dk, l, s_gam, sA, stage);
    __syncthreads();
    for (int e = threadIdx.x; e < GDR_C * GDR_C; e += GDR_NT)
        a_ws[cb * (GDR_C * GDR_C) + e] = f32_to_bf16(sA[(e >> 6) * GDR_LD + (e & 63)]);
}

// L2 norm of rows (one warp per row) written twice: fp32 (y) and bf16 (yb).
template <typename TI>
__device__ void gdr_l2norm2(const TI* __restrict__ x, float* __restrict__ y, bf16_t* __restrict__ yb, i64 rows,
                            int d) {
    i64 row = (i64)blockIdx.x * (GDR_NT / 32) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const TI* xr = x + row * d;
    float ss = warp_row_dot(d, [&](int c) { float v = ld(xr, c); return v * v; });
    float r = 1.f / sqrtf(ss + 1e-6f);
    for (int c = threadIdx.x & 31; c < d; c += 32) {
        float v = ld(xr, c) * r;
        y[row * d + c] = v;
        yb[row * d + c] = f32_to_bf16(v);
    }
}

// =============================================================================================
// v6 backward (issue 13, stage A; opt-in, cuda::BwdKernel::V6): the two sequential scans of
// backward on bf16 tensor cores in gdr_fwd6's style: one warp per 16 state columns, the state
// (or its gradient) in registers as fp32 m16n8 accumulator fragments, the chunk's operands
// double-buffered in shared memory by cp.async, the same fragment helpers (v6_s_frags,
// v6_mul_rows_t, the ldmatrix patterns of v6_chain_step; checked by chain6_matches_cpu).
//
//   gdr_hrec6   backward's recompute of the chunk-start states: gdr_fwd6's chain without the
//               output. Stores h[c] (fp32, [Dk][Dv] per chunk-head: v5's layout) before each step
//               and D (fp32, [64][Dv] per chunk-head: v5's layout) from the step. Inputs as
//               gdr_fwd6 (W bf16 from gdr_prep6, U and gam fp32).
//   gdr_bwd6    the reverse scan with dD_loc folded in (v5's gdr_dd_local + gdr_scan_bwd). Chunks
//               in reverse; dS^T (16 x Dk per warp) is the gradient of the chunk's end state:
//                 dh[c] = dS                                   (stored fp32, v5's layout)
//                 X     = dS^T K^T                 (16 x 64)    A operand: dS^T as bf16
//                 dD^T  = scale dO^T A + X diag(e^(gam_L - gam))    A: dO^T by ldmatrix.trans;
//                                                               B: A = lower_incl(QK^T Gamma),
//                                                               only its blocks on / below the
//                                                               diagonal (gdr_qk6, bf16)
//                 dS^T <- e^gam_L dS^T + (dO diag(scale e^gam))^T Q - dD^T W
//                                                               A: dO^T scaled per chunk row,
//                                                               -dD^T, both bf16; B: Q, W rows
//               dD (fp32, v5's layout) for gdr_grad; dS at the sequence start is dh0.
//   gdr_cvt_*   element-wise fp32 <-> bf16 copies (W between the v5 and v6 pieces when only
//               some pieces are selected).
// With both pieces, h and dh can be stored bf16 (h16_ws / dh16_ws instead of the fp32 pointers,
// which are then null) for gdr_grad_h16_* (v5's gdr_grad reading bf16 states).

// A warp's 16 columns of a state (fragments s[nt][c] = S[8 nt + 2t + (c & 1)][g + 8 (c >> 1)]
// relative to the warp's first column) to a [DK][dv] state at `off`: fp32 into `f` or, when
// `f` is null, bf16 into `b`.
template <int DK>
__device__ __forceinline__ void v6_store_state(const float (&s)[DK / 8][4], float* f, bf16_t* b, i64 off, int dv) {
    const int t = threadIdx.x & 3;
    if (f) {
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) f[off + (i64)(8 * nt + 2 * t + (cc & 1)) * dv + 8 * (cc >> 1)] = s[nt][cc];
    } else {
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc)
                b[off + (i64)(8 * nt + 2 * t + (cc & 1)) * dv + 8 * (cc >> 1)] = f32_to_bf16(s[nt][cc]);
    }
}

// Four 8x8 b16 matrices from registers to shared memory, transposed (stmatrix .trans, sm_90):
// lanes 8m .. 8m + 7 give the addresses of the 8 rows of matrix m in memory; register m of lane
// (g, t) holds elements (g, 2t), (g, 2t + 1) of matrix m, which land at (2t, g), (2t + 1, g).
// Below sm_90 (no stmatrix) the same bytes by 2-byte shared stores, each lane fetching the two
// row addresses it needs from the lanes that hold them. Every lane of the warp takes part.
__device__ __forceinline__ void stsm_x4_t(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
#if __CUDA_ARCH__ >= 900
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
#else
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned r[4] = {r0, r1, r2, r3};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned a0 = __shfl_sync(0xffffffffu, a, 8 * m + 2 * t);
        const unsigned a1 = __shfl_sync(0xffffffffu, a, 8 * m + 2 * t + 1);
        asm volatile("st.shared.u16 [%0], %1;" ::"r"(a0 + 2u * g), "h"((unsigned short)(r[m] & 0xffffu))
                     : "memory");
        asm volatile("st.shared.u16 [%0], %1;" ::"r"(a1 + 2u * g), "h"((unsigned short)(r[m] >> 16))
                     : "memory");
    }
#endif
}

// A warp's 16-column bf16 tile of NB * 16 rows to global memory through shared memory (the bf16
// state and D / dD workspaces of gdr_hrec6 / gdr_bwd8): f[kb] holds tile rows 16 kb .. 16 kb + 15
// as the A fragments of its transpose (v6_s_frags' sa, v6_chain_step's da: register m of lane
// (g, t) the 8 x 8 block (m & 1, m >> 1) of columns x rows), which stsm_x4_t writes as rows
// of 16 columns; `row(R, h)` is the shared-memory address of half h (8 columns, 16 bytes) of tile
// row R (this warp's own bytes). They are read back as 16-byte pieces, two lanes per row, and
// written to dst + grow(R) * ld (+ 8 columns for h = 1): whole 32-byte sectors. The bits st_ws /
// f32_to_bf16 store for finite values (the fragments are pack_bf16's round to nearest even).
// v6_tile_out's second half, also gdr_fwd9's (v9_store_o): the staged NB * 16 rows read back as
// 16-byte pieces, two lanes per row, and written to dst + grow(R) * ld (+ 8 columns for h = 1),
// whole 32-byte sectors; with LIM only the rows whose grow(R) < l.
template <int NB, bool LIM, class RowAddr, class GRow>
__device__ __forceinline__ void v6_tile_flush(RowAddr row, GRow grow, bf16_t* dst, i64 ld, int l = 0) {
    const int lane = threadIdx.x & 31;
    __syncwarp();  // the staging stores are done
    const bool vec = (reinterpret_cast<unsigned long long>(dst) & 15) == 0 && (ld & 7) == 0;
#pragma unroll
    for (int kb = 0; kb < NB; ++kb) {
        const int R = 16 * kb + (lane >> 1), hf = lane & 1;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(row(R, hf))
                     : "memory");
        const int i = grow(R);
        if (!LIM || i < l) {
            bf16_t* d = dst + (i64)i * ld + 8 * hf;
            if (vec) {
                asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};" ::"l"(d), "r"(v.x), "r"(v.y), "r"(v.z),
                             "r"(v.w)
                             : "memory");
            } else {
                const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int e = 0; e < 8; ++e) d[e] = (bf16_t)(w[e >> 1] >> (16 * (e & 1)));
            }
        }
    }
    __syncwarp();  // the reads are done before the bytes are written again
}

template <int NB, class RowAddr, class GRow>
__device__ __forceinline__ void v6_tile_out(const unsigned (&f)[NB][4], RowAddr row, GRow grow, bf16_t* dst,
                                            i64 ld) {
    const int lane = threadIdx.x & 31, r = lane & 7, m = lane >> 3;
    __syncwarp();  // every lane's earlier reads of the staging bytes are done
#pragma unroll
    for (int kb = 0; kb < NB; ++kb)
        stsm_x4_t(row(16 * kb + 8 * (m >> 1) + r, m & 1), f[kb][0], f[kb][1], f[kb][2], f[kb][3]);
    v6_tile_flush<NB, false>(row, grow, dst, ld);
}

// The row addresses of a staging tile of 32-byte rows at `base` (shared memory): half h of row R
// at 32 R + 16 (h ^ (R / 4 % 2)), so the 8 rows of one stmatrix matrix hit 8 different 16-byte
// bank groups.
struct SwRow32 {
    unsigned base;
    __device__ __forceinline__ unsigned operator()(int R, int h) const {
        return base + (unsigned)(R * 32 + 16 * (h ^ ((R >> 2) & 1)));
    }
};

// One stage of gdr_hrec6 (bytes, 16-byte aligned regions): W, K (64 rows of DK + 8 bf16), the
// CTA's U tile (64 rows of BV + 4 fp32), gam (64 fp32).
template <int DK, int NW>
struct V6R {
    static constexpr int BV = 16 * NW;
    static constexpr int NT = 32 * NW;
    static constexpr int LK = DK + 8;
    static constexpr int LU = BV + 4;
    static constexpr int W_OFF = 0;
    static constexpr int K_OFF = W_OFF + GDR_C * LK * 2;
    static constexpr int U_OFF = K_OFF + GDR_C * LK * 2;
    static constexpr int G_OFF = U_OFF + GDR_C * LU * 4;
    static constexpr int STAGE = G_OFF + GDR_C * 4;
};

template <int DK, int NW>
__device__ __forceinline__ void v6r_load_stage(char* st, const bf16_t* wc, const bf16_t* kc, i64 krow, int l,
                                               const float* uc, i64 urow, const float* gc) {
    typedef V6R<DK, NW> L;
    const int tid = threadIdx.x;
    constexpr int CPR = DK / 8;
    for (int e = tid; e < GDR_C * CPR; e += L::NT) {
        const int i = e / CPR, x = (e % CPR) * 8;
        const bool ok = i < l;
        const i64 r = ok ? i : 0;
        cp_async16(st + L::W_OFF + (i * L::LK + x) * 2, wc + (i64)i * DK + x, true);
        cp_async16(st + L::K_OFF + (i * L::LK + x) * 2, kc + r * krow + x, ok);
    }
    constexpr int UPR = L::BV / 4;
    for (int e = tid; e < GDR_C * UPR; e += L::NT) {
        const int i = e / UPR, x = (e % UPR) * 4;
        cp_async16(st + L::U_OFF + (i * L::LU + x) * 4, uc + (i64)i * urow + x, true);
    }
    if (tid < GDR_C / 4) cp_async16(st + L::G_OFF + tid * 16, gc + tid * 4, true);
    cp_async_commit();
}

// Grid: N * Hv * (dv / BV) CTAs of 32 NW threads; dynamic shared memory 2 * V6R<DK, NW>::STAGE.
// TD: D's type (float, or bf16 for gdr_grad10b: gdr_hrec6b).
template <int DK, int NW, typename TD = float>
__device__ void gdr_hrec6(const bf16_t* __restrict__ k, const float* __restrict__ gam_ws,
                          const bf16_t* __restrict__ w_ws, const float* __restrict__ u_ws,
                          const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                          const int* __restrict__ ch_len, int hk_n, int hv_n, int dv,
                          const float* __restrict__ h0, float* __restrict__ h_ws, bf16_t* __restrict__ h16_ws,
                          TD* __restrict__ d_ws) {
    typedef V6R<DK, NW> L;
    // A launch with too little shared memory writes nothing (tests see the poisoned output).
    if (dyn_smem_bytes() < 2u * L::STAGE) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / L::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 col0 = (i64)vt * L::BV;
    const int wc0 = 16 * warp;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK;

    // s[nt][c] = S[8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage, i64 t0, int l) {
        const i64 cb = c * hv_n + hv;
        v6r_load_stage<DK, NW>(sm + stage * L::STAGE, w_ws + cb * GDR_C * DK, k + t0 * krow + (i64)kh * DK, krow, l,
                               u_ws + cb * GDR_C * dv + col0, (i64)dv, gam_ws + cb * GDR_C);
    };
    // Chunk tables one chunk ahead of their use (no global round trip inside a step): l_cur is
    // chunk c's length, (t0_nxt, l_nxt) chunk c + 1's.
    int l_cur = 0, l_nxt = 0;
    i64 t0_nxt = 0;
    if (c_beg < c_end) {
        l_cur = ch_len[c_beg];
        issue(c_beg, 0, ch_t0[c_beg], l_cur);
        if (c_beg + 1 < c_end) {
            t0_nxt = ch_t0[c_beg + 1];
            l_nxt = ch_len[c_beg + 1];
        }
    } else {
        cp_async_commit();
    }
    for (i64 c = c_beg; c < c_end; ++c) {
        const int stg = (int)((c - c_beg) & 1);
        cp_async_wait_group<0>();
        // Chunk c's stage is complete and visible; every warp is done with the other stage.
        __syncthreads();
        if (c + 1 < c_end) issue(c + 1, stg ^ 1, t0_nxt, l_nxt);
        else cp_async_commit();
        const int l = l_cur;
        l_cur = l_nxt;
        if (c + 2 < c_end) {
            t0_nxt = ch_t0[c + 2];
            l_nxt = ch_len[c + 2];
        }
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF);
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF);
        const float* sU = reinterpret_cast<const float*>(sp + L::U_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;
        // fp32 states as before; bf16 states and a bf16 D go out after the step (below)
        if (h_ws) v6_store_state<DK>(s, h_ws, h16_ws, cb * (i64)DK * dv + col0 + wc0 + g, dv);
        unsigned sa[DK / 16][4], da[4][4];
        constexpr bool D16 = sizeof(TD) == 2;
        TD* dc = d_ws + cb * GDR_C * (i64)dv + col0 + wc0;
        // A full chunk with its length known at compile time (the row masks fold away; they
        // select nothing there, so the same bits).
        if (l == GDR_C)
            v6_chain_step<DK, !D16, TD>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, GDR_C, dc, (i64)dv);
        else
            v6_chain_step<DK, !D16, TD>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, l, dc, (i64)dv);
        if (!h_ws || D16) {
            // Through this warp's columns of the stage's U tile (read by this warp only, done
            // with; refilled after the next CTA barrier): tile row R at U row R / 2, half R % 2.
            const unsigned ub = smem_addr(sU + wc0);
            auto row = [&](int R, int h) { return ub + (unsigned)((R >> 1) * L::LU * 4 + 32 * (R & 1) + 16 * h); };
            auto same = [](int R) { return R; };
            // h[c] = S before the step: sa is its bf16 rounding (v6_s_frags)
            if (!h_ws) v6_tile_out<DK / 16>(sa, row, same, h16_ws + cb * (i64)DK * dv + col0 + wc0, (i64)dv);
            if (D16) v6_tile_out<4>(da, row, same, reinterpret_cast<bf16_t*>(dc), (i64)dv);
        }
    }
}

// One stage of gdr_bwd6 (bytes): K, Q, W (64 rows of DK + 8 bf16), A (64 rows of 72 bf16), the
// CTA's dO tile (64 rows of BV + 8 bf16), gam (64 fp32). Row strides keep ldmatrix's 8 row
// addresses in 8 different 16-byte bank groups.
template <int DK, int NW>
struct V6G {
    static constexpr int BV = 16 * NW;
    static constexpr int NT = 32 * NW;
    static constexpr int LK = DK + 8;
    static constexpr int LA = GDR_C + 8;
    static constexpr int LO = BV + 8;
    static constexpr int K_OFF = 0;
    static constexpr int Q_OFF = K_OFF + GDR_C * LK * 2;
    static constexpr int W_OFF = Q_OFF + GDR_C * LK * 2;
    static constexpr int A_OFF = W_OFF + GDR_C * LK * 2;
    static constexpr int O_OFF = A_OFF + GDR_C * LA * 2;
    static constexpr int G_OFF = O_OFF + GDR_C * LO * 2;
    static constexpr int STAGE = G_OFF + GDR_C * 4;
};

// K, Q and dO rows >= l are zero-filled (never read from memory: they may belong to the next
// sequence or lie past the buffer); W and A rows >= l are zero in their workspaces.
template <int DK, int NW>
__device__ __forceinline__ void v6g_load_stage(char* st, const bf16_t* kc, const bf16_t* qc, i64 krow, int l,
                                               const bf16_t* wc, const bf16_t* ac, const bf16_t* oc, i64 vrow,
                                               const float* gc) {
    typedef V6G<DK, NW> L;
    const int tid = threadIdx.x;
    constexpr int CPR = DK / 8;
    for (int e = tid; e < GDR_C * CPR; e += L::NT) {
        const int i = e / CPR, x = (e % CPR) * 8;
        const bool ok = i < l;
        const i64 r = ok ? i : 0;
        cp_async16(st + L::K_OFF + (i * L::LK + x) * 2, kc + r * krow + x, ok);
        cp_async16(st + L::Q_OFF + (i * L::LK + x) * 2, qc + r * krow + x, ok);
        cp_async16(st + L::W_OFF + (i * L::LK + x) * 2, wc + (i64)i * DK + x, true);
    }
    for (int e = tid; e < GDR_C * 8; e += L::NT) {
        const int i = e >> 3, x = (e & 7) * 8;
        cp_async16(st + L::A_OFF + (i * L::LA + x) * 2, ac + i * GDR_C + x, true);
    }
    constexpr int OPR = L::BV / 8;  // 16-byte pieces per dO row
    for (int e = tid; e < GDR_C * OPR; e += L::NT) {
        const int i = e / OPR, x = (e % OPR) * 8;
        const bool ok = i < l;
        const i64 r = ok ? i : 0;
        cp_async16(st + L::O_OFF + (i * L::LO + x) * 2, oc + r * vrow + x, ok);
    }
    if (tid < GDR_C / 4) cp_async16(st + L::G_OFF + tid * 16, gc + tid * 4, true);
    cp_async_commit();
}

// bf16x2 register u (elements lo, hi) times (a, b), rounded back to bf16x2.
__device__ __forceinline__ unsigned scale_bf16x2(unsigned u, float a, float b) {
    return pack_bf16(__uint_as_float(u << 16) * a, __uint_as_float(u & 0xffff0000u) * b);
}

// gdr_bwd6's and gdr_bwd8's two row-masked scalings of a chunk step (rows >= l get 0), with
// the chunk length a compile-time constant when LC is nonzero (a full chunk: the masks fold
// away, the same bits):
// x[j] (dS^T K^T's n8 tile j, chunk rows 8 j + 2t, + 1) *= e^(gam_L - gam_i) / scale, and dO^T's
// fragments *= scale e^gam_i.
template <int LC>
__device__ __forceinline__ void v8g_scale_x(float (&x)[8][4], const float* sG, int lr, float gl, float inv_scale) {
    const int l = LC ? LC : lr, t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i0 = 8 * j + 2 * t;
        const float e0 = i0 < l ? __expf(gl - sG[i0]) * inv_scale : 0.f;
        const float e1 = i0 + 1 < l ? __expf(gl - sG[i0 + 1]) * inv_scale : 0.f;
        x[j][0] *= e0;
        x[j][1] *= e1;
        x[j][2] *= e0;
        x[j][3] *= e1;
    }
}
template <int LC>
__device__ __forceinline__ void v8g_scale_o(unsigned (&of)[4][4], const float* sG, int lr, float scale) {
    const int l = LC ? LC : lr, t = threadIdx.x & 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int ia = 16 * kk + 2 * t, ib = ia + 8;
        const float ea0 = ia < l ? scale * __expf(sG[ia]) : 0.f;
        const float ea1 = ia + 1 < l ? scale * __expf(sG[ia + 1]) : 0.f;
        const float eb0 = ib < l ? scale * __expf(sG[ib]) : 0.f;
        const float eb1 = ib + 1 < l ? scale * __expf(sG[ib + 1]) : 0.f;
        of[kk][0] = scale_bf16x2(of[kk][0], ea0, ea1);
        of[kk][1] = scale_bf16x2(of[kk][1], ea0, ea1);
        of[kk][2] = scale_bf16x2(of[kk][2], eb0, eb1);
        of[kk][3] = scale_bf16x2(of[kk][3], eb0, eb1);
    }
}

// Grid: N * Hv * (dv / BV) CTAs of 32 NW threads; dynamic shared memory 2 * V6G<DK, NW>::STAGE.
// TD: dD's type (float, or bf16 for gdr_grad10b: gdr_bwd6b).
template <int DK, int NW, typename TD = float>
__device__ void gdr_bwd6(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const bf16_t* __restrict__ d_o, const float* __restrict__ gam_ws,
                         const bf16_t* __restrict__ w_ws, const bf16_t* __restrict__ a_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                         const float* __restrict__ dht, float* __restrict__ dh_ws, bf16_t* __restrict__ dh16_ws,
                         TD* __restrict__ dd_ws, float* __restrict__ dh0) {
    typedef V6G<DK, NW> L;
    if (dyn_smem_bytes() < 2u * L::STAGE) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / L::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r = lane & 7;
    const i64 col0 = (i64)vt * L::BV;
    const int wc0 = 16 * warp;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;

    // s[nt][c] = dS[8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = dht ? dht[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage, i64 t0, int l) {
        const i64 cb = c * hv_n + hv;
        v6g_load_stage<DK, NW>(sm + stage * L::STAGE, k + t0 * krow + (i64)kh * DK, q + t0 * krow + (i64)kh * DK,
                               krow, l, w_ws + cb * GDR_C * DK, a_ws + cb * GDR_C * GDR_C,
                               d_o + t0 * vrow + (i64)hv * dv + col0, vrow, gam_ws + cb * GDR_C);
    };
    // Chunk tables one chunk ahead of their use, as in gdr_hrec6 (here "next" is c - 1).
    int l_cur = 0, l_nxt = 0;
    i64 t0_nxt = 0;
    if (c_end > c_beg) {
        l_cur = ch_len[c_end - 1];
        issue(c_end - 1, 0, ch_t0[c_end - 1], l_cur);
        if (c_end - 1 > c_beg) {
            t0_nxt = ch_t0[c_end - 2];
            l_nxt = ch_len[c_end - 2];
        }
    } else {
        cp_async_commit();
    }
    const float inv_scale = 1.f / scale;
    for (i64 c = c_end - 1; c >= c_beg; --c) {
        const int stg = (int)((c_end - 1 - c) & 1);
        cp_async_wait_group<0>();
        __syncthreads();
        if (c > c_beg) issue(c - 1, stg ^ 1, t0_nxt, l_nxt);
        else cp_async_commit();
        const int l = l_cur;
        l_cur = l_nxt;
        if (c - 2 >= c_beg) {
            t0_nxt = ch_t0[c - 2];
            l_nxt = ch_len[c - 2];
        }
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF);
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF);
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF);
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const bf16_t* sO = reinterpret_cast<const bf16_t*>(sp + L::O_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;

        // dh[c] = dS (the gradient of the chunk's end state): fp32 here, bf16 below.
        if (dh_ws) v6_store_state<DK>(s, dh_ws, dh16_ws, cb * (i64)DK * dv + col0 + wc0 + g, dv);

        // x[j][c]: dD^T[v][i] for v = g + 8 (c >> 1), i = 8 j + 2t + (c & 1); first X = dS^T K^T
        // scaled by e^(gam_L - gam_i) / scale (zero for i >= l), then + dO^T A, times scale.
        float x[8][4];
        {
            unsigned sa[DK / 16][4];
            v6_s_frags<DK>(s, sa);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) x[j][cc] = 0.f;
            v6_mul_rows_t<DK>(x, sa, sK, L::LK);
        }
        const float gl = sG[l - 1];
        // a full chunk with its length known at compile time (the masks fold away; the same bits)
        if (l == GDR_C) v8g_scale_x<GDR_C>(x, sG, l, gl, inv_scale);
        else v8g_scale_x<0>(x, sG, l, gl, inv_scale);
        // dO^T as A fragments (m = the warp's 16 columns, k = chunk rows 16 kk ..): matrix mi of
        // ldmatrix.trans is stored rows 16 kk + 8 (mi >> 1) .., columns wc0 + 8 (mi & 1) ..
        unsigned of[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldsm_x4_t(of[kk], sO + (16 * kk + 8 * (mi >> 1) + r) * L::LO + wc0 + 8 * (mi & 1));
        // The warp's 16 columns of the stage's dO tile are read (only by this warp; refilled after
        // the next CTA barrier): they stage the bf16 dh (two halves of 64 rows) and dD below.
        const unsigned ob = smem_addr(sO + wc0);
        auto orow = [&](int R, int h) { return ob + (unsigned)(R * L::LO * 2 + 16 * h); };
        if (!dh_ws) {
            unsigned sb[DK / 16][4];
            v6_s_frags<DK>(s, sb);  // dS, rounded as v6_store_state rounds it
            bf16_t* dst = dh16_ws + cb * (i64)DK * dv + col0 + wc0;
#pragma unroll
            for (int hf = 0; hf < DK / 64; ++hf)
                v6_tile_out<4>(*reinterpret_cast<const unsigned(*)[4][4]>(&sb[4 * hf]), orow,
                               [&](int R) { return 64 * hf + R; }, dst, (i64)dv);
        }
        // + dO^T A: B[k = i][n = m] = A[i][m], nonzero for m <= i: blocks np <= kk.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int np = 0; np <= kk; ++np) {
                unsigned bb[4];
                ldsm_x4_t(bb, sA + (16 * kk + 8 * (mi & 1) + r) * L::LA + 16 * np + 8 * (mi >> 1));
                mma_bf16(x[2 * np], of[kk], bb[0], bb[1]);
                mma_bf16(x[2 * np + 1], of[kk], bb[2], bb[3]);
            }
        // dD (fp32, for gdr_grad) and -dD^T as bf16 A fragments (k-block kk = n tiles 2 kk, 2 kk + 1).
        TD* ddc = dd_ws + cb * GDR_C * (i64)dv + col0 + wc0 + g;
        unsigned nd[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const float d0 = scale * x[j][2 * rr];
                    const float d1 = scale * x[j][2 * rr + 1];
                    if (sizeof(TD) == 4) {  // bf16 dD staged below
                        st_ws(ddc, (i64)i0 * dv + 8 * rr, d0);
                        st_ws(ddc, (i64)(i0 + 1) * dv + 8 * rr, d1);
                    }
                    nd[kk][rr + 2 * h] = pack_bf16(-d0, -d1);
                }
            }
        if (sizeof(TD) == 2) {
            // -dD's fragments with the sign flipped (rounding commutes with negation: st_ws's bits)
            unsigned f[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) f[kk][e] = nd[kk][e] ^ 0x80008000u;
            v6_tile_out<4>(f, orow, [](int R) { return R; }, reinterpret_cast<bf16_t*>(ddc) - g, (i64)dv);
        }
        // dO^T diag(scale e^gam): registers 0, 1 of k-block kk hold rows 16 kk + 2t, + 1;
        // registers 2, 3 rows 16 kk + 8 + 2t, + 1.
        if (l == GDR_C) v8g_scale_o<GDR_C>(of, sG, l, scale);
        else v8g_scale_o<0>(of, sG, l, scale);
        // dS^T <- e^gam_L dS^T + (scaled dO)^T Q - dD^T W; B[k = i][n = x] = Q[i][x], W[i][x].
        const float egl = __expf(gl);
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) s[nt][cc] *= egl;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int np = 0; np < DK / 16; ++np) {
                unsigned bq[4], bw[4];
                ldsm_x4_t(bq, sQ + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                ldsm_x4_t(bw, sW + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                mma_bf16(s[2 * np], of[kk], bq[0], bq[1]);
                mma_bf16(s[2 * np + 1], of[kk], bq[2], bq[3]);
                mma_bf16(s[2 * np], nd[kk], bw[0], bw[1]);
                mma_bf16(s[2 * np + 1], nd[kk], bw[2], bw[3]);
            }
    }
    if (dh0) {
#pragma unroll
        for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                dh0[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
}


// ---------------------------------------------------------------------------------------------
// gdr_grad6 (v6 backward, opt-in `grad`): v5's gdr_grad (same formulas, same order of the
// steps' dependencies, same outputs: fp32 dq / dk partials, dv, dg, dbeta) with every product
// on bf16 tensor cores from operands staged once in shared memory: Q, K (normalized bf16), V, dO,
// D, dD, T (bf16, D / dD / T rounded from their fp32 workspaces), h, dh (bf16 states). One CTA
// (8 warps) per (chunk, value head); each product is a 64 x N block, warp w owning rows
// 16 (w & 3) .. + 16 and columns (w >> 2) N / 2 .. + N / 2. Elementwise parts (row dots,
// dgam, dbeta) as v5, reading q, k rows from memory (fp32 when normalized in the kernel).

// Shared-memory layout (bytes). Phase 1 (dq, dk from the states, dW, <S0, dS>) needs h and dh;
// phase 2 reuses their space for the 64 x 64 intermediates.
template <int DK, int DV>
struct G6 {
    static constexpr int LK = DK + 8, LV = DV + 8, LC = GDR_C + 8, LF = GDR_C + 1;
    static constexpr int Q_OFF = 0;
    static constexpr int K_OFF = Q_OFF + GDR_C * LK * 2;
    static constexpr int V_OFF = K_OFF + GDR_C * LK * 2;
    static constexpr int O_OFF = V_OFF + GDR_C * LV * 2;
    static constexpr int D_OFF = O_OFF + GDR_C * LV * 2;
    static constexpr int DD_OFF = D_OFF + GDR_C * LV * 2;
    static constexpr int T_OFF = DD_OFF + GDR_C * LV * 2;
    static constexpr int W_OFF = T_OFF + GDR_C * LC * 2;  // dW, bf16 [64][LK]
    static constexpr int U_OFF = W_OFF + GDR_C * LK * 2;
    static constexpr int H_OFF = U_OFF;                   // phase 1: h, dh bf16 [DK][LV]
    static constexpr int DH_OFF = H_OFF + DK * LV * 2;
    static constexpr int A_OFF = U_OFF;                   // phase 2: A, then dM (fp32 [64][LF])
    static constexpr int P_OFF = A_OFF + GDR_C * LF * 4;  // K K^T (fp32)
    static constexpr int E_OFF = P_OFF + GDR_C * LF * 4;  // dA * A (fp32)
    static constexpr int G_OFF = E_OFF + GDR_C * LF * 4;  // dA * Gamma, then T^T dT (bf16 [64][LC])
    static constexpr int X_OFF = G_OFF + GDR_C * LC * 2;  // dT, then dP (bf16 [64][LC])
    static constexpr int U1 = 2 * DK * LV * 2;
    static constexpr int U2 = 3 * GDR_C * LF * 4 + 2 * GDR_C * LC * 2;
    static constexpr int VEC_OFF = U_OFF + (U1 > U2 ? U1 : U2);
    static constexpr int BYTES = VEC_OFF + (7 * GDR_C + 32) * 4;
};

// acc (this warp's 16 x 8 NT8 slice of a 64 x 16 NT8 product) += sum over k < kdim of
// A(i, k) B(k, n), from bf16 shared memory. AT false: A stored [i][k]; true: stored [k][i].
// BT true: B stored [n][k]; false: stored [k][n]. Row strides in elements (16-byte rows).
template <int NT8, bool AT, bool BT>
__device__ __forceinline__ void g6_mma(float (&acc)[NT8][4], const bf16_t* a, int lda, const bf16_t* b, int ldb,
                                       int kdim) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mi = lane >> 3, r = lane & 7;
    const int rt = 16 * (warp & 3), col0 = (warp >> 2) * (8 * NT8);
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        unsigned af[4];
        if (AT) ldsm_x4_t(af, a + (k0 + 8 * (mi >> 1) + r) * lda + rt + 8 * (mi & 1));
        else ldsm_x4(af, a + (rt + 8 * (mi & 1) + r) * lda + k0 + 8 * (mi >> 1));
#pragma unroll
        for (int np = 0; np < NT8 / 2; ++np) {
            const int n0 = col0 + 16 * np;
            unsigned bb[4];
            if (BT) ldsm_x4(bb, b + (n0 + 8 * (mi >> 1) + r) * ldb + k0 + 8 * (mi & 1));
            else ldsm_x4_t(bb, b + (k0 + 8 * (mi & 1) + r) * ldb + n0 + 8 * (mi >> 1));
            mma_bf16(acc[2 * np], af, bb[0], bb[1]);
            mma_bf16(acc[2 * np + 1], af, bb[2], bb[3]);
        }
    }
}

template <int NT8>
__device__ __forceinline__ void g6_zero(float (&acc)[NT8][4]) {
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[n][c] = 0.f;
}

// f(row, column, value) for every element of this warp's slice (C fragment layout).
template <int NT8, class F>
__device__ __forceinline__ void g6_epi(const float (&acc)[NT8][4], F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(r0 + 8 * (c >> 1), c0 + 8 * n + (c & 1), acc[n][c]);
}

// rows x n bf16 (n a multiple of 8) global -> shared by cp.async (row strides gs, ls); rows >= l
// are zero-filled (not read).
__device__ __forceinline__ void g6_rows16(bf16_t* dst, int ls, const bf16_t* src, i64 gs, int n, int rows, int l) {
    const int per = n / 8;
    for (int e = threadIdx.x; e < rows * per; e += GDR_NT) {
        const int i = e / per, x = (e - i * per) * 8;
        const bool ok = i < l;
        cp_async16(dst + i * ls + x, src + (ok ? (i64)i : 0) * gs + x, ok);
    }
}

// rows x n fp32 (n a multiple of 4) global -> bf16 shared (rounded to nearest even).
__device__ __forceinline__ void g6_rows32(bf16_t* dst, int ls, const float* src, i64 gs, int n, int rows) {
    const int per = n / 4;
    for (int e = threadIdx.x; e < rows * per; e += GDR_NT) {
        const int i = e / per, x = (e - i * per) * 4;
        const float4 v = *reinterpret_cast<const float4*>(src + (i64)i * gs + x);
        *reinterpret_cast<uint2*>(dst + i * ls + x) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
    }
}

template <typename TQ, int DK, int DV>
__device__ void gdr_grad6(const TQ* __restrict__ q, const TQ* __restrict__ k, const bf16_t* __restrict__ qb,
                          const bf16_t* __restrict__ kb, const bf16_t* __restrict__ v,
                          const bf16_t* __restrict__ beta, const bf16_t* __restrict__ d_o,
                          const float* __restrict__ gam_ws, const float* __restrict__ t_ws,
                          const bf16_t* __restrict__ h_ws, const bf16_t* __restrict__ dh_ws,
                          const float* __restrict__ d_ws, const float* __restrict__ dd_ws,
                          float* __restrict__ dvb_ws, float* __restrict__ dkb_ws, const i64* __restrict__ ch_t0,
                          const int* __restrict__ ch_len, int hk_n, int hv_n, float scale,
                          float* __restrict__ dq_part, float* __restrict__ dk_part, bf16_t* __restrict__ dv_out,
                          float* __restrict__ dg, bf16_t* __restrict__ dbeta) {
    typedef G6<DK, DV> L;
    constexpr int dk = DK, dv = DV;
    // A launch with too little shared memory writes nothing (tests see the poisoned outputs).
    if (dyn_smem_bytes() < (unsigned)L::BYTES) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    bf16_t* sQ = reinterpret_cast<bf16_t*>(sm + L::Q_OFF);
    bf16_t* sK = reinterpret_cast<bf16_t*>(sm + L::K_OFF);
    bf16_t* sV = reinterpret_cast<bf16_t*>(sm + L::V_OFF);
    bf16_t* sO = reinterpret_cast<bf16_t*>(sm + L::O_OFF);
    bf16_t* sD = reinterpret_cast<bf16_t*>(sm + L::D_OFF);
    bf16_t* sDD = reinterpret_cast<bf16_t*>(sm + L::DD_OFF);
    bf16_t* sT = reinterpret_cast<bf16_t*>(sm + L::T_OFF);
    bf16_t* sW = reinterpret_cast<bf16_t*>(sm + L::W_OFF);
    bf16_t* sH = reinterpret_cast<bf16_t*>(sm + L::H_OFF);
    bf16_t* sDH = reinterpret_cast<bf16_t*>(sm + L::DH_OFF);
    float* sA = reinterpret_cast<float*>(sm + L::A_OFF);
    float* sP = reinterpret_cast<float*>(sm + L::P_OFF);
    float* sE = reinterpret_cast<float*>(sm + L::E_OFF);
    bf16_t* sG = reinterpret_cast<bf16_t*>(sm + L::G_OFF);
    bf16_t* sX = reinterpret_cast<bf16_t*>(sm + L::X_OFF);
    float* s_gam = reinterpret_cast<float*>(sm + L::VEC_OFF);
    float* s_eg = s_gam + GDR_C;
    float* s_ed = s_eg + GDR_C;
    float* s_beta = s_ed + GDR_C;
    float* s_dgam = s_beta + GDR_C;
    float* s_db = s_dgam + GDR_C;
    float* s_tmp = s_db + GDR_C;
    float* s_red = s_tmp + GDR_C;  // 32 floats for block_sum
    constexpr int LK = L::LK, LV = L::LV, LC = L::LC, LF = L::LF;
    constexpr int NK = DK / 16, NV = DV / 16;  // NT8 of 64 x DK and 64 x DV products

    ChunkGeo G = chunk_geo(ch_t0, ch_len, hv_n, hv_n / hk_n);
    const int l = G.l, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 cb = G.c * hv_n + G.hv;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const i64 prow = (i64)hv_n * dk;  // row stride of the fp32 partials [tokens, Hv, Dk]
    const TQ* qc = q + G.t0 * krow + (i64)G.kh * dk;
    const TQ* kc = k + G.t0 * krow + (i64)G.kh * dk;
    const bf16_t* vc = v + G.t0 * vrow + (i64)G.hv * dv;
    float* dqc = dq_part + G.t0 * prow + (i64)G.hv * dk;
    float* dkc = dk_part + G.t0 * prow + (i64)G.hv * dk;
    float* dVb = dvb_ws + cb * GDR_C * (i64)dv;
    float* dKb = dkb_ws + cb * GDR_C * (i64)dk;

    // Stage the operands (the bf16 ones asynchronously while the fp32 ones are rounded).
    g6_rows16(sQ, LK, qb + G.t0 * krow + (i64)G.kh * dk, krow, dk, GDR_C, l);
    g6_rows16(sK, LK, kb + G.t0 * krow + (i64)G.kh * dk, krow, dk, GDR_C, l);
    g6_rows16(sV, LV, vc, vrow, dv, GDR_C, l);
    g6_rows16(sO, LV, d_o + G.t0 * vrow + (i64)G.hv * dv, vrow, dv, GDR_C, l);
    g6_rows16(sH, LV, h_ws + cb * (i64)dk * dv, dv, dv, dk, dk);
    g6_rows16(sDH, LV, dh_ws + cb * (i64)dk * dv, dv, dv, dk, dk);
    cp_async_commit();
    g6_rows32(sD, LV, d_ws + cb * GDR_C * (i64)dv, dv, dv, GDR_C);
    g6_rows32(sDD, LV, dd_ws + cb * GDR_C * (i64)dv, dv, dv, GDR_C);
    g6_rows32(sT, LC, t_ws + cb * (GDR_C * GDR_C), GDR_C, GDR_C, GDR_C);
    load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, s_ed);  // synchronizes
    if (tid < GDR_C) {
        s_beta[tid] = tid < l ? ld(beta, (G.t0 + tid) * hv_n + G.hv) : 0.f;
        s_dgam[tid] = 0.f;
        s_db[tid] = 0.f;
    }
    cp_async_wait_all();
    __syncthreads();
    const float gl = s_gam[l - 1];
    const float egl = expf(gl);
    auto gamma = [&](int i, int j) { return expf(s_gam[i] - s_gam[j]); };

    // Phase 1. dq = e^gam (scale dO S0^T); dk = e^(gam_L - gam) (D dS^T); dW = -dD S0^T.
    {
        float acc[NK][4];
        g6_zero(acc);
        g6_mma<NK, false, true>(acc, sO, LV, sH, LV, dv);
        g6_epi(acc, [&](int i, int x, float a) {
            if (i < l) dqc[i * prow + x] = s_eg[i] * (scale * a);
        });
        g6_zero(acc);
        g6_mma<NK, false, true>(acc, sD, LV, sDH, LV, dv);
        g6_epi(acc, [&](int i, int x, float a) {
            if (i < l) dkc[i * prow + x] = s_ed[i] * a;
        });
        g6_zero(acc);
        g6_mma<NK, false, true>(acc, sDD, LV, sH, LV, dv);
        g6_epi(acc, [&](int i, int x, float a) { sW[i * LK + x] = f32_to_bf16(-a); });
    }
    float sds;
    {
        float p = 0.f;
        for (int e = tid; e < dk * dv; e += GDR_NT) {
            const int x = e / dv, c = e - x * dv;
            p += bf16_to_f32(sH[x * LV + c]) * bf16_to_f32(sDH[x * LV + c]);
        }
        sds = block_sum(p, s_red);  // synchronizes: dqc, dkc, sW written; h, dh no longer read
    }
    // dgam_i += <dq_i, q_i>; t_i = <dk_i, k_i>: dgam_L += sum t + e^gam_L <S0, dS>, dgam_i -= t_i.
    for (int i = warp; i < GDR_C; i += GDR_NT / 32) {
        float sq = 0.f, sk = 0.f;
        if (i < l) {
            sq = warp_row_dot(dk, [&](int x) { return dqc[i * prow + x] * ld(qc, i * krow + x); });
            sk = warp_row_dot(dk, [&](int x) { return dkc[i * prow + x] * ld(kc, i * krow + x); });
        }
        if (lane == 0) {
            s_dgam[i] = sq;
            s_tmp[i] = sk;
        }
    }
    __syncthreads();
    if (tid < GDR_C) {
        float d = s_dgam[tid] - s_tmp[tid];
        if (tid == l - 1) {
            float t = 0.f;
            for (int i = 0; i < GDR_C; ++i) t += s_tmp[i];
            d += egl * sds + t;
        }
        s_dgam[tid] = d;
    }

    // Phase 2 (h, dh's space reused). A = lower_incl(Q K^T * Gamma), P = K K^T (fp32).
    {
        float acc[4][4];
        g6_zero(acc);
        g6_mma<4, false, true>(acc, sQ, LK, sK, LK, dk);
        g6_epi(acc, [&](int i, int j, float a) {
            sA[i * LF + j] = (j <= i && i < l) ? a * gamma(i, j) : 0.f;
        });
        g6_zero(acc);
        g6_mma<4, false, true>(acc, sK, LK, sK, LK, dk);
        g6_epi(acc, [&](int i, int j, float a) { sP[i * LF + j] = a; });
    }
    __syncthreads();
    // dA = scale dO D^T (j <= i): E = dA * A (for dgam), G = dA * Gamma (bf16 operand).
    {
        float acc[4][4];
        g6_zero(acc);
        g6_mma<4, false, true>(acc, sO, LV, sD, LV, dv);
        g6_epi(acc, [&](int i, int j, float a) {
            const bool in = j <= i && i < l;
            const float x = scale * a;
            sE[i * LF + j] = in ? x * sA[i * LF + j] : 0.f;
            sG[i * LC + j] = f32_to_bf16(in ? x * gamma(i, j) : 0.f);
        });
    }
    __syncthreads();
    if (tid < GDR_C) {
        float rs = 0.f, cs = 0.f;
        for (int j = 0; j < GDR_C; ++j) rs += sE[tid * LF + j];
        for (int i = 0; i < GDR_C; ++i) cs += sE[i * LF + tid];
        s_dgam[tid] += rs - cs;
    }
    // dq += G K ; dk += G^T Q.
    {
        float acc[NK][4];
        g6_zero(acc);
        g6_mma<NK, false, false>(acc, sG, LC, sK, LK, GDR_C);
        g6_epi(acc, [&](int i, int x, float a) {
            if (i < l) dqc[i * prow + x] += a;
        });
        g6_zero(acc);
        g6_mma<NK, true, false>(acc, sG, LC, sQ, LK, GDR_C);
        g6_epi(acc, [&](int j, int x, float a) {
            if (j < l) dkc[j * prow + x] += a;
        });
    }
    // dT = dD Vb^T + dW Kb^T, Vb = diag(beta) V, Kb = diag(beta e^gam) K (column scales of dT).
    {
        float a1[4][4], a2[4][4];
        g6_zero(a1);
        g6_zero(a2);
        g6_mma<4, false, true>(a1, sDD, LV, sV, LV, dv);
        g6_mma<4, false, true>(a2, sW, LK, sK, LK, dk);
        const int g = lane >> 2, t = lane & 3;
        const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * 32 + 2 * t;
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int i = r0 + 8 * (c >> 1), j = c0 + 8 * n + (c & 1);
                const float x = s_beta[j] * a1[n][c] + (s_beta[j] * s_eg[j]) * a2[n][c];
                sX[i * LC + j] = f32_to_bf16(x);
            }
    }
    // dVb = T^T dD ; dKb = T^T dW (fp32 to their workspaces, read back row by row below).
    {
        float acc[NV][4];
        g6_zero(acc);
        g6_mma<NV, true, false>(acc, sT, LC, sDD, LV, GDR_C);
        g6_epi(acc, [&](int m, int c, float a) { dVb[(i64)m * dv + c] = a; });
    }
    {
        float acc[NK][4];
        g6_zero(acc);
        g6_mma<NK, true, false>(acc, sT, LC, sW, LK, GDR_C);
        g6_epi(acc, [&](int m, int x, float a) { dKb[(i64)m * dk + x] = a; });
    }
    __syncthreads();
    // v: dv = beta dVb, dbeta += <dVb, v>. Kb: dk += beta e^gam dKb, d = <dKb, k>,
    // dbeta += e^gam d, dgam += beta e^gam d.
    for (int i = warp; i < l; i += GDR_NT / 32) {
        float sv = warp_row_dot(dv, [&](int c) { return dVb[(i64)i * dv + c] * ld(vc, i * vrow + c); });
        float sk = warp_row_dot(dk, [&](int x) { return dKb[(i64)i * dk + x] * ld(kc, i * krow + x); });
        const float bb = s_beta[i], bge = bb * s_eg[i];
        for (int c = lane; c < dv; c += 32) st(dv_out, (G.t0 + i) * vrow + (i64)G.hv * dv + c, bb * dVb[(i64)i * dv + c]);
        for (int x = lane; x < dk; x += 32) dkc[i * prow + x] += bge * dKb[(i64)i * dk + x];
        if (lane == 0) {
            s_db[i] += sv + s_eg[i] * sk;
            s_dgam[i] += bge * sk;
        }
    }
    // dM = -T^T dT T^T: tmp = T^T dT (bf16, into G's space), dM = -(tmp T^T) (fp32, into A's).
    {
        float acc[4][4];
        g6_zero(acc);
        g6_mma<4, true, false>(acc, sT, LC, sX, LC, GDR_C);
        g6_epi(acc, [&](int m, int n, float a) { sG[m * LC + n] = f32_to_bf16(a); });
    }
    __syncthreads();
    {
        float acc[4][4];
        g6_zero(acc);
        g6_mma<4, false, true>(acc, sG, LC, sT, LC, GDR_C);
        g6_epi(acc, [&](int m, int n, float a) { sA[m * LF + n] = -a; });
    }
    __syncthreads();
    // M_ij = beta_i P_ij Gamma_ij (j < i): dbeta_i += sum_j dM_ij P_ij Gamma_ij ;
    // f = dM_ij beta_i P_ij Gamma_ij: dgam_i += f, dgam_j -= f ; dP_ij = dM_ij beta_i Gamma_ij.
    if (tid < GDR_C) {
        const int i = tid;
        float db = 0.f, fr = 0.f, fc = 0.f;
        if (i < l) {
            for (int j = 0; j < i; ++j) {
                float x = sA[i * LF + j];
                float pg = sP[i * LF + j] * gamma(i, j);
                db += x * pg;
                fr += x * s_beta[i] * pg;
            }
            for (int m = i + 1; m < l; ++m) {
                fc += sA[m * LF + i] * s_beta[m] * (sP[m * LF + i] * gamma(m, i));
            }
        }
        s_db[i] += db;
        s_dgam[i] += fr - fc;
    }
    for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
        int i = e >> 6, j = e & 63;
        float d = 0.f;
        if (j < i && i < l) d = sA[i * LF + j] * s_beta[i] * gamma(i, j);
        else if (i < j && j < l) d = sA[j * LF + i] * s_beta[j] * gamma(j, i);
        sX[i * LC + j] = f32_to_bf16(d);
    }
    __syncthreads();
    // dk += dP_sym K.
    {
        float acc[NK][4];
        g6_zero(acc);
        g6_mma<NK, false, false>(acc, sX, LC, sK, LK, GDR_C);
        g6_epi(acc, [&](int i, int x, float a) {
            if (i < l) dkc[i * prow + x] += a;
        });
    }
    __syncthreads();
    // gam = cumsum(g): dg_j = sum_{i >= j} dgam_i.
    if (tid == 0) {
        float acc = 0.f;
        for (int i = l - 1; i >= 0; --i) {
            acc += s_dgam[i];
            dg[(G.t0 + i) * hv_n + G.hv] = acc;
        }
    }
    if (tid < l) st(dbeta, (G.t0 + tid) * hv_n + G.hv, s_db[tid]);
}

// ---------------------------------------------------------------------------------------------
// Entry points, one per storage type (f32: verification; bf16: training).

// Entry points. Storage suffixes: f32 (all f32: verification), bf16 (all bf16), bf16n (bf16
// storage with the l2-normalized q, k kept in fp32: the in-kernel norm does not round them).

#define GDR_ROW_ENTRIES(T, S)                                                                           \
    extern "C" __global__ void __launch_bounds__(GDR_NT) gdr_l2norm_##S(const T* x, float* y, i64 rows,  \
                                                                        int d) {                        \
        gdr_l2norm<T, float>(x, y, rows, d);                                                            \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_reduce_qk_##S(const T* q, const T* k, const float* dq_part, const float* dk_part,           \
                          i64 tokens, i64 used, int hk, int hv, int dk, int l2norm, T* dq, T* dk_out) { \
        gdr_reduce_qk<T>(q, k, dq_part, dk_part, tokens, used, hk, hv, dk, l2norm, dq, dk_out);         \
    }

#define GDR_ENTRIES(TQ, T, S)                                                                           \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_prep_##S(const TQ* k, const T* v, const float* g, const T* beta, const i64* ch_t0,          \
                     const int* ch_len, int hk, int hv, int dk, int dv, float* gam_ws, float* t_ws,     \
                     float* w_ws, float* u_ws) {                                                        \
        gdr_prep<TQ, T>(k, v, g, beta, ch_t0, ch_len, hk, hv, dk, dv, gam_ws, t_ws, w_ws, u_ws);        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_scan_fwd16_##S(const TQ* k, const float* gam_ws, const float* w_ws, const float* u_ws,      \
                           const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,      \
                           int dk, int dv, const float* h0, float* h_ws, float* d_ws, float* fin) {     \
        gdr_scan_fwd<TQ, T, 16>(k, gam_ws, w_ws, u_ws, seq_ch, ch_t0, ch_len, hk, hv, dk, dv, h0, h_ws,    \
                             d_ws, fin);                                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_scan_fwd32_##S(const TQ* k, const float* gam_ws, const float* w_ws, const float* u_ws,      \
                           const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,      \
                           int dk, int dv, const float* h0, float* h_ws, float* d_ws, float* fin) {     \
        gdr_scan_fwd<TQ, T, 32>(k, gam_ws, w_ws, u_ws, seq_ch, ch_t0, ch_len, hk, hv, dk, dv, h0, h_ws,    \
                             d_ws, fin);                                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_output_##S(const TQ* q, const TQ* k, const float* gam_ws, const float* h_ws,                \
                       const float* d_ws, const i64* ch_t0, const int* ch_len, int hk, int hv, int dk,  \
                       int dv, float scale, T* o) {                                                     \
        gdr_output<TQ, T>(q, k, gam_ws, h_ws, d_ws, ch_t0, ch_len, hk, hv, dk, dv, scale, o);           \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_dd_local_##S(const TQ* q, const TQ* k, const T* d_o, const float* gam_ws, const i64* ch_t0, \
                         const int* ch_len, int hk, int hv, int dk, int dv, float scale, float* dd_ws) { \
        gdr_dd_local<TQ, T>(q, k, d_o, gam_ws, ch_t0, ch_len, hk, hv, dk, dv, scale, dd_ws);            \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_scan_bwd16_##S(const TQ* q, const TQ* k, const T* d_o, const float* gam_ws,                 \
                           const float* w_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len,   \
                           int hk, int hv, int dk, int dv, float scale, const float* dht, float* dh_ws, \
                           float* dd_ws, float* dh0) {                                                  \
        gdr_scan_bwd<TQ, T, 16>(q, k, d_o, gam_ws, w_ws, seq_ch, ch_t0, ch_len, hk, hv, dk, dv, scale,  \
                                dht, dh_ws, dd_ws, dh0);                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_scan_bwd32_##S(const TQ* q, const TQ* k, const T* d_o, const float* gam_ws,                 \
                           const float* w_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len,   \
                           int hk, int hv, int dk, int dv, float scale, const float* dht, float* dh_ws, \
                           float* dd_ws, float* dh0) {                                                  \
        gdr_scan_bwd<TQ, T, 32>(q, k, d_o, gam_ws, w_ws, seq_ch, ch_t0, ch_len, hk, hv, dk, dv, scale,  \
                                dht, dh_ws, dd_ws, dh0);                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT, 2)                                             \
        gdr_grad_##S(const TQ* q, const TQ* k, const T* v, const T* beta, const T* d_o,                 \
                     const float* gam_ws, const float* t_ws, const float* h_ws, const float* dh_ws,     \
                     const float* d_ws, const float* dd_ws, float* dw_ws, float* dvb_ws, float* dkb_ws, \
                     const i64* ch_t0, const int* ch_len, int hk, int hv, int dk, int dv, float scale,  \
                     float* dq_part, float* dk_part, T* dv_out, float* dg, T* dbeta) {                  \
        gdr_grad<TQ, T>(q, k, v, beta, d_o, gam_ws, t_ws, h_ws, dh_ws, d_ws, dd_ws, dw_ws, dvb_ws,      \
                        dkb_ws, ch_t0, ch_len, hk, hv, dk, dv, scale, dq_part, dk_part, dv_out, dg,     \
                        dbeta);                                                                         \
    }

GDR_ROW_ENTRIES(float, f32)
GDR_ROW_ENTRIES(bf16_t, bf16)
GDR_ENTRIES(float, float, f32)
GDR_ENTRIES(bf16_t, bf16_t, bf16)
GDR_ENTRIES(float, bf16_t, bf16n)

// v6 forward entries (bf16 storage only; suffix bf16n: normalized q, k in fp32 for the prep and
// for A, as in v5).
#define GDR_V6_ENTRIES(TQ, S)                                                                           \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_prep6_##S(const TQ* k, const bf16_t* v, const float* g, const bf16_t* beta, const i64* ch_t0, \
                      const int* ch_len, int hk, int hv, int dk, int dv, float* gam_ws, float* t_ws,    \
                      bf16_t* w_ws, float* u_ws) {                                                      \
        gdr_prep<TQ, bf16_t, bf16_t, true>(k, v, g, beta, ch_t0, ch_len, hk, hv, dk, dv, gam_ws, t_ws,  \
                                           w_ws, u_ws);                                                 \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(GDR_NT)                                                \
        gdr_qk6_##S(const TQ* q, const TQ* k, const float* gam_ws, const i64* ch_t0, const int* ch_len, \
                    int hk, int hv, int dk, bf16_t* a_ws) {                                             \
        gdr_qk6<TQ, bf16_t>(q, k, gam_ws, ch_t0, ch_len, hk, hv, dk, a_ws);                             \
    }

GDR_V6_ENTRIES(bf16_t, bf16)
GDR_V6_ENTRIES(float, bf16n)

extern "C" __global__ void __launch_bounds__(GDR_NT)
    gdr_l2norm2_bf16(const bf16_t* x, float* y, bf16_t* yb, i64 rows, int d) {
    gdr_l2norm2<bf16_t>(x, y, yb, rows, d);
}

// gdr_fwd6_*: cp.async loads; gdr_fwd6b_*: bulk copies (sm_90); gdr_fwd6n_*: diagnostic.
#define GDR_FWD6_ENTRY(NAME, LOADS, NS, DK, NW)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) NAME##_d##DK##_w##NW(                      \
        const bf16_t* q, const bf16_t* k, const float* gam_ws, const bf16_t* w_ws, const float* u_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* h0, bf16_t* o, float* fin) {                                  \
        gdr_fwd6<DK, NW, LOADS, NS>(q, k, gam_ws, w_ws, u_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv,     \
                                    scale, h0, o, fin);                                                 \
    }

GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 64, 1)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 64, 2)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 64, 4)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 64, 8)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 128, 2)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 128, 4)
GDR_FWD6_ENTRY(gdr_fwd6, 0, 2, 128, 8)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 64, 1)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 64, 2)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 64, 4)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 64, 8)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 128, 2)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 128, 4)
GDR_FWD6_ENTRY(gdr_fwd6b, 1, 2, 128, 8)
GDR_FWD6_ENTRY(gdr_fwd6n, 2, 2, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6n, 2, 2, 128, 2)
// three stages (fit in shared memory for Dk 128 with 1 or 2 warps)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 64, 1)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 64, 2)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 64, 4)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 64, 8)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 128, 2)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 128, 4)
GDR_FWD6_ENTRY(gdr_fwd6l, 3, 2, 128, 8)
GDR_FWD6_ENTRY(gdr_fwd6ls3, 3, 3, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6ls3, 3, 3, 128, 2)
GDR_FWD6_ENTRY(gdr_fwd6s3, 0, 3, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6s3, 0, 3, 128, 2)
GDR_FWD6_ENTRY(gdr_fwd6bs3, 1, 3, 128, 1)
GDR_FWD6_ENTRY(gdr_fwd6bs3, 1, 3, 128, 2)

#define GDR_CHAIN6_ENTRY(NW, OUT)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_chain6_d128_w##NW##_o##OUT(            \
        const bf16_t* w, const bf16_t* k, const bf16_t* a, const float* u, const float* gam, int steps,  \
        float* out) {                                                                                   \
        gdr_chain6<128, NW, (OUT != 0)>(w, k, a, u, gam, steps, out);                                   \
    }

GDR_CHAIN6_ENTRY(1, 0)
GDR_CHAIN6_ENTRY(2, 0)
GDR_CHAIN6_ENTRY(4, 0)
GDR_CHAIN6_ENTRY(8, 0)
GDR_CHAIN6_ENTRY(1, 1)
GDR_CHAIN6_ENTRY(2, 1)

// v6 backward (bf16 storage only).
#define GDR_BWD6_ENTRY(DK, NW)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_hrec6_d##DK##_w##NW(                   \
        const bf16_t* k, const float* gam_ws, const bf16_t* w_ws, const float* u_ws, const i64* seq_ch,  \
        const i64* ch_t0, const int* ch_len, int hk, int hv, int dv, const float* h0, float* h_ws,       \
        bf16_t* h16_ws, float* d_ws) {                                                                  \
        gdr_hrec6<DK, NW>(k, gam_ws, w_ws, u_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, h0, h_ws, h16_ws,   \
                          d_ws);                                                                        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_bwd6_d##DK##_w##NW(                    \
        const bf16_t* q, const bf16_t* k, const bf16_t* d_o, const float* gam_ws, const bf16_t* w_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* dht, float* dh_ws, bf16_t* dh16_ws, float* dd_ws,             \
        float* dh0) {                                                                                   \
        gdr_bwd6<DK, NW>(q, k, d_o, gam_ws, w_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale, dht,  \
                         dh_ws, dh16_ws, dd_ws, dh0);                                                   \
    } \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_hrec6b_d##DK##_w##NW(                  \
        const bf16_t* k, const float* gam_ws, const bf16_t* w_ws, const float* u_ws, const i64* seq_ch,  \
        const i64* ch_t0, const int* ch_len, int hk, int hv, int dv, const float* h0, float* h_ws,       \
        bf16_t* h16_ws, bf16_t* d_ws) {                                                                 \
        gdr_hrec6<DK, NW, bf16_t>(k, gam_ws, w_ws, u_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, h0, h_ws,    \
                                  h16_ws, d_ws);                                                        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_bwd6b_d##DK##_w##NW(                   \
        const bf16_t* q, const bf16_t* k, const bf16_t* d_o, const float* gam_ws, const bf16_t* w_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* dht, float* dh_ws, bf16_t* dh16_ws, bf16_t* dd_ws,            \
        float* dh0) {                                                                                   \
        gdr_bwd6<DK, NW, bf16_t>(q, k, d_o, gam_ws, w_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale, \
                                 dht, dh_ws, dh16_ws, dd_ws, dh0);                                      \
    }

GDR_BWD6_ENTRY(64, 1)
GDR_BWD6_ENTRY(64, 2)
GDR_BWD6_ENTRY(64, 4)
GDR_BWD6_ENTRY(64, 8)
GDR_BWD6_ENTRY(128, 1)
GDR_BWD6_ENTRY(128, 2)
GDR_BWD6_ENTRY(128, 4)
GDR_BWD6_ENTRY(128, 8)

// gdr_grad with bf16 chunk-start states and state gradients (the v6 backward's bf16 states).
#define GDR_GRAD_H16_ENTRY(TQ, S)                                                                       \
    extern "C" __global__ void __launch_bounds__(GDR_NT, 2)                                             \
        gdr_grad_h16_##S(const TQ* q, const TQ* k, const bf16_t* v, const bf16_t* beta,                 \
                         const bf16_t* d_o, const float* gam_ws, const float* t_ws, const bf16_t* h_ws, \
                         const bf16_t* dh_ws, const float* d_ws, const float* dd_ws, float* dw_ws,      \
                         float* dvb_ws, float* dkb_ws, const i64* ch_t0, const int* ch_len, int hk,     \
                         int hv, int dk, int dv, float scale, float* dq_part, float* dk_part,           \
                         bf16_t* dv_out, float* dg, bf16_t* dbeta) {                                    \
        gdr_grad<TQ, bf16_t, bf16_t>(q, k, v, beta, d_o, gam_ws, t_ws, h_ws, dh_ws, d_ws, dd_ws, dw_ws, \
                                     dvb_ws, dkb_ws, ch_t0, ch_len, hk, hv, dk, dv, scale, dq_part,     \
                                     dk_part, dv_out, dg, dbeta);                                       \
    }

GDR_GRAD_H16_ENTRY(bf16_t, bf16)
GDR_GRAD_H16_ENTRY(float, bf16n)

// gdr_grad6 (bf16 states; TQ: the q, k the row dots read, as gdr_grad).
#define GDR_GRAD6_ENTRY(TQ, S, DK, DV)                                                                  \
    extern "C" __global__ void __launch_bounds__(GDR_NT, 1) gdr_grad6_##S##_d##DK##_v##DV(              \
        const TQ* q, const TQ* k, const bf16_t* qb, const bf16_t* kb, const bf16_t* v, const bf16_t* beta, \
        const bf16_t* d_o, const float* gam_ws, const float* t_ws, const bf16_t* h_ws,                  \
        const bf16_t* dh_ws, const float* d_ws, const float* dd_ws, float* dvb_ws, float* dkb_ws,       \
        const i64* ch_t0, const int* ch_len, int hk, int hv, float scale, float* dq_part,               \
        float* dk_part, bf16_t* dv_out, float* dg, bf16_t* dbeta) {                                     \
        gdr_grad6<TQ, DK, DV>(q, k, qb, kb, v, beta, d_o, gam_ws, t_ws, h_ws, dh_ws, d_ws, dd_ws, dvb_ws, \
                              dkb_ws, ch_t0, ch_len, hk, hv, scale, dq_part, dk_part, dv_out, dg, dbeta); \
    }

GDR_GRAD6_ENTRY(bf16_t, bf16, 64, 64)
GDR_GRAD6_ENTRY(bf16_t, bf16, 64, 128)
GDR_GRAD6_ENTRY(bf16_t, bf16, 128, 64)
GDR_GRAD6_ENTRY(bf16_t, bf16, 128, 128)
GDR_GRAD6_ENTRY(float, bf16n, 64, 64)
GDR_GRAD6_ENTRY(float, bf16n, 64, 128)
GDR_GRAD6_ENTRY(float, bf16n, 128, 64)
GDR_GRAD6_ENTRY(float, bf16n, 128, 128)

extern "C" __global__ void __launch_bounds__(GDR_NT) gdr_cvt_f32_bf16(const float* x, bf16_t* y, i64 n) {
    for (i64 i = (i64)blockIdx.x * GDR_NT + threadIdx.x; i < n; i += (i64)gridDim.x * GDR_NT) y[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void __launch_bounds__(GDR_NT) gdr_cvt_bf16_f32(const bf16_t* x, float* y, i64 n) {
    for (i64 i = (i64)blockIdx.x * GDR_NT + threadIdx.x; i < n; i += (i64)gridDim.x * GDR_NT) y[i] = bf16_to_f32(x[i]);
}

// =============================================================================================
// prep7 (issue 13): one kernel for the v6 pipeline's whole chunk prep (it replaces
// gdr_l2norm2 x2 + gdr_prep6 + gdr_qk6 and writes exactly their outputs, same layouts and types):
// per (chunk, value head), 8 warps:
//   1. the chunk's raw q, k (bf16) and v rows by cp.async (16 B, rows >= l zero-filled);
//   2. NORM: the l2 norm of each q / k row in fp32 (two threads per row, 16-byte accesses; the
//      formula of gdr_l2norm2, another summation order), written fp32 and bf16 by the first
//      value head of the GVA group (cuda.rs runs gdr_l2norm2 on the padding rows, which are in
//      no chunk); the normalized rows kept in shared memory as bf16 hi + lo (x = hi + lo to
//      ~2^-16);
//   3. gam = cumsum g (one thread, gdr_prep's order);
//   4. K K^T and Q K^T on mma.sync m16n8k16 bf16, fp32 accumulation; SPLIT: three products per
//      tile (hi hi + lo hi + hi lo), so the products keep ~fp32 accuracy (a q.k that cancels is
//      not computed from bf16-rounded rows); M = strict_lower(diag(beta) K K^T * Gamma) to
//      shared memory (fp32), A = lower_incl(Q K^T * Gamma) to memory (bf16);
//   5. T = (I + M)^-1 in fp32: the 16 x 16 diagonal blocks by forward substitution, one lane
//      per column with the column in registers (no barrier per row); the blocks below by
//      gdr_prep's block rows (fp32 FMAs, 4 adjacent columns per thread, 16-byte loads);
//   6. W = (T diag(beta e^gam)) K and U = (T diag(beta)) V on mma.sync: the scaled T split into
//      bf16 hi + lo (SPLIT), K as hi (+ lo), V exact in bf16; only the k blocks on or below the
//      row block (T is lower triangular).
// Warp w owns rows 16 (w & 3) .. + 15 and one half of the columns (w >> 2) of every product.
// Without SPLIT ("f" kernels) every product runs on the bf16 hi parts alone (FLA's precision).
// Shared memory (P7Layout; cuda.rs prep7_bytes uses the same formula), DK = 128, Dv = 128:
// 108,288 bytes: two CTAs per SM.

template <int DK>
struct P7Layout {
    static constexpr int LK = DK + 8;   // bf16 row stride of Q, K (hi, lo)
    static constexpr int LP = GDR_C + 8;  // bf16 row stride of the scaled T (hi, lo)
    static constexpr int LF = GDR_C + 4;  // fp32 row stride of M and T
    static constexpr int KH = 0;
    static constexpr int KL = KH + GDR_C * LK * 2;
    static constexpr int QH = KL + GDR_C * LK * 2;  // Q hi, Q lo; then M (fp32), then P hi / lo
    static constexpr int QL = QH + GDR_C * LK * 2;
    static constexpr int M_OFF = QH;
    static constexpr int PH = QH;
    static constexpr int PL = PH + GDR_C * LP * 2;
    static constexpr int T_OFF = QL + GDR_C * LK * 2;
    static constexpr int X_OFF = T_OFF + GDR_C * LF * 4;  // X blocks of the off-diagonal solve
    static constexpr int S_OFF = X_OFF + 3 * 256 * 4;     // gam, beta, beta e^gam
    static constexpr int V_OFF = S_OFF + 3 * GDR_C * 4;   // V bf16 [64][dv + 8]
    static_assert(GDR_C * LF * 4 <= 2 * GDR_C * LK * 2, "M fits in the Q region");
    static_assert(2 * GDR_C * LP * 2 <= 2 * GDR_C * LK * 2, "P fits in the Q region");
    // prep8's staging: A (8 warps x 16 rows x 40 bf16) in the T region, W (8 x 16 x (DK / 2 + 8))
    // in the Q region
    static_assert(8 * 16 * 40 * 2 <= GDR_C * LF * 4, "A's staging fits in the T region");
    static_assert(8 * 16 * (DK / 2 + 8) * 2 <= 2 * GDR_C * LK * 2, "W's staging fits in the Q region");
};

// acc (16 x 8 NT8 slice at rows rt, columns col0) += sum over k in [k0, k1) of A(i, k) B(k, n),
// from bf16 shared memory; A stored [i][k]; BT true: B stored [n][k], false: [k][n]. The lo
// parts (al, bl; either may be null) add the products al bh and ah bl.
template <int NT8, bool BT>
__device__ __forceinline__ void p7_mma(float (&acc)[NT8][4], const bf16_t* ah, const bf16_t* al, int lda,
                                       const bf16_t* bh, const bf16_t* bl, int ldb, int rt, int col0, int k0,
                                       int k1) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
    for (int kk = k0; kk < k1; kk += 16) {
        const int ao = (rt + 8 * (mi & 1) + r) * lda + kk + 8 * (mi >> 1);
        unsigned fh[4], fl[4];
        ldsm_x4(fh, ah + ao);
        if (al) ldsm_x4(fl, al + ao);
#pragma unroll
        for (int np = 0; np < NT8 / 2; ++np) {
            const int n0 = col0 + 16 * np;
            const int bo = BT ? (n0 + 8 * (mi >> 1) + r) * ldb + kk + 8 * (mi & 1)
                              : (kk + 8 * (mi & 1) + r) * ldb + n0 + 8 * (mi >> 1);
            unsigned bb[4];
            if (BT) ldsm_x4(bb, bh + bo);
            else ldsm_x4_t(bb, bh + bo);
            mma_bf16(acc[2 * np], fh, bb[0], bb[1]);
            mma_bf16(acc[2 * np + 1], fh, bb[2], bb[3]);
            if (al) {
                mma_bf16(acc[2 * np], fl, bb[0], bb[1]);
                mma_bf16(acc[2 * np + 1], fl, bb[2], bb[3]);
            }
            if (bl) {
                if (BT) ldsm_x4(bb, bl + bo);
                else ldsm_x4_t(bb, bl + bo);
                mma_bf16(acc[2 * np], fh, bb[0], bb[1]);
                mma_bf16(acc[2 * np + 1], fh, bb[2], bb[3]);
            }
        }
    }
}

template <int NT8>
__device__ __forceinline__ void p7_zero(float (&acc)[NT8][4]) {
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[n][c] = 0.f;
}

// f(row, column, v0, v1) for each pair of adjacent columns (2t, 2t + 1) of the warp's slice.
template <int NT8, class F>
__device__ __forceinline__ void p7_epi(const float (&acc)[NT8][4], int rt, int col0, F f) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) f(rt + g + 8 * h, col0 + 8 * n + 2 * t, acc[n][2 * h], acc[n][2 * h + 1]);
}

// x as bf16 hi + lo (lo = the rounding error of hi, rounded).
__device__ __forceinline__ void p7_split(float x, bf16_t& hi, bf16_t& lo) {
    hi = f32_to_bf16(x);
    lo = f32_to_bf16(x - bf16_to_f32(hi));
}

// stmatrix .x4 (not transposed): register m of lane (g, t) holds elements (g, 2t), (g, 2t + 1) of
// 8 x 8 bf16 matrix m, written to the row address lane 8m + g gives (+ 4t bytes). Below sm_90
// the same bytes by 4-byte shared stores. Every lane of the warp takes part.
__device__ __forceinline__ void stsm_x4(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
#if __CUDA_ARCH__ >= 900
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
#else
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned r[4] = {r0, r1, r2, r3};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned ra = __shfl_sync(0xffffffffu, a, 8 * m + g);
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(ra + 4u * t), "r"(r[m]) : "memory");
    }
#endif
}

// prep8's bf16 output tiles: a warp's 16 rows x 16 NP columns, given as C fragments (f[n][h]:
// n8 tile n, rows g + 8 h, the pack_bf16 of columns 2t, 2t + 1), through its own shared-memory
// rows (`stg`, LD bf16 apart, 2 LD = 16 mod 128 bytes: the 8 rows of a matrix hit 8 different
// bank groups) to dst (row stride ld bf16, 16-byte aligned rows): 16-byte pieces, whole sectors.
template <int NP, int LD>
__device__ __forceinline__ void p8_tile_out(const unsigned (&f)[2 * NP][2], bf16_t* stg, bf16_t* dst, int ld) {
    const int lane = threadIdx.x & 31, r = lane & 7, m = lane >> 3;
    const unsigned sb = smem_addr(stg);
    __syncwarp();
#pragma unroll
    for (int np = 0; np < NP; ++np)
        stsm_x4(sb + 2u * ((8 * (m & 1) + r) * LD + 8 * (2 * np + (m >> 1))), f[2 * np][0], f[2 * np][1],
                f[2 * np + 1][0], f[2 * np + 1][1]);
    __syncwarp();
    constexpr int PR = NP * 2;  // 16-byte pieces per row
#pragma unroll
    for (int it = 0; it < PR / 2; ++it) {
        const int pc = lane + 32 * it, R = pc / PR, c = pc % PR;
        const uint4 x = *reinterpret_cast<const uint4*>(stg + R * LD + 8 * c);
        *reinterpret_cast<uint4*>(dst + (i64)R * ld + 8 * c) = x;
    }
    __syncwarp();
}

// prep8: the A fragments (hi, lo) of rows rt .. rt + 15, k block kb of P = T diag(sc), split as
// prep7 splits it in shared memory (the same bits: one rounded product, hi its round to nearest
// even, lo that of the remainder).
template <int LF>
__device__ __forceinline__ void p8_pfrag(const float* sT, const float* sc, int rt, int kb, unsigned (&fh)[4],
                                         unsigned (&fl)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int row = rt + g + 8 * (m & 1), col = 16 * kb + 2 * t + 8 * (m >> 1);
        const float2 tv = *reinterpret_cast<const float2*>(sT + row * LF + col);
        const float2 sv = *reinterpret_cast<const float2*>(sc + col);
        const float x0 = __fmul_rn(tv.x, sv.x), x1 = __fmul_rn(tv.y, sv.y);
        const unsigned h = pack_bf16(x0, x1);
        fh[m] = h;
        fl[m] = pack_bf16(x0 - __uint_as_float(h << 16), x1 - __uint_as_float(h & 0xffff0000u));
    }
}

// V8 (gdr_prep8, SPLIT only): the same outputs bit for bit with less work around the products:
// gam summed in registers; M by 8-byte stores; A, W out through shared memory as whole sectors
// (p8_tile_out); T by 16-byte stores; W and U from P fragments built in registers (p8_pfrag, no
// shared P, no barrier), each warp one W tile (rows 16 (w & 3), column half w >> 2) and one U
// tile (rows 16 (3 - (w & 3)), the same column half): 5 k blocks per warp, balanced.
// GVA (gdr_prep9, with V8): one CTA per (chunk, key head) walks the key head's value heads in
// order: the raw q, k rows, their l2 norm and the K K^T, Q K^T products once for the group, then
// per value head prep8's steps from the M / A epilogue on (its V, beta, g loaded after the
// previous head is done, V by cp.async under the epilogue and the solve). Every output is
// prep8's (and prep7's) bit for bit.
// Saved T (V8 only): `tp`, when not null, holds each (chunk, value head)'s T packed as its ten
// 16 x 16 blocks on or below the diagonal (block (a, b), b <= a, at a (a + 1) / 2 + b, 256 fp32
// row-major each: GDR_TP floats per chunk and value head; the blocks above the diagonal are
// zero). Without TIN (the forward) the kernel writes it after the solve; with TIN (gdr_prep8t /
// gdr_prep9t, the backward) it reads it instead of solving: no K K^T, no M, no solve, the copy
// of T in flight by cp.async with V. Everything after the solve reads the same T values, so every
// output is the solving kernel's bit for bit.
#define GDR_TP (10 * 256)
// Block blk (0 .. 9) of the packed T: its block row a and column b (blk = a (a + 1) / 2 + b).
__device__ __forceinline__ void gdr_tp_block(int blk, int& a, int& b) {
    a = blk < 1 ? 0 : blk < 3 ? 1 : blk < 6 ? 2 : 3;
    b = blk - a * (a + 1) / 2;
}
template <int DK, bool NORM, bool SPLIT, bool V8 = false, bool GVA = false, bool TIN = false, bool TOUT = false,
          bool TW = false>
__device__ void gdr_prep7(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                          const float* __restrict__ g, const bf16_t* __restrict__ beta,
                          const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                          int dv, float* __restrict__ qn, bf16_t* __restrict__ qnb, float* __restrict__ kn,
                          bf16_t* __restrict__ knb, float* __restrict__ gam_ws, float* __restrict__ t_ws,
                          bf16_t* __restrict__ w_ws, float* __restrict__ u_ws, bf16_t* __restrict__ a_ws,
                          float* __restrict__ tp) {
    using L = P7Layout<DK>;
    constexpr bool KLO = SPLIT && NORM;  // caller-normalized bf16 rows are exact in bf16
    const int ratio = hv_n / hk_n;
    ChunkGeo G;
    static_assert(V8 || !GVA, "the key-head CTA is prep8's");
    static_assert(V8 || !TIN, "a saved T is read by prep8 / prep9");
    static_assert(V8 || !TOUT, "prep8o / prep9o / prep8to / prep9to: prep8 / prep9");
    static_assert(TOUT || !TW, "W beside PT: the TOUT kernels");
    if constexpr (V8) {
        // 32-bit block arithmetic (the grid is below 2^31); GVA: one CTA per (chunk, key head),
        // from its first value head
        const unsigned b = blockIdx.x, nh = (unsigned)(GVA ? hk_n : hv_n);
        const int h = (int)(b % nh);
        G.c = b / nh;
        G.kh = GVA ? h : h / ratio;
        G.hv = GVA ? h * ratio : h;
        G.t0 = ch_t0[G.c];
        G.l = ch_len[G.c];
    } else {
        G = chunk_geo(ch_t0, ch_len, hv_n, ratio);
    }
    const int l = G.l, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    i64 cb = G.c * hv_n + G.hv;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    bf16_t* sKh = reinterpret_cast<bf16_t*>(sm + L::KH);
    bf16_t* sKl = reinterpret_cast<bf16_t*>(sm + L::KL);
    bf16_t* sQh = reinterpret_cast<bf16_t*>(sm + L::QH);
    bf16_t* sQl = reinterpret_cast<bf16_t*>(sm + L::QL);
    float* sM = reinterpret_cast<float*>(sm + L::M_OFF);
    bf16_t* sPh = reinterpret_cast<bf16_t*>(sm + L::PH);
    bf16_t* sPl = reinterpret_cast<bf16_t*>(sm + L::PL);
    float* sT = reinterpret_cast<float*>(sm + L::T_OFF);
    float* sX = reinterpret_cast<float*>(sm + L::X_OFF);
    float* s_gam = reinterpret_cast<float*>(sm + L::S_OFF);
    float* s_beta = s_gam + GDR_C;
    float* s_bge = s_beta + GDR_C;
    const int lv = dv + 8;
    bf16_t* sV = reinterpret_cast<bf16_t*>(sm + L::V_OFF);
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;
    const bf16_t* kg = k + G.t0 * krow + (i64)G.kh * DK;
    const bf16_t* qg = q + G.t0 * krow + (i64)G.kh * DK;
    const bf16_t* vg = v + G.t0 * vrow + (i64)G.hv * dv;
    // value head G.hv's V rows (by cp.async, committed), beta and g
    auto load_head = [&]() {
        const int pv = dv / 8;
        // (TOUT: no U, so no V)
        for (int e = tid; e < (TOUT ? 0 : GDR_C * pv); e += GDR_NT) {
            const int i = e / pv, x = 8 * (e - i * pv);
            const bool ok = i < l;
            cp_async16(sV + i * lv + x, vg + (ok ? (i64)i * vrow + x : 0), ok);
        }
        if constexpr (TIN) {
            // the head's saved T: its ten blocks' rows as 16-byte pieces into the T region
            const float* src = tp + cb * GDR_TP;
            for (int e = tid; e < 10 * 64; e += GDR_NT) {
                const int blk = e >> 6, r = (e >> 2) & 15, pc = e & 3;
                int a, b;
                gdr_tp_block(blk, a, b);
                cp_async16(sT + (16 * a + r) * L::LF + 16 * b + 4 * pc, src + blk * 256 + r * 16 + 4 * pc, true);
            }
        }
        cp_async_commit();
        if (tid < GDR_C) {
            s_beta[tid] = tid < l ? ld(beta, (G.t0 + tid) * hv_n + G.hv) : 0.f;
            s_gam[tid] = tid < l ? g[(G.t0 + tid) * hv_n + G.hv] : 0.f;
        }
    };

    // 1. Raw rows (rows >= l zero-filled: they may belong to the next sequence or lie past the
    // buffer), beta and g.
    {
        constexpr int PK = DK / 8;  // 16-byte pieces per q / k row
        for (int e = tid; e < GDR_C * PK; e += GDR_NT) {
            const int i = e / PK, x = 8 * (e - i * PK);
            const bool ok = i < l;
            const i64 src = ok ? (i64)i * krow + x : 0;
            cp_async16(sKh + i * L::LK + x, kg + src, ok);
            cp_async16(sQh + i * L::LK + x, qg + src, ok);
        }
    }
    load_head();
    if constexpr (TIN) {
        // the blocks above the diagonal, zero (only T's copy to t_ws reads them; nothing else
        // writes the T region here: A is staged in the Q region)
        for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
            const int i = e >> 6, c = e & 63;
            if ((c >> 4) > (i >> 4)) sT[i * L::LF + c] = 0.f;
        }
    }
    cp_async_wait_all();
    __syncthreads();

    // 2. gam (the last thread) and the l2 norm of the 128 q / k rows: two threads per row (K
    // rows 0..63, then Q), each summing its half row in order, 16-byte shared-memory accesses.
    auto gam_sum = [&]() {
    if (tid == GDR_NT - 1) {
        if constexpr (V8) {
            // the same sums in the same order, in registers (rows >= l hold 0 and stay 0)
            float x[GDR_C];
#pragma unroll
            for (int p = 0; p < GDR_C / 4; ++p) {
                const float4 v4 = reinterpret_cast<const float4*>(s_gam)[p];
                x[4 * p] = v4.x;
                x[4 * p + 1] = v4.y;
                x[4 * p + 2] = v4.z;
                x[4 * p + 3] = v4.w;
            }
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < GDR_C; ++i) {
                acc += x[i];
                x[i] = i < l ? acc : 0.f;
            }
#pragma unroll
            for (int p = 0; p < GDR_C / 4; ++p)
                reinterpret_cast<float4*>(s_gam)[p] = make_float4(x[4 * p], x[4 * p + 1], x[4 * p + 2], x[4 * p + 3]);
        } else {
            float acc = 0.f;
            for (int i = 0; i < l; ++i) { acc += s_gam[i]; s_gam[i] = acc; }
        }
    }
    };
    gam_sum();
    if (NORM) {
        constexpr int NV = DK / 16;  // 8-element pieces per half row
        const int rr = tid >> 1, hf = tid & 1, i = rr & (GDR_C - 1);
        const bool isq = rr >= GDR_C;
        bf16_t* xh = (isq ? sQh : sKh) + i * L::LK + hf * (DK / 2);
        bf16_t* xl = (isq ? sQl : sKl) + i * L::LK + hf * (DK / 2);
        uint4 raw[NV];
        float ss = 0.f;
#pragma unroll
        for (int p = 0; p < NV; ++p) {
            raw[p] = reinterpret_cast<const uint4*>(xh)[p];
            const unsigned wv[4] = {raw[p].x, raw[p].y, raw[p].z, raw[p].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float a = __uint_as_float(wv[e] << 16), b = __uint_as_float(wv[e] & 0xffff0000u);
                ss += a * a;
                ss += b * b;
            }
        }
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        const float rs = 1.f / sqrtf(ss + 1e-6f);
        const bool wr = (G.hv % ratio) == 0 && i < l;  // the first value head of the group writes
        const i64 orow = ((G.t0 + i) * hk_n + G.kh) * DK + hf * (DK / 2);
        float* yo = isq ? qn : kn;  // null: the fp32 copies are not wanted (forward)
        bf16_t* ybo = (isq ? qnb : knb) + orow;
        const bool w32 = wr && yo != nullptr;
        if (w32) yo += orow;
#pragma unroll
        for (int p = 0; p < NV; ++p) {
            const unsigned wv[4] = {raw[p].x, raw[p].y, raw[p].z, raw[p].w};
            float y[8];
            unsigned hi[4], lo[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                y[2 * e] = __uint_as_float(wv[e] << 16) * rs;
                y[2 * e + 1] = __uint_as_float(wv[e] & 0xffff0000u) * rs;
                hi[e] = pack_bf16(y[2 * e], y[2 * e + 1]);
                lo[e] = pack_bf16(y[2 * e] - __uint_as_float(hi[e] << 16),
                                  y[2 * e + 1] - __uint_as_float(hi[e] & 0xffff0000u));
            }
            const uint4 h4 = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            reinterpret_cast<uint4*>(xh)[p] = h4;
            reinterpret_cast<uint4*>(xl)[p] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
            if (w32) {
                reinterpret_cast<float4*>(yo)[2 * p] = make_float4(y[0], y[1], y[2], y[3]);
                reinterpret_cast<float4*>(yo)[2 * p + 1] = make_float4(y[4], y[5], y[6], y[7]);
            }
            if (wr) reinterpret_cast<uint4*>(ybo)[p] = h4;
        }
    }
    __syncthreads();

    // 3. K K^T and Q K^T: warp w, rows rt = 16 (w & 3), columns c0 = 32 (w >> 2) (4 n8 tiles);
    // tiles wholly above the diagonal are not computed (their outputs are masked to zero).
    const int rt = 16 * (warp & 3), half = warp >> 2;
    float akk[4][4], aqk[4][4];
    p7_zero<4>(akk);
    p7_zero<4>(aqk);
    if (32 * half <= rt + 15) {
        if (!TIN) p7_mma<4, true>(akk, sKh, KLO ? sKl : nullptr, L::LK, sKh, KLO ? sKl : nullptr, L::LK, rt, 32 * half, 0, DK);
        p7_mma<4, true>(aqk, sQh, KLO ? sQl : nullptr, L::LK, sKh, KLO ? sKl : nullptr, L::LK, rt, 32 * half, 0, DK);
    }
    __syncthreads();  // every warp is done with Q before M overwrites it
    // The value heads (one unless GVA): from here on per value head G.hv.
    for (int hj = 0; hj < (GVA ? ratio : 1); ++hj) {
    if constexpr (GVA) {
        if (hj > 0) {
            __syncthreads();  // the previous head's reads of V, T, beta, gam, the staging rows are done
            G.hv += 1;
            cb += 1;
            vg += dv;
            load_head();
            __syncthreads();
            gam_sum();
            __syncthreads();
        }
    }
    if (tid < GDR_C) {
        s_bge[tid] = tid < l ? s_beta[tid] * expf(s_gam[tid]) : 0.f;
        gam_ws[cb * GDR_C + tid] = s_gam[tid];
    }
    {
        const int c0 = 32 * half;
        // M and A from the two accumulators (the same fragment layout): Gamma once per element.
        unsigned* a_out = reinterpret_cast<unsigned*>(a_ws + cb * (GDR_C * GDR_C));
        const int g4 = lane >> 2, t4 = lane & 3;
        unsigned pa[4][2];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = rt + g4 + 8 * h, j = c0 + 8 * n + 2 * t4;
                const bool ri = i < l;
                const float e0 = (j <= i && ri) ? expf(s_gam[i] - s_gam[j]) : 0.f;
                const float e1 = (j + 1 <= i && ri) ? expf(s_gam[i] - s_gam[j + 1]) : 0.f;
                const float bi = s_beta[i];
                const float m0 = (j < i && ri) ? bi * akk[n][2 * h] * e0 : 0.f;
                const float m1 = (j + 1 < i && ri) ? bi * akk[n][2 * h + 1] * e1 : 0.f;
                const unsigned av = pack_bf16((j <= i && ri) ? aqk[n][2 * h] * e0 : 0.f,
                                              (j + 1 <= i && ri) ? aqk[n][2 * h + 1] * e1 : 0.f);
                if constexpr (TIN) {
                    pa[n][h] = av;
                } else if constexpr (V8) {
                    *reinterpret_cast<float2*>(sM + i * L::LF + j) = make_float2(m0, m1);
                    pa[n][h] = av;
                } else {
                    sM[i * L::LF + j] = m0;
                    sM[i * L::LF + j + 1] = m1;
                    a_out[(i * GDR_C + j) >> 1] = av;
                }
            }
        if constexpr (V8) {
            // the warp's 16 x 32 tile of A through its own rows of the T region (10,240 bytes; T
            // is written only after the next barrier; at Dk 64 M reaches into the Q lo rows)
            // (TIN: in the Q region, free after the products, since the T region holds T)
            p8_tile_out<2, 40>(pa, (TIN ? sQh : reinterpret_cast<bf16_t*>(sT)) + warp * 16 * 40,
                               a_ws + cb * (GDR_C * GDR_C) + (i64)rt * GDR_C + c0, GDR_C);
        }
    }
    __syncthreads();

    // 4. T = (I + M)^-1. Diagonal blocks: thread (a, c) (64 threads) computes column c of block
    // a by forward substitution with the column in registers; the other threads zero the
    // blocks above the diagonal. TIN: T is the saved one (its copy, issued with V, done).
    if constexpr (TIN) {
        cp_async_wait_all();
        __syncthreads();
    } else {
    if (tid < GDR_C) {
        const int a = tid >> 4, c = tid & 15;
        const float* mb = sM + (16 * a) * L::LF + 16 * a;
        float tc[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < i; ++j) s -= mb[i * L::LF + j] * tc[j];
            tc[i] = i == c ? 1.f : s;
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) sT[(16 * a + i) * L::LF + 16 * a + c] = tc[i];
    } else {
        for (int e = tid - GDR_C; e < GDR_C * GDR_C; e += GDR_NT - GDR_C) {
            const int i = e >> 6, c = e & 63;
            if ((c >> 4) > (i >> 4)) sT[i * L::LF + c] = 0.f;
        }
    }
    __syncthreads();
    // Blocks below the diagonal, block row by block row: T_ab = -T_aa X_ab with
    // X_ab = sum_{b <= k < a} M_ak T_kb (gdr_prep's order). Thread e < 64 a owns 4 adjacent
    // columns of one row of one block (16-byte loads of T and X rows, 4 FMAs per load).
    for (int a = 1; a < 4; ++a) {
        const int e = tid, b = e >> 6, r = (e >> 2) & 15, cq = e & 3;
        const int i = 16 * a + r, col = 16 * b + 4 * cq;
        if (e < 64 * a) {
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int j0 = 16 * b; j0 < 16 * a; j0 += 4) {
                const float4 m4 = *reinterpret_cast<const float4*>(sM + i * L::LF + j0);
                const float mv[4] = {m4.x, m4.y, m4.z, m4.w};
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const float4 t4 = *reinterpret_cast<const float4*>(sT + (j0 + jj) * L::LF + col);
                    x.x += mv[jj] * t4.x;
                    x.y += mv[jj] * t4.y;
                    x.z += mv[jj] * t4.z;
                    x.w += mv[jj] * t4.w;
                }
            }
            *reinterpret_cast<float4*>(sX + (b << 8) + (r << 4) + 4 * cq) = x;
        }
        __syncthreads();
        if (e < 64 * a) {
            float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j0 = 0; j0 < 16; j0 += 4) {
                const float4 d4 = *reinterpret_cast<const float4*>(sT + i * L::LF + 16 * a + j0);
                const float dv4[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const float4 x4 = *reinterpret_cast<const float4*>(sX + (b << 8) + ((j0 + jj) << 4) + 4 * cq);
                    y.x -= dv4[jj] * x4.x;
                    y.y -= dv4[jj] * x4.y;
                    y.z -= dv4[jj] * x4.z;
                    y.w -= dv4[jj] * x4.w;
                }
            }
            *reinterpret_cast<float4*>(sT + i * L::LF + col) = y;
        }
        __syncthreads();
    }
    }  // the solve

    if constexpr (V8) {
        static_assert(SPLIT, "prep8 splits every product");
        // 5. T to memory (backward), 16-byte stores; the packed T to keep (forward, tp).
        if (!TIN && tp) {
            float* dst = tp + cb * GDR_TP;
            for (int e = tid; e < 10 * 64; e += GDR_NT) {
                const int blk = e >> 6, r = (e >> 2) & 15, pc = e & 3;
                int a, b;
                gdr_tp_block(blk, a, b);
                *reinterpret_cast<float4*>(dst + blk * 256 + r * 16 + 4 * pc) =
                    *reinterpret_cast<const float4*>(sT + (16 * a + r) * L::LF + 16 * b + 4 * pc);
            }
        }
        if (t_ws) {
            for (int e = tid; e < GDR_C * GDR_C / 4; e += GDR_NT) {
                const int i = e >> 4, c4 = 4 * (e & 15);
                *reinterpret_cast<float4*>(t_ws + cb * (GDR_C * GDR_C) + i * GDR_C + c4) =
                    *reinterpret_cast<const float4*>(sT + i * L::LF + c4);
            }
        }
        if constexpr (TOUT) {
            // 6'. Instead of W and U (gdr_fwd10 rebuilds D from K, V and this): PT = T diag(beta)
            // as bf16 hi + lo, p8_pfrag's values (U's operand), [2][64][64] per (chunk, value
            // head) at w_ws (hi, then lo), zero above the diagonal. TW (gdr_prep8ow / 9ow /
            // 8tow / 9tow, for gdr_hrec10 beside a reverse scan that reads W): PT at u_ws (its
            // bytes as bf16), then W as prep8 writes it at w_ws; still no U.
            bf16_t* pt_out = TW ? reinterpret_cast<bf16_t*>(u_ws) : w_ws;
            unsigned* dst = reinterpret_cast<unsigned*>(pt_out + cb * (2 * GDR_C * GDR_C));
            for (int e = tid; e < GDR_C * GDR_C / 2; e += GDR_NT) {
                const int i = e >> 5, m = 2 * (e & 31);
                const float2 tv = *reinterpret_cast<const float2*>(sT + i * L::LF + m);
                const float2 sv = *reinterpret_cast<const float2*>(s_beta + m);
                const float x0 = m <= i ? __fmul_rn(tv.x, sv.x) : 0.f;
                const float x1 = m + 1 <= i ? __fmul_rn(tv.y, sv.y) : 0.f;
                const unsigned h = pack_bf16(x0, x1);
                dst[e] = h;
                dst[GDR_C * GDR_C / 2 + e] =
                    pack_bf16(x0 - __uint_as_float(h << 16), x1 - __uint_as_float(h & 0xffff0000u));
            }
            if constexpr (!TW) continue;
        }
        const int mi = lane >> 3, r8 = lane & 7;
        // 6. W = (T diag(beta e^gam)) K: rows 16 (warp & 3), columns half (DK / 2) ..; the k
        // blocks on or below the row block, each product hi hi, lo hi, hi lo as p7_mma adds them.
        {
            constexpr int NT8 = DK / 16;
            const int rb = warp & 3, rw = 16 * rb, c0 = half * (DK / 2);
            float acc[NT8][4];
            p7_zero<NT8>(acc);
#pragma unroll
            for (int kb = 0; kb < 4; ++kb) {
                if (kb > rb) break;
                unsigned fh[4], fl[4];
                p8_pfrag<L::LF>(sT, s_bge, rw, kb, fh, fl);
                const int kk = 16 * kb;
#pragma unroll
                for (int np = 0; np < NT8 / 2; ++np) {
                    const int bo = (kk + 8 * (mi & 1) + r8) * L::LK + c0 + 16 * np + 8 * (mi >> 1);
                    unsigned bb[4];
                    ldsm_x4_t(bb, sKh + bo);
                    mma_bf16(acc[2 * np], fh, bb[0], bb[1]);
                    mma_bf16(acc[2 * np + 1], fh, bb[2], bb[3]);
                    mma_bf16(acc[2 * np], fl, bb[0], bb[1]);
                    mma_bf16(acc[2 * np + 1], fl, bb[2], bb[3]);
                    if (KLO) {
                        ldsm_x4_t(bb, sKl + bo);
                        mma_bf16(acc[2 * np], fh, bb[0], bb[1]);
                        mma_bf16(acc[2 * np + 1], fh, bb[2], bb[3]);
                    }
                }
            }
            unsigned pw[NT8][2];
#pragma unroll
            for (int n = 0; n < NT8; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) pw[n][h] = pack_bf16(acc[n][2 * h], acc[n][2 * h + 1]);
            // staged in the Q region: M and the Q rows are dead after the solve
            constexpr int LDW = DK / 2 + 8;
            p8_tile_out<NT8 / 2, LDW>(pw, sQh + warp * 16 * LDW, w_ws + cb * GDR_C * DK + (i64)rw * DK + c0, DK);
        }
        if constexpr (TOUT) continue;  // (TW: W only)
        // 7. U = (T diag(beta)) V: rows 16 (3 - (warp & 3)), this half's 16-column groups
        // (alternating, as prep7), the products hi V, lo V.
        if (GVA && hj > 0) {  // this head's V rows
            cp_async_wait_all();
            __syncthreads();
        }
        {
            const int rb = 3 - (warp & 3), ru = 16 * rb;
            unsigned fh[4][4], fl[4][4];
#pragma unroll
            for (int kb = 0; kb < 4; ++kb)
                if (kb <= rb) p8_pfrag<L::LF>(sT, s_beta, ru, kb, fh[kb], fl[kb]);
            float* u_out = u_ws + cb * GDR_C * (i64)dv;
            const int g4 = lane >> 2, t4 = lane & 3;
            for (int c0 = 16 * half; c0 < dv; c0 += 32) {
                float acc[2][4];
                p7_zero<2>(acc);
#pragma unroll
                for (int kb = 0; kb < 4; ++kb) {
                    if (kb > rb) break;
                    unsigned bb[4];
                    ldsm_x4_t(bb, sV + (16 * kb + 8 * (mi & 1) + r8) * lv + c0 + 8 * (mi >> 1));
                    mma_bf16(acc[0], fh[kb], bb[0], bb[1]);
                    mma_bf16(acc[1], fh[kb], bb[2], bb[3]);
                    mma_bf16(acc[0], fl[kb], bb[0], bb[1]);
                    mma_bf16(acc[1], fl[kb], bb[2], bb[3]);
                }
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        *reinterpret_cast<float2*>(u_out + (i64)(ru + g4 + 8 * h) * dv + c0 + 8 * n + 2 * t4) =
                            make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
            }
        }
        continue;
    }
    // 5. T to memory (backward), P = T diag(beta e^gam) (overwrites M), W = P K.
    if (t_ws) {
        for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT)
            t_ws[cb * (GDR_C * GDR_C) + e] = sT[(e >> 6) * L::LF + (e & 63)];
    }
    for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
        const int i = e >> 6, m = e & 63;
        bf16_t hi, lo;
        p7_split(sT[i * L::LF + m] * s_bge[m], hi, lo);
        sPh[i * L::LP + m] = hi;
        sPl[i * L::LP + m] = lo;
    }
    __syncthreads();
    {
        constexpr int NT8 = DK / 16;  // half of the columns
        const int c0 = half * (DK / 2);
        float acc[NT8][4];
        p7_zero<NT8>(acc);
        p7_mma<NT8, false>(acc, sPh, SPLIT ? sPl : nullptr, L::LP, sKh, KLO ? sKl : nullptr, L::LK, rt, c0, 0,
                           rt + 16);
        unsigned* w_out = reinterpret_cast<unsigned*>(w_ws + cb * GDR_C * DK);
        p7_epi<NT8>(acc, rt, c0,
                    [&](int i, int j, float x0, float x1) { w_out[(i * DK + j) >> 1] = pack_bf16(x0, x1); });
    }
    __syncthreads();
    // 6. P = T diag(beta), U = P V (16-column groups, alternating between the two halves).
    for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
        const int i = e >> 6, m = e & 63;
        bf16_t hi, lo;
        p7_split(sT[i * L::LF + m] * s_beta[m], hi, lo);
        sPh[i * L::LP + m] = hi;
        sPl[i * L::LP + m] = lo;
    }
    __syncthreads();
    float* u_out = u_ws + cb * GDR_C * (i64)dv;
    for (int c0 = 16 * half; c0 < dv; c0 += 32) {
        float acc[2][4];
        p7_zero<2>(acc);
        p7_mma<2, false>(acc, sPh, SPLIT ? sPl : nullptr, L::LP, sV, nullptr, lv, rt, c0, 0, rt + 16);
        p7_epi<2>(acc, rt, c0, [&](int i, int j, float x0, float x1) {
            *reinterpret_cast<float2*>(u_out + (i64)i * dv + j) = make_float2(x0, x1);
        });
    }
    }  // the value heads
}

// Entries: gdr_prep7{,f}_d{64,128}_{bf16n,bf16}: f = bf16 hi parts only (no split); bf16n = the
// in-kernel l2 norm (qnb, knb written; qn, kn too unless null), bf16 = caller-normalized q, k
// (those four unused).
// One entry NAME_d{DK}_{NS} of the prep template with template arguments DK, NORM, ... (the
// prep7 / prep8 / prep9 entries below).
#define GDR_PREP_ENTRY(NAME, DK, NS, ...)                                                                \
    extern "C" __global__ void __launch_bounds__(GDR_NT, 2) NAME##_d##DK##_##NS(                        \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* g, const bf16_t* beta,          \
        const i64* ch_t0, const int* ch_len, int hk, int hv, int dv, float* qn, bf16_t* qnb, float* kn, \
        bf16_t* knb, float* gam_ws, float* t_ws, bf16_t* w_ws, float* u_ws, bf16_t* a_ws, float* tp) {  \
        gdr_prep7<DK, __VA_ARGS__>(q, k, v, g, beta, ch_t0, ch_len, hk, hv, dv, qn, qnb, kn, knb, gam_ws,  \
                                   t_ws, w_ws, u_ws, a_ws, tp);                                         \
    }
#define GDR_PREP7_ENTRY(SFX, SPLIT, DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep7##SFX, DK, NS, NORM, SPLIT)

GDR_PREP7_ENTRY(, true, 64, bf16n, true)
GDR_PREP7_ENTRY(, true, 64, bf16, false)
GDR_PREP7_ENTRY(, true, 128, bf16n, true)
GDR_PREP7_ENTRY(, true, 128, bf16, false)
GDR_PREP7_ENTRY(f, false, 64, bf16n, true)
GDR_PREP7_ENTRY(f, false, 64, bf16, false)
GDR_PREP7_ENTRY(f, false, 128, bf16n, true)
GDR_PREP7_ENTRY(f, false, 128, bf16, false)
// gdr_prep8_d{64,128}_{bf16n,bf16}: prep7's outputs bit for bit (V8 above), the default prep
#define GDR_PREP8_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep8, DK, NS, NORM, true, true)
GDR_PREP8_ENTRY(64, bf16n, true)
GDR_PREP8_ENTRY(64, bf16, false)
GDR_PREP8_ENTRY(128, bf16n, true)
GDR_PREP8_ENTRY(128, bf16, false)
// gdr_prep9_d{64,128}_{bf16n,bf16}: one CTA per (chunk, key head) over its value heads (GVA
// above), prep8's outputs bit for bit; the grid is chunks x key heads
#define GDR_PREP9_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep9, DK, NS, NORM, true, true, true)
GDR_PREP9_ENTRY(64, bf16n, true)
GDR_PREP9_ENTRY(64, bf16, false)
GDR_PREP9_ENTRY(128, bf16n, true)
GDR_PREP9_ENTRY(128, bf16, false)
// gdr_prep8t / gdr_prep9t_d{64,128}_{bf16n,bf16}: prep8 / prep9 reading the forward's saved T
// (`tp`, TIN above) instead of solving for it: the same outputs bit for bit (the backward)
#define GDR_PREP8T_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep8t, DK, NS, NORM, true, true, false, true)
#define GDR_PREP9T_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep9t, DK, NS, NORM, true, true, true, true)
GDR_PREP8T_ENTRY(64, bf16n, true)
GDR_PREP8T_ENTRY(64, bf16, false)
GDR_PREP8T_ENTRY(128, bf16n, true)
GDR_PREP8T_ENTRY(128, bf16, false)
GDR_PREP9T_ENTRY(64, bf16n, true)
GDR_PREP9T_ENTRY(64, bf16, false)
GDR_PREP9T_ENTRY(128, bf16n, true)
GDR_PREP9T_ENTRY(128, bf16, false)
// gdr_prep8o / gdr_prep9o_d{64,128}_{bf16n,bf16}: prep8 / prep9 for gdr_fwd10 (TOUT above): T
// diag(beta) as bf16 hi + lo at w_ws instead of W and U (u_ws unused); A, gam, the normalized
// q / k and the kept T as prep8 / prep9's
#define GDR_PREP8O_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep8o, DK, NS, NORM, true, true, false, false, true)
#define GDR_PREP9O_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep9o, DK, NS, NORM, true, true, true, false, true)
GDR_PREP8O_ENTRY(64, bf16n, true)
GDR_PREP8O_ENTRY(64, bf16, false)
GDR_PREP8O_ENTRY(128, bf16n, true)
GDR_PREP8O_ENTRY(128, bf16, false)
GDR_PREP9O_ENTRY(64, bf16n, true)
GDR_PREP9O_ENTRY(64, bf16, false)
GDR_PREP9O_ENTRY(128, bf16n, true)
GDR_PREP9O_ENTRY(128, bf16, false)
// gdr_prep8to / gdr_prep9to_d{64,128}_{bf16n,bf16}: both (TIN and TOUT), for the v10 backward
// scans (gdr_hrec10, gdr_bwd10): the kept T read instead of solved, PT written instead of W, U
#define GDR_PREP8TO_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep8to, DK, NS, NORM, true, true, false, true, true)
#define GDR_PREP9TO_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep9to, DK, NS, NORM, true, true, true, true, true)
GDR_PREP8TO_ENTRY(64, bf16n, true)
GDR_PREP8TO_ENTRY(64, bf16, false)
GDR_PREP8TO_ENTRY(128, bf16n, true)
GDR_PREP8TO_ENTRY(128, bf16, false)
GDR_PREP9TO_ENTRY(64, bf16n, true)
GDR_PREP9TO_ENTRY(64, bf16, false)
GDR_PREP9TO_ENTRY(128, bf16n, true)
GDR_PREP9TO_ENTRY(128, bf16, false)
// gdr_prep8ow / 9ow / 8tow / 9tow_d{64,128}_{bf16n,bf16}: TOUT with W (TW above), without and with
// the kept T: for gdr_hrec10 beside the default reverse scans, which read W (GDN_RULE_HREC=v10)
#define GDR_PREP8OW_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep8ow, DK, NS, NORM, true, true, false, false, true, true)
#define GDR_PREP9OW_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep9ow, DK, NS, NORM, true, true, true, false, true, true)
#define GDR_PREP8TOW_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep8tow, DK, NS, NORM, true, true, false, true, true, true)
#define GDR_PREP9TOW_ENTRY(DK, NS, NORM) GDR_PREP_ENTRY(gdr_prep9tow, DK, NS, NORM, true, true, true, true, true, true)
GDR_PREP8OW_ENTRY(64, bf16n, true)
GDR_PREP8OW_ENTRY(64, bf16, false)
GDR_PREP8OW_ENTRY(128, bf16n, true)
GDR_PREP8OW_ENTRY(128, bf16, false)
GDR_PREP9OW_ENTRY(64, bf16n, true)
GDR_PREP9OW_ENTRY(64, bf16, false)
GDR_PREP9OW_ENTRY(128, bf16n, true)
GDR_PREP9OW_ENTRY(128, bf16, false)
GDR_PREP8TOW_ENTRY(64, bf16n, true)
GDR_PREP8TOW_ENTRY(64, bf16, false)
GDR_PREP8TOW_ENTRY(128, bf16n, true)
GDR_PREP8TOW_ENTRY(128, bf16, false)
GDR_PREP9TOW_ENTRY(64, bf16n, true)
GDR_PREP9TOW_ENTRY(64, bf16, false)
GDR_PREP9TOW_ENTRY(128, bf16n, true)
GDR_PREP9TOW_ENTRY(128, bf16, false)
// gdr_grad7 (issue 13, the backward's per-chunk gradients, second bf16 version). One CTA of 8
// warps per (chunk, key head) walks the GVA group's value heads in order; per value head it
// runs gdr_grad6's products (the same formulas, operands and fragment mapping) with these
// differences:
//   - Q, K (bf16) are staged once per CTA, not once per value head;
//   - the fp32 operands D, dD, T are rounded to bf16 from registers after all of a thread's
//     loads of a matrix are in flight (gdr_grad6 waits on one global round trip per row group);
//   - the row dots (<dq, q>, <dk, k> of the states' parts, <dVb, v>, <dKb, k>) are reduced from
//     the accumulator fragments (quad shuffles, then the two warps sharing a row through shared
//     memory), so no per-value-head dq / dk / dVb / dKb goes through memory and back;
//   - dv is written from the dVb fragments (packed bf16 pairs);
//   - dq, dk are summed over the group in fp32 in a [tokens, Hk, Dk] accumulator that only this
//     CTA touches (rows of its chunk, its key head; head 0 writes, later heads add, in order),
//     then the CTA applies the l2norm backward (rstd from the raw rows, as gdr_reduce_qk) and
//     writes dq, dk bf16: gdr_reduce_qk and the per-value-head fp32 partials are gone.
// No atomics; every sum has a fixed order.

template <int DK, int DV>
struct G7 {
    typedef G6<DK, DV> B;
    // after G6's vectors (7 x 64 + 32 fp32): four pairs of 64 row partials (q, k, v, kb)
    static constexpr int PART_OFF = B::VEC_OFF + (7 * GDR_C + 32) * 4;
    static constexpr int BYTES = PART_OFF + 8 * GDR_C * 4;
};

// rows 0 .. 63 x N fp32 (row stride gs) -> bf16 shared (row stride ls), rounded to nearest even.
// Every load of the thread is issued before the first store.
template <int N>
__device__ __forceinline__ void g7_rows32(bf16_t* dst, int ls, const float* src, i64 gs) {
    constexpr int PER = N / 4, IT = GDR_C * PER / GDR_NT;
    static_assert(GDR_C * PER % GDR_NT == 0, "g7_rows32: whole iterations");
    float4 v[IT];
#pragma unroll
    for (int u = 0; u < IT; ++u) {
        const int e = threadIdx.x + u * GDR_NT, i = e / PER, x = (e - i * PER) * 4;
        v[u] = *reinterpret_cast<const float4*>(src + (i64)i * gs + x);
    }
#pragma unroll
    for (int u = 0; u < IT; ++u) {
        const int e = threadIdx.x + u * GDR_NT, i = e / PER, x = (e - i * PER) * 4;
        *reinterpret_cast<uint2*>(dst + i * ls + x) = make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
    }
}

// f(row, column, value&) for every element of this warp's slice (gdr_grad6's C mapping).
template <int NT8, class F>
__device__ __forceinline__ void g7_map(float (&acc)[NT8][4], F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(r0 + 8 * (c >> 1), c0 + 8 * n + (c & 1), acc[n][c]);
}

// Row sums of f(row, column, value) over a 64 x 16 NT8 product held as fragments: each lane
// sums its elements of its two rows (columns in increasing order), the quad adds (xor 1, then
// xor 2), lane t == 0 writes part[64 (warp >> 2) + row]. The row's sum is then
// part[row] + part[64 + row] (after a barrier).
template <int NT8, class F>
__device__ __forceinline__ void g7_rowsum(const float (&acc)[NT8][4], float* part, F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int n = 0; n < NT8; ++n) {
        s0 += f(r0, c0 + 8 * n, acc[n][0]);
        s0 += f(r0, c0 + 8 * n + 1, acc[n][1]);
        s1 += f(r0 + 8, c0 + 8 * n, acc[n][2]);
        s1 += f(r0 + 8, c0 + 8 * n + 1, acc[n][3]);
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (t == 0) {
        part[GDR_C * (warp >> 2) + r0] = s0;
        part[GDR_C * (warp >> 2) + r0 + 8] = s1;
    }
}

// Two adjacent elements (x even) of an fp32 or bf16 row as fp32.
__device__ __forceinline__ float2 g7_ld2(const float* p, i64 i) { return *reinterpret_cast<const float2*>(p + i); }
__device__ __forceinline__ float2 g7_ld2(const bf16_t* p, i64 i) {
    const unsigned u = *reinterpret_cast<const unsigned*>(p + i);
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

// g7_rowsum of a (row, column) * x[row * rs + column] over rows < l (x in global memory, read as
// pairs of adjacent columns).
template <int NT8, typename TX>
__device__ __forceinline__ void g7_rowdot(const float (&acc)[NT8][4], float* part, const TX* x, i64 rs, int l) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int n = 0; n < NT8; ++n) {
        if (r0 < l) {
            const float2 u = g7_ld2(x, r0 * rs + c0 + 8 * n);
            s0 += acc[n][0] * u.x;
            s0 += acc[n][1] * u.y;
        }
        if (r0 + 8 < l) {
            const float2 u = g7_ld2(x, (r0 + 8) * rs + c0 + 8 * n);
            s1 += acc[n][2] * u.x;
            s1 += acc[n][3] * u.y;
        }
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (t == 0) {
        part[GDR_C * (warp >> 2) + r0] = s0;
        part[GDR_C * (warp >> 2) + r0 + 8] = s1;
    }
}

// Asks L2 for the 128-byte lines of `bytes` bytes from p (global memory), spread over nt
// threads (this one: tid), by default the CTA's. No effect on results: the next value head's
// operands arrive while this one computes. (TI: tid's type, so each caller keeps its own index
// arithmetic: threadIdx.x unsigned, a producer's thread number int.)
template <typename TI>
__device__ __forceinline__ void g7_prefetch(const void* p, i64 bytes, TI tid, int nt) {
    const char* c = reinterpret_cast<const char*>(p);
    for (i64 o = (i64)tid * 128; o < bytes; o += (i64)nt * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
}
__device__ __forceinline__ void g7_prefetch(const void* p, i64 bytes) { g7_prefetch(p, bytes, threadIdx.x, GDR_NT); }

// acc_mem[row][col] (fp32, row stride rs, rows < l) = (first ? 0 : acc_mem) + the fragments'
// values: every load of the thread is issued before the first store. Each element is owned by
// one thread (the same one for every 64 x DK product of the CTA).
template <int NT8>
__device__ __forceinline__ void g7_accum(const float (&acc)[NT8][4], float* mem, i64 rs, int l, bool first) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
    // two halves of the columns (register pressure)
#pragma unroll
    for (int n0 = 0; n0 < NT8; n0 += NT8 / 2) {
        float2 old[NT8 / 2][2];
#pragma unroll
        for (int n = 0; n < NT8 / 2; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = r0 + 8 * h;
                old[n][h] = make_float2(0.f, 0.f);
                if (!first && i < l) old[n][h] = *reinterpret_cast<const float2*>(mem + i * rs + c0 + 8 * (n0 + n));
            }
#pragma unroll
        for (int n = 0; n < NT8 / 2; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = r0 + 8 * h;
                if (i < l)
                    *reinterpret_cast<float2*>(mem + i * rs + c0 + 8 * (n0 + n)) =
                        make_float2(old[n][h].x + acc[n0 + n][2 * h], old[n][h].y + acc[n0 + n][2 * h + 1]);
            }
    }
}

template <typename TQ, int DK, int DV>
__device__ void gdr_grad7(const bf16_t* __restrict__ q_raw, const bf16_t* __restrict__ k_raw,
                          const TQ* __restrict__ q, const TQ* __restrict__ k, const bf16_t* __restrict__ qb,
                          const bf16_t* __restrict__ kb, const bf16_t* __restrict__ v,
                          const bf16_t* __restrict__ beta, const bf16_t* __restrict__ d_o,
                          const float* __restrict__ gam_ws, const float* __restrict__ t_ws,
                          const bf16_t* __restrict__ h_ws, const bf16_t* __restrict__ dh_ws,
                          const float* __restrict__ d_ws, const float* __restrict__ dd_ws,
                          const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                          float scale, int l2norm, float* __restrict__ dqa, float* __restrict__ dka,
                          bf16_t* __restrict__ dq_out, bf16_t* __restrict__ dk_out, bf16_t* __restrict__ dv_out,
                          float* __restrict__ dg, bf16_t* __restrict__ dbeta) {
    typedef G6<DK, DV> L;
    constexpr int dk = DK, dv = DV;
    // A launch with too little shared memory writes nothing (tests see the poisoned outputs).
    if (dyn_smem_bytes() < (unsigned)G7<DK, DV>::BYTES) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    bf16_t* sQ = reinterpret_cast<bf16_t*>(sm + L::Q_OFF);
    bf16_t* sK = reinterpret_cast<bf16_t*>(sm + L::K_OFF);
    bf16_t* sV = reinterpret_cast<bf16_t*>(sm + L::V_OFF);
    bf16_t* sO = reinterpret_cast<bf16_t*>(sm + L::O_OFF);
    bf16_t* sD = reinterpret_cast<bf16_t*>(sm + L::D_OFF);
    bf16_t* sDD = reinterpret_cast<bf16_t*>(sm + L::DD_OFF);
    bf16_t* sT = reinterpret_cast<bf16_t*>(sm + L::T_OFF);
    bf16_t* sW = reinterpret_cast<bf16_t*>(sm + L::W_OFF);
    bf16_t* sH = reinterpret_cast<bf16_t*>(sm + L::H_OFF);
    bf16_t* sDH = reinterpret_cast<bf16_t*>(sm + L::DH_OFF);
    float* sA = reinterpret_cast<float*>(sm + L::A_OFF);
    float* sP = reinterpret_cast<float*>(sm + L::P_OFF);
    float* sE = reinterpret_cast<float*>(sm + L::E_OFF);
    bf16_t* sG = reinterpret_cast<bf16_t*>(sm + L::G_OFF);
    bf16_t* sX = reinterpret_cast<bf16_t*>(sm + L::X_OFF);
    float* s_gam = reinterpret_cast<float*>(sm + L::VEC_OFF);
    float* s_eg = s_gam + GDR_C;
    float* s_ed = s_eg + GDR_C;
    float* s_beta = s_ed + GDR_C;
    float* s_dgam = s_beta + GDR_C;
    float* s_db = s_dgam + GDR_C;
    float* s_tmp = s_db + GDR_C;
    float* s_red = s_tmp + GDR_C;  // 32 floats for block_sum
    float* p_q = reinterpret_cast<float*>(sm + G7<DK, DV>::PART_OFF);  // [2][64] each
    float* p_k = p_q + 2 * GDR_C;
    float* p_v = p_k + 2 * GDR_C;
    float* p_kb = p_v + 2 * GDR_C;
    constexpr int LK = L::LK, LV = L::LV, LC = L::LC, LF = L::LF;
    constexpr int NK = DK / 16, NV = DV / 16;  // NT8 of 64 x DK and 64 x DV products

    const i64 b = blockIdx.x;
    const int kh = (int)(b % hk_n);
    const i64 c = b / hk_n;
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int ratio = hv_n / hk_n;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const TQ* qc = q + t0 * krow + (i64)kh * dk;
    const TQ* kc = k + t0 * krow + (i64)kh * dk;
    float* dqc = dqa + t0 * krow + (i64)kh * dk;  // the group's fp32 sums, row stride krow
    float* dkc = dka + t0 * krow + (i64)kh * dk;

    // Q, K once (their cp.async group completes with the first value head's wait below).
    g6_rows16(sQ, LK, qb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l);
    g6_rows16(sK, LK, kb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l);
    cp_async_commit();

    for (int r = 0; r < ratio; ++r) {
        const int hv = kh * ratio + r;
        const i64 cb = c * hv_n + hv;
        const bool first = r == 0;
        const bf16_t* vc = v + t0 * vrow + (i64)hv * dv;
        __syncthreads();  // the previous value head is done with the per-head buffers
        g6_rows16(sV, LV, vc, vrow, dv, GDR_C, l);
        g6_rows16(sO, LV, d_o + t0 * vrow + (i64)hv * dv, vrow, dv, GDR_C, l);
        g6_rows16(sH, LV, h_ws + cb * (i64)dk * dv, dv, dv, dk, dk);
        g6_rows16(sDH, LV, dh_ws + cb * (i64)dk * dv, dv, dv, dk, dk);
        cp_async_commit();
        g7_rows32<DV>(sD, LV, d_ws + cb * GDR_C * (i64)dv, dv);
        g7_rows32<DV>(sDD, LV, dd_ws + cb * GDR_C * (i64)dv, dv);
        g7_rows32<GDR_C>(sT, LC, t_ws + cb * (GDR_C * GDR_C), GDR_C);
        load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, s_ed);  // synchronizes
        if (tid < GDR_C) {
            s_beta[tid] = tid < l ? ld(beta, (t0 + tid) * hv_n + hv) : 0.f;
            s_dgam[tid] = 0.f;
            s_db[tid] = 0.f;
        }
        cp_async_wait_all();
        __syncthreads();
        if (r + 1 < ratio) {  // the next value head's operands into L2 while this one computes
            const i64 cn = cb + 1;
            g7_prefetch(h_ws + cn * (i64)dk * dv, (i64)dk * dv * 2);
            g7_prefetch(dh_ws + cn * (i64)dk * dv, (i64)dk * dv * 2);
            g7_prefetch(d_ws + cn * GDR_C * (i64)dv, (i64)GDR_C * dv * 4);
            g7_prefetch(dd_ws + cn * GDR_C * (i64)dv, (i64)GDR_C * dv * 4);
            g7_prefetch(t_ws + cn * (GDR_C * GDR_C), (i64)GDR_C * GDR_C * 4);
            for (int i = warp; i < l; i += GDR_NT / 32) {
                if (lane < dv / 64) {  // dv * 2 bytes per row: dv / 64 lines
                    const i64 o = (t0 + i) * vrow + (i64)(hv + 1) * dv + 64 * lane;
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(v + o));
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(d_o + o));
                }
            }
        }
        const float gl = s_gam[l - 1];
        const float egl = expf(gl);
        auto gamma = [&](int i, int j) { return expf(s_gam[i] - s_gam[j]); };

        // Phase 1. dq += e^gam (scale dO S0^T), its row dot with q; dk += e^(gam_L - gam)
        // (D dS^T), its row dot with k; dW = -dD S0^T.
        {
            float acc[NK][4];
            g6_zero(acc);
            g6_mma<NK, false, true>(acc, sO, LV, sH, LV, dv);
            g7_map(acc, [&](int i, int x, float& a) { a = s_eg[i] * (scale * a); });
            g7_rowdot(acc, p_q, qc, krow, l);
            g7_accum(acc, dqc, krow, l, first);
            g6_zero(acc);
            g6_mma<NK, false, true>(acc, sD, LV, sDH, LV, dv);
            g7_map(acc, [&](int i, int x, float& a) { a = s_ed[i] * a; });
            g7_rowdot(acc, p_k, kc, krow, l);
            g7_accum(acc, dkc, krow, l, first);
            g6_zero(acc);
            g6_mma<NK, false, true>(acc, sDD, LV, sH, LV, dv);
            g6_epi(acc, [&](int i, int x, float a) { sW[i * LK + x] = f32_to_bf16(-a); });
        }
        float sds;
        {
            float p = 0.f;
            for (int e = tid; e < dk * dv; e += GDR_NT) {
                const int x = e / dv, cc = e - x * dv;
                p += bf16_to_f32(sH[x * LV + cc]) * bf16_to_f32(sDH[x * LV + cc]);
            }
            sds = block_sum(p, s_red);  // synchronizes: sW, p_q, p_k written; h, dh no longer read
        }
        // dgam_i = <dq_i, q_i> - t_i, t_i = <dk_i, k_i>; dgam_L += sum t + e^gam_L <S0, dS>.
        if (tid < GDR_C) {
            const int i = tid;
            s_dgam[i] = i < l ? p_q[i] + p_q[GDR_C + i] : 0.f;
            s_tmp[i] = i < l ? p_k[i] + p_k[GDR_C + i] : 0.f;
        }
        __syncthreads();
        if (tid < GDR_C) {
            float d = s_dgam[tid] - s_tmp[tid];
            if (tid == l - 1) {
                float t = 0.f;
                for (int i = 0; i < GDR_C; ++i) t += s_tmp[i];
                d += egl * sds + t;
            }
            s_dgam[tid] = d;
        }

        // Phase 2 (h, dh's space reused). A = lower_incl(Q K^T * Gamma), P = K K^T (fp32).
        {
            float acc[4][4];
            g6_zero(acc);
            g6_mma<4, false, true>(acc, sQ, LK, sK, LK, dk);
            g6_epi(acc, [&](int i, int j, float a) { sA[i * LF + j] = (j <= i && i < l) ? a * gamma(i, j) : 0.f; });
            g6_zero(acc);
            g6_mma<4, false, true>(acc, sK, LK, sK, LK, dk);
            g6_epi(acc, [&](int i, int j, float a) { sP[i * LF + j] = a; });
        }
        __syncthreads();
        // dA = scale dO D^T (j <= i): E = dA * A (for dgam), G = dA * Gamma (bf16 operand).
        {
            float acc[4][4];
            g6_zero(acc);
            g6_mma<4, false, true>(acc, sO, LV, sD, LV, dv);
            g6_epi(acc, [&](int i, int j, float a) {
                const bool in = j <= i && i < l;
                const float x = scale * a;
                sE[i * LF + j] = in ? x * sA[i * LF + j] : 0.f;
                sG[i * LC + j] = f32_to_bf16(in ? x * gamma(i, j) : 0.f);
            });
        }
        __syncthreads();
        if (tid < GDR_C) {
            float rs = 0.f, cs = 0.f;
            for (int j = 0; j < GDR_C; ++j) rs += sE[tid * LF + j];
            for (int i = 0; i < GDR_C; ++i) cs += sE[i * LF + tid];
            s_dgam[tid] += rs - cs;
        }
        // dq += G K ; dk += G^T Q.
        {
            float acc[NK][4];
            g6_zero(acc);
            g6_mma<NK, false, false>(acc, sG, LC, sK, LK, GDR_C);
            g7_accum(acc, dqc, krow, l, false);
            g6_zero(acc);
            g6_mma<NK, true, false>(acc, sG, LC, sQ, LK, GDR_C);
            g7_accum(acc, dkc, krow, l, false);
        }
        // dT = dD Vb^T + dW Kb^T, Vb = diag(beta) V, Kb = diag(beta e^gam) K (column scales of dT).
        {
            float a1[4][4], a2[4][4];
            g6_zero(a1);
            g6_zero(a2);
            g6_mma<4, false, true>(a1, sDD, LV, sV, LV, dv);
            g6_mma<4, false, true>(a2, sW, LK, sK, LK, dk);
            const int g = lane >> 2, t = lane & 3;
            const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * 32 + 2 * t;
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) {
                    const int i = r0 + 8 * (cc >> 1), j = c0 + 8 * n + (cc & 1);
                    const float x = s_beta[j] * a1[n][cc] + (s_beta[j] * s_eg[j]) * a2[n][cc];
                    sX[i * LC + j] = f32_to_bf16(x);
                }
        }
        // dVb = T^T dD: dv = beta dVb (packed bf16 pairs), <dVb_i, v_i>.
        {
            float acc[NV][4];
            g6_zero(acc);
            g6_mma<NV, true, false>(acc, sT, LC, sDD, LV, GDR_C);
            g7_rowsum(acc, p_v, [&](int i, int x, float a) { return a * bf16_to_f32(sV[i * LV + x]); });
            const int g = lane >> 2, t = lane & 3;
            const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NV) + 2 * t;
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = r0 + 8 * h;
                    if (i < l) {
                        const float bb = s_beta[i];
                        *reinterpret_cast<unsigned*>(dv_out + (t0 + i) * vrow + (i64)hv * dv + c0 + 8 * n) =
                            pack_bf16(bb * acc[n][2 * h], bb * acc[n][2 * h + 1]);
                    }
                }
        }
        // dKb = T^T dW: dk += beta e^gam dKb, <dKb_i, k_i>.
        {
            float acc[NK][4];
            g6_zero(acc);
            g6_mma<NK, true, false>(acc, sT, LC, sW, LK, GDR_C);
            g7_rowdot(acc, p_kb, kc, krow, l);
            g7_map(acc, [&](int i, int x, float& a) { a = (s_beta[i] * s_eg[i]) * a; });
            g7_accum(acc, dkc, krow, l, false);
        }
        __syncthreads();
        // dbeta += <dVb, v> + e^gam <dKb, k>; dgam += beta e^gam <dKb, k>.
        if (tid < l) {
            const int i = tid;
            const float sv = p_v[i] + p_v[GDR_C + i], sk = p_kb[i] + p_kb[GDR_C + i];
            s_db[i] += sv + s_eg[i] * sk;
            s_dgam[i] += (s_beta[i] * s_eg[i]) * sk;
        }
        // dM = -T^T dT T^T: tmp = T^T dT (bf16, into G's space), dM = -(tmp T^T) (fp32, into A's).
        {
            float acc[4][4];
            g6_zero(acc);
            g6_mma<4, true, false>(acc, sT, LC, sX, LC, GDR_C);
            g6_epi(acc, [&](int m, int n, float a) { sG[m * LC + n] = f32_to_bf16(a); });
        }
        __syncthreads();
        {
            float acc[4][4];
            g6_zero(acc);
            g6_mma<4, false, true>(acc, sG, LC, sT, LC, GDR_C);
            g6_epi(acc, [&](int m, int n, float a) { sA[m * LF + n] = -a; });
        }
        __syncthreads();
        // M_ij = beta_i P_ij Gamma_ij (j < i): dbeta_i += sum_j dM_ij P_ij Gamma_ij ;
        // f = dM_ij beta_i P_ij Gamma_ij: dgam_i += f, dgam_j -= f ; dP_ij = dM_ij beta_i Gamma_ij.
        if (tid < GDR_C) {
            const int i = tid;
            float db = 0.f, fr = 0.f, fc = 0.f;
            if (i < l) {
                for (int j = 0; j < i; ++j) {
                    float x = sA[i * LF + j];
                    float pg = sP[i * LF + j] * gamma(i, j);
                    db += x * pg;
                    fr += x * s_beta[i] * pg;
                }
                for (int m = i + 1; m < l; ++m) {
                    fc += sA[m * LF + i] * s_beta[m] * (sP[m * LF + i] * gamma(m, i));
                }
            }
            s_db[i] += db;
            s_dgam[i] += fr - fc;
        }
        for (int e = tid; e < GDR_C * GDR_C; e += GDR_NT) {
            int i = e >> 6, j = e & 63;
            float d = 0.f;
            if (j < i && i < l) d = sA[i * LF + j] * s_beta[i] * gamma(i, j);
            else if (i < j && j < l) d = sA[j * LF + i] * s_beta[j] * gamma(j, i);
            sX[i * LC + j] = f32_to_bf16(d);
        }
        __syncthreads();
        // dk += dP_sym K.
        {
            float acc[NK][4];
            g6_zero(acc);
            g6_mma<NK, false, false>(acc, sX, LC, sK, LK, GDR_C);
            g7_accum(acc, dkc, krow, l, false);
        }
        __syncthreads();
        // gam = cumsum(g): dg_j = sum_{i >= j} dgam_i.
        if (tid == 0) {
            float acc = 0.f;
            for (int i = l - 1; i >= 0; --i) {
                acc += s_dgam[i];
                dg[(t0 + i) * hv_n + hv] = acc;
            }
        }
        if (tid < l) st(dbeta, (t0 + tid) * hv_n + hv, s_db[tid]);
    }
    __syncthreads();  // the group's dq, dk sums are complete (written by other threads)

    // dq, dk through the l2 norm (as gdr_reduce_qk: rstd from the raw row, y = x rstd):
    // dx = rstd (dy - y <dy, y>). Warp w: rows w, w + 8, .. (NR at a time, all their loads
    // issued first).
    constexpr int NU = DK / 32, NR = GDR_C / (GDR_NT / 32) / 2;
    for (int which = 0; which < 4; ++which) {
        const int i0 = (GDR_NT / 32) * NR * (which & 1);
        const float* acc = which < 2 ? dqc : dkc;
        const bf16_t* xr = (which < 2 ? q_raw : k_raw) + t0 * krow + (i64)kh * dk;
        bf16_t* out = (which < 2 ? dq_out : dk_out) + t0 * krow + (i64)kh * dk;
        float dy[NR][NU], xv[NR][NU];
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            const int i = i0 + warp + (GDR_NT / 32) * j;
#pragma unroll
            for (int u = 0; u < NU; ++u) {
                const int x = lane + 32 * u;
                dy[j][u] = i < l ? acc[i * krow + x] : 0.f;
                xv[j][u] = (l2norm && i < l) ? ld(xr, i * krow + x) : 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            const int i = i0 + warp + (GDR_NT / 32) * j;
            if (l2norm) {
                float ss = 0.f;
#pragma unroll
                for (int u = 0; u < NU; ++u) ss += xv[j][u] * xv[j][u];
                const float rstd = 1.f / sqrtf(warp_sum(ss) + 1e-6f);
                float d = 0.f;
#pragma unroll
                for (int u = 0; u < NU; ++u) d += dy[j][u] * (xv[j][u] * rstd);
                d = warp_sum(d);
#pragma unroll
                for (int u = 0; u < NU; ++u) dy[j][u] = rstd * (dy[j][u] - (xv[j][u] * rstd) * d);
            }
            if (i < l) {
#pragma unroll
                for (int u = 0; u < NU; ++u) st(out, i * krow + lane + 32 * u, dy[j][u]);
            }
        }
    }
}

// gdr_grad7 (bf16 states; TQ: the q, k the row dots read, as gdr_grad6).
#define GDR_GRAD7_ENTRY(TQ, S, DK, DV)                                                                  \
    extern "C" __global__ void __launch_bounds__(GDR_NT, 1) gdr_grad7_##S##_d##DK##_v##DV(              \
        const bf16_t* q_raw, const bf16_t* k_raw, const TQ* q, const TQ* k, const bf16_t* qb,           \
        const bf16_t* kb, const bf16_t* v, const bf16_t* beta, const bf16_t* d_o, const float* gam_ws,  \
        const float* t_ws, const bf16_t* h_ws, const bf16_t* dh_ws, const float* d_ws,                  \
        const float* dd_ws, const i64* ch_t0, const int* ch_len, int hk, int hv, float scale,           \
        int l2norm, float* dqa, float* dka, bf16_t* dq_out, bf16_t* dk_out, bf16_t* dv_out, float* dg,  \
        bf16_t* dbeta) {                                                                                \
        gdr_grad7<TQ, DK, DV>(q_raw, k_raw, q, k, qb, kb, v, beta, d_o, gam_ws, t_ws, h_ws, dh_ws, d_ws, \
                              dd_ws, ch_t0, ch_len, hk, hv, scale, l2norm, dqa, dka, dq_out, dk_out,    \
                              dv_out, dg, dbeta);                                                       \
    }

GDR_GRAD7_ENTRY(bf16_t, bf16, 64, 64)
GDR_GRAD7_ENTRY(bf16_t, bf16, 64, 128)
GDR_GRAD7_ENTRY(bf16_t, bf16, 128, 64)
GDR_GRAD7_ENTRY(bf16_t, bf16, 128, 128)
GDR_GRAD7_ENTRY(float, bf16n, 64, 64)
GDR_GRAD7_ENTRY(float, bf16n, 64, 128)
GDR_GRAD7_ENTRY(float, bf16n, 128, 64)
GDR_GRAD7_ENTRY(float, bf16n, 128, 128)

// =============================================================================================
// v8 forward (issue 13; opt-in `FwdKernel::V8`, GDN_RULE_FWD=v8): gdr_fwd6's fused scan and
// output (same inputs from prep7 / prep6, same outputs) with the state's Dk rows split between
// the two warps of a pair, so a CTA of BV = 16 NC state columns has NW = 2 NC warps (32
// columns: 4 warps, one per scheduler) and each warp holds half the state (16 columns x DK / 2
// rows of S^T, fp32 accumulator fragments: 32 registers at DK 128 instead of 64).
// Warp w: pair (column group) cg = w >> 1, half hh = w & 1 (state rows hh DH .. hh DH + DH - 1,
// DH = DK / 2). Per chunk, per warp:
//   X_hh   = S_hh^T W_hh^T               (16 x 64, k = DH: the partial of X over this half)
//   X      = X_0 + X_1                   (exchanged through shared memory, one named barrier
//                                         per pair; fp32 addition commutes, so both warps hold
//                                         the same X bit for bit)
//   D^T    = U^T - X                     (both warps: all 64 chunk rows, the pair's 16 columns)
//   S_hh^T <- e^gam_L S_hh^T + (D^T diag(e^(gam_L - gam))) K_hh
//   P_hh   = S0_hh^T Q_hh^T              (16 x 64 partial of the inter-chunk output)
//   O^T rows (chunk rows) split between the pair: warp hh finishes the 16-row blocks
//   {hh, 3 - hh} (5 of A's 10 lower blocks each): it receives the partner's P for its rows
//   (second exchange, same barrier), O^T = scale (e^gam (P_0 + P_1) + D^T A^T).
// Exchange buffer: 4 KB per warp (8 slots x 32 lanes x float4, lane-private: conflict-free
// 16-byte accesses). Warp a writes its X partial to its own buffer, the barrier, reads b's;
// then writes its P partials for b's rows into b's buffer (slots it has just read, same lane:
// ordered), the barrier, reads its own buffer. The next step's writes into a's buffer come
// after a's reads (same lane) and b's reads of it after the next barrier: no other barrier.
// Stage layout: V6<DK, NC> (BV = 16 NC columns), loaded by all NW warps (v8_load_stage, the
// lean addressing of v6_load_stage_lean for NT = 32 NW threads).

template <int DK, int NW>
struct V8 {
    typedef V6<DK, NW / 2> L;  // the stage layout (BV = 16 NW / 2)
    static constexpr int NC = NW / 2;
    static constexpr int BV = 16 * NC;
    static constexpr int NT = 32 * NW;
    static constexpr int DH = DK / 2;
    static constexpr int XB = 8 * 32 * 16;  // exchange bytes per warp
    static constexpr int STAGE = L::STAGE;
};

// v6_load_stage_lean for a CTA of NT threads whose U tile is BV columns wide (the same bytes
// to the same places of a V6<DK, BV / 16> stage).
template <int DK, int BV, int NT>
__device__ __forceinline__ void v8_load_stage(char* st, const bf16_t* wc, const bf16_t* kc, const bf16_t* qc,
                                              i64 krow, int l, const bf16_t* ac, const float* uc, i64 urow,
                                              const float* gc) {
    typedef V6<DK, BV / 16> L;
    const int tid = threadIdx.x;
    const unsigned sb = smem_addr(st);
    constexpr int CPR = DK / 8;    // 16-byte pieces per row of W, K, Q
    constexpr int RPP = NT / CPR;  // rows per pass
    static_assert(NT % CPR == 0 && GDR_C % RPP == 0, "whole rows per pass");
    {
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const bf16_t* gw = wc + i0 * DK + x;
        const bf16_t* gk = kc + i0 * krow + x;
        const bf16_t* gq = qc + i0 * krow + x;
        const i64 step = RPP * krow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPP; ++m) {
            const bool ok = i0 + RPP * m < l;
            const unsigned n = ok ? 16u : 0u;
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            cp_async16_s(sr + L::W_OFF, gw + RPP * m * DK, 16u);
            cp_async16_s(sr + L::K_OFF, ok ? gk : kc, n);
            cp_async16_s(sr + L::Q_OFF, ok ? gq : qc, n);
            gk += step;
            gq += step;
        }
    }
    {
        constexpr int RPA = NT / 8;  // A: 8 pieces per row
        static_assert(GDR_C % RPA == 0, "whole rows of A per pass");
        const int i0 = tid >> 3, x = (tid & 7) * 8;
        const unsigned so = sb + L::A_OFF + (unsigned)((i0 * L::LA + x) * 2);
        const bf16_t* ga = ac + i0 * GDR_C + x;
#pragma unroll
        for (int m = 0; m < GDR_C / RPA; ++m)
            cp_async16_s(so + (unsigned)(RPA * m * L::LA * 2), ga + RPA * m * GDR_C, 16u);
    }
    {
        constexpr int UPR = BV / 4;    // U: 16-byte pieces per row of the tile
        constexpr int RPU = NT / UPR;  // rows per pass
        static_assert(NT % UPR == 0 && GDR_C % RPU == 0, "whole rows of U per pass");
        const int i0 = tid / UPR, x = (tid % UPR) * 4;
        const unsigned so = sb + L::U_OFF + (unsigned)((i0 * L::LU + x) * 4);
        const float* gu = uc + i0 * urow + x;
        const i64 step = RPU * urow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPU; ++m) {
            cp_async16_s(so + (unsigned)(RPU * m * L::LU * 4), gu, 16u);
            gu += step;
        }
    }
    if (tid < GDR_C / 4) cp_async16_s(sb + L::G_OFF + tid * 16, gc + tid * 4, 16u);
    cp_async_commit();
}

// Barrier `id` (1 + pair) of the two warps of a pair.
__device__ __forceinline__ void pair_bar(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

// One chunk step of the split chain for this warp (see the v8 header): on entry s holds this
// warp's half of S^T; on exit the half of S1^T, sa the half of S0^T as bf16 A fragments, da D^T
// (all 64 chunk rows, unscaled, bf16) for the output. sw, sk: the stage's W, K offset to this
// warp's DH columns; u: the U tile offset to the pair's first column; xme / xot: this warp's and
// its partner's exchange buffers (float4 slots, [slot][lane]). SD (gdr_hrec8): D (fp32, before
// its rounding) is also stored, D[i][v] at dst[i * ldd + v] for the pair's 16 columns v: half
// hd stores the chunk rows 32 hd .. 32 hd + 31 (all of them, rows >= l are 0).
template <int DK, bool SD = false>
__device__ __forceinline__ void v8_chain_step(float (&s)[DK / 16][4], unsigned (&sa)[DK / 32][4],
                                              unsigned (&da)[4][4], const bf16_t* sw, const bf16_t* sk,
                                              int lk, const float* u, int lu, const float* s_gam, int l,
                                              float4* xme, const float4* xot, int bar, float* dst = nullptr,
                                              i64 ldd = 0, int hd = 0) {
    constexpr int DH = DK / 2;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, mi = lane >> 3, r = lane & 7;
    v6_s_frags<DH>(s, sa);
    float x[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) x[j][c] = 0.f;
    v6_mul_rows_t<DH>(x, sa, sw, lk);
#pragma unroll
    for (int j = 0; j < 8; ++j) xme[j * 32 + lane] = make_float4(x[j][0], x[j][1], x[j][2], x[j][3]);
    // Independent of the exchange: the decay factors and the U values of this lane.
    const float gl = s_gam[l - 1];
    float ed[8][2], uu[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i0 = 8 * j + 2 * t;
        ed[j][0] = i0 < l ? __expf(gl - s_gam[i0]) : 0.f;
        ed[j][1] = i0 + 1 < l ? __expf(gl - s_gam[i0 + 1]) : 0.f;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            uu[j][2 * rr] = u[i0 * lu + g + 8 * rr];
            uu[j][2 * rr + 1] = u[(i0 + 1) * lu + g + 8 * rr];
        }
    }
    pair_bar(bar);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 o = xot[j * 32 + lane];
        x[j][0] += o.x;
        x[j][1] += o.y;
        x[j][2] += o.z;
        x[j][3] += o.w;
    }
    unsigned dsa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float d0 = uu[j][2 * rr] - x[j][2 * rr];
                const float d1 = uu[j][2 * rr + 1] - x[j][2 * rr + 1];
                if (SD && (kk >> 1) == hd) {
                    const int i0 = 8 * j + 2 * t, v = g + 8 * rr;
                    dst[(i64)i0 * ldd + v] = d0;
                    dst[(i64)(i0 + 1) * ldd + v] = d1;
                }
                da[kk][rr + 2 * h] = pack_bf16(d0, d1);
                dsa[kk][rr + 2 * h] = pack_bf16(ed[j][0] * d0, ed[j][1] * d1);
            }
        }
    const float egl = __expf(gl);
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] *= egl;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < DH / 16; ++np) {
            unsigned b[4];
            ldsm_x4_t(b, sk + (16 * kk + 8 * (mi & 1) + r) * lk + 16 * np + 8 * (mi >> 1));
            mma_bf16(s[2 * np], dsa[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], dsa[kk], b[2], b[3]);
        }
}

// The output of one chunk step for warp half H (compile time: the register tiles it finishes
// are fixed): P_H = S0_H^T Q_H^T over all 64 chunk rows, the partner's rows to the partner's
// buffer, the barrier, the partner's P for this warp's rows (16-row blocks H and 3 - H) added,
// scaled by e^gam, then + D^T A^T (A's blocks on or below the diagonal). f(j, cc, value) gets
// every element of this warp's rows (n8 tile j, fragment element cc), before `scale`.
template <int DK, int H, class F>
__device__ __forceinline__ void v8_output(const unsigned (&sa)[DK / 32][4], const unsigned (&da)[4][4],
                                          const bf16_t* sq, int lk, const bf16_t* sA, int la,
                                          const float* s_gam, int l, const float4* xme, float4* xot, int bar,
                                          F f) {
    constexpr int DH = DK / 2;
    constexpr int M0 = H ? 1 : 0, M1 = H ? 2 : 3;  // this warp's 16-row blocks
    constexpr int P0 = H ? 0 : 1, P1 = H ? 3 : 2;  // the partner's
    const int lane = threadIdx.x & 31, t = lane & 3, mi = lane >> 3, r = lane & 7;
    float p[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) p[j][c] = 0.f;
    v6_mul_rows_t<DH>(p, sa, sq, lk);
    // slots 0..3: the partner's blocks in its own order (its M0, M1 are this warp's P0, P1)
    xot[0 * 32 + lane] = make_float4(p[2 * P0][0], p[2 * P0][1], p[2 * P0][2], p[2 * P0][3]);
    xot[1 * 32 + lane] = make_float4(p[2 * P0 + 1][0], p[2 * P0 + 1][1], p[2 * P0 + 1][2], p[2 * P0 + 1][3]);
    xot[2 * 32 + lane] = make_float4(p[2 * P1][0], p[2 * P1][1], p[2 * P1][2], p[2 * P1][3]);
    xot[3 * 32 + lane] = make_float4(p[2 * P1 + 1][0], p[2 * P1 + 1][1], p[2 * P1 + 1][2], p[2 * P1 + 1][3]);
    float e[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int j = q < 2 ? 2 * M0 + q : 2 * M1 + q - 2;
        const int i0 = 8 * j + 2 * t;
        e[q][0] = i0 < l ? __expf(s_gam[i0]) : 0.f;
        e[q][1] = i0 + 1 < l ? __expf(s_gam[i0 + 1]) : 0.f;
    }
    pair_bar(bar);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int j = q < 2 ? 2 * M0 + q : 2 * M1 + q - 2;
        const float4 o = xme[q * 32 + lane];
        p[j][0] = (p[j][0] + o.x) * e[q][0];
        p[j][1] = (p[j][1] + o.y) * e[q][1];
        p[j][2] = (p[j][2] + o.z) * e[q][0];
        p[j][3] = (p[j][3] + o.w) * e[q][1];
    }
#pragma unroll
    for (int b2 = 0; b2 < 2; ++b2) {
        const int jp = b2 ? M1 : M0;
#pragma unroll
        for (int kk = 0; kk <= jp; ++kk) {
            unsigned bb[4];
            ldsm_x4(bb, sA + (16 * jp + 8 * (mi >> 1) + r) * la + 16 * kk + 8 * (mi & 1));
            mma_bf16(p[2 * jp], da[kk], bb[0], bb[1]);
            mma_bf16(p[2 * jp + 1], da[kk], bb[2], bb[3]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) f(2 * jp + h, cc, p[2 * jp + h][cc]);
    }
}

// Forward, scan and output fused, Dk split between warp pairs (see the v8 header). Grid:
// N * Hv * (dv / BV) CTAs of 32 NW threads (BV = 16 NW / 2); dynamic shared memory
// NS * STAGE + NW * XB. Inputs and outputs as gdr_fwd6.
template <int DK, int NW, int NS>
__device__ void gdr_fwd8(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const float* __restrict__ gam_ws, const bf16_t* __restrict__ w_ws,
                         const float* __restrict__ u_ws, const bf16_t* __restrict__ a_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                         const float* __restrict__ h0, bf16_t* __restrict__ o, float* __restrict__ fin) {
    typedef V8<DK, NW> P;
    typedef typename P::L L;
    constexpr int DH = P::DH;
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    static_assert(NW == 2 || NW == 4 || NW == 8, "1, 2 or 4 warp pairs");
    // A launch with too little shared memory writes nothing (tests see the poisoned output).
    if (dyn_smem_bytes() < (unsigned)(NS * P::STAGE + NW * P::XB)) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / P::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int cg = warp >> 1, hh = warp & 1;
    const int bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + NS * P::STAGE + warp * P::XB);
    float4* xot = reinterpret_cast<float4*>(sm + NS * P::STAGE + (warp ^ 1) * P::XB);
    const i64 col0 = (i64)vt * P::BV;  // the CTA's first state column
    const int wc0 = 16 * cg;           // the pair's first column inside the tile
    const int r0 = DH * hh;            // this warp's first state row
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;

    // s[nt][c] = S[r0 + 8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                          : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage) {
        const i64 cb = c * hv_n + hv;
        const i64 t0 = ch_t0[c];
        v8_load_stage<DK, P::BV, P::NT>(sm + stage * P::STAGE, w_ws + cb * GDR_C * DK,
                                        k + t0 * krow + (i64)kh * DK, q + t0 * krow + (i64)kh * DK, krow,
                                        ch_len[c], a_ws + cb * GDR_C * GDR_C, u_ws + cb * GDR_C * dv + col0,
                                        (i64)dv, gam_ws + cb * GDR_C);
    };
#pragma unroll
    for (int p = 0; p < NS - 1; ++p) {
        if (c_beg + p < c_end) issue(c_beg + p, p);
        else cp_async_commit();
    }
    for (i64 c = c_beg; c < c_end; ++c) {
        const int stg = (int)((c - c_beg) % NS);
        cp_async_wait_group<NS - 2>();  // chunk c's group (only the NS - 2 newer may pend)
        // Stage stg (chunk c) is complete and visible to all; every warp is done with stage
        // (c - 1) % NS (chunk c - 1), which now receives chunk c + NS - 1.
        __syncthreads();
        if (c + NS - 1 < c_end) issue(c + NS - 1, (int)((c + NS - 1 - c_beg) % NS));
        else cp_async_commit();
        const char* sp = sm + stg * P::STAGE;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF) + r0;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF) + r0;
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const float* sU = reinterpret_cast<const float*>(sp + L::U_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const int l = ch_len[c];
        const i64 t0 = ch_t0[c];

        unsigned sa[DH / 16][4], da[4][4];
        v8_chain_step<DK>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, l, xme, xot, bar);
        bf16_t* oc = o + t0 * vrow + (i64)hv * dv + col0 + wc0 + g;
        auto store = [&](int j, int cc, float val) {
            const int i = 8 * j + 2 * t + (cc & 1);
            if (i < l) st(oc, (i64)i * vrow + 8 * (cc >> 1), scale * val);
        };
        if (hh)
            v8_output<DK, 1>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, store);
        else
            v8_output<DK, 0>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, store);
    }
    if (fin) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                fin[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
}

// Chain microbenchmark of v8: one CTA of NW warps (NW / 2 pairs, 16 columns each) runs `steps`
// dependent chunk steps of gdr_fwd8's split chain (and output with OUT) on one chunk's
// operands loaded once (as gdr_chain6: W, K bf16 [64][DK]; A bf16 [64][64]; U fp32
// [64][8 NW]; gam [64]), then writes S [DK][8 NW] (fp32) to `out`.
template <int DK, int NW, bool OUT>
__device__ void gdr_chain8(const bf16_t* __restrict__ w, const bf16_t* __restrict__ kk,
                           const bf16_t* __restrict__ a, const float* __restrict__ u,
                           const float* __restrict__ gam, int steps, float* __restrict__ out) {
    typedef V8<DK, NW> P;
    typedef typename P::L L;
    constexpr int DH = P::DH;
    if (dyn_smem_bytes() < (unsigned)(P::STAGE + NW * P::XB)) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int cg = warp >> 1, hh = warp & 1, bar = 1 + cg, wc0 = 16 * cg, r0 = DH * hh;
    float4* xme = reinterpret_cast<float4*>(sm + P::STAGE + warp * P::XB);
    float4* xot = reinterpret_cast<float4*>(sm + P::STAGE + (warp ^ 1) * P::XB);
    v8_load_stage<DK, P::BV, P::NT>(sm, w, kk, kk, (i64)DK, GDR_C, a, u, (i64)P::BV, gam);
    cp_async_wait_all();
    __syncthreads();
    const bf16_t* sW = reinterpret_cast<const bf16_t*>(sm + L::W_OFF) + r0;
    const bf16_t* sK = reinterpret_cast<const bf16_t*>(sm + L::K_OFF) + r0;
    const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sm + L::Q_OFF) + r0;
    const bf16_t* sA = reinterpret_cast<const bf16_t*>(sm + L::A_OFF);
    const float* sU = reinterpret_cast<const float*>(sm + L::U_OFF);
    const float* sG = reinterpret_cast<const float*>(sm + L::G_OFF);
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] = 0.f;
    float osum = 0.f;
    for (int step = 0; step < steps; ++step) {
        unsigned sa[DH / 16][4], da[4][4];
        v8_chain_step<DK>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, GDR_C, xme, xot, bar);
        if (OUT) {
            auto acc = [&](int, int, float val) { osum += val; };
            if (hh)
                v8_output<DK, 1>(sa, da, sQ, L::LK, sA, L::LA, sG, GDR_C, xme, xot, bar, acc);
            else
                v8_output<DK, 0>(sa, da, sQ, L::LK, sA, L::LA, sG, GDR_C, xme, xot, bar, acc);
        }
    }
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            out[(r0 + 8 * nt + 2 * t + (c & 1)) * P::BV + wc0 + g + 8 * (c >> 1)] = s[nt][c] + 0.f * osum;
}

// gdr_hrec8 (opt-in GDN_RULE_HREC=v8): gdr_hrec6 (the backward's recompute of the chunk-start
// states h and of D) with v8's split chain: same inputs and outputs (h fp32 or bf16, D fp32,
// v5's layouts), CTAs of 16 NW / 2 columns with NW warps, two stages of V6R<DK, NW / 2> loaded
// with the lean addressing, + NW * 4 KB of exchange buffers. Each warp stores its half of the
// state rows and half of D's chunk rows.
template <int DK, int BV, int NT>
__device__ __forceinline__ void v8r_load_stage(char* st, const bf16_t* wc, const bf16_t* kc, i64 krow, int l,
                                               const float* uc, i64 urow, const float* gc) {
    typedef V6R<DK, BV / 16> L;
    const int tid = threadIdx.x;
    const unsigned sb = smem_addr(st);
    constexpr int CPR = DK / 8;
    constexpr int RPP = NT / CPR;
    static_assert(NT % CPR == 0 && GDR_C % RPP == 0, "whole rows per pass");
    {
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const bf16_t* gw = wc + i0 * DK + x;
        const bf16_t* gk = kc + i0 * krow + x;
        const i64 step = RPP * krow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPP; ++m) {
            const bool ok = i0 + RPP * m < l;
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            cp_async16_s(sr + L::W_OFF, gw + RPP * m * DK, 16u);
            cp_async16_s(sr + L::K_OFF, ok ? gk : kc, ok ? 16u : 0u);
            gk += step;
        }
    }
    {
        constexpr int UPR = BV / 4;
        constexpr int RPU = NT / UPR;
        static_assert(NT % UPR == 0 && GDR_C % RPU == 0, "whole rows of U per pass");
        const int i0 = tid / UPR, x = (tid % UPR) * 4;
        const unsigned so = sb + L::U_OFF + (unsigned)((i0 * L::LU + x) * 4);
        const float* gu = uc + i0 * urow + x;
        const i64 step = RPU * urow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPU; ++m) {
            cp_async16_s(so + (unsigned)(RPU * m * L::LU * 4), gu, 16u);
            gu += step;
        }
    }
    if (tid < GDR_C / 4) cp_async16_s(sb + L::G_OFF + tid * 16, gc + tid * 4, 16u);
    cp_async_commit();
}

template <int DK, int NW>
__device__ void gdr_hrec8(const bf16_t* __restrict__ k, const float* __restrict__ gam_ws,
                          const bf16_t* __restrict__ w_ws, const float* __restrict__ u_ws,
                          const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                          const int* __restrict__ ch_len, int hk_n, int hv_n, int dv,
                          const float* __restrict__ h0, float* __restrict__ h_ws, bf16_t* __restrict__ h16_ws,
                          float* __restrict__ d_ws) {
    typedef V6R<DK, NW / 2> L;
    constexpr int BV = 8 * NW, NT = 32 * NW, DH = DK / 2, XB = 8 * 32 * 16;
    if (dyn_smem_bytes() < (unsigned)(2 * L::STAGE + NW * XB)) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int cg = warp >> 1, hh = warp & 1, bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + 2 * L::STAGE + warp * XB);
    float4* xot = reinterpret_cast<float4*>(sm + 2 * L::STAGE + (warp ^ 1) * XB);
    const i64 col0 = (i64)vt * BV;
    const int wc0 = 16 * cg, r0 = DH * hh;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK;
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                          : 0.f;
    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage) {
        const i64 cb = c * hv_n + hv;
        v8r_load_stage<DK, BV, NT>(sm + stage * L::STAGE, w_ws + cb * GDR_C * DK, k + ch_t0[c] * krow + (i64)kh * DK,
                                   krow, ch_len[c], u_ws + cb * GDR_C * dv + col0, (i64)dv, gam_ws + cb * GDR_C);
    };
    if (c_beg < c_end) issue(c_beg, 0);
    else cp_async_commit();
    for (i64 c = c_beg; c < c_end; ++c) {
        const int stg = (int)((c - c_beg) & 1);
        cp_async_wait_group<0>();
        __syncthreads();
        if (c + 1 < c_end) issue(c + 1, stg ^ 1);
        else cp_async_commit();
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF) + r0;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const float* sU = reinterpret_cast<const float*>(sp + L::U_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;
        v6_store_state<DH>(s, h_ws, h16_ws, cb * (i64)DK * dv + (i64)r0 * dv + col0 + wc0 + g, dv);
        unsigned sa[DH / 16][4], da[4][4];
        v8_chain_step<DK, true>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, ch_len[c], xme, xot, bar,
                                d_ws + cb * GDR_C * (i64)dv + col0 + wc0, (i64)dv, hh);
    }
}

#define GDR_HREC8_ENTRY(DK, NW)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_hrec8_d##DK##_w##NW(                   \
        const bf16_t* k, const float* gam_ws, const bf16_t* w_ws, const float* u_ws, const i64* seq_ch,  \
        const i64* ch_t0, const int* ch_len, int hk, int hv, int dv, const float* h0, float* h_ws,      \
        bf16_t* h16_ws, float* d_ws) {                                                                  \
        gdr_hrec8<DK, NW>(k, gam_ws, w_ws, u_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, h0, h_ws, h16_ws,    \
                          d_ws);                                                                        \
    }

GDR_HREC8_ENTRY(64, 2)
GDR_HREC8_ENTRY(64, 4)
GDR_HREC8_ENTRY(64, 8)
GDR_HREC8_ENTRY(128, 2)
GDR_HREC8_ENTRY(128, 4)
GDR_HREC8_ENTRY(128, 8)

#define GDR_FWD8_ENTRY(DK, NW, NS)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_fwd8_d##DK##_w##NW##_s##NS(            \
        const bf16_t* q, const bf16_t* k, const float* gam_ws, const bf16_t* w_ws, const float* u_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* h0, bf16_t* o, float* fin) {                                  \
        gdr_fwd8<DK, NW, NS>(q, k, gam_ws, w_ws, u_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale,   \
                             h0, o, fin);                                                               \
    }

// Shared memory (NS * STAGE + NW * 4096 bytes) at Dk 128: w2 s3 208,640; w4 s3 229,120;
// w8 s2 190,976 (w8 s3 does not fit in 227 KB); Dk 64: every width fits three stages.
GDR_FWD8_ENTRY(64, 2, 2)
GDR_FWD8_ENTRY(64, 2, 3)
GDR_FWD8_ENTRY(64, 4, 2)
GDR_FWD8_ENTRY(64, 4, 3)
GDR_FWD8_ENTRY(64, 8, 2)
GDR_FWD8_ENTRY(64, 8, 3)
GDR_FWD8_ENTRY(128, 2, 2)
GDR_FWD8_ENTRY(128, 2, 3)
GDR_FWD8_ENTRY(128, 4, 2)
GDR_FWD8_ENTRY(128, 4, 3)
GDR_FWD8_ENTRY(128, 8, 2)

#define GDR_CHAIN8_ENTRY(NW, OUT)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_chain8_d128_w##NW##_o##OUT(            \
        const bf16_t* w, const bf16_t* k, const bf16_t* a, const float* u, const float* gam, int steps,  \
        float* out) {                                                                                   \
        gdr_chain8<128, NW, (OUT != 0)>(w, k, a, u, gam, steps, out);                                   \
    }

GDR_CHAIN8_ENTRY(2, 0)
GDR_CHAIN8_ENTRY(4, 0)
GDR_CHAIN8_ENTRY(8, 0)
GDR_CHAIN8_ENTRY(2, 1)
GDR_CHAIN8_ENTRY(4, 1)
GDR_CHAIN8_ENTRY(8, 1)

// =============================================================================================
// gdr_bwd8 (opt-in GDN_RULE_BWD_SCAN=v8): gdr_bwd6 (the reverse scan with dD_loc folded in)
// with v8's split: a CTA of BV = 16 NW / 2 columns has NW warps, warp w is half hh = w & 1 of
// pair cg = w >> 1 (the pair's 16 columns); the warp holds dS^T for its DH = DK / 2 state rows
// (fp32 accumulator fragments: 32 registers at DK 128, bwd6 needs 64). Same inputs, outputs and
// layouts as gdr_bwd6 (dh per chunk fp32 or bf16, dD fp32, dh0). Per chunk, per warp:
//   dh[c] rows of the half         = dS_hh                      (stored)
//   X_hh   = (dS_hh^T K_hh^T) diag(e^(gam_L - gam) / scale)     (16 x 64 partial, 32 mma)
//   dD^T's chunk rows split between the pair by 16-row blocks, {0, 3} for half 0 and {1, 2}
//   for half 1 (5 of A's 10 lower blocks each): the partials of the partner's blocks go to the
//   partner's buffer, barrier 1, the partner's partials of this warp's blocks added to
//   X_hh + dO^T A (this warp's blocks only, 10 mma), times scale: this warp's dD rows, stored
//   fp32 (each warp half of dD) and as -dD^T bf16 A fragments, which go to this warp's own
//   buffer, barrier 2, the partner's fragments read: both warps hold all of -dD^T (the same
//   bits: one warp computed each element);
//   dS_hh^T <- e^gam_L dS_hh^T + (dO diag(scale e^gam))^T Q_hh - dD^T W_hh   (64 mma)
// Per warp per step: 106 mma (bwd6: 212). Exchange buffer: 2 KB per warp (4 slots x 32 lanes x
// 16 bytes, lane-private). Ordering: a writes b's buffer (slots 0..3), barrier 1, a reads its own
// buffer (b wrote it before barrier 1), a writes its own buffer slots 0..1 (same lane, after its
// reads), barrier 2, a reads b's buffer slots 0..1. The next step's first write of b's buffer
// follows the step's __syncthreads, after which b has done its reads of it: no third barrier.
// Stage: V6G<DK, NW / 2> (two stages, loaded with v6's lean addressing for NT = 32 NW threads).
// The copies of one V6G stage by thread `tid` of NT (without the commit): K, Q, W rows (UNROLL:
// that loop's unroll count, GDR_C unrolls it fully), A, the dO tile, gam. gdr_bwd8 runs it on
// all its threads (v8g_load_stage), gdr_bwd9 on its producer warp (32 threads, UNROLL 4).
template <int DK, int BV, int NT, int UNROLL>
__device__ __forceinline__ void v8g_copy_stage(char* st, int tid, const bf16_t* kc, const bf16_t* qc, i64 krow,
                                               int l, const bf16_t* wc, const bf16_t* ac, const bf16_t* oc,
                                               i64 vrow, const float* gc) {
    typedef V6G<DK, BV / 16> L;
    const unsigned sb = smem_addr(st);
    constexpr int CPR = DK / 8;
    constexpr int RPP = NT / CPR;
    static_assert(NT % CPR == 0 && GDR_C % RPP == 0, "whole rows per pass");
    {
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const bf16_t* gw = wc + i0 * DK + x;
        const bf16_t* gk = kc + i0 * krow + x;
        const bf16_t* gq = qc + i0 * krow + x;
        const i64 step = RPP * krow;
#pragma unroll UNROLL
        for (int m = 0; m < GDR_C / RPP; ++m) {
            const bool ok = i0 + RPP * m < l;
            const unsigned n = ok ? 16u : 0u;
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            cp_async16_s(sr + L::K_OFF, ok ? gk : kc, n);
            cp_async16_s(sr + L::Q_OFF, ok ? gq : qc, n);
            cp_async16_s(sr + L::W_OFF, gw + RPP * m * DK, 16u);
            gk += step;
            gq += step;
        }
    }
    {
        constexpr int RPA = NT / 8;
        static_assert(GDR_C % RPA == 0, "whole rows of A per pass");
        const int i0 = tid >> 3, x = (tid & 7) * 8;
        const unsigned so = sb + L::A_OFF + (unsigned)((i0 * L::LA + x) * 2);
        const bf16_t* ga = ac + i0 * GDR_C + x;
#pragma unroll
        for (int m = 0; m < GDR_C / RPA; ++m)
            cp_async16_s(so + (unsigned)(RPA * m * L::LA * 2), ga + RPA * m * GDR_C, 16u);
    }
    {
        constexpr int OPR = BV / 8;    // dO: 16-byte pieces per row of the tile
        constexpr int RPO = NT / OPR;  // rows per pass
        static_assert(NT % OPR == 0 && GDR_C % RPO == 0, "whole rows of dO per pass");
        const int i0 = tid / OPR, x = (tid % OPR) * 8;
        const unsigned so = sb + L::O_OFF + (unsigned)((i0 * L::LO + x) * 2);
        const bf16_t* go = oc + i0 * vrow + x;
        const i64 step = RPO * vrow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPO; ++m) {
            const bool ok = i0 + RPO * m < l;
            cp_async16_s(so + (unsigned)(RPO * m * L::LO * 2), ok ? go : oc, ok ? 16u : 0u);
            go += step;
        }
    }
    if (tid < GDR_C / 4) cp_async16_s(sb + L::G_OFF + tid * 16, gc + tid * 4, 16u);
}

// One stage by all NT threads of the CTA, committed as one cp.async group.
template <int DK, int BV, int NT>
__device__ __forceinline__ void v8g_load_stage(char* st, const bf16_t* kc, const bf16_t* qc, i64 krow, int l,
                                               const bf16_t* wc, const bf16_t* ac, const bf16_t* oc, i64 vrow,
                                               const float* gc) {
    v8g_copy_stage<DK, BV, NT, GDR_C>(st, threadIdx.x, kc, qc, krow, l, wc, ac, oc, vrow, gc);
    cp_async_commit();
}

// The dD part of one step for warp half H (compile time: its 16-row blocks M0, M1 of dD^T's
// chunk rows are fixed). x: this warp's X_hh (all 8 n8 tiles), already scaled by
// e^(gam_L - gam) / scale; of: dO^T A fragments (unscaled). Stores this warp's dD rows (fp32) at
// ddc (offset to the pair's column g) and leaves -dD^T for all 64 chunk rows in nd.
template <int H, typename TD = float, bool ST = false>
__device__ __forceinline__ void v8g_dd(float (&x)[8][4], const unsigned (&of)[4][4], const bf16_t* sA, int la,
                                       float scale, TD* ddc, int dv, float4* xme, float4* xot, int bar,
                                       unsigned (&nd)[4][4]) {
    constexpr int M0 = H ? 1 : 0, M1 = H ? 2 : 3;  // this warp's blocks
    constexpr int P0 = H ? 0 : 1, P1 = H ? 3 : 2;  // the partner's
    const int lane = threadIdx.x & 31, t = lane & 3, mi = lane >> 3, r = lane & 7;
    // slots 0..3: the partner's blocks in its own order (its M0, M1 are this warp's P0, P1)
    xot[0 * 32 + lane] = make_float4(x[2 * P0][0], x[2 * P0][1], x[2 * P0][2], x[2 * P0][3]);
    xot[1 * 32 + lane] = make_float4(x[2 * P0 + 1][0], x[2 * P0 + 1][1], x[2 * P0 + 1][2], x[2 * P0 + 1][3]);
    xot[2 * 32 + lane] = make_float4(x[2 * P1][0], x[2 * P1][1], x[2 * P1][2], x[2 * P1][3]);
    xot[3 * 32 + lane] = make_float4(x[2 * P1 + 1][0], x[2 * P1 + 1][1], x[2 * P1 + 1][2], x[2 * P1 + 1][3]);
    // + dO^T A for this warp's blocks: B[k = i][n = m] = A[i][m], nonzero for m <= i.
#pragma unroll
    for (int b2 = 0; b2 < 2; ++b2) {
        const int np = b2 ? M1 : M0;
#pragma unroll
        for (int kk = np; kk < 4; ++kk) {
            unsigned bb[4];
            ldsm_x4_t(bb, sA + (16 * kk + 8 * (mi & 1) + r) * la + 16 * np + 8 * (mi >> 1));
            mma_bf16(x[2 * np], of[kk], bb[0], bb[1]);
            mma_bf16(x[2 * np + 1], of[kk], bb[2], bb[3]);
        }
    }
    pair_bar(bar);
    uint4* ume = reinterpret_cast<uint4*>(xme);
    const uint4* uot = reinterpret_cast<const uint4*>(xot);
#pragma unroll
    for (int b2 = 0; b2 < 2; ++b2) {
        const int kk = b2 ? M1 : M0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
            const float4 o = xme[(2 * b2 + h) * 32 + lane];
            const float y[4] = {x[j][0] + o.x, x[j][1] + o.y, x[j][2] + o.z, x[j][3] + o.w};
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float d0 = scale * y[2 * rr];
                const float d1 = scale * y[2 * rr + 1];
                if (sizeof(TD) == 4 || !ST) {  // else (gdr_bwd8b) bf16 dD staged below
                    st_ws(ddc, (i64)i0 * dv + 8 * rr, d0);
                    st_ws(ddc, (i64)(i0 + 1) * dv + 8 * rr, d1);
                }
                nd[kk][rr + 2 * h] = pack_bf16(-d0, -d1);
            }
        }
    }
    // Own buffer, slots 0, 1 (read above by this lane): this warp's -dD^T blocks.
    ume[0 * 32 + lane] = make_uint4(nd[M0][0], nd[M0][1], nd[M0][2], nd[M0][3]);
    ume[1 * 32 + lane] = make_uint4(nd[M1][0], nd[M1][1], nd[M1][2], nd[M1][3]);
    pair_bar(bar);
    const uint4 a0 = uot[0 * 32 + lane], a1 = uot[1 * 32 + lane];
    nd[P0][0] = a0.x;
    nd[P0][1] = a0.y;
    nd[P0][2] = a0.z;
    nd[P0][3] = a0.w;
    nd[P1][0] = a1.x;
    nd[P1][1] = a1.y;
    nd[P1][2] = a1.z;
    nd[P1][3] = a1.w;
    if (ST && sizeof(TD) == 2) {
        // gdr_bwd8b: bf16 dD (this warp's rows, blocks M0 and M1) from -dD's fragments with the
        // sign flipped (rounding commutes with negation: the bits st_ws stores), through slots 2
        // and 3 of this warp's buffer (read above; the partner writes it again only after
        // gdr_bwd8's next CTA barrier: not so in gdr_bwd9, which keeps ST false)
        const unsigned f[2][4] = {{nd[M0][0] ^ 0x80008000u, nd[M0][1] ^ 0x80008000u, nd[M0][2] ^ 0x80008000u,
                                   nd[M0][3] ^ 0x80008000u},
                                  {nd[M1][0] ^ 0x80008000u, nd[M1][1] ^ 0x80008000u, nd[M1][2] ^ 0x80008000u,
                                   nd[M1][3] ^ 0x80008000u}};
        const unsigned xb = smem_addr(xme) + 2u * 32u * 16u;
        v6_tile_out<2>(f, SwRow32{xb}, [](int R) { return R < 16 ? 16 * M0 + R : 16 * M1 + R - 16; },
                       reinterpret_cast<bf16_t*>(ddc) - (lane >> 2), (i64)dv);
    }
}

// Grid: N * Hv * (dv / BV) CTAs of 32 NW threads (BV = 16 NW / 2); dynamic shared memory
// 2 * V6G<DK, NW / 2>::STAGE + NW * 2048.
// TD: dD's type (float, or bf16 for gdr_grad10b: gdr_bwd8b).
template <int DK, int NW, typename TD = float>
__device__ void gdr_bwd8(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const bf16_t* __restrict__ d_o, const float* __restrict__ gam_ws,
                         const bf16_t* __restrict__ w_ws, const bf16_t* __restrict__ a_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                         const float* __restrict__ dht, float* __restrict__ dh_ws, bf16_t* __restrict__ dh16_ws,
                         TD* __restrict__ dd_ws, float* __restrict__ dh0) {
    typedef V6G<DK, NW / 2> L;
    constexpr int BV = 8 * NW, NT = 32 * NW, DH = DK / 2, XB = 4 * 32 * 16;
    static_assert(NW == 2 || NW == 4 || NW == 8, "1, 2 or 4 warp pairs");
    if (dyn_smem_bytes() < (unsigned)(2 * L::STAGE + NW * XB)) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r = lane & 7;
    const int cg = warp >> 1, hh = warp & 1, bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + 2 * L::STAGE + warp * XB);
    float4* xot = reinterpret_cast<float4*>(sm + 2 * L::STAGE + (warp ^ 1) * XB);
    const i64 col0 = (i64)vt * BV;
    const int wc0 = 16 * cg, r0 = DH * hh;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;

    // s[nt][c] = dS[r0 + 8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = dht ? dht[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                           : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage) {
        const i64 cb = c * hv_n + hv;
        const i64 t0 = ch_t0[c];
        v8g_load_stage<DK, BV, NT>(sm + stage * L::STAGE, k + t0 * krow + (i64)kh * DK, q + t0 * krow + (i64)kh * DK,
                                   krow, ch_len[c], w_ws + cb * GDR_C * DK, a_ws + cb * GDR_C * GDR_C,
                                   d_o + t0 * vrow + (i64)hv * dv + col0, vrow, gam_ws + cb * GDR_C);
    };
    if (c_end > c_beg) issue(c_end - 1, 0);
    else cp_async_commit();
    const float inv_scale = 1.f / scale;
    for (i64 c = c_end - 1; c >= c_beg; --c) {
        const int stg = (int)((c_end - 1 - c) & 1);
        cp_async_wait_group<0>();
        __syncthreads();
        if (c > c_beg) issue(c - 1, stg ^ 1);
        else cp_async_commit();
        const int l = ch_len[c];
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF) + r0;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF) + r0;
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const bf16_t* sO = reinterpret_cast<const bf16_t*>(sp + L::O_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;

        float x[8][4];
        {
            unsigned sa[DH / 16][4];
            v6_s_frags<DH>(s, sa);
            // dh[c] = dS (this warp's rows): fp32 as before; bf16 through this warp's exchange
            // buffer (free after the CTA barrier above; the pair barrier keeps the partner's
            // first exchange writes into it after this warp's reads)
            if (dh_ws) {
                v6_store_state<DH>(s, dh_ws, dh16_ws, cb * (i64)DK * dv + (i64)r0 * dv + col0 + wc0 + g, dv);
            } else {
                const unsigned xb = smem_addr(xme);
                v6_tile_out<DH / 16>(sa, SwRow32{xb}, [](int R) { return R; },
                                     dh16_ws + cb * (i64)DK * dv + (i64)r0 * dv + col0 + wc0, (i64)dv);
                pair_bar(bar);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) x[j][cc] = 0.f;
            v6_mul_rows_t<DH>(x, sa, sK, L::LK);
        }
        const float gl = sG[l - 1];
        // a full chunk with its length known at compile time (the masks fold away; the same bits)
        if (l == GDR_C) v8g_scale_x<GDR_C>(x, sG, l, gl, inv_scale);
        else v8g_scale_x<0>(x, sG, l, gl, inv_scale);
        unsigned of[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldsm_x4_t(of[kk], sO + (16 * kk + 8 * (mi >> 1) + r) * L::LO + wc0 + 8 * (mi & 1));
        unsigned nd[4][4];
        TD* ddc = dd_ws + cb * GDR_C * (i64)dv + col0 + wc0 + g;
        if (hh) v8g_dd<1, TD, true>(x, of, sA, L::LA, scale, ddc, dv, xme, xot, bar, nd);
        else v8g_dd<0, TD, true>(x, of, sA, L::LA, scale, ddc, dv, xme, xot, bar, nd);
        if (l == GDR_C) v8g_scale_o<GDR_C>(of, sG, l, scale);
        else v8g_scale_o<0>(of, sG, l, scale);
        const float egl = __expf(gl);
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) s[nt][cc] *= egl;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int np = 0; np < DH / 16; ++np) {
                unsigned bq[4], bw[4];
                ldsm_x4_t(bq, sQ + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                ldsm_x4_t(bw, sW + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                mma_bf16(s[2 * np], of[kk], bq[0], bq[1]);
                mma_bf16(s[2 * np + 1], of[kk], bq[2], bq[3]);
                mma_bf16(s[2 * np], nd[kk], bw[0], bw[1]);
                mma_bf16(s[2 * np + 1], nd[kk], bw[2], bw[3]);
            }
    }
    if (dh0) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                dh0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
}

#define GDR_BWD8_ENTRY(DK, NW)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_bwd8_d##DK##_w##NW(                    \
        const bf16_t* q, const bf16_t* k, const bf16_t* d_o, const float* gam_ws, const bf16_t* w_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* dht, float* dh_ws, bf16_t* dh16_ws, float* dd_ws,             \
        float* dh0) {                                                                                   \
        gdr_bwd8<DK, NW>(q, k, d_o, gam_ws, w_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale, dht,   \
                         dh_ws, dh16_ws, dd_ws, dh0);                                                   \
    } \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_bwd8b_d##DK##_w##NW(                   \
        const bf16_t* q, const bf16_t* k, const bf16_t* d_o, const float* gam_ws, const bf16_t* w_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* dht, float* dh_ws, bf16_t* dh16_ws, bf16_t* dd_ws,            \
        float* dh0) {                                                                                   \
        gdr_bwd8<DK, NW, bf16_t>(q, k, d_o, gam_ws, w_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale, \
                                 dht, dh_ws, dh16_ws, dd_ws, dh0);                                      \
    }

// Shared memory (2 * V6G<DK, NW / 2>::STAGE + NW * 2048 bytes) at Dk 128: w2 133,632; w4 141,824;
// w8 158,208 (Dk 64: 84,480 / 92,672 / 109,056). w4 beside gdr_hrec6 w2 (88,576): 230,400 of
// the SM's 233,472 less 1 KB reserved per CTA; beside gdr_hrec8 w4 (104,960) it does not fit.
GDR_BWD8_ENTRY(64, 2)
GDR_BWD8_ENTRY(64, 4)
GDR_BWD8_ENTRY(64, 8)
GDR_BWD8_ENTRY(128, 2)
GDR_BWD8_ENTRY(128, 4)
GDR_BWD8_ENTRY(128, 8)

// =============================================================================================
// v9 forward (issue 13; opt-in `FwdKernel::V9`, GDN_RULE_FWD=v9): gdr_fwd8 with its loads taken
// off the compute warps. NW compute warps run exactly gdr_fwd8's chunk step (v8_chain_step,
// v8_output: the same code on the same stage bytes, so the same bits of o and of the final
// state); PW producer warps (1, or 4 = one warpgroup) after them issue every chunk's operand
// loads (W, K, Q, A, the U tile, gam: v8_load_stage's bytes at v8_load_stage's places, by
// cp.async) NS - 1 chunks ahead into a ring of NS stages. No CTA-wide barrier per chunk:
//   full[s]  (count 32 PW): each producer thread's `cp.async.mbarrier.arrive.noinc` after its
//            copies of a chunk; the phase completes when every copy of the stage has landed.
//   empty[s] (count NW): lane 0 of each compute warp arrives (after __syncwarp: the warp's
//            reads of the stage are done) when it has finished the chunk's output.
// Chunk i of the CTA's sequence (i = c - c_beg) uses stage i % NS, phase k = i / NS of both of
// its barriers: the compute warps wait for full parity k & 1; the producer, before refilling
// the stage with chunk i (i >= NS), waits for empty parity (k - 1) & 1 (the release of chunk
// i - NS). Neither barrier can run a phase ahead of its waiter (the producer cannot fill chunk
// i + NS before chunk i's release; chunk i + NS's release needs chunk i + NS's fill), so one
// parity bit names the phase (checked by bench/notes/emu/fwd10.cpp's interleavings).
// Registers: with PW = 1 the CTA has 32 (NW + 1) threads: the register file holds 255 per
// thread at NW <= 4 (160 x 255 < 64 K), but at NW = 8 (288 threads) ptxas budgets whole
// warpgroups (384 x 168) and spills. setmaxnreg
// needs whole warpgroups, so the PW = 4 variant (NW = 8: 384 threads, 168 registers at launch)
// gives the producer warpgroup 40 and the two compute warpgroups 232 (128 x 40 + 256 x 232 =
// 64,512 of 65,536). sm_90 only (try_wait; setmaxnreg sm_90a): below sm_90 the body is empty and
// the Rust side runs gdr_fwd8 instead. Shared memory: gdr_fwd8's NS * STAGE + NW * XB, then the
// NS full and NS empty mbarriers (16 NS bytes).
// Two things differ from gdr_fwd8's compute loop, neither the arithmetic (session 13): a full
// chunk (l = 64, every chunk but a sequence's last) runs the step with the length known at
// compile time, so the row masks fold away (ncu: half the compute warps' samples were in the
// masked, predicated code); and o goes out through shared memory as whole 32-byte sectors
// (v9_stage_o / v9_store_o: two stmatrix, two 16-byte loads and stores per lane) instead of 16
// predicated 2-byte stores per lane with 64-bit address arithmetic each (40% of the samples).

// v8_load_stage's copies for a producer of PT threads, `ptid` 0 .. PT - 1 (the same bytes to
// the same places of a V6<DK, BV / 16> stage: thread ptid copies the pieces thread ptid of a
// PT-thread v8_load_stage copies), without the commit (the caller arrives on the stage's
// mbarrier instead).
template <int DK, int BV, int PT>
__device__ __forceinline__ void v9_load_stage(char* st, int ptid, const bf16_t* wc, const bf16_t* kc,
                                              const bf16_t* qc, i64 krow, int l, const bf16_t* ac,
                                              const float* uc, i64 urow, const float* gc) {
    typedef V6<DK, BV / 16> L;
    const int tid = ptid;
    const unsigned sb = smem_addr(st);
    constexpr int CPR = DK / 8;    // 16-byte pieces per row of W, K, Q
    constexpr int RPP = PT / CPR;  // rows per pass
    static_assert(PT % CPR == 0 && GDR_C % RPP == 0, "whole rows per pass");
    {
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const bf16_t* gw = wc + i0 * DK + x;
        const bf16_t* gk = kc + i0 * krow + x;
        const bf16_t* gq = qc + i0 * krow + x;
        const i64 step = RPP * krow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPP; ++m) {
            const bool ok = i0 + RPP * m < l;
            const unsigned n = ok ? 16u : 0u;
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            cp_async16_s(sr + L::W_OFF, gw + RPP * m * DK, 16u);
            cp_async16_s(sr + L::K_OFF, ok ? gk : kc, n);
            cp_async16_s(sr + L::Q_OFF, ok ? gq : qc, n);
            gk += step;
            gq += step;
        }
    }
    {
        constexpr int RPA = PT / 8;  // A: 8 pieces per row
        static_assert(GDR_C % RPA == 0, "whole rows of A per pass");
        const int i0 = tid >> 3, x = (tid & 7) * 8;
        const unsigned so = sb + L::A_OFF + (unsigned)((i0 * L::LA + x) * 2);
        const bf16_t* ga = ac + i0 * GDR_C + x;
#pragma unroll
        for (int m = 0; m < GDR_C / RPA; ++m)
            cp_async16_s(so + (unsigned)(RPA * m * L::LA * 2), ga + RPA * m * GDR_C, 16u);
    }
    {
        constexpr int UPR = BV / 4;    // U: 16-byte pieces per row of the tile
        constexpr int RPU = PT / UPR;  // rows per pass
        static_assert(PT % UPR == 0 && GDR_C % RPU == 0, "whole rows of U per pass");
        const int i0 = tid / UPR, x = (tid % UPR) * 4;
        const unsigned so = sb + L::U_OFF + (unsigned)((i0 * L::LU + x) * 4);
        const float* gu = uc + i0 * urow + x;
        const i64 step = RPU * urow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPU; ++m) {
            cp_async16_s(so + (unsigned)(RPU * m * L::LU * 4), gu, 16u);
            gu += step;
        }
    }
    if (tid < GDR_C / 4) cp_async16_s(sb + L::G_OFF + tid * 16, gc + tid * 4, 16u);
}

// Registers per thread after setmaxnreg (PW = 4 only): producer warpgroup, compute warpgroups.
#define GDR_V9_PREG 40
#define GDR_V9_CREG 232


// One warp's output of a chunk to global memory through shared memory (gdr_fwd9; warp half H:
// the chunk rows of 16-row blocks M0 = H, M1 = 3 - H, the pair's 16 columns). As v8_output
// finishes block B (0: M0, 1: M1), v9_stage_o puts its 16 rows x 16 columns, scaled, as bf16
// (round to nearest even: the bits st() gives a finite value) by one stmatrix.trans into the
// warp's own exchange buffer (free between v8_output's reads of it and the next chain step's
// writes: the partner writes it only after the next step's first pair barrier): tile row R
// (0 .. 15 block M0, 16 .. 31 block M1) at 32 R bytes, its two 16-byte halves swapped in rows
// with R & 4 (conflict-free). v9_store_o then reads the tile back as 16-byte pieces, two lanes
// per row, and writes whole 32-byte sectors (rows >= l are not written). `oc`: the pair's first
// column in the chunk's first row.
template <int B>
__device__ __forceinline__ void v9_stage_o(const float (&ov)[2][4], unsigned base) {
    const int lane = threadIdx.x & 31, r = lane & 7, m = lane >> 3;
    if (B == 0) __syncwarp();  // every lane's reads of the exchange slots are done
    // matrix m = 2 h + c: the block's n8 tile h (ov[h]: chunk rows 8 h ..), columns 8 c ..
    stsm_x4_t(SwRow32{base}(16 * B + 8 * (m >> 1) + r, m & 1), pack_bf16(ov[0][0], ov[0][1]),
              pack_bf16(ov[0][2], ov[0][3]), pack_bf16(ov[1][0], ov[1][1]), pack_bf16(ov[1][2], ov[1][3]));
}

template <int H>
__device__ __forceinline__ void v9_store_o(unsigned base, bf16_t* oc, i64 vrow, int l) {
    constexpr int M0 = H ? 1 : 0, M1 = H ? 2 : 3;
    v6_tile_flush<2, true>(SwRow32{base}, [](int R) { return 16 * (R < 16 ? M0 : M1) + (R & 15); }, oc, vrow, l);
}

// The output half of a gdr_fwd9 compute warp's chunk step for warp half H: v8_output, each
// finished block staged by v9_stage_o, then v9_store_o. LC is the chunk length when known at
// compile time (GDR_C: a full chunk, every row mask folds away) or 0 (a sequence's last, partial
// chunk: `lr` at run time); the chain step before it takes the same length. The masks select
// nothing in a full chunk, so both give the same bits.
template <int DK, int H, int LC>
__device__ __forceinline__ void v9_output(const unsigned (&sa)[DK / 32][4], const unsigned (&da)[4][4],
                                          const bf16_t* sQ, int lk, const bf16_t* sA, int la, const float* sG,
                                          int lr, float4* xme, float4* xot, int bar, float scale, bf16_t* oc,
                                          i64 vrow) {
    constexpr int M0 = H ? 1 : 0;
    const int l = LC ? LC : lr;
    const unsigned base = smem_addr(xme);
    float ov[2][4];  // the block being finished: [n8 tile][fragment element]
    v8_output<DK, H>(sa, da, sQ, lk, sA, la, sG, l, xme, xot, bar, [&](int j, int cc, float v) {
        ov[j & 1][cc] = scale * v;
        if ((j & 1) && cc == 3) {
            if ((j >> 1) == M0)
                v9_stage_o<0>(ov, base);
            else
                v9_stage_o<1>(ov, base);
        }
    });
    v9_store_o<H>(base, oc, vrow, l);
}

// gdr_fwd8 with a producer (see the v9 header). Grid as gdr_fwd8; 32 (NW + PW) threads; dynamic
// shared memory NS * STAGE + NW * XB + 16 NS.
template <int DK, int NW, int NS, int PW>
__device__ void gdr_fwd9(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const float* __restrict__ gam_ws, const bf16_t* __restrict__ w_ws,
                         const float* __restrict__ u_ws, const bf16_t* __restrict__ a_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                         const float* __restrict__ h0, bf16_t* __restrict__ o, float* __restrict__ fin) {
#if __CUDA_ARCH__ >= 900
    typedef V8<DK, NW> P;
    typedef typename P::L L;
    constexpr int DH = P::DH;
    constexpr int PT = 32 * PW;
    constexpr unsigned BAR_OFF = NS * P::STAGE + NW * P::XB;
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    static_assert(NW == 2 || NW == 4 || NW == 8, "1, 2 or 4 warp pairs");
    static_assert(PW == 1 || (PW == 4 && NW % 4 == 0), "one producer warp or one producer warpgroup");
    static_assert(BAR_OFF % 8 == 0, "mbarriers 8-byte aligned");
    // A launch with too little shared memory writes nothing (tests see the poisoned output).
    if (dyn_smem_bytes() < BAR_OFF + 16u * NS) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const unsigned full0 = smem_addr(sm + BAR_OFF), empty0 = full0 + 8u * NS;
    const int nvt = dv / P::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 col0 = (i64)vt * P::BV;  // the CTA's first state column
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;
    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            acp_mbar_init(full0 + 8u * s, PT);
            acp_mbar_init(empty0 + 8u * s, NW);
        }
        acp_fence_mbar_init();
    }
    // The only CTA-wide barrier: the mbarriers are initialized before anyone uses them.
    __syncthreads();

    if (warp >= NW) {
        // The producer: chunk i into stage i % NS once the stage's previous chunk is released.
        if (PW == 4 && NW == 8) acp_setmaxnreg_dec<GDR_V9_PREG>();
        const int ptid = threadIdx.x - 32 * NW;
        int stg = 0;
        unsigned eph = 1;  // parity of the empty phase to wait for (the previous round's)
        for (i64 c = c_beg; c < c_end; ++c) {
            if (c - c_beg >= NS) acp_mbar_wait(empty0 + 8u * stg, eph);
            const i64 cb = c * hv_n + hv;
            const i64 t0 = ch_t0[c];
            v9_load_stage<DK, P::BV, PT>(sm + stg * P::STAGE, ptid, w_ws + cb * GDR_C * DK,
                                         k + t0 * krow + (i64)kh * DK, q + t0 * krow + (i64)kh * DK, krow,
                                         ch_len[c], a_ws + cb * GDR_C * GDR_C, u_ws + cb * GDR_C * dv + col0,
                                         (i64)dv, gam_ws + cb * GDR_C);
            acp_cp_async_arrive_noinc(full0 + 8u * stg);
            if (++stg == NS) {
                stg = 0;
                eph ^= 1u;
            }
        }
        // Leave no copy in flight behind an exiting thread.
        cp_async_wait_all();
        return;
    }
    if (PW == 4 && NW == 8) acp_setmaxnreg_inc<GDR_V9_CREG>();

    const int cg = warp >> 1, hh = warp & 1;
    const int bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + NS * P::STAGE + warp * P::XB);
    float4* xot = reinterpret_cast<float4*>(sm + NS * P::STAGE + (warp ^ 1) * P::XB);
    const int wc0 = 16 * cg;  // the pair's first column inside the tile
    const int r0 = DH * hh;   // this warp's first state row
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;

    // s[nt][c] = S[r0 + 8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                          : 0.f;

    // The next chunk's length and first token, read one chunk ahead (off the chain's path).
    int l_next = c_beg < c_end ? ch_len[c_beg] : 0;
    i64 t0_next = c_beg < c_end ? ch_t0[c_beg] : 0;
    int stg = 0;
    unsigned fph = 0;  // parity of the full phase to wait for
    for (i64 c = c_beg; c < c_end; ++c) {
        const int l = l_next;
        const i64 t0 = t0_next;
        if (c + 1 < c_end) {
            l_next = ch_len[c + 1];
            t0_next = ch_t0[c + 1];
        }
        acp_mbar_wait(full0 + 8u * stg, fph);  // chunk c's copies have landed
        const char* sp = sm + stg * P::STAGE;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF) + r0;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF) + r0;
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const float* sU = reinterpret_cast<const float*>(sp + L::U_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);

        unsigned sa[DH / 16][4], da[4][4];
        bf16_t* oc = o + t0 * vrow + (i64)hv * dv + col0 + wc0;
        if (l == GDR_C) {
            v8_chain_step<DK>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, GDR_C, xme, xot, bar);
            if (hh)
                v9_output<DK, 1, GDR_C>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
            else
                v9_output<DK, 0, GDR_C>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
        } else {
            v8_chain_step<DK>(s, sa, da, sW, sK, L::LK, sU + wc0, L::LU, sG, l, xme, xot, bar);
            if (hh)
                v9_output<DK, 1, 0>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
            else
                v9_output<DK, 0, 0>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
        }
        // This warp is done with the stage (every lane's reads of it have returned: their
        // values were used above); release it to the producer.
        __syncwarp();
        if (lane == 0) acp_mbar_arrive(empty0 + 8u * stg);
        if (++stg == NS) {
            stg = 0;
            fph ^= 1u;
        }
    }
    if (fin) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                fin[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
#endif
}

#define GDR_FWD9_ENTRY(DK, NW, NS, PW)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * (NW + PW), 1) gdr_fwd9_d##DK##_w##NW##_s##NS##_p##PW( \
        const bf16_t* q, const bf16_t* k, const float* gam_ws, const bf16_t* w_ws, const float* u_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* h0, bf16_t* o, float* fin) {                                  \
        gdr_fwd9<DK, NW, NS, PW>(q, k, gam_ws, w_ws, u_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv,      \
                                 scale, h0, o, fin);                                                    \
    }

// Shared memory: gdr_fwd8's + 16 NS bytes (Dk 128: w2 s3 208,688; w4 s3 229,168; w8 s2 191,008).
GDR_FWD9_ENTRY(64, 2, 2, 1)
GDR_FWD9_ENTRY(64, 2, 3, 1)
GDR_FWD9_ENTRY(64, 4, 2, 1)
GDR_FWD9_ENTRY(64, 4, 3, 1)
GDR_FWD9_ENTRY(64, 8, 2, 1)
GDR_FWD9_ENTRY(64, 8, 3, 1)
GDR_FWD9_ENTRY(64, 8, 2, 4)
GDR_FWD9_ENTRY(64, 8, 3, 4)
GDR_FWD9_ENTRY(128, 2, 2, 1)
GDR_FWD9_ENTRY(128, 2, 3, 1)
GDR_FWD9_ENTRY(128, 4, 2, 1)
GDR_FWD9_ENTRY(128, 4, 3, 1)
GDR_FWD9_ENTRY(128, 8, 2, 1)
GDR_FWD9_ENTRY(128, 8, 2, 4)

// =============================================================================================
// v10 forward (issue 13, opt-in `FwdKernel::V10`, GDN_RULE_FWD=v10; written in session 18 with
// no device: compiled and inspected with ptxas, not yet run): gdr_fwd9 with D rebuilt in the
// scan instead of read as U - W S0, so the prep writes neither W (bf16) nor U (fp32):
//   D = U - W S0 = PT (V - diag(e^gam) K S0),   PT = T diag(beta)   (U = PT V, W = PT diag(e^gam) K)
// Per chunk, per warp (pair cg, half hh as in gdr_fwd8):
//   KS_hh^T = S_hh^T K_hh^T           (16 x 64 partial, k = DH; v8's X product with K for W)
//   KS^T    = KS_0^T + KS_1^T         (the same exchange and pair barrier as v8)
//   Y^T     = V^T - KS^T diag(e^gam)  (V: the input rows, bf16; this lane's elements)
//   D^T     = Y^T PT^T                (PT hi, then lo: gdr_prep8o / 9o's split, the values of U's
//                                      operand in prep8; PT's blocks on or below the diagonal)
// then v8's update with D^T and the output (v9_output) unchanged. One more product on the chain
// (Y^T PT^T: 20 mma.sync per half-operand) for ~48 KB less written and read per (chunk, value
// head) at Dk = Dv = 128 (W 16 KB, U 32 KB) and the prep's W / U products gone. Numerics: D
// from bf16 Y and a hi + lo PT (fwd9: fp32 U from a hi + lo P, minus W S0 with bf16 W and S0):
// not fwd9's bits; held to the f64 tests (gpu_rule's v10_forward_matches_f64, which prints the
// difference from v9). gdr_fwd10f (LO false): PT's hi part only (20 mma, the lo tile not loaded).
// Stage (V10S): K, Q (64 x DK + 8 bf16), PT hi, PT lo, A (64 x 72 bf16), the pair columns' V tile
// (64 x BV + 8 bf16, rows >= l zero-filled), gam (64 fp32).

template <int DK, int NC>
struct V10S {
    static constexpr int BV = 16 * NC;
    static constexpr int LK = DK + 8;
    static constexpr int LA = GDR_C + 8;
    static constexpr int LV = BV + 8;
    static constexpr int K_OFF = 0;
    static constexpr int Q_OFF = K_OFF + GDR_C * LK * 2;
    static constexpr int TH_OFF = Q_OFF + GDR_C * LK * 2;
    static constexpr int TL_OFF = TH_OFF + GDR_C * LA * 2;
    static constexpr int A_OFF = TL_OFF + GDR_C * LA * 2;
    static constexpr int V_OFF = A_OFF + GDR_C * LA * 2;
    static constexpr int G_OFF = V_OFF + GDR_C * LV * 2;
    static constexpr int STAGE = G_OFF + GDR_C * 4;
    static_assert(V_OFF % 16 == 0 && G_OFF % 16 == 0 && STAGE % 16 == 0, "16-byte aligned regions");
};

// One chunk's copies into a V10S stage from a producer of PT threads (`ptid` 0 .. PT - 1),
// without the commit (the caller arrives on the stage's mbarrier). pc: the chunk's PT hi (lo at
// + 64 x 64); vc: its first V row at the CTA's first column (row stride vrow).
template <int DK, int BV, int PT, bool LO = true>
__device__ __forceinline__ void v10_load_stage(char* st, int ptid, const bf16_t* kc, const bf16_t* qc, i64 krow,
                                               int l, const bf16_t* pc, const bf16_t* ac, const bf16_t* vc,
                                               i64 vrow, const float* gc) {
    typedef V10S<DK, BV / 16> L;
    const int tid = ptid;
    const unsigned sb = smem_addr(st);
    {
        constexpr int CPR = DK / 8;    // 16-byte pieces per row of K, Q
        constexpr int RPP = PT / CPR;  // rows per pass
        static_assert(PT % CPR == 0 && GDR_C % RPP == 0, "whole rows per pass");
        const int i0 = tid / CPR, x = (tid % CPR) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LK + x) * 2);
        const bf16_t* gk = kc + i0 * krow + x;
        const bf16_t* gq = qc + i0 * krow + x;
        const i64 step = RPP * krow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPP; ++m) {
            const bool ok = i0 + RPP * m < l;
            const unsigned n = ok ? 16u : 0u;
            const unsigned sr = so + (unsigned)(RPP * m * L::LK * 2);
            cp_async16_s(sr + L::K_OFF, ok ? gk : kc, n);
            cp_async16_s(sr + L::Q_OFF, ok ? gq : qc, n);
            gk += step;
            gq += step;
        }
    }
    {
        constexpr int RPA = PT / 8;  // PT hi / lo, A: 8 pieces per row
        static_assert(GDR_C % RPA == 0, "whole rows of A per pass");
        const int i0 = tid >> 3, x = (tid & 7) * 8;
        const unsigned so = sb + (unsigned)((i0 * L::LA + x) * 2);
        const bf16_t* gh = pc + i0 * GDR_C + x;
        const bf16_t* ga = ac + i0 * GDR_C + x;
#pragma unroll
        for (int m = 0; m < GDR_C / RPA; ++m) {
            const unsigned sr = so + (unsigned)(RPA * m * L::LA * 2);
            cp_async16_s(sr + L::TH_OFF, gh + RPA * m * GDR_C, 16u);
            if (LO) cp_async16_s(sr + L::TL_OFF, gh + GDR_C * GDR_C + RPA * m * GDR_C, 16u);
            cp_async16_s(sr + L::A_OFF, ga + RPA * m * GDR_C, 16u);
        }
    }
    {
        constexpr int UPR = BV / 8;    // V: 16-byte pieces per row of the tile
        constexpr int RPU = PT / UPR;  // rows per pass
        static_assert(PT % UPR == 0 && GDR_C % RPU == 0, "whole rows of V per pass");
        const int i0 = tid / UPR, x = (tid % UPR) * 8;
        const unsigned so = sb + L::V_OFF + (unsigned)((i0 * L::LV + x) * 2);
        const bf16_t* gv = vc + i0 * vrow + x;
        const i64 step = RPU * vrow;
#pragma unroll
        for (int m = 0; m < GDR_C / RPU; ++m) {
            const bool ok = i0 + RPU * m < l;
            cp_async16_s(so + (unsigned)(RPU * m * L::LV * 2), ok ? gv : vc, ok ? 16u : 0u);
            gv += step;
        }
    }
    if (tid < GDR_C / 4) cp_async16_s(sb + L::G_OFF + tid * 16, gc + tid * 4, 16u);
}

// gdr_fwd10's chunk step for this warp (see the v10 header; v8_chain_step's interface with K,
// PT and V in place of W and U): on entry s holds this warp's half of S^T; on exit the half of
// S1^T, sa the half of S0^T as bf16 A fragments, da D^T (all 64 chunk rows, bf16) for the
// output. sk: the stage's K offset to this warp's DH columns; pth / ptl: PT hi / lo (row stride
// la); sv: the V tile offset to the pair's first column (row stride lv).
template <int DK, bool LO = true>
__device__ __forceinline__ void v10_chain_step(float (&s)[DK / 16][4], unsigned (&sa)[DK / 32][4],
                                               unsigned (&da)[4][4], const bf16_t* sk, int lk, const bf16_t* pth,
                                               const bf16_t* ptl, int la, const bf16_t* sv, int lv,
                                               const float* s_gam, int l, float4* xme, const float4* xot,
                                               int bar) {
    constexpr int DH = DK / 2;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, mi = lane >> 3, r = lane & 7;
    v6_s_frags<DH>(s, sa);
    float x[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) x[j][c] = 0.f;
    v6_mul_rows_t<DH>(x, sa, sk, lk);
#pragma unroll
    for (int j = 0; j < 8; ++j) xme[j * 32 + lane] = make_float4(x[j][0], x[j][1], x[j][2], x[j][3]);
    // Independent of the exchange: the decay factors, e^gam and this lane's V values.
    const float gl = s_gam[l - 1];
    float ed[8][2], eg[8][2], vv[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i0 = 8 * j + 2 * t;
        ed[j][0] = i0 < l ? __expf(gl - s_gam[i0]) : 0.f;
        ed[j][1] = i0 + 1 < l ? __expf(gl - s_gam[i0 + 1]) : 0.f;
        eg[j][0] = i0 < l ? __expf(s_gam[i0]) : 0.f;
        eg[j][1] = i0 + 1 < l ? __expf(s_gam[i0 + 1]) : 0.f;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            vv[j][2 * rr] = bf16_to_f32(sv[i0 * lv + g + 8 * rr]);
            vv[j][2 * rr + 1] = bf16_to_f32(sv[(i0 + 1) * lv + g + 8 * rr]);
        }
    }
    pair_bar(bar);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 o = xot[j * 32 + lane];
        x[j][0] += o.x;
        x[j][1] += o.y;
        x[j][2] += o.z;
        x[j][3] += o.w;
    }
    // Y^T = V^T - KS^T diag(e^gam) as A fragments (k = the chunk rows)
    unsigned ya[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
                ya[kk][rr + 2 * h] = pack_bf16(vv[j][2 * rr] - eg[j][0] * x[j][2 * rr],
                                               vv[j][2 * rr + 1] - eg[j][1] * x[j][2 * rr + 1]);
        }
    // D^T = Y^T PT^T: B[k][n] = PT[n][k] (row-major PT), the blocks kk <= jp; hi, then lo
    float d[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) d[j][c] = 0.f;
#pragma unroll
    for (int jp = 0; jp < 4; ++jp)
#pragma unroll
        for (int kk = 0; kk <= jp; ++kk) {
            const int off = (16 * jp + 8 * (mi >> 1) + r) * la + 16 * kk + 8 * (mi & 1);
            unsigned bh[4];
            ldsm_x4(bh, pth + off);
            mma_bf16(d[2 * jp], ya[kk], bh[0], bh[1]);
            mma_bf16(d[2 * jp + 1], ya[kk], bh[2], bh[3]);
            if constexpr (LO) {
                unsigned bl[4];
                ldsm_x4(bl, ptl + off);
                mma_bf16(d[2 * jp], ya[kk], bl[0], bl[1]);
                mma_bf16(d[2 * jp + 1], ya[kk], bl[2], bl[3]);
            }
        }
    unsigned dsa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float d0 = d[j][2 * rr], d1 = d[j][2 * rr + 1];
                da[kk][rr + 2 * h] = pack_bf16(d0, d1);
                dsa[kk][rr + 2 * h] = pack_bf16(ed[j][0] * d0, ed[j][1] * d1);
            }
        }
    const float egl = __expf(gl);
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] *= egl;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < DH / 16; ++np) {
            unsigned b[4];
            ldsm_x4_t(b, sk + (16 * kk + 8 * (mi & 1) + r) * lk + 16 * np + 8 * (mi >> 1));
            mma_bf16(s[2 * np], dsa[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], dsa[kk], b[2], b[3]);
        }
}

// gdr_fwd9 on V10S stages and v10_chain_step (see the v10 header): the same producer, ring,
// exchange and output (kept a copy of gdr_fwd9 while v10 is unmeasured, so that the GPU-tested
// gdr_fwd9's machine code stays as it is; one template for both once v10 has run). Grid as
// gdr_fwd9; 32 (NW + PW) threads; dynamic shared memory NS * V10S::STAGE + NW * 4096 + 16 NS.
// pt_ws: gdr_prep8o / 9o's PT hi + lo ([chunk][value head][2][64][64] bf16); v: the input values.
template <int DK, int NW, int NS, int PW, bool LO = true>
__device__ void gdr_fwd10(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                          const float* __restrict__ gam_ws, const bf16_t* __restrict__ pt_ws,
                          const bf16_t* __restrict__ v, const bf16_t* __restrict__ a_ws,
                          const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                          const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                          const float* __restrict__ h0, bf16_t* __restrict__ o, float* __restrict__ fin) {
#if __CUDA_ARCH__ >= 900
    typedef V8<DK, NW> P;
    typedef V10S<DK, NW / 2> L;
    constexpr int DH = P::DH;
    constexpr int PT = 32 * PW;
    constexpr unsigned BAR_OFF = NS * L::STAGE + NW * P::XB;
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    static_assert(NW == 2 || NW == 4 || NW == 8, "1, 2 or 4 warp pairs");
    static_assert(PW == 1 || (PW == 4 && NW % 4 == 0), "one producer warp or one producer warpgroup");
    static_assert(BAR_OFF % 8 == 0, "mbarriers 8-byte aligned");
    // A launch with too little shared memory writes nothing (tests see the poisoned output).
    if (dyn_smem_bytes() < BAR_OFF + 16u * NS) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const unsigned full0 = smem_addr(sm + BAR_OFF), empty0 = full0 + 8u * NS;
    const int nvt = dv / P::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 col0 = (i64)vt * P::BV;  // the CTA's first state column
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;
    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            acp_mbar_init(full0 + 8u * s, PT);
            acp_mbar_init(empty0 + 8u * s, NW);
        }
        acp_fence_mbar_init();
    }
    // The only CTA-wide barrier: the mbarriers are initialized before anyone uses them.
    __syncthreads();

    if (warp >= NW) {
        // The producer: chunk i into stage i % NS once the stage's previous chunk is released.
        if (PW == 4 && NW == 8) acp_setmaxnreg_dec<GDR_V9_PREG>();
        const int ptid = threadIdx.x - 32 * NW;
        int stg = 0;
        unsigned eph = 1;  // parity of the empty phase to wait for (the previous round's)
        for (i64 c = c_beg; c < c_end; ++c) {
            if (c - c_beg >= NS) acp_mbar_wait(empty0 + 8u * stg, eph);
            const i64 cb = c * hv_n + hv;
            const i64 t0 = ch_t0[c];
            v10_load_stage<DK, P::BV, PT, LO>(sm + stg * L::STAGE, ptid, k + t0 * krow + (i64)kh * DK,
                                          q + t0 * krow + (i64)kh * DK, krow, ch_len[c],
                                          pt_ws + cb * (2 * GDR_C * GDR_C), a_ws + cb * GDR_C * GDR_C,
                                          v + t0 * vrow + (i64)hv * dv + col0, vrow, gam_ws + cb * GDR_C);
            acp_cp_async_arrive_noinc(full0 + 8u * stg);
            if (++stg == NS) {
                stg = 0;
                eph ^= 1u;
            }
        }
        // Leave no copy in flight behind an exiting thread.
        cp_async_wait_all();
        return;
    }
    if (PW == 4 && NW == 8) acp_setmaxnreg_inc<GDR_V9_CREG>();

    const int cg = warp >> 1, hh = warp & 1;
    const int bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + NS * L::STAGE + warp * P::XB);
    float4* xot = reinterpret_cast<float4*>(sm + NS * L::STAGE + (warp ^ 1) * P::XB);
    const int wc0 = 16 * cg;  // the pair's first column inside the tile
    const int r0 = DH * hh;   // this warp's first state row
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;

    // s[nt][c] = S[r0 + 8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                          : 0.f;

    // The next chunk's length and first token, read one chunk ahead (off the chain's path).
    int l_next = c_beg < c_end ? ch_len[c_beg] : 0;
    i64 t0_next = c_beg < c_end ? ch_t0[c_beg] : 0;
    int stg = 0;
    unsigned fph = 0;  // parity of the full phase to wait for
    for (i64 c = c_beg; c < c_end; ++c) {
        const int l = l_next;
        const i64 t0 = t0_next;
        if (c + 1 < c_end) {
            l_next = ch_len[c + 1];
            t0_next = ch_t0[c + 1];
        }
        acp_mbar_wait(full0 + 8u * stg, fph);  // chunk c's copies have landed
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF) + r0;
        const bf16_t* sTh = reinterpret_cast<const bf16_t*>(sp + L::TH_OFF);
        const bf16_t* sTl = reinterpret_cast<const bf16_t*>(sp + L::TL_OFF);
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const bf16_t* sV = reinterpret_cast<const bf16_t*>(sp + L::V_OFF) + wc0;
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);

        unsigned sa[DH / 16][4], da[4][4];
        bf16_t* oc = o + t0 * vrow + (i64)hv * dv + col0 + wc0;
        if (l == GDR_C) {
            v10_chain_step<DK, LO>(s, sa, da, sK, L::LK, sTh, sTl, L::LA, sV, L::LV, sG, GDR_C, xme, xot, bar);
            if (hh)
                v9_output<DK, 1, GDR_C>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
            else
                v9_output<DK, 0, GDR_C>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
        } else {
            v10_chain_step<DK, LO>(s, sa, da, sK, L::LK, sTh, sTl, L::LA, sV, L::LV, sG, l, xme, xot, bar);
            if (hh)
                v9_output<DK, 1, 0>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
            else
                v9_output<DK, 0, 0>(sa, da, sQ, L::LK, sA, L::LA, sG, l, xme, xot, bar, scale, oc, vrow);
        }
        // This warp is done with the stage; release it to the producer.
        __syncwarp();
        if (lane == 0) acp_mbar_arrive(empty0 + 8u * stg);
        if (++stg == NS) {
            stg = 0;
            fph ^= 1u;
        }
    }
    if (fin) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                fin[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
#endif
}

// gdr_fwd10_*: PT hi + lo (LO); gdr_fwd10f_*: PT's hi part only (one product less on the chain, D
// from a bf16-rounded PT as fwd9's W S0 is; GDN_RULE_FWD=v10f).
#define GDR_FWD10_ENTRY_LO(NAME, DK, NW, NS, PW, LO)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * (NW + PW), 1)                                     \
        NAME##_d##DK##_w##NW##_s##NS##_p##PW(const bf16_t* q, const bf16_t* k, const float* gam_ws,      \
                                             const bf16_t* pt_ws, const bf16_t* v, const bf16_t* a_ws,   \
                                             const i64* seq_ch, const i64* ch_t0, const int* ch_len,     \
                                             int hk, int hv, int dv, float scale, const float* h0,       \
                                             bf16_t* o, float* fin) {                                    \
        gdr_fwd10<DK, NW, NS, PW, LO>(q, k, gam_ws, pt_ws, v, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv,   \
                                      scale, h0, o, fin);                                                \
    }
#define GDR_FWD10_ENTRY(DK, NW, NS, PW)                  \
    GDR_FWD10_ENTRY_LO(gdr_fwd10, DK, NW, NS, PW, true) \
    GDR_FWD10_ENTRY_LO(gdr_fwd10f, DK, NW, NS, PW, false)

// The widths and stages gdr_fwd9 runs (cuda.rs picks them the same way for both).
GDR_FWD10_ENTRY(64, 2, 3, 1)
GDR_FWD10_ENTRY(64, 4, 3, 1)
GDR_FWD10_ENTRY(64, 8, 3, 4)
GDR_FWD10_ENTRY(128, 2, 3, 1)
GDR_FWD10_ENTRY(128, 4, 3, 1)
GDR_FWD10_ENTRY(128, 8, 2, 4)
GDR_FWD10_ENTRY(64, 2, 2, 1)
GDR_FWD10_ENTRY(64, 4, 2, 1)
GDR_FWD10_ENTRY(64, 8, 2, 4)
GDR_FWD10_ENTRY(128, 2, 2, 1)
GDR_FWD10_ENTRY(128, 4, 2, 1)

// =============================================================================================
// gdr_bwd9 (issue 13; opt-in GDN_RULE_BWD_SCAN=v9 / set_bwd9, sm_90): gdr_bwd8 with its loads
// taken off the compute warps, as gdr_fwd9 does for gdr_fwd8. NW compute warps run exactly
// gdr_bwd8's chunk step (the same code on the same stage bytes: the same bits of dh, dD, dh0);
// one producer warp after them issues each chunk's operand copies (K, Q, W, A, the dO tile, gam:
// v8g_load_stage's bytes at v8g_load_stage's places, by cp.async), chunks in reverse order, NS
// - 1 chunks ahead, into a ring of NS stages, with gdr_fwd9's full / empty mbarriers (full[s]:
// 32 producer arrivals by cp.async.mbarrier.arrive.noinc; empty[s]: lane 0 of each compute warp
// after __syncwarp, once its step's last reads of the stage are done). Chunk i of the CTA's
// walk (i = c_end - 1 - c) uses stage i % NS, phase i / NS. No CTA-wide barrier per chunk: the
// pair exchange of v8g_dd is ordered by its two pair barriers alone (a warp's next write of its
// partner's buffer follows the partner's reads of it, which precede the partner's second pair
// barrier of the step). sm_90 only (try_wait); below it the body is empty and the Rust side
// runs gdr_bwd8. Shared memory: gdr_bwd8's NS * STAGE + NW * XB (NS = 2: gdr_bwd8's bytes), then
// the 2 NS mbarriers: at NS = 2 it still fits beside gdr_hrec6 w2 on an SM.

// gdr_bwd8 with a producer warp (see above). Grid as gdr_bwd8; 32 (NW + 1) threads; dynamic
// shared memory NS * V6G<DK, NW / 2>::STAGE + NW * 2048 + 16 NS.
template <int DK, int NW, int NS>
__device__ void gdr_bwd9(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                         const bf16_t* __restrict__ d_o, const float* __restrict__ gam_ws,
                         const bf16_t* __restrict__ w_ws, const bf16_t* __restrict__ a_ws,
                         const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                         const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                         const float* __restrict__ dht, float* __restrict__ dh_ws, bf16_t* __restrict__ dh16_ws,
                         float* __restrict__ dd_ws, float* __restrict__ dh0) {
#if __CUDA_ARCH__ >= 900
    typedef V6G<DK, NW / 2> L;
    constexpr int BV = 8 * NW, DH = DK / 2, XB = 4 * 32 * 16;
    constexpr unsigned BAR_OFF = NS * L::STAGE + NW * XB;
    static_assert(NW == 2 || NW == 4 || NW == 8, "1, 2 or 4 warp pairs");
    static_assert(NS == 2 || NS == 3, "2 or 3 stages");
    static_assert(BAR_OFF % 8 == 0, "mbarriers 8-byte aligned");
    if (dyn_smem_bytes() < BAR_OFF + 16u * NS) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const unsigned full0 = smem_addr(sm + BAR_OFF), empty0 = full0 + 8u * NS;
    const int nvt = dv / BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r = lane & 7;
    const i64 col0 = (i64)vt * BV;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;
    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            acp_mbar_init(full0 + 8u * s, 32);
            acp_mbar_init(empty0 + 8u * s, NW);
        }
        acp_fence_mbar_init();
    }
    // The only CTA-wide barrier: the mbarriers are initialized before anyone uses them.
    __syncthreads();

    if (warp >= NW) {
        // The producer: chunk i of the reverse walk into stage i % NS once the stage's previous
        // chunk is released.
        int stg = 0;
        unsigned eph = 1;  // parity of the empty phase to wait for (the previous round's)
        for (i64 c = c_end - 1; c >= c_beg; --c) {
            if (c_end - 1 - c >= NS) acp_mbar_wait(empty0 + 8u * stg, eph);
            const i64 cb = c * hv_n + hv;
            const i64 t0 = ch_t0[c];
            v8g_copy_stage<DK, BV, 32, 4>(sm + stg * L::STAGE, lane, k + t0 * krow + (i64)kh * DK,
                                   q + t0 * krow + (i64)kh * DK, krow, ch_len[c], w_ws + cb * GDR_C * DK,
                                   a_ws + cb * GDR_C * GDR_C, d_o + t0 * vrow + (i64)hv * dv + col0, vrow,
                                   gam_ws + cb * GDR_C);
            acp_cp_async_arrive_noinc(full0 + 8u * stg);
            if (++stg == NS) {
                stg = 0;
                eph ^= 1u;
            }
        }
        // Leave no copy in flight behind an exiting thread.
        cp_async_wait_all();
        return;
    }

    const int cg = warp >> 1, hh = warp & 1, bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + NS * L::STAGE + warp * XB);
    float4* xot = reinterpret_cast<float4*>(sm + NS * L::STAGE + (warp ^ 1) * XB);
    const int wc0 = 16 * cg, r0 = DH * hh;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;

    // s[nt][c] = dS[r0 + 8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = dht ? dht[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                           : 0.f;

    const float inv_scale = 1.f / scale;
    int stg = 0;
    unsigned fph = 0;  // parity of the full phase to wait for
    int l_next = c_end > c_beg ? ch_len[c_end - 1] : 0;
    for (i64 c = c_end - 1; c >= c_beg; --c) {
        const int l = l_next;
        if (c > c_beg) l_next = ch_len[c - 1];
        acp_mbar_wait(full0 + 8u * stg, fph);  // chunk c's copies have landed
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF) + r0;
        const bf16_t* sW = reinterpret_cast<const bf16_t*>(sp + L::W_OFF) + r0;
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const bf16_t* sO = reinterpret_cast<const bf16_t*>(sp + L::O_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;

        // dh[c] = dS (this warp's rows).
        v6_store_state<DH>(s, dh_ws, dh16_ws, cb * (i64)DK * dv + (i64)r0 * dv + col0 + wc0 + g, dv);

        float x[8][4];
        {
            unsigned sa[DH / 16][4];
            v6_s_frags<DH>(s, sa);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) x[j][cc] = 0.f;
            v6_mul_rows_t<DH>(x, sa, sK, L::LK);
        }
        const float gl = sG[l - 1];
        v8g_scale_x<0>(x, sG, l, gl, inv_scale);
        unsigned of[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldsm_x4_t(of[kk], sO + (16 * kk + 8 * (mi >> 1) + r) * L::LO + wc0 + 8 * (mi & 1));
        unsigned nd[4][4];
        float* ddc = dd_ws + cb * GDR_C * (i64)dv + col0 + wc0 + g;
        if (hh) v8g_dd<1>(x, of, sA, L::LA, scale, ddc, dv, xme, xot, bar, nd);
        else v8g_dd<0>(x, of, sA, L::LA, scale, ddc, dv, xme, xot, bar, nd);
        v8g_scale_o<0>(of, sG, l, scale);
        const float egl = __expf(gl);
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) s[nt][cc] *= egl;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int np = 0; np < DH / 16; ++np) {
                unsigned bq[4], bw[4];
                ldsm_x4_t(bq, sQ + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                ldsm_x4_t(bw, sW + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                mma_bf16(s[2 * np], of[kk], bq[0], bq[1]);
                mma_bf16(s[2 * np + 1], of[kk], bq[2], bq[3]);
                mma_bf16(s[2 * np], nd[kk], bw[0], bw[1]);
                mma_bf16(s[2 * np + 1], nd[kk], bw[2], bw[3]);
            }
        // This warp is done with the stage; release it to the producer.
        __syncwarp();
        if (lane == 0) acp_mbar_arrive(empty0 + 8u * stg);
        if (++stg == NS) {
            stg = 0;
            fph ^= 1u;
        }
    }
    if (dh0) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                dh0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
#endif
}

#define GDR_BWD9_ENTRY(DK, NW, NS)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * (NW + 1), 1) gdr_bwd9_d##DK##_w##NW##_s##NS(       \
        const bf16_t* q, const bf16_t* k, const bf16_t* d_o, const float* gam_ws, const bf16_t* w_ws,   \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* dht, float* dh_ws, bf16_t* dh16_ws, float* dd_ws,             \
        float* dh0) {                                                                                   \
        gdr_bwd9<DK, NW, NS>(q, k, d_o, gam_ws, w_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale,   \
                             dht, dh_ws, dh16_ws, dd_ws, dh0);                                          \
    }

// Shared memory: gdr_bwd8's + 16 NS bytes (Dk 128, NS 2: w2 133,664; w4 141,856; w8 158,240).
GDR_BWD9_ENTRY(64, 2, 2)
GDR_BWD9_ENTRY(64, 4, 2)
GDR_BWD9_ENTRY(64, 8, 2)
GDR_BWD9_ENTRY(128, 2, 2)
GDR_BWD9_ENTRY(128, 4, 2)
GDR_BWD9_ENTRY(128, 8, 2)
GDR_BWD9_ENTRY(128, 4, 3)

// =============================================================================================
// gdr_grad8 (issue 13, opt-in `set_grad8` / GDN_RULE_GRAD=v8): gdr_grad7's per-chunk gradients
// (same inputs, outputs and grid: one CTA of 8 warps per (chunk, key head) walking the GVA
// group's value heads in order) in 110.5 KB of shared memory and <= 128 registers, so two CTAs
// run on an SM and one CTA's global round trips and serial steps hide behind the other's mma.
// What changes against gdr_grad7 (see bench/notes/h-grad8.md):
//   - six bf16 slots reused between the phases instead of every operand at once (gdr_grad7:
//     204.7 KB). Per value head: [dO, dD, h, D] -> dq, dW (dW into the free slot); dh over h
//     (through registers, <h, dh> from the same positions) -> dk; Q, K over dh (cp.async, in
//     flight during dA = dO D^T) -> A = Q K^T; G over dO, V over D, T over Q (its loads in
//     flight during G K, G^T Q);
//   - no fp32 64 x 64 matrices in shared memory: A, dA, E = dA * A, K K^T and dM stay in the
//     mma fragments (the same products and formulas as gdr_grad7, element by element), and the
//     row / column sums of E and of the dM terms are reduced from the fragments (quad / column
//     shuffles and 2 or 4 partials per row or column) instead of 64-step loops by 64 threads;
//     the symmetric dP is written to both triangles by the owner of its lower element;
//   - dgam, dbeta live in registers of threads 0 .. 63; dg's reverse cumsum is a warp scan.
// Products, their operands, k order and fragment mapping are gdr_grad7's, and dq, dk, dv are
// accumulated in its order: dq, dk, dv are bitwise gdr_grad7's. dg, dbeta: the same terms
// summed in another order. No atomics; every sum has a fixed order.

template <int DK, int DV>
struct G8 {
    static constexpr int LK = DK + 8, LV = DV + 8, LC = GDR_C + 8;
    static constexpr int S0 = 0;                           // dO, then G, then dT, then dP
    static constexpr int S1 = S0 + GDR_C * LV * 2;         // dD, then T^T dT
    static constexpr int HQ = S1 + GDR_C * LV * 2;         // h, then dh, then Q | K; T over Q
    static constexpr int HQ_N = DK * LV > 2 * GDR_C * LK ? DK * LV : 2 * GDR_C * LK;
    static constexpr int K_OFF = HQ + GDR_C * LK * 2;
    static constexpr int S4 = HQ + HQ_N * 2;               // D, then V
    static constexpr int S5 = S4 + GDR_C * LV * 2;         // dW
    static constexpr int VEC = S5 + GDR_C * LK * 2;        // fp32 vectors and row / column partials
    static constexpr int NVEC = 7 * GDR_C + 32 + 16 * GDR_C;
    static constexpr int BYTES = VEC + NVEC * 4;
};

// threadIdx.x through a volatile asm: address arithmetic derived from it is recomputed where it
// is used instead of being shared between products and kept live (128 registers).
// O false: plain threadIdx.x (the choice per instantiation that ptxas spills least with).
template <bool O>
__device__ __forceinline__ int g8_tid() {
    if (!O) return threadIdx.x;
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// Column sums of a 64 x 64 product held as NT8 = 4 fragments: the lane's two rows, then the
// 8 lanes of a column (xor 4, 8, 16); lanes 0 .. 3 write part[64 (warp & 3) + column]. The
// column's sum is then part[c] + part[64 + c] + part[128 + c] + part[192 + c].
template <bool O>
__device__ __forceinline__ void g8_colsum(const float (&v)[4][4], float* part) {
    const int tq = g8_tid<O>(), warp = tq >> 5, g = (tq & 31) >> 2, t = tq & 3;
    const int c0 = (warp >> 2) * 32 + 2 * t;
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float s = v[n][e] + v[n][2 + e];
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            if (g == 0) part[GDR_C * (warp & 3) + c0 + 8 * n + e] = s;
        }
}

// p through an empty asm: the compiler cannot share address arithmetic derived from p between
// two uses (it would keep it live, in registers it does not have, across the whole value head).
template <typename T>
__device__ __forceinline__ T* g8_opq(T* p) {
    asm volatile("" : "+l"(p));
    return p;
}

// g6_rows16 with compile-time counts (unrolled: its index math folds into constants).
template <int ROWS, int N>
__device__ __forceinline__ void g8_rows16(bf16_t* dst, int ls, const bf16_t* src, i64 gs, int l) {
    constexpr int PER = N / 8, IT = ROWS * PER / GDR_NT;
    static_assert(ROWS * PER % GDR_NT == 0, "g8_rows16: whole iterations");
#pragma unroll
    for (int u = 0; u < IT; ++u) {
        const int e = threadIdx.x + u * GDR_NT, i = e / PER, x = (e - i * PER) * 8;
        const bool ok = i < l;
        cp_async16(dst + i * ls + x, src + (ok ? (i64)i : 0) * gs + x, ok);
    }
}

// g7_rowdot with the loads in two halves of the columns (register pressure); the same
// products summed in the same order (the same bits).
template <bool O, int NT8, typename TX>
__device__ __forceinline__ void g8_rowdot(const float (&acc)[NT8][4], float* part, const TX* x, i64 rs, int l) {
    const int tid = g8_tid<O>(), lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
    constexpr int H = NT8 > 4 ? NT8 / 2 : NT8;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int n0 = 0; n0 < NT8; n0 += H) {
        float2 u0[H], u1[H];
#pragma unroll
        for (int n = 0; n < H; ++n) {
            u0[n] = r0 < l ? g7_ld2(x, r0 * rs + c0 + 8 * (n0 + n)) : make_float2(0.f, 0.f);
            u1[n] = r0 + 8 < l ? g7_ld2(x, (r0 + 8) * rs + c0 + 8 * (n0 + n)) : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int n = 0; n < H; ++n) {
            if (r0 < l) {
                s0 += acc[n0 + n][0] * u0[n].x;
                s0 += acc[n0 + n][1] * u0[n].y;
            }
            if (r0 + 8 < l) {
                s1 += acc[n0 + n][2] * u1[n].x;
                s1 += acc[n0 + n][3] * u1[n].y;
            }
        }
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (t == 0) {
        part[GDR_C * (warp >> 2) + r0] = s0;
        part[GDR_C * (warp >> 2) + r0 + 8] = s1;
    }
}

// g6_mma (the same ldmatrix fragments and mma order: the same bits) with its lane offsets from
// g8_tid().
template <int NT8, bool AT, bool BT, bool O>
__device__ __forceinline__ void g8_mma(float (&acc)[NT8][4], const bf16_t* a, int lda, const bf16_t* b, int ldb,
                                       int kdim) {
    const int tid = g8_tid<O>(), lane = tid & 31, warp = tid >> 5, mi = lane >> 3, r = lane & 7;
    const int rt = 16 * (warp & 3), col0 = (warp >> 2) * (8 * NT8);
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        unsigned af[4];
        if (AT) ldsm_x4_t(af, a + (k0 + 8 * (mi >> 1) + r) * lda + rt + 8 * (mi & 1));
        else ldsm_x4(af, a + (rt + 8 * (mi & 1) + r) * lda + k0 + 8 * (mi >> 1));
#pragma unroll
        for (int np = 0; np < NT8 / 2; ++np) {
            const int n0 = col0 + 16 * np;
            unsigned bb[4];
            if (BT) ldsm_x4(bb, b + (n0 + 8 * (mi >> 1) + r) * ldb + k0 + 8 * (mi & 1));
            else ldsm_x4_t(bb, b + (k0 + 8 * (mi & 1) + r) * ldb + n0 + 8 * (mi >> 1));
            mma_bf16(acc[2 * np], af, bb[0], bb[1]);
            mma_bf16(acc[2 * np + 1], af, bb[2], bb[3]);
        }
    }
}

// g7_accum (the same sums in the same order: the same bits) with its offsets from g8_tid<O>().
template <bool O, int NT8>
__device__ __forceinline__ void g8_accum(const float (&acc)[NT8][4], float* mem, i64 rs, int l, bool first) {
    const int tid = g8_tid<O>(), lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
#pragma unroll
    for (int n0 = 0; n0 < NT8; n0 += NT8 / 2) {
        float2 old[NT8 / 2][2];
#pragma unroll
        for (int n = 0; n < NT8 / 2; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = r0 + 8 * h;
                old[n][h] = make_float2(0.f, 0.f);
                if (!first && i < l) old[n][h] = *reinterpret_cast<const float2*>(mem + i * rs + c0 + 8 * (n0 + n));
            }
#pragma unroll
        for (int n = 0; n < NT8 / 2; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = r0 + 8 * h;
                if (i < l)
                    *reinterpret_cast<float2*>(mem + i * rs + c0 + 8 * (n0 + n)) =
                        make_float2(old[n][h].x + acc[n0 + n][2 * h], old[n][h].y + acc[n0 + n][2 * h + 1]);
            }
    }
}

// g7_map, g6_epi, g7_rowsum (the same elements, values and sums) with offsets from g8_tid<O>().
template <bool O, int NT8, class F>
__device__ __forceinline__ void g8_map(float (&acc)[NT8][4], F f) {
    const int tq = g8_tid<O>(), g = (tq & 31) >> 2, t = tq & 3;
    const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * (8 * NT8) + 2 * t;
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(r0 + 8 * (c >> 1), c0 + 8 * n + (c & 1), acc[n][c]);
}
template <bool O, int NT8, class F>
__device__ __forceinline__ void g8_epi(const float (&acc)[NT8][4], F f) {
    const int tq = g8_tid<O>(), g = (tq & 31) >> 2, t = tq & 3;
    const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * (8 * NT8) + 2 * t;
#pragma unroll
    for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(r0 + 8 * (c >> 1), c0 + 8 * n + (c & 1), acc[n][c]);
}
template <bool O, int NT8, class F>
__device__ __forceinline__ void g8_rowsum(const float (&acc)[NT8][4], float* part, F f) {
    const int tq = g8_tid<O>(), g = (tq & 31) >> 2, t = tq & 3, warp = tq >> 5;
    const int r0 = 16 * (warp & 3) + g, c0 = (warp >> 2) * (8 * NT8) + 2 * t;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int n = 0; n < NT8; ++n) {
        s0 += f(r0, c0 + 8 * n, acc[n][0]);
        s0 += f(r0, c0 + 8 * n + 1, acc[n][1]);
        s1 += f(r0 + 8, c0 + 8 * n, acc[n][2]);
        s1 += f(r0 + 8, c0 + 8 * n + 1, acc[n][3]);
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (t == 0) {
        part[GDR_C * (warp >> 2) + r0] = s0;
        part[GDR_C * (warp >> 2) + r0 + 8] = s1;
    }
}

// g7_rows32 in two halves: the loads into registers, later the bf16 stores.
template <int N>
struct G8Rows32 {
    static constexpr int PER = N / 4, IT = GDR_C * PER / GDR_NT;
    float4 v[IT];
    __device__ __forceinline__ void load(const float* src, i64 gs) {
#pragma unroll
        for (int u = 0; u < IT; ++u) {
            const int e = threadIdx.x + u * GDR_NT, i = e / PER, x = (e - i * PER) * 4;
            v[u] = *reinterpret_cast<const float4*>(src + (i64)i * gs + x);
        }
    }
    __device__ __forceinline__ void store(bf16_t* dst, int ls) const {
#pragma unroll
        for (int u = 0; u < IT; ++u) {
            const int e = threadIdx.x + u * GDR_NT, i = e / PER, x = (e - i * PER) * 4;
            *reinterpret_cast<uint2*>(dst + i * ls + x) = make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
        }
    }
};

__device__ __forceinline__ float g8_dot2(unsigned a, unsigned b) {
    return __uint_as_float(a << 16) * __uint_as_float(b << 16) +
           __uint_as_float(a & 0xffff0000u) * __uint_as_float(b & 0xffff0000u);
}

// dh (DK x DV bf16, row stride DV in memory) over h (shared, row stride ls): every load of the
// thread is issued first; the thread then reads h at the positions it overwrites (no other
// thread reads h any more) and returns the block's <h, dh> (block_sum: synchronizes, so dh is
// visible to every thread on return).
template <int DK, int DV>
__device__ __forceinline__ float g8_swap_dh(bf16_t* sh, int ls, const bf16_t* src, float* red) {
    constexpr int PER = DV / 8, IT = DK * PER / GDR_NT;
    static_assert(DK * PER % GDR_NT == 0, "g8_swap_dh: whole iterations");
    uint4 u[IT];
#pragma unroll
    for (int it = 0; it < IT; ++it) {
        const int e = threadIdx.x + it * GDR_NT, i = e / PER, x = (e - i * PER) * 8;
        u[it] = *reinterpret_cast<const uint4*>(src + (i64)i * DV + x);
    }
    float p = 0.f;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
        const int e = threadIdx.x + it * GDR_NT, i = e / PER, x = (e - i * PER) * 8;
        uint4* d = reinterpret_cast<uint4*>(sh + i * ls + x);
        const uint4 h = *d;
        p += g8_dot2(h.x, u[it].x) + g8_dot2(h.y, u[it].y) + g8_dot2(h.z, u[it].z) + g8_dot2(h.w, u[it].w);
        *d = u[it];
    }
    return block_sum(p, red);
}

template <typename TQ, int DK, int DV>
__device__ void gdr_grad8(const bf16_t* __restrict__ q_raw, const bf16_t* __restrict__ k_raw,
                          const TQ* __restrict__ q, const TQ* __restrict__ k, const bf16_t* __restrict__ qb,
                          const bf16_t* __restrict__ kb, const bf16_t* __restrict__ v,
                          const bf16_t* __restrict__ beta, const bf16_t* __restrict__ d_o,
                          const float* __restrict__ gam_ws, const float* __restrict__ t_ws,
                          const bf16_t* __restrict__ h_ws, const bf16_t* __restrict__ dh_ws,
                          const float* __restrict__ d_ws, const float* __restrict__ dd_ws,
                          const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, int hk_n, int hv_n,
                          float scale, int l2norm, float* __restrict__ dqa, float* __restrict__ dka,
                          bf16_t* __restrict__ dq_out, bf16_t* __restrict__ dk_out, bf16_t* __restrict__ dv_out,
                          float* __restrict__ dg, bf16_t* __restrict__ dbeta) {
    typedef G8<DK, DV> L;
    constexpr int dk = DK, dv = DV;
    constexpr bool OPQ = DK == 128 && DV == 128;  // g8_tid's choice: the fewest spills (ptxas 13.0)
    // A launch with too little shared memory writes nothing (tests see the poisoned outputs).
    if (dyn_smem_bytes() < (unsigned)L::BYTES) return;
    constexpr int LK = L::LK, LV = L::LV, LC = L::LC;
    constexpr int NK = DK / 16, NV = DV / 16;  // NT8 of 64 x DK and 64 x DV products

    const i64 b = blockIdx.x;
    const int kh = (int)(b % hk_n);
    const i64 c = b / hk_n;
    const i64 t0 = ch_t0[c];
    const int l = ch_len[c];
    const int ratio = hv_n / hk_n;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;
    const TQ* qc = q + t0 * krow + (i64)kh * dk;
    const TQ* kc = k + t0 * krow + (i64)kh * dk;
    float* dqc = dqa + t0 * krow + (i64)kh * dk;  // the group's fp32 sums, row stride krow
    float* dkc = dka + t0 * krow + (i64)kh * dk;

#pragma unroll 1
    for (int r = 0; r < ratio; ++r) {
        const int hv = kh * ratio + r;
        const i64 cb = c * hv_n + hv;
        const bool first = r == 0;
        const bf16_t* vc = v + t0 * vrow + (i64)hv * dv;
        char* sm = reinterpret_cast<char*>(gdr_smem);
        bf16_t* sO = reinterpret_cast<bf16_t*>(sm + L::S0);  // dO; G; dT; dP
        bf16_t* sG = sO;
        bf16_t* sX = sO;
        bf16_t* sDD = reinterpret_cast<bf16_t*>(sm + L::S1);  // dD; T^T dT
        bf16_t* sY = sDD;
        bf16_t* sH = reinterpret_cast<bf16_t*>(sm + L::HQ);  // h; dh; Q; T
        bf16_t* sQ = sH;
        bf16_t* sT = sH;
        bf16_t* sK = reinterpret_cast<bf16_t*>(sm + L::K_OFF);
        bf16_t* sD = reinterpret_cast<bf16_t*>(sm + L::S4);  // D; V
        bf16_t* sV = sD;
        bf16_t* sW = reinterpret_cast<bf16_t*>(sm + L::S5);
        float* s_gam = reinterpret_cast<float*>(sm + L::VEC);
        float* s_eg = s_gam + GDR_C;
        float* s_ed = s_eg + GDR_C;
        float* s_beta = s_ed + GDR_C;
        float* s_dgam = s_beta + GDR_C;
        float* s_db = s_dgam + GDR_C;
        float* s_tsum = s_db + GDR_C;  // 3 floats: sum t (2 halves), <S0, dS>
        float* s_red = s_tsum + GDR_C;  // 32 floats for block_sum
        float* p_q = s_red + 32;         // [2][64] each
        float* p_k = p_q + 2 * GDR_C;
        float* p_v = p_k + 2 * GDR_C;
        float* p_kb = p_v + 2 * GDR_C;
        float* p_r1 = p_kb + 2 * GDR_C;  // [2][64]: row sums of E, then of the dbeta terms of dM
        float* p_r2 = p_r1 + 2 * GDR_C;  // [2][64]: row sums of the dgam terms of dM
        float* p_c = p_r2 + 2 * GDR_C;   // [4][64]: column sums of E, then of the dgam terms of dM
        __syncthreads();  // the previous value head is done with every slot
        // Stage A: dO, h (cp.async); dD, D (bf16 from registers); gam, beta.
        g8_rows16<GDR_C, DV>(sO, LV, d_o + t0 * vrow + (i64)hv * dv, vrow, l);
        g8_rows16<DK, DV>(sH, LV, h_ws + cb * (i64)dk * dv, dv, DK);
        cp_async_commit();
        g7_rows32<DV>(sDD, LV, dd_ws + cb * GDR_C * (i64)dv, dv);
        g7_rows32<DV>(sD, LV, d_ws + cb * GDR_C * (i64)dv, dv);
        load_gam(gam_ws, cb * GDR_C, l, s_gam, s_eg, s_ed);  // synchronizes
        if (tid < GDR_C) s_beta[tid] = tid < l ? ld(beta, (t0 + tid) * hv_n + hv) : 0.f;
        cp_async_wait_all();
        __syncthreads();
        if (r + 1 < ratio) {  // the next value head's operands into L2 while this one computes
            const i64 cn = cb + 1;
            g7_prefetch(h_ws + cn * (i64)dk * dv, (i64)dk * dv * 2);
            g7_prefetch(dh_ws + cn * (i64)dk * dv, (i64)dk * dv * 2);
            g7_prefetch(d_ws + cn * GDR_C * (i64)dv, (i64)GDR_C * dv * 4);
            g7_prefetch(dd_ws + cn * GDR_C * (i64)dv, (i64)GDR_C * dv * 4);
            g7_prefetch(t_ws + cn * (GDR_C * GDR_C), (i64)GDR_C * GDR_C * 4);
            for (int i = warp; i < l; i += GDR_NT / 32) {
                if (lane < dv / 64) {  // dv * 2 bytes per row: dv / 64 lines
                    const i64 o = (t0 + i) * vrow + (i64)(hv + 1) * dv + 64 * lane;
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(v + o));
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(d_o + o));
                }
            }
        }
        auto gamma = [&](int i, int j) { return expf(s_gam[i] - s_gam[j]); };
        // Thread i < 64 alone updates dgam_i, dbeta_i (s_dgam, s_db).

        // dq += e^gam (scale dO S0^T), its row dot with q; dW = -dD S0^T into the free slot.
        {
            float acc[NK][4];
            g6_zero(acc);
            g8_mma<NK, false, true, OPQ>(acc, sO, LV, sH, LV, dv);
            g7_map(acc, [&](int i, int x, float& a) { a = s_eg[i] * (scale * a); });
            g8_rowdot<OPQ>(acc, p_q, g8_opq(qc), krow, l);
            g8_accum<OPQ>(acc, g8_opq(dqc), krow, l, first);
            g6_zero(acc);
            g8_mma<NK, false, true, OPQ>(acc, sDD, LV, sH, LV, dv);
            g6_epi(acc, [&](int i, int x, float a) { sW[i * LK + x] = f32_to_bf16(-a); });
        }
        __syncthreads();  // h no longer read (but for <h, dh> by the thread overwriting it)
        {
            const float sds = g8_swap_dh<DK, DV>(sH, LV, dh_ws + cb * (i64)dk * dv, s_red);  // synchronizes
            if (tid == 0) s_tsum[2] = sds;
        }
        // dk += e^(gam_L - gam) (D dS^T), its row dot with k.
        {
            float acc[NK][4];
            g6_zero(acc);
            g8_mma<NK, false, true, OPQ>(acc, sD, LV, sH, LV, dv);
            g7_map(acc, [&](int i, int x, float& a) { a = s_ed[i] * a; });
            g8_rowdot<OPQ>(acc, p_k, g8_opq(kc), krow, l);
            g8_accum<OPQ>(acc, g8_opq(dkc), krow, l, first);
        }
        __syncthreads();  // dh no longer read; p_q, p_k complete
        // Q, K over dh (cp.async; in flight during dA's product).
        g8_rows16<GDR_C, DK>(sQ, LK, qb + t0 * krow + (i64)kh * dk, krow, l);
        g8_rows16<GDR_C, DK>(sK, LK, kb + t0 * krow + (i64)kh * dk, krow, l);
        cp_async_commit();
        // dgam_i = <dq_i, q_i> - t_i, t_i = <dk_i, k_i>; dgam_L += sum t + e^gam_L <S0, dS> (below).
        if (tid < GDR_C) {
            const int i = tid;
            const float ti = i < l ? p_k[i] + p_k[GDR_C + i] : 0.f;
            s_dgam[i] = (i < l ? p_q[i] + p_q[GDR_C + i] : 0.f) - ti;
            s_db[i] = 0.f;
            const float ts = warp_sum(ti);
            if (lane == 0) s_tsum[warp] = ts;
        }
        // dA = scale dO D^T (j <= i): E = dA * A (for dgam), G = dA * Gamma (bf16 operand).
        {
            float ad[4][4], aa[4][4];
            g6_zero(ad);
            g8_mma<4, false, true, OPQ>(ad, sO, LV, sD, LV, dv);
            cp_async_wait_all();
            __syncthreads();  // Q, K (and s_tsum) visible
            g6_zero(aa);
            g8_mma<4, false, true, OPQ>(aa, sQ, LK, sK, LK, dk);
            unsigned gp[4][2];
            {
                const int tq = g8_tid<OPQ>(), g = (tq & 31) >> 2, t = tq & 3;
                const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * 32 + 2 * t;
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int i = r0 + 8 * h;
                        unsigned bits = 0;
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int j = c0 + 8 * n + e, cc = 2 * h + e;
                            const bool in = j <= i && i < l;
                            const float a = (j <= i && i < l) ? aa[n][cc] * gamma(i, j) : 0.f;
                            const float x = scale * ad[n][cc];
                            ad[n][cc] = in ? x * a : 0.f;
                            bits |= (unsigned)f32_to_bf16(in ? x * gamma(i, j) : 0.f) << (16 * e);
                        }
                        gp[n][h] = bits;
                    }
            }
            g7_rowsum(ad, p_r1, [&](int, int, float a) { return a; });
            g8_colsum<OPQ>(ad, p_c);
            __syncthreads();  // dO, D no longer read; the E partials complete
            const int tq = g8_tid<OPQ>(), g = (tq & 31) >> 2, t = tq & 3;
            const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * 32 + 2 * t;
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<unsigned*>(sG + (r0 + 8 * h) * LC + c0 + 8 * n) = gp[n][h];
        }
        // V over D (cp.async; waited for before dT).
        g8_rows16<GDR_C, DV>(sV, LV, vc, vrow, l);
        cp_async_commit();
        // T's loads (stored over Q once G K, G^T Q are done).
        if (tid < GDR_C) {
            const int i = tid;
            float dgam = s_dgam[i];
            if (i == l - 1) dgam += expf(s_gam[l - 1]) * s_tsum[2] + (s_tsum[0] + s_tsum[1]);
            const float rs = p_r1[i] + p_r1[GDR_C + i];
            const float cs = (p_c[i] + p_c[GDR_C + i]) + (p_c[2 * GDR_C + i] + p_c[3 * GDR_C + i]);
            s_dgam[i] = dgam + (rs - cs);
        }
        __syncthreads();  // G visible
        // dq += G K ; dk += G^T Q.
        {
            float acc[NK][4];
            g6_zero(acc);
            g8_mma<NK, false, false, OPQ>(acc, sG, LC, sK, LK, GDR_C);
            g8_accum<OPQ>(acc, g8_opq(dqc), krow, l, false);
            g6_zero(acc);
            g8_mma<NK, true, false, OPQ>(acc, sG, LC, sQ, LK, GDR_C);
            g8_accum<OPQ>(acc, g8_opq(dkc), krow, l, false);
        }
        __syncthreads();  // Q, G no longer read
        {
            G8Rows32<GDR_C> tl;
            tl.load(t_ws + cb * (GDR_C * GDR_C), GDR_C);
            tl.store(sT, LC);
        }
        cp_async_wait_all();
        __syncthreads();  // T, V visible
        // dT = dD Vb^T + dW Kb^T, Vb = diag(beta) V, Kb = diag(beta e^gam) K (column scales of dT).
        {
            float a1[4][4], a2[4][4];
            g6_zero(a1);
            g6_zero(a2);
            g8_mma<4, false, true, OPQ>(a1, sDD, LV, sV, LV, dv);
            g8_mma<4, false, true, OPQ>(a2, sW, LK, sK, LK, dk);
            const int tq = g8_tid<OPQ>(), g = (tq & 31) >> 2, t = tq & 3;
            const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * 32 + 2 * t;
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) {
                    const int i = r0 + 8 * (cc >> 1), j = c0 + 8 * n + (cc & 1);
                    const float x = s_beta[j] * a1[n][cc] + (s_beta[j] * s_eg[j]) * a2[n][cc];
                    sX[i * LC + j] = f32_to_bf16(x);
                }
        }
        // dVb = T^T dD: dv = beta dVb (packed bf16 pairs), <dVb_i, v_i>.
        {
            float acc[NV][4];
            g6_zero(acc);
            g8_mma<NV, true, false, OPQ>(acc, sT, LC, sDD, LV, GDR_C);
            g7_rowsum(acc, p_v, [&](int i, int x, float a) { return a * bf16_to_f32(sV[i * LV + x]); });
            const int tq = g8_tid<OPQ>(), g = (tq & 31) >> 2, t = tq & 3;
            const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * (8 * NV) + 2 * t;
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = r0 + 8 * h;
                    if (i < l) {
                        const float bb = s_beta[i];
                        *reinterpret_cast<unsigned*>(dv_out + (t0 + i) * vrow + (i64)hv * dv + c0 + 8 * n) =
                            pack_bf16(bb * acc[n][2 * h], bb * acc[n][2 * h + 1]);
                    }
                }
        }
        // dKb = T^T dW: dk += beta e^gam dKb, <dKb_i, k_i>.
        {
            float acc[NK][4];
            g6_zero(acc);
            g8_mma<NK, true, false, OPQ>(acc, sT, LC, sW, LK, GDR_C);
            g8_rowdot<OPQ>(acc, p_kb, g8_opq(kc), krow, l);
            g7_map(acc, [&](int i, int x, float& a) { a = (s_beta[i] * s_eg[i]) * a; });
            g8_accum<OPQ>(acc, g8_opq(dkc), krow, l, false);
        }
        __syncthreads();  // dT visible; dD, V no longer read; p_v, p_kb complete
        // dbeta += <dVb, v> + e^gam <dKb, k>; dgam += beta e^gam <dKb, k>.
        if (tid < l) {
            const int i = tid;
            const float sv = p_v[i] + p_v[GDR_C + i], sk = p_kb[i] + p_kb[GDR_C + i];
            s_db[i] += sv + s_eg[i] * sk;
            s_dgam[i] += (s_beta[i] * s_eg[i]) * sk;
        }
        // dM = -T^T dT T^T: Y = T^T dT (bf16, over dD), then dM = -(Y T^T) in the fragments.
        {
            float acc[4][4];
            g6_zero(acc);
            g8_mma<4, true, false, OPQ>(acc, sT, LC, sX, LC, GDR_C);
            g6_epi(acc, [&](int m, int n, float a) { sY[m * LC + n] = f32_to_bf16(a); });
        }
        __syncthreads();  // Y visible; dT no longer read
        // M_ij = beta_i P_ij Gamma_ij (j < i), P = K K^T: dbeta_i += sum_j dM_ij P_ij Gamma_ij;
        // f = dM_ij beta_i P_ij Gamma_ij: dgam_i += f, dgam_j -= f; dP_ij = dP_ji = dM_ij beta_i
        // Gamma_ij (bf16, both triangles written by the owner of the lower element; 0 elsewhere).
        {
            float am[4][4], ap[4][4];
            g6_zero(am);
            g6_zero(ap);
            g8_mma<4, false, true, OPQ>(am, sY, LC, sT, LC, GDR_C);
            g8_mma<4, false, true, OPQ>(ap, sK, LK, sK, LK, dk);
            const int tq = g8_tid<OPQ>(), g = (tq & 31) >> 2, t = tq & 3;
            const int r0 = 16 * ((tq >> 5) & 3) + g, c0 = (tq >> 7) * 32 + 2 * t;
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) {
                    const int i = r0 + 8 * (cc >> 1), j = c0 + 8 * n + (cc & 1);
                    float dbv = 0.f, f = 0.f, d = 0.f;
                    if (j < i && i < l) {
                        const float x = -am[n][cc], gm = gamma(i, j);
                        const float pg = ap[n][cc] * gm;
                        dbv = x * pg;
                        f = x * s_beta[i] * pg;
                        d = x * s_beta[i] * gm;
                    }
                    if (j <= i) {
                        const bf16_t db16 = f32_to_bf16(d);
                        sX[i * LC + j] = db16;
                        if (j < i) sX[j * LC + i] = db16;
                    }
                    am[n][cc] = dbv;
                    ap[n][cc] = f;
                }
            g7_rowsum(am, p_r1, [&](int, int, float a) { return a; });
            g7_rowsum(ap, p_r2, [&](int, int, float a) { return a; });
            g8_colsum<OPQ>(ap, p_c);
        }
        __syncthreads();  // dP visible; the dM partials complete
        if (tid < GDR_C) {
            const int i = tid;
            s_db[i] += p_r1[i] + p_r1[GDR_C + i];
            const float fr = p_r2[i] + p_r2[GDR_C + i];
            const float fc = (p_c[i] + p_c[GDR_C + i]) + (p_c[2 * GDR_C + i] + p_c[3 * GDR_C + i]);
            s_dgam[i] += fr - fc;
        }
        // dk += dP_sym K.
        {
            float acc[NK][4];
            g6_zero(acc);
            g8_mma<NK, false, false, OPQ>(acc, sX, LC, sK, LK, GDR_C);
            g8_accum<OPQ>(acc, g8_opq(dkc), krow, l, false);
        }
        __syncthreads();  // s_dgam complete
        // gam = cumsum(g): dg_j = sum_{i >= j} dgam_i (a reverse scan over lanes, two per lane).
        if (warp == 0) {
            const int i0 = 2 * lane;
            const float a0 = i0 < l ? s_dgam[i0] : 0.f, a1 = i0 + 1 < l ? s_dgam[i0 + 1] : 0.f;
            float s = a0 + a1;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float y = __shfl_down_sync(0xffffffffu, s, o);
                if (lane + o < 32) s += y;
            }
            float ex = __shfl_down_sync(0xffffffffu, s, 1);
            if (lane == 31) ex = 0.f;
            if (i0 + 1 < l) dg[(t0 + i0 + 1) * hv_n + hv] = ex + a1;
            if (i0 < l) dg[(t0 + i0) * hv_n + hv] = (ex + a1) + a0;
        }
        if (tid < l) st(dbeta, (t0 + tid) * hv_n + hv, s_db[tid]);
    }
    __syncthreads();  // the group's dq, dk sums are complete (written by other threads)

    // dq, dk through the l2 norm: gdr_grad7's pass (the same bits).
    constexpr int NU = DK / 32, NR = GDR_C / (GDR_NT / 32) / 2;
    for (int which = 0; which < 4; ++which) {
        const int i0 = (GDR_NT / 32) * NR * (which & 1);
        const float* acc = which < 2 ? dqc : dkc;
        const bf16_t* xr = (which < 2 ? q_raw : k_raw) + t0 * krow + (i64)kh * dk;
        bf16_t* out = (which < 2 ? dq_out : dk_out) + t0 * krow + (i64)kh * dk;
        float dy[NR][NU], xv[NR][NU];
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            const int i = i0 + warp + (GDR_NT / 32) * j;
#pragma unroll
            for (int u = 0; u < NU; ++u) {
                const int x = lane + 32 * u;
                dy[j][u] = i < l ? acc[i * krow + x] : 0.f;
                xv[j][u] = (l2norm && i < l) ? ld(xr, i * krow + x) : 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            const int i = i0 + warp + (GDR_NT / 32) * j;
            if (l2norm) {
                float ss = 0.f;
#pragma unroll
                for (int u = 0; u < NU; ++u) ss += xv[j][u] * xv[j][u];
                const float rstd = 1.f / sqrtf(warp_sum(ss) + 1e-6f);
                float d = 0.f;
#pragma unroll
                for (int u = 0; u < NU; ++u) d += dy[j][u] * (xv[j][u] * rstd);
                d = warp_sum(d);
#pragma unroll
                for (int u = 0; u < NU; ++u) dy[j][u] = rstd * (dy[j][u] - (xv[j][u] * rstd) * d);
            }
            if (i < l) {
#pragma unroll
                for (int u = 0; u < NU; ++u) st(out, i * krow + lane + 32 * u, dy[j][u]);
            }
        }
    }
}

// gdr_grad8 (bf16 states; TQ: the q, k the row dots read, as gdr_grad7). Two CTAs per SM.
#define GDR_GRAD8_ENTRY(TQ, S, DK, DV)                                                                  \
    extern "C" __global__ void __launch_bounds__(GDR_NT, 2) gdr_grad8_##S##_d##DK##_v##DV(              \
        const bf16_t* q_raw, const bf16_t* k_raw, const TQ* q, const TQ* k, const bf16_t* qb,           \
        const bf16_t* kb, const bf16_t* v, const bf16_t* beta, const bf16_t* d_o, const float* gam_ws,  \
        const float* t_ws, const bf16_t* h_ws, const bf16_t* dh_ws, const float* d_ws,                  \
        const float* dd_ws, const i64* ch_t0, const int* ch_len, int hk, int hv, float scale,           \
        int l2norm, float* dqa, float* dka, bf16_t* dq_out, bf16_t* dk_out, bf16_t* dv_out, float* dg,  \
        bf16_t* dbeta) {                                                                                \
        gdr_grad8<TQ, DK, DV>(q_raw, k_raw, q, k, qb, kb, v, beta, d_o, gam_ws, t_ws, h_ws, dh_ws, d_ws, \
                              dd_ws, ch_t0, ch_len, hk, hv, scale, l2norm, dqa, dka, dq_out, dk_out,    \
                              dv_out, dg, dbeta);                                                       \
    }

GDR_GRAD8_ENTRY(bf16_t, bf16, 64, 64)
GDR_GRAD8_ENTRY(bf16_t, bf16, 64, 128)
GDR_GRAD8_ENTRY(bf16_t, bf16, 128, 64)
GDR_GRAD8_ENTRY(bf16_t, bf16, 128, 128)
GDR_GRAD8_ENTRY(float, bf16n, 64, 64)
GDR_GRAD8_ENTRY(float, bf16n, 64, 128)
GDR_GRAD8_ENTRY(float, bf16n, 128, 64)
GDR_GRAD8_ENTRY(float, bf16n, 128, 128)

// =============================================================================================
// Row copies into SW128 tiles (gdr_grad10's producer; gdr_grad9, which used them first, was
// removed in session 13: slower than gdr_grad10 at every shape it took).

// rows x n bf16 (n % 8 == 0) global -> SW128 tile of R rows by cp.async from nt threads (this
// one: tid); rows >= l zero-filled.
template <typename TI>
__device__ __forceinline__ void sw_rows16(char* dst, int R, const bf16_t* src, i64 gs, int n, int rows, int l,
                                          TI tid, int nt) {
    const int per = n / 8;
    for (int e = tid; e < rows * per; e += nt) {
        const int i = e / per, x = (e - i * per) * 8;
        const bool ok = i < l;
        cp_async16(dst + wg_tile(R, i, x), src + (ok ? (i64)i : 0) * gs + x, ok);
    }
}

// =============================================================================================
// grad10 (issue 13; the default on sm_90a since session 12, sm_90a only): the per-chunk
// gradients of gdr_grad7 (same inputs and outputs) by a persistent, warp-specialized CTA of four
// warpgroups (512 threads, one CTA per SM) whose products are all wgmma (ops/common/wgmma.cuh)
// on unpadded SW128 bf16 tiles. bench/notes/flashqla-structure.md §5A is the plan.
//   WG0 "q side" (dq accumulator, 64 x Dk fp32, in registers across the value-head group):
//       dW = -dD S0^T (-> sW), dq += e^gam scale dO S0^T (its row dot with q), dq += G K,
//       dVb = T^T dD (dv, <dVb, v>); at the group's end dq through the l2 norm, stored bf16.
//   WG1 "k side" (dk accumulator likewise): dk += e^(gam_L - gam) D dS^T (row dot with k),
//       <S0, dS>, dk += G^T Q, dk += beta e^gam T^T dW (row dot with k), dk += dP K; the l2 norm.
//   WG2 "64 x 64 side": dA = scale dO D^T, A = Q K^T -> E (its row and column sums) and G (-> sG);
//       dT = dD Vb^T + dW Kb^T (-> sX: the dP tile since session 20), T^T dT (-> sX),
//       dM = -(T^T dT) T^T, P = K K^T -> dbeta, dgam terms and dP (-> sP); then each row's dgam
//       and dbeta, the reverse cumsum dg, the stores of dg and dbeta.
//   WG3 producer (56 registers, G10Regs): every operand of the next value head into its single
//       buffer as soon as the buffer's last reader releases it (bf16 tiles by cp.async, the fp32
//       D, dD, T rounded to bf16 through registers), the gate vectors (double-buffered), Q and K
//       once per (chunk, key head): K into buffer it % 2 of two (item it), Q into its one buffer
//       once the item before's last Q product (mid-head) released it, so both land while that
//       item's last products run (session 20; before, one buffer for both, reloaded only after
//       the item's last product, dP K); prefetches one head ahead into L2. Each of its four
//       warps loads its own buffers in its own order (see gdr_grad10).
// No CTA-wide barrier after the start: mbarriers order every hand-off (full: the loading
// producer warp's 32 threads, or a warpgroup's 128 writers; empty: lane 0 of each reading warp after its wgmma
// completed). Phase parity: a barrier used once per value head step s completes phase s, so
// waiters use s & 1 (per (chunk, key head) item it for Q; per s / 2 for the two vector and part
// buffers, per it / 2 for the two K buffers). No barrier can complete a phase twice ahead of its waiter: every full barrier's
// next fill waits for its empty barrier, every empty barrier's next release waits for the fill.
// Results: dq, dk summed over the group in registers in the same head order as gdr_grad7 (whose
// fp32 global partials they replace), the products' sums in the tensor cores' order: dq, dk, dv,
// dg, dbeta agree with gdr_grad7's to rounding (tested against f64), deterministic (no atomics).

// Registers per thread after setmaxnreg (producer / q side / k side / 64 x 64 side; 512 in all,
// 65,536 for 512 threads). RS 0: 56 / 160 / 152 / 144, every variant but one; RS 1: 56 / 168 /
// 160 / 128, gdr_grad10b_bf16_d128_v128 (ptxas serializes its wgmma at RS 0 and spills less at
// RS 1; measured 2.15 -> 2.05 ms at B1 T32768 16/32, session 15, then the caller-normalized
// variant only; since session 17 the one kernel of both norms). The same code and bits either
// way (gdr_grad10b_r0_bf16_d128_v128 keeps RS 0 for the bitwise check).
template <int RS>
struct G10Regs {
    static constexpr int P = 56, Q = RS == 0 ? 160 : 168, K = RS == 0 ? 152 : 160, A = RS == 0 ? 144 : 128;
    static_assert(P + Q + K + A == 512, "the four warpgroups' registers fill the register file");
};

// KB: K's buffers (2 since session 20: item it's K in buffer it & 1, so the next item's K loads
// while this item's last products read it; 1: session 17's layout, kept for the bitwise test).
// With KB 2 the 64 x 64 side's dT scratch (X) is the dP tile (dP is written after X's last read).
template <int DK, int DV, int KB = 2>
struct G10 {
    static_assert(KB == 1 || KB == 2, "one or two K buffers");
    static constexpr int Q_OFF = 0;                            // [64][DK], per item
    static constexpr int K_OFF = Q_OFF + GDR_C * DK * 2;       // KB x [64][DK], per item
    static constexpr int K_BYTES = GDR_C * DK * 2;
    static constexpr int H_OFF = K_OFF + KB * GDR_C * DK * 2;  // S0 [DK][DV]
    static constexpr int DH_OFF = H_OFF + DK * DV * 2;         // dS [DK][DV]
    static constexpr int V_OFF = DH_OFF + DK * DV * 2;         // [64][DV]
    static constexpr int O_OFF = V_OFF + GDR_C * DV * 2;
    static constexpr int D_OFF = O_OFF + GDR_C * DV * 2;
    static constexpr int DD_OFF = D_OFF + GDR_C * DV * 2;
    static constexpr int W_OFF = DD_OFF + GDR_C * DV * 2;      // dW [64][DK]
    static constexpr int T_OFF = W_OFF + GDR_C * DK * 2;       // [64][64]
    static constexpr int G_OFF = T_OFF + GDR_C * GDR_C * 2;
    static constexpr int X_OFF = G_OFF + GDR_C * GDR_C * 2;
    static constexpr int P_OFF = KB == 2 ? X_OFF : X_OFF + GDR_C * GDR_C * 2;
    static constexpr int VEC_OFF = P_OFF + GDR_C * GDR_C * 2;  // 2 x {gam, eg, ed, beta}[64]
    static constexpr int PART_OFF = VEC_OFF + 2 * 4 * GDR_C * 4;  // 2 x {pq, pk, pkb, pv}[64], 2 x 8 red
    // WG2 scratch: column partials [4 warps][64] (E's, then f's), rows [64]: rs(E), db, fr,
    // cs(E)
    static constexpr int S3_OFF = PART_OFF + (2 * 4 * GDR_C + 16) * 4;
    static constexpr int BAR_OFF = S3_OFF + 8 * GDR_C * 4;
    static constexpr int NBAR = KB == 2 ? 32 : 28;
    static constexpr int BYTES = BAR_OFF + NBAR * 8 + 1024;
};

// mbarrier indices (8 bytes each at BAR_OFF)
enum {
    G10_FQK = 0, G10_EQK, G10_FVEC0, G10_FVEC1, G10_EVEC0, G10_EVEC1,
    G10_FH, G10_EH, G10_FDH, G10_EDH, G10_FO, G10_EO, G10_FD, G10_ED, G10_FDD, G10_EDD,
    G10_FV, G10_EV, G10_FT, G10_ET, G10_FW, G10_EW, G10_FG, G10_EG, G10_FP, G10_EP,
    G10_FPART0, G10_FPART1,
    // KB 2: K buffer b's full / empty are G10_FK0 + 2 b / G10_EK0 + 2 b; G10_FQK / G10_EQK then
    // guard Q alone
    G10_FK0, G10_EK0, G10_FK1, G10_EK1
};

// d (64 x N fp32 fragments of this warpgroup, N = 2 R) = (acc ? d : 0) + A B over k < KD, from
// SW128 tiles at shared addresses a (ra rows) and b (rb rows). AT false: A stored [m][k]; true:
// [k][m]. BT true: B stored [n][k]; false: [k][n]. Complete when this returns.
// N0 (a multiple of 64): the product's first column (B's first n).
template <int R, bool AT, bool BT, int KD, int N0 = 0>
__device__ __forceinline__ void g10_mma(float (&d)[R], unsigned a, int ra, unsigned b, int rb, bool acc) {
    const unsigned long long da0 = AT ? wg_desc_mn(a, ra, 0, 0) : wg_desc_k(a, ra, 0);
    const unsigned long long db0 = BT ? wg_desc_k(b + (unsigned)N0 * 128u, rb, 0) : wg_desc_mn(b, rb, 0, N0);
    wg_fence();
#pragma unroll
    for (int k0 = 0; k0 < KD; k0 += 16) {
        const unsigned oa = AT ? (unsigned)(k0 * 128) : (unsigned)((k0 >> 6) * ra * 128 + (k0 & 63) * 2);
        const unsigned ob = BT ? (unsigned)((k0 >> 6) * rb * 128 + (k0 & 63) * 2) : (unsigned)(k0 * 128);
        wg_mma<AT ? 1 : 0, BT ? 0 : 1>(d, wg_desc_add(da0, oa), wg_desc_add(db0, ob), (acc || k0 > 0) ? 1 : 0);
    }
    wg_commit();
    wg_wait<0>();
    wg_hold(d);
}

// f(row, column, value&) over this thread's fragment elements (warp w of the warpgroup: rows
// 16 w + g, + 8; columns c0 + 8 j + 2 t, + 1).
template <int R, class F>
__device__ __forceinline__ void g10_each(float (&d)[R], F f, int c0 = 0) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < R / 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(16 * w + g + 8 * (c >> 1), c0 + 8 * j + 2 * t + (c & 1), d[4 * j + c]);
}

// A compile-time int for the generic lambdas that walk 64-column halves.
template <int N>
struct g10_ic {
    static constexpr int value = N;
};

// Sums of the quad (the 4 lanes of a row): every lane gets the row's total.
__device__ __forceinline__ float g10_quad(float s) {
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    return s;
}

// Row dots of the fragments (columns c0 ..) with the rows < l of the item's normalized q or k:
// its bf16 Q or K tile in shared memory (`tile`, 64 x Dk SW128: the operands of the forward's
// products), added to this lane's partials s0 (row 16 w + g), s1 (row + 8).
template <int R>
__device__ __forceinline__ void g10_rowdot(const float (&d)[R], const char* tile, int l, int c0, float& s0,
                                           float& s1) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * w + g;
#pragma unroll
    for (int j = 0; j < R / 4; ++j) {
        const int c = c0 + 8 * j + 2 * t;
        if (r0 < l) {
            const float2 u = g7_ld2(reinterpret_cast<const bf16_t*>(tile + wg_tile(GDR_C, r0, c)), 0);
            s0 += d[4 * j] * u.x;
            s0 += d[4 * j + 1] * u.y;
        }
        if (r0 + 8 < l) {
            const float2 u = g7_ld2(reinterpret_cast<const bf16_t*>(tile + wg_tile(GDR_C, r0 + 8, c)), 0);
            s1 += d[4 * j + 2] * u.x;
            s1 += d[4 * j + 3] * u.y;
        }
    }
}

// The quad sums of the row partials; lane t == 0 writes out[row].
__device__ __forceinline__ void g10_rows_out(float s0, float s1, float* out) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
    s0 = g10_quad(s0);
    s1 = g10_quad(s1);
    if (t == 0) {
        out[16 * w + g] = s0;
        out[16 * w + g + 8] = s1;
    }
}

// The fragments (64 x N, columns c0 ..) as bf16 (scaled by sc) into an SW128 tile of 64 rows.
template <int R>
__device__ __forceinline__ void g10_store_tile(char* tile, const float (&d)[R], float sc, int c0 = 0) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < R / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<unsigned*>(tile + wg_tile(GDR_C, 16 * w + g + 8 * h, c0 + 8 * j + 2 * t)) =
                pack_bf16(sc * d[4 * j + 2 * h], sc * d[4 * j + 2 * h + 1]);
}

// The l2 norm's backward on the group's dq or dk (fragments, 64 x DK) and the bf16 store of rows
// < l (gdr_grad7's formula: rstd from the raw row, dx = rstd (dy - y <dy, y>), y = x rstd).
template <int R>
__device__ __forceinline__ void g10_l2_store(float (&d)[R], const bf16_t* xr, bf16_t* out, i64 rs, int l,
                                             int l2norm) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = 16 * w + g + 8 * h;
        if (l2norm) {
            float2 x[R / 4];
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < R / 4; ++j) {
                x[j] = i < l ? g7_ld2(xr, i * rs + 8 * j + 2 * t) : make_float2(0.f, 0.f);
                ss += x[j].x * x[j].x;
                ss += x[j].y * x[j].y;
            }
            const float rstd = 1.f / sqrtf(g10_quad(ss) + 1e-6f);
            float dd = 0.f;
#pragma unroll
            for (int j = 0; j < R / 4; ++j) {
                dd += d[4 * j + 2 * h] * (x[j].x * rstd);
                dd += d[4 * j + 2 * h + 1] * (x[j].y * rstd);
            }
            dd = g10_quad(dd);
#pragma unroll
            for (int j = 0; j < R / 4; ++j) {
                d[4 * j + 2 * h] = rstd * (d[4 * j + 2 * h] - (x[j].x * rstd) * dd);
                d[4 * j + 2 * h + 1] = rstd * (d[4 * j + 2 * h + 1] - (x[j].y * rstd) * dd);
            }
        }
        if (i < l) {
#pragma unroll
            for (int j = 0; j < R / 4; ++j)
                *reinterpret_cast<unsigned*>(out + i * rs + 8 * j + 2 * t) =
                    pack_bf16(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
    }
}

// The producer's copies and L2 prefetches are sw_rows16 / g7_prefetch over its 128 threads
// (p = 0 .. 127).
template <int NT = 128>
__device__ __forceinline__ void g10_cp16(char* dst, int R, const bf16_t* src, i64 gs, int n, int rows, int l,
                                         int p) {
    sw_rows16(dst, R, src, gs, n, rows, l, p, NT);
}

// Producer: 64 x N fp32 (row stride gs) -> bf16 SW128 tile [64][N] (round to nearest even),
// four 16-byte pieces in flight per thread; PK: T (N = 64) from its packed copy.
template <int N, bool PK = false, int NT = 128>
__device__ __forceinline__ void g10_cv32(char* dst, const float* src, i64 gs, int p) {
    constexpr int PER = N / 4, IT = GDR_C * PER / NT, U = 4;
    static_assert(IT % U == 0, "g10_cv32: whole batches");
    static_assert(!PK || N == GDR_C, "g10_cv32: the packed form is T's");
#pragma unroll 1
    for (int u0 = 0; u0 < IT; u0 += U) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int e = p + (u0 + u) * NT, i = e / PER, x = (e - i * PER) * 4;
            if constexpr (PK) {
                // T's packed copy (GDR_TP floats: the ten 16 x 16 blocks on or below the
                // diagonal, block (a, b) at a (a + 1) / 2 + b; gs unused): the blocks above the
                // diagonal, zero in the full T, as zeros
                const int a = i >> 4, b = x >> 4;
                v[u] = b > a ? make_float4(0.f, 0.f, 0.f, 0.f)
                             : __ldg(reinterpret_cast<const float4*>(src + (a * (a + 1) / 2 + b) * 256 +
                                                                     (i & 15) * 16 + (x & 15)));
            } else {
                v[u] = __ldg(reinterpret_cast<const float4*>(src + (i64)i * gs + x));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int e = p + (u0 + u) * NT, i = e / PER, x = (e - i * PER) * 4;
            *reinterpret_cast<uint2*>(dst + wg_tile(GDR_C, i, x)) =
                make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
        }
    }
}

// Producer: a 64 x N workspace tile (row stride N) into its bf16 SW128 tile, then the tile's
// full barrier: fp32 rounded through registers (then the proxy fence and a plain arrival), bf16
// by cp.async (an arrival when the copies land).
template <int N, int NT = 128>
__device__ __forceinline__ void g10_load_ws(char* dst, const float* src, int n, int p, unsigned bar) {
    g10_cv32<N, false, NT>(dst, src, n, p);
    acp_fence_proxy_async();
    acp_mbar_arrive(bar);
}
template <int N, int NT = 128>
__device__ __forceinline__ void g10_load_ws(char* dst, const bf16_t* src, int n, int p, unsigned bar) {
    g10_cp16<NT>(dst, GDR_C, src, n, N, GDR_C, GDR_C, p);
    acp_cp_async_arrive_noinc(bar);
}

// lane 0 of each warp arrives (the warp's reads are complete: wgmma waited / values used).
__device__ __forceinline__ void g10_release(unsigned bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) acp_mbar_arrive(bar);
}

__device__ __forceinline__ void g10_wgbar(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// TD: the type of D and dD (float: rounded to bf16 by the producer through registers; bf16:
// written so by gdr_hrec6b / gdr_bwd6b / gdr_bwd8b, copied by cp.async, the same bits).
// The producer: its four warps load disjoint sets of buffers, each warp in its own order (warp 0:
// the gates, S0, dS; 1: D, dO, Q / K; 2: dD, V; 3: T and the L2 prefetch), so a buffer released
// late holds up only its own warp's later copies (before 2026-12-04 its 128 threads loaded every
// buffer in one order: the same bits, checked then by grad10_producer_is_bitwise).
template <int DK, int DV, typename TD = float, int RS = 0, int KB = 2>
__device__ void gdr_grad10(const bf16_t* __restrict__ q_raw, const bf16_t* __restrict__ k_raw,
                           const bf16_t* __restrict__ qb,
                           const bf16_t* __restrict__ kb, const bf16_t* __restrict__ v,
                           const bf16_t* __restrict__ beta, const bf16_t* __restrict__ d_o,
                           const float* __restrict__ gam_ws, const float* __restrict__ t_ws,
                           const float* __restrict__ t_pk, const bf16_t* __restrict__ h_ws,
                           const bf16_t* __restrict__ dh_ws, const TD* __restrict__ d_ws,
                           const TD* __restrict__ dd_ws,
                           const i64* __restrict__ ch_t0, const int* __restrict__ ch_len, i64 n_items,
                           int hk_n, int hv_n, float scale, int l2norm, bf16_t* __restrict__ dq_out,
                           bf16_t* __restrict__ dk_out, bf16_t* __restrict__ dv_out, float* __restrict__ dg,
                           bf16_t* __restrict__ dbeta) {
#if __CUDA_ARCH__ >= 900
    typedef G10<DK, DV, KB> L;
    constexpr int dk = DK, dv = DV;
    // A launch with too little shared memory writes nothing (tests see the poisoned outputs).
    if (dyn_smem_bytes() < (unsigned)L::BYTES) return;
    char* sm0 = reinterpret_cast<char*>(gdr_smem);
    const unsigned a0 = smem_addr(sm0);
    char* sm = sm0 + (((a0 + 1023u) & ~1023u) - a0);
    const unsigned sb = smem_addr(sm);
    const unsigned uQ = sb + L::Q_OFF, uK = sb + L::K_OFF, uH = sb + L::H_OFF, uDH = sb + L::DH_OFF;
    const unsigned uV = sb + L::V_OFF, uO = sb + L::O_OFF, uD = sb + L::D_OFF, uDD = sb + L::DD_OFF;
    const unsigned uW = sb + L::W_OFF, uT = sb + L::T_OFF, uG = sb + L::G_OFF, uX = sb + L::X_OFF;
    const unsigned uP = sb + L::P_OFF;
    float* vec = reinterpret_cast<float*>(sm + L::VEC_OFF);    // [2][4][64]
    float* part = reinterpret_cast<float*>(sm + L::PART_OFF);  // [2][4][64], then red [2][8]
    float* red = part + 2 * 4 * GDR_C;
    float* s3 = reinterpret_cast<float*>(sm + L::S3_OFF);
    const unsigned bar0 = sb + L::BAR_OFF;
    auto B = [&](int i) { return bar0 + 8u * (unsigned)i; };
    // Item it's K: its buffer (KB 2: it & 1), full-barrier wait, and its last reader's release
    // (KB 1: Q and K share G10_FQK / G10_EQK, released once the item's last product is done).
    auto kbuf = [&](int it) { return KB == 2 ? (it & 1) : 0; };
    auto wait_k = [&](int it) {
        if (KB == 2) acp_mbar_wait(B(G10_FK0 + 2 * kbuf(it)), (unsigned)(it >> 1) & 1u);
        else acp_mbar_wait(B(G10_FQK), (unsigned)it & 1u);
    };
    auto release_k = [&](int it) {
        if (KB == 2) g10_release(B(G10_EK0 + 2 * kbuf(it)));
    };
    // Q's last reader's release (KB 2 only; KB 1 releases G10_EQK after the item's last product)
    auto release_q = [&]() {
        if (KB == 2) g10_release(B(G10_EQK));
    };
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const int ratio = hv_n / hk_n;
    const i64 krow = (i64)hk_n * dk, vrow = (i64)hv_n * dv;

    // the producer's arrivals per full barrier: the loading warp's 32 threads
    constexpr int FN = 32;
    if (tid == 0) {
        acp_mbar_init(B(G10_FQK), FN);
        acp_mbar_init(B(G10_EQK), 12);
        for (int i = 0; i < 2; ++i) {
            acp_mbar_init(B(G10_FVEC0 + i), FN);
            acp_mbar_init(B(G10_EVEC0 + i), 12);
            acp_mbar_init(B(G10_FPART0 + i), 256);
        }
        acp_mbar_init(B(G10_FH), FN);
        acp_mbar_init(B(G10_EH), 8);  // WG0 (dW, dq), WG1 (<S0, dS>)
        acp_mbar_init(B(G10_FDH), FN);
        acp_mbar_init(B(G10_EDH), 4);  // WG1
        acp_mbar_init(B(G10_FO), FN);
        acp_mbar_init(B(G10_EO), 8);  // WG0, WG2
        acp_mbar_init(B(G10_FD), FN);
        acp_mbar_init(B(G10_ED), 8);  // WG1, WG2
        acp_mbar_init(B(G10_FDD), FN);
        acp_mbar_init(B(G10_EDD), 8);  // WG0, WG2
        acp_mbar_init(B(G10_FV), FN);
        acp_mbar_init(B(G10_EV), 8);  // WG0 (<dVb, v>), WG2 (dT)
        acp_mbar_init(B(G10_FT), FN);
        acp_mbar_init(B(G10_ET), 12);  // WG0 (dVb), WG1 (dKb), WG2 (T^T dT, dM)
        acp_mbar_init(B(G10_FW), 128);  // WG0
        acp_mbar_init(B(G10_EW), 8);  // WG1, WG2
        acp_mbar_init(B(G10_FG), 128);  // WG2
        acp_mbar_init(B(G10_EG), 8);  // WG0, WG1
        acp_mbar_init(B(G10_FP), 128);  // WG2
        acp_mbar_init(B(G10_EP), 4);  // WG1
        if (KB == 2) {
            for (int b = 0; b < 2; ++b) {
                acp_mbar_init(B(G10_FK0 + 2 * b), FN);
                acp_mbar_init(B(G10_EK0 + 2 * b), 12);  // WG0 (G K), WG1 (dP K), WG2 (K K^T)
            }
        }
        acp_fence_mbar_init();
    }
    // The only CTA-wide barrier: the mbarriers are initialized before anyone uses them.
    __syncthreads();

    if (wg == 3) {
        // ---- producer ----
        acp_setmaxnreg_dec<G10Regs<RS>::P>();
        const int pw = (tid - 384) >> 5;
        int s = 0, it = 0;
        for (i64 bi = blockIdx.x; bi < n_items; bi += gridDim.x, ++it) {
            const int kh = (int)(bi % hk_n);
            const i64 c = bi / hk_n;
            const i64 t0 = ch_t0[c];
            const int l = ch_len[c];
            for (int r = 0; r < ratio; ++r, ++s) {
                const int hv = kh * ratio + r;
                const i64 cb = c * hv_n + hv;
                const unsigned ph = (unsigned)(s - 1) & 1u;
                const int vb = s & 1;
                if (pw == 0) {
                    if (s >= 2) acp_mbar_wait(B(G10_EVEC0 + vb), (unsigned)((s >> 1) - 1) & 1u);
                    float* vv = vec + vb * 4 * GDR_C;
                    for (int e = lane; e < GDR_C; e += 32) {
                        const float gm = gam_ws[cb * GDR_C + e], gl = gam_ws[cb * GDR_C + l - 1];
                        vv[e] = gm;
                        vv[GDR_C + e] = e < l ? expf(gm) : 0.f;
                        vv[2 * GDR_C + e] = e < l ? expf(gl - gm) : 0.f;
                        vv[3 * GDR_C + e] = e < l ? ld(beta, (t0 + e) * hv_n + hv) : 0.f;
                    }
                    acp_mbar_arrive(B(G10_FVEC0 + vb));
                    if (s >= 1) acp_mbar_wait(B(G10_EH), ph);
                    g10_cp16<32>(sm + L::H_OFF, dk, h_ws + cb * (i64)dk * dv, dv, dv, dk, dk, lane);
                    acp_cp_async_arrive_noinc(B(G10_FH));
                    if (s >= 1) acp_mbar_wait(B(G10_EDH), ph);
                    g10_cp16<32>(sm + L::DH_OFF, dk, dh_ws + cb * (i64)dk * dv, dv, dv, dk, dk, lane);
                    acp_cp_async_arrive_noinc(B(G10_FDH));
                } else if (pw == 1) {
                    if (s >= 1) acp_mbar_wait(B(G10_ED), ph);
                    g10_load_ws<DV, 32>(sm + L::D_OFF, d_ws + cb * GDR_C * (i64)dv, dv, lane, B(G10_FD));
                    if (s >= 1) acp_mbar_wait(B(G10_EO), ph);
                    g10_cp16<32>(sm + L::O_OFF, GDR_C, d_o + t0 * vrow + (i64)hv * dv, vrow, dv, GDR_C, l, lane);
                    acp_cp_async_arrive_noinc(B(G10_FO));
                    if (r == 0 && KB == 1) {
                        if (it >= 1) acp_mbar_wait(B(G10_EQK), (unsigned)(it - 1) & 1u);
                        g10_cp16<32>(sm + L::Q_OFF, GDR_C, qb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l, lane);
                        g10_cp16<32>(sm + L::K_OFF, GDR_C, kb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l, lane);
                        acp_cp_async_arrive_noinc(B(G10_FQK));
                    } else if (r == 0) {
                        // K into its buffer (last read by item it - 2), then Q (its last reads are
                        // mid-head: this lands while the previous item's last head finishes)
                        const int b = kbuf(it);
                        if (it >= 2) acp_mbar_wait(B(G10_EK0 + 2 * b), (unsigned)((it >> 1) - 1) & 1u);
                        g10_cp16<32>(sm + L::K_OFF + b * L::K_BYTES, GDR_C, kb + t0 * krow + (i64)kh * dk, krow,
                                     dk, GDR_C, l, lane);
                        acp_cp_async_arrive_noinc(B(G10_FK0 + 2 * b));
                        if (it >= 1) acp_mbar_wait(B(G10_EQK), (unsigned)(it - 1) & 1u);
                        g10_cp16<32>(sm + L::Q_OFF, GDR_C, qb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l, lane);
                        acp_cp_async_arrive_noinc(B(G10_FQK));
                    }
                } else if (pw == 2) {
                    if (s >= 1) acp_mbar_wait(B(G10_EDD), ph);
                    g10_load_ws<DV, 32>(sm + L::DD_OFF, dd_ws + cb * GDR_C * (i64)dv, dv, lane, B(G10_FDD));
                    if (s >= 1) acp_mbar_wait(B(G10_EV), ph);
                    g10_cp16<32>(sm + L::V_OFF, GDR_C, v + t0 * vrow + (i64)hv * dv, vrow, dv, GDR_C, l, lane);
                    acp_cp_async_arrive_noinc(B(G10_FV));
                } else {
                    if (s >= 1) acp_mbar_wait(B(G10_ET), ph);
                    char* tt = sm + L::T_OFF;
                    if (t_pk) g10_cv32<GDR_C, true, 32>(tt, t_pk + cb * GDR_TP, 0, lane);
                    else g10_cv32<GDR_C, false, 32>(tt, t_ws + cb * (GDR_C * GDR_C), GDR_C, lane);
                    acp_fence_proxy_async();
                    acp_mbar_arrive(B(G10_FT));
                    // the next value head's operands into L2
                    i64 nb = bi, nr = r + 1;
                    if (nr == ratio) {
                        nr = 0;
                        nb += gridDim.x;
                    }
                    if (nb < n_items) {
                        const i64 nc = nb / hk_n;
                        const int nhv = (int)(nb % hk_n) * ratio + (int)nr;
                        const i64 ncb = nc * hv_n + nhv;
                        g7_prefetch(h_ws + ncb * (i64)dk * dv, (i64)dk * dv * 2, lane, 32);
                        g7_prefetch(dh_ws + ncb * (i64)dk * dv, (i64)dk * dv * 2, lane, 32);
                        g7_prefetch(d_ws + ncb * GDR_C * (i64)dv, (i64)GDR_C * dv * sizeof(TD), lane, 32);
                        g7_prefetch(dd_ws + ncb * GDR_C * (i64)dv, (i64)GDR_C * dv * sizeof(TD), lane, 32);
                        if (t_pk) g7_prefetch(t_pk + ncb * GDR_TP, (i64)GDR_TP * 4, lane, 32);
                        else g7_prefetch(t_ws + ncb * (GDR_C * GDR_C), (i64)GDR_C * GDR_C * 4, lane, 32);
                    }
                }
            }
        }
        // Leave no copy in flight behind an exiting thread.
        cp_async_wait_all();
        return;
    }

    if (wg == 0) {
        // ---- q side ----
        acp_setmaxnreg_inc<G10Regs<RS>::Q>();
        float dq[DK / 2];
        int s = 0, it = 0;
        for (i64 bi = blockIdx.x; bi < n_items; bi += gridDim.x, ++it) {
            const int kh = (int)(bi % hk_n);
            const i64 c = bi / hk_n;
            const i64 t0 = ch_t0[c];
            const int l = ch_len[c];
            for (int r = 0; r < ratio; ++r, ++s) {
                const unsigned ph = (unsigned)s & 1u;
                const int vb = s & 1;
                const float* s_eg = vec + vb * 4 * GDR_C + GDR_C;
                acp_mbar_wait(B(G10_FVEC0 + vb), (unsigned)(s >> 1) & 1u);
                acp_mbar_wait(B(G10_FH), ph);
                acp_mbar_wait(B(G10_FDD), ph);
                wg_fence_proxy();
                // dW = -dD S0^T -> sW, by 64-column halves (register pressure: dq is live)
                auto dw_half = [&](auto hc) {
                    constexpr int N0 = decltype(hc)::value * 64;
                    float a[32];
                    g10_mma<32, false, true, DV, N0>(a, uDD, GDR_C, uH, dk, false);
                    if (N0 == 0 && s >= 1) acp_mbar_wait(B(G10_EW), (unsigned)(s - 1) & 1u);
                    g10_store_tile(sm + L::W_OFF, a, -1.f, N0);
                };
                dw_half(g10_ic<0>());
                if (DK == 128) dw_half(g10_ic<1>());
                wg_fence_proxy();
                acp_mbar_arrive(B(G10_FW));
                acp_mbar_wait(B(G10_FO), ph);
                wg_fence_proxy();
                // (the row dot reads the Q tile)
                if (r == 0) acp_mbar_wait(B(G10_FQK), (unsigned)it & 1u);
                {
                    // dq += e^gam scale dO S0^T (its row dot with q), by halves
                    float s0 = 0.f, s1 = 0.f;
                    auto dq_half = [&](auto hc) {
                        constexpr int N0 = decltype(hc)::value * 64;
                        float a[32];
                        g10_mma<32, false, true, DV, N0>(a, uO, GDR_C, uH, dk, false);
                        g10_each(a, [&](int i, int x, float& e) { e = s_eg[i] * (scale * e); });
                        g10_rowdot(a, sm + L::Q_OFF, l, N0, s0, s1);
#pragma unroll
                        for (int e = 0; e < 32; ++e) dq[N0 / 2 + e] = r == 0 ? a[e] : dq[N0 / 2 + e] + a[e];
                    };
                    dq_half(g10_ic<0>());
                    if (DK == 128) dq_half(g10_ic<1>());
                    g10_release(B(G10_EH));
                    g10_release(B(G10_EO));
                    if (r == ratio - 1) release_q();
                    g10_rows_out(s0, s1, part + vb * 4 * GDR_C);
                }
                acp_mbar_wait(B(G10_FG), ph);
                if (r == 0) wait_k(it);
                wg_fence_proxy();
                g10_mma<DK / 2, false, false, GDR_C>(dq, uG, GDR_C, uK + kbuf(it) * L::K_BYTES, GDR_C,
                                                     true);  // dq += G K
                g10_release(B(G10_EG));
                if (r == ratio - 1) release_k(it);
                // dVb = T^T dD: dv = beta dVb, <dVb, v> (here, not in WG2, whose chain is the
                // longest), by halves
                acp_mbar_wait(B(G10_FT), ph);
                acp_mbar_wait(B(G10_FV), ph);
                wg_fence_proxy();
                {
                    const int hv = kh * ratio + r;
                    const float* s_beta = vec + vb * 4 * GDR_C + 3 * GDR_C;
                    const char* tV = sm + L::V_OFF;
                    float s0 = 0.f, s1 = 0.f;
                    const int r0 = 16 * w + g;
                    auto dv_half = [&](auto hc) {
                        constexpr int N0 = decltype(hc)::value * 64;
                        float a[32];
                        g10_mma<32, true, false, GDR_C, N0>(a, uT, GDR_C, uDD, GDR_C, false);
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const int x = N0 + 8 * j + 2 * t;
                            const float2 v0 = g7_ld2(reinterpret_cast<const bf16_t*>(tV + wg_tile(GDR_C, r0, x)), 0);
                            const float2 v1 =
                                g7_ld2(reinterpret_cast<const bf16_t*>(tV + wg_tile(GDR_C, r0 + 8, x)), 0);
                            s0 += a[4 * j] * v0.x;
                            s0 += a[4 * j + 1] * v0.y;
                            s1 += a[4 * j + 2] * v1.x;
                            s1 += a[4 * j + 3] * v1.y;
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int i = r0 + 8 * h;
                            if (i < l) {
                                const float bb = s_beta[i];
#pragma unroll
                                for (int j = 0; j < 8; ++j)
                                    *reinterpret_cast<unsigned*>(dv_out + (t0 + i) * vrow + (i64)hv * dv + N0 + 8 * j +
                                                                 2 * t) =
                                        pack_bf16(bb * a[4 * j + 2 * h], bb * a[4 * j + 2 * h + 1]);
                            }
                        }
                    };
                    dv_half(g10_ic<0>());
                    if (DV == 128) dv_half(g10_ic<1>());
                    g10_release(B(G10_EDD));
                    g10_release(B(G10_EV));
                    g10_release(B(G10_ET));
                    g10_rows_out(s0, s1, part + vb * 4 * GDR_C + 3 * GDR_C);
                }
                g10_release(B(G10_EVEC0 + vb));
                acp_mbar_arrive(B(G10_FPART0 + vb));
                if (r == ratio - 1) {
                    if (KB == 1) g10_release(B(G10_EQK));
                    g10_l2_store(dq, q_raw + t0 * krow + (i64)kh * dk, dq_out + t0 * krow + (i64)kh * dk, krow, l,
                                 l2norm);
                }
            }
        }
        return;
    }

    if (wg == 1) {
        // ---- k side ----
        acp_setmaxnreg_inc<G10Regs<RS>::K>();
        float dkr[DK / 2];
        int s = 0, it = 0;
        for (i64 bi = blockIdx.x; bi < n_items; bi += gridDim.x, ++it) {
            const int kh = (int)(bi % hk_n);
            const i64 c = bi / hk_n;
            const i64 t0 = ch_t0[c];
            const int l = ch_len[c];
            for (int r = 0; r < ratio; ++r, ++s) {
                const unsigned ph = (unsigned)s & 1u;
                const int vb = s & 1;
                const float* vv = vec + vb * 4 * GDR_C;
                float* pp = part + vb * 4 * GDR_C;
                acp_mbar_wait(B(G10_FVEC0 + vb), (unsigned)(s >> 1) & 1u);
                acp_mbar_wait(B(G10_FD), ph);
                acp_mbar_wait(B(G10_FDH), ph);
                wg_fence_proxy();
                // (the row dot reads the K tile)
                if (r == 0) wait_k(it);
                const char* tK = sm + L::K_OFF + kbuf(it) * L::K_BYTES;
                {
                    // dk += e^(gam_L - gam) D dS^T (its row dot with k), by halves
                    float s0 = 0.f, s1 = 0.f;
                    auto dk_half = [&](auto hc) {
                        constexpr int N0 = decltype(hc)::value * 64;
                        float a[32];
                        g10_mma<32, false, true, DV, N0>(a, uD, GDR_C, uDH, dk, false);
                        g10_each(a, [&](int i, int x, float& e) { e = vv[2 * GDR_C + i] * e; });
                        g10_rowdot(a, tK, l, N0, s0, s1);
#pragma unroll
                        for (int e = 0; e < 32; ++e) dkr[N0 / 2 + e] = r == 0 ? a[e] : dkr[N0 / 2 + e] + a[e];
                    };
                    dk_half(g10_ic<0>());
                    if (DK == 128) dk_half(g10_ic<1>());
                    g10_release(B(G10_ED));
                    g10_rows_out(s0, s1, pp + GDR_C);
                }
                // <S0, dS>: h and dh share the layout, so corresponding elements pair up
                acp_mbar_wait(B(G10_FH), ph);
                {
                    const char* tH = sm + L::H_OFF;
                    const char* tDH = sm + L::DH_OFF;
                    float pz = 0.f;
                    for (int e = tid - 128; e < dk * dv / 8; e += 128) {
                        const uint4 x = reinterpret_cast<const uint4*>(tH)[e];
                        const uint4 y = reinterpret_cast<const uint4*>(tDH)[e];
                        const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
                        for (int u = 0; u < 4; ++u) {
                            pz += __uint_as_float(xs[u] << 16) * __uint_as_float(ys[u] << 16);
                            pz += __uint_as_float(xs[u] & 0xffff0000u) * __uint_as_float(ys[u] & 0xffff0000u);
                        }
                    }
                    pz = warp_sum(pz);
                    g10_release(B(G10_EH));
                    g10_release(B(G10_EDH));
                    if (lane == 0) red[vb * 8 + w] = pz;
                    g10_wgbar(2);
                    if (tid == 128) red[vb * 8 + 4] = (red[vb * 8] + red[vb * 8 + 1]) + (red[vb * 8 + 2] + red[vb * 8 + 3]);
                }
                acp_mbar_wait(B(G10_FG), ph);
                if (r == 0) acp_mbar_wait(B(G10_FQK), (unsigned)it & 1u);
                wg_fence_proxy();
                g10_mma<DK / 2, true, false, GDR_C>(dkr, uG, GDR_C, uQ, GDR_C, true);  // dk += G^T Q
                g10_release(B(G10_EG));
                if (r == ratio - 1) release_q();
                acp_mbar_wait(B(G10_FW), ph);
                acp_mbar_wait(B(G10_FT), ph);
                wg_fence_proxy();
                {
                    // dKb = T^T dW: <dKb, k>, dk += beta e^gam dKb, by halves
                    float s0 = 0.f, s1 = 0.f;
                    auto kb_half = [&](auto hc) {
                        constexpr int N0 = decltype(hc)::value * 64;
                        float a[32];
                        g10_mma<32, true, false, GDR_C, N0>(a, uT, GDR_C, uW, GDR_C, false);
                        g10_rowdot(a, tK, l, N0, s0, s1);
                        g10_each(a, [&](int i, int x, float& e) { e = (vv[3 * GDR_C + i] * vv[GDR_C + i]) * e; });
#pragma unroll
                        for (int e = 0; e < 32; ++e) dkr[N0 / 2 + e] += a[e];
                    };
                    kb_half(g10_ic<0>());
                    if (DK == 128) kb_half(g10_ic<1>());
                    g10_release(B(G10_ET));
                    g10_release(B(G10_EW));
                    g10_rows_out(s0, s1, pp + 2 * GDR_C);
                }
                g10_release(B(G10_EVEC0 + vb));
                acp_mbar_arrive(B(G10_FPART0 + vb));
                acp_mbar_wait(B(G10_FP), ph);
                wg_fence_proxy();
                g10_mma<DK / 2, false, false, GDR_C>(dkr, uP, GDR_C, uK + kbuf(it) * L::K_BYTES, GDR_C,
                                                     true);  // dk += dP K
                g10_release(B(G10_EP));
                if (r == ratio - 1) {
                    if (KB == 1) g10_release(B(G10_EQK));
                    release_k(it);
                    g10_l2_store(dkr, k_raw + t0 * krow + (i64)kh * dk, dk_out + t0 * krow + (i64)kh * dk, krow, l,
                                 l2norm);
                }
            }
        }
        return;
    }

    // ---- wg == 2: the 64 x 64 side ----
    acp_setmaxnreg_inc<G10Regs<RS>::A>();
    float* colp = s3;                  // [4][64] column partials
    float* row_e = s3 + 4 * GDR_C;     // rs(E)
    float* row_db = row_e + GDR_C;     // sum_j dM P Gamma
    float* row_fr = row_db + GDR_C;    // sum_j f
    float* row_cs = row_fr + GDR_C;    // cs(E)
    int s = 0, it = 0;
    for (i64 bi = blockIdx.x; bi < n_items; bi += gridDim.x, ++it) {
        const int kh = (int)(bi % hk_n);
        const i64 c = bi / hk_n;
        const i64 t0 = ch_t0[c];
        const int l = ch_len[c];
        for (int r = 0; r < ratio; ++r, ++s) {
            const int hv = kh * ratio + r;
            const unsigned ph = (unsigned)s & 1u;
            const int vb = s & 1;
            const float* s_gam = vec + vb * 4 * GDR_C;
            const float* s_eg = s_gam + GDR_C;
            const float* s_beta = s_gam + 3 * GDR_C;
            auto gamma = [&](int i, int j) { return expf(s_gam[i] - s_gam[j]); };
            acp_mbar_wait(B(G10_FVEC0 + vb), (unsigned)(s >> 1) & 1u);
            acp_mbar_wait(B(G10_FO), ph);
            acp_mbar_wait(B(G10_FD), ph);
            wg_fence_proxy();
            // dA = scale dO D^T, A = Q K^T: E = dA * A Gamma (row and column sums), G = dA Gamma.
            {
                float da[32], qk[32];
                g10_mma<32, false, true, DV>(da, uO, GDR_C, uD, GDR_C, false);
                g10_release(B(G10_EO));
                g10_release(B(G10_ED));
                if (r == 0) {
                    acp_mbar_wait(B(G10_FQK), (unsigned)it & 1u);
                    if (KB == 2) wait_k(it);
                    wg_fence_proxy();
                }
                g10_mma<32, false, true, DK>(qk, uQ, GDR_C, uK + kbuf(it) * L::K_BYTES, GDR_C, false);
                if (r == ratio - 1) release_q();
                if (s >= 1) acp_mbar_wait(B(G10_EG), (unsigned)(s - 1) & 1u);
                float rs0 = 0.f, rs1 = 0.f, cs[16];
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int cc = 0; cc < 4; ++cc) {
                        const int i = 16 * w + g + 8 * (cc >> 1), jj = 8 * j + 2 * t + (cc & 1);
                        const bool in = jj <= i && i < l;
                        const float x = scale * da[4 * j + cc];
                        const float gm = in ? gamma(i, jj) : 0.f;
                        const float e = in ? x * (qk[4 * j + cc] * gm) : 0.f;
                        da[4 * j + cc] = in ? x * gm : 0.f;
                        if (cc >> 1) rs1 += e; else rs0 += e;
                        if (cc >> 1) cs[2 * j + (cc & 1)] += e; else cs[2 * j + (cc & 1)] = e;
                    }
                g10_store_tile(sm + L::G_OFF, da, 1.f);
                wg_fence_proxy();
                acp_mbar_arrive(B(G10_FG));
                rs0 = g10_quad(rs0);
                rs1 = g10_quad(rs1);
                if (t == 0) {
                    row_e[16 * w + g] = rs0;
                    row_e[16 * w + g + 8] = rs1;
                }
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    cs[u] += __shfl_xor_sync(0xffffffffu, cs[u], 4);
                    cs[u] += __shfl_xor_sync(0xffffffffu, cs[u], 8);
                    cs[u] += __shfl_xor_sync(0xffffffffu, cs[u], 16);
                }
                if (g == 0) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        colp[w * GDR_C + 8 * j + 2 * t] = cs[2 * j];
                        colp[w * GDR_C + 8 * j + 2 * t + 1] = cs[2 * j + 1];
                    }
                }
            }
            // dT = dD Vb^T + dW Kb^T (column scales beta, beta e^gam) -> sX.
            acp_mbar_wait(B(G10_FW), ph);
            acp_mbar_wait(B(G10_FDD), ph);
            acp_mbar_wait(B(G10_FV), ph);
            wg_fence_proxy();
            {
                float a1[32], a2[32];
                g10_mma<32, false, true, DV>(a1, uDD, GDR_C, uV, GDR_C, false);
                g10_mma<32, false, true, DK>(a2, uW, GDR_C, uK + kbuf(it) * L::K_BYTES, GDR_C, false);
                g10_release(B(G10_EW));
                g10_release(B(G10_EDD));
                g10_release(B(G10_EV));
#pragma unroll
                for (int e = 0; e < 32; ++e) {
                    const int j = 8 * (e >> 2) + 2 * t + (e & 1);
                    a1[e] = s_beta[j] * a1[e] + (s_beta[j] * s_eg[j]) * a2[e];
                }
                // the previous head's reads of sX ended before its last WG barrier; with KB 2, sX is
                // the dP tile, which WG1 reads last in its dP K
                if (KB == 2 && s >= 1) acp_mbar_wait(B(G10_EP), (unsigned)(s - 1) & 1u);
                g10_store_tile(sm + L::X_OFF, a1, 1.f);
                wg_fence_proxy();
            }
            g10_wgbar(1);
            // the E column partials are complete: fold them (row_cs = cs(E))
            if (tid - 256 < GDR_C) {
                const int j = tid - 256;
                row_cs[j] = ((colp[j] + colp[GDR_C + j]) + colp[2 * GDR_C + j]) + colp[3 * GDR_C + j];
            }
            acp_mbar_wait(B(G10_FT), ph);
            wg_fence_proxy();
            // tmp = T^T dT -> sX (bf16), dM = -(tmp T^T).
            float dm[32];
            {
                float a[32];
                g10_mma<32, true, false, GDR_C>(a, uT, GDR_C, uX, GDR_C, false);
                g10_wgbar(1);  // every warp's reads of dT are done
                g10_store_tile(sm + L::X_OFF, a, 1.f);
                wg_fence_proxy();
                g10_wgbar(1);
                g10_mma<32, false, true, GDR_C>(dm, uX, GDR_C, uT, GDR_C, false);
                g10_release(B(G10_ET));
            }
            // P = K K^T; M_ij = beta_i P_ij Gamma_ij (j < i): dbeta_i += sum_j dM_ij P_ij Gamma_ij;
            // f = dM_ij beta_i P_ij Gamma_ij: dgam_i += f, dgam_j -= f; dP_ij = dM_ij beta_i Gamma_ij,
            // symmetrized.
            {
                float pk[32];
                const unsigned uKc = uK + kbuf(it) * L::K_BYTES;
                g10_mma<32, false, true, DK>(pk, uKc, GDR_C, uKc, GDR_C, false);
                if (r == ratio - 1) {
                    // Q (KB 1), K: no further reads here
                    if (KB == 1) g10_release(B(G10_EQK));
                    release_k(it);
                }
                if (KB == 1 && s >= 1) acp_mbar_wait(B(G10_EP), (unsigned)(s - 1) & 1u);
                // KB 2: every warp's reads of sX (dM's product) are done before dP overwrites it
                if (KB == 2) g10_wgbar(1);
                char* tP = sm + L::P_OFF;
                float db0 = 0.f, db1 = 0.f, fr0 = 0.f, fr1 = 0.f, fc[16];
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int cc = 0; cc < 4; ++cc) {
                        const int i = 16 * w + g + 8 * (cc >> 1), jj = 8 * j + 2 * t + (cc & 1);
                        const bool in = jj < i && i < l;
                        const float x = -dm[4 * j + cc];
                        const float gm = in ? gamma(i, jj) : 0.f;
                        const float pg = pk[4 * j + cc] * gm;
                        const float dbv = in ? x * pg : 0.f;
                        const float f = in ? x * s_beta[i] * pg : 0.f;
                        const float d = in ? x * s_beta[i] * gm : 0.f;
                        if (cc >> 1) {
                            db1 += dbv;
                            fr1 += f;
                        } else {
                            db0 += dbv;
                            fr0 += f;
                        }
                        if (cc >> 1) fc[2 * j + (cc & 1)] += f; else fc[2 * j + (cc & 1)] = f;
                        if (jj <= i) {
                            const bf16_t bv = f32_to_bf16(d);
                            *reinterpret_cast<bf16_t*>(tP + wg_tile(GDR_C, i, jj)) = bv;
                            *reinterpret_cast<bf16_t*>(tP + wg_tile(GDR_C, jj, i)) = bv;
                        }
                    }
                wg_fence_proxy();
                acp_mbar_arrive(B(G10_FP));
                db0 = g10_quad(db0);
                db1 = g10_quad(db1);
                fr0 = g10_quad(fr0);
                fr1 = g10_quad(fr1);
                if (t == 0) {
                    row_db[16 * w + g] = db0;
                    row_db[16 * w + g + 8] = db1;
                    row_fr[16 * w + g] = fr0;
                    row_fr[16 * w + g + 8] = fr1;
                }
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    fc[u] += __shfl_xor_sync(0xffffffffu, fc[u], 4);
                    fc[u] += __shfl_xor_sync(0xffffffffu, fc[u], 8);
                    fc[u] += __shfl_xor_sync(0xffffffffu, fc[u], 16);
                }
                if (g == 0) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        colp[w * GDR_C + 8 * j + 2 * t] = fc[2 * j];
                        colp[w * GDR_C + 8 * j + 2 * t + 1] = fc[2 * j + 1];
                    }
                }
            }
            g10_wgbar(1);
            acp_mbar_wait(B(G10_FPART0 + vb), (unsigned)(s >> 1) & 1u);
            // Each row's dgam and dbeta (gdr_grad7's terms and order), then dg = reverse cumsum.
            if (tid < 256 + 32) {
                const float* pq = part + vb * 4 * GDR_C;
                const float* pkk = pq + GDR_C;
                const float* pkb = pq + 2 * GDR_C;
                const float sds = red[vb * 8 + 4];
                const float egl = expf(s_gam[l - 1]);
                float dgm[2], tk = 0.f;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = 2 * lane + h;
                    const float fcs = ((colp[i] + colp[GDR_C + i]) + colp[2 * GDR_C + i]) + colp[3 * GDR_C + i];
                    const float pki = i < l ? pkk[i] : 0.f;
                    float d = (i < l ? pq[i] : 0.f) - pki;
                    tk += pki;
                    d += row_e[i] - row_cs[i];
                    float db = 0.f;
                    if (i < l) {
                        const float sv = pq[3 * GDR_C + i], sk = pkb[i];
                        db = sv + s_eg[i] * sk;
                        d += (s_beta[i] * s_eg[i]) * sk;
                    }
                    db += row_db[i];
                    d += row_fr[i] - fcs;
                    dgm[h] = d;
                    if (i < l) st(dbeta, (t0 + i) * hv_n + hv, db);
                }
                tk = warp_sum(tk);
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (2 * lane + h == l - 1) dgm[h] += egl * sds + tk;
                // suffix sums over the pairs (lane order), then within the pair
                float incl = dgm[0] + dgm[1];
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const float y = __shfl_down_sync(0xffffffffu, incl, o);
                    if (lane + o < 32) incl += y;
                }
                float excl = __shfl_down_sync(0xffffffffu, incl, 1);
                if (lane == 31) excl = 0.f;
                const float d1 = dgm[1] + excl, d0 = dgm[0] + d1;
                if (2 * lane < l) dg[(t0 + 2 * lane) * hv_n + hv] = d0;
                if (2 * lane + 1 < l) dg[(t0 + 2 * lane + 1) * hv_n + hv] = d1;
            }
            g10_wgbar(1);  // the row arrays are free for the next head
            g10_release(B(G10_EVEC0 + vb));
        }
    }
#endif
}

// gdr_grad10 (bf16 states). Persistent grid (<= items = chunks x key heads CTAs), 512 threads. One
// kernel for both norms: its row dots read the bf16 normalized q, k tiles either way, and
// `l2norm` applies the l2 norm's backward to dq, dk at the end.
// gdr_grad10b: D, dD in bf16 (RSB: its register split, G10Regs).
#define GDR_GRAD10_ENTRY(DK, DV, RSB)                                                                   \
    GDR_GRAD10_ENTRY_TD(DK, DV, float, gdr_grad10, 0, 2)                                                \
    GDR_GRAD10_ENTRY_TD(DK, DV, bf16_t, gdr_grad10b, RSB, 2)
// RS: the register split (G10Regs); KB: K's buffers (G10)
#define GDR_GRAD10_ENTRY_TD(DK, DV, TD, NAME, RS, KB)                                                   \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME##_bf16_d##DK##_v##DV(                     \
        const bf16_t* q_raw, const bf16_t* k_raw, const bf16_t* qb, const bf16_t* kb, const bf16_t* v,  \
        const bf16_t* beta, const bf16_t* d_o, const float* gam_ws, const float* t_ws, const float* t_pk, \
        const bf16_t* h_ws, const bf16_t* dh_ws, const TD* d_ws, const TD* dd_ws, const i64* ch_t0,     \
        const int* ch_len, i64 n_items, int hk, int hv, float scale, int l2norm, bf16_t* dq_out,        \
        bf16_t* dk_out, bf16_t* dv_out, float* dg, bf16_t* dbeta) {                                     \
        gdr_grad10<DK, DV, TD, RS, KB>(q_raw, k_raw, qb, kb, v, beta, d_o, gam_ws, t_ws, t_pk, h_ws, dh_ws, \
                                   d_ws, dd_ws, ch_t0, ch_len, n_items, hk, hv, scale, l2norm, dq_out, \
                                   dk_out, dv_out, dg, dbeta);                                          \
    }

GDR_GRAD10_ENTRY(64, 64, 0)
GDR_GRAD10_ENTRY(64, 128, 0)
GDR_GRAD10_ENTRY(128, 64, 0)
GDR_GRAD10_ENTRY(128, 128, 1)
// gdr_grad10b_r0_bf16_d128_v128: the d128 / v128 kernel at RS 0 (tests: the same bits as RS 1)
GDR_GRAD10_ENTRY_TD(128, 128, bf16_t, gdr_grad10b_r0, 0, 2)
// gdr_grad10{,b}_k1_bf16_d128_v128: session 17's single K buffer (tests: the same bits as KB 2)
GDR_GRAD10_ENTRY_TD(128, 128, float, gdr_grad10_k1, 0, 1)
GDR_GRAD10_ENTRY_TD(128, 128, bf16_t, gdr_grad10b_k1, 1, 1)

// =============================================================================================
// v10 backward scans (issue 13, opt-in GDN_RULE_BWD_SCAN=v10 / set_bwd10; written in session 19
// with no device: compiled and inspected with ptxas, not yet run). The backward's two scans on
// gdr_fwd10's operands, so that the backward's prep (gdr_prep8to / gdr_prep9to: the kept T in,
// PT = T diag(beta) hi + lo out) writes neither W (bf16) nor U (fp32):
//   U = PT V,   W = PT diag(e^gam) K,   D = U - W S0 = PT (V - diag(e^gam) K S0).
// gdr_hrec10 (gdr_hrec6's v6 layout: warp w owns 16 state columns over all DK rows, no
// exchange): per chunk X^T = S^T K^T, Y^T = V^T - X^T diag(e^gam) (bf16), D^T = Y^T PT^T (PT hi,
// then lo: 40 mma), then v6's update; h and D stored as gdr_hrec6 / gdr_hrec6b store them (the
// bf16 tiles staged through the warp's own columns of the stage's V tile, done with after the
// step: D in one pass of 64 rows, h in DK / 64 passes).
// gdr_bwd10 (gdr_bwd8's v8 split: warp pair, Dk halves): dD exactly as gdr_bwd8 (v8g_dd), then
// the update's -dD^T W_hh as
//   Z^T = (-dD^T) PT                (16 x 64, k = the chunk rows: PT's blocks on or below the
//                                    diagonal, hi then lo: 20 + 20 mma, both warps of the pair)
//   -dD^T W_hh = (Z^T diag(e^gam)) K_hh   (bf16 A fragments times the K rows gdr_bwd8's W rows
//                                          were: the same 32 mma)
// 146 mma per warp per step against gdr_bwd8's 106. Numerics: Z^T diag(e^gam) rounded to bf16
// where gdr_bwd8 reads a bf16 W (both one rounding of an fp32 product), so not gdr_bwd8's bits;
// held to the f64 tests (gpu_rule's v10_backward_matches_f64). dD (and dh, dh0) of the last
// chunk step agree with gdr_bwd8's; the later ones differ by the dS rounding above.
// Stages: gdr_hrec10 V10R (K, PT hi, PT lo, the CTA's V tile, gam: 41,216 bytes at Dk 128, w2);
// gdr_bwd10 gdr_fwd10's V10S with the dO tile in V's place (67,840 at Dk 128, BV 32). Shared
// memory at Dk 128: gdr_bwd10 w4 2 x 67,840 + 8,192 = 143,872, gdr_hrec10 w2 2 x 41,216 =
// 82,432: 226,304 together, so they still share an SM as gdr_bwd8b and gdr_hrec6b do.
// gdr_hrec10 also runs alone beside the default reverse scans (GDN_RULE_HREC=v10), which read
// W: the prep then writes PT and W, no U (gdr_prep8ow / 9ow / 8tow / 9tow, TW above).

template <int DK, int NW>
struct V10R {
    static constexpr int BV = 16 * NW;
    static constexpr int NT = 32 * NW;
    static constexpr int LK = DK + 8;
    static constexpr int LA = GDR_C + 8;
    static constexpr int LV = BV + 8;
    static constexpr int K_OFF = 0;
    static constexpr int TH_OFF = K_OFF + GDR_C * LK * 2;
    static constexpr int TL_OFF = TH_OFF + GDR_C * LA * 2;
    static constexpr int V_OFF = TL_OFF + GDR_C * LA * 2;
    static constexpr int G_OFF = V_OFF + GDR_C * LV * 2;
    static constexpr int STAGE = G_OFF + GDR_C * 4;
    static_assert(TH_OFF % 16 == 0 && V_OFF % 16 == 0 && G_OFF % 16 == 0 && STAGE % 16 == 0,
                  "16-byte aligned regions");
};

// One V10R stage by all NT threads, committed as one cp.async group: K rows (rows >= l
// zero-filled), PT hi and lo (pc: the chunk's hi, lo at + 64 x 64), the CTA's V tile (vc: its
// first row at the CTA's first column, row stride vrow; rows >= l zero-filled), gam.
template <int DK, int NW>
__device__ __forceinline__ void v10r_load_stage(char* st, const bf16_t* kc, i64 krow, int l, const bf16_t* pc,
                                                const bf16_t* vc, i64 vrow, const float* gc) {
    typedef V10R<DK, NW> L;
    const int tid = threadIdx.x;
    constexpr int CPR = DK / 8;
    for (int e = tid; e < GDR_C * CPR; e += L::NT) {
        const int i = e / CPR, x = (e % CPR) * 8;
        const bool ok = i < l;
        cp_async16(st + L::K_OFF + (i * L::LK + x) * 2, kc + (ok ? (i64)i * krow + x : 0), ok);
    }
    // PT hi rows 0 .. 63, then lo (contiguous in both places): 8 pieces per row
    for (int e = tid; e < 2 * GDR_C * 8; e += L::NT) {
        const int i = e >> 3, x = (e & 7) * 8;
        cp_async16(st + L::TH_OFF + (i * L::LA + x) * 2, pc + (i64)i * GDR_C + x, true);
    }
    constexpr int VPR = L::BV / 8;
    for (int e = tid; e < GDR_C * VPR; e += L::NT) {
        const int i = e / VPR, x = (e % VPR) * 8;
        const bool ok = i < l;
        cp_async16(st + L::V_OFF + (i * L::LV + x) * 2, vc + (ok ? (i64)i * vrow + x : 0), ok);
    }
    if (tid < GDR_C / 4) cp_async16(st + L::G_OFF + tid * 16, gc + tid * 4, true);
    cp_async_commit();
}

// gdr_hrec10's chunk step for this warp (v6_chain_step's interface with K, PT and V in place of
// W and U; see the v10 backward header): on exit s holds S1^T, sa S0^T as bf16 A fragments, da
// D^T (bf16, unscaled). sv: the stage's V tile offset to this warp's first column (row stride
// lv). SD: D (fp32, before its rounding) also stored at dst as v6_chain_step stores it.
template <int DK, bool SD = false, typename TD = float>
__device__ __forceinline__ void v10r_chain_step(float (&s)[DK / 8][4], unsigned (&sa)[DK / 16][4],
                                                unsigned (&da)[4][4], const bf16_t* sk, int lk, const bf16_t* pth,
                                                const bf16_t* ptl, int la, const bf16_t* sv, int lv,
                                                const float* s_gam, int l, TD* dst = nullptr, i64 ldd = 0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, mi = lane >> 3, r = lane & 7;
    v6_s_frags<DK>(s, sa);
    float x[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) x[j][c] = 0.f;
    v6_mul_rows_t<DK>(x, sa, sk, lk);
    // Y^T = V^T - (S^T K^T) diag(e^gam) as A fragments (k = the chunk rows; rows >= l: 0)
    unsigned ya[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
            const float e0 = i0 < l ? __expf(s_gam[i0]) : 0.f;
            const float e1 = i0 + 1 < l ? __expf(s_gam[i0 + 1]) : 0.f;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int v = g + 8 * rr;
                ya[kk][rr + 2 * h] = pack_bf16(bf16_to_f32(sv[i0 * lv + v]) - e0 * x[j][2 * rr],
                                               bf16_to_f32(sv[(i0 + 1) * lv + v]) - e1 * x[j][2 * rr + 1]);
            }
        }
    // D^T = Y^T PT^T: B[k][n] = PT[n][k] (row-major PT), the blocks kk <= jp; hi, then lo
    float d[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) d[j][c] = 0.f;
#pragma unroll
    for (int jp = 0; jp < 4; ++jp)
#pragma unroll
        for (int kk = 0; kk <= jp; ++kk) {
            const int off = (16 * jp + 8 * (mi >> 1) + r) * la + 16 * kk + 8 * (mi & 1);
            unsigned bh[4], bl[4];
            ldsm_x4(bh, pth + off);
            ldsm_x4(bl, ptl + off);
            mma_bf16(d[2 * jp], ya[kk], bh[0], bh[1]);
            mma_bf16(d[2 * jp + 1], ya[kk], bh[2], bh[3]);
            mma_bf16(d[2 * jp], ya[kk], bl[0], bl[1]);
            mma_bf16(d[2 * jp + 1], ya[kk], bl[2], bl[3]);
        }
    const float gl = s_gam[l - 1];
    unsigned dsa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
            const float e0 = i0 < l ? __expf(gl - s_gam[i0]) : 0.f;
            const float e1 = i0 + 1 < l ? __expf(gl - s_gam[i0 + 1]) : 0.f;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int v = g + 8 * rr;
                const float d0 = d[j][2 * rr], d1 = d[j][2 * rr + 1];
                if (SD) {
                    st_ws(dst, (i64)i0 * ldd + v, d0);
                    st_ws(dst, (i64)(i0 + 1) * ldd + v, d1);
                }
                da[kk][rr + 2 * h] = pack_bf16(d0, d1);
                dsa[kk][rr + 2 * h] = pack_bf16(e0 * d0, e1 * d1);
            }
        }
    const float egl = __expf(gl);
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] *= egl;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < DK / 16; ++np) {
            unsigned b[4];
            ldsm_x4_t(b, sk + (16 * kk + 8 * (mi & 1) + r) * lk + 16 * np + 8 * (mi >> 1));
            mma_bf16(s[2 * np], dsa[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], dsa[kk], b[2], b[3]);
        }
}

// gdr_hrec6 on V10R stages and v10r_chain_step (see the v10 backward header). Grid: N * Hv *
// (dv / BV) CTAs of 32 NW threads; dynamic shared memory 2 * V10R<DK, NW>::STAGE. pt_ws:
// gdr_prep8to / 9to's PT hi + lo ([chunk][value head][2][64][64] bf16); v: the input values.
// Outputs as gdr_hrec6 (TD: D's type, bf16 for gdr_grad10b: gdr_hrec10b).
template <int DK, int NW, typename TD = float>
__device__ void gdr_hrec10(const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                           const float* __restrict__ gam_ws, const bf16_t* __restrict__ pt_ws,
                           const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                           const int* __restrict__ ch_len, int hk_n, int hv_n, int dv,
                           const float* __restrict__ h0, float* __restrict__ h_ws, bf16_t* __restrict__ h16_ws,
                           TD* __restrict__ d_ws) {
    typedef V10R<DK, NW> L;
    // A launch with too little shared memory writes nothing (tests see the poisoned output).
    if (dyn_smem_bytes() < 2u * L::STAGE) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / L::BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 col0 = (i64)vt * L::BV;
    const int wc0 = 16 * warp;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;

    // s[nt][c] = S[8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DK / 8][4];
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = h0 ? h0[st_base + (i64)(8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage, i64 t0, int l) {
        const i64 cb = c * hv_n + hv;
        v10r_load_stage<DK, NW>(sm + stage * L::STAGE, k + t0 * krow + (i64)kh * DK, krow, l,
                                pt_ws + cb * (2 * GDR_C * GDR_C), v + t0 * vrow + (i64)hv * dv + col0, vrow,
                                gam_ws + cb * GDR_C);
    };
    // Chunk tables one chunk ahead of their use, as gdr_hrec6.
    int l_cur = 0, l_nxt = 0;
    i64 t0_nxt = 0;
    if (c_beg < c_end) {
        l_cur = ch_len[c_beg];
        issue(c_beg, 0, ch_t0[c_beg], l_cur);
        if (c_beg + 1 < c_end) {
            t0_nxt = ch_t0[c_beg + 1];
            l_nxt = ch_len[c_beg + 1];
        }
    } else {
        cp_async_commit();
    }
    for (i64 c = c_beg; c < c_end; ++c) {
        const int stg = (int)((c - c_beg) & 1);
        cp_async_wait_group<0>();
        // Chunk c's stage is complete and visible; every warp is done with the other stage.
        __syncthreads();
        if (c + 1 < c_end) issue(c + 1, stg ^ 1, t0_nxt, l_nxt);
        else cp_async_commit();
        const int l = l_cur;
        l_cur = l_nxt;
        if (c + 2 < c_end) {
            t0_nxt = ch_t0[c + 2];
            l_nxt = ch_len[c + 2];
        }
        char* sp = sm + stg * L::STAGE;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF);
        const bf16_t* sTh = reinterpret_cast<const bf16_t*>(sp + L::TH_OFF);
        const bf16_t* sTl = reinterpret_cast<const bf16_t*>(sp + L::TL_OFF);
        bf16_t* sV = reinterpret_cast<bf16_t*>(sp + L::V_OFF) + wc0;
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;
        if (h_ws) v6_store_state<DK>(s, h_ws, h16_ws, cb * (i64)DK * dv + col0 + wc0 + g, dv);
        unsigned sa[DK / 16][4], da[4][4];
        constexpr bool D16 = sizeof(TD) == 2;
        TD* dc = d_ws + cb * GDR_C * (i64)dv + col0 + wc0;
        // a full chunk with its length known at compile time (the masks fold away; the same bits)
        if (l == GDR_C)
            v10r_chain_step<DK, !D16, TD>(s, sa, da, sK, L::LK, sTh, sTl, L::LA, sV, L::LV, sG, GDR_C, dc,
                                          (i64)dv);
        else
            v10r_chain_step<DK, !D16, TD>(s, sa, da, sK, L::LK, sTh, sTl, L::LA, sV, L::LV, sG, l, dc, (i64)dv);
        if (!h_ws || D16) {
            // Through this warp's 16 columns of the stage's V tile (read by this warp only, in the
            // step above; refilled after the next CTA barrier): tile row R at V row R.
            const unsigned vb = smem_addr(sV);
            auto row = [&](int R, int h) { return vb + (unsigned)(R * L::LV * 2 + 16 * h); };
            auto same = [](int R) { return R; };
            if (D16) v6_tile_out<4>(da, row, same, reinterpret_cast<bf16_t*>(dc), (i64)dv);
            // h[c] = S before the step: sa is its bf16 rounding (v6_s_frags), 64 rows a pass
            if (!h_ws) {
#pragma unroll
                for (int p = 0; p < DK / 64; ++p)
                    v6_tile_out<4>(*reinterpret_cast<const unsigned(*)[4][4]>(&sa[4 * p]), row, same,
                                   h16_ws + cb * (i64)DK * dv + (i64)(64 * p) * dv + col0 + wc0, (i64)dv);
            }
        }
    }
}

// gdr_bwd8 on V10S stages (the dO tile in V's place) with the update's W product rebuilt from
// PT and K (see the v10 backward header). Grid as gdr_bwd8; dynamic shared memory 2 *
// V10S<DK, NW / 2>::STAGE + NW * 2048. pt_ws: PT hi + lo as gdr_hrec10's.
template <int DK, int NW, typename TD = float>
__device__ void gdr_bwd10(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                          const bf16_t* __restrict__ d_o, const float* __restrict__ gam_ws,
                          const bf16_t* __restrict__ pt_ws, const bf16_t* __restrict__ a_ws,
                          const i64* __restrict__ seq_ch, const i64* __restrict__ ch_t0,
                          const int* __restrict__ ch_len, int hk_n, int hv_n, int dv, float scale,
                          const float* __restrict__ dht, float* __restrict__ dh_ws, bf16_t* __restrict__ dh16_ws,
                          TD* __restrict__ dd_ws, float* __restrict__ dh0) {
    typedef V10S<DK, NW / 2> L;
    constexpr int BV = 8 * NW, NT = 32 * NW, DH = DK / 2, XB = 4 * 32 * 16;
    static_assert(NW == 2 || NW == 4 || NW == 8, "1, 2 or 4 warp pairs");
    if (dyn_smem_bytes() < (unsigned)(2 * L::STAGE + NW * XB)) return;
    char* sm = reinterpret_cast<char*>(gdr_smem);
    const int nvt = dv / BV;
    const i64 b = blockIdx.x;
    const int vt = (int)(b % nvt);
    const int hv = (int)((b / nvt) % hv_n);
    const i64 n = b / ((i64)nvt * hv_n);
    const int kh = hv / (hv_n / hk_n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r = lane & 7;
    const int cg = warp >> 1, hh = warp & 1, bar = 1 + cg;
    float4* xme = reinterpret_cast<float4*>(sm + 2 * L::STAGE + warp * XB);
    float4* xot = reinterpret_cast<float4*>(sm + 2 * L::STAGE + (warp ^ 1) * XB);
    const i64 col0 = (i64)vt * BV;
    const int wc0 = 16 * cg, r0 = DH * hh;
    const i64 st_base = (n * hv_n + hv) * (i64)DK * dv;
    const i64 krow = (i64)hk_n * DK, vrow = (i64)hv_n * dv;

    // s[nt][c] = dS[r0 + 8 nt + 2t + (c & 1)][col0 + wc0 + g + 8 (c >> 1)]
    float s[DH / 8][4];
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            s[nt][c] = dht ? dht[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)]
                           : 0.f;

    const i64 c_beg = seq_ch[n], c_end = seq_ch[n + 1];
    auto issue = [&](i64 c, int stage) {
        const i64 cb = c * hv_n + hv;
        const i64 t0 = ch_t0[c];
        v10_load_stage<DK, BV, NT, true>(sm + stage * L::STAGE, threadIdx.x, k + t0 * krow + (i64)kh * DK,
                                         q + t0 * krow + (i64)kh * DK, krow, ch_len[c],
                                         pt_ws + cb * (2 * GDR_C * GDR_C), a_ws + cb * GDR_C * GDR_C,
                                         d_o + t0 * vrow + (i64)hv * dv + col0, vrow, gam_ws + cb * GDR_C);
        cp_async_commit();
    };
    if (c_end > c_beg) issue(c_end - 1, 0);
    else cp_async_commit();
    const float inv_scale = 1.f / scale;
    for (i64 c = c_end - 1; c >= c_beg; --c) {
        const int stg = (int)((c_end - 1 - c) & 1);
        cp_async_wait_group<0>();
        __syncthreads();
        if (c > c_beg) issue(c - 1, stg ^ 1);
        else cp_async_commit();
        const int l = ch_len[c];
        const char* sp = sm + stg * L::STAGE;
        const bf16_t* sK = reinterpret_cast<const bf16_t*>(sp + L::K_OFF) + r0;
        const bf16_t* sQ = reinterpret_cast<const bf16_t*>(sp + L::Q_OFF) + r0;
        const bf16_t* sTh = reinterpret_cast<const bf16_t*>(sp + L::TH_OFF);
        const bf16_t* sTl = reinterpret_cast<const bf16_t*>(sp + L::TL_OFF);
        const bf16_t* sA = reinterpret_cast<const bf16_t*>(sp + L::A_OFF);
        const bf16_t* sO = reinterpret_cast<const bf16_t*>(sp + L::V_OFF);
        const float* sG = reinterpret_cast<const float*>(sp + L::G_OFF);
        const i64 cb = c * hv_n + hv;

        float x[8][4];
        {
            unsigned sa[DH / 16][4];
            v6_s_frags<DH>(s, sa);
            // dh[c] = dS (this warp's rows), as gdr_bwd8
            if (dh_ws) {
                v6_store_state<DH>(s, dh_ws, dh16_ws, cb * (i64)DK * dv + (i64)r0 * dv + col0 + wc0 + g, dv);
            } else {
                const unsigned xb = smem_addr(xme);
                v6_tile_out<DH / 16>(sa, SwRow32{xb}, [](int R) { return R; },
                                     dh16_ws + cb * (i64)DK * dv + (i64)r0 * dv + col0 + wc0, (i64)dv);
                pair_bar(bar);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) x[j][cc] = 0.f;
            v6_mul_rows_t<DH>(x, sa, sK, L::LK);
        }
        const float gl = sG[l - 1];
        if (l == GDR_C) v8g_scale_x<GDR_C>(x, sG, l, gl, inv_scale);
        else v8g_scale_x<0>(x, sG, l, gl, inv_scale);
        unsigned of[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldsm_x4_t(of[kk], sO + (16 * kk + 8 * (mi >> 1) + r) * L::LV + wc0 + 8 * (mi & 1));
        unsigned nd[4][4];
        TD* ddc = dd_ws + cb * GDR_C * (i64)dv + col0 + wc0 + g;
        if (hh) v8g_dd<1, TD, true>(x, of, sA, L::LA, scale, ddc, dv, xme, xot, bar, nd);
        else v8g_dd<0, TD, true>(x, of, sA, L::LA, scale, ddc, dv, xme, xot, bar, nd);
        if (l == GDR_C) v8g_scale_o<GDR_C>(of, sG, l, scale);
        else v8g_scale_o<0>(of, sG, l, scale);
        // Z^T = (-dD^T) PT: B[k = i][n = m] = PT[i][m], nonzero for m <= i (blocks kk >= jp)
        unsigned za[4][4];
        {
            float z[8][4];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) z[j][cc] = 0.f;
#pragma unroll
            for (int jp = 0; jp < 4; ++jp)
#pragma unroll
                for (int kk = jp; kk < 4; ++kk) {
                    const int off = (16 * kk + 8 * (mi & 1) + r) * L::LA + 16 * jp + 8 * (mi >> 1);
                    unsigned bh[4], bl[4];
                    ldsm_x4_t(bh, sTh + off);
                    ldsm_x4_t(bl, sTl + off);
                    mma_bf16(z[2 * jp], nd[kk], bh[0], bh[1]);
                    mma_bf16(z[2 * jp + 1], nd[kk], bh[2], bh[3]);
                    mma_bf16(z[2 * jp], nd[kk], bl[0], bl[1]);
                    mma_bf16(z[2 * jp + 1], nd[kk], bl[2], bl[3]);
                }
            // times e^gam of the column (rows >= l: 0), as A fragments (k = the chunk rows)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * kk + h, i0 = 8 * j + 2 * t;
                    const float e0 = i0 < l ? __expf(sG[i0]) : 0.f;
                    const float e1 = i0 + 1 < l ? __expf(sG[i0 + 1]) : 0.f;
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr)
                        za[kk][rr + 2 * h] = pack_bf16(e0 * z[j][2 * rr], e1 * z[j][2 * rr + 1]);
                }
        }
        const float egl = __expf(gl);
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) s[nt][cc] *= egl;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int np = 0; np < DH / 16; ++np) {
                unsigned bq[4], bk[4];
                ldsm_x4_t(bq, sQ + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                ldsm_x4_t(bk, sK + (16 * kk + 8 * (mi & 1) + r) * L::LK + 16 * np + 8 * (mi >> 1));
                mma_bf16(s[2 * np], of[kk], bq[0], bq[1]);
                mma_bf16(s[2 * np + 1], of[kk], bq[2], bq[3]);
                mma_bf16(s[2 * np], za[kk], bk[0], bk[1]);
                mma_bf16(s[2 * np + 1], za[kk], bk[2], bk[3]);
            }
    }
    if (dh0) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                dh0[st_base + (i64)(r0 + 8 * nt + 2 * t + (c & 1)) * dv + col0 + wc0 + g + 8 * (c >> 1)] = s[nt][c];
    }
}

// gdr_hrec10{,b}_d{DK}_w{NW} (b: D in bf16), gdr_bwd10{,b}_d{DK}_w{NW} (b: dD in bf16): the
// widths gdr_hrec6 (1, 2, 4, 8) and gdr_bwd8 (2, 4, 8) run.
#define GDR_HREC10_ENTRY(NAME, DK, NW, TD)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_hrec##NAME##_d##DK##_w##NW(            \
        const bf16_t* k, const bf16_t* v, const float* gam_ws, const bf16_t* pt_ws, const i64* seq_ch,  \
        const i64* ch_t0, const int* ch_len, int hk, int hv, int dv, const float* h0, float* h_ws,      \
        bf16_t* h16_ws, TD* d_ws) {                                                                     \
        gdr_hrec10<DK, NW, TD>(k, v, gam_ws, pt_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, h0, h_ws, h16_ws, \
                               d_ws);                                                                   \
    }
#define GDR_BWD10_ENTRY(NAME, DK, NW, TD)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) gdr_bwd##NAME##_d##DK##_w##NW(             \
        const bf16_t* q, const bf16_t* k, const bf16_t* d_o, const float* gam_ws, const bf16_t* pt_ws,  \
        const bf16_t* a_ws, const i64* seq_ch, const i64* ch_t0, const int* ch_len, int hk, int hv,     \
        int dv, float scale, const float* dht, float* dh_ws, bf16_t* dh16_ws, TD* dd_ws, float* dh0) {  \
        gdr_bwd10<DK, NW, TD>(q, k, d_o, gam_ws, pt_ws, a_ws, seq_ch, ch_t0, ch_len, hk, hv, dv, scale,  \
                              dht, dh_ws, dh16_ws, dd_ws, dh0);                                         \
    }
#define GDR_HREC10_ENTRIES(DK, NW)         \
    GDR_HREC10_ENTRY(10, DK, NW, float)    \
    GDR_HREC10_ENTRY(10b, DK, NW, bf16_t)
#define GDR_BWD10_ENTRIES(DK, NW)          \
    GDR_BWD10_ENTRY(10, DK, NW, float)     \
    GDR_BWD10_ENTRY(10b, DK, NW, bf16_t)
GDR_HREC10_ENTRIES(64, 1)
GDR_HREC10_ENTRIES(64, 2)
GDR_HREC10_ENTRIES(64, 4)
GDR_HREC10_ENTRIES(64, 8)
GDR_HREC10_ENTRIES(128, 1)
GDR_HREC10_ENTRIES(128, 2)
GDR_HREC10_ENTRIES(128, 4)
GDR_HREC10_ENTRIES(128, 8)
GDR_BWD10_ENTRIES(64, 2)
GDR_BWD10_ENTRIES(64, 4)
GDR_BWD10_ENTRIES(64, 8)
GDR_BWD10_ENTRIES(128, 2)
GDR_BWD10_ENTRIES(128, 4)
GDR_BWD10_ENTRIES(128, 8)
