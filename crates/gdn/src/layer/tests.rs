use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use super::reference::{self, RefParams};
use super::*;
use crate::config::{GdnConfig, Normalization, RecomputeGranularity, Variant};
use crate::error::GdnError;
use crate::seqs::Seqs;
use crate::tensor::Tensor;

fn tiny(norm: Normalization, zc: bool, ratio: usize) -> GdnConfig {
    GdnConfig {
        hidden_size: 8,
        num_layers: 2,
        linear_num_key_heads: 1,
        linear_num_value_heads: ratio,
        linear_key_head_dim: 4,
        linear_value_head_dim: 3,
        linear_conv_kernel_dim: 3,
        normalization: norm,
        layernorm_zero_centered_gamma: zc,
        conv_bias: true,
        ..GdnConfig::default()
    }
}

fn tiny2(norm: Normalization, zc: bool, ratio: usize) -> GdnConfig {
    GdnConfig {
        variant: Variant::Gdn2,
        ..tiny(norm, zc, ratio)
    }
}

fn randn(rng: &mut ChaCha8Rng, n: usize, s: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            s * z as f32
        })
        .collect::<Vec<f32>>()
}

/// A layer whose parameters are all perturbed away from their init (so every gradient is generic),
/// with in_proj/out_proj scaled up so the layer is far from linear.
fn layer(cfg: &GdnConfig, seed: u64) -> GatedDeltaNet {
    let mut l = GatedDeltaNet::new(cfg, seed).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 100);
    for (name, t) in l.params_mut().iter_mut() {
        let s = match name {
            "in_proj.weight" => 0.5,
            "out_proj.weight" => 0.5,
            "A_log" | "dt_bias" => 0.3,
            _ => 0.2,
        };
        for v in t.data_mut() {
            *v += s * rng.gen_range(-1.0f32..1.0);
        }
    }
    l
}

fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    max_rel_floor(a, b, 1e-12)
}

/// max |a - b| / max(max |b|, floor): the floor keeps a gradient that happens to be near zero
/// (a sum over tokens that cancels) from turning f32 rounding into a large relative error.
fn max_rel_floor(a: &[f32], b: &[f64], floor: f64) -> f64 {
    let m = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(floor);
    a.iter()
        .zip(b)
        .fold(0.0f64, |e, (x, y)| e.max((*x as f64 - y).abs()))
        / m
}

#[test]
fn layer_forward_matches_f64_reference() {
    for (norm, zc, ratio) in [
        (Normalization::RMSNorm, false, 2),
        (Normalization::LayerNorm, true, 1),
        (Normalization::RMSNorm, true, 4),
    ] {
        let cfg = tiny(norm, zc, ratio);
        let l = layer(&cfg, 3);
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (b, t) = (2, 70);
        let x = Tensor::from_vec(&[b, t, 8], randn(&mut rng, b * t * 8, 1.0)).unwrap();
        let (y, _) = l.forward(&x).unwrap();
        let xf: Vec<f64> = x.data().iter().map(|&v| v as f64).collect();
        let yr = reference::forward(
            &cfg,
            &RefParams::from_params(l.params()),
            &xf,
            Seqs::uniform(b, t).cu(),
        );
        let e = max_rel(y.data(), &yr);
        assert!(
            e < 1e-5,
            "{norm:?} zc={zc} ratio={ratio}: forward rel err {e}"
        );
    }
}

