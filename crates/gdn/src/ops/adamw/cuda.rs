//! CUDA AdamW (kernels in `adamw.cu`): one launch per parameter tensor, and the sums of squares of
//! the gradients in one download.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::Hyper;
use crate::backend::cuda::GBuf;
use crate::backend::launch::{check_g, check_gpu, elem_cfg, launch, lin_cfg};
use crate::error::Result;

const MODULE: &str = "adamw";

/// Blocks of the first stage of [`sum_squares`] (`SS_BLOCKS` in `adamw.cu`).
const SS_BLOCKS: usize = 256;

/// One AdamW update on the device (same arithmetic as [`super::cpu::step`]).
pub fn step(
    p: &mut GBuf<f32>,
    m: &mut GBuf<f32>,
    v: &mut GBuf<f32>,
    g: &GBuf<f32>,
    h: &Hyper,
) -> Result<()> {
    let n = p.len();
    check_g("adamw exp_avg", m, n)?;
    check_g("adamw exp_avg_sq", v, n)?;
    check_g("adamw gradient", g, n)?;
    let gpu = p.gpu().clone();
    check_gpu("adamw exp_avg", &gpu, m.gpu())?;
    check_gpu("adamw exp_avg_sq", &gpu, v.gpu())?;
    check_gpu("adamw gradient", &gpu, g.gpu())?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(MODULE, "adamw_step")?;
    let n_i = n as i64;
    let (omb1, omb2) = (1.0f32 - h.b1, 1.0f32 - h.b2);
    let has_scale = h.grad_scale.is_some() as i32;
    let scale = h.grad_scale.unwrap_or(1.0);
    let cfg = elem_cfg(n);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&mut p.slice)
        .arg(&mut m.slice)
        .arg(&mut v.slice)
        .arg(&g.slice)
        .arg(&n_i)
        .arg(&h.b1)
        .arg(&omb1)
        .arg(&h.b2)
        .arg(&omb2)
        .arg(&h.step_size)
        .arg(&h.bc2_sqrt)
        .arg(&h.eps)
        .arg(&h.wd)
        .arg(&has_scale)
        .arg(&scale);
    launch(&mut l, cfg, "adamw_step")
}

/// `sum x^2` (f64) of each buffer (all on one GPU); one download.
pub fn sum_squares(xs: &[&GBuf<f32>]) -> Result<Vec<f64>> {
    let Some(first) = xs.first() else {
        return Ok(Vec::new());
    };
    let gpu = first.gpu().clone();
    for x in xs {
        check_gpu("sum of squares", &gpu, x.gpu())?;
    }
    let mut part = gpu.uninit::<f64>(xs.len() * SS_BLOCKS)?;
    let f = gpu.function(MODULE, "sumsq_part")?;
    for (k, x) in xs.iter().enumerate() {
        let (n, k) = (x.len() as i64, k as i32);
        let mut l = gpu.stream().launch_builder(&f);
        l.arg(&x.slice).arg(&n).arg(&mut part.slice).arg(&k);
        let cfg = LaunchConfig {
            grid_dim: (SS_BLOCKS as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(&mut l, cfg, "sumsq_part")?;
    }
    let mut out = gpu.uninit::<f64>(xs.len())?;
    let f = gpu.function(MODULE, "sumsq_final")?;
    let nbuf = xs.len() as i32;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&part.slice).arg(&nbuf).arg(&mut out.slice);
    launch(&mut l, lin_cfg(xs.len()), "sumsq_final")?;
    gpu.download(&out)
}
