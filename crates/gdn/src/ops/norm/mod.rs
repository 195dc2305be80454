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

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{dev, host, mixed, Act, F32s, P};
use crate::config::Normalization;
use crate::error::Result;
pub use crate::ops::common::norm::{GpuNormStats, NormStats, Stats};

/// Forward of the pre-norm over `x` `[rows, dim]`: returns `y` `[rows, dim]` and the statistics
/// backward needs. `b` is required for LayerNorm and must be `None` for RMSNorm.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &Act,
    rows: usize,
    dim: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    eps: f32,
    zc: bool,
) -> Result<(Act, Stats)> {
    match (x, w) {
        (Act::Host(x), P::Host(w)) => {
            let (y, s) = cpu::forward(x, rows, dim, w, host(b, "norm")?, kind, eps, zc)?;
            Ok((Act::Host(y), Stats::Host(s)))
        }
        (Act::Dev(x), P::Dev(w)) => {
            let b = dev(b, "norm")?;
            let gpu = x.gpu();
            let mut y = DBuf::uninit(gpu, rows.saturating_mul(dim), x.dtype())?;
            let mut s = GpuNormStats::uninit(gpu, rows, kind)?;
            cuda::forward(x, rows, dim, w, b, kind, eps, zc, &mut y, &mut s)?;
            Ok((Act::Dev(y), Stats::Dev(s)))
        }
        _ => Err(mixed("norm")),
    }
}

/// Backward of [`forward`]: from `x`, the statistics forward returned and `dy` `[rows, dim]`,
/// returns `dx` `[rows, dim]`, `dw` `[dim]` and, for LayerNorm, `db` `[dim]`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &Act,
    rows: usize,
    dim: usize,
    w: P,
    kind: Normalization,
    zc: bool,
    stats: &Stats,
    dy: &Act,
) -> Result<(Act, F32s, Option<F32s>)> {
    match (x, w, stats, dy) {
        (Act::Host(x), P::Host(w), Stats::Host(s), Act::Host(dy)) => {
            let (dx, dw, db) = cpu::backward(x, rows, dim, w, kind, zc, s, dy)?;
            Ok((Act::Host(dx), F32s::Host(dw), db.map(F32s::Host)))
        }
        (Act::Dev(x), P::Dev(w), Stats::Dev(s), Act::Dev(dy)) => {
            let gpu = x.gpu();
            let mut dx = DBuf::uninit(gpu, rows.saturating_mul(dim), x.dtype())?;
            let mut dw = gpu.uninit(dim)?;
            let mut db = match kind {
                Normalization::LayerNorm => Some(gpu.uninit(dim)?),
                Normalization::RMSNorm => None,
            };
            cuda::backward(
                x,
                rows,
                dim,
                w,
                kind,
                zc,
                s,
                dy,
                &mut dx,
                &mut dw,
                db.as_mut(),
            )?;
            Ok((Act::Dev(dx), F32s::Dev(dw), db.map(F32s::Dev)))
        }
        _ => Err(mixed("norm backward")),
    }
}
