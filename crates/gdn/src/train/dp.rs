//! Data and context parallelism of a training step.
//!
//! Data parallelism: the step's global batch (the same on every rank: a function of the data
//! seed and the step) is cut into `S = dp x micro_batches` equal micro-batches of whole
//! sequences; data rank `r` runs micro-batches `r m .. (r + 1) m`. The step's gradient is
//! `((g_0 + g_1) + g_2) + ... + g_{S-1}` over the micro-batches in order, on every rank: each
//! rank's micro-batch gradients are gathered ([`Communicator::all_gather`]) and every rank adds
//! all `S` of them in that order. Every micro-batch's loss is the mean over the whole batch's
//! target rows (its backward divides by the global count), so the sum is the batch's gradient;
//! clipping and AdamW then run on equal gradients and keep the parameters equal on every rank.
//!
//! Bitwise: the sum depends on `S` only, not on how the micro-batches are spread over ranks, so
//! `dp x m` ranks x micro-batches equal `1 x S` (and `S x 1`) bit for bit, and a run resumed on
//! another number of ranks with the same `S` continues bit for bit. Another `S` differs by the
//! order of those f32 additions (and from the unsplit step, `S = 1`, by the GEMMs' row sums).
//!
//! Context parallelism ([`Parallel::cp`]): the `cp` ranks of a CP group run the same
//! micro-batches, each its zigzag share of every sequence ([`Model::set_cp`]); the model returns
//! whole gradients, equal on the group's ranks, before the data-parallel sum above.

use std::sync::Arc;

use super::*;
use crate::backend::{Act, F32s};
use crate::dist::comm::{act_to_f32s, alloc_like, copy_range, f32s_to_act};
use crate::dist::Communicator;
use crate::model::loss::gather_stats;
use crate::model::{Batch, IGNORE_INDEX};
use crate::ops::add;

/// How a step is spread over ranks and micro-batches.
#[derive(Clone, Debug)]
pub struct Parallel {
    /// The data-parallel group (`None`: one data rank).
    pub comm: Option<Arc<dyn Communicator>>,
    /// Micro-batches per data rank and step (>= 1).
    pub micro_batches: usize,
    /// The context-parallel group (`None`: no context parallelism).
    pub cp: Option<Arc<dyn Communicator>>,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            comm: None,
            micro_batches: 1,
            cp: None,
        }
    }
}

impl Parallel {
    /// Data-parallel ranks.
    pub fn dp(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.size())
    }
    /// Context-parallel ranks.
    pub fn cp_size(&self) -> usize {
        self.cp.as_ref().map_or(1, |c| c.size())
    }
    /// This data rank.
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }
    /// Micro-batches per step over all data ranks (`S`).
    pub fn shards(&self) -> usize {
        self.dp() * self.micro_batches
    }
    /// Whether the step is split over micro-batches at all.
    pub fn is_split(&self) -> bool {
        self.shards() > 1
    }
    /// The data rule: the global batch divisible by `dp x micro_batches`.
    pub fn check(&self, global_batch: usize) -> Result<()> {
        if self.micro_batches == 0 {
            return Err(GdnError::Invalid("micro_batches must be at least 1".into()));
        }
        let parts = self.shards();
        if !global_batch.is_multiple_of(parts) {
            return Err(GdnError::config(
                "data.batch_size",
                format!(
                    "the global batch of {global_batch} sequences must be divisible by data-parallel ranks x micro-batches = {} x {} = {parts}",
                    self.dp(),
                    self.micro_batches
                ),
            ));
        }
        Ok(())
    }
    /// Every rule of this layout for `cfg`: the data rule, and under context parallelism
    /// Megatron's (key and value heads divisible by the CP size) and the zigzag's (the sequence
    /// length divisible by `2 cp`).
    pub fn check_config(&self, cfg: &RunConfig) -> Result<()> {
        self.check(cfg.data.batch_size)?;
        let cp = self.cp_size();
        if cp > 1 {
            let seq = cfg.data.seq_length;
            if !seq.is_multiple_of(2 * cp) {
                return Err(GdnError::config(
                    "data.seq_length",
                    format!(
                        "{seq} is not divisible by 2 x cp = {}: context parallelism cuts every sequence into 2 x cp chunks (zigzag load balancing)",
                        2 * cp
                    ),
                ));
            }
            let mc = cfg.model_config(1);
            crate::dist::cp::check_heads(&mc.layer, cp)?;
        }
        Ok(())
    }
}

