//! Times the CUDA GDN2 rule (issue 17): the chunked forward against the token recurrence, and
//! forward + backward with the backward named by `GDN_RULE2_BWD` (chunked forward in both), bf16
//! storage, Dk = Dv = 128, in-kernel l2norm, FLA's inputs (g = logsigmoid(randn) per key channel,
//! b, w uniform in (0, 1)), CUDA events, median of 5 after 2 warm-ups. Prints the per-kernel times
//! of one chunked forward and the chunked o against the recurrence's (RMS relative difference);
//! then (`bench-rule2-bwd`) the chunked backward against the recurrent one (backward alone and
//! chunked forward + backward), the RMS relative difference of their dq, dk, dg, and the
//! per-kernel times of one chunked backward; then (`bench-rule2-bwd-tc`) the same chunked
//! backward with `g2b_grad`'s products on TF32 tensor cores ([`Bwd::ChunkedTc`], opt-in
//! `GDN_RULE2_GRAD=tc`): its time, fwd + bwd, its dq, dk, dg against the fp32 chunked kernels'
//! and the recurrence's, and its per-kernel times; then (`bench-rule2-bwd-v2`) backward v2
//! ([`Bwd::V2`], opt-in `GDN_RULE2_BWD=v2`: the pipelined reverse scan and `g2b_grad2`) against
//! the chunked and tc backwards, fwd + bwd, its dq, dk, dg, dv, db against the tc kernels' and
//! dq, dk, dg against the fp32 chunked kernels' (RMS rel), and the per-kernel times of v2 and tc.
//! `BENCH_RULE2_V2=1` runs only that part (well under a minute). Then (`bench-rule2-bwd-v3`)
//! backward v3 ([`Bwd::V3`], opt-in `GDN_RULE2_BWD=v3`: v2 with `g2b_grad3`, the Gram step on
//! tensor cores) against v2, fwd + bwd (chunked forward; and both with prep8), its gradients
//! against v2's and the fp32 chunked kernels' (RMS rel), and the per-kernel times of v3;
//! `BENCH_RULE2_V3=1` runs only that part (well under a minute). Then (`bench-rule2-bwd-v4`)
//! backward v4 ([`Bwd::V4`], opt-in `GDN_RULE2_BWD=v4`: v3 with `g2b_grad4`, bf16 tensor cores
//! fed from shared memory) against v3, forward + backward for both, v4's gradients against v3's
//! and the fp32 chunked kernels', and v4's per-kernel times; then the same for backward v5
//! ([`Bwd::V5`], `GDN_RULE2_BWD=v5`: the recompute, reverse scan and gradient kernel all on bf16
//! tensor cores); `BENCH_RULE2_V4=1` runs only those parts.
//! First (`bench-rule2-prep8`), the chunked forward and forward + chunked backward with the
//! tensor-core chunk prep g2c_prep8 against g2c_prep, and its per-kernel times;
//! `GDN_BENCH_RULE2=prep8` prints only those rows.
//! Before those (`bench-rule2-fwd8`), the fused bf16 tensor-core forward ([`Fwd::V8`], opt-in
//! `GDN_RULE2_FWD=v8`: g2c_prep8h + g2f_fwd8; split `v8x`) against the chunked forward, at the
//! model's CTA width and every width, its o against the chunked one's, forward + the default
//! backward, and its per-kernel times; `GDN_BENCH_RULE2=fwd8` prints only those rows.
//!
//! FLA's `chunk_gdn2` on the H200 (issue 17): 4.80 ms forward, 25.0 ms forward + backward at B1
//! T32768 16/32. `GDN_RULE2_BV=16|32` forces the scan's tile width.
//!
//! `cargo run --release --example bench_rule2` on a machine with a CUDA GPU.

#[path = "common/bench.rs"]
mod bench;
use bench::*;

use gdn::backend::launch::{profile_start, profile_take};
use std::sync::Arc;

use gdn::device::cuda::{self, DBuf, DType, GBuf, Gpu};
use gdn::ops::gdn2_rule::cuda::{
    self as cuda_rule2, backward, backward_with, forward_with, with_prep, Bwd, Fwd, Prep,
};
use gdn::ops::gdn2_rule::{RuleOpts, RuleShape};
use gdn::testutil::rms_rel_err;
use gdn::Seqs;

