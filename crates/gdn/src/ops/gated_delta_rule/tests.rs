use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use super::cpu::{backward, forward};
use super::reference::{self, RefInputs};
use super::*;

struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    h0: Option<Vec<f32>>,
    d_o: Vec<f32>,
    dht: Option<Vec<f32>>,
    seqs: Seqs,
    shape: RuleShape,
    opts: RuleOpts,
}

fn normal(rng: &mut ChaCha8Rng, n: usize, s: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            s * z as f32
        })
        .collect::<Vec<f32>>()
}

/// Random inputs. Without in-kernel norm, k rows are unit-norm (as in the layer) so the
/// recurrence is contractive; `decay` sets the range of g as (-decay, 0].
fn case(
    seqs: Seqs,
    shape: RuleShape,
    norm_in_kernel: bool,
    with_states: bool,
    decay: f32,
    seed: u64,
) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = seqs.tokens();
    let (hk, hv, dk, dv) = (shape.hk, shape.hv, shape.dk, shape.dv);
    let mut q = normal(&mut rng, n * hk * dk, 1.0);
    let mut k = normal(&mut rng, n * hk * dk, 1.0);
    if !norm_in_kernel {
        for x in [&mut q, &mut k] {
            for r in x.chunks_mut(dk) {
                let s = 1.0 / r.iter().map(|a| a * a).sum::<f32>().sqrt();
                r.iter_mut().for_each(|a| *a *= s);
            }
        }
    }
    let v = normal(&mut rng, n * hv * dv, 1.0);
    let g = (0..n * hv).map(|_| -decay * rng.gen::<f32>()).collect();
    let beta = (0..n * hv).map(|_| rng.gen::<f32>()).collect();
    let st = seqs.count() * hv * dk * dv;
    let h0 = with_states.then(|| normal(&mut ChaCha8Rng::seed_from_u64(seed + 1), st, 0.5));
    let d_o = normal(&mut rng, n * hv * dv, 1.0);
    let dht = with_states.then(|| normal(&mut ChaCha8Rng::seed_from_u64(seed + 2), st, 0.5));
    let opts = RuleOpts {
        scale: 1.0 / (dk as f32).sqrt(),
        l2norm_in_kernel: norm_in_kernel,
    };
    Case {
        q,
        k,
        v,
        g,
        beta,
        h0,
        d_o,
        dht,
        seqs,
        shape,
        opts,
    }
}

fn f64v(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&a| a as f64).collect()
}

/// max |a - b| / max |b|.
fn rel(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let m = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |e, (x, y)| e.max((*x as f64 - y).abs()))
        / m
}

struct F64Case {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
    h0: Option<Vec<f64>>,
}

impl Case {
    /// The CPU op's backward on this case (its states and their gradient when it has them).
    fn backward(&self) -> super::cpu::Grads {
        backward(
            &self.q,
            &self.k,
            &self.v,
            &self.g,
            &self.beta,
            &self.seqs,
            self.shape,
            self.opts,
            self.h0.as_deref(),
            &self.d_o,
            self.dht.as_deref(),
        )
        .unwrap()
    }

    fn f64(&self) -> F64Case {
        F64Case {
            q: f64v(&self.q),
            k: f64v(&self.k),
            v: f64v(&self.v),
            g: f64v(&self.g),
            beta: f64v(&self.beta),
            h0: self.h0.as_deref().map(f64v),
        }
    }
}

fn inputs<'a>(c: &'a Case, f: &'a F64Case) -> RefInputs<'a> {
    RefInputs {
        q: &f.q,
        k: &f.k,
        v: &f.v,
        g: &f.g,
        beta: &f.beta,
        cu: c.seqs.cu(),
        tokens: c.seqs.tokens(),
        shape: c.shape,
        scale: c.opts.scale as f64,
        l2norm_in_kernel: c.opts.l2norm_in_kernel,
        h0: f.h0.as_deref(),
    }
}

