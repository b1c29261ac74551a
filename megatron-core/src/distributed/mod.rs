//! Data parallelism's state and collectives: every parameter and gradient of a rank's model in
//! two flat buffers cut into buckets ([`buffers`], Megatron-LM's `ParamAndGradBuffer`, laid out
//! by [`crate::optimizer::layout()`]: one shard computation), the gradients' reduction and the
//! parameters' gather per bucket over dp (experts over edp), and the tied embedding's gradient
//! sum ([`reduce`]).

pub mod buffers;
pub mod reduce;

pub use buffers::{
    Bucket, PackLayout, ParamBuffers, ParamSlot, ReduceGroups, ShardRanks, SlotPart,
};
pub use reduce::{
    gather_parameters, reduce_gradients, sum_sequence_parallel_gradients, sum_shared_gradients,
};
