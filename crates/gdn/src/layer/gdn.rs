//! The GDN layer base (Megatron's `_GDNBase`) with its two variants, Gated DeltaNet and
//! Gated DeltaNet-2. Forward goes top to bottom in Megatron's order; backward bottom to top.
//!
//! ```text
//! x -> RMSNorm/LayerNorm -> in_proj -> [q|k|v | z | gate sections]
//!   [q|k|v] -> causal depthwise conv1d + SiLU -> q, k (L2 norm per head), v
//!   gates:  GDN   g = -exp(A_log) softplus(alpha + dt_bias), beta = sigmoid(b)   [per value head]
//!           GDN2  g = -exp(A_log[head]) softplus(f + dt_bias[channel]),          [per key channel]
//!                 b = sigmoid(.) [per key channel], w = sigmoid(.) [per value channel]
//!   o = gated delta rule (GDN) / GDN2 rule over q, k, v and the gates
//!   y = out_proj(norm(o) * silu(z))
//! ```

use std::ops::Deref;

mod cp;
mod dev;
mod infer;
mod pool;
pub use cp::{CpLayer, CpSaved};
pub use infer::InferenceCache;
pub use pool::CachePool;
use std::sync::{Arc, OnceLock};

use crate::backend::cuda::{self, DBuf, DType, GBuf, Gpu};
use crate::backend::Device;
use crate::backend::{mixed, Act, Cols, F32s, P};
use crate::config::{GdnConfig, Normalization, Variant};
use crate::error::{GdnError, Result};
use crate::layer::saved::Acts;
use crate::layer::{Grads, Params, Saved};
use crate::ops::gated_delta_rule::{RuleOpts, RuleSaved, RuleShape};
use crate::ops::norm::Stats;
use crate::ops::prep::{PrepCols, PrepDy, PrepParams, PrepShape};
use crate::ops::{
    conv1d, gated_delta_rule, gated_norm, gates, gdn2_rule, l2norm, layout, linear, norm, prep,
};
use crate::seqs::Seqs;
use crate::tensor::Tensor;

/// One GDN layer: Gated DeltaNet (`variant = "gdn"`) or Gated DeltaNet-2 (`variant = "gdn2"`),
/// chosen by the config. [`GatedDeltaNet2`] is the same layer, constructed only for GDN2.
#[derive(Clone, Debug)]
pub struct GatedDeltaNet {
    cfg: GdnConfig,
    params: Params,
    device: Device,
    dtype: DType,
    /// Device copy of the parameters (fp32 master weights), made on first use on a GPU and
    /// dropped whenever `params_mut` hands out the host parameters.
    dev_params: OnceLock<Arc<DevParams>>,
}

/// Parameters resident on a GPU: the fp32 master weights and, for bf16 storage, the bf16 copies
/// of the two projection weights the GEMMs read (made here, once per upload, i.e. once per
/// parameter update, instead of once per GEMM call). Both are parameter memory (counted by the
/// allocator's live bytes, not in `Saved::bytes()`).
struct DevParams {
    gpu: Arc<Gpu>,
    map: Vec<(String, GBuf<f32>)>,
    bf16: Vec<(String, GBuf<u16>)>,
}

/// The weights the GEMMs read as bf16 copies under bf16 storage.
const GEMM_WEIGHTS: [&str; 2] = ["in_proj.weight", "out_proj.weight"];

/// Parameter bytes on `device` with activations in `dtype`: the fp32 master weights, plus the
/// bf16 copies of the projection weights on a GPU with bf16 storage.
pub(crate) fn device_param_bytes(cfg: &GdnConfig, device: Device, dtype: DType) -> u128 {
    let mut b = cfg.param_bytes();
    if matches!(device, Device::Cuda(_)) && dtype == DType::Bf16 {
        let h = cfg.hidden_size as u128;
        b += 2 * h * (cfg.in_proj_dim() as u128 + cfg.v_dim() as u128);
    }
    b
}

impl DevParams {
    /// Remake the bf16 copies of the GEMM weights from the fp32 masters (after they changed).
    fn refresh_bf16(&mut self, dtype: DType) -> Result<()> {
        self.bf16.clear();
        if dtype == DType::Bf16 {
            for name in GEMM_WEIGHTS {
                if let Some((_, w)) = self.map.iter().find(|(n, _)| n == name) {
                    self.bf16
                        .push((name.to_string(), linear::cuda::cast_bf16(w)?));
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for DevParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevParams({} tensors on {:?})", self.map.len(), self.gpu)
    }
}

/// Where the parameters are read from during one forward or backward.
enum ParamView<'a> {
    Host(&'a Params),
    Dev(Arc<DevParams>),
}

impl ParamView<'_> {
    fn get(&self, name: &str) -> P<'_> {
        self.opt(name)
            .unwrap_or_else(|| panic!("parameter {name} present by construction"))
    }
    fn opt(&self, name: &str) -> Option<P<'_>> {
        match self {
            ParamView::Host(p) => p.get(name).map(|t| P::Host(t.data())),
            ParamView::Dev(d) => d
                .map
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, b)| P::Dev(b)),
        }
    }
    /// The kept bf16 copy of a GEMM weight (device, bf16 storage), else `None`.
    fn bf16(&self, name: &str) -> Option<&GBuf<u16>> {
        match self {
            ParamView::Host(_) => None,
            ParamView::Dev(d) => d.bf16.iter().find(|(n, _)| n == name).map(|(_, b)| b),
        }
    }
}

/// Gated DeltaNet-2: the base layer, accepting only `variant = "gdn2"`.
#[derive(Clone, Debug)]
pub struct GatedDeltaNet2(GatedDeltaNet);

impl GatedDeltaNet2 {
    /// A GDN2 layer with Megatron's initialization from `seed`.
    pub fn new(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        Self::require(cfg)?;
        Ok(GatedDeltaNet2(GatedDeltaNet::new(cfg, seed)?))
    }
    /// A GDN2 layer with given parameters.
    pub fn with_params(cfg: &GdnConfig, params: Params) -> Result<Self> {
        Self::require(cfg)?;
        Ok(GatedDeltaNet2(GatedDeltaNet::with_params(cfg, params)?))
    }
    fn require(cfg: &GdnConfig) -> Result<()> {
        if cfg.variant != Variant::Gdn2 {
            return Err(GdnError::config(
                "variant",
                "GatedDeltaNet2 needs variant = \"gdn2\"",
            ));
        }
        Ok(())
    }
    /// The base layer.
    pub fn into_inner(self) -> GatedDeltaNet {
        self.0
    }
}

impl Deref for GatedDeltaNet2 {
    type Target = GatedDeltaNet;
    fn deref(&self) -> &GatedDeltaNet {
        &self.0
    }
}

