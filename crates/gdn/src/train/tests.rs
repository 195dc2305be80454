use std::path::PathBuf;

use super::*;
use crate::config::Normalization;
use crate::model::IGNORE_INDEX;
use crate::testutil::bits;
use crate::train::data::{Mqar, Text};

/// A fresh empty directory under the system temp dir.
fn tmpdir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "gdn-train-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small, fast run: MQAR with 4 pairs in 16 tokens, a 1-block model of width 16.
pub(super) fn small() -> RunConfig {
    RunConfig::from_toml_str(
        r#"
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
        batch_size = 8
        num_kv_pairs = 4
        key_vocab_size = 16
        value_vocab_size = 16
        eval_sequences = 32
        [optimizer]
        lr_warmup_iters = 2
        [train]
        train_iters = 6
        "#,
    )
    .unwrap()
}

fn param_bits(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    t.model()
        .params()
        .iter()
        .map(|(n, t)| (n.to_string(), bits(t.data())))
        .collect()
}

#[test]
fn config_overlays_defaults_and_roundtrips() {
    let c = small();
    let d = RunConfig::default();
    assert_eq!(c.model.layer.hidden_size, 16);
    // untouched keys keep the run defaults, not Megatron's layer defaults
    assert_eq!(c.model.layer.normalization, Normalization::RMSNorm);
    assert_eq!(c.optimizer.lr, d.optimizer.lr);
    assert_eq!(c.train.seed, d.train.seed);
    let back = RunConfig::from_toml_str(&c.to_toml_string()).unwrap();
    assert_eq!(back, c);
    let back = RunConfig::from_toml_str(&d.to_toml_string()).unwrap();
    assert_eq!(back, d);
    assert_eq!(RunConfig::from_toml_str("").unwrap(), d);
    // the layer's recompute options and variant come through [model]
    let c = RunConfig::from_toml_str(
        "[model]\nvariant = \"gdn2\"\nrecompute_granularity = \"selective\"\nrecompute_modules = [\"gdn\", \"mlp\"]\n",
    )
    .unwrap();
    assert_eq!(c.model.layer.variant, crate::Variant::Gdn2);
    assert!(c.model_config(8).recompute_mlp());
}

#[test]
fn config_errors_name_the_field() {
    let err = |s: &str| RunConfig::from_toml_str(s).unwrap_err().to_string();
    let e = err("[modle]\nhidden_size = 8\n");
    assert!(e.contains("unknown section [modle]"), "{e}");
    let e = err("[model]\nhiden_size = 8\n");
    assert!(e.contains("hiden_size"), "{e}");
    let e = err("[data]\nbatchsize = 8\n");
    assert!(e.contains("batchsize"), "{e}");
    let e = err("[model]\nffn_hidden_size = 0\n");
    assert!(e.contains("ffn_hidden_size"), "{e}");
    let e = err("[model]\nlinear_num_value_heads = 3\n");
    assert!(e.contains("linear_num_value_heads"), "{e}");
    let e = err("[data]\nkind = \"text\"\n");
    assert!(e.contains("data.path"), "{e}");
    let e = err("[data]\nseq_length = 15\n");
    assert!(e.contains("data.seq_length"), "{e}");
    let e = err("[data]\nnum_kv_pairs = 100\n[data.x]\n");
    assert!(e.contains("x"), "{e}");
    let e = err("[data]\nnum_kv_pairs = 70\nseq_length = 200\n");
    assert!(e.contains("data.key_vocab_size"), "{e}");
    let e = err("[optimizer]\nmin_lr = 1.0\n");
    assert!(e.contains("optimizer.min_lr"), "{e}");
    let e = err("[optimizer]\nadam_beta2 = 1.0\n");
    assert!(e.contains("optimizer.adam_beta2"), "{e}");
    let e = err("[train]\ntrain_iters = 0\n");
    assert!(e.contains("train.train_iters"), "{e}");
    let e = err("[model]\nrecompute_modules = [\"mlp\"]\n");
    assert!(e.contains("recompute_granularity"), "{e}");
}

