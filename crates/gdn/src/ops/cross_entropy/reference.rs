//! f64 softmax cross-entropy (tests): the mean loss over target rows and its gradient.

use super::IGNORE_INDEX;

/// (sum of row losses, target rows, dlogits of the mean loss).
pub fn forward_backward(
    l: &[f64],
    rows: usize,
    vocab: usize,
    targets: &[i32],
) -> (f64, usize, Vec<f64>) {
    let count = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let mut d = vec![0.0; rows * vocab];
    let mut sum = 0.0;
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE_INDEX {
            continue;
        }
        let row = &l[r * vocab..(r + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let lse = m + s.ln();
        sum += lse - row[t as usize];
        for j in 0..vocab {
            let p = (row[j] - lse).exp();
            d[r * vocab + j] = (p - f64::from(j == t as usize)) / count as f64;
        }
    }
    (sum, count, d)
}