/// Per-step wall times, printed to stderr when the environment variable `GDN_PROFILE` is set,
/// and handed to [`profile::capture`](super::profile::capture) when one is under way.
/// On a GPU each mark synchronizes the stream, so the times are the steps' device times.
struct Prof {
    on: bool,
    print: bool,
    gpu: Option<Arc<Gpu>>,
    last: std::time::Instant,
    rows: Vec<(&'static str, f64)>,
}

impl Prof {
    fn new(gpu: Option<Arc<Gpu>>) -> Self {
        let print = std::env::var_os("GDN_PROFILE").is_some();
        Prof {
            on: print || super::profile::capturing(),
            print,
            gpu,
            last: std::time::Instant::now(),
            rows: Vec::new(),
        }
    }
    fn mark(&mut self, step: &'static str) {
        if self.on {
            if let Some(g) = &self.gpu {
                let _ = g.sync();
            }
            let now = std::time::Instant::now();
            self.rows
                .push((step, (now - self.last).as_secs_f64() * 1e3));
            self.last = now;
        }
    }
    fn report(&self) {
        super::profile::record(&self.rows);
        if self.print {
            let total: f64 = self.rows.iter().map(|r| r.1).sum();
            for (step, ms) in &self.rows {
                eprintln!("gdn profile: {step:<45} {ms:9.2} ms");
            }
            eprintln!("gdn profile: {:<45} {total:9.2} ms", "total");
        }
    }
}

/// Parameter gradients as backward produces them: (name, shape, buffer) in the parameters' order.
type GradList = Vec<(String, Vec<usize>, F32s)>;

/// Where a backward step hands a parameter gradient (name, shape, buffer).
type SetGrad<'a> = dyn FnMut(&str, &[usize], F32s) -> Result<()> + 'a;

/// Parameter gradients resident on a GPU (fp32), under the parameters' names and in their order
/// ([`crate::layer::param_specs`]): what [`GatedDeltaNet::backward_dev`] returns. The layer never
/// copies them to the host; [`to_host`](Self::to_host) does, for tests and host optimizers.
pub struct DeviceGrads {
    entries: Vec<(String, Vec<usize>, GBuf<f32>)>,
}

impl std::fmt::Debug for DeviceGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.entries.iter().map(|(n, _, _)| n.as_str()).collect();
        write!(f, "DeviceGrads({names:?})")
    }
}

