//! Hugging Face's Llama-family decoders (`LlamaForCausalLM`, `MistralForCausalLM` without a
//! sliding window, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, and the mixtures of experts
//! `MixtralForCausalLM` and `Qwen3MoeForCausalLM`: `config.json` and `model.safetensors`, or
//! shards named by `model.safetensors.index.json`) to and from megatron-rs checkpoints.
//!
//! The layouts differ in three places, all Megatron-LM's: the separate `q_proj`, `k_proj` and
//! `v_proj` become one QKV projection laid out per query group (each group's queries, then its
//! key and its value); `gate_proj` and `up_proj` (Mixtral's experts: `w1` and `w3`) become one
//! `fc1`, the gate's rows then the up projection's; and the experts' separate matrices become
//! stacked `[experts, ..]` tensors. Hugging Face's rotary embeddings already turn rotate-half
//! pairs, as Megatron-LM's default: no permutation of the queries and keys. Routing: Mixtral's
//! softmax over all experts renormalised over the top-k (Qwen3-MoE's `norm_topk_prob`) is the
//! softmax of the top-k logits, Megatron-LM's default; Qwen3-MoE without `norm_topk_prob` is
//! `--moe-router-pre-softmax`. A setting the model cannot honour (another rope type, a partial
//! rotary factor, an activation other than SiLU, router jitter, shared experts) is refused by
//! name, never ignored; every field is read with the command line's bounds
//! ([`super::hf_config`]), and a checkpoint is written as the family member that holds it
//! exactly ([`super::architecture`]).

use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint;
use megatron_core::moe::RouterConfig;
use megatron_core::tensor_parallel::{Llama3Scaling, Rotary};
use megatron_models::{GptConfig, MoeConfig, MoeLayerFreq};
use serde_json::{Value, json};

use super::hf_config::{self, Bound, HfConfig};
use super::hf_files::{self, HfWeights};
use super::hf_gpt2::refuse_existing;
use super::stream::{OutTensor, Slice, TensorRef};
use super::{Converted, ExportOptions, float};

/// The architectures read here.
pub const ARCHITECTURES: [&str; 6] = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
];

