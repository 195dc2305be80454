//! The one error type of the library. Every public entry returns `Result<_, GdnError>`.

use thiserror::Error;

/// Everything a user can get wrong, and every failure outside our control, as a value.
///
/// Messages name the field or tensor, the value seen and what was expected.
#[derive(Debug, Error)]
pub enum GdnError {
    /// A configuration field has a bad value.
    #[error("config: {field}: {msg}")]
    Config { field: String, msg: String },
    /// A tensor has the wrong shape.
    #[error("shape of {name}: got {got:?}, expected {expected}")]
    Shape {
        name: String,
        got: Vec<usize>,
        expected: String,
    },
    /// A tensor holds NaN or infinity where finite values were required.
    #[error("{name} holds a non-finite value ({value}) at flat index {index}")]
    NonFinite {
        name: String,
        index: usize,
        value: f32,
    },
    /// `cu_seqlens` (packed sequence boundaries) is malformed.
    #[error("cu_seqlens: {0}")]
    CuSeqlens(String),
    /// A weight or tensor file is missing a tensor, or holds one of a wrong dtype.
    #[error("{path}: {msg}")]
    File { path: String, msg: String },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A device is unavailable or a device call failed (missing CUDA library, no GPU, a driver
    /// or compiler error).
    #[error("device: {0}")]
    Device(String),
    /// Any other invalid argument.
    #[error("{0}")]
    Invalid(String),
}

impl GdnError {
    pub(crate) fn config(field: &str, msg: impl Into<String>) -> Self {
        GdnError::Config {
            field: field.to_string(),
            msg: msg.into(),
        }
    }
    pub(crate) fn shape(name: &str, got: &[usize], expected: impl Into<String>) -> Self {
        GdnError::Shape {
            name: name.to_string(),
            got: got.to_vec(),
            expected: expected.into(),
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, GdnError>;
