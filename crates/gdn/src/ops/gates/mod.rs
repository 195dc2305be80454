//! The gates of GDN and GDN2, per token.
//!
//! GDN, per token `t` and value head `h` (`a`, `b` `[rows, heads]`):
//! `g = -exp(A_log[h]) * softplus(a + dt_bias[h])` (log decay) and `beta = sigmoid(b)`.
//! `softplus` is PyTorch's (`beta = 1`, threshold 20): `x` above 20, else `log1p(exp(x))`; its
//! derivative is exactly 1 above the threshold, as in PyTorch. Backward:
//! `da = -exp(A_log) * sigmoid(a + dt_bias) * dg`, `dA_log = sum_t g * dg` (since
//! `dg/dA_log = g`), `ddt_bias = sum_t da`, `db = beta (1 - beta) dbeta`.
//!
//! GDN2 ([`gates2_forward`]) has the same decay per key channel: `f` `[rows, key_heads * dk]`,
//! `g[t, h*dk + c] = -exp(A_log[h]) * softplus(f[t, h*dk + c] + dt_bias[h*dk + c])`; its erase and
//! write gates are plain sigmoids ([`sigmoid_forward`]).
//!
//! All math is f32. The sums over tokens are two-stage and fixed-order (blocks of
//! [`crate::ops::REDUCE_BLOCK`] rows), so they do not depend on the number of threads.

pub mod cpu;
pub mod cuda;
#[doc(hidden)]
pub mod reference;
#[cfg(test)]
mod tests;

use crate::backend::cuda::DBuf;
use crate::backend::{mixed, Act, F32s, P};
use crate::error::{GdnError, Result};

/// PyTorch's softplus threshold: above it, `softplus(x) = x`.
pub use crate::ops::common::act::SOFTPLUS_THRESHOLD;

/// GDN gates: returns g (fp32) and beta (activation storage on the device, f32 on the host).
pub fn forward(
    alpha: &Act,
    beta_raw: &Act,
    rows: usize,
    heads: usize,
    a_log: P,
    dt: P,
) -> Result<(F32s, Act)> {
    match (alpha, beta_raw, a_log, dt) {
        (Act::Host(a), Act::Host(b), P::Host(al), P::Host(d)) => {
            let (g, beta) = cpu::forward(a, b, rows, heads, al, d)?;
            Ok((F32s::Host(g), Act::Host(beta)))
        }
        (Act::Dev(a), Act::Dev(b), P::Dev(al), P::Dev(d)) => {
            let gpu = a.gpu();
            let n = rows.saturating_mul(heads);
            let mut g = gpu.uninit(n)?;
            let mut beta = DBuf::uninit(gpu, n, b.dtype())?;
            cuda::forward(a, b, rows, heads, al, d, &mut g, &mut beta)?;
            Ok((F32s::Dev(g), Act::Dev(beta)))
        }
        _ => Err(mixed("gates")),
    }
}

/// Backward of the GDN gates: (d alpha, d beta_raw, dA_log, ddt_bias).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    alpha: &Act,
    beta_raw: &Act,
    rows: usize,
    heads: usize,
    a_log: P,
    dt: P,
    dg: &F32s,
    dbeta: &Act,
) -> Result<(Act, Act, F32s, F32s)> {
    match (alpha, beta_raw, a_log, dt, dg, dbeta) {
        (Act::Host(a), Act::Host(b), P::Host(al), P::Host(d), F32s::Host(dg), Act::Host(db)) => {
            let (da, dbr, dal, ddt) = cpu::backward(a, b, rows, heads, al, d, dg, db)?;
            Ok((
                Act::Host(da),
                Act::Host(dbr),
                F32s::Host(dal),
                F32s::Host(ddt),
            ))
        }
        (Act::Dev(a), Act::Dev(b), P::Dev(al), P::Dev(d), F32s::Dev(dg), Act::Dev(db)) => {
            let gpu = a.gpu();
            let n = rows.saturating_mul(heads);
            let mut da = DBuf::uninit(gpu, n, a.dtype())?;
            let mut dbr = DBuf::uninit(gpu, n, a.dtype())?;
            let mut dal = gpu.uninit(heads)?;
            let mut ddt = gpu.uninit(heads)?;
            cuda::backward(
                a, b, rows, heads, al, d, dg, db, &mut da, &mut dbr, &mut dal, &mut ddt,
            )?;
            Ok((Act::Dev(da), Act::Dev(dbr), F32s::Dev(dal), F32s::Dev(ddt)))
        }
        _ => Err(mixed("gates backward")),
    }
}

