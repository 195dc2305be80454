//! Inference over a pool of cache slots: one decode token per row, and the row copies that move
//! cached states and conv rows between the pool and a batch.
//!
//! The pool (see `layer::gdn::pool`): states `[slots, Hv, Dk, Dv]` fp32 (bf16 as an option on a
//! GPU: fp32 arithmetic, rounded to nearest even when stored) and the conv window
//! `[slots, W - 1, conv_dim]` (the pre-conv `[q | k | v]` rows of the last `W - 1` tokens, oldest
//! first, in the activation storage type). Row `i` of a decode batch continues slot `slots[i]`;
//! a slot outside `[0, slots)` (padding: `-1`) touches nothing and gives zero outputs.
//!
//! [`pre`], per row `i` with slot `s` (the conv step, SiLU and the gates fused):
//! `pre[c] = bias[c] + sum_{j < W-1} w[c, j] win[s, j, c] + w[c, W-1] x[c]` (bias first, then the
//! taps in order, as the conv op), `qkv = silu(pre)`, the window shifted by one row with `x` (the
//! raw in_proj row) as its newest; gates as `ops::gates` (GDN `g = -exp(A_log) softplus(alpha +
//! dt_bias)`, `beta = sigmoid(b)` per value head; GDN2 `g` per key channel, `b`, `w` sigmoids).
//!
//! [`rule`], per row and value head `h` (key head `h / (Hv/Hk)`), with `q`, `k` l2-normalized
//! when `l2norm` (`1 / sqrt(sum x^2 + 1e-6)`):
//! - GDN: `S' = exp(g) S`, `u = beta (v - S'^T k)`, `S = S' + k u^T`;
//! - GDN2: `S' = diag(exp(g)) S`, `u = w v - S'^T (b k)`, `S = S' + k u^T`;
//! - `o = scale S^T q`; the state is updated in place.
//!
//! The CUDA rule reads each state once and writes it once (`o = scale (S'^T q + u (k.q))`, both
//! sums in the same pass); the CPU rule is the plain recurrence (o from the updated state), an
//! independent formulation the GPU tests compare against.

pub mod cpu;
pub mod cuda;
#[cfg(test)]
mod tests;

use crate::backend::cuda::{DBuf, DType};
use crate::backend::{mixed, Act, Cols, F32s, Ids, P};
use crate::error::{GdnError, Result};

/// Shape of a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    /// Conv width `W`.
    pub width: usize,
    /// GDN2's gates (per key channel decay and erase gate, per value channel write gate).
    pub gdn2: bool,
    /// l2-normalize q and k (in the rule).
    pub l2norm: bool,
}

impl DecodeShape {
    /// `Hk * Dk`.
    pub fn qk(&self) -> usize {
        self.hk * self.dk
    }
    /// `Hv * Dv`.
    pub fn vd(&self) -> usize {
        self.hv * self.dv
    }
    /// `2 Hk Dk + Hv Dv`, the conv's channels.
    pub fn conv_dim(&self) -> usize {
        2 * self.qk() + self.vd()
    }
    /// Values of one slot's state.
    pub fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
    /// Values of the gates per row: GDN `g`, `beta` `[Hv]` each; GDN2 `g`, `b` `[Hk Dk]`, `w`
    /// `[Hv Dv]`.
    pub(crate) fn gate_lens(&self) -> (usize, usize, usize) {
        if self.gdn2 {
            (self.qk(), self.qk(), self.vd())
        } else {
            (self.hv, self.hv, 0)
        }
    }
    pub(crate) fn check(&self) -> Result<()> {
        if self.hk == 0 || self.hv == 0 || self.dk == 0 || self.dv == 0 || self.width == 0 {
            return Err(GdnError::Invalid(format!("decode: empty shape {self:?}")));
        }
        if !self.hv.is_multiple_of(self.hk) {
            return Err(GdnError::Invalid(format!(
                "decode: {} value heads are not a multiple of {} key heads",
                self.hv, self.hk
            )));
        }
        Ok(())
    }
}

/// The in_proj output's sections the pre step reads: `[q|k|v]` and the gate sections (GDN
/// `[beta, alpha]`, GDN2 `[f, b, w]`).
#[derive(Clone, Debug)]
pub struct PreCols {
    pub qkv: Cols,
    pub gates: Vec<Cols>,
}

/// The pre step's parameters.
pub struct PreParams<'a> {
    pub conv_w: P<'a>,
    pub conv_b: Option<P<'a>>,
    pub a_log: P<'a>,
    pub dt_bias: P<'a>,
}

