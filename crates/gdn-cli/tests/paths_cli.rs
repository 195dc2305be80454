//! End-to-end tests of `gdn layer`'s output paths, input limits and argument ranges: nothing the
//! user owns is replaced or destroyed, and hostile inputs give a `gdn: error:` line.

use std::os::unix::fs::{symlink, FileTypeExt};
use std::path::{Path, PathBuf};

mod common;
use common::{expect_fail, gdn, layer_run, ok, tmpdir};

use gdn::io::{read_tensors, write_tensors};
use gdn::{GdnConfig, Normalization, Params, Tensor};

const HIDDEN: usize = 16;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn small_cfg() -> GdnConfig {
    GdnConfig {
        hidden_size: HIDDEN,
        linear_num_key_heads: 1,
        linear_num_value_heads: 2,
        linear_key_head_dim: 4,
        linear_value_head_dim: 4,
        normalization: Normalization::RMSNorm,
        ..Default::default()
    }
}

fn ramp(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(shape, (0..n).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect()).unwrap()
}

/// config.toml, weights.safetensors, x.safetensors (x [1, 6, h] and dy) in `d`.
fn setup(d: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let cfg = small_cfg();
    let c = d.join("config.toml");
    std::fs::write(&c, cfg.to_toml_string()).unwrap();
    let w = d.join("weights.safetensors");
    write_tensors(
        &w,
        &Params::init(&cfg, 1).unwrap().iter().collect::<Vec<_>>(),
    )
    .unwrap();
    let x = d.join("x.safetensors");
    write_tensors(
        &x,
        &[
            ("x", &ramp(&[1, 6, HIDDEN])),
            ("dy", &ramp(&[1, 6, HIDDEN])),
        ],
    )
    .unwrap();
    (c, w, x)
}

fn is_symlink(p: &Path) -> bool {
    std::fs::symlink_metadata(p)
        .unwrap()
        .file_type()
        .is_symlink()
}

