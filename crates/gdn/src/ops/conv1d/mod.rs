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

pub(crate) mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use crate::seqs::Seqs;

fn check_args(
    x: &[f32],
    ch: usize,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Result<()> {
    if ch == 0 {
        return Err(GdnError::Invalid(
            "conv1d: channels must be > 0, got 0".into(),
        ));
    }
    if width == 0 {
        return Err(GdnError::Invalid(
            "conv1d: kernel width must be > 0, got 0".into(),
        ));
    }
    check_len("conv1d x", x, seqs.tokens().saturating_mul(ch))?;
    check_len("conv1d weight", w, ch.saturating_mul(width))?;
    if let Some(b) = bias {
        check_len("conv1d bias", b, ch)?;
    }
    Ok(())
}

/// Forward: `x` `[seqs.tokens(), ch]`, `w` `[ch, width]`, optional `bias` `[ch]`; returns `y`
/// `[seqs.tokens(), ch]`.
pub fn conv1d_silu_forward(
    x: &[f32],
    ch: usize,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Result<Vec<f32>> {
    check_args(x, ch, w, width, bias, seqs)?;
    Ok(cpu::conv1d_silu_forward(x, ch, w, width, bias, seqs))
}

/// Backward of [`conv1d_silu_forward`]: returns `dx` `[tokens, ch]`, `dw` `[ch, width]` and, when
/// `bias` is given, `dbias` `[ch]`.
#[allow(clippy::type_complexity)]
pub fn conv1d_silu_backward(
    x: &[f32],
    ch: usize,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
    dy: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Option<Vec<f32>>)> {
    check_args(x, ch, w, width, bias, seqs)?;
    check_len("conv1d dy", dy, seqs.tokens().saturating_mul(ch))?;
    Ok(cpu::conv1d_silu_backward(x, ch, w, width, bias, seqs, dy))
}
