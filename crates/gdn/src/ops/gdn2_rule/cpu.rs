//! CPU chunked GDN2 rule (f32). One rayon task per (sequence, key head); the task runs the
//! `Hv/Hk` value heads that read that key head one after another, so the gradients of q and k
//! are summed over the group in a fixed order (no atomics, bitwise reproducible).
//!
//! Within a chunk of `L <= 64` rows with start state `S0`, let `Gam` `[L, Dk]` be the inclusive
//! cumulative sum of `g` over the chunk's rows, per key channel (so `Gam` is non-increasing down
//! each column), and `E_ijc = exp(Gam_ic - Gam_jc)` the decay from row `j` to row `i >= j` on
//! channel `c`. With `Kb = B*K` and `*` elementwise:
//!
//! ```text
//! M_ij = sum_c Kb_ic E_ijc K_jc   (j < i)            A_ij = sum_c Q_ic E_ijc K_jc   (j <= i)
//! T    = (I + M)^-1                                  (forward substitution)
//! U    = T (W*V),   Wm = T (Kb * e^Gam)
//! D    = U - Wm S0                                   (the per-token updates w*v - e)
//! O    = scale ((Q * e^Gam) S0 + A D)
//! S1   = Diag(e^Gam_L) S0 + (K * e^(Gam_L - Gam))^T D
//! ```
//!
//! # Why sub-chunks (numerical stability of per-channel decay)
//!
//! With GDN's scalar decay, `E_ij = e^gam_i e^-gam_j` factors out of the channel sum and `A` is a
//! masked `(Q K^T) * E`. With a decay per channel it does not: the only GEMM form of `A` over a
//! whole chunk is `(Q * e^Gam) (K * e^-Gam)^T`, and `e^-Gam` overflows f32 as soon as the chunk's
//! decay passes ~88 nats (g = -5 per step reaches e^+320 within a chunk), while `e^Gam`
//! underflows to 0: the products become inf * 0 = NaN, or silently lose every digit.
//!
//! So `M` and `A` are built from blocks of sub-chunks of 16 rows:
//!
//! - Off-diagonal block (rows in sub-chunk `I`, columns in an earlier sub-chunk `J`): take the
//!   reference row `r` = the last row of `J`; then for `i > r >= j`,
//!   `E_ijc = e^(Gam_ic - Gam_rc) * e^(Gam_rc - Gam_jc)` with BOTH exponents `<= 0`. The block is
//!   the GEMM `(X_I * e^(Gam_I - Gam_r)) (K_J * e^(Gam_r - Gam_J))^T` of two factors bounded by
//!   `|X|` and `|K|`: nothing overflows, and anything that underflows is truly negligible next to
//!   the terms that are kept. One GEMM per `J` covers all rows below it.
//! - Diagonal 16x16 block: elementwise, `sum_c X_ic e^(Gam_ic - Gam_jc) K_jc` with the exponent
//!   difference `<= 0` for `j <= i` taken first, then exponentiated. The cumulative sums are
//!   summed in f64 and kept as `hi + lo` pairs of f32, so that the difference of two rows is as
//!   accurate as the difference itself (with a plain f32 sum, `e^(Gam_i - Gam_j)` has a relative
//!   error of `|Gam| * 6e-8`, which put the errors of the strong-decay tests at 2e-5 instead of
//!   below 1e-6).
//!
//! Every other exponential of the chunk, `e^Gam`, `e^(Gam_L - Gam)`, also has exponent `<= 0`.
//! The gradients through `M` and `A` use the same blocks (`grams_backward`).
//!
//! The exponentials (about `8 L Dk` per chunk and value head, against the GEMMs' `O(L^2 Dk)`
//! flops) are most of the extra cost over GDN, so they use a vectorizable `exp` (`exp_f32`, within
//! 2 ulp; decays below `e^-86.5` flush to 0) and the elementwise loops are compiled for AVX2 when
//! the CPU has it (`simd_fn!`), with bitwise identical results either way.
//!
//! Backward recomputes the chunk-start states in a forward pass over the chunks (keeping the
//! decay factors, T, Wm, A and D per chunk), then walks the chunks in reverse carrying dS. The
//! derivation of every line is in the comments of `chunk_backward`; it is the per-channel version
//! of `gated_delta_rule`'s, with `dGam` a `[L, Dk]` matrix and the final reverse cumulative sum
//! taken per channel.

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use rayon::prelude::*;

use super::{RuleOpts, RuleShape, CHUNK};
use crate::ops::common::gemm::MatRef;
use crate::ops::common::l2norm::l2norm_row_backward;
use crate::ops::common::rule_cpu::{
    assemble_forward, dot, load_qk, load_rows, mm, tasks, FwdOut, QkRows,
};
use crate::seqs::Seqs;

/// Rows per sub-chunk of the stable decayed products (see the module docs).
const SUB: usize = 16;

/// The six inputs of the rule (layouts in `mod.rs`).
pub(crate) struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub b: &'a [f32],
    pub w: &'a [f32],
}

/// Row-major `[rows, cols]` matrix view of a contiguous buffer.
fn rm(x: &[f32], rows: usize, cols: usize) -> MatRef<'_> {
    MatRef::rm(x, rows, cols, cols)
}

/// `x * y` elementwise.
fn hadamard(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(a, b)| a * b).collect()
}

