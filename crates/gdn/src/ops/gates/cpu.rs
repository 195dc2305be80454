//! CPU gates. One decay kernel serves GDN (`group = 1`: one column per head) and GDN2
//! (`group = dk`: column `j` uses `A_log[j / dk]`).

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use rayon::prelude::*;

pub(crate) use crate::ops::common::act::{sigmoid, softplus, softplus_grad};
use crate::ops::common::task_rows;
use crate::ops::REDUCE_BLOCK;

/// `-exp(A_log)` per `A_log` entry.
fn neg_a(a_log: &[f32]) -> Vec<f32> {
    a_log.iter().map(|v| -v.exp()).collect()
}

/// `g[t, j] = -exp(A_log[j / group]) * softplus(x[t, j] + dt_bias[j])` over `x` `[rows, cols]`.
pub(crate) fn decay_forward(
    x: &[f32],
    cols: usize,
    group: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Vec<f32> {
    let na = neg_a(a_log);
    let mut g = vec![0.0f32; x.len()];
    let tr = task_rows(cols);
    g.par_chunks_mut(tr * cols)
        .zip(x.par_chunks(tr * cols))
        .for_each(|(gb, xb)| {
            for (gr, xr) in gb.chunks_mut(cols).zip(xb.chunks(cols)) {
                for j in 0..cols {
                    gr[j] = na[j / group] * softplus(xr[j] + dt_bias[j]);
                }
            }
        });
    g
}

/// Backward of [`decay_forward`]: `(dx, dA_log, ddt_bias)`.
pub(crate) fn decay_backward(
    x: &[f32],
    cols: usize,
    group: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    dg: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let na = neg_a(a_log);
    let heads = a_log.len();
    let mut dx = vec![0.0f32; x.len()];
    let blk = REDUCE_BLOCK * cols;
    // per block of REDUCE_BLOCK rows: partial [dA_log (heads) | ddt_bias (cols)], rows in order
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(blk)
        .zip(x.par_chunks(blk))
        .zip(dg.par_chunks(blk))
        .map(|((dxb, xb), dgb)| {
            let mut p = vec![0.0f32; heads + cols];
            let (pa, pd) = p.split_at_mut(heads);
            for ((dxr, xr), dgr) in dxb
                .chunks_mut(cols)
                .zip(xb.chunks(cols))
                .zip(dgb.chunks(cols))
            {
                for j in 0..cols {
                    let h = j / group;
                    let v = xr[j] + dt_bias[j];
                    let g = na[h] * softplus(v);
                    let d = na[h] * softplus_grad(v) * dgr[j];
                    dxr[j] = d;
                    pa[h] += g * dgr[j];
                    pd[j] += d;
                }
            }
            p
        })
        .collect();
    let mut acc = vec![0.0f32; heads + cols];
    for p in &partials {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v;
        }
    }
    let ddt = acc.split_off(heads);
    (dx, acc, ddt)
}

/// Elementwise sigmoid.
pub fn sigmoid_forward(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    y.par_chunks_mut(16384)
        .zip(x.par_chunks(16384))
        .for_each(|(yb, xb)| {
            for (y, x) in yb.iter_mut().zip(xb) {
                *y = sigmoid(*x);
            }
        });
    y
}

/// `dx = dy * y * (1 - y)`.
///
/// # Panics
/// If `y` and `dy` differ in length.
pub fn sigmoid_backward(y: &[f32], dy: &[f32]) -> Vec<f32> {
    assert_eq!(
        y.len(),
        dy.len(),
        "sigmoid_backward: y has {} values, dy {}",
        y.len(),
        dy.len()
    );
    let mut dx = vec![0.0f32; y.len()];
    dx.par_chunks_mut(16384)
        .zip(y.par_chunks(16384))
        .zip(dy.par_chunks(16384))
        .for_each(|((db, yb), gb)| {
            for ((d, y), g) in db.iter_mut().zip(yb).zip(gb) {
                *d = g * y * (1.0 - y);
            }
        });
    dx
}

/// `dx = dy * s * (1 - s)` with `s = sigmoid(x)` recomputed (same bits as through
/// [`sigmoid_forward`]).
pub(crate) fn sigmoid_backward_from_x(x: &[f32], dy: &[f32]) -> Vec<f32> {
    sigmoid_backward(&sigmoid_forward(x), dy)
}

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

fn check_gates(
    a: &[f32],
    b: &[f32],
    rows: usize,
    heads: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<()> {
    if heads == 0 {
        return Err(GdnError::Invalid("gates: heads must be > 0, got 0".into()));
    }
    check_len("gates a (alpha)", a, rows.saturating_mul(heads))?;
    check_len("gates b (beta logits)", b, rows.saturating_mul(heads))?;
    check_len("A_log", a_log, heads)?;
    check_len("dt_bias", dt_bias, heads)
}

/// GDN gates: from `a`, `b` `[rows, heads]`, `A_log` and `dt_bias` `[heads]`, returns the log
/// decay `g` and `beta`, both `[rows, heads]`.
pub fn forward(
    a: &[f32],
    b: &[f32],
    rows: usize,
    heads: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    check_gates(a, b, rows, heads, a_log, dt_bias)?;
    let g = decay_forward(a, heads, 1, a_log, dt_bias);
    Ok((g, sigmoid_forward(b)))
}

/// Backward of [`forward`]: returns `da`, `db` `[rows, heads]`, `dA_log` and `ddt_bias`
/// `[heads]`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn backward(
    a: &[f32],
    b: &[f32],
    rows: usize,
    heads: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    dg: &[f32],
    dbeta: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>)> {
    check_gates(a, b, rows, heads, a_log, dt_bias)?;
    check_len("gates dg", dg, rows.saturating_mul(heads))?;
    check_len("gates dbeta", dbeta, rows.saturating_mul(heads))?;
    let (da, da_log, ddt) = decay_backward(a, heads, 1, a_log, dt_bias, dg);
    let db = sigmoid_backward_from_x(b, dbeta);
    Ok((da, db, da_log, ddt))
}

fn check_gates2(
    f: &[f32],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<()> {
    if key_heads == 0 || dk == 0 {
        return Err(GdnError::Invalid(format!(
            "gates2: key_heads and dk must be > 0, got key_heads={key_heads}, dk={dk}"
        )));
    }
    let cols = key_heads.saturating_mul(dk);
    check_len("gates2 f (decay logits)", f, rows.saturating_mul(cols))?;
    check_len("A_log", a_log, key_heads)?;
    check_len("dt_bias", dt_bias, cols)
}

/// GDN2 per-channel log decay: from `f` `[rows, key_heads*dk]`, `A_log` `[key_heads]` and
/// `dt_bias` `[key_heads*dk]`, returns `g` `[rows, key_heads*dk]`.
pub fn gdn2_forward(
    f: &[f32],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<Vec<f32>> {
    check_gates2(f, rows, key_heads, dk, a_log, dt_bias)?;
    Ok(decay_forward(f, key_heads * dk, dk, a_log, dt_bias))
}

/// Backward of [`gdn2_forward`]: returns `df` `[rows, key_heads*dk]`, `dA_log` `[key_heads]`
/// and `ddt_bias` `[key_heads*dk]`.
#[allow(clippy::type_complexity)]
pub fn gdn2_backward(
    f: &[f32],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    dg: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    check_gates2(f, rows, key_heads, dk, a_log, dt_bias)?;
    check_len("gates2 dg", dg, rows.saturating_mul(key_heads * dk))?;
    Ok(decay_backward(f, key_heads * dk, dk, a_log, dt_bias, dg))
}
