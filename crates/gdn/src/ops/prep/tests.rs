use super::cpu::{self, Dy};
use super::reference::{forward as forward64, Out64};
use super::*;
use crate::testutil::*;

/// Sequences of lengths 3, 0, 6, then 2 rows of padding.
fn packed() -> Seqs {
    Seqs::packed(&[0, 3, 3, 9], 11).unwrap()
}

fn shape(l2norm: bool) -> PrepShape {
    PrepShape {
        hk: 2,
        hv: 4,
        dk: 3,
        dv: 2,
        width: 4,
        l2norm,
    }
}

/// The in_proj layout of the layer (`[q|k|v | z | beta | alpha]`) plus 3 unused columns.
fn layer_cols(s: &PrepShape) -> PrepCols {
    let cd = s.conv_dim();
    let ld = cd + s.vd() + 2 * s.hv + 3;
    PrepCols {
        qkv: Cols::new(ld, 0, cd),
        beta: Cols::new(ld, cd + s.vd(), s.hv),
        alpha: Cols::new(ld, cd + s.vd() + s.hv, s.hv),
    }
}

/// Sections in another order: alpha first, then beta, then qkv.
fn shuffled_cols(s: &PrepShape) -> PrepCols {
    let cd = s.conv_dim();
    let ld = cd + 2 * s.hv + 1;
    PrepCols {
        qkv: Cols::new(ld, 2 * s.hv + 1, cd),
        beta: Cols::new(ld, s.hv, s.hv),
        alpha: Cols::new(ld, 0, s.hv),
    }
}

struct Case {
    x: Vec<f32>,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    a_log: Vec<f32>,
    dt: Vec<f32>,
}

fn case(seed: u64, s: &PrepShape, c: &PrepCols, seqs: &Seqs, with_bias: bool) -> Case {
    let mut r = rng(seed);
    let cd = s.conv_dim();
    Case {
        x: normal(&mut r, seqs.tokens() * c.qkv.ld, 1.0),
        w: normal(&mut r, cd * s.width, 0.6),
        b: with_bias.then(|| normal(&mut r, cd, 0.5)),
        a_log: uniform(&mut r, s.hv, 0.0, 2.7),
        dt: normal(&mut r, s.hv, 0.5),
    }
}

fn fwd64(k: &Case, c: PrepCols, s: PrepShape, seqs: &Seqs, x: &[f64]) -> Out64 {
    let b = k.b.as_deref().map(to_f64);
    forward64(
        x,
        c,
        s,
        &to_f64(&k.w),
        b.as_deref(),
        &to_f64(&k.a_log),
        &to_f64(&k.dt),
        seqs,
    )
}

fn fwd(k: &Case, c: PrepCols, s: PrepShape, seqs: &Seqs) -> cpu::Out {
    cpu::forward(&k.x, c, s, &k.w, k.b.as_deref(), &k.a_log, &k.dt, seqs).unwrap()
}

#[test]
fn forward_matches_reference() {
    for l2 in [true, false] {
        let s = shape(l2);
        for (c, seqs, bias) in [
            (layer_cols(&s), packed(), true),
            (shuffled_cols(&s), packed(), false),
            (layer_cols(&s), Seqs::uniform(2, 7), false),
        ] {
            let k = case(3, &s, &c, &seqs, bias);
            let o = fwd(&k, c, s, &seqs);
            let r = fwd64(&k, c, s, &seqs, &to_f64(&k.x));
            assert_close("q", &o.q, &r.q, 2e-6);
            assert_close("k", &o.k, &r.k, 2e-6);
            assert_close("v", &o.v, &r.v, 2e-6);
            assert_close("g", &o.g, &r.g, 2e-6);
            assert_close("beta", &o.beta, &r.beta, 2e-6);
            match &o.qkn {
                Some((qn, kn)) => {
                    assert!(l2);
                    assert_close("qn", qn, &r.qn, 4e-6);
                    assert_close("kn", kn, &r.kn, 4e-6);
                }
                None => assert!(!l2),
            }
            let used = seqs.used();
            assert!(o.q[used * s.qk()..].iter().all(|&v| v == 0.0));
            assert!(o.v[used * s.vd()..].iter().all(|&v| v == 0.0));
        }
    }
}

