//! CPU `acc += x` (f32, rayon over chunks; elementwise, so the bits do not depend on threads).

use rayon::prelude::*;

use crate::error::{GdnError, Result};

/// Values per rayon task.
const CHUNK: usize = 1 << 14;

/// `acc += x`; errors on a length mismatch.
pub fn add_assign(acc: &mut [f32], x: &[f32]) -> Result<()> {
    if acc.len() != x.len() {
        return Err(GdnError::Invalid(format!(
            "add: {} values += {} values",
            acc.len(),
            x.len()
        )));
    }
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| {
            for (a, x) in a.iter_mut().zip(x) {
                *a += x;
            }
        });
    Ok(())
}
