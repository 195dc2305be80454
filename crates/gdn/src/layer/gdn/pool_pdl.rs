//! The decode step's chain (issue 14; the default since 2026-12-02, session 10; `GDN_DECODE_PDL=0`
//! or [`CachePool::set_pdl`]`(false)` turns it off):
//! the same ops as `decode_step` (norm + in_proj, pre, rule, gated norm, out_proj) with
//!
//! - every intermediate in a [`DecodeWork`] buffer allocated once per pool and batch size (a
//!   captured graph owns one; the op-by-op path keeps one in the pool), so the graph holds the
//!   kernels and none of the stream-ordered allocation / free nodes that stood between them;
//! - the pre step, the rule and the gated norm launched as programmatic dependent launches
//!   (`backend::launch::launch_pdl`, the `*_pdl` kernels of `decode.cu` / `gated_norm.cu`): each
//!   starts while the kernel before it drains and waits (`griddepcontrol.wait`) before it touches
//!   memory; the rule's blocks load their state tiles (the step's largest read) before they wait.
//!   The norm / folded in_proj (the step's first kernel) and the projections (cuBLASLt or the
//!   skinny GEMM) are ordinary launches, so a kernel never starts before the one two places
//!   before it has finished (the `*_pdl` kernels trigger their dependents only after their own
//!   wait), and the first waits for everything queued before the step.
//!
//! Same kernels' arithmetic on the same inputs as `decode_step`: the same bits (tests/gpu_infer.rs
//! `gpu_decode_pdl_matches_step_bitwise`). The skinny GEMM's split-K partials (out_proj at 16..64
//! rows with `GDN_DECODE_GEMV=1` only) are still allocated by `forward_skinny` per call.

use super::*;
use crate::ops::common::norm::GpuNormStats;
use crate::ops::decode::PreOut;

/// The chain is on unless `GDN_DECODE_PDL` is `0`, `off` or `false`. On by default since
/// 2026-12-02 (session 10): on the H200 its graph steps are the same bits and faster at every
/// batch measured (`bench_decode pdl 1 8 64 256`: B 1 60.1 -> 55.2 us with the skinny GEMM and
/// the folded norm, B 8 70.2 -> 62.5, B 64 154.7 -> 151.1 with cuBLASLt, B 256 382 -> 373).
pub(super) fn enabled_by_env() -> bool {
    !matches!(
        std::env::var("GDN_DECODE_PDL").as_deref(),
        Ok("0") | Ok("off") | Ok("false")
    )
}

/// The decode step's intermediates for `n` rows (device buffers, uninitialized; every kernel
/// writes all of its output before the next reads it).
pub(crate) struct DecodeWork {
    n: usize,
    /// The input norm's output `[n, hidden]` and statistics (unused when the norm is folded
    /// into in_proj).
    xn: DBuf,
    in_stats: GpuNormStats,
    /// in_proj's output `[n, in_proj_dim]`.
    proj: DBuf,
    /// The pre step's outputs.
    pre: PreOut,
    /// The rule's output `[n, Hv Dv]`.
    o: DBuf,
    /// The gated norm's output `[n, Hv Dv]` and statistics (`n Hv` rows).
    gn: DBuf,
    gn_stats: GpuNormStats,
}

impl DecodeWork {
    pub(super) fn batch(&self) -> usize {
        self.n
    }
    /// Device bytes held.
    pub(super) fn bytes(&self) -> usize {
        let pre = &self.pre;
        let f = |x: &F32s| x.len() * 4;
        self.xn.bytes()
            + self.in_stats.bytes()
            + self.proj.bytes()
            + f(&pre.q)
            + f(&pre.k)
            + f(&pre.v)
            + f(&pre.g)
            + f(&pre.b)
            + pre.w.as_ref().map_or(0, f)
            + self.o.bytes()
            + self.gn.bytes()
            + self.gn_stats.bytes()
    }
}

