//! CUDA linear (no bias) through cuBLASLt: `y = x W^T`, `dx = dy W`, `dW = dy^T x`, the same
//! signatures as [`super::linear_forward`] and [`super::linear_backward`] on device buffers.
//!
//! `x`, `y`, `dy`, `dx` are [`DBuf`] of one dtype; the weight `W` `[out, in]` and `dW` are fp32
//! [`GBuf`] (master weights). bf16 storage: the GEMMs take bf16 inputs (the bf16 copy of `W`, made by
//! `cast_f32_bf16` in `linear.cu`, round to nearest even, once per parameter update by the caller
//! or on the fly when none is given) and accumulate in fp32
//! (`CUBLAS_COMPUTE_32F`); `y` and `dx` are written as bf16, `dW` as fp32. f32 storage: plain fp32
//! GEMMs (`CUBLAS_COMPUTE_32F` on fp32 data: no TF32, which only `CUBLAS_COMPUTE_32F_FAST_TF32`
//! would allow).
//!
//! Determinism: cuBLAS(Lt) documents that, for a given toolkit version, GPU architecture and SM
//! count, every routine gives bitwise-identical results run to run (its split-K reductions are
//! ordered, no atomics). Each GEMM here is one fixed configuration (same descriptors, heuristic
//! algorithm, workspace size and stream every call: one cached plan per shape), so two runs on the same inputs give the same bits;
//! the GPU tests check it.

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};

use crate::backend::cuda::{DBuf, DType, GBuf, GemmKey, GemmPlan, Gpu, BLASLT_WORKSPACE_BYTES};
use crate::backend::launch::{
    check_d, check_g, check_gpu, elem_cfg, int, launch, launch_in_threads, ptr, Arg,
};
use crate::error::{GdnError, Result};

const MODULE: &str = "linear";

fn blas_err(what: &str, e: lt::CublasError) -> GdnError {
    GdnError::Device(format!("cuBLASLt {what}: {:?}", e.0))
}

/// One column-major GEMM `D[m, n] = op(A) op(B)` (`op(A)` `[m, k]`, `op(B)` `[k, n]`), cuBLAS's
/// convention; alpha = 1, beta = 0.
#[derive(Clone, Copy, Debug)]
struct Gemm {
    transa: bool,
    transb: bool,
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldd: i64,
}

struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created once by cublasLtMatmulPreferenceCreate.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// Build the plan of `key`: layouts, matmul descriptor (fp32 compute and scale, the transposes)
/// and the heuristic's first algorithm for the fixed workspace; the same objects and the same
/// query every uncached call made before plans were cached.
fn make_plan(handle: sys::cublasLtHandle_t, key: &GemmKey) -> Result<GemmPlan> {
    let mut p = GemmPlan::empty();
    let (ar, ac) = if key.transa {
        (key.k, key.m)
    } else {
        (key.m, key.k)
    };
    let (br, bc) = if key.transb {
        (key.n, key.k)
    } else {
        (key.k, key.n)
    };
    // Each handle goes into `p` as soon as it exists, so an error below destroys it (drop).
    p.la =
        lt::create_matrix_layout(key.ab, ar, ac, key.lda).map_err(|e| blas_err("layout A", e))?;
    p.lb =
        lt::create_matrix_layout(key.ab, br, bc, key.ldb).map_err(|e| blas_err("layout B", e))?;
    p.ld = lt::create_matrix_layout(key.d, key.m, key.n, key.ldd)
        .map_err(|e| blas_err("layout D", e))?;
    p.desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType_t::CUDA_R_32F,
    )
    .map_err(|e| blas_err("matmul desc", e))?;
    for (attr, t) in [
        (
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            key.transa,
        ),
        (
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            key.transb,
        ),
    ] {
        // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        let v: i32 = t as i32;
        // SAFETY: `p.desc` is a live descriptor; the value is one i32.
        unsafe {
            lt::set_matmul_desc_attribute(
                p.desc,
                attr,
                (&v) as *const i32 as *const _,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(|e| blas_err("transpose attribute", e))?;
    }
    let pref = Pref(lt::create_matmul_pref().map_err(|e| blas_err("preference", e))?);
    let ws: usize = BLASLT_WORKSPACE_BYTES;
    // SAFETY: `pref.0` is live; the value is one usize.
    unsafe {
        lt::set_matmul_pref_attribute(
            pref.0,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws) as *const usize as *const _,
            std::mem::size_of::<usize>(),
        )
    }
    .map_err(|e| blas_err("workspace preference", e))?;
    // SAFETY: all handles are live.
    let heur =
        unsafe { lt::get_matmul_algo_heuristic(handle, p.desc, p.la, p.lb, p.ld, p.ld, pref.0) }
            .map_err(|e| blas_err(&format!("no algorithm for {key:?}"), e))?;
    p.algo = heur.algo;
    Ok(p)
}

