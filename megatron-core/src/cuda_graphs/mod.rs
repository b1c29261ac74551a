//! Partial CUDA graphs: the scopes `#[graph_scope(..)]` marks and `--cuda-graph-scope` selects,
//! the in-flight slots that bound their graphs and static buffers by the pipeline schedule,
//! the counts, and the runtime that captures a scope on first use and replays it after.
//!
//! Megatron-LM captures attention, the MoE router and the MoE preprocessing with
//! TransformerEngine's `make_graphed_callables` and runs the dispatch's all-to-all (whose sizes
//! are known only at run time), the experts and the combine eagerly. Here the macros put the
//! boundary around the scoped field's call, forward and backward, in the generated code.

mod plan;
mod runtime;
mod scope;
mod slots;

pub use plan::{BufferBytes, RankGraphs, plan_graphs};
pub use runtime::{GraphRuntime, GraphStats, backward, captures, forward};
pub use scope::{GraphScope, ScopeError, ScopeSet, ScopedModel};
pub use slots::{SlotAllocator, SlotPlan};

/// Refuses graph scopes under a schedule whose backward is split (the zero-bubble ones): a
/// captured backward's static buffers are overwritten by its next replay, so the weight
/// gradients put off past it would read another microbatch's values.
pub fn check_schedule(kind: crate::pipeline_parallel::ScheduleKind) -> crate::Result<()> {
    if kind.splits_backward() {
        return crate::invalid!(
            "--cuda-graph-scope cannot run with --pipeline-schedule {kind}: its weight \
             gradients, put off past the backward, would read the captured graphs' buffers after \
             later replays overwrote them (drop one of them)"
        );
    }
    Ok(())
}
