//! Named parameters (Megatron's keys), their shapes and Megatron's initialization.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::config::{GdnConfig, Normalization, Variant};
use crate::error::{GdnError, Result};
use crate::tensor::Tensor;

/// Parameter names and shapes of a layer with this config, in Megatron's registration order.
pub fn param_specs(cfg: &GdnConfig) -> Vec<(&'static str, Vec<usize>)> {
    let h = cfg.hidden_size;
    let mut v: Vec<(&'static str, Vec<usize>)> = vec![("in_proj.layer_norm_weight", vec![h])];
    if cfg.normalization == Normalization::LayerNorm {
        v.push(("in_proj.layer_norm_bias", vec![h]));
    }
    v.push(("in_proj.weight", vec![cfg.in_proj_dim(), h]));
    v.push((
        "conv1d.weight",
        vec![cfg.conv_dim(), 1, cfg.linear_conv_kernel_dim],
    ));
    if cfg.conv_bias {
        v.push(("conv1d.bias", vec![cfg.conv_dim()]));
    }
    let (dt, a) = match cfg.variant {
        Variant::Gdn => (cfg.linear_num_value_heads, cfg.linear_num_value_heads),
        Variant::Gdn2 => (cfg.qk_dim(), cfg.linear_num_key_heads),
    };
    v.push(("dt_bias", vec![dt]));
    v.push(("A_log", vec![a]));
    v.push(("out_norm.weight", vec![cfg.linear_value_head_dim]));
    if cfg.normalization == Normalization::LayerNorm {
        v.push(("out_norm.bias", vec![cfg.linear_value_head_dim]));
    }
    v.push(("out_proj.weight", vec![h, cfg.v_dim()]));
    v
}

/// An ordered set of named tensors: parameters, or their gradients.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Params {
    entries: Vec<(String, Tensor)>,
}

