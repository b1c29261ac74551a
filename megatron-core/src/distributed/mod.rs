//! Data parallelism's state and collectives: every parameter and gradient of a rank's model in
//! two flat buffers cut into buckets ([`buffers`], Megatron-LM's `ParamAndGradBuffer`, laid out
//! by [`crate::optimizer::layout()`]: one shard computation), the gradients' reduction and the
//! parameters' gather per bucket over dp (experts over edp), and the tied embedding's gradient
//! sum ([`reduce`]); with `--overlap-grad-reduce`, each bucket's reduction started during the
//! backward once its gradients are final ([`grad_sync`]); with `--overlap-param-gather`, each
//! bucket's parameters gathered while the next step begins ([`param_gather`]); with
//! `optim_grads_params`, only each rank's shard of the values kept, the model's units gathered
//! around their passes ([`param_units`]).

pub mod buffers;
pub mod grad_sync;
pub mod param_gather;
pub mod param_units;
pub mod reduce;

pub use buffers::{
    Bucket, PackLayout, ParamBuffers, ParamSlot, ReduceGroups, ShardRanks, ShardedValues, SlotPart,
};
pub use grad_sync::GradSync;
pub use param_gather::ParamGather;
pub use param_units::{Gathered, ParamUnits};
pub use reduce::{
    gather_parameters, reduce_gradients, sum_sequence_parallel_gradients,
    sum_sequence_parallel_shards, sum_shared_gradients,
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
    /// What data parallelism shards (`--data-parallel-sharding-strategy`): from `optim` on,
    /// the run needs the distributed optimizer's layout ([`crate::training::TrainConfig`]'s
    /// `distributed_optimizer`).
    pub sharding: ShardingStrategy,
}

/// What data parallelism shards over its ranks (Megatron-FSDP's
/// `--data-parallel-sharding-strategy`, the stages of ZeRO); each strategy shards what the one
/// before does and more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardingStrategy {
    /// Nothing: every rank holds the parameters, gradients and optimizer state whole.
    #[default]
    NoShard,
    /// The optimizer state: Megatron-LM's distributed optimizer (ZeRO-1).
    Optim,
    /// Also the gradients: each bucket's whole gradients exist only between a micro-batch's
    /// writes and their reduce-scatter; the rank keeps its shard (ZeRO-2).
    OptimGrads,
    /// Also the parameters (ZeRO-3).
    OptimGradsParams,
}

impl ShardingStrategy {
    /// Every strategy, by its Megatron-FSDP name.
    pub const ALL: [(&'static str, ShardingStrategy); 4] = [
        ("no_shard", ShardingStrategy::NoShard),
        ("optim", ShardingStrategy::Optim),
        ("optim_grads", ShardingStrategy::OptimGrads),
        ("optim_grads_params", ShardingStrategy::OptimGradsParams),
    ];

    /// The strategy named `name` (Megatron-FSDP's names).
    pub fn named(name: &str) -> Option<ShardingStrategy> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, s)| s)
    }

    /// Megatron-FSDP's name of the strategy.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, s)| *s == self)
            .map_or("no_shard", |(n, _)| n)
    }

    /// Whether the optimizer state is sharded (the distributed optimizer).
    pub fn shards_optimizer(self) -> bool {
        self != ShardingStrategy::NoShard
    }

    /// Whether the gradients are sharded.
    pub fn shards_gradients(self) -> bool {
        matches!(
            self,
            ShardingStrategy::OptimGrads | ShardingStrategy::OptimGradsParams
        )
    }
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            overlap_param_gather_with_optimizer_step: false,
            num_distributed_optimizer_instances: 1,
            sharding: ShardingStrategy::NoShard,
        }
    }
}
