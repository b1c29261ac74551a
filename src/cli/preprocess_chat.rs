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
        "{}.{{bin,idx,packed}}: {} conversations{} in {} sequences of {} tokens ({:.1}% \
         filled), {} tokens of which {} count in the loss{}",
        output_prefix.display(),
        done.conversations,
        match done.documents == done.conversations {
            true => String::new(),
            false => format!(" as {} documents", done.documents),
        },
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
                .map(|&i| done.document_lines[i].to_string())
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
    if done.per_turn > 0 {
        say!(
            "{} conversations made one document per assistant turn: the chat template renders \
             earlier turns differently once later turns follow (each turn trains on the context \
             the template gives it)",
            done.per_turn
        )?;
    }
    say!(
        "{} lines in {:.1} s",
        done.lines,
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}