/// Hugging Face's names of a MoE layer's tensors: the router's and each expert's gate, up and
/// down projections (`{e}` the expert).
struct ExpertNames {
    router: &'static str,
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

/// Mixtral's (`block_sparse_moe`, `w1`/`w3`/`w2`) or Qwen3-MoE's (`mlp`, Llama's names).
fn expert_names(arch: &str) -> ExpertNames {
    match arch {
        "MixtralForCausalLM" => ExpertNames {
            router: "block_sparse_moe.gate.weight",
            gate: "block_sparse_moe.experts.{e}.w1.weight",
            up: "block_sparse_moe.experts.{e}.w3.weight",
            down: "block_sparse_moe.experts.{e}.w2.weight",
        },
        _ => ExpertNames {
            router: "mlp.gate.weight",
            gate: "mlp.experts.{e}.gate_proj.weight",
            up: "mlp.experts.{e}.up_proj.weight",
            down: "mlp.experts.{e}.down_proj.weight",
        },
    }
}

/// The rotary settings' object of a config: `rope_parameters` (transformers 5), or the older
/// top-level `rope_theta` and `partial_rotary_factor` with `rope_scaling`.
pub(crate) fn rope_parameters(hf: &HfConfig) -> Result<Value> {
    Ok(match hf.get("rope_parameters") {
        Value::Object(_) => hf.get("rope_parameters").clone(),
        Value::Null => {
            let mut p = match hf.get("rope_scaling") {
                Value::Object(m) => Value::Object(m.clone()),
                Value::Null => json!({}),
                other => bail!("config.json: `rope_scaling` is {other}, not an object"),
            };
            for key in ["rope_theta", "partial_rotary_factor"] {
                if !hf.absent(key) {
                    p[key] = hf.get(key).clone();
                }
            }
            p
        }
        other => bail!("config.json: `rope_parameters` is {other}, not an object"),
    })
}

/// The rotary settings of a config: `rope_parameters` (transformers 5), or the older top-level
/// `rope_theta` with `rope_scaling` (`rope_type`, or before that `type`). transformers' Llama
/// family rotates whole heads whatever `partial_rotary_factor` says: a factor other than 1 is
/// refused rather than read as a model transformers does not run.
fn rotary(hf: &HfConfig, default_theta: f64) -> Result<Rotary> {
    let params = rope_parameters(hf)?;
    let params = HfConfig::new(&params)?;
    let kind = params
        .opt_str("rope_type")?
        .or(params.opt_str("type")?)
        .unwrap_or("default");
    if let Some(f) = params.opt_float("partial_rotary_factor")?
        && f != 1.0
    {
        bail!(
            "config.json: `partial_rotary_factor` {f}: transformers' Llama family ignores it \
             and rotates whole heads; remove it to import the model transformers runs"
        );
    }
    let factor = |key: &str| -> Result<f32> {
        match params.opt_float(key)? {
            Some(v) => Ok(hf_config::positive(v, &format!("rope `{key}`"))? as f32),
            None => bail!("config.json: rope type {kind} needs `{key}`"),
        }
    };
    let scaling = match kind {
        "default" => None,
        "llama3" => {
            let s = Llama3Scaling {
                factor: factor("factor")?,
                low_freq_factor: factor("low_freq_factor")?,
                high_freq_factor: factor("high_freq_factor")?,
                original_max_position_embeddings: match params
                    .opt_int("original_max_position_embeddings", Bound::Dim)?
                {
                    Some(n) => n,
                    None => bail!(
                        "config.json: rope type llama3 needs `original_max_position_embeddings`"
                    ),
                },
            };
            if s.high_freq_factor <= s.low_freq_factor {
                bail!(
                    "config.json: rope `high_freq_factor` {} must be above `low_freq_factor` {} \
                     (the band between them is interpolated)",
                    s.high_freq_factor,
                    s.low_freq_factor
                );
            }
            Some(s)
        }
        other => {
            bail!("config.json: rope type `{other}` is not supported (default and llama3 are)")
        }
    };
    let base = params.opt_float("rope_theta")?.unwrap_or(default_theta);
    if base <= 1.0 {
        bail!("config.json: `rope_theta` {base} must be above 1");
    }
    Ok(Rotary {
        base: hf_config::positive(base, "`rope_theta`")? as f32,
        percent: 1.0,
        interleaved: false,
        scaling,
        yarn: None,
    })
}

/// The architecture a Llama-family `config.json` describes, every field within the command
/// line's bounds and named when refused.
pub fn config_from_hf(config: &Value) -> Result<GptConfig> {
    let hf = HfConfig::new(config)?;
    let arch = hf.architecture()?;
    if !ARCHITECTURES.contains(&arch) {
        bail!(
            "config.json: architecture {arch} is not one of the Llama family ({})",
            ARCHITECTURES.join(", ")
        );
    }
    if let Some(act) = hf.opt_str("hidden_act")?
        && act != "silu"
    {
        bail!("config.json: `hidden_act` {act} is not SwiGLU's silu");
    }
    if hf.flag("mlp_bias")? {
        bail!("config.json: `mlp_bias` = true (biases in the MLP) is not supported");
    }
    if hf.flag("attention_bias")? {
        bail!(
            "config.json: `attention_bias` = true (a bias on o_proj too) is not supported; \
             Qwen2's QKV bias is"
        );
    }
    let hidden = hf.int("hidden_size", Bound::Dim)?;
    let heads = hf.int("num_attention_heads", Bound::Dim)?;
    let groups = hf
        .opt_int("num_key_value_heads", Bound::Dim)?
        .unwrap_or(heads);
    if !heads.is_multiple_of(groups) {
        bail!(
            "config.json: `num_attention_heads` {heads} is not divisible by \
             `num_key_value_heads` {groups}"
        );
    }
    let head_dim = match (hf.opt_int("head_dim", Bound::Dim)?, arch) {
        (Some(d), _) => d,
        (None, "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM") => 128,
        (None, _) if hidden.is_multiple_of(heads) => hidden / heads,
        (None, _) => bail!(
            "config.json: `hidden_size` {hidden} is not divisible by `num_attention_heads` \
             {heads}, and there is no `head_dim`"
        ),
    };
    if head_dim < 2 || !head_dim.is_multiple_of(2) {
        bail!(
            "config.json: heads of {head_dim} channels (`head_dim`, or `hidden_size` / \
             `num_attention_heads`): rotary embeddings turn pairs of channels, an even number of \
             at least 2"
        );
    }
    // transformers' defaults where the file has no RoPE base.
    let default_theta = match arch {
        "MixtralForCausalLM" => 1e6,
        _ => 10000.0,
    };
    let layers = hf.int("num_hidden_layers", Bound::Layers)?;
    let mut c = GptConfig::llama(
        layers,
        hidden,
        heads,
        groups,
        hf.int("intermediate_size", Bound::Dim)?,
        hf.int("vocab_size", Bound::Vocab)?,
        hf.int("max_position_embeddings", Bound::Dim)?,
        10000.0,
    );
    c.rotary = rotary(&hf, default_theta)?;
    c.kv_channels = (head_dim != hidden / heads).then_some(head_dim);
    c.num_query_groups = Some(groups);
    let default_eps = if arch == "MixtralForCausalLM" {
        1e-5
    } else {
        1e-6
    };
    c.layernorm_epsilon = hf.positive("rms_norm_eps", default_eps)? as f32;
    c.untie_embeddings_and_output_weights = !hf.flag("tie_word_embeddings")?;
    c.add_qkv_bias = arch == "Qwen2ForCausalLM";
    c.qk_layernorm = matches!(arch, "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM");
    c.moe = moe_from_hf(&hf, arch, layers)?;
    (c.window_size, c.window_layers) = window_from_hf(&hf, arch, layers)?;
    c.attention_dropout = hf.fraction("attention_dropout", 0.0)? as f32;
    c.init_method_std = hf.non_negative("initializer_range", 0.02)? as f32;
    hf_config::check_model(&c)?;
    Ok(c)
}

/// The sliding window of a `config.json`: `sliding_window` W (the last W positions: each query
/// and the W − 1 keys before it), in every layer (Mistral, Mixtral) or, for Qwen with
/// `use_sliding_window`, in the layers `layer_types` marks `sliding_attention` (older files:
/// the layers from `max_window_layers` on).
fn window_from_hf(
    hf: &HfConfig,
    arch: &str,
    layers: usize,
) -> Result<(Option<usize>, Option<Vec<bool>>)> {
    let qwen = arch.starts_with("Qwen");
    let types: Option<Vec<bool>> = match hf.get("layer_types") {
        Value::Array(types) if types.len() != layers => bail!(
            "config.json: `layer_types` lists {} layers, `num_hidden_layers` is {layers}",
            types.len()
        ),
        Value::Array(types) => Some(
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => bail!(
                        "config.json: `layer_types` has {t} layers; megatron-rs builds \
                         full_attention and sliding_attention"
                    ),
                })
                .collect::<Result<_>>()?,
        ),
        Value::Null => None,
        other => bail!("config.json: `layer_types` is {other}, not a list"),
    };
    let on = !qwen || hf.flag("use_sliding_window")?;
    let size = match (hf.get("sliding_window"), on) {
        (Value::Null, _) | (_, false) => None,
        (w, true) => match w.as_u64() {
            Some(w) if w >= 1 => Some(hf_config::whole(&json!(w), "`sliding_window`", Bound::Dim)?),
            _ => bail!("config.json: `sliding_window` {w} is not a window of at least 1 position"),
        },
    };
    let Some(size) = size else {
        if !qwen && types.as_ref().is_some_and(|t| t.iter().any(|&w| w)) {
            bail!(
                "config.json: `layer_types` has sliding_attention layers but no `sliding_window`"
            );
        }
        return Ok((None, None));
    };
    if arch == "Qwen3MoeForCausalLM" {
        bail!("config.json: `sliding_window` with Qwen3-MoE is not supported");
    }
    let pattern = match (qwen, types) {
        (_, Some(types)) => types,
        (true, None) => {
            let first = hf
                .opt_int("max_window_layers", Bound::LayerIndex)?
                .unwrap_or(0);
            (0..layers).map(|i| i >= first).collect()
        }
        (false, None) => vec![true; layers],
    };
    if !pattern.iter().any(|&w| w) {
        return Ok((None, None));
    }
    let layers = (!pattern.iter().all(|&w| w)).then_some(pattern);
    Ok((Some(size - 1), layers))
}

