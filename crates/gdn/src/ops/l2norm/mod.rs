//! Per-row L2 normalization (of q and k per head).
//!
//! `rstd = 1 / sqrt(sum(x^2) + 1e-6)` (FLA's convention: eps inside the root, on the sum),
//! `y = x * rstd`. Backward: `dx = rstd * (dy - y * <dy, y>)`, with `y` recomputed in f32 from `x`
//! and `rstd` (more accurate than a stored, rounded `y`), so backward needs only `x` and the
//! `[rows]` `rstd`.
//!
//! The batch functions run the single-row helpers [`l2norm_row`] and [`l2norm_row_backward`]
//! (also used inside the gated-delta-rule kernel), so both give identical bits.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

pub use crate::ops::common::l2norm::{l2norm_row, l2norm_row_backward, L2NORM_EPS};

use crate::backend::cuda::DBuf;
use crate::backend::{mixed, Act};
use crate::error::Result;

/// L2 norm of every row of `x` `[rows, dim]`: `y = x * rsqrt(sum(x^2) + eps)`.
pub fn forward(x: &Act, rows: usize, dim: usize) -> Result<Act> {
    match x {
        Act::Host(x) => Ok(Act::Host(cpu::forward(x, rows, dim)?.0)),
        Act::Dev(x) => {
            let gpu = x.gpu();
            let mut y = DBuf::uninit(gpu, rows.saturating_mul(dim), x.dtype())?;
            let mut rstd = gpu.uninit(rows)?;
            cuda::forward(x, rows, dim, &mut y, &mut rstd)?;
            Ok(Act::Dev(y))
        }
    }
}

/// Backward of [`forward`] from `x` (the inverse norms are recomputed) and `dy` `[rows, dim]`.
pub fn backward(x: &Act, rows: usize, dim: usize, dy: &Act) -> Result<Act> {
    match (x, dy) {
        (Act::Host(x), Act::Host(dy)) => {
            let r = cpu::rstd(x, rows, dim)?;
            Ok(Act::Host(cpu::backward(x, rows, dim, &r, dy)?))
        }
        (Act::Dev(x), Act::Dev(dy)) => {
            let r = cuda::rstd(x, rows, dim)?;
            let mut dx = DBuf::uninit(x.gpu(), rows.saturating_mul(dim), x.dtype())?;
            cuda::backward(x, rows, dim, &r, dy, &mut dx)?;
            Ok(Act::Dev(dx))
        }
        _ => Err(mixed("l2norm backward")),
    }
}
