//! Training batches from a token stream: deterministic samples of `seq + 1` tokens, the same on
//! every rank, cut into data-parallel shares and microbatches.

use std::sync::Arc;

use super::masks::{MaskFlags, Microbatch, eod_loss_mask};
use crate::data::SampleSource;
use crate::documents::Documents;
use crate::error::Result;
use crate::invalid;
use crate::rng::splitmix64_mix;
use crate::tensor::Tensor;

/// A stream of token ids with a vocabulary.
#[derive(Debug, Clone)]
pub struct TokenStream {
    tokens: Arc<Vec<u32>>,
    vocab_size: usize,
}

impl TokenStream {
    /// Bytes as tokens of a 256-symbol vocabulary (byte-level tokenizer: no files needed).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        TokenStream {
            tokens: Arc::new(bytes.iter().map(|&b| u32::from(b)).collect()),
            vocab_size: 256,
        }
    }

    /// Any token ids below `vocab_size`.
    pub fn new(tokens: Vec<u32>, vocab_size: usize) -> Result<Self> {
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|&(_, &t)| t as usize >= vocab_size)
        {
            return invalid!("token {t} at position {i} is outside the vocabulary of {vocab_size}");
        }
        Ok(TokenStream {
            tokens: Arc::new(tokens),
            vocab_size,
        })
    }

    /// The first `fraction` of the tokens and the rest (a train/validation split by position).
    pub fn split(&self, fraction: f64) -> (TokenStream, TokenStream) {
        let cut = ((self.tokens.len() as f64) * fraction.clamp(0.0, 1.0)) as usize;
        let part = |r: std::ops::Range<usize>| TokenStream {
            tokens: Arc::new(self.tokens[r].to_vec()),
            vocab_size: self.vocab_size,
        };
        (part(0..cut), part(cut..self.tokens.len()))
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

/// How a global batch is cut: samples per step, per microbatch, and the data-parallel size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// Tokens per sample (the model's sequence length).
    pub seq_length: usize,
    /// Samples in one microbatch on one rank.
    pub micro_batch: usize,
    /// Samples per step over all data-parallel ranks.
    pub global_batch: usize,
    /// Data-parallel size.
    pub dp: usize,
}

impl BatchPlan {
    /// Checks that the global batch cuts into whole microbatches on every data-parallel rank.
    pub fn validate(&self) -> Result<()> {
        let per_step = self.micro_batch.saturating_mul(self.dp);
        if self.seq_length == 0 || self.micro_batch == 0 || self.global_batch == 0 {
            return invalid!("sequence length, micro batch and global batch must be at least 1");
        }
        if !self.global_batch.is_multiple_of(per_step) {
            return invalid!(
                "--global-batch-size {} is not divisible by --micro-batch-size {} × \
                 --data-parallel-size {} = {per_step}",
                self.global_batch,
                self.micro_batch,
                self.dp
            );
        }
        if self.microbatches() > crate::limits::MAX_SCHEDULE_PASSES {
            return invalid!(
                "--global-batch-size {} over --micro-batch-size {} × data-parallel size {} is {} \
                 microbatches per step, more than megatron-rs accepts (at most {})",
                self.global_batch,
                self.micro_batch,
                self.dp,
                self.microbatches(),
                crate::limits::MAX_SCHEDULE_PASSES
            );
        }
        Ok(())
    }

    /// Microbatches each data-parallel rank runs per step (gradient accumulation).
    pub fn microbatches(&self) -> usize {
        self.global_batch / (self.micro_batch * self.dp)
    }

    /// Index, over the whole step, of a rank's microbatch (the same on every layout).
    pub fn global_microbatch(&self, dp_rank: usize, micro: usize) -> usize {
        dp_rank * self.microbatches() + micro
    }
}

/// Random windows of `seq_length + 1` tokens of a token stream (a text file read as bytes):
/// sample `i` starts at a position drawn from `(seed, i)`.
#[derive(Debug, Clone)]
pub struct Windows {
    stream: TokenStream,
    seq_length: usize,
    seed: u64,
}

impl Windows {
    /// Windows of `seq_length + 1` tokens of `stream`.
    pub fn new(stream: TokenStream, seq_length: usize, seed: u64) -> Result<Windows> {
        if stream.len() <= seq_length + 1 {
            return invalid!(
                "the data has {} tokens, fewer than one sample of {seq_length} + 1",
                stream.len()
            );
        }
        Ok(Windows {
            stream,
            seq_length,
            seed,
        })
    }
}

impl SampleSource for Windows {
    /// The number of distinct windows.
    fn len(&self) -> usize {
        self.stream.len() - self.seq_length - 1
    }

    fn sample(&self, i: u64) -> crate::data::Result<Vec<u32>> {
        let span = self.len() as u64;
        let start = (splitmix64_mix(
            self.seed ^ splitmix64_mix(i.wrapping_add(0x51_7cc1_b727_220a)),
        ) % span) as usize;
        Ok(self.stream.tokens[start..start + self.seq_length + 1].to_vec())
    }
}