/// Chunked f32 forward and backward against the f64 recurrence; returns the worst relative
/// error over (o, final state, dq, dk, dv, dg, dbeta, dh0).
fn check(c: &Case, tol: f64) -> f64 {
    let f = c.f64();
    let inp = inputs(c, &f);
    let (o_ref, fin_ref) = reference::forward(&inp);
    let (o, fin) = forward(
        &c.q,
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        c.shape,
        c.opts,
        c.h0.as_deref(),
        true,
    )
    .unwrap();
    let gr_ref = reference::backward(&inp, &f64v(&c.d_o), c.dht.as_deref().map(f64v).as_deref());
    let gr = c.backward();
    let mut errs = vec![
        ("o", rel(&o, &o_ref)),
        ("final_state", rel(fin.as_ref().unwrap(), &fin_ref)),
        ("dq", rel(&gr.dq, &gr_ref.dq)),
        ("dk", rel(&gr.dk, &gr_ref.dk)),
        ("dv", rel(&gr.dv, &gr_ref.dv)),
        ("dg", rel(&gr.dg, &gr_ref.dg)),
        ("dbeta", rel(&gr.dbeta, &gr_ref.dbeta)),
    ];
    if let Some(d) = &gr.dh0 {
        errs.push(("dh0", rel(d, &gr_ref.dh0)));
    }
    let worst = errs.iter().fold(0.0f64, |m, e| m.max(e.1));
    let shown: Vec<String> = errs.iter().map(|(n, e)| format!("{n} {e:.1e}")).collect();
    eprintln!(
        "rule vs f64 recurrence {:?} cu {:?}: {}",
        c.shape,
        &c.seqs.cu()[..c.seqs.cu().len().min(8)],
        shown.join(", ")
    );
    assert!(
        worst <= tol,
        "errors {errs:?} exceed {tol} for shape {:?} seqs {:?}",
        c.shape,
        c.seqs.cu()
    );
    // padding rows are exactly zero
    let used = c.seqs.used();
    let hv = c.shape.hv;
    assert!(o[used * hv * c.shape.dv..].iter().all(|&x| x == 0.0));
    assert!(gr.dg[used * hv..].iter().all(|&x| x == 0.0));
    worst
}

const TOL: f64 = 2e-5;

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
        let c = case(seqs, shape, norm, true, 1.0, 7);
        let f = c.f64();
        let d_o = f64v(&c.d_o);
        let dht = f64v(c.dht.as_ref().unwrap());
        let inp = inputs(&c, &f);
        let gr = reference::backward(&inp, &d_o, Some(&dht));
        let loss = |f: &F64Case| {
            let inp = inputs(&c, f);
            let (o, fin) = reference::forward(&inp);
            o.iter().zip(&d_o).map(|(a, b)| a * b).sum::<f64>()
                + fin.iter().zip(&dht).map(|(a, b)| a * b).sum::<f64>()
        };
        let h = 1e-6;
        type Sel = fn(&mut F64Case) -> &mut Vec<f64>;
        let fields: [(&str, Sel, &Vec<f64>); 6] = [
            ("q", |f| &mut f.q, &gr.dq),
            ("k", |f| &mut f.k, &gr.dk),
            ("v", |f| &mut f.v, &gr.dv),
            ("g", |f| &mut f.g, &gr.dg),
            ("beta", |f| &mut f.beta, &gr.dbeta),
            ("h0", |f| f.h0.as_mut().unwrap(), &gr.dh0),
        ];
        for (name, sel, an) in fields {
            let mut fp = c.f64();
            for i in 0..an.len() {
                let x0 = sel(&mut fp)[i];
                sel(&mut fp)[i] = x0 + h;
                let lp = loss(&fp);
                sel(&mut fp)[i] = x0 - h;
                let lm = loss(&fp);
                sel(&mut fp)[i] = x0;
                let fd = (lp - lm) / (2.0 * h);
                assert!(
                    (fd - an[i]).abs() <= 1e-6 * (1.0 + fd.abs()),
                    "{name}[{i}] (norm {norm}): fd {fd} vs {}",
                    an[i]
                );
            }
        }
    }
}

#[test]
fn chunked_matches_recurrence_lengths() {
    let shape = RuleShape {
        hk: 2,
        hv: 2,
        dk: 16,
        dv: 8,
    };
    for &t in &[1usize, 63, 64, 65, 200] {
        check(
            &case(Seqs::uniform(1, t), shape, false, false, 0.5, t as u64),
            TOL,
        );
    }
}

