//! Multi-latent attention's compressed KV cache and its decoding attention with weight
//! absorption (DeepSeek-V2, section 2.1.2; Megatron-LM's `cache_mla_latents`): a layer caches,
//! per position, the normed key/value latent (`kv_lora_rank` features) and the turned rotary
//! key (`qk_pos_emb_head_dim`), not the heads' keys and values. A new query reaches the
//! cached positions through the up-projection's weight instead of expanding them: head h's
//! position-free query is carried into latent space by its key rows of `kv_up`
//! (`q_lat = q_nope · W_uk[h]`), its scores are `q_lat · latent + q_pe · k_pe`, and its context,
//! a weighted sum of latents, leaves through the value rows (`out = W_uv[h] · Σ p·latent`). The
//! same products as expanding every cached position, in another order, in the run's precision
//! (bf16 operands with f32 sums under `--bf16`).

use std::sync::PoisonError;

use crate::backend::cpu_product as product;
use crate::error::Result;
use crate::invalid;
use crate::kernels::gemm::{MatMut, MatRef};
use crate::kernels::softmax::{self, KeyMask};
use crate::module::Site;

use super::KvCache;

/// One multi-latent attention layer's cache: per batch entry, `[positions, latent]` and
/// `[positions, rotary]` rows.
#[derive(Debug)]
pub(super) struct LatentLayer {
    batch: usize,
    latent: usize,
    rotary: usize,
    positions: usize,
    latents: Vec<Vec<f32>>,
    keys: Vec<Vec<f32>>,
}

/// A decoding forward's inputs to multi-latent attention, host rows in `[seq, batch, ..]`
/// order; `heads` are this rank's.
#[derive(Debug, Clone, Copy)]
pub struct LatentStep<'a> {
    /// The new positions.
    pub seq: usize,
    /// Sequences.
    pub batch: usize,
    /// This rank's heads.
    pub heads: usize,
    /// Each head's position-free query and key features.
    pub nope: usize,
    /// The rotary features.
    pub rope: usize,
    /// Each head's value features.
    pub v: usize,
    /// The latent's features.
    pub latent: usize,
    /// `[seq, batch, heads·nope]`.
    pub q_nope: &'a [f32],
    /// `[seq, batch, heads·rope]`, turned at their positions.
    pub q_pe: &'a [f32],
    /// `[seq, batch, latent]`, normed.
    pub kv_latent: &'a [f32],
    /// `[seq, batch, rope]`, turned at their positions.
    pub k_pe: &'a [f32],
    /// The up-projection's weight on this rank, `[heads·(nope + v), latent]`: each head's key
    /// rows, then its value rows.
    pub kv_up: &'a [f32],
    /// The scores' scale.
    pub scale: f32,
    /// Each query sees at most this many keys before it.
    pub window: Option<usize>,
}

impl LatentStep<'_> {
    fn check(&self) -> Result<()> {
        let rows = self.seq * self.batch;
        for (name, len, want) in [
            ("q_nope", self.q_nope.len(), rows * self.heads * self.nope),
            ("q_pe", self.q_pe.len(), rows * self.heads * self.rope),
            ("kv_latent", self.kv_latent.len(), rows * self.latent),
            ("k_pe", self.k_pe.len(), rows * self.rope),
            (
                "kv_up",
                self.kv_up.len(),
                self.heads * (self.nope + self.v) * self.latent,
            ),
        ] {
            if len != want {
                return invalid!(
                    "latent decoding attention: {name} holds {len} values, the sizes ({} \
                     positions × {} sequences, {} heads of {} + {} features, values of {}, a \
                     latent of {}) need {want}",
                    self.seq,
                    self.batch,
                    self.heads,
                    self.nope,
                    self.rope,
                    self.v,
                    self.latent
                );
            }
        }
        Ok(())
    }
}

