//! Packed documents: where each sample of a microbatch has its documents, for the positions
//! and the attention masks that keep them apart.
//!
//! Megatron-LM's `_get_ltor_masks_and_position_ids` (`megatron/core/datasets/gpt_dataset.py`)
//! reads the documents of a sample from its end-of-document tokens: a document ends at an
//! end-of-document token (which belongs to the document it ends) and the next starts right
//! after it. With `--reset-position-ids` the positions restart at 0 at each document's start;
//! with `--reset-attention-mask` a token attends only to the earlier tokens of its own document.
//!
//! [`Documents`] holds those boundaries for one microbatch (`[s, b]`, sequence first) and the
//! two choices. The layers read it from the context ([`crate::module::Cx::documents`]):
//! attention runs each document of each sample as a sequence of its own (the variable-length
//! form of FlashAttention's `cu_seqlens`: a pair of a query and a key of different documents is
//! never computed, not masked), and the rotary and learned positions turn each run of rows at
//! its document's positions ([`map_runs`], [`each_run`]).

use std::ops::Range;

use crate::error::Result;
use crate::invalid;
use crate::tensor::Tensor;

/// Runs of rows, each with the position of its first row (or what a caller pairs with it).
pub type Runs = Vec<(Range<usize>, usize)>;

/// The documents of each sample of a microbatch, and what they change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    seq: usize,
    /// Per sample, the first position of every document after the first (sorted, in
    /// `1..seq`).
    starts: Vec<Vec<usize>>,
    reset_positions: bool,
    separate_attention: bool,
}

impl Documents {
    /// The documents of `batch` samples of `seq` tokens (`tokens[i · batch + j]` is token `i`
    /// of sample `j`, sequence first), ended by `eod`: positions restart after each one when
    /// `reset_positions`, attention stays inside each when `separate_attention`.
    pub fn from_tokens(
        tokens: &[i64],
        seq: usize,
        batch: usize,
        eod: u32,
        reset_positions: bool,
        separate_attention: bool,
    ) -> Result<Documents> {
        if tokens.len() != seq * batch {
            return invalid!(
                "documents: {} tokens are not {seq} positions × {batch} samples",
                tokens.len()
            );
        }
        let starts = (0..batch)
            .map(|j| {
                (0..seq.saturating_sub(1))
                    .filter(|&i| tokens[i * batch + j] == i64::from(eod))
                    .map(|i| i + 1)
                    .collect()
            })
            .collect();
        Ok(Documents {
            seq,
            starts,
            reset_positions,
            separate_attention,
        })
    }

    /// Documents given by their starts after the first, per sample (for tests and packed
    /// data whose boundaries are stored beside the tokens).
    pub fn from_starts(
        seq: usize,
        starts: Vec<Vec<usize>>,
        reset_positions: bool,
        separate_attention: bool,
    ) -> Result<Documents> {
        for (j, s) in starts.iter().enumerate() {
            if s.windows(2).any(|w| w[0] >= w[1]) || s.iter().any(|&p| p == 0 || p >= seq) {
                return invalid!(
                    "documents: sample {j}'s starts {s:?} are not increasing positions in 1..{seq}"
                );
            }
        }
        Ok(Documents {
            seq,
            starts,
            reset_positions,
            separate_attention,
        })
    }

    /// Positions per sample.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Samples.
    pub fn batch(&self) -> usize {
        self.starts.len()
    }

    /// Whether positions restart at each document (`--reset-position-ids`).
    pub fn resets_positions(&self) -> bool {
        self.reset_positions
    }

    /// Whether a token attends only to its own document (`--reset-attention-mask`).
    pub fn separates_attention(&self) -> bool {
        self.separate_attention
    }

    /// How many documents start inside the samples after their first position (0: every
    /// sample is one document, and the flags change nothing).
    pub fn boundaries(&self) -> usize {
        self.starts.iter().map(Vec::len).sum()
    }

    /// The document of every position, sample after sample (`[batch, seq]`), as its first
    /// position and the position after its last.
    pub fn spans(&self) -> Vec<(usize, usize)> {
        let mut spans = Vec::with_capacity(self.batch() * self.seq);
        for j in 0..self.batch() {
            for r in self.segments(j) {
                spans.extend(std::iter::repeat_n((r.start, r.end), r.len()));
            }
        }
        spans
    }

