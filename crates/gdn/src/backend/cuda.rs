//! The CUDA device: one context and one stream per GPU, an allocator that counts live and peak
//! bytes, and kernels compiled by NVRTC at first use for the device's architecture and cached on
//! disk (key: source hash + options + architecture + NVRTC version).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub use cudarc::driver::CudaGraph;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use rayon::prelude::*;

use super::kernels;
use crate::error::{GdnError, Result};

fn dev_err(what: &str, e: impl std::fmt::Debug) -> GdnError {
    GdnError::Device(format!("{what}: {e:?}"))
}

/// Whether the CUDA driver library can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Number of CUDA devices (0 when the driver is missing).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// One GPU: context, stream, compiled kernels, byte counters.
pub struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    name: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// How many of the loaded modules came from their CUBIN (the rest from PTX, JIT-compiled).
    cubin_loads: AtomicUsize,
    live: AtomicUsize,
    peak: AtomicUsize,
    blaslt: OnceLock<BlasLt>,
    /// The stream CUDA graphs are captured on (created at the first capture; the legacy default
    /// stream `stream` cannot be captured), see [`Gpu::capture`].
    capture_stream: OnceLock<Arc<CudaStream>>,
    /// The thread (a [`thread_token`]) capturing now, 0 when none: on that thread
    /// [`Gpu::stream`] is the capture stream.
    capture_owner: AtomicU64,
    /// One capture at a time per GPU.
    capture_lock: Mutex<()>,
    /// A second stream for kernels that may run beside those on [`Gpu::stream`] (created at
    /// first use), see [`Gpu::side_stream`].
    side_stream: OnceLock<Arc<CudaStream>>,
    /// Zeroed counters that kernels which pick their last CTA by a counter leave zero again
    /// (the skinny GEMM's split-K), made at first use, kept for the life of the process (a graph
    /// may bake in their address).
    counters: OnceLock<CudaSlice<u32>>,
}

/// Number of counters [`Gpu::counters`] holds.
pub const COUNTERS: usize = 1 << 16;

/// A small per-thread number (1, 2, ...), to tell the capturing thread from the others.
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|t| *t)
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({} {} {})", self.ordinal, self.name, self.arch)
    }
}

/// The kernels need compute capability 8.0 or newer (bf16 storage, TF32 `mma.sync`): an older
/// GPU is refused when it is opened, with its name, instead of failing at the first kernel load.
pub fn check_capability(ordinal: usize, name: &str, major: i32, minor: i32) -> Result<()> {
    if major < 8 {
        return Err(GdnError::Device(format!(
            "cuda:{ordinal} ({name}) has compute capability {major}.{minor}; gdn's CUDA kernels need \
             8.0 or newer (Ampere, Ada, Hopper, Blackwell). Use --device cpu"
        )));
    }
    Ok(())
}

/// NVRTC `--gpu-architecture` for a compute capability. Hopper gets `sm_90a` (wgmma, setmaxnreg).
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "sm_90a",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => "sm_80",
    }
}

static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();

