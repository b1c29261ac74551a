//! Which Hugging Face architecture holds a megatron-rs model exactly: GPT-2, or one of the Llama
//! family (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE). A model none of them holds is
//! refused with each of its features that the architectures lack, named by the flag that set
//! it: an export never writes a model transformers would run differently.

use anyhow::{Result, bail};
use megatron_core::moe::ScoreFunction;
use megatron_core::tensor_parallel::Normalization;
use megatron_models::{GptConfig, PositionEmbeddingType};

/// The Hugging Face architecture a model is exported as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfArchitecture {
    /// `GPT2LMHeadModel`.
    Gpt2,
    /// One of the Llama family, by its class name (`LlamaForCausalLM`, ...).
    LlamaFamily(&'static str),
    /// `DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi K2, Moonlight).
    DeepseekV3,
}

impl HfArchitecture {
    /// The architecture's class name, as `config.json`'s `architectures` names it.
    pub fn name(self) -> &'static str {
        match self {
            HfArchitecture::Gpt2 => "GPT2LMHeadModel",
            HfArchitecture::LlamaFamily(arch) => arch,
            HfArchitecture::DeepseekV3 => super::hf_deepseek::ARCHITECTURE,
        }
    }
}

/// What GPT-2 (`GPT2LMHeadModel`) cannot hold of `c`, each feature with the flag that sets it;
/// empty for a GPT-2.
pub fn gpt2_lacks(c: &GptConfig) -> Vec<String> {
    let mut lacks = Vec::new();
    if c.normalization == Normalization::RmsNorm {
        lacks.push("RMSNorm (--normalization RMSNorm; GPT-2's norms are LayerNorm)".to_string());
    }
    if c.swiglu {
        lacks.push("a SwiGLU MLP (--swiglu; GPT-2's is GeLU)".to_string());
    }
    if !c.add_bias_linear {
        lacks.push("linear layers without biases (--disable-bias-linear)".to_string());
    }
    match c.position_embedding_type {
        PositionEmbeddingType::LearnedAbsolute => {}
        PositionEmbeddingType::Rope => lacks.push(
            "rotary positions (--position-embedding-type rope; GPT-2 learns absolute ones)"
                .to_string(),
        ),
        PositionEmbeddingType::None => {
            lacks.push("no position embeddings (--position-embedding-type none)".to_string())
        }
    }
    let (heads, groups) = (c.num_attention_heads, c.query_groups());
    if groups != heads {
        lacks.push(format!(
            "grouped-query attention ({groups} key/value heads for {heads} query heads: \
             --num-query-groups)"
        ));
    }
    let split = c.hidden_size / heads.max(1);
    if c.head_dim() != split || c.head_dim() * heads != c.hidden_size {
        lacks.push(format!(
            "heads of {} channels (--kv-channels; GPT-2's are hidden / heads = {split})",
            c.head_dim()
        ));
    }
    if c.qk_layernorm {
        lacks.push("query and key norms (--qk-layernorm)".to_string());
    }
    if c.window_size.is_some() {
        lacks.push("a sliding window (--window-size)".to_string());
    }
    if c.moe.is_some() {
        lacks.push("a mixture of experts (--num-experts)".to_string());
    }
    if c.mla.is_some() {
        lacks.push("multi-latent attention (--multi-latent-attention)".to_string());
    }
    lacks
}

