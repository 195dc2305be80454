//! `gdn._gdn`: the engine's rule and layer on NumPy arrays (CPU) and DLPack capsules (CUDA).
//!
//! - CPU: float32 C-contiguous NumPy arrays (PyTorch CPU tensors reach here as `.numpy()` views).
//!   The rule reads them in place; results are NumPy arrays that own gdn's buffers (no copy).
//!   The layer copies `x` once into the `Saved` it keeps (as its host API does).
//! - CUDA: DLPack capsules (`tensor.__dlpack__()`), f32 or bf16, C-contiguous. The rule reads
//!   them in place (`GBuf::from_raw`); results are capsules owning gdn's buffers (no copy). The
//!   layer copies `x` and `dy` once on the device (its `Saved` owns its input; backward consumes
//!   `dy`). Work is queued on gdn's stream, the CUDA legacy default stream of the primary context:
//!   the caller must be on that stream too (`gdn.torch` checks `torch.cuda.current_stream()`), so
//!   no event is needed between the two.
//!
//! Errors are Python exceptions (`ValueError` for arguments, `RuntimeError` for device failures).

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use gdn::backend::{Act, F32s};
use gdn::device::cuda::{self, DBuf, DType, GBuf};
use gdn::ops::gated_delta_rule::{self as rule, RuleOpts, RuleShape};
use gdn::{Device, GatedDeltaNet, GdnConfig, GdnError, Params, Seqs, Tensor};
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

