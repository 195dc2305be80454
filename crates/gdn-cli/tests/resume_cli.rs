//! End-to-end tests of what `gdn train --resume` trusts and how the run directory stays
//! consistent: corrupt checkpoints (checksum, fallback), an empty or partial or edited
//! `config.toml`, a changed text data file, resuming from another working directory, stray
//! temporary files, a cut-short metrics line, and starts that fail or meet user files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{expect_fail, gdn, ok, stderr, tmpdir};

/// [`common::TINY`] with a checkpoint every 2 steps.
static TINY: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| common::TINY.replace("save_interval = 4", "save_interval = 2"));

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// `gdn` with the working directory `cwd`.
fn gdn_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gdn"))
        .current_dir(cwd)
        .args(args)
        .output()
        .expect("run gdn")
}

/// A run of TINY in `d/run`, stopped at `stop` (checkpoints every 2 steps).
fn stopped_run(d: &Path, stop: u64) -> PathBuf {
    let cfg = d.join("tiny.toml");
    std::fs::write(&cfg, &*TINY).unwrap();
    let run = d.join("run");
    ok(&gdn(&[
        "train",
        "--config",
        &s(&cfg),
        "--out",
        &s(&run),
        "--stop-at-step",
        &stop.to_string(),
    ]));
    run
}

fn ckpt(run: &Path, step: u64) -> PathBuf {
    run.join(format!("checkpoints/step-{step:08}.safetensors"))
}

/// Flip the lowest bit of a byte near the end of the file: a tensor value, still finite.
fn flip_tensor_bit(p: &Path) {
    let mut b = std::fs::read(p).unwrap();
    let i = b.len() - 9;
    b[i] ^= 0x01;
    std::fs::write(p, b).unwrap();
}

#[test]
fn flipped_tensor_bytes_are_caught_and_the_previous_checkpoint_used() {
    let d = tmpdir("flip");
    let run = stopped_run(&d, 6);
    flip_tensor_bit(&ckpt(&run, 6));
    let o = gdn(&["train", "--resume", &s(&run), "--stop-at-step", "7"]);
    let out = ok(&o);
    let err = stderr(&o);
    for needle in [
        "step-00000006.safetensors: not a usable checkpoint: checksum mismatch",
        "resuming from",
        "step-00000004.safetensors, the newest checkpoint that passes its checks, instead of",
    ] {
        assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    }
    assert!(out.contains("resumed at step 4"), "{out}");
    assert!(ckpt(&run, 7).exists());
    // the resumed run saved step 6 again, over the corrupt one
    assert!(ok(&gdn(&[
        "train",
        "--resume",
        &s(&run),
        "--stop-at-step",
        "7"
    ]))
    .contains("resumed at step 7"));
    // every checkpoint corrupt: an error naming each
    for step in [2, 4, 6, 7] {
        flip_tensor_bit(&ckpt(&run, step));
    }
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &[
            "no usable checkpoint",
            "step-00000007.safetensors",
            "step-00000002.safetensors",
            "checksum mismatch",
        ],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn empty_or_partial_config_is_refused_and_left_as_it_is() {
    let d = tmpdir("emptycfg");
    let run = stopped_run(&d, 2);
    let cpath = run.join("config.toml");
    let full = std::fs::read_to_string(&cpath).unwrap();
    std::fs::write(&cpath, "").unwrap();
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &["config.toml", "is empty"],
    );
    assert_eq!(std::fs::read(&cpath).unwrap(), b"", "config.toml rewritten");
    // cut after the [model] section
    let partial = &full[..full.find("[data]").unwrap()];
    std::fs::write(&cpath, partial).unwrap();
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &["config.toml", "lacks", "data.seq_length"],
    );
    assert_eq!(std::fs::read_to_string(&cpath).unwrap(), partial);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A config.toml edited to another (same-model) run config is refused naming the key; a resume
