//! End-to-end tests of `gdn memory`.

use std::collections::HashMap;
use std::path::PathBuf;

mod common;
use common::{expect_fail, gdn, ok, tmpdir};

/// Every row `gdn memory` prints, in order.
const SETTINGS: &[&str] = &[
    "keep_rule_inputs",
    "keep_rule_inputs+l2norm_in_kernel",
    "none",
    "l2norm_in_kernel",
    "gdn_norm_out",
    "l2norm_in_kernel+gdn_norm_out",
    "gdn",
    "full",
];

// The small layer of these tests.
const H: usize = 64;
const HK: usize = 2;
const HV: usize = 4;
const DK: usize = 16;
const DV: usize = 12;

fn config_text(use_qk_l2norm: bool) -> String {
    format!(
        "hidden_size = {H}\nlinear_num_key_heads = {HK}\nlinear_num_value_heads = {HV}\n\
         linear_key_head_dim = {DK}\nlinear_value_head_dim = {DV}\nnormalization = \"RMSNorm\"\n\
         use_qk_l2norm = {use_qk_l2norm}\n"
    )
}

/// A config file with the small layer, in a fresh temp dir.
fn config_file(use_qk_l2norm: bool) -> PathBuf {
    let d = tmpdir("memory");
    let p = d.join("config.toml");
    std::fs::write(&p, config_text(use_qk_l2norm)).unwrap();
    p
}

/// One table row: the columns after the name.
#[derive(Debug)]
struct Row {
    bytes: usize,
    mib: f64,
    pct: f64,
    ms: Option<f64>,
    ratio: Option<f64>,
}

