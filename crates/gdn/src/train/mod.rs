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
pub mod dp;
pub mod optim;
pub mod rundir;
#[cfg(test)]
mod tests;

use std::path::Path;

pub use checkpoint::Checkpoint;
pub use config::{DataConfig, DataKind, DecayStyle, OptimizerConfig, RunConfig, TrainConfig};
pub use data::Dataset;
pub use dp::Parallel;
pub use optim::AdamW;

use crate::backend::cuda::{DType, GBuf};
use crate::backend::Device;
use crate::error::{GdnError, Result};
use crate::layer::Params;
use crate::model::{param_specs, LossStats, Model};
use crate::tensor::Tensor;

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

/// Run-config keys (`section.key`) that a resume may change: `train.train_iters`, which
/// `gdn train --resume DIR --steps N` sets to extend the run. Every other key must equal the
/// checkpoint's run config (`data.path` may differ too under
/// [`ResumeOptions::allow_data_change`]).
pub const RESUME_MAY_CHANGE: &[&str] = &["train.train_iters"];

/// What a resume accepts beyond an exact continuation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResumeOptions {
    /// Continue even though the text data file's size or content (or `data.path`) differs from
    /// what the checkpoint recorded; the resumed run then trains on the new data.
    pub allow_data_change: bool,
}

/// A training run in memory.
#[derive(Debug)]
pub struct Trainer {
    cfg: RunConfig,
    model: Model,
    opt: AdamW,
    data: Dataset,
    step: u64,
    /// AdamW's moments on the GPU when the model runs there (`opt` then keeps only the step
    /// count and the names; its host moments are stale until a checkpoint downloads these).
    dev_moments: Option<DevMoments>,
    /// Data-parallel ranks and micro-batches ([`Trainer::set_parallel`]); one rank by default.
    par: Parallel,
}

/// `(exp_avg, exp_avg_sq)` per parameter on a GPU, in parameter order.
struct DevMoments(Vec<(GBuf<f32>, GBuf<f32>)>);

