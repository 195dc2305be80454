//! The rule's inputs of a Gated DeltaNet layer in one op: causal depthwise conv1d + SiLU over
//! the `[q | k | v]` section of the in_proj output, the caller-side L2 norm of q and k per key
//! head, and the GDN gates, read in place from the in_proj output (sections given as [`Cols`]).
//!
//! For a token `t` of a sequence starting at `s` and a channel `c` of `[q | k | v]`
//! (`conv_dim = 2 Hk Dk + Hv Dv` channels, Megatron's layout):
//!
//! ```text
//! y[t, c]  = silu(bias[c] + sum_{i<W} w[c, i] x[t - (W-1) + i, c])   (x before s counts as 0)
//! q, k, v  = y split into [Hk Dk | Hk Dk | Hv Dv] columns
//! qn, kn   = per key head: y_h * rsqrt(sum(y_h^2) + 1e-6)            (when the norm is caller-side)
//! g[t, h]  = -exp(A_log[h]) softplus(alpha[t, h] + dt_bias[h]),  beta[t, h] = sigmoid(b[t, h])
//! ```
//!
//! The raw q, k, v are stored in the storage dtype and the norm reads them as stored, so this op
//! is the composition of `conv1d`, a column split, `l2norm` and `gates` with the same roundings.
//! Padding rows (`t >= seqs.used()`) get q = k = v = 0 (normalized: 0); the gates are computed on
//! every row, as the gates op does.
//!
//! Backward takes the rule's gradients (`dq`, `dk` with respect to what the rule read: the
//! normalized q, k when the norm is caller-side, else the raw ones; `dv`; `dg` fp32; `dbeta`) and
//! writes, in place into the sections of `d(in_proj output)`: the gradient of the conv input
//! (recomputing the pre-activation and, per key head, the norm from `x`), `d alpha` and
//! `d b`. It returns the conv weight (and bias) gradients and those of `A_log` and `dt_bias`: sums
//! over tokens in a fixed order (per block of tokens, then blocks in order; no atomics).
//!
//! Forward is a pure function of its inputs (same bits every call), so a rebuild under the
//! `gdn_prep` recompute reproduces what a kept forward had.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{dev, host, mixed, Act, Cols, F32s, P};
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

/// Head counts and sizes of the op: `hk` key heads of `dk`, `hv` value heads of `dv`, conv
/// kernel `width`, and whether q and k are L2-normalized here (caller-side norm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepShape {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub width: usize,
    pub l2norm: bool,
}

impl PrepShape {
    /// Columns of q (and of k): `hk * dk`.
    pub fn qk(&self) -> usize {
        self.hk * self.dk
    }
    /// Columns of v: `hv * dv`.
    pub fn vd(&self) -> usize {
        self.hv * self.dv
    }
    /// Channels of the conv: `2 qk + vd`.
    pub fn conv_dim(&self) -> usize {
        2 * self.qk() + self.vd()
    }
    /// Error unless every size is positive.
    pub fn check(&self) -> Result<()> {
        let PrepShape {
            hk,
            hv,
            dk,
            dv,
            width,
            ..
        } = *self;
        if hk == 0 || hv == 0 || dk == 0 || dv == 0 || width == 0 {
            return Err(GdnError::Invalid(format!(
                "prep: heads, head sizes and the conv width must be > 0, got hk={hk} hv={hv} dk={dk} dv={dv} width={width}"
            )));
        }
        Ok(())
    }
}

/// Where the op's inputs sit in the in_proj output (one row-major buffer of `ld` values per
/// token): the `[q | k | v]` conv input (width `conv_dim`), the beta logits `b` and `alpha`
/// (width `hv` each). Backward writes the gradients into the same sections of `d(in_proj
/// output)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepCols {
    pub qkv: Cols,
    pub beta: Cols,
    pub alpha: Cols,
}

