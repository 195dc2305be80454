//! Per-row L2 normalization (of q and k per head).
//!
//! `rstd = 1 / sqrt(sum(x^2) + 1e-6)` (FLA's convention: eps inside the root, on the sum),
//! `y = x * rstd`. Backward: `dx = rstd * (dy - y * <dy, y>)`, with `y` recomputed in f32 from `x`
//! and `rstd` (more accurate than a stored, rounded `y`), so backward needs only `x` and the
//! `[rows]` `rstd`.
//!
//! The batch functions run the single-row helpers [`l2norm_row`] and [`l2norm_row_backward`]
//! (also used inside the gated-delta-rule kernel), so both give identical bits.

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

pub use cpu::{l2norm_row, l2norm_row_backward};

use crate::error::{GdnError, Result};
use crate::ops::check_len;

/// The epsilon added to `sum(x^2)` under the root.
pub const L2NORM_EPS: f32 = 1e-6;

fn check_x(x: &[f32], rows: usize, dim: usize) -> Result<()> {
    if dim == 0 {
        return Err(GdnError::Invalid(
            "l2norm: the row length must be > 0, got 0".into(),
        ));
    }
    check_len("l2norm x", x, rows.saturating_mul(dim))
}

/// Forward over `x` `[rows, dim]`: returns `y` `[rows, dim]` and `rstd` `[rows]`.
pub fn l2norm_forward(x: &[f32], rows: usize, dim: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    check_x(x, rows, dim)?;
    Ok(cpu::l2norm_forward(x, dim))
}

/// Only the `rstd` `[rows]` of [`l2norm_forward`] (same bits), for a backward that did not keep it.
pub fn l2norm_rstd(x: &[f32], rows: usize, dim: usize) -> Result<Vec<f32>> {
    check_x(x, rows, dim)?;
    Ok(cpu::l2norm_rstd(x, dim))
}

/// Backward of [`l2norm_forward`]: from `x` `[rows, dim]`, `rstd` `[rows]` and `dy` `[rows, dim]`,
/// returns `dx` `[rows, dim]`.
pub fn l2norm_backward(
    x: &[f32],
    rows: usize,
    dim: usize,
    rstd: &[f32],
    dy: &[f32],
) -> Result<Vec<f32>> {
    check_x(x, rows, dim)?;
    check_len("l2norm rstd", rstd, rows)?;
    check_len("l2norm dy", dy, rows.saturating_mul(dim))?;
    Ok(cpu::l2norm_backward(x, dim, rstd, dy))
}
