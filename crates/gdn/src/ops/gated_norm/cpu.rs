//! CPU gated norm, built on the pre-norm's row helpers.

use crate::backend::Cols;
use crate::error::{GdnError, Result};
use crate::ops::check_len;
use crate::ops::common::norm::{check_eps, check_norm_params};
use rayon::prelude::*;

use crate::config::Normalization;
use crate::ops::common::act::{silu, silu_grad};
use crate::ops::common::norm::{gain, row_backward, row_forward, row_stats, NormStats};
use crate::ops::common::task_rows;
use crate::ops::REDUCE_BLOCK;

/// See [`super::gated_norm_forward`]; arguments are validated.
#[allow(clippy::too_many_arguments)]
fn gated_norm_forward_unchecked(
    o: &[f32],
    z: &[f32],
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> (Vec<f32>, NormStats) {
    let rows = o.len() / dv;
    let g = gain(w, zero_centered);
    let mut y = vec![0.0f32; o.len()];
    let mut rstd = vec![0.0f32; rows];
    let mut mean = vec![0.0f32; rows];
    let tr = task_rows(dv);
    y.par_chunks_mut(tr * dv)
        .zip(rstd.par_chunks_mut(tr))
        .zip(mean.par_chunks_mut(tr))
        .zip(o.par_chunks(tr * dv))
        .zip(z.par_chunks(tr * dv))
        .for_each(|((((yb, rb), mb), ob), zb)| {
            for r in 0..rb.len() {
                let s = r * dv..(r + 1) * dv;
                let (m, sd) = row_stats(&ob[s.clone()], kind, eps);
                let yr = &mut yb[s.clone()];
                row_forward(&ob[s.clone()], &g, b, m, sd, yr);
                for (y, z) in yr.iter_mut().zip(&zb[s]) {
                    *y *= silu(*z);
                }
                rb[r] = sd;
                mb[r] = m;
            }
        });
    let mean = (kind == Normalization::LayerNorm).then_some(mean);
    (y, NormStats { rstd, mean })
}

/// See [`super::gated_norm_backward`]; arguments are validated.
#[allow(clippy::too_many_arguments)]
fn gated_norm_backward_unchecked(
    o: &[f32],
    z: &[f32],
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    zero_centered: bool,
    stats: &NormStats,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let layer = kind == Normalization::LayerNorm;
    let g = gain(w, zero_centered);
    let mean = stats.mean.as_deref();
    let mut d_o = vec![0.0f32; o.len()];
    let mut dz = vec![0.0f32; o.len()];
    let blk = REDUCE_BLOCK * dv;
    // per block of REDUCE_BLOCK rows: partial [dw | db], rows in order
    let partials: Vec<Vec<f32>> = d_o
        .par_chunks_mut(blk)
        .zip(dz.par_chunks_mut(blk))
        .zip(o.par_chunks(blk))
        .zip(z.par_chunks(blk))
        .zip(dy.par_chunks(blk))
        .enumerate()
        .map(|(bi, ((((dob, dzb), ob), zb), dyb))| {
            let mut p = vec![0.0f32; 2 * dv];
            let (pw, pb) = p.split_at_mut(dv);
            let mut n = vec![0.0f32; dv]; // norm(o) of the row, then d norm(o)
            for r in 0..ob.len() / dv {
                let row = bi * REDUCE_BLOCK + r;
                let s = r * dv..(r + 1) * dv;
                let (m, sd) = (mean.map_or(0.0, |m| m[row]), stats.rstd[row]);
                let (or, zr, dyr) = (&ob[s.clone()], &zb[s.clone()], &dyb[s.clone()]);
                row_forward(or, &g, b, m, sd, &mut n);
                let dzr = &mut dzb[s.clone()];
                for i in 0..dv {
                    dzr[i] = dyr[i] * n[i] * silu_grad(zr[i]);
                    n[i] = dyr[i] * silu(zr[i]);
                }
                row_backward(or, &g, layer, m, sd, &n, &mut dob[s], pw, pb);
            }
            p
        })
        .collect();
    let mut acc = vec![0.0f32; 2 * dv];
    for p in &partials {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v;
        }
    }
    let db = acc.split_off(dv);
    (d_o, dz, acc, layer.then_some(db))
}

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