/// The GPU with this ordinal (created on first use).
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    let map = GPUS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut m = map
        .lock()
        .map_err(|_| GdnError::Device("GPU registry poisoned".into()))?;
    if let Some(g) = m.get(&ordinal) {
        return Ok(g.clone());
    }
    if !driver_present() {
        return Err(GdnError::Device(
            "the CUDA driver library (libcuda.so) was not found; install the NVIDIA driver or run on the CPU".into(),
        ));
    }
    if !nvrtc_present() {
        return Err(GdnError::Device(
            "NVRTC (libnvrtc.so.13) was not found; put CUDA 13's lib directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let n = device_count();
    if ordinal >= n {
        return Err(GdnError::Device(format!(
            "cuda:{ordinal} requested but {n} CUDA device(s) found"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating the CUDA context", e))?;
    let (maj, min) = ctx
        .compute_capability()
        .map_err(|e| dev_err("compute capability", e))?;
    let name = ctx.name().unwrap_or_else(|_| "unknown".into());
    check_capability(ordinal, &name, maj, min)?;
    let stream = ctx.default_stream();
    keep_pool_memory(&ctx)?;
    let g = Arc::new(Gpu {
        ordinal,
        ctx,
        stream,
        arch: arch_for(maj, min),
        name,
        modules: Mutex::new(HashMap::new()),
        cubin_loads: AtomicUsize::new(0),
        live: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        blaslt: OnceLock::new(),
        capture_stream: OnceLock::new(),
        capture_owner: AtomicU64::new(0),
        capture_lock: Mutex::new(()),
        side_stream: OnceLock::new(),
        counters: OnceLock::new(),
    });
    m.insert(ordinal, g.clone());
    Ok(g)
}

/// The memory pool our allocations come from, when cudarc allocates stream-ordered
/// (`cuMemAllocAsync` from the device's current pool, used when the device supports pools).
fn async_pool(ctx: &CudaContext) -> Result<Option<cudarc::driver::sys::CUmemoryPool>> {
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    ctx.bind_to_thread()
        .map_err(|e| dev_err("binding the CUDA context", e))?;
    // SAFETY: the device handle is the context's own.
    let pool = unsafe { cudarc::driver::result::device::get_mem_pool(ctx.cu_device()) }
        .map_err(|e| dev_err("cuDeviceGetMemPool", e))?;
    Ok(Some(pool))
}

/// Make the stream-ordered pool a caching pool: by default (release threshold 0) it returns every
/// freed block to the driver at each synchronization, so a step's multi-GB workspaces were
/// obtained from the driver again after every sync. With the threshold at `u64::MAX` freed blocks
/// stay in the pool and steady-state steps allocate nothing from the driver. The allocator's
/// live/peak counters count our buffers (not the pool), so they are unchanged; [`Gpu::mem_info`]
/// counts the pool's idle blocks as free.
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    let Some(pool) = async_pool(ctx)? else {
        return Ok(());
    };
    let mut v: u64 = u64::MAX;
    // SAFETY: `pool` is the device's live pool; this attribute's value is a cuuint64_t.
    unsafe {
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut v) as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .map_err(|e| dev_err("raising the memory pool's release threshold", e))
}

/// A device buffer whose bytes are counted by its GPU's allocator while it lives.
pub struct GBuf<T: DeviceRepr> {
    pub slice: CudaSlice<T>,
    gpu: Arc<Gpu>,
}

impl<T: DeviceRepr> GBuf<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.slice.len() * std::mem::size_of::<T>()
    }
    /// The GPU it lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    /// A copy of elements `start..start + len` (device to device on the GPU's stream, no sync).
    pub fn copy_range(&self, start: usize, len: usize) -> Result<GBuf<T>> {
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| {
                GdnError::Invalid(format!(
                    "copy_range {start}..{start}+{len} of a buffer of {} elements",
                    self.len()
                ))
            })?;
        let mut c = self.gpu.uninit::<T>(len)?;
        if len > 0 {
            self.gpu
                .stream()
                .memcpy_dtod(&self.slice.slice(start..end), &mut c.slice)
                .map_err(|e| dev_err("cuMemcpyDtoDAsync", e))?;
        }
        Ok(c)
    }
}

impl<T: DeviceRepr> GBuf<T> {
    /// Wrap `len` elements of device memory that gdn does not own (another library's tensor, e.g.
    /// PyTorch's through DLPack) on `gpu`, to pass it to an op without a copy. Its bytes count as
    /// live while wrapped. It must be given back with [`into_raw`](Self::into_raw), never
    /// dropped: dropping frees the memory into gdn's pool.
    ///
    /// # Safety
    /// `ptr` must point to `len` valid elements of `T` in `gpu`'s (primary) context, stay valid
    /// until `into_raw`, and its pending writes must be ordered before gdn's stream.
    pub unsafe fn from_raw(
        gpu: &Arc<Gpu>,
        ptr: cudarc::driver::sys::CUdeviceptr,
        len: usize,
    ) -> Self {
        let slice = gpu.stream.upgrade_device_ptr::<T>(ptr, len);
        gpu.count(len * std::mem::size_of::<T>());
        GBuf {
            slice,
            gpu: gpu.clone(),
        }
    }

    /// Give back memory wrapped by [`from_raw`](Self::from_raw) without freeing it; returns
    /// its pointer. Its bytes stop counting as live.
    pub fn into_raw(self) -> cudarc::driver::sys::CUdeviceptr {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so each field is moved out exactly once.
        let (slice, gpu) = unsafe { (std::ptr::read(&me.slice), std::ptr::read(&me.gpu)) };
        gpu.live
            .fetch_sub(slice.len() * std::mem::size_of::<T>(), Ordering::Relaxed);
        slice.leak()
    }

    /// The device address of the first element (for handing a buffer to another library; the
    /// buffer must outlive that use).
    pub fn device_ptr(&self) -> cudarc::driver::sys::CUdeviceptr {
        use cudarc::driver::DevicePtr;
        let (p, _sync) = self.slice.device_ptr(&self.gpu.stream);
        p
    }
}

impl<T: DeviceRepr> Drop for GBuf<T> {
    fn drop(&mut self) {
        self.gpu.live.fetch_sub(self.bytes(), Ordering::Relaxed);
    }
}

/// Storage type of device tensors: f32 (verification) or bf16 (training; fp32 accumulation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
}

/// Values per rayon task of the host-side f32 <-> bf16 conversions of `DBuf::upload` /
/// `download` (the host API's copies of x, dy, y, dx: 67M values each at T 32768, hidden 2048).
const CONVERT_CHUNK: usize = 1 << 16;

/// A device tensor's storage: f32 or bf16 (raw 16-bit words).
pub enum DBuf {
    F32(GBuf<f32>),
    Bf16(GBuf<u16>),
}

impl DBuf {
    /// Storage type.
    pub fn dtype(&self) -> DType {
        match self {
            DBuf::F32(_) => DType::F32,
            DBuf::Bf16(_) => DType::Bf16,
        }
    }
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            DBuf::F32(b) => b.len(),
            DBuf::Bf16(b) => b.len(),
        }
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes.
    pub fn bytes(&self) -> usize {
        match self {
            DBuf::F32(b) => b.bytes(),
            DBuf::Bf16(b) => b.bytes(),
        }
    }
    /// Upload f32 host data, stored as `dtype` (bf16: round to nearest even).
    pub fn upload(gpu: &Arc<Gpu>, host: &[f32], dtype: DType) -> Result<DBuf> {
        Ok(match dtype {
            DType::F32 => DBuf::F32(gpu.upload(host)?),
            DType::Bf16 => {
                // Elementwise, order kept: the same bits as a sequential conversion.
                let h: Vec<u16> = host
                    .par_iter()
                    .with_min_len(CONVERT_CHUNK)
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                DBuf::Bf16(gpu.upload(&h)?)
            }
        })
    }
    /// A buffer of `n` elements of `dtype`, uninitialized.
    pub fn uninit(gpu: &Arc<Gpu>, n: usize, dtype: DType) -> Result<DBuf> {
        Ok(match dtype {
            DType::F32 => DBuf::F32(gpu.uninit(n)?),
            DType::Bf16 => DBuf::Bf16(gpu.uninit(n)?),
        })
    }
    /// A zeroed buffer.
    pub fn zeros(gpu: &Arc<Gpu>, n: usize, dtype: DType) -> Result<DBuf> {
        Ok(match dtype {
            DType::F32 => DBuf::F32(gpu.zeros(n)?),
            DType::Bf16 => DBuf::Bf16(gpu.zeros(n)?),
        })
    }
    /// A copy on the same GPU and stream (device to device, no sync), same dtype and bits.
    pub fn try_clone(&self) -> Result<DBuf> {
        fn dup<T: DeviceRepr>(b: &GBuf<T>) -> Result<GBuf<T>> {
            let mut c = b.gpu.uninit::<T>(b.len())?;
            b.gpu
                .stream()
                .memcpy_dtod(&b.slice, &mut c.slice)
                .map_err(|e| dev_err("cuMemcpyDtoDAsync", e))?;
            Ok(c)
        }
        Ok(match self {
            DBuf::F32(b) => DBuf::F32(dup(b)?),
            DBuf::Bf16(b) => DBuf::Bf16(dup(b)?),
        })
    }
    /// Download as f32 (synchronizes).
    pub fn download(&self) -> Result<Vec<f32>> {
        match self {
            DBuf::F32(b) => b.gpu().download(b),
            DBuf::Bf16(b) => Ok(b
                .gpu()
                .download(b)?
                .into_par_iter()
                .with_min_len(CONVERT_CHUNK)
                .map(|x| half::bf16::from_bits(x).to_f32())
                .collect()),
        }
    }
    /// The GPU it lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        match self {
            DBuf::F32(b) => b.gpu(),
            DBuf::Bf16(b) => b.gpu(),
        }
    }
}

