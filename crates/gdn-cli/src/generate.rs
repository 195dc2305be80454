//! `gdn generate`: run a trained model (`gdn train` run directory, latest checkpoint) with cached
//! states: prefill the prompt(s), then decode one token at a time (`Model::prefill` /
//! `Model::decode` over a `ModelCache`, the fused decode ops on a GPU).
//!
//! - `--prompt TEXT` (byte-level models): prints the prompt followed by up to `--max-tokens`
//!   sampled bytes (lossy UTF-8);
//! - `--mqar N` (MQAR models): the first N held-out sequences of the run's data (the ones its
//!   held-out evaluation uses), batched: the key-value pairs and the first query are prefilled,
//!   then each later token is decoded (teacher-forced: the true value follows each answer, as
//!   in the trainer's evaluation); an answer is right when the sampled token (arg max unless
//!   `--temperature` > 0) is the query's value. Prints the accuracy and, from metrics.jsonl, the
//!   trainer's held-out accuracy at the checkpoint's step.
//!
//! Both print the prefill and decode throughput (tokens/s, wall time including the logits'
//! download).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use gdn::device::cuda::DType;
use gdn::device::Device;
use gdn::model::Model;
use gdn::train::rundir;
use gdn::train::{DataKind, Dataset};
use gdn::Seqs;

/// Arguments of `gdn generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A `gdn train` run directory (its config.toml and latest checkpoint).
    #[arg(long, value_name = "DIR")]
    pub run: PathBuf,
    /// Prompt of a byte-level model (a run trained with --data).
    #[arg(long, value_name = "TEXT", required_unless_present = "mqar")]
    pub prompt: Option<String>,
    /// Answer the first N held-out sequences of an MQAR run and print the accuracy.
    #[arg(long, value_name = "N", conflicts_with = "prompt",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub mqar: Option<u64>,
    /// Tokens to generate after the prompt (--prompt).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 takes the arg max. Default: 1 for --prompt, 0 for --mqar.
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,
    /// Sample among the K most likely tokens only.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub top_k: Option<u64>,
    /// Seed of the sampler.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Where to run: cpu, or cuda[:N] (the whole model and its cache on the GPU).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// Activation storage on a GPU: f32 (default) or bf16. The CPU computes in f32 only.
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
}

/// splitmix64: a small, seedable, platform-independent generator for the sampler.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The sampler: arg max (first of equals) at temperature 0, else a draw from
/// `softmax(logits / temperature)` over the `top_k` largest logits.
struct Sampler {
    temperature: f64,
    top_k: Option<usize>,
    rng: Rng,
}

