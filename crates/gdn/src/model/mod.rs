//! A small language model built from the GDN layer, with an explicit forward and backward like
//! the layer's.
//!
//! ```text
//! tokens -> embedding
//!   N blocks:  x = x + GDN(x)                       (the layer's fused pre-norm included)
//!              x = x + fc2(swiglu(fc1(norm(x))))    (SwiGLU MLP)
//! norm -> LM head (tied to the embedding, or its own) -> softmax cross-entropy on the targets
//! ```
//!
//! `forward` returns the loss statistics and a [`ModelSaved`] holding exactly what backward
//! needs: each block's layer [`Saved`] (the layer's recompute options apply per
//! block), the MLP's kept activations, and the head's. `ModelSaved::bytes()` is the model's
//! activation memory to the byte. `backward` consumes it and returns the gradient of the mean
//! loss for every parameter, under the parameter's name.
//!
//! The math is written once over the backend's buffers (`Act`, `F32s`) and the ops' entries, like
//! the layer's: on the CPU it is the f32 host path; after [`Model::to_device`] every parameter,
//! activation and gradient lives on the GPU (the token ids and targets are uploaded once per step,
//! the loss statistics are the one download of a forward), and [`Model::backward_into_grads`] /
//! [`Model::adamw_step_on_device`] train it there.
//!
//! Parameter names follow Megatron's GPT model: `embedding.word_embeddings.weight`,
//! `decoder.layers.{i}.self_attention.<layer parameter>`,
//! `decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight` (and `_bias` for LayerNorm),
//! `decoder.layers.{i}.mlp.linear_fc1.weight` `[2F, h]` (`[gate | up]` rows),
//! `decoder.layers.{i}.mlp.linear_fc2.weight` `[h, F]`, `decoder.final_layernorm.weight` (and
//! `.bias`), `output_layer.weight` `[V, h]` (untied only).

mod config;
pub mod loss;
#[doc(hidden)]
pub mod reference;
mod saved;
pub mod swiglu;
#[cfg(test)]
mod tests;
// Inference with cached states (issue 14): Model::cache / prefill / extend / decode.
mod infer;

pub use config::ModelConfig;
pub use infer::ModelCache;
pub use loss::{LossStats, IGNORE_INDEX};
pub use saved::ModelSaved;

use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::backend::cuda::{self, DType, GBuf, Gpu};
use crate::backend::{Act, Device, F32s, Ids, PMut, P};
use crate::config::Normalization;
use crate::dist::Communicator;
use crate::error::{GdnError, Result};
use crate::layer::{
    param_specs as layer_param_specs, CpLayer, CpSaved, GatedDeltaNet, Params, Saved,
};
use crate::ops::{adamw, add, cross_entropy, embedding, linear, norm};
use crate::seqs::Seqs;
use crate::tensor::Tensor;
use saved::{BlockSaved, DevIds, HeadSaved, MlpActs};

/// Gradients of every model parameter, under the parameters' names, in parameter order.
pub type ModelGrads = Params;

/// `B` sequences of `T` tokens and their targets (the next token, or [`IGNORE_INDEX`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Token ids `[B*T]`, row-major.
    pub tokens: Vec<u32>,
    /// Target ids `[B*T]`: the token to predict at each position, or [`IGNORE_INDEX`].
    pub targets: Vec<i32>,
    /// `B`.
    pub batch: usize,
    /// `T`.
    pub seq_len: usize,
}

impl Batch {
    /// Check lengths.
    pub fn new(tokens: Vec<u32>, targets: Vec<i32>, batch: usize, seq_len: usize) -> Result<Self> {
        let n = batch * seq_len;
        if batch == 0 || seq_len == 0 || tokens.len() != n || targets.len() != n {
            return Err(GdnError::Invalid(format!(
                "batch of {batch} x {seq_len} needs {n} tokens and targets, got {} and {}",
                tokens.len(),
                targets.len()
            )));
        }
        Ok(Batch {
            tokens,
            targets,
            batch,
            seq_len,
        })
    }
    /// `B*T`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    /// Whether the batch holds no token (never, for a batch from [`Batch::new`]).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Prefix of block `i`'s GDN layer parameters.
fn gdn_prefix(i: usize) -> String {
    format!("decoder.layers.{i}.self_attention.")
}

/// Name of the embedding.
pub const EMBEDDING: &str = "embedding.word_embeddings.weight";
/// Name of the untied LM head.
pub const OUTPUT_LAYER: &str = "output_layer.weight";

/// Names and shapes of the model's own (non-GDN) parameters of block `i`, in order.
fn mlp_specs(cfg: &ModelConfig, i: usize) -> Vec<(String, Vec<usize>)> {
    let (h, f) = (cfg.hidden_size(), cfg.ffn_hidden_size);
    let p = format!("decoder.layers.{i}.mlp.");
    let mut v = vec![(format!("{p}linear_fc1.layer_norm_weight"), vec![h])];
    if cfg.layer.normalization == Normalization::LayerNorm {
        v.push((format!("{p}linear_fc1.layer_norm_bias"), vec![h]));
    }
    v.push((format!("{p}linear_fc1.weight"), vec![2 * f, h]));
    v.push((format!("{p}linear_fc2.weight"), vec![h, f]));
    v
}

/// Every parameter of a model with this config, names and shapes, in order (Megatron's
/// registration order: embedding, blocks, final norm, output layer).
pub fn param_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, vsz) = (cfg.hidden_size(), cfg.vocab_size);
    let mut v = vec![(EMBEDDING.to_string(), vec![vsz, h])];
    for i in 0..cfg.num_layers() {
        let pre = gdn_prefix(i);
        v.extend(
            layer_param_specs(&cfg.layer)
                .into_iter()
                .map(|(n, s)| (format!("{pre}{n}"), s)),
        );
        v.extend(mlp_specs(cfg, i));
    }
    v.push(("decoder.final_layernorm.weight".into(), vec![h]));
    if cfg.layer.normalization == Normalization::LayerNorm {
        v.push(("decoder.final_layernorm.bias".into(), vec![h]));
    }
    if !cfg.share_embeddings_and_output_weights {
        v.push((OUTPUT_LAYER.into(), vec![vsz, h]));
    }
    v
}