/// The Llama-family architecture of `c`: Qwen3 with query and key norms, Qwen2 with a QKV bias
/// alone, Mistral with a window in every layer, Llama otherwise; with experts, Qwen3-MoE with
/// query and key norms, Mixtral (every layer routed, the top-k renormalised) without. Else
/// what none of them holds, each feature with the flag that sets it.
pub fn llama_family(c: &GptConfig) -> std::result::Result<&'static str, Vec<String>> {
    let mut lacks = Vec::new();
    if c.mla.is_some() {
        lacks.push(
            "multi-latent attention (--multi-latent-attention: DeepSeek-V3's; the Llama family \
             attends on a fused projection)",
        );
    }
    if c.normalization != Normalization::RmsNorm {
        lacks.push("LayerNorm (the Llama family's norms are RMSNorm: --normalization RMSNorm)");
    }
    if !c.swiglu {
        lacks.push("a GeLU MLP (the Llama family's is SwiGLU: --swiglu)");
    }
    if c.add_bias_linear {
        lacks.push(
            "biases in the linear layers (the Llama family has none but Qwen2's QKV bias: \
             --disable-bias-linear, with --add-qkv-bias for Qwen2)",
        );
    }
    match c.position_embedding_type {
        PositionEmbeddingType::Rope => {
            if c.rotary.interleaved {
                lacks.push(
                    "interleaved rotary pairs (--rotary-interleaved; Hugging Face rotates halves)",
                );
            }
            if c.rotary.yarn.is_some() {
                lacks.push("YaRN frequencies (--rope-type yarn; written for DeepSeek-V3 only)");
            }
            if c.rotary.percent != 1.0 {
                lacks.push(
                    "rotary embeddings on part of each head (--rotary-percent; transformers' \
                     Llama family rotates whole heads)",
                );
            }
        }
        PositionEmbeddingType::LearnedAbsolute => lacks.push(
            "learned absolute positions (the Llama family's are rotary: \
             --position-embedding-type rope)",
        ),
        PositionEmbeddingType::None => lacks.push(
            "no position embeddings (the Llama family's are rotary: --position-embedding-type \
             rope)",
        ),
    }
    if !lacks.is_empty() {
        return Err(lacks.into_iter().map(str::to_string).collect());
    }
    let window = c.window_size.is_some();
    let every_window = window && c.window_layers.is_none();
    let Some(moe) = &c.moe else {
        return match (c.qk_layernorm, c.add_qkv_bias) {
            (true, false) => Ok("Qwen3ForCausalLM"),
            (false, true) => Ok("Qwen2ForCausalLM"),
            (false, false) if every_window => Ok("MistralForCausalLM"),
            (false, false) if !window => Ok("LlamaForCausalLM"),
            (false, false) => Err(vec![
                "a sliding window in some layers only (--window-attn-skip-freq) without query \
                 and key norms or a QKV bias (only Qwen2 and Qwen3 window some layers)"
                    .to_string(),
            ]),
            (true, true) => Err(vec![
                "query and key norms with a QKV bias (--qk-layernorm --add-qkv-bias: Qwen3 has \
                 the norms, Qwen2 the bias, none both)"
                    .to_string(),
            ]),
        };
    };
    let r = &moe.router;
    let mut lacks = Vec::new();
    if r.score_function != ScoreFunction::Softmax {
        lacks.push(
            "sigmoid router scores (--moe-router-score-function sigmoid; Mixtral and Qwen3-MoE \
             route by softmax)",
        );
    }
    if r.topk_scaling_factor.is_some() {
        lacks.push("scaled routing weights (--moe-router-topk-scaling-factor)");
    }
    if r.group_limited.is_some() {
        lacks.push("group-limited routing (--moe-router-num-groups)");
    }
    if r.capacity_factor.is_some() {
        lacks.push("an expert capacity (--moe-expert-capacity-factor: dropped tokens)");
    }
    if r.expert_bias {
        lacks.push("an expert bias in the routing (--moe-router-enable-expert-bias)");
    }
    if moe.shared_expert_ffn.is_some() {
        lacks.push("shared experts (--moe-shared-expert-intermediate-size)");
    }
    if c.add_qkv_bias {
        lacks.push("a QKV bias beside experts (--add-qkv-bias; Mixtral and Qwen3-MoE have none)");
    }
    let every_layer = c.moe_layers().is_ok_and(|l| l.iter().all(|&m| m));
    if c.qk_layernorm {
        // Qwen3-MoE: dense layers and either routing, no window.
        if window {
            lacks.push("a sliding window beside Qwen3-MoE's query and key norms (--window-size)");
        }
    } else {
        // Mixtral: every layer routed, the top-k renormalised, a window in all layers or none.
        if !every_layer {
            lacks.push(
                "dense layers among the routed ones (--moe-layer-freq) without query and key \
                 norms (Mixtral routes every layer; Qwen3-MoE, with --qk-layernorm, mixes them)",
            );
        }
        if r.pre_softmax {
            lacks.push(
                "routing weights not renormalised over the top-k (--moe-router-pre-softmax) \
                 without query and key norms (Mixtral renormalises; Qwen3-MoE, with \
                 --qk-layernorm, may not)",
            );
        }
        if window && !every_window {
            lacks.push("a sliding window in some layers only (--window-attn-skip-freq)");
        }
    }
    match (lacks.is_empty(), c.qk_layernorm) {
        (true, true) => Ok("Qwen3MoeForCausalLM"),
        (true, false) => Ok("MixtralForCausalLM"),
        (false, _) => Err(lacks.into_iter().map(str::to_string).collect()),
    }
}

