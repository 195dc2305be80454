//! `Saved`: exactly the tensors kept between forward and backward.

use crate::layer::gdn::RuleInputs;
use crate::ops::norm::NormStats;
use crate::seqs::Seqs;

/// What forward keeps for backward. Every buffer held is listed here, so `bytes()` is the
/// layer's activation memory to the byte. Recompute options leave fields empty; backward rebuilds
/// them with the same kernels, so its results are bitwise those of a run that kept them.
#[derive(Debug)]
pub struct Saved {
    pub(crate) seqs: Seqs,
    /// `[B, T, h]` or `[T, h]`: the shape `dx` gets.
    pub(crate) x_shape: Vec<usize>,
    /// Layer input `[n, h]` (in_proj's fused norm input).
    pub(crate) x: Vec<f32>,
    /// Initial recurrent states `[N, Hv, Dk, Dv]`, when forward was given them.
    pub(crate) h0: Option<Vec<f32>>,
    /// The rest; `None` under whole-layer recompute (`gdn` / `full`).
    pub(crate) acts: Option<Acts>,
}

/// Activations kept when the layer is not recomputed whole.
#[derive(Debug)]
pub(crate) struct Acts {
    /// Statistics of the fused input norm (rstd, and mean for LayerNorm), `[n]` each.
    pub in_stats: NormStats,
    /// in_proj output sections: conv input `[n, conv_dim]`, gate `z` `[n, v_dim]`, and the raw
    /// gate inputs (`beta`/`alpha` for GDN; `f`, `b`, `w` for GDN2).
    pub qkv_pre: Vec<f32>,
    pub z: Vec<f32>,
    pub gate_in: Vec<Vec<f32>>,
    /// The rule's inputs (conv outputs, normalized q/k when caller-side, gates); `None` under
    /// `gdn_prep`, which rebuilds them in backward.
    pub rule_in: Option<RuleInputs>,
    /// Output of the gated delta rule `[n, Hv, Dv]` and its norm statistics `[n*Hv]`.
    pub o: Vec<f32>,
    pub o_stats: NormStats,
    /// Input of `out_proj` `[n, v_dim]`; `None` under `gdn_norm_out`.
    pub norm_out: Option<Vec<f32>>,
}

fn f32_bytes(v: &[f32]) -> usize {
    std::mem::size_of_val(v)
}

impl Saved {
    /// Bytes held, exactly: the sum of the sizes of every buffer listed above (f32 values;
    /// shapes and the small `cu_seqlens` vector are metadata and not counted).
    pub fn bytes(&self) -> usize {
        let mut b = f32_bytes(&self.x) + self.h0.as_deref().map_or(0, f32_bytes);
        if let Some(a) = &self.acts {
            b += a.in_stats.bytes()
                + f32_bytes(&a.qkv_pre)
                + f32_bytes(&a.z)
                + a.gate_in.iter().map(|v| f32_bytes(v)).sum::<usize>()
                + a.rule_in.as_ref().map_or(0, RuleInputs::bytes)
                + f32_bytes(&a.o)
                + a.o_stats.bytes()
                + a.norm_out.as_deref().map_or(0, f32_bytes);
        }
        b
    }

    /// Tokens covered (rows of the flat token axis).
    pub fn tokens(&self) -> usize {
        self.seqs.tokens()
    }
}
