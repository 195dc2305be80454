//! The slot API on the CPU: prefill + extend + decode against the f64 layer over the whole
//! sequences, extend against one prefill of the concatenation, padding slots bitwise unchanged,
//! errors leaving every slot bitwise unchanged, and a pool through safetensors.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use super::*;
use crate::config::{GdnConfig, Normalization, Variant};
use crate::layer::reference::{self, RefParams};
use crate::testutil::{bits, to_f64};

fn tiny(variant: Variant, ratio: usize, width: usize, in_kernel: bool) -> GdnConfig {
    GdnConfig {
        variant,
        hidden_size: 8,
        num_layers: 2,
        linear_num_key_heads: 1,
        linear_num_value_heads: ratio,
        linear_key_head_dim: 4,
        linear_value_head_dim: 3,
        linear_conv_kernel_dim: width,
        normalization: Normalization::RMSNorm,
        conv_bias: true,
        use_qk_l2norm_in_kernel: in_kernel,
        ..GdnConfig::default()
    }
}

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            z as f32
        })
        .collect()
}

/// A layer with every parameter moved off its init (generic gates, a nonlinear layer).
fn layer(cfg: &GdnConfig, seed: u64) -> GatedDeltaNet {
    let mut l = GatedDeltaNet::new(cfg, seed).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 100);
    for (name, t) in l.params_mut().iter_mut() {
        let s = match name {
            "in_proj.weight" | "out_proj.weight" => 0.5,
            "A_log" | "dt_bias" => 0.3,
            _ => 0.2,
        };
        for v in t.data_mut() {
            *v += s * rng.gen_range(-1.0f32..1.0);
        }
    }
    l
}

/// max |a - b| / max |b|.
fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    let m = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .fold(0.0f64, |e, (x, y)| e.max((*x as f64 - y).abs()))
        / m
}

fn cu_of(lens: &[usize]) -> Vec<u64> {
    let mut cu = vec![0u64];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as u64);
    }
    cu
}

/// Sequences of `full`, tokens `[from[i], from[i] + lens[i])` of each, packed.
fn part(full: &[Vec<f32>], h: usize, from: &[usize], lens: &[usize]) -> (Tensor, Seqs) {
    let n = full.len();
    let x: Vec<f32> = (0..n)
        .flat_map(|i| full[i][from[i] * h..(from[i] + lens[i]) * h].to_vec())
        .collect();
    let cu = cu_of(lens);
    let t = cu[n] as usize;
    (
        Tensor::from_vec(&[t, h], x).unwrap(),
        Seqs::packed(&cu, t).unwrap(),
    )
}

fn snapshot(pool: &CachePool) -> (Vec<u32>, Vec<u32>) {
    (
        bits(pool.state_host().unwrap().data()),
        bits(pool.conv_host().unwrap().data()),
    )
}