/// The pre step's outputs, fp32: `q`, `k` `[n, Hk Dk]` (conv + SiLU, not normalized), `v`
/// `[n, Hv Dv]`, the gates (GDN `g`, `b` = beta `[n, Hv]`; GDN2 `g`, `b` `[n, Hk Dk]`, `w`
/// `[n, Hv Dv]`). Padding rows are zero.
pub struct PreOut {
    pub q: F32s,
    pub k: F32s,
    pub v: F32s,
    pub g: F32s,
    pub b: F32s,
    pub w: Option<F32s>,
}

impl PreOut {
    /// Uninitialized device outputs for `n` rows of shape `s` (the decode step's preallocated
    /// work buffers, `cuda::pre_into`).
    pub fn uninit_dev(
        gpu: &std::sync::Arc<crate::backend::cuda::Gpu>,
        n: usize,
        s: DecodeShape,
    ) -> Result<PreOut> {
        let (qk, vd) = (s.qk(), s.vd());
        let (gl0, gl1, gl2) = s.gate_lens();
        Ok(PreOut {
            q: F32s::Dev(gpu.uninit(n * qk)?),
            k: F32s::Dev(gpu.uninit(n * qk)?),
            v: F32s::Dev(gpu.uninit(n * vd)?),
            g: F32s::Dev(gpu.uninit(n * gl0)?),
            b: F32s::Dev(gpu.uninit(n * gl1)?),
            w: if s.gdn2 {
                Some(F32s::Dev(gpu.uninit(n * gl2)?))
            } else {
                None
            },
        })
    }
}

/// Error unless every slot is `-1` (padding) or in `[0, nslots)`, and no slot appears twice.
pub fn check_slots(slots: &[i32], nslots: usize) -> Result<()> {
    let mut seen = vec![false; nslots];
    for (i, &s) in slots.iter().enumerate() {
        if s == -1 {
            continue;
        }
        if s < 0 || s as usize >= nslots {
            return Err(GdnError::Invalid(format!(
                "slots[{i}] = {s}: expected -1 (padding) or a slot in [0, {nslots})"
            )));
        }
        if std::mem::replace(&mut seen[s as usize], true) {
            return Err(GdnError::Invalid(format!(
                "slots[{i}] = {s}: slot {s} appears twice in one call"
            )));
        }
    }
    Ok(())
}

/// The conv step, SiLU, window shift and gates for one decode token per row of `proj`
/// (`[n, ld]`, sections at `cols`), continuing `conv` (`[nslots, W-1, conv_dim]`) in place.
pub fn pre(
    proj: &Act,
    cols: &PreCols,
    conv: &mut Act,
    slots: Ids<i32>,
    nslots: usize,
    shape: DecodeShape,
    p: &PreParams,
) -> Result<PreOut> {
    shape.check()?;
    match (proj, conv, slots) {
        (Act::Host(x), Act::Host(c), Ids::Host(s)) => {
            let (pc, cb, al, dt) = (
                host_p(p.conv_w)?,
                p.conv_b.map(host_p).transpose()?,
                host_p(p.a_log)?,
                host_p(p.dt_bias)?,
            );
            cpu::pre(x, cols, c, s, nslots, shape, pc, cb, al, dt)
        }
        (Act::Dev(x), Act::Dev(c), Ids::Dev(s)) => {
            let (pc, cb, al, dt) = (
                dev_p(p.conv_w)?,
                p.conv_b.map(dev_p).transpose()?,
                dev_p(p.a_log)?,
                dev_p(p.dt_bias)?,
            );
            cuda::pre(x, cols, c, s, nslots, shape, pc, cb, al, dt)
        }
        _ => Err(mixed("decode pre")),
    }
}

/// The rule for one decode token per row: updates `state` (`[nslots, Hv, Dk, Dv]`: f32 on the
/// host; fp32 or bf16 storage on a GPU, computed in fp32 and rounded to nearest even when stored)
/// in place and returns `o` `[n, Hv Dv]` (`dtype` storage on a GPU, f32 on the host).
pub fn rule(
    x: &PreOut,
    state: &mut Act,
    slots: Ids<i32>,
    nslots: usize,
    shape: DecodeShape,
    scale: f32,
    dtype: DType,
) -> Result<Act> {
    shape.check()?;
    match (state, slots) {
        (Act::Host(st), Ids::Host(s)) => Ok(Act::Host(cpu::rule(x, st, s, nslots, shape, scale)?)),
        (Act::Dev(st), Ids::Dev(s)) => {
            let mut o = DBuf::uninit(st.gpu(), s.len().saturating_mul(shape.vd()), dtype)?;
            cuda::rule(x, st, s, nslots, shape, scale, &mut o)?;
            Ok(Act::Dev(o))
        }
        _ => Err(mixed("decode rule")),
    }
}

