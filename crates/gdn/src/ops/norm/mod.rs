//! Input pre-norm over the last dimension: RMSNorm or LayerNorm (`crate::config::Normalization`).
//!
//! Per row `x` of `dim` values, with gain `g = w` (or `g = 1 + w` when `zero_centered`):
//!
//! - RMSNorm: `rstd = 1 / sqrt(mean(x^2) + eps)`, `y = x * rstd * g`.
//! - LayerNorm: `mean = mean(x)`, `rstd = 1 / sqrt(var(x) + eps)` (biased variance),
//!   `y = (x - mean) * rstd * g + b`.
//!
//! Forward keeps the per-row statistics ([`NormStats`]) for backward. Backward, with
//! `xhat = (x - mean) * rstd` and `dxhat = dy * g`:
//! `dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))` (the `mean(dxhat)` term only for
//! LayerNorm), `dw = sum_rows dy * xhat`, `db = sum_rows dy`. The sums over rows are two-stage and
//! fixed-order (blocks of [`crate::ops::REDUCE_BLOCK`] rows), so they do not depend on the number
//! of threads.

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::config::Normalization;
use crate::error::{GdnError, Result};
use crate::ops::check_len;

/// Per-row statistics kept by a norm's forward for its backward.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NormStats {
    /// `1 / sqrt(mean(x^2) + eps)` (RMSNorm) or `1 / sqrt(var(x) + eps)` (LayerNorm), per row.
    pub rstd: Vec<f32>,
    /// Mean per row; LayerNorm only.
    pub mean: Option<Vec<f32>>,
}

impl NormStats {
    /// Bytes held (4 per stored f32).
    pub fn bytes(&self) -> usize {
        4 * (self.rstd.len() + self.mean.as_ref().map_or(0, |m| m.len()))
    }

    /// Error unless these are the stats of `rows` rows of a `kind` norm.
    pub(crate) fn check(&self, name: &str, rows: usize, kind: Normalization) -> Result<()> {
        check_len(&format!("{name}.rstd"), &self.rstd, rows)?;
        match (kind, &self.mean) {
            (Normalization::LayerNorm, Some(m)) => check_len(&format!("{name}.mean"), m, rows),
            (Normalization::LayerNorm, None) => Err(GdnError::Invalid(format!(
                "{name}: LayerNorm statistics need the per-row mean, got none"
            ))),
            (Normalization::RMSNorm, None) => Ok(()),
            (Normalization::RMSNorm, Some(_)) => Err(GdnError::Invalid(format!(
                "{name}: RMSNorm statistics hold no mean, got one (LayerNorm statistics?)"
            ))),
        }
    }
}

/// Shared argument checks of the norms (also used by `ops::gated_norm`): `dim > 0`, `w` of `dim`
/// values, `b` present (`dim` values) exactly for LayerNorm.
pub(crate) fn check_norm_params(
    op: &str,
    dim: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
) -> Result<()> {
    if dim == 0 {
        return Err(GdnError::Invalid(format!(
            "{op}: the normalized dimension must be > 0, got 0"
        )));
    }
    check_len(&format!("{op} weight"), w, dim)?;
    match (kind, b) {
        (Normalization::LayerNorm, Some(b)) => check_len(&format!("{op} bias"), b, dim),
        (Normalization::LayerNorm, None) => Err(GdnError::Invalid(format!(
            "{op}: LayerNorm needs a bias of {dim} values, got none"
        ))),
        (Normalization::RMSNorm, None) => Ok(()),
        (Normalization::RMSNorm, Some(_)) => Err(GdnError::Invalid(format!(
            "{op}: RMSNorm takes no bias, got one"
        ))),
    }
}

/// Error unless `eps` is finite and `>= 0`.
pub(crate) fn check_eps(op: &str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(GdnError::Invalid(format!(
            "{op}: eps must be finite and >= 0, got {eps}"
        )));
    }
    Ok(())
}

/// Forward of the pre-norm over `x` `[rows, dim]`: returns `y` `[rows, dim]` and the statistics
/// backward needs. `b` is required for LayerNorm and must be `None` for RMSNorm.
#[allow(clippy::too_many_arguments)]
pub fn norm_forward(
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
    Ok(cpu::norm_forward(x, dim, w, b, kind, eps, zero_centered))
}

/// Backward of [`norm_forward`]: from `x`, the statistics forward returned and `dy` `[rows, dim]`,
/// returns `dx` `[rows, dim]`, `dw` `[dim]` and, for LayerNorm, `db` `[dim]`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn norm_backward(
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
    Ok(cpu::norm_backward(
        x,
        dim,
        w,
        kind,
        zero_centered,
        stats,
        dy,
    ))
}
