//! `gdn train`: train a small GDN language model end to end, with a progress bar, held-out
//! evaluation, a metrics file, checkpoints, resume and an optional PNG of the curves.
//!
//! Run directory (`--out`, default `runs/<name or UTC timestamp>`):
//!
//! - `config.toml`: the resolved run config (every key), what `--resume` reads back;
//! - `metrics.jsonl`: one JSON object per line, `"kind": "train"` every `log_interval` steps and
//!   `"kind": "eval"` at every evaluation;
//! - `checkpoints/step-NNNNNNNN.safetensors`: every `save_interval` steps and at the end;
//! - `curves.png` with `--plot`.
//!
//! How the directory stays consistent (a new run only in a new or empty directory, removed again
//! if it fails before its first checkpoint; atomic writes; what a resume checks and when it
//! falls back to an older checkpoint): see [`gdn::train::rundir`]. A resume rewrites
//! `config.toml` only when `--steps` changes `train.train_iters`, and `metrics.jsonl` only to
//! drop lines past the checkpoint it continues from.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use gdn::device::Device;
use gdn::model::LossStats;
use gdn::train::rundir::{self, NewRunDir};
use gdn::train::{checkpoint, DataKind, Dataset, ResumeOptions, RunConfig, StepStats, Trainer};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::plot;

/// The largest integer a TOML file holds (TOML integers are i64): the bound of every flag that
/// is written into the run's config.toml.
const MAX_TOML_INT: u64 = i64::MAX as u64;

/// Arguments of `gdn train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Run config (TOML: [model], [data], [optimizer], [train]); keys not given keep the
    /// built-in default run (`--print-config` shows every key).
    #[arg(long, value_name = "TOML", conflicts_with = "resume")]
    pub config: Option<PathBuf>,
    /// Train a byte-level language model on this text file (vocab 256, last 10% held out)
    /// instead of MQAR.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub data: Option<PathBuf>,
    /// Optimizer steps (`train.train_iters`). With --resume: extend the run to this many steps.
    /// At most 2^63 - 1 (config.toml stores it as a TOML integer).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=MAX_TOML_INT))]
    pub steps: Option<u64>,
    /// Seed of the model's initialization (`train.seed`), 0 to 2^63 - 1 (config.toml stores it as
    /// a TOML integer).
    #[arg(long, value_name = "N", conflicts_with = "resume",
          value_parser = clap::value_parser!(u64).range(..=MAX_TOML_INT))]
    pub seed: Option<u64>,
    /// Run directory. Default: runs/<--name>, or runs/<UTC timestamp>.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub out: Option<PathBuf>,
    /// Name of the run directory under runs/.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["out", "resume"])]
    pub name: Option<String>,
    /// Continue the run in DIR from its latest checkpoint (with its config.toml).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// With --resume: continue even though the text data file (--data) changed since the
    /// checkpoint (size or content); the run then trains on the new content.
    #[arg(long, requires = "resume")]
    pub allow_data_change: bool,
    /// Save a checkpoint and stop once this step is reached (to be resumed later).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_at_step: Option<u64>,
    /// Write a PNG of the loss and accuracy curves to the run directory (curves.png).
    #[arg(long)]
    pub plot: bool,
    /// Print the resolved run config (TOML) and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Where to train: cpu, or cuda[:N] (the whole model, its gradients and AdamW on the GPU).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// Activation storage on a GPU: bf16 (default; fp32 accumulation, master weights, gradients
    /// and optimizer state) or f32. The CPU computes in f32 only.
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Data-parallel ranks: the global batch (data.batch_size) is split into equal micro-batches
    /// over N ranks, gradients summed in a fixed order. Without a launcher: N in-process ranks
    /// (threads on --device); under `gdn launch` / torchrun: one process per rank (default:
    /// WORLD_SIZE / --cp).
    #[arg(long, value_name = "N")]
    pub dp: Option<usize>,
    /// Context-parallel ranks: each holds 1/N of every sequence (zigzag chunks), the GDN layers
    /// run head-parallel (heads divisible by N, data.seq_length by 2 N). Ranks = --dp x --cp.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub cp: usize,
    /// Sequences per micro-batch (one forward + backward); default: the global batch / --dp.
    /// The step's gradient depends only on the number of micro-batches per step, not on how
    /// many ranks run them: keep it to resume bit for bit on another --dp.
    #[arg(long, value_name = "N")]
    pub micro_batch_size: Option<usize>,
}

/// How `gdn train` spreads its ranks.
struct Layout {
    dp: usize,
    cp: usize,
    /// The launcher's environment (one process per rank, NCCL), when it starts several.
    env: Option<gdn::dist::DistEnv>,
}

