//! Inference with cached states. [`GatedDeltaNet::prefill`] runs the chunked forward over the
//! prompts (keeping nothing for backward) and returns, per sequence, what decoding needs: the
//! pre-conv `[q | k | v]` rows of the last `W - 1` tokens and the recurrent state.
//! [`GatedDeltaNet::extend`] continues every cached sequence with a chunk of new tokens, and
//! [`GatedDeltaNet::decode`] with one token each, with the layer's own ops: the conv runs over
//! each sequence's cached rows followed by its new rows, the rule from the cached state.

use super::*;

/// What decoding needs of each of `N` sequences (f32, on the host):
/// - `conv` `[N, W - 1, conv_dim]`: the pre-conv `[q | k | v]` rows (in_proj's output) of the
///   sequence's last `W - 1` tokens, oldest first; zero rows before the sequence's start;
/// - `state` `[N, Hv, Dk, Dv]`: the recurrent state after the last token.
#[derive(Clone, Debug, PartialEq)]
pub struct InferenceCache {
    pub conv: Tensor,
    pub state: Tensor,
}

impl InferenceCache {
    /// Number of sequences.
    pub fn sequences(&self) -> usize {
        self.state.shape()[0]
    }
}

impl GatedDeltaNet {
    /// Prefill: the forward over prompts `x` (`[B, T, hidden]` with `seqs = Seqs::uniform(B, T)`,
    /// or packed `[1, T, hidden]` / `[T, hidden]` with `cu_seqlens` boundaries in `seqs`, as in
    /// [`forward_with_state`](Self::forward_with_state)), keeping nothing for backward. Returns
    /// `y` (the same values as the training forward) and each sequence's cache. Empty sequences
    /// get an empty cache (zero rows, zero state): decoding them starts a sequence.
    pub fn prefill(&self, x: &Tensor, seqs: &Seqs) -> Result<(Tensor, InferenceCache)> {
        self.check_rows(x, seqs)?;
        let c = &self.cfg;
        let (cd, w) = (c.conv_dim(), c.linear_conv_kernel_dim);
        let xa = self.act(x.data())?;
        let f = self.run_forward(&xa, seqs, None, true)?;
        let y = Tensor::from_vec(x.shape(), f.y.into_host()?)?;
        let fin = f
            .final_state
            .ok_or_else(|| GdnError::Invalid("final state was not produced".into()))?;
        let state = Tensor::from_vec(&self.state_shape(seqs), fin.into_host()?)?;
        let qkv_pre = self.conv_input_of(&f.acts.proj)?.into_host()?;
        let n = seqs.count();
        let zeros = vec![0.0f32; (w - 1) * cd];
        let mut conv = Vec::with_capacity(n * (w - 1) * cd);
        for i in 0..n {
            let r = seqs.range(i);
            last_rows(&zeros, &qkv_pre[r.start * cd..r.end * cd], &mut conv);
        }
        let conv = Tensor::from_vec(&[n, w - 1, cd], conv)?;
        Ok((y, InferenceCache { conv, state }))
    }

    /// An empty cache for `n` sequences (zero conv rows, zero states): decoding from it is the
    /// forward from each sequence's start.
    pub fn empty_cache(&self, n: usize) -> InferenceCache {
        let c = &self.cfg;
        InferenceCache {
            conv: Tensor::zeros(&[n, c.linear_conv_kernel_dim - 1, c.conv_dim()]),
            state: Tensor::zeros(&self.state_shape(&Seqs::uniform(n, 1))),
        }
    }

    /// Decode one token for each cached sequence: `x` `[N, hidden]` or `[N, 1, hidden]` (row i
    /// continues sequence i of `cache`); returns `y` of the same shape and advances `cache`. On
    /// an error the cache is left as it was.
    pub fn decode(&self, x: &Tensor, cache: &mut InferenceCache) -> Result<Tensor> {
        let h = self.cfg.hidden_size;
        let n = match x.shape() {
            &[n, hh] | &[n, 1, hh] if hh == h => n,
            s => return Err(GdnError::shape("x", s, format!("[N, {h}] or [N, 1, {h}]"))),
        };
        self.extend(x, &Seqs::uniform(n, 1), cache)
    }

