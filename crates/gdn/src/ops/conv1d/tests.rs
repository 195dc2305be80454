use super::cpu::{backward as conv1d_silu_backward, forward as conv1d_silu_forward};
use super::*;
use crate::ops::REDUCE_BLOCK;
use crate::testutil::*;

struct Case {
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    dy: Vec<f32>,
}

fn case(seed: u64, seqs: &Seqs, ch: usize, width: usize, with_bias: bool) -> Case {
    let mut r = rng(seed);
    let n = seqs.tokens() * ch;
    Case {
        x: normal(&mut r, n, 1.0),
        w: normal(&mut r, ch * width, 0.6),
        bias: with_bias.then(|| normal(&mut r, ch, 0.5)),
        dy: normal(&mut r, n, 1.0),
    }
}

/// Sequences of lengths 0, 1, 5, 0, 7, then 3 rows of padding.
fn packed() -> Seqs {
    Seqs::packed(&[0, 0, 1, 6, 6, 13], 16).unwrap()
}

fn forward_ref(c: &Case, ch: usize, width: usize, seqs: &Seqs) -> Vec<f64> {
    let b = c.bias.as_deref().map(to_f64);
    reference::conv1d_silu_forward(&to_f64(&c.x), ch, &to_f64(&c.w), width, b.as_deref(), seqs)
}

#[test]
fn forward_matches_reference() {
    let cases = [
        (packed(), 5, 4, true),
        (packed(), 3, 1, false),
        (Seqs::uniform(3, 40), 64, 4, false),
        (packed(), 2, 9, true),
    ];
    for (seqs, ch, width, with_bias) in cases {
        let c = case(1, &seqs, ch, width, with_bias);
        let y = conv1d_silu_forward(&c.x, ch, &c.w, width, c.bias.as_deref(), &seqs).unwrap();
        let want = forward_ref(&c, ch, width, &seqs);
        let e = assert_close("y", &y, &want, 2e-6);
        assert!(
            y[seqs.used() * ch..].iter().all(|&v| v == 0.0),
            "padding rows must be 0"
        );
        eprintln!(
            "conv1d fwd tokens={} ch={ch} W={width} bias={with_bias}: {e:.2e}",
            seqs.tokens()
        );
    }
}

#[test]
fn sequences_do_not_see_each_other() {
    // the first token of every sequence only sees its own x (zero history)
    let (seqs, ch, width) = (packed(), 3, 4);
    let c = case(2, &seqs, ch, width, true);
    let y = conv1d_silu_forward(&c.x, ch, &c.w, width, c.bias.as_deref(), &seqs).unwrap();
    let b = c.bias.as_ref().unwrap();
    for s in 0..seqs.count() {
        if let Some(t) = seqs.range(s).next() {
            for ch_i in 0..ch {
                let pre = b[ch_i] as f64
                    + c.w[ch_i * width + width - 1] as f64 * c.x[t * ch + ch_i] as f64;
                let want = reference::silu(pre);
                assert!(
                    (y[t * ch + ch_i] as f64 - want).abs() < 1e-6,
                    "seq {s} token {t}"
                );
            }
        }
    }
}

fn check_grads(seqs: &Seqs, ch: usize, width: usize, with_bias: bool, seed: u64, tol: f64) {
    let c = case(seed, seqs, ch, width, with_bias);
    let (dx, dw, db) =
        conv1d_silu_backward(&c.x, ch, &c.w, width, c.bias.as_deref(), seqs, &c.dy).unwrap();
    let (x64, w64, dy64) = (to_f64(&c.x), to_f64(&c.w), to_f64(&c.dy));
    let b64 = c.bias.as_deref().map(to_f64);
    let f = |x: &[f64], w: &[f64], b: Option<&[f64]>| {
        dot(
            &reference::conv1d_silu_forward(x, ch, w, width, b, seqs),
            &dy64,
        )
    };
    let fx = fd_grad(|x| f(x, &w64, b64.as_deref()), &x64, FD_STEP);
    let fw = fd_grad(|w| f(&x64, w, b64.as_deref()), &w64, FD_STEP);
    let ex = assert_close("dx", &dx, &fx, tol);
    let ew = assert_close("dw", &dw, &fw, tol);
    assert!(
        dx[seqs.used() * ch..].iter().all(|&v| v == 0.0),
        "padding dx must be 0"
    );
    let mut eb = 0.0;
    match b64 {
        Some(b64) => {
            let fb = fd_grad(|b| f(&x64, &w64, Some(b)), &b64, FD_STEP);
            eb = assert_close("dbias", db.as_ref().unwrap(), &fb, tol);
        }
        None => assert!(db.is_none()),
    }
    eprintln!(
        "conv1d bwd tokens={} ch={ch} W={width}: dx {ex:.2e} dw {ew:.2e} db {eb:.2e}",
        seqs.tokens()
    );
}

#[test]
fn backward_matches_finite_differences() {
    check_grads(&packed(), 3, 4, true, 3, 2e-5);
    check_grads(&packed(), 2, 4, false, 4, 2e-5);
    check_grads(&packed(), 2, 1, true, 5, 2e-5);
    check_grads(&packed(), 2, 8, true, 6, 2e-5);
    check_grads(&Seqs::uniform(2, 6), 3, 3, true, 7, 2e-5);
}

