//! `megatron convert`: Hugging Face directories (GPT-2 and the Llama family) to megatron-rs
//! checkpoints and back.

use std::ffi::OsString;
use std::path::PathBuf;

use super::output::say;
use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::convert;

/// Arguments of `megatron convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The source: `hf DIR` (a Hugging Face directory: config.json, model.safetensors or its
    /// shards; the architecture its config names: GPT2LMHeadModel, LlamaForCausalLM,
    /// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or
    /// Qwen3MoeForCausalLM; `hf-gpt2 DIR` is GPT-2 alone) or a megatron-rs checkpoint directory.
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true,
          value_parser = clap::value_parser!(OsString))]
    from: Vec<OsString>,
    /// The destination: a megatron-rs save directory, or `hf DIR` (the architecture that holds
    /// the model exactly: GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE; a model
    /// none holds is refused, naming its features; `hf-gpt2 DIR` insists on GPT-2).
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true,
          value_parser = clap::value_parser!(OsString))]
    to: Vec<OsString>,
}

/// A side of a conversion.
enum Side {
    /// A Hugging Face directory (`hf-gpt2`: GPT-2 alone).
    Hf { dir: PathBuf, gpt2_only: bool },
    /// A megatron-rs checkpoint.
    Checkpoint(PathBuf),
}

fn side(values: &[OsString], flag: &str) -> Result<Side> {
    match values {
        [format, path] if format == "hf-gpt2" || format == "hf" => Ok(Side::Hf {
            dir: PathBuf::from(path),
            gpt2_only: format == "hf-gpt2",
        }),
        [format, _] => bail!(
            "--{flag}: unknown format `{}` (formats: hf, hf-gpt2; or a megatron-rs checkpoint path alone)",
            format.to_string_lossy()
        ),
        [path] if path == "hf-gpt2" || path == "hf" => {
            bail!("--{flag} {} needs a directory", path.to_string_lossy())
        }
        [path] => Ok(Side::Checkpoint(PathBuf::from(path))),
        _ => bail!("--{flag} takes a path, or a format and a path"),
    }
}

/// Runs `megatron convert`.
pub fn run(args: &ConvertArgs) -> Result<()> {
    let (from, to) = (side(&args.from, "from")?, side(&args.to, "to")?);
    match (from, to) {
        (Side::Hf { dir: hf, gpt2_only }, Side::Checkpoint(out)) => {
            let flag = if gpt2_only { "hf-gpt2" } else { "hf" };
            let (arch, c) = convert::import_hf(&hf, &out, gpt2_only).with_context(|| {
                format!("--from {flag} {} --to {}", hf.display(), out.display())
            })?;
            say!(
                "converted {} ({arch}, {} layers, hidden {}, {} heads in {} groups, vocabulary {}) \
                 into {}",
                hf.display(),
                c.num_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.query_groups(),
                c.vocab_size,
                out.display()
            )?;
        }
        (Side::Checkpoint(ckpt), Side::Hf { dir: hf, gpt2_only }) => {
            let flag = if gpt2_only { "hf-gpt2" } else { "hf" };
            let (arch, c) = convert::export_hf(&ckpt, &hf, gpt2_only).with_context(|| {
                format!("--from {} --to {flag} {}", ckpt.display(), hf.display())
            })?;
            say!(
                "wrote {} as a Hugging Face {arch} ({} layers, hidden {})",
                hf.display(),
                c.num_layers,
                c.hidden_size
            )?;
            if c.hidden_dropout > 0.0 && arch != "GPT2LMHeadModel" {
                say!(
                    "note: {arch} has no hidden dropout: the model's --hidden-dropout {} is not \
                     written (it changes training, not what the model computes)",
                    c.hidden_dropout
                )?;
            }
        }
        (Side::Checkpoint(_), Side::Checkpoint(_)) => bail!(
            "--from and --to are both megatron-rs checkpoints: convert goes from `--from hf DIR` \
             to a checkpoint, or from a checkpoint to `--to hf DIR` (a checkpoint loads at any \
             layout as it is: `megatron train --load`)"
        ),
        (Side::Hf { .. }, Side::Hf { .. }) => bail!(
            "--from and --to are both Hugging Face directories: convert goes from `--from hf DIR` \
             to a checkpoint, or from a checkpoint to `--to hf DIR`"
        ),
    }
    Ok(())
}
