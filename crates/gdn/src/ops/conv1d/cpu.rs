//! CPU causal depthwise conv1d + SiLU.

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use rayon::prelude::*;

use crate::backend::Cols;
use crate::ops::common::act::{silu, silu_grad};
use crate::ops::common::conv::{backward_from_dpre, pre_row, seq_bounds, transpose};
use crate::ops::common::task_rows;
use crate::seqs::Seqs;

/// See [`super::conv1d_silu_forward`]; arguments are validated.
fn conv1d_silu_forward_unchecked(
    x: &[f32],
    xc: Cols,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Vec<f32> {
    let (used, ch) = (seqs.used(), xc.width);
    let bounds = seq_bounds(seqs);
    let wt = transpose(w, ch, width);
    let mut y = vec![0.0f32; seqs.tokens() * ch];
    let tr = task_rows(ch);
    y[..used * ch]
        .par_chunks_mut(tr * ch)
        .enumerate()
        .for_each(|(bi, yb)| {
            for (r, yr) in yb.chunks_mut(ch).enumerate() {
                let t = bi * tr + r;
                pre_row(x, xc, &wt, width, bias, t, bounds[t].0, yr);
                for v in yr.iter_mut() {
                    *v = silu(*v);
                }
            }
        });
    y
}

/// See [`super::conv1d_silu_backward`]; arguments are validated.
#[allow(clippy::too_many_arguments)]
fn conv1d_silu_backward_unchecked(
    x: &[f32],
    xc: Cols,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
    dy: &[f32],
    dx: &mut [f32],
) -> (Vec<f32>, Option<Vec<f32>>) {
    let (used, ch) = (seqs.used(), xc.width);
    let bounds = seq_bounds(seqs);
    let wt = transpose(w, ch, width);
    // dpre = dy * silu'(pre), pre recomputed from x.
    let mut dpre = vec![0.0f32; used * ch];
    let tr = task_rows(ch);
    dpre.par_chunks_mut(tr * ch)
        .enumerate()
        .for_each(|(bi, db)| {
            for (r, dr) in db.chunks_mut(ch).enumerate() {
                let t = bi * tr + r;
                pre_row(x, xc, &wt, width, bias, t, bounds[t].0, dr);
                for (d, g) in dr.iter_mut().zip(&dy[t * ch..(t + 1) * ch]) {
                    *d = g * silu_grad(*d);
                }
            }
        });
    let (dw, db) = backward_from_dpre(x, xc, &wt, width, &bounds, &dpre, dx, xc);
    let dbias = bias.map(|_| db);
    (dw, dbias)
}

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

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
pub fn forward(
    x: &[f32],
    ch: usize,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Result<Vec<f32>> {
    check_args(x, ch, w, width, bias, seqs)?;
    Ok(conv1d_silu_forward_unchecked(
        x,
        Cols::dense(ch),
        w,
        width,
        bias,
        seqs,
    ))
}

/// Backward of [`forward`]: returns `dx` `[tokens, ch]`, `dw` `[ch, width]` and, when
/// `bias` is given, `dbias` `[ch]`.
#[allow(clippy::type_complexity)]
pub fn backward(
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
    let mut dx = vec![0.0f32; x.len()];
    let (dw, db) =
        conv1d_silu_backward_unchecked(x, Cols::dense(ch), w, width, bias, seqs, dy, &mut dx);
    Ok((dx, dw, db))
}

/// [`forward`] with `x` read at the columns `xc` of a wider buffer (`xc.width` channels).
pub fn forward_cols(
    x: &[f32],
    xc: Cols,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Result<Vec<f32>> {
    check_cols(x, xc, w, width, bias, seqs)?;
    Ok(conv1d_silu_forward_unchecked(x, xc, w, width, bias, seqs))
}

/// [`backward`] with `x` read, and `dx` written, at the columns `xc` (`dx_out` is shaped like
/// `x`; its other columns are left as they are). Returns `dw` and (with a bias) `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn backward_cols(
    x: &[f32],
    xc: Cols,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
    dy: &[f32],
    dx_out: &mut [f32],
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    check_cols(x, xc, w, width, bias, seqs)?;
    check_len("conv1d dy", dy, seqs.tokens().saturating_mul(xc.width))?;
    check_len("conv1d dx", dx_out, x.len())?;
    Ok(conv1d_silu_backward_unchecked(
        x, xc, w, width, bias, seqs, dy, dx_out,
    ))
}

fn check_cols(
    x: &[f32],
    xc: Cols,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Result<()> {
    xc.check("conv1d x", x.len(), seqs.tokens())?;
    let ch = xc.width;
    // the dense checks on a dense view of the same size
    if ch == 0 || width == 0 {
        return check_args(&[], ch, w, width, bias, seqs);
    }
    check_len("conv1d weight", w, ch.saturating_mul(width))?;
    if let Some(b) = bias {
        check_len("conv1d bias", b, ch)?;
    }
    Ok(())
}
