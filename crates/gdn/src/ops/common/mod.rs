//! Pieces two or more ops share, so that no op imports a sibling: scalar activations, the GEMM
//! wrapper, L2 norm rows, the norms' statistics and checks, the two rules' shape, task lists,
//! row loaders and CUDA plumbing, and the f64 references several ops' references use.

pub mod act;
pub(crate) mod conv;
pub mod gemm;
pub mod l2norm;
pub mod norm;
#[doc(hidden)]
pub mod reference;
pub mod rule;
pub(crate) mod rule_cpu;
pub(crate) mod rule_cuda;

/// Rows per parallel task for row-wise work on rows of `dim` values (about 16K values per task).
pub(crate) fn task_rows(dim: usize) -> usize {
    (16384 / dim.max(1)).max(1)
}
