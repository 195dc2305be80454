//! The whole decode step of a layer on a GPU as one CUDA graph (issue 14): norm + in_proj GEMM,
//! the fused pre step, the rule, gated norm, out_proj GEMM, captured once per batch size (and
//! per set of device weights) and replayed.
//!
//! The graph reads its inputs from buffers it owns: the token rows `x` `[n, hidden]` and the slot
//! indices `[n]`; it writes `y` `[n, hidden]`, the pool's states and conv rows in place. A replay
//! is a device-to-device copy of the new rows, a host-to-device copy of the slots when they
//! changed since the last step (the usual decode loop names the same slots every step), the
//! graph launch and a copy of `y`: no other host work. The step's intermediates are allocated
//! and freed by the graph itself (stream-ordered allocation nodes).
//!
//! Capture: a warm-up step first on padding rows only (slots all `-1`: it compiles the kernels,
//! makes the GEMM plans and touches no slot), then the same ops captured (`Gpu::capture`). The
//! graph runs exactly the kernels the op-by-op path runs, with the same arguments: same bits
//! (tests/gpu_infer.rs checks it). A new batch size, or new device weights (after
//! `params_mut`), captures again. `GDN_DECODE_GRAPH=0` (or [`CachePool::set_graphs`]) turns
//! graphs off.

use super::*;
use crate::backend::cuda::CudaGraph;

/// Graphs are on unless `GDN_DECODE_GRAPH` is `0`, `off` or `false`.
pub(super) fn enabled_by_env() -> bool {
    !matches!(
        std::env::var("GDN_DECODE_GRAPH").as_deref(),
        Ok("0") | Ok("off") | Ok("false")
    )
}

const CAPTURE: &str = "decode graph capture";

/// Whether `e` is a failed capture (then nothing ran, and the op-by-op path can run instead).
pub(super) fn is_capture_error(e: &GdnError) -> bool {
    matches!(e, GdnError::Device(m) if m.starts_with(CAPTURE))
}

/// The instantiated graph.
struct Exec(CudaGraph);

// SAFETY: the graph is only launched through `&mut CachePool` (one thread at a time) and
// destroyed by its owner; CUDA graph execs may be used from any thread when accesses are
// serialized.
unsafe impl Send for Exec {}
// SAFETY: shared references never touch the graph (only `batch` reads a plain field).
unsafe impl Sync for Exec {}

/// A captured decode step (see the module doc).
pub(super) struct DecodeGraph {
    n: usize,
    /// The device weights the graph reads (kept alive, and compared to the layer's current ones).
    params: Arc<DevParams>,
    /// `[n, hidden]` input rows (`Act::Dev`).
    x: Act,
    /// `[n]` slot indices, and the host copy of what they hold.
    slots: GBuf<i32>,
    last: Vec<i32>,
    /// `[n, hidden]` output rows.
    y: DBuf,
    exec: Exec,
    /// The opt-in chain's intermediates (`pool_pdl.rs`), which the graph reads and writes.
    work: Option<DecodeWork>,
}

impl DecodeGraph {
    pub(super) fn batch(&self) -> usize {
        self.n
    }
    /// Whether the graph is the opt-in chain's (kernels only, programmatic launches).
    pub(super) fn is_pdl(&self) -> bool {
        self.work.is_some()
    }
    /// The opt-in chain's work buffers, if this graph is the chain's.
    pub(super) fn work_mut(&mut self) -> Option<&mut DecodeWork> {
        self.work.as_mut()
    }
    /// Device bytes of the opt-in chain's work buffers (0 for the default graph).
    pub(super) fn work_bytes(&self) -> usize {
        self.work.as_ref().map_or(0, DecodeWork::bytes)
    }
}

/// `dst = src` on the GPU's current stream (same storage and length, checked).
fn copy_d(gpu: &Gpu, src: &DBuf, dst: &mut DBuf) -> Result<()> {
    if src.len() != dst.len() {
        return Err(GdnError::Invalid(format!(
            "decode graph: copying {} values into {}",
            src.len(),
            dst.len()
        )));
    }
    let r = match (src, dst) {
        (DBuf::F32(a), DBuf::F32(b)) => gpu.stream().memcpy_dtod(&a.slice, &mut b.slice),
        (DBuf::Bf16(a), DBuf::Bf16(b)) => gpu.stream().memcpy_dtod(&a.slice, &mut b.slice),
        _ => {
            return Err(GdnError::Invalid(
                "decode graph: storage types differ".into(),
            ))
        }
    };
    r.map_err(|e| GdnError::Device(format!("decode graph: device copy: {e:?}")))
}

