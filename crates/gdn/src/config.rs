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
/// dev branch) and our `gdn_prep` (rebuild conv + SiLU, q/k L2 norm and gates from in_proj's
/// output in backward instead of keeping them). Only `gdn_norm_out`, `gdn` and `gdn_prep` act on this layer; the others belong to other
/// modules of a transformer and are accepted so a Megatron config loads unchanged.
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
    pub hidden_size: usize,
    /// Number of layers of the model; only used by `out_proj`'s init std `0.02/sqrt(2*num_layers)`.
    pub num_layers: usize,
    /// `Hk`.
    pub linear_num_key_heads: usize,
    /// `Hv`, a multiple of `Hk` (value head `j` reads key head `j / (Hv/Hk)`).
    pub linear_num_value_heads: usize,
    /// `Dk`.
    pub linear_key_head_dim: usize,
    /// `Dv`.
    pub linear_value_head_dim: usize,
    /// `W`, the causal conv1d kernel width.
    pub linear_conv_kernel_dim: usize,
    /// Epsilon of the input norm and the output norm.
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
    pub a_init_range: (f32, f32),
    /// Bias on the depthwise conv.
    pub conv_bias: bool,
    /// Std of `in_proj`'s init (`init_method_std`).
    pub init_method_std: f32,
    /// Accepted for Megatron parity; this library is always deterministic.
    pub deterministic_mode: bool,
    /// `None`, `"full"` or `"selective"`.
    pub recompute_granularity: Option<RecomputeGranularity>,
    /// Megatron's `recompute_method` (`"uniform"` | `"block"`); accepted and checked, and has no
    /// effect on a single layer.
    pub recompute_method: Option<String>,
    /// Modules to recompute under `"selective"`: `gdn_norm_out` and/or `gdn` act on this layer.
    pub recompute_modules: Option<Vec<String>>,
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
    /// `gdn_prep`: keep in_proj's output but not the conv outputs, normalized q/k and gates;
    /// rebuild them in backward (cheap elementwise work next to the projections).
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

    /// Parse a TOML document (unknown keys are an error) and validate it.
    pub fn from_toml_str(s: &str) -> Result<Self> {
        let cfg: GdnConfig =
            toml::from_str(s).map_err(|e| GdnError::config("toml", e.message().to_string()))?;
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

    /// The TOML text of this config.
    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).expect("GdnConfig always serializes")
    }

    /// `Hk * Dk`.
    pub fn qk_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// `Hv * Dv`.
    pub fn v_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the depthwise conv: `2*qk_dim + v_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.qk_dim() + self.v_dim()
    }
    /// `Hv / Hk`.
    pub fn head_ratio(&self) -> usize {
        self.linear_num_value_heads / self.linear_num_key_heads.max(1)
    }
    /// Rows of `in_proj.weight`: `2qk + 2v + 2Hv` (GDN) or `4qk + 3v` (GDN2).
    pub fn in_proj_dim(&self) -> usize {
        match self.variant {
            Variant::Gdn => 2 * self.qk_dim() + 2 * self.v_dim() + 2 * self.linear_num_value_heads,
            Variant::Gdn2 => 4 * self.qk_dim() + 3 * self.v_dim(),
        }
    }
    /// Default attention scale `Dk^-1/2`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.linear_key_head_dim as f32).sqrt()
    }

    /// The recompute settings acting on this layer (call after `validate`).
    pub fn recompute(&self) -> Recompute {
        let has = |m: &str| {
            self.recompute_modules
                .as_ref()
                .is_some_and(|v| v.iter().any(|x| x == m))
        };
        match self.recompute_granularity {
            None => Recompute::default(),
            Some(RecomputeGranularity::Full) => Recompute {
                norm_out: false,
                whole_layer: true,
                prep: false,
            },
            Some(RecomputeGranularity::Selective) => Recompute {
                norm_out: has("gdn_norm_out"),
                whole_layer: has("gdn"),
                prep: has("gdn_prep") && !has("gdn"),
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
        }
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
            let has = |x: &str| mods.iter().any(|m| m == x);
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
