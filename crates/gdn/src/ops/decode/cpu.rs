//! CPU decode (f32): the pre step and the rule for one token per row, row copies.

use rayon::prelude::*;

use super::{check_slots, DecodeShape, PreCols, PreOut};
use crate::backend::{Cols, F32s};
use crate::error::{GdnError, Result};
use crate::ops::check_len;
use crate::ops::common::act::{sigmoid, silu, softplus};
use crate::ops::common::l2norm::l2norm_row;

/// Row copies (pairs checked by the entry).
pub(crate) fn copy_rows(src: &[f32], sc: Cols, dst: &mut [f32], dc: Cols, pairs: &[(i32, i32)]) {
    for &(s, d) in pairs {
        if s < 0 || d < 0 {
            continue;
        }
        let (s, d) = (s as usize, d as usize);
        dst[dc.at(d, 0)..dc.at(d, dc.width)].copy_from_slice(&src[sc.at(s, 0)..sc.at(s, sc.width)]);
    }
}

/// The pre step (see the module doc) on host slices.
#[allow(clippy::too_many_arguments)]
pub fn pre(
    proj: &[f32],
    cols: &PreCols,
    conv: &mut [f32],
    slots: &[i32],
    nslots: usize,
    s: DecodeShape,
    conv_w: &[f32],
    conv_b: Option<&[f32]>,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<PreOut> {
    s.check()?;
    check_slots(slots, nslots)?;
    let n = slots.len();
    let (qk, vd, cd, w) = (s.qk(), s.vd(), s.conv_dim(), s.width);
    let ngates = if s.gdn2 { 3 } else { 2 };
    if cols.gates.len() != ngates || cols.qkv.width != cd {
        return Err(GdnError::Invalid(format!(
            "decode pre: expected a [q|k|v] section of {cd} columns and {ngates} gate sections"
        )));
    }
    cols.qkv.check("decode pre: proj", proj.len(), n)?;
    let (gl0, gl1, gl2) = s.gate_lens();
    let gate_w: Vec<usize> = if s.gdn2 {
        vec![gl0, gl1, gl2]
    } else {
        vec![s.hv, s.hv]
    };
    for (c, &gw) in cols.gates.iter().zip(&gate_w) {
        if c.width != gw {
            return Err(GdnError::Invalid(format!(
                "decode pre: gate section of {} columns, expected {gw}",
                c.width
            )));
        }
        c.check("decode pre: proj", proj.len(), n)?;
    }
    check_len("decode pre: conv", conv, nslots * (w - 1) * cd)?;
    check_len("conv1d.weight", conv_w, cd * w)?;
    if let Some(b) = conv_b {
        check_len("conv1d.bias", b, cd)?;
    }
    let (na, nd) = if s.gdn2 { (s.hk, qk) } else { (s.hv, s.hv) };
    check_len("A_log", a_log, na)?;
    check_len("dt_bias", dt_bias, nd)?;

    let (mut q, mut k, mut v) = (
        vec![0.0f32; n * qk],
        vec![0.0f32; n * qk],
        vec![0.0f32; n * vd],
    );
    let (mut g, mut b) = (vec![0.0f32; n * gl0], vec![0.0f32; n * gl1]);
    let mut wg = vec![0.0f32; n * gl2];
    let mut pre = vec![0.0f32; cd];
    for (i, &sl) in slots.iter().enumerate() {
        if sl < 0 {
            continue;
        }
        let x = &proj[cols.qkv.at(i, 0)..cols.qkv.at(i, cd)];
        let win = &mut conv[sl as usize * (w - 1) * cd..(sl as usize + 1) * (w - 1) * cd];
        for c in 0..cd {
            let mut acc = conv_b.map_or(0.0, |b| b[c]);
            for j in 0..w - 1 {
                acc += conv_w[c * w + j] * win[j * cd + c];
            }
            acc += conv_w[c * w + w - 1] * x[c];
            pre[c] = silu(acc);
        }
        if w > 1 {
            win.copy_within(cd.., 0);
            win[(w - 2) * cd..].copy_from_slice(x);
        }
        q[i * qk..(i + 1) * qk].copy_from_slice(&pre[..qk]);
        k[i * qk..(i + 1) * qk].copy_from_slice(&pre[qk..2 * qk]);
        v[i * vd..(i + 1) * vd].copy_from_slice(&pre[2 * qk..]);
        let sec = |j: usize, c: usize| proj[cols.gates[j].at(i, c)];
        if s.gdn2 {
            for c in 0..qk {
                g[i * qk + c] = -a_log[c / s.dk].exp() * softplus(sec(0, c) + dt_bias[c]);
                b[i * qk + c] = sigmoid(sec(1, c));
            }
            for c in 0..vd {
                wg[i * vd + c] = sigmoid(sec(2, c));
            }
        } else {
            for h in 0..s.hv {
                g[i * s.hv + h] = -a_log[h].exp() * softplus(sec(1, h) + dt_bias[h]);
                b[i * s.hv + h] = sigmoid(sec(0, h));
            }
        }
    }
    Ok(PreOut {
        q: F32s::Host(q),
        k: F32s::Host(k),
        v: F32s::Host(v),
        g: F32s::Host(g),
        b: F32s::Host(b),
        w: s.gdn2.then_some(F32s::Host(wg)),
    })
}

fn host<'a>(x: &'a F32s, name: &str, len: usize) -> Result<&'a [f32]> {
    match x {
        F32s::Host(v) => {
            check_len(name, v, len)?;
            Ok(v)
        }
        F32s::Dev(_) => Err(crate::backend::mixed("decode rule")),
    }
}

