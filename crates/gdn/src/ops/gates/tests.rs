use super::cpu::{
    backward as gates_backward, forward as gates_forward, gdn2_backward as gates2_backward,
    gdn2_forward as gates2_forward, sigmoid_backward, sigmoid_forward,
};
use super::*;
use crate::ops::REDUCE_BLOCK;
use crate::testutil::*;

struct Case {
    a: Vec<f32>,
    b: Vec<f32>,
    a_log: Vec<f32>,
    dt: Vec<f32>,
    dg: Vec<f32>,
    dbeta: Vec<f32>,
}

/// `a` uniform in `[lo, hi)`; `A_log = ln U(1, 16)`, `dt_bias` around 1.
fn case(seed: u64, rows: usize, heads: usize, lo: f32, hi: f32) -> Case {
    let mut r = rng(seed);
    Case {
        a: uniform(&mut r, rows * heads, lo, hi),
        b: normal(&mut r, rows * heads, 2.0),
        a_log: uniform(&mut r, heads, 1.0, 16.0)
            .iter()
            .map(|v| v.ln())
            .collect(),
        dt: normal_mean(&mut r, heads, 1.0, 0.3),
        dg: normal(&mut r, rows * heads, 1.0),
        dbeta: normal(&mut r, rows * heads, 1.0),
    }
}

#[test]
fn forward_matches_reference() {
    let (rows, heads) = (40, 6);
    // includes a + dt_bias above the softplus threshold and far below it
    let c = case(1, rows, heads, -30.0, 30.0);
    let (g, beta) = gates_forward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt).unwrap();
    let (wg, wb) = reference::gates_forward(
        &to_f64(&c.a),
        &to_f64(&c.b),
        rows,
        heads,
        &to_f64(&c.a_log),
        &to_f64(&c.dt),
    );
    // g spans 1e-12 .. 500: check it elementwise-relative as well as in max norm
    let eg = assert_close("g", &g, &wg, 2e-6);
    for (i, (x, y)) in g.iter().zip(&wg).enumerate() {
        assert!(
            (*x as f64 - y).abs() <= 2e-6 * y.abs(),
            "g[{i}]: {x} vs {y}"
        );
    }
    let eb = assert_close("beta", &beta, &wb, 2e-6);
    eprintln!("gates fwd: g {eg:.2e} beta {eb:.2e}");
}

fn check_grads(c: &Case, rows: usize, heads: usize, tol: f64) {
    let (da, db, da_log, ddt) =
        gates_backward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt, &c.dg, &c.dbeta).unwrap();
    let (a, b, al, dt) = (to_f64(&c.a), to_f64(&c.b), to_f64(&c.a_log), to_f64(&c.dt));
    let (dg, dbeta) = (to_f64(&c.dg), to_f64(&c.dbeta));
    let loss = |a: &[f64], b: &[f64], al: &[f64], dt: &[f64]| {
        let (g, beta) = reference::gates_forward(a, b, rows, heads, al, dt);
        dot(&g, &dg) + dot(&beta, &dbeta)
    };
    let fa = fd_grad(|v| loss(v, &b, &al, &dt), &a, FD_STEP);
    let fb = fd_grad(|v| loss(&a, v, &al, &dt), &b, FD_STEP);
    let fal = fd_grad(|v| loss(&a, &b, v, &dt), &al, FD_STEP);
    let fdt = fd_grad(|v| loss(&a, &b, &al, v), &dt, FD_STEP);
    let e = [
        assert_close("da", &da, &fa, tol),
        assert_close("db", &db, &fb, tol),
        assert_close("dA_log", &da_log, &fal, tol),
        assert_close("ddt_bias", &ddt, &fdt, tol),
    ];
    eprintln!(
        "gates bwd rows={rows}: da {:.2e} db {:.2e} dA_log {:.2e} ddt {:.2e}",
        e[0], e[1], e[2], e[3]
    );
}

#[test]
fn backward_matches_finite_differences() {
    let (rows, heads) = (7, 3);
    check_grads(&case(2, rows, heads, -8.0, 8.0), rows, heads, 2e-5);
    // over several reduce blocks
    let rows = 2 * REDUCE_BLOCK + 9;
    check_grads(&case(3, rows, 2, -8.0, 8.0), rows, 2, 2e-5);
}

#[test]
fn backward_above_the_softplus_threshold() {
    // a + dt_bias in (21, 30): softplus is the identity, its derivative exactly 1
    let (rows, heads) = (5, 2);
    let c = case(4, rows, heads, 21.0, 28.0);
    assert!(c.dt.iter().all(|&d| d > 0.0));
    let (da, ..) =
        gates_backward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt, &c.dg, &c.dbeta).unwrap();
    for (i, d) in da.iter().enumerate() {
        assert_eq!(*d, -c.a_log[i % heads].exp() * c.dg[i], "da[{i}]");
    }
    check_grads(&c, rows, heads, 2e-5);
}

#[test]
fn gates2_forward_matches_reference() {
    let (rows, hk, dk) = (9, 3, 16);
    let mut r = rng(5);
    let f = uniform(&mut r, rows * hk * dk, -30.0, 30.0);
    let a_log: Vec<f32> = uniform(&mut r, hk, 1.0, 16.0)
        .iter()
        .map(|v| v.ln())
        .collect();
    let dt = normal_mean(&mut r, hk * dk, 1.0, 0.3);
    let g = gates2_forward(&f, rows, hk, dk, &a_log, &dt).unwrap();
    let want = reference::gates2_forward(&to_f64(&f), rows, hk, dk, &to_f64(&a_log), &to_f64(&dt));
    let e = assert_close("g", &g, &want, 2e-6);
    for (i, (x, y)) in g.iter().zip(&want).enumerate() {
        assert!(
            (*x as f64 - y).abs() <= 2e-6 * y.abs(),
            "g[{i}]: {x} vs {y}"
        );
    }
    eprintln!("gates2 fwd: g {e:.2e}");
}

