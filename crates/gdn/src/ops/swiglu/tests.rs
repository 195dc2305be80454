use super::*;
use crate::testutil::*;

#[test]
fn forward_and_backward_match_f64_and_finite_differences() {
    let (rows, f) = (70, 9);
    let mut r = rng(4);
    let u = normal(&mut r, rows * 2 * f, 2.0);
    let da = normal(&mut r, rows * f, 1.0);
    let a = cpu::forward(&u, rows, f).unwrap();
    assert_close("a", &a, &reference::forward(&to_f64(&u), rows, f), 1e-5);
    let du = cpu::backward(&u, rows, f, &da).unwrap();
    assert_close(
        "du",
        &du,
        &reference::backward(&to_f64(&u), rows, f, &to_f64(&da)),
        1e-5,
    );
    // the reference's backward against finite differences of its forward
    let (ur, dar) = (to_f64(&u[..2 * f]), to_f64(&da[..f]));
    let loss = |x: &[f64]| -> f64 { dot(&reference::forward(x, 1, f), &dar) };
    let fd = fd_grad(loss, &ur, 1e-6);
    let an = reference::backward(&ur, 1, f, &dar);
    for (i, (a, b)) in fd.iter().zip(&an).enumerate() {
        assert!(
            (a - b).abs() < 1e-6 * (1.0 + b.abs()),
            "du[{i}]: fd {a} vs {b}"
        );
    }
    // the entry runs the CPU op on host buffers
    let e = forward(&Act::Host(u.clone()), rows, f)
        .unwrap()
        .into_host()
        .unwrap();
    assert_eq!(bits(&e), bits(&a));
    assert!(cpu::forward(&u[1..], rows, f).is_err());
    assert!(cpu::backward(&u, rows, f, &da[1..]).is_err());
    assert!(cpu::forward(&[], 0, 0).is_err());
}
