//! CPU decode ops: the rule against an f64 recurrence written here (the reference's order:
//! decay, then per column the prediction and update, o from the updated state), the pre step
//! against the conv op's definition in f64, padding, and the checks.

use super::*;
use crate::testutil::{rng, to_f64, uniform};

fn shape(gdn2: bool, l2norm: bool) -> DecodeShape {
    DecodeShape {
        hk: 2,
        hv: 4,
        dk: 5,
        dv: 3,
        width: 4,
        gdn2,
        l2norm,
    }
}

/// f64 one-token rule for row `i` of `x` from `st` (one slot's `[Hv, Dk, Dv]`): returns o.
fn ref_rule(x: &PreOut, i: usize, st: &mut [f64], s: DecodeShape, scale: f64) -> Vec<f64> {
    let h = |b: &F32s| match b {
        F32s::Host(v) => to_f64(v),
        F32s::Dev(_) => unreachable!(),
    };
    let (q, k, v, g, b) = (h(&x.q), h(&x.k), h(&x.v), h(&x.g), h(&x.b));
    let w = x.w.as_ref().map(h);
    let (dk, dv, hv, hk) = (s.dk, s.dv, s.hv, s.hk);
    let mut o = vec![0.0; hv * dv];
    for j in 0..hv {
        let kh = j / (hv / hk);
        let row = |a: &[f64]| a[(i * hk + kh) * dk..(i * hk + kh + 1) * dk].to_vec();
        let (mut qr, mut kr) = (row(&q), row(&k));
        if s.l2norm {
            for x in [&mut qr, &mut kr] {
                let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
                x.iter_mut().for_each(|v| *v *= r);
            }
        }
        let sj = &mut st[j * dk * dv..(j + 1) * dk * dv];
        for r in 0..dk {
            let a = if s.gdn2 {
                g[(i * hk + kh) * dk + r].exp()
            } else {
                g[i * hv + j].exp()
            };
            sj[r * dv..(r + 1) * dv].iter_mut().for_each(|e| *e *= a);
        }
        for c in 0..dv {
            let pred: f64 = (0..dk)
                .map(|r| {
                    let kb = if s.gdn2 {
                        b[(i * hk + kh) * dk + r] * kr[r]
                    } else {
                        kr[r]
                    };
                    sj[r * dv + c] * kb
                })
                .sum();
            let vv = v[(i * hv + j) * dv + c];
            let u = match &w {
                Some(w) => w[(i * hv + j) * dv + c] * vv - pred,
                None => b[i * hv + j] * (vv - pred),
            };
            for r in 0..dk {
                sj[r * dv + c] += kr[r] * u;
            }
        }
        for c in 0..dv {
            o[j * dv + c] = scale * (0..dk).map(|r| sj[r * dv + c] * qr[r]).sum::<f64>();
        }
    }
    o
}

fn inputs(s: DecodeShape, n: usize, seed: u64) -> PreOut {
    let mut r = rng(seed);
    let (qk, vd) = (s.qk(), s.vd());
    let (gl0, gl1, gl2) = s.gate_lens();
    PreOut {
        q: F32s::Host(uniform(&mut r, n * qk, -1.0, 1.0)),
        k: F32s::Host(uniform(&mut r, n * qk, -1.0, 1.0)),
        v: F32s::Host(uniform(&mut r, n * vd, -1.0, 1.0)),
        g: F32s::Host(uniform(&mut r, n * gl0, -0.5, 0.0)),
        b: F32s::Host(uniform(&mut r, n * gl1, 0.0, 1.0)),
        w: s.gdn2
            .then(|| F32s::Host(uniform(&mut r, n * gl2, 0.0, 1.0))),
    }
}

#[test]
fn rule_matches_the_f64_recurrence_and_skips_padding() {
    for gdn2 in [false, true] {
        for l2norm in [true, false] {
            let s = shape(gdn2, l2norm);
            let slots = [2i32, -1, 0];
            let x = inputs(s, 3, 1);
            let st0 = uniform(&mut rng(2), 4 * s.state_len(), -1.0, 1.0);
            let mut st = st0.clone();
            let o = cpu::rule(&x, &mut st, &slots, 4, s, 0.4).unwrap();
            let sl = s.state_len();
            for (i, &slot) in slots.iter().enumerate() {
                let vd = s.vd();
                if slot < 0 {
                    assert!(o[i * vd..(i + 1) * vd].iter().all(|v| v.to_bits() == 0));
                    continue;
                }
                let sl_ = slot as usize;
                let mut want = to_f64(&st0[sl_ * sl..(sl_ + 1) * sl]);
                let wo = ref_rule(&x, i, &mut want, s, 0.4);
                let e = crate::testutil::max_rel_err(&o[i * vd..(i + 1) * vd], &wo);
                assert!(e < 1e-5, "gdn2 {gdn2} l2 {l2norm}: o {e}");
                let e = crate::testutil::max_rel_err(&st[sl_ * sl..(sl_ + 1) * sl], &want);
                assert!(e < 1e-5, "gdn2 {gdn2} l2 {l2norm}: state {e}");
            }
            for untouched in [1usize, 3] {
                assert_eq!(
                    st[untouched * sl..(untouched + 1) * sl],
                    st0[untouched * sl..(untouched + 1) * sl]
                );
            }
        }
    }
}

