//! The gates of GDN and GDN2, per token.
//!
//! GDN, per token `t` and value head `h` (`a`, `b` `[rows, heads]`):
//! `g = -exp(A_log[h]) * softplus(a + dt_bias[h])` (log decay) and `beta = sigmoid(b)`.
//! `softplus` is PyTorch's (`beta = 1`, threshold 20): `x` above 20, else `log1p(exp(x))`; its
//! derivative is exactly 1 above the threshold, as in PyTorch. Backward:
//! `da = -exp(A_log) * sigmoid(a + dt_bias) * dg`, `dA_log = sum_t g * dg` (since
//! `dg/dA_log = g`), `ddt_bias = sum_t da`, `db = beta (1 - beta) dbeta`.
//!
//! GDN2 ([`gates2_forward`]) has the same decay per key channel: `f` `[rows, key_heads * dk]`,
//! `g[t, h*dk + c] = -exp(A_log[h]) * softplus(f[t, h*dk + c] + dt_bias[h*dk + c])`; its erase and
//! write gates are plain sigmoids ([`sigmoid_forward`]).
//!
//! All math is f32. The sums over tokens are two-stage and fixed-order (blocks of
//! [`crate::ops::REDUCE_BLOCK`] rows), so they do not depend on the number of threads.

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::error::{GdnError, Result};
use crate::ops::check_len;

/// PyTorch's softplus threshold: above it, `softplus(x) = x`.
pub const SOFTPLUS_THRESHOLD: f32 = 20.0;

fn check_gates(
    a: &[f32],
    b: &[f32],
    rows: usize,
    heads: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<()> {
    if heads == 0 {
        return Err(GdnError::Invalid("gates: heads must be > 0, got 0".into()));
    }
    check_len("gates a (alpha)", a, rows.saturating_mul(heads))?;
    check_len("gates b (beta logits)", b, rows.saturating_mul(heads))?;
    check_len("A_log", a_log, heads)?;
    check_len("dt_bias", dt_bias, heads)
}

/// GDN gates: from `a`, `b` `[rows, heads]`, `A_log` and `dt_bias` `[heads]`, returns the log
/// decay `g` and `beta`, both `[rows, heads]`.
pub fn gates_forward(
    a: &[f32],
    b: &[f32],
    rows: usize,
    heads: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    check_gates(a, b, rows, heads, a_log, dt_bias)?;
    let g = cpu::decay_forward(a, heads, 1, a_log, dt_bias);
    Ok((g, cpu::sigmoid_forward(b)))
}

/// Backward of [`gates_forward`]: returns `da`, `db` `[rows, heads]`, `dA_log` and `ddt_bias`
/// `[heads]`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn gates_backward(
    a: &[f32],
    b: &[f32],
    rows: usize,
    heads: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    dg: &[f32],
    dbeta: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>)> {
    check_gates(a, b, rows, heads, a_log, dt_bias)?;
    check_len("gates dg", dg, rows.saturating_mul(heads))?;
    check_len("gates dbeta", dbeta, rows.saturating_mul(heads))?;
    let (da, da_log, ddt) = cpu::decay_backward(a, heads, 1, a_log, dt_bias, dg);
    let db = cpu::sigmoid_backward_from_x(b, dbeta);
    Ok((da, db, da_log, ddt))
}

fn check_gates2(
    f: &[f32],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<()> {
    if key_heads == 0 || dk == 0 {
        return Err(GdnError::Invalid(format!(
            "gates2: key_heads and dk must be > 0, got key_heads={key_heads}, dk={dk}"
        )));
    }
    let cols = key_heads.saturating_mul(dk);
    check_len("gates2 f (decay logits)", f, rows.saturating_mul(cols))?;
    check_len("A_log", a_log, key_heads)?;
    check_len("dt_bias", dt_bias, cols)
}

/// GDN2 per-channel log decay: from `f` `[rows, key_heads*dk]`, `A_log` `[key_heads]` and
/// `dt_bias` `[key_heads*dk]`, returns `g` `[rows, key_heads*dk]`.
pub fn gates2_forward(
    f: &[f32],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<Vec<f32>> {
    check_gates2(f, rows, key_heads, dk, a_log, dt_bias)?;
    Ok(cpu::decay_forward(f, key_heads * dk, dk, a_log, dt_bias))
}

/// Backward of [`gates2_forward`]: returns `df` `[rows, key_heads*dk]`, `dA_log` `[key_heads]`
/// and `ddt_bias` `[key_heads*dk]`.
#[allow(clippy::type_complexity)]
pub fn gates2_backward(
    f: &[f32],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    dg: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    check_gates2(f, rows, key_heads, dk, a_log, dt_bias)?;
    check_len("gates2 dg", dg, rows.saturating_mul(key_heads * dk))?;
    Ok(cpu::decay_backward(
        f,
        key_heads * dk,
        dk,
        a_log,
        dt_bias,
        dg,
    ))
}

/// Elementwise `sigmoid(x) = 1 / (1 + exp(-x))` (GDN2's erase and write gates).
pub fn sigmoid_forward(x: &[f32]) -> Vec<f32> {
    cpu::sigmoid_forward(x)
}

/// Backward of [`sigmoid_forward`] from its output: `dx = dy * y * (1 - y)`.
///
/// # Panics
/// If `y` and `dy` differ in length.
pub fn sigmoid_backward(y: &[f32], dy: &[f32]) -> Vec<f32> {
    assert_eq!(
        y.len(),
        dy.len(),
        "sigmoid_backward: y has {} values, dy {}",
        y.len(),
        dy.len()
    );
    cpu::sigmoid_backward(y, dy)
}
