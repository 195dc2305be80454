//! `gdn bench`: times one layer's forward and forward + backward, and the gated delta rule alone,
//! for given batch shapes, with kept bytes per token, the allocator's peak, the split of the step
//! by stage, and optionally the ratio to FLA's layer on the same shapes (`--fla-json`).
//!
//! Two clocks on CUDA, printed side by side: `host` is the wall clock of the call on the host
//! (from before the call until the GPU is idle after it); `gpu` is the span between two CUDA
//! events recorded on the layer's stream around the call. The GPU span counts the time the GPU
//! sits idle waiting for the host between kernels, so it equals the GPU's work only when the host
//! keeps the GPU fed; the stage split and the rule's kernel times show where the time goes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use gdn::backend::{Act, F32s};
use gdn::device::cuda::{self, DBuf, DType, Gpu};
use gdn::ops::gated_delta_rule::{RuleOpts, RuleShape};
use gdn::ops::{gated_delta_rule, gdn2_rule};
use gdn::{Device, GatedDeltaNet, GatedDeltaNet2, GdnConfig, Normalization, Seqs, Tensor, Variant};
use serde::Deserialize;
use serde_json::json;

use crate::memory::{self, median, values, VariantArg};

/// The last row of the stage split: the pass's time outside the layer's stage marks.
/// (host work: x and dy to the device, y, dx and the gradients back, conversions).
const OUTSIDE_STAGES: &str = "outside the stages (host work)";

/// Most `--reps`.
pub const MAX_REPS: u64 = 10_000;
/// Most `--warmup`.
pub const MAX_WARMUP: u64 = 1_000;
/// Largest `--fla-json` file read.
const MAX_FLA_JSON_BYTES: u64 = 16 << 20;

/// Arguments of `gdn bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A batch shape `BxT` (B sequences of T tokens); repeat for more. Default: 1x32768 and
    /// 4x8192 on CUDA, 1x256 on the CPU.
    #[arg(long = "shape", value_name = "BxT")]
    pub shapes: Vec<String>,
    /// Layer config (TOML). Default: Qwen3-Next's layer (hidden 2048, 16 key / 32 value heads,
    /// Dk = Dv = 128, RMSNorm).
    #[arg(long, value_name = "TOML")]
    pub config: Option<PathBuf>,
    /// Layer variant (overrides the config's `variant`).
    #[arg(long, value_enum, value_name = "VARIANT")]
    pub variant: Option<VariantArg>,
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// Storage type of activations: bf16 (the GPU's default) or f32 (the CPU's only type).
    #[arg(long, value_name = "TYPE")]
    pub dtype: Option<String>,
    /// Timed repetitions of each measurement (after the warm-up); median, min and max are printed.
    /// Default: 10 on CUDA, 3 on the CPU.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=MAX_REPS))]
    pub reps: Option<u64>,
    /// Untimed runs before each measurement. Default: 2 on CUDA, 1 on the CPU.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=MAX_WARMUP))]
    pub warmup: Option<u64>,
    /// Recompute setting, named as the rows of `gdn memory` (none: the default, the rule's
    /// inputs rebuilt in backward; keep_rule_inputs, l2norm_in_kernel, gdn_norm_out, gdn, full,
    /// ...); it replaces the config's recompute fields and `keep_rule_inputs`.
    #[arg(long, value_name = "SETTING", default_value = "none")]
    pub recompute: String,
    /// Also write the results as JSON to FILE (atomically).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// FLA's layer on the same shapes (written by bench/fla_layer_json.py): print ours / FLA.
    #[arg(long, value_name = "FILE")]
    pub fla_json: Option<PathBuf>,
}

/// One `--shape`.
#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    t: usize,
}

impl Shape {
    fn tokens(&self) -> usize {
        self.b * self.t
    }
}

