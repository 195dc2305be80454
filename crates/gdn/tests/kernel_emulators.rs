//! The host emulators of `bench/notes/emu/` on the CPU (no GPU): the rule's scan kernels' own CUDA
//! source (the v10 kernels gdr_fwd10, gdr_hrec10, gdr_bwd10 and the prep variants that feed them;
//! the GPU-tested defaults gdr_fwd9 / gdr_fwd8, gdr_hrec6, gdr_bwd8 and gdr_bwd6; the wgmma
//! gradient kernel gdr_grad10, its wgmma from the PTX descriptor maps), extracted from
//! `gated_delta_rule.cu` and compiled as host C++ with one thread per CUDA thread and the warp
//! collectives (ldmatrix, stmatrix, mma.sync) emulated from their fragment maps. Each emulator
//! checks its kernels against f64 references with the kernels' roundings, or bit for bit against
//! the GPU-tested kernels, and exits nonzero on any failure (its mutants, `mutate.py`, show that
//! the checks fire). So an edit that breaks these kernels' algebra, fragment mapping, exchanges,
//! staging or mbarrier ring fails here, in CI, before a GPU runs them.
//!
//! Also GDN2's fused forward (`bench/notes/h-g2f-emu/`, its own harness). Needs `python3` (the
//! extraction) and a C++20 `g++` (std::barrier); both are on the CI
//! machine. Without them the tests fail (set `GDN_EMU_OPTIONAL=1` to skip them instead).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn notes_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/notes")
        .join(name)
}

fn emu_dir() -> PathBuf {
    notes_dir("emu")
}

fn optional() -> bool {
    std::env::var("GDN_EMU_OPTIONAL").as_deref() == Ok("1")
}

/// Runs a command in the emulators' folder to completion within `limit`, killing it after; the
/// outcome: Ok(stdout) on exit status 0, else Err(a description with its output's tail).
fn run(cmd: Command, limit: Duration) -> Result<String, String> {
    run_in(&emu_dir(), cmd, limit)
}

fn run_in(dir: &Path, mut cmd: Command, limit: Duration) -> Result<String, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: could not start: {e}"))?;
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let to = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).ok();
        s
    });
    let te = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err, &mut s).ok();
        s
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > limit => {
                child.kill().ok();
                child.wait().ok();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("{what}: {e}")),
        }
    };
    let (out, err) = (to.join().unwrap_or_default(), te.join().unwrap_or_default());
    let tail = |s: &str| {
        s.lines()
            .rev()
            .take(12)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    };
    match status {
        Some(s) if s.success() => Ok(out),
        Some(s) => Err(format!("{what}: {s}\n{}\n{}", tail(&out), tail(&err))),
        None => Err(format!(
            "{what}: still running after {limit:?}, killed\n{}",
            tail(&out)
        )),
    }
}

/// The extraction and the four builds, once per test process.
fn built() -> &'static Result<(), String> {
    static B: OnceLock<Result<(), String>> = OnceLock::new();
    B.get_or_init(|| {
        let mut py = Command::new("python3");
        py.arg("extract.py");
        run(py, Duration::from_secs(60))?;
        for name in ["main", "fwd10", "prep", "grad10"] {
            let mut cc = Command::new("g++");
            cc.args([
                "-std=c++20",
                "-O2",
                "-pthread",
                "-w",
                &format!("{name}.cpp"),
                "-o",
            ])
            .arg(format!("h/{name}"));
            run(cc, Duration::from_secs(300))?;
        }
        Ok(())
    })
}

/// Builds (once) and runs one emulator; its report lines are printed (`--nocapture`).
fn emulate(name: &str) {
    if let Err(e) = built() {
        if optional() {
            eprintln!("kernel emulators skipped (GDN_EMU_OPTIONAL=1): {e}");
            return;
        }
        panic!("building the kernel emulators failed (python3 and a C++20 g++ are needed; GDN_EMU_OPTIONAL=1 skips): {e}");
    }
    let exe = emu_dir().join("h").join(name);
    match run(Command::new(exe), Duration::from_secs(600)) {
        Ok(out) => {
            print!("{out}");
            assert!(out.contains("all ok"), "{name}: no verdict line in\n{out}");
        }
        Err(e) => panic!("{e}"),
    }
}

/// gdr_hrec10 / gdr_hrec6 (h and D) and gdr_bwd10 / gdr_bwd8 / gdr_bwd6 (dh, dD, dh0) against
/// step-by-step f64 recurrences, and their bf16 twins against the fp32 outputs rounded, bit for
/// bit.
#[test]
fn backward_scans_emulated() {
    emulate("main");
}

/// gdr_fwd10 / gdr_fwd10f and gdr_fwd9 under the asynchronous model of the producer warp and the
/// mbarrier ring: o against the f64 forward rounded to bf16, final states, the ring's protocol;
/// gdr_fwd9 bit for bit against gdr_fwd8.
#[test]
fn fused_forward_emulated() {
    emulate("fwd10");
}

/// The prep's TOUT / TIN + TOUT / TW variants (prep8 and prep9) bit for bit against prep8's
/// outputs and T diag(beta) split as the kernels split it.
#[test]
fn prep_variants_emulated() {
    emulate("prep");
}

/// gdr_grad10 (wgmma, persistent, warp-specialized) under the asynchronous model of cp.async and
/// the mbarriers, with long random holds of readers, warps and producer warps: every output of the
/// two-K-buffer kernel (KB 2, session 20) bit for bit against the single-buffer one (KB 1), also
/// with bf16 D / dD and the packed T; KB 1 against an f64 evaluation of the per-chunk gradients
/// (dq, dk, dv, dg, dbeta); the mbarrier protocol's checks (poisoned released buffers, reads of
/// buffers not held, copies into held buffers, phase order, double or missing arrivals).
#[test]
fn wgmma_gradient_emulated() {
    emulate("grad10");
}

