//! Decoding with multi-latent attention: the layers' own projections for the new positions,
//! then the compressed cache and the absorbed attention of
//! [`megatron_core::inference::latent_decode_attention`], then the output projection and its
//! reduction over tensor parallelism. Written by hand beside the DSL's forward (which expands
//! every position's keys and values, as training needs): an inference path, as Megatron-LM's
//! `cache_mla_latents` is, checked against the full forward's logits and transformers' greedy
//! continuation (`tests/hf_deepseek.rs`).

use megatron_core::comm::ReduceOp;
use megatron_core::inference::{LatentStep, latent_decode_attention};
use megatron_core::module::{ColumnParallel, Cx, Layer as _, RowParallel, Site};
use megatron_core::ops::{DotProductAttention, Rope};
use megatron_core::prelude::*;
use megatron_core::{Result, invalid};

use crate::mla::{LatentAttention, LatentKvAttention, MlaConfig};

/// What both variants decode their keys, values and output with.
struct Common<'m> {
    kv_down: &'m Linear,
    kv_norm: &'m LayerNorm,
    kv_up: &'m Linear,
    core: &'m DotProductAttention,
    proj: &'m Linear,
    rope: &'m Rope,
    dims: MlaConfig,
}

impl LatentAttention {
    /// One decoding forward (`cx` holds the KV cache): the output `[s, b, h]` of the new
    /// positions, the cache grown by their latents and rotary keys.
    pub fn decode(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<Tensor> {
        refuse_adapters(&[&self.q_up, &self.kv_up], &self.proj)?;
        let (a, _) = self.q_down.forward(cx, site.child("q_down"), x)?;
        let (a, _) = self.q_norm.forward(cx, site.child("q_norm"), &a)?;
        let (q, _) =
            <Linear as ColumnParallel>::forward_column(&self.q_up, cx, site.child("q_up"), &a)?;
        Common {
            kv_down: &self.kv_down,
            kv_norm: &self.kv_norm,
            kv_up: &self.kv_up,
            core: &self.core,
            proj: &self.proj,
            rope: &self.rope,
            dims: self.dims,
        }
        .decode(cx, site, x, &q)
    }
}

impl LatentKvAttention {
    /// As [`LatentAttention::decode`], the queries projected directly.
    pub fn decode(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<Tensor> {
        refuse_adapters(&[&self.q, &self.kv_up], &self.proj)?;
        let (q, _) = <Linear as ColumnParallel>::forward_column(&self.q, cx, site.child("q"), x)?;
        Common {
            kv_down: &self.kv_down,
            kv_norm: &self.kv_norm,
            kv_up: &self.kv_up,
            core: &self.core,
            proj: &self.proj,
            rope: &self.rope,
            dims: self.dims,
        }
        .decode(cx, site, x, &q)
    }
}

/// Decoding runs the layers' weights alone: adapters beside them are refused, not dropped.
fn refuse_adapters(columns: &[&Linear], row: &Linear) -> Result<()> {
    let adapted = columns
        .iter()
        .any(|l| <Linear as ColumnParallel>::lora(l).is_some())
        || <Linear as RowParallel>::lora(row).is_some();
    if adapted {
        return invalid!(
            "decoding multi-latent attention with LoRA adapters beside it is not built: export \
             the model with --merge-lora and generate from the merged one"
        );
    }
    Ok(())
}

impl Common<'_> {
    /// The keys' latent and rotary key of `x`, the queries `q` (this rank's heads) turned,
    /// the absorbed attention over the cache, the output projection reduced over tp.
    fn decode(&self, cx: &Cx, site: Site, x: &Tensor, q: &Tensor) -> Result<Tensor> {
        let Some(cache) = cx.kv_cache() else {
            return invalid!("decoding multi-latent attention needs a KV cache in the context");
        };
        let [s, b, _] = x.dims() else {
            return invalid!(
                "decoding: the input must be [sequence, batch, hidden], got {}",
                x.shape()
            );
        };
        let (s, b) = (*s, *b);
        let d = self.dims;
        let (nope, rope, kv) = (d.qk_head_dim, d.qk_pos_emb_head_dim, d.kv_lora_rank);
        let heads = q.last_dim() / d.q_head_dim();
        let offset = cx.position_offset();
        // The latent and the rotary key, per position.
        let (down, _) = self.kv_down.forward(cx, site.child("kv_down"), x)?;
        let down = down.to_vec_f32()?;
        let rows = s * b;
        let (mut latent, mut k_pe) = (
            Vec::with_capacity(rows * kv),
            Vec::with_capacity(rows * rope),
        );
        for r in 0..rows {
            let row = &down[r * (kv + rope)..(r + 1) * (kv + rope)];
            latent.extend_from_slice(&row[..kv]);
            k_pe.extend_from_slice(&row[kv..]);
        }
        let latent = Tensor::from_vec(latent, [s, b, kv])?;
        let (latent, _) = self.kv_norm.forward(cx, site.child("kv_norm"), &latent)?;
        let turn = |v: Vec<f32>, heads: usize| -> Result<Vec<f32>> {
            let t = Tensor::from_vec(v, [s, b, heads * rope])?;
            let turned = self
                .rope
                .rotary
                .apply(&t, (heads, 1, 1), rope, offset, false)?;
            Ok(turned.to_vec_f32()?)
        };
        let k_pe = turn(k_pe, 1)?;
        // The queries' two parts, per head.
        let q = q.to_vec_f32()?;
        let (mut q_nope, mut q_pe) = (
            Vec::with_capacity(rows * heads * nope),
            Vec::with_capacity(rows * heads * rope),
        );
        for head in q.chunks_exact(nope + rope) {
            q_nope.extend_from_slice(&head[..nope]);
            q_pe.extend_from_slice(&head[nope..]);
        }
        let q_pe = turn(q_pe, heads)?;
        let kv_up = self.kv_up.weight().value().to_vec_f32()?;
        let scale = self
            .core
            .scale
            .unwrap_or_else(|| 1.0 / (self.core.qk_head_dim as f32).sqrt());
        let ctx = latent_decode_attention(
            cache,
            site.child("core"),
            LatentStep {
                seq: s,
                batch: b,
                heads,
                nope,
                rope,
                v: d.v_head_dim,
                latent: kv,
                q_nope: &q_nope,
                q_pe: &q_pe,
                kv_latent: &latent.to_vec_f32()?,
                k_pe: &k_pe,
                kv_up: &kv_up,
                scale,
                window: self.core.window,
            },
        )?;
        let ctx = Tensor::from_vec(ctx, [s, b, heads * d.v_head_dim])?;
        let (out, _) =
            <Linear as RowParallel>::forward_row(self.proj, cx, site.child("proj"), &ctx)?;
        cx.tp().all_reduce(&out, ReduceOp::Sum)?;
        <Linear as RowParallel>::add_bias(self.proj, cx, &out)?;
        Ok(out)
    }
}
