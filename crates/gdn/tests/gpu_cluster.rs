//! A thread-block cluster's fixed-order reduction through distributed shared memory on a real
//! Hopper GPU (`cluster_probe.cu`, sm_90): clusters of 4 CTAs each write a 64 x 128 fp32 partial
//! per step to their own shared memory, and CTA r sums rows 16 r .. 16 r + 15 of the four
//! partials in rank order. The partials are small integers, so every sum is exact: the result
//! is compared bitwise with the host's. Run on the device machine with `--include-ignored`;
//! skipped (with a message) on GPUs before sm_90.

use gdn::backend::launch::cluster_probe;
use gdn::device::cuda;

/// `cluster_probe.cu`'s `cl_probe_val`.
fn val(step: i64, rank: i64, e: i64) -> f32 {
    ((step * 7 + rank * 3 + e * 5 + (e >> 7)) % 5 - 2) as f32
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cluster_dsmem_reduction_is_exact_and_in_rank_order() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    if !gpu.arch().starts_with("sm_9") && !gpu.arch().starts_with("sm_1") {
        eprintln!("skipped: thread-block clusters need sm_90 ({})", gpu.arch());
        return;
    }
    let (clusters, steps) = (8usize, 37i32);
    let mut failures = Vec::new();
    for read in [1i32, 0] {
        let mut out = gpu.zeros::<f32>(clusters * 64 * 128).unwrap();
        cluster_probe(&gpu, clusters, steps, read == 1, &mut out).unwrap();
        let got = gpu.download(&out).unwrap();
        let mut wrong = 0;
        for c in 0..clusters {
            for e in 0..64 * 128 {
                // the sums in the kernel's order: step by step, rank 0 .. 3
                let mut want = 0f32;
                if read == 1 {
                    for s in 0..steps as i64 {
                        for q in 0..4 {
                            want += val(s, q, e as i64);
                        }
                    }
                }
                let x = got[c * 64 * 128 + e];
                if x.to_bits() != want.to_bits() {
                    if wrong == 0 {
                        failures.push(format!(
                            "read {read}: cluster {c} element {e} = {x}, want {want}"
                        ));
                    }
                    wrong += 1;
                }
            }
        }
        eprintln!("read {read}: {wrong} of {} wrong", clusters * 64 * 128);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
