//! `gdn train --dp N --cp N --micro-batch-size N` with in-process ranks, resuming on other rank
//! counts, and the errors of every bad layout a user can type (`gdn launch` included).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{expect_fail, gdn, ok, tmpdir, TINY};

use gdn::train::Checkpoint;

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// TINY (batch 4, seq 16) with 2 key / 4 value heads (CP 2 divides them) and checkpoints every
/// 2 steps.
fn config(d: &Path) -> PathBuf {
    let c = d.join("tiny.toml");
    let t = TINY
        .replace("linear_num_key_heads = 1", "linear_num_key_heads = 2")
        .replace("linear_num_value_heads = 2", "linear_num_value_heads = 4")
        .replace("save_interval = 4", "save_interval = 2");
    std::fs::write(&c, t).unwrap();
    c
}

fn train(cfg: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut a = vec!["train", "--config"];
    let (c, o) = (s(cfg), s(out));
    a.push(&c);
    a.push("--out");
    a.push(&o);
    a.extend_from_slice(extra);
    gdn(&a)
}

fn ckpt(run: &Path, step: u64) -> Checkpoint {
    Checkpoint::load(&run.join(format!("checkpoints/step-{step:08}.safetensors"))).unwrap()
}

/// Parameters and AdamW moments bit for bit.
fn same_state(a: &Checkpoint, b: &Checkpoint, what: &str) {
    assert_eq!(a.step, b.step, "{what}");
    for (x, y) in [
        (&a.params, &b.params),
        (&a.exp_avg, &b.exp_avg),
        (&a.exp_avg_sq, &b.exp_avg_sq),
    ] {
        assert_eq!(x.names(), y.names(), "{what}");
        for ((n, p), (_, q)) in x.iter().zip(y.iter()) {
            let bits = |t: &gdn::Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(p) == bits(q), "{what}: {n} differs");
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), t).unwrap();
        }
    }
}

/// 2 data ranks equal 1 rank with the same micro-batches bit for bit; rank 0 alone prints and
/// writes; a run of 2 ranks stopped at step 4 and resumed on 1 and on 4 ranks (4 micro-batches
/// per step throughout) ends bit for bit where the uninterrupted 2-rank run does.
#[test]
fn data_ranks_equal_one_rank_and_resume_on_other_rank_counts() {
    let d = tmpdir("dp");
    let cfg = config(&d);
    let two = d.join("two");
    let out = ok(&train(
        &cfg,
        &two,
        &["--dp", "2", "--micro-batch-size", "1"],
    ));
    assert_eq!(out.matches("done: 8 steps").count(), 1, "{out}");
    assert!(
        out.contains("parallel: dp 2 x cp 1 (2 in-process ranks on cpu); 2 micro-batch(es) of 1 sequences per data rank"),
        "{out}"
    );
    let one = d.join("one");
    ok(&train(&cfg, &one, &["--micro-batch-size", "1"]));
    same_state(
        &ckpt(&two, 8),
        &ckpt(&one, 8),
        "2 ranks vs 1 rank, 4 micro-batches",
    );
    // 4 ranks of one sequence each: 4 micro-batches too.
    let four = d.join("four");
    ok(&train(&cfg, &four, &["--dp", "4"]));
    same_state(&ckpt(&four, 8), &ckpt(&one, 8), "4 ranks vs 1 rank");

    let stopped = d.join("stopped");
    ok(&train(
        &cfg,
        &stopped,
        &[
            "--dp",
            "2",
            "--micro-batch-size",
            "1",
            "--stop-at-step",
            "4",
        ],
    ));
    for (dp, mbs) in [("1", "1"), ("4", "1")] {
        let r = d.join(format!("resumed-{dp}"));
        copy_dir(&stopped, &r);
        let o = ok(&gdn(&[
            "train",
            "--resume",
            &s(&r),
            "--dp",
            dp,
            "--micro-batch-size",
            mbs,
        ]));
        assert!(o.contains("resumed at step 4"), "{o}");
        same_state(
            &ckpt(&r, 8),
            &ckpt(&two, 8),
            &format!("resumed on {dp} ranks"),
        );
    }
    // 3 ranks do not divide the batch of 4.
    let r = d.join("resumed-3");
    copy_dir(&stopped, &r);
    expect_fail(
        &gdn(&["train", "--resume", &s(&r), "--dp", "3"]),
        &["global batch of 4 sequences must be divisible by data-parallel ranks x micro-batches = 3 x 1 = 3"],
    );
}

