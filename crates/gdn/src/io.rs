//! safetensors reading and writing.
//!
//! Reading accepts floating-point tensors stored as `F32`, `BF16` or `F16` (converted to `f32`)
//! and, through [`read_any`], integer tensors stored as `I64` or `I32` (for `cu_seqlens`).
//! Tensors come back in file order (ascending data offset). The safetensors library writes
//! tensors sorted by dtype alignment, then by name, so files from [`write_tensors`] (all `F32`)
//! read back sorted by name.
//!
//! Reading checks the header against the file before reading the data, so an endless or huge
//! input (`/dev/zero`, a header claiming terabytes) is an error, not a hang or an abort.
//!
//! Writing is always `F32`, and atomic for regular files: the file is written to
//! `<path>.tmp-<pid>-<n>` beside the target, synced and renamed over it, so a failure never
//! leaves a partial file. A symbolic link is written through (its target is replaced, the link
//! stays), a device or FIFO is written directly, and a directory is refused.

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
    let buf = read_safetensors_bytes(path)?;
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

/// Largest safetensors header: safetensors' own limit (100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Read a whole safetensors file into memory, checking its header before reading the data.
///
/// The 8-byte header length and the header's declared data size are checked against the file's
/// length (a regular file) before the data is read, so a truncated, padded or lying file is an
/// error naming the byte counts, and memory is reserved once (an amount the machine cannot give
/// is an error naming it, not an abort). A stream (FIFO, device, `/dev/stdin`) is read up to the
/// size its header declares and must end there, so an endless one such as `/dev/zero` is refused.
/// The returned bytes are the whole file; full validation is left to the safetensors parser.
pub fn read_safetensors_bytes(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let bad = |msg: String| file_err(path, format!("not a valid safetensors file: {msg}"));
    let mut f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let m = f.metadata().map_err(|e| io_err(path, e))?;
    if m.is_dir() {
        return Err(file_err(
            path,
            "is a directory; expected a safetensors file",
        ));
    }
    // A regular file's length is known; /proc-like files report 0 and are read as streams.
    let file_len = (m.is_file() && m.len() > 0).then_some(m.len());

    let mut len8 = [0u8; 8];
    let got = read_up_to(&mut f, &mut len8).map_err(|e| io_err(path, e))?;
    if got < 8 {
        return Err(bad(format!(
            "file shorter than the 8-byte header length ({got} bytes)"
        )));
    }
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "header length {n} is larger than the {MAX_HEADER_BYTES} bytes allowed"
        )));
    }
    if let Some(len) = file_len {
        if 8 + n > len {
            return Err(bad(format!(
                "header length {n} runs past the end of the file ({len} bytes)"
            )));
        }
    }
    let mut header = Vec::new();
    (&mut f)
        .take(n)
        .read_to_end(&mut header)
        .map_err(|e| io_err(path, e))?;
    if (header.len() as u64) < n {
        return Err(bad(format!(
            "header length {n} runs past the end of the file ({} bytes)",
            8 + header.len()
        )));
    }
    let text = std::str::from_utf8(&header).map_err(|_| bad("header is not UTF-8".into()))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_str(text)
        .map_err(|e| bad(format!("header is not valid safetensors JSON ({e})")))?;
    // Data size as declared: the largest end offset (the parser checks the offsets later).
    let data = meta
        .tensors()
        .values()
        .map(|info| info.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    let total = (8 + n)
        .checked_add(data)
        .ok_or_else(|| bad(format!("declared data size {data} overflows")))?;
    if let Some(len) = file_len {
        if total != len {
            return Err(bad(format!(
                "header declares {data} data bytes, the file has {} after the header \
                 (truncated or padded file)",
                len - 8 - n
            )));
        }
    }
    let mut buf = Vec::new();
    usize::try_from(total)
        .ok()
        .and_then(|t| buf.try_reserve_exact(t).ok())
        .ok_or_else(|| {
            file_err(
                path,
                format!("reading it needs {total} bytes of memory, more than can be allocated"),
            )
        })?;
    buf.extend_from_slice(&len8);
    buf.extend_from_slice(&header);
    drop(header);
    (&mut f)
        .take(data)
        .read_to_end(&mut buf)
        .map_err(|e| io_err(path, e))?;
    if (buf.len() as u64) < total {
        return Err(bad(format!(
            "header declares {data} data bytes, the file ends after {} (truncated file)",
            buf.len() as u64 - 8 - n
        )));
    }
    if file_len.is_none() {
        let mut one = [0u8; 1];
        if read_up_to(&mut f, &mut one).map_err(|e| io_err(path, e))? > 0 {
            return Err(bad(format!(
                "more data after the {data} data bytes the header declares"
            )));
        }
    }
    Ok(buf)
}

