//! `ModelSaved`: exactly what the model's forward keeps for its backward.

use crate::layer::Saved;
use crate::ops::norm::NormStats;

/// What [`Model::forward`](super::Model::forward) keeps for backward. Every buffer held is listed
/// here, so [`bytes`](ModelSaved::bytes) is the model's activation memory to the byte.
#[derive(Debug)]
pub struct ModelSaved {
    pub(crate) batch: usize,
    pub(crate) seq_len: usize,
    /// Token ids `[n]` (u32): the embedding's backward scatters into their rows.
    pub(crate) tokens: Vec<u32>,
    /// Targets `[n]` (i32): the loss's backward.
    pub(crate) targets: Vec<i32>,
    /// Target rows (the loss is their mean).
    pub(crate) count: usize,
    /// One per block, first to last.
    pub(crate) blocks: Vec<BlockSaved>,
    pub(crate) head: HeadSaved,
}

/// One block: the GDN layer's own `Saved`, and the MLP's.
#[derive(Debug)]
pub(crate) struct BlockSaved {
    /// The layer's saved state (its input is the block's input; recompute options apply).
    pub gdn: Saved,
    /// The MLP's input `h1 = x + GDN(x)` `[n, h]`.
    pub h1: Vec<f32>,
    /// The rest of the MLP; `None` under `mlp` (or `full`) recompute, which rebuilds it from `h1`.
    pub mlp: Option<MlpActs>,
}

/// The MLP's kept activations besides its input.
#[derive(Debug)]
pub(crate) struct MlpActs {
    /// Norm statistics of `h1` (rstd, and mean for LayerNorm) `[n]` each.
    pub stats: NormStats,
    /// `linear_fc1`'s output `[n, 2F]` (SwiGLU's input; its output is rebuilt in backward).
    pub u: Vec<f32>,
}

/// The head: final norm input, its statistics, and the softmax.
#[derive(Debug)]
pub(crate) struct HeadSaved {
    /// Last block's output `[n, h]`.
    pub x: Vec<f32>,
    /// Final norm statistics `[n]` (two for LayerNorm).
    pub stats: NormStats,
    /// Softmax of the logits `[n, V]` (zero rows where the target is ignored).
    pub probs: Vec<f32>,
}

impl BlockSaved {
    fn bytes(&self) -> usize {
        self.gdn.bytes()
            + 4 * self.h1.len()
            + self
                .mlp
                .as_ref()
                .map_or(0, |m| m.stats.bytes() + 4 * m.u.len())
    }
}

impl ModelSaved {
    /// Bytes held, exactly: every buffer above (f32, u32 and i32 values: 4 bytes each; the
    /// shapes are metadata and not counted).
    pub fn bytes(&self) -> usize {
        4 * (self.tokens.len() + self.targets.len())
            + self.blocks.iter().map(BlockSaved::bytes).sum::<usize>()
            + 4 * self.head.x.len()
            + self.head.stats.bytes()
            + 4 * self.head.probs.len()
    }

    /// Bytes held by the GDN layers' `Saved` alone (the sum over blocks of `Saved::bytes()`).
    pub fn gdn_bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.gdn.bytes()).sum()
    }

    /// Bytes held by each block (its layer's `Saved` plus its MLP's activations).
    pub fn block_bytes(&self) -> Vec<usize> {
        self.blocks.iter().map(BlockSaved::bytes).collect()
    }

    /// Tokens of the batch (`B*T`).
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }
}
