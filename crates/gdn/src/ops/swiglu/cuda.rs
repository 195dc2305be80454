//! CUDA SwiGLU (kernels in `swiglu.cu`): the same signatures as [`super::forward`] /
//! [`super::backward`] into caller-provided outputs of the input's storage type.

use cudarc::driver::PushKernelArg;

use crate::backend::cuda::DBuf;
use crate::backend::launch::{arg_d, arg_dm, check_d, check_gpu, elem_cfg, int, kernel, launch};
use crate::error::{GdnError, Result};

const MODULE: &str = "swiglu";

fn check_f(f: usize) -> Result<i32> {
    if f == 0 {
        return Err(GdnError::Invalid(
            "swiglu: ffn_hidden_size must be > 0".into(),
        ));
    }
    int("swiglu 2f", 2 * f)?;
    int("swiglu f", f)
}

/// `a` `[rows, f]` from `u` `[rows, 2f]`.
pub fn forward(u: &DBuf, rows: usize, f: usize, a: &mut DBuf) -> Result<()> {
    let fi = check_f(f)?;
    let dt = u.dtype();
    check_d("swiglu u", u, rows.saturating_mul(2 * f), dt)?;
    check_d("swiglu a", a, rows.saturating_mul(f), dt)?;
    let gpu = u.gpu().clone();
    check_gpu("swiglu a", &gpu, a.gpu())?;
    if rows == 0 {
        return Ok(());
    }
    let k = kernel(&gpu, MODULE, "swiglu_fwd", dt)?;
    let rows_i = rows as i64;
    let cfg = elem_cfg(rows * f);
    let mut l = gpu.stream().launch_builder(&k);
    arg_d(&mut l, u);
    arg_dm(&mut l, a);
    l.arg(&rows_i).arg(&fi);
    launch(&mut l, cfg, "swiglu_fwd")
}

/// `du` `[rows, 2f]` from `u` `[rows, 2f]` and `da` `[rows, f]`.
pub fn backward(u: &DBuf, rows: usize, f: usize, da: &DBuf, du: &mut DBuf) -> Result<()> {
    let fi = check_f(f)?;
    let dt = u.dtype();
    check_d("swiglu u", u, rows.saturating_mul(2 * f), dt)?;
    check_d("swiglu da", da, rows.saturating_mul(f), dt)?;
    check_d("swiglu du", du, rows.saturating_mul(2 * f), dt)?;
    let gpu = u.gpu().clone();
    check_gpu("swiglu da", &gpu, da.gpu())?;
    check_gpu("swiglu du", &gpu, du.gpu())?;
    if rows == 0 {
        return Ok(());
    }
    let k = kernel(&gpu, MODULE, "swiglu_bwd", dt)?;
    let rows_i = rows as i64;
    let cfg = elem_cfg(rows * f);
    let mut l = gpu.stream().launch_builder(&k);
    arg_d(&mut l, u);
    arg_d(&mut l, da);
    arg_dm(&mut l, du);
    l.arg(&rows_i).arg(&fi);
    launch(&mut l, cfg, "swiglu_bwd")
}
