use super::cpu::{backward as norm_backward, forward as norm_forward};
use super::*;
use crate::testutil::*;

const KINDS: [Normalization; 2] = [Normalization::RMSNorm, Normalization::LayerNorm];

struct Case {
    x: Vec<f32>,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    dy: Vec<f32>,
}

fn case(seed: u64, rows: usize, dim: usize, kind: Normalization) -> Case {
    let mut r = rng(seed);
    Case {
        // an offset so LayerNorm's mean matters
        x: normal_mean(&mut r, rows * dim, 0.7, 1.3),
        w: normal_mean(&mut r, dim, 0.2, 0.5),
        b: (kind == Normalization::LayerNorm).then(|| normal(&mut r, dim, 0.5)),
        dy: normal(&mut r, rows * dim, 1.0),
    }
}

fn ref_y(
    c: &Case,
    x: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    rows: usize,
    kind: Normalization,
    zc: bool,
) -> f64 {
    let dim = w.len();
    let y = reference::norm_forward(x, rows, dim, w, b, kind, 1e-5, zc);
    dot(&y, &to_f64(&c.dy))
}

#[test]
fn forward_matches_reference() {
    let (rows, dim) = (37, 96);
    for kind in KINDS {
        for zc in [false, true] {
            let c = case(1, rows, dim, kind);
            let (y, stats) =
                norm_forward(&c.x, rows, dim, &c.w, c.b.as_deref(), kind, 1e-5, zc).unwrap();
            let b64 = c.b.as_deref().map(to_f64);
            let want = reference::norm_forward(
                &to_f64(&c.x),
                rows,
                dim,
                &to_f64(&c.w),
                b64.as_deref(),
                kind,
                1e-5,
                zc,
            );
            let e = assert_close(&format!("{kind:?} zc={zc} y"), &y, &want, 2e-6);
            let rs = reference::norm_stats(&to_f64(&c.x), rows, dim, kind, 1e-5);
            let er = assert_close(
                "rstd",
                &stats.rstd,
                &rs.iter().map(|s| s.1).collect::<Vec<_>>(),
                2e-6,
            );
            match kind {
                Normalization::LayerNorm => {
                    assert_close(
                        "mean",
                        stats.mean.as_ref().unwrap(),
                        &rs.iter().map(|s| s.0).collect::<Vec<_>>(),
                        2e-6,
                    );
                    assert_eq!(stats.bytes(), 8 * rows);
                }
                Normalization::RMSNorm => {
                    assert!(stats.mean.is_none());
                    assert_eq!(stats.bytes(), 4 * rows);
                }
            }
            eprintln!("norm fwd {kind:?} zc={zc}: y {e:.2e} rstd {er:.2e}");
        }
    }
}

fn check_grads(seed: u64, rows: usize, dim: usize, kind: Normalization, zc: bool, tol: f64) {
    let c = case(seed, rows, dim, kind);
    let (_, stats) = norm_forward(&c.x, rows, dim, &c.w, c.b.as_deref(), kind, 1e-5, zc).unwrap();
    let (dx, dw, db) = norm_backward(&c.x, rows, dim, &c.w, kind, zc, &stats, &c.dy).unwrap();
    let (x64, w64, b64) = (to_f64(&c.x), to_f64(&c.w), c.b.as_deref().map(to_f64));
    let fx = fd_grad(
        |x| ref_y(&c, x, &w64, b64.as_deref(), rows, kind, zc),
        &x64,
        FD_STEP,
    );
    let fw = fd_grad(
        |w| ref_y(&c, &x64, w, b64.as_deref(), rows, kind, zc),
        &w64,
        FD_STEP,
    );
    let ex = assert_close("dx", &dx, &fx, tol);
    let ew = assert_close("dw", &dw, &fw, tol);
    let mut eb = 0.0;
    match kind {
        Normalization::LayerNorm => {
            let b64 = b64.unwrap();
            let fb = fd_grad(
                |b| ref_y(&c, &x64, &w64, Some(b), rows, kind, zc),
                &b64,
                FD_STEP,
            );
            eb = assert_close("db", db.as_ref().unwrap(), &fb, tol);
        }
        Normalization::RMSNorm => assert!(db.is_none()),
    }
    eprintln!("norm bwd {kind:?} zc={zc} rows={rows}: dx {ex:.2e} dw {ew:.2e} db {eb:.2e}");
}