/// The mixture of experts of a Mixtral or Qwen3-MoE `config.json` (`None` for the dense
/// architectures): every layer's MLP routed over `num_local_experts` (Qwen3-MoE's older files:
/// `num_experts`) SwiGLU experts, top `num_experts_per_tok`, dropless, with
/// `router_aux_loss_coef` as the aux loss's coefficient; Qwen3-MoE's dense layers are those in
/// `mlp_only_layers` and those `decoder_sparse_step` skips.
fn moe_from_hf(hf: &HfConfig, arch: &str, layers: usize) -> Result<Option<MoeConfig>> {
    if !matches!(arch, "MixtralForCausalLM" | "Qwen3MoeForCausalLM") {
        return Ok(None);
    }
    let experts = hf.int_of(&["num_local_experts", "num_experts"], Bound::Experts)?;
    let topk = hf.int("num_experts_per_tok", Bound::Experts)?;
    if topk > experts {
        bail!(
            "config.json: `num_experts_per_tok` {topk} is more than the {experts} experts \
             (`num_local_experts`)"
        );
    }
    if let Some(jitter) = hf.opt_float("router_jitter_noise")?
        && jitter != 0.0
    {
        bail!(
            "config.json: `router_jitter_noise` {jitter} (noise on the router's input) is not supported"
        );
    }
    match hf.get("shared_expert_intermediate_size") {
        Value::Null => {}
        v if v.as_u64() == Some(0) => {}
        _ => bail!(
            "config.json: `shared_expert_intermediate_size` (Qwen2-MoE's gated shared expert) is not supported"
        ),
    }
    let qwen = arch == "Qwen3MoeForCausalLM";
    let ffn = if qwen {
        hf.int("moe_intermediate_size", Bound::Dim)?
    } else {
        hf.int("intermediate_size", Bound::Dim)?
    };
    // Qwen3-MoE renormalises the top-k probabilities only with `norm_topk_prob`; Mixtral always.
    let pre_softmax = qwen && !hf.flag("norm_topk_prob")?;
    let step = hf
        .opt_int("decoder_sparse_step", Bound::Layers)?
        .unwrap_or(1);
    let dense: Vec<usize> = match hf.get("mlp_only_layers") {
        Value::Array(list) => list
            .iter()
            .map(|v| hf_config::whole(v, "an entry of `mlp_only_layers`", Bound::LayerIndex))
            .collect::<Result<_>>()?,
        Value::Null => Vec::new(),
        other => bail!("config.json: `mlp_only_layers` is {other}, not a list"),
    };
    let pattern: Vec<bool> = (0..layers)
        .map(|i| !qwen || (!dense.contains(&i) && (i + 1) % step == 0))
        .collect();
    let layer_freq = if pattern.iter().all(|&m| m) {
        MoeLayerFreq::Every(1)
    } else {
        MoeLayerFreq::Pattern(pattern.iter().map(|&m| u8::from(m)).collect())
    };
    let router = RouterConfig {
        pre_softmax,
        aux_loss_coeff: hf.non_negative("router_aux_loss_coef", 0.0)? as f32,
        ..RouterConfig::new(experts, topk)
    };
    Ok(Some(MoeConfig {
        router,
        ffn_hidden_size: ffn,
        layer_freq,
        shared_expert_ffn: None,
        dispatcher: Default::default(),
    }))
}