/// The table's rows by setting name, and the names in printed order. Table rows start at column
/// 0 with a setting name followed by an integer (the legend below the table is indented).
fn table(out: &str) -> (HashMap<String, Row>, Vec<String>) {
    let mut rows = HashMap::new();
    let mut order = Vec::new();
    for line in out.lines() {
        if line.starts_with(char::is_whitespace) {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || !SETTINGS.contains(&f[0]) {
            continue;
        }
        let Ok(bytes) = f[1].parse::<usize>() else {
            continue;
        };
        let row = Row {
            bytes,
            mib: f[2].parse().unwrap(),
            pct: f[3].trim_end_matches('%').parse().unwrap(),
            ms: f.get(4).map(|v| v.parse().unwrap()),
            ratio: f.get(5).map(|v| v.parse().unwrap()),
        };
        assert!(
            rows.insert(f[0].to_string(), row).is_none(),
            "row {} twice:\n{out}",
            f[0]
        );
        order.push(f[0].to_string());
    }
    (rows, order)
}

/// Runs `gdn memory` on the small layer and checks the table; returns the rows.
fn check_table(variant: &str) -> HashMap<String, Row> {
    let cfg = config_file(true);
    let tokens = 1000;
    let out = ok(&gdn(&[
        "memory",
        "--config",
        cfg.to_str().unwrap(),
        "--tokens",
        &tokens.to_string(),
        "--variant",
        variant,
    ]));
    assert!(
        out.contains(&format!("{} layer", variant.to_uppercase())),
        "{out}"
    );
    let (rows, order) = table(&out);
    assert_eq!(order, SETTINGS, "rows and their order:\n{out}");
    let b = |s: &str| rows[s].bytes;

    // What must hold whatever the shapes: each recompute option only removes tensors, so adding
    // one never keeps more, and each one named here removes something.
    let strictly_less = [
        ("keep_rule_inputs+l2norm_in_kernel", "keep_rule_inputs"),
        ("none", "keep_rule_inputs+l2norm_in_kernel"),
        ("gdn_norm_out", "none"),
        ("gdn", "gdn_norm_out"),
    ];
    for (small, big) in strictly_less {
        assert!(
            b(small) < b(big),
            "{small} ({}) should keep less than {big} ({}):\n{out}",
            b(small),
            b(big)
        );
    }
    assert_eq!(b("gdn"), b("full"), "both keep only x:\n{out}");
    // Once the rule's inputs are rebuilt, the L2 norm's placement keeps the same bytes (the
    // normalized copy is not kept either way).
    assert_eq!(b("l2norm_in_kernel"), b("none"), "{out}");
    assert_eq!(
        b("l2norm_in_kernel+gdn_norm_out"),
        b("gdn_norm_out"),
        "{out}"
    );

    // The differences are exactly the tensors each option drops (f32, per token).
    let (qk, vd) = (HK * DK, HV * DV);
    assert_eq!(b("gdn"), 4 * H, "whole-layer recompute keeps only x");
    assert_eq!(b("none") - b("gdn_norm_out"), 4 * vd, "norm_out");
    assert_eq!(
        b("keep_rule_inputs") - b("keep_rule_inputs+l2norm_in_kernel"),
        4 * 2 * qk,
        "normalized q/k"
    );
    // The default drops the conv outputs q, k, v (2qk + vd), the normalized q/k (2qk) and the
    // gates: GDN g, beta per value head (2Hv); GDN2 g and b repeated to each value head's key
    // channels (2 Hv*Dk), w per value channel (vd) and b per key channel (qk), and in_proj's
    // gate sections f, b, w (2qk + vd).
    let gates = match variant {
        "gdn" => 2 * HV,
        _ => 2 * HV * DK + vd + qk + (2 * qk + vd),
    };
    assert_eq!(
        b("keep_rule_inputs") - b("none"),
        4 * (4 * qk + vd + gates),
        "rule inputs"
    );
    // What `none` keeps: x, the input norm's rstd, in_proj's output (GDN: q|k|v, z, beta, alpha;
    // GDN2: q|k|v, z), o, its rstd per head, norm_out.
    let proj = match variant {
        "gdn" => 2 * qk + 2 * vd + 2 * HV,
        _ => 2 * qk + 2 * vd,
    };
    assert_eq!(
        b("none"),
        4 * (H + 1 + proj + vd + HV + vd),
        "none keeps x, stats, in_proj output, o, stats, norm_out"
    );

    // MiB and % columns follow from bytes/token.
    for (name, r) in &rows {
        let mib = (r.bytes * tokens) as f64 / (1024.0 * 1024.0);
        assert!(
            (r.mib - mib).abs() <= 0.005 + 1e-9,
            "{name}: MiB {} vs {mib}",
            r.mib
        );
        let pct = 100.0 * r.bytes as f64 / b("none") as f64;
        assert!(
            (r.pct - pct).abs() <= 0.05 + 1e-9,
            "{name}: % {} vs {pct}",
            r.pct
        );
        assert!(
            r.ms.is_none() && r.ratio.is_none(),
            "no time without --time"
        );
    }
    assert!(out.contains(&format!("MiB@{tokens}")), "{out}");
    assert!(
        out.contains("divides"),
        "says the division is exact:\n{out}"
    );
    rows
}

#[test]
fn table_lists_every_setting_in_memory_order() {
    let rows = check_table("gdn");
    // The % column is the share of `none`, the default; keeping the rule's inputs is above it.
    assert_eq!(rows["none"].pct, 100.0);
    assert!(rows["keep_rule_inputs"].pct > 100.0);
}

#[test]
fn gdn2_table() {
    check_table("gdn2");
}

#[test]
fn time_column_on_a_tiny_config() {
    let cfg = config_file(true);
    let o = gdn(&[
        "memory",
        "--config",
        cfg.to_str().unwrap(),
        "--tokens",
        "96",
        "--time",
        "--reps",
        "2",
    ]);
    let out = ok(&o);
    let (rows, order) = table(&out);
    assert_eq!(order, SETTINGS, "{out}");
    for (name, r) in &rows {
        let (ms, ratio) = (r.ms.unwrap(), r.ratio.unwrap());
        assert!(ms > 0.0 && ms.is_finite(), "{name}: {ms} ms");
        assert!(ratio > 0.0 && ratio.is_finite(), "{name}: ratio {ratio}");
    }
    assert_eq!(rows["none"].ratio, Some(1.0));
    assert!(out.contains("x none"), "{out}");
    // Progress on stderr: not a terminal here, so one plain line per run
    // (8 settings x (1 warm-up + 2 reps)).
    let err = String::from_utf8_lossy(&o.stderr);
    let lines = err.lines().filter(|l| l.contains("timing [")).count();
    assert_eq!(lines, SETTINGS.len() * 3, "progress lines:\n{err}");
    assert!(err.contains("[24/24]"), "{err}");
}

#[test]
fn default_config_is_qwen3_next() {
    let out = ok(&gdn(&["memory"]));
    assert!(out.contains("hidden 2048"), "{out}");
    assert!(out.contains("MiB@4096"), "{out}");
    let (rows, order) = table(&out);
    assert_eq!(order, SETTINGS);
    // Whole-layer recompute keeps x only: 2048 f32 per token.
    assert_eq!(rows["full"].bytes, 4 * 2048);
    // The default keeps x (2048), rstd (1), in_proj's output (2*2048 + 2*4096 + 2*32), o (4096),
    // its rstd per head (32) and norm_out (4096); keep_rule_inputs also the conv outputs
    // (2*2048 + 4096), the normalized q/k (2*2048) and g, beta (2*32).
    let none = 2048 + 1 + (2 * 2048 + 2 * 4096 + 2 * 32) + 4096 + 32 + 4096;
    assert_eq!(rows["none"].bytes, 4 * none);
    assert_eq!(
        rows["keep_rule_inputs"].bytes,
        4 * (none + (2 * 2048 + 4096) + 2 * 2048 + 2 * 32)
    );
}

#[test]
fn without_qk_l2norm_the_in_kernel_rows_are_left_out() {
    let cfg = config_file(false);
    let out = ok(&gdn(&["memory", "--config", cfg.to_str().unwrap()]));
    let (_, order) = table(&out);
    let want: Vec<&str> = SETTINGS
        .iter()
        .copied()
        .filter(|s| !s.contains("l2norm_in_kernel"))
        .collect();
    assert_eq!(order, want, "{out}");
    assert!(out.contains("use_qk_l2norm = false"), "{out}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let cfg = config_file(true);
    let c = cfg.to_str().unwrap();
    if !gdn::device::cuda::driver_present() {
        expect_fail(
            &gdn(&["memory", "--config", c, "--device", "cuda"]),
            &["CUDA driver"],
        );
    }
    expect_fail(&gdn(&["memory", "--variant", "gdn3"]), &["--variant"]);
    expect_fail(&gdn(&["memory", "--device", "tpu"]), &["--device"]);
    expect_fail(&gdn(&["memory", "--tokens", "0"]), &["--tokens"]);
    expect_fail(&gdn(&["memory", "--reps", "3"]), &["--time"]);
    expect_fail(&gdn(&["memory", "--time", "--reps", "0"]), &["--reps"]);
    expect_fail(
        &gdn(&["memory", "--config", "/nonexistent/gdn.toml"]),
        &["/nonexistent/gdn.toml"],
    );
}
