//! `megatron preprocess --chat`: conversations rendered with the tokenizer directory's own chat
//! template, the assistant's tokens marked as the ones that count, packed whole into sequences
//! and written as a packed dataset (docs/packed-data.md).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use megatron::chat::pack::{Overlong, first_fit_decreasing};
use megatron::chat::{self, ChatTemplate, Tokenized};
use megatron::core::data::{DType, PackedDocument, PackedWriter};
use megatron::tokenizer::Tokenizer;

use super::output::say;

/// What `--chat` needs of `megatron preprocess`'s arguments.
#[derive(Debug)]
pub struct ChatJob<'a> {
    /// The JSON-lines file.
    pub input: &'a Path,
    /// The tokenizer directory (tokenizer.json, tokenizer_config.json).
    pub tokenizer: &'a Path,
    /// Where the packed dataset goes (`PREFIX.bin`, `.idx`, `.packed`).
    pub output_prefix: &'a Path,
    /// The training sequence length the bins are cut for (`seq_length + 1` tokens each).
    pub seq_length: usize,
    /// Only the assistant's tokens count.
    pub answer_only: bool,
    /// Render with the generation prompt, as transformers' `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// What happens to a conversation longer than a bin.
    pub overlong: Overlong,
    /// Tokenizing threads.
    pub workers: usize,
}

/// The tokenizer directory's `tokenizer.json` and chat template.
fn open_tokenizer(dir: &Path) -> Result<(Tokenizer, ChatTemplate)> {
    if !dir.is_dir() {
        bail!(
            "--tokenizer {}: --chat needs a tokenizer directory (tokenizer.json with \
             tokenizer_config.json and its chat_template)",
            dir.display()
        );
    }
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let template = ChatTemplate::from_dir(dir)?;
    Ok((tokenizer, template))
}

/// Runs `megatron preprocess --chat`.
pub fn run(job: &ChatJob<'_>) -> Result<()> {
    let start = Instant::now();
    let (tokenizer, template) = open_tokenizer(job.tokenizer)
        .with_context(|| format!("--tokenizer {}", job.tokenizer.display()))?;
    let file = std::fs::File::open(job.input)
        .with_context(|| format!("--input {}: cannot open", job.input.display()))?;
    let mut lines = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| {
            format!(
                "--input {}: line {} cannot be read as UTF-8 text",
                job.input.display(),
                i + 1
            )
        })?;
        if !line.trim().is_empty() {
            lines.push((i as u64 + 1, line));
        }
    }
    let encode = |(no, line): &(u64, String)| -> Result<Tokenized> {
        let conversation = chat::parse(line, *no)?;
        chat::tokenize(
            &conversation,
            &template,
            &tokenizer,
            job.answer_only,
            job.add_generation_prompt,
        )
        .with_context(|| format!("line {no}"))
    };
    let docs = in_parallel(&lines, job.workers, encode)
        .with_context(|| job.input.display().to_string())?;
    let capacity = job.seq_length + 1;
    let lengths: Vec<usize> = docs.iter().map(|d| d.tokens.len()).collect();
    let packing = first_fit_decreasing(&lengths, capacity, job.overlong, |i| {
        format!("line {}", lines[i].0)
    })
    .with_context(|| job.input.display().to_string())?;
    let mut writer = PackedWriter::create(
        job.output_prefix,
        DType::optimal(tokenizer.vocab_size()),
        capacity,
    )?;
    let (mut counted, mut conversations) = (0usize, 0usize);
    for bin in &packing.bins {
        let documents: Vec<PackedDocument> = bin
            .iter()
            .map(|&i| {
                let d = &docs[i];
                let n = d.tokens.len().min(capacity);
                PackedDocument {
                    tokens: d.tokens[..n].to_vec(),
                    counts: d.counts[..n].to_vec(),
                }
            })
            .collect();
        counted += documents
            .iter()
            .map(|d| d.counts.iter().filter(|&&c| c).count())
            .sum::<usize>();
        conversations += documents.len();
        writer.add_bin(&documents)?;
    }
    let bins = writer.bins();
    writer.finish()?;
    say!(
        "{}.{{bin,idx,packed}}: {conversations} conversations in {bins} sequences of {capacity} \
         tokens ({:.1}% filled), {} tokens of which {counted} count in the loss{}",
        job.output_prefix.display(),
        100.0 * packing.fill(capacity),
        packing.tokens,
        if job.answer_only {
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
                .map(|&i| lines[i].0.to_string())
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
        lines.len(),
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}

/// `f` of every item on `workers` threads, in order; the first error wins.
fn in_parallel<T: Sync, U: Send>(
    items: &[T],
    workers: usize,
    f: impl Fn(&T) -> Result<U> + Sync,
) -> Result<Vec<U>> {
    if workers <= 1 || items.len() < 2 {
        return items.iter().map(&f).collect();
    }
    let chunk = items.len().div_ceil(workers);
    let f = &f;
    let parts: Vec<Result<Vec<U>>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|part| s.spawn(move || part.iter().map(f).collect::<Result<Vec<U>>>()))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a tokenizing thread panicked"))?
            })
            .collect()
    });
    let mut out = Vec::with_capacity(items.len());
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}