fn err(e: GdnError) -> PyErr {
    match e {
        GdnError::Device(_) | GdnError::Io { .. } => PyRuntimeError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn verr(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

// ---- DLPack (v0.8 `dltensor` capsules) ----

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_FLOAT: u8 = 2;
const KDL_BFLOAT: u8 = 4;
const DLTENSOR: &CStr = c"dltensor";

/// A device buffer handed out through DLPack.
enum Owned {
    Act(DBuf),
    F32(GBuf<f32>),
}

struct Holder {
    _buf: Owned,
    shape: Vec<i64>,
    mt: DLManagedTensor,
}

unsafe extern "C" fn holder_deleter(mt: *mut DLManagedTensor) {
    if mt.is_null() {
        return;
    }
    // SAFETY: manager_ctx is the Box<Holder> made in `export`, deleted once (DLPack's contract).
    drop(unsafe { Box::from_raw((*mt).manager_ctx as *mut Holder) });
}

unsafe extern "C" fn capsule_destructor(cap: *mut pyo3::ffi::PyObject) {
    // An unconsumed capsule (still named "dltensor") owns its tensor.
    // SAFETY: called by Python with the capsule; a consumer renames it to "used_dltensor".
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(cap, DLTENSOR.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(cap, DLTENSOR.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*p).deleter {
                d(p);
            }
        }
    }
}

/// A gdn device buffer as a DLPack capsule (ownership moves to the capsule / its consumer).
fn export(py: Python<'_>, buf: Owned, shape: &[usize]) -> PyResult<PyObject> {
    let (ptr, dtype, dev) = match &buf {
        Owned::Act(DBuf::F32(b)) => (b.device_ptr(), (KDL_FLOAT, 32), b.gpu().ordinal()),
        Owned::Act(DBuf::Bf16(b)) => (b.device_ptr(), (KDL_BFLOAT, 16), b.gpu().ordinal()),
        Owned::F32(b) => (b.device_ptr(), (KDL_FLOAT, 32), b.gpu().ordinal()),
    };
    let mut h = Box::new(Holder {
        _buf: buf,
        shape: shape.iter().map(|&s| s as i64).collect(),
        mt: DLManagedTensor {
            dl_tensor: DLTensor {
                data: ptr as *mut c_void,
                device: DLDevice {
                    device_type: KDL_CUDA,
                    device_id: dev as i32,
                },
                ndim: shape.len() as i32,
                dtype: DLDataType {
                    code: dtype.0,
                    bits: dtype.1,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(holder_deleter),
        },
    });
    h.mt.dl_tensor.shape = h.shape.as_mut_ptr();
    let raw = Box::into_raw(h);
    // SAFETY: `raw` is a live Box; the capsule's pointer is its DLManagedTensor.
    unsafe {
        (*raw).mt.manager_ctx = raw as *mut c_void;
        let mt = std::ptr::addr_of_mut!((*raw).mt);
        let cap = pyo3::ffi::PyCapsule_New(
            mt as *mut c_void,
            DLTENSOR.as_ptr(),
            Some(capsule_destructor),
        );
        if cap.is_null() {
            holder_deleter(mt);
            return Err(PyErr::fetch(py));
        }
        Ok(PyObject::from_owned_ptr(py, cap))
    }
}

/// A CUDA tensor seen through a DLPack capsule (borrowed for the call).
struct DevView {
    ptr: u64,
    len: usize,
    shape: Vec<usize>,
    dtype: DType,
    ordinal: usize,
}

fn dev_view(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<DevView> {
    let cap = obj.downcast::<PyCapsule>().map_err(|_| {
        verr(format!(
            "{name}: expected a DLPack capsule (tensor.__dlpack__())"
        ))
    })?;
    // SAFETY: a "dltensor" capsule holds a DLManagedTensor that lives while the capsule does
    // (the caller keeps it for the call).
    let t = unsafe {
        let p = pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), DLTENSOR.as_ptr())
            as *const DLManagedTensor;
        if p.is_null() {
            pyo3::ffi::PyErr_Clear();
            return Err(verr(format!(
                "{name}: not an unused DLPack \"dltensor\" capsule"
            )));
        }
        &(*p).dl_tensor
    };
    if t.device.device_type != KDL_CUDA {
        return Err(verr(format!(
            "{name}: a capsule of device type {} (gdn takes CUDA capsules; CPU tensors as NumPy arrays)",
            t.device.device_type
        )));
    }
    let dtype = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (KDL_FLOAT, 32, 1) => DType::F32,
        (KDL_BFLOAT, 16, 1) => DType::Bf16,
        (c, b, l) => {
            return Err(verr(format!(
                "{name}: dtype code {c} bits {b} lanes {l}; gdn takes float32 or bfloat16"
            )))
        }
    };
    let nd = t.ndim.max(0) as usize;
    // SAFETY: shape (and strides unless null) have ndim entries.
    let shape: Vec<i64> = unsafe { std::slice::from_raw_parts(t.shape, nd) }.to_vec();
    let shape: Vec<usize> = shape.iter().map(|&s| s.max(0) as usize).collect();
    if !t.strides.is_null() {
        let strides = unsafe { std::slice::from_raw_parts(t.strides, nd) };
        let mut want = 1i64;
        for i in (0..nd).rev() {
            if shape[i] != 1 && strides[i] != want {
                return Err(verr(format!(
                    "{name}: not contiguous (shape {shape:?}, strides {strides:?}); gdn does not copy \
                     silently: call .contiguous() first"
                )));
            }
            want *= shape[i] as i64;
        }
    }
    let el = if dtype == DType::F32 { 4 } else { 2 };
    DevView {
        ptr: t.data as u64 + t.byte_offset,
        len: shape.iter().product(),
        shape,
        dtype,
        ordinal: t.device.device_id.max(0) as usize,
    }
    .check_align(name, el)
}

impl DevView {
    fn check_align(self, name: &str, el: u64) -> PyResult<Self> {
        if !self.ptr.is_multiple_of(el) {
            return Err(verr(format!(
                "{name}: data pointer not aligned to its element size"
            )));
        }
        Ok(self)
    }
}

/// The device buffers wrapping borrowed CUDA tensors; given back (never freed) on drop, also on
/// an error or a panic.
struct Borrowed {
    acts: Vec<Option<Act>>,
    f32s: Vec<Option<F32s>>,
}

impl Borrowed {
    fn new() -> Self {
        Borrowed {
            acts: vec![],
            f32s: vec![],
        }
    }
    fn act(&mut self, gpu: &Arc<cuda::Gpu>, v: &DevView) -> usize {
        // SAFETY: the capsule (held by the caller for the call) keeps the memory alive; the
        // caller's stream is gdn's stream (checked by gdn.torch).
        let a = match v.dtype {
            DType::F32 => DBuf::F32(unsafe { GBuf::from_raw(gpu, v.ptr, v.len) }),
            DType::Bf16 => DBuf::Bf16(unsafe { GBuf::from_raw(gpu, v.ptr, v.len) }),
        };
        self.acts.push(Some(Act::Dev(a)));
        self.acts.len() - 1
    }
    fn f32s(&mut self, gpu: &Arc<cuda::Gpu>, name: &str, v: &DevView) -> PyResult<usize> {
        if v.dtype != DType::F32 {
            return Err(verr(format!("{name}: must be float32")));
        }
        // SAFETY: as in `act`.
        self.f32s.push(Some(F32s::Dev(unsafe {
            GBuf::from_raw(gpu, v.ptr, v.len)
        })));
        Ok(self.f32s.len() - 1)
    }
    fn a(&self, i: usize) -> &Act {
        self.acts[i].as_ref().expect("present until drop")
    }
    fn f(&self, i: usize) -> &F32s {
        self.f32s[i].as_ref().expect("present until drop")
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        for a in self.acts.drain(..).flatten() {
            match a {
                Act::Dev(DBuf::F32(b)) => {
                    b.into_raw();
                }
                Act::Dev(DBuf::Bf16(b)) => {
                    b.into_raw();
                }
                Act::Host(_) => {}
            }
        }
        for f in self.f32s.drain(..).flatten() {
            if let F32s::Dev(b) = f {
                b.into_raw();
            }
        }
    }
}

// ---- NumPy ----

fn is_capsule(obj: &Bound<'_, PyAny>) -> bool {
    obj.downcast::<PyCapsule>().is_ok()
}

/// A float32 C-contiguous NumPy array, read in place.
fn np_f32<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let arr = obj.downcast::<PyArrayDyn<f32>>().map_err(|_| {
        verr(format!(
            "{name}: expected a float32 NumPy array (or a CUDA DLPack capsule); gdn does not \
             convert dtypes silently"
        ))
    })?;
    if !arr.is_c_contiguous() {
        return Err(verr(format!(
            "{name}: not C-contiguous; gdn does not copy silently: use np.ascontiguousarray"
        )));
    }
    Ok(arr.clone())
}

fn to_np<'py>(py: Python<'py>, v: Vec<f32>, shape: &[usize]) -> PyResult<PyObject> {
    let a = numpy::PyArray1::from_vec(py, v);
    Ok(a.reshape(shape.to_vec())?.into_any().unbind())
}

