//! CPU chunked gated delta rule (f32). One rayon task per (sequence, key head); the task runs the
//! `Hv/Hk` value heads that read that key head one after another, so the gradients of q and k
//! are summed over the group in a fixed order (no atomics, bitwise reproducible).
//!
//! Within a chunk of `L <= 64` rows (local cumulative log-decay `gam`, start state `S0`):
//!
//! ```text
//! M   = strict_lower(diag(beta) K K^T * Gamma),  Gamma_ij = exp(gam_i - gam_j)
//! T   = (I + M)^-1                                  (forward substitution)
//! U   = T diag(beta) V,   W = T diag(beta exp(gam)) K
//! D   = U - W S0                                    (the per-token delta-rule updates)
//! O   = scale (diag(exp(gam)) Q S0 + lower_incl(Q K^T * Gamma) D)
//! S1  = exp(gam_L) S0 + (diag(exp(gam_L - gam)) K)^T D
//! ```
//!
//! Backward recomputes the chunk-start states in a forward pass over the chunks (keeping T, W and
//! D per chunk), then walks the chunks in reverse carrying dS. The derivation of every line is in
//! the comments of `chunk_backward`.

use crate::error::{GdnError, Result};
use crate::ops::check_len;
use rayon::prelude::*;

use super::{RuleOpts, RuleShape, CHUNK};
use crate::ops::common::gemm::MatRef;
use crate::ops::common::l2norm::l2norm_row_backward;
use crate::ops::common::rule_cpu::{
    assemble_forward, dot, load_qk, load_rows, mm, tasks, FwdOut, RawQk,
};
use crate::seqs::Seqs;

fn load_scalars(x: &[f32], t0: usize, c0: usize, l: usize, j: usize, h: usize) -> Vec<f32> {
    (0..l).map(|i| x[(t0 + c0 + i) * h + j]).collect()
}

/// Intra-chunk quantities that depend only on the chunk (not on the state).
struct ChunkPrep {
    l: usize,
    gam: Vec<f32>,
    /// `T = (I+M)^-1`, `[l, l]` lower unitriangular.
    t: Vec<f32>,
    /// `U = T diag(beta) V`, `[l, Dv]`.
    u: Vec<f32>,
    /// `W = T diag(beta e^gam) K`, `[l, Dk]`.
    w: Vec<f32>,
}

fn prep_chunk(kc: &[f32], vc: &[f32], gc: &[f32], bc: &[f32], dk: usize, dv: usize) -> ChunkPrep {
    let l = gc.len();
    let mut gam = vec![0.0f32; l];
    let mut acc = 0.0f32;
    for i in 0..l {
        acc += gc[i];
        gam[i] = acc;
    }
    // P = K K^T, then M = strict_lower(beta_i P_ij exp(gam_i - gam_j)).
    let mut m = vec![0.0f32; l * l];
    let km = MatRef::rm(kc, l, dk, dk);
    mm(&mut m, l, km, km.t(), false, 1.0);
    for i in 0..l {
        for j in 0..l {
            m[i * l + j] = if j < i {
                bc[i] * m[i * l + j] * (gam[i] - gam[j]).exp()
            } else {
                0.0
            };
        }
    }
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
                for c in 0..=j {
                    ti[c] -= mij * tj[c];
                }
            }
        }
    }
    let mut vb = vc.to_vec();
    let mut kb = kc.to_vec();
    for i in 0..l {
        vb[i * dv..(i + 1) * dv]
            .iter_mut()
            .for_each(|x| *x *= bc[i]);
        let s = bc[i] * gam[i].exp();
        kb[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= s);
    }
    let tm = MatRef::rm(&t, l, l, l);
    let mut u = vec![0.0f32; l * dv];
    mm(&mut u, dv, tm, MatRef::rm(&vb, l, dv, dv), false, 1.0);
    let mut w = vec![0.0f32; l * dk];
    mm(&mut w, dk, tm, MatRef::rm(&kb, l, dk, dk), false, 1.0);
    ChunkPrep { l, gam, t, u, w }
}

