//! Mixture of experts: the router (top-k scores, capacity, load-balancing losses).

pub mod router;

pub use router::{
    DropPolicy, LoadBalancing, RouterConfig, RouterError, Routing, ScoreFunction, route,
    route_backward, update_expert_bias,
};
