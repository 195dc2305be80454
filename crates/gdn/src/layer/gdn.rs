//! GatedDeltaNet: forward top to bottom in Megatron's order, backward bottom to top.

use crate::config::{GdnConfig, Normalization, Variant};
use crate::error::{GdnError, Result};
use crate::layer::saved::Acts;

use crate::layer::{Grads, Params, Saved};
use crate::ops::gated_delta_rule::{self as gdr, RuleOpts, RuleShape};
use crate::ops::{conv1d, gated_norm, gates, l2norm, linear, norm};
use crate::seqs::Seqs;
use crate::tensor::{put_cols, take_cols, Tensor};

/// One Gated DeltaNet layer.
#[derive(Clone, Debug)]
pub struct GatedDeltaNet {
    cfg: GdnConfig,
    params: Params,
}

/// Everything forward computes (what `Acts` keeps is a subset).
struct Forward {
    y: Vec<f32>,
    acts: Acts,
}

impl GatedDeltaNet {
    /// A layer with Megatron's initialization from `seed`. Validates `cfg`.
    pub fn new(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        Self::check_variant(cfg)?;
        Ok(GatedDeltaNet {
            cfg: cfg.clone(),
            params: Params::init(cfg, seed),
        })
    }
    /// A layer with given parameters (checked against `cfg`: names and shapes).
    pub fn with_params(cfg: &GdnConfig, params: Params) -> Result<Self> {
        cfg.validate()?;
        Self::check_variant(cfg)?;
        params.check_against(cfg, "parameters")?;
        Ok(GatedDeltaNet {
            cfg: cfg.clone(),
            params,
        })
    }
    fn check_variant(cfg: &GdnConfig) -> Result<()> {
        if cfg.variant != Variant::Gdn {
            return Err(GdnError::config(
                "variant",
                "GatedDeltaNet needs variant = \"gdn\"",
            ));
        }
        Ok(())
    }
    /// The config.
    pub fn config(&self) -> &GdnConfig {
        &self.cfg
    }
    /// The parameters.
    pub fn params(&self) -> &Params {
        &self.params
    }
    /// The parameters, mutably (for optimizers). Shapes must not change.
    pub fn params_mut(&mut self) -> &mut Params {
        &mut self.params
    }

