//! Device-neutral buffers and op dispatch for the layer. The layer is written once against these
//! functions; each one runs the op's CPU implementation on host buffers and its CUDA
//! implementation on device buffers (same signature, same semantics, see `ops/<op>/`).

// Op signatures mirror the kernels: many scalar dimensions.
#![allow(clippy::too_many_arguments)]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::config::Normalization;
use crate::backend::cuda::{DBuf, GBuf, Gpu};
use crate::error::{GdnError, Result};
use crate::ops::gated_delta_rule::{self as gdr, RuleOpts, RuleShape};
use crate::ops::norm::cuda::GpuNormStats;
use crate::ops::norm::NormStats;
use crate::ops::{conv1d, gated_norm, gates, gdn2_rule, l2norm, linear, norm};
use crate::seqs::Seqs;

/// An activation: f32 on the host, or f32/bf16 storage on a GPU.
pub(crate) enum Act {
    Host(Vec<f32>),
    Dev(DBuf),
}

/// An fp32 buffer (statistics, decays, states, parameter gradients).
pub(crate) enum F32s {
    Host(Vec<f32>),
    Dev(GBuf<f32>),
}

/// A borrowed fp32 parameter.
#[derive(Clone, Copy)]
pub(crate) enum P<'a> {
    Host(&'a [f32]),
    Dev(&'a GBuf<f32>),
}

/// Norm statistics on either side.
pub(crate) enum Stats {
    Host(NormStats),
    Dev(GpuNormStats),
}

impl std::fmt::Debug for Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Act::Host(v) => write!(f, "Act::Host({} values)", v.len()),
            Act::Dev(d) => write!(f, "Act::Dev({} {:?} values)", d.len(), d.dtype()),
        }
    }
}

impl std::fmt::Debug for F32s {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            F32s::Host(v) => write!(f, "F32s::Host({} values)", v.len()),
            F32s::Dev(d) => write!(f, "F32s::Dev({} values)", d.len()),
        }
    }
}

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stats({} bytes)", self.bytes())
    }
}

fn host_f32(x: Option<&F32s>) -> Result<Option<&[f32]>> {
    match x {
        None => Ok(None),
        Some(F32s::Host(h)) => Ok(Some(h.as_slice())),
        Some(_) => Err(mixed("rule")),
    }
}

fn dev_f32(x: Option<&F32s>) -> Result<Option<&GBuf<f32>>> {
    match x {
        None => Ok(None),
        Some(F32s::Dev(h)) => Ok(Some(h)),
        Some(_) => Err(mixed("rule")),
    }
}

fn mixed(op: &str) -> GdnError {
    GdnError::Device(format!(
        "{op}: host and device buffers mixed (internal error)"
    ))
}

impl Act {
    pub fn bytes(&self) -> usize {
        match self {
            Act::Host(v) => 4 * v.len(),
            Act::Dev(d) => d.bytes(),
        }
    }
    pub fn into_host(self) -> Result<Vec<f32>> {
        match self {
            Act::Host(v) => Ok(v),
            Act::Dev(d) => d.download(),
        }
    }
}

impl F32s {
    pub fn bytes(&self) -> usize {
        match self {
            F32s::Host(v) => 4 * v.len(),
            F32s::Dev(d) => d.bytes(),
        }
    }
    pub fn into_host(self) -> Result<Vec<f32>> {
        match self {
            F32s::Host(v) => Ok(v),
            F32s::Dev(d) => d.gpu().download(&d),
        }
    }
}

impl Stats {
    pub fn bytes(&self) -> usize {
        match self {
            Stats::Host(s) => s.bytes(),
            Stats::Dev(s) => s.rstd.bytes() + s.mean.as_ref().map_or(0, |m| m.bytes()),
        }
    }
}

fn host<'a>(p: Option<P<'a>>, op: &str) -> Result<Option<&'a [f32]>> {
    match p {
        None => Ok(None),
        Some(P::Host(h)) => Ok(Some(h)),
        Some(P::Dev(_)) => Err(mixed(op)),
    }
}

