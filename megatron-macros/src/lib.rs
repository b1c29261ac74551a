//! Procedural macros of megatron-rs: `#[megatron::module]` and its field attributes.
//!
//! The macros arrive with the DSL and tensor-parallelism work; this crate is the workspace's
//! place for them.