#[test]
fn backward_matches_finite_differences_over_several_reduce_blocks() {
    // sequences cross the reduce-block boundaries; padding at the end
    let seqs = Seqs::packed(
        &[0, 250, 259, 2 * REDUCE_BLOCK as u64 + 70],
        2 * REDUCE_BLOCK + 80,
    )
    .unwrap();
    check_grads(&seqs, 2, 4, true, 8, 2e-5);
}

#[test]
fn deterministic_across_thread_counts() {
    let seqs = Seqs::packed(&[0, 300, 301, 1000, 1900], 2000).unwrap();
    let (ch, width) = (40, 4);
    let c = case(9, &seqs, ch, width, true);
    let run = || {
        let y = conv1d_silu_forward(&c.x, ch, &c.w, width, c.bias.as_deref(), &seqs).unwrap();
        let (dx, dw, db) =
            conv1d_silu_backward(&c.x, ch, &c.w, width, c.bias.as_deref(), &seqs, &c.dy).unwrap();
        (bits(&y), bits(&dx), bits(&dw), bits(&db.unwrap()))
    };
    assert!(
        with_threads(1, run) == with_threads(3, run),
        "results depend on the thread count"
    );
}

#[test]
fn all_padding() {
    let seqs = Seqs::packed(&[0, 0], 4).unwrap();
    let c = case(10, &seqs, 2, 3, true);
    let y = conv1d_silu_forward(&c.x, 2, &c.w, 3, c.bias.as_deref(), &seqs).unwrap();
    assert_eq!(y, vec![0.0; 8]);
    let (dx, dw, db) =
        conv1d_silu_backward(&c.x, 2, &c.w, 3, c.bias.as_deref(), &seqs, &c.dy).unwrap();
    assert_eq!(
        (dx, dw, db.unwrap()),
        (vec![0.0; 8], vec![0.0; 6], vec![0.0; 2])
    );
}

#[test]
fn bad_arguments_are_errors() {
    let seqs = packed();
    let (ch, width) = (3, 4);
    let c = case(11, &seqs, ch, width, true);
    let b = c.bias.as_deref();
    assert!(conv1d_silu_forward(&c.x[1..], ch, &c.w, width, b, &seqs).is_err());
    assert!(conv1d_silu_forward(&c.x, ch, &c.w[1..], width, b, &seqs).is_err());
    assert!(conv1d_silu_forward(&c.x, ch, &c.w, width, Some(&[0.0; 2]), &seqs).is_err());
    assert!(conv1d_silu_forward(&c.x, ch, &[], 0, b, &seqs).is_err());
    assert!(conv1d_silu_forward(&[], 0, &[], width, None, &seqs).is_err());
    assert!(conv1d_silu_backward(&c.x, ch, &c.w, width, b, &seqs, &c.dy[1..]).is_err());
    assert!(conv1d_silu_backward(&c.x[1..], ch, &c.w, width, b, &seqs, &c.dy).is_err());
    assert!(conv1d_silu_backward(&c.x, ch, &c.w, width, Some(&[0.0; 4]), &seqs, &c.dy).is_err());
}

#[test]
fn x_read_and_dx_written_in_place() {
    // channels 5 at columns 3..8 of rows of 11 values
    let seqs = packed();
    let (ch, width) = (5, 4);
    let xc = crate::backend::Cols::new(11, 3, ch);
    let c = case(9, &seqs, ch, width, true);
    let n = seqs.tokens();
    let mut wide = vec![2.5f32; n * xc.ld];
    for t in 0..n {
        wide[xc.at(t, 0)..xc.at(t, ch)].copy_from_slice(&c.x[t * ch..(t + 1) * ch]);
    }
    let b = c.bias.as_deref();
    let y0 = conv1d_silu_forward(&c.x, ch, &c.w, width, b, &seqs).unwrap();
    let y1 = super::cpu::forward_cols(&wide, xc, &c.w, width, b, &seqs).unwrap();
    assert_eq!(bits(&y0), bits(&y1));
    let (dx0, dw0, db0) = conv1d_silu_backward(&c.x, ch, &c.w, width, b, &seqs, &c.dy).unwrap();
    let mut dxw = vec![-1.0f32; wide.len()];
    let (dw1, db1) =
        super::cpu::backward_cols(&wide, xc, &c.w, width, b, &seqs, &c.dy, &mut dxw).unwrap();
    assert_eq!(bits(&dw0), bits(&dw1));
    assert_eq!(bits(&db0.unwrap()), bits(&db1.unwrap()));
    for t in 0..n {
        for col in 0..xc.ld {
            let v = dxw[t * xc.ld + col];
            if (3..3 + ch).contains(&col) {
                assert_eq!(v.to_bits(), dx0[t * ch + col - 3].to_bits());
            } else {
                assert_eq!(v, -1.0, "column {col} outside the section was written");
            }
        }
    }
    let bad = crate::backend::Cols::new(11, 7, ch);
    assert!(super::cpu::forward_cols(&wide, bad, &c.w, width, b, &seqs).is_err());
}
