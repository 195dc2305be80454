//! CUDA pre-norm (kernels in `norm.cu`): the same signatures as [`super::norm_forward`] and
//! [`super::norm_backward`], on device buffers. Activations are [`DBuf`] (f32 or bf16 storage, the
//! same dtype in and out), statistics and parameters fp32 [`GBuf`]; all math is fp32.
//!
//! `dw`, `db` are two-stage, fixed-order sums over rows (per chunk of
//! [`crate::ops::REDUCE_BLOCK`] rows, then chunks in order), no atomics: bitwise reproducible.
//!
//! Also home of the small launch and validation helpers shared by the other ops' CUDA wrappers.

use cudarc::driver::PushKernelArg;

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, check_part_dims, chunks, int, kernel, launch,
    lin_cfg, part_cfg, rows_cfg, NULL_PTR,
};
use crate::config::Normalization;
use crate::error::{GdnError, Result};
use crate::ops::common::norm::{arg_mean, check_params, GpuNormStats};

const MODULE: &str = "norm";

// ---- the norm ----

/// [`norm_forward`] into caller-provided `y` `[rows, dim]` and `stats`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &DBuf,
    rows: usize,
    dim: usize,
    w: &GBuf<f32>,
    b: Option<&GBuf<f32>>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
    y: &mut DBuf,
    stats: &mut GpuNormStats,
) -> Result<()> {
    let gpu = x.gpu().clone();
    check_params("norm", &gpu, dim, w, b, kind)?;
    crate::ops::common::norm::check_eps("norm", eps)?;
    let n = rows.saturating_mul(dim);
    check_d("norm x", x, n, x.dtype())?;
    check_d("norm y", y, n, x.dtype())?;
    check_gpu("norm y", &gpu, y.gpu())?;
    stats.check("norm stats", rows, kind)?;
    if rows == 0 {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "norm_fwd", x.dtype())?;
    let (rows_i, dim_i, layer, zc) = (
        rows as i64,
        dim as i32,
        (kind == Normalization::LayerNorm) as i32,
        zero_centered as i32,
    );
    let has_b = b.is_some() as i32;
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    l.arg(&w.slice);
    match b {
        Some(b) => l.arg(&b.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&has_b);
    arg_dm(&mut l, y);
    let GpuNormStats { rstd, mean } = stats;
    l.arg(&mut rstd.slice);
    match mean {
        Some(m) => l.arg(&mut m.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&rows_i).arg(&dim_i).arg(&layer).arg(&eps).arg(&zc);
    launch(&mut l, rows_cfg(rows), "norm_fwd")
}

/// [`norm_backward`] into caller-provided `dx`, `dw` and (LayerNorm only) `db`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &DBuf,
    rows: usize,
    dim: usize,
    w: &GBuf<f32>,
    kind: Normalization,
    zero_centered: bool,
    stats: &GpuNormStats,
    dy: &DBuf,
    dx: &mut DBuf,
    dw: &mut GBuf<f32>,
    db: Option<&mut GBuf<f32>>,
) -> Result<()> {
    let gpu = x.gpu().clone();
    if dim == 0 {
        return Err(GdnError::Invalid(
            "norm: the normalized dimension must be > 0, got 0".into(),
        ));
    }
    int("norm dim", dim)?;
    check_g("norm weight", w, dim)?;
    let n = rows.saturating_mul(dim);
    let dt = x.dtype();
    check_d("norm x", x, n, dt)?;
    check_d("norm dy", dy, n, dt)?;
    check_d("norm dx", dx, n, dt)?;
    stats.check("norm stats", rows, kind)?;
    check_g("norm dw", dw, dim)?;
    let layer = kind == Normalization::LayerNorm;
    match (&db, layer) {
        (Some(db), true) => check_g("norm db", db, dim)?,
        (None, false) => {}
        (None, true) => {
            return Err(GdnError::Invalid(
                "norm: LayerNorm backward needs a db buffer".into(),
            ))
        }
        (Some(_), false) => {
            return Err(GdnError::Invalid(
                "norm: RMSNorm has no bias, but a db buffer was given".into(),
            ))
        }
    }
    for (name, g) in [
        ("norm weight", w.gpu()),
        ("norm dy", dy.gpu()),
        ("norm dx", dx.gpu()),
        ("norm dw", dw.gpu()),
        ("norm stats", stats.rstd.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    let nchunks = chunks(rows);
    check_part_dims("norm", nchunks, dim)?;
    let (rows_i, dim_i, layer_i, zc) =
        (rows as i64, dim as i32, layer as i32, zero_centered as i32);
    if rows > 0 {
        let f = kernel(&gpu, MODULE, "norm_bwd_dx", dt)?;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, x);
        l.arg(&w.slice).arg(&stats.rstd.slice);
        arg_mean(&mut l, stats);
        arg_d(&mut l, dy);
        arg_dm(&mut l, dx);
        l.arg(&rows_i).arg(&dim_i).arg(&layer_i).arg(&zc);
        launch(&mut l, rows_cfg(rows), "norm_bwd_dx")?;
    }
    let mut part = gpu.uninit::<f32>((nchunks * 2 * dim).max(1))?;
    if rows > 0 {
        let f = kernel(&gpu, MODULE, "norm_bwd_part", dt)?;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, x);
        l.arg(&stats.rstd.slice);
        arg_mean(&mut l, stats);
        arg_d(&mut l, dy);
        l.arg(&mut part.slice)
            .arg(&rows_i)
            .arg(&dim_i)
            .arg(&layer_i);
        launch(&mut l, part_cfg(nchunks, dim), "norm_bwd_part")?;
    }
    let f = gpu.function(MODULE, "norm_sum_parts")?;
    let (nch, has_db) = (nchunks as i64, layer as i32);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&part.slice).arg(&nch).arg(&dim_i);
    match db {
        Some(db) => {
            l.arg(&mut dw.slice).arg(&mut db.slice);
        }
        None => {
            l.arg(&mut dw.slice).arg(&NULL_PTR);
        }
    }
    l.arg(&has_db);
    launch(&mut l, lin_cfg(dim), "norm_sum_parts")
}
