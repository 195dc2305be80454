//! The chunked GDN2 rule (Gated DeltaNet-2's recurrence), forward and backward.
//!
//! Per sequence and value head `j` (reading key head `j / (Hv/Hk)`), with state `S` `[Dk, Dv]`:
//!
//! ```text
//! S' = Diag(exp(g_t)) S          g_t in R^Dk: per key channel log-decay (<= 0)
//! e  = S'^T (b_t * k_t)          b_t in R^Dk: erase gate, per key channel
//! S  = S' + k_t (w_t * v_t - e)^T   w_t in R^Dv: write gate, per value channel
//! o_t = S^T (scale q_t)
//! ```
//!
//! i.e. `S_t = (I - k_t (b_t*k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t*v_t)^T` (FLA's
//! `fla/ops/gdn2/naive.py`, Megatron's `chunk_gdn2`). With `b = w = beta` and `g` the same on
//! every channel it is exactly [`gated_delta_rule`](super::gated_delta_rule).
//!
//! The CPU implementation is chunked (chunk 64, WY/UT form with per-channel decay computed in
//! sub-chunks of 16 so that no exponential can overflow, `cpu.rs`); `reference.rs` is the
//! token-by-token recurrence in f64 with its hand-written backward (tests only).
//!
//! `g` is a log-decay and must be `<= 0` (the layer's `-exp(A_log) softplus(..)` is); the chunked
//! algorithm relies on it to keep every decay factor in `[0, 1]`.
//!
//! Layouts (token-major, packed): `q`, `k` `[tokens, Hk, Dk]`, `v` `[tokens, Hv, Dv]`, `g`, `b`
//! `[tokens, Hv, Dk]` (per value head: the caller repeats key-head gates to the value heads, as
//! Megatron does), `w` `[tokens, Hv, Dv]`, states `[N, Hv, Dk, Dv]` with `N = seqs.count()`. Rows
//! at or after `seqs.used()` (padding) get zero output and zero gradient.

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use super::check_len;
pub use super::gated_delta_rule::{RuleOpts, RuleShape, CHUNK};
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

/// Gradients of the GDN2 rule's inputs (same layouts as the inputs).
#[derive(Clone, Debug)]
pub struct Gdn2Grads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dg: Vec<f32>,
    pub db: Vec<f32>,
    pub dw: Vec<f32>,
    /// Gradient of the initial state, when one was given.
    pub dh0: Option<Vec<f32>>,
}

/// Shared input checks of forward and backward.
#[allow(clippy::too_many_arguments)]
fn check_inputs(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    b: &[f32],
    w: &[f32],
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&[f32]>,
) -> Result<()> {
    if s.hk == 0 || s.hv == 0 || s.dk == 0 || s.dv == 0 {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule: zero dimension in {s:?}"
        )));
    }
    if !s.hv.is_multiple_of(s.hk) {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule: value heads ({}) must be a multiple of key heads ({})",
            s.hv, s.hk
        )));
    }
    let n = seqs.tokens();
    check_len("q", q, n * s.hk * s.dk)?;
    check_len("k", k, n * s.hk * s.dk)?;
    check_len("v", v, n * s.hv * s.dv)?;
    check_len("g", g, n * s.hv * s.dk)?;
    check_len("b", b, n * s.hv * s.dk)?;
    check_len("w", w, n * s.hv * s.dv)?;
    if let Some(h0) = h0 {
        check_len("initial_state", h0, seqs.count() * s.hv * s.dk * s.dv)?;
    }
    Ok(())
}

/// Forward. Returns `o` `[tokens, Hv, Dv]` and, if `output_final_state`, the final states
/// `[N, Hv, Dk, Dv]`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    b: &[f32],
    w: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    output_final_state: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    check_inputs(q, k, v, g, b, w, seqs, shape, initial_state)?;
    let x = cpu::Inputs { q, k, v, g, b, w };
    Ok(cpu::forward(
        &x,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
    ))
}

/// Backward from `d_o` `[tokens, Hv, Dv]` and optionally the gradient of the final states
/// `[N, Hv, Dk, Dv]`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    b: &[f32],
    w: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    d_o: &[f32],
    d_final_state: Option<&[f32]>,
) -> Result<Gdn2Grads> {
    check_inputs(q, k, v, g, b, w, seqs, shape, initial_state)?;
    check_len("d_o", d_o, seqs.tokens() * shape.hv * shape.dv)?;
    if let Some(d) = d_final_state {
        check_len(
            "d_final_state",
            d,
            seqs.count() * shape.hv * shape.dk * shape.dv,
        )?;
    }
    let x = cpu::Inputs { q, k, v, g, b, w };
    Ok(cpu::backward(
        &x,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
    ))
}