#[test]
fn chunked_matches_recurrence_batch_ratios_states() {
    for &(hk, hv) in &[(2usize, 2usize), (2, 4), (1, 4)] {
        let shape = RuleShape {
            hk,
            hv,
            dk: 16,
            dv: 24,
        };
        check(
            &case(
                Seqs::uniform(2, 130),
                shape,
                false,
                true,
                0.5,
                (hk * 10 + hv) as u64,
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
    check(&case(Seqs::uniform(2, 70), shape, true, true, 0.5, 3), TOL);
}

#[test]
fn chunked_matches_recurrence_strong_and_zero_decay() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 16,
        dv: 16,
    };
    // g in (-20, 0]: the decay underflows to 0 within a chunk; must stay finite and exact.
    check(
        &case(Seqs::uniform(1, 150), shape, false, true, 20.0, 11),
        TOL,
    );
    check(
        &case(Seqs::uniform(1, 150), shape, false, true, 0.0, 12),
        1e-4,
    );
}

#[test]
fn chunked_matches_recurrence_packed_with_edge_cases() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 8,
        dv: 8,
    };
    // empty, length 1, 63, 64, 65 sequences, then 5 padding rows
    let cu = [0u64, 0, 1, 64, 128, 193, 193];
    let seqs = Seqs::packed(&cu, 198).unwrap();
    check(&case(seqs, shape, false, true, 0.5, 5), TOL);
}

#[test]
fn backward_is_bitwise_reproducible_across_thread_counts() {
    let shape = RuleShape {
        hk: 2,
        hv: 4,
        dk: 16,
        dv: 16,
    };
    let c = case(Seqs::uniform(2, 100), shape, true, true, 0.5, 9);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let g = c.backward();
            [g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dh0.unwrap()]
                .concat()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<u32>>()
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
        dv: 4,
    };
    let c = case(Seqs::uniform(1, 5), shape, false, false, 0.5, 1);
    let opts = c.opts;
    assert!(forward(
        &c.q[1..],
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        shape,
        opts,
        None,
        false
    )
    .is_err());
    let bad = RuleShape {
        hk: 2,
        hv: 3,
        dk: 4,
        dv: 4,
    };
    assert!(forward(&c.q, &c.k, &c.v, &c.g, &c.beta, &c.seqs, bad, opts, None, false).is_err());
    assert!(forward(
        &c.q,
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        shape,
        opts,
        Some(&[0.0; 3]),
        false
    )
    .is_err());
    assert!(backward(
        &c.q,
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        shape,
        opts,
        None,
        &c.d_o[1..],
        None
    )
    .is_err());
}

/// Each sequence of a packed batch gets exactly (bitwise) what it gets alone: one task per
/// (sequence, head), the same chunking from the sequence start, the same arithmetic.
#[test]
fn packed_sequences_are_bitwise_independent() {
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 8,
        dv: 8,
    };
    let cu = [0u64, 5, 5, 70, 71];
    let c = case(Seqs::packed(&cu, 73).unwrap(), shape, true, true, 0.5, 17);
    let (o, fin) = forward(
        &c.q,
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        shape,
        c.opts,
        c.h0.as_deref(),
        true,
    )
    .unwrap();
    let gr = backward(
        &c.q,
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        shape,
        c.opts,
        c.h0.as_deref(),
        &c.d_o,
        c.dht.as_deref(),
    )
    .unwrap();
    let fin = fin.unwrap();
    let st = shape.hv * shape.dk * shape.dv;
    for i in 0..cu.len() - 1 {
        let (a, b) = (cu[i] as usize, cu[i + 1] as usize);
        let one = Seqs::uniform(1, b - a);
        let qk = |x: &[f32]| x[a * shape.dk..b * shape.dk].to_vec();
        let vv = |x: &[f32]| x[a * shape.hv * shape.dv..b * shape.hv * shape.dv].to_vec();
        let gg = |x: &[f32]| x[a * shape.hv..b * shape.hv].to_vec();
        let h0 = c.h0.as_ref().map(|h| h[i * st..(i + 1) * st].to_vec());
        let dht = c.dht.as_ref().map(|h| h[i * st..(i + 1) * st].to_vec());
        let (o1, f1) = forward(
            &qk(&c.q),
            &qk(&c.k),
            &vv(&c.v),
            &gg(&c.g),
            &gg(&c.beta),
            &one,
            shape,
            c.opts,
            h0.as_deref(),
            true,
        )
        .unwrap();
        let g1 = backward(
            &qk(&c.q),
            &qk(&c.k),
            &vv(&c.v),
            &gg(&c.g),
            &gg(&c.beta),
            &one,
            shape,
            c.opts,
            h0.as_deref(),
            &vv(&c.d_o),
            dht.as_deref(),
        )
        .unwrap();
        assert_eq!(o1, vv(&o));
        assert_eq!(f1.unwrap(), fin[i * st..(i + 1) * st].to_vec());
        assert_eq!(g1.dq, qk(&gr.dq));
        assert_eq!(g1.dk, qk(&gr.dk));
        assert_eq!(g1.dv, vv(&gr.dv));
        assert_eq!(g1.dg, gg(&gr.dg));
        assert_eq!(g1.dbeta, gg(&gr.dbeta));
        assert_eq!(
            g1.dh0.unwrap(),
            gr.dh0.as_ref().unwrap()[i * st..(i + 1) * st].to_vec()
        );
    }
}

