//! safetensors reading and writing.
//!
//! Reading accepts floating-point tensors stored as `F32`, `BF16` or `F16` (converted to `f32`)
//! and, through [`read_any`], integer tensors stored as `I64` or `I32` (for `cu_seqlens`).
//! Tensors come back in file order (ascending data offset). The safetensors library writes
//! tensors sorted by dtype alignment, then by name, so files from [`write_tensors`] (all `F32`)
//! read back sorted by name.
//!
//! Writing is always `F32`, and atomic: the file is written to `<path>.tmp-<pid>`, synced and
//! renamed over `path`, so a failure never leaves a partial file at `path`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, View};

use crate::config::GdnConfig;
use crate::error::{GdnError, Result};
use crate::layer::Params;
use crate::tensor::Tensor;

/// An integer tensor read from a file (`I64` or `I32`, widened to `i64`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Data, row-major.
    pub data: Vec<i64>,
}

impl IntTensor {
    /// The values as `u64`, requiring a 1-D tensor of non-negative values (e.g. `cu_seqlens`).
    /// Errors name `name` and `path`.
    pub fn to_u64_1d(&self, name: &str, path: &Path) -> Result<Vec<u64>> {
        if self.shape.len() != 1 {
            return Err(file_err(
                path,
                format!("tensor {name} must be 1-D, has shape {:?}", self.shape),
            ));
        }
        self.data
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                u64::try_from(v)
                    .map_err(|_| file_err(path, format!("tensor {name}[{i}] = {v} is negative")))
            })
            .collect()
    }
}

/// A tensor read by [`read_any`]: floating point (as `f32`) or integer (as `i64`).
#[derive(Clone, Debug, PartialEq)]
pub enum AnyTensor {
    /// `F32`, `BF16` or `F16` in the file.
    Float(Tensor),
    /// `I64` or `I32` in the file.
    Int(IntTensor),
}

