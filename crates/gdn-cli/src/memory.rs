//! `gdn memory`: the activation memory one layer keeps for backward under each recompute setting,
//! measured from `Saved::bytes()` after a real forward, and optionally each setting's
//! forward + backward time.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use gdn::{
    GatedDeltaNet, GatedDeltaNet2, GdnConfig, Normalization, Params, RecomputeGranularity, Tensor,
    Variant,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Tokens of the forward whose `Saved::bytes()` gives the bytes per token (a second forward over
/// twice as many checks that the count is exactly linear in the tokens).
pub const MEASURE_TOKENS: usize = 64;

/// Most `--reps` (each is a forward + backward of every setting).
pub const MAX_REPS: u64 = 1_000_000;

/// Arguments of `gdn memory`.
#[derive(Args, Debug)]
pub struct MemoryArgs {
    /// Layer config (TOML). Default: Qwen3-Next's layer (hidden 2048, 16 key / 32 value heads,
    /// Dk = Dv = 128, RMSNorm). Each row of the table replaces the config's
    /// `recompute_granularity`, `recompute_modules`, `use_qk_l2norm_in_kernel` and
    /// `keep_rule_inputs`.
    #[arg(long, value_name = "TOML")]
    pub config: Option<PathBuf>,
    /// Tokens per layer call for the MiB column (and the sequence length of the --time runs).
    #[arg(long, value_name = "N", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub tokens: u64,
    /// Layer variant (overrides the config's `variant`).
    #[arg(long, value_enum, value_name = "VARIANT")]
    pub variant: Option<VariantArg>,
    /// Also time forward + backward of each setting (batch 1, T = --tokens) and print the ratio
    /// to `none`.
    #[arg(long)]
    pub time: bool,
    /// Timed repetitions per setting (after one warm-up); the median is reported.
    #[arg(long, value_name = "N", default_value_t = 3, requires = "time",
          value_parser = clap::value_parser!(u64).range(1..=MAX_REPS))]
    pub reps: u64,
    /// Where to run.
    #[arg(long, value_enum, value_name = "DEVICE", default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
}

/// `--variant`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VariantArg {
    Gdn,
    Gdn2,
}

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

/// One row of the table: the config fields it sets.
pub(crate) struct Setting {
    pub(crate) name: &'static str,
    granularity: Option<RecomputeGranularity>,
    modules: &'static [&'static str],
    in_kernel: bool,
    keep_rule_inputs: bool,
}

const SEL: Option<RecomputeGranularity> = Some(RecomputeGranularity::Selective);

const fn row(
    name: &'static str,
    granularity: Option<RecomputeGranularity>,
    modules: &'static [&'static str],
    in_kernel: bool,
    keep_rule_inputs: bool,
) -> Setting {
    Setting {
        name,
        granularity,
        modules,
        in_kernel,
        keep_rule_inputs,
    }
}

/// The rows, from keeping everything (Megatron's default, `keep_rule_inputs`) to keeping only
/// the layer input. `none` is the library's default (the rule's inputs rebuilt in backward);
/// under it the q/k L2 norm's placement changes the time, not the bytes.
pub(crate) const SETTINGS: &[Setting] = &[
    row("keep_rule_inputs", None, &[], false, true),
    row("keep_rule_inputs+l2norm_in_kernel", None, &[], true, true),
    row("none", None, &[], false, false),
    row("l2norm_in_kernel", None, &[], true, false),
    row("gdn_norm_out", SEL, &["gdn_norm_out"], false, false),
    row(
        "l2norm_in_kernel+gdn_norm_out",
        SEL,
        &["gdn_norm_out"],
        true,
        false,
    ),
    row("gdn", SEL, &["gdn"], false, false),
    row("full", Some(RecomputeGranularity::Full), &[], false, false),
];

