//! Megatron-LM's GPT dataset: the documents of a split shuffled by seed, concatenated, and cut
//! into samples of `seq_length + 1` tokens, in the order of a shuffled sample index.
//!
//! Built exactly as `megatron/core/datasets/gpt_dataset.py` with `helpers.cpp`'s
//! `build_sample_idx` does (with `add_extra_token_to_sequence` and dropping the last partial
//! sample): the same seed gives the same document, sample and shuffle indices, so the same samples
//! in the same order as Megatron-LM. Nothing depends on the rank: every rank that builds a dataset
//! with the same arguments gets the same one.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

use super::SampleSource;
use super::error::{DataError, Result, data_invalid};
use super::indexed::IndexedDataset;
use super::numpy_rng::RandomState;

/// Which of the train, validation and test splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Training.
    Train,
    /// Validation.
    Valid,
    /// Test.
    Test,
}

impl Split {
    /// The three splits in Megatron-LM's order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    fn index(self) -> usize {
        self as usize
    }

    /// `train`, `valid` or `test`.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Megatron-LM's `--split`: the train, valid and test shares of every dataset's sequences,
/// normalized to sum to 1 (`"969,30,1"`, `"99,1,0"`, `"1"` = all train).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitVector([f64; 3]);

impl SplitVector {
    /// Every sequence in the train split.
    pub const TRAIN_ONLY: SplitVector = SplitVector([1.0, 0.0, 0.0]);

    /// Normalizes the three shares (`parse_and_normalize_split`).
    pub fn new(shares: [f64; 3]) -> Result<Self> {
        if shares.iter().any(|s| !s.is_finite() || *s < 0.0) {
            return data_invalid!("split shares must be non-negative numbers, got {shares:?}");
        }
        // NumPy sums short arrays left to right.
        let sum = shares[0] + shares[1] + shares[2];
        if sum <= 0.0 {
            return data_invalid!("split shares {shares:?} add up to zero");
        }
        Ok(SplitVector(shares.map(|s| s / sum)))
    }

    /// The normalized shares.
    pub fn shares(&self) -> [f64; 3] {
        self.0
    }

    /// The split's bookends as fractions of the sequences (`convert_split_vector_to_split_matrix`);
    /// `None` for a split with no share.
    pub fn bookends(&self, split: Split) -> Option<(f64, f64)> {
        let v = self.0;
        let ends = [0.0, v[0], v[0] + v[1], v[0] + v[1] + v[2]];
        let (a, b) = (ends[split.index()], ends[split.index() + 1]);
        (b > a).then_some((a, b))
    }

    /// The split's sequences among `num_sequences`, rounded as Megatron-LM rounds them (Python's
    /// `round`: half to even); `None` for a split with no share.
    pub fn sequence_range(&self, split: Split, num_sequences: usize) -> Option<Range<usize>> {
        let (a, b) = self.bookends(split)?;
        let n = num_sequences as f64;
        let beg = (a * n).round_ties_even() as usize;
        let end = (b * n).round_ties_even() as usize;
        Some(beg..end)
    }
}

impl Default for SplitVector {
    fn default() -> Self {
        SplitVector::TRAIN_ONLY
    }
}

impl FromStr for SplitVector {
    type Err = DataError;

    /// Up to three numbers separated by commas, slashes or spaces; missing ones are 0.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || DataError::Invalid(format!("bad split {s:?}: expected e.g. \"969,30,1\""));
        let mut shares = [0.0; 3];
        let parts: Vec<&str> = s
            .split(|c: char| c == ',' || c == '/' || c.is_whitespace())
            .filter(|p| !p.is_empty())
            .collect();
        if parts.is_empty() || parts.len() > 3 {
            return Err(bad());
        }
        for (slot, p) in shares.iter_mut().zip(&parts) {
            if !p.chars().all(|c| c.is_ascii_digit() || c == '.') {
                return Err(bad());
            }
            *slot = p.parse().map_err(|_| bad())?;
        }
        SplitVector::new(shares)
    }
}

/// What every GPT dataset of a run shares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptDatasetConfig {
    /// Tokens per sample the model sees; samples hold one more (the last label).
    pub seq_length: usize,
    /// Megatron-LM's `--seed` (NumPy seeds are 32-bit).
    pub seed: u32,
    /// Megatron-LM's `--split`.
    pub split: SplitVector,
}

impl GptDatasetConfig {
    /// A configuration with every sequence in the train split.
    pub fn new(seq_length: usize, seed: u32) -> Self {
        GptDatasetConfig {
            seq_length,
            seed,
            split: SplitVector::TRAIN_ONLY,
        }
    }

    /// The same with another split.
    pub fn with_split(self, split: SplitVector) -> Self {
        GptDatasetConfig { split, ..self }
    }
}

