//! Kernel launch and argument-check helpers shared by every op's CUDA wrapper: launch
//! configurations, kernel lookup by storage type, pushing buffers as kernel arguments, argument
//! lists of the rule kernels (with optional per-kernel profiling), and the length / storage-type /
//! same-GPU checks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};

use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::error::{GdnError, Result};
use crate::ops::REDUCE_BLOCK;

/// Threads per block of every kernel of the ops.
pub(crate) const THREADS: u32 = 256;

/// A null device pointer, for optional pointer arguments the kernel does not touch (its flag is 0).
pub(crate) static NULL_PTR: u64 = 0;

/// Kernel-name suffix of a storage type.
pub(crate) fn suffix(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
    }
}

/// Kernel `{base}_{f32|bf16}` of `module`.
pub(crate) fn kernel(
    gpu: &Gpu,
    module: &'static str,
    base: &str,
    dt: DType,
) -> Result<CudaFunction> {
    gpu.function(module, &format!("{base}_{}", suffix(dt)))
}

/// Push a [`DBuf`] as a kernel pointer argument.
pub(crate) fn arg_d<'a, 'b: 'a>(b: &mut LaunchArgs<'a>, d: &'b DBuf) {
    match d {
        DBuf::F32(g) => b.arg(&g.slice),
        DBuf::Bf16(g) => b.arg(&g.slice),
    };
}

/// Push a [`DBuf`] as a kernel pointer argument that the kernel writes.
pub(crate) fn arg_dm<'a, 'b: 'a>(b: &mut LaunchArgs<'a>, d: &'b mut DBuf) {
    match d {
        DBuf::F32(g) => b.arg(&mut g.slice),
        DBuf::Bf16(g) => b.arg(&mut g.slice),
    };
}

/// Launch, mapping the driver's error.
pub(crate) fn launch(b: &mut LaunchArgs, cfg: LaunchConfig, what: &str) -> Result<()> {
    // SAFETY: every caller passes the argument list of the named kernel, with buffers whose lengths
    // were validated against the sizes the kernel reads and writes.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| GdnError::Device(format!("launching {what}: {e:?}")))
}

/// One warp per row, 8 rows per block.
pub(crate) fn rows_cfg(rows: usize) -> LaunchConfig {
    let warps = (THREADS / 32) as usize;
    LaunchConfig {
        grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Grid-stride elementwise launch over `n` elements.
pub(crate) fn elem_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Column-partial launch: block (32 columns x 8 lanes), grid (row chunks, column tiles).
pub(crate) fn part_cfg(chunks: usize, cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (chunks as u32, cols.div_ceil(32) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks that the partial-sum layout fits the grid limits.
pub(crate) fn check_part_dims(op: &str, chunks: usize, cols: usize) -> Result<()> {
    if chunks > i32::MAX as usize || cols.div_ceil(32) > 65535 {
        return Err(GdnError::Invalid(format!(
            "{op}: {chunks} row chunks x {cols} columns exceed the CUDA grid (at most 2^31-1 chunks and 2097120 columns)"
        )));
    }
    Ok(())
}

/// A length that kernels take as a 32-bit int.
pub(crate) fn int(name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        GdnError::Invalid(format!(
            "{name}: {v} exceeds the CUDA kernels' limit of 2^31-1"
        ))
    })
}

/// Error unless `d` holds `len` values of `dtype`.
pub(crate) fn check_d(name: &str, d: &DBuf, len: usize, dtype: DType) -> Result<()> {
    if d.dtype() != dtype {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {dtype:?} storage, got {:?}",
            d.dtype()
        )));
    }
    if d.len() != len {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {len} values, got {}",
            d.len()
        )));
    }
    Ok(())
}

/// Error unless `g` holds `len` values.
pub(crate) fn check_g<T: cudarc::driver::DeviceRepr>(
    name: &str,
    g: &GBuf<T>,
    len: usize,
) -> Result<()> {
    if g.len() != len {
        return Err(GdnError::Invalid(format!(
            "{name}: expected {len} values, got {}",
            g.len()
        )));
    }
    Ok(())
}

/// Error unless `b` lives on `gpu`.
pub(crate) fn check_gpu(name: &str, gpu: &Arc<Gpu>, b: &Arc<Gpu>) -> Result<()> {
    if !Arc::ptr_eq(gpu, b) {
        return Err(GdnError::Invalid(format!(
            "{name} lives on cuda:{}, the other operands on cuda:{}",
            b.ordinal(),
            gpu.ordinal()
        )));
    }
    Ok(())
}

/// Number of partial-sum chunks of `rows` rows.
pub(crate) fn chunks(rows: usize) -> usize {
    rows.div_ceil(REDUCE_BLOCK)
}

/// A 1-D launch of `n` threads.
pub(crate) fn lin_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One kernel argument.
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

pub(crate) fn ptr<T: DeviceRepr>(b: &GBuf<T>, s: &Arc<CudaStream>) -> Arg {
    let (p, _sync) = b.slice.device_ptr(s);
    Arg::Ptr(p)
}