/// Appends the new positions' latents and rotary keys of `step` to `site`'s cache and attends
/// from each new query to every cached position up to its own, through the absorbed weights.
/// Returns the context `[seq, batch, heads·v]`, heads in order.
pub fn latent_decode_attention(cache: &KvCache, site: Site, step: LatentStep) -> Result<Vec<f32>> {
    step.check()?;
    let LatentStep {
        seq,
        batch,
        heads,
        nope,
        rope,
        v,
        latent,
        ..
    } = step;
    let mut state = cache.state.lock().unwrap_or_else(PoisonError::into_inner);
    let offset = state.offset;
    let layer = state.latents.entry(site.0).or_insert_with(|| LatentLayer {
        batch,
        latent,
        rotary: rope,
        positions: 0,
        latents: vec![Vec::new(); batch],
        keys: vec![Vec::new(); batch],
    });
    if (layer.batch, layer.latent, layer.rotary) != (batch, latent, rope) {
        return invalid!(
            "latent decoding attention: the cache holds {} sequences of latents of {} and \
             rotary keys of {}, this forward has {batch} of {latent} and {rope}",
            layer.batch,
            layer.latent,
            layer.rotary
        );
    }
    if layer.positions != offset {
        return invalid!(
            "latent decoding attention: the layer's cache holds {} positions, the forward \
             starts at position {offset}",
            layer.positions
        );
    }
    for b in 0..batch {
        for i in 0..seq {
            let row = i * batch + b;
            layer.latents[b].extend_from_slice(&step.kv_latent[row * latent..][..latent]);
            layer.keys[b].extend_from_slice(&step.k_pe[row * rope..][..rope]);
        }
    }
    layer.positions += seq;
    let keys_len = layer.positions;
    let mask = KeyMask::causal_window(true, step.window);
    let width = nope + v;
    let mut out = vec![0.0f32; seq * batch * heads * v];
    let (mut q_n, mut q_p) = (vec![0.0f32; seq * nope], vec![0.0f32; seq * rope]);
    let mut q_lat = vec![0.0f32; seq * latent];
    let mut scores = vec![0.0f32; seq * keys_len];
    let mut probs = vec![0.0f32; seq * keys_len];
    let mut ctx_lat = vec![0.0f32; seq * latent];
    let mut ctx = vec![0.0f32; seq * v];
    for b in 0..batch {
        let latents = MatRef::row_major(&layer.latents[b], keys_len, latent)?;
        let keys = MatRef::row_major(&layer.keys[b], keys_len, rope)?;
        for h in 0..heads {
            for i in 0..seq {
                let row = i * batch + b;
                q_n[i * nope..][..nope]
                    .copy_from_slice(&step.q_nope[(row * heads + h) * nope..][..nope]);
                q_p[i * rope..][..rope]
                    .copy_from_slice(&step.q_pe[(row * heads + h) * rope..][..rope]);
            }
            let w = &step.kv_up[h * width * latent..(h + 1) * width * latent];
            let (w_uk, w_uv) = w.split_at(nope * latent);
            // The position-free query carried into the latent's space.
            product(
                1.0,
                MatRef::row_major(&q_n, seq, nope)?,
                MatRef::row_major(w_uk, nope, latent)?,
                0.0,
                MatMut::row_major(&mut q_lat, seq, latent)?,
            )?;
            product(
                1.0,
                MatRef::row_major(&q_lat, seq, latent)?,
                latents.t(),
                0.0,
                MatMut::row_major(&mut scores, seq, keys_len)?,
            )?;
            product(
                1.0,
                MatRef::row_major(&q_p, seq, rope)?,
                keys.t(),
                1.0,
                MatMut::row_major(&mut scores, seq, keys_len)?,
            )?;
            // Query i is position offset + i: the kernel's causal rule over the last `seq`.
            softmax::softmax_forward(&scores, 1, seq, keys_len, step.scale, mask, &mut probs)?;
            product(
                1.0,
                MatRef::row_major(&probs, seq, keys_len)?,
                latents,
                0.0,
                MatMut::row_major(&mut ctx_lat, seq, latent)?,
            )?;
            // Out through the head's value rows.
            product(
                1.0,
                MatRef::row_major(&ctx_lat, seq, latent)?,
                MatRef::row_major(w_uv, v, latent)?.t(),
                0.0,
                MatMut::row_major(&mut ctx, seq, v)?,
            )?;
            for i in 0..seq {
                let to = ((i * batch + b) * heads + h) * v;
                out[to..to + v].copy_from_slice(&ctx[i * v..][..v]);
            }
        }
    }
    Ok(out)
}

impl KvCache {
    /// Bytes the cache holds per position and sequence, summed over its layers: multi-latent
    /// attention's latent and rotary key, or attention's keys and values, in f32.
    pub fn bytes_per_token(&self) -> usize {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let latent: usize = state.latents.values().map(|l| l.latent + l.rotary).sum();
        let expanded: usize = state
            .layers
            .values()
            .map(|l| 2 * l.groups * l.head_dim)
            .sum();
        4 * (latent + expanded)
    }
}
