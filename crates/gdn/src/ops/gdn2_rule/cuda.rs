//! CUDA GDN2 rule, forward and backward (kernels in `gdn2_rule.cu`).
//!
//! Same semantics and layouts as the CPU op (`super::forward` / `super::backward`): token-major
//! packed rows, sequences from `Seqs`, padding rows (at or after `seqs.used()`) get zero output
//! and zero gradients, GVA (value head `j` reads key head `j / (Hv/Hk)`; dq, dk summed over the
//! group in head order), optional in-kernel L2 norm of q and k, states `[N, Hv, Dk, Dv]` fp32.
//!
//! Storage: q, k, v, b, w (and d_o) are all f32 or all bf16; `g` is f32. Math and workspaces are
//! fp32. No atomics, fixed reduction orders: two runs give the same bits.
//!
//! Forward (issue 17): chunked by default ([`Fwd::Chunked`], kernels `g2c_*`: per (chunk, value
//! head) prep of the WY/UT pieces with per-channel decay in 16-row sub-chunks, a sequential scan
//! over the chunks per (sequence, value head, V tile) carrying the state, then the output per
//! chunk; fp32 math and workspaces; Dk, Dv <= 128, larger heads fall back to the recurrence).
//! `GDN_RULE2=recurrent` selects the token-by-token recurrence ([`Fwd::Recurrent`]), which the
//! tests compare against. The chunk prep (forward and the backward's recompute) is `g2c_prep_*`
//! unless `GDN_RULE2_PREP=v8` (or [`with_prep`]) picks [`Prep::V8`], `g2c_prep8_*`: the same
//! outputs with the block products on 3xTF32 tensor cores (module `gdn2_rule_tc`).
//! Opt-in [`Fwd::V8`] (`GDN_RULE2_FWD=v8`): `g2c_prep8h_*` (prep8 writing the mma operands in
//! bf16) then `g2f_fwd8_*`, the scan and the output fused on bf16 tensor cores with the state in
//! registers (no chunk-start states or D in memory); bf16 storage with Dk 64 / 128 and Dv a
//! multiple of 16 up to 128 ([`fwd8_supports`]), else [`Fwd::Chunked`].
//!
//! Backward (issue 17): [`Bwd::Chunked`] (`GDN_RULE2_BWD=chunked`; [`DEFAULT_BWD`] says which
//! runs when the variable is unset) recomputes the chunked forward's pieces, scans the state
//! gradient over the chunks in reverse (`g2b_dscan`), then computes every gradient per chunk
//! (`g2b_grad`); same limits as the chunked forward (Dk, Dv <= 128, else the recurrence).
//! Opt-in [`Bwd::ChunkedTc`] (`GDN_RULE2_GRAD=tc` with the chunked backward) runs `g2b_grad`'s
//! block products on TF32 tensor cores (`g2b_grad_tc_*`) for bf16 storage; f32 storage keeps the
//! exact fp32 kernel.
//!
//! Recurrent backward (and the recurrent forward): a token-by-token recurrence, one block per (sequence,
//! value head, V tile of 32 columns) with the state tile in registers. Backward stores the state at the start
//! of every 64-token chunk, then walks the chunks in reverse, recomputing each chunk's states into
//! a per-block workspace (`64 * Dk * 32` floats per block). Per-tile partials of dq, dk, dg, db
//! are summed in tile order; the GVA sum and the l2 norm's backward reuse the gated delta rule's
//! `gdr_l2norm` / `gdr_reduce_qk` kernels (module `gated_delta_rule`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::DeviceRepr;

use super::{RuleOpts, RuleShape};
use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::backend::launch::{dptr, i32_arg, launch_in, launch_in_threads, optr, ptr, suffix, Arg};
use crate::error::{GdnError, Result};
use crate::ops::common::rule_cuda::{check_backward_grads, fused_scan_warps, poison_if, zero_tail};
use crate::seqs::Seqs;

const MODULE: &str = "gdn2_rule";
const GDR_MODULE: &str = "gated_delta_rule";
/// gdn2_rule.cu with `G2B_TC_MODULE`: `g2b_grad_tc_*` (backend/kernels.rs).
const TC_MODULE: &str = "gdn2_rule_tc";
const THREADS: u32 = 256;
const ROWS_PER_BLOCK: usize = (THREADS / 32) as usize;
/// Chunk of the backward's checkpoints (tokens).
const CK: usize = 64;
/// Largest `Dk` / `Dv` the kernels support (multiples of 16).
pub const MAX_HEAD_DIM: usize = 256;

/// Gradients from [`backward`]: dq, dk `[tokens, Hk, Dk]`, dv `[tokens, Hv, Dv]`, db
/// `[tokens, Hv, Dk]`, dw `[tokens, Hv, Dv]` in the inputs' storage type; dg `[tokens, Hv, Dk]`
/// and dh0 `[N, Hv, Dk, Dv]` fp32.
pub struct Grads {
    pub dq: DBuf,
    pub dk: DBuf,
    pub dv: DBuf,
    pub dg: GBuf<f32>,
    pub db: DBuf,
    pub dw: DBuf,
    /// Gradient of the initial states, when they were given.
    pub dh0: Option<GBuf<f32>>,
}

/// Launch `module::name` on a flat grid of `blocks` blocks of 256 threads (no dynamic shared
/// memory), through the GDN rule's launcher.
fn launch(gpu: &Gpu, module: &'static str, name: &str, blocks: usize, args: &[Arg]) -> Result<()> {
    launch_in(gpu, module, name, blocks, 0, args)
}

/// Suffix of the rule kernels: the storage type, "bf16n" for bf16 with the in-kernel norm (the
/// normalized q, k are fp32).
fn rule_sfx(d: DType, opts: RuleOpts) -> &'static str {
    match (d, opts.l2norm_in_kernel) {
        (DType::Bf16, true) => "bf16n",
        _ => suffix(d),
    }
}

static POISON: AtomicBool = AtomicBool::new(false);

/// Tests only: fill every output and workspace this module allocates with NaN (all bits set)
/// before the kernels run.
#[doc(hidden)]
pub fn set_poison(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

fn poison<T: DeviceRepr>(b: &GBuf<T>) -> Result<()> {
    poison_if(POISON.load(Ordering::Relaxed), b, "gdn2 rule")
}

fn out_f32(gpu: &Arc<Gpu>, n: usize) -> Result<GBuf<f32>> {
    let b = gpu.uninit::<f32>(n.max(1))?;
    poison(&b)?;
    Ok(b)
}

/// An output of exactly `n` elements (n > 0 is guaranteed by the checks: tokens > 0).
fn out_exact(gpu: &Arc<Gpu>, n: usize) -> Result<GBuf<f32>> {
    let b = gpu.uninit::<f32>(n)?;
    poison(&b)?;
    Ok(b)
}

fn out_d(gpu: &Arc<Gpu>, n: usize, dt: DType) -> Result<DBuf> {
    let b = DBuf::uninit(gpu, n, dt)?;
    match &b {
        DBuf::F32(x) => poison(x)?,
        DBuf::Bf16(x) => poison(x)?,
    }
    Ok(b)
}

/// Input checks shared by forward and backward; returns the storage type.
#[allow(clippy::too_many_arguments)]
fn check(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    b: &DBuf,
    w: &DBuf,
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&GBuf<f32>>,
) -> Result<DType> {
    if s.hk == 0 || s.hv == 0 || s.dk == 0 || s.dv == 0 {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule: zero dimension in {s:?}"
        )));
    }
    if !s.hv.is_multiple_of(s.hk) {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule: value heads ({}) must be a multiple of key heads ({})",
            s.hv, s.hk
        )));
    }
    for (name, d) in [("Dk", s.dk), ("Dv", s.dv)] {
        if !d.is_multiple_of(16) || d > MAX_HEAD_DIM {
            return Err(GdnError::Invalid(format!(
                "gdn2 rule (CUDA): {name} = {d} is not supported; expected a multiple of 16 up to \
                 {MAX_HEAD_DIM}"
            )));
        }
    }
    let dt = q.dtype();
    for (name, x) in [("k", k), ("v", v), ("b", b), ("w", w)] {
        if x.dtype() != dt {
            return Err(GdnError::Invalid(format!(
                "gdn2 rule (CUDA): {name} is {:?} but q is {dt:?}; q, k, v, b and w must share \
                 one storage type",
                x.dtype()
            )));
        }
    }
    let n = seqs.tokens();
    let lens = [
        ("q", q.len(), n * s.hk * s.dk),
        ("k", k.len(), n * s.hk * s.dk),
        ("v", v.len(), n * s.hv * s.dv),
        ("g", g.len(), n * s.hv * s.dk),
        ("b", b.len(), n * s.hv * s.dk),
        ("w", w.len(), n * s.hv * s.dv),
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
    let same = [q.gpu(), k.gpu(), v.gpu(), g.gpu(), b.gpu(), w.gpu()]
        .into_iter()
        .chain(h0.map(|h| h.gpu()))
        .all(|x| Arc::ptr_eq(x, gpu));
    if !same {
        return Err(GdnError::Invalid(
            "gdn2 rule (CUDA): every input must live on the GPU the op runs on".into(),
        ));
    }
    if n == 0 {
        return Err(GdnError::Invalid(
            "gdn2 rule (CUDA): the input holds no tokens".into(),
        ));
    }
    Ok(dt)
}

