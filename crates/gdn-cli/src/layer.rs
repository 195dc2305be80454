//! `gdn layer`: one layer's forward (and backward) on tensors from safetensors files.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use gdn::io::{self, AnyTensor};
use gdn::{GatedDeltaNet, GdnConfig, Normalization, Params, Seqs, Tensor};

use crate::LayerArgs;

/// `--cu-seqlens 0,5,5,70`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CuSeqlens(pub Vec<u64>);

/// Parse a comma-separated list of non-negative integers. The error names the item and says
/// whether it is empty, negative, out of range (the largest value allowed) or not an integer.
pub fn parse_cu_seqlens(s: &str) -> std::result::Result<CuSeqlens, String> {
    use std::num::IntErrorKind;
    s.split(',')
        .enumerate()
        .map(|(i, item)| {
            let t = item.trim();
            t.parse::<u64>().map_err(|e| {
                let what = match e.kind() {
                    IntErrorKind::Empty => "is empty".to_string(),
                    IntErrorKind::PosOverflow => format!("is out of range (max {})", u64::MAX),
                    _ if t.starts_with('-') && t[1..].parse::<u128>().is_ok() => {
                        "is negative".to_string()
                    }
                    _ => "is not a non-negative integer".to_string(),
                };
                format!("item {i} ({t:?}) {what}; expected e.g. 0,5,5,70")
            })
        })
        .collect::<std::result::Result<Vec<u64>, String>>()
        .map(CuSeqlens)
}

/// One resolved `gdn layer` run.
struct Job {
    config: PathBuf,
    weights: Option<PathBuf>,
    seed: u64,
    input: PathBuf,
    grad_output: Option<PathBuf>,
    output: PathBuf,
    cu_seqlens: Option<Vec<u64>>,
    check_finite: bool,
    device: gdn::Device,
    dtype: Option<String>,
    variant: Option<gdn::Variant>,
    /// Context-parallel size: in-process ranks (threads) on `device`.
    cp: usize,
}

/// The storage type on `device`: f32 on the CPU; bf16 by default on a GPU.
pub fn resolve_dtype(device: gdn::Device, dtype: Option<&str>) -> Result<gdn::device::cuda::DType> {
    use gdn::device::cuda::DType;
    match (device, dtype) {
        (gdn::Device::Cpu, None | Some("f32")) => Ok(DType::F32),
        (gdn::Device::Cpu, Some(d)) => bail!("--dtype {d}: the CPU path computes in f32 only"),
        (gdn::Device::Cuda(_), None | Some("bf16")) => Ok(DType::Bf16),
        (gdn::Device::Cuda(_), Some("f32")) => Ok(DType::F32),
        (_, Some(d)) => bail!("--dtype {d}: expected f32 or bf16"),
    }
}

pub fn run(args: LayerArgs) -> Result<()> {
    if args.force && args.example.is_none() {
        bail!("--force applies only to --example DIR (an --output file is always replaced)");
    }
    if let Some(dir) = args.example {
        let device: gdn::Device = args.device.parse()?;
        // the device, dtype and variant apply to the example too; a GPU that cannot be used is
        // an error before any file is written
        resolve_dtype(device, args.dtype.as_deref())?;
        if let gdn::Device::Cuda(i) = device {
            gdn::device::cuda::gpu(i)?;
        }
        let run = ExampleRun {
            device,
            dtype: args.dtype,
            variant: args.variant,
            cp: args.cp,
        };
        return example(&dir, args.check_finite, args.force, run);
    }
    let missing = |what: &str| anyhow!("gdn layer needs --{what} (or --example DIR)");
    run_job(Job {
        config: args.config.ok_or_else(|| missing("config"))?,
        weights: args.weights,
        seed: args.seed.unwrap_or(0),
        input: args.input.ok_or_else(|| missing("input"))?,
        grad_output: args.grad_output,
        output: args.output.ok_or_else(|| missing("output"))?,
        cu_seqlens: args.cu_seqlens.map(|c| c.0),
        check_finite: args.check_finite,
        device: args.device.parse()?,
        dtype: args.dtype,
        variant: args.variant,
        cp: args.cp,
    })
}

/// Whether `a` and `b` are the same existing file (same device and inode, so `./a` and `a`,
/// symbolic and hard links all count). A path that does not exist is no other file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        #[cfg(unix)]
        (Ok(ma), Ok(mb)) => {
            use std::os::unix::fs::MetadataExt;
            ma.dev() == mb.dev() && ma.ino() == mb.ino()
        }
        #[cfg(not(unix))]
        (Ok(_), Ok(_)) => match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
            (Ok(ca), Ok(cb)) => ca == cb,
            _ => false,
        },
        _ => false,
    }
}

