//! Checkpoints: one safetensors file per save holding the parameters (under their names), AdamW's
//! moments (`optimizer.exp_avg.<name>`, `optimizer.exp_avg_sq.<name>`), and in the metadata the
//! step, the data seed, the model and run configs (TOML), for text data the size and hash of the
//! data file, and a checksum of all of it.
//!
//! The data state is the step: every training batch is a function of the data seed and the step
//! (see [`crate::train::data`]), and nothing else in a run draws random numbers after the init.
//!
//! **Format version 2.** The metadata key `gdn.checksum` holds `fnv1a64:<16 hex digits>`, the
//! 64-bit FNV-1a hash of every other metadata entry (sorted by key: key, NUL, value, NUL) and then
//! of every tensor (sorted by name: name, NUL, dtype, NUL, each dimension as 8 little-endian bytes,
//! the raw data bytes). The tensors cover the whole data section (safetensors checks that their
//! offsets tile it), so a flipped bit anywhere in the data, or in a metadata value, is a checksum
//! mismatch. Text runs also record `gdn.data_size` and `gdn.data_hash` (FNV-1a of the file's
//! bytes, see [`crate::train::data::DataFingerprint`]), so a resume can tell that the data file
//! changed. Version 1 checkpoints (no checksum) are refused with a message saying so: resume such
//! a run with the build that wrote it, or start it again.
//!
//! Files are written atomically (temporary file beside the target, synced, renamed), so a crash
//! never leaves a partial checkpoint under a checkpoint's name. Loading checks everything: a
//! corrupt file (checksum, safetensors structure, a missing, misshapen or extra tensor, a
//! non-finite value), a file that is not a `gdn train` checkpoint, another format version, a
//! different model config: each is an error that names the file and says which.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};

use crate::error::{GdnError, Result};
use crate::io::{file_err, io_err};
use crate::layer::Params;
use crate::model::ModelConfig;
use crate::tensor::Tensor;
use crate::train::data::DataFingerprint;

/// Metadata key of the checkpoint format tag, and its value.
pub const FORMAT_KEY: &str = "gdn.checkpoint";
/// Version of the checkpoint format (2: with [`CHECKSUM_KEY`]; 1 had no checksum).
pub const FORMAT_VERSION: &str = "2";
/// Metadata key of the checksum (`fnv1a64:<hex>`) of the other metadata and the tensors.
pub const CHECKSUM_KEY: &str = "gdn.checksum";
const STEP_KEY: &str = "gdn.step";
const MODEL_KEY: &str = "gdn.model_config";
const RUN_KEY: &str = "gdn.run_config";
const DATA_SEED_KEY: &str = "gdn.data_seed";
const DATA_SIZE_KEY: &str = "gdn.data_size";
const DATA_HASH_KEY: &str = "gdn.data_hash";
/// Prefix of AdamW's first moments.
pub const EXP_AVG: &str = "optimizer.exp_avg.";
/// Prefix of AdamW's second moments.
pub const EXP_AVG_SQ: &str = "optimizer.exp_avg_sq.";

/// 64-bit FNV-1a, the hash of checkpoints and data files (simple, dependency-free, fixed by its
/// specification so files stay checkable by any build).
#[derive(Clone, Copy, Debug)]
pub struct Fnv1a64(u64);

impl Default for Fnv1a64 {
    fn default() -> Self {
        Fnv1a64(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a64 {
    /// Feed bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }
    /// The hash of everything fed.
    pub fn finish(&self) -> u64 {
        self.0
    }
    /// The hash of `bytes`.
    pub fn hash(bytes: &[u8]) -> u64 {
        let mut h = Self::default();
        h.update(bytes);
        h.finish()
    }
}

/// The checksum text stored under [`CHECKSUM_KEY`].
fn checksum_text(h: u64) -> String {
    format!("fnv1a64:{h:016x}")
}

/// Hash the metadata (without the checksum) and the tensors, each sorted, as the module doc says.
fn checksum<'a>(
    meta: &BTreeMap<&str, &str>,
    tensors: impl Iterator<Item = (&'a str, &'a str, &'a [usize], &'a [u8])>,
) -> u64 {
    let mut h = Fnv1a64::default();
    for (k, v) in meta {
        if *k == CHECKSUM_KEY {
            continue;
        }
        h.update(k.as_bytes());
        h.update(&[0]);
        h.update(v.as_bytes());
        h.update(&[0]);
    }
    let mut ts: Vec<_> = tensors.collect();
    ts.sort_by(|a, b| a.0.cmp(b.0));
    for (name, dtype, shape, data) in ts {
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(dtype.as_bytes());
        h.update(&[0]);
        for d in shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(data);
    }
    h.finish()
}

/// What a checkpoint holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// Optimizer steps taken.
    pub step: u64,
    /// The data seed of the run.
    pub data_seed: u64,
    /// The model config it was written for.
    pub model: ModelConfig,
    /// The run config (TOML) it was written under; a resume compares it with its own.
    pub run_config: String,
    /// Size and hash of the text data it was trained on (`None` for MQAR).
    pub data_file: Option<DataFingerprint>,
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

/// The step of a checkpoint file name made by [`file_name`].
pub(crate) fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?.strip_suffix(".safetensors")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Every checkpoint in `dir` (files named by [`file_name`]; temporary files of interrupted
/// writes and other names are ignored), highest step first. A missing `dir` has none.
pub fn all(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir, e)),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| io_err(dir, e))?;
        let name = e.file_name();
        let Some(step) = name.to_str().and_then(step_of) else {
            continue;
        };
        out.push((step, e.path()));
    }
    out.sort_by(|a, b| b.cmp(a));
    Ok(out)
}

