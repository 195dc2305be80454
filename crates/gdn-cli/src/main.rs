//! `gdn`: the command-line front end of the `gdn` library.
//!
//! - `gdn layer`: forward (and backward) of one Gated DeltaNet layer on tensors from
//!   safetensors files; `gdn layer --example DIR` writes and runs a small built-in example.
//! - `gdn memory`: activation memory kept for backward per recompute setting (measured from
//!   `Saved::bytes()`), optionally with each setting's forward + backward time.
//! - `gdn train`: train a small GDN language model end to end (MQAR by default, or byte-level
//!   text), with held-out metrics, checkpoints, resume and a plot of the curves.
//! - `gdn generate`: run a trained model with cached states (a prompt, or MQAR answers).
//! - `gdn info`: version, build, threads, devices and the default configs.
//! - `gdn kernels`: compile the CUDA kernels into the kernel cache ahead of time (no GPU needed).
//!
//! Output never kills a command: [`outln!`] and [`errln!`] write to stdout / stderr and, when a
//! stream fails (closed pipe, full device), turn that stream off with one note on the other.
//! Training goes on and saves its checkpoints. Commands whose printed output is their product
//! (`gdn info`, `gdn memory`) print through [`emit!`] instead: a failed write ends them with a
//! `gdn: error:` line. No command uses `println!` (it panics on a failed write).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// `println!` that never fails: see [`write_out`].
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that never fails: see [`write_err`].
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::write_err(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `println!` for a command whose printed output is its product (`gdn info`, `gdn memory`): a
/// failed write (closed pipe, full device) is an error, returned for `?`, so the command ends with
/// a `gdn: error:` line and a non-zero exit.
macro_rules! emit {
    () => {
        $crate::emit_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::emit_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod bench;
mod convert;
mod generate;
mod info;
mod kernels;
mod launch;
mod layer;
mod memory;
mod plot;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "gdn",
    version,
    about = "Gated DeltaNet (GDN / GDN2) layers: forward and backward"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Train a small GDN language model end to end (the main job).
    ///
    /// Default: a 2-block GDN model on MQAR (multi-query associative recall) generated from a
    /// seed, no download; a few minutes on a 2-core CPU. `--data FILE` trains a byte-level
    /// model on a text file instead. Writes metrics.jsonl, checkpoints and (with --plot)
    /// curves.png into the run directory.
    ///
    /// Ctrl-C (SIGINT) or SIGTERM: the step under way finishes, its metrics and a checkpoint
    /// are written, and gdn exits with 130 (SIGINT) or 143 (SIGTERM), the shell's codes for a
    /// command ended by those signals, so that a script sees the run is not finished; continue it
    /// with `gdn train --resume DIR`. A second signal exits at once, without saving. Output that
    /// cannot be written (a closed pipe, a full device) is dropped; training goes on.
    Train(train::TrainArgs),
    /// Run one layer's forward (and, given dy, backward) on tensors from safetensors files.
    ///
    /// The input file holds `x` [B, T, hidden] (F32, BF16 or F16), optionally `dy` (same shape)
    /// and optionally `cu_seqlens` (I64 or I32, 1-D). The output file holds `y`, and with dy
    /// also `dx` and every parameter gradient under the parameter's own name.
    Layer(LayerArgs),
    /// Activation memory per recompute setting, measured from `Saved::bytes()` of a real forward.
    ///
    /// Prints one row per setting (keep_rule_inputs, Megatron's default, with and without the
    /// in-kernel q/k L2 norm; none, the default: the rule's inputs rebuilt in backward; the
    /// in-kernel L2 norm, gdn_norm_out, their combination; gdn, full): bytes kept per token, MiB
    /// for --tokens tokens and the share of `none`; with --time also forward + backward time and
    /// its ratio to `none`.
    Memory(memory::MemoryArgs),
    /// Time the layer (and the gated delta rule alone) forward and forward + backward.
    ///
    /// Per `--shape BxT`: host wall time and, on CUDA, GPU time from events (median, min, max),
    /// kept bytes per token, the allocator's peak, the split of the step by stage, and with
    /// --fla-json the ratio to FLA's layer on the same shapes.
    Bench(bench::BenchArgs),
    /// Generate with a trained model and cached states (prefill, then one token at a time).
    ///
    /// `--run DIR` (a `gdn train` run directory, its latest checkpoint) with `--prompt TEXT`
    /// (byte-level models: prints the continuation) or `--mqar N` (the first N held-out MQAR
    /// sequences: prints the accuracy of the decoded answers next to the trainer's). Prints
    /// prefill and decode tokens/s.
    Generate(generate::GenerateArgs),
    /// Convert one GDN layer's weights between layouts: gdn (ours), hf-qwen3-next, hf-qwen3.5,
    /// megatron (distributed-checkpoint keys). Bitwise: values are moved, never recomputed.
    Convert(convert::ConvertArgs),
    /// Print version, build, threads, devices and the default configs.
    Info,
    /// Compile the CUDA kernels with NVRTC into the kernel cache, with no GPU needed.
    ///
    /// The cache is $GDN_KERNEL_CACHE, else $XDG_CACHE_HOME/gdn/kernels or ~/.cache/gdn/kernels;
    /// a GPU run with the same NVRTC version reads it instead of compiling at first use (for
    /// container images, offline machines, and short GPU sessions).
    Kernels(kernels::KernelsArgs),
    /// Start N ranks of a gdn command on this machine, as torchrun does (one process per GPU).
    ///
    /// Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    /// and NCCL_NVLS_ENABLE=0; rank i uses cuda:i. Output is forwarded with a `[rank i]` prefix.
    /// If a rank fails the others are stopped and gdn launch exits with its status. The same
    /// commands run under torchrun or Slurm (which set those variables themselves).
    Launch(launch::LaunchArgs),
}

/// Arguments of `gdn layer`.
#[derive(Args, Debug)]
pub struct LayerArgs {
    /// Write a small built-in example (config, weights, x, dy) into DIR and run it,
    /// writing DIR/out.safetensors.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with_all = ["config", "weights", "input", "grad_output", "output", "cu_seqlens", "seed"]
    )]
    pub example: Option<PathBuf>,
    /// Layer config (TOML; Megatron's field names; unknown keys are an error).
    #[arg(long, value_name = "TOML", required_unless_present = "example")]
    pub config: Option<PathBuf>,
    /// Parameters (safetensors, Megatron's names). Without it: Megatron's init from --seed.
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Input tensors: `x`, optionally `dy` and `cu_seqlens`.
    #[arg(long, value_name = "FILE", required_unless_present = "example")]
    pub input: Option<PathBuf>,
    /// A file holding `dy` (the gradient of the output); runs backward.
    #[arg(long, value_name = "FILE")]
    pub grad_output: Option<PathBuf>,
    /// Where to write `y` (and `dx`, parameter gradients). Written atomically.
    #[arg(long, value_name = "FILE", required_unless_present = "example")]
    pub output: Option<PathBuf>,
    /// Packed sequence boundaries, e.g. `0,5,5,70` (x must then be [1, T, hidden]).
    #[arg(long, value_name = "LIST", value_parser = layer::parse_cu_seqlens)]
    pub cu_seqlens: Option<layer::CuSeqlens>,
    /// Fail if x, dy or a weight holds NaN or infinity.
    #[arg(long)]
    pub check_finite: bool,
    /// With --example: overwrite the example's files if DIR already has them.
    #[arg(long)]
    pub force: bool,
    /// Seed of Megatron's init when --weights is not given.
    #[arg(long, value_name = "N", conflicts_with = "weights")]
    pub seed: Option<u64>,
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// Storage type on the device: f32, or bf16 (GPU only; the GPU's default).
    #[arg(long, value_name = "TYPE")]
    pub dtype: Option<String>,
    /// Layer variant, overriding the config's `variant`: gdn or gdn2.
    #[arg(long, value_name = "VARIANT", value_parser = parse_variant)]
    pub variant: Option<gdn::Variant>,
    /// Context parallelism over N in-process ranks (threads on --device): each holds its zigzag
    /// share of every sequence (lengths divisible by 2 N; heads divisible by N); y, dx and the
    /// gradients are written as one rank would (up to f32 rounding of the row sums).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub cp: usize,
}

