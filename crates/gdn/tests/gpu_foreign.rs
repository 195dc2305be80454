//! Device memory gdn does not own (as PyTorch's tensors reach it through DLPack), wrapped by
//! `GBuf::from_raw` and given back by `GBuf::into_raw`: the rule computes on it in place with the
//! bits it gives on gdn's own buffers, the memory is neither freed nor changed, and the
//! allocator's live bytes come back to where they were. Run on the device machine with
//! `--include-ignored`.

use gdn::backend::{Act, F32s};
use gdn::device::cuda::{self, DBuf, GBuf};
use gdn::ops::gated_delta_rule::{self as rule, RuleOpts, RuleShape};
use gdn::Seqs;

fn vals(n: usize, seed: u32, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503))
                >> 8;
            lo + (hi - lo) * (x as f32 / (1u32 << 24) as f32)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rule_on_foreign_memory_is_in_place_and_bitwise() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    let s = RuleShape {
        hk: 2,
        hv: 4,
        dk: 64,
        dv: 32,
    };
    let seqs = Seqs::packed(&[0, 37, 100], 100).unwrap();
    let t = seqs.tokens();
    let host = [
        vals(t * s.hk * s.dk, 1, -1.0, 1.0),
        vals(t * s.hk * s.dk, 2, -1.0, 1.0),
        vals(t * s.hv * s.dv, 3, -1.0, 1.0),
        vals(t * s.hv, 4, -0.3, -0.01),
        vals(t * s.hv, 5, 0.1, 0.9),
    ];
    let opts = RuleOpts {
        scale: 0.25,
        l2norm_in_kernel: true,
    };
    // gdn's own buffers
    let own: Vec<GBuf<f32>> = host.iter().map(|h| gpu.upload(h).unwrap()).collect();
    let run = |b: &[GBuf<f32>]| {
        // the rule takes Act / F32s by reference; build them around the buffers without copying
        let acts: Vec<Act> = [0, 1, 2, 4]
            .iter()
            .map(|&i| {
                Act::Dev(DBuf::F32(unsafe {
                    GBuf::from_raw(&gpu, b[i].device_ptr(), b[i].len())
                }))
            })
            .collect();
        let g = F32s::Dev(unsafe { GBuf::from_raw(&gpu, b[3].device_ptr(), b[3].len()) });
        let (o, fin) = rule::forward(
            &acts[0], &acts[1], &acts[2], &g, &acts[3], &seqs, s, opts, None, true,
        )
        .unwrap();
        let o = o.into_host().unwrap();
        let fin = fin.unwrap().into_host().unwrap();
        for a in acts {
            let Act::Dev(DBuf::F32(x)) = a else {
                unreachable!()
            };
            x.into_raw();
        }
        let F32s::Dev(x) = g else { unreachable!() };
        x.into_raw();
        (o, fin)
    };
    let want = run(&own);
    // "foreign" memory: allocated with the driver directly, outside gdn's allocator
    let live0 = gpu.live_bytes();
    let mut foreign = Vec::new();
    for h in &host {
        let bytes = h.len() * 4;
        let p = unsafe { cudarc::driver::result::malloc_sync(bytes) }.unwrap();
        unsafe { cudarc::driver::result::memcpy_htod_sync(p, h) }.unwrap();
        foreign.push(p);
    }
    let wrapped: Vec<GBuf<f32>> = foreign
        .iter()
        .zip(&host)
        .map(|(&p, h)| unsafe { GBuf::from_raw(&gpu, p, h.len()) })
        .collect();
    assert_eq!(
        gpu.live_bytes() - live0,
        host.iter().map(|h| h.len() * 4).sum::<usize>()
    );
    for (w, &p) in wrapped.iter().zip(&foreign) {
        assert_eq!(w.device_ptr(), p, "wrapped in place, not copied");
    }
    let got = run(&wrapped);
    assert_eq!(got.0, want.0, "o bitwise");
    assert_eq!(got.1, want.1, "final state bitwise");
    for (w, &p) in wrapped.into_iter().zip(&foreign) {
        assert_eq!(w.into_raw(), p);
    }
    assert_eq!(gpu.live_bytes(), live0);
    gpu.sync().unwrap();
    // still allocated and unchanged: read back, then free with the driver
    for (h, &p) in host.iter().zip(&foreign) {
        let mut back = vec![0f32; h.len()];
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut back, p) }.unwrap();
        assert_eq!(&back, h);
        unsafe { cudarc::driver::result::free_sync(p) }.unwrap();
    }
}
