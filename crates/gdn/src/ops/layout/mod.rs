//! Layout ops of the layer: columns of row-major matrices (in_proj's output split into sections,
//! gradients put back) and GDN2's head repeat / sum between key and value heads. One entry per
//! op over backend buffers, dispatching to `cpu.rs` or `cuda.rs` (kernels in `layout.cu`).

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::backend::cuda::DBuf;
use crate::backend::{mixed, Act, Cols, F32s};
use crate::error::{GdnError, Result};

/// Columns `[c0, c0+w)` of a row-major `[rows, cols]` matrix, as a new `[rows, w]` buffer.
pub fn take_cols(x: &Act, cols: usize, c0: usize, w: usize) -> Result<Act> {
    match x {
        Act::Host(x) => Ok(Act::Host(cpu::take_cols(x, cols, c0, w))),
        Act::Dev(x) => {
            let rows = x.len() / cols;
            let gpu = x.gpu().clone();
            let mut out = DBuf::uninit(&gpu, rows * w, x.dtype())?;
            cuda::copy_cols(&gpu, x, cols, c0, &mut out, w, 0, rows, w)?;
            Ok(Act::Dev(out))
        }
    }
}

/// Write the dense `[rows, c.width]` buffer `src` into the columns `c` of `dst` (rows of `c.ld`
/// values); the other columns are left as they are.
pub fn put_cols(dst: &mut Act, c: Cols, src: &Act) -> Result<()> {
    let rows = dst.len().checked_div(c.ld).unwrap_or(0);
    c.check("put_cols dst", dst.len(), rows)?;
    if src.len() != rows.saturating_mul(c.width) {
        return Err(GdnError::Invalid(format!(
            "put_cols: src has {} values, expected {rows} x {}",
            src.len(),
            c.width
        )));
    }
    match (dst, src) {
        (Act::Host(d), Act::Host(s)) => {
            cpu::put_cols(d, c.ld, c.off, s, c.width);
            Ok(())
        }
        (Act::Dev(d), Act::Dev(s)) => {
            let gpu = s.gpu().clone();
            cuda::copy_cols(&gpu, s, c.width, 0, d, c.ld, c.off, rows, c.width)
        }
        _ => Err(mixed("put_cols")),
    }
}

/// A `[rows, cols]` matrix assembled from column blocks `(offset, width, buffer)` that tile it.
pub fn concat_cols(rows: usize, cols: usize, parts: &[(usize, usize, &Act)]) -> Result<Act> {
    match parts.first().map(|p| p.2) {
        None | Some(Act::Host(_)) => {
            let mut out = vec![0.0f32; rows * cols];
            for &(c0, w, a) in parts {
                let Act::Host(src) = a else {
                    return Err(mixed("concat_cols"));
                };
                cpu::put_cols(&mut out, cols, c0, src, w);
            }
            Ok(Act::Host(out))
        }
        Some(Act::Dev(first)) => {
            let gpu = first.gpu().clone();
            let mut out = DBuf::uninit(&gpu, rows * cols, first.dtype())?;
            for &(c0, w, a) in parts {
                let Act::Dev(src) = a else {
                    return Err(mixed("concat_cols"));
                };
                cuda::copy_cols(&gpu, src, w, 0, &mut out, cols, c0, rows, w)?;
            }
            Ok(Act::Dev(out))
        }
    }
}

fn heads_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(GdnError::Invalid(format!(
            "{what}: expected {want} values, got {got}"
        )));
    }
    Ok(())
}

/// Repeat key-head rows `[n, Hk, D]` to value heads `[n, Hv, D]` (value head j reads key head
/// j / (Hv/Hk)), activations.
pub fn repeat_heads(x: &Act, n: usize, hk: usize, hv: usize, d: usize) -> Result<Act> {
    heads_len("repeat_heads", x.len(), n * hk * d)?;
    match x {
        Act::Host(x) => Ok(Act::Host(cpu::repeat_heads(x, n, hk, hv, d))),
        Act::Dev(x) => Ok(Act::Dev(cuda::heads_dev(
            "repeat_heads",
            x,
            n * hv * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

/// Sum value-head rows `[n, Hv, D]` back to key heads `[n, Hk, D]`, the group in head order
/// (activations; fp32 sums).
pub fn sum_heads(x: &Act, n: usize, hk: usize, hv: usize, d: usize) -> Result<Act> {
    heads_len("sum_heads", x.len(), n * hv * d)?;
    match x {
        Act::Host(x) => Ok(Act::Host(cpu::sum_heads(x, n, hk, hv, d))),
        Act::Dev(x) => Ok(Act::Dev(cuda::heads_dev(
            "sum_heads",
            x,
            n * hk * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

/// [`repeat_heads`] of an fp32 buffer (the GDN2 decay).
pub fn repeat_heads_f32s(x: &F32s, n: usize, hk: usize, hv: usize, d: usize) -> Result<F32s> {
    heads_len("repeat_heads", x.len(), n * hk * d)?;
    match x {
        F32s::Host(v) => Ok(F32s::Host(cpu::repeat_heads(v, n, hk, hv, d))),
        F32s::Dev(g) => Ok(F32s::Dev(cuda::heads_g(
            "repeat_heads",
            g,
            n * hv * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

/// [`sum_heads`] of an fp32 buffer (the GDN2 decay's gradient).
pub fn sum_heads_f32s(x: &F32s, n: usize, hk: usize, hv: usize, d: usize) -> Result<F32s> {
    heads_len("sum_heads", x.len(), n * hv * d)?;
    match x {
        F32s::Host(v) => Ok(F32s::Host(cpu::sum_heads(v, n, hk, hv, d))),
        F32s::Dev(g) => Ok(F32s::Dev(cuda::heads_g(
            "sum_heads",
            g,
            n * hk * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}