/// Every gradient of the layer (dx and every parameter) against central finite differences of
/// the f64 reference layer.
fn fd_check(cfg: &GdnConfig, b: usize, t: usize, tol: f64) {
    let l = layer(cfg, 5);
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let h = cfg.hidden_size;
    let x = Tensor::from_vec(&[b, t, h], randn(&mut rng, b * t * h, 1.0)).unwrap();
    let dy = Tensor::from_vec(&[b, t, h], randn(&mut rng, b * t * h, 1.0)).unwrap();
    let (_, saved) = l.forward(&x).unwrap();
    let (dx, grads) = l.backward(saved, &dy).unwrap();
    let cu = Seqs::uniform(b, t).cu().to_vec();
    let dyf: Vec<f64> = dy.data().iter().map(|&v| v as f64).collect();
    let loss = |p: &RefParams, x: &[f64]| -> f64 {
        reference::forward(cfg, p, x, &cu)
            .iter()
            .zip(&dyf)
            .map(|(a, b)| a * b)
            .sum()
    };
    let eps = 1e-6;
    let mut xf: Vec<f64> = x.data().iter().map(|&v| v as f64).collect();
    let mut pf = RefParams::from_params(l.params());
    let mut fd = vec![0.0; xf.len()];
    for i in 0..xf.len() {
        let x0 = xf[i];
        xf[i] = x0 + eps;
        let lp = loss(&pf, &xf);
        xf[i] = x0 - eps;
        let lm = loss(&pf, &xf);
        xf[i] = x0;
        fd[i] = (lp - lm) / (2.0 * eps);
    }
    let e = max_rel(dx.data(), &fd);
    eprintln!(
        "layer FD {:?} {:?}: dx rel err {e:.2e}",
        cfg.variant, cfg.normalization
    );
    assert!(e < tol, "dx: rel err {e}");
    // Parameter gradients are judged relative to at least 1% of the input gradient's scale.
    let floor = 1e-2 * fd.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let names: Vec<String> = pf.0.iter().map(|(n, _)| n.clone()).collect();
    for (pi, name) in names.iter().enumerate() {
        let len = pf.0[pi].1.len();
        let mut fd = vec![0.0; len];
        for i in 0..len {
            let v0 = pf.0[pi].1[i];
            pf.0[pi].1[i] = v0 + eps;
            let lp = loss(&pf, &xf);
            pf.0[pi].1[i] = v0 - eps;
            let lm = loss(&pf, &xf);
            pf.0[pi].1[i] = v0;
            fd[i] = (lp - lm) / (2.0 * eps);
        }
        let g = grads
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let e = max_rel_floor(g.data(), &fd, floor);
        eprintln!(
            "layer FD {:?} {:?}: {name} rel err {e:.2e}",
            cfg.variant, cfg.normalization
        );
        assert!(
            e < tol,
            "{name}: rel err {e} (cfg {:?} {:?}) ours {:?} fd {:?}",
            cfg.normalization,
            cfg.linear_num_value_heads,
            &g.data()[..g.numel().min(4)],
            &fd[..fd.len().min(4)]
        );
    }
}

#[test]
fn layer_backward_matches_finite_differences_rmsnorm_gva() {
    fd_check(&tiny(Normalization::RMSNorm, false, 2), 2, 5, 1e-4);
}

#[test]
fn layer_backward_matches_finite_differences_layernorm_zero_centered() {
    fd_check(&tiny(Normalization::LayerNorm, true, 1), 1, 7, 1e-4);
}

#[test]
fn gdn2_layer_backward_matches_finite_differences_rmsnorm_gva() {
    fd_check(&tiny2(Normalization::RMSNorm, false, 2), 2, 5, 1e-4);
}

#[test]
fn gdn2_layer_backward_matches_finite_differences_layernorm_zero_centered_in_kernel_norm() {
    let cfg = GdnConfig {
        use_qk_l2norm_in_kernel: true,
        ..tiny2(Normalization::LayerNorm, true, 1)
    };
    fd_check(&cfg, 1, 70, 1e-4);
}

#[test]
fn layer_backward_matches_finite_differences_across_chunks_in_kernel_norm() {
    let cfg = GdnConfig {
        use_qk_l2norm_in_kernel: true,
        ..tiny(Normalization::RMSNorm, false, 2)
    };
    fd_check(&cfg, 1, 70, 1e-4);
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.data().iter().map(|x| x.to_bits()).collect()
}

fn run(cfg: &GdnConfig, x: &Tensor, dy: &Tensor) -> (Tensor, Tensor, Grads, usize) {
    let l = layer(cfg, 8);
    let (y, saved) = l.forward(x).unwrap();
    let bytes = saved.bytes();
    let (dx, g) = l.backward(saved, dy).unwrap();
    (y, dx, g, bytes)
}

