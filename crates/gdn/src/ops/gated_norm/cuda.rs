//! CUDA gated norm (kernels in `gated_norm.cu`): `y = norm(o) * silu(z)`, the same signatures as
//! [`super::gated_norm_forward`] and [`super::gated_norm_backward`] on device buffers. `o`, `z`,
//! `y` and their gradients are [`DBuf`] of one dtype; statistics and parameters fp32; math fp32.
//! `dw`, `db`: two-stage, fixed-order sums over rows (chunks of [`crate::ops::REDUCE_BLOCK`]
//! rows, then chunks in order), no atomics. The layer's shapes run the streaming kernels (see
//! [`streaming`]).

use cudarc::driver::PushKernelArg;

use cudarc::driver::LaunchConfig;

use std::sync::Arc;

use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, check_part_dims, chunks, int, kernel, launch,
    part_cfg, rows_cfg, NULL_PTR, THREADS,
};
use crate::backend::Cols;
use crate::config::Normalization;
use crate::error::{GdnError, Result};
use crate::ops::common::norm::{arg_mean, check_params, GpuNormStats};

const MODULE: &str = "gated_norm";

/// Largest `dv` the backward with fused weight-gradient partials takes (its shared memory:
/// 8 warps x 2 x dv floats in 48 KiB); wider rows use the separate partials kernel.
const FUSED_MAX_DV: usize = 768;

/// The streaming kernels (`gated_norm_fwd_v{NC}`, `gated_norm_bwd_v{NC}`: a row's values in a
/// warp's registers, 4 per lane per access) take rows of `dv` a multiple of 4 up to 256 (`NC` =
/// 1: up to 128, 2: up to 256), z's row stride and offset 4-aligned, fewer than 2^32 rows.
/// `Some(NC)` when they take the call.
fn streaming(rows: usize, dv: usize, zld: i64, zoff: i32) -> Option<usize> {
    let ok = dv.is_multiple_of(4)
        && dv <= 256
        && zld % 4 == 0
        && zoff % 4 == 0
        && rows <= u32::MAX as usize;
    ok.then_some(if dv <= 128 { 1 } else { 2 })
}

/// Checks `z` (read, or `dz` written) at `zc` for `rows` rows of `dv`: `zc.width` is a whole
/// number of heads per token; returns (row stride, column offset, heads per token).
fn check_z(name: &str, z: &DBuf, zc: Cols, rows: usize, dv: usize) -> Result<(i64, i32, i32)> {
    if dv == 0
        || zc.width == 0
        || !zc.width.is_multiple_of(dv)
        || !rows.is_multiple_of(zc.width / dv)
    {
        return Err(GdnError::Invalid(format!(
            "{name}: a section of {} columns does not hold whole rows of {dv} ({rows} rows)",
            zc.width
        )));
    }
    let hpt = zc.width / dv;
    zc.check(name, z.len(), rows / hpt)?;
    Ok((
        int(&format!("{name} row stride"), zc.ld)? as i64,
        int(&format!("{name} offset"), zc.off)?,
        int(&format!("{name} heads per token"), hpt)?,
    ))
}

/// The checks [`forward`] and [`forward_pdl`] make of their arguments: `(dtype, z row stride,
/// z offset, heads per token)`.
#[allow(clippy::too_many_arguments)]
fn check_forward(
    gpu: &Arc<Gpu>,
    o: &DBuf,
    z: &DBuf,
    zcols: Cols,
    rows: usize,
    dv: usize,
    w: &GBuf<f32>,
    b: Option<&GBuf<f32>>,
    kind: Normalization,
    eps: f32,
    y: &DBuf,
    stats: &GpuNormStats,
) -> Result<(DType, i64, i32, i32)> {
    check_params("gated_norm", gpu, dv, w, b, kind)?;
    crate::ops::common::norm::check_eps("gated_norm", eps)?;
    let n = rows.saturating_mul(dv);
    let dt = o.dtype();
    check_d("gated_norm o", o, n, dt)?;
    check_d("gated_norm z", z, z.len(), dt)?;
    let (zld, zoff, hpt) = check_z("gated_norm z", z, zcols, rows, dv)?;
    check_d("gated_norm y", y, n, dt)?;
    check_gpu("gated_norm z", gpu, z.gpu())?;
    check_gpu("gated_norm y", gpu, y.gpu())?;
    check_gpu("gated_norm stats", gpu, stats.rstd.gpu())?;
    stats.check("gated_norm stats", rows, kind)?;
    Ok((dt, zld, zoff, hpt))
}

