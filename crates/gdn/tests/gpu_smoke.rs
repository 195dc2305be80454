//! The CUDA toolchain end to end on a real GPU: context, NVRTC, launch, bf16 rounding, the
//! allocator's byte counters. Run on the device machine with `--include-ignored`.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gdn::device::cuda::{self, DBuf, DType};

#[test]
#[ignore = "needs a CUDA GPU"]
fn axpy_and_bf16_round_trip_and_byte_counters() {
    let gpu = cuda::gpu(0).expect("a CUDA GPU");
    eprintln!("{:?}, NVRTC {}", gpu, cuda::nvrtc_version());
    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 100.0).collect();
    let y0: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let live0 = gpu.live_bytes();
    let xd = gpu.upload(&x).unwrap();
    let mut yd = gpu.upload(&y0).unwrap();
    assert_eq!(gpu.live_bytes() - live0, 2 * n * 4);
    let f = gpu.function("smoke", "axpy_f32").unwrap();
    // NVRTC makes a CUBIN for every architecture we compile for, and the driver must take it
    // (else every process JIT-compiles the PTX of each module it loads)
    assert!(
        gpu.cubin_loads() >= 1,
        "the smoke module was loaded from PTX, not its CUBIN"
    );
    let mut b = gpu.stream().launch_builder(&f);
    let (a, nn) = (2.5f32, n as i64);
    b.arg(&xd.slice).arg(&mut yd.slice).arg(&a).arg(&nn);
    unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    let y = gpu.download(&yd).unwrap();
    for i in 0..n {
        // the GPU fuses the multiply-add (one rounding), as mul_add does
        assert_eq!(y[i], 2.5f32.mul_add(x[i], y0[i]));
    }
    let mut bd = DBuf::uninit(&gpu, n, DType::Bf16).unwrap();
    let mut zd = gpu.uninit::<f32>(n).unwrap();
    let f = gpu.function("smoke", "bf16_round_trip").unwrap();
    let mut b = gpu.stream().launch_builder(&f);
    let DBuf::Bf16(bb) = &mut bd else {
        unreachable!()
    };
    b.arg(&xd.slice)
        .arg(&mut bb.slice)
        .arg(&mut zd.slice)
        .arg(&nn);
    unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    let z = gpu.download(&zd).unwrap();
    for i in 0..n {
        assert_eq!(
            z[i],
            half::bf16::from_f32(x[i]).to_f32(),
            "bf16 rounding at {i}"
        );
    }
    let peak = gpu.peak_bytes();
    drop((xd, yd, bd, zd));
    assert_eq!(gpu.live_bytes(), live0);
    assert!(peak >= live0 + n * (4 + 4 + 2 + 4));
}
