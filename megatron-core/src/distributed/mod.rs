//! Data parallelism's state and collectives: every parameter and gradient of a rank's model in
//! two flat buffers cut into buckets ([`buffers`], Megatron-LM's `ParamAndGradBuffer`, laid out
//! by [`crate::optimizer::layout()`]: one shard computation), the gradients' reduction and the
//! parameters' gather per bucket over dp (experts over edp), and the tied embedding's gradient
//! sum ([`reduce`]); with `--overlap-grad-reduce`, each bucket's reduction started during the
//! backward once its gradients are final ([`grad_sync`]); with `--overlap-param-gather`, each
//! bucket's parameters gathered while the next step begins ([`param_gather`]).

pub mod buffers;
pub mod grad_sync;
pub mod param_gather;
pub mod reduce;

pub use buffers::{
    Bucket, PackLayout, ParamBuffers, ParamSlot, ReduceGroups, ShardRanks, SlotPart,
};
pub use grad_sync::GradSync;
pub use param_gather::ParamGather;
pub use reduce::{
    gather_parameters, reduce_gradients, sum_sequence_parallel_gradients, sum_shared_gradients,
};

/// How data parallelism overlaps its communication with compute (the flags of Megatron-LM's
/// `DistributedDataParallelConfig` of these names) and how many distributed-optimizer
/// instances it has; the default overlaps nothing, with one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpConfig {
    /// `--overlap-grad-reduce`: each bucket's reduction starts during the backward, once every
    /// gradient in it is final ([`GradSync`]).
    pub overlap_grad_reduce: bool,
    /// `--overlap-param-gather` (with the distributed optimizer): each bucket's all-gather of
    /// the updated parameters starts after the optimizer step, and the next step's first read
    /// of the bucket waits for it ([`ParamGather`]).
    pub overlap_param_gather: bool,
    /// `--overlap-param-gather-with-optimizer-step` (with `overlap_param_gather`, more than one
    /// model chunk per rank, and one bucket per chunk): the optimizer updates the first model
    /// chunk first and starts its all-gathers before it updates the others, so that the
    /// parameters the next step reads first are gathered during the rest of the update
    /// (Megatron-LM's first chunk with an optimizer of its own, `force_dispatch` after its
    /// step).
    pub overlap_param_gather_with_optimizer_step: bool,
    /// `--num-distributed-optimizer-instances` (with the distributed optimizer): the optimizer
    /// state sharded within each of this many parts of the data-parallel group and replicated
    /// across them (HSDP; [`crate::comm::OptimizerInstances`]). The run's
    /// [`crate::comm::ParallelState`] holds their groups.
    pub num_distributed_optimizer_instances: usize,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            overlap_param_gather_with_optimizer_step: false,
            num_distributed_optimizer_instances: 1,
        }
    }
}
