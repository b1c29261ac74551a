//! The optimizer: AdamW with one update path over dtypes and devices ([`adamw`]), global
//! gradient-norm clipping ([`clip`]), how parameters and gradients are laid out in buffers and
//! buckets and which shard of each bucket a data-parallel rank owns ([`layout`](mod@layout)), and
//! mixed precision (16-bit parameters and gradients, f32 main parameters, loss scaling,
//! [`precision`]).

pub mod adamw;
pub mod clip;
pub mod layout;
pub mod precision;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_coefficient, grad_norm};
pub use layout::{
    BufferKey, BufferLayout, LayoutConfig, LayoutError, ParamInfo, Placement, Shard, ShardPart,
    bucket_end_divisor, layout,
};
pub use precision::{GradScaler, LossScaling, Precision, PrecisionError, PrecisionFlags};