/// does not rewrite config.toml (a comment survives) unless --steps changes train_iters.
#[test]
fn config_mismatch_names_the_key_and_config_is_not_rewritten() {
    let d = tmpdir("cfgdiff");
    let run = stopped_run(&d, 2);
    let cpath = run.join("config.toml");
    let full = std::fs::read_to_string(&cpath).unwrap();
    assert!(full.contains("batch_size = 4\n"), "{full}");
    std::fs::write(&cpath, full.replace("batch_size = 4\n", "batch_size = 8\n")).unwrap();
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &[
            "step-00000002.safetensors",
            "data.batch_size = 4 in the checkpoint, 8 in this run",
            "train.train_iters",
        ],
    );
    let commented = format!("# my note\n{full}");
    std::fs::write(&cpath, &commented).unwrap();
    ok(&gdn(&[
        "train",
        "--resume",
        &s(&run),
        "--stop-at-step",
        "4",
    ]));
    assert_eq!(std::fs::read_to_string(&cpath).unwrap(), commented);
    // --steps below the steps taken cannot shorten the run: refused, config.toml untouched
    expect_fail(
        &gdn(&["train", "--resume", &s(&run), "--steps", "3"]),
        &["--steps 3 is below the 4 steps this run has taken"],
    );
    assert_eq!(std::fs::read_to_string(&cpath).unwrap(), commented);
    // --steps extends the run: train_iters is the one key rewritten
    let out = ok(&gdn(&["train", "--resume", &s(&run), "--steps", "10"]));
    assert!(out.contains("done: 10 steps"), "{out}");
    let now = std::fs::read_to_string(&cpath).unwrap();
    assert!(now.contains("train_iters = 10"), "{now}");
    assert_eq!(
        now.replace("train_iters = 10", "train_iters = 8"),
        full,
        "only train_iters changed"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A text run records its file (absolute path, size, hash): resuming from another working
/// directory works, a changed file is refused unless --allow-data-change.
#[test]
fn text_data_change_and_another_working_directory() {
    let d = tmpdir("textdata");
    std::fs::write(d.join("tiny.toml"), &*TINY).unwrap();
    let body: String = (0..400)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog.\n"))
        .collect();
    std::fs::write(d.join("corpus.txt"), &body).unwrap();
    // relative --data and --out, from d
    ok(&gdn_in(
        &d,
        &[
            "train",
            "--config",
            "tiny.toml",
            "--data",
            "corpus.txt",
            "--out",
            "run",
            "--stop-at-step",
            "2",
        ],
    ));
    let run = d.join("run");
    let cfg = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        cfg.contains(&format!("path = \"{}\"", s(&d.join("corpus.txt")))),
        "data.path not absolute:\n{cfg}"
    );
    // from another working directory
    let elsewhere = tmpdir("elsewhere");
    let out = ok(&gdn_in(
        &elsewhere,
        &["train", "--resume", &s(&run), "--stop-at-step", "4"],
    ));
    assert!(out.contains("resumed at step 2"), "{out}");
    // the file changes
    std::fs::write(d.join("corpus.txt"), format!("{body}one more line\n")).unwrap();
    expect_fail(
        &gdn(&["train", "--resume", &s(&run)]),
        &[
            "corpus.txt changed since the checkpoint was written",
            &format!("{} bytes", body.len()),
            &format!("{} bytes", body.len() + 14),
            "--allow-data-change",
        ],
    );
    expect_fail(
        &gdn(&["train", "--out", &s(&d.join("x")), "--allow-data-change"]),
        &["--allow-data-change", "--resume"],
    );
    assert!(!d.join("x").exists());
    let o = gdn(&["train", "--resume", &s(&run), "--allow-data-change"]);
    let out = ok(&o);
    assert!(out.contains("done: 8 steps"), "{out}");
    assert!(
        stderr(&o).contains("continuing on the new data"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&d).unwrap();
    std::fs::remove_dir_all(&elsewhere).unwrap();
}

/// Temporary files of killed writes go on the next resume (with a note); other files stay. A
/// metrics line cut short by a kill is dropped instead of blocking the resume.
#[test]
fn stray_temp_files_and_a_cut_metrics_line_are_cleaned() {
    let d = tmpdir("strays");
    let run = stopped_run(&d, 4);
    let strays = [
        run.join("config.toml.tmp-4242"),
        run.join("metrics.jsonl.tmp-4242-1"),
        run.join("checkpoints/step-00000006.safetensors.tmp-4242"),
    ];
    for p in &strays {
        std::fs::write(p, b"partial").unwrap();
    }
    std::fs::write(run.join("my.tmp-1"), b"mine").unwrap();
    let mut m = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    m.push_str(r#"{"kind":"train","step":4,"lo"#);
    std::fs::write(run.join("metrics.jsonl"), m).unwrap();
    let o = gdn(&["train", "--resume", &s(&run)]);
    let out = ok(&o);
    assert!(out.contains("done: 8 steps"), "{out}");
    let err = stderr(&o);
    for p in &strays {
        assert!(!p.exists(), "{} left", p.display());
        assert!(err.contains(&format!("removed {}", s(p))), "{err}");
    }
    assert!(err.contains("cut short"), "{err}");
    assert_eq!(std::fs::read(run.join("my.tmp-1")).unwrap(), b"mine");
    for (i, l) in std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .enumerate()
    {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("line {}: {e}: {l}", i + 1));
        assert!(v["step"].is_u64());
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A start that fails before its first checkpoint leaves nothing it created; a directory that
/// existed before stays; a non-empty --out is refused and left untouched.
#[test]
fn failed_start_leaves_nothing_behind() {
    let d = tmpdir("failstart");
    // lr 1e30 diverges at step 2, before the first checkpoint (step 2 would be the first)
    let bad = d.join("diverge.toml");
    std::fs::write(
        &bad,
        TINY.replace(
            "lr_warmup_iters = 2",
            "lr_warmup_iters = 2\nlr = 1e30\nmin_lr = 0.0",
        ),
    )
    .unwrap();
    let run = d.join("new/run");
    let e = expect_fail(
        &gdn(&["train", "--config", &s(&bad), "--out", &s(&run)]),
        &["gradient norm"],
    );
    assert!(e.contains("before its first checkpoint"), "{e}");
    assert!(!d.join("new").exists(), "left {}", d.join("new").display());
    // an existing empty directory: kept, and empty again
    let empty = d.join("empty");
    std::fs::create_dir(&empty).unwrap();
    expect_fail(
        &gdn(&["train", "--config", &s(&bad), "--out", &s(&empty)]),
        &["gradient norm"],
    );
    assert!(empty.is_dir());
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    // the same --out is usable afterwards
    let good = d.join("tiny.toml");
    std::fs::write(&good, &*TINY).unwrap();
    ok(&gdn(&[
        "train",
        "--config",
        &s(&good),
        "--out",
        &s(&empty),
        "--steps",
        "2",
    ]));
    assert!(ckpt(&empty, 2).exists());
    // a directory with the user's files is refused and left as it was
    let user = d.join("user");
    std::fs::create_dir(&user).unwrap();
    std::fs::write(user.join("metrics.jsonl"), b"my own notes\n").unwrap();
    expect_fail(
        &gdn(&["train", "--config", &s(&good), "--out", &s(&user)]),
        &["not empty", "metrics.jsonl"],
    );
    assert_eq!(
        std::fs::read(user.join("metrics.jsonl")).unwrap(),
        b"my own notes\n"
    );
    assert_eq!(std::fs::read_dir(&user).unwrap().count(), 1);
    // a seed the config cannot hold fails before any directory exists
    let seeded = d.join("seeded");
    let o = gdn(&[
        "train",
        "--config",
        &s(&good),
        "--seed",
        "9223372036854775808",
        "--out",
        &s(&seeded),
    ]);
    assert!(!o.status.success());
    assert!(!seeded.exists(), "a failed start left {}", seeded.display());
    std::fs::remove_dir_all(&d).unwrap();
}