/// The `config.json` of a Llama-family config as Hugging Face architecture `arch`, with the
/// tokenizer's end-of-text id as `bos_token_id` and `eos_token_id` when known. RoPE settings in
/// the older form every transformers version reads (`rope_theta`, `rope_scaling`).
pub fn config_to_hf(c: &GptConfig, arch: &str, eod: Option<u32>) -> Value {
    let model_type = match arch {
        "Qwen3ForCausalLM" => "qwen3",
        "Qwen2ForCausalLM" => "qwen2",
        "MixtralForCausalLM" => "mixtral",
        "Qwen3MoeForCausalLM" => "qwen3_moe",
        "MistralForCausalLM" => "mistral",
        _ => "llama",
    };
    let mut v = json!({
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups(),
        "head_dim": c.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": float(c.layernorm_epsilon),
        "rope_theta": float(c.rotary.base),
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "attention_bias": false,
        "attention_dropout": float(c.attention_dropout),
        "initializer_range": float(c.init_method_std),
        "bos_token_id": eod,
        "eos_token_id": eod,
    });
    if c.rotary.percent != 1.0 {
        v["partial_rotary_factor"] = float(c.rotary.percent);
    }
    if let Some(s) = &c.rotary.scaling {
        v["rope_scaling"] = json!({
            "rope_type": "llama3",
            "factor": float(s.factor),
            "low_freq_factor": float(s.low_freq_factor),
            "high_freq_factor": float(s.high_freq_factor),
            "original_max_position_embeddings": s.original_max_position_embeddings,
        });
    }
    if model_type != "llama" {
        v["use_sliding_window"] = json!(c.window_size.is_some());
        v["sliding_window"] = json!(c.window_size.map(|w| w + 1));
    }
    if let (Some(_), true) = (c.window_size, model_type.starts_with("qwen")) {
        let types: Vec<&str> = (0..c.num_layers)
            .map(|l| match c.window_of(l) {
                Some(_) => "sliding_attention",
                None => "full_attention",
            })
            .collect();
        // Older transformers read the first windowed layer instead, when the windowed layers
        // are the last ones.
        let first = types.iter().position(|&t| t == "sliding_attention");
        if let Some(first) = first
            && types[first..].iter().all(|&t| t == "sliding_attention")
        {
            v["max_window_layers"] = json!(first);
        }
        v["layer_types"] = json!(types);
    }
    if let Some(moe) = &c.moe {
        v["num_local_experts"] = json!(moe.router.num_experts);
        v["num_experts"] = json!(moe.router.num_experts);
        v["num_experts_per_tok"] = json!(moe.router.topk);
        v["router_aux_loss_coef"] = float(moe.router.aux_loss_coeff);
        if model_type == "mixtral" {
            v["intermediate_size"] = json!(moe.ffn_hidden_size);
        } else {
            v["moe_intermediate_size"] = json!(moe.ffn_hidden_size);
            v["norm_topk_prob"] = json!(!moe.router.pre_softmax);
            v["decoder_sparse_step"] = json!(1);
            let dense: Vec<usize> = c
                .moe_layers()
                .unwrap_or_default()
                .iter()
                .enumerate()
                .filter(|(_, m)| !**m)
                .map(|(i, _)| i)
                .collect();
            v["mlp_only_layers"] = json!(dense);
        }
    }
    v
}