/// Run `g` with A, B of type `ab` and D of type `d` (device pointers), fp32 compute and scale,
/// through the GPU's cached plan for this shape (made at its first use).
///
/// # Safety
/// The pointers must hold the matrices `g` describes, of the given types, on `gpu`.
unsafe fn lt_gemm(
    gpu: &Gpu,
    g: Gemm,
    ab: sys::cudaDataType,
    dty: sys::cudaDataType,
    a: u64,
    b: u64,
    d: u64,
) -> Result<()> {
    let blas = gpu.blaslt()?;
    let key = GemmKey {
        transa: g.transa,
        transb: g.transb,
        m: g.m,
        n: g.n,
        k: g.k,
        lda: g.lda,
        ldb: g.ldb,
        ldd: g.ldd,
        ab,
        d: dty,
    };
    let plan = blas.plan(key, || make_plan(blas.handle(), &key))?;
    let stream = gpu.stream();
    let (wsp, _rec) = blas.workspace().device_ptr(stream);
    let (alpha, beta) = (1.0f32, 0.0f32);
    lt::matmul(
        blas.handle(),
        plan.desc,
        (&alpha) as *const f32 as *const _,
        (&beta) as *const f32 as *const _,
        a as *const _,
        plan.la,
        b as *const _,
        plan.lb,
        d as *const _,
        plan.ld,
        d as *mut _,
        plan.ld,
        (&plan.algo) as *const _,
        wsp as *mut _,
        BLASLT_WORKSPACE_BYTES,
        stream.cu_stream() as *mut _,
    )
    .map_err(|e| blas_err(&format!("matmul {g:?}"), e))
}

/// The bf16 copy (round to nearest even) of an fp32 weight, for the bf16 GEMMs.
pub fn cast_bf16(w: &GBuf<f32>) -> Result<GBuf<u16>> {
    let gpu = w.gpu().clone();
    let mut out = gpu.uninit::<u16>(w.len())?;
    if w.is_empty() {
        return Ok(out);
    }
    let f = gpu.function(MODULE, "cast_f32_bf16")?;
    let n = w.len() as i64;
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&w.slice).arg(&mut out.slice).arg(&n);
    launch(&mut l, elem_cfg(w.len()), "cast_f32_bf16")?;
    Ok(out)
}

/// A bf16 weight copy: the caller's, or one made for this call.
enum Bf16W<'a> {
    Kept(&'a GBuf<u16>),
    Made(GBuf<u16>),
}

impl std::ops::Deref for Bf16W<'_> {
    type Target = GBuf<u16>;
    fn deref(&self) -> &GBuf<u16> {
        match self {
            Bf16W::Kept(b) => b,
            Bf16W::Made(b) => b,
        }
    }
}

/// The bf16 copy of `w` for a bf16 GEMM: the caller's `wb` (made by [`cast_bf16`] when `w` was
/// last updated; checked: same length and GPU), or one made now.
fn bf16_weight<'a>(w: &GBuf<f32>, wb: Option<&'a GBuf<u16>>) -> Result<Bf16W<'a>> {
    match wb {
        Some(b) => {
            if b.len() != w.len() {
                return Err(GdnError::Invalid(format!(
                    "linear bf16 weight copy has {} values, the weight {}",
                    b.len(),
                    w.len()
                )));
            }
            check_gpu("linear bf16 weight copy", w.gpu(), b.gpu())?;
            Ok(Bf16W::Kept(b))
        }
        None => Ok(Bf16W::Made(cast_bf16(w)?)),
    }
}

