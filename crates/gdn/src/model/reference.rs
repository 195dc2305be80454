//! The whole model in f64, written from the math with plain loops (tests only). The GDN layers
//! are the layer's own f64 reference (`crate::layer::reference`); everything else (embedding,
//! norms, SwiGLU MLP, head, cross-entropy) is written out here, independent of the f32 code.

use crate::config::Normalization;
use crate::layer::reference::{self as layer_ref, RefParams};
use crate::model::{ModelConfig, EMBEDDING, IGNORE_INDEX, OUTPUT_LAYER};
use crate::seqs::Seqs;

/// f64 parameters by full name.
pub type RefModelParams = Vec<(String, Vec<f64>)>;

/// From f32 parameters.
pub fn from_params(p: &crate::layer::Params) -> RefModelParams {
    p.iter()
        .map(|(n, t)| (n.to_string(), t.data().iter().map(|&x| x as f64).collect()))
        .collect()
}

fn get<'a>(p: &'a RefModelParams, name: &str) -> Option<&'a [f64]> {
    p.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
}

fn d<'a>(p: &'a RefModelParams, name: &str) -> &'a [f64] {
    get(p, name).unwrap_or_else(|| panic!("missing {name}"))
}

fn norm(cfg: &ModelConfig, x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
    let h = cfg.hidden_size();
    let eps = cfg.layer.layernorm_epsilon as f64;
    let zc = cfg.layer.layernorm_zero_centered_gamma;
    let mut y = vec![0.0; x.len()];
    for (r, yr) in x.chunks(h).zip(y.chunks_mut(h)) {
        let mean = match cfg.layer.normalization {
            Normalization::LayerNorm => r.iter().sum::<f64>() / h as f64,
            Normalization::RMSNorm => 0.0,
        };
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / h as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for i in 0..h {
            let g = if zc { 1.0 + w[i] } else { w[i] };
            yr[i] = (r[i] - mean) * rstd * g + b.map_or(0.0, |b| b[i]);
        }
    }
    y
}

/// `y = x W^T`, `W` `[out, in]`.
fn linear(x: &[f64], inp: usize, w: &[f64], out: usize) -> Vec<f64> {
    let rows = x.len() / inp;
    let mut y = vec![0.0; rows * out];
    for r in 0..rows {
        for o in 0..out {
            y[r * out + o] = (0..inp).map(|i| x[r * inp + i] * w[o * inp + i]).sum();
        }
    }
    y
}

/// Mean cross-entropy over the target rows of a batch of `b` sequences of `t` tokens.
pub fn loss(
    cfg: &ModelConfig,
    p: &RefModelParams,
    tokens: &[u32],
    targets: &[i32],
    b: usize,
    t: usize,
) -> f64 {
    let (h, f, vsz) = (cfg.hidden_size(), cfg.ffn_hidden_size, cfg.vocab_size);
    let n = b * t;
    let e = d(p, EMBEDDING);
    let mut x: Vec<f64> = tokens
        .iter()
        .flat_map(|&tok| e[tok as usize * h..(tok as usize + 1) * h].to_vec())
        .collect();
    let cu = Seqs::uniform(b, t).cu().to_vec();
    for i in 0..cfg.num_layers() {
        let pre = format!("decoder.layers.{i}.self_attention.");
        let lp = RefParams(
            p.iter()
                .filter_map(|(nm, v)| nm.strip_prefix(&pre).map(|s| (s.to_string(), v.clone())))
                .collect(),
        );
        let y = layer_ref::forward(&cfg.layer, &lp, &x, &cu);
        for (a, yv) in x.iter_mut().zip(&y) {
            *a += yv;
        }
        let m = format!("decoder.layers.{i}.mlp.");
        let hn = norm(
            cfg,
            &x,
            d(p, &format!("{m}linear_fc1.layer_norm_weight")),
            get(p, &format!("{m}linear_fc1.layer_norm_bias")),
        );
        let u = linear(&hn, h, d(p, &format!("{m}linear_fc1.weight")), 2 * f);
        let mut a = vec![0.0; n * f];
        for r in 0..n {
            for j in 0..f {
                let g = u[r * 2 * f + j];
                let up = u[r * 2 * f + f + j];
                a[r * f + j] = g / (1.0 + (-g).exp()) * up;
            }
        }
        let o = linear(&a, f, d(p, &format!("{m}linear_fc2.weight")), h);
        for (a, ov) in x.iter_mut().zip(&o) {
            *a += ov;
        }
    }
    let xf = norm(
        cfg,
        &x,
        d(p, "decoder.final_layernorm.weight"),
        get(p, "decoder.final_layernorm.bias"),
    );
    let w = if cfg.share_embeddings_and_output_weights {
        d(p, EMBEDDING)
    } else {
        d(p, OUTPUT_LAYER)
    };
    let logits = linear(&xf, h, w, vsz);
    let (mut sum, mut count) = (0.0, 0usize);
    for r in 0..n {
        if targets[r] == IGNORE_INDEX {
            continue;
        }
        let l = &logits[r * vsz..(r + 1) * vsz];
        let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + l.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        sum += lse - l[targets[r] as usize];
        count += 1;
    }
    if count == 0 {
        0.0
    } else {
        sum / count as f64
    }
}