#[test]
fn schedule_warmup_cosine_and_clip() {
    let o = OptimizerConfig {
        lr: 1.0,
        min_lr: 0.1,
        lr_warmup_iters: 10,
        ..OptimizerConfig::default()
    };
    let lr = |s| optim::lr_at(&o, 110, s);
    assert_eq!(lr(1), 0.1);
    assert_eq!(lr(5), 0.5);
    assert_eq!(lr(10), 1.0);
    assert!((lr(60) - 0.55).abs() < 1e-12, "{}", lr(60));
    assert!((lr(110) - 0.1).abs() < 1e-12);
    assert_eq!(lr(500), 0.1);
    // monotone decay after the warmup
    assert!((11..110).all(|s| lr(s + 1) <= lr(s)));
    let lin = OptimizerConfig {
        lr_decay_style: DecayStyle::Linear,
        ..o.clone()
    };
    assert!((optim::lr_at(&lin, 110, 60) - 0.55).abs() < 1e-12);
    assert!((optim::lr_at(&lin, 110, 35) - 0.775).abs() < 1e-12);
    let c = OptimizerConfig {
        lr_decay_style: DecayStyle::Constant,
        ..o.clone()
    };
    assert_eq!(optim::lr_at(&c, 110, 500), 1.0);
    // no decay window: min_lr right after the warmup
    assert_eq!(optim::lr_at(&o, 5, 11), 0.1);

    let mut g = crate::layer::Params::from_entries(vec![
        (
            "a".into(),
            crate::Tensor::from_vec(&[2], vec![3.0, 0.0]).unwrap(),
        ),
        (
            "b".into(),
            crate::Tensor::from_vec(&[1], vec![4.0]).unwrap(),
        ),
    ]);
    let n = optim::clip_grad_norm(&mut g, 1.0, 1).unwrap();
    assert_eq!(n, 5.0);
    assert!((optim::global_norm(&g) - 1.0).abs() < 1e-5);
    let n = optim::clip_grad_norm(&mut g, 10.0, 1).unwrap();
    assert!((n - 1.0).abs() < 1e-5);
    assert!(
        (optim::global_norm(&g) - 1.0).abs() < 1e-5,
        "not clipped below the max"
    );
    g.get_mut("b").unwrap().data_mut()[0] = f32::NAN;
    let e = optim::clip_grad_norm(&mut g, 1.0, 7)
        .unwrap_err()
        .to_string();
    assert!(e.contains("step 7") && e.contains("b"), "{e}");
}

/// One AdamW step against the formula written out in f64: decay on matrices only.
#[test]
fn adamw_matches_the_formula() {
    let cfg = small();
    let mut t = Trainer::new(&cfg).unwrap();
    let before = t.model().params();
    let o = cfg.optimizer.clone();
    let batch = t.data().train_batch(1);
    let (_, saved) = t.model().forward(&batch).unwrap();
    let mut g = t.model().backward(saved).unwrap();
    optim::clip_grad_norm(&mut g, o.clip_grad, 1).unwrap();
    let lr = optim::lr_at(&o, cfg.lr_decay_iters(), 1);
    t.step().unwrap();
    let after = t.model().params();
    for (name, p0) in before.iter() {
        let decay = if p0.shape().len() >= 2 {
            o.weight_decay
        } else {
            0.0
        };
        let gr = g.get(name).unwrap().data();
        for (i, &x) in p0.data().iter().enumerate() {
            let gi = gr[i] as f64;
            let m = (1.0 - o.adam_beta1) * gi / (1.0 - o.adam_beta1);
            let v = (1.0 - o.adam_beta2) * gi * gi / (1.0 - o.adam_beta2);
            let want = x as f64 * (1.0 - lr * decay) - lr * m / (v.sqrt() + o.adam_eps);
            let got = after.get(name).unwrap().data()[i] as f64;
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{name}[{i}]: {got} vs {want}"
            );
        }
    }
}

