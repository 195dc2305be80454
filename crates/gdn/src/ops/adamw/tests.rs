use super::*;
use crate::testutil::*;

fn hyper(scale: Option<f32>) -> Hyper {
    Hyper {
        b1: 0.9,
        b2: 0.95,
        step_size: 1e-3 / (1.0 - 0.9f64.powi(3)) as f32,
        bc2_sqrt: (1.0 - 0.95f64.powi(3)).sqrt() as f32,
        eps: 1e-8,
        wd: 1e-4,
        grad_scale: scale,
    }
}

#[test]
fn step_matches_f64_and_scales_like_clipping() {
    let mut r = rng(7);
    let n = 1000;
    let p = normal(&mut r, n, 1.0);
    let m = normal(&mut r, n, 0.01);
    let v: Vec<f32> = normal(&mut r, n, 0.01).iter().map(|x| x * x).collect();
    let g = normal(&mut r, n, 0.1);
    for scale in [None, Some(0.25f32)] {
        let h = hyper(scale);
        let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
        step(
            PMut::Host(&mut p1),
            PMut::Host(&mut m1),
            PMut::Host(&mut v1),
            P::Host(&g),
            &h,
        )
        .unwrap();
        let (wp, wm, wv) = reference::step(&to_f64(&p), &to_f64(&m), &to_f64(&v), &to_f64(&g), &h);
        assert_close("p", &p1, &wp, 1e-6);
        assert_close("m", &m1, &wm, 1e-5);
        assert_close("v", &v1, &wv, 1e-5);
        // a scale in the step is the gradient scaled first (clip_grad_norm's in-place scaling)
        if let Some(c) = scale {
            let gs: Vec<f32> = g.iter().map(|x| x * c).collect();
            let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
            let h2 = Hyper {
                grad_scale: None,
                ..h
            };
            cpu::step(&mut p2, &mut m2, &mut v2, &gs, &h2).unwrap();
            assert_eq!(bits(&p2), bits(&p1));
            assert_eq!(bits(&m2), bits(&m1));
        }
    }
    let mut short = p[1..].to_vec();
    let (mut m1, mut v1) = (m.clone(), v.clone());
    assert!(cpu::step(&mut short, &mut m1, &mut v1, &g, &hyper(None)).is_err());
    let ss = sum_squares(&[P::Host(&g), P::Host(&p)]).unwrap();
    let want: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
    assert!((ss[0] - want).abs() <= 1e-12 * want);
}
