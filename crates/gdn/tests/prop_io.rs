//! Property test: random safetensors files (random headers, dtypes, shapes, offsets, lengths and
//! truncated data) through the readers the CLI uses. Every one gives `Ok` or an error naming the
//! file; none panics, aborts or tries to allocate what the header claims.

use std::path::{Path, PathBuf};

use gdn::io::{read_any, read_params, read_u64_tensor, AnyTensor};
use gdn::{GdnConfig, Normalization};
use proptest::prelude::*;

const DTYPES: [(&str, u64); 10] = [
    ("F32", 4),
    ("BF16", 2),
    ("F16", 2),
    ("I64", 8),
    ("I32", 4),
    ("F64", 8),
    ("U8", 1),
    ("BOOL", 1),
    ("F8_E4M3", 1),
    ("Q4", 4),
];

const NAMES: [&str; 8] = [
    "x",
    "dy",
    "cu_seqlens",
    "A_log",
    "dt_bias",
    "out_norm.weight",
    "",
    "a\"b",
];

/// One tensor entry: name, dtype index, shape, and how its offsets are made.
#[derive(Clone, Debug)]
struct Entry {
    name: usize,
    dtype: usize,
    shape: Vec<u64>,
    /// `None`: consistent with the running offset; `Some((s, e))`: these offsets.
    offsets: Option<(u64, u64)>,
}

/// How the file is put together around the header.
#[derive(Clone, Debug)]
struct File {
    entries: Vec<Entry>,
    metadata: u8,
    /// Replace the 8-byte header length (else the true one).
    header_len: Option<u64>,
    /// Cut the header text at this fraction (per mille), if any.
    cut_header: Option<u16>,
    /// Flip this byte of the header, if any (index, xor).
    flip: Option<(usize, u8)>,
    /// Data bytes: declared size plus this (negative: truncated), capped.
    data_delta: i64,
    seed: u8,
}

fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..5,
        1 => Just(16u64),
        1 => Just(1u64 << 32),
        1 => Just(u64::MAX),
        1 => any::<u64>(),
    ]
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        0..NAMES.len(),
        0..DTYPES.len(),
        prop::collection::vec(dim(), 0..4),
        prop_oneof![
            4 => Just(None),
            1 => (0u64..64, 0u64..64).prop_map(Some),
            1 => (any::<u64>(), any::<u64>()).prop_map(Some),
        ],
    )
        .prop_map(|(name, dtype, shape, offsets)| Entry {
            name,
            dtype,
            shape,
            offsets,
        })
}

fn file() -> impl Strategy<Value = File> {
    (
        prop::collection::vec(entry(), 0..5),
        0u8..3,
        prop_oneof![4 => Just(None), 1 => any::<u64>().prop_map(Some), 1 => (0u64..300).prop_map(Some)],
        prop_oneof![4 => Just(None), 1 => (0u16..1000).prop_map(Some)],
        prop_oneof![4 => Just(None), 1 => (any::<usize>(), 1u8..=255).prop_map(Some)],
        prop_oneof![4 => Just(0i64), 1 => -64i64..64],
        any::<u8>(),
    )
        .prop_map(
            |(entries, metadata, header_len, cut_header, flip, data_delta, seed)| File {
                entries,
                metadata,
                header_len,
                cut_header,
                flip,
                data_delta,
                seed,
            },
        )
}

/// The bytes of `f`. Data is capped at 4 KiB, so a header declaring more is a truncated file.
fn bytes(f: &File) -> Vec<u8> {
    let mut items = Vec::new();
    let mut offset = 0u64;
    for e in &f.entries {
        let (name, size) = (NAMES[e.name], DTYPES[e.dtype].1);
        let numel = e
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .unwrap_or(u64::MAX);
        let (s, end) = e.offsets.unwrap_or_else(|| {
            let end = offset.saturating_add(numel.saturating_mul(size));
            (offset, end)
        });
        offset = end;
        items.push(format!(
            "{:?}:{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{s},{end}]}}",
            name, DTYPES[e.dtype].0, e.shape
        ));
    }
    match f.metadata {
        1 => items.insert(0, r#""__metadata__":{"format":"pt"}"#.to_string()),
        2 => items.push(r#""__metadata__":{"format":1}"#.to_string()),
        _ => {}
    }
    let mut header = format!("{{{}}}", items.join(",")).into_bytes();
    if let Some(c) = f.cut_header {
        header.truncate(header.len() * c as usize / 1000);
    }
    if let Some((i, x)) = f.flip {
        if !header.is_empty() {
            let i = i % header.len();
            header[i] ^= x;
        }
    }
    let n = f.header_len.unwrap_or(header.len() as u64);
    let data_len = (offset.min(4096) as i64 + f.data_delta).clamp(0, 4096) as usize;
    let mut out = n.to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend((0..data_len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(f.seed)));
    out
}

fn cfg() -> GdnConfig {
    GdnConfig {
        hidden_size: 16,
        linear_num_key_heads: 1,
        linear_num_value_heads: 2,
        linear_key_head_dim: 4,
        linear_value_head_dim: 4,
        normalization: Normalization::RMSNorm,
        ..Default::default()
    }
}

/// The file a test writes its cases to (one per test: they run in parallel).
fn tmp_file(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gdn-prop-io-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(format!("{tag}.safetensors"))
}

/// `Ok` results are self-consistent; errors name the file.
fn check(path: &Path) -> Result<(), TestCaseError> {
    let name = path.display().to_string();
    match read_any(path) {
        Ok(ts) => {
            for (n, t) in ts {
                let (shape, len) = match &t {
                    AnyTensor::Float(t) => (t.shape().to_vec(), t.data().len()),
                    AnyTensor::Int(t) => (t.shape.clone(), t.data.len()),
                };
                prop_assert_eq!(shape.iter().product::<usize>(), len, "tensor {}", n);
            }
        }
        Err(e) => prop_assert!(e.to_string().contains(&name), "{}", e),
    }
    if let Err(e) = read_params(path, &cfg()) {
        prop_assert!(e.to_string().contains(&name), "{}", e);
    }
    if let Err(e) = read_u64_tensor(path, "cu_seqlens") {
        prop_assert!(e.to_string().contains(&name), "{}", e);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_safetensors_never_panic(f in file()) {
        let p = tmp_file("header");
        std::fs::write(&p, bytes(&f)).unwrap();
        check(&p)?;
    }

    #[test]
    fn random_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..200)) {
        let p = tmp_file("bytes");
        std::fs::write(&p, &b).unwrap();
        check(&p)?;
    }
}
