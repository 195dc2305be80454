//! The CUDA C++ kernel sources in this repository. Each op's kernels live beside it
//! (`ops/<op>/<op>.cu`); `common.cuh` (bf16 conversion, warp reductions) is prepended so NVRTC
//! needs no include path, and so are the shared headers a module names in [`headers`]
//! (`ops/common/conv_vec.cuh`, 4-wide vector accesses, for `prep`, `conv1d` and `gated_norm`;
//! `ops/common/conv.cuh`, the conv helpers, for `conv1d` and `prep`; `ops/common/mma_tf32.cuh`,
//! the TF32 tensor-core primitives, for `gdn2_rule_tc`, which is `gdn2_rule.cu` compiled with
//! `G2B_TC_MODULE` defined: the opt-in tensor-core kernels, kept out of `gdn2_rule` so that the
//! default module's code is unchanged; `ops/common/async_copy.cuh`, mbarrier and async-copy
//! primitives, for `gated_delta_rule`; `ops/common/wgmma.cuh`, the warpgroup-MMA (sm_90a)
//! primitives, for `gated_delta_rule` (gdr_grad10) and `wgmma_probe`, their GPU test's module).

use crate::error::{GdnError, Result};

/// Helpers shared by every kernel file.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// 4-wide vector loads/stores and bf16 rounding (`ops/common/conv_vec.cuh`).
pub const CONV_VEC: &str = include_str!("../ops/common/conv_vec.cuh");

/// Device code shared by the causal conv kernels (`ops/common/conv.cuh`).
pub const CONV: &str = include_str!("../ops/common/conv.cuh");

/// TF32 mma.sync primitives (`ops/common/mma_tf32.cuh`).
pub const MMA_TF32: &str = include_str!("../ops/common/mma_tf32.cuh");

/// mbarrier, cp.async / bulk-copy and setmaxnreg primitives for warp-specialized pipelines
/// (`ops/common/async_copy.cuh`).
pub const ASYNC_COPY: &str = include_str!("../ops/common/async_copy.cuh");

/// Warpgroup matrix-multiply (wgmma, sm_90a) primitives: the SW128 shared-memory layout, its
/// descriptors, the m64nNk16 bf16 instructions (`ops/common/wgmma.cuh`).
pub const WGMMA: &str = include_str!("../ops/common/wgmma.cuh");

/// The shared headers (name, source) prepended to `module` after [`COMMON`], in order.
pub fn headers(module: &str) -> &'static [(&'static str, &'static str)] {
    match module {
        "conv1d" | "prep" => &[("conv_vec.cuh", CONV_VEC), ("conv.cuh", CONV)],
        "gated_norm" => &[("conv_vec.cuh", CONV_VEC)],
        // gated_delta_rule keeps its own copy of the TF32 primitives for now: prepending that
        // header there reorders its PTX (same source otherwise), see bench/notes/h-g2tc.md.
        // async_copy.cuh only adds new (acp_) names, used by the v9 and grad10 sections.
        // wgmma.cuh (wg_ names) is used by the grad10 section.
        "gated_delta_rule" => &[("async_copy.cuh", ASYNC_COPY), ("wgmma.cuh", WGMMA)],
        "wgmma_probe" => &[("async_copy.cuh", ASYNC_COPY), ("wgmma.cuh", WGMMA)],
        "gdn2_rule_tc" => &[
            ("g2b_tc_module.cuh", "#define G2B_TC_MODULE 1\n"),
            ("mma_tf32.cuh", MMA_TF32),
        ],
        _ => &[],
    }
}

/// (module name, source) of every kernel file.
pub const MODULES: &[(&str, &str)] = &[
    ("smoke", include_str!("kernels/smoke.cu")),
    // The wgmma primitives' probes (tests/gpu_wgmma.rs).
    ("wgmma_probe", include_str!("kernels/wgmma_probe.cu")),
    // A thread-block cluster's fixed-order reduction through distributed shared memory
    // (tests/gpu_cluster.rs; bench_rule `cluster`).
    ("cluster_probe", include_str!("kernels/cluster_probe.cu")),
    ("layout", include_str!("../ops/layout/layout.cu")),
    (
        "gated_delta_rule",
        include_str!("../ops/gated_delta_rule/gated_delta_rule.cu"),
    ),
    ("gdn2_rule", include_str!("../ops/gdn2_rule/gdn2_rule.cu")),
    // The same file with G2B_TC_MODULE (see `headers`): g2b_grad_tc_* (GDN_RULE2_GRAD=tc).
    (
        "gdn2_rule_tc",
        include_str!("../ops/gdn2_rule/gdn2_rule.cu"),
    ),
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
    // The decode projections' skinny GEMM (opt-in: GDN_DECODE_GEMV=1).
    ("skinny", include_str!("../ops/linear/skinny.cu")),
];

/// The entry of [`MODULES`] named `module`, or an error listing the names there are.
pub fn module(module: &str) -> Result<(&'static str, &'static str)> {
    MODULES
        .iter()
        .find(|(n, _)| *n == module)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = MODULES.iter().map(|(n, _)| *n).collect();
            GdnError::Invalid(format!(
                "no kernel module named {module:?}: expected one of {}",
                names.join(", ")
            ))
        })
}

/// The full source NVRTC compiles for `module`.
pub fn source(module: &str) -> Result<String> {
    let (_, body) = self::module(module)?;
    let mut src = format!("{COMMON}\n");
    for (name, h) in headers(module) {
        src.push_str(&format!("#line 1 \"{name}\"\n{h}\n"));
    }
    src.push_str(&format!("#line 1 \"{module}.cu\"\n{body}"));
    Ok(src)
}