/// Fail early (before any compute) if `output` cannot be a file in an existing directory, or
/// is one of the inputs (`(flag, path)`), which writing it would destroy.
fn check_output_path(output: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    for (flag, input) in inputs {
        if same_file(output, input) {
            bail!(
                "--output {} is the same file as {flag} {}; writing it would destroy the input",
                output.display(),
                input.display()
            );
        }
    }
    if output.is_dir() {
        bail!(
            "--output {} is a directory; give a file path",
            output.display()
        );
    }
    if output.file_name().is_none() {
        bail!("--output {} is not a file path", output.display());
    }
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        bail!(
            "--output {}: directory {} does not exist",
            output.display(),
            parent.display()
        );
    }
    Ok(())
}

fn float(name: &str, t: AnyTensor, path: &Path) -> Result<Tensor> {
    match t {
        AnyTensor::Float(t) => Ok(t),
        AnyTensor::Int(_) => {
            bail!(
                "{}: tensor {name} must be a float tensor (F32, BF16 or F16), found an integer one",
                path.display()
            )
        }
    }
}

fn run_job(job: Job) -> Result<()> {
    let mut cfg = GdnConfig::from_toml_file(&job.config)?;
    if let Some(v) = job.variant {
        cfg.variant = v;
        cfg.validate()?;
    }
    let dtype = resolve_dtype(job.device, job.dtype.as_deref())?;
    let mut inputs: Vec<(&str, &Path)> = vec![("--config", &job.config), ("--input", &job.input)];
    if let Some(w) = &job.weights {
        inputs.push(("--weights", w));
    }
    if let Some(g) = &job.grad_output {
        inputs.push(("--grad-output", g));
    }
    check_output_path(&job.output, &inputs)?;
    let h = cfg.hidden_size;

    // Parameters.
    let (layer, weights_desc) = match &job.weights {
        Some(w) => {
            let p = io::read_params(w, &cfg)?;
            if job.check_finite {
                for (name, t) in p.iter() {
                    t.check_finite(&format!("weight {name}"))
                        .with_context(|| format!("--check-finite: {}", w.display()))?;
                }
            }
            (
                GatedDeltaNet::with_params(&cfg, p)?,
                w.display().to_string(),
            )
        }
        None => (
            GatedDeltaNet::new(&cfg, job.seed)?,
            format!("Megatron init, seed {}", job.seed),
        ),
    };
    let layer = layer.to_device(job.device, dtype)?;

    // Inputs.
    let (mut x, mut dy, mut cu_file) = (None, None, None);
    for (name, t) in io::read_any(&job.input)? {
        match name.as_str() {
            "x" => x = Some(float("x", t, &job.input)?),
            "dy" => dy = Some(float("dy", t, &job.input)?),
            "cu_seqlens" => match t {
                AnyTensor::Int(it) => cu_file = Some(it.to_u64_1d("cu_seqlens", &job.input)?),
                AnyTensor::Float(_) => bail!(
                    "{}: tensor cu_seqlens must be an integer tensor (I64 or I32), found a float one",
                    job.input.display()
                ),
            },
            other => bail!(
                "{}: unexpected tensor {other}; an input file holds x, and optionally dy and cu_seqlens",
                job.input.display()
            ),
        }
    }
    let x = x.ok_or_else(|| {
        anyhow!(
            "{}: no tensor named x (the layer input, [B, T, {h}])",
            job.input.display()
        )
    })?;
    if let Some(g) = &job.grad_output {
        if dy.is_some() {
            bail!(
                "dy is given twice: in {} and in --grad-output {}",
                job.input.display(),
                g.display()
            );
        }
        for (name, t) in io::read_tensors(g)? {
            if name != "dy" {
                bail!(
                    "{}: unexpected tensor {name}; a --grad-output file holds only dy",
                    g.display()
                );
            }
            dy = Some(t);
        }
        if dy.is_none() {
            bail!(
                "{}: no tensor named dy (the gradient of y, shape of x)",
                g.display()
            );
        }
    }
    let cu = match (job.cu_seqlens, cu_file) {
        (Some(_), Some(_)) => bail!(
            "cu_seqlens is given twice: by --cu-seqlens and in {}",
            job.input.display()
        ),
        (a, b) => a.or(b),
    };

    // Shapes.
    let xs = x.shape().to_vec();
    if xs.len() == 3 && (xs[0] == 0 || xs[1] == 0) {
        // (an empty batch may still name 2^40 sequences: refused before anything is sized by it)
        bail!("x has shape {xs:?}: no tokens; expected [B, T, {h}] with B >= 1 and T >= 1");
    }
    let seqs = match &cu {
        None => {
            if xs.len() != 3 || xs[2] != h {
                bail!("x has shape {xs:?}, expected [B, T, {h}] (hidden_size = {h})");
            }
            None
        }
        Some(cu) => {
            if xs.len() != 3 || xs[0] != 1 || xs[2] != h {
                bail!(
                    "x has shape {xs:?}, expected [1, T, {h}] with cu_seqlens (packed sequences; hidden_size = {h})"
                );
            }
            Some(Seqs::packed(cu, xs[1])?)
        }
    };
    if job.device == gdn::Device::Cpu {
        let tokens = xs[0].saturating_mul(xs[1]);
        gdn::budget::check_host(
            &format!("the forward over x {xs:?}"),
            cfg.forward_bytes_at_least(tokens),
        )?;
    }
    if let Some(dy) = &dy {
        if dy.shape() != xs.as_slice() {
            bail!(
                "dy has shape {:?}, expected the shape of x {xs:?}",
                dy.shape()
            );
        }
    }
    if job.check_finite {
        x.check_finite("x")?;
        if let Some(dy) = &dy {
            dy.check_finite("dy")?;
        }
    }

    // Forward, backward.
    if job.cp == 0 {
        bail!("--cp 0: the context-parallel size is at least 1");
    }
    let t0 = Instant::now();
    let (y, saved_bytes, t_fwd, back) = if job.cp > 1 {
        let all = match &seqs {
            None => Seqs::uniform(xs[0], xs[1]),
            Some(s) => s.clone(),
        };
        let r = run_cp(&layer, job.cp, &x, dy.as_ref(), &all)?;
        (r.y, r.saved_bytes, r.t_fwd, r.back)
    } else {
        let (y, saved) = match &seqs {
            None => layer.forward(&x)?,
            Some(s) => layer.forward_packed(&x, s)?,
        };
        let t_fwd = t0.elapsed();
        let saved_bytes = saved.bytes();
        let back = match &dy {
            Some(dy) => {
                let t1 = Instant::now();
                let (dx, grads) = layer.backward(saved, dy)?;
                Some((dx, grads, t1.elapsed()))
            }
            None => {
                let _freed_now = saved;
                None
            }
        };
        (y, saved_bytes, t_fwd, back)
    };
    let mut out: Vec<(&str, &Tensor)> = vec![("y", &y)];
    if let Some((dx, grads, _)) = &back {
        out.push(("dx", dx));
        out.extend(grads.iter());
    }
    io::write_tensors(&job.output, &out)?;

    let seq_desc = match &seqs {
        None => format!("{} seqs of {}", xs[0], xs[1]),
        Some(s) => format!("{} packed seqs", s.count()),
    };
    let cp_desc = if job.cp > 1 {
        format!(
            "; cp {} (in-process ranks; saved bytes: the largest rank's)",
            job.cp
        )
    } else {
        String::new()
    };
    let mut line = format!(
        "gdn layer: x {xs:?} ({seq_desc}{cp_desc}) -> y {:?}; weights: {weights_desc}; saved {saved_bytes} bytes ({:.2} MiB); forward {:.1} ms",
        y.shape(),
        saved_bytes as f64 / (1024.0 * 1024.0),
        t_fwd.as_secs_f64() * 1e3,
    );
    if let Some((dx, _, t_bwd)) = &back {
        line.push_str(&format!(
            ", backward {:.1} ms (dx {:?})",
            t_bwd.as_secs_f64() * 1e3,
            dx.shape()
        ));
    }
    line.push_str(&format!(
        "; wrote {} tensors to {}",
        out.len(),
        job.output.display()
    ));
    errln!("{line}");
    Ok(())
}