pub(crate) fn file_err(path: &Path, msg: impl Into<String>) -> GdnError {
    GdnError::File {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

pub(crate) fn io_err(path: &Path, source: std::io::Error) -> GdnError {
    GdnError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A readable message for a safetensors parse error.
fn describe(e: &SafeTensorError) -> String {
    let what = match e {
        SafeTensorError::HeaderTooSmall => "file shorter than the 8-byte header length".into(),
        SafeTensorError::HeaderTooLarge => "header length is larger than allowed".into(),
        SafeTensorError::InvalidHeaderLength => {
            "header length runs past the end of the file".into()
        }
        SafeTensorError::InvalidHeader => "header is not UTF-8".into(),
        SafeTensorError::InvalidHeaderStart => "header does not start with '{'".into(),
        SafeTensorError::InvalidHeaderDeserialization => {
            "header is not valid safetensors JSON".into()
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            "data section size does not match the header (truncated or padded file)".into()
        }
        SafeTensorError::InvalidOffset(n) => format!("tensor {n} has invalid data offsets"),
        SafeTensorError::TensorInvalidInfo => {
            "a tensor's byte size does not match its shape and dtype".into()
        }
        SafeTensorError::ValidationOverflow => "a tensor's shape overflows".into(),
        other => format!("{other:?}"),
    };
    format!("not a valid safetensors file: {what}")
}

fn unsupported(path: &Path, name: &str, dtype: Dtype, ints: bool) -> GdnError {
    let also = if ints {
        " (and I64, I32 for integer tensors such as cu_seqlens)"
    } else {
        ""
    };
    file_err(
        path,
        format!("tensor {name} has dtype {dtype:?}; supported: F32, BF16, F16{also}"),
    )
}

/// Parse a whole file; integer tensors are returned when `ints`, else they are an error.
fn load(path: &Path, ints: bool) -> Result<Vec<(String, AnyTensor)>> {
    let buf = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let (_, meta) = SafeTensors::read_metadata(&buf).map_err(|e| file_err(path, describe(&e)))?;
    let st = SafeTensors::deserialize(&buf).map_err(|e| file_err(path, describe(&e)))?;
    // file order: ascending data offset (ties, i.e. empty tensors, by name)
    let mut infos: Vec<(String, (usize, usize))> = meta
        .tensors()
        .into_iter()
        .map(|(n, info)| (n, info.data_offsets))
        .collect();
    infos.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    let mut out = Vec::with_capacity(infos.len());
    for (name, _) in infos {
        let view = st.tensor(&name).map_err(|e| file_err(path, describe(&e)))?;
        let shape = view.shape().to_vec();
        let b = view.data();
        let t = match view.dtype() {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            Dtype::I64 if ints => {
                let data = b
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect();
                out.push((name, AnyTensor::Int(IntTensor { shape, data })));
                continue;
            }
            Dtype::I32 if ints => {
                let data = b
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                    .collect();
                out.push((name, AnyTensor::Int(IntTensor { shape, data })));
                continue;
            }
            other => return Err(unsupported(path, &name, other, ints)),
        };
        let t = Tensor::from_vec(&shape, t)
            .map_err(|e| file_err(path, format!("tensor {name}: {e}")))?;
        out.push((name, AnyTensor::Float(t)));
    }
    Ok(out)
}

/// Read every tensor of a safetensors file, floating point and integer, in file order.
///
/// Float dtypes `F32`, `BF16`, `F16` become [`AnyTensor::Float`]; `I64`, `I32` become
/// [`AnyTensor::Int`]; any other dtype is a [`GdnError::File`] naming the tensor and its dtype.
pub fn read_any(path: &Path) -> Result<Vec<(String, AnyTensor)>> {
    load(path, true)
}

/// Read every tensor of a safetensors file as `f32`, in file order.
///
/// Accepts `F32`, `BF16` and `F16`; any other dtype (integers included) is a
/// [`GdnError::File`] naming the tensor and its dtype. A missing or unreadable file is a
/// [`GdnError::Io`]; a corrupt one a [`GdnError::File`]; both carry the path.
pub fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    Ok(load(path, false)?
        .into_iter()
        .map(|(n, t)| match t {
            AnyTensor::Float(t) => (n, t),
            AnyTensor::Int(_) => unreachable!("load(_, false) returns floats only"),
        })
        .collect())
}

/// Read the integer tensor `name` of a file as 1-D non-negative `u64` values (e.g.
/// `cu_seqlens`); `Ok(None)` if the file has no tensor of that name. `I64` and `I32` are accepted.
pub fn read_u64_tensor(path: &Path, name: &str) -> Result<Option<Vec<u64>>> {
    for (n, t) in read_any(path)? {
        if n == name {
            return match t {
                AnyTensor::Int(it) => it.to_u64_1d(name, path).map(Some),
                AnyTensor::Float(_) => Err(file_err(
                    path,
                    format!(
                        "tensor {name} must be an integer tensor (I64 or I32), found a float one"
                    ),
                )),
            };
        }
    }
    Ok(None)
}

/// Read a layer's parameters and check them against `cfg`: every parameter of
/// [`crate::layer::param_specs`] present with its shape, nothing else. The error names the
/// missing, misshapen or unexpected tensor and the path.
pub fn read_params(path: &Path, cfg: &GdnConfig) -> Result<Params> {
    let p = Params::from_entries(read_tensors(path)?);
    p.check_against(cfg, &path.display().to_string())?;
    Ok(p)
}

/// An `f32` tensor viewed as safetensors data (little-endian bytes).
struct F32View<'a>(&'a Tensor);

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.0.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.0.data().iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.0.bytes()
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|s| s.to_os_string())
        .unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Largest text file (a config) the tool reads: 16 MiB. A larger one, or an endless one such as
/// `/dev/zero`, is refused with an error instead of being read into memory.
pub const MAX_TEXT_BYTES: u64 = 16 << 20;