/// The Hugging Face architecture that holds `c` exactly, or an error naming, for GPT-2 and
/// for the Llama family (for a model of multi-latent attention, DeepSeek-V3), what each lacks.
pub fn for_model(c: &GptConfig) -> Result<HfArchitecture> {
    if c.mla.is_some() {
        let lacks = super::hf_deepseek::lacks(c);
        if lacks.is_empty() {
            return Ok(HfArchitecture::DeepseekV3);
        }
        bail!(
            "no Hugging Face architecture holds this model exactly: it has multi-latent \
             attention, and DeepseekV3ForCausalLM cannot hold: {}",
            lacks.join("; ")
        );
    }
    let gpt2 = gpt2_lacks(c);
    if gpt2.is_empty() {
        return Ok(HfArchitecture::Gpt2);
    }
    match llama_family(c) {
        Ok(arch) => Ok(HfArchitecture::LlamaFamily(arch)),
        Err(llama) => bail!(
            "no Hugging Face architecture holds this model exactly. GPT-2 cannot hold: {}. The \
             Llama family (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) cannot hold: {}",
            gpt2.join("; "),
            llama.join("; ")
        ),
    }
}

/// Refuses `c` unless GPT-2 holds it exactly, naming what GPT-2 lacks (and the Llama-family
/// architecture that holds it, when one does).
pub fn require_gpt2(c: &GptConfig) -> Result<()> {
    let lacks = gpt2_lacks(c);
    if lacks.is_empty() {
        return Ok(());
    }
    let instead = match llama_family(c) {
        Ok(arch) => format!(" (it is a {arch}: convert with --to hf)"),
        Err(_) => String::new(),
    };
    bail!(
        "the model is not a GPT-2; GPT2LMHeadModel cannot hold: {}{instead}",
        lacks.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_core::moe::RouterConfig;
    use megatron_models::{MoeConfig, MoeLayerFreq};

    fn llama() -> GptConfig {
        GptConfig::llama(2, 64, 4, 2, 128, 256, 64, 10000.0)
    }

    #[test]
    fn each_model_goes_to_the_architecture_that_holds_it() {
        assert_eq!(
            for_model(&GptConfig::new(2, 64, 4, 256, 64)).unwrap(),
            HfArchitecture::Gpt2
        );
        // Untied GPT-2 is a GPT-2 (transformers keeps its lm_head).
        let mut untied = GptConfig::new(2, 64, 4, 256, 64);
        untied.untie_embeddings_and_output_weights = true;
        assert_eq!(for_model(&untied).unwrap(), HfArchitecture::Gpt2);
        let arch = |c: &GptConfig| for_model(c).unwrap().name();
        assert_eq!(arch(&llama()), "LlamaForCausalLM");
        let mut c = llama();
        c.qk_layernorm = true;
        assert_eq!(arch(&c), "Qwen3ForCausalLM");
        let mut c = llama();
        c.add_qkv_bias = true;
        assert_eq!(arch(&c), "Qwen2ForCausalLM");
        let mut c = llama();
        c.window_size = Some(3);
        assert_eq!(arch(&c), "MistralForCausalLM");
        let moe = MoeConfig {
            router: RouterConfig::new(4, 2),
            ffn_hidden_size: 32,
            layer_freq: MoeLayerFreq::Every(1),
            shared_expert_ffn: None,
            dispatcher: Default::default(),
        };
        let c = llama().with_moe(moe.clone());
        assert_eq!(arch(&c), "MixtralForCausalLM");
        let mut c = llama().with_moe(MoeConfig {
            layer_freq: MoeLayerFreq::Pattern(vec![0, 1]),
            ..moe
        });
        let err = for_model(&c).unwrap_err().to_string();
        assert!(
            err.contains("cannot hold: dense layers among the routed ones"),
            "{err}"
        );
        c.qk_layernorm = true;
        assert_eq!(arch(&c), "Qwen3MoeForCausalLM");
    }

    #[test]
    fn a_model_no_architecture_holds_is_refused_naming_its_features() {
        // GPT-2 with a Llama-family flag: neither holds it.
        let mut c = GptConfig::new(2, 64, 4, 256, 64);
        c.swiglu = true;
        let err = for_model(&c).unwrap_err().to_string();
        assert!(
            err.contains("GPT-2 cannot hold: a SwiGLU MLP (--swiglu"),
            "{err}"
        );
        assert!(err.contains("cannot hold: LayerNorm"), "{err}");
        assert!(err.contains("; learned absolute positions"), "{err}");
        // Llama with grouped-query attention is not a GPT-2, and says where it belongs.
        let err = require_gpt2(&llama()).unwrap_err().to_string();
        assert!(
            err.contains("grouped-query attention (2 key/value heads for 4"),
            "{err}"
        );
        assert!(
            err.contains("it is a LlamaForCausalLM: convert with --to hf"),
            "{err}"
        );
        let mut c = GptConfig::new(2, 64, 4, 256, 64);
        c.kv_channels = Some(8);
        let err = require_gpt2(&c).unwrap_err().to_string();
        assert!(err.contains("heads of 8 channels (--kv-channels"), "{err}");
        let mut c = llama();
        c.rotary.percent = 0.5;
        let err = for_model(&c).unwrap_err().to_string();
        assert!(err.contains("--rotary-percent"), "{err}");
    }
}
