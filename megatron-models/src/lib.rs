//! Models written with the megatron-rs DSL, registered by name.

#![warn(missing_docs)]

pub mod config;
pub mod gpt;
pub mod moe;
pub mod registry;

pub use config::{GptConfig, MoeConfig, MoeLayerFreq, PositionEmbeddingType};
pub use registry::{ModelPreset, preset, presets};
