//! Inference of the model with cached states: one [`CachePool`] per GDN layer (the model is
//! attention-free, so the GDN layers' states and conv rows are all it caches), addressed by slot
//! indices as the layer's (`-1`: padding).
//!
//! - [`Model::prefill`]: packed prompts (`cu_seqlens`), sequence `i` starting afresh in slot
//!   `slots[i]`; returns the logits of each sequence's last token.
//! - [`Model::extend`]: the same, continuing the slots.
//! - [`Model::decode`]: one token per row; returns each row's logits.
//!
//! Everything a caller passes (token ids, slots, lengths, the cache's layers and shapes) is
//! checked before the first layer writes its pool, so an error leaves the cache as it was. The
//! model runs where it is (CPU, or wholly on one GPU after [`Model::to_device`]); the logits are
//! the one download.

use super::*;
use crate::layer::CachePool;
use crate::ops::decode;

/// The model's cache: one pool per GDN layer, all with the same number of slots.
#[derive(Debug)]
pub struct ModelCache {
    pools: Vec<CachePool>,
    slots: usize,
}

impl ModelCache {
    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Bytes held (every layer's states and conv rows).
    pub fn bytes(&self) -> usize {
        self.pools.iter().map(CachePool::bytes).sum()
    }
    /// The pool of GDN layer `i`.
    pub fn layer(&self, i: usize) -> Option<&CachePool> {
        self.pools.get(i)
    }
}

impl Model {
    /// An empty cache of `slots` slots for every GDN layer, where the model runs (fp32 states).
    pub fn cache(&self, slots: usize) -> Result<ModelCache> {
        self.cache_with(slots, DType::F32)
    }