impl Layout {
    fn from_args(args: &TrainArgs) -> Result<Self> {
        let env = gdn::dist::DistEnv::from_env()?.filter(|e| e.world_size > 1);
        let cp = args.cp;
        let dp = match (args.dp, &env) {
            (Some(d), _) => d,
            (None, Some(e)) if cp > 0 => {
                if !e.world_size.is_multiple_of(cp) {
                    bail!(
                        "--cp {cp}: the launcher's WORLD_SIZE={} is not a multiple of it (ranks = --dp x --cp)",
                        e.world_size
                    );
                }
                e.world_size / cp
            }
            (None, _) => 1,
        };
        gdn::dist::check_layout(dp, cp, env.as_ref().map(|e| e.world_size))?;
        Ok(Layout { dp, cp, env })
    }
    fn ranks(&self) -> usize {
        self.dp * self.cp
    }
}

/// This rank's data-parallel layout for `cfg`'s global batch.
fn parallel_for(
    args: &TrainArgs,
    cfg: &RunConfig,
    grid: Option<&gdn::dist::Grid>,
) -> Result<gdn::train::Parallel> {
    let dp = grid.map_or(1, |g| g.dp.size());
    let b = cfg.data.batch_size;
    let micro_batches = match args.micro_batch_size {
        None => 1,
        Some(0) => bail!("--micro-batch-size 0: a micro-batch holds at least one sequence"),
        Some(m) => {
            if !b.is_multiple_of(dp.saturating_mul(m)) {
                bail!(
                    "--micro-batch-size {m}: the global batch of {b} sequences (data.batch_size) must be divisible by --dp {dp} x --micro-batch-size {m} = {}",
                    dp.saturating_mul(m)
                );
            }
            b / (dp * m)
        }
    };
    let multi = |c: &std::sync::Arc<dyn gdn::dist::Communicator>| (c.size() > 1).then(|| c.clone());
    Ok(gdn::train::Parallel {
        comm: grid.and_then(|g| multi(&g.dp)),
        micro_batches,
        cp: grid.and_then(|g| multi(&g.cp)),
    })
}

/// The activation storage type of `--dtype` on `device`.
fn train_dtype(args: &TrainArgs, device: Device) -> Result<gdn::device::cuda::DType> {
    use gdn::device::cuda::DType;
    let on_gpu = device != Device::Cpu;
    let dt = match args.dtype.as_deref() {
        None if on_gpu => DType::Bf16,
        None => DType::F32,
        Some("bf16") => DType::Bf16,
        Some("f32") => DType::F32,
        Some(o) => bail!("--dtype {o:?}: expected bf16 or f32"),
    };
    if !on_gpu && dt != DType::F32 {
        bail!("--dtype bf16 needs --device cuda: the CPU path computes in f32 only");
    }
    Ok(dt)
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Metric {
    /// `"train"` (mean over the steps since the last train line) or `"eval"` (held-out set).
    pub kind: String,
    /// Steps taken.
    pub step: u64,
    /// Mean cross-entropy over target positions.
    pub loss: f64,
    /// Fraction of target positions predicted right (arg max).
    pub accuracy: f64,
    /// Target positions counted.
    pub targets: usize,
    /// Learning rate of the last step (train lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Gradient norm before clipping of the last step (train lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Training tokens per second over the logged steps (train lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Seconds since this process started.
    pub elapsed_s: f64,
}

/// `runs/<UTC timestamp>`: `YYYYMMDD-HHMMSS`.
fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86400, secs % 86400);
    // civil date from days since 1970-01-01 (Howard Hinnant's algorithm)
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn human_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!("{}h{:02}m", (s / 3600.0) as u64, (s % 3600.0 / 60.0) as u64)
    }
}

