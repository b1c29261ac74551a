//! The KV cache: each attention layer's keys and values of the positions a generation has run
//! (after rotary embeddings, per key/value head), kept on the host. A forward with a cache in
//! its context ([`crate::module::Cx::with_kv_cache`]) runs its tokens at positions
//! [`KvCache::offset`] on (the learned positions and the rotary angles start there), and each
//! attention layer appends the new positions' keys and values to its cache and attends from
//! the new queries to every cached key: the prompt is read once (the prefill), then one
//! position a step. The caller moves the offset on after each forward ([`KvCache::advance`]).
//!
//! A tensor-parallel rank caches its own heads (the layers' own split); nothing is
//! communicated beyond the model's own collectives. The scores and the context are products in
//! the run's precision (under `--bf16`, of operands rounded to bf16 with f32 sums, as the
//! attention of a forward without the cache).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::backend::cpu_product as product;
use crate::error::Result;
use crate::invalid;
use crate::kernels::gemm::{MatMut, MatRef};
use crate::kernels::heads::GroupedHeads;
use crate::kernels::softmax::{self, KeyMask};
use crate::module::Site;
use crate::tensor::Tensor;

use super::latent_cache::LatentLayer;

/// What a generation keeps between its forward passes (see the module's documentation).
#[derive(Debug, Default)]
pub struct KvCache {
    pub(super) state: Mutex<State>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    /// Positions run before the current forward.
    pub(super) offset: usize,
    /// Each attention layer's cache, by its site.
    pub(super) layers: HashMap<u64, LayerCache>,
    /// Each multi-latent attention layer's compressed cache, by its site.
    pub(super) latents: HashMap<u64, LatentLayer>,
}

/// One attention layer's keys and values: per batch entry and key/value head, `[positions,
/// head size]` rows, grown by a forward's new positions.
#[derive(Debug)]
pub(super) struct LayerCache {
    batch: usize,
    pub(super) groups: usize,
    pub(super) head_dim: usize,
    positions: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    /// An empty cache: the next forward starts at position 0.
    pub fn new() -> KvCache {
        KvCache::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere leaves whole entries behind: the state stays usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The position of the next forward's first token (the positions cached so far).
    pub fn offset(&self) -> usize {
        self.state().offset
    }

    /// Moves the offset past a forward of `positions` positions (every layer has cached them).
    pub fn advance(&self, positions: usize) {
        self.state().offset += positions;
    }

    /// Empties the cache: the next forward starts at position 0 again.
    pub fn clear(&self) {
        let mut state = self.state();
        state.offset = 0;
        state.layers.clear();
        state.latents.clear();
    }
}

/// Position-`offset`-on attention of a decoding forward at `site`: appends the new positions'
/// keys and values of `qkv` (`[s, b, groups·(per_group + 2)·d]` laid out per query group, the
/// queries and keys already turned by their positions) to the layer's cache, and attends from
/// each new query to every cached key up to its own position (within `window` keys before it,
/// with one), scaled by 1/√d. Returns the context `[s, b, heads·d]`, heads in order.
pub(crate) fn decode_attention(
    cache: &KvCache,
    site: Site,
    qkv: &Tensor,
    g: GroupedHeads,
    window: Option<usize>,
) -> Result<Tensor> {
    let [seq, batch, width] = qkv.dims() else {
        return invalid!(
            "decoding attention: fused QKV must be [sequence, batch, width], got {}",
            qkv.shape()
        );
    };
    let (seq, batch) = (*seq, *batch);
    let (groups, per_group, d) = (g.groups, g.per_group, g.head_dim);
    let parts = per_group + 2;
    if *width != groups * parts * d {
        return invalid!(
            "decoding attention: QKV width {width} is not {groups} groups × ({per_group} queries \
             + a key + a value) × {d}"
        );
    }
    if qkv.gpu().is_some() {
        return invalid!(
            "decoding with a KV cache runs on the host; this attention's projection is on a GPU"
        );
    }
    let x = qkv.to_vec_f32()?;
    let at = |i: usize, b: usize, group: usize, part: usize| {
        (((i * batch + b) * groups + group) * parts + part) * d
    };
    let mut state = cache.state();
    let offset = state.offset;
    let layer = state.layers.entry(site.0).or_insert_with(|| LayerCache {
        batch,
        groups,
        head_dim: d,
        positions: 0,
        keys: vec![Vec::new(); batch * groups],
        values: vec![Vec::new(); batch * groups],
    });
    if (layer.batch, layer.groups, layer.head_dim) != (batch, groups, d) {
        return invalid!(
            "decoding attention: the cache holds {} batch entries × {} key/value heads of {}, \
             this forward has {batch} × {groups} of {d}",
            layer.batch,
            layer.groups,
            layer.head_dim
        );
    }
    if layer.positions != offset {
        return invalid!(
            "decoding attention: the layer's cache holds {} positions, the forward starts at \
             position {offset}",
            layer.positions
        );
    }
    for b in 0..batch {
        for group in 0..groups {
            let (keys, values) = (
                &mut layer.keys[b * groups + group],
                &mut layer.values[b * groups + group],
            );
            for i in 0..seq {
                let k = at(i, b, group, per_group);
                keys.extend_from_slice(&x[k..k + d]);
                values.extend_from_slice(&x[k + d..k + 2 * d]);
            }
        }
    }
    layer.positions += seq;
    let keys_len = layer.positions;
    let heads = groups * per_group;
    let mut out = vec![0.0f32; seq * batch * heads * d];
    let scale = 1.0 / (d as f32).sqrt();
    let mask = KeyMask::causal_window(true, window);
    // Per batch entry and key/value head: its queries' rows (query head p, position i), their
    // scores against every cached key, the masked softmax, the values' weighted sum.
    let rows = per_group * seq;
    let mut q = vec![0.0f32; rows * d];
    let mut scores = vec![0.0f32; rows * keys_len];
    let mut probs = vec![0.0f32; rows * keys_len];
    let mut ctx = vec![0.0f32; rows * d];
    for b in 0..batch {
        for group in 0..groups {
            for p in 0..per_group {
                for i in 0..seq {
                    let from = at(i, b, group, p);
                    q[(p * seq + i) * d..][..d].copy_from_slice(&x[from..from + d]);
                }
            }
            let keys = MatRef::row_major(&layer.keys[b * groups + group], keys_len, d)?;
            let values = MatRef::row_major(&layer.values[b * groups + group], keys_len, d)?;
            product(
                1.0,
                MatRef::row_major(&q, rows, d)?,
                keys.t(),
                0.0,
                MatMut::row_major(&mut scores, rows, keys_len)?,
            )?;
            // Row (p, i) is query i of the last `seq` positions: the kernel's causal rule.
            softmax::softmax_forward(&scores, per_group, seq, keys_len, scale, mask, &mut probs)?;
            product(
                1.0,
                MatRef::row_major(&probs, rows, keys_len)?,
                values,
                0.0,
                MatMut::row_major(&mut ctx, rows, d)?,
            )?;
            for p in 0..per_group {
                let h = group * per_group + p;
                for i in 0..seq {
                    let to = ((i * batch + b) * heads + h) * d;
                    out[to..to + d].copy_from_slice(&ctx[(p * seq + i) * d..][..d]);
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, [seq, batch, heads * d])?)
}
