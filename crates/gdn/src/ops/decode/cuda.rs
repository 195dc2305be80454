//! CUDA decode (kernels in `decode.cu`): row copies (and the fp32 <-> bf16 ones of bf16 cache
//! states), the fused pre step (conv step + SiLU + window shift + gates) and the fused decode rule
//! (128 threads per (row, value head, 32 or 64 value columns); the state tile read once into
//! registers and written once; fp32 or bf16 states).

use crate::backend::cuda::{DBuf, DType, GBuf};
use crate::backend::launch::{
    check_d, check_g, check_gpu, dptr, i32_arg, int, launch_in_threads, launch_pdl, ptr, suffix,
    Arg,
};
use crate::backend::Cols;
use crate::error::{GdnError, Result};

use super::{DecodeShape, PreCols, PreOut};

const MODULE: &str = "decode";

/// Threads of the rule's blocks and the largest `Dk` (as in `decode.cu`).
pub const RULE_THREADS: u32 = 128;
pub const RULE_MAX_DK: usize = 256;

fn copy_rows_raw(
    gpu: &std::sync::Arc<crate::backend::cuda::Gpu>,
    kernel: &str,
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
    launch_in_threads(gpu, MODULE, kernel, blocks, 256, 0, &args)
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
    let name = format!("copy_rows_{}", suffix(src.dtype()));
    copy_rows_raw(&gpu, &name, dptr(src, s), sc, dptr(dst, s), dc, pairs)
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
    copy_rows_raw(
        &gpu,
        "copy_rows_f32",
        ptr(src, s),
        sc,
        ptr(dst, s),
        dc,
        pairs,
    )
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
    let mut out = PreOut::uninit_dev(&gpu, slots.len(), s)?;
    pre_into(
        proj, cols, conv, slots, nslots, s, conv_w, conv_b, a_log, dt_bias, &mut out, false,
    )?;
    Ok(out)
}

/// [`pre`] into caller-provided outputs `out` (made by [`PreOut::uninit_dev`] for `slots.len()`
/// rows, checked); `pdl`: the kernel `decode_pre_pdl_*` as a programmatic dependent launch
/// (`backend::launch::launch_pdl`; the same bits).
#[allow(clippy::too_many_arguments)]
pub fn pre_into(
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
    out: &mut PreOut,
    pdl: bool,
) -> Result<()> {
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
    let q = dev(&out.q, "decode pre: q", n * qk)?;
    let k = dev(&out.k, "decode pre: k", n * qk)?;
    let v = dev(&out.v, "decode pre: v", n * vd)?;
    let g = dev(&out.g, "decode pre: g", n * gl0)?;
    let b = dev(&out.b, "decode pre: b", n * gl1)?;
    let wg = match (&out.w, s.gdn2) {
        (Some(w), true) => Some(dev(w, "decode pre: w", n * gl2)?),
        (None, false) => None,
        _ => {
            return Err(GdnError::Invalid(
                "decode pre: the write gate w is GDN2's (and only GDN2's)".into(),
            ))
        }
    };
    for gg in [q, k, v, g, b].into_iter().chain(wg) {
        check_gpu("decode pre: outputs", &gpu, gg.gpu())?;
    }
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
        ptr(q, st),
        ptr(k, st),
        ptr(v, st),
        ptr(g, st),
        ptr(b, st),
        wg.map_or(Arg::Ptr(0), |w| ptr(w, st)),
        i32_arg(s.hk),
        i32_arg(s.hv),
        i32_arg(s.dk),
        i32_arg(s.dv),
        i32_arg(w),
        i32_arg(s.gdn2 as usize),
        Arg::I64(chunks as i64),
    ];
    let sfx = suffix(proj.dtype());
    if pdl {
        let name = format!("decode_pre_pdl_{sfx}");
        launch_pdl(&gpu, MODULE, &name, n * chunks, 256, 0, &args)
    } else {
        let name = format!("decode_pre_{sfx}");
        launch_in_threads(&gpu, MODULE, &name, n * chunks, 256, 0, &args)
    }
}

/// Rows of the state each thread of the rule holds: `ceil(Dk / 16)` rounded up to a power of two,
/// at least 2.
pub fn rule_rows(dk: usize) -> Result<usize> {
    if dk == 0 || dk > RULE_MAX_DK {
        return Err(GdnError::Invalid(format!(
            "decode rule: the CUDA kernel takes key heads of 1..={RULE_MAX_DK} dims, got {dk}"
        )));
    }
    Ok(dk.div_ceil(16).next_power_of_two().max(2))
}

