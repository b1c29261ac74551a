//! The distributed optimizer's data: how parameters and gradients are laid out in buffers and
//! buckets, and which shard of each bucket a data-parallel rank owns.

pub mod layout;

pub use layout::{
    BufferKey, BufferLayout, LayoutConfig, LayoutError, ParamInfo, Placement, Shard, ShardPart,
    bucket_end_divisor, layout,
};