#[test]
fn pre_is_the_conv_step_and_the_gates() {
    let s = shape(false, true);
    let (cd, w) = (s.conv_dim(), s.width);
    let ld = cd + 2 * s.hv + 1;
    let cols = PreCols {
        qkv: Cols::new(ld, 0, cd),
        gates: vec![Cols::new(ld, cd, s.hv), Cols::new(ld, cd + s.hv, s.hv)],
    };
    let mut r = rng(3);
    let proj = uniform(&mut r, 2 * ld, -1.0, 1.0);
    let conv0 = uniform(&mut r, 3 * (w - 1) * cd, -1.0, 1.0);
    let cw = uniform(&mut r, cd * w, -1.0, 1.0);
    let cb = uniform(&mut r, cd, -0.1, 0.1);
    let al = uniform(&mut r, s.hv, -1.0, 1.0);
    let dt = uniform(&mut r, s.hv, -1.0, 1.0);
    let mut conv = conv0.clone();
    let out = cpu::pre(
        &proj,
        &cols,
        &mut conv,
        &[-1, 1],
        3,
        s,
        &cw,
        Some(&cb),
        &al,
        &dt,
    )
    .unwrap();
    let host = |b: &F32s| match b {
        F32s::Host(v) => v.clone(),
        F32s::Dev(_) => unreachable!(),
    };
    let (q, k, v) = (host(&out.q), host(&out.k), host(&out.v));
    let qkv: Vec<f32> = [&q[s.qk()..], &k[s.qk()..], &v[s.vd()..]].concat();
    for c in 0..cd {
        let mut pre = cb[c] as f64;
        for j in 0..w - 1 {
            pre += cw[c * w + j] as f64 * conv0[(w - 1 + j) * cd + c] as f64;
        }
        pre += cw[c * w + w - 1] as f64 * proj[ld + c] as f64;
        let want = pre / (1.0 + (-pre).exp());
        assert!(
            (qkv[c] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
            "channel {c}"
        );
        // window shifted: rows 1.. then the new row
        for j in 0..w - 1 {
            let want = if j + 1 < w - 1 {
                conv0[(w - 1 + j + 1) * cd + c]
            } else {
                proj[ld + c]
            };
            assert_eq!(conv[(w - 1 + j) * cd + c], want);
        }
    }
    // padding row: zero outputs; slots 0 and 2 untouched
    assert!(q[..s.qk()].iter().all(|v| *v == 0.0));
    assert_eq!(conv[..(w - 1) * cd], conv0[..(w - 1) * cd]);
    assert_eq!(conv[2 * (w - 1) * cd..], conv0[2 * (w - 1) * cd..]);
    let (g, b) = (host(&out.g), host(&out.b));
    for h in 0..s.hv {
        let a = proj[ld + cd + s.hv + h] as f64 + dt[h] as f64;
        let want_g = -(al[h] as f64).exp() * a.exp().ln_1p();
        let want_b = 1.0 / (1.0 + (-(proj[ld + cd + h] as f64)).exp());
        assert!((g[s.hv + h] as f64 - want_g).abs() < 1e-5 * (1.0 + want_g.abs()));
        assert!((b[s.hv + h] as f64 - want_b).abs() < 1e-6);
    }
}

#[test]
fn bad_slots_and_pairs_are_errors() {
    assert!(check_slots(&[0, 1, -1, -1], 2).is_ok());
    let e = check_slots(&[0, 2], 2).unwrap_err().to_string();
    assert!(e.contains("slots[1] = 2"), "{e}");
    let e = check_slots(&[1, -3], 2).unwrap_err().to_string();
    assert!(e.contains("slots[1] = -3"), "{e}");
    let e = check_slots(&[1, 0, 1], 2).unwrap_err().to_string();
    assert!(e.contains("twice"), "{e}");
    let src = Act::Host(vec![1.0; 6]);
    let mut dst = Act::Host(vec![0.0; 6]);
    let d = Cols::dense(3);
    assert!(copy_rows(&src, d, &mut dst, d, &[(0, 1), (1, 0), (-1, 1)]).is_ok());
    assert!(copy_rows(&src, d, &mut dst, d, &[(2, 0)]).is_err());
    assert!(copy_rows(&src, d, &mut dst, d, &[(0, 1), (1, 1)]).is_err());
    assert!(copy_rows(&src, d, &mut dst, Cols::dense(2), &[(0, 1)]).is_err());
    // a rule call with a bad slot changes no state
    let s = shape(false, true);
    let x = inputs(s, 2, 4);
    let mut st = vec![0.5f32; 2 * s.state_len()];
    assert!(cpu::rule(&x, &mut st, &[0, 5], 2, s, 1.0).is_err());
    assert!(st.iter().all(|v| *v == 0.5));
}
