//! Hugging Face GPT-2 (`transformers`' `GPT2LMHeadModel`: `config.json` + `model.safetensors`)
//! to and from megatron-rs checkpoints.
//!
//! The layouts differ in three ways. Hugging Face's `Conv1D` stores weights `[in, out]`, ours
//! (like `torch.nn.Linear` and Megatron-LM) `[out, in]`. Its fused `c_attn` lays the output out
//! as all queries, all keys, all values (`[q | k | v]`, heads inside each); ours interleaves per
//! head (`[q₀ k₀ v₀ | q₁ k₁ v₁ | …]`) so that a column-parallel split gives each rank whole heads.
//! And the output layer is tied to the embedding unless `tie_word_embeddings` is false
//! (`--untie-embeddings-and-output-weights`): only then is `lm_head.weight` stored. A model
//! GPT-2 cannot hold exactly (a Llama-family flag, grouped-query attention, other head sizes) is
//! refused by name on export ([`super::architecture`]).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::{self, Whole};
use megatron_models::GptConfig;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{Value, json};

use super::hf_config::{Bound, HfConfig};

/// The architecture a GPT-2 `config.json` describes, every field within the command line's
/// bounds and named when refused.
pub fn config_from_hf(config: &Value) -> Result<GptConfig> {
    let hf = HfConfig::new(config)?;
    let arch = hf.architecture()?;
    if !matches!(arch, "GPT2LMHeadModel" | "GPT2Model") {
        bail!("config.json: architecture {arch} is not GPT-2 (convert it with --from hf)");
    }
    if let Some(act) = hf.opt_str("activation_function")?
        && !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast")
    {
        bail!(
            "config.json: activation `{act}` is not GPT-2's tanh GeLU (gelu_new), which megatron-rs implements"
        );
    }
    for flag in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if hf.flag(flag)? {
            bail!("config.json: `{flag}` = true is not supported");
        }
    }
    if hf.opt_bool("scale_attn_weights")? == Some(false) {
        bail!(
            "config.json: `scale_attn_weights` = false (attention scores not divided by √d) is \
             not supported: megatron-rs always scales them, as GPT-2 and Megatron-LM do"
        );
    }
    let (hidden, heads) = (hf.int("n_embd", Bound::Dim)?, hf.int("n_head", Bound::Dim)?);
    if !hidden.is_multiple_of(heads) {
        bail!("config.json: `n_embd` {hidden} is not divisible by `n_head` {heads}");
    }
    let mut c = GptConfig::new(
        hf.int("n_layer", Bound::Layers)?,
        hidden,
        heads,
        hf.int("vocab_size", Bound::Vocab)?,
        hf.int("n_positions", Bound::Dim)?,
    );
    if let Some(inner) = hf.opt_int("n_inner", Bound::Dim)? {
        c.ffn_hidden_size = inner;
    }
    c.layernorm_epsilon = hf.positive("layer_norm_epsilon", 1e-5)? as f32;
    c.hidden_dropout = hf.fraction("resid_pdrop", 0.1)? as f32;
    c.attention_dropout = hf.fraction("attn_pdrop", 0.1)? as f32;
    c.init_method_std = hf.non_negative("initializer_range", 0.02)? as f32;
    // transformers ties GPT-2's head to the embedding unless the file says otherwise.
    c.untie_embeddings_and_output_weights = hf.opt_bool("tie_word_embeddings")? == Some(false);
    super::hf_config::check_model(&c)?;
    Ok(c)
}

