//! Packed documents with loss masks: fine-tuning data whose sequences each hold several whole
//! documents (conversations) and say which of their tokens count in the loss.
//!
//! A packed dataset is a Megatron-LM indexed dataset (`PREFIX.bin`, `PREFIX.idx`: one sequence
//! per packed bin, readable by Megatron-LM as any token dataset) with a sidecar,
//! `PREFIX.packed`, holding what the tokens alone cannot say: where each bin's documents
//! start, and which tokens count as predicted targets. Its layout (little-endian, documented in
//! docs/packed-data.md):
//!
//! | bytes | what |
//! | --- | --- |
//! | 8 | magic `MGRSPACK` |
//! | 4 | version, 1 |
//! | 4 | the bins' capacity, `seq_length + 1` tokens |
//! | 8 | bins `B` (the indexed dataset's sequences) |
//! | 8 | documents `D` |
//! | 8 | tokens `T` (the indexed dataset's tokens) |
//! | 8·(B + 1) | the first document of each bin, and `D` (cumulative document counts) |
//! | 4·D | each document's tokens, bin after bin |
//! | T | per token, 1 when it counts as a predicted target (its loss counts), else 0 |
//!
//! [`PackedDataset`] reads one split of the bins as training samples of `seq_length + 1`
//! tokens (a bin shorter than that is padded with tokens that count nothing, in a document of
//! their own), shuffled by seed epoch after epoch, each sample with its loss mask and its
//! documents ([`SampleSource::loss_mask`], [`SampleSource::documents`]).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::error::{DataError, Result};
use super::gpt::{GptDatasetConfig, Split};
use super::indexed::IndexedDataset;
use super::numpy_rng::RandomState;
use super::{IndexedDatasetBuilder, SampleSource};
use crate::files::write_atomically;

/// The sidecar's first bytes.
pub const PACKED_MAGIC: &[u8; 8] = b"MGRSPACK";
/// The sidecar's format version.
pub const PACKED_VERSION: u32 = 1;
const HEADER: usize = 40;

/// `PREFIX.packed`.
pub fn packed_path(prefix: impl AsRef<Path>) -> PathBuf {
    let mut p = prefix.as_ref().as_os_str().to_owned();
    p.push(".packed");
    PathBuf::from(p)
}

/// Whether the indexed dataset at `prefix` has a packed sidecar.
pub fn is_packed(prefix: impl AsRef<Path>) -> bool {
    packed_path(prefix).is_file()
}

/// One document as the packer places it: its tokens and which of them count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedDocument {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Per token, whether it counts as a predicted target.
    pub counts: Vec<bool>,
}

/// Writes a packed dataset: the indexed dataset and its sidecar, each complete or not there
/// (written aside and renamed into place).
pub struct PackedWriter {
    tokens: IndexedDatasetBuilder,
    sidecar: PathBuf,
    bin_starts: Vec<u64>,
    lengths: Vec<u32>,
    mask: Vec<u8>,
    capacity: u32,
}

impl PackedWriter {
    /// A writer of `PREFIX.bin`, `PREFIX.idx` and `PREFIX.packed` with tokens stored as
    /// `dtype`, for bins of at most `capacity` tokens (a sample's `seq_length + 1`).
    pub fn create(prefix: impl AsRef<Path>, dtype: super::DType, capacity: usize) -> Result<Self> {
        let capacity = u32::try_from(capacity).map_err(|_| {
            DataError::Invalid(format!(
                "bins of {capacity} tokens do not fit the format's u32"
            ))
        })?;
        Ok(PackedWriter {
            capacity,
            tokens: IndexedDatasetBuilder::create(&prefix, dtype)?,
            sidecar: packed_path(&prefix),
            bin_starts: vec![0],
            lengths: Vec::new(),
            mask: Vec::new(),
        })
    }

