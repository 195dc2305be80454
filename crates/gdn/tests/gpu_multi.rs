//! Several ranks on GPUs: the context-parallel layer (`CpLayer`) with in-process ranks sharing one
//! GPU (runs on the one-GPU machine), and, on a machine with two GPUs, over NCCL (one process per
//! GPU, started by `gdn launch`; see `scripts/multi-gpu.sh`). Run on the device machine with
//! `--include-ignored`; the two-GPU tests skip with a message when fewer GPUs are present.

use std::sync::Arc;

use gdn::device::cuda::{self, DBuf, DType};
use gdn::dist::{cp as perm, run_ranks, Communicator};
use gdn::layer::CpLayer;
use gdn::testutil::max_rel_err_f32 as rel;
use gdn::{Device, GatedDeltaNet, GdnConfig, Normalization, Seqs, Tensor, Variant};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn cfg(variant: Variant) -> GdnConfig {
    GdnConfig {
        variant,
        hidden_size: 256,
        linear_num_key_heads: 2,
        linear_num_value_heads: 4,
        linear_key_head_dim: 64,
        linear_value_head_dim: 64,
        normalization: Normalization::RMSNorm,
        conv_bias: true,
        ..GdnConfig::default()
    }
}

fn randv(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn rows_of(x: &[f32], h: usize, rows: &[std::ops::Range<usize>]) -> Vec<f32> {
    rows.iter()
        .flat_map(|r| x[r.start * h..r.end * h].iter().copied())
        .collect()
}

/// Rank-local rows back into natural order.
fn place(out: &mut [f32], h: usize, rows: &[std::ops::Range<usize>], local: &[f32]) {
    let mut k = 0;
    for r in rows {
        for t in r.clone() {
            out[t * h..(t + 1) * h].copy_from_slice(&local[k * h..(k + 1) * h]);
            k += 1;
        }
    }
}

struct Out {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
}

/// A rank's natural-order rows, its y and dx rows, and the gradients.
type RankOut = (Vec<std::ops::Range<usize>>, Vec<f32>, Vec<f32>, gdn::Grads);

/// One rank's CP forward + backward through the device API; returns natural-order rows of y and
/// dx (this rank's filled in) and the gradients.
fn cp_rank(
    l: &GatedDeltaNet,
    comm: Arc<dyn Communicator>,
    x: &[f32],
    dy: &[f32],
    seqs: &Seqs,
    dtype: DType,
) -> gdn::Result<RankOut> {
    let cp = comm.size();
    let h = l.config().hidden_size;
    let rows = perm::local_rows(seqs, cp, comm.rank());
    let cl = CpLayer::new(l.clone(), comm)?;
    let gpu = cuda::gpu(0)?;
    let xl = DBuf::upload(&gpu, &rows_of(x, h, &rows), dtype)?;
    let dyl = DBuf::upload(&gpu, &rows_of(dy, h, &rows), dtype)?;
    let (y, s) = cl.forward_dev(xl, seqs)?;
    let y = y.download()?;
    let (dx, g) = cl.backward_dev(s, dyl)?;
    Ok((rows, y, dx.download()?, g.to_host()?))
}

fn cp_in_process(
    l: &GatedDeltaNet,
    x: &[f32],
    dy: &[f32],
    seqs: &Seqs,
    cp: usize,
    dtype: DType,
) -> Out {
    let h = l.config().hidden_size;
    let outs = run_ranks(cp, |comm| cp_rank(l, comm, x, dy, seqs, dtype)).unwrap();
    let n = seqs.tokens();
    let (mut y, mut dx) = (vec![f32::NAN; n * h], vec![f32::NAN; n * h]);
    for (rows, yl, dxl, g) in &outs {
        place(&mut y, h, rows, yl);
        place(&mut dx, h, rows, dxl);
        for ((n0, a), (_, b)) in outs[0].3.iter().zip(g.iter()) {
            assert_eq!(a.data(), b.data(), "{n0}: ranks disagree");
        }
    }
    let grads = outs[0]
        .3
        .iter()
        .map(|(n, t)| (n.to_string(), t.data().to_vec()))
        .collect();
    Out { y, dx, grads }
}

fn one_rank(l: &GatedDeltaNet, x: &[f32], dy: &[f32], seqs: &Seqs) -> Out {
    let h = l.config().hidden_size;
    let n = seqs.tokens();
    let (y, s) = l
        .forward_packed(&Tensor::from_vec(&[n, h], x.to_vec()).unwrap(), seqs)
        .unwrap();
    let (dx, g) = l
        .backward(s, &Tensor::from_vec(&[n, h], dy.to_vec()).unwrap())
        .unwrap();
    Out {
        y: y.into_vec(),
        dx: dx.into_vec(),
        grads: g
            .iter()
            .map(|(n, t)| (n.to_string(), t.data().to_vec()))
            .collect(),
    }
}

fn compare(got: &Out, want: &Out, tol: f64, what: &str) {
    let ey = rel(&got.y, &want.y);
    let edx = rel(&got.dx, &want.dx);
    eprintln!("{what}: y {ey:.2e} dx {edx:.2e}");
    assert!(
        ey <= tol && edx <= tol,
        "{what}: y {ey:e} dx {edx:e} > {tol:e}"
    );
    assert_eq!(got.grads.len(), want.grads.len());
    for ((n, g), (n2, w)) in got.grads.iter().zip(&want.grads) {
        assert_eq!(n, n2);
        let e = rel(g, w);
        assert!(e <= tol, "{what}: {n} {e:e} > {tol:e}");
    }
}

fn layer(variant: Variant, dtype: DType) -> GatedDeltaNet {
    GatedDeltaNet::new(&cfg(variant), 4)
        .unwrap()
        .to_device(Device::Cuda(0), dtype)
        .unwrap()
}

/// CP = 2 with two in-process ranks sharing cuda:0 equals the one-rank GPU layer: f32 within
/// 1e-4 of max |.| (the GEMMs over half the rows may take other cuBLASLt algorithms; the row-
/// summed gradients add two partial sums), bf16 within 3e-2 (a bf16 rounding of an intermediate
/// that differs by one ulp moves the rest); and two CP runs are bitwise equal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cp2_in_process_on_one_gpu_equals_one_rank() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for variant in [Variant::Gdn, Variant::Gdn2] {
        for seqs in [
            Seqs::uniform(2, 128),
            Seqs::packed(&[0, 64, 192, 256], 256).unwrap(),
        ] {
            let h = 256;
            let x = randv(&mut rng, seqs.tokens() * h);
            let dy = randv(&mut rng, seqs.tokens() * h);
            for (dtype, tol) in [(DType::F32, 1e-4), (DType::Bf16, 3e-2)] {
                let l = layer(variant, dtype);
                let want = one_rank(&l, &x, &dy, &seqs);
                let got = cp_in_process(&l, &x, &dy, &seqs, 2, dtype);
                let what = format!("{variant:?} {dtype:?} {seqs:?}");
                compare(&got, &want, tol, &what);
                let again = cp_in_process(&l, &x, &dy, &seqs, 2, dtype);
                assert_eq!(got.y, again.y, "{what}: rerun y");
                assert_eq!(got.dx, again.dx, "{what}: rerun dx");
                assert_eq!(got.grads, again.grads, "{what}: rerun grads");
            }
        }
    }
}

