//! Converting checkpoints between megatron-rs and other formats.

pub mod hf_gpt2;
pub mod hf_llama;
