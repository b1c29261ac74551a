//! Tensor-parallel layers and operators (Megatron-LM's `megatron/core/tensor_parallel`).
//!
//! The layers hold this rank's part of their parameters and compute on it; the collectives that
//! join the parts (f, g, the embedding's all-reduce) are called by the code the
//! `#[megatron::module]` macros generate, where they can be read. The fused vocab-parallel
//! cross-entropy and the last-dimension gather/split are here too.

mod attention;
mod cross_entropy;
mod embedding;
mod layer_norm;
mod linear;
pub mod lora;
mod mappings;
mod qk_norm;
mod rotary;

pub use attention::{AttentionSaved, CausalSelfAttention};
pub use cross_entropy::{
    VocabParallelCrossEntropySaved, vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_backward, vocab_parallel_cross_entropy_backward_to,
};
pub use embedding::{
    Embedding, EmbeddingSaved, EmbeddingSpec, LogitsSaved, PositionEmbedding,
    PositionEmbeddingSpec, PositionSaved, Positions, PositionsSpec, padded_vocab_size,
};
pub use layer_norm::{LayerNorm, LayerNormSaved, LayerNormSpec, Normalization};
pub use linear::{Linear, LinearSaved, LinearSpec};
pub use mappings::{
    all_gather_sequence, all_reduce_tp, gather_last_dim, keep_sequence_shard,
    reduce_scatter_sequence, split_last_dim, split_sequence,
};
pub use qk_norm::{QkNorm, QkNormSaved, QkNormSpec};
pub use rotary::{Llama3Scaling, Rotary, Yarn};
