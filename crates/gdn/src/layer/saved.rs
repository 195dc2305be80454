//! `Saved`: exactly the tensors kept between forward and backward.

/// Tensors kept for backward. `bytes()` is the activation memory of the layer.
#[derive(Clone, Debug, Default)]
pub struct Saved {
    pub(crate) _todo: (),
}

impl Saved {
    /// Bytes held, exactly.
    pub fn bytes(&self) -> usize {
        0
    }
}
