//! CPU (f32, rayon) pre-norm. The row helpers are shared with `ops::gated_norm`.

use rayon::prelude::*;

use super::NormStats;
use crate::config::Normalization;
use crate::ops::REDUCE_BLOCK;

/// Rows per parallel task for row-wise work on rows of `dim` values (about 16K values per task).
pub(crate) fn task_rows(dim: usize) -> usize {
    (16384 / dim.max(1)).max(1)
}

/// The gain `w`, or `1 + w` when zero-centered.
pub(crate) fn gain(w: &[f32], zero_centered: bool) -> Vec<f32> {
    w.iter()
        .map(|&v| if zero_centered { 1.0 + v } else { v })
        .collect()
}

/// `(mean, rstd)` of one row (mean is 0 for RMSNorm). Sums run left to right in f32.
pub(crate) fn row_stats(x: &[f32], kind: Normalization, eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    match kind {
        Normalization::RMSNorm => {
            let ss: f32 = x.iter().map(|v| v * v).sum();
            (0.0, 1.0 / (ss / n + eps).sqrt())
        }
        Normalization::LayerNorm => {
            let mean = x.iter().sum::<f32>() / n;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            (mean, 1.0 / (var + eps).sqrt())
        }
    }
}

/// `y = (x - mean) * rstd * g (+ b)` for one row.
#[inline]
pub(crate) fn row_forward(
    x: &[f32],
    g: &[f32],
    b: Option<&[f32]>,
    mean: f32,
    rstd: f32,
    y: &mut [f32],
) {
    match b {
        Some(b) => {
            for i in 0..x.len() {
                y[i] = (x[i] - mean) * rstd * g[i] + b[i];
            }
        }
        None => {
            for i in 0..x.len() {
                y[i] = (x[i] - mean) * rstd * g[i];
            }
        }
    }
}

/// Backward of one row given `dy` of the norm's output: writes `dx` and adds `dy * xhat` into
/// `dw` and, for LayerNorm (`layer`), `dy` into `db`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn row_backward(
    x: &[f32],
    g: &[f32],
    layer: bool,
    mean: f32,
    rstd: f32,
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    let n = x.len() as f32;
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    for i in 0..x.len() {
        let xhat = (x[i] - mean) * rstd;
        let dxhat = dy[i] * g[i];
        s1 += dxhat;
        s2 += dxhat * xhat;
        dw[i] += dy[i] * xhat;
    }
    let m1 = if layer { s1 / n } else { 0.0 };
    let m2 = s2 / n;
    for i in 0..x.len() {
        let xhat = (x[i] - mean) * rstd;
        dx[i] = rstd * (dy[i] * g[i] - m1 - xhat * m2);
    }
    if layer {
        for i in 0..x.len() {
            db[i] += dy[i];
        }
    }
}

/// See [`super::norm_forward`]; arguments are validated.
pub(crate) fn norm_forward(
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
pub(crate) fn norm_backward(
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
