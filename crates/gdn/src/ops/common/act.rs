//! Scalar activations of the CPU ops (conv1d, gates, gated norm, prep), one definition so every op
//! rounds them the same way.

/// `1 / (1 + exp(-x))`.
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x * sigmoid(x)`.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `d silu / dx = s (1 + x (1 - s))`, `s = sigmoid(x)`.
#[inline]
pub(crate) fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// PyTorch's softplus threshold: above it, `softplus(x) = x`.
pub const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// PyTorch's softplus: `x` above the threshold, else `log1p(exp(x))`.
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// PyTorch's softplus backward factor: 1 above the threshold, else `z / (z + 1)`, `z = exp(x)`.
#[inline]
pub(crate) fn softplus_grad(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        1.0
    } else {
        let z = x.exp();
        z / (z + 1.0)
    }
}
