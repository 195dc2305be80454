use super::*;
use crate::config::{RecomputeGranularity, Variant};
use crate::testutil::{bits, fd_grad, normal, rng, to_f64, with_threads, FD_STEP};
use crate::GdnConfig;
use rand::Rng;

/// A tiny model: every dimension different, so a term with the wrong dimension shows.
fn tiny(norm: Normalization, variant: Variant, tied: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        ffn_hidden_size: 6,
        share_embeddings_and_output_weights: tied,
        layer: GdnConfig {
            hidden_size: 8,
            num_layers: 2,
            linear_num_key_heads: 1,
            linear_num_value_heads: 2,
            linear_key_head_dim: 4,
            linear_value_head_dim: 3,
            normalization: norm,
            variant,
            // large enough that every path carries signal
            init_method_std: 0.4,
            ..GdnConfig::default()
        },
    }
}

/// A random batch; roughly a third of the targets ignored.
fn batch(cfg: &ModelConfig, b: usize, t: usize, seed: u64) -> Batch {
    let mut r = rng(seed);
    let v = cfg.vocab_size;
    let tokens: Vec<u32> = (0..b * t).map(|_| r.gen_range(0..v as u32)).collect();
    let targets: Vec<i32> = (0..b * t)
        .map(|_| {
            if r.gen_range(0..3) == 0 {
                IGNORE_INDEX
            } else {
                r.gen_range(0..v as i32)
            }
        })
        .collect();
    Batch::new(tokens, targets, b, t).unwrap()
}

/// A model whose 1-D parameters (norm weights, gates' biases) are perturbed away from their
/// constant init, so their gradients are tested on generic values.
fn model(cfg: &ModelConfig, seed: u64) -> Model {
    let mut m = Model::new(cfg, seed).unwrap();
    let mut r = rng(seed + 100);
    m.for_each_param_mut(|_, t| {
        if t.shape().len() == 1 {
            let noise = normal(&mut r, t.numel(), 0.3);
            t.data_mut()
                .iter_mut()
                .zip(noise)
                .for_each(|(x, e)| *x += e);
        }
    });
    m
}

/// Every parameter gradient of the model against central finite differences of the f64
/// reference model (the layer's own f64 reference inside).
fn fd_check(cfg: &ModelConfig, tol: f64) {
    let m = model(cfg, 3);
    let bt = batch(cfg, 2, 5, 4);
    let (st, saved) = m.forward(&bt).unwrap();
    let grads = m.backward(saved).unwrap();
    let mut p = reference::from_params(&m.params());
    let want_loss = reference::loss(cfg, &p, &bt.tokens, &bt.targets, 2, 5);
    assert!(
        (st.loss() - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
        "loss {} vs reference {want_loss}",
        st.loss()
    );
    // names in the same order as the gradients
    let names: Vec<String> = grads.names().iter().map(|s| s.to_string()).collect();
    let pn: Vec<String> = p.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, pn, "gradient order is parameter order");
    let mut fds = Vec::new();
    let mut global = 0.0f64;
    for pi in 0..p.len() {
        let len = p[pi].1.len();
        let mut fd = vec![0.0; len];
        for i in 0..len {
            let v = p[pi].1[i];
            p[pi].1[i] = v + FD_STEP;
            let lp = reference::loss(cfg, &p, &bt.tokens, &bt.targets, 2, 5);
            p[pi].1[i] = v - FD_STEP;
            let lm = reference::loss(cfg, &p, &bt.tokens, &bt.targets, 2, 5);
            p[pi].1[i] = v;
            fd[i] = (lp - lm) / (2.0 * FD_STEP);
        }
        global = fd.iter().fold(global, |a, v| a.max(v.abs()));
        fds.push(fd);
    }
    // Each tensor is judged relative to its own largest gradient, floored at 1% of the largest
    // gradient of the model.
    let floor = 1e-2 * global;
    for (pi, name) in names.iter().enumerate() {
        let g = grads.get(name).unwrap().data();
        let fd = &fds[pi];
        let scale = fd.iter().fold(floor, |a, v| a.max(v.abs()));
        let err = g
            .iter()
            .zip(fd)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max)
            / scale;
        assert!(
            err < tol,
            "{name}: rel err {err:.2e} (ours {:?}, fd {:?})",
            &g[..g.len().min(4)],
            &fd[..fd.len().min(4)]
        );
    }
}

