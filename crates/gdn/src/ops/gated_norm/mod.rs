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

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{dev, host, mixed, Act, F32s, P};
use crate::config::Normalization;
use crate::error::Result;
use crate::ops::common::norm::{GpuNormStats, Stats};

/// Forward over `o`, `z` `[rows, dv]` with weight `w` `[dv]` (and bias `b` for LayerNorm):
/// returns `y = norm(o) * silu(z)` `[rows, dv]` and the norm's per-row statistics.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    o: &Act,
    z: &Act,
    rows: usize,
    dv: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    eps: f32,
    zc: bool,
) -> Result<(Act, Stats)> {
    match (o, z, w) {
        (Act::Host(o), Act::Host(z), P::Host(w)) => {
            let (y, s) = cpu::forward(o, z, rows, dv, w, host(b, "gated norm")?, kind, eps, zc)?;
            Ok((Act::Host(y), Stats::Host(s)))
        }
        (Act::Dev(o), Act::Dev(z), P::Dev(w)) => {
            let b = dev(b, "gated norm")?;
            let gpu = o.gpu();
            let mut y = DBuf::uninit(gpu, rows.saturating_mul(dv), o.dtype())?;
            let mut s = GpuNormStats::uninit(gpu, rows, kind)?;
            cuda::forward(o, z, rows, dv, w, b, kind, eps, zc, &mut y, &mut s)?;
            Ok((Act::Dev(y), Stats::Dev(s)))
        }
        _ => Err(mixed("gated norm")),
    }
}

/// Backward of the gated norm: (do, dz, dw, db).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    o: &Act,
    z: &Act,
    rows: usize,
    dv: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    zc: bool,
    stats: &Stats,
    dy: &Act,
) -> Result<(Act, Act, F32s, Option<F32s>)> {
    match (o, z, w, stats, dy) {
        (Act::Host(o), Act::Host(z), P::Host(w), Stats::Host(s), Act::Host(dy)) => {
            let (d_o, dz, dw, db) =
                cpu::backward(o, z, rows, dv, w, host(b, "gated norm")?, kind, zc, s, dy)?;
            Ok((
                Act::Host(d_o),
                Act::Host(dz),
                F32s::Host(dw),
                db.map(F32s::Host),
            ))
        }
        (Act::Dev(o), Act::Dev(z), P::Dev(w), Stats::Dev(s), Act::Dev(dy)) => {
            let b = dev(b, "gated norm")?;
            let gpu = o.gpu();
            let n = rows.saturating_mul(dv);
            let mut d_o = DBuf::uninit(gpu, n, o.dtype())?;
            let mut dz = DBuf::uninit(gpu, n, o.dtype())?;
            let mut dw = gpu.uninit(dv)?;
            let mut db = match kind {
                Normalization::LayerNorm => Some(gpu.uninit(dv)?),
                Normalization::RMSNorm => None,
            };
            cuda::backward(
                o,
                z,
                rows,
                dv,
                w,
                b,
                kind,
                zc,
                s,
                dy,
                &mut d_o,
                &mut dz,
                &mut dw,
                db.as_mut(),
            )?;
            Ok((
                Act::Dev(d_o),
                Act::Dev(dz),
                F32s::Dev(dw),
                db.map(F32s::Dev),
            ))
        }
        _ => Err(mixed("gated norm backward")),
    }
}
