//! Training data: MQAR (generated) and byte-level text.
//!
//! Every training batch is a pure function of the data seed and the step number (its own ChaCha8
//! stream), so a run's data order is fixed by the seed, and resuming at step `s` needs only `s`.
//! The held-out set is a function of the seed alone, and disjoint from every training batch.
//!
//! **MQAR** (multi-query associative recall, Zoology's task): a sequence of `T` tokens is `N`
//! key-value pairs `k1 v1 k2 v2 ... kN vN` followed by `Q = (T - 2N) / 2` queries `q a`, each
//! `q` a key of the pairs (every key once before any repeats, in random order) and `a` its
//! value. Keys are ids `[0, K)`, distinct within a sequence; values ids `[K, K + V)`, drawn with
//! repetition. Loss and accuracy count only the answer positions: at each query key the target
//! is its value; every other position is ignored. Chance accuracy is `1 / V`. Training
//! sequences that happen to equal a held-out sequence are drawn again.
//!
//! **Text**: the bytes of a file (vocab 256). The first 90% trains, the last 10% is held out.
//! Training sequences are `T + 1`-byte windows at random offsets of the training part (inputs the
//! first `T`, targets the last `T`); the held-out set is consecutive windows of the held-out part.
//! A text file is read whole into memory, up to [`MAX_TEXT_DATA_BYTES`] (an endless file such as
//! `/dev/zero` is refused, not read forever).
//!
//! **What a text run records about its file.** `gdn train` writes the file's absolute path in the
//! run's `config.toml` (`data.path`; a relative `--data` is resolved against the working directory
//! when the run starts, so the run resumes from any directory), and every checkpoint records the
//! file's size and 64-bit FNV-1a hash ([`DataFingerprint`], metadata `gdn.data_size` and
//! `gdn.data_hash`). A resume compares the file as it is now with the checkpoint's record and
//! refuses a change (size or hash) unless asked to accept it
//! ([`crate::train::ResumeOptions::allow_data_change`], `gdn train --allow-data-change`).

use std::collections::HashSet;
use std::path::Path;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{GdnError, Result};
use crate::model::{Batch, IGNORE_INDEX};
use crate::train::config::{DataConfig, DataKind};

/// Stream of the training batch of a step (the step in the low bits).
const TRAIN_STREAM: u64 = 1 << 62;
/// Stream of the held-out set.
const EVAL_STREAM: u64 = 2 << 62;

fn stream(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream);
    r
}

fn cfg_err(field: &str, msg: impl Into<String>) -> GdnError {
    GdnError::Config {
        field: field.to_string(),
        msg: msg.into(),
    }
}

/// The MQAR generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mqar {
    /// `N`.
    pub num_kv_pairs: usize,
    /// `K`.
    pub key_vocab: usize,
    /// `V`.
    pub value_vocab: usize,
    /// `T`.
    pub seq_len: usize,
}

impl Mqar {
    /// From `[data]`, checked.
    pub fn from_config(d: &DataConfig) -> Result<Self> {
        let m = Mqar {
            num_kv_pairs: d.num_kv_pairs,
            key_vocab: d.key_vocab_size,
            value_vocab: d.value_vocab_size,
            seq_len: d.seq_length,
        };
        if m.num_kv_pairs == 0 {
            return Err(cfg_err("data.num_kv_pairs", "must be > 0"));
        }
        if m.key_vocab < m.num_kv_pairs {
            return Err(cfg_err(
                "data.key_vocab_size",
                format!(
                    "must be >= num_kv_pairs = {} (keys are distinct within a sequence), got {}",
                    m.num_kv_pairs, m.key_vocab
                ),
            ));
        }
        if m.value_vocab == 0 {
            return Err(cfg_err("data.value_vocab_size", "must be > 0"));
        }
        let t = m.seq_len;
        if t < 2 * m.num_kv_pairs + 2 || !(t - 2 * m.num_kv_pairs).is_multiple_of(2) {
            return Err(cfg_err(
                "data.seq_length",
                format!(
                    "MQAR needs seq_length = 2 * num_kv_pairs + 2 * queries with at least one query: \
                     an even number >= {} for num_kv_pairs = {} (got {t})",
                    2 * m.num_kv_pairs + 2,
                    m.num_kv_pairs
                ),
            ));
        }
        Ok(m)
    }

    /// `K + V`.
    pub fn vocab_size(&self) -> usize {
        self.key_vocab + self.value_vocab
    }

    /// Queries per sequence.
    pub fn num_queries(&self) -> usize {
        (self.seq_len - 2 * self.num_kv_pairs) / 2
    }

