//! Pipeline parallelism: Megatron-LM's 1F1B and interleaved 1F1B schedules and the zero-bubble
//! ones (ZB-H1, ZB-H2, ZB-V, DualPipeV) as data, the executor that walks a rank's order, and a
//! simulation of the whole pipeline.
//!
//! [`layout`] assigns the layers to the ranks' chunks; [`schedule`] computes what Megatron-LM's `get_schedule_table`, `get_pp_rank_microbatches`
//! and `convert_schedule_table_to_order` compute, with Megatron-LM's argument checks, and
//! [`zero_bubble`] the orders that split each backward into input and weight gradients;
//! [`executor`] runs one rank's order over a [`executor::Stage`] (a model's, or a
//! recording one); [`simulate`](mod@simulate) checks that the ranks' orders make a valid pipeline and times
//! it; [`plan`](mod@plan) adds to each rank's order the batched exchanges that run it on any backend.

pub mod executor;
pub mod layout;
pub mod plan;
pub mod schedule;
pub mod simulate;
pub mod zero_bubble;

pub use executor::{
    Pass, RecordingStage, ScheduledPass, Slot, Stage, WalkError, WalkStats, execute, walk,
};
pub use layout::{PipelineLayout, StageLayoutError, StagePart};
pub use plan::{Action, Delivery, PlanError, RankPlan, Transfer, plan};
pub use schedule::{
    Placement, RankCounts, RankSchedule, Schedule, ScheduleConfig, ScheduleError, ScheduleKind,
    StageMap, TableEntry, order_from_table, schedule_table,
};
pub use simulate::{
    Costs, PipelineError, Theory, Timed, Timeline, draw, simulate, simulate_ranks, theory, traces,
};
