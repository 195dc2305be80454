//! The CUDA ops against the CPU ops and the f64 references, at realistic shapes, on a real GPU.
//! Run on the device machine with `--include-ignored --nocapture` (the error table is printed to
//! stderr, one `| op | dtype | tensor | metric | error |` line per output).
//!
//! For every op and both storage types:
//! - every output buffer is poisoned with NaN before each run and must come back finite (written);
//! - two runs give identical bits (outputs and parameter gradients);
//! - f32 storage: max-norm relative error against the CPU f32 op <= 1e-5;
//! - bf16 storage: RMS relative error against the f64 reference, evaluated on the same
//!   bf16-rounded inputs, <= 0.005 (the weights stay fp32, as on the GPU).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

use std::sync::Arc;

use gdn::backend::{Act, Cols, P};
use gdn::config::Normalization;
use gdn::device::cuda::{self, DBuf, DType, GBuf, Gpu};
use gdn::ops::{conv1d, gated_norm, gates, l2norm, linear, norm, prep};
use gdn::testutil::{bits, max_rel_err, normal, normal_mean, rms_rel_err, rng, to_f64, uniform};
use gdn::{GdnError, Seqs};

const F32_TOL: f64 = 1e-5;
const BF16_TOL: f64 = 5e-3;

fn gpu() -> Arc<Gpu> {
    cuda::gpu(0).expect("a CUDA GPU")
}

fn nan_d(gpu: &Arc<Gpu>, n: usize, dt: DType) -> DBuf {
    DBuf::upload(gpu, &vec![f32::NAN; n], dt).unwrap()
}

fn nan_g(gpu: &Arc<Gpu>, n: usize) -> GBuf<f32> {
    gpu.upload(&vec![f32::NAN; n]).unwrap()
}

fn dl(d: &DBuf) -> Vec<f32> {
    d.download().unwrap()
}

fn dlg(g: &GBuf<f32>) -> Vec<f32> {
    g.gpu().download(g).unwrap()
}

/// bf16 rounding (nearest even) of host data, as `DBuf::upload` does.
fn rb(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// The host data the GPU sees for storage `dt`.
fn stored(x: &[f32], dt: DType) -> Vec<f32> {
    match dt {
        DType::F32 => x.to_vec(),
        DType::Bf16 => rb(x),
    }
}

fn dts(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
    }
}

type Outs = Vec<(&'static str, Vec<f32>)>;

/// Run `f` (which poisons its outputs, runs the op and downloads) twice: every output written
/// (finite) and bitwise identical between the runs.
fn twice(label: &str, f: impl Fn() -> Outs) -> Outs {
    let a = f();
    let b = f();
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            panic!(
                "{label} {n}: element {i} of {} not written (or not finite): {}",
                x.len(),
                x[i]
            );
        }
        assert!(bits(x) == bits(y), "{label} {n}: two runs differ");
    }
    a
}

fn get<'a>(o: &'a Outs, name: &str) -> &'a [f32] {
    &o.iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no output {name}"))
        .1
}

/// f32 storage: max-norm relative error against the CPU f32 result.
fn vs_cpu(op: &str, name: &str, got: &[f32], cpu: &[f32]) {
    let e = max_rel_err(got, &to_f64(cpu));
    eprintln!("| {op} | f32 | {name} | max-rel vs CPU f32 | {e:.2e} |");
    assert!(
        e <= F32_TOL,
        "{op} f32 {name}: max rel err {e:.3e} vs CPU > {F32_TOL:.0e}"
    );
}

/// bf16 storage: RMS relative error against the f64 reference.
fn vs_ref(op: &str, name: &str, got: &[f32], want: &[f64]) {
    let e = rms_rel_err(got, want);
    eprintln!("| {op} | bf16 | {name} | rms-rel vs f64 ref | {e:.2e} |");
    assert!(
        e <= BF16_TOL,
        "{op} bf16 {name}: rms rel err {e:.3e} vs f64 > {BF16_TOL}"
    );
}

// ---------------------------------------------------------------- f64 backward references

/// Norm backward in f64 (statistics recomputed from `x`): `(dx, dw, db)`.
#[allow(clippy::too_many_arguments)]
fn norm_bwd64(
    x: &[f64],
    rows: usize,
    dim: usize,
    w: &[f64],
    kind: Normalization,
    zc: bool,
    eps: f64,
    dy: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let st = norm::reference::norm_stats(x, rows, dim, kind, eps);
    let layer = kind == Normalization::LayerNorm;
    let g: Vec<f64> = w.iter().map(|&v| if zc { 1.0 + v } else { v }).collect();
    let (mut dx, mut dw, mut db) = (vec![0.0; rows * dim], vec![0.0; dim], vec![0.0; dim]);
    for r in 0..rows {
        let (mean, rstd) = st[r];
        let s = r * dim;
        let xh: Vec<f64> = (0..dim).map(|i| (x[s + i] - mean) * rstd).collect();
        let (mut s1, mut s2) = (0.0, 0.0);
        for i in 0..dim {
            let d = dy[s + i] * g[i];
            s1 += d;
            s2 += d * xh[i];
            dw[i] += dy[s + i] * xh[i];
            db[i] += dy[s + i];
        }
        let m1 = if layer { s1 / dim as f64 } else { 0.0 };
        let m2 = s2 / dim as f64;
        for i in 0..dim {
            dx[s + i] = rstd * (dy[s + i] * g[i] - m1 - xh[i] * m2);
        }
    }
    (dx, dw, db)
}