/// A GPT-2 `config.json` for an architecture whose tokenizer ends documents with `eod` (GPT-2's
/// `<|endoftext|>`, its `bos_token_id` and `eos_token_id`; left out when unknown).
pub fn config_to_hf(c: &GptConfig, eod: Option<u32>) -> Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.max_position_embeddings,
        "n_ctx": c.max_position_embeddings,
        "n_embd": c.hidden_size,
        "n_layer": c.num_layers,
        "n_head": c.num_attention_heads,
        "n_inner": c.ffn_hidden_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": c.layernorm_epsilon,
        "resid_pdrop": c.hidden_dropout,
        "embd_pdrop": c.hidden_dropout,
        "attn_pdrop": c.attention_dropout,
        "initializer_range": c.init_method_std,
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "scale_attn_weights": true,
        "bos_token_id": eod,
        "eos_token_id": eod,
    })
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(t: &Whole) -> Whole {
    let (r, c) = (t.shape[0], t.shape[1]);
    let mut data = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            data[j * r + i] = t.data[i * c + j];
        }
    }
    Whole {
        shape: vec![c, r],
        data,
    }
}

/// Row `r` of our per-head `[q k v]` layout is row `hf_row(r)` of Hugging Face's `[q | k | v]`.
fn hf_row(r: usize, hidden: usize, heads: usize) -> usize {
    let d = hidden / heads;
    let (head, rest) = (r / (3 * d), r % (3 * d));
    let (part, j) = (rest / d, rest % d);
    part * hidden + head * d + j
}

/// Reorders the rows of a `[3h, …]` tensor between the two QKV layouts.
fn permute_qkv(t: &Whole, hidden: usize, heads: usize, to_ours: bool) -> Whole {
    let row: usize = t.shape[1..].iter().product();
    let mut data = vec![0.0; t.data.len()];
    for r in 0..3 * hidden {
        let h = hf_row(r, hidden, heads);
        let (dst, src) = if to_ours { (r, h) } else { (h, r) };
        data[dst * row..(dst + 1) * row].copy_from_slice(&t.data[src * row..(src + 1) * row]);
    }
    Whole {
        shape: t.shape.clone(),
        data,
    }
}

/// Every tensor of a safetensors file as f32 (from F32, F16 or BF16), by name with GPT-2's
/// `transformer.` prefix taken off; a tensor present under both names is refused.
pub(crate) fn read_safetensors(path: &Path) -> Result<HashMap<String, Whole>> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let whole = to_whole(path, &name, &view)?;
        // `transformer.` is the prefix of GPT2LMHeadModel's weights; GPT2Model's have none.
        let ours = name
            .strip_prefix("transformer.")
            .unwrap_or(&name)
            .to_string();
        if out.insert(ours.clone(), whole).is_some() {
            bail!(
                "{}: `{ours}` is there twice (with and without the `transformer.` prefix): \
                 which one is the model's is not known",
                path.display()
            );
        }
    }
    Ok(out)
}

