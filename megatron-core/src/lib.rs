//! megatron-core: the runtime under the megatron-rs DSL.
//!
//! Bottom up, one room per concept:
//! - [`parallel`] builds Megatron's process groups, [`comm`] moves data between ranks (every
//!   collective of a named group, `#[track_caller]`);
//! - [`tensor`] holds local (sharded) data, [`kernels`] computes on it on the CPU, [`cuda`] on a
//!   GPU (the device seam between them is `backend`, private: layers never choose a device);
//!   [`rng`] gives layout-invariant random streams;
//! - [`module`] is the DSL's runtime (`Module`, `Cx`, parameters, sites, recompute);
//!   [`tensor_parallel`], [`moe`] and [`ops`] are the layers and ops the generated code calls;
//! - [`pipeline_parallel`] holds Megatron-LM's schedules as data and the plan of a rank's passes;
//!   [`cuda_graphs`] the graph scopes;
//! - [`training`] is the trainer and its step engine; [`distributed`] the flat buffers and their
//!   data-parallel collectives; [`optimizer`] AdamW, clipping, the buffer layout and mixed
//!   precision; [`checkpoint`] checkpoints on disk; [`data`] Megatron's datasets.

#![warn(missing_docs)]

mod backend;
pub mod checkpoint;
pub mod comm;
pub mod context_parallel;
pub mod cuda;
pub mod cuda_graphs;
pub mod data;
pub mod distributed;
pub mod documents;
mod error;
pub mod files;
pub mod inference;
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
pub mod trace;
pub mod training;

pub use error::{Error, Result};