impl Sampler {
    fn sample(&mut self, logits: &[f32]) -> u32 {
        let argmax = logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| {
                if x > b.1 {
                    (i, x)
                } else {
                    b
                }
            })
            .0;
        if self.temperature <= 0.0 {
            return argmax as u32;
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        // Largest first; equal logits by index, so the order is deterministic.
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if let Some(k) = self.top_k {
            idx.truncate(k.max(1));
        }
        let m = logits[idx[0]] as f64;
        let w: Vec<f64> = idx
            .iter()
            .map(|&i| ((logits[i] as f64 - m) / self.temperature).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut u = self.rng.unit() * total;
        for (&i, &wi) in idx.iter().zip(&w) {
            if u < wi {
                return i as u32;
            }
            u -= wi;
        }
        idx[idx.len() - 1] as u32
    }
}

fn rate(tokens: usize, secs: f64) -> String {
    if secs <= 0.0 || tokens == 0 {
        return "-".into();
    }
    let r = tokens as f64 / secs;
    if r >= 1e6 {
        format!("{:.2}M", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1}k", r / 1e3)
    } else {
        format!("{r:.1}")
    }
}

fn print_speed(prefill: (usize, f64), decode: (usize, f64), rows: usize) {
    outln!(
        "prefill: {} tokens in {:.1} ms ({} tokens/s)",
        prefill.0,
        prefill.1 * 1e3,
        rate(prefill.0, prefill.1)
    );
    outln!(
        "decode: {} tokens ({} steps x {rows} sequences) in {:.1} ms ({} tokens/s)",
        decode.0,
        decode.0 / rows.max(1),
        decode.1 * 1e3,
        rate(decode.0, decode.1)
    );
}

/// The trainer's held-out accuracy at `step`, from the run's metrics.jsonl (if it has that line).
fn trainer_accuracy(dir: &Path, step: u64) -> Option<(f64, u64)> {
    let text = std::fs::read_to_string(dir.join(rundir::METRICS)).ok()?;
    text.lines().rev().find_map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        if v["kind"].as_str()? == "eval" && v["step"].as_u64()? == step {
            Some((v["accuracy"].as_f64()?, v["targets"].as_u64()?))
        } else {
            None
        }
    })
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let device: Device = args.device.parse()?;
    let dtype = match (args.dtype.as_deref(), device) {
        (None | Some("f32"), _) => DType::F32,
        (Some("bf16"), Device::Cuda(_)) => DType::Bf16,
        (Some("bf16"), Device::Cpu) => {
            bail!("--dtype bf16 needs --device cuda: the CPU path computes in f32 only")
        }
        (Some(o), _) => bail!("--dtype {o:?}: expected f32 or bf16"),
    };
    if let Some(t) = args.temperature {
        if !(t.is_finite() && t >= 0.0) {
            bail!("--temperature {t}: expected a finite number >= 0");
        }
    }
    let dir = &args.run;
    let cfg = rundir::read_config(dir)?;
    match (cfg.data.kind, args.prompt.is_some()) {
        (DataKind::Mqar, true) => bail!(
            "--prompt needs a byte-level model (a run trained with --data FILE); {} is an MQAR run: use --mqar N",
            dir.display()
        ),
        (DataKind::Text, false) => bail!(
            "--mqar needs an MQAR run; {} is a byte-level model: use --prompt TEXT",
            dir.display()
        ),
        _ => {}
    }
    let latest = rundir::load_latest(&dir.join(rundir::CHECKPOINTS))?;
    for (p, e) in &latest.rejected {
        errln!("gdn: note: passed over {} ({e})", p.display());
    }
    let ck = &latest.checkpoint;
    let mut model = Model::with_params(&ck.model, &ck.params)
        .with_context(|| format!("loading {}", latest.path.display()))?;
    if device != Device::Cpu {
        model.to_device(device, dtype)?;
    }
    outln!(
        "model: {} (step {}), {} blocks of {:?}, hidden {}, vocab {}, on {device} ({dtype:?})",
        latest.path.display(),
        ck.step,
        ck.model.num_layers(),
        ck.model.layer.variant,
        ck.model.hidden_size(),
        ck.model.vocab_size
    );
    let mut sampler = Sampler {
        temperature: args
            .temperature
            .unwrap_or(if args.prompt.is_some() { 1.0 } else { 0.0 }),
        top_k: args.top_k.map(|k| k as usize),
        rng: Rng(args.seed),
    };
    match &args.prompt {
        Some(p) => prompt(&model, p, args.max_tokens, &mut sampler),
        None => mqar(
            &model,
            &cfg,
            dir,
            ck.step,
            args.mqar.unwrap_or(1),
            &mut sampler,
        ),
    }
}

fn prompt(model: &Model, text: &str, max_tokens: usize, s: &mut Sampler) -> Result<()> {
    if text.is_empty() {
        bail!("--prompt is empty: give at least one byte to continue");
    }
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let v = model.config().vocab_size;
    let mut cache = model.cache(1)?;
    let t0 = Instant::now();
    let logits = model.prefill(&tokens, &Seqs::uniform(1, tokens.len()), &[0], &mut cache)?;
    let t_prefill = t0.elapsed().as_secs_f64();
    let mut out: Vec<u8> = Vec::with_capacity(max_tokens);
    let mut last = logits;
    let t1 = Instant::now();
    let mut decoded = 0;
    for i in 0..max_tokens {
        let next = s.sample(&last[..v]);
        out.push(next.min(255) as u8);
        if i + 1 < max_tokens {
            last = model.decode(&[next], &[0], &mut cache)?;
            decoded += 1;
        }
    }
    let t_decode = t1.elapsed().as_secs_f64();
    outln!("{text}{}", String::from_utf8_lossy(&out));
    outln!(
        "generated {} bytes (temperature {}, top-k {})",
        out.len(),
        s.temperature,
        s.top_k.map_or("all".into(), |k| k.to_string())
    );
    print_speed((tokens.len(), t_prefill), (decoded, t_decode), 1);
    Ok(())
}

