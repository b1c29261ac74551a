//! The names a model file needs: `use megatron::prelude::*;`.

pub use crate::context_parallel::ContextParallel;
pub use crate::error::{Error, Result};
pub use crate::module::{
    Builder, ColumnParallel, Cx, Ids, Layer, Lookup, Module, Op, Param, RowParallel, Sharding,
    Site, VocabParallel,
};
pub use crate::tensor::{DType, Tensor};
pub use crate::tensor_parallel::{
    CausalSelfAttention, Embedding, EmbeddingSpec, LayerNorm, LayerNormSpec, Linear, LinearSpec,
    PositionEmbedding, PositionEmbeddingSpec, Positions, PositionsSpec, QkNorm, QkNormSpec,
};
