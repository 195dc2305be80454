use rand::Rng;

use super::cpu::{backward, forward, Grads as Gdn2Grads};
use super::reference::{self, RefInputs};
use super::*;
use crate::ops::gated_delta_rule;
use crate::testutil::*;

/// Chunked f32 vs the f64 recurrence: max-norm relative error (`max|a-b| / max|b|`, per tensor)
/// allowed for the output, the final state and every gradient. Observed: at most 8e-7, with weak,
/// strong and extreme decay alike (no decay factor can overflow, and differences of cumulative
/// log-decays are exact to f32 rounding).
const TOL: f64 = 4e-6;

/// How the log-decays `g` are drawn.
#[derive(Clone, Copy, Debug)]
enum Decay {
    /// Uniform in `(-x, 0]`.
    Uniform(f32),
    /// Each channel of each token is `-20` or uniform in `(-0.1, 0]`, half and half: extreme
    /// decay next to almost none, the case a whole-chunk `e^Gam e^-Gam` factorization cannot do.
    Mixed20,
}

const WEAK: Decay = Decay::Uniform(0.1);
const STRONG: Decay = Decay::Uniform(5.0);

struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    b: Vec<f32>,
    w: Vec<f32>,
    h0: Option<Vec<f32>>,
    d_o: Vec<f32>,
    dht: Option<Vec<f32>>,
    seqs: Seqs,
    shape: RuleShape,
    opts: RuleOpts,
}

/// Random inputs. Without in-kernel norm, q and k rows are unit-norm (as in the layer) so the
/// recurrence is contractive. b and w are in (0, 1) (sigmoids in the layer).
fn case(
    seqs: Seqs,
    shape: RuleShape,
    norm_in_kernel: bool,
    with_states: bool,
    decay: Decay,
    seed: u64,
) -> Case {
    let mut r = rng(seed);
    let n = seqs.tokens();
    let (hk, hv, dk, dv) = (shape.hk, shape.hv, shape.dk, shape.dv);
    let mut q = normal(&mut r, n * hk * dk, 1.0);
    let mut k = normal(&mut r, n * hk * dk, 1.0);
    if !norm_in_kernel {
        for x in [&mut q, &mut k] {
            for row in x.chunks_mut(dk) {
                let s = 1.0 / row.iter().map(|a| a * a).sum::<f32>().sqrt();
                row.iter_mut().for_each(|a| *a *= s);
            }
        }
    }
    let v = normal(&mut r, n * hv * dv, 1.0);
    let g = (0..n * hv * dk)
        .map(|_| match decay {
            Decay::Uniform(x) => -x * r.gen::<f32>(),
            Decay::Mixed20 => {
                if r.gen::<bool>() {
                    -20.0
                } else {
                    -0.1 * r.gen::<f32>()
                }
            }
        })
        .collect();
    let b = uniform(&mut r, n * hv * dk, 0.0, 1.0);
    let w = uniform(&mut r, n * hv * dv, 0.0, 1.0);
    let st = seqs.count() * hv * dk * dv;
    let h0 = with_states.then(|| normal(&mut rng(seed + 1), st, 0.5));
    let d_o = normal(&mut r, n * hv * dv, 1.0);
    let dht = with_states.then(|| normal(&mut rng(seed + 2), st, 0.5));
    let opts = RuleOpts {
        scale: 1.0 / (dk as f32).sqrt(),
        l2norm_in_kernel: norm_in_kernel,
    };
    Case {
        q,
        k,
        v,
        g,
        b,
        w,
        h0,
        d_o,
        dht,
        seqs,
        shape,
        opts,
    }
}

struct F64Case {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    b: Vec<f64>,
    w: Vec<f64>,
    h0: Option<Vec<f64>>,
}

impl Case {
    fn f64(&self) -> F64Case {
        F64Case {
            q: to_f64(&self.q),
            k: to_f64(&self.k),
            v: to_f64(&self.v),
            g: to_f64(&self.g),
            b: to_f64(&self.b),
            w: to_f64(&self.w),
            h0: self.h0.as_deref().map(to_f64),
        }
    }