/// Every output of the f64 recurrence for `c` and their conditioning floors for bf16 storage
/// (`reference::conditioning_floors`, the GPU tests' seeds); prints the `gradient_conditioning`
/// line with the GPU tests' base tolerances.
#[allow(clippy::type_complexity)]
fn ref_and_floors(
    label: &str,
    c: &Case,
) -> (Vec<(&'static str, Vec<f64>)>, Vec<(&'static str, f64)>) {
    use crate::testutil::{conditioning_line, CONDITIONING_SEEDS};
    let f = c.f64();
    let inp = inputs(c, &f);
    let d_o = f64v(&c.d_o);
    let dht = c.dht.as_deref().map(f64v);
    let rf = reference::outputs(&inp, &d_o, dht.as_deref());
    let fl = reference::conditioning_floors(&inp, &d_o, dht.as_deref(), &rf, &CONDITIONING_SEEDS);
    let rows: Vec<(&str, f64, f64)> = fl.iter().map(|&(n, x)| (n, bf16_base(n), x)).collect();
    eprintln!("{}", conditioning_line(label, &rows));
    (rf, fl)
}

/// The GPU tests' fixed bf16 tolerances (RMS relative against the f64 recurrence).
fn bf16_base(name: &str) -> f64 {
    match name {
        "dg" | "dbeta" => 0.02,
        _ => 0.005,
    }
}

