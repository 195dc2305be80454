//! Inference on a GPU (issue 14): the fused decode ops against the CPU ones, the slot API of the
//! layer (prefill / extend / decode on CUDA) against the CPU path, padding slots bitwise
//! untouched, reruns bitwise equal. Run on the device machine with `--include-ignored`.

use gdn::backend::cuda::{self, DType};
use gdn::backend::{Act, Cols, F32s, Ids};
use gdn::ops::decode::{self, DecodeShape, PreCols, PreOut, PreParams};
use gdn::{Device, GatedDeltaNet, GdnConfig, Seqs, Tensor, Variant};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn unif(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

/// max |a - b| / max |b|
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let m = b
        .iter()
        .fold(0.0f64, |m, x| m.max(x.abs() as f64))
        .max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |e, (x, y)| e.max((*x as f64 - *y as f64).abs()))
        / m
}

/// RMS(a - b) / RMS(b).
fn rms_rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let r: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / r.max(1e-300)).sqrt()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn host(x: &F32s) -> Vec<f32> {
    match x {
        F32s::Host(v) => v.clone(),
        F32s::Dev(g) => g.gpu().download(g).unwrap(),
    }
}

/// Random rule inputs for `n` rows (fp32, host): q, k raw (normalized in the rule when asked),
/// v, gates in their ranges (GDN: g <= 0, beta in (0, 1); GDN2: per key channel g, b, w).
fn rule_inputs(rng: &mut ChaCha8Rng, n: usize, s: DecodeShape) -> PreOut {
    let (qk, vd) = (s.hk * s.dk, s.hv * s.dv);
    let (g, b, w) = if s.gdn2 {
        (
            unif(rng, n * qk, -0.5, 0.0),
            unif(rng, n * qk, 0.0, 1.0),
            Some(F32s::Host(unif(rng, n * vd, 0.0, 1.0))),
        )
    } else {
        (
            unif(rng, n * s.hv, -0.5, 0.0),
            unif(rng, n * s.hv, 0.0, 1.0),
            None,
        )
    };
    PreOut {
        q: F32s::Host(unif(rng, n * qk, -1.0, 1.0)),
        k: F32s::Host(unif(rng, n * qk, -1.0, 1.0)),
        v: F32s::Host(unif(rng, n * vd, -1.0, 1.0)),
        g: F32s::Host(g),
        b: F32s::Host(b),
        w,
    }
}

fn upload(gpu: &std::sync::Arc<cuda::Gpu>, x: &F32s) -> F32s {
    F32s::Dev(gpu.upload(&host(x)).unwrap())
}

fn to_dev(gpu: &std::sync::Arc<cuda::Gpu>, x: &PreOut) -> PreOut {
    PreOut {
        q: upload(gpu, &x.q),
        k: upload(gpu, &x.k),
        v: upload(gpu, &x.v),
        g: upload(gpu, &x.g),
        b: upload(gpu, &x.b),
        w: x.w.as_ref().map(|w| upload(gpu, w)),
    }
}

