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
//! needs: each block's layer [`Saved`](crate::Saved) (the layer's recompute options apply per
//! block), the MLP's kept activations, and the head's. `ModelSaved::bytes()` is the model's
//! activation memory to the byte. `backward` consumes it and returns the gradient of the mean
//! loss for every parameter, under the parameter's name.
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

pub use config::ModelConfig;
pub use loss::{LossStats, IGNORE_INDEX};
pub use saved::ModelSaved;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::config::Normalization;
use crate::error::{GdnError, Result};
use crate::layer::{param_specs as layer_param_specs, GatedDeltaNet, Params};
use crate::ops::{linear, norm};
use crate::tensor::Tensor;
use saved::{BlockSaved, HeadSaved, MlpActs};

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
/// final norm, head) by name.
#[derive(Clone, Debug)]
pub struct Model {
    cfg: ModelConfig,
    layers: Vec<GatedDeltaNet>,
    own: Params,
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

    /// Run the GDN layers on `device` with `dtype` activation storage (bf16 or f32 on a GPU);
    /// the embedding, MLPs and head stay on the CPU, so each block's layer input and output
    /// cross to the device and back.
    pub fn gdn_layers_to_device(
        &mut self,
        device: crate::Device,
        dtype: crate::backend::cuda::DType,
    ) -> Result<()> {
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

    fn w(&self, name: &str) -> &[f32] {
        self.own.d(name)
    }
    fn norm_bias(&self, prefix: &str) -> Option<&[f32]> {
        self.own.opt(prefix)
    }
    fn head_weight(&self) -> &[f32] {
        if self.cfg.share_embeddings_and_output_weights {
            self.w(EMBEDDING)
        } else {
            self.w(OUTPUT_LAYER)
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

    /// Training forward: the loss statistics of `batch` and what backward needs.
    pub fn forward(&self, batch: &Batch) -> Result<(LossStats, ModelSaved)> {
        let (st, saved) = self.run_forward(batch, true)?;
        Ok((st, saved.expect("kept")))
    }

    /// Inference forward: the loss statistics only; keeps nothing for backward.
    pub fn evaluate(&self, batch: &Batch) -> Result<LossStats> {
        Ok(self.run_forward(batch, false)?.0)
    }

    /// Embedding lookup `[n, h]`.
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.cfg.hidden_size();
        let e = self.w(EMBEDDING);
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            let t = t as usize;
            x.extend_from_slice(&e[t * h..(t + 1) * h]);
        }
        x
    }

    /// The model, top to bottom.
    fn run_forward(&self, batch: &Batch, keep: bool) -> Result<(LossStats, Option<ModelSaved>)> {
        self.check_batch(batch)?;
        let c = &self.cfg;
        let (b, t) = (batch.batch, batch.seq_len);
        let n = b * t;
        let (h, f, vsz) = (c.hidden_size(), c.ffn_hidden_size, c.vocab_size);
        let (kind, eps, zc) = (
            c.layer.normalization,
            c.layer.layernorm_epsilon,
            c.layer.layernorm_zero_centered_gamma,
        );
        // Embedding.
        let mut x = self.embed(&batch.tokens);
        let mut blocks = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            // x = x + GDN(x)
            let xt = Tensor::from_vec(&[b, t, h], x)?;
            let (y, gdn_saved) = if keep {
                let (y, s) = layer.forward(&xt)?;
                (y, Some(s))
            } else {
                (layer.forward_inference(&xt)?, None)
            };
            let mut h1 = xt.into_vec();
            for (a, yv) in h1.iter_mut().zip(y.data()) {
                *a += yv;
            }
            // x = x + fc2(swiglu(fc1(norm(x))))
            let p = format!("decoder.layers.{i}.mlp.");
            let (hn, stats) = norm::cpu::forward(
                &h1,
                n,
                h,
                self.w(&format!("{p}linear_fc1.layer_norm_weight")),
                self.norm_bias(&format!("{p}linear_fc1.layer_norm_bias")),
                kind,
                eps,
                zc,
            )?;
            let u =
                linear::cpu::forward(&hn, n, h, self.w(&format!("{p}linear_fc1.weight")), 2 * f)?;
            drop(hn);
            let a = swiglu::swiglu_forward(&u, n, f);
            let mut out =
                linear::cpu::forward(&a, n, f, self.w(&format!("{p}linear_fc2.weight")), h)?;
            drop(a);
            for (o, r) in out.iter_mut().zip(&h1) {
                *o += r;
            }
            if let Some(gdn) = gdn_saved {
                let mlp = (!c.recompute_mlp()).then_some(MlpActs { stats, u });
                blocks.push(BlockSaved { gdn, h1, mlp });
            }
            x = out;
        }
        // Final norm, LM head, loss.
        let (xf, fstats) = norm::cpu::forward(
            &x,
            n,
            h,
            self.w("decoder.final_layernorm.weight"),
            self.norm_bias("decoder.final_layernorm.bias"),
            kind,
            eps,
            zc,
        )?;
        let logits = linear::cpu::forward(&xf, n, h, self.head_weight(), vsz)?;
        drop(xf);
        let (st, probs) = loss::cross_entropy_forward(&logits, n, vsz, &batch.targets, keep)?;
        let saved = probs.map(|probs| ModelSaved {
            batch: b,
            seq_len: t,
            tokens: batch.tokens.clone(),
            targets: batch.targets.clone(),
            count: st.count,
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
    /// returns every parameter's gradient, in [`param_specs`] order.
    pub fn backward(&self, saved: ModelSaved) -> Result<ModelGrads> {
        let c = &self.cfg;
        if saved.blocks.len() != self.layers.len() {
            return Err(GdnError::Invalid(format!(
                "saved state of {} blocks for a model of {}",
                saved.blocks.len(),
                self.layers.len()
            )));
        }
        let ModelSaved {
            batch: b,
            seq_len: t,
            tokens,
            targets,
            count,
            blocks,
            head,
        } = saved;
        let n = b * t;
        let (h, f, vsz) = (c.hidden_size(), c.ffn_hidden_size, c.vocab_size);
        let (kind, eps, zc) = (
            c.layer.normalization,
            c.layer.layernorm_epsilon,
            c.layer.layernorm_zero_centered_gamma,
        );
        let mut g: Vec<(String, Tensor)> = Vec::new();

        // Loss and LM head; the final norm's output is rebuilt from its input (same kernel,
        // same bits as forward).
        let dlogits = loss::cross_entropy_backward(&head.probs, n, vsz, &targets, count)?;
        drop(head.probs);
        let (xf, _) = norm::cpu::forward(
            &head.x,
            n,
            h,
            self.w("decoder.final_layernorm.weight"),
            self.norm_bias("decoder.final_layernorm.bias"),
            kind,
            eps,
            zc,
        )?;
        let (dxf, dw_head) = linear::cpu::backward(&xf, n, h, self.head_weight(), vsz, &dlogits)?;
        drop((xf, dlogits));
        let (mut dx, dfw, dfb) = norm::cpu::backward(
            &head.x,
            n,
            h,
            self.w("decoder.final_layernorm.weight"),
            kind,
            zc,
            &head.stats,
            &dxf,
        )?;
        drop(dxf);
        let mut tail = vec![(
            "decoder.final_layernorm.weight".to_string(),
            Tensor::from_vec(&[h], dfw)?,
        )];
        if let Some(db) = dfb {
            tail.push((
                "decoder.final_layernorm.bias".into(),
                Tensor::from_vec(&[h], db)?,
            ));
        }

        // Blocks, last to first.
        let mut block_grads: Vec<Vec<(String, Tensor)>> = Vec::with_capacity(blocks.len());
        for (i, bs) in blocks.into_iter().enumerate().rev() {
            let p = format!("decoder.layers.{i}.mlp.");
            let nw = self.w(&format!("{p}linear_fc1.layer_norm_weight"));
            let nb = self.norm_bias(&format!("{p}linear_fc1.layer_norm_bias"));
            let w1 = self.w(&format!("{p}linear_fc1.weight"));
            let w2 = self.w(&format!("{p}linear_fc2.weight"));
            let BlockSaved { gdn, h1, mlp } = bs;
            // MLP: rebuild norm(h1) (and, under `mlp` recompute, the stats and fc1's output).
            let (hn, stats) = norm::cpu::forward(&h1, n, h, nw, nb, kind, eps, zc)?;
            let (stats, u) = match mlp {
                Some(a) => (a.stats, a.u),
                None => {
                    let u = linear::cpu::forward(&hn, n, h, w1, 2 * f)?;
                    (stats, u)
                }
            };
            let a = swiglu::swiglu_forward(&u, n, f);
            let (da, dw2) = linear::cpu::backward(&a, n, f, w2, h, &dx)?;
            drop(a);
            let du = swiglu::swiglu_backward(&u, n, f, &da);
            drop((u, da));
            let (dhn, dw1) = linear::cpu::backward(&hn, n, h, w1, 2 * f, &du)?;
            drop((hn, du));
            let (dh1, dnw, dnb) = norm::cpu::backward(&h1, n, h, nw, kind, zc, &stats, &dhn)?;
            drop((h1, dhn));
            // The residual: d h1 = d out + d(MLP input).
            for (a, d) in dx.iter_mut().zip(&dh1) {
                *a += d;
            }
            drop(dh1);
            // GDN: d x = d h1 + d(layer input).
            let dh1t = Tensor::from_vec(&[b, t, h], dx)?;
            let (dxl, lg) = self.layers[i].backward(gdn, &dh1t)?;
            dx = dh1t.into_vec();
            for (a, d) in dx.iter_mut().zip(dxl.data()) {
                *a += d;
            }
            let mut bg: Vec<(String, Tensor)> = lg
                .iter()
                .map(|(n, t)| (format!("{}{n}", gdn_prefix(i)), t.clone()))
                .collect();
            bg.push((
                format!("{p}linear_fc1.layer_norm_weight"),
                Tensor::from_vec(&[h], dnw)?,
            ));
            if let Some(db) = dnb {
                bg.push((
                    format!("{p}linear_fc1.layer_norm_bias"),
                    Tensor::from_vec(&[h], db)?,
                ));
            }
            bg.push((
                format!("{p}linear_fc1.weight"),
                Tensor::from_vec(&[2 * f, h], dw1)?,
            ));
            bg.push((
                format!("{p}linear_fc2.weight"),
                Tensor::from_vec(&[h, f], dw2)?,
            ));
            block_grads.push(bg);
        }

        // Embedding: the head's gradient when tied, plus each token's row, in token order.
        let mut de = if c.share_embeddings_and_output_weights {
            dw_head.clone()
        } else {
            vec![0.0f32; vsz * h]
        };
        for (r, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            for (a, d) in de[tok * h..(tok + 1) * h]
                .iter_mut()
                .zip(&dx[r * h..(r + 1) * h])
            {
                *a += d;
            }
        }
        g.push((EMBEDDING.into(), Tensor::from_vec(&[vsz, h], de)?));
        for bg in block_grads.into_iter().rev() {
            g.extend(bg);
        }
        g.extend(tail);
        if !c.share_embeddings_and_output_weights {
            g.push((OUTPUT_LAYER.into(), Tensor::from_vec(&[vsz, h], dw_head)?));
        }
        Ok(Params::from_entries(g))
    }
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
