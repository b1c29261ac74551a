//! `megatron tokenizer train`: a byte-level BPE tokenizer (GPT-2's kind) trained on JSON lines,
//! so that the path from raw text to training needs no download.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use megatron::tokenizer::{ENDOFTEXT, Tokenizer, train_byte_level_bpe};

use super::output::say;
use super::preprocess::{JsonLines, key_texts, parse_line};
use super::values;

/// Arguments of `megatron tokenizer`.
#[derive(Debug, Args)]
pub struct TokenizerArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Debug, Subcommand)]
enum Which {
    /// Train a byte-level BPE tokenizer (GPT-2's kind, with <|endoftext|>) on JSON lines and
    /// write it as a Hugging Face tokenizer.json.
    Train(TrainArgs),
}

/// Arguments of `megatron tokenizer train`.
#[derive(Debug, Args)]
struct TrainArgs {
    #[command(flatten)]
    corpus: JsonLines,
    /// Most tokens in the vocabulary: 256 byte symbols, <|endoftext|>, and the merges learned.
    #[arg(long, value_parser = values::vocab)]
    vocab_size: usize,
    /// Where to write the tokenizer.json.
    #[arg(long)]
    output: PathBuf,
}

/// Runs `megatron tokenizer`.
pub fn run(args: &TokenizerArgs) -> Result<()> {
    match &args.which {
        Which::Train(train) => run_train(train),
    }
}

fn run_train(args: &TrainArgs) -> Result<()> {
    let file = File::open(&args.corpus.input)
        .with_context(|| format!("--input {}: cannot open", args.corpus.input.display()))?;
    // The lines stream into the trainer; the first bad one stops it and is reported.
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let documents = Mutex::new(0u64);
    let keys = &args.corpus.json_keys;
    let texts = BufReader::new(file)
        .lines()
        .zip(1u64..)
        .map_while(|(line, no)| {
            let texts = line
                .with_context(|| format!("{}: reading line {no}", args.corpus.input.display()))
                .and_then(|line| {
                    if line.trim().is_empty() {
                        return Ok(Vec::new());
                    }
                    let object = parse_line(&line, no)?;
                    let mut texts = Vec::new();
                    for key in keys {
                        texts.extend(key_texts(&object, key, no)?.into_iter().map(str::to_string));
                    }
                    Ok(texts)
                });
            match texts {
                Ok(texts) => {
                    if !texts.is_empty()
                        && let Ok(mut n) = documents.lock()
                    {
                        *n += 1;
                    }
                    Some(texts)
                }
                Err(e) => {
                    if let Ok(mut f) = failure.lock() {
                        *f = Some(e);
                    }
                    None
                }
            }
        })
        .flatten();
    let json = train_byte_level_bpe(texts, args.vocab_size)?;
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e.context("--input"));
    }
    let documents = documents.into_inner().unwrap_or(0);
    if documents == 0 {
        anyhow::bail!(
            "{}: no documents with keys {keys:?} to train on",
            args.corpus.input.display()
        );
    }
    megatron::checkpoint::write_atomically(&args.output, json.as_bytes())
        .with_context(|| format!("writing --output {}", args.output.display()))?;
    let tokenizer = Tokenizer::from_file(&args.output)?;
    say!(
        "trained a byte-level BPE tokenizer of {} tokens ({ENDOFTEXT} = {}) on {documents} documents of {} into {}",
        tokenizer.vocab_size(),
        tokenizer
            .eod()
            .map_or("none".to_string(), |id| id.to_string()),
        args.corpus.input.display(),
        args.output.display()
    )?;
    Ok(())
}
