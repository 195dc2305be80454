//! Helpers shared by the tests of every op and layer: seeded random data, error metrics against
//! an f64 reference, central finite differences, and running code under a rayon pool of a given
//! size (for thread-count independence checks).
//!
//! Public (but hidden from the docs) so integration tests under `tests/` can use it too. Nothing
//! here is used by the library itself.
//!
//! The usual gradient check of an op `y = f(x, p)` with an f64 reference `f64_f`:
//!
//! ```ignore
//! let dy = normal(&mut rng, y_len, 1.0);               // random upstream gradient
//! let loss = |x: &[f64]| dot(&f64_f(x, &p64), &to_f64(&dy)); // loss = sum(y * dy)
//! let want = fd_grad(loss, &to_f64(&x), FD_STEP);       // d loss / d x, central differences
//! let (dx, ..) = op_backward(&x, &p, &dy)?;             // f32 backward under test
//! assert_close("dx", &dx, &want, 1e-4);
//! ```

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// Step of the central finite differences used by the op tests (in f64).
pub const FD_STEP: f64 = 1e-6;

/// Floor of the denominators of relative errors, so an all-zero reference does not divide by 0.
pub const TINY: f64 = 1e-30;

/// A seeded, portable random generator (ChaCha8): the same seed gives the same data everywhere.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in `[lo, hi)`.
pub fn uniform(rng: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

/// `n` values from `N(mean, std^2)`.
pub fn normal_mean(rng: &mut impl Rng, n: usize, mean: f32, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z: f32 = StandardNormal.sample(rng);
            mean + std * z
        })
        .collect()
}

/// `n` values from `N(0, std^2)`.
pub fn normal(rng: &mut impl Rng, n: usize, std: f32) -> Vec<f32> {
    normal_mean(rng, n, 0.0, std)
}

/// Widen to f64 (exactly).
pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// `sum_i a_i b_i` in f64 (the loss `sum(y * dy)` of the gradient checks).
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Max-norm relative error: `max_i |a_i - b_i| / max(max_i |b_i|, TINY)`.
///
/// Every element is compared, and the scale is that of the whole reference tensor, so an element
/// that is tiny in the reference is not held to a tighter absolute bound than a large one. Returns
/// infinity if any difference is NaN (a NaN never passes a `<= tol` check) and panics on a length
/// mismatch.
pub fn max_rel_err(a: &[f32], b: &[f64]) -> f64 {
    max_rel_err_at(a, b).0
}

/// [`max_rel_err`] against an f32 reference (e.g. another run of the engine).
pub fn max_rel_err_f32(a: &[f32], b: &[f32]) -> f64 {
    max_rel_err(a, &to_f64(b))
}

/// [`max_rel_err`] and the index of the worst element (0 when empty).
pub fn max_rel_err_at(a: &[f32], b: &[f64]) -> (f64, usize) {
    assert_eq!(a.len(), b.len(), "max_rel_err: length mismatch");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(TINY);
    let mut worst = (0.0f64, 0usize);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let d = (x as f64 - y).abs();
        if d.is_nan() || (y.is_nan() && !x.is_nan()) {
            return (f64::INFINITY, i);
        }
        if d > worst.0 {
            worst = (d, i);
        }
    }
    (worst.0 / scale, worst.1)
}

/// Root-mean-square relative error: `||a - b||_2 / max(||b||_2, TINY)`; infinity on NaN.
pub fn rms_rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rms_rel_err: length mismatch");
    rms_rel(a.iter().map(|&x| x as f64), b)
}

