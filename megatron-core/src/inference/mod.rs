//! Inference: what generation keeps between its forward passes (the KV cache, Megatron-LM's
//! `InferenceParams`), so that the prompt is read once and every later step runs the model on
//! its one new position. Multi-latent attention keeps its compressed latents instead and
//! attends through the absorbed up-projection ([`latent_decode_attention`]).

mod kv_cache;
mod latent_cache;

pub use kv_cache::KvCache;
pub(crate) use kv_cache::decode_attention;
pub use latent_cache::{LatentStep, latent_decode_attention};