/// A GPT dataset over one indexed dataset's split: samples of `seq_length + 1` tokens.
pub struct GptDataset {
    dataset: Arc<IndexedDataset>,
    split: Split,
    sequences: Range<usize>,
    seq_length: usize,
    num_samples: Option<u64>,
    num_epochs: u64,
    tokens_per_epoch: u64,
    /// Sequence ids, epoch after epoch, shuffled.
    document_index: Vec<i32>,
    /// (position in `document_index`, token offset) where each sample starts; one extra entry.
    sample_index: Vec<[u32; 2]>,
    shuffle_index: Vec<u32>,
}

impl fmt::Debug for GptDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GptDataset")
            .field("prefix", &self.dataset.prefix())
            .field("split", &self.split)
            .field("sequences", &self.sequences)
            .field("seq_length", &self.seq_length)
            .field("samples", &self.len())
            .field("epochs", &self.num_epochs)
            .finish()
    }
}

impl GptDataset {
    /// The `split` of `dataset` under `config` with at least `num_samples` samples (whole epochs
    /// of the split's documents; `None`: one epoch). Errors when the split is empty.
    pub fn new(
        dataset: Arc<IndexedDataset>,
        config: &GptDatasetConfig,
        split: Split,
        num_samples: Option<u64>,
    ) -> Result<GptDataset> {
        let Some(sequences) = config.split.sequence_range(split, dataset.len()) else {
            return data_invalid!(
                "the {split} split of {} is empty (split {:?})",
                dataset.prefix().display(),
                config.split.shares()
            );
        };
        GptDataset::with_sequences(
            dataset,
            sequences,
            split,
            config.seq_length,
            num_samples,
            config.seed,
        )
    }

    /// A GPT dataset over the sequences `sequences` of `dataset` (the lower-level constructor).
    pub fn with_sequences(
        dataset: Arc<IndexedDataset>,
        sequences: Range<usize>,
        split: Split,
        seq_length: usize,
        num_samples: Option<u64>,
        seed: u32,
    ) -> Result<GptDataset> {
        let name = dataset.prefix().display().to_string();
        if sequences.end > dataset.len() || sequences.start > sequences.end {
            return data_invalid!(
                "sequences {sequences:?} out of range: {name} has {}",
                dataset.len()
            );
        }
        if seq_length < 2 || seq_length > i32::MAX as usize - 1 {
            return data_invalid!("sequence length {seq_length} must be in 2..2^31 - 1");
        }
        if sequences.end > i32::MAX as usize {
            return data_invalid!("{name}: more than 2^31 sequences are not supported");
        }
        let mut sizes = Vec::with_capacity(sequences.len());
        let mut tokens_per_epoch = 0u64;
        for s in sequences.clone() {
            let n = dataset.sequence_length(s)?;
            tokens_per_epoch += n as u64;
            sizes.push(n as u32);
        }
        if tokens_per_epoch < 2 {
            return data_invalid!(
                "the {split} split of {name} (sequences {sequences:?}) holds {tokens_per_epoch} \
                 tokens; a GPT dataset needs at least 2"
            );
        }
        let seq = seq_length as u64;
        let num_epochs = match num_samples {
            None => 1,
            Some(n) => {
                let requested = n
                    .checked_mul(seq)
                    .and_then(|t| t.checked_add(1))
                    .ok_or_else(|| DataError::Invalid(format!("{n} samples overflow")))?;
                requested.div_ceil(tokens_per_epoch).max(1)
            }
        };
        let separate_final_epoch = match num_samples {
            Some(n) if num_epochs > 1 => {
                let sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) / seq;
                let per_epoch = (tokens_per_epoch - 1) / seq;
                let from_final = n - sans_final;
                debug_assert!(from_final <= per_epoch + 1);
                from_final < (0.80 * per_epoch as f64) as u64
            }
            _ => false,
        };
        let docs = sequences.len() as u64;
        if num_epochs
            .checked_mul(docs)
            .is_none_or(|n| n > i32::MAX as u64)
        {
            return data_invalid!(
                "{num_epochs} epochs of {docs} documents exceed Megatron's int32 document index"
            );
        }
        let total_samples = (num_epochs * tokens_per_epoch - 1) / seq;
        if total_samples >= u64::from(u32::MAX) - 1 {
            return data_invalid!("{total_samples} samples exceed the supported 2^32 - 2");
        }