fn seqs_of(cu: Option<Vec<u64>>, batch: usize, len: usize) -> PyResult<Seqs> {
    match cu {
        Some(cu) => Seqs::packed(&cu, batch * len).map_err(err),
        None => Ok(Seqs::uniform(batch, len)),
    }
}

/// Heads and dims of the rule from the shapes of q `[.., Hk, Dk]` and v `[.., Hv, Dv]`.
fn rule_shape(qs: &[usize], vs: &[usize]) -> PyResult<(RuleShape, usize)> {
    if qs.len() < 2 || vs.len() < 2 {
        return Err(verr("q and v need at least 2 dimensions ([.., H, D])"));
    }
    let s = RuleShape {
        hk: qs[qs.len() - 2],
        hv: vs[vs.len() - 2],
        dk: qs[qs.len() - 1],
        dv: vs[vs.len() - 1],
    };
    let tokens: usize = qs[..qs.len() - 2].iter().product();
    Ok((s, tokens))
}

// ---- the rule ----

/// What the rule's forward kept for its backward (`rule_forward(..., keep_saved=True)`): on a
/// GPU the chunk inverses T its chunk prep solved for (`bytes` of them; 0 on the CPU, whose
/// backward solves again). Opaque; pass it to `rule_backward(..., saved=...)` with the same
/// inputs: the same gradients bit for bit, with less recomputed.
#[pyclass(module = "gdn._gdn", name = "RuleSaved")]
struct RuleSavedPy {
    inner: rule::RuleSaved,
}

#[pymethods]
impl RuleSavedPy {
    /// Bytes held on the GPU.
    #[getter]
    fn bytes(&self) -> usize {
        self.inner.bytes()
    }
    fn __repr__(&self) -> String {
        format!("gdn.RuleSaved(bytes={})", self.inner.bytes())
    }
}

