//! Converting checkpoints between megatron-rs and other formats.

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
/// that `config` makes from the tokenizer's end-of-text id (`None` when unknown).
pub(crate) fn write_hf<'t>(
    hf_dir: &Path,
    tensors: impl Iterator<Item = (String, &'t Whole)>,
    tokenizer: Option<&Tokenizer>,
    config: impl FnOnce(Option<u32>) -> Value,
) -> Result<()> {
    std::fs::create_dir_all(hf_dir).with_context(|| format!("creating {}", hf_dir.display()))?;
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
    let config = config(tokenizer.and_then(Tokenizer::eod));
    checkpoint::write_atomically(
        &hf_dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    Ok(())
}