/// The output `name` of a list of named outputs.
fn named<'a>(v: &'a [(&'static str, Vec<f64>)], name: &str) -> &'a [f64] {
    &v.iter().find(|(n, _)| *n == name).unwrap().1
}

/// The floor of output `name`.
fn floor_of(v: &[(&'static str, f64)], name: &str) -> f64 {
    v.iter().find(|(n, _)| *n == name).unwrap().1
}

/// The conditioned tolerances of the GPU bf16 tests (max(base, floor), the floor from the f64
/// recurrence on bf16-rounding-perturbed inputs) still catch bugs:
/// - on well-conditioned cases (several tokens, GVA 2 and 4, states, both norms) every floor is
///   below the base tolerance (so nothing is widened; they are 3.2e-3 .. 5.5e-3, close to the
///   5e-3 base: the fixed tolerance is about one bf16 rounding of the inputs) and above 1e-4 (the
///   perturbation acts);
/// - on a one-token GVA 2 case whose two value heads' dq / dk contributions nearly cancel, the
///   floor of dq and dk is several times the base tolerance (the case the GPU's prep7 failed);
/// - the CPU op's answer passes the conditioned tolerances, and planted errors fail them: dq
///   scaled by 1.02, one token's dk row zeroed, a value head's contribution to dq dropped (also on
///   the cancelling case, where the tolerance is widened), and the l2 norm backward's projection
///   term with its sign flipped (on both).
#[test]
fn conditioned_tolerance_floors_and_bugs() {
    use crate::testutil::{conditioned_tol, rms_rel_err};
    let tol = |fl: &[(&'static str, f64)], name: &str| {
        conditioned_tol(bf16_base(name), floor_of(fl, name))
    };
    // 1. Well-conditioned cases.
    let wc = [
        (
            "T130 1/2 d64 norm states",
            case(
                Seqs::uniform(1, 130),
                RuleShape {
                    hk: 1,
                    hv: 2,
                    dk: 64,
                    dv: 64,
                },
                true,
                true,
                1.0,
                71,
            ),
        ),
        (
            "B2 T65 2/4 d32x48 caller",
            case(
                Seqs::uniform(2, 65),
                RuleShape {
                    hk: 2,
                    hv: 4,
                    dk: 32,
                    dv: 48,
                },
                false,
                false,
                0.5,
                72,
            ),
        ),
    ];
    for (label, c) in &wc {
        let (rf, fl) = ref_and_floors(label, c);
        for &(name, floor) in &fl {
            assert!(
                floor > 1e-4 && floor < bf16_base(name),
                "{label}: {name}'s floor {floor:.3e} is not small (base {})",
                bf16_base(name)
            );
        }
        // The CPU op (f32) passes; planted errors fail.
        let gr = c.backward();
        for (name, x) in [
            ("dq", &gr.dq),
            ("dk", &gr.dk),
            ("dv", &gr.dv),
            ("dg", &gr.dg),
            ("dbeta", &gr.dbeta),
        ] {
            let e = rms_rel_err(x, named(&rf, name));
            assert!(e <= tol(&fl, name), "{label}: CPU {name} {e:.3e}");
        }
        let tol_dq = tol(&fl, "dq");
        let scaled: Vec<f32> = gr.dq.iter().map(|&x| x * 1.02).collect();
        let e = rms_rel_err(&scaled, named(&rf, "dq"));
        eprintln!("{label}: dq x 1.02: {e:.3e} (tol {tol_dq:.3e})");
        assert!(e > tol_dq, "{label}: dq x 1.02 passes ({e:.3e})");
        let row = c.shape.hk * c.shape.dk;
        let mut holed = gr.dk.clone();
        holed[37 * row..38 * row].iter_mut().for_each(|x| *x = 0.0);
        let e = rms_rel_err(&holed, named(&rf, "dk"));
        let tol_dk = tol(&fl, "dk");
        eprintln!("{label}: dk row 37 zeroed: {e:.3e} (tol {tol_dk:.3e})");
        assert!(e > tol_dk, "{label}: a zeroed dk row passes ({e:.3e})");
        let e = dropped_head_error(c, named(&rf, "dq"));
        eprintln!("{label}: dq without value head 1: {e:.3e} (tol {tol_dq:.3e})");
        assert!(e > tol_dq, "{label}: a dropped head passes ({e:.3e})");
        if c.opts.l2norm_in_kernel {
            let e = flipped_projection_error(c, named(&rf, "dq"));
            eprintln!("{label}: dq, projection sign flipped: {e:.3e} (tol {tol_dq:.3e})");
            assert!(e > tol_dq, "{label}: a flipped projection passes ({e:.3e})");
        }
    }
    // 2. One token, GVA 2, in-kernel norm: head 1's beta set so that beta_j (v_j . do_j), the
    // factor of head j's dq and dk (both along one vector), cancels head 0's to 1/8.
    let shape = RuleShape {
        hk: 1,
        hv: 2,
        dk: 64,
        dv: 64,
    };
    let mut c = case(Seqs::uniform(1, 1), shape, true, false, 1.0, 73);
    // q correlated with k (q.k ~ 0.45 after the norm), so the projection term is not small.
    for i in 0..64 {
        c.q[i] = 0.5 * c.k[i] + 0.5 * c.q[i];
    }
    let dot = |c: &Case, h: usize| -> f64 {
        (0..64)
            .map(|x| c.v[h * 64 + x] as f64 * c.d_o[h * 64 + x] as f64)
            .sum()
    };
    if dot(&c, 0) * dot(&c, 1) > 0.0 {
        c.d_o[64..].iter_mut().for_each(|x| *x = -*x);
    }
    c.beta[0] = 0.8;
    c.beta[1] = (-(1.0 - 0.125) * 0.8 * dot(&c, 0) / dot(&c, 1)) as f32;
    assert!(c.beta[1] > 0.0 && c.beta[1] < 4.0, "beta {}", c.beta[1]);
    let (rf, fl) = ref_and_floors("T1 1/2 d64 norm, dq heads cancel to 1/8", &c);
    for name in ["dq", "dk"] {
        let floor = floor_of(&fl, name);
        assert!(
            floor > 2.0 * bf16_base(name),
            "cancelling case: {name}'s floor {floor:.3e} is not large"
        );
    }
    let tol_dq = tol(&fl, "dq");
    let e = dropped_head_error(&c, named(&rf, "dq"));
    eprintln!("cancelling: dq without value head 1: {e:.3e} (tol {tol_dq:.3e})");
    assert!(e > tol_dq, "cancelling: a dropped head passes ({e:.3e})");
    let e = flipped_projection_error(&c, named(&rf, "dq"));
    eprintln!("cancelling: dq, projection sign flipped: {e:.3e} (tol {tol_dq:.3e})");
    assert!(
        e > tol_dq,
        "cancelling: a flipped projection passes ({e:.3e})"
    );
    let gr = c.backward();
    let e = rms_rel_err(&gr.dq, named(&rf, "dq"));
    assert!(e <= tol_dq, "cancelling: CPU dq {e:.3e}");
}

/// RMS relative error of the f64 recurrence's dq when value head 1's contribution is dropped
/// (its d_o zeroed, so only the other heads feed dq) against the true dq `want`.
fn dropped_head_error(c: &Case, want: &[f64]) -> f64 {
    let f = c.f64();
    let inp = inputs(c, &f);
    let mut d_o = f64v(&c.d_o);
    let (hv, dv) = (c.shape.hv, c.shape.dv);
    for t in 0..c.seqs.tokens() {
        d_o[(t * hv + 1) * dv..(t * hv + 2) * dv]
            .iter_mut()
            .for_each(|x| *x = 0.0);
    }
    let dht = c.dht.as_deref().map(|d| {
        let mut d = f64v(d);
        let st = c.shape.dk * dv;
        for n in 0..c.seqs.count() {
            d[(n * hv + 1) * st..(n * hv + 2) * st]
                .iter_mut()
                .for_each(|x| *x = 0.0);
        }
        d
    });
    let gr = reference::backward(&inp, &d_o, dht.as_deref());
    crate::testutil::rms_rel_err_f64(&gr.dq, want)
}

/// RMS relative error, against the true dq `want`, of a dq whose l2 norm backward adds the
/// projection term instead of subtracting it: `r (dy + y <dy, y>)` for `r (dy - y <dy, y>)`,
/// with `dy` the recurrence's gradient of the normalized q (the recurrence run on normalized q,
/// k without the in-kernel norm). Also checks that the subtracted form is the recurrence's dq.
fn flipped_projection_error(c: &Case, want: &[f64]) -> f64 {
    let dk = c.shape.dk;
    let mut f = c.f64();
    let mut rs = Vec::new();
    for x in [&mut f.q, &mut f.k] {
        for row in x.chunks_mut(dk) {
            let r = 1.0 / (row.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
            row.iter_mut().for_each(|a| *a *= r);
            rs.push(r);
        }
    }
    let mut inp = inputs(c, &f);
    inp.l2norm_in_kernel = false;
    let gr = reference::backward(&inp, &f64v(&c.d_o), c.dht.as_deref().map(f64v).as_deref());
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for (i, (dy, y)) in gr.dq.chunks(dk).zip(f.q.chunks(dk)).enumerate() {
        let p: f64 = dy.iter().zip(y).map(|(a, b)| a * b).sum();
        for (d, yy) in dy.iter().zip(y) {
            good.push(rs[i] * (d - yy * p));
            bad.push(rs[i] * (d + yy * p));
        }
    }
    let consistent = crate::testutil::rms_rel_err_f64(&good, want);
    assert!(
        consistent < 1e-10,
        "projection form vs the recurrence's dq: {consistent:.3e}"
    );
    crate::testutil::rms_rel_err_f64(&bad, want)
}
