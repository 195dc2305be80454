//! CUDA embedding (kernels in `embedding.cu`): the gather, and the backward from per-token
//! position lists built on the host ([`super::cpu::position_lists`]) and uploaded (two int32
//! arrays, `vocab + 1` and `n` values; freed when the queued kernel no longer needs them).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::launch::{
    arg_d, arg_dm, check_d, check_g, check_gpu, elem_cfg, int, kernel, launch,
};
use crate::error::Result;

const MODULE: &str = "embedding";

/// `y` `[n, h]` (its storage type) from device ids `[n]` and `E` `[vocab, h]`.
pub fn forward(ids: &GBuf<u32>, w: &GBuf<f32>, vocab: usize, h: usize, y: &mut DBuf) -> Result<()> {
    let n = ids.len();
    check_g("embedding weight", w, vocab.saturating_mul(h))?;
    check_d("embedding y", y, n.saturating_mul(h), y.dtype())?;
    let gpu = w.gpu().clone();
    check_gpu("embedding ids", &gpu, ids.gpu())?;
    check_gpu("embedding y", &gpu, y.gpu())?;
    let (hi, vi) = (int("embedding h", h)?, int("embedding vocab", vocab)?);
    if y.is_empty() {
        return Ok(());
    }
    let f = kernel(&gpu, MODULE, "emb_fwd", y.dtype())?;
    let n_i = n as i64;
    let cfg = elem_cfg(n * h);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&ids.slice).arg(&w.slice);
    arg_dm(&mut l, y);
    l.arg(&n_i).arg(&hi).arg(&vi);
    launch(&mut l, cfg, "emb_fwd")
}

/// `dE` `[vocab, h]` (+)= per-token sums of `dy` `[n, h]`'s rows; `ids` the host token ids.
pub fn backward(
    ids: &[u32],
    dy: &DBuf,
    vocab: usize,
    h: usize,
    de: &mut GBuf<f32>,
    accumulate: bool,
) -> Result<()> {
    check_g("embedding dE", de, vocab.saturating_mul(h))?;
    check_d("embedding dy", dy, ids.len().saturating_mul(h), dy.dtype())?;
    let gpu = de.gpu().clone();
    check_gpu("embedding dy", &gpu, dy.gpu())?;
    let hi = int("embedding h", h)?;
    int("embedding vocab", vocab)?;
    if de.is_empty() {
        return Ok(());
    }
    let (off, pos) = super::cpu::position_lists(ids, vocab)?;
    let off = gpu.upload(&off)?;
    // An empty upload is not a valid pointer on every driver: keep one slot.
    let pos = gpu.upload(if pos.is_empty() { &[0i32][..] } else { &pos })?;
    let f = kernel(&gpu, MODULE, "emb_bwd", dy.dtype())?;
    let acc = accumulate as i32;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&off.slice).arg(&pos.slice);
    arg_d(&mut l, dy);
    l.arg(&mut de.slice).arg(&hi).arg(&acc);
    let cfg = LaunchConfig {
        grid_dim: (vocab as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(&mut l, cfg, "emb_bwd")
}
