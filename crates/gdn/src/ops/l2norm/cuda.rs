//! CUDA per-row L2 norm (kernels in `l2norm.cu`): the same signatures as
//! [`super::l2norm_forward`], [`super::l2norm_rstd`] and [`super::l2norm_backward`] on device
//! buffers. `x`, `y`, `dy`, `dx` are [`DBuf`] of one dtype; `rstd` is fp32; math fp32.

use cudarc::driver::PushKernelArg;

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, int, kernel, launch, rows_cfg,
};
use crate::error::{GdnError, Result};

const MODULE: &str = "l2norm";

fn check_x(x: &DBuf, rows: usize, dim: usize) -> Result<()> {
    if dim == 0 {
        return Err(GdnError::Invalid(
            "l2norm: the row length must be > 0, got 0".into(),
        ));
    }
    int("l2norm dim", dim)?;
    check_d("l2norm x", x, rows.saturating_mul(dim), x.dtype())
}

/// [`l2norm_forward`] into caller-provided `y` and `rstd`.
pub fn forward(
    x: &DBuf,
    rows: usize,
    dim: usize,
    y: &mut DBuf,
    rstd: &mut GBuf<f32>,
) -> Result<()> {
    check_x(x, rows, dim)?;
    check_d("l2norm y", y, rows * dim, x.dtype())?;
    check_g("l2norm rstd", rstd, rows)?;
    let gpu = x.gpu().clone();
    check_gpu("l2norm y", &gpu, y.gpu())?;
    check_gpu("l2norm rstd", &gpu, rstd.gpu())?;
    if rows == 0 {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "l2norm_fwd", x.dtype())?;
    let (rows_i, dim_i, write_y) = (rows as i64, dim as i32, 1i32);
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    arg_dm(&mut l, y);
    l.arg(&mut rstd.slice)
        .arg(&rows_i)
        .arg(&dim_i)
        .arg(&write_y);
    launch(&mut l, rows_cfg(rows), "l2norm_fwd")
}

/// Only the `rstd` `[rows]` of [`l2norm_forward`] (same bits), for a backward that did not keep it.
pub fn rstd(x: &DBuf, rows: usize, dim: usize) -> Result<GBuf<f32>> {
    check_x(x, rows, dim)?;
    let gpu = x.gpu().clone();
    let mut rstd = gpu.uninit(rows)?;
    if rows == 0 {
        return Ok(rstd);
    }
    let f = kernel(&gpu, MODULE, "l2norm_fwd", x.dtype())?;
    let (rows_i, dim_i, write_y) = (rows as i64, dim as i32, 0i32);
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    arg_d(&mut l, x); // y: not written (write_y = 0)
    l.arg(&mut rstd.slice)
        .arg(&rows_i)
        .arg(&dim_i)
        .arg(&write_y);
    launch(&mut l, rows_cfg(rows), "l2norm_fwd")?;
    Ok(rstd)
}

/// [`l2norm_backward`] into a caller-provided `dx`.
pub fn backward(
    x: &DBuf,
    rows: usize,
    dim: usize,
    rstd: &GBuf<f32>,
    dy: &DBuf,
    dx: &mut DBuf,
) -> Result<()> {
    check_x(x, rows, dim)?;
    check_g("l2norm rstd", rstd, rows)?;
    check_d("l2norm dy", dy, rows * dim, x.dtype())?;
    check_d("l2norm dx", dx, rows * dim, x.dtype())?;
    let gpu = x.gpu().clone();
    for (name, g) in [
        ("l2norm rstd", rstd.gpu()),
        ("l2norm dy", dy.gpu()),
        ("l2norm dx", dx.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "l2norm_bwd", x.dtype())?;
    let (rows_i, dim_i) = (rows as i64, dim as i32);
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    l.arg(&rstd.slice);
    arg_d(&mut l, dy);
    arg_dm(&mut l, dx);
    l.arg(&rows_i).arg(&dim_i);
    launch(&mut l, rows_cfg(rows), "l2norm_bwd")
}
