//! Times the CUDA gated delta rule (bf16 storage, Dk = Dv = 128, in-kernel l2norm, FLA's inputs:
//! g = logsigmoid(randn), beta = rand) at FLA's anchor cases: forward, and forward + backward, with
//! CUDA events, median of 10 after 2 warm-up runs. Prints the arithmetic and byte floors next to
//! our times and FLA 0.6.0's (9.40 ms fwd+bwd at B1 T32768 16/32 heads, 9.27 ms at B4 T8192, on the
//! same H200, 2026-11-30; `bench/NOTES.md` has the per-kernel history).
//!
//! `cargo run --release --example bench_rule` on a machine with a CUDA GPU.
//!
//! Modes (first argument):
//! - none: the table above with the kernels `cuda::forward` / `cuda::backward` run, which the
//!   environment names (printed first): by default (since 2026-12-04) prep9 (`gdr_prep9`, or
//!   `gdr_prep8` without GVA), the v9 forward on sm_90 (`gdr_fwd9*`) and the v6 backward with
//!   `gdr_grad10` on sm_90a; `GDN_RULE_PREP=v7` / `v6` and `GDN_RULE_FWD=v6l` / `v6` give earlier
//!   defaults (prep7, v6's prep; the lean v6 forward, the first cp.async loads). Plus issue
//!   13's packed row (6 sequences, 32768 tokens) and few-heads row
//!   (2 / 8 heads, T 32768) with the tokens/s of each row against the first. Since 2026-12-04
//!   the table times what the layer runs: `forward_saving` (the forward keeps its chunk
//!   inverses T) and `backward_saved` (its recompute reads them instead of solving); a
//!   `bench-rule-saved-t` line per row times `forward` + `backward` (solving again) beside it;
//! - `chain`: the scan's latency floor: per chunk step, v6's chain kernel (one CTA, 512
//!   dependent steps on resident operands, 1/2/4/8 warps, with and without the output
//!   products), then one CTA of the real scans (v5 `gdr_scan_fwd16`, v6 `gdr_fwd6` with its
//!   loads and output: cp.async, bulk copies, and without reloads) on a single 32768-token head;
//! - `variants`: v5 against v6 forward (every CTA width, cp.async, lean cp.async and bulk-copy
//!   loads) at B1 T32768 16/32 and B8 T4096 16/16, v6's chunk prep the one `GDN_RULE_PREP`
//!   names (prep9 by default), CUDA events, medians, per-kernel times, and v6's o against v5's
//!   (RMS relative difference);
//! - `v8`: the short list for the v8 forward (`FwdKernel::V8`, `gdr_fwd8*`, Dk split per warp
//!   pair): v8's chain kernel (`gdr_chain8`, 2 / 4 / 8 warps, with and without the output) beside
//!   v6's (1 / 2 warps), one CTA of the real fused kernels (V6Lean, V8) on one 32768-token head,
//!   then V6Lean (the default) against V8 (auto, every width, two and three stages) at B1 T32768
//!   16/32 and B8 T4096 16/16 with per-kernel times and o against V6Lean's, then the default
//!   backward with `gdr_hrec6` against `gdr_hrec8` (`GDN_RULE_HREC=v8`) there, then the
//!   backward with `gdr_bwd6` against `gdr_bwd8` (`GDN_RULE_BWD_SCAN=v8`; with hrec6 and hrec8,
//!   the overlap on and off); `chain` and `variants` include the V8 rows too;
//! - `v9`: the fused forward with a producer warp (`FwdKernel::V9`, `gdr_fwd9*`) against v8
//!   (`gdr_fwd8*`) in the same run: v8's chain kernel rows (the floor), one CTA of each on one
//!   32768-token head, then B1 T32768 16/32 and B8 T4096 16/16 (auto widths, every width, two
//!   stages, both producers at 8 warps) with per-kernel times and o against v8's bit for bit;
//! - `bwd`: v5 against the v6 backward pieces (`BwdKernel::V6`: both, each alone, every CTA
//!   width) at the same two cases: backward alone (after one default forward), CUDA events,
//!   medians, per-kernel times, peak device memory, and each gradient against v5's; also
//!   `gdr_grad7` (the default) against `gdr_grad6` (`GDN_RULE_BWD=v6`); the recompute's prep is
//!   `GDN_RULE_PREP`'s (prep9 by default);
//! - `prep`: the v6 pipeline's chunk prep, v6 (`gdr_l2norm2` x2 + `gdr_prep6` + `gdr_qk6`)
//!   against prep7 (`gdr_prep7`, and `gdr_prep7f` without the hi/lo split), prep8 and prep9 (the
//!   same bits as prep7: `gdr_prep8`, `gdr_prep9`) at the same two
//!   cases: the prep alone, the v6 forward (first cp.async loads) and the v6 backward with each,
//!   medians of 10, per-kernel times, o against the v6 prep's;
//! - `grad8`: the default backward with `gdr_grad7` against `gdr_grad8` (`GDN_RULE_GRAD=v8`, two
//!   CTAs per SM) at B1 T32768 16/32 and B8 T4096 16/16: backward alone, medians of 10,
//!   per-kernel times, each gradient against grad7's. `GDN_RULE_GRAD=v8` also makes the default
//!   table (no argument) run gdr_grad8;
//! - `grad10`: the same with `gdr_grad10` (`GDN_RULE_GRAD=v10`: persistent, warp-specialized,
//!   wgmma, sm_90a) against `gdr_grad7`; `GDN_RULE_GRAD=v10` also makes the default table run it;
//! - `ws16`: the default backward (gdr_grad10 on sm_90a) with fp32 D / dD workspaces against
//!   bf16 ones (`set_ws16`, the default); every output must be bitwise equal (diff 0);
//! - `cluster`: the step of a fused reverse scan + gradients over a head's four column CTAs
//!   (`bench/notes/fused-bwd-plan.md`): `cluster_probe.cu`'s clusters of 4 CTAs each reducing a
//!   64 x 128 fp32 partial through distributed shared memory in rank order, 512 steps, 32 and
//!   132 clusters, with and without the reads (the cluster barrier alone): us per step;
//! - `v10`: the default forward (v9) against the opt-in v10 (`GDN_RULE_FWD=v10`: D rebuilt in
//!   the scan, the prep without W and U) and v10f (`v10f`: T diag(beta)'s hi part only) at B1 /
//!   B4 16/32 and B8 16/16: forward ms, per-kernel times, o against v9's;
//! - `g10ratio`: the default backward at B8 T4096, 16 value heads over 16 / 8 / 4 key heads, fp32
//!   and bf16 D / dD workspaces: per-kernel times (gdr_grad10's cost per item against per value
//!   head);
//! - `bwd9`: the same with the reverse scan `gdr_bwd9` (`GDN_RULE_BWD_SCAN=v9`: gdr_bwd8 with a
//!   producer warp) against the default's; its outputs must equal bwd8's bitwise (diff 0);
//! - `bwd10`: the same with the v10 backward scans (`GDN_RULE_BWD_SCAN=v10`: the prep writes T
//!   diag(beta) instead of W and U, `gdr_hrec10` and `gdr_bwd10` rebuild them) against the
//!   default's (another rounding: the diff is the difference, not zero). Both solve for T here
//!   (`backward_with`); the default table with `GDN_RULE_BWD_SCAN=v10` runs them after a
//!   forward that keeps T, as the layer does (`gdr_prep9to`);
//! - `hrec10`: the same with only the recompute on v10's operands (`gdr_hrec10` beside the
//!   default reverse scan, the prep writing T diag(beta) and W, no U; the default on sm_90 since
//!   session 20) against gdr_hrec6 (the prep writing W and U).

