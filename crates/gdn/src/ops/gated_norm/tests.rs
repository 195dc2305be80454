use super::cpu::{backward as gated_norm_backward, forward as gated_norm_forward};
use super::*;
use crate::ops::common::norm::NormStats;
use crate::ops::REDUCE_BLOCK;
use crate::testutil::*;

const KINDS: [Normalization; 2] = [Normalization::RMSNorm, Normalization::LayerNorm];
const EPS: f32 = 1e-5;

struct Case {
    o: Vec<f32>,
    z: Vec<f32>,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    dy: Vec<f32>,
}

fn case(seed: u64, rows: usize, dv: usize, kind: Normalization) -> Case {
    let mut r = rng(seed);
    Case {
        o: normal_mean(&mut r, rows * dv, 0.4, 1.5),
        z: normal(&mut r, rows * dv, 2.0),
        w: normal_mean(&mut r, dv, 0.3, 0.5),
        b: (kind == Normalization::LayerNorm).then(|| normal(&mut r, dv, 0.5)),
        dy: normal(&mut r, rows * dv, 1.0),
    }
}

fn fwd(c: &Case, rows: usize, dv: usize, kind: Normalization, zc: bool) -> (Vec<f32>, NormStats) {
    gated_norm_forward(&c.o, &c.z, rows, dv, &c.w, c.b.as_deref(), kind, EPS, zc).unwrap()
}

#[test]
fn forward_matches_reference() {
    let (rows, dv) = (48, 128);
    for kind in KINDS {
        for zc in [false, true] {
            let c = case(1, rows, dv, kind);
            let (y, stats) = fwd(&c, rows, dv, kind, zc);
            let b64 = c.b.as_deref().map(to_f64);
            let want = reference::gated_norm_forward(
                &to_f64(&c.o),
                &to_f64(&c.z),
                rows,
                dv,
                &to_f64(&c.w),
                b64.as_deref(),
                kind,
                EPS as f64,
                zc,
            );
            let e = assert_close(&format!("{kind:?} zc={zc} y"), &y, &want, 2e-6);
            let rs = crate::ops::common::reference::norm_stats(
                &to_f64(&c.o),
                rows,
                dv,
                kind,
                EPS as f64,
            );
            assert_close(
                "rstd",
                &stats.rstd,
                &rs.iter().map(|s| s.1).collect::<Vec<_>>(),
                2e-6,
            );
            assert_eq!(stats.mean.is_some(), kind == Normalization::LayerNorm);
            eprintln!("gated_norm fwd {kind:?} zc={zc}: y {e:.2e}");
        }
    }
}

fn check_grads(seed: u64, rows: usize, dv: usize, kind: Normalization, zc: bool, tol: f64) {
    let c = case(seed, rows, dv, kind);
    let (_, stats) = fwd(&c, rows, dv, kind, zc);
    let (d_o, dz, dw, db) = gated_norm_backward(
        &c.o,
        &c.z,
        rows,
        dv,
        &c.w,
        c.b.as_deref(),
        kind,
        zc,
        &stats,
        &c.dy,
    )
    .unwrap();
    let (o, z, w, dy) = (to_f64(&c.o), to_f64(&c.z), to_f64(&c.w), to_f64(&c.dy));
    let b = c.b.as_deref().map(to_f64);
    let loss = |o: &[f64], z: &[f64], w: &[f64], b: Option<&[f64]>| {
        dot(
            &reference::gated_norm_forward(o, z, rows, dv, w, b, kind, EPS as f64, zc),
            &dy,
        )
    };
    let eo = assert_close(
        "do",
        &d_o,
        &fd_grad(|v| loss(v, &z, &w, b.as_deref()), &o, FD_STEP),
        tol,
    );
    let ez = assert_close(
        "dz",
        &dz,
        &fd_grad(|v| loss(&o, v, &w, b.as_deref()), &z, FD_STEP),
        tol,
    );
    let ew = assert_close(
        "dw",
        &dw,
        &fd_grad(|v| loss(&o, &z, v, b.as_deref()), &w, FD_STEP),
        tol,
    );
    let mut eb = 0.0;
    match &b {
        Some(b) => {
            let fb = fd_grad(|v| loss(&o, &z, &w, Some(v)), b, FD_STEP);
            eb = assert_close("db", db.as_ref().unwrap(), &fb, tol);
        }
        None => assert!(db.is_none()),
    }
    eprintln!("gated_norm bwd {kind:?} zc={zc} rows={rows}: do {eo:.2e} dz {ez:.2e} dw {ew:.2e} db {eb:.2e}");
}

#[test]
fn backward_matches_finite_differences() {
    for kind in KINDS {
        for zc in [false, true] {
            check_grads(2, 6, 8, kind, zc, 2e-5);
        }
    }
}

#[test]
fn backward_matches_finite_differences_over_several_reduce_blocks() {
    for kind in KINDS {
        check_grads(3, 2 * REDUCE_BLOCK + 21, 4, kind, true, 2e-5);
    }
}

