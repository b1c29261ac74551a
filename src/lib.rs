//! megatron-rs: NVIDIA Megatron-LM's parallel training, rebuilt in Rust as an embedded DSL.
//!
//! This facade re-exports the workspace crates; the `megatron` binary is the command-line front.

#![warn(missing_docs)]

pub mod audit;
pub mod bench;
pub mod chat;
pub mod convert;
pub mod data;
pub mod generate;
#[cfg_attr(feature = "cuda", path = "gpu/cuda.rs")]
#[cfg_attr(not(feature = "cuda"), path = "gpu/absent.rs")]
pub mod gpu;
pub mod job;
pub mod launch;
pub mod report;
pub mod tokenizer;

pub use megatron_core as core;
pub use megatron_core::*;
#[doc(hidden)]
pub use megatron_macros::__module_impl;
pub use megatron_macros::module;
pub use megatron_models as models;
