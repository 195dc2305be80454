//! f64 SwiGLU (tests).

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `a` `[rows, f]` from `u` `[rows, 2f]`.
pub fn forward(u: &[f64], rows: usize, f: usize) -> Vec<f64> {
    let mut a = vec![0.0; rows * f];
    for r in 0..rows {
        for j in 0..f {
            let (g, up) = (u[r * 2 * f + j], u[r * 2 * f + f + j]);
            a[r * f + j] = g * sigmoid(g) * up;
        }
    }
    a
}

/// `du` `[rows, 2f]` from `u` and `da` `[rows, f]`.
pub fn backward(u: &[f64], rows: usize, f: usize, da: &[f64]) -> Vec<f64> {
    let mut du = vec![0.0; rows * 2 * f];
    for r in 0..rows {
        for j in 0..f {
            let (g, up, d) = (u[r * 2 * f + j], u[r * 2 * f + f + j], da[r * f + j]);
            let s = sigmoid(g);
            du[r * 2 * f + f + j] = d * g * s;
            du[r * 2 * f + j] = d * up * s * (1.0 + g * (1.0 - s));
        }
    }
    du
}
