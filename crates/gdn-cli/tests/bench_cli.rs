//! End-to-end tests of `gdn bench` on the CPU: every column of a small run, the JSON file, the
//! ratio to FLA's numbers from `--fla-json`, and a clean error for every bad flag.

use std::path::{Path, PathBuf};

mod common;
use common::{expect_fail, gdn, ok, tmpdir};

// The small layer of these tests (RMSNorm, caller-side q/k L2 norm).
const H: usize = 64;
const HK: usize = 2;
const HV: usize = 4;
const DK: usize = 16;
const DV: usize = 12;

/// Bytes per token the layer keeps by default (`--recompute none`: the rule's inputs rebuilt in
/// backward), counted by hand (f32): x (H), the input norm's rstd (1), in_proj's output (conv
/// input 2*HK*DK + HV*DV, z HV*DV, beta/alpha 2*HV), the rule output o (HV*DV), its norm's rstd
/// (HV) and the gated norm's output (HV*DV).
const KEPT_NONE: usize =
    4 * (H + 1 + (2 * HK * DK + HV * DV) + HV * DV + 2 * HV + HV * DV + HV + HV * DV);

/// `--recompute keep_rule_inputs` (Megatron's default) also keeps the conv outputs
/// (2*HK*DK + HV*DV), the normalized q/k (2*HK*DK) and g and beta (2*HV).
const KEPT_KEEP: usize = KEPT_NONE + 4 * ((2 * HK * DK + HV * DV) + 2 * HK * DK + 2 * HV);

/// The rows of each shape's table.
const ROWS: &[&str] = &["layer fwd", "layer fwd+bwd", "rule fwd", "rule fwd+bwd"];

fn config_file() -> PathBuf {
    let d = tmpdir("bench");
    let p = d.join("config.toml");
    std::fs::write(
        &p,
        format!(
            "hidden_size = {H}\nlinear_num_key_heads = {HK}\nlinear_num_value_heads = {HV}\n\
             linear_key_head_dim = {DK}\nlinear_value_head_dim = {DV}\nnormalization = \"RMSNorm\"\n"
        ),
    )
    .unwrap();
    p
}

/// `gdn bench --config <small> --reps 2 --warmup 1` plus `extra`.
fn bench(cfg: &Path, extra: &[&str]) -> std::process::Output {
    let mut a = vec![
        "bench",
        "--config",
        cfg.to_str().unwrap(),
        "--reps",
        "2",
        "--warmup",
        "1",
    ];
    a.extend_from_slice(extra);
    gdn(&a)
}

/// The lines of the block of shape `BbTt` (from its title to the next blank line).
fn block(out: &str, b: usize, t: usize) -> Vec<&str> {
    let title = format!("shape B{b} T{t} ({} tokens)", b * t);
    let mut lines = out.lines().skip_while(|l| *l != title);
    assert!(lines.next().is_some(), "no block {title:?} in:\n{out}");
    lines.take_while(|l| !l.is_empty()).collect()
}

/// The columns after the row's name (two words), split on whitespace.
fn row<'a>(block: &[&'a str], name: &str) -> Vec<&'a str> {
    let line = block
        .iter()
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(char::is_whitespace))
        })
        .unwrap_or_else(|| panic!("no row {name:?} in {block:#?}"));
    line.split_whitespace().skip(2).collect()
}

/// `1.23 (1.01..2.34)` -> (median, min, max).
fn stat(median: &str, range: &str) -> (f64, f64, f64) {
    let r = range
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not a (min..max) range: {range:?}"));
    let (lo, hi) = r.split_once("..").unwrap();
    (
        median.parse().unwrap(),
        lo.parse().unwrap(),
        hi.parse().unwrap(),
    )
}

