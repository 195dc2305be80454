//! Output norm then gate: `y = norm(o) * silu(z)` per row of `dv` values, rows = tokens * heads,
//! one `[dv]` weight shared by all heads.
//!
//! `norm` is RMSNorm (`o * rstd * g`) or LayerNorm (`(o - mean) * rstd * g + b`) over `dv`, with
//! `g = w` or `1 + w` (zero-centered); the norm comes first, then the gate (FLA's
//! `FusedRMSNormGated`, Megatron's `out_norm`). Forward keeps the norm statistics
//! ([`NormStats`]); backward recomputes `norm(o)` and `silu(z)` from them:
//! `dz = dy * norm(o) * silu'(z)`, then the norm's backward with `dy * silu(z)`.
//!
//! `z` is read in place from a wider buffer (the layer's in_proj output) at a column section
//! ([`Cols`]), and backward writes `dz` at the same section of a buffer of that shape (the
//! layer's `d(in_proj output)`).
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
use crate::backend::{dev, host, mixed, Act, Cols, F32s, P};
use crate::config::Normalization;
use crate::error::Result;
use crate::ops::common::norm::{GpuNormStats, Stats};

/// Forward over `o` `[rows, dv]` and `z` read at `zcols` (rows are (token, head) pairs:
/// `zcols.width / dv` heads per token; `Cols::dense(dv)` for a plain `[rows, dv]` z) with weight
/// `w` `[dv]` (and bias `b` for LayerNorm): returns `y = norm(o) * silu(z)` `[rows, dv]` and the
/// norm's per-row statistics.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    o: &Act,
    z: &Act,
    zcols: Cols,
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
            let (y, s) = cpu::forward_cols(
                o,
                z,
                zcols,
                rows,
                dv,
                w,
                host(b, "gated norm")?,
                kind,
                eps,
                zc,
            )?;
            Ok((Act::Host(y), Stats::Host(s)))
        }
        (Act::Dev(o), Act::Dev(z), P::Dev(w)) => {
            let b = dev(b, "gated norm")?;
            let gpu = o.gpu();
            let mut y = DBuf::uninit(gpu, rows.saturating_mul(dv), o.dtype())?;
            let mut s = GpuNormStats::uninit(gpu, rows, kind)?;
            cuda::forward(o, z, zcols, rows, dv, w, b, kind, eps, zc, &mut y, &mut s)?;
            Ok((Act::Dev(y), Stats::Dev(s)))
        }
        _ => Err(mixed("gated norm")),
    }
}

/// Backward of the gated norm: writes `dz` into `dz_out` at `zcols` (a buffer shaped like the one
/// `z` lives in; its other columns are left as they are) and returns (do, dw, db).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    o: &Act,
    z: &Act,
    zcols: Cols,
    rows: usize,
    dv: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    zc: bool,
    stats: &Stats,
    dy: &Act,
    dz_out: &mut Act,
) -> Result<(Act, F32s, Option<F32s>)> {
    match (o, z, w, stats, dy, dz_out) {
        (Act::Host(o), Act::Host(z), P::Host(w), Stats::Host(s), Act::Host(dy), Act::Host(dz)) => {
            let (d_o, dw, db) = cpu::backward_cols(
                o,
                z,
                zcols,
                rows,
                dv,
                w,
                host(b, "gated norm")?,
                kind,
                zc,
                s,
                dy,
                dz,
            )?;
            Ok((Act::Host(d_o), F32s::Host(dw), db.map(F32s::Host)))
        }
        (Act::Dev(o), Act::Dev(z), P::Dev(w), Stats::Dev(s), Act::Dev(dy), Act::Dev(dz)) => {
            let b = dev(b, "gated norm")?;
            let gpu = o.gpu();
            let n = rows.saturating_mul(dv);
            let mut d_o = DBuf::uninit(gpu, n, o.dtype())?;
            let mut dw = gpu.uninit(dv)?;
            let mut db = match kind {
                Normalization::LayerNorm => Some(gpu.uninit(dv)?),
                Normalization::RMSNorm => None,
            };
            cuda::backward(
                o,
                z,
                zcols,
                rows,
                dv,
                w,
                b,
                kind,
                zc,
                s,
                dy,
                &mut d_o,
                dz,
                &mut dw,
                db.as_mut(),
            )?;
            Ok((Act::Dev(d_o), F32s::Dev(dw), db.map(F32s::Dev)))
        }
        _ => Err(mixed("gated norm backward")),
    }
}