/// Every recompute setting gives bitwise the results of keeping everything
/// (`keep_rule_inputs = true`, Megatron's default), keeping fewer bytes: the default (rule
/// inputs rebuilt in backward), `gdn_prep` (accepted, means the default), `gdn_norm_out`, `gdn`,
/// `full`; GDN and GDN2, both norms, batched and packed (an empty sequence, padding rows).
#[test]
fn recompute_options_are_bitwise_identical() {
    for (norm, zc) in [
        (Normalization::RMSNorm, false),
        (Normalization::RMSNorm, true),
        (Normalization::LayerNorm, false),
        (Normalization::LayerNorm, true),
    ] {
        for variant in [Variant::Gdn, Variant::Gdn2] {
            let keep = GdnConfig {
                keep_rule_inputs: true,
                variant,
                ..tiny(norm, zc, 2)
            };
            let mut rng = ChaCha8Rng::seed_from_u64(9);
            let x = Tensor::from_vec(&[2, 70, 8], randn(&mut rng, 2 * 70 * 8, 1.0)).unwrap();
            let dy = Tensor::from_vec(&[2, 70, 8], randn(&mut rng, 2 * 70 * 8, 1.0)).unwrap();
            let packed = Seqs::packed(&[0, 33, 33, 130], 140).unwrap();
            for seqs in [None, Some(&packed)] {
                let (y0, dx0, g0, b0) = run_seqs(&keep, &x, &dy, seqs);
                let variants = [
                    (None, vec![]),
                    (Some(RecomputeGranularity::Selective), vec!["gdn_norm_out"]),
                    (Some(RecomputeGranularity::Selective), vec!["gdn_prep"]),
                    (
                        Some(RecomputeGranularity::Selective),
                        vec!["gdn_prep", "gdn_norm_out"],
                    ),
                    (Some(RecomputeGranularity::Selective), vec!["gdn"]),
                    (Some(RecomputeGranularity::Full), vec![]),
                ];
                for (gran, mods) in variants {
                    let cfg = GdnConfig {
                        keep_rule_inputs: false,
                        recompute_granularity: gran,
                        recompute_modules: Some(mods.iter().map(|s| s.to_string()).collect()),
                        ..keep.clone()
                    };
                    let what = format!("{variant:?} {norm:?} zc={zc} packed={}", seqs.is_some());
                    let (y, dx, g, b) = run_seqs(&cfg, &x, &dy, seqs);
                    assert_eq!(bits(&y0), bits(&y), "{what} {mods:?}: output");
                    assert_eq!(bits(&dx0), bits(&dx), "{what} {mods:?}: dx");
                    assert_eq!(g0.names(), g.names());
                    for (name, t) in g0.iter() {
                        assert_eq!(
                            bits(t),
                            bits(g.get(name).unwrap()),
                            "{what} {mods:?}: grad {name}"
                        );
                    }
                    assert!(
                        b < b0,
                        "{what} {mods:?} keeps {b} bytes, keep_rule_inputs {b0}"
                    );
                }
            }
        }
    }
}

/// `run` over packed sequences (`x`'s `[2, 70, h]` read as `[140, h]`) or batched (`None`).
fn run_seqs(
    cfg: &GdnConfig,
    x: &Tensor,
    dy: &Tensor,
    seqs: Option<&Seqs>,
) -> (Tensor, Tensor, Grads, usize) {
    let Some(seqs) = seqs else {
        return run(cfg, x, dy);
    };
    let rows = |t: &Tensor| Tensor::from_vec(&[140, 8], t.data().to_vec()).unwrap();
    let l = layer(cfg, 8);
    let (y, saved) = l.forward_packed(&rows(x), seqs).unwrap();
    let bytes = saved.bytes();
    let (dx, g) = l.backward(saved, &rows(dy)).unwrap();
    (y, dx, g, bytes)
}

#[test]
fn bad_inputs_are_errors() {
    let cfg = tiny(Normalization::RMSNorm, false, 2);
    let l = layer(&cfg, 1);
    assert!(l.forward(&Tensor::zeros(&[2, 5, 7])).is_err());
    assert!(l.forward(&Tensor::zeros(&[10, 8])).is_err());
    let (_, saved) = l.forward(&Tensor::zeros(&[2, 5, 8])).unwrap();
    assert!(l.backward(saved, &Tensor::zeros(&[2, 4, 8])).is_err());
    let mut p = l.params().clone();
    p.set("A_log", Tensor::zeros(&[3]));
    assert!(GatedDeltaNet::with_params(&cfg, p).is_err());
    let bad = GdnConfig {
        linear_num_value_heads: 3,
        linear_num_key_heads: 2,
        ..cfg
    };
    assert!(GatedDeltaNet::new(&bad, 0).is_err());
}