fn zero_d(gpu: &Gpu, d: &mut DBuf) -> Result<()> {
    let r = match d {
        DBuf::F32(g) => gpu.stream().memset_zeros(&mut g.slice),
        DBuf::Bf16(g) => gpu.stream().memset_zeros(&mut g.slice),
    };
    r.map_err(|e| GdnError::Device(format!("memset: {e:?}")))
}

/// [`super::forward`] into a caller-provided `y`; `wb`: the bf16 copy of `w` for bf16 storage
/// (`None`: made now; ignored for f32).
pub fn forward(
    x: &DBuf,
    rows: usize,
    in_dim: usize,
    w: &GBuf<f32>,
    wb: Option<&GBuf<u16>>,
    out_dim: usize,
    y: &mut DBuf,
) -> Result<()> {
    let dt = x.dtype();
    check_d("linear x", x, rows.saturating_mul(in_dim), dt)?;
    check_g("linear weight", w, out_dim.saturating_mul(in_dim))?;
    check_d("linear y", y, rows.saturating_mul(out_dim), dt)?;
    let gpu = x.gpu().clone();
    check_gpu("linear weight", &gpu, w.gpu())?;
    check_gpu("linear y", &gpu, y.gpu())?;
    if y.is_empty() {
        return Ok(());
    }
    if in_dim == 0 {
        return zero_d(&gpu, y);
    }
    // y^T [out, rows] = (W^T)^T x^T: A = W as column-major [in, out], B = x as [in, rows].
    let g = Gemm {
        transa: true,
        transb: false,
        m: out_dim as u64,
        n: rows as u64,
        k: in_dim as u64,
        lda: in_dim as i64,
        ldb: in_dim as i64,
        ldd: out_dim as i64,
    };
    let s = gpu.stream();
    match (x, y) {
        (DBuf::F32(x), DBuf::F32(y)) => {
            let (a, _ra) = w.slice.device_ptr(s);
            let (b, _rb) = x.slice.device_ptr(s);
            let (d, _rd) = y.slice.device_ptr_mut(s);
            let f = sys::cudaDataType_t::CUDA_R_32F;
            // SAFETY: lengths checked above match the GEMM's shapes.
            unsafe { lt_gemm(&gpu, g, f, f, a, b, d) }
        }
        (DBuf::Bf16(x), DBuf::Bf16(y)) => {
            let wb = bf16_weight(w, wb)?;
            let (a, _ra) = wb.slice.device_ptr(s);
            let (b, _rb) = x.slice.device_ptr(s);
            let (d, _rd) = y.slice.device_ptr_mut(s);
            let h = sys::cudaDataType_t::CUDA_R_16BF;
            // SAFETY: as above.
            unsafe { lt_gemm(&gpu, g, h, h, a, b, d) }
        }
        _ => unreachable!("dtypes checked"),
    }
}