/// GDN2's forward (g2c_prep8h and the fused scan + output g2f_fwd8, every width, Dk 64 / 128,
/// GVA, packed sequences, initial states, three gate regimes; then two cases with the prep's
/// one-TF32-product variant g2c_prep8hf) against an f64 token recurrence:
/// the emulator `bench/notes/h-g2f-emu/` written with those kernels (session 8), run as it is.
#[test]
fn gdn2_fused_forward_emulated() {
    let dir = notes_dir("h-g2f-emu");
    let build = || -> Result<(), String> {
        std::fs::create_dir_all(dir.join("h")).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut py = Command::new("python3");
        py.arg("extract.py");
        run_in(&dir, py, Duration::from_secs(60))?;
        let mut cc = Command::new("g++");
        cc.args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-w",
            "main.cpp",
            "-o",
            "h/main",
        ]);
        run_in(&dir, cc, Duration::from_secs(300))?;
        Ok(())
    };
    if let Err(e) = build() {
        if optional() {
            eprintln!("kernel emulators skipped (GDN_EMU_OPTIONAL=1): {e}");
            return;
        }
        panic!("building the GDN2 forward emulator failed (python3 and a C++20 g++ are needed; GDN_EMU_OPTIONAL=1 skips): {e}");
    }
    // Then the first two cases again with the prep's one-TF32-product variant (g2c_prep8hf,
    // opt-in GDN_RULE2_PREP8=f1).
    for f1 in [false, true] {
        let mut cmd = Command::new(dir.join("h/main"));
        if f1 {
            cmd.env("EMU_PREP_F1", "1").env("EMU_CASES", "2");
        }
        match run_in(&dir, cmd, Duration::from_secs(600)) {
            Ok(out) => {
                print!("{out}");
                assert!(out.trim_end().ends_with("ok"), "no final verdict in\n{out}");
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// GDN2's backward v4 and v5 on the CPU: `bench/notes/h-g2b-emu/` (session 7's harness of the
/// chunked GDN2 backward, its device code extracted from gdn2_rule.cu) against its float64 model
/// of the backward, bf16 inputs, eleven cases (T 1 .. 200, packed with empty and 1-token
/// sequences and padding rows, GVA, Dk 16 .. 128, Dv 16 .. 128, strong gates): v4's gradient
/// kernel `g2b_grad4` (bf16 mma.sync / ldmatrix from shared memory, the diagonal Gram blocks
/// through the block's middle row or elementwise) on the model's workspaces, and where Dk is 64
/// or 128 v5's whole chain (`g2c_prep8ht`, `g2f_hrec8`, `g2b_dscan8`, `g2b_grad4w`); then the
/// elementwise diagonal forced (`-DG4_SAFE=-1.0`) on two cases. Every output must be written and
/// within 1.5e-2 of the largest exact value (bf16 operands: ~4e-3 seen; widths 1, 2, 4, 8 all
/// pass with `EMU_NW`; the 16 mutants of
/// `mutate_v4.py` give 0.22 to inf). The model needs numpy: python3 with numpy (`.ci/run`
/// installs it into `.ci/py`, on `PYTHONPATH`).
#[test]
fn gdn2_backward_v4_v5_emulated() {
    let dir = notes_dir("h-g2b-emu");
    let gxx = |defs: &[&str], out: &str| {
        let mut cc = Command::new("g++");
        cc.args(["-std=c++20", "-O2", "-pthread", "-w"])
            .args(defs)
            .args(["main.cpp", "-o", out]);
        cc
    };
    let build = || -> Result<(), String> {
        std::fs::create_dir_all(dir.join("h")).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut py = Command::new("python3");
        py.arg("extract.py");
        run_in(&dir, py, Duration::from_secs(60))?;
        run_in(&dir, gxx(&[], "h/main"), Duration::from_secs(300))?;
        run_in(
            &dir,
            gxx(&["-DG4_SAFE=-1.0"], "h/main_fb"),
            Duration::from_secs(300),
        )?;
        let mut np = Command::new("python3");
        np.args(["-c", "import numpy"]);
        run_in(&dir, np, Duration::from_secs(60)).map_err(|e| format!("numpy: {e}"))?;
        Ok(())
    };
    if let Err(e) = build() {
        if optional() {
            eprintln!("kernel emulators skipped (GDN_EMU_OPTIONAL=1): {e}");
            return;
        }
        panic!("building the GDN2 backward emulator failed (python3 with numpy and a C++20 g++ are needed; GDN_EMU_OPTIONAL=1 skips): {e}");
    }
    // The second run (v4's elementwise diagonal forced) also takes v5's scans at 8 warps per CTA
    // (the width the GPU picks at B8 T4096 16/16; the first run takes 2, or 1 where Dv = 16 or 48).
    for (bin, cases, nw) in [("./h/main", "", ""), ("./h/main_fb", "0,6", "8")] {
        let mut py = Command::new("python3");
        py.arg("drive.py")
            .env("EMU_BIN", bin)
            .env("EMU_CASES", cases)
            .env("EMU_NW", nw)
            .env("EMU_MAXERR", "1.5e-2")
            .env("EMU_BF16_INPUTS", "1")
            .env("EMU_V2", "1")
            .env("EMU_V4", "1")
            .env("EMU_V5", "1");
        match run_in(&dir, py, Duration::from_secs(900)) {
            Ok(out) => {
                print!("{out}");
                assert!(out.trim_end().ends_with("ok"), "no final verdict in\n{out}");
            }
            Err(e) => panic!("{bin}: {e}"),
        }
    }
}
