//! `megatron convert`: Hugging Face directories (GPT-2 and the Llama family) to megatron-rs
//! checkpoints and back.

use std::path::PathBuf;

use super::output::say;
use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::convert::{hf_gpt2, hf_llama};

/// Arguments of `megatron convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The source: `hf DIR` (a Hugging Face directory: config.json, model.safetensors or its
    /// shards; GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
    /// Qwen3ForCausalLM; `hf-gpt2 DIR` is GPT-2 alone) or a megatron-rs checkpoint directory.
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true)]
    from: Vec<String>,
    /// The destination: a megatron-rs save directory, or `hf DIR` (the architecture the model
    /// is: GPT-2, Llama, Qwen2 or Qwen3; `hf-gpt2 DIR` insists on GPT-2).
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true)]
    to: Vec<String>,
}

/// A side of a conversion.
enum Side {
    HfGpt2(PathBuf),
    Hf(PathBuf),
    Checkpoint(PathBuf),
}

fn side(values: &[String], flag: &str) -> Result<Side> {
    match values {
        [format, path] if format == "hf-gpt2" => Ok(Side::HfGpt2(PathBuf::from(path))),
        [format, path] if format == "hf" => Ok(Side::Hf(PathBuf::from(path))),
        [format, _] => bail!(
            "--{flag}: unknown format `{format}` (formats: hf, hf-gpt2; or a megatron-rs checkpoint path alone)"
        ),
        [path] if path == "hf-gpt2" || path == "hf" => bail!("--{flag} {path} needs a directory"),
        [path] => Ok(Side::Checkpoint(PathBuf::from(path))),
        _ => bail!("--{flag} takes a path, or a format and a path"),
    }
}

/// The architecture a Hugging Face directory's `config.json` names (GPT-2 when it names none).
fn hf_architecture(dir: &std::path::Path) -> Result<String> {
    let config = megatron::convert::read_hf_config(dir)?;
    Ok(hf_llama::architecture(&config)
        .unwrap_or("GPT2LMHeadModel")
        .to_string())
}

/// Runs `megatron convert`.
pub fn run(args: &ConvertArgs) -> Result<()> {
    let (from, to) = (side(&args.from, "from")?, side(&args.to, "to")?);
    let arch = match &from {
        Side::Hf(hf) => hf_architecture(hf)?,
        _ => "GPT2LMHeadModel".to_string(),
    };
    match (from, to) {
        (Side::Hf(hf), Side::Checkpoint(out)) if arch != "GPT2LMHeadModel" => {
            let c = hf_llama::import(&hf, &out)
                .with_context(|| format!("--from hf {} --to {}", hf.display(), out.display()))?;
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
        (Side::HfGpt2(hf) | Side::Hf(hf), Side::Checkpoint(out)) => {
            let c = hf_gpt2::import(&hf, &out).with_context(|| {
                format!("--from hf-gpt2 {} --to {}", hf.display(), out.display())
            })?;
            say!(
                "converted {} (GPT-2, {} layers, hidden {}, vocabulary {}) into {}",
                hf.display(),
                c.num_layers,
                c.hidden_size,
                c.vocab_size,
                out.display()
            )?;
        }
        (Side::Checkpoint(ckpt), Side::Hf(hf)) if checkpoint_is_llama(&ckpt)? => {
            let (arch, c) = hf_llama::export(&ckpt, &hf)
                .with_context(|| format!("--from {} --to hf {}", ckpt.display(), hf.display()))?;
            say!(
                "wrote {} as a Hugging Face {arch} ({} layers, hidden {})",
                hf.display(),
                c.num_layers,
                c.hidden_size
            )?;
        }
        (Side::Checkpoint(ckpt), Side::HfGpt2(hf) | Side::Hf(hf)) => {
            let c = hf_gpt2::export(&ckpt, &hf).with_context(|| {
                format!("--from {} --to hf-gpt2 {}", ckpt.display(), hf.display())
            })?;
            say!(
                "wrote {} as a Hugging Face GPT-2 ({} layers, hidden {})",
                hf.display(),
                c.num_layers,
                c.hidden_size
            )?;
        }
        _ => bail!("convert goes from hf to a checkpoint or from a checkpoint to hf"),
    }
    Ok(())
}

/// Whether a checkpoint's model is one of the Llama family's (else GPT-2's export applies,
/// and refuses what GPT-2 is not).
fn checkpoint_is_llama(ckpt: &std::path::Path) -> Result<bool> {
    let loaded = megatron::checkpoint::open(ckpt)?;
    let c: megatron::models::GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    Ok(hf_llama::hf_architecture(&c).is_some())
}