/// `D = U - W S0`.
fn chunk_delta(p: &ChunkPrep, s0: &[f32], dk: usize, dv: usize) -> Vec<f32> {
    let mut d = p.u.clone();
    mm(
        &mut d,
        dv,
        MatRef::rm(&p.w, p.l, dk, dk),
        MatRef::rm(s0, dk, dv, dv),
        true,
        -1.0,
    );
    d
}

/// `A_ij = (q_i . k_j) exp(gam_i - gam_j)` for `j <= i`, else 0.
fn chunk_qk(qc: &[f32], kc: &[f32], gam: &[f32], dk: usize) -> Vec<f32> {
    let l = gam.len();
    let mut a = vec![0.0f32; l * l];
    mm(
        &mut a,
        l,
        MatRef::rm(qc, l, dk, dk),
        MatRef::rm(kc, l, dk, dk).t(),
        false,
        1.0,
    );
    for i in 0..l {
        for j in 0..l {
            a[i * l + j] = if j <= i {
                a[i * l + j] * (gam[i] - gam[j]).exp()
            } else {
                0.0
            };
        }
    }
    a
}

/// Output rows of the chunk, `[l, Dv]`.
#[allow(clippy::too_many_arguments)]
fn chunk_output(
    qc: &[f32],
    kc: &[f32],
    p: &ChunkPrep,
    d: &[f32],
    s0: &[f32],
    scale: f32,
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    let l = p.l;
    let mut qg = qc.to_vec();
    for i in 0..l {
        let e = p.gam[i].exp();
        qg[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= e);
    }
    let mut o = vec![0.0f32; l * dv];
    mm(
        &mut o,
        dv,
        MatRef::rm(&qg, l, dk, dk),
        MatRef::rm(s0, dk, dv, dv),
        false,
        scale,
    );
    let a = chunk_qk(qc, kc, &p.gam, dk);
    mm(
        &mut o,
        dv,
        MatRef::rm(&a, l, l, l),
        MatRef::rm(d, l, dv, dv),
        true,
        scale,
    );
    o
}

/// `S <- exp(gam_L) S + (diag(exp(gam_L - gam)) K)^T D`, in place.
fn chunk_state_update(s: &mut [f32], kc: &[f32], p: &ChunkPrep, d: &[f32], dk: usize, dv: usize) {
    let l = p.l;
    let gl = p.gam[l - 1];
    let el = gl.exp();
    s.iter_mut().for_each(|x| *x *= el);
    let mut kd = kc.to_vec();
    for i in 0..l {
        let e = (gl - p.gam[i]).exp();
        kd[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= e);
    }
    mm(
        s,
        dv,
        MatRef::rm(&kd, l, dk, dk).t(),
        MatRef::rm(d, l, dv, dv),
        true,
        1.0,
    );
}

#[allow(clippy::too_many_arguments)]
fn chunked_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
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
                let qk = load_qk(q, k, range, kh, s, opts.l2norm_in_kernel);
                let mut out = FwdOut {
                    o: Vec::with_capacity(r),
                    state: Vec::with_capacity(r),
                };
                for j in kh * r..(kh + 1) * r {
                    let mut st_j = match h0 {
                        Some(h) => h[(n * hv + j) * st..(n * hv + j + 1) * st].to_vec(),
                        None => vec![0.0f32; st],
                    };
                    let mut o = vec![0.0f32; len * dv];
                    let mut c0 = 0;
                    while c0 < len {
                        let l = CHUNK.min(len - c0);
                        let qc = &qk.q[c0 * dk..(c0 + l) * dk];
                        let kc = &qk.k[c0 * dk..(c0 + l) * dk];
                        let vc = load_rows(v, t0, c0, l, j, hv, dv);
                        let gc = load_scalars(g, t0, c0, l, j, hv);
                        let bc = load_scalars(beta, t0, c0, l, j, hv);
                        let p = prep_chunk(kc, &vc, &gc, &bc, dk, dv);
                        let d = chunk_delta(&p, &st_j, dk, dv);
                        let oc = chunk_output(qc, kc, &p, &d, &st_j, opts.scale, dk, dv);
                        o[c0 * dv..(c0 + l) * dv].copy_from_slice(&oc);
                        chunk_state_update(&mut st_j, kc, &p, &d, dk, dv);
                        c0 += l;
                    }
                    out.o.push(o);
                    out.state.push(st_j);
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
    vc: Vec<f32>,
    bc: Vec<f32>,
}

