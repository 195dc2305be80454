//! CUDA pre-norm (kernels in `norm.cu`): the same signatures as [`super::norm_forward`] and
//! [`super::norm_backward`], on device buffers. Activations are [`DBuf`] (f32 or bf16 storage, the
//! same dtype in and out), statistics and parameters fp32 [`GBuf`]; all math is fp32.
//!
//! `dw`, `db` are two-stage, fixed-order sums over rows (per chunk of
//! [`crate::ops::REDUCE_BLOCK`] rows, then chunks in order), no atomics: bitwise reproducible.
//!
//! Also home of the small launch and validation helpers shared by the other ops' CUDA wrappers.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, LaunchArgs, LaunchConfig, PushKernelArg};

use crate::config::Normalization;
use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::error::{GdnError, Result};
use crate::ops::REDUCE_BLOCK;

const MODULE: &str = "norm";

/// Per-row statistics kept by a norm's forward on the GPU (fp32), the device twin of
/// [`super::NormStats`].
pub struct GpuNormStats {
    /// `1 / sqrt(mean(x^2) + eps)` (RMSNorm) or `1 / sqrt(var(x) + eps)` (LayerNorm), per row.
    pub rstd: GBuf<f32>,
    /// Mean per row; LayerNorm only.
    pub mean: Option<GBuf<f32>>,
}

impl GpuNormStats {
    /// Uninitialized statistics of `rows` rows of a `kind` norm.
    pub fn uninit(gpu: &Arc<Gpu>, rows: usize, kind: Normalization) -> Result<Self> {
        Ok(GpuNormStats {
            rstd: gpu.uninit(rows)?,
            mean: match kind {
                Normalization::LayerNorm => Some(gpu.uninit(rows)?),
                Normalization::RMSNorm => None,
            },
        })
    }
    /// Bytes held (4 per stored f32).
    pub fn bytes(&self) -> usize {
        self.rstd.bytes() + self.mean.as_ref().map_or(0, |m| m.bytes())
    }
    /// Copy to the host.
    pub fn download(&self) -> Result<super::NormStats> {
        let gpu = self.rstd.gpu();
        Ok(super::NormStats {
            rstd: gpu.download(&self.rstd)?,
            mean: self.mean.as_ref().map(|m| gpu.download(m)).transpose()?,
        })
    }
    pub(crate) fn check(&self, name: &str, rows: usize, kind: Normalization) -> Result<()> {
        check_g(&format!("{name}.rstd"), &self.rstd, rows)?;
        match (kind, &self.mean) {
            (Normalization::LayerNorm, Some(m)) => check_g(&format!("{name}.mean"), m, rows),
            (Normalization::LayerNorm, None) => Err(GdnError::Invalid(format!(
                "{name}: LayerNorm statistics need the per-row mean, got none"
            ))),
            (Normalization::RMSNorm, None) => Ok(()),
            (Normalization::RMSNorm, Some(_)) => Err(GdnError::Invalid(format!(
                "{name}: RMSNorm statistics hold no mean, got one (LayerNorm statistics?)"
            ))),
        }
    }
}

// ---- helpers shared by the CUDA wrappers of the ops ----

/// Threads per block of every kernel of the ops.
pub(crate) const THREADS: u32 = 256;

/// A null device pointer, for optional pointer arguments the kernel does not touch (its flag is 0).
pub(crate) static NULL_PTR: u64 = 0;

/// Kernel-name suffix of a storage type.
pub(crate) fn suffix(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
    }
}

/// Kernel `{base}_{f32|bf16}` of `module`.
pub(crate) fn kernel(
    gpu: &Gpu,
    module: &'static str,
    base: &str,
    dt: DType,
) -> Result<CudaFunction> {
    gpu.function(module, &format!("{base}_{}", suffix(dt)))
}

/// Push a [`DBuf`] as a kernel pointer argument.
pub(crate) fn arg_d<'a, 'b: 'a>(b: &mut LaunchArgs<'a>, d: &'b DBuf) {
    match d {
        DBuf::F32(g) => b.arg(&g.slice),
        DBuf::Bf16(g) => b.arg(&g.slice),
    };
}

/// Push a [`DBuf`] as a kernel pointer argument that the kernel writes.
pub(crate) fn arg_dm<'a, 'b: 'a>(b: &mut LaunchArgs<'a>, d: &'b mut DBuf) {
    match d {
        DBuf::F32(g) => b.arg(&mut g.slice),
        DBuf::Bf16(g) => b.arg(&mut g.slice),
    };
}

/// Launch, mapping the driver's error.
pub(crate) fn launch(b: &mut LaunchArgs, cfg: LaunchConfig, what: &str) -> Result<()> {
    // SAFETY: every caller passes the argument list of the named kernel, with buffers whose lengths
    // were validated against the sizes the kernel reads and writes.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| GdnError::Device(format!("launching {what}: {e:?}")))
}

/// One warp per row, 8 rows per block.
pub(crate) fn rows_cfg(rows: usize) -> LaunchConfig {
    let warps = (THREADS / 32) as usize;
    LaunchConfig {
        grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Grid-stride elementwise launch over `n` elements.
pub(crate) fn elem_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Column-partial launch: block (32 columns x 8 lanes), grid (row chunks, column tiles).
pub(crate) fn part_cfg(chunks: usize, cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (chunks as u32, cols.div_ceil(32) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks that the partial-sum layout fits the grid limits.
pub(crate) fn check_part_dims(op: &str, chunks: usize, cols: usize) -> Result<()> {
    if chunks > i32::MAX as usize || cols.div_ceil(32) > 65535 {
        return Err(GdnError::Invalid(format!(
            "{op}: {chunks} row chunks x {cols} columns exceed the CUDA grid (at most 2^31-1 chunks and 2097120 columns)"
        )));
    }
    Ok(())
}

/// A length that kernels take as a 32-bit int.
pub(crate) fn int(name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        GdnError::Invalid(format!(
            "{name}: {v} exceeds the CUDA kernels' limit of 2^31-1"
        ))
    })
}

/// Error unless `d` holds `len` values of `dtype`.
pub(crate) fn check_d(name: &str, d: &DBuf, len: usize, dtype: DType) -> Result<()> {
    if d.dtype() != dtype {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {dtype:?} storage, got {:?}",
            d.dtype()
        )));
    }
    if d.len() != len {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {len} values, got {}",
            d.len()
        )));
    }
    Ok(())
}

