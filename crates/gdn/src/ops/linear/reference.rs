//! f64 reference of the linear projection (plain loops; for tests).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

/// `y[r, o] = sum_i x[r, i] * w[o, i]`.
pub fn linear_forward(
    x: &[f64],
    rows: usize,
    in_dim: usize,
    w: &[f64],
    out_dim: usize,
) -> Vec<f64> {
    let mut y = vec![0.0; rows * out_dim];
    for r in 0..rows {
        for o in 0..out_dim {
            let mut s = 0.0;
            for i in 0..in_dim {
                s += x[r * in_dim + i] * w[o * in_dim + i];
            }
            y[r * out_dim + o] = s;
        }
    }
    y
}