fn check_grads2(seed: u64, rows: usize, hk: usize, dk: usize, tol: f64) {
    let mut r = rng(seed);
    let f = uniform(&mut r, rows * hk * dk, -8.0, 8.0);
    let a_log: Vec<f32> = uniform(&mut r, hk, 1.0, 16.0)
        .iter()
        .map(|v| v.ln())
        .collect();
    let dt = normal_mean(&mut r, hk * dk, 1.0, 0.3);
    let dg = normal(&mut r, rows * hk * dk, 1.0);
    let (df, da_log, ddt) = gates2_backward(&f, rows, hk, dk, &a_log, &dt, &dg).unwrap();
    let (f64_, al, dt64, dg64) = (to_f64(&f), to_f64(&a_log), to_f64(&dt), to_f64(&dg));
    let loss = |f: &[f64], al: &[f64], dt: &[f64]| {
        dot(&reference::gates2_forward(f, rows, hk, dk, al, dt), &dg64)
    };
    let e = [
        assert_close(
            "df",
            &df,
            &fd_grad(|v| loss(v, &al, &dt64), &f64_, FD_STEP),
            tol,
        ),
        assert_close(
            "dA_log",
            &da_log,
            &fd_grad(|v| loss(&f64_, v, &dt64), &al, FD_STEP),
            tol,
        ),
        assert_close(
            "ddt_bias",
            &ddt,
            &fd_grad(|v| loss(&f64_, &al, v), &dt64, FD_STEP),
            tol,
        ),
    ];
    eprintln!(
        "gates2 bwd rows={rows}: df {:.2e} dA_log {:.2e} ddt {:.2e}",
        e[0], e[1], e[2]
    );
}

#[test]
fn gates2_backward_matches_finite_differences() {
    check_grads2(6, 5, 2, 3, 2e-5);
    check_grads2(7, REDUCE_BLOCK + 40, 2, 2, 2e-5);
}

#[test]
fn sigmoid_matches_reference_and_finite_differences() {
    let mut r = rng(8);
    let x = normal(&mut r, 50, 4.0);
    let dy = normal(&mut r, 50, 1.0);
    let y = sigmoid_forward(&x);
    let e = assert_close(
        "sigmoid",
        &y,
        &reference::sigmoid_forward(&to_f64(&x)),
        2e-6,
    );
    let dx = sigmoid_backward(&y, &dy);
    let want = fd_grad(
        |v| dot(&reference::sigmoid_forward(v), &to_f64(&dy)),
        &to_f64(&x),
        FD_STEP,
    );
    let ed = assert_close("dsigmoid", &dx, &want, 2e-5);
    eprintln!("sigmoid: y {e:.2e} dx {ed:.2e}");
}

#[test]
fn deterministic_across_thread_counts() {
    let (rows, heads) = (5000, 8);
    let c = case(9, rows, heads, -10.0, 10.0);
    let run = || {
        let (g, beta) = gates_forward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt).unwrap();
        let (da, db, dal, ddt) =
            gates_backward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt, &c.dg, &c.dbeta).unwrap();
        // the same data as GDN2 with 2 key heads of 4 channels
        let (df, dal2, ddt2) =
            gates2_backward(&c.a, rows, 2, 4, &c.a_log[..2], &c.dg[..8], &c.dg).unwrap();
        [g, beta, da, db, dal, ddt, df, dal2, ddt2].map(|v| bits(&v))
    };
    assert!(with_threads(1, run) == with_threads(3, run));
}

#[test]
fn bad_arguments_are_errors() {
    let (rows, heads) = (4, 3);
    let c = case(10, rows, heads, -1.0, 1.0);
    assert!(gates_forward(&c.a[1..], &c.b, rows, heads, &c.a_log, &c.dt).is_err());
    assert!(gates_forward(&c.a, &c.b[1..], rows, heads, &c.a_log, &c.dt).is_err());
    assert!(gates_forward(&c.a, &c.b, rows, heads, &c.a_log[1..], &c.dt).is_err());
    assert!(gates_forward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt[1..]).is_err());
    assert!(gates_forward(&[], &[], rows, 0, &[], &[]).is_err());
    let bw = |dg: &[f32], dbeta: &[f32]| {
        gates_backward(&c.a, &c.b, rows, heads, &c.a_log, &c.dt, dg, dbeta)
    };
    assert!(bw(&c.dg, &c.dbeta).is_ok());
    assert!(bw(&c.dg[1..], &c.dbeta).is_err());
    assert!(bw(&c.dg, &c.dbeta[1..]).is_err());
    // gates2: 4 rows, 2 key heads of dk 3 = 24 values
    let f = vec![0.5f32; 24];
    assert!(gates2_forward(&f, 4, 2, 3, &[0.0; 2], &[1.0; 6]).is_ok());
    assert!(gates2_forward(&f[1..], 4, 2, 3, &[0.0; 2], &[1.0; 6]).is_err());
    assert!(gates2_forward(&f, 4, 2, 3, &[0.0; 3], &[1.0; 6]).is_err());
    assert!(gates2_forward(&f, 4, 2, 3, &[0.0; 2], &[1.0; 2]).is_err());
    assert!(gates2_forward(&f, 4, 2, 0, &[0.0; 2], &[]).is_err());
    assert!(gates2_backward(&f, 4, 2, 3, &[0.0; 2], &[1.0; 6], &f[1..]).is_err());
}