/// Gradients of one chunk. Adds into `dq`, `dk` (rows of this chunk, `[l, Dk]`), writes `dv`,
/// `dg`, `dbeta` rows, and replaces `ds` (gradient w.r.t. the chunk's end state) with the
/// gradient w.r.t. its start state.
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
    dq: &mut [f32],
    dkk: &mut [f32],
    dvv: &mut [f32],
    dg: &mut [f32],
    db: &mut [f32],
) {
    let p = &c.p;
    let l = p.l;
    let gam = &p.gam;
    let gl = gam[l - 1];
    let eg: Vec<f32> = gam.iter().map(|x| x.exp()).collect();
    let ed: Vec<f32> = gam.iter().map(|x| (gl - x).exp()).collect();
    let egl = gl.exp();
    let s0 = &c.s0;
    let d = &c.d;
    let mut dgam = vec![0.0f32; l];

    // --- S1 = egL S0 + Kd^T D, Kd = diag(ed) K.
    // dD = Kd dS1 ; dS0 = egL dS1 ; dgam_L += egL <S0, dS1> ; dKd = D dS1^T.
    let mut kd = kc.to_vec();
    for i in 0..l {
        kd[i * dk..(i + 1) * dk]
            .iter_mut()
            .for_each(|x| *x *= ed[i]);
    }
    let mut dd = vec![0.0f32; l * dv];
    mm(
        &mut dd,
        dv,
        MatRef::rm(&kd, l, dk, dk),
        MatRef::rm(ds, dk, dv, dv),
        false,
        1.0,
    );
    let mut dkd = vec![0.0f32; l * dk];
    mm(
        &mut dkd,
        dk,
        MatRef::rm(d, l, dv, dv),
        MatRef::rm(ds, dk, dv, dv).t(),
        false,
        1.0,
    );
    dgam[l - 1] += egl * dot(s0, ds);
    for i in 0..l {
        let a = dot(&dkd[i * dk..(i + 1) * dk], &kd[i * dk..(i + 1) * dk]);
        dgam[l - 1] += a;
        dgam[i] -= a;
        for x in 0..dk {
            dkk[i * dk + x] += ed[i] * dkd[i * dk + x];
        }
    }
    let mut ds0: Vec<f32> = ds.iter().map(|x| x * egl).collect();

    // --- O = scale (diag(eg) Q S0 + A D), A_ij = (q_i.k_j) Gamma_ij (j <= i).
    // dD += scale A^T dO ; dS0 += scale (diag(eg) Q)^T dO ; dQg = scale dO S0^T.
    let a = chunk_qk(qc, kc, gam, dk);
    mm(
        &mut dd,
        dv,
        MatRef::rm(&a, l, l, l).t(),
        MatRef::rm(d_o, l, dv, dv),
        true,
        scale,
    );
    let mut qg = qc.to_vec();
    for i in 0..l {
        qg[i * dk..(i + 1) * dk]
            .iter_mut()
            .for_each(|x| *x *= eg[i]);
    }
    mm(
        &mut ds0,
        dv,
        MatRef::rm(&qg, l, dk, dk).t(),
        MatRef::rm(d_o, l, dv, dv),
        true,
        scale,
    );
    let mut dqg = vec![0.0f32; l * dk];
    mm(
        &mut dqg,
        dk,
        MatRef::rm(d_o, l, dv, dv),
        MatRef::rm(s0, dk, dv, dv).t(),
        false,
        scale,
    );
    for i in 0..l {
        // Qg_i = eg_i q_i: dq_i += eg_i dQg_i ; dgam_i += <dQg_i, Qg_i>.
        dgam[i] += dot(&dqg[i * dk..(i + 1) * dk], &qg[i * dk..(i + 1) * dk]);
        for x in 0..dk {
            dq[i * dk + x] += eg[i] * dqg[i * dk + x];
        }
    }
    // dA = scale dO D^T (j <= i). With Gamma-weighted dAg = dA * Gamma:
    // dQ += dAg K ; dK += dAg^T Q ; dgam_i += sum_j dA_ij A_ij ; dgam_j -= sum_i dA_ij A_ij.
    let mut da = vec![0.0f32; l * l];
    mm(
        &mut da,
        l,
        MatRef::rm(d_o, l, dv, dv),
        MatRef::rm(d, l, dv, dv).t(),
        false,
        scale,
    );
    let mut dag = vec![0.0f32; l * l];
    for i in 0..l {
        for j in 0..=i {
            let x = da[i * l + j];
            let e = x * a[i * l + j];
            dgam[i] += e;
            dgam[j] -= e;
            dag[i * l + j] = x * (gam[i] - gam[j]).exp();
        }
    }
    let dagm = MatRef::rm(&dag, l, l, l);
    mm(dq, dk, dagm, MatRef::rm(kc, l, dk, dk), true, 1.0);
    mm(dkk, dk, dagm.t(), MatRef::rm(qc, l, dk, dk), true, 1.0);

    // --- D = U - W S0: dU = dD ; dW = -dD S0^T ; dS0 -= W^T dD.
    mm(
        &mut ds0,
        dv,
        MatRef::rm(&p.w, l, dk, dk).t(),
        MatRef::rm(&dd, l, dv, dv),
        true,
        -1.0,
    );
    let mut dw = vec![0.0f32; l * dk];
    mm(
        &mut dw,
        dk,
        MatRef::rm(&dd, l, dv, dv),
        MatRef::rm(s0, dk, dv, dv).t(),
        false,
        -1.0,
    );

    // --- U = T Vb, W = T Kb (Vb = diag(beta) V, Kb = diag(beta eg) K):
    // dT = dU Vb^T + dW Kb^T ; dVb = T^T dU ; dKb = T^T dW.
    let bc = &c.bc;
    let vc = &c.vc;
    let mut vb = vc.clone();
    let mut kb = kc.to_vec();
    for i in 0..l {
        vb[i * dv..(i + 1) * dv]
            .iter_mut()
            .for_each(|x| *x *= bc[i]);
        let sc = bc[i] * eg[i];
        kb[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= sc);
    }
    let tm = MatRef::rm(&p.t, l, l, l);
    let mut dt = vec![0.0f32; l * l];
    mm(
        &mut dt,
        l,
        MatRef::rm(&dd, l, dv, dv),
        MatRef::rm(&vb, l, dv, dv).t(),
        false,
        1.0,
    );
    mm(
        &mut dt,
        l,
        MatRef::rm(&dw, l, dk, dk),
        MatRef::rm(&kb, l, dk, dk).t(),
        true,
        1.0,
    );
    let mut dvb = vec![0.0f32; l * dv];
    mm(&mut dvb, dv, tm.t(), MatRef::rm(&dd, l, dv, dv), false, 1.0);
    let mut dkb = vec![0.0f32; l * dk];
    mm(&mut dkb, dk, tm.t(), MatRef::rm(&dw, l, dk, dk), false, 1.0);
    for i in 0..l {
        // v_i: dv_i = beta_i dVb_i ; dbeta_i += <dVb_i, v_i>.
        let dvbi = &dvb[i * dv..(i + 1) * dv];
        db[i] += dot(dvbi, &vc[i * dv..(i + 1) * dv]);
        for x in 0..dv {
            dvv[i * dv + x] = bc[i] * dvbi[x];
        }
        // Kb_i = beta_i eg_i k_i: dk_i += beta_i eg_i dKb_i ; dbeta_i += eg_i <dKb_i, k_i> ;
        // dgam_i += <dKb_i, Kb_i>.
        let dkbi = &dkb[i * dk..(i + 1) * dk];
        let kd_ = dot(dkbi, &kc[i * dk..(i + 1) * dk]);
        db[i] += eg[i] * kd_;
        dgam[i] += bc[i] * eg[i] * kd_;
        let sc = bc[i] * eg[i];
        for x in 0..dk {
            dkk[i * dk + x] += sc * dkbi[x];
        }
    }

    // --- T = (I+M)^-1: dM = -T^T dT T^T, strictly lower part.
    let mut tmp = vec![0.0f32; l * l];
    mm(&mut tmp, l, tm.t(), MatRef::rm(&dt, l, l, l), false, 1.0);
    let mut dm = vec![0.0f32; l * l];
    mm(&mut dm, l, MatRef::rm(&tmp, l, l, l), tm.t(), false, -1.0);

    // --- M_ij = beta_i P_ij Gamma_ij (j < i), P = K K^T:
    // dbeta_i += sum_j dM_ij P_ij Gamma_ij ; dgam_i += sum_j dM_ij M_ij ; dgam_j -= same ;
    // dP_ij = dM_ij beta_i Gamma_ij ; dK += (dP + dP^T) K.
    let mut pk = vec![0.0f32; l * l];
    let km = MatRef::rm(kc, l, dk, dk);
    mm(&mut pk, l, km, km.t(), false, 1.0);
    let mut dp = vec![0.0f32; l * l];
    for i in 0..l {
        for j in 0..i {
            let x = dm[i * l + j];
            let pg = pk[i * l + j] * (gam[i] - gam[j]).exp();
            db[i] += x * pg;
            let f = x * bc[i] * pg;
            dgam[i] += f;
            dgam[j] -= f;
            let v = x * bc[i] * (gam[i] - gam[j]).exp();
            dp[i * l + j] = v;
        }
    }
    for i in 0..l {
        for j in 0..i {
            dp[j * l + i] = dp[i * l + j];
        }
    }
    mm(dkk, dk, MatRef::rm(&dp, l, l, l), km, true, 1.0);

    // --- gam = cumsum(g): dg_j = sum_{i >= j} dgam_i.
    let mut acc = 0.0f32;
    for i in (0..l).rev() {
        acc += dgam[i];
        dg[i] = acc;
    }
    ds.copy_from_slice(&ds0);
}