#[test]
fn initial_and_final_states_match_reference_and_finite_differences() {
    for v in [Variant::Gdn, Variant::Gdn2] {
        let cfg = GdnConfig {
            variant: v,
            ..tiny(Normalization::RMSNorm, false, 2)
        };
        let l = layer(&cfg, 21);
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        let seqs = Seqs::packed(&[0, 3, 3, 7], 9).unwrap();
        let st = l.state_shape(&seqs);
        let n_st: usize = st.iter().product();
        let x = Tensor::from_vec(&[1, 9, 8], randn(&mut rng, 72, 1.0)).unwrap();
        let h0 = Tensor::from_vec(&st, randn(&mut rng, n_st, 0.5)).unwrap();
        let dy = Tensor::from_vec(&[1, 9, 8], randn(&mut rng, 72, 1.0)).unwrap();
        let dht = Tensor::from_vec(&st, randn(&mut rng, n_st, 0.5)).unwrap();
        let (y, fin, saved) = l.forward_with_state(&x, &seqs, Some(&h0)).unwrap();
        // the initial states are kept for backward: exactly N*Hv*Dk*Dv f32 more
        let (_, _, saved_no_h0) = l.forward_with_state(&x, &seqs, None).unwrap();
        assert_eq!(saved.bytes() - saved_no_h0.bytes(), n_st * 4);
        let (dx, _, dh0) = l.backward_with_state(saved, &dy, Some(&dht)).unwrap();
        let dh0 = dh0.expect("dh0 when h0 was given");
        let f = |t: &Tensor| t.data().iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let pf = RefParams::from_params(l.params());
        let (yr, finr) = reference::forward_with_state(&cfg, &pf, &f(&x), seqs.cu(), Some(&f(&h0)));
        assert!(max_rel(y.data(), &yr) < 1e-5, "{v:?} y");
        assert!(max_rel(fin.data(), &finr) < 1e-5, "{v:?} final state");
        // padding rows: zero output and zero input gradient
        assert!(
            y.data()[7 * 8..].iter().all(|&a| a == 0.0),
            "{v:?} padding output"
        );
        assert!(
            dx.data()[7 * 8..].iter().all(|&a| a == 0.0),
            "{v:?} padding dx"
        );
        let loss = |h: &[f64]| -> f64 {
            let (y, fin) = reference::forward_with_state(&cfg, &pf, &f(&x), seqs.cu(), Some(h));
            y.iter().zip(f(&dy)).map(|(a, b)| a * b).sum::<f64>()
                + fin.iter().zip(f(&dht)).map(|(a, b)| a * b).sum::<f64>()
        };
        let mut h = f(&h0);
        let mut fd = vec![0.0; h.len()];
        for i in 0..h.len() {
            let v0 = h[i];
            h[i] = v0 + 1e-6;
            let lp = loss(&h);
            h[i] = v0 - 1e-6;
            let lm = loss(&h);
            h[i] = v0;
            fd[i] = (lp - lm) / 2e-6;
        }
        let e = max_rel(dh0.data(), &fd);
        assert!(e < 1e-4, "{v:?} dh0 rel err {e}");
    }
}