    /// Continue every cached sequence with new tokens (chunked prefill, multi-turn): `x` packed
    /// (`[1, T, hidden]` or `[T, hidden]`) or `[N, L, hidden]` as in
    /// [`forward_with_state`](Self::forward_with_state), sequence i of `seqs` continuing sequence
    /// i of `cache` (an empty one leaves it as it is). Returns `y` (padding rows zero) and
    /// advances `cache`; on an error the cache is left as it was.
    pub fn extend(&self, x: &Tensor, seqs: &Seqs, cache: &mut InferenceCache) -> Result<Tensor> {
        self.check_rows(x, seqs)?;
        let c = &self.cfg;
        let (cd, w) = (c.conv_dim(), c.linear_conv_kernel_dim);
        let (n, t) = (seqs.count(), seqs.tokens());
        cache
            .state
            .expect_shape("cache.state", &self.state_shape(seqs))?;
        cache.conv.expect_shape("cache.conv", &[n, w - 1, cd])?;
        if t == 0 {
            return Ok(x.clone());
        }
        let p = self.view()?;
        let mut prof = Prof::new(self.gpu()?);
        let (proj, _) = self.in_proj(&p, &self.act(x.data())?, t)?;
        let (qkv_pre, gate_in) = (self.conv_input_of(&proj)?, self.gate_sections_of(&proj)?);
        // conv + SiLU over each sequence's cached rows followed by its new rows; keep the new.
        let cur = qkv_pre.into_host()?;
        let mut cu_ext = vec![0u64];
        let mut ext = Vec::with_capacity((n * (w - 1) + seqs.used()) * cd);
        for i in 0..n {
            let r = seqs.range(i);
            ext.extend_from_slice(&cache.conv.data()[i * (w - 1) * cd..(i + 1) * (w - 1) * cd]);
            ext.extend_from_slice(&cur[r.start * cd..r.end * cd]);
            cu_ext.push((ext.len() / cd) as u64);
        }
        let seqs_ext = Seqs::packed(&cu_ext, ext.len() / cd)?;
        let conv_out = conv1d::forward(
            &self.act(&ext)?,
            Cols::dense(cd),
            p.get("conv1d.weight"),
            w,
            p.opt("conv1d.bias"),
            &seqs_ext,
        )?
        .into_host()?;
        let mut qkv = vec![0.0f32; t * cd];
        for i in 0..n {
            let (r, e0) = (seqs.range(i), cu_ext[i] as usize + w - 1);
            qkv[r.start * cd..r.end * cd].copy_from_slice(&conv_out[e0 * cd..(e0 + r.len()) * cd]);
        }
        let r = self.prep_after_conv(&p, self.act(&qkv)?, &gate_in, t)?;
        // On the CPU the rule reads the cached state in place of a copy (decode's largest
        // buffer: N x Hv x Dk x Dv floats); it is put back if anything below fails.
        let st_shape = cache.state.shape().to_vec();
        let h0 = match self.gpu()? {
            None => F32s::Host(std::mem::replace(&mut cache.state, Tensor::zeros(&[0])).into_vec()),
            Some(_) => self.f32s(cache.state.data())?,
        };
        let mut run = || -> Result<(Tensor, F32s)> {
            let (o, fin, _) = self.rule_forward(&r, seqs, Some(&h0), true, false)?;
            let (y, _, _) = self.out_proj(&p, &o, &proj, t, &mut prof)?;
            let mut y = y.into_host()?;
            y[seqs.used() * c.hidden_size..].fill(0.0);
            let fin =
                fin.ok_or_else(|| GdnError::Invalid("final state was not produced".into()))?;
            Ok((Tensor::from_vec(x.shape(), y)?, fin))
        };
        let (y, fin) = match run() {
            Ok(v) => v,
            Err(e) => {
                if let F32s::Host(v) = h0 {
                    cache.state = Tensor::from_vec(&st_shape, v)?;
                }
                return Err(e);
            }
        };
        // Advance the cache only now that everything succeeded: each sequence's last W - 1 rows.
        let state = Tensor::from_vec(&st_shape, fin.into_host()?)?;
        let mut conv = Vec::with_capacity(n * (w - 1) * cd);
        for i in 0..n {
            let r = seqs.range(i);
            let hist = &cache.conv.data()[i * (w - 1) * cd..(i + 1) * (w - 1) * cd];
            last_rows(hist, &cur[r.start * cd..r.end * cd], &mut conv);
        }
        cache.conv = Tensor::from_vec(&[n, w - 1, cd], conv)?;
        cache.state = state;
        Ok(y)
    }
}

/// Append to `out` the last `hist.len()` values of `hist` followed by `new` (whole rows, as both
/// hold whole rows): a sequence's conv cache after its rows `new`, given its cache `hist` before.
fn last_rows(hist: &[f32], new: &[f32], out: &mut Vec<f32>) {
    let from_new = new.len().min(hist.len());
    out.extend_from_slice(&hist[from_new..]);
    out.extend_from_slice(&new[new.len() - from_new..]);
}
