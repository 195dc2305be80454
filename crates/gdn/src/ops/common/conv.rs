//! CPU causal depthwise conv1d rows over packed sequences, shared by `ops::conv1d` and the fused
//! `ops::prep`: sequence bounds per token, the pre-activation of one token, and the backward from
//! the pre-activation's gradient (dx and the two-stage, fixed-order weight/bias sums). The input
//! and `dx` are sections of row-major buffers ([`Cols`]), so a section of the in_proj output is
//! read, and its gradient written, in place.

use rayon::prelude::*;

use crate::backend::Cols;
use crate::ops::REDUCE_BLOCK;
use crate::seqs::Seqs;

/// `(start, end)` of the sequence of each token below `seqs.used()`.
pub(crate) fn seq_bounds(seqs: &Seqs) -> Vec<(usize, usize)> {
    let mut b = vec![(0, 0); seqs.used()];
    for i in 0..seqs.count() {
        let r = seqs.range(i);
        b[r.clone()].fill((r.start, r.end));
    }
    b
}

/// `w` `[ch, width]` to `[width, ch]`, so the inner loops run over contiguous channels.
pub(crate) fn transpose(w: &[f32], ch: usize, width: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; w.len()];
    for c in 0..ch {
        for i in 0..width {
            t[i * ch + c] = w[c * width + i];
        }
    }
    t
}

/// Pre-activation of token `t` (sequence starting at `start`) into `acc` `[ch]` from the section
/// `xc` of `x`: bias first, then taps `i = 0..width` in order. Forward and backward both call
/// this, so they agree bitwise.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn pre_row(
    x: &[f32],
    xc: Cols,
    wt: &[f32],
    width: usize,
    bias: Option<&[f32]>,
    t: usize,
    start: usize,
    acc: &mut [f32],
) {
    let ch = xc.width;
    match bias {
        Some(b) => acc.copy_from_slice(b),
        None => acc.fill(0.0),
    }
    for i in 0..width {
        let back = width - 1 - i;
        if t >= start + back {
            let xr = &x[xc.at(t - back, 0)..xc.at(t - back, ch)];
            let wr = &wt[i * ch..(i + 1) * ch];
            for c in 0..ch {
                acc[c] += wr[c] * xr[c];
            }
        }
    }
}

/// The conv's backward from `dpre` `[used, ch]` (the pre-activation's gradient): writes
/// `dx[t, c] = sum_i w[c, i] dpre[t + back_i, c]` (same sequence) into the section `dxc` of `dx`
/// (zero on padding rows, `tokens` rows in all) and returns `dw` `[ch, width]` and `dbias` `[ch]`
/// (`dw[c, i] = sum_t dpre[t, c] x[t - back_i, c]`, `dbias[c] = sum_t dpre[t, c]`), summed per
/// block of [`REDUCE_BLOCK`] tokens, then blocks in order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_from_dpre(
    x: &[f32],
    xc: Cols,
    wt: &[f32],
    width: usize,
    bounds: &[(usize, usize)],
    dpre: &[f32],
    dx: &mut [f32],
    dxc: Cols,
) -> (Vec<f32>, Vec<f32>) {
    let ch = xc.width;
    let used = bounds.len();
    let plen = (width + 1) * ch;
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(REDUCE_BLOCK * dxc.ld)
        .enumerate()
        .map(|(bi, dxb)| {
            let mut p = vec![0.0f32; plen];
            for (r, row) in dxb.chunks_mut(dxc.ld).enumerate() {
                let t = bi * REDUCE_BLOCK + r;
                let dxr = &mut row[dxc.off..dxc.off + ch];
                dxr.fill(0.0);
                if t >= used {
                    continue;
                }
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
                        let xr = &x[xc.at(t - back, 0)..xc.at(t - back, ch)];
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
    let dbias = acc[width * ch..].to_vec();
    (dw, dbias)
}