struct BwdOut {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<Vec<f32>>,
    dg: Vec<Vec<f32>>,
    db: Vec<Vec<f32>>,
    dh0: Vec<Vec<f32>>,
}

#[allow(clippy::too_many_arguments)]
fn chunked_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
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
                let qk = load_qk(q, k, range, kh, s, opts.l2norm_in_kernel);
                let mut out = BwdOut {
                    dq: vec![0.0; len * dk],
                    dk: vec![0.0; len * dk],
                    dv: Vec::with_capacity(r),
                    dg: Vec::with_capacity(r),
                    db: Vec::with_capacity(r),
                    dh0: Vec::with_capacity(r),
                };
                for j in kh * r..(kh + 1) * r {
                    // Recompute pass: chunk-start states and the chunk quantities.
                    let mut sj = match h0 {
                        Some(h) => h[(n * hv + j) * st..(n * hv + j + 1) * st].to_vec(),
                        None => vec![0.0f32; st],
                    };
                    let mut keep = Vec::with_capacity(len.div_ceil(CHUNK));
                    let mut c0 = 0;
                    while c0 < len {
                        let l = CHUNK.min(len - c0);
                        let kc = &qk.k[c0 * dk..(c0 + l) * dk];
                        let vc = load_rows(v, t0, c0, l, j, hv, dv);
                        let gc = load_scalars(g, t0, c0, l, j, hv);
                        let bc = load_scalars(beta, t0, c0, l, j, hv);
                        let p = prep_chunk(kc, &vc, &gc, &bc, dk, dv);
                        let d = chunk_delta(&p, &sj, dk, dv);
                        let s0 = sj.clone();
                        chunk_state_update(&mut sj, kc, &p, &d, dk, dv);
                        keep.push(ChunkKeep { p, d, s0, vc, bc });
                        c0 += l;
                    }
                    // Reverse pass.
                    let mut ds = match dht {
                        Some(x) => x[(n * hv + j) * st..(n * hv + j + 1) * st].to_vec(),
                        None => vec![0.0f32; st],
                    };
                    let mut dvj = vec![0.0f32; len * dv];
                    let mut dgj = vec![0.0f32; len];
                    let mut dbj = vec![0.0f32; len];
                    for (ci, c) in keep.iter().enumerate().rev() {
                        let c0 = ci * CHUNK;
                        let l = c.p.l;
                        let doc = load_rows(d_o, t0, c0, l, j, hv, dv);
                        chunk_backward(
                            &qk.q[c0 * dk..(c0 + l) * dk],
                            &qk.k[c0 * dk..(c0 + l) * dk],
                            c,
                            &doc,
                            &mut ds,
                            opts.scale,
                            dk,
                            dv,
                            &mut out.dq[c0 * dk..(c0 + l) * dk],
                            &mut out.dk[c0 * dk..(c0 + l) * dk],
                            &mut dvj[c0 * dv..(c0 + l) * dv],
                            &mut dgj[c0..c0 + l],
                            &mut dbj[c0..c0 + l],
                        );
                    }
                    out.dv.push(dvj);
                    out.dg.push(dgj);
                    out.db.push(dbj);
                    out.dh0.push(ds);
                }
                if let Some(RawQk {
                    q: qr,
                    k: kr,
                    q_rstd: qrs,
                    k_rstd: krs,
                }) = &qk.raw
                {
                    // Through the in-kernel L2 norm: dx = rstd (dy - y <dy, y>).
                    let mut dqr = vec![0.0f32; len * dk];
                    let mut dkr = vec![0.0f32; len * dk];
                    for i in 0..len {
                        let sl = i * dk..(i + 1) * dk;
                        l2norm_row_backward(
                            &qr[sl.clone()],
                            qrs[i],
                            &out.dq[sl.clone()],
                            &mut dqr[sl.clone()],
                        );
                        l2norm_row_backward(
                            &kr[sl.clone()],
                            krs[i],
                            &out.dk[sl.clone()],
                            &mut dkr[sl],
                        );
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
        dg: vec![0.0; n_tok * hv],
        dbeta: vec![0.0; n_tok * hv],
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
            for (i, row) in out.dv[jj].chunks_exact(dv).enumerate() {
                let dst = ((t0 + i) * hv + j) * dv;
                grads.dv[dst..dst + dv].copy_from_slice(row);
            }
            for i in 0..out.dg[jj].len() {
                grads.dg[(t0 + i) * hv + j] = out.dg[jj][i];
                grads.dbeta[(t0 + i) * hv + j] = out.db[jj][i];
            }
            if let Some(d) = grads.dh0.as_mut() {
                d[(n * hv + j) * st..(n * hv + j + 1) * st].copy_from_slice(&out.dh0[jj]);
            }
        }
    }
    grads
}

