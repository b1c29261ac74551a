//! Hugging Face's `DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi K2, Moonlight) to and from
//! megatron-rs checkpoints.
//!
//! The names follow transformers' modeling and Megatron-Bridge's DeepSeek mapping: the query
//! latent (`q_a_proj`, `q_a_layernorm`, `q_b_proj`, or `q_proj` without one) is `attn.q_down`,
//! `attn.q_norm`, `attn.q_up` (`attn.q`); `kv_a_proj_with_mqa` (the latent and the rotary key)
//! is `attn.kv_down`, `kv_a_layernorm` `attn.kv_norm`, `kv_b_proj` `attn.kv_up`; the router's
//! `gate.weight` and `gate.e_score_correction_bias` are `mlp.experts.router.weight` and
//! `.expert_bias`; the dense layers' and the shared experts' gate and up projections join into
//! one `fc1` (gate rows, then up); the routed experts' are stacked `[experts, ..]`. transformers
//! turns the rotary part in interleaved pairs (`rope_interleave`), which is
//! `--rotary-interleaved`: no weight is permuted.
//!
//! Routing: transformers ranks each group by the sum of its best 2 scores, Megatron-LM by its
//! best `topk / topk_group`: a grouped config where those differ is refused. DeepSeek-V3's
//! multi-token prediction layers (`model.layers.{num_hidden_layers + k}.*`, which transformers
//! does not load) are the model's depths of multi-token prediction (`mtp.{k}.*`: `enorm`,
//! `hnorm`, `eh_proj`, the layer as `block`, `shared_head.norm` as `final_norm`); their copies of
//! the embedding and the output layer must be the model's, and are written back as copies. Its
//! FP8 release (`quantization_config`, block scales in `weight_scale_inv`) is refused by name.

use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint;
use megatron_core::moe::ScoreFunction;
use megatron_core::tensor_parallel::{Normalization, Yarn};
use megatron_models::{DeepSeekMoe, GptConfig, MlaConfig, MtpConfig, PositionEmbeddingType};
use safetensors::Dtype;
use serde_json::{Value, json};

use super::hf_config::{self, Bound, HfConfig};
use super::hf_files::{self, HfWeights};
use super::hf_gpt2::refuse_existing;
use super::stream::OutTensor;
use super::{Converted, ExportOptions, float};

/// The architecture read and written here.
pub const ARCHITECTURE: &str = "DeepseekV3ForCausalLM";

/// The model a `DeepseekV3ForCausalLM` `config.json` describes, every field within the command
/// line's bounds and named when refused.
pub fn config_from_hf(config: &Value) -> Result<GptConfig> {
    let hf = HfConfig::new(config)?;
    let arch = hf.architecture()?;
    if arch != ARCHITECTURE {
        bail!("config.json: architecture {arch} is not {ARCHITECTURE}");
    }
    if !hf.absent("quantization_config") {
        bail!(
            "config.json: `quantization_config` (DeepSeek's FP8 release: e4m3 weights with \
             block scales in `weight_scale_inv`) is not read; dequantise the weights to bf16 \
             first (DeepSeek-V3's inference/fp8_cast_bf16.py), then import"
        );
    }
    if let Some(act) = hf.opt_str("hidden_act")?
        && act != "silu"
    {
        bail!("config.json: `hidden_act` {act} is not SwiGLU's silu");
    }
    if hf.flag("attention_bias")? {
        bail!("config.json: `attention_bias` = true (biases in attention) is not supported");
    }
    if let Some(tp) = hf.opt_int("pretraining_tp", Bound::Dim)?
        && tp != 1
    {
        bail!("config.json: `pretraining_tp` {tp} (sliced linear layers) is not supported");
    }
    let hidden = hf.int("hidden_size", Bound::Dim)?;
    let heads = hf.int("num_attention_heads", Bound::Dim)?;
    if let Some(kv) = hf.opt_int("num_key_value_heads", Bound::Dim)?
        && kv != heads
    {
        bail!(
            "config.json: `num_key_value_heads` {kv} is not `num_attention_heads` {heads}: \
             multi-latent attention has a key and a value per head"
        );
    }
    let q_lora_rank = match hf.get("q_lora_rank") {
        Value::Null => None,
        v => Some(hf_config::whole(v, "`q_lora_rank`", Bound::Dim)?),
    };
    let rope_dim = hf.int("qk_rope_head_dim", Bound::Dim)?;
    if rope_dim < 2 || !rope_dim.is_multiple_of(2) {
        bail!(
            "config.json: `qk_rope_head_dim` {rope_dim}: rotary embeddings turn pairs of \
             channels, an even number of at least 2"
        );
    }
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: hf.int("kv_lora_rank", Bound::Dim)?,
        qk_head_dim: hf.int("qk_nope_head_dim", Bound::Dim)?,
        qk_pos_emb_head_dim: rope_dim,
        v_head_dim: hf.int("v_head_dim", Bound::Dim)?,
        latent_norm_epsilon: None,
    };
    let layers = hf.int("num_hidden_layers", Bound::Layers)?;
    let moe = moe_from_hf(&hf, layers)?;
    let (theta, yarn) = rope_from_hf(&hf)?;
    let dropout = hf.fraction("attention_dropout", 0.0)?;
    if dropout != 0.0 {
        bail!(
            "config.json: `attention_dropout` {dropout}: the general attention multi-latent \
             attention runs has no dropout on its weights yet"
        );
    }
    let mut c = GptConfig::deepseek_v3(
        (
            layers,
            hidden,
            heads,
            hf.int("intermediate_size", Bound::Dim)?,
        ),
        (
            hf.int("vocab_size", Bound::Vocab)?,
            hf.int("max_position_embeddings", Bound::Dim)?,
        ),
        mla,
        moe,
        (theta, yarn),
        hf.positive("rms_norm_eps", 1e-6)? as f32,
    );
    // transformers' default: the rotary part laid out in interleaved pairs.
    c.rotary.interleaved = hf.opt_bool("rope_interleave")?.unwrap_or(true);
    c.untie_embeddings_and_output_weights = !hf.flag("tie_word_embeddings")?;
    c.init_method_std = hf.non_negative("initializer_range", 0.02)? as f32;
    let depths = hf
        .opt_int("num_nextn_predict_layers", Bound::LayerIndex)?
        .unwrap_or(0);
    c.mtp = (depths > 0).then(|| MtpConfig::new(depths));
    hf_config::check_model(&c)?;
    Ok(c)
}

