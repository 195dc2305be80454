//! CUDA causal depthwise conv1d + SiLU over packed sequences (kernels in `conv1d.cu`): the same
//! signatures as [`super::conv1d_silu_forward`] and [`super::conv1d_silu_backward`] on device
//! buffers. `x`, `y`, `dy`, `dx` are [`DBuf`] of one dtype; `w` `[ch, width]`, `bias` `[ch]` and
//! their gradients fp32; math fp32. Padding rows (`t >= seqs.used()`) get `y = 0` and `dx = 0`.
//!
//! `dw`, `dbias` are two-stage, fixed-order sums over tokens (per tile of 128 tokens, lanes in a
//! fixed order, then tiles in order), no atomics: bitwise reproducible.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::backend::cuda::{DBuf, GBuf, Gpu};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, elem_cfg, int, kernel, launch, lin_cfg, NULL_PTR,
    THREADS,
};
use crate::backend::Cols;
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

const MODULE: &str = "conv1d";

/// Tokens per tile of the backward kernel (`CONV_TT` in `conv1d.cu`).
const TILE: usize = 128;

/// Widest kernel the backward's shared-memory tile holds in 48 KiB.
pub const MAX_WIDTH: usize = 32;

/// Dynamic shared memory of the backward kernel for kernel width `w`.
fn bwd_smem(w: usize) -> usize {
    let h = w - 1;
    let (ns, nx) = (TILE + h, TILE + 2 * h);
    8 * (ns + TILE) + 4 * 32 * (nx + ns + 8)
}

fn check_args(
    x: &DBuf,
    xc: Cols,
    w: &GBuf<f32>,
    width: usize,
    bias: Option<&GBuf<f32>>,
    seqs: &Seqs,
) -> Result<()> {
    let ch = xc.width;
    if ch == 0 {
        return Err(GdnError::Invalid(
            "conv1d: channels must be > 0, got 0".into(),
        ));
    }
    if width == 0 {
        return Err(GdnError::Invalid(
            "conv1d: kernel width must be > 0, got 0".into(),
        ));
    }
    if width > MAX_WIDTH {
        return Err(GdnError::Invalid(format!(
            "conv1d: the CUDA kernels take kernel widths up to {MAX_WIDTH}, got {width}"
        )));
    }
    int("conv1d channels", ch)?;
    int("conv1d sequences", seqs.count())?;
    xc.check("conv1d x", x.len(), seqs.tokens())?;
    int("conv1d x row stride", xc.ld)?;
    check_g("conv1d weight", w, ch.saturating_mul(width))?;
    check_gpu("conv1d weight", x.gpu(), w.gpu())?;
    if let Some(b) = bias {
        check_g("conv1d bias", b, ch)?;
        check_gpu("conv1d bias", x.gpu(), b.gpu())?;
    }
    Ok(())
}

/// The sequence boundaries as int64 on the GPU.
fn upload_cu(gpu: &std::sync::Arc<Gpu>, seqs: &Seqs) -> Result<GBuf<i64>> {
    let cu: Vec<i64> = seqs.cu().iter().map(|&c| c as i64).collect();
    gpu.upload(&cu)
}

