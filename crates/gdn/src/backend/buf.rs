//! Device-neutral buffers, the one place an op gets a buffer from: an activation ([`Act`]: f32 on
//! the host, f32 or bf16 storage on a GPU), an fp32 buffer ([`F32s`]: statistics, decays, states,
//! parameter gradients) and a borrowed fp32 parameter ([`P`]). Each op's entry
//! (`ops::<op>::forward` / `backward`) takes and returns these and dispatches on where they live;
//! a host/device mix is an error.

use crate::backend::cuda::{DBuf, GBuf};
use crate::error::{GdnError, Result};

/// An activation: f32 on the host, or f32/bf16 storage on a GPU.
pub enum Act {
    Host(Vec<f32>),
    Dev(DBuf),
}

/// Where an op's columns sit in a row-major buffer of `ld` values per row: columns
/// `off .. off + width` of every row. Ops that read a section of a wider buffer in place (the
/// in_proj output `[n, in_proj_dim]`: conv input, `z`, gate logits) or write their gradient into
/// a section of one (`d(in_proj output)`) take the buffer and a `Cols`; a dense `[rows, width]`
/// buffer is [`Cols::dense`]. Plain metadata: one buffer can be read (or written) through
/// several `Cols` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cols {
    /// Values per row of the buffer (row stride).
    pub ld: usize,
    /// First column of the section.
    pub off: usize,
    /// Columns of the section.
    pub width: usize,
}

impl Cols {
    /// Columns `off .. off + width` of rows of `ld` values.
    pub fn new(ld: usize, off: usize, width: usize) -> Self {
        Cols { ld, off, width }
    }
    /// A whole dense `[rows, width]` buffer.
    pub fn dense(width: usize) -> Self {
        Cols {
            ld: width,
            off: 0,
            width,
        }
    }
    /// Whether the section is the whole row (a dense buffer).
    pub fn is_dense(&self) -> bool {
        self.off == 0 && self.width == self.ld
    }
    /// Index of (row `r`, section column `c`).
    #[inline]
    pub fn at(&self, r: usize, c: usize) -> usize {
        r * self.ld + self.off + c
    }
    /// Error unless the section fits in its rows and a buffer of `len` values holds `rows`
    /// rows of `ld` values.
    pub fn check(&self, name: &str, len: usize, rows: usize) -> Result<()> {
        if !matches!(self.off.checked_add(self.width), Some(e) if e <= self.ld) {
            return Err(GdnError::Invalid(format!(
                "{name}: columns {}..{}+{} do not fit rows of {} values",
                self.off, self.off, self.width, self.ld
            )));
        }
        if Some(len) != rows.checked_mul(self.ld) {
            return Err(GdnError::Invalid(format!(
                "{name}: expected {rows} rows x {} values, got {len} values",
                self.ld
            )));
        }
        Ok(())
    }
}

/// An fp32 buffer (statistics, decays, states, parameter gradients).
pub enum F32s {
    Host(Vec<f32>),
    Dev(GBuf<f32>),
}

/// A borrowed fp32 parameter.
#[derive(Clone, Copy)]
pub enum P<'a> {
    Host(&'a [f32]),
    Dev(&'a GBuf<f32>),
}

/// A mutably borrowed fp32 buffer (a parameter, an optimizer moment, a gradient accumulated in
/// place).
pub enum PMut<'a> {
    Host(&'a mut [f32]),
    Dev(&'a mut GBuf<f32>),
}

/// Borrowed integer ids (token ids `u32`, targets `i32`) on the host or a GPU.
pub enum Ids<'a, T: cudarc::driver::DeviceRepr> {
    Host(&'a [T]),
    Dev(&'a GBuf<T>),
}

impl<T: cudarc::driver::DeviceRepr> Clone for Ids<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: cudarc::driver::DeviceRepr> Copy for Ids<'_, T> {}

impl<T: cudarc::driver::DeviceRepr> Ids<'_, T> {
    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            Ids::Host(h) => h.len(),
            Ids::Dev(d) => d.len(),
        }
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Act::Host(v) => write!(f, "Act::Host({} values)", v.len()),
            Act::Dev(d) => write!(f, "Act::Dev({} {:?} values)", d.len(), d.dtype()),
        }
    }
}

impl std::fmt::Debug for F32s {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            F32s::Host(v) => write!(f, "F32s::Host({} values)", v.len()),
            F32s::Dev(d) => write!(f, "F32s::Dev({} values)", d.len()),
        }
    }
}

impl Act {
    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        match self {
            Act::Host(v) => 4 * v.len(),
            Act::Dev(d) => d.bytes(),
        }
    }
    /// The values as host f32 (downloads from a device).
    pub fn into_host(self) -> Result<Vec<f32>> {
        match self {
            Act::Host(v) => Ok(v),
            Act::Dev(d) => d.download(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Act::Host(v) => v.len(),
            Act::Dev(d) => d.len(),
        }
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl F32s {
    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        match self {
            F32s::Host(v) => 4 * v.len(),
            F32s::Dev(d) => d.bytes(),
        }
    }
    /// The values as host f32 (downloads from a device).
    pub fn into_host(self) -> Result<Vec<f32>> {
        match self {
            F32s::Host(v) => Ok(v),
            F32s::Dev(d) => d.gpu().download(&d),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            F32s::Host(v) => v.len(),
            F32s::Dev(d) => d.len(),
        }
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The error of a host/device mix in one op call.
pub(crate) fn mixed(op: &str) -> GdnError {
    GdnError::Device(format!(
        "{op}: host and device buffers mixed (internal error)"
    ))
}

/// The host side of an optional parameter (error if it lives on a device).
pub(crate) fn host<'a>(p: Option<P<'a>>, op: &str) -> Result<Option<&'a [f32]>> {
    match p {
        None => Ok(None),
        Some(P::Host(h)) => Ok(Some(h)),
        Some(P::Dev(_)) => Err(mixed(op)),
    }
}

pub(crate) fn dev<'a>(p: Option<P<'a>>, op: &str) -> Result<Option<&'a GBuf<f32>>> {
    match p {
        None => Ok(None),
        Some(P::Dev(d)) => Ok(Some(d)),
        Some(P::Host(_)) => Err(mixed(op)),
    }
}

/// The host side of an optional fp32 buffer (error if it lives on a device).
pub(crate) fn host_f32(x: Option<&F32s>) -> Result<Option<&[f32]>> {
    match x {
        None => Ok(None),
        Some(F32s::Host(h)) => Ok(Some(h.as_slice())),
        Some(_) => Err(mixed("rule")),
    }
}

pub(crate) fn dev_f32(x: Option<&F32s>) -> Result<Option<&GBuf<f32>>> {
    match x {
        None => Ok(None),
        Some(F32s::Dev(h)) => Ok(Some(h)),
        Some(_) => Err(mixed("rule")),
    }
}
