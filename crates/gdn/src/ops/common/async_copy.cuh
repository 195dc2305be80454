// Asynchronous-copy and mbarrier primitives (inline PTX) for warp-specialized pipelines: a
// producer warp fills a ring of shared-memory stages, consumer warps wait on each stage's
// "full" mbarrier and release it on its "empty" mbarrier (no CTA-wide barrier per stage).
// Prepended by backend/kernels.rs (`headers`) to the modules that use it. Every name starts with
// `acp_` (gated_delta_rule.cu has older, differently named copies of some of these).
//
// Addresses are 32-bit shared-window offsets (`acp_smem`). An mbarrier is 8 bytes, 8-byte
// aligned. Its phase completes when its pending arrival count reaches zero (and, with
// transaction counts, when every expected byte has landed); `parity` names a phase by its
// number mod 2: a wait for parity p returns once the phase with parity p that is current or
// just past has completed. A fresh barrier is in phase 0, so waiting for parity 1 on it
// returns at once (the "previous" phase counts as complete).
//
// Target: mbarrier.init / arrive / test_wait and cp.async (+ .mbarrier.arrive.noinc) exist from
// sm_80; try_wait, expect_tx, the bulk copies, fence.proxy.async and setmaxnreg need sm_90
// (setmaxnreg: sm_90a). The sm_90-only bodies are empty below sm_90, so a module still compiles
// for sm_80; callers select their kernels only on sm_90 and newer.


__device__ __forceinline__ unsigned acp_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// mbarrier.init: `count` arrivals complete a phase. One thread, before any use; make it visible
// to the CTA with acp_fence_mbar_init() and a __syncthreads.
__device__ __forceinline__ void acp_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Orders the mbarrier inits before their use by other threads (with the barrier that follows).
__device__ __forceinline__ void acp_fence_mbar_init() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival (release semantics at CTA scope: this thread's earlier shared-memory reads and
// writes are ordered before any thread that then observes the phase complete).
__device__ __forceinline__ void acp_mbar_arrive(unsigned bar) {
    asm volatile("{ .reg .b64 acp_state; mbarrier.arrive.shared.b64 acp_state, [%0]; }" ::"r"(bar) : "memory");
}

// An arrival that fires when all of this thread's earlier cp.async copies have completed
// (their data is then visible to threads that wait on the barrier). `.noinc`: the barrier's
// expected count is not raised, so `init`'s count must include these arrivals.
__device__ __forceinline__ void acp_cp_async_arrive_noinc(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(bar) : "memory");
}

// Whether the phase of parity `parity` has completed (acquire: afterwards this thread sees what
// the arrivals released and the copies wrote). try_wait may suspend the thread for a
// system-dependent time before returning false.
__device__ __forceinline__ bool acp_mbar_try_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#else
    asm volatile(
        "{ .reg .pred p; mbarrier.test_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#endif
    return done != 0;
}

// Spin until the phase of parity `parity` has completed.
__device__ __forceinline__ void acp_mbar_wait(unsigned bar, unsigned parity) {
    while (!acp_mbar_try_wait(bar, parity)) {
    }
}

// One arrival that also expects `bytes` more transaction bytes this phase (bulk copies).
__device__ __forceinline__ void acp_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// 1-D bulk copy (the TMA engine without a tensor map) of `bytes` (a multiple of 16; both ends
// 16-byte aligned) global -> shared, completing `bytes` transactions on `bar`. It cannot
// zero-fill: a caller that needs zeros writes them (and orders them with acp_fence_proxy_async).
__device__ __forceinline__ void acp_bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
}

// Orders this thread's generic-proxy shared-memory accesses (plain ld / st, ldmatrix) before
// later async-proxy accesses (bulk copies) of the same memory: a consumer that read a stage
// calls it before releasing the stage to a bulk-copy producer. Not needed with cp.async (not
// the async proxy).
__device__ __forceinline__ void acp_fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// setmaxnreg (sm_90a): every warp of a warpgroup (4 consecutive warps, warp 4 i .. 4 i + 3)
// must execute the same instruction; a CTA whose thread count is not a multiple of 128 has a
// partial warpgroup, which may not use it. `dec` gives registers back to the SM's pool, `inc`
// waits until it can take them. N: a multiple of 8 in 24 .. 256.
template <int N>
__device__ __forceinline__ void acp_setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void acp_setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
