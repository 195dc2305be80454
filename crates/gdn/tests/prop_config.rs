//! Configs and sizes from user input: errors (naming the field, stating bytes), never a panic.
//!
//! Property tests feed random TOML documents through `GdnConfig::from_toml_str` and
//! `RunConfig::from_toml_str` (the CLI's entry points), then the size checks of what a valid
//! config would allocate (allocating only small ones), and random `cu_seqlens` lists through
//! `Seqs::packed` / `Seqs::resolve`.

use gdn::model::{Model, ModelConfig};
use gdn::train::{RunConfig, Trainer};
use gdn::{GdnConfig, GdnError, Params, Seqs};
use proptest::prelude::*;

fn gdn_err(s: &str) -> String {
    GdnConfig::from_toml_str(s).unwrap_err().to_string()
}

fn run_err(s: &str) -> String {
    RunConfig::from_toml_str(s).unwrap_err().to_string()
}

#[test]
fn type_errors_name_the_field_the_value_and_the_expected_type() {
    let e = gdn_err("hidden_size = \"64\"\n");
    assert!(e.contains("hidden_size"), "{e}");
    assert!(e.contains("\"64\""), "{e}");
    assert!(e.contains("expected an integer"), "{e}");
    let e = gdn_err("hidden_size = 64\nlayernorm_epsilon = true\n");
    assert!(
        e.contains("layernorm_epsilon") && e.contains("expected a number"),
        "{e}"
    );
    let e = gdn_err("hidden_size = -1\n");
    assert!(e.contains("hidden_size") && e.contains("-1"), "{e}");

    let e = run_err("[model]\nhidden_size = \"64\"\n");
    assert!(e.contains("model.hidden_size"), "{e}");
    assert!(
        e.contains("\"64\"") && e.contains("expected an integer"),
        "{e}"
    );
    let e = run_err("[train]\nseed = \"x\"\n");
    assert!(e.contains("train.seed") && e.contains("\"x\""), "{e}");
    let e = run_err("[optimizer]\nlr = \"fast\"\n");
    assert!(
        e.contains("optimizer.lr") && e.contains("expected a number"),
        "{e}"
    );
    let e = run_err("[data]\nkind = 3\n");
    assert!(e.contains("data.kind") && e.contains('3'), "{e}");
    let e = run_err("[data]\nbatch_size = 1.5\n");
    assert!(e.contains("data.batch_size") && e.contains("1.5"), "{e}");
}

#[test]
fn integers_beyond_toml_range_are_errors_with_the_range() {
    // In a file: TOML itself cannot hold it; the error names the key and the range.
    let e = run_err("[train]\nseed = 9223372036854775808\n");
    assert!(e.contains("train.seed"), "{e}");
    assert!(e.contains("9223372036854775807"), "{e}");
    let e = run_err("[data]\nseed = 99999999999999999999\n");
    assert!(e.contains("data.seed"), "{e}");
    // Set programmatically (as `--seed` does): validate() refuses, writing does not panic.
    let mut c = RunConfig::default();
    c.train.seed = i64::MAX as u64 + 1;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("train.seed"), "{e}");
    assert!(e.contains("0..=9223372036854775807"), "{e}");
    assert!(e.contains("9223372036854775808"), "{e}");
    let text = c.to_toml_string();
    assert!(RunConfig::from_toml_str(&text).is_err());
    let mut c = RunConfig::default();
    c.train.train_iters = u64::MAX;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("train.train_iters"), "{e}");
    let mut c = RunConfig::default();
    c.model.ffn_hidden_size = usize::MAX;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("model.ffn_hidden_size"), "{e}");
    let _ = c.to_toml_string();
    let g = GdnConfig {
        num_layers: usize::MAX,
        ..GdnConfig::default()
    };
    let e = g.validate().unwrap_err().to_string();
    assert!(e.contains("num_layers"), "{e}");
    let _ = g.to_toml_string();
}

/// Values of the default (Megatron, LayerNorm) layer's parameters for width `h`, written out:
/// norm weight + bias 2h, in_proj (2*16*128 + 2*32*128 + 2*32 = 12352) x h, conv 8192 x 4,
/// dt_bias 32, A_log 32, out_norm weight + bias 2*128, out_proj h x 4096.
fn default_layer_values(h: u128) -> u128 {
    2 * h + 12352 * h + 8192 * 4 + 32 + 32 + 256 + 4096 * h
}