/// What a context-parallel run returns, in natural token order.
struct CpRun {
    y: Tensor,
    saved_bytes: usize,
    t_fwd: std::time::Duration,
    back: Option<(Tensor, gdn::Grads, std::time::Duration)>,
}

/// `--cp N`: the layer on N in-process ranks (threads, on the layer's device), each holding its
/// zigzag share of every sequence (`gdn::dist::cp::local_rows`); `y` and `dx` are put back in
/// natural order, the gradients are rank 0's (every rank's are the same bits).
fn run_cp(
    layer: &GatedDeltaNet,
    cp: usize,
    x: &Tensor,
    dy: Option<&Tensor>,
    seqs: &Seqs,
) -> Result<CpRun> {
    use gdn::dist::cp::local_rows;
    let h = layer.config().hidden_size;
    gdn::dist::cp::check_seqs(seqs, cp)?;
    let pick = |v: &[f32], rows: &[std::ops::Range<usize>]| -> Vec<f32> {
        rows.iter()
            .flat_map(|r| v[r.start * h..r.end * h].iter().copied())
            .collect()
    };
    let nl = seqs.tokens() / cp;
    let outs = gdn::dist::run_ranks(cp, |comm| {
        let rows = local_rows(seqs, cp, comm.rank());
        let cl = gdn::layer::CpLayer::new(layer.clone(), comm)?;
        let xl = Tensor::from_vec(&[nl, h], pick(x.data(), &rows))?;
        let t0 = Instant::now();
        let (y, saved) = cl.forward(&xl, seqs)?;
        let t_fwd = t0.elapsed();
        let bytes = saved.bytes();
        let back = match dy {
            Some(dy) => {
                let dyl = Tensor::from_vec(&[nl, h], pick(dy.data(), &rows))?;
                let t1 = Instant::now();
                let (dx, g) = cl.backward(saved, &dyl)?;
                Some((dx, g, t1.elapsed()))
            }
            None => None,
        };
        Ok((rows, y, bytes, t_fwd, back))
    })?;
    let n = seqs.tokens();
    let mut y = vec![0.0f32; n * h];
    let mut dx = vec![0.0f32; n * h];
    let place = |out: &mut [f32], rows: &[std::ops::Range<usize>], local: &[f32]| {
        let mut k = 0;
        for r in rows {
            let len = r.len() * h;
            out[r.start * h..r.end * h].copy_from_slice(&local[k..k + len]);
            k += len;
        }
    };
    let mut saved_bytes = 0;
    let mut t_fwd = std::time::Duration::ZERO;
    let mut t_bwd = std::time::Duration::ZERO;
    let mut grads = None;
    for (rows, yl, bytes, tf, back) in outs {
        place(&mut y, &rows, yl.data());
        saved_bytes = saved_bytes.max(bytes);
        t_fwd = t_fwd.max(tf);
        if let Some((dxl, g, tb)) = back {
            place(&mut dx, &rows, dxl.data());
            t_bwd = t_bwd.max(tb);
            grads.get_or_insert(g);
        }
    }
    let back = match grads {
        Some(g) => Some((Tensor::from_vec(x.shape(), dx)?, g, t_bwd)),
        None => None,
    };
    Ok(CpRun {
        y: Tensor::from_vec(x.shape(), y)?,
        saved_bytes,
        t_fwd,
        back,
    })
}

