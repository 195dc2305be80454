//! gdn: Gated DeltaNet (GDN) and Gated DeltaNet-2 layers, forward and backward, with exact
//! activation-memory accounting.
//!
//! See `docs/architecture.md` in the repository for the layout. `backend` owns devices and
//! buffers; every op lives in `ops/<op>/` with one entry (`forward` / `backward` over backend
//! buffers) dispatching to its CPU or CUDA implementation, and an f64 reference used by tests;
//! the layer (`layer::GatedDeltaNet`) composes them.

// Index loops mirror the math (rows i, columns j) in this numeric code.
#![allow(clippy::needless_range_loop)]

pub mod backend;
pub mod budget;
pub mod config;
pub mod convert;
pub mod dist;
pub mod error;
pub mod io;
pub mod layer;
pub mod model;
pub mod ops;
pub mod seqs;
pub mod tensor;
#[doc(hidden)]
pub mod testutil;
pub mod train;

/// The former name of [`backend`]; `gdn::device::Device`, `gdn::device::cuda::*` keep working.
pub use backend as device;
pub use backend::Device;
pub use config::{GdnConfig, Normalization, Recompute, RecomputeGranularity, Variant};
pub use error::{GdnError, Result};
pub use layer::{
    CachePool, DeviceGrads, GatedDeltaNet, GatedDeltaNet2, Grads, InferenceCache, Params, Saved,
};
pub use seqs::Seqs;
pub use tensor::Tensor;
