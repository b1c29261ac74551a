//! Data parallelism's state and collectives: every parameter and gradient of a rank's model in
//! two flat buffers cut into buckets ([`buffers`], Megatron-LM's `ParamAndGradBuffer`, laid out
//! by [`crate::optimizer::layout()`]: one shard computation), the gradients' reduction and the
//! parameters' gather per bucket over dp (experts over edp), and the tied embedding's gradient
//! sum ([`reduce`]); with `--overlap-grad-reduce`, each bucket's reduction started during the
//! backward once its gradients are final ([`grad_sync`]).

pub mod buffers;
pub mod grad_sync;
pub mod reduce;

pub use buffers::{
    Bucket, PackLayout, ParamBuffers, ParamSlot, ReduceGroups, ShardRanks, SlotPart,
};
pub use grad_sync::GradSync;

pub use reduce::{
    gather_parameters, reduce_gradients, sum_sequence_parallel_gradients, sum_shared_gradients,
};

/// How data parallelism overlaps its communication with compute (the flags of Megatron-LM's
/// `DistributedDataParallelConfig` of these names); the default overlaps nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DdpConfig {
    /// `--overlap-grad-reduce`: each bucket's reduction starts during the backward, once every
    /// gradient in it is final ([`GradSync`]).
    pub overlap_grad_reduce: bool,
}
