//! GPT as Megatron-LM trains it, written only with the DSL: pre-LayerNorm transformer blocks,
//! learned positions, a GeLU MLP of 4h, and the input embedding tied to the output layer.
//!
//! The same struct is the Llama family when its config says so (Megatron-LM's flags): RMSNorm
//! for the norms, the gated MLP ([`GatedMlp`], SwiGLU), no biases, rotary embeddings in
//! attention instead of learned positions, an output layer of its own.
//!
//! The field attributes are the whole tensor-parallel plan: the fused QKV projection and the
//! MLP's first layer are column-parallel, the attention output projection and the MLP's second
//! layer row-parallel, and the embedding is split by vocabulary. The macros insert the two
//! all-reduces per layer forward and two backward, the embedding's all-reduce, the f operator
//! before the tied output layer, and the fused cross-entropy's b·s-sized all-reduces.

use megatron_core::moe::RoutedExpertsSpec;
use megatron_core::ops::{DotProductAttention, Rope};
use megatron_core::prelude::*;
use megatron_core::training::CarriedWidth;
use megatron_macros::module;

use crate::config::{GptConfig, PositionEmbeddingType};
use crate::mla::{LatentAttentionSpec, LatentKvAttentionSpec};
use crate::moe::{DenseMlpSpec, Ffn, FfnSpec, MoeMlpSpec, SharedMoeMlpSpec};
use crate::self_attention::{SelfAttention, SelfAttentionSpec};

/// The feed-forward block: fc1 split by output features, GeLU, fc2 split by input features.
#[module]
pub struct Mlp {
    /// `h → ffn`, output features split over tensor parallelism.
    #[column_parallel]
    pub fc1: Linear,
    /// `ffn → h`, input features split; partial outputs all-reduced.
    #[row_parallel]
    pub fc2: Linear,
}

#[module]
impl Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = gelu(self.fc1(x));
        self.fc2(h)
    }
}

/// The gated feed-forward block (`--swiglu`, Llama's MLP): fc1 holds the gate and the up
/// projection (`[gate; up]`, each tensor-parallel rank its own part of both), SwiGLU, fc2.
#[module]
pub struct GatedMlp {
    /// `h → 2·ffn`, the gate's and the up projection's features split over tensor parallelism.
    #[column_parallel]
    pub fc1: Linear,
    /// `ffn → h`, input features split; partial outputs all-reduced.
    #[row_parallel]
    pub fc2: Linear,
}

#[module]
impl GatedMlp {
    fn forward(&self, x: Tensor) -> Tensor {
        self.fc2(swiglu(self.fc1(x)))
    }
}

/// Causal self-attention: each tensor-parallel rank holds whole heads.
#[module]
pub struct Attention {
    /// The fused `h → 3h` projection, laid out per head as `[q | k | v]` (per query group
    /// with grouped-query attention).
    #[column_parallel]
    pub qkv: Linear,
    /// `--qk-layernorm`: each query and key head normalised over its size (on this rank's
    /// heads; the identity without the flag).
    #[local]
    pub qk_norm: QkNorm,
    /// Scaled dot-product attention with the causal mask and attention dropout; with context
    /// parallelism on this rank's chunks of the sequence, keys and values exchanged over the
    /// group (the one field context parallelism changes).
    #[context_parallel]
    pub core: CausalSelfAttention,
    /// `h → h`, input features (heads) split; partial outputs all-reduced.
    #[row_parallel]
    pub proj: Linear,
}

#[module]
impl Attention {
    fn forward(&self, x: Tensor) -> Tensor {
        let qkv = self.qk_norm(self.qkv(x));
        let ctx = self.core(qkv);
        self.proj(ctx)
    }
}

