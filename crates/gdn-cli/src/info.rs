//! `gdn info`.

use gdn::GdnConfig;

pub fn run() -> anyhow::Result<()> {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    println!("gdn {}", env!("CARGO_PKG_VERSION"));
    println!(
        "build: {profile} (debug assertions {})",
        if cfg!(debug_assertions) { "on" } else { "off" }
    );
    println!("rayon threads: {}", rayon::current_num_threads());
    println!("devices: cpu");
    use gdn::device::cuda;
    if !cuda::driver_present() {
        println!("cuda: no driver (libcuda.so not found); CPU only");
    } else {
        let n = cuda::device_count();
        println!(
            "cuda: {n} device(s), NVRTC {}",
            match cuda::nvrtc_version().as_str() {
                "" => "not found".to_string(),
                v => v.to_string(),
            }
        );
        for i in 0..n {
            match cuda::gpu(i) {
                Ok(g) => println!("  cuda:{i}: {} (kernels for {})", g.name(), g.arch()),
                Err(e) => println!("  cuda:{i}: unavailable: {e}"),
            }
        }
    }
    println!();
    println!("# default config (GdnConfig::default(), Megatron's defaults)");
    print!("{}", GdnConfig::default().to_toml_string());
    println!();
    println!("# qwen3_next config (GdnConfig::qwen3_next())");
    print!("{}", GdnConfig::qwen3_next().to_toml_string());
    Ok(())
}
