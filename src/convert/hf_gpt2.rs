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

use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::{self, Whole};
use megatron_models::GptConfig;
use serde_json::{Value, json};

use super::hf_config::{Bound, HfConfig};
use super::hf_files::HfWeights;
use super::stream::{OutTensor, SafetensorsFile, TensorRef};
use super::{Converted, ExportOptions, float};

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
        "layer_norm_epsilon": float(c.layernorm_epsilon),
        "resid_pdrop": float(c.hidden_dropout),
        "embd_pdrop": float(c.hidden_dropout),
        "attn_pdrop": float(c.attention_dropout),
        "initializer_range": float(c.init_method_std),
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

/// `src` rearranged by `f` (a transposition, the QKV rows' reordering) when it is written,
/// named `name`, of shape `shape`.
fn rearranged<'a>(
    name: String,
    src: TensorRef<'a>,
    shape: Vec<usize>,
    f: impl Fn(Whole) -> Whole + 'a,
) -> OutTensor<'a> {
    OutTensor::computed(name, src.dtype(), shape, move || {
        let t = Whole {
            shape: src.shape().to_vec(),
            data: src.read_all()?,
        };
        Ok(f(t).data)
    })
}

/// `src` (`[rows, cols]`) transposed.
fn transposed<'a>(name: String, src: TensorRef<'a>) -> OutTensor<'a> {
    let shape = src.shape().iter().rev().copied().collect();
    rearranged(name, src, shape, |t| transpose(&t))
}

/// Converts a Hugging Face GPT-2 directory into a megatron-rs checkpoint (iteration 0, no
/// optimizer state) in the save directory `out`, which must be new or empty, tensor by tensor
/// in their own dtype; the directory's `tokenizer.json`, when it has one, goes into the
/// checkpoint with the files an export writes back.
pub fn import(hf_dir: &Path, out: &Path) -> Result<Converted> {
    refuse_existing(out)?;
    let config = super::read_hf_config(hf_dir)?;
    let c = config_from_hf(&config)?;
    let arch = HfConfig::new(&config)?.architecture()?;
    // `transformer.` is the prefix of GPT2LMHeadModel's weights; GPT2Model's have none. The
    // causal-mask buffers of older checkpoints are not weights.
    let hf = HfWeights::open(hf_dir, |name| {
        let ours = name.strip_prefix("transformer.").unwrap_or(name);
        (!(ours.ends_with(".attn.bias") || ours.ends_with(".attn.masked_bias")))
            .then(|| ours.to_string())
    })?;
    let take = |name: &str, shape: &[usize]| hf.take(name, shape);
    let (h, f, heads) = (c.hidden_size, c.ffn_hidden_size, c.num_attention_heads);
    let embed = take("wte.weight", &[c.vocab_size, h])?;
    let mut model = vec![
        OutTensor::copy("wte.weight", embed),
        OutTensor::copy(
            "wpe.weight",
            take("wpe.weight", &[c.max_position_embeddings, h])?,
        ),
    ];
    for i in 0..c.num_layers {
        let hf_name = |s: &str| format!("h.{i}.{s}");
        let ours = |s: &str| format!("blocks.{i}.{s}");
        for (hf_ln, our_ln) in [("ln_1", "ln1"), ("ln_2", "ln2")] {
            for p in ["weight", "bias"] {
                model.push(OutTensor::copy(
                    ours(&format!("{our_ln}.{p}")),
                    take(&hf_name(&format!("{hf_ln}.{p}")), &[h])?,
                ));
            }
        }
        model.push(rearranged(
            ours("attn.qkv.weight"),
            take(&hf_name("attn.c_attn.weight"), &[h, 3 * h])?,
            vec![3 * h, h],
            move |t| permute_qkv(&transpose(&t), h, heads, true),
        ));
        model.push(rearranged(
            ours("attn.qkv.bias"),
            take(&hf_name("attn.c_attn.bias"), &[3 * h])?,
            vec![3 * h],
            move |t| permute_qkv(&t, h, heads, true),
        ));
        model.push(transposed(
            ours("attn.proj.weight"),
            take(&hf_name("attn.c_proj.weight"), &[h, h])?,
        ));
        model.push(OutTensor::copy(
            ours("attn.proj.bias"),
            take(&hf_name("attn.c_proj.bias"), &[h])?,
        ));
        model.push(transposed(
            ours("mlp.fc1.weight"),
            take(&hf_name("mlp.c_fc.weight"), &[h, f])?,
        ));
        model.push(OutTensor::copy(
            ours("mlp.fc1.bias"),
            take(&hf_name("mlp.c_fc.bias"), &[f])?,
        ));
        model.push(transposed(
            ours("mlp.fc2.weight"),
            take(&hf_name("mlp.c_proj.weight"), &[f, h])?,
        ));
        model.push(OutTensor::copy(
            ours("mlp.fc2.bias"),
            take(&hf_name("mlp.c_proj.bias"), &[h])?,
        ));
    }
    model.push(OutTensor::copy("ln_f.weight", take("ln_f.weight", &[h])?));
    model.push(OutTensor::copy("ln_f.bias", take("ln_f.bias", &[h])?));
    let head = hf.get("lm_head.weight");
    match (c.untie_embeddings_and_output_weights, head) {
        (true, Some(_)) => model.push(OutTensor::copy(
            "wte.output_weight",
            take("lm_head.weight", &[c.vocab_size, h])?,
        )),
        (true, None) => bail!(
            "{}: no tensor `lm_head.weight` (the config does not tie it to the embedding)",
            hf_dir.display()
        ),
        (false, Some(head)) if !head.same_values(&embed)? => bail!(
            "{}: `lm_head.weight` differs from `wte.weight`, but the config ties them",
            hf_dir.display()
        ),
        (false, Some(_)) => {
            take("lm_head.weight", &[c.vocab_size, h])?;
        }
        (false, None) => {}
    }
    hf.refuse_untaken()?;
    super::save_imported(hf_dir, out, &c, &model, arch)
}

