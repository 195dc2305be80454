//! CPU per-row L2 norm: the single-row helpers and the batch functions built on them.

use rayon::prelude::*;

use super::L2NORM_EPS;
use crate::ops::norm::cpu::task_rows;

/// `1 / sqrt(sum(x^2) + eps)` of one row; the sum runs left to right in f32.
#[inline]
pub fn l2norm_row_rstd(x: &[f32]) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss + L2NORM_EPS).sqrt()
}

/// Normalize one row: `y = x * rstd`; returns `rstd`.
#[inline]
pub fn l2norm_row(x: &[f32], y: &mut [f32]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let rstd = l2norm_row_rstd(x);
    for (y, x) in y.iter_mut().zip(x) {
        *y = x * rstd;
    }
    rstd
}

/// Backward of one row: `dx = rstd * (dy - y <dy, y>)` with `y = x * rstd` recomputed.
#[inline]
pub fn l2norm_row_backward(x: &[f32], rstd: f32, dy: &[f32], dx: &mut [f32]) {
    debug_assert!(x.len() == dy.len() && x.len() == dx.len());
    let mut d = 0.0f32;
    for (x, g) in x.iter().zip(dy) {
        d += g * (x * rstd);
    }
    for ((dx, x), g) in dx.iter_mut().zip(x).zip(dy) {
        *dx = rstd * (g - (x * rstd) * d);
    }
}

/// See [`super::l2norm_forward`]; arguments are validated.
pub(crate) fn l2norm_forward(x: &[f32], dim: usize) -> (Vec<f32>, Vec<f32>) {
    let mut y = vec![0.0f32; x.len()];
    let mut rstd = vec![0.0f32; x.len() / dim];
    let tr = task_rows(dim);
    y.par_chunks_mut(tr * dim)
        .zip(rstd.par_chunks_mut(tr))
        .zip(x.par_chunks(tr * dim))
        .for_each(|((yb, rb), xb)| {
            for ((yr, r), xr) in yb.chunks_mut(dim).zip(rb.iter_mut()).zip(xb.chunks(dim)) {
                *r = l2norm_row(xr, yr);
            }
        });
    (y, rstd)
}

/// See [`super::l2norm_rstd`]; arguments are validated.
pub(crate) fn l2norm_rstd(x: &[f32], dim: usize) -> Vec<f32> {
    x.par_chunks(dim).map(l2norm_row_rstd).collect()
}

/// See [`super::l2norm_backward`]; arguments are validated.
pub(crate) fn l2norm_backward(x: &[f32], dim: usize, rstd: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0f32; x.len()];
    dx.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .zip(dy.par_chunks(dim))
        .zip(rstd.par_iter())
        .for_each(|(((dxr, xr), dyr), &r)| l2norm_row_backward(xr, r, dyr, dxr));
    dx
}
