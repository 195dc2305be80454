//! CPU pieces shared by the two rules (`ops::gated_delta_rule`, `ops::gdn2_rule`): the task list
//! (one task per sequence and key head), row loaders, the small GEMM wrapper and the scatter of
//! the per-task forward outputs.

use rayon::prelude::*;

use super::gemm::{matmul, MatRef};
use super::l2norm::l2norm_row;
use super::rule::RuleShape;
use crate::seqs::Seqs;

/// q and k rows of one (sequence, key head), contiguous `[len, Dk]`, normalized if asked.
pub(crate) struct QkRows {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    /// Raw rows and inverse norms, kept when the norm is done in the kernel (for backward).
    pub(crate) raw: Option<RawQk>,
}

/// Raw q, k rows `[len, Dk]` and their inverse L2 norms `[len]`.
pub(crate) struct RawQk {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) q_rstd: Vec<f32>,
    pub(crate) k_rstd: Vec<f32>,
}

pub(crate) fn load_qk(
    q: &[f32],
    k: &[f32],
    r: std::ops::Range<usize>,
    kh: usize,
    s: RuleShape,
    norm: bool,
) -> QkRows {
    let len = r.len();
    let (dk, hk) = (s.dk, s.hk);
    let mut qr = Vec::with_capacity(len * dk);
    let mut kr = Vec::with_capacity(len * dk);
    for t in r {
        let o = (t * hk + kh) * dk;
        qr.extend_from_slice(&q[o..o + dk]);
        kr.extend_from_slice(&k[o..o + dk]);
    }
    if !norm {
        return QkRows {
            q: qr,
            k: kr,
            raw: None,
        };
    }
    let mut qn = vec![0.0; len * dk];
    let mut kn = vec![0.0; len * dk];
    let mut qrs = vec![0.0; len];
    let mut krs = vec![0.0; len];
    for i in 0..len {
        qrs[i] = l2norm_row(&qr[i * dk..(i + 1) * dk], &mut qn[i * dk..(i + 1) * dk]);
        krs[i] = l2norm_row(&kr[i * dk..(i + 1) * dk], &mut kn[i * dk..(i + 1) * dk]);
    }
    QkRows {
        q: qn,
        k: kn,
        raw: Some(RawQk {
            q: qr,
            k: kr,
            q_rstd: qrs,
            k_rstd: krs,
        }),
    }
}

/// Rows `[c0, c0+l)` of value head `j` of a `[tokens, H, D]` buffer, sequence starting at `t0`.
pub(crate) fn load_rows(
    x: &[f32],
    t0: usize,
    c0: usize,
    l: usize,
    j: usize,
    h: usize,
    d: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(l * d);
    for i in 0..l {
        let o = ((t0 + c0 + i) * h + j) * d;
        out.extend_from_slice(&x[o..o + d]);
    }
    out
}

pub(crate) fn mm(c: &mut [f32], ldc: usize, a: MatRef, b: MatRef, acc: bool, scale: f32) {
    matmul(c, ldc, a, b, acc, scale, false);
}

pub(crate) fn tasks(seqs: &Seqs, s: RuleShape) -> Vec<(usize, usize)> {
    (0..seqs.count())
        .flat_map(|n| (0..s.hk).map(move |kh| (n, kh)))
        .collect()
}

pub(crate) struct FwdOut {
    /// Per value head of the group: `[len, Dv]`.
    pub(crate) o: Vec<Vec<f32>>,
    /// Per value head of the group: final state `[Dk, Dv]`.
    pub(crate) state: Vec<Vec<f32>>,
}

/// Scatter the per-task outputs of a forward (in `tasks` order) into `o` `[tokens, Hv, Dv]` and,
/// if asked, the final states `[N, Hv, Dk, Dv]`. Padding rows stay zero.
pub(crate) fn assemble_forward(
    seqs: &Seqs,
    s: RuleShape,
    outs: Vec<FwdOut>,
    output_final_state: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let (dv, hv) = (s.dv, s.hv);
    let r = hv / s.hk;
    let st = s.dk * dv;
    let mut o = vec![0.0f32; seqs.tokens() * hv * dv];
    // Task (n, kh)'s final states are value heads kh r .. (kh + 1) r of sequence n: in `tasks`
    // order, consecutive blocks of r states, copied in parallel (decode's largest copy).
    let mut fin = output_final_state.then(|| vec![0.0f32; seqs.count() * hv * st]);
    if let Some(f) = fin.as_mut() {
        f.par_chunks_mut(r * st)
            .zip(outs.par_iter())
            .for_each(|(dst, out)| {
                for (d, sj) in dst.chunks_exact_mut(st).zip(&out.state) {
                    d.copy_from_slice(sj);
                }
            });
    }
    for (&(n, kh), out) in tasks(seqs, s).iter().zip(outs) {
        let t0 = seqs.range(n).start;
        for (jj, oj) in out.o.into_iter().enumerate() {
            let j = kh * r + jj;
            for (i, row) in oj.chunks_exact(dv).enumerate() {
                let dst = ((t0 + i) * hv + j) * dv;
                o[dst..dst + dv].copy_from_slice(row);
            }
        }
    }
    (o, fin)
}

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