/// Estimated time left: `remaining` steps at the mean time per step of the `done` steps taken in
/// `elapsed`; None when no step was taken yet. An estimate past `Duration::MAX` (a `--steps`
/// near 2^63 on a slow model) saturates.
fn eta(remaining: u64, done: u64, elapsed: Duration) -> Option<Duration> {
    if done == 0 {
        return None;
    }
    let secs = remaining as f64 * (elapsed.as_secs_f64() / done as f64);
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// [`human_duration`] for an [`eta`], with "?" when unknown and a bound past a year.
fn human_eta(eta: Option<Duration>) -> String {
    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
    match eta {
        None => "?".to_string(),
        Some(d) if d > YEAR => "over a year".to_string(),
        Some(d) => human_duration(d),
    }
}

fn human_bytes(b: usize) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

fn human_rate(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Thousands separators.
fn group(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A `gdn: warning:` line on stderr (never fails the run).
fn warn(msg: &str) {
    errln!("gdn: warning: {msg}");
}

/// A `gdn: note:` line on stderr (never fails the run).
fn note(msg: &str) {
    errln!("gdn: note: {msg}");
}

/// The run config from the flags. A text data path is made absolute (against the working
/// directory, where it is read), so that the run resumes from any directory.
fn resolve_config(args: &TrainArgs) -> Result<RunConfig> {
    let mut cfg = match &args.config {
        Some(p) => RunConfig::from_toml_file(p)?,
        None => RunConfig::default(),
    };
    if let Some(p) = &args.data {
        cfg.data.kind = DataKind::Text;
        cfg.data.path = Some(p.clone());
    }
    if let Some(p) = &cfg.data.path {
        let abs = std::path::absolute(p)
            .with_context(|| format!("data.path {}: cannot make it absolute", p.display()))?;
        cfg.data.path = Some(abs);
    }
    if let Some(s) = args.steps {
        cfg.train.train_iters = s;
    }
    if let Some(s) = args.seed {
        cfg.train.seed = s;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Largest `metrics.jsonl` read back on resume (1 GiB, millions of lines).
const MAX_METRICS_BYTES: u64 = 1 << 30;

/// Read `metrics.jsonl`, keeping the lines up to `max_step` (what a resumed run keeps). A last
/// line cut short by a killed write is dropped with a note. Returns the lines and whether the
/// file holds anything else (so that it needs rewriting).
fn read_metrics(path: &Path, max_step: u64) -> Result<(Vec<Metric>, bool)> {
    let bytes = match gdn::io::read_limited(path, MAX_METRICS_BYTES) {
        Ok(b) => b,
        Err(gdn::GdnError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok((Vec::new(), false))
        }
        Err(e) => return Err(e.into()),
    };
    let text = String::from_utf8_lossy(&bytes);
    let torn_tail = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut changed = torn_tail;
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            changed = true;
            continue;
        }
        let m: Metric = match serde_json::from_str(line) {
            Ok(m) => m,
            Err(_) if torn_tail && i + 1 == lines.len() => {
                note(&format!(
                    "{}: dropped its last line, cut short by an interrupted write",
                    path.display()
                ));
                continue;
            }
            Err(e) => bail!(
                "{}: line {} is not a metrics record ({e})",
                path.display(),
                i + 1
            ),
        };
        if m.step <= max_step {
            out.push(m);
        } else {
            changed = true;
        }
    }
    Ok((out, changed))
}

/// Rewrite `metrics.jsonl` with `lines` (atomically).
fn write_metrics(path: &Path, lines: &[Metric]) -> Result<()> {
    let mut s = String::new();
    for m in lines {
        s.push_str(&serde_json::to_string(m)?);
        s.push('\n');
    }
    gdn::io::write_atomic(path, s.as_bytes())?;
    Ok(())
}

/// A new run directory: if the run ends (error or panic) before its first checkpoint, what this
/// process created of it is removed, with a note.
struct Created(NewRunDir);

impl Drop for Created {
    fn drop(&mut self) {
        let notes = self.0.remove_created();
        if !notes.is_empty() {
            note(&format!(
                "the run stopped before its first checkpoint, so its files go too: {}",
                notes.join(", ")
            ));
        }
    }
}

/// What `run` starts from.
struct Setup {
    cfg: RunConfig,
    dir: PathBuf,
    trainer: Trainer,
    /// The checkpoint a resumed run continues from.
    resumed_from: Option<PathBuf>,
    /// A new run's directory, until its first checkpoint.
    created: Option<Created>,
    /// The metrics lines so far.
    metrics: Vec<Metric>,
}

/// Config, run directory and trainer of a new run; `None` after --print-config. Everything
/// that can fail (config, data, model, device) fails before the directory is created.
fn start_new(args: &TrainArgs, device: Device, rank: &Rank) -> Result<Option<Setup>> {
    if args.allow_data_change {
        // clap waives `requires` when a flag that conflicts with --resume (--out) is given
        bail!("--allow-data-change applies to --resume only (a new run reads its data fresh)");
    }
    let cfg = resolve_config(args)?;
    let doc = cfg.to_toml_string();
    let dir = match (&args.out, &args.name) {
        (Some(d), _) => d.clone(),
        (None, Some(n)) => {
            // a name, not a path: it stays under runs/ (use --out for a directory elsewhere)
            let one = std::path::Path::new(n).components().count() == 1;
            if n.is_empty() || !one || n == "." || n == ".." || n.contains(['/', '\\']) {
                bail!(
                    "--name {n:?}: expected a plain directory name under runs/ (no '/', '.' or \
                     '..'); use --out DIR for a run directory elsewhere"
                );
            }
            PathBuf::from("runs").join(n)
        }
        (None, None) => PathBuf::from("runs").join(timestamp()),
    };
    if args.print_config {
        if rank.lead {
            crate::write_out(format_args!("{doc}"));
        }
        return Ok(None);
    }
    if rank.lead {
        NewRunDir::check(&dir)?;
    }
    let mut trainer = Trainer::new(&cfg)?;
    trainer.set_parallel(parallel_for(args, &cfg, rank.grid.as_ref())?)?;
    if device != Device::Cpu {
        // The whole model, its gradients and AdamW run there.
        trainer.to_device(device, train_dtype(args, device)?)?;
    }
    if !rank.lead {
        // Only rank 0 writes the run directory.
        return Ok(Some(Setup {
            cfg,
            dir,
            trainer,
            resumed_from: None,
            created: None,
            metrics: Vec::new(),
        }));
    }
    let mut nd = NewRunDir::create(&dir)
        .with_context(|| format!("creating the run directory {}", dir.display()))?;
    nd.write_file(rundir::CONFIG, doc.as_bytes())?;
    nd.create_subdir(rundir::CHECKPOINTS)?;
    nd.write_file(rundir::METRICS, b"")?;
    Ok(Some(Setup {
        cfg,
        dir,
        trainer,
        resumed_from: None,
        created: Some(Created(nd)),
        metrics: Vec::new(),
    }))
}

/// Config and trainer of the run in `dir`, from its newest good checkpoint; `None` after
/// --print-config.
fn start_resumed(
    args: &TrainArgs,
    dir: &Path,
    device: Device,
    rank: &Rank,
) -> Result<Option<Setup>> {
    let cannot = || format!("cannot resume {}", dir.display());
    let mut cfg = rundir::read_config(dir).with_context(cannot)?;
    let file_iters = cfg.train.train_iters;
    if let Some(s) = args.steps {
        cfg.train.train_iters = s;
        cfg.validate()?;
    }
    if args.print_config {
        if rank.lead {
            crate::write_out(format_args!("{}", cfg.to_toml_string()));
        }
        return Ok(None);
    }
    if rank.lead {
        for p in rundir::remove_stray_temps(dir).with_context(cannot)? {
            note(&format!(
                "removed {}, left by an interrupted write",
                p.display()
            ));
        }
    }
    let data = Dataset::from_config(&cfg.data).with_context(cannot)?;
    let latest = rundir::load_latest(&dir.join(rundir::CHECKPOINTS)).with_context(cannot)?;
    if let Some((newest, _)) = latest.rejected.first().filter(|_| rank.lead) {
        for (_, e) in &latest.rejected {
            warn(&format!("passing over a corrupt checkpoint: {e}"));
        }
        warn(&format!(
            "resuming from {}, the newest checkpoint that passes its checks, instead of {}",
            latest.path.display(),
            newest.display()
        ));
    }
    let opts = ResumeOptions {
        allow_data_change: args.allow_data_change,
    };
    let path = latest.path;
    let (mut trainer, notes) = Trainer::from_checkpoint(&cfg, data, latest.checkpoint, &path, opts)
        .with_context(|| format!("cannot resume from {}", path.display()))?;
    if rank.lead {
        for n in notes {
            warn(&n);
        }
    }
    trainer.set_parallel(parallel_for(args, &cfg, rank.grid.as_ref())?)?;
    if device != Device::Cpu {
        trainer.to_device(device, train_dtype(args, device)?)?;
    }
    if args.steps.is_some() && cfg.train.train_iters < trainer.step_count() {
        bail!(
            "--steps {} is below the {} steps this run has taken (checkpoint {}); a resumed run can \
             only be continued or extended",
            cfg.train.train_iters,
            trainer.step_count(),
            path.display()
        );
    }
    let mpath = dir.join(rundir::METRICS);
    if !rank.lead {
        return Ok(Some(Setup {
            cfg,
            dir: dir.to_path_buf(),
            trainer,
            resumed_from: Some(path),
            created: None,
            metrics: Vec::new(),
        }));
    }
    let (metrics, changed) = read_metrics(&mpath, trainer.step_count())?;
    if changed {
        write_metrics(&mpath, &metrics)?;
    }
    if cfg.train.train_iters != file_iters {
        // --steps extends the run (or ends it where it is): the one key a resume changes.
        gdn::io::write_atomic(&dir.join(rundir::CONFIG), cfg.to_toml_string().as_bytes())?;
    }
    Ok(Some(Setup {
        cfg,
        dir: dir.to_path_buf(),
        trainer,
        resumed_from: Some(path),
        created: None,
        metrics,
    }))
}

/// Progress output: an indicatif bar on a terminal, plain lines otherwise.
struct Progress {
    /// Ranks other than 0 print nothing.
    quiet: bool,
    bar: Option<ProgressBar>,
    total: u64,
    last_eval: Option<LossStats>,
    last_train: Option<Metric>,
}

impl Progress {
    fn new(start: u64, total: u64, quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:28.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            b.set_position(start);
            b.reset_eta();
            b
        });
        Progress {
            quiet,
            bar,
            total,
            last_eval: None,
            last_train: None,
        }
    }

    /// A line above the bar, or on stderr (indicatif ignores write errors; errln! turns stderr
    /// off after its first failure).
    fn println(&self, s: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(b) => b.println(s),
            None => errln!("{s}"),
        }
    }

    fn step(&self, step: u64) {
        if let Some(b) = &self.bar {
            b.set_position(step);
        }
    }

    /// The bar's message: the last training metrics and the last held-out accuracy.
    fn message(&self) -> String {
        let eval = self.last_eval.map_or(String::new(), |e| {
            format!(" | held-out acc {:.1}%", 100.0 * e.accuracy())
        });
        match &self.last_train {
            Some(m) => format!(
                "loss {:.4} acc {:.1}%{eval} | {} tok/s",
                m.loss,
                100.0 * m.accuracy,
                human_rate(m.tokens_per_s.unwrap_or(0.0))
            ),
            None => eval.trim_start_matches(" | ").to_string(),
        }
    }

    fn train(&mut self, m: &Metric, eta: Option<Duration>) {
        self.last_train = Some(m.clone());
        match &self.bar {
            Some(b) => b.set_message(self.message()),
            None if self.quiet => {}
            None => errln!(
                "step {:>w$}/{}  loss {:.4}  acc {:6.2}%  lr {:.2e}  grad norm {:.3}  {} tok/s  eta {}",
                m.step,
                self.total,
                m.loss,
                100.0 * m.accuracy,
                m.lr.unwrap_or(0.0),
                m.grad_norm.unwrap_or(0.0),
                human_rate(m.tokens_per_s.unwrap_or(0.0)),
                human_eta(eta),
                w = self.total.to_string().len()
            ),
        }
    }

    fn eval(&mut self, step: u64, e: LossStats) {
        self.last_eval = Some(e);
        if let Some(b) = &self.bar {
            b.set_message(self.message());
        }
        self.println(&format!(
            "eval at step {step}: held-out loss {:.4}, accuracy {:.2}% ({} targets)",
            e.loss(),
            100.0 * e.accuracy(),
            e.count
        ));
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// This process's (or thread's) rank.
struct Rank {
    /// Its groups (`None`: one rank alone).
    grid: Option<gdn::dist::Grid>,
    /// Rank 0: the one that prints, evaluates and writes the run directory.
    lead: bool,
    /// One process per rank (launched): every rank handles SIGINT / SIGTERM itself.
    launched: bool,
    /// How the ranks talk, for the header.
    how: String,
}

/// Run `gdn train`: one rank; `--dp` x `--cp` in-process ranks (threads); or, under `gdn launch` /
/// torchrun, this process's rank of the launched group (NCCL).
pub fn run(args: TrainArgs) -> Result<()> {
    let device: Device = args.device.parse()?;
    train_dtype(&args, device)?;
    let layout = Layout::from_args(&args)?;
    if let Some(env) = &layout.env {
        let Device::Cuda(_) = device else {
            bail!(
                "launched ranks (WORLD_SIZE={}) talk over NCCL, one GPU each: use --device cuda \
                 (in-process ranks on the CPU: gdn train --dp N without gdn launch)",
                env.world_size
            );
        };
        // Rank i uses cuda:LOCAL_RANK.
        let device = Device::Cuda(env.local_rank);
        let grid = gdn::dist::Nccl::grid(env, layout.dp, layout.cp)?;
        let lead = grid.rank() == 0;
        let rank = Rank {
            grid: Some(grid),
            lead,
            launched: true,
            how: format!("{} processes over NCCL", env.world_size),
        };
        return run_rank(&args, device, rank);
    }
    if let Device::Cuda(i) = device {
        // Fail before creating the run directory when no GPU can be used.
        gdn::device::cuda::gpu(i)?;
    }
    if layout.ranks() == 1 {
        let rank = Rank {
            grid: None,
            lead: true,
            launched: false,
            how: String::new(),
        };
        return run_rank(&args, device, rank);
    }
    let how = format!("{} in-process ranks on {device}", layout.ranks());
    let results = gdn::dist::run_grid(layout.dp, layout.cp, |grid| {
        let lead = grid.rank() == 0;
        let rank = Rank {
            grid: Some(grid),
            lead,
            launched: false,
            how: how.clone(),
        };
        Ok(run_rank(&args, device, rank))
    })?;
    // The cause: the first error that is not another rank leaving because one failed.
    let mut errs: Vec<anyhow::Error> = results.into_iter().filter_map(|r| r.err()).collect();
    if errs.is_empty() {
        return Ok(());
    }
    let cause = errs
        .iter()
        .position(|e| !crate::report(e).contains("has left the group"))
        .unwrap_or(0);
    Err(errs.swap_remove(cause))
}

/// One rank's run (all of `gdn train` when alone): rank 0 prints, evaluates, and writes the run
/// directory; every rank steps (the steps' collectives keep them together).
fn run_rank(args: &TrainArgs, device: Device, rank: Rank) -> Result<()> {
    let started = Instant::now();
    let lead = rank.lead;

    // Config, run directory, and the trainer (fresh or resumed).
    let setup = match &args.resume {
        Some(dir) => start_resumed(args, dir, device, &rank)?,
        None => start_new(args, device, &rank)?,
    };
    let Some(Setup {
        cfg,
        dir,
        mut trainer,
        resumed_from,
        created,
        mut metrics,
    }) = setup
    else {
        return Ok(()); // --print-config
    };
    let ckdir = dir.join(rundir::CHECKPOINTS);
    let mpath = dir.join(rundir::METRICS);

    let total = cfg.train.train_iters;
    let start_step = trainer.step_count();
    let stop = args.stop_at_step.map_or(total, |s| s.min(total));
    if lead {
        print_header(
            &cfg,
            &trainer,
            &dir,
            start_step,
            resumed_from.as_deref(),
            &rank,
        );
    }

    // From here on SIGINT / SIGTERM stop the run at the next step boundary, with a checkpoint.
    // (In-process ranks: rank 0 handles them for the process; launched: every process, and
    // rank 0's decision holds for all.)
    let signals = if lead || rank.launched {
        match StopSignals::register() {
            Ok(s) => Some(s),
            Err(e) => {
                if lead {
                    errln!(
                        "gdn: note: cannot handle SIGINT / SIGTERM ({e}); they end the run unsaved"
                    );
                }
                None
            }
        }
    } else {
        None
    };
    let mut interrupted: Option<i32> = None;
    let mut stop = stop;
    let mut progress = Progress::new(start_step, total, !lead);
    let mut acc = LossStats::default();
    let mut last: Option<StepStats> = None;
    let (mut win_tokens, mut win_time) = (0usize, Duration::ZERO);
    let (mut train_tokens, mut train_time) = (0usize, Duration::ZERO);
    let mut last_ckpt: Option<PathBuf> = None;
    let mut final_eval = None;
    let append = |m: &Metric| -> Result<()> {
        // one write of the whole line, so a killed process leaves at most a cut-short last
        // line (which a resume drops)
        let mut line = serde_json::to_string(m)?;
        line.push('\n');
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&mpath)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .with_context(|| format!("writing {}", mpath.display()))?;
        Ok(())
    };
    let save = |t: &Trainer| -> Result<PathBuf> {
        let p = ckdir.join(checkpoint::file_name(t.step_count()));
        t.save(&p)
            .with_context(|| format!("writing checkpoint {}", p.display()))?;
        if let Some(c) = &created {
            c.0.keep();
        }
        Ok(p)
    };
    let eval_metric = |step: u64, e: &LossStats| Metric {
        kind: "eval".into(),
        step,
        loss: e.loss(),
        accuracy: e.accuracy(),
        targets: e.count,
        lr: None,
        grad_norm: None,
        tokens_per_s: None,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    if start_step == 0 && lead {
        // the untrained model, so the held-out curve starts at chance
        let e = trainer.evaluate()?;
        progress.eval(0, e);
        let m = eval_metric(0, &e);
        append(&m)?;
        metrics.push(m);
    }
    while trainer.step_count() < stop {
        let t0 = Instant::now();
        let st = trainer.step()?;
        let dt = t0.elapsed();
        win_time += dt;
        train_time += dt;
        win_tokens += st.tokens;
        train_tokens += st.tokens;
        acc.add(&st.loss);
        last = Some(st);
        let s = st.step;
        if interrupted.is_none() && s < stop {
            // a signal during this step: make this step the last one (logged and saved below)
            let mine = signals.as_ref().and_then(StopSignals::received);
            interrupted = match &rank.grid {
                // every rank stops where rank 0 does
                Some(g) => {
                    let mut v = vec![mine.unwrap_or(0) as f32];
                    g.broadcast_host(&mut v)?;
                    (v[0] != 0.0).then_some(v[0] as i32)
                }
                None => mine,
            };
            if interrupted.is_some() {
                stop = s;
            }
        }
        progress.step(s);
        if !lead {
            continue;
        }
        if s % cfg.train.log_interval == 0 || s == stop {
            let rate = win_tokens as f64 / win_time.as_secs_f64().max(1e-9);
            let m = Metric {
                kind: "train".into(),
                step: s,
                loss: acc.loss(),
                accuracy: acc.accuracy(),
                targets: acc.count,
                lr: Some(st.lr),
                grad_norm: Some(st.grad_norm),
                tokens_per_s: Some(rate),
                elapsed_s: started.elapsed().as_secs_f64(),
            };
            let eta = eta(
                stop.saturating_sub(s),
                s.saturating_sub(start_step),
                train_time,
            );
            progress.train(&m, eta);
            append(&m)?;
            metrics.push(m);
            acc = LossStats::default();
            win_tokens = 0;
            win_time = Duration::ZERO;
        }
        let at_end = s == total;
        if (cfg.train.eval_interval > 0 && s % cfg.train.eval_interval == 0) || at_end {
            let e = trainer.evaluate()?;
            let m = eval_metric(s, &e);
            progress.eval(s, e);
            append(&m)?;
            metrics.push(m);
            if at_end {
                final_eval = Some(e);
            }
        }
        if (cfg.train.save_interval > 0 && s % cfg.train.save_interval == 0) || s == stop {
            last_ckpt = Some(save(&trainer)?);
        }
    }
    progress.finish();
    if !lead {
        return match interrupted {
            Some(signal) => Err(Interrupted { signal }.into()),
            None => Ok(()),
        };
    }
    if last_ckpt.is_none() {
        // nothing to train (already at the end): make sure the final state is saved
        last_ckpt = Some(save(&trainer)?);
    }
    // (no held-out evaluation after a signal: the user asked to stop)
    let eval = match final_eval {
        Some(e) => Some(e),
        None if interrupted.is_some() => None,
        None => Some(trainer.evaluate()?),
    };
    let wall = started.elapsed();

    let plot_path = dir.join("curves.png");
    if args.plot {
        plot::write_curves(&plot_path, &metrics, trainer.data().chance_accuracy())
            .with_context(|| format!("writing {}", plot_path.display()))?;
    }

    // Summary.
    let done = trainer.step_count();
    if let Some(sig) = interrupted {
        outln!(
            "stopped at step {done} of {total} ({}); continue with: gdn train --resume {}",
            signal_name(sig),
            dir.display()
        );
    } else if done < total {
        outln!(
            "stopped at step {done} of {total} (--stop-at-step); continue with: gdn train --resume {}",
            dir.display()
        );
    } else {
        outln!("done: {done} steps");
    }
    let chance = trainer
        .data()
        .chance_accuracy()
        .map_or(String::new(), |c| format!("; chance {:.2}%", 100.0 * c));
    if let Some(eval) = eval {
        outln!(
            "held-out: loss {:.4}, accuracy {:.2}% ({} sequences, {} targets{chance})",
            eval.loss(),
            100.0 * eval.accuracy(),
            trainer.data().eval_sequences(),
            group(eval.count)
        );
    }
    let steps_run = done.saturating_sub(start_step);
    outln!(
        "time: {} wall, {} steps in {} ({} tokens/s training)",
        human_duration(wall),
        steps_run,
        human_duration(train_time),
        human_rate(train_tokens as f64 / train_time.as_secs_f64().max(1e-9))
    );
    if let Some(st) = last {
        outln!(
            "activation memory per step: {} kept for backward ({} in the GDN layers' Saved), {} tokens",
            human_bytes(st.activation_bytes),
            human_bytes(st.gdn_activation_bytes),
            group(st.tokens)
        );
    }
    let mut files = vec![
        mpath.display().to_string(),
        last_ckpt
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
    ];
    if args.plot {
        files.push(plot_path.display().to_string());
    }
    outln!("wrote: {}", files.join(", "));
    match interrupted {
        Some(signal) => Err(Interrupted { signal }.into()),
        None => Ok(()),
    }
}

/// The run's description (rank 0).
fn print_header(
    cfg: &RunConfig,
    trainer: &Trainer,
    dir: &Path,
    start_step: u64,
    resumed_from: Option<&Path>,
    rank: &Rank,
) {
    let total = cfg.train.train_iters;
    let mcfg = trainer.model().config().clone();
    let l = &mcfg.layer;
    outln!(
        "model: {} blocks of {} (hidden {}, {} key / {} value heads, Dk {}, Dv {}) + SwiGLU MLP {}, vocab {}, {} parameters",
        l.num_layers,
        match l.variant {
            gdn::Variant::Gdn => "GDN",
            gdn::Variant::Gdn2 => "GDN2",
        },
        l.hidden_size,
        l.linear_num_key_heads,
        l.linear_num_value_heads,
        l.linear_key_head_dim,
        l.linear_value_head_dim,
        mcfg.ffn_hidden_size,
        mcfg.vocab_size,
        group(trainer.model().numel())
    );
    outln!("data: {}", trainer.data().describe());
    if let Device::Cuda(_) = trainer.device() {
        let dt = match trainer.model().dtype() {
            gdn::device::cuda::DType::Bf16 => "bf16",
            gdn::device::cuda::DType::F32 => "f32",
        };
        outln!(
            "device: {} ({dt} activations; fp32 weights, gradients and AdamW moments), the whole model on the GPU",
            trainer.device()
        );
    }
    outln!(
        "train: {} steps of {} x {} tokens, AdamW lr {:.1e} ({} warmup, {:?} decay to {:.1e}), {} threads",
        total,
        cfg.data.batch_size,
        cfg.data.seq_length,
        cfg.optimizer.lr,
        cfg.optimizer.lr_warmup_iters,
        cfg.optimizer.lr_decay_style,
        cfg.optimizer.min_lr,
        rayon::current_num_threads()
    );
    match resumed_from {
        Some(p) => outln!(
            "run dir: {} (resumed at step {start_step} from {})",
            dir.display(),
            p.display()
        ),
        None => outln!("run dir: {}", dir.display()),
    }

    if let Some(g) = &rank.grid {
        let par = trainer.parallel();
        let per = cfg.data.batch_size / par.shards().max(1);
        outln!(
            "parallel: dp {} x cp {} ({}); {} micro-batch(es) of {per} sequences per data rank, the step's gradient summed over {} micro-batches in order",
            g.dp.size(),
            g.cp.size(),
            rank.how,
            par.micro_batches,
            par.shards()
        );
    }
}

/// The error `run` returns after SIGINT / SIGTERM stopped training (checkpoint saved, summary
/// printed): `gdn` exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the
/// shell's code for a command ended by that signal, so a script sees the run did not finish.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: i32,
}

impl Interrupted {
    pub fn exit_code(&self) -> u8 {
        u8::try_from(128 + self.signal).unwrap_or(1)
    }
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "training stopped by {}", signal_name(self.signal))
    }
}

