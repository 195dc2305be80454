//! CPU causal depthwise conv1d + SiLU.

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use rayon::prelude::*;

use crate::ops::common::act::{silu, silu_grad};
use crate::ops::common::task_rows;
use crate::ops::REDUCE_BLOCK;
use crate::seqs::Seqs;

/// `(start, end)` of the sequence of each token below `seqs.used()`.
fn seq_bounds(seqs: &Seqs) -> Vec<(usize, usize)> {
    let mut b = vec![(0, 0); seqs.used()];
    for i in 0..seqs.count() {
        let r = seqs.range(i);
        b[r.clone()].fill((r.start, r.end));
    }
    b
}

/// `w` `[ch, width]` to `[width, ch]`, so the inner loops run over contiguous channels.
fn transpose(w: &[f32], ch: usize, width: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; w.len()];
    for c in 0..ch {
        for i in 0..width {
            t[i * ch + c] = w[c * width + i];
        }
    }
    t
}

/// Pre-activation of token `t` (sequence starting at `start`) into `acc` `[ch]`: bias first, then
/// taps `i = 0..width` in order. Forward and backward both call this, so they agree bitwise.
#[allow(clippy::too_many_arguments)]
#[inline]
fn pre_row(
    x: &[f32],
    ch: usize,
    wt: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    t: usize,
    start: usize,
    acc: &mut [f32],
) {
    match bias {
        Some(b) => acc.copy_from_slice(b),
        None => acc.fill(0.0),
    }
    for i in 0..width {
        let back = width - 1 - i;
        if t >= start + back {
            let xr = &x[(t - back) * ch..(t - back + 1) * ch];
            let wr = &wt[i * ch..(i + 1) * ch];
            for c in 0..ch {
                acc[c] += wr[c] * xr[c];
            }
        }
    }
}

/// See [`super::conv1d_silu_forward`]; arguments are validated.
fn conv1d_silu_forward_unchecked(
    x: &[f32],
    ch: usize,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
) -> Vec<f32> {
    let used = seqs.used();
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
                pre_row(x, ch, &wt, width, bias, t, bounds[t].0, yr);
                for v in yr.iter_mut() {
                    *v = silu(*v);
                }
            }
        });
    y
}

/// See [`super::conv1d_silu_backward`]; arguments are validated.
fn conv1d_silu_backward_unchecked(
    x: &[f32],
    ch: usize,
    w: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    seqs: &Seqs,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let used = seqs.used();
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
                pre_row(x, ch, &wt, width, bias, t, bounds[t].0, dr);
                for (d, g) in dr.iter_mut().zip(&dy[t * ch..(t + 1) * ch]) {
                    *d = g * silu_grad(*d);
                }
            }
        });
    // dx per token; partial [dw^T (width x ch) | dbias (ch)] per block of REDUCE_BLOCK tokens.
    let mut dx = vec![0.0f32; seqs.tokens() * ch];
    let plen = (width + 1) * ch;
    let partials: Vec<Vec<f32>> = dx[..used * ch]
        .par_chunks_mut(REDUCE_BLOCK * ch)
        .enumerate()
        .map(|(bi, dxb)| {
            let mut p = vec![0.0f32; plen];
            for (r, dxr) in dxb.chunks_mut(ch).enumerate() {
                let t = bi * REDUCE_BLOCK + r;
                let (start, end) = bounds[t];
                let dp = &dpre[t * ch..(t + 1) * ch];
                for i in 0..width {
                    let back = width - 1 - i;
                    let wr = &wt[i * ch..(i + 1) * ch];
                    // token t feeds tap i of token t + back
                    if t + back < end {
                        let dn = &dpre[(t + back) * ch..(t + back + 1) * ch];
                        for c in 0..ch {
                            dxr[c] += wr[c] * dn[c];
                        }
                    }
                    // tap i of token t reads token t - back
                    if t >= start + back {
                        let xr = &x[(t - back) * ch..(t - back + 1) * ch];
                        let pr = &mut p[i * ch..(i + 1) * ch];
                        for c in 0..ch {
                            pr[c] += dp[c] * xr[c];
                        }
                    }
                }
                for (a, d) in p[width * ch..].iter_mut().zip(dp) {
                    *a += d;
                }
            }
            p
        })
        .collect();
    let mut acc = vec![0.0f32; plen];
    for p in &partials {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v;
        }
    }
    let mut dw = vec![0.0f32; ch * width];
    for c in 0..ch {
        for i in 0..width {
            dw[c * width + i] = acc[i * ch + c];
        }
    }
    let dbias = bias.map(|_| acc[width * ch..].to_vec());
    (dx, dw, dbias)
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
    Ok(conv1d_silu_forward_unchecked(x, ch, w, width, bias, seqs))
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
    Ok(conv1d_silu_backward_unchecked(
        x, ch, w, width, bias, seqs, dy,
    ))
}