/// [`super::backward`] into caller-provided `dx` and `dw` (`dw` is overwritten, not
/// accumulated); `wb` as in [`forward`].
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &DBuf,
    rows: usize,
    in_dim: usize,
    w: &GBuf<f32>,
    wb: Option<&GBuf<u16>>,
    out_dim: usize,
    dy: &DBuf,
    dx: &mut DBuf,
    dw: &mut GBuf<f32>,
) -> Result<()> {
    let dt = x.dtype();
    check_d("linear x", x, rows.saturating_mul(in_dim), dt)?;
    check_g("linear weight", w, out_dim.saturating_mul(in_dim))?;
    check_d("linear dy", dy, rows.saturating_mul(out_dim), dt)?;
    check_d("linear dx", dx, rows.saturating_mul(in_dim), dt)?;
    check_g("linear dW", dw, out_dim.saturating_mul(in_dim))?;
    let gpu = x.gpu().clone();
    for (name, g) in [
        ("linear weight", w.gpu()),
        ("linear dy", dy.gpu()),
        ("linear dx", dx.gpu()),
        ("linear dW", dw.gpu()),
    ] {
        check_gpu(name, &gpu, g)?;
    }
    let s = gpu.stream();
    // dx^T [in, rows] = W^T dy^T: A = W as column-major [in, out], B = dy as [out, rows].
    let gx = Gemm {
        transa: false,
        transb: false,
        m: in_dim as u64,
        n: rows as u64,
        k: out_dim as u64,
        lda: in_dim as i64,
        ldb: out_dim as i64,
        ldd: in_dim as i64,
    };
    // dW^T [in, out] = x^T dy: A = x as column-major [in, rows], B = dy as [out, rows], transposed.
    let gw = Gemm {
        transa: false,
        transb: true,
        m: in_dim as u64,
        n: out_dim as u64,
        k: rows as u64,
        lda: in_dim as i64,
        ldb: out_dim as i64,
        ldd: in_dim as i64,
    };
    let (f32t, bf16t) = (
        sys::cudaDataType_t::CUDA_R_32F,
        sys::cudaDataType_t::CUDA_R_16BF,
    );
    let wb = match dt {
        DType::Bf16 if !dx.is_empty() && out_dim > 0 => Some(bf16_weight(w, wb)?),
        _ => None,
    };
    if !dx.is_empty() {
        if out_dim == 0 {
            zero_d(&gpu, dx)?;
        } else {
            match (dy, &mut *dx, &wb) {
                (DBuf::F32(dy), DBuf::F32(dx), _) => {
                    let (a, _ra) = w.slice.device_ptr(s);
                    let (b, _rb) = dy.slice.device_ptr(s);
                    let (d, _rd) = dx.slice.device_ptr_mut(s);
                    // SAFETY: lengths checked above match the GEMM's shapes.
                    unsafe { lt_gemm(&gpu, gx, f32t, f32t, a, b, d) }?
                }
                (DBuf::Bf16(dy), DBuf::Bf16(dx), Some(wb)) => {
                    let (a, _ra) = wb.slice.device_ptr(s);
                    let (b, _rb) = dy.slice.device_ptr(s);
                    let (d, _rd) = dx.slice.device_ptr_mut(s);
                    // SAFETY: as above.
                    unsafe { lt_gemm(&gpu, gx, bf16t, bf16t, a, b, d) }?
                }
                _ => unreachable!("dtypes checked"),
            }
        }
    }
    if !dw.is_empty() {
        if rows == 0 {
            s.memset_zeros(&mut dw.slice)
                .map_err(|e| GdnError::Device(format!("memset: {e:?}")))?;
        } else {
            let (d, _rd) = dw.slice.device_ptr_mut(s);
            match (x, dy) {
                (DBuf::F32(x), DBuf::F32(dy)) => {
                    let (a, _ra) = x.slice.device_ptr(s);
                    let (b, _rb) = dy.slice.device_ptr(s);
                    // SAFETY: as above.
                    unsafe { lt_gemm(&gpu, gw, f32t, f32t, a, b, d) }?
                }
                (DBuf::Bf16(x), DBuf::Bf16(dy)) => {
                    let (a, _ra) = x.slice.device_ptr(s);
                    let (b, _rb) = dy.slice.device_ptr(s);
                    // SAFETY: as above; bf16 inputs, fp32 output.
                    unsafe { lt_gemm(&gpu, gw, bf16t, f32t, a, b, d) }?
                }
                _ => unreachable!("dtypes checked"),
            }
        }
    }
    Ok(())
}

/// The skinny GEMM's module (`skinny.cu`).
const SKINNY_MODULE: &str = "skinny";

/// Most token rows the skinny GEMM takes (8 token tiles of 8).
pub const SKINNY_MAX_ROWS: usize = 64;

/// k values per chunk of the skinny GEMM (`32 SK_U` in `skinny.cu`): `in_dim` must be a multiple.
const SKINNY_STEP: usize = 128;

