//! The CUDA C++ kernel sources in this repository. Each op's kernels live beside it
//! (`ops/<op>/<op>.cu`); `common.cuh` (bf16 conversion, warp reductions) is prepended so NVRTC
//! needs no include path.

use crate::error::{GdnError, Result};

/// Helpers shared by every kernel file.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// (module name, source) of every kernel file.
pub const MODULES: &[(&str, &str)] = &[
    ("smoke", include_str!("kernels/smoke.cu")),
    ("layout", include_str!("../ops/layout/layout.cu")),
    (
        "gated_delta_rule",
        include_str!("../ops/gated_delta_rule/gated_delta_rule.cu"),
    ),
    ("gdn2_rule", include_str!("../ops/gdn2_rule/gdn2_rule.cu")),
    ("norm", include_str!("../ops/norm/norm.cu")),
    ("linear", include_str!("../ops/linear/linear.cu")),
    ("conv1d", include_str!("../ops/conv1d/conv1d.cu")),
    ("l2norm", include_str!("../ops/l2norm/l2norm.cu")),
    ("gates", include_str!("../ops/gates/gates.cu")),
    (
        "gated_norm",
        include_str!("../ops/gated_norm/gated_norm.cu"),
    ),
    ("prep", include_str!("../ops/prep/prep.cu")),
    ("add", include_str!("../ops/add/add.cu")),
    ("swiglu", include_str!("../ops/swiglu/swiglu.cu")),
    ("embedding", include_str!("../ops/embedding/embedding.cu")),
    (
        "cross_entropy",
        include_str!("../ops/cross_entropy/cross_entropy.cu"),
    ),
    ("adamw", include_str!("../ops/adamw/adamw.cu")),
    ("decode", include_str!("../ops/decode/decode.cu")),
];

/// The full source NVRTC compiles for `module`.
pub fn source(module: &str) -> Result<String> {
    let (_, body) = MODULES
        .iter()
        .find(|(n, _)| *n == module)
        .ok_or_else(|| GdnError::Device(format!("no kernel module named {module}")))?;
    Ok(format!("{COMMON}\n#line 1 \"{module}.cu\"\n{body}"))
}
