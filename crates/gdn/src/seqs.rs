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

    /// Megatron's `_resolve_cu_seqlens` for packed (THD) input: the padded boundaries are used
    /// when given (Megatron pads each sequence to a multiple of the context-parallel size), the
    /// last boundary must equal the number of tokens, and every sequence length must be divisible
    /// by `cp_size`. Our own rules on top: starts at 0, non-decreasing, at least one sequence.
    pub fn resolve(
        cu_seqlens: Option<&[u64]>,
        cu_seqlens_padded: Option<&[u64]>,
        total_tokens: usize,
        cp_size: usize,
    ) -> Result<Self> {
        let (name, cu) = match (cu_seqlens_padded, cu_seqlens) {
            (Some(p), _) => ("cu_seqlens_padded", p),
            (None, Some(c)) => ("cu_seqlens", c),
            (None, None) => {
                return Err(GdnError::CuSeqlens(
                    "neither cu_seqlens nor cu_seqlens_padded given".into(),
                ))
            }
        };
        if cp_size == 0 {
            return Err(GdnError::CuSeqlens("cp_size must be >= 1".into()));
        }
        let seqs = Seqs::packed(cu, total_tokens).map_err(|e| match e {
            GdnError::CuSeqlens(m) => GdnError::CuSeqlens(format!("{name}: {m}")),
            e => e,
        })?;
        let last = *cu.last().unwrap();
        if last != total_tokens as u64 {
            return Err(GdnError::CuSeqlens(format!(
                "GDN: {name}[-1]={last} does not match total_sequence_length={total_tokens}"
            )));
        }
        if let Some(w) = cu.windows(2).find(|w| (w[1] - w[0]) % cp_size as u64 != 0) {
            return Err(GdnError::CuSeqlens(format!(
                "All per-sequence lengths in {name} must be divisible by cp_size={cp_size} (found a sequence of length {})",
                w[1] - w[0]
            )));
        }
        Ok(seqs)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rules() {
        assert!(Seqs::packed(&[], 4).is_err());
        assert!(Seqs::packed(&[0], 4).is_err());
        assert!(Seqs::packed(&[1, 4], 4).is_err());
        assert!(Seqs::packed(&[0, 3, 2], 4).is_err());
        assert!(Seqs::packed(&[0, 5], 4).is_err());
        let s = Seqs::packed(&[0, 0, 1, 3], 5).unwrap();
        assert_eq!((s.count(), s.used(), s.tokens()), (3, 3, 5));
        assert_eq!(s.range(0), 0..0);
        assert_eq!(s.range(2), 1..3);
        // 64-bit offsets beyond u32 are carried as usize
        let big = 5_000_000_000u64;
        assert_eq!(
            Seqs::packed(&[0, big], big as usize).unwrap().used(),
            big as usize
        );
    }

    #[test]
    fn megatron_resolution() {
        // the padded variant is preferred when given
        let s = Seqs::resolve(Some(&[0, 30, 60]), Some(&[0, 32, 64]), 64, 1).unwrap();
        assert_eq!(s.cu(), &[0, 32, 64]);
        // without padding the actual boundaries are used
        assert_eq!(
            Seqs::resolve(Some(&[0, 32, 64]), None, 64, 1).unwrap().cu(),
            &[0, 32, 64]
        );
        // the total must equal the token count
        let e = Seqs::resolve(Some(&[0, 30, 60]), None, 64, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not match total_sequence_length=64"), "{e}");
        let e = Seqs::resolve(None, Some(&[0, 32, 62]), 64, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cu_seqlens_padded[-1]=62"), "{e}");
        // lengths divisible by cp
        let e = Seqs::resolve(Some(&[0, 505, 1008]), None, 1008, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be divisible by cp_size=2"), "{e}");
        assert!(Seqs::resolve(Some(&[0, 504, 1008]), None, 1008, 2).is_ok());
        assert!(Seqs::resolve(None, None, 8, 1).is_err());
        assert!(Seqs::resolve(Some(&[0, 8]), None, 8, 0).is_err());
    }
}