/// The checkpoint with the highest step in `dir` (see [`all`]), or `None`.
pub fn latest(dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    Ok(all(dir)?.into_iter().next())
}

/// Why a checkpoint was not loaded.
#[derive(Debug)]
pub enum Rejected {
    /// The file's content cannot be trusted (checksum mismatch, truncated, not safetensors, a
    /// missing or misshapen tensor, a non-finite value, ...): an earlier checkpoint of the same
    /// run may still be good.
    Corrupt(GdnError),
    /// The file could not be read, or is of another format version: an earlier checkpoint would
    /// not help.
    Unusable(GdnError),
}

impl Rejected {
    /// The error, whichever kind.
    pub fn into_error(self) -> GdnError {
        match self {
            Rejected::Corrupt(e) | Rejected::Unusable(e) => e,
        }
    }
}

impl Checkpoint {
    /// Write atomically to `path` (temporary file beside it, sync, rename).
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
        let model = toml::to_string(&self.model)
            .map_err(|e| file_err(path, format!("cannot write the model config: {e}")))?;
        let mut meta: BTreeMap<&str, String> = [
            ("format", "pt".to_string()),
            (FORMAT_KEY, FORMAT_VERSION.to_string()),
            (STEP_KEY, self.step.to_string()),
            (DATA_SEED_KEY, self.data_seed.to_string()),
            (MODEL_KEY, model),
            (RUN_KEY, self.run_config.clone()),
        ]
        .into_iter()
        .collect();
        if let Some(d) = &self.data_file {
            meta.insert(DATA_SIZE_KEY, d.size.to_string());
            meta.insert(DATA_HASH_KEY, format!("{:016x}", d.hash));
        }
        let bytes: Vec<(&str, Vec<u8>)> = items
            .iter()
            .map(|(n, t)| {
                let b = t.data().iter().flat_map(|x| x.to_le_bytes()).collect();
                (n.as_str(), b)
            })
            .collect();
        let sum = {
            let m: BTreeMap<&str, &str> = meta.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let f32_name = format!("{:?}", Dtype::F32);
            checksum(
                &m,
                items.iter().zip(&bytes).map(|((n, t), (_, b))| {
                    (n.as_str(), f32_name.as_str(), t.shape(), b.as_slice())
                }),
            )
        };
        meta.insert(CHECKSUM_KEY, checksum_text(sum));
        let meta: HashMap<String, String> =
            meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let items: Vec<(&str, &Tensor)> = items.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        crate::io::write_tensors_with_meta(path, &items, meta)
    }

    /// Read and check a checkpoint written for `expected` (the model config of this run).
    pub fn read(path: &Path, expected: &ModelConfig) -> Result<Self> {
        let ck = Self::load(path)?;
        ck.check_model(path, expected)?;
        Ok(ck)
    }

    /// Read a checkpoint and check its integrity (format version, checksum, metadata, every
    /// tensor of its own model config with its shape, finite values), whatever model it is for.
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_checked(path).map_err(Rejected::into_error)
    }

    /// [`load`](Self::load), saying whether an error means the file is corrupt (an earlier
    /// checkpoint may be used instead) or that it cannot be used for another reason.
    pub fn load_checked(path: &Path) -> std::result::Result<Self, Rejected> {
        let corrupt = |msg: String| {
            Rejected::Corrupt(file_err(path, format!("not a usable checkpoint: {msg}")))
        };
        let md = std::fs::metadata(path).map_err(|e| Rejected::Unusable(io_err(path, e)))?;
        if !md.is_file() {
            return Err(Rejected::Unusable(file_err(
                path,
                "not a usable checkpoint: not a regular file",
            )));
        }
        let buf = std::fs::read(path).map_err(|e| Rejected::Unusable(io_err(path, e)))?;
        let invalid = |e: safetensors::SafeTensorError| {
            corrupt(format!(
                "not a valid safetensors file ({e:?}); it may be truncated or corrupt"
            ))
        };
        let (_, header) = SafeTensors::read_metadata(&buf).map_err(invalid)?;
        // Validates the data section against the header too (offsets tile it exactly).
        let st = SafeTensors::deserialize(&buf).map_err(invalid)?;
        let md = header.metadata().clone().unwrap_or_default();
        match md.get(FORMAT_KEY).map(String::as_str) {
            Some(FORMAT_VERSION) => {}
            Some("1") => {
                return Err(Rejected::Unusable(file_err(
                    path,
                    format!(
                        "checkpoint format version 1 (written by an earlier gdn, without a \
                         checksum); this build reads version {FORMAT_VERSION} only: resume the run \
                         with the gdn that wrote it, or start it again"
                    ),
                )))
            }
            Some(v) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => {
                return Err(Rejected::Unusable(file_err(
                    path,
                    format!(
                        "checkpoint format version {v}, this build reads version {FORMAT_VERSION}"
                    ),
                )))
            }
            Some(v) => {
                return Err(corrupt(format!(
                    "metadata {FORMAT_KEY} = {v:?} is not a format version"
                )))
            }
            None => {
                return Err(corrupt(format!(
                    "a safetensors file without the {FORMAT_KEY} tag: not a gdn train checkpoint"
                )))
            }
        }
        let stored = md
            .get(CHECKSUM_KEY)
            .ok_or_else(|| corrupt(format!("metadata lacks {CHECKSUM_KEY}")))?;
        let mut views = Vec::new();
        for (name, view) in st.tensors() {
            views.push((name, format!("{:?}", view.dtype()), view));
        }
        let meta_ref: BTreeMap<&str, &str> =
            md.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let computed = checksum(
            &meta_ref,
            views
                .iter()
                .map(|(n, d, v)| (n.as_str(), d.as_str(), v.shape(), v.data())),
        );
        if *stored != checksum_text(computed) {
            return Err(corrupt(format!(
                "checksum mismatch: the metadata says {stored}, the content hashes to {}; \
                 the file is corrupt",
                checksum_text(computed)
            )));
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
        model
            .validate()
            .map_err(|e| corrupt(format!("metadata {MODEL_KEY}: {e}")))?;
        let run_config = get(RUN_KEY)?.clone();
        let data_file = match (md.get(DATA_SIZE_KEY), md.get(DATA_HASH_KEY)) {
            (None, None) => None,
            (Some(s), Some(h)) => Some(DataFingerprint {
                size: s
                    .parse()
                    .map_err(|_| corrupt(format!("metadata {DATA_SIZE_KEY} is not a size")))?,
                hash: u64::from_str_radix(h, 16)
                    .map_err(|_| corrupt(format!("metadata {DATA_HASH_KEY} is not a hash")))?,
            }),
            _ => {
                return Err(corrupt(format!(
                    "metadata has only one of {DATA_SIZE_KEY} and {DATA_HASH_KEY}"
                )))
            }
        };
        let mut by_name: HashMap<String, Tensor> = HashMap::new();
        for (name, dtype, view) in &views {
            if view.dtype() != Dtype::F32 {
                return Err(corrupt(format!(
                    "tensor {name} has dtype {dtype}, expected F32"
                )));
            }
            let data = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let t = Tensor::from_vec(view.shape(), data)
                .map_err(|e| corrupt(format!("tensor {name}: {e}")))?;
            by_name.insert(name.clone(), t);
        }
        let specs = crate::model::param_specs(&model);
        let mut take = |prefix: &str| -> std::result::Result<Params, Rejected> {
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
            data_file,
            params,
            exp_avg,
            exp_avg_sq,
        })
    }

    /// An error naming each differing field when the checkpoint is for another model config.
    pub fn check_model(&self, path: &Path, expected: &ModelConfig) -> Result<()> {
        if &self.model != expected {
            return Err(file_err(
                path,
                format!(
                    "the checkpoint was written for a different model: {}; \
                     resume with the run's own config (its config.toml)",
                    config_diff(&self.model, expected)
                ),
            ));
        }
        Ok(())
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
    diff_keys(&flat(ckpt), &flat(run))
}

/// `key = a in the checkpoint, b in this run` for every key whose values differ between two
/// flattened configs (a missing key reads `unset`), joined by `; `.
pub(crate) fn diff_keys(a: &[(String, String)], b: &[(String, String)]) -> String {
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
            let (x, y) = (get(a, k), get(b, k));
            (x != y).then(|| format!("{k} = {x} in the checkpoint, {y} in this run"))
        })
        .collect();
    if diffs.is_empty() {
        "the configs differ".into()
    } else {
        diffs.join("; ")
    }
}