impl Setting {
    /// `base` with this setting's recompute fields and l2norm placement.
    pub(crate) fn apply(&self, base: &GdnConfig) -> Result<GdnConfig> {
        let cfg = GdnConfig {
            use_qk_l2norm_in_kernel: self.in_kernel,
            keep_rule_inputs: self.keep_rule_inputs,
            recompute_granularity: self.granularity,
            recompute_modules: (!self.modules.is_empty())
                .then(|| self.modules.iter().map(|m| m.to_string()).collect()),
            ..base.clone()
        };
        cfg.validate()
            .with_context(|| format!("setting {}", self.name))?;
        Ok(cfg)
    }

    /// The config fields, as a reader would write them.
    fn describe(&self) -> String {
        let gran = match self.granularity {
            None => "recompute_granularity unset".to_string(),
            Some(RecomputeGranularity::Full) => "recompute_granularity = \"full\"".to_string(),
            Some(RecomputeGranularity::Selective) => format!(
                "recompute_granularity = \"selective\", recompute_modules = {:?}",
                self.modules
            ),
        };
        format!(
            "{gran}; use_qk_l2norm_in_kernel = {}; keep_rule_inputs = {}",
            self.in_kernel, self.keep_rule_inputs
        )
    }
}

/// Deterministic values in [-1, 1) (SplitMix64), so inputs need no RNG crate.
pub(crate) fn values(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n = shape.iter().product();
    let mut s = seed;
    let data = (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect();
    Ok(Tensor::from_vec(shape, data)?)
}

/// `Saved::bytes()` after a forward of `layer` over one sequence of `t` tokens.
fn saved_bytes(layer: &GatedDeltaNet, t: usize) -> Result<usize> {
    let x = values(&[1, t, layer.config().hidden_size], 1)?;
    let (_, saved) = layer.forward(&x)?;
    Ok(saved.bytes())
}

/// Bytes kept per token, measured: `Saved::bytes()` at [`MEASURE_TOKENS`] tokens divided by
/// that count, which must divide it exactly; a forward over twice the tokens must keep exactly
/// twice the bytes (no per-call constant hides in the per-token figure).
fn bytes_per_token(layer: &GatedDeltaNet, name: &str) -> Result<usize> {
    let t = MEASURE_TOKENS;
    let b1 = saved_bytes(layer, t)?;
    let b2 = saved_bytes(layer, 2 * t)?;
    if b1 % t != 0 || b2 != 2 * b1 {
        bail!(
            "setting {name}: Saved::bytes() is not linear in the tokens \
             ({b1} bytes at {t} tokens, {b2} at {}); cannot report bytes per token",
            2 * t
        );
    }
    Ok(b1 / t)
}

/// Progress of the timing runs on stderr: a bar on a terminal, one line per run otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
}

