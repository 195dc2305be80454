//! CPU linear: three GEMMs through `ops::gemm`.

use crate::ops::gemm::{matmul, MatRef};

/// See [`super::linear_forward`]; arguments are validated.
pub(crate) fn linear_forward(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
) -> Vec<f32> {
    let mut y = vec![0.0f32; rows * out_dim];
    let xm = MatRef::rm(x, rows, in_dim, in_dim);
    let wt = MatRef::rm(w, out_dim, in_dim, in_dim).t();
    matmul(&mut y, out_dim, xm, wt, false, 1.0, true);
    y
}

/// See [`super::linear_backward`]; arguments are validated.
pub(crate) fn linear_backward(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let dym = MatRef::rm(dy, rows, out_dim, out_dim);
    let mut dx = vec![0.0f32; rows * in_dim];
    matmul(
        &mut dx,
        in_dim,
        dym,
        MatRef::rm(w, out_dim, in_dim, in_dim),
        false,
        1.0,
        true,
    );
    let mut dw = vec![0.0f32; out_dim * in_dim];
    matmul(
        &mut dw,
        in_dim,
        dym.t(),
        MatRef::rm(x, rows, in_dim, in_dim),
        false,
        1.0,
        true,
    );
    (dx, dw)
}
