//! A file of conversations to a packed dataset: each line rendered and tokenized
//! ([`super::tokenize`]), the conversations packed whole ([`super::pack`]) and written with
//! their loss masks and boundaries (`megatron_core::data::PackedWriter`, docs/packed-data.md).

use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::data::{DType, PackedDocument, PackedWriter};

use super::pack::{Overlong, Packing, first_fit_decreasing, one_per_bin};
use super::{ChatTemplate, Tokenized};
use crate::tokenizer::Tokenizer;

/// How conversations are prepared.
#[derive(Debug, Clone, Copy)]
pub struct PrepareOptions {
    /// The training sequence length the bins are cut for (`seq_length + 1` tokens each).
    pub seq_length: usize,
    /// Only the assistant's tokens count.
    pub answer_only: bool,
    /// Render with the generation prompt, as transformers' `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// What happens to a conversation longer than a bin.
    pub overlong: Overlong,
    /// Pack several conversations into each bin (first-fit decreasing); `false`: one each,
    /// the rest of the bin padding (to compare the two).
    pub pack: bool,
    /// Pad each document with tokens that count nothing (id 0, as a bin's tail) to a multiple
    /// of this many positions, and pack them into `seq_length` positions so that every
    /// document of a sample, the tail's padding too, is such a multiple (1: no padding).
    /// `2·cp` lets context parallelism cut each document over its ranks
    /// (`CpChunks::of_microbatch`).
    pub pad_to_multiple_of: usize,
    /// Tokenizing threads.
    pub workers: usize,
}

/// What [`prepare`] wrote.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Conversations read (the input's non-empty lines).
    pub lines: usize,
    /// The input's line number of each document, in input order (a conversation is one
    /// document, or one per assistant turn where its template rewrites earlier turns:
    /// [`super::tokenize`]).
    pub document_lines: Vec<u64>,
    /// Conversations made into one document per assistant turn.
    pub per_turn: usize,
    /// How the documents were packed (indices into `document_lines`).
    pub packing: Packing,
    /// Conversations with at least one document written.
    pub conversations: usize,
    /// Documents written.
    pub documents: usize,
    /// Tokens that count in the loss.
    pub counted: usize,
    /// Each bin's capacity.
    pub capacity: usize,
}

/// A tokenizer directory's `tokenizer.json` and chat template.
pub fn open_tokenizer(dir: &Path) -> Result<(Tokenizer, ChatTemplate)> {
    if !dir.is_dir() {
        bail!(
            "{}: chat data needs a tokenizer directory (tokenizer.json with \
             tokenizer_config.json and its chat_template)",
            dir.display()
        );
    }
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let template = ChatTemplate::from_dir(dir)?;
    Ok((tokenizer, template))
}

/// Renders every conversation of the JSON-lines file `input` with `tokenizer_dir`'s chat
/// template and packs them into the packed dataset at `output_prefix`; errors name the line.
pub fn prepare(
    input: &Path,
    tokenizer_dir: &Path,
    output_prefix: &Path,
    options: PrepareOptions,
) -> Result<Prepared> {
    let (tokenizer, template) = open_tokenizer(tokenizer_dir)?;
    let file =
        std::fs::File::open(input).with_context(|| format!("{}: cannot open", input.display()))?;
    let mut lines = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| {
            format!(
                "{}: line {} cannot be read as UTF-8 text",
                input.display(),
                i + 1
            )
        })?;
        if !line.trim().is_empty() {
            lines.push((i as u64 + 1, line));
        }
    }
    let encode = |(no, line): &(u64, String)| -> Result<Vec<Tokenized>> {
        let conversation = super::parse(line, *no)?;
        super::tokenize(
            &conversation,
            &template,
            &tokenizer,
            options.answer_only,
            options.add_generation_prompt,
        )
        .with_context(|| format!("line {no}"))
    };
    let conversations = crate::data::in_parallel(&lines, options.workers, encode)
        .with_context(|| input.display().to_string())?;
    let per_turn = conversations.iter().filter(|c| c.len() > 1).count();
    let mut document_lines = Vec::new();
    let mut docs = Vec::new();
    for ((no, _), documents) in lines.iter().zip(conversations) {
        document_lines.extend(std::iter::repeat_n(*no, documents.len()));
        docs.extend(documents);
    }
    let capacity = options.seq_length + 1;
    let multiple = options.pad_to_multiple_of.max(1);
    // Padded documents fill at most the sequence's positions (the bin's last token, a target
    // only, is then the tail's padding).
    let room = match multiple {
        1 => capacity,
        m if options.seq_length.is_multiple_of(m) => options.seq_length,
        m => bail!(
            "--pad-to-multiple-of {m} does not divide --seq-length {}: the last document of a \
             sequence would not be a multiple",
            options.seq_length
        ),
    };
    for d in &mut docs {
        let padded = d.tokens.len().next_multiple_of(multiple);
        d.tokens.resize(padded, 0);
        d.counts.resize(padded, false);
    }
    let lengths: Vec<usize> = docs.iter().map(|d| d.tokens.len()).collect();
    let name = |i: usize| format!("line {}", document_lines[i]);
    let packing = match options.pack {
        true => first_fit_decreasing(&lengths, room, options.overlong, name),
        false => one_per_bin(&lengths, room, options.overlong, name),
    }
    .with_context(|| input.display().to_string())?;
    let dtype = DType::optimal(tokenizer.vocab_size());
    let mut writer = PackedWriter::create(output_prefix, dtype, capacity)?;
    let mut counted = 0;
    let mut written = std::collections::BTreeSet::new();
    for bin in &packing.bins {
        written.extend(bin.iter().map(|&i| document_lines[i]));
        let documents: Vec<PackedDocument> = bin
            .iter()
            .map(|&i| {
                let n = docs[i].tokens.len().min(room);
                PackedDocument {
                    tokens: docs[i].tokens[..n].to_vec(),
                    counts: docs[i].counts[..n].to_vec(),
                }
            })
            .collect();
        counted += documents
            .iter()
            .map(|d| d.counts.iter().filter(|&&c| c).count())
            .sum::<usize>();
        writer.add_bin(&documents)?;
    }
    writer.finish()?;
    Ok(Prepared {
        lines: lines.len(),
        document_lines,
        per_turn,
        documents: packing.bins.iter().map(Vec::len).sum(),
        packing,
        conversations: written.len(),
        counted,
        capacity,
    })
}