/// [`rms_rel_err`]'s arithmetic over `a` (as f64, the same length as `b`).
fn rms_rel(a: impl Iterator<Item = f64>, b: &[f64]) -> f64 {
    let num: f64 = a.zip(b).map(|(x, &y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    let e = num.sqrt() / den.sqrt().max(TINY);
    if e.is_nan() {
        f64::INFINITY
    } else {
        e
    }
}

/// [`rms_rel_err`] between two f64 vectors (`a` against the reference `b`).
pub fn rms_rel_err_f64(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rms_rel_err_f64: length mismatch");
    rms_rel(a.iter().copied(), b)
}

/// The unit roundoff of bf16 (8 significant bits): rounding to bf16 moves a value by at most
/// this fraction of itself. The size of the perturbations of [`conditioning_floors`].
pub const BF16_UNIT_ROUNDOFF: f64 = 1.0 / 256.0;

/// The seeds of the perturbations behind the GPU tests' conditioned tolerances (the floor is the
/// largest change over them).
pub const CONDITIONING_SEEDS: [u64; 3] = [0x5eed_0001, 0x5eed_0002, 0x5eed_0003];

/// `x` with every element multiplied by `1 + d`, `d` uniform in `[-rel, rel]`: a random relative
/// perturbation of the size of a rounding (`rel` = [`BF16_UNIT_ROUNDOFF`] for bf16).
pub fn perturb_rel(rng: &mut impl Rng, x: &[f64], rel: f64) -> Vec<f64> {
    x.iter()
        .map(|&a| a * (1.0 + rel * rng.gen_range(-1.0..=1.0)))
        .collect()
}

/// Conditioning floors of an f64 reference's outputs: for each seed, `run(seed)` recomputes
/// every output of the reference from inputs perturbed by that seed (see [`perturb_rel`]); the
/// floor of an output is the largest RMS-relative change ([`rms_rel_err_f64`]) from `base` (the
/// unperturbed outputs, same names and order) over the seeds. It says how far the exact answer
/// moves when the inputs are rounded (to bf16, say) alone, so no kernel that stores those inputs
/// at that precision can be held closer to the reference than about that: a bf16 comparison
/// checks against [`conditioned_tol`]`(base tolerance, floor)`. Well-conditioned outputs have
/// floors far below the bf16 tolerances; an output that is a near-cancelling sum (e.g. a
/// one-token dq summed over value heads) has a large one. Computed by the reference only, never
/// by the code under test. The seeds run on threads of their own.
pub fn conditioning_floors<F>(
    base: &[(&'static str, Vec<f64>)],
    seeds: &[u64],
    run: F,
) -> Vec<(&'static str, f64)>
where
    F: Fn(u64) -> Vec<(&'static str, Vec<f64>)> + Sync,
{
    let runs: Vec<Vec<(&'static str, Vec<f64>)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = seeds
            .iter()
            .map(|&seed| {
                let run = &run;
                sc.spawn(move || run(seed))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("conditioning run panicked"))
            .collect()
    });
    base.iter()
        .enumerate()
        .map(|(i, (name, b))| {
            let floor = runs.iter().fold(0.0f64, |m, r| {
                assert_eq!(r[i].0, *name, "conditioning_floors: outputs out of order");
                m.max(rms_rel_err_f64(&r[i].1, b))
            });
            (*name, floor)
        })
        .collect()
}

/// The tolerance of a bf16 comparison against the f64 reference: the fixed `base` tolerance,
/// widened to the output's conditioning `floor` ([`conditioning_floors`]) where that is larger.
pub fn conditioned_tol(base: f64, floor: f64) -> f64 {
    base.max(floor)
}

/// One `gradient_conditioning` log line: the case, then per output its base tolerance, its floor
/// and, where the floor is above the base, `widened`.
pub fn conditioning_line(case: &str, rows: &[(&str, f64, f64)]) -> String {
    let mut line = format!("gradient_conditioning {case:<34}");
    for (name, base, floor) in rows {
        line += &format!(" {name}: base {base:.1e} floor {floor:.2e}");
        if floor > base {
            line += " widened";
        }
        line += ";";
    }
    line
}

/// Panic unless `max_rel_err(got, want) <= tol`; the message names the tensor, the error, the
/// worst index and both values there. Returns the error (for reporting).
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    let (e, i) = max_rel_err_at(got, want);
    assert!(
        e <= tol,
        "{what}: max rel err {e:.3e} > {tol:.1e} at index {i}: got {}, want {}",
        got[i],
        want[i]
    );
    e
}

/// Gradient of `f` at `x` by central finite differences with step `h`:
/// `g_i = (f(x + h e_i) - f(x - h e_i)) / (2h)`.
///
/// `f` is evaluated `2 * x.len()` times; use it on small shapes. With f64 references and
/// `h = 1e-6` the error is about `1e-10 * |f|` (rounding) plus `h^2 f'''` (truncation), far below
/// f32 rounding. To differentiate with respect to one of several arguments, capture the others in
/// the closure.
pub fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64], h: f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = xp[i];
            xp[i] = x0 + h;
            let fp = f(&xp);
            xp[i] = x0 - h;
            let fm = f(&xp);
            xp[i] = x0;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Run `f` inside a fresh rayon pool of `threads` threads (for checks that results do not depend
/// on the thread count).
pub fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("build rayon pool")
        .install(f)
}

/// Bit patterns, for bitwise comparisons that treat NaNs and signed zeros exactly.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_grad_of_a_cubic() {
        // f(x) = sum x_i^3 + x_0 x_1, grad = 3 x_i^2 + (x_1, x_0, 0)
        let x = [0.3, -1.2, 2.0];
        let g = fd_grad(
            |v| v.iter().map(|a| a * a * a).sum::<f64>() + v[0] * v[1],
            &x,
            FD_STEP,
        );
        let want = [3.0 * 0.09 - 1.2, 3.0 * 1.44 + 0.3, 12.0];
        for (a, b) in g.iter().zip(want) {
            assert!((a - b).abs() < 1e-8, "{a} vs {b}");
        }
    }

    #[test]
    fn errors_detect_differences_and_nan() {
        assert_eq!(max_rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((max_rel_err(&[1.0, 2.5], &[1.0, 2.0]) - 0.25).abs() < 1e-12);
        assert_eq!(max_rel_err_at(&[1.0, 2.0, 0.0], &[1.0, 2.0, 0.5]).1, 2);
        assert_eq!(max_rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(max_rel_err(&[1.0], &[f64::NAN]), f64::INFINITY);
        assert_eq!(rms_rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert!((rms_rel_err(&[3.0, 0.0], &[0.0, 4.0]) - 1.25).abs() < 1e-12);
        assert!(std::panic::catch_unwind(|| assert_close("x", &[1.0], &[2.0], 0.1)).is_err());
    }

    #[test]
    fn conditioning_floors_see_cancellation() {
        let u = BF16_UNIT_ROUNDOFF;
        let x: Vec<f64> = (1..=1000).map(|i| i as f64 * 0.01).collect();
        let p = perturb_rel(&mut rng(1), &x, u);
        assert!(p.iter().zip(&x).all(|(a, b)| (a / b - 1.0).abs() <= u));
        assert!(p.iter().zip(&x).filter(|(a, b)| a != b).count() > 990);
        // s = x0 + x1: no cancellation (1 + 1), then cancellation to 1/100 (1 - 0.99).
        let floor = |x0: f64, x1: f64| {
            let base = [("s", vec![x0 + x1]), ("x0", vec![x0])];
            conditioning_floors(&base, &CONDITIONING_SEEDS, |seed| {
                let p = perturb_rel(&mut rng(seed), &[x0, x1], u);
                vec![("s", vec![p[0] + p[1]]), ("x0", vec![p[0]])]
            })
        };
        let well = floor(1.0, 1.0);
        let bad = floor(1.0, -0.99);
        assert_eq!(well[0].0, "s");
        assert!(well[0].1 > 0.0 && well[0].1 <= u, "{well:?}");
        assert!(bad[0].1 > 20.0 * u && bad[0].1 <= 199.0 * u, "{bad:?}");
        assert!(bad[1].1 <= u, "{bad:?}");
        assert_eq!(conditioned_tol(5e-3, 1e-3), 5e-3);
        assert_eq!(conditioned_tol(5e-3, 2e-2), 2e-2);
        let line = conditioning_line("c", &[("dq", 5e-3, 2e-2), ("dv", 5e-3, 1e-3)]);
        assert!(line.starts_with("gradient_conditioning c"), "{line}");
        assert_eq!(line.matches("widened").count(), 1, "{line}");
        assert!(
            line.contains("dq: base 5.0e-3 floor 2.00e-2 widened;"),
            "{line}"
        );
        assert_eq!(rms_rel_err_f64(&[3.0, 0.0], &[0.0, 4.0]), 1.25);
    }

    #[test]
    fn rng_is_seeded() {
        assert_eq!(
            bits(&normal(&mut rng(7), 5, 1.0)),
            bits(&normal(&mut rng(7), 5, 1.0))
        );
        assert_ne!(
            bits(&normal(&mut rng(7), 5, 1.0)),
            bits(&normal(&mut rng(8), 5, 1.0))
        );
        assert_eq!(with_threads(2, rayon::current_num_threads), 2);
    }
}
