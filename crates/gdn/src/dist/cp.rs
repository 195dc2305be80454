//! Context parallelism's index arithmetic (Megatron's head-parallel scheme, `megatron-gdn.md`
//! section 5.2): the per-section head permutation, the zigzag (load-balanced) chunk order, and
//! the packed-sequence `idx` / `inv` permutations of the all-to-all. Pure functions over sizes;
//! the layer that moves data with them is `layer::CpLayer`.
//!
//! With `cp` ranks every sequence of length `L` is cut into `2 cp` chunks of `L / (2 cp)` tokens;
//! rank `r` holds chunks `r` and `2 cp - 1 - r` of every sequence, sequence after sequence (TE's
//! `thd_get_partitioned_indices`; for one sequence this is Megatron's zigzag split). After the
//! input all-to-all each rank holds every token, in natural order, for `1 / cp` of the heads.

use crate::config::{GdnConfig, Variant};
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

/// Megatron's `_build_head_perm_for_split_sections`: the column permutation that makes block `c`
/// (of `cp` equal blocks of the last dimension) hold the `c`-th part of every section,
/// `[s0_c | s1_c | ...]`, so one un-sectioned all-to-all moves each rank's heads of every section.
/// `perm[j]` is the source column of output column `j`. Every section must be divisible by `cp`.
pub fn head_perm(sections: &[usize], cp: usize) -> Result<Vec<usize>> {
    check_sections(sections, cp)?;
    let mut perm = Vec::with_capacity(sections.iter().sum());
    for c in 0..cp {
        let mut off = 0;
        for &s in sections {
            let w = s / cp;
            perm.extend(off + c * w..off + (c + 1) * w);
            off += s;
        }
    }
    Ok(perm)
}

/// The pieces of block `c` of [`head_perm`] as (source column, width), in order.
pub fn head_block(sections: &[usize], cp: usize, c: usize) -> Vec<(usize, usize)> {
    let mut off = 0;
    sections
        .iter()
        .map(|&s| {
            let w = s / cp;
            let piece = (off + c * w, w);
            off += s;
            piece
        })
        .collect()
}

fn check_sections(sections: &[usize], cp: usize) -> Result<()> {
    if cp == 0 {
        return Err(GdnError::Invalid("cp size must be >= 1".into()));
    }
    if let Some(s) = sections.iter().find(|&&s| !s.is_multiple_of(cp)) {
        return Err(GdnError::Invalid(format!(
            "split_sections {sections:?} must be divisible by cp_size {cp} for GDN (section {s})"
        )));
    }
    Ok(())
}

/// Megatron's `_undo_attention_load_balancing` order: natural chunk `k` is chunk `order[k]` of
/// the rank-grouped buffer (rank 0's two chunks, then rank 1's, ...):
/// `[0, 2, 4, ..., 2cp-2, 2cp-1, 2cp-3, ..., 1]`.
pub fn undo_zigzag_order(cp: usize) -> Vec<usize> {
    let mut o: Vec<usize> = (0..cp).map(|k| 2 * k).collect();
    o.extend((0..cp).map(|k| 2 * cp - 1 - 2 * k));
    o
}

/// Megatron's `_redo_attention_load_balancing` order: chunk `j` of the rank-grouped buffer is
/// natural chunk `order[j]`: `order[0::2] = 0..cp`, `order[1::2] = 2cp-1, 2cp-2, ..., cp`.
pub fn redo_zigzag_order(cp: usize) -> Vec<usize> {
    let mut o = vec![0; 2 * cp];
    for r in 0..cp {
        o[2 * r] = r;
        o[2 * r + 1] = 2 * cp - 1 - r;
    }
    o
}

/// The CP rules on sequences: no padding rows after the last boundary, and every sequence length
/// divisible by `2 cp` (the zigzag cuts each sequence into `2 cp` chunks; Megatron checks `cp`
/// for packed sequences, which is not enough for its own permutation).
pub fn check_seqs(seqs: &Seqs, cp: usize) -> Result<()> {
    if cp == 0 {
        return Err(GdnError::Invalid("cp size must be >= 1".into()));
    }
    if seqs.used() != seqs.tokens() {
        return Err(GdnError::CuSeqlens(format!(
            "context parallelism needs every row in a sequence: cu_seqlens[-1]={} but there are {} rows (pad each sequence to a multiple of 2 x cp = {} instead)",
            seqs.used(),
            seqs.tokens(),
            2 * cp
        )));
    }
    for i in 0..seqs.count() {
        let l = seqs.range(i).len();
        if !l.is_multiple_of(2 * cp) {
            return Err(GdnError::CuSeqlens(format!(
                "sequence {i} has length {l}, not divisible by 2 x cp = {}: context parallelism cuts every sequence into 2 x cp chunks (zigzag load balancing)",
                2 * cp
            )));
        }
    }
    Ok(())
}