/// The run's samples cut into steps, data-parallel shares and microbatches: sample
/// `step · global_batch + g · micro_batch + j` is the `j`-th of global microbatch `g` of the
/// step, whatever the layout (so dp = 2 sees the samples dp = 1 sees).
#[derive(Clone)]
pub struct Sampler {
    source: Arc<dyn SampleSource>,
    plan: BatchPlan,
    masks: MaskFlags,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("samples", &self.source.len())
            .field("plan", &self.plan)
            .field("masks", &self.masks)
            .finish()
    }
}

impl Sampler {
    /// Batches of `source`'s samples (each `plan.seq_length + 1` tokens); a run that needs more
    /// samples than the source has starts over from its first.
    pub fn new(source: Arc<dyn SampleSource>, plan: BatchPlan) -> Result<Sampler> {
        plan.validate()?;
        if source.is_empty() {
            return invalid!("the data has no samples");
        }
        Ok(Sampler {
            source,
            plan,
            masks: MaskFlags::default(),
        })
    }

    /// The same samples masked as `masks` say (Megatron-LM's GPTDataset flags).
    pub fn with_masks(self, masks: MaskFlags) -> Result<Sampler> {
        masks.validate()?;
        Ok(Sampler { masks, ..self })
    }

    /// The masking flags.
    pub fn masks(&self) -> &MaskFlags {
        &self.masks
    }

    /// Batches of random windows of a token stream.
    pub fn windows(stream: TokenStream, plan: BatchPlan, seed: u64) -> Result<Sampler> {
        Sampler::new(Arc::new(Windows::new(stream, plan.seq_length, seed)?), plan)
    }

    /// The batch plan.
    pub fn plan(&self) -> &BatchPlan {
        &self.plan
    }

    /// The samples.
    pub fn source(&self) -> &Arc<dyn SampleSource> {
        &self.source
    }

    /// Tokens and targets `[seq, micro_batch]` (i64, sequence first) of one microbatch.
    pub fn microbatch(&self, step: u64, dp_rank: usize, micro: usize) -> Result<(Tensor, Tensor)> {
        let (s, b) = (self.plan.seq_length, self.plan.micro_batch);
        let mut tokens = vec![0i64; s * b];
        let mut targets = vec![0i64; s * b];
        for j in 0..b {
            let k = self.sample_index(step, dp_rank, micro, j);
            let window = self.source.sample(k)?;
            if window.len() != s + 1 {
                return invalid!(
                    "sample {k} has {} tokens, the model takes {s} + 1",
                    window.len()
                );
            }
            for i in 0..s {
                tokens[i * b + j] = i64::from(window[i]);
                targets[i * b + j] = i64::from(window[i + 1]);
            }
        }
        Ok((
            Tensor::from_vec(tokens, [s, b])?,
            Tensor::from_vec(targets, [s, b])?,
        ))
    }
}

impl Sampler {
    /// The index in the source of sample `j` of microbatch `micro` of data-parallel rank
    /// `dp_rank` at step `step`.
    fn sample_index(&self, step: u64, dp_rank: usize, micro: usize, j: usize) -> u64 {
        let b = self.plan.micro_batch;
        let first = step * self.plan.global_batch as u64
            + (self.plan.global_microbatch(dp_rank, micro) * b) as u64;
        (first + j as u64) % self.source.len() as u64
    }

    /// Whether some targets may not count: the end-of-document mask, or the samples' own
    /// masks (chat data's answers, an evaluation's padding).
    pub fn masks_loss(&self) -> bool {
        self.masks.masks_loss() || self.source.has_loss_mask()
    }

    /// Whether microbatches carry documents: the reset flags, or packed samples.
    pub fn reads_documents(&self) -> bool {
        self.masks.reads_documents() || self.source.has_documents()
    }