/// Gated delta rule forward. q, k `[..., Hk, Dk]`, v `[..., Hv, Dv]`, g (log decay), beta
/// `[..., Hv]` over `tokens` rows (the leading dims' product) as `seqs` describes: uniform
/// `batch` x `len` or packed by `cu_seqlens`. Returns (o like v, final states `[N, Hv, Dk, Dv]`
/// or None), and with `keep_saved` a third item, the [`RuleSavedPy`] for `rule_backward`.
#[pyfunction]
#[pyo3(signature = (q, k, v, g, beta, batch, seq_len, scale, cu_seqlens=None, initial_state=None, output_final_state=false, l2norm_in_kernel=false, keep_saved=false))]
#[allow(clippy::too_many_arguments)]
fn rule_forward(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    batch: usize,
    seq_len: usize,
    scale: f32,
    cu_seqlens: Option<Vec<u64>>,
    initial_state: Option<&Bound<'_, PyAny>>,
    output_final_state: bool,
    l2norm_in_kernel: bool,
    keep_saved: bool,
) -> PyResult<PyObject> {
    let seqs = seqs_of(cu_seqlens, batch, seq_len)?;
    // (o, final state) or, with keep_saved, (o, final state, saved)
    let out = |py: Python<'_>, o: PyObject, fin: Option<PyObject>, saved: rule::RuleSaved| {
        if keep_saved {
            let saved = Py::new(py, RuleSavedPy { inner: saved })?;
            Ok::<PyObject, PyErr>((o, fin, saved).into_pyobject(py)?.into_any().unbind())
        } else {
            Ok((o, fin).into_pyobject(py)?.into_any().unbind())
        }
    };
    let opts = RuleOpts {
        scale,
        l2norm_in_kernel,
    };
    if is_capsule(q) {
        let views = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
            .iter()
            .map(|(n, o)| dev_view(n, o))
            .collect::<PyResult<Vec<_>>>()?;
        let (s, _) = rule_shape(&views[0].shape, &views[2].shape)?;
        let gpu = same_gpu(&views)?;
        let mut b = Borrowed::new();
        let (iq, ik, iv, ib) = (
            b.act(&gpu, &views[0]),
            b.act(&gpu, &views[1]),
            b.act(&gpu, &views[2]),
            b.act(&gpu, &views[4]),
        );
        let ig = b.f32s(&gpu, "g", &views[3])?;
        let ih = match initial_state {
            Some(h) => {
                let hv = dev_view("initial_state", h)?;
                check_same(&gpu, "initial_state", &hv)?;
                Some(b.f32s(&gpu, "initial_state", &hv)?)
            }
            None => None,
        };
        let (q, k, v, g, bt, h0) = (
            b.a(iq),
            b.a(ik),
            b.a(iv),
            b.f(ig),
            b.a(ib),
            ih.map(|i| b.f(i)),
        );
        let fin_too = output_final_state;
        let (o, fin, saved) = if keep_saved {
            rule::forward_saving(q, k, v, g, bt, &seqs, s, opts, h0, fin_too)
        } else {
            rule::forward(q, k, v, g, bt, &seqs, s, opts, h0, fin_too)
                .map(|(o, fin)| (o, fin, rule::RuleSaved::default()))
        }
        .map_err(err)?;
        drop(b);
        let Act::Dev(o) = o else {
            unreachable!("device inputs give device outputs")
        };
        let o = export(py, Owned::Act(o), &views[2].shape)?;
        let fin = match fin {
            Some(F32s::Dev(f)) => Some(export(
                py,
                Owned::F32(f),
                &[seqs.count(), s.hv, s.dk, s.dv],
            )?),
            _ => None,
        };
        return out(py, o, fin, saved);
    }
    let (q, k, v, g, beta) = (
        np_f32("q", q)?,
        np_f32("k", k)?,
        np_f32("v", v)?,
        np_f32("g", g)?,
        np_f32("beta", beta)?,
    );
    let (s, _) = rule_shape(q.shape(), v.shape())?;
    let h0 = initial_state
        .map(|h| np_f32("initial_state", h))
        .transpose()?;
    let (qr, kr, vr, gr, br) = (
        q.readonly(),
        k.readonly(),
        v.readonly(),
        g.readonly(),
        beta.readonly(),
    );
    let h0r = h0.as_ref().map(|h| h.readonly());
    let (o, fin) = rule::cpu::forward(
        qr.as_slice()?,
        kr.as_slice()?,
        vr.as_slice()?,
        gr.as_slice()?,
        br.as_slice()?,
        &seqs,
        s,
        opts,
        h0r.as_ref().map(|h| h.as_slice()).transpose()?,
        output_final_state,
    )
    .map_err(err)?;
    let o = to_np(py, o, v.shape())?;
    let fin = fin
        .map(|f| to_np(py, f, &[seqs.count(), s.hv, s.dk, s.dv]))
        .transpose()?;
    out(py, o, fin, rule::RuleSaved::default())
}

fn same_gpu(views: &[DevView]) -> PyResult<Arc<cuda::Gpu>> {
    let o = views[0].ordinal;
    if let Some(v) = views.iter().find(|v| v.ordinal != o) {
        return Err(verr(format!(
            "tensors on different GPUs (cuda:{o} and cuda:{}); gdn does not move them",
            v.ordinal
        )));
    }
    let d = views[0].dtype;
    for (i, v) in views.iter().enumerate() {
        // g (index 3) is float32 whatever the activations' dtype
        if i != 3 && v.dtype != d {
            return Err(verr("q, k, v and beta must have one dtype"));
        }
    }
    cuda::gpu(o).map_err(err)
}

fn check_same(gpu: &Arc<cuda::Gpu>, name: &str, v: &DevView) -> PyResult<()> {
    if v.ordinal != gpu.ordinal() {
        return Err(verr(format!(
            "{name} is on cuda:{}, the other tensors on cuda:{}",
            v.ordinal,
            gpu.ordinal()
        )));
    }
    Ok(())
}

