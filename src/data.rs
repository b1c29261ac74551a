//! Training data the command line can use without downloads.

/// The project's own sources and documentation as text, collected at build time: the default
/// corpus of `megatron train` (with the byte-level tokenizer).
pub fn default_corpus() -> &'static [u8] {
    include_bytes!(concat!(env!("OUT_DIR"), "/corpus.txt"))
}
