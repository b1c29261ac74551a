//! `megatron preprocess --chat`: conversations rendered with the tokenizer directory's own chat
//! template, the assistant's tokens marked as the ones that count, packed whole into sequences
//! and written as a packed dataset (docs/packed-data.md).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use megatron::chat::prepare::{PrepareOptions, prepare};

use super::output::say;

/// Runs `megatron preprocess --chat`.
pub fn run(
    input: &Path,
    tokenizer: &Path,
    output_prefix: &Path,
    options: PrepareOptions,
) -> Result<()> {
    let start = Instant::now();
    let done = prepare(input, tokenizer, output_prefix, options).with_context(|| {
        format!(
            "--input {} --tokenizer {}",
            input.display(),
            tokenizer.display()
        )
    })?;
    let packing = &done.packing;
    say!(
        "{}.{{bin,idx,packed}}: {} conversations in {} sequences of {} tokens ({:.1}% filled), \
         {} tokens of which {} count in the loss{}",
        output_prefix.display(),
        done.conversations,
        packing.bins.len(),
        done.capacity,
        100.0 * packing.fill(done.capacity),
        packing.tokens,
        done.counted,
        if options.answer_only {
            " (the assistant's)"
        } else {
            ""
        }
    )?;
    if !packing.dropped.is_empty() || !packing.truncated.is_empty() {
        let lines_of = |ids: &[usize]| -> String {
            let shown: Vec<String> = ids
                .iter()
                .take(8)
                .map(|&i| done.lines[i].to_string())
                .collect();
            let more = if ids.len() > 8 { ", ..." } else { "" };
            format!("{}{more}", shown.join(", "))
        };
        say!(
            "longer than a sequence: {} dropped (lines {}), {} truncated (lines {})",
            packing.dropped.len(),
            lines_of(&packing.dropped),
            packing.truncated.len(),
            lines_of(&packing.truncated)
        )?;
    }
    say!(
        "{} lines in {:.1} s",
        done.lines.len(),
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}