pub(crate) fn dptr(b: &DBuf, s: &Arc<CudaStream>) -> Arg {
    match b {
        DBuf::F32(x) => ptr(x, s),
        DBuf::Bf16(x) => ptr(x, s),
    }
}

pub(crate) fn optr(b: Option<&GBuf<f32>>, s: &Arc<CudaStream>) -> Arg {
    b.map_or(Arg::Ptr(0), |b| ptr(b, s))
}

pub(crate) fn i32_arg(x: usize) -> Arg {
    Arg::I32(x as i32)
}

fn dev_err(what: &str, e: impl std::fmt::Debug) -> GdnError {
    GdnError::Device(format!("gated delta rule: {what}: {e:?}"))
}

/// Launch `module::name` on a flat grid of `blocks` blocks of 256 threads with `smem_bytes` of
/// dynamic shared memory, from an argument list (timed when profiling is on). Used by the rules.
pub(crate) fn launch_in(
    gpu: &Gpu,
    module: &'static str,
    name: &str,
    blocks: usize,
    smem_bytes: usize,
    args: &[Arg],
) -> Result<()> {
    launch_in_threads(gpu, module, name, blocks, THREADS, smem_bytes, args)
}

/// [`launch_in`] with blocks of `threads` threads.
pub(crate) fn launch_in_threads(
    gpu: &Gpu,
    module: &'static str,
    name: &str,
    blocks: usize,
    threads: u32,
    smem_bytes: usize,
    args: &[Arg],
) -> Result<()> {
    launch_on(
        gpu,
        gpu.stream(),
        module,
        name,
        blocks,
        threads,
        smem_bytes,
        args,
    )
}

/// [`launch_in_threads`] on stream `stream` (the GPU's own or its [`Gpu::side_stream`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_on(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    module: &'static str,
    name: &str,
    blocks: usize,
    threads: u32,
    smem_bytes: usize,
    args: &[Arg],
) -> Result<()> {
    if blocks == 0 {
        return Ok(());
    }
    if blocks > i32::MAX as usize {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: {name} needs {blocks} blocks, more than a grid holds"
        )));
    }
    let f = gpu.function(module, name)?;
    if smem_bytes > 48 * 1024 {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem_bytes as i32,
        )
        .map_err(|e| dev_err(&format!("shared memory of {name} ({smem_bytes} bytes)"), e))?;
    }
    let mut b = stream.launch_builder(&f);
    for a in args {
        match a {
            Arg::Ptr(p) => b.arg(p),
            Arg::I32(x) => b.arg(x),
            Arg::I64(x) => b.arg(x),
            Arg::F32(x) => b.arg(x),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem_bytes as u32,
    };
    let profiling = PROFILING.load(Ordering::Relaxed);
    let ev = |st: &Arc<CudaStream>| {
        st.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| dev_err("recording an event", e))
    };
    let t0 = if profiling { Some(ev(stream)?) } else { None };
    // SAFETY: argument lists match the kernels' signatures in gated_delta_rule.cu and
    // gdn2_rule.cu; every buffer is sized by the callers for the indices the kernels touch.
    unsafe { b.launch(cfg) }.map_err(|e| dev_err(&format!("launching {name}"), e))?;
    if let Some(t0) = t0 {
        let t1 = ev(stream)?;
        let ms = t0
            .elapsed_ms(&t1)
            .map_err(|e| dev_err("timing a kernel", e))? as f64;
        let mut p = PROFILE
            .lock()
            .map_err(|_| GdnError::Device("profile poisoned".into()))?;
        match p.iter_mut().find(|(n, _, _)| n == name) {
            Some(e) => {
                e.1 += ms;
                e.2 += 1;
            }
            None => p.push((name.to_string(), ms, 1)),
        }
    }
    Ok(())
}