fn dev<'a>(p: Option<P<'a>>, op: &str) -> Result<Option<&'a GBuf<f32>>> {
    match p {
        None => Ok(None),
        Some(P::Dev(d)) => Ok(Some(d)),
        Some(P::Host(_)) => Err(mixed(op)),
    }
}

#[allow(clippy::too_many_arguments)]
pub fn norm_fwd(
    x: &Act,
    rows: usize,
    dim: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    eps: f32,
    zc: bool,
) -> Result<(Act, Stats)> {
    match (x, w) {
        (Act::Host(x), P::Host(w)) => {
            let (y, s) = norm::norm_forward(x, rows, dim, w, host(b, "norm")?, kind, eps, zc)?;
            Ok((Act::Host(y), Stats::Host(s)))
        }
        (Act::Dev(x), P::Dev(w)) => {
            let (y, s) = norm::cuda::norm_forward(x, rows, dim, w, dev(b, "norm")?, kind, eps, zc)?;
            Ok((Act::Dev(y), Stats::Dev(s)))
        }
        _ => Err(mixed("norm")),
    }
}

#[allow(clippy::too_many_arguments)]
pub fn norm_bwd(
    x: &Act,
    rows: usize,
    dim: usize,
    w: P,
    kind: Normalization,
    zc: bool,
    stats: &Stats,
    dy: &Act,
) -> Result<(Act, F32s, Option<F32s>)> {
    match (x, w, stats, dy) {
        (Act::Host(x), P::Host(w), Stats::Host(s), Act::Host(dy)) => {
            let (dx, dw, db) = norm::norm_backward(x, rows, dim, w, kind, zc, s, dy)?;
            Ok((Act::Host(dx), F32s::Host(dw), db.map(F32s::Host)))
        }
        (Act::Dev(x), P::Dev(w), Stats::Dev(s), Act::Dev(dy)) => {
            let (dx, dw, db) = norm::cuda::norm_backward(x, rows, dim, w, kind, zc, s, dy)?;
            Ok((Act::Dev(dx), F32s::Dev(dw), db.map(F32s::Dev)))
        }
        _ => Err(mixed("norm backward")),
    }
}

pub fn linear_fwd(x: &Act, rows: usize, in_dim: usize, w: P, out_dim: usize) -> Result<Act> {
    match (x, w) {
        (Act::Host(x), P::Host(w)) => Ok(Act::Host(linear::linear_forward(
            x, rows, in_dim, w, out_dim,
        )?)),
        (Act::Dev(x), P::Dev(w)) => Ok(Act::Dev(linear::cuda::linear_forward(
            x, rows, in_dim, w, out_dim,
        )?)),
        _ => Err(mixed("linear")),
    }
}

pub fn linear_bwd(
    x: &Act,
    rows: usize,
    in_dim: usize,
    w: P,
    out_dim: usize,
    dy: &Act,
) -> Result<(Act, F32s)> {
    match (x, w, dy) {
        (Act::Host(x), P::Host(w), Act::Host(dy)) => {
            let (dx, dw) = linear::linear_backward(x, rows, in_dim, w, out_dim, dy)?;
            Ok((Act::Host(dx), F32s::Host(dw)))
        }
        (Act::Dev(x), P::Dev(w), Act::Dev(dy)) => {
            let (dx, dw) = linear::cuda::linear_backward(x, rows, in_dim, w, out_dim, dy)?;
            Ok((Act::Dev(dx), F32s::Dev(dw)))
        }
        _ => Err(mixed("linear backward")),
    }
}

pub fn conv_fwd(
    x: &Act,
    ch: usize,
    w: P,
    width: usize,
    bias: Option<P>,
    seqs: &Seqs,
) -> Result<Act> {
    match (x, w) {
        (Act::Host(x), P::Host(w)) => Ok(Act::Host(conv1d::conv1d_silu_forward(
            x,
            ch,
            w,
            width,
            host(bias, "conv1d")?,
            seqs,
        )?)),
        (Act::Dev(x), P::Dev(w)) => Ok(Act::Dev(conv1d::cuda::conv1d_silu_forward(
            x,
            ch,
            w,
            width,
            dev(bias, "conv1d")?,
            seqs,
        )?)),
        _ => Err(mixed("conv1d")),
    }
}

