//! End-to-end tests of the `gdn` binary.

use std::path::{Path, PathBuf};

mod common;
use common::{expect_fail, gdn, layer_run, ok, stderr, tmpdir};

use gdn::io::{read_tensors, write_tensors};
use gdn::layer::param_specs;
use gdn::{GdnConfig, Normalization, Params, Tensor};

const HIDDEN: usize = 32;

fn small_cfg() -> GdnConfig {
    GdnConfig {
        hidden_size: HIDDEN,
        linear_num_key_heads: 1,
        linear_num_value_heads: 2,
        linear_key_head_dim: 8,
        linear_value_head_dim: 8,
        normalization: Normalization::RMSNorm,
        ..Default::default()
    }
}

fn ramp(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| {
            let v = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503));
            (v >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect();
    Tensor::from_vec(shape, data).unwrap()
}

/// config.toml, weights.safetensors (all parameters) in `d`; returns their paths.
fn setup(d: &Path) -> (PathBuf, PathBuf) {
    let cfg = small_cfg();
    let c = d.join("config.toml");
    std::fs::write(&c, cfg.to_toml_string()).unwrap();
    let w = d.join("weights.safetensors");
    let p = Params::init(&cfg, 1).unwrap();
    write_tensors(&w, &p.iter().collect::<Vec<_>>()).unwrap();
    (c, w)
}