/// Sub-chunk `J`'s rows `[s, e)` of a chunk of `l` rows.
fn sub_range(jb: usize, l: usize) -> (usize, usize) {
    (jb * SUB, ((jb + 1) * SUB).min(l))
}

/// Declares `fn $name(args)` whose body runs compiled for AVX2 when the CPU has it, else for the
/// baseline target. The elementwise decay loops are most of GDN2's cost over GDN, and the default
/// x86-64 target vectorizes them only 4 wide (SSE2). Both copies do the same IEEE operations in
/// the same order (Rust never contracts `a*b + c` into an FMA, and the loops keep their own lane
/// structure), so the results are bitwise the same on every CPU.
macro_rules! simd_fn {
    ($(#[$m:meta])* fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        fn $name($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn imp($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($a: $t),*) $(-> $r)? {
                    imp($($a),*)
                }
                if is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has the feature `avx2` is compiled for.
                    return unsafe { avx2($($a),*) };
                }
            }
            imp($($a),*)
        }
    };
}

/// `e^x` for the decay exponents (`x <= 0` in normal use), written so that loops over it
/// vectorize: Cephes' single-precision range reduction and polynomial (error within 2 ulp of the
/// exact value). Results below ~2e-38 flush to 0 (no subnormals: a decay that small is 0 for
/// every purpose here, and subnormal arithmetic is slow); `x > 88` gives infinity, NaN stays NaN.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.clamp(-88.0, 88.0);
    let t = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC; // round(x / ln 2)
    let r = xc - n * 0.693_359_375 - n * -2.121_944_400_5e-4; // x - n ln 2, in two parts
    let mut p = 1.987_569_150_0e-4f32;
    p = p * r + 1.398_199_950_7e-3;
    p = p * r + 8.333_451_907_3e-3;
    p = p * r + 4.166_579_589_4e-2;
    p = p * r + 1.666_666_545_9e-1;
    p = p * r + 5.000_000_120_1e-1;
    let y = p * r * r + r + 1.0;
    let two_n = f32::from_bits(((t.to_bits() as i32 - MAGIC.to_bits() as i32 + 127) << 23) as u32);
    if x < -86.5 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        y * two_n
    }
}

/// A row of the cumulative log-decay `Gam` as an unevaluated sum `hi + lo` of two f32 (`hi` the
/// f32 rounding of the f64 cumulative sum, `lo` the remainder), so that a difference of two rows
/// is accurate to the rounding of the difference itself, not of the (much larger) sums.
#[derive(Clone, Copy)]
struct GamRow<'a> {
    hi: &'a [f32],
    lo: &'a [f32],
}

simd_fn! {
    /// `out_x = e^(a_x - b_x)`: `(a.hi - b.hi) + (a.lo - b.lo)`, all f32 (vectorizes).
    fn exp_diff(a: GamRow, b: GamRow, out: &mut [f32]) {
        for ((((o, ah), al), bh), bl) in out.iter_mut().zip(a.hi).zip(a.lo).zip(b.hi).zip(b.lo) {
            *o = exp_f32((ah - bh) + (al - bl));
        }
    }
}

/// The per-channel decay factors of one chunk. Every exponent is `<= 0`.
struct Decay {
    dk: usize,
    /// Inclusive cumulative sum of g over the chunk, `[l, Dk]`, summed in f64 and kept as
    /// `hi + lo` (see [`GamRow`]).
    gam_hi: Vec<f32>,
    gam_lo: Vec<f32>,
    /// `e^Gam_i`, `[l, Dk]`.
    eg: Vec<f32>,
    /// `e^(Gam_L - Gam_i)`, `[l, Dk]`.
    ed: Vec<f32>,
    /// `e^(Gam_r - Gam_j)` with `r` the last row of `j`'s sub-chunk, `[l, Dk]`.
    down: Vec<f32>,
    /// Per sub-chunk `J` (ending at row `e`): `e^(Gam_i - Gam_r)` for the rows `i >= e` after it,
    /// `[l - e, Dk]`.
    up: Vec<Vec<f32>>,
}

impl Decay {
    fn row(&self, i: usize) -> GamRow<'_> {
        let r = i * self.dk..(i + 1) * self.dk;
        GamRow {
            hi: &self.gam_hi[r.clone()],
            lo: &self.gam_lo[r],
        }
    }
}

fn decay(gc: &[f32], l: usize, dk: usize) -> Decay {
    let mut acc = vec![0.0f64; dk];
    let mut dc = Decay {
        dk,
        gam_hi: vec![0.0f32; l * dk],
        gam_lo: vec![0.0f32; l * dk],
        eg: Vec::new(),
        ed: Vec::new(),
        down: Vec::new(),
        up: Vec::new(),
    };
    for i in 0..l {
        let r = i * dk..(i + 1) * dk;
        for (((a, &y), h), lo) in acc
            .iter_mut()
            .zip(&gc[r.clone()])
            .zip(&mut dc.gam_hi[r.clone()])
            .zip(&mut dc.gam_lo[r])
        {
            *a += y as f64;
            *h = *a as f32;
            *lo = (*a - *h as f64) as f32;
        }
    }
    let zero = vec![0.0f32; dk];
    let zero = GamRow {
        hi: &zero,
        lo: &zero,
    };
    let (mut eg, mut ed, mut down) = (
        vec![0.0f32; l * dk],
        vec![0.0f32; l * dk],
        vec![0.0f32; l * dk],
    );
    for i in 0..l {
        let ri = i * dk..(i + 1) * dk;
        exp_diff(dc.row(i), zero, &mut eg[ri.clone()]);
        exp_diff(dc.row(l - 1), dc.row(i), &mut ed[ri.clone()]);
        let r = sub_range(i / SUB, l).1 - 1;
        exp_diff(dc.row(r), dc.row(i), &mut down[ri]);
    }
    let mut up = Vec::new();
    for jb in 0..l.div_ceil(SUB) {
        let e = sub_range(jb, l).1;
        let mut u = vec![0.0f32; (l - e) * dk];
        for i in e..l {
            exp_diff(
                dc.row(i),
                dc.row(e - 1),
                &mut u[(i - e) * dk..(i - e + 1) * dk],
            );
        }
        up.push(u);
    }
    (dc.eg, dc.ed, dc.down, dc.up) = (eg, ed, down, up);
    dc
}

