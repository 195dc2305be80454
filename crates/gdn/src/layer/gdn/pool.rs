//! A pool of cache slots for serving: recurrent states `[slots, Hv, Dk, Dv]` (fp32; bf16 as an
//! option on a GPU, [`GatedDeltaNet::cache_pool_with`]) and conv windows `[slots, W - 1,
//! conv_dim]` (the pre-conv `[q | k | v]` rows of the last `W - 1` tokens, oldest first, in the
//! layer's activation storage) where the layer runs, addressed by slot indices (`i32`; `-1` is
//! padding and touches nothing).
//!
//! - [`GatedDeltaNet::prefill_slots`]: packed prompts (`cu_seqlens`); sequence `i` starts afresh
//!   and its final state and last `W - 1` rows go to slot `slots[i]`.
//! - [`GatedDeltaNet::extend_slots`]: the same, continuing each slot's cached state and rows
//!   (chunked prefill, multi-turn).
//! - [`GatedDeltaNet::decode_slots`]: one token per row, row `i` continuing slot `slots[i]`: the
//!   fused decode ops (`ops::decode`: conv step + SiLU + gates, then the rule reading and writing
//!   each state once, in place). On a GPU the whole step (norm + in_proj .. out_proj) runs as one
//!   CUDA graph (`infer_graph.rs`), captured per batch size; `GDN_DECODE_GRAPH=0` or
//!   [`CachePool::set_graphs`] turns graphs off (same kernels, same bits).
//!
//! Every argument (shapes, slots in range, no slot twice in one call, the pool's device, storage
//! and shape) is checked before anything is written, so an error leaves every cache as it was.
//!
//! The conv window is stored as rows (`[slots, W - 1, conv_dim]`, not `[slots, conv_dim, W - 1]`):
//! the decode pre-kernel's threads run over channels, so each of the `W - 1` taps is one coalesced
//! row read, and prefill / extend move whole rows.

use super::*;
use crate::backend::Ids;
use crate::ops::decode::{self, DecodeShape, PreCols, PreParams};

#[path = "infer_graph.rs"]
mod graph;
use graph::DecodeGraph;

#[path = "pool_pdl.rs"]
mod pdl;
use pdl::DecodeWork;

/// The cache pool of one layer (see the module doc). Made by [`GatedDeltaNet::cache_pool`].
pub struct CachePool {
    shape: DecodeShape,
    slots: usize,
    device: Device,
    dtype: DType,
    /// Storage of the states: fp32, or bf16 (GPU only).
    state_dtype: DType,
    /// `[slots, Hv, Dk, Dv]`, `state_dtype` storage.
    state: Act,
    /// `[slots, W - 1, conv_dim]`, activation storage.
    conv: Act,
    /// Whether a GPU decode step runs as a CUDA graph.
    graphs: bool,
    /// The captured decode step (GPU; its batch size, the weights it reads).
    graph: Option<DecodeGraph>,
    /// Why capturing failed (graphs are then off for this pool), if it did.
    graph_error: Option<String>,
    /// The most rows (slots per step) at which a GPU decode step's projections run the skinny
    /// GEMM (0: never): `ops::linear::DECODE_GEMV_ROWS` by default, see
    /// `ops::linear::decode_gemv_by_env`.
    gemv_rows: usize,
    /// With the skinny GEMM: the input norm folded into in_proj's (off with
    /// `GDN_DECODE_GEMV=gemm`).
    fold: bool,
    /// The folded in_proj weight, for the device weights it was made from.
    folded: Option<Folded>,
    /// GPU decode steps on the chain of `pool_pdl.rs` (the default): the step's intermediates
    /// kept in [`DecodeWork`] buffers (the graph is kernels only) and our kernels launched as
    /// programmatic dependent launches (`GDN_DECODE_PDL=0` or [`CachePool::set_pdl`] turn it off).
    pdl: bool,
    /// The op-by-op chain's work buffers (a captured graph owns its own).
    work: Option<DecodeWork>,
}

/// in_proj.weight with the input norm's scale folded in, and its row constants
/// (`ops::linear::cuda::fold_norm`), made from `params` (kept alive and compared, as the graph's).
struct Folded {
    params: Arc<DevParams>,
    w: GBuf<u16>,
    c1: GBuf<f32>,
    c2: Option<GBuf<f32>>,
}