/// A pre-LayerNorm transformer block with dropout on each residual branch.
#[module]
pub struct Block {
    /// Norm before attention (LayerNorm or RMSNorm).
    pub ln1: LayerNorm,
    /// Attention (the fused projection's, or multi-latent): graph scope `attn`.
    #[graph_scope(attn)]
    pub attn: SelfAttention,
    /// Norm before the MLP.
    pub ln2: LayerNorm,
    /// The MLP: dense, or a mixture of experts (see [`Ffn`]).
    pub mlp: Ffn,
    /// Dropout on the branches' outputs.
    #[config]
    pub hidden_dropout: f32,
}

#[module]
impl Block {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = x + dropout(self.attn(self.ln1(x)), self.hidden_dropout);
        h + dropout(self.mlp(self.ln2(h)), self.hidden_dropout)
    }
}

/// One depth of multi-token prediction (Megatron-LM's `MultiTokenPredictionLayer`, DeepSeek-V3's
/// MTP module): the previous depth's hidden state and the embedding of the token one further,
/// each normed, side by side (embedding first) and projected back to the hidden size, then a
/// transformer layer like the model's last and a norm before the shared output layer.
#[module]
pub struct MtpLayer {
    /// Norm of the next token's embedding.
    pub enorm: LayerNorm,
    /// Norm of the previous depth's hidden state.
    pub hnorm: LayerNorm,
    /// `2h → h` without bias, output features split over tensor parallelism and gathered
    /// (Megatron-LM's `eh_proj`, gathered and scattered back to the sequence with sequence
    /// parallelism).
    #[column_parallel(gather_output = true)]
    pub eh_proj: Linear,
    /// The depth's transformer layer.
    pub block: Block,
    /// Norm before the output layer.
    pub final_norm: LayerNorm,
}

#[module]
impl MtpLayer {
    fn forward(&self, h: Tensor, e: Tensor) -> Tensor {
        let x = self.eh_proj(cat(self.enorm(e), self.hnorm(h)));
        self.final_norm(self.block(x))
    }
}

/// The whole model: token ids in, per-token losses out.
#[module]
pub struct Gpt {
    /// Word embedding, split by vocabulary; also the output layer.
    #[vocab_parallel]
    pub wte: Embedding,
    /// Positions added to the word embeddings: learned ones, or none here (rotary embeddings
    /// turn the queries and keys in attention).
    pub wpe: Positions,
    /// The transformer blocks: pipeline parallelism cuts them into stages.
    #[pipeline]
    pub blocks: Vec<Block>,
    /// Final norm.
    pub ln_f: LayerNorm,
    /// Multi-token prediction's depths (`--mtp-num-layers`; none without), after the final
    /// norm on the last pipeline stage.
    pub mtp: Vec<MtpLayer>,
    /// Dropout on the summed embeddings.
    #[config]
    pub embedding_dropout: f32,
    /// Each depth's loss's weight: `--mtp-loss-scaling-factor / --mtp-num-layers`.
    #[config]
    pub mtp_loss_weight: f32,
}

#[module]
impl Gpt {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let x = self.wpe(self.wte(tokens));
        let mut h = dropout(x, self.embedding_dropout);
        for block in &self.blocks {
            h = block(h);
        }
        h = self.ln_f(h);
        let mut losses = cross_entropy(self.wte.logits(h), targets);
        // Multi-token prediction: depth k sees the tokens, targets and mask k places further
        // on, and its loss rides on the main one, reported as `mtp_k`.
        let mut ids = tokens;
        let mut labels = targets;
        let mut mask = loss_mask(targets);
        for depth in &self.mtp {
            ids = shift_left(ids);
            labels = shift_left(labels);
            mask = shift_left(mask);
            h = depth(h, dropout(self.wte(ids), self.embedding_dropout));
            let depth_losses = cross_entropy(self.wte.logits(h), labels);
            losses = aux_loss(losses, depth_losses, mask, self.mtp_loss_weight, "mtp");
        }
        losses
    }
}