simd_fn! {
    /// `(sum_x a_x e_x c_x, sum_x b_x e_x c_x)`, in 8 lanes (vectorizes; fixed order).
    fn dot2_weighted(a: &[f32], b: &[f32], e: &[f32], c: &[f32]) -> (f32, f32) {
        let (mut sa, mut sb) = ([0.0f32; 8], [0.0f32; 8]);
        let n8 = a.len() / 8 * 8;
        for o in (0..n8).step_by(8) {
            for z in 0..8 {
                let ec = e[o + z] * c[o + z];
                sa[z] += a[o + z] * ec;
                sb[z] += b[o + z] * ec;
            }
        }
        let (mut ra, mut rb) = (sa.iter().sum::<f32>(), sb.iter().sum::<f32>());
        for o in n8..a.len() {
            let ec = e[o] * c[o];
            ra += a[o] * ec;
            rb += b[o] * ec;
        }
        (ra, rb)
    }
}

simd_fn! {
    /// One `(i, j)` term of the diagonal-block gradients of [`grams_backward`]:
    /// `dq_i += da E*k_j ; dkb_i += dm E*k_j ; dk_j += E*(da q_i + dm kb_i)`.
    #[allow(clippy::too_many_arguments)]
    fn diag_grad_term(
        da: f32,
        dm: f32,
        ev: &[f32],
        kj: &[f32],
        qi: &[f32],
        kbi: &[f32],
        dqi: &mut [f32],
        dkbi: &mut [f32],
        dkj: &mut [f32],
    ) {
        for (((q_, kb_), e_), k_) in dqi.iter_mut().zip(dkbi.iter_mut()).zip(ev).zip(kj) {
            let ek = e_ * k_;
            *q_ += da * ek;
            *kb_ += dm * ek;
        }
        for (((d_, e_), q_), kb_) in dkj.iter_mut().zip(ev).zip(qi).zip(kbi) {
            *d_ += e_ * (da * q_ + dm * kb_);
        }
    }
}

/// The decayed Gram matrices of the chunk: `M` (strictly lower, from `Kb` and `K`) and `A`
/// (lower with diagonal, from `Q` and `K`), both `[l, l]`, by sub-chunk blocks.
fn grams(
    qc: &[f32],
    kb: &[f32],
    kc: &[f32],
    dc: &Decay,
    l: usize,
    dk: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut m = vec![0.0f32; l * l];
    let mut a = vec![0.0f32; l * l];
    for jb in 0..l.div_ceil(SUB) {
        let (s, e) = sub_range(jb, l);
        // Diagonal block, elementwise.
        let mut ev = vec![0.0f32; dk];
        for i in s..e {
            for j in s..=i {
                let kj = &kc[j * dk..(j + 1) * dk];
                let (qi, kbi) = (&qc[i * dk..(i + 1) * dk], &kb[i * dk..(i + 1) * dk]);
                if j == i {
                    a[i * l + i] = dot(qi, kj);
                    continue;
                }
                exp_diff(dc.row(i), dc.row(j), &mut ev);
                (a[i * l + j], m[i * l + j]) = dot2_weighted(qi, kbi, &ev, kj);
            }
        }
        // Every row below the sub-chunk, against reference row e-1: two bounded factors.
        if e == l {
            continue;
        }
        let nb = l - e;
        let up = &dc.up[jb];
        let kr = hadamard(&kc[s * dk..e * dk], &dc.down[s * dk..e * dk]);
        let krm = rm(&kr, e - s, dk);
        let qu = hadamard(&qc[e * dk..], up);
        mm(&mut a[e * l + s..], l, rm(&qu, nb, dk), krm.t(), false, 1.0);
        let kbu = hadamard(&kb[e * dk..], up);
        let kbum = rm(&kbu, nb, dk);
        mm(&mut m[e * l + s..], l, kbum, krm.t(), false, 1.0);
    }
    (m, a)
}