/// DeepSeek-V3's experts: sigmoid scores with the correction bias, group-limited, normalised
/// over the top-k and scaled, beside shared experts, after the dense first layers.
fn moe_from_hf(hf: &HfConfig, layers: usize) -> Result<DeepSeekMoe> {
    let experts = hf.int("n_routed_experts", Bound::Experts)?;
    let topk = hf.int("num_experts_per_tok", Bound::Experts)?;
    if topk > experts {
        bail!(
            "config.json: `num_experts_per_tok` {topk} is more than the {experts} experts \
             (`n_routed_experts`)"
        );
    }
    for (key, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
        if let Some(v) = hf.opt_str(key)?
            && v != want
        {
            bail!(
                "config.json: `{key}` {v}: DeepSeek-V3's routing ({want}) is read, not \
                 DeepSeek-V2's"
            );
        }
    }
    if hf.opt_bool("norm_topk_prob")? == Some(false) {
        bail!(
            "config.json: `norm_topk_prob` = false: Megatron-LM's sigmoid routing normalises \
             the top-k scores, as DeepSeek-V3's does"
        );
    }
    if let Some(freq) = hf.opt_int("moe_layer_freq", Bound::Layers)?
        && freq != 1
    {
        bail!("config.json: `moe_layer_freq` {freq}: every layer after the dense ones is MoE");
    }
    let groups = hf.opt_int("n_group", Bound::Experts)?.unwrap_or(1);
    let group_topk = hf.opt_int("topk_group", Bound::Experts)?.unwrap_or(1);
    if groups > 1 {
        if !experts.is_multiple_of(groups) || group_topk > groups {
            bail!(
                "config.json: `n_group` {groups} and `topk_group` {group_topk} do not fit \
                 {experts} experts (`n_routed_experts`)"
            );
        }
        if topk != 2 * group_topk {
            bail!(
                "config.json: `n_group` {groups}, `topk_group` {group_topk}, \
                 `num_experts_per_tok` {topk}: transformers ranks each group by its best 2 \
                 scores, Megatron-LM's group-limited routing by its best num_experts_per_tok / \
                 topk_group; they agree only when that is 2"
            );
        }
    }
    let shared = match hf.get("n_shared_experts") {
        Value::Null => 0,
        v => hf_config::whole(v, "`n_shared_experts`", Bound::LayerIndex)?,
    };
    if shared == 0 {
        bail!("config.json: `n_shared_experts` 0: DeepseekV3's MoE layers have shared experts");
    }
    let dense = hf
        .opt_int("first_k_dense_replace", Bound::LayerIndex)?
        .unwrap_or(0);
    if dense > layers {
        bail!(
            "config.json: `first_k_dense_replace` {dense} is more than the {layers} layers \
             (`num_hidden_layers`)"
        );
    }
    Ok(DeepSeekMoe {
        experts,
        topk,
        ffn: hf.int("moe_intermediate_size", Bound::Dim)?,
        shared,
        groups,
        group_topk,
        scaling: hf.positive("routed_scaling_factor", 1.0)? as f32,
        dense,
    })
}