    /// One sequence: tokens and targets.
    pub fn sample(&self, rng: &mut impl Rng) -> (Vec<u32>, Vec<i32>) {
        let n = self.num_kv_pairs;
        let mut pool: Vec<u32> = (0..self.key_vocab as u32).collect();
        let (keys, _) = pool.partial_shuffle(rng, n);
        let keys = keys.to_vec();
        let values: Vec<u32> = (0..n)
            .map(|_| (self.key_vocab + rng.gen_range(0..self.value_vocab)) as u32)
            .collect();
        let mut tokens = Vec::with_capacity(self.seq_len);
        let mut targets = Vec::with_capacity(self.seq_len);
        for i in 0..n {
            tokens.extend([keys[i], values[i]]);
            targets.extend([IGNORE_INDEX, IGNORE_INDEX]);
        }
        let mut order: Vec<usize> = Vec::new();
        while order.len() < self.num_queries() {
            let mut p: Vec<usize> = (0..n).collect();
            p.shuffle(rng);
            order.extend(p);
        }
        for &i in &order[..self.num_queries()] {
            tokens.extend([keys[i], values[i]]);
            targets.extend([values[i] as i32, IGNORE_INDEX]);
        }
        (tokens, targets)
    }
}

/// Largest text data file read (1 GiB): the whole file is held in memory.
pub const MAX_TEXT_DATA_BYTES: u64 = 1 << 30;

/// Size and content hash of a text data file: what a checkpoint records of the data it was
/// trained on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataFingerprint {
    /// Bytes.
    pub size: u64,
    /// 64-bit FNV-1a of the bytes ([`crate::train::checkpoint::Fnv1a64`]).
    pub hash: u64,
}

impl std::fmt::Display for DataFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes, FNV-1a hash {:016x}", self.size, self.hash)
    }
}

/// Byte-level text with a held-out tail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Text {
    bytes: Vec<u8>,
    /// First held-out byte.
    split: usize,
    seq_len: usize,
    fingerprint: DataFingerprint,
}

impl Text {
    /// Load `path` (at most [`MAX_TEXT_DATA_BYTES`]); the last 10% is held out. Both parts must
    /// hold a `T + 1`-byte window.
    pub fn load(path: &Path, seq_len: usize) -> Result<Self> {
        let md = std::fs::metadata(path).map_err(|e| GdnError::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        if md.is_dir() {
            return Err(GdnError::File {
                path: path.display().to_string(),
                msg: "is a directory, expected a text file".into(),
            });
        }
        if md.is_file() && md.len() > MAX_TEXT_DATA_BYTES {
            return Err(GdnError::File {
                path: path.display().to_string(),
                msg: format!(
                    "{} bytes is larger than the {MAX_TEXT_DATA_BYTES} bytes a text data file may have",
                    md.len()
                ),
            });
        }
        let bytes = crate::io::read_limited(path, MAX_TEXT_DATA_BYTES)?;
        Self::from_bytes(bytes, seq_len).map_err(|e| GdnError::File {
            path: path.display().to_string(),
            msg: e.to_string(),
        })
    }

    /// From bytes in memory.
    pub fn from_bytes(bytes: Vec<u8>, seq_len: usize) -> Result<Self> {
        let split = bytes.len() - bytes.len() / 10;
        let need = seq_len.saturating_add(1);
        if split < need || bytes.len() - split < need {
            return Err(GdnError::Invalid(format!(
                "{} bytes is too short for data.seq_length = {seq_len}: the training 90% and the \
                 held-out 10% must each hold {need} bytes (at least {} bytes in all)",
                bytes.len(),
                need.saturating_mul(10)
            )));
        }
        let fingerprint = DataFingerprint {
            size: bytes.len() as u64,
            hash: crate::train::checkpoint::Fnv1a64::hash(&bytes),
        };
        Ok(Text {
            bytes,
            split,
            seq_len,
            fingerprint,
        })
    }

    /// Training bytes, held-out bytes.
    pub fn sizes(&self) -> (usize, usize) {
        (self.split, self.bytes.len() - self.split)
    }

    /// Size and hash of the bytes.
    pub fn fingerprint(&self) -> DataFingerprint {
        self.fingerprint
    }

    fn window(&self, start: usize) -> (Vec<u32>, Vec<i32>) {
        let w = &self.bytes[start..start + self.seq_len + 1];
        (
            w[..self.seq_len].iter().map(|&b| b as u32).collect(),
            w[1..].iter().map(|&b| b as i32).collect(),
        )
    }
}

/// The data of a run.
#[derive(Clone, Debug)]
pub struct Dataset {
    source: Source,
    seed: u64,
    batch_size: usize,
    seq_len: usize,
    eval: Vec<Batch>,
    /// Held-out MQAR sequences, so training never draws one.
    eval_set: HashSet<Vec<u32>>,
}

#[derive(Clone, Debug)]
enum Source {
    Mqar(Mqar),
    Text(Text),
}

impl Dataset {
    /// Build from `[data]` (reads the text file for `kind = "text"`).
    pub fn from_config(d: &DataConfig) -> Result<Self> {
        let source = match d.kind {
            DataKind::Mqar => Source::Mqar(Mqar::from_config(d)?),
            DataKind::Text => {
                let path = d.path.as_ref().ok_or_else(|| {
                    cfg_err("data.path", "kind = \"text\" needs path = \"<text file>\"")
                })?;
                Source::Text(Text::load(path, d.seq_length)?)
            }
        };
        Self::new(source, d)
    }

