//! f64 token-by-token recurrence of the gated delta rule and its hand-written backward
//! (backpropagation through time). Tests only: simple loops, no chunking, no cleverness.

use super::RuleShape;

/// Inputs of the rule in f64, same layouts as the CPU op.
pub struct RefInputs<'a> {
    pub q: &'a [f64],
    pub k: &'a [f64],
    pub v: &'a [f64],
    pub g: &'a [f64],
    pub beta: &'a [f64],
    /// Sequence boundaries (`cu_seqlens`); rows past the last are padding.
    pub cu: &'a [usize],
    pub tokens: usize,
    pub shape: RuleShape,
    pub scale: f64,
    pub l2norm_in_kernel: bool,
    pub h0: Option<&'a [f64]>,
}

fn l2n(x: &[f64]) -> (Vec<f64>, f64) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
    (x.iter().map(|v| v * r).collect(), r)
}

fn row(x: &[f64], t: usize, h: usize, heads: usize, d: usize) -> &[f64] {
    &x[(t * heads + h) * d..(t * heads + h + 1) * d]
}

/// Forward: `o` `[tokens, Hv, Dv]` and final states `[N, Hv, Dk, Dv]`.
pub fn forward(inp: &RefInputs) -> (Vec<f64>, Vec<f64>) {
    let s = inp.shape;
    let (dk, dv, hv) = (s.dk, s.dv, s.hv);
    let r = hv / s.hk;
    let n_seq = inp.cu.len() - 1;
    let mut o = vec![0.0; inp.tokens * hv * dv];
    let mut fin = vec![0.0; n_seq * hv * dk * dv];
    for n in 0..n_seq {
        for j in 0..hv {
            let kh = j / r;
            let mut st = match inp.h0 {
                Some(h) => h[(n * hv + j) * dk * dv..(n * hv + j + 1) * dk * dv].to_vec(),
                None => vec![0.0; dk * dv],
            };
            for t in inp.cu[n]..inp.cu[n + 1] {
                let (mut qt, mut kt) = (
                    row(inp.q, t, kh, s.hk, dk).to_vec(),
                    row(inp.k, t, kh, s.hk, dk).to_vec(),
                );
                if inp.l2norm_in_kernel {
                    qt = l2n(&qt).0;
                    kt = l2n(&kt).0;
                }
                let vt = row(inp.v, t, j, hv, dv);
                let a = inp.g[t * hv + j].exp();
                let b = inp.beta[t * hv + j];
                st.iter_mut().for_each(|x| *x *= a);
                for c in 0..dv {
                    let pred: f64 = (0..dk).map(|x| st[x * dv + c] * kt[x]).sum();
                    let u = b * (vt[c] - pred);
                    for x in 0..dk {
                        st[x * dv + c] += kt[x] * u;
                    }
                }
                for c in 0..dv {
                    o[(t * hv + j) * dv + c] =
                        (0..dk).map(|x| st[x * dv + c] * qt[x] * inp.scale).sum();
                }
            }
            fin[(n * hv + j) * dk * dv..(n * hv + j + 1) * dk * dv].copy_from_slice(&st);
        }
    }
    (o, fin)
}

/// Gradients from the reference backward.
pub struct RefGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub dg: Vec<f64>,
    pub dbeta: Vec<f64>,
    pub dh0: Vec<f64>,
}

