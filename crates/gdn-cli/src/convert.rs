//! `gdn convert`: one GDN layer's weights between layouts (ours, HF Qwen3-Next, HF Qwen3.5,
//! Megatron's distributed-checkpoint keys), bitwise (`gdn::convert`).

use std::path::PathBuf;

use clap::Args;
use gdn::convert::{self, Layout};
use gdn::GdnConfig;

/// Arguments of `gdn convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Layout of IN: gdn, hf-qwen3-next, hf-qwen3.5 or megatron.
    #[arg(long, value_name = "LAYOUT", value_parser = parse_layout)]
    pub from: Layout,
    /// Layout of OUT: gdn, hf-qwen3-next, hf-qwen3.5 or megatron.
    #[arg(long, value_name = "LAYOUT", value_parser = parse_layout)]
    pub to: Layout,
    /// Index N of the layer (keys under `layers.N.`); also the index written. Ours has one
    /// layer per file (no prefix).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub layer: usize,
    /// Layer config (TOML, Megatron's names). Default for an HF folder: its config.json.
    #[arg(long, value_name = "TOML")]
    pub config: Option<PathBuf>,
    /// Overwrite OUT if it exists.
    #[arg(long)]
    pub force: bool,
    /// The checkpoint: a safetensors file, an index file (`*.index.json`), or a folder with
    /// `model.safetensors.index.json` or `*.safetensors`.
    #[arg(value_name = "IN")]
    pub input: PathBuf,
    /// Where to write: a safetensors file (gdn, megatron) or a folder with one shard and
    /// `model.safetensors.index.json` (HF layouts). Written atomically; never replaced without
    /// --force.
    #[arg(value_name = "OUT")]
    pub output: PathBuf,
}

fn parse_layout(s: &str) -> Result<Layout, String> {
    s.parse::<Layout>().map_err(|e| e.to_string())
}

pub fn run(a: ConvertArgs) -> anyhow::Result<()> {
    let cfg = match &a.config {
        Some(p) => GdnConfig::from_toml_file(p)?,
        None => {
            let dir = if a.input.is_dir() {
                a.input.clone()
            } else {
                a.input.parent().map(PathBuf::from).unwrap_or_default()
            };
            let cj = dir.join("config.json");
            if !a.from.is_hf() || !cj.is_file() {
                anyhow::bail!(
                    "--config is needed (only an HF checkpoint folder's config.json can stand in for it)"
                );
            }
            convert::config_from_hf_json(&gdn::io::read_text(&cj)?, &cj)?
        }
    };
    convert::convert(&a.input, a.from, a.to, a.layer, &cfg, &a.output, a.force)?;
    outln!(
        "gdn convert: layer {} {} -> {}: wrote {}",
        a.layer,
        a.from.name(),
        a.to.name(),
        a.output.display()
    );
    Ok(())
}
