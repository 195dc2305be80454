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
    /// Something sized by the user (a config, a token count) needs more memory than there is:
    /// raised before anything is allocated.
    #[error(
        "{what} needs {needed} bytes ({}), more than the {available} bytes ({}) {limit}",
        human_bytes(*.needed),
        human_bytes(*.available)
    )]
    Memory {
        /// What would be allocated, with the sizes it comes from.
        what: String,
        /// Bytes it needs (`u128::MAX` stands for "at least that many": the count overflowed).
        needed: u128,
        /// Bytes there are.
        available: u128,
        /// Where `available` comes from (e.g. "available on this machine (MemAvailable)").
        limit: String,
    },
}

/// `n` in binary units with one decimal (`44.9 TiB`), for messages next to the exact count.
pub fn human_bytes(n: u128) -> String {
    if n == u128::MAX {
        return "at least 2^128 B".into();
    }
    const UNITS: [&str; 9] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_error_states_both_byte_counts() {
        let e = GdnError::Memory {
            what: "allocating the layer's parameters".into(),
            needed: 3 << 40,
            available: 1536 << 20,
            limit: "available on this machine".into(),
        }
        .to_string();
        assert_eq!(
            e,
            "allocating the layer's parameters needs 3298534883328 bytes (3.0 TiB), more than the \
             1610612736 bytes (1.5 GiB) available on this machine"
        );
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(u128::MAX), "at least 2^128 B");
    }
}
