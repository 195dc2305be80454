//! The model's ops (embedding, SwiGLU, cross-entropy, add, AdamW, sums of squares) and the whole
//! model and trainer on a real GPU. Run on the device machine with `--include-ignored`.
//!
//! Ops: outputs poisoned with NaN before each run must come back written; two runs give the same
//! bits; f32 storage against the CPU op (bitwise where the arithmetic is the same: add, gather,
//! embedding sums, AdamW), bf16 storage against the f64 references.

#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use gdn::backend::{Act, Ids, PMut, P};
use gdn::device::cuda::{self, DBuf, DType, GBuf, Gpu};
use gdn::ops::{adamw, add, cross_entropy, embedding, swiglu};
use gdn::testutil::{bits, max_rel_err, normal, rms_rel_err, rng, to_f64};

const F32_TOL: f64 = 1e-5;
const BF16_TOL: f64 = 5e-3;

fn gpu() -> Arc<Gpu> {
    cuda::gpu(0).expect("a CUDA GPU")
}

fn rb(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

fn stored(x: &[f32], dt: DType) -> Vec<f32> {
    match dt {
        DType::F32 => x.to_vec(),
        DType::Bf16 => rb(x),
    }
}

fn up(g: &Arc<Gpu>, x: &[f32], dt: DType) -> DBuf {
    DBuf::upload(g, x, dt).unwrap()
}

fn dev(a: Act) -> DBuf {
    match a {
        Act::Dev(d) => d,
        Act::Host(_) => panic!("expected a device result"),
    }
}

fn dl(a: &DBuf) -> Vec<f32> {
    a.download().unwrap()
}

fn dlg(g: &GBuf<f32>) -> Vec<f32> {
    g.gpu().download(g).unwrap()
}

fn written(label: &str, x: &[f32]) {
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        panic!("{label}: element {i} of {} not written: {}", x.len(), x[i]);
    }
}