/// The rotary base and YaRN, if the config has it, as transformers computes them: the pairs'
/// factor `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set, else
/// `mscale(factor, 1)`; the scores' `mscale(factor, mscale_all_dim)²` when that is set.
fn rope_from_hf(hf: &HfConfig) -> Result<(f32, Option<Yarn>)> {
    let params = super::hf_llama::rope_parameters(hf)?;
    let params = HfConfig::new(&params)?;
    let theta = hf_config::positive(
        params.opt_float("rope_theta")?.unwrap_or(10000.0),
        "`rope_theta`",
    )? as f32;
    if theta <= 1.0 {
        bail!("config.json: `rope_theta` {theta} must be above 1");
    }
    if let Some(f) = params.opt_float("partial_rotary_factor")?
        && f != 1.0
    {
        bail!("config.json: `partial_rotary_factor` {f}: the rotary part is turned whole");
    }
    let kind = params
        .opt_str("rope_type")?
        .or(params.opt_str("type")?)
        .unwrap_or("default");
    match kind {
        "default" => return Ok((theta, None)),
        "yarn" => {}
        other => bail!("config.json: rope type `{other}` is not supported (default and yarn are)"),
    }
    for key in ["attention_factor"] {
        if !params.absent(key) {
            bail!("config.json: rope `{key}` (an explicit YaRN factor) is not supported");
        }
    }
    if params.opt_bool("truncate")? == Some(false) {
        bail!("config.json: rope `truncate` = false (an unrounded YaRN band) is not supported");
    }
    let factor = match params.opt_float("factor")? {
        Some(f) => hf_config::positive(f, "rope `factor`")? as f32,
        None => bail!("config.json: rope type yarn needs `factor`"),
    };
    let original = match params.opt_int("original_max_position_embeddings", Bound::Dim)? {
        Some(n) => n,
        None => hf.int("max_position_embeddings", Bound::Dim)?,
    };
    let (mscale, all_dim) = (
        params.opt_float("mscale")?.unwrap_or(0.0) as f32,
        params.opt_float("mscale_all_dim")?.unwrap_or(0.0) as f32,
    );
    let (mscale, mscale_all_dim) = match (mscale != 0.0, all_dim != 0.0) {
        (true, true) => (mscale, all_dim),
        (_, false) => (1.0, 0.0),
        (false, true) => bail!(
            "config.json: rope `mscale_all_dim` {all_dim} without `mscale`: transformers then \
             scales the pairs by mscale(factor, 1) and the scores by mscale_all_dim's, which \
             megatron-rs's YaRN does not express"
        ),
    };
    let beta = |key: &str, default: f64| -> Result<f32> {
        Ok(hf_config::positive(
            params.opt_float(key)?.unwrap_or(default),
            &format!("rope `{key}`"),
        )? as f32)
    };
    Ok((
        theta,
        Some(Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: beta("beta_fast", 32.0)?,
            beta_slow: beta("beta_slow", 1.0)?,
            mscale,
            mscale_all_dim,
        }),
    ))
}

