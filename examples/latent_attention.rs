//! DeepSeek's multi-head latent attention (MLA, simplified as in docs: no query compression),
//! written in the DSL alone: a latent down-projection of the keys and values with its norm (a
//! module of two outputs, the latent and the rotary key),
//! per-head up-projections cut per head into the keys' position-free part and the values (a
//! value head size of its own), queries cut into a position-free and a rotary part, one rotary
//! key computed whole on every rank and shared by all heads, and attention over queries, keys and
//! values with their own head sizes. No hand-written layer, no hand-written backward: the shape
//! operations (`split`, `split_heads`, `cat_heads`, `broadcast_heads`), `rope` and
//! `DotProductAttention` are the DSL's, and the macros check where each value is split.
//!
//! A small decoder of these layers is trained on one rank, at tensor parallelism 2, at tensor
//! parallelism 2 with sequence parallelism, at pipeline parallelism 2 and at context
//! parallelism 2 (the attention on each rank's two chunks of the sequence, the rotary parts
//! turned at the chunks' positions; thread ranks), and every layout follows the one-rank run.
//!
//! ```sh
//! cargo run --release --example latent_attention
//! ```

mod common;

use common::{Layout, ONE, Run};
use megatron::models::gpt::{Mlp, MlpSpec};
use megatron::ops::{DotProductAttention, Rope};
use megatron::prelude::*;
use megatron::tensor_parallel::Normalization;
use megatron::training::CarriedWidth;

/// The keys' and values' latent, a module of two outputs: the normed latent of `KV_RANK`
/// features and the rotary key shared by every head, both whole on every rank.
#[megatron::module]
pub struct KvLatent {
    /// `h → KV_RANK + D_ROPE`.
    kv_down: Linear,
    kv_norm: LayerNorm,
}

#[megatron::module]
impl KvLatent {
    fn forward(&self, x: Tensor) -> (Tensor, Tensor) {
        let (latent, k_pe) = split(self.kv_down(x), [KV_RANK, D_ROPE]);
        (self.kv_norm(latent), k_pe)
    }
}

/// Multi-head latent attention: the keys and values through a latent of `KV_RANK` features.
#[megatron::module]
pub struct LatentAttention {
    kv: KvLatent,
    /// `KV_RANK → heads · (D_NOPE + D_V)`: each head's position-free key and its value.
    #[column_parallel]
    kv_up: Linear,
    /// `h → heads · (D_NOPE + D_ROPE)`.
    #[column_parallel]
    q: Linear,
    /// On this rank's chunks of the sequence under context parallelism.
    #[context_parallel]
    core: DotProductAttention,
    #[row_parallel]
    proj: Linear,
    #[config]
    rope: Rope,
}

#[megatron::module]
impl LatentAttention {
    fn forward(&self, x: Tensor) -> Tensor {
        let (latent, k_pe) = self.kv(x);
        let (k_nope, v) = split_heads(self.kv_up(latent), [D_NOPE, D_V]);
        let (q_nope, q_pe) = split_heads(self.q(x), [D_NOPE, D_ROPE]);
        let q = cat_heads(q_nope, rope(q_pe, self.rope), [D_NOPE, D_ROPE]);
        let k_pe = broadcast_heads(rope(k_pe, self.rope), HEADS);
        let k = cat_heads(k_nope, k_pe, [D_NOPE, D_ROPE]);
        self.proj(self.core(q, k, v))
    }
}

/// A pre-norm decoder layer: latent attention and a GeLU MLP (from `megatron-models`).
#[megatron::module]
pub struct MlaLayer {
    ln_1: LayerNorm,
    attn: LatentAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

#[megatron::module]
impl MlaLayer {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = x + self.attn(self.ln_1(x));
        h + self.mlp(self.ln_2(h))
    }
}

/// The language model: tied vocabulary-parallel embedding, the layers cut into pipeline
/// stages, the final norm and the fused vocabulary-parallel cross-entropy.
#[megatron::module]
pub struct MlaLm {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    layers: Vec<MlaLayer>,
    ln_f: LayerNorm,
}

#[megatron::module]
impl MlaLm {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for layer in &self.layers {
            h = layer(h);
        }
        cross_entropy(self.wte.logits(self.ln_f(h)), targets)
    }
}

impl CarriedWidth for MlaLm {
    fn carried_width(&self) -> usize {
        self.ln_f.hidden()
    }
}

const HIDDEN: usize = 96;
const HEADS: usize = 4;
/// The keys' and values' latent.
const KV_RANK: usize = 32;
/// Each head's position-free query and key features, its rotary features, its value features.
const D_NOPE: usize = 16;
const D_ROPE: usize = 8;
const D_V: usize = 20;
const LAYERS: usize = 4;
/// Bytes: the examples' frozen corpus (examples/data) is read as bytes.
const VOCAB: usize = 256;
const STEPS: u64 = 40;
const SEED: u64 = 1234;

fn spec() -> MlaLmSpec {
    let rms = LayerNormSpec::new(KV_RANK).with_kind(Normalization::RmsNorm);
    let layer = MlaLayerSpec {
        ln_1: LayerNormSpec::new(HIDDEN),
        attn: LatentAttentionSpec {
            kv: KvLatentSpec {
                kv_down: LinearSpec::new(HIDDEN, KV_RANK + D_ROPE).with_bias(false),
                kv_norm: rms,
            },
            kv_up: LinearSpec::new(KV_RANK, HEADS * (D_NOPE + D_V)).with_bias(false),
            q: LinearSpec::new(HIDDEN, HEADS * (D_NOPE + D_ROPE)).with_bias(false),
            core: DotProductAttention::new(D_NOPE + D_ROPE),
            proj: LinearSpec::new(HEADS * D_V, HIDDEN).with_bias(false),
            rope: Rope::new(D_ROPE),
        },
        ln_2: LayerNormSpec::new(HIDDEN),
        mlp: MlpSpec {
            fc1: LinearSpec::new(HIDDEN, 4 * HIDDEN),
            fc2: LinearSpec::new(4 * HIDDEN, HIDDEN),
        },
    };
    MlaLmSpec {
        wte: EmbeddingSpec::new(VOCAB, HIDDEN),
        layers: vec![layer; LAYERS],
        ln_f: LayerNormSpec::new(HIDDEN),
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    println!(
        "a {LAYERS}-layer decoder with latent attention (hidden {HIDDEN}, {HEADS} heads, latent \
         {KV_RANK}, head sizes q·k {} and v {D_V}, a rotary key of {D_ROPE} shared by the heads) \
         on the examples' corpus (the guide and the model sources) as bytes",
        D_NOPE + D_ROPE
    );
    let run = Run {
        steps: STEPS,
        layers: LAYERS,
        seq_length: 64,
        micro_batch: 2,
        global_batch: 8,
        max_lr: 2e-3,
        seed: SEED,
    };
    common::train_and_compare::<MlaLm>(
        &spec(),
        run,
        &[
            ("one rank", ONE),
            ("TP=2", Layout { tp: 2, ..ONE }),
            (
                "TP=2 + SP",
                Layout {
                    tp: 2,
                    sp: true,
                    ..ONE
                },
            ),
            ("PP=2", Layout { pp: 2, ..ONE }),
            ("CP=2", Layout { cp: 2, ..ONE }),
        ],
        (1e-5, 1e-3),
    )
}
