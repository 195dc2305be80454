//! End-to-end tests of `gdn generate`: on a short MQAR run trained here (CPU, 300 steps) the
//! decoded answers reach the held-out accuracy the trainer reported; a byte model continues a
//! prompt reproducibly under --seed; the errors a user can hit are messages, not panics.

use std::path::Path;

mod common;
use common::{expect_fail, gdn, ok, tmpdir};

/// 1 block of width 32 on MQAR (4 pairs + 4 queries in 16 tokens), 300 steps: enough to answer
/// most held-out queries, a few seconds on a CPU.
const MQAR: &str = r#"
[model]
hidden_size = 32
num_layers = 1
ffn_hidden_size = 64
linear_num_key_heads = 1
linear_num_value_heads = 2
linear_key_head_dim = 16
linear_value_head_dim = 16
[data]
seq_length = 16
batch_size = 16
num_kv_pairs = 4
key_vocab_size = 16
value_vocab_size = 16
eval_sequences = 64
[optimizer]
lr_warmup_iters = 10
[train]
train_iters = 300
log_interval = 100
eval_interval = 300
save_interval = 300
"#;

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The first `NN.NN%` after `key` in `out`, as a fraction.
fn pct_after(out: &str, key: &str) -> f64 {
    let i = out
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in:\n{out}"))
        + key.len();
    let rest = &out[i..];
    let end = rest.find('%').unwrap();
    rest[..end].trim().parse::<f64>().unwrap() / 100.0
}

#[test]
fn mqar_answers_reach_the_trainers_held_out_accuracy() {
    let d = tmpdir("gen-mqar");
    std::fs::write(d.join("run.toml"), MQAR).unwrap();
    let run = d.join("run");
    let out = ok(&gdn(&[
        "train",
        "--config",
        &s(&d.join("run.toml")),
        "--out",
        &s(&run),
    ]));
    // "held-out: loss L, accuracy A% (...)"
    let held = &out[out.find("held-out: loss").expect("held-out line")..];
    let trained = pct_after(held, "accuracy ");
    let gen = ok(&gdn(&["generate", "--run", &s(&run), "--mqar", "64"]));
    let got = pct_after(&gen, "accuracy ");
    // Same 64 sequences (256 answers), same weights, arg max of the decoded logits vs of the
    // chunked training forward's: equal up to f32 rounding, i.e. at most 2 of 256 answers may
    // flip on a near tie.
    assert!(
        (got - trained).abs() <= 2.0 / 256.0 + 1e-4,
        "generate {got} vs trainer {trained}:\n{out}\n{gen}"
    );
    assert!(
        trained > 0.3,
        "the run should learn beyond chance (6.25%): {trained}"
    );
    for needle in [
        "MQAR: 64 held-out sequences, 4 queries each",
        "trainer's held-out accuracy at step 300",
        "prefill: 576 tokens",
        "decode: 384 tokens (6 steps x 64 sequences)",
        "tokens/s",
    ] {
        assert!(gen.contains(needle), "stdout lacks {needle:?}:\n{gen}");
    }
    // Errors: wrong task, too many sequences, no checkpoint, no run.
    expect_fail(
        &gdn(&["generate", "--run", &s(&run), "--prompt", "hi"]),
        &["--prompt needs a byte-level model", "use --mqar N"],
    );
    expect_fail(
        &gdn(&["generate", "--run", &s(&run), "--mqar", "65"]),
        &["--mqar 65", "64 held-out sequences"],
    );
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(run.join("config.toml"), empty.join("config.toml")).unwrap();
    expect_fail(
        &gdn(&["generate", "--run", &s(&empty), "--mqar", "1"]),
        &["no checkpoint"],
    );
    expect_fail(
        &gdn(&["generate", "--run", &s(&d.join("nope")), "--mqar", "1"]),
        &["no config.toml"],
    );
    expect_fail(
        &gdn(&[
            "generate",
            "--run",
            &s(&run),
            "--mqar",
            "1",
            "--temperature=-1",
        ]),
        &["--temperature"],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn prompt_on_a_byte_model_is_reproducible_with_seed() {
    let d = tmpdir("gen-text");
    std::fs::write(d.join("run.toml"), MQAR).unwrap();
    let body: String = (0..400)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog.\n"))
        .collect();
    std::fs::write(d.join("corpus.txt"), body).unwrap();
    let run = d.join("run");
    ok(&gdn(&[
        "train",
        "--config",
        &s(&d.join("run.toml")),
        "--data",
        &s(&d.join("corpus.txt")),
        "--steps",
        "20",
        "--out",
        &s(&run),
    ]));
    let args = |seed: &str| {
        gdn(&[
            "generate",
            "--run",
            &s(&run),
            "--prompt",
            "line 7: the",
            "--max-tokens",
            "24",
            "--seed",
            seed,
            "--top-k",
            "8",
        ])
    };
    let (a, b, c) = (ok(&args("3")), ok(&args("3")), ok(&args("4")));
    // The continuation is the line after the model line.
    let text = |o: &str| o.lines().nth(1).unwrap_or("").to_string();
    assert!(text(&a).starts_with("line 7: the"), "{a}");
    assert_eq!(text(&a), text(&b), "same seed, same text");
    assert_ne!(
        text(&a),
        text(&c),
        "another seed, another draw (24 bytes from 8 choices)"
    );
    assert!(a.contains("generated 24 bytes"), "{a}");
    assert!(a.contains("decode: 23 tokens"), "{a}");
    expect_fail(
        &gdn(&["generate", "--run", &s(&run), "--mqar", "1"]),
        &["--mqar needs an MQAR run"],
    );
    expect_fail(
        &gdn(&["generate", "--run", &s(&run), "--prompt", ""]),
        &["--prompt is empty"],
    );
    std::fs::remove_dir_all(&d).unwrap();
}