/// What `DeepseekV3ForCausalLM` cannot hold of `c`, each feature with the flag that sets it;
/// empty for a model it holds exactly.
pub fn lacks(c: &GptConfig) -> Vec<String> {
    let mut lacks: Vec<String> = Vec::new();
    let mut lack = |s: &str| lacks.push(s.to_string());
    let Some(mla) = &c.mla else {
        lack("attention on a fused projection (DeepSeek-V3's is --multi-latent-attention)");
        return lacks;
    };
    if c.normalization != Normalization::RmsNorm {
        lack("LayerNorm (DeepSeek-V3's norms are RMSNorm: --normalization RMSNorm)");
    }
    if !c.swiglu {
        lack("a GeLU MLP (DeepSeek-V3's is SwiGLU: --swiglu)");
    }
    if c.add_bias_linear {
        lack("biases in the linear layers (--disable-bias-linear)");
    }
    if c.position_embedding_type != PositionEmbeddingType::Rope {
        lack("positions other than rotary (--position-embedding-type rope)");
    }
    if c.rotary.percent != 1.0 {
        lack("rotary embeddings on part of the rotary features (--rotary-percent)");
    }
    if c.rotary.scaling.is_some() {
        lack("Llama 3.1's frequency scaling (--use-rope-scaling; DeepSeek-V3's is YaRN)");
    }
    if c.window_size.is_some() {
        lack("a sliding window (--window-size)");
    }
    let latent = mla.latent_norm_epsilon.unwrap_or(c.layernorm_epsilon);
    if latent != 1e-6 {
        lack(&format!(
            "latent norms of ε {latent} (transformers' DeepSeek-V3 norms its latents with 1e-6)"
        ));
    }
    let Some(moe) = &c.moe else {
        lack("a model without experts (DeepSeek-V3's layers after the dense ones are MoE)");
        return lacks;
    };
    let r = &moe.router;
    if r.score_function != ScoreFunction::Sigmoid {
        lack(
            "softmax router scores (DeepSeek-V3's are sigmoid: --moe-router-score-function sigmoid)",
        );
    }
    if let Some(g) = r.group_limited
        && r.topk != 2 * g.topk
    {
        lack(
            "group-limited routing ranking groups by other than their best 2 scores \
             (--moe-router-topk ≠ 2 × --moe-router-group-topk; transformers sums the best 2)",
        );
    }
    if r.capacity_factor.is_some() {
        lack("an expert capacity (--moe-expert-capacity-factor: dropped tokens)");
    }
    match moe.shared_expert_ffn {
        Some(s) if s.is_multiple_of(moe.ffn_hidden_size) => {}
        Some(_) => lack(
            "shared experts not a whole number of experts (--moe-shared-expert-intermediate-size \
             must be a multiple of --moe-ffn-hidden-size)",
        ),
        None => lack("MoE layers without shared experts (--moe-shared-expert-intermediate-size)"),
    }
    let pattern = c.moe_layers().unwrap_or_default();
    if c.mtp.is_some() && pattern.last() == Some(&false) {
        lack(
            "multi-token prediction after a dense last layer (--mtp-num-layers: the depth's layer \
             is like the last, and DeepSeek-V3's depths are MoE layers)",
        );
    }
    let dense = pattern.iter().take_while(|m| !**m).count();
    if pattern[dense..].iter().any(|m| !*m) {
        lack(
            "dense layers after MoE ones (--moe-layer-freq: DeepSeek-V3's dense layers come first)",
        );
    }
    lacks
}

/// The `config.json` of `c` as `DeepseekV3ForCausalLM`, with the tokenizer's end-of-text id as
/// `bos_token_id` and `eos_token_id` when known; RoPE in the older form every transformers
/// version reads.
pub fn config_to_hf(c: &GptConfig, eod: Option<u32>) -> Value {
    let mla = c.mla.unwrap_or_default();
    let moe = c.moe.as_ref();
    let router = moe.map(|m| m.router);
    let groups = router.and_then(|r| r.group_limited);
    let dense = c
        .moe_layers()
        .unwrap_or_default()
        .iter()
        .take_while(|m| !**m)
        .count();
    let mut v = json!({
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "moe_intermediate_size": moe.map_or(0, |m| m.ffn_hidden_size),
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "n_shared_experts": moe.map_or(0, |m| m.shared_expert_ffn.unwrap_or(0) / m.ffn_hidden_size.max(1)),
        "n_routed_experts": router.map_or(0, |r| r.num_experts),
        "routed_scaling_factor": float(router.and_then(|r| r.topk_scaling_factor).unwrap_or(1.0)),
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "qk_nope_head_dim": mla.qk_head_dim,
        "n_group": groups.map_or(1, |g| g.groups),
        "topk_group": groups.map_or(1, |g| g.topk),
        "num_experts_per_tok": router.map_or(0, |r| r.topk),
        "first_k_dense_replace": dense,
        "norm_topk_prob": true,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": float(c.init_method_std),
        "rms_norm_eps": float(c.layernorm_epsilon),
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "rope_theta": float(c.rotary.base),
        "rope_interleave": c.rotary.interleaved,
        "attention_bias": false,
        "attention_dropout": float(c.attention_dropout),
        "num_nextn_predict_layers": c.mtp_depths(),
        "bos_token_id": eod,
        "eos_token_id": eod,
    });
    if let Some(y) = &c.rotary.yarn {
        v["rope_scaling"] = json!({
            "type": "yarn",
            "rope_type": "yarn",
            "factor": float(y.factor),
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": float(y.beta_fast),
            "beta_slow": float(y.beta_slow),
            "mscale": float(y.mscale),
            "mscale_all_dim": float(y.mscale_all_dim),
        });
    }
    v
}

