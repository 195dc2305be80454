//! The GDN layer base (Megatron's `_GDNBase`) with its two variants, Gated DeltaNet and
//! Gated DeltaNet-2. Forward goes top to bottom in Megatron's order; backward bottom to top.
//!
//! ```text
//! x -> RMSNorm/LayerNorm -> in_proj -> [q|k|v | z | gate sections]
//!   [q|k|v] -> causal depthwise conv1d + SiLU -> q, k (L2 norm per head), v
//!   gates:  GDN   g = -exp(A_log) softplus(alpha + dt_bias), beta = sigmoid(b)   [per value head]
//!           GDN2  g = -exp(A_log[head]) softplus(f + dt_bias[channel]),          [per key channel]
//!                 b = sigmoid(.) [per key channel], w = sigmoid(.) [per value channel]
//!   o = gated delta rule (GDN) / GDN2 rule over q, k, v and the gates
//!   y = out_proj(norm(o) * silu(z))
//! ```

use std::ops::Deref;

use crate::config::{GdnConfig, Normalization, Variant};
use crate::error::{GdnError, Result};
use crate::layer::saved::Acts;
use crate::layer::{Grads, Params, Saved};
use crate::ops::gated_delta_rule::{self as gdr, RuleOpts, RuleShape};
use crate::ops::gdn2_rule;
use crate::ops::{conv1d, gated_norm, gates, l2norm, linear, norm};
use crate::seqs::Seqs;
use crate::tensor::{put_cols, take_cols, Tensor};

/// One GDN layer: Gated DeltaNet (`variant = "gdn"`) or Gated DeltaNet-2 (`variant = "gdn2"`),
/// chosen by the config. [`GatedDeltaNet2`] is the same layer, constructed only for GDN2.
#[derive(Clone, Debug)]
pub struct GatedDeltaNet {
    cfg: GdnConfig,
    params: Params,
}

/// Gated DeltaNet-2: the base layer, accepting only `variant = "gdn2"`.
#[derive(Clone, Debug)]
pub struct GatedDeltaNet2(GatedDeltaNet);

impl GatedDeltaNet2 {
    /// A GDN2 layer with Megatron's initialization from `seed`.
    pub fn new(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        Self::require(cfg)?;
        Ok(GatedDeltaNet2(GatedDeltaNet::new(cfg, seed)?))
    }
    /// A GDN2 layer with given parameters.
    pub fn with_params(cfg: &GdnConfig, params: Params) -> Result<Self> {
        Self::require(cfg)?;
        Ok(GatedDeltaNet2(GatedDeltaNet::with_params(cfg, params)?))
    }
    fn require(cfg: &GdnConfig) -> Result<()> {
        if cfg.variant != Variant::Gdn2 {
            return Err(GdnError::config(
                "variant",
                "GatedDeltaNet2 needs variant = \"gdn2\"",
            ));
        }
        Ok(())
    }
    /// The base layer.
    pub fn into_inner(self) -> GatedDeltaNet {
        self.0
    }
}

impl Deref for GatedDeltaNet2 {
    type Target = GatedDeltaNet;
    fn deref(&self) -> &GatedDeltaNet {
        &self.0
    }
}

/// Per-step wall times, printed to stderr when the environment variable `GDN_PROFILE` is set.
struct Prof {
    on: bool,
    last: std::time::Instant,
    rows: Vec<(&'static str, f64)>,
}

impl Prof {
    fn new() -> Self {
        Prof { on: std::env::var_os("GDN_PROFILE").is_some(), last: std::time::Instant::now(), rows: Vec::new() }
    }
    fn mark(&mut self, step: &'static str) {
        if self.on {
            let now = std::time::Instant::now();
            self.rows.push((step, (now - self.last).as_secs_f64() * 1e3));
            self.last = now;
        }
    }
    fn report(&self) {
        if self.on {
            let total: f64 = self.rows.iter().map(|r| r.1).sum();
            for (step, ms) in &self.rows {
                eprintln!("gdn profile: {step:<45} {ms:9.2} ms");
            }
            eprintln!("gdn profile: {:<45} {total:9.2} ms", "total");
        }
    }
}

/// Forward output.
struct Forward {
    y: Vec<f32>,
    final_state: Option<Vec<f32>>,
    acts: Acts,
}

/// The gates as the rule receives them.
#[derive(Debug)]
pub(crate) enum Gates {
    /// `g`, `beta` `[n, Hv]`.
    Gdn { g: Vec<f32>, beta: Vec<f32> },
    /// `g`, `b` `[n, Hv, Dk]` (key-channel gates repeated to the value heads), `w` `[n, Hv*Dv]`;
    /// plus the key-channel erase gate `[n, Hk*Dk]` before the repeat (its sigmoid backward).
    Gdn2 {
        g: Vec<f32>,
        b: Vec<f32>,
        w: Vec<f32>,
        b_key: Vec<f32>,
    },
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
    pub gates: Gates,
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
        let gates = match &self.gates {
            Gates::Gdn { g, beta } => g.len() + beta.len(),
            Gates::Gdn2 { g, b, w, b_key } => g.len() + b.len() + w.len() + b_key.len(),
        };
        4 * (self.q.len()
            + self.k.len()
            + self.v.len()
            + self.qkn.as_ref().map_or(0, |(a, b)| a.len() + b.len())
            + gates)
    }
}