/// The CP layer on a GPU (f32) against the CP layer on the CPU: the same rank arithmetic on two
/// devices, within the GPU-vs-CPU layer tolerance (1e-4 of max |.|).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cp2_gpu_matches_cp2_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let seqs = Seqs::packed(&[0, 64, 192], 192).unwrap();
    let h = 256;
    let x = randv(&mut rng, seqs.tokens() * h);
    let dy = randv(&mut rng, seqs.tokens() * h);
    let cpu = GatedDeltaNet::new(&cfg(Variant::Gdn), 4).unwrap();
    let outs = run_ranks(2, |comm| {
        let rows = perm::local_rows(&seqs, 2, comm.rank());
        let cl = CpLayer::new(cpu.clone(), comm)?;
        let nl = seqs.tokens() / 2;
        let (y, s) = cl.forward(&Tensor::from_vec(&[nl, h], rows_of(&x, h, &rows))?, &seqs)?;
        let (dx, g) = cl.backward(s, &Tensor::from_vec(&[nl, h], rows_of(&dy, h, &rows))?)?;
        Ok((rows, y.into_vec(), dx.into_vec(), g))
    })
    .unwrap();
    let n = seqs.tokens();
    let (mut y, mut dx) = (vec![0.0; n * h], vec![0.0; n * h]);
    for (rows, yl, dxl, _) in &outs {
        place(&mut y, h, rows, yl);
        place(&mut dx, h, rows, dxl);
    }
    let want = Out {
        y,
        dx,
        grads: outs[0]
            .3
            .iter()
            .map(|(n, t)| (n.to_string(), t.data().to_vec()))
            .collect(),
    };
    let got = cp_in_process(
        &layer(Variant::Gdn, DType::F32),
        &x,
        &dy,
        &seqs,
        2,
        DType::F32,
    );
    compare(&got, &want, 1e-4, "GPU CP 2 vs CPU CP 2");
}

