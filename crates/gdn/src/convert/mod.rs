//! Weight layouts of a GDN layer: ours, Hugging Face Qwen3-Next and Qwen3.5, Megatron's
//! distributed-checkpoint keys. Conversions move stored bytes (rows of the projection matrices,
//! channels of the conv) without touching a value, so every round trip is bitwise, in any stored
//! dtype (F32, BF16, F16; one dtype per tensor, kept).
//!
//! Layouts (`Hk` key heads of `Dk`, `Hv` value heads of `Dv`, `R = Hv / Hk`, hidden `h`):
//!
//! - `gdn` (ours): one file, Megatron's parameter names without prefix ([`param_specs`]);
//!   `in_proj.weight` rows `[q | k | v | z | beta | alpha]` (GDN) or `[q | k | v | z | f | b | w]`
//!   (GDN2), heads major within each section; `conv1d.weight` channels `[q | k | v]`.
//! - `hf-qwen3-next` (transformers `Qwen3NextGatedDeltaNet`, keys
//!   `model.layers.N.linear_attn.*` and the decoder layer's `model.layers.N.input_layernorm.weight`):
//!   `in_proj_qkvz` rows grouped by key head, `[q_g (Dk) | k_g (Dk) | v of the group's R value heads
//!   (R*Dv) | z of the same (R*Dv)]` for g in 0..Hk (the inverse of the model's
//!   `fix_query_key_value_ordering`), `in_proj_ba` rows `[beta (R) | alpha (R)]` per key head;
//!   `conv1d.weight` flat `[q | k | v]`, `A_log`, `dt_bias` `[Hv]`, `norm.weight` `[Dv]`,
//!   `out_proj.weight`. Sharded safetensors with `model.safetensors.index.json`.
//! - `hf-qwen3.5` (transformers `Qwen3_5GatedDeltaNet`, keys
//!   `model.language_model.layers.N.linear_attn.*`): flat splits `in_proj_qkv` `[q | k | v]`,
//!   `in_proj_z`, `in_proj_b` (beta), `in_proj_a` (alpha); the rest as Qwen3-Next.
//! - `megatron` (Megatron-LM's `sharded_state_dict` of `GatedDeltaNet`, TP = 1, keys
//!   `decoder.layers.N.self_attention.*`): `in_proj.weight.{query,key,value,z,beta,alpha}`
//!   (GDN2: `{query,key,value,z,f,b,w}`), `conv1d.weight.{query,key,value}` (and `conv1d.bias.*`),
//!   the other parameters under their own names. Stored here as safetensors (a real
//!   distributed checkpoint is torch_dist; export its tensors under these keys first).
//!
//! The HF layouts describe GDN layers (no GDN2) with RMSNorm and no biases. HF's
//! `input_layernorm` multiplies by `1 + w` while its gated `norm` multiplies by `w`; gdn's
//! `layernorm_zero_centered_gamma` applies to both norms, so the stored values are moved as they
//! are and the config decides how they are read (see the README's "From PyTorch").
//!
//! Reading finds layer `N`'s keys by their suffix (any prefix ending in `layers.N.`), so
//! `model.` / `model.language_model.` / other wrappers need no option.

pub mod testgen;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::config::{GdnConfig, Normalization, Variant};
use crate::error::{GdnError, Result};
use crate::io::{file_err, io_err, read_safetensors_bytes, read_text, write_atomic};
use crate::layer::{param_specs, Params};
use crate::tensor::Tensor;

/// A weight layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Ours: Megatron's parameter names, one file.
    Gdn,
    /// Hugging Face Qwen3-Next (`in_proj_qkvz` + `in_proj_ba` grouped by key head).
    HfQwen3Next,
    /// Hugging Face Qwen3.5 (flat `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
    HfQwen35,
    /// Megatron's distributed-checkpoint keys (`in_proj.weight.query`, ...).
    Megatron,
}

