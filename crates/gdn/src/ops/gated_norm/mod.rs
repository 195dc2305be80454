//! Output norm then gate: `y = norm(o) * silu(z)` per row of `dv` values, rows = tokens * heads,
//! one `[dv]` weight shared by all heads.
//!
//! `norm` is RMSNorm (`o * rstd * g`) or LayerNorm (`(o - mean) * rstd * g + b`) over `dv`, with
//! `g = w` or `1 + w` (zero-centered); the norm comes first, then the gate (FLA's
//! `FusedRMSNormGated`, Megatron's `out_norm`). Forward keeps the norm statistics
//! ([`NormStats`]); backward recomputes `norm(o)` and `silu(z)` from them:
//! `dz = dy * norm(o) * silu'(z)`, then the norm's backward with `dy * silu(z)`.
//!
//! [`gated_norm_forward`] is a pure function of its inputs: every row is computed by the same
//! sequential code whatever the thread count, so calling it twice gives identical bits (a
//! recompute in backward reproduces the kept output exactly). The weight gradients sum over rows
//! two-stage and fixed-order (blocks of [`crate::ops::REDUCE_BLOCK`] rows).

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::config::Normalization;
use crate::error::Result;
use crate::ops::check_len;
use crate::ops::norm::{check_eps, check_norm_params, NormStats};

/// Forward over `o`, `z` `[rows, dv]` with weight `w` `[dv]` (and bias `b` `[dv]` for LayerNorm,
/// `None` for RMSNorm): returns `y` `[rows, dv]` and the norm's per-row statistics.
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_forward(
    o: &[f32],
    z: &[f32],
    rows: usize,
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> Result<(Vec<f32>, NormStats)> {
    check_norm_params("gated_norm", dv, w, b, kind)?;
    check_eps("gated_norm", eps)?;
    check_len("gated_norm o", o, rows.saturating_mul(dv))?;
    check_len("gated_norm z", z, rows.saturating_mul(dv))?;
    Ok(cpu::gated_norm_forward(
        o,
        z,
        dv,
        w,
        b,
        kind,
        eps,
        zero_centered,
    ))
}

/// Backward of [`gated_norm_forward`]: returns `do`, `dz` `[rows, dv]`, `dw` `[dv]` and, for
/// LayerNorm, `db` `[dv]`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn gated_norm_backward(
    o: &[f32],
    z: &[f32],
    rows: usize,
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    zero_centered: bool,
    stats: &NormStats,
    dy: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>)> {
    check_norm_params("gated_norm", dv, w, b, kind)?;
    check_len("gated_norm o", o, rows.saturating_mul(dv))?;
    check_len("gated_norm z", z, rows.saturating_mul(dv))?;
    check_len("gated_norm dy", dy, rows.saturating_mul(dv))?;
    stats.check("gated_norm stats", rows, kind)?;
    Ok(cpu::gated_norm_backward(
        o,
        z,
        dv,
        w,
        b,
        kind,
        zero_centered,
        stats,
        dy,
    ))
}