#[test]
fn mqar_sequences_are_well_formed_and_deterministic() {
    let cfg = RunConfig::default();
    let m = Mqar::from_config(&cfg.data).unwrap();
    let data = Dataset::from_config(&cfg.data).unwrap();
    assert_eq!(data.vocab_size(), 128);
    assert_eq!(data.chance_accuracy(), Some(1.0 / 64.0));
    let (k, n, t) = (m.key_vocab as u32, m.num_kv_pairs, m.seq_len);
    for step in [1u64, 2, 977] {
        let b = data.train_batch(step);
        assert_eq!(b, data.train_batch(step), "deterministic");
        assert_eq!((b.batch, b.seq_len), (32, 64));
        for s in 0..b.batch {
            let tok = &b.tokens[s * t..(s + 1) * t];
            let tg = &b.targets[s * t..(s + 1) * t];
            let keys: Vec<u32> = (0..n).map(|i| tok[2 * i]).collect();
            let mut uniq = keys.clone();
            uniq.sort();
            uniq.dedup();
            assert_eq!(uniq.len(), n, "distinct keys");
            assert!(keys.iter().all(|&x| x < k));
            for i in 0..t {
                let is_val = i % 2 == 1;
                assert_eq!(tok[i] >= k, is_val, "keys at even, values at odd positions");
                if i >= 2 * n && !is_val {
                    let j = keys
                        .iter()
                        .position(|&x| x == tok[i])
                        .expect("query is a key");
                    assert_eq!(tg[i], tok[2 * j + 1] as i32, "target is the key's value");
                    assert_eq!(tok[i + 1], tok[2 * j + 1], "answer follows the query");
                } else {
                    assert_eq!(tg[i], IGNORE_INDEX);
                }
            }
            // every key is queried before any repeats
            let first: Vec<u32> = (0..n).map(|i| tok[2 * n + 2 * i]).collect();
            let mut f = first.clone();
            f.sort();
            assert_eq!(f, uniq);
        }
    }
    assert_ne!(data.train_batch(1), data.train_batch(2));
    // held-out: fixed by the seed, disjoint from training batches
    assert_eq!(data.eval_sequences(), 512);
    let held: std::collections::HashSet<Vec<u32>> = data
        .eval_batches()
        .iter()
        .flat_map(|b| b.tokens.chunks(t).map(|c| c.to_vec()).collect::<Vec<_>>())
        .collect();
    assert_eq!(held.len(), 512);
    for step in 1..=200 {
        let b = data.train_batch(step);
        for c in b.tokens.chunks(t) {
            assert!(
                !held.contains(c),
                "step {step} trains on a held-out sequence"
            );
        }
    }
    let again = Dataset::from_config(&cfg.data).unwrap();
    assert_eq!(again.eval_batches(), data.eval_batches());
}

/// With a key vocabulary so small that collisions are certain, training never draws a held-out
/// sequence.
#[test]
fn mqar_training_skips_held_out_sequences() {
    let mut d = RunConfig::default().data;
    d.num_kv_pairs = 2;
    d.key_vocab_size = 2;
    d.value_vocab_size = 2;
    d.seq_length = 6;
    d.eval_sequences = 20;
    d.batch_size = 8;
    let data = Dataset::from_config(&d).unwrap();
    let held: std::collections::HashSet<Vec<u32>> = data
        .eval_batches()
        .iter()
        .flat_map(|b| b.tokens.chunks(6).map(|c| c.to_vec()).collect::<Vec<_>>())
        .collect();
    // 2 key orders x 4 value pairs x 2 query orders = 16 possible sequences
    assert!(held.len() < 16);
    for step in 1..50 {
        for c in data.train_batch(step).tokens.chunks(6) {
            assert!(!held.contains(c));
        }
    }
}

#[test]
fn text_split_windows_and_errors() {
    let mut d = RunConfig::default().data;
    d.kind = DataKind::Text;
    d.seq_length = 8;
    d.batch_size = 4;
    d.eval_sequences = 100;
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    let data = Dataset::text_from_bytes(bytes.clone(), &d).unwrap();
    assert_eq!(data.vocab_size(), 256);
    assert_eq!(data.chance_accuracy(), None);
    // held out: the last 100 bytes, windows of 9 bytes at a stride of 8 (900, 908, ..., 988)
    assert_eq!(data.eval_sequences(), 12);
    let e0 = &data.eval_batches()[0];
    assert_eq!(
        e0.tokens[..8],
        bytes[900..908]
            .iter()
            .map(|&b| b as u32)
            .collect::<Vec<_>>()[..]
    );
    assert_eq!(
        e0.targets[..8],
        bytes[901..909]
            .iter()
            .map(|&b| b as i32)
            .collect::<Vec<_>>()[..]
    );
    for step in 1..100 {
        let b = data.train_batch(step);
        for (tok, tg) in b.tokens.chunks(8).zip(b.targets.chunks(8)) {
            let start = (0..=891).find(|&s| {
                bytes[s..s + 8]
                    .iter()
                    .map(|&x| x as u32)
                    .eq(tok.iter().copied())
            });
            let s = start.expect("a window of the training part");
            assert!(s + 9 <= 900, "training window reaches the held-out part");
            assert!(tg
                .iter()
                .zip(&bytes[s + 1..s + 9])
                .all(|(a, &b)| *a == b as i32));
        }
    }
    let e = Text::from_bytes(vec![0; 50], 8).unwrap_err().to_string();
    assert!(e.contains("too short") && e.contains("90 bytes"), "{e}");
    d.path = Some(PathBuf::from("/no/such/file.txt"));
    let e = Dataset::from_config(&d).unwrap_err().to_string();
    assert!(e.contains("/no/such/file.txt"), "{e}");
}

