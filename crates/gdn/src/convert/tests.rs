use super::*;
use crate::layer::GatedDeltaNet;
use crate::seqs::Seqs;

fn tmpdir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "gdn-convert-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gdn2_config() -> GdnConfig {
    GdnConfig {
        variant: Variant::Gdn2,
        normalization: Normalization::LayerNorm,
        conv_bias: true,
        ..testgen::small_config()
    }
}

fn out_path(d: &Path, l: Layout) -> PathBuf {
    d.join(if l.is_hf() { "out" } else { "out.safetensors" })
}

#[test]
fn generated_checkpoints_read_back_as_the_independent_construction() {
    for dtype in [RawDtype::F32, RawDtype::Bf16] {
        for layout in Layout::ALL {
            let cfg = testgen::small_config();
            let d = tmpdir("gen");
            let p = out_path(&d, layout);
            let layer = if layout == Layout::Gdn { 0 } else { 3 };
            let want = testgen::write(&p, layout, &cfg, dtype, 11, layer).unwrap();
            let got = read_layer(&p, layout, layer, &cfg).unwrap();
            assert_eq!(got, want, "{layout:?} {dtype:?}");
        }
    }
}

#[test]
fn megatron_gdn2_with_biases_reads_back() {
    let cfg = gdn2_config();
    let d = tmpdir("g2");
    let p = d.join("m.safetensors");
    let want = testgen::write(&p, Layout::Megatron, &cfg, RawDtype::Bf16, 5, 1).unwrap();
    assert!(want.get("conv1d.bias").is_some() && want.get("out_norm.bias").is_some());
    assert_eq!(read_layer(&p, Layout::Megatron, 1, &cfg).unwrap(), want);
    // the HF layouts refuse GDN2
    let e = to_layout(&want, &cfg, Layout::HfQwen3Next).unwrap_err();
    assert!(e.to_string().contains("GDN layers only"), "{e}");
}

#[test]
fn round_trips_are_bitwise_through_every_layout_and_dtype() {
    for dtype in [RawDtype::F32, RawDtype::Bf16] {
        for layout in Layout::ALL {
            let cfg = testgen::small_config();
            let d = tmpdir("rt");
            let src = d.join("ours.safetensors");
            let ours = testgen::write(&src, Layout::Gdn, &cfg, dtype, 3, 0).unwrap();
            let mid = out_path(&d, layout);
            convert(&src, Layout::Gdn, layout, 2, &cfg, &mid, false).unwrap();
            let back = d.join("back.safetensors");
            convert(&mid, layout, Layout::Gdn, 2, &cfg, &back, false).unwrap();
            assert_eq!(read_layer(&back, Layout::Gdn, 0, &cfg).unwrap(), ours);
            // the files themselves: ours -> X -> ours gives the same bytes
            assert_eq!(
                std::fs::read(&back).unwrap(),
                std::fs::read(&src).unwrap(),
                "{layout:?} {dtype:?}"
            );
        }
    }
    // GDN2 through Megatron's keys
    let cfg = gdn2_config();
    let d = tmpdir("rt2");
    let src = d.join("ours.safetensors");
    let ours = testgen::write(&src, Layout::Gdn, &cfg, RawDtype::F32, 4, 0).unwrap();
    convert(
        &src,
        Layout::Gdn,
        Layout::Megatron,
        0,
        &cfg,
        &d.join("m"),
        false,
    )
    .unwrap();
    convert(
        &d.join("m"),
        Layout::Megatron,
        Layout::Gdn,
        0,
        &cfg,
        &d.join("b"),
        false,
    )
    .unwrap();
    assert_eq!(
        read_layer(&d.join("b"), Layout::Gdn, 0, &cfg).unwrap(),
        ours
    );
}

#[test]
fn hf_layer_gives_the_forward_of_the_same_weights_in_ours() {
    let cfg = testgen::small_config();
    let d = tmpdir("fwd");
    let hf = d.join("hf");
    let want = testgen::write(&hf, Layout::HfQwen3Next, &cfg, RawDtype::Bf16, 9, 1).unwrap();
    let ours = d.join("ours.safetensors");
    testgen::write(&ours, Layout::Gdn, &cfg, RawDtype::Bf16, 9, 0).unwrap();
    let a = GatedDeltaNet::with_params(
        &cfg,
        read_layer(&hf, Layout::HfQwen3Next, 1, &cfg)
            .unwrap()
            .to_params(&cfg)
            .unwrap(),
    )
    .unwrap();
    let b = GatedDeltaNet::with_params(&cfg, crate::io::read_params(&ours, &cfg).unwrap()).unwrap();
    let want = want.to_params(&cfg).unwrap();
    for (n, t) in want.iter() {
        assert_eq!(Some(t), b.params().get(n), "{n}");
        assert_eq!(Some(t), a.params().get(n), "{n}");
    }
    let x: Vec<f32> = (0..2 * 10 * cfg.hidden_size)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let x = Tensor::from_vec(&[2, 10, cfg.hidden_size], x).unwrap();
    let (ya, _) = a.forward(&x).unwrap();
    let (yb, _) = b.forward(&x).unwrap();
    assert_eq!(ya.data(), yb.data());
    // and the packed form
    let seqs = Seqs::packed(&[0, 7, 20], 20).unwrap();
    let x = x.reshape(&[20, cfg.hidden_size]).unwrap();
    let (ya, _) = a.forward_packed(&x, &seqs).unwrap();
    let (yb, _) = b.forward_packed(&x, &seqs).unwrap();
    assert_eq!(ya.data(), yb.data());
    assert!(ya.data().iter().any(|v| *v != 0.0));
}

