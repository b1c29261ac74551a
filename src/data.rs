//! Training data: Megatron-LM's indexed datasets, GPT samples and blends (re-exported from
//! megatron-core), and what the command line can use without downloads.

pub use megatron_core::data::*;

/// The project's own sources and documentation as text, collected at build time: the default
/// corpus of `megatron train` (with the byte-level tokenizer).
pub fn default_corpus() -> &'static [u8] {
    include_bytes!(concat!(env!("OUT_DIR"), "/corpus.txt"))
}