// ---- Two GPUs over NCCL: the test starts itself once per rank (the launcher's environment,
// as `gdn launch` or torchrun set it) and the ranks compare with a one-rank run they compute
// themselves.

/// Number of CUDA devices, with a message when fewer than `n`.
fn have_gpus(n: usize, test: &str) -> bool {
    let c = cuda::device_count();
    if c < n {
        eprintln!("{test}: skipped, needs {n} CUDA GPUs, found {c}");
        return false;
    }
    true
}

/// In the parent: run this test binary's `test` as `n` ranks (RANK, WORLD_SIZE, LOCAL_RANK,
/// MASTER_ADDR, MASTER_PORT, NCCL_NVLS_ENABLE=0) and require every rank to pass.
fn launch_self(test: &str, n: usize) {
    let exe = std::env::current_exe().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..n)
        .map(|r| {
            std::process::Command::new(&exe)
                .args([test, "--exact", "--include-ignored", "--nocapture"])
                .env("GDN_TEST_RANK_CHILD", "1")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("NCCL_NVLS_ENABLE", "0")
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, mut c) in children.into_iter().enumerate() {
        let s = c.wait().unwrap();
        assert!(s.success(), "{test}: rank {r} failed ({s})");
    }
}

fn nccl_comm() -> Arc<dyn Communicator> {
    let env = gdn::dist::DistEnv::from_env().unwrap().expect("launched");
    Arc::new(gdn::dist::Nccl::from_env(&env).unwrap())
}