/// Megatron's heads rule: `linear_num_key_heads` and `linear_num_value_heads` divisible by the CP
/// size (TP = 1 here).
pub fn check_heads(cfg: &GdnConfig, cp: usize) -> Result<()> {
    if cp == 0 {
        return Err(GdnError::Invalid("cp size must be >= 1".into()));
    }
    for (field, v) in [
        ("linear_num_key_heads", cfg.linear_num_key_heads),
        ("linear_num_value_heads", cfg.linear_num_value_heads),
    ] {
        if !v.is_multiple_of(cp) {
            return Err(GdnError::config(
                field,
                format!(
                    "{field}={v} must be a multiple of (tensor_model_parallel_size=1 * context_parallel_size={cp})"
                ),
            ));
        }
    }
    Ok(())
}

/// The in_proj output's sections in order: GDN `[q, k, v, z, beta, alpha]`, GDN2
/// `[q, k, v, z, f, b, w]`.
pub fn in_proj_sections(cfg: &GdnConfig) -> Vec<usize> {
    let (qk, v) = (cfg.qk_dim(), cfg.v_dim());
    match cfg.variant {
        Variant::Gdn => vec![
            qk,
            qk,
            v,
            v,
            cfg.linear_num_value_heads,
            cfg.linear_num_value_heads,
        ],
        Variant::Gdn2 => vec![qk, qk, v, v, qk, qk, v],
    }
}

/// Natural rows held by rank `rank` of `cp`, in its local order: for every sequence, its chunk
/// `rank` then its chunk `2 cp - 1 - rank` (each `L / (2 cp)` rows). Needs [`check_seqs`].
pub fn local_rows(seqs: &Seqs, cp: usize, rank: usize) -> Vec<std::ops::Range<usize>> {
    let mut v = Vec::new();
    for i in 0..seqs.count() {
        let r = seqs.range(i);
        let half = r.len() / (2 * cp);
        for chunk in [rank, 2 * cp - 1 - rank] {
            let a = r.start + chunk * half;
            v.push(a..a + half);
        }
    }
    v
}

/// Megatron's `_build_thd_cp_a2a_perm(cu_seqlens, cp, T)`: after the all-to-all the rows arrive
/// grouped by source rank (rank `s`'s `T / cp` local rows at `s T / cp`); `idx[p]` is the row of
/// that buffer holding natural position `p`, and `inv[idx[p]] = p`. Needs [`check_seqs`].
pub fn thd_perm(seqs: &Seqs, cp: usize) -> (Vec<usize>, Vec<usize>) {
    let t = seqs.tokens();
    let mut idx = vec![0; t];
    let mut inv = vec![0; t];
    for i in 0..seqs.count() {
        let r = seqs.range(i);
        let half = r.len() / (2 * cp);
        for p in r.clone() {
            let pos = p - r.start;
            let nc = pos / half;
            let lb = if nc < cp { 2 * nc } else { 4 * cp - 2 * nc - 1 };
            let rank = lb / 2;
            let k = (lb - 2 * rank) * half + pos % half;
            idx[p] = rank * (t / cp) + r.start / cp + k;
            inv[idx[p]] = p;
        }
    }
    (idx, inv)
}

/// A run of rows the all-to-all's permutation moves as one block: natural rows
/// `nat .. nat + len` are buffer rows `buf .. buf + len` (the buffer grouped by rank, as in
/// [`thd_perm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub nat: usize,
    pub buf: usize,
    pub len: usize,
}