/// Gradients through [`grams`] with the decay held fixed: from `dM` (strictly lower part read)
/// and `dA` (lower part with diagonal read), returns `(dQ, dKb, dK)` `[l, Dk]` each, where `dK`
/// sums K's role in both matrices. The gradient w.r.t. `Gam` is then `Q*dQ + Kb*dKb - K*dK`
/// (each `E_ijc` enters as `e^Gam_ic` on the row side and `e^-Gam_jc` on the column side).
#[allow(clippy::too_many_arguments)]
fn grams_backward(
    qc: &[f32],
    kb: &[f32],
    kc: &[f32],
    dc: &Decay,
    dm: &[f32],
    da: &[f32],
    l: usize,
    dk: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dq = vec![0.0f32; l * dk];
    let mut dkb = vec![0.0f32; l * dk];
    let mut dkk = vec![0.0f32; l * dk];
    let mut ev = vec![0.0f32; dk];
    for jb in 0..l.div_ceil(SUB) {
        let (s, e) = sub_range(jb, l);
        // Diagonal block: A_ij = sum_c q_ic E_ijc k_jc, M_ij = sum_c kb_ic E_ijc k_jc:
        // dq_i += dA_ij E_ij*k_j ; dkb_i += dM_ij E_ij*k_j ; dk_j += E_ij*(dA_ij q_i + dM_ij kb_i).
        for i in s..e {
            for j in s..=i {
                let x_a = da[i * l + j];
                let x_m = if j < i { dm[i * l + j] } else { 0.0 };
                if j == i {
                    ev.fill(1.0);
                } else {
                    exp_diff(dc.row(i), dc.row(j), &mut ev);
                }
                let (ri, rj) = (i * dk..(i + 1) * dk, j * dk..(j + 1) * dk);
                diag_grad_term(
                    x_a,
                    x_m,
                    &ev,
                    &kc[rj.clone()],
                    &qc[ri.clone()],
                    &kb[ri.clone()],
                    &mut dq[ri.clone()],
                    &mut dkb[ri],
                    &mut dkk[rj],
                );
            }
        }
        if e == l {
            continue;
        }
        // Off-diagonal blocks below the sub-chunk: A[e.., s..e] = Qu Kr^T, M[e.., s..e] = Kbu Kr^T
        // with Qu = Q*up, Kbu = Kb*up, Kr = K*down:
        // dQu = dA Kr, dKbu = dM Kr, dKr = dA^T Qu + dM^T Kbu ; then through the factors.
        let nb = l - e;
        let up = &dc.up[jb];
        let kr = hadamard(&kc[s * dk..e * dk], &dc.down[s * dk..e * dk]);
        let krm = rm(&kr, e - s, dk);
        let dam = MatRef::rm(&da[e * l + s..], nb, e - s, l);
        let dmm = MatRef::rm(&dm[e * l + s..], nb, e - s, l);
        let mut tmp = vec![0.0f32; nb * dk];
        mm(&mut tmp, dk, dam, krm, false, 1.0);
        for (i, t) in tmp.iter().enumerate() {
            dq[e * dk + i] += up[i] * t;
        }
        mm(&mut tmp, dk, dmm, krm, false, 1.0);
        for (i, t) in tmp.iter().enumerate() {
            dkb[e * dk + i] += up[i] * t;
        }
        let qu = hadamard(&qc[e * dk..], up);
        let kbu = hadamard(&kb[e * dk..], up);
        let mut dkr = vec![0.0f32; (e - s) * dk];
        mm(&mut dkr, dk, dam.t(), rm(&qu, nb, dk), false, 1.0);
        mm(&mut dkr, dk, dmm.t(), rm(&kbu, nb, dk), true, 1.0);
        for (i, t) in dkr.iter().enumerate() {
            dkk[s * dk + i] += dc.down[s * dk + i] * t;
        }
    }
    (dq, dkb, dkk)
}

/// Intra-chunk quantities that depend only on the chunk (not on the state).
struct ChunkPrep {
    l: usize,
    dc: Decay,
    /// `Kb = B*K`, `[l, Dk]`.
    kb: Vec<f32>,
    /// `T = (I+M)^-1`, `[l, l]` lower unitriangular.
    t: Vec<f32>,
    /// `A`, `[l, l]` lower with diagonal.
    a: Vec<f32>,
    /// `U = T (W*V)`, `[l, Dv]`.
    u: Vec<f32>,
    /// `Wm = T (Kb * e^Gam)`, `[l, Dk]`.
    wm: Vec<f32>,
}

/// Chunk inputs of one value head: `q`, `k` `[l, Dk]`, `v`, `w` `[l, Dv]`, `g`, `b` `[l, Dk]`.
struct ChunkIn<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: Vec<f32>,
    w: Vec<f32>,
    g: Vec<f32>,
    b: Vec<f32>,
}

fn prep_chunk(c: &ChunkIn, dk: usize, dv: usize) -> ChunkPrep {
    let l = c.g.len() / dk;
    let dc = decay(&c.g, l, dk);
    let kb = hadamard(&c.b, c.k);
    let (m, a) = grams(c.q, &kb, c.k, &dc, l, dk);
    // T = (I+M)^-1 by forward substitution: T_i = e_i - sum_{j<i} M_ij T_j.
    let mut t = vec![0.0f32; l * l];
    for i in 0..l {
        t[i * l + i] = 1.0;
        for j in 0..i {
            let mij = m[i * l + j];
            if mij != 0.0 {
                let (head, tail) = t.split_at_mut(i * l);
                let tj = &head[j * l..j * l + j + 1];
                let ti = &mut tail[..j + 1];
                for x in 0..=j {
                    ti[x] -= mij * tj[x];
                }
            }
        }
    }
    let wv = hadamard(&c.w, &c.v);
    let kbg = hadamard(&kb, &dc.eg);
    let tm = rm(&t, l, l);
    let mut u = vec![0.0f32; l * dv];
    mm(&mut u, dv, tm, rm(&wv, l, dv), false, 1.0);
    let mut wm = vec![0.0f32; l * dk];
    mm(&mut wm, dk, tm, rm(&kbg, l, dk), false, 1.0);
    ChunkPrep {
        l,
        dc,
        kb,
        t,
        a,
        u,
        wm,
    }
}