/// Prefill (empty, short, across a chunk) into permuted slots of a larger pool, extend, decode
/// `steps` tokens with the sequences in another order plus a padding row; every output against
/// the f64 layer over the whole sequences, each slot's state against the f64 final state, the
/// slots no sequence uses still zero.
fn check_slots_against_f64(cfg: &GdnConfig, seed: u64) {
    let l = layer(cfg, seed);
    let h = cfg.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    let (prompt, ext, steps) = ([0usize, 1, 5, 70], [3usize, 0, 66, 2], 5);
    let n = prompt.len();
    let slot_of = [4i32, 0, 5, 2];
    let total: Vec<usize> = (0..n).map(|i| prompt[i] + ext[i] + steps).collect();
    let full: Vec<Vec<f32>> = total.iter().map(|&t| randn(&mut rng, t * h)).collect();
    let cu_f = cu_of(&total);
    let mut ours = vec![f32::NAN; cu_f[n] as usize * h];
    let mut place = |y: &[f32], from: &[usize], lens: &[usize], order: &[usize]| {
        let mut r = 0;
        for &i in order {
            let dst = (cu_f[i] as usize + from[i]) * h;
            ours[dst..dst + lens[i] * h].copy_from_slice(&y[r * h..(r + lens[i]) * h]);
            r += lens[i];
        }
    };
    let mut pool = l.cache_pool(7).unwrap();
    let (xp, sp) = part(&full, h, &[0; 4], &prompt);
    let yp = l.prefill_slots(&xp, &sp, &slot_of, &mut pool).unwrap();
    place(yp.data(), &[0; 4], &prompt, &[0, 1, 2, 3]);
    let (xe, se) = part(&full, h, &prompt, &ext);
    let ye = l.extend_slots(&xe, &se, &slot_of, &mut pool).unwrap();
    place(ye.data(), &prompt, &ext, &[0, 1, 2, 3]);
    // Decode rows: sequences 2, 0, padding, 3, 1.
    let order = [2usize, 0, usize::MAX, 3, 1];
    let slots: Vec<i32> = order
        .iter()
        .map(|&i| if i == usize::MAX { -1 } else { slot_of[i] })
        .collect();
    for s in 0..steps {
        let mut x = Vec::new();
        for &i in &order {
            if i == usize::MAX {
                x.extend(randn(&mut rng, h));
            } else {
                let t = prompt[i] + ext[i] + s;
                x.extend_from_slice(&full[i][t * h..(t + 1) * h]);
            }
        }
        let y = l
            .decode_slots(&Tensor::from_vec(&[5, h], x).unwrap(), &slots, &mut pool)
            .unwrap();
        for (r, &i) in order.iter().enumerate() {
            if i != usize::MAX {
                let from = prompt[i] + ext[i] + s;
                let dst = (cu_f[i] as usize + from) * h;
                ours[dst..dst + h].copy_from_slice(&y.data()[r * h..(r + 1) * h]);
            }
        }
    }
    let cu: Vec<usize> = cu_f.iter().map(|&c| c as usize).collect();
    let (yr, fin) = reference::forward_with_state(
        cfg,
        &RefParams::from_params(l.params()),
        &to_f64(&full.concat()),
        &cu,
        None,
    );
    let e = max_rel(&ours, &yr);
    eprintln!(
        "slots: prefill + extend + decode vs f64 layer ({:?}, Hv {}, W {}): {e:.2e}",
        cfg.variant, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    );
    assert!(e < 2e-5, "{cfg:?}: outputs vs f64 layer: {e}");
    let st = pool.state_host().unwrap();
    let sl = l
        .state_shape(&Seqs::uniform(1, 1))
        .iter()
        .product::<usize>();
    for (i, &s) in slot_of.iter().enumerate() {
        let got = &st.data()[s as usize * sl..(s as usize + 1) * sl];
        let e = max_rel(got, &fin[i * sl..(i + 1) * sl]);
        assert!(e < 2e-5, "sequence {i} (slot {s}): state vs f64: {e}");
    }
    for s in [1usize, 3, 6] {
        assert!(
            st.data()[s * sl..(s + 1) * sl]
                .iter()
                .all(|v| v.to_bits() == 0),
            "slot {s} is used by no sequence and must stay zero"
        );
    }
}

#[test]
fn slot_prefill_extend_decode_match_the_f64_layer() {
    check_slots_against_f64(&tiny(Variant::Gdn, 2, 3, false), 21);
    check_slots_against_f64(&tiny(Variant::Gdn, 1, 4, true), 22);
    check_slots_against_f64(&tiny(Variant::Gdn2, 2, 3, false), 23);
    check_slots_against_f64(&tiny(Variant::Gdn2, 2, 2, true), 24);
}

