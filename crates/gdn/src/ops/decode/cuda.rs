//! CUDA decode (kernels in `decode.cu`): row copies, the fused pre step (conv step + SiLU + window
//! shift + gates) and the fused decode rule (one block of 128 threads per (row, value head, 32
//! value columns); the state tile read once into registers and written once).

use crate::backend::cuda::{DBuf, DType, GBuf};
use crate::backend::launch::{
    check_d, check_g, check_gpu, dptr, i32_arg, int, launch_in_threads, ptr, suffix, Arg,
};
use crate::backend::Cols;
use crate::error::{GdnError, Result};

use super::{DecodeShape, PreCols, PreOut};

const MODULE: &str = "decode";

/// Threads of the rule's blocks and the largest `Dk` (as in `decode.cu`).
pub const RULE_THREADS: u32 = 128;
pub const RULE_MAX_DK: usize = 256;

/// Value columns per thread of the rule (a block covers 8 times as many): 4 (the default), or 8
/// when the environment variable `GDN_DECODE_COLS` is `8`.
pub fn default_cols() -> usize {
    match std::env::var("GDN_DECODE_COLS").as_deref() {
        Ok("8") => 8,
        _ => 4,
    }
}

fn copy_rows_raw(
    gpu: &std::sync::Arc<crate::backend::cuda::Gpu>,
    dt: DType,
    src: Arg,
    sc: Cols,
    dst: Arg,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let live: Vec<i32> = pairs
        .iter()
        .filter(|(s, d)| *s >= 0 && *d >= 0)
        .flat_map(|&(s, d)| [s, d])
        .collect();
    if live.is_empty() || sc.width == 0 {
        return Ok(());
    }
    let idx = gpu.upload(&live)?;
    let s = gpu.stream();
    let chunks = sc.width.div_ceil(256);
    let blocks = (live.len() / 2)
        .checked_mul(chunks)
        .ok_or_else(|| GdnError::Invalid("copy_rows: too many blocks".into()))?;
    let args = [
        src,
        Arg::I64(sc.ld as i64),
        Arg::I64(sc.off as i64),
        dst,
        Arg::I64(dc.ld as i64),
        Arg::I64(dc.off as i64),
        Arg::I64(sc.width as i64),
        ptr(&idx, s),
        Arg::I64(chunks as i64),
    ];
    launch_in_threads(
        gpu,
        MODULE,
        &format!("copy_rows_{}", suffix(dt)),
        blocks,
        256,
        0,
        &args,
    )
}

/// Row copies between activations of one storage type (pairs checked by the entry).
pub(crate) fn copy_rows_d(
    src: &DBuf,
    sc: Cols,
    dst: &mut DBuf,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let gpu = src.gpu().clone();
    check_gpu("copy_rows destination", &gpu, dst.gpu())?;
    if src.dtype() != dst.dtype() {
        return Err(GdnError::Invalid(
            "copy_rows: source and destination storage types differ".into(),
        ));
    }
    let s = gpu.stream();
    copy_rows_raw(&gpu, src.dtype(), dptr(src, s), sc, dptr(dst, s), dc, pairs)
}

/// Row copies between fp32 buffers (pairs checked by the entry).
pub(crate) fn copy_rows_g(
    src: &GBuf<f32>,
    sc: Cols,
    dst: &mut GBuf<f32>,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let gpu = src.gpu().clone();
    check_gpu("copy_rows destination", &gpu, dst.gpu())?;
    let s = gpu.stream();
    copy_rows_raw(&gpu, DType::F32, ptr(src, s), sc, ptr(dst, s), dc, pairs)
}

fn dev<'a>(x: &'a crate::backend::F32s, name: &str, len: usize) -> Result<&'a GBuf<f32>> {
    match x {
        crate::backend::F32s::Dev(g) => {
            check_g(name, g, len)?;
            Ok(g)
        }
        crate::backend::F32s::Host(_) => Err(crate::backend::mixed("decode")),
    }
}