/// A packed batch gives each sequence what running it alone gives, within f32 rounding: the
/// rule, conv and norms treat sequences independently (bitwise, see the rule's own test), but the
/// projections' GEMM blocks rows differently for 1 row and 200, and parameter gradients sum over
/// tokens in a different grouping.
#[test]
fn packed_batch_equals_sequences_alone() {
    for v in [Variant::Gdn, Variant::Gdn2] {
        let cfg = GdnConfig {
            variant: v,
            ..tiny(Normalization::RMSNorm, false, 2)
        };
        let l = layer(&cfg, 31);
        let lens = [0usize, 1, 63, 64, 65, 0, 7];
        let mut cu = vec![0u64];
        for &n in &lens {
            cu.push(cu.last().unwrap() + n as u64);
        }
        let used = *cu.last().unwrap() as usize;
        let total = used + 3; // three padding rows
        let seqs = Seqs::packed(&cu, total).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(32);
        let x = Tensor::from_vec(&[1, total, 8], randn(&mut rng, total * 8, 1.0)).unwrap();
        let dy = Tensor::from_vec(&[1, total, 8], randn(&mut rng, total * 8, 1.0)).unwrap();
        let (y, fin, saved) = l.forward_with_state(&x, &seqs, None).unwrap();
        let (dx, g, _) = l.backward_with_state(saved, &dy, None).unwrap();
        let mut gsum: Option<Grads> = None;
        let st_per = fin.numel() / lens.len();
        for (i, &len) in lens.iter().enumerate() {
            let a = cu[i] as usize;
            let xs =
                Tensor::from_vec(&[1, len, 8], x.data()[a * 8..(a + len) * 8].to_vec()).unwrap();
            let dys =
                Tensor::from_vec(&[1, len, 8], dy.data()[a * 8..(a + len) * 8].to_vec()).unwrap();
            let one = Seqs::uniform(1, len);
            let (ys, fins, saved) = l.forward_with_state(&xs, &one, None).unwrap();
            let (dxs, gs, _) = l.backward_with_state(saved, &dys, None).unwrap();
            let sl = a * 8..(a + len) * 8;
            let f64s = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
            if len > 0 {
                let e = max_rel(&y.data()[sl.clone()], &f64s(ys.data()));
                assert!(e < 1e-5, "{v:?} output of sequence {i}: {e}");
                assert!(
                    max_rel(&dx.data()[sl], &f64s(dxs.data())) < 1e-5,
                    "{v:?} dx of sequence {i}"
                );
                let fp = &fin.data()[i * st_per..(i + 1) * st_per];
                assert!(
                    max_rel(fp, &f64s(fins.data())) < 1e-6,
                    "{v:?} final state of sequence {i}"
                );
            } else {
                assert!(fin.data()[i * st_per..(i + 1) * st_per]
                    .iter()
                    .all(|&a| a == 0.0));
            }
            gsum = Some(match gsum {
                None => gs,
                Some(mut acc) => {
                    for (name, t) in acc.iter_mut() {
                        for (a, b) in t.data_mut().iter_mut().zip(gs.get(name).unwrap().data()) {
                            *a += b;
                        }
                    }
                    acc
                }
            });
        }
        assert!(y.data()[used * 8..].iter().all(|&a| a == 0.0));
        assert!(dx.data()[used * 8..].iter().all(|&a| a == 0.0));
        let gsum = gsum.unwrap();
        for (name, t) in g.iter() {
            let r: Vec<f64> = gsum
                .get(name)
                .unwrap()
                .data()
                .iter()
                .map(|&a| a as f64)
                .collect();
            let e = max_rel(t.data(), &r);
            assert!(e < 1e-5, "{v:?} {name}: packed vs separate rel err {e}");
        }
    }
}

#[test]
fn hundreds_of_short_sequences() {
    let cfg = tiny(Normalization::RMSNorm, false, 2);
    let l = layer(&cfg, 41);
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut cu = vec![0u64];
    for i in 0..300u64 {
        cu.push(cu.last().unwrap() + (i * 7919) % 5);
    }
    let total = *cu.last().unwrap() as usize;
    let seqs = Seqs::packed(&cu, total).unwrap();
    let x = Tensor::from_vec(&[1, total, 8], randn(&mut rng, total * 8, 1.0)).unwrap();
    let (y, _) = l.forward_packed(&x, &seqs).unwrap();
    let xf: Vec<f64> = x.data().iter().map(|&a| a as f64).collect();
    let yr = reference::forward(&cfg, &RefParams::from_params(l.params()), &xf, seqs.cu());
    assert!(max_rel(y.data(), &yr) < 1e-5);
}

