//! f64 reference of the gates (plain loops; for tests).

#![allow(clippy::needless_range_loop)] // plain indexed loops, like the math

/// PyTorch's softplus in f64, same threshold.
pub fn softplus(x: f64) -> f64 {
    if x > super::SOFTPLUS_THRESHOLD as f64 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `1 / (1 + exp(-x))`.
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// GDN gates: `(g, beta)` over `a`, `b` `[rows, heads]`.
pub fn gates_forward(
    a: &[f64],
    b: &[f64],
    rows: usize,
    heads: usize,
    a_log: &[f64],
    dt_bias: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let mut g = vec![0.0; rows * heads];
    let mut beta = vec![0.0; rows * heads];
    for t in 0..rows {
        for h in 0..heads {
            let i = t * heads + h;
            g[i] = -a_log[h].exp() * softplus(a[i] + dt_bias[h]);
            beta[i] = sigmoid(b[i]);
        }
    }
    (g, beta)
}

/// GDN2 per-channel log decay over `f` `[rows, key_heads*dk]`.
pub fn gates2_forward(
    f: &[f64],
    rows: usize,
    key_heads: usize,
    dk: usize,
    a_log: &[f64],
    dt_bias: &[f64],
) -> Vec<f64> {
    let cols = key_heads * dk;
    let mut g = vec![0.0; rows * cols];
    for t in 0..rows {
        for h in 0..key_heads {
            for c in 0..dk {
                let j = h * dk + c;
                g[t * cols + j] = -a_log[h].exp() * softplus(f[t * cols + j] + dt_bias[j]);
            }
        }
    }
    g
}

/// Elementwise sigmoid.
pub fn sigmoid_forward(x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| sigmoid(v)).collect()
}
