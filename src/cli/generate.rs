//! `megatron generate`: text from a trained or imported model.

use std::path::PathBuf;

use super::output::{self, say};
use super::values;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::sync::Mutex;

use megatron::chat::ChatTemplate;
use megatron::generate::{Compute, Sampling, generate_streaming};
use megatron::tokenizer::{TextStream, Tokenizer};

/// Arguments of `megatron generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The checkpoint (a save directory or an iteration directory).
    #[arg(long)]
    load: PathBuf,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// Most tokens to add (the prompt and the new tokens share the model's positions); the
    /// text is printed as it is produced and ends at the end-of-text token.
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
    /// bf16 weights (the checkpoint's values rounded to bf16: half the bytes each new token
    /// reads) and matrix products of bf16 operands summed in f32, as a `--bf16` training run's
    /// forward; f32 without it.
    #[arg(long)]
    bf16: bool,
    /// Tokenizer (`byte` or a tokenizer.json) [default: the one the checkpoint records].
    #[arg(long)]
    tokenizer: Option<String>,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// A chat: the prompt is a user turn rendered with this tokenizer directory's chat template
    /// and its generation prompt, and the reply ends at the template's end-of-turn token
    /// (`eos_token` of its tokenizer_config.json).
    #[arg(long, value_name = "TOKENIZER_DIR")]
    chat: Option<PathBuf>,
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
    // A chat's prompt is the user's turn as the template renders it; it ends at the end of
    // the assistant's turn.
    let (text, end) = match &args.chat {
        Some(dir) => {
            let template =
                ChatTemplate::from_dir(dir).with_context(|| format!("--chat {}", dir.display()))?;
            let turn = serde_json::json!({"role": "user", "content": args.prompt});
            let text = template.render(&[turn], None, true)?;
            let end = template
                .special_token("eos_token")
                .and_then(|t| tokenizer.token_id(t));
            (text, end.or(tokenizer.eod()))
        }
        None => (args.prompt.clone(), tokenizer.eod()),
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!(
            "--prompt {:?} has no tokens: give some text to continue",
            args.prompt
        );
    }
    let context = megatron::generate::context_length(&args.load).context("--load")?;
    let depths = megatron::generate::mtp_depths(&args.load).context("--load")?;
    if depths > 0 {
        output::error_line(&format!(
            "note: generation leaves the model's multi-token prediction ({depths} depth{}) \
             unused: each token comes from the model's output layer (no speculative decoding)",
            if depths == 1 { "" } else { "s" }
        ));
    }
    if args.max_new_tokens >= context {
        bail!(
            "--max-new-tokens {}: the model holds {context} positions (its \
             --max-position-embeddings) for the prompt and the new tokens together",
            args.max_new_tokens
        );
    }
    // The prompt's last tokens that leave room for the new ones.
    let room = context - args.max_new_tokens;
    let prompt = if prompt.len() > room {
        output::error_line(&format!(
            "note: the prompt is {} tokens and {} new ones are asked, more than the model's \
             {context} positions: the model sees the prompt's last {room} tokens",
            prompt.len(),
            args.max_new_tokens
        ));
        prompt[prompt.len() - room..].to_vec()
    } else {
        prompt
    };
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    // The prompt with the first token (once the model is loaded and has read it), then each
    // new token's text as it is drawn; the end-of-text token ends it unprinted.
    let eod = end;
    let stream: Mutex<Option<TextStream>> = Mutex::new(None);
    // Standard output's failure, kept: it crosses the ranks' threads only as text.
    let failed: Mutex<Option<output::StdoutError>> = Mutex::new(None);
    let print = |id: u32| -> Result<()> {
        let mut stream = stream
            .lock()
            .map_err(|_| anyhow::anyhow!("the text stream"))?;
        let mut piece = match stream.is_none() {
            true => text.clone(),
            false => String::new(),
        };
        let stream = stream.get_or_insert_with(TextStream::new);
        if Some(id) != eod {
            piece.push_str(&stream.push(&tokenizer, id)?);
        }
        if !piece.is_empty()
            && let Err(err) = output::text(&piece)
        {
            let stop = anyhow::anyhow!("{err}");
            *failed
                .lock()
                .map_err(|_| anyhow::anyhow!("standard output"))? = Some(err);
            return Err(stop);
        }
        Ok(())
    };
    let generated = generate_streaming(
        &args.load,
        Compute {
            tp: args.tp,
            bf16: args.bf16,
        },
        &prompt,
        args.max_new_tokens,
        sampling,
        eod,
        &print,
    );
    if let Some(err) = failed.into_inner().ok().flatten() {
        // A reader that left (`| head`) ends generation quietly; another failure is named.
        return Err(err.into());
    }
    generated?;
    let rest = match stream
        .into_inner()
        .map_err(|_| anyhow::anyhow!("the text stream"))?
    {
        Some(mut stream) => stream.finish(&tokenizer)?,
        None => text.clone(),
    };
    say!("{rest}")?;
    Ok(())
}
