//! f64 reference of the per-row L2 norm (plain loops; for tests).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

/// `y = x / sqrt(sum(x^2) + 1e-6)` per row of `x` `[rows, dim]`; returns `(y, rstd)`.
pub fn l2norm_forward(x: &[f64], rows: usize, dim: usize) -> (Vec<f64>, Vec<f64>) {
    let eps = super::L2NORM_EPS as f64;
    let mut y = vec![0.0; rows * dim];
    let mut rstd = vec![0.0; rows];
    for r in 0..rows {
        let ss: f64 = x[r * dim..(r + 1) * dim].iter().map(|v| v * v).sum();
        rstd[r] = 1.0 / (ss + eps).sqrt();
        for i in 0..dim {
            y[r * dim + i] = x[r * dim + i] * rstd[r];
        }
    }
    (y, rstd)
}