/// A launch of the skinny GEMM (`skinny.cu`): `nt` token tiles of 8, CTAs of `wm` x `ws` warps
/// (`wm` row tiles of 16, `ws` k ranges), `slabs` x `splits` CTAs (`splits` k ranges of K across
/// CTAs, summed in order by the last CTA of each slab), `nchunk` chunks of 128 k per warp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyPlan {
    pub nt: usize,
    pub wm: usize,
    pub ws: usize,
    pub slabs: usize,
    pub splits: usize,
    pub nchunk: usize,
}

impl SkinnyPlan {
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        32 * self.wm * self.ws
    }
    /// Dynamic shared memory bytes: the in-CTA partials of warps `ws > 0`, and a flag.
    pub fn smem_bytes(&self) -> usize {
        (self.ws - 1) * self.wm * 128 * self.nt * 4 + 16
    }
    /// Dynamic shared memory bytes of the kernel with the input norm folded in (the per-token
    /// sums of each k range too).
    pub fn smem_bytes_norm(&self) -> usize {
        self.smem_bytes() + 2 * self.ws * 8 * self.nt * 4
    }
    /// Whether the kernel with the input norm folded in takes this plan: one k range across CTAs
    /// (each CTA sees whole token rows) and `wm >= nt / 2` (the kernel's two sum slots per warp).
    pub fn takes_norm(&self) -> bool {
        self.splits == 1 && 2 * self.wm >= self.nt
    }
    /// fp32 values of the split-K partials (0 when `splits` is 1).
    pub fn part_len(&self) -> usize {
        if self.splits > 1 {
            self.splits * self.slabs * self.wm * 128 * self.nt
        } else {
            0
        }
    }
}

/// The skinny GEMM's plan for `y [m, n] = x [m, k] W[n, k]^T` on a GPU of `sms` SMs, or `None`
/// where it does not take the shape (`m` of 1..=64, `k` a multiple of 128). Rows per CTA: enough
/// row tiles that the CTAs fill the SMs once (`ceil(n / 16 / sms)`), and at least `nt / 2` so
/// that the token rows (each CTA reads all of its k range of them, through L1) are at most as
/// many bytes as the weights; then k splits across CTAs (divisors of the chunks, at most 8)
/// until the CTAs fill the SMs, and k ranges within a CTA (up to 12 warps at 8 token tiles,
/// 16 below).
pub fn skinny_plan(m: usize, n: usize, k: usize, sms: usize) -> Option<SkinnyPlan> {
    skinny_plan_with(m, n, k, sms, false)
}

/// [`skinny_plan`]; `one_split`: no k splits across CTAs (the plan then takes the folded input
/// norm, [`SkinnyPlan::takes_norm`]).
pub fn skinny_plan_with(
    m: usize,
    n: usize,
    k: usize,
    sms: usize,
    one_split: bool,
) -> Option<SkinnyPlan> {
    if m == 0 || m > SKINNY_MAX_ROWS || n == 0 || k == 0 || !k.is_multiple_of(SKINNY_STEP) {
        return None;
    }
    let nt = [1usize, 2, 4, 8].into_iter().find(|&t| 8 * t >= m)?;
    let max_warps = if nt == 8 { 12 } else { 16 };
    let (sms, mtiles, steps) = (sms.max(1), n.div_ceil(16), k / SKINNY_STEP);
    let wm = mtiles.div_ceil(sms).max(nt / 2).clamp(1, max_warps);
    let slabs = mtiles.div_ceil(wm);
    let want = if one_split {
        1
    } else {
        (sms / slabs).clamp(1, 8)
    };
    let splits = (1..=want).rev().find(|s| steps.is_multiple_of(*s))?;
    let per = steps / splits;
    let ws = (1..=(max_warps / wm).min(8))
        .rev()
        .find(|w| per.is_multiple_of(*w))?;
    if slabs > crate::backend::cuda::COUNTERS {
        return None;
    }
    Some(SkinnyPlan {
        nt,
        wm,
        ws,
        slabs,
        splits,
        nchunk: per / ws,
    })
}

