//! `megatron inspect --pp N`: how evenly the stages share the work. Each pipeline rank's model
//! FLOPs per token (its transformer layers, and on the last rank the output layer, the loss
//! and multi-token prediction's depths), the most loaded rank against the mean, and the uneven split Megatron-LM's flags
//! (`--decoder-first-pipeline-num-layers`, `--decoder-last-pipeline-num-layers`) allow that
//! loads the most loaded rank least: a pipeline runs at its slowest stage's pace, so that ratio
//! is what its bubble grows by.

use std::fmt::Write as _;

use anyhow::Result;
use megatron::models::GptConfig;
use megatron::pipeline_parallel::PipelineLayout;
use serde_json::{Value, json};

/// One split's load per pipeline rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// `--decoder-first-pipeline-num-layers` and `--decoder-last-pipeline-num-layers` (`None`:
    /// not given).
    pub first: Option<usize>,
    pub last: Option<usize>,
    /// Model FLOPs per token of each rank's stages.
    pub per_rank: Vec<f64>,
}

impl Split {
    /// The most loaded rank's FLOPs over the mean.
    pub fn max_over_mean(&self) -> f64 {
        let max = self.per_rank.iter().copied().fold(0.0, f64::max);
        let mean = self.per_rank.iter().sum::<f64>() / self.per_rank.len().max(1) as f64;
        if mean > 0.0 { max / mean } else { 1.0 }
    }

    fn flags(&self) -> String {
        let mut flags = Vec::new();
        if let Some(n) = self.first {
            flags.push(format!("--decoder-first-pipeline-num-layers {n}"));
        }
        if let Some(n) = self.last {
            flags.push(format!("--decoder-last-pipeline-num-layers {n}"));
        }
        match flags.is_empty() {
            true => "the even split".to_string(),
            false => flags.join(" "),
        }
    }

    fn json(&self) -> Value {
        json!({
            "decoder_first_pipeline_num_layers": self.first,
            "decoder_last_pipeline_num_layers": self.last,
            "flops_per_token_per_rank": self.per_rank,
            "max_over_mean": self.max_over_mean(),
        })
    }
}

/// The split given and the most balanced one.
#[derive(Debug, Clone, PartialEq)]
pub struct Balance {
    /// The split of the flags given.
    pub given: Split,
    /// The split that loads the most loaded rank least (the given one when no other does
    /// better).
    pub best: Split,
}

/// The load of `config` on `pp` ranks of `vpp` chunks, at sequence length `seq`, for the split
/// `first`/`last` given, and the most balanced split.
pub fn balance(
    config: &GptConfig,
    (pp, vpp): (usize, usize),
    seq: usize,
    (first, last): (Option<usize>, Option<usize>),
) -> Result<Balance> {
    let layers = config.num_layers;
    // A transformer layer's FLOPs per token, and the last stage's own: the output layer's (its
    // product forward and the two backward: 6 per table entry; the loss is negligible beside
    // it) and multi-token prediction's depths, if any (each a layer and the output layer again).
    let without_mtp = GptConfig {
        mtp: None,
        ..config.clone()
    };
    let whole = without_mtp.flops_per_token(seq, 1);
    let without_layers = GptConfig {
        num_layers: 0,
        ..without_mtp.clone()
    }
    .flops_per_token(seq, 1);
    let layer = (whole - without_layers) / layers.max(1) as f64;
    let depths = config.flops_per_token(seq, 1) - whole;
    let head = 6.0 * (config.padded_vocab_size(1) * config.hidden_size) as f64 + depths;
    let split = |first: Option<usize>, last: Option<usize>| -> Option<Split> {
        let layout = PipelineLayout::new(layers, pp, vpp, first, last).ok()?;
        let per_rank = (0..pp)
            .map(|rank| {
                (0..vpp)
                    .map(|chunk| {
                        let part = layout.part(rank, chunk);
                        part.layers.len() as f64 * layer + if part.last { head } else { 0.0 }
                    })
                    .sum()
            })
            .collect();
        Some(Split {
            first,
            last,
            per_rank,
        })
    };
    let given = split(first, last).ok_or_else(|| {
        anyhow::anyhow!("the layers do not divide over the stages as the flags give them")
    })?;
    // The splits train takes: each end left out or given at least one layer.
    let choices = std::iter::once(None).chain((1..=layers).map(Some));
    let mut best = given.clone();
    for first in choices.clone() {
        for last in choices.clone() {
            if let Some(s) = split(first, last)
                && s.max_over_mean() < best.max_over_mean() - 1e-9
            {
                best = s;
            }
        }
    }
    Ok(Balance { given, best })
}

impl Balance {
    /// The report's lines.
    pub fn text(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "load (model MFLOP per token of each rank's stages, the output layer on the last): \
             {} {:?}, the most loaded rank {:.3}× the mean",
            self.given.flags(),
            self.given
                .per_rank
                .iter()
                .map(|f| (f / 1e6 * 10.0).round() / 10.0)
                .collect::<Vec<_>>(),
            self.given.max_over_mean()
        );
        if self.best != self.given {
            let _ = writeln!(
                out,
                "  most balanced: {} ({:.3}× the mean)",
                self.best.flags(),
                self.best.max_over_mean()
            );
        } else {
            let _ = writeln!(
                out,
                "  the most balanced split Megatron-LM's uneven-stage flags allow"
            );
        }
    }

    /// The report as JSON.
    pub fn json(&self) -> Value {
        json!({ "given": self.given.json(), "most_balanced": self.best.json() })
    }
}