fn first_train_loss(run: &Path) -> f64 {
    let m = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let line = m.lines().find(|l| l.contains("\"train\"")).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v["loss"].as_f64().unwrap()
}

/// `--cp 2` and `--dp 2 --cp 2` train; their first logged loss (steps 1-2) is within 1e-5 of the
/// one-rank run's (context parallelism changes only the f32 rounding of the row sums).
#[test]
fn context_parallel_training_matches_one_rank() {
    let d = tmpdir("cp-train");
    let cfg = config(&d);
    ok(&train(&cfg, &d.join("one"), &[]));
    let want = first_train_loss(&d.join("one"));
    for (name, extra) in [
        ("cp2", vec!["--cp", "2"]),
        ("dp2cp2", vec!["--dp", "2", "--cp", "2"]),
    ] {
        let r = d.join(name);
        let out = ok(&train(&cfg, &r, &extra));
        assert_eq!(out.matches("done: 8 steps").count(), 1, "{out}");
        let got = first_train_loss(&r);
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "{name}: loss {got} vs {want}"
        );
    }
}

/// Every bad layout is an error before a run directory is made.
#[test]
fn bad_layouts_are_errors() {
    let d = tmpdir("dp-errors");
    let cfg = config(&d);
    let run = d.join("run");
    for (extra, needles) in [
        (vec!["--dp", "0"], vec!["--dp) must be at least 1"]),
        (vec!["--cp", "0"], vec!["--cp) must be at least 1"]),
        (
            vec!["--dp", "3"],
            vec!["global batch of 4 sequences must be divisible by data-parallel ranks x micro-batches = 3 x 1 = 3"],
        ),
        (
            vec!["--cp", "3"],
            vec!["data.seq_length", "16 is not divisible by 2 x cp = 6"],
        ),
        (
            vec!["--cp", "4"],
            vec!["linear_num_key_heads=2 must be a multiple of"],
        ),
        (
            vec!["--micro-batch-size", "0"],
            vec!["--micro-batch-size 0: a micro-batch holds at least one sequence"],
        ),
        (
            vec!["--dp", "2", "--micro-batch-size", "3"],
            vec!["must be divisible by --dp 2 x --micro-batch-size 3 = 6"],
        ),
    ] {
        expect_fail(&train(&cfg, &run, &extra), &needles);
        assert!(!run.exists(), "{extra:?} left {}", run.display());
    }
    // Launched ranks: the world must be dp x cp, and they need GPUs.
    let launched = |world: &str, extra: &[&str]| {
        let mut a = vec![
            "train".to_string(),
            "--config".into(),
            s(&cfg),
            "--out".into(),
            s(&run),
        ];
        a.extend(extra.iter().map(|x| x.to_string()));
        Command::new(env!("CARGO_BIN_EXE_gdn"))
            .args(&a)
            .env("WORLD_SIZE", world)
            .env("RANK", "0")
            .env("LOCAL_RANK", "0")
            .output()
            .unwrap()
    };
    expect_fail(
        &launched("2", &[]),
        &["launched ranks (WORLD_SIZE=2) talk over NCCL, one GPU each: use --device cuda"],
    );
    expect_fail(
        &launched("3", &["--cp", "2"]),
        &["--cp 2: the launcher's WORLD_SIZE=3 is not a multiple of it"],
    );
    expect_fail(
        &launched("2", &["--dp", "4"]),
        &["WORLD_SIZE=2 processes but --dp 4 x --cp 1 = 4 ranks"],
    );
    assert!(!run.exists());
    // gdn launch: no ranks, or more ranks than GPUs for a GPU command.
    expect_fail(
        &gdn(&["launch", "--nproc-per-node", "0", "--", "info"]),
        &["--nproc-per-node 0: start at least one process"],
    );
    expect_fail(
        &gdn(&[
            "launch",
            "--nproc-per-node",
            "64",
            "--",
            "train",
            "--device",
            "cuda",
        ]),
        &["--nproc-per-node 64: the ranks use one GPU each (--device cuda) and this machine has"],
    );
}
