//! SwiGLU, the MLP's activation: the op is [`crate::ops::swiglu`]; these are its CPU functions
//! under their former names (lengths are the caller's).

/// `a` `[rows, f]` from `u` `[rows, 2f]`.
pub fn swiglu_forward(u: &[f32], rows: usize, f: usize) -> Vec<f32> {
    crate::ops::swiglu::cpu::forward_unchecked(u, rows, f)
}

/// `du` `[rows, 2f]` from `u` `[rows, 2f]` and `da` `[rows, f]`.
pub fn swiglu_backward(u: &[f32], rows: usize, f: usize, da: &[f32]) -> Vec<f32> {
    crate::ops::swiglu::cpu::backward_unchecked(u, rows, f, da)
}

pub use crate::ops::swiglu::{backward, forward};