    /// Training forward over `x` `[B, T, hidden]` (B sequences of T tokens).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (b, t) = self.batch_dims(x)?;
        self.forward_seqs(x, Seqs::uniform(b, t))
    }

    /// Training forward over packed sequences: `x` `[1, T, hidden]` or `[T, hidden]`, with
    /// `cu_seqlens` boundaries in `seqs`; rows after the last boundary are padding (zero output,
    /// zero gradient).
    pub fn forward_packed(&self, x: &Tensor, seqs: &Seqs) -> Result<(Tensor, Saved)> {
        let t = self.packed_dims(x)?;
        if seqs.tokens() != t {
            return Err(GdnError::CuSeqlens(format!(
                "describes {} rows but x has {t} tokens",
                seqs.tokens()
            )));
        }
        self.forward_seqs(x, seqs.clone())
    }

    /// Inference forward: keeps nothing for backward (recompute settings do not apply).
    pub fn forward_inference(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = self.batch_dims(x)?;
        let f = self.run_forward(x.data(), &Seqs::uniform(b, t))?;
        Tensor::from_vec(x.shape(), f.y)
    }

    fn batch_dims(&self, x: &Tensor) -> Result<(usize, usize)> {
        match x.shape() {
            &[b, t, h] if h == self.cfg.hidden_size => Ok((b, t)),
            s => Err(GdnError::shape(
                "x",
                s,
                format!("[B, T, {}] (hidden_size)", self.cfg.hidden_size),
            )),
        }
    }
    fn packed_dims(&self, x: &Tensor) -> Result<usize> {
        match x.shape() {
            &[1, t, h] | &[t, h] if h == self.cfg.hidden_size => Ok(t),
            s => Err(GdnError::shape(
                "x",
                s,
                format!(
                    "[1, T, {}] or [T, {}] for packed sequences (batch must be 1)",
                    self.cfg.hidden_size, self.cfg.hidden_size
                ),
            )),
        }
    }

    fn forward_seqs(&self, x: &Tensor, seqs: Seqs) -> Result<(Tensor, Saved)> {
        let rc = self.cfg.recompute();
        let f = self.run_forward(x.data(), &seqs)?;
        let y = Tensor::from_vec(x.shape(), f.y)?;
        let mut acts = f.acts;
        if rc.norm_out {
            // gdn_norm_out: out_proj has consumed the gated norm's output; drop it.
            acts.norm_out = None;
        }
        let saved = Saved {
            seqs,
            x_shape: x.shape().to_vec(),
            x: x.data().to_vec(),
            acts: (!rc.whole_layer).then_some(acts),
        };
        Ok((y, saved))
    }

    fn rule_shape(&self) -> RuleShape {
        let c = &self.cfg;
        RuleShape {
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
        }
    }
    fn rule_opts(&self) -> RuleOpts {
        RuleOpts {
            scale: self.cfg.scale(),
            l2norm_in_kernel: self.cfg.use_qk_l2norm_in_kernel,
        }
    }
    fn in_norm_bias(&self) -> Option<&[f32]> {
        self.params.opt("in_proj.layer_norm_bias")
    }
    fn out_norm_bias(&self) -> Option<&[f32]> {
        self.params.opt("out_norm.bias")
    }

    /// The layer, top to bottom (Megatron's `GatedDeltaNet.forward`).
    fn run_forward(&self, x: &[f32], seqs: &Seqs) -> Result<Forward> {
        let c = &self.cfg;
        let p = &self.params;
        let n = seqs.tokens();
        let (h, hv, dv) = (
            c.hidden_size,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let (vd, cd) = (c.v_dim(), c.conv_dim());
        let eps = c.layernorm_epsilon;
        let zc = c.layernorm_zero_centered_gamma;

        // 1. Fused pre-norm + in_proj -> [q | k | v | z | beta | alpha].
        let (xn, in_stats) = norm::norm_forward(
            x,
            n,
            h,
            p.d("in_proj.layer_norm_weight"),
            self.in_norm_bias(),
            c.normalization,
            eps,
            zc,
        )?;
        let proj = linear::linear_forward(&xn, n, h, p.d("in_proj.weight"), c.in_proj_dim())?;
        drop(xn);
        // 2. Split.
        let pd = c.in_proj_dim();
        let qkv_pre = take_cols(&proj, pd, 0, cd);
        let z = take_cols(&proj, pd, cd, vd);
        let beta_raw = take_cols(&proj, pd, cd + vd, hv);
        let alpha = take_cols(&proj, pd, cd + vd + hv, hv);
        drop(proj);
        // 3-6. conv + SiLU, l2norm, gates, gated delta rule.
        let r = self.prep(&qkv_pre, &beta_raw, &alpha, seqs)?;
        let (o, _) = gdr::forward(
            r.qn(),
            r.kn(),
            &r.v,
            &r.g,
            &r.beta,
            seqs,
            self.rule_shape(),
            self.rule_opts(),
            None,
            false,
        )?;
        // Keep the rule's inputs (Megatron keeps these), unless `gdn_prep` rebuilds them.
        let rule_in = (!c.recompute().prep).then_some(r);
        // 7. Gated norm: RMSNorm(o) * silu(z) (norm first, then gate).
        let (norm_out, o_stats) = gated_norm::gated_norm_forward(
            &o,
            &z,
            n * hv,
            dv,
            p.d("out_norm.weight"),
            self.out_norm_bias(),
            c.normalization,
            eps,
            zc,
        )?;
        // 8. out_proj.
        let y = linear::linear_forward(&norm_out, n, vd, p.d("out_proj.weight"), h)?;
        Ok(Forward {
            y,
            acts: Acts {
                in_stats,
                qkv_pre,
                z,
                gate_in: vec![beta_raw, alpha],
                rule_in,
                o,
                o_stats,
                norm_out: Some(norm_out),
            },
        })
    }

    /// conv + SiLU, q/k L2 norm and gates: the rule's inputs from in_proj's sections. Forward
    /// runs it once; backward reruns it when `gdn_prep` dropped its results (same kernels, same
    /// inputs, so the same bits).
    fn prep(
        &self,
        qkv_pre: &[f32],
        beta_raw: &[f32],
        alpha: &[f32],
        seqs: &Seqs,
    ) -> Result<RuleInputs> {
        let c = &self.cfg;
        let p = &self.params;
        let n = seqs.tokens();
        let (hk, hv, dk) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
        );
        let (qk, vd, cd) = (c.qk_dim(), c.v_dim(), c.conv_dim());
        let w = c.linear_conv_kernel_dim;
        let qkv = conv1d::conv1d_silu_forward(
            qkv_pre,
            cd,
            p.d("conv1d.weight"),
            w,
            p.opt("conv1d.bias"),
            seqs,
        )?;
        let q = take_cols(&qkv, cd, 0, qk);
        let k = take_cols(&qkv, cd, qk, qk);
        let v = take_cols(&qkv, cd, 2 * qk, vd);
        drop(qkv);
        // Caller-side q/k L2 norm (Megatron's route); with `use_qk_l2norm_in_kernel` the rule
        // normalizes the raw rows itself and no normalized copy exists.
        let qkn = if c.use_qk_l2norm && !c.use_qk_l2norm_in_kernel {
            Some((
                l2norm::l2norm_forward(&q, n * hk, dk)?.0,
                l2norm::l2norm_forward(&k, n * hk, dk)?.0,
            ))
        } else {
            None
        };
        let (g, beta) = gates::gates_forward(alpha, beta_raw, n, hv, p.d("A_log"), p.d("dt_bias"))?;
        Ok(RuleInputs {
            q,
            k,
            v,
            qkn,
            g,
            beta,
        })
    }

    /// Backward: consumes what forward saved, returns `dx` (shape of `x`) and parameter grads
    /// under the parameters' names.
    pub fn backward(&self, saved: Saved, dy: &Tensor) -> Result<(Tensor, Grads)> {
        if dy.shape() != saved.x_shape.as_slice() {
            return Err(GdnError::shape(
                "dy",
                dy.shape(),
                format!("{:?} (the shape of x)", saved.x_shape),
            ));
        }
        let Saved {
            seqs,
            x_shape,
            x,
            acts,
        } = saved;
        let acts = match acts {
            Some(a) => a,
            // Whole-layer recompute: rerun forward, keeping everything this time.
            None => self.run_forward(&x, &seqs)?.acts,
        };
        let (dx, grads) = self.run_backward(&x, &seqs, acts, dy.data())?;
        Ok((Tensor::from_vec(&x_shape, dx)?, grads))
    }

    /// The layer, bottom to top.
    fn run_backward(
        &self,
        x: &[f32],
        seqs: &Seqs,
        a: Acts,
        dy: &[f32],
    ) -> Result<(Vec<f32>, Grads)> {
        let c = &self.cfg;
        let p = &self.params;
        let n = seqs.tokens();
        let (h, hk, hv, dk, dv) = (
            c.hidden_size,
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let (qk, vd, cd, pd) = (c.qk_dim(), c.v_dim(), c.conv_dim(), c.in_proj_dim());
        let eps = c.layernorm_epsilon;
        let zc = c.layernorm_zero_centered_gamma;
        let mut grads = Params::zeros_like_config(c);

        // 8. out_proj. Under gdn_norm_out its input is rebuilt here, by the same kernel on the
        // same inputs as in forward, so the bits are those forward had.
        let norm_out = match a.norm_out {
            Some(v) => v,
            None => {
                gated_norm::gated_norm_forward(
                    &a.o,
                    &a.z,
                    n * hv,
                    dv,
                    p.d("out_norm.weight"),
                    self.out_norm_bias(),
                    c.normalization,
                    eps,
                    zc,
                )?
                .0
            }
        };
        let (d_norm_out, d_wout) =
            linear::linear_backward(&norm_out, n, vd, p.d("out_proj.weight"), h, dy)?;
        drop(norm_out);
        grads.set("out_proj.weight", Tensor::from_vec(&[h, vd], d_wout)?);

        // 7. Gated norm.
        let (d_o, dz, d_onw, d_onb) = gated_norm::gated_norm_backward(
            &a.o,
            &a.z,
            n * hv,
            dv,
            p.d("out_norm.weight"),
            self.out_norm_bias(),
            c.normalization,
            zc,
            &a.o_stats,
            &d_norm_out,
        )?;
        drop(d_norm_out);
        grads.set("out_norm.weight", Tensor::from_vec(&[dv], d_onw)?);
        if let Some(b) = d_onb {
            grads.set("out_norm.bias", Tensor::from_vec(&[dv], b)?);
        }

        // 3-6 recomputed (conv + SiLU, l2norm, gates), then the rule's backward.
        let (beta_raw, alpha) = (&a.gate_in[0], &a.gate_in[1]);
        let core = match a.rule_in {
            Some(r) => r,
            None => self.prep(&a.qkv_pre, beta_raw, alpha, seqs)?,
        };
        let rg = gdr::backward(
            core.qn(),
            core.kn(),
            &core.v,
            &core.g,
            &core.beta,
            seqs,
            self.rule_shape(),
            self.rule_opts(),
            None,
            &d_o,
            None,
        )?;
        let (dq, dk_) = if core.qkn.is_some() {
            let qr = l2norm::l2norm_rstd(&core.q, n * hk, dk)?;
            let kr = l2norm::l2norm_rstd(&core.k, n * hk, dk)?;
            (
                l2norm::l2norm_backward(&core.q, n * hk, dk, &qr, &rg.dq)?,
                l2norm::l2norm_backward(&core.k, n * hk, dk, &kr, &rg.dk)?,
            )
        } else {
            (rg.dq, rg.dk)
        };
        let (dalpha, dbeta_raw, d_alog, d_dt) = gates::gates_backward(
            alpha,
            beta_raw,
            n,
            hv,
            p.d("A_log"),
            p.d("dt_bias"),
            &rg.dg,
            &rg.dbeta,
        )?;
        grads.set("A_log", Tensor::from_vec(&[hv], d_alog)?);
        grads.set("dt_bias", Tensor::from_vec(&[hv], d_dt)?);

        // 3. conv.
        let mut dqkv = vec![0.0f32; n * cd];
        put_cols(&mut dqkv, cd, 0, &dq, qk);
        put_cols(&mut dqkv, cd, qk, &dk_, qk);
        put_cols(&mut dqkv, cd, 2 * qk, &rg.dv, vd);
        let w = c.linear_conv_kernel_dim;
        let (dqkv_pre, dcw, dcb) = conv1d::conv1d_silu_backward(
            &a.qkv_pre,
            cd,
            p.d("conv1d.weight"),
            w,
            p.opt("conv1d.bias"),
            seqs,
            &dqkv,
        )?;
        drop(dqkv);
        grads.set("conv1d.weight", Tensor::from_vec(&[cd, 1, w], dcw)?);
        if let Some(b) = dcb {
            grads.set("conv1d.bias", Tensor::from_vec(&[cd], b)?);
        }

        // 2. Un-split into d(in_proj output).
        let mut dproj = vec![0.0f32; n * pd];
        put_cols(&mut dproj, pd, 0, &dqkv_pre, cd);
        put_cols(&mut dproj, pd, cd, &dz, vd);
        put_cols(&mut dproj, pd, cd + vd, &dbeta_raw, hv);
        put_cols(&mut dproj, pd, cd + vd + hv, &dalpha, hv);

        // 1. in_proj and its fused norm; the normalized input is rebuilt from x.
        let (xn, _) = norm::norm_forward(
            x,
            n,
            h,
            p.d("in_proj.layer_norm_weight"),
            self.in_norm_bias(),
            c.normalization,
            eps,
            zc,
        )?;
        let (dxn, d_win) = linear::linear_backward(&xn, n, h, p.d("in_proj.weight"), pd, &dproj)?;
        drop(xn);
        grads.set("in_proj.weight", Tensor::from_vec(&[pd, h], d_win)?);
        let (dx, d_lnw, d_lnb) = norm::norm_backward(
            x,
            n,
            h,
            p.d("in_proj.layer_norm_weight"),
            c.normalization,
            zc,
            &a.in_stats,
            &dxn,
        )?;
        grads.set("in_proj.layer_norm_weight", Tensor::from_vec(&[h], d_lnw)?);
        if c.normalization == Normalization::LayerNorm {
            let b = d_lnb.ok_or_else(|| {
                GdnError::Invalid("LayerNorm backward returned no bias gradient".into())
            })?;
            grads.set("in_proj.layer_norm_bias", Tensor::from_vec(&[h], b)?);
        }
        Ok((dx, grads))
    }
}

/// The rule's inputs, computed from in_proj's output by conv + SiLU, L2 norm and gates.
#[derive(Debug)]
pub(crate) struct RuleInputs {
    /// conv outputs: raw q, k `[n, Hk*Dk]` and v `[n, Hv*Dv]`.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Normalized q, k when the L2 norm is caller-side.
    pub qkn: Option<(Vec<f32>, Vec<f32>)>,
    /// Gates `[n, Hv]`.
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

impl RuleInputs {
    /// q as the rule receives it.
    fn qn(&self) -> &[f32] {
        self.qkn.as_ref().map_or(&self.q, |x| &x.0)
    }
    /// k as the rule receives it.
    fn kn(&self) -> &[f32] {
        self.qkn.as_ref().map_or(&self.k, |x| &x.1)
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.q.len()
            + self.k.len()
            + self.v.len()
            + self.qkn.as_ref().map_or(0, |(a, b)| a.len() + b.len())
            + self.g.len()
            + self.beta.len())
    }
}