impl std::fmt::Debug for DevMoments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevMoments({} parameters)", self.0.len())
    }
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
            dev_moments: None,
            par: Parallel::default(),
        })
    }

    /// Train on `device`: the whole model ([`Model::to_device`]) and AdamW's moments live there,
    /// activations in `dtype` storage (bf16 or f32 on a GPU; the CPU is f32). A step then copies
    /// to the host only the loss statistics and the gradient norm; checkpoints download the
    /// parameters and moments. `Device::Cpu` brings everything back. Checks the GPU's free memory
    /// first.
    pub fn to_device(&mut self, device: Device, dtype: DType) -> Result<()> {
        self.sync_moments_to_host()?;
        self.dev_moments = None;
        let Device::Cuda(i) = device else {
            return self.model.to_device(device, dtype);
        };
        let gpu = crate::backend::cuda::gpu(i)?;
        let mcfg = self.model.config().clone();
        crate::budget::check_gpu(
            &gpu,
            &format!(
                "the model's parameters, gradients and AdamW moments ({})",
                mcfg.describe_params()
            ),
            crate::model::device_param_bytes(&mcfg, device, dtype) + 2 * mcfg.param_bytes(),
        )?;
        self.model.to_device(device, dtype)?;
        let m = self
            .opt
            .exp_avg
            .iter()
            .zip(&self.opt.exp_avg_sq)
            .map(|(m, v)| Ok((gpu.upload(m.data())?, gpu.upload(v.data())?)))
            .collect::<Result<Vec<_>>>()?;
        self.dev_moments = Some(DevMoments(m));
        Ok(())
    }

    /// Where the run trains.
    pub fn device(&self) -> Device {
        self.model.device()
    }

    /// AdamW's moments from where they live (downloads on a GPU).
    fn moments(&self) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let Some(d) = &self.dev_moments else {
            return Ok((self.opt.exp_avg.clone(), self.opt.exp_avg_sq.clone()));
        };
        let (mut ms, mut vs) = (Vec::new(), Vec::new());
        for ((m, v), t) in d.0.iter().zip(&self.opt.exp_avg) {
            ms.push(Tensor::from_vec(t.shape(), m.gpu().download(m)?)?);
            vs.push(Tensor::from_vec(t.shape(), v.gpu().download(v)?)?);
        }
        Ok((ms, vs))
    }

    fn sync_moments_to_host(&mut self) -> Result<()> {
        if self.dev_moments.is_some() {
            let (m, v) = self.moments()?;
            self.opt.exp_avg = m;
            self.opt.exp_avg_sq = v;
        }
        Ok(())
    }

    /// Run the model's GDN layers on `device` (see [`Model::gdn_layers_to_device`]).
    pub fn gdn_layers_to_device(
        &mut self,
        device: crate::Device,
        dtype: crate::backend::cuda::DType,
    ) -> Result<()> {
        self.model.gdn_layers_to_device(device, dtype)
    }

    /// Continue the run of `cfg` from the checkpoint at `path` (refused if it is corrupt, or
    /// was written for another model config, another data seed, another run config or other
    /// text data; see [`from_checkpoint`](Self::from_checkpoint)).
    pub fn resume(cfg: &RunConfig, path: &Path) -> Result<Self> {
        cfg.validate()?;
        cfg.check_memory()?;
        let data = Dataset::from_config(&cfg.data)?;
        Self::resume_with_data(cfg, data, path)
    }

    /// [`resume`](Self::resume) on given data.
    pub fn resume_with_data(cfg: &RunConfig, data: Dataset, path: &Path) -> Result<Self> {
        let ck = Checkpoint::load(path)?;
        let (t, _) = Self::from_checkpoint(cfg, data, ck, path, ResumeOptions::default())?;
        Ok(t)
    }

    /// Continue the run of `cfg` on `data` from `ck`, a checkpoint loaded (and so checked for
    /// integrity) from `path`. Refused, naming `path`: a checkpoint of another model config
    /// (each differing field), of another data seed, of another run config (each differing
    /// `section.key`, except [`RESUME_MAY_CHANGE`]), or of text data whose size or hash differ
    /// from `data`'s (unless `opts.allow_data_change`). Returns the trainer and notes on what
    /// was accepted under `opts` (one line each).
    pub fn from_checkpoint(
        cfg: &RunConfig,
        data: Dataset,
        ck: Checkpoint,
        path: &Path,
        opts: ResumeOptions,
    ) -> Result<(Self, Vec<String>)> {
        let refuse = |msg: String| GdnError::File {
            path: path.display().to_string(),
            msg,
        };
        let mut t = Self::with_data(cfg, data)?;
        ck.check_model(path, t.model.config())?;
        if ck.data_seed != cfg.data.seed {
            return Err(refuse(format!(
                "the checkpoint was written with data seed {}, this run has {}",
                ck.data_seed, cfg.data.seed
            )));
        }
        run_config_matches(&ck.run_config, cfg, opts).map_err(refuse)?;
        let mut notes = Vec::new();
        let file = match &cfg.data.path {
            Some(p) => format!("data file {}", p.display()),
            None => "the text data".to_string(),
        };
        match (ck.data_file, t.data.fingerprint()) {
            (Some(then), Some(now)) if then != now => {
                let what = format!(
                    "{file} changed since the checkpoint was written: {then} then, {now} now"
                );
                if !opts.allow_data_change {
                    return Err(refuse(format!(
                        "{what}; resuming would continue the run on other data \
                         (gdn train --allow-data-change accepts that)"
                    )));
                }
                notes.push(format!(
                    "{what}; continuing on the new data (--allow-data-change)"
                ));
            }
            (Some(_), None) => {
                return Err(refuse(
                    "the checkpoint was trained on text data, this run's data is MQAR".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(refuse(format!(
                    "the checkpoint records no text data file, this run trains on {file}"
                )))
            }
            _ => {}
        }
        t.model.set_params(&ck.params)?;
        let tensors = |p: &Params| p.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>();
        t.opt.exp_avg = tensors(&ck.exp_avg);
        t.opt.exp_avg_sq = tensors(&ck.exp_avg_sq);
        t.opt.steps = ck.step;
        t.step = ck.step;
        Ok((t, notes))
    }

    /// The checkpoint of the current state (on a GPU: the parameters and moments downloaded).
    pub fn checkpoint(&self) -> Result<Checkpoint> {
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
        let (m, v) = self.moments()?;
        Ok(Checkpoint {
            step: self.step,
            data_seed: self.cfg.data.seed,
            model: self.model.config().clone(),
            run_config: self.cfg.to_toml_string(),
            data_file: self.data.fingerprint(),
            params: self.model.try_params()?,
            exp_avg: named(&m),
            exp_avg_sq: named(&v),
        })
    }

    /// Write the current state to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.checkpoint()?.write(path)
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
        // One rank, one batch: forward + backward here. Split over data-parallel ranks or
        // micro-batches: `split_forward_backward` (train/dp.rs) leaves the summed gradients in
        // `split_grads` (CPU) or the model's gradient buffers (GPU).
        let (loss, saved, activation_bytes, gdn_activation_bytes, mut split_grads) =
            if self.par.is_split() {
                let (l, a, g, h) = self.split_forward_backward(&batch)?;
                (l, None, a, g, h)
            } else {
                let (l, saved) = self.model.forward(&batch)?;
                let (a, g) = (saved.bytes(), saved.gdn_bytes());
                (l, Some(saved), a, g, None)
            };
        let o = &self.cfg.optimizer;
        let lr = optim::lr_at(o, self.cfg.lr_decay_iters(), s);
        let grad_norm = match &mut self.dev_moments {
            None => {
                let mut grads = match (saved, split_grads.take()) {
                    (Some(saved), _) => self.model.backward(saved)?,
                    (None, Some(g)) => g,
                    (None, None) => {
                        return Err(GdnError::Invalid("the step produced no gradients".into()))
                    }
                };
                let grad_norm = optim::clip_grad_norm(&mut grads, o.clip_grad, s)?;
                self.opt.update(&mut self.model, &grads, o, lr)?;
                grad_norm
            }
            Some(moments) => {
                // On the GPU: gradients into the model's buffers, their norm (one download),
                // clipping folded into the AdamW kernel's gradient scale.
                if let Some(saved) = saved {
                    self.model.backward_into_grads(saved)?;
                }
                let ss = self.model.grad_sum_squares()?;
                let norm = ss.iter().sum::<f64>().sqrt();
                if !norm.is_finite() {
                    let specs = param_specs(self.model.config());
                    let bad = ss
                        .iter()
                        .position(|x| !x.is_finite())
                        .map_or("?".to_string(), |k| specs[k].0.clone());
                    return Err(GdnError::Invalid(format!(
                        "step {s}: the gradient norm is {norm} (first non-finite gradient: {bad}); \
                         training diverged, try a lower optimizer.lr or clip_grad"
                    )));
                }
                let scale = optim::clip_scale(o.clip_grad, norm);
                self.opt.steps += 1;
                let t = self.opt.steps;
                self.model.adamw_step_on_device(&mut moments.0, |shape| {
                    optim::hyper(o, t, lr, shape.len() >= 2, scale)
                })?;
                norm
            }
        };
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

/// `section.key` -> value (TOML text) of every key of a run config document.
pub(crate) fn flat_table(table: toml::Table) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (section, v) in table {
        match v {
            toml::Value::Table(keys) => out.extend(
                keys.into_iter()
                    .map(|(k, v)| (format!("{section}.{k}"), v.to_string())),
            ),
            v => out.push((section, v.to_string())),
        }
    }
    out
}

/// `section.key` -> value of a run config, every key it writes.
pub(crate) fn flat_config(cfg: &RunConfig) -> Vec<(String, String)> {
    flat_table(toml::from_str(&cfg.to_toml_string()).unwrap_or_default())
}

/// `Ok` when `run` is the run config `ckpt` (a checkpoint's TOML) up to the keys a resume may
/// change; else a message naming every differing key with both values.
fn run_config_matches(
    ckpt: &str,
    run: &RunConfig,
    opts: ResumeOptions,
) -> std::result::Result<(), String> {
    let mut then = RunConfig::from_toml_str(ckpt)
        .map_err(|e| format!("the run config stored in the checkpoint does not parse: {e}"))?;
    then.train.train_iters = run.train.train_iters;
    if opts.allow_data_change {
        then.data.path.clone_from(&run.data.path);
    }
    if &then == run {
        return Ok(());
    }
    let diffs = checkpoint::diff_keys(&flat_config(&then), &flat_config(run));
    Err(format!(
        "the run config differs from the one the checkpoint was written with: {diffs} \
         (a resume may change only {}; resume with the run's own config.toml)",
        RESUME_MAY_CHANGE.join(", ")
    ))
}
