//! SwiGLU, the MLP's activation (Megatron's `gated_linear_unit` with SiLU): `linear_fc1` gives
//! `u = [gate | up]` per row (`2F` values), and `a = silu(gate) * up` (`F` values).
//!
//! Backward, with `s = sigmoid(gate)`: `d up = da * silu(gate)`,
//! `d gate = da * up * s * (1 + gate * (1 - s))`.

use rayon::prelude::*;

/// Rows per parallel task.
const TASK_ROWS: usize = 64;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `a` `[rows, f]` from `u` `[rows, 2f]`.
pub fn swiglu_forward(u: &[f32], rows: usize, f: usize) -> Vec<f32> {
    debug_assert_eq!(u.len(), rows * 2 * f);
    let mut a = vec![0.0f32; rows * f];
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
pub fn swiglu_backward(u: &[f32], rows: usize, f: usize, da: &[f32]) -> Vec<f32> {
    debug_assert_eq!(u.len(), rows * 2 * f);
    debug_assert_eq!(da.len(), rows * f);
    let mut du = vec![0.0f32; rows * 2 * f];
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
