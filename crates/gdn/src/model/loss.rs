//! Softmax cross-entropy over the vocabulary, forward and backward, with ignored positions.
//!
//! Per row `r` with target `t_r` (rows whose target is [`IGNORE_INDEX`] take no part):
//! `lse_r = log sum_j exp(l_rj)`, `loss_r = lse_r - l_{r,t_r}`; the loss is the mean over the
//! `count` target rows. Backward of that mean: `dl_rj = (p_rj - [j = t_r]) / count` with
//! `p_r = softmax(l_r)`, zero on ignored rows.
//!
//! Each row is computed on its own (max-subtracted, the exponent sum in f64); the per-row losses
//! are then added in row order in f64, so the result does not depend on the thread count.

use rayon::prelude::*;

use crate::error::{GdnError, Result};

/// Target of a position that takes no part in the loss (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// Rows per parallel task.
const TASK_ROWS: usize = 64;

/// The loss statistics of a batch: sum of per-row losses, number of target rows, and how many
/// of them the model ranks first (arg max of the logits, first index on ties).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossStats {
    /// Sum over target rows of `lse - logit[target]`, in f64.
    pub loss_sum: f64,
    /// Target rows.
    pub count: usize,
    /// Target rows whose arg max is the target.
    pub correct: usize,
}

impl LossStats {
    /// Mean loss over target rows (0 when there are none).
    pub fn loss(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.loss_sum / self.count as f64
        }
    }
    /// Fraction of target rows predicted right (0 when there are none).
    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct as f64 / self.count as f64
        }
    }
    /// Add another batch's statistics.
    pub fn add(&mut self, o: &LossStats) {
        self.loss_sum += o.loss_sum;
        self.count += o.count;
        self.correct += o.correct;
    }
}

/// Check targets: each in `[0, vocab)` or [`IGNORE_INDEX`].
pub(crate) fn check_targets(targets: &[i32], vocab: usize) -> Result<()> {
    if let Some((i, &t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t != IGNORE_INDEX && (t < 0 || t as usize >= vocab))
    {
        return Err(GdnError::Invalid(format!(
            "targets[{i}] = {t}: expected a token id in [0, {vocab}) or {IGNORE_INDEX} (ignored)"
        )));
    }
    Ok(())
}

/// Forward over `logits` `[rows, vocab]`: the loss statistics and, when `keep_probs`, the
/// softmax `[rows, vocab]` that backward needs (rows without a target are left zero).
pub fn cross_entropy_forward(
    logits: &[f32],
    rows: usize,
    vocab: usize,
    targets: &[i32],
    keep_probs: bool,
) -> Result<(LossStats, Option<Vec<f32>>)> {
    if vocab == 0 {
        return Err(GdnError::Invalid("cross entropy: vocab must be > 0".into()));
    }
    crate::ops::check_len("cross entropy logits", logits, rows * vocab)?;
    if targets.len() != rows {
        return Err(GdnError::Invalid(format!(
            "cross entropy: {} targets for {rows} rows",
            targets.len()
        )));
    }
    check_targets(targets, vocab)?;
    let mut probs = if keep_probs {
        vec![0.0f32; rows * vocab]
    } else {
        Vec::new()
    };
    // (loss, correct) per target row, None for ignored rows.
    let mut per_row: Vec<Option<(f64, bool)>> = vec![None; rows];
    let body = |r0: usize, out: &mut [Option<(f64, bool)>], p: Option<&mut [f32]>| {
        let mut p = p;
        for (i, o) in out.iter_mut().enumerate() {
            let r = r0 + i;
            let t = targets[r];
            if t == IGNORE_INDEX {
                continue;
            }
            let l = &logits[r * vocab..(r + 1) * vocab];
            let mut m = l[0];
            let mut arg = 0;
            for (j, &v) in l.iter().enumerate() {
                if v > m {
                    m = v;
                    arg = j;
                }
            }
            let s: f64 = l.iter().map(|&v| ((v - m) as f64).exp()).sum();
            let lse = m as f64 + s.ln();
            *o = Some((lse - l[t as usize] as f64, arg == t as usize));
            if let Some(p) = p.as_deref_mut() {
                let pr = &mut p[i * vocab..(i + 1) * vocab];
                for (pj, &v) in pr.iter_mut().zip(l) {
                    *pj = (v as f64 - lse).exp() as f32;
                }
            }
        }
    };
    if keep_probs {
        per_row
            .par_chunks_mut(TASK_ROWS)
            .zip(probs.par_chunks_mut(TASK_ROWS * vocab))
            .enumerate()
            .for_each(|(c, (out, p))| body(c * TASK_ROWS, out, Some(p)));
    } else {
        per_row
            .par_chunks_mut(TASK_ROWS)
            .enumerate()
            .for_each(|(c, out)| body(c * TASK_ROWS, out, None));
    }
    let mut st = LossStats::default();
    for (l, ok) in per_row.into_iter().flatten() {
        st.loss_sum += l;
        st.count += 1;
        st.correct += ok as usize;
    }
    Ok((st, keep_probs.then_some(probs)))
}

/// Backward of the mean loss: `dlogits` `[rows, vocab]` from the kept softmax, the targets and
/// the number of target rows.
pub fn cross_entropy_backward(
    probs: &[f32],
    rows: usize,
    vocab: usize,
    targets: &[i32],
    count: usize,
) -> Result<Vec<f32>> {
    crate::ops::check_len("cross entropy probs", probs, rows * vocab)?;
    if targets.len() != rows {
        return Err(GdnError::Invalid(format!(
            "cross entropy: {} targets for {rows} rows",
            targets.len()
        )));
    }
    check_targets(targets, vocab)?;
    let mut d = vec![0.0f32; rows * vocab];
    if count == 0 {
        return Ok(d);
    }
    let inv = 1.0 / count as f32;
    d.par_chunks_mut(vocab).enumerate().for_each(|(r, dr)| {
        let t = targets[r];
        if t == IGNORE_INDEX {
            return;
        }
        let p = &probs[r * vocab..(r + 1) * vocab];
        for (dj, &pj) in dr.iter_mut().zip(p) {
            *dj = pj * inv;
        }
        dr[t as usize] -= inv;
    });
    Ok(d)
}
