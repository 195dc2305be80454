//! CPU prep: the same math as `conv1d`, a split, `l2norm` and `gates` on the CPU, in f32 and in
//! the same order (so the layer's CPU results are those of the separate ops, bit for bit), with
//! the in_proj output read, and its gradient written, in place.

use rayon::prelude::*;

use super::{PrepCols, PrepShape};
use crate::backend::Cols;
use crate::error::{GdnError, Result};
use crate::ops::check_len;
use crate::ops::common::act::{sigmoid, silu, silu_grad, softplus, softplus_grad};
use crate::ops::common::conv::{backward_from_dpre, pre_row, seq_bounds, transpose};
use crate::ops::common::l2norm::{l2norm_row, l2norm_row_backward, l2norm_row_rstd};
use crate::ops::common::task_rows;
use crate::ops::REDUCE_BLOCK;
use crate::seqs::Seqs;

/// Forward results on the host.
pub struct Out {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub qkn: Option<(Vec<f32>, Vec<f32>)>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

/// The rule's gradients on the host (see [`super::PrepDy`]).
pub struct Dy<'a> {
    pub dq: &'a [f32],
    pub dk: &'a [f32],
    pub dv: &'a [f32],
    pub dg: &'a [f32],
    pub dbeta: &'a [f32],
}

/// Parameter gradients on the host.
pub struct Grads {
    pub conv_w: Vec<f32>,
    pub conv_b: Option<Vec<f32>>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn check(
    x: &[f32],
    c: PrepCols,
    s: PrepShape,
    w: &[f32],
    bias: Option<&[f32]>,
    a_log: &[f32],
    dt_bias: &[f32],
    seqs: &Seqs,
) -> Result<()> {
    s.check()?;
    c.check("prep in_proj output", &s, x.len(), seqs.tokens())?;
    let cd = s.conv_dim();
    check_len("prep conv weight", w, cd.saturating_mul(s.width))?;
    if let Some(b) = bias {
        check_len("prep conv bias", b, cd)?;
    }
    check_len("prep A_log", a_log, s.hv)?;
    check_len("prep dt_bias", dt_bias, s.hv)
}

/// Forward on host slices (validated): see [`super::forward`].
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &[f32],
    c: PrepCols,
    s: PrepShape,
    w: &[f32],
    bias: Option<&[f32]>,
    a_log: &[f32],
    dt_bias: &[f32],
    seqs: &Seqs,
) -> Result<Out> {
    check(x, c, s, w, bias, a_log, dt_bias, seqs)?;
    let (n, used) = (seqs.tokens(), seqs.used());
    let (qk, vd, cd, dk) = (s.qk(), s.vd(), s.conv_dim(), s.dk);
    let bounds = seq_bounds(seqs);
    let wt = transpose(w, cd, s.width);
    let mut q = vec![0.0f32; n * qk];
    let mut k = vec![0.0f32; n * qk];
    let mut v = vec![0.0f32; n * vd];
    let mut qkn = s
        .l2norm
        .then(|| (vec![0.0f32; n * qk], vec![0.0f32; n * qk]));
    let tr = task_rows(cd);
    {
        let (qn, kn) = match &mut qkn {
            Some((a, b)) => (Some(a.as_mut_slice()), Some(b.as_mut_slice())),
            None => (None, None),
        };
        let qn_chunks = qn.map(|a| a.par_chunks_mut(tr * qk));
        let kn_chunks = kn.map(|a| a.par_chunks_mut(tr * qk));
        let body = |bi: usize,
                    qb: &mut [f32],
                    kb: &mut [f32],
                    vb: &mut [f32],
                    qnb: Option<&mut [f32]>,
                    knb: Option<&mut [f32]>| {
            let mut y = vec![0.0f32; cd];
            let rows = vb.len() / vd;
            let (mut qnb, mut knb) = (qnb, knb);
            for r in 0..rows {
                let t = bi * tr + r;
                if t >= used {
                    break;
                }
                pre_row(x, c.qkv, &wt, s.width, bias, t, bounds[t].0, &mut y);
                for e in y.iter_mut() {
                    *e = silu(*e);
                }
                let (qr, rest) = y.split_at(qk);
                let (kr, vr) = rest.split_at(qk);
                qb[r * qk..(r + 1) * qk].copy_from_slice(qr);
                kb[r * qk..(r + 1) * qk].copy_from_slice(kr);
                vb[r * vd..(r + 1) * vd].copy_from_slice(vr);
                for (src, dst) in [(qr, qnb.as_deref_mut()), (kr, knb.as_deref_mut())] {
                    if let Some(dst) = dst {
                        for h in 0..s.hk {
                            let o = r * qk + h * dk;
                            l2norm_row(&src[h * dk..(h + 1) * dk], &mut dst[o..o + dk]);
                        }
                    }
                }
            }
        };
        let base = q
            .par_chunks_mut(tr * qk)
            .zip(k.par_chunks_mut(tr * qk))
            .zip(v.par_chunks_mut(tr * vd))
            .enumerate();
        match (qn_chunks, kn_chunks) {
            (Some(a), Some(b)) => {
                base.zip(a.zip(b))
                    .for_each(|((bi, ((qb, kb), vb)), (qnb, knb))| {
                        body(bi, qb, kb, vb, Some(qnb), Some(knb))
                    })
            }
            _ => base.for_each(|(bi, ((qb, kb), vb))| body(bi, qb, kb, vb, None, None)),
        }
    }
    // Gates on every row, as the gates op.
    let na: Vec<f32> = a_log.iter().map(|v| -v.exp()).collect();
    let hv = s.hv;
    let mut g = vec![0.0f32; n * hv];
    let mut beta = vec![0.0f32; n * hv];
    g.par_chunks_mut(hv)
        .zip(beta.par_chunks_mut(hv))
        .enumerate()
        .for_each(|(t, (gr, br))| {
            for j in 0..hv {
                gr[j] = na[j] * softplus(x[c.alpha.at(t, j)] + dt_bias[j]);
                br[j] = sigmoid(x[c.beta.at(t, j)]);
            }
        });
    Ok(Out {
        q,
        k,
        v,
        qkn,
        g,
        beta,
    })
}

