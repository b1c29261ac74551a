//! `megatron convert`: Hugging Face directories (GPT-2 and the Llama family) to megatron-rs
//! checkpoints and back.

use std::ffi::OsString;
use std::path::PathBuf;

use super::output::say;
use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::convert::{self, ExportOptions};
use safetensors::Dtype;

/// Arguments of `megatron convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The source: `hf DIR` (a Hugging Face directory: config.json, model.safetensors or its
    /// shards; the architecture its config names: GPT2LMHeadModel, LlamaForCausalLM,
    /// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or
    /// Qwen3MoeForCausalLM; `hf-gpt2 DIR` is GPT-2 alone), `peft DIR` (PEFT's LoRA adapter, with
    /// --base) or a megatron-rs checkpoint directory.
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true,
          value_parser = clap::value_parser!(OsString))]
    from: Vec<OsString>,
    /// The destination: a megatron-rs save directory, `hf DIR` (the architecture that holds
    /// the model exactly: GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE; a model
    /// none holds is refused, naming its features; `hf-gpt2 DIR` insists on GPT-2), or `peft
    /// DIR` (a LoRA checkpoint's adapters in PEFT's format).
    #[arg(long, num_args = 1..=2, value_names = ["FORMAT", "PATH"], required = true,
          value_parser = clap::value_parser!(OsString))]
    to: Vec<OsString>,
    /// The dtype an export writes its weights in: float32, bfloat16 or float16 (default: the
    /// dtype of the model the checkpoint was imported from, else the checkpoint's own; values
    /// rounded to nearest, ties to even, as `torch.Tensor.to` rounds).
    #[arg(long, value_name = "DTYPE", value_parser = parse_dtype)]
    dtype: Option<Dtype>,
    /// The largest weight file an export writes, as transformers' `max_shard_size` (`50GB`,
    /// `5GB`, `500MB`; powers of 1000): more are `model-0000N-of-0000M.safetensors` with their
    /// index; a larger tensor has a file of its own.
    #[arg(long, value_name = "SIZE", value_parser = parse_shard_size)]
    max_shard_size: Option<u64>,
    /// With `--to hf`, fold a LoRA checkpoint's adapters into the weights they sit beside
    /// (`W + (α / r)·B·A`, in f32, then rounded to the dtype written); its base is read from the
    /// checkpoint it names.
    #[arg(long)]
    merge_lora: bool,
    /// With `--from peft DIR`: the megatron-rs checkpoint of the adapter's base model (its
    /// Hugging Face base, imported); the new checkpoint holds the adapters and names it.
    #[arg(long, value_name = "CKPT")]
    base: Option<PathBuf>,
}

fn parse_dtype(text: &str) -> Result<Dtype, String> {
    convert::dtype_of_name(text).ok_or_else(|| {
        format!("`{text}` is not a dtype parameters are held in: float32, bfloat16 or float16")
    })
}

fn parse_shard_size(text: &str) -> Result<u64, String> {
    convert::stream::parse_size(text).map_err(|e| e.to_string())
}

/// `bytes` for people: `1.2 GB`, `340 MB`, `12 kB`.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000_000 => format!("{:.1} kB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}

/// Says what the process held in memory at most, when the system says.
fn say_peak() -> Result<()> {
    if let Some(bytes) = convert::stream::peak_resident_bytes() {
        say!("peak resident memory {}", size(bytes))?;
    }
    Ok(())
}

/// A side of a conversion.
enum Side {
    /// A Hugging Face directory (`hf-gpt2`: GPT-2 alone).
    Hf { dir: PathBuf, gpt2_only: bool },
    /// A megatron-rs checkpoint.
    Checkpoint(PathBuf),
    /// A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`).
    Peft(PathBuf),
}

fn side(values: &[OsString], flag: &str) -> Result<Side> {
    match values {
        [format, path] if format == "hf-gpt2" || format == "hf" => Ok(Side::Hf {
            dir: PathBuf::from(path),
            gpt2_only: format == "hf-gpt2",
        }),
        [format, path] if format == "peft" => Ok(Side::Peft(PathBuf::from(path))),
        [format, _] => bail!(
            "--{flag}: unknown format `{}` (formats: hf, hf-gpt2, peft; or a megatron-rs checkpoint path alone)",
            format.to_string_lossy()
        ),
        [path] if path == "hf-gpt2" || path == "hf" || path == "peft" => {
            bail!("--{flag} {} needs a directory", path.to_string_lossy())
        }
        [path] => Ok(Side::Checkpoint(PathBuf::from(path))),
        _ => bail!("--{flag} takes a path, or a format and a path"),
    }
}

