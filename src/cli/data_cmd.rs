//! `megatron data inspect`: the facts of an indexed dataset and the tokens of chosen documents.

use std::fmt::Write as _;
use std::ops::Range;

use super::output;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use megatron::core::data::{IndexedDataset, PackedSidecar, is_packed, packed_path};
use megatron::tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

/// Arguments of `megatron data`.
#[derive(Debug, Args)]
pub struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Debug, Subcommand)]
enum DataCommand {
    /// Print an indexed dataset's type and counts (checking every entry), and chosen documents.
    Inspect(InspectArgs),
}

/// Arguments of `megatron data inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The dataset: PREFIX.bin and PREFIX.idx.
    prefix: std::path::PathBuf,
    /// Documents to print: `A..B` (B excluded), `A..`, `..B` or `A` [default: 0..3].
    #[arg(long)]
    docs: Option<String>,
    /// Also print the documents' text: `byte` or a tokenizer.json.
    #[arg(long)]
    tokenizer: Option<String>,
    /// Print one JSON object (a packed dataset: one object per line per document, with its
    /// `tokens` and `loss_mask`).
    #[arg(long)]
    json: bool,
    /// A packed dataset: print training sample N's documents, rows and positions.
    #[arg(long)]
    sample: Option<usize>,
}

/// Runs `megatron data ...`.
pub fn run(args: &DataArgs) -> Result<()> {
    match &args.command {
        DataCommand::Inspect(args) => inspect(args),
    }
}

fn parse_docs(spec: &str, documents: usize) -> Result<Range<usize>> {
    let num = |s: &str, default: usize| -> Result<usize> {
        if s.is_empty() {
            Ok(default)
        } else {
            s.trim()
                .parse()
                .with_context(|| format!("--docs {spec:?}: {s:?} is not a document number"))
        }
    };
    let range = match spec.split_once("..") {
        Some((a, b)) => num(a, 0)?..num(b, documents)?,
        None => {
            let a = num(spec, 0)?;
            a..a + 1
        }
    };
    if range.start > range.end || range.end > documents {
        bail!(
            "--docs {spec}: documents {}..{} out of range: the dataset has {documents}",
            range.start,
            range.end
        );
    }
    Ok(range)
}

fn inspect(args: &InspectArgs) -> Result<()> {
    if is_packed(&args.prefix) {
        return inspect_packed(args);
    }
    if args.sample.is_some() {
        bail!(
            "--sample shows a packed dataset's sample; {} has no {}",
            args.prefix.display(),
            packed_path(&args.prefix).display()
        );
    }
    let dataset = IndexedDataset::open(&args.prefix)?;
    let tokens = dataset.validate()?;
    let documents = dataset.documents();
    let range = match &args.docs {
        Some(spec) => parse_docs(spec, documents)?,
        None => 0..documents.min(3),
    };
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(|spec| Tokenizer::from_spec(spec).with_context(|| format!("--tokenizer {spec}")))
        .transpose()?;

    let mut docs = Vec::with_capacity(range.len());
    for d in range {
        let ids = dataset.document(d)?;
        let mut doc = Map::new();
        doc.insert("index".into(), json!(d));
        if let Some(t) = &tokenizer {
            let ids32 = ids
                .iter()
                .map(|&id| u32::try_from(id))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("document {d} holds a negative token id"))?;
            doc.insert("text".into(), json!(t.decode(&ids32)?));
        }
        doc.insert("tokens".into(), json!(ids));
        docs.push(doc);
    }

    let mut out = String::new();
    if args.json {
        let value = json!({
            "dtype": dataset.dtype().name(),
            "documents": documents,
            "sequences": dataset.len(),
            "tokens": tokens,
            "docs": docs,
        });
        writeln!(out, "{}", serde_json::to_string(&value)?)?;
    } else {
        writeln!(out, "{}", args.prefix.display())?;
        writeln!(out, "  dtype      {}", dataset.dtype())?;
        writeln!(out, "  documents  {documents}")?;
        writeln!(out, "  sequences  {}", dataset.len())?;
        writeln!(out, "  tokens     {tokens}")?;
        for doc in docs {
            let ids = doc["tokens"].as_array().map_or(0, Vec::len);
            writeln!(
                out,
                "document {} ({ids} tokens): {}",
                doc["index"],
                serde_json::to_string(&doc["tokens"])?
            )?;
            if let Some(Value::String(text)) = doc.get("text") {
                writeln!(out, "  text: {text:?}")?;
            }
        }
    }
    Ok(output::text(&out)?)
}

