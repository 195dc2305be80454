//! `ModelSaved`: exactly what the model's forward keeps for its backward.

use crate::backend::cuda::GBuf;
use crate::backend::Act;
use crate::layer::Saved;
use crate::ops::norm::Stats;

/// What [`Model::forward`](super::Model::forward) keeps for backward. Every buffer held is listed
/// here, so [`bytes`](ModelSaved::bytes) is the model's activation memory to the byte.
#[derive(Debug)]
pub struct ModelSaved {
    pub(crate) batch: usize,
    pub(crate) seq_len: usize,
    /// Rows this rank computed: `batch * seq_len`, or `1 / cp` of them under context
    /// parallelism (the rank's zigzag share of every sequence).
    pub(crate) rows: usize,
    /// Under context parallelism: each block's `CpLayer` of the forward (this rank's slices of
    /// the parameters; backward runs through them). Parameters, not activations: not counted.
    pub(crate) cp_layers: Vec<crate::layer::CpLayer>,
    /// Token ids `[rows]` (u32, host): the embedding's backward scatters into their rows (on a GPU
    /// it builds its per-token position lists from them).
    pub(crate) tokens: Vec<u32>,
    /// Targets `[n]` (i32, host): the loss's backward on the CPU.
    pub(crate) targets: Vec<i32>,
    /// The targets on the GPU (a GPU model's loss backward), uploaded once by forward.
    pub(crate) targets_dev: Option<DevIds>,
    /// Target rows (the loss is their mean).
    pub(crate) count: usize,
    /// One per block, first to last.
    pub(crate) blocks: Vec<BlockSaved>,
    pub(crate) head: HeadSaved,
}

/// Ids on a GPU (a `Debug` wrapper).
pub(crate) struct DevIds(pub GBuf<i32>);

impl std::fmt::Debug for DevIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevIds({} values)", self.0.len())
    }
}

/// One block: the GDN layer's own `Saved`, and the MLP's.
#[derive(Debug)]
pub(crate) struct BlockSaved {
    /// The layer's saved state (its input is the block's input; recompute options apply).
    pub gdn: Saved,
    /// The MLP's input `h1 = x + GDN(x)` `[n, h]`.
    pub h1: Act,
    /// The rest of the MLP; `None` under `mlp` (or `full`) recompute, which rebuilds it from `h1`.
    pub mlp: Option<MlpActs>,
}

/// The MLP's kept activations besides its input.
#[derive(Debug)]
pub(crate) struct MlpActs {
    /// Norm statistics of `h1` (rstd, and mean for LayerNorm) `[n]` each.
    pub stats: Stats,
    /// `linear_fc1`'s output `[n, 2F]` (SwiGLU's input; its output is rebuilt in backward).
    pub u: Act,
}

/// The head: final norm input, its statistics, and the softmax.
#[derive(Debug)]
pub(crate) struct HeadSaved {
    /// Last block's output `[n, h]`.
    pub x: Act,
    /// Final norm statistics `[n]` (two for LayerNorm).
    pub stats: Stats,
    /// Softmax of the logits `[n, V]` (zero rows where the target is ignored), in the
    /// activations' storage type.
    pub probs: Act,
}

impl BlockSaved {
    fn bytes(&self) -> usize {
        self.gdn.bytes()
            + self.h1.bytes()
            + self
                .mlp
                .as_ref()
                .map_or(0, |m| m.stats.bytes() + m.u.bytes())
    }
}

impl ModelSaved {
    /// Bytes held where the model runs, exactly: every buffer above (f32, u32 and i32 values:
    /// 4 bytes each, bf16 2; the shapes are metadata and not counted). On the CPU the token ids
    /// and targets count; on a GPU the device targets do (the host copy of the token ids and
    /// targets is the batch's, as on the CPU, but not GPU memory), so `bytes()` is what the GPU's
    /// allocator holds for this state.
    pub fn bytes(&self) -> usize {
        let ids = match &self.targets_dev {
            None => 4 * (self.tokens.len() + self.targets.len()),
            Some(t) => t.0.bytes(),
        };
        ids + self.blocks.iter().map(BlockSaved::bytes).sum::<usize>()
            + self.head.x.bytes()
            + self.head.stats.bytes()
            + self.head.probs.bytes()
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
