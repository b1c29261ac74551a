//! megatron-core: the runtime under the megatron-rs DSL.
//!
//! Bottom up: [`parallel`] builds Megatron's process groups, [`comm`] moves data between
//! ranks, [`tensor`] holds local (sharded) data and [`kernels`] computes on it; [`rng`] gives
//! layout-invariant random streams.

#![warn(missing_docs)]

mod backend;
pub mod checkpoint;
pub mod comm;
pub mod cuda;
pub mod cuda_graphs;
pub mod data;
pub mod distributed;
mod error;
pub mod files;
pub mod kernels;
pub mod limits;
pub mod module;
pub mod moe;
pub mod ops;
pub mod optimizer;
pub mod parallel;
pub mod pipeline_parallel;
pub mod prelude;
pub mod rng;
pub mod tensor;
pub mod tensor_parallel;
pub mod training;

pub use error::{Error, Result};