/// `D = U - Wm S0`.
fn chunk_delta(p: &ChunkPrep, s0: &[f32], dk: usize, dv: usize) -> Vec<f32> {
    let mut d = p.u.clone();
    mm(&mut d, dv, rm(&p.wm, p.l, dk), rm(s0, dk, dv), true, -1.0);
    d
}

/// Output rows of the chunk, `O = scale ((Q * e^Gam) S0 + A D)`, `[l, Dv]`.
fn chunk_output(
    qc: &[f32],
    p: &ChunkPrep,
    d: &[f32],
    s0: &[f32],
    scale: f32,
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    let l = p.l;
    let qg = hadamard(qc, &p.dc.eg);
    let mut o = vec![0.0f32; l * dv];
    mm(&mut o, dv, rm(&qg, l, dk), rm(s0, dk, dv), false, scale);
    mm(&mut o, dv, rm(&p.a, l, l), rm(d, l, dv), true, scale);
    o
}

/// `S <- Diag(e^Gam_L) S + (K * e^(Gam_L - Gam))^T D`, in place.
fn chunk_state_update(s: &mut [f32], kc: &[f32], p: &ChunkPrep, d: &[f32], dk: usize, dv: usize) {
    let l = p.l;
    let egl = &p.dc.eg[(l - 1) * dk..];
    for x in 0..dk {
        s[x * dv..(x + 1) * dv]
            .iter_mut()
            .for_each(|y| *y *= egl[x]);
    }
    let kd = hadamard(kc, &p.dc.ed);
    mm(s, dv, rm(&kd, l, dk).t(), rm(d, l, dv), true, 1.0);
}

/// Chunk `c0..c0+l` inputs of value head `j` of the sequence starting at `t0`.
#[allow(clippy::too_many_arguments)]
fn chunk_in<'a>(
    x: &Inputs,
    qk: &'a QkRows,
    t0: usize,
    c0: usize,
    l: usize,
    j: usize,
    s: RuleShape,
) -> ChunkIn<'a> {
    let (dk, dv, hv) = (s.dk, s.dv, s.hv);
    ChunkIn {
        q: &qk.q[c0 * dk..(c0 + l) * dk],
        k: &qk.k[c0 * dk..(c0 + l) * dk],
        v: load_rows(x.v, t0, c0, l, j, hv, dv),
        w: load_rows(x.w, t0, c0, l, j, hv, dv),
        g: load_rows(x.g, t0, c0, l, j, hv, dk),
        b: load_rows(x.b, t0, c0, l, j, hv, dk),
    }
}

fn initial(h0: Option<&[f32]>, n: usize, j: usize, hv: usize, st: usize) -> Vec<f32> {
    match h0 {
        Some(h) => h[(n * hv + j) * st..(n * hv + j + 1) * st].to_vec(),
        None => vec![0.0f32; st],
    }
}

fn chunked_forward(
    x: &Inputs,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    h0: Option<&[f32]>,
    output_final_state: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let (dk, dv, hv) = (s.dk, s.dv, s.hv);
    let r = hv / s.hk;
    let st = dk * dv;
    let outs: Vec<FwdOut> = tasks(seqs, s)
        .par_iter()
        .map(|&(n, kh)| {
            crate::ops::flush_denormals(|| {
                let range = seqs.range(n);
                let (t0, len) = (range.start, range.len());
                let qk = load_qk(x.q, x.k, range, kh, s, opts.l2norm_in_kernel);
                let mut out = FwdOut {
                    o: Vec::with_capacity(r),
                    state: Vec::with_capacity(r),
                };
                for j in kh * r..(kh + 1) * r {
                    let mut sj = initial(h0, n, j, hv, st);
                    let mut o = vec![0.0f32; len * dv];
                    let mut c0 = 0;
                    while c0 < len {
                        let l = CHUNK.min(len - c0);
                        let c = chunk_in(x, &qk, t0, c0, l, j, s);
                        let p = prep_chunk(&c, dk, dv);
                        let d = chunk_delta(&p, &sj, dk, dv);
                        let oc = chunk_output(c.q, &p, &d, &sj, opts.scale, dk, dv);
                        o[c0 * dv..(c0 + l) * dv].copy_from_slice(&oc);
                        chunk_state_update(&mut sj, c.k, &p, &d, dk, dv);
                        c0 += l;
                    }
                    out.o.push(o);
                    out.state.push(sj);
                }
                out
            })
        })
        .collect();

    assemble_forward(seqs, s, outs, output_final_state)
}

/// Per-chunk values kept from the recompute pass of backward.
struct ChunkKeep {
    p: ChunkPrep,
    d: Vec<f32>,
    s0: Vec<f32>,
    v: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
}

/// Gradient rows of one chunk of one value head, `[l, Dk]` or `[l, Dv]`.
struct ChunkGrads<'a> {
    /// Added into (summed over the value heads of the group).
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    /// Written.
    dv: &'a mut [f32],
    dg: &'a mut [f32],
    db: &'a mut [f32],
    dw: &'a mut [f32],
}

