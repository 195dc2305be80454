//! The chunked gated delta rule (GDN's recurrence), forward and backward.
//!
//! Per sequence and value head `j` (reading key head `j / (Hv/Hk)`), with state `S` `[Dk, Dv]`:
//!
//! ```text
//! S' = exp(g_t) S;  u = beta_t (v_t - S'^T k_t);  S = S' + k_t u^T;  o_t = S^T (scale q_t)
//! ```
//!
//! The CPU implementation is chunked (chunk 64, WY/UT form, `cpu.rs`); `reference.rs` is the
//! token-by-token recurrence in f64 with its hand-written backward (tests only).
//!
//! Layouts (token-major, packed): `q`, `k` `[tokens, Hk, Dk]`, `v` `[tokens, Hv, Dv]`, `g`, `beta`
//! `[tokens, Hv]`, states `[N, Hv, Dk, Dv]` with `N = seqs.count()`. Rows at or after
//! `seqs.used()` (padding) get zero output and zero gradient.

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use super::check_len;
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

/// Chunk length of the chunked algorithm (FLA's and Megatron's).
pub const CHUNK: usize = 64;

/// Head counts and dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleShape {
    /// Key heads `Hk`.
    pub hk: usize,
    /// Value heads `Hv` (a multiple of `hk`).
    pub hv: usize,
    /// Key head dim `Dk`.
    pub dk: usize,
    /// Value head dim `Dv`.
    pub dv: usize,
}

/// Options of the rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleOpts {
    /// Multiplies q (default `Dk^-1/2`).
    pub scale: f32,
    /// L2-normalize q and k rows inside the kernel (`x * rsqrt(sum x^2 + 1e-6)`); q and k are
    /// then the raw inputs and their gradients are taken through the norm.
    pub l2norm_in_kernel: bool,
}

/// Gradients of the rule's inputs.
#[derive(Clone, Debug)]
pub struct RuleGrads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dg: Vec<f32>,
    pub dbeta: Vec<f32>,
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
    beta: &[f32],
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&[f32]>,
) -> Result<()> {
    if s.hk == 0 || s.hv == 0 || s.dk == 0 || s.dv == 0 {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: zero dimension in {s:?}"
        )));
    }
    if !s.hv.is_multiple_of(s.hk) {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: value heads ({}) must be a multiple of key heads ({})",
            s.hv, s.hk
        )));
    }
    let n = seqs.tokens();
    check_len("q", q, n * s.hk * s.dk)?;
    check_len("k", k, n * s.hk * s.dk)?;
    check_len("v", v, n * s.hv * s.dv)?;
    check_len("g", g, n * s.hv)?;
    check_len("beta", beta, n * s.hv)?;
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
    beta: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    output_final_state: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    check_inputs(q, k, v, g, beta, seqs, shape, initial_state)?;
    Ok(cpu::forward(
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
    ))
}

/// Backward from `d_o` `[tokens, Hv, Dv]` and optionally the gradient of the final states.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    d_o: &[f32],
    d_final_state: Option<&[f32]>,
) -> Result<RuleGrads> {
    check_inputs(q, k, v, g, beta, seqs, shape, initial_state)?;
    check_len("d_o", d_o, seqs.tokens() * shape.hv * shape.dv)?;
    if let Some(d) = d_final_state {
        check_len(
            "d_final_state",
            d,
            seqs.count() * shape.hv * shape.dk * shape.dv,
        )?;
    }
    Ok(cpu::backward(
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
    ))
}