    fn forward(&self) -> (Vec<f32>, Option<Vec<f32>>) {
        let c = self;
        forward(
            &c.q,
            &c.k,
            &c.v,
            &c.g,
            &c.b,
            &c.w,
            &c.seqs,
            c.shape,
            c.opts,
            c.h0.as_deref(),
            true,
        )
        .unwrap()
    }

    fn backward(&self) -> Gdn2Grads {
        let c = self;
        backward(
            &c.q,
            &c.k,
            &c.v,
            &c.g,
            &c.b,
            &c.w,
            &c.seqs,
            c.shape,
            c.opts,
            c.h0.as_deref(),
            &c.d_o,
            c.dht.as_deref(),
        )
        .unwrap()
    }
}

fn inputs<'a>(c: &'a Case, f: &'a F64Case) -> RefInputs<'a> {
    RefInputs {
        q: &f.q,
        k: &f.k,
        v: &f.v,
        g: &f.g,
        b: &f.b,
        w: &f.w,
        cu: c.seqs.cu(),
        tokens: c.seqs.tokens(),
        shape: c.shape,
        scale: c.opts.scale as f64,
        l2norm_in_kernel: c.opts.l2norm_in_kernel,
        h0: f.h0.as_deref(),
    }
}

/// Chunked f32 forward and backward against the f64 recurrence; asserts every error is within
/// `tol`, checks padding rows are zero, and returns the worst error.
fn check(c: &Case, tol: f64) -> f64 {
    let f = c.f64();
    let inp = inputs(c, &f);
    let (o_ref, fin_ref) = reference::forward(&inp);
    let gr_ref = reference::backward(
        &inp,
        &to_f64(&c.d_o),
        c.dht.as_deref().map(to_f64).as_deref(),
    );
    let (o, fin) = c.forward();
    let gr = c.backward();
    let mut errs = vec![
        ("o", max_rel_err(&o, &o_ref)),
        ("final_state", max_rel_err(fin.as_ref().unwrap(), &fin_ref)),
        ("dq", max_rel_err(&gr.dq, &gr_ref.dq)),
        ("dk", max_rel_err(&gr.dk, &gr_ref.dk)),
        ("dv", max_rel_err(&gr.dv, &gr_ref.dv)),
        ("dg", max_rel_err(&gr.dg, &gr_ref.dg)),
        ("db", max_rel_err(&gr.db, &gr_ref.db)),
        ("dw", max_rel_err(&gr.dw, &gr_ref.dw)),
    ];
    if let Some(d) = &gr.dh0 {
        errs.push(("dh0", max_rel_err(d, &gr_ref.dh0)));
    }
    let worst = errs.iter().fold(0.0f64, |m, e| m.max(e.1));
    let list: Vec<String> = errs.iter().map(|(n, e)| format!("{n} {e:.1e}")).collect();
    eprintln!("{:?} cu {:?}: {}", c.shape, c.seqs.cu(), list.join(", "));
    assert!(
        worst <= tol,
        "errors {errs:?} exceed {tol} for shape {:?} seqs {:?}",
        c.shape,
        c.seqs.cu()
    );
    // Padding rows are exactly zero.
    let (used, s) = (c.seqs.used(), c.shape);
    assert!(o[used * s.hv * s.dv..].iter().all(|&x| x == 0.0));
    for (x, d) in [
        (&gr.dq, s.hk * s.dk),
        (&gr.dk, s.hk * s.dk),
        (&gr.dv, s.hv * s.dv),
        (&gr.dw, s.hv * s.dv),
    ] {
        assert!(x[used * d..].iter().all(|&y| y == 0.0));
    }
    for x in [&gr.dg, &gr.db] {
        assert!(x[used * s.hv * s.dk..].iter().all(|&y| y == 0.0));
    }
    worst
}