/// (B, T, Hk, Hv, FLA fwd ms, FLA fwd+bwd ms; 0 = not measured).
const CASES: &[(usize, usize, usize, usize, f64, f64)] =
    &[(1, 32768, 16, 32, 4.80, 25.0), (8, 4096, 16, 16, 0.0, 0.0)];

/// Uniform (0, 1) values from the same generator (the normal's CDF, logistic approximation).
fn uniforms(n: usize, seed: u64) -> Vec<f32> {
    normals(n, seed)
        .into_iter()
        .map(|z| 1.0 / (1.0 + (-1.702 * z).exp()))
        .collect()
}

/// `x` as f64 (the reference side of [`rms_rel_err`]).
fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&a| a as f64).collect()
}

/// The kernels `f` launches, each `name=ms/launches` (events around each launch, one run).
fn kernel_times(gpu: &Arc<Gpu>, f: impl FnOnce()) -> String {
    profile_start();
    f();
    gpu.sync().unwrap();
    let prof = profile_take();
    let line: Vec<String> = prof
        .iter()
        .map(|(n, ms, c)| format!("{n}={ms:.2}ms/{c}"))
        .collect();
    line.join(" ")
}

fn main() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    keep_pool(&gpu);
    println!("{gpu:?}");
    let (dk, dv) = (128usize, 128usize);
    println!(
        "bench-rule2 | case | chunked fwd ms | recurrent fwd ms | FLA fwd ms | chunked/FLA | chunked fwd + bwd ms | FLA fwd+bwd ms | o chunked vs recurrent (RMS rel)"
    );
    let v2_only = std::env::var_os("BENCH_RULE2_V2").is_some();
    let v3_only = std::env::var_os("BENCH_RULE2_V3").is_some();
    let v4_only = std::env::var_os("BENCH_RULE2_V4").is_some();
    for &(b, t, hk, hv, fla_f, fla_fb) in CASES {
        let tokens = b * t;
        let seqs = Seqs::uniform(b, t);
        let shape = RuleShape { hk, hv, dk, dv };
        let opts = RuleOpts {
            scale: 1.0 / (dk as f32).sqrt(),
            l2norm_in_kernel: true,
        };
        let up = |x: &[f32]| DBuf::upload(&gpu, x, DType::Bf16).unwrap();
        let q = up(&normals(tokens * hk * dk, 1));
        let k = up(&normals(tokens * hk * dk, 2));
        let v = up(&normals(tokens * hv * dv, 3));
        let g_host: Vec<f32> = normals(tokens * hv * dk, 4)
            .into_iter()
            .map(|z| -((-z).exp().ln_1p()))
            .collect();
        let g: GBuf<f32> = gpu.upload(&g_host).unwrap();
        let bb = up(&uniforms(tokens * hv * dk, 5));
        let w = up(&uniforms(tokens * hv * dv, 6));
        let d_o = up(&normals(tokens * hv * dv, 7));
        let run = |fwd: Fwd| {
            forward_with(
                &gpu, fwd, &q, &k, &v, &g, &bb, &w, &seqs, shape, opts, None, false,
            )
            .unwrap()
            .0
        };
        let bwd = |which: Bwd| {
            backward_with(
                &gpu, which, &q, &k, &v, &g, &bb, &w, &seqs, shape, opts, None, &d_o, None,
            )
            .unwrap()
        };
        let rel =
            |a: &DBuf, b: &DBuf| rms_rel_err(&a.download().unwrap(), &f64s(&b.download().unwrap()));
        if v4_only {
            bench_v4(
                &gpu,
                &format!("B{b} T{t} {hk}/{hv}"),
                &run,
                &bwd,
                &rel,
                fla_fb,
            );
            continue;
        }
        if v3_only {
            bench_v3(&gpu, &format!("B{b} T{t} {hk}/{hv}"), &run, &bwd, &rel);
            continue;
        }
        if v2_only {
            bench_v2(
                &gpu,
                &format!("B{b} T{t} {hk}/{hv}"),
                &run,
                &bwd,
                &rel,
                fla_fb,
            );
            continue;
        }
        // The fused forward g2f_fwd8 (GDN_RULE2_FWD=v8) against the chunked forward, both with
        // prep8; every CTA width; fwd8 + the default backward; per-kernel times.
        {
            let v8 = |warps: usize| Fwd::V8 {
                warps,
                split: false,
            };
            let v8x = |warps: usize| Fwd::V8 { warps, split: true };
            let t_c8 = time_ms(&gpu, 2, 5, || {
                with_prep(Prep::V8, || drop(run(Fwd::Chunked)))
            });
            let t_f8 = time_ms(&gpu, 2, 5, || drop(run(v8(0))));
            let t_f8x = time_ms(&gpu, 2, 5, || drop(run(v8x(0))));
            let mut widths: Vec<String> = [1usize, 2, 4, 8]
                .iter()
                .map(|&w| format!("w{w} {:.2}", time_ms(&gpu, 1, 3, || drop(run(v8(w))))))
                .collect();
            widths.extend(
                [1usize, 2, 4]
                    .iter()
                    .map(|&w| format!("x w{w} {:.2}", time_ms(&gpu, 1, 3, || drop(run(v8x(w)))))),
            );
            let tfb = time_ms(&gpu, 1, 3, || {
                let o = run(v8(0));
                let gr = backward(
                    &gpu, &q, &k, &v, &g, &bb, &w, &seqs, shape, opts, None, &d_o, None,
                )
                .unwrap();
                drop((o, gr));
            });
            let oc = with_prep(Prep::V8, || run(Fwd::Chunked))
                .download()
                .unwrap();
            let of = run(v8(0)).download().unwrap();
            let ratio = if fla_f > 0.0 {
                format!("{:.2}", t_f8 / fla_f)
            } else {
                "-".into()
            };
            println!(
                "bench-rule2-fwd8 | B{b} T{t} {hk}/{hv} | chunked fwd (prep8) {t_c8:.2} ms -> fwd8 {t_f8:.2} ms (/FLA {ratio}), fwd8x (split) {t_f8x:.2} ms | widths {} | fwd8 + default bwd {tfb:.2} ms | o fwd8 vs chunked RMS rel {:.2e}",
                widths.join(", "),
                rms_rel_err(&of, &f64s(&oc))
            );
            let line = kernel_times(&gpu, || drop(run(v8(0))));
            println!("bench-rule2-fwd8-kernels | B{b} T{t} {hk}/{hv} | {line}");
            let line = kernel_times(&gpu, || drop(run(v8x(0))));
            println!("bench-rule2-fwd8-kernels | B{b} T{t} {hk}/{hv} | split | {line}");
            if std::env::var("GDN_BENCH_RULE2").as_deref() == Ok("fwd8") {
                continue;
            }
        }
        // The tensor-core chunk prep g2c_prep8 (GDN_RULE2_PREP=v8) against g2c_prep, in the
        // chunked forward and in forward + chunked backward (its recompute runs the prep too);
        // per-kernel times of one forward and one backward with it. `GDN_BENCH_RULE2=prep8`
        // prints only these rows.
        {
            let fb = |p: Prep| {
                with_prep(p, || {
                    let o = run(Fwd::Chunked);
                    let gr = bwd(Bwd::Chunked);
                    drop((o, gr));
                })
            };
            let t1 = time_ms(&gpu, 2, 5, || {
                with_prep(Prep::V1, || drop(run(Fwd::Chunked)))
            });
            let t8 = time_ms(&gpu, 2, 5, || {
                with_prep(Prep::V8, || drop(run(Fwd::Chunked)))
            });
            let tfb1 = time_ms(&gpu, 1, 3, || fb(Prep::V1));
            let tfb8 = time_ms(&gpu, 1, 3, || fb(Prep::V8));
            let o1 = with_prep(Prep::V1, || run(Fwd::Chunked))
                .download()
                .unwrap();
            let o8 = with_prep(Prep::V8, || run(Fwd::Chunked))
                .download()
                .unwrap();
            println!(
                "bench-rule2-prep8 | B{b} T{t} {hk}/{hv} | chunked fwd prep {t1:.2} ms -> prep8 {t8:.2} ms | fwd + chunked bwd prep {tfb1:.2} ms -> prep8 {tfb8:.2} ms | o prep8 vs prep RMS rel {:.2e}",
                rms_rel_err(&o8, &f64s(&o1))
            );
            let line = with_prep(Prep::V8, || kernel_times(&gpu, || drop(run(Fwd::Chunked))));
            println!("bench-rule2-prep8-kernels | B{b} T{t} {hk}/{hv} | fwd | {line}");
            let line = with_prep(Prep::V8, || kernel_times(&gpu, || drop(bwd(Bwd::Chunked))));
            println!("bench-rule2-prep8-kernels | B{b} T{t} {hk}/{hv} | bwd | {line}");
            if std::env::var("GDN_BENCH_RULE2").as_deref() == Ok("prep8") {
                continue;
            }
        }
        let t_c = time_ms(&gpu, 2, 5, || drop(run(Fwd::Chunked)));
        let t_r = time_ms(&gpu, 2, 3, || drop(run(Fwd::Recurrent)));
        let t_fb = time_ms(&gpu, 2, 3, || {
            let o = run(Fwd::Chunked);
            let gr = backward(
                &gpu, &q, &k, &v, &g, &bb, &w, &seqs, shape, opts, None, &d_o, None,
            )
            .unwrap();
            drop((o, gr));
        });
        let oc = run(Fwd::Chunked).download().unwrap();
        let or = f64s(&run(Fwd::Recurrent).download().unwrap());
        let diff = rms_rel_err(&oc, &or);
        let ratio = if fla_f > 0.0 {
            format!("{:.2}", t_c / fla_f)
        } else {
            "-".into()
        };
        println!(
            "bench-rule2 | B{b} T{t} {hk}/{hv} | {t_c:.2} | {t_r:.2} | {fla_f:.2} | {ratio} | {t_fb:.2} | {fla_fb:.2} | {diff:.2e}"
        );
        let line = kernel_times(&gpu, || drop(run(Fwd::Chunked)));
        println!("bench-rule2-kernels | B{b} T{t} {hk}/{hv} | {line}");
        println!(
            "bench-rule2-mem | B{b} T{t} {hk}/{hv} | peak device bytes {:.2} GiB",
            gpu.peak_bytes() as f64 / (1u64 << 30) as f64
        );
        let tb_c = time_ms(&gpu, 2, 5, || drop(bwd(Bwd::Chunked)));
        let tb_r = time_ms(&gpu, 1, 3, || drop(bwd(Bwd::Recurrent)));
        let tfb_c = time_ms(&gpu, 2, 5, || drop((run(Fwd::Chunked), bwd(Bwd::Chunked))));
        let (gc, gr) = (bwd(Bwd::Chunked), bwd(Bwd::Recurrent));
        let dg_c = gpu.download(&gc.dg).unwrap();
        let dg_r = f64s(&gpu.download(&gr.dg).unwrap());
        println!(
            "bench-rule2-bwd | B{b} T{t} {hk}/{hv} | chunked bwd {tb_c:.2} ms | recurrent bwd {tb_r:.2} ms | chunked fwd + chunked bwd {tfb_c:.2} ms | FLA fwd+bwd {fla_fb:.2} ms | chunked vs recurrent RMS rel: dq {:.2e} dk {:.2e} dg {:.2e}",
            rel(&gc.dq, &gr.dq),
            rel(&gc.dk, &gr.dk),
            rms_rel_err(&dg_c, &dg_r)
        );
        drop((gc, gr));
        let line = kernel_times(&gpu, || drop(bwd(Bwd::Chunked)));
        println!("bench-rule2-bwd-kernels | B{b} T{t} {hk}/{hv} | {line}");
        println!(
            "bench-rule2-bwd-mem | B{b} T{t} {hk}/{hv} | peak device bytes {:.2} GiB",
            gpu.peak_bytes() as f64 / (1u64 << 30) as f64
        );
        let tb_t = time_ms(&gpu, 2, 5, || drop(bwd(Bwd::ChunkedTc)));
        let tfb_t = time_ms(&gpu, 2, 5, || {
            drop((run(Fwd::Chunked), bwd(Bwd::ChunkedTc)))
        });
        let (gt, gc, gr) = (bwd(Bwd::ChunkedTc), bwd(Bwd::Chunked), bwd(Bwd::Recurrent));
        let dg_t = gpu.download(&gt.dg).unwrap();
        let dg_c = f64s(&gpu.download(&gc.dg).unwrap());
        let dg_r = f64s(&gpu.download(&gr.dg).unwrap());
        println!(
            "bench-rule2-bwd-tc | B{b} T{t} {hk}/{hv} | chunked bwd (tc grad) {tb_t:.2} ms | chunked fwd + bwd (tc grad) {tfb_t:.2} ms | fp32 chunked bwd {tb_c:.2} ms | RMS rel vs fp32 chunked: dq {:.2e} dk {:.2e} dg {:.2e} | vs recurrent: dq {:.2e} dk {:.2e} dg {:.2e}",
            rel(&gt.dq, &gc.dq),
            rel(&gt.dk, &gc.dk),
            rms_rel_err(&dg_t, &dg_c),
            rel(&gt.dq, &gr.dq),
            rel(&gt.dk, &gr.dk),
            rms_rel_err(&dg_t, &dg_r)
        );
        drop((gt, gc, gr));
        let line = kernel_times(&gpu, || drop(bwd(Bwd::ChunkedTc)));
        println!("bench-rule2-bwd-tc-kernels | B{b} T{t} {hk}/{hv} | {line}");
        bench_v2(
            &gpu,
            &format!("B{b} T{t} {hk}/{hv}"),
            &run,
            &bwd,
            &rel,
            fla_fb,
        );
        bench_v3(&gpu, &format!("B{b} T{t} {hk}/{hv}"), &run, &bwd, &rel);
        bench_v4(
            &gpu,
            &format!("B{b} T{t} {hk}/{hv}"),
            &run,
            &bwd,
            &rel,
            fla_fb,
        );
    }
}

