//! Training: a [`Trainer`] runs AdamW steps of a [`Model`] on a [`Dataset`], evaluates on the
//! held-out set, and saves and restores [`Checkpoint`]s.
//!
//! One step: the batch of this step (a function of the data seed and the step) -> forward ->
//! backward -> clip by global norm -> AdamW with the scheduled learning rate. Everything is
//! deterministic: the same config gives the same weights bit for bit, whether the run goes
//! straight through or stops and resumes from a checkpoint.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod optim;
#[cfg(test)]
mod tests;

use std::path::Path;

pub use checkpoint::Checkpoint;
pub use config::{DataConfig, DataKind, DecayStyle, OptimizerConfig, RunConfig, TrainConfig};
pub use data::Dataset;
pub use optim::AdamW;

use crate::error::{GdnError, Result};
use crate::layer::Params;
use crate::model::{LossStats, Model};

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Steps taken, this one included.
    pub step: u64,
    /// Loss, target count and correct predictions of the step's batch.
    pub loss: LossStats,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the batch (`B*T`).
    pub tokens: usize,
    /// Activation bytes kept between forward and backward (`ModelSaved::bytes()`).
    pub activation_bytes: usize,
    /// Of those, the GDN layers' `Saved::bytes()` summed over blocks.
    pub gdn_activation_bytes: usize,
}

/// A training run in memory.
#[derive(Clone, Debug)]
pub struct Trainer {
    cfg: RunConfig,
    model: Model,
    opt: AdamW,
    data: Dataset,
    step: u64,
}

impl Trainer {
    /// A fresh run: data from `cfg.data`, model initialized from `cfg.train.seed`.
    pub fn new(cfg: &RunConfig) -> Result<Self> {
        cfg.validate()?;
        cfg.check_memory()?;
        let data = Dataset::from_config(&cfg.data)?;
        Self::with_data(cfg, data)
    }

    /// A fresh run on given data (e.g. text already in memory).
    pub fn with_data(cfg: &RunConfig, data: Dataset) -> Result<Self> {
        cfg.validate()?;
        cfg.check_memory()?;
        let model = Model::new(&cfg.model_config(data.vocab_size()), cfg.train.seed)?;
        let opt = AdamW::new(&model);
        Ok(Trainer {
            cfg: cfg.clone(),
            model,
            opt,
            data,
            step: 0,
        })
    }

    /// Run the model's GDN layers on `device` (see [`Model::gdn_layers_to_device`]).
    pub fn gdn_layers_to_device(
        &mut self,
        device: crate::Device,
        dtype: crate::backend::cuda::DType,
    ) -> Result<()> {
        self.model.gdn_layers_to_device(device, dtype)
    }

    /// Continue the run of `cfg` from the checkpoint at `path` (refused if it was written for
    /// another model config or another data seed, or is corrupt).
    pub fn resume(cfg: &RunConfig, path: &Path) -> Result<Self> {
        cfg.validate()?;
        cfg.check_memory()?;
        let data = Dataset::from_config(&cfg.data)?;
        Self::resume_with_data(cfg, data, path)
    }

    /// [`resume`](Self::resume) on given data.
    pub fn resume_with_data(cfg: &RunConfig, data: Dataset, path: &Path) -> Result<Self> {
        let mut t = Self::with_data(cfg, data)?;
        let ck = Checkpoint::read(path, t.model.config())?;
        if ck.data_seed != cfg.data.seed {
            return Err(GdnError::File {
                path: path.display().to_string(),
                msg: format!(
                    "the checkpoint was written with data seed {}, this run has {}",
                    ck.data_seed, cfg.data.seed
                ),
            });
        }
        t.model.set_params(&ck.params)?;
        let tensors = |p: &Params| p.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>();
        t.opt.exp_avg = tensors(&ck.exp_avg);
        t.opt.exp_avg_sq = tensors(&ck.exp_avg_sq);
        t.opt.steps = ck.step;
        t.step = ck.step;
        Ok(t)
    }

    /// The checkpoint of the current state.
    pub fn checkpoint(&self) -> Checkpoint {
        let named = |v: &[crate::tensor::Tensor]| {
            Params::from_entries(
                self.opt
                    .names
                    .iter()
                    .cloned()
                    .zip(v.iter().cloned())
                    .collect(),
            )
        };
        Checkpoint {
            step: self.step,
            data_seed: self.cfg.data.seed,
            model: self.model.config().clone(),
            run_config: self.cfg.to_toml_string(),
            params: self.model.params(),
            exp_avg: named(&self.opt.exp_avg),
            exp_avg_sq: named(&self.opt.exp_avg_sq),
        }
    }

    /// Write the current state to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.checkpoint().write(path)
    }

    /// Steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }
    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }
    /// The data.
    pub fn data(&self) -> &Dataset {
        &self.data
    }
    /// The config.
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    /// One optimizer step on the batch of the next step.
    pub fn step(&mut self) -> Result<StepStats> {
        let s = self.step + 1;
        let batch = self.data.train_batch(s);
        let (loss, saved) = self.model.forward(&batch)?;
        let (activation_bytes, gdn_activation_bytes) = (saved.bytes(), saved.gdn_bytes());
        let mut grads = self.model.backward(saved)?;
        let o = &self.cfg.optimizer;
        let grad_norm = optim::clip_grad_norm(&mut grads, o.clip_grad, s)?;
        let lr = optim::lr_at(o, self.cfg.lr_decay_iters(), s);
        self.opt.update(&mut self.model, &grads, o, lr)?;
        self.step = s;
        Ok(StepStats {
            step: s,
            loss,
            lr,
            grad_norm,
            tokens: batch.len(),
            activation_bytes,
            gdn_activation_bytes,
        })
    }

    /// Loss and accuracy on the whole held-out set.
    pub fn evaluate(&self) -> Result<LossStats> {
        let mut st = LossStats::default();
        for b in self.data.eval_batches() {
            st.add(&self.model.evaluate(b)?);
        }
        Ok(st)
    }
}