    /// Adds one bin of whole documents.
    pub fn add_bin(&mut self, documents: &[PackedDocument]) -> Result<()> {
        let total: usize = documents.iter().map(|d| d.tokens.len()).sum();
        if total > self.capacity as usize {
            return Err(DataError::Invalid(format!(
                "a bin of {total} tokens, more than its capacity of {}",
                self.capacity
            )));
        }
        let mut tokens = Vec::new();
        for d in documents {
            if d.tokens.len() != d.counts.len() || d.tokens.is_empty() {
                return Err(DataError::Invalid(format!(
                    "a packed document of {} tokens with {} mask values",
                    d.tokens.len(),
                    d.counts.len()
                )));
            }
            tokens.extend_from_slice(&d.tokens);
            self.lengths.push(d.tokens.len() as u32);
            self.mask.extend(d.counts.iter().map(|&c| u8::from(c)));
        }
        self.tokens.add_document(&tokens, &[tokens.len()])?;
        self.bin_starts.push(self.lengths.len() as u64);
        Ok(())
    }

    /// Bins written so far.
    pub fn bins(&self) -> usize {
        self.bin_starts.len() - 1
    }

    /// Finishes the three files: the indexed dataset, then the sidecar (when the sidecar
    /// cannot be written, the indexed dataset is removed again: no data without its masks).
    pub fn finish(self) -> Result<()> {
        let mut bytes = Vec::with_capacity(
            HEADER + 8 * self.bin_starts.len() + 4 * self.lengths.len() + self.mask.len(),
        );
        bytes.extend_from_slice(PACKED_MAGIC);
        bytes.extend_from_slice(&PACKED_VERSION.to_le_bytes());
        bytes.extend_from_slice(&self.capacity.to_le_bytes());
        for n in [self.bins(), self.lengths.len(), self.mask.len()] {
            bytes.extend_from_slice(&(n as u64).to_le_bytes());
        }
        for start in &self.bin_starts {
            bytes.extend_from_slice(&start.to_le_bytes());
        }
        for len in &self.lengths {
            bytes.extend_from_slice(&len.to_le_bytes());
        }
        bytes.extend_from_slice(&self.mask);
        let (bin, idx) = self.tokens.finish()?;
        if let Err((path, cause)) = write_atomically(&self.sidecar, &bytes) {
            let _ = std::fs::remove_file(bin);
            let _ = std::fs::remove_file(idx);
            return Err(DataError::Io {
                path,
                action: "write",
                cause,
            });
        }
        Ok(())
    }
}

/// A packed sidecar, memory-mapped.
pub struct PackedSidecar {
    path: PathBuf,
    map: Mmap,
    capacity: usize,
    bins: usize,
    documents: usize,
    tokens: usize,
}

impl std::fmt::Debug for PackedSidecar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedSidecar")
            .field("path", &self.path)
            .field("bins", &self.bins)
            .field("documents", &self.documents)
            .finish()
    }
}

