//! `RunConfig`: everything a training run needs, as one TOML document (`run.toml`).
//!
//! ```toml
//! [model]        # the GDN layer's fields (GdnConfig, Megatron's names) plus the model's own
//! hidden_size = 64
//! num_layers = 2
//! ffn_hidden_size = 256
//! share_embeddings_and_output_weights = true
//! linear_num_key_heads = 2
//! # ... any GdnConfig field: variant, recompute_granularity, recompute_modules, ...
//!
//! [data]
//! kind = "mqar"          # or "text" with path = "file.txt"
//! seq_length = 64
//! batch_size = 32
//!
//! [optimizer]
//! lr = 3e-3
//!
//! [train]
//! train_iters = 1000
//! ```
//!
//! A document only names what it changes: every missing key takes the built-in default
//! ([`RunConfig::default`], the `gdn train` default run), not Megatron's layer defaults. Unknown
//! sections and keys are errors naming them.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{
    check_toml_int, from_table_naming_key, to_toml_text, toml_syntax_error, GdnConfig,
    Normalization,
};
use crate::error::{GdnError, Result};
use crate::model::ModelConfig;

/// The model's own fields besides the layer's (the vocabulary comes from the data).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSection {
    /// `F`, the SwiGLU MLP's hidden width.
    pub ffn_hidden_size: usize,
    /// Tie the LM head to the embedding.
    pub share_embeddings_and_output_weights: bool,
    /// Every GDN layer field (width, depth, heads, norms, recompute, variant, ...).
    pub layer: GdnConfig,
}

/// Which data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Multi-query associative recall, generated from `seed`.
    Mqar,
    /// Byte-level language modelling on the text file at `path` (vocab 256; the last 10% held
    /// out).
    Text,
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `"mqar"` or `"text"`.
    pub kind: DataKind,
    /// The text file (`kind = "text"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// `T`, tokens per sequence.
    #[serde(serialize_with = "crate::config::int")]
    pub seq_length: usize,
    /// `B`, sequences per step (and per evaluation batch).
    #[serde(serialize_with = "crate::config::int")]
    pub batch_size: usize,
    /// Seed of the data: every training batch is a function of this seed and the step, and the
    /// held-out set of this seed alone.
    #[serde(serialize_with = "crate::config::int")]
    pub seed: u64,
    /// Held-out sequences evaluated (text: at most what the held-out 10% holds).
    #[serde(serialize_with = "crate::config::int")]
    pub eval_sequences: usize,
    /// MQAR: key-value pairs at the start of each sequence.
    #[serde(serialize_with = "crate::config::int")]
    pub num_kv_pairs: usize,
    /// MQAR: keys are token ids `[0, key_vocab_size)`, distinct within a sequence.
    #[serde(serialize_with = "crate::config::int")]
    pub key_vocab_size: usize,
    /// MQAR: values are token ids `[key_vocab_size, key_vocab_size + value_vocab_size)`.
    #[serde(serialize_with = "crate::config::int")]
    pub value_vocab_size: usize,
}

/// Learning-rate decay after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayStyle {
    /// Half a cosine from `lr` to `min_lr`.
    Cosine,
    /// Straight line from `lr` to `min_lr`.
    Linear,
    /// Stay at `lr`.
    Constant,
}

/// `[optimizer]`: AdamW with Megatron's names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the decay.
    pub min_lr: f64,
    /// Linear warmup from 0 over this many steps.
    #[serde(serialize_with = "crate::config::int")]
    pub lr_warmup_iters: u64,
    /// Steps until `min_lr` is reached (default: `train_iters`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(serialize_with = "crate::config::opt_int")]
    pub lr_decay_iters: Option<u64>,
    /// `"cosine"`, `"linear"` or `"constant"`.
    pub lr_decay_style: DecayStyle,
    /// Decoupled weight decay (AdamW), applied to parameters of two or more dimensions only
    /// (no decay on norm weights, biases, `A_log`, `dt_bias`: Megatron's rule).
    pub weight_decay: f64,
    /// Adam's beta1.
    pub adam_beta1: f64,
    /// Adam's beta2.
    pub adam_beta2: f64,
    /// Adam's epsilon.
    pub adam_eps: f64,
    /// Clip the gradients' global L2 norm to this (0: no clipping).
    pub clip_grad: f64,
}

