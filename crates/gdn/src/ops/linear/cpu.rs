//! CPU linear: three GEMMs through `ops::common::gemm`.

use crate::error::Result;
use crate::ops::check_len;
use crate::ops::common::gemm::{matmul, MatRef};

/// See [`super::linear_forward`]; arguments are validated.
fn linear_forward_unchecked(
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
fn linear_backward_unchecked(
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

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

/// `y = x W^T` for `x` `[rows, in_dim]` and `w` `[out_dim, in_dim]`; returns `y` `[rows, out_dim]`.
pub fn forward(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
) -> Result<Vec<f32>> {
    check_len("linear x", x, rows.saturating_mul(in_dim))?;
    check_len("linear weight", w, out_dim.saturating_mul(in_dim))?;
    Ok(linear_forward_unchecked(x, rows, in_dim, w, out_dim))
}

/// Backward of [`forward`]: returns `dx = dy W` `[rows, in_dim]` and `dW = dy^T x`
/// `[out_dim, in_dim]`.
pub fn backward(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
    dy: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    check_len("linear x", x, rows.saturating_mul(in_dim))?;
    check_len("linear weight", w, out_dim.saturating_mul(in_dim))?;
    check_len("linear dy", dy, rows.saturating_mul(out_dim))?;
    Ok(linear_backward_unchecked(x, rows, in_dim, w, out_dim, dy))
}