    /// The documents of sample `sample`, in order: ranges of positions covering `0..seq`.
    pub fn segments(&self, sample: usize) -> Vec<Range<usize>> {
        let starts = &self.starts[sample];
        std::iter::once(0)
            .chain(starts.iter().copied())
            .zip(starts.iter().copied().chain(std::iter::once(self.seq)))
            .map(|(a, b)| a..b)
            .collect()
    }

    /// The position of sequence position `p` of sample `sample`: `p` less its document's start
    /// when positions restart, else `p`.
    pub fn position(&self, sample: usize, p: usize) -> usize {
        if !self.reset_positions {
            return p;
        }
        let starts = &self.starts[sample];
        let k = starts.partition_point(|&s| s <= p);
        p - if k == 0 { 0 } else { starts[k - 1] }
    }

    /// Rows `run` of sample `sample` (sequence positions) cut where a document starts: each
    /// part as its rows counted from `run.start`, and the position of its first row.
    pub fn runs_in(&self, sample: usize, run: Range<usize>) -> Runs {
        let mut cuts: Vec<usize> = match self.reset_positions {
            true => self.starts[sample]
                .iter()
                .copied()
                .filter(|&s| s > run.start && s < run.end)
                .collect(),
            false => Vec::new(),
        };
        cuts.insert(0, run.start);
        cuts.push(run.end);
        cuts.windows(2)
            .filter(|w| w[0] < w[1])
            .map(|w| {
                (
                    w[0] - run.start..w[1] - run.start,
                    self.position(sample, w[0]),
                )
            })
            .collect()
    }

    /// Where local rows lie, per sample: the rows of `runs` (runs of sequence positions, in
    /// local order) cut at document starts, each as local rows and its first position.
    pub fn local_runs(&self, sample: usize, runs: &[Range<usize>]) -> Runs {
        let mut at = 0;
        let mut out = Vec::new();
        for run in runs {
            for (rows, first) in self.runs_in(sample, run.clone()) {
                out.push((at + rows.start..at + rows.end, first));
            }
            at += run.len();
        }
        out
    }
}