/// Inference forward keeps nothing and ignores recompute settings: its output is bitwise the
/// training forward's, for every setting.
#[test]
fn inference_forward_matches_training_forward_under_every_setting() {
    let mut rng = ChaCha8Rng::seed_from_u64(51);
    let x = Tensor::from_vec(&[2, 70, 8], randn(&mut rng, 2 * 70 * 8, 1.0)).unwrap();
    for v in [Variant::Gdn, Variant::Gdn2] {
        let base = GdnConfig {
            variant: v,
            ..tiny(Normalization::RMSNorm, false, 2)
        };
        let l0 = layer(&base, 52);
        let (y_train, _) = l0.forward(&x).unwrap();
        for (gran, mods) in [
            (None, vec![]),
            (
                Some(RecomputeGranularity::Selective),
                vec!["gdn_norm_out", "gdn_prep"],
            ),
            (Some(RecomputeGranularity::Selective), vec!["gdn"]),
            (Some(RecomputeGranularity::Full), vec![]),
        ] {
            let cfg = GdnConfig {
                recompute_granularity: gran,
                recompute_modules: Some(mods.iter().map(|s| s.to_string()).collect()),
                ..base.clone()
            };
            let l = GatedDeltaNet::with_params(&cfg, l0.params().clone()).unwrap();
            assert_eq!(
                bits(&l.forward_inference(&x).unwrap()),
                bits(&y_train),
                "{v:?} {mods:?}"
            );
        }
    }
}

/// Offsets of consecutive sequences of the given lengths.
fn cu_of(lens: &[usize]) -> Vec<u64> {
    let mut cu = vec![0u64];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as u64);
    }
    cu
}

/// Prefill over packed prompts (empty, shorter than the conv window, across a chunk boundary),
/// then a packed chunk of more tokens per sequence (`extend`, lengths 3, 0, 66, 2), then `steps`
/// decode steps: every output against the f64 layer over the whole sequences and against the
/// chunked f32 forward; the cache's states against the forward's final states.
fn check_prefill_decode(cfg: &GdnConfig, seed: u64) {
    let l = layer(cfg, seed);
    let h = cfg.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    let (prompt_lens, ext_lens, steps) = ([0usize, 1, 5, 70], [3usize, 0, 66, 2], 6);
    let n = prompt_lens.len();
    let full_lens: Vec<usize> = (0..n)
        .map(|i| prompt_lens[i] + ext_lens[i] + steps)
        .collect();
    let full: Vec<Vec<f32>> = full_lens
        .iter()
        .map(|&t| randn(&mut rng, t * h, 1.0))
        .collect();
    let cu_f = cu_of(&full_lens);
    let tf = cu_f[n] as usize;
    let mut ours = vec![f32::NAN; tf * h];
    // Tokens [from, from + lens[i]) of every sequence, packed; their outputs go into `ours`.
    let part = |from: &[usize], lens: &[usize]| -> (Tensor, Seqs) {
        let x: Vec<f32> = (0..n)
            .flat_map(|i| full[i][from[i] * h..(from[i] + lens[i]) * h].to_vec())
            .collect();
        let cu = cu_of(lens);
        let t = cu[n] as usize;
        (
            Tensor::from_vec(&[t, h], x).unwrap(),
            Seqs::packed(&cu, t).unwrap(),
        )
    };
    let mut place = |y: &Tensor, from: &[usize], lens: &[usize]| {
        let cu = cu_of(lens);
        for i in 0..n {
            let (src, dst) = (cu[i] as usize * h, (cu_f[i] as usize + from[i]) * h);
            ours[dst..dst + lens[i] * h].copy_from_slice(&y.data()[src..src + lens[i] * h]);
        }
    };
    let (xp, sp) = part(&[0; 4], &prompt_lens);
    let (yp, mut cache) = l.prefill(&xp, &sp).unwrap();
    assert_eq!(cache.sequences(), n);
    place(&yp, &[0; 4], &prompt_lens);
    let (xe, se) = part(&prompt_lens, &ext_lens);
    let ye = l.extend(&xe, &se, &mut cache).unwrap();
    place(&ye, &prompt_lens, &ext_lens);
    for s in 0..steps {
        let from: Vec<usize> = (0..n).map(|i| prompt_lens[i] + ext_lens[i] + s).collect();
        let (xs, _) = part(&from, &[1; 4]);
        let ys = l.decode(&xs, &mut cache).unwrap();
        assert_eq!(ys.shape(), &[n, h]);
        place(&ys, &from, &[1; 4]);
    }
    let xf: Vec<f32> = full.concat();
    let yr = reference::forward(
        cfg,
        &RefParams::from_params(l.params()),
        &crate::testutil::to_f64(&xf),
        &cu_f.iter().map(|&c| c as usize).collect::<Vec<_>>(),
    );
    let e = max_rel(&ours, &yr);
    eprintln!(
        "prefill + extend + decode vs f64 layer ({:?}, ratio {}, W {}): {e:.2e}",
        cfg.variant, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    );
    assert!(
        e < 2e-5,
        "{cfg:?}: prefill + extend + decode vs f64 layer: {e}"
    );
    let seqs_f = Seqs::packed(&cu_f, tf).unwrap();
    let (yf, fin, _) = l
        .forward_with_state(&Tensor::from_vec(&[tf, h], xf).unwrap(), &seqs_f, None)
        .unwrap();
    let e = max_rel(&ours, &crate::testutil::to_f64(yf.data()));
    assert!(
        e < 2e-5,
        "prefill + extend + decode vs chunked forward: {e}"
    );
    let e = max_rel(cache.state.data(), &crate::testutil::to_f64(fin.data()));
    assert!(e < 2e-5, "decoded state vs forward's final state: {e}");
}