impl PackedSidecar {
    /// Opens `PREFIX.packed` and checks it against the indexed dataset it describes.
    pub fn open(prefix: impl AsRef<Path>, dataset: &IndexedDataset) -> Result<Self> {
        let path = packed_path(&prefix);
        let bad = |message: String| DataError::Format {
            path: path.clone(),
            message,
        };
        let file = File::open(&path).map_err(|cause| DataError::Io {
            path: path.clone(),
            action: "open",
            cause,
        })?;
        // SAFETY: the map is read only; a file changed under it by another process is a
        // caller error the checks below may not catch, as for the indexed dataset's own maps.
        let map = unsafe { Mmap::map(&file) }.map_err(|cause| DataError::Io {
            path: path.clone(),
            action: "map",
            cause,
        })?;
        if map.len() < HEADER || &map[..8] != PACKED_MAGIC {
            return Err(bad("not a packed sidecar (no MGRSPACK header)".into()));
        }
        let u32_at = |at: usize| u32::from_le_bytes(map[at..at + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |at: usize| u64::from_le_bytes(map[at..at + 8].try_into().unwrap_or([0; 8]));
        if u32_at(8) != PACKED_VERSION {
            return Err(bad(format!(
                "version {}, megatron-rs reads {PACKED_VERSION}",
                u32_at(8)
            )));
        }
        let (bins, documents, tokens) = (u64_at(16), u64_at(24), u64_at(32));
        let want = (HEADER as u64)
            .checked_add(8 * (bins + 1))
            .and_then(|n| n.checked_add(4 * documents))
            .and_then(|n| n.checked_add(tokens));
        if want != Some(map.len() as u64) {
            return Err(bad(format!(
                "{} bytes, but {bins} bins of {documents} documents and {tokens} tokens take {}",
                map.len(),
                want.map_or("more than 2^64".into(), |w| w.to_string())
            )));
        }
        if bins as usize != dataset.len() || tokens != dataset.num_tokens() {
            return Err(bad(format!(
                "describes {bins} bins of {tokens} tokens, but {} has {} sequences of {} tokens",
                dataset.bin_path().display(),
                dataset.len(),
                dataset.num_tokens()
            )));
        }
        let sidecar = PackedSidecar {
            path: path.clone(),
            capacity: u32_at(12) as usize,
            map,
            bins: bins as usize,
            documents: documents as usize,
            tokens: tokens as usize,
        };
        for b in 0..sidecar.bins {
            let lengths: usize = sidecar.lengths(b).iter().map(|&l| l as usize).sum();
            if lengths != dataset.sequence_length(b)? {
                return Err(bad(format!(
                    "bin {b}'s documents hold {lengths} tokens, its sequence {}",
                    dataset.sequence_length(b)?
                )));
            }
        }
        Ok(sidecar)
    }

    /// Bins.
    pub fn bins(&self) -> usize {
        self.bins
    }

    /// The most tokens a bin holds: the `seq_length + 1` the data was packed for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Documents over all bins.
    pub fn documents(&self) -> usize {
        self.documents
    }

    fn bin_start(&self, b: usize) -> usize {
        let at = HEADER + 8 * b;
        u64::from_le_bytes(self.map[at..at + 8].try_into().unwrap_or([0; 8])) as usize
    }

    /// The token counts of bin `b`'s documents.
    pub fn lengths(&self, b: usize) -> Vec<u32> {
        let (first, end) = (self.bin_start(b), self.bin_start(b + 1));
        let base = HEADER + 8 * (self.bins + 1);
        (first..end.max(first))
            .filter(|&d| d < self.documents)
            .map(|d| {
                let at = base + 4 * d;
                u32::from_le_bytes(self.map[at..at + 4].try_into().unwrap_or([0; 4]))
            })
            .collect()
    }

    /// Which of bin `b`'s tokens count as predicted targets (`first_token` is the bin's first
    /// token in the dataset, `len` its length).
    pub fn counts(&self, first_token: usize, len: usize) -> &[u8] {
        let base = HEADER + 8 * (self.bins + 1) + 4 * self.documents;
        let end = (first_token + len).min(self.tokens);
        &self.map[base + first_token.min(end)..base + end]
    }
}

/// One split of a packed dataset as training samples (see the module's documentation).
pub struct PackedDataset {
    dataset: Arc<IndexedDataset>,
    sidecar: PackedSidecar,
    /// The first token of every bin in the dataset.
    first_tokens: Vec<usize>,
    seq_length: usize,
    /// Bins, epoch after epoch, shuffled.
    order: Vec<u32>,
    /// Samples after `order`'s that count nothing (an evaluation's last batch filled up).
    padding: usize,
}

impl std::fmt::Debug for PackedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedDataset")
            .field("prefix", &self.dataset.prefix())
            .field("samples", &self.order.len())
            .finish()
    }
}

