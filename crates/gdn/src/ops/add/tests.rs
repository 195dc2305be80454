use super::*;
use crate::testutil::*;

#[test]
fn adds_elementwise_and_checks_lengths() {
    let mut r = rng(3);
    let a = normal(&mut r, 40000, 1.0);
    let x = normal(&mut r, 40000, 1.0);
    let mut acc = Act::Host(a.clone());
    add_assign(&mut acc, &Act::Host(x.clone())).unwrap();
    let got = acc.into_host().unwrap();
    for i in 0..a.len() {
        // one f32 addition, exactly (f64 sum rounded once)
        assert_eq!(got[i], (a[i] as f64 + x[i] as f64) as f32, "element {i}");
    }
    let mut g = a.clone();
    add_assign_f32(PMut::Host(&mut g), P::Host(&x)).unwrap();
    assert_eq!(bits(&g), bits(&got));
    let mut short = Act::Host(vec![0.0; 3]);
    assert!(add_assign(&mut short, &Act::Host(vec![0.0; 4])).is_err());
}