impl DeviceGrads {
    /// The gradient of parameter `name`.
    pub fn get(&self, name: &str) -> Option<&GBuf<f32>> {
        self.entries
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, b)| b)
    }
    /// (name, shape, buffer) in the parameters' order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[usize], &GBuf<f32>)> {
        self.entries
            .iter()
            .map(|(n, s, b)| (n.as_str(), s.as_slice(), b))
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|(_, _, b)| b.bytes()).sum()
    }
    /// Copy to the host as [`Grads`] (synchronizes the stream).
    pub fn to_host(&self) -> Result<Grads> {
        let entries = self
            .entries
            .iter()
            .map(|(n, s, b)| Ok((n.clone(), Tensor::from_vec(s, b.gpu().download(b)?)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Params::from_entries(entries))
    }
    /// (name, shape, buffer) in the parameters' order, owned (to hand the buffers to another
    /// library without a copy).
    pub fn into_buffers(self) -> Vec<(String, Vec<usize>, GBuf<f32>)> {
        self.entries
    }
}

/// A buffer of `x`'s length and storage where `x` lives, for a backward to fill every element of
/// (host: zeros; device: uninitialized).
fn uninit_like(x: &Act) -> Result<Act> {
    Ok(match x {
        Act::Host(v) => Act::Host(vec![0.0; v.len()]),
        Act::Dev(d) => Act::Dev(DBuf::uninit(d.gpu(), d.len(), d.dtype())?),
    })
}

/// Column sections of the in_proj output (see [`GatedDeltaNet::proj_cols`]).
struct ProjCols {
    qkv: Cols,
    z: Cols,
    /// GDN `[beta, alpha]`, GDN2 `[f, b, w]`.
    gates: Vec<Cols>,
}

impl ProjCols {
    /// The fused prep op's sections (GDN).
    fn prep(&self) -> PrepCols {
        PrepCols {
            qkv: self.qkv,
            beta: self.gates[0],
            alpha: self.gates[1],
        }
    }
}

/// Forward output.
struct Forward {
    y: Act,
    final_state: Option<F32s>,
    acts: Acts,
    /// GDN2: in_proj's `[q|k|v|z]` columns, what the default keeps of its output (`Some` only
    /// when backward rebuilds the rule's inputs, `recompute().prep`).
    qkvz: Option<Act>,
}

/// The gates as the rule receives them.
#[derive(Debug)]
pub(crate) enum Gates {
    /// `g` (fp32) and `beta` `[n, Hv]`.
    Gdn { g: F32s, beta: Act },
    /// `g`, `b` `[n, Hv, Dk]` (key-channel gates repeated to the value heads), `w` `[n, Hv*Dv]`;
    /// plus the key-channel erase gate `[n, Hk*Dk]` before the repeat (its sigmoid backward).
    Gdn2 { g: F32s, b: Act, w: Act, b_key: Act },
}

/// The rule's inputs, computed from in_proj's output by conv + SiLU, L2 norm and gates.
#[derive(Debug)]
pub(crate) struct RuleInputs {
    /// conv outputs: raw q, k `[n, Hk*Dk]` and v `[n, Hv*Dv]`.
    pub q: Act,
    pub k: Act,
    pub v: Act,
    /// Normalized q, k when the L2 norm is caller-side.
    pub qkn: Option<(Act, Act)>,
    pub gates: Gates,
}

impl RuleInputs {
    /// q as the rule receives it.
    fn qn(&self) -> &Act {
        self.qkn.as_ref().map_or(&self.q, |x| &x.0)
    }
    /// k as the rule receives it.
    fn kn(&self) -> &Act {
        self.qkn.as_ref().map_or(&self.k, |x| &x.1)
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let gates = match &self.gates {
            Gates::Gdn { g, beta } => g.bytes() + beta.bytes(),
            Gates::Gdn2 { g, b, w, b_key } => g.bytes() + b.bytes() + w.bytes() + b_key.bytes(),
        };
        self.q.bytes()
            + self.k.bytes()
            + self.v.bytes()
            + self.qkn.as_ref().map_or(0, |(a, b)| a.bytes() + b.bytes())
            + gates
    }
}

impl GatedDeltaNet {
    /// A layer with Megatron's initialization from `seed`, on the CPU. Validates `cfg`.
    pub fn new(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        Ok(Self::build(cfg.clone(), Params::init(cfg, seed)?))
    }
    /// A layer with given parameters (checked against `cfg`: names and shapes), on the CPU.
    pub fn with_params(cfg: &GdnConfig, params: Params) -> Result<Self> {
        cfg.validate()?;
        params.check_against(cfg, "parameters")?;
        Ok(Self::build(cfg.clone(), params))
    }
    fn build(cfg: GdnConfig, params: Params) -> Self {
        GatedDeltaNet {
            cfg,
            params,
            device: Device::Cpu,
            dtype: DType::F32,
            dev_params: OnceLock::new(),
        }
    }
    /// Run on `device`: activations in `dtype` storage there (bf16: fp32 accumulation, fp32
    /// states and parameter gradients; f32 for verification). The CPU is always f32.
    pub fn to_device(mut self, device: Device, dtype: DType) -> Result<Self> {
        match device {
            Device::Cpu => {
                if dtype != DType::F32 {
                    return Err(GdnError::Invalid(
                        "the CPU path computes in f32 only".into(),
                    ));
                }
            }
            Device::Cuda(i) => {
                let gpu = cuda::gpu(i)?;
                crate::budget::check_gpu(
                    &gpu,
                    &self.cfg.describe_params(),
                    device_param_bytes(&self.cfg, device, dtype),
                )?;
            }
        }
        self.device = device;
        self.dtype = dtype;
        self.dev_params = OnceLock::new();
        Ok(self)
    }
    /// The device the layer runs on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The config.
    pub fn config(&self) -> &GdnConfig {
        &self.cfg
    }
    /// Bytes the parameters take where the layer runs: f32 masters, plus on a GPU with bf16
    /// storage the bf16 copies of `in_proj.weight` and `out_proj.weight` that the GEMMs read
    /// (made once per parameter update).
    pub fn param_bytes(&self) -> u128 {
        device_param_bytes(&self.cfg, self.device, self.dtype)
    }
    /// The parameters (host copy, f32).
    pub fn params(&self) -> &Params {
        &self.params
    }
    /// The parameters, mutably (for optimizers). Shapes must not change. A GPU copy is
    /// refreshed from these at the next forward.
    pub fn params_mut(&mut self) -> &mut Params {
        self.dev_params = OnceLock::new();
        &mut self.params
    }

    fn gpu(&self) -> Result<Option<Arc<Gpu>>> {
        match self.device {
            Device::Cpu => Ok(None),
            Device::Cuda(i) => Ok(Some(cuda::gpu(i)?)),
        }
    }
    fn view(&self) -> Result<ParamView<'_>> {
        let Some(gpu) = self.gpu()? else {
            return Ok(ParamView::Host(&self.params));
        };
        if let Some(d) = self.dev_params.get() {
            return Ok(ParamView::Dev(d.clone()));
        }
        let mut map = Vec::new();
        for (name, t) in self.params.iter() {
            map.push((name.to_string(), gpu.upload(t.data())?));
        }
        let mut d = DevParams {
            gpu,
            map,
            bf16: Vec::new(),
        };
        d.refresh_bf16(self.dtype)?;
        let d = Arc::new(d);
        let _ = self.dev_params.set(d.clone());
        Ok(ParamView::Dev(d))
    }
    /// Move host values to where the layer computes.
    fn act(&self, x: &[f32]) -> Result<Act> {
        match self.gpu()? {
            None => Ok(Act::Host(x.to_vec())),
            Some(g) => Ok(Act::Dev(DBuf::upload(&g, x, self.dtype)?)),
        }
    }
    fn f32s(&self, x: &[f32]) -> Result<F32s> {
        match self.gpu()? {
            None => Ok(F32s::Host(x.to_vec())),
            Some(g) => Ok(F32s::Dev(g.upload(x)?)),
        }
    }

    /// Training forward over `x` `[B, T, hidden]` (B sequences of T tokens).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (b, t) = self.batch_dims(x)?;
        let (y, _, saved) = self.forward_seqs(x, Seqs::uniform(b, t), None, false)?;
        Ok((y, saved))
    }

    /// Training forward over packed sequences: `x` `[1, T, hidden]` or `[T, hidden]`, with
    /// `cu_seqlens` boundaries in `seqs` (conv history and recurrent state restart at each);
    /// rows after the last boundary are padding (zero output, zero gradient).
    pub fn forward_packed(&self, x: &Tensor, seqs: &Seqs) -> Result<(Tensor, Saved)> {
        let (y, _, saved) = self.forward_with_state(x, seqs, None)?;
        Ok((y, saved))
    }

    /// Training forward with per-sequence recurrent states: `initial_state` `[N, Hv, Dk, Dv]`
    /// (zeros when `None`), returns `y`, the final states `[N, Hv, Dk, Dv]` and what backward
    /// needs. `x` is `[B, T, hidden]` with `seqs = Seqs::uniform(B, T)`, or packed as in
    /// [`forward_packed`](Self::forward_packed).
    pub fn forward_with_state(
        &self,
        x: &Tensor,
        seqs: &Seqs,
        initial_state: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Saved)> {
        self.check_rows(x, seqs)?;
        let st = self.state_shape(seqs);
        if let Some(h0) = initial_state {
            h0.expect_shape("initial_state", &st)?;
        }
        let (y, fin, saved) = self.forward_seqs(x, seqs.clone(), initial_state, true)?;
        let fin = fin.ok_or_else(|| GdnError::Invalid("final state was not produced".into()))?;
        Ok((y, Tensor::from_vec(&st, fin)?, saved))
    }

    /// `x` is `[B, T, hidden]` with `seqs = Seqs::uniform(B, T)`, or packed (`[1, T, hidden]` or
    /// `[T, hidden]`) with as many rows as `seqs` describes.
    fn check_rows(&self, x: &Tensor, seqs: &Seqs) -> Result<()> {
        let rows = match x.shape() {
            &[b, t, h] if h == self.cfg.hidden_size => b * t,
            &[t, h] if h == self.cfg.hidden_size => t,
            s => {
                return Err(GdnError::shape(
                    "x",
                    s,
                    format!("[B, T, {0}] or [T, {0}]", self.cfg.hidden_size),
                ))
            }
        };
        if seqs.tokens() != rows {
            return Err(GdnError::CuSeqlens(format!(
                "describes {} rows but x has {rows} tokens",
                seqs.tokens()
            )));
        }
        if x.shape().len() == 3
            && x.shape()[0] != 1
            && *seqs != Seqs::uniform(x.shape()[0], x.shape()[1])
        {
            return Err(GdnError::shape(
                "x",
                x.shape(),
                "batch 1 ([1, T, hidden] or [T, hidden]) for packed sequences, as Megatron's THD format",
            ));
        }
        Ok(())
    }

    /// Inference forward: keeps nothing for backward (recompute settings do not apply).
    pub fn forward_inference(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = self.batch_dims(x)?;
        let xa = self.act(x.data())?;
        let f = self.run_forward(&xa, &Seqs::uniform(b, t), None, false)?;
        Tensor::from_vec(x.shape(), f.y.into_host()?)
    }

    /// Shape of the recurrent states of `seqs`: `[N, Hv, Dk, Dv]`.
    pub fn state_shape(&self, seqs: &Seqs) -> Vec<usize> {
        let c = &self.cfg;
        vec![
            seqs.count(),
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        ]
    }

    fn batch_dims(&self, x: &Tensor) -> Result<(usize, usize)> {
        match x.shape() {
            &[b, t, h] if h == self.cfg.hidden_size => {
                // Per-sequence bookkeeping (boundaries, states) grows with B even when T = 0 and
                // x holds no values: refuse a B the machine cannot hold instead of aborting.
                crate::budget::check_host(
                    "the sequence boundaries of x's batch",
                    crate::budget::bytes_of(&[b, 1], std::mem::size_of::<usize>()),
                )?;
                Ok((b, t))
            }
            s => Err(GdnError::shape(
                "x",
                s,
                format!("[B, T, {}] (hidden_size)", self.cfg.hidden_size),
            )),
        }
    }

    fn forward_seqs(
        &self,
        x: &Tensor,
        seqs: Seqs,
        h0: Option<&Tensor>,
        want_final: bool,
    ) -> Result<(Tensor, Option<Vec<f32>>, Saved)> {
        let xa = self.act(x.data())?;
        let h0 = match h0 {
            Some(t) => Some(self.f32s(t.data())?),
            None => None,
        };
        let (y, fin, saved) = self.forward_act(xa, x.shape().to_vec(), seqs, h0, want_final)?;
        let y = Tensor::from_vec(x.shape(), y.into_host()?)?;
        let fin = match fin {
            Some(s) => Some(s.into_host()?),
            None => None,
        };
        Ok((y, fin, saved))
    }

    /// The training forward of every API, on buffers where the layer computes: `x` is moved into
    /// `Saved`; returns `y`, the final states (when wanted) and `Saved`.
    fn forward_act(
        &self,
        xa: Act,
        x_shape: Vec<usize>,
        seqs: Seqs,
        h0: Option<F32s>,
        want_final: bool,
    ) -> Result<(Act, Option<F32s>, Saved)> {
        let rc = self.cfg.recompute();
        let f = self.run_forward(&xa, &seqs, h0.as_ref(), want_final)?;
        let mut acts = f.acts;
        if rc.norm_out {
            // gdn_norm_out: out_proj has consumed the gated norm's output; drop it.
            acts.norm_out = None;
        }
        if let Some(qkvz) = f.qkvz {
            // GDN2 by default: keep in_proj's [q|k|v|z] columns, not its gate sections (the
            // rule's gate inputs); backward reruns their GEMM.
            acts.proj = qkvz;
            acts.proj_qkvz_only = true;
        }
        let saved = Saved {
            seqs,
            x_shape,
            x: xa,
            h0,
            acts: (!rc.whole_layer).then_some(acts),
        };
        Ok((f.y, f.final_state, saved))
    }

    /// A buffer handed to the device API lives on `gpu`: the layer must be on that GPU.
    fn check_on_layer_gpu(&self, what: &str, gpu: &Gpu) -> Result<()> {
        let Device::Cuda(i) = self.device else {
            return Err(GdnError::Invalid(format!(
                "{what}: the device API needs a layer on a GPU (to_device); this one runs on the CPU"
            )));
        };
        if gpu.ordinal() != i {
            return Err(GdnError::Device(format!(
                "{what} lives on cuda:{} but the layer on cuda:{i}",
                gpu.ordinal()
            )));
        }
        Ok(())
    }

    /// A device tensor handed to the device API: the layer is on a GPU, `t` on that GPU, in the
    /// layer's storage dtype, `rows x hidden_size` values.
    fn check_dev(&self, what: &str, t: &DBuf, rows: usize) -> Result<()> {
        self.check_on_layer_gpu(what, t.gpu())?;
        if t.dtype() != self.dtype {
            return Err(GdnError::Invalid(format!(
                "{what} is {:?} but the layer stores activations as {:?}",
                t.dtype(),
                self.dtype
            )));
        }
        let h = self.cfg.hidden_size;
        if t.len() != rows.saturating_mul(h) {
            return Err(GdnError::Invalid(format!(
                "{what} has {} values, expected {rows} tokens x {h} (hidden_size)",
                t.len()
            )));
        }
        Ok(())
    }

    /// Training forward on the layer's GPU with device tensors: `x` `[n, hidden]` (row-major,
    /// `n = seqs.tokens()`, in the layer's storage dtype; packed or uniform sequences as `seqs`
    /// says) is moved into `Saved` (backward needs it; no copy is made). Returns `y`
    /// `[n, hidden]` in the same dtype. Nothing is copied to the host and nothing waits for the
    /// GPU: the work is queued on the GPU's stream. [`forward_packed`](Self::forward_packed) on a
    /// GPU layer is this with an upload before and a download after (same kernels, same bits).
    pub fn forward_dev(&self, x: DBuf, seqs: &Seqs) -> Result<(DBuf, Saved)> {
        let n = seqs.tokens();
        self.check_dev("x", &x, n)?;
        let shape = vec![n, self.cfg.hidden_size];
        let (y, _, saved) = self.forward_act(Act::Dev(x), shape, seqs.clone(), None, false)?;
        match y {
            Act::Dev(y) => Ok((y, saved)),
            Act::Host(_) => Err(mixed("layer forward")),
        }
    }

    /// [`forward_dev`](Self::forward_dev) with per-sequence recurrent states on the device:
    /// `initial_state` `[N, Hv, Dk, Dv]` fp32 (zeros when `None`; N = `seqs.count()`), moved into
    /// `Saved`; returns `y`, the final states `[N, Hv, Dk, Dv]` fp32 and what backward needs.
    /// [`forward_with_state`](Self::forward_with_state) on a GPU layer is this with uploads and
    /// downloads (same kernels, same bits).
    pub fn forward_dev_with_state(
        &self,
        x: DBuf,
        seqs: &Seqs,
        initial_state: Option<GBuf<f32>>,
    ) -> Result<(DBuf, GBuf<f32>, Saved)> {
        let n = seqs.tokens();
        self.check_dev("x", &x, n)?;
        let st = self.state_shape(seqs);
        if let Some(h0) = &initial_state {
            self.check_dev_state("initial_state", h0, &st)?;
        }
        let shape = vec![n, self.cfg.hidden_size];
        let h0 = initial_state.map(F32s::Dev);
        let (y, fin, saved) = self.forward_act(Act::Dev(x), shape, seqs.clone(), h0, true)?;
        match (y, fin) {
            (Act::Dev(y), Some(F32s::Dev(f))) => Ok((y, f, saved)),
            (_, None) => Err(GdnError::Invalid("final state was not produced".into())),
            _ => Err(mixed("layer forward")),
        }
    }

    /// Backward of [`forward_dev_with_state`](Self::forward_dev_with_state): `dy` as in
    /// [`backward_dev`](Self::backward_dev), and the gradient of the final states
    /// `[N, Hv, Dk, Dv]` fp32 (`None`: zero). Returns `dx`, the parameter gradients and, when the
    /// forward was given initial states, their gradient.
    pub fn backward_dev_with_state(
        &self,
        saved: Saved,
        dy: DBuf,
        d_final_state: Option<GBuf<f32>>,
    ) -> Result<(DBuf, DeviceGrads, Option<GBuf<f32>>)> {
        self.check_dev("dy", &dy, saved.tokens())?;
        if !matches!(saved.x, Act::Dev(_)) {
            return Err(GdnError::Invalid(
                "backward_dev: Saved comes from a forward on the CPU".into(),
            ));
        }
        if let Some(d) = &d_final_state {
            self.check_dev_state("d_final_state", d, &self.state_shape(&saved.seqs))?;
        }
        let d_final = d_final_state.map(F32s::Dev);
        let (dx, grads, dh0) = self.backward_act(saved, &Act::Dev(dy), d_final.as_ref())?;
        let dx = match dx {
            Act::Dev(d) => d,
            Act::Host(_) => return Err(mixed("layer backward")),
        };
        let dh0 = match dh0 {
            None => None,
            Some(F32s::Dev(d)) => Some(d),
            Some(F32s::Host(_)) => return Err(mixed("layer backward")),
        };
        Ok((dx, self.grads_dev(grads)?, dh0))
    }

    /// A state handed to the device API: on the layer's GPU, `shape`'s number of fp32 values.
    fn check_dev_state(&self, what: &str, t: &GBuf<f32>, shape: &[usize]) -> Result<()> {
        self.check_on_layer_gpu(what, t.gpu())?;
        let want: usize = shape.iter().product();
        if t.len() != want {
            return Err(GdnError::Invalid(format!(
                "{what} has {} values, expected {shape:?} = {want} (fp32)",
                t.len()
            )));
        }
        Ok(())
    }

    /// Backward of [`forward_dev`](Self::forward_dev) (or of a GPU layer's host-API forward) with
    /// device tensors: `dy` `[n, hidden]` in the layer's storage dtype (consumed). Returns `dx`
    /// `[n, hidden]` and the parameter gradients in fp32 device buffers ([`DeviceGrads`]).
    /// Nothing is copied to the host and nothing waits for the GPU.
    /// [`backward`](Self::backward) on a GPU layer is this with an upload and downloads.
    pub fn backward_dev(&self, saved: Saved, dy: DBuf) -> Result<(DBuf, DeviceGrads)> {
        let (dx, grads, _) = self.backward_dev_with_state(saved, dy, None)?;
        Ok((dx, grads))
    }

    /// Gradients on the host as [`Grads`] (downloads device buffers), checked against the config.
    fn grads_host(&self, g: GradList) -> Result<Grads> {
        let entries = g
            .into_iter()
            .map(|(n, s, v)| Ok((n, Tensor::from_vec(&s, v.into_host()?)?)))
            .collect::<Result<Vec<_>>>()?;
        let grads = Params::from_entries(entries);
        grads.check_against(&self.cfg, "gradients")?;
        Ok(grads)
    }

    /// Gradients kept on the device, checked: exactly the parameters' names, in order.
    fn grads_dev(&self, g: GradList) -> Result<DeviceGrads> {
        let want: Vec<&str> = super::param_specs(&self.cfg)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        if !g
            .iter()
            .map(|(n, _, _)| n.as_str())
            .eq(want.iter().copied())
        {
            let got: Vec<&str> = g.iter().map(|(n, _, _)| n.as_str()).collect();
            return Err(GdnError::Invalid(format!(
                "backward produced gradients {got:?}, the parameters are {want:?}"
            )));
        }
        let entries = g
            .into_iter()
            .map(|(n, s, v)| match v {
                F32s::Dev(b) => Ok((n, s, b)),
                F32s::Host(_) => Err(mixed("layer gradients")),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceGrads { entries })
    }

    fn rule_shape(&self) -> RuleShape {
        let c = &self.cfg;
        RuleShape {
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
        }
    }
    fn rule_opts(&self) -> RuleOpts {
        RuleOpts {
            scale: self.cfg.scale(),
            l2norm_in_kernel: self.cfg.use_qk_l2norm_in_kernel,
        }
    }
    /// Widths of in_proj's gate sections after `[q|k|v|z]`: GDN `[beta | alpha]`, GDN2 `[f | b | w]`.
    fn gate_sections(&self) -> Vec<usize> {
        let c = &self.cfg;
        match c.variant {
            Variant::Gdn => vec![c.linear_num_value_heads, c.linear_num_value_heads],
            Variant::Gdn2 => vec![c.qk_dim(), c.qk_dim(), c.v_dim()],
        }
    }

    /// Where the sections of the in_proj output `[n, in_proj_dim]` sit: `[q|k|v]` (the conv
    /// input), `z`, then the gate sections. The ops read them in place, and backward writes each
    /// gradient into the same columns of one `d(in_proj output)` buffer.
    fn proj_cols(&self) -> ProjCols {
        let c = &self.cfg;
        let (pd, cd, vd) = (c.in_proj_dim(), c.conv_dim(), c.v_dim());
        let mut off = cd + vd;
        let gates = self
            .gate_sections()
            .into_iter()
            .map(|w| {
                let g = Cols::new(pd, off, w);
                off += w;
                g
            })
            .collect();
        ProjCols {
            qkv: Cols::new(pd, 0, cd),
            z: Cols::new(pd, cd, vd),
            gates,
        }
    }

    /// The fused prep op's shape (GDN).
    fn prep_shape(&self) -> PrepShape {
        let c = &self.cfg;
        PrepShape {
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
            width: c.linear_conv_kernel_dim,
            l2norm: c.use_qk_l2norm && !c.use_qk_l2norm_in_kernel,
        }
    }

    /// The layer, top to bottom (Megatron's `GatedDeltaNet.forward`).
    fn run_forward(
        &self,
        x: &Act,
        seqs: &Seqs,
        h0: Option<&F32s>,
        want_final: bool,
    ) -> Result<Forward> {
        let c = &self.cfg;
        let p = self.view()?;
        let n = seqs.tokens();
        let mut prof = Prof::new(self.gpu()?);

        // 1-2. Fused pre-norm + in_proj -> [q | k | v | z | gate sections], one buffer whose
        // sections the ops below read in place.
        let (proj, qkvz, in_stats) = self.in_proj_parts(&p, x, n)?;
        // GDN2's [q|k|v|z] columns on their own are kept only when the rule's inputs are
        // rebuilt in backward (forward_act); free them now otherwise.
        let qkvz = qkvz.filter(|_| c.recompute().prep);
        prof.mark("fwd in_proj (norm + GEMM)");
        // 3-5. conv + SiLU, q/k L2 norm, gates.
        let r = self.prep(&p, &proj, seqs)?;
        prof.mark("fwd conv + l2norm + gates");
        // 6. The rule.
        let (o, final_state, rule_saved) = self.rule_forward(&r, seqs, h0, want_final, true)?;
        prof.mark("fwd gated delta rule");
        // Keep the rule's inputs only under `keep_rule_inputs` (Megatron keeps them); by default
        // backward rebuilds them from `proj` (which is kept).
        let rule_in = (!c.recompute().prep).then_some(r);
        // 7-8. Gated norm, out_proj.
        let (y, norm_out, o_stats) = self.out_proj(&p, &o, &proj, n, &mut prof)?;
        prof.mark("fwd out_proj");
        prof.report();
        Ok(Forward {
            y,
            final_state,
            acts: Acts {
                in_stats,
                proj,
                proj_qkvz_only: false,
                rule_in,
                rule_saved,
                o,
                o_stats,
                norm_out: Some(norm_out),
            },
            qkvz,
        })
    }

    /// Fused pre-norm + in_proj over `n` rows: the in_proj output `[n, in_proj_dim]` (sections
    /// at [`proj_cols`](Self::proj_cols)) and the norm's statistics.
    fn in_proj(&self, p: &ParamView, x: &Act, n: usize) -> Result<(Act, Stats)> {
        let (proj, _, in_stats) = self.in_proj_parts(p, x, n)?;
        Ok((proj, in_stats))
    }

    /// [`in_proj`](Self::in_proj), and for GDN2 also its `[q|k|v|z]` columns
    /// `[n, conv_dim + v_dim]` as a buffer of their own. GDN: one GEMM. GDN2: two GEMMs, over
    /// in_proj.weight's `[q|k|v|z]` rows and over its gate rows `[f|b|w]`, joined into one
    /// buffer. By default GDN2 keeps only the first for backward, which reruns the second (the
    /// same call on the same inputs: the same bits; [`rebuild_proj`](Self::rebuild_proj)).
    /// Training, prefill / extend and CP compute GDN2's in_proj this way, so their bits agree
    /// (the decode step uses [`in_proj_one_gemm`](Self::in_proj_one_gemm)).
    fn in_proj_parts(&self, p: &ParamView, x: &Act, n: usize) -> Result<(Act, Option<Act>, Stats)> {
        let c = &self.cfg;
        let (xn, in_stats) = self.in_norm(p, x, n)?;
        match c.variant {
            Variant::Gdn => Ok((self.in_proj_gemm(p, &xn, n)?, None, in_stats)),
            Variant::Gdn2 => {
                let (pd, a) = (c.in_proj_dim(), c.conv_dim() + c.v_dim());
                let qkvz = self.in_proj_rows(p, &xn, n, 0, a)?;
                let gates = self.in_proj_rows(p, &xn, n, a, pd - a)?;
                drop(xn);
                let proj = layout::concat_cols(n, pd, &[(0, a, &qkvz), (a, pd - a, &gates)])?;
                Ok((proj, Some(qkvz), in_stats))
            }
        }
    }

    /// [`in_proj`](Self::in_proj) as one GEMM over all of in_proj.weight, for either variant:
    /// the decode step's (a few rows per call, where GDN2's split would cost two weight-block
    /// copies per step; its bits are not promised equal to the training forward's, which runs
    /// GEMMs of another shape anyway).
    /// `skinny`: the GEMM is [`linear::forward_decode`]'s skinny GEMM where it takes the shape.
    fn in_proj_one_gemm(&self, p: &ParamView, x: &Act, n: usize, skinny: bool) -> Result<Act> {
        let (xn, _) = self.in_norm(p, x, n)?;
        if !skinny {
            return self.in_proj_gemm(p, &xn, n);
        }
        let c = &self.cfg;
        linear::forward_decode(
            &xn,
            n,
            c.hidden_size,
            p.get("in_proj.weight"),
            p.bf16("in_proj.weight"),
            c.in_proj_dim(),
            true,
        )
    }

    /// The GEMM of the normalized input `xn` `[n, h]` with all of in_proj.weight.
    fn in_proj_gemm(&self, p: &ParamView, xn: &Act, n: usize) -> Result<Act> {
        let c = &self.cfg;
        linear::forward(
            xn,
            n,
            c.hidden_size,
            p.get("in_proj.weight"),
            p.bf16("in_proj.weight"),
            c.in_proj_dim(),
        )
    }

    /// The input norm over `n` rows of `x`: its output and statistics.
    fn in_norm(&self, p: &ParamView, x: &Act, n: usize) -> Result<(Act, Stats)> {
        let c = &self.cfg;
        norm::forward(
            x,
            n,
            c.hidden_size,
            p.get("in_proj.layer_norm_weight"),
            p.opt("in_proj.layer_norm_bias"),
            c.normalization,
            c.layernorm_epsilon,
            c.layernorm_zero_centered_gamma,
        )
    }

    /// The GEMM of the normalized input `xn` `[n, h]` with rows `off..off + len` of
    /// in_proj.weight: `[n, len]`. The rows are a slice of the weight on the host, copies on a
    /// GPU (of the fp32 master and of the kept bf16 copy: tens of MB, next to a GEMM over every
    /// token).
    fn in_proj_rows(
        &self,
        p: &ParamView,
        xn: &Act,
        n: usize,
        off: usize,
        len: usize,
    ) -> Result<Act> {
        let h = self.cfg.hidden_size;
        let (a, b) = (off * h, (off + len) * h);
        match p.get("in_proj.weight") {
            P::Host(w) => {
                let w = w.get(a..b).ok_or_else(|| {
                    GdnError::Invalid(format!(
                        "in_proj.weight has {} values, rows {off}..{} of {h} wanted",
                        w.len(),
                        off + len
                    ))
                })?;
                linear::forward(xn, n, h, P::Host(w), None, len)
            }
            P::Dev(w) => {
                let wr = w.copy_range(a, len * h)?;
                let wb = match p.bf16("in_proj.weight") {
                    Some(c) => Some(c.copy_range(a, len * h)?),
                    None => None,
                };
                linear::forward(xn, n, h, P::Dev(&wr), wb.as_ref(), len)
            }
        }
    }

    /// in_proj's output `[n, in_proj_dim]` again from its kept `[q|k|v|z]` columns `qkvz`
    /// (GDN2 by default): the input norm and the gate rows' GEMM rerun as in
    /// [`in_proj_parts`](Self::in_proj_parts), joined as forward joined them: forward's bits.
    fn rebuild_proj(&self, p: &ParamView, x: &Act, n: usize, qkvz: &Act) -> Result<Act> {
        let c = &self.cfg;
        let (pd, a) = (c.in_proj_dim(), c.conv_dim() + c.v_dim());
        let (xn, _) = self.in_norm(p, x, n)?;
        let gates = self.in_proj_rows(p, &xn, n, a, pd - a)?;
        drop(xn);
        layout::concat_cols(n, pd, &[(0, a, qkvz), (a, pd - a, &gates)])
    }

    /// The gate sections of the in_proj output as separate buffers (copies): what the gates ops
    /// of GDN2 (and of the inference path) take.
    fn gate_sections_of(&self, proj: &Act) -> Result<Vec<Act>> {
        self.proj_cols()
            .gates
            .iter()
            .map(|&g| layout::take_cols(proj, g.ld, g.off, g.width))
            .collect()
    }

    /// The conv input `[n, conv_dim]` of the in_proj output as a separate buffer (a copy): what
    /// the inference path's conv over cached rows takes.
    fn conv_input_of(&self, proj: &Act) -> Result<Act> {
        let c = self.proj_cols().qkv;
        layout::take_cols(proj, c.ld, c.off, c.width)
    }

    /// Gated norm `norm(o) * silu(z)` (norm first, then gate; one `[Dv]` weight for all heads;
    /// `z` read in place from the in_proj output `proj`) and out_proj over `n` rows: `y`, the
    /// norm's output and its statistics.
    fn out_proj(
        &self,
        p: &ParamView,
        o: &Act,
        proj: &Act,
        n: usize,
        prof: &mut Prof,
    ) -> Result<(Act, Act, Stats)> {
        self.out_proj_with(p, o, proj, n, prof, false)
    }

    /// [`out_proj`](Self::out_proj); `skinny`: its GEMM is [`linear::forward_decode`]'s skinny
    /// GEMM where it takes the shape (the decode step's opt-in).
    fn out_proj_with(
        &self,
        p: &ParamView,
        o: &Act,
        proj: &Act,
        n: usize,
        prof: &mut Prof,
        skinny: bool,
    ) -> Result<(Act, Act, Stats)> {
        let c = &self.cfg;
        let (hv, dv, vd) = (c.linear_num_value_heads, c.linear_value_head_dim, c.v_dim());
        let (norm_out, o_stats) = gated_norm::forward(
            o,
            proj,
            self.proj_cols().z,
            n * hv,
            dv,
            p.get("out_norm.weight"),
            p.opt("out_norm.bias"),
            c.normalization,
            c.layernorm_epsilon,
            c.layernorm_zero_centered_gamma,
        )?;
        prof.mark("fwd gated norm");
        let y = linear::forward_decode(
            &norm_out,
            n,
            vd,
            p.get("out_proj.weight"),
            p.bf16("out_proj.weight"),
            c.hidden_size,
            skinny,
        )?;
        Ok((y, norm_out, o_stats))
    }

    /// conv + SiLU, q/k L2 norm and gates: the rule's inputs from the in_proj output `proj`,
    /// read in place. Forward runs it once; backward reruns it unless `keep_rule_inputs` kept
    /// its results (same kernels, same inputs, so the same bits). GDN: one fused op
    /// ([`prep::forward`]); GDN2: conv1d on the `[q|k|v]` section, then its gates.
    fn prep(&self, p: &ParamView, proj: &Act, seqs: &Seqs) -> Result<RuleInputs> {
        let c = &self.cfg;
        let (n, w) = (seqs.tokens(), c.linear_conv_kernel_dim);
        match c.variant {
            Variant::Gdn => {
                let o = prep::forward(
                    proj,
                    self.proj_cols().prep(),
                    self.prep_shape(),
                    self.prep_params(p),
                    seqs,
                )?;
                Ok(RuleInputs {
                    q: o.q,
                    k: o.k,
                    v: o.v,
                    qkn: o.qkn,
                    gates: Gates::Gdn {
                        g: o.g,
                        beta: o.beta,
                    },
                })
            }
            Variant::Gdn2 => {
                let pc = self.proj_cols();
                let qkv = conv1d::forward(
                    proj,
                    pc.qkv,
                    p.get("conv1d.weight"),
                    w,
                    p.opt("conv1d.bias"),
                    seqs,
                )?;
                let gate_in = self.gate_sections_of(proj)?;
                self.prep_after_conv(p, qkv, &gate_in, n)
            }
        }
    }

    /// The parameters of the fused prep op.
    fn prep_params<'a>(&self, p: &'a ParamView) -> PrepParams<'a> {
        PrepParams {
            conv_w: p.get("conv1d.weight"),
            conv_b: p.opt("conv1d.bias"),
            a_log: p.get("A_log"),
            dt_bias: p.get("dt_bias"),
        }
    }

    /// q/k L2 norm and gates from the conv's output `qkv` `[n, conv_dim]` (the rest of
    /// [`prep`](Self::prep)).
    fn prep_after_conv(
        &self,
        p: &ParamView,
        qkv: Act,
        gate_in: &[Act],
        n: usize,
    ) -> Result<RuleInputs> {
        let c = &self.cfg;
        let (hk, hv, dk) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
        );
        let (qk, vd, cd) = (c.qk_dim(), c.v_dim(), c.conv_dim());
        let q = layout::take_cols(&qkv, cd, 0, qk)?;
        let k = layout::take_cols(&qkv, cd, qk, qk)?;
        let v = layout::take_cols(&qkv, cd, 2 * qk, vd)?;
        drop(qkv);
        // Caller-side q/k L2 norm (Megatron's route); with `use_qk_l2norm_in_kernel` the rule
        // normalizes the raw rows itself and no normalized copy exists.
        let qkn = if c.use_qk_l2norm && !c.use_qk_l2norm_in_kernel {
            Some((
                l2norm::forward(&q, n * hk, dk)?,
                l2norm::forward(&k, n * hk, dk)?,
            ))
        } else {
            None
        };
        let gates = match c.variant {
            Variant::Gdn => {
                let (g, beta) = gates::forward(
                    &gate_in[1],
                    &gate_in[0],
                    n,
                    hv,
                    p.get("A_log"),
                    p.get("dt_bias"),
                )?;
                Gates::Gdn { g, beta }
            }
            Variant::Gdn2 => {
                let (g_key, b_key, w) = gates::gdn2_forward(
                    &gate_in[0],
                    &gate_in[1],
                    &gate_in[2],
                    n,
                    hk,
                    dk,
                    p.get("A_log"),
                    p.get("dt_bias"),
                )?;
                Gates::Gdn2 {
                    g: layout::repeat_heads_f32s(&g_key, n, hk, hv, dk)?,
                    b: layout::repeat_heads(&b_key, n, hk, hv, dk)?,
                    w,
                    b_key,
                }
            }
        };
        Ok(RuleInputs {
            q,
            k,
            v,
            qkn,
            gates,
        })
    }

    /// The rule's forward; with `keep`, also what its backward can use instead of recomputing
    /// (training; inference keeps nothing).
    fn rule_forward(
        &self,
        r: &RuleInputs,
        seqs: &Seqs,
        h0: Option<&F32s>,
        want_final: bool,
        keep: bool,
    ) -> Result<(Act, Option<F32s>, RuleSaved)> {
        let (s, o) = (self.rule_shape(), self.rule_opts());
        match &r.gates {
            Gates::Gdn { g, beta } if keep => gated_delta_rule::forward_saving(
                r.qn(),
                r.kn(),
                &r.v,
                g,
                beta,
                seqs,
                s,
                o,
                h0,
                want_final,
            ),
            Gates::Gdn { g, beta } => {
                let (y, fin) = gated_delta_rule::forward(
                    r.qn(),
                    r.kn(),
                    &r.v,
                    g,
                    beta,
                    seqs,
                    s,
                    o,
                    h0,
                    want_final,
                )?;
                Ok((y, fin, RuleSaved::default()))
            }
            Gates::Gdn2 { g, b, w, .. } => {
                let (y, fin) =
                    gdn2_rule::forward(r.qn(), r.kn(), &r.v, g, b, w, seqs, s, o, h0, want_final)?;
                Ok((y, fin, RuleSaved::default()))
            }
        }
    }

    /// Backward: consumes what forward saved, returns `dx` (shape of `x`) and parameter grads
    /// under the parameters' names.
    pub fn backward(&self, saved: Saved, dy: &Tensor) -> Result<(Tensor, Grads)> {
        let (dx, g, _) = self.backward_with_state(saved, dy, None)?;
        Ok((dx, g))
    }

    /// Backward with the gradient of the final states (`[N, Hv, Dk, Dv]`, zeros when `None`);
    /// also returns the gradient of the initial states when forward was given them.
    pub fn backward_with_state(
        &self,
        saved: Saved,
        dy: &Tensor,
        d_final_state: Option<&Tensor>,
    ) -> Result<(Tensor, Grads, Option<Tensor>)> {
        if dy.shape() != saved.x_shape.as_slice() {
            return Err(GdnError::shape(
                "dy",
                dy.shape(),
                format!("{:?} (the shape of x)", saved.x_shape),
            ));
        }
        let st = self.state_shape(&saved.seqs);
        if let Some(d) = d_final_state {
            d.expect_shape("d_final_state", &st)?;
        }
        let x_shape = saved.x_shape.clone();
        let dya = self.act(dy.data())?;
        let d_final = match d_final_state {
            Some(t) => Some(self.f32s(t.data())?),
            None => None,
        };
        let (dx, grads, dh0) = self.backward_act(saved, &dya, d_final.as_ref())?;
        drop(dya);
        let dx = Tensor::from_vec(&x_shape, dx.into_host()?)?;
        let dh0 = match dh0 {
            Some(d) => Some(Tensor::from_vec(&st, d.into_host()?)?),
            None => None,
        };
        Ok((dx, self.grads_host(grads)?, dh0))
    }

    /// The backward of every API, on buffers where the layer computes: reruns forward under
    /// whole-layer recompute, then [`run_backward`](Self::run_backward).
    fn backward_act(
        &self,
        saved: Saved,
        dy: &Act,
        d_final: Option<&F32s>,
    ) -> Result<(Act, GradList, Option<F32s>)> {
        let Saved {
            seqs, x, h0, acts, ..
        } = saved;
        let acts = match acts {
            Some(a) => a,
            // Whole-layer recompute: rerun forward, keeping everything this time.
            None => self.run_forward(&x, &seqs, h0.as_ref(), false)?.acts,
        };
        self.run_backward(&x, &seqs, h0.as_ref(), acts, dy, d_final)
    }

    /// Backward of the rule, then of the gates, L2 norm and conv (`prep`): steps 6 to 3 of
    /// [`run_backward`](Self::run_backward), over `seqs.tokens()` rows of the in_proj output
    /// `proj`, writing their sections of `dproj` and handing the parameter gradients to `set`.
    /// The context-parallel layer runs it on each rank's heads.
    #[allow(clippy::too_many_arguments)]
    fn backward_rule_prep(
        &self,
        p: &ParamView,
        proj: &Act,
        rule_in: Option<RuleInputs>,
        rule_saved: &RuleSaved,
        seqs: &Seqs,
        h0: Option<&F32s>,
        d_o: &Act,
        d_final: Option<&F32s>,
        dproj: &mut Act,
        set: &mut SetGrad,
        prof: &mut Prof,
    ) -> Result<Option<F32s>> {
        let c = &self.cfg;
        let n = seqs.tokens();
        let (hk, hv, dk) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
        );
        let (qk, vd, cd) = (c.qk_dim(), c.v_dim(), c.conv_dim());
        let pc = self.proj_cols();
        // 6. The rule (its inputs rebuilt, or kept under keep_rule_inputs), then 5. gates, 4. L2 norm and
        // 3. conv, each writing its sections of dproj.
        let r = match rule_in {
            Some(r) => r,
            None => self.prep(p, proj, seqs)?,
        };
        let (s, o) = (self.rule_shape(), self.rule_opts());
        let w = c.linear_conv_kernel_dim;
        let dh0 = match &r.gates {
            Gates::Gdn { g, beta } => {
                let gated_delta_rule::RuleGrads {
                    dq,
                    dk: dkk,
                    dv: dvv,
                    dg,
                    dbeta,
                    dh0,
                } = gated_delta_rule::backward_saved(
                    r.qn(),
                    r.kn(),
                    &r.v,
                    g,
                    beta,
                    seqs,
                    s,
                    o,
                    h0,
                    d_o,
                    d_final,
                    rule_saved,
                )?;
                drop(r);
                prof.mark("bwd rule (+ prep rebuild)");
                // gates + L2 norm + conv in one op.
                let pg = prep::backward(
                    proj,
                    pc.prep(),
                    self.prep_shape(),
                    self.prep_params(p),
                    seqs,
                    PrepDy {
                        dq: &dq,
                        dk: &dkk,
                        dv: &dvv,
                        dg: &dg,
                        dbeta: &dbeta,
                    },
                    dproj,
                )?;
                set("A_log", &[hv], pg.a_log)?;
                set("dt_bias", &[hv], pg.dt_bias)?;
                set("conv1d.weight", &[cd, 1, w], pg.conv_w)?;
                if let Some(b) = pg.conv_b {
                    set("conv1d.bias", &[cd], b)?;
                }
                prof.mark("bwd gates + l2norm + conv");
                dh0
            }
            Gates::Gdn2 { g, b, w: wg, b_key } => {
                let gdn2_rule::RuleGrads {
                    dq,
                    dk: dkk,
                    dv: dvv,
                    dg,
                    db,
                    dw,
                    dh0,
                } = gdn2_rule::backward(
                    r.qn(),
                    r.kn(),
                    &r.v,
                    g,
                    b,
                    wg,
                    seqs,
                    s,
                    o,
                    h0,
                    d_o,
                    d_final,
                )?;
                prof.mark("bwd rule (+ prep rebuild)");
                let gi = self.gate_sections_of(proj)?;
                // The key-channel gates were repeated to the value heads: sum their gradients back.
                let dg_key = layout::sum_heads_f32s(&dg, n, hk, hv, dk)?;
                let db_key = layout::sum_heads(&db, n, hk, hv, dk)?;
                let (df, d_alog, d_dt) = gates::gdn2_backward(
                    &gi[0],
                    n,
                    hk,
                    dk,
                    p.get("A_log"),
                    p.get("dt_bias"),
                    &dg_key,
                )?;
                set("A_log", &[hk], d_alog)?;
                set("dt_bias", &[qk], d_dt)?;
                let db_raw = gates::sigmoid_backward(b_key, &db_key)?;
                let dw_raw = gates::sigmoid_backward(wg, &dw)?;
                for (d, &col) in [&df, &db_raw, &dw_raw].into_iter().zip(&pc.gates) {
                    layout::put_cols(dproj, col, d)?;
                }
                drop((df, db_raw, dw_raw));
                let (dq, dk_) = match &r.qkn {
                    Some(_) => (
                        l2norm::backward(&r.q, n * hk, dk, &dq)?,
                        l2norm::backward(&r.k, n * hk, dk, &dkk)?,
                    ),
                    None => (dq, dkk),
                };
                drop(r);
                let dqkv = layout::concat_cols(
                    n,
                    cd,
                    &[(0, qk, &dq), (qk, qk, &dk_), (2 * qk, vd, &dvv)],
                )?;
                drop((dq, dk_, dvv));
                // conv reads its input in place and writes d(conv input) into dproj.
                let (dcw, dcb) = conv1d::backward(
                    proj,
                    pc.qkv,
                    p.get("conv1d.weight"),
                    w,
                    p.opt("conv1d.bias"),
                    seqs,
                    &dqkv,
                    dproj,
                )?;
                drop(dqkv);
                set("conv1d.weight", &[cd, 1, w], dcw)?;
                if let Some(b) = dcb {
                    set("conv1d.bias", &[cd], b)?;
                }
                prof.mark("bwd gates + l2norm + conv");
                dh0
            }
        };
        Ok(dh0)
    }

    /// The layer, bottom to top.
    fn run_backward(
        &self,
        x: &Act,
        seqs: &Seqs,
        h0: Option<&F32s>,
        a: Acts,
        dy: &Act,
        d_final: Option<&F32s>,
    ) -> Result<(Act, GradList, Option<F32s>)> {
        let c = &self.cfg;
        let p = self.view()?;
        let n = seqs.tokens();
        let mut a = a;
        if a.proj_qkvz_only {
            a.proj = self.rebuild_proj(&p, x, n, &a.proj)?;
            a.proj_qkvz_only = false;
        }
        let (h, hv, dv) = (
            c.hidden_size,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let (vd, pd) = (c.v_dim(), c.in_proj_dim());
        let (kind, eps, zc) = (
            c.normalization,
            c.layernorm_epsilon,
            c.layernorm_zero_centered_gamma,
        );
        // Gradients arrive bottom to top; they are put in the parameters' order at the end.
        // They stay where they were computed: no download, no synchronization here.
        let mut grads: GradList = Vec::new();
        let mut set = |name: &str, shape: &[usize], g: F32s| -> Result<()> {
            grads.push((name.to_string(), shape.to_vec(), g));
            Ok(())
        };
        let mut prof = Prof::new(self.gpu()?);

        let pc = self.proj_cols();
        // 8. out_proj. Under gdn_norm_out its input is rebuilt here, by the same kernel on the
        // same inputs as in forward, so the bits are those forward had.
        let norm_out = match a.norm_out {
            Some(v) => v,
            None => {
                gated_norm::forward(
                    &a.o,
                    &a.proj,
                    pc.z,
                    n * hv,
                    dv,
                    p.get("out_norm.weight"),
                    p.opt("out_norm.bias"),
                    kind,
                    eps,
                    zc,
                )?
                .0
            }
        };
        let (d_norm_out, d_wout) = linear::backward(
            &norm_out,
            n,
            vd,
            p.get("out_proj.weight"),
            p.bf16("out_proj.weight"),
            h,
            dy,
        )?;
        drop(norm_out);
        set("out_proj.weight", &[h, vd], d_wout)?;
        prof.mark("bwd out_proj (+ norm_out rebuild)");

        // d(in_proj output) `[n, in_proj_dim]`, one buffer: each backward below writes its own
        // sections (z; gates; conv input), so nothing is concatenated.
        let mut dproj = uninit_like(&a.proj)?;

        // 7. Gated norm; dz into dproj's z columns.
        let (d_o, d_onw, d_onb) = gated_norm::backward(
            &a.o,
            &a.proj,
            pc.z,
            n * hv,
            dv,
            p.get("out_norm.weight"),
            p.opt("out_norm.bias"),
            kind,
            zc,
            &a.o_stats,
            &d_norm_out,
            &mut dproj,
        )?;
        // The rule's output and its norm statistics are not needed past this point: free them
        // before the rule's backward, whose workspaces set the step's memory peak.
        drop((d_norm_out, a.o, a.o_stats));
        set("out_norm.weight", &[dv], d_onw)?;
        if let Some(b) = d_onb {
            set("out_norm.bias", &[dv], b)?;
        }
        prof.mark("bwd gated norm");

        // 6. The rule (its inputs rebuilt, or kept under keep_rule_inputs), then 5. gates, 4. L2 norm and
        // 3. conv, each writing its sections of dproj.
        let dh0 = self.backward_rule_prep(
            &p,
            &a.proj,
            a.rule_in,
            &a.rule_saved,
            seqs,
            h0,
            &d_o,
            d_final,
            &mut dproj,
            &mut set,
            &mut prof,
        )?;
        drop(a.rule_saved);

        // 1. in_proj and its fused norm; the normalized input is rebuilt from x.
        let (xn, _) = norm::forward(
            x,
            n,
            h,
            p.get("in_proj.layer_norm_weight"),
            p.opt("in_proj.layer_norm_bias"),
            kind,
            eps,
            zc,
        )?;
        let (dxn, d_win) = linear::backward(
            &xn,
            n,
            h,
            p.get("in_proj.weight"),
            p.bf16("in_proj.weight"),
            pd,
            &dproj,
        )?;
        drop(xn);
        drop(dproj);
        set("in_proj.weight", &[pd, h], d_win)?;
        let (dx, d_lnw, d_lnb) = norm::backward(
            x,
            n,
            h,
            p.get("in_proj.layer_norm_weight"),
            kind,
            zc,
            &a.in_stats,
            &dxn,
        )?;
        set("in_proj.layer_norm_weight", &[h], d_lnw)?;
        if c.normalization == Normalization::LayerNorm {
            let b = d_lnb.ok_or_else(|| {
                GdnError::Invalid("LayerNorm backward returned no bias gradient".into())
            })?;
            set("in_proj.layer_norm_bias", &[h], b)?;
        }
        prof.mark("bwd in_proj (GEMMs + norm)");
        prof.report();
        let order = super::param_specs(c);
        let pos = |n: &str| {
            order
                .iter()
                .position(|(p, _)| *p == n)
                .unwrap_or(usize::MAX)
        };
        grads.sort_by_key(|(n, _, _)| pos(n));
        Ok((dx, grads, dh0))
    }
}
