//! End-to-end tests of sizes and numbers from user input: huge configs are refused with the
//! bytes needed and available (never an abort), config type errors name the field, integers
//! beyond TOML's range are refused with the range, and numbers the tool prints are exact.

use std::path::{Path, PathBuf};

mod common;
use common::{expect_fail, gdn, ok, tmpdir};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `text` as a file `name` in a fresh temp dir.
fn file(name: &str, text: &str) -> PathBuf {
    let p = tmpdir("sizes").join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Values of the default (Megatron, LayerNorm) layer's parameters at width `h`: norm weight +
/// bias 2h, in_proj (2*16*128 + 2*32*128 + 2*32 = 12352) x h, conv 8192 x 4, dt_bias and
/// A_log 32 each, out_norm weight + bias 2*128, out_proj h x 4096.
fn default_layer_bytes(h: u128) -> u128 {
    4 * (2 * h + 12352 * h + 8192 * 4 + 32 + 32 + 256 + 4096 * h)
}

#[test]
fn layer_with_huge_hidden_size_is_refused_with_bytes() {
    for h in [1_000_000_000u128, 1 << 62] {
        let c = file("config.toml", &format!("hidden_size = {h}\n"));
        let dir = c.parent().unwrap();
        let o = gdn(&[
            "layer",
            "--config",
            s(&c),
            "--input",
            s(&dir.join("in.safetensors")),
            "--output",
            s(&dir.join("out.safetensors")),
        ]);
        let needs = format!("needs {} bytes", default_layer_bytes(h));
        let e = expect_fail(&o, &["gdn: error:", &needs, "bytes (", "more than the"]);
        assert!(e.contains(&format!("hidden_size {h}")), "{e}");
        assert!(!dir.join("out.safetensors").exists());
    }
}

#[test]
fn memory_with_huge_hidden_size_is_refused_with_bytes() {
    for h in [1_000_000_000u128, 1 << 62] {
        let c = file("config.toml", &format!("hidden_size = {h}\n"));
        let o = gdn(&["memory", "--config", s(&c)]);
        let needs = format!("needs {} bytes", default_layer_bytes(h));
        expect_fail(&o, &["gdn: error:", &needs, "more than the"]);
    }
}

#[test]
fn train_with_huge_sizes_is_refused_with_bytes() {
    for (text, needle) in [
        ("[model]\nhidden_size = 1000000000\n", "hidden_size"),
        ("[model]\nffn_hidden_size = 1000000000000\n", "bytes"),
        (
            "[model]\nnum_layers = 4611686018427387904\n",
            "num_layers 4611686018427387904",
        ),
    ] {
        let c = file("run.toml", text);
        let out = c.parent().unwrap().join("run");
        let o = gdn(&["train", "--config", s(&c), "--out", s(&out)]);
        expect_fail(&o, &["gdn: error:", "needs", "bytes", needle]);
    }
}

#[test]
fn memory_with_huge_tokens_prints_exact_numbers() {
    let c = file(
        "config.toml",
        "hidden_size = 64\nlinear_num_key_heads = 2\nlinear_num_value_heads = 4\n\
         linear_key_head_dim = 16\nlinear_value_head_dim = 16\n",
    );
    let tokens = u64::MAX;
    let out = ok(&gdn(&[
        "memory",
        "--config",
        s(&c),
        "--tokens",
        &tokens.to_string(),
    ]));
    assert!(out.contains(&format!("MiB@{tokens}")), "{out}");
    let mut rows = 0;
    for line in out.lines().filter(|l| !l.starts_with(char::is_whitespace)) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (Some(bpt), Some(mib)) = (
            cols.get(1).and_then(|c| c.parse::<u128>().ok()),
            cols.get(2).and_then(|c| c.parse::<f64>().ok()),
        ) else {
            continue;
        };
        let want = (bpt * tokens as u128) as f64 / (1024.0 * 1024.0);
        assert!(
            ((mib - want) / want).abs() < 1e-12,
            "{line}: MiB {mib}, expected {want}"
        );
        rows += 1;
    }
    assert_eq!(rows, 8, "{out}");
}

#[test]
fn seed_beyond_toml_range_in_a_config_file_is_an_error() {
    let c = file("run.toml", "[train]\nseed = 9223372036854775808\n");
    let out = c.parent().unwrap().join("run");
    let o = gdn(&["train", "--config", s(&c), "--out", s(&out)]);
    expect_fail(&o, &["gdn: error:", "train.seed", "9223372036854775807"]);
}

#[test]
fn config_type_errors_name_the_field() {
    let c = file("config.toml", "hidden_size = \"64\"\n");
    let dir = c.parent().unwrap();
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--input",
        s(&dir.join("in.safetensors")),
        "--output",
        s(&dir.join("out.safetensors")),
    ]);
    expect_fail(&o, &["hidden_size", "\"64\"", "expected an integer"]);

    let c = file("run.toml", "[model]\nhidden_size = \"64\"\n");
    let out = c.parent().unwrap().join("run");
    let o = gdn(&["train", "--config", s(&c), "--out", s(&out)]);
    expect_fail(&o, &["model.hidden_size", "\"64\"", "expected an integer"]);

    let c = file("run.toml", "[optimizer]\nlr = \"fast\"\n");
    let o = gdn(&["train", "--config", s(&c), "--out", s(&out)]);
    expect_fail(&o, &["optimizer.lr", "\"fast\"", "expected a number"]);
}

#[test]
fn written_configs_use_the_shortest_f32() {
    let out = ok(&gdn(&["info"]));
    assert!(out.contains("layernorm_epsilon = 0.00001\n"), "{out}");
    assert!(!out.contains("0.000009999999747378752"), "{out}");
    let dir = tmpdir("sizes-example").join("ex");
    ok(&gdn(&["layer", "--example", s(&dir)]));
    let text = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(text.contains("layernorm_epsilon = 0.00001\n"), "{text}");
    assert!(text.contains("init_method_std = 0.02\n"), "{text}");
}

#[test]
fn layer_forward_beyond_memory_is_refused_before_running() {
    // Small parameters (h = 1, Dk = 2^20: about 42 MB) but wide activations: per token
    // in_proj's output 2*2^20 + 2 + 2, the conv's 2*2^20 + 1 and the output 1 value.
    let dk: u128 = 1 << 20;
    let tokens: u128 = 100_000;
    let c = file(
        "config.toml",
        &format!(
            "hidden_size = 1\nlinear_num_key_heads = 1\nlinear_num_value_heads = 1\n\
             linear_key_head_dim = {dk}\nlinear_value_head_dim = 1\n"
        ),
    );
    let dir = c.parent().unwrap();
    let x = gdn::Tensor::zeros(&[1, tokens as usize, 1]);
    let input = dir.join("in.safetensors");
    gdn::io::write_tensors(&input, &[("x", &x)]).unwrap();
    let out = dir.join("out.safetensors");
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--input",
        s(&input),
        "--output",
        s(&out),
    ]);
    let bytes = tokens * ((2 * dk + 4) + (2 * dk + 1) + 1) * 4;
    expect_fail(
        &o,
        &[
            "gdn: error:",
            "the forward over x [1, 100000, 1]",
            &format!("needs {bytes} bytes"),
        ],
    );
    assert!(!out.exists());
}
