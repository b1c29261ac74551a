//! Megatron-LM's masking flags of the training data (`--eod-mask-loss`, `--reset-position-ids`,
//! `--reset-attention-mask`, `--calculate-per-token-loss`), shared by `train` and `eval`.

use clap::Args;
use megatron::data::SampleSource;
use megatron::training::MaskFlags;

/// The masking flags, named and meant as Megatron-LM's (`megatron/training/arguments.py`).
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct MaskArgs {
    /// Positions whose input token ends a document do not count in the loss.
    #[arg(long)]
    pub eod_mask_loss: bool,
    /// Positions restart at 0 after each end-of-document token (learned and rotary positions).
    #[arg(long)]
    pub reset_position_ids: bool,
    /// A token attends only to the earlier tokens of its own document (the end-of-document
    /// token belongs to the document it ends).
    #[arg(long)]
    pub reset_attention_mask: bool,
    /// The loss is the sum over the global batch's counted tokens over their number, instead
    /// of the mean of each microbatch's mean (README: "Masked data").
    #[arg(long)]
    pub calculate_per_token_loss: bool,
}

impl MaskArgs {
    /// The flags for data whose documents end with `eod`.
    pub fn flags(&self, eod: Option<u32>) -> MaskFlags {
        MaskFlags {
            eod,
            eod_mask_loss: self.eod_mask_loss,
            reset_position_ids: self.reset_position_ids,
            reset_attention_mask: self.reset_attention_mask,
            calculate_per_token_loss: self.calculate_per_token_loss,
        }
    }

    /// The flags given, as on the command line.
    pub fn given(&self) -> Vec<&'static str> {
        [
            (self.eod_mask_loss, "--eod-mask-loss"),
            (self.reset_position_ids, "--reset-position-ids"),
            (self.reset_attention_mask, "--reset-attention-mask"),
            (self.calculate_per_token_loss, "--calculate-per-token-loss"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

/// Samples looked at to say whether the flags that read documents find any.
const LOOKED_AT: usize = 64;

/// A line for the run to print once when flags that read end-of-document tokens find none in
/// the data's first samples (they are allowed, and change nothing there), else `None`.
pub fn unused_flags_note(flags: &MaskFlags, data: &dyn SampleSource) -> Option<String> {
    let eod = flags.eod?;
    let reading = [
        (flags.eod_mask_loss, "--eod-mask-loss"),
        (flags.reset_position_ids, "--reset-position-ids"),
        (flags.reset_attention_mask, "--reset-attention-mask"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect::<Vec<_>>();
    if reading.is_empty() {
        return None;
    }
    let looked = data.len().min(LOOKED_AT);
    let found = (0..looked as u64).any(|i| data.sample(i).is_ok_and(|s| s.contains(&eod)));
    (!found).then(|| {
        format!(
            "{}: the first {looked} samples have no end-of-document token ({eod}), so these \
             flags change nothing there (text read as bytes has none: preprocess it with \
             --append-eod)",
            reading.join(" ")
        )
    })
}
