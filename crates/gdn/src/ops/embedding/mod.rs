//! Token embedding: `y[r] = E[tok_r]` (`E` `[vocab, h]` fp32, `y` `[n, h]`), and its backward
//! `dE[v] (+)= sum over positions r with tok_r = v, in increasing r, of dy[r]`.
//!
//! Backward is deterministic on both sides: each vocabulary row adds its positions' rows in
//! position order (the CPU walks the tokens in order; the GPU gets, from the host token list, a
//! per-token list of positions in increasing order (CSR) and runs one block per vocabulary row).
//! With a tied LM head the caller puts the head's weight gradient in `dE` first and passes
//! `accumulate`, so each element is `dW_head + dy[r0] + dy[r1] + ...`, the CPU model's order.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::{DBuf, DType};
use crate::backend::{mixed, Act, Ids, PMut, P};
use crate::error::{GdnError, Result};

/// `y` `[n, h]` in `dtype` storage (the host: f32 only) from token ids `[n]` and `E` `[vocab, h]`.
/// Host ids are checked (`< vocab`); device ids must hold checked values (the model checks the
/// host batch before uploading it; an out-of-range device id gives NaN rows).
pub fn forward(ids: Ids<u32>, w: P, vocab: usize, h: usize, dtype: DType) -> Result<Act> {
    match (ids, w) {
        (Ids::Host(ids), P::Host(w)) => {
            if dtype != DType::F32 {
                return Err(GdnError::Invalid(
                    "embedding: the CPU path computes in f32 only".into(),
                ));
            }
            Ok(Act::Host(cpu::forward(ids, w, vocab, h)?))
        }
        (Ids::Dev(ids), P::Dev(w)) => {
            let mut y = DBuf::uninit(w.gpu(), ids.len().saturating_mul(h), dtype)?;
            cuda::forward(ids, w, vocab, h, &mut y)?;
            Ok(Act::Dev(y))
        }
        _ => Err(mixed("embedding")),
    }
}

/// Backward: `dE` `[vocab, h]` gets the sum of `dy` `[n, h]`'s rows per token (`accumulate`:
/// added to what `dE` holds; else `dE` is overwritten). `ids` are the host token ids (checked);
/// on a GPU they become the per-token position lists uploaded for the kernel.
pub fn backward(
    ids: &[u32],
    dy: &Act,
    vocab: usize,
    h: usize,
    de: PMut,
    accumulate: bool,
) -> Result<()> {
    match (dy, de) {
        (Act::Host(dy), PMut::Host(de)) => cpu::backward(ids, dy, vocab, h, de, accumulate),
        (Act::Dev(dy), PMut::Dev(de)) => cuda::backward(ids, dy, vocab, h, de, accumulate),
        _ => Err(mixed("embedding backward")),
    }
}