/// `[train]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps of the run.
    #[serde(serialize_with = "crate::config::int")]
    pub train_iters: u64,
    /// Seed of the model's initialization.
    #[serde(serialize_with = "crate::config::int")]
    pub seed: u64,
    /// Training metrics every this many steps (the loss and accuracy averaged over them).
    #[serde(serialize_with = "crate::config::int")]
    pub log_interval: u64,
    /// Held-out evaluation every this many steps, and at the end (0: only at the end).
    #[serde(serialize_with = "crate::config::int")]
    pub eval_interval: u64,
    /// Checkpoint every this many steps, and at the end (0: only at the end).
    #[serde(serialize_with = "crate::config::int")]
    pub save_interval: u64,
}

/// A whole run.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RunConfig {
    pub model: ModelSection,
    pub data: DataConfig,
    pub optimizer: OptimizerConfig,
    pub train: TrainConfig,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            ffn_hidden_size: 256,
            share_embeddings_and_output_weights: true,
            layer: GdnConfig {
                hidden_size: 64,
                num_layers: 2,
                linear_num_key_heads: 2,
                linear_num_value_heads: 4,
                linear_key_head_dim: 32,
                linear_value_head_dim: 32,
                // Width 2: the conv mixes each token with the one before it only, which is the
                // shift MQAR needs (a value's key is the token before it).
                linear_conv_kernel_dim: 2,
                // Slow decay at init, so the state holds the whole sequence from the first step
                // (with A = U(1, 16) and dt_bias = 1 it keeps about exp(-1.3 A) per token).
                a_init_range: (0.001, 0.01),
                normalization: Normalization::RMSNorm,
                ..GdnConfig::default()
            },
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            kind: DataKind::Mqar,
            path: None,
            seq_length: 64,
            batch_size: 32,
            seed: 1234,
            eval_sequences: 512,
            num_kv_pairs: 8,
            key_vocab_size: 64,
            value_vocab_size: 64,
        }
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            lr_warmup_iters: 50,
            lr_decay_iters: None,
            lr_decay_style: DecayStyle::Cosine,
            weight_decay: 0.1,
            adam_beta1: 0.9,
            adam_beta2: 0.95,
            adam_eps: 1e-8,
            clip_grad: 1.0,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            train_iters: 1000,
            seed: 0,
            log_interval: 10,
            eval_interval: 100,
            save_interval: 500,
        }
    }
}

/// The model section's own keys (the rest are the layer's).
const MODEL_KEYS: [&str; 2] = ["ffn_hidden_size", "share_embeddings_and_output_weights"];
const SECTIONS: [&str; 4] = ["model", "data", "optimizer", "train"];

fn cfg_err(field: &str, msg: impl Into<String>) -> GdnError {
    GdnError::Config {
        field: field.to_string(),
        msg: msg.into(),
    }
}

/// A config section as a TOML table. Its fields always serialize (integers through
/// [`crate::config::int`]); should that ever fail, the table holds the error under a key no
/// section accepts, so reading it back names the problem instead of this panicking.
fn to_table<T: Serialize>(v: &T) -> toml::Table {
    toml::Table::try_from(v).unwrap_or_else(|e| {
        let mut t = toml::Table::new();
        t.insert(
            "serialization_error".into(),
            toml::Value::String(e.to_string()),
        );
        t
    })
}

/// A TOML integer, or a string where `v` exceeds TOML's range (refused by `validate()`).
fn int_value(v: usize) -> toml::Value {
    i64::try_from(v).map_or_else(|_| toml::Value::String(v.to_string()), toml::Value::Integer)
}

/// Prefix a bare field name of a `[model]` error with `model.`.
fn in_model(e: GdnError) -> GdnError {
    match e {
        GdnError::Config { field, msg } if !field.contains('.') => GdnError::Config {
            field: format!("model.{field}"),
            msg,
        },
        e => e,
    }
}