/// Converts a Hugging Face `DeepseekV3ForCausalLM` directory into a megatron-rs checkpoint
/// (iteration 0, no optimizer state) in the new or empty directory `out`, tensor by tensor in
/// their own dtype, the multi-token prediction layers as the model's depths.
pub fn import(hf_dir: &Path, out: &Path) -> Result<Converted> {
    refuse_existing(out)?;
    let config = super::read_hf_config(hf_dir)?;
    let mut c = config_from_hf(&config)?;
    let weights = HfWeights::open(hf_dir, |name| {
        (!name.ends_with("rotary_emb.inv_freq")).then(|| name.to_string())
    })?;
    // transformers neither builds nor saves the depths: a model it wrote declares them
    // (`num_nextn_predict_layers`) without their weights, and is imported without them.
    let mut skipped = Vec::new();
    let first_depth = format!("model.layers.{}.enorm.weight", c.num_layers);
    if let Some(mtp) = c.mtp
        && weights.get(&first_depth).is_none()
    {
        skipped.push(format!(
            "multi-token prediction: config.json declares {} depth(s) \
             (`num_nextn_predict_layers`) but the weights hold none (no `{first_depth}`; \
             transformers does not save them): imported without",
            mtp.num_layers
        ));
        c.mtp = None;
    }
    let c = c;
    let take = |name: &str, shape: &[usize]| weights.take(name, shape);
    let (h, f, vocab) = (c.hidden_size, c.ffn_hidden_size, c.vocab_size);
    let heads = c.num_attention_heads;
    let mla = c
        .mla
        .context("an imported DeepSeek-V3 has multi-latent attention")?;
    let moe = c
        .moe
        .as_ref()
        .context("an imported DeepSeek-V3 has experts")?;
    let (e, ef) = (moe.router.num_experts, moe.ffn_hidden_size);
    let sf = moe.shared_expert_ffn.unwrap_or(0);
    let q_width = heads * mla.q_head_dim();
    let embed = take("model.embed_tokens.weight", &[vocab, h])?;
    let mut model = vec![OutTensor::copy("wte.weight", embed)];
    // Transformers' layer `hf` (`model.layers.{hf}.`) as ours under `at` (`blocks.{i}.`, or
    // `mtp.{k}.block.` for a depth of multi-token prediction).
    let layer = |hf: usize, at: &str, routed: bool| {
        let mut model = Vec::new();
        let hf_name = |s: &str| format!("model.layers.{hf}.{s}");
        let ours = |s: &str| format!("{at}{s}");
        let mut copy = |to: &str, from: &str, shape: &[usize]| -> Result<()> {
            model.push(OutTensor::copy(ours(to), take(&hf_name(from), shape)?));
            Ok(())
        };
        copy("ln1.weight", "input_layernorm.weight", &[h])?;
        copy("ln2.weight", "post_attention_layernorm.weight", &[h])?;
        match mla.q_lora_rank {
            Some(r) => {
                copy("attn.q_down.weight", "self_attn.q_a_proj.weight", &[r, h])?;
                copy("attn.q_norm.weight", "self_attn.q_a_layernorm.weight", &[r])?;
                copy(
                    "attn.q_up.weight",
                    "self_attn.q_b_proj.weight",
                    &[q_width, r],
                )?;
            }
            None => copy("attn.q.weight", "self_attn.q_proj.weight", &[q_width, h])?,
        }
        let kv = mla.kv_lora_rank;
        copy(
            "attn.kv_down.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            &[kv + mla.qk_pos_emb_head_dim, h],
        )?;
        copy(
            "attn.kv_norm.weight",
            "self_attn.kv_a_layernorm.weight",
            &[kv],
        )?;
        copy(
            "attn.kv_up.weight",
            "self_attn.kv_b_proj.weight",
            &[heads * (mla.qk_head_dim + mla.v_head_dim), kv],
        )?;
        copy(
            "attn.proj.weight",
            "self_attn.o_proj.weight",
            &[h, heads * mla.v_head_dim],
        )?;
        // Gate rows, then up rows: one fc1 of `2·rows`.
        let gated = |to: String, from: &str, rows: usize| -> Result<OutTensor<'_>> {
            let gate = take(&hf_name(&format!("{from}.gate_proj.weight")), &[rows, h])?;
            let up = take(&hf_name(&format!("{from}.up_proj.weight")), &[rows, h])?;
            Ok(OutTensor::concat(
                to,
                vec![2 * rows, h],
                vec![gate.all(), up.all()],
            ))
        };
        if !routed {
            model.push(gated(ours("mlp.fc1.weight"), "mlp", f)?);
            model.push(OutTensor::copy(
                ours("mlp.fc2.weight"),
                take(&hf_name("mlp.down_proj.weight"), &[h, f])?,
            ));
            return Ok::<_, anyhow::Error>(model);
        }
        model.push(OutTensor::copy(
            ours("mlp.experts.router.weight"),
            take(&hf_name("mlp.gate.weight"), &[e, h])?,
        ));
        model.push(OutTensor::copy(
            ours("mlp.experts.router.expert_bias"),
            take(&hf_name("mlp.gate.e_score_correction_bias"), &[e])?,
        ));
        let expert = |x: usize, s: &str| hf_name(&format!("mlp.experts.{x}.{s}.weight"));
        let (mut fc1, mut fc2) = (Vec::with_capacity(2 * e), Vec::with_capacity(e));
        for x in 0..e {
            fc1.push(take(&expert(x, "gate_proj"), &[ef, h])?.all());
            fc1.push(take(&expert(x, "up_proj"), &[ef, h])?.all());
            fc2.push(take(&expert(x, "down_proj"), &[h, ef])?.all());
        }
        model.push(OutTensor::concat(
            ours("mlp.experts.fc1.weight"),
            vec![e, 2 * ef, h],
            fc1,
        ));
        model.push(OutTensor::concat(
            ours("mlp.experts.fc2.weight"),
            vec![e, h, ef],
            fc2,
        ));
        model.push(gated(
            ours("mlp.shared.fc1.weight"),
            "mlp.shared_experts",
            sf,
        )?);
        model.push(OutTensor::copy(
            ours("mlp.shared.fc2.weight"),
            take(&hf_name("mlp.shared_experts.down_proj.weight"), &[h, sf])?,
        ));
        Ok(model)
    };
    let pattern = c.moe_layers()?;
    for (i, &routed) in pattern.iter().enumerate() {
        model.extend(layer(i, &format!("blocks.{i}."), routed)?);
    }
    model.extend(super::hf_llama::final_norm_and_head(
        &weights, &c, &embed, hf_dir,
    )?);
    // DeepSeek-V3's depths of multi-token prediction follow the layers: each has its norms,
    // its projection, a layer like the last, a final norm (`shared_head.norm`) and copies of
    // the embedding and the output layer, which must be the model's (megatron-rs shares them).
    let head = match c.untie_embeddings_and_output_weights {
        true => take("lm_head.weight", &[vocab, h])?,
        false => embed,
    };
    for k in 0..c.mtp_depths() {
        let hf = c.num_layers + k;
        let hf_name = |s: &str| format!("model.layers.{hf}.{s}");
        let ours = |s: &str| format!("mtp.{k}.{s}");
        for (to, from, shape) in [
            ("enorm.weight", "enorm.weight", vec![h]),
            ("hnorm.weight", "hnorm.weight", vec![h]),
            ("eh_proj.weight", "eh_proj.weight", vec![h, 2 * h]),
            ("final_norm.weight", "shared_head.norm.weight", vec![h]),
        ] {
            model.push(OutTensor::copy(ours(to), take(&hf_name(from), &shape)?));
        }
        model.extend(layer(
            hf,
            &ours("block."),
            *pattern.last().unwrap_or(&true),
        )?);
        for (copy, of, what) in [
            ("embed_tokens.weight", &embed, "model.embed_tokens.weight"),
            ("shared_head.head.weight", &head, "the output layer"),
        ] {
            let name = hf_name(copy);
            if !take(&name, &[vocab, h])?.same_values(of)? {
                bail!(
                    "{}: `{name}` differs from {what}: megatron-rs's multi-token prediction \
                     shares the model's embedding and output layer, so it cannot hold a \
                     depth with its own",
                    hf_dir.display()
                );
            }
        }
    }
    weights.refuse_untaken()?;
    let mut done = super::save_imported(hf_dir, out, &c, &model, ARCHITECTURE)?;
    done.skipped.extend(skipped);
    Ok(done)
}