impl DecodeWork {
    /// Fill every buffer with `0xff` bytes (NaN in f32 and bf16) on the GPU's stream: tests
    /// (every kernel of the step must write all of its output before the next reads it).
    pub(super) fn poison(&mut self) -> Result<()> {
        use cudarc::driver::{DevicePtrMut, DeviceRepr};
        fn fill<T: DeviceRepr>(g: &mut GBuf<T>) -> Result<()> {
            let bytes = g.bytes();
            let s = g.gpu().stream().clone();
            let (p, _rec) = g.slice.device_ptr_mut(&s);
            // SAFETY: `p` is this live buffer's, `bytes` its size; allocated on this stream
            // (the default one: work buffers are never made inside a capture). NaN bits are
            // valid f32 / u16 values.
            unsafe { cudarc::driver::result::memset_d8_async(p, 0xff, bytes, s.cu_stream()) }
                .map_err(|e| GdnError::Device(format!("poisoning decode work buffers: {e:?}")))
        }
        fn fill_d(d: &mut DBuf) -> Result<()> {
            match d {
                DBuf::F32(g) => fill(g),
                DBuf::Bf16(g) => fill(g),
            }
        }
        fn fill_s(s: &mut GpuNormStats) -> Result<()> {
            fill(&mut s.rstd)?;
            match &mut s.mean {
                Some(m) => fill(m),
                None => Ok(()),
            }
        }
        fill_d(&mut self.xn)?;
        fill_s(&mut self.in_stats)?;
        fill_d(&mut self.proj)?;
        let pre = &mut self.pre;
        for x in [&mut pre.q, &mut pre.k, &mut pre.v, &mut pre.g, &mut pre.b]
            .into_iter()
            .chain(pre.w.as_mut())
        {
            if let F32s::Dev(g) = x {
                fill(g)?;
            }
        }
        fill_d(&mut self.o)?;
        fill_d(&mut self.gn)?;
        fill_s(&mut self.gn_stats)
    }
}

/// The device weight `name` (an error on a host view).
fn dev_w<'a>(p: &'a ParamView, name: &str) -> Result<&'a GBuf<f32>> {
    match p.get(name) {
        P::Dev(w) => Ok(w),
        P::Host(_) => Err(mixed("decode step (programmatic launches)")),
    }
}
fn dev_opt<'a>(p: &'a ParamView, name: &str) -> Result<Option<&'a GBuf<f32>>> {
    match p.opt(name) {
        Some(P::Dev(w)) => Ok(Some(w)),
        Some(P::Host(_)) => Err(mixed("decode step (programmatic launches)")),
        None => Ok(None),
    }
}

impl GatedDeltaNet {
    /// Work buffers for `n` rows of this layer's decode step.
    pub(super) fn decode_work(
        &self,
        gpu: &Arc<Gpu>,
        n: usize,
        pool: &CachePool,
    ) -> Result<DecodeWork> {
        let c = &self.cfg;
        let (h, pd, vd, hv) = (
            c.hidden_size,
            c.in_proj_dim(),
            c.v_dim(),
            c.linear_num_value_heads,
        );
        Ok(DecodeWork {
            n,
            xn: DBuf::uninit(gpu, n * h, self.dtype)?,
            in_stats: GpuNormStats::uninit(gpu, n, c.normalization)?,
            proj: DBuf::uninit(gpu, n * pd, self.dtype)?,
            pre: PreOut::uninit_dev(gpu, n, pool.shape)?,
            o: DBuf::uninit(gpu, n * vd, self.dtype)?,
            gn: DBuf::uninit(gpu, n * vd, self.dtype)?,
            gn_stats: GpuNormStats::uninit(gpu, n * hv, c.normalization)?,
        })
    }

    /// `y = x W^T` of projection `name` into `y`: the skinny GEMM where `skinny`, bf16 storage
    /// and its plan take the shape, else cuBLASLt (as `linear::forward_decode`: the same kernels).
    #[allow(clippy::too_many_arguments)]
    fn proj_into(
        &self,
        p: &ParamView,
        x: &DBuf,
        rows: usize,
        in_dim: usize,
        name: &str,
        out_dim: usize,
        skinny: bool,
        y: &mut DBuf,
    ) -> Result<()> {
        use crate::ops::linear::cuda as lc;
        let w = dev_w(p, name)?;
        let wb = p.bf16(name);
        if skinny && x.dtype() == DType::Bf16 {
            if let Some(plan) = lc::skinny_plan(rows, out_dim, in_dim, x.gpu().sm_count()?) {
                let made;
                let wb = match wb {
                    Some(b) => b,
                    None => {
                        made = lc::cast_bf16(w)?;
                        &made
                    }
                };
                crate::backend::launch::check_g("linear bf16 weight copy", wb, w.len())?;
                return lc::forward_skinny(x, rows, in_dim, wb, out_dim, y, plan, None);
            }
        }
        lc::forward(x, rows, in_dim, w, wb, out_dim, y)
    }