/// Which decode rule kernel runs (every choice gives the same bits: the per-item arithmetic is
/// one code path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleKernel {
    /// One block per (row, value head, 8 `cols` value columns); `cols` 4 or 8 value columns per
    /// thread (bf16 states: 8).
    Tile { cols: usize },
    /// `grid` resident blocks (`None`: as many as fit on the GPU at once) looping over the
    /// items, the next item's state tile loading while the current one computes; fp32 states,
    /// 4 columns per thread, `Dk <= 128`.
    Pipe { grid: Option<usize> },
}

/// The kernel [`rule`] runs: `GDN_DECODE_KERNEL` = `pipe`, `tile4` or `tile8` when
/// set (and the kernel takes the shape), else (`GDN_DECODE_COLS` = 4 or 8 picks the tile width)
/// 4 columns per thread for fp32 states (the H200, 2026-12-01, after the block's chain was
/// shortened: 4 columns faster at every batch measured, 80.8 vs 82.8 us at B 64 and 284.6 vs
/// 288.9 us at B 256 with 16/32 heads; 8 had been faster before); bf16 states always 8.
pub fn default_kernel(s: &DecodeShape, state: DType) -> RuleKernel {
    let pipe_ok = state == DType::F32 && s.dk <= 128;
    match std::env::var("GDN_DECODE_KERNEL").as_deref() {
        Ok("pipe") if pipe_ok => return RuleKernel::Pipe { grid: None },
        Ok("tile4") if state == DType::F32 => return RuleKernel::Tile { cols: 4 },
        Ok("tile8") => return RuleKernel::Tile { cols: 8 },
        _ => {}
    }
    if state == DType::Bf16 {
        return RuleKernel::Tile { cols: 8 };
    }
    let cols = match std::env::var("GDN_DECODE_COLS").as_deref() {
        Ok("8") => 8,
        _ => 4,
    };
    RuleKernel::Tile { cols }
}

/// The rule on device buffers: `state` `[nslots, Hv, Dk, Dv]` (fp32 or bf16) updated in place,
/// `o` `[n, Hv Dv]` written (every element); the kernel of [`default_kernel`].
pub fn rule(
    x: &PreOut,
    state: &mut DBuf,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    scale: f32,
    o: &mut DBuf,
) -> Result<()> {
    let k = default_kernel(&s, state.dtype());
    rule_with(x, state, slots, nslots, s, scale, o, k)
}

/// [`rule`] with a given kernel (tests, benchmarks).
#[allow(clippy::too_many_arguments)]
pub fn rule_with(
    x: &PreOut,
    state: &mut DBuf,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    scale: f32,
    o: &mut DBuf,
    kernel: RuleKernel,
) -> Result<()> {
    rule_impl(x, state, slots, nslots, s, scale, o, kernel, false)
}

/// [`rule`] (the kernel of [`default_kernel`]) as a programmatic dependent launch: the tile
/// kernels' `decode_rule_pdl_*` twins (each block's state tile loaded before its
/// `griddepcontrol.wait`; per item the same code: the same bits as [`rule`]). The pipelined
/// kernel has no twin: when `GDN_DECODE_KERNEL=pipe` picks it, it runs as an ordinary launch.
#[allow(clippy::too_many_arguments)]
pub fn rule_pdl(
    x: &PreOut,
    state: &mut DBuf,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    scale: f32,
    o: &mut DBuf,
) -> Result<()> {
    let k = default_kernel(&s, state.dtype());
    rule_impl(x, state, slots, nslots, s, scale, o, k, true)
}

