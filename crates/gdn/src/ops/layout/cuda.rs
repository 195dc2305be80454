//! CUDA layout ops (kernels in `layout.cu`): column copies between row-major matrices and head
//! repeat / sum, for f32 and bf16 storage. Launch parameters: 256 threads per block, one thread
//! per output element.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::backend::cuda::{DBuf, GBuf, Gpu};
use crate::backend::launch::{arg_d, arg_dm, kernel, launch};
use crate::error::{GdnError, Result};

/// Copy columns `[s0, s0+w)` of the `[rows, scols]` matrix `src` into columns `[d0, d0+w)` of the
/// `[rows, dcols]` matrix `dst` (same storage type).
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_cols(
    gpu: &Arc<Gpu>,
    src: &DBuf,
    scols: usize,
    s0: usize,
    dst: &mut DBuf,
    dcols: usize,
    d0: usize,
    rows: usize,
    w: usize,
) -> Result<()> {
    let n = rows * w;
    if n == 0 {
        return Ok(());
    }
    let (scols, s0, dcols, d0, rows, w) = (
        scols as i64,
        s0 as i64,
        dcols as i64,
        d0 as i64,
        rows as i64,
        w as i64,
    );
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    if src.dtype() != dst.dtype() {
        return Err(GdnError::Device("copy_cols: storage types differ".into()));
    }
    let f = kernel(gpu, "layout", "copy_cols", src.dtype())?;
    let mut b = gpu.stream().launch_builder(&f);
    arg_d(&mut b, src);
    b.arg(&scols).arg(&s0);
    arg_dm(&mut b, dst);
    b.arg(&dcols).arg(&d0).arg(&rows).arg(&w);
    // Bounds are guaranteed by the callers (rows * cols of both matrices).
    launch(&mut b, cfg, "copy_cols")?;
    Ok(())
}

/// Launch `layout::{name}_{sfx}` (repeat_heads / sum_heads) from `src` into `out` (`out_len`
/// elements).
#[allow(clippy::too_many_arguments)]
fn launch_heads<T: DeviceRepr>(
    gpu: &Arc<Gpu>,
    name: &str,
    sfx: &str,
    src: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    out_len: usize,
    n: usize,
    hk: usize,
    hv: usize,
    d: usize,
) -> Result<()> {
    if out_len == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (out_len.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n, hk, hv, d) = (n as i64, hk as i32, hv as i32, d as i32);
    let f = gpu.function("layout", &format!("{name}_{sfx}"))?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(src).arg(out).arg(&n).arg(&hk).arg(&hv).arg(&d);
    // SAFETY: argument types match the kernel's signature; src holds n * Hk|Hv * d values
    // (checked by the callers) and out holds out_len.
    unsafe { b.launch(cfg) }.map_err(|e| GdnError::Device(format!("{name} launch: {e:?}")))?;
    Ok(())
}

/// Repeat or sum heads of a device buffer into a new one of `out_len` elements.
pub(crate) fn heads_dev(
    name: &str,
    x: &DBuf,
    out_len: usize,
    n: usize,
    hk: usize,
    hv: usize,
    d: usize,
) -> Result<DBuf> {
    let gpu = x.gpu().clone();
    let mut out = DBuf::uninit(&gpu, out_len, x.dtype())?;
    match (x, &mut out) {
        (DBuf::F32(s), DBuf::F32(o)) => launch_heads(
            &gpu,
            name,
            "f32",
            &s.slice,
            &mut o.slice,
            out_len,
            n,
            hk,
            hv,
            d,
        )?,
        (DBuf::Bf16(s), DBuf::Bf16(o)) => launch_heads(
            &gpu,
            name,
            "bf16",
            &s.slice,
            &mut o.slice,
            out_len,
            n,
            hk,
            hv,
            d,
        )?,
        _ => return Err(GdnError::Device(format!("{name}: storage types differ"))),
    }
    Ok(out)
}

/// Repeat or sum heads of a device fp32 buffer into a new one of `out_len` elements.
pub(crate) fn heads_g(
    name: &str,
    x: &GBuf<f32>,
    out_len: usize,
    n: usize,
    hk: usize,
    hv: usize,
    d: usize,
) -> Result<GBuf<f32>> {
    let gpu = x.gpu().clone();
    let mut out = gpu.uninit::<f32>(out_len)?;
    launch_heads(
        &gpu,
        name,
        "f32",
        &x.slice,
        &mut out.slice,
        out_len,
        n,
        hk,
        hv,
        d,
    )?;
    Ok(out)
}
