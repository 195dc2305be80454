//! Sequence layout: which tokens of a flat `[tokens, ...]` buffer belong to which sequence.
//!
//! Every op works on a flat token axis plus `cu_seqlens` (FlashAttention's convention: sequence
//! `i` is tokens `cu[i]..cu[i+1]`). A batch `[B, T, ...]` is the layout `cu = [0, T, 2T, ..., BT]`.
//! Tokens at and after `cu[last]` are padding: zero output and zero gradient.

use crate::error::{GdnError, Result};

/// Validated sequence boundaries over a buffer of `tokens` rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seqs {
    cu: Vec<usize>,
    tokens: usize,
}

impl Seqs {
    /// `batch` sequences of `len` tokens each.
    pub fn uniform(batch: usize, len: usize) -> Self {
        Seqs {
            cu: (0..=batch).map(|b| b * len).collect(),
            tokens: batch * len,
        }
    }

    /// Packed sequences from `cu_seqlens` over a buffer of `tokens` rows.
    pub fn packed(cu: &[u64], tokens: usize) -> Result<Self> {
        if cu.is_empty() {
            return Err(GdnError::CuSeqlens(
                "is empty; it needs at least [0, total]".into(),
            ));
        }
        if cu[0] != 0 {
            return Err(GdnError::CuSeqlens(format!(
                "must start at 0, starts at {}",
                cu[0]
            )));
        }
        if cu.len() < 2 {
            return Err(GdnError::CuSeqlens("holds no sequence (length 1)".into()));
        }
        for (i, w) in cu.windows(2).enumerate() {
            if w[1] < w[0] {
                return Err(GdnError::CuSeqlens(format!(
                    "must be non-decreasing: cu_seqlens[{}]={} < cu_seqlens[{}]={}",
                    i + 1,
                    w[1],
                    i,
                    w[0]
                )));
            }
        }
        let last = *cu.last().unwrap();
        if last > tokens as u64 {
            return Err(GdnError::CuSeqlens(format!(
                "cu_seqlens[-1]={last} exceeds the {tokens} tokens of the input"
            )));
        }
        Ok(Seqs {
            cu: cu.iter().map(|&x| x as usize).collect(),
            tokens,
        })
    }

    /// Number of sequences `N`.
    pub fn count(&self) -> usize {
        self.cu.len() - 1
    }
    /// Token range of sequence `i`.
    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu[i]..self.cu[i + 1]
    }
    /// Rows of the buffer (sequences plus padding).
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Rows covered by sequences (`cu[last]`).
    pub fn used(&self) -> usize {
        *self.cu.last().unwrap()
    }
    /// The boundaries.
    pub fn cu(&self) -> &[usize] {
        &self.cu
    }
}
