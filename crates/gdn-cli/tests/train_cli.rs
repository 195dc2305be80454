//! End-to-end tests of `gdn train`: a tiny run with every output, resume through the binary
//! (bitwise equal to a straight run), and the errors a user can hit.

use std::path::Path;

mod common;
use common::{expect_fail, gdn, ok, tmpdir, TINY};

use gdn::io::read_tensors;
use gdn::train::RunConfig;

fn write_tiny(dir: &Path) -> String {
    let p = dir.join("run.toml");
    std::fs::write(&p, TINY).unwrap();
    p.display().to_string()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// (kind, step) of every line of metrics.jsonl.
fn metric_steps(dir: &Path) -> Vec<(String, u64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["kind"].as_str().unwrap().to_string(),
                v["step"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn tiny_run_writes_everything() {
    let d = tmpdir("run");
    let cfg = write_tiny(&d);
    let run = d.join("run");
    let out = ok(&gdn(&[
        "train",
        "--config",
        &cfg,
        "--out",
        &s(&run),
        "--plot",
    ]));
    for needle in [
        "model: 1 blocks of GDN",
        "data: MQAR: 4 key-value pairs + 4 queries",
        "done: 8 steps",
        "held-out: loss",
        "chance 6.25%",
        "activation memory per step",
        "tokens/s",
    ] {
        assert!(out.contains(needle), "stdout lacks {needle:?}:\n{out}");
    }
    let steps = metric_steps(&run);
    let want: Vec<(String, u64)> = [
        ("eval", 0),
        ("train", 2),
        ("train", 4),
        ("eval", 4),
        ("train", 6),
        ("train", 8),
        ("eval", 8),
    ]
    .iter()
    .map(|(k, s)| (k.to_string(), *s))
    .collect();
    assert_eq!(steps, want);
    let line: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .nth(1)
            .unwrap(),
    )
    .unwrap();
    for k in [
        "loss",
        "accuracy",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "elapsed_s",
    ] {
        assert!(line[k].is_number(), "{k} missing in {line}");
    }
    let ck: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut ck = ck;
    ck.sort();
    assert_eq!(
        ck,
        ["step-00000004.safetensors", "step-00000008.safetensors"]
    );
    let png = std::fs::read(run.join("curves.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // the run's config.toml is the resolved config
    let back = RunConfig::from_toml_file(&run.join("config.toml")).unwrap();
    assert_eq!(back, RunConfig::from_toml_str(TINY).unwrap());
    // a second run into the same directory is refused
    expect_fail(
        &gdn(&["train", "--config", &cfg, "--out", &s(&run)]),
        &["already holds a run", "--resume"],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// 8 steps straight equal 4 steps, a stop, and a resume for 4 more: the final checkpoints hold
/// the same bits, and the metrics file has each line once.
#[test]
fn stop_and_resume_match_a_straight_run() {
    let d = tmpdir("resume");
    let cfg = write_tiny(&d);
    let (a, b) = (d.join("a"), d.join("b"));
    ok(&gdn(&["train", "--config", &cfg, "--out", &s(&a)]));
    let out = ok(&gdn(&[
        "train",
        "--config",
        &cfg,
        "--out",
        &s(&b),
        "--stop-at-step",
        "4",
    ]));
    assert!(out.contains("stopped at step 4 of 8"), "{out}");
    // a crash after the step-4 checkpoint leaves metrics past it; resume drops them
    let mut m = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    m.push_str(
        r#"{"kind":"train","step":6,"loss":9.0,"accuracy":0.0,"targets":1,"elapsed_s":0.0}"#,
    );
    m.push('\n');
    std::fs::write(b.join("metrics.jsonl"), m).unwrap();
    let out = ok(&gdn(&["train", "--resume", &s(&b), "--plot"]));
    assert!(out.contains("resumed at step 4"), "{out}");
    assert!(out.contains("done: 8 steps"), "{out}");
    let ca = read_tensors(&a.join("checkpoints/step-00000008.safetensors")).unwrap();
    let cb = read_tensors(&b.join("checkpoints/step-00000008.safetensors")).unwrap();
    assert_eq!(ca.len(), cb.len());
    for ((na, ta), (nb, tb)) in ca.iter().zip(&cb) {
        assert_eq!(na, nb);
        let bits = |t: &gdn::Tensor| t.data().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(ta) == bits(tb), "{na} differs after resume");
    }
    let (sa, sb) = (metric_steps(&a), metric_steps(&b));
    assert_eq!(sa, sb);
    // resuming a finished run does no step and says so
    let out = ok(&gdn(&["train", "--resume", &s(&b)]));
    assert!(out.contains("done: 8 steps"), "{out}");
    // --steps extends it
    let out = ok(&gdn(&["train", "--resume", &s(&b), "--steps", "10"]));
    assert!(out.contains("done: 10 steps"), "{out}");
    assert!(b.join("checkpoints/step-00000010.safetensors").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn resume_refuses_corrupt_and_foreign_checkpoints() {
    let d = tmpdir("refuse");
    let cfg = write_tiny(&d);
    let run = d.join("run");
    ok(&gdn(&[
        "train",
        "--config",
        &cfg,
        "--out",
        &s(&run),
        "--stop-at-step",
        "4",
    ]));
    let ck = run.join("checkpoints/step-00000004.safetensors");
    let good = std::fs::read(&ck).unwrap();
    std::fs::write(&ck, &good[..good.len() / 2]).unwrap();
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &["step-00000004.safetensors", "not a usable checkpoint"],
    );
    // the config.toml edited to another model
    std::fs::write(&ck, &good).unwrap();
    let edited = std::fs::read_to_string(run.join("config.toml"))
        .unwrap()
        .replace("hidden_size = 16", "hidden_size = 24");
    std::fs::write(run.join("config.toml"), edited).unwrap();
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &[
            "different model",
            "hidden_size = 16 in the checkpoint, 24 in this run",
        ],
    );
    expect_fail(
        &gdn(&["train", "--resume", &s(&d.join("nothing"))]),
        &["no config.toml"],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn text_data_device_and_config_errors() {
    let d = tmpdir("text");
    let cfg = write_tiny(&d);
    let text = d.join("corpus.txt");
    let body: String = (0..400)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog.\n"))
        .collect();
    std::fs::write(&text, body).unwrap();
    let out = ok(&gdn(&[
        "train",
        "--config",
        &cfg,
        "--data",
        &s(&text),
        "--steps",
        "3",
        "--out",
        &s(&d.join("t")),
    ]));
    assert!(out.contains("byte-level text"), "{out}");
    assert!(out.contains("vocab 256"), "{out}");
    assert!(out.contains("done: 3 steps"), "{out}");

    if !gdn::device::cuda::driver_present() {
        expect_fail(
            &gdn(&["train", "--device", "cuda", "--out", &s(&d.join("c"))]),
            &["CUDA driver"],
        );
        assert!(
            !d.join("c").exists(),
            "no run directory when the device is unusable"
        );
    }
    expect_fail(
        &gdn(&["train", "--device", "tpu", "--out", &s(&d.join("c"))]),
        &["unknown device"],
    );
    expect_fail(
        &gdn(&["train", "--dtype", "bf16", "--out", &s(&d.join("c"))]),
        &["--dtype bf16 needs --device cuda"],
    );
    expect_fail(
        &gdn(&["train", "--dtype", "f16", "--out", &s(&d.join("c"))]),
        &["--dtype \"f16\"", "bf16 or f32"],
    );
    let bad = d.join("bad.toml");
    std::fs::write(&bad, "[model]\nhiden_size = 3\n").unwrap();
    expect_fail(
        &gdn(&["train", "--config", &s(&bad), "--out", &s(&d.join("c"))]),
        &["hiden_size", "bad.toml"],
    );
    expect_fail(
        &gdn(&[
            "train",
            "--data",
            &s(&d.join("missing.txt")),
            "--out",
            &s(&d.join("c")),
        ]),
        &["missing.txt"],
    );
    assert!(
        !d.join("c").exists(),
        "a failed start leaves no run directory"
    );
    let printed = ok(&gdn(&["train", "--config", &cfg, "--print-config"]));
    assert_eq!(
        RunConfig::from_toml_str(&printed).unwrap(),
        RunConfig::from_toml_str(TINY).unwrap()
    );
    assert!(!Path::new("runs").join("x").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// `--name` is a directory name under runs/, not a path: `../x`, `a/b`, `..` and `` are refused
/// (`../../x` used to put the run outside runs/).
#[test]
fn name_must_be_a_plain_directory_name() {
    for n in ["../escape", "a/b", "..", ".", ""] {
        expect_fail(
            &gdn(&["train", "--name", n, "--steps", "1"]),
            &["expected a plain directory name under runs/"],
        );
    }
}
