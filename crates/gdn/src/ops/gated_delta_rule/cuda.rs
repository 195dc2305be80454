//! CUDA chunked gated delta rule, forward and backward (kernels in `gated_delta_rule.cu`).
//!
//! Same semantics and layouts as the CPU op (`super::forward` / `super::backward`): token-major
//! packed `[tokens, H, D]`, sequences from `Seqs`, padding rows (at or after `seqs.used()`) get
//! zero output and zero gradients, GVA (value head `j` reads key head `j / (Hv/Hk)`), optional
//! in-kernel L2 norm of q and k, initial / final states `[N, Hv, Dk, Dv]` fp32.
//!
//! Storage: q, k, v, beta (and d_o) are all f32 or all bf16; `g` is f32. Every accumulation is
//! fp32 and so is every workspace (chunk-start states, T, W, U, D). No atomics: each output element
//! is written by one thread, each reduction has a fixed order, so two runs give the same bits.
//! The dq / dk sums over a GVA group go through per-value-head fp32 partials reduced in head order.
//!
//! Pipeline (see the .cu file's header): forward = (l2norm,) prep, scan, output; backward =
//! (l2norm,) prep, scan (recomputes the chunk-start states), dD_loc, reverse scan, per-chunk
//! gradients, GVA reduction (through the l2norm). With the in-kernel norm, the normalized q and k
//! are kept in fp32 whatever the storage type (`*_bf16n` kernels).
//!
//! Workspace (fp32, per chunk of 64 tokens and value head): chunk-start states `h` (and their
//! gradients `dh` in backward) `Dk * Dv` each, `T` `64 * 64`, `W`, `U`, `D`, `dD` `64 * D`; about
//! 7.5 GiB at 32768 tokens x 32 value heads, Dk = Dv = 128, for forward + backward.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::DeviceRepr;

use super::{RuleOpts, RuleShape, CHUNK};
use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::backend::launch::{dptr, i32_arg, launch_in, launch_in_threads, optr, ptr, suffix, Arg};
use crate::error::{GdnError, Result};
use crate::ops::common::rule_cuda::{check_backward_grads, fused_scan_warps, poison_if, zero_tail};
use crate::seqs::Seqs;

const MODULE: &str = "gated_delta_rule";
const THREADS: u32 = 256;
/// Rows (one warp each) per block of the row kernels (l2norm, GVA reduction).
const ROWS_PER_BLOCK: usize = (THREADS / 32) as usize;
/// Largest `Dk` / `Dv` the kernels support (they need multiples of 16).
pub const MAX_HEAD_DIM: usize = 256;

/// Gradients from [`backward`]: dq, dk `[tokens, Hk, Dk]`, dv `[tokens, Hv, Dv]` and dbeta
/// `[tokens, Hv]` in the inputs' storage type; dg `[tokens, Hv]` and dh0 `[N, Hv, Dk, Dv]` fp32.
pub struct Grads {
    pub dq: DBuf,
    pub dk: DBuf,
    pub dv: DBuf,
    pub dg: GBuf<f32>,
    pub dbeta: DBuf,
    /// Gradient of the initial states, when they were given.
    pub dh0: Option<GBuf<f32>>,
}

/// Launch `name_<dtype>` on a flat grid of `blocks` blocks of 256 threads.
fn launch(gpu: &Gpu, name: &str, blocks: usize, smem_bytes: usize, args: &[Arg]) -> Result<()> {
    launch_in(gpu, MODULE, name, blocks, smem_bytes, args)
}

/// Suffix of the chunk kernels: the storage type, and for bf16 with the in-kernel norm "bf16n"
/// (the normalized q, k are kept in fp32, see `normalized`).
fn chunk_sfx(d: DType, opts: RuleOpts) -> &'static str {
    match (d, opts.l2norm_in_kernel) {
        (DType::Bf16, true) => "bf16n",
        _ => suffix(d),
    }
}

/// Chunk tables: first token and length of every chunk (chunks never straddle sequences), and
/// the first chunk of every sequence.
struct Chunks {
    count: usize,
    t0: GBuf<i64>,
    len: GBuf<i32>,
    seq: GBuf<i64>,
}

impl Chunks {
    fn new(gpu: &Arc<Gpu>, seqs: &Seqs) -> Result<Chunks> {
        let mut t0 = Vec::new();
        let mut len = Vec::new();
        let mut seq = vec![0i64];
        for n in 0..seqs.count() {
            let r = seqs.range(n);
            let mut c0 = r.start;
            while c0 < r.end {
                t0.push(c0 as i64);
                len.push(CHUNK.min(r.end - c0) as i32);
                c0 += CHUNK;
            }
            seq.push(t0.len() as i64);
        }
        let count = t0.len();
        // Never allocate zero bytes.
        t0.resize(count.max(1), 0);
        len.resize(count.max(1), 0);
        Ok(Chunks {
            count,
            t0: gpu.upload(&t0)?,
            len: gpu.upload(&len)?,
            seq: gpu.upload(&seq)?,
        })
    }
}

static POISON: AtomicBool = AtomicBool::new(false);

/// Tests only: fill every output and workspace this module allocates with NaN (all bits set)
/// before the kernels run, so an element a kernel fails to write (or a workspace element read
/// before it is written) shows up as NaN.
#[doc(hidden)]
pub fn set_poison(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

fn poison<T: DeviceRepr>(b: &GBuf<T>) -> Result<()> {
    poison_if(POISON.load(Ordering::Relaxed), b, "gated delta rule")
}

/// An uninitialized f32 buffer of `n` elements (poisoned in tests).
fn out_f32(gpu: &Arc<Gpu>, n: usize) -> Result<GBuf<f32>> {
    let b = gpu.uninit::<f32>(n)?;
    poison(&b)?;
    Ok(b)
}

/// An uninitialized buffer of `n` elements of `dt` (poisoned in tests).
fn out_d(gpu: &Arc<Gpu>, n: usize, dt: DType) -> Result<DBuf> {
    let b = DBuf::uninit(gpu, n, dt)?;
    match &b {
        DBuf::F32(x) => poison(x)?,
        DBuf::Bf16(x) => poison(x)?,
    }
    Ok(b)
}

/// A workspace of `n` fp32 elements (at least one: no zero-byte allocations).
fn ws(gpu: &Arc<Gpu>, n: usize) -> Result<GBuf<f32>> {
    out_f32(gpu, n.max(1))
}

/// Input checks shared by forward and backward; returns the storage type.
#[allow(clippy::too_many_arguments)]
fn check(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&GBuf<f32>>,
) -> Result<DType> {
    if s.hk == 0 || s.hv == 0 || s.dk == 0 || s.dv == 0 {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: zero dimension in {s:?}"
        )));
    }
    if !s.hv.is_multiple_of(s.hk) {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: value heads ({}) must be a multiple of key heads ({})",
            s.hv, s.hk
        )));
    }
    for (name, d) in [("Dk", s.dk), ("Dv", s.dv)] {
        if !d.is_multiple_of(16) || d > MAX_HEAD_DIM {
            return Err(GdnError::Invalid(format!(
                "gated delta rule (CUDA): {name} = {d} is not supported; expected a multiple of 16 \
                 up to {MAX_HEAD_DIM}"
            )));
        }
    }
    let dt = q.dtype();
    for (name, b) in [("k", k), ("v", v), ("beta", beta)] {
        if b.dtype() != dt {
            return Err(GdnError::Invalid(format!(
                "gated delta rule (CUDA): {name} is {:?} but q is {dt:?}; q, k, v and beta must \
                 share one storage type",
                b.dtype()
            )));
        }
    }
    let n = seqs.tokens();
    let lens = [
        ("q", q.len(), n * s.hk * s.dk),
        ("k", k.len(), n * s.hk * s.dk),
        ("v", v.len(), n * s.hv * s.dv),
        ("g", g.len(), n * s.hv),
        ("beta", beta.len(), n * s.hv),
    ];
    for (name, got, want) in lens {
        if got != want {
            return Err(GdnError::Invalid(format!(
                "{name}: expected {want} values, got {got}"
            )));
        }
    }
    if let Some(h) = h0 {
        let want = seqs.count() * s.hv * s.dk * s.dv;
        if h.len() != want {
            return Err(GdnError::Invalid(format!(
                "initial_state: expected {want} values, got {}",
                h.len()
            )));
        }
    }
    let same = [q.gpu(), k.gpu(), v.gpu(), g.gpu(), beta.gpu()]
        .into_iter()
        .chain(h0.map(|h| h.gpu()))
        .all(|x| Arc::ptr_eq(x, gpu));
    if !same {
        return Err(GdnError::Invalid(
            "gated delta rule (CUDA): every input must live on the GPU the op runs on".into(),
        ));
    }
    if n == 0 {
        return Err(GdnError::Invalid(
            "gated delta rule (CUDA): the input holds no tokens".into(),
        ));
    }
    Ok(dt)
}

/// V-tile width of the scans: 32 columns, or 16 when that leaves too few blocks to fill the GPU
/// (the scans are sequential over chunks, so their parallelism is N * Hv * Dv / BV blocks).
fn scan_bv(gpu: &Gpu, n_seq: usize, s: RuleShape) -> usize {
    if !s.dv.is_multiple_of(32) {
        return 16;
    }
    let sms = gpu.sm_count().unwrap_or(132);
    if n_seq * s.hv * (s.dv / 32) < 2 * sms {
        16
    } else {
        32
    }
}

/// l2-normalized copies of q and k when the norm is in the kernel, in fp32 whatever the storage
/// type (rounding them to bf16 would add an error the op does not need: FLA does round them).
fn normalized(gpu: &Arc<Gpu>, q: &DBuf, k: &DBuf, s: RuleShape, dt: DType) -> Result<(DBuf, DBuf)> {
    let st = gpu.stream();
    let qn = DBuf::F32(out_f32(gpu, q.len())?);
    let kn = DBuf::F32(out_f32(gpu, k.len())?);
    let rows = q.len() / s.dk;
    let name = format!("gdr_l2norm_{}", suffix(dt));
    for (x, y) in [(q, &qn), (k, &kn)] {
        launch(
            gpu,
            &name,
            rows.div_ceil(ROWS_PER_BLOCK),
            0,
            &[
                dptr(x, st),
                dptr(y, st),
                Arg::I64(rows as i64),
                i32_arg(s.dk),
            ],
        )?;
    }
    Ok((qn, kn))
}

/// Per-chunk workspaces of the forward pass.
struct Prep {
    gam: GBuf<f32>,
    t: Option<GBuf<f32>>,
    w: GBuf<f32>,
    u: GBuf<f32>,
}

const C: usize = CHUNK;
/// Floats of shared memory of the block GEMM staging and of one padded 64x64 matrix.
const STAGE_F: usize = 2 * 64 * (32 + 4);
const MAT_F: usize = 64 * 65;

