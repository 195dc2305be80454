//! Logging never kills a command: `gdn train` with its output on a closed pipe or a full device
//! still trains and saves; SIGINT / SIGTERM save a checkpoint and exit; the other commands end
//! with an error line, never a panic. Numbers on the command line are in range.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::{expect_fail, gdn, ok, stderr, tmpdir, TINY};

/// The same model for a million steps, a line every step, no periodic eval or checkpoint: only
/// a signal (or the end, hours away) writes a checkpoint.
fn long_config() -> String {
    TINY.replace("train_iters = 8", "train_iters = 1000000")
        .replace("log_interval = 2", "log_interval = 1")
        .replace("eval_interval = 4", "eval_interval = 0")
        .replace("save_interval = 4", "save_interval = 0")
}

fn write_config(dir: &Path, text: &str) -> String {
    let p = dir.join("run.toml");
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gdn"))
}

/// The checkpoint file names in `run/checkpoints`, sorted.
fn checkpoints(run: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The step of every line of metrics.jsonl.
fn metric_steps(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["step"].as_u64().unwrap()
        })
        .collect()
}

/// `gdn train` on the tiny config into a fresh run directory, as a command to finish setting up.
fn tiny_train(tag: &str) -> (Command, PathBuf) {
    let d = tmpdir(tag);
    let cfg = write_config(&d, TINY);
    let run = d.join("run");
    let mut c = bin();
    c.args(["train", "--config", &cfg, "--out", &s(&run)]);
    (c, run)
}

const FINAL_CHECKPOINTS: [&str; 2] = ["step-00000004.safetensors", "step-00000008.safetensors"];

#[test]
fn train_on_a_closed_pipe_finishes_and_saves() {
    // stdout and stderr are pipes whose read ends are closed before gdn writes its first line:
    // every write fails with EPIPE (Rust ignores SIGPIPE). Before the fix: panic, exit 101, no
    // checkpoint.
    let (mut c, run) = tiny_train("pipe");
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "gdn train on a closed pipe: {status}"
    );
    assert_eq!(checkpoints(&run), FINAL_CHECKPOINTS);
    assert_eq!(*metric_steps(&run).last().unwrap(), 8);
}

#[test]
fn train_piped_into_head_finishes_and_saves() {
    // The issue's `gdn train ... 2>&1 | head -1`; gdn's exit code goes to a file.
    let (c, run) = tiny_train("head");
    let rc = run.with_file_name("rc");
    let args: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into()).collect();
    let out = Command::new("sh")
        .arg("-c")
        .arg(r#"rc="$1"; shift; ("$@" 2>&1; echo $? > "$rc") | head -1"#)
        .arg("sh")
        .arg(s(&rc))
        .arg(env!("CARGO_BIN_EXE_gdn"))
        .args(&args)
        .output()
        .unwrap();
    let first = String::from_utf8_lossy(&out.stdout);
    assert!(first.starts_with("model: 1 blocks of GDN"), "{first}");
    assert_eq!(first.lines().count(), 1, "{first}");
    assert_eq!(std::fs::read_to_string(&rc).unwrap().trim(), "0");
    assert_eq!(checkpoints(&run), FINAL_CHECKPOINTS);
}

fn dev_full() -> Option<std::fs::File> {
    match std::fs::OpenOptions::new().write(true).open("/dev/full") {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("skipped: cannot open /dev/full ({e})");
            None
        }
    }
}

#[test]
fn train_with_stdout_on_a_full_device_finishes_and_saves() {
    let Some(full) = dev_full() else { return };
    let (mut c, run) = tiny_train("full-out");
    let o = c.stdout(full).output().unwrap();
    let e = stderr(&o);
    assert!(o.status.success(), "{}\n{e}", o.status);
    assert!(!e.contains("panicked"), "{e}");
    // one note, then the progress lines go on on stderr
    assert_eq!(
        e.matches("gdn: note: cannot write to stdout").count(),
        1,
        "{e}"
    );
    assert!(e.contains("No space left on device"), "{e}");
    assert!(e.contains("eval at step 8: held-out loss"), "{e}");
    assert_eq!(checkpoints(&run), FINAL_CHECKPOINTS);
}

#[test]
fn train_with_stderr_on_a_full_device_finishes_and_saves() {
    let Some(full) = dev_full() else { return };
    let (mut c, run) = tiny_train("full-err");
    let o = c.stderr(full).output().unwrap();
    let out = ok(&o);
    // the note about stderr goes to stdout, once; the summary follows
    assert_eq!(
        out.matches("gdn: note: cannot write to stderr").count(),
        1,
        "{out}"
    );
    assert!(out.contains("done: 8 steps"), "{out}");
    assert_eq!(checkpoints(&run), FINAL_CHECKPOINTS);
}

/// Run `gdn train ARGS` until it prints its first step line (returned), send `signal` with the
/// `kill` command, and check that it exits with `code` without a panic. Returns (first step
/// line, stdout).
fn train_then_signal(args: &[&str], signal: &str, code: i32) -> (String, String) {
    let mut child = bin()
        .arg("train")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let first = loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("gdn ended before training:\n{seen}");
        }
        seen.push_str(&line);
        if line.starts_with("step ") {
            break line;
        }
    };
    let kill = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    err.read_to_string(&mut seen).unwrap();
    let o = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(code), "{}\n{out}\n{seen}", o.status);
    assert!(!seen.contains("panicked"), "{seen}");
    (first, out)
}