impl std::fmt::Debug for CachePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CachePool({} slots, {:?}, {:?} ({:?} states) on {:?})",
            self.slots, self.shape, self.dtype, self.state_dtype, self.device
        )
    }
}

impl CachePool {
    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Where the pool lives.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Shape of the states: `[slots, Hv, Dk, Dv]`.
    pub fn state_shape(&self) -> Vec<usize> {
        let s = &self.shape;
        vec![self.slots, s.hv, s.dk, s.dv]
    }
    /// Shape of the conv windows: `[slots, W - 1, conv_dim]`.
    pub fn conv_shape(&self) -> Vec<usize> {
        vec![self.slots, self.shape.width - 1, self.shape.conv_dim()]
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.state.bytes() + self.conv.bytes()
    }
    /// Storage type of the states: fp32, or bf16 (GPU only).
    pub fn state_dtype(&self) -> DType {
        self.state_dtype
    }
    /// A host copy of the states, as f32 (downloads from a GPU; bf16 states convert exactly).
    pub fn state_host(&self) -> Result<Tensor> {
        let v = match &self.state {
            Act::Host(v) => v.clone(),
            Act::Dev(d) => d.download()?,
        };
        Tensor::from_vec(&self.state_shape(), v)
    }
    /// Run GPU decode steps as CUDA graphs (the default unless `GDN_DECODE_GRAPH=0`) or not.
    /// Either way the same kernels run on the same inputs: the outputs and states are the same
    /// bits.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
        if !on {
            self.graph = None;
        }
    }
    /// Run a GPU decode step's two projections (in_proj, out_proj) with the skinny GEMM
    /// (`ops::linear::cuda::forward_skinny`, bf16 storage) at every batch its plan takes (1..=64
    /// rows; cuBLASLt elsewhere) or never (cuBLASLt), and with it the input norm folded into
    /// in_proj's GEMM (on with it; turn it off after with [`set_fold_norm`](Self::set_fold_norm)).
    /// By default the skinny GEMM runs up to `ops::linear::DECODE_GEMV_ROWS` (8) rows, where it
    /// was measured faster, folded (`GDN_DECODE_GEMV=1` / `0` / `gemm`: every shape / never /
    /// without the fold). The paths differ within the bf16 rounding of the projections' outputs;
    /// each is bitwise reproducible.
    pub fn set_gemv(&mut self, on: bool) {
        let rows = if on {
            crate::ops::linear::cuda::SKINNY_MAX_ROWS
        } else {
            0
        };
        if rows != self.gemv_rows || on != self.fold {
            self.graph = None;
        }
        self.gemv_rows = rows;
        self.fold = on;
    }
    /// Run GPU decode steps on the chain (on by default since 2026-12-02; `GDN_DECODE_PDL=0`
    /// makes new pools start without it): the step's
    /// intermediates (normalized input, in_proj output, the pre step's outputs, the rule's `o`,
    /// the gated norm's output and statistics) in buffers allocated once per pool and batch size
    /// instead of per step (so the captured graph holds kernels and no allocation nodes), and the
    /// pre step, the rule and the gated norm launched as programmatic dependent launches (each
    /// starts while the kernel before it finishes; the rule's blocks load their state tiles
    /// before they wait). The same kernels' arithmetic on the same inputs: the same bits as the
    /// step without it (in every projection mode, [`set_gemv`](Self::set_gemv)).
    pub fn set_pdl(&mut self, on: bool) {
        if on != self.pdl {
            self.graph = None;
            self.work = None;
        }
        self.pdl = on;
    }
    /// Whether decode steps run the chain ([`set_pdl`](Self::set_pdl)).
    pub fn pdl(&self) -> bool {
        self.pdl
    }
    /// Whether the decode projections run the skinny GEMM at some batch sizes
    /// ([`set_gemv`](Self::set_gemv)).
    pub fn gemv(&self) -> bool {
        self.gemv_rows > 0
    }
    /// With the skinny GEMM on: fold the input norm into in_proj's GEMM (one kernel fewer: the
    /// GEMM reads the raw input rows, takes each token's mean / rstd from them and applies them
    /// to its sums; the norm's weight is folded into a bf16 copy of in_proj.weight that the pool
    /// keeps, 2 bytes per weight, made at the first step after the weights change) or not (the
    /// norm kernel, then the GEMM). Only where the plan keeps whole token rows in one CTA (the
    /// layer's shapes up to 64 rows); elsewhere the norm kernel runs. Within bf16 rounding of the
    /// unfolded step, not bit for bit.
    pub fn set_fold_norm(&mut self, on: bool) {
        if on != self.fold {
            self.graph = None;
        }
        self.fold = on;
    }
    /// The batch size of the captured decode graph, if one is held (tests, benchmarks).
    pub fn graph_batch(&self) -> Option<usize> {
        self.graph.as_ref().map(DecodeGraph::batch)
    }
    /// Whether the captured decode graph, if one is held, is the chain's
    /// ([`set_pdl`](Self::set_pdl): kernels only, programmatic launches).
    pub fn graph_is_pdl(&self) -> Option<bool> {
        self.graph.as_ref().map(DecodeGraph::is_pdl)
    }
    /// Device bytes of the chain's work buffers held (the graph's and the op-by-op path's; 0 with
    /// [`set_pdl`](Self::set_pdl)`(false)`).
    pub fn decode_work_bytes(&self) -> usize {
        self.graph.as_ref().map_or(0, DecodeGraph::work_bytes)
            + self.work.as_ref().map_or(0, DecodeWork::bytes)
    }
    /// Tests: fill the opt-in chain's work buffers (the graph's and the op-by-op path's) with
    /// NaN, so a kernel that leaves part of its output unwritten shows in the results.
    #[doc(hidden)]
    pub fn poison_decode_work(&mut self) -> Result<()> {
        if let Some(w) = self.graph.as_mut().and_then(DecodeGraph::work_mut) {
            w.poison()?;
        }
        match self.work.as_mut() {
            Some(w) => w.poison(),
            None => Ok(()),
        }
    }
    /// Why capturing the decode graph failed, if it did (graphs are then off for this pool).
    pub fn graph_error(&self) -> Option<&str> {
        self.graph_error.as_deref()
    }
    /// A host copy of the conv windows, as f32 (downloads from a GPU).
    pub fn conv_host(&self) -> Result<Tensor> {
        let v = match &self.conv {
            Act::Host(v) => v.clone(),
            Act::Dev(d) => d.download()?,
        };
        Tensor::from_vec(&self.conv_shape(), v)
    }
    /// Write the pool to a safetensors file (`state`, `conv`, f32; bf16 states convert exactly).
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        let (s, c) = (self.state_host()?, self.conv_host()?);
        crate::io::write_tensors(path, &[("state", &s), ("conv", &c)])
    }
    /// The device-resident states (fp32 or bf16), for benchmarks and tests.
    pub fn state_dev(&self) -> Option<&DBuf> {
        match &self.state {
            Act::Dev(d) => Some(d),
            Act::Host(_) => None,
        }
    }
}

