//! Times inference on a CUDA GPU (issue 14), CUDA events, median of 20 after 3 warm-up runs:
//!
//! 1. the decode step of the rule alone (`ops::decode::cuda::rule_with`: the tile kernel with 4
//!    and 8 value columns per thread, the pipelined kernel, and the default pick; one token per
//!    slot, state `[B, Hv, 128, 128]` read and written once, bf16 o), Hk/Hv = 16/32, at B = 1,
//!    8, 64, 256 (and 16/16 at B = 64), fp32 states, then bf16 states: time, the state bytes
//!    moved (read + write), GB/s and the share of 4.2 TB/s;
//! 2. the whole layer's decode step (`decode_slots_dev`: norm + in_proj GEMM, the fused pre step,
//!    the rule, gated norm, out_proj GEMM) at B = 1, 8, 64, 256, hidden 2048 (Qwen3-Next's
//!    layer), bf16, as a CUDA graph and op by op, fp32 states (and bf16 states at B 64 and 256),
//!    against its byte floor (state read + written, both projection weights read once), with the
//!    split by kernel of the op-by-op step at B 1 and 64;
//! 3. the decode projections alone (in_proj 12352 x 2048, out_proj 2048 x 4096, M = 1 .. 128
//!    tokens): cuBLASLt against the skinny GEMM (`ops/linear/skinny.cu`), and the layer step with
//!    it (`GDN_DECODE_GEMV`'s path, `CachePool::set_gemv`): `graph+gemv` (the GEMMs only,
//!    `GDN_DECODE_GEMV=gemm`) and `graph+gemv+fold` / `op+gemv+fold` (the input norm folded
//!    into in_proj's GEMM too, `GDN_DECODE_GEMV=1`) rows;
//! 4. prefill of 8 x 4096 tokens (`extend_slots_dev`, fresh) against the layer's device-resident
//!    training forward (`forward_dev`) on the same input.
//!
//! Prints one JSON line per row too (prefix `json:`), for scripts. `cargo run --release --example
//! bench_decode` on a machine with a CUDA GPU; `bench_decode rule` runs part 1 only;
//! `bench_decode step B` the layer's decode step at batch B only (op by op with its split, then
//! as a graph; then both with the skinny GEMM), for `ncu`; `bench_decode gemm` part 3's GEMM
//! rows only.

#[path = "common/bench.rs"]
mod bench;
use bench::*;

use std::sync::Arc;

use gdn::backend::cuda::{self, DBuf, DType, Gpu};
use gdn::backend::launch::{profile_start, profile_take};
use gdn::backend::F32s;
use gdn::ops::decode::cuda::RuleKernel;
use gdn::ops::decode::{self, DecodeShape, PreOut};
use gdn::{Device, GatedDeltaNet, GdnConfig, Seqs};

/// The H200's copy bandwidth the issue measures against (bytes/s).
const PEAK_BPS: f64 = 4.2e12;
const REPS: usize = 20;