/// A seed for block `i`'s layer, derived from the model seed (SplitMix64 finalizer).
fn layer_seed(seed: u64, i: usize) -> u64 {
    let mut z = seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The model: its config, one GDN layer per block, and its own parameters (embedding, MLPs,
/// final norm, head) by name; on a GPU ([`Model::to_device`]) also their device copies and one
/// fp32 gradient buffer per parameter (the last backward's).
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    layers: Vec<GatedDeltaNet>,
    own: Params,
    dev: Option<DevModel>,
    /// The context-parallel group ([`Model::set_cp`]); `None`: one rank.
    cp: Option<Arc<dyn Communicator>>,
}

/// The model's own parameters on a GPU: fp32 masters (the values the optimizer updates; the host
/// `own` is refreshed only by [`Model::try_params`] / [`Model::sync_to_host`]), bf16 copies of
/// the GEMM weights under bf16 storage (remade after each update), and one fp32 gradient buffer
/// per model parameter (GDN layers' included), in [`param_specs`] order, written by
/// [`Model::backward_into_grads`].
struct DevModel {
    gpu: Arc<Gpu>,
    dtype: DType,
    /// Masters, in the order of `Model::own`.
    own: Vec<GBuf<f32>>,
    /// bf16 copies of the GEMM weights (`None` for the others, and everything under f32).
    own_bf16: Vec<Option<GBuf<u16>>>,
    /// Gradients, [`param_specs`] order.
    grads: Vec<GBuf<f32>>,
}

impl std::fmt::Debug for DevModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevModel({:?}, {:?}, {} own tensors, {} gradients)",
            self.gpu,
            self.dtype,
            self.own.len(),
            self.grads.len()
        )
    }
}

/// Whether the model's own parameter `name` is a GEMM weight (read as a bf16 copy under bf16
/// storage): the MLP's two linears and the LM head (the embedding when tied).
fn is_gemm_weight(cfg: &ModelConfig, name: &str) -> bool {
    name.ends_with("linear_fc1.weight")
        || name.ends_with("linear_fc2.weight")
        || name == OUTPUT_LAYER
        || (name == EMBEDDING && cfg.share_embeddings_and_output_weights)
}

/// Bytes of the model's parameters on `device` with `dtype` storage, as [`Model::to_device`]
/// allocates them: fp32 masters, bf16 copies of the GEMM weights (bf16 on a GPU), and one fp32
/// gradient per parameter (GPU).
pub fn device_param_bytes(cfg: &ModelConfig, device: Device, dtype: DType) -> u128 {
    let masters = cfg.param_bytes();
    if device == Device::Cpu {
        return masters;
    }
    let mut b = 2 * masters;
    if dtype == DType::Bf16 {
        for (name, shape) in param_specs(cfg) {
            let n: u128 = shape.iter().map(|&d| d as u128).product();
            if is_gemm_weight(cfg, &name)
                || name.ends_with("in_proj.weight")
                || name.ends_with("out_proj.weight")
            {
                b += 2 * n;
            }
        }
    }
    b
}

impl Model {
    /// A model with Megatron's initialization from `seed`: normals of std `init_method_std`
    /// (embedding, `linear_fc1`, untied output layer) and `init_method_std / sqrt(2 num_layers)`
    /// (`linear_fc2`), norm weights 1 (0 when zero-centered), biases 0, and each block's layer as
    /// [`Params::init`] with a seed derived from `seed` and the block index.
    pub fn new(cfg: &ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        crate::budget::check_host(&cfg.describe_params(), cfg.param_bytes())?;
        let layers = (0..cfg.num_layers())
            .map(|i| GatedDeltaNet::new(&cfg.layer, layer_seed(seed, i)))
            .collect::<Result<Vec<_>>>()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let std = cfg.layer.init_method_std;
        let out_std = std / (2.0 * cfg.num_layers() as f32).sqrt();
        let one = if cfg.layer.layernorm_zero_centered_gamma {
            0.0
        } else {
            1.0
        };
        let mut own = Vec::new();
        for (name, shape) in param_specs(cfg) {
            if name.contains(".self_attention.") {
                continue;
            }
            let mut t = Tensor::zeros(&shape);
            let normal = |rng: &mut ChaCha8Rng, t: &mut Tensor, s: f32| {
                if s > 0.0 {
                    let d = Normal::new(0.0f32, s).expect("finite std");
                    t.data_mut().iter_mut().for_each(|x| *x = d.sample(rng));
                }
            };
            if name.ends_with("layer_norm_weight") || name == "decoder.final_layernorm.weight" {
                t.data_mut().fill(one);
            } else if name.ends_with("linear_fc2.weight") {
                normal(&mut rng, &mut t, out_std);
            } else if name.ends_with(".weight") {
                normal(&mut rng, &mut t, std);
            }
            own.push((name, t));
        }
        Ok(Model {
            cfg: cfg.clone(),
            layers,
            own: Params::from_entries(own),
            dev: None,
            cp: None,
        })
    }