/// A profiler that records nothing (nothing may synchronize inside a capture).
fn prof_off() -> Prof {
    Prof {
        on: false,
        print: false,
        gpu: None,
        last: std::time::Instant::now(),
        rows: Vec::new(),
    }
}

impl GatedDeltaNet {
    /// The decode step as the pool's graph (captured now if it has none for this batch size and
    /// these weights). `x` `[n, hidden]` and `slots` checked by the caller.
    pub(super) fn decode_graph(
        &self,
        x: &DBuf,
        slots: &[i32],
        pool: &mut CachePool,
    ) -> Result<DBuf> {
        let p = self.view()?;
        let dp = match &p {
            ParamView::Dev(d) => d.clone(),
            ParamView::Host(_) => return Err(mixed("decode graph")),
        };
        let gpu = dp.gpu.clone();
        let n = slots.len();
        let stale = pool
            .graph
            .as_ref()
            .is_none_or(|g| g.n != n || !Arc::ptr_eq(&g.params, &dp));
        if stale {
            pool.graph = None;
            let g = self.capture_decode(&p, &dp, &gpu, n, pool)?;
            pool.graph = Some(g);
        }
        let g = pool
            .graph
            .as_mut()
            .ok_or_else(|| GdnError::Device("decode graph missing after capture".into()))?;
        match &mut g.x {
            Act::Dev(gx) => copy_d(&gpu, x, gx)?,
            Act::Host(_) => return Err(mixed("decode graph")),
        }
        if g.last != slots {
            gpu.stream()
                .memcpy_htod(slots, &mut g.slots.slice)
                .map_err(|e| GdnError::Device(format!("decode graph: slot upload: {e:?}")))?;
            g.last = slots.to_vec();
        }
        gpu.launch_graph(&g.exec.0)?;
        g.y.try_clone()
    }

    /// Warm up (padding rows only) and capture the decode step for `n` rows.
    fn capture_decode(
        &self,
        p: &ParamView,
        dp: &Arc<DevParams>,
        gpu: &Arc<Gpu>,
        n: usize,
        pool: &mut CachePool,
    ) -> Result<DecodeGraph> {
        let h = self.cfg.hidden_size;
        let x = Act::Dev(DBuf::zeros(gpu, n * h, self.dtype)?);
        let last = vec![-1i32; n];
        let slots = gpu.upload(&last)?;
        let mut y = DBuf::zeros(gpu, n * h, self.dtype)?;
        if pool.pdl {
            // The opt-in chain: the step writes the graph's own y; no allocation inside.
            let Act::Dev(xd) = &x else {
                return Err(mixed("decode graph"));
            };
            let mut work = self.decode_work(gpu, n, pool)?;
            self.decode_step_pdl(p, xd, &slots, pool, &mut work, &mut y)?;
            let captured =
                gpu.capture(|| self.decode_step_pdl(p, xd, &slots, pool, &mut work, &mut y));
            let ((), graph) = captured.map_err(|e| GdnError::Device(format!("{CAPTURE}: {e}")))?;
            return Ok(DecodeGraph {
                n,
                params: dp.clone(),
                x,
                slots,
                last,
                y,
                exec: Exec(graph),
                work: Some(work),
            });
        }
        drop(self.decode_step(p, &x, Ids::Dev(&slots), pool, &mut prof_off())?);
        let captured = gpu.capture(|| {
            let out = self.decode_step(p, &x, Ids::Dev(&slots), pool, &mut prof_off())?;
            match out {
                Act::Dev(o) => copy_d(gpu, &o, &mut y),
                Act::Host(_) => Err(mixed("decode graph")),
            }
        });
        let ((), graph) = captured.map_err(|e| GdnError::Device(format!("{CAPTURE}: {e}")))?;
        Ok(DecodeGraph {
            n,
            params: dp.clone(),
            x,
            slots,
            last,
            y,
            exec: Exec(graph),
            work: None,
        })
    }
}
