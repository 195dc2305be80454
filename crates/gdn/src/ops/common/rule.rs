//! Shape and options shared by the two rules (`ops::gated_delta_rule`, `ops::gdn2_rule`).

/// Chunk length of the chunked algorithm (FLA's and Megatron's).
pub const CHUNK: usize = 64;

/// Head counts and dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleShape {
    /// Key heads `Hk`.
    pub hk: usize,
    /// Value heads `Hv` (a multiple of `hk`).
    pub hv: usize,
    /// Key head dim `Dk`.
    pub dk: usize,
    /// Value head dim `Dv`.
    pub dv: usize,
}

/// Options of the rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleOpts {
    /// Multiplies q (default `Dk^-1/2`).
    pub scale: f32,
    /// L2-normalize q and k rows inside the kernel (`x * rsqrt(sum x^2 + 1e-6)`); q and k are
    /// then the raw inputs and their gradients are taken through the norm.
    pub l2norm_in_kernel: bool,
}
