//! `megatron generate`: text from a trained or imported model.

use std::path::PathBuf;

use super::output::{self, say};
use super::values;
use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::generate::{Sampling, generate};
use megatron::tokenizer::Tokenizer;

/// Arguments of `megatron generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The checkpoint (a save directory or an iteration directory).
    #[arg(long)]
    load: PathBuf,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// Most tokens to add.
    #[arg(long, default_value_t = 64, value_parser = values::batch)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(
        long,
        default_value_t = 0.0,
        allow_negative_numbers = true,
        value_parser = values::non_negative
    )]
    temperature: f64,
    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0, value_parser = values::vocab_or_all)]
    top_k: usize,
    /// Sample among the most likely tokens while the probability above each is below p
    /// (nucleus sampling, as transformers; 1: all).
    #[arg(long, default_value_t = 1.0, value_parser = values::probability)]
    top_p: f64,
    /// Tensor-parallel size to run the model with.
    #[arg(
        long = "tensor-model-parallel-size",
        visible_alias = "tp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    tp: usize,
    /// Tokenizer (`byte` or a tokenizer.json) [default: the one the checkpoint records].
    #[arg(long)]
    tokenizer: Option<String>,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

/// Runs `megatron generate`.
pub fn run(args: &GenerateArgs) -> Result<()> {
    if args.top_p < 1.0 && args.temperature == 0.0 {
        bail!(
            "--top-p {} does nothing with greedy decoding (--temperature 0, the default): give a \
             --temperature above 0 to sample",
            args.top_p
        );
    }
    if args.top_k > 0 && args.temperature == 0.0 {
        bail!(
            "--top-k {} does nothing with greedy decoding (--temperature 0, the default): give a \
             --temperature above 0 to sample",
            args.top_k
        );
    }
    let spec = match &args.tokenizer {
        Some(s) => s.clone(),
        None => megatron::tokenizer::checkpoint_tokenizer(&args.load)
            .context("--load")?
            .unwrap_or_else(|| "byte".to_string()),
    };
    let tokenizer = Tokenizer::from_spec(&spec).with_context(|| format!("--tokenizer {spec}"))?;
    let prompt = tokenizer.encode(&args.prompt)?;
    if prompt.is_empty() {
        bail!(
            "--prompt {:?} has no tokens: give some text to continue",
            args.prompt
        );
    }
    let context = megatron::generate::context_length(&args.load).context("--load")?;
    if prompt.len() > context {
        output::error_line(&format!(
            "note: the prompt is {} tokens, more than the model's context of {context}: the \
             model sees its last {context} tokens",
            prompt.len()
        ));
    }
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let new = generate(
        &args.load,
        args.tp,
        &prompt,
        args.max_new_tokens,
        sampling,
        tokenizer.eod(),
    )?;
    let text = tokenizer.decode(&new)?;
    say!("{}{}", args.prompt, text)?;
    Ok(())
}
