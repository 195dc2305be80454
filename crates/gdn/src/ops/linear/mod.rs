//! Linear projection without bias: `y = x W^T`, `W` `[out, in]` (PyTorch's layout), `x`
//! `[rows, in]`, `y` `[rows, out]`.
//!
//! Backward: `dx = dy W` `[rows, in]`, `dW = dy^T x` `[out, in]`. All three products go through
//! the `gemm` crate ([`crate::ops::common::gemm::matmul`]) with rayon. `dW` reduces over the token axis
//! (the GEMM's inner dimension); the `gemm` crate splits work over the output only and blocks the
//! inner dimension by cache sizes, never by thread count, so `dW` has the same bits under any
//! number of threads (checked by a test).

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::check_g;
use crate::backend::{mixed, Act, F32s, P};
use crate::error::Result;

/// `y = x W^T`: `x` `[rows, in_dim]`, `W` `[out_dim, in_dim]`, returns `y` `[rows, out_dim]`.
/// `w_bf16`: on a GPU with bf16 storage, the bf16 copy of `W` made when `W` was last updated
/// ([`cuda::cast_bf16`]); `None` makes it on the fly (same kernel, same bits). Host: `None`.
pub fn forward(
    x: &Act,
    rows: usize,
    in_dim: usize,
    w: P,
    w_bf16: Option<&GBuf<u16>>,
    out_dim: usize,
) -> Result<Act> {
    match (x, w) {
        (Act::Host(x), P::Host(w)) if w_bf16.is_none() => {
            Ok(Act::Host(cpu::forward(x, rows, in_dim, w, out_dim)?))
        }
        (Act::Dev(x), P::Dev(w)) => {
            let mut y = DBuf::uninit(x.gpu(), rows.saturating_mul(out_dim), x.dtype())?;
            cuda::forward(x, rows, in_dim, w, w_bf16, out_dim, &mut y)?;
            Ok(Act::Dev(y))
        }
        _ => Err(mixed("linear")),
    }
}

/// Rows up to which a decode step's projections run the skinny GEMM (with the input norm folded
/// into in_proj's) by default. Measured on the H200 (2026-12-02, `bench_decode gemm`): it beats
/// cuBLASLt at 1 and 8 rows (in_proj with the norm folded in 41.7 -> 26.6 us at one row, out_proj
/// 18.4 -> 13.7 us; the layer's decode step as a graph at B1 78.5 -> 60.6 us) and loses from 16
/// rows on (in_proj at 64 rows 29.2 -> 36.7 us).
pub const DECODE_GEMV_ROWS: usize = 8;

/// The decode projections' skinny GEMM from `GDN_DECODE_GEMV`: (the most rows it runs at, whether
/// the input norm is folded into in_proj's). Unset: ([`DECODE_GEMV_ROWS`], folded); `0` / `off`
/// / `false`: never; `1` / `on` / `true`: up to [`cuda::SKINNY_MAX_ROWS`] (64) rows (every shape
/// its plan takes), folded; `gemm`: the same, the norm kernel kept. See [`forward_decode`].
pub fn decode_gemv_by_env() -> (usize, bool) {
    match std::env::var("GDN_DECODE_GEMV").as_deref() {
        Ok("0") | Ok("off") | Ok("false") => (0, false),
        Ok("1") | Ok("on") | Ok("true") => (cuda::SKINNY_MAX_ROWS, true),
        Ok("gemm") => (cuda::SKINNY_MAX_ROWS, false),
        _ => (DECODE_GEMV_ROWS, true),
    }
}

/// [`forward`] for a decode step's few rows: with `skinny` on a GPU in bf16 storage, where
/// [`cuda::skinny_plan`] takes the shape (1..=64 rows, `in_dim` a multiple of 128), the skinny
/// GEMM (`skinny.cu`: the weights streamed once at 16 bytes a load, tensor cores, fixed-order
/// sums); otherwise (or `skinny` off) [`forward`]'s cuBLASLt GEMM. The two agree within the
/// bf16 rounding of `y`, not bit for bit.
pub fn forward_decode(
    x: &Act,
    rows: usize,
    in_dim: usize,
    w: P,
    w_bf16: Option<&GBuf<u16>>,
    out_dim: usize,
    skinny: bool,
) -> Result<Act> {
    if let (true, Act::Dev(xd), P::Dev(wd)) = (skinny, x, w) {
        if xd.dtype() == crate::backend::cuda::DType::Bf16 {
            let gpu = xd.gpu();
            if let Some(plan) = cuda::skinny_plan(rows, out_dim, in_dim, gpu.sm_count()?) {
                let made;
                let wb = match w_bf16 {
                    Some(b) => b,
                    None => {
                        made = cuda::cast_bf16(wd)?;
                        &made
                    }
                };
                check_g("linear bf16 weight copy", wb, wd.len())?;
                let mut y = DBuf::uninit(gpu, rows * out_dim, xd.dtype())?;
                cuda::forward_skinny(xd, rows, in_dim, wb, out_dim, &mut y, plan, None)?;
                return Ok(Act::Dev(y));
            }
        }
    }
    forward(x, rows, in_dim, w, w_bf16, out_dim)
}

/// Backward of [`forward`]: returns `dx = dy W` `[rows, in_dim]` and `dW = dy^T x`
/// `[out_dim, in_dim]`. `w_bf16` as in [`forward`].
pub fn backward(
    x: &Act,
    rows: usize,
    in_dim: usize,
    w: P,
    w_bf16: Option<&GBuf<u16>>,
    out_dim: usize,
    dy: &Act,
) -> Result<(Act, F32s)> {
    match (x, w, dy) {
        (Act::Host(x), P::Host(w), Act::Host(dy)) if w_bf16.is_none() => {
            let (dx, dw) = cpu::backward(x, rows, in_dim, w, out_dim, dy)?;
            Ok((Act::Host(dx), F32s::Host(dw)))
        }
        (Act::Dev(x), P::Dev(w), Act::Dev(dy)) => {
            let gpu = x.gpu();
            let mut dx = DBuf::uninit(gpu, rows.saturating_mul(in_dim), x.dtype())?;
            let mut dw = gpu.uninit(out_dim.saturating_mul(in_dim))?;
            cuda::backward(x, rows, in_dim, w, w_bf16, out_dim, dy, &mut dx, &mut dw)?;
            Ok((Act::Dev(dx), F32s::Dev(dw)))
        }
        _ => Err(mixed("linear backward")),
    }
}