#[test]
fn forward_is_a_pure_function_and_everything_is_thread_count_independent() {
    let (rows, dv) = (4 * REDUCE_BLOCK + 5, 64);
    for kind in KINDS {
        let c = case(4, rows, dv, kind);
        let run = || {
            let (y, s) = fwd(&c, rows, dv, kind, false);
            let (y2, _) = fwd(&c, rows, dv, kind, false);
            assert_eq!(bits(&y), bits(&y2), "two forward calls differ");
            let (d_o, dz, dw, db) = gated_norm_backward(
                &c.o,
                &c.z,
                rows,
                dv,
                &c.w,
                c.b.as_deref(),
                kind,
                false,
                &s,
                &c.dy,
            )
            .unwrap();
            (
                bits(&y),
                bits(&s.rstd),
                bits(&d_o),
                bits(&dz),
                bits(&dw),
                db.map(|d| bits(&d)),
            )
        };
        assert!(with_threads(1, run) == with_threads(3, run), "{kind:?}");
    }
}

#[test]
fn bad_arguments_are_errors() {
    let (rows, dv) = (3, 4);
    let rms = Normalization::RMSNorm;
    let ln = Normalization::LayerNorm;
    let c = case(5, rows, dv, ln);
    let b = c.b.as_deref();
    let f = |o: &[f32], z: &[f32], w: &[f32], b: Option<&[f32]>, kind| {
        gated_norm_forward(o, z, rows, dv, w, b, kind, EPS, false)
    };
    assert!(f(&c.o, &c.z, &c.w, b, ln).is_ok());
    assert!(f(&c.o[1..], &c.z, &c.w, b, ln).is_err());
    assert!(f(&c.o, &c.z[1..], &c.w, b, ln).is_err());
    assert!(f(&c.o, &c.z, &c.w[1..], b, ln).is_err());
    assert!(f(&c.o, &c.z, &c.w, None, ln).is_err());
    assert!(f(&c.o, &c.z, &c.w, b, rms).is_err());
    assert!(gated_norm_forward(&c.o, &c.z, rows, dv, &c.w, b, ln, -1.0, false).is_err());
    let (_, s) = f(&c.o, &c.z, &c.w, b, ln).unwrap();
    let bw = |dy: &[f32], s: &NormStats, kind| {
        gated_norm_backward(&c.o, &c.z, rows, dv, &c.w, b, kind, false, s, dy)
    };
    assert!(bw(&c.dy, &s, ln).is_ok());
    assert!(bw(&c.dy[1..], &s, ln).is_err());
    assert!(bw(
        &c.dy,
        &NormStats {
            rstd: s.rstd.clone(),
            mean: None
        },
        ln
    )
    .is_err());
    assert!(bw(
        &c.dy,
        &NormStats {
            rstd: vec![1.0; 2],
            mean: Some(vec![0.0; 2])
        },
        ln
    )
    .is_err());
    assert!(gated_norm_backward(&c.o, &c.z, rows, dv, &c.w, None, rms, false, &s, &c.dy).is_err());
}

#[test]
fn z_read_and_dz_written_in_place() {
    // 10 tokens x 3 heads of 8; z at columns 5..29 of rows of 31 values.
    let (tokens, hpt, dv) = (10, 3, 8);
    let rows = tokens * hpt;
    let zc = Cols::new(31, 5, hpt * dv);
    for kind in KINDS {
        let c = case(7, rows, dv, kind);
        let mut wide = vec![9.0f32; tokens * zc.ld];
        for t in 0..tokens {
            wide[zc.at(t, 0)..zc.at(t, zc.width)]
                .copy_from_slice(&c.z[t * zc.width..(t + 1) * zc.width]);
        }
        let b = c.b.as_deref();
        let (y0, s0) = fwd(&c, rows, dv, kind, true);
        let (y1, s1) =
            super::cpu::forward_cols(&c.o, &wide, zc, rows, dv, &c.w, b, kind, EPS, true).unwrap();
        assert_eq!(bits(&y0), bits(&y1));
        assert_eq!(bits(&s0.rstd), bits(&s1.rstd));
        let (d_o0, dz0, dw0, db0) =
            gated_norm_backward(&c.o, &c.z, rows, dv, &c.w, b, kind, true, &s0, &c.dy).unwrap();
        let mut dzw = vec![-4.0f32; wide.len()];
        let (d_o1, dw1, db1) = super::cpu::backward_cols(
            &c.o, &wide, zc, rows, dv, &c.w, b, kind, true, &s0, &c.dy, &mut dzw,
        )
        .unwrap();
        assert_eq!(bits(&d_o0), bits(&d_o1));
        assert_eq!(bits(&dw0), bits(&dw1));
        assert_eq!(db0.map(|v| bits(&v)), db1.map(|v| bits(&v)));
        for t in 0..tokens {
            for col in 0..zc.ld {
                let v = dzw[t * zc.ld + col];
                if (zc.off..zc.off + zc.width).contains(&col) {
                    assert_eq!(v.to_bits(), dz0[t * zc.width + col - zc.off].to_bits());
                } else {
                    assert_eq!(v, -4.0, "column {col} outside z was written");
                }
            }
        }
        // a section that does not hold whole rows, and one past the row
        let bad = Cols::new(31, 5, 20);
        assert!(
            super::cpu::forward_cols(&c.o, &wide, bad, rows, dv, &c.w, b, kind, EPS, true).is_err()
        );
        let bad = Cols::new(31, 8, 24);
        assert!(
            super::cpu::forward_cols(&c.o, &wide, bad, rows, dv, &c.w, b, kind, EPS, true).is_err()
        );
    }
}
