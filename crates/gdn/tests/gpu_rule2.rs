//! The CUDA GDN2 rule against the CPU op (f32 storage) and the f64 recurrence (bf16 storage),
//! with poisoned outputs and workspaces, exact-zero padding rows (packed sequences with empty and
//! length-1 ones) and bitwise reproducibility. The chunked forward (the default) is also checked
//! on its own against the f64 recurrence and the token-recurrence kernel (`gdn2_chunked_*`), and
//! so is the chunked backward (`gdn2_chunked_bwd_*`, `Bwd::Chunked`, `Bwd::ChunkedTc`), and both
//! again with the tensor-core chunk prep g2c_prep8 (`gdn2_prep8_*`, `Prep::V8`); the fused
//! bf16 tensor-core forward (`gdn2_fwd8_*`, `Fwd::V8`). Run on the device machine with
//! `--include-ignored --nocapture`: every check prints one line (`gdn2-check ...`).

use std::sync::Arc;

use gdn::device::cuda::{self, DBuf, DType, GBuf, Gpu};
use gdn::ops::gdn2_rule::cuda::{
    backward as backward_cuda, backward_with, chunked_supports, forward as forward_cuda,
    forward_with, fwd8_supports, prep_outputs, set_poison, v4_supports, v5_supports, with_prep,
    Bwd, Fwd, Prep,
};
use gdn::ops::gdn2_rule::reference::{self, RefInputs};
use gdn::ops::gdn2_rule::{self as g2, RuleOpts, RuleShape};
use gdn::testutil::{max_rel_err as max_rel, rms_rel_err as rms_rel};
use gdn::Seqs;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

struct Case {
    name: String,
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

fn normal(rng: &mut ChaCha8Rng, n: usize, s: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            s * z as f32
        })
        .collect()
}

fn bf16r(x: &mut [f32]) {
    for a in x {
        *a = half::bf16::from_f32(*a).to_f32();
    }
}

/// Random inputs: g = logsigmoid(randn) per key channel, b and w in (0, 1). Without the in-kernel
/// norm, q and k rows are unit-norm. With `bf16`, every input is rounded to bf16 first.
fn case(
    name: &str,
    seqs: Seqs,
    shape: RuleShape,
    norm_in_kernel: bool,
    with_states: bool,
    seed: u64,
    bf16: bool,
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
    let mut v = normal(&mut rng, n * hv * dv, 1.0);
    let g: Vec<f32> = (0..n * hv * dk)
        .map(|_| {
            let z: f64 = StandardNormal.sample(&mut rng);
            -((-z).exp().ln_1p()) as f32
        })
        .collect();
    let mut b: Vec<f32> = (0..n * hv * dk)
        .map(|_| rng.gen_range(0.0f32..1.0))
        .collect();
    let mut w: Vec<f32> = (0..n * hv * dv)
        .map(|_| rng.gen_range(0.0f32..1.0))
        .collect();
    let mut d_o = normal(&mut rng, n * hv * dv, 1.0);
    let st = seqs.count() * hv * dk * dv;
    let h0 = with_states.then(|| normal(&mut rng, st, 0.5));
    let dht = with_states.then(|| normal(&mut rng, st, 0.5));
    if bf16 {
        for x in [&mut q, &mut k, &mut v, &mut b, &mut w, &mut d_o] {
            bf16r(x);
        }
    }
    Case {
        name: name.to_string(),
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
        opts: RuleOpts {
            scale: 1.0 / (dk as f32).sqrt(),
            l2norm_in_kernel: norm_in_kernel,
        },
    }
}

struct Out {
    o: Vec<f32>,
    fin: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    dg: Vec<f32>,
    db: Vec<f32>,
    dw: Vec<f32>,
    dh0: Option<Vec<f32>>,
}

impl Out {
    fn fields(&self) -> Vec<(&'static str, &[f32])> {
        let mut f: Vec<(&'static str, &[f32])> = vec![
            ("o", &self.o),
            ("final_state", &self.fin),
            ("dq", &self.dq),
            ("dk", &self.dk),
            ("dv", &self.dv),
            ("dg", &self.dg),
            ("db", &self.db),
            ("dw", &self.dw),
        ];
        if let Some(d) = &self.dh0 {
            f.push(("dh0", d));
        }
        f
    }
    fn bits(&self) -> Vec<u32> {
        self.fields()
            .iter()
            .flat_map(|(_, x)| x.iter().map(|a| a.to_bits()))
            .collect()
    }
}

fn gpu() -> Arc<Gpu> {
    set_poison(true);
    cuda::gpu(0).expect("a CUDA GPU")
}

fn run_gpu(gpu: &Arc<Gpu>, c: &Case, dt: DType) -> Out {
    let up = |x: &[f32]| DBuf::upload(gpu, x, dt).unwrap();
    let up32 = |x: &[f32]| -> GBuf<f32> { gpu.upload(x).unwrap() };
    let (q, k, v, b, w, d_o) = (up(&c.q), up(&c.k), up(&c.v), up(&c.b), up(&c.w), up(&c.d_o));
    let g = up32(&c.g);
    let h0 = c.h0.as_deref().map(up32);
    let dht = c.dht.as_deref().map(up32);
    let (o, fin) = forward_cuda(
        gpu,
        &q,
        &k,
        &v,
        &g,
        &b,
        &w,
        &c.seqs,
        c.shape,
        c.opts,
        h0.as_ref(),
        true,
    )
    .unwrap();
    let gr = backward_cuda(
        gpu,
        &q,
        &k,
        &v,
        &g,
        &b,
        &w,
        &c.seqs,
        c.shape,
        c.opts,
        h0.as_ref(),
        &d_o,
        dht.as_ref(),
    )
    .unwrap();
    assert_eq!(o.dtype(), dt);
    assert_eq!(gr.dq.dtype(), dt);
    assert_eq!(gr.dh0.is_some(), c.h0.is_some());
    Out {
        o: o.download().unwrap(),
        fin: gpu.download(fin.as_ref().unwrap()).unwrap(),
        dq: gr.dq.download().unwrap(),
        dk: gr.dk.download().unwrap(),
        dv: gr.dv.download().unwrap(),
        dg: gpu.download(&gr.dg).unwrap(),
        db: gr.db.download().unwrap(),
        dw: gr.dw.download().unwrap(),
        dh0: gr.dh0.as_ref().map(|d| gpu.download(d).unwrap()),
    }
}

