//! The gated delta rule's host API on tensors from a safetensors file, for the Python package's
//! tests (`crates/gdn-py/tests/test_core.py` compares its results with the package's, bitwise).
//!
//!     rule_io IN OUT
//!
//! IN holds q, k `[tokens, Hk, Dk]`, v `[tokens, Hv, Dv]`, g, beta `[tokens, Hv]`, d_o like v,
//! `cu_seqlens` (I64, 1-D) and optionally `h0` `[N, Hv, Dk, Dv]`, and `opts` = [scale,
//! l2norm_in_kernel (0 or 1)]. OUT gets o, final, dq, dk, dv, dg, dbeta (and dh0).

use std::path::Path;

#[path = "common/io.rs"]
mod io;

use gdn::io::write_tensors;
use gdn::ops::gated_delta_rule::{cpu, RuleOpts, RuleShape};
use gdn::{Seqs, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        return Err("usage: rule_io IN OUT".into());
    }
    let (f, cu) = io::read_inputs(&args[1])?;
    let get = |n: &str| f.get(n).ok_or_else(|| format!("missing {n}"));
    let (q, k, v, g, b, d_o, opts) = (
        get("q")?,
        get("k")?,
        get("v")?,
        get("g")?,
        get("beta")?,
        get("d_o")?,
        get("opts")?,
    );
    let (qs, vs) = (q.shape(), v.shape());
    let s = RuleShape {
        hk: qs[1],
        hv: vs[1],
        dk: qs[2],
        dv: vs[2],
    };
    let seqs = Seqs::packed(&cu.ok_or("missing cu_seqlens")?, qs[0])?;
    let o = RuleOpts {
        scale: opts.data()[0],
        l2norm_in_kernel: opts.data()[1] != 0.0,
    };
    let h0 = f.get("h0").map(|t| t.data());
    let (out, fin) = cpu::forward(
        q.data(),
        k.data(),
        v.data(),
        g.data(),
        b.data(),
        &seqs,
        s,
        o,
        h0,
        true,
    )?;
    let r = cpu::backward(
        q.data(),
        k.data(),
        v.data(),
        g.data(),
        b.data(),
        &seqs,
        s,
        o,
        h0,
        d_o.data(),
        None,
    )?;
    let st = [seqs.count(), s.hv, s.dk, s.dv];
    let mut outs = vec![
        ("o", Tensor::from_vec(vs, out)?),
        (
            "final",
            Tensor::from_vec(&st, fin.ok_or("no final state")?)?,
        ),
        ("dq", Tensor::from_vec(qs, r.dq)?),
        ("dk", Tensor::from_vec(k.shape(), r.dk)?),
        ("dv", Tensor::from_vec(vs, r.dv)?),
        ("dg", Tensor::from_vec(g.shape(), r.dg)?),
        ("dbeta", Tensor::from_vec(b.shape(), r.dbeta)?),
    ];
    if let Some(d) = r.dh0 {
        outs.push(("dh0", Tensor::from_vec(&st, d)?));
    }
    let refs: Vec<(&str, &Tensor)> = outs.iter().map(|(n, t)| (*n, t)).collect();
    write_tensors(Path::new(&args[2]), &refs)?;
    Ok(())
}