/// Error unless `g` holds `len` values.
pub(crate) fn check_g<T: cudarc::driver::DeviceRepr>(
    name: &str,
    g: &GBuf<T>,
    len: usize,
) -> Result<()> {
    if g.len() != len {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {len} values, got {}",
            g.len()
        )));
    }
    Ok(())
}

/// Error unless `b` lives on `gpu`.
pub(crate) fn check_gpu(name: &str, gpu: &Arc<Gpu>, b: &Arc<Gpu>) -> Result<()> {
    if !Arc::ptr_eq(gpu, b) {
        return Err(GdnError::Invalid(format!(
            "{name} lives on cuda:{}, the other operands on cuda:{}",
            b.ordinal(),
            gpu.ordinal()
        )));
    }
    Ok(())
}

/// Number of partial-sum chunks of `rows` rows.
pub(crate) fn chunks(rows: usize) -> usize {
    rows.div_ceil(REDUCE_BLOCK)
}

/// Push the per-row means of `stats`, or a null pointer (RMSNorm).
pub(crate) fn arg_mean<'a, 'b: 'a>(l: &mut LaunchArgs<'a>, stats: &'b GpuNormStats) {
    match &stats.mean {
        Some(m) => l.arg(&m.slice),
        None => l.arg(&NULL_PTR),
    };
}

/// A 1-D launch of `n` threads.
pub(crate) fn lin_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

// ---- the norm ----

pub(crate) fn check_params(
    op: &str,
    gpu: &Arc<Gpu>,
    dim: usize,
    w: &GBuf<f32>,
    b: Option<&GBuf<f32>>,
    kind: Normalization,
) -> Result<()> {
    if dim == 0 {
        return Err(GdnError::Invalid(format!(
            "{op}: the normalized dimension must be > 0, got 0"
        )));
    }
    int(&format!("{op} dim"), dim)?;
    check_g(&format!("{op} weight"), w, dim)?;
    check_gpu(&format!("{op} weight"), gpu, w.gpu())?;
    match (kind, b) {
        (Normalization::LayerNorm, Some(b)) => {
            check_gpu(&format!("{op} bias"), gpu, b.gpu())?;
            check_g(&format!("{op} bias"), b, dim)
        }
        (Normalization::LayerNorm, None) => Err(GdnError::Invalid(format!(
            "{op}: LayerNorm needs a bias of {dim} values, got none"
        ))),
        (Normalization::RMSNorm, None) => Ok(()),
        (Normalization::RMSNorm, Some(_)) => Err(GdnError::Invalid(format!(
            "{op}: RMSNorm takes no bias, got one"
        ))),
    }
}

/// Forward of the pre-norm over `x` `[rows, dim]`: returns `y` (dtype of `x`) and the statistics.
#[allow(clippy::too_many_arguments)]
pub fn norm_forward(
    x: &DBuf,
    rows: usize,
    dim: usize,
    w: &GBuf<f32>,
    b: Option<&GBuf<f32>>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> Result<(DBuf, GpuNormStats)> {
    let gpu = x.gpu();
    let mut y = DBuf::uninit(gpu, rows.saturating_mul(dim), x.dtype())?;
    let mut stats = GpuNormStats::uninit(gpu, rows, kind)?;
    norm_forward_into(
        x,
        rows,
        dim,
        w,
        b,
        kind,
        eps,
        zero_centered,
        &mut y,
        &mut stats,
    )?;
    Ok((y, stats))
}

/// [`norm_forward`] into caller-provided `y` `[rows, dim]` and `stats`.
#[allow(clippy::too_many_arguments)]
pub fn norm_forward_into(
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
    super::check_eps("norm", eps)?;
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

/// Backward of [`norm_forward`]: returns `dx` `[rows, dim]` (dtype of `x`), `dw` `[dim]` and, for
/// LayerNorm, `db` `[dim]` (fp32).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn norm_backward(
    x: &DBuf,
    rows: usize,
    dim: usize,
    w: &GBuf<f32>,
    kind: Normalization,
    zero_centered: bool,
    stats: &GpuNormStats,
    dy: &DBuf,
) -> Result<(DBuf, GBuf<f32>, Option<GBuf<f32>>)> {
    let gpu = x.gpu();
    let mut dx = DBuf::uninit(gpu, rows.saturating_mul(dim), x.dtype())?;
    let mut dw = gpu.uninit(dim)?;
    let mut db = match kind {
        Normalization::LayerNorm => Some(gpu.uninit(dim)?),
        Normalization::RMSNorm => None,
    };
    norm_backward_into(
        x,
        rows,
        dim,
        w,
        kind,
        zero_centered,
        stats,
        dy,
        &mut dx,
        &mut dw,
        db.as_mut(),
    )?;
    Ok((dx, dw, db))
}

/// [`norm_backward`] into caller-provided `dx`, `dw` and (LayerNorm only) `db`.
#[allow(clippy::too_many_arguments)]
pub fn norm_backward_into(
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