fn run_cpu(c: &Case) -> Out {
    let (o, fin) = g2::cpu::forward(
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
    .unwrap();
    let gr = g2::cpu::backward(
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
    .unwrap();
    Out {
        o,
        fin: fin.unwrap(),
        dq: gr.dq,
        dk: gr.dk,
        dv: gr.dv,
        dg: gr.dg,
        db: gr.db,
        dw: gr.dw,
        dh0: gr.dh0,
    }
}

fn run_ref(c: &Case) -> Vec<(&'static str, Vec<f64>)> {
    let f = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (q, k, v, g, b, w, d_o) = (
        f(&c.q),
        f(&c.k),
        f(&c.v),
        f(&c.g),
        f(&c.b),
        f(&c.w),
        f(&c.d_o),
    );
    let h0 = c.h0.as_deref().map(f);
    let dht = c.dht.as_deref().map(f);
    let inp = RefInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        b: &b,
        w: &w,
        cu: c.seqs.cu(),
        tokens: c.seqs.tokens(),
        shape: c.shape,
        scale: c.opts.scale as f64,
        l2norm_in_kernel: c.opts.l2norm_in_kernel,
        h0: h0.as_deref(),
    };
    let (o, fin) = reference::forward(&inp);
    let gr = reference::backward(&inp, &d_o, dht.as_deref());
    let mut out = vec![
        ("o", o),
        ("final_state", fin),
        ("dq", gr.dq),
        ("dk", gr.dk),
        ("dv", gr.dv),
        ("dg", gr.dg),
        ("db", gr.db),
        ("dw", gr.dw),
    ];
    if c.h0.is_some() {
        out.push(("dh0", gr.dh0));
    }
    out
}

/// Every element finite (poisoned buffers are NaN where unwritten) and padding rows exactly 0.
fn check_written(c: &Case, out: &Out, fails: &mut Vec<String>) {
    let used = c.seqs.used();
    let s = c.shape;
    let width = |name: &str| match name {
        "o" | "dv" | "dw" => Some(s.hv * s.dv),
        "dq" | "dk" => Some(s.hk * s.dk),
        "dg" | "db" => Some(s.hv * s.dk),
        _ => None,
    };
    for (name, x) in out.fields() {
        if let Some(i) = x.iter().position(|a| !a.is_finite()) {
            fails.push(format!(
                "{}: {name}[{i}] = {} (unwritten or non-finite)",
                c.name, x[i]
            ));
        }
        if let Some(w) = width(name) {
            if x[used * w..].iter().any(|&a| a != 0.0) {
                fails.push(format!("{}: {name} padding rows are not zero", c.name));
            }
        }
    }
}

fn check_f32(gpu: &Arc<Gpu>, c: &Case, tol: f64, fails: &mut Vec<String>) {
    let out = run_gpu(gpu, c, DType::F32);
    check_written(c, &out, fails);
    let cpu = run_cpu(c);
    let rf = run_ref(c);
    let mut line = format!("gdn2-check f32-vs-cpu {:<30}", c.name);
    let mut line_ref = format!("gdn2-check f32-vs-f64 {:<30}", c.name);
    for ((name, x), ((_, y), (_, r))) in out
        .fields()
        .into_iter()
        .zip(cpu.fields().into_iter().zip(&rf))
    {
        let y64: Vec<f64> = y.iter().map(|&a| a as f64).collect();
        // A field whose exact value is zero everywhere (dg at T = 1 without an initial state) has
        // no scale: the CPU op leaves rounding noise there, so check it against zero absolutely.
        let e = if r.iter().all(|&a| a == 0.0) {
            x.iter().fold(0.0f64, |m, &a| m.max(a.abs() as f64))
        } else {
            max_rel(x, &y64)
        };
        let er = max_rel(x, r);
        let ec = max_rel(y, r);
        line += &format!(" {name}={e:.1e}");
        line_ref += &format!(" {name}={er:.1e}(cpu {ec:.1e})");
        if e.is_nan() || e > tol {
            fails.push(format!(
                "{}: f32 {name} vs CPU: {e:.3e} > {tol:.0e}",
                c.name
            ));
        }
    }
    println!("{line}");
    println!("{line_ref}");
}

fn check_bf16(gpu: &Arc<Gpu>, c: &Case, fails: &mut Vec<String>) {
    let out = run_gpu(gpu, c, DType::Bf16);
    check_written(c, &out, fails);
    let rf = run_ref(c);
    let mut line = format!("gdn2-check bf16-vs-f64 {:<29}", c.name);
    for ((name, x), (_, r)) in out.fields().into_iter().zip(&rf) {
        let e = rms_rel(x, r);
        let tol = match name {
            "dg" | "db" | "dw" => 0.02,
            _ => 0.005,
        };
        line += &format!(" {name}={e:.2e}");
        if e.is_nan() || e > tol {
            fails.push(format!("{}: bf16 {name}: RMS rel {e:.3e} > {tol}", c.name));
        }
    }
    println!("{line}");
}

fn finish(fails: Vec<String>) {
    assert!(fails.is_empty(), "failures:\n{}", fails.join("\n"));
}

fn sh(hk: usize, hv: usize, dk: usize, dv: usize) -> RuleShape {
    RuleShape { hk, hv, dk, dv }
}

fn packed() -> Seqs {
    Seqs::packed(&[0, 0, 1, 64, 128, 193, 193, 260], 265).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_f32_matches_cpu_op() {
    let gpu = gpu();
    let mut fails = Vec::new();
    let cases = vec![
        case(
            "T1 1/1 d16",
            Seqs::uniform(1, 1),
            sh(1, 1, 16, 16),
            false,
            false,
            1,
            false,
        ),
        case(
            "T65 2/2 d64x48",
            Seqs::uniform(1, 65),
            sh(2, 2, 64, 48),
            false,
            true,
            2,
            false,
        ),
        case(
            "T200 1/2 d32x64 norm",
            Seqs::uniform(2, 200),
            sh(1, 2, 32, 64),
            true,
            true,
            3,
            false,
        ),
        case(
            "packed 2/4 d64 norm",
            packed(),
            sh(2, 4, 64, 64),
            true,
            true,
            4,
            false,
        ),
        case(
            "T130 1/1 d128 norm",
            Seqs::uniform(1, 130),
            sh(1, 1, 128, 128),
            true,
            false,
            5,
            false,
        ),
    ];
    for c in &cases {
        check_f32(&gpu, c, 1e-5, &mut fails);
    }
    finish(fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_bf16_matches_f64_reference() {
    let gpu = gpu();
    let mut fails = Vec::new();
    let cases = vec![
        case(
            "T1 1/1 d16",
            Seqs::uniform(1, 1),
            sh(1, 1, 16, 16),
            true,
            false,
            11,
            true,
        ),
        case(
            "T300 2/4 d64 norm",
            Seqs::uniform(1, 300),
            sh(2, 4, 64, 64),
            true,
            true,
            12,
            true,
        ),
        case(
            "packed 1/2 d128 norm",
            packed(),
            sh(1, 2, 128, 128),
            true,
            true,
            13,
            true,
        ),
        case(
            "packed 2/2 d32x48",
            packed(),
            sh(2, 2, 32, 48),
            false,
            true,
            14,
            true,
        ),
    ];
    for c in &cases {
        check_bf16(&gpu, c, &mut fails);
    }
    finish(fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_two_runs_are_bitwise_identical() {
    let gpu = gpu();
    for (dt, bf) in [(DType::Bf16, true), (DType::F32, false)] {
        let c = case(
            "bitwise",
            Seqs::packed(&[0, 0, 1, 100, 300], 303).unwrap(),
            sh(2, 4, 64, 64),
            true,
            true,
            41,
            bf,
        );
        let a = run_gpu(&gpu, &c, dt);
        let b = run_gpu(&gpu, &c, dt);
        let same = a.bits() == b.bits();
        println!("gdn2-check bitwise {dt:?}: identical={same}");
        assert!(same, "{dt:?}: two runs differ");
    }
}

// ---- the chunked forward (issue 17) against the f64 recurrence and the recurrence kernel ----

/// Forward only, with the chosen kernels: (o, final state).
fn fwd_gpu(gpu: &Arc<Gpu>, c: &Case, dt: DType, fwd: Fwd) -> (Vec<f32>, Vec<f32>) {
    let up = |x: &[f32]| DBuf::upload(gpu, x, dt).unwrap();
    let up32 = |x: &[f32]| -> GBuf<f32> { gpu.upload(x).unwrap() };
    let (q, k, v, b, w) = (up(&c.q), up(&c.k), up(&c.v), up(&c.b), up(&c.w));
    let g = up32(&c.g);
    let h0 = c.h0.as_deref().map(up32);
    let (o, fin) = forward_with(
        gpu,
        fwd,
        &q,
        &k,
        &v,
        &g,
        &b,
        &w,
        &c.seqs,
        c.shape,
        c.opts,
        h0.as_ref(),
        true,
    )
    .unwrap();
    assert_eq!(o.dtype(), dt);
    (
        o.download().unwrap(),
        gpu.download(fin.as_ref().unwrap()).unwrap(),
    )
}

/// The f64 recurrence's (o, final state).
fn ref_fwd(c: &Case) -> (Vec<f64>, Vec<f64>) {
    let f = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (q, k, v, g, b, w) = (f(&c.q), f(&c.k), f(&c.v), f(&c.g), f(&c.b), f(&c.w));
    let h0 = c.h0.as_deref().map(f);
    let inp = RefInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        b: &b,
        w: &w,
        cu: c.seqs.cu(),
        tokens: c.seqs.tokens(),
        shape: c.shape,
        scale: c.opts.scale as f64,
        l2norm_in_kernel: c.opts.l2norm_in_kernel,
        h0: h0.as_deref(),
    };
    reference::forward(&inp)
}

/// Strongly decaying gates on every other key channel (g = 20 logsigmoid(z) - 10: a 64-token
/// chunk decays by e^-1000 and more, which overflows any whole-chunk e^-Gam), nearly no decay on
/// the others (g = logsigmoid(z) / 20).
fn strong(mut c: Case) -> Case {
    let dk = c.shape.dk;
    for (i, g) in c.g.iter_mut().enumerate() {
        *g = if (i % dk).is_multiple_of(2) {
            20.0 * *g - 10.0
        } else {
            *g / 20.0
        };
    }
    c.name += " strong";
    c
}

/// The chunked forward's cases: Dk 16 .. 256 (256: the recurrence fallback), Dv 48 / 128, GVA 1 /
/// 2, T 1 .. 300 with partial chunks, states, packed sequences with empty and length-1 ones and
/// padding, in-kernel and caller-side l2norm, strongly decaying gates.
fn chunked_cases(bf16: bool) -> Vec<Case> {
    let s = if bf16 { 100 } else { 200 };
    vec![
        case(
            "T1 1/1 d64",
            Seqs::uniform(1, 1),
            sh(1, 1, 64, 64),
            false,
            false,
            s + 1,
            bf16,
        ),
        case(
            "T63 1/2 d128 norm",
            Seqs::uniform(1, 63),
            sh(1, 2, 128, 128),
            true,
            true,
            s + 2,
            bf16,
        ),
        case(
            "T64x2 2/2 d64x48",
            Seqs::uniform(2, 64),
            sh(2, 2, 64, 48),
            false,
            true,
            s + 3,
            bf16,
        ),
        case(
            "T65 1/1 d128x48 norm",
            Seqs::uniform(1, 65),
            sh(1, 1, 128, 48),
            true,
            false,
            s + 4,
            bf16,
        ),
        case(
            "T300 1/2 d128 norm",
            Seqs::uniform(1, 300),
            sh(1, 2, 128, 128),
            true,
            true,
            s + 5,
            bf16,
        ),
        case(
            "packed 2/4 d64 norm",
            packed(),
            sh(2, 4, 64, 64),
            true,
            true,
            s + 6,
            bf16,
        ),
        case(
            "packed 1/2 d128x48",
            packed(),
            sh(1, 2, 128, 48),
            false,
            true,
            s + 7,
            bf16,
        ),
        case(
            "T100 1/1 d16",
            Seqs::uniform(1, 100),
            sh(1, 1, 16, 16),
            true,
            true,
            s + 8,
            bf16,
        ),
        case(
            "T90 1/2 d32x48",
            Seqs::uniform(1, 90),
            sh(1, 2, 32, 48),
            false,
            false,
            s + 9,
            bf16,
        ),
        strong(case(
            "T200x2 2/2 d64x128",
            Seqs::uniform(2, 200),
            sh(2, 2, 64, 128),
            true,
            true,
            s + 10,
            bf16,
        )),
        strong(case(
            "packed 1/2 d128",
            packed(),
            sh(1, 2, 128, 128),
            true,
            true,
            s + 11,
            bf16,
        )),
        case(
            "T70 1/1 d256 fallback",
            Seqs::uniform(1, 70),
            sh(1, 1, 256, 64),
            true,
            true,
            s + 12,
            bf16,
        ),
    ]
}

/// Finite everywhere, padding rows of o exactly zero.
fn check_fwd_written(c: &Case, o: &[f32], fin: &[f32], what: &str, fails: &mut Vec<String>) {
    let w = c.shape.hv * c.shape.dv;
    for (name, x) in [("o", o), ("final_state", fin)] {
        if let Some(i) = x.iter().position(|a| !a.is_finite()) {
            fails.push(format!(
                "{} {what}: {name}[{i}] = {} (unwritten or non-finite)",
                c.name, x[i]
            ));
        }
    }
    if o[c.seqs.used() * w..].iter().any(|&a| a != 0.0) {
        fails.push(format!("{} {what}: o padding rows are not zero", c.name));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_f32_matches_f64_and_recurrence() {
    let gpu = gpu();
    let mut fails = Vec::new();
    for c in &chunked_cases(false) {
        let (o, fin) = fwd_gpu(&gpu, c, DType::F32, Fwd::Chunked);
        let (ro, rfin) = fwd_gpu(&gpu, c, DType::F32, Fwd::Recurrent);
        check_fwd_written(c, &o, &fin, "chunked f32", &mut fails);
        check_fwd_written(c, &ro, &rfin, "recurrent f32", &mut fails);
        let (fo, ffin) = ref_fwd(c);
        let f64s = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let mut line = format!("gdn2-check chunked-f32 {:<30}", c.name);
        for (name, x, r, f) in [("o", &o, &ro, &fo), ("final_state", &fin, &rfin, &ffin)] {
            let e = max_rel(x, f);
            let er = max_rel(r, f);
            let ecr = max_rel(x, &f64s(r));
            line +=
                &format!(" {name}: vs-f64={e:.1e} (recurrence {er:.1e}) vs-recurrence={ecr:.1e}");
            if e.is_nan() || e > 5e-6 {
                fails.push(format!(
                    "{}: chunked f32 {name} vs f64: {e:.3e} > 5e-6",
                    c.name
                ));
            }
            if ecr.is_nan() || ecr > 1e-5 {
                fails.push(format!(
                    "{}: chunked f32 {name} vs recurrence: {ecr:.3e} > 1e-5",
                    c.name
                ));
            }
        }
        if !chunked_supports(c.shape) && (o != ro || fin != rfin) {
            fails.push(format!("{}: the fallback is not the recurrence", c.name));
        }
        println!("{line}");
    }
    finish(fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bf16_matches_f64() {
    let gpu = gpu();
    let mut fails = Vec::new();
    for c in &chunked_cases(true) {
        let (o, fin) = fwd_gpu(&gpu, c, DType::Bf16, Fwd::Chunked);
        let (ro, rfin) = fwd_gpu(&gpu, c, DType::Bf16, Fwd::Recurrent);
        check_fwd_written(c, &o, &fin, "chunked bf16", &mut fails);
        let (fo, ffin) = ref_fwd(c);
        let mut line = format!("gdn2-check chunked-bf16 {:<29}", c.name);
        for (name, x, r, f) in [("o", &o, &ro, &fo), ("final_state", &fin, &rfin, &ffin)] {
            let e = rms_rel(x, f);
            let er = rms_rel(r, f);
            line += &format!(" {name}={e:.2e} (recurrence {er:.2e})");
            if e.is_nan() || e > 5e-3 {
                fails.push(format!(
                    "{}: chunked bf16 {name}: RMS rel {e:.3e} > 5e-3",
                    c.name
                ));
            }
        }
        println!("{line}");
    }
    finish(fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_two_runs_are_bitwise_identical() {
    let gpu = gpu();
    for (dt, bf) in [(DType::Bf16, true), (DType::F32, false)] {
        let c = strong(case(
            "bitwise",
            Seqs::packed(&[0, 0, 1, 100, 300], 303).unwrap(),
            sh(1, 2, 128, 128),
            true,
            true,
            43,
            bf,
        ));
        let a = fwd_gpu(&gpu, &c, dt, Fwd::Chunked);
        let b = fwd_gpu(&gpu, &c, dt, Fwd::Chunked);
        let bits = |x: &(Vec<f32>, Vec<f32>)| {
            x.0.iter()
                .chain(&x.1)
                .map(|a| a.to_bits())
                .collect::<Vec<u32>>()
        };
        let same = bits(&a) == bits(&b);
        println!("gdn2-check chunked-bitwise {dt:?}: identical={same}");
        assert!(same, "{dt:?}: two runs of the chunked forward differ");
    }
}

// ---- the tensor-core chunk prep g2c_prep8 (GDN_RULE2_PREP=v8, `with_prep(Prep::V8, ..)`) ----

/// The chunked forward's f32 test (same cases, same tolerances) with g2c_prep8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_prep8_chunked_f32_matches_f64_and_recurrence() {
    with_prep(Prep::V8, gdn2_chunked_f32_matches_f64_and_recurrence);
}

/// The chunked forward's bf16 test with g2c_prep8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_prep8_chunked_bf16_matches_f64() {
    with_prep(Prep::V8, gdn2_chunked_bf16_matches_f64);
}

/// The chunked backward's f32 test with g2c_prep8 in the backward's recompute.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_prep8_chunked_bwd_f32_matches_f64_and_recurrence() {
    with_prep(Prep::V8, gdn2_chunked_bwd_f32_matches_f64_and_recurrence);
}

/// The chunked backward's bf16 tests (fp32 and TF32 gradient kernels) with g2c_prep8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_prep8_chunked_bwd_bf16_matches_f64() {
    with_prep(Prep::V8, || {
        check_chunked_bwd_bf16(Bwd::Chunked, "prep8-chunked-bwd-bf16");
        check_chunked_bwd_bf16(Bwd::ChunkedTc, "prep8-chunked-bwd-tc-bf16");
    });
}

/// The forward and backward bitwise tests with g2c_prep8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_prep8_two_runs_are_bitwise_identical() {
    with_prep(Prep::V8, || {
        gdn2_chunked_two_runs_are_bitwise_identical();
        gdn2_chunked_bwd_two_runs_are_bitwise_identical();
    });
}

/// g2c_prep8's outputs (U, Wm, Qg, Kd^T, A, e^Gam_L, T) against g2c_prep's on the chunked
/// cases, f32 and bf16 storage: every element written (poisoned workspaces), RMS-relative
/// difference per output <= 2e-5 (both are fp32 math; prep8's products are 3xTF32), two prep8
/// runs bit for bit equal, and prep8 not bit for bit prep (else it did not run).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_prep8_outputs_match_prep() {
    let gpu = gpu();
    let mut fails = Vec::new();
    for (dt, bf) in [(DType::F32, false), (DType::Bf16, true)] {
        for c in chunked_cases(bf)
            .into_iter()
            .filter(|c| chunked_supports(c.shape))
        {
            let up = |x: &[f32]| DBuf::upload(&gpu, x, dt).unwrap();
            let (q, k, v, b, w) = (up(&c.q), up(&c.k), up(&c.v), up(&c.b), up(&c.w));
            let g: GBuf<f32> = gpu.upload(&c.g).unwrap();
            let run = |p: Prep| {
                prep_outputs(&gpu, p, &q, &k, &v, &g, &b, &w, &c.seqs, c.shape, c.opts).unwrap()
            };
            let (r1, r8, r8b) = (run(Prep::V1), run(Prep::V8), run(Prep::V8));
            let mut line = format!("gdn2-check prep8-vs-prep {dt:?} {:<28}", c.name);
            let mut differs = false;
            for (((name, x1), (_, x8)), (_, y8)) in r1.iter().zip(&r8).zip(&r8b) {
                if let Some(i) = x8.iter().position(|a| !a.is_finite()) {
                    fails.push(format!(
                        "{} {dt:?}: prep8 {name}[{i}] = {} (unwritten or non-finite)",
                        c.name, x8[i]
                    ));
                }
                let f64s = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
                let e = rms_rel(x8, &f64s(x1));
                line += &format!(" {name}={e:.1e}");
                if e.is_nan() || e > 2e-5 {
                    fails.push(format!(
                        "{} {dt:?}: prep8 {name} vs prep: RMS rel {e:.3e} > 2e-5",
                        c.name
                    ));
                }
                let bits = |x: &[f32]| x.iter().map(|a| a.to_bits()).collect::<Vec<u32>>();
                if bits(x8) != bits(y8) {
                    fails.push(format!(
                        "{} {dt:?}: two prep8 runs differ in {name}",
                        c.name
                    ));
                }
                differs |= bits(x8) != bits(x1);
            }
            if !differs {
                fails.push(format!(
                    "{} {dt:?}: prep8 is bit for bit prep (did it run?)",
                    c.name
                ));
            }
            println!("{line}");
        }
    }
    finish(fails);
}

// ---- the fused bf16 tensor-core forward g2f_fwd8 (GDN_RULE2_FWD=v8, `Fwd::V8`) ----

/// Mild gates (g / 20 on every key channel: a 64-token chunk decays by ~e^-2.5, so the state
/// carries across chunks and e^Gam_L's per-channel scale of the state matters).
fn mild(mut c: Case) -> Case {
    c.g.iter_mut().for_each(|g| *g /= 20.0);
    c.name += " mild";
    c
}

/// The chunked bf16 cases plus GVA 4, Dk 64 with Dv 128, T 1 at Dk 128, one chunk boundary
/// exactly at 64 with states, mild gates, and a long single sequence (many chunk steps).
fn fwd8_cases() -> Vec<Case> {
    let mut v = chunked_cases(true);
    v.push(mild(case(
        "T300 1/2 d128",
        Seqs::uniform(1, 300),
        sh(1, 2, 128, 128),
        true,
        true,
        310,
        true,
    )));
    v.push(mild(case(
        "packed 1/2 d64x128",
        packed(),
        sh(1, 2, 64, 128),
        false,
        true,
        316,
        true,
    )));
    v.push(case(
        "T130 1/4 d128 norm",
        Seqs::uniform(1, 130),
        sh(1, 4, 128, 128),
        true,
        true,
        311,
        true,
    ));
    v.push(case(
        "T1 2/2 d128",
        Seqs::uniform(1, 1),
        sh(2, 2, 128, 128),
        false,
        true,
        312,
        true,
    ));
    v.push(case(
        "T64x3 1/4 d64x128 norm",
        Seqs::uniform(3, 64),
        sh(1, 4, 64, 128),
        true,
        true,
        313,
        true,
    ));
    v.push(strong(case(
        "packed 2/4 d128x64 norm",
        packed(),
        sh(2, 4, 128, 64),
        true,
        true,
        314,
        true,
    )));
    v.push(case(
        "T2000 1/1 d128",
        Seqs::uniform(1, 2000),
        sh(1, 1, 128, 128),
        true,
        true,
        315,
        true,
    ));
    v
}

/// g2f_fwd8 (and g2f_fwd8x, `split`) against the f64 recurrence at every CTA width that divides
/// Dv (0: the model's pick),
/// bf16 storage: o and the final state RMS-relative <= 5e-3 (the chunked bf16 test's bound; the
/// chunked forward's error printed beside), every output written (poisoned), padding rows zero,
/// and not bit for bit the chunked forward (else it did not run). Unsupported shapes (Dk 16 / 32
/// / 256) must give exactly the chunked forward's bits (the fallback).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_fwd8_matches_f64() {
    let gpu = gpu();
    let mut fails = Vec::new();
    for c in &fwd8_cases() {
        let (co, cfin) = fwd_gpu(&gpu, c, DType::Bf16, Fwd::Chunked);
        let (fo, ffin) = ref_fwd(c);
        if !fwd8_supports(DType::Bf16, c.shape) {
            let (o, fin) = fwd_gpu(
                &gpu,
                c,
                DType::Bf16,
                Fwd::V8 {
                    warps: 0,
                    split: false,
                },
            );
            let same = o == co && fin == cfin;
            println!("gdn2-check fwd8 {:<30} fallback to chunked: {same}", c.name);
            if !same {
                fails.push(format!(
                    "{}: fwd8's fallback is not the chunked forward",
                    c.name
                ));
            }
            continue;
        }
        let (eo, efin) = (rms_rel(&co, &fo), rms_rel(&cfin, &ffin));
        for (warps, split) in [
            (0, false),
            (1, false),
            (2, false),
            (4, false),
            (8, false),
            (0, true),
            (1, true),
            (2, true),
            (4, true),
        ] {
            if warps > 0 && !c.shape.dv.is_multiple_of(16 * warps) {
                continue;
            }
            let (o, fin) = fwd_gpu(&gpu, c, DType::Bf16, Fwd::V8 { warps, split });
            let what = format!("fwd8{} w{warps}", if split { "x" } else { "" });
            check_fwd_written(c, &o, &fin, &what, &mut fails);
            let mut line = format!("gdn2-check {what} {:<30}", c.name);
            for (name, x, f, ec) in [("o", &o, &fo, eo), ("final_state", &fin, &ffin, efin)] {
                let e = rms_rel(x, f);
                line += &format!(" {name}={e:.2e} (chunked {ec:.2e})");
                if e.is_nan() || e > 5e-3 {
                    fails.push(format!("{} {what}: {name}: RMS rel {e:.3e} > 5e-3", c.name));
                }
            }
            if o == co {
                fails.push(format!(
                    "{} {what}: o is bit for bit the chunked forward's (did fwd8 run?)",
                    c.name
                ));
            }
            println!("{line}");
        }
    }
    finish(fails);
}

/// g2f_fwd8 twice on the same inputs (every width): the same bits; g2f_fwd8x (split) the same
/// bits as g2f_fwd8 at the same width (same products, same orders); f32 storage and Dk 32 fall
/// back to the chunked forward bit for bit; the environment choice `Fwd::from_env` is not V8
/// unless asked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_fwd8_bitwise_and_fallback() {
    let gpu = gpu();
    let c = strong(case(
        "bitwise",
        Seqs::packed(&[0, 0, 1, 100, 300], 303).unwrap(),
        sh(1, 2, 128, 128),
        true,
        true,
        43,
        true,
    ));
    let bits = |x: &(Vec<f32>, Vec<f32>)| {
        x.0.iter()
            .chain(&x.1)
            .map(|a| a.to_bits())
            .collect::<Vec<u32>>()
    };
    for warps in [0, 1, 2, 4, 8] {
        let v8 = |split| Fwd::V8 { warps, split };
        let a = fwd_gpu(&gpu, &c, DType::Bf16, v8(false));
        let b = fwd_gpu(&gpu, &c, DType::Bf16, v8(false));
        let same = bits(&a) == bits(&b);
        println!("gdn2-check fwd8-bitwise w{warps}: identical={same}");
        assert!(same, "w{warps}: two runs of fwd8 differ");
        if warps > 0 && warps <= 4 {
            let x = fwd_gpu(&gpu, &c, DType::Bf16, v8(true));
            let y = fwd_gpu(&gpu, &c, DType::Bf16, v8(true));
            let (sx, sy) = (bits(&x) == bits(&a), bits(&x) == bits(&y));
            println!("gdn2-check fwd8x-bitwise w{warps}: = fwd8 {sx}, reruns identical {sy}");
            assert!(
                sx && sy,
                "w{warps}: fwd8x differs from fwd8 or between runs"
            );
        }
    }
    let cf = strong(case(
        "fallback f32",
        Seqs::packed(&[0, 0, 1, 100, 300], 303).unwrap(),
        sh(1, 2, 128, 128),
        true,
        true,
        44,
        false,
    ));
    let v80 = Fwd::V8 {
        warps: 0,
        split: false,
    };
    let a = fwd_gpu(&gpu, &cf, DType::F32, v80);
    let b = fwd_gpu(&gpu, &cf, DType::F32, Fwd::Chunked);
    println!(
        "gdn2-check fwd8-fallback f32: identical={}",
        bits(&a) == bits(&b)
    );
    assert!(
        bits(&a) == bits(&b),
        "f32 storage: fwd8 is not the chunked forward"
    );
    let cd = case(
        "fallback d32",
        Seqs::uniform(1, 90),
        sh(1, 2, 32, 48),
        true,
        true,
        45,
        true,
    );
    let a = fwd_gpu(&gpu, &cd, DType::Bf16, v80);
    let b = fwd_gpu(&gpu, &cd, DType::Bf16, Fwd::Chunked);
    println!(
        "gdn2-check fwd8-fallback d32: identical={}",
        bits(&a) == bits(&b)
    );
    assert!(
        bits(&a) == bits(&b),
        "Dk 32: fwd8 is not the chunked forward"
    );
    if std::env::var_os("GDN_RULE2_FWD").is_none()
        && std::env::var_os("GDN_RULE2").is_none()
        && std::env::var_os("GDN_RULE2_V8_WARPS").is_none()
    {
        // the default since 2026-12-02: the fused forward
        assert_eq!(Fwd::from_env(), v80);
    }
}

// ---- the chunked backward (issue 17) against the f64 recurrence and the recurrence kernel ----

/// Backward only, with the chosen kernels: (name, gradient) in the order of `Out::fields`
/// (dq, dk, dv, dg, db, dw, then dh0 when there are initial states).
fn bwd_gpu(gpu: &Arc<Gpu>, c: &Case, dt: DType, bwd: Bwd) -> Vec<(&'static str, Vec<f32>)> {
    let up = |x: &[f32]| DBuf::upload(gpu, x, dt).unwrap();
    let up32 = |x: &[f32]| -> GBuf<f32> { gpu.upload(x).unwrap() };
    let (q, k, v, b, w, d_o) = (up(&c.q), up(&c.k), up(&c.v), up(&c.b), up(&c.w), up(&c.d_o));
    let g = up32(&c.g);
    let h0 = c.h0.as_deref().map(up32);
    let dht = c.dht.as_deref().map(up32);
    let gr = backward_with(
        gpu,
        bwd,
        &q,
        &k,
        &v,
        &g,
        &b,
        &w,
        &c.seqs,
        c.shape,
        c.opts,
        h0.as_ref(),
        &d_o,
        dht.as_ref(),
    )
    .unwrap();
    assert_eq!(gr.dq.dtype(), dt);
    assert_eq!(gr.db.dtype(), dt);
    assert_eq!(gr.dh0.is_some(), c.h0.is_some());
    let mut out = vec![
        ("dq", gr.dq.download().unwrap()),
        ("dk", gr.dk.download().unwrap()),
        ("dv", gr.dv.download().unwrap()),
        ("dg", gpu.download(&gr.dg).unwrap()),
        ("db", gr.db.download().unwrap()),
        ("dw", gr.dw.download().unwrap()),
    ];
    if let Some(d) = &gr.dh0 {
        out.push(("dh0", gpu.download(d).unwrap()));
    }
    out
}

/// The f64 recurrence's gradients, same order as [`bwd_gpu`].
fn ref_bwd(c: &Case) -> Vec<(&'static str, Vec<f64>)> {
    run_ref(c)
        .into_iter()
        .filter(|(n, _)| *n != "o" && *n != "final_state")
        .collect()
}

/// Every element finite (the outputs are poisoned) and the padding rows exactly 0.
fn check_bwd_written(
    c: &Case,
    out: &[(&'static str, Vec<f32>)],
    what: &str,
    fails: &mut Vec<String>,
) {
    let s = c.shape;
    let used = c.seqs.used();
    for (name, x) in out {
        if let Some(i) = x.iter().position(|a| !a.is_finite()) {
            fails.push(format!(
                "{} {what}: {name}[{i}] = {} (unwritten or non-finite)",
                c.name, x[i]
            ));
        }
        let w = match *name {
            "dv" | "dw" => s.hv * s.dv,
            "dq" | "dk" => s.hk * s.dk,
            "dg" | "db" => s.hv * s.dk,
            _ => continue,
        };
        if x[used * w..].iter().any(|&a| a != 0.0) {
            fails.push(format!(
                "{} {what}: {name} padding rows are not zero",
                c.name
            ));
        }
    }
}

/// Largest |x| (the error measure where the exact gradient is zero everywhere, e.g. dg at T = 1
/// without an initial state: no relative scale exists there).
fn max_abs(x: &[f32]) -> f64 {
    x.iter().fold(0.0f64, |m, &a| m.max(a.abs() as f64))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_f32_matches_f64_and_recurrence() {
    let gpu = gpu();
    let mut fails = Vec::new();
    for c in &chunked_cases(false) {
        let ch = bwd_gpu(&gpu, c, DType::F32, Bwd::Chunked);
        let re = bwd_gpu(&gpu, c, DType::F32, Bwd::Recurrent);
        check_bwd_written(c, &ch, "chunked bwd f32", &mut fails);
        check_bwd_written(c, &re, "recurrent bwd f32", &mut fails);
        let rf = ref_bwd(c);
        assert_eq!(rf.len(), ch.len());
        let f64s = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let mut line = format!("gdn2-check chunked-bwd-f32 {:<30}", c.name);
        for (((name, x), (_, r)), (_, f)) in ch.iter().zip(&re).zip(&rf) {
            let zero = f.iter().all(|&a| a == 0.0);
            let (e, er, ecr) = if zero {
                (max_abs(x), max_abs(r), max_abs(x))
            } else {
                (max_rel(x, f), max_rel(r, f), max_rel(x, &f64s(r)))
            };
            line += &format!(" {name}: vs-f64={e:.1e} (recurrence {er:.1e}) vs-rec={ecr:.1e}");
            // Absolute where the exact value is 0; else relative to the field's largest value.
            let tol = if zero { 1e-6 } else { 2e-5f64.max(4.0 * er) };
            if e.is_nan() || e > tol {
                fails.push(format!(
                    "{}: chunked bwd f32 {name} vs f64: {e:.3e} > {tol:.1e}",
                    c.name
                ));
            }
            if !zero && (ecr.is_nan() || ecr > 2e-5f64.max(5.0 * er)) {
                fails.push(format!(
                    "{}: chunked bwd f32 {name} vs recurrence: {ecr:.3e}",
                    c.name
                ));
            }
        }
        if !chunked_supports(c.shape) && ch != re {
            fails.push(format!("{}: the fallback is not the recurrence", c.name));
        }
        println!("{line}");
    }
    finish(fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_bf16_matches_f64() {
    check_chunked_bwd_bf16(Bwd::Chunked, "chunked-bwd-bf16");
}

/// The opt-in TF32 tensor-core products in g2b_grad (`GDN_RULE2_GRAD=tc`): the same cases and
/// tolerances as the fp32 kernels' bf16 test (the recurrence's own error x 2, or the
/// recurrence's bf16 tolerances), poisoned outputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_tc_bf16_matches_f64() {
    check_chunked_bwd_bf16(Bwd::ChunkedTc, "chunked-bwd-tc-bf16");
}

/// Backward v2 (`GDN_RULE2_BWD=v2`: the pipelined reverse scan, `g2b_grad2`): the same cases
/// and tolerances as the chunked backward's bf16 test, poisoned outputs, padding rows zero.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v2_bf16_matches_f64() {
    check_chunked_bwd_bf16(Bwd::V2, "chunked-bwd-v2-bf16");
}

/// Backward v2 against the kernels it replaces, every chunked case, both storage types:
/// `g2b_dscan*p` computes exactly `g2b_dscan*`'s FMAs, so dh0 is bitwise the chunked
/// backward's (f32 and bf16); on f32 storage the whole v2 backward is bitwise the chunked one
/// (its gradient kernel is the fp32 `g2b_grad_f32`); on bf16, dv and dw (the tc products alone,
/// same epilogue values) are bitwise the tc backward's and dq, dk, dg, db (ex2.approx in the
/// Gram step) within 1e-4 RMS of the tc backward's. Every output finite, padding rows zero.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v2_matches_existing_kernels() {
    let gpu = gpu();
    let mut fails = Vec::new();
    for bf in [false, true] {
        let dt = if bf { DType::Bf16 } else { DType::F32 };
        for c in &chunked_cases(bf) {
            let v2 = bwd_gpu(&gpu, c, dt, Bwd::V2);
            let old = bwd_gpu(&gpu, c, dt, Bwd::Chunked);
            let tc = bwd_gpu(&gpu, c, dt, Bwd::ChunkedTc);
            check_bwd_written(c, &v2, "v2 bwd", &mut fails);
            let mut line = format!("gdn2-check chunked-bwd-v2-vs-old {dt:?} {:<29}", c.name);
            for (((name, x), (_, o)), (_, t)) in v2.iter().zip(&old).zip(&tc) {
                let same_old = x.iter().zip(o).all(|(a, b)| a.to_bits() == b.to_bits());
                let same_tc = x.iter().zip(t).all(|(a, b)| a.to_bits() == b.to_bits());
                let e = rms_rel(x, &t.iter().map(|&a| a as f64).collect::<Vec<f64>>());
                line += &format!(" {name}: =old {same_old} =tc {same_tc} vs-tc {e:.1e}");
                let ok = match (bf, *name) {
                    (false, _) | (true, "dh0") => same_old,
                    (true, "dv" | "dw") => same_tc,
                    // Where the exact value is all zero (dg at T = 1) the RMS is 0/0.
                    (true, _) => same_tc || e <= 1e-4,
                };
                if !ok {
                    fails.push(format!(
                        "{}: v2 {dt:?} {name}: bitwise old {same_old}, tc {same_tc}, RMS vs tc {e:.2e}",
                        c.name
                    ));
                }
            }
            println!("{line}");
        }
    }
    finish(fails);
}

/// `bwd` (a chunked one) on bf16 storage against the f64 reference, next to the recurrence.
fn check_chunked_bwd_bf16(bwd: Bwd, what: &str) {
    check_bwd_bf16_cases(bwd, what, &chunked_cases(true));
}

/// [`check_chunked_bwd_bf16`] on the given cases.
fn check_bwd_bf16_cases(bwd: Bwd, what: &str, cases: &[Case]) {
    let gpu = gpu();
    let mut fails = Vec::new();
    for c in cases {
        let ch = bwd_gpu(&gpu, c, DType::Bf16, bwd);
        let re = bwd_gpu(&gpu, c, DType::Bf16, Bwd::Recurrent);
        check_bwd_written(c, &ch, what, &mut fails);
        let rf = ref_bwd(c);
        let mut line = format!("gdn2-check {what} {:<29}", c.name);
        for (((name, x), (_, r)), (_, f)) in ch.iter().zip(&re).zip(&rf) {
            let zero = f.iter().all(|&a| a == 0.0);
            let (e, er) = if zero {
                (max_abs(x), max_abs(r))
            } else {
                (rms_rel(x, f), rms_rel(r, f))
            };
            line += &format!(" {name}={e:.2e} (recurrence {er:.2e})");
            // The recurrence's tolerances (check_bf16), or twice the recurrence's own error where
            // that is larger (the chunked kernels are held to the accepted implementation's
            // accuracy, not to a bound it does not meet itself).
            let base: f64 = match (*name, zero) {
                (_, true) => 1e-4,
                ("dg" | "db" | "dw", _) => 0.02,
                _ => 0.005,
            };
            let tol = if er.is_finite() {
                base.max(2.0 * er)
            } else {
                base
            };
            if e.is_nan() || e > tol {
                fails.push(format!(
                    "{}: {what} {name}: {} {e:.3e} > {tol}",
                    c.name,
                    if zero { "max abs" } else { "RMS rel" }
                ));
            }
        }
        println!("{line}");
    }
    finish(fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_two_runs_are_bitwise_identical() {
    let gpu = gpu();
    for (dt, bf) in [(DType::Bf16, true), (DType::F32, false)] {
        let c = strong(case(
            "bitwise",
            Seqs::packed(&[0, 0, 1, 100, 300], 303).unwrap(),
            sh(1, 2, 128, 128),
            true,
            true,
            47,
            bf,
        ));
        let bits = |x: &[(&'static str, Vec<f32>)]| {
            x.iter()
                .flat_map(|(_, v)| v.iter().map(|a| a.to_bits()))
                .collect::<Vec<u32>>()
        };
        let a = bits(&bwd_gpu(&gpu, &c, dt, Bwd::Chunked));
        let b = bits(&bwd_gpu(&gpu, &c, dt, Bwd::Chunked));
        let same = a == b;
        println!("gdn2-check chunked-bwd-bitwise {dt:?}: identical={same}");
        assert!(same, "{dt:?}: two runs of the chunked backward differ");
        // The tensor-core variant: bitwise reruns on bf16; on f32 storage it is the fp32 kernel
        // itself (bit for bit), on bf16 a different kernel (its results differ from the fp32
        // kernel's: the TF32 rounding; were they equal, the variant did not run).
        let t1 = bits(&bwd_gpu(&gpu, &c, dt, Bwd::ChunkedTc));
        let t2 = bits(&bwd_gpu(&gpu, &c, dt, Bwd::ChunkedTc));
        println!(
            "gdn2-check chunked-bwd-tc-bitwise {dt:?}: identical={} same-as-fp32-kernel={}",
            t1 == t2,
            t1 == a
        );
        assert!(
            t1 == t2,
            "{dt:?}: two runs of the tc chunked backward differ"
        );
        let v1 = bits(&bwd_gpu(&gpu, &c, dt, Bwd::V2));
        let v2 = bits(&bwd_gpu(&gpu, &c, dt, Bwd::V2));
        println!(
            "gdn2-check chunked-bwd-v2-bitwise {dt:?}: identical={} same-as-tc={}",
            v1 == v2,
            v1 == t1
        );
        assert!(v1 == v2, "{dt:?}: two runs of the v2 backward differ");
        if dt != DType::F32 {
            assert!(
                v1 != t1,
                "bf16: the v2 backward equals the tc backward's bits"
            );
        }
        match dt {
            DType::F32 => assert!(t1 == a, "f32: the tc backward is not the fp32 kernel"),
            _ => assert!(
                t1 != a,
                "bf16: the tc backward equals the fp32 kernel's bits"
            ),
        }
    }
}

/// [`chunked_cases`] plus the head sizes and groupings the v3 gradient kernel (`g2b_grad3`,
/// one warp per 8-channel column tile) meets nowhere else: GVA 4, Dk 96 / 48 / 112 / 80, Dv 80 /
/// 112 / 16, strong gates over several 16-row blocks.
fn v3_cases(bf16: bool) -> Vec<Case> {
    let s = if bf16 { 300 } else { 400 };
    let mut v = chunked_cases(bf16);
    v.push(case(
        "packed 1/4 d96x80 norm",
        packed(),
        sh(1, 4, 96, 80),
        true,
        true,
        s + 1,
        bf16,
    ));
    v.push(strong(case(
        "T130 1/1 d48x112",
        Seqs::uniform(1, 130),
        sh(1, 1, 48, 112),
        false,
        true,
        s + 2,
        bf16,
    )));
    v.push(case(
        "T129x2 2/2 d112x16",
        Seqs::uniform(2, 129),
        sh(2, 2, 112, 16),
        true,
        false,
        s + 3,
        bf16,
    ));
    v.push(strong(case(
        "packed 2/4 d80x64 norm",
        packed(),
        sh(2, 4, 80, 64),
        true,
        true,
        s + 4,
        bf16,
    )));
    v
}

/// Backward v3 (`GDN_RULE2_BWD=v3`: v2 with `g2b_grad3`, the Gram step on 3xTF32 tensor cores
/// by 16-row blocks): the chunked backward's bf16 tolerances against f64 on [`v3_cases`],
/// poisoned outputs, padding rows zero, the Dk 256 case on the fallback.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v3_bf16_matches_f64() {
    check_bwd_bf16_cases(Bwd::V3, "chunked-bwd-v3-bf16", &v3_cases(true));
}

/// Backward v3 against v2, every [`v3_cases`] case, both storage types: on f32 storage v3 is
/// v2 (bitwise every output); on bf16, dh0 (the same reverse scan) and dv, dw (steps 1-3 are
/// g2b_grad2's) are bitwise v2's, dq, dk, dg, db (the Gram step by blocks on 3xTF32, the Gam
/// per 16-row block) within 1e-4 RMS of v2's and not all of them bitwise (else v3 did not run).
/// Every output finite, padding rows zero; two v3 runs bitwise.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v3_matches_v2() {
    check_bwd_against(
        Bwd::V3,
        Bwd::V2,
        "v3",
        "v2",
        |dt, s| dt == DType::Bf16 && chunked_supports(s),
        &["dh0", "dv", "dw"],
        1e-4,
    );
}

/// Backward v4 (`GDN_RULE2_BWD=v4`: `g2b_grad4`, bf16 tensor cores fed from shared memory, the
/// diagonal Gram blocks through the block's middle row where the decay allows it, else
/// elementwise): the chunked backward's bf16 tolerances against f64 on [`v3_cases`] (the strong
/// gates take the elementwise path, the others the tensor-core one), poisoned outputs, padding
/// rows zero, the Dk 256 case on the fallback.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v4_bf16_matches_f64() {
    check_bwd_bf16_cases(Bwd::V4, "chunked-bwd-v4-bf16", &v3_cases(true));
}

/// Backward v4 against v3, every [`v3_cases`] case, both storage types: on f32 storage (and
/// shapes [`v4_supports`] rejects) v4 is v3, bitwise every output; on bf16 dh0 (the same reverse
/// scan) is bitwise v3's, and dq, dk, dv, dw, db, dg are within 1e-2 RMS of v3's (v4's bf16
/// operands against v3's TF32 ones: ~2e-3 each) and not all bitwise (else v4 did not run).
/// Every output finite, padding rows zero; two v4 runs bitwise.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v4_matches_v3() {
    check_bwd_against(
        Bwd::V4,
        Bwd::V3,
        "v4",
        "v3",
        |dt, s| dt == DType::Bf16 && v4_supports(s),
        &["dh0"],
        1e-2,
    );
}

/// Backward v5 (`GDN_RULE2_BWD=v5`: the recompute, the reverse scan and the gradient kernel all
/// on bf16 tensor cores with bf16 workspaces) against the f64 reference with the chunked
/// backward's bf16 tolerances on [`v3_cases`] (Dk 64 / 128 run v5, the others v4), poisoned
/// outputs, padding rows zero.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v5_bf16_matches_f64() {
    check_bwd_bf16_cases(Bwd::V5, "chunked-bwd-v5-bf16", &v3_cases(true));
}

/// Backward v5 against v4, every [`v3_cases`] case, both storage types: where [`v5_supports`]
/// says no, v5 is v4 bitwise; where it runs, every output (dh0 too: its own reverse scan) within
/// 1e-2 RMS of v4's and not all bitwise. Every output finite, padding rows zero; two v5 runs
/// bitwise.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn2_chunked_bwd_v5_matches_v4() {
    check_bwd_against(Bwd::V5, Bwd::V4, "v5", "v4", v5_supports, &[], 1e-2);
}

/// `new` against `old` on every [`v3_cases`] case, both storage types: where `runs(dt, shape)`
/// is false the two are the same kernels (bitwise every output); where it is true the outputs in
/// `same` are bitwise `old`'s, the others within `tol` RMS of them, and not all bitwise. Every
/// output finite, padding rows zero, two runs of `new` bitwise.
fn check_bwd_against(
    new: Bwd,
    old: Bwd,
    nn: &str,
    on: &str,
    runs: fn(DType, RuleShape) -> bool,
    same_fields: &[&str],
    tol: f64,
) {
    let gpu = gpu();
    let mut fails = Vec::new();
    for bf in [false, true] {
        let dt = if bf { DType::Bf16 } else { DType::F32 };
        for c in &v3_cases(bf) {
            let x1 = bwd_gpu(&gpu, c, dt, new);
            let x2 = bwd_gpu(&gpu, c, dt, new);
            let r = bwd_gpu(&gpu, c, dt, old);
            check_bwd_written(c, &x1, &format!("{nn} bwd"), &mut fails);
            let run = runs(dt, c.shape);
            let mut line = format!("gdn2-check chunked-bwd-{nn}-vs-{on} {dt:?} {:<29}", c.name);
            let mut any_diff = false;
            for (((name, x), (_, y)), (_, o)) in x1.iter().zip(&x2).zip(&r) {
                let rerun = x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
                let same = x.iter().zip(o).all(|(a, b)| a.to_bits() == b.to_bits());
                any_diff |= !same;
                let e = rms_rel(x, &o.iter().map(|&a| a as f64).collect::<Vec<f64>>());
                line += &format!(" {name}: ={on} {same} vs-{on} {e:.1e}");
                if !rerun {
                    fails.push(format!("{}: {nn} {dt:?} {name}: two runs differ", c.name));
                }
                let ok = if !run || same_fields.contains(name) {
                    same
                } else {
                    // Where the exact value is all zero (dg at T = 1) the RMS is 0/0.
                    same || e <= tol
                };
                if !ok {
                    fails.push(format!(
                        "{}: {nn} {dt:?} {name}: bitwise {on} {same}, RMS vs {on} {e:.2e}",
                        c.name
                    ));
                }
            }
            if run && c.seqs.used() > 1 && !any_diff {
                fails.push(format!(
                    "{}: {nn} equals {on}'s bits (did {nn} run?)",
                    c.name
                ));
            }
            println!("{line}");
        }
    }
    finish(fails);
}