/// Gated delta rule backward: the forward's inputs, `d_o` like v and optionally the gradient
/// of the final states; `saved`: what `rule_forward(..., keep_saved=True)` kept on these same
/// inputs (the same gradients, less recomputed). Returns (dq, dk, dv, dg, dbeta, dh0 or None).
#[pyfunction]
#[pyo3(signature = (q, k, v, g, beta, d_o, batch, seq_len, scale, cu_seqlens=None, initial_state=None, d_final_state=None, l2norm_in_kernel=false, saved=None))]
#[allow(clippy::too_many_arguments)]
fn rule_backward(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    d_o: &Bound<'_, PyAny>,
    batch: usize,
    seq_len: usize,
    scale: f32,
    cu_seqlens: Option<Vec<u64>>,
    initial_state: Option<&Bound<'_, PyAny>>,
    d_final_state: Option<&Bound<'_, PyAny>>,
    l2norm_in_kernel: bool,
    saved: Option<PyRef<'_, RuleSavedPy>>,
) -> PyResult<Vec<Option<PyObject>>> {
    let seqs = seqs_of(cu_seqlens, batch, seq_len)?;
    let opts = RuleOpts {
        scale,
        l2norm_in_kernel,
    };
    if is_capsule(q) {
        let views = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
            .iter()
            .map(|(n, o)| dev_view(n, o))
            .collect::<PyResult<Vec<_>>>()?;
        let (s, _) = rule_shape(&views[0].shape, &views[2].shape)?;
        let gpu = same_gpu(&views)?;
        let dov = dev_view("d_o", d_o)?;
        check_same(&gpu, "d_o", &dov)?;
        if dov.dtype != views[0].dtype {
            return Err(verr("d_o must have q's dtype"));
        }
        let mut b = Borrowed::new();
        let (iq, ik, iv, ib, io) = (
            b.act(&gpu, &views[0]),
            b.act(&gpu, &views[1]),
            b.act(&gpu, &views[2]),
            b.act(&gpu, &views[4]),
            b.act(&gpu, &dov),
        );
        let ig = b.f32s(&gpu, "g", &views[3])?;
        let mut opt = |name: &str, o: Option<&Bound<'_, PyAny>>| -> PyResult<Option<usize>> {
            match o {
                Some(h) => {
                    let hv = dev_view(name, h)?;
                    check_same(&gpu, name, &hv)?;
                    Ok(Some(b.f32s(&gpu, name, &hv)?))
                }
                None => Ok(None),
            }
        };
        let ih = opt("initial_state", initial_state)?;
        let idf = opt("d_final_state", d_final_state)?;
        // (an empty RuleSaved: the backward solves again, as rule::backward)
        let none = rule::RuleSaved::default();
        let r = rule::backward_saved(
            b.a(iq),
            b.a(ik),
            b.a(iv),
            b.f(ig),
            b.a(ib),
            &seqs,
            s,
            opts,
            ih.map(|i| b.f(i)),
            b.a(io),
            idf.map(|i| b.f(i)),
            saved.as_ref().map_or(&none, |sv| &sv.inner),
        )
        .map_err(err)?;
        drop(b);
        let act = |a: Act| match a {
            Act::Dev(d) => Owned::Act(d),
            Act::Host(_) => unreachable!("device inputs give device outputs"),
        };
        let f = |a: F32s| match a {
            F32s::Dev(d) => Owned::F32(d),
            F32s::Host(_) => unreachable!("device inputs give device outputs"),
        };
        let st = [seqs.count(), s.hv, s.dk, s.dv];
        return Ok(vec![
            Some(export(py, act(r.dq), &views[0].shape)?),
            Some(export(py, act(r.dk), &views[1].shape)?),
            Some(export(py, act(r.dv), &views[2].shape)?),
            Some(export(py, f(r.dg), &views[3].shape)?),
            Some(export(py, act(r.dbeta), &views[4].shape)?),
            r.dh0.map(|d| export(py, f(d), &st)).transpose()?,
        ]);
    }
    if saved.as_ref().is_some_and(|sv| sv.inner.bytes() > 0) {
        return Err(verr(
            "saved holds GPU memory (from a CUDA forward) but the inputs are on the CPU",
        ));
    }
    let arrs = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("g", g),
        ("beta", beta),
        ("d_o", d_o),
    ]
    .iter()
    .map(|(n, o)| np_f32(n, o))
    .collect::<PyResult<Vec<_>>>()?;
    let (s, _) = rule_shape(arrs[0].shape(), arrs[2].shape())?;
    let ro: Vec<_> = arrs.iter().map(|a| a.readonly()).collect();
    let sl = ro
        .iter()
        .map(|r| r.as_slice())
        .collect::<Result<Vec<_>, _>>()?;
    let h0 = initial_state
        .map(|h| np_f32("initial_state", h))
        .transpose()?;
    let dfin = d_final_state
        .map(|h| np_f32("d_final_state", h))
        .transpose()?;
    let h0r = h0.as_ref().map(|h| h.readonly());
    let dfr = dfin.as_ref().map(|h| h.readonly());
    let r = rule::cpu::backward(
        sl[0],
        sl[1],
        sl[2],
        sl[3],
        sl[4],
        &seqs,
        s,
        opts,
        h0r.as_ref().map(|h| h.as_slice()).transpose()?,
        sl[5],
        dfr.as_ref().map(|h| h.as_slice()).transpose()?,
    )
    .map_err(err)?;
    let st = [seqs.count(), s.hv, s.dk, s.dv];
    Ok(vec![
        Some(to_np(py, r.dq, arrs[0].shape())?),
        Some(to_np(py, r.dk, arrs[1].shape())?),
        Some(to_np(py, r.dv, arrs[2].shape())?),
        Some(to_np(py, r.dg, arrs[3].shape())?),
        Some(to_np(py, r.dbeta, arrs[4].shape())?),
        r.dh0.map(|d| to_np(py, d, &st)).transpose()?,
    ])
}

