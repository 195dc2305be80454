//! Safe wrapper over the `gemm` crate for f32 matrices given by slice + strides.

use gemm::Parallelism;

/// A read-only strided matrix view: element `(i, j)` is `data[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// Row-major `[rows, cols]` with leading dimension `ld` (row stride).
    pub fn rm(data: &'a [f32], rows: usize, cols: usize, ld: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
    fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// `c = alpha_c * c + a @ b` where `c` is row-major `[a.rows, b.cols]` with leading dimension
/// `ldc`. `accumulate = false` overwrites `c` (alpha_c ignored). `parallel` uses rayon inside the
/// GEMM (for the big projections); kernels that already run one task per head pass `false`.
pub fn matmul(
    c: &mut [f32],
    ldc: usize,
    a: MatRef,
    b: MatRef,
    accumulate: bool,
    scale: f32,
    parallel: bool,
) {
    assert_eq!(a.cols, b.rows, "matmul inner dimensions");
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * ldc + n <= c.len(), "matmul output out of bounds");
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(0.0);
            }
        }
        return;
    }
    a.check();
    b.check();
    let par = if parallel && m * n * k >= 1 << 18 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: all three views were bounds-checked above; `c` is uniquely borrowed and does not
    // alias `a` or `b` (they are shared borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            par,
        );
    }
}
