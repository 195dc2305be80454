//! `GdnConfig`: Megatron's field names and defaults, TOML loading, and `validate()`.

use serde::{Deserialize, Serialize};

use crate::error::{GdnError, Result};

/// Which layer: Gated DeltaNet (scalar decay and beta per value head) or Gated DeltaNet-2
/// (per-channel decay, separate erase and write gates).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// Gated DeltaNet; `gated_delta_net` is accepted as Megatron's deprecated alias.
    #[default]
    #[serde(alias = "gated_delta_net")]
    Gdn,
    /// Gated DeltaNet-2.
    Gdn2,
}

/// Normalization used by the fused pre-norm of `in_proj` and by the output norm's statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Normalization {
    /// Megatron's default.
    #[default]
    LayerNorm,
    /// What Qwen3-Next / Qwen3.5 use.
    RMSNorm,
}

/// `recompute_granularity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecomputeGranularity {
    /// Recompute the whole layer in backward (only the layer input is kept).
    Full,
    /// Recompute the modules named in `recompute_modules`.
    Selective,
}

/// Recompute module names Megatron accepts (main), plus `gdn` (whole-layer recompute, Megatron's
/// dev branch) and our `gdn_prep`. Only `gdn_norm_out` and `gdn` act on this layer; the others
/// belong to other modules of a transformer and are accepted so a Megatron config loads
/// unchanged. `gdn_prep` (rebuild conv + SiLU, q/k L2 norm and gates from in_proj's output in
/// backward instead of keeping them) is what the layer does by default since
/// [`GdnConfig::keep_rule_inputs`] exists; the name stays accepted, with no further effect, so
/// configs written for earlier versions load unchanged.
pub const RECOMPUTE_MODULES: &[&str] = &[
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
    "gdn_norm_out",
    "gdp_in_proj",
    "gdp_qkv",
    "mhc",
    "gdn",
    "gdn_prep",
];

/// Configuration of one GDN / GDN2 layer. Field names and defaults follow Megatron-LM's
/// `TransformerConfig` (see `reference/megatron-gdn.md` section 4), plus the constructor
/// arguments Megatron passes separately (`use_qk_l2norm`, `conv_bias`, `a_init_range`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GdnConfig {
    /// Model width `h`.
    #[serde(serialize_with = "int")]
    pub hidden_size: usize,
    /// Number of layers of the model; only used by `out_proj`'s init std `0.02/sqrt(2*num_layers)`.
    #[serde(serialize_with = "int")]
    pub num_layers: usize,
    /// `Hk`.
    #[serde(serialize_with = "int")]
    pub linear_num_key_heads: usize,
    /// `Hv`, a multiple of `Hk` (value head `j` reads key head `j / (Hv/Hk)`).
    #[serde(serialize_with = "int")]
    pub linear_num_value_heads: usize,
    /// `Dk`.
    #[serde(serialize_with = "int")]
    pub linear_key_head_dim: usize,
    /// `Dv`.
    #[serde(serialize_with = "int")]
    pub linear_value_head_dim: usize,
    /// `W`, the causal conv1d kernel width.
    #[serde(serialize_with = "int")]
    pub linear_conv_kernel_dim: usize,
    /// Epsilon of the input norm and the output norm.
    #[serde(serialize_with = "short_f32")]
    pub layernorm_epsilon: f32,
    /// Norm weights parametrised as `1 + w` (Megatron's `--apply-layernorm-1p`).
    pub layernorm_zero_centered_gamma: bool,
    /// Input norm type (and output norm statistics: the output norm is always RMS over `Dv`).
    pub normalization: Normalization,
    /// L2-normalize q and k per head (`x * rsqrt(sum x^2 + 1e-6)`).
    pub use_qk_l2norm: bool,
    /// Do the q/k L2 norm inside the gated-delta-rule kernel, so no normalized copy is kept.
    pub use_qk_l2norm_in_kernel: bool,
    /// `A_log = ln U(a_init_range)`.
    #[serde(serialize_with = "short_f32_pair")]
    pub a_init_range: (f32, f32),
    /// Bias on the depthwise conv.
    pub conv_bias: bool,
    /// Std of `in_proj`'s init (`init_method_std`).
    #[serde(serialize_with = "short_f32")]
    pub init_method_std: f32,
    /// Accepted for Megatron parity; this library is always deterministic.
    pub deterministic_mode: bool,
    /// `None`, `"full"` or `"selective"`.
    pub recompute_granularity: Option<RecomputeGranularity>,
    /// Megatron's `recompute_method` (`"uniform"` | `"block"`); accepted and checked, and has no
    /// effect on a single layer.
    pub recompute_method: Option<String>,
    /// Modules to recompute under `"selective"`: `gdn_norm_out` and/or `gdn` act on this layer
    /// (`gdn_prep` is accepted and means the default, see `keep_rule_inputs`).
    pub recompute_modules: Option<Vec<String>>,
    /// Keep the rule's inputs (conv + SiLU outputs q, k, v, the normalized q/k copy, the gates)
    /// from forward to backward, as Megatron does. Default `false`: backward rebuilds them from
    /// in_proj's output (which is kept) with the same kernels, so the results are bitwise the
    /// same and the layer keeps less (Qwen3-Next's layer in bf16: 45,316 instead of 70,084
    /// bytes per token), at ~3% of the layer's time (1.028x measured on the H200). GDN2 by
    /// default also keeps only the `[q|k|v|z]` columns of in_proj's output and reruns the GEMM
    /// of its gate rows in backward (45,188 instead of 123,012 bytes per token). Cannot be
    /// combined with `gdn_prep`, `gdn` or `full` recompute, which do not keep them.
    pub keep_rule_inputs: bool,
    /// `gdn` or `gdn2`.
    pub variant: Variant,
}