// ---- the layer ----

/// What a layer's forward keeps for its backward (gdn's `Saved`, opaque). `bytes` is its
/// activation memory, exactly.
#[pyclass(module = "gdn._gdn", weakref)]
struct Saved {
    inner: Option<gdn::Saved>,
    bytes: usize,
    x_shape: Vec<usize>,
}

#[pymethods]
impl Saved {
    /// Bytes held (gdn's `Saved::bytes()`), 0 once a backward consumed it.
    #[getter]
    fn bytes(&self) -> usize {
        if self.inner.is_some() {
            self.bytes
        } else {
            0
        }
    }
    /// Whether a backward already consumed it.
    #[getter]
    fn consumed(&self) -> bool {
        self.inner.is_none()
    }
    fn __repr__(&self) -> String {
        format!("gdn.Saved(bytes={})", self.bytes())
    }
}

/// A GDN / GDN2 layer (Megatron's parameters and config), on the CPU or a CUDA GPU.
#[pyclass(module = "gdn._gdn")]
struct Layer {
    inner: GatedDeltaNet,
    gpu: bool,
}

fn parse_device(device: &str, dtype: &str) -> PyResult<(Device, DType)> {
    let d: Device = device.parse().map_err(err)?;
    let t = match dtype {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::Bf16,
        o => return Err(verr(format!("unknown dtype {o:?}: expected f32 or bf16"))),
    };
    Ok((d, t))
}

fn params_from_dict(cfg: &GdnConfig, d: &Bound<'_, PyDict>) -> PyResult<Params> {
    let mut entries = Vec::new();
    for (name, shape) in gdn::layer::param_specs(cfg) {
        let Some(a) = d.get_item(name)? else {
            return Err(verr(format!("missing parameter {name} {shape:?}")));
        };
        let a = np_f32(name, &a)?;
        let r = a.readonly();
        let t = Tensor::from_vec(a.shape(), r.as_slice()?.to_vec()).map_err(err)?;
        entries.push((name.to_string(), t));
    }
    for k in d.keys() {
        let k: String = k.extract()?;
        if !entries.iter().any(|(n, _)| *n == k) {
            return Err(verr(format!("unexpected parameter {k}")));
        }
    }
    let p = Params::from_entries(entries);
    p.check_against(cfg, "parameters").map_err(err)?;
    Ok(p)
}

#[pymethods]
impl Layer {
    /// `config`: the layer config as TOML (Megatron's field names). `params`: a dict name ->
    /// float32 array (Megatron's names), else Megatron's init from `seed`. `device`: cpu, cuda,
    /// cuda:N; `dtype`: f32 or bf16 (activations on a GPU; the CPU computes in f32).
    #[new]
    #[pyo3(signature = (config, params=None, seed=0, device="cpu", dtype="f32"))]
    fn new(
        config: &str,
        params: Option<&Bound<'_, PyDict>>,
        seed: u64,
        device: &str,
        dtype: &str,
    ) -> PyResult<Self> {
        let cfg = GdnConfig::from_toml_str(config).map_err(err)?;
        let (dev, dt) = parse_device(device, dtype)?;
        let l = match params {
            Some(p) => GatedDeltaNet::with_params(&cfg, params_from_dict(&cfg, p)?),
            None => GatedDeltaNet::new(&cfg, seed),
        }
        .map_err(err)?;
        let inner = l.to_device(dev, dt).map_err(err)?;
        Ok(Layer {
            inner,
            gpu: dev != Device::Cpu,
        })
    }

