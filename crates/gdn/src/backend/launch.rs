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