/// [`conv1d_silu_forward`] into a caller-provided `y` `[tokens, xc.width]`; `x` read at `xc`.
pub fn forward(
    x: &DBuf,
    xc: Cols,
    w: &GBuf<f32>,
    width: usize,
    bias: Option<&GBuf<f32>>,
    seqs: &Seqs,
    y: &mut DBuf,
) -> Result<()> {
    check_args(x, xc, w, width, bias, seqs)?;
    let ch = xc.width;
    let n = seqs.tokens().saturating_mul(ch);
    check_d("conv1d y", y, n, x.dtype())?;
    let gpu = x.gpu().clone();
    check_gpu("conv1d y", &gpu, y.gpu())?;
    if n == 0 {
        return Ok(());
    }
    let cu = upload_cu(&gpu, seqs)?;
    let f = kernel(&gpu, MODULE, "conv1d_silu_fwd", x.dtype())?;
    let (has_bias, nseq, used, tokens, ch_i, w_i) = (
        bias.is_some() as i32,
        seqs.count() as i32,
        seqs.used() as i64,
        seqs.tokens() as i64,
        ch as i32,
        width as i32,
    );
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    l.arg(&w.slice);
    match bias {
        Some(b) => l.arg(&b.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&has_bias)
        .arg(&cu.slice)
        .arg(&nseq)
        .arg(&used)
        .arg(&tokens)
        .arg(&ch_i)
        .arg(&w_i);
    arg_dm(&mut l, y);
    let (xld, xoff) = (xc.ld as i64, xc.off as i32);
    l.arg(&xld).arg(&xoff);
    launch(&mut l, elem_cfg(n), "conv1d_silu_fwd")
}

/// [`conv1d_silu_backward`] into caller-provided `dx` (written at `xc`, the columns `x` is read
/// at, of a buffer shaped like `x`; its other columns are left as they are), `dw` and (with a
/// bias) `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &DBuf,
    xc: Cols,
    w: &GBuf<f32>,
    width: usize,
    bias: Option<&GBuf<f32>>,
    seqs: &Seqs,
    dy: &DBuf,
    dx: &mut DBuf,
    dw: &mut GBuf<f32>,
    dbias: Option<&mut GBuf<f32>>,
) -> Result<()> {
    check_args(x, xc, w, width, bias, seqs)?;
    let ch = xc.width;
    check_d("conv1d dy", dy, seqs.tokens().saturating_mul(ch), x.dtype())?;
    check_d("conv1d dx", dx, x.len(), x.dtype())?;
    check_g("conv1d dw", dw, ch * width)?;
    match (&dbias, bias.is_some()) {
        (Some(d), true) => check_g("conv1d dbias", d, ch)?,
        (None, false) => {}
        (None, true) => {
            return Err(GdnError::Invalid(
                "conv1d: a bias was given but no dbias buffer".into(),
            ))
        }
        (Some(_), false) => {
            return Err(GdnError::Invalid(
                "conv1d: a dbias buffer was given but no bias".into(),
            ))
        }
    }
    let gpu = x.gpu().clone();
    for (name, g) in [
        ("conv1d dy", dy.gpu()),
        ("conv1d dx", dx.gpu()),
        ("conv1d dw", dw.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    let tiles = seqs.tokens().div_ceil(TILE);
    if tiles > i32::MAX as usize || ch.div_ceil(32) > 65535 {
        return Err(GdnError::Invalid(format!(
            "conv1d: {} tokens x {ch} channels exceed the CUDA grid",
            seqs.tokens()
        )));
    }
    let (has_bias, nseq, used, tokens, ch_i, w_i) = (
        bias.is_some() as i32,
        seqs.count() as i32,
        seqs.used() as i64,
        seqs.tokens() as i64,
        ch as i32,
        width as i32,
    );
    let mut part = gpu.uninit::<f32>((tiles * (width + 1) * ch).max(1))?;
    if tiles > 0 {
        let cu = upload_cu(&gpu, seqs)?;
        let f = kernel(&gpu, MODULE, "conv1d_silu_bwd", x.dtype())?;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, x);
        l.arg(&w.slice);
        match bias {
            Some(b) => l.arg(&b.slice),
            None => l.arg(&NULL_PTR),
        };
        l.arg(&has_bias)
            .arg(&cu.slice)
            .arg(&nseq)
            .arg(&used)
            .arg(&tokens)
            .arg(&ch_i)
            .arg(&w_i);
        arg_d(&mut l, dy);
        arg_dm(&mut l, dx);
        let (xld, xoff) = (xc.ld as i64, xc.off as i32);
        l.arg(&mut part.slice).arg(&xld).arg(&xoff);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, ch.div_ceil(32) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: bwd_smem(width) as u32,
        };
        launch(&mut l, cfg, "conv1d_silu_bwd")?;
    }
    let f = gpu.function(MODULE, "conv1d_sum_parts")?;
    let nt = tiles as i64;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&part.slice)
        .arg(&nt)
        .arg(&ch_i)
        .arg(&w_i)
        .arg(&mut dw.slice);
    match dbias {
        Some(d) => l.arg(&mut d.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&has_bias);
    launch(&mut l, lin_cfg((width + 1) * ch), "conv1d_sum_parts")
}

#[cfg(test)]
mod tests {
    #[test]
    fn widest_kernel_fits_48k_of_shared_memory() {
        assert!(super::bwd_smem(super::MAX_WIDTH) <= 48 * 1024);
    }
}
