//! Models registered by name: `megatron train --model NAME` looks them up here.

use megatron_core::moe::RouterConfig;
use megatron_core::tensor_parallel::Yarn;

use crate::config::{DeepSeekMoe, GptConfig, MoeConfig, MoeLayerFreq};
use crate::mla::MlaConfig;

/// A named architecture.
#[derive(Debug)]
pub struct ModelPreset {
    /// The name, e.g. `gpt2-small`.
    pub name: &'static str,
    /// One line about it.
    pub description: &'static str,
    /// Its architecture.
    pub config: fn() -> GptConfig,
}

inventory::collect!(ModelPreset);

/// Every registered preset, sorted by name.
pub fn presets() -> Vec<&'static ModelPreset> {
    let mut all: Vec<&'static ModelPreset> = inventory::iter::<ModelPreset>.into_iter().collect();
    all.sort_by_key(|p| p.name);
    all
}

/// The preset called `name`.
pub fn preset(name: &str) -> Option<&'static ModelPreset> {
    inventory::iter::<ModelPreset>
        .into_iter()
        .find(|p| p.name == name)
}

inventory::submit! {
    ModelPreset {
        name: "gpt-tiny",
        description: "4 layers, hidden 128, 4 heads, byte vocabulary: trains on a laptop CPU in minutes",
        config: || GptConfig::new(4, 128, 4, 256, 256),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt-moe-tiny",
        description: "gpt-tiny with MoE MLPs: 8 experts of ffn 256, top-2, aux loss 0.01: trains on a CPU in minutes",
        config: || {
            GptConfig::new(4, 128, 4, 256, 256).with_moe(MoeConfig {
                router: RouterConfig {
                    aux_loss_coeff: 0.01,
                    ..RouterConfig::new(8, 2)
                },
                ffn_hidden_size: 256,
                layer_freq: MoeLayerFreq::Every(1),
                shared_expert_ffn: None,
                dispatcher: Default::default(),
            })
        },
    }
}

/// Mixture-of-experts MLPs in every layer: `experts` SwiGLU experts of `ffn`, top-`topk`,
/// softmax over the chosen experts' logits (Mixtral's and Qwen3-MoE's routing, which
/// renormalises the top-k probabilities), dropless, with the auxiliary load-balancing loss.
fn swiglu_experts(experts: usize, topk: usize, ffn: usize, aux_loss: f32) -> MoeConfig {
    MoeConfig {
        router: RouterConfig {
            aux_loss_coeff: aux_loss,
            ..RouterConfig::new(experts, topk)
        },
        ffn_hidden_size: ffn,
        layer_freq: MoeLayerFreq::Every(1),
        shared_expert_ffn: None,
        dispatcher: Default::default(),
    }
}

inventory::submit! {
    ModelPreset {
        name: "mistral-7b",
        description: "Mistral 7B v0.1: 32 layers, hidden 4096, 32 heads in 8 key/value groups, SwiGLU 14336, vocabulary 32,000, a sliding window of 4096 positions: 7.24B parameters",
        config: || {
            let mut c = GptConfig::llama(32, 4096, 32, 8, 14336, 32000, 32768, 10000.0);
            c.window_size = Some(4095);
            c
        },
    }
}

inventory::submit! {
    ModelPreset {
        name: "mixtral-tiny",
        description: "Mixtral-shaped llama-tiny: 4 layers, hidden 128, 4 heads in 2 key/value groups, 8 SwiGLU experts of 160, top-2, RoPE, untied, byte vocabulary: trains on a CPU in minutes",
        config: || {
            GptConfig::llama(4, 128, 4, 2, 320, 256, 256, 1e6)
                .with_moe(swiglu_experts(8, 2, 160, 0.01))
        },
    }
}

inventory::submit! {
    ModelPreset {
        name: "mixtral-8x7b",
        description: "Mixtral 8x7B: 32 layers, hidden 4096, 32 heads in 8 key/value groups, 8 SwiGLU experts of 14336, top-2, vocabulary 32,000, RoPE base 10⁶: 46.7B parameters, 12.9B active",
        config: || {
            GptConfig::llama(32, 4096, 32, 8, 14336, 32000, 32768, 1e6)
                .with_moe(swiglu_experts(8, 2, 14336, 0.02))
        },
    }
}

inventory::submit! {
    ModelPreset {
        name: "qwen3-30b-a3b",
        description: "Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads of 128 in 4 key/value groups, qk-layernorm, 128 SwiGLU experts of 768, top-8: 30.5B parameters, 3.3B active",
        config: || {
            let mut c = qwen3(48, 2048, 32, 4, 6144);
            c.moe = Some(swiglu_experts(128, 8, 768, 0.001));
            c
        },
    }
}

inventory::submit! {
    ModelPreset {
        name: "llama-tiny",
        description: "Llama-shaped gpt-tiny: 4 layers, hidden 128, 4 heads in 2 key/value groups, RMSNorm, SwiGLU 320, RoPE, untied, byte vocabulary: trains on a CPU in minutes",
        config: || GptConfig::llama(4, 128, 4, 2, 320, 256, 256, 10000.0),
    }
}

