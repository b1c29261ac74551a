//! Converting checkpoints between megatron-rs and other formats.

pub mod architecture;
pub mod hf_config;
pub mod hf_deepseek;
pub mod hf_files;
pub mod hf_gpt2;
pub mod hf_llama;
pub mod peft;
pub mod stream;

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::{self, CheckpointMeta, Loaded};
use megatron_models::GptConfig;
use safetensors::tensor::Dtype;
use serde_json::{Value, json};

use stream::{Check, OutTensor};

use crate::tokenizer::{self, Tokenizer};

/// How an export writes its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// The dtype written (F32, BF16 or F16); `None`: the dtype of the model the checkpoint was
    /// imported from (its carried `config.json`'s `dtype`), else the checkpoint's own.
    pub dtype: Option<Dtype>,
    /// The largest shard in bytes, as transformers' `max_shard_size` (a tensor larger than it
    /// has a shard of its own).
    pub max_shard_size: u64,
    /// Folds the checkpoint's LoRA adapters into the weights they sit beside
    /// (`W + (α / r)·B·A`); a checkpoint with adapters is refused without it.
    pub merge_lora: bool,
}

impl Default for ExportOptions {
    /// transformers 5's defaults: the model's dtype, shards of at most 50 GB.
    fn default() -> Self {
        ExportOptions {
            dtype: None,
            max_shard_size: 50_000_000_000,
            merge_lora: false,
        }
    }
}

/// What a conversion wrote.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The Hugging Face architecture.
    pub arch: &'static str,
    /// The model.
    pub config: GptConfig,
    /// The dtype of the weights written (the one most tensors have, on import).
    pub dtype: Dtype,
    /// Bytes of weights written.
    pub bytes: u64,
    /// The weight files written (an export's shards and index; an import's checkpoint file).
    pub weight_files: Vec<String>,
    /// The files carried with the weights: into the checkpoint (`hf/…`) or back out.
    pub carried: Vec<String>,
    /// What of the source was left out on purpose, and why (an import's layers the model
    /// does not build).
    pub skipped: Vec<String>,
}

/// Converts the Hugging Face directory `hf_dir` into a megatron-rs checkpoint in the new or
/// empty directory `out`, as the architecture its `config.json` names (with `gpt2_only`, GPT-2
/// or refused), tensor by tensor in their own dtype.
pub fn import_hf(hf_dir: &Path, out: &Path, gpt2_only: bool) -> Result<Converted> {
    let config = read_hf_config(hf_dir)?;
    let arch = hf_config::HfConfig::new(&config)?.architecture()?;
    let gpt2 = matches!(arch, "GPT2LMHeadModel" | "GPT2Model");
    if gpt2_only && !gpt2 {
        bail!(
            "{}: config.json names {arch}, not GPT-2 (convert it with --from hf)",
            hf_dir.display()
        );
    }
    match (gpt2, arch) {
        (true, _) => hf_gpt2::import(hf_dir, out),
        (false, hf_deepseek::ARCHITECTURE) => hf_deepseek::import(hf_dir, out),
        (false, _) => hf_llama::import(hf_dir, out),
    }
}

/// Writes the checkpoint `ckpt` as a Hugging Face directory `hf_dir` (new or empty) of the
/// architecture that holds its model exactly (with `gpt2_only`, GPT-2 or refused); a model no
/// architecture holds is refused naming what each lacks.
pub fn export_hf(
    ckpt: &Path,
    hf_dir: &Path,
    gpt2_only: bool,
    options: &ExportOptions,
) -> Result<Converted> {
    let meta = checkpoint::read_meta(ckpt)?;
    let c: GptConfig = serde_json::from_value(meta.model.clone())
        .with_context(|| format!("{}: the model config", ckpt.display()))?;
    let arch = match gpt2_only {
        true => architecture::require_gpt2(&c)
            .map(|()| architecture::HfArchitecture::Gpt2)
            .with_context(|| format!("{}", ckpt.display()))?,
        false => architecture::for_model(&c).with_context(|| format!("{}", ckpt.display()))?,
    };
    match arch {
        architecture::HfArchitecture::Gpt2 => hf_gpt2::export(ckpt, hf_dir, options),
        architecture::HfArchitecture::LlamaFamily(_) => hf_llama::export(ckpt, hf_dir, options),
        architecture::HfArchitecture::DeepseekV3 => hf_deepseek::export(ckpt, hf_dir, options),
    }
}

