//! Pieces shared by the rule I/O examples (`rule_io`, `gdn2_rule_io`), included by `#[path]`:
//! a safetensors file's float tensors by name and its one integer tensor (`cu_seqlens`).

use std::collections::HashMap;
use std::path::Path;

use gdn::io::{read_any, AnyTensor};
use gdn::Tensor;

/// A file's float tensors by name and its integer tensor (1-D, as u64) if it has one.
pub type Inputs = (HashMap<String, Tensor>, Option<Vec<u64>>);

/// The float tensors of `path` by name, and its integer tensor (1-D, as u64) if it has one.
pub fn read_inputs(path: &str) -> Result<Inputs, Box<dyn std::error::Error>> {
    let mut f = HashMap::new();
    let mut cu = None;
    for (n, t) in read_any(Path::new(path))? {
        match t {
            AnyTensor::Float(t) => {
                f.insert(n, t);
            }
            AnyTensor::Int(i) => cu = Some(i.to_u64_1d(&n, Path::new(path))?),
        }
    }
    Ok((f, cu))
}
