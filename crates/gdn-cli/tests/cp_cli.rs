//! `gdn layer --cp N`: context parallelism over in-process ranks from the command line.

mod common;
use common::{expect_fail, gdn, ok, tmpdir};

use gdn::io::read_tensors;
use gdn::testutil::max_rel_err_f32 as rel;

#[test]
fn layer_cp2_matches_cp1_and_rules_are_errors() {
    let d = tmpdir("cp_cli");
    let (one, two) = (d.join("one"), d.join("two"));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    ok(&gdn(&["layer", "--example", &s(&one)]));
    let o = gdn(&["layer", "--example", &s(&two), "--cp", "2"]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("cp 2"));
    let a = read_tensors(&one.join("out.safetensors")).unwrap();
    let b = read_tensors(&two.join("out.safetensors")).unwrap();
    assert_eq!(a.len(), b.len());
    for ((n, x), (n2, y)) in a.iter().zip(&b) {
        assert_eq!(n, n2);
        assert_eq!(x.shape(), y.shape(), "{n}");
        // y, dx and the per-head gradients are the same arithmetic; the row-summed gradients
        // add two partial sums (f32 rounding).
        let e = rel(y.data(), x.data());
        assert!(e <= 1e-5, "{n}: {e:e}");
    }
    // The example's sequences (100 tokens) are not divisible by 2 x 3.
    let o = gdn(&["layer", "--example", &s(&d.join("three")), "--cp", "3"]);
    expect_fail(&o, &["length 100, not divisible by 2 x cp = 6"]);
    // (4 ranks: the sequence rule is checked before the heads rule, tested in the library.)
    let o = gdn(&["layer", "--example", &s(&d.join("four")), "--cp", "4"]);
    expect_fail(&o, &["not divisible by 2 x cp = 8"]);
    let o = gdn(&["layer", "--example", &s(&d.join("zero")), "--cp", "0"]);
    expect_fail(&o, &["--cp 0"]);
}