#[test]
fn small_shapes_print_every_column() {
    let cfg = config_file();
    let out = ok(&bench(&cfg, &["--shape", "2x70", "--shape", "1x64"]));
    assert!(out.starts_with(&format!(
        "gdn bench: GDN layer, hidden {H}, {HK} key heads x {DK}, {HV} value heads x {DV}"
    )));
    assert!(out.contains("recompute none; device cpu"), "{out}");
    assert!(out.contains("median (min..max) of 2 reps after 1 warm-up runs"));
    assert!(out.contains("host = wall clock") && out.contains("gpu = span of CUDA events"));
    for (b, t) in [(2, 70), (1, 64)] {
        let bl = block(&out, b, t);
        let header: Vec<&str> = bl[0].split_whitespace().collect();
        assert_eq!(
            header,
            [
                "what",
                "host",
                "ms",
                "(min..max)",
                "gpu",
                "ms",
                "(min..max)"
            ]
        );
        for name in ROWS {
            let c = row(&bl, name);
            assert_eq!(c.len(), 3, "{name}: {c:?}");
            let (med, lo, hi) = stat(c[0], c[1]);
            assert!(lo > 0.0 && lo <= med && med <= hi, "{name}: {c:?}");
            assert_eq!(c[2], "n/a", "the CPU has no GPU clock");
        }
        let kept = format!(
            "kept for backward: {KEPT_NONE}.0 bytes/token (Saved::bytes() {} / {} tokens)",
            KEPT_NONE * b * t,
            b * t
        );
        assert!(
            bl.iter().any(|l| l.starts_with(&kept)),
            "{kept:?} in {bl:#?}"
        );
        assert!(bl.contains(&"peak: n/a on the CPU (no allocator counter)"));
        // The stage split: every stage of forward and backward, percentages adding to 100.
        let stages: Vec<&str> = bl
            .iter()
            .copied()
            .skip_while(|l| !l.starts_with("stages of one profiled fwd+bwd"))
            .skip(1)
            .collect();
        for s in [
            "fwd in_proj",
            "fwd conv + l2norm + gates",
            "fwd gated delta rule",
            "fwd gated norm",
            "fwd out_proj",
            "bwd out_proj",
            "bwd gated norm",
            "bwd rule",
            "bwd gates + l2norm + conv",
            "bwd in_proj",
            "outside the stages",
        ] {
            assert!(
                stages.iter().any(|l| l.trim_start().starts_with(s)),
                "stage {s:?} missing in {stages:#?}"
            );
        }
        let pct: f64 = stages
            .iter()
            .map(|l| {
                l.split_whitespace()
                    .last()
                    .unwrap()
                    .trim_end_matches('%')
                    .parse::<f64>()
                    .unwrap()
            })
            .sum();
        assert!((pct - 100.0).abs() < 1.0, "stage shares add to {pct}");
    }
}

#[test]
fn recompute_setting_changes_what_is_kept() {
    let cfg = config_file();
    // `gdn` keeps only the layer input x: H f32 values per token.
    let out = ok(&bench(&cfg, &["--shape", "1x64", "--recompute", "gdn"]));
    assert!(out.contains("recompute gdn;"), "{out}");
    assert!(
        out.contains(&format!("kept for backward: {}.0 bytes/token", 4 * H)),
        "{out}"
    );
    // Backward reruns the forward: its stages appear a second time.
    assert!(out.contains("(again: recompute in backward)"), "{out}");
}

#[test]
fn keep_rule_inputs_keeps_the_rule_inputs() {
    let cfg = config_file();
    let out = ok(&bench(
        &cfg,
        &["--shape", "1x64", "--recompute", "keep_rule_inputs"],
    ));
    assert!(out.contains("recompute keep_rule_inputs;"), "{out}");
    assert!(
        out.contains(&format!("kept for backward: {KEPT_KEEP}.0 bytes/token")),
        "{out}"
    );
    // gdn_prep is the default now; the row (and the setting name) is gone.
    expect_fail(
        &bench(&cfg, &["--shape", "1x64", "--recompute", "gdn_prep"]),
        &["gdn: error:", "--recompute \"gdn_prep\"", "none"],
    );
}

#[test]
fn json_has_every_field() {
    let cfg = config_file();
    let d = tmpdir("bench-json");
    let j = d.join("bench.json");
    ok(&bench(
        &cfg,
        &[
            "--shape",
            "1x64",
            "--shape",
            "2x40",
            "--json",
            j.to_str().unwrap(),
        ],
    ));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["dtype"], "f32");
    assert_eq!(v["variant"], "GDN");
    assert_eq!(v["recompute"], "none");
    assert_eq!(v["reps"], 2);
    assert_eq!(v["warmup"], 1);
    assert!(v["gpu"].is_null());
    assert_eq!(v["config"]["hidden_size"], H);
    assert_eq!(v["config"]["num_value_heads"], HV);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, (b, t)) in rows.iter().zip([(1usize, 64usize), (2, 40)]) {
        assert_eq!(r["batch"], b);
        assert_eq!(r["seq_len"], t);
        assert_eq!(r["tokens"], b * t);
        for m in ["layer_fwd", "layer_fwd_bwd", "rule_fwd", "rule_fwd_bwd"] {
            let h = &r[m]["host_ms"];
            let (med, lo, hi) = (
                h["median"].as_f64().unwrap(),
                h["min"].as_f64().unwrap(),
                h["max"].as_f64().unwrap(),
            );
            assert!(lo > 0.0 && lo <= med && med <= hi, "{m}: {h}");
            assert!(r[m]["gpu_ms"].is_null(), "{m}");
        }
        assert_eq!(r["kept_bytes"], KEPT_NONE * b * t);
        assert_eq!(r["kept_bytes_per_token"].as_f64(), Some(KEPT_NONE as f64));
        assert!(r["peak_bytes"].is_null() && r["peak_bytes_over_start"].is_null());
        assert!(r["rule_kernels_ms"].is_null());
        assert!(r["fla"].is_null());
        let stages = r["stages"].as_array().unwrap();
        // forward: in_proj, prep, rule, gated norm, out_proj; backward: out_proj, gated norm,
        // rule, gates + l2norm + conv, in_proj
        assert_eq!(stages.len(), 10, "{stages:?}");
        let in_stages: f64 = stages.iter().map(|s| s["ms"].as_f64().unwrap()).sum();
        assert!(in_stages <= r["profiled_ms"].as_f64().unwrap());
        assert_eq!(stages[0]["stage"], "fwd in_proj (norm + GEMM)");
        assert!(stages.iter().all(|s| s["ms"].as_f64().unwrap() >= 0.0));
        assert!(r["profiled_ms"].as_f64().unwrap() > 0.0);
    }
}