/// [`thd_perm`] as runs of whole chunks (`2 cp` per sequence), what the layer copies. Needs
/// [`check_seqs`].
pub fn runs(seqs: &Seqs, cp: usize) -> Vec<Run> {
    let per_rank = seqs.tokens() / cp;
    let mut v = Vec::new();
    for i in 0..seqs.count() {
        let r = seqs.range(i);
        let half = r.len() / (2 * cp);
        if half == 0 {
            continue;
        }
        for nc in 0..2 * cp {
            let (rank, slot) = if nc < cp {
                (nc, 0)
            } else {
                (2 * cp - 1 - nc, 1)
            };
            v.push(Run {
                nat: r.start + nc * half,
                buf: rank * per_rank + r.start / cp + slot * half,
                len: half,
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_perm_matches_megatrons_worked_example() {
        // megatron-gdn.md 5.2: sections (4,4,8,8,2,2), cp = 2.
        let want: Vec<usize> = [
            vec![0, 1, 4, 5],
            (8..12).collect(),
            (16..20).collect(),
            vec![24, 26, 2, 3, 6, 7],
            (12..16).collect(),
            (20..24).collect(),
            vec![25, 27],
        ]
        .concat();
        assert_eq!(head_perm(&[4, 4, 8, 8, 2, 2], 2).unwrap(), want);
        // The blocks are the perm's halves.
        let b: Vec<usize> = head_block(&[4, 4, 8, 8, 2, 2], 2, 1)
            .into_iter()
            .flat_map(|(o, w)| o..o + w)
            .collect();
        assert_eq!(b, want[14..]);
        let e = head_perm(&[4, 3], 2).unwrap_err().to_string();
        assert!(e.contains("must be divisible by cp_size 2"), "{e}");
    }

    #[test]
    fn zigzag_orders_match_megatron() {
        // cp = 3: rank-grouped 1 6 2 5 3 4 -> natural 1..6 (megatron-gdn.md: "162534 -> 123456").
        let grouped = [1, 6, 2, 5, 3, 4];
        let nat: Vec<i32> = undo_zigzag_order(3).iter().map(|&j| grouped[j]).collect();
        assert_eq!(nat, vec![1, 2, 3, 4, 5, 6]);
        let back: Vec<i32> = redo_zigzag_order(3).iter().map(|&k| nat[k]).collect();
        assert_eq!(back, grouped);
        assert_eq!(undo_zigzag_order(2), vec![0, 2, 3, 1]);
    }

    #[test]
    fn thd_perm_puts_every_rank_grouped_row_in_natural_order() {
        for (cu, cp) in [
            (vec![0u64, 8, 16], 2),
            (vec![0, 16, 48, 80], 2),
            (vec![0, 16, 48, 80], 4),
            (vec![0, 32, 64, 96, 128], 4),
        ] {
            let t = *cu.last().unwrap() as usize;
            let seqs = Seqs::packed(&cu, t).unwrap();
            check_seqs(&seqs, cp).unwrap();
            // The rank-grouped buffer, built from the shard rule (chunks r and 2cp-1-r).
            let buf: Vec<usize> = (0..cp)
                .flat_map(|r| local_rows(&seqs, cp, r).into_iter().flatten())
                .collect();
            assert_eq!(buf.len(), t);
            let (idx, inv) = thd_perm(&seqs, cp);
            let nat: Vec<usize> = idx.iter().map(|&i| buf[i]).collect();
            assert_eq!(nat, (0..t).collect::<Vec<_>>(), "cu {cu:?} cp {cp}");
            let back: Vec<usize> = inv.iter().map(|&p| nat[p]).collect();
            assert_eq!(back, buf);
            // The runs are the same permutation.
            let mut from_runs = vec![usize::MAX; t];
            for r in runs(&seqs, cp) {
                for k in 0..r.len {
                    from_runs[r.nat + k] = r.buf + k;
                }
            }
            assert_eq!(from_runs, idx);
        }
        // One sequence: the THD permutation is the zigzag undo of the chunks.
        let seqs = Seqs::uniform(1, 12);
        let (idx, _) = thd_perm(&seqs, 3);
        let order = undo_zigzag_order(3);
        for p in 0..12 {
            assert_eq!(idx[p] / 2, order[p / 2]);
        }
    }

    #[test]
    fn cp_rules_are_errors() {
        let cfg = GdnConfig {
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            ..GdnConfig::qwen3_next()
        };
        check_heads(&cfg, 2).unwrap();
        let e = check_heads(&cfg, 4).unwrap_err().to_string();
        assert!(
            e.contains("linear_num_key_heads=2 must be a multiple of") && e.contains("=4)"),
            "{e}"
        );
        // Uniform batch: T = 12 is not divisible by 2 x 4.
        let e = check_seqs(&Seqs::uniform(2, 12), 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("length 12, not divisible by 2 x cp = 8"), "{e}");
        check_seqs(&Seqs::uniform(2, 16), 4).unwrap();
        // Packed: divisible by cp (Megatron's check) but not by 2 cp.
        let s = Seqs::packed(&[0, 8, 14], 14).unwrap();
        let e = check_seqs(&s, 2).unwrap_err().to_string();
        assert!(e.contains("sequence 1 has length 6"), "{e}");
        // Padding rows.
        let s = Seqs::packed(&[0, 8], 12).unwrap();
        let e = check_seqs(&s, 2).unwrap_err().to_string();
        assert!(e.contains("needs every row in a sequence"), "{e}");
    }
}
