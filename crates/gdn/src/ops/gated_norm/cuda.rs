//! CUDA gated norm (kernels in `gated_norm.cu`): `y = norm(o) * silu(z)`, the same signatures as
//! [`super::gated_norm_forward`] and [`super::gated_norm_backward`] on device buffers. `o`, `z`,
//! `y` and their gradients are [`DBuf`] of one dtype; statistics and parameters fp32; math fp32.
//! `dw`, `db`: two-stage, fixed-order sums over rows (chunks of [`crate::ops::REDUCE_BLOCK`]
//! rows, then chunks in order), no atomics.

use cudarc::driver::PushKernelArg;

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, check_part_dims, chunks, kernel, launch, lin_cfg,
    part_cfg, rows_cfg, NULL_PTR,
};
use crate::config::Normalization;
use crate::error::{GdnError, Result};
use crate::ops::common::norm::{arg_mean, check_params, GpuNormStats};

const MODULE: &str = "gated_norm";

/// [`gated_norm_forward`] into caller-provided `y` and `stats`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    o: &DBuf,
    z: &DBuf,
    rows: usize,
    dv: usize,
    w: &GBuf<f32>,
    b: Option<&GBuf<f32>>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
    y: &mut DBuf,
    stats: &mut GpuNormStats,
) -> Result<()> {
    let gpu = o.gpu().clone();
    check_params("gated_norm", &gpu, dv, w, b, kind)?;
    crate::ops::common::norm::check_eps("gated_norm", eps)?;
    let n = rows.saturating_mul(dv);
    let dt = o.dtype();
    check_d("gated_norm o", o, n, dt)?;
    check_d("gated_norm z", z, n, dt)?;
    check_d("gated_norm y", y, n, dt)?;
    check_gpu("gated_norm z", &gpu, z.gpu())?;
    check_gpu("gated_norm y", &gpu, y.gpu())?;
    check_gpu("gated_norm stats", &gpu, stats.rstd.gpu())?;
    stats.check("gated_norm stats", rows, kind)?;
    if rows == 0 {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "gated_norm_fwd", dt)?;
    let layer = (kind == Normalization::LayerNorm) as i32;
    let (rows_i, dim_i, zc, has_b) = (
        rows as i64,
        dv as i32,
        zero_centered as i32,
        b.is_some() as i32,
    );
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, o);
    arg_d(&mut l, z);
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
    launch(&mut l, rows_cfg(rows), "gated_norm_fwd")
}

/// [`gated_norm_backward`] into caller-provided `do`, `dz`, `dw` and (LayerNorm only) `db`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    o: &DBuf,
    z: &DBuf,
    rows: usize,
    dv: usize,
    w: &GBuf<f32>,
    b: Option<&GBuf<f32>>,
    kind: Normalization,
    zero_centered: bool,
    stats: &GpuNormStats,
    dy: &DBuf,
    d_o: &mut DBuf,
    dz: &mut DBuf,
    dw: &mut GBuf<f32>,
    db: Option<&mut GBuf<f32>>,
) -> Result<()> {
    let gpu = o.gpu().clone();
    check_params("gated_norm", &gpu, dv, w, b, kind)?;
    let n = rows.saturating_mul(dv);
    let dt = o.dtype();
    check_d("gated_norm o", o, n, dt)?;
    check_d("gated_norm z", z, n, dt)?;
    check_d("gated_norm dy", dy, n, dt)?;
    check_d("gated_norm do", d_o, n, dt)?;
    check_d("gated_norm dz", dz, n, dt)?;
    stats.check("gated_norm stats", rows, kind)?;
    check_g("gated_norm dw", dw, dv)?;
    let layer = kind == Normalization::LayerNorm;
    match (&db, layer) {
        (Some(db), true) => check_g("gated_norm db", db, dv)?,
        (None, false) => {}
        (None, true) => {
            return Err(GdnError::Invalid(
                "gated_norm: LayerNorm backward needs a db buffer".into(),
            ))
        }
        (Some(_), false) => {
            return Err(GdnError::Invalid(
                "gated_norm: RMSNorm has no bias, but a db buffer was given".into(),
            ))
        }
    }
    for (name, g) in [
        ("gated_norm z", z.gpu()),
        ("gated_norm dy", dy.gpu()),
        ("gated_norm do", d_o.gpu()),
        ("gated_norm dz", dz.gpu()),
        ("gated_norm dw", dw.gpu()),
        ("gated_norm stats", stats.rstd.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    let nchunks = chunks(rows);
    check_part_dims("gated_norm", nchunks, dv)?;
    let (rows_i, dim_i, layer_i, zc, has_b) = (
        rows as i64,
        dv as i32,
        layer as i32,
        zero_centered as i32,
        b.is_some() as i32,
    );
    if rows > 0 {
        let f = kernel(&gpu, MODULE, "gated_norm_bwd_dx", dt)?;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, o);
        arg_d(&mut l, z);
        l.arg(&w.slice);
        match b {
            Some(b) => l.arg(&b.slice),
            None => l.arg(&NULL_PTR),
        };
        l.arg(&has_b).arg(&stats.rstd.slice);
        arg_mean(&mut l, stats);
        arg_d(&mut l, dy);
        arg_dm(&mut l, d_o);
        arg_dm(&mut l, dz);
        l.arg(&rows_i).arg(&dim_i).arg(&layer_i).arg(&zc);
        launch(&mut l, rows_cfg(rows), "gated_norm_bwd_dx")?;
    }
    let mut part = gpu.uninit::<f32>((nchunks * 2 * dv).max(1))?;
    if rows > 0 {
        let f = kernel(&gpu, MODULE, "gated_norm_bwd_part", dt)?;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, o);
        arg_d(&mut l, z);
        l.arg(&stats.rstd.slice);
        arg_mean(&mut l, stats);
        arg_d(&mut l, dy);
        l.arg(&mut part.slice)
            .arg(&rows_i)
            .arg(&dim_i)
            .arg(&layer_i);
        launch(&mut l, part_cfg(nchunks, dv), "gated_norm_bwd_part")?;
    }
    let f = gpu.function(MODULE, "gated_norm_sum_parts")?;
    let nch = nchunks as i64;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&part.slice).arg(&nch).arg(&dim_i).arg(&mut dw.slice);
    match db {
        Some(db) => l.arg(&mut db.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&layer_i);
    launch(&mut l, lin_cfg(dv), "gated_norm_sum_parts")
}