/// Read at most `max` bytes of `path`; a file with more is an error naming the limit.
pub fn read_limited(path: &Path, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let mut buf = Vec::new();
    f.take(max.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| io_err(path, e))?;
    if buf.len() as u64 > max {
        return Err(file_err(
            path,
            format!("larger than the {max} bytes allowed for this file"),
        ));
    }
    Ok(buf)
}

/// Read a UTF-8 text file of at most [`MAX_TEXT_BYTES`] (configs).
pub fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read_limited(path, MAX_TEXT_BYTES)?)
        .map_err(|_| file_err(path, "not UTF-8 text"))
}

/// Write `bytes` to `path` atomically: the data goes to a temporary file beside it first and is
/// renamed over `path` only when complete and synced. On any error `path` is left as it was.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| {
        use std::io::Write;
        f.write_all(bytes)
    })
}

/// [`write_atomic`] with the content written by `fill` into the temporary file.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    if path.file_name().is_none() {
        return Err(file_err(path, "not a file path"));
    }
    let tmp = temp_path(path);
    let result = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        fill(&mut f).map_err(|e| io_err(&tmp, e))?;
        f.sync_all().map_err(|e| io_err(&tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Write `tensors` as `F32` to a safetensors file at `path` (replacing it), atomically: the data
/// goes to `<path>.tmp-<pid>` first and is renamed over `path` only when complete. On any error
/// the temporary file is removed and `path` is left as it was. Names must be unique.
pub fn write_tensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    write_tensors_with_meta(
        path,
        tensors,
        [("format".to_string(), "pt".to_string())].into(),
    )
}

/// [`write_tensors`] with the file's metadata given (checkpoints add their own keys).
pub(crate) fn write_tensors_with_meta(
    path: &Path,
    tensors: &[(&str, &Tensor)],
    meta: HashMap<String, String>,
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (n, _) in tensors {
        if !seen.insert(*n) {
            return Err(file_err(path, format!("tensor name {n} given twice")));
        }
    }
    if path.file_name().is_none() {
        return Err(file_err(path, "not a file path"));
    }
    let tmp = temp_path(path);
    let result = (|| -> Result<()> {
        let views = tensors.iter().map(|(n, t)| (*n, F32View(t)));
        safetensors::serialize_to_file(views, &Some(meta), &tmp).map_err(|e| match e {
            SafeTensorError::IoError(io) => io_err(&tmp, io),
            e => file_err(path, format!("cannot serialize: {e:?}")),
        })?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Normalization;

    /// A fresh empty directory under the system temp dir.
    fn tmpdir(tag: &str) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "gdn-io-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn small_cfg() -> GdnConfig {
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

    fn ramp(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(shape, (0..n).map(|i| i as f32 * 0.25 - 3.0).collect()).unwrap()
    }

    /// A raw tensor for writing arbitrary dtypes with safetensors' own API.
    struct Raw {
        dtype: Dtype,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    }
    impl View for &Raw {
        fn dtype(&self) -> Dtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.bytes)
        }
        fn data_len(&self) -> usize {
            self.bytes.len()
        }
    }

    fn write_raw(path: &Path, items: &[(&str, Raw)]) {
        safetensors::serialize_to_file(items.iter().map(|(n, r)| (*n, r)), &None, path).unwrap();
    }

    #[test]
    fn roundtrip_f32() {
        let d = tmpdir("roundtrip");
        let p = d.join("t.safetensors");
        let a = ramp(&[3, 5]);
        let b = ramp(&[7]);
        let c = Tensor::from_vec(&[], vec![f32::MIN_POSITIVE]).unwrap();
        write_tensors(&p, &[("b", &b), ("a", &a), ("c", &c)]).unwrap();
        let got = read_tensors(&p).unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(got[0].1, a);
        assert_eq!(got[1].1, b);
        assert_eq!(got[2].1, c);
        // no temp file left behind
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        // overwrite works
        write_tensors(&p, &[("a", &b)]).unwrap();
        assert_eq!(read_tensors(&p).unwrap(), vec![("a".to_string(), b)]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn reads_bf16_and_f16() {
        let d = tmpdir("bf16");
        let p = d.join("t.safetensors");
        let vals = [1.0f32, -2.5, 0.15625, 3.0e4, -0.0, 65504.0];
        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let hf: Vec<u8> = vals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        write_raw(
            &p,
            &[
                (
                    "w_bf16",
                    Raw {
                        dtype: Dtype::BF16,
                        shape: vec![2, 3],
                        bytes: bf,
                    },
                ),
                (
                    "w_f16",
                    Raw {
                        dtype: Dtype::F16,
                        shape: vec![6],
                        bytes: hf,
                    },
                ),
            ],
        );
        let got = read_tensors(&p).unwrap();
        let get = |n: &str| got.iter().find(|(m, _)| m == n).unwrap().1.clone();
        let b = get("w_bf16");
        assert_eq!(b.shape(), &[2, 3]);
        let want: Vec<f32> = vals
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(b.data(), want.as_slice());
        assert_eq!(b.data()[0], 1.0);
        assert_eq!(b.data()[1], -2.5);
        let h = get("w_f16");
        assert_eq!(h.shape(), &[6]);
        let want: Vec<f32> = vals
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect();
        assert_eq!(h.data(), want.as_slice());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn read_params_roundtrip_and_missing_tensor() {
        let cfg = small_cfg();
        let d = tmpdir("params");
        let p = d.join("w.safetensors");
        let params = Params::init(&cfg, 3).unwrap();
        let entries: Vec<(&str, &Tensor)> = params.iter().collect();
        write_tensors(&p, &entries).unwrap();
        let back = read_params(&p, &cfg).unwrap();
        for (n, t) in params.iter() {
            assert_eq!(back.get(n), Some(t), "{n}");
        }

        let without: Vec<(&str, &Tensor)> = params.iter().filter(|(n, _)| *n != "A_log").collect();
        write_tensors(&p, &without).unwrap();
        let e = read_params(&p, &cfg).unwrap_err().to_string();
        assert!(e.contains("missing tensor A_log"), "{e}");
        assert!(e.contains(&p.display().to_string()), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn read_params_wrong_shape_and_unexpected() {
        let cfg = small_cfg();
        let d = tmpdir("shape");
        let p = d.join("w.safetensors");
        let mut params = Params::init(&cfg, 3).unwrap();
        params.set("dt_bias", Tensor::zeros(&[3]));
        let entries: Vec<(&str, &Tensor)> = params.iter().collect();
        write_tensors(&p, &entries).unwrap();
        let e = read_params(&p, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("dt_bias") && e.contains("[3]") && e.contains("[2]"),
            "{e}"
        );

        let mut params = Params::init(&cfg, 3).unwrap();
        params.set("in_proj.layer_norm_bias", Tensor::zeros(&[16]));
        let entries: Vec<(&str, &Tensor)> = params.iter().collect();
        write_tensors(&p, &entries).unwrap();
        let e = read_params(&p, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("unexpected tensor in_proj.layer_norm_bias"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corrupt_and_missing_files() {
        let d = tmpdir("corrupt");
        let p = d.join("bad.safetensors");
        std::fs::write(&p, b"definitely not safetensors").unwrap();
        let e = read_tensors(&p).unwrap_err();
        assert!(matches!(e, GdnError::File { .. }), "{e:?}");
        assert!(e.to_string().contains("bad.safetensors"), "{e}");
        assert!(
            e.to_string().contains("not a valid safetensors file"),
            "{e}"
        );

        // a valid file, truncated
        let good = d.join("good.safetensors");
        write_tensors(&good, &[("a", &ramp(&[10]))]).unwrap();
        let bytes = std::fs::read(&good).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
        let e = read_tensors(&p).unwrap_err();
        assert!(matches!(e, GdnError::File { .. }), "{e:?}");

        // too short for a header
        std::fs::write(&p, b"abc").unwrap();
        assert!(matches!(
            read_tensors(&p).unwrap_err(),
            GdnError::File { .. }
        ));

        let missing = d.join("nope.safetensors");
        let e = read_tensors(&missing).unwrap_err();
        assert!(matches!(e, GdnError::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("nope.safetensors"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unsupported_dtype() {
        let d = tmpdir("dtype");
        let p = d.join("i.safetensors");
        let bytes: Vec<u8> = [0i64, 5, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_raw(
            &p,
            &[(
                "cu_seqlens",
                Raw {
                    dtype: Dtype::I64,
                    shape: vec![3],
                    bytes,
                },
            )],
        );
        let e = read_tensors(&p).unwrap_err().to_string();
        assert!(e.contains("cu_seqlens") && e.contains("I64"), "{e}");

        // read_any / read_u64_tensor take it
        assert_eq!(
            read_u64_tensor(&p, "cu_seqlens").unwrap(),
            Some(vec![0, 5, 9])
        );
        assert_eq!(read_u64_tensor(&p, "other").unwrap(), None);

        let bytes: Vec<u8> = [1.0f64, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_raw(
            &p,
            &[(
                "x",
                Raw {
                    dtype: Dtype::F64,
                    shape: vec![2],
                    bytes,
                },
            )],
        );
        let e = read_tensors(&p).unwrap_err().to_string();
        assert!(e.contains("tensor x") && e.contains("F64"), "{e}");
        let e = read_any(&p).unwrap_err().to_string();
        assert!(e.contains("tensor x") && e.contains("F64"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn read_any_mixed_and_i32() {
        let d = tmpdir("any");
        let p = d.join("in.safetensors");
        let x = ramp(&[1, 4, 2]);
        let xb: Vec<u8> = x.data().iter().flat_map(|v| v.to_le_bytes()).collect();
        let cu: Vec<u8> = [0i32, 1, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        let neg: Vec<u8> = [0i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_raw(
            &p,
            &[
                (
                    "x",
                    Raw {
                        dtype: Dtype::F32,
                        shape: vec![1, 4, 2],
                        bytes: xb,
                    },
                ),
                (
                    "cu_seqlens",
                    Raw {
                        dtype: Dtype::I32,
                        shape: vec![3],
                        bytes: cu,
                    },
                ),
                (
                    "neg",
                    Raw {
                        dtype: Dtype::I32,
                        shape: vec![2],
                        bytes: neg,
                    },
                ),
            ],
        );
        let all = read_any(&p).unwrap();
        assert_eq!(all.len(), 3);
        let get = |n: &str| all.iter().find(|(m, _)| m == n).unwrap().1.clone();
        assert_eq!(get("x"), AnyTensor::Float(x));
        assert_eq!(
            read_u64_tensor(&p, "cu_seqlens").unwrap(),
            Some(vec![0, 1, 4])
        );
        let e = read_u64_tensor(&p, "neg").unwrap_err().to_string();
        assert!(e.contains("neg[1] = -1"), "{e}");
        let e = read_u64_tensor(&p, "x").unwrap_err().to_string();
        assert!(e.contains("integer"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn write_into_missing_directory_fails_cleanly() {
        let d = tmpdir("nodir");
        let p = d.join("no/such/dir/out.safetensors");
        let e = write_tensors(&p, &[("a", &ramp(&[4]))]).unwrap_err();
        assert!(matches!(e, GdnError::Io { .. }), "{e:?}");
        assert!(!p.exists());
        assert!(!d.join("no").exists());
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn failed_write_keeps_old_file() {
        let d = tmpdir("keep");
        let p = d.join("out.safetensors");
        let a = ramp(&[4]);
        write_tensors(&p, &[("a", &a)]).unwrap();
        let e = write_tensors(&p, &[("b", &a), ("b", &a)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("given twice"), "{e}");
        assert_eq!(read_tensors(&p).unwrap(), vec![("a".to_string(), a)]);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