/// The decode rule on the GPU against the CPU rule: Qwen3-Next's head shape (16 key / 32 value
/// heads of 128), a short key head with a partial value tile (Dk 100, Dv 40: guarded rows and
/// scalar loads), Dk 256 (16 rows per thread), GDN and GDN2, f32 and bf16 outputs, with and
/// without the l2 norm. Slots permuted in a larger pool with padding rows: o and the named
/// slots' states within 1e-5 (f32 o) of the CPU's; slots not named bitwise unchanged; a rerun
/// from the same pool bitwise equal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_decode_rule_matches_cpu_and_reruns_bitwise() {
    let gpu = cuda::gpu(0).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let slots: Vec<i32> = vec![5, -1, 0, 9, 3, -1, 7, 1];
    let nslots = 11;
    for (hk, hv, dk, dv) in [
        (16, 32, 128, 128),
        (2, 4, 100, 40),
        (1, 2, 256, 64),
        (4, 4, 16, 8),
    ] {
        for gdn2 in [false, true] {
            for l2norm in [true, false] {
                let s = DecodeShape {
                    hk,
                    hv,
                    dk,
                    dv,
                    width: 4,
                    gdn2,
                    l2norm,
                };
                let what = format!("{s:?}");
                let n = slots.len();
                let x = rule_inputs(&mut rng, n, s);
                let st0 = unif(&mut rng, nslots * s.state_len(), -1.0, 1.0);
                let scale = 1.0 / (dk as f32).sqrt();
                let mut st_cpu = F32s::Host(st0.clone());
                let o_cpu = decode::rule(
                    &x,
                    &mut st_cpu,
                    Ids::Host(&slots),
                    nslots,
                    s,
                    scale,
                    DType::F32,
                )
                .unwrap()
                .into_host()
                .unwrap();
                let st_cpu = host(&st_cpu);
                let xd = to_dev(&gpu, &x);
                let dslots = gpu.upload(&slots).unwrap();
                // The entry (default columns per thread) and both kernel widths.
                let run = |dt: DType, cols: usize| {
                    if cols == 0 {
                        let mut st = F32s::Dev(gpu.upload(&st0).unwrap());
                        let o = decode::rule(&xd, &mut st, Ids::Dev(&dslots), nslots, s, scale, dt)
                            .unwrap()
                            .into_host()
                            .unwrap();
                        return (o, host(&st));
                    }
                    let mut st = gpu.upload(&st0).unwrap();
                    let mut o = cuda::DBuf::uninit(&gpu, n * s.hv * s.dv, dt).unwrap();
                    decode::cuda::rule_with(&xd, &mut st, &dslots, nslots, s, scale, &mut o, cols)
                        .unwrap();
                    (o.download().unwrap(), gpu.download(&st).unwrap())
                };
                for cols in [0usize, 4, 8] {
                    let what = format!("{what} cols {cols}");
                    let (o1, st1) = run(DType::F32, cols);
                    let (o2, st2) = run(DType::F32, cols);
                    assert_eq!(bits(&o1), bits(&o2), "{what}: o rerun");
                    assert_eq!(bits(&st1), bits(&st2), "{what}: state rerun");
                    let (eo, es) = (rel(&o1, &o_cpu), rel(&st1, &st_cpu));
                    eprintln!("decode rule {what}: o {eo:.2e}, state {es:.2e}");
                    assert!(eo < 1e-5, "{what}: o vs CPU {eo}");
                    assert!(es < 1e-5, "{what}: state vs CPU {es}");
                    let sl = s.state_len();
                    for sidx in 0..nslots {
                        if !slots.contains(&(sidx as i32)) {
                            assert_eq!(
                                bits(&st1[sidx * sl..(sidx + 1) * sl]),
                                bits(&st0[sidx * sl..(sidx + 1) * sl]),
                                "{what}: slot {sidx} is named by no row"
                            );
                        }
                    }
                    for (r, &sl_) in slots.iter().enumerate() {
                        if sl_ < 0 {
                            let vd = s.hv * s.dv;
                            assert!(o1[r * vd..(r + 1) * vd].iter().all(|v| v.to_bits() == 0));
                        }
                    }
                    let (ob, _) = run(DType::Bf16, cols);
                    let eb = rms_rel(&ob, &o_cpu);
                    assert!(eb < 1e-2, "{what}: bf16 o vs CPU (rms) {eb}");
                }
            }
        }
    }
}