/// Deterministic standard normals (SplitMix64 + Box-Muller), so the example needs no RNG crate.
struct Normals(u64);

impl Normals {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
    fn tensor(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|_| {
                let (u1, u2) = (self.uniform(), self.uniform());
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect();
        Tensor::from_vec(shape, data).expect("length matches shape")
    }
}

/// The built-in example's config: hidden 64, 2 key / 4 value heads, Dk = Dv = 16, RMSNorm.
pub fn example_config() -> GdnConfig {
    GdnConfig {
        hidden_size: 64,
        linear_num_key_heads: 2,
        linear_num_value_heads: 4,
        linear_key_head_dim: 16,
        linear_value_head_dim: 16,
        normalization: Normalization::RMSNorm,
        ..GdnConfig::default()
    }
}

/// The files `gdn layer --example DIR` writes into DIR.
pub const EXAMPLE_FILES: [&str; 5] = [
    "config.toml",
    "weights.safetensors",
    "input.safetensors",
    "dy.safetensors",
    "out.safetensors",
];

/// `gdn layer --example DIR`: write config.toml, weights.safetensors, input.safetensors (x) and
/// dy.safetensors into DIR, then run forward + backward on them into DIR/out.safetensors.
/// Files of those names already in DIR are an error naming them, unless `force`.
/// Where and how `--example` runs its layer: the flags given with it.
struct ExampleRun {
    device: gdn::Device,
    dtype: Option<String>,
    variant: Option<gdn::Variant>,
    cp: usize,
}

fn example(dir: &Path, check_finite: bool, force: bool, run: ExampleRun) -> Result<()> {
    let [config, weights, input, grad, output] = EXAMPLE_FILES.map(|f| dir.join(f));
    if !force {
        // symlink_metadata: a dangling symbolic link is something of the user's too
        let existing: Vec<String> = [&config, &weights, &input, &grad, &output]
            .into_iter()
            .filter(|p| std::fs::symlink_metadata(p).is_ok())
            .map(|p| p.display().to_string())
            .collect();
        if !existing.is_empty() {
            bail!(
                "--example {}: {} already exist{}; pass --force to overwrite, or choose another directory",
                dir.display(),
                existing.join(", "),
                if existing.len() == 1 { "s" } else { "" }
            );
        }
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create directory {}", dir.display()))?;
    let mut cfg = example_config();
    if let Some(v) = run.variant {
        // written into config.toml (the weights follow the variant's parameter shapes)
        cfg.variant = v;
    }
    cfg.validate()?;

    let text = format!(
        "# gdn layer --example: hidden 64, 2 key / 4 value heads, Dk = Dv = 16, RMSNorm\n{}",
        cfg.to_toml_string()
    );
    io::write_atomic(&config, text.as_bytes())?;

    let params = Params::init(&cfg, 0)?;
    io::write_tensors(&weights, &params.iter().collect::<Vec<_>>())?;
    let mut rng = Normals(42);
    let x = rng.tensor(&[2, 100, cfg.hidden_size]);
    let dy = rng.tensor(&[2, 100, cfg.hidden_size]);
    io::write_tensors(&input, &[("x", &x)])?;
    io::write_tensors(&grad, &[("dy", &dy)])?;

    let mut flags = String::new();
    if run.device != gdn::Device::Cpu {
        flags.push_str(&format!(" --device {}", run.device));
    }
    if let Some(d) = &run.dtype {
        flags.push_str(&format!(" --dtype {d}"));
    }
    errln!(
        "gdn layer --example: wrote {} ; running:\n  gdn layer --config {} --weights {} --input {} --grad-output {} --output {}{flags}",
        dir.display(),
        config.display(),
        weights.display(),
        input.display(),
        grad.display(),
        output.display()
    );
    run_job(Job {
        config,
        weights: Some(weights),
        seed: 0,
        input,
        grad_output: Some(grad),
        output,
        cu_seqlens: None,
        check_finite,
        device: run.device,
        dtype: run.dtype,
        variant: None,
        cp: run.cp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_parsing() {
        assert_eq!(
            parse_cu_seqlens("0,5,5,70").unwrap(),
            CuSeqlens(vec![0, 5, 5, 70])
        );
        assert_eq!(parse_cu_seqlens(" 0, 3 ").unwrap(), CuSeqlens(vec![0, 3]));
        for bad in ["", "0,,5", "0,-1", "0,x", "0;5", "1.5"] {
            assert!(parse_cu_seqlens(bad).is_err(), "{bad:?}");
        }
        let msg = |s: &str| parse_cu_seqlens(s).unwrap_err();
        let e = msg("0,99999999999999999999");
        assert!(
            e.contains("item 1") && e.contains("out of range (max 18446744073709551615)"),
            "{e}"
        );
        assert_eq!(
            parse_cu_seqlens("0,18446744073709551615").unwrap(),
            CuSeqlens(vec![0, u64::MAX])
        );
        let e = msg("0,-3");
        assert!(e.contains("item 1") && e.contains("is negative"), "{e}");
        let e = msg("0,-99999999999999999999");
        assert!(e.contains("is negative"), "{e}");
        let e = msg("0,,5");
        assert!(e.contains("item 1") && e.contains("is empty"), "{e}");
        let e = msg("0,1.5");
        assert!(e.contains("is not a non-negative integer"), "{e}");
    }

    #[test]
    fn example_config_is_valid() {
        example_config().validate().unwrap();
        let back = GdnConfig::from_toml_str(&example_config().to_toml_string()).unwrap();
        assert_eq!(back, example_config());
    }

    #[test]
    fn normals_are_deterministic_and_standard() {
        let a = Normals(42).tensor(&[10000]);
        assert_eq!(a, Normals(42).tensor(&[10000]));
        let n = a.numel() as f64;
        let mean = a.data().iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = a
            .data()
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
    }
}
