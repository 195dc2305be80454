//! The backend: devices (the CPU, always, and CUDA GPUs found at run time), device buffers, the
//! counting allocator, kernel sources and their compile cache, and the launch helpers.
//!
//! The CUDA libraries are loaded dynamically (cudarc's `dynamic-loading`), so the crate builds,
//! and its CPU path runs and is tested, on machines with no CUDA at all. Every CUDA entry point
//! checks for the libraries first and returns a [`GdnError::Device`] naming what is missing.

pub mod buf;
pub mod cuda;
pub mod kernels;
#[doc(hidden)]
pub mod launch;

pub(crate) use buf::{dev, dev_f32, host, host_f32, mixed};
pub use buf::{Act, Cols, F32s, Ids, PMut, P};

use std::fmt;
use std::str::FromStr;

use crate::error::{GdnError, Result};

/// Where a computation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    /// The host CPU (f32, rayon).
    #[default]
    Cpu,
    /// CUDA GPU with this ordinal.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = GdnError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(Device::Cuda(i)),
                _ => Err(GdnError::Invalid(format!(
                    "unknown device {s:?}: expected \"cpu\", \"cuda\" or \"cuda:N\""
                ))),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert!("cuda:x".parse::<Device>().is_err());
        assert!("tpu".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
