//! `megatron convert`: Hugging Face GPT-2 directories to megatron-rs checkpoints and back.

use std::path::PathBuf;

use super::output::say;
use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::convert::hf_gpt2;

/// Arguments of `megatron convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The source: `hf-gpt2 DIR` (a Hugging Face GPT-2 with config.json and model.safetensors)
    /// or a megatron-rs checkpoint directory.
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true)]
    from: Vec<String>,
    /// The destination: a megatron-rs save directory, or `hf-gpt2 DIR`.
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true)]
    to: Vec<String>,
}

/// A side of a conversion.
enum Side {
    HfGpt2(PathBuf),
    Checkpoint(PathBuf),
}

fn side(values: &[String], flag: &str) -> Result<Side> {
    match values {
        [format, path] if format == "hf-gpt2" => Ok(Side::HfGpt2(PathBuf::from(path))),
        [format, _] => bail!(
            "--{flag}: unknown format `{format}` (formats: hf-gpt2; or a megatron-rs checkpoint path alone)"
        ),
        [path] if path == "hf-gpt2" => bail!("--{flag} hf-gpt2 needs a directory"),
        [path] => Ok(Side::Checkpoint(PathBuf::from(path))),
        _ => bail!("--{flag} takes a path, or a format and a path"),
    }
}

/// Runs `megatron convert`.
pub fn run(args: &ConvertArgs) -> Result<()> {
    match (side(&args.from, "from")?, side(&args.to, "to")?) {
        (Side::HfGpt2(hf), Side::Checkpoint(out)) => {
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
        (Side::Checkpoint(ckpt), Side::HfGpt2(hf)) => {
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
        _ => bail!("convert goes from hf-gpt2 to a checkpoint or from a checkpoint to hf-gpt2"),
    }
    Ok(())
}
