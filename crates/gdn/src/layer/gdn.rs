//! GatedDeltaNet: forward top to bottom in Megatron's order, backward bottom to top.

use crate::config::GdnConfig;
use crate::error::Result;
use crate::layer::{Grads, Params, Saved};
use crate::seqs::Seqs;
use crate::tensor::Tensor;

/// One Gated DeltaNet layer.
#[derive(Clone, Debug)]
pub struct GatedDeltaNet {
    cfg: GdnConfig,
    params: Params,
}

impl GatedDeltaNet {
    /// A layer with Megatron's initialization from `seed`. Validates `cfg`.
    pub fn new(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        Ok(GatedDeltaNet { cfg: cfg.clone(), params: Params::init(cfg, seed) })
    }
    /// A layer with given parameters (checked against `cfg`: names and shapes).
    pub fn with_params(cfg: &GdnConfig, params: Params) -> Result<Self> {
        cfg.validate()?;
        params.check_against(cfg, "parameters")?;
        Ok(GatedDeltaNet { cfg: cfg.clone(), params })
    }
    /// The config.
    pub fn config(&self) -> &GdnConfig {
        &self.cfg
    }
    /// The parameters.
    pub fn params(&self) -> &Params {
        &self.params
    }
    /// The parameters, mutably (for optimizers).
    pub fn params_mut(&mut self) -> &mut Params {
        &mut self.params
    }
    /// Forward over `x` `[B, T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Saved)> {
        let _ = x;
        todo!()
    }
    /// Forward over packed sequences: `x` `[T, hidden]` (or `[1, T, hidden]`), boundaries `seqs`.
    pub fn forward_packed(&self, x: &Tensor, seqs: &Seqs) -> Result<(Tensor, Saved)> {
        let _ = (x, seqs);
        todo!()
    }
    /// Backward: consumes what forward saved, returns `dx` (shape of `x`) and parameter grads.
    pub fn backward(&self, saved: Saved, dy: &Tensor) -> Result<(Tensor, Grads)> {
        let _ = (saved, dy);
        todo!()
    }
}