/// The fused QKV laid out per query group from separate q, k, v (weights or biases): each
/// group's queries, then its key and its value.
pub(crate) fn fuse_qkv<'a>(
    q: TensorRef<'a>,
    k: TensorRef<'a>,
    v: TensorRef<'a>,
    groups: usize,
    d: usize,
) -> Vec<Slice<'a>> {
    let per_group = q.shape()[0] / d / groups;
    (0..groups)
        .flat_map(|g| {
            [
                q.rows(g * per_group * d..(g + 1) * per_group * d),
                k.rows(g * d..(g + 1) * d),
                v.rows(g * d..(g + 1) * d),
            ]
        })
        .collect()
}

/// The rows of q, k or v (`part` 0, 1, 2) in a QKV fused per query group (the inverse of
/// [`fuse_qkv`]): each group's queries, key or value.
pub(crate) fn qkv_rows(part: usize, heads: usize, groups: usize, d: usize) -> Vec<Range<usize>> {
    let per_group = heads / groups;
    (0..groups)
        .map(|g| {
            let base = g * (per_group + 2) * d;
            match part {
                0 => base..base + per_group * d,
                1 => base + per_group * d..base + (per_group + 1) * d,
                _ => base + (per_group + 1) * d..base + (per_group + 2) * d,
            }
        })
        .collect()
}

