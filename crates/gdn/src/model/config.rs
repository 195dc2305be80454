//! `ModelConfig`: the language model around the GDN layer.

use serde::{Deserialize, Serialize};

use crate::config::{GdnConfig, RecomputeGranularity};
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
    pub vocab_size: usize,
    /// `F`, the MLP's hidden width (`linear_fc1` gives `2F`: SwiGLU's gate and up halves).
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
        self.layer.validate()?;
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
