//! Scalar activations of the CPU ops (conv1d, gates, gated norm), one definition so every op
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