/// FLA's file as bench/fla_layer_json.py writes it, with times chosen here.
fn fla_file(dir: &Path, hidden: usize) -> PathBuf {
    let p = dir.join("fla.json");
    std::fs::write(
        &p,
        format!(
            r#"{{"source": "hand-written", "gpu": "none", "hidden_size": {hidden}, "num_heads": {HK},
               "num_v_heads": {HV}, "head_dim": {DK},
               "rows": [{{"batch": 1, "seq_len": 64, "fwd_ms": 0.01, "fwd_bwd_ms": 0.02,
                          "rule_fwd_ms": 0.03, "rule_fwd_bwd_ms": 0.04,
                          "kept_bytes_per_token": 1234.5, "peak_bytes_over_start": 1048576}},
                        {{"batch": 9, "seq_len": 9, "fwd_ms": 5.0, "fwd_bwd_ms": 6.0}}]}}"#
        ),
    )
    .unwrap();
    p
}

#[test]
fn fla_json_gives_ours_over_fla() {
    // head_dim is compared with Dk and Dv: this layer needs Dk = Dv.
    let d = tmpdir("bench-fla");
    let cfg = d.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "hidden_size = {H}\nlinear_num_key_heads = {HK}\nlinear_num_value_heads = {HV}\n\
             linear_key_head_dim = {DK}\nlinear_value_head_dim = {DK}\nnormalization = \"RMSNorm\"\n"
        ),
    )
    .unwrap();
    let fla = fla_file(&d, H);
    let j = d.join("ours.json");
    let out = ok(&bench(
        &cfg,
        &[
            "--shape",
            "1x64",
            "--shape",
            "1x32",
            "--fla-json",
            fla.to_str().unwrap(),
            "--json",
            j.to_str().unwrap(),
        ],
    ));
    assert!(
        out.contains("FLA: hand-written (none); ours/FLA compares host ms"),
        "{out}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    let r0 = &v["rows"][0];
    let bl = block(&out, 1, 64);
    let header: Vec<&str> = bl[0].split_whitespace().collect();
    assert_eq!(&header[7..], ["FLA", "ms", "ours/FLA"]);
    // The FLA times written above; the ratio from our median (full precision, from the JSON).
    for (name, key, fla_ms) in [
        ("layer fwd", "layer_fwd", 0.01),
        ("layer fwd+bwd", "layer_fwd_bwd", 0.02),
        ("rule fwd", "rule_fwd", 0.03),
        ("rule fwd+bwd", "rule_fwd_bwd", 0.04),
    ] {
        let c = row(&bl, name);
        assert_eq!(c.len(), 5, "{name}: {c:?}");
        assert_eq!(c[3].parse::<f64>().unwrap(), fla_ms, "{name}: FLA ms");
        let ours = r0[key]["host_ms"]["median"].as_f64().unwrap();
        let want = ours / fla_ms;
        let got: f64 = c[4].parse().unwrap();
        assert!(
            (got - want).abs() <= 0.0051,
            "{name}: printed ratio {got}, expected {ours} / {fla_ms} = {want}"
        );
    }
    // (the JSON's median went through text: equal to rounding, not always to the last bit)
    let ratio = r0["fla"]["ratio_fwd_bwd"].as_f64().unwrap();
    let want = r0["layer_fwd_bwd"]["host_ms"]["median"].as_f64().unwrap() / 0.02;
    assert!(
        (ratio - want).abs() <= 1e-12 * want.abs(),
        "JSON ratio_fwd_bwd {ratio}, expected {want}"
    );
    assert!(
        bl.iter().any(|l| l.ends_with("; FLA 1234.5 bytes/token")),
        "{bl:#?}"
    );
    // A shape FLA did not run: dashes and a note, no ratio.
    let bl = block(&out, 1, 32);
    let c = row(&bl, "layer fwd");
    assert_eq!(&c[3..], ["-", "-"]);
    assert!(bl.contains(&"  (no FLA row for B1 T32 in --fla-json)"));
    assert!(v["rows"][1]["fla"].is_null());

    // FLA's layer of another width: refused, not compared.
    let other = fla_file(&tmpdir("bench-fla2"), 2 * H);
    expect_fail(
        &bench(
            &cfg,
            &["--shape", "1x64", "--fla-json", other.to_str().unwrap()],
        ),
        &["gdn: error:", "hidden_size = 128", "different layers"],
    );
}

