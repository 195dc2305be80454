//! CUDA prep (kernels in `prep.cu`): [`forward`] and [`backward`] on device buffers with the
//! signatures of the op's entry. The in_proj output, `q`, `k`, `v`, their normalized copies,
//! `beta` and the activation gradients are [`DBuf`] of one dtype; `g`, `dg`, parameters and their
//! gradients fp32. Outputs are caller-provided (the GPU tests poison them to check that every
//! element is written). Parameter gradients are two-stage, fixed-order sums (per tile of tokens
//! (512 for the streaming kernels, 128 for the general ones) or chunk of
//! [`crate::ops::REDUCE_BLOCK`] rows, then in order), no atomics. The layer's shapes run the
//! streaming kernels (see [`streaming`]): one pass over the tokens forward and one backward.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{PrepCols, PrepShape};
use crate::backend::cuda::{DBuf, GBuf, Gpu};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, check_part_dims, chunks, int, kernel, launch,
    lin_cfg, part_cfg, rows_cfg, NULL_PTR, THREADS,
};
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

const MODULE: &str = "prep";

/// Tokens per tile of the general conv backward (`PREP_TT` in `prep.cu`).
const TILE: usize = 128;

/// Tokens per warp of the streaming kernels, forward and backward (`PREP_FT`, `PREP_BT`); a
/// block is [`WARPS`] warps of consecutive tokens of one head, so a partial of the weight
/// gradients covers `WARPS * BT` tokens.
const FT: usize = 32;
const BT: usize = 64;
const WARPS: usize = 8;

/// The streaming kernels (`prep_fwd_w{W}n{NC}`, `prep_bwd_w{W}n{NC}`) take conv widths 2..=4,
/// head sizes that are multiples of 4 up to 256 (`NC` = 1: up to 128, 2: up to 256), and a
/// 4-aligned row stride and qkv offset (4 values per lane per access). Other shapes run the
/// general kernels. `Some((W, NC))` when they take `s`, `c`.
fn streaming(c: PrepCols, s: PrepShape) -> Option<(usize, usize)> {
    let d = s.dk.max(s.dv);
    let ok = (2..=4).contains(&s.width)
        && s.dk.is_multiple_of(4)
        && s.dv.is_multiple_of(4)
        && d <= 256
        && c.qkv.ld.is_multiple_of(4)
        && c.qkv.off.is_multiple_of(4)
        && 2 * s.hk + s.hv <= 65535;
    ok.then_some((s.width, if d <= 128 { 1 } else { 2 }))
}

/// Widest conv kernel the CUDA path takes (as `conv1d`).
pub const MAX_WIDTH: usize = 32;

/// Dynamic shared memory of the conv backward for kernel width `w`: per-token tap bounds (int),
/// the weights `[w][32]`, x `[TILE + 2h][32]`, d(pre) `[TILE + h][32]`, the lane sums `[8][32]`.
fn bwd_smem(w: usize) -> usize {
    let h = w - 1;
    let (ns, nx) = (TILE + h, TILE + 2 * h);
    4 * (ns + TILE) + 4 * 32 * (w + nx + ns + 8)
}

/// The scalar kernel arguments both directions pass, as the kernels take them.
struct KernelDims {
    ld: i64,
    xoff: i32,
    boff: i32,
    aoff: i32,
    has_bias: i32,
    nseq: i32,
    used: i64,
    tokens: i64,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    wi: i32,
    l2: i32,
}

impl KernelDims {
    fn new(c: PrepCols, s: PrepShape, seqs: &Seqs, has_bias: bool, n: usize) -> Self {
        KernelDims {
            ld: c.qkv.ld as i64,
            xoff: c.qkv.off as i32,
            boff: c.beta.off as i32,
            aoff: c.alpha.off as i32,
            has_bias: has_bias as i32,
            nseq: seqs.count() as i32,
            used: seqs.used() as i64,
            tokens: n as i64,
            hk: s.hk as i32,
            hv: s.hv as i32,
            dk: s.dk as i32,
            dv: s.dv as i32,
            wi: s.width as i32,
            l2: s.l2norm as i32,
        }
    }
}

/// Dynamic shared memory a block may use without opting in.
const SMEM_DEFAULT: usize = 48 * 1024;

