//! CPU AdamW update and sum of squares (f32 update, f64 sums, element order).

use super::Hyper;
use crate::error::{GdnError, Result};

/// One AdamW update (see the module docs for the order of operations).
pub fn step(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], h: &Hyper) -> Result<()> {
    let n = p.len();
    if m.len() != n || v.len() != n || g.len() != n {
        return Err(GdnError::Invalid(format!(
            "adamw: parameter of {n} values with moments of {} and {} and a gradient of {}",
            m.len(),
            v.len(),
            g.len()
        )));
    }
    let Hyper {
        b1,
        b2,
        step_size,
        bc2_sqrt,
        eps,
        wd,
        grad_scale,
    } = *h;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
        let g = match grad_scale {
            Some(c) => g * c,
            None => g,
        };
        *p -= wd * *p;
        *m = b1 * *m + (1.0 - b1) * g;
        *v = b2 * *v + (1.0 - b2) * g * g;
        *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
    }
    Ok(())
}

/// `sum x^2` in f64, element order.
pub fn sum_squares(x: &[f32]) -> f64 {
    x.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()
}
