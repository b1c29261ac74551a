//! Training data as Megatron-LM prepares it: indexed datasets, GPT samples, blends and splits.
//!
//! * [`IndexedDataset`] reads Megatron-LM's `PREFIX.idx` + `PREFIX.bin` through memory maps;
//!   [`IndexedDatasetBuilder`] writes them byte for byte as Megatron-LM does.
//! * [`GptDataset`] cuts one split of an indexed dataset into samples of `seq_length + 1` tokens,
//!   shuffled by seed exactly as Megatron-LM's `GPTDataset` (NumPy's generator included), so the
//!   same seed gives the same samples in the same order on every rank and in Megatron-LM.
//! * [`BlendedDataset`] mixes datasets by weights; [`build_gpt_dataset`] is Megatron-LM's dataset
//!   builder for one split of a `--data-path` blend.
//! * [`InOrder`] reads a held-out set whole and in order, for evaluation.
//! * [`PackedDataset`] reads packed fine-tuning data: whole documents per sequence, with their
//!   loss masks and boundaries in a sidecar ([`PackedWriter`] writes it).
//! * The trainer reads samples through [`SampleSource`].

mod blended;
mod builder;
mod dtype;
mod error;
mod gpt;
mod in_order;
mod indexed;
pub mod numpy_rng;
mod packed;

pub use blended::{
    Blend, BlendedDataset, MID_LEVEL_DATASET_SURPLUS, build_gpt_dataset, normalize, parse_data_path,
};
pub use builder::{IndexedDatasetBuilder, encode_index};
pub use dtype::DType;
pub use error::{DataError, Result};
pub use gpt::{GptDataset, GptDatasetConfig, Split, SplitVector};
pub use in_order::InOrder;
pub use indexed::{
    INDEX_HEADER_LEN, INDEX_MAGIC, INDEX_VERSION, IndexedDataset, Tokens, bin_path, idx_path,
};
pub use packed::{
    PACKED_MAGIC, PACKED_VERSION, PackedDataset, PackedDocument, PackedSidecar, PackedWriter,
    is_packed, packed_path,
};

/// Samples of token ids for training: sample `i` is `seq_length + 1` tokens (inputs and, shifted
/// by one, labels). Implementations are deterministic: the same `i` gives the same tokens on
/// every rank and every call.
pub trait SampleSource: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `i`.
    fn sample(&self, i: u64) -> Result<Vec<u32>>;

    /// Which targets of sample `i` count in the loss (`seq_length` values, 1 where the target
    /// at that position counts), or `None` when all do.
    fn loss_mask(&self, _i: u64) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// Whether some sample may have a loss mask.
    fn has_loss_mask(&self) -> bool {
        false
    }

    /// Where sample `i`'s documents start after its first (positions in `1..seq_length`), when
    /// the sample is packed documents that must not see each other (packed fine-tuning data:
    /// positions and attention reset at each), or `None`.
    fn documents(&self, _i: u64) -> Result<Option<Vec<usize>>> {
        Ok(None)
    }

    /// Whether some sample may have documents of its own.
    fn has_documents(&self) -> bool {
        false
    }
}
