//! f64 AdamW update (tests).

use super::Hyper;

/// The update of [`super::cpu::step`] in f64: returns (p, m, v).
pub fn step(
    p: &[f64],
    m: &[f64],
    v: &[f64],
    g: &[f64],
    h: &Hyper,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (b1, b2) = (h.b1 as f64, h.b2 as f64);
    let c = h.grad_scale.map_or(1.0, |c| c as f64);
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..p.len() {
        let g = g[i] * c;
        let mut pp = p[i] - h.wd as f64 * p[i];
        let mm = b1 * m[i] + (1.0 - b1) * g;
        let vv = b2 * v[i] + (1.0 - b2) * g * g;
        pp -= h.step_size as f64 * mm / (vv.sqrt() / h.bc2_sqrt as f64 + h.eps as f64);
        out.0.push(pp);
        out.1.push(mm);
        out.2.push(vv);
    }
    out
}