/// The pre step on the GPU against the CPU: q, k, v and the gates within 1e-5, the shifted conv
/// windows bitwise (they are copies of in_proj rows), slots not named bitwise unchanged, f32 and
/// bf16 storage (bf16: the same bf16 inputs on both sides).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_decode_pre_matches_cpu() {
    let gpu = cuda::gpu(0).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let slots: Vec<i32> = vec![2, -1, 0, 5];
    let nslots = 6;
    for gdn2 in [false, true] {
        for dtype in [DType::F32, DType::Bf16] {
            let s = DecodeShape {
                hk: 2,
                hv: 4,
                dk: 32,
                dv: 48,
                width: 4,
                gdn2,
                l2norm: true,
            };
            let (qk, vd, cd) = (s.hk * s.dk, s.hv * s.dv, s.conv_dim());
            let gw: Vec<usize> = if gdn2 {
                vec![qk, qk, vd]
            } else {
                vec![s.hv, s.hv]
            };
            let ld = cd + vd + gw.iter().sum::<usize>() + 3;
            let mut off = cd + vd;
            let gates: Vec<Cols> = gw
                .iter()
                .map(|&w| {
                    let c = Cols::new(ld, off, w);
                    off += w;
                    c
                })
                .collect();
            let cols = PreCols {
                qkv: Cols::new(ld, 0, cd),
                gates,
            };
            let n = slots.len();
            // Values representable in the storage type, so both sides read the same numbers.
            let round = |v: Vec<f32>| -> Vec<f32> {
                match dtype {
                    DType::F32 => v,
                    DType::Bf16 => v
                        .iter()
                        .map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
                        .collect(),
                }
            };
            let proj = round(unif(&mut rng, n * ld, -2.0, 2.0));
            let conv0 = round(unif(&mut rng, nslots * (s.width - 1) * cd, -2.0, 2.0));
            let cw = unif(&mut rng, cd * s.width, -0.5, 0.5);
            let cb = unif(&mut rng, cd, -0.2, 0.2);
            let (na, nd) = if gdn2 { (s.hk, qk) } else { (s.hv, s.hv) };
            let al = unif(&mut rng, na, -1.0, 1.0);
            let dt = unif(&mut rng, nd, -1.0, 1.0);
            let mut conv_c = Act::Host(conv0.clone());
            let pc = PreParams {
                conv_w: gdn::backend::P::Host(&cw),
                conv_b: Some(gdn::backend::P::Host(&cb)),
                a_log: gdn::backend::P::Host(&al),
                dt_bias: gdn::backend::P::Host(&dt),
            };
            let oc = decode::pre(
                &Act::Host(proj.clone()),
                &cols,
                &mut conv_c,
                Ids::Host(&slots),
                nslots,
                s,
                &pc,
            )
            .unwrap();
            let (cwd, cbd, ald, dtd) = (
                gpu.upload(&cw).unwrap(),
                gpu.upload(&cb).unwrap(),
                gpu.upload(&al).unwrap(),
                gpu.upload(&dt).unwrap(),
            );
            let pd = PreParams {
                conv_w: gdn::backend::P::Dev(&cwd),
                conv_b: Some(gdn::backend::P::Dev(&cbd)),
                a_log: gdn::backend::P::Dev(&ald),
                dt_bias: gdn::backend::P::Dev(&dtd),
            };
            let dslots = gpu.upload(&slots).unwrap();
            let mut conv_d = Act::Dev(cuda::DBuf::upload(&gpu, &conv0, dtype).unwrap());
            let od = decode::pre(
                &Act::Dev(cuda::DBuf::upload(&gpu, &proj, dtype).unwrap()),
                &cols,
                &mut conv_d,
                Ids::Dev(&dslots),
                nslots,
                s,
                &pd,
            )
            .unwrap();
            let what = format!("gdn2 {gdn2} {dtype:?}");
            for (name, a, b) in [
                ("q", &od.q, &oc.q),
                ("k", &od.k, &oc.k),
                ("v", &od.v, &oc.v),
                ("g", &od.g, &oc.g),
                ("b", &od.b, &oc.b),
            ] {
                let e = rel(&host(a), &host(b));
                assert!(e < 1e-5, "{what}: {name} vs CPU {e}");
            }
            if gdn2 {
                let e = rel(&host(od.w.as_ref().unwrap()), &host(oc.w.as_ref().unwrap()));
                assert!(e < 1e-5, "{what}: w vs CPU {e}");
            }
            let (cd_, cc_) = (conv_d.into_host().unwrap(), conv_c.into_host().unwrap());
            assert_eq!(bits(&cd_), bits(&cc_), "{what}: conv windows");
            let wl = (s.width - 1) * cd;
            for sidx in [1usize, 3, 4] {
                assert_eq!(
                    bits(&cd_[sidx * wl..(sidx + 1) * wl]),
                    bits(&conv0[sidx * wl..(sidx + 1) * wl]),
                    "{what}: slot {sidx} named by no row"
                );
            }
        }
    }
}

fn cfg(variant: Variant) -> GdnConfig {
    GdnConfig {
        variant,
        hidden_size: 256,
        linear_num_key_heads: 2,
        linear_num_value_heads: 4,
        linear_key_head_dim: 64,
        linear_value_head_dim: 64,
        conv_bias: true,
        ..GdnConfig::default()
    }
}

fn randt(rng: &mut ChaCha8Rng, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(shape, unif(rng, n, -1.0, 1.0)).unwrap()
}