impl PrepCols {
    /// Error unless the three sections share one row stride, have the shape's widths, fit, and a
    /// buffer of `len` values holds `rows` rows, and the sections do not overlap (backward writes
    /// all three into one buffer).
    pub fn check(&self, name: &str, s: &PrepShape, len: usize, rows: usize) -> Result<()> {
        let ld = self.qkv.ld;
        for (what, c, w) in [
            ("qkv", self.qkv, s.conv_dim()),
            ("beta", self.beta, s.hv),
            ("alpha", self.alpha, s.hv),
        ] {
            if c.ld != ld {
                return Err(GdnError::Invalid(format!(
                    "{name}: the {what} section has row stride {} but qkv has {ld}",
                    c.ld
                )));
            }
            if c.width != w {
                return Err(GdnError::Invalid(format!(
                    "{name}: the {what} section is {} columns wide, expected {w}",
                    c.width
                )));
            }
            c.check(&format!("{name} {what}"), len, rows)?;
        }
        let mut r = [
            (self.qkv.off, s.conv_dim()),
            (self.beta.off, s.hv),
            (self.alpha.off, s.hv),
        ];
        r.sort();
        if r[0].0 + r[0].1 > r[1].0 || r[1].0 + r[1].1 > r[2].0 {
            return Err(GdnError::Invalid(format!(
                "{name}: the qkv, beta and alpha sections overlap"
            )));
        }
        Ok(())
    }
}

/// What the rule takes, as [`forward`] makes it.
#[derive(Debug)]
pub struct PrepOut {
    /// Raw conv outputs `[n, qk]`, `[n, qk]`, `[n, vd]`.
    pub q: Act,
    pub k: Act,
    pub v: Act,
    /// L2-normalized q, k (caller-side norm only).
    pub qkn: Option<(Act, Act)>,
    /// Log decay `[n, hv]` (fp32) and `beta` `[n, hv]`.
    pub g: F32s,
    pub beta: Act,
}

/// Parameter gradients of [`backward`].
#[derive(Debug)]
pub struct PrepGrads {
    /// `[conv_dim, width]`, and `[conv_dim]` with a bias.
    pub conv_w: F32s,
    pub conv_b: Option<F32s>,
    /// `[hv]` each.
    pub a_log: F32s,
    pub dt_bias: F32s,
}

/// The parameters the op reads.
#[derive(Clone, Copy)]
pub struct PrepParams<'a> {
    /// `[conv_dim, width]`, optional bias `[conv_dim]`.
    pub conv_w: P<'a>,
    pub conv_b: Option<P<'a>>,
    /// `[hv]` each.
    pub a_log: P<'a>,
    pub dt_bias: P<'a>,
}

/// Forward from the in_proj output `proj` (sections `c`) over the packed sequences `seqs`.
pub fn forward(
    proj: &Act,
    c: PrepCols,
    s: PrepShape,
    p: PrepParams,
    seqs: &Seqs,
) -> Result<PrepOut> {
    let n = seqs.tokens();
    match (proj, p.conv_w, p.a_log, p.dt_bias) {
        (Act::Host(x), P::Host(w), P::Host(al), P::Host(dt)) => {
            let cb = host(p.conv_b, "prep")?;
            let o = cpu::forward(x, c, s, w, cb, al, dt, seqs)?;
            Ok(PrepOut {
                q: Act::Host(o.q),
                k: Act::Host(o.k),
                v: Act::Host(o.v),
                qkn: o.qkn.map(|(a, b)| (Act::Host(a), Act::Host(b))),
                g: F32s::Host(o.g),
                beta: Act::Host(o.beta),
            })
        }
        (Act::Dev(x), P::Dev(w), P::Dev(al), P::Dev(dt)) => {
            let cb = dev(p.conv_b, "prep")?;
            let (gpu, dt_) = (x.gpu(), x.dtype());
            let (qk, vd) = (n.saturating_mul(s.qk()), n.saturating_mul(s.vd()));
            let mut o = cuda::Out {
                q: DBuf::uninit(gpu, qk, dt_)?,
                k: DBuf::uninit(gpu, qk, dt_)?,
                v: DBuf::uninit(gpu, vd, dt_)?,
                qkn: if s.l2norm {
                    Some((DBuf::uninit(gpu, qk, dt_)?, DBuf::uninit(gpu, qk, dt_)?))
                } else {
                    None
                },
                g: gpu.uninit(n.saturating_mul(s.hv))?,
                beta: DBuf::uninit(gpu, n.saturating_mul(s.hv), dt_)?,
            };
            cuda::forward(x, c, s, w, cb, al, dt, seqs, &mut o)?;
            Ok(PrepOut {
                q: Act::Dev(o.q),
                k: Act::Dev(o.k),
                v: Act::Dev(o.v),
                qkn: o.qkn.map(|(a, b)| (Act::Dev(a), Act::Dev(b))),
                g: F32s::Dev(o.g),
                beta: Act::Dev(o.beta),
            })
        }
        _ => Err(mixed("prep")),
    }
}