#[test]
fn reference_backward_matches_finite_differences() {
    for &norm in &[false, true] {
        let shape = RuleShape {
            hk: 1,
            hv: 2,
            dk: 3,
            dv: 2,
        };
        let seqs = Seqs::packed(&[0, 4, 4, 7], 8).unwrap();
        let c = case(seqs, shape, norm, true, Decay::Uniform(1.0), 7);
        let f = c.f64();
        let d_o = to_f64(&c.d_o);
        let dht = to_f64(c.dht.as_ref().unwrap());
        let gr = reference::backward(&inputs(&c, &f), &d_o, Some(&dht));
        let loss = |f: &F64Case| {
            let (o, fin) = reference::forward(&inputs(&c, f));
            dot(&o, &d_o) + dot(&fin, &dht)
        };
        type Sel = fn(&mut F64Case) -> &mut Vec<f64>;
        let fields: [(&str, Sel, &Vec<f64>); 7] = [
            ("q", |f| &mut f.q, &gr.dq),
            ("k", |f| &mut f.k, &gr.dk),
            ("v", |f| &mut f.v, &gr.dv),
            ("g", |f| &mut f.g, &gr.dg),
            ("b", |f| &mut f.b, &gr.db),
            ("w", |f| &mut f.w, &gr.dw),
            ("h0", |f| f.h0.as_mut().unwrap(), &gr.dh0),
        ];
        for (name, sel, an) in fields {
            let x0 = sel(&mut c.f64()).clone();
            let at = |x: &[f64]| {
                let mut fp = c.f64();
                sel(&mut fp).copy_from_slice(x);
                loss(&fp)
            };
            let fd = fd_grad(at, &x0, FD_STEP);
            for i in 0..an.len() {
                assert!(
                    (fd[i] - an[i]).abs() <= 1e-6 * (1.0 + fd[i].abs()),
                    "{name}[{i}] (norm {norm}): fd {} vs {}",
                    fd[i],
                    an[i]
                );
            }
        }
    }
}

#[test]
fn chunked_matches_recurrence_lengths_weak_and_strong_decay() {
    // Dk != Dv; chunk tails of 1, 15 (a partial sub-chunk) and 8 rows.
    let shape = RuleShape {
        hk: 2,
        hv: 2,
        dk: 16,
        dv: 8,
    };
    for decay in [WEAK, STRONG] {
        for &t in &[1usize, 63, 64, 65, 200] {
            check(
                &case(Seqs::uniform(2, t), shape, false, true, decay, t as u64),
                TOL,
            );
        }
    }
}

#[test]
fn chunked_matches_recurrence_head_ratios() {
    for &(hk, hv) in &[(2usize, 2usize), (2, 4), (1, 4)] {
        let shape = RuleShape {
            hk,
            hv,
            dk: 16,
            dv: 24,
        };
        // 100 = 64 + 36: the second chunk ends in a partial sub-chunk of 4 rows.
        check(
            &case(
                Seqs::uniform(2, 100),
                shape,
                false,
                true,
                WEAK,
                (hk * 10 + hv) as u64,
            ),
            TOL,
        );
        check(
            &case(
                Seqs::uniform(2, 100),
                shape,
                false,
                true,
                STRONG,
                (hk * 10 + hv + 1) as u64,
            ),
            TOL,
        );
    }
}

#[test]
fn chunked_matches_recurrence_in_kernel_l2norm() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 8,
        dv: 16,
    };
    check(&case(Seqs::uniform(2, 70), shape, true, true, WEAK, 3), TOL);
    check(
        &case(Seqs::uniform(2, 70), shape, true, true, STRONG, 4),
        TOL,
    );
}

#[test]
fn chunked_matches_recurrence_extreme_and_zero_decay() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 16,
        dv: 16,
    };
    // g = -20 on half the channels next to weak decay: decays underflow within one step, the
    // whole-chunk factorization would overflow; must stay finite and exact.
    check(
        &case(
            Seqs::uniform(1, 150),
            shape,
            false,
            true,
            Decay::Mixed20,
            11,
        ),
        TOL,
    );
    check(
        &case(
            Seqs::uniform(1, 150),
            shape,
            false,
            true,
            Decay::Uniform(20.0),
            13,
        ),
        TOL,
    );
    // No decay at all: the state only grows through the delta rule.
    check(
        &case(
            Seqs::uniform(1, 150),
            shape,
            false,
            true,
            Decay::Uniform(0.0),
            12,
        ),
        1e-4,
    );
}