impl Default for GdnConfig {
    fn default() -> Self {
        GdnConfig {
            hidden_size: 2048,
            num_layers: 1,
            linear_num_key_heads: 16,
            linear_num_value_heads: 32,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            layernorm_epsilon: 1e-5,
            layernorm_zero_centered_gamma: false,
            normalization: Normalization::LayerNorm,
            use_qk_l2norm: true,
            use_qk_l2norm_in_kernel: false,
            a_init_range: (1.0, 16.0),
            conv_bias: false,
            init_method_std: 0.02,
            deterministic_mode: false,
            recompute_granularity: None,
            recompute_method: None,
            recompute_modules: None,
            keep_rule_inputs: false,
            variant: Variant::Gdn,
        }
    }
}

/// What the layer recomputes in backward, resolved from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Recompute {
    /// `gdn_norm_out`: drop the gated norm's output after `out_proj`, rebuild it in backward.
    pub norm_out: bool,
    /// `gdn` or `full`: keep only the layer input, rerun forward in backward.
    pub whole_layer: bool,
    /// Keep in_proj's output but not the conv outputs, normalized q/k and gates; rebuild them in
    /// backward (cheap elementwise work next to the projections). The default: `false` only
    /// under `keep_rule_inputs` (or whole-layer recompute, which keeps neither).
    pub prep: bool,
}

impl GdnConfig {
    /// Qwen3-Next's GDN layer: hidden 2048, 16 key / 32 value heads, Dk = Dv = 128, RMSNorm.
    pub fn qwen3_next() -> Self {
        GdnConfig {
            normalization: Normalization::RMSNorm,
            ..Default::default()
        }
    }