/// CP = 2 over NCCL (one process per GPU, bf16 and f32) equals the one-rank layer each rank
/// computes on its own GPU (same tolerances as the in-process test); the NCCL collectives are
/// also checked against their definition (all-to-all with uneven splits, rank-order sums).
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn nccl_cp2_equals_one_rank() {
    const NAME: &str = "nccl_cp2_equals_one_rank";
    if std::env::var_os("GDN_TEST_RANK_CHILD").is_none() {
        if have_gpus(2, NAME) {
            launch_self(NAME, 2);
        }
        return;
    }
    let comm = nccl_comm();
    let (rank, size) = (comm.rank(), comm.size());
    let dev = Device::Cuda(rank);
    // Collectives: rank r sends (r + 1) * (d + 1) values to rank d.
    let gpu = cuda::gpu(rank).unwrap();
    let counts: Vec<usize> = (0..size).map(|d| (rank + 1) * (d + 1)).collect();
    let send: Vec<f32> = counts
        .iter()
        .enumerate()
        .flat_map(|(d, &n)| (0..n).map(move |k| (100 * rank + 10 * d + k) as f32))
        .collect();
    let recv_counts: Vec<usize> = (0..size).map(|s| (s + 1) * (rank + 1)).collect();
    let got = comm
        .all_to_all(
            &gdn::backend::Act::Dev(DBuf::upload(&gpu, &send, DType::F32).unwrap()),
            &counts,
            &recv_counts,
        )
        .unwrap()
        .into_host()
        .unwrap();
    let want: Vec<f32> = recv_counts
        .iter()
        .enumerate()
        .flat_map(|(s, &n)| (0..n).map(move |k| (100 * s + 10 * rank + k) as f32))
        .collect();
    assert_eq!(got, want, "all_to_all");
    let mut v = gdn::backend::Act::Dev(
        DBuf::upload(&gpu, &[[1e8f32, 1.0][rank], 1.0], DType::F32).unwrap(),
    );
    comm.all_reduce_sum(&mut v).unwrap();
    assert_eq!(
        v.into_host().unwrap(),
        vec![1e8 + 1.0, 2.0],
        "all_reduce_sum"
    );

    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let seqs = Seqs::packed(&[0, 64, 192, 256], 256).unwrap();
    let h = 256;
    let x = randv(&mut rng, seqs.tokens() * h);
    let dy = randv(&mut rng, seqs.tokens() * h);
    for variant in [Variant::Gdn, Variant::Gdn2] {
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::Bf16, 3e-2)] {
            let l = GatedDeltaNet::new(&cfg(variant), 4)
                .unwrap()
                .to_device(dev, dtype)
                .unwrap();
            let want = one_rank(&l, &x, &dy, &seqs);
            let rows = perm::local_rows(&seqs, size, rank);
            let cl = CpLayer::new(l.clone(), comm.clone()).unwrap();
            let xl = DBuf::upload(&gpu, &rows_of(&x, h, &rows), dtype).unwrap();
            let dyl = DBuf::upload(&gpu, &rows_of(&dy, h, &rows), dtype).unwrap();
            let (y, s) = cl.forward_dev(xl, &seqs).unwrap();
            let y = y.download().unwrap();
            let (dx, g) = cl.backward_dev(s, dyl).unwrap();
            let what = format!("rank {rank} {variant:?} {dtype:?}");
            let e = rel(&y, &rows_of(&want.y, h, &rows));
            assert!(e <= tol, "{what}: y {e:e}");
            let e = rel(&dx.download().unwrap(), &rows_of(&want.dx, h, &rows));
            assert!(e <= tol, "{what}: dx {e:e}");
            for ((n, t), (n2, w)) in g.to_host().unwrap().iter().zip(&want.grads) {
                assert_eq!(n, n2);
                let e = rel(t.data(), w);
                assert!(e <= tol, "{what}: {n} {e:e}");
            }
        }
    }
}

/// Two data-parallel ranks over NCCL (one GPU each) train 3 steps to the same parameters, bit for
/// bit, as one rank with two micro-batches on its GPU.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn nccl_two_data_ranks_equal_one() {
    use gdn::train::{Parallel, RunConfig, Trainer};
    const NAME: &str = "nccl_two_data_ranks_equal_one";
    if std::env::var_os("GDN_TEST_RANK_CHILD").is_none() {
        if have_gpus(2, NAME) {
            launch_self(NAME, 2);
        }
        return;
    }
    let comm = nccl_comm();
    let rank = comm.rank();
    let cfg = RunConfig::from_toml_str(
        r#"
        [model]
        hidden_size = 64
        num_layers = 2
        ffn_hidden_size = 128
        linear_num_key_heads = 1
        linear_num_value_heads = 2
        linear_key_head_dim = 32
        linear_value_head_dim = 32
        [data]
        seq_length = 64
        batch_size = 8
        [train]
        train_iters = 3
        "#,
    )
    .unwrap();
    let params = |par: Parallel| {
        let mut t = Trainer::new(&cfg).unwrap();
        t.to_device(Device::Cuda(rank), DType::Bf16).unwrap();
        t.set_parallel(par).unwrap();
        for _ in 0..3 {
            t.step().unwrap();
        }
        t.checkpoint().unwrap().params
    };
    let two = params(Parallel {
        comm: Some(comm.clone()),
        micro_batches: 1,
        ..Default::default()
    });
    let one = params(Parallel {
        comm: None,
        micro_batches: 2,
        ..Default::default()
    });
    for ((n, a), (_, b)) in two.iter().zip(one.iter()) {
        assert_eq!(a.data(), b.data(), "rank {rank}: {n}");
    }
}

