//! f64 reference of the prep op (plain loops; for tests): conv1d + SiLU, split, per-head L2
//! norm of q and k, GDN gates.

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

use super::{PrepCols, PrepShape};
use crate::ops::common::reference::silu;
use crate::seqs::Seqs;

/// Forward outputs in f64: q, k, v (raw), qn, kn (normalized; equal to q, k when the shape's
/// norm is off), g, beta.
pub struct Out64 {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub qn: Vec<f64>,
    pub kn: Vec<f64>,
    pub g: Vec<f64>,
    pub beta: Vec<f64>,
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The forward in f64 over the in_proj output `x` with sections `c`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &[f64],
    c: PrepCols,
    s: PrepShape,
    w: &[f64],
    bias: Option<&[f64]>,
    a_log: &[f64],
    dt_bias: &[f64],
    seqs: &Seqs,
) -> Out64 {
    let n = seqs.tokens();
    let (qk, vd, cd, dk, hv, width) = (s.qk(), s.vd(), s.conv_dim(), s.dk, s.hv, s.width);
    let mut y = vec![0.0; n * cd];
    for sq in 0..seqs.count() {
        let r = seqs.range(sq);
        for t in r.clone() {
            for ch in 0..cd {
                let mut pre = bias.map_or(0.0, |b| b[ch]);
                for i in 0..width {
                    let src = t as isize - (width as isize - 1) + i as isize;
                    if src >= r.start as isize {
                        pre += w[ch * width + i] * x[c.qkv.at(src as usize, ch)];
                    }
                }
                y[t * cd + ch] = silu(pre);
            }
        }
    }
    let mut q = vec![0.0; n * qk];
    let mut k = vec![0.0; n * qk];
    let mut v = vec![0.0; n * vd];
    for t in 0..n {
        q[t * qk..(t + 1) * qk].copy_from_slice(&y[t * cd..t * cd + qk]);
        k[t * qk..(t + 1) * qk].copy_from_slice(&y[t * cd + qk..t * cd + 2 * qk]);
        v[t * vd..(t + 1) * vd].copy_from_slice(&y[t * cd + 2 * qk..(t + 1) * cd]);
    }
    let norm = |a: &[f64]| -> Vec<f64> {
        let mut o = a.to_vec();
        if s.l2norm {
            for row in o.chunks_mut(dk) {
                let ss: f64 = row.iter().map(|v| v * v).sum();
                let r = 1.0 / (ss + 1e-6).sqrt();
                row.iter_mut().for_each(|v| *v *= r);
            }
        }
        o
    };
    let (qn, kn) = (norm(&q), norm(&k));
    let mut g = vec![0.0; n * hv];
    let mut beta = vec![0.0; n * hv];
    for t in 0..n {
        for j in 0..hv {
            g[t * hv + j] = -a_log[j].exp() * softplus(x[c.alpha.at(t, j)] + dt_bias[j]);
            beta[t * hv + j] = 1.0 / (1.0 + (-x[c.beta.at(t, j)]).exp());
        }
    }
    Out64 {
        q,
        k,
        v,
        qn,
        kn,
        g,
        beta,
    }
}
