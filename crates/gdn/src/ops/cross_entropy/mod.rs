//! Softmax cross-entropy over the vocabulary, forward and backward, with ignored positions.
//!
//! Per row `r` with target `t_r` (rows whose target is [`IGNORE_INDEX`] take no part):
//! `lse_r = log sum_j exp(l_rj)`, `loss_r = lse_r - l_{r,t_r}`; the loss is the mean over the
//! `count` target rows. Backward of that mean: `dl_rj = (p_rj - [j = t_r]) / count` with
//! `p_r = softmax(l_r)`, zero on ignored rows.
//!
//! Each row is computed on its own (max-subtracted, the exponent sum in f64); the per-row losses
//! are then added in row order in f64, so the result does not depend on the thread count.

//! On a GPU (kernels in `cross_entropy.cu`): one block per row (max and first arg max, the
//! exponent sum in f64 in a fixed tree order), per-row losses in f64, then one block adds them in
//! a fixed order; the three statistics are the one download. The softmax is kept in the logits'
//! storage type.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{mixed, Act, Ids};
use crate::error::Result;

pub use cpu::check_targets;

/// Target of a position that takes no part in the loss (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

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

/// Forward over `logits` `[rows, vocab]` with `targets` `[rows]`: the loss statistics and, when
/// `keep_probs`, the softmax `[rows, vocab]` that backward needs (zero rows where the target is
/// ignored). Host targets are checked; device targets must hold checked values (the model checks
/// the host batch before uploading it; an out-of-range device target gives a NaN loss).
pub fn forward(
    logits: &Act,
    rows: usize,
    vocab: usize,
    targets: Ids<i32>,
    keep_probs: bool,
) -> Result<(LossStats, Option<Act>)> {
    match (logits, targets) {
        (Act::Host(l), Ids::Host(t)) => {
            let (st, p) = cpu::forward(l, rows, vocab, t, keep_probs)?;
            Ok((st, p.map(Act::Host)))
        }
        (Act::Dev(l), Ids::Dev(t)) => {
            let mut probs = if keep_probs {
                Some(DBuf::uninit(
                    l.gpu(),
                    rows.saturating_mul(vocab),
                    l.dtype(),
                )?)
            } else {
                None
            };
            let st = cuda::forward(l, rows, vocab, t, probs.as_mut())?;
            Ok((st, probs.map(Act::Dev)))
        }
        _ => Err(mixed("cross entropy")),
    }
}

/// Backward of the mean loss: `dlogits` `[rows, vocab]` from the kept softmax, the targets and
/// the number of target rows (`count` of the forward's statistics).
pub fn backward(
    probs: &Act,
    rows: usize,
    vocab: usize,
    targets: Ids<i32>,
    count: usize,
) -> Result<Act> {
    match (probs, targets) {
        (Act::Host(p), Ids::Host(t)) => Ok(Act::Host(cpu::backward(p, rows, vocab, t, count)?)),
        (Act::Dev(p), Ids::Dev(t)) => {
            let mut d = DBuf::uninit(p.gpu(), rows.saturating_mul(vocab), p.dtype())?;
            cuda::backward(p, rows, vocab, t, count, &mut d)?;
            Ok(Act::Dev(d))
        }
        _ => Err(mixed("cross entropy backward")),
    }
}