/// Writes the checkpoint `ckpt` of a DeepSeek-V3-architecture model as a Hugging Face
/// `DeepseekV3ForCausalLM` directory `hf_dir` (new or empty), tensor by tensor: the weights as
/// transformers saves them in the dtype `options` asks (else the imported model's), the
/// `config.json` the import carried where the model is still the one it describes, and the
/// tokenizer and generation files the checkpoint carries. LoRA adapters are merged with
/// `--merge-lora`.
pub fn export(ckpt: &Path, hf_dir: &Path, options: &ExportOptions) -> Result<Converted> {
    refuse_existing(hf_dir)?;
    let loaded = checkpoint::open(ckpt)?;
    let c: GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    let lacks = lacks(&c);
    if !lacks.is_empty() {
        bail!(
            "{}: {ARCHITECTURE} cannot hold the model: {}",
            loaded.dir().display(),
            lacks.join("; ")
        );
    }
    super::check_merge_lora(&c, options.merge_lora, loaded.dir(), "")?;
    let tokenizer = super::checkpoint_tokenizer(ckpt, loaded.dir())?;
    let eod = super::eod_id(tokenizer.as_ref(), c.vocab_size);
    let carried = hf_files::carried_in(ckpt)?;
    let original = hf_files::carried_config(&carried)?;
    let before = original
        .as_ref()
        .and_then(|o| Some(config_to_hf(&config_from_hf(o).ok()?, eod)));
    let tensors = super::CheckpointTensors::open(&loaded)?;
    let get = |name: &str| tensors.get(name);
    let lora = c.lora.as_ref();
    let merged = |hf: String, at: &str, layer: &str, rows: Range<usize>| {
        let w = get(&format!("{at}{layer}.weight"))?;
        let adapter = super::peft::merge_source(&tensors, lora, at, layer);
        Ok::<_, anyhow::Error>(super::peft::merged_rows(hf, w, adapter, vec![rows]))
    };
    let (h, f) = (c.hidden_size, c.ffn_hidden_size);
    let mla = c.mla.context("checked: multi-latent attention")?;
    let moe = c.moe.as_ref().context("checked: experts")?;
    let (ef, sf) = (moe.ffn_hidden_size, moe.shared_expert_ffn.unwrap_or(0));
    let q_width = c.num_attention_heads * mla.q_head_dim();
    let kv_width = c.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim);
    let mut hf = vec![OutTensor::copy(
        "model.embed_tokens.weight",
        get("wte.weight")?,
    )];
    // Our layer at `at` (`blocks.{i}.`, or `mtp.{k}.block.`) as transformers' layer `index`.
    let layer = |index: usize, at: &str, routed: bool| {
        let mut hf = Vec::new();
        let ours = |s: &str| format!("{at}{s}");
        let hf_name = |s: &str| format!("model.layers.{index}.{s}");
        hf.push(OutTensor::copy(
            hf_name("input_layernorm.weight"),
            get(&ours("ln1.weight"))?,
        ));
        match mla.q_lora_rank {
            Some(r) => {
                hf.push(merged(
                    hf_name("self_attn.q_a_proj.weight"),
                    at,
                    "attn.q_down",
                    0..r,
                )?);
                hf.push(OutTensor::copy(
                    hf_name("self_attn.q_a_layernorm.weight"),
                    get(&ours("attn.q_norm.weight"))?,
                ));
                hf.push(merged(
                    hf_name("self_attn.q_b_proj.weight"),
                    at,
                    "attn.q_up",
                    0..q_width,
                )?);
            }
            None => hf.push(merged(
                hf_name("self_attn.q_proj.weight"),
                at,
                "attn.q",
                0..q_width,
            )?),
        }
        hf.push(merged(
            hf_name("self_attn.kv_a_proj_with_mqa.weight"),
            at,
            "attn.kv_down",
            0..mla.kv_lora_rank + mla.qk_pos_emb_head_dim,
        )?);
        hf.push(OutTensor::copy(
            hf_name("self_attn.kv_a_layernorm.weight"),
            get(&ours("attn.kv_norm.weight"))?,
        ));
        hf.push(merged(
            hf_name("self_attn.kv_b_proj.weight"),
            at,
            "attn.kv_up",
            0..kv_width,
        )?);
        hf.push(merged(
            hf_name("self_attn.o_proj.weight"),
            at,
            "attn.proj",
            0..h,
        )?);
        if routed {
            for x in 0..moe.router.num_experts {
                let name = |s: &str| hf_name(&format!("mlp.experts.{x}.{s}.weight"));
                let row = x * 2 * ef;
                hf.push(merged(
                    name("gate_proj"),
                    at,
                    "mlp.experts.fc1",
                    row..row + ef,
                )?);
                hf.push(merged(
                    name("up_proj"),
                    at,
                    "mlp.experts.fc1",
                    row + ef..row + 2 * ef,
                )?);
                hf.push(merged(
                    name("down_proj"),
                    at,
                    "mlp.experts.fc2",
                    x * h..(x + 1) * h,
                )?);
            }
            hf.push(OutTensor::copy(
                hf_name("mlp.gate.weight"),
                get(&ours("mlp.experts.router.weight"))?,
            ));
            hf.push(expert_bias(
                &tensors,
                &ours,
                &hf_name,
                moe.router.num_experts,
            )?);
            let shared = |s: &str| hf_name(&format!("mlp.shared_experts.{s}.weight"));
            hf.push(merged(shared("gate_proj"), at, "mlp.shared.fc1", 0..sf)?);
            hf.push(merged(shared("up_proj"), at, "mlp.shared.fc1", sf..2 * sf)?);
            hf.push(merged(shared("down_proj"), at, "mlp.shared.fc2", 0..h)?);
        } else {
            hf.push(merged(
                hf_name("mlp.gate_proj.weight"),
                at,
                "mlp.fc1",
                0..f,
            )?);
            hf.push(merged(
                hf_name("mlp.up_proj.weight"),
                at,
                "mlp.fc1",
                f..2 * f,
            )?);
            hf.push(merged(
                hf_name("mlp.down_proj.weight"),
                at,
                "mlp.fc2",
                0..h,
            )?);
        }
        hf.push(OutTensor::copy(
            hf_name("post_attention_layernorm.weight"),
            get(&ours("ln2.weight"))?,
        ));
        Ok::<_, anyhow::Error>(hf)
    };
    let pattern = c.moe_layers()?;
    for (i, &routed) in pattern.iter().enumerate() {
        hf.extend(layer(i, &format!("blocks.{i}."), routed)?);
    }
    hf.push(OutTensor::copy("model.norm.weight", get("ln_f.weight")?));
    let head = match c.untie_embeddings_and_output_weights {
        true => get("wte.output_weight")?,
        false => get("wte.weight")?,
    };
    if c.untie_embeddings_and_output_weights {
        hf.push(OutTensor::copy("lm_head.weight", head));
    }
    // The depths of multi-token prediction after the layers, as DeepSeek-V3 ships them, with
    // copies of the embedding and the output layer.
    for k in 0..c.mtp_depths() {
        let index = c.num_layers + k;
        let hf_name = |s: &str| format!("model.layers.{index}.{s}");
        let ours = |s: &str| format!("mtp.{k}.{s}");
        for (to, from) in [
            ("enorm.weight", "enorm.weight"),
            ("hnorm.weight", "hnorm.weight"),
            ("shared_head.norm.weight", "final_norm.weight"),
        ] {
            hf.push(OutTensor::copy(hf_name(to), get(&ours(from))?));
        }
        hf.push(merged(
            hf_name("eh_proj.weight"),
            &ours(""),
            "eh_proj",
            0..h,
        )?);
        hf.extend(layer(
            index,
            &ours("block."),
            *pattern.last().unwrap_or(&true),
        )?);
        hf.push(OutTensor::copy(
            hf_name("embed_tokens.weight"),
            get("wte.weight")?,
        ));
        hf.push(OutTensor::copy(hf_name("shared_head.head.weight"), head));
    }
    let dtype = super::export_dtype(options, original.as_ref(), &hf);
    let config = super::export_config(original.as_ref(), config_to_hf(&c, eod), before, dtype);
    let (bytes, weight_files, carried) =
        super::write_export(hf_dir, &loaded, hf, &config, dtype, options, &carried)?;
    Ok(Converted {
        arch: ARCHITECTURE,
        config: c,
        dtype,
        bytes,
        weight_files,
        carried,
        skipped: Vec::new(),
    })
}

/// A MoE layer's routing correction bias: the checkpoint's expert bias, or zeros for a model
/// trained without one (transformers always adds it).
fn expert_bias<'a>(
    tensors: &'a super::CheckpointTensors,
    ours: &dyn Fn(&str) -> String,
    hf_name: &dyn Fn(&str) -> String,
    experts: usize,
) -> Result<OutTensor<'a>> {
    let name = hf_name("mlp.gate.e_score_correction_bias");
    Ok(
        match tensors.find(&ours("mlp.experts.router.expert_bias")) {
            Some(bias) => OutTensor::copy(name, bias),
            None => OutTensor::computed(name, Dtype::F32, vec![experts], move || {
                Ok(vec![0.0; experts])
            }),
        },
    )
}