/// [`gated_norm_forward`] into caller-provided `y` and `stats`; `z` is read at `zcols`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    o: &DBuf,
    z: &DBuf,
    zcols: Cols,
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
    let (dt, zld, zoff, hpt) =
        check_forward(&gpu, o, z, zcols, rows, dv, w, b, kind, eps, y, stats)?;
    if rows == 0 {
        return Ok(());
    }
    let name = match streaming(rows, dv, zld, zoff) {
        Some(nc) => format!("gated_norm_fwd_v{nc}"),
        None => "gated_norm_fwd".to_string(),
    };
    let f = kernel(&gpu, MODULE, &name, dt)?;
    let layer = (kind == Normalization::LayerNorm) as i32;
    let (rows_i, dim_i, zc_i, has_b) = (
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
    l.arg(&rows_i)
        .arg(&dim_i)
        .arg(&layer)
        .arg(&eps)
        .arg(&zc_i)
        .arg(&zld)
        .arg(&zoff)
        .arg(&hpt);
    launch(&mut l, rows_cfg(rows), &name)
}

/// [`gated_norm_backward`] into caller-provided `do`, `dz`, `dw` and (LayerNorm only) `db`; `z`
/// is read and `dz` written at `zcols` (dz's other columns are left as they are).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    o: &DBuf,
    z: &DBuf,
    zcols: Cols,
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
    check_d("gated_norm z", z, z.len(), dt)?;
    let (zld, zoff, hpt) = check_z("gated_norm z", z, zcols, rows, dv)?;
    check_d("gated_norm dz", dz, dz.len(), dt)?;
    check_z("gated_norm dz", dz, zcols, rows, dv)?;
    check_d("gated_norm dy", dy, n, dt)?;
    check_d("gated_norm do", d_o, n, dt)?;
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
    let mut part = gpu.uninit::<f32>((nchunks * 2 * dv).max(1))?;
    let vec = streaming(rows, dv, zld, zoff);
    if rows > 0 && (vec.is_some() || dv <= FUSED_MAX_DV) {
        // do, dz and the weight-gradient partials in one pass over o, z, dy.
        let name = match vec {
            Some(nc) => format!("gated_norm_bwd_v{nc}"),
            None => "gated_norm_bwd_fused".to_string(),
        };
        let f = kernel(&gpu, MODULE, &name, dt)?;
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
        l.arg(&mut part.slice)
            .arg(&rows_i)
            .arg(&dim_i)
            .arg(&layer_i)
            .arg(&zc)
            .arg(&zld)
            .arg(&zoff)
            .arg(&hpt);
        let cfg = LaunchConfig {
            grid_dim: (nchunks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            // the streaming kernel's sums live in static shared memory
            shared_mem_bytes: if vec.is_some() {
                0
            } else {
                (8 * 2 * dv * 4) as u32
            },
        };
        launch(&mut l, cfg, &name)?;
    } else if rows > 0 {
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
        l.arg(&rows_i)
            .arg(&dim_i)
            .arg(&layer_i)
            .arg(&zc)
            .arg(&zld)
            .arg(&zoff)
            .arg(&hpt);
        launch(&mut l, rows_cfg(rows), "gated_norm_bwd_dx")?;
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
            .arg(&layer_i)
            .arg(&zld)
            .arg(&zoff)
            .arg(&hpt);
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
    let cfg = LaunchConfig {
        grid_dim: (dv as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(&mut l, cfg, "gated_norm_sum_parts")
}

/// [`forward`] launched as a programmatic dependent launch (`gated_norm_fwd_pdl_v{NC}`: the
/// streaming kernel behind a `griddepcontrol.wait`), for the decode step's opt-in chain
/// (`GDN_DECODE_PDL=1`); the same bits as [`forward`]. Shapes the streaming kernels do not take
/// run [`forward`] (an ordinary launch).
#[allow(clippy::too_many_arguments)]
pub fn forward_pdl(
    o: &DBuf,
    z: &DBuf,
    zcols: Cols,
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
    use crate::backend::launch::{dptr, launch_pdl, optr, ptr, suffix, Arg};
    let gpu = o.gpu().clone();
    let (dt, zld, zoff, hpt) =
        check_forward(&gpu, o, z, zcols, rows, dv, w, b, kind, eps, y, stats)?;
    if rows == 0 {
        return Ok(());
    }
    let Some(nc) = streaming(rows, dv, zld, zoff) else {
        return forward(
            o,
            z,
            zcols,
            rows,
            dv,
            w,
            b,
            kind,
            eps,
            zero_centered,
            y,
            stats,
        );
    };
    let s = gpu.stream();
    let args = [
        dptr(o, s),
        dptr(z, s),
        ptr(w, s),
        optr(b, s),
        Arg::I32(b.is_some() as i32),
        dptr(y, s),
        ptr(&stats.rstd, s),
        optr(stats.mean.as_ref(), s),
        Arg::I64(rows as i64),
        Arg::I32(dv as i32),
        Arg::I32((kind == Normalization::LayerNorm) as i32),
        Arg::F32(eps),
        Arg::I32(zero_centered as i32),
        Arg::I64(zld),
        Arg::I32(zoff),
        Arg::I32(hpt),
    ];
    let warps = (THREADS / 32) as usize;
    launch_pdl(
        &gpu,
        MODULE,
        &format!("gated_norm_fwd_pdl_v{nc}_{}", suffix(dt)),
        rows.div_ceil(warps),
        THREADS,
        0,
        &args,
    )
}
