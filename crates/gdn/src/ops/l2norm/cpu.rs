//! CPU per-row L2 norm: the single-row helpers and the batch functions built on them.

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use rayon::prelude::*;

pub use crate::ops::common::l2norm::{l2norm_row, l2norm_row_backward, l2norm_row_rstd};
use crate::ops::common::task_rows;

/// See [`super::l2norm_forward`]; arguments are validated.
fn l2norm_forward_unchecked(x: &[f32], dim: usize) -> (Vec<f32>, Vec<f32>) {
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
fn l2norm_rstd_unchecked(x: &[f32], dim: usize) -> Vec<f32> {
    x.par_chunks(dim).map(l2norm_row_rstd).collect()
}

/// See [`super::l2norm_backward`]; arguments are validated.
fn l2norm_backward_unchecked(x: &[f32], dim: usize, rstd: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0f32; x.len()];
    dx.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .zip(dy.par_chunks(dim))
        .zip(rstd.par_iter())
        .for_each(|(((dxr, xr), dyr), &r)| l2norm_row_backward(xr, r, dyr, dxr));
    dx
}

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

fn check_x(x: &[f32], rows: usize, dim: usize) -> Result<()> {
    if dim == 0 {
        return Err(GdnError::Invalid(
            "l2norm: the row length must be > 0, got 0".into(),
        ));
    }
    check_len("l2norm x", x, rows.saturating_mul(dim))
}

/// Forward over `x` `[rows, dim]`: returns `y` `[rows, dim]` and `rstd` `[rows]`.
pub fn forward(x: &[f32], rows: usize, dim: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    check_x(x, rows, dim)?;
    Ok(l2norm_forward_unchecked(x, dim))
}

/// Only the `rstd` `[rows]` of [`forward`] (same bits), for a backward that did not keep it.
pub fn rstd(x: &[f32], rows: usize, dim: usize) -> Result<Vec<f32>> {
    check_x(x, rows, dim)?;
    Ok(l2norm_rstd_unchecked(x, dim))
}

/// Backward of [`forward`]: from `x` `[rows, dim]`, `rstd` `[rows]` and `dy` `[rows, dim]`,
/// returns `dx` `[rows, dim]`.
pub fn backward(x: &[f32], rows: usize, dim: usize, rstd: &[f32], dy: &[f32]) -> Result<Vec<f32>> {
    check_x(x, rows, dim)?;
    check_len("l2norm rstd", rstd, rows)?;
    check_len("l2norm dy", dy, rows.saturating_mul(dim))?;
    Ok(l2norm_backward_unchecked(x, dim, rstd, dy))
}
