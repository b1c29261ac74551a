//! Models written with the megatron-rs DSL, registered by name.

pub mod config;
pub mod gpt;
pub mod registry;

pub use config::GptConfig;
pub use registry::{ModelPreset, preset, presets};
