//! Pieces shared by the two norm ops (`ops::norm`, `ops::gated_norm`): the statistics they keep
//! for backward (host [`NormStats`], device [`GpuNormStats`], either side [`Stats`]), their
//! argument checks, and the CPU row helpers.

use std::sync::Arc;

use cudarc::driver::{LaunchArgs, PushKernelArg};

use crate::backend::cuda::{GBuf, Gpu};
use crate::backend::launch::{check_g, check_gpu, int, NULL_PTR};
use crate::config::Normalization;
use crate::error::{GdnError, Result};
use crate::ops::check_len;

/// Per-row statistics kept by a norm's forward for its backward.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NormStats {
    /// `1 / sqrt(mean(x^2) + eps)` (RMSNorm) or `1 / sqrt(var(x) + eps)` (LayerNorm), per row.
    pub rstd: Vec<f32>,
    /// Mean per row; LayerNorm only.
    pub mean: Option<Vec<f32>>,
}

impl NormStats {
    /// Bytes held (4 per stored f32).
    pub fn bytes(&self) -> usize {
        4 * (self.rstd.len() + self.mean.as_ref().map_or(0, |m| m.len()))
    }

    /// Error unless these are the stats of `rows` rows of a `kind` norm.
    pub(crate) fn check(&self, name: &str, rows: usize, kind: Normalization) -> Result<()> {
        check_len(&format!("{name}.rstd"), &self.rstd, rows)?;
        match (kind, &self.mean) {
            (Normalization::LayerNorm, Some(m)) => check_len(&format!("{name}.mean"), m, rows),
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

/// Shared argument checks of the norms (also used by `ops::gated_norm`): `dim > 0`, `w` of `dim`
/// values, `b` present (`dim` values) exactly for LayerNorm.
pub(crate) fn check_norm_params(
    op: &str,
    dim: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
) -> Result<()> {
    if dim == 0 {
        return Err(GdnError::Invalid(format!(
            "{op}: the normalized dimension must be > 0, got 0"
        )));
    }
    check_len(&format!("{op} weight"), w, dim)?;
    match (kind, b) {
        (Normalization::LayerNorm, Some(b)) => check_len(&format!("{op} bias"), b, dim),
        (Normalization::LayerNorm, None) => Err(GdnError::Invalid(format!(
            "{op}: LayerNorm needs a bias of {dim} values, got none"
        ))),
        (Normalization::RMSNorm, None) => Ok(()),
        (Normalization::RMSNorm, Some(_)) => Err(GdnError::Invalid(format!(
            "{op}: RMSNorm takes no bias, got one"
        ))),
    }
}

/// Error unless `eps` is finite and `>= 0`.
pub(crate) fn check_eps(op: &str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(GdnError::Invalid(format!(
            "{op}: eps must be finite and >= 0, got {eps}"
        )));
    }
    Ok(())
}

/// Per-row statistics kept by a norm's forward on the GPU (fp32), the device twin of
/// [`NormStats`].
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
    pub fn download(&self) -> Result<NormStats> {
        let gpu = self.rstd.gpu();
        Ok(NormStats {
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

/// Norm statistics on either side (what the layer keeps).
pub enum Stats {
    Host(NormStats),
    Dev(GpuNormStats),
}

impl Stats {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Stats::Host(s) => s.bytes(),
            Stats::Dev(s) => s.rstd.bytes() + s.mean.as_ref().map_or(0, |m| m.bytes()),
        }
    }
}

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stats({} bytes)", self.bytes())
    }
}

/// Push the per-row means of `stats`, or a null pointer (RMSNorm).
pub(crate) fn arg_mean<'a, 'b: 'a>(l: &mut LaunchArgs<'a>, stats: &'b GpuNormStats) {
    match &stats.mean {
        Some(m) => l.arg(&m.slice),
        None => l.arg(&NULL_PTR),
    };
}

/// Device parameter checks of the norms: `dim > 0` (and a 32-bit int), `w` of `dim` values, `b`
/// present exactly for LayerNorm, all on `gpu`.
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

// ---- CPU row helpers ----

/// The gain `w`, or `1 + w` when zero-centered.
pub(crate) fn gain(w: &[f32], zero_centered: bool) -> Vec<f32> {
    w.iter()
        .map(|&v| if zero_centered { 1.0 + v } else { v })
        .collect()
}

/// `(mean, rstd)` of one row (mean is 0 for RMSNorm). Sums run left to right in f32.
pub(crate) fn row_stats(x: &[f32], kind: Normalization, eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    match kind {
        Normalization::RMSNorm => {
            let ss: f32 = x.iter().map(|v| v * v).sum();
            (0.0, 1.0 / (ss / n + eps).sqrt())
        }
        Normalization::LayerNorm => {
            let mean = x.iter().sum::<f32>() / n;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            (mean, 1.0 / (var + eps).sqrt())
        }
    }
}

/// `y = (x - mean) * rstd * g (+ b)` for one row.
#[inline]
pub(crate) fn row_forward(
    x: &[f32],
    g: &[f32],
    b: Option<&[f32]>,
    mean: f32,
    rstd: f32,
    y: &mut [f32],
) {
    match b {
        Some(b) => {
            for i in 0..x.len() {
                y[i] = (x[i] - mean) * rstd * g[i] + b[i];
            }
        }
        None => {
            for i in 0..x.len() {
                y[i] = (x[i] - mean) * rstd * g[i];
            }
        }
    }
}

/// Backward of one row given `dy` of the norm's output: writes `dx` and adds `dy * xhat` into
/// `dw` and, for LayerNorm (`layer`), `dy` into `db`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn row_backward(
    x: &[f32],
    g: &[f32],
    layer: bool,
    mean: f32,
    rstd: f32,
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    let n = x.len() as f32;
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    for i in 0..x.len() {
        let xhat = (x[i] - mean) * rstd;
        let dxhat = dy[i] * g[i];
        s1 += dxhat;
        s2 += dxhat * xhat;
        dw[i] += dy[i] * xhat;
    }
    let m1 = if layer { s1 / n } else { 0.0 };
    let m2 = s2 / n;
    for i in 0..x.len() {
        let xhat = (x[i] - mean) * rstd;
        dx[i] = rstd * (dy[i] * g[i] - m1 - xhat * m2);
    }
    if layer {
        for i in 0..x.len() {
            db[i] += dy[i];
        }
    }
}
