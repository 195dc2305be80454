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
    let gr = backward(
        &c.q,
        &c.k,
        &c.v,
        &c.g,
        &c.beta,
        &c.seqs,
        c.shape,
        c.opts,
        c.h0.as_deref(),
        &c.d_o,
        c.dht.as_deref(),
    )
    .unwrap();
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
            let g = backward(
                &c.q,
                &c.k,
                &c.v,
                &c.g,
                &c.beta,
                &c.seqs,
                c.shape,
                c.opts,
                c.h0.as_deref(),
                &c.d_o,
                c.dht.as_deref(),
            )
            .unwrap();
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