/// Forward outputs (caller-provided): `q`, `k` `[n, qk]`, `v` `[n, vd]`, normalized q, k (with
/// the norm), `g` `[n, hv]` fp32, `beta` `[n, hv]`.
pub struct Out {
    pub q: DBuf,
    pub k: DBuf,
    pub v: DBuf,
    pub qkn: Option<(DBuf, DBuf)>,
    pub g: GBuf<f32>,
    pub beta: DBuf,
}

/// The rule's gradients on the device (see [`super::PrepDy`]).
pub struct Dy<'a> {
    pub dq: &'a DBuf,
    pub dk: &'a DBuf,
    pub dv: &'a DBuf,
    pub dg: &'a GBuf<f32>,
    pub dbeta: &'a DBuf,
}

/// Parameter gradients (caller-provided): conv weight `[conv_dim, width]`, bias `[conv_dim]`
/// (with a bias), `A_log`, `dt_bias` `[hv]`.
pub struct Grads {
    pub conv_w: GBuf<f32>,
    pub conv_b: Option<GBuf<f32>>,
    pub a_log: GBuf<f32>,
    pub dt_bias: GBuf<f32>,
}

#[allow(clippy::too_many_arguments)]
fn check(
    x: &DBuf,
    c: PrepCols,
    s: PrepShape,
    w: &GBuf<f32>,
    bias: Option<&GBuf<f32>>,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    seqs: &Seqs,
) -> Result<()> {
    s.check()?;
    if s.width > MAX_WIDTH {
        return Err(GdnError::Invalid(format!(
            "prep: the CUDA kernels take conv widths up to {MAX_WIDTH}, got {}",
            s.width
        )));
    }
    c.check("prep in_proj output", &s, x.len(), seqs.tokens())?;
    for (name, v) in [
        ("prep key heads", s.hk),
        ("prep value heads", s.hv),
        ("prep key head dim", s.dk),
        ("prep value head dim", s.dv),
        ("prep conv channels", s.conv_dim()),
        ("prep row stride", c.qkv.ld),
        ("prep sequences", seqs.count()),
    ] {
        int(name, v)?;
    }
    let rows = seqs.tokens().saturating_mul(2 * s.hk + s.hv);
    if rows.div_ceil(8) > i32::MAX as usize {
        return Err(GdnError::Invalid(format!(
            "prep: {} tokens x {} heads exceed the CUDA grid",
            seqs.tokens(),
            2 * s.hk + s.hv
        )));
    }
    let cd = s.conv_dim();
    check_g("prep conv weight", w, cd.saturating_mul(s.width))?;
    check_gpu("prep conv weight", x.gpu(), w.gpu())?;
    if let Some(b) = bias {
        check_g("prep conv bias", b, cd)?;
        check_gpu("prep conv bias", x.gpu(), b.gpu())?;
    }
    check_g("prep A_log", a_log, s.hv)?;
    check_g("prep dt_bias", dt_bias, s.hv)?;
    check_gpu("prep A_log", x.gpu(), a_log.gpu())?;
    check_gpu("prep dt_bias", x.gpu(), dt_bias.gpu())
}

/// The sequence boundaries as int64 on the GPU.
fn upload_cu(gpu: &std::sync::Arc<Gpu>, seqs: &Seqs) -> Result<GBuf<i64>> {
    let cu: Vec<i64> = seqs.cu().iter().map(|&c| c as i64).collect();
    gpu.upload(&cu)
}