impl GptConfig {
    /// The logical description the model is built from. Weights are drawn from
    /// N(0, init_method_std); the output layer of each residual branch (attention projection,
    /// fc2) from N(0, init_method_std / √(2·layers)), as in the Megatron-LM paper.
    pub fn spec(&self) -> GptSpec {
        let h = self.hidden_size;
        let std = self.init_method_std;
        let out_std = std / (2.0 * self.num_layers as f32).sqrt();
        let bias = self.add_bias_linear;
        let ln = LayerNormSpec {
            hidden: h,
            eps: self.layernorm_epsilon,
            kind: self.normalization,
        };
        let linear =
            |i: usize, o: usize, std: f32| LinearSpec::new(i, o).with_init_std(std).with_bias(bias);
        let mlp = |ffn: usize| MlpSpec {
            fc1: linear(h, ffn, std),
            fc2: linear(ffn, h, out_std),
        };
        let gated = |ffn: usize| GatedMlpSpec {
            fc1: linear(h, 2 * ffn, std).gated(),
            fc2: linear(ffn, h, out_std),
        };
        let dense = |ffn: usize| match self.swiglu {
            true => FfnSpec::Gated(gated(ffn)),
            false => FfnSpec::Dense(mlp(ffn)),
        };
        let ffn = |is_moe: bool| match (&self.moe, is_moe) {
            (Some(moe), true) => {
                let experts = RoutedExpertsSpec {
                    router: moe.router,
                    hidden: h,
                    ffn: moe.ffn_hidden_size,
                    gated: self.swiglu,
                    init_std: std,
                    out_init_std: out_std,
                    dispatcher: moe.dispatcher,
                };
                match moe.shared_expert_ffn {
                    None => FfnSpec::Moe(MoeMlpSpec { experts }),
                    Some(shared) => FfnSpec::SharedMoe(SharedMoeMlpSpec {
                        experts,
                        shared: match self.swiglu {
                            true => DenseMlpSpec::Gated(gated(shared)),
                            false => DenseMlpSpec::Plain(mlp(shared)),
                        },
                    }),
                }
            }
            _ => dense(self.ffn_hidden_size),
        };
        // A pattern that does not fit is reported by `validate_parallel`; here it is dense.
        let moe_layers = self
            .moe_layers()
            .unwrap_or_else(|_| vec![false; self.num_layers]);
        let block = |layer: usize, is_moe: bool| BlockSpec {
            ln1: ln.clone(),
            attn: self.attention_spec(layer, &ln),
            ln2: ln.clone(),
            mlp: ffn(is_moe),
            hidden_dropout: self.hidden_dropout,
        };
        // Each depth of multi-token prediction has a layer like the model's last.
        let last = (
            self.num_layers - 1,
            moe_layers.last().copied().unwrap_or(false),
        );
        let mtp = (0..self.mtp_depths())
            .map(|_| MtpLayerSpec {
                enorm: ln.clone(),
                hnorm: ln.clone(),
                eh_proj: LinearSpec::new(2 * h, h)
                    .with_init_std(std)
                    .with_bias(false),
                block: block(last.0, last.1),
                final_norm: ln.clone(),
            })
            .collect();
        let blocks = moe_layers
            .into_iter()
            .enumerate()
            .map(|(layer, is_moe)| block(layer, is_moe))
            .collect();
        GptSpec {
            wte: EmbeddingSpec {
                vocab_size: self.vocab_size,
                hidden: h,
                init_std: std,
                make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
                untied: self.untie_embeddings_and_output_weights,
            },
            wpe: match self.position_embedding_type {
                PositionEmbeddingType::LearnedAbsolute => {
                    PositionsSpec::Learned(PositionEmbeddingSpec {
                        max_positions: self.max_position_embeddings,
                        hidden: h,
                        init_std: std,
                    })
                }
                PositionEmbeddingType::Rope | PositionEmbeddingType::None => {
                    PositionsSpec::Elsewhere
                }
            },
            blocks,
            ln_f: ln.clone(),
            mtp,
            embedding_dropout: self.hidden_dropout,
            mtp_loss_weight: self
                .mtp
                .map_or(0.0, |m| m.loss_scaling_factor / m.num_layers as f32),
        }
    }
}

