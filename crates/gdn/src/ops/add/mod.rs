//! Elementwise accumulation: `acc += x`, for the model's residual connections (activations,
//! [`add_assign`]) and for summing gradients in place (fp32, [`add_assign_f32`]).
//!
//! Each element is one f32 addition (bf16 storage: both loaded as f32, the sum rounded to bf16
//! once, to nearest even), so the result does not depend on threads or launch shape.

pub mod cpu;
pub mod cuda;
#[cfg(test)]
mod tests;

use crate::backend::{mixed, Act, PMut, P};
use crate::error::Result;

/// `acc += x` over activations of one length (and, on a GPU, one storage type).
pub fn add_assign(acc: &mut Act, x: &Act) -> Result<()> {
    match (acc, x) {
        (Act::Host(a), Act::Host(x)) => cpu::add_assign(a, x),
        (Act::Dev(a), Act::Dev(x)) => cuda::add_assign(a, x),
        _ => Err(mixed("add")),
    }
}

/// `acc += x` over fp32 buffers of one length.
pub fn add_assign_f32(acc: PMut, x: P) -> Result<()> {
    match (acc, x) {
        (PMut::Host(a), P::Host(x)) => cpu::add_assign(a, x),
        (PMut::Dev(a), P::Dev(x)) => cuda::add_assign_f32(a, x),
        _ => Err(mixed("add")),
    }
}
