//! Multi-latent attention (MLA, DeepSeek-V2 and V3; Megatron-LM's `MLASelfAttention`), written
//! with the DSL: the keys and values come from a low-rank latent of the hidden state, each head
//! split into a position-free part and a rotary part whose key is one head shared by every head.
//!
//! The tensor-parallel plan is Megatron-LM's. The down projections (`kv_down`, and `q_down`
//! with a query latent) are whole on every rank (Megatron-LM's `parallel_mode="duplicated"`),
//! as are the latents' norms: with sequence parallelism they run on the rank's sequence shard
//! and their gradients are summed over tp. The up projections are column-parallel by head (the
//! all-gather of the shards before them with sequence parallelism), the output projection is
//! row-parallel. The rotary key is turned where it is made and broadcast to this rank's heads
//! (the all-gather of its shards with sequence parallelism, Megatron-LM's
//! `gather_from_sequence_parallel_region`; its gradient summed over the heads and reduced).
//! Attention is the general [`DotProductAttention`], queries and keys of
//! `qk_head_dim + qk_pos_emb_head_dim` per head, values of `v_head_dim`, on this rank's chunks
//! under context parallelism. docs/expanded-mla.md shows the generated code.

use megatron_core::ops::{DotProductAttention, Rope};
use megatron_core::prelude::*;
use megatron_macros::module;

/// MLA's sizes: Megatron-LM's `--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`,
/// `--qk-pos-emb-head-dim` and `--v-head-dim` (Hugging Face's `q_lora_rank`, `kv_lora_rank`,
/// `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MlaConfig {
    /// The queries' latent; `None`: the queries projected from the hidden state directly
    /// (DeepSeek-V2-Lite's, Moonlight's).
    pub q_lora_rank: Option<usize>,
    /// The keys' and values' latent.
    pub kv_lora_rank: usize,
    /// Each head's position-free query and key features.
    pub qk_head_dim: usize,
    /// Each head's rotary query and key features (the key's shared by every head).
    pub qk_pos_emb_head_dim: usize,
    /// Each head's value features.
    pub v_head_dim: usize,
    /// The latents' norms' ε when it is not the model's (DeepSeek's own code and transformers
    /// build them with 1e-6 whatever `rms_norm_eps` says); `None`: the model's, as Megatron-LM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latent_norm_epsilon: Option<f32>,
}

impl Default for MlaConfig {
    /// Megatron-LM's defaults: no query latent, a key/value latent of 32, heads of 128
    /// position-free and 64 rotary features, values of 128.
    fn default() -> Self {
        MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 32,
            qk_head_dim: 128,
            qk_pos_emb_head_dim: 64,
            v_head_dim: 128,
            latent_norm_epsilon: None,
        }
    }
}

impl MlaConfig {
    /// A query (and key) head's features: position-free and rotary.
    pub fn q_head_dim(&self) -> usize {
        self.qk_head_dim + self.qk_pos_emb_head_dim
    }

    /// Parameters of one layer's attention of `heads` heads over `hidden` features (the
    /// latents' norms of `norm` parameters per feature, the output projection's bias of
    /// `proj_bias` features).
    pub fn params(&self, hidden: u128, heads: u128, norm: u128, proj_bias: u128) -> u128 {
        let q = match self.q_lora_rank {
            Some(r) => {
                let r = r as u128;
                hidden * r + norm * r + r * heads * self.q_head_dim() as u128
            }
            None => hidden * heads * self.q_head_dim() as u128,
        };
        let (kv, pe) = (self.kv_lora_rank as u128, self.qk_pos_emb_head_dim as u128);
        let kv = hidden * (kv + pe)
            + norm * kv
            + kv * heads * (self.qk_head_dim + self.v_head_dim) as u128;
        q + kv + heads * self.v_head_dim as u128 * hidden + proj_bias
    }
}