/// Names in `d`, sorted.
fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn output_symlink_is_written_through() {
    let d = tmpdir("out-link");
    let (c, w, x) = setup(&d);
    let real = d.join("real.safetensors");
    let link = d.join("out.safetensors");
    symlink("real.safetensors", &link).unwrap();
    // a dangling link: the file it names is created
    ok(&layer_run(&c, &w, &x, &link, &[]));
    assert!(is_symlink(&link), "the link was replaced");
    let t = read_tensors(&real).unwrap();
    assert!(t.iter().any(|(n, _)| n == "y") && t.iter().any(|(n, _)| n == "dx"));
    // and again onto the existing target
    std::fs::write(&real, b"old").unwrap();
    ok(&layer_run(&c, &w, &x, &link, &[]));
    assert!(is_symlink(&link));
    assert!(read_tensors(&real).unwrap().iter().any(|(n, _)| n == "y"));
    assert_eq!(
        listing(&d),
        [
            "config.toml",
            "out.safetensors",
            "real.safetensors",
            "weights.safetensors",
            "x.safetensors"
        ]
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn output_device_node_stays_a_device() {
    let d = tmpdir("out-dev");
    let (c, w, x) = setup(&d);
    let null = d.join("null");
    // a copy of /dev/null (char 1:3) made here; never the machine's own
    match std::process::Command::new("mknod")
        .args([s(&null), "c", "1", "3"])
        .status()
    {
        Ok(st) if st.success() => {}
        other => {
            eprintln!("skipped: mknod is not permitted here ({other:?})");
            return;
        }
    }
    ok(&layer_run(&c, &w, &x, &null, &[]));
    let m = std::fs::symlink_metadata(&null).unwrap();
    assert!(
        m.file_type().is_char_device(),
        "device node replaced: {m:?}"
    );
    assert!(!listing(&d).iter().any(|n| n.contains(".tmp-")));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn output_fifo_is_written_in_place() {
    use std::io::Read;
    let d = tmpdir("out-fifo");
    let (c, w, x) = setup(&d);
    let fifo = d.join("fifo");
    let st = std::process::Command::new("mkfifo").arg(s(&fifo)).status();
    if !matches!(st, Ok(st) if st.success()) {
        eprintln!("skipped: mkfifo is not permitted here ({st:?})");
        return;
    }
    // the reader, like `gdn layer ... --output fifo` with `cat fifo` on the other end
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut b = Vec::new();
            std::fs::File::open(&fifo)
                .unwrap()
                .read_to_end(&mut b)
                .unwrap();
            b
        })
    };
    let o = layer_run(&c, &w, &x, &fifo, &[]);
    let still_fifo = std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo();
    // (if it was replaced, the reader stays blocked; the test process ends it)
    assert!(still_fifo, "the FIFO was replaced by a regular file");
    ok(&o);
    let bytes = reader.join().unwrap();
    let back = d.join("back.safetensors");
    std::fs::write(&back, &bytes).unwrap();
    assert!(read_tensors(&back).unwrap().iter().any(|(n, _)| n == "y"));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn output_directory_is_refused() {
    let d = tmpdir("out-dir");
    let (c, w, x) = setup(&d);
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let link = d.join("link");
    symlink(&sub, &link).unwrap();
    for p in [&sub, &link] {
        expect_fail(&layer_run(&c, &w, &x, p, &[]), &["is a directory"]);
    }
    assert!(sub.is_dir() && listing(&sub).is_empty());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn output_equal_to_an_input_is_refused() {
    let d = tmpdir("out-in");
    let (c, w, x) = setup(&d);
    let dy = d.join("dy.safetensors");
    write_tensors(&dy, &[("dy", &ramp(&[1, 6, HIDDEN]))]).unwrap();
    let x_only = d.join("xo.safetensors");
    write_tensors(&x_only, &[("x", &ramp(&[1, 6, HIDDEN]))]).unwrap();
    let before: Vec<Vec<u8>> = [&c, &w, &x, &dy, &x_only]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    // the same file by another spelling: ./dir/../dir/x
    let dir_name = d.file_name().unwrap().to_str().unwrap();
    let other = d.join("..").join(dir_name).join("x.safetensors");
    let o = layer_run(&c, &w, &x, &other, &[]);
    expect_fail(&o, &["is the same file as --input"]);
    let o = layer_run(&c, &w, &x, &w, &[]);
    expect_fail(&o, &["is the same file as --weights"]);
    let o = layer_run(&c, &w, &x, &c, &[]);
    expect_fail(&o, &["is the same file as --config"]);
    let o = layer_run(&c, &w, &x_only, &dy, &["--grad-output", s(&dy)]);
    expect_fail(&o, &["is the same file as --grad-output"]);
    // through a symbolic link
    let link = d.join("link.safetensors");
    symlink("weights.safetensors", &link).unwrap();
    let o = layer_run(&c, &w, &x, &link, &[]);
    expect_fail(&o, &["is the same file as --weights"]);
    // a relative spelling, from the directory itself
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_gdn"))
        .current_dir(&d)
        .args([
            "layer",
            "--config",
            "config.toml",
            "--weights",
            "./weights.safetensors",
            "--input",
            "x.safetensors",
            "--output",
            "weights.safetensors",
        ])
        .output()
        .unwrap();
    expect_fail(&o, &["is the same file as --weights"]);
    let after: Vec<Vec<u8>> = [&c, &w, &x, &dy, &x_only]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert!(before == after, "an input was changed");
    assert!(is_symlink(&link));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn example_refuses_to_clobber_and_force_overwrites() {
    let d = tmpdir("ex-clobber");
    let dir = d.join("ex");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), "# mine\n").unwrap();
    std::fs::write(dir.join("weights.safetensors"), b"my weights").unwrap();
    let o = gdn(&["layer", "--example", s(&dir)]);
    expect_fail(
        &o,
        &[
            "config.toml",
            "weights.safetensors",
            "already exist",
            "--force",
        ],
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("config.toml")).unwrap(),
        "# mine\n"
    );
    assert_eq!(
        std::fs::read(dir.join("weights.safetensors")).unwrap(),
        b"my weights"
    );
    assert_eq!(listing(&dir), ["config.toml", "weights.safetensors"]);

    // one file only, the output
    let dir2 = d.join("ex2");
    std::fs::create_dir(&dir2).unwrap();
    std::fs::write(dir2.join("out.safetensors"), b"mine").unwrap();
    let e = expect_fail(
        &gdn(&["layer", "--example", s(&dir2)]),
        &["out.safetensors"],
    );
    assert!(!e.contains("config.toml"), "{e}");
    assert_eq!(
        std::fs::read(dir2.join("out.safetensors")).unwrap(),
        b"mine"
    );

    ok(&gdn(&["layer", "--example", s(&dir), "--force"]));
    let cfg = GdnConfig::from_toml_file(&dir.join("config.toml")).unwrap();
    assert_eq!(cfg.hidden_size, 64);
    assert!(read_tensors(&dir.join("out.safetensors"))
        .unwrap()
        .iter()
        .any(|(n, _)| n == "dx"));
    // --force needs --example
    let (c, w, x) = setup(&d);
    expect_fail(
        &layer_run(&c, &w, &x, &d.join("o.safetensors"), &["--force"]),
        &["--example"],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn endless_config_and_inputs_are_refused() {
    let d = tmpdir("endless");
    let (c, w, x) = setup(&d);
    let out = d.join("out.safetensors");
    let zero = Path::new("/dev/zero");
    expect_fail(
        &layer_run(zero, &w, &x, &out, &[]),
        &["/dev/zero", "larger than the 16777216 bytes allowed"],
    );
    for (c, w, x) in [(&*c, zero, &*x), (&*c, &*w, zero)] {
        expect_fail(
            &layer_run(c, w, x, &out, &[]),
            &["/dev/zero", "not a valid safetensors file"],
        );
    }
    let x_only = d.join("xo.safetensors");
    write_tensors(&x_only, &[("x", &ramp(&[1, 6, HIDDEN]))]).unwrap();
    expect_fail(
        &layer_run(&c, &w, &x_only, &out, &["--grad-output", "/dev/zero"]),
        &["/dev/zero", "not a valid safetensors file"],
    );
    // a huge config file is refused by its size
    let big = d.join("big.toml");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(17 << 20).unwrap();
    expect_fail(
        &layer_run(&big, &w, &x, &out, &[]),
        &["big.toml", "bytes allowed"],
    );
    // an input whose header claims far more data than the file has
    let lie = d.join("lie.safetensors");
    let header =
        br#"{"x":{"dtype":"F32","shape":[1,1000000000000,16],"data_offsets":[0,64000000000000]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    std::fs::write(&lie, &b).unwrap();
    expect_fail(
        &layer_run(&c, &w, &lie, &out, &[]),
        &["lie.safetensors", "declares 64000000000000 data bytes"],
    );
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn cu_seqlens_out_of_range_is_named() {
    let d = tmpdir("cu-range");
    let (c, w, x) = setup(&d);
    let out = d.join("out.safetensors");
    let e = expect_fail(
        &layer_run(
            &c,
            &w,
            &x,
            &out,
            &["--cu-seqlens", "0,99999999999999999999"],
        ),
        &["out of range (max 18446744073709551615)"],
    );
    assert!(!e.contains("not a non-negative integer"), "{e}");
    expect_fail(
        &layer_run(&c, &w, &x, &out, &["--cu-seqlens", "0,-2"]),
        &["is negative"],
    );
    // in range for the parser, beyond the 6 tokens of x
    expect_fail(
        &layer_run(
            &c,
            &w,
            &x,
            &out,
            &["--cu-seqlens", "0,18446744073709551615"],
        ),
        &["cu_seqlens", "exceeds the 6 tokens"],
    );
    expect_fail(
        &layer_run(&c, &w, &x, &out, &["--cu-seqlens", "0,3,7"]),
        &["cu_seqlens", "exceeds the 6 tokens"],
    );
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn check_finite_checks_the_weights() {
    let d = tmpdir("finite-w");
    let (c, _, x) = setup(&d);
    let cfg = small_cfg();
    let mut p = Params::init(&cfg, 1).unwrap();
    let mut a = p.get("A_log").unwrap().clone();
    a.data_mut()[1] = f32::NAN;
    p.set("A_log", a);
    let w = d.join("nan.safetensors");
    write_tensors(&w, &p.iter().collect::<Vec<_>>()).unwrap();
    let out = d.join("out.safetensors");
    expect_fail(
        &layer_run(&c, &w, &x, &out, &["--check-finite"]),
        &["nan.safetensors", "A_log", "non-finite", "index 1"],
    );
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn empty_x_with_a_huge_batch_is_refused() {
    let d = tmpdir("empty-x");
    let (c, w, _) = setup(&d);
    let out = d.join("out.safetensors");
    // x [2^40, 0, h]: no data, but 2^40 sequences (this aborted allocating their boundaries)
    let x = d.join("x.safetensors");
    let header = format!(
        r#"{{"x":{{"dtype":"F32","shape":[{},0,{HIDDEN}],"data_offsets":[0,0]}}}}"#,
        1u64 << 40
    );
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    std::fs::write(&x, &b).unwrap();
    expect_fail(
        &layer_run(&c, &w, &x, &out, &[]),
        &["x has shape", "no tokens"],
    );
    write_tensors(&x, &[("x", &ramp(&[1, 0, HIDDEN]))]).unwrap();
    expect_fail(&layer_run(&c, &w, &x, &out, &[]), &["no tokens"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}
