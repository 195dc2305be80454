//! Small test checkpoints in every layout, built from per-head pieces by the published
//! descriptions, not by the converter (`convert::to_layout`), so that tests reading them check
//! the converter against an independent construction:
//!
//! - Hugging Face transformers, `models/qwen3_next/modeling_qwen3_next.py`
//!   (`Qwen3NextGatedDeltaNet.__init__` names and shapes; `fix_query_key_value_ordering`: the
//!   projection output viewed as `[Hk, 2 Dk + 2 R Dv]` and `[Hk, 2 R]` per token, split
//!   `[Dk, Dk, R Dv, R Dv]` and `[R, R]`), and the sharded-checkpoint index
//!   (`model.safetensors.index.json`, `weight_map`);
//! - transformers `models/qwen3_5/modeling_qwen3_5.py` (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
//!   `in_proj_a`, flat);
//! - Megatron-LM `megatron/core/ssm/gated_delta_net.py` (`sharded_state_dict`: `in_proj.weight`
//!   split into `query, key, value, z, beta, alpha`, `conv1d.weight` into `query, key, value`),
//!   as summarized in `reference/megatron-gdn.md` section 2.1.
//!
//! Each checkpoint also holds other layers' tensors (an attention layer, an MLP, a second GDN
//! layer with other values), so that finding the requested layer is tested too.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{write_checkpoint, LayerWeights, Layout, Raw, RawDtype};
use crate::config::{GdnConfig, Normalization, Variant};
use crate::error::{GdnError, Result};

/// A small GDN config with RMSNorm and GVA (`Hv = 2 Hk`), the HF layouts' kind of layer.
pub fn small_config() -> GdnConfig {
    GdnConfig {
        hidden_size: 8,
        num_layers: 2,
        linear_num_key_heads: 2,
        linear_num_value_heads: 4,
        linear_key_head_dim: 4,
        linear_value_head_dim: 3,
        linear_conv_kernel_dim: 4,
        layernorm_epsilon: 1e-6,
        normalization: Normalization::RMSNorm,
        ..GdnConfig::default()
    }
}

/// Per-head pieces of one layer (f32 values exactly representable in the stored dtype).
struct Pieces {
    /// q and k rows per key head `[Dk, h]`.
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    /// v and z rows per value head `[Dv, h]`.
    v: Vec<Vec<f32>>,
    z: Vec<Vec<f32>>,
    /// GDN: beta and alpha row per value head `[h]`; GDN2: f, b `[qk, h]` and w `[v, h]` flat.
    beta: Vec<Vec<f32>>,
    alpha: Vec<Vec<f32>>,
    gdn2: Vec<Vec<f32>>,
    in_norm: Vec<f32>,
    in_norm_b: Option<Vec<f32>>,
    /// conv channels `[q | k | v]`, `W` taps each.
    conv: Vec<f32>,
    conv_b: Option<Vec<f32>>,
    dt_bias: Vec<f32>,
    a_log: Vec<f32>,
    out_norm: Vec<f32>,
    out_norm_b: Option<Vec<f32>>,
    out_proj: Vec<f32>,
}

fn vals(rng: &mut ChaCha8Rng, n: usize, dtype: RawDtype) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x: f32 = rng.gen_range(-0.5..0.5);
            Raw::from_f32(&[1], &[x], dtype)
                .expect("one value")
                .to_f32()[0]
        })
        .collect()
}