#[path = "common/bench.rs"]
mod bench;
use bench::*;

use std::sync::Arc;

use gdn::backend::launch::{profile_start, profile_take};
use gdn::device::cuda::{self, DBuf, DType, GBuf, Gpu};
use gdn::ops::gated_delta_rule::cuda::{
    backward as backward_cuda, backward_saved, backward_with, backward_with_prep, chain6, chain8,
    forward as forward_cuda, forward_saving, forward_with, forward_with_prep, prep_only,
    set_backward_overlap, set_bwd10, set_bwd8, set_bwd9, set_grad10, set_grad8, set_hrec10,
    set_hrec8, set_v6_stages, set_v9_producer, set_ws16, BwdKernel, ChainInputs, FwdKernel,
    PrepKernel,
};
use gdn::ops::gated_delta_rule::{RuleOpts, RuleShape, CHUNK};
use gdn::Seqs;

/// FLA 0.6.0 on the H200 (bf16, K = V = 128, median of 10): (fwd ms, fwd+bwd ms).
const CASES: &[(usize, usize, usize, usize, f64, f64)] = &[
    // B, T, Hk, Hv, FLA fwd, FLA fwd+bwd
    (1, 32768, 16, 32, 2.50, 9.40),
    (4, 8192, 16, 32, 2.30, 9.27),
    (8, 4096, 16, 16, 1.25, 5.00),
    (16, 2048, 16, 16, 1.45, 4.54),
];

/// Issue 13's other two rows (no FLA figure): packed sequences of these lengths (32768 tokens,
/// 16 key / 32 value heads), and few heads over a long sequence (B1 T32768, 2 key / 8 value heads;
/// target: >= 60% of the first row's tokens/s).
const PACKED_LENS: &[usize] = &[4096, 1000, 7000, 333, 12000, 8339];
const FEW_HEADS: (usize, usize, usize, usize) = (1, 32768, 2, 8);

/// One row of the table: the batch layout, its label and FLA's figures when known.
struct Case {
    label: String,
    seqs: Seqs,
    hk: usize,
    hv: usize,
    fla: Option<(f64, f64)>,
}

fn cases() -> Vec<Case> {
    let mut v: Vec<Case> = CASES
        .iter()
        .map(|&(b, t, hk, hv, f, fb)| Case {
            label: format!("B{b} T{t} {hk}/{hv}"),
            seqs: Seqs::uniform(b, t),
            hk,
            hv,
            fla: Some((f, fb)),
        })
        .collect();
    let mut cu = vec![0u64];
    for &l in PACKED_LENS {
        cu.push(cu.last().unwrap() + l as u64);
    }
    let tokens = *cu.last().unwrap() as usize;
    v.push(Case {
        label: format!("packed {PACKED_LENS:?} 16/32").replace(' ', ""),
        seqs: Seqs::packed(&cu, tokens).unwrap(),
        hk: 16,
        hv: 32,
        fla: None,
    });
    let (b, t, hk, hv) = FEW_HEADS;
    v.push(Case {
        label: format!("B{b} T{t} {hk}/{hv}"),
        seqs: Seqs::uniform(b, t),
        hk,
        hv,
        fla: None,
    });
    v
}

/// Measured ceilings of the H200 (2026-11-30): bf16 dense matmul, and device copy bandwidth.
const BF16_FLOPS: f64 = 750e12;
const FP32_FLOPS: f64 = 67e12;
const COPY_BPS: f64 = 4.13e12;