#[test]
fn sequences_do_not_see_each_other() {
    // Changing the rows of the first sequence changes nothing in the second.
    let s = shape(true);
    let c = layer_cols(&s);
    let seqs = packed();
    let k = case(5, &s, &c, &seqs, true);
    let mut k2 = case(5, &s, &c, &seqs, true);
    for v in &mut k2.x[..3 * c.qkv.ld] {
        *v += 1.5;
    }
    let (a, b) = (fwd(&k, c, s, &seqs), fwd(&k2, c, s, &seqs));
    let qk = s.qk();
    assert_ne!(bits(&a.q[..3 * qk]), bits(&b.q[..3 * qk]));
    assert_eq!(bits(&a.q[3 * qk..]), bits(&b.q[3 * qk..]));
    assert_eq!(bits(&a.v[3 * s.vd()..]), bits(&b.v[3 * s.vd()..]));
}

/// Loss `sum(qn Rq) + sum(kn Rk) + sum(v Rv) + sum(g Rg) + sum(beta Rb)` in f64.
fn loss(o: &Out64, r: &[Vec<f64>; 5]) -> f64 {
    dot(&o.qn, &r[0])
        + dot(&o.kn, &r[1])
        + dot(&o.v, &r[2])
        + dot(&o.g, &r[3])
        + dot(&o.beta, &r[4])
}

#[test]
fn backward_matches_finite_differences() {
    for (l2, bias, shuffled) in [
        (true, true, false),
        (false, false, true),
        (true, false, true),
    ] {
        let s = shape(l2);
        let c = if shuffled {
            shuffled_cols(&s)
        } else {
            layer_cols(&s)
        };
        let seqs = packed();
        let n = seqs.tokens();
        let k = case(11, &s, &c, &seqs, bias);
        let mut rr = rng(12);
        let dy: [Vec<f32>; 5] = [
            normal(&mut rr, n * s.qk(), 1.0),
            normal(&mut rr, n * s.qk(), 1.0),
            normal(&mut rr, n * s.vd(), 1.0),
            normal(&mut rr, n * s.hv, 1.0),
            normal(&mut rr, n * s.hv, 1.0),
        ];
        let r64: [Vec<f64>; 5] = dy.clone().map(|v| to_f64(&v));
        // Columns outside the sections keep their values.
        let mut dproj = vec![7.25f32; k.x.len()];
        let g = cpu::backward(
            &k.x,
            c,
            s,
            &k.w,
            k.b.as_deref(),
            &k.a_log,
            &k.dt,
            &seqs,
            Dy {
                dq: &dy[0],
                dk: &dy[1],
                dv: &dy[2],
                dg: &dy[3],
                dbeta: &dy[4],
            },
            &mut dproj,
        )
        .unwrap();
        let x64 = to_f64(&k.x);
        let gx = fd_grad(|x| loss(&fwd64(&k, c, s, &seqs, x), &r64), &x64, FD_STEP);
        let inside = |col: usize| {
            [c.qkv, c.beta, c.alpha]
                .iter()
                .any(|q| col >= q.off && col < q.off + q.width)
        };
        let mut got = Vec::new();
        let mut want = Vec::new();
        for (i, (&d, &f)) in dproj.iter().zip(&gx).enumerate() {
            if inside(i % c.qkv.ld) {
                got.push(d);
                want.push(f);
            } else {
                assert_eq!(
                    d,
                    7.25,
                    "column {} outside the sections was written",
                    i % c.qkv.ld
                );
                assert_eq!(f, 0.0);
            }
        }
        assert_close("dproj", &got, &want, 2e-5);
        let b64 = k.b.as_deref().map(to_f64);
        let (al, dt) = (to_f64(&k.a_log), to_f64(&k.dt));
        let gw = fd_grad(
            |w| {
                let o = forward64(&x64, c, s, w, b64.as_deref(), &al, &dt, &seqs);
                loss(&o, &r64)
            },
            &to_f64(&k.w),
            FD_STEP,
        );
        assert_close("dconv_w", &g.conv_w, &gw, 2e-5);
        match (&g.conv_b, &b64) {
            (Some(gb), Some(b)) => {
                let want = fd_grad(
                    |b| {
                        let o = forward64(&x64, c, s, &to_f64(&k.w), Some(b), &al, &dt, &seqs);
                        loss(&o, &r64)
                    },
                    b,
                    FD_STEP,
                );
                assert_close("dconv_b", gb, &want, 2e-5);
            }
            (None, None) => {}
            _ => panic!("conv bias gradient present without a bias or missing with one"),
        }
        let w64 = to_f64(&k.w);
        let ga = fd_grad(
            |a| {
                loss(
                    &forward64(&x64, c, s, &w64, b64.as_deref(), a, &dt, &seqs),
                    &r64,
                )
            },
            &al,
            FD_STEP,
        );
        assert_close("dA_log", &g.a_log, &ga, 2e-5);
        let gd = fd_grad(
            |d| {
                loss(
                    &forward64(&x64, c, s, &w64, b64.as_deref(), &al, d, &seqs),
                    &r64,
                )
            },
            &dt,
            FD_STEP,
        );
        assert_close("ddt_bias", &g.dt_bias, &gd, 2e-5);
    }
}