impl Params {
    /// From (name, tensor) pairs.
    pub fn from_entries(entries: Vec<(String, Tensor)>) -> Self {
        Params { entries }
    }
    /// Zeros with the shapes of `cfg`'s parameters. Validates `cfg` and refuses, before
    /// allocating, parameters that need more memory than the machine has
    /// ([`crate::budget::check_host`]); an allocation the allocator still refuses is an error,
    /// not an abort.
    pub fn zeros_like_config(cfg: &GdnConfig) -> Result<Self> {
        cfg.validate()?;
        crate::budget::check_host(&cfg.describe_params(), cfg.param_bytes())?;
        let entries = param_specs(cfg)
            .into_iter()
            .map(|(n, s)| {
                let numel = s.iter().product::<usize>();
                let data = crate::budget::try_zeros(&format!("parameter {n} {s:?}"), numel)?;
                Ok((n.to_string(), Tensor::from_vec(&s, data)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Params { entries })
    }
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
    /// The tensor called `name`, mutably.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        self.entries
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }
    /// The tensor called `name`, or an error naming it (for required parameters).
    pub fn req(&self, name: &str) -> Result<&Tensor> {
        self.get(name)
            .ok_or_else(|| GdnError::Invalid(format!("missing parameter {name}")))
    }
    /// Data of `name` (panics if absent: only for names guaranteed by `param_specs`).
    pub(crate) fn d(&self, name: &str) -> &[f32] {
        self.get(name)
            .unwrap_or_else(|| panic!("parameter {name} present by construction"))
            .data()
    }
    /// Data of `name` if present.
    pub(crate) fn opt(&self, name: &str) -> Option<&[f32]> {
        self.get(name).map(|t| t.data())
    }
    /// Iterate (name, tensor) in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.entries.iter().map(|(n, t)| (n.as_str(), t))
    }
    /// Iterate mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut Tensor)> {
        self.entries.iter_mut().map(|(n, t)| (n.as_str(), t))
    }
    /// Names in order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|(n, _)| n.as_str()).collect()
    }
    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.entries.iter().map(|(_, t)| t.numel()).sum()
    }
    /// Set `name` (replacing), keeping order for existing names.
    pub fn set(&mut self, name: &str, t: Tensor) {
        match self.get_mut(name) {
            Some(x) => *x = t,
            None => self.entries.push((name.to_string(), t)),
        }
    }

    /// Check that exactly the parameters of `cfg` are present with their shapes.
    pub fn check_against(&self, cfg: &GdnConfig, source: &str) -> Result<()> {
        let specs = param_specs(cfg);
        for (name, shape) in &specs {
            match self.get(name) {
                None => {
                    return Err(GdnError::File {
                        path: source.to_string(),
                        msg: format!("missing tensor {name} (shape {shape:?})"),
                    })
                }
                Some(t) if t.shape() != shape.as_slice() => {
                    return Err(GdnError::File {
                        path: source.to_string(),
                        msg: format!(
                            "tensor {name} has shape {:?}, expected {shape:?}",
                            t.shape()
                        ),
                    })
                }
                _ => {}
            }
        }
        for (name, _) in &self.entries {
            if !specs.iter().any(|(n, _)| n == name) {
                return Err(GdnError::File {
                    path: source.to_string(),
                    msg: format!(
                        "unexpected tensor {name}: this config's parameters are {:?}",
                        specs.iter().map(|(n, _)| *n).collect::<Vec<_>>()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Megatron's initialization, deterministic from `seed`. Errors as
    /// [`zeros_like_config`](Self::zeros_like_config): an invalid config, or parameters larger
    /// than the memory there is (stating the bytes needed and available).
    pub fn init(cfg: &GdnConfig, seed: u64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut p = Params::zeros_like_config(cfg)?;
        let norm_one = if cfg.layernorm_zero_centered_gamma {
            0.0
        } else {
            1.0
        };
        let normal = |rng: &mut ChaCha8Rng, t: &mut Tensor, std: f32| {
            let d = Normal::new(0.0f32, std.max(0.0)).expect("finite std");
            t.data_mut()
                .iter_mut()
                .for_each(|x| *x = if std > 0.0 { d.sample(rng) } else { 0.0 });
        };
        let uniform = |rng: &mut ChaCha8Rng, t: &mut Tensor, lo: f32, hi: f32| {
            t.data_mut()
                .iter_mut()
                .for_each(|x| *x = if hi > lo { rng.gen_range(lo..hi) } else { lo });
        };
        let w = cfg.linear_conv_kernel_dim as f32;
        let bound = 1.0 / w.sqrt();
        for (name, t) in p.iter_mut() {
            match name {
                "in_proj.layer_norm_weight" | "out_norm.weight" => t.data_mut().fill(norm_one),
                "in_proj.layer_norm_bias" | "out_norm.bias" => t.data_mut().fill(0.0),
                "in_proj.weight" => normal(&mut rng, t, cfg.init_method_std),
                "conv1d.weight" | "conv1d.bias" => uniform(&mut rng, t, -bound, bound),
                "dt_bias" => match cfg.variant {
                    Variant::Gdn => t.data_mut().fill(1.0),
                    Variant::Gdn2 => {
                        // inverse softplus of dt ~ exp(U(ln 1e-3, ln 0.1)), dt >= 1e-4
                        let (lo, hi) = (1e-3f64.ln(), 0.1f64.ln());
                        t.data_mut().iter_mut().for_each(|x| {
                            let dt = rng.gen_range(lo..hi).exp().max(1e-4);
                            *x = (dt + (-(-dt).exp_m1()).ln()) as f32;
                        });
                    }
                },
                "A_log" => {
                    let (lo, hi) = cfg.a_init_range;
                    t.data_mut()
                        .iter_mut()
                        .for_each(|x| *x = if hi > lo { rng.gen_range(lo..hi) } else { lo }.ln());
                }
                "out_proj.weight" => normal(
                    &mut rng,
                    t,
                    cfg.init_method_std / (2.0 * cfg.num_layers as f32).sqrt(),
                ),
                _ => unreachable!("param_specs names only these"),
            }
        }
        Ok(p)
    }
}