#[test]
fn bad_flags_are_errors() {
    let cfg = config_file();
    let run = |extra: &[&str]| bench(&cfg, extra);
    // Shapes (parsed by gdn: `gdn: error:` lines).
    for (shape, needle) in [
        ("0x8", "the batch B must be at least 1"),
        ("8x0", "the sequence length T must be at least 1"),
        ("64", "no 'x' between B and T"),
        ("1x-5", "is not a whole number"),
        ("1x99999999999999999999999", "is not a whole number"),
        ("4294967296x4294967296", "tokens overflow"),
        ("4294967296x1073741824", "values overflow"),
    ] {
        expect_fail(
            &run(&["--shape", shape]),
            &["gdn: error:", "--shape", needle],
        );
    }
    // A shape that fits in the arithmetic but not in memory: refused before allocating.
    expect_fail(
        &run(&["--shape", "100000000000x100000"]),
        &["gdn: error:", "benchmarking --shape 100000000000x100000"],
    );
    expect_fail(
        &run(&["--device", "tpu"]),
        &["gdn: error:", "--device \"tpu\"", "unknown device"],
    );
    expect_fail(
        &run(&["--dtype", "f16"]),
        &["gdn: error:", "--dtype \"f16\""],
    );
    expect_fail(
        &run(&["--dtype", "bf16"]),
        &["gdn: error:", "needs --device cuda"],
    );
    expect_fail(
        &run(&["--recompute", "most"]),
        &["gdn: error:", "--recompute \"most\"", "keep_rule_inputs"],
    );
    expect_fail(
        &run(&["--fla-json", "/nonexistent/fla.json"]),
        &["gdn: error:", "/nonexistent/fla.json"],
    );
    let d = tmpdir("bench-bad");
    let junk = d.join("junk.json");
    std::fs::write(&junk, "{\"rows\": [{\"batch\": 1}]}").unwrap();
    expect_fail(
        &run(&["--fla-json", junk.to_str().unwrap()]),
        &["gdn: error:", "not FLA's bench JSON"],
    );
    std::fs::write(
        &junk,
        "{\"rows\": [{\"batch\": 1, \"seq_len\": 8, \"fwd_ms\": -1, \"fwd_bwd_ms\": 2}]}",
    )
    .unwrap();
    expect_fail(
        &run(&["--fla-json", junk.to_str().unwrap()]),
        &["gdn: error:", "fwd_ms = -1", "not a positive time"],
    );
    expect_fail(
        &run(&["--json", "/nonexistent/dir/out.json"]),
        &["gdn: error:", "/nonexistent/dir", "does not exist"],
    );
    expect_fail(
        &run(&["--json", d.to_str().unwrap()]),
        &["gdn: error:", "is a folder"],
    );
    // clap's ranges (clap's `error:` line names the flag).
    for arg in [
        "--reps=0",
        "--reps=10001",
        "--reps=-1",
        "--warmup=1001",
        "--warmup=x",
    ] {
        let flag = arg.split('=').next().unwrap();
        expect_fail(&run(&[arg]), &["error:", flag]);
    }
    // No GPU here: a clean error naming what is missing, not a panic.
    if !gdn::device::cuda::driver_present() {
        expect_fail(
            &run(&["--device", "cuda", "--shape", "1x8"]),
            &["gdn: error:", "CUDA driver"],
        );
    }
}

#[test]
fn default_shape_runs_on_the_cpu() {
    // No --shape: the CPU default (1x256) of the default (Qwen3-Next) layer, one rep.
    let out = ok(&gdn(&["bench", "--reps", "1", "--warmup", "0"]));
    assert!(out.contains("hidden 2048, 16 key heads x 128, 32 value heads x 128"));
    let bl = block(&out, 1, 256);
    for name in ROWS {
        assert_eq!(row(&bl, name).len(), 3, "{name}");
    }
    // gdn memory's `none` row for this layer (the default, the rule's inputs rebuilt): x 2048,
    // rstd 1, in_proj's output 2*2048 + 2*4096 + 2*32, o 4096, its rstd 32, norm_out 4096, f32.
    let kept = 4 * (2048 + 1 + (2 * 2048 + 2 * 4096 + 2 * 32) + 4096 + 32 + 4096);
    assert!(
        bl.iter()
            .any(|l| l.starts_with(&format!("kept for backward: {kept}.0 bytes/token"))),
        "{bl:#?}"
    );
}
