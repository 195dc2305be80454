//! A minimal host tensor: a shape and row-major `f32` data.

use crate::error::{GdnError, Result};

/// Row-major `f32` tensor on the host.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Tensor {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }

    /// Wrap `data`; its length must be the product of `shape`.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(GdnError::Invalid(format!(
                "tensor of shape {shape:?} needs {n} values, got {}",
                data.len()
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Data, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    /// Mutable data, row-major.
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
    /// Take the data out.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// Bytes of storage (f32).
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }
    /// Same data, new shape with the same number of elements.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != self.data.len() {
            return Err(GdnError::Invalid(format!(
                "cannot reshape {:?} to {shape:?}",
                self.shape
            )));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// Error unless the shape equals `expected`.
    pub fn expect_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(GdnError::shape(name, &self.shape, format!("{expected:?}")));
        }
        Ok(())
    }

    /// Error at the first NaN or infinity.
    pub fn check_finite(&self, name: &str) -> Result<()> {
        check_finite(name, &self.data)
    }
}

/// Error at the first NaN or infinity in `x`.
pub fn check_finite(name: &str, x: &[f32]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(GdnError::NonFinite {
            name: name.to_string(),
            index: i,
            value: x[i],
        }),
    }
}
