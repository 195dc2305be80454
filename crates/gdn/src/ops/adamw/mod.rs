//! AdamW (PyTorch's update, decoupled weight decay) over fp32 parameter / moment / gradient
//! buffers, and the sums of squares behind the global gradient norm.
//!
//! Per element, in this order and in f32 (the GPU kernel uses round-to-nearest intrinsics, no
//! fused multiply-add, so it does the CPU's arithmetic exactly): `g = g * scale` (when clipping
//! scales the step's gradients), `p -= wd p`, `m = b1 m + (1 - b1) g`,
//! `v = b2 v + (1 - b2) g g`, `p -= step_size m / (sqrt(v) / bc2_sqrt + eps)`. The scalars
//! (bias corrections, learning rate, decay) are computed on the host ([`Hyper`]).
//!
//! [`sum_squares`]: per buffer, `sum x^2` in f64 (the CPU in element order; the GPU in a fixed
//! two-stage order: per-block partials, then the blocks in order), one download for all buffers.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::{mixed, PMut, P};
use crate::error::Result;

/// The scalars of one AdamW update (f32, as the update uses them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub b1: f32,
    pub b2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `lr * weight_decay` for matrices, 0 for vectors.
    pub wd: f32,
    /// Clipping factor the gradient is multiplied by first (`None`: not clipped).
    pub grad_scale: Option<f32>,
}

/// One AdamW update of a parameter `p` with its moments `m`, `v` and gradient `g` (same length,
/// all on the host or all on one GPU).
pub fn step(p: PMut, m: PMut, v: PMut, g: P, h: &Hyper) -> Result<()> {
    match (p, m, v, g) {
        (PMut::Host(p), PMut::Host(m), PMut::Host(v), P::Host(g)) => cpu::step(p, m, v, g, h),
        (PMut::Dev(p), PMut::Dev(m), PMut::Dev(v), P::Dev(g)) => cuda::step(p, m, v, g, h),
        _ => Err(mixed("adamw")),
    }
}

/// `sum x^2` (f64) of each buffer, in order (all on the host or all on one GPU).
pub fn sum_squares(xs: &[P]) -> Result<Vec<f64>> {
    if xs.iter().all(|x| matches!(x, P::Host(_))) {
        return Ok(xs
            .iter()
            .map(|x| match x {
                P::Host(h) => cpu::sum_squares(h),
                P::Dev(_) => unreachable!("all host"),
            })
            .collect());
    }
    let dev = xs
        .iter()
        .map(|x| match x {
            P::Dev(d) => Ok(*d),
            P::Host(_) => Err(mixed("sum of squares")),
        })
        .collect::<Result<Vec<_>>>()?;
    cuda::sum_squares(&dev)
}