#[test]
fn prefill_extend_and_decode_match_the_f64_layer() {
    check_prefill_decode(&tiny(Normalization::RMSNorm, false, 2), 11);
    let mut c = tiny(Normalization::LayerNorm, true, 1);
    c.use_qk_l2norm_in_kernel = true;
    check_prefill_decode(&c, 12);
    let mut c = tiny(Normalization::RMSNorm, false, 4);
    c.linear_conv_kernel_dim = 1;
    check_prefill_decode(&c, 13);
    check_prefill_decode(&tiny2(Normalization::RMSNorm, false, 2), 14);
}

#[test]
fn prefill_returns_the_training_forward_and_its_states_bitwise() {
    let cfg = tiny(Normalization::RMSNorm, false, 2);
    let l = layer(&cfg, 21);
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let cu = cu_of(&[3, 0, 66, 2]);
    let t = cu[4] as usize;
    let x = Tensor::from_vec(&[t, 8], randn(&mut rng, t * 8, 1.0)).unwrap();
    let seqs = Seqs::packed(&cu, t).unwrap();
    let (y, cache) = l.prefill(&x, &seqs).unwrap();
    let (y0, fin, _) = l.forward_with_state(&x, &seqs, None).unwrap();
    assert_eq!(bits(&y), bits(&y0));
    assert_eq!(bits(&cache.state), bits(&fin));
    // conv rows: the last W - 1 = 2 tokens' in_proj q/k/v rows, zeros before a sequence's start
    let cd = cfg.conv_dim();
    assert_eq!(cache.conv.shape(), &[4, 2, cd]);
    let row = |i: usize, j: usize| &cache.conv.data()[(i * 2 + j) * cd..(i * 2 + j + 1) * cd];
    assert!(
        row(1, 0).iter().chain(row(1, 1)).all(|&v| v == 0.0),
        "empty sequence"
    );
    assert!(row(0, 0).iter().any(|&v| v != 0.0) && row(3, 0).iter().any(|&v| v != 0.0));
    // the same as decoding each prompt token by token from an empty cache
    let st = cache.state.shape()[1..].iter().product::<usize>();
    for (i, len) in [3usize, 0, 66, 2].into_iter().enumerate() {
        let mut c1 = l.empty_cache(1);
        for tok in cu[i] as usize..cu[i] as usize + len {
            let xs = x.data()[tok * 8..(tok + 1) * 8].to_vec();
            l.decode(&Tensor::from_vec(&[1, 8], xs).unwrap(), &mut c1)
                .unwrap();
        }
        let e = max_rel(
            c1.conv.data(),
            &crate::testutil::to_f64(row_pair(&cache, i, cd)),
        );
        assert!(
            e < 1e-6,
            "sequence {i}: conv rows decoded vs prefilled: {e}"
        );
        let want = &cache.state.data()[i * st..(i + 1) * st];
        let e = max_rel_floor(c1.state.data(), &crate::testutil::to_f64(want), 1e-6);
        assert!(e < 2e-5, "sequence {i}: state decoded vs prefilled: {e}");
    }
}

/// Sequence `i`'s two cached conv rows.
fn row_pair(cache: &InferenceCache, i: usize, cd: usize) -> &[f32] {
    &cache.conv.data()[i * 2 * cd..(i + 1) * 2 * cd]
}