/// Start a long run, wait until it is training, send `signal`, and check: exit code `code`, one
/// checkpoint at a step between 1 and the end, metrics up to exactly that step, the resume hint;
/// then the run resumes from there.
fn signal_stops_with_a_checkpoint(signal: &str, code: i32) {
    let d = tmpdir("signal");
    let cfg = write_config(&d, &long_config());
    let run = d.join("run");
    let (_, out) = train_then_signal(&["--config", &cfg, "--out", &s(&run)], signal, code);

    let cks = checkpoints(&run);
    assert_eq!(cks.len(), 1, "{cks:?}");
    let step: u64 = cks[0]
        .strip_prefix("step-")
        .and_then(|x| x.strip_suffix(".safetensors"))
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..1_000_000).contains(&step), "{step}");
    assert!(
        out.contains(&format!("stopped at step {step} of 1000000 (SIG{signal})")),
        "{out}"
    );
    assert!(
        out.contains(&format!("continue with: gdn train --resume {}", s(&run))),
        "{out}"
    );
    // metrics.jsonl matches the checkpoint: its last line is that step's training line
    let steps = metric_steps(&run);
    assert_eq!(*steps.last().unwrap(), step, "{steps:?}");
    assert!(steps.iter().all(|&x| x <= step), "{steps:?}");

    let next = (step + 2).to_string();
    let out = ok(&gdn(&[
        "train",
        "--resume",
        &s(&run),
        "--stop-at-step",
        &next,
    ]));
    assert!(
        out.contains(&format!("resumed at step {step} from")),
        "{out}"
    );
    assert!(checkpoints(&run).contains(&format!("step-{:08}.safetensors", step + 2)));
}

#[test]
fn sigterm_saves_a_checkpoint_and_exits_143() {
    signal_stops_with_a_checkpoint("TERM", 143);
}

#[test]
fn sigint_saves_a_checkpoint_and_exits_130() {
    signal_stops_with_a_checkpoint("INT", 130);
}

#[test]
fn huge_steps_train_and_print_a_bounded_eta() {
    let d = tmpdir("steps");
    let cfg = write_config(&d, TINY);
    let run = d.join("run");
    let o = gdn(&[
        "train",
        "--config",
        &cfg,
        "--out",
        &s(&run),
        "--steps",
        "9223372036854775807",
        "--stop-at-step",
        "2",
    ]);
    let out = ok(&o);
    assert!(
        out.contains("stopped at step 2 of 9223372036854775807"),
        "{out}"
    );
    assert_eq!(checkpoints(&run), ["step-00000002.safetensors"]);

    // Without --stop-at-step the progress line estimates 2^63 steps (Duration::from_secs_f64
    // panicked once that passed Duration::MAX); SIGTERM then ends the run.
    let run = d.join("run2");
    let (first, _) = train_then_signal(
        &[
            "--config",
            &cfg,
            "--out",
            &s(&run),
            "--steps",
            "9223372036854775807",
        ],
        "TERM",
        143,
    );
    assert!(first.contains("/9223372036854775807 "), "{first}");
    assert!(first.trim_end().ends_with("eta over a year"), "{first}");
}

#[test]
fn steps_and_seed_out_of_range_state_the_range() {
    // config.toml holds them as TOML integers (i64): 2^63 used to panic when writing it.
    let d = tmpdir("range");
    let cfg = write_config(&d, TINY);
    let run = s(&d.join("run"));
    for (flag, value, range) in [
        ("--seed", "9223372036854775808", "0..=9223372036854775807"),
        ("--steps", "18446744073709551615", "1..=9223372036854775807"),
        ("--steps", "0", "1..=9223372036854775807"),
    ] {
        let o = gdn(&["train", "--config", &cfg, "--out", &run, flag, value]);
        expect_fail(&o, &[flag, value, range]);
        assert!(
            !d.join("run").exists(),
            "{flag} {value} left a run directory"
        );
    }
    // the largest seed is accepted and written back
    ok(&gdn(&[
        "train",
        "--config",
        &cfg,
        "--out",
        &run,
        "--seed",
        "9223372036854775807",
        "--steps",
        "1",
    ]));
    let written = std::fs::read_to_string(d.join("run").join("config.toml")).unwrap();
    assert!(written.contains("seed = 9223372036854775807"), "{written}");
}

/// `gdn info` / `gdn memory` with stdout on a pipe nobody reads: an error line, no panic.
fn closed_stdout_is_an_error(args: &[&str]) {
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    expect_fail(&o, &["gdn: error: cannot write to stdout: Broken pipe"]);
}

#[test]
fn info_on_a_closed_pipe_is_an_error_not_a_panic() {
    closed_stdout_is_an_error(&["info"]);
}

#[test]
fn memory_on_a_closed_pipe_is_an_error_not_a_panic() {
    let d = tmpdir("memory");
    let p = d.join("layer.toml");
    std::fs::write(
        &p,
        "hidden_size = 32\nlinear_num_key_heads = 1\nlinear_num_value_heads = 2\n\
         linear_key_head_dim = 8\nlinear_value_head_dim = 8\n",
    )
    .unwrap();
    closed_stdout_is_an_error(&["memory", "--config", &s(&p), "--tokens", "64"]);
}

#[test]
fn info_on_a_full_device_is_an_error_not_a_panic() {
    let Some(full) = dev_full() else { return };
    let o = bin().arg("info").stdout(full).output().unwrap();
    expect_fail(
        &o,
        &["gdn: error: cannot write to stdout: No space left on device"],
    );
}

#[test]
fn layer_example_with_stderr_closed_still_writes_its_output() {
    // `gdn layer` reports on stderr; its product is the output file. With stderr gone the report
    // is dropped (no panic, no failure) and the file is written.
    let d = tmpdir("layer");
    let ex = d.join("ex");
    let mut child = bin()
        .args(["layer", "--example", &s(&ex)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", o.status);
    assert!(ex.join("out.safetensors").is_file(), "no out.safetensors");
}