/// Fill as much of `buf` as the reader gives before its end; the count read.
fn read_up_to(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Largest text file (a config) the tool reads: 16 MiB. A larger one, or an endless one such as
/// `/dev/zero`, is refused with an error instead of being read into memory.
pub const MAX_TEXT_BYTES: u64 = 16 << 20;

/// Read at most `max` bytes of `path`; a file with more is an error naming the limit.
pub fn read_limited(path: &Path, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(file_err(path, "is a directory; expected a file"));
    }
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

/// Write `bytes` to `path` as [`write_atomic_with`] does.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| {
        use std::io::Write;
        f.write_all(bytes)
    })
}

/// Where a write to a path lands.
enum Target {
    /// A regular file (existing, with its permissions, or new) at this path, the last symbolic
    /// link resolved: written to a temporary file beside it and renamed over it.
    File(PathBuf, Option<std::fs::Permissions>),
    /// An existing device, FIFO or socket: written in place (it cannot be replaced).
    Special,
}

/// Most symbolic links followed when resolving an output path (Linux's own limit).
const MAX_LINK_HOPS: usize = 40;

/// Resolve where writing `path` lands. Directories are refused; symbolic links (dangling ones
/// included: their target is created) are followed to the file they name.
fn write_target(path: &Path) -> Result<Target> {
    use std::io::ErrorKind;
    if path.file_name().is_none() {
        return Err(file_err(path, "not a file path"));
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(file_err(path, "is a directory; expected a file path"));
        }
        Ok(m) if !m.is_file() => return Ok(Target::Special),
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(path, e)),
    }
    // A regular file or nothing: follow the links of the last component ourselves, so the
    // temporary file goes beside the file actually written and the links stay links.
    let mut p = path.to_path_buf();
    for _ in 0..MAX_LINK_HOPS {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p).map_err(|e| io_err(&p, e))?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            Ok(m) if m.is_dir() => {
                return Err(file_err(path, format!("{} is a directory", p.display())));
            }
            Ok(m) if m.is_file() => return Ok(Target::File(p, Some(m.permissions()))),
            Ok(_) => return Ok(Target::Special),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if p.file_name().is_none() {
                    return Err(file_err(
                        path,
                        format!("symbolic link to {}, not a file path", p.display()),
                    ));
                }
                return Ok(Target::File(p, None));
            }
            Err(e) => return Err(io_err(&p, e)),
        }
    }
    Err(file_err(
        path,
        format!("more than {MAX_LINK_HOPS} symbolic links to follow"),
    ))
}

/// A temporary file that is removed when dropped unless kept (so any error or panic cleans up).
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Create a new temporary file `<target>.tmp-<pid>-<n>` beside `target` (never an existing one).
fn create_temp(target: &Path) -> Result<(std::fs::File, TempFile)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .map(|s| s.to_os_string())
        .unwrap_or_default();
    let mut last = None;
    for _ in 0..100 {
        let mut n = name.clone();
        n.push(format!(
            ".tmp-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = target.with_file_name(n);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(f) => return Ok((f, TempFile(Some(tmp)))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((tmp, e)),
            Err(e) => return Err(io_err(&tmp, e)),
        }
    }
    let (tmp, e) = last.expect("loop ran");
    Err(io_err(&tmp, e))
}

/// Write `path` with the content written by `fill`, never leaving a partial file:
///
/// - a regular file (existing or new) is written to a temporary file `<file>.tmp-<pid>-<n>`
///   beside it, synced and renamed over it; an existing file keeps its permissions. On any error
///   the temporary file is removed and the file is left as it was;
/// - a symbolic link is written through: the file it points to is written as above (created if
///   the link dangles) and the link stays a link;
/// - a device, FIFO or socket (e.g. `/dev/null`) is opened and written in place, never replaced;
/// - a directory is an error.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    match write_target(path)? {
        Target::Special => {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| io_err(path, e))?;
            fill(&mut f).map_err(|e| io_err(path, e))
        }
        Target::File(target, perms) => {
            let (mut f, mut tmp) = create_temp(&target)?;
            let tmp_path = tmp.0.clone().expect("temp path set");
            fill(&mut f).map_err(|e| io_err(&tmp_path, e))?;
            if let Some(perms) = perms {
                f.set_permissions(perms).map_err(|e| io_err(&tmp_path, e))?;
            }
            f.sync_all().map_err(|e| io_err(&tmp_path, e))?;
            drop(f);
            std::fs::rename(&tmp_path, &target).map_err(|e| io_err(&target, e))?;
            tmp.0 = None; // renamed: nothing to remove
            Ok(())
        }
    }
}

