//! megatron-core: the runtime under the megatron-rs DSL.
//!
//! Bottom up: [`parallel`] builds Megatron's process groups, [`comm`] moves data between
//! ranks, [`tensor`] holds local (sharded) data and [`kernels`] computes on it.

pub mod kernels;
pub mod rng;
