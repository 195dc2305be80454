//! Softmax cross-entropy over the vocabulary: the op is [`crate::ops::cross_entropy`]; these are
//! its statistics type and CPU functions under their former names.

pub use crate::ops::cross_entropy::{LossStats, IGNORE_INDEX};

use crate::error::Result;

/// Check targets: each in `[0, vocab)` or [`IGNORE_INDEX`].
pub(crate) fn check_targets(targets: &[i32], vocab: usize) -> Result<()> {
    crate::ops::cross_entropy::cpu::check_targets(targets, vocab)
}

/// [`crate::ops::cross_entropy::cpu::forward`].
pub fn cross_entropy_forward(
    logits: &[f32],
    rows: usize,
    vocab: usize,
    targets: &[i32],
    keep_probs: bool,
) -> Result<(LossStats, Option<Vec<f32>>)> {
    crate::ops::cross_entropy::cpu::forward(logits, rows, vocab, targets, keep_probs)
}

/// [`crate::ops::cross_entropy::cpu::backward`].
pub fn cross_entropy_backward(
    probs: &[f32],
    rows: usize,
    vocab: usize,
    targets: &[i32],
    count: usize,
) -> Result<Vec<f32>> {
    crate::ops::cross_entropy::cpu::backward(probs, rows, vocab, targets, count)
}