/// Row-major f64 product `[m, k] x [k, n]` of strided views (element (i, j) of a is
/// `a[i*ars + j*acs]`).
#[allow(clippy::too_many_arguments)]
fn mm64(
    m: usize,
    n: usize,
    k: usize,
    a: &[f64],
    ars: usize,
    acs: usize,
    b: &[f64],
    brs: usize,
    bcs: usize,
) -> Vec<f64> {
    let mut c = vec![0.0f64; m * n];
    // SAFETY: the views lie inside `a` and `b` for the shapes the callers pass; `c` is fresh.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            acs as isize,
            ars as isize,
            b.as_ptr(),
            bcs as isize,
            brs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    c
}

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn silu_grad64(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

/// Conv1d + SiLU backward in f64: `(dx, dw, dbias)`.
#[allow(clippy::too_many_arguments)]
fn conv_bwd64(
    x: &[f64],
    ch: usize,
    w: &[f64],
    width: usize,
    bias: Option<&[f64]>,
    seqs: &Seqs,
    dy: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dpre = vec![0.0; seqs.tokens() * ch];
    let (mut dx, mut dw, mut db) = (
        vec![0.0; seqs.tokens() * ch],
        vec![0.0; ch * width],
        vec![0.0; ch],
    );
    for s in 0..seqs.count() {
        let r = seqs.range(s);
        for t in r.clone() {
            for c in 0..ch {
                let mut pre = bias.map_or(0.0, |b| b[c]);
                for i in 0..width {
                    let back = width - 1 - i;
                    if t >= r.start + back {
                        pre += w[c * width + i] * x[(t - back) * ch + c];
                    }
                }
                dpre[t * ch + c] = dy[t * ch + c] * silu_grad64(pre);
            }
        }
        for t in r.clone() {
            for c in 0..ch {
                let d = dpre[t * ch + c];
                db[c] += d;
                for i in 0..width {
                    let back = width - 1 - i;
                    if t >= r.start + back {
                        dw[c * width + i] += d * x[(t - back) * ch + c];
                        dx[(t - back) * ch + c] += w[c * width + i] * d;
                    }
                }
            }
        }
    }
    (dx, dw, db)
}

// ---------------------------------------------------------------- the ops

fn norm_case(kind: Normalization, zc: bool, rows: usize, dim: usize, seed: u64) {
    let gpu = gpu();
    let mut r = rng(seed);
    let layer = kind == Normalization::LayerNorm;
    let op = format!(
        "norm {kind:?}{} {rows}x{dim}",
        if zc { " zero-centered" } else { "" }
    );
    let x = normal_mean(&mut r, rows * dim, if layer { 0.5 } else { 0.0 }, 1.0);
    let w = normal_mean(&mut r, dim, if zc { 0.0 } else { 1.0 }, 0.1);
    let b = layer.then(|| normal(&mut r, dim, 0.1));
    let dy = normal(&mut r, rows * dim, 1.0);
    let eps = 1e-5f32;
    let wd = gpu.upload(&w).unwrap();
    let bd = b.as_ref().map(|b| gpu.upload(b).unwrap());
    for dt in [DType::F32, DType::Bf16] {
        let (xs, dys) = (stored(&x, dt), stored(&dy, dt));
        let (xd, dyd) = (
            DBuf::upload(&gpu, &xs, dt).unwrap(),
            DBuf::upload(&gpu, &dys, dt).unwrap(),
        );
        let o = twice(&format!("{op} {}", dts(dt)), || {
            let mut y = nan_d(&gpu, rows * dim, dt);
            let mut st = norm::GpuNormStats {
                rstd: nan_g(&gpu, rows),
                mean: layer.then(|| nan_g(&gpu, rows)),
            };
            norm::cuda::forward(
                &xd,
                rows,
                dim,
                &wd,
                bd.as_ref(),
                kind,
                eps,
                zc,
                &mut y,
                &mut st,
            )
            .unwrap();
            let mut dx = nan_d(&gpu, rows * dim, dt);
            let mut dw = nan_g(&gpu, dim);
            let mut db = layer.then(|| nan_g(&gpu, dim));
            norm::cuda::backward(
                &xd,
                rows,
                dim,
                &wd,
                kind,
                zc,
                &st,
                &dyd,
                &mut dx,
                &mut dw,
                db.as_mut(),
            )
            .unwrap();
            let mut o = vec![
                ("y", dl(&y)),
                ("rstd", dlg(&st.rstd)),
                ("dx", dl(&dx)),
                ("dw", dlg(&dw)),
            ];
            if let (Some(m), Some(db)) = (&st.mean, &db) {
                o.push(("mean", dlg(m)));
                o.push(("db", dlg(db)));
            }
            o
        });
        match dt {
            DType::F32 => {
                let (y, st) =
                    norm::cpu::forward(&x, rows, dim, &w, b.as_deref(), kind, eps, zc).unwrap();
                let (dx, dw, db) =
                    norm::cpu::backward(&x, rows, dim, &w, kind, zc, &st, &dy).unwrap();
                vs_cpu(&op, "y", get(&o, "y"), &y);
                vs_cpu(&op, "rstd", get(&o, "rstd"), &st.rstd);
                vs_cpu(&op, "dx", get(&o, "dx"), &dx);
                vs_cpu(&op, "dw", get(&o, "dw"), &dw);
                if layer {
                    vs_cpu(&op, "mean", get(&o, "mean"), st.mean.as_ref().unwrap());
                    vs_cpu(&op, "db", get(&o, "db"), db.as_ref().unwrap());
                }
            }
            DType::Bf16 => {
                let (x64, w64, dy64) = (to_f64(&xs), to_f64(&w), to_f64(&dys));
                let b64 = b.as_ref().map(|b| to_f64(b));
                let y = norm::reference::norm_forward(
                    &x64,
                    rows,
                    dim,
                    &w64,
                    b64.as_deref(),
                    kind,
                    eps as f64,
                    zc,
                );
                let st = norm::reference::norm_stats(&x64, rows, dim, kind, eps as f64);
                let (dx, dw, db) = norm_bwd64(&x64, rows, dim, &w64, kind, zc, eps as f64, &dy64);
                vs_ref(&op, "y", get(&o, "y"), &y);
                vs_ref(
                    &op,
                    "rstd",
                    get(&o, "rstd"),
                    &st.iter().map(|s| s.1).collect::<Vec<_>>(),
                );
                vs_ref(&op, "dx", get(&o, "dx"), &dx);
                vs_ref(&op, "dw", get(&o, "dw"), &dw);
                if layer {
                    vs_ref(
                        &op,
                        "mean",
                        get(&o, "mean"),
                        &st.iter().map(|s| s.0).collect::<Vec<_>>(),
                    );
                    vs_ref(&op, "db", get(&o, "db"), &db);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norm_rms_and_layer() {
    norm_case(Normalization::RMSNorm, false, 4096, 2048, 1);
    norm_case(Normalization::LayerNorm, true, 4096, 1024, 2);
    // errors: dtype mismatch, wrong lengths
    let gpu = gpu();
    let x = Act::Dev(DBuf::upload(&gpu, &[1.0; 64], DType::F32).unwrap());
    let w = gpu.upload(&[1.0f32; 16]).unwrap();
    let w = P::Dev(&w);
    let rms = Normalization::RMSNorm;
    assert!(norm::forward(&x, 4, 16, w, None, rms, 1e-5, false).is_ok());
    assert!(matches!(
        norm::forward(&x, 5, 16, w, None, rms, 1e-5, false),
        Err(GdnError::Invalid(_))
    ));
    let (_, st) = norm::forward(&x, 4, 16, w, None, rms, 1e-5, false).unwrap();
    let dy = Act::Dev(DBuf::upload(&gpu, &[1.0; 64], DType::Bf16).unwrap());
    assert!(matches!(
        norm::backward(&x, 4, 16, w, rms, false, &st, &dy),
        Err(GdnError::Invalid(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_gemm() {
    let gpu = gpu();
    let (rows, in_dim, out_dim) = (4096, 1024, 2048);
    let op = format!("linear {rows}x{in_dim}->{out_dim}");
    let mut r = rng(3);
    let x = normal(&mut r, rows * in_dim, 1.0);
    let w = normal(&mut r, out_dim * in_dim, (1.0 / in_dim as f32).sqrt());
    let dy = normal(&mut r, rows * out_dim, 1.0);
    let wd = gpu.upload(&w).unwrap();
    for dt in [DType::F32, DType::Bf16] {
        let (xs, dys) = (stored(&x, dt), stored(&dy, dt));
        let (xd, dyd) = (
            DBuf::upload(&gpu, &xs, dt).unwrap(),
            DBuf::upload(&gpu, &dys, dt).unwrap(),
        );
        let o = twice(&format!("{op} {}", dts(dt)), || {
            let mut y = nan_d(&gpu, rows * out_dim, dt);
            linear::cuda::forward(&xd, rows, in_dim, &wd, None, out_dim, &mut y).unwrap();
            let mut dx = nan_d(&gpu, rows * in_dim, dt);
            let mut dw = nan_g(&gpu, out_dim * in_dim);
            linear::cuda::backward(
                &xd, rows, in_dim, &wd, None, out_dim, &dyd, &mut dx, &mut dw,
            )
            .unwrap();
            vec![("y", dl(&y)), ("dx", dl(&dx)), ("dW", dlg(&dw))]
        });
        // The bf16 copy made once (as the layer keeps it per parameter update) gives the bits of
        // the copy made per call; the cached cuBLASLt plans give the bits of the first call.
        let plans = gpu.blaslt().unwrap().plans();
        let wb = linear::cuda::cast_bf16(&wd).unwrap();
        let mut y = nan_d(&gpu, rows * out_dim, dt);
        linear::cuda::forward(&xd, rows, in_dim, &wd, Some(&wb), out_dim, &mut y).unwrap();
        let mut dx = nan_d(&gpu, rows * in_dim, dt);
        let mut dw = nan_g(&gpu, out_dim * in_dim);
        linear::cuda::backward(
            &xd,
            rows,
            in_dim,
            &wd,
            Some(&wb),
            out_dim,
            &dyd,
            &mut dx,
            &mut dw,
        )
        .unwrap();
        assert_eq!(
            gpu.blaslt().unwrap().plans(),
            plans,
            "{op}: a shape got a second plan"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (name, v) in [("y", dl(&y)), ("dx", dl(&dx)), ("dW", dlg(&dw))] {
            assert_eq!(
                bits(&v),
                bits(get(&o, name)),
                "{op} {}: {name} with the kept bf16 copy",
                dts(dt)
            );
        }
        let short = gpu.zeros::<u16>(3).unwrap();
        let mut y = nan_d(&gpu, rows * out_dim, dt);
        let r = linear::cuda::forward(&xd, rows, in_dim, &wd, Some(&short), out_dim, &mut y);
        if dt == DType::Bf16 {
            assert!(matches!(r, Err(GdnError::Invalid(_))), "{r:?}");
        }
        match dt {
            DType::F32 => {
                let y = linear::cpu::forward(&x, rows, in_dim, &w, out_dim).unwrap();
                let (dx, dw) = linear::cpu::backward(&x, rows, in_dim, &w, out_dim, &dy).unwrap();
                vs_cpu(&op, "y", get(&o, "y"), &y);
                vs_cpu(&op, "dx", get(&o, "dx"), &dx);
                vs_cpu(&op, "dW", get(&o, "dW"), &dw);
            }
            DType::Bf16 => {
                let (x64, w64, dy64) = (to_f64(&xs), to_f64(&w), to_f64(&dys));
                // y = x W^T; dx = dy W; dW = dy^T x
                let y = mm64(rows, out_dim, in_dim, &x64, in_dim, 1, &w64, 1, in_dim);
                let dx = mm64(rows, in_dim, out_dim, &dy64, out_dim, 1, &w64, in_dim, 1);
                let dw = mm64(out_dim, in_dim, rows, &dy64, 1, out_dim, &x64, in_dim, 1);
                vs_ref(&op, "y", get(&o, "y"), &y);
                vs_ref(&op, "dx", get(&o, "dx"), &dx);
                vs_ref(&op, "dW", get(&o, "dW"), &dw);
            }
        }
    }
    let bad = Act::Dev(DBuf::upload(&gpu, &[1.0; 10], DType::F32).unwrap());
    assert!(matches!(
        linear::forward(&bad, 4, 3, P::Dev(&wd), None, out_dim),
        Err(GdnError::Invalid(_))
    ));
}

/// `x` read at columns `pad_l .. pad_l + ch` of rows of `pad_l + ch + pad_r` values (in place, as
/// from the in_proj output), `dx` written at the same columns of a buffer of that shape (the
/// other columns must keep their values).
#[allow(clippy::too_many_arguments)]
fn conv_case(
    tokens: usize,
    ch: usize,
    width: usize,
    cu: &[u64],
    with_bias: bool,
    seed: u64,
    pad_l: usize,
    pad_r: usize,
) {
    let gpu = gpu();
    let xc = Cols::new(pad_l + ch + pad_r, pad_l, ch);
    let inside = |i: usize| (pad_l..pad_l + ch).contains(&(i % xc.ld));
    let sect = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .enumerate()
            .filter(|(i, _)| inside(*i))
            .map(|(_, v)| *v)
            .collect()
    };
    let seqs = Seqs::packed(cu, tokens).unwrap();
    let used = seqs.used();
    let op = format!(
        "conv1d+silu {tokens}x{ch} W{width}{} {} seqs",
        if with_bias { " bias" } else { "" },
        seqs.count()
    );
    let mut r = rng(seed);
    let xwide = normal(&mut r, tokens * xc.ld, 1.0);
    let x = sect(&xwide);
    let dx_init: Vec<f32> = (0..xwide.len())
        .map(|i| if inside(i) { f32::NAN } else { 3.5 })
        .collect();
    let w = normal(&mut r, ch * width, 0.5);
    let bias = with_bias.then(|| normal(&mut r, ch, 0.2));
    let dy = normal(&mut r, tokens * ch, 1.0);
    let wd = gpu.upload(&w).unwrap();
    let bd = bias.as_ref().map(|b| gpu.upload(b).unwrap());
    for dt in [DType::F32, DType::Bf16] {
        let (xs, dys) = (stored(&x, dt), stored(&dy, dt));
        let (xd, dyd) = (
            DBuf::upload(&gpu, &stored(&xwide, dt), dt).unwrap(),
            DBuf::upload(&gpu, &dys, dt).unwrap(),
        );
        let o = twice(&format!("{op} {}", dts(dt)), || {
            let mut y = nan_d(&gpu, tokens * ch, dt);
            conv1d::cuda::forward(&xd, xc, &wd, width, bd.as_ref(), &seqs, &mut y).unwrap();
            let mut dx = DBuf::upload(&gpu, &dx_init, dt).unwrap();
            let mut dw = nan_g(&gpu, ch * width);
            let mut db = with_bias.then(|| nan_g(&gpu, ch));
            conv1d::cuda::backward(
                &xd,
                xc,
                &wd,
                width,
                bd.as_ref(),
                &seqs,
                &dyd,
                &mut dx,
                &mut dw,
                db.as_mut(),
            )
            .unwrap();
            let dxw = dl(&dx);
            for (i, v) in dxw.iter().enumerate() {
                assert!(
                    inside(i) || *v == 3.5,
                    "dx column {} outside the section was written",
                    i % xc.ld
                );
            }
            let mut o = vec![("y", dl(&y)), ("dx", sect(&dxw)), ("dw", dlg(&dw))];
            if let Some(db) = &db {
                o.push(("dbias", dlg(db)));
            }
            o
        });
        for name in ["y", "dx"] {
            assert!(
                get(&o, name)[used * ch..].iter().all(|&v| v == 0.0),
                "{op}: padding rows of {name} not zero"
            );
        }
        match dt {
            DType::F32 => {
                let y = conv1d::cpu::forward(&x, ch, &w, width, bias.as_deref(), &seqs).unwrap();
                let (dx, dw, db) =
                    conv1d::cpu::backward(&x, ch, &w, width, bias.as_deref(), &seqs, &dy).unwrap();
                vs_cpu(&op, "y", get(&o, "y"), &y);
                vs_cpu(&op, "dx", get(&o, "dx"), &dx);
                vs_cpu(&op, "dw", get(&o, "dw"), &dw);
                if with_bias {
                    vs_cpu(&op, "dbias", get(&o, "dbias"), db.as_ref().unwrap());
                }
            }
            DType::Bf16 => {
                let (x64, w64, dy64) = (to_f64(&xs), to_f64(&w), to_f64(&dys));
                let b64 = bias.as_ref().map(|b| to_f64(b));
                let y = conv1d::reference::conv1d_silu_forward(
                    &x64,
                    ch,
                    &w64,
                    width,
                    b64.as_deref(),
                    &seqs,
                );
                let (dx, dw, db) = conv_bwd64(&x64, ch, &w64, width, b64.as_deref(), &seqs, &dy64);
                vs_ref(&op, "y", get(&o, "y"), &y);
                vs_ref(&op, "dx", get(&o, "dx"), &dx);
                vs_ref(&op, "dw", get(&o, "dw"), &dw);
                if with_bias {
                    vs_ref(&op, "dbias", get(&o, "dbias"), &db);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv1d_silu_packed_with_padding() {
    // hidden 1024-class layer: q, k (8 heads x 128) and v (16 x 128) channels; 5 sequences (one
    // empty, one of a single token, boundaries off the 128-token tiles) and 96 padding rows
    conv_case(
        4096,
        4096,
        4,
        &[0, 1000, 1001, 2500, 2500, 4000],
        false,
        4,
        0,
        0,
    );
    // x read in place from a wider buffer, dx written into its columns
    conv_case(1000, 384, 3, &[0, 7, 300, 301, 777, 1000], true, 5, 40, 9);
    let gpu = gpu();
    let x = Act::Dev(DBuf::upload(&gpu, &[1.0; 64], DType::F32).unwrap());
    let w = gpu.upload(&[1.0f32; 16 * 40]).unwrap();
    let seqs = Seqs::uniform(1, 4);
    assert!(matches!(
        conv1d::forward(&x, Cols::dense(16), P::Dev(&w), 40, None, &seqs),
        Err(GdnError::Invalid(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn l2norm_rows() {
    let gpu = gpu();
    let (rows, dim) = (4096 * 16, 128);
    let op = format!("l2norm {rows}x{dim}");
    let mut r = rng(6);
    let x = normal(&mut r, rows * dim, 1.0);
    let dy = normal(&mut r, rows * dim, 1.0);
    for dt in [DType::F32, DType::Bf16] {
        let (xs, dys) = (stored(&x, dt), stored(&dy, dt));
        let (xd, dyd) = (
            DBuf::upload(&gpu, &xs, dt).unwrap(),
            DBuf::upload(&gpu, &dys, dt).unwrap(),
        );
        let o = twice(&format!("{op} {}", dts(dt)), || {
            let mut y = nan_d(&gpu, rows * dim, dt);
            let mut rstd = nan_g(&gpu, rows);
            l2norm::cuda::forward(&xd, rows, dim, &mut y, &mut rstd).unwrap();
            let rstd2 = l2norm::cuda::rstd(&xd, rows, dim).unwrap();
            let mut dx = nan_d(&gpu, rows * dim, dt);
            l2norm::cuda::backward(&xd, rows, dim, &rstd, &dyd, &mut dx).unwrap();
            let (r1, r2) = (dlg(&rstd), dlg(&rstd2));
            assert!(
                bits(&r1) == bits(&r2),
                "l2norm_rstd differs from the forward's rstd"
            );
            vec![("y", dl(&y)), ("rstd", r1), ("dx", dl(&dx))]
        });
        match dt {
            DType::F32 => {
                let (y, rstd) = l2norm::cpu::forward(&x, rows, dim).unwrap();
                let dx = l2norm::cpu::backward(&x, rows, dim, &rstd, &dy).unwrap();
                vs_cpu(&op, "y", get(&o, "y"), &y);
                vs_cpu(&op, "rstd", get(&o, "rstd"), &rstd);
                vs_cpu(&op, "dx", get(&o, "dx"), &dx);
            }
            DType::Bf16 => {
                let (x64, dy64) = (to_f64(&xs), to_f64(&dys));
                let (y, rstd) = l2norm::reference::l2norm_forward(&x64, rows, dim);
                let mut dx = vec![0.0; rows * dim];
                for row in 0..rows {
                    let s = row * dim..(row + 1) * dim;
                    let p: f64 = y[s.clone()]
                        .iter()
                        .zip(&dy64[s.clone()])
                        .map(|(a, b)| a * b)
                        .sum();
                    for i in s {
                        dx[i] = rstd[row] * (dy64[i] - y[i] * p);
                    }
                }
                vs_ref(&op, "y", get(&o, "y"), &y);
                vs_ref(&op, "rstd", get(&o, "rstd"), &rstd);
                vs_ref(&op, "dx", get(&o, "dx"), &dx);
            }
        }
    }
}

fn softplus_grad64(x: f64) -> f64 {
    if x > 20.0 {
        1.0
    } else {
        1.0 / (1.0 + (-x).exp())
    }
}

/// Decay backward in f64 over `x` `[rows, cols]`: `(dx, dA_log, ddt_bias)`.
fn decay_bwd64(
    x: &[f64],
    cols: usize,
    group: usize,
    a_log: &[f64],
    dt: &[f64],
    dg: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut da, mut ddt) = (vec![0.0; x.len()], vec![0.0; a_log.len()], vec![0.0; cols]);
    for i in 0..x.len() {
        let j = i % cols;
        let h = j / group;
        let v = x[i] + dt[j];
        let na = -a_log[h].exp();
        let d = na * softplus_grad64(v) * dg[i];
        dx[i] = d;
        ddt[j] += d;
        da[h] += na * gates::reference::softplus(v) * dg[i];
    }
    (dx, da, ddt)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gates_gdn_gdn2_sigmoid() {
    let gpu = gpu();
    let mut r = rng(7);
    // GDN: 4096 tokens x 32 value heads
    let (rows, heads) = (4096, 32);
    let op = format!("gates {rows}x{heads}");
    let a = normal(&mut r, rows * heads, 1.0);
    let b = normal(&mut r, rows * heads, 1.0);
    let a_log: Vec<f32> = uniform(&mut r, heads, 1.0, 16.0)
        .iter()
        .map(|v| v.ln())
        .collect();
    let mut dt_bias = vec![1.0f32; heads];
    dt_bias[0] = 25.0; // one head above the softplus threshold
    let dg = normal(&mut r, rows * heads, 1.0);
    let dbeta = normal(&mut r, rows * heads, 1.0);
    let (ald, dtd, dgd) = (
        gpu.upload(&a_log).unwrap(),
        gpu.upload(&dt_bias).unwrap(),
        gpu.upload(&dg).unwrap(),
    );
    for dt in [DType::F32, DType::Bf16] {
        let (as_, bs, dbs) = (stored(&a, dt), stored(&b, dt), stored(&dbeta, dt));
        let ad = DBuf::upload(&gpu, &as_, dt).unwrap();
        let bd = DBuf::upload(&gpu, &bs, dt).unwrap();
        let dbd = DBuf::upload(&gpu, &dbs, dt).unwrap();
        let n = rows * heads;
        let o = twice(&format!("{op} {}", dts(dt)), || {
            let (mut g, mut beta) = (nan_g(&gpu, n), nan_d(&gpu, n, dt));
            gates::cuda::forward(&ad, &bd, rows, heads, &ald, &dtd, &mut g, &mut beta).unwrap();
            let (mut da, mut db, mut dal, mut ddt) = (
                nan_d(&gpu, n, dt),
                nan_d(&gpu, n, dt),
                nan_g(&gpu, heads),
                nan_g(&gpu, heads),
            );
            gates::cuda::backward(
                &ad, &bd, rows, heads, &ald, &dtd, &dgd, &dbd, &mut da, &mut db, &mut dal, &mut ddt,
            )
            .unwrap();
            vec![
                ("g", dlg(&g)),
                ("beta", dl(&beta)),
                ("da", dl(&da)),
                ("db", dl(&db)),
                ("dA_log", dlg(&dal)),
                ("ddt_bias", dlg(&ddt)),
            ]
        });
        match dt {
            DType::F32 => {
                let (g, beta) = gates::cpu::forward(&a, &b, rows, heads, &a_log, &dt_bias).unwrap();
                let (da, db, dal, ddt) =
                    gates::cpu::backward(&a, &b, rows, heads, &a_log, &dt_bias, &dg, &dbeta)
                        .unwrap();
                for (name, want) in [
                    ("g", &g),
                    ("beta", &beta),
                    ("da", &da),
                    ("db", &db),
                    ("dA_log", &dal),
                    ("ddt_bias", &ddt),
                ] {
                    vs_cpu(&op, name, get(&o, name), want);
                }
            }
            DType::Bf16 => {
                let (a64, b64, db64) = (to_f64(&as_), to_f64(&bs), to_f64(&dbs));
                let (al64, dt64, dg64) = (to_f64(&a_log), to_f64(&dt_bias), to_f64(&dg));
                let (g, beta) =
                    gates::reference::gates_forward(&a64, &b64, rows, heads, &al64, &dt64);
                let (da, dal, ddt) = decay_bwd64(&a64, heads, 1, &al64, &dt64, &dg64);
                let db: Vec<f64> = b64
                    .iter()
                    .zip(&db64)
                    .map(|(&x, &d)| {
                        let s = gates::reference::sigmoid(x);
                        d * s * (1.0 - s)
                    })
                    .collect();
                for (name, want) in [
                    ("g", &g),
                    ("beta", &beta),
                    ("da", &da),
                    ("db", &db),
                    ("dA_log", &dal),
                    ("ddt_bias", &ddt),
                ] {
                    vs_ref(&op, name, get(&o, name), want);
                }
            }
        }
    }

    // GDN2: 4096 tokens x 16 key heads x 128 channels; sigmoid gates over the same size
    let (kh, dk) = (16, 128);
    let cols = kh * dk;
    let op2 = format!("gates2 {rows}x{kh}x{dk}");
    let ops = format!("sigmoid {rows}x{cols}");
    let f = normal(&mut r, rows * cols, 1.0);
    let a_log2: Vec<f32> = uniform(&mut r, kh, 1.0, 16.0)
        .iter()
        .map(|v| v.ln())
        .collect();
    let dt2 = normal_mean(&mut r, cols, 1.0, 0.5);
    let dg2 = normal(&mut r, rows * cols, 1.0);
    let dys = normal(&mut r, rows * cols, 1.0);
    let (ald2, dtd2, dgd2) = (
        gpu.upload(&a_log2).unwrap(),
        gpu.upload(&dt2).unwrap(),
        gpu.upload(&dg2).unwrap(),
    );
    for dt in [DType::F32, DType::Bf16] {
        let (fs, dyss) = (stored(&f, dt), stored(&dys, dt));
        let fd = DBuf::upload(&gpu, &fs, dt).unwrap();
        let dyd = DBuf::upload(&gpu, &dyss, dt).unwrap();
        let n = rows * cols;
        let o = twice(&format!("{op2} {}", dts(dt)), || {
            let mut g = nan_g(&gpu, n);
            gates::cuda::gdn2_forward(&fd, rows, kh, dk, &ald2, &dtd2, &mut g).unwrap();
            let (mut df, mut dal, mut ddt) =
                (nan_d(&gpu, n, dt), nan_g(&gpu, kh), nan_g(&gpu, cols));
            gates::cuda::gdn2_backward(
                &fd, rows, kh, dk, &ald2, &dtd2, &dgd2, &mut df, &mut dal, &mut ddt,
            )
            .unwrap();
            let mut s = nan_d(&gpu, n, dt);
            gates::cuda::sigmoid_forward(&fd, &mut s).unwrap();
            let mut ds = nan_d(&gpu, n, dt);
            gates::cuda::sigmoid_backward(&s, &dyd, &mut ds).unwrap();
            vec![
                ("g", dlg(&g)),
                ("df", dl(&df)),
                ("dA_log", dlg(&dal)),
                ("ddt_bias", dlg(&ddt)),
                ("sig", dl(&s)),
                ("dsig", dl(&ds)),
            ]
        });
        match dt {
            DType::F32 => {
                let g = gates::cpu::gdn2_forward(&f, rows, kh, dk, &a_log2, &dt2).unwrap();
                let (df, dal, ddt) =
                    gates::cpu::gdn2_backward(&f, rows, kh, dk, &a_log2, &dt2, &dg2).unwrap();
                for (name, want) in [("g", &g), ("df", &df), ("dA_log", &dal), ("ddt_bias", &ddt)] {
                    vs_cpu(&op2, name, get(&o, name), want);
                }
                let s = gates::cpu::sigmoid_forward(&f);
                let ds = gates::cpu::sigmoid_backward(&s, &dys);
                vs_cpu(&ops, "y", get(&o, "sig"), &s);
                vs_cpu(&ops, "dx", get(&o, "dsig"), &ds);
            }
            DType::Bf16 => {
                let (f64_, al64, dt64, dg64) =
                    (to_f64(&fs), to_f64(&a_log2), to_f64(&dt2), to_f64(&dg2));
                let g = gates::reference::gates2_forward(&f64_, rows, kh, dk, &al64, &dt64);
                let (df, dal, ddt) = decay_bwd64(&f64_, cols, dk, &al64, &dt64, &dg64);
                for (name, want) in [("g", &g), ("df", &df), ("dA_log", &dal), ("ddt_bias", &ddt)] {
                    vs_ref(&op2, name, get(&o, name), want);
                }
                // sigmoid backward from its stored (bf16) output, as the GPU computes it
                let s = gates::reference::sigmoid_forward(&f64_);
                let s_stored = to_f64(get(&o, "sig"));
                let ds: Vec<f64> = s_stored
                    .iter()
                    .zip(&dyss)
                    .map(|(&y, &d)| d as f64 * y * (1.0 - y))
                    .collect();
                vs_ref(&ops, "y", get(&o, "sig"), &s);
                vs_ref(&ops, "dx", get(&o, "dsig"), &ds);
            }
        }
    }
}

/// `z` (and `dz`) at columns `zcols` of a `[rows / heads-per-token, zcols.ld]` buffer (the layer's
/// in_proj output and its gradient): the columns outside the section must keep their values.
fn gated_norm_case(kind: Normalization, zc: bool, rows: usize, dv: usize, zcols: Cols, seed: u64) {
    let gpu = gpu();
    let mut r = rng(seed);
    let layer = kind == Normalization::LayerNorm;
    let op = format!(
        "gated_norm {kind:?}{} {rows}x{dv} z {zcols:?}",
        if zc { " zero-centered" } else { "" }
    );
    let tokens = rows / (zcols.width / dv);
    let o_ = normal(&mut r, rows * dv, 1.0);
    let zwide = normal(&mut r, tokens * zcols.ld, 1.0);
    let inside = |i: usize| (zcols.off..zcols.off + zcols.width).contains(&(i % zcols.ld));
    let sect = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .enumerate()
            .filter(|(i, _)| inside(*i))
            .map(|(_, v)| *v)
            .collect()
    };
    let z = sect(&zwide);
    // dz's buffer before the backward: NaN in the section (must be written), 3.5 outside.
    let dz_init: Vec<f32> = (0..zwide.len())
        .map(|i| if inside(i) { f32::NAN } else { 3.5 })
        .collect();
    let w = normal_mean(&mut r, dv, if zc { 0.0 } else { 1.0 }, 0.1);
    let b = layer.then(|| normal(&mut r, dv, 0.1));
    let dy = normal(&mut r, rows * dv, 1.0);
    let eps = 1e-5f32;
    let wd = gpu.upload(&w).unwrap();
    let bd = b.as_ref().map(|b| gpu.upload(b).unwrap());
    for dt in [DType::F32, DType::Bf16] {
        let (os, zs, dys) = (stored(&o_, dt), stored(&z, dt), stored(&dy, dt));
        let od = DBuf::upload(&gpu, &os, dt).unwrap();
        let zd = DBuf::upload(&gpu, &stored(&zwide, dt), dt).unwrap();
        let dyd = DBuf::upload(&gpu, &dys, dt).unwrap();
        let n = rows * dv;
        let out = twice(&format!("{op} {}", dts(dt)), || {
            let mut y = nan_d(&gpu, n, dt);
            let mut st = norm::GpuNormStats {
                rstd: nan_g(&gpu, rows),
                mean: layer.then(|| nan_g(&gpu, rows)),
            };
            gated_norm::cuda::forward(
                &od,
                &zd,
                zcols,
                rows,
                dv,
                &wd,
                bd.as_ref(),
                kind,
                eps,
                zc,
                &mut y,
                &mut st,
            )
            .unwrap();
            let (mut d_o, mut dz, mut dw) = (
                nan_d(&gpu, n, dt),
                DBuf::upload(&gpu, &dz_init, dt).unwrap(),
                nan_g(&gpu, dv),
            );
            let mut db = layer.then(|| nan_g(&gpu, dv));
            gated_norm::cuda::backward(
                &od,
                &zd,
                zcols,
                rows,
                dv,
                &wd,
                bd.as_ref(),
                kind,
                zc,
                &st,
                &dyd,
                &mut d_o,
                &mut dz,
                &mut dw,
                db.as_mut(),
            )
            .unwrap();
            let dzw = dl(&dz);
            for (i, v) in dzw.iter().enumerate() {
                assert!(
                    inside(i) || *v == 3.5,
                    "dz column {} outside the section was written",
                    i % zcols.ld
                );
            }
            let mut v = vec![
                ("y", dl(&y)),
                ("rstd", dlg(&st.rstd)),
                ("do", dl(&d_o)),
                ("dz", sect(&dzw)),
                ("dw", dlg(&dw)),
            ];
            if let Some(db) = &db {
                v.push(("db", dlg(db)));
            }
            v
        });
        match dt {
            DType::F32 => {
                let (y, st) =
                    gated_norm::cpu::forward(&o_, &z, rows, dv, &w, b.as_deref(), kind, eps, zc)
                        .unwrap();
                let (d_o, dz, dw, db) = gated_norm::cpu::backward(
                    &o_,
                    &z,
                    rows,
                    dv,
                    &w,
                    b.as_deref(),
                    kind,
                    zc,
                    &st,
                    &dy,
                )
                .unwrap();
                vs_cpu(&op, "y", get(&out, "y"), &y);
                vs_cpu(&op, "rstd", get(&out, "rstd"), &st.rstd);
                vs_cpu(&op, "do", get(&out, "do"), &d_o);
                vs_cpu(&op, "dz", get(&out, "dz"), &dz);
                vs_cpu(&op, "dw", get(&out, "dw"), &dw);
                if layer {
                    vs_cpu(&op, "db", get(&out, "db"), db.as_ref().unwrap());
                }
            }
            DType::Bf16 => {
                let (o64, z64, w64, dy64) = (to_f64(&os), to_f64(&zs), to_f64(&w), to_f64(&dys));
                let b64 = b.as_ref().map(|b| to_f64(b));
                let y = gated_norm::reference::gated_norm_forward(
                    &o64,
                    &z64,
                    rows,
                    dv,
                    &w64,
                    b64.as_deref(),
                    kind,
                    eps as f64,
                    zc,
                );
                let nrm = norm::reference::norm_forward(
                    &o64,
                    rows,
                    dv,
                    &w64,
                    b64.as_deref(),
                    kind,
                    eps as f64,
                    zc,
                );
                let st = norm::reference::norm_stats(&o64, rows, dv, kind, eps as f64);
                let dz: Vec<f64> = (0..n)
                    .map(|i| dy64[i] * nrm[i] * silu_grad64(z64[i]))
                    .collect();
                let dn: Vec<f64> = (0..n).map(|i| dy64[i] * silu64(z64[i])).collect();
                let (d_o, dw, db) = norm_bwd64(&o64, rows, dv, &w64, kind, zc, eps as f64, &dn);
                vs_ref(&op, "y", get(&out, "y"), &y);
                vs_ref(
                    &op,
                    "rstd",
                    get(&out, "rstd"),
                    &st.iter().map(|s| s.1).collect::<Vec<_>>(),
                );
                vs_ref(&op, "do", get(&out, "do"), &d_o);
                vs_ref(&op, "dz", get(&out, "dz"), &dz);
                vs_ref(&op, "dw", get(&out, "dw"), &dw);
                if layer {
                    vs_ref(&op, "db", get(&out, "db"), &db);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gated_norm_rms_and_layer() {
    // 4096 tokens x 32 value heads, Dv = 128, z read in place from a wider buffer (the layer's
    // in_proj output: z after 8192 conv columns, gate columns after it)
    let ld = 8192 + 32 * 128 + 64;
    gated_norm_case(
        Normalization::RMSNorm,
        false,
        4096 * 32,
        128,
        Cols::new(ld, 8192, 32 * 128),
        8,
    );
    // dense z
    gated_norm_case(
        Normalization::LayerNorm,
        true,
        4096 * 16,
        128,
        Cols::dense(128),
        9,
    );
    // rows wider than the fused backward's shared memory (separate partials kernel), 3 heads
    gated_norm_case(
        Normalization::RMSNorm,
        true,
        300 * 3,
        800,
        Cols::new(3 * 800 + 7, 5, 3 * 800),
        10,
    );
}

/// The streaming gated-norm kernels (rows of a multiple of 4 up to 256 values in one warp's
/// registers, 4-aligned z section) at their edges, and the general kernels beside them: row
/// counts that are not a multiple of the 256-row partial chunks, half a warp's lanes (Dv = 64),
/// two 128-value chunks per lane (Dv = 256) and a partial second chunk (Dv = 200), and a z
/// offset that is not 4-aligned (the general fused backward at Dv = 128).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gated_norm_streaming_edges() {
    for (kind, zc, tokens, hpt, dv, extra, off, seed) in [
        (Normalization::LayerNorm, false, 1001, 3, 64, 4, 8, 60),
        (Normalization::RMSNorm, true, 333, 2, 256, 0, 4, 61),
        (Normalization::LayerNorm, true, 517, 4, 200, 8, 0, 62),
        (Normalization::RMSNorm, false, 700, 4, 128, 3, 5, 63),
        (Normalization::LayerNorm, false, 700, 1, 128, 1, 1, 64),
    ] {
        let ld = hpt * dv + off + extra;
        gated_norm_case(
            kind,
            zc,
            tokens * hpt,
            dv,
            Cols::new(ld, off, hpt * dv),
            seed,
        );
    }
}

/// The fused prep op (conv + SiLU + q/k L2 norm + gates, forward and backward) against the CPU op
/// (f32 storage: max-rel <= 1e-5; bf16: forward vs the f64 reference <= 5e-3 RMS, backward vs the
/// CPU f32 op on the same rounded inputs <= 1e-2 RMS, since the GPU stores the raw conv output and
/// d(raw output) in bf16 between steps as the separate ops did). Every output is poisoned with
/// NaN and must be written; d(in_proj output) must be written exactly in its sections (a
/// sentinel elsewhere survives); two runs give the same bits.
#[allow(clippy::too_many_arguments)]
fn prep_case(s: prep::PrepShape, cols: prep::PrepCols, seqs: &Seqs, bias: bool, seed: u64) {
    use gdn::ops::prep::{cpu as pcpu, cuda as pcuda};
    let gpu = gpu();
    let mut r = rng(seed);
    let n = seqs.tokens();
    let ld = cols.qkv.ld;
    let (qk, vd, cd, hv) = (s.qk(), s.vd(), s.conv_dim(), s.hv);
    let op = format!(
        "prep hk{} hv{} dk{} dv{} W{} l2={} bias={bias} tokens={n} used={}",
        s.hk,
        s.hv,
        s.dk,
        s.dv,
        s.width,
        s.l2norm,
        seqs.used()
    );
    let x = normal(&mut r, n * ld, 1.0);
    let w = normal(&mut r, cd * s.width, 0.4);
    let b = bias.then(|| normal(&mut r, cd, 0.3));
    let a_log = uniform(&mut r, hv, 0.0, 2.7);
    let dt = normal(&mut r, hv, 0.5);
    let dq = normal(&mut r, n * qk, 1.0);
    let dk = normal(&mut r, n * qk, 1.0);
    let dv = normal(&mut r, n * vd, 1.0);
    let dg = normal(&mut r, n * hv, 1.0);
    let dbeta = normal(&mut r, n * hv, 1.0);
    let inside = |i: usize| {
        let c = i % ld;
        [cols.qkv, cols.beta, cols.alpha]
            .iter()
            .any(|q| c >= q.off && c < q.off + q.width)
    };
    let sect = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .enumerate()
            .filter(|(i, _)| inside(*i))
            .map(|(_, v)| *v)
            .collect()
    };
    let dproj_init: Vec<f32> = (0..x.len())
        .map(|i| if inside(i) { f32::NAN } else { 3.5 })
        .collect();
    let (wd, ald, dtd, dgd) = (
        gpu.upload(&w).unwrap(),
        gpu.upload(&a_log).unwrap(),
        gpu.upload(&dt).unwrap(),
        gpu.upload(&dg).unwrap(),
    );
    let bd = b.as_ref().map(|b| gpu.upload(b).unwrap());
    for dty in [DType::F32, DType::Bf16] {
        let up = |v: &[f32]| DBuf::upload(&gpu, v, dty).unwrap();
        let (xs, dqs, dks, dvs, dbs) = (
            stored(&x, dty),
            stored(&dq, dty),
            stored(&dk, dty),
            stored(&dv, dty),
            stored(&dbeta, dty),
        );
        let (xd, dqd, dkd, dvd, dbd) = (up(&xs), up(&dqs), up(&dks), up(&dvs), up(&dbs));
        let label = format!("{op} {}", dts(dty));
        let out = twice(&label, || {
            let mut o = pcuda::Out {
                q: nan_d(&gpu, n * qk, dty),
                k: nan_d(&gpu, n * qk, dty),
                v: nan_d(&gpu, n * vd, dty),
                qkn: s
                    .l2norm
                    .then(|| (nan_d(&gpu, n * qk, dty), nan_d(&gpu, n * qk, dty))),
                g: nan_g(&gpu, n * hv),
                beta: nan_d(&gpu, n * hv, dty),
            };
            pcuda::forward(&xd, cols, s, &wd, bd.as_ref(), &ald, &dtd, seqs, &mut o).unwrap();
            let mut dproj = up(&dproj_init);
            let mut g = pcuda::Grads {
                conv_w: nan_g(&gpu, cd * s.width),
                conv_b: bias.then(|| nan_g(&gpu, cd)),
                a_log: nan_g(&gpu, hv),
                dt_bias: nan_g(&gpu, hv),
            };
            pcuda::backward(
                &xd,
                cols,
                s,
                &wd,
                bd.as_ref(),
                &ald,
                &dtd,
                seqs,
                pcuda::Dy {
                    dq: &dqd,
                    dk: &dkd,
                    dv: &dvd,
                    dg: &dgd,
                    dbeta: &dbd,
                },
                &mut dproj,
                &mut g,
            )
            .unwrap();
            let dp = dl(&dproj);
            for (i, v) in dp.iter().enumerate() {
                assert!(
                    inside(i) || *v == 3.5,
                    "{label}: dproj column {} outside the sections was written",
                    i % ld
                );
            }
            let mut v = vec![
                ("q", dl(&o.q)),
                ("k", dl(&o.k)),
                ("v", dl(&o.v)),
                ("g", dlg(&o.g)),
                ("beta", dl(&o.beta)),
                ("dproj", sect(&dp)),
                ("dconv_w", dlg(&g.conv_w)),
                ("dA_log", dlg(&g.a_log)),
                ("ddt_bias", dlg(&g.dt_bias)),
            ];
            if let Some((a, b)) = &o.qkn {
                v.push(("qn", dl(a)));
                v.push(("kn", dl(b)));
            }
            if let Some(b) = &g.conv_b {
                v.push(("dconv_b", dlg(b)));
            }
            v
        });
        // The CPU op on the inputs the GPU saw.
        let co = pcpu::forward(&xs, cols, s, &w, b.as_deref(), &a_log, &dt, seqs).unwrap();
        let mut cdp = vec![0.0f32; x.len()];
        let cg = pcpu::backward(
            &xs,
            cols,
            s,
            &w,
            b.as_deref(),
            &a_log,
            &dt,
            seqs,
            pcpu::Dy {
                dq: &dqs,
                dk: &dks,
                dv: &dvs,
                dg: &dg,
                dbeta: &dbs,
            },
            &mut cdp,
        )
        .unwrap();
        let mut bwd: Vec<(&str, Vec<f32>)> = vec![
            ("dproj", sect(&cdp)),
            ("dconv_w", cg.conv_w.clone()),
            ("dA_log", cg.a_log.clone()),
            ("ddt_bias", cg.dt_bias.clone()),
        ];
        if let Some(b) = &cg.conv_b {
            bwd.push(("dconv_b", b.clone()));
        }
        let (qn, kn) = match &co.qkn {
            Some((a, b)) => (Some(a.clone()), Some(b.clone())),
            None => (None, None),
        };
        match dty {
            DType::F32 => {
                let mut fwd: Vec<(&str, Vec<f32>)> = vec![
                    ("q", co.q.clone()),
                    ("k", co.k.clone()),
                    ("v", co.v.clone()),
                    ("g", co.g.clone()),
                    ("beta", co.beta.clone()),
                ];
                if let (Some(a), Some(b)) = (qn, kn) {
                    fwd.push(("qn", a));
                    fwd.push(("kn", b));
                }
                for (name, want) in fwd.iter().chain(&bwd) {
                    vs_cpu(&op, name, get(&out, name), want);
                }
            }
            DType::Bf16 => {
                let b64 = b.as_deref().map(to_f64);
                let rf = prep::reference::forward(
                    &to_f64(&xs),
                    cols,
                    s,
                    &to_f64(&w),
                    b64.as_deref(),
                    &to_f64(&a_log),
                    &to_f64(&dt),
                    seqs,
                );
                let mut fwd: Vec<(&str, &[f64])> = vec![
                    ("q", &rf.q),
                    ("k", &rf.k),
                    ("v", &rf.v),
                    ("g", &rf.g),
                    ("beta", &rf.beta),
                ];
                if s.l2norm {
                    fwd.push(("qn", &rf.qn));
                    fwd.push(("kn", &rf.kn));
                }
                for (name, want) in fwd {
                    vs_ref(&op, name, get(&out, name), want);
                }
                for (name, want) in &bwd {
                    let e = rms_rel_err(get(&out, name), &to_f64(want));
                    eprintln!("| {op} | bf16 | {name} | rms-rel vs CPU f32 | {e:.2e} |");
                    assert!(
                        e <= 1e-2,
                        "{op} bf16 {name}: rms rel err {e:.3e} vs CPU > 1e-2"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prep_fused_conv_l2norm_gates() {
    // The layer's in_proj layout: [q|k|v | z | beta | alpha]; packed sequences with an empty one,
    // a one-token one, and padding rows at the end.
    let layer_cols = |s: &prep::PrepShape| {
        let (cd, vd, hv) = (s.conv_dim(), s.vd(), s.hv);
        let ld = cd + vd + 2 * hv;
        prep::PrepCols {
            qkv: Cols::new(ld, 0, cd),
            beta: Cols::new(ld, cd + vd, hv),
            alpha: Cols::new(ld, cd + vd + hv, hv),
        }
    };
    let seqs = Seqs::packed(&[0, 700, 701, 701, 2300, 3000], 3100).unwrap();
    let s = prep::PrepShape {
        hk: 4,
        hv: 8,
        dk: 128,
        dv: 128,
        width: 4,
        l2norm: true,
    };
    prep_case(s, layer_cols(&s), &seqs, true, 31);
    // the norm in the rule (no caller-side norm), no conv bias
    let s2 = prep::PrepShape { l2norm: false, ..s };
    prep_case(s2, layer_cols(&s2), &seqs, false, 32);
    // odd sizes (heads straddle the 32-channel tiles, head dims not multiples of 32), sections
    // in another order, uniform sequences
    let s3 = prep::PrepShape {
        hk: 3,
        hv: 6,
        dk: 40,
        dv: 24,
        width: 3,
        l2norm: true,
    };
    let cd = s3.conv_dim();
    let c3 = prep::PrepCols {
        alpha: Cols::new(cd + 2 * 6 + 5, 0, 6),
        beta: Cols::new(cd + 2 * 6 + 5, 6, 6),
        qkv: Cols::new(cd + 2 * 6 + 5, 17, cd),
    };
    prep_case(s3, c3, &Seqs::uniform(3, 333), true, 33);
}

/// The streaming prep kernels (conv widths 2..=4, head sizes multiples of 4 up to 256, 4-aligned
/// rows) at the edges of their tiling (32 tokens per warp forward, 64 backward, 512 per block
/// of the weight-gradient partials), and the general kernels they fall back to, against the
/// CPU op and the f64 reference (see `prep_case`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn prep_streaming_tiles_sequences_and_heads() {
    let layer_cols = |s: &prep::PrepShape, extra: usize| {
        let (cd, vd, hv) = (s.conv_dim(), s.vd(), s.hv);
        let ld = cd + vd + 2 * hv + extra;
        prep::PrepCols {
            qkv: Cols::new(ld, 0, cd),
            beta: Cols::new(ld, cd + vd, hv),
            alpha: Cols::new(ld, cd + vd + hv, hv),
        }
    };
    let base = prep::PrepShape {
        hk: 2,
        hv: 4,
        dk: 128,
        dv: 128,
        width: 4,
        l2norm: true,
    };
    // Sequences shorter than the window, boundaries on and next to the tiles' edges (31/32/33,
    // 63/64/65, 511/512/513), an empty one, and padding that starts inside a tile and fills
    // the last ones (1100 tokens: not a multiple of 32, 64 or 512).
    let edges = Seqs::packed(
        &[
            0, 1, 3, 6, 31, 32, 33, 63, 64, 65, 65, 511, 512, 513, 700, 1030,
        ],
        1100,
    )
    .unwrap();
    prep_case(base, layer_cols(&base, 0), &edges, true, 41);
    // every width the streaming kernels take; without the norm, without a bias
    for (width, seed) in [(2, 42), (3, 43)] {
        let s = prep::PrepShape { width, ..base };
        prep_case(s, layer_cols(&s, 0), &edges, width == 2, seed);
    }
    let s = prep::PrepShape {
        l2norm: false,
        ..base
    };
    prep_case(s, layer_cols(&s, 0), &edges, false, 44);
    // GVA (Hv = 2 Hk), Dk = 64 (half a warp's lanes on a key head), B = 3 uniform sequences of
    // 333 tokens
    let s = prep::PrepShape {
        hk: 2,
        hv: 4,
        dk: 64,
        dv: 128,
        width: 4,
        l2norm: true,
    };
    prep_case(s, layer_cols(&s, 0), &Seqs::uniform(3, 333), true, 45);
    // Dk = Dv = 256 (two 128-channel chunks per lane), width 3, and Dk = 256 with Dv = 128
    let s = prep::PrepShape {
        hk: 1,
        hv: 2,
        dk: 256,
        dv: 256,
        width: 3,
        l2norm: true,
    };
    prep_case(s, layer_cols(&s, 0), &edges, true, 46);
    let s = prep::PrepShape {
        hk: 2,
        hv: 2,
        dk: 256,
        dv: 128,
        width: 4,
        l2norm: true,
    };
    prep_case(s, layer_cols(&s, 0), &Seqs::uniform(2, 700), false, 47);
    // the general kernels: width 5 and width 1, Dk = 512, a row stride that is not 4-aligned
    for (s, extra, seed) in [
        (prep::PrepShape { width: 5, ..base }, 0, 48),
        (
            prep::PrepShape {
                width: 1,
                dk: 32,
                dv: 32,
                ..base
            },
            0,
            49,
        ),
        (
            prep::PrepShape {
                hk: 1,
                hv: 1,
                dk: 512,
                dv: 64,
                ..base
            },
            0,
            50,
        ),
        (base, 1, 51),
    ] {
        prep_case(s, layer_cols(&s, extra), &edges, true, seed);
    }
}
