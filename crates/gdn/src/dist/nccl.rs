//! The NCCL communicator: one process per GPU, ranks from the launcher's environment
//! ([`DistEnv`]), the NCCL unique id made by rank 0 and shared over the TCP rendezvous. NCCL is
//! loaded at run time (cudarc's dynamic loading): building and the CPU paths need no NCCL, and a
//! missing `libnccl.so` is an error when a communicator is created. Everything is queued on the
//! GPU's one stream (the layer's), so collectives are ordered with the kernels around them.
//! NVLink multicast (NVLS) is kept off: `NCCL_NVLS_ENABLE=0` is set before NCCL initializes unless
//! the environment already says otherwise; nothing here calls `cuMulticastCreate`.
//!
//! All-to-all and all-gather are grouped point-to-point sends and receives (one segment per
//! peer). The sum is [`Communicator::all_reduce_sum`]'s: gather, then add in rank order on every
//! rank (not NCCL's ring all-reduce, whose order of additions depends on the rank).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nr, sys as ns};

use super::comm::{check_a2a, copy_range, Communicator};
use super::env::DistEnv;
use super::grid::Grid;
use super::rendezvous;
use crate::backend::cuda::{self, DBuf, Gpu};
use crate::backend::Act;
use crate::error::{GdnError, Result};

/// Whether `libnccl.so` can be loaded here.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { ns::is_culib_present() }
}

/// A fresh NCCL unique id (128 bytes).
fn new_id() -> Result<Vec<u8>> {
    let id = nr::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn nccl_err(what: &str, e: nr::NcclError) -> GdnError {
    GdnError::Device(format!("NCCL {what}: {:?}", e.0))
}

/// One rank of an NCCL group, on one GPU.
pub struct Nccl {
    comm: ns::ncclComm_t,
    gpu: Arc<Gpu>,
    rank: usize,
    size: usize,
}

// SAFETY: the communicator handle is used from one thread at a time (NCCL's rule for one
// communicator); `Nccl` is shared behind `Arc` only to hand it to the layer.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Nccl(rank {} of {} on cuda:{})",
            self.rank,
            self.size,
            self.gpu.ordinal()
        )
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and used by nothing else after this.
        unsafe {
            let _ = nr::comm_destroy(self.comm);
        }
    }
}

