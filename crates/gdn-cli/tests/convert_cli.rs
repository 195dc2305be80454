//! `gdn convert` end to end: round trips through every layout are bitwise, errors are clear,
//! outputs are never replaced without --force.

mod common;
use common::{expect_fail, gdn, ok, tmpdir};

use gdn::convert::{testgen, Layout, RawDtype};

#[test]
fn convert_round_trips_every_layout_bitwise_and_reads_hf_config_json() {
    let cfg = testgen::small_config();
    let d = tmpdir("convert-rt");
    let cfg_path = d.join("cfg.toml");
    std::fs::write(&cfg_path, cfg.to_toml_string()).unwrap();
    let src = d.join("ours.safetensors");
    testgen::write(&src, Layout::Gdn, &cfg, RawDtype::Bf16, 1, 0).unwrap();
    let c = cfg_path.to_str().unwrap();
    for to in ["hf-qwen3-next", "hf-qwen3.5", "megatron"] {
        let mid = d.join(format!("mid-{to}"));
        let back = d.join(format!("back-{to}.safetensors"));
        let (m, b, s) = (
            mid.to_str().unwrap(),
            back.to_str().unwrap(),
            src.to_str().unwrap(),
        );
        ok(&gdn(&[
            "convert", "--from", "gdn", "--to", to, "--layer", "4", "--config", c, s, m,
        ]));
        ok(&gdn(&[
            "convert", "--from", to, "--to", "gdn", "--layer", "4", "--config", c, m, b,
        ]));
        assert_eq!(
            std::fs::read(&back).unwrap(),
            std::fs::read(&src).unwrap(),
            "{to}"
        );
    }
    // an HF folder's config.json stands in for --config
    let hf = d.join("hf");
    let want = testgen::write(&hf, Layout::HfQwen3Next, &cfg, RawDtype::F32, 2, 1).unwrap();
    let out = d.join("from-hf.safetensors");
    ok(&gdn(&[
        "convert",
        "--from",
        "hf-qwen3-next",
        "--to",
        "gdn",
        "--layer",
        "1",
        hf.to_str().unwrap(),
        out.to_str().unwrap(),
    ]));
    assert_eq!(
        gdn::convert::read_layer(&out, Layout::Gdn, 0, &cfg).unwrap(),
        want
    );
}

#[test]
fn convert_errors_are_clear() {
    let cfg = testgen::small_config();
    let d = tmpdir("convert-err");
    let src = d.join("ours.safetensors");
    testgen::write(&src, Layout::Gdn, &cfg, RawDtype::F32, 1, 0).unwrap();
    let cfg_path = d.join("cfg.toml");
    std::fs::write(&cfg_path, cfg.to_toml_string()).unwrap();
    let (s, c) = (src.to_str().unwrap(), cfg_path.to_str().unwrap());
    let out = d.join("o.safetensors");
    let o = out.to_str().unwrap();
    expect_fail(
        &gdn(&[
            "convert", "--from", "hf-qwen4", "--to", "gdn", "--config", c, s, o,
        ]),
        &["unknown layout", "hf-qwen3-next"],
    );
    expect_fail(
        &gdn(&[
            "convert", "--from", "megatron", "--to", "gdn", "--config", c, s, o,
        ]),
        &["no key ends in", "megatron"],
    );
    expect_fail(
        &gdn(&["convert", "--from", "gdn", "--to", "megatron", s, o]),
        &["--config"],
    );
    // existing output kept without --force
    std::fs::write(&out, b"keep").unwrap();
    expect_fail(
        &gdn(&[
            "convert", "--from", "gdn", "--to", "megatron", "--config", c, s, o,
        ]),
        &["--force"],
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"keep");
    ok(&gdn(&[
        "convert", "--from", "gdn", "--to", "megatron", "--force", "--config", c, s, o,
    ]));
    // a config that does not fit the checkpoint: shape error naming the tensor
    let other = gdn::GdnConfig {
        linear_key_head_dim: 8,
        ..cfg.clone()
    };
    std::fs::write(&cfg_path, other.to_toml_string()).unwrap();
    expect_fail(
        &gdn(&[
            "convert", "--from", "gdn", "--to", "megatron", "--force", "--config", c, s, o,
        ]),
        &["has shape", "expected"],
    );
}