/// The `bench-rule2-bwd-v4*` and `-v5*` rows: backward v4 (`g2b_grad4`, bf16 tensor cores) and
/// v5 (everything on bf16 tensor cores) against v3 (the default), forward (the default) +
/// backward, their gradients against v3's and the fp32 chunked kernels' (RMS rel), and their
/// per-kernel times.
fn bench_v4(
    gpu: &Arc<Gpu>,
    case: &str,
    run: &dyn Fn(Fwd) -> DBuf,
    bwd: &dyn Fn(Bwd) -> cuda_rule2::Grads,
    rel: &dyn Fn(&DBuf, &DBuf) -> f64,
    fla_fb: f64,
) {
    let tb_3 = time_ms(gpu, 2, 5, || drop(bwd(Bwd::V3)));
    let fwd = Fwd::from_env();
    let tfb_3 = time_ms(gpu, 2, 5, || drop((run(fwd), bwd(Bwd::V3))));
    let (g3, gc) = (bwd(Bwd::V3), bwd(Bwd::Chunked));
    for (which, name) in [(Bwd::V4, "v4"), (Bwd::V5, "v5")] {
        let tb = time_ms(gpu, 2, 5, || drop(bwd(which)));
        let tfb = time_ms(gpu, 2, 5, || drop((run(fwd), bwd(which))));
        let gn = bwd(which);
        println!(
            "bench-rule2-bwd-{name} | {case} | {name} bwd {tb:.2} ms | v3 bwd {tb_3:.2} ms | fwd ({fwd:?}) + {name} bwd {tfb:.2} ms | fwd + v3 bwd {tfb_3:.2} ms | FLA fwd+bwd {fla_fb:.2} ms | RMS rel vs v3: {} | vs fp32 chunked: {}",
            grads_rel(gpu, rel, &gn, &g3),
            grads_rel(gpu, rel, &gn, &gc),
        );
        drop(gn);
        let line = kernel_times(gpu, || drop(bwd(which)));
        println!("bench-rule2-bwd-{name}-kernels | {case} | {line}");
    }
}

