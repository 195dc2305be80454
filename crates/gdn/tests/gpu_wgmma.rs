//! The warpgroup-MMA primitives (`ops/common/wgmma.cuh`, sm_90a) on a real Hopper GPU: the
//! SW128 shared-memory layout, the K-major and MN-major descriptors and the accumulator fragment
//! mapping, through `wgmma_probe.cu`'s one-warpgroup GEMM C[64][N] = A B, compared bitwise with
//! the exact product (small-integer bf16 operands: every sum is exact in fp32). Run on the device
//! machine with `--include-ignored`; skipped (with a message) on GPUs before sm_90a.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gdn::device::cuda;

/// Small integers in [-3, 3] as bf16 bits (exact), from a fixed LCG.
fn ints(n: usize, seed: u64) -> (Vec<u16>, Vec<f64>) {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut bits = Vec::with_capacity(n);
    let mut vals = Vec::with_capacity(n);
    for _ in 0..n {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v = ((s >> 33) % 7) as i64 - 3;
        bits.push(half::bf16::from_f32(v as f32).to_bits());
        vals.push(v as f64);
    }
    (bits, vals)
}

/// Runs `wg_probe_n{n}_a{ta}_b{tb}_w{nb}` on A (64 x kdim), B (kdim x nb) stored as the kernel
/// reads them (nb = 64 for n = 32: the product uses B's columns 32 .. 63); `over`: (lbo_a, sbo_a, lbo_b, sbo_b) overrides (0: the header's). Returns the number
/// of wrong outputs and the first one's description.
fn probe(
    gpu: &std::sync::Arc<cuda::Gpu>,
    n: usize,
    ta: u32,
    tb: u32,
    kdim: usize,
    over: [i32; 4],
) -> (usize, String) {
    let (abits, av) = ints(64 * kdim, 1 + (n * 7 + kdim) as u64 + 3 * ta as u64);
    let nb = n.max(64);
    let (bbits, bv) = ints(nb * kdim, 99 + (n + kdim * 5) as u64 + 11 * tb as u64);
    // logical A(m, k), B(k, n) from the stored layouts
    let a_at = |m: usize, k: usize| {
        if ta == 1 {
            av[k * 64 + m]
        } else {
            av[m * kdim + k]
        }
    };
    let b_at = |k: usize, j: usize| {
        let j = j + nb - n;
        if tb == 1 {
            bv[k * nb + j]
        } else {
            bv[j * kdim + k]
        }
    };
    let ad = gpu.upload(&abits).unwrap();
    let bd = gpu.upload(&bbits).unwrap();
    let mut cd = gpu.zeros::<f32>(64 * n).unwrap();
    let f = gpu
        .function("wgmma_probe", &format!("wg_probe_n{n}_a{ta}_b{tb}_w{nb}"))
        .unwrap();
    let kk = kdim as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&ad.slice)
        .arg(&bd.slice)
        .arg(&mut cd.slice)
        .arg(&kk)
        .arg(&over[0])
        .arg(&over[1])
        .arg(&over[2])
        .arg(&over[3]);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.unwrap();
    let c = gpu.download(&cd).unwrap();
    let mut wrong = 0;
    let mut first = String::new();
    for m in 0..64 {
        for j in 0..n {
            let want: f64 = (0..kdim).map(|k| a_at(m, k) * b_at(k, j)).sum();
            if c[m * n + j] as f64 != want {
                if wrong == 0 {
                    first = format!("C({m}, {j}) = {} (want {want})", c[m * n + j]);
                }
                wrong += 1;
            }
        }
    }
    (wrong, first)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wgmma_gemm_every_majorness_matches_the_exact_product() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    if gpu.arch() != "sm_90a" {
        eprintln!("skipped: wgmma needs sm_90a ({})", gpu.arch());
        return;
    }
    let mut failed = Vec::new();
    for n in [64usize, 128, 32] {
        for ta in 0..2u32 {
            for tb in 0..2u32 {
                for kdim in [16usize, 64, 128] {
                    let (wrong, first) = probe(&gpu, n, ta, tb, kdim, [0; 4]);
                    eprintln!(
                        "n{n} a{ta} b{tb} k{kdim}: {wrong} of {} wrong {first}",
                        64 * n
                    );
                    if wrong > 0 {
                        failed.push((n, ta, tb, kdim));
                    }
                }
            }
        }
    }
    if !failed.is_empty() {
        // Search the leading / stride byte offsets of the failing cases' MN-major operands, so
        // the log says which encoding the hardware wants.
        let cands = [16i32, 128, 1024, 2048, 4096, 8192, 16384];
        for &(n, ta, tb, kdim) in &failed {
            let kp = kdim.div_ceil(64) * 64;
            for &l in &cands {
                for &s in &cands {
                    let mut over = [0i32; 4];
                    if ta == 1 {
                        over[0] = l;
                        over[1] = s;
                    }
                    if tb == 1 {
                        over[2] = l;
                        over[3] = s;
                    }
                    if ta == 0 && tb == 0 {
                        over = [l, s, l, s];
                    }
                    let (wrong, _) = probe(&gpu, n, ta, tb, kdim, over);
                    if wrong == 0 {
                        eprintln!("n{n} a{ta} b{tb} k{kdim} (k panel rows {kp}): passes with lbo {l}, sbo {s}");
                    }
                }
            }
        }
    }
    assert!(failed.is_empty(), "wgmma probes wrong: {failed:?}");
}