fn mqar(
    model: &Model,
    cfg: &gdn::train::RunConfig,
    dir: &Path,
    step: u64,
    n: u64,
    s: &mut Sampler,
) -> Result<()> {
    let data = Dataset::from_config(&cfg.data)?;
    let avail = data.eval_sequences();
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    if n > avail {
        bail!("--mqar {n}: the run holds {avail} held-out sequences (data.eval_sequences)");
    }
    // The first n held-out sequences: tokens and targets.
    let mut seqs: Vec<(&[u32], &[i32])> = Vec::new();
    for b in data.eval_batches() {
        let t = b.seq_len;
        for i in 0..b.batch {
            if seqs.len() < n {
                seqs.push((
                    &b.tokens[i * t..(i + 1) * t],
                    &b.targets[i * t..(i + 1) * t],
                ));
            }
        }
    }
    let t = seqs[0].0.len();
    // Every MQAR sequence has its targets at the same positions (the query keys).
    let targets_at: Vec<usize> = (0..t).filter(|&p| seqs[0].1[p] >= 0).collect();
    let (first, last) = match (targets_at.first(), targets_at.last()) {
        (Some(&f), Some(&l)) => (f, l),
        _ => bail!("the held-out sequences have no targets"),
    };
    let v = model.config().vocab_size;
    let slots: Vec<i32> = (0..n as i32).collect();
    let mut cache = model.cache(n)?;
    let (mut correct, mut total) = (0usize, 0usize);
    let mut score = |logits: &[f32], p: usize, s: &mut Sampler| {
        for (i, (_, tg)) in seqs.iter().enumerate() {
            if tg[p] >= 0 {
                total += 1;
                if s.sample(&logits[i * v..(i + 1) * v]) == tg[p] as u32 {
                    correct += 1;
                }
            }
        }
    };
    // Prefill: the pairs and the first query key.
    let prompt: Vec<u32> = seqs
        .iter()
        .flat_map(|(tk, _)| tk[..=first].to_vec())
        .collect();
    let t0 = Instant::now();
    let logits = model.prefill(&prompt, &Seqs::uniform(n, first + 1), &slots, &mut cache)?;
    let t_prefill = t0.elapsed().as_secs_f64();
    score(&logits, first, s);
    // Decode: every later token up to the last query key, all sequences at once.
    let t1 = Instant::now();
    for p in first + 1..=last {
        let tok: Vec<u32> = seqs.iter().map(|(tk, _)| tk[p]).collect();
        let logits = model.decode(&tok, &slots, &mut cache)?;
        score(&logits, p, s);
    }
    let t_decode = t1.elapsed().as_secs_f64();
    let acc = correct as f64 / total.max(1) as f64;
    outln!(
        "MQAR: {n} held-out sequences, {} queries each: accuracy {:.2}% ({correct}/{total}){}",
        targets_at.len(),
        100.0 * acc,
        data.chance_accuracy()
            .map_or(String::new(), |c| format!("; chance {:.2}%", 100.0 * c))
    );
    match trainer_accuracy(dir, step) {
        Some((a, targets)) => outln!(
            "trainer's held-out accuracy at step {step}: {:.2}% ({targets} targets, all {avail} held-out sequences)",
            100.0 * a
        ),
        None => outln!("trainer's held-out accuracy at step {step}: not in metrics.jsonl"),
    }
    print_speed((prompt.len(), t_prefill), (n * (last - first), t_decode), n);
    Ok(())
}