/// l2-normalized fp32 copies of q and k (the gated delta rule's kernel).
fn normalized(gpu: &Arc<Gpu>, q: &DBuf, k: &DBuf, s: RuleShape, dt: DType) -> Result<(DBuf, DBuf)> {
    let st = gpu.stream();
    let qn = DBuf::F32(out_exact(gpu, q.len())?);
    let kn = DBuf::F32(out_exact(gpu, k.len())?);
    let rows = q.len() / s.dk;
    let name = format!("gdr_l2norm_{}", suffix(dt));
    for (x, y) in [(q, &qn), (k, &kn)] {
        launch(
            gpu,
            GDR_MODULE,
            &name,
            rows.div_ceil(ROWS_PER_BLOCK),
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

/// Sequence starts `[N + 1]` and the first 64-token chunk of every sequence `[N + 1]`.
fn tables(gpu: &Arc<Gpu>, seqs: &Seqs) -> Result<(GBuf<i64>, GBuf<i64>, usize)> {
    let mut cu = vec![0i64];
    let mut chf = vec![0i64];
    for n in 0..seqs.count() {
        let r = seqs.range(n);
        cu[n] = r.start as i64;
        cu.push(r.end as i64);
        chf.push(chf[n] + r.len().div_ceil(CK) as i64);
    }
    let chunks = *chf.last().unwrap_or(&0) as usize;
    Ok((gpu.upload(&cu)?, gpu.upload(&chf)?, chunks))
}

fn tiles(s: RuleShape) -> usize {
    s.dv.div_ceil(32)
}

/// Which forward kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fwd {
    /// The token-by-token recurrence (`g2_fwd_*`).
    Recurrent,
    /// The chunked kernels (`g2c_prep_*`, `g2c_scan*`, `g2c_out_*`) where
    /// [`chunked_supports`] says yes, else the recurrence.
    Chunked,
    /// `g2c_prep8h_*` then the fused bf16 tensor-core scan + output `g2f_fwd8_*` (CTAs of
    /// `warps` warps, 16 state columns each; 0: picked by a model) where [`fwd8_supports`] says
    /// yes, else [`Fwd::Chunked`]. `split`: `g2f_fwd8x_*`, each chain warp paired with an output
    /// warp (2 `warps` warps per CTA, `warps` <= 4; same bits). Opt-in: `GDN_RULE2_FWD=v8`
    /// (`=v8x`: split; `GDN_RULE2_V8_WARPS=1|2|4|8` forces the width).
    V8 { warps: usize, split: bool },
}

impl Fwd {
    /// `GDN_RULE2=recurrent` picks the recurrence; else `GDN_RULE2_FWD=chunked` the chunked
    /// kernels, `v8x` the split fused forward; anything else (or unset) the fused forward
    /// [`Fwd::V8`] (the default since 2026-12-02, session 8: H200, B1 T32768 16/32 11.34 ->
    /// 6.27 ms, B8 T4096 16/16 5.88 -> 2.80; the split kernel measured slower, 6.48 / 3.02).
    pub fn from_env() -> Fwd {
        if std::env::var("GDN_RULE2").as_deref() == Ok("recurrent") {
            return Fwd::Recurrent;
        }
        let warps = std::env::var("GDN_RULE2_V8_WARPS")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(0);
        match std::env::var("GDN_RULE2_FWD").as_deref() {
            Ok("v8") => Fwd::V8 {
                warps,
                split: false,
            },
            Ok("v8x") => Fwd::V8 { warps, split: true },
            Ok("chunked") => Fwd::Chunked,
            _ => Fwd::V8 {
                warps,
                split: false,
            },
        }
    }
}

/// Whether [`Fwd::V8`] runs this storage type and shape (else the chunked kernels do): bf16
/// storage, Dk 64 or 128, Dv a multiple of 16 up to [`CHUNKED_MAX_HEAD_DIM`].
pub fn fwd8_supports(dt: DType, s: RuleShape) -> bool {
    dt == DType::Bf16
        && (s.dk == 64 || s.dk == 128)
        && s.dv.is_multiple_of(16)
        && s.dv <= CHUNKED_MAX_HEAD_DIM
}

/// Largest `Dk` / `Dv` of the chunked forward (its prep kernel keeps six `[64, max(Dk, Dv)]`
/// fp32 matrices in shared memory).
pub const CHUNKED_MAX_HEAD_DIM: usize = 128;

/// Whether the chunked forward runs this shape (otherwise [`Fwd::Chunked`] falls back to the
/// recurrence). `Dk`, `Dv` are multiples of 16 (checked for every forward).
pub fn chunked_supports(s: RuleShape) -> bool {
    s.dk <= CHUNKED_MAX_HEAD_DIM && s.dv <= CHUNKED_MAX_HEAD_DIM
}

/// Forward on the GPU with the kernels [`Fwd::from_env`] names (chunked by default). Returns `o`
/// `[tokens, Hv, Dv]` (storage type of q) and, if `output_final_state`, the final states
/// `[N, Hv, Dk, Dv]` fp32.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    b: &DBuf,
    w: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
) -> Result<(DBuf, Option<GBuf<f32>>)> {
    forward_with(
        gpu,
        Fwd::from_env(),
        q,
        k,
        v,
        g,
        b,
        w,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
    )
}

/// [`forward`] with the kernels chosen by the caller.
#[allow(clippy::too_many_arguments)]
pub fn forward_with(
    gpu: &Arc<Gpu>,
    fwd: Fwd,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    b: &DBuf,
    w: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    output_final_state: bool,
) -> Result<(DBuf, Option<GBuf<f32>>)> {
    let s = shape;
    let dt = check(gpu, q, k, v, g, b, w, seqs, s, initial_state)?;
    let st = gpu.stream();
    let (cu, _chf, _) = tables(gpu, seqs)?;
    let norm = if opts.l2norm_in_kernel {
        Some(normalized(gpu, q, k, s, dt)?)
    } else {
        None
    };
    let (qq, kk) = norm.as_ref().map_or((q, k), |(a, b)| (a, b));
    let n_seq = seqs.count();
    let fin = if output_final_state {
        Some(out_f32(gpu, n_seq * s.hv * s.dk * s.dv)?)
    } else {
        None
    };
    let mut o = out_d(gpu, seqs.tokens() * s.hv * s.dv, dt)?;
    if let Fwd::V8 { warps, split } = fwd {
        if fwd8_supports(dt, s) {
            let x = ChunkedIo {
                q: qq,
                k: kk,
                v,
                g,
                b,
                w,
                h0: initial_state,
                o: &o,
                fin: fin.as_ref(),
            };
            fused_forward8(gpu, &x, seqs, s, opts, dt, warps, split)?;
            zero_tail(
                "gdn2 rule",
                gpu,
                &mut o,
                seqs.used(),
                seqs.tokens(),
                s.hv * s.dv,
            )?;
            return Ok((o, fin));
        }
    }
    if fwd != Fwd::Recurrent && chunked_supports(s) {
        let x = ChunkedIo {
            q: qq,
            k: kk,
            v,
            g,
            b,
            w,
            h0: initial_state,
            o: &o,
            fin: fin.as_ref(),
        };
        chunked_forward(gpu, &x, seqs, s, opts, dt)?;
        zero_tail(
            "gdn2 rule",
            gpu,
            &mut o,
            seqs.used(),
            seqs.tokens(),
            s.hv * s.dv,
        )?;
        return Ok((o, fin));
    }
    launch(
        gpu,
        MODULE,
        &format!("g2_fwd_{}", rule_sfx(dt, opts)),
        n_seq * s.hv * tiles(s),
        &[
            dptr(qq, st),
            dptr(kk, st),
            dptr(v, st),
            ptr(g, st),
            dptr(b, st),
            dptr(w, st),
            ptr(&cu, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(initial_state, st),
            dptr(&o, st),
            optr(fin.as_ref(), st),
        ],
    )?;
    zero_tail(
        "gdn2 rule",
        gpu,
        &mut o,
        seqs.used(),
        seqs.tokens(),
        s.hv * s.dv,
    )?;
    Ok((o, fin))
}

/// Buffers of one chunked forward (q, k already normalized when the norm is in the kernel).
struct ChunkedIo<'a> {
    q: &'a DBuf,
    k: &'a DBuf,
    v: &'a DBuf,
    g: &'a GBuf<f32>,
    b: &'a DBuf,
    w: &'a DBuf,
    h0: Option<&'a GBuf<f32>>,
    o: &'a DBuf,
    fin: Option<&'a GBuf<f32>>,
}

/// Chunk tables of the chunked kernels: global first token `t0` `[chunks]` (i64) and length `len`
/// `[chunks]` (i32) of every 64-token chunk, sequence after sequence, and the first chunk of every
/// sequence `chf` `[N + 1]` (i64). Empty sequences have no chunk. The device tables hold at least
/// one element.
struct ChunkTables {
    t0: GBuf<i64>,
    len: GBuf<i32>,
    chf: GBuf<i64>,
    chunks: usize,
}

fn chunk_tables(gpu: &Arc<Gpu>, seqs: &Seqs) -> Result<ChunkTables> {
    let (mut t0, mut len, mut chf) = (Vec::new(), Vec::new(), vec![0i64]);
    for n in 0..seqs.count() {
        let r = seqs.range(n);
        let mut c = r.start;
        while c < r.end {
            let l = CK.min(r.end - c);
            t0.push(c as i64);
            len.push(l as i32);
            c += l;
        }
        chf.push(t0.len() as i64);
    }
    let chunks = t0.len();
    if chunks == 0 {
        t0.push(0);
        len.push(0);
    }
    Ok(ChunkTables {
        t0: gpu.upload(&t0)?,
        len: gpu.upload(&len)?,
        chf: gpu.upload(&chf)?,
        chunks,
    })
}

/// Shared memory (bytes) of `g2c_prep` (see the kernel).
fn prep_smem(s: RuleShape) -> usize {
    let lx = (s.dk.max(s.dv) + 1).max(68);
    4 * (6 * CK * lx + CK * 65 + 6 * s.dk)
}

/// Which chunk-prep kernel the chunked forward and the backward's recompute run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prep {
    /// `g2c_prep_*` (module `gdn2_rule`): fp32 CUDA-core products (`GDN_RULE2_PREP=v1`).
    V1,
    /// `g2c_prep8_*` (module `gdn2_rule_tc`): the block products on 3xTF32 tensor cores,
    /// 108,544 B of shared memory (two CTAs per SM); same outputs to ~fp32 accuracy. The default
    /// since 2026-12-02 (H200, B1 T32768 16/32: 4.22 ms against g2c_prep's 20.4).
    V8,
}