/// Backward on host slices (validated): see [`super::backward`]. `dproj` is shaped like `x`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &[f32],
    c: PrepCols,
    s: PrepShape,
    w: &[f32],
    bias: Option<&[f32]>,
    a_log: &[f32],
    dt_bias: &[f32],
    seqs: &Seqs,
    dy: Dy,
    dproj: &mut [f32],
) -> Result<Grads> {
    check(x, c, s, w, bias, a_log, dt_bias, seqs)?;
    let (n, used) = (seqs.tokens(), seqs.used());
    let (qk, vd, cd, dk, hv) = (s.qk(), s.vd(), s.conv_dim(), s.dk, s.hv);
    check_len("prep dq", dy.dq, n.saturating_mul(qk))?;
    check_len("prep dk", dy.dk, n.saturating_mul(qk))?;
    check_len("prep dv", dy.dv, n.saturating_mul(vd))?;
    check_len("prep dg", dy.dg, n.saturating_mul(hv))?;
    check_len("prep dbeta", dy.dbeta, n.saturating_mul(hv))?;
    if dproj.len() != x.len() {
        return Err(GdnError::Invalid(format!(
            "prep dproj: expected {} values (the in_proj output's shape), got {}",
            x.len(),
            dproj.len()
        )));
    }
    let bounds = seq_bounds(seqs);
    let wt = transpose(w, cd, s.width);
    // dpre = d(conv output) * silu'(pre); d(conv output) of q, k through the norm's backward
    // (from the raw output, as the l2norm op), of v as given.
    let mut dpre = vec![0.0f32; used * cd];
    let tr = task_rows(cd);
    dpre.par_chunks_mut(tr * cd)
        .enumerate()
        .for_each(|(bi, db)| {
            let mut pre = vec![0.0f32; cd];
            let mut y = vec![0.0f32; cd];
            for (r, dr) in db.chunks_mut(cd).enumerate() {
                let t = bi * tr + r;
                pre_row(x, c.qkv, &wt, s.width, bias, t, bounds[t].0, &mut pre);
                for (yv, p) in y.iter_mut().zip(&pre) {
                    *yv = silu(*p);
                }
                for (src, off) in [(dy.dq, 0usize), (dy.dk, qk)] {
                    let g = &src[t * qk..(t + 1) * qk];
                    let out = &mut dr[off..off + qk];
                    if s.l2norm {
                        for h in 0..s.hk {
                            let yr = &y[off + h * dk..off + (h + 1) * dk];
                            let rstd = l2norm_row_rstd(yr);
                            l2norm_row_backward(
                                yr,
                                rstd,
                                &g[h * dk..(h + 1) * dk],
                                &mut out[h * dk..(h + 1) * dk],
                            );
                        }
                    } else {
                        out.copy_from_slice(g);
                    }
                }
                dr[2 * qk..].copy_from_slice(&dy.dv[t * vd..(t + 1) * vd]);
                for (d, p) in dr.iter_mut().zip(&pre) {
                    *d *= silu_grad(*p);
                }
            }
        });
    let (conv_w, db) = backward_from_dpre(x, c.qkv, &wt, s.width, &bounds, &dpre, dproj, c.qkv);
    let conv_b = bias.map(|_| db);
    // Gates: d alpha, d b per row; dA_log = sum g dg, ddt_bias = sum d alpha, per block of
    // REDUCE_BLOCK rows, then blocks in order.
    let na: Vec<f32> = a_log.iter().map(|v| -v.exp()).collect();
    let partials: Vec<Vec<f32>> = dproj
        .par_chunks_mut(REDUCE_BLOCK * c.qkv.ld)
        .enumerate()
        .map(|(bi, blk)| {
            let mut p = vec![0.0f32; 2 * hv];
            for (r, row) in blk.chunks_mut(c.qkv.ld).enumerate() {
                let t = bi * REDUCE_BLOCK + r;
                for j in 0..hv {
                    let i = t * hv + j;
                    let v = x[c.alpha.at(t, j)] + dt_bias[j];
                    let gv = na[j] * softplus(v);
                    let d = na[j] * softplus_grad(v) * dy.dg[i];
                    row[c.alpha.off + j] = d;
                    p[j] += gv * dy.dg[i];
                    p[hv + j] += d;
                    let sb = sigmoid(x[c.beta.at(t, j)]);
                    row[c.beta.off + j] = dy.dbeta[i] * sb * (1.0 - sb);
                }
            }
            p
        })
        .collect();
    let mut acc = vec![0.0f32; 2 * hv];
    for p in &partials {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v;
        }
    }
    let dt_g = acc.split_off(hv);
    Ok(Grads {
        conv_w,
        conv_b,
        a_log: acc,
        dt_bias: dt_g,
    })
}

/// Columns of a dense buffer (for callers that hold the sections separately).
pub fn dense_cols(s: &PrepShape) -> PrepCols {
    let cd = s.conv_dim();
    let ld = cd + 2 * s.hv;
    PrepCols {
        qkv: Cols::new(ld, 0, cd),
        beta: Cols::new(ld, cd, s.hv),
        alpha: Cols::new(ld, cd + s.hv, s.hv),
    }
}
