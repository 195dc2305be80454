//! L2 norm of one row and its backward: used by `ops::l2norm` and by both rules' in-kernel norm.

/// The epsilon added to `sum(x^2)` under the root.
pub const L2NORM_EPS: f32 = 1e-6;

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