impl GatedDeltaNet {
    fn decode_shape(&self) -> DecodeShape {
        let c = &self.cfg;
        DecodeShape {
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
            width: c.linear_conv_kernel_dim,
            gdn2: c.variant == Variant::Gdn2,
            l2norm: c.use_qk_l2norm,
        }
    }

    /// Zeros where the layer computes: activations.
    fn zeros_act(&self, n: usize) -> Result<Act> {
        Ok(match self.gpu()? {
            None => Act::Host(vec![0.0; n]),
            Some(g) => Act::Dev(DBuf::zeros(&g, n, self.dtype)?),
        })
    }
    /// Zeros where the layer computes, in `dtype` storage (the CPU: f32 only).
    fn zeros_as(&self, n: usize, dtype: DType) -> Result<Act> {
        Ok(match self.gpu()? {
            None => Act::Host(vec![0.0; n]),
            Some(g) => Act::Dev(DBuf::zeros(&g, n, dtype)?),
        })
    }
    /// Zeros where the layer computes: fp32.
    fn zeros_f32s(&self, n: usize) -> Result<F32s> {
        Ok(match self.gpu()? {
            None => F32s::Host(vec![0.0; n]),
            Some(g) => F32s::Dev(g.zeros(n)?),
        })
    }

    /// An empty pool of `slots` slots (zero states and conv rows: each slot starts a sequence)
    /// where the layer runs, in its storage type, with fp32 states.
    pub fn cache_pool(&self, slots: usize) -> Result<CachePool> {
        self.cache_pool_with(slots, DType::F32)
    }

