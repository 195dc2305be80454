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

/// CTA width (warps, each 16 state columns) of a fused scan + output kernel that keeps S^T in
/// registers (the GDN rule's `gdr_fwd6`, GDN2's `g2f_fwd8`): `forced` if it is one of 1, 2, 4,
/// 8 and `fits`, else the fitting width with the lowest modelled cost. Every CTA needs more than
/// half of an SM's shared memory (one CTA per SM), and each warp re-reads the chunk's four
/// 64-row operand fragments (two of Dk columns and one of Dk rows, bf16, and A's 10 lower 16x16
/// blocks) from shared memory, so the cost is waves x (shared-memory bytes per SM per chunk
/// step: the warps' fragment reads plus the stage, `stage_bytes(w)`). `chunk` is the chunk
/// length (64).
pub(crate) fn fused_scan_warps(
    sms: usize,
    n_seq: usize,
    s: RuleShape,
    chunk: usize,
    forced: usize,
    fits: impl Fn(usize) -> bool,
    stage_bytes: impl Fn(usize) -> usize,
) -> usize {
    if [1, 2, 4, 8].contains(&forced) && fits(forced) {
        return forced;
    }
    let per_warp = 3 * chunk * s.dk * 2 + chunk * chunk * 2 * 10 / 16;
    let mut best = (usize::MAX, 1);
    for w in [2, 4, 1, 8] {
        if !fits(w) {
            continue;
        }
        let ctas = n_seq * s.hv * (s.dv / (16 * w));
        let cost = ctas.div_ceil(sms.max(1)) * (w * per_warp + stage_bytes(w));
        if cost < best.0 {
            best = (cost, w);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The widths the two fused scans ran at on the H200 (132 SMs) in the benchmarks of
    /// 2026-12-02 (kernel names in bench/NOTES.md: gdr_fwd6ls3_d128_w2 at B1 T32768 16/32,
    /// gdr_fwd6l_d128_w4 for the packed 6 sequences, gdr_fwd6l_d128_w8 at B8 T4096 16/16 and B4
    /// T8192, gdr_fwd6ls3_d128_w1 with 2/8 heads), a forced width, and one that does not fit.
    #[test]
    fn fused_scan_widths_at_the_benchmark_shapes() {
        let sh = |hv, dv| RuleShape {
            hk: 16,
            hv,
            dk: 128,
            dv,
        };
        let fits16 = |dv: usize| move |w: usize| dv.is_multiple_of(16 * w);
        let v6 = |w: usize| {
            let c = 64;
            3 * c * (128 + 8) * 2 + c * (c + 8) * 2 + c * (16 * w + 4) * 4 + c * 4
        };
        let pick =
            |n, hv, dv, forced| fused_scan_warps(132, n, sh(hv, dv), 64, forced, fits16(dv), v6);
        assert_eq!(pick(1, 32, 128, 0), 2);
        assert_eq!(pick(6, 32, 128, 0), 4);
        assert_eq!(pick(8, 16, 128, 0), 8);
        assert_eq!(pick(4, 32, 128, 0), 8);
        assert_eq!(pick(1, 8, 128, 0), 1);
        assert_eq!(pick(1, 32, 128, 4), 4);
        // Dv 48: only one warp's 16 columns divide it; a forced 2 does not fit
        assert_eq!(pick(1, 32, 48, 2), 1);
    }
}