impl std::error::Error for Interrupted {}

fn signal_name(sig: i32) -> &'static str {
    signal_hook::low_level::signal_name(sig).unwrap_or("a signal")
}

/// SIGINT / SIGTERM while training: the first one is recorded (the loop stops at the next step
/// boundary and saves a checkpoint); a second one exits at once with 128 + its number.
struct StopSignals {
    got: Arc<AtomicUsize>,
}

impl StopSignals {
    fn register() -> std::io::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        use signal_hook::flag;
        let got = Arc::new(AtomicUsize::new(0));
        let armed = Arc::new(AtomicBool::new(false));
        let mut ids = Vec::new();
        let mut register = || -> std::io::Result<()> {
            for sig in [SIGINT, SIGTERM] {
                // The shutdown goes first: it sees `armed` only from the second signal on.
                ids.push(flag::register_conditional_shutdown(
                    sig,
                    128 + sig,
                    Arc::clone(&armed),
                )?);
                ids.push(flag::register(sig, Arc::clone(&armed))?);
                ids.push(flag::register_usize(sig, Arc::clone(&got), sig as usize)?);
            }
            Ok(())
        };
        if let Err(e) = register() {
            // all or nothing: a half-registered signal would be caught and never acted on
            for id in ids {
                signal_hook::low_level::unregister(id);
            }
            return Err(e);
        }
        Ok(StopSignals { got })
    }

    /// The signal received, if any.
    fn received(&self) -> Option<i32> {
        match self.got.load(Ordering::SeqCst) {
            0 => None,
            s => i32::try_from(s).ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_is_remaining_steps_at_the_mean_step_time() {
        assert_eq!(
            eta(6, 2, Duration::from_secs(1)),
            Some(Duration::from_secs(3))
        );
        assert_eq!(human_eta(eta(6, 2, Duration::from_secs(1))), "3.0s");
        assert_eq!(human_eta(eta(90, 1, Duration::from_secs(60))), "1h30m");
        assert_eq!(human_eta(eta(90, 1, Duration::from_secs(3600))), "90h00m");
    }

    #[test]
    fn eta_without_a_step_is_unknown() {
        assert_eq!(eta(10, 0, Duration::ZERO), None);
        assert_eq!(human_eta(None), "?");
    }

    #[test]
    fn absurd_etas_do_not_overflow() {
        // 2^64 steps at 10 s each is past Duration::MAX (Duration::from_secs_f64 panicked)
        assert_eq!(
            eta(u64::MAX, 1, Duration::from_secs(10)),
            Some(Duration::MAX)
        );
        // 2^63 steps at 1 ms each fits, and is past a year
        let e = eta(i64::MAX as u64, 1000, Duration::from_secs(1));
        assert!(e.is_some());
        assert_eq!(human_eta(e), "over a year");
        assert_eq!(human_eta(Some(Duration::MAX)), "over a year");
    }
}