impl Gpu {
    /// Ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// NVRTC architecture used for kernels.
    pub fn arch(&self) -> &'static str {
        self.arch
    }
    /// The stream all our work goes to: the context's default stream, except on a thread inside
    /// [`Gpu::capture`], where it is the capture stream (so every op's launches, allocations and
    /// copies on that thread become nodes of the graph).
    pub fn stream(&self) -> &Arc<CudaStream> {
        let owner = self.capture_owner.load(Ordering::Acquire);
        if owner != 0 && owner == thread_token() {
            if let Some(s) = self.capture_stream.get() {
                return s;
            }
        }
        &self.stream
    }
    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> Result<usize> {
        self.ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map(|n| n.max(1) as usize)
            .map_err(|e| dev_err("querying the multiprocessor count", e))
    }

    /// The capture stream (created on first use: a non-blocking stream of this context, kept
    /// for the life of the process like the GPU itself). Called under `capture_lock`.
    fn capture_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.capture_stream.get() {
            return Ok(s);
        }
        let _ = self
            .capture_stream
            .set(self.process_stream("the capture stream")?);
        Ok(self.capture_stream.get().expect("set above"))
    }

    /// A new non-blocking stream of this context that lives as long as the process (never
    /// destroyed, like the GPU itself; not counted by cudarc's multi-stream event tracking,
    /// which stays off: our code orders its streams itself).
    fn process_stream(&self, what: &str) -> Result<Arc<CudaStream>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the CUDA context", e))?;
        let raw = cudarc::driver::result::stream::create(
            cudarc::driver::result::stream::StreamKind::NonBlocking,
        )
        .map_err(|e| dev_err(&format!("creating {what}"), e))?;
        // SAFETY: `raw` is a live stream of this context, never destroyed (the wrapper does not
        // own it, and the GPU registry keeps this `Gpu` for the life of the process).
        Ok(unsafe { self.ctx.wrap_borrowed_stream(raw) })
    }

    /// A second stream, for work that may overlap the work queued on [`Gpu::stream`] (e.g. two
    /// independent scans of the rule's backward that each leave most of every SM idle), or
    /// `None` on a thread that is capturing a graph (callers then queue everything on
    /// [`Gpu::stream`]). A non-blocking stream: it never waits for [`Gpu::stream`] by itself, so
    /// every use is bracketed by [`Gpu::order`]: `order(main, side)` before the side's work
    /// (it sees everything queued on the main stream so far) and `order(side, main)` after it,
    /// before the main stream touches what the side work reads or writes, and before any buffer
    /// the side work uses is freed (frees are ordered on the main stream).
    pub(crate) fn side_stream(&self) -> Result<Option<&Arc<CudaStream>>> {
        let owner = self.capture_owner.load(Ordering::Acquire);
        if owner != 0 && owner == thread_token() {
            return Ok(None);
        }
        if let Some(s) = self.side_stream.get() {
            return Ok(Some(s));
        }
        let _ = self
            .side_stream
            .set(self.process_stream("a second stream")?);
        Ok(self.side_stream.get())
    }

    /// Make the work queued on `after` from now on wait for everything queued on `before` so far
    /// (an event recorded on `before`, waited on by `after`; nothing blocks the host).
    pub(crate) fn order(&self, before: &Arc<CudaStream>, after: &Arc<CudaStream>) -> Result<()> {
        let ev = before
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .map_err(|e| dev_err("recording an event", e))?;
        after
            .wait(&ev)
            .map_err(|e| dev_err("waiting for an event", e))
    }

    /// Capture the work that `f` queues on this GPU from the calling thread into a CUDA graph
    /// (instantiated, not run: [`Gpu::launch_graph`] runs it). While `f` runs, [`Gpu::stream`]
    /// is the capture stream on this thread only (other threads keep the default stream; the
    /// capture mode is thread-local), so every op's kernels, GEMMs, copies and stream-ordered
    /// allocations and frees become the graph's nodes. The default stream is synchronized
    /// first (the graph reads what it wrote).
    ///
    /// The graph bakes in every device address `f` used: the buffers it read and wrote must
    /// outlive the graph and stay where they are. Buffers `f` allocates must be dropped inside
    /// `f` (then the graph allocates and frees them itself at each launch); `f` must not
    /// synchronize or copy to the host. One capture at a time per GPU.
    pub fn capture<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, CudaGraph)> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let _one = self
            .capture_lock
            .lock()
            .map_err(|_| GdnError::Device("capture lock poisoned".into()))?;
        let cs = self.capture_stream()?.clone();
        self.sync()?;
        cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| dev_err("beginning a stream capture", e))?;
        /// Ends the capture state on every exit (a panic in `f` included).
        struct Guard<'a> {
            owner: &'a AtomicU64,
            cs: &'a Arc<CudaStream>,
        }
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                self.owner.store(0, Ordering::Release);
                if let Ok(st) = self.cs.capture_status() {
                    if st
                        != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                    {
                        let _ = self.cs.end_capture(CUgraphInstantiate_flags(0));
                    }
                }
            }
        }
        self.capture_owner.store(thread_token(), Ordering::Release);
        let guard = Guard {
            owner: &self.capture_owner,
            cs: &cs,
        };
        let r = f();
        self.capture_owner.store(0, Ordering::Release);
        let g = cs.end_capture(CUgraphInstantiate_flags(0));
        drop(guard);
        let v = r?;
        match g {
            Ok(Some(g)) => Ok((v, g)),
            Ok(None) => Err(GdnError::Device("stream capture produced no graph".into())),
            Err(e) => Err(dev_err(
                "ending a stream capture (instantiating the graph)",
                e,
            )),
        }
    }

    /// Run a graph made by [`Gpu::capture`] on the default stream, after the work queued there.
    pub fn launch_graph(&self, g: &CudaGraph) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the CUDA context", e))?;
        // SAFETY: the graph was instantiated in this context (by `capture`) and is live; the
        // default stream is this context's.
        unsafe { cudarc::driver::result::graph::launch(g.cu_graph_exec(), self.stream.cu_stream()) }
            .map_err(|e| dev_err("launching a CUDA graph", e))
    }

    /// [`COUNTERS`] zeroed `u32` counters for kernels that leave them zero when they finish
    /// (allocated and zeroed on the default stream at the first call, which must not be inside
    /// a capture: the decode graph's warm-up step makes them). Their one user, the skinny GEMM,
    /// runs only on [`Gpu::stream`] (never on [`Gpu::side_stream`]), so two kernels never use
    /// them at once.
    pub fn counters(&self) -> Result<&CudaSlice<u32>> {
        if let Some(c) = self.counters.get() {
            return Ok(c);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the CUDA context", e))?;
        let c = self
            .stream
            .alloc_zeros::<u32>(COUNTERS)
            .map_err(|e| dev_err("allocating the kernel counters", e))?;
        // A racing thread may have set it first; then ours is freed.
        let _ = self.counters.set(c);
        Ok(self.counters.get().expect("set above"))
    }

    /// Free and total bytes of this GPU's memory: the driver's `cuMemGetInfo`, plus the bytes
    /// the caching pool holds but no buffer uses (reserved - used), which our next allocations
    /// get without asking the driver.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| dev_err("querying free GPU memory", e))?;
        let Some(pool) = async_pool(&self.ctx)? else {
            return Ok((free, total));
        };
        let attr = |a| -> Result<u64> {
            let mut v: u64 = 0;
            // SAFETY: `pool` is live; these attributes' values are cuuint64_t.
            unsafe {
                cudarc::driver::result::mem_pool::get_attribute(
                    pool,
                    a,
                    (&mut v) as *mut u64 as *mut std::ffi::c_void,
                )
            }
            .map_err(|e| dev_err("querying the memory pool", e))?;
            Ok(v)
        };
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let reserved = attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = attr(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        let idle = usize::try_from(reserved.saturating_sub(used)).unwrap_or(usize::MAX);
        Ok((free.saturating_add(idle).min(total), total))
    }
    /// Bytes currently held by our buffers.
    pub fn live_bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
    /// Most bytes held at once since the last `reset_peak`.
    pub fn peak_bytes(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
    /// Restart peak tracking from the current live bytes.
    pub fn reset_peak(&self) {
        self.peak.store(self.live_bytes(), Ordering::Relaxed);
    }

    fn count(self: &Arc<Self>, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// A zeroed buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(self: &Arc<Self>, n: usize) -> Result<GBuf<T>> {
        let slice = self
            .stream()
            .alloc_zeros::<T>(n)
            .map_err(|e| dev_err("cudaMalloc", e))?;
        self.count(n * std::mem::size_of::<T>());
        Ok(GBuf {
            slice,
            gpu: self.clone(),
        })
    }

    /// An uninitialized buffer of `n` elements (every element must be written before it is read).
    pub fn uninit<T: DeviceRepr>(self: &Arc<Self>, n: usize) -> Result<GBuf<T>> {
        // SAFETY: callers write every element before reading (tests poison and check this).
        let slice = unsafe { self.stream().alloc::<T>(n) }.map_err(|e| dev_err("cudaMalloc", e))?;
        self.count(n * std::mem::size_of::<T>());
        Ok(GBuf {
            slice,
            gpu: self.clone(),
        })
    }

    /// Copy host data to a new device buffer.
    pub fn upload<T: DeviceRepr>(self: &Arc<Self>, host: &[T]) -> Result<GBuf<T>> {
        let slice = self
            .stream()
            .clone_htod(host)
            .map_err(|e| dev_err("host-to-device copy", e))?;
        self.count(std::mem::size_of_val(host));
        Ok(GBuf {
            slice,
            gpu: self.clone(),
        })
    }

    /// Copy a device buffer to the host (synchronizes the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, buf: &GBuf<T>) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(&buf.slice)
            .map_err(|e| dev_err("device-to-host copy", e))
    }

    /// Wait for all queued work; surfaces asynchronous kernel errors.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| dev_err("stream synchronize", e))
    }

    /// How many kernel modules this GPU loaded from CUBIN (machine code NVRTC made for its
    /// architecture) rather than from PTX (which the driver compiles at load, a minute or more
    /// for the large modules).
    pub fn cubin_loads(&self) -> usize {
        self.cubin_loads.load(Ordering::Relaxed)
    }

    /// The kernel `func` of kernel source `module` (compiled on first use, cached on disk).
    pub fn function(&self, module: &'static str, func: &str) -> Result<CudaFunction> {
        let m = {
            let mut mods = self
                .modules
                .lock()
                .map_err(|_| GdnError::Device("module cache poisoned".into()))?;
            match mods.get(module) {
                Some(m) => m.clone(),
                None => {
                    let code = compile_cached(module, self.arch)?;
                    // The CUBIN needs no JIT; the driver refuses one that is not for this GPU
                    // (or too new for it), and then the PTX is compiled as before.
                    let from_cubin = code
                        .cubin
                        .and_then(|bin| self.ctx.load_module(Ptx::from_binary(bin)).ok());
                    let m = match from_cubin {
                        Some(m) => {
                            self.cubin_loads.fetch_add(1, Ordering::Relaxed);
                            m
                        }
                        None => self
                            .ctx
                            .load_module(Ptx::from_src(code.ptx))
                            .map_err(|e| dev_err(&format!("loading kernels {module}"), e))?,
                    };
                    mods.insert(module, m.clone());
                    m
                }
            }
        };
        m.load_function(func)
            .map_err(|e| dev_err(&format!("kernel {module}::{func}"), e))
    }
}

