//! `gdn kernels`: compile the CUDA kernels into the on-disk kernel cache ahead of time.

use clap::Args;
use gdn::device::cuda;

/// Arguments of `gdn kernels`.
#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Target architecture (what `gdn info` prints as "kernels for"): sm_80, sm_86, sm_89,
    /// sm_90a (H100 / H200), sm_100, sm_120.
    #[arg(long, value_name = "ARCH", default_value = "sm_90a")]
    pub arch: String,
    /// Compile only this module (repeat for more). Default: every module.
    #[arg(long = "module", value_name = "NAME")]
    pub modules: Vec<String>,
}

pub fn run(args: KernelsArgs) -> anyhow::Result<()> {
    if !cuda::ARCHS.contains(&args.arch.as_str()) {
        anyhow::bail!(
            "--arch {:?}: expected one of {}",
            args.arch,
            cuda::ARCHS.join(", ")
        );
    }
    if cuda::nvrtc_version().is_empty() {
        anyhow::bail!(
            "NVRTC (libnvrtc.so.13) was not found: install CUDA 13.0's NVRTC \
             (e.g. `pip install nvidia-cuda-nvrtc==13.0.88`) and put its lib directory on \
             LD_LIBRARY_PATH"
        );
    }
    let modules: Vec<String> = if args.modules.is_empty() {
        cuda::module_names().iter().map(|m| m.to_string()).collect()
    } else {
        args.modules.clone()
    };
    let (mut compiled, mut cached, mut secs) = (0, 0, 0.0);
    for m in &modules {
        let p = cuda::precompile(m, &args.arch)?;
        if p.cached {
            cached += 1;
            emit!("{:<18} cached       {}", p.module, p.path.display())?;
        } else {
            compiled += 1;
            secs += p.secs;
            emit!(
                "{:<18} {:>6.1} s     {}",
                p.module,
                p.secs,
                p.path.display()
            )?;
        }
    }
    emit!(
        "{} module(s) for {} with NVRTC {}: {compiled} compiled ({secs:.1} s), {cached} already cached",
        modules.len(),
        args.arch,
        cuda::nvrtc_version()
    )?;
    Ok(())
}