fn parse_variant(s: &str) -> std::result::Result<gdn::Variant, String> {
    match s {
        "gdn" | "gated_delta_net" => Ok(gdn::Variant::Gdn),
        "gdn2" => Ok(gdn::Variant::Gdn2),
        _ => Err(format!("unknown variant {s:?}: expected gdn or gdn2")),
    }
}

/// Whether stdout / stderr still take output (false after their first failed write).
static STDOUT_ON: AtomicBool = AtomicBool::new(true);
static STDERR_ON: AtomicBool = AtomicBool::new(true);

/// Write to stdout (through [`outln!`]). A failed write (closed pipe, full device) turns stdout
/// off for the rest of the process and leaves one note on stderr; nothing is returned to fail on.
pub fn write_out(args: std::fmt::Arguments) {
    let failed = write_to(&mut std::io::stdout().lock(), &STDOUT_ON, args);
    if let Some(e) = failed {
        note(&mut std::io::stderr().lock(), &STDERR_ON, "stdout", &e);
    }
}

/// Write to stderr (through [`errln!`]). A failed write turns stderr off for the rest of the
/// process and leaves one note on stdout.
pub fn write_err(args: std::fmt::Arguments) {
    let failed = write_to(&mut std::io::stderr().lock(), &STDERR_ON, args);
    if let Some(e) = failed {
        note(&mut std::io::stdout().lock(), &STDOUT_ON, "stderr", &e);
    }
}