/// `BxT`, both at least 1, with `B * T` and `B * T * hidden` in range.
fn parse_shape(s: &str, hidden: usize) -> Result<Shape> {
    let bad = |why: String| anyhow!("--shape {s:?}: {why} (expected BxT, e.g. 1x32768)");
    let (b, t) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| bad("no 'x' between B and T".into()))?;
    let num = |v: &str, what: &str| -> Result<usize> {
        let n: u64 = v
            .trim()
            .parse()
            .map_err(|e| bad(format!("{what} {v:?} is not a whole number ({e})")))?;
        if n == 0 {
            return Err(bad(format!("{what} must be at least 1")));
        }
        usize::try_from(n).map_err(|_| bad(format!("{what} {n} does not fit in usize")))
    };
    let (b, t) = (num(b, "the batch B")?, num(t, "the sequence length T")?);
    let tokens = b
        .checked_mul(t)
        .ok_or_else(|| bad(format!("{b} x {t} tokens overflow")))?;
    tokens
        .checked_mul(hidden)
        .ok_or_else(|| bad(format!("{tokens} tokens x hidden {hidden} values overflow")))?;
    Ok(Shape { b, t })
}

/// Median, min and max of some times in ms.
#[derive(Clone, Copy, Debug)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

impl Stat {
    fn of(v: &[f64]) -> Option<Stat> {
        if v.is_empty() {
            return None;
        }
        Some(Stat {
            median: median(v.to_vec()),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
    fn json(s: Option<Stat>) -> serde_json::Value {
        match s {
            Some(s) => json!({"median": s.median, "min": s.min, "max": s.max}),
            None => serde_json::Value::Null,
        }
    }
}

/// Host and GPU times of one measurement over its repetitions.
#[derive(Clone, Copy, Debug)]
struct Timing {
    host: Stat,
    gpu: Option<Stat>,
}

impl Timing {
    fn json(&self) -> serde_json::Value {
        json!({"host_ms": Stat::json(Some(self.host)), "gpu_ms": Stat::json(self.gpu)})
    }
    /// The time compared with FLA's (CUDA events on both sides; the host clock on the CPU).
    fn anchor_ms(&self) -> f64 {
        self.gpu.unwrap_or(self.host).median
    }
}

/// Times calls on the host and, on a GPU, with events on its stream.
struct Clock {
    gpu: Option<Arc<Gpu>>,
}

fn dev_err(what: &str, e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow!("{what}: {e:?}")
}

impl Clock {
    /// Run `f` once; its result (dropped by the caller, outside the timed region), host ms and
    /// GPU ms.
    fn once<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<(R, f64, Option<f64>)> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        match &self.gpu {
            None => {
                let t0 = Instant::now();
                let r = f()?;
                Ok((r, t0.elapsed().as_secs_f64() * 1e3, None))
            }
            Some(g) => {
                g.sync()?;
                let st = g.stream();
                let t0 = Instant::now();
                let a = st
                    .record_event(Some(CU_EVENT_DEFAULT))
                    .map_err(|e| dev_err("recording a CUDA event", e))?;
                let r = f()?;
                let b = st
                    .record_event(Some(CU_EVENT_DEFAULT))
                    .map_err(|e| dev_err("recording a CUDA event", e))?;
                g.sync()?;
                let host = t0.elapsed().as_secs_f64() * 1e3;
                let gpu = a
                    .elapsed_ms(&b)
                    .map_err(|e| dev_err("reading CUDA event times", e))?;
                Ok((r, host, Some(gpu as f64)))
            }
        }
    }

    /// `warmup` untimed runs of `f`, then `reps` timed runs.
    fn time<R>(
        &self,
        warmup: usize,
        reps: usize,
        mut f: impl FnMut() -> Result<R>,
    ) -> Result<Timing> {
        for _ in 0..warmup {
            drop(self.once(&mut f)?);
        }
        let (mut host, mut gpu) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
        for _ in 0..reps {
            let (r, h, g) = self.once(&mut f)?;
            drop(r);
            host.push(h);
            gpu.extend(g);
        }
        Ok(Timing {
            host: Stat::of(&host).ok_or_else(|| anyhow!("no timed repetitions"))?,
            gpu: Stat::of(&gpu),
        })
    }
}

/// FLA's numbers for one shape, from `--fla-json`.
#[derive(Clone, Debug, Deserialize)]
struct FlaRow {
    batch: usize,
    seq_len: usize,
    fwd_ms: f64,
    fwd_bwd_ms: f64,
    #[serde(default)]
    rule_fwd_ms: Option<f64>,
    #[serde(default)]
    rule_fwd_bwd_ms: Option<f64>,
    #[serde(default)]
    kept_bytes_per_token: Option<f64>,
    #[serde(default)]
    peak_bytes_over_start: Option<f64>,
}

/// The file bench/fla_layer_json.py writes.
#[derive(Debug, Deserialize)]
struct FlaFile {
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    gpu: Option<String>,
    #[serde(default)]
    hidden_size: Option<usize>,
    #[serde(default)]
    num_heads: Option<usize>,
    #[serde(default)]
    num_v_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    rows: Vec<FlaRow>,
}

/// Read and check `--fla-json` against the layer benchmarked.
fn read_fla(path: &Path, cfg: &GdnConfig) -> Result<FlaFile> {
    let bytes = gdn::io::read_limited(path, MAX_FLA_JSON_BYTES)?;
    let f: FlaFile = serde_json::from_slice(&bytes)
        .with_context(|| format!("--fla-json {}: not FLA's bench JSON", path.display()))?;
    let mine = [
        ("hidden_size", f.hidden_size, cfg.hidden_size),
        ("num_heads", f.num_heads, cfg.linear_num_key_heads),
        ("num_v_heads", f.num_v_heads, cfg.linear_num_value_heads),
        ("head_dim", f.head_dim, cfg.linear_key_head_dim),
        ("head_dim", f.head_dim, cfg.linear_value_head_dim),
    ];
    for (name, theirs, ours) in mine {
        if let Some(v) = theirs {
            if v != ours {
                bail!(
                    "--fla-json {}: FLA's layer has {name} = {v}, the layer benchmarked here {ours}; \
                     the ratio would compare different layers",
                    path.display()
                );
            }
        }
    }
    for r in &f.rows {
        let times = [
            ("fwd_ms", Some(r.fwd_ms)),
            ("fwd_bwd_ms", Some(r.fwd_bwd_ms)),
            ("rule_fwd_ms", r.rule_fwd_ms),
            ("rule_fwd_bwd_ms", r.rule_fwd_bwd_ms),
        ];
        for (name, v) in times {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    bail!(
                        "--fla-json {}: row B{} T{}: {name} = {v} is not a positive time",
                        path.display(),
                        r.batch,
                        r.seq_len
                    );
                }
            }
        }
    }
    Ok(f)
}

