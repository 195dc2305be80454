//! Data parallelism: the step's global batch (the same on every rank: a function of the data seed
//! and the step) is cut into `dp x micro_batches` equal shards of whole sequences; rank `r` runs
//! shards `r m .. (r + 1) m` one after the other, adding their gradients in shard order, then the
//! ranks' sums are added in rank order ([`Communicator::all_reduce_sum`]: the same bits on every
//! rank). Every shard's loss is the mean over the whole batch's target rows (its backward divides
//! by the global count), so the sum is the batch's gradient; clipping and AdamW then run on equal
//! gradients and keep the parameters equal on every rank.
//!
//! Bitwise: `dp` ranks with one micro-batch each equal one rank with `micro_batches = dp` (both
//! compute `((g_0 + g_1) + g_2) + ...` over the same shards with the same kernels). Other splits
//! of the same batch differ by the order of those f32 additions (and from the unsplit step by the
//! GEMMs' row sums).

use std::sync::Arc;

use super::*;
use crate::backend::{Act, F32s};
use crate::dist::comm::all_reduce_sum_f32;
use crate::dist::Communicator;
use crate::model::{Batch, IGNORE_INDEX};
use crate::ops::add;

/// How a step is spread over ranks and micro-batches.
#[derive(Clone, Debug)]
pub struct Parallel {
    /// The data-parallel group (`None`: one rank).
    pub comm: Option<Arc<dyn Communicator>>,
    /// Micro-batches per rank and step (>= 1).
    pub micro_batches: usize,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            comm: None,
            micro_batches: 1,
        }
    }
}

impl Parallel {
    /// Data-parallel ranks.
    pub fn dp(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.size())
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }
    /// Whether the step is split at all.
    pub fn is_split(&self) -> bool {
        self.dp() * self.micro_batches > 1
    }
    /// The rule: the global batch divisible by `dp x micro_batches`.
    pub fn check(&self, global_batch: usize) -> Result<()> {
        if self.micro_batches == 0 {
            return Err(GdnError::Invalid("micro_batches must be at least 1".into()));
        }
        let parts = self.dp() * self.micro_batches;
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
}

/// Shard `k` of `parts` equal shards of whole sequences.
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

/// Loss statistics of every rank, in rank order (f64 and counts sent bit for bit).
fn gather_stats(comm: &dyn Communicator, st: &[LossStats]) -> Result<Vec<LossStats>> {
    let mut v = Vec::with_capacity(st.len() * 4);
    for s in st {
        let b = s.loss_sum.to_bits();
        v.push(f32::from_bits((b >> 32) as u32));
        v.push(f32::from_bits(b as u32));
        v.push(f32::from_bits(u32::try_from(s.count).unwrap_or(u32::MAX)));
        v.push(f32::from_bits(u32::try_from(s.correct).unwrap_or(u32::MAX)));
    }
    let parts = comm.all_gather(&Act::Host(v))?;
    let mut out = Vec::new();
    for p in parts {
        let p = p.into_host()?;
        for c in p.chunks(4) {
            let hi = c[0].to_bits() as u64;
            let lo = c[1].to_bits() as u64;
            out.push(LossStats {
                loss_sum: f64::from_bits((hi << 32) | lo),
                count: c[2].to_bits() as usize,
                correct: c[3].to_bits() as usize,
            });
        }
    }
    Ok(out)
}

impl Trainer {
    /// Spread every later step over `par`'s data-parallel ranks and micro-batches (each rank of
    /// the group calls this with its own communicator). Errors unless the global batch
    /// (`data.batch_size`) is divisible by ranks x micro-batches. The parameters must be equal
    /// on every rank (same seed, or the same checkpoint).
    pub fn set_parallel(&mut self, par: Parallel) -> Result<()> {
        par.check(self.cfg.data.batch_size)?;
        self.par = par;
        Ok(())
    }