/// Whether the cuBLASLt library can be loaded here.
pub fn cublaslt_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::cublaslt::sys::is_culib_present() }
}

/// Size of the cuBLASLt workspace of each GPU (NVIDIA's recommendation for Hopper).
pub const BLASLT_WORKSPACE_BYTES: usize = 32 << 20;

/// One GPU's cuBLASLt handle and workspace, created on first use (`Gpu::blaslt`) and kept for the
/// life of the process, and its GEMM plans (one per [`GemmKey`], made at a shape's first use).
/// The workspace is not counted in `live_bytes`: like the context and the libraries' own memory,
/// it is a fixed per-GPU cost, not a tensor.
pub struct BlasLt {
    handle: cudarc::cublaslt::sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<GemmKey, Arc<GemmPlan>>>,
}

/// A column-major cuBLASLt GEMM `D[m, n] = op(A) op(B)` (`op(A)` `[m, k]`, `op(B)` `[k, n]`) with
/// A, B of type `ab` and D of type `d`: the key of its cached [`GemmPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmKey {
    pub transa: bool,
    pub transb: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: i64,
    pub ldb: i64,
    pub ldd: i64,
    pub ab: cudarc::cublaslt::sys::cudaDataType,
    pub d: cudarc::cublaslt::sys::cudaDataType,
}

