//! AdamW (decoupled weight decay, PyTorch's update), the learning-rate schedule (linear warmup,
//! then cosine / linear / constant, Megatron's `OptimizerParamScheduler`) and clipping by global
//! norm. Master weights and the moments are f32; the norm is summed in f64 in parameter order,
//! so every step is deterministic.

use crate::error::{GdnError, Result};
use crate::model::{Model, ModelGrads};
use crate::ops::adamw;
use crate::tensor::Tensor;
use crate::train::config::{DecayStyle, OptimizerConfig};

/// Learning rate of update `step` (1-based): `lr * step / warmup` during the warmup, then the
/// decay from `lr` to `min_lr` over `(warmup, decay_iters]`, `min_lr` after (and right after
/// the warmup when `decay_iters <= warmup`).
pub fn lr_at(o: &OptimizerConfig, decay_iters: u64, step: u64) -> f64 {
    let warm = o.lr_warmup_iters;
    if warm > 0 && step <= warm {
        return o.lr * step as f64 / warm as f64;
    }
    if o.lr_decay_style == DecayStyle::Constant {
        return o.lr;
    }
    if step > decay_iters || decay_iters <= warm {
        return o.min_lr;
    }
    let ratio = (step - warm) as f64 / (decay_iters - warm) as f64;
    let coeff = match o.lr_decay_style {
        DecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
        DecayStyle::Linear => 1.0 - ratio,
        DecayStyle::Constant => 1.0,
    };
    o.min_lr + coeff * (o.lr - o.min_lr)
}

/// Global L2 norm of all gradients (f64, in parameter order).
pub fn global_norm(g: &ModelGrads) -> f64 {
    g.iter()
        .map(|(_, t)| adamw::cpu::sum_squares(t.data()))
        .sum::<f64>()
        .sqrt()
}

/// Scale the gradients so their global norm is at most `max_norm` (Megatron's / PyTorch's
/// `clip_grad_norm_`: factor `max_norm / (norm + 1e-6)` when below 1). Returns the norm before
/// clipping; a non-finite norm is an error (the step would poison the weights).
pub fn clip_grad_norm(g: &mut ModelGrads, max_norm: f64, step: u64) -> Result<f64> {
    let norm = global_norm(g);
    if !norm.is_finite() {
        let bad = g
            .iter()
            .find(|(_, t)| t.data().iter().any(|x| !x.is_finite()))
            .map_or("?".to_string(), |(n, _)| n.to_string());
        return Err(GdnError::Invalid(format!(
            "step {step}: the gradient norm is {norm} (first non-finite gradient: {bad}); \
             training diverged, try a lower optimizer.lr or clip_grad"
        )));
    }
    if let Some(c) = clip_scale(max_norm, norm) {
        for (_, t) in g.iter_mut() {
            t.data_mut().iter_mut().for_each(|x| *x *= c);
        }
    }
    Ok(norm)
}

/// The scalars of AdamW update `t` (1-based) with learning rate `lr`: bias corrections in f64,
/// then f32 as the update uses them; weight decay `lr * weight_decay` for matrices (`matrix`),
/// none for vectors; `grad_scale` the clipping factor, if any.
pub fn hyper(
    o: &OptimizerConfig,
    t: u64,
    lr: f64,
    matrix: bool,
    grad_scale: Option<f32>,
) -> adamw::Hyper {
    let t = t as i32;
    let bc1 = 1.0 - o.adam_beta1.powi(t);
    let bc2 = 1.0 - o.adam_beta2.powi(t);
    adamw::Hyper {
        b1: o.adam_beta1 as f32,
        b2: o.adam_beta2 as f32,
        step_size: (lr / bc1) as f32,
        bc2_sqrt: bc2.sqrt() as f32,
        eps: o.adam_eps as f32,
        wd: if matrix {
            (lr * o.weight_decay) as f32
        } else {
            0.0
        },
        grad_scale,
    }
}

/// The factor clipping by global norm multiplies the gradients by: `max_norm / (norm + 1e-6)`
/// (as f32) when `max_norm > 0` and that is below 1, else `None`.
pub fn clip_scale(max_norm: f64, norm: f64) -> Option<f32> {
    if max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            return Some(coef as f32);
        }
    }
    None
}

/// AdamW's state: first and second moments per parameter (PyTorch's `exp_avg`, `exp_avg_sq`),
/// in the model's parameter order, and the number of updates taken.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub(crate) names: Vec<String>,
    pub(crate) exp_avg: Vec<Tensor>,
    pub(crate) exp_avg_sq: Vec<Tensor>,
    pub(crate) steps: u64,
}

impl AdamW {
    /// Zero moments for `model`'s parameters.
    pub fn new(model: &Model) -> Self {
        let (mut names, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        model.for_each_param(|n, t| {
            names.push(n.to_string());
            m.push(Tensor::zeros(t.shape()));
            v.push(Tensor::zeros(t.shape()));
        });
        AdamW {
            names,
            exp_avg: m,
            exp_avg_sq: v,
            steps: 0,
        }
    }

    /// Updates taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One AdamW update of every parameter with learning rate `lr`:
    /// `p -= lr wd p` (matrices only), `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g^2`,
    /// `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
    pub fn update(
        &mut self,
        model: &mut Model,
        grads: &ModelGrads,
        o: &OptimizerConfig,
        lr: f64,
    ) -> Result<()> {
        self.steps += 1;
        let h = hyper(o, self.steps, lr, false, None);
        let (b1, b2, step_size, bc2_sqrt, eps) = (h.b1, h.b2, h.step_size, h.bc2_sqrt, h.eps);
        let decay = hyper(o, self.steps, lr, true, None).wd;
        let mut i = 0;
        let mut err = None;
        model.for_each_param_mut(|name, p| {
            if err.is_some() {
                return;
            }
            let g = match grads.get(name) {
                Some(g) if g.shape() == p.shape() && self.names[i] == name => g,
                _ => {
                    err = Some(GdnError::Invalid(format!(
                        "optimizer: no gradient of shape {:?} for parameter {name}",
                        p.shape()
                    )));
                    return;
                }
            };
            let h = adamw::Hyper {
                b1,
                b2,
                step_size,
                bc2_sqrt,
                eps,
                wd: if p.shape().len() >= 2 { decay } else { 0.0 },
                grad_scale: None,
            };
            if let Err(e) = adamw::cpu::step(
                p.data_mut(),
                self.exp_avg[i].data_mut(),
                self.exp_avg_sq[i].data_mut(),
                g.data(),
                &h,
            ) {
                err = Some(e);
                return;
            }
            i += 1;
        });
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
