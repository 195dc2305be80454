use super::cpu::{backward as linear_backward, forward as linear_forward};
use super::*;
use crate::testutil::*;

fn data(seed: u64, rows: usize, i: usize, o: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = rng(seed);
    (
        normal(&mut r, rows * i, 1.0),
        normal(&mut r, o * i, 0.3),
        normal(&mut r, rows * o, 1.0),
    )
}

#[test]
fn forward_matches_reference() {
    // big enough for the parallel GEMM path, odd sizes for the edges
    for (rows, i, o) in [(3, 5, 4), (300, 67, 129)] {
        let (x, w, _) = data(1, rows, i, o);
        let y = linear_forward(&x, rows, i, &w, o).unwrap();
        let want = reference::linear_forward(&to_f64(&x), rows, i, &to_f64(&w), o);
        let e = assert_close("y", &y, &want, 2e-6);
        eprintln!(
            "linear fwd {rows}x{i}->{o}: {e:.2e} (rms {:.2e})",
            rms_rel_err(&y, &want)
        );
    }
}

#[test]
fn backward_matches_finite_differences() {
    let (rows, i, o) = (6, 7, 5);
    let (x, w, dy) = data(2, rows, i, o);
    let (dx, dw) = linear_backward(&x, rows, i, &w, o, &dy).unwrap();
    let (x64, w64, dy64) = (to_f64(&x), to_f64(&w), to_f64(&dy));
    let fx = fd_grad(
        |x| dot(&reference::linear_forward(x, rows, i, &w64, o), &dy64),
        &x64,
        FD_STEP,
    );
    let fw = fd_grad(
        |w| dot(&reference::linear_forward(&x64, rows, i, w, o), &dy64),
        &w64,
        FD_STEP,
    );
    let ex = assert_close("dx", &dx, &fx, 2e-5);
    let ew = assert_close("dw", &dw, &fw, 2e-5);
    eprintln!("linear bwd: dx {ex:.2e} dw {ew:.2e}");
}

#[test]
fn backward_matches_reference_products_at_size() {
    // dW = dy^T x and dx = dy W in f64, on sizes that take the parallel, blocked GEMM path
    let (rows, i, o) = (700, 40, 72);
    let (x, w, dy) = data(3, rows, i, o);
    let (dx, dw) = linear_backward(&x, rows, i, &w, o, &dy).unwrap();
    let (x64, w64, dy64) = (to_f64(&x), to_f64(&w), to_f64(&dy));
    // dx = dy W = linear_forward(dy, W^T); dW = dy^T x = linear_forward(dy^T, x^T)
    let tr = |m: &[f64], r: usize, c: usize| -> Vec<f64> {
        (0..c * r).map(|k| m[(k % r) * c + k / r]).collect()
    };
    let want_dx = reference::linear_forward(&dy64, rows, o, &tr(&w64, o, i), i);
    let want_dw = reference::linear_forward(&tr(&dy64, rows, o), o, rows, &tr(&x64, rows, i), i);
    let ex = assert_close("dx", &dx, &want_dx, 2e-6);
    let ew = assert_close("dw", &dw, &want_dw, 5e-6);
    eprintln!("linear bwd at size: dx {ex:.2e} dw {ew:.2e}");
}

#[test]
fn backward_is_bitwise_independent_of_thread_count() {
    // rows (the inner dimension of dW) spans several of the gemm crate's depth blocks
    let (rows, i, o) = (1500, 96, 80);
    let (x, w, dy) = data(4, rows, i, o);
    let run = || {
        let y = linear_forward(&x, rows, i, &w, o).unwrap();
        let (dx, dw) = linear_backward(&x, rows, i, &w, o, &dy).unwrap();
        (bits(&y), bits(&dx), bits(&dw))
    };
    let a = with_threads(1, run);
    let b = with_threads(3, run);
    assert!(a.0 == b.0, "y depends on the thread count");
    assert!(a.1 == b.1, "dx depends on the thread count");
    assert!(a.2 == b.2, "dW depends on the thread count");
}

