//! CUDA `acc += x` (kernels in `add.cu`): device buffers of one length, dtype and GPU.

use cudarc::driver::PushKernelArg;

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, elem_cfg, kernel, launch,
};
use crate::error::Result;

const MODULE: &str = "add";

/// `acc += x` on activations (same length and storage type).
pub fn add_assign(acc: &mut DBuf, x: &DBuf) -> Result<()> {
    check_d("add x", x, acc.len(), acc.dtype())?;
    let gpu = acc.gpu().clone();
    check_gpu("add x", &gpu, x.gpu())?;
    if acc.is_empty() {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "add_assign", acc.dtype())?;
    let n = acc.len() as i64;
    let cfg = elem_cfg(acc.len());
    let mut l = gpu.stream().launch_builder(&f);
    arg_dm(&mut l, acc);
    arg_d(&mut l, x);
    l.arg(&n);
    launch(&mut l, cfg, "add_assign")
}

/// `acc += x` on fp32 buffers (same length).
pub fn add_assign_f32(acc: &mut GBuf<f32>, x: &GBuf<f32>) -> Result<()> {
    check_g("add x", x, acc.len())?;
    let gpu = acc.gpu().clone();
    check_gpu("add x", &gpu, x.gpu())?;
    if acc.is_empty() {
        return Ok(());
    }
    let f = gpu.function(MODULE, "add_assign_f32")?;
    let n = acc.len() as i64;
    let cfg = elem_cfg(acc.len());
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&mut acc.slice).arg(&x.slice).arg(&n);
    launch(&mut l, cfg, "add_assign_f32")
}