/// Micro-batch `k` of `parts` equal ones of whole sequences.
fn shard(b: &Batch, parts: usize, k: usize) -> Batch {
    let per = b.batch / parts;
    let (lo, hi) = (k * per * b.seq_len, (k + 1) * per * b.seq_len);
    Batch {
        tokens: b.tokens[lo..hi].to_vec(),
        targets: b.targets[lo..hi].to_vec(),
        batch: per,
        seq_len: b.seq_len,
    }
}

/// `((g_0 + g_1) + g_2) + ...` over every data rank's micro-batch gradients in order: `local`
/// holds this rank's (its micro-batches in order), the group's are gathered first.
fn fold_shards(comm: Option<&dyn Communicator>, local: Vec<Act>) -> Result<Act> {
    let m = local.len();
    let len = local.first().map_or(0, Act::len);
    let parts: Vec<Act> = match comm {
        Some(c) if c.size() > 1 => {
            let cat = if m == 1 {
                local.into_iter().next().expect("one")
            } else {
                let mut cat = alloc_like(&local[0], m * len)?;
                for (k, a) in local.iter().enumerate() {
                    copy_range(&mut cat, k * len, a, 0, len)?;
                }
                cat
            };
            let mut v = Vec::with_capacity(c.size() * m);
            for g in c.all_gather(&cat)? {
                if m == 1 {
                    v.push(g);
                    continue;
                }
                for k in 0..m {
                    let mut p = alloc_like(&g, len)?;
                    copy_range(&mut p, 0, &g, k * len, len)?;
                    v.push(p);
                }
            }
            v
        }
        _ => local,
    };
    let mut it = parts.into_iter();
    let mut acc = it
        .next()
        .ok_or_else(|| GdnError::Invalid("no micro-batch gradients".into()))?;
    for p in it {
        add::add_assign(&mut acc, &p)?;
    }
    Ok(acc)
}

impl Trainer {
    /// Spread every later step over `par`'s data-parallel ranks, micro-batches and
    /// context-parallel ranks (each rank calls this with its own communicators). Errors unless
    /// the layout's rules hold ([`Parallel::check_config`]). The parameters must be equal on
    /// every rank (same seed, or the same checkpoint).
    pub fn set_parallel(&mut self, par: Parallel) -> Result<()> {
        par.check_config(&self.cfg)?;
        self.model.set_cp(par.cp.clone())?;
        self.par = par;
        Ok(())
    }

    /// The layout of the steps.
    pub fn parallel(&self) -> &Parallel {
        &self.par
    }