impl GptConfig {
    /// Layer `layer`'s attention: multi-latent with `--multi-latent-attention`, otherwise on
    /// the fused `[q | k | v]` projection.
    fn attention_spec(&self, layer: usize, ln: &LayerNormSpec) -> SelfAttentionSpec {
        let h = self.hidden_size;
        let std = self.init_method_std;
        let out_std = std / (2.0 * self.num_layers as f32).sqrt();
        let bias = self.add_bias_linear;
        let (heads, head_dim) = (self.num_attention_heads, self.head_dim());
        let linear =
            |i: usize, o: usize, std: f32| LinearSpec::new(i, o).with_init_std(std).with_bias(bias);
        let Some(mla) = self.mla else {
            let rope = self.position_embedding_type == PositionEmbeddingType::Rope;
            return SelfAttentionSpec::Fused(AttentionSpec {
                qkv: linear(h, (heads + 2 * self.query_groups()) * head_dim, std)
                    .with_bias(bias || self.add_qkv_bias)
                    .with_query_groups(self.query_groups(), heads / self.query_groups(), head_dim),
                qk_norm: match self.qk_layernorm {
                    true => QkNormSpec::On {
                        norm: LayerNormSpec {
                            hidden: head_dim,
                            ..ln.clone()
                        },
                        per_group: heads / self.query_groups(),
                        groups: self.query_groups(),
                    },
                    false => QkNormSpec::Off,
                },
                core: CausalSelfAttention::new(self.num_attention_heads, self.attention_dropout)
                    .with_rotary(rope.then_some(self.rotary))
                    .with_query_groups(self.query_groups())
                    .with_window(self.window_of(layer)),
                proj: linear(heads * head_dim, h, out_std),
            });
        };
        // Megatron-LM's MLA: no biases but the output projection's.
        let plain = |i: usize, o: usize| LinearSpec::new(i, o).with_init_std(std).with_bias(false);
        let norm = |n: usize| LayerNormSpec {
            hidden: n,
            eps: mla.latent_norm_epsilon.unwrap_or(ln.eps),
            ..ln.clone()
        };
        let kv_down = plain(h, mla.kv_lora_rank + mla.qk_pos_emb_head_dim);
        let kv_up = plain(mla.kv_lora_rank, heads * (mla.qk_head_dim + mla.v_head_dim));
        let mut core =
            DotProductAttention::new(mla.q_head_dim()).with_window(self.window_of(layer));
        if let Some(yarn) = self.rotary.yarn {
            // Megatron-LM's `mscale² / √q_head_dim`.
            core =
                core.with_scale((yarn.softmax_factor() / (mla.q_head_dim() as f64).sqrt()) as f32);
        }
        let proj = linear(heads * mla.v_head_dim, h, out_std);
        let rope = Rope::new(mla.qk_pos_emb_head_dim).with_rotary(self.rotary);
        let q_width = heads * mla.q_head_dim();
        match mla.q_lora_rank {
            Some(r) => SelfAttentionSpec::Latent(LatentAttentionSpec {
                q_down: plain(h, r),
                q_norm: norm(r),
                q_up: plain(r, q_width),
                kv_down,
                kv_norm: norm(mla.kv_lora_rank),
                kv_up,
                core,
                proj,
                rope,
                dims: mla,
                heads,
            }),
            None => SelfAttentionSpec::LatentKv(LatentKvAttentionSpec {
                q: plain(h, q_width),
                kv_down,
                kv_norm: norm(mla.kv_lora_rank),
                kv_up,
                core,
                proj,
                rope,
                dims: mla,
                heads,
            }),
        }
    }
}

impl CarriedWidth for Gpt {
    /// The hidden size: what each stage's blocks take and give.
    fn carried_width(&self) -> usize {
        self.ln_f.hidden()
    }
}