fn main() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    keep_pool(&gpu);
    println!("{gpu:?}");
    match std::env::args().nth(1).as_deref() {
        Some("chain") => return chain(&gpu),
        Some("variants") => return variants(&gpu),
        Some("v8") => return v8(&gpu),
        Some("v9") => return v9(&gpu),
        Some("bwd") => return bwd_variants(&gpu),
        Some("grad8") => {
            return bwd_piece_variants(
                &gpu,
                "per-chunk gradients",
                "gdr_grad7",
                "gdr_grad8",
                set_grad8,
            )
        }
        Some("grad10") => {
            return bwd_piece_variants(
                &gpu,
                "per-chunk gradients",
                "gdr_grad7",
                "gdr_grad10",
                set_grad10,
            )
        }
        Some("ws16") => {
            return bwd_piece_variants(&gpu, "D / dD workspaces", "fp32-ws", "bf16-ws", set_ws16)
        }
        Some("bwd9") => {
            return bwd_piece_variants(
                &gpu,
                "reverse scan",
                "the default scan",
                "gdr_bwd9",
                set_bwd9,
            )
        }
        Some("hrec10") => {
            return bwd_piece_variants(
                &gpu,
                "state recompute",
                "gdr_hrec6 (the default before session 20)",
                "gdr_hrec10",
                set_hrec10,
            )
        }
        Some("bwd10") => {
            return bwd_piece_variants(
                &gpu,
                "backward scans",
                "the default scans",
                "gdr_bwd10",
                set_bwd10,
            )
        }
        Some("prep") => return prep_variants(&gpu),
        Some("cluster") => return cluster_probe(&gpu),
        Some("g10ratio") => return g10_ratio(&gpu),
        Some("v10") => return v10(&gpu),
        _ => {}
    }
    println!(
        "bench-rule-kernels-used | prep {:?} | forward {:?} | backward {:?} (GDN_RULE_PREP={:?}, GDN_RULE_FWD={:?}, GDN_RULE_BWD={:?})",
        PrepKernel::from_env(),
        FwdKernel::from_env(),
        BwdKernel::from_env(),
        std::env::var("GDN_RULE_PREP").ok(),
        std::env::var("GDN_RULE_FWD").ok(),
        std::env::var("GDN_RULE_BWD").ok(),
    );
    let (dk, dv) = (128usize, 128usize);
    let (c, k, v) = (CHUNK as f64, dk as f64, dv as f64);
    // MACs per token per value head (reference/fla-gated-delta-rule.md 7.5), as FLOPs.
    let fwd_flop = 2.0 * (3.0 * c * k + 2.0 * c * v + 3.0 * k * v);
    let bwd_flop = 2.0 * (9.0 * c * k + 5.0 * c * v + 8.0 * k * v + 2.0 * c * c);
    println!(
        "bench-rule | case | ours fwd ms | FLA fwd ms | ours/FLA | ours fwd+bwd ms | FLA fwd+bwd ms | ours/FLA | floor fwd bf16-MMA/fp32-core/bytes ms | floor fwd+bwd bf16-MMA/fp32-core/bytes ms"
    );
    // Tokens x value heads per ms of fwd+bwd of the first row, for the few-heads row's ratio.
    let mut first_rate = None;
    // BENCH_RULE_ROWS=0,2: only those rows of the table (0-based), for short device calls.
    let rows: Option<Vec<usize>> = std::env::var("BENCH_RULE_ROWS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect());
    for (row, case) in cases().into_iter().enumerate() {
        if rows.as_ref().is_some_and(|r| !r.contains(&row)) {
            continue;
        }
        let Case {
            label,
            seqs,
            hk,
            hv,
            fla,
        } = case;
        let tokens = seqs.tokens();
        let shape = RuleShape { hk, hv, dk, dv };
        let opts = RuleOpts {
            scale: 1.0 / (dk as f32).sqrt(),
            l2norm_in_kernel: true,
        };
        let up = |x: &[f32]| DBuf::upload(&gpu, x, DType::Bf16).unwrap();
        let q = up(&normals(tokens * hk * dk, 1));
        let kk = up(&normals(tokens * hk * dk, 2));
        let vv = up(&normals(tokens * hv * dv, 3));
        let g_host: Vec<f32> = normals(tokens * hv, 4)
            .into_iter()
            .map(|z| -((-z).exp().ln_1p()))
            .collect();
        let g: GBuf<f32> = gpu.upload(&g_host).unwrap();
        let beta_host: Vec<f32> = normals(tokens * hv, 5)
            .into_iter()
            .map(|z| 0.5 * (1.0 + libm_erf(z / std::f32::consts::SQRT_2)))
            .collect();
        let beta = up(&beta_host);
        let d_o = up(&normals(tokens * hv * dv, 6));
        // The forward keeping its chunk inverses and the backward reading them (what the layer
        // runs since 2026-12-04); the line after the table times the backward that solves again.
        let fwd = || {
            let r = forward_saving(
                &gpu, &q, &kk, &vv, &g, &beta, &seqs, shape, opts, None, false,
            )
            .unwrap();
            drop(r);
        };
        let t_f = time_ms(&gpu, 2, 10, fwd);
        let run_saved = || {
            let (o, _, t) = forward_saving(
                &gpu, &q, &kk, &vv, &g, &beta, &seqs, shape, opts, None, false,
            )
            .unwrap();
            let gr = backward_saved(
                &gpu,
                &q,
                &kk,
                &vv,
                &g,
                &beta,
                &seqs,
                shape,
                opts,
                None,
                &d_o,
                None,
                t.as_ref(),
            )
            .unwrap();
            (o, gr, t)
        };
        let fwd_bwd = || drop(run_saved());
        let t_fb = time_ms(&gpu, 2, 10, fwd_bwd);
        let fwd_bwd_solve = || {
            let (o, _) = forward_cuda(
                &gpu, &q, &kk, &vv, &g, &beta, &seqs, shape, opts, None, false,
            )
            .unwrap();
            let gr = backward_cuda(
                &gpu, &q, &kk, &vv, &g, &beta, &seqs, shape, opts, None, &d_o, None,
            )
            .unwrap();
            drop((o, gr));
        };
        let t_f_solve = time_ms(&gpu, 1, 10, || {
            drop(
                forward_cuda(
                    &gpu, &q, &kk, &vv, &g, &beta, &seqs, shape, opts, None, false,
                )
                .unwrap(),
            )
        });
        let t_fb_solve = time_ms(&gpu, 1, 10, fwd_bwd_solve);
        println!(
            "bench-rule-saved-t | {label} | keeping T: fwd {t_f:.2} fwd+bwd {t_fb:.2} ms; solving again in backward: fwd {t_f_solve:.2} fwd+bwd {t_fb_solve:.2} ms ({:+.2} ms)",
            t_fb - t_fb_solve
        );
        // The same with the backward's two scans one after the other (the default runs them
        // side by side on two streams).
        set_backward_overlap(false);
        let t_fb_seq = time_ms(&gpu, 1, 10, fwd_bwd);
        set_backward_overlap(true);
        println!(
            "bench-rule-overlap | {label} | fwd+bwd {t_fb:.2} ms with the scans side by side, {t_fb_seq:.2} ms in order ({:+.2} ms)",
            t_fb - t_fb_seq
        );
        let th = (tokens * hv) as f64;
        // Bytes: forward reads q, k, v, g, beta and writes o; backward also reads d_o and
        // writes dq, dk, dv, dg, dbeta (bf16 storage, g / dg fp32).
        let qk_b = 2.0 * (tokens * hk * dk * 2) as f64;
        let v_b = (tokens * hv * dv * 2) as f64;
        let gb_b = (tokens * hv * (4 + 2)) as f64;
        let fwd_bytes = qk_b + 2.0 * v_b + gb_b;
        let bwd_bytes = 2.0 * qk_b + 3.0 * v_b + 2.0 * gb_b;
        let fl_f = fwd_flop * th;
        let fl_fb = (fwd_flop + bwd_flop) * th;
        let ratio = |ours: f64, theirs: Option<f64>| match theirs {
            Some(x) => (format!("{x:.2}"), format!("{:.2}", ours / x)),
            None => ("n/a".to_string(), "n/a".to_string()),
        };
        let (fla_f, r_f) = ratio(t_f, fla.map(|x| x.0));
        let (fla_fb, r_fb) = ratio(t_fb, fla.map(|x| x.1));
        println!(
            "bench-rule | {label} | {t_f:.2} | {fla_f} | {r_f} | {t_fb:.2} | {fla_fb} | {r_fb} | {:.3}/{:.2}/{:.3} | {:.3}/{:.2}/{:.3}",
            fl_f / BF16_FLOPS * 1e3,
            fl_f / FP32_FLOPS * 1e3,
            fwd_bytes / COPY_BPS * 1e3,
            fl_fb / BF16_FLOPS * 1e3,
            fl_fb / FP32_FLOPS * 1e3,
            (fwd_bytes + bwd_bytes) / COPY_BPS * 1e3,
        );
        // Tokens/s (fwd+bwd) against the first row's: issue 13's few-heads target is >= 60%.
        let rate = tokens as f64 / t_fb;
        let first = *first_rate.get_or_insert(rate);
        println!(
            "bench-rule-rate | {label} | {:.1} M tokens/s fwd+bwd | {:.0}% of the first row's",
            rate / 1e3,
            100.0 * rate / first
        );
        println!(
            "bench-rule-mem | {label} | peak device bytes {:.2} GiB",
            gpu.peak_bytes() as f64 / (1u64 << 30) as f64
        );
        gpu.reset_peak();
        // One more forward + backward with every kernel timed on its own.
        profile_start();
        drop(run_saved());
        let prof = profile_take();
        let line: Vec<String> = prof
            .iter()
            .map(|(n, ms, c)| format!("{n}={ms:.2}ms/{c}"))
            .collect();
        println!("bench-rule-kernels | {label} | {}", line.join(" "));
    }
}