/// Forward over `o`, `z` `[rows, dv]` with weight `w` `[dv]` (and bias `b` `[dv]` for LayerNorm,
/// `None` for RMSNorm): returns `y` `[rows, dv]` and the norm's per-row statistics.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    o: &[f32],
    z: &[f32],
    rows: usize,
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> Result<(Vec<f32>, NormStats)> {
    check_norm_params("gated_norm", dv, w, b, kind)?;
    check_eps("gated_norm", eps)?;
    check_len("gated_norm o", o, rows.saturating_mul(dv))?;
    check_len("gated_norm z", z, rows.saturating_mul(dv))?;
    Ok(gated_norm_forward_unchecked(
        o,
        z,
        dv,
        w,
        b,
        kind,
        eps,
        zero_centered,
    ))
}

/// Backward of [`forward`]: returns `do`, `dz` `[rows, dv]`, `dw` `[dv]` and, for
/// LayerNorm, `db` `[dv]`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn backward(
    o: &[f32],
    z: &[f32],
    rows: usize,
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    zero_centered: bool,
    stats: &NormStats,
    dy: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>)> {
    check_norm_params("gated_norm", dv, w, b, kind)?;
    check_len("gated_norm o", o, rows.saturating_mul(dv))?;
    check_len("gated_norm z", z, rows.saturating_mul(dv))?;
    check_len("gated_norm dy", dy, rows.saturating_mul(dv))?;
    stats.check("gated_norm stats", rows, kind)?;
    Ok(gated_norm_backward_unchecked(
        o,
        z,
        dv,
        w,
        b,
        kind,
        zero_centered,
        stats,
        dy,
    ))
}

// ---- z read (dz written) in place in a wider buffer ----

/// Checks `zc` for `rows` rows of `dv` in a buffer of `len` values; returns heads per token.
fn check_cols(name: &str, len: usize, zc: Cols, rows: usize, dv: usize) -> Result<usize> {
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
    zc.check(name, len, rows / hpt)?;
    Ok(hpt)
}

/// The section `zc` of `z` as a dense `[tokens, zc.width]` buffer.
fn gather(z: &[f32], zc: Cols, tokens: usize) -> Vec<f32> {
    if zc.is_dense() {
        return z.to_vec();
    }
    let mut out = vec![0.0f32; tokens * zc.width];
    out.par_chunks_mut(zc.width)
        .enumerate()
        .for_each(|(t, r)| r.copy_from_slice(&z[zc.at(t, 0)..zc.at(t, zc.width)]));
    out
}

/// [`forward`] with `z` read at `zc` of a wider buffer (`zc.width / dv` heads per token).
#[allow(clippy::too_many_arguments)]
pub fn forward_cols(
    o: &[f32],
    z: &[f32],
    zc: Cols,
    rows: usize,
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    eps: f32,
    zero_centered: bool,
) -> Result<(Vec<f32>, NormStats)> {
    let hpt = check_cols("gated_norm z", z.len(), zc, rows, dv)?;
    let zd = gather(z, zc, rows / hpt);
    forward(o, &zd, rows, dv, w, b, kind, eps, zero_centered)
}

/// [`backward`] with `z` read at `zc` and `dz` written at `zc` of `dz_out` (its other columns
/// are left as they are); returns `do`, `dw` and (LayerNorm) `db`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn backward_cols(
    o: &[f32],
    z: &[f32],
    zc: Cols,
    rows: usize,
    dv: usize,
    w: &[f32],
    b: Option<&[f32]>,
    kind: Normalization,
    zero_centered: bool,
    stats: &NormStats,
    dy: &[f32],
    dz_out: &mut [f32],
) -> Result<(Vec<f32>, Vec<f32>, Option<Vec<f32>>)> {
    let hpt = check_cols("gated_norm z", z.len(), zc, rows, dv)?;
    check_cols("gated_norm dz", dz_out.len(), zc, rows, dv)?;
    let tokens = rows / hpt;
    let zd = gather(z, zc, tokens);
    let (d_o, dz, dw, db) = backward(o, &zd, rows, dv, w, b, kind, zero_centered, stats, dy)?;
    dz_out
        .par_chunks_mut(zc.ld)
        .zip(dz.par_chunks(zc.width.max(1)))
        .for_each(|(r, d)| r[zc.off..zc.off + zc.width].copy_from_slice(d));
    Ok((d_o, dw, db))
}
