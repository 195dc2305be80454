use super::*;
use crate::testutil::*;

#[test]
fn gather_and_per_token_sums() {
    let mut r = rng(6);
    let (vocab, h, n) = (11, 5, 40);
    let w = normal(&mut r, vocab * h, 1.0);
    let ids: Vec<u32> = (0..n)
        .map(|i| ((i * 7 + i / 3) % (vocab - 2)) as u32)
        .collect();
    let y = forward(Ids::Host(&ids), P::Host(&w), vocab, h, DType::F32)
        .unwrap()
        .into_host()
        .unwrap();
    for (i, &t) in ids.iter().enumerate() {
        assert_eq!(
            &y[i * h..(i + 1) * h],
            &w[t as usize * h..(t as usize + 1) * h]
        );
    }
    let dy = normal(&mut r, n * h, 1.0);
    let base = normal(&mut r, vocab * h, 1.0);
    let mut de = base.clone();
    backward(
        &ids,
        &Act::Host(dy.clone()),
        vocab,
        h,
        PMut::Host(&mut de),
        true,
    )
    .unwrap();
    let want = reference::backward(&ids, &to_f64(&dy), vocab, h, Some(&to_f64(&base)));
    assert_close("dE (accumulated)", &de, &want, 1e-6);
    let mut de0 = vec![f32::NAN; vocab * h];
    backward(
        &ids,
        &Act::Host(dy.clone()),
        vocab,
        h,
        PMut::Host(&mut de0),
        false,
    )
    .unwrap();
    let want0 = reference::backward(&ids, &to_f64(&dy), vocab, h, None);
    assert_close("dE", &de0, &want0, 1e-6);
    // unused tokens' rows are exactly zero
    assert!(de0[(vocab - 1) * h..].iter().all(|&x| x == 0.0));
    // the CSR lists: every position once, under its token, in increasing order
    let (off, pos) = cpu::position_lists(&ids, vocab).unwrap();
    assert_eq!(off[vocab] as usize, n);
    for v in 0..vocab {
        let p = &pos[off[v] as usize..off[v + 1] as usize];
        assert!(p.windows(2).all(|w| w[0] < w[1]));
        assert!(p.iter().all(|&i| ids[i as usize] as usize == v));
    }
    let bad = vec![vocab as u32];
    assert!(forward(Ids::Host(&bad), P::Host(&w), vocab, h, DType::F32).is_err());
    assert!(forward(Ids::Host(&ids), P::Host(&w[1..]), vocab, h, DType::F32).is_err());
    assert!(forward(Ids::Host(&ids), P::Host(&w), vocab, h, DType::Bf16).is_err());
    assert!(cpu::position_lists(&bad, vocab).is_err());
}