/// The rule's inputs for `n` tokens where the layer runs (FLA's kind of inputs: decays
/// `log(sigmoid(u))`, write strengths `sigmoid(u)`, q/k normalized inside the kernel).
struct RuleBench {
    q: Act,
    k: Act,
    v: Act,
    g: F32s,
    beta: Act,
    /// GDN2's write gate (`w`), or None for GDN.
    w: Option<Act>,
    d_o: Act,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl RuleBench {
    fn new(cfg: &GdnConfig, n: usize, gpu: Option<&Arc<Gpu>>, dtype: DType) -> Result<Self> {
        let (hk, hv, dk, dv) = (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        );
        let gdn2 = cfg.variant == Variant::Gdn2;
        // GDN gates one decay and one write strength per value head; GDN2 per key channel of
        // each value head.
        let gate_len = if gdn2 { hv * dk } else { hv };
        let host = |shape: &[usize], seed: u64| -> Result<Vec<f32>> {
            Ok(values(shape, seed)?.into_vec())
        };
        let g: Vec<f32> = host(&[n, gate_len], 4)?
            .into_iter()
            .map(|u| sigmoid(u).ln())
            .collect();
        let beta: Vec<f32> = host(&[n, gate_len], 5)?.into_iter().map(sigmoid).collect();
        let w = if gdn2 {
            Some(
                host(&[n, hv * dv], 6)?
                    .into_iter()
                    .map(sigmoid)
                    .collect::<Vec<_>>(),
            )
        } else {
            None
        };
        let act = |x: Vec<f32>| -> Result<Act> {
            Ok(match gpu {
                None => Act::Host(x),
                Some(g) => Act::Dev(DBuf::upload(g, &x, dtype)?),
            })
        };
        let g = match gpu {
            None => F32s::Host(g),
            Some(gp) => F32s::Dev(gp.upload(&g)?),
        };
        Ok(RuleBench {
            q: act(host(&[n, hk * dk], 1)?)?,
            k: act(host(&[n, hk * dk], 2)?)?,
            v: act(host(&[n, hv * dv], 3)?)?,
            g,
            beta: act(beta)?,
            w: w.map(act).transpose()?,
            d_o: act(host(&[n, hv * dv], 7)?)?,
        })
    }

    fn forward(&self, seqs: &Seqs, s: RuleShape, o: RuleOpts) -> Result<Act> {
        let r = match &self.w {
            None => gated_delta_rule::forward(
                &self.q, &self.k, &self.v, &self.g, &self.beta, seqs, s, o, None, false,
            )?,
            Some(w) => gdn2_rule::forward(
                &self.q, &self.k, &self.v, &self.g, &self.beta, w, seqs, s, o, None, false,
            )?,
        };
        Ok(r.0)
    }

    /// Forward + backward; returns what they made (dropped by the caller).
    fn forward_backward(
        &self,
        seqs: &Seqs,
        s: RuleShape,
        o: RuleOpts,
    ) -> Result<Box<dyn std::any::Any>> {
        let out = self.forward(seqs, s, o)?;
        Ok(match &self.w {
            None => Box::new((
                out,
                gated_delta_rule::backward(
                    &self.q, &self.k, &self.v, &self.g, &self.beta, seqs, s, o, None, &self.d_o,
                    None,
                )?,
            )),
            Some(w) => Box::new((
                out,
                gdn2_rule::backward(
                    &self.q, &self.k, &self.v, &self.g, &self.beta, w, seqs, s, o, None, &self.d_o,
                    None,
                )?,
            )),
        })
    }
}

/// Everything measured for one shape.
struct Row {
    shape: Shape,
    layer_fwd: Timing,
    layer_fwd_bwd: Timing,
    /// CUDA only: the device-resident API (`forward_dev` / `backward_dev`): x, dy, y, dx and
    /// the gradients stay on the GPU (each call starts from a device copy of x and dy).
    layer_dev: Option<(Timing, Timing)>,
    rule_fwd: Timing,
    rule_fwd_bwd: Timing,
    kept_bytes: usize,
    /// Peak bytes of the allocator during a forward + backward, and the live bytes at its start.
    peak: Option<(usize, usize)>,
    /// The profiled forward + backward: stages (name, ms) and its whole wall time.
    stages: Vec<(String, f64)>,
    profiled_ms: f64,
    /// The rule kernels' times in the profiled pass (CUDA only): (kernel, ms, launches).
    rule_kernels: Vec<(String, f64, usize)>,
}

/// Time one shape.
#[allow(clippy::too_many_arguments)]
fn bench_shape(
    layer: &GatedDeltaNet,
    cfg: &GdnConfig,
    shape: Shape,
    clock: &Clock,
    dtype: DType,
    warmup: usize,
    reps: usize,
) -> Result<Row> {
    let h = cfg.hidden_size;
    let tokens = shape.tokens();
    let tag = format!("B{} T{}", shape.b, shape.t);
    // x, dy, y and dx live on the host (f32); on the CPU the forward's own buffers too.
    let mut need = gdn::budget::bytes_of(&[4, tokens, h], 4);
    if clock.gpu.is_none() {
        need = need.saturating_add(cfg.forward_bytes_at_least(tokens));
    }
    gdn::budget::check_host(
        &format!(
            "benchmarking --shape {}x{} (hidden_size {h})",
            shape.b, shape.t
        ),
        need,
    )?;
    let x = values(&[shape.b, shape.t, h], 1)?;
    let dy = values(&[shape.b, shape.t, h], 2)?;

    errln!("gdn bench: {tag}: layer forward");
    let kept_bytes = layer.forward(&x)?.1.bytes();
    let layer_fwd = clock.time(warmup, reps, || Ok(layer.forward(&x)?))?;
    errln!("gdn bench: {tag}: layer forward + backward");
    let fb = || -> Result<(Tensor, gdn::Grads)> {
        let (y, saved) = layer.forward(&x)?;
        drop(y);
        Ok(layer.backward(saved, &dy)?)
    };
    let layer_fwd_bwd = clock.time(warmup, reps, fb)?;

    // The device-resident API: no host copies, no sync inside the calls.
    let layer_dev = match &clock.gpu {
        None => None,
        Some(g) => {
            errln!("gdn bench: {tag}: layer forward (+ backward), device API");
            let xd = DBuf::upload(g, x.data(), dtype)?;
            let dyd = DBuf::upload(g, dy.data(), dtype)?;
            let seqs = Seqs::uniform(shape.b, shape.t);
            let fwd = clock.time(warmup, reps, || {
                Ok(layer.forward_dev(xd.try_clone()?, &seqs)?)
            })?;
            let fwd_bwd = clock.time(warmup, reps, || {
                let (y, saved) = layer.forward_dev(xd.try_clone()?, &seqs)?;
                drop(y);
                Ok(layer.backward_dev(saved, dyd.try_clone()?)?)
            })?;
            Some((fwd, fwd_bwd))
        }
    };

    // Peak bytes of one more forward + backward (allocator counters; CUDA only).
    let peak = match &clock.gpu {
        None => None,
        Some(g) => {
            g.sync()?;
            let live = g.live_bytes();
            g.reset_peak();
            drop(fb()?);
            g.sync()?;
            Some((g.peak_bytes(), live))
        }
    };

    // The split by stage: one more forward + backward with the layer's stage marks on (each
    // synchronizes the GPU), and the rule kernels timed one by one.
    errln!("gdn bench: {tag}: profiled pass");
    if clock.gpu.is_some() {
        gdn::backend::launch::profile_start();
    }
    let t0 = Instant::now();
    let (r, stages) = gdn::layer::profile::capture(fb);
    let profiled_ms = t0.elapsed().as_secs_f64() * 1e3;
    let rule_kernels = if clock.gpu.is_some() {
        gdn::backend::launch::profile_take()
    } else {
        Vec::new()
    };
    drop(r?);
    let mut seen: Vec<&str> = Vec::new();
    let stages = stages
        .into_iter()
        .map(|(name, ms)| {
            let again = seen.contains(&name);
            seen.push(name);
            let label = if again {
                format!("{name} (again: recompute in backward)")
            } else {
                name.to_string()
            };
            (label, ms)
        })
        .collect();

    // The rule alone, on buffers already where the layer runs.
    errln!("gdn bench: {tag}: rule alone");
    let rb = RuleBench::new(cfg, tokens, clock.gpu.as_ref(), dtype)?;
    let seqs = Seqs::uniform(shape.b, shape.t);
    let s = RuleShape {
        hk: cfg.linear_num_key_heads,
        hv: cfg.linear_num_value_heads,
        dk: cfg.linear_key_head_dim,
        dv: cfg.linear_value_head_dim,
    };
    let o = RuleOpts {
        scale: cfg.scale(),
        l2norm_in_kernel: true,
    };
    let rule_fwd = clock.time(warmup, reps, || rb.forward(&seqs, s, o))?;
    let rule_fwd_bwd = clock.time(warmup, reps, || rb.forward_backward(&seqs, s, o))?;
    Ok(Row {
        shape,
        layer_fwd,
        layer_fwd_bwd,
        layer_dev,
        rule_fwd,
        rule_fwd_bwd,
        kept_bytes,
        peak,
        stages,
        profiled_ms,
        rule_kernels,
    })
}

fn mib(b: f64) -> f64 {
    b / (1024.0 * 1024.0)
}

/// `12.34 (12.01..13.50)` or `n/a`.
fn fmt_stat(s: Option<Stat>) -> String {
    match s {
        Some(s) => format!("{:.2} ({:.2}..{:.2})", s.median, s.min, s.max),
        None => "n/a".to_string(),
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    let mut cfg = match &args.config {
        Some(p) => GdnConfig::from_toml_file(p)?,
        None => GdnConfig::qwen3_next(),
    };
    if let Some(v) = args.variant {
        cfg.variant = match v {
            VariantArg::Gdn => Variant::Gdn,
            VariantArg::Gdn2 => Variant::Gdn2,
        };
    }
    let device: Device = args
        .device
        .parse()
        .with_context(|| format!("--device {:?}", args.device))?;
    let on_gpu = matches!(device, Device::Cuda(_));
    let dtype = match args.dtype.as_deref() {
        None if on_gpu => DType::Bf16,
        None => DType::F32,
        Some("bf16") => DType::Bf16,
        Some("f32") => DType::F32,
        Some(o) => bail!("--dtype {o:?}: expected bf16 or f32"),
    };
    if !on_gpu && dtype != DType::F32 {
        bail!("--dtype bf16 needs --device cuda: the CPU path computes in f32 only");
    }
    let setting = memory::SETTINGS
        .iter()
        .find(|s| s.name == args.recompute)
        .ok_or_else(|| {
            let names: Vec<&str> = memory::SETTINGS.iter().map(|s| s.name).collect();
            anyhow!(
                "--recompute {:?}: unknown setting; expected one of {}",
                args.recompute,
                names.join(", ")
            )
        })?;
    let cfg = setting.apply(&cfg)?;
    let shapes: Vec<Shape> = if args.shapes.is_empty() {
        let d: &[&str] = if on_gpu {
            &["1x32768", "4x8192"]
        } else {
            &["1x256"]
        };
        d.iter()
            .map(|s| parse_shape(s, cfg.hidden_size))
            .collect::<Result<_>>()?
    } else {
        args.shapes
            .iter()
            .map(|s| parse_shape(s, cfg.hidden_size))
            .collect::<Result<_>>()?
    };
    let reps = usize::try_from(args.reps.unwrap_or(if on_gpu { 10 } else { 3 }))?;
    let warmup = usize::try_from(args.warmup.unwrap_or(if on_gpu { 2 } else { 1 }))?;
    // Read FLA's numbers and check the output's folder before the long part.
    let fla = match &args.fla_json {
        Some(p) => Some(read_fla(p, &cfg)?),
        None => None,
    };
    if let Some(p) = &args.json {
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            bail!(
                "--json {}: folder {} does not exist",
                p.display(),
                dir.display()
            );
        }
        if p.is_dir() {
            bail!("--json {}: is a folder; expected a file name", p.display());
        }
    }

    let layer = match cfg.variant {
        Variant::Gdn => GatedDeltaNet::new(&cfg, 0)?,
        Variant::Gdn2 => GatedDeltaNet2::new(&cfg, 0)?.into_inner(),
    };
    let layer = layer.to_device(device, dtype)?;
    let gpu = match device {
        Device::Cpu => None,
        Device::Cuda(i) => Some(cuda::gpu(i)?),
    };
    let clock = Clock { gpu: gpu.clone() };

    let mut rows = Vec::with_capacity(shapes.len());
    for &shape in &shapes {
        rows.push(bench_shape(
            &layer, &cfg, shape, &clock, dtype, warmup, reps,
        )?);
    }

    // Report.
    let norm = match cfg.normalization {
        Normalization::RMSNorm => "RMSNorm",
        Normalization::LayerNorm => "LayerNorm",
    };
    let variant = match cfg.variant {
        Variant::Gdn => "GDN",
        Variant::Gdn2 => "GDN2",
    };
    let dtype_name = match dtype {
        DType::Bf16 => "bf16",
        DType::F32 => "f32",
    };
    let dev_desc = match &gpu {
        Some(g) => format!("{device} ({}, {})", g.name(), g.arch()),
        None => format!("cpu ({} rayon threads)", rayon::current_num_threads()),
    };
    outln!(
        "gdn bench: {variant} layer, hidden {}, {} key heads x {}, {} value heads x {}, conv {}, \
         {norm}; recompute {}; device {dev_desc}, {dtype_name} storage",
        cfg.hidden_size,
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel_dim,
        setting.name,
    );
    outln!(
        "times in ms: median (min..max) of {reps} reps after {warmup} warm-up runs; fwd is the \
         training forward (keeps what backward needs)"
    );
    outln!(
        "host = wall clock of the call on the host, until the device is idle; gpu = span of CUDA \
         events on the layer's stream around the call (includes the GPU's idle gaps while it waits \
         for the host; n/a on the CPU)"
    );
    outln!(
        "rule = the gated delta rule alone ({} op) on inputs already where the layer runs, q/k \
         L2-normalized in the kernel",
        if cfg.variant == Variant::Gdn2 {
            "gdn2_rule"
        } else {
            "gated_delta_rule"
        }
    );
    if let Some(f) = &fla {
        outln!(
            "FLA: {} ({}); ours/FLA compares {} ms",
            f.source.as_deref().unwrap_or("FLA's layer"),
            f.gpu.as_deref().unwrap_or("GPU not given"),
            if on_gpu {
                "gpu (events on both sides)"
            } else {
                "host"
            }
        );
    }
    for r in &rows {
        let (b, t) = (r.shape.b, r.shape.t);
        let tokens = r.shape.tokens();
        let fla_row = fla
            .as_ref()
            .and_then(|f| f.rows.iter().find(|x| x.batch == b && x.seq_len == t));
        outln!("");
        outln!("shape B{b} T{t} ({tokens} tokens)");
        let mut header = format!(
            "{:<26}  {:>28}  {:>28}",
            "what", "host ms (min..max)", "gpu ms (min..max)"
        );
        if fla.is_some() {
            header.push_str(&format!("  {:>9}  {:>8}", "FLA ms", "ours/FLA"));
        }
        outln!("{header}");
        let lines: [(&str, &Timing, Option<f64>); 4] = [
            ("layer fwd", &r.layer_fwd, fla_row.map(|f| f.fwd_ms)),
            (
                "layer fwd+bwd",
                &r.layer_fwd_bwd,
                fla_row.map(|f| f.fwd_bwd_ms),
            ),
            ("rule fwd", &r.rule_fwd, fla_row.and_then(|f| f.rule_fwd_ms)),
            (
                "rule fwd+bwd",
                &r.rule_fwd_bwd,
                fla_row.and_then(|f| f.rule_fwd_bwd_ms),
            ),
        ];
        let dev_lines: Vec<(&str, &Timing, Option<f64>)> = match &r.layer_dev {
            None => Vec::new(),
            Some((f, fb)) => vec![
                ("layer fwd (device API)", f, fla_row.map(|f| f.fwd_ms)),
                (
                    "layer fwd+bwd (device API)",
                    fb,
                    fla_row.map(|f| f.fwd_bwd_ms),
                ),
            ],
        };
        for (what, tm, theirs) in lines.into_iter().chain(dev_lines) {
            let mut line = format!(
                "{what:<26}  {:>28}  {:>28}",
                fmt_stat(Some(tm.host)),
                fmt_stat(tm.gpu)
            );
            if fla.is_some() {
                match theirs {
                    Some(f) => line.push_str(&format!("  {:>9.2}  {:>8.2}", f, tm.anchor_ms() / f)),
                    None => line.push_str(&format!("  {:>9}  {:>8}", "-", "-")),
                }
            }
            outln!("{line}");
        }
        if fla.is_some() && fla_row.is_none() {
            outln!("  (no FLA row for B{b} T{t} in --fla-json)");
        }
        outln!(
            "kept for backward: {:.1} bytes/token (Saved::bytes() {} / {tokens} tokens), {:.1} MiB{}",
            r.kept_bytes as f64 / tokens as f64,
            r.kept_bytes,
            mib(r.kept_bytes as f64),
            match fla_row.and_then(|f| f.kept_bytes_per_token) {
                Some(k) => format!("; FLA {k:.1} bytes/token"),
                None => String::new(),
            }
        );
        match r.peak {
            Some((peak, live)) => outln!(
                "peak: {:.1} MiB above the {:.1} MiB live at the step's start ({:.1} MiB in all; the \
                 allocator's peak counter over one fwd+bwd){}",
                mib(peak.saturating_sub(live) as f64),
                mib(live as f64),
                mib(peak as f64),
                match fla_row.and_then(|f| f.peak_bytes_over_start) {
                    Some(p) => format!("; FLA {:.1} MiB above its start", mib(p)),
                    None => String::new(),
                }
            ),
            None => outln!("peak: n/a on the CPU (no allocator counter)"),
        }
        let total: f64 = r.stages.iter().map(|s| s.1).sum();
        outln!(
            "stages of one profiled fwd+bwd ({:.2} ms in all; the layer's own stage marks, each \
             after a device sync; % of the whole pass):",
            r.profiled_ms
        );
        let outside = OUTSIDE_STAGES;
        let w = r
            .stages
            .iter()
            .map(|s| s.0.len())
            .chain([outside.len()])
            .max()
            .unwrap_or(0);
        let whole = r.profiled_ms.max(total);
        let rest = (whole - total).max(0.0);
        for (name, ms) in r
            .stages
            .iter()
            .map(|(n, ms)| (n.as_str(), *ms))
            .chain([(outside, rest)])
        {
            let pct = if whole > 0.0 { 100.0 * ms / whole } else { 0.0 };
            outln!("  {name:<w$}  {ms:>10.2} ms  {pct:>5.1}%");
        }
        if !r.rule_kernels.is_empty() {
            let k: f64 = r.rule_kernels.iter().map(|x| x.1).sum();
            let list: Vec<String> = r
                .rule_kernels
                .iter()
                .map(|(n, ms, c)| format!("{n}={ms:.2}ms/{c}"))
                .collect();
            outln!(
                "rule kernels in the profiled pass (CUDA events around each): {k:.2} ms ({}); \
                 layer fwd+bwd gpu minus rule kernels: {:.2} ms",
                list.join(" "),
                r.layer_fwd_bwd.anchor_ms() - k
            );
        }
    }

    if let Some(p) = &args.json {
        let rows_json: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let (b, t) = (r.shape.b, r.shape.t);
                let fla_row = fla
                    .as_ref()
                    .and_then(|f| f.rows.iter().find(|x| x.batch == b && x.seq_len == t));
                json!({
                    "batch": b,
                    "seq_len": t,
                    "tokens": r.shape.tokens(),
                    "layer_fwd": r.layer_fwd.json(),
                    "layer_fwd_bwd": r.layer_fwd_bwd.json(),
                    "layer_dev_fwd": r.layer_dev.as_ref().map(|d| d.0.json()),
                    "layer_dev_fwd_bwd": r.layer_dev.as_ref().map(|d| d.1.json()),
                    "rule_fwd": r.rule_fwd.json(),
                    "rule_fwd_bwd": r.rule_fwd_bwd.json(),
                    "kept_bytes": r.kept_bytes,
                    "kept_bytes_per_token": r.kept_bytes as f64 / r.shape.tokens() as f64,
                    "peak_bytes": r.peak.map(|p| p.0),
                    "peak_bytes_over_start": r.peak.map(|p| p.0.saturating_sub(p.1)),
                    "stages": r.stages.iter().map(|(n, ms)| json!({"stage": n, "ms": ms})).collect::<Vec<_>>(),
                    "profiled_ms": r.profiled_ms,
                    "rule_kernels_ms": (!r.rule_kernels.is_empty()).then(|| r.rule_kernels.iter().map(|x| x.1).sum::<f64>()),
                    "fla": fla_row.map(|f| json!({
                        "fwd_ms": f.fwd_ms,
                        "fwd_bwd_ms": f.fwd_bwd_ms,
                        "ratio_fwd": r.layer_fwd.anchor_ms() / f.fwd_ms,
                        "ratio_fwd_bwd": r.layer_fwd_bwd.anchor_ms() / f.fwd_bwd_ms,
                        "rule_fwd_ms": f.rule_fwd_ms,
                        "rule_fwd_bwd_ms": f.rule_fwd_bwd_ms,
                    })),
                })
            })
            .collect();
        let doc = json!({
            "gdn_version": env!("CARGO_PKG_VERSION"),
            "device": device.to_string(),
            "gpu": gpu.as_ref().map(|g| g.name().to_string()),
            "dtype": dtype_name,
            "variant": variant,
            "recompute": setting.name,
            "reps": reps,
            "warmup": warmup,
            "config": {
                "hidden_size": cfg.hidden_size,
                "num_key_heads": cfg.linear_num_key_heads,
                "num_value_heads": cfg.linear_num_value_heads,
                "key_head_dim": cfg.linear_key_head_dim,
                "value_head_dim": cfg.linear_value_head_dim,
            },
            "rows": rows_json,
        });
        let text = serde_json::to_string_pretty(&doc)? + "\n";
        gdn::io::write_atomic(p, text.as_bytes())?;
        errln!("gdn bench: wrote {}", p.display());
    }
    Ok(())
}