/// Writes the checkpoint `ckpt` as a Hugging Face GPT-2 directory `hf_dir`, new or empty
/// (`config.json`, the weights with `transformer.`-prefixed names, the head tied unless
/// untied; and the checkpoint's `tokenizer.json` when it has one, whose end-of-text id becomes
/// the config's `bos_token_id` and `eos_token_id` when no imported config is carried).
pub fn export(ckpt: &Path, hf_dir: &Path, options: &ExportOptions) -> Result<Converted> {
    refuse_existing(hf_dir)?;
    let loaded = checkpoint::open(ckpt)?;
    let tokenizer = super::checkpoint_tokenizer(ckpt, loaded.dir())?;
    let c: GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    super::architecture::require_gpt2(&c).with_context(|| format!("{}", loaded.dir().display()))?;
    if c.lora.is_some() || options.merge_lora {
        bail!(
            "{}: LoRA adapters are exported for the Llama family (--merge-lora, --to peft); \
             GPT-2's are not supported",
            loaded.dir().display()
        );
    }
    let eod = super::eod_id(tokenizer.as_ref(), c.vocab_size);
    let carried = super::hf_files::carried_in(ckpt)?;
    let original = super::hf_files::carried_config(&carried)?;
    let before = original
        .as_ref()
        .and_then(|o| Some(config_to_hf(&config_from_hf(o).ok()?, eod)));
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let src = SafetensorsFile::open(&loaded.dir().join(checkpoint::MODEL_FILE))?;
    let get = |name: &str| {
        src.tensor(name)
            .with_context(|| format!("{}: no tensor `{name}`", loaded.dir().display()))
    };
    let t = |s: &str| format!("transformer.{s}");
    let mut hf = vec![
        OutTensor::copy(t("wte.weight"), get("wte.weight")?),
        OutTensor::copy(t("wpe.weight"), get("wpe.weight")?),
    ];
    for i in 0..c.num_layers {
        let ours = |s: &str| format!("blocks.{i}.{s}");
        let hf_name = |s: &str| format!("transformer.h.{i}.{s}");
        for (hf_ln, our_ln) in [("ln_1", "ln1"), ("ln_2", "ln2")] {
            for p in ["weight", "bias"] {
                hf.push(OutTensor::copy(
                    hf_name(&format!("{hf_ln}.{p}")),
                    get(&ours(&format!("{our_ln}.{p}")))?,
                ));
            }
        }
        hf.push(rearranged(
            hf_name("attn.c_attn.weight"),
            get(&ours("attn.qkv.weight"))?,
            vec![h, 3 * h],
            move |t| transpose(&permute_qkv(&t, h, heads, false)),
        ));
        hf.push(rearranged(
            hf_name("attn.c_attn.bias"),
            get(&ours("attn.qkv.bias"))?,
            vec![3 * h],
            move |t| permute_qkv(&t, h, heads, false),
        ));
        hf.push(transposed(
            hf_name("attn.c_proj.weight"),
            get(&ours("attn.proj.weight"))?,
        ));
        hf.push(OutTensor::copy(
            hf_name("attn.c_proj.bias"),
            get(&ours("attn.proj.bias"))?,
        ));
        hf.push(transposed(
            hf_name("mlp.c_fc.weight"),
            get(&ours("mlp.fc1.weight"))?,
        ));
        hf.push(OutTensor::copy(
            hf_name("mlp.c_fc.bias"),
            get(&ours("mlp.fc1.bias"))?,
        ));
        hf.push(transposed(
            hf_name("mlp.c_proj.weight"),
            get(&ours("mlp.fc2.weight"))?,
        ));
        hf.push(OutTensor::copy(
            hf_name("mlp.c_proj.bias"),
            get(&ours("mlp.fc2.bias"))?,
        ));
    }
    hf.push(OutTensor::copy(t("ln_f.weight"), get("ln_f.weight")?));
    hf.push(OutTensor::copy(t("ln_f.bias"), get("ln_f.bias")?));
    if c.untie_embeddings_and_output_weights {
        hf.push(OutTensor::copy("lm_head.weight", get("wte.output_weight")?));
    }
    let dtype = super::export_dtype(options, original.as_ref(), &hf);
    let config = super::export_config(original.as_ref(), config_to_hf(&c, eod), before, dtype);
    let (bytes, weight_files, carried) =
        super::write_export(hf_dir, &loaded, hf, &config, dtype, options, &carried)?;
    Ok(Converted {
        arch: "GPT2LMHeadModel",
        config: c,
        dtype,
        bytes,
        weight_files,
        carried,
        skipped: Vec::new(),
    })
}
