//! Model inference on the CPU: decoded logits give the training forward's loss; extend equals
//! one prefill of the concatenation; errors leave the cache bitwise unchanged.

use super::*;
use crate::config::Variant;
use crate::testutil::{bits, rng};
use crate::GdnConfig;
use rand::Rng;

fn tiny(variant: Variant, tied: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        ffn_hidden_size: 6,
        share_embeddings_and_output_weights: tied,
        layer: GdnConfig {
            hidden_size: 8,
            num_layers: 2,
            linear_num_key_heads: 1,
            linear_num_value_heads: 2,
            linear_key_head_dim: 4,
            linear_value_head_dim: 3,
            variant,
            init_method_std: 0.4,
            ..GdnConfig::default()
        },
    }
}

/// Sum over rows of `lse(logits) - logits[target]` in f64.
fn ce_sum(logits: &[f32], v: usize, targets: &[u32]) -> f64 {
    logits
        .chunks(v)
        .zip(targets)
        .map(|(row, &t)| {
            let m = row.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            lse - row[t as usize] as f64
        })
        .sum()
}

fn snapshot(c: &ModelCache) -> Vec<Vec<u32>> {
    (0..c.pools.len())
        .flat_map(|i| {
            let p = c.layer(i).unwrap();
            [
                bits(p.state_host().unwrap().data()),
                bits(p.conv_host().unwrap().data()),
            ]
        })
        .collect()
}

/// Prefill a prompt of 5 tokens per sequence, then decode the next 15 one at a time (slots in
/// another order than the sequences, one padding row): the logits at positions 4..20 give the
/// training forward's cross-entropy (its targets there; the prompt's first four ignored) to f32
/// rounding.
#[test]
fn decoded_logits_give_the_training_forward_loss() {
    for (variant, tied) in [(Variant::Gdn, false), (Variant::Gdn2, true)] {
        let cfg = tiny(variant, tied);
        let m = Model::new(&cfg, 7).unwrap();
        let (b, t, p, v) = (3usize, 20usize, 5usize, cfg.vocab_size);
        let mut r = rng(8);
        let tokens: Vec<u32> = (0..b * t).map(|_| r.gen_range(0..v as u32)).collect();
        // Targets: the next token (positions 4 .. t-2), the rest ignored.
        let mut targets = vec![IGNORE_INDEX; b * t];
        for s in 0..b {
            for i in p - 1..t - 1 {
                targets[s * t + i] = tokens[s * t + i + 1] as i32;
            }
        }
        let want = m
            .evaluate(&Batch::new(tokens.clone(), targets, b, t).unwrap())
            .unwrap();
        let slot_of = [2i32, 0, 3];
        let mut cache = m.cache(4).unwrap();
        let prompt: Vec<u32> = (0..b)
            .flat_map(|s| tokens[s * t..s * t + p].to_vec())
            .collect();
        let mut logits = vec![Vec::new(); b];
        let l0 = m
            .prefill(&prompt, &Seqs::uniform(b, p), &slot_of, &mut cache)
            .unwrap();
        for s in 0..b {
            logits[s].extend_from_slice(&l0[s * v..(s + 1) * v]);
        }
        // Decode rows: sequence 1, padding, sequence 2, sequence 0.
        let order = [1usize, usize::MAX, 2, 0];
        let slots: Vec<i32> = order
            .iter()
            .map(|&s| if s == usize::MAX { -1 } else { slot_of[s] })
            .collect();
        for i in p..t - 1 {
            let tok: Vec<u32> = order
                .iter()
                .map(|&s| {
                    if s == usize::MAX {
                        3
                    } else {
                        tokens[s * t + i]
                    }
                })
                .collect();
            let l = m.decode(&tok, &slots, &mut cache).unwrap();
            for (row, &s) in order.iter().enumerate() {
                if s != usize::MAX {
                    logits[s].extend_from_slice(&l[row * v..(row + 1) * v]);
                }
            }
        }
        let mut sum = 0.0;
        for s in 0..b {
            sum += ce_sum(&logits[s], v, &tokens[s * t + p..(s + 1) * t]);
        }
        let e = (sum - want.loss_sum).abs() / want.loss_sum.abs();
        eprintln!(
            "{variant:?}: decoded loss sum {sum} vs forward {}: {e:.2e}",
            want.loss_sum
        );
        assert_eq!(want.count, b * (t - p));
        assert!(e < 1e-5, "{variant:?}: {sum} vs {}", want.loss_sum);
    }
}