/// See [`super::forward`]; writes every element of `o`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &DBuf,
    c: PrepCols,
    s: PrepShape,
    w: &GBuf<f32>,
    bias: Option<&GBuf<f32>>,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    seqs: &Seqs,
    o: &mut Out,
) -> Result<()> {
    check(x, c, s, w, bias, a_log, dt_bias, seqs)?;
    let n = seqs.tokens();
    let dt = x.dtype();
    let gpu = x.gpu().clone();
    let (qk, vd) = (n.saturating_mul(s.qk()), n.saturating_mul(s.vd()));
    check_d("prep q", &o.q, qk, dt)?;
    check_d("prep k", &o.k, qk, dt)?;
    check_d("prep v", &o.v, vd, dt)?;
    check_g("prep g", &o.g, n.saturating_mul(s.hv))?;
    check_d("prep beta", &o.beta, n.saturating_mul(s.hv), dt)?;
    for (name, g) in [
        ("prep q", o.q.gpu()),
        ("prep k", o.k.gpu()),
        ("prep v", o.v.gpu()),
        ("prep g", o.g.gpu()),
        ("prep beta", o.beta.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    match (&o.qkn, s.l2norm) {
        (Some((a, b)), true) => {
            check_d("prep qn", a, qk, dt)?;
            check_d("prep kn", b, qk, dt)?;
            check_gpu("prep qn", &gpu, a.gpu())?;
            check_gpu("prep kn", &gpu, b.gpu())?;
        }
        (None, false) => {}
        _ => {
            return Err(GdnError::Invalid(format!(
            "prep: normalized q, k buffers are needed exactly when the norm is on (l2norm = {})",
            s.l2norm
        )))
        }
    }
    if n == 0 {
        return Ok(());
    }
    let cu = upload_cu(&gpu, seqs)?;
    let vec = streaming(c, s);
    let name = match vec {
        Some((w, nc)) => format!("prep_fwd_w{w}n{nc}"),
        None => "prep_fwd".to_string(),
    };
    let f = kernel(&gpu, MODULE, &name, dt)?;
    let KernelDims {
        ld,
        xoff,
        boff,
        aoff,
        has_bias,
        nseq,
        used,
        tokens,
        hk,
        hv,
        dk,
        dv,
        wi,
        l2,
    } = KernelDims::new(c, s, seqs, bias.is_some(), n);
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, x);
    l.arg(&ld).arg(&xoff).arg(&boff).arg(&aoff).arg(&w.slice);
    match bias {
        Some(b) => l.arg(&b.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&has_bias)
        .arg(&a_log.slice)
        .arg(&dt_bias.slice)
        .arg(&cu.slice)
        .arg(&nseq)
        .arg(&used)
        .arg(&tokens)
        .arg(&hk)
        .arg(&hv)
        .arg(&dk)
        .arg(&dv);
    if vec.is_none() {
        l.arg(&wi);
    }
    l.arg(&l2);
    let Out {
        q,
        k,
        v,
        qkn,
        g,
        beta,
    } = o;
    arg_dm(&mut l, q);
    arg_dm(&mut l, k);
    arg_dm(&mut l, v);
    match qkn {
        Some((a, b)) => {
            arg_dm(&mut l, a);
            arg_dm(&mut l, b);
        }
        None => {
            l.arg(&NULL_PTR);
            l.arg(&NULL_PTR);
        }
    }
    l.arg(&mut g.slice);
    arg_dm(&mut l, beta);
    let nseg = 2 * s.hk + s.hv;
    let cfg = match vec {
        Some(_) => LaunchConfig {
            grid_dim: (n.div_ceil(FT * WARPS) as u32, nseg as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        None => rows_cfg(n * nseg),
    };
    launch(&mut l, cfg, &name)
}

/// See [`super::backward`]: writes d(conv input), d alpha and d b into the sections `c` of
/// `dproj` (other columns untouched) and every element of `g`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &DBuf,
    c: PrepCols,
    s: PrepShape,
    w: &GBuf<f32>,
    bias: Option<&GBuf<f32>>,
    a_log: &GBuf<f32>,
    dt_bias: &GBuf<f32>,
    seqs: &Seqs,
    dy: Dy,
    dproj: &mut DBuf,
    g: &mut Grads,
) -> Result<()> {
    check(x, c, s, w, bias, a_log, dt_bias, seqs)?;
    let n = seqs.tokens();
    let dt = x.dtype();
    let gpu = x.gpu().clone();
    let (qk, vd, hvn) = (
        n.saturating_mul(s.qk()),
        n.saturating_mul(s.vd()),
        n.saturating_mul(s.hv),
    );
    check_d("prep dq", dy.dq, qk, dt)?;
    check_d("prep dk", dy.dk, qk, dt)?;
    check_d("prep dv", dy.dv, vd, dt)?;
    check_g("prep dg", dy.dg, hvn)?;
    check_d("prep dbeta", dy.dbeta, hvn, dt)?;
    check_d("prep dproj", dproj, x.len(), dt)?;
    let cd = s.conv_dim();
    check_g("prep dconv_w", &g.conv_w, cd * s.width)?;
    match (&g.conv_b, bias.is_some()) {
        (Some(d), true) => check_g("prep dconv_b", d, cd)?,
        (None, false) => {}
        _ => {
            return Err(GdnError::Invalid(
                "prep: a conv bias gradient buffer is needed exactly when there is a bias".into(),
            ))
        }
    }
    check_g("prep dA_log", &g.a_log, s.hv)?;
    check_g("prep ddt_bias", &g.dt_bias, s.hv)?;
    for (name, b) in [
        ("prep dq", dy.dq.gpu()),
        ("prep dk", dy.dk.gpu()),
        ("prep dv", dy.dv.gpu()),
        ("prep dg", dy.dg.gpu()),
        ("prep dbeta", dy.dbeta.gpu()),
        ("prep dproj", dproj.gpu()),
        ("prep dconv_w", g.conv_w.gpu()),
        ("prep dA_log", g.a_log.gpu()),
        ("prep ddt_bias", g.dt_bias.gpu()),
    ] {
        check_gpu(name, &gpu, b)?;
    }
    if let Some(b) = &g.conv_b {
        check_gpu("prep dconv_b", &gpu, b.gpu())?;
    }
    let vec = streaming(c, s);
    let tiles = match vec {
        Some(_) => n.div_ceil(WARPS * BT),
        None => n.div_ceil(TILE),
    };
    if tiles > i32::MAX as usize || cd.div_ceil(32) > 65535 {
        return Err(GdnError::Invalid(format!(
            "prep: {n} tokens x {cd} channels exceed the CUDA grid"
        )));
    }
    let nchunks = chunks(n);
    check_part_dims("prep gates", nchunks, s.hv)?;
    let KernelDims {
        ld,
        xoff,
        boff,
        aoff,
        has_bias,
        nseq,
        used,
        tokens,
        hk,
        hv,
        dk,
        dv,
        wi,
        l2,
    } = KernelDims::new(c, s, seqs, bias.is_some(), n);
    let mut part = gpu.uninit::<f32>((tiles * (s.width + 1) * cd).max(1))?;
    let mut gpart = gpu.uninit::<f32>((nchunks * 2 * s.hv).max(1))?;
    if n > 0 {
        let cu = upload_cu(&gpu, seqs)?;
        if let Some((wv, nc)) = vec {
            // (1+2) one pass: the norm's statistics per token in registers, the conv backward
            // into dproj's qkv columns, partials of dw, dbias per block of WARPS * BT tokens.
            let name = format!("prep_bwd_w{wv}n{nc}");
            let f = kernel(&gpu, MODULE, &name, dt)?;
            let mut l = gpu.stream().launch_builder(&f);
            arg_d(&mut l, x);
            l.arg(&ld).arg(&xoff).arg(&w.slice);
            match bias {
                Some(b) => l.arg(&b.slice),
                None => l.arg(&NULL_PTR),
            };
            l.arg(&has_bias)
                .arg(&cu.slice)
                .arg(&nseq)
                .arg(&used)
                .arg(&tokens)
                .arg(&hk)
                .arg(&hv)
                .arg(&dk)
                .arg(&dv)
                .arg(&l2);
            arg_d(&mut l, dy.dq);
            arg_d(&mut l, dy.dk);
            arg_d(&mut l, dy.dv);
            arg_dm(&mut l, dproj);
            l.arg(&mut part.slice);
            let cfg = LaunchConfig {
                grid_dim: (tiles as u32, (2 * s.hk + s.hv) as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(&mut l, cfg, &name)?;
        } else {
            // (1) the norm's per-row statistics.
            let srows = n * 2 * s.hk;
            let mut st_r = gpu.uninit::<f32>(if s.l2norm { srows } else { 1 })?;
            let mut st_d = gpu.uninit::<f32>(if s.l2norm { srows } else { 1 })?;
            if s.l2norm {
                let f = kernel(&gpu, MODULE, "prep_bwd_stats", dt)?;
                let mut l = gpu.stream().launch_builder(&f);
                arg_d(&mut l, x);
                l.arg(&ld).arg(&xoff).arg(&w.slice);
                match bias {
                    Some(b) => l.arg(&b.slice),
                    None => l.arg(&NULL_PTR),
                };
                l.arg(&has_bias)
                    .arg(&cu.slice)
                    .arg(&nseq)
                    .arg(&used)
                    .arg(&tokens)
                    .arg(&hk)
                    .arg(&dk)
                    .arg(&wi);
                arg_d(&mut l, dy.dq);
                arg_d(&mut l, dy.dk);
                l.arg(&mut st_r.slice).arg(&mut st_d.slice);
                launch(&mut l, rows_cfg(srows), "prep_bwd_stats")?;
            }
            // (2) conv backward into dproj's qkv columns, partials of dw, dbias.
            let f = kernel(&gpu, MODULE, "prep_bwd", dt)?;
            let smem = bwd_smem(s.width);
            if smem > SMEM_DEFAULT {
                // widths above 28 need more than the default 48 KiB
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(|e| {
                    GdnError::Device(format!(
                        "prep: shared memory of prep_bwd ({smem} bytes): {e:?}"
                    ))
                })?;
            }
            let mut l = gpu.stream().launch_builder(&f);
            arg_d(&mut l, x);
            l.arg(&ld).arg(&xoff).arg(&w.slice);
            match bias {
                Some(b) => l.arg(&b.slice),
                None => l.arg(&NULL_PTR),
            };
            l.arg(&has_bias)
                .arg(&cu.slice)
                .arg(&nseq)
                .arg(&used)
                .arg(&tokens)
                .arg(&hk)
                .arg(&hv)
                .arg(&dk)
                .arg(&dv)
                .arg(&wi)
                .arg(&l2)
                .arg(&st_r.slice)
                .arg(&st_d.slice);
            arg_d(&mut l, dy.dq);
            arg_d(&mut l, dy.dk);
            arg_d(&mut l, dy.dv);
            arg_dm(&mut l, dproj);
            l.arg(&mut part.slice);
            let cfg = LaunchConfig {
                grid_dim: (tiles as u32, cd.div_ceil(32) as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            launch(&mut l, cfg, "prep_bwd")?;
        }
        // (3) the gates into dproj's alpha and beta columns, partials of dA_log, ddt_bias.
        let f = kernel(&gpu, MODULE, "prep_gates_bwd", dt)?;
        let rows = n as i64;
        let mut l = gpu.stream().launch_builder(&f);
        arg_d(&mut l, x);
        l.arg(&ld)
            .arg(&boff)
            .arg(&aoff)
            .arg(&a_log.slice)
            .arg(&dt_bias.slice)
            .arg(&dy.dg.slice);
        arg_d(&mut l, dy.dbeta);
        arg_dm(&mut l, dproj);
        l.arg(&mut gpart.slice).arg(&rows).arg(&hv);
        launch(&mut l, part_cfg(nchunks, s.hv), "prep_gates_bwd")?;
    }
    // (4) partials summed in order (zero sums when there are no tokens).
    let f = gpu.function(MODULE, "prep_conv_sum_parts")?;
    let nt = tiles as i64;
    let cd_i = cd as i32;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&part.slice)
        .arg(&nt)
        .arg(&cd_i)
        .arg(&wi)
        .arg(&mut g.conv_w.slice);
    match &mut g.conv_b {
        Some(d) => l.arg(&mut d.slice),
        None => l.arg(&NULL_PTR),
    };
    l.arg(&has_bias);
    launch(&mut l, lin_cfg((s.width + 1) * cd), "prep_conv_sum_parts")?;
    let f = gpu.function(MODULE, "prep_gates_sum_parts")?;
    let nch = nchunks as i64;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&gpart.slice)
        .arg(&nch)
        .arg(&hv)
        .arg(&mut g.a_log.slice)
        .arg(&mut g.dt_bias.slice);
    launch(&mut l, lin_cfg(2 * s.hv), "prep_gates_sum_parts")
}

#[cfg(test)]
mod tests {
    #[test]
    fn shared_memory_of_the_backward() {
        // the usual widths fit the default 48 KiB; the widest fits what sm_80 (163 KiB) and
        // sm_90 (227 KiB) allow a block when opted in
        assert!(super::bwd_smem(4) <= super::SMEM_DEFAULT);
        assert!(super::bwd_smem(28) <= super::SMEM_DEFAULT);
        assert!(super::bwd_smem(super::MAX_WIDTH) <= 163 * 1024);
    }
}