#[allow(clippy::too_many_arguments)]
pub fn conv_bwd(
    x: &Act,
    ch: usize,
    w: P,
    width: usize,
    bias: Option<P>,
    seqs: &Seqs,
    dy: &Act,
) -> Result<(Act, F32s, Option<F32s>)> {
    match (x, w, dy) {
        (Act::Host(x), P::Host(w), Act::Host(dy)) => {
            let (dx, dw, db) =
                conv1d::conv1d_silu_backward(x, ch, w, width, host(bias, "conv1d")?, seqs, dy)?;
            Ok((Act::Host(dx), F32s::Host(dw), db.map(F32s::Host)))
        }
        (Act::Dev(x), P::Dev(w), Act::Dev(dy)) => {
            let (dx, dw, db) = conv1d::cuda::conv1d_silu_backward(
                x,
                ch,
                w,
                width,
                dev(bias, "conv1d")?,
                seqs,
                dy,
            )?;
            Ok((Act::Dev(dx), F32s::Dev(dw), db.map(F32s::Dev)))
        }
        _ => Err(mixed("conv1d backward")),
    }
}

pub fn l2norm_fwd(x: &Act, rows: usize, dim: usize) -> Result<Act> {
    match x {
        Act::Host(x) => Ok(Act::Host(l2norm::l2norm_forward(x, rows, dim)?.0)),
        Act::Dev(x) => Ok(Act::Dev(l2norm::cuda::l2norm_forward(x, rows, dim)?.0)),
    }
}

pub fn l2norm_bwd(x: &Act, rows: usize, dim: usize, dy: &Act) -> Result<Act> {
    match (x, dy) {
        (Act::Host(x), Act::Host(dy)) => {
            let r = l2norm::l2norm_rstd(x, rows, dim)?;
            Ok(Act::Host(l2norm::l2norm_backward(x, rows, dim, &r, dy)?))
        }
        (Act::Dev(x), Act::Dev(dy)) => {
            let r = l2norm::cuda::l2norm_rstd(x, rows, dim)?;
            Ok(Act::Dev(l2norm::cuda::l2norm_backward(
                x, rows, dim, &r, dy,
            )?))
        }
        _ => Err(mixed("l2norm backward")),
    }
}

/// GDN gates: returns g (fp32) and beta (activation storage on the device, f32 on the host).
pub fn gates_fwd(
    alpha: &Act,
    beta_raw: &Act,
    rows: usize,
    heads: usize,
    a_log: P,
    dt: P,
) -> Result<(F32s, Act)> {
    match (alpha, beta_raw, a_log, dt) {
        (Act::Host(a), Act::Host(b), P::Host(al), P::Host(d)) => {
            let (g, beta) = gates::gates_forward(a, b, rows, heads, al, d)?;
            Ok((F32s::Host(g), Act::Host(beta)))
        }
        (Act::Dev(a), Act::Dev(b), P::Dev(al), P::Dev(d)) => {
            let (g, beta) = gates::cuda::gates_forward(a, b, rows, heads, al, d)?;
            Ok((F32s::Dev(g), Act::Dev(beta)))
        }
        _ => Err(mixed("gates")),
    }
}

