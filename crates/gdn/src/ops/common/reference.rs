//! f64 references shared by several ops' references (plain loops; for tests): the norm
//! (`ops::norm`, `ops::gated_norm`) and SiLU (`ops::conv1d`, `ops::gated_norm`).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

use crate::config::Normalization;

/// `x / (1 + exp(-x))`.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Per-row `(mean, rstd)` in f64 (mean is 0 for RMSNorm).
pub fn norm_stats(
    x: &[f64],
    rows: usize,
    dim: usize,
    kind: Normalization,
    eps: f64,
) -> Vec<(f64, f64)> {
    (0..rows)
        .map(|r| {
            let xr = &x[r * dim..(r + 1) * dim];
            let n = dim as f64;
            match kind {
                Normalization::RMSNorm => {
                    let ms = xr.iter().map(|v| v * v).sum::<f64>() / n;
                    (0.0, 1.0 / (ms + eps).sqrt())
                }
                Normalization::LayerNorm => {
                    let mean = xr.iter().sum::<f64>() / n;
                    let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                    (mean, 1.0 / (var + eps).sqrt())
                }
            }
        })
        .collect()
}

/// `y = (x - mean) * rstd * g (+ b)` over `x` `[rows, dim]`, `g = w` or `1 + w`.
#[allow(clippy::too_many_arguments)]
pub fn norm_forward(
    x: &[f64],
    rows: usize,
    dim: usize,
    w: &[f64],
    b: Option<&[f64]>,
    kind: Normalization,
    eps: f64,
    zero_centered: bool,
) -> Vec<f64> {
    let stats = norm_stats(x, rows, dim, kind, eps);
    let mut y = vec![0.0; rows * dim];
    for r in 0..rows {
        let (mean, rstd) = stats[r];
        for i in 0..dim {
            let g = if zero_centered { 1.0 + w[i] } else { w[i] };
            y[r * dim + i] = (x[r * dim + i] - mean) * rstd * g + b.map_or(0.0, |b| b[i]);
        }
    }
    y
}
