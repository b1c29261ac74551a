//! `megatron preprocess`: JSON lines to Megatron-LM's indexed dataset, as Megatron-LM's
//! `tools/preprocess_data.py` writes it (same files, same bytes, same names).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use super::output::say;
use super::values;
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use megatron::chat::pack::Overlong;
use megatron::core::data::{DType, IndexedDatasetBuilder};
use megatron::tokenizer::Tokenizer;
use serde_json::Value;

/// A JSON-lines corpus and the keys to read of it (`preprocess` and `tokenizer train`).
#[derive(Debug, Args)]
pub struct JsonLines {
    /// JSON-lines file: one document per line, a JSON object.
    #[arg(long)]
    pub input: PathBuf,
    /// Keys whose text to read (preprocess: each gives a dataset PREFIX_KEY_document).
    #[arg(
        long = "json-keys",
        visible_alias = "json-key",
        num_args = 1..,
        default_value = "text"
    )]
    pub json_keys: Vec<String>,
}

/// Arguments of `megatron preprocess`, named as `preprocess_data.py`'s.
#[derive(Debug, Args)]
pub struct PreprocessArgs {
    #[command(flatten)]
    corpus: JsonLines,
    /// `byte`, or the path of a Hugging Face tokenizer.json (GPT-2's included).
    #[arg(long)]
    tokenizer: String,
    /// Output prefix: writes PREFIX_KEY_document.bin and .idx, as Megatron-LM names them.
    #[arg(long)]
    output_prefix: PathBuf,
    /// End every non-empty document with the tokenizer's end-of-document token.
    #[arg(long)]
    append_eod: bool,
    /// The end-of-document token when it is not <|endoftext|> (e.g. "</s>").
    #[arg(long)]
    eod_token: Option<String>,
    /// Tokenizing threads [default: the machine's cores].
    #[arg(long, value_parser = values::threads)]
    workers: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Chat data: each line's `messages` (or `prompt` and `completion`) rendered with the
    /// tokenizer directory's chat template, packed whole into sequences of --seq-length + 1
    /// tokens; writes PREFIX.bin, PREFIX.idx and PREFIX.packed (docs/packed-data.md).
    #[arg(long)]
    chat: bool,
    /// With --chat: the training sequence length the conversations are packed for.
    #[arg(long, value_parser = values::batch)]
    seq_length: Option<usize>,
    /// With --chat: only the assistant's tokens count in the loss.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    answer_only_loss: bool,
    /// With --chat: render each conversation with the generation prompt (transformers'
    /// add_generation_prompt).
    #[arg(long)]
    add_generation_prompt: bool,
    /// With --chat: what to do with a conversation longer than a sequence.
    #[arg(long, value_enum, default_value_t)]
    overlong: Overlong,
    /// With --chat: pack several conversations into each sequence (first-fit decreasing);
    /// false puts each in a sequence of its own, padded.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pack: bool,
    /// With --chat: pad each conversation with tokens that count nothing to a multiple of N
    /// positions (NeMo and Megatron-Bridge's pad_seq_to_mult; 2·cp lets context parallelism
    /// cut every conversation over its ranks, Transformer Engine's thd).
    #[arg(long, value_parser = values::batch, default_value_t = 1, value_name = "N")]
    pad_to_multiple_of: usize,
}

/// One line's documents, one per key: the tokens and the lengths of their sequences.
type Encoded = Vec<(Vec<u32>, Vec<usize>)>;

/// The dataset prefix `preprocess_data.py` writes for a key: `PREFIX_KEY_document`.
pub fn output_prefix(prefix: &std::path::Path, key: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(format!("_{key}_document"));
    PathBuf::from(s)
}

/// The texts of `key` in one JSON line, as `preprocess_data.py` reads them: a string (one
/// sequence) or a list of strings (one sequence each).
pub fn key_texts<'a>(
    object: &'a serde_json::Map<String, Value>,
    key: &str,
    line_no: u64,
) -> Result<Vec<&'a str>> {
    match object.get(key) {
        Some(Value::String(s)) => Ok(vec![s.as_str()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str())
            .collect::<Option<Vec<_>>>()
            .with_context(|| format!("line {line_no}: \"{key}\" is a list of non-strings")),
        Some(_) => bail!("line {line_no}: \"{key}\" is not a string or a list of strings"),
        None => bail!("line {line_no}: no key \"{key}\""),
    }
}

/// One line of a JSON-lines file, which must be a JSON object.
pub fn parse_line(line: &str, line_no: u64) -> Result<serde_json::Map<String, Value>> {
    let value: Value = serde_json::from_str(line)
        .with_context(|| format!("line {line_no}: not a JSON document"))?;
    let Value::Object(object) = value else {
        bail!("line {line_no}: not a JSON object");
    };
    Ok(object)
}

/// Tokenizes one JSON line as `preprocess_data.py`'s `Encoder.encode`: a key's value is a
/// string (one sequence) or a list of strings (one sequence each); empty sequences are dropped;
/// the end-of-document token goes at the end of a non-empty document.
fn encode_line(
    line: &str,
    line_no: u64,
    keys: &[String],
    tokenizer: &Tokenizer,
    eod: Option<u32>,
) -> Result<Encoded> {
    let object = parse_line(line, line_no)?;
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let texts = key_texts(&object, key, line_no)?;
        let mut tokens = Vec::new();
        let mut lengths = Vec::new();
        for text in texts {
            let ids = tokenizer
                .encode(text)
                .with_context(|| format!("line {line_no}"))?;
            if !ids.is_empty() {
                lengths.push(ids.len());
                tokens.extend_from_slice(&ids);
            }
        }
        if let (Some(eod), Some(last)) = (eod, lengths.last_mut()) {
            tokens.push(eod);
            *last += 1;
        }
        out.push((tokens, lengths));
    }
    Ok(out)
}