    /// One microbatch with its masks: which targets count (the samples' own masks, and
    /// Megatron-LM's `_get_ltor_masks_and_position_ids` on the input tokens), and the samples'
    /// documents when the run resets positions or attention at them.
    pub fn batch(&self, step: u64, dp_rank: usize, micro: usize) -> Result<Microbatch> {
        let (tokens, targets) = self.microbatch(step, dp_rank, micro)?;
        let m = self.masks;
        let (s, b) = (self.plan.seq_length, self.plan.micro_batch);
        let mut loss_mask = None;
        if self.source.has_loss_mask() {
            let mut mask = vec![1.0f32; s * b];
            for j in 0..b {
                let k = self.sample_index(step, dp_rank, micro, j);
                let Some(own) = self.source.loss_mask(k)? else {
                    continue;
                };
                if own.len() != s {
                    return invalid!(
                        "sample {k}'s loss mask has {} values, the model takes {s}",
                        own.len()
                    );
                }
                for (i, &counts) in own.iter().enumerate() {
                    mask[i * b + j] = f32::from(u8::from(counts != 0));
                }
            }
            loss_mask = Some(mask);
        }
        // Packed samples bring their documents, which reset positions and attention both.
        let mut own_documents = None;
        if self.source.has_documents() {
            let mut starts = Vec::with_capacity(b);
            for j in 0..b {
                starts.push(
                    self.source
                        .documents(self.sample_index(step, dp_rank, micro, j))?,
                );
            }
            own_documents = Some(starts);
        }
        let Some(eod) = m.eod.filter(|_| m.masks_loss() || m.reads_documents()) else {
            let documents = match own_documents {
                Some(starts) => Some(Documents::from_starts(
                    s,
                    starts.into_iter().map(Option::unwrap_or_default).collect(),
                    true,
                    true,
                )?),
                None => None,
            };
            return Ok(Microbatch {
                tokens,
                targets,
                loss_mask,
                documents,
            });
        };
        let ids = tokens.to_vec::<i64>()?;
        let documents = match (own_documents, m.reads_documents()) {
            (None, true) => Some(Documents::from_tokens(
                &ids,
                s,
                b,
                eod,
                m.reset_position_ids,
                m.reset_attention_mask,
            )?),
            (None, false) => None,
            (Some(starts), _) => {
                // A sample of token data beside packed ones: its documents at its
                // end-of-document tokens when both resets are asked for, else one document.
                let by_eod = (m.reset_position_ids && m.reset_attention_mask)
                    .then(|| Documents::from_tokens(&ids, s, b, eod, true, true))
                    .transpose()?;
                let starts = starts
                    .into_iter()
                    .enumerate()
                    .map(|(j, own)| match (own, &by_eod) {
                        (Some(own), _) => own,
                        (None, Some(d)) => d.segments(j).iter().skip(1).map(|r| r.start).collect(),
                        (None, None) => Vec::new(),
                    })
                    .collect();
                Some(Documents::from_starts(s, starts, true, true)?)
            }
        };
        if m.masks_loss() {
            let eod_mask = eod_loss_mask(&ids, eod);
            loss_mask = Some(match loss_mask {
                Some(own) => own.iter().zip(&eod_mask).map(|(a, b)| a * b).collect(),
                None => eod_mask,
            });
        }
        Ok(Microbatch {
            loss_mask,
            tokens,
            targets,
            documents,
        })
    }

    /// The targets counted in step `step`'s global batch (over every data-parallel rank's
    /// microbatches; `None` when every target counts).
    pub fn step_counted(&self, step: u64) -> Result<Option<usize>> {
        if !self.masks_loss() {
            return Ok(None);
        }
        let mut counted = 0;
        for micro in 0..self.plan.microbatches() * self.plan.dp {
            counted += self.batch(step, 0, micro)?.counted();
        }
        Ok(Some(counted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microbatches_are_the_same_samples_on_every_layout() {
        let text: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        let stream = TokenStream::from_bytes(&text);
        let one = Sampler::windows(
            stream.clone(),
            BatchPlan {
                seq_length: 8,
                micro_batch: 2,
                global_batch: 8,
                dp: 1,
            },
            5,
        )
        .unwrap();
        let two = Sampler::windows(
            stream,
            BatchPlan {
                seq_length: 8,
                micro_batch: 2,
                global_batch: 8,
                dp: 2,
            },
            5,
        )
        .unwrap();
        assert_eq!(one.plan().microbatches(), 4);
        assert_eq!(two.plan().microbatches(), 2);
        for step in 0..3 {
            for g in 0..4 {
                let a = one.microbatch(step, 0, g).unwrap();
                let b = two.microbatch(step, g / 2, g % 2).unwrap();
                assert_eq!(a.0.to_vec::<i64>().unwrap(), b.0.to_vec::<i64>().unwrap());
            }
        }
        let (tokens, targets) = one.microbatch(0, 0, 0).unwrap();
        let (t, y) = (
            tokens.to_vec::<i64>().unwrap(),
            targets.to_vec::<i64>().unwrap(),
        );
        // targets are the tokens shifted by one, sequence-first.
        assert_eq!(t[2..], y[..y.len() - 2]);
        assert_ne!(
            one.microbatch(1, 0, 0).unwrap().0.to_vec::<i64>().unwrap(),
            t
        );
    }

    #[test]
    fn bad_plans_are_errors() {
        let plan = BatchPlan {
            seq_length: 8,
            micro_batch: 3,
            global_batch: 8,
            dp: 2,
        };
        assert_eq!(
            plan.validate().unwrap_err().to_string(),
            "--global-batch-size 8 is not divisible by --micro-batch-size 3 × --data-parallel-size 2 = 6"
        );
        let short = Sampler::windows(
            TokenStream::from_bytes(b"abc"),
            BatchPlan {
                seq_length: 8,
                micro_batch: 1,
                global_batch: 1,
                dp: 1,
            },
            0,
        );
        assert!(
            short
                .unwrap_err()
                .to_string()
                .contains("fewer than one sample")
        );
    }
}