/// 2N steps straight equal N steps, a checkpoint, a fresh process state resumed from it, and N
/// more steps: bitwise, parameters and optimizer state.
#[test]
fn resume_is_bitwise_identical() {
    let cfg = small();
    let dir = tmpdir("resume");
    let mut straight = Trainer::new(&cfg).unwrap();
    for _ in 0..6 {
        straight.step().unwrap();
    }
    let mut first = Trainer::new(&cfg).unwrap();
    for _ in 0..3 {
        first.step().unwrap();
    }
    let p = dir.join(checkpoint::file_name(3));
    first.save(&p).unwrap();
    drop(first);
    let mut resumed = Trainer::resume(&cfg, &p).unwrap();
    assert_eq!(resumed.step_count(), 3);
    for _ in 0..3 {
        resumed.step().unwrap();
    }
    assert_eq!(resumed.step_count(), 6);
    assert!(
        param_bits(&resumed) == param_bits(&straight),
        "parameters differ"
    );
    let (a, b) = (
        resumed.checkpoint().unwrap(),
        straight.checkpoint().unwrap(),
    );
    assert!(a == b, "checkpoints differ");
    assert_eq!(resumed.evaluate().unwrap(), straight.evaluate().unwrap());
    // the checkpoint of the resumed run is the one of the straight run
    let (pa, pb) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    resumed.save(&pa).unwrap();
    straight.save(&pb).unwrap();
    let ra = Checkpoint::read(&pa, resumed.model().config()).unwrap();
    let rb = Checkpoint::read(&pb, straight.model().config()).unwrap();
    assert!(ra == rb && ra == a, "checkpoint files differ");
    assert_eq!(
        checkpoint::latest(&dir).unwrap().map(|x| x.0),
        Some(3),
        "only step-N files count"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_and_mismatched_checkpoints_are_refused() {
    let cfg = small();
    let dir = tmpdir("corrupt");
    let mut t = Trainer::new(&cfg).unwrap();
    t.step().unwrap();
    let good = dir.join(checkpoint::file_name(1));
    t.save(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    // no temporary file is left behind
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

    let bad = dir.join("bad.safetensors");
    let refuse = |path: &PathBuf, cfg: &RunConfig, needles: &[&str]| {
        let e = Trainer::resume(cfg, path).unwrap_err().to_string();
        for n in needles {
            assert!(e.contains(n), "{n:?} not in: {e}");
        }
    };
    // truncated
    std::fs::write(&bad, &bytes[..bytes.len() - 100]).unwrap();
    refuse(
        &bad,
        &cfg,
        &["bad.safetensors", "not a usable checkpoint", "corrupt"],
    );
    // garbage
    std::fs::write(&bad, b"not a checkpoint at all").unwrap();
    refuse(
        &bad,
        &cfg,
        &["bad.safetensors", "not a valid safetensors file"],
    );
    // a flipped byte in the header
    let mut flipped = bytes.clone();
    flipped[10] ^= 0xff;
    std::fs::write(&bad, &flipped).unwrap();
    refuse(&bad, &cfg, &["bad.safetensors"]);
    // a safetensors file that is not a checkpoint
    crate::io::write_tensors(&bad, &[("x", &crate::Tensor::zeros(&[2]))]).unwrap();
    refuse(&bad, &cfg, &["not a gdn train checkpoint"]);
    // another model config
    let mut other = cfg.clone();
    other.model.layer.hidden_size = 32;
    refuse(
        &good,
        &other,
        &[
            "different model",
            "hidden_size = 16 in the checkpoint, 32 in this run",
        ],
    );
    let mut other = cfg.clone();
    other.model.layer.variant = crate::Variant::Gdn2;
    refuse(
        &good,
        &other,
        &["variant = \"gdn\" in the checkpoint, \"gdn2\" in this run"],
    );
    let mut other = cfg.clone();
    other.data.value_vocab_size = 20;
    refuse(
        &good,
        &other,
        &["vocab_size = 32 in the checkpoint, 36 in this run"],
    );
    // another data seed
    let mut other = cfg.clone();
    other.data.seed = 5;
    refuse(&good, &other, &["data seed 1234", "this run has 5"]);
    // missing
    refuse(&dir.join("nope.safetensors"), &cfg, &["nope.safetensors"]);
    // the good one still loads
    assert_eq!(Trainer::resume(&cfg, &good).unwrap().step_count(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A short run lowers the held-out loss well below its start.
#[test]
fn short_training_lowers_the_loss() {
    let mut cfg = small();
    cfg.train.train_iters = 200;
    let mut t = Trainer::new(&cfg).unwrap();
    let before = t.evaluate().unwrap();
    let mut first = None;
    let mut last = None;
    for _ in 0..200 {
        let s = t.step().unwrap();
        first.get_or_insert(s.loss.loss());
        last = Some(s.loss.loss());
        assert!(s.activation_bytes > s.gdn_activation_bytes && s.gdn_activation_bytes > 0);
        assert_eq!(s.tokens, 8 * 16);
    }
    let after = t.evaluate().unwrap();
    // from ln(32) (uniform over the vocabulary) towards ln(16) (uniform over the values)
    assert!(
        after.loss() < before.loss() - 0.5,
        "held-out loss {} -> {}",
        before.loss(),
        after.loss()
    );
    assert!(last.unwrap() < first.unwrap() - 0.5);
}

/// A 2-block model learns MQAR (4 pairs, 16 values: chance 6.25%) far above chance in 300
/// steps (about 3 s).
#[test]
fn learns_mqar_far_above_chance() {
    let cfg = RunConfig::from_toml_str(
        r#"
        [model]
        hidden_size = 32
        ffn_hidden_size = 64
        linear_num_key_heads = 1
        linear_num_value_heads = 2
        linear_key_head_dim = 16
        linear_value_head_dim = 16
        [data]
        seq_length = 32
        batch_size = 16
        num_kv_pairs = 4
        key_vocab_size = 16
        value_vocab_size = 16
        eval_sequences = 64
        [optimizer]
        lr_warmup_iters = 20
        [train]
        train_iters = 600
        "#,
    )
    .unwrap();
    let mut t = Trainer::new(&cfg).unwrap();
    for _ in 0..300 {
        t.step().unwrap();
    }
    let e = t.evaluate().unwrap();
    assert_eq!(e.count, 64 * 12);
    assert!(e.accuracy() > 0.4, "held-out accuracy {}", e.accuracy());
}

// ---- resume trusts only what it has checked -------------------------------------------------

/// A checkpoint of `small()` after `steps` steps, saved as `dir/step-N.safetensors`.
fn saved(dir: &std::path::Path, cfg: &RunConfig, steps: u64) -> PathBuf {
    let mut t = Trainer::new(cfg).unwrap();
    for _ in 0..steps {
        t.step().unwrap();
    }
    let p = dir.join(checkpoint::file_name(steps));
    t.save(&p).unwrap();
    p
}

/// Flip one bit of the byte `from_end` bytes before the end of the file (the data section).
fn flip_data_bit(p: &std::path::Path, from_end: usize) {
    let mut b = std::fs::read(p).unwrap();
    let i = b.len() - from_end;
    b[i] ^= 0x01;
    std::fs::write(p, b).unwrap();
}

#[test]
fn fnv1a64_matches_the_published_test_vectors() {
    use checkpoint::Fnv1a64;
    // from the FNV reference (isthe.com/chongo/tech/comp/fnv), 64-bit FNV-1a
    assert_eq!(Fnv1a64::hash(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(Fnv1a64::hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(Fnv1a64::hash(b"foobar"), 0x8594_4171_f739_67e8);
    let mut h = Fnv1a64::default();
    h.update(b"foo");
    h.update(b"bar");
    assert_eq!(h.finish(), 0x8594_4171_f739_67e8);
}

/// A flipped bit in the tensor data (which leaves every value finite and every shape right) or
/// in a metadata value is a checksum mismatch naming the file.
#[test]
fn checksum_catches_flipped_bytes() {
    let cfg = small();
    let dir = tmpdir("checksum");
    let good = saved(&dir, &cfg, 1);
    let bytes = std::fs::read(&good).unwrap();
    let ck = Checkpoint::load(&good).unwrap();
    assert_eq!(ck.step, 1);
    for (what, at) in [("tensor data", bytes.len() - 7), ("first tensor byte", 0)] {
        let mut b = bytes.clone();
        let i = if at == 0 {
            // the first byte of the data section: after the 8-byte length and the header
            8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize
        } else {
            at
        };
        b[i] ^= 0x01;
        let p = dir.join("flipped.safetensors");
        std::fs::write(&p, &b).unwrap();
        let e = Checkpoint::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("flipped.safetensors") && e.contains("checksum mismatch"),
            "{what}: {e}"
        );
        let e = Trainer::resume(&cfg, &p).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{what}: {e}");
    }
    // a digit of the run config in the metadata: `train_iters = 6` -> `train_iters = 7`
    let pos = bytes
        .windows(15)
        .position(|w| w == b"train_iters = 6")
        .expect("run config in the header");
    let mut b = bytes.clone();
    b[pos + 14] = b'7';
    let p = dir.join("meta.safetensors");
    std::fs::write(&p, &b).unwrap();
    let e = Checkpoint::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("meta.safetensors") && e.contains("checksum mismatch"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A version-1 checkpoint (no checksum) is refused with a message naming the version, and is not
/// passed over as corrupt.
#[test]
fn version_1_checkpoints_are_refused() {
    let cfg = small();
    let dir = tmpdir("v1");
    let good = saved(&dir, &cfg, 1);
    let buf = std::fs::read(&good).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&buf).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    meta.insert(checkpoint::FORMAT_KEY.into(), "1".into());
    meta.remove(checkpoint::CHECKSUM_KEY);
    let tensors = crate::io::read_tensors(&good).unwrap();
    let items: Vec<(&str, &crate::Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let old = dir.join(checkpoint::file_name(2));
    crate::io::write_tensors_with_meta(&old, &items, meta).unwrap();
    let e = Checkpoint::load(&old).unwrap_err().to_string();
    assert!(
        e.contains("step-00000002.safetensors") && e.contains("format version 1"),
        "{e}"
    );
    assert!(matches!(
        Checkpoint::load_checked(&old),
        Err(checkpoint::Rejected::Unusable(_))
    ));
    // the newest is v1: no fallback to step 1
    let e = rundir::load_latest(&dir).unwrap_err().to_string();
    assert!(e.contains("format version 1"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The newest checkpoint that passes its checks is used; corrupt newer ones are listed with the
/// reason; none good is an error naming each.
#[test]
fn load_latest_falls_back_over_corrupt_checkpoints() {
    let cfg = small();
    let dir = tmpdir("fallback");
    let e = rundir::load_latest(&dir).unwrap_err().to_string();
    assert!(e.contains("no checkpoint"), "{e}");
    let p1 = saved(&dir, &cfg, 1);
    let p2 = saved(&dir, &cfg, 2);
    let l = rundir::load_latest(&dir).unwrap();
    assert_eq!((l.path.clone(), l.checkpoint.step), (p2.clone(), 2));
    assert!(l.rejected.is_empty());
    flip_data_bit(&p2, 5);
    let l = rundir::load_latest(&dir).unwrap();
    assert_eq!((l.path.clone(), l.checkpoint.step), (p1.clone(), 1));
    assert_eq!(l.rejected.len(), 1);
    assert_eq!(l.rejected[0].0, p2);
    assert!(l.rejected[0].1.to_string().contains("checksum mismatch"));
    // truncated counts as corrupt too
    let b = std::fs::read(&p1).unwrap();
    std::fs::write(&p1, &b[..b.len() / 2]).unwrap();
    let e = rundir::load_latest(&dir).unwrap_err().to_string();
    assert!(
        e.contains("no usable checkpoint")
            && e.contains("step-00000001.safetensors")
            && e.contains("step-00000002.safetensors"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resume under a run config that differs from the checkpoint's is refused naming the key;
/// `train.train_iters` (extended by --steps) may differ.
#[test]
fn resume_refuses_another_run_config_naming_the_key() {
    let cfg = small();
    let dir = tmpdir("runcfg");
    let p = saved(&dir, &cfg, 2);
    let mut other = cfg.clone();
    other.optimizer.lr = 0.01;
    let e = Trainer::resume(&other, &p).unwrap_err().to_string();
    assert!(
        e.contains("step-00000002.safetensors")
            && e.contains("optimizer.lr = 0.003 in the checkpoint, 0.01 in this run"),
        "{e}"
    );
    let mut other = cfg.clone();
    other.train.log_interval = 3;
    other.data.batch_size = 4;
    let e = Trainer::resume(&other, &p).unwrap_err().to_string();
    assert!(
        e.contains("data.batch_size = 8 in the checkpoint, 4 in this run")
            && e.contains("train.log_interval = 10 in the checkpoint, 3 in this run"),
        "{e}"
    );
    let mut longer = cfg.clone();
    longer.train.train_iters = 60;
    let t = Trainer::resume(&longer, &p).unwrap();
    assert_eq!(t.step_count(), 2);
    assert_eq!(t.config().train.train_iters, 60);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A text run records its data's size and hash; a resume on changed data is refused (naming the
/// file and both sizes and hashes) unless allowed.
#[test]
fn resume_refuses_changed_text_data_unless_allowed() {
    let mut cfg = small();
    cfg.data.kind = DataKind::Text;
    cfg.data.path = Some(PathBuf::from("/data/corpus.txt"));
    let bytes: Vec<u8> = (0..2000u32).map(|i| (i * 7 % 251) as u8).collect();
    let dir = tmpdir("textdata");
    let data = Dataset::text_from_bytes(bytes.clone(), &cfg.data).unwrap();
    let mut t = Trainer::with_data(&cfg, data).unwrap();
    t.step().unwrap();
    let p = dir.join(checkpoint::file_name(1));
    t.save(&p).unwrap();
    let ck = Checkpoint::load(&p).unwrap();
    let rec = ck.data_file.expect("a text run records its data");
    assert_eq!(rec.size, 2000);
    assert_eq!(rec.hash, checkpoint::Fnv1a64::hash(&bytes));

    let resume = |b: Vec<u8>, allow: bool| {
        let data = Dataset::text_from_bytes(b, &cfg.data).unwrap();
        let opts = ResumeOptions {
            allow_data_change: allow,
        };
        Trainer::from_checkpoint(&cfg, data, Checkpoint::load(&p).unwrap(), &p, opts)
    };
    let (same, notes) = resume(bytes.clone(), false).unwrap();
    assert_eq!(same.step_count(), 1);
    assert!(notes.is_empty());
    let mut changed = bytes.clone();
    changed[100] ^= 1;
    changed.push(b'x');
    let e = resume(changed.clone(), false).unwrap_err().to_string();
    assert!(
        e.contains("/data/corpus.txt")
            && e.contains("changed since the checkpoint")
            && e.contains("2000 bytes")
            && e.contains("2001 bytes")
            && e.contains("allow-data-change"),
        "{e}"
    );
    // same size, other content
    let mut flipped = bytes.clone();
    flipped[5] ^= 1;
    assert!(resume(flipped, false).is_err());
    let (t, notes) = resume(changed, true).unwrap();
    assert_eq!(t.step_count(), 1);
    assert_eq!(notes.len(), 1);
    assert!(notes[0].contains("2001 bytes"), "{}", notes[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn text_data_over_the_size_limit_is_refused_unread() {
    let dir = tmpdir("bigtext");
    let p = dir.join("huge.txt");
    // sparse: no disk space used
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(data::MAX_TEXT_DATA_BYTES + 1).unwrap();
    let e = Text::load(&p, 8).unwrap_err().to_string();
    assert!(
        e.contains("huge.txt") && e.contains(&data::MAX_TEXT_DATA_BYTES.to_string()),
        "{e}"
    );
    let e = Text::load(&dir, 8).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `config.toml` of a run: complete is read; empty or lacking keys is refused, naming them.
#[test]
fn run_config_file_must_be_complete() {
    let cfg = small();
    let dir = tmpdir("cfgfile");
    let path = dir.join(rundir::CONFIG);
    let e = rundir::read_config(&dir).unwrap_err().to_string();
    assert!(e.contains("no config.toml"), "{e}");
    let doc = cfg.to_toml_string();
    std::fs::write(&path, &doc).unwrap();
    assert_eq!(rundir::read_config(&dir).unwrap(), cfg);
    std::fs::write(&path, "").unwrap();
    let e = rundir::read_config(&dir).unwrap_err().to_string();
    assert!(e.contains("config.toml") && e.contains("is empty"), "{e}");
    std::fs::write(&path, "\n  \n").unwrap();
    assert!(rundir::read_config(&dir).is_err());
    // one key gone
    let without: String = doc
        .lines()
        .filter(|l| !l.starts_with("log_interval"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(without, doc);
    std::fs::write(&path, &without).unwrap();
    let e = rundir::read_config(&dir).unwrap_err().to_string();
    assert!(
        e.contains("lacks 1 key") && e.contains("train.log_interval"),
        "{e}"
    );
    // cut after the [model] section
    let model_only = &doc[..doc.find("[data]").unwrap()];
    std::fs::write(&path, model_only).unwrap();
    let e = rundir::read_config(&dir).unwrap_err().to_string();
    assert!(e.contains("data.seq_length") && e.contains("more"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(unix)]
#[test]
fn stray_temp_files_are_removed_and_nothing_else() {
    let dir = tmpdir("strays");
    let ck = dir.join(rundir::CHECKPOINTS);
    std::fs::create_dir(&ck).unwrap();
    // pids above the largest pid_max (2^22) name processes that cannot be running
    let strays = [
        dir.join("config.toml.tmp-9000017"),
        dir.join("metrics.jsonl.tmp-9000017-2"),
        dir.join("curves.png.tmp-9000003.png"),
        ck.join("step-00000004.safetensors.tmp-9000099"),
        dir.join(format!("config.toml.tmp-{}-1", std::process::id())),
    ];
    let live = std::os::unix::process::parent_id();
    let kept = [
        // a write in progress by a running process
        dir.join(format!("metrics.jsonl.tmp-{live}-1")),
        dir.join("notes.tmp-1"),
        dir.join("config.toml"),
        ck.join("step-00000004.safetensors"),
        ck.join("mine.safetensors.tmp-1"),
        dir.join("config.toml.tmp"),
    ];
    for p in strays.iter().chain(&kept) {
        std::fs::write(p, b"x").unwrap();
    }
    // a directory with a temp file's name is not a temp file
    std::fs::create_dir(dir.join("metrics.jsonl.tmp-5")).unwrap();
    let mut removed = rundir::remove_stray_temps(&dir).unwrap();
    removed.sort();
    let mut want = strays.to_vec();
    want.sort();
    assert_eq!(removed, want);
    for p in &strays {
        assert!(!p.exists(), "{}", p.display());
    }
    for p in &kept {
        assert!(p.exists(), "{}", p.display());
    }
    assert!(dir.join("metrics.jsonl.tmp-5").is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A new run directory removes exactly what it created when dropped before `keep`.
#[test]
fn new_run_dir_removes_only_what_it_created() {
    let root = tmpdir("newrun");
    // missing parents: all created, all removed
    let dir = root.join("a/b/run");
    let mut nd = rundir::NewRunDir::create(&dir).unwrap();
    nd.write_file(rundir::CONFIG, b"x").unwrap();
    nd.create_subdir(rundir::CHECKPOINTS).unwrap();
    nd.write_file(rundir::METRICS, b"").unwrap();
    assert!(dir.join(rundir::CHECKPOINTS).is_dir());
    drop(nd);
    assert!(!root.join("a").exists());
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);

    // an existing empty directory stays, emptied; a file someone else put in a created
    // subdirectory keeps that subdirectory
    let dir = root.join("empty");
    std::fs::create_dir(&dir).unwrap();
    let mut nd = rundir::NewRunDir::create(&dir).unwrap();
    nd.write_file(rundir::CONFIG, b"x").unwrap();
    let sub = nd.create_subdir(rundir::CHECKPOINTS).unwrap();
    std::fs::write(sub.join("theirs.txt"), b"keep me").unwrap();
    let notes = nd.remove_created();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("left") && n.contains("checkpoints")),
        "{notes:?}"
    );
    drop(nd);
    assert!(dir.is_dir());
    assert!(!dir.join(rundir::CONFIG).exists());
    assert_eq!(std::fs::read(sub.join("theirs.txt")).unwrap(), b"keep me");

    // kept: everything stays
    let dir = root.join("kept");
    let mut nd = rundir::NewRunDir::create(&dir).unwrap();
    nd.write_file(rundir::CONFIG, b"x").unwrap();
    nd.keep();
    drop(nd);
    assert!(dir.join(rundir::CONFIG).is_file());

    // what is in the way
    let e = rundir::NewRunDir::check(&dir).unwrap_err().to_string();
    assert!(e.contains("already holds a run"), "{e}");
    let user = root.join("user");
    std::fs::create_dir(&user).unwrap();
    std::fs::write(user.join("notes.md"), b"mine").unwrap();
    let e = rundir::NewRunDir::create(&user).unwrap_err().to_string();
    assert!(e.contains("not empty") && e.contains("notes.md"), "{e}");
    assert_eq!(std::fs::read(user.join("notes.md")).unwrap(), b"mine");
    assert_eq!(std::fs::read_dir(&user).unwrap().count(), 1);
    let e = rundir::NewRunDir::check(&user.join("notes.md"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a directory"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}
