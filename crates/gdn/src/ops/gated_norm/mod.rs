//! gated_norm (in progress)