#[test]
fn backward_matches_finite_differences_rmsnorm_tied() {
    fd_check(&tiny(Normalization::RMSNorm, Variant::Gdn, true), 1e-4);
}

#[test]
fn backward_matches_finite_differences_layernorm_untied_gdn2_recompute() {
    let mut cfg = tiny(Normalization::LayerNorm, Variant::Gdn2, false);
    cfg.layer.layernorm_zero_centered_gamma = true;
    cfg.layer.recompute_granularity = Some(RecomputeGranularity::Selective);
    cfg.layer.recompute_modules = Some(vec!["mlp".into(), "gdn_norm_out".into()]);
    fd_check(&cfg, 1e-4);
}

/// `fd_grad` is the helper the op tests use; the model check above inlines it to keep one
/// parameter vector. This checks the helper agrees with the inline loop on one tensor.
#[test]
fn inline_fd_equals_helper() {
    let cfg = tiny(Normalization::RMSNorm, Variant::Gdn, true);
    let m = model(&cfg, 3);
    let bt = batch(&cfg, 1, 4, 9);
    let p = reference::from_params(&m.params());
    let i = p
        .iter()
        .position(|(n, _)| n == "decoder.final_layernorm.weight")
        .unwrap();
    let helper = fd_grad(
        |x| {
            let mut q = p.clone();
            q[i].1 = x.to_vec();
            reference::loss(&cfg, &q, &bt.tokens, &bt.targets, 1, 4)
        },
        &p[i].1,
        FD_STEP,
    );
    let (_, saved) = m.forward(&bt).unwrap();
    let g = m.backward(saved).unwrap();
    crate::testutil::assert_close(
        "final norm weight",
        g.get("decoder.final_layernorm.weight").unwrap().data(),
        &helper,
        1e-3,
    );
}

fn grads_bits(g: &ModelGrads) -> Vec<(String, Vec<u32>)> {
    g.iter()
        .map(|(n, t)| (n.to_string(), bits(t.data())))
        .collect()
}

/// Every recompute setting gives the same loss and bitwise the same gradients, keeping fewer
/// bytes; and the result does not depend on the thread count.
#[test]
fn recompute_settings_are_bitwise_identical_and_threads_do_not_matter() {
    // Keeping everything (Megatron's default) against every recompute setting, the default
    // (the rule's inputs rebuilt in backward) included.
    let mut base = tiny(Normalization::RMSNorm, Variant::Gdn, true);
    base.layer.keep_rule_inputs = true;
    let bt = batch(&base, 3, 70, 11);
    let run = |cfg: &ModelConfig| {
        let m = model(cfg, 5);
        let (st, saved) = m.forward(&bt).unwrap();
        let bytes = saved.bytes();
        (st, bytes, grads_bits(&m.backward(saved).unwrap()))
    };
    let (st0, b0, g0) = run(&base);
    let settings: Vec<(Option<RecomputeGranularity>, Vec<&str>)> = vec![
        (None, vec![]),
        (Some(RecomputeGranularity::Selective), vec!["mlp"]),
        (Some(RecomputeGranularity::Selective), vec!["gdn_norm_out"]),
        (
            Some(RecomputeGranularity::Selective),
            vec!["gdn_prep", "mlp"],
        ),
        (Some(RecomputeGranularity::Selective), vec!["gdn"]),
        (Some(RecomputeGranularity::Full), vec![]),
    ];
    for (gran, mods) in settings {
        let mut cfg = base.clone();
        cfg.layer.keep_rule_inputs = false;
        cfg.layer.recompute_granularity = gran;
        cfg.layer.recompute_modules =
            (!mods.is_empty()).then(|| mods.iter().map(|s| s.to_string()).collect());
        let (st, b, g) = run(&cfg);
        assert_eq!(st, st0, "{gran:?} {mods:?}");
        assert!(b < b0, "{gran:?} {mods:?}: {b} bytes, not fewer than {b0}");
        assert!(g == g0, "{gran:?} {mods:?}: gradients differ");
    }
    let g1 = with_threads(1, || run(&base).2);
    let g3 = with_threads(3, || run(&base).2);
    assert!(g1 == g0 && g3 == g0, "gradients depend on the thread count");
}

