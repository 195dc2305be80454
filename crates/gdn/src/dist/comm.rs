//! The [`Communicator`] trait: the collectives the parallel paths need, over [`Act`] buffers
//! (f32 on the host; f32 or bf16 storage on a GPU). fp32 buffers ([`F32s`]) go through
//! [`all_reduce_sum_f32`]; plain host vectors through [`all_reduce_sum_host`].

use std::sync::Arc;

use crate::backend::cuda::{DBuf, GBuf};
use crate::backend::{Act, F32s};
use crate::error::{GdnError, Result};
use crate::ops::add;

/// A group of `size()` ranks; this value is rank `rank()`. Every rank must call the same
/// collectives in the same order (like NCCL and MPI); a rank that stops answering makes the
/// others fail with an error (in-process: at once when its end is dropped, else after a timeout).
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// What carries the data (`"in-process"`, `"nccl"`), for messages.
    fn kind(&self) -> &'static str;

    /// All-to-all with per-rank split sizes: `send` holds `size()` contiguous segments in rank
    /// order, `send_counts[i]` elements for rank `i`; the result holds `recv_counts[j]` elements
    /// from rank `j`, in rank order. Rank `i`'s `recv_counts[j]` must equal rank `j`'s
    /// `send_counts[i]`. The result lives where `send` does (same GPU, same storage type).
    fn all_to_all(&self, send: &Act, send_counts: &[usize], recv_counts: &[usize]) -> Result<Act>;

    /// Every rank's `x` (all of one length), in rank order, where `x` lives.
    fn all_gather(&self, x: &Act) -> Result<Vec<Act>>;

    /// Rank `root`'s `x` into every rank's `x` (same length on every rank).
    fn broadcast(&self, x: &mut Act, root: usize) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// `x` becomes the sum over ranks of `x`, added in rank order 0, 1, ..., N-1 (gather, then
    /// `((x_0 + x_1) + x_2) + ...` on every rank): the same bits on every rank and in every run.
    fn all_reduce_sum(&self, x: &mut Act) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        let parts = self.all_gather(x)?;
        let mut it = parts.into_iter();
        let mut acc = it
            .next()
            .ok_or_else(|| GdnError::Invalid("all_reduce_sum: empty group".into()))?;
        for p in it {
            add::add_assign(&mut acc, &p)?;
        }
        *x = acc;
        Ok(())
    }
}

/// [`Communicator::all_reduce_sum`] over an fp32 buffer (host or device).
pub fn all_reduce_sum_f32(comm: &dyn Communicator, x: &mut F32s) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let taken = std::mem::replace(x, F32s::Host(Vec::new()));
    let mut a = f32s_to_act(taken);
    let r = comm.all_reduce_sum(&mut a);
    *x = act_to_f32s(a)?;
    r
}

/// [`Communicator::all_reduce_sum`] over host values.
pub fn all_reduce_sum_host(comm: &dyn Communicator, x: &mut Vec<f32>) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let mut a = Act::Host(std::mem::take(x));
    let r = comm.all_reduce_sum(&mut a);
    *x = a.into_host()?;
    r
}

/// An fp32 buffer as an activation (moves, no copy).
pub fn f32s_to_act(x: F32s) -> Act {
    match x {
        F32s::Host(v) => Act::Host(v),
        F32s::Dev(g) => Act::Dev(DBuf::F32(g)),
    }
}

/// An f32 activation as an fp32 buffer (moves, no copy); bf16 storage is an error.
pub fn act_to_f32s(x: Act) -> Result<F32s> {
    match x {
        Act::Host(v) => Ok(F32s::Host(v)),
        Act::Dev(DBuf::F32(g)) => Ok(F32s::Dev(g)),
        Act::Dev(DBuf::Bf16(_)) => Err(GdnError::Invalid(
            "expected an fp32 buffer, got bf16 storage".into(),
        )),
    }
}

/// Checks shared by the implementations of [`Communicator::all_to_all`].
pub(crate) fn check_a2a(
    comm: &dyn Communicator,
    send: &Act,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<()> {
    let n = comm.size();
    if send_counts.len() != n || recv_counts.len() != n {
        return Err(GdnError::Invalid(format!(
            "all_to_all: {} send counts and {} receive counts for {n} ranks",
            send_counts.len(),
            recv_counts.len()
        )));
    }
    let total: usize = send_counts.iter().sum();
    if total != send.len() {
        return Err(GdnError::Invalid(format!(
            "all_to_all: send counts add up to {total} but the buffer holds {}",
            send.len()
        )));
    }
    Ok(())
}

/// A buffer of `n` elements where `like` lives (host zeros; device uninitialized, same dtype).
pub fn alloc_like(like: &Act, n: usize) -> Result<Act> {
    Ok(match like {
        Act::Host(_) => Act::Host(vec![0.0; n]),
        Act::Dev(d) => Act::Dev(DBuf::uninit(d.gpu(), n, d.dtype())?),
    })
}

/// Copy `len` elements from `src[src_off..]` to `dst[dst_off..]` (same place and storage type;
/// on a GPU one stream-ordered device-to-device copy).
pub fn copy_range(
    dst: &mut Act,
    dst_off: usize,
    src: &Act,
    src_off: usize,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if dst_off + len > dst.len() || src_off + len > src.len() {
        return Err(GdnError::Invalid(format!(
            "copy_range: [{src_off}, +{len}) of {} into [{dst_off}, +{len}) of {}",
            src.len(),
            dst.len()
        )));
    }
    match (dst, src) {
        (Act::Host(d), Act::Host(s)) => {
            d[dst_off..dst_off + len].copy_from_slice(&s[src_off..src_off + len]);
            Ok(())
        }
        (Act::Dev(DBuf::F32(d)), Act::Dev(DBuf::F32(s))) => dtod(d, dst_off, s, src_off, len),
        (Act::Dev(DBuf::Bf16(d)), Act::Dev(DBuf::Bf16(s))) => dtod(d, dst_off, s, src_off, len),
        _ => Err(GdnError::Invalid(
            "copy_range: buffers of different places or storage types".into(),
        )),
    }
}

fn dtod<T: cudarc::driver::DeviceRepr>(
    d: &mut GBuf<T>,
    dst_off: usize,
    s: &GBuf<T>,
    src_off: usize,
    len: usize,
) -> Result<()> {
    if !Arc::ptr_eq(d.gpu(), s.gpu()) {
        return Err(GdnError::Device(format!(
            "copy_range: cuda:{} and cuda:{}",
            d.gpu().ordinal(),
            s.gpu().ordinal()
        )));
    }
    let gpu = d.gpu().clone();
    let sv = s.slice.slice(src_off..src_off + len);
    let mut dv = d.slice.slice_mut(dst_off..dst_off + len);
    gpu.stream()
        .memcpy_dtod(&sv, &mut dv)
        .map_err(|e| GdnError::Device(format!("cuMemcpyDtoDAsync: {e:?}")))
}

/// Host values placed where `like` lives (device: uploaded in `like`'s storage type).
pub(crate) fn host_like(like: &Act, v: Vec<f32>) -> Result<Act> {
    Ok(match like {
        Act::Host(_) => Act::Host(v),
        Act::Dev(d) => Act::Dev(DBuf::upload(d.gpu(), &v, d.dtype())?),
    })
}

/// A copy of `x`, where it lives.
pub fn clone_act(x: &Act) -> Result<Act> {
    Ok(match x {
        Act::Host(v) => Act::Host(v.clone()),
        Act::Dev(d) => Act::Dev(d.try_clone()?),
    })
}