/// Runs `megatron preprocess`.
pub fn run(args: &PreprocessArgs) -> Result<()> {
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get));
    if args.chat {
        if args.append_eod || args.eod_token.is_some() {
            bail!("--append-eod and --eod-token do nothing with --chat: the template ends turns");
        }
        let Some(seq_length) = args.seq_length else {
            bail!("--chat packs conversations into sequences: give --seq-length");
        };
        let options = megatron::chat::prepare::PrepareOptions {
            seq_length,
            answer_only: args.answer_only_loss,
            add_generation_prompt: args.add_generation_prompt,
            overlong: args.overlong,
            pack: args.pack,
            pad_to_multiple_of: args.pad_to_multiple_of,
            workers,
        };
        return super::preprocess_chat::run(
            &args.corpus.input,
            std::path::Path::new(&args.tokenizer),
            &args.output_prefix,
            options,
        );
    }
    for (given, flag) in [
        (args.seq_length.is_some(), "--seq-length"),
        (!args.answer_only_loss, "--answer-only-loss"),
        (args.add_generation_prompt, "--add-generation-prompt"),
        (args.overlong != Overlong::default(), "--overlong"),
        (!args.pack, "--pack"),
        (args.pad_to_multiple_of != 1, "--pad-to-multiple-of"),
    ] {
        if given {
            bail!("{flag} does nothing without --chat: add --chat or drop {flag}");
        }
    }
    let start = Instant::now();
    let mut tokenizer = Tokenizer::from_spec(&args.tokenizer)
        .with_context(|| format!("--tokenizer {}", args.tokenizer))?;
    if let Some(token) = &args.eod_token {
        tokenizer = tokenizer.with_eod_token(token)?;
    }
    let eod = if args.append_eod {
        Some(tokenizer.require_eod().context("--append-eod")?)
    } else {
        None
    };
    let vocab = tokenizer.vocab_size();
    let dtype = DType::optimal(vocab);

    let file = File::open(&args.corpus.input)
        .with_context(|| format!("--input {}: cannot open", args.corpus.input.display()))?;
    let input_len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = BufReader::with_capacity(1 << 20, file);

    let mut builders = Vec::with_capacity(args.corpus.json_keys.len());
    for key in &args.corpus.json_keys {
        let prefix = output_prefix(&args.output_prefix, key);
        builders.push((
            prefix.clone(),
            IndexedDatasetBuilder::create(&prefix, dtype)
                .with_context(|| format!("key \"{key}\""))?,
        ));
    }

    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(input_len)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} {msg}",
        )
        .expect("a valid template"),
    );

    // Lines are read in batches, tokenized by `workers` threads, and written in input order.
    let batch_lines = 256 * workers;
    let mut line_no = 0u64;
    let mut documents = 0u64;
    let mut batch: Vec<(u64, String)> = Vec::with_capacity(batch_lines);
    let mut eof = false;
    while !eof {
        batch.clear();
        let mut bytes = 0u64;
        while batch.len() < batch_lines {
            let mut raw = Vec::new();
            let n = reader
                .read_until(b'\n', &mut raw)
                .with_context(|| format!("--input {}: cannot read", args.corpus.input.display()))?;
            if n == 0 {
                eof = true;
                break;
            }
            line_no += 1;
            bytes += n as u64;
            let line = String::from_utf8(raw).map_err(|_| {
                anyhow::anyhow!(
                    "{}: line {line_no} is not valid UTF-8",
                    args.corpus.input.display()
                )
            })?;
            // Blank lines (a trailing newline, say) hold no document.
            if !line.trim().is_empty() {
                batch.push((line_no, line));
            }
        }
        let encoded = encode_batch(&batch, workers, &args.corpus.json_keys, &tokenizer, eod)
            .with_context(|| args.corpus.input.display().to_string())?;
        for doc in encoded {
            for ((_, builder), (tokens, lengths)) in builders.iter_mut().zip(doc) {
                builder.add_document(&tokens, &lengths)?;
            }
            documents += 1;
        }
        bar.inc(bytes);
        bar.set_message(format!("{documents} documents"));
    }
    bar.finish_and_clear();

    for (prefix, builder) in builders {
        let (sequences, tokens) = (builder.sequences(), builder.tokens());
        let docs = builder.documents();
        builder.finish()?;
        say!(
            "{}.{{bin,idx}}: {docs} documents, {sequences} sequences, {tokens} tokens ({dtype}, \
             vocabulary {vocab})",
            prefix.display()
        )?;
    }
    say!(
        "{line_no} lines in {:.1} s with {workers} worker{}",
        start.elapsed().as_secs_f64(),
        if workers == 1 { "" } else { "s" }
    )?;
    Ok(())
}

/// Tokenizes a batch of lines on `workers` threads; results in input order.
fn encode_batch(
    batch: &[(u64, String)],
    workers: usize,
    keys: &[String],
    tokenizer: &Tokenizer,
    eod: Option<u32>,
) -> Result<Vec<Encoded>> {
    megatron::data::in_parallel(batch, workers, |(no, line)| {
        encode_line(line, *no, keys, tokenizer, eod)
    })
}
