//! The ops of a GDN layer, one folder each (see `docs/architecture.md`): `mod.rs` is the op's one
//! entry over backend buffers (`crate::backend::{Act, F32s, P}`), dispatching to `cpu.rs` (f32,
//! rayon) or `cuda.rs` by where the inputs live; `reference.rs` is the f64 reference (tests).
//! `common/` holds what several ops share; ops never import a sibling op.

pub mod adamw;
pub mod add;
pub mod common;
pub mod conv1d;
pub mod cross_entropy;
pub mod decode;
pub mod embedding;
pub mod gated_delta_rule;
pub mod gated_norm;
pub mod gates;
pub mod gdn2_rule;
pub mod l2norm;
pub mod layout;
pub mod linear;
pub mod norm;
pub mod prep;
pub mod swiglu;

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

/// Run `f` with denormal floats flushed to zero (x86-64: MXCSR FTZ and DAZ), restoring the
/// previous mode after. The gated delta rules multiply by decays `exp(gamma)` that underflow
/// deep into the denormal range under strong decay (Megatron's `A_log` init reaches 16 per step);
/// denormal arithmetic is up to 100x slower on some x86 cores and changes no result that matters
/// (values below 1.2e-38 become 0). Deterministic: the mode is set per task, on every thread.
pub(crate) fn flush_denormals<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[allow(deprecated)]
        use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
        const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
        // SAFETY: reading/writing MXCSR only changes the SSE rounding/denormal mode of this thread.
        #[allow(deprecated)]
        let old = unsafe { _mm_getcsr() };
        #[allow(deprecated)]
        unsafe {
            _mm_setcsr(old | FTZ_DAZ)
        };
        let r = f();
        #[allow(deprecated)]
        unsafe {
            _mm_setcsr(old)
        };
        r
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        f()
    }
}