/// Converts a Hugging Face Llama-family directory into a megatron-rs checkpoint (iteration 0,
/// no optimizer state) in the new or empty save directory `out`, tensor by tensor in their own
/// dtype, with the directory's `tokenizer.json` and the files an export writes back.
pub fn import(hf_dir: &Path, out: &Path) -> Result<Converted> {
    refuse_existing(out)?;
    let config = super::read_hf_config(hf_dir)?;
    let c = config_from_hf(&config)?;
    let hf = HfWeights::open(hf_dir, |name| {
        (!name.ends_with("rotary_emb.inv_freq")).then(|| name.to_string())
    })?;
    let take = |name: &str, shape: &[usize]| hf.take(name, shape);
    let (h, f, v) = (c.hidden_size, c.ffn_hidden_size, c.vocab_size);
    let (heads, groups, d) = (c.num_attention_heads, c.query_groups(), c.head_dim());
    let arch = HfConfig::new(&config)?.architecture()?;
    let moe_layers = c.moe_layers()?;
    let embed = take("model.embed_tokens.weight", &[v, h])?;
    let mut model = vec![OutTensor::copy("wte.weight", embed)];
    let qkv_rows = (heads + 2 * groups) * d;
    for (i, &routed) in moe_layers.iter().enumerate() {
        let hf_name = |s: &str| format!("model.layers.{i}.{s}");
        let ours = |s: &str| format!("blocks.{i}.{s}");
        model.push(OutTensor::copy(
            ours("ln1.weight"),
            take(&hf_name("input_layernorm.weight"), &[h])?,
        ));
        model.push(OutTensor::copy(
            ours("ln2.weight"),
            take(&hf_name("post_attention_layernorm.weight"), &[h])?,
        ));
        let q = take(&hf_name("self_attn.q_proj.weight"), &[heads * d, h])?;
        let k = take(&hf_name("self_attn.k_proj.weight"), &[groups * d, h])?;
        let vv = take(&hf_name("self_attn.v_proj.weight"), &[groups * d, h])?;
        model.push(OutTensor::concat(
            ours("attn.qkv.weight"),
            vec![qkv_rows, h],
            fuse_qkv(q, k, vv, groups, d),
        ));
        if c.add_qkv_bias {
            let q = take(&hf_name("self_attn.q_proj.bias"), &[heads * d])?;
            let k = take(&hf_name("self_attn.k_proj.bias"), &[groups * d])?;
            let vv = take(&hf_name("self_attn.v_proj.bias"), &[groups * d])?;
            model.push(OutTensor::concat(
                ours("attn.qkv.bias"),
                vec![qkv_rows],
                fuse_qkv(q, k, vv, groups, d),
            ));
        }
        if c.qk_layernorm {
            model.push(OutTensor::copy(
                ours("attn.qk_norm.q_norm.weight"),
                take(&hf_name("self_attn.q_norm.weight"), &[d])?,
            ));
            model.push(OutTensor::copy(
                ours("attn.qk_norm.k_norm.weight"),
                take(&hf_name("self_attn.k_norm.weight"), &[d])?,
            ));
        }
        model.push(OutTensor::copy(
            ours("attn.proj.weight"),
            take(&hf_name("self_attn.o_proj.weight"), &[h, heads * d])?,
        ));
        if let (Some(moe), true) = (&c.moe, routed) {
            let (e, f) = (moe.router.num_experts, moe.ffn_hidden_size);
            let names = expert_names(arch);
            let expert = |pattern: &str, x: usize| hf_name(&pattern.replace("{e}", &x.to_string()));
            model.push(OutTensor::copy(
                ours("mlp.experts.router.weight"),
                take(&hf_name(names.router), &[e, h])?,
            ));
            let (mut fc1, mut fc2) = (Vec::with_capacity(2 * e), Vec::with_capacity(e));
            for x in 0..e {
                fc1.push(take(&expert(names.gate, x), &[f, h])?.all());
                fc1.push(take(&expert(names.up, x), &[f, h])?.all());
                fc2.push(take(&expert(names.down, x), &[h, f])?.all());
            }
            model.push(OutTensor::concat(
                ours("mlp.experts.fc1.weight"),
                vec![e, 2 * f, h],
                fc1,
            ));
            model.push(OutTensor::concat(
                ours("mlp.experts.fc2.weight"),
                vec![e, h, f],
                fc2,
            ));
            continue;
        }
        let gate = take(&hf_name("mlp.gate_proj.weight"), &[f, h])?;
        let up = take(&hf_name("mlp.up_proj.weight"), &[f, h])?;
        model.push(OutTensor::concat(
            ours("mlp.fc1.weight"),
            vec![2 * f, h],
            vec![gate.all(), up.all()],
        ));
        model.push(OutTensor::copy(
            ours("mlp.fc2.weight"),
            take(&hf_name("mlp.down_proj.weight"), &[h, f])?,
        ));
    }
    model.extend(final_norm_and_head(&hf, &c, &embed, hf_dir)?);
    hf.refuse_untaken()?;
    super::save_imported(hf_dir, out, &c, &model, arch)
}

