//! Linear projection without bias: `y = x W^T`, `W` `[out, in]` (PyTorch's layout), `x`
//! `[rows, in]`, `y` `[rows, out]`.
//!
//! Backward: `dx = dy W` `[rows, in]`, `dW = dy^T x` `[out, in]`. All three products go through
//! the `gemm` crate ([`crate::ops::gemm::matmul`]) with rayon. `dW` reduces over the token axis
//! (the GEMM's inner dimension); the `gemm` crate splits work over the output only and blocks the
//! inner dimension by cache sizes, never by thread count, so `dW` has the same bits under any
//! number of threads (checked by a test).

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::error::Result;
use crate::ops::check_len;

/// `y = x W^T` for `x` `[rows, in_dim]` and `w` `[out_dim, in_dim]`; returns `y` `[rows, out_dim]`.
pub fn linear_forward(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
) -> Result<Vec<f32>> {
    check_len("linear x", x, rows.saturating_mul(in_dim))?;
    check_len("linear weight", w, out_dim.saturating_mul(in_dim))?;
    Ok(cpu::linear_forward(x, rows, in_dim, w, out_dim))
}

/// Backward of [`linear_forward`]: returns `dx = dy W` `[rows, in_dim]` and `dW = dy^T x`
/// `[out_dim, in_dim]`.
pub fn linear_backward(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
    dy: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    check_len("linear x", x, rows.saturating_mul(in_dim))?;
    check_len("linear weight", w, out_dim.saturating_mul(in_dim))?;
    check_len("linear dy", dy, rows.saturating_mul(out_dim))?;
    Ok(cpu::linear_backward(x, rows, in_dim, w, out_dim, dy))
}