/// Prefill of A then extend by B equals one prefill of A ++ B (outputs of B, states and conv
/// rows), to f32 rounding of the different chunking.
#[test]
fn extend_equals_one_prefill_of_the_concatenation() {
    for variant in [Variant::Gdn, Variant::Gdn2] {
        let cfg = tiny(variant, 2, 4, false);
        let l = layer(&cfg, 31);
        let h = cfg.hidden_size;
        let mut rng = ChaCha8Rng::seed_from_u64(32);
        let (a, b) = ([7usize, 2, 65], [9usize, 70, 1]);
        let full: Vec<Vec<f32>> = (0..3).map(|i| randn(&mut rng, (a[i] + b[i]) * h)).collect();
        let slots = [1i32, 2, 0];
        let mut p1 = l.cache_pool(3).unwrap();
        let (xa, sa) = part(&full, h, &[0; 3], &a);
        l.prefill_slots(&xa, &sa, &slots, &mut p1).unwrap();
        let (xb, sb) = part(&full, h, &a, &b);
        let yb = l.extend_slots(&xb, &sb, &slots, &mut p1).unwrap();
        let mut p2 = l.cache_pool(3).unwrap();
        let tot: Vec<usize> = (0..3).map(|i| a[i] + b[i]).collect();
        let (xf, sf) = part(&full, h, &[0; 3], &tot);
        let yf = l.prefill_slots(&xf, &sf, &slots, &mut p2).unwrap();
        let cu = cu_of(&tot);
        let want: Vec<f32> = (0..3)
            .flat_map(|i| yf.data()[(cu[i] as usize + a[i]) * h..cu[i + 1] as usize * h].to_vec())
            .collect();
        let e = max_rel(yb.data(), &to_f64(&want));
        assert!(e < 2e-5, "{variant:?}: extend outputs vs one prefill: {e}");
        let e = max_rel(
            p1.state_host().unwrap().data(),
            &to_f64(p2.state_host().unwrap().data()),
        );
        assert!(e < 2e-5, "{variant:?}: states: {e}");
        assert_eq!(
            bits(p1.conv_host().unwrap().data()),
            bits(p2.conv_host().unwrap().data()),
            "{variant:?}: conv rows are the in_proj rows of the last W-1 tokens, bitwise"
        );
    }
}

/// Padding rows (slot -1) in prefill and decode change no slot; slots not named are bitwise
/// unchanged; a decode of a subset leaves the others bitwise as they were.
#[test]
fn padding_and_unnamed_slots_are_bitwise_unchanged() {
    let cfg = tiny(Variant::Gdn, 2, 4, false);
    let l = layer(&cfg, 41);
    let h = cfg.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut pool = l.cache_pool(4).unwrap();
    let x = Tensor::from_vec(&[12, h], randn(&mut rng, 12 * h)).unwrap();
    let seqs = Seqs::packed(&[0, 5, 9, 12], 12).unwrap();
    l.prefill_slots(&x, &seqs, &[3, -1, 1], &mut pool).unwrap();
    let before = snapshot(&pool);
    let sl = 2 * 4 * 3;
    let cl = 3 * cfg.conv_dim();
    // Slots 0 and 2 untouched by the prefill (zero), 1 and 3 written.
    let st = pool.state_host().unwrap();
    assert!(st.data()[..sl].iter().all(|v| v.to_bits() == 0));
    assert!(st.data()[2 * sl..3 * sl].iter().all(|v| v.to_bits() == 0));
    assert!(st.data()[3 * sl..].iter().any(|v| *v != 0.0));
    // Decode only slot 3 (padding rows around it): slots 0, 1, 2 bitwise unchanged.
    let xd = Tensor::from_vec(&[3, h], randn(&mut rng, 3 * h)).unwrap();
    l.decode_slots(&xd, &[-1, 3, -1], &mut pool).unwrap();
    let after = snapshot(&pool);
    assert_eq!(
        before.0[..3 * sl],
        after.0[..3 * sl],
        "states of slots 0..3"
    );
    assert_ne!(before.0[3 * sl..], after.0[3 * sl..], "slot 3 advanced");
    assert_eq!(
        before.1[..3 * cl],
        after.1[..3 * cl],
        "conv rows of slots 0..3"
    );
    // All padding: nothing changes.
    l.decode_slots(&xd, &[-1, -1, -1], &mut pool).unwrap();
    assert_eq!(after, snapshot(&pool));
}

