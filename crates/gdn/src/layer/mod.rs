//! The GDN layer: parameters, forward -> (y, Saved), backward.

pub(crate) mod gdn;
pub mod params;
pub mod profile;
#[doc(hidden)]
pub mod reference;
mod saved;
#[cfg(test)]
mod tests;

pub use gdn::{
    CachePool, CpLayer, CpSaved, DeviceGrads, GatedDeltaNet, GatedDeltaNet2, InferenceCache,
};
pub use params::{param_specs, Params};
pub use saved::Saved;

/// Parameter gradients, under the parameters' own names.
pub type Grads = Params;