impl Layout {
    /// Every layout, in the order of their names.
    pub const ALL: [Layout; 4] = [
        Layout::Gdn,
        Layout::HfQwen3Next,
        Layout::HfQwen35,
        Layout::Megatron,
    ];
    /// The name `gdn convert` uses.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Gdn => "gdn",
            Layout::HfQwen3Next => "hf-qwen3-next",
            Layout::HfQwen35 => "hf-qwen3.5",
            Layout::Megatron => "megatron",
        }
    }
    /// Whether it is written as a directory (sharded, with an index file).
    pub fn is_hf(self) -> bool {
        matches!(self, Layout::HfQwen3Next | Layout::HfQwen35)
    }
    /// The key prefix written for layer `n`.
    pub fn default_prefix(self, n: usize) -> String {
        match self {
            Layout::Gdn => String::new(),
            Layout::HfQwen3Next => format!("model.layers.{n}."),
            Layout::HfQwen35 => format!("model.language_model.layers.{n}."),
            Layout::Megatron => format!("decoder.layers.{n}.self_attention."),
        }
    }
    /// A key that every checkpoint of this layout has, after the layer's prefix (how the prefix
    /// is found).
    fn anchor(self) -> &'static str {
        match self {
            Layout::Gdn => "in_proj.weight",
            Layout::HfQwen3Next => "linear_attn.in_proj_qkvz.weight",
            Layout::HfQwen35 => "linear_attn.in_proj_qkv.weight",
            Layout::Megatron => "in_proj.weight.query",
        }
    }
}

impl FromStr for Layout {
    type Err = GdnError;
    fn from_str(s: &str) -> Result<Self> {
        Layout::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| {
                GdnError::Invalid(format!(
                    "unknown layout {s:?}: expected one of {}",
                    Layout::ALL.map(Layout::name).join(", ")
                ))
            })
    }
}

/// Stored element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawDtype {
    F32,
    Bf16,
    F16,
}

impl RawDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            RawDtype::F32 => 4,
            RawDtype::Bf16 | RawDtype::F16 => 2,
        }
    }
    fn st(self) -> Dtype {
        match self {
            RawDtype::F32 => Dtype::F32,
            RawDtype::Bf16 => Dtype::BF16,
            RawDtype::F16 => Dtype::F16,
        }
    }
}

/// A tensor as stored: dtype, shape, little-endian bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Raw {
    pub dtype: RawDtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Raw {
    /// From f32 values, stored as `dtype` (bf16 / f16: round to nearest even).
    pub fn from_f32(shape: &[usize], data: &[f32], dtype: RawDtype) -> Result<Raw> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(GdnError::shape(
                "tensor",
                shape,
                format!("{} values", data.len()),
            ));
        }
        let bytes = match dtype {
            RawDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            RawDtype::Bf16 => data
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            RawDtype::F16 => data
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        };
        Ok(Raw {
            dtype,
            shape: shape.to_vec(),
            bytes,
        })
    }
    /// The values as f32 (exact for every stored dtype).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            RawDtype::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            RawDtype::Bf16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            RawDtype::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }
    /// Bytes of one row (one index of the first dimension).
    fn row_bytes(&self) -> usize {
        self.shape[1..].iter().product::<usize>() * self.dtype.size()
    }
    /// Rows `start..start + n` of the first dimension.
    fn rows(&self, start: usize, n: usize) -> Raw {
        let rb = self.row_bytes();
        let mut shape = self.shape.clone();
        shape[0] = n;
        Raw {
            dtype: self.dtype,
            shape,
            bytes: self.bytes[start * rb..(start + n) * rb].to_vec(),
        }
    }
    /// Concatenate along the first dimension (same dtype and trailing shape, checked by the
    /// callers' shape checks).
    fn cat(parts: &[Raw]) -> Raw {
        let mut shape = parts[0].shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        Raw {
            dtype: parts[0].dtype,
            shape,
            bytes: parts.iter().flat_map(|p| p.bytes.iter().copied()).collect(),
        }
    }
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype.st()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// One layer's tensors in our layout (Megatron's names, [`param_specs`] order), as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerWeights {
    pub entries: Vec<(String, Raw)>,
}