fn write_x(path: &Path, x: &Tensor, dy: Option<&Tensor>) {
    let mut v = vec![("x", x)];
    if let Some(dy) = dy {
        v.push(("dy", dy));
    }
    write_tensors(path, &v).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn info_works() {
    let o = gdn(&["info"]);
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    for n in [
        "gdn ",
        "rayon threads:",
        "cpu",
        "cuda: ",
        "hidden_size = 2048",
        "RMSNorm",
    ] {
        assert!(out.contains(n), "info lacks {n:?}:\n{out}");
    }
}

#[test]
fn no_subcommand_is_an_error() {
    let o = gdn(&[]);
    expect_fail(&o, &[]);
}

#[test]
fn bad_config_names_the_field() {
    let d = tmpdir("badcfg");
    let (_, w) = setup(&d);
    let x = d.join("x.safetensors");
    write_x(&x, &ramp(&[1, 4, HIDDEN], 0), None);
    let out = d.join("out.safetensors");

    let c = d.join("bad.toml");
    std::fs::write(
        &c,
        format!("hidden_size = {HIDDEN}\nlinear_num_key_heads = 2\nlinear_num_value_heads = 3\n"),
    )
    .unwrap();
    let o = layer_run(&c, &w, &x, &out, &[]);
    expect_fail(&o, &["linear_num_value_heads", "bad.toml"]);
    assert!(!out.exists());

    std::fs::write(&c, "hiden_size = 64\n").unwrap();
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--input",
        s(&x),
        "--output",
        s(&out),
    ]);
    expect_fail(&o, &["hiden_size"]);

    let missing = d.join("no-such-config.toml");
    let o = gdn(&[
        "layer",
        "--config",
        s(&missing),
        "--input",
        s(&x),
        "--output",
        s(&out),
    ]);
    expect_fail(&o, &["no-such-config.toml"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn missing_weight_tensor_is_named() {
    let d = tmpdir("missingw");
    let (c, _) = setup(&d);
    let cfg = small_cfg();
    let p = Params::init(&cfg, 1).unwrap();
    let w = d.join("partial.safetensors");
    let kept: Vec<(&str, &Tensor)> = p.iter().filter(|(n, _)| *n != "dt_bias").collect();
    write_tensors(&w, &kept).unwrap();
    let x = d.join("x.safetensors");
    write_x(&x, &ramp(&[1, 4, HIDDEN], 0), None);
    let out = d.join("out.safetensors");
    let o = layer_run(&c, &w, &x, &out, &[]);
    expect_fail(&o, &["dt_bias", "partial.safetensors"]);
    assert!(!out.exists());

    // wrong shape
    let mut p2 = p.clone();
    p2.set("out_norm.weight", Tensor::zeros(&[3]));
    write_tensors(&w, &p2.iter().collect::<Vec<_>>()).unwrap();
    let o = layer_run(&c, &w, &x, &out, &[]);
    expect_fail(&o, &["out_norm.weight", "[3]"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn wrong_x_shape_fails() {
    let d = tmpdir("xshape");
    let (c, w) = setup(&d);
    let x = d.join("x.safetensors");
    let out = d.join("out.safetensors");
    for shape in [
        vec![1, 4, HIDDEN + 1],
        vec![4, HIDDEN],
        vec![1, 1, 4, HIDDEN],
    ] {
        write_x(&x, &ramp(&shape, 0), None);
        let o = layer_run(&c, &w, &x, &out, &[]);
        expect_fail(&o, &["x has shape"]);
        assert!(!out.exists());
    }
    // dy of another shape
    write_x(
        &x,
        &ramp(&[1, 4, HIDDEN], 0),
        Some(&ramp(&[1, 5, HIDDEN], 1)),
    );
    let o = layer_run(&c, &w, &x, &out, &[]);
    expect_fail(&o, &["dy has shape"]);
    // packed needs [1, T, hidden]
    write_x(&x, &ramp(&[2, 4, HIDDEN], 0), None);
    let o = layer_run(&c, &w, &x, &out, &["--cu-seqlens", "0,4,8"]);
    expect_fail(&o, &["[1, T, 32]"]);
    // no x at all
    write_tensors(&x, &[("X", &ramp(&[1, 4, HIDDEN], 0))]).unwrap();
    let o = layer_run(&c, &w, &x, &out, &[]);
    expect_fail(&o, &["unexpected tensor X"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn nan_with_check_finite_fails_without_output() {
    let d = tmpdir("nan");
    let (c, w) = setup(&d);
    let x = d.join("x.safetensors");
    let out = d.join("out.safetensors");
    let mut xt = ramp(&[2, 4, HIDDEN], 0);
    xt.data_mut()[37] = f32::NAN;
    write_x(&x, &xt, None);
    let o = layer_run(&c, &w, &x, &out, &["--check-finite"]);
    expect_fail(&o, &["x", "non-finite", "37"]);
    assert!(!out.exists());

    let mut dy = ramp(&[2, 4, HIDDEN], 1);
    dy.data_mut()[5] = f32::INFINITY;
    write_x(&x, &ramp(&[2, 4, HIDDEN], 0), Some(&dy));
    let o = layer_run(&c, &w, &x, &out, &["--check-finite"]);
    expect_fail(&o, &["dy", "non-finite"]);
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(&d).unwrap().count(),
        3,
        "only config, weights, x"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn unreadable_input_fails() {
    let d = tmpdir("noinput");
    let (c, w) = setup(&d);
    let out = d.join("out.safetensors");
    let x = d.join("does-not-exist.safetensors");
    let o = layer_run(&c, &w, &x, &out, &[]);
    expect_fail(&o, &["does-not-exist.safetensors"]);
    assert!(!out.exists());

    let junk = d.join("junk.safetensors");
    std::fs::write(&junk, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all").unwrap();
    let o = layer_run(&c, &w, &junk, &out, &[]);
    expect_fail(&o, &["junk.safetensors", "not a valid safetensors file"]);
    let o = layer_run(&c, &junk, &junk, &out, &[]);
    expect_fail(&o, &["junk.safetensors"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_arguments_fail() {
    let d = tmpdir("args");
    let (c, w) = setup(&d);
    let x = d.join("x.safetensors");
    write_x(&x, &ramp(&[1, 8, HIDDEN], 0), None);
    let out = d.join("out.safetensors");
    let base = [
        "layer",
        "--config",
        s(&c),
        "--weights",
        s(&w),
        "--input",
        s(&x),
        "--output",
        s(&out),
    ];
    let with = |extra: &[&str]| {
        let mut v: Vec<&str> = base.to_vec();
        v.extend_from_slice(extra);
        gdn(&v)
    };
    expect_fail(&with(&["--cu-seqlens", "0,4,x"]), &["cu-seqlens"]);
    expect_fail(&with(&["--cu-seqlens", "0,9"]), &["cu_seqlens"]);
    expect_fail(&with(&["--cu-seqlens", "1,8"]), &["cu_seqlens"]);
    expect_fail(&with(&["--cu-seqlens", "0,5,3"]), &["cu_seqlens"]);
    expect_fail(&with(&["--seed", "3"]), &["--seed"]);
    expect_fail(
        &with(&["--grad-output", s(&d.join("nope.safetensors"))]),
        &["nope.safetensors"],
    );
    // output into a missing directory: rejected before any work
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--weights",
        s(&w),
        "--input",
        s(&x),
        "--output",
        s(&d.join("missing/out.safetensors")),
    ]);
    expect_fail(&o, &["does not exist"]);
    // missing required flags
    let o = gdn(&["layer", "--config", s(&c)]);
    expect_fail(&o, &[]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

// The tests below run the layer's forward/backward.

fn names(path: &Path) -> Vec<String> {
    read_tensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect()
}

#[test]
fn forward_and_backward_write_every_tensor() {
    let d = tmpdir("fb");
    let (c, w) = setup(&d);
    let cfg = small_cfg();
    let x = d.join("x.safetensors");
    let dy = d.join("dy.safetensors");
    let out = d.join("out.safetensors");
    write_x(&x, &ramp(&[2, 9, HIDDEN], 0), None);
    write_tensors(&dy, &[("dy", &ramp(&[2, 9, HIDDEN], 1))]).unwrap();

    // forward only
    let o = layer_run(&c, &w, &x, &out, &[]);
    ok(&o);
    assert!(stderr(&o).contains("saved"), "{}", stderr(&o));
    let t = read_tensors(&out).unwrap();
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].0, "y");
    assert_eq!(t[0].1.shape(), &[2, 9, HIDDEN]);
    assert!(t[0].1.data().iter().all(|v| v.is_finite()));

    // forward + backward
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--weights",
        s(&w),
        "--input",
        s(&x),
        "--grad-output",
        s(&dy),
        "--output",
        s(&out),
        "--check-finite",
    ]);
    ok(&o);
    let t = read_tensors(&out).unwrap();
    let get = |n: &str| t.iter().find(|(m, _)| m == n).map(|(_, t)| t.clone());
    assert_eq!(get("y").unwrap().shape(), &[2, 9, HIDDEN]);
    assert_eq!(get("dx").unwrap().shape(), &[2, 9, HIDDEN]);
    for (name, shape) in param_specs(&cfg) {
        let g = get(name).unwrap_or_else(|| panic!("no gradient {name}"));
        assert_eq!(g.shape(), shape.as_slice(), "{name}");
    }
    assert_eq!(t.len(), 2 + param_specs(&cfg).len());

    // weights from --seed: runs, and is deterministic
    let out2 = d.join("out2.safetensors");
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--input",
        s(&x),
        "--output",
        s(&out2),
        "--seed",
        "1",
    ]);
    ok(&o);
    let o = gdn(&[
        "layer",
        "--config",
        s(&c),
        "--input",
        s(&x),
        "--output",
        s(&out),
        "--seed",
        "1",
    ]);
    ok(&o);
    assert_eq!(read_tensors(&out).unwrap(), read_tensors(&out2).unwrap());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn packed_sequences_run() {
    let d = tmpdir("packed");
    let (c, w) = setup(&d);
    let x = d.join("x.safetensors");
    let out = d.join("out.safetensors");
    write_x(
        &x,
        &ramp(&[1, 12, HIDDEN], 0),
        Some(&ramp(&[1, 12, HIDDEN], 1)),
    );
    let o = layer_run(&c, &w, &x, &out, &["--cu-seqlens", "0,5,5,12"]);
    ok(&o);
    let n = names(&out);
    assert!(
        n.contains(&"y".to_string()) && n.contains(&"dx".to_string()),
        "{n:?}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn example_runs() {
    let d = tmpdir("example");
    let dir = d.join("ex");
    let o = gdn(&["layer", "--example", s(&dir)]);
    ok(&o);
    for f in [
        "config.toml",
        "weights.safetensors",
        "input.safetensors",
        "dy.safetensors",
        "out.safetensors",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    let cfg = GdnConfig::from_toml_file(&dir.join("config.toml")).unwrap();
    assert_eq!(cfg.hidden_size, 64);
    let n = names(&dir.join("out.safetensors"));
    for (name, _) in param_specs(&cfg) {
        assert!(n.iter().any(|m| m == name), "{name} not in {n:?}");
    }
    assert!(n.iter().any(|m| m == "y") && n.iter().any(|m| m == "dx"));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn variant_gdn2_runs_and_bad_device_or_dtype_fail() {
    let d = tmpdir("variant");
    let (c, _) = setup(&d);
    let x = d.join("x.safetensors");
    let out = d.join("out.safetensors");
    write_x(
        &x,
        &ramp(&[1, 12, HIDDEN], 0),
        Some(&ramp(&[1, 12, HIDDEN], 1)),
    );
    let base = [
        "layer",
        "--config",
        s(&c),
        "--input",
        s(&x),
        "--output",
        s(&out),
    ];
    let o = gdn(&[&base[..], &["--variant", "gdn2"]].concat());
    ok(&o);
    // GDN2 has its own gate sections: every GDN2 parameter gradient is written
    let n = names(&out);
    assert!(
        n.contains(&"dt_bias".to_string()) && n.contains(&"dx".to_string()),
        "{n:?}"
    );
    expect_fail(
        &gdn(&[&base[..], &["--variant", "gdn3"]].concat()),
        &["unknown variant"],
    );
    expect_fail(
        &gdn(&[&base[..], &["--device", "tpu"]].concat()),
        &["unknown device"],
    );
    expect_fail(
        &gdn(&[&base[..], &["--dtype", "bf16"]].concat()),
        &["f32 only"],
    );
    if !gdn::device::cuda::driver_present() {
        expect_fail(
            &gdn(&[&base[..], &["--device", "cuda"]].concat()),
            &["CUDA driver"],
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// `--example` honours `--variant`, `--device` and `--dtype` (they were ignored: the example ran
/// a GDN layer on the CPU whatever was asked), and a device or dtype that cannot be used is an
/// error before any file is written.
#[test]
fn example_takes_device_dtype_and_variant() {
    let d = tmpdir("example-flags");
    let dir = d.join("ex2");
    let o = gdn(&["layer", "--example", s(&dir), "--variant", "gdn2"]);
    ok(&o);
    let cfg = GdnConfig::from_toml_file(&dir.join("config.toml")).unwrap();
    assert_eq!(cfg.variant, gdn::Variant::Gdn2);
    let n = names(&dir.join("out.safetensors"));
    for (name, _) in param_specs(&cfg) {
        assert!(
            n.iter().any(|m| m == name),
            "GDN2 gradient {name} not in {n:?}"
        );
    }
    let bad = d.join("never");
    expect_fail(
        &gdn(&["layer", "--example", s(&bad), "--dtype", "bf16"]),
        &["--dtype bf16: the CPU path computes in f32 only"],
    );
    assert!(!bad.exists(), "a refused example wrote {}", bad.display());
    if !gdn::device::cuda::driver_present() {
        let o = gdn(&["layer", "--example", s(&bad), "--device", "cuda"]);
        expect_fail(&o, &["libcuda"]);
        assert!(!bad.exists(), "a refused example wrote {}", bad.display());
    }
    std::fs::remove_dir_all(&d).unwrap();
}

fn gdn_kernels(cache: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gdn"))
        .arg("kernels")
        .args(args)
        .env("GDN_KERNEL_CACHE", cache)
        .output()
        .expect("run gdn")
}

#[test]
fn kernels_refuses_unknown_arch_and_module() {
    let d = tmpdir("kernels-bad");
    let o = gdn_kernels(&d, &["--arch", "sm_70"]);
    expect_fail(&o, &["--arch \"sm_70\"", "sm_90a"]);
    if gdn::device::cuda::nvrtc_version().is_empty() {
        return; // the module check runs after the NVRTC check
    }
    let o = gdn_kernels(&d, &["--module", "nope"]);
    expect_fail(&o, &["no kernel module named \"nope\"", "gated_delta_rule"]);
}

#[test]
fn kernels_fills_the_cache_once_and_reports_an_unwritable_one() {
    if gdn::device::cuda::nvrtc_version().is_empty() {
        assert!(
            std::env::var_os("GDN_REQUIRE_NVRTC").is_none(),
            "GDN_REQUIRE_NVRTC is set but NVRTC was not found"
        );
        eprintln!("NVRTC not found: gdn kernels not tested");
        return;
    }
    let d = tmpdir("kernels");
    let cache = d.join("cache");
    let first = ok(&gdn_kernels(
        &cache,
        &["--module", "smoke", "--arch", "sm_80"],
    ));
    assert!(first.contains("1 compiled"), "{first}");
    // one module: its PTX and the CUBIN NVRTC built beside it, nothing else
    let mut exts: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            assert!(
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("smoke-sm_80-"),
                "unexpected cache file {p:?}"
            );
            p.extension().unwrap().to_string_lossy().into_owned()
        })
        .collect();
    exts.sort();
    assert_eq!(exts, ["cubin", "ptx"], "{first}");
    let second = ok(&gdn_kernels(
        &cache,
        &["--module", "smoke", "--arch", "sm_80"],
    ));
    assert!(
        second.contains("0 compiled") && second.contains("1 already cached"),
        "{second}"
    );
    // the cache directory's place is taken by a file: an error naming it, no panic
    let blocked = d.join("blocked");
    std::fs::write(&blocked, b"mine").unwrap();
    let o = gdn_kernels(&blocked, &["--module", "smoke"]);
    expect_fail(&o, &["blocked"]);
    assert_eq!(
        std::fs::read(&blocked).unwrap(),
        b"mine",
        "the user's file was changed"
    );
}
