//! The whole GDN layer in f64, written directly from the math with plain loops (tests only).
//! Independent of the ops' implementations except the rule's f64 recurrence.

use crate::config::{GdnConfig, Normalization, Variant};
use crate::ops::gated_delta_rule::reference as rule_ref;
use crate::ops::gated_delta_rule::RuleShape;
use crate::ops::gdn2_rule::reference as rule2_ref;

/// f64 parameters by name (`Params` converted).
pub struct RefParams(pub Vec<(String, Vec<f64>)>);

impl RefParams {
    /// From f32 parameters.
    pub fn from_params(p: &crate::layer::Params) -> Self {
        RefParams(
            p.iter()
                .map(|(n, t)| (n.to_string(), t.data().iter().map(|&x| x as f64).collect()))
                .collect(),
        )
    }
    /// Values of `name`.
    pub fn get(&self, name: &str) -> Option<&[f64]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
    fn d(&self, name: &str) -> &[f64] {
        self.get(name).unwrap()
    }
}

fn norm_rows(
    x: &[f64],
    d: usize,
    w: &[f64],
    b: Option<&[f64]>,
    kind: Normalization,
    eps: f64,
    zc: bool,
) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (r, yr) in x.chunks(d).zip(y.chunks_mut(d)) {
        let mean = if kind == Normalization::LayerNorm {
            r.iter().sum::<f64>() / d as f64
        } else {
            0.0
        };
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            let g = if zc { 1.0 + w[i] } else { w[i] };
            yr[i] = (r[i] - mean) * rstd * g + b.map_or(0.0, |b| b[i]);
        }
    }
    y
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `y = x W^T` with W `[out, in]`.
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

/// Layer forward in f64 over `x` `[tokens, h]` with sequence boundaries `cu`.
pub fn forward(cfg: &GdnConfig, p: &RefParams, x: &[f64], cu: &[usize]) -> Vec<f64> {
    forward_with_state(cfg, p, x, cu, None).0
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Layer forward in f64 with initial states `[N, Hv, Dk, Dv]`; returns `y` and the final states.
pub fn forward_with_state(
    cfg: &GdnConfig,
    p: &RefParams,
    x: &[f64],
    cu: &[usize],
    h0: Option<&[f64]>,
) -> (Vec<f64>, Vec<f64>) {
    let h = cfg.hidden_size;
    let n = x.len() / h;
    let (hk, hv, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let (qk, vd, cd, pd) = (cfg.qk_dim(), cfg.v_dim(), cfg.conv_dim(), cfg.in_proj_dim());
    let eps = cfg.layernorm_epsilon as f64;
    let zc = cfg.layernorm_zero_centered_gamma;
    let kind = cfg.normalization;
    let xn = norm_rows(
        x,
        h,
        p.d("in_proj.layer_norm_weight"),
        p.get("in_proj.layer_norm_bias"),
        kind,
        eps,
        zc,
    );
    let proj = linear(&xn, h, p.d("in_proj.weight"), pd);
    // causal depthwise conv + SiLU over [q|k|v], zero history at each sequence start
    let w = cfg.linear_conv_kernel_dim;
    let cw = p.d("conv1d.weight");
    let cb = p.get("conv1d.bias");
    let mut qkv = vec![0.0; n * cd];
    for s in 0..cu.len() - 1 {
        for t in cu[s]..cu[s + 1] {
            for c in 0..cd {
                let mut acc = cb.map_or(0.0, |b| b[c]);
                for i in 0..w {
                    let src = t as isize - (w - 1) as isize + i as isize;
                    if src >= cu[s] as isize {
                        acc += cw[c * w + i] * proj[src as usize * pd + c];
                    }
                }
                qkv[t * cd + c] = silu(acc);
            }
        }
    }
    let l2 = |r: &[f64]| {
        let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
        r.iter().map(|v| v * s).collect::<Vec<f64>>()
    };
    let mut q = vec![0.0; n * qk];
    let mut k = vec![0.0; n * qk];
    let mut v = vec![0.0; n * vd];
    for t in 0..n {
        q[t * qk..(t + 1) * qk].copy_from_slice(&qkv[t * cd..t * cd + qk]);
        k[t * qk..(t + 1) * qk].copy_from_slice(&qkv[t * cd + qk..t * cd + 2 * qk]);
        v[t * vd..(t + 1) * vd].copy_from_slice(&qkv[t * cd + 2 * qk..t * cd + cd]);
    }
    if cfg.use_qk_l2norm {
        // caller-side or in-kernel: the same math
        q = q.chunks(dk).flat_map(l2).collect();
        k = k.chunks(dk).flat_map(l2).collect();
    }
    let a_log = p.d("A_log");
    let dt = p.d("dt_bias");
    let shape = RuleShape { hk, hv, dk, dv };
    let scale = 1.0 / (dk as f64).sqrt();
    let (o, fin) = match cfg.variant {
        Variant::Gdn => {
            let mut g = vec![0.0; n * hv];
            let mut beta = vec![0.0; n * hv];
            for t in 0..n {
                for j in 0..hv {
                    let b = proj[t * pd + cd + vd + j];
                    let a = proj[t * pd + cd + vd + hv + j];
                    g[t * hv + j] = -a_log[j].exp() * softplus(a + dt[j]);
                    beta[t * hv + j] = sigmoid(b);
                }
            }
            let inp = rule_ref::RefInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
                cu,
                tokens: n,
                shape,
                scale,
                l2norm_in_kernel: false,
                h0,
            };
            rule_ref::forward(&inp)
        }
        Variant::Gdn2 => {
            // sections after [q|k|v|z]: f (qk), b (qk), w (vd); g and b repeated to value heads
            let r = hv / hk;
            let mut g = vec![0.0; n * hv * dk];
            let mut b = vec![0.0; n * hv * dk];
            let mut w = vec![0.0; n * vd];
            for t in 0..n {
                let base = t * pd + cd + vd;
                for j in 0..hv {
                    let kh = j / r;
                    for c in 0..dk {
                        let ch = kh * dk + c;
                        g[(t * hv + j) * dk + c] =
                            -a_log[kh].exp() * softplus(proj[base + ch] + dt[ch]);
                        b[(t * hv + j) * dk + c] = sigmoid(proj[base + qk + ch]);
                    }
                }
                for i in 0..vd {
                    w[t * vd + i] = sigmoid(proj[base + 2 * qk + i]);
                }
            }
            let inp = rule2_ref::RefInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                b: &b,
                w: &w,
                cu,
                tokens: n,
                shape,
                scale,
                l2norm_in_kernel: false,
                h0,
            };
            rule2_ref::forward(&inp)
        }
    };
    let on = norm_rows(
        &o,
        dv,
        p.d("out_norm.weight"),
        p.get("out_norm.bias"),
        kind,
        eps,
        zc,
    );
    let mut gated = vec![0.0; n * vd];
    for t in 0..n {
        for i in 0..vd {
            gated[t * vd + i] = on[t * vd + i] * silu(proj[t * pd + cd + i]);
        }
    }
    (linear(&gated, vd, p.d("out_proj.weight"), h), fin)
}