#[allow(clippy::too_many_arguments)]
fn prep(
    gpu: &Arc<Gpu>,
    ks: &str,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    ch: &Chunks,
    s: RuleShape,
    keep_t: bool,
) -> Result<Prep> {
    let st = gpu.stream();
    let chh = ch.count * s.hv;
    let p = Prep {
        gam: ws(gpu, chh * C)?,
        t: if keep_t {
            Some(ws(gpu, chh * C * C)?)
        } else {
            None
        },
        w: ws(gpu, chh * C * s.dk)?,
        u: ws(gpu, chh * C * s.dv)?,
    };
    let smem = (STAGE_F + 2 * MAT_F + 3 * C) * 4;
    launch(
        gpu,
        &format!("gdr_prep_{ks}"),
        chh,
        smem,
        &[
            dptr(k, st),
            dptr(v, st),
            ptr(g, st),
            dptr(beta, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            ptr(&p.gam, st),
            optr(p.t.as_ref(), st),
            ptr(&p.w, st),
            ptr(&p.u, st),
        ],
    )?;
    Ok(p)
}

/// Forward scan: chunk-start states `h` and `D = U - W S` per chunk; final states if `fin`.
#[allow(clippy::too_many_arguments)]
fn scan_fwd(
    gpu: &Arc<Gpu>,
    ks: &str,
    k: &DBuf,
    p: &Prep,
    ch: &Chunks,
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&GBuf<f32>>,
    fin: Option<&GBuf<f32>>,
) -> Result<(GBuf<f32>, GBuf<f32>)> {
    let st = gpu.stream();
    let chh = ch.count * s.hv;
    let h = ws(gpu, chh * s.dk * s.dv)?;
    let d = ws(gpu, chh * C * s.dv)?;
    let bv = scan_bv(gpu, seqs.count(), s);
    let smem = (s.dk * (bv + 8) + 2 * C * (s.dk + 4) + C * (bv + 8) + C) * 4;
    launch(
        gpu,
        &format!("gdr_scan_fwd{bv}_{ks}"),
        seqs.count() * s.hv * (s.dv / bv),
        smem,
        &[
            dptr(k, st),
            ptr(&p.gam, st),
            ptr(&p.w, st),
            ptr(&p.u, st),
            ptr(&ch.seq, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            optr(h0, st),
            ptr(&h, st),
            ptr(&d, st),
            optr(fin, st),
        ],
    )?;
    Ok((h, d))
}

/// Forward on the GPU. Returns `o` `[tokens, Hv, Dv]` (storage type of q) and, if
/// `output_final_state`, the final states `[N, Hv, Dk, Dv]` fp32. Runs the kernels
/// [`FwdKernel::from_env`] names (v9 on sm_90 and newer, by shape below it, unless
/// `GDN_RULE_FWD` names another) with [`PrepKernel::from_env`]'s chunk prep
/// ([`PrepKernel::Auto`] unless `GDN_RULE_PREP` names another).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
) -> Result<(DBuf, Option<GBuf<f32>>)> {
    forward_with(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
        FwdKernel::from_env(),
    )
}

/// [`forward`] with the forward kernels chosen by the caller. `FwdKernel::V6` runs the v6 path
/// where [`v6_supports`] says it can (bf16 storage, Dk 64 or 128, Dv a multiple of 16) and v5
/// elsewhere. Backward does not depend on which forward ran (it recomputes from the inputs).
/// The v6 path's prep is [`PrepKernel::from_env`]'s.
#[allow(clippy::too_many_arguments)]
pub fn forward_with(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
    kernel: FwdKernel,
) -> Result<(DBuf, Option<GBuf<f32>>)> {
    forward_with_prep(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
        kernel,
        PrepKernel::from_env(),
    )
}

/// [`forward_with`] with the v6 path's prep chosen by the caller too.
#[allow(clippy::too_many_arguments)]
pub fn forward_with_prep(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
    kernel: FwdKernel,
    prep_kind: PrepKernel,
) -> Result<(DBuf, Option<GBuf<f32>>)> {
    let (o, fin, _) = forward_inner(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
        kernel,
        prep_kind,
        false,
    )?;
    Ok((o, fin))
}

/// [`forward`], also returning the chunk inverses T its chunk prep solved for, for
/// [`backward_saved`], which then skips the solve (and the K K^T product) in its recompute:
/// `[chunks, Hv, T_PACKED]` fp32, T's ten 16 x 16 blocks on or below the diagonal per (chunk,
/// value head) (`chunks`: the 64-token chunks of the packed sequences, none straddling two),
/// 160 bytes per token and value head. `None` where the forward's kernels do not make them
/// (the v5 path: f32 storage or other head dims; the v6 / prep7 preps a `GDN_RULE_PREP` names)
/// and when `GDN_RULE_SAVE_T=0` (the backward then solves again: less memory, the same bits).
#[allow(clippy::too_many_arguments)]
pub fn forward_saving(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
) -> Result<SavingForward> {
    forward_inner(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
        FwdKernel::from_env(),
        PrepKernel::from_env(),
        std::env::var("GDN_RULE_SAVE_T").as_deref() != Ok("0"),
    )
}

/// The forward: [`forward_with_prep`], and with `keep_t` the saved chunk inverses where the
/// kernels make them ([`forward_saving`]).
#[allow(clippy::too_many_arguments)]
fn forward_inner(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
    kernel: FwdKernel,
    prep_kind: PrepKernel,
    keep_t: bool,
) -> Result<SavingForward> {
    let s = shape;
    let dt = check(gpu, q, k, v, g, beta, seqs, s, initial_state)?;
    let v6 = match kernel {
        FwdKernel::V5 => None,
        FwdKernel::V6 { warps } => Some((warps, V6Loads::CpAsync)),
        FwdKernel::V6Bulk { warps } if gpu_has_bulk_copies(gpu) => Some((warps, V6Loads::Bulk)),
        FwdKernel::V6Bulk { warps } => Some((warps, V6Loads::CpAsync)),
        FwdKernel::V6NoReload { warps } => Some((warps, V6Loads::NoReload)),
        FwdKernel::V6Lean { warps } => Some((warps, V6Loads::Lean)),
        FwdKernel::V8 { warps } => Some((warps, V6Loads::Split)),
        FwdKernel::V9 { warps } if gpu_has_bulk_copies(gpu) => Some((warps, V6Loads::Ring)),
        FwdKernel::V9 { warps } => Some((warps, V6Loads::Split)),
        FwdKernel::V10 { warps } if gpu_has_bulk_copies(gpu) => Some((warps, V6Loads::Ring10)),
        FwdKernel::V10Fast { warps } if gpu_has_bulk_copies(gpu) => {
            Some((warps, V6Loads::Ring10Fast))
        }
        FwdKernel::V10 { warps } | FwdKernel::V10Fast { warps } => Some((warps, V6Loads::Split)),
        FwdKernel::Auto => {
            let sms = gpu.sm_count().unwrap_or(132);
            if gpu_has_bulk_copies(gpu) && prep_may_keep_t(prep_kind) {
                // v10 at every shape where the GPU has mbarrier-completed copies and the prep
                // writes T diag(beta) (prep8 / prep9; session 20 on the H200: forward 1.99 ->
                // 1.86 ms at B1 T32768 16/32, 1.05 -> 0.97 at B8 T4096 16/16, the prep writing
                // 32 KB less per chunk and value head)
                Some((0, V6Loads::Ring10))
            } else if gpu_has_bulk_copies(gpu) {
                // v9 where the prep is another (session 13: 0.33 ms against v6 lean's 0.42 at
                // B8 T4096 16/16, 0.81 against 1.45 at B1)
                Some((0, V6Loads::Ring))
            } else if auto_picks_v8(seqs.count(), s.hv, s.dv, sms) {
                Some((0, V6Loads::Split))
            } else {
                Some((0, V6Loads::Lean))
            }
        }
    };
    if let Some((warps, loads)) = v6 {
        if v6_supports(dt, s) {
            return forward_v6(
                gpu,
                q,
                k,
                v,
                g,
                beta,
                seqs,
                s,
                opts,
                initial_state,
                output_final_state,
                warps,
                loads,
                prep_kind,
                keep_t,
            );
        }
    }
    let st = gpu.stream();
    let ch = Chunks::new(gpu, seqs)?;
    let norm = if opts.l2norm_in_kernel {
        Some(normalized(gpu, q, k, s, dt)?)
    } else {
        None
    };
    let (qq, kk) = norm.as_ref().map_or((q, k), |(a, b)| (a, b));
    let ks = chunk_sfx(dt, opts);
    let p = prep(gpu, ks, kk, v, g, beta, &ch, s, false)?;
    let fin = if output_final_state {
        Some(out_f32(gpu, seqs.count() * s.hv * s.dk * s.dv)?)
    } else {
        None
    };
    let (h, d) = scan_fwd(gpu, ks, kk, &p, &ch, seqs, s, initial_state, fin.as_ref())?;
    let mut o = out_d(gpu, seqs.tokens() * s.hv * s.dv, dt)?;
    let smem = (STAGE_F + MAT_F + 2 * C) * 4;
    launch(
        gpu,
        &format!("gdr_output_{ks}"),
        ch.count * s.hv,
        smem,
        &[
            dptr(qq, st),
            dptr(kk, st),
            ptr(&p.gam, st),
            ptr(&h, st),
            ptr(&d, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            dptr(&o, st),
        ],
    )?;
    zero_tail(
        "gated delta rule",
        gpu,
        &mut o,
        seqs.used(),
        seqs.tokens(),
        s.hv * s.dv,
    )?;
    Ok((o, fin, None))
}

/// Backward on the GPU from `d_o` `[tokens, Hv, Dv]` (storage type of q) and optionally the
/// gradient of the final states (fp32). Recomputes everything it needs from the inputs. Runs the
/// kernels [`BwdKernel::from_env`] names (every v6 piece unless `GDN_RULE_BWD` says otherwise).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
) -> Result<Grads> {
    backward_with(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
        BwdKernel::from_env(),
    )
}

/// [`backward`] with the kernels chosen by the caller. `BwdKernel::V6` runs its selected v6
/// pieces where [`v6_supports`] says they can (bf16 storage, Dk 64 or 128, Dv a multiple of 16)
/// and v5 elsewhere (bit for bit the v5 path). The v6 recompute's prep is
/// [`PrepKernel::from_env`]'s.
#[allow(clippy::too_many_arguments)]
pub fn backward_with(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
    kernel: BwdKernel,
) -> Result<Grads> {
    backward_with_prep(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
        kernel,
        PrepKernel::from_env(),
    )
}

/// [`backward_with`] with the v6 recompute's prep chosen by the caller too.
#[allow(clippy::too_many_arguments)]
pub fn backward_with_prep(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
    kernel: BwdKernel,
    prep_kind: PrepKernel,
) -> Result<Grads> {
    backward_inner(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
        kernel,
        prep_kind,
        None,
    )
}

/// [`backward`] with the chunk inverses [`forward_saving`] kept (`None`: recompute them, as
/// [`backward`]): the recompute reads them instead of solving for T, the same outputs bit for
/// bit. Where the backward's kernels do not take them (the v5 path, a prep other than prep8 /
/// prep9) they are not read. Saved inverses of another shape are an error.
#[allow(clippy::too_many_arguments)]
pub fn backward_saved(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
    t_saved: Option<&GBuf<f32>>,
) -> Result<Grads> {
    backward_inner(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
        BwdKernel::from_env(),
        PrepKernel::from_env(),
        t_saved,
    )
}

/// The backward: [`backward_with_prep`] with optionally the saved chunk inverses
/// ([`backward_saved`]).
#[allow(clippy::too_many_arguments)]
fn backward_inner(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
    kernel: BwdKernel,
    prep_kind: PrepKernel,
    t_saved: Option<&GBuf<f32>>,
) -> Result<Grads> {
    let s = shape;
    let dt = check(gpu, q, k, v, g, beta, seqs, s, initial_state)?;
    let (tokens, n_seq) = (seqs.tokens(), seqs.count());
    check_backward_grads("gated delta rule", gpu, dt, seqs, s, d_o, d_final_state)?;
    if let BwdKernel::V6 {
        recompute,
        scan,
        bf16_states,
        grad,
        grad7,
        warps,
    } = kernel
    {
        if (recompute || scan) && v6_supports(dt, s) {
            let bf16_states = bf16_states && recompute && scan;
            let grad = grad && bf16_states && matches!(s.dk, 64 | 128) && matches!(s.dv, 64 | 128);
            let pieces = V6Pieces {
                recompute,
                scan,
                bf16_states,
                grad,
                grad7: grad && grad7,
                warps,
            };
            return backward_v6(
                gpu,
                q,
                k,
                v,
                g,
                beta,
                seqs,
                s,
                opts,
                initial_state,
                d_o,
                d_final_state,
                pieces,
                prep_kind,
                t_saved,
            );
        }
    }
    let st = gpu.stream();
    let sf = suffix(dt);
    let ch = Chunks::new(gpu, seqs)?;
    let chh = ch.count * s.hv;
    let norm = if opts.l2norm_in_kernel {
        Some(normalized(gpu, q, k, s, dt)?)
    } else {
        None
    };
    let (qq, kk) = norm.as_ref().map_or((q, k), |(a, b)| (a, b));
    let ks = chunk_sfx(dt, opts);
    let p = prep(gpu, ks, kk, v, g, beta, &ch, s, true)?;
    let (h, d) = scan_fwd(gpu, ks, kk, &p, &ch, seqs, s, initial_state, None)?;

    // dD_loc = scale A^T dO.
    let dd = ws(gpu, chh * C * s.dv)?;
    let smem_a = (STAGE_F + MAT_F + 2 * C) * 4;
    launch(
        gpu,
        &format!("gdr_dd_local_{ks}"),
        chh,
        smem_a,
        &[
            dptr(qq, st),
            dptr(kk, st),
            dptr(d_o, st),
            ptr(&p.gam, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            ptr(&dd, st),
        ],
    )?;

    // Reverse scan: dh[c], dD, dh0.
    let dh = ws(gpu, chh * s.dk * s.dv)?;
    let dh0 = match initial_state {
        Some(_) => Some(out_f32(gpu, n_seq * s.hv * s.dk * s.dv)?),
        None => None,
    };
    let bv = scan_bv(gpu, n_seq, s);
    let smem_s = (s.dk * (bv + 8) + 2 * C * (s.dk + 4) + 2 * C * (bv + 8) + C) * 4;
    launch(
        gpu,
        &format!("gdr_scan_bwd{bv}_{ks}"),
        n_seq * s.hv * (s.dv / bv),
        smem_s,
        &[
            dptr(qq, st),
            dptr(kk, st),
            dptr(d_o, st),
            ptr(&p.gam, st),
            ptr(&p.w, st),
            ptr(&ch.seq, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(d_final_state, st),
            ptr(&dh, st),
            ptr(&dd, st),
            optr(dh0.as_ref(), st),
        ],
    )?;

    // Per-chunk gradients (W's workspace becomes dW, U's becomes dVb).
    let dkb = ws(gpu, chh * C * s.dk)?;
    let dq_part = ws(gpu, tokens * s.hv * s.dk)?;
    let dk_part = ws(gpu, tokens * s.hv * s.dk)?;
    let mut dv = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let dg = out_f32(gpu, tokens * s.hv)?;
    let mut dbeta = out_d(gpu, tokens * s.hv, dt)?;
    let smem_g = (STAGE_F + 5 * MAT_F + 8 * C) * 4;
    launch(
        gpu,
        &format!("gdr_grad_{ks}"),
        chh,
        smem_g,
        &[
            dptr(qq, st),
            dptr(kk, st),
            dptr(v, st),
            dptr(beta, st),
            dptr(d_o, st),
            ptr(&p.gam, st),
            optr(p.t.as_ref(), st),
            ptr(&h, st),
            ptr(&dh, st),
            ptr(&d, st),
            ptr(&dd, st),
            ptr(&p.w, st),
            ptr(&p.u, st),
            ptr(&dkb, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            ptr(&dq_part, st),
            ptr(&dk_part, st),
            dptr(&dv, st),
            ptr(&dg, st),
            dptr(&dbeta, st),
        ],
    )?;
    drop((p, h, d, dd, dh, dkb));

    // dq, dk: fixed-order sums over the GVA group, through the l2 norm.
    let dq = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    let dk = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    launch(
        gpu,
        &format!("gdr_reduce_qk_{sf}"),
        (tokens * s.hk).div_ceil(ROWS_PER_BLOCK),
        0,
        &[
            dptr(q, st),
            dptr(k, st),
            ptr(&dq_part, st),
            ptr(&dk_part, st),
            Arg::I64(tokens as i64),
            Arg::I64(seqs.used() as i64),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            Arg::I32(opts.l2norm_in_kernel as i32),
            dptr(&dq, st),
            dptr(&dk, st),
        ],
    )?;
    let used = seqs.used();
    zero_tail("gated delta rule", gpu, &mut dv, used, tokens, s.hv * s.dv)?;
    zero_tail("gated delta rule", gpu, &mut dbeta, used, tokens, s.hv)?;
    let mut dg = DBuf::F32(dg);
    zero_tail("gated delta rule", gpu, &mut dg, used, tokens, s.hv)?;
    let DBuf::F32(dg) = dg else {
        unreachable!("dg is f32")
    };
    Ok(Grads {
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dh0,
    })
}

// ---------------------------------------------------------------------------------------------
// v6 forward (issue 13, stage A): see the v6 section of gated_delta_rule.cu.

/// Which kernels run the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FwdKernel {
    /// v5: prep, scan (chunk-start states to memory), output; TF32 tensor cores for bf16.
    V5,
    /// v6: prep with bf16 W, A = QK^T on its own, then the scan and the output fused in one
    /// kernel on bf16 tensor cores (mma.sync m16n8k16, ldmatrix, cp.async double buffering).
    /// `warps` per CTA (1, 2, 4 or 8; each owns 16 state columns); 0 picks by shape.
    V6 { warps: usize },
    /// v6 with the fused kernel's loads as Hopper bulk copies (the TMA engine, completing on
    /// mbarriers) instead of cp.async; `V6` below sm_90.
    V6Bulk { warps: usize },
    /// Benchmarks only, wrong results: v6 whose fused kernel loads the first two chunks and then
    /// reuses them (its time without the loads). Dk 128, 1 or 2 warps.
    #[doc(hidden)]
    V6NoReload { warps: usize },
    /// v6 whose fused kernel computes its cp.async addresses once per chunk and thread
    /// (`gdr_fwd6l*`): the same bytes to the same places, so the same bits as `V6`, with fewer
    /// instructions per chunk step.
    V6Lean { warps: usize },
    /// v8 (opt-in, `GDN_RULE_FWD=v8`): v6's fused scan and output with the state's Dk rows split
    /// between the two warps of a pair (`gdr_fwd8*`: X and the inter-chunk output exchanged
    /// through shared memory), so a CTA of 16 `warps / 2` columns has `warps` warps: 2, 4 or 8
    /// (0 picks by shape; `GDN_RULE_V8_WARPS` from the environment). The same inputs (v6's prep)
    /// and outputs; not the same bits as v6 (another summation order).
    V8 { warps: usize },
    /// v9 (`GDN_RULE_FWD=v9`; [`FwdKernel::Auto`]'s pick at few heads): v8 with its loads
    /// warp-specialized (`gdr_fwd9*`: one producer warp, or a producer warpgroup at 8 compute
    /// warps, fills a ring of stages by
    /// cp.async completing on mbarriers; the compute warps wait per stage and release it, no
    /// CTA-wide barrier per chunk). The same arithmetic on the same stage bytes: the same bits
    /// as [`FwdKernel::V8`] at every width. sm_90 and newer; `V8` below. `warps` as `V8`'s
    /// (`GDN_RULE_V8_WARPS` from the environment).
    V9 { warps: usize },
    /// v10 (`GDN_RULE_FWD=v10`; [`FwdKernel::Auto`]'s pick on sm_90 and newer since session
    /// 20): v9 with D rebuilt in the scan as `T diag(beta) (V - diag(e^gam) K S0)` from the
    /// input V and the prep's `T diag(beta)` (bf16 hi + lo, `gdr_prep8o` / `gdr_prep9o`), so the
    /// prep writes neither W nor U (`gdr_fwd10*`). Not v9's bits (D from other roundings); held
    /// to the f64 tests (o within 2.8-3.9e-3 RMS of f64 on the H200, as v9). sm_90 and newer
    /// (`V8` below); `warps` as `V8`'s; the prep must be prep8 / prep9 (the default's).
    V10 { warps: usize },
    /// v10 with the hi part of `T diag(beta)` only (opt-in, `GDN_RULE_FWD=v10f`,
    /// `gdr_fwd10f*`): one product less on the scan's chain; D from a bf16-rounded
    /// `T diag(beta)`, as v9's `W S0` takes a bf16 W. Measured on the H200 (session 20): 0.02-0.06
    /// ms faster than v10 per forward, the same error against f64 in every test case; not the
    /// default because rounding T's entries (not a product) is the less robust choice where
    /// a chunk's keys are nearly dependent and T's entries are large.
    V10Fast { warps: usize },
    /// The default: on sm_90 and newer [`FwdKernel::V10`] at every shape when the prep is
    /// prep8 / prep9 (since session 20: B1 T32768 16/32 1.99 -> 1.86 ms, B8 T4096 16/16 1.05
    /// -> 0.97 with its prep, against v9), else [`FwdKernel::V9`] (session 13: B1 0.81 ms, B8
    /// 0.33 against v6 lean's 0.42); below sm_90 [`FwdKernel::V8`] (v9's bits) where v6's
    /// grid would leave schedulers idle (at most two 16-column state tiles per SM,
    /// [`auto_picks_v8`]: few sequences x value heads over long sequences), else
    /// [`FwdKernel::V6Lean`]; widths by shape.
    Auto,
}

/// Whether [`FwdKernel::Auto`] runs v8 for `n_seq` sequences of `hv` value heads of `dv` state
/// columns on a GPU of `sms` multiprocessors: when v6 would have at most two 16-column tiles
/// (one warp each) per SM, so that at one CTA per SM half the schedulers or more would idle.
pub fn auto_picks_v8(n_seq: usize, hv: usize, dv: usize, sms: usize) -> bool {
    n_seq * hv * dv.div_ceil(16) <= 2 * sms
}

/// How `gdr_fwd6` brings a chunk's operands into shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum V6Loads {
    CpAsync,
    Bulk,
    NoReload,
    Lean,
    /// Not a v6 load path: the v8 kernel (`gdr_fwd8*`, the lean loads, Dk split per warp pair).
    Split,
    /// Not a v6 load path: the v9 kernel (`gdr_fwd9*`, v8 with a producer warp and mbarriers).
    Ring,
    /// Not a v6 load path: the v10 kernel (`gdr_fwd10*`: v9 rebuilding D, after prep8o / 9o).
    Ring10,
    /// Not a v6 load path: v10 with T diag(beta)'s hi part only (`gdr_fwd10f*`).
    Ring10Fast,
}

/// Whether the GPU has the bulk-copy engine (sm_90 and newer).
fn gpu_has_bulk_copies(gpu: &Gpu) -> bool {
    !matches!(gpu.arch(), "sm_80" | "sm_86" | "sm_89")
}

impl FwdKernel {
    /// The default: v6 with the lean cp.async loads ([`FwdKernel::V6Lean`], since 2026-12-02;
    /// the same bits as `V6`, measured 0.4 ms faster at B1 T32768 16/32 on the H200), CTA width
    /// by shape; it falls back to v5 where [`v6_supports`] says no: f32 storage, Dk other than 64
    /// / 128. `GDN_RULE_FWD=v6` selects v6's first cp.async loads (`gdr_fwd6*`), `v5` keeps v5
    /// everywhere, `v6b` picks the bulk-copy loads (`v6l` names the default);
    /// `GDN_RULE_V6_WARPS=1|2|4|8` forces the CTA width of v6.
    /// `GDN_RULE_FWD=v8` selects [`FwdKernel::V8`] (`GDN_RULE_V8_WARPS=2|4|8` its width), `v9`
    /// [`FwdKernel::V9`], `v10` / `v10f` [`FwdKernel::V10`] / [`FwdKernel::V10Fast`] (the same
    /// width switch),
    /// `v6l` [`FwdKernel::V6Lean`] everywhere; unset (or `auto`), [`FwdKernel::Auto`].
    pub fn from_env() -> FwdKernel {
        let fwd = std::env::var("GDN_RULE_FWD").ok();
        let warps = if matches!(fwd.as_deref(), Some("v8" | "v9" | "v10" | "v10f")) {
            "GDN_RULE_V8_WARPS"
        } else {
            "GDN_RULE_V6_WARPS"
        };
        Self::named(fwd.as_deref(), std::env::var(warps).ok().as_deref())
    }

    /// The kernels `GDN_RULE_FWD` and `GDN_RULE_V6_WARPS` values name (`None`: unset).
    fn named(fwd: Option<&str>, warps: Option<&str>) -> FwdKernel {
        let warps = warps.and_then(|w| w.parse().ok()).unwrap_or(0);
        match fwd {
            Some("v5") => FwdKernel::V5,
            Some("v6") => FwdKernel::V6 { warps },
            Some("v6b") => FwdKernel::V6Bulk { warps },
            Some("v8") => FwdKernel::V8 { warps },
            Some("v9") => FwdKernel::V9 { warps },
            Some("v10") => FwdKernel::V10 { warps },
            Some("v10f") => FwdKernel::V10Fast { warps },
            Some("v6l") => FwdKernel::V6Lean { warps },
            _ if warps != 0 => FwdKernel::V6Lean { warps },
            _ => FwdKernel::Auto,
        }
    }
}

/// Whether [`FwdKernel::V6`] runs for this storage type and shape (else v5 does).
pub fn v6_supports(dt: DType, s: RuleShape) -> bool {
    dt == DType::Bf16 && (s.dk == 64 || s.dk == 128) && s.dv.is_multiple_of(16)
}

/// Bytes of one pipeline stage of `gdr_fwd6` (the .cu file's `V6<DK, NW>::STAGE`): W, K, Q
/// (64 rows of Dk + 8 bf16), A (64 rows of 72 bf16), the U tile (64 rows of 16 NW + 4 fp32),
/// gam (64 fp32).
pub fn v6_stage_bytes(dk: usize, warps: usize) -> usize {
    3 * C * (dk + 8) * 2 + C * (C + 8) * 2 + C * (16 * warps + 4) * 4 + C * 4
}

/// CTA width of `gdr_fwd6` (warps, each 16 state columns): `forced` if it is valid, else the
/// width with the lowest modelled cost. Every CTA needs more than half of an SM's shared memory
/// (one CTA per SM), and each warp re-reads the chunk's W, K, Q and A fragments from shared
/// memory, so the model is: waves x (shared-memory bytes per SM per chunk step).
fn v6_warps(gpu: &Gpu, n_seq: usize, s: RuleShape, forced: usize) -> usize {
    fused_scan_warps(
        gpu.sm_count().unwrap_or(132),
        n_seq,
        s,
        C,
        forced,
        |w| s.dv.is_multiple_of(16 * w),
        |w| v6_stage_bytes(s.dk, w),
    )
}

static V6_STAGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// 0: from the environment (`GDN_RULE_OVERLAP=0` turns it off); 1 off; 2 on.
static OVERLAP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether the v6 backward runs its two scans side by side (see `backward_v6`): on unless
/// `GDN_RULE_OVERLAP=0` or [`set_backward_overlap`]`(false)`.
fn backward_overlap() -> bool {
    match OVERLAP.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => std::env::var("GDN_RULE_OVERLAP").map_or(true, |v| v != "0"),
    }
}

/// Tests and benchmarks (process-wide): run the v6 backward's state recompute and reverse scan
/// side by side on two streams (`true`, the default) or one after the other (`false`). Same
/// kernels and bits either way.
#[doc(hidden)]
pub fn set_backward_overlap(on: bool) {
    OVERLAP.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Benchmarks only (process-wide): `2` makes the fused v6 kernel use two pipeline stages even
/// where three fit; anything else restores the default (three where they fit).
#[doc(hidden)]
pub fn set_v6_stages(n: usize) {
    V6_STAGES.store(n, Ordering::Relaxed);
}

/// An uninitialized bf16 buffer of `n` elements (at least one; poisoned in tests).
fn ws_bf16(gpu: &Arc<Gpu>, n: usize) -> Result<GBuf<u16>> {
    let b = gpu.uninit::<u16>(n.max(1))?;
    poison(&b)?;
    Ok(b)
}

/// The v6 forward (callers checked the inputs and [`v6_supports`]).
#[allow(clippy::too_many_arguments)]
fn forward_v6(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    h0: Option<&GBuf<f32>>,
    want_final: bool,
    warps: usize,
    loads: V6Loads,
    prep_kind: PrepKernel,
    keep_t: bool,
) -> Result<SavingForward> {
    let st = gpu.stream();
    let dt = DType::Bf16;
    if loads == V6Loads::NoReload && (s.dk != 128 || ![1, 2].contains(&warps)) {
        return Err(GdnError::Invalid(
            "gated delta rule v6 (no reload, benchmarks only): Dk 128 with 1 or 2 warps".into(),
        ));
    }
    let ch = Chunks::new(gpu, seqs)?;
    // The chunk inverses to keep (prep8 / prep9 write them beside their other outputs).
    let kept = if keep_t && prep_keeps_t(resolve_prep(gpu, prep_kind, ch.count, s)?) {
        Some(ws(gpu, ch.count * s.hv * T_PACKED)?)
    } else {
        None
    };
    // Prep: the normalized q, k (fp32 and bf16, with the in-kernel norm), gam, W (bf16), U, A
    // (v10: T diag(beta) hi + lo instead of W and U).
    let pre = v6_prep(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        &ch,
        s,
        opts,
        seqs.used(),
        false,
        false,
        true,
        prep_kind,
        kept.as_ref().map_or(TSaved::No, TSaved::Out),
        if matches!(loads, V6Loads::Ring10 | V6Loads::Ring10Fast) {
            PrepOut::Pt
        } else {
            PrepOut::WU
        },
    )?;
    let (qb, kb) = match &pre.norm {
        Some(o) => (&o[0].1, &o[1].1),
        None => (q, k),
    };
    let (gam, w, u) = (&pre.gam, &pre.w, &pre.u);
    let Some(a) = pre.a.as_ref() else {
        unreachable!("the forward's prep computes A")
    };
    // Scan + output.
    let fin = if want_final {
        Some(out_f32(gpu, seqs.count() * s.hv * s.dk * s.dv)?)
    } else {
        None
    };
    let mut o = out_d(gpu, seqs.tokens() * s.hv * s.dv, dt)?;
    if matches!(
        loads,
        V6Loads::Split | V6Loads::Ring | V6Loads::Ring10 | V6Loads::Ring10Fast
    ) {
        launch_fwd8(
            gpu,
            qb,
            kb,
            v,
            &pre,
            a,
            &ch,
            seqs,
            s,
            opts,
            h0,
            fin.as_ref(),
            &o,
            warps,
            loads,
        )?;
        zero_tail(
            "gated delta rule",
            gpu,
            &mut o,
            seqs.used(),
            seqs.tokens(),
            s.hv * s.dv,
        )?;
        return Ok((o, fin, kept));
    }
    let nw = v6_warps(gpu, seqs.count(), s, warps);
    // Three pipeline stages where they fit in shared memory (Dk 128, 1 or 2 warps), else two.
    let three = s.dk == 128 && nw <= 2 && loads != V6Loads::NoReload;
    let stages = match V6_STAGES.load(Ordering::Relaxed) {
        2 => 2,
        _ if three => 3,
        _ => 2,
    };
    let (name, bars) = match (loads, stages) {
        (V6Loads::CpAsync, 3) => ("gdr_fwd6s3", 0),
        (V6Loads::CpAsync, _) => ("gdr_fwd6", 0),
        (V6Loads::Bulk, 3) => ("gdr_fwd6bs3", 32),
        (V6Loads::Bulk, _) => ("gdr_fwd6b", 32),
        (V6Loads::NoReload, _) => ("gdr_fwd6n", 0),
        (V6Loads::Lean, 3) => ("gdr_fwd6ls3", 0),
        (V6Loads::Lean, _) => ("gdr_fwd6l", 0),
        (V6Loads::Split | V6Loads::Ring | V6Loads::Ring10 | V6Loads::Ring10Fast, _) => {
            unreachable!("launched by launch_fwd8")
        }
    };
    launch_in_threads(
        gpu,
        MODULE,
        &format!("{name}_d{}_w{nw}", s.dk),
        seqs.count() * s.hv * (s.dv / (16 * nw)),
        32 * nw as u32,
        stages * v6_stage_bytes(s.dk, nw) + bars,
        &[
            dptr(qb, st),
            dptr(kb, st),
            ptr(gam, st),
            ptr(w, st),
            ptr(u, st),
            ptr(a, st),
            ptr(&ch.seq, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(h0, st),
            dptr(&o, st),
            optr(fin.as_ref(), st),
        ],
    )?;
    zero_tail(
        "gated delta rule",
        gpu,
        &mut o,
        seqs.used(),
        seqs.tokens(),
        s.hv * s.dv,
    )?;
    Ok((o, fin, kept))
}

// ---------------------------------------------------------------------------------------------
// v8 forward (issue 13, opt-in): see the v8 section of gated_delta_rule.cu.

/// Shared-memory bytes of `gdr_fwd8` (the .cu file's `NS * V8<DK, NW>::STAGE + NW * XB`): `stages`
/// stages of v6's layout for 16 `warps / 2` columns plus a 4 KB exchange buffer per warp.
pub fn v8_bytes(dk: usize, warps: usize, stages: usize) -> usize {
    stages * v6_stage_bytes(dk, warps / 2) + warps * 4096
}

/// The largest dynamic shared memory a block may opt in to (227 KB on the H100 / H200).
fn smem_optin(gpu: &Gpu) -> usize {
    gpu.stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .unwrap_or(232_448)
        .max(0) as usize
}

/// CTA width of `gdr_fwd8` (warps: 2, 4 or 8, i.e. 16, 32 or 64 state columns): `forced` if it
/// is valid, else by a model of waves x per-step time: one CTA per SM (each needs most of the
/// shared memory), 2 and 4 warps put one warp on a scheduler (the same step time), 8 put two
/// (each scheduler issues both warps' mma: ~4/3 of the step time, from 2 x 106 mma against
/// ~1.4 us of one warp's latency-bound step).
fn v8_warps(gpu: &Gpu, n_seq: usize, s: RuleShape, forced: usize) -> usize {
    let fits = |w: usize| s.dv.is_multiple_of(8 * w);
    if [2, 4, 8].contains(&forced) && fits(forced) {
        return forced;
    }
    let sms = gpu.sm_count().unwrap_or(132);
    let mut best = (usize::MAX, 2);
    for w in [4, 8, 2] {
        if !fits(w) {
            continue;
        }
        let ctas = n_seq * s.hv * (s.dv / (8 * w));
        let cost = ctas.div_ceil(sms) * if w == 8 { 4 } else { 3 };
        if cost < best.0 {
            best = (cost, w);
        }
    }
    best.1
}

/// Pipeline stages of `gdr_fwd8` at this width: three where they fit in the device's shared
/// memory (and [`set_v6_stages`] does not ask for two), else two. `bytes`: the kernel's shared
/// memory by (Dk, warps, stages) (`v8_bytes`; `v10_bytes` for gdr_fwd10, which takes the same
/// rule).
fn v8_stages(gpu: &Gpu, dk: usize, warps: usize, bytes: fn(usize, usize, usize) -> usize) -> usize {
    let three = bytes(dk, warps, 3) <= smem_optin(gpu) && !(dk == 128 && warps == 8);
    if three && V6_STAGES.load(Ordering::Relaxed) != 2 {
        3
    } else {
        2
    }
}

/// Shared-memory bytes of `gdr_fwd9` (the .cu file's `NS * STAGE + NW * XB + 16 NS`): v8's
/// plus a full and an empty mbarrier per stage.
pub fn v9_bytes(dk: usize, warps: usize, stages: usize) -> usize {
    v8_bytes(dk, warps, stages) + 16 * stages
}

/// 0: by width and arch ([`v9_producer_warps`]); 1 or 4: forced (see [`set_v9_producer`]).
static V9_PRODUCER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Benchmarks and tests: the producer of `gdr_fwd9` at 8 compute warps, 1 (one warp, 288
/// threads: ptxas budgets whole warpgroups, so 168 registers each, small spills) or 4 (a
/// warpgroup, 384 threads, setmaxnreg: 40 for the producer, 232 for the compute warps); 0
/// restores the default (4 on sm_90a, else 1). Widths 2 and 4 always take one producer warp.
/// Process-wide.
pub fn set_v9_producer(warps: usize) {
    V9_PRODUCER.store(warps, Ordering::Relaxed);
}

/// Producer warps of `gdr_fwd9` at `nw` compute warps: a whole warpgroup (setmaxnreg) only at 8
/// compute warps on sm_90a, where one producer warp would cap every thread at 168 registers.
fn v9_producer_warps(gpu: &Gpu, nw: usize) -> usize {
    if nw != 8 {
        return 1;
    }
    match V9_PRODUCER.load(Ordering::Relaxed) {
        1 => 1,
        4 => 4,
        _ if gpu.arch() == "sm_90a" => 4,
        _ => 1,
    }
}

/// Bytes of one pipeline stage of `gdr_fwd10` (the .cu file's `V10S<DK, NC>::STAGE`, BV = 16 NC
/// columns): K, Q (64 rows of Dk + 8 bf16), T diag(beta) hi and lo and A (64 rows of 72 bf16),
/// the V tile (64 rows of BV + 8 bf16), gam (64 fp32).
pub fn v10_stage_bytes(dk: usize, bv: usize) -> usize {
    2 * C * (dk + 8) * 2 + 3 * C * (C + 8) * 2 + C * (bv + 8) * 2 + C * 4
}

/// Shared-memory bytes of `gdr_fwd10` (`NS * STAGE + NW * XB + 16 NS`) at `warps` compute warps
/// (16 `warps / 2` columns).
pub fn v10_bytes(dk: usize, warps: usize, stages: usize) -> usize {
    stages * v10_stage_bytes(dk, 8 * warps) + warps * 4096 + 16 * stages
}

/// The v8 fused scan + output on v6's prep outputs (`loads`: `Split` v8's `gdr_fwd8*`; `Ring`
/// v9's `gdr_fwd9*`, sm_90+; `Ring10` / `Ring10Fast` v10's `gdr_fwd10*` / `gdr_fwd10f*` on
/// prep8o / 9o's outputs and the input `v`, sm_90+).
#[allow(clippy::too_many_arguments)]
fn launch_fwd8(
    gpu: &Arc<Gpu>,
    qb: &DBuf,
    kb: &DBuf,
    v: &DBuf,
    pre: &V6Prep,
    a: &GBuf<u16>,
    ch: &Chunks,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    h0: Option<&GBuf<f32>>,
    fin: Option<&GBuf<f32>>,
    o: &DBuf,
    warps: usize,
    loads: V6Loads,
) -> Result<()> {
    let st = gpu.stream();
    let mut nw = v8_warps(gpu, seqs.count(), s, warps);
    let rebuild = matches!(loads, V6Loads::Ring10 | V6Loads::Ring10Fast);
    let (name, threads, bytes) = if rebuild {
        // its 8-warp kernels take a producer warpgroup (setmaxnreg: sm_90a)
        if nw == 8 && gpu.arch() != "sm_90a" {
            nw = 4;
        }
        let ns = v8_stages(gpu, s.dk, nw, v10_bytes);
        let pw = if nw == 8 { 4 } else { 1 };
        let f = if loads == V6Loads::Ring10Fast {
            "f"
        } else {
            ""
        };
        (
            format!("gdr_fwd10{f}_d{}_w{nw}_s{ns}_p{pw}", s.dk),
            32 * (nw + pw),
            v10_bytes(s.dk, nw, ns),
        )
    } else if loads == V6Loads::Ring {
        let mut ns = v8_stages(gpu, s.dk, nw, v8_bytes);
        // v9's 16 NS bytes of mbarriers fit wherever v8's stages do (w4 s3 at Dk 128: 229,168
        // of 232,448); two stages if a device says otherwise.
        if v9_bytes(s.dk, nw, ns) > smem_optin(gpu) {
            ns = 2;
        }
        let pw = v9_producer_warps(gpu, nw);
        (
            format!("gdr_fwd9_d{}_w{nw}_s{ns}_p{pw}", s.dk),
            32 * (nw + pw),
            v9_bytes(s.dk, nw, ns),
        )
    } else {
        let ns = v8_stages(gpu, s.dk, nw, v8_bytes);
        (
            format!("gdr_fwd8_d{}_w{nw}_s{ns}", s.dk),
            32 * nw,
            v8_bytes(s.dk, nw, ns),
        )
    };
    launch_in_threads(
        gpu,
        MODULE,
        &name,
        seqs.count() * s.hv * (s.dv / (8 * nw)),
        threads as u32,
        bytes,
        &[
            dptr(qb, st),
            dptr(kb, st),
            ptr(&pre.gam, st),
            // W, or v10's T diag(beta) hi + lo
            ptr(&pre.w, st),
            // U, or v10's input V
            if rebuild {
                dptr(v, st)
            } else {
                ptr(&pre.u, st)
            },
            ptr(a, st),
            ptr(&ch.seq, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(h0, st),
            dptr(o, st),
            optr(fin, st),
        ],
    )
}

/// Benchmarks and tests only: v8's chain microbenchmark, one CTA of `warps` warps (2, 4 or 8:
/// 16 `warps / 2` columns, Dk = 128 split per warp pair) running `steps` dependent chunk steps
/// of `gdr_fwd8`'s chain (and its output products with `output`) on operands loaded once
/// ([`ChainInputs`] with U `[64][8 warps]`); returns S `[128][8 warps]` (fp32).
#[doc(hidden)]
pub fn chain8(
    gpu: &Arc<Gpu>,
    x: &ChainInputs,
    warps: usize,
    output: bool,
    steps: usize,
) -> Result<GBuf<f32>> {
    if ![2, 4, 8].contains(&warps)
        || x.u.len() != C * 8 * warps
        || x.w.len() != C * 128
        || x.k.len() != C * 128
        || x.a.len() != C * C
        || x.gam.len() != C
    {
        return Err(GdnError::Invalid(format!(
            "chain8: {warps} warps with W {}, K {}, A {}, U {}, gam {} values",
            x.w.len(),
            x.k.len(),
            x.a.len(),
            x.u.len(),
            x.gam.len()
        )));
    }
    let st = gpu.stream();
    let out = out_f32(gpu, 128 * 8 * warps)?;
    launch_in_threads(
        gpu,
        MODULE,
        &format!("gdr_chain8_d128_w{warps}_o{}", output as u8),
        1,
        32 * warps as u32,
        v8_bytes(128, warps, 1),
        &[
            ptr(&x.w, st),
            ptr(&x.k, st),
            ptr(&x.a, st),
            ptr(&x.u, st),
            ptr(&x.gam, st),
            Arg::I32(steps.min(i32::MAX as usize) as i32),
            ptr(&out, st),
        ],
    )?;
    Ok(out)
}

/// Operands of the chain microbenchmark ([`chain6`]): one chunk's W, K (bf16 bits, `[64][128]`),
/// A (bf16 bits, `[64][64]`), U (`[64][16 warps]`) and gam (`[64]`), on the device.
#[doc(hidden)]
pub struct ChainInputs {
    pub w: GBuf<u16>,
    pub k: GBuf<u16>,
    pub a: GBuf<u16>,
    pub u: GBuf<f32>,
    pub gam: GBuf<f32>,
}

/// Benchmarks and tests only: one CTA of `warps` warps (1, 2, 4 or 8; with `output`, 1 or 2)
/// runs `steps` dependent chunk steps of the v6 scan's chain (Dk = 128) on operands loaded once,
/// and returns the state S `[128][16 warps]` (fp32).
#[doc(hidden)]
pub fn chain6(
    gpu: &Arc<Gpu>,
    x: &ChainInputs,
    warps: usize,
    output: bool,
    steps: usize,
) -> Result<GBuf<f32>> {
    let ok = if output {
        [1, 2].contains(&warps)
    } else {
        [1, 2, 4, 8].contains(&warps)
    };
    if !ok || x.u.len() != C * 16 * warps || x.w.len() != C * 128 || x.k.len() != C * 128 {
        return Err(GdnError::Invalid(format!(
            "chain6: {warps} warps (output {output}) with W {}, K {}, U {} values",
            x.w.len(),
            x.k.len(),
            x.u.len()
        )));
    }
    if x.a.len() != C * C || x.gam.len() != C {
        return Err(GdnError::Invalid(
            "chain6: A must be 64 x 64 and gam 64".into(),
        ));
    }
    let st = gpu.stream();
    let out = out_f32(gpu, 128 * 16 * warps)?;
    launch_in_threads(
        gpu,
        MODULE,
        &format!("gdr_chain6_d128_w{warps}_o{}", output as u8),
        1,
        32 * warps as u32,
        v6_stage_bytes(128, warps),
        &[
            ptr(&x.w, st),
            ptr(&x.k, st),
            ptr(&x.a, st),
            ptr(&x.u, st),
            ptr(&x.gam, st),
            Arg::I32(steps.min(i32::MAX as usize) as i32),
            ptr(&out, st),
        ],
    )?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// v6 backward (issue 13, stage A, opt-in): see the v6 backward section of gated_delta_rule.cu.

/// Which kernels run the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdKernel {
    /// v5: prep, scan (fp32 chunk-start states), dD_loc, reverse scan, per-chunk gradients, GVA
    /// reduction; TF32 tensor cores for bf16.
    V5,
    /// v6 pieces on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), each on or off;
    /// bf16 storage with Dk 64 / 128 only (v5 elsewhere). `recompute`: the chunk-start states
    /// by `gdr_prep6` + `gdr_hrec6` (the v6 forward's chain) instead of prep + scan; `scan`:
    /// dD_loc and the reverse scan fused in `gdr_bwd6` (after `gdr_qk6`) instead of dd_local +
    /// scan_bwd. The per-chunk gradients and the GVA reduction stay v5's. `bf16_states` (with
    /// both pieces only): the chunk-start states h and their gradients dh are stored bf16 (half
    /// the bytes; `gdr_grad_h16_*` reads them) instead of fp32. `warps` per CTA of the v6 scans
    /// as in [`FwdKernel::V6`] (0 picks by shape). `grad` (with both pieces and bf16 states, Dk
    /// and Dv 64 or 128; v5's gdr_grad elsewhere): the per-chunk gradients by `gdr_grad6` (bf16
    /// tensor cores, every operand staged once in shared memory) instead of v5's `gdr_grad`.
    /// `grad7` (with `grad`): `gdr_grad7` instead of `gdr_grad6`: one CTA per (chunk, key head)
    /// over the GVA group's value heads, dq and dk summed in the CTA and written through the
    /// l2norm backward (no `gdr_reduce_qk`, no per-value-head fp32 partials).
    V6 {
        recompute: bool,
        scan: bool,
        bf16_states: bool,
        grad: bool,
        grad7: bool,
        warps: usize,
    },
}

impl BwdKernel {
    /// The default (and `GDN_RULE_BWD=v7`): every v6 piece (both scans, bf16 states) with
    /// gdr_grad7; `v6` the same with gdr_grad6 (and v5's GVA reduction); `v5` the v5 backward;
    /// `v6h` (both scans, bf16 states, v5's gradient kernel),
    /// `v6f` (both scans, fp32 states), `v6r` (the recompute only), `v6s` (the reverse scan
    /// only), with `GDN_RULE_V6_WARPS` as for the forward. Where v6 does not apply (f32
    /// storage, other head dims) every choice runs v5.
    pub fn from_env() -> BwdKernel {
        let warps = std::env::var("GDN_RULE_V6_WARPS")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(0);
        let v6 = |recompute, scan, bf16_states, grad| BwdKernel::V6 {
            recompute,
            scan,
            bf16_states,
            grad,
            grad7: false,
            warps,
        };
        match std::env::var("GDN_RULE_BWD").as_deref() {
            Ok("v5") => BwdKernel::V5,
            Ok("v6") => v6(true, true, true, true),
            Ok("v6h") => v6(true, true, true, false),
            Ok("v6f") => v6(true, true, false, false),
            Ok("v6r") => v6(true, false, false, false),
            Ok("v6s") => v6(false, true, false, false),
            _ => BwdKernel::V6 {
                recompute: true,
                scan: true,
                bf16_states: true,
                grad: true,
                grad7: true,
                warps,
            },
        }
    }
}

/// The selected pieces of a v6 backward.
#[derive(Clone, Copy)]
struct V6Pieces {
    recompute: bool,
    scan: bool,
    bf16_states: bool,
    grad: bool,
    grad7: bool,
    warps: usize,
}

thread_local! {
    static HREC8: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the v6 backward's recompute
/// run `gdr_hrec8` (v8's split chain: the same outputs, another summation order), `Some(false)`
/// `gdr_hrec6`; `None` (the default) follows `GDN_RULE_HREC` (`v8` selects `gdr_hrec8`; else
/// `gdr_hrec6`).
#[doc(hidden)]
pub fn set_hrec8(on: Option<bool>) {
    HREC8.with(|c| c.set(on));
}

fn hrec8_on() -> bool {
    HREC8
        .with(|c| c.get())
        .unwrap_or_else(|| std::env::var("GDN_RULE_HREC").as_deref() == Ok("v8"))
}

thread_local! {
    static BWD8: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static BWD9: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the v6 backward's reverse scan
/// run `gdr_bwd9` on GPUs with mbarrier waits (sm_90 and newer; elsewhere this changes nothing):
/// `gdr_bwd8`'s chunk step, the same bits, with its operand loads issued by a producer warp into
/// a two-stage mbarrier ring (no CTA-wide barrier per chunk), at `gdr_bwd8`'s width, whatever
/// [`set_bwd8`] says. `Some(false)` leaves the choice to [`set_bwd8`]; `None` (the default)
/// follows `GDN_RULE_BWD_SCAN` (`v9` selects `gdr_bwd9`).
#[doc(hidden)]
pub fn set_bwd9(on: Option<bool>) {
    BWD9.with(|c| c.set(on));
}

fn bwd9_on(gpu: &Gpu) -> bool {
    gpu_has_bulk_copies(gpu)
        && BWD9
            .with(|c| c.get())
            .unwrap_or_else(|| std::env::var("GDN_RULE_BWD_SCAN").as_deref() == Ok("v9"))
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the v6 backward's reverse scan
/// run `gdr_bwd8` (v8's split of dS's Dk rows between warp pairs: the same outputs and layouts,
/// another summation order), `Some(false)` `gdr_bwd6`; `None` (the default) follows
/// `GDN_RULE_BWD_SCAN` (`v8` selects `gdr_bwd8`, `v6` `gdr_bwd6`; unset: by shape, as the
/// forward, [`auto_picks_v8`]: measured on the H200, B1 T32768 16/32 bwd8 2.12 ms against
/// bwd6's 2.49 (backward 10.24 -> 9.89 with the overlap), B8 T4096 16/16 0.74 against 0.55).
#[doc(hidden)]
pub fn set_bwd8(on: Option<bool>) {
    BWD8.with(|c| c.set(on));
}

fn bwd8_on(gpu: &Gpu, n_seq: usize, s: RuleShape) -> bool {
    BWD8.with(|c| c.get())
        .unwrap_or_else(|| match std::env::var("GDN_RULE_BWD_SCAN").as_deref() {
            Ok("v8") => true,
            Ok("v6") => false,
            _ => auto_picks_v8(n_seq, s.hv, s.dv, gpu.sm_count().unwrap_or(132)),
        })
}

/// Dynamic shared memory of `gdr_bwd8` (the .cu file's `2 * V6G<DK, NW / 2>::STAGE + NW *
/// 2048`): two stages of `gdr_bwd6`'s layout for 16 `warps / 2` columns plus a 2 KB exchange
/// buffer per warp (141,824 bytes at Dk 128, 4 warps).
pub fn bwd8_bytes(dk: usize, warps: usize) -> usize {
    2 * v6g_stage_bytes(dk, warps / 2) + warps * 2048
}

thread_local! {
    static BWD10: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the v6 backward run its two
/// scans on the v10 forward's operands (issue 13, opt-in; written in session 19, not yet run on a
/// GPU): the prep reads the kept T and writes PT = T diag(beta) (bf16 hi + lo) instead of W and U
/// (`gdr_prep8to` / `gdr_prep9to`, or `gdr_prep8o` / `gdr_prep9o` when no T was kept), the
/// recompute is `gdr_hrec10` (D = PT (V - diag(e^gam) K S0), gdr_hrec6's layout and width) and
/// the reverse scan `gdr_bwd10` (gdr_bwd8's, its W product rebuilt from PT and K, at gdr_bwd8's
/// width), whatever [`set_bwd8`], [`set_bwd9`] and [`set_hrec8`] say. Another summation order
/// and rounding than the default's: held to the f64 tests, not to its bits. `Some(false)` the
/// default scans; `None` follows `GDN_RULE_BWD_SCAN` (`v10` selects these).
#[doc(hidden)]
pub fn set_bwd10(on: Option<bool>) {
    BWD10.with(|c| c.set(on));
}

thread_local! {
    static HREC10: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the v6 backward's recompute
/// `gdr_hrec10` (see [`set_bwd10`]) beside the default reverse scan, which still reads W: the
/// prep writes T diag(beta) and W but no U (`gdr_prep8tow` / `gdr_prep9tow`, or `gdr_prep8ow` /
/// `9ow` when no T was kept), whatever [`set_hrec8`] says. [`set_bwd10`] implies it. `Some(false)`
/// the v6 / v8 recompute ([`set_hrec8`]'s choice). `None` (the default): see `hrec10_on`
/// (gdr_hrec10 on sm_90 and newer with prep8 / prep9, unless [`set_hrec8`] or
/// `GDN_RULE_HREC=v6|v8` chose another).
#[doc(hidden)]
pub fn set_hrec10(on: Option<bool>) {
    HREC10.with(|c| c.set(on));
}

/// Whether the backward's recompute is `gdr_hrec10`: [`set_hrec10`]'s choice; else not when
/// [`set_hrec8`] chose between hrec6 and hrec8 on this thread; else `GDN_RULE_HREC` (`v10`
/// selects it, `v6` / `v8` the others); unset (or `auto`), on GPUs with mbarrier-completed copies
/// (sm_90 and newer) when the prep is prep8 / prep9 (the default since session 20: measured on
/// the H200, backward prep9tow 0.63 ms against prep9t's 0.77 at B1 T32768 16/32 with hrec10b
/// hidden beside the reverse scan, rule fwd+bwd 6.96 -> 6.87; B8 T4096 16/16 4.00 -> 3.91).
fn hrec10_on(gpu: &Gpu, prep: PrepKernel) -> bool {
    if let Some(on) = HREC10.with(|c| c.get()) {
        return on;
    }
    if HREC8.with(|c| c.get()).is_some() {
        return false;
    }
    match std::env::var("GDN_RULE_HREC").as_deref() {
        Ok("v10") => true,
        Ok("auto") | Err(_) => gpu_has_bulk_copies(gpu) && prep_keeps_t(prep),
        Ok(_) => false,
    }
}

fn bwd10_on() -> bool {
    BWD10
        .with(|c| c.get())
        .unwrap_or_else(|| std::env::var("GDN_RULE_BWD_SCAN").as_deref() == Ok("v10"))
}

/// Bytes of one pipeline stage of `gdr_hrec10` (the .cu file's `V10R<DK, NW>::STAGE`): K (64
/// rows of Dk + 8 bf16), PT hi and lo (64 rows of 72 bf16 each), the CTA's V tile (64 rows of
/// 16 NW + 8 bf16), gam.
pub fn v10r_stage_bytes(dk: usize, warps: usize) -> usize {
    C * (dk + 8) * 2 + 2 * C * (C + 8) * 2 + C * (16 * warps + 8) * 2 + C * 4
}

/// Dynamic shared memory of `gdr_bwd10` (`2 * V10S<DK, NW / 2>::STAGE + NW * 2048`): two of
/// gdr_fwd10's stages (the dO tile in V's place) for 16 `warps / 2` columns plus gdr_bwd8's
/// 2 KB exchange buffer per warp (143,872 bytes at Dk 128, 4 warps).
pub fn bwd10_bytes(dk: usize, warps: usize) -> usize {
    2 * v10_stage_bytes(dk, 8 * warps) + warps * 2048
}

/// The backward's state-recompute launch (`gdr_hrec6` or `gdr_hrec8`), held back to run beside
/// `gdr_bwd6` on the second stream.
struct HrecLaunch {
    name: String,
    grid: usize,
    threads: u32,
    smem: usize,
    args: Vec<Arg>,
}

/// Bytes of one pipeline stage of `gdr_hrec6` (the .cu file's `V6R<DK, NW>::STAGE`): W, K (64
/// rows of Dk + 8 bf16), the U tile (64 rows of 16 NW + 4 fp32), gam.
pub fn v6r_stage_bytes(dk: usize, warps: usize) -> usize {
    2 * C * (dk + 8) * 2 + C * (16 * warps + 4) * 4 + C * 4
}

/// Bytes of one pipeline stage of `gdr_bwd6` (`V6G<DK, NW>::STAGE`): K, Q, W (64 rows of Dk + 8
/// bf16), A (64 rows of 72 bf16), the dO tile (64 rows of 16 NW + 8 bf16), gam.
pub fn v6g_stage_bytes(dk: usize, warps: usize) -> usize {
    3 * C * (dk + 8) * 2 + C * (C + 8) * 2 + C * (16 * warps + 8) * 2 + C * 4
}

/// Dynamic shared memory of `gdr_grad6` (the .cu file's `G6<DK, DV>::BYTES`): Q, K, dW (64 rows
/// of Dk + 8 bf16), V, dO, D, dD (64 rows of Dv + 8), T (64 rows of 72), then h and dh (Dk rows
/// of Dv + 8) or, later, three fp32 64 x 65 and two bf16 64 x 72 matrices, then 7 x 64 + 32 fp32.
pub fn g6_bytes(dk: usize, dv: usize) -> usize {
    let (lk, lv, lc, lf) = (dk + 8, dv + 8, C + 8, C + 1);
    let base = 3 * C * lk * 2 + 4 * C * lv * 2 + C * lc * 2;
    let u1 = 2 * dk * lv * 2;
    let u2 = 3 * C * lf * 4 + 2 * C * lc * 2;
    base + u1.max(u2) + (7 * C + 32) * 4
}

/// Dynamic shared memory of `gdr_grad7` (`G7<DK, DV>::BYTES`): `gdr_grad6`'s layout and four
/// pairs of 64 fp32 row partials.
pub fn g7_bytes(dk: usize, dv: usize) -> usize {
    g6_bytes(dk, dv) + 8 * C * 4
}

/// Dynamic shared memory of `gdr_grad8` (`G8<DK, DV>::BYTES`): six bf16 slots reused between
/// the phases (dO | dD | h, dh, then Q and K | D | dW: 3 x 64 rows of Dv + 8, max(Dk rows of
/// Dv + 8, 128 rows of Dk + 8), 64 rows of Dk + 8) and 23 x 64 + 32 fp32 (vectors, row and
/// column partials): 110,464 bytes at Dk = Dv = 128, so two CTAs fit on an SM.
pub fn g8_bytes(dk: usize, dv: usize) -> usize {
    let (lk, lv) = (dk + 8, dv + 8);
    let hq = (dk * lv).max(2 * C * lk);
    (3 * C * lv + hq + C * lk) * 2 + (23 * C + 32) * 4
}

/// Dynamic shared memory of `gdr_grad10` (`G10<DK, DV>::BYTES`, two K buffers): SW128 bf16
/// tiles (Q, K twice, dW: 64 x Dk; h, dh: Dk x Dv; V, dO, D, dD: 64 x Dv; T, G, dP (also dT's
/// scratch): 64 x 64), two sets of gate vectors (4 x 64 fp32) and of row partials (4 x 64 + 8),
/// the 64 x 64 warpgroup's 8 x 64 fp32 scratch, 32 mbarriers and 1 KB to round the base up to
/// 1024 bytes: 228,672 bytes at Dk = Dv = 128 (one CTA per SM).
pub fn g10_bytes(dk: usize, dv: usize) -> usize {
    let tiles = 4 * C * dk * 2 + 2 * dk * dv * 2 + 4 * C * dv * 2 + 3 * C * C * 2;
    tiles + 2 * 4 * C * 4 + (2 * 4 * C + 16) * 4 + 8 * C * 4 + 32 * 8 + 1024
}

/// `gdr_grad10_k1` / `gdr_grad10b_k1`'s (`G10<DK, DV, 1>::BYTES`, session 17's layout: one K
/// buffer, dT's own scratch tile, 28 mbarriers): 220,448 bytes at Dk = Dv = 128.
pub fn g10_k1_bytes(dk: usize, dv: usize) -> usize {
    g10_bytes(dk, dv) - C * dk * 2 + C * C * 2 - 4 * 8
}

thread_local! {
    static GRAD8: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static GRAD10: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static WS16: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static G10SPLIT0: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static G10K1: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tests only: on the calling thread, `true` runs gdr_grad10 at Dk = Dv = 128 with one K buffer
/// (`gdr_grad10_k1_*` / `gdr_grad10b_k1_*`, session 17's kernel: the next item's Q and K load
/// only after the item's last product) instead of two (the default since session 20: item it's
/// K in buffer it % 2, Q with its own barriers): the same products on the same operands, so the
/// same bits.
#[doc(hidden)]
pub fn set_g10_k1(on: bool) {
    G10K1.with(|c| c.set(on));
}

/// Tests only: on the calling thread, `true` runs the layer's gdr_grad10b variant (bf16 D / dD,
/// caller-normalized q / k, Dk = Dv = 128) at the setmaxnreg split every other variant has
/// (`gdr_grad10b_r0_*`: 56 / 160 / 152 / 144 registers for the producer / q side / k side /
/// 64 x 64 side) instead of its own (56 / 168 / 160 / 128, the .cu file's `G10Regs`): the same
/// code and bits, another register allocation.
#[doc(hidden)]
pub fn set_g10_split0(on: bool) {
    G10SPLIT0.with(|c| c.set(on));
}

/// Tests and benchmarks: on the calling thread, `Some(true)` writes the backward's D and dD
/// workspaces in bf16 when gdr_grad10 runs and every kernel involved has the variant
/// (gdr_hrec6b, gdr_bwd6b / gdr_bwd8b, gdr_grad10b): the same bits of every output, half the
/// workspace bytes; `Some(false)` keeps them fp32 (gdr_grad10 rounds them to bf16 as it loads
/// them). `None` (the default) follows `GDN_RULE_WS16` (`1` / `0`), else the shape: bf16 with
/// at least 4 key heads, where gdr_grad10's producer is its bottleneck (measured 2026-12-03 at
/// B1 T32768 / B4 T8192 / packed, 16 / 32 heads: the rule's fwd+bwd -0.3 to -0.4 ms; since
/// session 20 also without GVA: `bench_rule g10ratio` at B8 T4096 16/16, backward 3.15 -> 2.69
/// ms, grad10 1.83 -> 1.41, the bf16 scans no slower; at 2 / 8 heads it was 0.1 to 0.5 ms slower
/// on 2026-12-03, before the scans' whole-sector bf16 stores, and has not been measured since).
#[doc(hidden)]
pub fn set_ws16(on: Option<bool>) {
    WS16.with(|c| c.set(on));
}

fn ws16_on(s: RuleShape) -> bool {
    WS16.with(|c| c.get())
        .unwrap_or_else(|| match std::env::var("GDN_RULE_WS16").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => s.hk >= 4,
        })
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the backward's per-chunk
/// gradients (the bf16 path's `gdr_grad7` family) run `gdr_grad10` on GPUs with wgmma (sm_90a;
/// elsewhere gdr_grad7 runs): the same outputs from the same bf16 operands by a persistent,
/// warp-specialized kernel (one CTA per SM, three compute warpgroups and a producer, dq and dk
/// summed over the value-head group in registers); results agree with gdr_grad7's to rounding.
/// See [`grad_kernel`] for how this and [`set_grad8`] combine.
#[doc(hidden)]
pub fn set_grad10(on: Option<bool>) {
    GRAD10.with(|c| c.set(on));
}

/// Tests and benchmarks: on the calling thread, `Some(true)` makes the backward's per-chunk
/// gradients run `gdr_grad8` (the same outputs; dq, dk, dv the same bits as gdr_grad7's, dg,
/// dbeta summed in another order; two CTAs per SM). See [`grad_kernel`].
#[doc(hidden)]
pub fn set_grad8(on: Option<bool>) {
    GRAD8.with(|c| c.set(on));
}

/// The per-chunk gradient kernel of the bf16 path (7, 8 or 10: `gdr_grad{n}`). A thread's
/// `Some(true)` from [`set_grad10`], [`set_grad8`] wins, in that order (10 only on sm_90a); any
/// other explicit setting (`Some(false)`) means gdr_grad7, the reference the tests compare with.
/// With none set, `GDN_RULE_GRAD` picks (`v7`, `v8`, `v10`; any other value, such as `v9` for
/// gdr_grad9, removed in session 13, means the default), and without it the default is
/// gdr_grad10 on sm_90a and gdr_grad7 elsewhere.
#[doc(hidden)]
pub fn grad_kernel(gpu: &Gpu) -> u32 {
    let wg = gpu.arch() == "sm_90a";
    let (t10, t8) = (GRAD10.with(|c| c.get()), GRAD8.with(|c| c.get()));
    if t10 == Some(true) && wg {
        return 10;
    }
    if t8 == Some(true) {
        return 8;
    }
    if t10.is_some() || t8.is_some() {
        return 7;
    }
    match std::env::var("GDN_RULE_GRAD").as_deref() {
        Ok("v7") => 7,
        Ok("v8") => 8,
        Ok("v10") if wg => 10,
        _ if wg => 10,
        _ => 7,
    }
}

/// Element-wise copy of `n` values between an fp32 and a bf16 buffer (`name`: gdr_cvt_f32_bf16
/// or gdr_cvt_bf16_f32).
fn cvt(gpu: &Arc<Gpu>, name: &str, x: Arg, y: Arg, n: usize) -> Result<()> {
    launch_in(
        gpu,
        MODULE,
        name,
        n.div_ceil(THREADS as usize).min(1 << 20),
        0,
        &[x, y, Arg::I64(n as i64)],
    )
}

/// The v6 backward (callers checked the inputs and [`v6_supports`]; at least one piece is on).
#[allow(clippy::too_many_arguments)]
fn backward_v6(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
    pieces: V6Pieces,
    prep_kind: PrepKernel,
    t_saved: Option<&GBuf<f32>>,
) -> Result<Grads> {
    let st = gpu.stream();
    let dt = DType::Bf16;
    let sf = suffix(dt);
    let (tokens, n_seq) = (seqs.tokens(), seqs.count());
    let ch = Chunks::new(gpu, seqs)?;
    let chh = ch.count * s.hv;
    // D and dD in bf16 (gdr_hrec6b, gdr_bwd6b / gdr_bwd8b write them rounded to nearest even,
    // gdr_grad10b copies them: the bits gdr_grad10 rounds fp32 ones to, at half the bytes) when
    // gdr_grad10 reads them and both scans have the variant (not gdr_hrec8 / gdr_bwd9). Their
    // workspaces stay f32-typed buffers of half the length (the kernels see raw pointers).
    let kern = grad_kernel(gpu);
    // The v10 scans (opt-in, set_bwd10): PT from the prep instead of W and U.
    // v10: both scans (gdr_hrec10, gdr_bwd10; the prep writes PT only); h10: gdr_hrec10 at
    // least (alone: beside the default reverse scan, the prep writing PT and W).
    // They need the default pieces (the recompute, the reverse scan, the grad7 / 8 / 10
    // gradients, which read neither W nor U); elsewhere (other GDN_RULE_BWD pieces, head sizes
    // without those gradient kernels) the default scans run, as with the other opt-in scans.
    let v10_fits = pieces.recompute && pieces.scan && pieces.grad7;
    // The forward's chunk inverses, where this backward's prep reads them (prep8 / prep9).
    let pk = resolve_prep(gpu, prep_kind, ch.count, s)?;
    let v10 = bwd10_on() && v10_fits;
    let h10 = (v10 || hrec10_on(gpu, pk)) && v10_fits;
    let td16 = pieces.grad7
        && pieces.recompute
        && pieces.scan
        && pieces.bf16_states
        && kern == 10
        && ws16_on(s)
        && (h10 || !hrec8_on())
        && (v10 || !bwd9_on(gpu));
    let dn = if td16 {
        chh * C * s.dv / 2
    } else {
        chh * C * s.dv
    };
    let b16 = if td16 { "b" } else { "" };
    // With the in-kernel norm: the normalized q, k in fp32 (prep, qk6, dd_local, gdr_grad: as
    // v5) and in bf16 (the v6 scans' mma operands), by the v6 pipeline's prep with the recompute
    // (which also gives gam, T, W, U and A), else by gdr_l2norm2 (its fp32 output has v5's
    // gdr_l2norm bits).
    let tsaved = match t_saved {
        Some(t) if prep_keeps_t(pk) => TSaved::In(t),
        _ => TSaved::No,
    };
    // gdr_grad10 after the recompute reads T from the forward's packed copy when there is one
    // (the prep then writes no fp32 T); its q, k row dots read the bf16 normalized rows (the
    // forward's mma operands), so the prep writes no fp32 copies of them for it.
    let g10 = pieces.recompute && pieces.grad7 && kern == 10;
    let t_pk = match tsaved {
        TSaved::In(t) if g10 => Some(t),
        _ => None,
    };
    let mut pre = if pieces.recompute {
        Some(v6_prep(
            gpu,
            q,
            k,
            v,
            g,
            beta,
            &ch,
            s,
            opts,
            seqs.used(),
            !g10,
            t_pk.is_none(),
            pieces.scan,
            prep_kind,
            tsaved,
            if v10 {
                PrepOut::Pt
            } else if h10 {
                PrepOut::PtW
            } else {
                PrepOut::WU
            },
        )?)
    } else {
        None
    };
    let norm = match pre.as_mut().map(|p| p.norm.take()) {
        Some(Some(v)) => {
            // (for gdr_grad10 the prep writes no fp32 copies: it reads the bf16 rows)
            if !g10 && v.iter().any(|(f, _)| f.is_none()) {
                return Err(GdnError::Device(
                    "rule backward: the prep wrote no fp32 q, k".into(),
                ));
            }
            Some(v)
        }
        Some(None) => None,
        None => {
            v6_norm(gpu, q, k, s, opts)?.map(|v| v.into_iter().map(|(f, b)| (Some(f), b)).collect())
        }
    };
    let mut a_pre = pre.as_mut().and_then(|p| p.a.take());
    // qq, kk: the fp32 normalized rows for gdr_grad7 / 8 (gdr_grad10 takes none: the raw rows
    // stand in where the prep wrote no copies)
    let (qq, kk, qb, kb) = match &norm {
        Some(o) => (
            o[0].0.as_ref().unwrap_or(q),
            o[1].0.as_ref().unwrap_or(k),
            &o[0].1,
            &o[1].1,
        ),
        None => (q, k, q, k),
    };
    let ks = chunk_sfx(dt, opts);
    let k_bytes = if opts.l2norm_in_kernel { 4 } else { 2 };
    let nw = v6_warps(gpu, n_seq, s, pieces.warps);
    let ctas = n_seq * s.hv * (s.dv / (16 * nw));

    let h16 = pieces.bf16_states;
    let o16 = |b: Option<&GBuf<u16>>| b.map_or(Arg::Ptr(0), |b| ptr(b, st));
    // The state recompute (gdr_hrec6) and the reverse scan (gdr_bwd6) read only the prep's
    // workspaces and the inputs, not each other's outputs, and each leaves most of every SM idle
    // (one CTA of 2 warps per SM at B1 T32768): with both v6 scans they run side by side, hrec6
    // on the GPU's second stream (same kernels, same bits; in order when profiling, capturing
    // or [`set_backward_overlap`]`(false)`).
    let overlap = pieces.recompute
        && pieces.scan
        && backward_overlap()
        && !crate::backend::launch::profiling()
        && gpu.side_stream()?.is_some();
    let mut hrec: Option<HrecLaunch> = None;
    // Recompute: gam, T, U (fp32), W (bf16 with v6's recompute, fp32 with v5's), chunk-start
    // states h (fp32, or bf16 with bf16 states) and D (fp32), in v5's layouts.
    let (gam, t, u, mut w32, mut w16, h32, h16b, d) = if let Some(p) = pre {
        let V6Prep { gam, t, w, u, .. } = p;
        let (h32, h16b) = if h16 {
            (None, Some(ws_bf16(gpu, chh * s.dk * s.dv)?))
        } else {
            (Some(ws(gpu, chh * s.dk * s.dv)?), None)
        };
        let d = ws(gpu, dn)?;
        // gdr_hrec8 (opt-in): the same outputs from v8's split chain, width by v8's model.
        let nw8 = v8_warps(gpu, n_seq, s, pieces.warps);
        let (name, grid, threads, smem) = if h10 {
            (
                format!("gdr_hrec10{b16}_d{}_w{nw}", s.dk),
                ctas,
                32 * nw as u32,
                2 * v10r_stage_bytes(s.dk, nw),
            )
        } else if hrec8_on() {
            (
                format!("gdr_hrec8_d{}_w{nw8}", s.dk),
                n_seq * s.hv * (s.dv / (8 * nw8)),
                32 * nw8 as u32,
                2 * v6r_stage_bytes(s.dk, nw8 / 2) + nw8 * 4096,
            )
        } else {
            (
                format!("gdr_hrec6{b16}_d{}_w{nw}", s.dk),
                ctas,
                32 * nw as u32,
                2 * v6r_stage_bytes(s.dk, nw),
            )
        };
        // gdr_hrec10 reads V and PT (in w, or in u beside W) where the others read W and U
        let (a1, a2, a3) = if h10 {
            (
                dptr(v, st),
                ptr(&gam, st),
                if v10 { ptr(&w, st) } else { ptr(&u, st) },
            )
        } else {
            (ptr(&gam, st), ptr(&w, st), ptr(&u, st))
        };
        let args = vec![
            dptr(kb, st),
            a1,
            a2,
            a3,
            ptr(&ch.seq, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dv),
            optr(initial_state, st),
            optr(h32.as_ref(), st),
            o16(h16b.as_ref()),
            ptr(&d, st),
        ];
        if overlap {
            // launched beside gdr_bwd6, below
            hrec = Some(HrecLaunch {
                name,
                grid,
                threads,
                smem,
                args,
            });
        } else {
            launch_in_threads(gpu, MODULE, &name, grid, threads, smem, &args)?;
        }
        (gam, t, u, None, Some(w), h32, h16b, d)
    } else {
        let p = prep(gpu, ks, kk, v, g, beta, &ch, s, true)?;
        let (h, d) = scan_fwd(gpu, ks, kk, &p, &ch, seqs, s, initial_state, None)?;
        let Prep { gam, t, w, u } = p;
        (gam, t, u, Some(w), None, Some(h), None, d)
    };
    // W in the type the selected reverse scan reads.
    let n_w = chh * C * s.dk;
    if pieces.scan && w16.is_none() {
        let (Some(src), b) = (&w32, ws_bf16(gpu, n_w)?) else {
            unreachable!("one of the W copies exists")
        };
        cvt(gpu, "gdr_cvt_f32_bf16", ptr(src, st), ptr(&b, st), n_w)?;
        w16 = Some(b);
    }
    if !pieces.scan && w32.is_none() {
        let (Some(src), b) = (&w16, ws(gpu, n_w)?) else {
            unreachable!("one of the W copies exists")
        };
        cvt(gpu, "gdr_cvt_bf16_f32", ptr(src, st), ptr(&b, st), n_w)?;
        w32 = Some(b);
    }

    // dD (complete), dh (gradients of the chunks' end states), dh0.
    let dd = ws(gpu, dn)?;
    let (dh32, dh16) = if h16 {
        (None, Some(ws_bf16(gpu, chh * s.dk * s.dv)?))
    } else {
        (Some(ws(gpu, chh * s.dk * s.dv)?), None)
    };
    let dh0 = match initial_state {
        Some(_) => Some(out_f32(gpu, n_seq * s.hv * s.dk * s.dv)?),
        None => None,
    };
    if let (true, Some(w)) = (pieces.scan, &w16) {
        let a = match a_pre.take() {
            Some(a) => a,
            None => {
                let a = ws_bf16(gpu, chh * C * C)?;
                launch(
                    gpu,
                    &format!("gdr_qk6_{ks}"),
                    chh,
                    (STAGE_F + MAT_F + 2 * C) * 4 + 2 * C * s.dk * k_bytes,
                    &[
                        dptr(qq, st),
                        dptr(kk, st),
                        ptr(&gam, st),
                        ptr(&ch.t0, st),
                        ptr(&ch.len, st),
                        i32_arg(s.hk),
                        i32_arg(s.hv),
                        i32_arg(s.dk),
                        ptr(&a, st),
                    ],
                )?;
                a
            }
        };
        // gdr_bwd8 (opt-in): the same outputs from v8's split of dS, width by v8's model.
        // gdr_bwd9 (opt-in): gdr_bwd8 with a producer warp, one more warp per CTA and the ring's
        // four mbarriers (32 bytes).
        let v9 = !v10 && bwd9_on(gpu);
        let (bwd6, bgrid, bthreads, bsmem) = if v10 {
            let nw8 = v8_warps(gpu, n_seq, s, pieces.warps);
            (
                format!("gdr_bwd10{b16}_d{}_w{nw8}", s.dk),
                n_seq * s.hv * (s.dv / (8 * nw8)),
                32 * nw8 as u32,
                bwd10_bytes(s.dk, nw8),
            )
        } else if v9 || bwd8_on(gpu, n_seq, s) {
            let nw8 = v8_warps(gpu, n_seq, s, pieces.warps);
            (
                if v9 {
                    format!("gdr_bwd9_d{}_w{nw8}_s2", s.dk)
                } else {
                    format!("gdr_bwd8{b16}_d{}_w{nw8}", s.dk)
                },
                n_seq * s.hv * (s.dv / (8 * nw8)),
                32 * (nw8 + v9 as usize) as u32,
                bwd8_bytes(s.dk, nw8) + if v9 { 32 } else { 0 },
            )
        } else {
            (
                format!("gdr_bwd6{b16}_d{}_w{nw}", s.dk),
                ctas,
                32 * nw as u32,
                2 * v6g_stage_bytes(s.dk, nw),
            )
        };
        let side = match hrec.take() {
            Some(HrecLaunch {
                name,
                grid,
                threads,
                smem,
                args,
            }) => {
                let side = gpu
                    .side_stream()?
                    .ok_or_else(|| GdnError::Device("rule backward: no second stream".into()))?;
                // Both kernels ask for the largest shared-memory carveout, so that one CTA of
                // each fits on an SM (88.6 + 133.6 KB at Dk 128, 2 warps; gdr_bwd8 w4 141.8 KB
                // beside gdr_hrec6 w2: 230.4 KB fits, beside gdr_hrec8 w4 105.0 KB it does not).
                for n in [&name, &bwd6] {
                    gpu.function(MODULE, n)?
                        .set_attribute(
                            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                            100,
                        )
                        .map_err(|e| GdnError::Device(format!("carveout of {n}: {e:?}")))?;
                }
                gpu.order(st, side)?;
                crate::backend::launch::launch_on(
                    gpu, side, MODULE, &name, grid, threads, smem, &args,
                )?;
                Some(side)
            }
            None => None,
        };
        let r = launch_in_threads(
            gpu,
            MODULE,
            &bwd6,
            bgrid,
            bthreads,
            bsmem,
            &[
                dptr(qb, st),
                dptr(kb, st),
                dptr(d_o, st),
                ptr(&gam, st),
                ptr(w, st),
                ptr(&a, st),
                ptr(&ch.seq, st),
                ptr(&ch.t0, st),
                ptr(&ch.len, st),
                i32_arg(s.hk),
                i32_arg(s.hv),
                i32_arg(s.dv),
                Arg::F32(opts.scale),
                optr(d_final_state, st),
                optr(dh32.as_ref(), st),
                o16(dh16.as_ref()),
                ptr(&dd, st),
                optr(dh0.as_ref(), st),
            ],
        );
        // Before anything reads hrec6's outputs or frees what it reads (also on an error).
        if let Some(side) = side {
            gpu.order(side, st)?;
        }
        r?;
    } else if let (Some(w), Some(dh)) = (&w32, &dh32) {
        // v5's dD_loc = scale A^T dO, then its reverse scan.
        launch(
            gpu,
            &format!("gdr_dd_local_{ks}"),
            chh,
            (STAGE_F + MAT_F + 2 * C) * 4,
            &[
                dptr(qq, st),
                dptr(kk, st),
                dptr(d_o, st),
                ptr(&gam, st),
                ptr(&ch.t0, st),
                ptr(&ch.len, st),
                i32_arg(s.hk),
                i32_arg(s.hv),
                i32_arg(s.dk),
                i32_arg(s.dv),
                Arg::F32(opts.scale),
                ptr(&dd, st),
            ],
        )?;
        let bv = scan_bv(gpu, n_seq, s);
        launch(
            gpu,
            &format!("gdr_scan_bwd{bv}_{ks}"),
            n_seq * s.hv * (s.dv / bv),
            (s.dk * (bv + 8) + 2 * C * (s.dk + 4) + 2 * C * (bv + 8) + C) * 4,
            &[
                dptr(qq, st),
                dptr(kk, st),
                dptr(d_o, st),
                ptr(&gam, st),
                ptr(w, st),
                ptr(&ch.seq, st),
                ptr(&ch.t0, st),
                ptr(&ch.len, st),
                i32_arg(s.hk),
                i32_arg(s.hv),
                i32_arg(s.dk),
                i32_arg(s.dv),
                Arg::F32(opts.scale),
                optr(d_final_state, st),
                ptr(dh, st),
                ptr(&dd, st),
                optr(dh0.as_ref(), st),
            ],
        )?;
    }
    if let Some(h) = hrec.take() {
        // (not reached: overlap implies the bwd6 branch above, which launched it)
        launch_in_threads(gpu, MODULE, &h.name, h.grid, h.threads, h.smem, &h.args)?;
    }
    drop((w32, w16));

    if pieces.grad7 {
        drop(u);
        return grad7(
            gpu,
            (q, k, qq, kk, qb, kb),
            (v, beta, d_o),
            (&gam, t.as_ref(), h16b.as_ref(), dh16.as_ref(), &d, &dd),
            t_pk,
            &ch,
            seqs,
            s,
            opts,
            dh0,
            kern,
            td16,
        );
    }
    let t = t.ok_or_else(|| GdnError::Device("rule backward: prep kept no T".into()))?;
    // The per-chunk gradients (U's workspace becomes dVb), then v5's GVA reduction.
    let dkb = ws(gpu, chh * C * s.dk)?;
    let dq_part = ws(gpu, tokens * s.hv * s.dk)?;
    let dk_part = ws(gpu, tokens * s.hv * s.dk)?;
    let mut dv = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let dg = out_f32(gpu, tokens * s.hv)?;
    let mut dbeta = out_d(gpu, tokens * s.hv, dt)?;
    if pieces.grad {
        // gdr_grad6: bf16 tensor cores, operands staged once (bf16 states, Dk, Dv 64 / 128).
        launch(
            gpu,
            &format!("gdr_grad6_{ks}_d{}_v{}", s.dk, s.dv),
            chh,
            g6_bytes(s.dk, s.dv),
            &[
                dptr(qq, st),
                dptr(kk, st),
                dptr(qb, st),
                dptr(kb, st),
                dptr(v, st),
                dptr(beta, st),
                dptr(d_o, st),
                ptr(&gam, st),
                ptr(&t, st),
                o16(h16b.as_ref()),
                o16(dh16.as_ref()),
                ptr(&d, st),
                ptr(&dd, st),
                ptr(&u, st),
                ptr(&dkb, st),
                ptr(&ch.t0, st),
                ptr(&ch.len, st),
                i32_arg(s.hk),
                i32_arg(s.hv),
                Arg::F32(opts.scale),
                ptr(&dq_part, st),
                ptr(&dk_part, st),
                dptr(&dv, st),
                ptr(&dg, st),
                dptr(&dbeta, st),
            ],
        )?;
    } else {
        let gw = GradWs {
            gam: &gam,
            t: &t,
            h32: &h32,
            h16: &h16b,
            dh32: &dh32,
            dh16: &dh16,
            d: &d,
            dd: &dd,
            u: &u,
            dkb: &dkb,
        };
        let outs = (&dq_part, &dk_part, &dv, &dg, &dbeta);
        grad_v5(gpu, ks, qq, kk, v, beta, d_o, &gw, &ch, s, opts, outs)?;
    }
    drop((gam, t, u, h32, h16b, d, dd, dh32, dh16, dkb, norm));
    let dq = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    let dk = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    launch(
        gpu,
        &format!("gdr_reduce_qk_{sf}"),
        (tokens * s.hk).div_ceil(ROWS_PER_BLOCK),
        0,
        &[
            dptr(q, st),
            dptr(k, st),
            ptr(&dq_part, st),
            ptr(&dk_part, st),
            Arg::I64(tokens as i64),
            Arg::I64(seqs.used() as i64),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            Arg::I32(opts.l2norm_in_kernel as i32),
            dptr(&dq, st),
            dptr(&dk, st),
        ],
    )?;
    let used = seqs.used();
    zero_tail("gated delta rule", gpu, &mut dv, used, tokens, s.hv * s.dv)?;
    zero_tail("gated delta rule", gpu, &mut dbeta, used, tokens, s.hv)?;
    let mut dg = DBuf::F32(dg);
    zero_tail("gated delta rule", gpu, &mut dg, used, tokens, s.hv)?;
    let DBuf::F32(dg) = dg else {
        unreachable!("dg is f32")
    };
    Ok(Grads {
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dh0,
    })
}

/// The v6 backward's workspaces that v5's per-chunk gradient kernel reads.
struct GradWs<'a> {
    gam: &'a GBuf<f32>,
    t: &'a GBuf<f32>,
    h32: &'a Option<GBuf<f32>>,
    h16: &'a Option<GBuf<u16>>,
    dh32: &'a Option<GBuf<f32>>,
    dh16: &'a Option<GBuf<u16>>,
    d: &'a GBuf<f32>,
    dd: &'a GBuf<f32>,
    u: &'a GBuf<f32>,
    dkb: &'a GBuf<f32>,
}

/// v5's per-chunk gradient kernel for the v6 backward: `gdr_grad` (fp32 states) or
/// `gdr_grad_h16` (bf16 states), dW in its own workspace. Outputs: dq, dk partials, dv, dg,
/// dbeta.
#[allow(clippy::too_many_arguments)]
fn grad_v5(
    gpu: &Arc<Gpu>,
    ks: &str,
    qq: &DBuf,
    kk: &DBuf,
    v: &DBuf,
    beta: &DBuf,
    d_o: &DBuf,
    w: &GradWs,
    ch: &Chunks,
    s: RuleShape,
    opts: RuleOpts,
    outs: (&GBuf<f32>, &GBuf<f32>, &DBuf, &GBuf<f32>, &DBuf),
) -> Result<()> {
    let (dq_part, dk_part, dv, dg, dbeta) = outs;
    let st = gpu.stream();
    let o16 = |b: Option<&GBuf<u16>>| b.map_or(Arg::Ptr(0), |b| ptr(b, st));
    let chh = ch.count * s.hv;
    let dw = ws(gpu, chh * C * s.dk)?;
    let (grad, h_arg, dh_arg) = if w.h16.is_some() {
        ("gdr_grad_h16", o16(w.h16.as_ref()), o16(w.dh16.as_ref()))
    } else {
        (
            "gdr_grad",
            optr(w.h32.as_ref(), st),
            optr(w.dh32.as_ref(), st),
        )
    };
    launch(
        gpu,
        &format!("{grad}_{ks}"),
        chh,
        (STAGE_F + 5 * MAT_F + 8 * C) * 4,
        &[
            dptr(qq, st),
            dptr(kk, st),
            dptr(v, st),
            dptr(beta, st),
            dptr(d_o, st),
            ptr(w.gam, st),
            ptr(w.t, st),
            h_arg,
            dh_arg,
            ptr(w.d, st),
            ptr(w.dd, st),
            ptr(&dw, st),
            ptr(w.u, st),
            ptr(w.dkb, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            ptr(dq_part, st),
            ptr(dk_part, st),
            dptr(dv, st),
            ptr(dg, st),
            dptr(dbeta, st),
        ],
    )?;
    drop(dw);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The v6 pipeline's chunk prep (issue 13): v6's kernels (gdr_l2norm2 x2, gdr_prep6, gdr_qk6)
// or one `gdr_prep7` launch writing the same buffers. See the prep7 section of
// gated_delta_rule.cu.

/// Which kernels compute the chunk prep of the v6 forward and of the v6 backward's recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrepKernel {
    /// `gdr_l2norm2` (q, k), `gdr_prep6`, `gdr_qk6`: TF32 products, as before prep7.
    V6,
    /// `gdr_prep7`: one kernel per (chunk, value head), bf16 tensor cores with every product's
    /// operands split in bf16 hi + lo (about fp32 accuracy).
    V7,
    /// `gdr_prep7f`: as V7 with the bf16 hi parts only (FLA's precision; measurement only).
    V7Fast,
    /// `gdr_prep8`: V7's outputs bit for bit with less work around the products (the P
    /// fragments of W and U built in registers, balanced over the warps; A and W stored as whole
    /// sectors through shared memory; gam summed in registers).
    V8,
    /// `gdr_prep9`: V8 with one CTA per (chunk, key head) walking the GVA group's value heads:
    /// the q, k loads, their l2 norm and K K^T, Q K^T once per group; V8's outputs bit for bit.
    V9,
    /// The default: V9 where there is GVA and its grid (chunks x key heads) gives every SM at
    /// least 4 CTAs (2 waves at 2 per SM: its CTAs run about twice as long as V8's, so a shorter
    /// grid would leave SMs idle; measured faster than V8 at B1 T32768 with 16 / 32 heads, 31
    /// waves, and with 2 / 8 heads, 3.9 waves), else V8 (measured 2-3% faster than V9 without
    /// GVA). The same bits either way.
    Auto,
}

impl PrepKernel {
    /// The default: Auto (since 2026-12-04: `gdr_prep9` or `gdr_prep8` by shape, V7's bits,
    /// faster; `GDN_RULE_PREP=v9` / `v8` one of them everywhere). V7 (`gdr_prep7`, the
    /// default from 2026-12-02, `GDN_RULE_PREP=v7`) measured 2.4 ms faster than V6 in the
    /// forward at B1 T32768 16/32 on the H200. Its one-token dq, dk error that held it back
    /// (2.6e-2 RMS relative on one test case, v6's prep 1.2e-2) is the case's conditioning: the
    /// two value heads' contributions nearly cancel, and the GPU tests now hold every bf16 output
    /// to its conditioning floor where that is above the fixed tolerance (bench/NOTES.md).
    /// `GDN_RULE_PREP=v6` selects the old kernels (`gdr_l2norm2` x2, `gdr_prep6`, `gdr_qk6`),
    /// `v7f` V7Fast. Wherever the v6 pipeline runs (bf16 storage, Dk 64 / 128, Dv a multiple of
    /// 16 up to 256: `gdr_prep7` needs at most 124,672 bytes of shared memory there) every prep
    /// applies; elsewhere (f32 storage, other Dk) the v5 path runs and no prep kernel is chosen.
    pub fn from_env() -> PrepKernel {
        Self::named(std::env::var("GDN_RULE_PREP").ok().as_deref())
    }

    /// The prep a `GDN_RULE_PREP` value names (`None`: unset).
    fn named(v: Option<&str>) -> PrepKernel {
        match v {
            Some("v6") => PrepKernel::V6,
            Some("v7f") => PrepKernel::V7Fast,
            Some("v7") => PrepKernel::V7,
            Some("v8") => PrepKernel::V8,
            Some("v9") => PrepKernel::V9,
            _ => PrepKernel::Auto,
        }
    }
}

/// Dynamic shared memory of `gdr_prep7` (the .cu file's `P7Layout<DK>` plus V): Q, K hi and lo
/// (64 rows of Dk + 8 bf16 each), T (64 x 68 fp32), the off-diagonal solve's 768 fp32, gam,
/// beta, beta e^gam (64 fp32 each), V (64 rows of Dv + 8 bf16).
pub fn prep7_bytes(dk: usize, dv: usize) -> usize {
    4 * C * (dk + 8) * 2 + C * (C + 4) * 4 + 3 * 256 * 4 + 3 * C * 4 + C * (dv + 8) * 2
}

/// Outputs of the v6 pipeline's prep: the normalized q, k (fp32 and bf16) when the norm is in
/// the kernel, gam, T (when kept), W (bf16), U (fp32), A = lower_incl(Q K^T * Gamma) (bf16,
/// when wanted). Layouts as `gdr_prep6` / `gdr_qk6` / `gdr_l2norm2` write them.
#[doc(hidden)]
pub struct V6Prep {
    /// `[(q fp32, q bf16), (k fp32, k bf16)]`; the fp32 copies only when wanted.
    pub norm: Option<Vec<(Option<DBuf>, DBuf)>>,
    pub gam: GBuf<f32>,
    pub t: Option<GBuf<f32>>,
    pub w: GBuf<u16>,
    pub u: GBuf<f32>,
    pub a: Option<GBuf<u16>>,
}

/// The in-kernel l2 norm of q and k for the v6 kernels (`gdr_l2norm2`: fp32 and bf16 copies),
/// or None with caller-side normalization.
fn v6_norm(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    s: RuleShape,
    opts: RuleOpts,
) -> Result<Option<Vec<(DBuf, DBuf)>>> {
    if !opts.l2norm_in_kernel {
        return Ok(None);
    }
    let st = gpu.stream();
    let rows = q.len() / s.dk;
    let mut outs = Vec::with_capacity(2);
    for x in [q, k] {
        let y = out_f32(gpu, x.len())?;
        let yb = ws_bf16(gpu, x.len())?;
        launch(
            gpu,
            "gdr_l2norm2_bf16",
            rows.div_ceil(ROWS_PER_BLOCK),
            0,
            &[
                dptr(x, st),
                ptr(&y, st),
                ptr(&yb, st),
                Arg::I64(rows as i64),
                i32_arg(s.dk),
            ],
        )?;
        outs.push((DBuf::F32(y), DBuf::Bf16(yb)));
    }
    Ok(Some(outs))
}

/// A forward's output `o`, its final states (when asked for) and the chunk inverses it kept
/// (when asked for and made: [`forward_saving`]).
pub type SavingForward = (DBuf, Option<GBuf<f32>>, Option<GBuf<f32>>);

/// Floats of the saved chunk inverses per (chunk, value head): T's ten 16 x 16 blocks on or
/// below the diagonal, fp32 (the .cu file's `GDR_TP`; T is block lower triangular).
pub const T_PACKED: usize = 10 * 256;

/// What the chunk prep does with the saved chunk inverses (`[chunks, Hv, T_PACKED]` fp32).
#[derive(Clone, Copy)]
enum TSaved<'a> {
    /// Neither written nor read.
    No,
    /// Written (the forward keeps them; prep8 / prep9 only).
    Out(&'a GBuf<f32>),
    /// Read instead of solving for T (the backward; `gdr_prep8t` / `gdr_prep9t`).
    In(&'a GBuf<f32>),
}

/// The prep kernel `kind` names for this shape: `Auto` is `gdr_prep9` with GVA where its grid
/// (chunks x key heads) gives every SM at least 4 CTAs, else `gdr_prep8` (the same bits).
fn resolve_prep(gpu: &Gpu, kind: PrepKernel, n_chunks: usize, s: RuleShape) -> Result<PrepKernel> {
    Ok(match kind {
        PrepKernel::Auto if s.hv > s.hk && n_chunks * s.hk >= 4 * gpu.sm_count()? => PrepKernel::V9,
        PrepKernel::Auto => PrepKernel::V8,
        k => k,
    })
}

/// A device-pointer argument `bytes` further on (other arguments unchanged).
fn ptr_plus(a: Arg, bytes: usize) -> Arg {
    match a {
        Arg::Ptr(p) => Arg::Ptr(p + bytes as u64),
        x => x,
    }
}

/// Whether the prep `kind` (resolved) writes and reads saved chunk inverses (prep8, prep9).
fn prep_keeps_t(kind: PrepKernel) -> bool {
    matches!(kind, PrepKernel::V8 | PrepKernel::V9)
}

/// Whether the prep `kind` resolves to prep8 / prep9 (`Auto` always does): the preps that can
/// write T diag(beta) for the v10 scans.
fn prep_may_keep_t(kind: PrepKernel) -> bool {
    kind == PrepKernel::Auto || prep_keeps_t(kind)
}

/// What the v6 pipeline's prep writes for the scans besides A, gam and the normalized rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PrepOut {
    /// W (bf16) and U (fp32): the default scans.
    WU,
    /// T diag(beta) as bf16 hi + lo in `w`, no U (gdr_prep8o / 9o, 8to / 9to): gdr_fwd10, or
    /// the backward's gdr_hrec10 with gdr_bwd10.
    Pt,
    /// T diag(beta) in `u` (its bytes as bf16) and W in `w`, no U (gdr_prep8ow / 9ow, 8tow /
    /// 9tow): gdr_hrec10 beside a reverse scan that reads W.
    PtW,
}

/// The chunk prep of the v6 pipeline (bf16 storage, Dk 64 / 128, checked inputs) by `kind`.
/// `want_f32`: the fp32 copies of the normalized q, k are needed (backward; v6's prep always
/// writes them); `keep_t`: store T (backward); `want_a`: A is needed (prep7 always computes it);
/// `tsaved`: the saved chunk inverses to write or to read (prep8 / prep9 only, see [`TSaved`]).
#[allow(clippy::too_many_arguments)]
fn v6_prep(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    ch: &Chunks,
    s: RuleShape,
    opts: RuleOpts,
    used: usize,
    want_f32: bool,
    keep_t: bool,
    want_a: bool,
    kind: PrepKernel,
    tsaved: TSaved,
    out: PrepOut,
) -> Result<V6Prep> {
    let st = gpu.stream();
    let chh = ch.count * s.hv;
    let kind = resolve_prep(gpu, kind, ch.count, s)?;
    if !matches!(tsaved, TSaved::No) && !prep_keeps_t(kind) {
        return Err(GdnError::Device(
            "rule: saved chunk inverses need the prep8 / prep9 kernels".into(),
        ));
    }
    let tout = out != PrepOut::WU;
    let tw = out == PrepOut::PtW;
    if tout && !prep_keeps_t(kind) {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: the v10 kernels (GDN_RULE_FWD=v10, GDN_RULE_BWD_SCAN=v10) need the \
             prep8 / prep9 kernels (GDN_RULE_PREP unset, v8 or v9), got {kind:?}"
        )));
    }
    let ks = chunk_sfx(DType::Bf16, opts);
    let gam = ws(gpu, chh * C)?;
    let t = if keep_t {
        Some(ws(gpu, chh * C * C)?)
    } else {
        None
    };
    // PrepOut::Pt: w holds T diag(beta) hi + lo, and there is no U; PtW: w holds W and u T
    // diag(beta) (2 x 64 x 64 bf16 in the bytes of 64 x 64 floats per chunk and value head)
    let w = ws_bf16(
        gpu,
        chh * if out == PrepOut::Pt {
            2 * C * C
        } else {
            C * s.dk
        },
    )?;
    let u = ws(
        gpu,
        chh * match out {
            PrepOut::WU => C * s.dv,
            PrepOut::Pt => 0,
            PrepOut::PtW => C * C,
        },
    )?;
    if kind == PrepKernel::V6 {
        let norm = v6_norm(gpu, q, k, s, opts)?;
        let (qf, kf) = match &norm {
            Some(o) => (&o[0].0, &o[1].0),
            None => (q, k),
        };
        let k_bytes = if opts.l2norm_in_kernel { 4 } else { 2 };
        launch(
            gpu,
            &format!("gdr_prep6_{ks}"),
            chh,
            (STAGE_F + 2 * MAT_F + 3 * C) * 4 + C * s.dk * k_bytes + C * s.dv * 2,
            &[
                dptr(kf, st),
                dptr(v, st),
                ptr(g, st),
                dptr(beta, st),
                ptr(&ch.t0, st),
                ptr(&ch.len, st),
                i32_arg(s.hk),
                i32_arg(s.hv),
                i32_arg(s.dk),
                i32_arg(s.dv),
                ptr(&gam, st),
                optr(t.as_ref(), st),
                ptr(&w, st),
                ptr(&u, st),
            ],
        )?;
        let a = if want_a {
            let a = ws_bf16(gpu, chh * C * C)?;
            launch(
                gpu,
                &format!("gdr_qk6_{ks}"),
                chh,
                (STAGE_F + MAT_F + 2 * C) * 4 + 2 * C * s.dk * k_bytes,
                &[
                    dptr(qf, st),
                    dptr(kf, st),
                    ptr(&gam, st),
                    ptr(&ch.t0, st),
                    ptr(&ch.len, st),
                    i32_arg(s.hk),
                    i32_arg(s.hv),
                    i32_arg(s.dk),
                    ptr(&a, st),
                ],
            )?;
            Some(a)
        } else {
            None
        };
        let norm = norm.map(|v| v.into_iter().map(|(f, b)| (Some(f), b)).collect());
        return Ok(V6Prep {
            norm,
            gam,
            t,
            w,
            u,
            a,
        });
    }
    let norm = if opts.l2norm_in_kernel {
        let mut outs = Vec::with_capacity(2);
        for x in [q, k] {
            let f = if want_f32 {
                Some(DBuf::F32(out_f32(gpu, x.len())?))
            } else {
                None
            };
            outs.push((f, DBuf::Bf16(ws_bf16(gpu, x.len())?)));
        }
        Some(outs)
    } else {
        None
    };
    // gdr_prep7 normalizes the rows of the chunks; with the fp32 copies (backward), the padding
    // rows (at or after `used`, in no chunk, read by no kernel) get gdr_l2norm2's as with the v6
    // prep (the same formula), so the buffers are the v6 prep's.
    let rows = q.len() / s.dk;
    let pad_rows = rows - used * s.hk;
    if let (Some(o), true) = (&norm, pad_rows > 0) {
        let r0 = used * s.hk * s.dk;
        let at = |a: Arg, elem: usize| ptr_plus(a, r0 * elem);
        for (x, (y, yb)) in [q, k].into_iter().zip(o) {
            let Some(y) = y else {
                continue;
            };
            launch(
                gpu,
                "gdr_l2norm2_bf16",
                pad_rows.div_ceil(ROWS_PER_BLOCK),
                0,
                &[
                    at(dptr(x, st), 2),
                    at(dptr(y, st), 4),
                    at(dptr(yb, st), 2),
                    Arg::I64(pad_rows as i64),
                    i32_arg(s.dk),
                ],
            )?;
        }
    }
    let a = ws_bf16(gpu, chh * C * C)?;
    let n = |i: usize, j: usize| match (&norm, j) {
        (Some(o), 0) => o[i].0.as_ref().map_or(Arg::Ptr(0), |f| dptr(f, st)),
        (Some(o), _) => dptr(&o[i].1, st),
        (None, _) => Arg::Ptr(0),
    };
    // (kind resolved above: Auto is gdr_prep9 or gdr_prep8, the same bits)
    let tin = matches!(tsaved, TSaved::In(_));
    let (name, grid) = match kind {
        PrepKernel::V7Fast => ("gdr_prep7f", chh),
        PrepKernel::V8 if tin && tw => ("gdr_prep8tow", chh),
        PrepKernel::V8 if tw => ("gdr_prep8ow", chh),
        PrepKernel::V8 if tin && tout => ("gdr_prep8to", chh),
        PrepKernel::V8 if tin => ("gdr_prep8t", chh),
        PrepKernel::V8 if tout => ("gdr_prep8o", chh),
        PrepKernel::V8 => ("gdr_prep8", chh),
        // one CTA per (chunk, key head)
        PrepKernel::V9 if tin && tw => ("gdr_prep9tow", ch.count * s.hk),
        PrepKernel::V9 if tw => ("gdr_prep9ow", ch.count * s.hk),
        PrepKernel::V9 if tin && tout => ("gdr_prep9to", ch.count * s.hk),
        PrepKernel::V9 if tin => ("gdr_prep9t", ch.count * s.hk),
        PrepKernel::V9 if tout => ("gdr_prep9o", ch.count * s.hk),
        PrepKernel::V9 => ("gdr_prep9", ch.count * s.hk),
        _ => ("gdr_prep7", chh),
    };
    let tp = match tsaved {
        TSaved::No => Arg::Ptr(0),
        TSaved::Out(b) | TSaved::In(b) => {
            // (a workspace holds at least one float)
            if b.len() != (chh * T_PACKED).max(1) {
                return Err(GdnError::Invalid(format!(
                    "gated delta rule backward: the saved chunk inverses hold {} floats, expected {} ({} chunks x {} value heads x {T_PACKED}): they are not from this forward",
                    b.len(),
                    chh * T_PACKED,
                    ch.count,
                    s.hv
                )));
            }
            ptr(b, st)
        }
    };
    launch(
        gpu,
        &format!("{name}_d{}_{ks}", s.dk),
        grid,
        prep7_bytes(s.dk, s.dv),
        &[
            dptr(q, st),
            dptr(k, st),
            dptr(v, st),
            ptr(g, st),
            dptr(beta, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dv),
            n(0, 0),
            n(0, 1),
            n(1, 0),
            n(1, 1),
            ptr(&gam, st),
            optr(t.as_ref(), st),
            ptr(&w, st),
            ptr(&u, st),
            ptr(&a, st),
            tp,
        ],
    )?;
    Ok(V6Prep {
        norm,
        gam,
        t,
        w,
        u,
        a: Some(a),
    })
}

/// Tests and benchmarks only: the v6 pipeline's chunk prep on its own (bf16 storage, Dk 64 or
/// 128, Dv a multiple of 16), with T kept and A computed, by `kind`.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn prep_only(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    kind: PrepKernel,
) -> Result<V6Prep> {
    let dt = check(gpu, q, k, v, g, beta, seqs, shape, None)?;
    if !v6_supports(dt, shape) {
        return Err(GdnError::Invalid(format!(
            "gated delta rule prep (v6 pipeline): needs bf16 storage, Dk 64 or 128 and Dv a \
             multiple of 16, got {dt:?} {shape:?}"
        )));
    }
    let ch = Chunks::new(gpu, seqs)?;
    v6_prep(
        gpu,
        q,
        k,
        v,
        g,
        beta,
        &ch,
        shape,
        opts,
        seqs.used(),
        true,
        true,
        true,
        kind,
        TSaved::No,
        PrepOut::WU,
    )
}

/// Tests only: [`prep_only`]'s prep (`kind`: prep8 / prep9 or `Auto`) writing the packed chunk
/// inverses the forward keeps, then the same prep reading them instead of solving
/// (`gdr_prep8t` / `gdr_prep9t`): (the solving prep's outputs, the packed inverses
/// `[chunks, Hv, T_PACKED]`, the reading prep's outputs).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn prep_saved_t(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    beta: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    kind: PrepKernel,
) -> Result<(V6Prep, GBuf<f32>, V6Prep)> {
    check(gpu, q, k, v, g, beta, seqs, shape, None)?;
    let ch = Chunks::new(gpu, seqs)?;
    let tp = ws(gpu, ch.count * shape.hv * T_PACKED)?;
    let run = |t: TSaved| {
        v6_prep(
            gpu,
            q,
            k,
            v,
            g,
            beta,
            &ch,
            shape,
            opts,
            seqs.used(),
            true,
            true,
            true,
            kind,
            t,
            PrepOut::WU,
        )
    };
    let solved = run(TSaved::Out(&tp))?;
    let read = run(TSaved::In(&tp))?;
    Ok((solved, tp, read))
}

/// The per-chunk gradients by `gdr_grad{kern}` ([`grad_kernel`]; bf16 states; Dk, Dv 64 or
/// 128): one CTA per (chunk, key head) over the GVA group, dq and dk summed (in an fp32
/// `[tokens, Hk, Dk]` accumulator that each CTA owns for its rows; gdr_grad10 in registers, its
/// persistent CTAs walking the items) and written through the l2norm backward by the same CTA.
/// td16: D and dD are bf16 (gdr_grad10b; the backward sets it only with kern 10).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn grad7(
    gpu: &Arc<Gpu>,
    qk: (&DBuf, &DBuf, &DBuf, &DBuf, &DBuf, &DBuf),
    vbo: (&DBuf, &DBuf, &DBuf),
    w: (
        &GBuf<f32>,
        Option<&GBuf<f32>>,
        Option<&GBuf<u16>>,
        Option<&GBuf<u16>>,
        &GBuf<f32>,
        &GBuf<f32>,
    ),
    t_pk: Option<&GBuf<f32>>,
    ch: &Chunks,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    dh0: Option<GBuf<f32>>,
    kern: u32,
    td16: bool,
) -> Result<Grads> {
    let (q, k, qq, kk, qb, kb) = qk;
    let (v, beta, d_o) = vbo;
    let (gam, t, h16, dh16, d, dd) = w;
    // `t_pk`: T's packed copy from the forward, which the caller passes only for gdr_grad10
    // (`t` may then be absent)
    if t.is_none() && t_pk.is_none() {
        return Err(GdnError::Device("rule backward: prep kept no T".into()));
    }
    let (Some(h16), Some(dh16)) = (h16, dh16) else {
        return Err(GdnError::Device(
            "rule backward: gdr_grad7 needs the bf16 states".into(),
        ));
    };
    let st = gpu.stream();
    let dt = DType::Bf16;
    let ks = chunk_sfx(dt, opts);
    let tokens = seqs.tokens();
    let dq = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    let dk = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    let dv = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let dg = out_f32(gpu, tokens * s.hv)?;
    let dbeta = out_d(gpu, tokens * s.hv, dt)?;
    // The kernels' arguments: gdr_grad10 takes no q, k for its row dots (it reads the bf16 rows
    // qb, kb), the packed T, the item count before the shape and no fp32 dq / dk accumulators;
    // gdr_grad7 / 8 take the accumulators after it.
    let args = |items: Option<usize>, acc: Option<(&GBuf<f32>, &GBuf<f32>)>| {
        let mut a = vec![dptr(q, st), dptr(k, st)];
        if items.is_none() {
            a.extend([dptr(qq, st), dptr(kk, st)]);
        }
        a.extend([
            dptr(qb, st),
            dptr(kb, st),
            dptr(v, st),
            dptr(beta, st),
            dptr(d_o, st),
            ptr(gam, st),
            optr(t, st),
        ]);
        if items.is_some() {
            // gdr_grad10: the packed T
            a.push(optr(t_pk, st));
        }
        a.extend([
            ptr(h16, st),
            ptr(dh16, st),
            ptr(d, st),
            ptr(dd, st),
            ptr(&ch.t0, st),
            ptr(&ch.len, st),
        ]);
        if let Some(n) = items {
            a.push(Arg::I64(n as i64));
        }
        a.extend([
            i32_arg(s.hk),
            i32_arg(s.hv),
            Arg::F32(opts.scale),
            Arg::I32(opts.l2norm_in_kernel as i32),
        ]);
        if let Some((x, y)) = acc {
            a.extend([ptr(x, st), ptr(y, st)]);
        }
        a.extend([
            dptr(&dq, st),
            dptr(&dk, st),
            dptr(&dv, st),
            ptr(&dg, st),
            dptr(&dbeta, st),
        ]);
        a
    };
    if kern == 10 {
        // persistent: at most one CTA per SM, each walking (chunk, key head) items
        let items = ch.count * s.hk;
        // td16: D, dD in bf16 (see the backward)
        let b16 = if td16 { "b" } else { "" };
        // (tests: the other register split, set_g10_split0)
        // (tests: one K buffer, set_g10_k1)
        let d128 = s.dk == 128 && s.dv == 128;
        let k1 = d128 && G10K1.with(|c| c.get());
        let var = if k1 {
            "_k1"
        } else if td16 && d128 && G10SPLIT0.with(|c| c.get()) {
            "_r0"
        } else {
            ""
        };
        // one kernel for both norms (`l2norm` selects the l2 norm's backward at its end)
        let name = format!("gdr_grad10{b16}{var}_bf16_d{}_v{}", s.dk, s.dv);
        launch_in_threads(
            gpu,
            MODULE,
            &name,
            items.min(gpu.sm_count()?),
            512,
            if k1 {
                g10_k1_bytes(s.dk, s.dv)
            } else {
                g10_bytes(s.dk, s.dv)
            },
            &args(Some(items), None),
        )?;
        return grad_tails(gpu, seqs, s, dq, dk, dv, dg, dbeta, dh0);
    }
    let dqa = ws(gpu, tokens * s.hk * s.dk)?;
    let dka = ws(gpu, tokens * s.hk * s.dk)?;
    let v8 = kern == 8;
    let name = format!("gdr_grad{kern}_{ks}_d{}_v{}", s.dk, s.dv);
    if v8 {
        // Two CTAs of 110.5 KB per SM need the largest shared-memory carveout.
        gpu.function(MODULE, &name)?
            .set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .map_err(|e| GdnError::Device(format!("carveout of {name}: {e:?}")))?;
    }
    launch(
        gpu,
        &name,
        ch.count * s.hk,
        if v8 {
            g8_bytes(s.dk, s.dv)
        } else {
            g7_bytes(s.dk, s.dv)
        },
        &args(None, Some((&dqa, &dka))),
    )?;
    drop((dqa, dka));
    grad_tails(gpu, seqs, s, dq, dk, dv, dg, dbeta, dh0)
}

/// The per-chunk gradient kernels' outputs with the rows past the used tokens zeroed.
#[allow(clippy::too_many_arguments)]
fn grad_tails(
    gpu: &Arc<Gpu>,
    seqs: &Seqs,
    s: RuleShape,
    mut dq: DBuf,
    mut dk: DBuf,
    mut dv: DBuf,
    dg: GBuf<f32>,
    mut dbeta: DBuf,
    dh0: Option<GBuf<f32>>,
) -> Result<Grads> {
    let tokens = seqs.tokens();
    let used = seqs.used();
    zero_tail("gated delta rule", gpu, &mut dq, used, tokens, s.hk * s.dk)?;
    zero_tail("gated delta rule", gpu, &mut dk, used, tokens, s.hk * s.dk)?;
    zero_tail("gated delta rule", gpu, &mut dv, used, tokens, s.hv * s.dv)?;
    zero_tail("gated delta rule", gpu, &mut dbeta, used, tokens, s.hv)?;
    let mut dg = DBuf::F32(dg);
    zero_tail("gated delta rule", gpu, &mut dg, used, tokens, s.hv)?;
    let DBuf::F32(dg) = dg else {
        unreachable!("dg is f32")
    };
    Ok(Grads {
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dh0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults (issue 13): the prep by shape (Auto, 2026-12-04) and the forward by shape;
    /// the environment's names select the others.
    #[test]
    fn kernel_choices_from_environment_values() {
        assert_eq!(PrepKernel::named(None), PrepKernel::Auto);
        assert_eq!(PrepKernel::named(Some("v9")), PrepKernel::V9);
        assert_eq!(PrepKernel::named(Some("v7")), PrepKernel::V7);
        assert_eq!(PrepKernel::named(Some("v8")), PrepKernel::V8);
        assert_eq!(PrepKernel::named(Some("v6")), PrepKernel::V6);
        assert_eq!(PrepKernel::named(Some("v7f")), PrepKernel::V7Fast);
        assert_eq!(FwdKernel::named(None, None), FwdKernel::Auto);
        assert_eq!(FwdKernel::named(Some("auto"), None), FwdKernel::Auto);
        assert_eq!(
            FwdKernel::named(None, Some("4")),
            FwdKernel::V6Lean { warps: 4 }
        );
        // v8 where v6 leaves schedulers idle (measured on the H200, 132 SMs: B1 T32768 16/32
        // v8 1.66 ms vs v6 2.49; B8 T4096 16/16 v6 0.42 vs v8 0.55), v6 where its grid fills
        // the GPU.
        assert!(auto_picks_v8(1, 32, 128, 132));
        assert!(auto_picks_v8(1, 8, 128, 132));
        assert!(auto_picks_v8(2, 16, 128, 132));
        assert!(!auto_picks_v8(4, 32, 128, 132));
        assert!(!auto_picks_v8(8, 16, 128, 132));
        assert!(!auto_picks_v8(16, 16, 128, 132));
        assert!(!auto_picks_v8(6, 32, 128, 132));
        assert!(auto_picks_v8(1, 32, 128, 128) == (32 * 8 <= 256));
        assert_eq!(
            FwdKernel::named(Some("v6l"), Some("2")),
            FwdKernel::V6Lean { warps: 2 }
        );
        assert_eq!(
            FwdKernel::named(Some("v6"), None),
            FwdKernel::V6 { warps: 0 }
        );
        assert_eq!(
            FwdKernel::named(Some("v6b"), Some("8")),
            FwdKernel::V6Bulk { warps: 8 }
        );
        assert_eq!(FwdKernel::named(Some("v5"), None), FwdKernel::V5);
        assert_eq!(
            FwdKernel::named(Some("v8"), Some("4")),
            FwdKernel::V8 { warps: 4 }
        );
        assert_eq!(v8_bytes(128, 4, 3), 229_120);
        assert_eq!(v8_bytes(128, 2, 3), 208_640);
        assert_eq!(v8_bytes(128, 8, 2), 190_976);
        assert_eq!(
            FwdKernel::named(Some("v9"), Some("4")),
            FwdKernel::V9 { warps: 4 }
        );
        assert_eq!(
            FwdKernel::named(Some("v9"), None),
            FwdKernel::V9 { warps: 0 }
        );
        assert_eq!(v9_bytes(128, 4, 3), 229_168);
        assert_eq!(v9_bytes(128, 2, 3), 208_688);
        assert_eq!(v9_bytes(128, 8, 2), 191_008);
        // gdr_fwd10 (the .cu file's V10S: K, Q 2 x 64 x 136 x 2; PT hi, lo, A 3 x 64 x 72 x 2;
        // V 64 x (BV + 8) x 2; gam 256; then 4 KB of exchange per warp and 16 NS of mbarriers)
        assert_eq!(v10_bytes(128, 4, 3), 3 * 67_840 + 4 * 4096 + 48);
        assert_eq!(v10_bytes(128, 4, 3), 219_952);
        assert_eq!(v10_bytes(128, 2, 3), 205_616);
        assert_eq!(v10_bytes(128, 8, 2), 176_672);
        assert_eq!(
            FwdKernel::named(Some("v10"), Some("4")),
            FwdKernel::V10 { warps: 4 }
        );
        assert_eq!(
            FwdKernel::named(Some("v10f"), None),
            FwdKernel::V10Fast { warps: 0 }
        );
        // gdr_bwd8 (the .cu file's table), and w4 beside gdr_hrec6 w2 within an SM's 233,472
        // bytes less 1 KB reserved per CTA.
        assert_eq!(bwd8_bytes(128, 2), 133_632);
        assert_eq!(bwd8_bytes(128, 4), 141_824);
        assert_eq!(bwd8_bytes(128, 8), 158_208);
        assert_eq!(bwd8_bytes(64, 8), 109_056);
        assert!(bwd8_bytes(128, 4) + 2 * v6r_stage_bytes(128, 2) <= 233_472 - 2 * 1024);
        // gdr_bwd9 (bwd8's bytes and 4 mbarriers) still fits beside gdr_hrec6 w2
        assert!(bwd8_bytes(128, 4) + 32 + 2 * v6r_stage_bytes(128, 2) <= 233_472 - 2 * 1024);
        // The v10 backward scans (session 19): gdr_hrec10's V10R (K 64 x 136 x 2, PT hi and lo 2
        // x 64 x 72 x 2, the V tile 64 x (16 NW + 8) x 2, gam 256) and gdr_bwd10 (two V10S stages
        // and 2 KB per warp); w4 beside gdr_hrec10 w2 still within an SM, as bwd8 beside hrec6.
        assert_eq!(v10r_stage_bytes(128, 2), 17_408 + 18_432 + 5_120 + 256);
        assert_eq!(v10r_stage_bytes(128, 2), 41_216);
        assert_eq!(v10r_stage_bytes(64, 1), 9_216 + 18_432 + 3_072 + 256);
        assert_eq!(bwd10_bytes(128, 4), 2 * 67_840 + 8_192);
        assert_eq!(bwd10_bytes(128, 4), 143_872);
        assert_eq!(bwd10_bytes(128, 2), 2 * 65_792 + 4_096);
        assert!(bwd10_bytes(128, 4) + 2 * v10r_stage_bytes(128, 2) <= 233_472 - 2 * 1024);
        // prep7's shared memory fits the H200's 227 KB at every shape the v6 pipeline takes.
        for dk in [64, 128] {
            for dv in (16..=256).step_by(16) {
                assert!(v6_supports(
                    DType::Bf16,
                    RuleShape {
                        hk: 1,
                        hv: 1,
                        dk,
                        dv
                    }
                ));
                assert!(prep7_bytes(dk, dv) <= 227 * 1024, "Dk {dk} Dv {dv}");
            }
        }
        assert_eq!(prep7_bytes(128, 256), 124_672);
    }

    /// gdr_grad10's shared memory (the .cu file's `G10<DK, DV>::BYTES`): one CTA per SM, under
    /// the 227 KB a block may have, at every head size it is built for.
    #[test]
    fn grad10_fits_an_sm() {
        assert_eq!(g10_bytes(128, 128), 228_672);
        assert_eq!(g10_k1_bytes(128, 128), 220_448);
        for dk in [64, 128] {
            for dv in [64, 128] {
                assert!(g10_bytes(dk, dv) <= 227 * 1024, "Dk {dk} Dv {dv}");
            }
        }
        assert!(g10_bytes(64, 64) < g10_bytes(128, 128));
    }

    /// gdr_grad8's shared memory (the .cu file's `G8<DK, DV>::BYTES`) at every size it takes:
    /// two CTAs (and the 1 KB the driver reserves per CTA) fit the H200's 228 KB per SM.
    #[test]
    fn grad8_fits_two_ctas_per_sm() {
        assert_eq!(g8_bytes(128, 128), 110_464);
        assert_eq!(g8_bytes(64, 64), 61_312);
        for dk in [64, 128] {
            for dv in [64, 128] {
                assert!(2 * (g8_bytes(dk, dv) + 1024) <= 233_472, "Dk {dk} Dv {dv}");
                assert!(g8_bytes(dk, dv) < g7_bytes(dk, dv));
            }
        }
    }
}