    /// One decode step on the opt-in chain (see the module doc): `x` `[n, hidden]` on the
    /// layer's GPU, `slots` `[n]` there (checked by the caller), `work` for `n` rows; `y`
    /// `[n, hidden]` written.
    pub(super) fn decode_step_pdl(
        &self,
        p: &ParamView,
        x: &DBuf,
        slots: &GBuf<i32>,
        pool: &mut CachePool,
        work: &mut DecodeWork,
        y: &mut DBuf,
    ) -> Result<()> {
        let c = &self.cfg;
        let n = slots.len();
        if work.n != n {
            return Err(GdnError::Invalid(format!(
                "decode step: work buffers for {} rows, {n} rows given",
                work.n
            )));
        }
        let (h, pd, vd, hv, dv) = (
            c.hidden_size,
            c.in_proj_dim(),
            c.v_dim(),
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let skinny = n <= pool.gemv_rows;
        // 1. norm + in_proj (ordinary launches: the chain's first kernel waits for everything
        // queued before the step).
        if self.folds_in_proj(p, x, n, skinny, pool)? {
            self.in_proj_folded_into(p, x, n, pool, &mut work.proj)?;
        } else {
            norm::cuda::forward(
                x,
                n,
                h,
                dev_w(p, "in_proj.layer_norm_weight")?,
                dev_opt(p, "in_proj.layer_norm_bias")?,
                c.normalization,
                c.layernorm_epsilon,
                c.layernorm_zero_centered_gamma,
                &mut work.xn,
                &mut work.in_stats,
            )?;
            self.proj_into(
                p,
                &work.xn,
                n,
                h,
                "in_proj.weight",
                pd,
                skinny,
                &mut work.proj,
            )?;
        }
        // 2. conv step + SiLU + gates, 3. the rule: programmatic launches.
        let pc = self.proj_cols();
        let cols = decode::PreCols {
            qkv: pc.qkv,
            gates: pc.gates.clone(),
        };
        let (shape, ns) = (pool.shape, pool.slots);
        let Act::Dev(conv) = &mut pool.conv else {
            return Err(mixed("decode step (programmatic launches)"));
        };
        decode::cuda::pre_into(
            &work.proj,
            &cols,
            conv,
            slots,
            ns,
            shape,
            dev_w(p, "conv1d.weight")?,
            dev_opt(p, "conv1d.bias")?,
            dev_w(p, "A_log")?,
            dev_w(p, "dt_bias")?,
            &mut work.pre,
            true,
        )?;
        let Act::Dev(state) = &mut pool.state else {
            return Err(mixed("decode step (programmatic launches)"));
        };
        decode::cuda::rule_pdl(&work.pre, state, slots, ns, shape, c.scale(), &mut work.o)?;
        // 4. gated norm (programmatic), 5. out_proj.
        gated_norm::cuda::forward_pdl(
            &work.o,
            &work.proj,
            pc.z,
            n * hv,
            dv,
            dev_w(p, "out_norm.weight")?,
            dev_opt(p, "out_norm.bias")?,
            c.normalization,
            c.layernorm_epsilon,
            c.layernorm_zero_centered_gamma,
            &mut work.gn,
            &mut work.gn_stats,
        )?;
        self.proj_into(p, &work.gn, n, vd, "out_proj.weight", h, skinny, y)
    }

    /// The opt-in chain op by op (graphs off): the pool's work buffers (made for this batch
    /// size when it changed), the slots uploaded, a new `y`.
    pub(super) fn decode_pdl_op_by_op(
        &self,
        x: &DBuf,
        slots: &[i32],
        pool: &mut CachePool,
    ) -> Result<DBuf> {
        let p = self.view()?;
        let gpu = x.gpu().clone();
        let n = slots.len();
        let mut work = match pool.work.take() {
            Some(w) if w.batch() == n => w,
            _ => self.decode_work(&gpu, n, pool)?,
        };
        let ids = gpu.upload(slots)?;
        let mut y = DBuf::uninit(&gpu, n * self.cfg.hidden_size, self.dtype)?;
        let r = self.decode_step_pdl(&p, x, &ids, pool, &mut work, &mut y);
        pool.work = Some(work);
        r.map(|()| y)
    }
}