    /// [`cache`](Self::cache) with the states in `state_dtype` storage (bf16: a GPU option, see
    /// [`GatedDeltaNet::cache_pool_with`](crate::GatedDeltaNet::cache_pool_with)).
    pub fn cache_with(&self, slots: usize, state_dtype: DType) -> Result<ModelCache> {
        self.check_infer_device()?;
        let pools = self
            .layers
            .iter()
            .map(|l| l.cache_pool_with(slots, state_dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelCache { pools, slots })
    }

    /// Prefill: the forward over packed prompts `tokens` (`seqs` boundaries), sequence `i`
    /// starting afresh and cached in slot `slots[i]` (`-1`: computed, not kept). Returns the
    /// logits `[seqs.count(), vocab]` of each sequence's last token (a zero row for an empty
    /// sequence).
    pub fn prefill(
        &self,
        tokens: &[u32],
        seqs: &Seqs,
        slots: &[i32],
        cache: &mut ModelCache,
    ) -> Result<Vec<f32>> {
        self.extend_impl(tokens, seqs, slots, cache, true)
    }

    /// As [`prefill`](Self::prefill), sequence `i` continuing slot `slots[i]`.
    pub fn extend(
        &self,
        tokens: &[u32],
        seqs: &Seqs,
        slots: &[i32],
        cache: &mut ModelCache,
    ) -> Result<Vec<f32>> {
        self.extend_impl(tokens, seqs, slots, cache, false)
    }

    /// Decode one token per row, row `i` continuing slot `slots[i]`; returns the logits
    /// `[N, vocab]` (rows of padding slots are not meaningful).
    pub fn decode(
        &self,
        tokens: &[u32],
        slots: &[i32],
        cache: &mut ModelCache,
    ) -> Result<Vec<f32>> {
        if tokens.len() != slots.len() {
            return Err(GdnError::Invalid(format!(
                "{} tokens for {} slots: decode takes one token per slot",
                tokens.len(),
                slots.len()
            )));
        }
        self.check_infer(tokens, slots, cache)?;
        let pick: Vec<(i32, i32)> = (0..tokens.len() as i32).map(|i| (i, i)).collect();
        self.run_infer(tokens, &pick, cache, |l, x, pool| {
            l.decode_slots_act(x, slots, pool)
        })
    }

    fn extend_impl(
        &self,
        tokens: &[u32],
        seqs: &Seqs,
        slots: &[i32],
        cache: &mut ModelCache,
        fresh: bool,
    ) -> Result<Vec<f32>> {
        if seqs.tokens() != tokens.len() {
            return Err(GdnError::CuSeqlens(format!(
                "describes {} tokens but {} were given",
                seqs.tokens(),
                tokens.len()
            )));
        }
        if slots.len() != seqs.count() {
            return Err(GdnError::Invalid(format!(
                "{} slots for {} sequences",
                slots.len(),
                seqs.count()
            )));
        }
        self.check_infer(tokens, slots, cache)?;
        let pick: Vec<(i32, i32)> = (0..seqs.count())
            .map(|i| {
                let r = seqs.range(i);
                if r.is_empty() {
                    (-1, i as i32)
                } else {
                    (r.end as i32 - 1, i as i32)
                }
            })
            .collect();
        self.run_infer(tokens, &pick, cache, |l, x, pool| {
            l.extend_slots_act(x, seqs, slots, pool, fresh)
        })
    }

    /// The model and its GDN layers run in one place (not `gdn_layers_to_device`'s split).
    fn check_infer_device(&self) -> Result<()> {
        if self.layers.iter().any(|l| l.device() != self.device()) {
            return Err(GdnError::Invalid(
                "inference needs the whole model in one place (Model::to_device), not only its GDN layers on a GPU"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Everything checked before the first write: ids in the vocabulary, slots, the cache's
    /// layers.
    fn check_infer(&self, tokens: &[u32], slots: &[i32], cache: &ModelCache) -> Result<()> {
        self.check_infer_device()?;
        let v = self.cfg.vocab_size;
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= v) {
            return Err(GdnError::Invalid(format!(
                "tokens[{i}] = {t}: expected a token id in [0, {v})"
            )));
        }
        if cache.pools.len() != self.layers.len() {
            return Err(GdnError::Invalid(format!(
                "a cache of {} layers for a model of {}",
                cache.pools.len(),
                self.layers.len()
            )));
        }
        for (l, p) in self.layers.iter().zip(&cache.pools) {
            l.check_pool(p)?;
        }
        decode::check_slots(slots, cache.slots)
    }

    /// Embedding, the blocks (`layer_step` for each GDN layer with its pool, then the MLP), the
    /// final norm and head over the rows `pick` selects (`(row, out row)` pairs); returns the
    /// logits `[pick.len(), vocab]` on the host.
    fn run_infer(
        &self,
        tokens: &[u32],
        pick: &[(i32, i32)],
        cache: &mut ModelCache,
        layer_step: impl Fn(&GatedDeltaNet, &Act, &mut CachePool) -> Result<Act>,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n = tokens.len();
        let (h, f, vsz) = (c.hidden_size(), c.ffn_hidden_size, c.vocab_size);
        let (kind, eps, zc) = (
            c.layer.normalization,
            c.layer.layernorm_epsilon,
            c.layer.layernorm_zero_centered_gamma,
        );
        let m = pick.len();
        let zeros = |len: usize| -> Result<Act> {
            Ok(match &self.dev {
                None => Act::Host(vec![0.0; len]),
                Some(d) => Act::Dev(crate::backend::cuda::DBuf::zeros(&d.gpu, len, d.dtype)?),
            })
        };
        if n == 0 {
            return Ok(vec![0.0; m * vsz]);
        }
        let tok_dev = match &self.dev {
            None => None,
            Some(d) => Some(d.gpu.upload(tokens)?),
        };
        let ids = tok_dev.as_ref().map_or(Ids::Host(tokens), Ids::Dev);
        let mut x = embedding::forward(ids, self.wp(EMBEDDING), vsz, h, self.dtype())?;
        drop(tok_dev);
        for (i, (layer, pool)) in self.layers.iter().zip(cache.pools.iter_mut()).enumerate() {
            // x = x + GDN(x), the layer continuing its pool.
            let mut h1 = layer_step(layer, &x, pool)?;
            add::add_assign(&mut h1, &x)?;
            drop(x);
            // x = x + fc2(swiglu(fc1(norm(x))))
            let p = format!("decoder.layers.{i}.mlp.");
            let (nw, nb) = (
                format!("{p}linear_fc1.layer_norm_weight"),
                format!("{p}linear_fc1.layer_norm_bias"),
            );
            let (w1, w2) = (
                format!("{p}linear_fc1.weight"),
                format!("{p}linear_fc2.weight"),
            );
            let (hn, _) = norm::forward(&h1, n, h, self.wp(&nw), self.wp_opt(&nb), kind, eps, zc)?;
            let u = linear::forward(&hn, n, h, self.wp(&w1), self.wb(&w1), 2 * f)?;
            drop(hn);
            let a = swiglu::forward(&u, n, f)?;
            drop(u);
            let mut out = linear::forward(&a, n, f, self.wp(&w2), self.wb(&w2), h)?;
            drop(a);
            add::add_assign(&mut out, &h1)?;
            x = out;
        }
        // The rows whose logits are wanted, then the final norm and the head over those only.
        let mut xs = zeros(m * h)?;
        decode::copy_rows(
            &x,
            crate::backend::Cols::dense(h),
            &mut xs,
            crate::backend::Cols::dense(h),
            pick,
        )?;
        drop(x);
        let (xf, _) = norm::forward(
            &xs,
            m,
            h,
            self.wp("decoder.final_layernorm.weight"),
            self.wp_opt("decoder.final_layernorm.bias"),
            kind,
            eps,
            zc,
        )?;
        let head = self.head_name();
        let logits = linear::forward(&xf, m, h, self.wp(head), self.wb(head), vsz)?;
        let mut logits = logits.into_host()?;
        // Rows no pair fills (empty sequences) are zero.
        for (i, row) in logits.chunks_mut(vsz).enumerate() {
            if !pick.iter().any(|&(s, d)| s >= 0 && d as usize == i) {
                row.fill(0.0);
            }
        }
        Ok(logits)
    }
}

#[cfg(test)]
#[path = "infer_tests.rs"]
mod tests;