/// The final norm and, untied, the output layer of a decoder whose Hugging Face names are
/// Llama's (`model.norm`, `lm_head`); a tied model's `lm_head.weight`, when stored, must be
/// the embedding `embed`.
pub(crate) fn final_norm_and_head<'a>(
    hf: &'a HfWeights,
    c: &GptConfig,
    embed: &TensorRef<'a>,
    hf_dir: &Path,
) -> Result<Vec<OutTensor<'a>>> {
    let (v, h) = (c.vocab_size, c.hidden_size);
    let mut out = vec![OutTensor::copy(
        "ln_f.weight",
        hf.take("model.norm.weight", &[h])?,
    )];
    match (
        c.untie_embeddings_and_output_weights,
        hf.get("lm_head.weight"),
    ) {
        (true, Some(_)) => out.push(OutTensor::copy(
            "wte.output_weight",
            hf.take("lm_head.weight", &[v, h])?,
        )),
        (true, None) => bail!(
            "{}: no tensor `lm_head.weight` (the config does not tie it to the embedding)",
            hf_dir.display()
        ),
        (false, Some(head)) if !head.same_values(embed)? => bail!(
            "{}: `lm_head.weight` differs from the embedding, but the config ties them",
            hf_dir.display()
        ),
        (false, Some(_)) => {
            hf.take("lm_head.weight", &[v, h])?;
        }
        (false, None) => {}
    }
    Ok(out)
}