// ---- Training with in-process ranks sharing one GPU (runs on the one-GPU machine).

fn train_cfg(seq: usize) -> gdn::train::RunConfig {
    gdn::train::RunConfig::from_toml_str(&format!(
        r#"
        [model]
        hidden_size = 128
        num_layers = 2
        ffn_hidden_size = 256
        linear_num_key_heads = 2
        linear_num_value_heads = 4
        linear_key_head_dim = 32
        linear_value_head_dim = 32
        [data]
        seq_length = {seq}
        batch_size = 8
        [train]
        train_iters = 3
        "#
    ))
    .unwrap()
}

/// Parameters (bits) and per-step (loss bits, grad-norm bits) after 3 steps on cuda:0.
type TrainOut = (Vec<(String, Vec<u32>)>, Vec<(u64, u64)>);

fn train_on_gpu(
    cfg: &gdn::train::RunConfig,
    dtype: DType,
    par: gdn::train::Parallel,
) -> gdn::Result<TrainOut> {
    train_on(cfg, Device::Cuda(0), dtype, par)
}

fn train_on(
    cfg: &gdn::train::RunConfig,
    dev: Device,
    dtype: DType,
    par: gdn::train::Parallel,
) -> gdn::Result<TrainOut> {
    let mut t = gdn::train::Trainer::new(cfg)?;
    t.set_parallel(par)?;
    t.to_device(dev, dtype)?;
    let mut st = Vec::new();
    for _ in 0..3 {
        let s = t.step()?;
        st.push((s.loss.loss_sum.to_bits(), s.grad_norm.to_bits()));
    }
    let p = t
        .checkpoint()?
        .params
        .iter()
        .map(|(n, x)| {
            (
                n.to_string(),
                x.data().iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect();
    Ok((p, st))
}

/// Data parallelism on one GPU: 2 x 2 and 4 x 1 in-process ranks (sharing cuda:0 through the
/// in-process communicator) train 3 bf16 steps to the same parameters, losses and gradient norms,
/// bit for bit, as 1 rank with 4 micro-batches (the step's gradient is the in-order sum over the
/// 4 micro-batches however they are spread); every rank holds the same parameters.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dp_in_process_on_one_gpu_equals_one_rank_bitwise() {
    use gdn::train::Parallel;
    let cfg = train_cfg(64);
    let want = train_on_gpu(
        &cfg,
        DType::Bf16,
        Parallel {
            micro_batches: 4,
            ..Default::default()
        },
    )
    .unwrap();
    for (dp, m) in [(2, 2), (4, 1)] {
        let got = gdn::dist::run_grid(dp, 1, |g| {
            train_on_gpu(
                &cfg,
                DType::Bf16,
                Parallel {
                    comm: Some(g.dp.clone()),
                    micro_batches: m,
                    ..Default::default()
                },
            )
        })
        .unwrap();
        for (r, g) in got.iter().enumerate() {
            assert_eq!(g.1, want.1, "{dp} x {m}, rank {r}: losses / grad norms");
            for ((n, a), (_, b)) in g.0.iter().zip(&want.0) {
                assert!(a == b, "{dp} x {m}, rank {r}: {n} differs from 1 x 4");
            }
        }
    }
}

/// Context parallelism inside the model on one GPU: CP = 2 (in-process ranks sharing cuda:0)
/// against CP = 1 for 3 steps: f32 losses and gradient norms within 1e-4 relative, bf16 within
/// 3e-2 (the layer tests' tolerances: GEMMs over half the rows, rank-order sums); a second CP
/// run is bitwise equal to the first; CP 2 x DP 2 runs and its ranks agree bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cp_model_in_process_on_one_gpu_close_to_cp1() {
    use gdn::train::Parallel;
    let cfg = train_cfg(128);
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::Bf16, 3e-2)] {
        let want = train_on_gpu(&cfg, dtype, Parallel::default()).unwrap();
        let cp = |dp: usize| {
            gdn::dist::run_grid(dp, 2, |g| {
                train_on_gpu(
                    &cfg,
                    dtype,
                    Parallel {
                        comm: (dp > 1).then(|| g.dp.clone()),
                        cp: Some(g.cp.clone()),
                        ..Default::default()
                    },
                )
            })
            .unwrap()
        };
        let got = cp(1);
        assert_eq!(got[0], got[1], "{dtype:?}: CP ranks disagree");
        for ((a, b), (c, d)) in got[0].1.iter().zip(&want.1) {
            let (l, l0) = (f64::from_bits(*a), f64::from_bits(*c));
            let (g, g0) = (f64::from_bits(*b), f64::from_bits(*d));
            let (el, eg) = ((l - l0).abs() / l0.abs(), (g - g0).abs() / g0.abs());
            eprintln!("{dtype:?} cp 2 vs 1: loss {el:.2e} grad norm {eg:.2e}");
            assert!(
                el <= tol && eg <= tol,
                "{dtype:?}: loss {el:e} grad norm {eg:e}"
            );
        }
        let again = cp(1);
        assert_eq!(again[0], got[0], "{dtype:?}: CP rerun differs");
        let grid = cp(2);
        for r in &grid {
            assert_eq!(r, &grid[0], "{dtype:?}: CP 2 x DP 2 ranks disagree");
        }
    }
}