/// The pre step on device buffers. `slots` is trusted for bounds by the kernel (a slot outside
/// `[0, nslots)` is padding); distinctness is the caller's (the layer checks the host copy).
#[allow(clippy::too_many_arguments)]
pub fn pre(
    proj: &DBuf,
    cols: &PreCols,
    conv: &mut DBuf,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    conv_w: &GBuf<f32>,
    conv_b: Option<&GBuf<f32>>,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
) -> Result<PreOut> {
    let gpu = proj.gpu().clone();
    let n = slots.len();
    let (qk, vd, cd, w) = (s.qk(), s.vd(), s.conv_dim(), s.width);
    let ngates = if s.gdn2 { 3 } else { 2 };
    if cols.gates.len() != ngates || cols.qkv.width != cd || cols.qkv.ld != cols.gates[0].ld {
        return Err(GdnError::Invalid(format!(
            "decode pre: expected a [q|k|v] section of {cd} columns and {ngates} gate sections of one buffer"
        )));
    }
    cols.qkv.check("decode pre: proj", proj.len(), n)?;
    for c in &cols.gates {
        c.check("decode pre: proj", proj.len(), n)?;
    }
    check_d(
        "decode pre: conv",
        conv,
        nslots * (w - 1) * cd,
        proj.dtype(),
    )?;
    check_g("conv1d.weight", conv_w, cd * w)?;
    if let Some(b) = conv_b {
        check_g("conv1d.bias", b, cd)?;
    }
    let (na, nd) = if s.gdn2 { (s.hk, qk) } else { (s.hv, s.hv) };
    check_g("A_log", a_log, na)?;
    check_g("dt_bias", dt_bias, nd)?;
    for (name, g) in [
        ("conv", conv.gpu()),
        ("slots", slots.gpu()),
        ("conv1d.weight", conv_w.gpu()),
        ("A_log", a_log.gpu()),
        ("dt_bias", dt_bias.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    int("decode pre: in_proj columns", cols.qkv.ld)?;
    int("decode pre: slots", nslots)?;
    let (gl0, gl1, gl2) = s.gate_lens();
    let (q, k, v) = (
        gpu.uninit(n * qk)?,
        gpu.uninit(n * qk)?,
        gpu.uninit(n * vd)?,
    );
    let (g, b) = (gpu.uninit(n * gl0)?, gpu.uninit(n * gl1)?);
    let wg: Option<GBuf<f32>> = if s.gdn2 {
        Some(gpu.uninit(n * gl2)?)
    } else {
        None
    };
    let gw = if s.gdn2 { 2 * qk + vd } else { 2 * s.hv };
    let chunks = (cd + gw).div_ceil(256);
    let st = gpu.stream();
    let g2 = cols.gates.get(2).map_or(0, |c| c.off);
    let args = [
        dptr(proj, st),
        Arg::I64(cols.qkv.ld as i64),
        i32_arg(cols.qkv.off),
        i32_arg(cols.gates[0].off),
        i32_arg(cols.gates[1].off),
        i32_arg(g2),
        dptr(conv, st),
        ptr(slots, st),
        i32_arg(nslots),
        ptr(conv_w, st),
        conv_b.map_or(Arg::Ptr(0), |b| ptr(b, st)),
        i32_arg(conv_b.is_some() as usize),
        ptr(a_log, st),
        ptr(dt_bias, st),
        ptr(&q, st),
        ptr(&k, st),
        ptr(&v, st),
        ptr(&g, st),
        ptr(&b, st),
        wg.as_ref().map_or(Arg::Ptr(0), |w| ptr(w, st)),
        i32_arg(s.hk),
        i32_arg(s.hv),
        i32_arg(s.dk),
        i32_arg(s.dv),
        i32_arg(w),
        i32_arg(s.gdn2 as usize),
        Arg::I64(chunks as i64),
    ];
    launch_in_threads(
        &gpu,
        MODULE,
        &format!("decode_pre_{}", suffix(proj.dtype())),
        n * chunks,
        256,
        0,
        &args,
    )?;
    use crate::backend::F32s::Dev;
    Ok(PreOut {
        q: Dev(q),
        k: Dev(k),
        v: Dev(v),
        g: Dev(g),
        b: Dev(b),
        w: wg.map(Dev),
    })
}

/// Rows of the state each thread of the rule holds: `ceil(Dk / 16)` rounded up to a power of two.
pub fn rule_rows(dk: usize) -> Result<usize> {
    if dk == 0 || dk > RULE_MAX_DK {
        return Err(GdnError::Invalid(format!(
            "decode rule: the CUDA kernel takes key heads of 1..={RULE_MAX_DK} dims, got {dk}"
        )));
    }
    Ok(dk.div_ceil(16).next_power_of_two())
}

/// The rule on device buffers: `state` `[nslots, Hv, Dk, Dv]` updated in place, `o`
/// `[n, Hv Dv]` written (every element); [`default_cols`] value columns per thread.
pub fn rule(
    x: &PreOut,
    state: &mut GBuf<f32>,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    scale: f32,
    o: &mut DBuf,
) -> Result<()> {
    rule_with(x, state, slots, nslots, s, scale, o, default_cols())
}

/// [`rule`] with `cols` (4 or 8) value columns per thread (tests, benchmarks).
#[allow(clippy::too_many_arguments)]
pub fn rule_with(
    x: &PreOut,
    state: &mut GBuf<f32>,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    scale: f32,
    o: &mut DBuf,
    cols: usize,
) -> Result<()> {
    if cols != 4 && cols != 8 {
        return Err(GdnError::Invalid(format!(
            "decode rule: {cols} value columns per thread; the kernels take 4 or 8"
        )));
    }
    let gpu = state.gpu().clone();
    let n = slots.len();
    let (qk, vd) = (s.qk(), s.vd());
    let (gl0, gl1, gl2) = s.gate_lens();
    let q = dev(&x.q, "q", n * qk)?;
    let k = dev(&x.k, "k", n * qk)?;
    let v = dev(&x.v, "v", n * vd)?;
    let g = dev(&x.g, "g", n * gl0)?;
    let b = dev(&x.b, "b", n * gl1)?;
    let w = match (&x.w, s.gdn2) {
        (Some(w), true) => Some(dev(w, "w", n * gl2)?),
        (None, false) => None,
        _ => {
            return Err(GdnError::Invalid(
                "decode rule: the write gate w is GDN2's (and only GDN2's)".into(),
            ))
        }
    };
    check_g("state", state, nslots * s.state_len())?;
    check_d("o", o, n * vd, o.dtype())?;
    for (name, gg) in [
        ("q", q.gpu()),
        ("k", k.gpu()),
        ("v", v.gpu()),
        ("g", g.gpu()),
        ("b", b.gpu()),
        ("slots", slots.gpu()),
        ("o", o.gpu()),
    ] {
        check_gpu(name, &gpu, gg)?;
    }
    let rows = rule_rows(s.dk)?;
    int("decode rule: slots", nslots)?;
    let vtiles = s.dv.div_ceil(8 * cols);
    let blocks = n
        .checked_mul(s.hv)
        .and_then(|x| x.checked_mul(vtiles))
        .ok_or_else(|| GdnError::Invalid("decode rule: too many blocks".into()))?;
    let st = gpu.stream();
    let args = [
        ptr(q, st),
        ptr(k, st),
        ptr(v, st),
        ptr(g, st),
        ptr(b, st),
        w.map_or(Arg::Ptr(0), |w| ptr(w, st)),
        ptr(state, st),
        ptr(slots, st),
        i32_arg(nslots),
        dptr(o, st),
        i32_arg(s.hk),
        i32_arg(s.hv),
        i32_arg(s.dk),
        i32_arg(s.dv),
        Arg::F32(scale),
        i32_arg(s.l2norm as usize),
        i32_arg(s.gdn2 as usize),
    ];
    launch_in_threads(
        &gpu,
        MODULE,
        &format!("decode_rule_r{rows}_c{cols}_{}", suffix(o.dtype())),
        blocks,
        RULE_THREADS,
        0,
        &args,
    )
}