/// Backward of the GDN gates: (d alpha, d beta_raw, dA_log, ddt_bias).
#[allow(clippy::too_many_arguments)]
pub fn gates_bwd(
    alpha: &Act,
    beta_raw: &Act,
    rows: usize,
    heads: usize,
    a_log: P,
    dt: P,
    dg: &F32s,
    dbeta: &Act,
) -> Result<(Act, Act, F32s, F32s)> {
    match (alpha, beta_raw, a_log, dt, dg, dbeta) {
        (Act::Host(a), Act::Host(b), P::Host(al), P::Host(d), F32s::Host(dg), Act::Host(db)) => {
            let (da, dbr, dal, ddt) = gates::gates_backward(a, b, rows, heads, al, d, dg, db)?;
            Ok((
                Act::Host(da),
                Act::Host(dbr),
                F32s::Host(dal),
                F32s::Host(ddt),
            ))
        }
        (Act::Dev(a), Act::Dev(b), P::Dev(al), P::Dev(d), F32s::Dev(dg), Act::Dev(db)) => {
            let (da, dbr, dal, ddt) =
                gates::cuda::gates_backward(a, b, rows, heads, al, d, dg, db)?;
            Ok((Act::Dev(da), Act::Dev(dbr), F32s::Dev(dal), F32s::Dev(ddt)))
        }
        _ => Err(mixed("gates backward")),
    }
}

/// GDN rule forward.
#[allow(clippy::too_many_arguments)]
pub fn rule_fwd(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    beta: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    want_final: bool,
) -> Result<(Act, Option<F32s>)> {
    match (q, k, v, g, beta) {
        (Act::Host(q), Act::Host(k), Act::Host(v), F32s::Host(g), Act::Host(b)) => {
            let h0 = match h0 {
                None => None,
                Some(F32s::Host(h)) => Some(h.as_slice()),
                Some(_) => return Err(mixed("rule")),
            };
            let (out, fin) = gdr::forward(q, k, v, g, b, seqs, s, o, h0, want_final)?;
            Ok((Act::Host(out), fin.map(F32s::Host)))
        }
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b)) => {
            let h0 = match h0 {
                None => None,
                Some(F32s::Dev(h)) => Some(h),
                Some(_) => return Err(mixed("rule")),
            };
            let gpu = q.gpu().clone();
            let (out, fin) =
                gdr::cuda::forward_cuda(&gpu, q, k, v, g, b, seqs, s, o, h0, want_final)?;
            Ok((Act::Dev(out), fin.map(F32s::Dev)))
        }
        _ => Err(mixed("rule")),
    }
}

/// Gradients of the GDN rule: dq, dk, dv, dg, dbeta, dh0.
pub type RuleBwd = (Act, Act, Act, F32s, Act, Option<F32s>);

/// GDN rule backward.
#[allow(clippy::too_many_arguments)]
pub fn rule_bwd(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    beta: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    d_o: &Act,
    d_final: Option<&F32s>,
) -> Result<RuleBwd> {
    match (q, k, v, g, beta, d_o) {
        (Act::Host(q), Act::Host(k), Act::Host(v), F32s::Host(g), Act::Host(b), Act::Host(d_o)) => {
            let r = gdr::backward(
                q,
                k,
                v,
                g,
                b,
                seqs,
                s,
                o,
                host_f32(h0)?,
                d_o,
                host_f32(d_final)?,
            )?;
            Ok((
                Act::Host(r.dq),
                Act::Host(r.dk),
                Act::Host(r.dv),
                F32s::Host(r.dg),
                Act::Host(r.dbeta),
                r.dh0.map(F32s::Host),
            ))
        }
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b), Act::Dev(d_o)) => {
            let gpu = q.gpu().clone();
            let r = gdr::cuda::backward_cuda(
                &gpu,
                q,
                k,
                v,
                g,
                b,
                seqs,
                s,
                o,
                dev_f32(h0)?,
                d_o,
                dev_f32(d_final)?,
            )?;
            Ok((
                Act::Dev(r.dq),
                Act::Dev(r.dk),
                Act::Dev(r.dv),
                F32s::Dev(r.dg),
                Act::Dev(r.dbeta),
                r.dh0.map(F32s::Dev),
            ))
        }
        _ => Err(mixed("rule backward")),
    }
}

