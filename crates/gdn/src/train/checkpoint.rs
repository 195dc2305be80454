//! Checkpoints: one safetensors file per save holding the parameters (under their names), AdamW's
//! moments (`optimizer.exp_avg.<name>`, `optimizer.exp_avg_sq.<name>`), and in the metadata the
//! step, the data seed and the model and run configs (TOML).
//!
//! The data state is the step: every training batch is a function of the data seed and the step
//! (see [`crate::train::data`]), and nothing else in a run draws random numbers after the init.
//!
//! Files are written to `<path>.tmp-<pid>`, synced and renamed, so a crash never leaves a partial
//! checkpoint under a checkpoint's name. Loading checks everything: a corrupt file, a file that
//! is not a `gdn train` checkpoint, a different model config, or a missing, misshapen or extra
//! tensor is an error that says which.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::SafeTensors;

use crate::error::Result;
use crate::io::{file_err, io_err};
use crate::layer::Params;
use crate::model::ModelConfig;
use crate::tensor::Tensor;

/// Metadata key of the checkpoint format tag, and its value.
pub const FORMAT_KEY: &str = "gdn.checkpoint";
/// Version of the checkpoint format.
pub const FORMAT_VERSION: &str = "1";
const STEP_KEY: &str = "gdn.step";
const MODEL_KEY: &str = "gdn.model_config";
const RUN_KEY: &str = "gdn.run_config";
const DATA_SEED_KEY: &str = "gdn.data_seed";
/// Prefix of AdamW's first moments.
pub const EXP_AVG: &str = "optimizer.exp_avg.";
/// Prefix of AdamW's second moments.
pub const EXP_AVG_SQ: &str = "optimizer.exp_avg_sq.";

/// What a checkpoint holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// Optimizer steps taken.
    pub step: u64,
    /// The data seed of the run.
    pub data_seed: u64,
    /// The model config it was written for.
    pub model: ModelConfig,
    /// The run config (TOML) it was written under, for reference.
    pub run_config: String,
    /// Parameters, by name.
    pub params: Params,
    /// AdamW's first moments, by parameter name.
    pub exp_avg: Params,
    /// AdamW's second moments, by parameter name.
    pub exp_avg_sq: Params,
}

/// File name of the checkpoint of `step`.
pub fn file_name(step: u64) -> String {
    format!("step-{step:08}.safetensors")
}

/// The checkpoint with the highest step in `dir` (files named by [`file_name`]; temporary files
/// of interrupted writes are ignored), or `None`.
pub fn latest(dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(dir, e)),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for e in rd {
        let e = e.map_err(|e| io_err(dir, e))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.strip_suffix(".safetensors"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        match &best {
            Some((b, _)) if *b >= step => {}
            _ => best = Some((step, e.path())),
        }
    }
    Ok(best)
}