inventory::submit! {
    ModelPreset {
        name: "llama3-8b",
        description: "Llama 3 8B: 32 layers, hidden 4096, 32 heads in 8 key/value groups, SwiGLU 14336, vocabulary 128,256, RoPE base 500,000: 8.03B parameters",
        config: || GptConfig::llama(32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    }
}

inventory::submit! {
    ModelPreset {
        name: "llama3-70b",
        description: "Llama 3 70B: 80 layers, hidden 8192, 64 heads in 8 key/value groups, SwiGLU 28672, vocabulary 128,256, RoPE base 500,000: 70.6B parameters",
        config: || GptConfig::llama(80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
    }
}

/// Qwen3's dense decoder: a Llama with heads of 128, query and key norms, ε 1e-6, RoPE base
/// 10⁶ and a vocabulary of 151,936.
fn qwen3(layers: usize, hidden: usize, heads: usize, groups: usize, ffn: usize) -> GptConfig {
    let mut c = GptConfig::llama(layers, hidden, heads, groups, ffn, 151936, 40960, 1e6);
    c.kv_channels = Some(128);
    c.qk_layernorm = true;
    c.layernorm_epsilon = 1e-6;
    c
}

inventory::submit! {
    ModelPreset {
        name: "qwen3-0.6b",
        description: "Qwen3 0.6B: 28 layers, hidden 1024, 16 heads of 128 in 8 key/value groups, qk-layernorm, SwiGLU 3072, tied embeddings: 0.60B parameters",
        config: || {
            let mut c = qwen3(28, 1024, 16, 8, 3072);
            c.untie_embeddings_and_output_weights = false;
            c
        },
    }
}

inventory::submit! {
    ModelPreset {
        name: "qwen3-8b",
        description: "Qwen3 8B: 36 layers, hidden 4096, 32 heads of 128 in 8 key/value groups, qk-layernorm, SwiGLU 12288: 8.19B parameters",
        config: || qwen3(36, 4096, 32, 8, 12288),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt2-small",
        description: "GPT-2 small (124M): 12 layers, hidden 768, 12 heads, vocabulary 50,257",
        config: || GptConfig::new(12, 768, 12, 50257, 1024),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt2-medium",
        description: "GPT-2 medium (355M): 24 layers, hidden 1024, 16 heads, vocabulary 50,257",
        config: || GptConfig::new(24, 1024, 16, 50257, 1024),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt-1.2b",
        description: "Megatron-LM paper's 1.2B: 40 layers, hidden 1536, 16 heads, vocabulary 50,257",
        config: || GptConfig::new(40, 1536, 16, 50257, 1024),
    }
}

/// YaRN from an original context of `original` by `factor`, betas `beta_fast` and
/// `beta_slow`, mscale and mscale_all_dim 1 (DeepSeek-V3's and Kimi K2's).
fn yarn(original: usize, factor: f32, (beta_fast, beta_slow): (f32, f32)) -> Option<Yarn> {
    Some(Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast,
        beta_slow,
        mscale: 1.0,
        mscale_all_dim: 1.0,
    })
}

/// DeepSeek-V3's latent sizes: a query latent of `q_lora_rank` (or none), a key/value latent
/// of 512, heads of 128 position-free and 64 rotary features, values of 128.
fn deepseek_mla(q_lora_rank: Option<usize>) -> MlaConfig {
    MlaConfig {
        q_lora_rank,
        kv_lora_rank: 512,
        qk_head_dim: 128,
        qk_pos_emb_head_dim: 64,
        v_head_dim: 128,
        latent_norm_epsilon: None,
    }
}

inventory::submit! {
    ModelPreset {
        name: "deepseek-v3",
        description: "DeepSeek-V3: 61 layers, hidden 7168, 128 heads of multi-latent attention (query latent 1536, key/value latent 512), YaRN ×40, 3 dense layers then 256 SwiGLU experts of 2048 and 1 shared, top-8 in 4 of 8 groups, vocabulary 129,280: 671B parameters, 37.6B active (without MTP)",
        config: || GptConfig::deepseek_v3(
            (61, 7168, 128, 18432),
            (129280, 163840),
            deepseek_mla(Some(1536)),
            DeepSeekMoe { experts: 256, topk: 8, ffn: 2048, shared: 1, groups: 8, group_topk: 4, scaling: 2.5, dense: 3 },
            (10000.0, yarn(4096, 40.0, (32.0, 1.0))),
            1e-6,
        ),
    }
}

inventory::submit! {
    ModelPreset {
        name: "kimi-k2",
        description: "Kimi K2: DeepSeek-V3's architecture with 64 heads, 1 dense layer, 384 experts of 2048 and 1 shared, top-8, YaRN ×32 from base 50,000, vocabulary 163,840: 1.03T parameters, 32.9B active",
        config: || GptConfig::deepseek_v3(
            (61, 7168, 64, 18432),
            (163840, 131072),
            deepseek_mla(Some(1536)),
            DeepSeekMoe { experts: 384, topk: 8, ffn: 2048, shared: 1, groups: 1, group_topk: 1, scaling: 2.827, dense: 1 },
            (50000.0, yarn(4096, 32.0, (1.0, 1.0))),
            1e-6,
        ),
    }
}

inventory::submit! {
    ModelPreset {
        name: "moonlight-16b-a3b",
        description: "Moonlight-16B-A3B: DeepSeek-V3's architecture with 27 layers, hidden 2048, 16 heads and no query latent, 1 dense layer, 64 experts of 1408 and 2 shared, top-6, base 50,000, vocabulary 163,840: 16.0B parameters, 2.9B active",
        config: || GptConfig::deepseek_v3(
            (27, 2048, 16, 11264),
            (163840, 8192),
            deepseek_mla(None),
            DeepSeekMoe { experts: 64, topk: 6, ffn: 1408, shared: 2, groups: 1, group_topk: 1, scaling: 2.446, dense: 1 },
            (50000.0, None),
            1e-5,
        ),
    }
}

inventory::submit! {
    ModelPreset {
        name: "deepseek-v3-tiny",
        description: "DeepSeek-V3-shaped tiny model: 4 layers, hidden 128, 4 heads of multi-latent attention (latents 48 and 32), YaRN ×4, 1 dense layer then 8 SwiGLU experts of 64 and 1 shared, top-4 in 2 of 4 groups, byte vocabulary: trains on a CPU in minutes",
        config: || GptConfig::deepseek_v3(
            (4, 128, 4, 256),
            (256, 256),
            MlaConfig { q_lora_rank: Some(48), kv_lora_rank: 32, qk_head_dim: 16, qk_pos_emb_head_dim: 8, v_head_dim: 16, latent_norm_epsilon: None },
            DeepSeekMoe { experts: 8, topk: 4, ffn: 64, shared: 1, groups: 4, group_topk: 2, scaling: 2.5, dense: 1 },
            (10000.0, yarn(64, 4.0, (32.0, 1.0))),
            1e-6,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_registered() {
        let names: Vec<&str> = presets().iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "deepseek-v3",
                "deepseek-v3-tiny",
                "gpt-1.2b",
                "gpt-moe-tiny",
                "gpt-tiny",
                "gpt2-medium",
                "gpt2-small",
                "kimi-k2",
                "llama-tiny",
                "llama3-70b",
                "llama3-8b",
                "mistral-7b",
                "mixtral-8x7b",
                "mixtral-tiny",
                "moonlight-16b-a3b",
                "qwen3-0.6b",
                "qwen3-30b-a3b",
                "qwen3-8b"
            ]
        );
        // Hugging Face's counts of the same configurations (Meta's and Qwen's published
        // totals): embeddings and the untied output layer (Qwen3-0.6B ties them), layers of
        // grouped-query attention (Qwen3: heads of 128 and their two norms), a SwiGLU MLP and
        // two RMSNorms, the final norm.
        for (name, params) in [
            ("llama3-8b", 8_030_261_248),
            ("llama3-70b", 70_553_706_496),
            ("qwen3-0.6b", 596_049_920),
            ("qwen3-8b", 8_190_735_360),
            ("mistral-7b", 7_241_732_096),
        ] {
            let c = (preset(name).unwrap().config)();
            assert_eq!(c.num_params(1), params, "{name}");
            c.validate_parallel(8, 1, false).unwrap();
        }
        // The MoE ones (transformers' counts on the meta device): every expert in the total,
        // top-k experts a layer in the active count (each SwiGLU expert 3·h·ffn).
        for (name, params, active) in [
            ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
            ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
            // DeepseekV3ForCausalLM (which builds no MTP layer): multi-latent attention, the
            // dense first layers, the shared experts; the expert bias is a buffer.
            ("deepseek-v3", 671_026_404_352, 37_552_282_624),
            ("kimi-k2", 1_026_408_209_408, 32_861_477_888),
            ("moonlight-16b-a3b", 15_960_108_544, 2_914_774_528),
        ] {
            let c = (preset(name).unwrap().config)();
            assert_eq!(c.num_params(1), params, "{name}");
            assert_eq!(c.active_params(1), active, "{name} active");
            c.validate_parallel(8, 8, true).unwrap();
        }
        // DeepSeek-V3's depth of multi-token prediction, as its release's `model.layers.61.*`
        // counts it without the copies of the embedding and the output layer: the two input
        // norms and the final one (3 · 7168), eh_proj (7168 × 14336) and an MoE layer
        // (attention 187,107,328, norms 14,336, router 1,835,008, 256 experts of 3 · 7168 ·
        // 2048, the shared expert 44,040,192); active, 8 of the experts.
        let mut c = (preset("deepseek-v3").unwrap().config)();
        c.mtp = Some(crate::MtpConfig::new(1));
        assert_eq!(c.mtp_params(1, false), 11_610_067_968);
        assert_eq!(c.mtp_params(1, true), 688_100_352);
        assert_eq!(c.num_params(1), 671_026_404_352 + 11_610_067_968);
        let big = (preset("gpt-1.2b").unwrap().config)();
        let params = big.num_params(1) as f64 / 1e9;
        assert!((1.15..1.3).contains(&params), "{params}");
        assert!(preset("gpt-3").is_none());
    }
}
