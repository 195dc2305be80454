//! `Saved`: exactly the tensors kept between forward and backward.

use crate::backend::{Act, F32s};
use crate::layer::gdn::RuleInputs;
use crate::ops::gated_delta_rule::RuleSaved;
use crate::ops::norm::Stats;
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
    pub(crate) x: Act,
    /// Initial recurrent states `[N, Hv, Dk, Dv]`, when forward was given them.
    pub(crate) h0: Option<F32s>,
    /// The rest; `None` under whole-layer recompute (`gdn` / `full`).
    pub(crate) acts: Option<Acts>,
}

/// Activations kept when the layer is not recomputed whole.
#[derive(Debug)]
pub(crate) struct Acts {
    /// Statistics of the fused input norm (rstd, and mean for LayerNorm), `[n]` each.
    pub in_stats: Stats,
    /// The in_proj output `[n, in_proj_dim]`, `[q|k|v | z | gate sections]` per row (`beta`,
    /// `alpha` for GDN; `f`, `b`, `w` for GDN2): the ops read their sections in place
    /// (`GatedDeltaNet::proj_cols`); see `proj_qkvz_only`.
    pub proj: Act,
    /// `proj` holds only the `[q|k|v|z]` columns `[n, conv_dim + v_dim]` (GDN2 by default):
    /// backward rebuilds the gate columns (`GatedDeltaNet::rebuild_proj`).
    pub proj_qkvz_only: bool,
    /// The rule's inputs (conv outputs, normalized q/k when caller-side, gates): kept only under
    /// `keep_rule_inputs`; `None` by default (backward rebuilds them from `proj`).
    pub rule_in: Option<RuleInputs>,
    /// What the rule's forward kept for its backward (GDN on a GPU: the chunk inverses T,
    /// 160 bytes per token and value head; empty on the CPU and for GDN2).
    pub rule_saved: RuleSaved,
    /// Output of the gated delta rule `[n, Hv, Dv]` and its norm statistics `[n*Hv]`.
    pub o: Act,
    pub o_stats: Stats,
    /// Input of `out_proj` `[n, v_dim]`; `None` under `gdn_norm_out`.
    pub norm_out: Option<Act>,
}

impl Saved {
    /// Bytes held, exactly: the sum of the sizes of every buffer listed above (f32 values, or bf16
    /// activations on a GPU;
    /// shapes and the small `cu_seqlens` vector are metadata and not counted).
    pub fn bytes(&self) -> usize {
        let mut b = self.x.bytes() + self.h0.as_ref().map_or(0, F32s::bytes);
        if let Some(a) = &self.acts {
            b += a.in_stats.bytes()
                + a.proj.bytes()
                + a.rule_in.as_ref().map_or(0, RuleInputs::bytes)
                + a.rule_saved.bytes()
                + a.o.bytes()
                + a.o_stats.bytes()
                + a.norm_out.as_ref().map_or(0, Act::bytes);
        }
        b
    }

    /// Tokens covered (rows of the flat token axis).
    pub fn tokens(&self) -> usize {
        self.seqs.tokens()
    }
}
