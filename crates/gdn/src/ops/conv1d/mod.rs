//! Causal depthwise conv1d followed by SiLU, over packed sequences.
//!
//! `x` is `[tokens, ch]` with sequences laid out by a [`Seqs`]; `w` is `[ch, width]` (Megatron's
//! `conv1d.weight` `[ch, 1, width]` without the middle axis). For a token `t` of a sequence that
//! starts at `s`:
//!
//! `y[t, c] = silu(bias[c] + sum_{i=0}^{W-1} w[c, i] * x[t - (W-1) + i, c])`,
//!
//! where `x` before `s` counts as 0 (zero history at every sequence start: no state crosses a
//! sequence boundary). Padding rows (`t >= seqs.used()`) get `y = 0` and `dx = 0`, and contribute
//! nothing to `dw` or `dbias`.
//!
//! Backward recomputes the pre-activation from `x` (it does not need `y`), then
//! `dpre = dy * silu'(pre)`, `dx[t, c] = sum_i w[c, i] * dpre[t + (W-1) - i, c]` (same sequence only),
//! `dw[c, i] = sum_t dpre[t, c] * x[t - (W-1) + i, c]`, `dbias[c] = sum_t dpre[t, c]`. The sums
//! over tokens are two-stage and fixed-order (blocks of [`crate::ops::REDUCE_BLOCK`] tokens).
//!
//! `x` is read at a column section ([`Cols`]) of a possibly wider buffer (the layer's in_proj
//! output) and `dx` written at the same section of a buffer of that shape.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{dev, host, mixed, Act, Cols, F32s, P};
use crate::error::Result;
use crate::seqs::Seqs;

/// Causal depthwise conv1d + SiLU over the packed sequences `x`, read at its columns `xc`
/// (`xc.width` channels; `Cols::dense(ch)` for a plain `[tokens, ch]` input, or a section of the
/// in_proj output read in place), with weight `w` `[ch, width]` and optional `bias` `[ch]`:
/// returns `y` `[tokens, ch]`.
pub fn forward(x: &Act, xc: Cols, w: P, width: usize, bias: Option<P>, seqs: &Seqs) -> Result<Act> {
    match (x, w) {
        (Act::Host(x), P::Host(w)) => Ok(Act::Host(cpu::forward_cols(
            x,
            xc,
            w,
            width,
            host(bias, "conv1d")?,
            seqs,
        )?)),
        (Act::Dev(x), P::Dev(w)) => {
            let bias = dev(bias, "conv1d")?;
            let n = seqs.tokens().saturating_mul(xc.width);
            let mut y = DBuf::uninit(x.gpu(), n, x.dtype())?;
            cuda::forward(x, xc, w, width, bias, seqs, &mut y)?;
            Ok(Act::Dev(y))
        }
        _ => Err(mixed("conv1d")),
    }
}

/// Backward of [`forward`]: writes `dx` at the columns `xc` of `dx_out` (shaped like `x`; its
/// other columns are left as they are) and returns `dw` `[ch, width]` and, with a bias, `dbias`
/// `[ch]`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &Act,
    xc: Cols,
    w: P,
    width: usize,
    bias: Option<P>,
    seqs: &Seqs,
    dy: &Act,
    dx_out: &mut Act,
) -> Result<(F32s, Option<F32s>)> {
    match (x, w, dy, dx_out) {
        (Act::Host(x), P::Host(w), Act::Host(dy), Act::Host(dx)) => {
            let (dw, db) =
                cpu::backward_cols(x, xc, w, width, host(bias, "conv1d")?, seqs, dy, dx)?;
            Ok((F32s::Host(dw), db.map(F32s::Host)))
        }
        (Act::Dev(x), P::Dev(w), Act::Dev(dy), Act::Dev(dx)) => {
            let bias = dev(bias, "conv1d")?;
            let gpu = x.gpu();
            let mut dw = gpu.uninit(xc.width.saturating_mul(width))?;
            let mut db = match bias {
                Some(_) => Some(gpu.uninit(xc.width)?),
                None => None,
            };
            cuda::backward(x, xc, w, width, bias, seqs, dy, dx, &mut dw, db.as_mut())?;
            Ok((F32s::Dev(dw), db.map(F32s::Dev)))
        }
        _ => Err(mixed("conv1d backward")),
    }
}
