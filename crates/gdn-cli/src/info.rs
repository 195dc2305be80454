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
    println!("cuda: not built in this version");
    println!();
    println!("# default config (GdnConfig::default(), Megatron's defaults)");
    print!("{}", GdnConfig::default().to_toml_string());
    println!();
    println!("# qwen3_next config (GdnConfig::qwen3_next())");
    print!("{}", GdnConfig::qwen3_next().to_toml_string());
    Ok(())
}