#[test]
fn empty_shapes() {
    assert!(linear_forward(&[], 0, 3, &[0.0; 6], 2).unwrap().is_empty());
    let (dx, dw) = linear_backward(&[], 0, 3, &[1.0; 6], 2, &[]).unwrap();
    assert!(dx.is_empty());
    assert_eq!(dw, vec![0.0; 6]);
    assert_eq!(linear_forward(&[], 2, 0, &[], 3).unwrap(), vec![0.0; 6]);
}

#[test]
fn bad_lengths_are_errors() {
    let (x, w, dy) = data(5, 3, 4, 2);
    assert!(linear_forward(&x[1..], 3, 4, &w, 2).is_err());
    assert!(linear_forward(&x, 3, 4, &w[1..], 2).is_err());
    assert!(linear_forward(&x, usize::MAX, 4, &w, 2).is_err());
    assert!(linear_backward(&x, 3, 4, &w, 2, &dy[1..]).is_err());
    assert!(linear_backward(&x[1..], 3, 4, &w, 2, &dy).is_err());
    assert!(linear_backward(&x, 3, 4, &w, 3, &dy).is_err());
}

/// The skinny GEMM's plans: the Qwen3-Next decode shapes on 132 SMs give the plans the notes
/// (bench/notes/h-dec.md) and the host emulator (bench/notes/h-dec-emu) state, and every plan of a
/// sweep of shapes covers the rows and k exactly within the kernel's launch bounds.
#[test]
fn skinny_plans() {
    use super::cuda::{skinny_plan, SkinnyPlan};
    let p = |nt, wm, ws, slabs, splits, nchunk| SkinnyPlan {
        nt,
        wm,
        ws,
        slabs,
        splits,
        nchunk,
    };
    assert_eq!(
        skinny_plan(64, 12352, 2048, 132),
        Some(p(8, 6, 2, 129, 1, 8))
    );
    assert_eq!(
        skinny_plan(1, 12352, 2048, 132),
        Some(p(1, 6, 2, 129, 1, 8))
    );
    assert_eq!(skinny_plan(64, 2048, 4096, 132), Some(p(8, 4, 2, 32, 4, 4)));
    assert_eq!(skinny_plan(8, 2048, 4096, 132), Some(p(1, 1, 8, 128, 1, 4)));
    // The folded input norm takes the in_proj plans as they are (one k range per CTA) ...
    for m in [1usize, 8, 64] {
        let q = skinny_plan(m, 12352, 2048, 132).unwrap();
        assert!(q.takes_norm(), "{q:?}");
        assert_eq!(
            super::cuda::skinny_plan_with(m, 12352, 2048, 132, true),
            Some(q)
        );
    }
    // ... and small shapes with one k range when asked.
    let q = super::cuda::skinny_plan_with(5, 776, 256, 132, true).unwrap();
    assert!(q.takes_norm() && q.splits == 1, "{q:?}");
    assert!(!skinny_plan(5, 776, 256, 132).unwrap().takes_norm());
    assert_eq!(skinny_plan(65, 2048, 4096, 132), None);
    assert_eq!(skinny_plan(0, 2048, 4096, 132), None);
    assert_eq!(skinny_plan(8, 2048, 4000, 132), None);
    for m in [1usize, 2, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64] {
        for n in [1usize, 15, 16, 40, 776, 1280, 2048, 12352] {
            for k in [128usize, 256, 384, 1024, 2048, 4096] {
                for sms in [1usize, 78, 132] {
                    let q = skinny_plan(m, n, k, sms).unwrap();
                    let qn = super::cuda::skinny_plan_with(m, n, k, sms, true).unwrap();
                    assert!(qn.takes_norm(), "{qn:?}");
                    assert!(qn.smem_bytes_norm() <= 48 * 1024, "{qn:?}");
                    assert!(8 * q.nt >= m && q.nt <= 8, "{q:?}");
                    assert!(q.threads() <= if q.nt == 8 { 384 } else { 512 }, "{q:?}");
                    assert!(
                        q.slabs * 16 * q.wm >= n && (q.slabs - 1) * 16 * q.wm < n,
                        "{q:?}"
                    );
                    assert_eq!(q.splits * q.ws * q.nchunk * 128, k, "{q:?}");
                    assert!(q.smem_bytes() <= 48 * 1024, "{q:?}");
                }
            }
        }
    }
}