/// Writes the checkpoint `ckpt` of a Llama-family model as a Hugging Face directory `hf_dir`
/// (new or empty), tensor by tensor: the weights sharded as transformers shards them in the
/// dtype `options` asks (else the imported model's), the `config.json` the import carried where
/// the model is still the one it describes (else the matching architecture's), and the
/// tokenizer and generation files the checkpoint carries.
pub fn export(ckpt: &Path, hf_dir: &Path, options: &ExportOptions) -> Result<Converted> {
    refuse_existing(hf_dir)?;
    let loaded = checkpoint::open(ckpt)?;
    let c: GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    let family = super::architecture::llama_family(&c).map_err(|lacks| {
        anyhow::anyhow!(
            "{}: the model is not one of Hugging Face's Llama family (Llama, Mistral, Qwen2, \
             Qwen3, Mixtral, Qwen3-MoE), which cannot hold: {}",
            loaded.dir().display(),
            lacks.join("; ")
        )
    })?;
    let tokenizer = super::checkpoint_tokenizer(ckpt, loaded.dir())?;
    let eod = super::eod_id(tokenizer.as_ref(), c.vocab_size);
    let carried = hf_files::carried_in(ckpt)?;
    let original = hf_files::carried_config(&carried)?;
    let before = original.as_ref().and_then(|o| {
        let arch = HfConfig::new(o).ok()?.architecture().ok()?;
        Some((arch, config_to_hf(&config_from_hf(o).ok()?, arch, eod)))
    });
    // The imported architecture while the model is still the one it was (Mistral without a
    // window stays Mistral), else the family member that holds it.
    let arch = match &before {
        Some((arch, old)) if config_to_hf(&c, arch, eod) == *old => *arch,
        _ => family,
    };
    super::check_merge_lora(
        &c,
        options.merge_lora,
        loaded.dir(),
        ", or `--to peft DIR` writes them as PEFT's adapter for the base",
    )?;
    let tensors = super::CheckpointTensors::open(&loaded)?;
    let get = |name: &str| tensors.get(name);
    let lora = c.lora.as_ref();
    let merged = |hf: String, i: usize, layer: &str, ranges: Vec<Range<usize>>| {
        let w = get(&format!("blocks.{i}.{layer}.weight"))?;
        let adapter = super::peft::merge_source(&tensors, lora, &format!("blocks.{i}."), layer);
        Ok::<_, anyhow::Error>(super::peft::merged_rows(hf, w, adapter, ranges))
    };
    let moe_layers = c.moe_layers()?;
    let (h, heads, groups, d, f) = (
        c.hidden_size,
        c.num_attention_heads,
        c.query_groups(),
        c.head_dim(),
        c.ffn_hidden_size,
    );
    let mut hf = vec![OutTensor::copy(
        "model.embed_tokens.weight",
        get("wte.weight")?,
    )];
    for (i, &routed) in moe_layers.iter().enumerate() {
        let ours = |s: &str| format!("blocks.{i}.{s}");
        let hf_name = |s: &str| format!("model.layers.{i}.{s}");
        // transformers' order: each projection's weight, then its bias.
        let bias = match c.add_qkv_bias {
            true => Some(get(&ours("attn.qkv.bias"))?),
            false => None,
        };
        let rows = [heads * d, groups * d, groups * d];
        for (part, proj) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
            let ranges = qkv_rows(part, heads, groups, d);
            let weight = hf_name(&format!("self_attn.{proj}.weight"));
            hf.push(merged(weight, i, "attn.qkv", ranges.clone())?);
            if let Some(bias) = bias {
                hf.push(OutTensor::concat(
                    hf_name(&format!("self_attn.{proj}.bias")),
                    vec![rows[part]],
                    ranges.into_iter().map(|r| bias.rows(r)).collect(),
                ));
            }
        }
        hf.push(merged(
            hf_name("self_attn.o_proj.weight"),
            i,
            "attn.proj",
            std::iter::once(0..h).collect(),
        )?);
        if c.qk_layernorm {
            hf.push(OutTensor::copy(
                hf_name("self_attn.q_norm.weight"),
                get(&ours("attn.qk_norm.q_norm.weight"))?,
            ));
            hf.push(OutTensor::copy(
                hf_name("self_attn.k_norm.weight"),
                get(&ours("attn.qk_norm.k_norm.weight"))?,
            ));
        }
        if let (Some(moe), true) = (&c.moe, routed) {
            let names = expert_names(arch);
            let expert = |pattern: &str, x: usize| hf_name(&pattern.replace("{e}", &x.to_string()));
            hf.push(OutTensor::copy(
                hf_name(names.router),
                get(&ours("mlp.experts.router.weight"))?,
            ));
            // Each expert's rows of fc1 (gate, then up) and of fc2, with its adapter merged in.
            let ef = moe.ffn_hidden_size;
            for x in 0..moe.router.num_experts {
                let at = x * 2 * ef;
                hf.push(merged(
                    expert(names.gate, x),
                    i,
                    "mlp.experts.fc1",
                    std::iter::once(at..at + ef).collect(),
                )?);
                hf.push(merged(
                    expert(names.up, x),
                    i,
                    "mlp.experts.fc1",
                    std::iter::once(at + ef..at + 2 * ef).collect(),
                )?);
                hf.push(merged(
                    expert(names.down, x),
                    i,
                    "mlp.experts.fc2",
                    std::iter::once(x * h..(x + 1) * h).collect(),
                )?);
            }
        } else {
            hf.push(merged(
                hf_name("mlp.gate_proj.weight"),
                i,
                "mlp.fc1",
                std::iter::once(0..f).collect(),
            )?);
            hf.push(merged(
                hf_name("mlp.up_proj.weight"),
                i,
                "mlp.fc1",
                std::iter::once(f..2 * f).collect(),
            )?);
            hf.push(merged(
                hf_name("mlp.down_proj.weight"),
                i,
                "mlp.fc2",
                std::iter::once(0..h).collect(),
            )?);
        }
        hf.push(OutTensor::copy(
            hf_name("input_layernorm.weight"),
            get(&ours("ln1.weight"))?,
        ));
        hf.push(OutTensor::copy(
            hf_name("post_attention_layernorm.weight"),
            get(&ours("ln2.weight"))?,
        ));
    }
    hf.push(OutTensor::copy("model.norm.weight", get("ln_f.weight")?));
    if c.untie_embeddings_and_output_weights {
        hf.push(OutTensor::copy("lm_head.weight", get("wte.output_weight")?));
    }
    let dtype = super::export_dtype(options, original.as_ref(), &hf);
    let config = super::export_config(
        original.as_ref(),
        config_to_hf(&c, arch, eod),
        before.map(|(_, old)| old),
        dtype,
    );
    let (bytes, weight_files, carried) =
        super::write_export(hf_dir, &loaded, hf, &config, dtype, options, &carried)?;
    Ok(Converted {
        arch,
        config: c,
        dtype,
        bytes,
        weight_files,
        carried,
        skipped: Vec::new(),
    })
}
