use super::*;
use crate::testutil::*;

#[test]
fn forward_and_backward_match_f64() {
    let mut r = rng(5);
    let (rows, v) = (300, 37);
    let logits = normal(&mut r, rows * v, 3.0);
    let targets: Vec<i32> = (0..rows)
        .map(|i| {
            if i % 7 == 3 {
                IGNORE_INDEX
            } else {
                ((i * 13) % v) as i32
            }
        })
        .collect();
    let (st, p) = forward(
        &Act::Host(logits.clone()),
        rows,
        v,
        Ids::Host(&targets),
        true,
    )
    .unwrap();
    let (sum, count, want) = reference::forward_backward(&to_f64(&logits), rows, v, &targets);
    assert_eq!(st.count, count);
    assert!(
        (st.loss_sum - sum).abs() < 1e-9 * sum.abs().max(1.0),
        "{} vs {sum}",
        st.loss_sum
    );
    let d = backward(&p.unwrap(), rows, v, Ids::Host(&targets), st.count).unwrap();
    assert_close("dlogits", &d.into_host().unwrap(), &want, 1e-5);
    // correct predictions: arg max (first on ties) equals the target
    let correct = (0..rows)
        .filter(|&i| targets[i] != IGNORE_INDEX)
        .filter(|&i| {
            let row = &logits[i * v..(i + 1) * v];
            let mut a = 0;
            for j in 1..v {
                if row[j] > row[a] {
                    a = j;
                }
            }
            a == targets[i] as usize
        })
        .count();
    assert_eq!(st.correct, correct);
    assert!(forward(
        &Act::Host(logits.clone()),
        rows,
        v,
        Ids::Host(&targets[1..]),
        false
    )
    .is_err());
    let mut bad = targets.clone();
    bad[5] = v as i32;
    assert!(forward(&Act::Host(logits), rows, v, Ids::Host(&bad), false).is_err());
}