/// Gradients of one chunk (see [`ChunkGrads`]); replaces `ds` (gradient w.r.t. the chunk's end
/// state) with the gradient w.r.t. its start state.
#[allow(clippy::too_many_arguments)]
fn chunk_backward(
    qc: &[f32],
    kc: &[f32],
    c: &ChunkKeep,
    d_o: &[f32],
    ds: &mut [f32],
    scale: f32,
    dk: usize,
    dv: usize,
    gr: ChunkGrads,
) {
    let p = &c.p;
    let l = p.l;
    let (eg, ed) = (&p.dc.eg, &p.dc.ed);
    let egl = &eg[(l - 1) * dk..];
    let (s0, d) = (&c.s0, &c.d);
    // Views: S0 [Dk, Dv], D and dO [l, Dv].
    let (s0m, dm_, dom) = (rm(s0, dk, dv), rm(d, l, dv), rm(d_o, l, dv));
    let mut dgam = vec![0.0f32; l * dk];

    // --- S1 = Diag(egL) S0 + Kd^T D, Kd = K * ed, ed_i = e^(Gam_L - Gam_i):
    // dD = Kd dS1 ; dS0 = Diag(egL) dS1 ; dGam_L,x += egL_x <S0_x, dS1_x> ; dKd = D dS1^T ;
    // dK += ed * dKd ; dGam_i -= dKd_i * Kd_i ; dGam_L += sum_i dKd_i * Kd_i.
    let kd = hadamard(kc, ed);
    let mut dd = vec![0.0f32; l * dv];
    mm(&mut dd, dv, rm(&kd, l, dk), rm(ds, dk, dv), false, 1.0);
    let mut dkd = vec![0.0f32; l * dk];
    mm(&mut dkd, dk, dm_, rm(ds, dk, dv).t(), false, 1.0);
    let mut ds0 = vec![0.0f32; dk * dv];
    for x in 0..dk {
        let (s0x, dsx) = (&s0[x * dv..(x + 1) * dv], &ds[x * dv..(x + 1) * dv]);
        dgam[(l - 1) * dk + x] += egl[x] * dot(s0x, dsx);
        for y in 0..dv {
            ds0[x * dv + y] = egl[x] * dsx[y];
        }
    }
    for i in 0..l {
        for x in 0..dk {
            let o = i * dk + x;
            let a = dkd[o] * kd[o];
            dgam[(l - 1) * dk + x] += a;
            dgam[o] -= a;
            gr.dk[o] += ed[o] * dkd[o];
        }
    }

    // --- O = scale (Qg S0 + A D), Qg = Q * eg:
    // dD += scale A^T dO ; dS0 += scale Qg^T dO ; dQg = scale dO S0^T ;
    // dQ += eg * dQg ; dGam += dQg * Qg ; dA = scale dO D^T (lower part read below).
    mm(&mut dd, dv, rm(&p.a, l, l).t(), dom, true, scale);
    let qg = hadamard(qc, eg);
    mm(&mut ds0, dv, rm(&qg, l, dk).t(), dom, true, scale);
    let mut dqg = vec![0.0f32; l * dk];
    mm(&mut dqg, dk, dom, s0m.t(), false, scale);
    for o in 0..l * dk {
        dgam[o] += dqg[o] * qg[o];
        gr.dq[o] += eg[o] * dqg[o];
    }
    let mut da = vec![0.0f32; l * l];
    mm(&mut da, l, dom, dm_.t(), false, scale);

    // --- D = U - Wm S0: dU = dD ; dWm = -dD S0^T ; dS0 -= Wm^T dD.
    let ddm = rm(&dd, l, dv);
    mm(&mut ds0, dv, rm(&p.wm, l, dk).t(), ddm, true, -1.0);
    let mut dwm = vec![0.0f32; l * dk];
    mm(&mut dwm, dk, ddm, s0m.t(), false, -1.0);

    // --- U = T Wv, Wm = T Kbg (Wv = W*V, Kbg = Kb*eg):
    // dT = dU Wv^T + dWm Kbg^T ; dWv = T^T dU ; dKbg = T^T dWm.
    let wv = hadamard(&c.w, &c.v);
    let kbg = hadamard(&p.kb, eg);
    let tm = rm(&p.t, l, l);
    let mut dt = vec![0.0f32; l * l];
    mm(&mut dt, l, ddm, rm(&wv, l, dv).t(), false, 1.0);
    mm(&mut dt, l, rm(&dwm, l, dk), rm(&kbg, l, dk).t(), true, 1.0);
    let mut dwv = vec![0.0f32; l * dv];
    mm(&mut dwv, dv, tm.t(), ddm, false, 1.0);
    let mut dkbg = vec![0.0f32; l * dk];
    mm(&mut dkbg, dk, tm.t(), rm(&dwm, l, dk), false, 1.0);
    // Wv = W*V: dW = dWv * V ; dV = dWv * W.
    gr.dw.copy_from_slice(&hadamard(&dwv, &c.v));
    gr.dv.copy_from_slice(&hadamard(&dwv, &c.w));
    // Kbg = Kb * eg: dKb = eg * dKbg (completed below) ; dGam += dKbg * Kbg.
    let mut dkb = vec![0.0f32; l * dk];
    for o in 0..l * dk {
        dgam[o] += dkbg[o] * kbg[o];
        dkb[o] = eg[o] * dkbg[o];
    }

    // --- T = (I+M)^-1: dM = -T^T dT T^T (only the strictly lower part is read).
    let mut tmp = vec![0.0f32; l * l];
    mm(&mut tmp, l, tm.t(), rm(&dt, l, l), false, 1.0);
    let mut dm = vec![0.0f32; l * l];
    mm(&mut dm, l, rm(&tmp, l, l), tm.t(), false, -1.0);

    // --- M_ij = sum_c Kb_ic E_ijc K_jc, A_ij = sum_c Q_ic E_ijc K_jc, E_ijc = e^(Gam_ic - Gam_jc):
    // with (dQa, dKbm, dKg) the gradients at fixed decay,
    // dGam_ic += Q_ic dQa_ic + Kb_ic dKbm_ic - K_ic dKg_ic.
    let (dqa, dkbm, dkg) = grams_backward(qc, &p.kb, kc, &p.dc, &dm, &da, l, dk);
    for o in 0..l * dk {
        dgam[o] += qc[o] * dqa[o] + p.kb[o] * dkbm[o] - kc[o] * dkg[o];
        gr.dq[o] += dqa[o];
        gr.dk[o] += dkg[o];
        dkb[o] += dkbm[o];
        // Kb = B*K: dB = dKb * K ; dK += dKb * B.
        gr.db[o] = dkb[o] * kc[o];
        gr.dk[o] += dkb[o] * c.b[o];
    }

    // --- Gam = cumsum(g) per channel: dg_j = sum_{i >= j} dGam_i.
    let mut acc = vec![0.0f32; dk];
    for i in (0..l).rev() {
        for x in 0..dk {
            acc[x] += dgam[i * dk + x];
            gr.dg[i * dk + x] = acc[x];
        }
    }
    ds.copy_from_slice(&ds0);
}