/// The rule's gradients [`backward`] starts from: `dq`, `dk` `[n, qk]` (with respect to what the
/// rule read), `dv` `[n, vd]`, `dg` `[n, hv]` fp32, `dbeta` `[n, hv]`.
pub struct PrepDy<'a> {
    pub dq: &'a Act,
    pub dk: &'a Act,
    pub dv: &'a Act,
    pub dg: &'a F32s,
    pub dbeta: &'a Act,
}

/// Backward: writes d(conv input), d alpha and d b into the sections `c` of `dproj` (a buffer
/// shaped like `proj`; its other columns are left as they are) and returns the parameter
/// gradients.
pub fn backward(
    proj: &Act,
    c: PrepCols,
    s: PrepShape,
    p: PrepParams,
    seqs: &Seqs,
    dy: PrepDy,
    dproj: &mut Act,
) -> Result<PrepGrads> {
    match (
        proj, p.conv_w, p.a_log, p.dt_bias, dy.dq, dy.dk, dy.dv, dy.dg, dy.dbeta, dproj,
    ) {
        (
            Act::Host(x),
            P::Host(w),
            P::Host(al),
            P::Host(dt),
            Act::Host(dq),
            Act::Host(dk),
            Act::Host(dv),
            F32s::Host(dg),
            Act::Host(db),
            Act::Host(out),
        ) => {
            let cb = host(p.conv_b, "prep backward")?;
            let g = cpu::backward(
                x,
                c,
                s,
                w,
                cb,
                al,
                dt,
                seqs,
                cpu::Dy {
                    dq,
                    dk,
                    dv,
                    dg,
                    dbeta: db,
                },
                out,
            )?;
            Ok(PrepGrads {
                conv_w: F32s::Host(g.conv_w),
                conv_b: g.conv_b.map(F32s::Host),
                a_log: F32s::Host(g.a_log),
                dt_bias: F32s::Host(g.dt_bias),
            })
        }
        (
            Act::Dev(x),
            P::Dev(w),
            P::Dev(al),
            P::Dev(dt),
            Act::Dev(dq),
            Act::Dev(dk),
            Act::Dev(dv),
            F32s::Dev(dg),
            Act::Dev(db),
            Act::Dev(out),
        ) => {
            let cb = dev(p.conv_b, "prep backward")?;
            let gpu = x.gpu();
            let mut g = cuda::Grads {
                conv_w: gpu.uninit(s.conv_dim().saturating_mul(s.width))?,
                conv_b: match cb {
                    Some(_) => Some(gpu.uninit(s.conv_dim())?),
                    None => None,
                },
                a_log: gpu.uninit(s.hv)?,
                dt_bias: gpu.uninit(s.hv)?,
            };
            cuda::backward(
                x,
                c,
                s,
                w,
                cb,
                al,
                dt,
                seqs,
                cuda::Dy {
                    dq,
                    dk,
                    dv,
                    dg,
                    dbeta: db,
                },
                out,
                &mut g,
            )?;
            Ok(PrepGrads {
                conv_w: F32s::Dev(g.conv_w),
                conv_b: g.conv_b.map(F32s::Dev),
                a_log: F32s::Dev(g.a_log),
                dt_bias: F32s::Dev(g.dt_bias),
            })
        }
        _ => Err(mixed("prep backward")),
    }
}