/// The one note on the other stream when `stream` fails (silent if that one fails too).
fn note(w: &mut dyn Write, on: &AtomicBool, stream: &str, e: &std::io::Error) {
    let _ = write_to(
        w,
        on,
        format_args!(
            "gdn: note: cannot write to {stream} ({e}); its further output is dropped, the command goes on\n"
        ),
    );
}

/// Write `args` to `w` and flush it while `on`. The first failure turns `on` off and is returned
/// (later calls write nothing and return None).
fn write_to(
    w: &mut dyn Write,
    on: &AtomicBool,
    args: std::fmt::Arguments,
) -> Option<std::io::Error> {
    if !on.load(Ordering::Relaxed) {
        return None;
    }
    match w.write_fmt(args).and_then(|()| w.flush()) {
        Ok(()) => None,
        Err(e) => on.swap(false, Ordering::Relaxed).then_some(e),
    }
}

/// Write to stdout (through [`emit!`]); a failed write is an error naming stdout.
pub fn emit_out(args: std::fmt::Arguments) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("cannot write to stdout: {e}"))
}

/// The error and its causes, each once (library errors already quote their source).
fn report(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if msg.contains(&s) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&s);
    }
    msg
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Train(args) => train::run(args),
        Cmd::Layer(args) => layer::run(args),
        Cmd::Memory(args) => memory::run(args),
        Cmd::Bench(args) => bench::run(args),
        Cmd::Generate(args) => generate::run(args),
        Cmd::Convert(args) => convert::run(args),
        Cmd::Info => info::run(),
        Cmd::Kernels(args) => kernels::run(args),
        Cmd::Launch(args) => launch::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<train::Interrupted>() {
            // the summary already said where the run stopped and how to continue it
            Some(i) => ExitCode::from(i.exit_code()),
            None if e.downcast_ref::<launch::ChildFailed>().is_some() => {
                let c = e
                    .downcast_ref::<launch::ChildFailed>()
                    .map_or(1, |c| c.code);
                errln!("gdn launch: {}", report(&e));
                ExitCode::from(c)
            }
            None => {
                errln!("gdn: error: {}", report(&e));
                ExitCode::FAILURE
            }
        },
    }
}
