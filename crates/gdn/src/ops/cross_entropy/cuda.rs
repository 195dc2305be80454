//! CUDA softmax cross-entropy (kernels in `cross_entropy.cu`): [`super::forward`] and
//! [`super::backward`] on device buffers. The statistics come back in one download of three
//! f64 values (loss sum, target rows, correct rows), which synchronizes the stream.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::LossStats;
use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, elem_cfg, int, kernel, launch, NULL_PTR,
};
use crate::error::{GdnError, Result};

const MODULE: &str = "cross_entropy";

fn check_vocab(vocab: usize, rows: usize) -> Result<i32> {
    if vocab == 0 {
        return Err(GdnError::Invalid("cross entropy: vocab must be > 0".into()));
    }
    int("cross entropy rows", rows)?;
    int("cross entropy vocab", vocab)
}

/// Forward: the statistics, and the softmax into `probs` when given.
pub fn forward(
    logits: &DBuf,
    rows: usize,
    vocab: usize,
    targets: &GBuf<i32>,
    probs: Option<&mut DBuf>,
) -> Result<LossStats> {
    let vi = check_vocab(vocab, rows)?;
    let dt = logits.dtype();
    let n = rows.saturating_mul(vocab);
    check_d("cross entropy logits", logits, n, dt)?;
    check_g("cross entropy targets", targets, rows)?;
    let gpu = logits.gpu().clone();
    check_gpu("cross entropy targets", &gpu, targets.gpu())?;
    if let Some(p) = &probs {
        check_d("cross entropy probs", p, n, dt)?;
        check_gpu("cross entropy probs", &gpu, p.gpu())?;
    }
    if rows == 0 {
        return Ok(LossStats::default());
    }
    let mut row_loss = gpu.uninit::<f64>(rows)?;
    let mut row_flag = gpu.uninit::<i32>(rows)?;
    let rows_i = rows as i64;
    let keep = probs.is_some() as i32;
    let f = kernel(&gpu, MODULE, "ce_fwd", dt)?;
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, logits);
    l.arg(&targets.slice);
    match probs {
        Some(p) => arg_dm(&mut l, p),
        None => {
            l.arg(&NULL_PTR);
        }
    }
    l.arg(&keep)
        .arg(&mut row_loss.slice)
        .arg(&mut row_flag.slice)
        .arg(&rows_i)
        .arg(&vi);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(&mut l, cfg, "ce_fwd")?;
    let mut out = gpu.uninit::<f64>(3)?;
    let f = gpu.function(MODULE, "ce_sum")?;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&row_loss.slice)
        .arg(&row_flag.slice)
        .arg(&rows_i)
        .arg(&mut out.slice);
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(&mut l, one, "ce_sum")?;
    let o = gpu.download(&out)?;
    Ok(LossStats {
        loss_sum: o[0],
        count: o[1] as usize,
        correct: o[2] as usize,
    })
}

/// Backward of the mean loss into `d` `[rows, vocab]`: `(p - onehot) / count`, zero rows where
/// the target is ignored (all zero when `count` is 0).
pub fn backward(
    probs: &DBuf,
    rows: usize,
    vocab: usize,
    targets: &GBuf<i32>,
    count: usize,
    d: &mut DBuf,
) -> Result<()> {
    let vi = check_vocab(vocab, rows)?;
    let dt = probs.dtype();
    let n = rows.saturating_mul(vocab);
    check_d("cross entropy probs", probs, n, dt)?;
    check_d("cross entropy dlogits", d, n, dt)?;
    check_g("cross entropy targets", targets, rows)?;
    let gpu = probs.gpu().clone();
    check_gpu("cross entropy targets", &gpu, targets.gpu())?;
    check_gpu("cross entropy dlogits", &gpu, d.gpu())?;
    if n == 0 {
        return Ok(());
    }
    // The CPU's `1.0 / count as f32`, and 0 with no target rows (then every row is ignored).
    let inv = if count == 0 {
        0.0f32
    } else {
        1.0 / count as f32
    };
    let rows_i = rows as i64;
    let f = kernel(&gpu, MODULE, "ce_bwd", dt)?;
    let mut l = gpu.stream().launch_builder(&f);
    arg_d(&mut l, probs);
    l.arg(&targets.slice);
    arg_dm(&mut l, d);
    l.arg(&rows_i).arg(&vi).arg(&inv);
    launch(&mut l, elem_cfg(n), "ce_bwd")
}