#[test]
fn chunked_matches_recurrence_packed_with_edge_cases() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 8,
        dv: 12,
    };
    // empty, length 1, 63, 64, 65 sequences, then 5 padding rows
    let cu = [0u64, 0, 1, 64, 128, 193, 193];
    for (decay, seed) in [(WEAK, 5), (STRONG, 6)] {
        let seqs = Seqs::packed(&cu, 198).unwrap();
        check(&case(seqs, shape, true, true, decay, seed), TOL);
    }
}

/// Repeat each value of `x` `times` times (a per-head value broadcast over a head dimension).
fn broadcast(x: &[f32], times: usize) -> Vec<f32> {
    x.iter()
        .flat_map(|&a| std::iter::repeat_n(a, times))
        .collect()
}

/// Sum groups of `n` consecutive values.
fn group_sum(x: &[f32], n: usize) -> Vec<f32> {
    x.chunks_exact(n).map(|c| c.iter().sum()).collect()
}

#[test]
fn reduces_to_gated_delta_rule() {
    // b = w = beta broadcast, g scalar per head broadcast over Dk: the GDN recurrence. Two f32
    // implementations of it agree to f32 rounding (observed: at most 7e-7).
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 16,
        dv: 8,
    };
    let cu = [0u64, 0, 1, 70, 200];
    let seqs = Seqs::packed(&cu, 203).unwrap();
    let c = case(seqs, shape, true, true, WEAK, 21);
    let n = c.seqs.tokens();
    let mut r = rng(22);
    let g1: Vec<f32> = (0..n * shape.hv).map(|_| -0.5 * r.gen::<f32>()).collect();
    let beta = uniform(&mut r, n * shape.hv, 0.0, 1.0);
    let (g2, b2, w2) = (
        broadcast(&g1, shape.dk),
        broadcast(&beta, shape.dk),
        broadcast(&beta, shape.dv),
    );
    let (h0, dht) = (c.h0.as_deref(), c.dht.as_deref());
    let (o1, f1) = gated_delta_rule::cpu::forward(
        &c.q, &c.k, &c.v, &g1, &beta, &c.seqs, shape, c.opts, h0, true,
    )
    .unwrap();
    let (o2, f2) = forward(
        &c.q, &c.k, &c.v, &g2, &b2, &w2, &c.seqs, shape, c.opts, h0, true,
    )
    .unwrap();
    let g_1 = gated_delta_rule::cpu::backward(
        &c.q, &c.k, &c.v, &g1, &beta, &c.seqs, shape, c.opts, h0, &c.d_o, dht,
    )
    .unwrap();
    let g_2 = backward(
        &c.q, &c.k, &c.v, &g2, &b2, &w2, &c.seqs, shape, c.opts, h0, &c.d_o, dht,
    )
    .unwrap();
    let dbeta: Vec<f32> = group_sum(&g_2.db, shape.dk)
        .iter()
        .zip(group_sum(&g_2.dw, shape.dv))
        .map(|(a, b)| a + b)
        .collect();
    let pairs: [(&str, &[f32], &[f32]); 9] = [
        ("o", &o2, &o1),
        ("final_state", f2.as_ref().unwrap(), f1.as_ref().unwrap()),
        ("dq", &g_2.dq, &g_1.dq),
        ("dk", &g_2.dk, &g_1.dk),
        ("dv", &g_2.dv, &g_1.dv),
        ("dg", &group_sum(&g_2.dg, shape.dk), &g_1.dg),
        ("dbeta", &dbeta, &g_1.dbeta),
        ("dh0", g_2.dh0.as_ref().unwrap(), g_1.dh0.as_ref().unwrap()),
        (
            "o (padding)",
            &o2[200 * shape.hv * shape.dv..],
            &o1[200 * shape.hv * shape.dv..],
        ),
    ];
    for (name, a, b) in pairs {
        assert_close(name, a, &to_f64(b), TOL);
    }
}