/// GDN2 gates from in_proj's `f`, `b`, `w` sections: the per-key-channel decay (fp32) and the
/// sigmoids of the erase and write gates.
pub fn gates2_fwd(
    f: &Act,
    b: &Act,
    w: &Act,
    rows: usize,
    hk: usize,
    dk: usize,
    a_log: P,
    dt: P,
) -> Result<(F32s, Act, Act)> {
    match (f, b, w, a_log, dt) {
        (Act::Host(f), Act::Host(b), Act::Host(w), P::Host(al), P::Host(d)) => {
            let g = gates::gates2_forward(f, rows, hk, dk, al, d)?;
            Ok((
                F32s::Host(g),
                Act::Host(gates::sigmoid_forward(b)),
                Act::Host(gates::sigmoid_forward(w)),
            ))
        }
        (Act::Dev(f), Act::Dev(b), Act::Dev(w), P::Dev(al), P::Dev(d)) => {
            let g = gates::cuda::gates2_forward(f, rows, hk, dk, al, d)?;
            Ok((
                F32s::Dev(g),
                Act::Dev(gates::cuda::sigmoid_forward(b)?),
                Act::Dev(gates::cuda::sigmoid_forward(w)?),
            ))
        }
        _ => Err(mixed("gates2")),
    }
}

/// Backward of the GDN2 decay: (df, dA_log, ddt_bias).
#[allow(clippy::too_many_arguments)]
pub fn gates2_bwd(
    f: &Act,
    rows: usize,
    hk: usize,
    dk: usize,
    a_log: P,
    dt: P,
    dg: &F32s,
) -> Result<(Act, F32s, F32s)> {
    match (f, a_log, dt, dg) {
        (Act::Host(f), P::Host(al), P::Host(d), F32s::Host(dg)) => {
            let (df, dal, ddt) = gates::gates2_backward(f, rows, hk, dk, al, d, dg)?;
            Ok((Act::Host(df), F32s::Host(dal), F32s::Host(ddt)))
        }
        (Act::Dev(f), P::Dev(al), P::Dev(d), F32s::Dev(dg)) => {
            let (df, dal, ddt) = gates::cuda::gates2_backward(f, rows, hk, dk, al, d, dg)?;
            Ok((Act::Dev(df), F32s::Dev(dal), F32s::Dev(ddt)))
        }
        _ => Err(mixed("gates2 backward")),
    }
}

/// `dx = dy * y * (1 - y)` from a sigmoid's output.
pub fn sigmoid_bwd(y: &Act, dy: &Act) -> Result<Act> {
    match (y, dy) {
        (Act::Host(y), Act::Host(dy)) => {
            if y.len() != dy.len() {
                return Err(GdnError::Invalid(format!(
                    "sigmoid backward: {} values vs {}",
                    y.len(),
                    dy.len()
                )));
            }
            Ok(Act::Host(gates::sigmoid_backward(y, dy)))
        }
        (Act::Dev(y), Act::Dev(dy)) => Ok(Act::Dev(gates::cuda::sigmoid_backward(y, dy)?)),
        _ => Err(mixed("sigmoid backward")),
    }
}

/// Repeat key-head rows `[n, Hk, D]` to value heads `[n, Hv, D]` (value head j reads key head
/// j / (Hv/Hk)).
fn repeat_heads_host(x: &[f32], n: usize, hk: usize, hv: usize, d: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = Vec::with_capacity(n * hv * d);
    for t in 0..n {
        for j in 0..hv {
            let o = (t * hk + j / r) * d;
            out.extend_from_slice(&x[o..o + d]);
        }
    }
    out
}

/// Sum value-head rows `[n, Hv, D]` back to key heads `[n, Hk, D]`, the group in head order.
fn sum_heads_host(x: &[f32], n: usize, hk: usize, hv: usize, d: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = vec![0.0f32; n * hk * d];
    for t in 0..n {
        for j in 0..hv {
            let (src, dst) = ((t * hv + j) * d, (t * hk + j / r) * d);
            for c in 0..d {
                out[dst + c] += x[src + c];
            }
        }
    }
    out
}

