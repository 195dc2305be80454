//! The CUDA GDN2 rule on tensors from a safetensors file, forward and backward in bf16 storage, for
//! the accuracy comparison with FLA's `chunk_gdn2` against a float64 reference
//! (`bench/gdn2_accuracy.py`, run on the GPU machine).
//!
//!     gdn2_rule_io IN OUT [BWD ...]
//!
//! IN holds q, k `[tokens, Hk, Dk]`, v, w, d_o `[tokens, Hv, Dv]`, g, b `[tokens, Hv, Dk]` (F32;
//! q, k, v, b, w, d_o are rounded to bf16 on upload), `cu_seqlens` (I64, 1-D) and `opts` =
//! [scale, l2norm_in_kernel (0 or 1)]. For each BWD named (`v3`, `v4`, `v5`, `chunked`,
//! `recurrent`; default: the one `GDN_RULE2_BWD` picks) OUT gets `<bwd>.dq`, `.dk`, `.dv`, `.dg`,
//! `.db`, `.dw` (F32), and `o` once (the forward `GDN_RULE2_FWD` picks).

use std::path::Path;

use gdn::device::cuda::{self, DBuf, DType, GBuf};
#[path = "common/io.rs"]
mod io;

use gdn::io::write_tensors;
use gdn::ops::gdn2_rule::cuda::{backward_with, forward, Bwd};
use gdn::ops::gdn2_rule::{RuleOpts, RuleShape};
use gdn::{Seqs, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: gdn2_rule_io IN OUT [v3|v4|v5|chunked|recurrent ...]".into());
    }
    let (f, cu) = io::read_inputs(&args[1])?;
    let get = |n: &str| f.get(n).ok_or_else(|| format!("missing {n}"));
    let (q, k, v, g, b, w, d_o, opts) = (
        get("q")?,
        get("k")?,
        get("v")?,
        get("g")?,
        get("b")?,
        get("w")?,
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
    let gpu = cuda::gpu(0)?;
    let up = |t: &Tensor| DBuf::upload(&gpu, t.data(), DType::Bf16);
    let (qd, kd, vd, bd, wd, od) = (up(q)?, up(k)?, up(v)?, up(b)?, up(w)?, up(d_o)?);
    let gd: GBuf<f32> = gpu.upload(g.data())?;
    let (out, _) = forward(&gpu, &qd, &kd, &vd, &gd, &bd, &wd, &seqs, s, o, None, false)?;
    let mut outs = vec![("o".to_string(), Tensor::from_vec(vs, out.download()?)?)];
    let names: Vec<String> = if args.len() > 3 {
        args[3..].to_vec()
    } else {
        vec!["default".into()]
    };
    for name in names {
        let bwd = match name.as_str() {
            "v3" => Bwd::V3,
            "v4" => Bwd::V4,
            "v5" => Bwd::V5,
            "chunked" => Bwd::Chunked,
            "recurrent" => Bwd::Recurrent,
            "default" => Bwd::from_env(),
            x => return Err(format!("unknown backward {x}").into()),
        };
        let r = backward_with(
            &gpu, bwd, &qd, &kd, &vd, &gd, &bd, &wd, &seqs, s, o, None, &od, None,
        )?;
        for (n, shape, x) in [
            ("dq", qs, r.dq.download()?),
            ("dk", k.shape(), r.dk.download()?),
            ("dv", vs, r.dv.download()?),
            ("dg", g.shape(), gpu.download(&r.dg)?),
            ("db", b.shape(), r.db.download()?),
            ("dw", w.shape(), r.dw.download()?),
        ] {
            outs.push((format!("{name}.{n}"), Tensor::from_vec(shape, x)?));
        }
    }
    let refs: Vec<(&str, &Tensor)> = outs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_tensors(Path::new(&args[2]), &refs)?;
    Ok(())
}
