//! CPU embedding: the gather, and the per-token sums in token order.

use crate::error::{GdnError, Result};
use crate::ops::check_len;

/// Error unless every id is below `vocab`.
pub fn check_ids(ids: &[u32], vocab: usize) -> Result<()> {
    if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(GdnError::Invalid(format!(
            "tokens[{i}] = {t}: expected a token id in [0, {vocab})"
        )));
    }
    Ok(())
}

/// `y` `[n, h]` from ids `[n]` and `E` `[vocab, h]`.
pub fn forward(ids: &[u32], w: &[f32], vocab: usize, h: usize) -> Result<Vec<f32>> {
    check_len("embedding weight", w, vocab.saturating_mul(h))?;
    check_ids(ids, vocab)?;
    let mut y = Vec::with_capacity(ids.len() * h);
    for &t in ids {
        let t = t as usize;
        y.extend_from_slice(&w[t * h..(t + 1) * h]);
    }
    Ok(y)
}

/// `dE (+)= ` each position's `dy` row added to its token's row, positions in order.
pub fn backward(
    ids: &[u32],
    dy: &[f32],
    vocab: usize,
    h: usize,
    de: &mut [f32],
    accumulate: bool,
) -> Result<()> {
    check_len("embedding dE", de, vocab.saturating_mul(h))?;
    check_len("embedding dy", dy, ids.len().saturating_mul(h))?;
    check_ids(ids, vocab)?;
    if !accumulate {
        de.fill(0.0);
    }
    for (r, &tok) in ids.iter().enumerate() {
        let tok = tok as usize;
        for (a, d) in de[tok * h..(tok + 1) * h]
            .iter_mut()
            .zip(&dy[r * h..(r + 1) * h])
        {
            *a += d;
        }
    }
    Ok(())
}

/// The per-token position lists (CSR): `offsets` `[vocab + 1]` and `positions` `[n]`, the
/// positions of token `v` being `positions[offsets[v]..offsets[v + 1]]`, in increasing order.
pub fn position_lists(ids: &[u32], vocab: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    check_ids(ids, vocab)?;
    if ids.len() > i32::MAX as usize {
        return Err(GdnError::Invalid(format!(
            "embedding: {} tokens exceed the CUDA kernels' limit of 2^31-1",
            ids.len()
        )));
    }
    let mut offsets = vec![0i32; vocab + 1];
    for &t in ids {
        offsets[t as usize + 1] += 1;
    }
    for v in 0..vocab {
        offsets[v + 1] += offsets[v];
    }
    let mut next: Vec<i32> = offsets[..vocab].to_vec();
    let mut positions = vec![0i32; ids.len()];
    for (r, &t) in ids.iter().enumerate() {
        let slot = &mut next[t as usize];
        positions[*slot as usize] = r as i32;
        *slot += 1;
    }
    Ok((offsets, positions))
}