/// erf (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7): enough for sigmoid-like test inputs.
fn libm_erf(x: f32) -> f32 {
    let s = x.signum();
    let x = x.abs() as f64;
    let t = 1.0 / (1.0 + 0.3275911 * x);
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    s * y as f32
}

/// Inputs of one rule call (bf16 storage, FLA's distributions), on the device.
struct Inputs {
    q: DBuf,
    k: DBuf,
    v: DBuf,
    g: GBuf<f32>,
    beta: DBuf,
    seqs: Seqs,
    shape: RuleShape,
    opts: RuleOpts,
}

fn inputs(
    gpu: &Arc<Gpu>,
    b: usize,
    t: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
) -> Inputs {
    let tokens = b * t;
    let up = |x: &[f32]| DBuf::upload(gpu, x, DType::Bf16).unwrap();
    let g_host: Vec<f32> = normals(tokens * hv, 4)
        .into_iter()
        .map(|z| -((-z).exp().ln_1p()))
        .collect();
    let beta_host: Vec<f32> = normals(tokens * hv, 5)
        .into_iter()
        .map(|z| 0.5 * (1.0 + libm_erf(z / std::f32::consts::SQRT_2)))
        .collect();
    Inputs {
        q: up(&normals(tokens * hk * dk, 1)),
        k: up(&normals(tokens * hk * dk, 2)),
        v: up(&normals(tokens * hv * dv, 3)),
        g: gpu.upload(&g_host).unwrap(),
        beta: up(&beta_host),
        seqs: Seqs::uniform(b, t),
        shape: RuleShape { hk, hv, dk, dv },
        opts: RuleOpts {
            scale: 1.0 / (dk as f32).sqrt(),
            l2norm_in_kernel: true,
        },
    }
}

fn fwd(gpu: &Arc<Gpu>, x: &Inputs, kernel: FwdKernel) -> DBuf {
    forward_with(
        gpu, &x.q, &x.k, &x.v, &x.g, &x.beta, &x.seqs, x.shape, x.opts, None, false, kernel,
    )
    .unwrap()
    .0
}

/// One forward with every kernel timed on its own.
fn kernel_times(gpu: &Arc<Gpu>, x: &Inputs, kernel: FwdKernel) -> Vec<(String, f64, usize)> {
    gpu.sync().unwrap();
    profile_start();
    drop(fwd(gpu, x, kernel));
    gpu.sync().unwrap();
    profile_take()
}