/// `x` (`[rows, b, w]`) with each run of each sample's rows replaced by
/// `f(part, sample, first)`, where `part` is the run as `[len, 1, w]` and `first` what
/// `runs(sample)` gave with it (a position); `f` returns `[len, 1, w_out]`. The runs of a
/// sample must cover its rows.
pub fn map_runs(
    x: &Tensor,
    runs: impl Fn(usize) -> Runs,
    mut f: impl FnMut(&Tensor, usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let [rows, batch, _] = *x.dims() else {
        return invalid!(
            "documents: expected [sequence, batch, width], got {}",
            x.shape()
        );
    };
    let by_sample = x.transpose(0, 1)?.contiguous()?;
    let mut out: Option<Tensor> = None;
    for j in 0..batch {
        let mut covered = 0;
        for (run, first) in runs(j) {
            let part = by_sample
                .narrow(0, j, 1)?
                .narrow(1, run.start, run.len())?
                .reshape([run.len(), 1, x.last_dim()])?;
            let y = f(&part, j, first)?;
            let width = y.last_dim();
            let out = match &mut out {
                Some(out) => out,
                None => out.insert(Tensor::empty_near([batch, rows, width], y.dtype(), x)?),
            };
            out.narrow(0, j, 1)?
                .narrow(1, run.start, run.len())?
                .copy_from(&y.reshape([1, run.len(), width])?)?;
            covered += run.len();
        }
        if covered != rows {
            return invalid!("documents: sample {j}'s runs cover {covered} of {rows} rows");
        }
    }
    match out {
        Some(out) => Ok(out.transpose(0, 1)?.contiguous()?),
        None => Ok(x.clone()),
    }
}

/// Calls `f(part, sample, first)` for each run of each sample's rows of `x` (`[rows, b, w]`),
/// `part` the run as `[len, 1, w]`.
pub fn each_run(
    x: &Tensor,
    runs: impl Fn(usize) -> Runs,
    mut f: impl FnMut(&Tensor, usize, usize) -> Result<()>,
) -> Result<()> {
    let [_, batch, width] = *x.dims() else {
        return invalid!(
            "documents: expected [sequence, batch, width], got {}",
            x.shape()
        );
    };
    let by_sample = x.transpose(0, 1)?.contiguous()?;
    for j in 0..batch {
        for (run, first) in runs(j) {
            let part = by_sample
                .narrow(0, j, 1)?
                .narrow(1, run.start, run.len())?
                .reshape([run.len(), 1, width])?;
            f(&part, j, first)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two samples of 6 tokens, sequence first; 9 ends documents.
    fn docs(reset: bool) -> Documents {
        // sample 0: 1 9 | 2 3 9 | 4 ; sample 1: 5 6 7 8 1 2 (one document)
        let s0 = [1, 9, 2, 3, 9, 4];
        let s1 = [5, 6, 7, 8, 1, 2];
        let tokens: Vec<i64> = (0..6).flat_map(|i| [s0[i], s1[i]]).collect();
        Documents::from_tokens(&tokens, 6, 2, 9, reset, true).unwrap()
    }

    #[test]
    fn documents_end_at_the_end_of_document_token_as_megatron_reads_them() {
        let d = docs(true);
        assert_eq!(d.segments(0), vec![0..2, 2..5, 5..6]);
        assert_eq!(d.segments(1), vec![0..6]);
        assert_eq!(d.boundaries(), 2);
        // Megatron's position_ids for sample 0: 0 1 0 1 2 0.
        let positions: Vec<usize> = (0..6).map(|p| d.position(0, p)).collect();
        assert_eq!(positions, [0, 1, 0, 1, 2, 0]);
        assert_eq!(docs(false).position(0, 4), 4);
        // A run of rows 1..5 cuts at 2 and 5 is outside.
        assert_eq!(d.runs_in(0, 1..5), vec![(0..1, 1), (1..4, 0)]);
        // Local rows of two context-parallel chunks 0..2 and 4..6.
        assert_eq!(
            d.local_runs(0, &[0..2, 4..6]),
            vec![(0..2, 0), (2..3, 2), (3..4, 0)]
        );
        // An end-of-document token in the last position starts nothing.
        let last = Documents::from_tokens(&[1, 9], 2, 1, 9, true, true).unwrap();
        assert_eq!(last.segments(0), vec![0..2]);
    }

    #[test]
    fn runs_map_each_sample_in_place() {
        // x[i, j, 0] = 10·i + j; f adds 100 × the run's first position and 1000 × its length.
        let x = Tensor::from_vec(
            (0..6)
                .flat_map(|i| (0..2).map(move |j| (10 * i + j) as f32))
                .collect::<Vec<_>>(),
            [6, 2, 1],
        )
        .unwrap();
        let d = docs(true);
        let y = map_runs(
            &x,
            |j| d.runs_in(j, 0..6),
            |part, _, first| {
                let v: Vec<f32> = part.to_vec().unwrap();
                Tensor::from_vec(
                    v.iter()
                        .map(|a| a + (100 * first + 1000 * v.len()) as f32)
                        .collect(),
                    part.dims().to_vec(),
                )
                .map_err(Into::into)
            },
        )
        .unwrap();
        let y: Vec<f32> = y.to_vec().unwrap();
        // Sample 0's documents are 2, 3 and 1 rows long, sample 1's one of 6.
        assert_eq!(
            y,
            [
                2000., 6001., 2010., 6011., 3020., 6021., 3030., 6031., 3040., 6041., 1050., 6051.
            ]
        );
        let mut seen = Vec::new();
        each_run(
            &x,
            |j| d.runs_in(j, 1..5),
            |p, j, first| {
                seen.push((j, p.dims()[0], first));
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(seen, vec![(0, 1, 1), (0, 3, 0), (1, 4, 1)]);
    }

    #[test]
    fn bad_starts_are_refused() {
        assert!(Documents::from_starts(4, vec![vec![2, 2]], true, true).is_err());
        assert!(Documents::from_starts(4, vec![vec![4]], true, true).is_err());
        assert!(Documents::from_tokens(&[1, 2, 3], 2, 2, 9, true, true).is_err());
    }
}