impl Progress {
    fn new(total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "timing {bar:30} {pos}/{len} runs [{elapsed_precise}, eta {eta}] {msg}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            b
        });
        Progress {
            bar,
            total,
            done: 0,
        }
    }
    /// A run starts (shown on the bar).
    fn start(&self, what: &str) {
        if let Some(b) = &self.bar {
            b.set_message(what.to_string());
        }
    }
    /// A run finished in `ms`.
    fn done(&mut self, what: &str, ms: f64) {
        self.done += 1;
        match &self.bar {
            Some(b) => b.inc(1),
            None => errln!(
                "gdn memory: timing [{}/{}] {what}: {ms:.1} ms",
                self.done,
                self.total
            ),
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// Wall time of one forward + backward of `layer` over `x`, in milliseconds. On the GPU through
/// the device-resident API (`forward_dev` / `backward_dev`, x and dy uploaded before the clock
/// starts, one sync at the end), so the time is the layer's, not the host copies'.
fn time_once(layer: &GatedDeltaNet, x: &Tensor, dy: &Tensor, device: DeviceArg) -> Result<f64> {
    match device {
        DeviceArg::Cpu => {
            let t0 = Instant::now();
            let (y, saved) = layer.forward(x)?;
            let (dx, grads) = layer.backward(saved, dy)?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            drop((y, dx, grads));
            Ok(ms)
        }
        DeviceArg::Cuda => {
            use gdn::device::cuda::{gpu, DBuf, DType};
            let g = gpu(0)?;
            let xd = DBuf::upload(&g, x.data(), DType::Bf16)?;
            let dyd = DBuf::upload(&g, dy.data(), DType::Bf16)?;
            let seqs = gdn::Seqs::uniform(x.shape()[0], x.shape()[1]);
            g.sync()?;
            let t0 = Instant::now();
            let (y, saved) = layer.forward_dev(xd, &seqs)?;
            let (dx, grads) = layer.backward_dev(saved, dyd)?;
            g.sync()?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            drop((y, dx, grads));
            Ok(ms)
        }
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Forward + backward time of every row over `[1, t, hidden]`: one warm-up round, then `reps`
/// rounds; each round runs every setting once (interleaved, so a slow spell of the machine hits
/// all settings alike). Fills each row's median in milliseconds.
fn time_rows(
    rows: &mut [Row],
    base: &GdnConfig,
    params: &Params,
    t: usize,
    reps: usize,
    device: DeviceArg,
) -> Result<()> {
    let h = base.hidden_size;
    let x = values(&[1, t, h], 1)?;
    let dy = values(&[1, t, h], 2)?;
    let mut p = Progress::new((rows.len() * (reps + 1)) as u64);
    let mut times = vec![Vec::with_capacity(reps); rows.len()];
    for round in 0..=reps {
        for (row, ts) in rows.iter().zip(times.iter_mut()) {
            let what = match round {
                0 => format!("{}: warm-up", row.setting.name),
                r => format!("{}: rep {r}/{reps}", row.setting.name),
            };
            p.start(&what);
            // Parameters are copied outside the timed region.
            let layer = place(
                GatedDeltaNet::with_params(&row.setting.apply(base)?, params.clone())?,
                device,
            )?;
            let ms = time_once(&layer, &x, &dy, device)?;
            p.done(&what, ms);
            if round > 0 {
                ts.push(ms);
            }
        }
    }
    p.finish();
    for (row, ts) in rows.iter_mut().zip(times) {
        row.ms = Some(median(ts));
    }
    Ok(())
}

struct Row {
    setting: &'static Setting,
    bytes_per_token: usize,
    ms: Option<f64>,
}

/// Where the layers run: the CPU in f32, or GPU 0 in bf16 storage.
fn place(layer: GatedDeltaNet, device: DeviceArg) -> Result<GatedDeltaNet> {
    Ok(match device {
        DeviceArg::Cpu => layer,
        DeviceArg::Cuda => layer.to_device(gdn::Device::Cuda(0), gdn::device::cuda::DType::Bf16)?,
    })
}

pub fn run(args: MemoryArgs) -> Result<()> {
    let mut base = match &args.config {
        Some(p) => GdnConfig::from_toml_file(p)?,
        None => GdnConfig::qwen3_next(),
    };
    if let Some(v) = args.variant {
        base.variant = match v {
            VariantArg::Gdn => Variant::Gdn,
            VariantArg::Gdn2 => Variant::Gdn2,
        };
    }
    let tokens = usize::try_from(args.tokens).context("--tokens does not fit in usize")?;
    let reps = usize::try_from(args.reps).context("--reps does not fit in usize")?;

    // Parameters do not depend on the recompute settings: initialize once, share.
    let params = match base.variant {
        Variant::Gdn => GatedDeltaNet::new(&base, 0)?,
        Variant::Gdn2 => GatedDeltaNet2::new(&base, 0)?.into_inner(),
    }
    .params()
    .clone();
    let settings: Vec<&'static Setting> = SETTINGS
        .iter()
        .filter(|s| base.use_qk_l2norm || !s.in_kernel)
        .collect();
    let mut rows = Vec::with_capacity(settings.len());
    for s in &settings {
        let layer = place(
            GatedDeltaNet::with_params(&s.apply(&base)?, params.clone())?,
            args.device,
        )?;
        rows.push(Row {
            setting: s,
            bytes_per_token: bytes_per_token(&layer, s.name)?,
            ms: None,
        });
    }
    if args.time {
        // x and dy of [1, tokens, hidden], and at least the forward's own activations.
        let io = gdn::budget::bytes_of(&[2, tokens, base.hidden_size], 4);
        gdn::budget::check_host(
            &format!(
                "timing forward + backward over --tokens {tokens} (hidden_size {})",
                base.hidden_size
            ),
            io.saturating_add(base.forward_bytes_at_least(tokens)),
        )?;
        time_rows(&mut rows, &base, &params, tokens, reps, args.device)?;
    }

    // Report.
    let norm = match base.normalization {
        Normalization::RMSNorm => "RMSNorm",
        Normalization::LayerNorm => "LayerNorm",
    };
    emit!(
        "gdn memory: {} layer, hidden {}, {} key heads x {}, {} value heads x {}, conv {}, {norm}; \
         device {}",
        match base.variant {
            Variant::Gdn => "GDN",
            Variant::Gdn2 => "GDN2",
        },
        base.hidden_size,
        base.linear_num_key_heads,
        base.linear_key_head_dim,
        base.linear_num_value_heads,
        base.linear_value_head_dim,
        base.linear_conv_kernel_dim,
        match args.device {
            DeviceArg::Cpu => "cpu, f32 (4 bytes/value)",
            DeviceArg::Cuda => "cuda:0, bf16 activations (2 bytes/value; norm statistics, decays and states fp32)",
        },
    )?;
    emit!(
        "bytes/token: Saved::bytes() after a forward over {MEASURE_TOKENS} tokens, divided by \
         {MEASURE_TOKENS} (exact for every row: it divides, and {} tokens keep exactly twice as much)",
        2 * MEASURE_TOKENS
    )?;
    if args.time {
        emit!(
            "time: forward + backward, batch 1 x {tokens} tokens, median of {reps} rounds after 1 warm-up \
             round (settings interleaved), {} rayon threads{}",
            rayon::current_num_threads(),
            match args.device {
                DeviceArg::Cpu => "",
                DeviceArg::Cuda =>
                    "; on the GPU through forward_dev / backward_dev (x, dy already there, one sync)",
            }
        )?;
    }
    emit!()?;
    let name_w = settings.iter().map(|s| s.name.len()).max().unwrap_or(0);
    let mib_h = format!("MiB@{tokens}");
    let mut header = format!(
        "{:<name_w$}  {:>11}  {:>12}  {:>9}",
        "setting", "bytes/token", mib_h, "% of none"
    );
    if args.time {
        header.push_str(&format!("  {:>10}  {:>7}", "fwd+bwd ms", "x none"));
    }
    emit!("{header}")?;
    // `none` (the default) is in every table: only l2norm_in_kernel rows are ever left out.
    let none = rows
        .iter()
        .find(|r| r.setting.name == "none")
        .context("the none row")?;
    for r in &rows {
        // u128: bytes per token x tokens cannot overflow for any --tokens.
        let mib = (r.bytes_per_token as u128 * tokens as u128) as f64 / (1024.0 * 1024.0);
        let pct = 100.0 * r.bytes_per_token as f64 / none.bytes_per_token as f64;
        let mut line = format!(
            "{:<name_w$}  {:>11}  {:>12.2}  {:>8.1}%",
            r.setting.name, r.bytes_per_token, mib, pct
        );
        if let (Some(ms), Some(ms0)) = (r.ms, none.ms) {
            line.push_str(&format!("  {:>10.1}  {:>7.2}", ms, ms / ms0));
        }
        emit!("{line}")?;
    }
    emit!()?;
    emit!(
        "settings (each replaces the config's recompute fields, keep_rule_inputs and l2norm placement):"
    )?;
    for s in &settings {
        emit!("  {:<name_w$}  {}", s.name, s.describe())?;
    }
    if settings.len() < SETTINGS.len() {
        emit!("  (the l2norm_in_kernel rows are left out: the config has use_qk_l2norm = false)")?;
    }
    Ok(())
}