impl Checkpoint {
    /// Write atomically to `path` (`<path>.tmp-<pid>`, sync, rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut items: Vec<(String, &Tensor)> = Vec::new();
        for (n, t) in self.params.iter() {
            items.push((n.to_string(), t));
        }
        for (n, t) in self.exp_avg.iter() {
            items.push((format!("{EXP_AVG}{n}"), t));
        }
        for (n, t) in self.exp_avg_sq.iter() {
            items.push((format!("{EXP_AVG_SQ}{n}"), t));
        }
        let model = toml::to_string(&self.model).expect("model config serializes");
        let meta: HashMap<String, String> = [
            ("format", "pt".to_string()),
            (FORMAT_KEY, FORMAT_VERSION.to_string()),
            (STEP_KEY, self.step.to_string()),
            (DATA_SEED_KEY, self.data_seed.to_string()),
            (MODEL_KEY, model),
            (RUN_KEY, self.run_config.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let items: Vec<(&str, &Tensor)> = items.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        crate::io::write_tensors_with_meta(path, &items, meta)
    }

    /// Read and check a checkpoint written for `expected` (the model config of this run).
    pub fn read(path: &Path, expected: &ModelConfig) -> Result<Self> {
        let corrupt = |msg: String| file_err(path, format!("not a usable checkpoint: {msg}"));
        let buf = std::fs::read(path).map_err(|e| io_err(path, e))?;
        let (_, meta) = SafeTensors::read_metadata(&buf).map_err(|e| {
            corrupt(format!(
                "not a valid safetensors file ({e:?}); it may be truncated or corrupt"
            ))
        })?;
        // Validates the data section against the header too.
        SafeTensors::deserialize(&buf).map_err(|e| {
            corrupt(format!(
                "not a valid safetensors file ({e:?}); it may be truncated or corrupt"
            ))
        })?;
        let md = meta.metadata().clone().unwrap_or_default();
        match md.get(FORMAT_KEY) {
            Some(v) if v == FORMAT_VERSION => {}
            Some(v) => {
                return Err(corrupt(format!(
                    "checkpoint format version {v}, this build reads version {FORMAT_VERSION}"
                )))
            }
            None => {
                return Err(corrupt(format!(
                    "a safetensors file without the {FORMAT_KEY} tag: not a gdn train checkpoint"
                )))
            }
        }
        let get = |k: &str| {
            md.get(k)
                .ok_or_else(|| corrupt(format!("metadata lacks {k}")))
        };
        let step: u64 = get(STEP_KEY)?
            .parse()
            .map_err(|_| corrupt(format!("metadata {STEP_KEY} is not a step number")))?;
        let data_seed: u64 = get(DATA_SEED_KEY)?
            .parse()
            .map_err(|_| corrupt(format!("metadata {DATA_SEED_KEY} is not a number")))?;
        let model: ModelConfig = toml::from_str(get(MODEL_KEY)?)
            .map_err(|e| corrupt(format!("metadata {MODEL_KEY}: {}", e.message())))?;
        if &model != expected {
            return Err(file_err(
                path,
                format!(
                    "the checkpoint was written for a different model: {}; \
                     resume with the run's own config (its config.toml)",
                    config_diff(&model, expected)
                ),
            ));
        }
        let run_config = get(RUN_KEY)?.clone();
        let tensors = crate::io::read_tensors(path)?;
        let specs = crate::model::param_specs(expected);
        let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
        let mut take = |prefix: &str| -> Result<Params> {
            let mut out = Vec::new();
            for (n, shape) in &specs {
                let key = format!("{prefix}{n}");
                match by_name.remove(&key) {
                    None => return Err(corrupt(format!("missing tensor {key} (shape {shape:?})"))),
                    Some(t) if t.shape() != shape.as_slice() => {
                        return Err(corrupt(format!(
                            "tensor {key} has shape {:?}, expected {shape:?}",
                            t.shape()
                        )))
                    }
                    Some(t) => out.push((n.clone(), t)),
                }
            }
            Ok(Params::from_entries(out))
        };
        let params = take("")?;
        let exp_avg = take(EXP_AVG)?;
        let exp_avg_sq = take(EXP_AVG_SQ)?;
        if let Some(extra) = by_name.keys().min() {
            return Err(corrupt(format!("unexpected tensor {extra}")));
        }
        for (n, t) in params.iter().chain(exp_avg.iter()).chain(exp_avg_sq.iter()) {
            t.check_finite(n).map_err(|e| corrupt(e.to_string()))?;
        }
        Ok(Checkpoint {
            step,
            data_seed,
            model,
            run_config,
            params,
            exp_avg,
            exp_avg_sq,
        })
    }
}

/// `field: a (checkpoint) vs b (this run)` for every differing field.
fn config_diff(ckpt: &ModelConfig, run: &ModelConfig) -> String {
    let flat = |c: &ModelConfig| -> Vec<(String, String)> {
        let mut t = toml::Table::try_from(c.layer.clone()).expect("serializes");
        t.insert(
            "vocab_size".into(),
            toml::Value::Integer(c.vocab_size as i64),
        );
        t.insert(
            "ffn_hidden_size".into(),
            toml::Value::Integer(c.ffn_hidden_size as i64),
        );
        t.insert(
            "share_embeddings_and_output_weights".into(),
            toml::Value::Boolean(c.share_embeddings_and_output_weights),
        );
        t.into_iter().map(|(k, v)| (k, v.to_string())).collect()
    };
    let (a, b) = (flat(ckpt), flat(run));
    let mut keys: Vec<&String> = a.iter().chain(b.iter()).map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    let get = |v: &[(String, String)], k: &str| {
        v.iter()
            .find(|(x, _)| x == k)
            .map_or("unset".to_string(), |(_, v)| v.clone())
    };
    let diffs: Vec<String> = keys
        .into_iter()
        .filter_map(|k| {
            let (x, y) = (get(&a, k), get(&b, k));
            (x != y).then(|| format!("{k} = {x} in the checkpoint, {y} in this run"))
        })
        .collect();
    if diffs.is_empty() {
        "the configs differ".into()
    } else {
        diffs.join("; ")
    }
}
