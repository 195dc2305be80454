//! CPU softmax cross-entropy (f32 logits; each row max-subtracted with its exponent sum in f64;
//! per-row losses added in row order in f64, so the result does not depend on the thread count).

use rayon::prelude::*;

use super::{LossStats, IGNORE_INDEX};
use crate::error::{GdnError, Result};

/// Rows per parallel task.
const TASK_ROWS: usize = 64;

/// Check targets: each in `[0, vocab)` or [`IGNORE_INDEX`].
pub fn check_targets(targets: &[i32], vocab: usize) -> Result<()> {
    if let Some((i, &t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t != IGNORE_INDEX && (t < 0 || t as usize >= vocab))
    {
        return Err(GdnError::Invalid(format!(
            "targets[{i}] = {t}: expected a token id in [0, {vocab}) or {IGNORE_INDEX} (ignored)"
        )));
    }
    Ok(())
}

/// Forward over `logits` `[rows, vocab]`: the loss statistics and, when `keep_probs`, the
/// softmax `[rows, vocab]` that backward needs (rows without a target are left zero).
pub fn forward(
    logits: &[f32],
    rows: usize,
    vocab: usize,
    targets: &[i32],
    keep_probs: bool,
) -> Result<(LossStats, Option<Vec<f32>>)> {
    if vocab == 0 {
        return Err(GdnError::Invalid("cross entropy: vocab must be > 0".into()));
    }
    crate::ops::check_len("cross entropy logits", logits, rows * vocab)?;
    if targets.len() != rows {
        return Err(GdnError::Invalid(format!(
            "cross entropy: {} targets for {rows} rows",
            targets.len()
        )));
    }
    check_targets(targets, vocab)?;
    let mut probs = if keep_probs {
        vec![0.0f32; rows * vocab]
    } else {
        Vec::new()
    };
    // (loss, correct) per target row, None for ignored rows.
    let mut per_row: Vec<Option<(f64, bool)>> = vec![None; rows];
    let body = |r0: usize, out: &mut [Option<(f64, bool)>], p: Option<&mut [f32]>| {
        let mut p = p;
        for (i, o) in out.iter_mut().enumerate() {
            let r = r0 + i;
            let t = targets[r];
            if t == IGNORE_INDEX {
                continue;
            }
            let l = &logits[r * vocab..(r + 1) * vocab];
            let mut m = l[0];
            let mut arg = 0;
            for (j, &v) in l.iter().enumerate() {
                if v > m {
                    m = v;
                    arg = j;
                }
            }
            let s: f64 = l.iter().map(|&v| ((v - m) as f64).exp()).sum();
            let lse = m as f64 + s.ln();
            *o = Some((lse - l[t as usize] as f64, arg == t as usize));
            if let Some(p) = p.as_deref_mut() {
                let pr = &mut p[i * vocab..(i + 1) * vocab];
                for (pj, &v) in pr.iter_mut().zip(l) {
                    *pj = (v as f64 - lse).exp() as f32;
                }
            }
        }
    };
    if keep_probs {
        per_row
            .par_chunks_mut(TASK_ROWS)
            .zip(probs.par_chunks_mut(TASK_ROWS * vocab))
            .enumerate()
            .for_each(|(c, (out, p))| body(c * TASK_ROWS, out, Some(p)));
    } else {
        per_row
            .par_chunks_mut(TASK_ROWS)
            .enumerate()
            .for_each(|(c, out)| body(c * TASK_ROWS, out, None));
    }
    let mut st = LossStats::default();
    for (l, ok) in per_row.into_iter().flatten() {
        st.loss_sum += l;
        st.count += 1;
        st.correct += ok as usize;
    }
    Ok((st, keep_probs.then_some(probs)))
}

/// Backward of the mean loss: `dlogits` `[rows, vocab]` from the kept softmax, the targets and
/// the number of target rows.
pub fn backward(
    probs: &[f32],
    rows: usize,
    vocab: usize,
    targets: &[i32],
    count: usize,
) -> Result<Vec<f32>> {
    crate::ops::check_len("cross entropy probs", probs, rows * vocab)?;
    if targets.len() != rows {
        return Err(GdnError::Invalid(format!(
            "cross entropy: {} targets for {rows} rows",
            targets.len()
        )));
    }
    check_targets(targets, vocab)?;
    let mut d = vec![0.0f32; rows * vocab];
    if count == 0 {
        return Ok(d);
    }
    let inv = 1.0 / count as f32;
    d.par_chunks_mut(vocab).enumerate().for_each(|(r, dr)| {
        let t = targets[r];
        if t == IGNORE_INDEX {
            return;
        }
        let p = &probs[r * vocab..(r + 1) * vocab];
        for (dj, &pj) in dr.iter_mut().zip(p) {
            *dj = pj * inv;
        }
        dr[t as usize] -= inv;
    });
    Ok(d)
}
