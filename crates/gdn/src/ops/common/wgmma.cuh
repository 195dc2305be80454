// Warpgroup matrix multiply (wgmma, sm_90a) primitives: bf16 operands from shared memory in the
// 128-byte-swizzle layout, fp32 accumulators in registers. Prepended by backend/kernels.rs
// (`headers`) to the modules that use it; every name starts with `wg_`. Without sm_90a
// (`__CUDA_ARCH_FEAT_SM90_ALL`) the instruction bodies trap, so a module still compiles for
// sm_80 and older Hopper targets; callers select wgmma kernels only on sm_90a.
//
// Shared-memory layout ("SW128 panel"): a [rows][64] bf16 tile, 128 bytes per row, whose 16-byte
// pieces are permuted within each row by XOR with (row mod 8): element (r, c) lives at byte
// r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2 of the panel. Panels start 1024-byte
// aligned. A wider tile is a sequence of panels of 64 columns (panel p at p * rows * 128).
// Bank-conflict free for 16-byte row-piece stores and for the tensor cores' reads.
//
// Operand majorness (PTX ISA 9.7.15.5.1.2): an operand whose K index runs along the panel's
// columns is K-major (A stored [m][k], B stored [n][k]); one whose M / N index runs along the
// columns is MN-major (A stored [k][m], B stored [k][n]: the transposed flag of the instruction).
//   K-major:  descriptor at the panel holding k0, + (k0 % 64) * 2 bytes; SBO = 1024 (8 rows of
//             128 bytes), LBO unused (16).
//   MN-major: descriptor at row k0 of the first M / N panel; LBO = the byte distance between
//             the 64-wide M / N panels, SBO = 1024 (8 k-rows).
//
// Accumulator fragment of m64nNk16 (per warpgroup of 128 threads; warp w = (tid / 32) % 4,
// g = lane / 4, t = lane % 4): d[4 j + 0, 1] = C(16 w + g, 8 j + 2 t + {0, 1}),
// d[4 j + 2, 3] = C(16 w + g + 8, 8 j + 2 t + {0, 1}): mma.sync's m16n8 C layout, N / 8 tiles.
//
// Order of use: write the operands to shared memory, wg_fence_proxy() in each writing thread,
// a barrier, wg_fence() (orders the accumulator registers), the wg_mma calls, wg_commit(),
// then wg_wait<0>() before reading the accumulators or overwriting the operands.

__device__ __forceinline__ void wg_unsupported() { asm volatile("trap;"); }

// Byte offset of bf16 element (r, c), c < 64, in an SW128 panel.
__device__ __forceinline__ unsigned wg_sw128(int r, int c) {
    return (unsigned)(r * 128 + ((((c >> 3) ^ r) & 7) << 4) + (c & 7) * 2);
}

// Byte offset of bf16 element (r, c) of a [rows][cols] tile of SW128 panels (cols % 64 == 0).
__device__ __forceinline__ unsigned wg_tile(int rows, int r, int c) {
    return (unsigned)((c >> 6) * rows * 128) + wg_sw128(r, c & 63);
}

// Shared-memory matrix descriptor: start address (shared window), leading / stride byte
// offsets, 128-byte swizzle (layout type 1).
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Descriptor of a K-major operand at k0 (a multiple of 16) of a tile of `rows` rows whose
// panels start at shared address `base`.
__device__ __forceinline__ unsigned long long wg_desc_k(unsigned base, int rows, int k0) {
    return wg_desc(base + (unsigned)((k0 >> 6) * rows * 128 + (k0 & 63) * 2), 16, 1024);
}

// Descriptor of an MN-major operand at k-row k0 (a multiple of 16) of a [krows][mn] tile of
// SW128 panels at shared address `base` (mn0: the first M / N column, a multiple of 64).
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned base, int krows, int k0, int mn0) {
    return wg_desc(base + (unsigned)((mn0 >> 6) * krows * 128 + k0 * 128), (unsigned)(krows * 128), 1024);
}

// desc with its start address moved by `bytes` (a multiple of 16): the address field holds
// shared-window bytes / 16 in 14 bits, and every shared address is below 2^18, so the field never
// carries into the next one. Descriptors for the k steps of a product are one descriptor plus
// constants (a 64-bit add each instead of rebuilding the fields).
__device__ __forceinline__ unsigned long long wg_desc_add(unsigned long long desc, unsigned bytes) {
    return desc + (unsigned long long)(bytes >> 4);
}

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits until at most N committed wgmma groups of this warp are pending.
template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Generic-proxy shared-memory writes made visible to the tensor cores (async proxy): each
// writing thread, before the barrier that precedes the wgmma.
__device__ __forceinline__ void wg_fence_proxy() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Keeps the compiler from moving reads / writes of accumulator registers across a wgmma.
template <int R>
__device__ __forceinline__ void wg_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (m64 x N fp32 fragments) = (acc ? d : 0) + A B over one k16 step. TA / TB: 0 K-major,
// 1 MN-major (transposed). da, db: descriptors (wg_desc_k / wg_desc_mn).
template <int TA, int TB>
__device__ __forceinline__ void wg_mma_n16(float (&d)[8], unsigned long long da, unsigned long long db, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, p, 1, 1, %11, %12;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#else
    wg_unsupported();
#endif
}

template <int TA, int TB>
__device__ __forceinline__ void wg_mma_n32(float (&d)[16], unsigned long long da, unsigned long long db, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#else
    wg_unsupported();
#endif
}

template <int TA, int TB>
__device__ __forceinline__ void wg_mma_n64(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#else
    wg_unsupported();
#endif
}

template <int TA, int TB>
__device__ __forceinline__ void wg_mma_n128(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#else
    wg_unsupported();
#endif
}

// wg_mma_n{16,32,64,128} chosen by the accumulator's size (N / 2 floats per thread).
template <int TA, int TB>
__device__ __forceinline__ void wg_mma(float (&d)[8], unsigned long long da, unsigned long long db, int acc) {
    wg_mma_n16<TA, TB>(d, da, db, acc);
}
template <int TA, int TB>
__device__ __forceinline__ void wg_mma(float (&d)[16], unsigned long long da, unsigned long long db, int acc) {
    wg_mma_n32<TA, TB>(d, da, db, acc);
}
template <int TA, int TB>
__device__ __forceinline__ void wg_mma(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    wg_mma_n64<TA, TB>(d, da, db, acc);
}
template <int TA, int TB>
__device__ __forceinline__ void wg_mma(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    wg_mma_n128<TA, TB>(d, da, db, acc);
}
