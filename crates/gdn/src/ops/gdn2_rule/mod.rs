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
//! every channel it is exactly the gated delta rule (`ops::gated_delta_rule`).
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

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

pub use crate::ops::common::rule::{RuleOpts, RuleShape, CHUNK};

use crate::backend::{dev_f32, host_f32, mixed, Act, F32s};
use crate::error::Result;
use crate::seqs::Seqs;

/// Gradients of the GDN2 rule's inputs (same layouts as the inputs): dq, dk, dv, db, dw as
/// activations; dg and dh0 fp32.
#[derive(Debug)]
pub struct RuleGrads {
    pub dq: Act,
    pub dk: Act,
    pub dv: Act,
    pub dg: F32s,
    pub db: Act,
    pub dw: Act,
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
    b: &Act,
    w: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    want_final: bool,
) -> Result<(Act, Option<F32s>)> {
    match (q, k, v, g, b, w) {
        (Act::Host(q), Act::Host(k), Act::Host(v), F32s::Host(g), Act::Host(b), Act::Host(w)) => {
            let (out, fin) = cpu::forward(q, k, v, g, b, w, seqs, s, o, host_f32(h0)?, want_final)?;
            Ok((Act::Host(out), fin.map(F32s::Host)))
        }
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b), Act::Dev(w)) => {
            let gpu = q.gpu().clone();
            let (out, fin) =
                cuda::forward(&gpu, q, k, v, g, b, w, seqs, s, o, dev_f32(h0)?, want_final)?;
            Ok((Act::Dev(out), fin.map(F32s::Dev)))
        }
        _ => Err(mixed("GDN2 rule")),
    }
}

/// Backward from `d_o` `[tokens, Hv, Dv]` and optionally the gradient of the final states.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    b: &Act,
    w: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    d_o: &Act,
    d_final: Option<&F32s>,
) -> Result<RuleGrads> {
    match (q, k, v, g, b, w, d_o) {
        (
            Act::Host(q),
            Act::Host(k),
            Act::Host(v),
            F32s::Host(g),
            Act::Host(b),
            Act::Host(w),
            Act::Host(d_o),
        ) => {
            let (h0, d_final) = (host_f32(h0)?, host_f32(d_final)?);
            let r = cpu::backward(q, k, v, g, b, w, seqs, s, o, h0, d_o, d_final)?;
            Ok(RuleGrads {
                dq: Act::Host(r.dq),
                dk: Act::Host(r.dk),
                dv: Act::Host(r.dv),
                dg: F32s::Host(r.dg),
                db: Act::Host(r.db),
                dw: Act::Host(r.dw),
                dh0: r.dh0.map(F32s::Host),
            })
        }
        (
            Act::Dev(q),
            Act::Dev(k),
            Act::Dev(v),
            F32s::Dev(g),
            Act::Dev(b),
            Act::Dev(w),
            Act::Dev(d_o),
        ) => {
            let gpu = q.gpu().clone();
            let (h0, d_final) = (dev_f32(h0)?, dev_f32(d_final)?);
            let r = cuda::backward(&gpu, q, k, v, g, b, w, seqs, s, o, h0, d_o, d_final)?;
            Ok(RuleGrads {
                dq: Act::Dev(r.dq),
                dk: Act::Dev(r.dk),
                dv: Act::Dev(r.dv),
                dg: F32s::Dev(r.dg),
                db: Act::Dev(r.db),
                dw: Act::Dev(r.dw),
                dh0: r.dh0.map(F32s::Dev),
            })
        }
        _ => Err(mixed("GDN2 rule backward")),
    }
}
