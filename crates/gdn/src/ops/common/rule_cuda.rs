//! CUDA pieces shared by the two rules (`ops::gated_delta_rule`, `ops::gdn2_rule`): backward's
//! extra input checks, zeroing of padding rows and the tests' output poisoning.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, DeviceRepr};

use super::rule::RuleShape;
use crate::backend::cuda::{DBuf, DType, GBuf, Gpu};
use crate::error::{GdnError, Result};
use crate::seqs::Seqs;

/// Backward's extra inputs: `d_o` `[tokens, Hv, Dv]` in the inputs' storage type and the
/// optional gradient of the final states `[N, Hv, Dk, Dv]`, all on `gpu` (shared by both rules).
pub(crate) fn check_backward_grads(
    what: &str,
    gpu: &Arc<Gpu>,
    dt: DType,
    seqs: &Seqs,
    s: RuleShape,
    d_o: &DBuf,
    d_final_state: Option<&GBuf<f32>>,
) -> Result<()> {
    let (tokens, n_seq) = (seqs.tokens(), seqs.count());
    if d_o.dtype() != dt {
        return Err(GdnError::Invalid(format!(
            "{what} (CUDA): d_o is {:?} but q is {dt:?}",
            d_o.dtype()
        )));
    }
    if d_o.len() != tokens * s.hv * s.dv {
        return Err(GdnError::Invalid(format!(
            "d_o: expected {} values, got {}",
            tokens * s.hv * s.dv,
            d_o.len()
        )));
    }
    if let Some(d) = d_final_state {
        let want = n_seq * s.hv * s.dk * s.dv;
        if d.len() != want {
            return Err(GdnError::Invalid(format!(
                "d_final_state: expected {want} values, got {}",
                d.len()
            )));
        }
    }
    if !Arc::ptr_eq(d_o.gpu(), gpu) || d_final_state.is_some_and(|d| !Arc::ptr_eq(d.gpu(), gpu)) {
        return Err(GdnError::Invalid(format!(
            "{what} (CUDA): every input must live on the GPU the op runs on"
        )));
    }
    Ok(())
}

/// Zero rows `[used, tokens)` of a `[tokens, width]` buffer.
pub(crate) fn zero_tail(
    what: &str,
    gpu: &Arc<Gpu>,
    b: &mut DBuf,
    used: usize,
    tokens: usize,
    width: usize,
) -> Result<()> {
    if used == tokens {
        return Ok(());
    }
    let st = gpu.stream();
    let r = used * width..tokens * width;
    match b {
        DBuf::F32(x) => st.memset_zeros(&mut x.slice.slice_mut(r)),
        DBuf::Bf16(x) => st.memset_zeros(&mut x.slice.slice_mut(r)),
    }
    .map_err(|e| GdnError::Device(format!("{what}: zeroing padding rows: {e:?}")))
}

/// Tests only: when `on`, fill `b` with NaN (all bits set) so that an element a kernel fails to
/// write shows up. Each rule keeps its own switch (`set_poison`).
pub(crate) fn poison_if<T: DeviceRepr>(on: bool, b: &GBuf<T>, what: &str) -> Result<()> {
    if !on || b.is_empty() {
        return Ok(());
    }
    let st = b.gpu().stream();
    let (p, _sync) = b.slice.device_ptr(st);
    // SAFETY: writes exactly the buffer's bytes, on the stream that orders all its uses.
    unsafe { cudarc::driver::result::memset_d8_async(p, 0xff, b.bytes(), st.cu_stream()) }
        .map_err(|e| GdnError::Device(format!("{what}: poisoning a buffer: {e:?}")))
}