impl ModelSection {
    fn to_table(&self) -> toml::Table {
        let mut t = to_table(&self.layer);
        t.insert("ffn_hidden_size".into(), int_value(self.ffn_hidden_size));
        t.insert(
            "share_embeddings_and_output_weights".into(),
            toml::Value::Boolean(self.share_embeddings_and_output_weights),
        );
        t
    }

    /// The section from `user`'s keys over `defaults` (a whole `[model]` table).
    fn from_tables(mut defaults: toml::Table, mut user: toml::Table) -> Result<Self> {
        let mut own = |k: &str| {
            let given = user.remove(k);
            let default = defaults.remove(k);
            given.or(default)
        };
        let ffn = own("ffn_hidden_size");
        let tie = own("share_embeddings_and_output_weights");
        let ffn_hidden_size = match ffn {
            Some(toml::Value::Integer(v)) if v > 0 => v as usize,
            Some(v) => {
                return Err(cfg_err(
                    "model.ffn_hidden_size",
                    format!("must be an integer > 0 (got {v})"),
                ))
            }
            None => unreachable!("defaults hold every key"),
        };
        let share = match tie {
            Some(toml::Value::Boolean(b)) => b,
            Some(v) => {
                return Err(cfg_err(
                    "model.share_embeddings_and_output_weights",
                    format!("must be true or false (got {v})"),
                ))
            }
            None => unreachable!("defaults hold every key"),
        };
        let layer: GdnConfig =
            from_table_naming_key("model.", &defaults, user).map_err(|e| match e {
                GdnError::Config { field, msg } if msg.contains("unknown field") => {
                    GdnError::Config {
                        field,
                        msg: format!(
                            "{msg} (the [model] section takes the GDN layer's fields and {})",
                            MODEL_KEYS.join(", ")
                        ),
                    }
                }
                e => e,
            })?;
        layer.validate().map_err(in_model)?;
        Ok(ModelSection {
            ffn_hidden_size,
            share_embeddings_and_output_weights: share,
            layer,
        })
    }
}