#[test]
fn decode_errors_leave_the_cache_unchanged() {
    let cfg = tiny(Normalization::RMSNorm, false, 2);
    let l = layer(&cfg, 31);
    let mut cache = l.empty_cache(2);
    cache.state.data_mut()[0] = 0.5;
    let before = cache.clone();
    let bad = [
        (Tensor::zeros(&[2, 7]), "x"),
        (Tensor::zeros(&[2, 2, 8]), "x"),
        (Tensor::zeros(&[3, 8]), "cache.state"),
    ];
    for (x, needle) in bad {
        let e = l.decode(&x, &mut cache).unwrap_err();
        assert!(matches!(e, GdnError::Shape { .. }), "{e:?}");
        assert!(e.to_string().contains(needle), "{e}");
        assert_eq!(cache, before);
    }
    let mut wrong = before.clone();
    wrong.conv = Tensor::zeros(&[2, 1, cfg.conv_dim()]);
    let e = l.decode(&Tensor::zeros(&[2, 8]), &mut wrong).unwrap_err();
    assert!(e.to_string().contains("cache.conv"), "{e}");
    // extend: one cache row per sequence; padding rows after the last sequence give zeros
    let e = l
        .extend(
            &Tensor::zeros(&[3, 8]),
            &Seqs::packed(&[0, 1, 2, 3], 3).unwrap(),
            &mut cache,
        )
        .unwrap_err();
    assert!(e.to_string().contains("cache.state"), "{e}");
    assert_eq!(cache, before);
    let mut rng = ChaCha8Rng::seed_from_u64(32);
    let x = Tensor::from_vec(&[5, 8], randn(&mut rng, 40, 1.0)).unwrap();
    let y = l
        .extend(&x, &Seqs::packed(&[0, 2, 3], 5).unwrap(), &mut cache)
        .unwrap();
    assert!(y.data()[..24].iter().all(|v| v.is_finite() && *v != 0.0));
    assert!(y.data()[24..].iter().all(|&v| v == 0.0), "padding rows");
    assert_ne!(cache, before);
    // prefill checks its rows as the training forward does
    let e = l
        .prefill(
            &Tensor::zeros(&[5, 8]),
            &Seqs::packed(&[0, 2, 4], 4).unwrap(),
        )
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(e, GdnError::CuSeqlens(_)), "{e:?}");
}

/// `x` `[2^40, 0, hidden]` holds no values, but its batch would need 2^40 sequence boundaries:
/// an error naming the bytes, not an abort of the process.
#[test]
fn huge_batch_of_empty_sequences_is_an_error_not_an_abort() {
    let cfg = tiny(Normalization::RMSNorm, false, 1);
    let l = layer(&cfg, 1);
    let x = Tensor::from_vec(&[1 << 40, 0, cfg.hidden_size], Vec::new()).unwrap();
    let e = l.forward(&x).unwrap_err().to_string();
    assert!(e.contains("sequence boundaries"), "{e}");
    assert!(e.contains(&(8u128 << 40).to_string()), "{e}");
    // a small empty batch still works: zero tokens out
    let x = Tensor::from_vec(&[2, 0, cfg.hidden_size], Vec::new()).unwrap();
    let (y, _) = l.forward(&x).unwrap();
    assert_eq!(y.shape(), &[2, 0, cfg.hidden_size]);
}

/// Parameter memory where the layer runs: the fp32 masters, plus (GPU, bf16 storage) the bf16
/// copies of in_proj.weight and out_proj.weight that the GEMMs read.
#[test]
fn param_bytes_count_the_bf16_gemm_weight_copies() {
    use crate::backend::cuda::DType;
    use crate::backend::Device;
    use crate::layer::gdn::device_param_bytes;
    for c in [
        tiny(Normalization::RMSNorm, false, 2),
        tiny2(Normalization::LayerNorm, false, 2),
    ] {
        let f32b = c.param_bytes();
        assert_eq!(device_param_bytes(&c, Device::Cpu, DType::F32), f32b);
        assert_eq!(device_param_bytes(&c, Device::Cuda(0), DType::F32), f32b);
        let copies = 2 * (c.in_proj_dim() * c.hidden_size + c.hidden_size * c.v_dim()) as u128;
        assert_eq!(
            device_param_bytes(&c, Device::Cuda(1), DType::Bf16),
            f32b + copies
        );
        assert_eq!(GatedDeltaNet::new(&c, 1).unwrap().param_bytes(), f32b);
    }
}
