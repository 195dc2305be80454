// Warp collectives from their PTX fragment maps: each lane publishes its operand, the warp meets
// at a barrier, each lane takes what the instruction gives it (ldmatrix, stmatrix, mma.sync
// m16n8k16 bf16 with the 16-term sums in f64, shfl.xor). Needs base.h and g_warp set per CTA.
#pragma once
struct WX { const void* addr[32]; unsigned sa[32]; float fx[32]; unsigned a[32][4], b[32][2]; };
WX g_wx[16];
inline void wbar() { g_warp[threadIdx.x >> 5]->arrive_and_wait(); }
inline void __syncwarp() { wbar(); }
inline void ldsm_x4(unsigned (&r)[4], const void* p) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.addr[l] = p; wbar();
    for (int m = 0; m < 4; ++m) r[m] = ((const unsigned*)W.addr[8 * m + g])[t];
    wbar();
}
inline void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.addr[l] = p; wbar();
    for (int m = 0; m < 4; ++m) {
        const bf16_t* r0 = (const bf16_t*)W.addr[8 * m + 2 * t];
        const bf16_t* r1 = (const bf16_t*)W.addr[8 * m + 2 * t + 1];
        r[m] = (unsigned)r0[g] | ((unsigned)r1[g] << 16);
    }
    wbar();
}
// stmatrix.m8n8.x4.trans: lanes 8m .. 8m + 7 give the shared addresses of matrix m's 8 rows;
// register m of lane (g, t) holds elements (g, 2t), (g, 2t + 1), stored at (2t, g), (2t + 1, g).
inline void stsm_x4_t(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.sa[l] = a; wbar();
    const unsigned r[4] = {r0, r1, r2, r3};
    for (int m = 0; m < 4; ++m) {
        bf16_t* p0 = (bf16_t*)((char*)gdr_smem + W.sa[8 * m + 2 * t]);
        bf16_t* p1 = (bf16_t*)((char*)gdr_smem + W.sa[8 * m + 2 * t + 1]);
        p0[g] = (bf16_t)(r[m] & 0xffffu);
        p1[g] = (bf16_t)(r[m] >> 16);
    }
    wbar();
}
inline void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) W.a[l][i] = a[i];
    W.b[l][0] = b0; W.b[l][1] = b1; wbar();
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; ++L) {
        const int gg = L >> 2, tt = L & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = gg + 8 * (i & 1), k = 2 * tt + 8 * (i >> 1);
            A[row][k] = bf(W.a[L][i] & 0xffff); A[row][k + 1] = bf(W.a[L][i] >> 16);
        }
        for (int i = 0; i < 2; ++i) {
            const int k = 2 * tt + 8 * i;
            B[k][gg] = bf(W.b[L][i] & 0xffff); B[k + 1][gg] = bf(W.b[L][i] >> 16);
        }
    }
    wbar();
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double s = 0; for (int k = 0; k < 16; ++k) s += (double)A[row][k] * B[k][col];
        c[i] = (float)(c[i] + s);
    }
}
inline float __shfl_xor_sync(unsigned, float v, int m) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31;
    W.fx[l] = v; wbar(); const float r = W.fx[l ^ m]; wbar(); return r;
}
// stmatrix.m8n8.x4 (not transposed): lanes 8m .. 8m + 7 give the addresses of matrix m's rows;
// register m of lane (g, t) holds row g's elements 2t, 2t + 1 (4 bytes at row address + 4t).
inline void stsm_x4(unsigned a, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    WX& W = g_wx[threadIdx.x >> 5]; const int l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    W.sa[l] = a; wbar();
    const unsigned r[4] = {r0, r1, r2, r3};
    for (int m = 0; m < 4; ++m) std::memcpy((char*)gdr_smem + W.sa[8 * m + g] + 4 * t, &r[m], 4);
    wbar();
}
