//! Inference: what generation keeps between its forward passes (the KV cache, Megatron-LM's
//! `InferenceParams`), so that the prompt is read once and every later step runs the model on
//! its one new position.

mod kv_cache;

pub use kv_cache::KvCache;
pub(crate) use kv_cache::decode_attention;