    /// Parse a TOML document (unknown keys are an error) and validate it. Errors name the key,
    /// the value given and what was expected.
    pub fn from_toml_str(s: &str) -> Result<Self> {
        let t: toml::Table = toml::from_str(s).map_err(|e| toml_syntax_error(s, &e))?;
        let cfg: GdnConfig = from_table_naming_key("", &toml::Table::new(), t)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read and validate a TOML file.
    pub fn from_toml_file(path: &std::path::Path) -> Result<Self> {
        let s = crate::io::read_text(path)?;
        Self::from_toml_str(&s).map_err(|e| match e {
            GdnError::Config { field, msg } => GdnError::Config {
                field,
                msg: format!("{msg} (in {})", path.display()),
            },
            e => e,
        })
    }

    /// The TOML text of this config (f32 fields in their shortest form, `1e-5` not
    /// `0.000009999999747378752`). Never panics: an integer beyond TOML's 64-bit range (which
    /// `validate()` refuses) is written as a string.
    pub fn to_toml_string(&self) -> String {
        to_toml_text(self)
    }

    /// `Hk * Dk` (saturating; `validate()` guarantees no overflow).
    pub fn qk_dim(&self) -> usize {
        self.linear_num_key_heads
            .saturating_mul(self.linear_key_head_dim)
    }
    /// `Hv * Dv` (saturating; `validate()` guarantees no overflow).
    pub fn v_dim(&self) -> usize {
        self.linear_num_value_heads
            .saturating_mul(self.linear_value_head_dim)
    }
    /// Channels of the depthwise conv: `2*qk_dim + v_dim` (saturating).
    pub fn conv_dim(&self) -> usize {
        self.qk_dim().saturating_mul(2).saturating_add(self.v_dim())
    }
    /// `Hv / Hk`.
    pub fn head_ratio(&self) -> usize {
        self.linear_num_value_heads / self.linear_num_key_heads.max(1)
    }
    /// Rows of `in_proj.weight`: `2qk + 2v + 2Hv` (GDN) or `4qk + 3v` (GDN2) (saturating).
    pub fn in_proj_dim(&self) -> usize {
        let (qk, v) = (self.qk_dim(), self.v_dim());
        match self.variant {
            Variant::Gdn => qk
                .saturating_mul(2)
                .saturating_add(v.saturating_mul(2))
                .saturating_add(self.linear_num_value_heads.saturating_mul(2)),
            Variant::Gdn2 => qk.saturating_mul(4).saturating_add(v.saturating_mul(3)),
        }
    }

    /// Values of the layer's parameters (all of [`crate::layer::param_specs`]), in `u128`
    /// (saturating: `u128::MAX` means "at least").
    pub fn param_count(&self) -> u128 {
        crate::layer::param_specs(self)
            .iter()
            .map(|(_, shape)| crate::budget::bytes_of(shape, 1))
            .fold(0u128, u128::saturating_add)
    }

    /// Bytes of the layer's parameters in f32.
    pub fn param_bytes(&self) -> u128 {
        crate::budget::mul(self.param_count(), 4)
    }

    /// What allocating this layer's parameters is, with the sizes that make it (for
    /// [`GdnError::Memory`] messages).
    pub fn describe_params(&self) -> String {
        format!(
            "allocating the layer's parameters ({} values in f32: hidden_size {}, in_proj rows {}, conv channels {}, value dim {})",
            self.param_count(),
            self.hidden_size,
            self.in_proj_dim(),
            self.conv_dim(),
            self.v_dim()
        )
    }

    /// A lower bound of the bytes one forward over `tokens` tokens allocates besides the
    /// parameters and its input: in_proj's output, the conv's output and the output, f32 each.
    pub fn forward_bytes_at_least(&self, tokens: usize) -> u128 {
        let per_token = (self.hidden_size as u128)
            .saturating_add(self.in_proj_dim() as u128)
            .saturating_add(self.conv_dim() as u128);
        crate::budget::mul(crate::budget::mul(per_token, tokens as u128), 4)
    }
    /// Default attention scale `Dk^-1/2`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.linear_key_head_dim as f32).sqrt()
    }

    /// Whether `recompute_modules` names module `m`.
    fn has_module(&self, m: &str) -> bool {
        self.recompute_modules
            .as_ref()
            .is_some_and(|v| v.iter().any(|x| x == m))
    }

