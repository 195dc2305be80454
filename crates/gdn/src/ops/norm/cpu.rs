//! CPU (f32, rayon) pre-norm. The row helpers are shared with `ops::gated_norm`.

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use crate::ops::common::norm::{check_eps, check_norm_params};
use rayon::prelude::*;

use super::NormStats;
use crate::config::Normalization;
use crate::ops::common::norm::{gain, row_backward, row_forward, row_stats};
use crate::ops::common::task_rows;
use crate::ops::REDUCE_BLOCK;

/// See [`super::norm_forward`]; arguments are validated.
fn norm_forward_unchecked(
    x: &[f32],
    dim: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> (Vec<f32>, NormStats) {
    let rows = x.len() / dim;
    let g = gain(w, zero_centered);
    let mut y = vec![0.0f32; x.len()];
    let mut rstd = vec![0.0f32; rows];
    let mut mean = vec![0.0f32; rows];
    let tr = task_rows(dim);
    y.par_chunks_mut(tr * dim)
        .zip(rstd.par_chunks_mut(tr))
        .zip(mean.par_chunks_mut(tr))
        .zip(x.par_chunks(tr * dim))
        .for_each(|(((yb, rb), mb), xb)| {
            for r in 0..rb.len() {
                let xr = &xb[r * dim..(r + 1) * dim];
                let (m, s) = row_stats(xr, kind, eps);
                row_forward(xr, &g, b, m, s, &mut yb[r * dim..(r + 1) * dim]);
                rb[r] = s;
                mb[r] = m;
            }
        });
    let mean = (kind == Normalization::LayerNorm).then_some(mean);
    (y, NormStats { rstd, mean })
}

/// See [`super::norm_backward`]; arguments are validated.
fn norm_backward_unchecked(
    x: &[f32],
    dim: usize,
    w: &[f32],
    kind: Normalization,
    zero_centered: bool,
    stats: &NormStats,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let layer = kind == Normalization::LayerNorm;
    let g = gain(w, zero_centered);
    let mean = stats.mean.as_deref();
    let mut dx = vec![0.0f32; x.len()];
    let blk = REDUCE_BLOCK * dim;
    // Stage 1: one partial [dw | db] per block of REDUCE_BLOCK rows, rows in order.
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(blk)
        .zip(x.par_chunks(blk))
        .zip(dy.par_chunks(blk))
        .enumerate()
        .map(|(bi, ((dxb, xb), dyb))| {
            let mut p = vec![0.0f32; 2 * dim];
            let (pw, pb) = p.split_at_mut(dim);
            for r in 0..xb.len() / dim {
                let row = bi * REDUCE_BLOCK + r;
                let s = r * dim..(r + 1) * dim;
                let m = mean.map_or(0.0, |m| m[row]);
                let (xr, dyr) = (&xb[s.clone()], &dyb[s.clone()]);
                row_backward(xr, &g, layer, m, stats.rstd[row], dyr, &mut dxb[s], pw, pb);
            }
            p
        })
        .collect();
    // Stage 2: partials summed in block order.
    let mut acc = vec![0.0f32; 2 * dim];
    for p in &partials {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v;
        }
    }
    let db = acc.split_off(dim);
    (dx, acc, layer.then_some(db))
}

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

/// Forward of the pre-norm over `x` `[rows, dim]`: returns `y` `[rows, dim]` and the statistics
/// backward needs. `b` is required for LayerNorm and must be `None` for RMSNorm.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &[f32],
    rows: usize,
    dim: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> Result<(Vec<f32>, NormStats)> {
    check_norm_params("norm", dim, w, b, kind)?;
    check_eps("norm", eps)?;
    check_len("norm x", x, rows.saturating_mul(dim))?;
    Ok(norm_forward_unchecked(
        x,
        dim,
        w,
        b,
        kind,
        eps,
        zero_centered,
    ))
}

/// Backward of [`forward`]: from `x`, the statistics forward returned and `dy` `[rows, dim]`,
/// returns `dx` `[rows, dim]`, `dw` `[dim]` and, for LayerNorm, `db` `[dim]`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn backward(
    x: &[f32],
    rows: usize,
    dim: usize,
    w: &[f32],
    kind: Normalization,
    zero_centered: bool,
    stats: &NormStats,
    dy: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Option<Vec<f32>>)> {
    if dim == 0 {
        return Err(GdnError::Invalid(
            "norm: the normalized dimension must be > 0, got 0".into(),
        ));
    }
    check_len("norm weight", w, dim)?;
    check_len("norm x", x, rows.saturating_mul(dim))?;
    check_len("norm dy", dy, rows.saturating_mul(dim))?;
    stats.check("norm stats", rows, kind)?;
    Ok(norm_backward_unchecked(
        x,
        dim,
        w,
        kind,
        zero_centered,
        stats,
        dy,
    ))
}