/// The input norm folded into the skinny GEMM ([`fold_norm`] made `wb`, `c1`, `c2`): `x` is the
/// norm's raw input and `y = norm(x) W^T` is `rstd (x W'^T - mean c1) + c2` per token, the
/// token's mean (LayerNorm; RMSNorm: 0) and rstd from sums the kernel takes of the x values it
/// loads anyway.
#[derive(Clone, Copy)]
pub struct SkinnyNorm<'a> {
    /// LayerNorm (subtract the mean) or RMSNorm.
    pub layer: bool,
    pub eps: f32,
    /// `[out_dim]`: the row sums of the folded weight.
    pub c1: &'a GBuf<f32>,
    /// `[out_dim]`: `W b`, with the norm's bias.
    pub c2: Option<&'a GBuf<f32>>,
}

/// [`fold_norm`]'s result: the folded bf16 weight `W'`, `c1`, and `c2` (with the norm's bias).
pub type Folded = (GBuf<u16>, GBuf<f32>, Option<GBuf<f32>>);

/// The norm's scale folded into a weight, for [`SkinnyNorm`]: `W' = bf16(W diag(g))` (`g` = the
/// norm weight `gw`, or `1 + gw` zero-centered; rounded once from the fp32 master `w`
/// `[out_dim, in_dim]`), `c1 = W' 1` (the rounded values summed in fp32) and, with the norm's bias
/// `b`, `c2 = W b`. One kernel (`skinny_fold`), fixed-order sums.
pub fn fold_norm(
    w: &GBuf<f32>,
    gw: &GBuf<f32>,
    zero_centered: bool,
    b: Option<&GBuf<f32>>,
    out_dim: usize,
    in_dim: usize,
) -> Result<Folded> {
    check_g("fold weight", w, out_dim.saturating_mul(in_dim))?;
    check_g("fold norm weight", gw, in_dim)?;
    if let Some(b) = b {
        check_g("fold norm bias", b, in_dim)?;
    }
    let gpu = w.gpu().clone();
    check_gpu("fold norm weight", &gpu, gw.gpu())?;
    int("fold out_dim", out_dim)?;
    int("fold in_dim", in_dim)?;
    let wf = gpu.uninit::<u16>(w.len())?;
    let c1 = gpu.uninit::<f32>(out_dim)?;
    let c2 = match b {
        Some(_) => Some(gpu.uninit::<f32>(out_dim)?),
        None => None,
    };
    let s = gpu.stream();
    let args = [
        ptr(w, s),
        ptr(gw, s),
        Arg::I32(zero_centered as i32),
        b.map_or(Arg::Ptr(0), |b| ptr(b, s)),
        Arg::I32(b.is_some() as i32),
        ptr(&wf, s),
        ptr(&c1, s),
        c2.as_ref().map_or(Arg::Ptr(0), |c| ptr(c, s)),
        Arg::I32(out_dim as i32),
        Arg::I32(in_dim as i32),
    ];
    launch_in_threads(
        &gpu,
        SKINNY_MODULE,
        "skinny_fold",
        out_dim.div_ceil(8),
        256,
        0,
        &args,
    )?;
    Ok((wf, c1, c2))
}