/// How long ranks wait for each other at the rendezvous (`GDN_RENDEZVOUS_TIMEOUT` seconds,
/// default 300).
pub fn rendezvous_timeout() -> Duration {
    let s = std::env::var("GDN_RENDEZVOUS_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(300);
    Duration::from_secs(s)
}

impl Nccl {
    /// The group of the launched processes: this process is `env.rank` on `cuda:env.local_rank`.
    pub fn from_env(env: &DistEnv) -> Result<Self> {
        let gpu = Self::prepare(env)?;
        let id = rendezvous::share(
            &env.master_addr,
            env.master_port,
            env.rank,
            env.world_size,
            rendezvous_timeout(),
            new_id,
        )?;
        Self::init(gpu, &id, env.rank, env.world_size)
    }

    /// The launched processes as a `dp x cp` grid ([`Grid`]; world rank `d cp + c`): one NCCL
    /// communicator per group of more than one rank (rank 0 makes every group's id and shares
    /// them in one rendezvous; every rank creates its CP group first, then its DP group), a
    /// group of one rank is in-process. Errors unless `WORLD_SIZE = dp x cp`.
    pub fn grid(env: &DistEnv, dp: usize, cp: usize) -> Result<Grid> {
        super::grid::check_layout(dp, cp, Some(env.world_size))?;
        let gpu = Self::prepare(env)?;
        let ids = rendezvous::share(
            &env.master_addr,
            env.master_port,
            env.rank,
            env.world_size,
            rendezvous_timeout(),
            || {
                let mut v = Vec::with_capacity(128 * (dp + cp));
                for _ in 0..dp + cp {
                    v.extend(new_id()?);
                }
                Ok(v)
            },
        )?;
        if ids.len() != 128 * (dp + cp) {
            return Err(GdnError::Device(format!(
                "rendezvous: {} bytes of NCCL ids, expected {}",
                ids.len(),
                128 * (dp + cp)
            )));
        }
        let (d, c) = (env.rank / cp, env.rank % cp);
        let solo = || -> Result<Arc<dyn Communicator>> {
            Ok(Arc::new(
                super::inproc::InProc::group(1)?
                    .into_iter()
                    .next()
                    .expect("one rank"),
            ))
        };
        // CP group d: ids[d]; DP group c: ids[dp + c].
        let cpc: Arc<dyn Communicator> = if cp > 1 {
            Arc::new(Self::init(
                gpu.clone(),
                &ids[128 * d..128 * (d + 1)],
                c,
                cp,
            )?)
        } else {
            solo()?
        };
        let dpc: Arc<dyn Communicator> = if dp > 1 {
            let o = 128 * (dp + c);
            Arc::new(Self::init(gpu, &ids[o..o + 128], d, dp)?)
        } else {
            solo()?
        };
        Ok(Grid { dp: dpc, cp: cpc })
    }

    /// NVLS off, NCCL present, this rank's GPU.
    fn prepare(env: &DistEnv) -> Result<Arc<Gpu>> {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // Before NCCL reads its environment (at the first communicator); no other thread
            // reads the environment at this point of startup.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        if !nccl_present() {
            return Err(GdnError::Device(
                "NCCL (libnccl.so.2) was not found; install NCCL (e.g. pip's nvidia-nccl-cu13) and put its lib directory on LD_LIBRARY_PATH".into(),
            ));
        }
        let n = cuda::device_count();
        if env.local_rank >= n {
            return Err(GdnError::Device(format!(
                "LOCAL_RANK={} but this machine has {n} CUDA GPUs (one process per GPU: start at most {n} on this machine)",
                env.local_rank
            )));
        }
        cuda::gpu(env.local_rank)
    }

    /// Rank `rank` of a communicator of `size` ranks with the unique id `id` (128 bytes).
    fn init(gpu: Arc<Gpu>, id: &[u8], rank: usize, size: usize) -> Result<Self> {
        if id.len() != 128 {
            return Err(GdnError::Device(format!(
                "rendezvous: the NCCL id has {} bytes, expected 128",
                id.len()
            )));
        }
        let mut internal = [0 as ::core::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(id) {
            *d = *s as ::core::ffi::c_char;
        }
        let uid = ns::ncclUniqueId { internal };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL; the GPU's context is bound to this thread first.
        let comm = unsafe {
            bind(&gpu)?;
            nr::comm_init_rank(comm.as_mut_ptr(), size as i32, uid, rank as i32)
                .map_err(|e| nccl_err("ncclCommInitRank", e))?;
            comm.assume_init()
        };
        Ok(Nccl {
            comm,
            gpu,
            rank,
            size,
        })
    }

    /// The GPU this rank uses.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn stream(&self) -> ns::cudaStream_t {
        self.gpu.stream().cu_stream() as ns::cudaStream_t
    }

    /// `f` between ncclGroupStart and ncclGroupEnd.
    fn group(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        bind(&self.gpu)?;
        nr::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let r = f();
        let end = nr::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
        r.and(end.map(|_| ()))
    }

    /// Device buffer of a host or device activation, on this rank's GPU (host: uploaded as f32).
    fn on_device(&self, x: &Act) -> Result<(DBufRef, bool)> {
        match x {
            Act::Dev(d) => {
                if d.gpu().ordinal() != self.gpu.ordinal() {
                    return Err(GdnError::Device(format!(
                        "NCCL rank {} is on cuda:{} but the buffer on cuda:{}",
                        self.rank,
                        self.gpu.ordinal(),
                        d.gpu().ordinal()
                    )));
                }
                Ok((DBufRef::Borrowed, false))
            }
            Act::Host(v) => Ok((
                DBufRef::Owned(DBuf::upload(
                    &self.gpu,
                    v,
                    crate::backend::cuda::DType::F32,
                )?),
                true,
            )),
        }
    }
}

enum DBufRef {
    Borrowed,
    Owned(DBuf),
}

fn bind(gpu: &Gpu) -> Result<()> {
    gpu.stream()
        .context()
        .bind_to_thread()
        .map_err(|e| GdnError::Device(format!("binding the CUDA context: {e:?}")))
}

/// (device pointer, NCCL type, element size) of a device buffer at element `off`.
fn ptr(d: &DBuf, gpu: &Gpu, off: usize) -> (u64, ns::ncclDataType_t, usize) {
    match d {
        DBuf::F32(b) => {
            let (p, _s) = b.slice.device_ptr(gpu.stream());
            (p + 4 * off as u64, ns::ncclDataType_t::ncclFloat32, 4)
        }
        DBuf::Bf16(b) => {
            let (p, _s) = b.slice.device_ptr(gpu.stream());
            (p + 2 * off as u64, ns::ncclDataType_t::ncclBfloat16, 2)
        }
    }
}

