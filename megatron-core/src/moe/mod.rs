//! Mixture of experts: the router (top-k scores, capacity, load-balancing losses) and the
//! all-to-all token dispatcher.

pub mod dispatcher;
pub mod experts;
pub mod layer;
pub mod router;

pub use router::{
    DropPolicy, LoadBalancing, RouterConfig, RouterError, Routing, ScoreFunction, route,
    route_backward, update_expert_bias,
};
