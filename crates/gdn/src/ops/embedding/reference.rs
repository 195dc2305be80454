//! f64 embedding backward (tests): per-token sums of the gradient rows.

/// `dE` `[vocab, h]`: `base` plus each position's row added to its token's row.
pub fn backward(ids: &[u32], dy: &[f64], vocab: usize, h: usize, base: Option<&[f64]>) -> Vec<f64> {
    let mut de = base.map_or_else(|| vec![0.0; vocab * h], |b| b.to_vec());
    for (r, &t) in ids.iter().enumerate() {
        for c in 0..h {
            de[t as usize * h + c] += dy[r * h + c];
        }
    }
    de
}