/// A Hugging Face directory's `config.json`.
pub fn read_hf_config(hf_dir: &Path) -> Result<Value> {
    let path = hf_dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))
}

/// Saves an imported model (`tensors`: by our names, streamed from the Hugging Face files in
/// their own dtype, every value checked finite) with architecture `c` as a megatron-rs
/// checkpoint (iteration 0, no optimizer state) in `out`, with `hf_dir`'s `tokenizer.json`
/// when it has one (refused when it has more tokens than the model) and the files an export
/// writes back ([`hf_files::CARRIED`], in `hf/`); `arch` names the source in the run record.
pub(crate) fn save_imported(
    hf_dir: &Path,
    out: &Path,
    c: &GptConfig,
    tensors: &[OutTensor<'_>],
    arch: &'static str,
) -> Result<Converted> {
    let tokenizer_path = hf_dir.join(checkpoint::TOKENIZER_FILE);
    let (tokenizer, mut files) = if tokenizer_path.is_file() {
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
    let carried = hf_files::carried_from(hf_dir)?;
    let carried_names = carried.iter().map(|(name, _)| name.clone()).collect();
    files.extend(carried);
    let mut run = json!({ "imported_from": hf_dir.display().to_string(), "format": arch });
    if !tokenizer.is_empty() {
        run["tokenizer"] = json!(tokenizer);
    }
    save_converted(out, c, tensors, &files, run, None)?;
    Ok(Converted {
        arch,
        config: c.clone(),
        dtype: most_common_dtype(tensors),
        bytes: tensors.iter().map(OutTensor::bytes).sum(),
        weight_files: vec![checkpoint::MODEL_FILE.to_string()],
        carried: carried_names,
        skipped: Vec::new(),
    })
}

/// Saves a converted model `c` as a megatron-rs checkpoint (iteration 0, no optimizer state)
/// in `out`: `tensors` streamed into its parameter file (every value checked finite), `files`
/// beside them, `run` as its record, `base` as the checkpoint holding what it does not.
pub(crate) fn save_converted(
    out: &Path,
    c: &GptConfig,
    tensors: &[OutTensor<'_>],
    files: &checkpoint::Files,
    run: Value,
    base: Option<std::path::PathBuf>,
) -> Result<()> {
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
        base,
        meta_sha256: None,
    };
    let files: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(name, bytes)| (name.as_str(), bytes.as_slice()))
        .collect();
    let metadata = BTreeMap::from([("format".to_string(), checkpoint::FORMAT.to_string())]);
    let mut write = |path: &Path| {
        stream::write_file(path, tensors, &metadata, Check::Finite).map_err(|e| {
            checkpoint::CheckpointError::Format {
                path: path.to_path_buf(),
                message: format!("{e:#}"),
            }
        })
    };
    checkpoint::save_with_model(out, &mut write, &files, meta)?;
    Ok(())
}

/// The dtype most of `tensors`' bytes are in (F32 for none).
fn most_common_dtype(tensors: &[OutTensor<'_>]) -> Dtype {
    let mut bytes: Vec<(Dtype, u64)> = Vec::new();
    for t in tensors {
        match bytes.iter_mut().find(|(d, _)| *d == t.dtype) {
            Some((_, b)) => *b += t.bytes(),
            None => bytes.push((t.dtype, t.bytes())),
        }
    }
    bytes
        .into_iter()
        .max_by_key(|&(_, b)| b)
        .map_or(Dtype::F32, |(d, _)| d)
}

/// The dtype a Hugging Face config names (`dtype`, or transformers 4's `torch_dtype`), when it
/// is one parameters are held in.
pub fn config_dtype(config: &Value) -> Option<Dtype> {
    ["dtype", "torch_dtype"]
        .iter()
        .find_map(|key| config[*key].as_str())
        .and_then(dtype_of_name)
}

/// F32, BF16 or F16 by torch's name (`float32`, `bfloat16`, `float16`) or its short one
/// (`fp32`, `bf16`, `fp16`).
pub fn dtype_of_name(name: &str) -> Option<Dtype> {
    match name {
        "float32" | "fp32" | "f32" => Some(Dtype::F32),
        "bfloat16" | "bf16" => Some(Dtype::BF16),
        "float16" | "fp16" | "f16" | "half" => Some(Dtype::F16),
        _ => None,
    }
}

/// torch's name of an F32, BF16 or F16 dtype.
pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        _ => "float32",
    }
}