    /// [`cache_pool`](Self::cache_pool) with the states in `state_dtype` storage: fp32, or bf16
    /// on a GPU (half the bytes each decode step moves; the arithmetic stays fp32 in registers,
    /// each stored state rounded to nearest even; prefill and extend run in fp32 from and to the
    /// bf16 states). The CPU keeps fp32 states only.
    pub fn cache_pool_with(&self, slots: usize, state_dtype: DType) -> Result<CachePool> {
        if state_dtype == DType::Bf16 && self.gpu()?.is_none() {
            return Err(GdnError::Invalid(
                "bf16 cache states are a GPU option; the CPU keeps fp32 states".into(),
            ));
        }
        let s = self.decode_shape();
        let (sl, cl) = (
            crate::budget::mul(slots as u128, s.state_len() as u128),
            crate::budget::mul(slots as u128, ((s.width - 1) * s.conv_dim()) as u128),
        );
        let sbytes = if state_dtype == DType::Bf16 { 2 } else { 4 };
        let bytes = crate::budget::mul(sbytes, sl).saturating_add(crate::budget::mul(4, cl));
        let what = format!("a cache pool of {slots} slots");
        match self.gpu()? {
            None => crate::budget::check_host(&what, bytes)?,
            Some(g) => crate::budget::check_gpu(&g, &what, bytes)?,
        }
        let (sl, cl) = (sl as usize, cl as usize);
        let (gemv_rows, fold) = crate::ops::linear::decode_gemv_by_env();
        Ok(CachePool {
            shape: s,
            slots,
            device: self.device,
            dtype: self.dtype,
            state_dtype,
            state: self.zeros_as(sl, state_dtype)?,
            conv: self.zeros_act(cl)?,
            graphs: graph::enabled_by_env(),
            graph: None,
            graph_error: None,
            gemv_rows,
            fold,
            folded: None,
            pdl: pdl::enabled_by_env(),
            work: None,
        })
    }

