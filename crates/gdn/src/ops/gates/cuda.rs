//! CUDA gates (kernels in `gates.cu`): the same signatures as [`super::gates_forward`],
//! [`super::gates_backward`], [`super::gates2_forward`], [`super::gates2_backward`],
//! [`super::sigmoid_forward`] and [`super::sigmoid_backward`] on device buffers.
//!
//! Logits (`a`, `b`, `f`), `beta` and their gradients are [`DBuf`] of one dtype; the log decay `g`
//! and its gradient `dg` are fp32 [`GBuf`] (as FLA keeps `g`), as are `A_log`, `dt_bias` and their
//! gradients. Math fp32. `dA_log`, `ddt_bias` are two-stage, fixed-order sums over rows (chunks of
//! [`crate::ops::REDUCE_BLOCK`] rows, then chunks in order), no atomics.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use crate::backend::cuda::{DBuf, GBuf, Gpu};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, check_part_dims, chunks, elem_cfg, int, kernel,
    launch, lin_cfg, part_cfg,
};
use crate::error::{GdnError, Result};

const MODULE: &str = "gates";

/// Checks of the decay: `x` `[rows, cols]`, `A_log` `[cols / group]`, `dt_bias` `[cols]`.
#[allow(clippy::too_many_arguments)]
fn check_decay(
    op: &str,
    xname: &str,
    x: &DBuf,
    rows: usize,
    cols: usize,
    group: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
) -> Result<()> {
    int(&format!("{op} columns"), cols)?;
    check_d(xname, x, rows.saturating_mul(cols), x.dtype())?;
    check_g("A_log", a_log, cols / group)?;
    check_g("dt_bias", dt_bias, cols)?;
    check_gpu("A_log", x.gpu(), a_log.gpu())?;
    check_gpu("dt_bias", x.gpu(), dt_bias.gpu())
}

fn decay_fwd(
    x: &DBuf,
    cols: usize,
    group: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    g: &mut GBuf<f32>,
) -> Result<()> {
    let gpu = x.gpu().clone();
    check_g("g", g, x.len())?;
    check_gpu("g", &gpu, g.gpu())?;
    if x.is_empty() {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "decay_fwd", x.dtype())?;
    let (n, cols_i, group_i) = (x.len() as i64, cols as i32, group as i32);
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    l.arg(&a_log.slice)
        .arg(&dt_bias.slice)
        .arg(&mut g.slice)
        .arg(&n)
        .arg(&cols_i)
        .arg(&group_i);
    launch(&mut l, elem_cfg(x.len()), "decay_fwd")
}

#[allow(clippy::too_many_arguments)]
fn decay_bwd(
    x: &DBuf,
    rows: usize,
    cols: usize,
    group: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    dg: &GBuf<f32>,
    dx: &mut DBuf,
    da_log: &mut GBuf<f32>,
    ddt: &mut GBuf<f32>,
) -> Result<()> {
    let gpu = x.gpu().clone();
    check_g("dg", dg, x.len())?;
    check_d("dx", dx, x.len(), x.dtype())?;
    check_g("dA_log", da_log, cols / group)?;
    check_g("ddt_bias", ddt, cols)?;
    for (name, g) in [
        ("dg", dg.gpu()),
        ("dx", dx.gpu()),
        ("dA_log", da_log.gpu()),
        ("ddt_bias", ddt.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    let nchunks = chunks(rows);
    check_part_dims("gates", nchunks, cols)?;
    let (rows_i, cols_i, group_i) = (rows as i64, cols as i32, group as i32);
    let mut part = gpu.uninit::<f32>((nchunks * 2 * cols).max(1))?;
    if rows > 0 {
        let f = kernel(&gpu, MODULE, "decay_bwd", x.dtype())?;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, x);
        l.arg(&a_log.slice).arg(&dt_bias.slice).arg(&dg.slice);
        arg_dm(&mut l, dx);
        l.arg(&mut part.slice)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(&group_i);
        launch(&mut l, part_cfg(nchunks, cols), "decay_bwd")?;
    }
    let f = gpu.function(MODULE, "decay_sum_parts")?;
    let nch = nchunks as i64;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&part.slice)
        .arg(&nch)
        .arg(&cols_i)
        .arg(&group_i)
        .arg(&mut da_log.slice)
        .arg(&mut ddt.slice);
    launch(&mut l, lin_cfg(cols + cols / group), "decay_sum_parts")
}

/// `base` = "sigmoid_bwd" (from y) or "sigmoid_bwd_x" (from x).
fn sig_bwd(gpu: &Arc<Gpu>, base: &str, src: &DBuf, dy: &DBuf, dx: &mut DBuf) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    let f = kernel(gpu, MODULE, base, src.dtype())?;
    let n = src.len() as i64;
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, src);
    arg_d(&mut l, dy);
    arg_dm(&mut l, dx);
    l.arg(&n);
    launch(&mut l, elem_cfg(src.len()), base)
}