    /// The config as TOML.
    #[getter]
    fn config(&self) -> String {
        self.inner.config().to_toml_string()
    }

    /// The parameters: a dict name -> float32 NumPy array (a host copy).
    fn params(&self, py: Python<'_>) -> PyResult<PyObject> {
        let d = PyDict::new(py);
        for (n, t) in self.inner.params().iter() {
            d.set_item(n, to_np(py, t.data().to_vec(), t.shape())?)?;
        }
        Ok(d.into_any().unbind())
    }

    /// Replace the parameters (same names and shapes).
    fn set_params(&mut self, params: &Bound<'_, PyDict>) -> PyResult<()> {
        let p = params_from_dict(self.inner.config(), params)?;
        *self.inner.params_mut() = p;
        Ok(())
    }

    /// Forward over `x` `[B, T, hidden]` (or packed `[1, T, hidden]` / `[T, hidden]` with
    /// `cu_seqlens`). Returns (y like x, Saved).
    #[pyo3(signature = (x, cu_seqlens=None))]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        cu_seqlens: Option<Vec<u64>>,
    ) -> PyResult<(PyObject, Saved)> {
        let h = self.inner.config().hidden_size;
        if is_capsule(x) {
            if !self.gpu {
                return Err(verr("x is a CUDA tensor but the layer runs on the CPU"));
            }
            let xv = dev_view("x", x)?;
            let gpu = self.layer_gpu()?;
            check_same(&gpu, "x", &xv)?;
            let seqs = self.seqs(&xv.shape, cu_seqlens)?;
            // Saved owns its input: one device copy of x (gdn's stream), the caller's kept.
            let xc = {
                let mut b = Borrowed::new();
                let i = b.act(&gpu, &xv);
                let Act::Dev(d) = b.a(i) else { unreachable!() };
                d.try_clone().map_err(err)?
            };
            let (y, saved) = self.inner.forward_dev(xc, &seqs).map_err(err)?;
            let bytes = saved.bytes();
            let _ = h;
            let y = export(py, Owned::Act(y), &xv.shape)?;
            return Ok((
                y,
                Saved {
                    inner: Some(saved),
                    bytes,
                    x_shape: xv.shape,
                },
            ));
        }
        if self.gpu {
            return Err(verr("x is a host array but the layer runs on a GPU"));
        }
        let xa = np_f32("x", x)?;
        let shape = xa.shape().to_vec();
        let seqs = self.seqs(&shape, cu_seqlens)?;
        let t = Tensor::from_vec(&shape, xa.readonly().as_slice()?.to_vec()).map_err(err)?;
        let (y, saved) = self.inner.forward_packed(&t, &seqs).map_err(err)?;
        let bytes = saved.bytes();
        Ok((
            to_np(py, y.into_vec(), &shape)?,
            Saved {
                inner: Some(saved),
                bytes,
                x_shape: shape,
            },
        ))
    }

    /// Backward from `dy` (like y), consuming `saved`. Returns (dx, dict name -> gradient).
    fn backward(
        &self,
        py: Python<'_>,
        saved: &mut Saved,
        dy: &Bound<'_, PyAny>,
    ) -> PyResult<(PyObject, PyObject)> {
        let s = saved
            .inner
            .take()
            .ok_or_else(|| verr("this Saved was consumed by a backward already"))?;
        let grads = PyDict::new(py);
        if is_capsule(dy) {
            if !self.gpu {
                saved.inner = Some(s);
                return Err(verr("dy is a CUDA tensor but the layer runs on the CPU"));
            }
            let dv = dev_view("dy", dy)?;
            let gpu = self.layer_gpu()?;
            check_same(&gpu, "dy", &dv)?;
            if dv.shape != saved.x_shape {
                let e = verr(format!(
                    "dy has shape {:?}, y has {:?}",
                    dv.shape, saved.x_shape
                ));
                saved.inner = Some(s);
                return Err(e);
            }
            let dyc = {
                let mut b = Borrowed::new();
                let i = b.act(&gpu, &dv);
                let Act::Dev(d) = b.a(i) else { unreachable!() };
                d.try_clone().map_err(err)?
            };
            let (dx, g) = self.inner.backward_dev(s, dyc).map_err(err)?;
            let dx = export(py, Owned::Act(dx), &dv.shape)?;
            for (n, shape, b) in g.into_buffers() {
                grads.set_item(n, export(py, Owned::F32(b), &shape)?)?;
            }
            return Ok((dx, grads.into_any().unbind()));
        }
        if self.gpu {
            saved.inner = Some(s);
            return Err(verr("dy is a host array but the layer runs on a GPU"));
        }
        let da = np_f32("dy", dy)?;
        let t = Tensor::from_vec(da.shape(), da.readonly().as_slice()?.to_vec()).map_err(err)?;
        let (dx, g) = self.inner.backward(s, &t).map_err(err)?;
        for (n, t) in g.iter() {
            grads.set_item(n, to_np(py, t.data().to_vec(), t.shape())?)?;
        }
        let shape = dx.shape().to_vec();
        Ok((to_np(py, dx.into_vec(), &shape)?, grads.into_any().unbind()))
    }

    /// Bytes the parameters take where the layer runs.
    #[getter]
    fn param_bytes(&self) -> u128 {
        self.inner.param_bytes()
    }

    /// `cuda:N` or `cpu`.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }
}