thread_local! {
    static PREP_OVERRIDE: std::cell::Cell<Option<Prep>> = const { std::cell::Cell::new(None) };
}

impl Prep {
    /// `GDN_RULE2_PREP=v1` picks [`Prep::V1`]; anything else (or unset) [`Prep::V8`].
    pub fn from_env() -> Prep {
        match std::env::var("GDN_RULE2_PREP").as_deref() {
            Ok("v1") => Prep::V1,
            _ => Prep::V8,
        }
    }

    /// The prep the next chunked launch on this thread runs: [`with_prep`]'s choice, else
    /// [`Prep::from_env`].
    pub fn current() -> Prep {
        PREP_OVERRIDE
            .with(|p| p.get())
            .unwrap_or_else(Prep::from_env)
    }
}

/// Runs `f` with every chunked GDN2 forward / backward on this thread using `prep` (tests and
/// benches compare the kernels without touching the environment); restores the previous choice.
pub fn with_prep<R>(prep: Prep, f: impl FnOnce() -> R) -> R {
    let old = PREP_OVERRIDE.with(|p| p.replace(Some(prep)));
    let r = f();
    PREP_OVERRIDE.with(|p| p.set(old));
    r
}

/// Shared memory (bytes) of `g2c_prep8` (see the kernel): four `[64][72]` and two `[64][68]`
/// fp32 regions, whatever Dk, Dv (<= 128).
const PREP8_SMEM: usize = 4 * (4 * 64 * 72 + 2 * 64 * 68);

/// Launches [`Prep::current`]'s chunk prep on `ch` (chunk, value head) blocks; `args` are the
/// kernels' common arguments (`ws_t` last: null when the caller does not want T).
fn launch_prep(
    gpu: &Gpu,
    ch: usize,
    s: RuleShape,
    dt: DType,
    opts: RuleOpts,
    args: &[Arg],
) -> Result<()> {
    match Prep::current() {
        Prep::V1 => launch_in(
            gpu,
            MODULE,
            &format!("g2c_prep_{}", rule_sfx(dt, opts)),
            ch,
            prep_smem(s),
            args,
        ),
        Prep::V8 => launch_in(
            gpu,
            TC_MODULE,
            &format!("g2c_prep8_{}", rule_sfx(dt, opts)),
            ch,
            PREP8_SMEM,
            args,
        ),
    }
}

/// Tests only: the chunk prep's outputs alone (U, Wm, Qg, Kd^T, A, e^Gam_L, T; fp32, chunk by
/// chunk) from `prep` on the forward's inputs (q, k normalized first when the norm is in the
/// kernel). Errors where the chunked kernels do not run this shape.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn prep_outputs(
    gpu: &Arc<Gpu>,
    prep: Prep,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    b: &DBuf,
    w: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
) -> Result<Vec<(&'static str, Vec<f32>)>> {
    let s = shape;
    let dt = check(gpu, q, k, v, g, b, w, seqs, s, None)?;
    if !chunked_supports(s) {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule prep: Dk {} / Dv {} above {CHUNKED_MAX_HEAD_DIM}",
            s.dk, s.dv
        )));
    }
    let st = gpu.stream();
    let norm = if opts.l2norm_in_kernel {
        Some(normalized(gpu, q, k, s, dt)?)
    } else {
        None
    };
    let (qq, kk) = norm.as_ref().map_or((q, k), |(a, b)| (a, b));
    let tab = chunk_tables(gpu, seqs)?;
    let ch = tab.chunks * s.hv;
    let bufs = [
        ("u", out_f32(gpu, ch * CK * s.dv)?),
        ("wm", out_f32(gpu, ch * CK * s.dk)?),
        ("qg", out_f32(gpu, ch * CK * s.dk)?),
        ("kd", out_f32(gpu, ch * CK * s.dk)?),
        ("a", out_f32(gpu, ch * CK * CK)?),
        ("egl", out_f32(gpu, ch * s.dk)?),
        ("t", out_f32(gpu, ch * CK * CK)?),
    ];
    if ch > 0 {
        with_prep(prep, || {
            launch_prep(
                gpu,
                ch,
                s,
                dt,
                opts,
                &[
                    dptr(qq, st),
                    dptr(kk, st),
                    dptr(v, st),
                    ptr(g, st),
                    dptr(b, st),
                    dptr(w, st),
                    ptr(&tab.t0, st),
                    ptr(&tab.len, st),
                    i32_arg(s.hk),
                    i32_arg(s.hv),
                    i32_arg(s.dk),
                    i32_arg(s.dv),
                    ptr(&bufs[0].1, st),
                    ptr(&bufs[1].1, st),
                    ptr(&bufs[2].1, st),
                    ptr(&bufs[3].1, st),
                    ptr(&bufs[4].1, st),
                    ptr(&bufs[5].1, st),
                    ptr(&bufs[6].1, st),
                ],
            )
        })?;
    }
    let mut out = Vec::new();
    for (name, b) in bufs {
        out.push((name, gpu.download(&b)?));
    }
    Ok(out)
}

/// Shared memory (bytes) of `g2c_scan{bv}`: two buffers of operands, then (16) the state tile
/// and D, or (32) the transposed state, transposed D and a partial product.
fn scan_smem(s: RuleShape, bv: usize) -> usize {
    let ops = 2 * (2 * CK * s.dk + CK * bv + s.dk);
    4 * match bv {
        16 => ops + s.dk * bv + CK * bv,
        _ => ops + bv * (s.dk + 4) + bv * (CK + 4) + CK * bv,
    }
}

/// Shared memory (bytes) of `g2c_out_*`.
fn out_smem(s: RuleShape) -> usize {
    4 * (CK * s.dk + CK * CK + 64 * (s.dk + 4) + 64 * (CK + 4))
}

