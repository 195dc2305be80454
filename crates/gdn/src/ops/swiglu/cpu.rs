//! CPU SwiGLU (f32, rayon over blocks of rows).

use rayon::prelude::*;

use crate::error::{GdnError, Result};
use crate::ops::check_len;

/// Rows per parallel task.
const TASK_ROWS: usize = 64;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn check_f(f: usize) -> Result<()> {
    if f == 0 {
        return Err(GdnError::Invalid(
            "swiglu: ffn_hidden_size must be > 0".into(),
        ));
    }
    Ok(())
}

/// `a` `[rows, f]` from `u` `[rows, 2f]`.
pub fn forward(u: &[f32], rows: usize, f: usize) -> Result<Vec<f32>> {
    check_f(f)?;
    check_len("swiglu u", u, rows.saturating_mul(2 * f))?;
    Ok(forward_unchecked(u, rows, f))
}

/// [`forward`] without the checks (lengths are the caller's).
pub(crate) fn forward_unchecked(u: &[f32], rows: usize, f: usize) -> Vec<f32> {
    debug_assert_eq!(u.len(), rows * 2 * f);
    let mut a = vec![0.0f32; rows * f];
    if f == 0 {
        return a;
    }
    a.par_chunks_mut(TASK_ROWS * f)
        .zip(u.par_chunks(TASK_ROWS * 2 * f))
        .for_each(|(a, u)| {
            for (ar, ur) in a.chunks_mut(f).zip(u.chunks(2 * f)) {
                let (g, up) = ur.split_at(f);
                for j in 0..f {
                    ar[j] = g[j] * sigmoid(g[j]) * up[j];
                }
            }
        });
    a
}

/// `du` `[rows, 2f]` from `u` `[rows, 2f]` and `da` `[rows, f]`.
pub fn backward(u: &[f32], rows: usize, f: usize, da: &[f32]) -> Result<Vec<f32>> {
    check_f(f)?;
    check_len("swiglu u", u, rows.saturating_mul(2 * f))?;
    check_len("swiglu da", da, rows.saturating_mul(f))?;
    Ok(backward_unchecked(u, rows, f, da))
}

/// [`backward`] without the checks.
pub(crate) fn backward_unchecked(u: &[f32], rows: usize, f: usize, da: &[f32]) -> Vec<f32> {
    debug_assert_eq!(u.len(), rows * 2 * f);
    debug_assert_eq!(da.len(), rows * f);
    let mut du = vec![0.0f32; rows * 2 * f];
    if f == 0 {
        return du;
    }
    du.par_chunks_mut(TASK_ROWS * 2 * f)
        .zip(u.par_chunks(TASK_ROWS * 2 * f))
        .zip(da.par_chunks(TASK_ROWS * f))
        .for_each(|((du, u), da)| {
            for ((dr, ur), dar) in du.chunks_mut(2 * f).zip(u.chunks(2 * f)).zip(da.chunks(f)) {
                let (g, up) = ur.split_at(f);
                let (dg, dup) = dr.split_at_mut(f);
                for j in 0..f {
                    let s = sigmoid(g[j]);
                    let silu = g[j] * s;
                    dup[j] = dar[j] * silu;
                    dg[j] = dar[j] * up[j] * s * (1.0 + g[j] * (1.0 - s));
                }
            }
        });
    du
}
