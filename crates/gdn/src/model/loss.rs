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

/// Loss statistics of every rank of `comm`, in rank order (`st` per rank, the same length on
/// every rank; the f64 sums and the counts are sent bit for bit).
pub(crate) fn gather_stats(
    comm: &dyn crate::dist::Communicator,
    st: &[LossStats],
) -> Result<Vec<LossStats>> {
    use crate::backend::Act;
    let mut v = Vec::with_capacity(st.len() * 4);
    for s in st {
        let b = s.loss_sum.to_bits();
        v.push(f32::from_bits((b >> 32) as u32));
        v.push(f32::from_bits(b as u32));
        v.push(f32::from_bits(u32::try_from(s.count).unwrap_or(u32::MAX)));
        v.push(f32::from_bits(u32::try_from(s.correct).unwrap_or(u32::MAX)));
    }
    let parts = comm.all_gather(&Act::Host(v))?;
    let mut out = Vec::new();
    for p in parts {
        let p = p.into_host()?;
        for c in p.chunks(4) {
            let hi = c[0].to_bits() as u64;
            let lo = c[1].to_bits() as u64;
            out.push(LossStats {
                loss_sum: f64::from_bits((hi << 32) | lo),
                count: c[2].to_bits() as usize,
                correct: c[3].to_bits() as usize,
            });
        }
    }
    Ok(out)
}