        let mut rng = RandomState::new(seed);
        let epoch: Vec<i32> = sequences.clone().map(|s| s as i32).collect();
        let repeat = |epochs: u64| -> Vec<i32> {
            let mut v = Vec::with_capacity(epochs as usize * epoch.len());
            for _ in 0..epochs {
                v.extend_from_slice(&epoch);
            }
            v
        };
        let document_index = if separate_final_epoch {
            let mut first = repeat(num_epochs - 1);
            rng.shuffle(&mut first);
            let mut last = repeat(1);
            rng.shuffle(&mut last);
            first.extend_from_slice(&last);
            first
        } else {
            let mut all = repeat(num_epochs);
            rng.shuffle(&mut all);
            all
        };
        let base = sequences.start;
        let sample_index = build_sample_index(
            |d| sizes[d as usize - base],
            &document_index,
            seq_length,
            total_samples,
        );
        let total = (sample_index.len() - 1) as u32;
        let shuffle_index = if separate_final_epoch {
            let sans_final = (((num_epochs - 1) * tokens_per_epoch - 1) / seq) as u32;
            let mut first: Vec<u32> = (0..sans_final).collect();
            rng.shuffle(&mut first);
            let mut last: Vec<u32> = (sans_final..total).collect();
            rng.shuffle(&mut last);
            first.extend_from_slice(&last);
            first
        } else {
            let mut all: Vec<u32> = (0..total).collect();
            rng.shuffle(&mut all);
            all
        };
        Ok(GptDataset {
            dataset,
            split,
            sequences,
            seq_length,
            num_samples,
            num_epochs,
            tokens_per_epoch,
            document_index,
            sample_index,
            shuffle_index,
        })
    }

    /// Number of samples (all whole epochs' samples: at least the number asked for).
    pub fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// Tokens the model sees per sample (samples hold one more).
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }

    /// The split.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The underlying indexed dataset.
    pub fn indexed(&self) -> &Arc<IndexedDataset> {
        &self.dataset
    }

    /// The split's sequences in the indexed dataset.
    pub fn sequences(&self) -> Range<usize> {
        self.sequences.clone()
    }

    /// The number of samples asked for.
    pub fn num_samples(&self) -> Option<u64> {
        self.num_samples
    }

    /// Epochs over the split's documents needed to cover the samples asked for.
    pub fn num_epochs(&self) -> u64 {
        self.num_epochs
    }

    /// Tokens in one epoch of the split.
    pub fn tokens_per_epoch(&self) -> u64 {
        self.tokens_per_epoch
    }

    /// Megatron-LM's document index: sequence ids, epoch after epoch, shuffled.
    pub fn document_index(&self) -> &[i32] {
        &self.document_index
    }

    /// Megatron-LM's sample index: `[position in the document index, token offset]` where
    /// each sample starts, plus one entry past the last.
    pub fn sample_index(&self) -> &[[u32; 2]] {
        &self.sample_index
    }

    /// Megatron-LM's shuffle index: sample `i` is unshuffled sample `shuffle_index[i]`.
    pub fn shuffle_index(&self) -> &[u32] {
        &self.shuffle_index
    }

    /// Sample `i`: `seq_length + 1` token ids (Megatron-LM's
    /// `_query_document_sample_shuffle_indices`).
    pub fn sample(&self, i: u64) -> Result<Vec<u32>> {
        let Some(&idx) = usize::try_from(i)
            .ok()
            .and_then(|i| self.shuffle_index.get(i))
        else {
            return data_invalid!(
                "sample {i} out of range: the {} dataset of {} has {} samples",
                self.split,
                self.dataset.prefix().display(),
                self.len()
            );
        };
        let idx = idx as usize;
        let [beg, beg_off] = self.sample_index[idx].map(|v| v as usize);
        let [end, end_off] = self.sample_index[idx + 1].map(|v| v as usize);
        let mut out = Vec::with_capacity(self.seq_length + 1);
        for k in beg..=end {
            let doc = self.document_index[k] as usize;
            let offset = if k == beg { beg_off } else { 0 };
            let length = if k < end {
                None
            } else {
                Some(end_off + 1 - offset)
            };
            self.dataset
                .get(doc, offset, length)?
                .extend_u32(&mut out)?;
        }
        if out.len() != self.seq_length + 1 {
            return data_invalid!(
                "sample {i} of {} holds {} tokens instead of {} (its index is inconsistent \
                 with the data)",
                self.dataset.prefix().display(),
                out.len(),
                self.seq_length + 1
            );
        }
        Ok(out)
    }
}

impl SampleSource for GptDataset {
    fn len(&self) -> usize {
        GptDataset::len(self)
    }

    fn sample(&self, i: u64) -> Result<Vec<u32>> {
        GptDataset::sample(self, i)
    }
}

/// `helpers.cpp`'s `build_sample_idx` with `drop_last_partial_sequence` and
/// `add_extra_token_to_sequence`: where each of `num_samples` samples of `seq_length + 1` tokens
/// starts in the concatenation of the documents of `document_index`, consecutive samples sharing
/// their boundary token.
fn build_sample_index(
    size_of: impl Fn(i32) -> u32,
    document_index: &[i32],
    seq_length: usize,
    num_samples: u64,
) -> Vec<[u32; 2]> {
    let mut out = Vec::with_capacity(num_samples as usize + 1);
    let mut doc = 0usize;
    let mut offset = 0i64;
    out.push([0, 0]);
    while (out.len() as u64) <= num_samples {
        let mut remaining = seq_length as i64 + 1;
        while remaining != 0 {
            let length = i64::from(size_of(document_index[doc])) - offset;
            remaining -= length;
            if remaining <= 0 {
                offset += remaining + length - 1;
                remaining = 0;
            } else {
                if doc == document_index.len() - 1 {
                    offset = i64::from(size_of(document_index[doc])) - 1;
                    break;
                }
                doc += 1;
                offset = 0;
            }
        }
        out.push([doc as u32, offset as u32]);
    }
    out
}