/// Repeat key-head rows `[n, Hk, D]` to value heads `[n, Hv, D]` (value head j reads key head
/// j / (Hv/Hk)).
fn repeat_heads(x: &[f32], n: usize, hk: usize, hv: usize, d: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = Vec::with_capacity(n * hv * d);
    for t in 0..n {
        for j in 0..hv {
            let o = (t * hk + j / r) * d;
            out.extend_from_slice(&x[o..o + d]);
        }
    }
    out
}

/// Sum value-head rows `[n, Hv, D]` back to key heads `[n, Hk, D]`, the group in head order.
fn sum_heads(x: &[f32], n: usize, hk: usize, hv: usize, d: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = vec![0.0f32; n * hk * d];
    for t in 0..n {
        for j in 0..hv {
            let (src, dst) = ((t * hv + j) * d, (t * hk + j / r) * d);
            for c in 0..d {
                out[dst + c] += x[src + c];
            }
        }
    }
    out
}

impl GatedDeltaNet {
    /// A layer with Megatron's initialization from `seed`. Validates `cfg`.
    pub fn new(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        Ok(GatedDeltaNet {
            cfg: cfg.clone(),
            params: Params::init(cfg, seed),
        })
    }
    /// A layer with given parameters (checked against `cfg`: names and shapes).
    pub fn with_params(cfg: &GdnConfig, params: Params) -> Result<Self> {
        cfg.validate()?;
        params.check_against(cfg, "parameters")?;
        Ok(GatedDeltaNet {
            cfg: cfg.clone(),
            params,
        })
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
        let (y, _, saved) = self.forward_seqs(x, Seqs::uniform(b, t), None, false)?;
        Ok((y, saved))
    }

    /// Training forward over packed sequences: `x` `[1, T, hidden]` or `[T, hidden]`, with
    /// `cu_seqlens` boundaries in `seqs` (conv history and recurrent state restart at each);
    /// rows after the last boundary are padding (zero output, zero gradient).
    pub fn forward_packed(&self, x: &Tensor, seqs: &Seqs) -> Result<(Tensor, Saved)> {
        let (y, _, saved) = self.forward_with_state(x, seqs, None)?;
        Ok((y, saved))
    }

    /// Training forward with per-sequence recurrent states: `initial_state` `[N, Hv, Dk, Dv]`
    /// (zeros when `None`), returns `y`, the final states `[N, Hv, Dk, Dv]` and what backward
    /// needs. `x` is `[B, T, hidden]` with `seqs = Seqs::uniform(B, T)`, or packed as in
    /// [`forward_packed`](Self::forward_packed).
    pub fn forward_with_state(
        &self,
        x: &Tensor,
        seqs: &Seqs,
        initial_state: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Saved)> {
        let rows = match x.shape() {
            &[b, t, h] if h == self.cfg.hidden_size => b * t,
            &[t, h] if h == self.cfg.hidden_size => t,
            s => {
                return Err(GdnError::shape(
                    "x",
                    s,
                    format!("[B, T, {0}] or [T, {0}]", self.cfg.hidden_size),
                ))
            }
        };
        if seqs.tokens() != rows {
            return Err(GdnError::CuSeqlens(format!(
                "describes {} rows but x has {rows} tokens",
                seqs.tokens()
            )));
        }
        if x.shape().len() == 3
            && x.shape()[0] != 1
            && *seqs != Seqs::uniform(x.shape()[0], x.shape()[1])
        {
            return Err(GdnError::shape(
                "x",
                x.shape(),
                "batch 1 ([1, T, hidden] or [T, hidden]) for packed sequences, as Megatron's THD format",
            ));
        }
        let st = self.state_shape(seqs);
        if let Some(h0) = initial_state {
            h0.expect_shape("initial_state", &st)?;
        }
        let (y, fin, saved) =
            self.forward_seqs(x, seqs.clone(), initial_state.map(|t| t.data()), true)?;
        let fin = fin.ok_or_else(|| GdnError::Invalid("final state was not produced".into()))?;
        Ok((y, Tensor::from_vec(&st, fin)?, saved))
    }

