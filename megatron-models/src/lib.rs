//! Models written with the megatron-rs DSL, registered by name.

#![warn(missing_docs)]

pub mod config;
pub mod gpt;
pub mod mla;
pub mod mla_decode;
pub mod moe;
pub mod registry;
pub mod self_attention;

pub use config::{
    DeepSeekMoe, GptConfig, MoeConfig, MoeLayerFreq, MtpConfig, PositionEmbeddingType,
};
pub use mla::MlaConfig;
pub use registry::{ModelPreset, preset, presets};
