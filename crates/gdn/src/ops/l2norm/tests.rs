use super::cpu::{backward as l2norm_backward, forward as l2norm_forward, rstd as l2norm_rstd};
use super::*;
use crate::testutil::*;

#[test]
fn forward_matches_reference() {
    let (rows, dim) = (50, 128);
    let mut r = rng(1);
    let mut x = normal(&mut r, rows * dim, 1.0);
    // a row of tiny values, where eps matters, and a zero row
    for v in &mut x[..dim] {
        *v *= 1e-5;
    }
    x[dim..2 * dim].fill(0.0);
    let (y, rstd) = l2norm_forward(&x, rows, dim).unwrap();
    let (wy, wr) = reference::l2norm_forward(&to_f64(&x), rows, dim);
    let e = assert_close("y", &y, &wy, 2e-6);
    // rstd spans 0.1 .. 1000 over the rows: compare each relative to itself
    let mut er = 0.0f64;
    for (row, (a, b)) in rstd.iter().zip(&wr).enumerate() {
        er = er.max(assert_close(&format!("rstd row {row}"), &[*a], &[*b], 2e-6));
    }
    assert_eq!(bits(&l2norm_rstd(&x, rows, dim).unwrap()), bits(&rstd));
    eprintln!("l2norm fwd: y {e:.2e} rstd {er:.2e}");
}

#[test]
fn eps_is_inside_the_root_on_the_sum() {
    // sum(x^2) = 3e-6, so rstd = 1/sqrt(4e-6) = 500 (eps on the mean would give about 1/sqrt(2e-6))
    let x = [1e-3f32; 3];
    let (_, rstd) = l2norm_forward(&x, 1, 3).unwrap();
    assert!((rstd[0] - 500.0).abs() < 1e-2, "{}", rstd[0]);
}

#[test]
fn backward_matches_finite_differences() {
    let (rows, dim) = (6, 9);
    let mut r = rng(2);
    let mut x = normal(&mut r, rows * dim, 1.0);
    for v in &mut x[..dim] {
        *v *= 1e-3; // eps still visible in the gradient
    }
    let dy = normal(&mut r, rows * dim, 1.0);
    let (_, rstd) = l2norm_forward(&x, rows, dim).unwrap();
    let dx = l2norm_backward(&x, rows, dim, &rstd, &dy).unwrap();
    let dy64 = to_f64(&dy);
    let fx = fd_grad(
        |x| dot(&reference::l2norm_forward(x, rows, dim).0, &dy64),
        &to_f64(&x),
        FD_STEP,
    );
    // compare row by row: rows differ in scale by 1e3
    let mut worst = 0.0f64;
    for row in 0..rows {
        let s = row * dim..(row + 1) * dim;
        worst = worst.max(assert_close(
            &format!("dx row {row}"),
            &dx[s.clone()],
            &fx[s],
            2e-5,
        ));
    }
    eprintln!("l2norm bwd: dx {worst:.2e}");
}

#[test]
fn row_helpers_match_the_batch_bitwise() {
    let (rows, dim) = (7, 33);
    let mut r = rng(3);
    let x = normal(&mut r, rows * dim, 2.0);
    let dy = normal(&mut r, rows * dim, 1.0);
    let (y, rstd) = l2norm_forward(&x, rows, dim).unwrap();
    let dx = l2norm_backward(&x, rows, dim, &rstd, &dy).unwrap();
    for (row, want_rstd) in rstd.iter().enumerate() {
        let s = row * dim..(row + 1) * dim;
        let mut yr = vec![0.0; dim];
        let rr = l2norm_row(&x[s.clone()], &mut yr);
        assert_eq!(rr.to_bits(), want_rstd.to_bits());
        assert_eq!(bits(&yr), bits(&y[s.clone()]));
        let mut dxr = vec![0.0; dim];
        l2norm_row_backward(&x[s.clone()], rr, &dy[s.clone()], &mut dxr);
        assert_eq!(bits(&dxr), bits(&dx[s]));
    }
}

#[test]
fn deterministic_across_thread_counts() {
    let (rows, dim) = (3000, 64);
    let mut r = rng(4);
    let x = normal(&mut r, rows * dim, 1.0);
    let dy = normal(&mut r, rows * dim, 1.0);
    let run = || {
        let (y, rstd) = l2norm_forward(&x, rows, dim).unwrap();
        (
            bits(&y),
            bits(&rstd),
            bits(&l2norm_backward(&x, rows, dim, &rstd, &dy).unwrap()),
        )
    };
    assert!(with_threads(1, run) == with_threads(3, run));
}

#[test]
fn bad_arguments_are_errors() {
    let x = vec![1.0f32; 12];
    assert!(l2norm_forward(&x, 3, 4).is_ok());
    assert!(l2norm_forward(&x[1..], 3, 4).is_err());
    assert!(l2norm_forward(&x, 3, 0).is_err());
    assert!(l2norm_forward(&x, usize::MAX, 4).is_err());
    assert!(l2norm_rstd(&x, 4, 4).is_err());
    assert!(l2norm_backward(&x, 3, 4, &[1.0; 2], &x).is_err());
    assert!(l2norm_backward(&x, 3, 4, &[1.0; 3], &x[1..]).is_err());
    assert!(l2norm_backward(&x[1..], 3, 4, &[1.0; 3], &x).is_err());
    assert!(l2norm_forward(&[], 0, 4).unwrap().0.is_empty());
}