/// The rule (see the module doc) on host buffers: the plain recurrence, `o` from the updated
/// state. Returns `o` `[n, Hv Dv]` (zero rows for padding).
pub fn rule(
    x: &PreOut,
    state: &mut [f32],
    slots: &[i32],
    nslots: usize,
    s: DecodeShape,
    scale: f32,
) -> Result<Vec<f32>> {
    s.check()?;
    check_slots(slots, nslots)?;
    let n = slots.len();
    let (qk, vd, dk, dv, hv) = (s.qk(), s.vd(), s.dk, s.dv, s.hv);
    let (gl0, gl1, gl2) = s.gate_lens();
    let q = host(&x.q, "q", n * qk)?;
    let k = host(&x.k, "k", n * qk)?;
    let v = host(&x.v, "v", n * vd)?;
    let g = host(&x.g, "g", n * gl0)?;
    let b = host(&x.b, "b", n * gl1)?;
    let w = match (&x.w, s.gdn2) {
        (Some(w), true) => host(w, "w", n * gl2)?,
        (None, false) => &[][..],
        _ => {
            return Err(GdnError::Invalid(
                "decode rule: the write gate w is GDN2's (and only GDN2's)".into(),
            ))
        }
    };
    check_len("state", state, nslots * s.state_len())?;
    let mut o = vec![0.0f32; n * vd];
    let r = hv / s.hk;
    for (i, &sl) in slots.iter().enumerate() {
        if sl < 0 {
            continue;
        }
        let st = &mut state[sl as usize * s.state_len()..(sl as usize + 1) * s.state_len()];
        st.par_chunks_mut(dk * dv)
            .zip(o[i * vd..(i + 1) * vd].par_chunks_mut(dv))
            .enumerate()
            .for_each(|(h, (st, o))| {
                let kh = h / r;
                let (mut qn, mut kn) = (vec![0.0f32; dk], vec![0.0f32; dk]);
                let (qr, kr) = (
                    &q[(i * s.hk + kh) * dk..(i * s.hk + kh + 1) * dk],
                    &k[(i * s.hk + kh) * dk..(i * s.hk + kh + 1) * dk],
                );
                if s.l2norm {
                    l2norm_row(qr, &mut qn);
                    l2norm_row(kr, &mut kn);
                } else {
                    qn.copy_from_slice(qr);
                    kn.copy_from_slice(kr);
                }
                // Decay, per row of the state.
                for x in 0..dk {
                    let a = if s.gdn2 {
                        g[(i * s.hk + kh) * dk + x].exp()
                    } else {
                        g[i * hv + h].exp()
                    };
                    st[x * dv..(x + 1) * dv].iter_mut().for_each(|e| *e *= a);
                }
                // The prediction's key: k (GDN) or b k (GDN2).
                let kp: Vec<f32> = if s.gdn2 {
                    (0..dk)
                        .map(|x| b[(i * s.hk + kh) * dk + x] * kn[x])
                        .collect()
                } else {
                    kn.clone()
                };
                let vr = &v[(i * hv + h) * dv..(i * hv + h + 1) * dv];
                for c in 0..dv {
                    let pred: f32 = (0..dk).map(|x| st[x * dv + c] * kp[x]).sum();
                    let u = if s.gdn2 {
                        w[(i * hv + h) * dv + c] * vr[c] - pred
                    } else {
                        b[i * hv + h] * (vr[c] - pred)
                    };
                    for x in 0..dk {
                        st[x * dv + c] += kn[x] * u;
                    }
                }
                for c in 0..dv {
                    o[c] = scale * (0..dk).map(|x| st[x * dv + c] * qn[x]).sum::<f32>();
                }
            });
    }
    Ok(o)
}