/// A GEMM's cuBLASLt objects: the matmul descriptor, the layouts of A, B and D (C = D) and the
/// algorithm the heuristic chose (its first result) for the fixed workspace. Made once per
/// [`GemmKey`] and reused, so every call of a shape runs the same algorithm (the bits do not
/// depend on whether the plan was cached). Null handles are not yet created (a plan being built);
/// drop destroys the others.
pub struct GemmPlan {
    pub desc: cudarc::cublaslt::sys::cublasLtMatmulDesc_t,
    pub la: cudarc::cublaslt::sys::cublasLtMatrixLayout_t,
    pub lb: cudarc::cublaslt::sys::cublasLtMatrixLayout_t,
    pub ld: cudarc::cublaslt::sys::cublasLtMatrixLayout_t,
    pub algo: cudarc::cublaslt::sys::cublasLtMatmulAlgo_t,
}

impl GemmPlan {
    /// A plan with no handles yet (filled in by its builder).
    pub fn empty() -> Self {
        GemmPlan {
            desc: std::ptr::null_mut(),
            la: std::ptr::null_mut(),
            lb: std::ptr::null_mut(),
            ld: std::ptr::null_mut(),
            algo: cudarc::cublaslt::sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        }
    }
}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        use cudarc::cublaslt::result as lt;
        // SAFETY: each non-null handle was created once by cuBLASLt and is destroyed once here;
        // a plan is dropped only when no call uses it (it is shared through `Arc`).
        unsafe {
            for l in [self.la, self.lb, self.ld] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

// SAFETY: a plan's descriptors are only read after it is built (cuBLASLt allows concurrent reads);
// all our GEMMs go to the GPU's one stream.
unsafe impl Send for GemmPlan {}
unsafe impl Sync for GemmPlan {}

// SAFETY: a cuBLASLt handle may be used from any thread; all our work goes to the GPU's one stream,
// which orders every use of the shared workspace.
unsafe impl Send for BlasLt {}
unsafe impl Sync for BlasLt {}

impl BlasLt {
    /// The raw handle.
    pub fn handle(&self) -> cudarc::cublaslt::sys::cublasLtHandle_t {
        self.handle
    }
    /// The workspace (`BLASLT_WORKSPACE_BYTES`).
    pub fn workspace(&self) -> &CudaSlice<u8> {
        &self.workspace
    }
    /// The plan of `key`: cached, or made by `make` at the key's first use (and cached if made).
    pub fn plan(
        &self,
        key: GemmKey,
        make: impl FnOnce() -> Result<GemmPlan>,
    ) -> Result<Arc<GemmPlan>> {
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| GdnError::Device("cuBLASLt plan cache poisoned".into()))?;
        if let Some(p) = plans.get(&key) {
            return Ok(p.clone());
        }
        let p = Arc::new(make()?);
        plans.insert(key, p.clone());
        Ok(p)
    }
    /// Number of cached plans (tests).
    pub fn plans(&self) -> usize {
        self.plans.lock().map_or(0, |p| p.len())
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtCreate and destroyed once.
        let _ = unsafe { cudarc::cublaslt::result::destroy_handle(self.handle) };
    }
}