/// MLA with a latent for the queries too (DeepSeek-V3's, Kimi K2's): `q_down`, its norm,
/// `q_up`; `kv_down`, its norm, `kv_up`.
#[module]
pub struct LatentAttention {
    /// `h → q_lora_rank`, whole on every rank.
    pub q_down: Linear,
    /// The queries' latent norm.
    pub q_norm: LayerNorm,
    /// `q_lora_rank → heads · (qk_head_dim + qk_pos_emb_head_dim)`, split by head.
    #[column_parallel]
    pub q_up: Linear,
    /// `h → kv_lora_rank + qk_pos_emb_head_dim`: the latent and the rotary key, whole on
    /// every rank.
    pub kv_down: Linear,
    /// The keys' and values' latent norm.
    pub kv_norm: LayerNorm,
    /// `kv_lora_rank → heads · (qk_head_dim + v_head_dim)`, split by head.
    #[column_parallel]
    pub kv_up: Linear,
    /// Attention over separate queries, keys and values; on this rank's chunks of the sequence
    /// under context parallelism.
    #[context_parallel]
    pub core: DotProductAttention,
    /// `heads · v_head_dim → h`, input features (heads) split; partial outputs reduced.
    #[row_parallel]
    pub proj: Linear,
    /// The rotary part's embedding.
    #[config]
    pub rope: Rope,
    /// The sizes.
    #[config]
    pub dims: MlaConfig,
    /// Attention heads (of the whole model: `broadcast_heads` takes this rank's).
    #[config]
    pub heads: usize,
}

#[module]
impl LatentAttention {
    fn forward(&self, x: Tensor) -> Tensor {
        let (latent, k_pe) = split(
            self.kv_down(x),
            [self.dims.kv_lora_rank, self.dims.qk_pos_emb_head_dim],
        );
        let (k_nope, v) = split_heads(
            self.kv_up(self.kv_norm(latent)),
            [self.dims.qk_head_dim, self.dims.v_head_dim],
        );
        let (q_nope, q_pe) = split_heads(
            self.q_up(self.q_norm(self.q_down(x))),
            [self.dims.qk_head_dim, self.dims.qk_pos_emb_head_dim],
        );
        let q = cat_heads(
            q_nope,
            rope(q_pe, self.rope),
            [self.dims.qk_head_dim, self.dims.qk_pos_emb_head_dim],
        );
        let k = cat_heads(
            k_nope,
            broadcast_heads(rope(k_pe, self.rope), self.heads),
            [self.dims.qk_head_dim, self.dims.qk_pos_emb_head_dim],
        );
        self.proj(self.core(q, k, v))
    }
}

/// MLA with the queries projected from the hidden state directly (`--q-lora-rank` unset:
/// DeepSeek-V2-Lite's, Moonlight's); the keys and values through their latent as in
/// [`LatentAttention`].
#[module]
pub struct LatentKvAttention {
    /// `h → heads · (qk_head_dim + qk_pos_emb_head_dim)`, split by head.
    #[column_parallel]
    pub q: Linear,
    /// `h → kv_lora_rank + qk_pos_emb_head_dim`, whole on every rank.
    pub kv_down: Linear,
    /// The keys' and values' latent norm.
    pub kv_norm: LayerNorm,
    /// `kv_lora_rank → heads · (qk_head_dim + v_head_dim)`, split by head.
    #[column_parallel]
    pub kv_up: Linear,
    /// As [`LatentAttention`]'s.
    #[context_parallel]
    pub core: DotProductAttention,
    /// `heads · v_head_dim → h`.
    #[row_parallel]
    pub proj: Linear,
    /// The rotary part's embedding.
    #[config]
    pub rope: Rope,
    /// The sizes.
    #[config]
    pub dims: MlaConfig,
    /// Attention heads of the whole model.
    #[config]
    pub heads: usize,
}

#[module]
impl LatentKvAttention {
    fn forward(&self, x: Tensor) -> Tensor {
        let (latent, k_pe) = split(
            self.kv_down(x),
            [self.dims.kv_lora_rank, self.dims.qk_pos_emb_head_dim],
        );
        let (k_nope, v) = split_heads(
            self.kv_up(self.kv_norm(latent)),
            [self.dims.qk_head_dim, self.dims.v_head_dim],
        );
        let (q_nope, q_pe) = split_heads(
            self.q(x),
            [self.dims.qk_head_dim, self.dims.qk_pos_emb_head_dim],
        );
        let q = cat_heads(
            q_nope,
            rope(q_pe, self.rope),
            [self.dims.qk_head_dim, self.dims.qk_pos_emb_head_dim],
        );
        let k = cat_heads(
            k_nope,
            broadcast_heads(rope(k_pe, self.rope), self.heads),
            [self.dims.qk_head_dim, self.dims.qk_pos_emb_head_dim],
        );
        self.proj(self.core(q, k, v))
    }
}
