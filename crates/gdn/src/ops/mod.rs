//! The ops of a GDN layer. Each has a forward and a backward on the CPU (f32, rayon) and an f64
//! reference (`reference` submodule, for tests).

pub mod conv1d;
pub mod gated_delta_rule;
pub mod gated_norm;
pub mod gates;
pub mod gdn2_rule;
pub mod gemm;
pub mod l2norm;
pub mod linear;
pub mod norm;

use crate::error::{GdnError, Result};

/// Error unless `x.len() == expected`.
pub(crate) fn check_len(name: &str, x: &[f32], expected: usize) -> Result<()> {
    if x.len() != expected {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {expected} values, got {}",
            x.len()
        )));
    }
    Ok(())
}

/// Rows per block of the fixed-order two-stage reductions over tokens (parameter gradients).
/// Partial sums over blocks of this many rows are added in block order, so the result does not
/// depend on the number of threads.
pub(crate) const REDUCE_BLOCK: usize = 256;