#[test]
fn results_do_not_depend_on_threads() {
    let s = shape(true);
    let c = layer_cols(&s);
    let seqs = Seqs::packed(&[0, 300, 301, 700], 710).unwrap();
    let k = case(21, &s, &c, &seqs, true);
    let n = seqs.tokens();
    let mut rr = rng(22);
    let dy: Vec<Vec<f32>> = [s.qk(), s.qk(), s.vd(), s.hv, s.hv]
        .iter()
        .map(|&w| normal(&mut rr, n * w, 1.0))
        .collect();
    let run = || {
        let o = fwd(&k, c, s, &seqs);
        let mut dproj = vec![0.0f32; k.x.len()];
        let g = cpu::backward(
            &k.x,
            c,
            s,
            &k.w,
            k.b.as_deref(),
            &k.a_log,
            &k.dt,
            &seqs,
            Dy {
                dq: &dy[0],
                dk: &dy[1],
                dv: &dy[2],
                dg: &dy[3],
                dbeta: &dy[4],
            },
            &mut dproj,
        )
        .unwrap();
        let (qn, kn) = o.qkn.unwrap();
        [
            bits(&o.q),
            bits(&qn),
            bits(&kn),
            bits(&o.v),
            bits(&o.g),
            bits(&o.beta),
            bits(&dproj),
            bits(&g.conv_w),
            bits(&g.conv_b.unwrap()),
            bits(&g.a_log),
            bits(&g.dt_bias),
        ]
    };
    assert_eq!(with_threads(1, run), with_threads(3, run));
}

#[test]
fn bad_inputs_are_errors() {
    let s = shape(true);
    let c = layer_cols(&s);
    let seqs = packed();
    let k = case(1, &s, &c, &seqs, false);
    let f = |x: &[f32], c: PrepCols, s: PrepShape, w: &[f32], al: &[f32]| {
        cpu::forward(x, c, s, w, None, al, &k.dt, &seqs).map(|_| ())
    };
    assert!(f(&k.x, c, s, &k.w, &k.a_log).is_ok());
    assert!(f(&k.x[1..], c, s, &k.w, &k.a_log).is_err(), "short x");
    assert!(f(&k.x, c, s, &k.w[1..], &k.a_log).is_err(), "short weight");
    assert!(f(&k.x, c, s, &k.w, &k.a_log[1..]).is_err(), "short A_log");
    let mut o = c;
    o.beta.off = c.alpha.off - 1;
    assert!(
        f(&k.x, o, s, &k.w, &k.a_log).is_err(),
        "overlapping sections"
    );
    let mut o = c;
    o.alpha.off = c.qkv.ld - 1;
    assert!(
        f(&k.x, o, s, &k.w, &k.a_log).is_err(),
        "section past the row"
    );
    let mut o = c;
    o.beta.ld += 1;
    assert!(f(&k.x, o, s, &k.w, &k.a_log).is_err(), "mixed row strides");
    let mut o = c;
    o.qkv.width -= 1;
    assert!(f(&k.x, o, s, &k.w, &k.a_log).is_err(), "wrong qkv width");
    let mut z = s;
    z.dk = 0;
    assert!(f(&k.x, c, z, &k.w, &k.a_log).is_err(), "zero head size");
    // Backward: wrong gradient lengths and a dproj of another shape.
    let n = seqs.tokens();
    let zeros = |m: usize| vec![0.0f32; m];
    let (dq, dv, dg) = (zeros(n * s.qk()), zeros(n * s.vd()), zeros(n * s.hv));
    let b = |dq: &[f32], dproj: &mut [f32]| {
        cpu::backward(
            &k.x,
            c,
            s,
            &k.w,
            None,
            &k.a_log,
            &k.dt,
            &seqs,
            Dy {
                dq,
                dk: &dq_full(n, &s),
                dv: &dv,
                dg: &dg,
                dbeta: &dg,
            },
            dproj,
        )
        .map(|_| ())
    };
    fn dq_full(n: usize, s: &PrepShape) -> Vec<f32> {
        vec![0.0; n * s.qk()]
    }
    assert!(b(&dq, &mut zeros(k.x.len())).is_ok());
    assert!(b(&dq[1..], &mut zeros(k.x.len())).is_err(), "short dq");
    assert!(b(&dq, &mut zeros(k.x.len() - 1)).is_err(), "short dproj");
}