/// Two GPUs, `Nccl::grid` as `gdn train --dp 2` under `gdn launch` builds it: 2 data ranks x 2
/// micro-batches train 3 bf16 steps to the parameters, losses and gradient norms of 1 rank x 4
/// micro-batches on the same GPU, bit for bit.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn nccl_grid_dp2_equals_one_rank_bitwise() {
    use gdn::train::Parallel;
    const NAME: &str = "nccl_grid_dp2_equals_one_rank_bitwise";
    if std::env::var_os("GDN_TEST_RANK_CHILD").is_none() {
        if have_gpus(2, NAME) {
            launch_self(NAME, 2);
        }
        return;
    }
    let env = gdn::dist::DistEnv::from_env().unwrap().expect("launched");
    let g = gdn::dist::Nccl::grid(&env, 2, 1).unwrap();
    assert_eq!((g.rank(), g.world(), g.cp.size()), (env.rank, 2, 1));
    let dev = Device::Cuda(env.local_rank);
    let cfg = train_cfg(64);
    let got = train_on(
        &cfg,
        dev,
        DType::Bf16,
        Parallel {
            comm: Some(g.dp.clone()),
            micro_batches: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let want = train_on(
        &cfg,
        dev,
        DType::Bf16,
        Parallel {
            micro_batches: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(got.1, want.1, "rank {}: losses / grad norms", env.rank);
    for ((n, a), (_, b)) in got.0.iter().zip(&want.0) {
        assert!(a == b, "rank {}: {n} differs", env.rank);
    }
}

/// Two GPUs, `Nccl::grid` with CP = 2 (as `gdn train --cp 2` under `gdn launch`): 3 f32 steps of
/// the model with its layers head-parallel over NCCL give the losses and gradient norms of CP = 2
/// with in-process ranks on one GPU (the same per-rank arithmetic; NCCL moves values exactly):
/// within 1e-6 relative (printed; expected bitwise), and both ranks the same parameters.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn nccl_grid_cp2_train_matches_in_process() {
    use gdn::train::Parallel;
    const NAME: &str = "nccl_grid_cp2_train_matches_in_process";
    if std::env::var_os("GDN_TEST_RANK_CHILD").is_none() {
        if have_gpus(2, NAME) {
            launch_self(NAME, 2);
        }
        return;
    }
    let env = gdn::dist::DistEnv::from_env().unwrap().expect("launched");
    let g = gdn::dist::Nccl::grid(&env, 1, 2).unwrap();
    let dev = Device::Cuda(env.local_rank);
    let cfg = train_cfg(128);
    let got = train_on(
        &cfg,
        dev,
        DType::F32,
        Parallel {
            cp: Some(g.cp.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let want = gdn::dist::run_grid(1, 2, |gi| {
        train_on(
            &cfg,
            dev,
            DType::F32,
            Parallel {
                cp: Some(gi.cp.clone()),
                ..Default::default()
            },
        )
    })
    .unwrap();
    for ((a, b), (c, d)) in got.1.iter().zip(&want[env.rank].1) {
        let (el, eg) = (
            (f64::from_bits(*a) - f64::from_bits(*c)).abs() / f64::from_bits(*c).abs(),
            (f64::from_bits(*b) - f64::from_bits(*d)).abs() / f64::from_bits(*d).abs(),
        );
        eprintln!(
            "rank {}: NCCL vs in-process CP 2: loss {el:.2e} grad norm {eg:.2e} (bitwise: {})",
            env.rank,
            a == c && b == d
        );
        assert!(el <= 1e-6 && eg <= 1e-6, "rank {}: {el:e} {eg:e}", env.rank);
    }
    // Both ranks hold the same parameters: compare their bits through a gather.
    let mine: Vec<f32> = got
        .0
        .iter()
        .flat_map(|(_, v)| v.iter().map(|&b| f32::from_bits(b)))
        .collect();
    let all = g.cp.all_gather(&gdn::backend::Act::Host(mine)).unwrap();
    let mut all = all.into_iter().map(|x| x.into_host().unwrap());
    let (a, b) = (all.next().unwrap(), all.next().unwrap());
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "ranks disagree"
    );
}

/// The rule's saved chunk inverses (`forward_saving` on cuda:0) given to a backward whose
/// inputs are on cuda:1: an error naming both devices (the kernels would read another GPU's
/// memory), not a launch.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn rule_saved_on_another_gpu_is_an_error() {
    use gdn::backend::{Act, F32s};
    use gdn::ops::gated_delta_rule::{self as rule, RuleOpts, RuleShape};
    if !have_gpus(2, "rule_saved_on_another_gpu_is_an_error") {
        return;
    }
    let s = RuleShape {
        hk: 1,
        hv: 2,
        dk: 64,
        dv: 64,
    };
    let seqs = Seqs::uniform(1, 128);
    let n = seqs.tokens();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (q, k) = (randv(&mut rng, n * s.dk), randv(&mut rng, n * s.dk));
    let (v, d_o) = (
        randv(&mut rng, n * s.hv * s.dv),
        randv(&mut rng, n * s.hv * s.dv),
    );
    let g: Vec<f32> = (0..n * s.hv).map(|_| -rng.gen_range(0.0f32..0.2)).collect();
    let beta: Vec<f32> = (0..n * s.hv).map(|_| rng.gen_range(0.1f32..0.9)).collect();
    let opts = RuleOpts {
        scale: 0.125,
        l2norm_in_kernel: true,
    };
    let on = |i: usize| {
        let gpu = cuda::gpu(i).unwrap();
        let a = |x: &[f32]| Act::Dev(DBuf::upload(&gpu, x, DType::Bf16).unwrap());
        (
            a(&q),
            a(&k),
            a(&v),
            F32s::Dev(gpu.upload(&g).unwrap()),
            a(&beta),
            a(&d_o),
        )
    };
    let (q0, k0, v0, g0, b0, _) = on(0);
    let (_, _, saved) =
        rule::forward_saving(&q0, &k0, &v0, &g0, &b0, &seqs, s, opts, None, false).unwrap();
    assert!(
        saved.bytes() > 0,
        "the bf16 Dk 64 forward keeps its chunk inverses"
    );
    let (q1, k1, v1, g1, b1, o1) = on(1);
    let e = rule::backward_saved(
        &q1, &k1, &v1, &g1, &b1, &seqs, s, opts, None, &o1, None, &saved,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("saved chunk inverses are on cuda:0, the inputs on cuda:1"),
        "{e}"
    );
}
