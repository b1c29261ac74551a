//! Converting checkpoints between megatron-rs and other formats.

pub mod architecture;
pub mod hf_config;
pub mod hf_gpt2;
pub mod hf_llama;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::{self, CheckpointMeta, Whole};
use megatron_models::GptConfig;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{Value, json};

use crate::tokenizer::{self, Tokenizer};

/// Converts the Hugging Face directory `hf_dir` into a megatron-rs checkpoint in the new or
/// empty directory `out`, as the architecture its `config.json` names (with `gpt2_only`, GPT-2
/// or refused). Returns the architecture and the model.
pub fn import_hf(hf_dir: &Path, out: &Path, gpt2_only: bool) -> Result<(&'static str, GptConfig)> {
    let config = read_hf_config(hf_dir)?;
    let arch = hf_config::HfConfig::new(&config)?.architecture()?;
    let gpt2 = matches!(arch, "GPT2LMHeadModel" | "GPT2Model");
    if gpt2_only && !gpt2 {
        bail!(
            "{}: config.json names {arch}, not GPT-2 (convert it with --from hf)",
            hf_dir.display()
        );
    }
    let c = match gpt2 {
        true => hf_gpt2::import(hf_dir, out)?,
        false => hf_llama::import(hf_dir, out)?,
    };
    Ok((arch, c))
}

/// Writes the checkpoint `ckpt` as a Hugging Face directory `hf_dir` (new or empty) of the
/// architecture that holds its model exactly (with `gpt2_only`, GPT-2 or refused); a model no
/// architecture holds is refused naming what each lacks. Returns the architecture and the model.
pub fn export_hf(ckpt: &Path, hf_dir: &Path, gpt2_only: bool) -> Result<(&'static str, GptConfig)> {
    let loaded = checkpoint::open(ckpt)?;
    let c: GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    let arch = match gpt2_only {
        true => architecture::require_gpt2(&c)
            .map(|()| architecture::HfArchitecture::Gpt2)
            .with_context(|| format!("{}", loaded.dir().display()))?,
        false => {
            architecture::for_model(&c).with_context(|| format!("{}", loaded.dir().display()))?
        }
    };
    drop(loaded);
    match arch {
        architecture::HfArchitecture::Gpt2 => Ok((arch.name(), hf_gpt2::export(ckpt, hf_dir)?)),
        architecture::HfArchitecture::LlamaFamily(_) => hf_llama::export(ckpt, hf_dir),
    }
}

/// A Hugging Face directory's `config.json`.
pub fn read_hf_config(hf_dir: &Path) -> Result<Value> {
    let path = hf_dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))
}

/// Saves an imported model (`model`: whole tensors by our names) with architecture `c` as a
/// megatron-rs checkpoint (iteration 0, no optimizer state) in `out`, with `hf_dir`'s
/// `tokenizer.json` when it has one (refused when it has more tokens than the model);
/// `format` names the source in the checkpoint's run record.
pub(crate) fn save_imported(
    hf_dir: &Path,
    out: &Path,
    c: &GptConfig,
    model: &BTreeMap<String, Whole>,
    format: &str,
) -> Result<()> {
    let tokenizer_path = hf_dir.join(checkpoint::TOKENIZER_FILE);
    let (tokenizer, files) = if tokenizer_path.is_file() {
        let t = Tokenizer::from_file(&tokenizer_path)?;
        if t.vocab_size() > c.vocab_size {
            bail!(
                "{}: {} tokens, more than the model's vocabulary of {}",
                tokenizer_path.display(),
                t.vocab_size(),
                c.vocab_size
            );
        }
        tokenizer::checkpoint_record(&t)?
    } else {
        (String::new(), Vec::new())
    };
    let mut run = json!({ "imported_from": hf_dir.display().to_string(), "format": format });
    if !tokenizer.is_empty() {
        run["tokenizer"] = json!(tokenizer);
    }
    let meta = CheckpointMeta {
        format: checkpoint::FORMAT.to_string(),
        iteration: 0,
        adam_steps: 0,
        seed: 0,
        consumed_samples: 0,
        saved_tp: 1,
        saved_dp: 1,
        saved_pp: 1,
        model: serde_json::to_value(c)?,
        run,
        files: BTreeMap::new(),
        grad_scaler: None,
        meta_sha256: None,
    };
    let files: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(name, bytes)| (name.as_str(), bytes.as_slice()))
        .collect();
    checkpoint::save(out, model, None, &files, meta)?;
    Ok(())
}

/// The tokenizer a checkpoint carries, if any (`dir`: the checkpoint's directory, for errors).
pub(crate) fn checkpoint_tokenizer(ckpt: &Path, dir: &Path) -> Result<Option<Tokenizer>> {
    tokenizer::checkpoint_tokenizer(ckpt)?
        .map(|spec| {
            Tokenizer::from_spec(&spec)
                .with_context(|| format!("{}: the checkpoint's tokenizer", dir.display()))
        })
        .transpose()
}

/// Writes a Hugging Face directory `hf_dir`: `tensors` (by their Hugging Face names) in
/// `model.safetensors` as f32, the tokenizer's file when there is one, and the `config.json`
/// that `config` makes from the tokenizer's end-of-text id (`None` when unknown or not one of
/// the model's `vocab_size` tokens).
pub(crate) fn write_hf<'t>(
    hf_dir: &Path,
    tensors: impl Iterator<Item = (String, &'t Whole)>,
    tokenizer: Option<&Tokenizer>,
    vocab_size: usize,
    config: impl FnOnce(Option<u32>) -> Value,
) -> Result<()> {
    checkpoint::create_dir(hf_dir)?;
    let views = tensors
        .map(|(name, t)| {
            Ok((
                name,
                TensorView::new(Dtype::F32, t.shape.clone(), bytemuck::cast_slice(&t.data))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(metadata))?;
    checkpoint::write_atomically(&hf_dir.join("model.safetensors"), &bytes)?;
    if let Some(bytes) = tokenizer.map(Tokenizer::file_bytes).transpose()?.flatten() {
        checkpoint::write_atomically(&hf_dir.join(checkpoint::TOKENIZER_FILE), &bytes)?;
    }
    // An end-of-text id outside the vocabulary (the byte tokenizer's 256 beside 256 bytes) is
    // no token of the model: left out.
    let config = config(
        tokenizer
            .and_then(Tokenizer::eod)
            .filter(|&id| (id as usize) < vocab_size),
    );
    checkpoint::write_atomically(
        &hf_dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    Ok(())
}
