//! CPU layout ops: column blocks of row-major matrices, and head repeat / sum (GQA/GVA).

/// Copy columns `[c0, c0+w)` of a row-major `[rows, cols]` matrix into a new `[rows, w]` buffer.
pub(crate) fn take_cols(x: &[f32], cols: usize, c0: usize, w: usize) -> Vec<f32> {
    let rows = x.len() / cols;
    let mut out = Vec::with_capacity(rows * w);
    for r in 0..rows {
        out.extend_from_slice(&x[r * cols + c0..r * cols + c0 + w]);
    }
    out
}

/// Write a `[rows, w]` buffer into columns `[c0, c0+w)` of a row-major `[rows, cols]` matrix.
pub(crate) fn put_cols(dst: &mut [f32], cols: usize, c0: usize, src: &[f32], w: usize) {
    let rows = dst.len() / cols;
    debug_assert_eq!(src.len(), rows * w);
    for r in 0..rows {
        dst[r * cols + c0..r * cols + c0 + w].copy_from_slice(&src[r * w..(r + 1) * w]);
    }
}

/// Repeat key-head rows `[n, Hk, D]` to value heads `[n, Hv, D]` (value head j reads key head
/// j / (Hv/Hk)).
pub(crate) fn repeat_heads(x: &[f32], n: usize, hk: usize, hv: usize, d: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = Vec::with_capacity(n * hv * d);
    for t in 0..n {
        for j in 0..hv {
            let o = (t * hk + j / r) * d;
            out.extend_from_slice(&x[o..o + d]);
        }
    }
    out
}

/// Sum value-head rows `[n, Hv, D]` back to key heads `[n, Hk, D]`, the group in head order.
pub(crate) fn sum_heads(x: &[f32], n: usize, hk: usize, hv: usize, d: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = vec![0.0f32; n * hk * d];
    for t in 0..n {
        for j in 0..hv {
            let (src, dst) = ((t * hv + j) * d, (t * hk + j / r) * d);
            for c in 0..d {
                out[dst + c] += x[src + c];
            }
        }
    }
    out
}