    /// The step's forward and backward over this rank's micro-batches; the gradients summed
    /// over all micro-batches in order. CPU: returned; GPU: in the model's gradient buffers.
    /// Returns the whole batch's loss statistics, this rank's largest activation bytes (all,
    /// GDN) and the gradients (CPU).
    pub(super) fn split_forward_backward(
        &mut self,
        batch: &Batch,
    ) -> Result<(LossStats, usize, usize, Option<crate::model::ModelGrads>)> {
        let (rank, m) = (self.par.rank(), self.par.micro_batches);
        let parts = self.par.shards();
        self.par.check(batch.batch)?;
        let count = batch.targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let mut stats = Vec::with_capacity(m);
        let (mut act_bytes, mut gdn_bytes) = (0, 0);
        let on_gpu = self.dev_moments.is_some();
        // Per parameter, this rank's micro-batch gradients in order.
        let mut per_param: Vec<Vec<Act>> = Vec::new();
        let mut names: Vec<(String, Vec<usize>)> = Vec::new();
        for k in 0..m {
            let sb = shard(batch, parts, rank * m + k);
            let (st, mut saved) = self.model.forward(&sb)?;
            act_bytes = act_bytes.max(saved.bytes());
            gdn_bytes = gdn_bytes.max(saved.gdn_bytes());
            stats.push(st);
            // Each micro-batch's loss is its part of the whole batch's mean.
            saved.count = count;
            let grads: Vec<Act> = if !on_gpu {
                let g = self.model.backward(saved)?;
                if names.is_empty() {
                    names = g
                        .iter()
                        .map(|(n, t)| (n.to_string(), t.shape().to_vec()))
                        .collect();
                }
                g.iter()
                    .map(|(_, t)| Act::Host(t.data().to_vec()))
                    .collect()
            } else {
                self.model.backward_into_grads(saved)?;
                let dg = self
                    .model
                    .device_grads()
                    .ok_or_else(|| GdnError::Invalid("no device gradients".into()))?;
                let mut v = Vec::with_capacity(dg.len());
                for g in dg {
                    // A copy: the next micro-batch's backward replaces the model's buffers.
                    let mut c = g.gpu().uninit::<f32>(g.len())?;
                    g.gpu()
                        .stream()
                        .memcpy_dtod(&g.slice, &mut c.slice)
                        .map_err(|e| GdnError::Device(format!("cuMemcpyDtoDAsync: {e:?}")))?;
                    v.push(f32s_to_act(F32s::Dev(c)));
                }
                v
            };
            if per_param.is_empty() {
                per_param = grads.into_iter().map(|g| vec![g]).collect();
            } else {
                for (p, g) in per_param.iter_mut().zip(grads) {
                    p.push(g);
                }
            }
        }
        let comm = self.par.comm.clone();
        let dp_comm = comm.as_deref();
        let mut host = Vec::new();
        for (j, local) in per_param.into_iter().enumerate() {
            let sum = fold_shards(dp_comm, local)?;
            if on_gpu {
                let dst = self
                    .model
                    .device_grads_mut()
                    .ok_or_else(|| GdnError::Invalid("no device gradients".into()))?;
                match act_to_f32s(sum)? {
                    F32s::Dev(g) => dst[j] = g,
                    F32s::Host(_) => return Err(crate::backend::mixed("gradients")),
                }
            } else {
                let (n, shape) = &names[j];
                host.push((n.clone(), Tensor::from_vec(shape, sum.into_host()?)?));
            }
        }
        let all_stats = match &comm {
            Some(c) if c.size() > 1 => gather_stats(c.as_ref(), &stats)?,
            _ => stats,
        };
        let mut loss = LossStats::default();
        for s in &all_stats {
            loss.add(s);
        }
        let host = (!on_gpu).then(|| Params::from_entries(host));
        Ok((loss, act_bytes, gdn_bytes, host))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::{run_grid, run_ranks};
    use crate::testutil::bits;
    use crate::testutil::max_rel_err_f32 as rel;

    /// The trainer tests' small run (`train::tests::small`), 4 steps long.
    fn small() -> RunConfig {
        let mut c = crate::train::tests::small();
        c.train.train_iters = 4;
        c
    }

    type Run = (Vec<(String, Vec<u32>)>, Vec<(u64, u32, usize, usize)>);

    fn run(t: &mut Trainer, steps: usize) -> Result<Run> {
        let mut stats = Vec::new();
        for _ in 0..steps {
            let s = t.step()?;
            stats.push((
                s.loss.loss_sum.to_bits(),
                (s.grad_norm as f32).to_bits(),
                s.loss.count,
                s.loss.correct,
            ));
        }
        let p = t
            .model()
            .params()
            .iter()
            .map(|(n, x)| (n.to_string(), bits(x.data())))
            .collect();
        Ok((p, stats))
    }

    #[test]
    fn the_step_depends_on_the_micro_batch_count_only_bitwise() {
        // S = 2: 2 ranks x 1 = 1 rank x 2; S = 4: 1 x 4 = 2 x 2 = 4 x 1 (4 steps each).
        let cfg = small();
        for (s, layouts) in [(2, vec![(2, 1)]), (4, vec![(2, 2), (4, 1)])] {
            let mut one = Trainer::new(&cfg).unwrap();
            one.set_parallel(Parallel {
                micro_batches: s,
                ..Default::default()
            })
            .unwrap();
            let want = run(&mut one, 4).unwrap();
            for (dp, m) in layouts {
                let got = run_grid(dp, 1, |g| {
                    let mut t = Trainer::new(&cfg)?;
                    t.set_parallel(Parallel {
                        comm: Some(g.dp.clone()),
                        micro_batches: m,
                        ..Default::default()
                    })?;
                    run(&mut t, 4)
                })
                .unwrap();
                for g in &got {
                    assert_eq!(g, &got[0], "ranks disagree");
                }
                assert_eq!(
                    got[0], want,
                    "{dp} ranks x {m} vs 1 rank x {s} micro-batches"
                );
            }
        }
    }

    fn cp_cfg(seq: usize) -> RunConfig {
        cp_cfg_heads(seq, 4, 8)
    }

    fn cp_cfg_heads(seq: usize, hk: usize, hv: usize) -> RunConfig {
        RunConfig::from_toml_str(&format!(
            r#"
            [model]
            hidden_size = 16
            num_layers = 2
            ffn_hidden_size = 32
            linear_num_key_heads = {hk}
            linear_num_value_heads = {hv}
            linear_key_head_dim = 8
            linear_value_head_dim = 8
            [data]
            seq_length = {seq}
            batch_size = 4
            num_kv_pairs = 4
            key_vocab_size = 16
            value_vocab_size = 16
            eval_sequences = 8
            [optimizer]
            lr_warmup_iters = 2
            [train]
            train_iters = 3
            "#
        ))
        .unwrap()
    }

    /// CP = 2 and 4 inside the model (2 blocks) against CP = 1 on one batch: the same target
    /// counts and correct predictions, the loss within 1e-6 (f64 sums of per-rank f32 row losses),
    /// every gradient within 1e-5 of max |.| (the GEMMs over 1 / cp of the rows and the rank-order
    /// sums of the row-partial gradients round differently: `CpLayer`'s tolerance), the ranks'
    /// gradients bitwise equal, and CP x DP (2 x 2) through the trainer within the same bounds
    /// of DP 2 for 3 steps' losses.
    #[test]
    fn context_parallel_model_equals_one_rank() {
        let cfg = cp_cfg(16);
        let t = Trainer::new(&cfg).unwrap();
        let batch = t.data.train_batch(1);
        let (st, saved) = t.model.forward(&batch).unwrap();
        let want = t.model.backward(saved).unwrap();
        for cp in [2, 4] {
            let got = run_grid(1, cp, |g| {
                let mut t = Trainer::new(&cfg)?;
                t.set_parallel(Parallel {
                    cp: Some(g.cp.clone()),
                    ..Default::default()
                })?;
                let (st, saved) = t.model.forward(&batch)?;
                Ok((st, t.model.backward(saved)?))
            })
            .unwrap();
            for (st2, g) in &got {
                assert_eq!((st2.count, st2.correct), (st.count, st.correct), "cp {cp}");
                let e = (st2.loss_sum - st.loss_sum).abs() / st.loss_sum.abs();
                assert!(e <= 1e-6, "cp {cp}: loss rel err {e:e}");
                assert_eq!(g.names(), want.names());
                for ((n, a), (_, b)) in g.iter().zip(got[0].1.iter()) {
                    assert_eq!(
                        bits(a.data()),
                        bits(b.data()),
                        "cp {cp}: {n} differs across ranks"
                    );
                }
            }
            for ((n, a), (_, b)) in got[0].1.iter().zip(want.iter()) {
                let e = rel(a.data(), b.data());
                assert!(e <= 1e-5, "cp {cp}: {n} rel err {e:e}");
            }
        }
        // CP x DP: 2 x 2 ranks against 2 data ranks, 3 steps.
        let losses = |dp: usize, cp: usize| {
            run_grid(dp, cp, |g| {
                let mut t = Trainer::new(&cfg)?;
                t.set_parallel(Parallel {
                    comm: Some(g.dp.clone()),
                    cp: Some(g.cp.clone()),
                    ..Default::default()
                })?;
                (0..3)
                    .map(|_| t.step().map(|s| s.loss))
                    .collect::<Result<Vec<_>>>()
            })
            .unwrap()
        };
        let (a, b) = (losses(2, 2), losses(2, 1));
        for r in &a {
            assert_eq!(r, &a[0], "every rank has the whole batch's statistics");
        }
        for (x, y) in a[0].iter().zip(&b[0]) {
            assert_eq!((x.count, x.correct), (y.count, y.correct));
            let e = (x.loss_sum - y.loss_sum).abs() / y.loss_sum.abs();
            assert!(e <= 1e-5, "cp 2 x dp 2 vs dp 2: loss rel err {e:e}");
        }
    }

    /// Issue 18's layouts in process (no 4- or 8-GPU machine is lent): CP = 8 inside the model
    /// (8 key heads, one per rank) against CP = 1 on one batch, and CP x DP = 4 x 2 (8 ranks)
    /// through the trainer against DP = 2 for 3 steps, within
    /// `context_parallel_model_equals_one_rank`'s bounds.
    #[test]
    fn context_parallel_8_and_grid_4_by_2_equal_fewer_ranks() {
        let cfg = cp_cfg_heads(16, 8, 8);
        let t = Trainer::new(&cfg).unwrap();
        let batch = t.data.train_batch(1);
        let (st, saved) = t.model.forward(&batch).unwrap();
        let want = t.model.backward(saved).unwrap();
        let got = run_grid(1, 8, |g| {
            let mut t = Trainer::new(&cfg)?;
            t.set_parallel(Parallel {
                cp: Some(g.cp.clone()),
                ..Default::default()
            })?;
            let (st, saved) = t.model.forward(&batch)?;
            Ok((st, t.model.backward(saved)?))
        })
        .unwrap();
        for (st2, g) in &got {
            assert_eq!((st2.count, st2.correct), (st.count, st.correct));
            let e = (st2.loss_sum - st.loss_sum).abs() / st.loss_sum.abs();
            assert!(e <= 1e-6, "cp 8: loss rel err {e:e}");
            for ((n, a), (_, b)) in g.iter().zip(got[0].1.iter()) {
                assert_eq!(
                    bits(a.data()),
                    bits(b.data()),
                    "cp 8: {n} differs across ranks"
                );
            }
        }
        for ((n, a), (_, b)) in got[0].1.iter().zip(want.iter()) {
            let e = rel(a.data(), b.data());
            assert!(e <= 1e-5, "cp 8: {n} rel err {e:e}");
        }
        let losses = |dp: usize, cp: usize| {
            run_grid(dp, cp, |g| {
                let mut t = Trainer::new(&cfg)?;
                t.set_parallel(Parallel {
                    comm: Some(g.dp.clone()),
                    cp: Some(g.cp.clone()),
                    ..Default::default()
                })?;
                (0..3)
                    .map(|_| t.step().map(|s| s.loss))
                    .collect::<Result<Vec<_>>>()
            })
            .unwrap()
        };
        let (a, b) = (losses(2, 4), losses(2, 1));
        for r in &a {
            assert_eq!(r, &a[0], "every rank has the whole batch's statistics");
        }
        for (x, y) in a[0].iter().zip(&b[0]) {
            assert_eq!((x.count, x.correct), (y.count, y.correct));
            let e = (x.loss_sum - y.loss_sum).abs() / y.loss_sum.abs();
            assert!(e <= 1e-5, "cp 4 x dp 2 vs dp 2: loss rel err {e:e}");
        }
    }

    #[test]
    fn context_parallel_rules_are_errors() {
        let group = |n: usize| -> Arc<dyn Communicator> {
            Arc::new(crate::dist::InProc::group(n).unwrap().remove(0))
        };
        let set = |cfg: &RunConfig, cp: usize| {
            let mut t = Trainer::new(cfg).unwrap();
            t.set_parallel(Parallel {
                cp: Some(group(cp)),
                ..Default::default()
            })
            .unwrap_err()
            .to_string()
        };
        // 16 tokens over 2 x 3 chunks.
        let e = set(&cp_cfg(16), 3);
        assert!(
            e.contains("data.seq_length") && e.contains("16 is not divisible by 2 x cp = 6"),
            "{e}"
        );
        // 4 key heads over 8 ranks (16 tokens = 2 x 8 chunks of 1).
        let e = set(&cp_cfg(16), 8);
        assert!(
            e.contains("linear_num_key_heads=4 must be a multiple of"),
            "{e}"
        );
        // The model refuses too.
        let mut m = Trainer::new(&cp_cfg(16)).unwrap().model;
        assert!(m.set_cp(Some(group(8))).is_err());
        m.set_cp(Some(group(2))).unwrap();
        assert_eq!(m.cp_size(), 2);
    }

    #[test]
    fn split_gradients_equal_the_whole_batch_gradient() {
        let cfg = small();
        let mut t = Trainer::new(&cfg).unwrap();
        let batch = t.data.train_batch(1);
        let (st, saved) = t.model.forward(&batch).unwrap();
        let whole = t.model.backward(saved).unwrap();
        for m in [2, 4, 8] {
            t.set_parallel(Parallel {
                comm: None,
                micro_batches: m,
                ..Default::default()
            })
            .unwrap();
            let (st2, _, _, g) = t.split_forward_backward(&batch).unwrap();
            assert_eq!((st2.count, st2.correct), (st.count, st.correct));
            assert!((st2.loss_sum - st.loss_sum).abs() <= 1e-9 * st.loss_sum.abs());
            let g = g.unwrap();
            for ((n, a), (_, b)) in g.iter().zip(whole.iter()) {
                let m_ = b
                    .data()
                    .iter()
                    .fold(0.0f32, |m, x| m.max(x.abs()))
                    .max(1e-30);
                let e = a
                    .data()
                    .iter()
                    .zip(b.data())
                    .fold(0.0f32, |e, (x, y)| e.max((x - y).abs()))
                    / m_;
                // f32 reassociation of the row sums (measured below 1e-6).
                assert!(e <= 1e-5, "{m} micro-batches: {n} rel err {e:e}");
            }
        }
    }

    #[test]
    fn batch_not_divisible_is_an_error() {
        let cfg = small();
        let mut t = Trainer::new(&cfg).unwrap();
        let e = t
            .set_parallel(Parallel {
                comm: None,
                micro_batches: 3,
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("global batch of 8 sequences must be divisible by data-parallel ranks x micro-batches = 1 x 3 = 3"),
            "{e}"
        );
        let e = run_ranks(3, |comm| {
            let mut t = Trainer::new(&cfg)?;
            t.set_parallel(Parallel {
                comm: Some(comm),
                micro_batches: 1,
                ..Default::default()
            })
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("= 3 x 1 = 3"), "{e}");
        assert!(t
            .set_parallel(Parallel {
                comm: None,
                micro_batches: 0,
                ..Default::default()
            })
            .is_err());
    }
}