/// `dq .. dk .. dg .. dv .. dw .. db ..`: the RMS relative difference of each gradient of `a`
/// from `b`'s.
fn grads_rel(
    gpu: &Arc<Gpu>,
    rel: &dyn Fn(&DBuf, &DBuf) -> f64,
    a: &cuda_rule2::Grads,
    b: &cuda_rule2::Grads,
) -> String {
    let dg_a = gpu.download(&a.dg).unwrap();
    let dg_b = f64s(&gpu.download(&b.dg).unwrap());
    format!(
        "dq {:.2e} dk {:.2e} dg {:.2e} dv {:.2e} dw {:.2e} db {:.2e}",
        rel(&a.dq, &b.dq),
        rel(&a.dk, &b.dk),
        rms_rel_err(&dg_a, &dg_b),
        rel(&a.dv, &b.dv),
        rel(&a.dw, &b.dw),
        rel(&a.db, &b.db),
    )
}

/// The `bench-rule2-bwd-v3*` rows: backward v3 (`g2b_grad3`) against v2.
fn bench_v3(
    gpu: &Arc<Gpu>,
    case: &str,
    run: &dyn Fn(Fwd) -> DBuf,
    bwd: &dyn Fn(Bwd) -> cuda_rule2::Grads,
    rel: &dyn Fn(&DBuf, &DBuf) -> f64,
) {
    let tb_3 = time_ms(gpu, 2, 5, || drop(bwd(Bwd::V3)));
    let tb_2 = time_ms(gpu, 2, 5, || drop(bwd(Bwd::V2)));
    let tfb_3 = time_ms(gpu, 2, 5, || drop((run(Fwd::Chunked), bwd(Bwd::V3))));
    let tfb_3p = with_prep(Prep::V8, || {
        time_ms(gpu, 2, 5, || drop((run(Fwd::Chunked), bwd(Bwd::V3))))
    });
    let tfb_2p = with_prep(Prep::V8, || {
        time_ms(gpu, 2, 5, || drop((run(Fwd::Chunked), bwd(Bwd::V2))))
    });
    let (g3, g2, gc) = (bwd(Bwd::V3), bwd(Bwd::V2), bwd(Bwd::Chunked));
    let dg_3 = gpu.download(&g3.dg).unwrap();
    let dg_c = f64s(&gpu.download(&gc.dg).unwrap());
    println!(
        "bench-rule2-bwd-v3 | {case} | v3 bwd {tb_3:.2} ms | v2 bwd {tb_2:.2} ms | chunked fwd + v3 bwd {tfb_3:.2} ms | with prep8: fwd + v3 bwd {tfb_3p:.2} ms, fwd + v2 bwd {tfb_2p:.2} ms | RMS rel vs v2: {} | vs fp32 chunked: dq {:.2e} dk {:.2e} dg {:.2e} db {:.2e}",
        grads_rel(gpu, rel, &g3, &g2),
        rel(&g3.dq, &gc.dq),
        rel(&g3.dk, &gc.dk),
        rms_rel_err(&dg_3, &dg_c),
        rel(&g3.db, &gc.db),
    );
    drop((g3, g2, gc));
    let line = kernel_times(gpu, || drop(bwd(Bwd::V3)));
    println!("bench-rule2-bwd-v3-kernels | {case} | {line}");
}