/// Runs `megatron convert`.
pub fn run(args: &ConvertArgs) -> Result<()> {
    let (from, to) = (side(&args.from, "from")?, side(&args.to, "to")?);
    let exporting = matches!(to, Side::Hf { .. } | Side::Peft(_));
    if !exporting && (args.dtype.is_some() || args.max_shard_size.is_some()) {
        bail!(
            "--dtype and --max-shard-size shape an export (`--to hf DIR`); an import keeps each \
             tensor's dtype in the checkpoint"
        );
    }
    if args.base.is_some() && !matches!(from, Side::Peft(_)) {
        bail!("--base names a PEFT adapter's base: it goes with `--from peft DIR`");
    }
    if args.merge_lora && !matches!(to, Side::Hf { .. }) {
        bail!("--merge-lora folds adapters into an export's weights: it goes with `--to hf DIR`");
    }
    match (from, to) {
        (Side::Hf { dir: hf, gpt2_only }, Side::Checkpoint(out)) => {
            let flag = if gpt2_only { "hf-gpt2" } else { "hf" };
            let done = convert::import_hf(&hf, &out, gpt2_only).with_context(|| {
                format!("--from {flag} {} --to {}", hf.display(), out.display())
            })?;
            let c = &done.config;
            let heads = match c.mla {
                Some(_) => format!("{} heads of multi-latent attention", c.num_attention_heads),
                None => format!(
                    "{} heads in {} groups",
                    c.num_attention_heads,
                    c.query_groups()
                ),
            };
            say!(
                "converted {} ({}, {} layers, hidden {}, {heads}, vocabulary {}) into {}: {} of \
                 {} weights",
                hf.display(),
                done.arch,
                c.num_layers,
                c.hidden_size,
                c.vocab_size,
                out.display(),
                size(done.bytes),
                convert::dtype_name(done.dtype),
            )?;
            if !done.carried.is_empty() {
                say!("carried for the export: {}", done.carried.join(", "))?;
            }
            for left_out in &done.skipped {
                say!("left out: {left_out}")?;
            }
            say_peak()?;
        }
        (Side::Checkpoint(ckpt), Side::Hf { dir: hf, gpt2_only }) => {
            let flag = if gpt2_only { "hf-gpt2" } else { "hf" };
            let mut options = ExportOptions {
                dtype: args.dtype,
                merge_lora: args.merge_lora,
                ..ExportOptions::default()
            };
            if let Some(max) = args.max_shard_size {
                options.max_shard_size = max;
            }
            let done = convert::export_hf(&ckpt, &hf, gpt2_only, &options).with_context(|| {
                format!("--from {} --to {flag} {}", ckpt.display(), hf.display())
            })?;
            let (arch, c) = (done.arch, &done.config);
            say!(
                "wrote {} as a Hugging Face {arch} ({} layers, hidden {}): {} of {} weights in {}",
                hf.display(),
                c.num_layers,
                c.hidden_size,
                size(done.bytes),
                convert::dtype_name(done.dtype),
                done.weight_files.join(", ")
            )?;
            if !done.carried.is_empty() {
                say!("with {}", done.carried.join(", "))?;
            }
            say_peak()?;
            if c.hidden_dropout > 0.0 && arch != "GPT2LMHeadModel" {
                say!(
                    "note: {arch} has no hidden dropout: the model's --hidden-dropout {} is not \
                     written (it changes training, not what the model computes)",
                    c.hidden_dropout
                )?;
            }
        }
        (Side::Checkpoint(ckpt), Side::Peft(dir)) => {
            let options = ExportOptions {
                dtype: args.dtype,
                ..ExportOptions::default()
            };
            let (c, n) = convert::peft::export(&ckpt, &dir, &options).with_context(|| {
                format!("--from {} --to peft {}", ckpt.display(), dir.display())
            })?;
            let lora = c.lora.as_ref().map_or(0, |l| l.rank);
            say!(
                "wrote {} as PEFT's LoRA adapter of rank {lora}: {n} tensors \
                 (adapter_config.json, adapter_model.safetensors)",
                dir.display()
            )?;
            say_peak()?;
        }
        (Side::Peft(dir), Side::Checkpoint(out)) => {
            let Some(base) = &args.base else {
                bail!(
                    "--from peft {}: give the adapter's base as a megatron-rs checkpoint with \
                     --base CKPT (its Hugging Face model imported with `--from hf`)",
                    dir.display()
                );
            };
            let c = convert::peft::import(&dir, base, &out)
                .with_context(|| format!("--from peft {} --to {}", dir.display(), out.display()))?;
            let lora = c.lora.as_ref().map_or(0, |l| l.rank);
            say!(
                "converted PEFT's adapter {} (rank {lora}) into {}, on the base {}",
                dir.display(),
                out.display(),
                base.display()
            )?;
        }
        (Side::Peft(dir), _) => bail!(
            "--from peft {}: a PEFT adapter converts into a megatron-rs checkpoint \
             (`--from peft DIR --to CKPT --base BASE`)",
            dir.display()
        ),
        (_, Side::Peft(dir)) => bail!(
            "--to peft {}: a PEFT adapter is written from a megatron-rs checkpoint trained with \
             --lora-rank (`--from CKPT --to peft DIR`)",
            dir.display()
        ),
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