/// Write `tensors` as `F32` to a safetensors file at `path` (replacing it) through
/// [`write_atomic_with`]: atomic for a regular file, through symbolic links, in place for a
/// device. On any error `path` is left as it was. Names must be unique.
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
    let views = tensors.iter().map(|(n, t)| (*n, F32View(t)));
    let bytes = safetensors::serialize(views, &Some(meta))
        .map_err(|e| file_err(path, format!("cannot serialize: {e:?}")))?;
    write_atomic(path, &bytes)
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
    fn writes_through_symlinks() {
        use std::os::unix::fs::symlink;
        let d = tmpdir("symlink");
        let real_dir = d.join("real");
        std::fs::create_dir(&real_dir).unwrap();
        let real = real_dir.join("w.safetensors");
        write_tensors(&real, &[("a", &ramp(&[3]))]).unwrap();
        // d/link -> real/w.safetensors (relative), d/link2 -> link (a chain)
        let link = d.join("link");
        symlink("real/w.safetensors", &link).unwrap();
        let link2 = d.join("link2");
        symlink(&link, &link2).unwrap();
        let b = ramp(&[5]);
        write_tensors(&link2, &[("b", &b)]).unwrap();
        for l in [&link, &link2] {
            assert!(
                std::fs::symlink_metadata(l)
                    .unwrap()
                    .file_type()
                    .is_symlink(),
                "{} was replaced",
                l.display()
            );
        }
        assert_eq!(read_tensors(&real).unwrap(), vec![("b".to_string(), b)]);
        assert_eq!(listing(&d), ["link", "link2", "real"]);
        assert_eq!(listing(&real_dir), ["w.safetensors"]);

        // a dangling link: the file it names is created, the link stays
        let dangling = d.join("dangling");
        symlink("real/new.toml", &dangling).unwrap();
        write_atomic(&dangling, b"x = 1\n").unwrap();
        assert!(std::fs::symlink_metadata(&dangling)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read(real_dir.join("new.toml")).unwrap(),
            b"x = 1\n"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Run `cmd args`; false (with a note) where it is not permitted here.
    fn try_cmd(cmd: &str, args: &[&str]) -> bool {
        match std::process::Command::new(cmd).args(args).status() {
            Ok(s) if s.success() => true,
            other => {
                eprintln!(
                    "skipped: `{cmd} {}` not permitted here ({other:?})",
                    args.join(" ")
                );
                false
            }
        }
    }

    #[test]
    fn device_node_is_written_in_place() {
        use std::os::unix::fs::FileTypeExt;
        let d = tmpdir("mknod");
        let null = d.join("null");
        // a copy of /dev/null (char 1:3); never the real one
        if !try_cmd("mknod", &[null.to_str().unwrap(), "c", "1", "3"]) {
            return;
        }
        write_tensors(&null, &[("a", &ramp(&[4]))]).unwrap();
        write_atomic(&null, b"text").unwrap();
        let m = std::fs::symlink_metadata(&null).unwrap();
        assert!(m.file_type().is_char_device(), "replaced: {m:?}");
        assert_eq!(listing(&d), ["null"]);
        // through a symbolic link too
        let link = d.join("link");
        std::os::unix::fs::symlink(&null, &link).unwrap();
        write_atomic(&link, b"text").unwrap();
        assert!(std::fs::symlink_metadata(&null)
            .unwrap()
            .file_type()
            .is_char_device());
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn fifo_is_written_in_place() {
        use std::io::Read;
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        let d = tmpdir("fifo");
        let fifo = d.join("fifo");
        if !try_cmd("mkfifo", &[fifo.to_str().unwrap()]) {
            return;
        }
        // a non-blocking reader, so the writer's open does not wait (O_NONBLOCK = 0o4000)
        let mut reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(0o4000)
            .open(&fifo)
            .unwrap();
        let a = ramp(&[6]);
        write_tensors(&fifo, &[("a", &a)]).unwrap();
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        let st = SafeTensors::deserialize(&got).unwrap();
        assert_eq!(st.names(), ["a"]);
        assert_eq!(listing(&d), ["fifo"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn directory_target_is_refused() {
        let d = tmpdir("dirtarget");
        let sub = d.join("sub");
        std::fs::create_dir(&sub).unwrap();
        let link = d.join("link");
        std::os::unix::fs::symlink(&sub, &link).unwrap();
        for p in [&sub, &link] {
            let e = write_tensors(p, &[("a", &ramp(&[2]))]).unwrap_err();
            assert!(matches!(e, GdnError::File { .. }), "{e:?}");
            let e = e.to_string();
            assert!(
                e.contains("is a directory; expected a file path")
                    && e.contains(&*p.display().to_string()),
                "{e}"
            );
        }
        assert!(sub.is_dir());
        assert_eq!(listing(&d), ["link", "sub"]);
        assert!(listing(&sub).is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn failed_or_panicking_fill_leaves_no_temp_file() {
        let d = tmpdir("fillerr");
        let p = d.join("f.txt");
        write_atomic(&p, b"old").unwrap();
        let e = write_atomic_with(&p, |f| {
            use std::io::Write;
            f.write_all(b"partial")?;
            Err(std::io::Error::other("disk on fire"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("disk on fire"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(listing(&d), ["f.txt"]);
        let r = std::panic::catch_unwind(|| {
            let _ = write_atomic_with(&p, |f| {
                use std::io::Write;
                f.write_all(b"partial")?;
                panic!("fill panicked");
            });
        });
        assert!(r.is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(listing(&d), ["f.txt"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn temp_file_never_replaces_an_existing_one_and_permissions_stay() {
        use std::os::unix::fs::PermissionsExt;
        let d = tmpdir("perm");
        let p = d.join("f.txt");
        std::fs::write(&p, b"old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        // something of the user's at the name the old writer used
        let theirs = d.join(format!("f.txt.tmp-{}", std::process::id()));
        std::fs::write(&theirs, b"theirs").unwrap();
        write_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read(&theirs).unwrap(), b"theirs");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The raw bytes of a safetensors file: length, header, data.
    fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(data);
        b
    }

    #[test]
    fn endless_and_lying_inputs_are_refused() {
        // /dev/zero: header length 0, then an endless stream
        let e = read_any(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero") && e.contains("header"), "{e}");
        let e = read_limited(Path::new("/dev/zero"), 1000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than the 1000 bytes"), "{e}");

        let d = tmpdir("lying");
        let p = d.join("x.safetensors");
        // header claims 4 TB of data the file does not have
        std::fs::write(
            &p,
            raw_file(
                r#"{"x":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,4000000000000]}}"#,
                &[0; 16],
            ),
        )
        .unwrap();
        let e = read_any(&p).unwrap_err().to_string();
        assert!(
            e.contains("declares 4000000000000 data bytes, the file has 16"),
            "{e}"
        );
        // header length past the end of the file
        let mut b = raw_file("{}", &[]);
        b[..8].copy_from_slice(&1000u64.to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        let e = read_any(&p).unwrap_err().to_string();
        assert!(e.contains("header length 1000 runs past the end"), "{e}");
        // header length beyond safetensors' limit
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        let e = read_any(&p).unwrap_err().to_string();
        assert!(e.contains("larger than the 100000000 bytes allowed"), "{e}");
        // a shape whose element count overflows
        std::fs::write(
            &p,
            raw_file(
                r#"{"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
                &[],
            ),
        )
        .unwrap();
        let e = read_any(&p).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        // a directory
        let e = read_any(&d).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn streams_are_read_up_to_the_declared_size() {
        use std::io::Write;
        let d = tmpdir("stream");
        let fifo = d.join("fifo");
        if !try_cmd("mkfifo", &[fifo.to_str().unwrap()]) {
            return;
        }
        let a = ramp(&[3, 100]);
        let bytes = safetensors::serialize([("a", F32View(&a))], &None).unwrap();
        let feed = |extra: &'static [u8]| {
            let (fifo, bytes) = (fifo.clone(), bytes.clone());
            std::thread::spawn(move || {
                let mut f = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
                let _ = f.write_all(&bytes);
                let _ = f.write_all(extra);
            })
        };
        let t = feed(b"");
        assert_eq!(read_tensors(&fifo).unwrap(), vec![("a".to_string(), a)]);
        t.join().unwrap();
        let t = feed(b"trailing");
        let e = read_tensors(&fifo).unwrap_err().to_string();
        assert!(e.contains("more data after the 1200 data bytes"), "{e}");
        t.join().unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}
