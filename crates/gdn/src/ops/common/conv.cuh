// Device code shared by the causal depthwise conv kernels (`conv1d.cu`, `prep.cu`): the
// activation and its derivative, and the sequence of a token. Prepended (after common.cuh and
// conv_vec.cuh) to the modules that use it by backend/kernels.rs.
#pragma once

__device__ __forceinline__ float cv_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float cv_silu(float x) { return x * cv_sigmoid(x); }
__device__ __forceinline__ float cv_silu_grad(float x) {
    float s = cv_sigmoid(x);
    return s * (1.f + x * (1.f - s));
}

// Index s of the sequence holding token t (< cu[nseq]): cu[s] <= t < cu[s + 1].
__device__ __forceinline__ int cv_seq_of(const long long* __restrict__ cu, int nseq, long long t) {
    int lo = 0, hi = nseq;
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (cu[mid] <= t) lo = mid;
        else hi = mid;
    }
    return lo;
}