#[test]
fn backward_matches_finite_differences() {
    for kind in KINDS {
        for zc in [false, true] {
            check_grads(2, 5, 7, kind, zc, 2e-5);
        }
    }
}

#[test]
fn backward_matches_finite_differences_over_several_reduce_blocks() {
    for kind in KINDS {
        check_grads(3, 2 * REDUCE_BLOCK + 37, 3, kind, false, 2e-5);
    }
}

use crate::ops::REDUCE_BLOCK;

#[test]
fn deterministic_across_thread_counts() {
    let (rows, dim) = (5 * REDUCE_BLOCK + 3, 48);
    for kind in KINDS {
        let c = case(4, rows, dim, kind);
        let run = || {
            let (y, s) =
                norm_forward(&c.x, rows, dim, &c.w, c.b.as_deref(), kind, 1e-5, true).unwrap();
            let (dx, dw, db) = norm_backward(&c.x, rows, dim, &c.w, kind, true, &s, &c.dy).unwrap();
            (
                bits(&y),
                bits(&s.rstd),
                bits(&dx),
                bits(&dw),
                db.map(|d| bits(&d)),
            )
        };
        let a = with_threads(1, run);
        let b = with_threads(3, run);
        assert!(a == b, "{kind:?}: results depend on the thread count");
    }
}

#[test]
fn empty_rows() {
    let (y, s) = norm_forward(
        &[],
        0,
        4,
        &[1.0; 4],
        None,
        Normalization::RMSNorm,
        1e-5,
        false,
    )
    .unwrap();
    assert!(y.is_empty() && s.rstd.is_empty());
    let (dx, dw, db) =
        norm_backward(&[], 0, 4, &[1.0; 4], Normalization::RMSNorm, false, &s, &[]).unwrap();
    assert!(dx.is_empty() && db.is_none());
    assert_eq!(dw, vec![0.0; 4]);
}

#[test]
fn bad_arguments_are_errors() {
    let (rows, dim) = (3, 4);
    let x = vec![1.0; rows * dim];
    let w = vec![1.0; dim];
    let b = vec![0.0; dim];
    let rms = Normalization::RMSNorm;
    let ln = Normalization::LayerNorm;
    assert!(norm_forward(&x[1..], rows, dim, &w, None, rms, 1e-5, false).is_err());
    assert!(norm_forward(&x, rows, dim, &w[1..], None, rms, 1e-5, false).is_err());
    assert!(norm_forward(&x, rows, dim, &w, Some(&b), rms, 1e-5, false).is_err());
    assert!(norm_forward(&x, rows, dim, &w, None, ln, 1e-5, false).is_err());
    assert!(norm_forward(&x, rows, dim, &w, Some(&b[1..]), ln, 1e-5, false).is_err());
    assert!(norm_forward(&x, rows, dim, &w, None, rms, f32::NAN, false).is_err());
    assert!(norm_forward(&x, rows, 0, &[], None, rms, 1e-5, false).is_err());
    assert!(norm_forward(&x, usize::MAX, dim, &w, None, rms, 1e-5, false).is_err());
    let (_, s_rms) = norm_forward(&x, rows, dim, &w, None, rms, 1e-5, false).unwrap();
    let (_, s_ln) = norm_forward(&x, rows, dim, &w, Some(&b), ln, 1e-5, false).unwrap();
    assert!(norm_backward(&x, rows, dim, &w, rms, false, &s_rms, &x).is_ok());
    assert!(norm_backward(&x, rows, dim, &w, rms, false, &s_rms, &x[1..]).is_err());
    assert!(norm_backward(&x[1..], rows, dim, &w, rms, false, &s_rms, &x).is_err());
    assert!(norm_backward(&x, rows, dim, &w[1..], rms, false, &s_rms, &x).is_err());
    assert!(norm_backward(&x, rows, dim, &w, rms, false, &s_ln, &x).is_err());
    assert!(norm_backward(&x, rows, dim, &w, ln, false, &s_rms, &x).is_err());
    let short = NormStats {
        rstd: vec![1.0; rows - 1],
        mean: None,
    };
    assert!(norm_backward(&x, rows, dim, &w, rms, false, &short, &x).is_err());
}