fn fmt_times(p: &[(String, f64, usize)]) -> String {
    p.iter()
        .map(|(n, ms, c)| format!("{n}={ms:.3}ms/{c}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn kernel_ms(p: &[(String, f64, usize)], prefix: &str) -> f64 {
    p.iter()
        .filter(|(n, _, _)| n.starts_with(prefix))
        .map(|(_, ms, _)| ms)
        .sum()
}

const STEPS: usize = 512;

/// The scan's latency floor (see the module doc).
fn chain(gpu: &Arc<Gpu>) {
    let bits = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    let (c, dk) = (CHUNK, 128usize);
    let w: Vec<f32> = normals(c * dk, 11).iter().map(|x| 0.05 * x).collect();
    let k: Vec<f32> = normals(c * dk, 12)
        .iter()
        .map(|x| x / (dk as f32).sqrt())
        .collect();
    let a: Vec<f32> = normals(c * c, 13).iter().map(|x| 0.1 * x).collect();
    let gam: Vec<f32> = (0..c).map(|i| -0.02 * (i + 1) as f32).collect();
    println!("bench-chain | kernel | warps | output | us per chunk step (median of 10, {STEPS} steps, one CTA)");
    for (warps, output) in [
        (1, false),
        (2, false),
        (4, false),
        (8, false),
        (1, true),
        (2, true),
    ] {
        let x = ChainInputs {
            w: gpu.upload(&bits(&w)).unwrap(),
            k: gpu.upload(&bits(&k)).unwrap(),
            a: gpu.upload(&bits(&a)).unwrap(),
            u: gpu.upload(&normals(c * 16 * warps, 14)).unwrap(),
            gam: gpu.upload(&gam).unwrap(),
        };
        let ms = time_ms(gpu, 2, 10, || {
            drop(chain6(gpu, &x, warps, output, STEPS).unwrap());
        });
        let s = gpu
            .download(&chain6(gpu, &x, warps, output, STEPS).unwrap())
            .unwrap();
        let finite = s.iter().all(|v| v.is_finite());
        println!(
            "bench-chain | gdr_chain6 (bf16 mma.sync, state in registers) | {warps} | {output} | {:.3} (state finite: {finite})",
            ms * 1e3 / STEPS as f64
        );
    }
    chain8_rows(gpu, &w, &k, &a, &gam);
    // One CTA of the real scans on one 32768-token head: v5's scan (BV 16, 256 threads,
    // TF32, S in shared memory) and v6's fused kernel (1 warp for Dv 16, 2 warps for Dv 32).
    for dv in [16usize, 32] {
        let x = inputs(gpu, 1, 32768, 1, 1, 128, dv);
        let warps = dv / 16;
        for (kernel, stages) in [
            (FwdKernel::V5, 0),
            (FwdKernel::V6 { warps }, 2),
            (FwdKernel::V6 { warps }, 3),
            (FwdKernel::V6Lean { warps }, 2),
            (FwdKernel::V6Lean { warps }, 3),
            (FwdKernel::V6Bulk { warps }, 2),
            (FwdKernel::V6Bulk { warps }, 3),
            (FwdKernel::V6NoReload { warps }, 2),
            (FwdKernel::V8 { warps: 2 * warps }, 2),
            (FwdKernel::V8 { warps: 2 * warps }, 3),
        ] {
            set_v6_stages(stages);
            drop(fwd(gpu, &x, kernel)); // compile + warm up
            let mut ms = Vec::new();
            let mut line = String::new();
            for _ in 0..5 {
                let p = kernel_times(gpu, &x, kernel);
                let m = match kernel {
                    FwdKernel::V5 => kernel_ms(&p, "gdr_scan_fwd"),
                    FwdKernel::V8 { .. } => kernel_ms(&p, "gdr_fwd8"),
                    _ => kernel_ms(&p, "gdr_fwd6"),
                };
                ms.push(m as f32);
                line = fmt_times(&p);
            }
            let m = median(ms);
            println!(
                "bench-chain | one CTA of the scan, Dv {dv}, {kernel:?} stages {stages} | {:.3} us per chunk step | {line}",
                m * 1e3 / STEPS as f64
            );
            set_v6_stages(0);
        }
    }
}

/// v8's chain kernel rows (operands as `chain`'s).
fn chain8_rows(gpu: &Arc<Gpu>, w: &[f32], k: &[f32], a: &[f32], gam: &[f32]) {
    let bits = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    for output in [false, true] {
        for warps in [2usize, 4, 8] {
            let x = ChainInputs {
                w: gpu.upload(&bits(w)).unwrap(),
                k: gpu.upload(&bits(k)).unwrap(),
                a: gpu.upload(&bits(a)).unwrap(),
                u: gpu.upload(&normals(CHUNK * 8 * warps, 14)).unwrap(),
                gam: gpu.upload(gam).unwrap(),
            };
            let ms = time_ms(gpu, 2, 10, || {
                drop(chain8(gpu, &x, warps, output, STEPS).unwrap());
            });
            let s = gpu
                .download(&chain8(gpu, &x, warps, output, STEPS).unwrap())
                .unwrap();
            let finite = s.iter().all(|v| v.is_finite());
            println!(
                "bench-chain | gdr_chain8 (Dk split per warp pair, {} columns) | {warps} | {output} | {:.3} (state finite: {finite})",
                8 * warps,
                ms * 1e3 / STEPS as f64
            );
        }
    }
}

/// v9 against v8 (see the module doc).
fn v9(gpu: &Arc<Gpu>) {
    let bits = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    let (c, dk) = (CHUNK, 128usize);
    let w: Vec<f32> = normals(c * dk, 11).iter().map(|x| 0.05 * x).collect();
    let k: Vec<f32> = normals(c * dk, 12)
        .iter()
        .map(|x| x / (dk as f32).sqrt())
        .collect();
    let a: Vec<f32> = normals(c * c, 13).iter().map(|x| 0.1 * x).collect();
    let gam: Vec<f32> = (0..c).map(|i| -0.02 * (i + 1) as f32).collect();
    println!("bench-chain | kernel | warps | output | us per chunk step (median of 10, {STEPS} steps, one CTA)");
    chain8_rows(gpu, &w, &k, &a, &gam);
    // One CTA of each fused kernel on one 32768-token head (Dv 32: 4 compute warps).
    let x = inputs(gpu, 1, 32768, 1, 1, 128, 32);
    for (kernel, stages) in [
        (FwdKernel::V8 { warps: 4 }, 3),
        (FwdKernel::V9 { warps: 4 }, 3),
        (FwdKernel::V9 { warps: 4 }, 2),
        (FwdKernel::V8 { warps: 2 }, 3),
        (FwdKernel::V9 { warps: 2 }, 3),
    ] {
        set_v6_stages(stages);
        drop(fwd(gpu, &x, kernel));
        let pre = if matches!(kernel, FwdKernel::V9 { .. }) {
            "gdr_fwd9"
        } else {
            "gdr_fwd8"
        };
        let mut ms = Vec::new();
        for _ in 0..5 {
            let p = kernel_times(gpu, &x, kernel);
            ms.push(kernel_ms(&p, pre) as f32);
        }
        println!(
            "bench-chain | one CTA of the scan, Dv 32, {kernel:?} stages {stages} | {:.3} us per chunk step",
            median(ms) * 1e3 / STEPS as f64
        );
        set_v6_stages(0);
    }
    println!(
        "bench-v9 | case | kernel | fwd ms (median of 10) | per kernel | o vs V8 (same width): bf16 elements that differ"
    );
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        // (kernel, two stages, producer warps at 8 compute warps: 0 default)
        let mut runs = Vec::new();
        for warps in [0, 2, 4, 8] {
            runs.push((FwdKernel::V8 { warps }, false, 0));
            runs.push((FwdKernel::V9 { warps }, false, 0));
        }
        runs.push((FwdKernel::V9 { warps: 8 }, false, 1));
        runs.push((FwdKernel::V8 { warps: 4 }, true, 0));
        runs.push((FwdKernel::V9 { warps: 4 }, true, 0));
        let mut base: Vec<(usize, Vec<u16>)> = Vec::new();
        for (kernel, two, producer) in runs {
            set_v6_stages(if two { 2 } else { 0 });
            set_v9_producer(producer);
            let ms = time_ms(gpu, 2, 10, || drop(fwd(gpu, &x, kernel)));
            let p = kernel_times(gpu, &x, kernel);
            let o = bits(&fwd(gpu, &x, kernel).download().unwrap());
            let cmp = match kernel {
                FwdKernel::V8 { warps } => {
                    base.push((warps, o));
                    String::from("(reference)")
                }
                FwdKernel::V9 { warps } => {
                    let r = &base.iter().find(|(w, _)| *w == warps).unwrap().1;
                    let diff = r.iter().zip(&o).filter(|(a, b)| a != b).count();
                    format!("{diff} of {}", o.len())
                }
                _ => unreachable!(),
            };
            println!(
                "bench-v9 | B{b} T{t} {hk}/{hv} | {kernel:?}{}{} | {ms:.3} | {} | {cmp}",
                if two { " 2 stages" } else { "" },
                if producer == 1 {
                    " producer 1 warp"
                } else {
                    ""
                },
                fmt_times(&p),
            );
            set_v9_producer(0);
            set_v6_stages(0);
        }
        gpu.reset_peak();
    }
}

/// The v8 short list (see the module doc).
fn v8(gpu: &Arc<Gpu>) {
    let bits = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    let (c, dk) = (CHUNK, 128usize);
    let w: Vec<f32> = normals(c * dk, 11).iter().map(|x| 0.05 * x).collect();
    let k: Vec<f32> = normals(c * dk, 12)
        .iter()
        .map(|x| x / (dk as f32).sqrt())
        .collect();
    let a: Vec<f32> = normals(c * c, 13).iter().map(|x| 0.1 * x).collect();
    let gam: Vec<f32> = (0..c).map(|i| -0.02 * (i + 1) as f32).collect();
    println!("bench-chain | kernel | warps | output | us per chunk step (median of 10, {STEPS} steps, one CTA)");
    for (warps, output) in [(1, false), (2, false), (1, true), (2, true)] {
        let x = ChainInputs {
            w: gpu.upload(&bits(&w)).unwrap(),
            k: gpu.upload(&bits(&k)).unwrap(),
            a: gpu.upload(&bits(&a)).unwrap(),
            u: gpu.upload(&normals(c * 16 * warps, 14)).unwrap(),
            gam: gpu.upload(&gam).unwrap(),
        };
        let ms = time_ms(gpu, 2, 10, || {
            drop(chain6(gpu, &x, warps, output, STEPS).unwrap());
        });
        println!(
            "bench-chain | gdr_chain6 | {warps} | {output} | {:.3}",
            ms * 1e3 / STEPS as f64
        );
    }
    chain8_rows(gpu, &w, &k, &a, &gam);
    // One CTA of the fused kernels on one 32768-token head (Dv 32: V6Lean 2 warps, V8 4).
    let x = inputs(gpu, 1, 32768, 1, 1, 128, 32);
    for (kernel, stages) in [
        (FwdKernel::V6Lean { warps: 2 }, 3),
        (FwdKernel::V8 { warps: 4 }, 2),
        (FwdKernel::V8 { warps: 4 }, 3),
        (FwdKernel::V8 { warps: 2 }, 3),
    ] {
        set_v6_stages(stages);
        drop(fwd(gpu, &x, kernel));
        let mut ms = Vec::new();
        for _ in 0..5 {
            let p = kernel_times(gpu, &x, kernel);
            let pre = if matches!(kernel, FwdKernel::V8 { .. }) {
                "gdr_fwd8"
            } else {
                "gdr_fwd6"
            };
            ms.push(kernel_ms(&p, pre) as f32);
        }
        println!(
            "bench-chain | one CTA of the scan, Dv 32, {kernel:?} stages {stages} | {:.3} us per chunk step",
            median(ms) * 1e3 / STEPS as f64
        );
        set_v6_stages(0);
    }
    println!("bench-v8 | case | kernel | fwd ms (median of 10) | per kernel | o vs V6Lean");
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let base = fwd(gpu, &x, FwdKernel::V6Lean { warps: 0 })
            .download()
            .unwrap();
        let mut runs = vec![(FwdKernel::V6Lean { warps: 0 }, false)];
        for warps in [0, 2, 4, 8] {
            runs.push((FwdKernel::V8 { warps }, false));
        }
        runs.push((FwdKernel::V8 { warps: 2 }, true));
        runs.push((FwdKernel::V8 { warps: 4 }, true));
        for (kernel, two) in runs {
            set_v6_stages(if two { 2 } else { 0 });
            let ms = time_ms(gpu, 2, 10, || drop(fwd(gpu, &x, kernel)));
            let p = kernel_times(gpu, &x, kernel);
            let o = fwd(gpu, &x, kernel).download().unwrap();
            let finite = o.iter().all(|a| a.is_finite());
            println!(
                "bench-v8 | B{b} T{t} {hk}/{hv} | {kernel:?}{} | {ms:.3} | {} | RMS rel diff {:.2e}, finite {finite}",
                if two { " 2 stages" } else { "" },
                fmt_times(&p),
                rms_rel_diff(&o, &base)
            );
            set_v6_stages(0);
        }
        gpu.reset_peak();
    }
    // The backward (default kernels) with gdr_hrec6 against gdr_hrec8 (v8's split recompute).
    println!(
        "bench-hrec8 | case | recompute | bwd ms (median of 10) | per kernel | grads vs hrec6"
    );
    let v7 = BwdKernel::from_env();
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let d_o = DBuf::upload(gpu, &normals(b * t * hv * 128, 6), DType::Bf16).unwrap();
        set_hrec8(Some(false));
        let g6 = bwd(gpu, &x, &d_o, v7);
        for on in [false, true] {
            set_hrec8(Some(on));
            let (ms, p, diff) = bwd_row(gpu, &x, &d_o, v7, &g6);
            println!(
                "bench-hrec8 | B{b} T{t} {hk}/{hv} | {} | {ms:.3} | {} | {diff}",
                if on { "gdr_hrec8" } else { "gdr_hrec6" },
                fmt_times(&p)
            );
        }
        set_hrec8(None);
        gpu.reset_peak();
    }
    // The backward (default kernels) with gdr_bwd6 against gdr_bwd8 (v8's split reverse scan),
    // with either recompute, the two scans side by side (the default) or in order. The per-kernel
    // times come from a profiled run (always in order).
    println!(
        "bench-bwd8 | case | recompute + reverse scan | overlap | bwd ms (median of 10) | per kernel | grads vs bwd6"
    );
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let d_o = DBuf::upload(gpu, &normals(b * t * hv * 128, 6), DType::Bf16).unwrap();
        set_hrec8(Some(false));
        set_bwd8(Some(false));
        let g6 = bwd(gpu, &x, &d_o, v7);
        for &(h8, b8, ov) in &[
            (false, false, true),
            (false, true, true),
            (false, false, false),
            (false, true, false),
            (true, false, true),
            (true, true, true),
        ] {
            set_hrec8(Some(h8));
            set_bwd8(Some(b8));
            set_backward_overlap(ov);
            let (ms, p, diff) = bwd_row(gpu, &x, &d_o, v7, &g6);
            println!(
                "bench-bwd8 | B{b} T{t} {hk}/{hv} | hrec{} + bwd{} | {} | {ms:.3} | {} | {diff}",
                if h8 { 8 } else { 6 },
                if b8 { 8 } else { 6 },
                if ov { "on" } else { "off" },
                fmt_times(&p)
            );
        }
        set_backward_overlap(true);
        set_hrec8(None);
        set_bwd8(None);
        gpu.reset_peak();
    }
}