/// Every bad call is an error and leaves every slot bitwise as it was.
#[test]
fn errors_leave_every_slot_unchanged() {
    let cfg = tiny(Variant::Gdn2, 2, 3, false);
    let l = layer(&cfg, 51);
    let h = cfg.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(52);
    let mut pool = l.cache_pool(3).unwrap();
    let x = Tensor::from_vec(&[6, h], randn(&mut rng, 6 * h)).unwrap();
    let seqs = Seqs::packed(&[0, 2, 6], 6).unwrap();
    l.prefill_slots(&x, &seqs, &[0, 2], &mut pool).unwrap();
    let before = snapshot(&pool);
    let xd = Tensor::from_vec(&[2, h], randn(&mut rng, 2 * h)).unwrap();
    let msg = |e: GdnError| e.to_string();
    let cases: Vec<(&str, String)> = vec![
        (
            "slot out of range",
            msg(l.decode_slots(&xd, &[0, 3], &mut pool).unwrap_err()),
        ),
        (
            "negative slot",
            msg(l.decode_slots(&xd, &[-2, 0], &mut pool).unwrap_err()),
        ),
        (
            "duplicate slot",
            msg(l.decode_slots(&xd, &[2, 2], &mut pool).unwrap_err()),
        ),
        (
            "rows vs slots",
            msg(l.decode_slots(&xd, &[0, 1, 2], &mut pool).unwrap_err()),
        ),
        (
            "extend: slots vs sequences",
            msg(l.extend_slots(&x, &seqs, &[0], &mut pool).unwrap_err()),
        ),
        (
            "extend: duplicate",
            msg(l.extend_slots(&x, &seqs, &[1, 1], &mut pool).unwrap_err()),
        ),
        (
            "prefill: rows vs seqs",
            msg(l.prefill_slots(&xd, &seqs, &[0, 1], &mut pool).unwrap_err()),
        ),
    ];
    for (what, e) in &cases {
        assert_eq!(before, snapshot(&pool), "{what} ({e}) changed the pool");
    }
    assert!(cases[0].1.contains("slots[1] = 3"), "{}", cases[0].1);
    assert!(cases[2].1.contains("twice"), "{}", cases[2].1);
    // A pool of another layer's shape.
    let other = GatedDeltaNet::new(&tiny(Variant::Gdn2, 1, 3, false), 1).unwrap();
    let mut wrong = other.cache_pool(3).unwrap();
    let e = l.decode_slots(&xd, &[0, 1], &mut wrong).unwrap_err();
    assert!(e.to_string().contains("does not match"), "{e}");
    assert!(wrong
        .state_host()
        .unwrap()
        .data()
        .iter()
        .all(|v| v.to_bits() == 0));
}