/// Deterministic values in [lo, hi) (splitmix64).
fn unif(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^= x >> 31;
            lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn rule_row(gpu: &Arc<Gpu>, b: usize, hk: usize, hv: usize, kernel: Option<RuleKernel>, sd: DType) {
    let (dk, dv) = (128, 128);
    let s = DecodeShape {
        hk,
        hv,
        dk,
        dv,
        width: 4,
        gdn2: false,
        l2norm: true,
    };
    let up = |v: Vec<f32>| F32s::Dev(gpu.upload(&v).unwrap());
    let x = PreOut {
        q: up(unif(b * hk * dk, 1, -1.0, 1.0)),
        k: up(unif(b * hk * dk, 2, -1.0, 1.0)),
        v: up(unif(b * hv * dv, 3, -1.0, 1.0)),
        g: up(unif(b * hv, 4, -0.2, -0.01)),
        b: up(unif(b * hv, 5, 0.1, 0.9)),
        w: None,
    };
    let mut state = DBuf::upload(gpu, &unif(b * s.state_len(), 6, -0.1, 0.1), sd).unwrap();
    let slots: Vec<i32> = (0..b as i32).collect();
    let dslots = gpu.upload(&slots).unwrap();
    let mut o = DBuf::uninit(gpu, b * hv * dv, DType::Bf16).unwrap();
    let scale = 1.0 / (dk as f32).sqrt();
    let k = kernel.unwrap_or_else(|| decode::cuda::default_kernel(&s, sd));
    let ms = time_ms(gpu, 3, REPS, || {
        decode::cuda::rule_with(&x, &mut state, &dslots, b, s, scale, &mut o, k).unwrap();
    });
    let esz = if sd == DType::Bf16 { 2 } else { 4 };
    let bytes = 2.0 * (b * s.state_len() * esz) as f64;
    let bps = bytes / (ms * 1e-3);
    let kname = match (kernel, k) {
        (None, RuleKernel::Tile { cols }) => format!("default (tile {cols})"),
        (None, RuleKernel::Pipe { .. }) => "default (pipe)".to_string(),
        (_, RuleKernel::Tile { cols }) => format!("tile {cols}"),
        (_, RuleKernel::Pipe { .. }) => "pipe".to_string(),
    };
    println!(
        "rule decode  B {b:>3} {hk:>2}/{hv:<2} heads  {sd:?} state  {kname:<18} {:>9.4} ms  state {:>8.1} MB r+w  {:>7.1} GB/s  {:>5.1}% of 4.2 TB/s",
        ms,
        bytes / 1e6,
        bps / 1e9,
        100.0 * bps / PEAK_BPS
    );
    println!(
        "json: {{\"what\":\"rule_decode\",\"kernel\":\"{kname}\",\"state\":\"{sd:?}\",\"B\":{b},\"hk\":{hk},\"hv\":{hv},\"ms\":{ms:.5},\"bytes\":{bytes},\"gbps\":{:.1}}}",
        bps / 1e9
    );
}

fn qwen3_next() -> GdnConfig {
    GdnConfig {
        hidden_size: 2048,
        linear_num_key_heads: 16,
        linear_num_value_heads: 32,
        linear_key_head_dim: 128,
        linear_value_head_dim: 128,
        ..GdnConfig::default()
    }
}

/// One decode projection GEMM `[m, k] x [n, k]^T` (bf16): cuBLASLt against the skinny GEMM
/// (`GDN_DECODE_GEMV`'s kernel, where it takes the shape), the weights' bytes read once against
/// 4.2 TB/s.
fn gemm_row(gpu: &Arc<Gpu>, what: &str, m: usize, n: usize, k: usize) {
    use gdn::ops::linear::cuda as lin;
    let x = DBuf::upload(gpu, &unif(m * k, 11, -1.0, 1.0), DType::Bf16).unwrap();
    let w = gpu.upload(&unif(n * k, 12, -0.05, 0.05)).unwrap();
    let wb = lin::cast_bf16(&w).unwrap();
    let mut y = DBuf::uninit(gpu, m * n, DType::Bf16).unwrap();
    let blas = time_ms(gpu, 3, REPS, || {
        lin::forward(&x, m, k, &w, Some(&wb), n, &mut y).unwrap();
    });
    let bytes = (2 * n * k) as f64;
    let plan = lin::skinny_plan(m, n, k, gpu.sm_count().unwrap());
    let sk = plan.map(|p| {
        time_ms(gpu, 3, REPS, || {
            lin::forward_skinny(&x, m, k, &wb, n, &mut y, p, None).unwrap();
        })
    });
    let pct = |ms: f64| 100.0 * bytes / (ms * 1e-3) / PEAK_BPS;
    match (sk, plan) {
        (Some(t), Some(p)) => println!(
            "gemm {what:<8} M {m:>3} N {n:>5} K {k:>4}: cuBLASLt {blas:.4} ms ({:.0}% of 4.2 TB/s on the weights), skinny {t:.4} ms ({:.0}%): {:.2}x; plan {p:?}",
            pct(blas),
            pct(t),
            blas / t
        ),
        _ => println!(
            "gemm {what:<8} M {m:>3} N {n:>5} K {k:>4}: cuBLASLt {blas:.4} ms ({:.0}% of 4.2 TB/s on the weights), skinny: no plan (falls back to cuBLASLt)",
            pct(blas)
        ),
    }
    println!(
        "json: {{\"what\":\"decode_gemm\",\"proj\":\"{what}\",\"M\":{m},\"N\":{n},\"K\":{k},\"blas_ms\":{blas:.5},\"skinny_ms\":{}}}",
        sk.map_or("null".to_string(), |t| format!("{t:.5}"))
    );
}

/// in_proj with its input norm (RMSNorm): the norm kernel then cuBLASLt, the norm kernel then the
/// skinny GEMM, and the skinny GEMM with the norm folded in (one kernel).
fn norm_gemm_row(gpu: &Arc<Gpu>, m: usize, n: usize, k: usize) {
    use gdn::backend::{Act, P};
    use gdn::ops::linear::cuda as lin;
    let x = DBuf::upload(gpu, &unif(m * k, 13, -1.0, 1.0), DType::Bf16).unwrap();
    let w = gpu.upload(&unif(n * k, 14, -0.05, 0.05)).unwrap();
    let g = gpu.upload(&unif(k, 15, -0.5, 0.5)).unwrap();
    let wb = lin::cast_bf16(&w).unwrap();
    let (wf, c1, _) = lin::fold_norm(&w, &g, true, None, n, k).unwrap();
    let xa = Act::Dev(x.try_clone().unwrap());
    let mut y = DBuf::uninit(gpu, m * n, DType::Bf16).unwrap();
    let norm = || {
        let (xn, _) = gdn::ops::norm::forward(
            &xa,
            m,
            k,
            P::Dev(&g),
            None,
            gdn::Normalization::RMSNorm,
            1e-6,
            true,
        )
        .unwrap();
        match xn {
            Act::Dev(d) => d,
            Act::Host(_) => unreachable!(),
        }
    };
    let blas = time_ms(gpu, 3, REPS, || {
        let xn = norm();
        lin::forward(&xn, m, k, &w, Some(&wb), n, &mut y).unwrap();
    });
    let sms = gpu.sm_count().unwrap();
    let (p, pf) = (
        lin::skinny_plan(m, n, k, sms),
        lin::skinny_plan_with(m, n, k, sms, true).filter(|q| q.takes_norm()),
    );
    let sk = p.map(|p| {
        time_ms(gpu, 3, REPS, || {
            let xn = norm();
            lin::forward_skinny(&xn, m, k, &wb, n, &mut y, p, None).unwrap();
        })
    });
    let fold = pf.map(|p| {
        let nm = lin::SkinnyNorm {
            layer: false,
            eps: 1e-6,
            c1: &c1,
            c2: None,
        };
        time_ms(gpu, 3, REPS, || {
            lin::forward_skinny(&x, m, k, &wf, n, &mut y, p, Some(nm)).unwrap();
        })
    });
    let f = |t: Option<f64>| t.map_or("n/a".to_string(), |t| format!("{t:.4} ms"));
    println!(
        "norm+gemm in_proj M {m:>3} N {n:>5} K {k:>4}: norm + cuBLASLt {blas:.4} ms, norm + skinny {}, skinny with the norm folded in {}",
        f(sk),
        f(fold)
    );
    println!(
        "json: {{\"what\":\"decode_norm_gemm\",\"M\":{m},\"blas_ms\":{blas:.5},\"skinny_ms\":{},\"fold_ms\":{}}}",
        sk.map_or("null".to_string(), |t| format!("{t:.5}")),
        fold.map_or("null".to_string(), |t| format!("{t:.5}"))
    );
}

fn gemm_rows(gpu: &Arc<Gpu>) {
    let cfg = qwen3_next();
    let (h, pd, vd) = (cfg.hidden_size, cfg.in_proj_dim(), cfg.v_dim());
    for m in [1usize, 8, 16, 32, 64, 128] {
        gemm_row(gpu, "in_proj", m, pd, h);
        gemm_row(gpu, "out_proj", m, h, vd);
    }
    for m in [1usize, 8, 64] {
        norm_gemm_row(gpu, m, pd, h);
    }
}

/// One layer decode step at batch `b`: graph or op by op, fp32 or bf16 states, cuBLASLt or (with
/// `gemv`) the skinny GEMM for the projections (and, with `fold`, the input norm folded into
/// in_proj's).
fn layer_step(gpu: &Arc<Gpu>, l: &GatedDeltaNet, b: usize, graph: bool, sd: DType, split: bool) {
    layer_step_with(gpu, l, b, graph, sd, split, false)
}

fn layer_step_with(
    gpu: &Arc<Gpu>,
    l: &GatedDeltaNet,
    b: usize,
    graph: bool,
    sd: DType,
    split: bool,
    gemv: bool,
) {
    layer_step_full(gpu, l, b, graph, sd, split, gemv, gemv)
}

#[allow(clippy::too_many_arguments)]
fn layer_step_full(
    gpu: &Arc<Gpu>,
    l: &GatedDeltaNet,
    b: usize,
    graph: bool,
    sd: DType,
    split: bool,
    gemv: bool,
    fold: bool,
) {
    layer_step_chain(gpu, l, b, graph, sd, split, gemv, fold, false)
}

/// [`layer_step_full`], with `pdl` the opt-in chain (`CachePool::set_pdl`: preallocated work
/// buffers, programmatic dependent launches); its rows' mode ends in `+pdl`.
#[allow(clippy::too_many_arguments)]
fn layer_step_chain(
    gpu: &Arc<Gpu>,
    l: &GatedDeltaNet,
    b: usize,
    graph: bool,
    sd: DType,
    split: bool,
    gemv: bool,
    fold: bool,
    pdl: bool,
) {
    let cfg = l.config();
    let h = cfg.hidden_size;
    let mut pool = l.cache_pool_with(b, sd).unwrap();
    pool.set_graphs(graph);
    pool.set_gemv(gemv);
    pool.set_fold_norm(fold);
    pool.set_pdl(pdl);
    let slots: Vec<i32> = (0..b as i32).collect();
    let x = DBuf::upload(gpu, &unif(b * h, 7, -1.0, 1.0), DType::Bf16).unwrap();
    // Fill the states with a prefill of 16 tokens per slot first (realistic values).
    let xp = DBuf::upload(gpu, &unif(b * 16 * h, 8, -1.0, 1.0), DType::Bf16).unwrap();
    l.extend_slots_dev(xp, &Seqs::uniform(b, 16), &slots, &mut pool, true)
        .unwrap();
    let ms = time_ms(gpu, 3, REPS, || {
        let xi = x.try_clone().unwrap();
        l.decode_slots_dev(xi, &slots, &mut pool).unwrap();
    });
    let esz = if sd == DType::Bf16 { 2 } else { 4 };
    let state = 2.0 * (b * cfg.linear_num_value_heads * 128 * 128 * esz) as f64;
    let weights = 2.0 * (h * (cfg.in_proj_dim() + cfg.v_dim())) as f64;
    let floor_ms = (state + weights) / PEAK_BPS * 1e3;
    let mode = match (graph, gemv, fold) {
        (true, false, _) => "graph",
        (false, false, _) => "op by op",
        (true, true, true) => "graph+gemv+fold",
        (false, true, true) => "op+gemv+fold",
        (true, true, false) => "graph+gemv",
        (false, true, false) => "op+gemv",
    };
    let mode = if pdl {
        format!("{mode}+pdl")
    } else {
        mode.to_string()
    };
    let used = match (graph, pool.graph_batch(), pool.graph_error()) {
        (false, _, _) => String::new(),
        (true, Some(n), _) => format!(" (graph of batch {n})"),
        (true, None, e) => format!(" (NO GRAPH: {e:?})"),
    };
    println!(
        "layer decode B {b:>3} hidden {h} bf16, {sd:?} states, {mode:<15}: {ms:.4} ms; byte floor {floor_ms:.4} ms (state {:.0} MB r+w + weights {:.0} MB at 4.2 TB/s): {:.2}x the floor{used}",
        state / 1e6,
        weights / 1e6,
        ms / floor_ms
    );
    println!(
        "json: {{\"what\":\"layer_decode\",\"B\":{b},\"graph\":{graph},\"gemv\":{gemv},\"fold\":{fold},\"pdl\":{pdl},\"state\":\"{sd:?}\",\"ms\":{ms:.5},\"floor_ms\":{floor_ms:.5}}}"
    );
    if pdl && graph && pool.graph_is_pdl() != Some(true) {
        println!(
            "  (the chain's graph was NOT used: {:?})",
            pool.graph_error()
        );
    }
    if split {
        profile_start();
        let xi = x.try_clone().unwrap();
        l.decode_slots_dev(xi, &slots, &mut pool).unwrap();
        gpu.sync().unwrap();
        for (k, t, n) in profile_take() {
            println!("  kernel {k:<36} {t:9.4} ms ({n} launches)");
        }
    }
}

fn layer_rows(gpu: &Arc<Gpu>) {
    let cfg = qwen3_next();
    let l = GatedDeltaNet::new(&cfg, 1)
        .unwrap()
        .to_device(Device::Cuda(0), DType::Bf16)
        .unwrap();
    let h = cfg.hidden_size;
    for b in [1usize, 8, 64, 256] {
        layer_step(gpu, &l, b, true, DType::F32, false);
        layer_step(gpu, &l, b, false, DType::F32, b == 1 || b == 64);
        // The skinny GEMMs for the projections (GDN_DECODE_GEMV=gemm), then with the input norm
        // folded into in_proj's (GDN_DECODE_GEMV=1); B 256 falls back to cuBLASLt and the norm.
        layer_step_full(gpu, &l, b, true, DType::F32, false, true, false);
        layer_step_full(gpu, &l, b, true, DType::F32, false, true, true);
        layer_step_full(gpu, &l, b, false, DType::F32, b == 64, true, true);
    }
    for b in [64usize, 256] {
        layer_step(gpu, &l, b, true, DType::Bf16, false);
    }

    // Prefill 8 x 4096 against the training forward on the same input.
    let (b, t) = (8usize, 4096usize);
    let seqs = Seqs::uniform(b, t);
    let xv = unif(b * t * h, 9, -1.0, 1.0);
    let x = DBuf::upload(gpu, &xv, DType::Bf16).unwrap();
    let mut pool = l.cache_pool(b).unwrap();
    let slots: Vec<i32> = (0..b as i32).collect();
    let pre_ms = time_ms(gpu, 3, REPS, || {
        let xi = x.try_clone().unwrap();
        l.extend_slots_dev(xi, &seqs, &slots, &mut pool, true)
            .unwrap();
    });
    let fwd_ms = time_ms(gpu, 3, REPS, || {
        let xi = x.try_clone().unwrap();
        let (_y, saved) = l.forward_dev(xi, &seqs).unwrap();
        drop(saved);
    });
    println!(
        "prefill {b}x{t} whole layer bf16: {pre_ms:.3} ms; training forward (forward_dev) {fwd_ms:.3} ms: {:.2}x",
        pre_ms / fwd_ms
    );
    println!(
        "json: {{\"what\":\"prefill\",\"B\":{b},\"T\":{t},\"ms\":{pre_ms:.4},\"forward_dev_ms\":{fwd_ms:.4}}}"
    );
}

fn main() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    println!("{gpu:?}");
    // `bench_decode step B`: the layer's decode step at batch B alone, op by op with the
    // per-op split (for ncu / the profile marks).
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("step") {
        let b: usize = args.get(2).and_then(|b| b.parse().ok()).unwrap_or(64);
        let l = GatedDeltaNet::new(&qwen3_next(), 1)
            .unwrap()
            .to_device(Device::Cuda(0), DType::Bf16)
            .unwrap();
        layer_step(&gpu, &l, b, false, DType::F32, true);
        layer_step(&gpu, &l, b, true, DType::F32, false);
        layer_step_full(&gpu, &l, b, false, DType::F32, true, true, false);
        layer_step_full(&gpu, &l, b, true, DType::F32, false, true, false);
        layer_step_full(&gpu, &l, b, false, DType::F32, true, true, true);
        layer_step_full(&gpu, &l, b, true, DType::F32, false, true, true);
        return;
    }
    // `bench_decode pdl [B ..]`: the layer's decode step, default against the opt-in chain
    // (GDN_DECODE_PDL: kernels-only graph, programmatic dependent launches), as graphs, with
    // cuBLASLt and with the skinny GEMM + fold (the default up to 8 rows), at B 1, 8, 64, 256
    // unless given; then the chain op by op at B 64 with the per-kernel split.
    if args.get(1).map(String::as_str) == Some("pdl") {
        let bs: Vec<usize> = args[2..].iter().filter_map(|b| b.parse().ok()).collect();
        let bs = if bs.is_empty() {
            vec![1, 8, 64, 256]
        } else {
            bs
        };
        let l = GatedDeltaNet::new(&qwen3_next(), 1)
            .unwrap()
            .to_device(Device::Cuda(0), DType::Bf16)
            .unwrap();
        for &b in &bs {
            for pdl in [false, true] {
                layer_step_chain(&gpu, &l, b, true, DType::F32, false, false, false, pdl);
            }
            if b <= 64 {
                for pdl in [false, true] {
                    layer_step_chain(&gpu, &l, b, true, DType::F32, false, true, true, pdl);
                }
            }
        }
        layer_step_chain(&gpu, &l, 64, false, DType::F32, true, false, false, true);
        return;
    }
    // `bench_decode gemm`: the decode projections alone, cuBLASLt against the skinny GEMM.
    if args.get(1).map(String::as_str) == Some("gemm") {
        gemm_rows(&gpu);
        return;
    }
    let kernels = [
        Some(RuleKernel::Tile { cols: 4 }),
        Some(RuleKernel::Tile { cols: 8 }),
        Some(RuleKernel::Pipe { grid: None }),
        None,
    ];
    for k in kernels {
        for b in [1usize, 8, 64, 256] {
            rule_row(&gpu, b, 16, 32, k, DType::F32);
        }
        rule_row(&gpu, 64, 16, 16, k, DType::F32);
    }
    for b in [1usize, 8, 64, 256] {
        rule_row(&gpu, b, 16, 32, None, DType::Bf16);
    }
    if std::env::args().nth(1).as_deref() == Some("rule") {
        return;
    }
    gemm_rows(&gpu);
    layer_rows(&gpu);
}
