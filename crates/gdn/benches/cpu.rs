//! CPU benchmarks: one GDN layer forward + backward, inference (a decode step), and the gated
//! delta rule alone.
//!
//! `cargo bench -p gdn --bench cpu` (set `RAYON_NUM_THREADS` to pin the thread count).
//! Shapes: the anchor (hidden 1024, 8 key / 16 value heads, Dk = Dv = 128, B = 1,
//! T = 4096), as `bench/cpu_anchor.py` measures PyTorch.

use criterion::{criterion_group, criterion_main, Criterion};
use gdn::ops::gated_delta_rule::{self as gdr, RuleOpts, RuleShape};
use gdn::{GatedDeltaNet, GdnConfig, Normalization, Seqs, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn randv(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

fn bench_layer(c: &mut Criterion) {
    let t: usize = std::env::var("GDN_BENCH_T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let cfg = GdnConfig {
        hidden_size: 1024,
        linear_num_key_heads: 8,
        linear_num_value_heads: 16,
        normalization: Normalization::RMSNorm,
        ..GdnConfig::default()
    };
    let layer = GatedDeltaNet::new(&cfg, 0).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let x = Tensor::from_vec(&[1, t, 1024], randv(&mut rng, t * 1024, -1.0, 1.0)).unwrap();
    let dy = Tensor::from_vec(&[1, t, 1024], randv(&mut rng, t * 1024, -1.0, 1.0)).unwrap();
    let mut g = c.benchmark_group("cpu");
    g.sample_size(10);
    g.bench_function(format!("layer_fwd_bwd_h1024_hk8_hv16_d128_T{t}"), |b| {
        b.iter(|| {
            let (y, saved) = layer.forward(&x).unwrap();
            let (dx, _) = layer.backward(saved, &dy).unwrap();
            (y, dx)
        })
    });
    g.bench_function(format!("layer_fwd_h1024_hk8_hv16_d128_T{t}"), |b| {
        b.iter(|| layer.forward_inference(&x).unwrap())
    });

    // The same tokens packed as 64 sequences of T/64 (cu_seqlens), against one sequence above.
    let seqs64 = Seqs::uniform(64, t / 64);
    g.bench_function(format!("layer_fwd_bwd_packed_64_seqs_T{t}"), |b| {
        b.iter(|| {
            let (y, saved) = layer.forward_packed(&x, &seqs64).unwrap();
            let (dx, _) = layer.backward(saved, &dy).unwrap();
            (y, dx)
        })
    });
    // Inference: one decode step of 64 sequences (each prefilled with 64 tokens), against the
    // inference forward over the same 64 x 64 tokens at once.
    let prompts = Tensor::from_vec(&[64, 64, 1024], x.data()[..64 * 64 * 1024].to_vec()).unwrap();
    let (_, cache) = layer.prefill(&prompts, &Seqs::uniform(64, 64)).unwrap();
    let step = Tensor::from_vec(&[64, 1024], randv(&mut rng, 64 * 1024, -1.0, 1.0)).unwrap();
    let mut c0 = cache.clone();
    g.bench_function("decode_step_64_seqs", |b| {
        b.iter(|| layer.decode(&step, &mut c0).unwrap())
    });
    g.bench_function("layer_fwd_64_seqs_of_64", |b| {
        b.iter(|| layer.forward_inference(&prompts).unwrap())
    });
    // GDN2 at the same shape.
    let cfg2 = GdnConfig {
        variant: gdn::Variant::Gdn2,
        ..cfg.clone()
    };
    let layer2 = GatedDeltaNet::new(&cfg2, 0).unwrap();
    g.bench_function(
        format!("gdn2_layer_fwd_bwd_h1024_hk8_hv16_d128_T{t}"),
        |b| {
            b.iter(|| {
                let (y, saved) = layer2.forward(&x).unwrap();
                let (dx, _) = layer2.backward(saved, &dy).unwrap();
                (y, dx)
            })
        },
    );
    let s = RuleShape {
        hk: 8,
        hv: 16,
        dk: 128,
        dv: 128,
    };
    let seqs = Seqs::uniform(1, t);
    let mut q = randv(&mut rng, t * 8 * 128, -1.0, 1.0);
    let mut k = randv(&mut rng, t * 8 * 128, -1.0, 1.0);
    for x in [&mut q, &mut k] {
        for r in x.chunks_mut(128) {
            let n = 1.0 / r.iter().map(|a| a * a).sum::<f32>().sqrt();
            r.iter_mut().for_each(|a| *a *= n);
        }
    }
    let v = randv(&mut rng, t * 16 * 128, -1.0, 1.0);
    let gg = randv(&mut rng, t * 16, -0.5, 0.0);
    let beta = randv(&mut rng, t * 16, 0.0, 1.0);
    let d_o = randv(&mut rng, t * 16 * 128, -1.0, 1.0);
    let opts = RuleOpts {
        scale: 128f32.powf(-0.5),
        l2norm_in_kernel: false,
    };
    g.bench_function(format!("rule_fwd_bwd_hk8_hv16_d128_T{t}"), |b| {
        b.iter(|| {
            let o = gdr::cpu::forward(&q, &k, &v, &gg, &beta, &seqs, s, opts, None, false).unwrap();
            let gr = gdr::cpu::backward(&q, &k, &v, &gg, &beta, &seqs, s, opts, None, &d_o, None)
                .unwrap();
            (o, gr)
        })
    });
    g.finish();
}

criterion_group!(benches, bench_layer);
criterion_main!(benches);