/// The config keys that hold the rotary settings, in either of transformers' forms.
const ROPE_KEYS: [&str; 4] = [
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
];

/// The `config.json` an export writes. With the `original` an import carried: itself where
/// the model is still the one it describes (`generated`, what megatron-rs would write for the
/// model, equals `regenerated`, what it writes for the original's model), so every float,
/// token id, RoPE form and field megatron-rs does not read stays as it was; else the original
/// with each field megatron-rs writes that changed replaced. Without one: `generated`. The
/// dtype fields say `dtype`.
pub(crate) fn export_config(
    original: Option<&Value>,
    generated: Value,
    regenerated: Option<Value>,
    dtype: Dtype,
) -> Value {
    let mut out = match (original, regenerated) {
        (Some(original), Some(regenerated)) => {
            let mut out = original.clone();
            let (Some(map), Some(gen_map), Some(old)) = (
                out.as_object_mut(),
                generated.as_object(),
                regenerated.as_object(),
            ) else {
                return generated;
            };
            let rope_changed = ROPE_KEYS.iter().any(|k| gen_map.get(*k) != old.get(*k));
            if rope_changed {
                for k in ROPE_KEYS {
                    map.shift_remove(k);
                }
            }
            for (k, v) in gen_map {
                if old.get(k) != Some(v) || (rope_changed && ROPE_KEYS.contains(&k.as_str())) {
                    map.insert(k.clone(), v.clone());
                }
            }
            for k in old.keys() {
                if !gen_map.contains_key(k) {
                    map.shift_remove(k);
                }
            }
            out
        }
        _ => generated,
    };
    let name = json!(dtype_name(dtype));
    let mut set = false;
    for key in ["dtype", "torch_dtype"] {
        if out.get(key).is_some() {
            out[key] = name.clone();
            set = true;
        }
    }
    if !set {
        out["dtype"] = name;
    }
    out
}

/// A float of the model's config (f32) as the shortest decimal that reads back as it: 1e-6,
/// not 9.999999974752427e-7.
pub(crate) fn float(v: f32) -> Value {
    v.to_string()
        .parse::<f64>()
        .map_or_else(|_| json!(v), |f| json!(f))
}

