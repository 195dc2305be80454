//! f64 reference of the causal depthwise conv1d + SiLU (plain loops; for tests).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

pub use crate::ops::common::reference::silu;
use crate::seqs::Seqs;

/// `y[t, c] = silu(bias[c] + sum_i w[c, i] x[t - (W-1) + i, c])`, zero history at each sequence
/// start, zero rows for padding.
pub fn conv1d_silu_forward(
    x: &[f64],
    ch: usize,
    w: &[f64],
    width: usize,
    bias: Option<&[f64]>,
    seqs: &Seqs,
) -> Vec<f64> {
    let mut y = vec![0.0; seqs.tokens() * ch];
    for s in 0..seqs.count() {
        let r = seqs.range(s);
        for t in r.clone() {
            for c in 0..ch {
                let mut pre = bias.map_or(0.0, |b| b[c]);
                for i in 0..width {
                    let src = t as isize - (width as isize - 1) + i as isize;
                    if src >= r.start as isize {
                        pre += w[c * width + i] * x[src as usize * ch + c];
                    }
                }
                y[t * ch + c] = silu(pre);
            }
        }
    }
    y
}