/// One slot session: prefill packed prompts (lengths 0, 3, 70, 130) into slots [6, 1, 3, 0],
/// extend by (5, 64, 0, 1), decode 4 steps with rows [seq 2, pad, seq 0, seq 3, seq 1]. Returns
/// the outputs of every call (concatenated), the states and the conv rows.
fn session(l: &GatedDeltaNet, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let h = l.config().hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let slots = [6i32, 1, 3, 0];
    let mut pool = l.cache_pool(8).unwrap();
    let mut out = Vec::new();
    let cu = |lens: &[usize]| {
        let mut c = vec![0u64];
        for &x in lens {
            c.push(c.last().unwrap() + x as u64);
        }
        c
    };
    let (p, e) = ([0usize, 3, 70, 130], [5usize, 64, 0, 1]);
    let cp = cu(&p);
    let x = randt(&mut rng, &[cp[4] as usize, h]);
    let seqs = Seqs::packed(&cp, cp[4] as usize).unwrap();
    out.extend_from_slice(
        l.prefill_slots(&x, &seqs, &slots, &mut pool)
            .unwrap()
            .data(),
    );
    let ce = cu(&e);
    let x = randt(&mut rng, &[ce[4] as usize, h]);
    let seqs = Seqs::packed(&ce, ce[4] as usize).unwrap();
    out.extend_from_slice(l.extend_slots(&x, &seqs, &slots, &mut pool).unwrap().data());
    let rows = [slots[2], -1, slots[0], slots[3], slots[1]];
    for _ in 0..4 {
        let x = randt(&mut rng, &[5, h]);
        let y = l.decode_slots(&x, &rows, &mut pool).unwrap();
        for r in [0usize, 2, 3, 4] {
            out.extend_from_slice(&y.data()[r * h..(r + 1) * h]);
        }
    }
    (
        out,
        pool.state_host().unwrap().into_vec(),
        pool.conv_host().unwrap().into_vec(),
    )
}

/// The layer's slot API on CUDA (f32) against the CPU path: outputs of prefill, extend and
/// decode within 1e-4 (the layer tests' f32 tolerance), states within 1e-4, conv rows (copies of
/// in_proj rows) within 1e-5; bf16 storage within 2e-2 RMS; a rerun bitwise equal; GDN and GDN2.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_layer_slots_match_cpu_and_rerun_bitwise() {
    for variant in [Variant::Gdn, Variant::Gdn2] {
        let cpu = GatedDeltaNet::new(&cfg(variant), 3).unwrap();
        let (y0, s0, c0) = session(&cpu, 4);
        let g = cpu.clone().to_device(Device::Cuda(0), DType::F32).unwrap();
        let (y1, s1, c1) = session(&g, 4);
        let (y2, s2, c2) = session(&g, 4);
        assert_eq!(bits(&y1), bits(&y2), "{variant:?}: y rerun");
        assert_eq!(bits(&s1), bits(&s2), "{variant:?}: states rerun");
        assert_eq!(bits(&c1), bits(&c2), "{variant:?}: conv rerun");
        let (ey, es, ec) = (rel(&y1, &y0), rel(&s1, &s0), rel(&c1, &c0));
        eprintln!("{variant:?} f32 slots vs CPU: y {ey:.2e}, states {es:.2e}, conv {ec:.2e}");
        assert!(ey < 1e-4, "{variant:?}: y vs CPU {ey}");
        assert!(es < 1e-4, "{variant:?}: states vs CPU {es}");
        assert!(ec < 1e-5, "{variant:?}: conv rows vs CPU {ec}");
        // Slots 2, 4, 5, 7 are named by no call: zero.
        let sl = s1.len() / 8;
        for sidx in [2usize, 4, 5, 7] {
            assert!(s1[sidx * sl..(sidx + 1) * sl]
                .iter()
                .all(|v| v.to_bits() == 0));
        }
        let b = cpu.clone().to_device(Device::Cuda(0), DType::Bf16).unwrap();
        let (yb, sb, _) = session(&b, 4);
        let (ey, es) = (rms_rel(&yb, &y0), rms_rel(&sb, &s0));
        eprintln!("{variant:?} bf16 slots vs CPU (rms): y {ey:.2e}, states {es:.2e}");
        assert!(
            ey < 2e-2 && es < 2e-2,
            "{variant:?}: bf16 y {ey}, states {es}"
        );
    }
}