struct BwdOut {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<Vec<f32>>,
    dg: Vec<Vec<f32>>,
    db: Vec<Vec<f32>>,
    dw: Vec<Vec<f32>>,
    dh0: Vec<Vec<f32>>,
}

fn chunked_backward(
    x: &Inputs,
    seqs: &Seqs,
    s: RuleShape,
    opts: RuleOpts,
    h0: Option<&[f32]>,
    d_o: &[f32],
    dht: Option<&[f32]>,
) -> Grads {
    let (dk, dv, hv, hk) = (s.dk, s.dv, s.hv, s.hk);
    let r = hv / hk;
    let st = dk * dv;
    let outs: Vec<BwdOut> = tasks(seqs, s)
        .par_iter()
        .map(|&(n, kh)| {
            crate::ops::flush_denormals(|| {
                let range = seqs.range(n);
                let (t0, len) = (range.start, range.len());
                let qk = load_qk(x.q, x.k, range, kh, s, opts.l2norm_in_kernel);
                let mut out = BwdOut {
                    dq: vec![0.0; len * dk],
                    dk: vec![0.0; len * dk],
                    dv: Vec::with_capacity(r),
                    dg: Vec::with_capacity(r),
                    db: Vec::with_capacity(r),
                    dw: Vec::with_capacity(r),
                    dh0: Vec::with_capacity(r),
                };
                for j in kh * r..(kh + 1) * r {
                    // Recompute pass: chunk-start states and the chunk quantities.
                    let mut sj = initial(h0, n, j, hv, st);
                    let mut keep = Vec::with_capacity(len.div_ceil(CHUNK));
                    let mut c0 = 0;
                    while c0 < len {
                        let l = CHUNK.min(len - c0);
                        let c = chunk_in(x, &qk, t0, c0, l, j, s);
                        let mut p = prep_chunk(&c, dk, dv);
                        let d = chunk_delta(&p, &sj, dk, dv);
                        p.u = Vec::new(); // not needed by backward
                        let s0 = sj.clone();
                        chunk_state_update(&mut sj, c.k, &p, &d, dk, dv);
                        keep.push(ChunkKeep {
                            p,
                            d,
                            s0,
                            v: c.v,
                            w: c.w,
                            b: c.b,
                        });
                        c0 += l;
                    }
                    // Reverse pass.
                    let mut ds = match dht {
                        Some(y) => y[(n * hv + j) * st..(n * hv + j + 1) * st].to_vec(),
                        None => vec![0.0f32; st],
                    };
                    let mut dvj = vec![0.0f32; len * dv];
                    let mut dwj = vec![0.0f32; len * dv];
                    let mut dgj = vec![0.0f32; len * dk];
                    let mut dbj = vec![0.0f32; len * dk];
                    for (ci, c) in keep.iter().enumerate().rev() {
                        let c0 = ci * CHUNK;
                        let l = c.p.l;
                        let doc = load_rows(d_o, t0, c0, l, j, hv, dv);
                        let (rk, rv) = (c0 * dk..(c0 + l) * dk, c0 * dv..(c0 + l) * dv);
                        let gr = ChunkGrads {
                            dq: &mut out.dq[rk.clone()],
                            dk: &mut out.dk[rk.clone()],
                            dv: &mut dvj[rv.clone()],
                            dg: &mut dgj[rk.clone()],
                            db: &mut dbj[rk.clone()],
                            dw: &mut dwj[rv],
                        };
                        chunk_backward(
                            &qk.q[rk.clone()],
                            &qk.k[rk],
                            c,
                            &doc,
                            &mut ds,
                            opts.scale,
                            dk,
                            dv,
                            gr,
                        );
                    }
                    out.dv.push(dvj);
                    out.dg.push(dgj);
                    out.db.push(dbj);
                    out.dw.push(dwj);
                    out.dh0.push(ds);
                }
                if let Some(raw) = &qk.raw {
                    // Through the in-kernel L2 norm.
                    let mut dqr = vec![0.0f32; len * dk];
                    let mut dkr = vec![0.0f32; len * dk];
                    for i in 0..len {
                        let sl = i * dk..(i + 1) * dk;
                        let (q_, dq_) = (&raw.q[sl.clone()], &out.dq[sl.clone()]);
                        l2norm_row_backward(q_, raw.q_rstd[i], dq_, &mut dqr[sl.clone()]);
                        let (k_, dk_) = (&raw.k[sl.clone()], &out.dk[sl.clone()]);
                        l2norm_row_backward(k_, raw.k_rstd[i], dk_, &mut dkr[sl]);
                    }
                    out.dq = dqr;
                    out.dk = dkr;
                }
                out
            })
        })
        .collect();

    let n_tok = seqs.tokens();
    let mut grads = Grads {
        dq: vec![0.0; n_tok * hk * dk],
        dk: vec![0.0; n_tok * hk * dk],
        dv: vec![0.0; n_tok * hv * dv],
        dg: vec![0.0; n_tok * hv * dk],
        db: vec![0.0; n_tok * hv * dk],
        dw: vec![0.0; n_tok * hv * dv],
        dh0: h0.map(|_| vec![0.0; seqs.count() * hv * st]),
    };
    for (&(n, kh), out) in tasks(seqs, s).iter().zip(outs) {
        let t0 = seqs.range(n).start;
        for (i, (a, b)) in out
            .dq
            .chunks_exact(dk)
            .zip(out.dk.chunks_exact(dk))
            .enumerate()
        {
            let dst = ((t0 + i) * hk + kh) * dk;
            grads.dq[dst..dst + dk].copy_from_slice(a);
            grads.dk[dst..dst + dk].copy_from_slice(b);
        }
        for jj in 0..r {
            let j = kh * r + jj;
            let scatter = |dst: &mut [f32], src: &[f32], d: usize| {
                for (i, row) in src.chunks_exact(d).enumerate() {
                    let o = ((t0 + i) * hv + j) * d;
                    dst[o..o + d].copy_from_slice(row);
                }
            };
            scatter(&mut grads.dv, &out.dv[jj], dv);
            scatter(&mut grads.dw, &out.dw[jj], dv);
            scatter(&mut grads.dg, &out.dg[jj], dk);
            scatter(&mut grads.db, &out.db[jj], dk);
            if let Some(d) = grads.dh0.as_mut() {
                d[(n * hv + j) * st..(n * hv + j + 1) * st].copy_from_slice(&out.dh0[jj]);
            }
        }
    }
    grads
}