/// Tests and benchmarks only: one launch of `cluster_probe.cu`'s `cl_probe` (`clusters` clusters
/// of 4 CTAs, `steps` steps, `read`: the distributed-shared-memory reduction as well as the
/// cluster barrier) into `out` (`clusters x 64 x 128` fp32). Needs sm_90 or newer.
#[doc(hidden)]
pub fn cluster_probe(
    gpu: &Gpu,
    clusters: usize,
    steps: i32,
    read: bool,
    out: &mut GBuf<f32>,
) -> Result<()> {
    if out.len() < clusters * 64 * 128 {
        return Err(GdnError::Invalid(format!(
            "cluster probe: out holds {} floats, {clusters} clusters need {}",
            out.len(),
            clusters * 64 * 128
        )));
    }
    let f = gpu.function("cluster_probe", "cl_probe")?;
    let smem: i32 = 2 * 64 * 128 * 4;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem,
    )
    .map_err(|e| dev_err("shared memory of cl_probe", e))?;
    let read = read as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&mut out.slice).arg(&steps).arg(&read);
    let cfg = LaunchConfig {
        grid_dim: (4 * clusters as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: cl_probe(float* out, int steps, int read) writes clusters x 64 x 128 floats of
    // out, whose length was checked above.
    unsafe { b.launch(cfg) }.map_err(|e| dev_err("launching cl_probe", e))?;
    Ok(())
}

static PROFILING: AtomicBool = AtomicBool::new(false);
static PROFILE: Mutex<Vec<(String, f64, usize)>> = Mutex::new(Vec::new());

/// Benchmarks only: time every kernel launch of this module with events (synchronizing after
/// each), from now until [`profile_take`].
#[doc(hidden)]
pub fn profile_start() {
    if let Ok(mut p) = PROFILE.lock() {
        p.clear();
    }
    PROFILING.store(true, Ordering::Relaxed);
}

/// Stops profiling; returns (kernel, total ms, launches) in first-launch order.
#[doc(hidden)]
pub fn profile_take() -> Vec<(String, f64, usize)> {
    PROFILING.store(false, Ordering::Relaxed);
    PROFILE
        .lock()
        .map(|mut p| std::mem::take(&mut *p))
        .unwrap_or_default()
}

/// Whether per-kernel profiling is on (work meant to overlap then runs in order, so that each
/// kernel's time is its own).
pub(crate) fn profiling() -> bool {
    PROFILING.load(Ordering::Relaxed)
}

/// Whether `gpu` takes programmatic dependent launches (`griddepcontrol`, sm_90 and up).
pub(crate) fn pdl_supported(gpu: &Gpu) -> bool {
    arch_takes_pdl(gpu.arch())
}

/// Whether an NVRTC architecture (`sm_90a`, `sm_80`, `compute_100`, ..) is sm_90 or newer.
fn arch_takes_pdl(arch: &str) -> bool {
    let digits: String = arch
        .trim_start_matches("sm_")
        .trim_start_matches("compute_")
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse::<u32>().is_ok_and(|cc| cc >= 90)
}

/// [`launch_in_threads`] with programmatic stream serialization
/// (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` through `cuLaunchKernelEx`): the
/// kernel may start before the kernel queued before it on the stream has finished, so it must
/// run `griddepcontrol.wait` before it touches memory that kernel (or any earlier work) writes
/// or reads (the `*_pdl` kernels of `decode.cu` and `gated_norm.cu`). Inside a stream capture the
/// edge becomes a programmatic graph edge. Below sm_90, or while profiling (which times each
/// launch on its own), an ordinary launch (the kernels' waits then return at once).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_pdl(
    gpu: &Gpu,
    module: &'static str,
    name: &str,
    blocks: usize,
    threads: u32,
    smem_bytes: usize,
    args: &[Arg],
) -> Result<()> {
    if profiling() || !pdl_supported(gpu) || blocks == 0 {
        return launch_in_threads(gpu, module, name, blocks, threads, smem_bytes, args);
    }
    use cudarc::driver::sys;
    if blocks > i32::MAX as usize {
        return Err(GdnError::Invalid(format!(
            "{name} needs {blocks} blocks, more than a grid holds"
        )));
    }
    if smem_bytes > 48 * 1024 {
        return Err(GdnError::Invalid(format!(
            "{name}: a programmatic launch with {smem_bytes} bytes of dynamic shared memory (at most 48 KiB here)"
        )));
    }
    let f = gpu.function(module, name)?;
    let stream = gpu.stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| dev_err("binding the CUDA context", e))?;
    // The kernel's parameters: pointers to the values, which live in `args` for the call.
    let mut params: Vec<*mut std::ffi::c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(p) => p as *const u64 as *mut std::ffi::c_void,
            Arg::I32(x) => x as *const i32 as *mut std::ffi::c_void,
            Arg::I64(x) => x as *const i64 as *mut std::ffi::c_void,
            Arg::F32(x) => x as *const f32 as *mut std::ffi::c_void,
        })
        .collect();
    // SAFETY: a plain-old-data union; the attribute reads its `int` member only.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let cfg = sys::CUlaunchConfig {
        gridDimX: blocks as u32,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem_bytes as u32,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `params` point at values of the kernel's parameter types in its order (the callers
    // pass the argument list of the named kernel, buffers sized for what it touches); the config
    // and its attribute live across the call, which copies them.
    let r = unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result();
    match r {
        Ok(()) => Ok(()),
        // A stream or driver that refuses the attribute (a launch-configuration error, which is
        // not sticky): the same kernel as an ordinary launch (its wait then returns at once).
        // Inside a capture the refusal has already invalidated it, and the capture reports it.
        Err(_) => {
            launch_in_threads(gpu, module, name, blocks, threads, smem_bytes, args).map_err(|e| {
                GdnError::Device(format!(
                    "{e} (after a refused programmatic dependent launch of {name})"
                ))
            })
        }
    }
}

#[cfg(test)]
mod pdl_tests {
    use super::arch_takes_pdl;

    #[test]
    fn programmatic_launches_from_sm90() {
        for a in ["sm_90a", "sm_90", "sm_100a", "sm_120", "compute_90"] {
            assert!(arch_takes_pdl(a), "{a}");
        }
        for a in ["sm_80", "sm_86", "sm_89", "sm_75", "", "sm_", "gfx90a"] {
            assert!(!arch_takes_pdl(a), "{a}");
        }
    }
}