/// GDN2 gates from in_proj's `f`, `b`, `w` sections: the per-key-channel decay (fp32) and the
/// sigmoids of the erase and write gates.
#[allow(clippy::too_many_arguments)]
pub fn gdn2_forward(
    f: &Act,
    b: &Act,
    w: &Act,
    rows: usize,
    hk: usize,
    dk: usize,
    a_log: P,
    dt: P,
) -> Result<(F32s, Act, Act)> {
    match (f, b, w, a_log, dt) {
        (Act::Host(f), Act::Host(b), Act::Host(w), P::Host(al), P::Host(d)) => {
            let g = cpu::gdn2_forward(f, rows, hk, dk, al, d)?;
            Ok((
                F32s::Host(g),
                Act::Host(cpu::sigmoid_forward(b)),
                Act::Host(cpu::sigmoid_forward(w)),
            ))
        }
        (Act::Dev(f), Act::Dev(b), Act::Dev(w), P::Dev(al), P::Dev(d)) => {
            let mut g = f.gpu().uninit(rows.saturating_mul(hk).saturating_mul(dk))?;
            cuda::gdn2_forward(f, rows, hk, dk, al, d, &mut g)?;
            let sig = |x: &DBuf| -> Result<DBuf> {
                let mut y = DBuf::uninit(x.gpu(), x.len(), x.dtype())?;
                cuda::sigmoid_forward(x, &mut y)?;
                Ok(y)
            };
            let (sb, sw) = (sig(b)?, sig(w)?);
            Ok((F32s::Dev(g), Act::Dev(sb), Act::Dev(sw)))
        }
        _ => Err(mixed("gates2")),
    }
}

/// Backward of the GDN2 decay: (df, dA_log, ddt_bias).
#[allow(clippy::too_many_arguments)]
pub fn gdn2_backward(
    f: &Act,
    rows: usize,
    hk: usize,
    dk: usize,
    a_log: P,
    dt: P,
    dg: &F32s,
) -> Result<(Act, F32s, F32s)> {
    match (f, a_log, dt, dg) {
        (Act::Host(f), P::Host(al), P::Host(d), F32s::Host(dg)) => {
            let (df, dal, ddt) = cpu::gdn2_backward(f, rows, hk, dk, al, d, dg)?;
            Ok((Act::Host(df), F32s::Host(dal), F32s::Host(ddt)))
        }
        (Act::Dev(f), P::Dev(al), P::Dev(d), F32s::Dev(dg)) => {
            let gpu = f.gpu();
            let mut df = DBuf::uninit(gpu, f.len(), f.dtype())?;
            let mut dal = gpu.uninit(hk)?;
            let mut ddt = gpu.uninit(hk.saturating_mul(dk))?;
            cuda::gdn2_backward(f, rows, hk, dk, al, d, dg, &mut df, &mut dal, &mut ddt)?;
            Ok((Act::Dev(df), F32s::Dev(dal), F32s::Dev(ddt)))
        }
        _ => Err(mixed("gates2 backward")),
    }
}

/// `dx = dy * y * (1 - y)` from a sigmoid's output.
pub fn sigmoid_backward(y: &Act, dy: &Act) -> Result<Act> {
    match (y, dy) {
        (Act::Host(y), Act::Host(dy)) => {
            if y.len() != dy.len() {
                return Err(GdnError::Invalid(format!(
                    "sigmoid backward: {} values vs {}",
                    y.len(),
                    dy.len()
                )));
            }
            Ok(Act::Host(cpu::sigmoid_backward(y, dy)))
        }
        (Act::Dev(y), Act::Dev(dy)) => {
            let mut dx = DBuf::uninit(y.gpu(), y.len(), y.dtype())?;
            cuda::sigmoid_backward(y, dy, &mut dx)?;
            Ok(Act::Dev(dx))
        }
        _ => Err(mixed("sigmoid backward")),
    }
}