impl Gpu {
    /// This GPU's cuBLASLt handle and workspace (created on first use), with the GPU's context
    /// made current on the calling thread. Errors if cuBLASLt cannot be loaded.
    pub fn blaslt(&self) -> Result<&BlasLt> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the CUDA context", e))?;
        if let Some(b) = self.blaslt.get() {
            return Ok(b);
        }
        if !cublaslt_present() {
            return Err(GdnError::Device(
                "cuBLASLt (libcublasLt.so.13) was not found; put CUDA 13's lib directory on LD_LIBRARY_PATH".into(),
            ));
        }
        let handle =
            cudarc::cublaslt::result::create_handle().map_err(|e| dev_err("cublasLtCreate", e))?;
        // SAFETY: the workspace is scratch for cuBLASLt only; nothing reads it.
        let workspace = match unsafe { self.stream.alloc::<u8>(BLASLT_WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: just created, not shared.
                let _ = unsafe { cudarc::cublaslt::result::destroy_handle(handle) };
                return Err(dev_err("cudaMalloc (cuBLASLt workspace)", e));
            }
        };
        // A racing thread may have set it first; then ours is dropped (handle destroyed).
        let _ = self.blaslt.set(BlasLt {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
        });
        Ok(self.blaslt.get().expect("set above"))
    }
}

