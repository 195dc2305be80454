//! Pieces shared by the GPU benchmark examples (`bench_rule`, `bench_rule2`, `bench_decode`),
//! included by `#[path]`: deterministic inputs, CUDA-event timing with medians, and a device
//! pool that keeps freed memory.

#![allow(dead_code)]

use std::sync::Arc;

use cudarc::driver::sys;
use gdn::device::cuda::Gpu;
use rayon::prelude::*;

/// Deterministic pseudo-random normals (splitmix64 + Box-Muller), generated in parallel.
pub fn normals(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .into_par_iter()
        .map(|i| {
            let mix = |mut z: u64| {
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
                z ^ (z >> 31)
            };
            let a = mix(seed.wrapping_mul(0x9e3779b97f4a7c15) ^ (2 * i as u64));
            let b = mix(a ^ 0x5851f42d4c957f2d);
            let u1 = ((a >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// RMS relative difference of `a` from the reference `r`: sqrt(sum (a - r)^2 / sum r^2), f64
/// sums in element order.
#[allow(dead_code)] // not every bench compares outputs
pub fn rms_rel_diff(a: &[f32], r: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (a, r) in a.iter().zip(r) {
        num += ((a - r) as f64).powi(2);
        den += (*r as f64).powi(2);
    }
    (num / den).sqrt()
}

pub fn median(mut x: Vec<f32>) -> f64 {
    x.sort_by(|a, b| a.partial_cmp(b).unwrap());
    x[x.len() / 2] as f64
}

/// Keep freed device memory in the pool (like PyTorch's caching allocator) so the timed runs do
/// not measure the driver growing and trimming the pool.
pub fn keep_pool(gpu: &Gpu) {
    let ctx = gpu.stream().context();
    // SAFETY: plain driver calls on the current device's default pool.
    unsafe {
        let mut pool = std::mem::MaybeUninit::uninit();
        if sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
            == sys::CUresult::CUDA_SUCCESS
        {
            let mut v: u64 = u64::MAX;
            let _ = sys::cuMemPoolSetAttribute(
                pool.assume_init(),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut v as *mut u64 as *mut std::ffi::c_void,
            );
        }
    }
}

/// Median over `reps` runs of `f` (CUDA events on the GPU's stream) after `warmup` runs, ms.
pub fn time_ms(gpu: &Arc<Gpu>, warmup: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    let st = gpu.stream();
    let ctx = st.context();
    for _ in 0..warmup {
        f();
    }
    gpu.sync().unwrap();
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        let b = ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        a.record(st).unwrap();
        f();
        b.record(st).unwrap();
        t.push(a.elapsed_ms(&b).unwrap());
    }
    median(t)
}