impl RunConfig {
    /// Parse a `run.toml` document over the defaults and validate it. Errors name the key
    /// (`section.key`), the value given and what was expected.
    pub fn from_toml_str(s: &str) -> Result<Self> {
        let user: toml::Table = toml::from_str(s).map_err(|e| toml_syntax_error(s, &e))?;
        let mut by_section: Vec<toml::Table> =
            SECTIONS.iter().map(|_| toml::Table::new()).collect();
        for (section, v) in user {
            let Some(i) = SECTIONS.iter().position(|s| *s == section) else {
                return Err(cfg_err(
                    &section,
                    format!(
                        "unknown section [{section}]; expected {}",
                        SECTIONS.map(|s| format!("[{s}]")).join(", ")
                    ),
                ));
            };
            let toml::Value::Table(keys) = v else {
                return Err(cfg_err(&section, "must be a table ([section])"));
            };
            by_section[i] = keys;
        }
        let mut defaults = RunConfig::default().to_table();
        let mut take = |name: &str| -> toml::Table {
            match defaults.remove(name) {
                Some(toml::Value::Table(t)) => t,
                _ => toml::Table::new(),
            }
        };
        let mut user = by_section.into_iter();
        let mut next = || user.next().unwrap_or_default();
        let model = ModelSection::from_tables(take("model"), next())?;
        let data: DataConfig = from_table_naming_key("data.", &take("data"), next())?;
        let optimizer: OptimizerConfig =
            from_table_naming_key("optimizer.", &take("optimizer"), next())?;
        let train: TrainConfig = from_table_naming_key("train.", &take("train"), next())?;
        let cfg = RunConfig {
            model,
            data,
            optimizer,
            train,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read and parse a `run.toml` file.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let s = crate::io::read_text(path)?;
        Self::from_toml_str(&s).map_err(|e| match e {
            GdnError::Config { field, msg } => GdnError::Config {
                field,
                msg: format!("{msg} (in {})", path.display()),
            },
            e => e,
        })
    }

    fn to_table(&self) -> toml::Table {
        let mut t = toml::Table::new();
        t.insert("model".into(), toml::Value::Table(self.model.to_table()));
        t.insert("data".into(), toml::Value::Table(to_table(&self.data)));
        t.insert(
            "optimizer".into(),
            toml::Value::Table(to_table(&self.optimizer)),
        );
        t.insert("train".into(), toml::Value::Table(to_table(&self.train)));
        t
    }

    /// The whole config as a `run.toml` document (every key, defaults included).
    pub fn to_toml_string(&self) -> String {
        let mut s = String::new();
        for name in SECTIONS {
            let t = self.to_table();
            let mut one = toml::Table::new();
            one.insert(name.into(), t[name].clone());
            s.push_str(&to_toml_text(&one));
            s.push('\n');
        }
        s
    }

    /// The model config, with the vocabulary of the data.
    pub fn model_config(&self, vocab_size: usize) -> ModelConfig {
        ModelConfig {
            vocab_size,
            ffn_hidden_size: self.model.ffn_hidden_size,
            share_embeddings_and_output_weights: self.model.share_embeddings_and_output_weights,
            layer: self.model.layer.clone(),
        }
    }

    /// Tokens of the vocabulary the data gives: `key_vocab_size + value_vocab_size` (MQAR) or
    /// 256 (bytes of text).
    pub fn vocab_size(&self) -> usize {
        match self.data.kind {
            DataKind::Mqar => self
                .data
                .key_vocab_size
                .saturating_add(self.data.value_vocab_size),
            DataKind::Text => 256,
        }
    }

    /// A lower bound of the bytes a run of this config allocates: parameters, their gradients
    /// and AdamW's two moments (4 x f32 per parameter); one batch's activations (per token and
    /// block at least the block's input, plus the largest of in_proj's output, `linear_fc1`'s
    /// output and the logits); the MQAR held-out set (tokens and targets, 8 bytes per token).
    pub fn memory_bytes_at_least(&self) -> u128 {
        use crate::budget::mul;
        let m = self.model_config(self.vocab_size());
        let l = &m.layer;
        let tokens = mul(self.data.batch_size as u128, self.data.seq_length as u128);
        let widest = (l.in_proj_dim() as u128)
            .max(mul(2, m.ffn_hidden_size as u128))
            .max(m.vocab_size as u128);
        let per_token = mul(l.num_layers as u128, l.hidden_size as u128).saturating_add(widest);
        let eval = match self.data.kind {
            DataKind::Mqar => mul(
                mul(
                    self.data.eval_sequences as u128,
                    self.data.seq_length as u128,
                ),
                8,
            ),
            DataKind::Text => 0,
        };
        mul(m.param_bytes(), 4)
            .saturating_add(mul(mul(tokens, per_token), 4))
            .saturating_add(eval)
    }

    /// Error (stating the bytes needed and available) when a run of this config cannot fit in
    /// this machine's memory ([`memory_bytes_at_least`](Self::memory_bytes_at_least) against
    /// [`crate::budget::check_host`]). Call before building the data and the model.
    pub fn check_memory(&self) -> Result<()> {
        let m = self.model_config(self.vocab_size());
        crate::budget::check_host(
            &format!(
                "training this config (at least: weights, gradients and AdamW moments of {} \
                 parameter values (vocab_size {}, hidden_size {}, ffn_hidden_size {}, num_layers {}), \
                 activations of a batch of {} x {} tokens, the held-out set)",
                m.param_count(),
                m.vocab_size,
                m.layer.hidden_size,
                m.ffn_hidden_size,
                m.layer.num_layers,
                self.data.batch_size,
                self.data.seq_length
            ),
            self.memory_bytes_at_least(),
        )
    }

    /// Steps over which the learning rate decays to `min_lr`.
    pub fn lr_decay_iters(&self) -> u64 {
        self.optimizer
            .lr_decay_iters
            .unwrap_or(self.train.train_iters)
    }

    /// Check every field; errors name the field (`section.key`).
    pub fn validate(&self) -> Result<()> {
        // Every integer must fit in TOML (the run directory's config.toml) before any
        // arithmetic on it.
        let (d, o, t) = (&self.data, &self.optimizer, &self.train);
        let ints: [(&str, u128); 15] = [
            ("model.ffn_hidden_size", self.model.ffn_hidden_size as u128),
            ("data.seq_length", d.seq_length as u128),
            ("data.batch_size", d.batch_size as u128),
            ("data.seed", d.seed as u128),
            ("data.eval_sequences", d.eval_sequences as u128),
            ("data.num_kv_pairs", d.num_kv_pairs as u128),
            ("data.key_vocab_size", d.key_vocab_size as u128),
            ("data.value_vocab_size", d.value_vocab_size as u128),
            ("optimizer.lr_warmup_iters", o.lr_warmup_iters as u128),
            (
                "optimizer.lr_decay_iters",
                o.lr_decay_iters.unwrap_or(0) as u128,
            ),
            ("train.train_iters", t.train_iters as u128),
            ("train.seed", t.seed as u128),
            ("train.log_interval", t.log_interval as u128),
            ("train.eval_interval", t.eval_interval as u128),
            ("train.save_interval", t.save_interval as u128),
        ];
        for (name, v) in ints {
            check_toml_int(name, v)?;
        }
        self.model.layer.validate().map_err(in_model)?;
        if self.model.ffn_hidden_size == 0 {
            return Err(cfg_err("model.ffn_hidden_size", "must be > 0"));
        }
        self.model_config(self.vocab_size())
            .validate()
            .map_err(in_model)?;
        for (what, n) in [
            ("data.batch_size x data.seq_length", d.batch_size),
            ("data.eval_sequences x data.seq_length", d.eval_sequences),
        ] {
            if n.checked_mul(d.seq_length).is_none() {
                return Err(cfg_err(
                    what.split(' ').next().unwrap_or(what),
                    format!(
                        "{what} = {n} x {} tokens overflows (more than {})",
                        d.seq_length,
                        usize::MAX
                    ),
                ));
            }
        }
        for (name, v) in [
            ("data.seq_length", d.seq_length),
            ("data.batch_size", d.batch_size),
            ("data.eval_sequences", d.eval_sequences),
        ] {
            if v == 0 {
                return Err(cfg_err(name, "must be > 0"));
            }
        }
        match d.kind {
            DataKind::Text => {
                if d.path.is_none() {
                    return Err(cfg_err(
                        "data.path",
                        "kind = \"text\" needs path = \"<text file>\"",
                    ));
                }
            }
            DataKind::Mqar => {
                crate::train::data::Mqar::from_config(d)?;
            }
        }
        let finite_nonneg = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(cfg_err(name, format!("must be finite and >= 0 (got {v})")))
            }
        };
        finite_nonneg("optimizer.lr", o.lr)?;
        finite_nonneg("optimizer.min_lr", o.min_lr)?;
        finite_nonneg("optimizer.weight_decay", o.weight_decay)?;
        finite_nonneg("optimizer.clip_grad", o.clip_grad)?;
        if o.min_lr > o.lr {
            return Err(cfg_err(
                "optimizer.min_lr",
                format!("must be <= lr (got min_lr {} > lr {})", o.min_lr, o.lr),
            ));
        }
        for (name, b) in [
            ("optimizer.adam_beta1", o.adam_beta1),
            ("optimizer.adam_beta2", o.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&b) {
                return Err(cfg_err(name, format!("must be in [0, 1) (got {b})")));
            }
        }
        if !(o.adam_eps.is_finite() && o.adam_eps > 0.0) {
            return Err(cfg_err(
                "optimizer.adam_eps",
                format!("must be finite and > 0 (got {})", o.adam_eps),
            ));
        }
        if self.train.train_iters == 0 {
            return Err(cfg_err("train.train_iters", "must be > 0"));
        }
        if self.train.log_interval == 0 {
            return Err(cfg_err("train.log_interval", "must be > 0"));
        }
        Ok(())
    }
}
