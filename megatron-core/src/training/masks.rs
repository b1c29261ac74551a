//! Megatron-LM's masks of a training sample (`_get_ltor_masks_and_position_ids` in
//! `megatron/core/datasets/gpt_dataset.py`), as a pure function of its tokens and the flags,
//! and how the counted tokens weigh in the loss.
//!
//! * `--eod-mask-loss`: a position whose *input* token is the end-of-document token does not
//!   count (predicting the next document's first token from the end of this one).
//! * `--reset-position-ids`, `--reset-attention-mask`: the sample's documents
//!   ([`Documents`]), each ended by an end-of-document token that belongs to it.
//! * `--calculate-per-token-loss`: the loss is the sum over the global batch's counted tokens
//!   over their number; without it (Megatron-LM's default) each microbatch's loss is the mean
//!   over its own counted tokens and the step's loss the mean of its microbatches' (the
//!   gradient weighs a token by `1 / (its microbatch's count × microbatches)`). Both are the
//!   plain mean when every token counts; with masks they differ when microbatches count
//!   different numbers of tokens, and the per-token form is the one that weighs every counted
//!   token alike.

use crate::documents::Documents;
use crate::error::Result;
use crate::invalid;
use crate::tensor::Tensor;

/// The masking flags of a run's data (Megatron-LM's names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaskFlags {
    /// The token that ends a document (`None`: the tokenizer has none; every flag below but
    /// `calculate_per_token_loss` needs one).
    pub eod: Option<u32>,
    /// `--eod-mask-loss`.
    pub eod_mask_loss: bool,
    /// `--reset-position-ids`.
    pub reset_position_ids: bool,
    /// `--reset-attention-mask`.
    pub reset_attention_mask: bool,
    /// `--calculate-per-token-loss`.
    pub calculate_per_token_loss: bool,
}

impl MaskFlags {
    /// Checks that the flags that read documents have an end-of-document token.
    pub fn validate(&self) -> Result<()> {
        if self.eod.is_none() && (self.masks_loss() || self.reads_documents()) {
            return invalid!(
                "--eod-mask-loss, --reset-position-ids and --reset-attention-mask read the \
                 end-of-document token, and the tokenizer has none (give it one with --eod-token)"
            );
        }
        Ok(())
    }

    /// Whether some tokens may not count in the loss.
    pub fn masks_loss(&self) -> bool {
        self.eod_mask_loss
    }

    /// Whether the microbatches carry their documents (positions or attention reset at them).
    pub fn reads_documents(&self) -> bool {
        self.reset_position_ids || self.reset_attention_mask
    }
}

/// One microbatch of a rank: its token ids and targets (`[s, b]`, sequence first), which
/// targets count in the loss, and its packed documents when the run keeps them apart.
#[derive(Debug, Clone)]
pub struct Microbatch {
    /// Input token ids `[s, b]` (i64).
    pub tokens: Tensor,
    /// Target token ids `[s, b]` (i64).
    pub targets: Tensor,
    /// `1` where a target counts, `0` where it does not, sequence first (`None`: all count).
    pub loss_mask: Option<Vec<f32>>,
    /// The samples' documents, with the flags' choices.
    pub documents: Option<Documents>,
}

impl Microbatch {
    /// The number of targets that count.
    pub fn counted(&self) -> usize {
        match &self.loss_mask {
            Some(mask) => mask.iter().filter(|&&m| m != 0.0).count(),
            None => self.targets.numel(),
        }
    }
}

/// Megatron-LM's loss mask of a microbatch's input tokens (`[s, b]` flattened, sequence
/// first): 0 where the token is `eod`, else 1.
pub fn eod_loss_mask(tokens: &[i64], eod: u32) -> Vec<f32> {
    tokens
        .iter()
        .map(|&t| if t == i64::from(eod) { 0.0 } else { 1.0 })
        .collect()
}

/// The backward's weight of each counted token of one microbatch, `loss_scale` times the
/// derivative of the step's loss by the token's loss: `counted` targets in the microbatch,
/// `step_counted` in the step's global batch of `microbatches` microbatches. `None` when the
/// microbatch counts nothing (its tokens weigh 0).
pub fn token_weight(
    flags: &MaskFlags,
    loss_scale: f32,
    counted: usize,
    step_counted: usize,
    microbatches: usize,
) -> Option<f32> {
    if counted == 0 {
        return None;
    }
    let denominator = match flags.calculate_per_token_loss {
        true => step_counted as f64,
        false => counted as f64 * microbatches as f64,
    };
    Some((f64::from(loss_scale) / denominator) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_of_document_input_does_not_count() {
        // Megatron: loss_mask[data == eod_token] = 0.0, on the inputs.
        assert_eq!(eod_loss_mask(&[5, 0, 7, 0], 0), [1.0, 0.0, 1.0, 0.0]);
    }

    #[test]
    fn weights_follow_megatrons_two_normalizations() {
        let default = MaskFlags::default();
        let per_token = MaskFlags {
            calculate_per_token_loss: true,
            ..default
        };
        // Two microbatches counting 3 and 1 tokens: by default each is a mean, halved.
        assert_eq!(token_weight(&default, 1.0, 3, 4, 2), Some(1.0 / 6.0));
        assert_eq!(token_weight(&default, 1.0, 1, 4, 2), Some(0.5));
        // Per token: every counted token weighs 1/4.
        assert_eq!(token_weight(&per_token, 1.0, 3, 4, 2), Some(0.25));
        assert_eq!(token_weight(&per_token, 8.0, 1, 4, 2), Some(2.0));
        assert_eq!(token_weight(&per_token, 1.0, 0, 4, 2), None);
    }

    #[test]
    fn flags_that_read_documents_need_their_end() {
        let flags = MaskFlags {
            reset_attention_mask: true,
            ..MaskFlags::default()
        };
        assert!(
            flags
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--eod-token")
        );
        assert!(
            MaskFlags {
                eod: Some(2),
                ..flags
            }
            .validate()
            .is_ok()
        );
    }
}