/// NVRTC options used for every kernel.
pub fn nvrtc_options(arch: &'static str) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into(), "-default-device".into()],
        fmad: Some(true),
        ..Default::default()
    }
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GDN_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    home.join("gdn").join("kernels")
}

/// FNV-1a 64-bit: a stable hash for cache keys.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// What NVRTC made of one kernel module: its PTX and, for a real architecture (every one in
/// [`ARCHS`]), the machine code (CUBIN) NVRTC assembled from it, which the driver loads without
/// compiling the PTX again (for the large modules that JIT step costs a minute or more).
pub struct Compiled {
    pub ptx: String,
    pub cubin: Option<Vec<u8>>,
}

/// Compile kernel source `module` for `arch` with NVRTC (no cache). Used by `compile_cached` and by
/// the CI test that compiles every kernel.
pub fn compile(module: &str, arch: &'static str) -> Result<Ptx> {
    Ok(Ptx::from_src(compile_module(module, arch)?.ptx))
}

/// The options string NVRTC gets for `arch` (as `CompileOptions` would build them).
fn nvrtc_args(arch: &'static str) -> Vec<String> {
    let o = nvrtc_options(arch);
    let mut args = Vec::new();
    if let Some(v) = o.fmad {
        args.push(format!("--fmad={v}"));
    }
    if let Some(a) = o.arch {
        args.push(format!("--gpu-architecture={a}"));
    }
    args.extend(o.options);
    args
}

/// The bytes of an NVRTC text buffer up to its terminating NUL.
fn c_bytes(buf: &[std::ffi::c_char]) -> Vec<u8> {
    buf.iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect()
}

/// Compile kernel source `module` for `arch` with NVRTC (no cache): PTX and CUBIN.
pub fn compile_module(module: &str, arch: &'static str) -> Result<Compiled> {
    use cudarc::nvrtc::{result as nr, sys as ns};
    if !nvrtc_present() {
        return Err(GdnError::Device(
            "NVRTC (libnvrtc.so.13) was not found".into(),
        ));
    }
    let src = kernels::source(module)?;
    let c_src = std::ffi::CString::new(src)
        .map_err(|_| GdnError::Device(format!("kernel source {module} holds a NUL byte")))?;
    let c_name = std::ffi::CString::new(format!("{module}.cu"))
        .map_err(|_| GdnError::Device(format!("kernel name {module:?} holds a NUL byte")))?;
    let nv = |what: &str, e: cudarc::nvrtc::result::NvrtcError| {
        GdnError::Device(format!("NVRTC {what} on {module}.cu for {arch}: {e:?}"))
    };
    let prog = nr::create_program(&c_src, Some(&c_name)).map_err(|e| nv("create", e))?;
    // Destroys the program on every path out.
    struct Prog(ns::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: made by create_program above, destroyed once.
            let _ = unsafe { nr::destroy_program(self.0) };
        }
    }
    let prog = Prog(prog);
    // SAFETY: a live program; the options are plain strings.
    if let Err(e) = unsafe { nr::compile_program(prog.0, &nvrtc_args(arch)) } {
        // SAFETY: a live, compiled (or failed) program.
        let log = unsafe { nr::get_program_log(prog.0) }
            .map(|l| String::from_utf8_lossy(&c_bytes(&l)).into_owned())
            .unwrap_or_default();
        return Err(GdnError::Device(format!(
            "NVRTC failed on {module}.cu for {arch} ({e:?}):\n{log}"
        )));
    }
    // SAFETY: a compiled program.
    let ptx = unsafe { nr::get_ptx(prog.0) }.map_err(|e| nv("PTX", e))?;
    let ptx = String::from_utf8(c_bytes(&ptx))
        .map_err(|_| GdnError::Device(format!("NVRTC gave non-UTF-8 PTX for {module}")))?;
    // The CUBIN exists only for a real architecture; its absence is not an error (PTX works).
    let mut size = 0usize;
    // SAFETY: a compiled program; size is written by the call.
    let cubin = match unsafe { ns::nvrtcGetCUBINSize(prog.0, &mut size) } {
        ns::nvrtcResult::NVRTC_SUCCESS if size > 0 => {
            let mut buf = vec![0u8; size];
            // SAFETY: buf holds the size NVRTC reported.
            let r = unsafe { ns::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut _) };
            (r == ns::nvrtcResult::NVRTC_SUCCESS).then_some(buf)
        }
        _ => None,
    };
    Ok(Compiled { ptx, cubin })
}

/// NVRTC's version as "major.minor" (empty when unavailable).
pub fn nvrtc_version() -> String {
    if !nvrtc_present() {
        return String::new();
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: the library is present; the call writes two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{a}.{b}")
    } else {
        String::new()
    }
}

