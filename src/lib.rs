//! megatron-rs: NVIDIA Megatron-LM's parallel training, rebuilt in Rust as an embedded DSL.
//!
//! This facade re-exports the workspace crates; the `megatron` binary is the command-line front.

pub mod bench;
pub mod data;

pub use megatron_core as core;
pub use megatron_core::*;
pub use megatron_models as models;