/// The dtype an export writes: the option's, else the carried config's, else `tensors`'.
pub(crate) fn export_dtype(
    options: &ExportOptions,
    original: Option<&Value>,
    tensors: &[OutTensor<'_>],
) -> Dtype {
    options
        .dtype
        .or_else(|| original.and_then(config_dtype))
        .unwrap_or_else(|| most_common_dtype(tensors))
}

/// Writes an export into `hf_dir` (new or empty), whole or not at all: `tensors` (their dtype
/// set to `dtype`) sharded as transformers shards, `config`, the checkpoint's `tokenizer.json`
/// and the files it carries (but its config), then the directory renamed into place.
pub(crate) fn write_export(
    hf_dir: &Path,
    loaded: &Loaded,
    mut tensors: Vec<OutTensor<'_>>,
    config: &Value,
    dtype: Dtype,
    options: &ExportOptions,
    carried: &checkpoint::Files,
) -> Result<(u64, Vec<String>, Vec<String>)> {
    let staging = hf_files::Staging::new(hf_dir)?;
    for t in &mut tensors {
        t.dtype = dtype;
    }
    let bytes = tensors.iter().map(OutTensor::bytes).sum();
    let weight_files = stream::write_sharded(staging.dir(), &tensors, options.max_shard_size)?;
    let mut written = Vec::new();
    if let Some(path) = loaded.file(checkpoint::TOKENIZER_FILE) {
        let tokenizer = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        staging.write(checkpoint::TOKENIZER_FILE, &tokenizer)?;
        written.push(checkpoint::TOKENIZER_FILE.to_string());
    }
    let prefix = format!("{}/", hf_files::CARRIED_DIR);
    for (name, bytes) in carried {
        let Some(name) = name.strip_prefix(&prefix) else {
            continue;
        };
        if name != "config.json" {
            staging.write(name, bytes)?;
            written.push(name.to_string());
        }
    }
    let original = hf_files::carried_config(carried)?;
    // The original file itself when nothing changed: byte for byte as transformers wrote it.
    let text = match (
        &original,
        carried
            .iter()
            .find(|(n, _)| *n == format!("{prefix}config.json")),
    ) {
        (Some(o), Some((_, bytes))) if o == config => bytes.clone(),
        _ => {
            let mut text = serde_json::to_string_pretty(config)?;
            text.push('\n');
            text.into_bytes()
        }
    };
    staging.write("config.json", &text)?;
    staging.commit()?;
    Ok((bytes, weight_files, written))
}

/// A checkpoint's tensors for an export: its own file's, and those of the base it names
/// (a LoRA fine-tune's frozen weights), opened for streaming.
pub(crate) struct CheckpointTensors {
    dir: std::path::PathBuf,
    own: stream::SafetensorsFile,
    base: Option<stream::SafetensorsFile>,
}

impl CheckpointTensors {
    /// Opens `loaded`'s parameters, and its base's when it names one (verified as `loaded`
    /// was, when it was opened).
    pub(crate) fn open(loaded: &Loaded) -> Result<Self> {
        let file =
            |l: &Loaded| stream::SafetensorsFile::open(&l.dir().join(checkpoint::MODEL_FILE));
        let own = file(loaded)?;
        let base = loaded.base().map(file).transpose()?;
        Ok(CheckpointTensors {
            dir: loaded.dir().to_path_buf(),
            own,
            base,
        })
    }

    /// Parameter `name`: the checkpoint's, else its base's.
    pub(crate) fn get(&self, name: &str) -> Result<stream::TensorRef<'_>> {
        self.find(name)
            .with_context(|| format!("{}: no tensor `{name}`", self.dir.display()))
    }

    /// Parameter `name` if the checkpoint or its base has it.
    pub(crate) fn find(&self, name: &str) -> Option<stream::TensorRef<'_>> {
        self.own
            .tensor(name)
            .or_else(|| self.base.as_ref().and_then(|b| b.tensor(name)))
    }
}

/// Refuses an export whose LoRA adapters and `--merge-lora` disagree: adapters need
/// `--merge-lora` (`also`: what else could write them, said after it), and `--merge-lora` needs
/// adapters. `dir` is the checkpoint's directory, for the messages.
pub(crate) fn check_merge_lora(
    config: &GptConfig,
    merge_lora: bool,
    dir: &Path,
    also: &str,
) -> Result<()> {
    match (&config.lora, merge_lora) {
        (Some(lora), false) => bail!(
            "{}: the checkpoint holds LoRA adapters (rank {} beside {}): --merge-lora folds them \
             into the weights{also}",
            dir.display(),
            lora.rank,
            lora.targets.join(", ")
        ),
        (None, true) => bail!(
            "{}: --merge-lora, but the checkpoint holds no LoRA adapters",
            dir.display()
        ),
        _ => Ok(()),
    }
}

/// The tokenizer's end-of-text id when it is one of the model's `vocab_size` tokens (the byte
/// tokenizer's 256 beside 256 bytes is not).
pub(crate) fn eod_id(tokenizer: Option<&Tokenizer>, vocab_size: usize) -> Option<u32> {
    tokenizer
        .and_then(Tokenizer::eod)
        .filter(|&id| (id as usize) < vocab_size)
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