impl PackedDataset {
    /// Split `split` of the packed dataset at `dataset`'s prefix: `num_samples` samples (its
    /// bins once when `None`), bins shuffled by `config.seed` in every epoch.
    pub fn new(
        dataset: Arc<IndexedDataset>,
        config: &GptDatasetConfig,
        split: Split,
        num_samples: Option<u64>,
    ) -> Result<PackedDataset> {
        let sidecar = PackedSidecar::open(dataset.prefix(), &dataset)?;
        let Some(bins) = config.split.sequence_range(split, dataset.len()) else {
            return Err(DataError::Invalid(format!(
                "the {} split of {} has no packed sequences",
                split.name(),
                dataset.prefix().display()
            )));
        };
        let mut first_tokens = Vec::with_capacity(dataset.len());
        let mut at = 0;
        for b in 0..dataset.len() {
            first_tokens.push(at);
            let len = dataset.sequence_length(b)?;
            if len > config.seq_length + 1 {
                return Err(DataError::Invalid(format!(
                    "{}: packed sequence {b} holds {len} tokens, more than --seq-length {} + 1 \
                     (the data was packed for a longer sequence: preprocess it again)",
                    dataset.prefix().display(),
                    config.seq_length
                )));
            }
            at += len;
        }
        let count = bins.len() as u64;
        let wanted = num_samples.unwrap_or(count);
        let epochs = wanted.div_ceil(count.max(1)).max(1);
        let mut rng = RandomState::new(config.seed);
        let mut order = Vec::with_capacity((epochs * count) as usize);
        for _ in 0..epochs {
            let mut epoch: Vec<u32> = bins.clone().map(|b| b as u32).collect();
            rng.shuffle(&mut epoch);
            order.extend(epoch);
        }
        order.truncate(wanted as usize);
        Ok(PackedDataset {
            dataset,
            sidecar,
            first_tokens,
            seq_length: config.seq_length,
            order,
            padding: 0,
        })
    }

    /// Every bin once, in order (a held-out set for evaluation), followed by samples that count
    /// nothing up to a multiple of `multiple` samples.
    pub fn in_order(
        dataset: Arc<IndexedDataset>,
        seq_length: usize,
        multiple: usize,
    ) -> Result<PackedDataset> {
        let config = GptDatasetConfig::new(seq_length, 0);
        let mut d = PackedDataset::new(dataset, &config, Split::Train, None)?;
        d.order.sort_unstable();
        let n = d.order.len();
        d.padding = n.div_ceil(multiple.max(1)) * multiple.max(1) - n;
        Ok(d)
    }

    /// The samples the bins make (without the padding).
    pub fn samples(&self) -> usize {
        self.order.len()
    }

    fn bin(&self, i: u64) -> Result<Option<usize>> {
        match self.order.get(i as usize) {
            Some(&b) => Ok(Some(b as usize)),
            None if (i as usize) < self.len() => Ok(None),
            None => Err(DataError::Invalid(format!(
                "sample {i} out of range: the packed dataset has {} samples",
                self.len()
            ))),
        }
    }
}

impl SampleSource for PackedDataset {
    fn len(&self) -> usize {
        self.order.len() + self.padding
    }

    fn sample(&self, i: u64) -> Result<Vec<u32>> {
        let Some(b) = self.bin(i)? else {
            return Ok(vec![0; self.seq_length + 1]);
        };
        let mut out = self.dataset.sequence(b)?.to_u32_vec()?;
        // Padding: token 0, in a document of its own, counting nothing.
        out.resize(self.seq_length + 1, 0);
        Ok(out)
    }

    fn loss_mask(&self, i: u64) -> Result<Option<Vec<u8>>> {
        let Some(b) = self.bin(i)? else {
            return Ok(Some(vec![0; self.seq_length]));
        };
        let len = self.dataset.sequence_length(b)?;
        let counts = self.sidecar.counts(self.first_tokens[b], len);
        // The loss at position p predicts token p + 1.
        Ok(Some(
            (0..self.seq_length)
                .map(|p| counts.get(p + 1).copied().unwrap_or(0))
                .collect(),
        ))
    }

    fn has_loss_mask(&self) -> bool {
        true
    }

    fn documents(&self, i: u64) -> Result<Option<Vec<usize>>> {
        let Some(b) = self.bin(i)? else {
            return Ok(Some(Vec::new()));
        };
        let mut starts = Vec::new();
        let mut at = 0;
        for len in self.sidecar.lengths(b) {
            at += len as usize;
            if at < self.seq_length {
                starts.push(at);
            }
        }
        Ok(Some(starts))
    }