#[test]
fn hf_config_json_gives_the_layer_config() {
    let cfg = testgen::small_config();
    for layout in [Layout::HfQwen3Next, Layout::HfQwen35] {
        let d = tmpdir("cj");
        testgen::write(&d.join("m"), layout, &cfg, RawDtype::F32, 1, 0).unwrap();
        let p = d.join("m/config.json");
        let c = config_from_hf_json(&read_text(&p).unwrap(), &p).unwrap();
        assert_eq!(c.linear_num_key_heads, 2);
        assert_eq!(c.linear_num_value_heads, 4);
        assert_eq!(c.linear_value_head_dim, 3);
        assert_eq!(c.hidden_size, 8);
        assert!(c.layernorm_zero_centered_gamma);
    }
    let e = config_from_hf_json("{\"hidden_size\": 8}", Path::new("c.json")).unwrap_err();
    assert!(e.to_string().contains("linear_num_key_heads"), "{e}");
}

#[test]
fn errors_name_missing_keys_shapes_layouts_and_existing_outputs() {
    let cfg = testgen::small_config();
    let d = tmpdir("err");
    // unknown layout
    let e = "hf-qwen4".parse::<Layout>().unwrap_err();
    assert!(e.to_string().contains("hf-qwen3-next"), "{e}");
    // missing keys: all of them listed
    let p = d.join("m.safetensors");
    let w = testgen::write(&p, Layout::Gdn, &cfg, RawDtype::F32, 1, 0).unwrap();
    let mut keyed: Vec<(String, Raw)> = to_layout(&w, &cfg, Layout::Megatron)
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n != "A_log" && n != "in_proj.weight.z")
        .map(|(n, t)| (format!("decoder.layers.0.self_attention.{n}"), t))
        .collect();
    let m = d.join("missing.safetensors");
    write_checkpoint(&m, Layout::Megatron, &keyed, 1, false).unwrap();
    let e = read_layer(&m, Layout::Megatron, 0, &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("in_proj.weight.z") && e.contains("A_log"), "{e}");
    // a shape mismatch names the key and both shapes
    keyed[0].1.shape = vec![4, 2];
    keyed[0].1.bytes.truncate(32);
    let s = d.join("shape.safetensors");
    write_checkpoint(&s, Layout::Megatron, &keyed, 1, false).unwrap();
    let e = from_layout(
        &keyed
            .iter()
            .map(|(n, t)| {
                (
                    n.trim_start_matches("decoder.layers.0.self_attention.")
                        .to_string(),
                    t.clone(),
                )
            })
            .collect(),
        &cfg,
        Layout::Megatron,
        "x",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("missing") || e.contains("shape"), "{e}");
    // the wrong layer, the wrong layout
    let e = read_layer(&p, Layout::HfQwen3Next, 0, &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no key ends in layers.0.linear_attn.in_proj_qkvz.weight"),
        "{e}"
    );
    let hf = d.join("hf");
    testgen::write(&hf, Layout::HfQwen3Next, &cfg, RawDtype::F32, 2, 0).unwrap();
    let e = read_layer(&hf, Layout::HfQwen3Next, 5, &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layers.5."), "{e}");
    // an existing output is kept unless forced
    let before = std::fs::read(&p).unwrap();
    let e = convert(&hf, Layout::HfQwen3Next, Layout::Gdn, 0, &cfg, &p, false).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), before);
    convert(&hf, Layout::HfQwen3Next, Layout::Gdn, 0, &cfg, &p, true).unwrap();
    assert_ne!(std::fs::read(&p).unwrap(), before);
    // a config whose heads differ from the checkpoint's: shape error naming the key
    let other = GdnConfig {
        linear_value_head_dim: 5,
        ..cfg.clone()
    };
    let e = read_layer(&hf, Layout::HfQwen3Next, 0, &other)
        .unwrap_err()
        .to_string();
    assert!(e.contains("has shape"), "{e}");
}
