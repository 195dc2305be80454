//! `gdn info`.

use gdn::GdnConfig;

pub fn run() -> anyhow::Result<()> {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    emit!("gdn {}", env!("CARGO_PKG_VERSION"))?;
    emit!(
        "build: {profile} (debug assertions {})",
        if cfg!(debug_assertions) { "on" } else { "off" }
    )?;
    emit!("rayon threads: {}", rayon::current_num_threads())?;
    emit!("devices: cpu")?;
    use gdn::device::cuda;
    if !cuda::driver_present() {
        emit!("cuda: no driver (libcuda.so not found); CPU only")?;
    } else {
        let n = cuda::device_count();
        emit!(
            "cuda: {n} device(s), NVRTC {}",
            match cuda::nvrtc_version().as_str() {
                "" => "not found".to_string(),
                v => v.to_string(),
            }
        )?;
        for i in 0..n {
            match cuda::gpu(i) {
                Ok(g) => emit!("  cuda:{i}: {} (kernels for {})", g.name(), g.arch())?,
                Err(e) => emit!("  cuda:{i}: unavailable: {e}")?,
            }
        }
    }
    emit!()?;
    emit!("# default config (GdnConfig::default(), Megatron's defaults)")?;
    crate::emit_out(format_args!("{}", GdnConfig::default().to_toml_string()))?;
    emit!()?;
    emit!("# qwen3_next config (GdnConfig::qwen3_next())")?;
    crate::emit_out(format_args!("{}", GdnConfig::qwen3_next().to_toml_string()))?;
    Ok(())
}