/// Launch `layer::{name}_{sfx}` (repeat_heads / sum_heads) from `src` into `out` (`out_len`
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
fn heads_dev(
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
fn heads_g(
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

fn heads_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(GdnError::Invalid(format!(
            "{what}: expected {want} values, got {got}"
        )));
    }
    Ok(())
}

/// [`repeat_heads_host`] on either side (activations).
pub fn repeat_heads(x: &Act, n: usize, hk: usize, hv: usize, d: usize) -> Result<Act> {
    heads_len("repeat_heads", x_len(x), n * hk * d)?;
    match x {
        Act::Host(x) => Ok(Act::Host(repeat_heads_host(x, n, hk, hv, d))),
        Act::Dev(x) => Ok(Act::Dev(heads_dev(
            "repeat_heads",
            x,
            n * hv * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

/// [`sum_heads_host`] on either side (activations; fp32 sums).
pub fn sum_heads(x: &Act, n: usize, hk: usize, hv: usize, d: usize) -> Result<Act> {
    heads_len("sum_heads", x_len(x), n * hv * d)?;
    match x {
        Act::Host(x) => Ok(Act::Host(sum_heads_host(x, n, hk, hv, d))),
        Act::Dev(x) => Ok(Act::Dev(heads_dev(
            "sum_heads",
            x,
            n * hk * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

fn x_len(x: &Act) -> usize {
    match x {
        Act::Host(v) => v.len(),
        Act::Dev(d) => d.len(),
    }
}

fn f_len(x: &F32s) -> usize {
    match x {
        F32s::Host(v) => v.len(),
        F32s::Dev(d) => d.len(),
    }
}

/// [`repeat_heads`] of an fp32 buffer (the GDN2 decay).
pub fn repeat_heads_f32s(x: &F32s, n: usize, hk: usize, hv: usize, d: usize) -> Result<F32s> {
    heads_len("repeat_heads", f_len(x), n * hk * d)?;
    match x {
        F32s::Host(v) => Ok(F32s::Host(repeat_heads_host(v, n, hk, hv, d))),
        F32s::Dev(g) => Ok(F32s::Dev(heads_g(
            "repeat_heads",
            g,
            n * hv * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

/// [`sum_heads`] of an fp32 buffer (the GDN2 decay's gradient).
pub fn sum_heads_f32s(x: &F32s, n: usize, hk: usize, hv: usize, d: usize) -> Result<F32s> {
    heads_len("sum_heads", f_len(x), n * hv * d)?;
    match x {
        F32s::Host(v) => Ok(F32s::Host(sum_heads_host(v, n, hk, hv, d))),
        F32s::Dev(g) => Ok(F32s::Dev(heads_g(
            "sum_heads",
            g,
            n * hk * d,
            n,
            hk,
            hv,
            d,
        )?)),
    }
}

/// GDN2 rule forward.
#[allow(clippy::too_many_arguments)]
pub fn rule2_fwd(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    b: &Act,
    w: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    want_final: bool,
) -> Result<(Act, Option<F32s>)> {
    match (q, k, v, g, b, w) {
        (Act::Host(q), Act::Host(k), Act::Host(v), F32s::Host(g), Act::Host(b), Act::Host(w)) => {
            let (out, fin) =
                gdn2_rule::forward(q, k, v, g, b, w, seqs, s, o, host_f32(h0)?, want_final)?;
            Ok((Act::Host(out), fin.map(F32s::Host)))
        }
        (Act::Dev(q), Act::Dev(k), Act::Dev(v), F32s::Dev(g), Act::Dev(b), Act::Dev(w)) => {
            let gpu = q.gpu().clone();
            let (out, fin) = gdn2_rule::cuda::forward_cuda(
                &gpu,
                q,
                k,
                v,
                g,
                b,
                w,
                seqs,
                s,
                o,
                dev_f32(h0)?,
                want_final,
            )?;
            Ok((Act::Dev(out), fin.map(F32s::Dev)))
        }
        _ => Err(mixed("GDN2 rule")),
    }
}

/// Gradients of the GDN2 rule: dq, dk, dv, dg, db, dw, dh0.
pub type Rule2Bwd = (Act, Act, Act, F32s, Act, Act, Option<F32s>);

/// GDN2 rule backward.
#[allow(clippy::too_many_arguments)]
pub fn rule2_bwd(
    q: &Act,
    k: &Act,
    v: &Act,
    g: &F32s,
    b: &Act,
    w: &Act,
    seqs: &Seqs,
    s: RuleShape,
    o: RuleOpts,
    h0: Option<&F32s>,
    d_o: &Act,
    d_final: Option<&F32s>,
) -> Result<Rule2Bwd> {
    match (q, k, v, g, b, w, d_o) {
        (
            Act::Host(q),
            Act::Host(k),
            Act::Host(v),
            F32s::Host(g),
            Act::Host(b),
            Act::Host(w),
            Act::Host(d_o),
        ) => {
            let r = gdn2_rule::backward(
                q,
                k,
                v,
                g,
                b,
                w,
                seqs,
                s,
                o,
                host_f32(h0)?,
                d_o,
                host_f32(d_final)?,
            )?;
            Ok((
                Act::Host(r.dq),
                Act::Host(r.dk),
                Act::Host(r.dv),
                F32s::Host(r.dg),
                Act::Host(r.db),
                Act::Host(r.dw),
                r.dh0.map(F32s::Host),
            ))
        }
        (
            Act::Dev(q),
            Act::Dev(k),
            Act::Dev(v),
            F32s::Dev(g),
            Act::Dev(b),
            Act::Dev(w),
            Act::Dev(d_o),
        ) => {
            let gpu = q.gpu().clone();
            let r = gdn2_rule::cuda::backward_cuda(
                &gpu,
                q,
                k,
                v,
                g,
                b,
                w,
                seqs,
                s,
                o,
                dev_f32(h0)?,
                d_o,
                dev_f32(d_final)?,
            )?;
            Ok((
                Act::Dev(r.dq),
                Act::Dev(r.dk),
                Act::Dev(r.dv),
                F32s::Dev(r.dg),
                Act::Dev(r.db),
                Act::Dev(r.dw),
                r.dh0.map(F32s::Dev),
            ))
        }
        _ => Err(mixed("GDN2 rule backward")),
    }
}

#[allow(clippy::too_many_arguments)]
pub fn gated_norm_fwd(
    o: &Act,
    z: &Act,
    rows: usize,
    dv: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    eps: f32,
    zc: bool,
) -> Result<(Act, Stats)> {
    match (o, z, w) {
        (Act::Host(o), Act::Host(z), P::Host(w)) => {
            let (y, s) = gated_norm::gated_norm_forward(
                o,
                z,
                rows,
                dv,
                w,
                host(b, "gated norm")?,
                kind,
                eps,
                zc,
            )?;
            Ok((Act::Host(y), Stats::Host(s)))
        }
        (Act::Dev(o), Act::Dev(z), P::Dev(w)) => {
            let (y, s) = gated_norm::cuda::gated_norm_forward(
                o,
                z,
                rows,
                dv,
                w,
                dev(b, "gated norm")?,
                kind,
                eps,
                zc,
            )?;
            Ok((Act::Dev(y), Stats::Dev(s)))
        }
        _ => Err(mixed("gated norm")),
    }
}

/// Backward of the gated norm: (do, dz, dw, db).
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_bwd(
    o: &Act,
    z: &Act,
    rows: usize,
    dv: usize,
    w: P,
    b: Option<P>,
    kind: Normalization,
    zc: bool,
    stats: &Stats,
    dy: &Act,
) -> Result<(Act, Act, F32s, Option<F32s>)> {
    match (o, z, w, stats, dy) {
        (Act::Host(o), Act::Host(z), P::Host(w), Stats::Host(s), Act::Host(dy)) => {
            let (d_o, dz, dw, db) = gated_norm::gated_norm_backward(
                o,
                z,
                rows,
                dv,
                w,
                host(b, "gated norm")?,
                kind,
                zc,
                s,
                dy,
            )?;
            Ok((
                Act::Host(d_o),
                Act::Host(dz),
                F32s::Host(dw),
                db.map(F32s::Host),
            ))
        }
        (Act::Dev(o), Act::Dev(z), P::Dev(w), Stats::Dev(s), Act::Dev(dy)) => {
            let (d_o, dz, dw, db) = gated_norm::cuda::gated_norm_backward(
                o,
                z,
                rows,
                dv,
                w,
                dev(b, "gated norm")?,
                kind,
                zc,
                s,
                dy,
            )?;
            Ok((
                Act::Dev(d_o),
                Act::Dev(dz),
                F32s::Dev(dw),
                db.map(F32s::Dev),
            ))
        }
        _ => Err(mixed("gated norm backward")),
    }
}

fn launch_copy_cols(
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
    let err = |e| GdnError::Device(format!("copy_cols launch: {e:?}"));
    match (src, dst) {
        (DBuf::F32(s), DBuf::F32(d)) => {
            let f = gpu.function("layout", "copy_cols_f32")?;
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&s.slice)
                .arg(&scols)
                .arg(&s0)
                .arg(&mut d.slice)
                .arg(&dcols)
                .arg(&d0)
                .arg(&rows)
                .arg(&w);
            // SAFETY: argument types match the kernel's signature; bounds are guaranteed by the
            // callers (rows * cols of both matrices).
            unsafe { b.launch(cfg) }.map_err(err)?;
        }
        (DBuf::Bf16(s), DBuf::Bf16(d)) => {
            let f = gpu.function("layout", "copy_cols_bf16")?;
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&s.slice)
                .arg(&scols)
                .arg(&s0)
                .arg(&mut d.slice)
                .arg(&dcols)
                .arg(&d0)
                .arg(&rows)
                .arg(&w);
            // SAFETY: as above.
            unsafe { b.launch(cfg) }.map_err(err)?;
        }
        _ => return Err(GdnError::Device("copy_cols: storage types differ".into())),
    }
    Ok(())
}

/// Columns `[c0, c0+w)` of a row-major `[rows, cols]` matrix, as a new `[rows, w]` buffer.
pub fn take_cols(x: &Act, cols: usize, c0: usize, w: usize) -> Result<Act> {
    match x {
        Act::Host(x) => Ok(Act::Host(crate::tensor::take_cols(x, cols, c0, w))),
        Act::Dev(x) => {
            let rows = x.len() / cols;
            let gpu = x.gpu().clone();
            let mut out = DBuf::uninit(&gpu, rows * w, x.dtype())?;
            launch_copy_cols(&gpu, x, cols, c0, &mut out, w, 0, rows, w)?;
            Ok(Act::Dev(out))
        }
    }
}

/// A `[rows, cols]` matrix assembled from column blocks `(offset, width, buffer)` that tile it.
pub fn concat_cols(rows: usize, cols: usize, parts: &[(usize, usize, &Act)]) -> Result<Act> {
    match parts.first().map(|p| p.2) {
        None | Some(Act::Host(_)) => {
            let mut out = vec![0.0f32; rows * cols];
            for &(c0, w, a) in parts {
                let Act::Host(src) = a else {
                    return Err(mixed("concat_cols"));
                };
                crate::tensor::put_cols(&mut out, cols, c0, src, w);
            }
            Ok(Act::Host(out))
        }
        Some(Act::Dev(first)) => {
            let gpu = first.gpu().clone();
            let mut out = DBuf::uninit(&gpu, rows * cols, first.dtype())?;
            for &(c0, w, a) in parts {
                let Act::Dev(src) = a else {
                    return Err(mixed("concat_cols"));
                };
                launch_copy_cols(&gpu, src, w, 0, &mut out, cols, c0, rows, w)?;
            }
            Ok(Act::Dev(out))
        }
    }
}
