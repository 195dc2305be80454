//! `ModelConfig`: the language model around the GDN layer.

use serde::{Deserialize, Serialize};

use crate::budget::mul;
use crate::config::{check_toml_int, GdnConfig, Normalization, RecomputeGranularity};
use crate::error::{GdnError, Result};

/// A small language model: token embedding, `layer.num_layers` blocks of
/// [GDN / GDN2 layer (with its fused pre-norm) + residual] + [norm, SwiGLU MLP, residual], a final
/// norm and the LM head.
///
/// Width, depth, norms, init std, recompute and variant come from the layer's [`GdnConfig`]
/// (Megatron keeps them in one `TransformerConfig`): `hidden_size` is the model width,
/// `num_layers` the number of blocks (and sets `out_proj`'s and `linear_fc2`'s init std
/// `init_method_std / sqrt(2 num_layers)`), `normalization` / `layernorm_epsilon` /
/// `layernorm_zero_centered_gamma` apply to every norm of the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Tokens of the vocabulary.
    #[serde(serialize_with = "crate::config::int")]
    pub vocab_size: usize,
    /// `F`, the MLP's hidden width (`linear_fc1` gives `2F`: SwiGLU's gate and up halves).
    #[serde(serialize_with = "crate::config::int")]
    pub ffn_hidden_size: usize,
    /// LM head tied to the embedding (Megatron's `share_embeddings_and_output_weights`).
    pub share_embeddings_and_output_weights: bool,
    /// The GDN layer of every block, and the model's width, depth and norm settings.
    pub layer: GdnConfig,
}

impl ModelConfig {
    /// Check every field; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.vocab_size == 0 {
            return Err(GdnError::Config {
                field: "vocab_size".into(),
                msg: "must be > 0".into(),
            });
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(GdnError::Config {
                field: "vocab_size".into(),
                msg: format!("must be < 2^31 (got {})", self.vocab_size),
            });
        }
        if self.ffn_hidden_size == 0 {
            return Err(GdnError::Config {
                field: "ffn_hidden_size".into(),
                msg: "must be > 0".into(),
            });
        }
        check_toml_int("ffn_hidden_size", self.ffn_hidden_size as u128)?;
        self.layer.validate()?;
        crate::budget::check_addressable(&self.describe_params(), self.param_bytes())?;
        if self.layer.recompute_granularity.is_none()
            && self
                .layer
                .recompute_modules
                .as_ref()
                .is_some_and(|m| m.iter().any(|x| x == "mlp"))
        {
            return Err(GdnError::Config {
                field: "recompute_granularity".into(),
                msg: "recompute_modules names mlp but recompute_granularity is not set; \
                      set recompute_granularity = \"selective\""
                    .into(),
            });
        }
        Ok(())
    }

    /// Values of every parameter of the model (closed form of [`crate::model::param_specs`]),
    /// in `u128`, saturating: embedding `V x h`, per block the GDN layer's parameters, the MLP's
    /// norm, `linear_fc1` `2F x h` and `linear_fc2` `h x F`, the final norm and the untied head.
    pub fn param_count(&self) -> u128 {
        let (h, f, v) = (
            self.layer.hidden_size as u128,
            self.ffn_hidden_size as u128,
            self.vocab_size as u128,
        );
        let norms = if self.layer.normalization == Normalization::LayerNorm {
            2
        } else {
            1
        };
        let mlp = mul(norms, h)
            .saturating_add(mul(mul(2, f), h))
            .saturating_add(mul(h, f));
        let block = self.layer.param_count().saturating_add(mlp);
        let head = if self.share_embeddings_and_output_weights {
            0
        } else {
            mul(v, h)
        };
        mul(v, h)
            .saturating_add(mul(self.layer.num_layers as u128, block))
            .saturating_add(mul(norms, h))
            .saturating_add(head)
    }

    /// Bytes of the model's parameters in f32.
    pub fn param_bytes(&self) -> u128 {
        mul(self.param_count(), 4)
    }

    /// What allocating the model's parameters is, with the sizes that make it.
    pub fn describe_params(&self) -> String {
        format!(
            "allocating the model's parameters ({} values in f32: vocab_size {}, hidden_size {}, ffn_hidden_size {}, num_layers {})",
            self.param_count(),
            self.vocab_size,
            self.layer.hidden_size,
            self.ffn_hidden_size,
            self.layer.num_layers
        )
    }

    /// Model width.
    pub fn hidden_size(&self) -> usize {
        self.layer.hidden_size
    }
    /// Number of blocks.
    pub fn num_layers(&self) -> usize {
        self.layer.num_layers
    }

    /// Whether the MLP keeps only its input and reruns its forward in backward: Megatron's
    /// `mlp` module under `recompute_granularity = "selective"`, or `"full"` (which also
    /// recomputes the GDN layer whole).
    pub fn recompute_mlp(&self) -> bool {
        match self.layer.recompute_granularity {
            Some(RecomputeGranularity::Full) => true,
            Some(RecomputeGranularity::Selective) => self
                .layer
                .recompute_modules
                .as_ref()
                .is_some_and(|m| m.iter().any(|x| x == "mlp")),
            None => false,
        }
    }
}