/// State columns per block of the chunked scan: 32 where Dv allows it, else 16;
/// `GDN_RULE2_BV=16|32` forces one (where it divides Dv).
fn scan_bv(s: RuleShape) -> usize {
    match std::env::var("GDN_RULE2_BV").as_deref() {
        Ok("16") => 16,
        Ok("32") if s.dv.is_multiple_of(32) => 32,
        _ if s.dv.is_multiple_of(32) => 32,
        _ => 16,
    }
}

/// The chunked forward: `g2c_prep`, `g2c_scan`, `g2c_out` (kernels' header comment).
fn chunked_forward(
    gpu: &Arc<Gpu>,
    x: &ChunkedIo,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    dt: DType,
) -> Result<()> {
    let st = gpu.stream();
    let ChunkTables {
        t0: ch_t0,
        len: ch_len,
        chf,
        chunks,
    } = chunk_tables(gpu, seqs)?;
    let ch = chunks * s.hv;
    let ws_u = out_f32(gpu, ch * CK * s.dv)?;
    let ws_wm = out_f32(gpu, ch * CK * s.dk)?;
    let ws_qg = out_f32(gpu, ch * CK * s.dk)?;
    let ws_kd = out_f32(gpu, ch * CK * s.dk)?;
    let ws_a = out_f32(gpu, ch * CK * CK)?;
    let ws_egl = out_f32(gpu, ch * s.dk)?;
    launch_prep(
        gpu,
        ch,
        s,
        dt,
        opts,
        &[
            dptr(x.q, st),
            dptr(x.k, st),
            dptr(x.v, st),
            ptr(x.g, st),
            dptr(x.b, st),
            dptr(x.w, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            ptr(&ws_u, st),
            ptr(&ws_wm, st),
            ptr(&ws_qg, st),
            ptr(&ws_kd, st),
            ptr(&ws_a, st),
            ptr(&ws_egl, st),
            Arg::Ptr(0),
        ],
    )?;
    let ws_h = out_f32(gpu, ch * s.dk * s.dv)?;
    let ws_d = out_f32(gpu, ch * CK * s.dv)?;
    let bv = scan_bv(s);
    launch_in(
        gpu,
        MODULE,
        &format!("g2c_scan{bv}"),
        seqs.count() * s.hv * (s.dv / bv),
        scan_smem(s, bv),
        &[
            ptr(&ws_u, st),
            ptr(&ws_wm, st),
            ptr(&ws_kd, st),
            ptr(&ws_egl, st),
            ptr(&chf, st),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            optr(x.h0, st),
            ptr(&ws_h, st),
            ptr(&ws_d, st),
            optr(x.fin, st),
        ],
    )?;
    drop((ws_u, ws_wm, ws_kd, ws_egl));
    launch_in(
        gpu,
        MODULE,
        &format!("g2c_out_{}", suffix(dt)),
        ch * s.dv.div_ceil(64),
        out_smem(s),
        &[
            ptr(&ws_qg, st),
            ptr(&ws_a, st),
            ptr(&ws_h, st),
            ptr(&ws_d, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            dptr(x.o, st),
        ],
    )?;
    Ok(())
}

/// Bytes of one pipeline stage of `g2f_fwd8` (the .cu file's `G2F8<DK, NW>::STAGE`): Wm, Qg
/// (64 rows of Dk + 8 bf16), Kd^T (Dk rows of 72 bf16), A (64 rows of 72 bf16), the U tile (64
/// rows of 16 warps + 4 fp32), e^Gam_L (Dk fp32).
pub fn fwd8_stage_bytes(dk: usize, warps: usize) -> usize {
    2 * CK * (dk + 8) * 2
        + dk * (CK + 8) * 2
        + CK * (CK + 8) * 2
        + CK * (16 * warps + 4) * 4
        + dk * 4
}

/// CTA width of `g2f_fwd8` (warps of 16 state columns): `forced` where valid, else the width
/// with the lowest modelled cost, the GDN rule's v6 model (`ops::common::rule_cuda::
/// fused_scan_warps`): one CTA per SM, every warp re-reads the chunk's Wm, Qg, Kd and A fragments, so cost = waves x
/// shared-memory bytes per SM per chunk step. `split` (2 `w` warps per CTA): `w` <= 4.
fn fwd8_warps(gpu: &Gpu, n_seq: usize, s: RuleShape, forced: usize, split: bool) -> usize {
    fused_scan_warps(
        gpu.sm_count().unwrap_or(132),
        n_seq,
        s,
        CK,
        forced,
        |w| s.dv.is_multiple_of(16 * w) && (!split || w <= 4),
        |w| fwd8_stage_bytes(s.dk, w),
    )
}

/// An uninitialized bf16 workspace of `n` elements (at least one; poisoned in tests).
fn ws_bf16(gpu: &Arc<Gpu>, n: usize) -> Result<GBuf<u16>> {
    let b = gpu.uninit::<u16>(n.max(1))?;
    poison(&b)?;
    Ok(b)
}

/// The workspaces of `g2c_prep8h_*` / `g2c_prep8ht_*`: U, e^Gam_L fp32; Wm, Qg, Kd^T, A bf16.
struct P8h {
    u: GBuf<f32>,
    wm: GBuf<u16>,
    qg: GBuf<u16>,
    kt: GBuf<u16>,
    a: GBuf<u16>,
    egl: GBuf<f32>,
}

/// Whether the bf16-output chunk prep runs its products as one TF32 product instead of 3xTF32
/// (`g2c_prep8hf_*` / `g2c_prep8htf_*`; opt-in `GDN_RULE2_PREP8=f1`, not yet measured: the
/// outputs are bf16, so 3xTF32's accuracy is mostly rounded away).
pub fn prep8_f1() -> bool {
    std::env::var("GDN_RULE2_PREP8").as_deref() == Ok("f1")
}

/// Runs the chunk prep with bf16 outputs on `ch` (chunk, value head) blocks: `g2c_prep8h_{sfx}`,
/// or with `t` (`[ch][64][64]` fp32) `g2c_prep8ht_{sfx}`, which writes T there too; with
/// [`prep8_f1`] their one-TF32-product twins. `qkvbw` = q, k (normalized where the norm is in
/// the kernel), v, b, w.
#[allow(clippy::too_many_arguments)]
fn prep8h(
    gpu: &Arc<Gpu>,
    qkvbw: [&DBuf; 5],
    g: &GBuf<f32>,
    (ch_t0, ch_len): (&GBuf<i64>, &GBuf<i32>),
    ch: usize,
    s: RuleShape,
    sfx: &str,
    t: Option<&GBuf<f32>>,
) -> Result<P8h> {
    let st = gpu.stream();
    let [q, k, v, b, w] = qkvbw;
    let o = P8h {
        u: out_f32(gpu, ch * CK * s.dv)?,
        wm: ws_bf16(gpu, ch * CK * s.dk)?,
        qg: ws_bf16(gpu, ch * CK * s.dk)?,
        kt: ws_bf16(gpu, ch * CK * s.dk)?,
        a: ws_bf16(gpu, ch * CK * CK)?,
        egl: out_f32(gpu, ch * s.dk)?,
    };
    let mut args = vec![
        dptr(q, st),
        dptr(k, st),
        dptr(v, st),
        ptr(g, st),
        dptr(b, st),
        dptr(w, st),
        ptr(ch_t0, st),
        ptr(ch_len, st),
        i32_arg(s.hk),
        i32_arg(s.hv),
        i32_arg(s.dk),
        i32_arg(s.dv),
        ptr(&o.u, st),
        ptr(&o.wm, st),
        ptr(&o.qg, st),
        ptr(&o.kt, st),
        ptr(&o.a, st),
        ptr(&o.egl, st),
    ];
    if let Some(t) = t {
        args.push(ptr(t, st));
    }
    let name = format!(
        "g2c_prep8h{}{}_{sfx}",
        if t.is_some() { "t" } else { "" },
        if prep8_f1() { "f" } else { "" }
    );
    launch_in(gpu, TC_MODULE, &name, ch, PREP8_SMEM, &args)?;
    Ok(o)
}

/// [`Fwd::V8`]: `g2c_prep8h_*` (U, e^Gam_L fp32; Wm, Qg, Kd^T, A bf16), then `g2f_fwd8_*` (the
/// scan and the output fused, kernels' header comment; `split`: `g2f_fwd8x_*`). Callers checked
/// [`fwd8_supports`].
#[allow(clippy::too_many_arguments)]
fn fused_forward8(
    gpu: &Arc<Gpu>,
    x: &ChunkedIo,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    dt: DType,
    warps: usize,
    split: bool,
) -> Result<()> {
    let st = gpu.stream();
    let ChunkTables {
        t0: ch_t0,
        len: ch_len,
        chf,
        chunks,
    } = chunk_tables(gpu, seqs)?;
    let P8h {
        u: ws_u,
        wm: ws_wm,
        qg: ws_qg,
        kt: ws_kt,
        a: ws_a,
        egl: ws_egl,
    } = prep8h(
        gpu,
        [x.q, x.k, x.v, x.b, x.w],
        x.g,
        (&ch_t0, &ch_len),
        chunks * s.hv,
        s,
        rule_sfx(dt, opts),
        None,
    )?;
    let nw = fwd8_warps(gpu, seqs.count(), s, warps, split);
    // Split: the exchanged fragments (S0^T 4 KiB, D^T 2 KiB per chain warp) after the stages.
    let stages = fused_scan_stages(s.dk, nw);
    let name = format!(
        "g2f_fwd8{}{}_d{}_w{nw}",
        if split { "x" } else { "" },
        if stages == 3 { "s3" } else { "" },
        s.dk
    );
    launch_in_threads(
        gpu,
        TC_MODULE,
        &name,
        seqs.count() * s.hv * (s.dv / (16 * nw)),
        (32 * nw * if split { 2 } else { 1 }) as u32,
        stages * fwd8_stage_bytes(s.dk, nw) + if split { 6144 * nw } else { 0 },
        &[
            ptr(&ws_wm, st),
            ptr(&ws_qg, st),
            ptr(&ws_kt, st),
            ptr(&ws_a, st),
            ptr(&ws_u, st),
            ptr(&ws_egl, st),
            ptr(&chf, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hv),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(x.h0, st),
            dptr(x.o, st),
            optr(x.fin, st),
        ],
    )?;
    Ok(())
}

/// Which backward kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bwd {
    /// The token-by-token recurrence (`g2_bwd_*`, `g2_reduce_*`).
    Recurrent,
    /// The chunked kernels (`g2c_prep_*` and `g2c_scan*` recomputing the forward, then
    /// `g2b_dscan*`, `g2b_grad_*`) where [`chunked_supports`] says yes, else the recurrence.
    Chunked,
    /// [`Bwd::Chunked`] with `g2b_grad`'s block products on TF32 tensor cores
    /// (`g2b_grad_tc_*`: operands rounded to 10 mantissa bits, fp32 accumulation) for bf16
    /// storage; f32 storage runs exactly [`Bwd::Chunked`]. Opt-in: `GDN_RULE2_GRAD=tc`.
    ChunkedTc,
    /// Backward v2 (`GDN_RULE2_BWD=v2`; the default in sessions 8-9, bench/notes/h-g2bw.md): [`Bwd::ChunkedTc`]'s
    /// kernels with `g2b_dscan*p` (the reverse scan with its operand loads overlapped with the
    /// math: the same bits as `g2b_dscan*`) and, for bf16 storage, `g2b_grad2_*` (the tc products,
    /// coalesced scratch stores and dg row dots, ex2.approx in the Gram step); f32 storage keeps
    /// the fp32 `g2b_grad_f32`.
    V2,
    /// [`Bwd::V2`] with, for bf16 storage, `g2b_grad3_*` (bench/notes/h-g2g3.md): `g2b_grad2`
    /// with the Gram step by 16-row blocks (the 6 blocks below the diagonal as 3xTF32 tensor-core
    /// products with per-channel scale vectors, only the diagonal blocks elementwise). The
    /// default ([`DEFAULT_BWD`]); `GDN_RULE2_GRAD=v3` with `GDN_RULE2_BWD=v2` picks it too; f32
    /// storage is exactly [`Bwd::V2`].
    V3,
    /// [`Bwd::V3`] with, for bf16 storage and Dk, Dv multiples of 16 ([`v4_supports`]),
    /// `g2b_grad4_*` (bench/notes/h-g2g4.md): the same math rebuilt on bf16 `mma.sync` tensor
    /// cores fed by `ldmatrix` from operands staged once in shared memory as bf16 (FLA's
    /// operand precision: ~2e-3 RMS against f64 where v3's TF32 products give ~3e-4), the
    /// diagonal 16-row blocks of the Gram step on tensor cores through the block's middle row
    /// wherever every block's decay is at most 2^64 (else v3's elementwise sums), dg's reverse
    /// sum in registers. Opt-in: `GDN_RULE2_BWD=v4`; other shapes and f32 storage run [`Bwd::V3`].
    V4,
    /// Backward v5 (bench/notes/h-g2g4.md): every piece on bf16 tensor cores, every workspace
    /// bf16: the recompute as the fused forward's prep and scan (`g2c_prep8ht_*`, which also
    /// writes T, and `g2f_hrec8_*`, storing h and D instead of the output), the reverse scan
    /// `g2b_dscan8_*` (g2f_fwd8's design run backwards: dS^T in registers), then `g2b_grad4w_*`
    /// (`g2b_grad4` reading bf16 h, D, dh, dD). Where [`v5_supports`] says no, [`Bwd::V4`].
    /// Opt-in: `GDN_RULE2_BWD=v5`.
    V5,
}

/// Whether `g2b_grad4` ([`Bwd::V4`]) takes the shape: Dk and Dv multiples of 16 (its bf16
/// tiles are read 16 columns at a time) within the chunked kernels' limits.
pub fn v4_supports(s: RuleShape) -> bool {
    chunked_supports(s) && s.dk.is_multiple_of(16) && s.dv.is_multiple_of(16)
}

/// Whether backward v5 ([`Bwd::V5`]) takes the storage type and shape: [`fwd8_supports`]
/// (bf16, Dk 64 or 128, Dv a multiple of 16) and [`v4_supports`].
pub fn v5_supports(dt: DType, s: RuleShape) -> bool {
    fwd8_supports(dt, s) && v4_supports(s)
}

/// Bytes of one pipeline stage of `g2b_dscan8` (the .cu file's `G2D8<DK, NW>::STAGE`): Kd^T
/// (Dk rows of 72 bf16), A (64 rows of 72 bf16), Qg, Wm (64 rows of Dk + 8 bf16), the dO tile
/// (64 rows of 16 warps + 8 bf16), e^Gam_L (Dk fp32).
pub fn dscan8_stage_bytes(dk: usize, warps: usize) -> usize {
    2 * (dk * (CK + 8) + CK * (CK + 8) + 2 * CK * (dk + 8) + CK * (16 * warps + 8)) + 4 * dk
}

/// Pipeline stages of the fused scans (`g2f_fwd8`, backward v5's `g2f_hrec8` and `g2b_dscan8`)
/// at `warps` warps per CTA: three where they fit in shared memory (Dk 128, 1 or 2 warps; the
/// kernels' `s3` entries), else two.
fn fused_scan_stages(dk: usize, warps: usize) -> usize {
    if dk == 128 && warps <= 2 {
        3
    } else {
        2
    }
}

/// Shared memory (bytes) of `g2b_grad4_*`: `G4_SMEM` in gdn2_rule.cu (its fixed layout for
/// Dk, Dv <= 128: the persistent tiles, then the region phase A and phase C share).
const G4_SMEM: usize = 218_368;
// One CTA's dynamic shared memory at most (sm_90: 227 KiB).
const _: () = assert!(G4_SMEM <= 232_448);

/// The backward [`Bwd::from_env`] picks when `GDN_RULE2_BWD` is unset: [`Bwd::V3`] (since
/// 2026-12-02, session 10: its GPU tests passed on the H200; B1 T32768 16/32 backward 55.3 ms
/// (v2) -> 49.8, g2b_grad2 ~36.7 -> g2b_grad3 31.8; B8 T4096 16/16 28.5 -> 25.6; before it
/// [`Bwd::V2`], since session 8). `GDN_RULE2_BWD=v2` keeps v2, `GDN_RULE2_BWD=chunked` the fp32
/// gradient kernel (`GDN_RULE2_GRAD=tc` with it: the TF32 one).
pub const DEFAULT_BWD: Bwd = Bwd::V3;

impl Bwd {
    /// `GDN_RULE2_BWD=chunked` or `=recurrent` picks the kernels; unset (or anything else),
    /// [`DEFAULT_BWD`]. A chunked choice becomes [`Bwd::ChunkedTc`] with `GDN_RULE2_GRAD=tc`;
    /// `GDN_RULE2_BWD=v3`, or v2 with `GDN_RULE2_GRAD=v3`, is [`Bwd::V3`]; `GDN_RULE2_BWD=v4`
    /// and `=v5` are [`Bwd::V4`] and [`Bwd::V5`].
    pub fn from_env() -> Bwd {
        let bwd = match std::env::var("GDN_RULE2_BWD").as_deref() {
            Ok("chunked") => Bwd::Chunked,
            Ok("recurrent") => Bwd::Recurrent,
            Ok("v2") => Bwd::V2,
            Ok("v3") => Bwd::V3,
            Ok("v4") => Bwd::V4,
            Ok("v5") => Bwd::V5,
            _ => DEFAULT_BWD,
        };
        match (bwd, std::env::var("GDN_RULE2_GRAD").as_deref()) {
            (Bwd::Chunked, Ok("tc")) => Bwd::ChunkedTc,
            (Bwd::V2, Ok("v3")) => Bwd::V3,
            _ => bwd,
        }
    }
}

/// Backward on the GPU from `d_o` `[tokens, Hv, Dv]` (storage type of q) and optionally the
/// gradient of the final states (fp32), with the kernels [`Bwd::from_env`] names. Recomputes the
/// states from the inputs.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    gpu: &Arc<Gpu>,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    b: &DBuf,
    w: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
) -> Result<Grads> {
    backward_with(
        gpu,
        Bwd::from_env(),
        q,
        k,
        v,
        g,
        b,
        w,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
    )
}