/// `ModelSaved::bytes()` equals a closed-form count: per block the layer's own `Saved::bytes()`
/// (held against its formula by `tests/memory.rs`), the MLP input `n*h`, its norm statistics
/// `n` (RMSNorm) and `fc1`'s output `n*2F` (the last two dropped under `mlp` recompute); the
/// head's input `n*h`, statistics `n` and softmax `n*V`; tokens and targets `2n`; 4 bytes each.
#[test]
fn saved_bytes_are_exact() {
    for (mlp, tied) in [(false, true), (true, false)] {
        let mut cfg = tiny(Normalization::RMSNorm, Variant::Gdn, tied);
        if mlp {
            cfg.layer.recompute_granularity = Some(RecomputeGranularity::Selective);
            cfg.layer.recompute_modules = Some(vec!["mlp".into()]);
        }
        let (b, t) = (2, 9);
        let n = b * t;
        let (h, f, v) = (8, 6, 11);
        let layer = GatedDeltaNet::new(&cfg.layer, 0).unwrap();
        let (_, ls) = layer.forward(&Tensor::zeros(&[b, t, h])).unwrap();
        let layer_bytes = ls.bytes();
        let mlp_vals = n * h + if mlp { 0 } else { n + n * 2 * f };
        let want = 2 * layer_bytes + 4 * (2 * mlp_vals + n * h + n + n * v + 2 * n);
        let m = Model::new(&cfg, 1).unwrap();
        let (_, saved) = m.forward(&batch(&cfg, b, t, 2)).unwrap();
        assert_eq!(saved.bytes(), want, "mlp recompute {mlp}");
        assert_eq!(saved.gdn_bytes(), 2 * layer_bytes);
        assert_eq!(saved.block_bytes().len(), 2);
        assert_eq!(saved.tokens(), n);
    }
}

#[test]
fn evaluate_equals_training_forward() {
    let cfg = tiny(Normalization::LayerNorm, Variant::Gdn, false);
    let m = model(&cfg, 1);
    let bt = batch(&cfg, 2, 33, 3);
    let (st, _) = m.forward(&bt).unwrap();
    assert_eq!(m.evaluate(&bt).unwrap(), st);
}

#[test]
fn params_roundtrip_names_and_errors() {
    let cfg = tiny(Normalization::LayerNorm, Variant::Gdn, false);
    let m = Model::new(&cfg, 7).unwrap();
    let p = m.params();
    let specs = param_specs(&cfg);
    assert_eq!(
        p.names(),
        specs.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
    );
    assert_eq!(p.numel(), m.numel());
    assert!(p
        .get("decoder.layers.1.self_attention.in_proj.weight")
        .is_some());
    assert!(p
        .get("decoder.layers.0.mlp.linear_fc1.layer_norm_bias")
        .is_some());
    assert!(p.get(OUTPUT_LAYER).is_some());
    let m2 = Model::with_params(&cfg, &p).unwrap();
    assert_eq!(m2.params(), p);
    // same seed, same model; another seed, another
    assert_eq!(Model::new(&cfg, 7).unwrap().params(), p);
    assert_ne!(Model::new(&cfg, 8).unwrap().params(), p);

    let mut bad = p.clone();
    bad.set(OUTPUT_LAYER, Tensor::zeros(&[3, 8]));
    let e = Model::with_params(&cfg, &bad).unwrap_err().to_string();
    assert!(e.contains(OUTPUT_LAYER) && e.contains("[3, 8]"), "{e}");
    let mut extra = p.clone();
    extra.set("bogus", Tensor::zeros(&[1]));
    let e = Model::with_params(&cfg, &extra).unwrap_err().to_string();
    assert!(e.contains("unexpected tensor bogus"), "{e}");
    let tied = tiny(Normalization::LayerNorm, Variant::Gdn, true);
    let e = Model::with_params(&tied, &p).unwrap_err().to_string();
    assert!(e.contains("unexpected tensor output_layer.weight"), "{e}");
}

