//! Mixture of experts: the router (top-k scores, capacity, load-balancing losses), the
//! all-to-all token dispatcher, the grouped experts, and [`RoutedExperts`], the
//! `#[expert_parallel]` layer made of them.

pub mod dispatcher;
pub mod expert_lora;
pub mod expert_parallel;
pub mod expert_tp;
pub mod experts;
pub mod placed;
pub mod routed;
pub mod router;
pub mod step;

pub use dispatcher::{
    CombineSaved, Dispatch, DispatcherKind, combine, combine_backward, dispatch, dispatch_backward,
};
pub use expert_parallel::ExpertParallel;
pub use expert_tp::{TpRows, gather_expert_rows, reduce_scatter_expert_rows, regather_expert_rows};
pub use placed::PlacedRouting;
pub use routed::{
    ExpertParallelSaved, GateSaved, RoutedExperts, RoutedExpertsSpec, RouterOutput, RouterSaved,
    is_expert_bias,
};
pub use router::{
    DropPolicy, GroupLimited, LoadBalancing, Partition, RouterConfig, RouterError, Routing,
    ScoreFunction, route, route_backward, route_partitioned, update_expert_bias,
};
pub use step::{RoutingLog, RoutingTotals};