    /// Inference forward: keeps nothing for backward (recompute settings do not apply).
    pub fn forward_inference(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = self.batch_dims(x)?;
        let f = self.run_forward(x.data(), &Seqs::uniform(b, t), None, false)?;
        Tensor::from_vec(x.shape(), f.y)
    }

    /// Shape of the recurrent states of `seqs`: `[N, Hv, Dk, Dv]`.
    pub fn state_shape(&self, seqs: &Seqs) -> Vec<usize> {
        let c = &self.cfg;
        vec![
            seqs.count(),
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        ]
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

    fn forward_seqs(
        &self,
        x: &Tensor,
        seqs: Seqs,
        h0: Option<&[f32]>,
        want_final: bool,
    ) -> Result<(Tensor, Option<Vec<f32>>, Saved)> {
        let rc = self.cfg.recompute();
        let f = self.run_forward(x.data(), &seqs, h0, want_final)?;
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
            h0: h0.map(|h| h.to_vec()),
            acts: (!rc.whole_layer).then_some(acts),
        };
        Ok((y, f.final_state, saved))
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
    /// Widths of in_proj's gate sections after `[q|k|v|z]`: GDN `[beta | alpha]`, GDN2 `[f | b | w]`.
    fn gate_sections(&self) -> Vec<usize> {
        let c = &self.cfg;
        match c.variant {
            Variant::Gdn => vec![c.linear_num_value_heads, c.linear_num_value_heads],
            Variant::Gdn2 => vec![c.qk_dim(), c.qk_dim(), c.v_dim()],
        }
    }

    /// The layer, top to bottom (Megatron's `GatedDeltaNet.forward`).
    fn run_forward(
        &self,
        x: &[f32],
        seqs: &Seqs,
        h0: Option<&[f32]>,
        want_final: bool,
    ) -> Result<Forward> {
        let c = &self.cfg;
        let p = &self.params;
        let n = seqs.tokens();
        let (h, hv, dv) = (
            c.hidden_size,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let (vd, cd, pd) = (c.v_dim(), c.conv_dim(), c.in_proj_dim());
        let eps = c.layernorm_epsilon;
        let zc = c.layernorm_zero_centered_gamma;

        let mut prof = Prof::new();
        // 1. Fused pre-norm + in_proj -> [q | k | v | z | gate sections].
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
        let proj = linear::linear_forward(&xn, n, h, p.d("in_proj.weight"), pd)?;
        drop(xn);
        prof.mark("fwd in_proj (norm + GEMM)");
        // 2. Split.
        let qkv_pre = take_cols(&proj, pd, 0, cd);
        let z = take_cols(&proj, pd, cd, vd);
        let mut gate_in = Vec::new();
        let mut off = cd + vd;
        for w in self.gate_sections() {
            gate_in.push(take_cols(&proj, pd, off, w));
            off += w;
        }
        drop(proj);
        // 3-5. conv + SiLU, q/k L2 norm, gates.
        let r = self.prep(&qkv_pre, &gate_in, seqs)?;
        prof.mark("fwd split + conv + l2norm + gates");
        // 6. The rule.
        let (o, final_state) = self.rule_forward(&r, seqs, h0, want_final)?;
        prof.mark("fwd gated delta rule");
        // Keep the rule's inputs (Megatron keeps these), unless `gdn_prep` rebuilds them.
        let rule_in = (!c.recompute().prep).then_some(r);
        // 7. Gated norm: norm(o) * silu(z) (norm first, then gate), one [Dv] weight for all heads.
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
        prof.mark("fwd gated norm");
        // 8. out_proj.
        let y = linear::linear_forward(&norm_out, n, vd, p.d("out_proj.weight"), h)?;
        prof.mark("fwd out_proj");
        prof.report();
        Ok(Forward {
            y,
            final_state,
            acts: Acts {
                in_stats,
                qkv_pre,
                z,
                gate_in,
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
    fn prep(&self, qkv_pre: &[f32], gate_in: &[Vec<f32>], seqs: &Seqs) -> Result<RuleInputs> {
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
        let gates = match c.variant {
            Variant::Gdn => {
                let (g, beta) = gates::gates_forward(
                    &gate_in[1],
                    &gate_in[0],
                    n,
                    hv,
                    p.d("A_log"),
                    p.d("dt_bias"),
                )?;
                Gates::Gdn { g, beta }
            }
            Variant::Gdn2 => {
                let g_key =
                    gates::gates2_forward(&gate_in[0], n, hk, dk, p.d("A_log"), p.d("dt_bias"))?;
                let b_key = gates::sigmoid_forward(&gate_in[1]);
                let w = gates::sigmoid_forward(&gate_in[2]);
                Gates::Gdn2 {
                    g: repeat_heads(&g_key, n, hk, hv, dk),
                    b: repeat_heads(&b_key, n, hk, hv, dk),
                    w,
                    b_key,
                }
            }
        };
        Ok(RuleInputs {
            q,
            k,
            v,
            qkn,
            gates,
        })
    }

    fn rule_forward(
        &self,
        r: &RuleInputs,
        seqs: &Seqs,
        h0: Option<&[f32]>,
        want_final: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let (s, o) = (self.rule_shape(), self.rule_opts());
        match &r.gates {
            Gates::Gdn { g, beta } => {
                gdr::forward(r.qn(), r.kn(), &r.v, g, beta, seqs, s, o, h0, want_final)
            }
            Gates::Gdn2 { g, b, w, .. } => {
                gdn2_rule::forward(r.qn(), r.kn(), &r.v, g, b, w, seqs, s, o, h0, want_final)
            }
        }
    }

    /// Backward: consumes what forward saved, returns `dx` (shape of `x`) and parameter grads
    /// under the parameters' names.
    pub fn backward(&self, saved: Saved, dy: &Tensor) -> Result<(Tensor, Grads)> {
        let (dx, g, _) = self.backward_with_state(saved, dy, None)?;
        Ok((dx, g))
    }

    /// Backward with the gradient of the final states (`[N, Hv, Dk, Dv]`, zeros when `None`);
    /// also returns the gradient of the initial states when forward was given them.
    pub fn backward_with_state(
        &self,
        saved: Saved,
        dy: &Tensor,
        d_final_state: Option<&Tensor>,
    ) -> Result<(Tensor, Grads, Option<Tensor>)> {
        if dy.shape() != saved.x_shape.as_slice() {
            return Err(GdnError::shape(
                "dy",
                dy.shape(),
                format!("{:?} (the shape of x)", saved.x_shape),
            ));
        }
        let st = self.state_shape(&saved.seqs);
        if let Some(d) = d_final_state {
            d.expect_shape("d_final_state", &st)?;
        }
        let Saved {
            seqs,
            x_shape,
            x,
            h0,
            acts,
        } = saved;
        let acts = match acts {
            Some(a) => a,
            // Whole-layer recompute: rerun forward, keeping everything this time.
            None => self.run_forward(&x, &seqs, h0.as_deref(), false)?.acts,
        };
        let (dx, grads, dh0) = self.run_backward(
            &x,
            &seqs,
            h0.as_deref(),
            acts,
            dy.data(),
            d_final_state.map(|t| t.data()),
        )?;
        let dh0 = match dh0 {
            Some(d) => Some(Tensor::from_vec(&st, d)?),
            None => None,
        };
        Ok((Tensor::from_vec(&x_shape, dx)?, grads, dh0))
    }

    /// The layer, bottom to top.
    #[allow(clippy::type_complexity)]
    fn run_backward(
        &self,
        x: &[f32],
        seqs: &Seqs,
        h0: Option<&[f32]>,
        a: Acts,
        dy: &[f32],
        d_final: Option<&[f32]>,
    ) -> Result<(Vec<f32>, Grads, Option<Vec<f32>>)> {
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

        let mut prof = Prof::new();
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

        prof.mark("bwd out_proj (+ norm_out rebuild)");
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

        prof.mark("bwd gated norm");
        // 6. The rule (its inputs kept, or rebuilt under gdn_prep), then 5. gates and 4. L2 norm.
        let r = match a.rule_in {
            Some(r) => r,
            None => self.prep(&a.qkv_pre, &a.gate_in, seqs)?,
        };
        let (s, o) = (self.rule_shape(), self.rule_opts());
        let gi = &a.gate_in;
        let (dq, dk_, dv_, d_gate_in, dh0) = match &r.gates {
            Gates::Gdn { g, beta } => {
                let rg =
                    gdr::backward(r.qn(), r.kn(), &r.v, g, beta, seqs, s, o, h0, &d_o, d_final)?;
                let (dalpha, dbeta_raw, d_alog, d_dt) = gates::gates_backward(
                    &gi[1],
                    &gi[0],
                    n,
                    hv,
                    p.d("A_log"),
                    p.d("dt_bias"),
                    &rg.dg,
                    &rg.dbeta,
                )?;
                grads.set("A_log", Tensor::from_vec(&[hv], d_alog)?);
                grads.set("dt_bias", Tensor::from_vec(&[hv], d_dt)?);
                (rg.dq, rg.dk, rg.dv, vec![dbeta_raw, dalpha], rg.dh0)
            }
            Gates::Gdn2 { g, b, w, b_key } => {
                let rg = gdn2_rule::backward(
                    r.qn(),
                    r.kn(),
                    &r.v,
                    g,
                    b,
                    w,
                    seqs,
                    s,
                    o,
                    h0,
                    &d_o,
                    d_final,
                )?;
                // The key-channel gates were repeated to the value heads: sum their gradients back.
                let dg_key = sum_heads(&rg.dg, n, hk, hv, dk);
                let db_key = sum_heads(&rg.db, n, hk, hv, dk);
                let (df, d_alog, d_dt) = gates::gates2_backward(
                    &gi[0],
                    n,
                    hk,
                    dk,
                    p.d("A_log"),
                    p.d("dt_bias"),
                    &dg_key,
                )?;
                grads.set("A_log", Tensor::from_vec(&[hk], d_alog)?);
                grads.set("dt_bias", Tensor::from_vec(&[qk], d_dt)?);
                let db_raw = gates::sigmoid_backward(b_key, &db_key);
                let dw_raw = gates::sigmoid_backward(w, &rg.dw);
                (rg.dq, rg.dk, rg.dv, vec![df, db_raw, dw_raw], rg.dh0)
            }
        };
        let (dq, dk_) = match &r.qkn {
            Some(_) => {
                let qr = l2norm::l2norm_rstd(&r.q, n * hk, dk)?;
                let kr = l2norm::l2norm_rstd(&r.k, n * hk, dk)?;
                (
                    l2norm::l2norm_backward(&r.q, n * hk, dk, &qr, &dq)?,
                    l2norm::l2norm_backward(&r.k, n * hk, dk, &kr, &dk_)?,
                )
            }
            None => (dq, dk_),
        };
        drop(r);

        prof.mark("bwd rule (+ prep rebuild) + gates + l2norm");
        // 3. conv.
        let mut dqkv = vec![0.0f32; n * cd];
        put_cols(&mut dqkv, cd, 0, &dq, qk);
        put_cols(&mut dqkv, cd, qk, &dk_, qk);
        put_cols(&mut dqkv, cd, 2 * qk, &dv_, vd);
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

        prof.mark("bwd conv");
        // 2. Un-split into d(in_proj output).
        let mut dproj = vec![0.0f32; n * pd];
        put_cols(&mut dproj, pd, 0, &dqkv_pre, cd);
        put_cols(&mut dproj, pd, cd, &dz, vd);
        let mut off = cd + vd;
        for (d, w) in d_gate_in.iter().zip(self.gate_sections()) {
            put_cols(&mut dproj, pd, off, d, w);
            off += w;
        }

        prof.mark("bwd un-split");
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
        drop(dproj);
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
        prof.mark("bwd in_proj (GEMMs + norm)");
        prof.report();
        Ok((dx, grads, dh0))
    }
}