/// v5 against v6 forward (see the module doc).
fn variants(gpu: &Arc<Gpu>) {
    println!("bench-variants | case | kernel | fwd ms (median of 10) | per kernel");
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let o5 = fwd(gpu, &x, FwdKernel::V5).download().unwrap();
        let mut kernels = vec![FwdKernel::V5, FwdKernel::V6 { warps: 0 }];
        kernels.extend([1, 2, 4, 8].map(|warps| FwdKernel::V6 { warps }));
        kernels.push(FwdKernel::V6Lean { warps: 0 });
        kernels.extend([1, 2, 4, 8].map(|warps| FwdKernel::V6Lean { warps }));
        kernels.push(FwdKernel::V6Bulk { warps: 0 });
        kernels.extend([1, 2, 4, 8].map(|warps| FwdKernel::V6Bulk { warps }));
        kernels.extend([0, 2, 4, 8].map(|warps| FwdKernel::V8 { warps }));
        // (kernel, forced two stages): the defaults, then 1 and 2 warps with two stages
        let mut runs: Vec<(FwdKernel, bool)> = kernels.into_iter().map(|k| (k, false)).collect();
        for warps in [1, 2] {
            runs.push((FwdKernel::V6 { warps }, true));
            runs.push((FwdKernel::V6Bulk { warps }, true));
        }
        for (kernel, two) in runs {
            set_v6_stages(if two { 2 } else { 0 });
            let ms = time_ms(gpu, 2, 10, || drop(fwd(gpu, &x, kernel)));
            let p = kernel_times(gpu, &x, kernel);
            let diff = if kernel == FwdKernel::V5 {
                String::new()
            } else {
                let o6 = fwd(gpu, &x, kernel).download().unwrap();
                let finite = o6.iter().all(|a| a.is_finite());
                format!(
                    " | o vs v5: RMS rel diff {:.2e}, finite {finite}",
                    rms_rel_diff(&o6, &o5)
                )
            };
            println!(
                "bench-variants | B{b} T{t} {hk}/{hv} | {kernel:?}{} | {ms:.3} | {}{diff}",
                if two { " 2 stages" } else { "" },
                fmt_times(&p)
            );
            set_v6_stages(0);
        }
        gpu.reset_peak();
    }
}

