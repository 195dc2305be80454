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

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

pub use crate::ops::common::rule::{RuleOpts, RuleShape, CHUNK};

use crate::backend::{dev_f32, host_f32, mixed, Act, F32s};
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

/// Gradients of the rule's inputs: dq, dk `[tokens, Hk, Dk]`, dv `[tokens, Hv, Dv]` and dbeta
/// `[tokens, Hv]` as activations; dg `[tokens, Hv]` and dh0 `[N, Hv, Dk, Dv]` fp32.
#[derive(Debug)]
pub struct RuleGrads {
    pub dq: Act,
    pub dk: Act,
    pub dv: Act,
    pub dg: F32s,
    pub dbeta: Act,
    /// Gradient of the initial states, when they were given.
    pub dh0: Option<F32s>,
}

/// Forward. Returns `o` `[tokens, Hv, Dv]` and, if `want_final`, the final states
/// `[N, Hv, Dk, Dv]` (fp32).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    beta: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    want_final: bool,
) -> Result<(Act, Option<F32s>)> {
    match (q, k, v, g, beta) {
        (Act::Host(q), Act::Host(k), Act::Host(v), F32s::Host(g), Act::Host(b)) => {
            let h0 = host_f32(h0)?;
            let (out, fin) = cpu::forward(q, k, v, g, b, seqs, s, o, h0, want_final)?;
            Ok((Act::Host(out), fin.map(F32s::Host)))
        }
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b)) => {
            let h0 = dev_f32(h0)?;
            let gpu = q.gpu().clone();
            let (out, fin) = cuda::forward(&gpu, q, k, v, g, b, seqs, s, o, h0, want_final)?;
            Ok((Act::Dev(out), fin.map(F32s::Dev)))
        }
        _ => Err(mixed("rule")),
    }
}

impl RuleGrads {
    /// The GPU backward's gradients as device buffers.
    fn dev(r: cuda::Grads) -> RuleGrads {
        RuleGrads {
            dq: Act::Dev(r.dq),
            dk: Act::Dev(r.dk),
            dv: Act::Dev(r.dv),
            dg: F32s::Dev(r.dg),
            dbeta: Act::Dev(r.dbeta),
            dh0: r.dh0.map(F32s::Dev),
        }
    }
}

/// What the rule's forward keeps for its backward besides the inputs ([`forward_saving`]): on
/// a GPU, the chunks' inverses `T = (I + M)^-1` its chunk prep solved for (fp32, the ten 16 x 16
/// blocks of T on or below the diagonal: 160 bytes per token and value head), so the
/// backward's recompute reads them instead of solving again, with bit-for-bit the same results.
/// Empty on the CPU (its backward recomputes them) and where the GPU's kernels do not make them
/// (`cuda::forward_saving`).
#[derive(Debug, Default)]
pub struct RuleSaved {
    t: Option<F32s>,
}

impl RuleSaved {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.t.as_ref().map_or(0, F32s::bytes)
    }
}

/// [`forward`], also returning what the backward can use instead of recomputing it
/// ([`RuleSaved`]; pass it to [`backward_saved`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_saving(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    beta: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    want_final: bool,
) -> Result<(Act, Option<F32s>, RuleSaved)> {
    match (q, k, v, g, beta) {
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b)) => {
            let h0 = dev_f32(h0)?;
            let gpu = q.gpu().clone();
            let (out, fin, t) =
                cuda::forward_saving(&gpu, q, k, v, g, b, seqs, s, o, h0, want_final)?;
            Ok((
                Act::Dev(out),
                fin.map(F32s::Dev),
                RuleSaved {
                    t: t.map(F32s::Dev),
                },
            ))
        }
        _ => {
            let (out, fin) = forward(q, k, v, g, beta, seqs, s, o, h0, want_final)?;
            Ok((out, fin, RuleSaved::default()))
        }
    }
}

/// [`backward`] with what [`forward_saving`] kept on the same inputs: the same results bit for
/// bit, with less recomputed.
#[allow(clippy::too_many_arguments)]
pub fn backward_saved(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    beta: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    d_o: &Act,
    d_final: Option<&F32s>,
    saved: &RuleSaved,
) -> Result<RuleGrads> {
    let t = match &saved.t {
        None => return backward(q, k, v, g, beta, seqs, s, o, h0, d_o, d_final),
        Some(F32s::Dev(t)) => t,
        Some(F32s::Host(_)) => return Err(mixed("rule backward (saved chunk inverses)")),
    };
    match (q, k, v, g, beta, d_o) {
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b), Act::Dev(d_o)) => {
            let gpu = q.gpu().clone();
            if t.gpu().ordinal() != gpu.ordinal() {
                return Err(GdnError::Invalid(format!(
                    "rule backward: the saved chunk inverses are on cuda:{}, the inputs on cuda:{}",
                    t.gpu().ordinal(),
                    gpu.ordinal()
                )));
            }
            let (h0, d_final) = (dev_f32(h0)?, dev_f32(d_final)?);
            let r =
                cuda::backward_saved(&gpu, q, k, v, g, b, seqs, s, o, h0, d_o, d_final, Some(t))?;
            Ok(RuleGrads::dev(r))
        }
        _ => Err(mixed("rule backward")),
    }
}

/// Backward from `d_o` `[tokens, Hv, Dv]` and optionally the gradient of the final states.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    beta: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    d_o: &Act,
    d_final: Option<&F32s>,
) -> Result<RuleGrads> {
    match (q, k, v, g, beta, d_o) {
        (Act::Host(q), Act::Host(k), Act::Host(v), F32s::Host(g), Act::Host(b), Act::Host(d_o)) => {
            let (h0, d_final) = (host_f32(h0)?, host_f32(d_final)?);
            let r = cpu::backward(q, k, v, g, b, seqs, s, o, h0, d_o, d_final)?;
            Ok(RuleGrads {
                dq: Act::Host(r.dq),
                dk: Act::Host(r.dk),
                dv: Act::Host(r.dv),
                dg: F32s::Host(r.dg),
                dbeta: Act::Host(r.dbeta),
                dh0: r.dh0.map(F32s::Host),
            })
        }
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b), Act::Dev(d_o)) => {
            let gpu = q.gpu().clone();
            let (h0, d_final) = (dev_f32(h0)?, dev_f32(d_final)?);
            let r = cuda::backward(&gpu, q, k, v, g, b, seqs, s, o, h0, d_o, d_final)?;
            Ok(RuleGrads::dev(r))
        }
        _ => Err(mixed("rule backward")),
    }
}