#[test]
fn bitwise_reproducible_across_thread_counts() {
    let shape = RuleShape {
        hk: 2,
        hv: 4,
        dk: 16,
        dv: 8,
    };
    let c = case(
        Seqs::packed(&[0, 100, 130, 230], 232).unwrap(),
        shape,
        true,
        true,
        STRONG,
        9,
    );
    let run = |threads: usize| {
        with_threads(threads, || {
            let (o, fin) = c.forward();
            let g = c.backward();
            bits(
                &[
                    o,
                    fin.unwrap(),
                    g.dq,
                    g.dk,
                    g.dv,
                    g.dg,
                    g.db,
                    g.dw,
                    g.dh0.unwrap(),
                ]
                .concat(),
            )
        })
    };
    assert_eq!(run(1), run(3));
}

#[test]
fn bad_lengths_are_errors() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 4,
        dv: 3,
    };
    let c = case(Seqs::uniform(2, 5), shape, false, true, WEAK, 1);
    let (s, o, h0) = (&c.seqs, c.opts, c.h0.as_deref());
    let (q, k, v, g, b, w, d_o) = (
        &c.q[..],
        &c.k[..],
        &c.v[..],
        &c.g[..],
        &c.b[..],
        &c.w[..],
        &c.d_o[..],
    );
    let short = |x: &[f32]| x[1..].to_vec();
    let fwd = |q: &[f32], k: &[f32], v: &[f32], g: &[f32], b: &[f32], w: &[f32]| {
        forward(q, k, v, g, b, w, s, shape, o, h0, true).is_err()
    };
    assert!(!fwd(q, k, v, g, b, w));
    assert!(fwd(&short(q), k, v, g, b, w));
    assert!(fwd(q, &short(k), v, g, b, w));
    assert!(fwd(q, k, &short(v), g, b, w));
    assert!(fwd(q, k, v, &short(g), b, w));
    assert!(fwd(q, k, v, g, &short(b), w));
    assert!(fwd(q, k, v, g, b, &short(w)));
    // GDN's per-head gates are not GDN2's per-channel gates.
    let per_head = vec![0.0f32; s.tokens() * shape.hv];
    assert!(fwd(q, k, v, &per_head, b, w));
    assert!(fwd(q, k, v, g, &per_head, w));
    assert!(fwd(q, k, v, g, b, &per_head));
    let bad = RuleShape {
        hk: 2,
        hv: 3,
        dk: 4,
        dv: 3,
    };
    assert!(forward(q, k, v, g, b, w, s, bad, o, None, false).is_err());
    let zero = RuleShape {
        hk: 1,
        hv: 2,
        dk: 0,
        dv: 3,
    };
    assert!(forward(&[], &[], v, &[], &[], w, s, zero, o, None, false).is_err());
    assert!(forward(q, k, v, g, b, w, s, shape, o, Some(&[0.0; 3]), false).is_err());
    assert!(backward(q, k, v, g, b, w, s, shape, o, h0, &short(d_o), None).is_err());
    assert!(backward(q, k, v, g, b, w, s, shape, o, h0, d_o, Some(&[0.0; 3])).is_err());
    assert!(backward(q, k, v, &short(g), b, w, s, shape, o, h0, d_o, None).is_err());
    assert!(backward(q, k, v, g, b, w, s, shape, o, h0, d_o, c.dht.as_deref()).is_ok());
}

#[test]
fn decay_exp_is_accurate() {
    use super::cpu::exp_f32;
    // Within 2 ulp-ish of the exact value wherever the result is a normal f32; exact at 0.
    assert_eq!(exp_f32(0.0), 1.0);
    let mut worst = 0.0f64;
    for i in 0..=2_000_000 {
        let x = -86.5 + 96.5 * i as f32 / 2e6; // [-86.5, 10]
        let want = (x as f64).exp();
        worst = worst.max((exp_f32(x) as f64 - want).abs() / want);
    }
    assert!(worst < 2.5e-7, "max relative error {worst:e}");
    assert_eq!(exp_f32(-86.6), 0.0);
    assert_eq!(exp_f32(-1e30), 0.0);
    assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_f32(89.0), f32::INFINITY);
    assert!(exp_f32(f32::NAN).is_nan());
}