/// Decode on CUDA through the device-tensor API leaves slots that no row names (and padding
/// rows' nothing) bitwise unchanged, and a bad slot is an error that changes nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_decode_padding_and_errors_leave_slots_unchanged() {
    let l = GatedDeltaNet::new(&cfg(Variant::Gdn), 5)
        .unwrap()
        .to_device(Device::Cuda(0), DType::F32)
        .unwrap();
    let gpu = cuda::gpu(0).unwrap();
    let h = 256;
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let mut pool = l.cache_pool(4).unwrap();
    let x = randt(&mut rng, &[40, h]);
    let seqs = Seqs::packed(&[0, 10, 25, 40], 40).unwrap();
    l.prefill_slots(&x, &seqs, &[0, 1, 2], &mut pool).unwrap();
    let (s0, c0) = (
        pool.state_host().unwrap().into_vec(),
        pool.conv_host().unwrap().into_vec(),
    );
    let xd = cuda::DBuf::upload(&gpu, &unif(&mut rng, 3 * h, -1.0, 1.0), DType::F32).unwrap();
    l.decode_slots_dev(xd, &[-1, 1, -1], &mut pool).unwrap();
    let (s1, c1) = (
        pool.state_host().unwrap().into_vec(),
        pool.conv_host().unwrap().into_vec(),
    );
    let (sl, cl) = (s0.len() / 4, c0.len() / 4);
    for sidx in [0usize, 2, 3] {
        assert_eq!(
            bits(&s1[sidx * sl..(sidx + 1) * sl]),
            bits(&s0[sidx * sl..(sidx + 1) * sl])
        );
        assert_eq!(
            bits(&c1[sidx * cl..(sidx + 1) * cl]),
            bits(&c0[sidx * cl..(sidx + 1) * cl])
        );
    }
    assert_ne!(
        bits(&s1[sl..2 * sl]),
        bits(&s0[sl..2 * sl]),
        "slot 1 advanced"
    );
    for bad in [[0i32, 4, 1], [2, 2, 1]] {
        let xd = cuda::DBuf::upload(&gpu, &unif(&mut rng, 3 * h, -1.0, 1.0), DType::F32).unwrap();
        assert!(l.decode_slots_dev(xd, &bad, &mut pool).is_err());
        assert_eq!(bits(&pool.state_host().unwrap().into_vec()), bits(&s1));
        assert_eq!(bits(&pool.conv_host().unwrap().into_vec()), bits(&c1));
    }
}

/// The model's prefill + decode on CUDA (f32) against the CPU's: logits within 1e-4 (relative to
/// the largest), GDN and GDN2; a rerun bitwise equal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_model_prefill_decode_matches_cpu() {
    use gdn::model::{Model, ModelConfig};
    for variant in [Variant::Gdn, Variant::Gdn2] {
        let mc = ModelConfig {
            vocab_size: 300,
            ffn_hidden_size: 512,
            share_embeddings_and_output_weights: false,
            layer: GdnConfig {
                num_layers: 2,
                ..cfg(variant)
            },
        };
        let cpu = Model::new(&mc, 7).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let prompt: Vec<u32> = (0..3 * 50).map(|_| rng.gen_range(0..300)).collect();
        let steps: Vec<Vec<u32>> = (0..5)
            .map(|_| (0..3).map(|_| rng.gen_range(0..300)).collect())
            .collect();
        let go = |m: &Model| {
            let mut c = m.cache(4).unwrap();
            let slots = [3, 0, 2];
            let mut out = m
                .prefill(&prompt, &Seqs::uniform(3, 50), &slots, &mut c)
                .unwrap();
            for s in &steps {
                out.extend(m.decode(s, &slots, &mut c).unwrap());
            }
            out
        };
        let want = go(&cpu);
        let mut g = Model::new(&mc, 7).unwrap();
        g.to_device(Device::Cuda(0), DType::F32).unwrap();
        let (a, b) = (go(&g), go(&g));
        assert_eq!(bits(&a), bits(&b), "{variant:?}: rerun");
        let e = rel(&a, &want);
        eprintln!("{variant:?}: model logits CUDA vs CPU: {e:.2e}");
        assert!(e < 1e-4, "{variant:?}: logits vs CPU {e}");
    }
}