    /// The recompute settings acting on this layer (call after `validate`).
    pub fn recompute(&self) -> Recompute {
        let has = |m: &str| self.has_module(m);
        // `gdn_prep` needs no case: rebuilding the rule's inputs is the default.
        let prep = !self.keep_rule_inputs;
        match self.recompute_granularity {
            None => Recompute {
                norm_out: false,
                whole_layer: false,
                prep,
            },
            Some(RecomputeGranularity::Full) => Recompute {
                norm_out: false,
                whole_layer: true,
                prep: false,
            },
            Some(RecomputeGranularity::Selective) => Recompute {
                norm_out: has("gdn_norm_out"),
                whole_layer: has("gdn"),
                prep: prep && !has("gdn"),
            },
        }
    }

    /// Check every rule of Megatron's `TransformerConfig.__post_init__` that applies to a GDN
    /// layer, plus our own. The error names the field.
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(GdnError::config(
                    name,
                    format!("{name} must be set for gated delta net (got 0)."),
                ));
            }
            check_toml_int(name, v as u128)?;
        }
        // Products of sizes: each must fit in usize (the code computes them as usize), and the
        // parameters in one allocation.
        let products = [
            (
                "linear_num_key_heads x linear_key_head_dim",
                [self.linear_num_key_heads, self.linear_key_head_dim],
            ),
            (
                "linear_num_value_heads x linear_value_head_dim",
                [self.linear_num_value_heads, self.linear_value_head_dim],
            ),
        ];
        for (what, [a, b]) in products {
            if a.checked_mul(b).is_none() {
                return Err(GdnError::config(
                    what.split(' ').next().unwrap_or(what),
                    format!("{what} = {a} x {b} overflows (more than {})", usize::MAX),
                ));
            }
        }
        crate::budget::check_addressable(&self.describe_params(), self.param_bytes())?;
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return Err(GdnError::config(
                "linear_num_value_heads",
                format!(
                    "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({}).",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if !(self.layernorm_epsilon.is_finite() && self.layernorm_epsilon > 0.0) {
            return Err(GdnError::config(
                "layernorm_epsilon",
                format!("must be finite and > 0 (got {})", self.layernorm_epsilon),
            ));
        }
        let (lo, hi) = self.a_init_range;
        if !(lo.is_finite() && hi.is_finite() && lo > 0.0 && lo <= hi) {
            return Err(GdnError::config(
                "a_init_range",
                format!("must be (lo, hi) with 0 < lo <= hi, both finite (got ({lo}, {hi})); A_log = ln U(lo, hi)"),
            ));
        }
        if !(self.init_method_std.is_finite() && self.init_method_std >= 0.0) {
            return Err(GdnError::config(
                "init_method_std",
                format!("must be finite and >= 0 (got {})", self.init_method_std),
            ));
        }
        if self.use_qk_l2norm_in_kernel && !self.use_qk_l2norm {
            return Err(GdnError::config(
                "use_qk_l2norm_in_kernel",
                "use_qk_l2norm_in_kernel = true needs use_qk_l2norm = true (it moves that norm into the kernel)",
            ));
        }
        if let Some(m) = &self.recompute_method {
            if m != "uniform" && m != "block" {
                return Err(GdnError::config(
                    "recompute_method",
                    format!("recompute_method: {m} must be \"block\" or \"uniform\"."),
                ));
            }
        }
        if self.keep_rule_inputs {
            let has = |m: &str| self.has_module(m);
            let conflict = match self.recompute_granularity {
                Some(RecomputeGranularity::Full) => Some("recompute_granularity = \"full\""),
                Some(RecomputeGranularity::Selective) if has("gdn") => {
                    Some("'gdn' in recompute_modules")
                }
                Some(RecomputeGranularity::Selective) if has("gdn_prep") => {
                    Some("'gdn_prep' in recompute_modules")
                }
                _ => None,
            };
            if let Some(what) = conflict {
                return Err(GdnError::config(
                    "keep_rule_inputs",
                    format!(
                        "keep_rule_inputs = true and {what} cannot be used together: \
                         keep_rule_inputs keeps the rule's inputs (conv outputs, normalized q/k, \
                         gates) for backward, {what} rebuilds them in backward; \
                         drop one of the two"
                    ),
                ));
            }
        }
        if let Some(mods) = &self.recompute_modules {
            let bad: Vec<&String> = mods
                .iter()
                .filter(|m| !RECOMPUTE_MODULES.contains(&m.as_str()))
                .collect();
            if !bad.is_empty() {
                return Err(GdnError::config(
                    "recompute_modules",
                    format!(
                        "Invalid choices for recompute_modules: {bad:?}. Allowed modules are: {RECOMPUTE_MODULES:?}"
                    ),
                ));
            }
            let has = |m: &str| self.has_module(m);
            if has("gdn") && has("gdn_norm_out") {
                return Err(GdnError::config(
                    "recompute_modules",
                    "'gdn' and 'gdn_norm_out' in recompute_modules cannot be used together: \
                     'gdn' already recomputes the gated norm (it recomputes the whole GatedDeltaNet layer)",
                ));
            }
            if self.recompute_granularity.is_none()
                && (has("gdn") || has("gdn_norm_out") || has("gdn_prep"))
            {
                return Err(GdnError::config(
                    "recompute_granularity",
                    "recompute_modules names gdn/gdn_norm_out/gdn_prep but recompute_granularity is not set; \
                     set recompute_granularity = \"selective\"",
                ));
            }
        }
        Ok(())
    }
}

/// The largest integer a TOML document holds (TOML integers are 64-bit signed).
pub const TOML_INT_MAX: u64 = i64::MAX as u64;

/// Error unless `v` fits in a TOML integer (`0..=9223372036854775807`), so the config can be
/// written and read back.
pub(crate) fn check_toml_int(field: &str, v: u128) -> Result<()> {
    if v > TOML_INT_MAX as u128 {
        return Err(GdnError::config(
            field,
            format!("must be in 0..={TOML_INT_MAX} (TOML integers are 64-bit signed), got {v}"),
        ));
    }
    Ok(())
}

/// Serialize an integer as a TOML integer, or as a string where it exceeds TOML's range (a
/// config `validate()` refuses; this keeps writing it from failing).
pub(crate) fn int<T, S>(v: &T, s: S) -> std::result::Result<S::Ok, S::Error>
where
    T: Copy + TryInto<i64> + std::fmt::Display,
    S: serde::Serializer,
{
    match (*v).try_into() {
        Ok(i) => s.serialize_i64(i),
        Err(_) => s.serialize_str(&v.to_string()),
    }
}

/// [`int`] for an optional integer.
pub(crate) fn opt_int<T, S>(v: &Option<T>, s: S) -> std::result::Result<S::Ok, S::Error>
where
    T: Copy + TryInto<i64> + std::fmt::Display,
    S: serde::Serializer,
{
    match v {
        Some(x) => int(x, s),
        None => s.serialize_none(),
    }
}

/// The shortest decimal that reads back to the same f32 (`1e-5`, not
/// `0.000009999999747378752`), as the f64 TOML stores.
pub(crate) fn shortest_f32(v: f32) -> f64 {
    format!("{v}").parse::<f64>().unwrap_or(v as f64)
}

/// Serialize an f32 in its shortest round-trip form ([`shortest_f32`]).
pub(crate) fn short_f32<S: serde::Serializer>(
    v: &f32,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(shortest_f32(*v))
}

/// [`short_f32`] for a pair.
pub(crate) fn short_f32_pair<S: serde::Serializer>(
    v: &(f32, f32),
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeTuple;
    let mut t = s.serialize_tuple(2)?;
    t.serialize_element(&shortest_f32(v.0))?;
    t.serialize_element(&shortest_f32(v.1))?;
    t.end()
}

/// TOML text of a config. Its fields are integers (through [`int`]), floats, booleans,
/// strings, arrays and tables, which always serialize; should that ever fail, the text holds
/// the error as a comment (and reads back as a config with defaults), never a panic.
pub(crate) fn to_toml_text<T: Serialize>(v: &T) -> String {
    toml::to_string(v).unwrap_or_else(|e| format!("# cannot write this config as TOML: {e}\n"))
}

/// A TOML syntax error (or an integer beyond 64 bits) as a config error naming the line, the
/// key written on it (with its `[section]`) and the message.
pub(crate) fn toml_syntax_error(src: &str, e: &toml::de::Error) -> GdnError {
    let mut msg = e.message().trim().to_string();
    if msg.contains("too large") || msg.contains("too small") {
        msg.push_str(&format!(
            " (TOML integers are 64-bit signed: -9223372036854775808..={TOML_INT_MAX})"
        ));
    }
    let Some(span) = e.span() else {
        return GdnError::config("toml", msg);
    };
    let mut start = span.start.min(src.len());
    while !src.is_char_boundary(start) {
        start -= 1;
    }
    let before = &src[..start];
    let line_no = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = src[line_start..].lines().next().unwrap_or("").trim();
    let shown: String = line.chars().take(80).collect();
    let shown = if shown.len() < line.len() {
        format!("{shown}...")
    } else {
        shown
    };
    let section = src[..line_start].lines().rev().find_map(|l| {
        let l = l.trim();
        l.starts_with('[')
            .then(|| l.trim_matches(|c| c == '[' || c == ']').trim().to_string())
    });
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"').to_string())
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    let field = match (section, key) {
        (Some(sec), Some(k)) => format!("{sec}.{k}"),
        (None, Some(k)) => k,
        _ => "toml".to_string(),
    };
    GdnError::config(&field, format!("line {line_no} (`{shown}`): {msg}"))
}

/// Deserialize `T` from `base` with `user`'s keys over it. On an error, the key at fault is
/// found by trying each of `user`'s keys alone over `base`, and the error names it
/// (`{prefix}{key}`), with the value given and what was expected.
pub(crate) fn from_table_naming_key<T: serde::de::DeserializeOwned>(
    prefix: &str,
    base: &toml::Table,
    user: toml::Table,
) -> Result<T> {
    let mut all = base.clone();
    all.extend(user.clone());
    let err = match toml::Value::Table(all).try_into::<T>() {
        Ok(v) => return Ok(v),
        Err(e) => e,
    };
    for (k, v) in user {
        let mut one = base.clone();
        one.insert(k.clone(), v.clone());
        if let Err(e) = toml::Value::Table(one).try_into::<T>() {
            return Err(GdnError::config(
                &format!("{prefix}{k}"),
                format!("{} (got {k} = {})", readable(e.message()), short_value(&v)),
            ));
        }
    }
    let section = prefix.trim_end_matches('.');
    Err(GdnError::config(
        if section.is_empty() { "toml" } else { section },
        readable(err.message()),
    ))
}

/// serde's message with Rust type names said as TOML values.
fn readable(msg: &str) -> String {
    msg.replace(
        "expected usize",
        &format!("expected an integer in 0..={TOML_INT_MAX}"),
    )
    .replace(
        "expected u64",
        &format!("expected an integer in 0..={TOML_INT_MAX}"),
    )
    .replace("expected f32", "expected a number")
    .replace("expected f64", "expected a number")
    .trim()
    .to_string()
}

/// A TOML value as written, cut to 80 characters.
fn short_value(v: &toml::Value) -> String {
    let s = v.to_string();
    let cut: String = s.chars().take(80).collect();
    if cut.len() < s.len() {
        format!("{cut}...")
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(mods: &[&str]) -> GdnConfig {
        GdnConfig {
            recompute_granularity: Some(RecomputeGranularity::Selective),
            recompute_modules: Some(mods.iter().map(|m| m.to_string()).collect()),
            ..GdnConfig::default()
        }
    }

    /// The default rebuilds the rule's inputs in backward; `keep_rule_inputs` keeps them;
    /// `gdn_prep` is accepted and means the default.
    #[test]
    fn rule_inputs_are_rebuilt_by_default() {
        let d = GdnConfig::default();
        assert!(!d.keep_rule_inputs);
        d.validate().unwrap();
        assert_eq!(
            d.recompute(),
            Recompute {
                norm_out: false,
                whole_layer: false,
                prep: true
            }
        );
        let keep = GdnConfig {
            keep_rule_inputs: true,
            ..GdnConfig::default()
        };
        keep.validate().unwrap();
        assert_eq!(keep.recompute(), Recompute::default());
        let p = sel(&["gdn_prep"]);
        p.validate().unwrap();
        assert_eq!(p.recompute(), d.recompute(), "gdn_prep is the default");
        let pn = sel(&["gdn_prep", "gdn_norm_out"]);
        pn.validate().unwrap();
        assert_eq!(pn.recompute(), sel(&["gdn_norm_out"]).recompute());
        assert!(sel(&["gdn_norm_out"]).recompute().prep);
        let kn = GdnConfig {
            keep_rule_inputs: true,
            ..sel(&["gdn_norm_out"])
        };
        kn.validate().unwrap();
        assert_eq!(
            kn.recompute(),
            Recompute {
                norm_out: true,
                whole_layer: false,
                prep: false
            }
        );
        // Whole-layer recompute keeps neither; `prep` stays off there.
        for c in [
            sel(&["gdn"]),
            GdnConfig {
                recompute_granularity: Some(RecomputeGranularity::Full),
                ..GdnConfig::default()
            },
        ] {
            c.validate().unwrap();
            let r = c.recompute();
            assert!(r.whole_layer && !r.prep, "{r:?}");
        }
    }

    /// The field reads from and writes to TOML; configs without it get the default.
    #[test]
    fn keep_rule_inputs_in_toml() {
        let c = GdnConfig::from_toml_str("keep_rule_inputs = true\n").unwrap();
        assert!(c.keep_rule_inputs);
        assert!(!c.recompute().prep);
        assert!(
            !GdnConfig::from_toml_str("hidden_size = 64\n")
                .unwrap()
                .keep_rule_inputs
        );
        let t = c.to_toml_string();
        assert!(t.contains("keep_rule_inputs = true\n"), "{t}");
        assert_eq!(GdnConfig::from_toml_str(&t).unwrap(), c);
        let e = GdnConfig::from_toml_str("keep_rule_inputs = 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("keep_rule_inputs"), "{e}");
    }

    fn conflict(c: &GdnConfig, what: &str) {
        let e = c.validate().unwrap_err();
        match &e {
            GdnError::Config { field, msg } => {
                assert_eq!(field, "keep_rule_inputs", "{e}");
                assert!(msg.contains("cannot be used together"), "{e}");
                assert!(msg.contains(what), "{e}");
            }
            _ => panic!("not a config error: {e}"),
        }
    }

    #[test]
    fn keep_rule_inputs_with_gdn_prep_is_an_error() {
        let c = GdnConfig {
            keep_rule_inputs: true,
            ..sel(&["gdn_prep"])
        };
        conflict(&c, "'gdn_prep' in recompute_modules");
        let c = GdnConfig {
            keep_rule_inputs: true,
            ..sel(&["gdn_norm_out", "gdn_prep"])
        };
        conflict(&c, "'gdn_prep' in recompute_modules");
        let e = GdnConfig::from_toml_str(
            "keep_rule_inputs = true\nrecompute_granularity = \"selective\"\n\
             recompute_modules = [\"gdn_prep\"]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("keep_rule_inputs") && e.contains("gdn_prep"),
            "{e}"
        );
    }

    #[test]
    fn keep_rule_inputs_with_gdn_is_an_error() {
        let c = GdnConfig {
            keep_rule_inputs: true,
            ..sel(&["gdn"])
        };
        conflict(&c, "'gdn' in recompute_modules");
    }

    #[test]
    fn keep_rule_inputs_with_full_is_an_error() {
        let c = GdnConfig {
            keep_rule_inputs: true,
            recompute_granularity: Some(RecomputeGranularity::Full),
            ..GdnConfig::default()
        };
        conflict(&c, "recompute_granularity = \"full\"");
    }
}