fn pieces(cfg: &GdnConfig, seed: u64, dtype: RawDtype) -> Pieces {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let h = cfg.hidden_size;
    let (hk, hv, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let ln = cfg.normalization == Normalization::LayerNorm;
    let (dt, a) = match cfg.variant {
        Variant::Gdn => (hv, hv),
        Variant::Gdn2 => (cfg.qk_dim(), hk),
    };
    Pieces {
        q: (0..hk).map(|_| vals(&mut r, dk * h, dtype)).collect(),
        k: (0..hk).map(|_| vals(&mut r, dk * h, dtype)).collect(),
        v: (0..hv).map(|_| vals(&mut r, dv * h, dtype)).collect(),
        z: (0..hv).map(|_| vals(&mut r, dv * h, dtype)).collect(),
        beta: (0..hv).map(|_| vals(&mut r, h, dtype)).collect(),
        alpha: (0..hv).map(|_| vals(&mut r, h, dtype)).collect(),
        gdn2: vec![
            vals(&mut r, cfg.qk_dim() * h, dtype),
            vals(&mut r, cfg.qk_dim() * h, dtype),
            vals(&mut r, cfg.v_dim() * h, dtype),
        ],
        in_norm: vals(&mut r, h, dtype),
        in_norm_b: ln.then(|| vals(&mut r, h, dtype)),
        conv: vals(&mut r, cfg.conv_dim() * cfg.linear_conv_kernel_dim, dtype),
        conv_b: cfg.conv_bias.then(|| vals(&mut r, cfg.conv_dim(), dtype)),
        dt_bias: vals(&mut r, dt, dtype),
        a_log: vals(&mut r, a, dtype),
        out_norm: vals(&mut r, dv, dtype),
        out_norm_b: ln.then(|| vals(&mut r, dv, dtype)),
        out_proj: vals(&mut r, h * cfg.v_dim(), dtype),
    }
}

fn raw(shape: &[usize], v: &[f32], dtype: RawDtype) -> Raw {
    Raw::from_f32(shape, v, dtype).expect("shape matches by construction")
}

/// Megatron's flat in_proj sections, each as a flat row-major `[rows, h]` buffer, in order.
fn flat_sections(p: &Pieces, cfg: &GdnConfig) -> Vec<(&'static str, Vec<f32>)> {
    let cat = |x: &[Vec<f32>]| x.concat();
    let mut s = vec![
        ("query", cat(&p.q)),
        ("key", cat(&p.k)),
        ("value", cat(&p.v)),
        ("z", cat(&p.z)),
    ];
    match cfg.variant {
        Variant::Gdn => {
            s.push(("beta", cat(&p.beta)));
            s.push(("alpha", cat(&p.alpha)));
        }
        Variant::Gdn2 => {
            s.push(("f", p.gdn2[0].clone()));
            s.push(("b", p.gdn2[1].clone()));
            s.push(("w", p.gdn2[2].clone()));
        }
    }
    s
}

/// Our layout's tensors (Megatron's parameter names, `param_specs` order).
fn ours(p: &Pieces, cfg: &GdnConfig, dt: RawDtype) -> Vec<(String, Raw)> {
    let h = cfg.hidden_size;
    let w = cfg.linear_conv_kernel_dim;
    let inp: Vec<f32> = flat_sections(p, cfg)
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect();
    let mut t = vec![(
        "in_proj.layer_norm_weight".to_string(),
        raw(&[h], &p.in_norm, dt),
    )];
    if let Some(b) = &p.in_norm_b {
        t.push(("in_proj.layer_norm_bias".into(), raw(&[h], b, dt)));
    }
    t.push(("in_proj.weight".into(), raw(&[inp.len() / h, h], &inp, dt)));
    t.push((
        "conv1d.weight".into(),
        raw(&[cfg.conv_dim(), 1, w], &p.conv, dt),
    ));
    if let Some(b) = &p.conv_b {
        t.push(("conv1d.bias".into(), raw(&[cfg.conv_dim()], b, dt)));
    }
    t.push(("dt_bias".into(), raw(&[p.dt_bias.len()], &p.dt_bias, dt)));
    t.push(("A_log".into(), raw(&[p.a_log.len()], &p.a_log, dt)));
    let dv = cfg.linear_value_head_dim;
    t.push(("out_norm.weight".into(), raw(&[dv], &p.out_norm, dt)));
    if let Some(b) = &p.out_norm_b {
        t.push(("out_norm.bias".into(), raw(&[dv], b, dt)));
    }
    t.push((
        "out_proj.weight".into(),
        raw(&[h, cfg.v_dim()], &p.out_proj, dt),
    ));
    t
}

/// The layer's tensors in `layout`, full keys for layer `n`.
fn layer_tensors(
    p: &Pieces,
    cfg: &GdnConfig,
    dt: RawDtype,
    layout: Layout,
    n: usize,
) -> Vec<(String, Raw)> {
    let h = cfg.hidden_size;
    let (hk, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let r = cfg.head_ratio();
    let w = cfg.linear_conv_kernel_dim;
    match layout {
        Layout::Gdn => ours(p, cfg, dt),
        Layout::Megatron => {
            let pre = format!("decoder.layers.{n}.self_attention.");
            let mut t = Vec::new();
            t.push((
                format!("{pre}in_proj.layer_norm_weight"),
                raw(&[h], &p.in_norm, dt),
            ));
            if let Some(b) = &p.in_norm_b {
                t.push((format!("{pre}in_proj.layer_norm_bias"), raw(&[h], b, dt)));
            }
            for (s, v) in flat_sections(p, cfg) {
                t.push((
                    format!("{pre}in_proj.weight.{s}"),
                    raw(&[v.len() / h, h], &v, dt),
                ));
            }
            let (qk, vd) = (cfg.qk_dim(), cfg.v_dim());
            for (s, a, b) in [
                ("query", 0, qk),
                ("key", qk, 2 * qk),
                ("value", 2 * qk, 2 * qk + vd),
            ] {
                t.push((
                    format!("{pre}conv1d.weight.{s}"),
                    raw(&[b - a, 1, w], &p.conv[a * w..b * w], dt),
                ));
                if let Some(cb) = &p.conv_b {
                    t.push((
                        format!("{pre}conv1d.bias.{s}"),
                        raw(&[b - a], &cb[a..b], dt),
                    ));
                }
            }
            t.push((
                format!("{pre}dt_bias"),
                raw(&[p.dt_bias.len()], &p.dt_bias, dt),
            ));
            t.push((format!("{pre}A_log"), raw(&[p.a_log.len()], &p.a_log, dt)));
            t.push((format!("{pre}out_norm.weight"), raw(&[dv], &p.out_norm, dt)));
            if let Some(b) = &p.out_norm_b {
                t.push((format!("{pre}out_norm.bias"), raw(&[dv], b, dt)));
            }
            t.push((
                format!("{pre}out_proj.weight"),
                raw(&[h, cfg.v_dim()], &p.out_proj, dt),
            ));
            t
        }
        Layout::HfQwen3Next | Layout::HfQwen35 => {
            let pre = layout.default_prefix(n);
            let la = format!("{pre}linear_attn.");
            let mut t = vec![(
                format!("{pre}input_layernorm.weight"),
                raw(&[h], &p.in_norm, dt),
            )];
            if layout == Layout::HfQwen3Next {
                // Per key head g: [q_g | k_g | v_(gR..gR+R) | z_(gR..gR+R)]; [b_(g..) | a_(g..)].
                let mut qkvz = Vec::new();
                let mut ba = Vec::new();
                for g in 0..hk {
                    qkvz.extend_from_slice(&p.q[g]);
                    qkvz.extend_from_slice(&p.k[g]);
                    for j in g * r..(g + 1) * r {
                        qkvz.extend_from_slice(&p.v[j]);
                    }
                    for j in g * r..(g + 1) * r {
                        qkvz.extend_from_slice(&p.z[j]);
                    }
                    for j in g * r..(g + 1) * r {
                        ba.extend_from_slice(&p.beta[j]);
                    }
                    for j in g * r..(g + 1) * r {
                        ba.extend_from_slice(&p.alpha[j]);
                    }
                }
                assert_eq!(qkvz.len(), hk * (2 * dk + 2 * r * dv) * h);
                t.push((
                    format!("{la}in_proj_qkvz.weight"),
                    raw(&[qkvz.len() / h, h], &qkvz, dt),
                ));
                t.push((
                    format!("{la}in_proj_ba.weight"),
                    raw(&[ba.len() / h, h], &ba, dt),
                ));
            } else {
                let qkv = [p.q.concat(), p.k.concat(), p.v.concat()].concat();
                let z = p.z.concat();
                let (b, a) = (p.beta.concat(), p.alpha.concat());
                t.push((
                    format!("{la}in_proj_qkv.weight"),
                    raw(&[qkv.len() / h, h], &qkv, dt),
                ));
                t.push((
                    format!("{la}in_proj_z.weight"),
                    raw(&[z.len() / h, h], &z, dt),
                ));
                t.push((
                    format!("{la}in_proj_b.weight"),
                    raw(&[b.len() / h, h], &b, dt),
                ));
                t.push((
                    format!("{la}in_proj_a.weight"),
                    raw(&[a.len() / h, h], &a, dt),
                ));
            }
            t.push((
                format!("{la}conv1d.weight"),
                raw(&[cfg.conv_dim(), 1, w], &p.conv, dt),
            ));
            t.push((
                format!("{la}dt_bias"),
                raw(&[p.dt_bias.len()], &p.dt_bias, dt),
            ));
            t.push((format!("{la}A_log"), raw(&[p.a_log.len()], &p.a_log, dt)));
            t.push((format!("{la}norm.weight"), raw(&[dv], &p.out_norm, dt)));
            t.push((
                format!("{la}out_proj.weight"),
                raw(&[h, cfg.v_dim()], &p.out_proj, dt),
            ));
            t
        }
    }
}

/// Write a test checkpoint of `layout` at `out` (a file, or a folder for the HF layouts with
/// `config.json`, three shards and the index) whose layer `layer` holds weights drawn from
/// `seed` in `dtype`, among other layers' tensors. Returns those weights in our layout, built
/// independently of the converter.
pub fn write(
    out: &Path,
    layout: Layout,
    cfg: &GdnConfig,
    dtype: RawDtype,
    seed: u64,
    layer: usize,
) -> Result<LayerWeights> {
    let p = pieces(cfg, seed, dtype);
    let mut t = layer_tensors(&p, cfg, dtype, layout, layer);
    if layout != Layout::Gdn {
        // Another GDN layer (other values) and non-GDN tensors around it.
        let other = pieces(cfg, seed ^ 0x5eed, dtype);
        t.extend(layer_tensors(&other, cfg, dtype, layout, layer + 1));
        let h = cfg.hidden_size;
        let filler = vals(&mut ChaCha8Rng::seed_from_u64(seed + 7), 16 * h, dtype);
        let extra: Vec<String> = match layout {
            Layout::Megatron => vec![
                "embedding.word_embeddings.weight".into(),
                format!("decoder.layers.{layer}.mlp.linear_fc1.weight"),
                format!(
                    "decoder.layers.{}.self_attention.linear_qkv.weight",
                    layer + 2
                ),
            ],
            _ => {
                let pre = layout.default_prefix(layer);
                let root = pre
                    .trim_end_matches(&format!("layers.{layer}."))
                    .to_string();
                vec![
                    format!("{root}embed_tokens.weight"),
                    format!("{pre}post_attention_layernorm.weight"),
                    format!("{pre}mlp.gate_proj.weight"),
                    format!("{root}layers.{}.self_attn.q_proj.weight", layer + 2),
                ]
            }
        };
        for e in extra {
            t.push((e, raw(&[16, h], &filler, dtype)));
        }
    }
    if layout.is_hf() {
        std::fs::create_dir_all(out).map_err(|e| crate::io::io_err(out, e))?;
        let mut c = serde_json::json!({
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": layer + 3,
            "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads,
            "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
            "rms_norm_eps": cfg.layernorm_epsilon,
        });
        if layout == Layout::HfQwen35 {
            c = serde_json::json!({ "model_type": "qwen3_5", "text_config": c });
        }
        let cp = out.join("config.json");
        crate::io::write_atomic(
            &cp,
            serde_json::to_string_pretty(&c)
                .map_err(|e| GdnError::Invalid(e.to_string()))?
                .as_bytes(),
        )?;
        write_checkpoint(out, layout, &t, 3, true)?;
    } else {
        write_checkpoint(out, layout, &t, 1, true)?;
    }
    Ok(LayerWeights {
        entries: ours(&p, cfg, dtype),
    })
}