#[test]
fn huge_hidden_size_is_an_error_stating_bytes_before_allocating() {
    // 1e9: fits in the address space, not in this machine.
    let cfg = GdnConfig {
        hidden_size: 1_000_000_000,
        ..GdnConfig::default()
    };
    assert!(cfg.validate().is_ok());
    let bytes = 4 * default_layer_values(1_000_000_000);
    let e = Params::init(&cfg, 0).unwrap_err();
    assert!(matches!(e, GdnError::Memory { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains(&format!("needs {bytes} bytes")), "{e}");
    assert!(e.contains("hidden_size 1000000000"), "{e}");
    let e = gdn::GatedDeltaNet::new(&cfg, 0).unwrap_err().to_string();
    assert!(e.contains(&format!("needs {bytes} bytes")), "{e}");

    // 2^62: beyond any address space; the product must not wrap.
    let cfg = GdnConfig {
        hidden_size: 1 << 62,
        ..GdnConfig::default()
    };
    let bytes = 4 * default_layer_values(1 << 62);
    for e in [
        cfg.validate().unwrap_err(),
        Params::init(&cfg, 0).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(e.contains(&format!("needs {bytes} bytes")), "{e}");
        assert!(e.contains("9223372036854775807 bytes"), "{e}");
    }
    // A head count x head dim that overflows usize.
    let cfg = GdnConfig {
        linear_num_key_heads: 1 << 40,
        linear_num_value_heads: 1 << 40,
        linear_key_head_dim: 1 << 40,
        ..GdnConfig::default()
    };
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("linear_num_key_heads"), "{e}");
}

#[test]
fn huge_models_and_runs_are_errors_stating_bytes() {
    let layer = GdnConfig {
        hidden_size: 64,
        linear_num_key_heads: 2,
        linear_num_value_heads: 4,
        linear_key_head_dim: 16,
        linear_value_head_dim: 16,
        ..GdnConfig::default()
    };
    let m = ModelConfig {
        vocab_size: 256,
        ffn_hidden_size: 1 << 40,
        share_embeddings_and_output_weights: true,
        layer,
    };
    // 2F x h + h x F = 3 * 2^40 * 64 values in the MLP alone: 768 TiB of f32.
    let e = Model::new(&m, 0).unwrap_err().to_string();
    assert!(e.contains("needs") && e.contains("bytes"), "{e}");
    assert!(e.contains("ffn_hidden_size 1099511627776"), "{e}");

    let c = RunConfig::from_toml_str("[model]\nhidden_size = 1000000000\n").unwrap();
    let e = Trainer::new(&c).unwrap_err();
    assert!(matches!(e, GdnError::Memory { .. }), "{e}");
    // a batch whose activations cannot fit: 2^20 x 2^20 tokens
    let c = RunConfig::from_toml_str("[data]\nbatch_size = 1048576\nseq_length = 1048576\n");
    let e = match c {
        Ok(c) => Trainer::new(&c).unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("bytes"), "{e}");
    let e = run_err("[data]\nbatch_size = 4611686018427387904\n");
    assert!(
        e.contains("data.batch_size") && e.contains("overflows"),
        "{e}"
    );
}

#[test]
fn configs_print_the_shortest_f32() {
    let t = GdnConfig::default().to_toml_string();
    assert!(t.contains("layernorm_epsilon = 0.00001\n"), "{t}");
    assert!(t.contains("init_method_std = 0.02\n"), "{t}");
    assert!(!t.contains("0.000009999999747378752"), "{t}");
    let t = RunConfig::default().to_toml_string();
    assert!(t.contains("layernorm_epsilon = 0.00001\n"), "{t}");
    assert!(t.contains("a_init_range = [0.001, 0.01]\n"), "{t}");
}

/// Keys of the real configs, plus junk.
const GDN_KEYS: &[&str] = &[
    "hidden_size",
    "num_layers",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "normalization",
    "use_qk_l2norm",
    "use_qk_l2norm_in_kernel",
    "a_init_range",
    "conv_bias",
    "init_method_std",
    "deterministic_mode",
    "recompute_granularity",
    "recompute_method",
    "recompute_modules",
    "keep_rule_inputs",
    "variant",
    "junk",
];
const RUN_KEYS: &[(&str, &[&str])] = &[
    (
        "model",
        &["ffn_hidden_size", "share_embeddings_and_output_weights"],
    ),
    (
        "data",
        &[
            "kind",
            "path",
            "seq_length",
            "batch_size",
            "seed",
            "eval_sequences",
            "num_kv_pairs",
            "key_vocab_size",
            "value_vocab_size",
        ],
    ),
    (
        "optimizer",
        &[
            "lr",
            "min_lr",
            "lr_warmup_iters",
            "lr_decay_iters",
            "lr_decay_style",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "clip_grad",
        ],
    ),
    (
        "train",
        &[
            "train_iters",
            "seed",
            "log_interval",
            "eval_interval",
            "save_interval",
        ],
    ),
    ("junk", &["junk"]),
];

/// A TOML value as text: integers (small, huge, negative), floats (NaN, inf, tiny, huge),
/// strings (valid enum names and not), booleans, arrays.
fn value() -> impl Strategy<Value = String> {
    let ints = prop_oneof![
        Just(0i64),
        Just(1),
        Just(2),
        Just(4),
        Just(8),
        Just(16),
        Just(64),
        Just(-1),
        Just(i64::MAX),
        Just(i64::MIN),
        Just(1 << 31),
        Just(1 << 40),
        Just(1 << 62),
        Just(1_000_000_000),
        any::<i64>(),
    ]
    .prop_map(|i| i.to_string());
    let floats = prop_oneof![
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e-5".to_string()),
        Just("0.0".to_string()),
        Just("-1.0".to_string()),
        Just("1e300".to_string()),
        Just("1e-45".to_string()),
        (-1e6f64..1e6).prop_map(|f| format!("{f:e}")),
    ];
    let strings = prop_oneof![
        Just("\"gdn\"".to_string()),
        Just("\"gdn2\"".to_string()),
        Just("\"RMSNorm\"".to_string()),
        Just("\"selective\"".to_string()),
        Just("\"full\"".to_string()),
        Just("\"mqar\"".to_string()),
        Just("\"text\"".to_string()),
        Just("\"cosine\"".to_string()),
        Just("\"64\"".to_string()),
        Just("\"\"".to_string()),
        "[a-z]{0,6}".prop_map(|s| format!("\"{s}\"")),
    ];
    let scalar = prop_oneof![
        3 => ints,
        2 => floats,
        2 => strings,
        1 => any::<bool>().prop_map(|b| b.to_string()),
    ];
    prop_oneof![
        6 => scalar.clone(),
        1 => prop::collection::vec(scalar, 0..3).prop_map(|v| format!("[{}]", v.join(", "))),
    ]
}

fn gdn_doc() -> impl Strategy<Value = String> {
    prop::collection::vec((prop::sample::select(GDN_KEYS), value()), 0..8).prop_map(|kv| {
        let mut seen = std::collections::HashSet::new();
        kv.into_iter()
            .filter(|(k, _)| seen.insert(*k))
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect()
    })
}

fn run_doc() -> impl Strategy<Value = String> {
    let entry = (
        0..RUN_KEYS.len(),
        any::<prop::sample::Index>(),
        value(),
        any::<bool>(),
    );
    prop::collection::vec(entry, 0..10).prop_map(|es| {
        let mut sections: Vec<Vec<(String, String)>> = vec![Vec::new(); RUN_KEYS.len()];
        for (s, k, v, layer_key) in es {
            let (name, keys) = RUN_KEYS[s];
            let key = if name == "model" && layer_key {
                k.get(GDN_KEYS)
            } else {
                k.get(keys)
            };
            if !sections[s].iter().any(|(k2, _)| k2 == key) {
                sections[s].push((key.to_string(), v));
            }
        }
        let mut doc = String::new();
        for (i, kv) in sections.iter().enumerate() {
            if kv.is_empty() {
                continue;
            }
            doc.push_str(&format!("[{}]\n", RUN_KEYS[i].0));
            for (k, v) in kv {
                doc.push_str(&format!("{k} = {v}\n"));
            }
        }
        doc
    })
}

/// Allocate only what is small; of the rest, run the size checks (no allocation).
const ALLOC_CAP: u128 = 1 << 20;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_layer_configs_never_panic(doc in gdn_doc()) {
        if let Ok(cfg) = GdnConfig::from_toml_str(&doc) {
            // what validate() accepted can be written and read back unchanged
            let back = GdnConfig::from_toml_str(&cfg.to_toml_string());
            prop_assert!(back.is_ok(), "{doc}\n{:?}", back);
            let back = back.unwrap();
            prop_assert_eq!(back.to_toml_string(), cfg.to_toml_string());
            let bytes = cfg.param_bytes();
            if bytes <= ALLOC_CAP {
                let p = Params::init(&cfg, 0);
                prop_assert!(p.is_ok(), "{doc}\n{:?}", p.err());
                prop_assert_eq!(4 * p.unwrap().numel() as u128, bytes);
            } else {
                let _ = gdn::budget::check_host("test", bytes);
            }
            let _ = cfg.forward_bytes_at_least(usize::MAX);
        }
    }

    #[test]
    fn random_run_configs_never_panic(doc in run_doc()) {
        if let Ok(cfg) = RunConfig::from_toml_str(&doc) {
            let back = RunConfig::from_toml_str(&cfg.to_toml_string());
            prop_assert!(back.is_ok(), "{doc}\n{:?}", back);
            let _ = cfg.memory_bytes_at_least();
            let _ = cfg.check_memory();
            let m = cfg.model_config(cfg.vocab_size());
            if m.param_bytes() <= ALLOC_CAP && cfg.memory_bytes_at_least() <= 64 * ALLOC_CAP {
                let model = Model::new(&m, 0);
                prop_assert!(model.is_ok(), "{doc}\n{:?}", model.err());
                prop_assert_eq!(4 * model.unwrap().numel() as u128, m.param_bytes());
            }
        }
    }

    #[test]
    fn f32_fields_round_trip_through_their_shortest_text(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assume!(x.is_finite() && x > 0.0);
        let cfg = GdnConfig { layernorm_epsilon: x, init_method_std: x, ..GdnConfig::default() };
        let back = GdnConfig::from_toml_str(&cfg.to_toml_string()).unwrap();
        prop_assert_eq!(back.layernorm_epsilon.to_bits(), bits);
        prop_assert_eq!(back.init_method_std.to_bits(), bits);
    }

    #[test]
    fn random_cu_seqlens_never_panic(
        cu in prop::collection::vec(
            prop_oneof![
                Just(0u64), Just(1), Just(5), Just(64), Just(u64::MAX), Just(i64::MAX as u64),
                Just(u32::MAX as u64 + 1), any::<u64>(), 0u64..100
            ],
            0..8,
        ),
        padded in prop::option::of(prop::collection::vec(0u64..200, 0..5)),
        tokens in prop_oneof![Just(0usize), Just(64), Just(usize::MAX), 0usize..200],
        cp in prop_oneof![Just(0usize), Just(1), Just(2), Just(3), Just(usize::MAX)],
    ) {
        if let Ok(s) = Seqs::packed(&cu, tokens) {
            prop_assert!(s.used() <= s.tokens());
            prop_assert_eq!(s.count() + 1, cu.len());
        }
        let _ = Seqs::resolve(Some(&cu), padded.as_deref(), tokens, cp);
        let _ = Seqs::resolve(None, Some(&cu), tokens, cp);
    }
}

#[test]
fn gpu_free_memory_is_checked_where_a_gpu_is_present() {
    use gdn::device::cuda;
    if !cuda::driver_present() || cuda::device_count() == 0 {
        eprintln!("skipped: no CUDA driver or GPU here");
        return;
    }
    let g = cuda::gpu(0).unwrap();
    assert!(gdn::budget::check_gpu(&g, "a few bytes", 64).is_ok());
    let e = gdn::budget::check_gpu(&g, "everything", 1 << 62)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs 4611686018427387904 bytes"), "{e}");
    assert!(e.contains("free on cuda:0"), "{e}");
}