/// Prefill of A then extend by B gives the logits of one prefill of A ++ B (last tokens).
#[test]
fn model_extend_equals_one_prefill() {
    let cfg = tiny(Variant::Gdn, false);
    let m = Model::new(&cfg, 9).unwrap();
    let v = cfg.vocab_size;
    let mut r = rng(10);
    let (a, b) = ([4usize, 70], [66usize, 3]);
    let seqs_tok: Vec<Vec<u32>> = (0..2)
        .map(|i| (0..a[i] + b[i]).map(|_| r.gen_range(0..v as u32)).collect())
        .collect();
    let pack = |from: &[usize], lens: &[usize]| -> (Vec<u32>, Seqs) {
        let t: Vec<u32> = (0..2)
            .flat_map(|i| seqs_tok[i][from[i]..from[i] + lens[i]].to_vec())
            .collect();
        let n = t.len();
        let cu = [0, lens[0] as u64, (lens[0] + lens[1]) as u64];
        (t, Seqs::packed(&cu, n).unwrap())
    };
    let mut c1 = m.cache(2).unwrap();
    let (ta, sa) = pack(&[0, 0], &a);
    m.prefill(&ta, &sa, &[1, 0], &mut c1).unwrap();
    let (tb, sb) = pack(&a, &b);
    let l1 = m.extend(&tb, &sb, &[1, 0], &mut c1).unwrap();
    let mut c2 = m.cache(2).unwrap();
    let (tf, sf) = pack(&[0, 0], &[a[0] + b[0], a[1] + b[1]]);
    let l2 = m.prefill(&tf, &sf, &[1, 0], &mut c2).unwrap();
    let mx = l2.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let e = l1
        .iter()
        .zip(&l2)
        .fold(0.0f32, |e, (x, y)| e.max((x - y).abs()))
        / mx;
    assert!(e < 2e-5, "extend vs one prefill: {e}");
}

/// Bad tokens, slots and lengths are errors that leave every layer's pool bitwise unchanged.
#[test]
fn model_inference_errors_leave_the_cache_unchanged() {
    let cfg = tiny(Variant::Gdn2, false);
    let m = Model::new(&cfg, 11).unwrap();
    let mut cache = m.cache(3).unwrap();
    m.prefill(
        &[1, 2, 3, 4, 5],
        &Seqs::packed(&[0, 2, 5], 5).unwrap(),
        &[0, 2],
        &mut cache,
    )
    .unwrap();
    let before = snapshot(&cache);
    let errs = [
        m.decode(&[1, 11], &[0, 2], &mut cache).unwrap_err(),
        m.decode(&[1, 2], &[0, 3], &mut cache).unwrap_err(),
        m.decode(&[1, 2], &[2, 2], &mut cache).unwrap_err(),
        m.decode(&[1, 2, 3], &[0, 2], &mut cache).unwrap_err(),
        m.extend(
            &[1, 2],
            &Seqs::packed(&[0, 2], 2).unwrap(),
            &[0, 1],
            &mut cache,
        )
        .unwrap_err(),
        m.extend(
            &[1, 2],
            &Seqs::packed(&[0, 3], 3).unwrap(),
            &[0],
            &mut cache,
        )
        .unwrap_err(),
    ];
    assert!(
        errs[0].to_string().contains("tokens[1] = 11"),
        "{}",
        errs[0]
    );
    assert_eq!(before, snapshot(&cache));
    let other = Model::new(&tiny(Variant::Gdn, false), 1).unwrap();
    let mut wrong = other.cache(3).unwrap();
    assert!(m.decode(&[1], &[0], &mut wrong).is_err());
}