/// The gradients of one backward with `kernel` (after the caller's forward), downloaded:
/// dq, dk, dv, dg, dbeta.
/// One row of the v8 backward tables: the backward's median time, the per-kernel times of one
/// profiled run, and each gradient's RMS relative difference from `base`'s.
fn bwd_row(
    gpu: &Arc<Gpu>,
    x: &Inputs,
    d_o: &DBuf,
    kernel: BwdKernel,
    base: &[(&'static str, Vec<f32>)],
) -> (f64, Vec<(String, f64, usize)>, String) {
    let ms = time_ms(gpu, 2, 10, || drop(bwd_run(gpu, x, d_o, kernel)));
    gpu.sync().unwrap();
    profile_start();
    drop(bwd_run(gpu, x, d_o, kernel));
    gpu.sync().unwrap();
    let p = profile_take();
    let diff = bwd(gpu, x, d_o, kernel)
        .iter()
        .zip(base)
        .map(|((n, a), (_, b))| format!("{n}={:.2e}", rms_rel_diff(a, b)))
        .collect::<Vec<_>>()
        .join(" ");
    (ms, p, diff)
}

fn bwd(gpu: &Arc<Gpu>, x: &Inputs, d_o: &DBuf, kernel: BwdKernel) -> Vec<(&'static str, Vec<f32>)> {
    let gr = bwd_run(gpu, x, d_o, kernel);
    vec![
        ("dq", gr.dq.download().unwrap()),
        ("dk", gr.dk.download().unwrap()),
        ("dv", gr.dv.download().unwrap()),
        ("dg", gpu.download(&gr.dg).unwrap()),
        ("dbeta", gr.dbeta.download().unwrap()),
    ]
}

fn bwd_run(
    gpu: &Arc<Gpu>,
    x: &Inputs,
    d_o: &DBuf,
    kernel: BwdKernel,
) -> gdn::ops::gated_delta_rule::cuda::Grads {
    backward_with(
        gpu, &x.q, &x.k, &x.v, &x.g, &x.beta, &x.seqs, x.shape, x.opts, None, d_o, None, kernel,
    )
    .unwrap()
}

/// v5 against the v6 backward pieces (see the module doc).
fn bwd_variants(gpu: &Arc<Gpu>) {
    println!(
        "bench-bwd | case | kernel | bwd ms (median of 10) | peak GiB | per kernel | grads vs v5 (RMS rel diff)"
    );
    let v6 = |recompute, scan, bf16_states, grad, warps| BwdKernel::V6 {
        recompute,
        scan,
        bf16_states,
        grad,
        grad7: false,
        warps,
    };
    // gdr_grad7 instead of gdr_grad6 (GDN_RULE_BWD=v7).
    let v7 = BwdKernel::V6 {
        recompute: true,
        scan: true,
        bf16_states: true,
        grad: true,
        grad7: true,
        warps: 0,
    };
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let d_o = DBuf::upload(gpu, &normals(b * t * hv * 128, 6), DType::Bf16).unwrap();
        let g5 = bwd(gpu, &x, &d_o, BwdKernel::V5);
        let mut kernels = vec![
            BwdKernel::V5,
            v7,
            v6(true, true, true, true, 0),
            v6(true, true, true, false, 0),
            v6(true, true, false, false, 0),
            v6(true, false, false, false, 0),
            v6(false, true, false, false, 0),
        ];
        kernels.extend([1, 2, 4, 8].map(|w| v6(true, true, true, true, w)));
        for kernel in kernels {
            gpu.sync().unwrap();
            gpu.reset_peak();
            let ms = time_ms(gpu, 2, 10, || drop(bwd_run(gpu, &x, &d_o, kernel)));
            let peak = gpu.peak_bytes() as f64 / (1u64 << 30) as f64;
            gpu.sync().unwrap();
            profile_start();
            drop(bwd_run(gpu, &x, &d_o, kernel));
            gpu.sync().unwrap();
            let p = profile_take();
            let diff = if kernel == BwdKernel::V5 {
                String::new()
            } else {
                bwd(gpu, &x, &d_o, kernel)
                    .iter()
                    .zip(&g5)
                    .map(|((n, a), (_, b))| {
                        let finite = a.iter().all(|x| x.is_finite());
                        format!(
                            "{n}={:.2e}{}",
                            rms_rel_diff(a, b),
                            if finite { "" } else { "(NaN)" }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            println!(
                "bench-bwd | B{b} T{t} {hk}/{hv} | {kernel:?} | {ms:.3} | {peak:.2} | {} | {diff}",
                fmt_times(&p)
            );
        }
        gpu.reset_peak();
    }
}

/// v6's prep against prep7, prep7f, prep8 and prep9 (see the module doc).
fn prep_variants(gpu: &Arc<Gpu>) {
    println!("bench-prep | case | prep | what | ms (median of 10) | per kernel");
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let d_o = DBuf::upload(gpu, &normals(b * t * hv * 128, 6), DType::Bf16).unwrap();
        let fwdp = |kind: PrepKernel| {
            forward_with_prep(
                gpu,
                &x.q,
                &x.k,
                &x.v,
                &x.g,
                &x.beta,
                &x.seqs,
                x.shape,
                x.opts,
                None,
                false,
                FwdKernel::V6 { warps: 0 },
                kind,
            )
            .unwrap()
            .0
        };
        let o6 = fwdp(PrepKernel::V6).download().unwrap();
        for kind in [
            PrepKernel::V6,
            PrepKernel::V7,
            PrepKernel::V7Fast,
            PrepKernel::V8,
            PrepKernel::V9,
        ] {
            let prep = || {
                drop(
                    prep_only(
                        gpu, &x.q, &x.k, &x.v, &x.g, &x.beta, &x.seqs, x.shape, x.opts, kind,
                    )
                    .unwrap(),
                )
            };
            let bwdp = || {
                drop(
                    backward_with_prep(
                        gpu,
                        &x.q,
                        &x.k,
                        &x.v,
                        &x.g,
                        &x.beta,
                        &x.seqs,
                        x.shape,
                        x.opts,
                        None,
                        &d_o,
                        None,
                        BwdKernel::from_env(),
                        kind,
                    )
                    .unwrap(),
                )
            };
            let profile = |f: &dyn Fn()| {
                gpu.sync().unwrap();
                profile_start();
                f();
                gpu.sync().unwrap();
                fmt_times(&profile_take())
            };
            let ms = time_ms(gpu, 2, 10, prep);
            println!(
                "bench-prep | B{b} T{t} {hk}/{hv} | {kind:?} | prep alone | {ms:.3} | {}",
                profile(&prep)
            );
            let ms = time_ms(gpu, 2, 10, || drop(fwdp(kind)));
            let o = fwdp(kind).download().unwrap();
            println!(
                "bench-prep | B{b} T{t} {hk}/{hv} | {kind:?} | v6 forward | {ms:.3} | {} | o vs v6 prep: RMS rel diff {:.2e}, finite {}",
                profile(&|| drop(fwdp(kind))),
                rms_rel_diff(&o, &o6),
                o.iter().all(|a| a.is_finite())
            );
            let ms = time_ms(gpu, 2, 10, bwdp);
            println!(
                "bench-prep | B{b} T{t} {hk}/{hv} | {kind:?} | v6 backward | {ms:.3} | {}",
                profile(&bwdp)
            );
        }
        gpu.reset_peak();
    }
}

/// The default backward against itself with one piece replaced (see the module doc): `new` (the
/// kernel's name) where `set(Some(true))` puts it, `base` (what runs there by default) where
/// `set(Some(false))` leaves it; `what` names the piece.
fn bwd_piece_variants(gpu: &Arc<Gpu>, what: &str, base: &str, new: &str, set: fn(Option<bool>)) {
    let tag = new.trim_start_matches("gdr_");
    println!(
        "bench-{tag} | case | {what} | bwd ms (median of 10) | per kernel | grads vs {base}'s"
    );
    let kernel = BwdKernel::from_env();
    for &(b, t, hk, hv) in &[(1usize, 32768usize, 16usize, 32usize), (8, 4096, 16, 16)] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let d_o = DBuf::upload(gpu, &normals(b * t * hv * 128, 6), DType::Bf16).unwrap();
        set(Some(false));
        let g7 = bwd(gpu, &x, &d_o, kernel);
        for on in [false, true, false, true] {
            set(Some(on));
            let (ms, p, diff) = bwd_row(gpu, &x, &d_o, kernel, &g7);
            println!(
                "bench-{tag} | B{b} T{t} {hk}/{hv} | {} | {ms:.3} | {} | {diff}",
                if on { new } else { base },
                fmt_times(&p)
            );
        }
        set(None);
        gpu.reset_peak();
    }
}

/// `v10` mode: the default forward (v9) against v10 (`FwdKernel::V10`: D rebuilt in the scan,
/// the prep without W and U) and v10f (`V10Fast`: T diag(beta)'s hi part only) at B1 T32768
/// 16/32, B4 T8192 16/32 and B8 T4096 16/16: forward ms
/// (medians of 10, twice each, alternating), per-kernel times, o against v9's (RMS relative).
fn v10(gpu: &Arc<Gpu>) {
    println!("bench-v10 | case | forward | fwd ms (median of 10) | per kernel | o vs v9 (RMS rel)");
    for &(b, t, hk, hv) in &[
        (1usize, 32768usize, 16usize, 32usize),
        (4, 8192, 16, 32),
        (8, 4096, 16, 16),
    ] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let v9 = FwdKernel::V9 { warps: 0 };
        let o9 = fwd(gpu, &x, v9).download().unwrap();
        let (v10, v10f) = (FwdKernel::V10 { warps: 0 }, FwdKernel::V10Fast { warps: 0 });
        for kernel in [v9, v10, v10f, v9, v10, v10f] {
            let ms = time_ms(gpu, 2, 10, || drop(fwd(gpu, &x, kernel)));
            let p = kernel_times(gpu, &x, kernel);
            let o = fwd(gpu, &x, kernel).download().unwrap();
            println!(
                "bench-v10 | B{b} T{t} {hk}/{hv} | {kernel:?} | {ms:.3} | {} | {:.2e}",
                fmt_times(&p),
                rms_rel_diff(&o, &o9)
            );
        }
    }
}

/// `g10ratio` mode: the default backward at B8 T4096 with 16 value heads over 16, 8 and 4 key
/// heads (GVA ratio 1, 2, 4: the same value-head work, one gdr_grad10 item per 1, 2, 4 value
/// heads), fp32 and bf16 D / dD workspaces: per-kernel times, so that gdr_grad10's cost per
/// item boundary (the Q / K reload, the dq / dk sums and stores, the restart of its chain)
/// separates from its cost per value head (bench/notes/fused-bwd-plan.md, session 18).
fn g10_ratio(gpu: &Arc<Gpu>) {
    println!("bench-g10ratio | case | D / dD | bwd ms (median of 10) | grad10 ms | per kernel");
    let kernel = BwdKernel::from_env();
    let (b, t, hv) = (8usize, 4096usize, 16usize);
    for hk in [16usize, 8, 4] {
        let x = inputs(gpu, b, t, hk, hv, 128, 128);
        let d_o = DBuf::upload(gpu, &normals(b * t * hv * 128, 6), DType::Bf16).unwrap();
        for ws16 in [false, true] {
            set_ws16(Some(ws16));
            let base = bwd(gpu, &x, &d_o, kernel);
            let (ms, p, _) = bwd_row(gpu, &x, &d_o, kernel, &base);
            println!(
                "bench-g10ratio | B{b} T{t} {hk}/{hv} | {} | {ms:.3} | {:.3} | {}",
                if ws16 { "bf16" } else { "fp32" },
                kernel_ms(&p, "gdr_grad10"),
                fmt_times(&p)
            );
        }
        set_ws16(None);
    }
}

/// `cluster` mode: us per step of `cl_probe` (a cluster barrier per step, and with `read` the
/// fixed-order DSMEM reduction of a 64 x 128 fp32 partial), 512 steps, medians of 10.
fn cluster_probe(gpu: &Arc<Gpu>) {
    if !gpu.arch().starts_with("sm_9") && !gpu.arch().starts_with("sm_1") {
        println!(
            "bench-rule-cluster | skipped: clusters need sm_90 ({})",
            gpu.arch()
        );
        return;
    }
    let steps = 512i32;
    for clusters in [32usize, 132] {
        let mut out = gpu.zeros::<f32>(clusters * 64 * 128).unwrap();
        for read in [0i32, 1] {
            let mut run = || {
                gdn::backend::launch::cluster_probe(gpu, clusters, steps, read == 1, &mut out)
                    .unwrap()
            };
            let ms = time_ms(gpu, 2, 10, &mut run);
            println!(
                "bench-rule-cluster | {clusters} clusters of 4 CTAs | {} | {ms:.3} ms for {steps} steps | {:.2} us per step",
                if read == 1 { "barrier + 64 x 128 fp32 DSMEM reduction" } else { "barrier only" },
                ms * 1e3 / steps as f64
            );
        }
    }
}
