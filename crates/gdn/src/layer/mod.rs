//! The GDN layer: parameters, forward -> (y, Saved), backward.

mod gdn;
pub mod params;
mod saved;

pub use gdn::GatedDeltaNet;
pub use params::{param_specs, Params};
pub use saved::Saved;

/// Parameter gradients, under the parameters' own names.
pub type Grads = Params;