/// Gradients of the GDN2 rule's inputs (same layouts as the inputs).
#[derive(Clone, Debug)]
pub struct Grads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dg: Vec<f32>,
    pub db: Vec<f32>,
    pub dw: Vec<f32>,
    /// Gradient of the initial state, when one was given.
    pub dh0: Option<Vec<f32>>,
}

// ---- validated entries on host slices (the op's `forward` / `backward` dispatch here) ----

/// Shared input checks of forward and backward.
#[allow(clippy::too_many_arguments)]
fn check_inputs(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    b: &[f32],
    w: &[f32],
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&[f32]>,
) -> Result<()> {
    if s.hk == 0 || s.hv == 0 || s.dk == 0 || s.dv == 0 {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule: zero dimension in {s:?}"
        )));
    }
    if !s.hv.is_multiple_of(s.hk) {
        return Err(GdnError::Invalid(format!(
            "gdn2 rule: value heads ({}) must be a multiple of key heads ({})",
            s.hv, s.hk
        )));
    }
    let n = seqs.tokens();
    check_len("q", q, n * s.hk * s.dk)?;
    check_len("k", k, n * s.hk * s.dk)?;
    check_len("v", v, n * s.hv * s.dv)?;
    check_len("g", g, n * s.hv * s.dk)?;
    check_len("b", b, n * s.hv * s.dk)?;
    check_len("w", w, n * s.hv * s.dv)?;
    if let Some(h0) = h0 {
        check_len("initial_state", h0, seqs.count() * s.hv * s.dk * s.dv)?;
    }
    Ok(())
}

/// Forward. Returns `o` `[tokens, Hv, Dv]` and, if `output_final_state`, the final states
/// `[N, Hv, Dk, Dv]`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    b: &[f32],
    w: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    output_final_state: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    check_inputs(q, k, v, g, b, w, seqs, shape, initial_state)?;
    let x = Inputs { q, k, v, g, b, w };
    Ok(chunked_forward(
        &x,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
    ))
}

/// Backward from `d_o` `[tokens, Hv, Dv]` and optionally the gradient of the final states
/// `[N, Hv, Dk, Dv]`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    b: &[f32],
    w: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    d_o: &[f32],
    d_final_state: Option<&[f32]>,
) -> Result<Grads> {
    check_inputs(q, k, v, g, b, w, seqs, shape, initial_state)?;
    check_len("d_o", d_o, seqs.tokens() * shape.hv * shape.dv)?;
    if let Some(d) = d_final_state {
        check_len(
            "d_final_state",
            d,
            seqs.count() * shape.hv * shape.dk * shape.dv,
        )?;
    }
    let x = Inputs { q, k, v, g, b, w };
    Ok(chunked_backward(
        &x,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
    ))
}