/// The `bench-rule2-bwd-v2*` rows: backward v2 against the chunked and tc backwards.
fn bench_v2(
    gpu: &Arc<Gpu>,
    case: &str,
    run: &dyn Fn(Fwd) -> DBuf,
    bwd: &dyn Fn(Bwd) -> cuda_rule2::Grads,
    rel: &dyn Fn(&DBuf, &DBuf) -> f64,
    fla_fb: f64,
) {
    let tb_v = time_ms(gpu, 2, 5, || drop(bwd(Bwd::V2)));
    let tb_t = time_ms(gpu, 2, 5, || drop(bwd(Bwd::ChunkedTc)));
    let tb_c = time_ms(gpu, 2, 5, || drop(bwd(Bwd::Chunked)));
    let tfb_v = time_ms(gpu, 2, 5, || drop((run(Fwd::Chunked), bwd(Bwd::V2))));
    let (gv, gt, gc) = (bwd(Bwd::V2), bwd(Bwd::ChunkedTc), bwd(Bwd::Chunked));
    let dg_v = gpu.download(&gv.dg).unwrap();
    let dg_t = f64s(&gpu.download(&gt.dg).unwrap());
    let dg_c = f64s(&gpu.download(&gc.dg).unwrap());
    println!(
        "bench-rule2-bwd-v2 | {case} | v2 bwd {tb_v:.2} ms | tc bwd {tb_t:.2} ms | chunked bwd {tb_c:.2} ms | chunked fwd + v2 bwd {tfb_v:.2} ms | FLA fwd+bwd {fla_fb:.2} ms | RMS rel vs tc: dq {:.2e} dk {:.2e} dg {:.2e} dv {:.2e} db {:.2e} | vs fp32 chunked: dq {:.2e} dk {:.2e} dg {:.2e}",
        rel(&gv.dq, &gt.dq),
        rel(&gv.dk, &gt.dk),
        rms_rel_err(&dg_v, &dg_t),
        rel(&gv.dv, &gt.dv),
        rel(&gv.db, &gt.db),
        rel(&gv.dq, &gc.dq),
        rel(&gv.dk, &gc.dk),
        rms_rel_err(&dg_v, &dg_c),
    );
    drop((gv, gt, gc));
    for (which, name) in [(Bwd::V2, "v2"), (Bwd::ChunkedTc, "tc")] {
        let line = kernel_times(gpu, || drop(bwd(which)));
        println!("bench-rule2-bwd-{name}-kernels | {case} | {line}");
    }
}