    /// A model with the given parameters (every parameter of [`param_specs`] with its shape,
    /// nothing else).
    pub fn with_params(cfg: &ModelConfig, params: &Params) -> Result<Self> {
        let mut m = Model::new(cfg, 0)?;
        m.set_params(params)?;
        Ok(m)
    }

    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Train with context parallelism over `comm` (its size is the CP size; `None` or one rank:
    /// off). Every rank of the group passes the same batches to [`forward`](Self::forward); each
    /// computes its zigzag share of every sequence ([`crate::dist::cp::local_rows`]): the
    /// embedding, MLPs and head on its rows, the GDN layers through [`CpLayer`] (head-parallel
    /// over whole sequences). The loss statistics and every gradient come back whole and equal on
    /// every rank (row-partial gradients summed in rank order). [`evaluate`](Self::evaluate) stays
    /// on one rank. Errors unless the key and value heads are divisible by the CP size (sequence
    /// lengths must be divisible by `2 cp`: checked per batch).
    pub fn set_cp(&mut self, comm: Option<Arc<dyn Communicator>>) -> Result<()> {
        let comm = comm.filter(|c| c.size() > 1);
        if let Some(c) = &comm {
            crate::dist::cp::check_heads(&self.cfg.layer, c.size())?;
        }
        self.cp = comm;
        Ok(())
    }

    /// The context-parallel size (1 without).
    pub fn cp_size(&self) -> usize {
        self.cp.as_ref().map_or(1, |c| c.size())
    }

    /// Number of parameter values.
    pub fn numel(&self) -> usize {
        self.own.numel()
            + self
                .layers
                .iter()
                .map(|l| l.params().numel())
                .sum::<usize>()
    }

    /// Every parameter, cloned, in [`param_specs`] order under its full name.
    pub fn params(&self) -> Params {
        let mut out = Vec::new();
        self.for_each_param(|n, t| out.push((n.to_string(), t.clone())));
        Params::from_entries(out)
    }

    /// Replace every parameter (checked: exactly the names and shapes of [`param_specs`]).
    pub fn set_params(&mut self, p: &Params) -> Result<()> {
        check_params(&self.cfg, p, "parameters")?;
        self.for_each_param_mut(|n, t| {
            *t = p.get(n).expect("checked above").clone();
        });
        Ok(())
    }

    /// Visit every parameter in [`param_specs`] order.
    pub fn for_each_param(&self, mut f: impl FnMut(&str, &Tensor)) {
        let mut name = String::new();
        let mut own = self.own.iter();
        let (n, t) = own.next().expect("embedding");
        f(n, t);
        for (i, l) in self.layers.iter().enumerate() {
            for (n, t) in l.params().iter() {
                name.clear();
                name.push_str(&gdn_prefix(i));
                name.push_str(n);
                f(&name, t);
            }
            for _ in 0..mlp_specs(&self.cfg, i).len() {
                let (n, t) = own.next().expect("mlp parameter");
                f(n, t);
            }
        }
        for (n, t) in own {
            f(n, t);
        }
    }

    /// Run the whole model on `device`: every parameter there (fp32 masters, and bf16 copies of
    /// the GEMM weights under bf16 storage, remade after each update), activations in `dtype`
    /// storage (bf16: fp32 accumulation; f32 for verification), one fp32 gradient buffer per
    /// parameter (zeros until the first backward). `Device::Cpu` (f32 only) brings the parameters back to the host.
    /// Checks the GPU's free memory first.
    pub fn to_device(&mut self, device: Device, dtype: DType) -> Result<()> {
        let Device::Cuda(i) = device else {
            if dtype != DType::F32 {
                return Err(GdnError::Invalid(
                    "the CPU path computes in f32 only".into(),
                ));
            }
            self.sync_to_host()?;
            self.dev = None;
            return self.gdn_layers_to_device(device, dtype);
        };
        let gpu = cuda::gpu(i)?;
        self.sync_to_host()?;
        self.dev = None;
        crate::budget::check_gpu(
            &gpu,
            &format!(
                "the model's parameters and gradients ({})",
                self.cfg.describe_params()
            ),
            device_param_bytes(&self.cfg, device, dtype),
        )?;
        self.gdn_layers_to_device(device, dtype)?;
        for l in &self.layers {
            l.ensure_dev_params()?;
        }
        let own = self
            .own
            .iter()
            .map(|(_, t)| gpu.upload(t.data()))
            .collect::<Result<Vec<_>>>()?;
        let grads = param_specs(&self.cfg)
            .iter()
            .map(|(_, s)| gpu.zeros::<f32>(s.iter().product()))
            .collect::<Result<Vec<_>>>()?;
        self.dev = Some(DevModel {
            gpu,
            dtype,
            own_bf16: Vec::new(),
            own,
            grads,
        });
        self.refresh_bf16()
    }

    /// Where the model runs (the CPU, or the GPU of [`to_device`](Self::to_device); a model
    /// with only its GDN layers on a GPU runs on the CPU).
    pub fn device(&self) -> Device {
        match &self.dev {
            None => Device::Cpu,
            Some(d) => Device::Cuda(d.gpu.ordinal()),
        }
    }

    /// Activation storage type (f32 on the CPU).
    pub fn dtype(&self) -> DType {
        self.dev.as_ref().map_or(DType::F32, |d| d.dtype)
    }

    /// Bytes the parameters, their bf16 copies and the gradient buffers take on the GPU (0 on
    /// the CPU).
    pub fn device_bytes(&self) -> usize {
        let Some(d) = &self.dev else { return 0 };
        d.own.iter().map(GBuf::bytes).sum::<usize>()
            + d.own_bf16.iter().flatten().map(GBuf::bytes).sum::<usize>()
            + d.grads.iter().map(GBuf::bytes).sum::<usize>()
            + self
                .layers
                .iter()
                .map(|l| l.dev_param_bytes())
                .sum::<usize>()
    }

    /// Remake the bf16 copies of the GEMM weights from the fp32 masters (after an update).
    fn refresh_bf16(&mut self) -> Result<()> {
        let cfg = &self.cfg;
        let Some(d) = &mut self.dev else {
            return Ok(());
        };
        d.own_bf16 = self
            .own
            .iter()
            .zip(&d.own)
            .map(|((n, _), w)| {
                if d.dtype == DType::Bf16 && is_gemm_weight(cfg, n) {
                    linear::cuda::cast_bf16(w).map(Some)
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        for l in &mut self.layers {
            l.refresh_dev_bf16()?;
        }
        Ok(())
    }

    /// Every parameter in [`param_specs`] order under its full name, from where it lives (a
    /// GPU model downloads its masters; [`params`](Self::params) is the host copy).
    pub fn try_params(&self) -> Result<Params> {
        let Some(d) = &self.dev else {
            return Ok(self.params());
        };
        let mut own = Vec::with_capacity(d.own.len());
        for ((n, t), b) in self.own.iter().zip(&d.own) {
            own.push((
                n.to_string(),
                Tensor::from_vec(t.shape(), d.gpu.download(b)?)?,
            ));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| l.download_params())
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::new();
        let mut own = own.into_iter();
        out.push(own.next().expect("embedding"));
        for (i, lp) in layers.iter().enumerate() {
            for (n, t) in lp.iter() {
                out.push((format!("{}{n}", gdn_prefix(i)), t.clone()));
            }
            for _ in 0..mlp_specs(&self.cfg, i).len() {
                out.push(own.next().expect("mlp parameter"));
            }
        }
        out.extend(own);
        Ok(Params::from_entries(out))
    }

    /// Copy a GPU model's parameters to the host copy (what [`params`](Self::params) returns).
    pub fn sync_to_host(&mut self) -> Result<()> {
        if self.dev.is_none() {
            return Ok(());
        }
        let p = self.try_params()?;
        self.for_each_param_mut(|n, t| {
            *t = p.get(n).expect("every parameter").clone();
        });
        Ok(())
    }

    /// The parameter `name` of the model's own (not a GDN layer's) where it lives.
    fn wp(&self, name: &str) -> P<'_> {
        match &self.dev {
            None => P::Host(self.own.d(name)),
            Some(_) => self
                .wp_opt(name)
                .unwrap_or_else(|| panic!("parameter {name} present by construction")),
        }
    }
    fn wp_opt(&self, name: &str) -> Option<P<'_>> {
        match &self.dev {
            None => self.own.opt(name).map(P::Host),
            Some(d) => {
                let i = self.own.iter().position(|(n, _)| n == name)?;
                Some(P::Dev(&d.own[i]))
            }
        }
    }
    /// The bf16 copy of a GEMM weight (GPU, bf16 storage).
    fn wb(&self, name: &str) -> Option<&GBuf<u16>> {
        let d = self.dev.as_ref()?;
        let i = self.own.iter().position(|(n, _)| n == name)?;
        d.own_bf16.get(i).and_then(Option::as_ref)
    }
    fn head_name(&self) -> &'static str {
        if self.cfg.share_embeddings_and_output_weights {
            EMBEDDING
        } else {
            OUTPUT_LAYER
        }
    }

    /// Run the GDN layers on `device` with `dtype` activation storage (bf16 or f32 on a GPU);
    /// the embedding, MLPs and head stay on the CPU, so each block's layer input and output
    /// cross to the device and back.
    pub fn gdn_layers_to_device(
        &mut self,
        device: crate::Device,
        dtype: crate::backend::cuda::DType,
    ) -> Result<()> {
        if self.dev.is_some() {
            return Err(GdnError::Invalid(
                "gdn_layers_to_device: the whole model is on a GPU; use to_device".into(),
            ));
        }
        self.layers = std::mem::take(&mut self.layers)
            .into_iter()
            .map(|l| l.to_device(device, dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(())
    }

    /// Visit every parameter mutably in [`param_specs`] order (for optimizers; shapes must not
    /// change).
    pub fn for_each_param_mut(&mut self, mut f: impl FnMut(&str, &mut Tensor)) {
        let cfg = &self.cfg;
        let mut name = String::new();
        let mut own = self.own.iter_mut();
        let (n, t) = own.next().expect("embedding");
        f(n, t);
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (n, t) in l.params_mut().iter_mut() {
                name.clear();
                name.push_str(&gdn_prefix(i));
                name.push_str(n);
                f(&name, t);
            }
            for _ in 0..mlp_specs(cfg, i).len() {
                let (n, t) = own.next().expect("mlp parameter");
                f(n, t);
            }
        }
        for (n, t) in own {
            f(n, t);
        }
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        let v = self.cfg.vocab_size;
        if let Some((i, &t)) = batch
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= v)
        {
            return Err(GdnError::Invalid(format!(
                "tokens[{i}] = {t}: expected a token id in [0, {v})"
            )));
        }
        loss::check_targets(&batch.targets, v)?;
        if batch.tokens.len() != batch.batch * batch.seq_len
            || batch.targets.len() != batch.tokens.len()
        {
            return Err(GdnError::Invalid(format!(
                "batch of {} x {} holds {} tokens and {} targets",
                batch.batch,
                batch.seq_len,
                batch.tokens.len(),
                batch.targets.len()
            )));
        }
        Ok(())
    }

    /// Training forward: the loss statistics of `batch` and what backward needs. On a GPU the
    /// token ids and targets are uploaded once, everything stays on the device, and the loss
    /// statistics are the one download.
    pub fn forward(&self, batch: &Batch) -> Result<(LossStats, ModelSaved)> {
        let (st, saved) = self.run_forward(batch, true)?;
        Ok((st, saved.expect("kept")))
    }

    /// Inference forward: the loss statistics only; keeps nothing for backward.
    pub fn evaluate(&self, batch: &Batch) -> Result<LossStats> {
        Ok(self.run_forward(batch, false)?.0)
    }

    /// Block `i`'s `h1 = x + GDN(x)`, and the layer's `Saved` when `keep`.
    fn gdn_forward(
        &self,
        i: usize,
        x: Act,
        b: usize,
        t: usize,
        keep: bool,
        cp: Option<&CpLayer>,
    ) -> Result<(Act, Option<Saved>)> {
        let layer = &self.layers[i];
        if let Some(cl) = cp {
            // This rank's rows of the batch of b sequences of t tokens.
            let seqs = Seqs::uniform(b, t);
            let (y, saved) = match x {
                Act::Host(x) => {
                    let xt = Tensor::from_vec(
                        &[x.len() / self.cfg.hidden_size(), self.cfg.hidden_size()],
                        x,
                    )?;
                    let (y, s) = cl.forward(&xt, &seqs)?;
                    (Act::Host(y.into_vec()), s.into_saved())
                }
                Act::Dev(x) => {
                    let (y, s) = cl.forward_dev(x, &seqs)?;
                    (Act::Dev(y), s.into_saved())
                }
            };
            let mut h1 = y;
            add::add_assign(&mut h1, &saved.x)?;
            return Ok((h1, Some(saved)));
        }
        match x {
            Act::Host(x) => {
                let xt = Tensor::from_vec(&[b, t, self.cfg.hidden_size()], x)?;
                let (y, saved) = if keep {
                    let (y, s) = layer.forward(&xt)?;
                    (y, Some(s))
                } else {
                    (layer.forward_inference(&xt)?, None)
                };
                let mut h1 = Act::Host(xt.into_vec());
                add::add_assign(&mut h1, &Act::Host(y.into_vec()))?;
                Ok((h1, saved))
            }
            Act::Dev(x) => {
                // The layer keeps its input in `Saved`; the residual reads it there.
                let (y, saved) = layer.forward_dev(x, &Seqs::uniform(b, t))?;
                let mut h1 = Act::Dev(y);
                add::add_assign(&mut h1, &saved.x)?;
                Ok((h1, keep.then_some(saved)))
            }
        }
    }

    /// The model, top to bottom.
    fn run_forward(&self, batch: &Batch, keep: bool) -> Result<(LossStats, Option<ModelSaved>)> {
        self.check_batch(batch)?;
        // Context parallelism (training only): this rank's rows of every sequence.
        let cp = self.cp.as_ref().filter(|_| keep);
        let global_count = batch.targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let local;
        let (batch, cp_layers) = match cp {
            None => (batch, Vec::new()),
            Some(comm) => {
                let seqs = Seqs::uniform(batch.batch, batch.seq_len);
                crate::dist::cp::check_seqs(&seqs, comm.size())?;
                let rows = crate::dist::cp::local_rows(&seqs, comm.size(), comm.rank());
                let pick = |v: &[u32]| {
                    rows.iter()
                        .flat_map(|r| v[r.clone()].iter().copied())
                        .collect::<Vec<u32>>()
                };
                let targets: Vec<i32> = rows
                    .iter()
                    .flat_map(|r| batch.targets[r.clone()].iter().copied())
                    .collect();
                local = Batch {
                    tokens: pick(&batch.tokens),
                    targets,
                    batch: batch.batch,
                    seq_len: batch.seq_len,
                };
                let layers = self
                    .layers
                    .iter()
                    .map(|l| CpLayer::new(l.clone(), comm.clone()))
                    .collect::<Result<Vec<_>>>()?;
                (&local, layers)
            }
        };
        let c = &self.cfg;
        let (b, t) = (batch.batch, batch.seq_len);
        let n = batch.tokens.len();
        let (h, f, vsz) = (c.hidden_size(), c.ffn_hidden_size, c.vocab_size);
        let (kind, eps, zc) = (
            c.layer.normalization,
            c.layer.layernorm_epsilon,
            c.layer.layernorm_zero_centered_gamma,
        );
        // Token ids and targets where the model runs (one upload each on a GPU).
        let (tok_dev, tgt_dev) = match &self.dev {
            None => (None, None),
            Some(d) => (
                Some(d.gpu.upload(&batch.tokens)?),
                Some(DevIds(d.gpu.upload(&batch.targets)?)),
            ),
        };
        let ids = tok_dev.as_ref().map_or(Ids::Host(&batch.tokens), Ids::Dev);
        // Embedding.
        let mut x = embedding::forward(ids, self.wp(EMBEDDING), vsz, h, self.dtype())?;
        drop(tok_dev);
        let mut blocks = Vec::new();
        for i in 0..self.layers.len() {
            // x = x + GDN(x)
            let (h1, gdn_saved) = self.gdn_forward(i, x, b, t, keep, cp_layers.get(i))?;
            // x = x + fc2(swiglu(fc1(norm(x))))
            let p = format!("decoder.layers.{i}.mlp.");
            let (nw, nb) = (
                format!("{p}linear_fc1.layer_norm_weight"),
                format!("{p}linear_fc1.layer_norm_bias"),
            );
            let (w1, w2) = (
                format!("{p}linear_fc1.weight"),
                format!("{p}linear_fc2.weight"),
            );
            let (hn, stats) =
                norm::forward(&h1, n, h, self.wp(&nw), self.wp_opt(&nb), kind, eps, zc)?;
            let u = linear::forward(&hn, n, h, self.wp(&w1), self.wb(&w1), 2 * f)?;
            drop(hn);
            let a = swiglu::forward(&u, n, f)?;
            let mut out = linear::forward(&a, n, f, self.wp(&w2), self.wb(&w2), h)?;
            drop(a);
            add::add_assign(&mut out, &h1)?;
            if let Some(gdn) = gdn_saved {
                let mlp = (!c.recompute_mlp()).then_some(MlpActs { stats, u });
                blocks.push(BlockSaved { gdn, h1, mlp });
            }
            x = out;
        }
        // Final norm, LM head, loss.
        let (xf, fstats) = norm::forward(
            &x,
            n,
            h,
            self.wp("decoder.final_layernorm.weight"),
            self.wp_opt("decoder.final_layernorm.bias"),
            kind,
            eps,
            zc,
        )?;
        let head = self.head_name();
        let logits = linear::forward(&xf, n, h, self.wp(head), self.wb(head), vsz)?;
        drop(xf);
        let tg = tgt_dev
            .as_ref()
            .map_or(Ids::Host(&batch.targets), |t| Ids::Dev(&t.0));
        let (st, probs) = cross_entropy::forward(&logits, n, vsz, tg, keep)?;
        drop(logits);
        // Under CP: the whole batch's statistics (every rank's, added in rank order) and the
        // loss's mean over the whole batch's targets.
        let (st, count) = match cp {
            None => (st, st.count),
            Some(comm) => {
                let mut all = LossStats::default();
                for s in loss::gather_stats(comm.as_ref(), &[st])? {
                    all.add(&s);
                }
                (all, global_count)
            }
        };
        let saved = probs.map(|probs| ModelSaved {
            batch: b,
            seq_len: t,
            rows: n,
            cp_layers,
            tokens: batch.tokens.clone(),
            targets: batch.targets.clone(),
            targets_dev: tgt_dev,
            count,
            blocks,
            head: HeadSaved {
                x,
                stats: fstats,
                probs,
            },
        });
        Ok((st, saved))
    }

    /// Backward of the mean loss over the batch's target rows: consumes what forward kept and
    /// returns every parameter's gradient, in [`param_specs`] order, on the host (a GPU model
    /// downloads them; training on a GPU uses [`backward_into_grads`](Self::backward_into_grads)).
    pub fn backward(&self, saved: ModelSaved) -> Result<ModelGrads> {
        let g = self.run_backward(saved)?;
        let entries = g
            .into_iter()
            .zip(param_specs(&self.cfg))
            .map(|((n, v), (want, shape))| {
                check_grad_name(&n, &want)?;
                Ok((n, Tensor::from_vec(&shape, v.into_host()?)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Params::from_entries(entries))
    }

    /// GPU training backward: the gradients become the model's fp32 gradient buffers (one per
    /// parameter, [`param_specs`] order; each step's buffers replace the last step's, no copy);
    /// nothing is copied to the host.
    pub fn backward_into_grads(&mut self, saved: ModelSaved) -> Result<()> {
        if self.dev.is_none() {
            return Err(GdnError::Invalid(
                "backward_into_grads: the model runs on the CPU (use backward)".into(),
            ));
        }
        let g = self.run_backward(saved)?;
        let specs = param_specs(&self.cfg);
        let d = self.dev.as_mut().expect("checked");
        for (((name, src), dst), (want, _)) in g.into_iter().zip(d.grads.iter_mut()).zip(&specs) {
            check_grad_name(&name, want)?;
            let F32s::Dev(src) = src else {
                return Err(crate::backend::mixed("model gradients"));
            };
            crate::backend::launch::check_g("gradient", &src, dst.len())?;
            crate::backend::launch::check_gpu("gradient", dst.gpu(), src.gpu())?;
            // The freshly computed buffer becomes the parameter's gradient buffer (no copy);
            // the previous one goes back to the stream's pool for the next step's backward.
            *dst = src;
        }
        Ok(())
    }

    /// The gradient buffers of a GPU model (after
    /// [`backward_into_grads`](Self::backward_into_grads)), [`param_specs`] order.
    pub fn device_grads(&self) -> Option<&[GBuf<f32>]> {
        self.dev.as_ref().map(|d| d.grads.as_slice())
    }

    /// The persistent gradient buffers, mutably (data parallelism sums micro-batches and ranks
    /// into them; lengths must not change).
    pub(crate) fn device_grads_mut(&mut self) -> Option<&mut [GBuf<f32>]> {
        self.dev.as_mut().map(|d| d.grads.as_mut_slice())
    }

    /// Block `i`'s layer backward: `dh1` is the gradient at `h1 = x + GDN(x)`; returns the
    /// gradient at `x` (`dh1 + d(layer input)`) and the layer's parameter gradients.
    fn gdn_backward(
        &self,
        i: usize,
        saved: Saved,
        dh1: Act,
        b: usize,
        t: usize,
        cp: Option<&CpLayer>,
    ) -> Result<(Act, Vec<(String, F32s)>)> {
        let pre = gdn_prefix(i);
        if let Some(cl) = cp {
            let shape = saved.x_shape.clone();
            let saved = CpSaved::from_saved(saved);
            return match dh1 {
                Act::Host(dh1) => {
                    let dh1t = Tensor::from_vec(&shape, dh1)?;
                    let (dxl, lg) = cl.backward(saved, &dh1t)?;
                    let mut dx = Act::Host(dh1t.into_vec());
                    add::add_assign(&mut dx, &Act::Host(dxl.into_vec()))?;
                    let g = lg
                        .iter()
                        .map(|(n, t)| (format!("{pre}{n}"), F32s::Host(t.data().to_vec())))
                        .collect();
                    Ok((dx, g))
                }
                Act::Dev(dh1) => {
                    let (dxl, lg) = cl.backward_dev(saved, dh1.try_clone()?)?;
                    let mut dx = Act::Dev(dh1);
                    add::add_assign(&mut dx, &Act::Dev(dxl))?;
                    let g = lg
                        .into_entries()
                        .into_iter()
                        .map(|(n, _, b)| (format!("{pre}{n}"), F32s::Dev(b)))
                        .collect();
                    Ok((dx, g))
                }
            };
        }
        match dh1 {
            Act::Host(dh1) => {
                let dh1t = Tensor::from_vec(&[b, t, self.cfg.hidden_size()], dh1)?;
                let (dxl, lg) = self.layers[i].backward(saved, &dh1t)?;
                let mut dx = Act::Host(dh1t.into_vec());
                add::add_assign(&mut dx, &Act::Host(dxl.into_vec()))?;
                let g = lg
                    .iter()
                    .map(|(n, t)| (format!("{pre}{n}"), F32s::Host(t.data().to_vec())))
                    .collect();
                Ok((dx, g))
            }
            Act::Dev(dh1) => {
                let (dxl, lg) = self.layers[i].backward_dev(saved, dh1.try_clone()?)?;
                let mut dx = Act::Dev(dh1);
                add::add_assign(&mut dx, &Act::Dev(dxl))?;
                let g = lg
                    .into_entries()
                    .into_iter()
                    .map(|(n, _, b)| (format!("{pre}{n}"), F32s::Dev(b)))
                    .collect();
                Ok((dx, g))
            }
        }
    }

    /// The model, bottom to top: every gradient, in [`param_specs`] order, where the model runs.
    fn run_backward(&self, saved: ModelSaved) -> Result<Vec<(String, F32s)>> {
        let c = &self.cfg;
        if saved.blocks.len() != self.layers.len() {
            return Err(GdnError::Invalid(format!(
                "saved state of {} blocks for a model of {}",
                saved.blocks.len(),
                self.layers.len()
            )));
        }
        let on_gpu = matches!(saved.head.x, Act::Dev(_));
        let on_cp = !saved.cp_layers.is_empty();
        if on_gpu != self.dev.is_some() {
            return Err(GdnError::Invalid(
                "backward: the saved state comes from a forward on another device".into(),
            ));
        }
        let ModelSaved {
            batch: b,
            seq_len: t,
            rows: n,
            cp_layers,
            tokens,
            targets,
            targets_dev,
            count,
            blocks,
            head,
        } = saved;
        let (h, f, vsz) = (c.hidden_size(), c.ffn_hidden_size, c.vocab_size);
        let (kind, eps, zc) = (
            c.layer.normalization,
            c.layer.layernorm_epsilon,
            c.layer.layernorm_zero_centered_gamma,
        );

        // Loss and LM head; the final norm's output is rebuilt from its input (same kernel,
        // same bits as forward).
        let tg = targets_dev
            .as_ref()
            .map_or(Ids::Host(&targets), |t| Ids::Dev(&t.0));
        let dlogits = cross_entropy::backward(&head.probs, n, vsz, tg, count)?;
        drop(head.probs);
        drop(targets_dev);
        let (fw, fb) = (
            self.wp("decoder.final_layernorm.weight"),
            self.wp_opt("decoder.final_layernorm.bias"),
        );
        let (xf, _) = norm::forward(&head.x, n, h, fw, fb, kind, eps, zc)?;
        let hn = self.head_name();
        let (dxf, dw_head) = linear::backward(&xf, n, h, self.wp(hn), self.wb(hn), vsz, &dlogits)?;
        drop((xf, dlogits));
        let (mut dx, dfw, dfb) = norm::backward(&head.x, n, h, fw, kind, zc, &head.stats, &dxf)?;
        drop(dxf);
        let mut tail = vec![("decoder.final_layernorm.weight".to_string(), dfw)];
        if let Some(db) = dfb {
            tail.push(("decoder.final_layernorm.bias".into(), db));
        }

        // Blocks, last to first.
        let mut block_grads: Vec<Vec<(String, F32s)>> = Vec::with_capacity(blocks.len());
        for (i, bs) in blocks.into_iter().enumerate().rev() {
            let p = format!("decoder.layers.{i}.mlp.");
            let (nwn, nbn) = (
                format!("{p}linear_fc1.layer_norm_weight"),
                format!("{p}linear_fc1.layer_norm_bias"),
            );
            let (w1n, w2n) = (
                format!("{p}linear_fc1.weight"),
                format!("{p}linear_fc2.weight"),
            );
            let (nw, nb) = (self.wp(&nwn), self.wp_opt(&nbn));
            let (w1, w1b, w2, w2b) = (self.wp(&w1n), self.wb(&w1n), self.wp(&w2n), self.wb(&w2n));
            let BlockSaved { gdn, h1, mlp } = bs;
            // MLP: rebuild norm(h1) (and, under `mlp` recompute, the stats and fc1's output).
            let (hn, stats) = norm::forward(&h1, n, h, nw, nb, kind, eps, zc)?;
            let (stats, u) = match mlp {
                Some(a) => (a.stats, a.u),
                None => {
                    let u = linear::forward(&hn, n, h, w1, w1b, 2 * f)?;
                    (stats, u)
                }
            };
            let a = swiglu::forward(&u, n, f)?;
            let (da, dw2) = linear::backward(&a, n, f, w2, w2b, h, &dx)?;
            drop(a);
            let du = swiglu::backward(&u, n, f, &da)?;
            drop((u, da));
            let (dhn, dw1) = linear::backward(&hn, n, h, w1, w1b, 2 * f, &du)?;
            drop((hn, du));
            let (dh1, dnw, dnb) = norm::backward(&h1, n, h, nw, kind, zc, &stats, &dhn)?;
            drop((h1, dhn));
            // The residual: d h1 = d out + d(MLP input).
            add::add_assign(&mut dx, &dh1)?;
            drop(dh1);
            // GDN: d x = d h1 + d(layer input).
            let (dxn, mut bg) = self.gdn_backward(i, gdn, dx, b, t, cp_layers.get(i))?;
            dx = dxn;
            bg.push((nwn, dnw));
            if let Some(db) = dnb {
                bg.push((nbn, db));
            }
            bg.push((w1n, dw1));
            bg.push((w2n, dw2));
            block_grads.push(bg);
        }

        // Embedding: the head's gradient when tied, plus each token's rows, in token order.
        let tied = c.share_embeddings_and_output_weights;
        let (mut de, dw_head) = if tied {
            (dw_head, None)
        } else {
            let z = match &dx {
                Act::Host(_) => F32s::Host(vec![0.0f32; vsz * h]),
                Act::Dev(d) => F32s::Dev(d.gpu().uninit(vsz * h)?),
            };
            (z, Some(dw_head))
        };
        let de_mut = match &mut de {
            F32s::Host(v) => PMut::Host(v),
            F32s::Dev(g) => PMut::Dev(g),
        };
        embedding::backward(&tokens, &dx, vsz, h, de_mut, tied)?;
        drop(dx);
        let mut g: Vec<(String, F32s)> = vec![(EMBEDDING.into(), de)];
        for bg in block_grads.into_iter().rev() {
            g.extend(bg);
        }
        g.extend(tail);
        if let Some(dw) = dw_head {
            g.push((OUTPUT_LAYER.into(), dw));
        }
        drop(cp_layers);
        if let Some(comm) = &self.cp {
            if on_cp {
                // The model's own gradients are sums over this rank's rows: add the ranks' in
                // rank order (the GDN layers' came back whole from their CpLayer).
                for (name, v) in g.iter_mut() {
                    if !name.contains(".self_attention.") {
                        crate::dist::all_reduce_sum_f32(comm.as_ref(), v)?;
                    }
                }
            }
        }
        Ok(g)
    }

    /// Sums of squares of the gradient buffers of a GPU model (f64, [`param_specs`] order; one
    /// download): the global gradient norm is the square root of their sum in order.
    pub fn grad_sum_squares(&self) -> Result<Vec<f64>> {
        let d = self.dev.as_ref().ok_or_else(|| {
            GdnError::Invalid("grad_sum_squares: the model runs on the CPU".into())
        })?;
        let ps: Vec<P> = d.grads.iter().map(P::Dev).collect();
        adamw::sum_squares(&ps)
    }

    /// One AdamW update of every parameter of a GPU model from its gradient buffers, with the
    /// moments `moments` (`(exp_avg, exp_avg_sq)` per parameter, [`param_specs`] order) and the
    /// scalars `hyper(shape)` of each parameter; then the bf16 copies are remade.
    pub fn adamw_step_on_device(
        &mut self,
        moments: &mut [(GBuf<f32>, GBuf<f32>)],
        hyper: impl Fn(&[usize]) -> adamw::Hyper,
    ) -> Result<()> {
        let specs = param_specs(&self.cfg);
        let own_names: Vec<String> = self.own.iter().map(|(n, _)| n.to_string()).collect();
        let Model {
            cfg, layers, dev, ..
        } = self;
        let d = dev.as_mut().ok_or_else(|| {
            GdnError::Invalid("adamw_step_on_device: the model runs on the CPU".into())
        })?;
        if moments.len() != specs.len() {
            return Err(GdnError::Invalid(format!(
                "optimizer: {} moment pairs for {} parameters",
                moments.len(),
                specs.len()
            )));
        }
        let mut params: Vec<(String, &mut GBuf<f32>)> = Vec::with_capacity(specs.len());
        let mut own = own_names.iter().cloned().zip(d.own.iter_mut());
        params.push(own.next().expect("embedding"));
        for (i, l) in layers.iter_mut().enumerate() {
            params.extend(
                l.dev_params_mut()?
                    .into_iter()
                    .map(|(n, b)| (format!("{}{n}", gdn_prefix(i)), b)),
            );
            for _ in 0..mlp_specs(cfg, i).len() {
                params.push(own.next().expect("mlp parameter"));
            }
        }
        params.extend(own);
        if params.len() != specs.len() {
            return Err(GdnError::Invalid(format!(
                "optimizer: {} device parameters for {} parameters",
                params.len(),
                specs.len()
            )));
        }
        for ((((pname, p), (m, v)), g), (name, shape)) in params
            .into_iter()
            .zip(moments.iter_mut())
            .zip(&d.grads)
            .zip(&specs)
        {
            check_grad_name(&pname, name)?;
            let n: usize = shape.iter().product();
            if p.len() != n {
                return Err(GdnError::Invalid(format!(
                    "optimizer: parameter {name} has {} values, expected {n}",
                    p.len()
                )));
            }
            adamw::step(
                PMut::Dev(p),
                PMut::Dev(m),
                PMut::Dev(v),
                P::Dev(g),
                &hyper(shape),
            )?;
        }
        self.refresh_bf16()
    }
}

/// Error unless the gradient (or parameter) `got` is the parameter `want` of [`param_specs`] at
/// its position (an internal ordering error).
fn check_grad_name(got: &str, want: &str) -> Result<()> {
    if got != want {
        return Err(GdnError::Invalid(format!(
            "internal error: gradient {got} where {want} was expected (parameter order)"
        )));
    }
    Ok(())
}

/// Check that `p` holds exactly the parameters of `cfg` with their shapes; errors name the
/// tensor and `source`.
pub fn check_params(cfg: &ModelConfig, p: &Params, source: &str) -> Result<()> {
    let specs = param_specs(cfg);
    for (name, shape) in &specs {
        match p.get(name) {
            None => {
                return Err(GdnError::File {
                    path: source.into(),
                    msg: format!("missing tensor {name} (shape {shape:?})"),
                })
            }
            Some(t) if t.shape() != shape.as_slice() => {
                return Err(GdnError::File {
                    path: source.into(),
                    msg: format!(
                        "tensor {name} has shape {:?}, expected {shape:?}",
                        t.shape()
                    ),
                })
            }
            _ => {}
        }
    }
    if let Some(extra) = p
        .names()
        .into_iter()
        .find(|n| !specs.iter().any(|(s, _)| s == n))
    {
        return Err(GdnError::File {
            path: source.into(),
            msg: format!("unexpected tensor {extra}: not a parameter of this model config"),
        });
    }
    Ok(())
}