/// Gradients of the rule's inputs.
#[derive(Clone, Debug)]
pub struct Grads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dg: Vec<f32>,
    pub dbeta: Vec<f32>,
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
    beta: &[f32],
    seqs: &Seqs,
    s: RuleShape,
    h0: Option<&[f32]>,
) -> Result<()> {
    if s.hk == 0 || s.hv == 0 || s.dk == 0 || s.dv == 0 {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: zero dimension in {s:?}"
        )));
    }
    if !s.hv.is_multiple_of(s.hk) {
        return Err(GdnError::Invalid(format!(
            "gated delta rule: value heads ({}) must be a multiple of key heads ({})",
            s.hv, s.hk
        )));
    }
    let n = seqs.tokens();
    check_len("q", q, n * s.hk * s.dk)?;
    check_len("k", k, n * s.hk * s.dk)?;
    check_len("v", v, n * s.hv * s.dv)?;
    check_len("g", g, n * s.hv)?;
    check_len("beta", beta, n * s.hv)?;
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
    beta: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    output_final_state: bool,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    check_inputs(q, k, v, g, beta, seqs, shape, initial_state)?;
    Ok(chunked_forward(
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        output_final_state,
    ))
}

/// Backward from `d_o` `[tokens, Hv, Dv]` and optionally the gradient of the final states.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    seqs: &Seqs,
    shape: RuleShape,
    opts: RuleOpts,
    initial_state: Option<&[f32]>,
    d_o: &[f32],
    d_final_state: Option<&[f32]>,
) -> Result<Grads> {
    check_inputs(q, k, v, g, beta, seqs, shape, initial_state)?;
    check_len("d_o", d_o, seqs.tokens() * shape.hv * shape.dv)?;
    if let Some(d) = d_final_state {
        check_len(
            "d_final_state",
            d,
            seqs.count() * shape.hv * shape.dk * shape.dv,
        )?;
    }
    Ok(chunked_backward(
        q,
        k,
        v,
        g,
        beta,
        seqs,
        shape,
        opts,
        initial_state,
        d_o,
        d_final_state,
    ))
}