impl Layer {
    fn layer_gpu(&self) -> PyResult<Arc<cuda::Gpu>> {
        match self.inner.device() {
            Device::Cuda(i) => cuda::gpu(i).map_err(err),
            Device::Cpu => Err(verr("the layer runs on the CPU")),
        }
    }
    fn seqs(&self, shape: &[usize], cu: Option<Vec<u64>>) -> PyResult<Seqs> {
        let h = self.inner.config().hidden_size;
        let (b, t) = match shape {
            &[b, t, hh] if hh == h => (b, t),
            &[t, hh] if hh == h => (1, t),
            s => {
                return Err(verr(format!(
                    "x has shape {s:?}, expected [B, T, {h}] or [T, {h}]"
                )))
            }
        };
        seqs_of(cu, b, t)
    }
}

// ---- weights ----

/// Layer `layer`'s weights from a checkpoint in `layout` (gdn, hf-qwen3-next, hf-qwen3.5,
/// megatron) as a dict name -> float32 array (our names), for `config` (TOML).
#[pyfunction]
#[pyo3(signature = (path, layout, config, layer=0))]
fn load_weights(
    py: Python<'_>,
    path: &str,
    layout: &str,
    config: &str,
    layer: usize,
) -> PyResult<PyObject> {
    let cfg = GdnConfig::from_toml_str(config).map_err(err)?;
    let l: gdn::convert::Layout = layout.parse().map_err(err)?;
    let w = gdn::convert::read_layer(std::path::Path::new(path), l, layer, &cfg).map_err(err)?;
    let d = PyDict::new(py);
    for (n, r) in &w.entries {
        d.set_item(n, to_np(py, r.to_f32(), &r.shape)?)?;
    }
    Ok(d.into_any().unbind())
}

/// `gdn convert` from Python: layer `layer` of `src` (layout `from_layout`) written to `out`
/// in `to_layout`, bitwise.
#[pyfunction]
#[pyo3(signature = (src, from_layout, to_layout, out, config, layer=0, force=false))]
fn convert(
    src: &str,
    from_layout: &str,
    to_layout: &str,
    out: &str,
    config: &str,
    layer: usize,
    force: bool,
) -> PyResult<()> {
    let cfg = GdnConfig::from_toml_str(config).map_err(err)?;
    let (f, t): (gdn::convert::Layout, gdn::convert::Layout) = (
        from_layout.parse().map_err(err)?,
        to_layout.parse().map_err(err)?,
    );
    gdn::convert::convert(
        std::path::Path::new(src),
        f,
        t,
        layer,
        &cfg,
        std::path::Path::new(out),
        force,
    )
    .map_err(err)
}

/// Bytes gdn's allocator holds on `cuda:N` now (0 if that GPU was never used).
#[pyfunction]
fn cuda_live_bytes(ordinal: usize) -> PyResult<usize> {
    Ok(cuda::gpu(ordinal).map_err(err)?.live_bytes())
}

#[pymodule]
fn _gdn(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rule_forward, m)?)?;
    m.add_function(wrap_pyfunction!(rule_backward, m)?)?;
    m.add_function(wrap_pyfunction!(load_weights, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_live_bytes, m)?)?;
    m.add_class::<Layer>()?;
    m.add_class::<Saved>()?;
    m.add_class::<RuleSavedPy>()?;
    m.add("KDL_CPU", KDL_CPU)?;
    Ok(())
}