/// [`backward`] with the kernels chosen by the caller.
#[allow(clippy::too_many_arguments)]
pub fn backward_with(
    gpu: &Arc<Gpu>,
    bwd: Bwd,
    q: &DBuf,
    k: &DBuf,
    v: &DBuf,
    g: &GBuf<f32>,
    b: &DBuf,
    w: &DBuf,
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&GBuf<f32>>,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
) -> Result<Grads> {
    let s = shape;
    let dt = check(gpu, q, k, v, g, b, w, seqs, s, initial_state)?;
    let (tokens, n_seq) = (seqs.tokens(), seqs.count());
    check_backward_grads("gdn2 rule", gpu, dt, seqs, s, d_o, d_final_state)?;
    let st = gpu.stream();
    let norm = if opts.l2norm_in_kernel {
        Some(normalized(gpu, q, k, s, dt)?)
    } else {
        None
    };
    let (qq, kk) = norm.as_ref().map_or((q, k), |(a, b)| (a, b));
    if bwd != Bwd::Recurrent && chunked_supports(s) {
        let x = BwdIo {
            q,
            k,
            qq,
            kk,
            v,
            g,
            b,
            w,
            h0: initial_state,
            d_o,
            dht: d_final_state,
        };
        if bwd == Bwd::V5 && v5_supports(dt, s) {
            return chunked_backward_v5(gpu, &x, seqs, s, opts, dt);
        }
        return chunked_backward(gpu, &x, seqs, s, opts, dt, bwd);
    }
    let (cu, chf, chunks) = tables(gpu, seqs)?;
    let nt = tiles(s);
    let blocks = n_seq * s.hv * nt;
    let ckpt = out_f32(gpu, chunks * s.hv * s.dk * s.dv)?;
    let loc = out_f32(gpu, blocks * CK * s.dk * 32)?;
    let part = tokens * s.hv * s.dk;
    let dq_p = out_exact(gpu, nt * part)?;
    let dk_p = out_exact(gpu, nt * part)?;
    let dg_p = out_exact(gpu, nt * part)?;
    let db_p = out_exact(gpu, nt * part)?;
    let mut dv = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let mut dw = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let dh0 = match initial_state {
        Some(_) => Some(out_f32(gpu, n_seq * s.hv * s.dk * s.dv)?),
        None => None,
    };
    launch(
        gpu,
        MODULE,
        &format!("g2_bwd_{}", rule_sfx(dt, opts)),
        blocks,
        &[
            dptr(qq, st),
            dptr(kk, st),
            dptr(v, st),
            ptr(g, st),
            dptr(b, st),
            dptr(w, st),
            dptr(d_o, st),
            ptr(&cu, st),
            ptr(&chf, st),
            Arg::I64(tokens as i64),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(initial_state, st),
            optr(d_final_state, st),
            ptr(&ckpt, st),
            ptr(&loc, st),
            ptr(&dq_p, st),
            ptr(&dk_p, st),
            ptr(&dg_p, st),
            ptr(&db_p, st),
            dptr(&dv, st),
            dptr(&dw, st),
            optr(dh0.as_ref(), st),
        ],
    )?;
    drop((ckpt, loc));
    let dqs = out_exact(gpu, part)?;
    let dks = out_exact(gpu, part)?;
    let dg = out_exact(gpu, part)?;
    let db = out_d(gpu, part, dt)?;
    launch(
        gpu,
        MODULE,
        &format!("g2_reduce_{}", suffix(dt)),
        part.div_ceil(THREADS as usize),
        &[
            ptr(&dq_p, st),
            ptr(&dk_p, st),
            ptr(&dg_p, st),
            ptr(&db_p, st),
            i32_arg(nt),
            Arg::I64(tokens as i64),
            Arg::I64(seqs.used() as i64),
            i32_arg(s.hv),
            i32_arg(s.dk),
            ptr(&dqs, st),
            ptr(&dks, st),
            ptr(&dg, st),
            dptr(&db, st),
        ],
    )?;
    drop((dq_p, dk_p, dg_p, db_p));
    let dq = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    let dk = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    launch(
        gpu,
        GDR_MODULE,
        &format!("gdr_reduce_qk_{}", suffix(dt)),
        (tokens * s.hk).div_ceil(ROWS_PER_BLOCK),
        &[
            dptr(q, st),
            dptr(k, st),
            ptr(&dqs, st),
            ptr(&dks, st),
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
    zero_tail("gdn2 rule", gpu, &mut dv, used, tokens, s.hv * s.dv)?;
    zero_tail("gdn2 rule", gpu, &mut dw, used, tokens, s.hv * s.dv)?;
    Ok(Grads {
        dq,
        dk,
        dv,
        dg,
        db,
        dw,
        dh0,
    })
}

/// Inputs of one chunked backward: the raw q, k (for the l2 norm's backward) and the ones the
/// rule reads (`qq`, `kk`: normalized fp32 copies when the norm is in the kernel).
struct BwdIo<'a> {
    q: &'a DBuf,
    k: &'a DBuf,
    qq: &'a DBuf,
    kk: &'a DBuf,
    v: &'a DBuf,
    g: &'a GBuf<f32>,
    b: &'a DBuf,
    w: &'a DBuf,
    h0: Option<&'a GBuf<f32>>,
    d_o: &'a DBuf,
    dht: Option<&'a GBuf<f32>>,
}

/// State columns per block of `g2b_dscan`: 32 where Dv allows it, else 16.
fn dscan_bv(s: RuleShape) -> usize {
    if s.dv.is_multiple_of(32) {
        32
    } else {
        16
    }
}

/// Shared memory (bytes) of `g2b_dscan{bv}` (see the kernel).
fn dscan_smem(s: RuleShape, bv: usize) -> usize {
    4 * (3 * CK * s.dk + CK * CK + s.dk + 2 * CK * bv + s.dk * bv)
}

/// Shared memory (bytes) of `g2b_dscan{bv}p` (v2): `g2b_dscan`'s plus a second dO tile.
fn dscan_p_smem(s: RuleShape, bv: usize) -> usize {
    dscan_smem(s, bv) + 4 * CK * bv
}

/// Shared memory (bytes) of `g2b_grad_*` (see the kernel): 230400 at Dk = 128; with `tc`
/// (`g2b_grad_tc_*`, a larger staging area) 232192 (the limit is 232448).
fn grad_smem(s: RuleShape, tc: bool) -> usize {
    let stage = if tc { 2 * CK * (32 + 4) } else { 2 * 32 * 65 };
    4 * (5 * CK * s.dk + 3 * CK * 65 + stage)
}

/// The chunked backward (kernels' header comment in `gdn2_rule.cu`): recompute the forward's
/// chunk pieces (`g2c_prep`, with T) and chunk-start states (`g2c_scan`), the reverse scan of
/// the state gradient (`g2b_dscan`), every gradient per chunk (`g2b_grad`), then the GVA sum and
/// the l2 norm's backward (`gdr_reduce_qk`). `bwd` (a chunked choice) picks `g2b_dscan*` or
/// `g2b_dscan*p` and `g2b_grad_*`, `g2b_grad_tc_*` or `g2b_grad2_*` (the last two for bf16 only).
fn chunked_backward(
    gpu: &Arc<Gpu>,
    x: &BwdIo,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    dt: DType,
    bwd: Bwd,
) -> Result<Grads> {
    let bf = dt == DType::Bf16;
    // v2, v3 and v4 (and v5 where it falls back to v4) share the pipelined reverse scan.
    let v2 = matches!(bwd, Bwd::V2 | Bwd::V3 | Bwd::V4 | Bwd::V5);
    let v4 = matches!(bwd, Bwd::V4 | Bwd::V5) && bf && v4_supports(s);
    // (module, name prefix) of g2b_grad.
    let grad = match (bwd, bf) {
        _ if v4 => (TC_MODULE, "g2b_grad4_"),
        (Bwd::ChunkedTc, true) => (TC_MODULE, "g2b_grad_tc_"),
        (Bwd::V2, true) => (TC_MODULE, "g2b_grad2_"),
        (Bwd::V3 | Bwd::V4 | Bwd::V5, true) => (TC_MODULE, "g2b_grad3_"),
        _ => (MODULE, "g2b_grad_"),
    };
    let tc = grad.0 == TC_MODULE;
    let st = gpu.stream();
    let n_seq = seqs.count();
    let ChunkTables {
        t0: ch_t0,
        len: ch_len,
        chf,
        chunks,
    } = chunk_tables(gpu, seqs)?;
    let ch = chunks * s.hv;
    let ws_u = out_f32(gpu, ch * CK * s.dv)?;
    let ws_wm = out_f32(gpu, ch * CK * s.dk)?;
    let ws_qg = out_f32(gpu, ch * CK * s.dk)?;
    let ws_kd = out_f32(gpu, ch * CK * s.dk)?;
    let ws_a = out_f32(gpu, ch * CK * CK)?;
    let ws_egl = out_f32(gpu, ch * s.dk)?;
    let ws_t = out_f32(gpu, ch * CK * CK)?;
    launch_prep(
        gpu,
        ch,
        s,
        dt,
        opts,
        &[
            dptr(x.qq, st),
            dptr(x.kk, st),
            dptr(x.v, st),
            ptr(x.g, st),
            dptr(x.b, st),
            dptr(x.w, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            ptr(&ws_u, st),
            ptr(&ws_wm, st),
            ptr(&ws_qg, st),
            ptr(&ws_kd, st),
            ptr(&ws_a, st),
            ptr(&ws_egl, st),
            ptr(&ws_t, st),
        ],
    )?;
    let ws_h = out_f32(gpu, ch * s.dk * s.dv)?;
    let ws_d = out_f32(gpu, ch * CK * s.dv)?;
    let bv = scan_bv(s);
    launch_in(
        gpu,
        MODULE,
        &format!("g2c_scan{bv}"),
        n_seq * s.hv * (s.dv / bv),
        scan_smem(s, bv),
        &[
            ptr(&ws_u, st),
            ptr(&ws_wm, st),
            ptr(&ws_kd, st),
            ptr(&ws_egl, st),
            ptr(&chf, st),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            optr(x.h0, st),
            ptr(&ws_h, st),
            ptr(&ws_d, st),
            Arg::Ptr(0),
        ],
    )?;
    drop(ws_u);
    let ws_dh = out_f32(gpu, ch * s.dk * s.dv)?;
    let ws_dd = out_f32(gpu, ch * CK * s.dv)?;
    let dh0 = match x.h0 {
        Some(_) => Some(out_f32(gpu, n_seq * s.hv * s.dk * s.dv)?),
        None => None,
    };
    let bvb = dscan_bv(s);
    launch_in(
        gpu,
        if v2 { TC_MODULE } else { MODULE },
        &format!("g2b_dscan{bvb}{}_{}", if v2 { "p" } else { "" }, suffix(dt)),
        n_seq * s.hv * (s.dv / bvb),
        if v2 {
            dscan_p_smem(s, bvb)
        } else {
            dscan_smem(s, bvb)
        },
        &[
            ptr(&ws_kd, st),
            ptr(&ws_a, st),
            ptr(&ws_qg, st),
            ptr(&ws_wm, st),
            ptr(&ws_egl, st),
            dptr(x.d_o, st),
            ptr(&chf, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(x.dht, st),
            ptr(&ws_dh, st),
            ptr(&ws_dd, st),
            optr(dh0.as_ref(), st),
        ],
    )?;
    drop((ws_wm, ws_qg, ws_kd, ws_a, ws_egl));
    // g2b_grad4 keeps two of the four scratch tiles (dKd, dQg).
    let ws_g = out_f32(gpu, ch * if v4 { 2 } else { 4 } * CK * s.dk)?;
    grad_and_finish(
        gpu,
        x,
        seqs,
        s,
        opts,
        dt,
        &format!("{}{}", grad.1, rule_sfx(dt, opts)),
        grad.0,
        if v4 { G4_SMEM } else { grad_smem(s, tc) },
        [&ws_h, &ws_d, &ws_dh, &ws_dd],
        &ws_t,
        &ws_g,
        (&ch_t0, &ch_len),
        dh0,
    )
}

/// Backward v5 ([`Bwd::V5`], kernels' header comment in `gdn2_rule.cu`, "Backward v5"):
/// `g2c_prep8ht`, `g2f_hrec8` (h, D), `g2b_dscan8` (dh, dD, dh0), then [`grad_and_finish`]
/// with `g2b_grad4w`. Callers checked [`v5_supports`].
fn chunked_backward_v5(
    gpu: &Arc<Gpu>,
    x: &BwdIo,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    dt: DType,
) -> Result<Grads> {
    let st = gpu.stream();
    let n_seq = seqs.count();
    let ChunkTables {
        t0: ch_t0,
        len: ch_len,
        chf,
        chunks,
    } = chunk_tables(gpu, seqs)?;
    let ch = chunks * s.hv;
    let sfx = rule_sfx(dt, opts);
    let ws_t = out_f32(gpu, ch * CK * CK)?;
    let P8h {
        u: ws_u,
        wm: ws_wm,
        qg: ws_qg,
        kt: ws_kt,
        a: ws_a,
        egl: ws_egl,
    } = prep8h(
        gpu,
        [x.qq, x.kk, x.v, x.b, x.w],
        x.g,
        (&ch_t0, &ch_len),
        ch,
        s,
        sfx,
        Some(&ws_t),
    )?;
    // The recompute: g2f_fwd8's width and stages.
    let nw = fwd8_warps(gpu, n_seq, s, 0, false);
    let ns = fused_scan_stages(s.dk, nw);
    let s3 = if ns == 3 { "s3" } else { "" };
    let ws_h = ws_bf16(gpu, ch * s.dk * s.dv)?;
    let ws_d = ws_bf16(gpu, ch * CK * s.dv)?;
    launch_in_threads(
        gpu,
        TC_MODULE,
        &format!("g2f_hrec8{s3}_d{}_w{nw}", s.dk),
        n_seq * s.hv * (s.dv / (16 * nw)),
        (32 * nw) as u32,
        ns * fwd8_stage_bytes(s.dk, nw),
        &[
            ptr(&ws_wm, st),
            ptr(&ws_qg, st),
            ptr(&ws_kt, st),
            ptr(&ws_a, st),
            ptr(&ws_u, st),
            ptr(&ws_egl, st),
            ptr(&chf, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hv),
            i32_arg(s.dv),
            optr(x.h0, st),
            ptr(&ws_h, st),
            ptr(&ws_d, st),
        ],
    )?;
    drop(ws_u);
    // The reverse scan: the same width model with its own stage size.
    let nwd = fused_scan_warps(
        gpu.sm_count().unwrap_or(132),
        n_seq,
        s,
        CK,
        0,
        |w| s.dv.is_multiple_of(16 * w),
        |w| dscan8_stage_bytes(s.dk, w),
    );
    let nsd = fused_scan_stages(s.dk, nwd);
    let s3d = if nsd == 3 { "s3" } else { "" };
    let ws_dh = ws_bf16(gpu, ch * s.dk * s.dv)?;
    let ws_dd = ws_bf16(gpu, ch * CK * s.dv)?;
    let dh0 = match x.h0 {
        Some(_) => Some(out_f32(gpu, n_seq * s.hv * s.dk * s.dv)?),
        None => None,
    };
    launch_in_threads(
        gpu,
        TC_MODULE,
        &format!("g2b_dscan8{s3d}_d{}_w{nwd}", s.dk),
        n_seq * s.hv * (s.dv / (16 * nwd)),
        (32 * nwd) as u32,
        nsd * dscan8_stage_bytes(s.dk, nwd),
        &[
            ptr(&ws_kt, st),
            ptr(&ws_a, st),
            ptr(&ws_qg, st),
            ptr(&ws_wm, st),
            ptr(&ws_egl, st),
            dptr(x.d_o, st),
            ptr(&chf, st),
            ptr(&ch_t0, st),
            ptr(&ch_len, st),
            i32_arg(s.hv),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            optr(x.dht, st),
            ptr(&ws_dh, st),
            ptr(&ws_dd, st),
            optr(dh0.as_ref(), st),
        ],
    )?;
    drop((ws_wm, ws_qg, ws_kt, ws_a, ws_egl));
    let ws_g = out_f32(gpu, ch * 2 * CK * s.dk)?;
    grad_and_finish(
        gpu,
        x,
        seqs,
        s,
        opts,
        dt,
        &format!("g2b_grad4w_{sfx}"),
        TC_MODULE,
        G4_SMEM,
        [&ws_h, &ws_d, &ws_dh, &ws_dd],
        &ws_t,
        &ws_g,
        (&ch_t0, &ch_len),
        dh0,
    )
}

/// The chunked backward's last steps: the per-chunk gradient kernel `name` (module `module`,
/// `smem` bytes; its workspaces h, D, dh, dD in `hd` (fp32 or bf16, as the kernel reads them),
/// T, scratch), then the GVA sum and the l2 norm's backward (`gdr_reduce_qk`) and the padding
/// rows zeroed.
#[allow(clippy::too_many_arguments)]
fn grad_and_finish<W: DeviceRepr>(
    gpu: &Arc<Gpu>,
    x: &BwdIo,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    dt: DType,
    name: &str,
    module: &'static str,
    smem: usize,
    hd: [&GBuf<W>; 4],
    ws_t: &GBuf<f32>,
    ws_g: &GBuf<f32>,
    (ch_t0, ch_len): (&GBuf<i64>, &GBuf<i32>),
    dh0: Option<GBuf<f32>>,
) -> Result<Grads> {
    let st = gpu.stream();
    let (tokens, used) = (seqs.tokens(), seqs.used());
    let ch = ws_t.len() / (CK * CK);
    let part = tokens * s.hv * s.dk;
    let dqs = out_exact(gpu, part)?;
    let dks = out_exact(gpu, part)?;
    let mut dv = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let mut dw = out_d(gpu, tokens * s.hv * s.dv, dt)?;
    let mut dg = out_exact(gpu, part)?;
    let mut db = out_d(gpu, part, dt)?;
    launch_in(
        gpu,
        module,
        name,
        ch,
        smem,
        &[
            dptr(x.qq, st),
            dptr(x.kk, st),
            dptr(x.v, st),
            ptr(x.g, st),
            dptr(x.b, st),
            dptr(x.w, st),
            dptr(x.d_o, st),
            ptr(ch_t0, st),
            ptr(ch_len, st),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            i32_arg(s.dv),
            Arg::F32(opts.scale),
            ptr(hd[0], st),
            ptr(hd[1], st),
            ptr(hd[2], st),
            ptr(hd[3], st),
            ptr(ws_t, st),
            ptr(ws_g, st),
            ptr(&dqs, st),
            ptr(&dks, st),
            dptr(&dv, st),
            dptr(&dw, st),
            ptr(&dg, st),
            dptr(&db, st),
        ],
    )?;
    let dq = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    let dk = out_d(gpu, tokens * s.hk * s.dk, dt)?;
    launch(
        gpu,
        GDR_MODULE,
        &format!("gdr_reduce_qk_{}", suffix(dt)),
        (tokens * s.hk).div_ceil(ROWS_PER_BLOCK),
        &[
            dptr(x.q, st),
            dptr(x.k, st),
            ptr(&dqs, st),
            ptr(&dks, st),
            Arg::I64(tokens as i64),
            Arg::I64(used as i64),
            i32_arg(s.hk),
            i32_arg(s.hv),
            i32_arg(s.dk),
            Arg::I32(opts.l2norm_in_kernel as i32),
            dptr(&dq, st),
            dptr(&dk, st),
        ],
    )?;
    for b in [&mut dv, &mut dw] {
        zero_tail("gdn2 rule", gpu, b, used, tokens, s.hv * s.dv)?;
    }
    zero_tail("gdn2 rule", gpu, &mut db, used, tokens, s.hv * s.dk)?;
    if used < tokens {
        let wd = s.hv * s.dk;
        st.memset_zeros(&mut dg.slice.slice_mut(used * wd..tokens * wd))
            .map_err(|e| GdnError::Device(format!("gdn2 rule: zeroing padding rows: {e:?}")))?;
    }
    Ok(Grads {
        dq,
        dk,
        dv,
        dg,
        db,
        dw,
        dh0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The most dynamic shared memory a CTA may ask for on sm_90 (227 KiB).
    const SMEM_MAX: usize = 232_448;

    /// Backward v4 / v5's launches: every (Dk, width) the width model can pick for `g2f_hrec8`
    /// and `g2b_dscan8` fits in shared memory with the stages `fused_scan_stages` gives and names an
    /// entry gdn2_rule.cu defines (a missing one fails only on a GPU otherwise); the stage sizes
    /// are the .cu structs' (`G2F8`, `G2D8`: hand-computed at Dk 128, 2 warps); `G4_SMEM` is
    /// g2b_grad4's layout (`G4_SMEM` in the .cu: four [64][72] and one [64][136] bf16 tiles, dA_ii,
    /// <S0, dS1>, 15 x 128 constants, then the region: four [64][136] and two [128][136] bf16
    /// tiles and the [128][32] partials) and fits; the prep and gradient entries exist.
    #[test]
    fn v5_launches_fit_and_name_existing_entries() {
        let cu = include_str!("gdn2_rule.cu");
        assert_eq!(
            fwd8_stage_bytes(128, 2),
            2 * 64 * 136 * 2 + 128 * 72 * 2 + 64 * 72 * 2 + 64 * 36 * 4 + 512
        );
        assert_eq!(dscan8_stage_bytes(128, 2), 68_096);
        for dk in [64, 128] {
            for w in [1, 2, 4, 8] {
                let ns = fused_scan_stages(dk, w);
                let s3 = if ns == 3 { "s3" } else { "" };
                assert!(ns * fwd8_stage_bytes(dk, w) <= SMEM_MAX, "hrec8 d{dk} w{w}");
                assert!(
                    ns * dscan8_stage_bytes(dk, w) <= SMEM_MAX,
                    "dscan8 d{dk} w{w}"
                );
                for entry in [
                    format!("G2H8_ENTRY(g2f_hrec8{s3}, {ns}, {dk}, {w})"),
                    format!("G2D8_ENTRY(g2b_dscan8{s3}, {ns}, {dk}, {w})"),
                ] {
                    assert!(cu.contains(&entry), "gdn2_rule.cu has no {entry}");
                }
            }
        }
        let g4 = 4 * 64 * 72 * 2
            + 64 * 136 * 2
            + 64 * 4
            + 128 * 4
            + 15 * 128 * 4
            + 4 * 64 * 136 * 2
            + 2 * 128 * 136 * 2
            + 128 * 32 * 4;
        assert_eq!(G4_SMEM, g4);
        for entry in [
            "G2C8HT_ENTRIES(bf16_t, bf16_t, bf16)",
            "G2C8HT_ENTRIES(float, bf16_t, bf16n)",
            "G2C8F_ENTRIES(bf16_t, bf16_t, bf16)",
            "G2C8F_ENTRIES(float, bf16_t, bf16n)",
            "G2B_GRAD4(g2b_grad4, bf16_t, bf16_t, float, bf16)",
            "G2B_GRAD4(g2b_grad4, float, bf16_t, float, bf16n)",
            "G2B_GRAD4(g2b_grad4w, bf16_t, bf16_t, bf16_t, bf16)",
            "G2B_GRAD4(g2b_grad4w, float, bf16_t, bf16_t, bf16n)",
        ] {
            assert!(cu.contains(entry), "gdn2_rule.cu has no {entry}");
        }
        // Who takes what: v5 needs bf16, Dk 64 / 128 and Dv a multiple of 16; v4 any Dk, Dv <=
        // 128 that are multiples of 16.
        let sh = |dk, dv| RuleShape {
            hk: 2,
            hv: 4,
            dk,
            dv,
        };
        assert!(v5_supports(DType::Bf16, sh(128, 128)));
        assert!(v5_supports(DType::Bf16, sh(64, 48)));
        assert!(!v5_supports(DType::F32, sh(128, 128)));
        assert!(!v5_supports(DType::Bf16, sh(96, 128)));
        assert!(v4_supports(sh(96, 80)));
        assert!(!v4_supports(sh(72, 64)));
        assert!(!v4_supports(sh(256, 64)));
    }
}