    /// A pool read from a file written by [`CachePool::save`], where the layer runs.
    pub fn load_cache_pool(&self, path: &std::path::Path) -> Result<CachePool> {
        let t = crate::io::read_tensors(path)?;
        let get = |n: &str| {
            t.iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v)
                .ok_or_else(|| crate::io::file_err(path, format!("no tensor named {n}")))
        };
        let (st, cv) = (get("state")?, get("conv")?);
        let slots = st.shape().first().copied().unwrap_or(0);
        let mut pool = self.cache_pool(slots)?;
        st.expect_shape("state", &pool.state_shape())?;
        cv.expect_shape("conv", &pool.conv_shape())?;
        pool.state = match self.f32s(st.data())? {
            F32s::Host(v) => Act::Host(v),
            F32s::Dev(g) => Act::Dev(DBuf::F32(g)),
        };
        pool.conv = self.act(cv.data())?;
        Ok(pool)
    }

    /// The pool belongs to this layer: same device, storage and shape.
    pub(crate) fn check_pool(&self, pool: &CachePool) -> Result<()> {
        if pool.device != self.device || pool.dtype != self.dtype {
            return Err(GdnError::Invalid(format!(
                "cache pool on {:?} ({:?}) but the layer runs on {:?} ({:?})",
                pool.device, pool.dtype, self.device, self.dtype
            )));
        }
        if pool.shape != self.decode_shape() {
            return Err(GdnError::Invalid(format!(
                "cache pool of shape {:?} does not match the layer's {:?}",
                pool.shape,
                self.decode_shape()
            )));
        }
        if self.gpu()?.is_some() {
            decode::cuda::rule_rows(pool.shape.dk)?;
        }
        Ok(())
    }

    /// Prefill: the forward over packed prompts `x` (`[1, T, hidden]` / `[T, hidden]` with
    /// `cu_seqlens` in `seqs`, or `[B, T, hidden]` with `Seqs::uniform(B, T)`), keeping nothing
    /// for backward; sequence `i` starts afresh and its cache goes to slot `slots[i]` (`-1`:
    /// computed, not kept). Returns `y` (the training forward's values). On an error no slot
    /// changes.
    pub fn prefill_slots(
        &self,
        x: &Tensor,
        seqs: &Seqs,
        slots: &[i32],
        pool: &mut CachePool,
    ) -> Result<Tensor> {
        self.check_rows(x, seqs)?;
        let y = self.extend_slots_act(&self.act(x.data())?, seqs, slots, pool, true)?;
        Tensor::from_vec(x.shape(), y.into_host()?)
    }

    /// Extend: as [`prefill_slots`](Self::prefill_slots), sequence `i` continuing slot
    /// `slots[i]` from its cached state and rows (an empty sequence leaves its slot as it is).
    pub fn extend_slots(
        &self,
        x: &Tensor,
        seqs: &Seqs,
        slots: &[i32],
        pool: &mut CachePool,
    ) -> Result<Tensor> {
        self.check_rows(x, seqs)?;
        let y = self.extend_slots_act(&self.act(x.data())?, seqs, slots, pool, false)?;
        Tensor::from_vec(x.shape(), y.into_host()?)
    }

    /// Decode one token per row: `x` `[N, hidden]` or `[N, 1, hidden]`, row `i` continuing slot
    /// `slots[i]` (`-1`: padding, its output row is not meaningful and no slot changes). Returns
    /// `y` of `x`'s shape. On an error no slot changes.
    pub fn decode_slots(&self, x: &Tensor, slots: &[i32], pool: &mut CachePool) -> Result<Tensor> {
        let h = self.cfg.hidden_size;
        match x.shape() {
            &[n, hh] | &[n, 1, hh] if hh == h && n == slots.len() => {}
            s => {
                return Err(GdnError::shape(
                    "x",
                    s,
                    format!("[N, {h}] or [N, 1, {h}] with N = {} slots", slots.len()),
                ))
            }
        }
        let y = self.decode_slots_act(&self.act(x.data())?, slots, pool)?;
        Tensor::from_vec(x.shape(), y.into_host()?)
    }

    /// [`prefill_slots`](Self::prefill_slots) (`fresh`) or [`extend_slots`](Self::extend_slots)
    /// with device tensors: `x` `[n, hidden]` on the layer's GPU in its storage type; returns `y`
    /// there. Nothing is copied to the host but the slot indices' upload.
    pub fn extend_slots_dev(
        &self,
        x: DBuf,
        seqs: &Seqs,
        slots: &[i32],
        pool: &mut CachePool,
        fresh: bool,
    ) -> Result<DBuf> {
        self.check_dev("x", &x, seqs.tokens())?;
        match self.extend_slots_act(&Act::Dev(x), seqs, slots, pool, fresh)? {
            Act::Dev(y) => Ok(y),
            Act::Host(_) => Err(mixed("extend_slots_dev")),
        }
    }

    /// [`decode_slots`](Self::decode_slots) with device tensors: `x` `[N, hidden]` on the layer's
    /// GPU in its storage type; returns `y` there.
    pub fn decode_slots_dev(&self, x: DBuf, slots: &[i32], pool: &mut CachePool) -> Result<DBuf> {
        self.check_dev("x", &x, slots.len())?;
        match self.decode_slots_act(&Act::Dev(x), slots, pool)? {
            Act::Dev(y) => Ok(y),
            Act::Host(_) => Err(mixed("decode_slots_dev")),
        }
    }

    /// Prefill (`fresh`) or extend over activations where the layer computes (rows checked by the
    /// caller).
    pub(crate) fn extend_slots_act(
        &self,
        x: &Act,
        seqs: &Seqs,
        slots: &[i32],
        pool: &mut CachePool,
        fresh: bool,
    ) -> Result<Act> {
        self.check_pool(pool)?;
        let (n, t) = (seqs.count(), seqs.tokens());
        if slots.len() != n {
            return Err(GdnError::Invalid(format!(
                "{} slots for {n} sequences",
                slots.len()
            )));
        }
        decode::check_slots(slots, pool.slots)?;
        if x.len() != t * self.cfg.hidden_size {
            return Err(GdnError::Invalid(format!(
                "x has {} values, expected {t} tokens x {}",
                x.len(),
                self.cfg.hidden_size
            )));
        }
        if t == 0 {
            return self.zeros_act(0);
        }
        let c = &self.cfg;
        let (cd, w) = (c.conv_dim(), c.linear_conv_kernel_dim);
        let w1 = w - 1;
        let p = self.view()?;
        let mut prof = Prof::new(self.gpu()?);
        let (proj, _) = self.in_proj(&p, x, t)?;
        // Each sequence's conv input: its W - 1 cached rows (zeros when fresh), then its new rows.
        let mut cu_ext = vec![0u64];
        let (mut win_in, mut new_in, mut back, mut win_out) = (vec![], vec![], vec![], vec![]);
        for (i, &sl) in slots.iter().enumerate() {
            let r = seqs.range(i);
            let e0 = *cu_ext.last().unwrap_or(&0) as usize;
            for j in 0..w1 {
                if !fresh && sl >= 0 {
                    win_in.push(((sl as usize * w1 + j) as i32, (e0 + j) as i32));
                }
                if sl >= 0 {
                    let e1 = e0 + w1 + r.len();
                    win_out.push(((e1 - w1 + j) as i32, (sl as usize * w1 + j) as i32));
                }
            }
            for (k, tok) in r.enumerate() {
                new_in.push((tok as i32, (e0 + w1 + k) as i32));
                back.push(((e0 + w1 + k) as i32, tok as i32));
            }
            cu_ext.push((e0 + w1 + seqs.range(i).len()) as u64);
        }
        let ext_rows = *cu_ext.last().unwrap_or(&0) as usize;
        let pc = self.proj_cols();
        let dense = Cols::dense(cd);
        let sl = pool.shape.state_len();
        // The rule's inputs. Fresh: the training forward's own prep over the prompts (the same
        // kernels on the same inputs, so y is the training forward's, bit for bit). Extending:
        // conv over each sequence's cached rows followed by its new rows (`ext`), keeping the
        // new rows' outputs.
        let (r, ext) = if fresh {
            (self.prep(&p, &proj, seqs)?, None)
        } else {
            let mut ext = self.zeros_act(ext_rows * cd)?;
            decode::copy_rows(&pool.conv, dense, &mut ext, dense, &win_in)?;
            decode::copy_rows(&proj, pc.qkv, &mut ext, dense, &new_in)?;
            let seqs_ext = Seqs::packed(&cu_ext, ext_rows)?;
            let conv_out = conv1d::forward(
                &ext,
                dense,
                p.get("conv1d.weight"),
                w,
                p.opt("conv1d.bias"),
                &seqs_ext,
            )?;
            let mut qkv = self.zeros_act(t * cd)?;
            decode::copy_rows(&conv_out, dense, &mut qkv, dense, &back)?;
            drop(conv_out);
            let gate_in = self.gate_sections_of(&proj)?;
            (self.prep_after_conv(&p, qkv, &gate_in, t)?, Some(ext))
        };
        let h0 = if fresh {
            None
        } else {
            let mut h0 = self.zeros_f32s(n * sl)?;
            let pairs: Vec<(i32, i32)> = slots
                .iter()
                .enumerate()
                .map(|(i, &s)| (s, i as i32))
                .collect();
            decode::copy_rows_from_state(
                &pool.state,
                Cols::dense(sl),
                &mut h0,
                Cols::dense(sl),
                &pairs,
            )?;
            Some(h0)
        };
        let (o, fin, _) = self.rule_forward(&r, seqs, h0.as_ref(), true, false)?;
        drop((r, h0));
        let (y, _, _) = self.out_proj(&p, &o, &proj, t, &mut prof)?;
        let fin = fin.ok_or_else(|| GdnError::Invalid("final state was not produced".into()))?;
        // Fresh: each slot's rows are its sequence's last W - 1 in_proj rows, zero rows before
        // the sequence's start (from a zero row made here, before anything is written).
        let zero_row = if fresh {
            Some(self.zeros_act(cd)?)
        } else {
            None
        };
        // Everything computed: now write the slots. An empty sequence keeps its slot's state and
        // rows when extending (its final state is its initial one; its last rows the cached
        // ones), and gets zeros when prefilled.
        let pairs: Vec<(i32, i32)> = slots
            .iter()
            .enumerate()
            .map(|(i, &s)| (i as i32, s))
            .collect();
        decode::copy_rows_into_state(
            &fin,
            Cols::dense(sl),
            &mut pool.state,
            Cols::dense(sl),
            &pairs,
        )?;
        match (ext, zero_row) {
            (Some(ext), _) => decode::copy_rows(&ext, dense, &mut pool.conv, dense, &win_out)?,
            (None, Some(zero)) => {
                let (mut from_proj, mut from_zero) = (Vec::new(), Vec::new());
                for (i, &sl) in slots.iter().enumerate() {
                    if sl < 0 {
                        continue;
                    }
                    let r = seqs.range(i);
                    for j in 0..w1 {
                        let dst = (sl as usize * w1 + j) as i32;
                        // token end - (W-1) + j, if it is in the sequence
                        match (r.end + j).checked_sub(w1) {
                            Some(tok) if tok >= r.start => from_proj.push((tok as i32, dst)),
                            _ => from_zero.push((0, dst)),
                        }
                    }
                }
                decode::copy_rows(&proj, pc.qkv, &mut pool.conv, dense, &from_proj)?;
                for pr in from_zero {
                    decode::copy_rows(&zero, dense, &mut pool.conv, dense, &[pr])?;
                }
            }
            (None, None) => {}
        }
        Ok(y)
    }

    /// Decode one token per row over activations where the layer computes: on a GPU as the
    /// pool's CUDA graph when graphs are on, else op by op.
    pub(crate) fn decode_slots_act(
        &self,
        x: &Act,
        slots: &[i32],
        pool: &mut CachePool,
    ) -> Result<Act> {
        self.check_pool(pool)?;
        let n = slots.len();
        decode::check_slots(slots, pool.slots)?;
        if x.len() != n * self.cfg.hidden_size {
            return Err(GdnError::Invalid(format!(
                "x has {} values, expected {n} tokens x {}",
                x.len(),
                self.cfg.hidden_size
            )));
        }
        if n == 0 {
            return self.zeros_act(0);
        }
        if let (Act::Dev(xd), true) = (x, pool.graphs) {
            match self.decode_graph(xd, slots, pool) {
                Ok(y) => return Ok(Act::Dev(y)),
                Err(e) if graph::is_capture_error(&e) => {
                    // Nothing ran: the captured work was never executed. Off for this pool.
                    eprintln!("gdn: decode graph capture failed, running op by op: {e}");
                    pool.graph_error = Some(e.to_string());
                    pool.set_graphs(false);
                }
                Err(e) => return Err(e),
            }
        }
        if let (Act::Dev(xd), true) = (x, pool.pdl) {
            return Ok(Act::Dev(self.decode_pdl_op_by_op(xd, slots, pool)?));
        }
        let p = self.view()?;
        let mut prof = Prof::new(self.gpu()?);
        let dev_slots = match self.gpu()? {
            None => None,
            Some(g) => Some(g.upload(slots)?),
        };
        let ids = dev_slots.as_ref().map_or(Ids::Host(slots), Ids::Dev);
        let y = self.decode_step(&p, x, ids, pool, &mut prof)?;
        prof.report();
        Ok(y)
    }

    /// in_proj of the decode step with the input norm folded into the skinny GEMM, where the step
    /// runs the skinny GEMM (`skinny`), the pool asks for the fold
    /// ([`CachePool::set_fold_norm`]) and the shapes allow it; `None`: not taken.
    fn in_proj_folded(
        &self,
        p: &ParamView,
        x: &Act,
        n: usize,
        skinny: bool,
        pool: &mut CachePool,
    ) -> Result<Option<Act>> {
        let Act::Dev(xd) = x else {
            return Ok(None);
        };
        if !self.folds_in_proj(p, xd, n, skinny, pool)? {
            return Ok(None);
        }
        let pd = self.cfg.in_proj_dim();
        let mut y = DBuf::uninit(xd.gpu(), n * pd, DType::Bf16)?;
        self.in_proj_folded_into(p, xd, n, pool, &mut y)?;
        Ok(Some(Act::Dev(y)))
    }

    /// Whether [`in_proj_folded`](Self::in_proj_folded) takes this step (see there).
    fn folds_in_proj(
        &self,
        p: &ParamView,
        xd: &DBuf,
        n: usize,
        skinny: bool,
        pool: &CachePool,
    ) -> Result<bool> {
        use crate::ops::linear::cuda::skinny_plan_with;
        if !(matches!(p, ParamView::Dev(_)) && skinny && pool.fold && xd.dtype() == DType::Bf16) {
            return Ok(false);
        }
        let c = &self.cfg;
        let sms = xd.gpu().sm_count()?;
        let plan = skinny_plan_with(n, c.in_proj_dim(), c.hidden_size, sms, true);
        let dev = |n: &str| matches!(p.get(n), P::Dev(_));
        let bias_ok = !matches!(p.opt("in_proj.layer_norm_bias"), Some(P::Host(_)));
        Ok(plan.is_some_and(|q| q.takes_norm())
            && dev("in_proj.weight")
            && dev("in_proj.layer_norm_weight")
            && bias_ok)
    }

    /// The folded in_proj (where [`folds_in_proj`](Self::folds_in_proj) said yes) into `y`
    /// `[n, in_proj_dim]` bf16.
    fn in_proj_folded_into(
        &self,
        p: &ParamView,
        xd: &DBuf,
        n: usize,
        pool: &mut CachePool,
        y: &mut DBuf,
    ) -> Result<()> {
        use crate::ops::linear::cuda::{fold_norm, forward_skinny, skinny_plan_with, SkinnyNorm};
        let not_taken =
            || GdnError::Invalid("decode: the folded in_proj does not take this step".into());
        let ParamView::Dev(dp) = p else {
            return Err(not_taken());
        };
        let c = &self.cfg;
        let (h, pd) = (c.hidden_size, c.in_proj_dim());
        let gpu = xd.gpu().clone();
        let Some(plan) =
            skinny_plan_with(n, pd, h, gpu.sm_count()?, true).filter(|q| q.takes_norm())
        else {
            return Err(not_taken());
        };
        let (P::Dev(w), P::Dev(g)) = (p.get("in_proj.weight"), p.get("in_proj.layer_norm_weight"))
        else {
            return Err(not_taken());
        };
        let b = match p.opt("in_proj.layer_norm_bias") {
            Some(P::Dev(b)) => Some(b),
            Some(P::Host(_)) => return Err(not_taken()),
            None => None,
        };
        if pool
            .folded
            .as_ref()
            .is_none_or(|f| !Arc::ptr_eq(&f.params, dp))
        {
            pool.folded = None;
            let (wf, c1, c2) = fold_norm(w, g, c.layernorm_zero_centered_gamma, b, pd, h)?;
            pool.folded = Some(Folded {
                params: dp.clone(),
                w: wf,
                c1,
                c2,
            });
        }
        let f = pool
            .folded
            .as_ref()
            .ok_or_else(|| GdnError::Device("folded in_proj weight missing".into()))?;
        let norm = SkinnyNorm {
            layer: c.normalization == Normalization::LayerNorm,
            eps: c.layernorm_epsilon,
            c1: &f.c1,
            c2: f.c2.as_ref(),
        };
        forward_skinny(xd, n, h, &f.w, pd, y, plan, Some(norm))
    }

    /// One decode step, every op of it in order (the graph captures exactly this): norm +
    /// in_proj, the fused pre step, the rule, gated norm + out_proj. `slots` checked by the
    /// caller (the host copy); `ids` are the same slots where the layer computes.
    fn decode_step(
        &self,
        p: &ParamView,
        x: &Act,
        ids: Ids<i32>,
        pool: &mut CachePool,
        prof: &mut Prof,
    ) -> Result<Act> {
        let n = ids.len();
        // the skinny GEMM for both projections at this batch size, or cuBLASLt for both
        let skinny = n <= pool.gemv_rows;
        let proj = match self.in_proj_folded(p, x, n, skinny, pool)? {
            Some(proj) => proj,
            None => self.in_proj_one_gemm(p, x, n, skinny)?,
        };
        prof.mark("decode in_proj (norm + GEMM)");
        let pc = self.proj_cols();
        let cols = PreCols {
            qkv: pc.qkv,
            gates: pc.gates.clone(),
        };
        let params = PreParams {
            conv_w: p.get("conv1d.weight"),
            conv_b: p.opt("conv1d.bias"),
            a_log: p.get("A_log"),
            dt_bias: p.get("dt_bias"),
        };
        let (shape, ns) = (pool.shape, pool.slots);
        let pre = decode::pre(&proj, &cols, &mut pool.conv, ids, ns, shape, &params)?;
        prof.mark("decode conv + gates");
        let o = decode::rule(
            &pre,
            &mut pool.state,
            ids,
            ns,
            shape,
            self.cfg.scale(),
            self.dtype,
        )?;
        drop(pre);
        prof.mark("decode rule");
        let (y, _, _) = self.out_proj_with(p, &o, &proj, n, prof, skinny)?;
        prof.mark("decode out_proj");
        Ok(y)
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