impl LayerWeights {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&Raw> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
    /// As f32 parameters of a layer (checked against `cfg`).
    pub fn to_params(&self, cfg: &GdnConfig) -> Result<Params> {
        let p = Params::from_entries(
            self.entries
                .iter()
                .map(|(n, r)| Ok((n.clone(), Tensor::from_vec(&r.shape, r.to_f32())?)))
                .collect::<Result<Vec<_>>>()?,
        );
        p.check_against(cfg, "converted weights")?;
        Ok(p)
    }
    /// From f32 parameters, stored as `dtype`.
    pub fn from_params(p: &Params, dtype: RawDtype) -> Result<Self> {
        Ok(LayerWeights {
            entries: p
                .iter()
                .map(|(n, t)| Ok((n.to_string(), Raw::from_f32(t.shape(), t.data(), dtype)?)))
                .collect::<Result<Vec<_>>>()?,
        })
    }
    /// Check names and shapes against `cfg` (every parameter present with its shape, nothing
    /// else); missing tensors are listed together.
    pub fn check(&self, cfg: &GdnConfig, source: &str) -> Result<()> {
        let specs = param_specs(cfg);
        let missing: Vec<String> = specs
            .iter()
            .filter(|(n, _)| self.get(n).is_none())
            .map(|(n, s)| format!("{n} {s:?}"))
            .collect();
        if !missing.is_empty() {
            return Err(GdnError::File {
                path: source.into(),
                msg: format!("missing tensors: {}", missing.join(", ")),
            });
        }
        for (n, s) in &specs {
            let t = self.get(n).expect("checked above");
            if t.shape != *s {
                return Err(GdnError::File {
                    path: source.into(),
                    msg: format!("tensor {n} has shape {:?}, expected {s:?}", t.shape),
                });
            }
        }
        if let Some((n, _)) = self
            .entries
            .iter()
            .find(|(n, _)| !specs.iter().any(|(s, _)| s == n))
        {
            return Err(GdnError::File {
                path: source.into(),
                msg: format!("unexpected tensor {n}"),
            });
        }
        Ok(())
    }
}

/// Names of the in_proj sections and their row counts, in our order.
pub fn in_proj_sections(cfg: &GdnConfig) -> Vec<(&'static str, usize)> {
    let (qk, v, hv) = (cfg.qk_dim(), cfg.v_dim(), cfg.linear_num_value_heads);
    match cfg.variant {
        Variant::Gdn => vec![
            ("query", qk),
            ("key", qk),
            ("value", v),
            ("z", v),
            ("beta", hv),
            ("alpha", hv),
        ],
        Variant::Gdn2 => vec![
            ("query", qk),
            ("key", qk),
            ("value", v),
            ("z", v),
            ("f", qk),
            ("b", qk),
            ("w", v),
        ],
    }
}

