//! f64 reference of the gated norm (plain loops; for tests).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

use crate::config::Normalization;
use crate::ops::common::reference::{norm_forward, silu};

/// `y = norm(o) * silu(z)` over `o`, `z` `[rows, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_forward(
    o: &[f64],
    z: &[f64],
    rows: usize,
    dv: usize,
    w: &[f64],
    b: Option<&[f64]>,
    kind: Normalization,
    eps: f64,
    zero_centered: bool,
) -> Vec<f64> {
    let n = norm_forward(o, rows, dv, w, b, kind, eps, zero_centered);
    n.iter().zip(z).map(|(n, z)| n * silu(*z)).collect()
}