    /// The step's forward and backward over this rank's shards; the gradients summed over
    /// shards and ranks. CPU: returned; GPU: in the model's gradient buffers. Returns the whole
    /// batch's loss statistics, this rank's largest activation bytes (all, GDN) and the
    /// gradients (CPU).
    pub(super) fn split_forward_backward(
        &mut self,
        batch: &Batch,
    ) -> Result<(LossStats, usize, usize, Option<crate::model::ModelGrads>)> {
        let (dp, rank, m) = (self.par.dp(), self.par.rank(), self.par.micro_batches);
        let parts = dp * m;
        self.par.check(batch.batch)?;
        let count = batch.targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let mut stats = Vec::with_capacity(m);
        let (mut act_bytes, mut gdn_bytes) = (0, 0);
        let mut host: Option<crate::model::ModelGrads> = None;
        let mut dev_acc: Option<Vec<GBuf<f32>>> = None;
        for k in 0..m {
            let sb = shard(batch, parts, rank * m + k);
            let (st, mut saved) = self.model.forward(&sb)?;
            act_bytes = act_bytes.max(saved.bytes());
            gdn_bytes = gdn_bytes.max(saved.gdn_bytes());
            stats.push(st);
            // Each shard's loss is its part of the whole batch's mean.
            saved.count = count;
            if self.dev_moments.is_none() {
                let g = self.model.backward(saved)?;
                match &mut host {
                    None => host = Some(g),
                    Some(acc) => {
                        for ((_, a), (_, x)) in acc.iter_mut().zip(g.iter()) {
                            add::cpu::add_assign(a.data_mut(), x.data())?;
                        }
                    }
                }
            } else {
                self.model.backward_into_grads(saved)?;
                if m > 1 {
                    let grads = self
                        .model
                        .device_grads()
                        .ok_or_else(|| GdnError::Invalid("no device gradients".into()))?;
                    match &mut dev_acc {
                        None => {
                            let mut v = Vec::with_capacity(grads.len());
                            for g in grads {
                                let mut c = g.gpu().uninit::<f32>(g.len())?;
                                g.gpu()
                                    .stream()
                                    .memcpy_dtod(&g.slice, &mut c.slice)
                                    .map_err(|e| {
                                        GdnError::Device(format!("cuMemcpyDtoDAsync: {e:?}"))
                                    })?;
                                v.push(c);
                            }
                            dev_acc = Some(v);
                        }
                        Some(acc) => {
                            for (a, g) in acc.iter_mut().zip(grads) {
                                add::cuda::add_assign_f32(a, g)?;
                            }
                        }
                    }
                }
            }
        }
        // Across ranks, in rank order.
        let comm = self.par.comm.clone();
        if let Some(acc) = dev_acc {
            // The shards' sum into the model's buffers.
            let dst = self
                .model
                .device_grads_mut()
                .ok_or_else(|| GdnError::Invalid("no device gradients".into()))?;
            for (d, a) in dst.iter_mut().zip(acc) {
                *d = a;
            }
        }
        let all_stats = match &comm {
            Some(c) if c.size() > 1 => {
                if let Some(g) = &mut host {
                    for (_, t) in g.iter_mut() {
                        let mut v = t.data().to_vec();
                        crate::dist::all_reduce_sum_host(c.as_ref(), &mut v)?;
                        t.data_mut().copy_from_slice(&v);
                    }
                }
                if let Some(dst) = self.model.device_grads_mut() {
                    for d in dst.iter_mut() {
                        let tmp = d.gpu().uninit::<f32>(d.len())?;
                        let g = std::mem::replace(d, tmp);
                        let mut f = F32s::Dev(g);
                        all_reduce_sum_f32(c.as_ref(), &mut f)?;
                        match f {
                            F32s::Dev(g) => *d = g,
                            F32s::Host(_) => return Err(crate::backend::mixed("gradients")),
                        }
                    }
                }
                gather_stats(c.as_ref(), &stats)?
            }
            _ => stats,
        };
        let mut loss = LossStats::default();
        for s in &all_stats {
            loss.add(s);
        }
        Ok((loss, act_bytes, gdn_bytes, host))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::run_ranks;
    use crate::testutil::bits;

    fn small() -> RunConfig {
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
            train_iters = 4
            "#,
        )
        .unwrap()
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
    fn two_data_ranks_equal_one_rank_with_two_micro_batches_bitwise() {
        let cfg = small();
        let mut one = Trainer::new(&cfg).unwrap();
        one.set_parallel(Parallel {
            comm: None,
            micro_batches: 2,
        })
        .unwrap();
        let want = run(&mut one, 4).unwrap();
        for (dp, m) in [(2, 1), (4, 1)] {
            let got = run_ranks(dp, |comm| {
                let mut t = Trainer::new(&cfg)?;
                t.set_parallel(Parallel {
                    comm: Some(comm),
                    micro_batches: m,
                })?;
                run(&mut t, 4)
            })
            .unwrap();
            // Every rank holds the same parameters.
            for g in &got {
                assert_eq!(g, &got[0]);
            }
            if dp == 2 {
                assert_eq!(got[0], want, "2 ranks vs 1 rank x 2 micro-batches");
            } else {
                // 4 ranks: the same losses (f64 sums in shard order equal the 2-shard sums only
                // up to rounding, so compare counts exactly and the parameters closely).
                for (a, b) in got[0].1.iter().zip(&want.1) {
                    assert_eq!((a.2, a.3), (b.2, b.3));
                }
            }
        }
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
            })
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("= 3 x 1 = 3"), "{e}");
        assert!(t
            .set_parallel(Parallel {
                comm: None,
                micro_batches: 0,
            })
            .is_err());
    }
}