fn ptr_mut(d: &mut DBuf, gpu: &Gpu, off: usize) -> (u64, ns::ncclDataType_t) {
    match d {
        DBuf::F32(b) => {
            let (p, _s) = b.slice.device_ptr_mut(gpu.stream());
            (p + 4 * off as u64, ns::ncclDataType_t::ncclFloat32)
        }
        DBuf::Bf16(b) => {
            let (p, _s) = b.slice.device_ptr_mut(gpu.stream());
            (p + 2 * off as u64, ns::ncclDataType_t::ncclBfloat16)
        }
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn kind(&self) -> &'static str {
        "nccl"
    }

    fn all_to_all(&self, send: &Act, send_counts: &[usize], recv_counts: &[usize]) -> Result<Act> {
        check_a2a(self, send, send_counts, recv_counts)?;
        let (owned, was_host) = self.on_device(send)?;
        let src: &DBuf = match (&owned, send) {
            (DBufRef::Owned(d), _) => d,
            (DBufRef::Borrowed, Act::Dev(d)) => d,
            _ => return Err(GdnError::Invalid("all_to_all: internal".into())),
        };
        let total: usize = recv_counts.iter().sum();
        let mut out = DBuf::uninit(&self.gpu, total, src.dtype())?;
        let stream = self.stream();
        self.group(|| {
            let (mut so, mut ro) = (0, 0);
            for peer in 0..self.size {
                let (sp, ty, _) = ptr(src, &self.gpu, so);
                let (rp, _) = ptr_mut(&mut out, &self.gpu, ro);
                // SAFETY: the pointers address `send_counts[peer]` / `recv_counts[peer]` elements
                // inside live buffers that outlive the group (stream-ordered).
                unsafe {
                    if send_counts[peer] > 0 {
                        nr::send(
                            sp as _,
                            send_counts[peer],
                            ty,
                            peer as i32,
                            self.comm,
                            stream,
                        )
                        .map_err(|e| nccl_err("ncclSend", e))?;
                    }
                    if recv_counts[peer] > 0 {
                        nr::recv(
                            rp as _,
                            recv_counts[peer],
                            ty,
                            peer as i32,
                            self.comm,
                            stream,
                        )
                        .map_err(|e| nccl_err("ncclRecv", e))?;
                    }
                }
                so += send_counts[peer];
                ro += recv_counts[peer];
            }
            Ok(())
        })?;
        drop(owned);
        if was_host {
            return Ok(Act::Host(out.download()?));
        }
        Ok(Act::Dev(out))
    }

    fn all_gather(&self, x: &Act) -> Result<Vec<Act>> {
        let n = x.len();
        let send_counts = vec![n; self.size];
        // Every rank sends its buffer to every rank (itself included): an all-to-all of copies.
        let mut rep = crate::dist::comm::alloc_like(x, n * self.size)?;
        for r in 0..self.size {
            copy_range(&mut rep, r * n, x, 0, n)?;
        }
        let all = self.all_to_all(&rep, &send_counts, &send_counts)?;
        (0..self.size)
            .map(|r| {
                let mut p = crate::dist::comm::alloc_like(&all, n)?;
                copy_range(&mut p, 0, &all, r * n, n)?;
                Ok(p)
            })
            .collect()
    }

    fn broadcast(&self, x: &mut Act, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(GdnError::Invalid(format!(
                "broadcast: root {root} of {} ranks",
                self.size
            )));
        }
        let n = x.len();
        let mut counts = vec![0; self.size];
        let mut recv = vec![0; self.size];
        recv[root] = n;
        if self.rank == root {
            counts = vec![n; self.size];
        }
        let mut send = crate::dist::comm::alloc_like(x, counts.iter().sum())?;
        if self.rank == root {
            for r in 0..self.size {
                copy_range(&mut send, r * n, x, 0, n)?;
            }
        }
        let got = self.all_to_all(&send, &counts, &recv)?;
        copy_range(x, 0, &got, 0, n)
    }

    fn barrier(&self) -> Result<()> {
        let z = Act::Dev(DBuf::zeros(&self.gpu, 1, crate::backend::cuda::DType::F32)?);
        self.all_gather(&z)?;
        self.gpu.sync()
    }
}
