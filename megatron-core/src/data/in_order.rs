//! A held-out set read whole and in order, for evaluation: every token of indexed datasets
//! once, cut into samples as Megatron-LM's `GPTDataset` cuts its document stream (sample `i`
//! is tokens `i·s .. i·s + s + 1` of the sequences concatenated, consecutive samples sharing
//! one token) but without a split and without shuffling, the last batch filled with samples
//! that count nothing.

use std::sync::Arc;

use super::SampleSource;
use super::error::{DataError, Result};
use super::indexed::IndexedDataset;

/// The samples of datasets in order (see the module's documentation).
pub struct InOrder {
    datasets: Vec<Arc<IndexedDataset>>,
    /// Where each sequence starts in the concatenated stream: (first token, dataset,
    /// sequence), in order.
    starts: Vec<(u64, usize, usize)>,
    seq: usize,
    /// The samples the tokens make, and the samples with the padding.
    real: usize,
    padded: usize,
}

impl std::fmt::Debug for InOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InOrder")
            .field("datasets", &self.datasets.len())
            .field("seq", &self.seq)
            .field("samples", &self.real)
            .field("padded", &self.padded)
            .finish()
    }
}

impl InOrder {
    /// The samples of `seq + 1` tokens of `datasets`' sequences in order, padded up to a
    /// multiple of `multiple` samples (a global batch).
    pub fn new(datasets: Vec<Arc<IndexedDataset>>, seq: usize, multiple: usize) -> Result<Self> {
        let mut starts = Vec::new();
        let mut total = 0u64;
        for (d, ds) in datasets.iter().enumerate() {
            for i in 0..ds.len() {
                let n = ds.sequence_length(i)? as u64;
                if n > 0 {
                    starts.push((total, d, i));
                    total += n;
                }
            }
        }
        if seq == 0 || total <= seq as u64 {
            return Err(DataError::Invalid(format!(
                "the data has {total} tokens, fewer than one sample of {seq} + 1"
            )));
        }
        let real = ((total - 1) / seq as u64) as usize;
        let padded = real.div_ceil(multiple.max(1)) * multiple.max(1);
        Ok(InOrder {
            datasets,
            starts,
            seq,
            real,
            padded,
        })
    }

    /// The samples the data makes (without the padding).
    pub fn samples(&self) -> usize {
        self.real
    }
}

impl SampleSource for InOrder {
    fn len(&self) -> usize {
        self.padded
    }

    fn sample(&self, i: u64) -> Result<Vec<u32>> {
        let n = self.seq + 1;
        if i as usize >= self.real {
            return Ok(vec![0; n]);
        }
        let mut at = i * self.seq as u64;
        let mut out = Vec::with_capacity(n);
        let mut k = self.starts.partition_point(|s| s.0 <= at) - 1;
        while out.len() < n {
            let (first, d, s) = self.starts[k];
            let ds = &self.datasets[d];
            let offset = (at - first) as usize;
            let take = (ds.sequence_length(s)? - offset).min(n - out.len());
            ds.get(s, offset, Some(take))?.extend_u32(&mut out)?;
            at += take as u64;
            k += 1;
        }
        Ok(out)
    }

    fn loss_mask(&self, i: u64) -> Result<Option<Vec<u8>>> {
        Ok((i as usize >= self.real).then(|| vec![0; self.seq]))
    }

    fn has_loss_mask(&self) -> bool {
        self.padded > self.real
    }
}