#[test]
fn bad_batches_and_configs_are_errors() {
    let cfg = tiny(Normalization::RMSNorm, Variant::Gdn, true);
    let m = Model::new(&cfg, 0).unwrap();
    let e = m
        .evaluate(&Batch::new(vec![11, 0], vec![0, 0], 1, 2).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokens[0] = 11"), "{e}");
    let e = m
        .evaluate(&Batch::new(vec![1, 0], vec![0, 11], 1, 2).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("targets[1] = 11"), "{e}");
    assert!(Batch::new(vec![1, 2, 3], vec![0, 0, 0], 2, 2).is_err());
    assert!(Batch::new(vec![], vec![], 0, 2).is_err());

    let mut c = cfg.clone();
    c.vocab_size = 0;
    assert!(Model::new(&c, 0)
        .unwrap_err()
        .to_string()
        .contains("vocab_size"));
    let mut c = cfg.clone();
    c.ffn_hidden_size = 0;
    assert!(Model::new(&c, 0)
        .unwrap_err()
        .to_string()
        .contains("ffn_hidden_size"));
    let mut c = cfg.clone();
    c.layer.recompute_modules = Some(vec!["mlp".into()]);
    let e = Model::new(&c, 0).unwrap_err().to_string();
    assert!(e.contains("recompute_granularity"), "{e}");
    let mut c = cfg;
    c.layer.linear_num_value_heads = 3;
    c.layer.linear_num_key_heads = 2;
    assert!(Model::new(&c, 0)
        .unwrap_err()
        .to_string()
        .contains("linear_num_value_heads"));
}

#[test]
fn all_targets_ignored_gives_zero_loss_and_gradients() {
    let cfg = tiny(Normalization::RMSNorm, Variant::Gdn, true);
    let m = model(&cfg, 0);
    let bt = Batch::new(vec![1, 2, 3, 4], vec![IGNORE_INDEX; 4], 1, 4).unwrap();
    let (st, saved) = m.forward(&bt).unwrap();
    assert_eq!((st.count, st.loss(), st.accuracy()), (0, 0.0, 0.0));
    let g = m.backward(saved).unwrap();
    assert!(g.iter().all(|(_, t)| t.data().iter().all(|&x| x == 0.0)));
}

#[test]
fn cross_entropy_and_swiglu_against_f64() {
    let mut r = rng(3);
    let (rows, v) = (5, 7);
    let logits = normal(&mut r, rows * v, 2.0);
    let targets = vec![3, IGNORE_INDEX, 0, 6, 2];
    let (st, probs) = loss::cross_entropy_forward(&logits, rows, v, &targets, true).unwrap();
    let probs = probs.unwrap();
    let ce = |l: &[f64]| -> f64 {
        let mut s = 0.0;
        for (i, &t) in targets.iter().enumerate() {
            if t == IGNORE_INDEX {
                continue;
            }
            let row = &l[i * v..(i + 1) * v];
            let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
            s += lse - row[t as usize];
        }
        s / 4.0
    };
    let l64 = to_f64(&logits);
    assert!((st.loss() - ce(&l64)).abs() < 1e-6);
    assert_eq!(st.count, 4);
    let d = loss::cross_entropy_backward(&probs, rows, v, &targets, st.count).unwrap();
    crate::testutil::assert_close("dlogits", &d, &fd_grad(ce, &l64, FD_STEP), 1e-5);
    assert!(loss::cross_entropy_forward(&logits, rows, v, &[0, 0, 0, 0, 7], false).is_err());

    let (rows, f) = (3, 4);
    let u = normal(&mut r, rows * 2 * f, 2.0);
    let da = normal(&mut r, rows * f, 1.0);
    let sw = |u: &[f64]| -> f64 {
        let mut s = 0.0;
        for i in 0..rows {
            for j in 0..f {
                let g = u[i * 2 * f + j];
                s += g / (1.0 + (-g).exp()) * u[i * 2 * f + f + j] * da[i * f + j] as f64;
            }
        }
        s
    };
    let du = swiglu::swiglu_backward(&u, rows, f, &da);
    crate::testutil::assert_close("du", &du, &fd_grad(sw, &to_f64(&u), FD_STEP), 1e-5);
}
