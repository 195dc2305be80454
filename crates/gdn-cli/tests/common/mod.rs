//! Helpers shared by the end-to-end tests of the `gdn` binary.
#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A tiny `gdn train` run config: 1 block of width 16 on MQAR with 4 pairs in 16 tokens;
/// 8 steps, a line every 2, held-out evaluation every 4, checkpoints every 4.
pub const TINY: &str = r#"
[model]
hidden_size = 16
num_layers = 1
ffn_hidden_size = 32
linear_num_key_heads = 1
linear_num_value_heads = 2
linear_key_head_dim = 8
linear_value_head_dim = 8
[data]
seq_length = 16
batch_size = 4
num_kv_pairs = 4
key_vocab_size = 16
value_vocab_size = 16
eval_sequences = 16
[optimizer]
lr_warmup_iters = 2
[train]
train_iters = 8
log_interval = 2
eval_interval = 4
save_interval = 4
"#;

/// A fresh empty directory under the system temp dir.
pub fn tmpdir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "gdn-cli-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Run the `gdn` binary built for these tests.
pub fn gdn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gdn"))
        .args(args)
        .output()
        .expect("run gdn")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Expect success; returns stdout (the failure message shows stdout and stderr).
pub fn ok(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "gdn failed:\n{out}\n{}", stderr(o));
    out
}

/// Expect a clean failure: non-zero exit, no panic, and every needle in stderr. Returns stderr.
pub fn expect_fail(o: &Output, needles: &[&str]) -> String {
    let e = stderr(o);
    assert!(
        !o.status.success(),
        "expected failure, got success; stderr:\n{e}"
    );
    assert!(
        !e.contains("panicked"),
        "panicked instead of an error:\n{e}"
    );
    for n in needles {
        assert!(e.contains(n), "stderr lacks {n:?}:\n{e}");
    }
    e
}

/// `gdn layer --config c --weights w --input x --output out`, then `extra`.
pub fn layer_run(c: &Path, w: &Path, x: &Path, out: &Path, extra: &[&str]) -> Output {
    let p = |p: &Path| p.to_str().expect("UTF-8 test path").to_string();
    let mut args = vec![
        "layer".to_string(),
        "--config".into(),
        p(c),
        "--weights".into(),
        p(w),
        "--input".into(),
        p(x),
        "--output".into(),
        p(out),
    ];
    args.extend(extra.iter().map(|e| e.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    gdn(&args)
}