/// Row copies from fp32 rows (final states) into state rows (`[rows, ..]` fp32, or bf16 on a GPU:
/// rounded to nearest even); pairs as [`copy_rows`].
pub fn copy_rows_into_state(
    src: &F32s,
    sc: Cols,
    dst: &mut Act,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let (sn, dn) = (src.len(), dst.len());
    check_pairs(sc, sn, dc, dn, pairs)?;
    match (src, dst) {
        (F32s::Host(s), Act::Host(d)) => {
            cpu::copy_rows(s, sc, d, dc, pairs);
            Ok(())
        }
        (F32s::Dev(s), Act::Dev(d)) => cuda::copy_rows_into_state(s, sc, d, dc, pairs),
        _ => Err(mixed("copy_rows")),
    }
}

/// Row copies from state rows (fp32, or bf16 on a GPU: exact) into fp32 rows (initial states);
/// pairs as [`copy_rows`].
pub fn copy_rows_from_state(
    src: &Act,
    sc: Cols,
    dst: &mut F32s,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let (sn, dn) = (src.len(), dst.len());
    check_pairs(sc, sn, dc, dn, pairs)?;
    match (src, dst) {
        (Act::Host(s), F32s::Host(d)) => {
            cpu::copy_rows(s, sc, d, dc, pairs);
            Ok(())
        }
        (Act::Dev(s), F32s::Dev(d)) => cuda::copy_rows_from_state(s, sc, d, dc, pairs),
        _ => Err(mixed("copy_rows")),
    }
}

/// Row copies: for each `(src_row, dst_row)` pair with both indices non-negative,
/// `dst[dst_row, dc] = src[src_row, sc]` (the sections have one width). Rows are checked against
/// the buffers' lengths; destination rows must be distinct.
pub fn copy_rows(src: &Act, sc: Cols, dst: &mut Act, dc: Cols, pairs: &[(i32, i32)]) -> Result<()> {
    let (sn, dn) = (src.len(), dst.len());
    check_pairs(sc, sn, dc, dn, pairs)?;
    match (src, dst) {
        (Act::Host(s), Act::Host(d)) => {
            cpu::copy_rows(s, sc, d, dc, pairs);
            Ok(())
        }
        (Act::Dev(s), Act::Dev(d)) => cuda::copy_rows_d(s, sc, d, dc, pairs),
        _ => Err(mixed("copy_rows")),
    }
}

/// [`copy_rows`] over fp32 buffers (states).
pub fn copy_rows_f32(
    src: &F32s,
    sc: Cols,
    dst: &mut F32s,
    dc: Cols,
    pairs: &[(i32, i32)],
) -> Result<()> {
    let (sn, dn) = (src.len(), dst.len());
    check_pairs(sc, sn, dc, dn, pairs)?;
    match (src, dst) {
        (F32s::Host(s), F32s::Host(d)) => {
            cpu::copy_rows(s, sc, d, dc, pairs);
            Ok(())
        }
        (F32s::Dev(s), F32s::Dev(d)) => cuda::copy_rows_g(s, sc, d, dc, pairs),
        _ => Err(mixed("copy_rows")),
    }
}

fn check_pairs(sc: Cols, sn: usize, dc: Cols, dn: usize, pairs: &[(i32, i32)]) -> Result<()> {
    if sc.width != dc.width {
        return Err(GdnError::Invalid(format!(
            "copy_rows: source sections of {} columns, destination of {}",
            sc.width, dc.width
        )));
    }
    if sc.ld == 0 || dc.ld == 0 {
        return Err(GdnError::Invalid("copy_rows: rows of 0 values".into()));
    }
    let (srows, drows) = (sn / sc.ld, dn / dc.ld);
    sc.check("copy_rows source", sn, srows)?;
    dc.check("copy_rows destination", dn, drows)?;
    let mut seen = std::collections::HashSet::new();
    for (i, &(s, d)) in pairs.iter().enumerate() {
        if s < 0 || d < 0 {
            continue;
        }
        if s as usize >= srows || d as usize >= drows {
            return Err(GdnError::Invalid(format!(
                "copy_rows: pair {i} ({s}, {d}) outside {srows} source / {drows} destination rows"
            )));
        }
        if !seen.insert(d) {
            return Err(GdnError::Invalid(format!(
                "copy_rows: destination row {d} written twice"
            )));
        }
    }
    Ok(())
}

fn host_p<'a>(p: P<'a>) -> Result<&'a [f32]> {
    match p {
        P::Host(h) => Ok(h),
        P::Dev(_) => Err(mixed("decode")),
    }
}

fn dev_p<'a>(p: P<'a>) -> Result<&'a crate::backend::cuda::GBuf<f32>> {
    match p {
        P::Dev(d) => Ok(d),
        P::Host(_) => Err(mixed("decode")),
    }
}