/// A tensor of a safetensors file as f32.
pub(crate) fn to_whole(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Whole> {
    let data: Vec<f32> = match view.dtype() {
        Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => view
            .data()
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => view
            .data()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => bail!(
            "{}: `{name}` is {other:?}; expected F32, F16 or BF16",
            path.display()
        ),
    };
    Ok(Whole {
        shape: view.shape().to_vec(),
        data,
    })
}

/// Refuses to write a conversion into `dir` when it already holds files (a save directory's
/// checkpoints, or another model): a conversion never overwrites.
pub fn refuse_existing(dir: &Path) -> Result<()> {
    if let Some(why) = checkpoint::blocked_dir(dir) {
        bail!("{} is {why}", dir.display());
    }
    let Ok(mut entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    if let Some(Ok(entry)) = entries.next() {
        bail!(
            "{} already holds files (e.g. {}): convert into a new or empty directory",
            dir.display(),
            entry.file_name().to_string_lossy()
        );
    }
    Ok(())
}

/// Converts a Hugging Face GPT-2 directory into a megatron-rs checkpoint (iteration 0, no
/// optimizer state) in the save directory `out`, which must be new or empty; the directory's
/// `tokenizer.json`, when it has one, goes into the checkpoint. Returns the architecture.
pub fn import(hf_dir: &Path, out: &Path) -> Result<GptConfig> {
    refuse_existing(out)?;
    let config = super::read_hf_config(hf_dir)?;
    let c = config_from_hf(&config)?;
    let weights = hf_dir.join("model.safetensors");
    if !weights.exists() && hf_dir.join("pytorch_model.bin").exists() {
        bail!(
            "{}: only model.safetensors is read; save the model with safe_serialization=True",
            hf_dir.display()
        );
    }
    let mut hf = read_safetensors(&weights)?;
    // The causal-mask buffers of older checkpoints are not weights.
    hf.retain(|name, _| !(name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")));
    let head = hf.remove("lm_head.weight");
    let mut take = |name: &str, shape: &[usize]| -> Result<Whole> {
        let t = hf
            .remove(name)
            .with_context(|| format!("{}: no tensor `{name}`", weights.display()))?;
        if t.shape != shape {
            bail!(
                "{}: `{name}` has shape {:?}, the config implies {shape:?}",
                weights.display(),
                t.shape
            );
        }
        Ok(t)
    };
    let (h, f, heads) = (c.hidden_size, c.ffn_hidden_size, c.num_attention_heads);
    let mut model = BTreeMap::new();
    model.insert(
        "wte.weight".to_string(),
        take("wte.weight", &[c.vocab_size, h])?,
    );
    model.insert(
        "wpe.weight".to_string(),
        take("wpe.weight", &[c.max_position_embeddings, h])?,
    );
    for i in 0..c.num_layers {
        let hf_name = |s: &str| format!("h.{i}.{s}");
        let ours = |s: &str| format!("blocks.{i}.{s}");
        for (hf_ln, our_ln) in [("ln_1", "ln1"), ("ln_2", "ln2")] {
            model.insert(
                ours(&format!("{our_ln}.weight")),
                take(&hf_name(&format!("{hf_ln}.weight")), &[h])?,
            );
            model.insert(
                ours(&format!("{our_ln}.bias")),
                take(&hf_name(&format!("{hf_ln}.bias")), &[h])?,
            );
        }
        let qkv = transpose(&take(&hf_name("attn.c_attn.weight"), &[h, 3 * h])?);
        model.insert(ours("attn.qkv.weight"), permute_qkv(&qkv, h, heads, true));
        model.insert(
            ours("attn.qkv.bias"),
            permute_qkv(
                &take(&hf_name("attn.c_attn.bias"), &[3 * h])?,
                h,
                heads,
                true,
            ),
        );
        model.insert(
            ours("attn.proj.weight"),
            transpose(&take(&hf_name("attn.c_proj.weight"), &[h, h])?),
        );
        model.insert(
            ours("attn.proj.bias"),
            take(&hf_name("attn.c_proj.bias"), &[h])?,
        );
        model.insert(
            ours("mlp.fc1.weight"),
            transpose(&take(&hf_name("mlp.c_fc.weight"), &[h, f])?),
        );
        model.insert(ours("mlp.fc1.bias"), take(&hf_name("mlp.c_fc.bias"), &[f])?);
        model.insert(
            ours("mlp.fc2.weight"),
            transpose(&take(&hf_name("mlp.c_proj.weight"), &[f, h])?),
        );
        model.insert(
            ours("mlp.fc2.bias"),
            take(&hf_name("mlp.c_proj.bias"), &[h])?,
        );
    }
    model.insert("ln_f.weight".to_string(), take("ln_f.weight", &[h])?);
    model.insert("ln_f.bias".to_string(), take("ln_f.bias", &[h])?);
    match (c.untie_embeddings_and_output_weights, head) {
        (true, Some(head)) if head.shape == [c.vocab_size, h] => {
            model.insert("wte.output_weight".to_string(), head);
        }
        (true, Some(head)) => bail!(
            "{}: `lm_head.weight` has shape {:?}, the config implies [{}, {h}]",
            weights.display(),
            head.shape,
            c.vocab_size
        ),
        (true, None) => bail!(
            "{}: no tensor `lm_head.weight` (the config does not tie it to the embedding)",
            weights.display()
        ),
        (false, Some(head)) if head.data != model["wte.weight"].data => bail!(
            "{}: `lm_head.weight` differs from `wte.weight`, but the config ties them",
            weights.display()
        ),
        (false, _) => {}
    }
    if let Some(extra) = hf.keys().next() {
        bail!("{}: unexpected tensor `{extra}`", weights.display());
    }
    super::save_imported(hf_dir, out, &c, &model, "hf-gpt2")?;
    Ok(c)
}

/// Writes the checkpoint `ckpt` as a Hugging Face GPT-2 directory `hf_dir`, new or empty
/// (`config.json`, `model.safetensors` with `transformer.`-prefixed names, the head tied; and
/// the checkpoint's `tokenizer.json` when it has one, whose end-of-text id becomes the
/// config's `bos_token_id` and `eos_token_id`).
pub fn export(ckpt: &Path, hf_dir: &Path) -> Result<GptConfig> {
    refuse_existing(hf_dir)?;
    let loaded = checkpoint::open(ckpt)?;
    let tokenizer = super::checkpoint_tokenizer(ckpt, loaded.dir())?;
    let c: GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    super::architecture::require_gpt2(&c).with_context(|| format!("{}", loaded.dir().display()))?;
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let get = |name: &str| loaded.model_tensor(name).map_err(anyhow::Error::from);
    let mut hf: BTreeMap<String, Whole> = BTreeMap::new();
    hf.insert("wte.weight".into(), get("wte.weight")?);
    hf.insert("wpe.weight".into(), get("wpe.weight")?);
    for i in 0..c.num_layers {
        let ours = |s: &str| format!("blocks.{i}.{s}");
        let hf_name = |s: &str| format!("h.{i}.{s}");
        for (hf_ln, our_ln) in [("ln_1", "ln1"), ("ln_2", "ln2")] {
            hf.insert(
                hf_name(&format!("{hf_ln}.weight")),
                get(&ours(&format!("{our_ln}.weight")))?,
            );
            hf.insert(
                hf_name(&format!("{hf_ln}.bias")),
                get(&ours(&format!("{our_ln}.bias")))?,
            );
        }
        let qkv = permute_qkv(&get(&ours("attn.qkv.weight"))?, h, heads, false);
        hf.insert(hf_name("attn.c_attn.weight"), transpose(&qkv));
        hf.insert(
            hf_name("attn.c_attn.bias"),
            permute_qkv(&get(&ours("attn.qkv.bias"))?, h, heads, false),
        );
        hf.insert(
            hf_name("attn.c_proj.weight"),
            transpose(&get(&ours("attn.proj.weight"))?),
        );
        hf.insert(hf_name("attn.c_proj.bias"), get(&ours("attn.proj.bias"))?);
        hf.insert(
            hf_name("mlp.c_fc.weight"),
            transpose(&get(&ours("mlp.fc1.weight"))?),
        );
        hf.insert(hf_name("mlp.c_fc.bias"), get(&ours("mlp.fc1.bias"))?);
        hf.insert(
            hf_name("mlp.c_proj.weight"),
            transpose(&get(&ours("mlp.fc2.weight"))?),
        );
        hf.insert(hf_name("mlp.c_proj.bias"), get(&ours("mlp.fc2.bias"))?);
    }
    hf.insert("ln_f.weight".into(), get("ln_f.weight")?);
    hf.insert("ln_f.bias".into(), get("ln_f.bias")?);
    let head = match c.untie_embeddings_and_output_weights {
        true => Some(get("wte.output_weight")?),
        false => None,
    };
    super::write_hf(
        hf_dir,
        hf.iter()
            .map(|(name, t)| (format!("transformer.{name}"), t))
            .chain(head.iter().map(|t| ("lm_head.weight".to_string(), t))),
        tokenizer.as_ref(),
        c.vocab_size,
        |eod| config_to_hf(&c, eod),
    )?;
    Ok(c)
}