/// `y = x W^T` by the skinny GEMM (`skinny.cu`) with plan `plan` (from [`skinny_plan`] for
/// these shapes): bf16 `x` `[rows, in_dim]`, the bf16 weight `wb` `[out_dim, in_dim]`, bf16 `y`
/// `[rows, out_dim]` (every element written); with `norm`, `y = norm(x) W^T` from the folded
/// weight (`plan.takes_norm()` required). Same inputs and plan, same bits.
#[allow(clippy::too_many_arguments)]
pub fn forward_skinny(
    x: &DBuf,
    rows: usize,
    in_dim: usize,
    wb: &GBuf<u16>,
    out_dim: usize,
    y: &mut DBuf,
    plan: SkinnyPlan,
    norm: Option<SkinnyNorm>,
) -> Result<()> {
    check_d("skinny x", x, rows.saturating_mul(in_dim), DType::Bf16)?;
    check_g("skinny weight", wb, out_dim.saturating_mul(in_dim))?;
    check_d("skinny y", y, rows.saturating_mul(out_dim), DType::Bf16)?;
    let gpu = x.gpu().clone();
    check_gpu("skinny weight", &gpu, wb.gpu())?;
    check_gpu("skinny y", &gpu, y.gpu())?;
    let p = plan;
    let ok = p.nt >= 1
        && 8 * p.nt >= rows
        && matches!(p.nt, 1 | 2 | 4 | 8)
        && rows >= 1
        && p.wm >= 1
        && p.ws >= 1
        && p.threads() <= if p.nt == 8 { 384 } else { 512 }
        && p.slabs * 16 * p.wm >= out_dim
        && p.slabs <= crate::backend::cuda::COUNTERS
        && p.splits >= 1
        && p.splits * p.ws * p.nchunk * SKINNY_STEP == in_dim;
    if !ok {
        return Err(GdnError::Invalid(format!(
            "skinny GEMM: plan {p:?} does not fit [{rows}, {in_dim}] x [{out_dim}, {in_dim}]^T"
        )));
    }
    int("skinny out_dim", out_dim)?;
    int("skinny in_dim", in_dim)?;
    if let Some(nm) = norm {
        if !p.takes_norm() {
            return Err(GdnError::Invalid(format!(
                "skinny GEMM: plan {p:?} cannot fold the input norm (one k range per CTA, wm >= nt / 2)"
            )));
        }
        check_g("skinny c1", nm.c1, out_dim)?;
        check_gpu("skinny c1", &gpu, nm.c1.gpu())?;
        if let Some(c2) = nm.c2 {
            check_g("skinny c2", c2, out_dim)?;
            check_gpu("skinny c2", &gpu, c2.gpu())?;
        }
        crate::ops::common::norm::check_eps("skinny norm", nm.eps)?;
        let s = gpu.stream();
        let (DBuf::Bf16(xb), DBuf::Bf16(yb)) = (x, &*y) else {
            unreachable!("dtypes checked")
        };
        let args = [
            ptr(xb, s),
            ptr(wb, s),
            ptr(yb, s),
            Arg::I32(rows as i32),
            Arg::I32(out_dim as i32),
            Arg::I32(in_dim as i32),
            Arg::I32(p.wm as i32),
            Arg::I32(p.ws as i32),
            Arg::I32(p.nchunk as i32),
            Arg::I32(p.slabs as i32),
            Arg::I32(nm.layer as i32),
            Arg::F32(nm.eps),
            ptr(nm.c1, s),
            nm.c2.map_or(Arg::Ptr(0), |c| ptr(c, s)),
        ];
        return launch_in_threads(
            &gpu,
            SKINNY_MODULE,
            &format!("skinny_norm_t{}", p.nt),
            p.slabs,
            p.threads() as u32,
            p.smem_bytes_norm(),
            &args,
        );
    }
    let part = if p.part_len() > 0 {
        Some(gpu.uninit::<f32>(p.part_len())?)
    } else {
        None
    };
    let counters = gpu.counters()?;
    let s = gpu.stream();
    let (DBuf::Bf16(xb), DBuf::Bf16(yb)) = (x, &*y) else {
        unreachable!("dtypes checked")
    };
    let (cp, _rc) = counters.device_ptr(s);
    let args = [
        ptr(xb, s),
        ptr(wb, s),
        ptr(yb, s),
        part.as_ref().map_or(Arg::Ptr(0), |b| ptr(b, s)),
        Arg::Ptr(cp),
        Arg::I32(rows as i32),
        Arg::I32(out_dim as i32),
        Arg::I32(in_dim as i32),
        Arg::I32(p.wm as i32),
        Arg::I32(p.ws as i32),
        Arg::I32(p.nchunk as i32),
        Arg::I32(p.slabs as i32),
        Arg::I32(p.splits as i32),
    ];
    launch_in_threads(
        &gpu,
        SKINNY_MODULE,
        &format!("skinny_gemm_t{}", p.nt),
        p.slabs * p.splits,
        p.threads() as u32,
        p.smem_bytes(),
        &args,
    )
}