#[allow(clippy::too_many_arguments)]
fn rule_impl(
    x: &PreOut,
    state: &mut DBuf,
    slots: &GBuf<i32>,
    nslots: usize,
    s: DecodeShape,
    scale: f32,
    o: &mut DBuf,
    kernel: RuleKernel,
    pdl: bool,
) -> Result<()> {
    let sd = state.dtype();
    let rows = rule_rows(s.dk)?;
    match kernel {
        RuleKernel::Tile { cols } if cols != 4 && cols != 8 => {
            return Err(GdnError::Invalid(format!(
                "decode rule: {cols} value columns per thread; the kernels take 4 or 8"
            )))
        }
        RuleKernel::Tile { cols: 4 } if sd == DType::Bf16 => {
            return Err(GdnError::Invalid(
                "decode rule: bf16 states take 8 value columns per thread".into(),
            ))
        }
        RuleKernel::Pipe { .. } if sd == DType::Bf16 || rows > 8 => {
            return Err(GdnError::Invalid(format!(
                "decode rule: the pipelined kernel takes fp32 states and Dk <= 128 (got {sd:?}, Dk {})",
                s.dk
            )))
        }
        RuleKernel::Pipe { grid: Some(0) } => {
            return Err(GdnError::Invalid(
                "decode rule: a grid of 0 blocks".into(),
            ))
        }
        _ => {}
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
    check_d("state", state, nslots * s.state_len(), sd)?;
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
    int("decode rule: slots", nslots)?;
    let cols = match kernel {
        RuleKernel::Tile { cols } => cols,
        RuleKernel::Pipe { .. } => 4,
    };
    let vtiles = s.dv.div_ceil(8 * cols);
    let items = n
        .checked_mul(s.hv)
        .and_then(|x| x.checked_mul(vtiles))
        .ok_or_else(|| GdnError::Invalid("decode rule: too many blocks".into()))?;
    let st = gpu.stream();
    let mut args = vec![
        ptr(q, st),
        ptr(k, st),
        ptr(v, st),
        ptr(g, st),
        ptr(b, st),
        w.map_or(Arg::Ptr(0), |w| ptr(w, st)),
        dptr(state, st),
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
    let (os, ss) = (suffix(o.dtype()), suffix(sd));
    match kernel {
        RuleKernel::Tile { cols } if pdl => launch_pdl(
            &gpu,
            MODULE,
            &format!("decode_rule_pdl_r{rows}_c{cols}_{os}_{ss}"),
            items,
            RULE_THREADS,
            0,
            &args,
        ),
        RuleKernel::Tile { cols } => launch_in_threads(
            &gpu,
            MODULE,
            &format!("decode_rule_r{rows}_c{cols}_{os}_{ss}"),
            items,
            RULE_THREADS,
            0,
            &args,
        ),
        RuleKernel::Pipe { grid } => {
            let rows = rows.max(4);
            let name = format!("decode_rule_pipe_r{rows}_c4_{os}_{ss}");
            let grid = match grid {
                Some(gr) => gr,
                None => {
                    let f = gpu.function(MODULE, &name)?;
                    let per_sm = f
                        .occupancy_max_active_blocks_per_multiprocessor(RULE_THREADS, 0, None)
                        .map_err(|e| GdnError::Device(format!("occupancy of {name}: {e:?}")))?;
                    gpu.sm_count()?.saturating_mul(per_sm.max(1) as usize)
                }
            }
            .min(items);
            args.push(Arg::I64(items as i64));
            launch_in_threads(&gpu, MODULE, &name, grid, RULE_THREADS, 0, &args)
        }
    }
}

/// Row copies from an fp32 buffer into a state buffer (fp32 or bf16: rounded to nearest even),
/// pairs checked by the entry.
pub(crate) fn copy_rows_into_state(
    src: &GBuf<f32>,
    sc: Cols,
    dst: &mut DBuf,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let gpu = src.gpu().clone();
    check_gpu("copy_rows destination", &gpu, dst.gpu())?;
    let s = gpu.stream();
    match dst.dtype() {
        DType::F32 => copy_rows_raw(
            &gpu,
            "copy_rows_f32",
            ptr(src, s),
            sc,
            dptr(dst, s),
            dc,
            pairs,
        ),
        DType::Bf16 => copy_rows_raw(
            &gpu,
            "copy_rows_cvt_f32_bf16",
            ptr(src, s),
            sc,
            dptr(dst, s),
            dc,
            pairs,
        ),
    }
}

/// Row copies from a state buffer (fp32 or bf16) into an fp32 buffer, pairs checked by the entry.
pub(crate) fn copy_rows_from_state(
    src: &DBuf,
    sc: Cols,
    dst: &mut GBuf<f32>,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let gpu = src.gpu().clone();
    check_gpu("copy_rows destination", &gpu, dst.gpu())?;
    let s = gpu.stream();
    let name = match src.dtype() {
        DType::F32 => "copy_rows_f32",
        DType::Bf16 => "copy_rows_cvt_bf16_f32",
    };
    copy_rows_raw(&gpu, name, dptr(src, s), sc, ptr(dst, s), dc, pairs)
}