fn check(op: &str, dt: DType, name: &str, got: &[f32], cpu: &[f32], want64: &[f64]) {
    written(&format!("{op} {name}"), got);
    match dt {
        DType::F32 => {
            let e = max_rel_err(got, &to_f64(cpu));
            eprintln!("| {op} | f32 | {name} | max-rel vs CPU | {e:.2e} |");
            assert!(e <= F32_TOL, "{op} f32 {name}: {e:.3e}");
        }
        DType::Bf16 => {
            let e = rms_rel_err(got, want64);
            eprintln!("| {op} | bf16 | {name} | rms-rel vs f64 | {e:.2e} |");
            assert!(e <= BF16_TOL, "{op} bf16 {name}: {e:.3e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn add_matches_cpu_bitwise() {
    let g = gpu();
    let mut r = rng(1);
    let n = 100_003;
    let a = normal(&mut r, n, 1.0);
    let x = normal(&mut r, n, 1.0);
    for dt in [DType::F32, DType::Bf16] {
        let mut acc = Act::Dev(up(&g, &a, dt));
        add::add_assign(&mut acc, &Act::Dev(up(&g, &x, dt))).unwrap();
        let got = dl(&dev(acc));
        let (sa, sx) = (stored(&a, dt), stored(&x, dt));
        let want: Vec<f32> = sa.iter().zip(&sx).map(|(a, x)| a + x).collect();
        assert_eq!(bits(&got), bits(&stored(&want, dt)), "add {dt:?}");
    }
    let mut acc = g.upload(&a).unwrap();
    let xg = g.upload(&x).unwrap();
    add::add_assign_f32(PMut::Dev(&mut acc), P::Dev(&xg)).unwrap();
    let want: Vec<f32> = a.iter().zip(&x).map(|(a, x)| a + x).collect();
    assert_eq!(bits(&dlg(&acc)), bits(&want));
    let mut short = Act::Dev(up(&g, &a[1..], DType::F32));
    assert!(add::add_assign(&mut short, &Act::Dev(up(&g, &x, DType::F32))).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_matches_cpu_and_reference() {
    let g = gpu();
    let mut r = rng(2);
    let (rows, f) = (777, 96);
    let u = normal(&mut r, rows * 2 * f, 2.0);
    let da = normal(&mut r, rows * f, 1.0);
    for dt in [DType::F32, DType::Bf16] {
        let run = || {
            let ud = Act::Dev(up(&g, &u, dt));
            let a = dl(&dev(swiglu::forward(&ud, rows, f).unwrap()));
            let du = dl(&dev(swiglu::backward(
                &ud,
                rows,
                f,
                &Act::Dev(up(&g, &da, dt)),
            )
            .unwrap()));
            (a, du)
        };
        let (a, du) = run();
        let (a2, du2) = run();
        assert_eq!((bits(&a), bits(&du)), (bits(&a2), bits(&du2)), "rerun");
        let (su, sda) = (stored(&u, dt), stored(&da, dt));
        let ca = swiglu::cpu::forward(&su, rows, f).unwrap();
        let cdu = swiglu::cpu::backward(&su, rows, f, &sda).unwrap();
        let wa = swiglu::reference::forward(&to_f64(&su), rows, f);
        let wdu = swiglu::reference::backward(&to_f64(&su), rows, f, &to_f64(&sda));
        check("swiglu", dt, "a", &a, &ca, &wa);
        check("swiglu", dt, "du", &du, &cdu, &wdu);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_matches_cpu_bitwise() {
    let g = gpu();
    let mut r = rng(3);
    let (vocab, h, n) = (301, 130, 2000);
    let w = normal(&mut r, vocab * h, 1.0);
    // skewed ids (many repeats of a few tokens, some tokens unused)
    let ids: Vec<u32> = (0..n)
        .map(|i| ((i * i + 7 * i) % 97 + (i % 3) * 150) as u32 % (vocab as u32 - 5))
        .collect();
    let wd = g.upload(&w).unwrap();
    let idd = g.upload(&ids).unwrap();
    let dy = normal(&mut r, n * h, 1.0);
    let base = normal(&mut r, vocab * h, 1.0);
    for dt in [DType::F32, DType::Bf16] {
        let y = dl(&dev(embedding::forward(
            Ids::Dev(&idd),
            P::Dev(&wd),
            vocab,
            h,
            dt,
        )
        .unwrap()));
        let cy = embedding::cpu::forward(&ids, &w, vocab, h).unwrap();
        assert_eq!(bits(&y), bits(&stored(&cy, dt)), "gather {dt:?}");
        let sdy = stored(&dy, dt);
        let dyd = Act::Dev(up(&g, &dy, dt));
        for accumulate in [false, true] {
            let run = || {
                let mut de = g
                    .upload(&if accumulate {
                        base.clone()
                    } else {
                        vec![f32::NAN; vocab * h]
                    })
                    .unwrap();
                embedding::backward(&ids, &dyd, vocab, h, PMut::Dev(&mut de), accumulate).unwrap();
                dlg(&de)
            };
            let got = run();
            assert_eq!(bits(&got), bits(&run()), "rerun");
            let mut want = base.clone();
            embedding::cpu::backward(&ids, &sdy, vocab, h, &mut want, accumulate).unwrap();
            // the same f32 additions in the same order: the same bits
            assert_eq!(bits(&got), bits(&want), "dE {dt:?} accumulate {accumulate}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_matches_cpu_and_reference() {
    let g = gpu();
    let mut r = rng(4);
    let (rows, v) = (1031, 517);
    let logits = normal(&mut r, rows * v, 3.0);
    let targets: Vec<i32> = (0..rows)
        .map(|i| {
            if i % 5 == 2 {
                cross_entropy::IGNORE_INDEX
            } else {
                ((i * 31) % v) as i32
            }
        })
        .collect();
    let td = g.upload(&targets).unwrap();
    for dt in [DType::F32, DType::Bf16] {
        let sl = stored(&logits, dt);
        let run = || {
            let ld = Act::Dev(up(&g, &logits, dt));
            let (st, p) = cross_entropy::forward(&ld, rows, v, Ids::Dev(&td), true).unwrap();
            let p = p.unwrap();
            let d = cross_entropy::backward(&p, rows, v, Ids::Dev(&td), st.count).unwrap();
            (st, dl(&dev(p)), dl(&dev(d)))
        };
        let (st, p, d) = run();
        let (st2, p2, d2) = run();
        assert_eq!(st, st2);
        assert_eq!((bits(&p), bits(&d)), (bits(&p2), bits(&d2)), "rerun");
        let (cst, cp) = cross_entropy::cpu::forward(&sl, rows, v, &targets, true).unwrap();
        let cd = cross_entropy::cpu::backward(&cp.clone().unwrap(), rows, v, &targets, cst.count)
            .unwrap();
        assert_eq!((st.count, st.correct), (cst.count, cst.correct), "{dt:?}");
        let e = (st.loss_sum - cst.loss_sum).abs() / cst.loss_sum;
        eprintln!("| cross_entropy | {dt:?} | loss_sum | rel vs CPU | {e:.2e} |");
        assert!(e < 1e-10, "loss sum {} vs {}", st.loss_sum, cst.loss_sum);
        let (_, _, wd) =
            cross_entropy::reference::forward_backward(&to_f64(&sl), rows, v, &targets);
        check("cross_entropy", dt, "dlogits", &d, &cd, &wd);
        let cp = cp.unwrap();
        check("cross_entropy", dt, "probs", &p, &cp, &to_f64(&cp));
    }
    let ld = Act::Dev(up(&g, &logits, DType::F32));
    let short = g.upload(&targets[1..]).unwrap();
    assert!(cross_entropy::forward(&ld, rows, v, Ids::Dev(&short), false).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_matches_cpu_bitwise_and_sums_of_squares() {
    let g = gpu();
    let mut r = rng(5);
    let n = 123_457;
    let p = normal(&mut r, n, 1.0);
    let m = normal(&mut r, n, 0.01);
    let v: Vec<f32> = normal(&mut r, n, 0.01).iter().map(|x| x * x).collect();
    let gr = normal(&mut r, n, 0.1);
    for scale in [None, Some(0.3f32)] {
        let h = adamw::Hyper {
            b1: 0.9,
            b2: 0.95,
            step_size: (1e-3 / (1.0 - 0.9f64.powi(5))) as f32,
            bc2_sqrt: (1.0 - 0.95f64.powi(5)).sqrt() as f32,
            eps: 1e-8,
            wd: 1e-5,
            grad_scale: scale,
        };
        let (mut pd, mut md, mut vd) = (
            g.upload(&p).unwrap(),
            g.upload(&m).unwrap(),
            g.upload(&v).unwrap(),
        );
        let gd = g.upload(&gr).unwrap();
        adamw::step(
            PMut::Dev(&mut pd),
            PMut::Dev(&mut md),
            PMut::Dev(&mut vd),
            P::Dev(&gd),
            &h,
        )
        .unwrap();
        let (mut pc, mut mc, mut vc) = (p.clone(), m.clone(), v.clone());
        adamw::cpu::step(&mut pc, &mut mc, &mut vc, &gr, &h).unwrap();
        assert_eq!(bits(&dlg(&pd)), bits(&pc), "p, scale {scale:?}");
        assert_eq!(bits(&dlg(&md)), bits(&mc), "m");
        assert_eq!(bits(&dlg(&vd)), bits(&vc), "v");
    }
    let (a, b) = (g.upload(&p).unwrap(), g.upload(&gr[..1000]).unwrap());
    let ss = adamw::sum_squares(&[P::Dev(&a), P::Dev(&b)]).unwrap();
    let ss2 = adamw::sum_squares(&[P::Dev(&a), P::Dev(&b)]).unwrap();
    assert_eq!(ss, ss2);
    let want = adamw::sum_squares(&[P::Host(&p), P::Host(&gr[..1000])]).unwrap();
    for k in 0..2 {
        assert!(
            (ss[k] - want[k]).abs() <= 1e-12 * want[k],
            "{} vs {}",
            ss[k],
            want[k]
        );
    }
}