fn conv_sections(cfg: &GdnConfig) -> [(&'static str, usize); 3] {
    [
        ("query", cfg.qk_dim()),
        ("key", cfg.qk_dim()),
        ("value", cfg.v_dim()),
    ]
}

/// Split `t` along rows into named sections.
fn split(t: &Raw, secs: &[(&'static str, usize)]) -> Vec<(&'static str, Raw)> {
    let mut at = 0;
    secs.iter()
        .map(|&(n, r)| {
            let s = t.rows(at, r);
            at += r;
            (n, s)
        })
        .collect()
}

/// A layout's tensors for one layer: keys relative to the layer's prefix, or absolute ones
/// (HF's decoder-level `input_layernorm.weight` is relative too, see [`to_layout`]).
pub type Keyed = Vec<(String, Raw)>;

fn hf_only_gdn(cfg: &GdnConfig, layout: Layout) -> Result<()> {
    if cfg.variant != Variant::Gdn {
        return Err(GdnError::Invalid(format!(
            "the {} layout describes GDN layers only (this config is GDN2)",
            layout.name()
        )));
    }
    if cfg.normalization != Normalization::RMSNorm || cfg.conv_bias {
        return Err(GdnError::Invalid(format!(
            "the {} layout has RMSNorm and no conv bias; this config has {:?}{}",
            layout.name(),
            cfg.normalization,
            if cfg.conv_bias {
                " and a conv bias"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// Our weights in `layout`: keys relative to the layer's prefix.
pub fn to_layout(w: &LayerWeights, cfg: &GdnConfig, layout: Layout) -> Result<Keyed> {
    w.check(cfg, "weights")?;
    let g = |n: &str| w.get(n).expect("checked").clone();
    let mut out: Keyed = Vec::new();
    match layout {
        Layout::Gdn => return Ok(w.entries.clone()),
        Layout::Megatron => {
            for (name, t) in &w.entries {
                match name.as_str() {
                    "in_proj.weight" => {
                        for (s, r) in split(t, &in_proj_sections(cfg)) {
                            out.push((format!("in_proj.weight.{s}"), r));
                        }
                    }
                    "conv1d.weight" | "conv1d.bias" => {
                        for (s, r) in split(t, &conv_sections(cfg)) {
                            out.push((format!("{name}.{s}"), r));
                        }
                    }
                    _ => out.push((name.clone(), t.clone())),
                }
            }
        }
        Layout::HfQwen3Next | Layout::HfQwen35 => {
            hf_only_gdn(cfg, layout)?;
            let secs = split(&g("in_proj.weight"), &in_proj_sections(cfg));
            let sec = |n: &str| {
                secs.iter()
                    .find(|(s, _)| *s == n)
                    .expect("section")
                    .1
                    .clone()
            };
            let (q, k, v, z, b, a) = (
                sec("query"),
                sec("key"),
                sec("value"),
                sec("z"),
                sec("beta"),
                sec("alpha"),
            );
            out.push((
                "input_layernorm.weight".into(),
                g("in_proj.layer_norm_weight"),
            ));
            if layout == Layout::HfQwen3Next {
                let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
                let r = cfg.head_ratio();
                let mut qkvz = Vec::new();
                let mut ba = Vec::new();
                for grp in 0..cfg.linear_num_key_heads {
                    qkvz.push(q.rows(grp * dk, dk));
                    qkvz.push(k.rows(grp * dk, dk));
                    qkvz.push(v.rows(grp * r * dv, r * dv));
                    qkvz.push(z.rows(grp * r * dv, r * dv));
                    ba.push(b.rows(grp * r, r));
                    ba.push(a.rows(grp * r, r));
                }
                out.push(("linear_attn.in_proj_qkvz.weight".into(), Raw::cat(&qkvz)));
                out.push(("linear_attn.in_proj_ba.weight".into(), Raw::cat(&ba)));
            } else {
                out.push((
                    "linear_attn.in_proj_qkv.weight".into(),
                    Raw::cat(&[q, k, v]),
                ));
                out.push(("linear_attn.in_proj_z.weight".into(), z));
                out.push(("linear_attn.in_proj_b.weight".into(), b));
                out.push(("linear_attn.in_proj_a.weight".into(), a));
            }
            out.push(("linear_attn.conv1d.weight".into(), g("conv1d.weight")));
            out.push(("linear_attn.dt_bias".into(), g("dt_bias")));
            out.push(("linear_attn.A_log".into(), g("A_log")));
            out.push(("linear_attn.norm.weight".into(), g("out_norm.weight")));
            out.push(("linear_attn.out_proj.weight".into(), g("out_proj.weight")));
        }
    }
    Ok(out)
}

/// The keys (relative to the layer's prefix) and shapes `layout` has for `cfg`.
pub fn layout_specs(cfg: &GdnConfig, layout: Layout) -> Result<Vec<(String, Vec<usize>)>> {
    // The shapes of the converted zero-size-free specs: convert a placeholder of our shapes.
    let w = LayerWeights {
        entries: param_specs(cfg)
            .into_iter()
            .map(|(n, s)| {
                (
                    n.to_string(),
                    Raw {
                        dtype: RawDtype::Bf16,
                        bytes: vec![0; s.iter().product::<usize>() * 2],
                        shape: s,
                    },
                )
            })
            .collect(),
    };
    Ok(to_layout(&w, cfg, layout)?
        .into_iter()
        .map(|(n, r)| (n, r.shape))
        .collect())
}

/// Our weights from `layout`'s tensors (keys relative to the layer's prefix). Missing keys are
/// listed together; a shape that differs from `cfg`'s is an error naming the key.
pub fn from_layout(
    keyed: &BTreeMap<String, Raw>,
    cfg: &GdnConfig,
    layout: Layout,
    source: &str,
) -> Result<LayerWeights> {
    let specs = layout_specs(cfg, layout)?;
    let missing: Vec<String> = specs
        .iter()
        .filter(|(n, _)| !keyed.contains_key(n))
        .map(|(n, s)| format!("{n} {s:?}"))
        .collect();
    if !missing.is_empty() {
        return Err(GdnError::File {
            path: source.into(),
            msg: format!(
                "missing tensors for the {} layout: {}",
                layout.name(),
                missing.join(", ")
            ),
        });
    }
    for (n, s) in &specs {
        let t = &keyed[n];
        if t.shape != *s {
            return Err(GdnError::File {
                path: source.into(),
                msg: format!("tensor {n} has shape {:?}, expected {s:?}", t.shape),
            });
        }
    }
    let k = |n: &str| keyed[n].clone();
    let mut entries = Vec::new();
    for (name, _) in param_specs(cfg) {
        let t = match (layout, name) {
            (Layout::Gdn, _) => k(name),
            (Layout::Megatron, "in_proj.weight") => Raw::cat(
                &in_proj_sections(cfg)
                    .iter()
                    .map(|(s, _)| k(&format!("in_proj.weight.{s}")))
                    .collect::<Vec<_>>(),
            ),
            (Layout::Megatron, "conv1d.weight" | "conv1d.bias") => Raw::cat(
                &conv_sections(cfg)
                    .iter()
                    .map(|(s, _)| k(&format!("{name}.{s}")))
                    .collect::<Vec<_>>(),
            ),
            (Layout::Megatron, _) => k(name),
            (_, "in_proj.layer_norm_weight") => k("input_layernorm.weight"),
            (_, "in_proj.weight") => {
                let (dk, dv, r) = (
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    cfg.head_ratio(),
                );
                let (q, kk, v, z, b, a) = if layout == Layout::HfQwen3Next {
                    let qkvz = k("linear_attn.in_proj_qkvz.weight");
                    let ba = k("linear_attn.in_proj_ba.weight");
                    let per = 2 * dk + 2 * r * dv;
                    let (mut q, mut kk, mut v, mut z, mut b, mut a) =
                        (vec![], vec![], vec![], vec![], vec![], vec![]);
                    for grp in 0..cfg.linear_num_key_heads {
                        let base = grp * per;
                        q.push(qkvz.rows(base, dk));
                        kk.push(qkvz.rows(base + dk, dk));
                        v.push(qkvz.rows(base + 2 * dk, r * dv));
                        z.push(qkvz.rows(base + 2 * dk + r * dv, r * dv));
                        b.push(ba.rows(grp * 2 * r, r));
                        a.push(ba.rows(grp * 2 * r + r, r));
                    }
                    (
                        Raw::cat(&q),
                        Raw::cat(&kk),
                        Raw::cat(&v),
                        Raw::cat(&z),
                        Raw::cat(&b),
                        Raw::cat(&a),
                    )
                } else {
                    let qkv = k("linear_attn.in_proj_qkv.weight");
                    let (qk, vd) = (cfg.qk_dim(), cfg.v_dim());
                    (
                        qkv.rows(0, qk),
                        qkv.rows(qk, qk),
                        qkv.rows(2 * qk, vd),
                        k("linear_attn.in_proj_z.weight"),
                        k("linear_attn.in_proj_b.weight"),
                        k("linear_attn.in_proj_a.weight"),
                    )
                };
                Raw::cat(&[q, kk, v, z, b, a])
            }
            (_, "conv1d.weight") => k("linear_attn.conv1d.weight"),
            (_, "dt_bias") => k("linear_attn.dt_bias"),
            (_, "A_log") => k("linear_attn.A_log"),
            (_, "out_norm.weight") => k("linear_attn.norm.weight"),
            (_, "out_proj.weight") => k("linear_attn.out_proj.weight"),
            (_, other) => {
                return Err(GdnError::Invalid(format!(
                    "parameter {other} has no place in the {} layout",
                    layout.name()
                )))
            }
        };
        entries.push((name.to_string(), t));
    }
    let w = LayerWeights { entries };
    w.check(cfg, source)?;
    Ok(w)
}

/// The safetensors files of a checkpoint at `path`: the file itself, the shards an index file
/// (`*.index.json`) names, or in a directory its `model.safetensors.index.json`, else its
/// `*.safetensors` files. Returns (file, keys it holds or `None` for "read its header").
fn checkpoint_files(path: &Path) -> Result<Vec<(PathBuf, Option<Vec<String>>)>> {
    let index = |p: &Path| -> Result<Vec<(PathBuf, Option<Vec<String>>)>> {
        let v: serde_json::Value = serde_json::from_str(&read_text(p)?)
            .map_err(|e| file_err(p, format!("not a JSON index file: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| file_err(p, "index file has no \"weight_map\" object"))?;
        let dir = p.parent().unwrap_or(Path::new("."));
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (k, f) in map {
            let f = f
                .as_str()
                .ok_or_else(|| file_err(p, format!("weight_map[{k:?}] is not a file name")))?;
            if f.contains('/') || f.contains("..") {
                return Err(file_err(
                    p,
                    format!("weight_map[{k:?}] = {f:?} leaves the folder"),
                ));
            }
            by_file.entry(f.to_string()).or_default().push(k.clone());
        }
        Ok(by_file
            .into_iter()
            .map(|(f, ks)| (dir.join(f), Some(ks)))
            .collect())
    };
    if path.is_dir() {
        let idx = path.join("model.safetensors.index.json");
        if idx.is_file() {
            return index(&idx);
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| io_err(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(file_err(
                path,
                "folder has neither model.safetensors.index.json nor *.safetensors files",
            ));
        }
        return Ok(files.into_iter().map(|f| (f, None)).collect());
    }
    if path.to_string_lossy().ends_with(".json") {
        return index(path);
    }
    Ok(vec![(path.to_path_buf(), None)])
}

fn raw_dtype(d: Dtype, path: &Path, name: &str) -> Result<RawDtype> {
    match d {
        Dtype::F32 => Ok(RawDtype::F32),
        Dtype::BF16 => Ok(RawDtype::Bf16),
        Dtype::F16 => Ok(RawDtype::F16),
        other => Err(file_err(
            path,
            format!("tensor {name} has dtype {other:?}; supported: F32, BF16, F16"),
        )),
    }
}

/// Read layer `layer`'s tensors of `layout` from the checkpoint at `path` (a safetensors file,
/// an index file, or a folder with either), as our layer weights.
pub fn read_layer(
    path: &Path,
    layout: Layout,
    layer: usize,
    cfg: &GdnConfig,
) -> Result<LayerWeights> {
    cfg.validate()?;
    let files = checkpoint_files(path)?;
    // Find the prefix: the key ending in the layout's anchor (under `layers.{layer}.` unless
    // ours, which has no prefix).
    let want_layer = format!("layers.{layer}.");
    let anchor = layout.anchor();
    let mut all_keys: Vec<(usize, String)> = Vec::new();
    let mut loaded: Vec<Option<Vec<u8>>> = vec![None; files.len()];
    for (i, (f, keys)) in files.iter().enumerate() {
        match keys {
            Some(ks) => all_keys.extend(ks.iter().map(|k| (i, k.clone()))),
            None => {
                let buf = read_safetensors_bytes(f)?;
                let (_, meta) = SafeTensors::read_metadata(&buf)
                    .map_err(|e| file_err(f, format!("not a valid safetensors file: {e:?}")))?;
                all_keys.extend(meta.tensors().into_keys().map(|k| (i, k)));
                loaded[i] = Some(buf);
            }
        }
    }
    let prefix = if layout == Layout::Gdn {
        String::new()
    } else {
        let cands: Vec<String> = all_keys
            .iter()
            .filter_map(|(_, k)| k.strip_suffix(anchor))
            .filter(|p| {
                p.ends_with(&want_layer)
                    || p.strip_suffix("self_attention.")
                        .or_else(|| p.strip_suffix("mixer."))
                        .is_some_and(|q| q.ends_with(&want_layer))
            })
            .filter(|p| {
                let at = p.rfind(&want_layer).expect("ends with it");
                at == 0 || p[..at].ends_with('.')
            })
            .map(str::to_string)
            .collect();
        match cands.as_slice() {
            [p] => p.clone(),
            [] => {
                return Err(file_err(
                    path,
                    format!(
                        "no key ends in {want_layer}{anchor} (the {} layout's layer {layer}); \
                         is the layout or the layer index right?",
                        layout.name()
                    ),
                ))
            }
            many => {
                return Err(file_err(
                    path,
                    format!("several layers match layer {layer}: prefixes {many:?}"),
                ))
            }
        }
    };
    // HF's input_layernorm lives beside linear_attn: same prefix.
    let specs = layout_specs(cfg, layout)?;
    let mut keyed = BTreeMap::new();
    for (rel, _) in &specs {
        let full = format!("{prefix}{rel}");
        let Some((i, _)) = all_keys.iter().find(|(_, k)| *k == full) else {
            continue; // reported with the others by from_layout
        };
        let f = &files[*i].0;
        if loaded[*i].is_none() {
            loaded[*i] = Some(read_safetensors_bytes(f)?);
        }
        let buf = loaded[*i].as_ref().expect("loaded");
        let st = SafeTensors::deserialize(buf)
            .map_err(|e| file_err(f, format!("not a valid safetensors file: {e:?}")))?;
        let v = st.tensor(&full).map_err(|_| {
            file_err(
                f,
                format!("the index names tensor {full} but the file lacks it"),
            )
        })?;
        keyed.insert(
            rel.clone(),
            Raw {
                dtype: raw_dtype(v.dtype(), f, &full)?,
                shape: v.shape().to_vec(),
                bytes: v.data().to_vec(),
            },
        );
    }
    let src = format!("{} (layer {layer}, prefix {prefix:?})", path.display());
    from_layout(&keyed, cfg, layout, &src)
}

/// Serialize named tensors to safetensors bytes.
fn serialize(tensors: &[(String, Raw)], path: &Path) -> Result<Vec<u8>> {
    let mut seen = std::collections::HashSet::new();
    for (n, _) in tensors {
        if !seen.insert(n.as_str()) {
            return Err(file_err(path, format!("tensor name {n} given twice")));
        }
    }
    let meta = Some([("format".to_string(), "pt".to_string())].into());
    safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), &meta)
        .map_err(|e| file_err(path, format!("cannot serialize: {e:?}")))
}

/// Write `tensors` (full keys) as `layout` does: one safetensors file at `out` (ours, Megatron),
/// or a folder `out` with `shards` shards and `model.safetensors.index.json` (HF). Every file
/// is written atomically; `out` must not exist unless `force`.
pub fn write_checkpoint(
    out: &Path,
    layout: Layout,
    tensors: &[(String, Raw)],
    shards: usize,
    force: bool,
) -> Result<()> {
    if !force && std::fs::symlink_metadata(out).is_ok() {
        return Err(file_err(out, "exists; pass --force to overwrite it"));
    }
    if !layout.is_hf() {
        return write_atomic(out, &serialize(tensors, out)?);
    }
    if out.exists() && !out.is_dir() {
        return Err(file_err(
            out,
            "exists and is not a folder (the HF layouts are folders)",
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| io_err(out, e))?;
    let shards = shards.clamp(1, tensors.len().max(1));
    let per = tensors.len().div_ceil(shards);
    let mut map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, chunk) in tensors.chunks(per.max(1)).enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
        let p = out.join(&name);
        write_atomic(&p, &serialize(chunk, &p)?)?;
        for (n, t) in chunk {
            map.insert(n.clone(), serde_json::Value::String(name.clone()));
            total += t.bytes.len();
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": map,
    });
    let p = out.join("model.safetensors.index.json");
    write_atomic(
        &p,
        serde_json::to_string_pretty(&index)
            .map_err(|e| file_err(&p, e.to_string()))?
            .as_bytes(),
    )
}

/// Convert layer `layer` of the checkpoint at `input` from one layout to another, writing `out`
/// (the same layer index in the output's keys).
pub fn convert(
    input: &Path,
    from: Layout,
    to: Layout,
    layer: usize,
    cfg: &GdnConfig,
    out: &Path,
    force: bool,
) -> Result<()> {
    if !force && std::fs::symlink_metadata(out).is_ok() {
        return Err(file_err(out, "exists; pass --force to overwrite it"));
    }
    let w = read_layer(input, from, layer, cfg)?;
    let prefix = to.default_prefix(layer);
    let keyed: Vec<(String, Raw)> = to_layout(&w, cfg, to)?
        .into_iter()
        .map(|(n, t)| (format!("{prefix}{n}"), t))
        .collect();
    write_checkpoint(out, to, &keyed, 1, force)
}

/// A layer config from a Hugging Face `config.json` (Qwen3-Next's fields, or Qwen3.5's under
/// `text_config`): heads, head dims, conv width, hidden size, `rms_norm_eps`; RMSNorm with
/// zero-centered gamma (HF's `input_layernorm`), q/k L2 norm.
pub fn config_from_hf_json(text: &str, source: &Path) -> Result<GdnConfig> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| file_err(source, format!("not JSON: {e}")))?;
    let c = v.get("text_config").unwrap_or(&v);
    let int = |k: &str| -> Result<usize> {
        c.get(k)
            .and_then(|x| x.as_u64())
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| file_err(source, format!("missing integer field {k:?}")))
    };
    let cfg = GdnConfig {
        hidden_size: int("hidden_size")?,
        num_layers: int("num_hidden_layers").unwrap_or(1),
        linear_num_key_heads: int("linear_num_key_heads")?,
        linear_num_value_heads: int("linear_num_value_heads")?,
        linear_key_head_dim: int("linear_key_head_dim")?,
        linear_value_head_dim: int("linear_value_head_dim")?,
        linear_conv_kernel_dim: int("linear_conv_kernel_dim")?,
        layernorm_epsilon: c
            .get("rms_norm_eps")
            .and_then(|x| x.as_f64())
            .unwrap_or(1e-6) as f32,
        layernorm_zero_centered_gamma: true,
        normalization: Normalization::RMSNorm,
        use_qk_l2norm: true,
        ..GdnConfig::default()
    };
    cfg.validate()?;
    Ok(cfg)
}