/// The cache file of `module` compiled for `arch`: its name holds a hash of the full source, the
/// NVRTC options, the architecture and NVRTC's version, so any change compiles anew.
fn cache_path(module: &str, arch: &str) -> Result<PathBuf> {
    let src = kernels::source(module)?;
    let opts = format!("{:?}", nvrtc_options(arch_static(arch)?).options);
    let ver = nvrtc_version();
    let key = fnv1a(&[
        src.as_bytes(),
        opts.as_bytes(),
        arch.as_bytes(),
        ver.as_bytes(),
    ]);
    Ok(cache_dir().join(format!("{module}-{arch}-{key:016x}.ptx")))
}

/// The architectures kernels are compiled for (what [`arch_for`] gives per capability).
pub const ARCHS: &[&str] = &["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"];

fn arch_static(arch: &str) -> Result<&'static str> {
    ARCHS.iter().copied().find(|a| *a == arch).ok_or_else(|| {
        GdnError::Invalid(format!(
            "unknown GPU architecture {arch:?}: expected one of {}",
            ARCHS.join(", ")
        ))
    })
}

/// The kernel modules, in [`kernels::MODULES`] order.
pub fn module_names() -> Vec<&'static str> {
    kernels::MODULES.iter().map(|(n, _)| *n).collect()
}

/// What [`precompile`] did for one module.
#[derive(Clone, Debug)]
pub struct Precompiled {
    pub module: &'static str,
    /// The PTX cache file (present afterwards unless the cache directory cannot be written).
    pub path: PathBuf,
    /// The CUBIN beside it (`path` with the extension `cubin`), when NVRTC made one.
    pub cubin: Option<PathBuf>,
    /// Whether the files were already there (nothing compiled).
    pub cached: bool,
    /// Seconds spent compiling (0 when cached).
    pub secs: f64,
}

/// The CUBIN file beside a PTX cache file.
fn cubin_path(ptx: &std::path::Path) -> PathBuf {
    ptx.with_extension("cubin")
}

/// Compile kernel module `module` for `arch` (one of [`ARCHS`]) into the on-disk kernel cache
/// (its PTX and its CUBIN), which GPU runs on any machine with the same NVRTC version then read
/// instead of compiling. No GPU is needed. Unlike the compile at first use, a cache file that
/// cannot be written is an error here.
pub fn precompile(module: &str, arch: &str) -> Result<Precompiled> {
    let arch = arch_static(arch)?;
    let (module, _) = kernels::module(module)?;
    let path = cache_path(module, arch)?;
    let cpath = cubin_path(&path);
    if path.is_file() && cpath.is_file() {
        return Ok(Precompiled {
            module,
            path,
            cubin: Some(cpath),
            cached: true,
            secs: 0.0,
        });
    }
    let t0 = std::time::Instant::now();
    let c = compile_module(module, arch)?;
    let secs = t0.elapsed().as_secs_f64();
    let io = |p: &std::path::Path, source| GdnError::Io {
        path: p.display().to_string(),
        source,
    };
    // The CUBIN first: a reader that finds the PTX may look for the CUBIN beside it.
    let cubin = match &c.cubin {
        Some(bin) => {
            write_cache(&cpath, bin).map_err(|e| io(&cpath, e))?;
            Some(cpath)
        }
        None => None,
    };
    write_cache(&path, c.ptx.as_bytes()).map_err(|e| io(&path, e))?;
    Ok(Precompiled {
        module,
        path,
        cubin,
        cached: false,
        secs,
    })
}

/// Write `bytes` to `path` through a temporary file and a rename (a reader never sees a partial
/// file), creating the directory.
fn write_cache(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A module's code as the kernel cache (or NVRTC) gives it: the CUBIN when there is one (loaded
/// first), always the PTX (the fallback when the driver refuses the CUBIN).
fn compile_cached(module: &'static str, arch: &'static str) -> Result<Compiled> {
    let path = cache_path(module, arch)?;
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        let cubin = std::fs::read(cubin_path(&path))
            .ok()
            .filter(|b| !b.is_empty());
        return Ok(Compiled { ptx, cubin });
    }
    let c = compile_module(module, arch)?;
    // Best effort: a cache we cannot write only costs a recompile next time.
    if let Some(bin) = &c.cubin {
        let _ = write_cache(&cubin_path(&path), bin);
    }
    let _ = write_cache(&path, c.ptx.as_bytes());
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_ampere_gpus_are_refused_with_their_name() {
        let e = check_capability(1, "Tesla V100-SXM2-32GB", 7, 0).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, GdnError::Device(_)), "{e:?}");
        for needle in ["cuda:1", "Tesla V100-SXM2-32GB", "7.0", "8.0 or newer"] {
            assert!(msg.contains(needle), "{msg} lacks {needle}");
        }
        assert!(check_capability(0, "T4", 7, 5).is_err());
        for (maj, min) in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
            assert!(check_capability(0, "gpu", maj, min).is_ok(), "{maj}.{min}");
        }
    }

    #[test]
    fn arch_per_capability() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 6), "sm_86");
        // an unlisted newer capability gets sm_80 code, which the driver JIT-compiles forward
        assert_eq!(arch_for(8, 7), "sm_80");
    }
}
