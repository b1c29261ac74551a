//! The optimizer's data and numerics: how parameters and gradients are laid out in buffers and
//! buckets, which shard of each bucket a data-parallel rank owns, and mixed precision (16-bit
//! parameters and gradients, f32 main parameters, loss scaling).

pub mod layout;
pub mod precision;

pub use layout::{
    BufferKey, BufferLayout, LayoutConfig, LayoutError, ParamInfo, Placement, Shard, ShardPart,
    bucket_end_divisor, layout,
};
pub use precision::{GradScaler, LossScaling, Precision, PrecisionError, PrecisionFlags};
