//! f64 token-by-token recurrence of the GDN2 rule and its hand-written backward
//! (backpropagation through time). Tests only: simple loops, no chunking, no cleverness.

use super::RuleShape;

/// Inputs of the rule in f64, same layouts as the CPU op.
pub struct RefInputs<'a> {
    pub q: &'a [f64],
    pub k: &'a [f64],
    pub v: &'a [f64],
    /// `[tokens, Hv, Dk]`
    pub g: &'a [f64],
    /// `[tokens, Hv, Dk]`
    pub b: &'a [f64],
    /// `[tokens, Hv, Dv]`
    pub w: &'a [f64],
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

/// One step: `S' = Diag(exp(g)) S`, `e = S'^T (b*k)`, `delta = w*v - e`, `S = S' + k delta^T`.
/// Returns `(S', delta)` and updates `st` in place.
fn step(
    st: &mut [f64],
    kt: &[f64],
    vt: &[f64],
    gt: &[f64],
    bt: &[f64],
    wt: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let (dk, dv) = (kt.len(), vt.len());
    for x in 0..dk {
        let a = gt[x].exp();
        st[x * dv..(x + 1) * dv].iter_mut().for_each(|s| *s *= a);
    }
    let sp = st.to_vec();
    let delta: Vec<f64> = (0..dv)
        .map(|c| wt[c] * vt[c] - (0..dk).map(|x| sp[x * dv + c] * bt[x] * kt[x]).sum::<f64>())
        .collect();
    for x in 0..dk {
        for c in 0..dv {
            st[x * dv + c] += kt[x] * delta[c];
        }
    }
    (sp, delta)
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
                step(
                    &mut st,
                    &kt,
                    row(inp.v, t, j, hv, dv),
                    row(inp.g, t, j, hv, dk),
                    row(inp.b, t, j, hv, dk),
                    row(inp.w, t, j, hv, dv),
                );
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
    pub db: Vec<f64>,
    pub dw: Vec<f64>,
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
        dg: vec![0.0; inp.tokens * hv * dk],
        db: vec![0.0; inp.tokens * hv * dk],
        dw: vec![0.0; inp.tokens * hv * dv],
        dh0: vec![0.0; n_seq * hv * st_n],
    };
    let norm = |x: &[f64]| {
        if inp.l2norm_in_kernel {
            l2n(x)
        } else {
            (x.to_vec(), 1.0)
        }
    };
    // Through the L2 norm if in the kernel: dx = r (dy - y <dy, y>).
    let norm_back = |y: &[f64], r_: f64, dy: &[f64]| -> Vec<f64> {
        if !inp.l2norm_in_kernel {
            return dy.to_vec();
        }
        let p: f64 = dy.iter().zip(y).map(|(a, b)| a * b).sum();
        dy.iter().zip(y).map(|(d, yy)| r_ * (d - yy * p)).collect()
    };
    for n in 0..n_seq {
        let (t0, t1) = (inp.cu[n], inp.cu[n + 1]);
        for j in 0..hv {
            let kh = j / r;
            // Forward, keeping every state S_t (after the update), S_{t-1}, S' and delta.
            let mut states = Vec::with_capacity(t1 - t0 + 1);
            let mut steps = Vec::with_capacity(t1 - t0);
            states.push(match inp.h0 {
                Some(h) => h[(n * hv + j) * st_n..(n * hv + j + 1) * st_n].to_vec(),
                None => vec![0.0; st_n],
            });
            for t in t0..t1 {
                let kt = norm(row(inp.k, t, kh, hk, dk)).0;
                let mut st = states.last().unwrap().clone();
                steps.push(step(
                    &mut st,
                    &kt,
                    row(inp.v, t, j, hv, dv),
                    row(inp.g, t, j, hv, dk),
                    row(inp.b, t, j, hv, dk),
                    row(inp.w, t, j, hv, dv),
                ));
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
                let (vt, gt, bt, wt) = (
                    row(inp.v, t, j, hv, dv),
                    row(inp.g, t, j, hv, dk),
                    row(inp.b, t, j, hv, dk),
                    row(inp.w, t, j, hv, dv),
                );
                let (prev, cur) = (&states[i], &states[i + 1]);
                let (sp, delta) = &steps[i];
                let dot_ = &d_o[(t * hv + j) * dv..(t * hv + j + 1) * dv];
                // o = S_t^T (scale q): dS_t += scale q do^T ; dq = scale S_t do.
                let mut dq = vec![0.0; dk];
                for x in 0..dk {
                    for c in 0..dv {
                        ds[x * dv + c] += inp.scale * qt[x] * dot_[c];
                        dq[x] += inp.scale * cur[x * dv + c] * dot_[c];
                    }
                }
                // S_t = S' + k delta^T: dS' = dS_t ; dk = dS_t delta ; ddelta = dS_t^T k.
                let mut dk_: Vec<f64> = (0..dk)
                    .map(|x| (0..dv).map(|c| ds[x * dv + c] * delta[c]).sum())
                    .collect();
                let ddelta: Vec<f64> = (0..dv)
                    .map(|c| (0..dk).map(|x| ds[x * dv + c] * kt[x]).sum())
                    .collect();
                // delta = w*v - e: dw = ddelta*v ; dv = ddelta*w ; de = -ddelta.
                for c in 0..dv {
                    gr.dw[(t * hv + j) * dv + c] = ddelta[c] * vt[c];
                    gr.dv[(t * hv + j) * dv + c] = ddelta[c] * wt[c];
                }
                // e = S'^T (b*k): d(b*k) = S' de ; dS' += (b*k) de^T ; db = d(b*k)*k ; dk += d(b*k)*b.
                let mut dsp = ds.clone();
                for x in 0..dk {
                    let mut dbk = 0.0;
                    for c in 0..dv {
                        let de = -ddelta[c];
                        dbk += sp[x * dv + c] * de;
                        dsp[x * dv + c] += bt[x] * kt[x] * de;
                    }
                    gr.db[(t * hv + j) * dk + x] = dbk * kt[x];
                    dk_[x] += dbk * bt[x];
                }
                // S' = Diag(a) S_{t-1}, a = exp(g): dg_x = a_x <dS'_x, S_{t-1,x}> ; dS_{t-1} = Diag(a) dS'.
                for (x, a) in gt.iter().map(|y| y.exp()).enumerate() {
                    let row_ = x * dv..(x + 1) * dv;
                    let p: f64 = dsp[row_.clone()]
                        .iter()
                        .zip(&prev[row_.clone()])
                        .map(|(u, w)| u * w)
                        .sum();
                    gr.dg[(t * hv + j) * dk + x] = a * p;
                    for c in row_ {
                        ds[c] = a * dsp[c];
                    }
                }
                let dqx = norm_back(&qt, qr, &dq);
                let dkx = norm_back(&kt, kr, &dk_);
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