/// `inspect` of a packed dataset: its documents (conversations) with which tokens count, or one
/// training sample's documents and positions.
fn inspect_packed(args: &InspectArgs) -> Result<()> {
    let dataset = IndexedDataset::open(&args.prefix)?;
    dataset.validate()?;
    let sidecar = PackedSidecar::open(&args.prefix, &dataset)?;
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(|spec| Tokenizer::from_spec(spec).with_context(|| format!("--tokenizer {spec}")))
        .transpose()?;
    // Every document's bin and place in it.
    let mut places = Vec::with_capacity(sidecar.documents());
    let mut first_token = 0;
    for b in 0..sidecar.bins() {
        let mut at = 0;
        for len in sidecar.lengths(b) {
            places.push((b, first_token, at, len as usize));
            at += len as usize;
        }
        first_token += dataset.sequence_length(b)?;
    }
    let mut out = String::new();
    if let Some(n) = args.sample {
        if n >= sidecar.bins() {
            bail!(
                "--sample {n}: the packed dataset has {} sequences",
                sidecar.bins()
            );
        }
        let len = dataset.sequence_length(n)?;
        writeln!(out, "sample {n}: {len} tokens")?;
        for (d, &(b, _, at, dl)) in places.iter().enumerate().filter(|(_, p)| p.0 == n) {
            let _ = b;
            writeln!(
                out,
                "  document {d}: rows {at}..{}, positions 0..{dl}",
                at + dl
            )?;
        }
        return Ok(output::text(&out)?);
    }
    let range = match &args.docs {
        Some(spec) => parse_docs(spec, places.len())?,
        None => 0..places.len().min(3),
    };
    if !args.json {
        writeln!(out, "{}", args.prefix.display())?;
        writeln!(out, "  dtype      {}", dataset.dtype())?;
        writeln!(out, "  sequences  {} (packed)", sidecar.bins())?;
        writeln!(out, "  documents  {}", sidecar.documents())?;
    }
    for d in range {
        let (bin, first, at, len) = places[d];
        let ids = dataset.get(bin, at, Some(len))?.to_u32_vec()?;
        let mask: Vec<u8> = sidecar.counts(first + at, len).to_vec();
        if args.json {
            let mut doc = Map::new();
            doc.insert("document".into(), json!(d));
            doc.insert("sequence".into(), json!(bin));
            doc.insert("tokens".into(), json!(ids));
            doc.insert("loss_mask".into(), json!(mask));
            if let Some(t) = &tokenizer {
                doc.insert("text".into(), json!(t.decode(&ids)?));
            }
            writeln!(out, "{}", Value::Object(doc))?;
            continue;
        }
        let counted = mask.iter().filter(|&&m| m == 1).count();
        writeln!(
            out,
            "document {d} (sequence {bin}, {len} tokens, {counted} counted): {}",
            serde_json::to_string(&ids)?
        )?;
        writeln!(out, "  loss_mask: {}", serde_json::to_string(&mask)?)?;
        if let Some(t) = &tokenizer {
            writeln!(out, "  text: {:?}", t.decode(&ids)?)?;
            let kept: Vec<u32> = ids
                .iter()
                .zip(&mask)
                .filter(|(_, m)| **m == 1)
                .map(|(i, _)| *i)
                .collect();
            writeln!(out, "  counted: {:?}", t.decode(&kept)?)?;
        }
    }
    Ok(output::text(&out)?)
}