    fn has_documents(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DType;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("megatron-packed-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("data")
    }

    fn doc(tokens: &[u32], counts: &[u8]) -> PackedDocument {
        PackedDocument {
            tokens: tokens.to_vec(),
            counts: counts.iter().map(|&c| c == 1).collect(),
        }
    }

    /// Two bins: documents of 3 and 2 tokens, then one of 4.
    fn write(prefix: &Path) {
        let mut w = PackedWriter::create(prefix, DType::U16, 6).unwrap();
        w.add_bin(&[doc(&[1, 2, 3], &[0, 1, 1]), doc(&[4, 5], &[0, 1])])
            .unwrap();
        w.add_bin(&[doc(&[6, 7, 8, 9], &[0, 0, 1, 1])]).unwrap();
        let err = w.add_bin(&[doc(&[1; 7], &[0; 7])]).unwrap_err();
        assert!(
            err.to_string().contains("more than its capacity of 6"),
            "{err}"
        );
        w.finish().unwrap();
    }

    #[test]
    fn samples_carry_the_shifted_mask_and_their_documents() {
        let prefix = scratch("samples");
        write(&prefix);
        assert!(is_packed(&prefix));
        let dataset = Arc::new(IndexedDataset::open(&prefix).unwrap());
        let sidecar = PackedSidecar::open(&prefix, &dataset).unwrap();
        assert_eq!(
            (sidecar.bins(), sidecar.documents(), sidecar.capacity()),
            (2, 3, 6)
        );
        assert_eq!(sidecar.lengths(0), [3, 2]);
        let d = PackedDataset::in_order(dataset, 5, 4).unwrap();
        assert_eq!((d.samples(), d.len()), (2, 4));
        // Bin 0, padded to 6 tokens with 0.
        assert_eq!(d.sample(0).unwrap(), [1, 2, 3, 4, 5, 0]);
        // The target of position p is token p + 1: 2 and 3 count, 4 (a new document) not,
        // 5 does, the padding not.
        assert_eq!(d.loss_mask(0).unwrap().unwrap(), [1, 1, 0, 1, 0]);
        assert_eq!(d.documents(0).unwrap().unwrap(), [3]);
        assert_eq!(d.sample(1).unwrap(), [6, 7, 8, 9, 0, 0]);
        assert_eq!(d.loss_mask(1).unwrap().unwrap(), [0, 1, 1, 0, 0]);
        // The padding is a document of its own.
        assert_eq!(d.documents(1).unwrap().unwrap(), [4]);
        // Samples that fill the last batch count nothing.
        assert_eq!(d.loss_mask(3).unwrap().unwrap(), [0; 5]);
        assert!(d.sample(4).is_err());
    }

    #[test]
    fn a_sidecar_that_does_not_describe_its_dataset_is_refused_by_name() {
        let prefix = scratch("bad");
        write(&prefix);
        let dataset = IndexedDataset::open(&prefix).unwrap();
        let path = packed_path(&prefix);
        let good = std::fs::read(&path).unwrap();
        let mut truncated = good.clone();
        truncated.pop();
        std::fs::write(&path, &truncated).unwrap();
        let err = PackedSidecar::open(&prefix, &dataset)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data.packed") && err.contains("bytes, but 2 bins"),
            "{err}"
        );
        let mut magic = good.clone();
        magic[0] = b'X';
        std::fs::write(&path, &magic).unwrap();
        let err = PackedSidecar::open(&prefix, &dataset)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MGRSPACK"), "{err}");
        // A document's length that does not add up to its bin.
        let mut lengths = good;
        lengths[HEADER + 8 * 3] = 9;
        std::fs::write(&path, &lengths).unwrap();
        let err = PackedSidecar::open(&prefix, &dataset)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bin 0's documents hold"), "{err}");
        // Data packed for longer sequences than the run's.
        write(&prefix);
        let config = GptDatasetConfig::new(3, 1);
        let err = PackedDataset::new(Arc::new(dataset), &config, Split::Train, None).unwrap_err();
        assert!(
            err.to_string().contains("more than --seq-length 3 + 1"),
            "{err}"
        );
    }
}