/// Backward through time from `d_o` and the gradient of the final states `dht`.
pub fn backward(inp: &RefInputs, d_o: &[f64], dht: Option<&[f64]>) -> RefGrads {
    let s = inp.shape;
    let (dk, dv, hv, hk) = (s.dk, s.dv, s.hv, s.hk);
    let r = hv / hk;
    let n_seq = inp.cu.len() - 1;
    let st_n = dk * dv;
    let mut gr = RefGrads {
        dq: vec![0.0; inp.tokens * hk * dk],
        dk: vec![0.0; inp.tokens * hk * dk],
        dv: vec![0.0; inp.tokens * hv * dv],
        dg: vec![0.0; inp.tokens * hv],
        dbeta: vec![0.0; inp.tokens * hv],
        dh0: vec![0.0; n_seq * hv * st_n],
    };
    for n in 0..n_seq {
        let (t0, t1) = (inp.cu[n], inp.cu[n + 1]);
        for j in 0..hv {
            let kh = j / r;
            let norm = |x: &[f64]| {
                if inp.l2norm_in_kernel {
                    l2n(x)
                } else {
                    (x.to_vec(), 1.0)
                }
            };
            // Forward, keeping every state S_t (after the update) and S_{t-1}.
            let mut states = Vec::with_capacity(t1 - t0 + 1);
            states.push(match inp.h0 {
                Some(h) => h[(n * hv + j) * st_n..(n * hv + j + 1) * st_n].to_vec(),
                None => vec![0.0; st_n],
            });
            for t in t0..t1 {
                let kt = norm(row(inp.k, t, kh, hk, dk)).0;
                let vt = row(inp.v, t, j, hv, dv);
                let a = inp.g[t * hv + j].exp();
                let b = inp.beta[t * hv + j];
                let mut st: Vec<f64> = states.last().unwrap().iter().map(|x| x * a).collect();
                for c in 0..dv {
                    let pred: f64 = (0..dk).map(|x| st[x * dv + c] * kt[x]).sum();
                    let u = b * (vt[c] - pred);
                    for x in 0..dk {
                        st[x * dv + c] += kt[x] * u;
                    }
                }
                states.push(st);
            }
            let mut ds = match dht {
                Some(d) => d[(n * hv + j) * st_n..(n * hv + j + 1) * st_n].to_vec(),
                None => vec![0.0; st_n],
            };
            for t in (t0..t1).rev() {
                let i = t - t0;
                let (qt, qr) = norm(row(inp.q, t, kh, hk, dk));
                let (kt, kr) = norm(row(inp.k, t, kh, hk, dk));
                let vt = row(inp.v, t, j, hv, dv);
                let a = inp.g[t * hv + j].exp();
                let b = inp.beta[t * hv + j];
                let prev = &states[i];
                let cur = &states[i + 1];
                let sp: Vec<f64> = prev.iter().map(|x| x * a).collect();
                let dot_ = &d_o[(t * hv + j) * dv..(t * hv + j + 1) * dv];
                // o = S_t^T (scale q): dS_t += scale q do^T ; dq = scale S_t do.
                let mut dq = vec![0.0; dk];
                for x in 0..dk {
                    for c in 0..dv {
                        ds[x * dv + c] += inp.scale * qt[x] * dot_[c];
                        dq[x] += inp.scale * cur[x * dv + c] * dot_[c];
                    }
                }
                // S_t = S' + k u^T, u = b (v - S'^T k).
                let pred: Vec<f64> = (0..dv)
                    .map(|c| (0..dk).map(|x| sp[x * dv + c] * kt[x]).sum())
                    .collect();
                let u: Vec<f64> = (0..dv).map(|c| b * (vt[c] - pred[c])).collect();
                let du: Vec<f64> = (0..dv)
                    .map(|c| (0..dk).map(|x| ds[x * dv + c] * kt[x]).sum())
                    .collect();
                let mut dk_ = vec![0.0; dk];
                for x in 0..dk {
                    dk_[x] += (0..dv).map(|c| ds[x * dv + c] * u[c]).sum::<f64>();
                }
                let mut db = 0.0;
                for c in 0..dv {
                    db += du[c] * (vt[c] - pred[c]);
                    gr.dv[(t * hv + j) * dv + c] = b * du[c];
                }
                // dpred = -b du ; dS' += k dpred^T ; dk += S' dpred.
                let mut dsp = ds.clone();
                for x in 0..dk {
                    for c in 0..dv {
                        let dp = -b * du[c];
                        dsp[x * dv + c] += kt[x] * dp;
                        dk_[x] += sp[x * dv + c] * dp;
                    }
                }
                // S' = a S_{t-1}.
                let da: f64 = dsp.iter().zip(prev).map(|(x, y)| x * y).sum();
                gr.dg[t * hv + j] = a * da;
                gr.dbeta[t * hv + j] = db;
                ds = dsp.iter().map(|x| x * a).collect();
                // Through the L2 norm if in the kernel: dx = r (dy - y <dy, y>).
                let back = |y: &[f64], r_: f64, dy: &[f64]| -> Vec<f64> {
                    if !inp.l2norm_in_kernel {
                        return dy.to_vec();
                    }
                    let p: f64 = dy.iter().zip(y).map(|(a, b)| a * b).sum();
                    dy.iter().zip(y).map(|(d, yy)| r_ * (d - yy * p)).collect()
                };
                let dqx = back(&qt, qr, &dq);
                let dkx = back(&kt, kr, &dk_);
                for x in 0..dk {
                    gr.dq[(t * hk + kh) * dk + x] += dqx[x];
                    gr.dk[(t * hk + kh) * dk + x] += dkx[x];
                }
            }
            gr.dh0[(n * hv + j) * st_n..(n * hv + j + 1) * st_n].copy_from_slice(&ds);
        }
    }
    gr
}

/// Every output of one forward and backward, named as the tests name them: `o`, `final_state`,
/// `dq`, `dk`, `dv`, `dg`, `dbeta`, then `dh0` when `inp.h0` is given.
pub fn outputs(inp: &RefInputs, d_o: &[f64], dht: Option<&[f64]>) -> Vec<(&'static str, Vec<f64>)> {
    let (o, fin) = forward(inp);
    let gr = backward(inp, d_o, dht);
    let mut out = vec![
        ("o", o),
        ("final_state", fin),
        ("dq", gr.dq),
        ("dk", gr.dk),
        ("dv", gr.dv),
        ("dg", gr.dg),
        ("dbeta", gr.dbeta),
    ];
    if inp.h0.is_some() {
        out.push(("dh0", gr.dh0));
    }
    out
}

/// The conditioning floor of each of [`outputs`] (`base`: the unperturbed outputs) for bf16
/// storage: the largest RMS-relative change over `seeds` when q, k, v, beta and d_o (the tensors
/// the GPU stores in bf16) are perturbed by relative amounts of up to bf16's unit roundoff
/// ([`crate::testutil::conditioning_floors`]). g, the initial states and the final states'
/// gradient are fp32 on the GPU and are not perturbed.
pub fn conditioning_floors(
    inp: &RefInputs,
    d_o: &[f64],
    dht: Option<&[f64]>,
    base: &[(&'static str, Vec<f64>)],
    seeds: &[u64],
) -> Vec<(&'static str, f64)> {
    use crate::testutil::{perturb_rel, rng, BF16_UNIT_ROUNDOFF as U};
    crate::testutil::conditioning_floors(base, seeds, |seed| {
        let mut r = rng(seed);
        let (q, k, v) = (
            perturb_rel(&mut r, inp.q, U),
            perturb_rel(&mut r, inp.k, U),
            perturb_rel(&mut r, inp.v, U),
        );
        let beta = perturb_rel(&mut r, inp.beta, U);
        let d_o = perturb_rel(&mut r, d_o, U);
        let p = RefInputs {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            ..*inp
        };
        outputs(&p, &d_o, dht)
    })
}
