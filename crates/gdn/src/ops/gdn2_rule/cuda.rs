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
//! Design (simple, not fast): a token-by-token recurrence, one block per (sequence, value head,
//! V tile of 32 columns) with the state tile in registers. Backward stores the state at the start
//! of every 64-token chunk, then walks the chunks in reverse, recomputing each chunk's states into
//! a per-block workspace (`64 * Dk * 32` floats per block). Per-tile partials of dq, dk, dg, db
//! are summed in tile order; the GVA sum and the l2 norm's backward reuse the gated delta rule's
//! `gdr_l2norm` / `gdr_reduce_qk` kernels (module `gated_delta_rule`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::DeviceRepr;

use super::{RuleOpts, RuleShape};
use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::backend::launch::{dptr, i32_arg, launch_in, optr, ptr, suffix, Arg};
use crate::error::{GdnError, Result};
use crate::ops::common::rule_cuda::{check_backward_grads, poison_if, zero_tail};
use crate::seqs::Seqs;

const MODULE: &str = "gdn2_rule";
const GDR_MODULE: &str = "gated_delta_rule";
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

/// Forward on the GPU. Returns `o` `[tokens, Hv, Dv]` (storage type of q) and, if
/// `output_final_state`, the final states `[N, Hv, Dk, Dv]` fp32.
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

/// Backward on the GPU from `d_o` `[tokens, Hv, Dv]` (storage type of q) and optionally the
/// gradient of the final states (fp32). Recomputes the states from the inputs.
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
    let s = shape;
    let dt = check(gpu, q, k, v, g, b, w, seqs, s, initial_state)?;
    let (tokens, n_seq) = (seqs.tokens(), seqs.count());
    check_backward_grads("gdn2 rule", gpu, dt, seqs, s, d_o, d_final_state)?;
    let st = gpu.stream();
    let (cu, chf, chunks) = tables(gpu, seqs)?;
    let norm = if opts.l2norm_in_kernel {
        Some(normalized(gpu, q, k, s, dt)?)
    } else {
        None
    };
    let (qq, kk) = norm.as_ref().map_or((q, k), |(a, b)| (a, b));
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