    /// Byte-level text from memory (tests, or text already loaded).
    pub fn text_from_bytes(bytes: Vec<u8>, d: &DataConfig) -> Result<Self> {
        Self::new(Source::Text(Text::from_bytes(bytes, d.seq_length)?), d)
    }

    fn new(source: Source, d: &DataConfig) -> Result<Self> {
        let (b, t) = (d.batch_size, d.seq_length);
        let mut seqs: Vec<(Vec<u32>, Vec<i32>)> = Vec::new();
        match &source {
            Source::Mqar(m) => {
                let mut r = stream(d.seed, EVAL_STREAM);
                seqs = (0..d.eval_sequences).map(|_| m.sample(&mut r)).collect();
            }
            Source::Text(x) => {
                let mut s = x.split;
                while seqs.len() < d.eval_sequences && s + t < x.bytes.len() {
                    seqs.push(x.window(s));
                    s += t;
                }
            }
        }
        let eval_set = match source {
            Source::Mqar(_) => seqs.iter().map(|(tok, _)| tok.clone()).collect(),
            Source::Text(_) => HashSet::new(),
        };
        let eval = seqs
            .chunks(b)
            .map(|c| {
                let tokens = c.iter().flat_map(|s| s.0.iter().copied()).collect();
                let targets = c.iter().flat_map(|s| s.1.iter().copied()).collect();
                Batch::new(tokens, targets, c.len(), t)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Dataset {
            source,
            seed: d.seed,
            batch_size: b,
            seq_len: t,
            eval,
            eval_set,
        })
    }

    /// Tokens of the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match &self.source {
            Source::Mqar(m) => m.vocab_size(),
            Source::Text(_) => 256,
        }
    }

    /// Size and hash of the text (`None` for MQAR, which is a function of the seed).
    pub fn fingerprint(&self) -> Option<DataFingerprint> {
        match &self.source {
            Source::Mqar(_) => None,
            Source::Text(x) => Some(x.fingerprint()),
        }
    }

    /// Accuracy of guessing (MQAR: one value in `V`); `None` for text.
    pub fn chance_accuracy(&self) -> Option<f64> {
        match &self.source {
            Source::Mqar(m) => Some(1.0 / m.value_vocab as f64),
            Source::Text(_) => None,
        }
    }

    /// One line saying what the data is.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Mqar(m) => format!(
                "MQAR: {} key-value pairs + {} queries per sequence of {} tokens, keys from {}, values from {} (vocab {}), seed {}",
                m.num_kv_pairs,
                m.num_queries(),
                m.seq_len,
                m.key_vocab,
                m.value_vocab,
                m.vocab_size(),
                self.seed
            ),
            Source::Text(x) => {
                let (tr, ho) = x.sizes();
                format!("byte-level text: {tr} training bytes, {ho} held-out bytes (vocab 256)")
            }
        }
    }

    /// The held-out set, in batches of at most `batch_size` sequences.
    pub fn eval_batches(&self) -> &[Batch] {
        &self.eval
    }

    /// Held-out sequences.
    pub fn eval_sequences(&self) -> usize {
        self.eval.iter().map(|b| b.batch).sum()
    }

    /// The training batch of update `step` (1-based): a function of the seed and `step` only.
    pub fn train_batch(&self, step: u64) -> Batch {
        let mut r = stream(self.seed, TRAIN_STREAM | (step & (TRAIN_STREAM - 1)));
        let (b, t) = (self.batch_size, self.seq_len);
        let mut tokens = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        for _ in 0..b {
            let (tok, tg) = match &self.source {
                Source::Mqar(m) => loop {
                    let s = m.sample(&mut r);
                    if !self.eval_set.contains(&s.0) {
                        break s;
                    }
                },
                Source::Text(x) => x.window(r.gen_range(0..=x.split - t - 1)),
            };
            tokens.extend(tok);
            targets.extend(tg);
        }
        Batch::new(tokens, targets, b, t).expect("lengths by construction")
    }
}