fn check_gates(
    a: &DBuf,
    b: &DBuf,
    rows: usize,
    heads: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
) -> Result<()> {
    if heads == 0 {
        return Err(GdnError::Invalid("gates: heads must be > 0, got 0".into()));
    }
    check_decay(
        "gates",
        "gates a (alpha)",
        a,
        rows,
        heads,
        1,
        a_log,
        dt_bias,
    )?;
    check_d(
        "gates b (beta logits)",
        b,
        rows.saturating_mul(heads),
        a.dtype(),
    )?;
    check_gpu("gates b", a.gpu(), b.gpu())
}

/// [`gates_forward`] into caller-provided `g` and `beta`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    a: &DBuf,
    b: &DBuf,
    rows: usize,
    heads: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    g: &mut GBuf<f32>,
    beta: &mut DBuf,
) -> Result<()> {
    check_gates(a, b, rows, heads, a_log, dt_bias)?;
    decay_fwd(a, heads, 1, a_log, dt_bias, g)?;
    sigmoid_forward(b, beta)
}

/// [`gates_backward`] into caller-provided buffers.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    a: &DBuf,
    b: &DBuf,
    rows: usize,
    heads: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    dg: &GBuf<f32>,
    dbeta: &DBuf,
    da: &mut DBuf,
    db: &mut DBuf,
    da_log: &mut GBuf<f32>,
    ddt: &mut GBuf<f32>,
) -> Result<()> {
    check_gates(a, b, rows, heads, a_log, dt_bias)?;
    check_d("gates dbeta", dbeta, b.len(), b.dtype())?;
    check_d("gates db", db, b.len(), b.dtype())?;
    check_gpu("gates dbeta", a.gpu(), dbeta.gpu())?;
    check_gpu("gates db", a.gpu(), db.gpu())?;
    decay_bwd(a, rows, heads, 1, a_log, dt_bias, dg, da, da_log, ddt)?;
    // beta = sigmoid(b): db = dbeta * s (1 - s), s recomputed from b in fp32.
    sig_bwd(a.gpu(), "sigmoid_bwd_x", b, dbeta, db)
}

fn check_gates2(
    f: &DBuf,
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
) -> Result<()> {
    if key_heads == 0 || dk == 0 {
        return Err(GdnError::Invalid(format!(
            "gates2: key_heads and dk must be > 0, got key_heads={key_heads}, dk={dk}"
        )));
    }
    check_decay(
        "gates2",
        "gates2 f (decay logits)",
        f,
        rows,
        key_heads.saturating_mul(dk),
        dk,
        a_log,
        dt_bias,
    )
}

/// [`gates2_forward`] into a caller-provided `g`.
pub fn gdn2_forward(
    f: &DBuf,
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    g: &mut GBuf<f32>,
) -> Result<()> {
    check_gates2(f, rows, key_heads, dk, a_log, dt_bias)?;
    decay_fwd(f, key_heads * dk, dk, a_log, dt_bias, g)
}

/// [`gates2_backward`] into caller-provided buffers.
#[allow(clippy::too_many_arguments)]
pub fn gdn2_backward(
    f: &DBuf,
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    dg: &GBuf<f32>,
    df: &mut DBuf,
    da_log: &mut GBuf<f32>,
    ddt: &mut GBuf<f32>,
) -> Result<()> {
    check_gates2(f, rows, key_heads, dk, a_log, dt_bias)?;
    decay_bwd(
        f,
        rows,
        key_heads * dk,
        dk,
        a_log,
        dt_bias,
        dg,
        df,
        da_log,
        ddt,
    )
}

/// [`sigmoid_forward`] into a caller-provided `y`.
pub fn sigmoid_forward(x: &DBuf, y: &mut DBuf) -> Result<()> {
    check_d("sigmoid y", y, x.len(), x.dtype())?;
    let gpu = x.gpu().clone();
    check_gpu("sigmoid y", &gpu, y.gpu())?;
    if x.is_empty() {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "sigmoid_fwd", x.dtype())?;
    let n = x.len() as i64;
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    arg_dm(&mut l, y);
    l.arg(&n);
    launch(&mut l, elem_cfg(x.len()), "sigmoid_fwd")
}

/// [`sigmoid_backward`] into a caller-provided `dx`.
pub fn sigmoid_backward(y: &DBuf, dy: &DBuf, dx: &mut DBuf) -> Result<()> {
    check_d("sigmoid dy", dy, y.len(), y.dtype())?;
    check_d("sigmoid dx", dx, y.len(), y.dtype())?;
    let gpu = y.gpu().clone();
    check_gpu("sigmoid dy", &gpu, dy.gpu())?;
    check_gpu("sigmoid dx", &gpu, dx.gpu())?;
    sig_bwd(&gpu, "sigmoid_bwd", y, dy, dx)
}