/// A pool written to safetensors and read back is bitwise the same, and decodes the same.
#[test]
fn a_pool_round_trips_through_safetensors() {
    let cfg = tiny(Variant::Gdn, 2, 4, false);
    let l = layer(&cfg, 61);
    let h = cfg.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(62);
    let mut pool = l.cache_pool(2).unwrap();
    let x = Tensor::from_vec(&[9, h], randn(&mut rng, 9 * h)).unwrap();
    l.prefill_slots(
        &x,
        &Seqs::packed(&[0, 4, 9], 9).unwrap(),
        &[1, 0],
        &mut pool,
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("gdn-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pool.safetensors");
    pool.save(&path).unwrap();
    let mut back = l.load_cache_pool(&path).unwrap();
    assert_eq!(snapshot(&pool), snapshot(&back));
    let xd = Tensor::from_vec(&[2, h], randn(&mut rng, 2 * h)).unwrap();
    let y1 = l.decode_slots(&xd, &[0, 1], &mut pool).unwrap();
    let y2 = l.decode_slots(&xd, &[0, 1], &mut back).unwrap();
    assert_eq!(bits(y1.data()), bits(y2.data()));
    assert_eq!(snapshot(&pool), snapshot(&back));
    // A file of another shape is an error.
    let other = GatedDeltaNet::new(&tiny(Variant::Gdn, 1, 4, false), 1).unwrap();
    let e = other.load_cache_pool(&path).unwrap_err();
    assert!(e.to_string().contains("state"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Prefill runs the training forward's kernels: y bitwise equal to `forward_with_state`'s, the
/// slots' states bitwise its final states, the conv rows the prompts' last in_proj rows (zero
/// before a short prompt's start, checked by decoding on: the f64 test above).
#[test]
fn prefill_is_the_training_forward_bitwise() {
    for variant in [Variant::Gdn, Variant::Gdn2] {
        let cfg = tiny(variant, 2, 4, false);
        let l = layer(&cfg, 71);
        let h = cfg.hidden_size;
        let mut rng = ChaCha8Rng::seed_from_u64(72);
        let cu = [0u64, 2, 2, 69, 80];
        let x = Tensor::from_vec(&[80, h], randn(&mut rng, 80 * h)).unwrap();
        let seqs = Seqs::packed(&cu, 80).unwrap();
        let (yf, fin, _) = l.forward_with_state(&x, &seqs, None).unwrap();
        let mut pool = l.cache_pool(4).unwrap();
        let y = l
            .prefill_slots(&x, &seqs, &[2, 3, 0, 1], &mut pool)
            .unwrap();
        assert_eq!(bits(y.data()), bits(yf.data()), "{variant:?}: y");
        let st = pool.state_host().unwrap();
        let sl = fin.data().len() / 4;
        for (i, s) in [2usize, 3, 0, 1].into_iter().enumerate() {
            assert_eq!(
                bits(&st.data()[s * sl..(s + 1) * sl]),
                bits(&fin.data()[i * sl..(i + 1) * sl]),
                "{variant:?}: sequence {i}'s state"
            );
        }
    }
}

/// bf16 cache states are a GPU option: asking for them on the CPU is an error that names it;
/// fp32 states through `cache_pool_with` are `cache_pool`'s.
#[test]
fn bf16_states_on_the_cpu_are_an_error() {
    let cfg = tiny(Variant::Gdn, 1, 2, false);
    let l = layer(&cfg, 71);
    let e = l.cache_pool_with(2, DType::Bf16).unwrap_err();
    assert!(matches!(e, GdnError::Invalid(_)), "{e:?}");
    assert!(e.to_string().contains("bf16"), "{e}");
    let p = l.cache_pool_with(2, DType::F32).unwrap();
    assert_eq!(p.state_dtype(), DType::F32);
    assert_eq!(p.bytes(), l.cache_pool(2).unwrap().bytes());
    assert_eq!(p.graph_batch(), None);
}

/// The decode chain (`set_pdl`) is a GPU path: on the CPU the setter is recorded, no work
/// buffers are made, and decoding gives the same bits as without it.
#[test]
fn the_pdl_chain_is_a_gpu_option_and_leaves_cpu_decoding_as_it_was() {
    let cfg = tiny(Variant::Gdn, 2, 4, false);
    let l = layer(&cfg, 51);
    let h = cfg.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(52);
    let (mut a, mut b) = (l.cache_pool(3).unwrap(), l.cache_pool(3).unwrap());
    a.set_pdl(false);
    b.set_pdl(true);
    assert!(b.pdl() && !a.pdl());
    for step in 0..3 {
        let x = Tensor::from_vec(&[2, h], randn(&mut rng, 2 * h)).unwrap();
        let ya = l.decode_slots(&x, &[2, 0], &mut a).unwrap();
        let yb = l.decode_slots(&x, &[2, 0], &mut b).unwrap();
        let bits = |t: &Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ya), bits(&yb), "step {step} y");
        assert_eq!(snapshot(&a), snapshot(&b), "step {step} slots");
    }
    assert_eq!(b.decode_work_bytes(), 0);
    b.set_pdl(false);
    assert!(!b.pdl());
}
