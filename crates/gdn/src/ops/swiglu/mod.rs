//! SwiGLU, the MLP's activation (Megatron's `gated_linear_unit` with SiLU): `linear_fc1` gives
//! `u = [gate | up]` per row (`2F` values), and `a = silu(gate) * up` (`F` values).
//!
//! Backward, with `s = sigmoid(gate)`: `d up = da * silu(gate)`,
//! `d gate = da * up * s * (1 + gate * (1 - s))`. Elementwise, math in f32 (bf16 storage: loads
//! and one rounding per stored value).

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{mixed, Act};
use crate::error::Result;

/// `a` `[rows, f]` from `u` `[rows, 2f]`.
pub fn forward(u: &Act, rows: usize, f: usize) -> Result<Act> {
    match u {
        Act::Host(u) => Ok(Act::Host(cpu::forward(u, rows, f)?)),
        Act::Dev(u) => {
            let mut a = DBuf::uninit(u.gpu(), rows.saturating_mul(f), u.dtype())?;
            cuda::forward(u, rows, f, &mut a)?;
            Ok(Act::Dev(a))
        }
    }
}

/// `du` `[rows, 2f]` from `u` `[rows, 2f]` and `da` `[rows, f]`.
pub fn backward(u: &Act, rows: usize, f: usize, da: &Act) -> Result<Act> {
    match (u, da) {
        (Act::Host(u), Act::Host(da)) => Ok(Act::Host(cpu::backward(u, rows, f, da)?)),
        (Act::Dev(u), Act::Dev(da)) => {
            let mut du = DBuf::uninit(u.gpu(), rows.saturating_mul(2 * f), u.dtype())?;
            cuda::backward(u, rows, f, da, &mut du)?;
            Ok(Act::Dev(du))
        }
        _ => Err(mixed("swiglu backward")),
    }
}
