"""Golden files for the Llama-family importer (tests/hf_llama.rs), made by Hugging Face
transformers itself: tiny random models of each architecture, saved as transformers saves them,
with the logits transformers computes for fixed tokens and its greedy continuation.

    python3 -m venv venv && venv/bin/pip install torch transformers safetensors
    venv/bin/python tools/golden/hf_llama.py tests/data/hf [NAME ...]

Each model lands in OUT/<name>/ (config.json, model.safetensors or shards with their index)
with reference.json: the tokens, the logits [seq, vocab] in f32, and the greedy continuation of
the first half of the tokens (transformers' generate with do_sample=False and its KV cache).
Each model's seed is its place in MODELS: add new ones at the end.
"""

import json
import sys
from pathlib import Path

import torch
import transformers

TOKENS = [3, 17, 42, 5, 63, 0, 21, 9, 33, 12, 7, 50]
NEW_TOKENS = 6

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MODELS = {
    # Llama 3.1's scaled RoPE, grouped-query attention, untied, in two shards.
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            COMMON,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
            tie_word_embeddings=False,
        ),
        "24KB",
    ),
    # Mistral without a sliding window (v0.3's kind).
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(COMMON, sliding_window=None, rope_theta=1000000.0, tie_word_embeddings=False),
        None,
    ),
    # Qwen2: a bias on q, k and v alone; tied embeddings.
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(COMMON, tie_word_embeddings=True, use_sliding_window=False, rms_norm_eps=1e-6),
        None,
    ),
    # Qwen3: heads of 16 (not 32 / 4), query and key norms, untied.
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(COMMON, head_dim=16, tie_word_embeddings=False, use_sliding_window=False, rms_norm_eps=1e-6),
        None,
    ),
    # Mixtral: 4 SwiGLU experts of 24 in every layer, top-2 renormalised.
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(
            COMMON,
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            sliding_window=None,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        None,
    ),
    # Qwen3-MoE: 4 experts of 16, top-2 without renormalising (norm_topk_prob false), the
    # second layer dense (mlp_only_layers), query and key norms, heads of 16.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            COMMON,
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            use_sliding_window=False,
            rms_norm_eps=1e-6,
        ),
        None,
    ),
    # Mistral 7B v0.1's kind: a sliding window of the last 4 positions in every layer.
    "mistral_window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(COMMON, sliding_window=4, rope_theta=10000.0, tie_word_embeddings=False),
        None,
    ),
    # Qwen2 with a window of 3 in the layers from max_window_layers = 1 on.
    "qwen2_window": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            COMMON,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            rms_norm_eps=1e-6,
        ),
        None,
    ),
    # DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention with a query latent of 24, a
    # key/value latent of 16, heads of 8 + 4 rotary features in interleaved pairs, values of
    # 12; YaRN ×4 from 16 positions with mscale_all_dim 1 (the scores scaled); the first layer
    # dense, then 8 SwiGLU experts of 16 in 4 groups of 2 (top-4 in the best 2 groups by their
    # best 2 scores), sigmoid scores with the correction bias, scaled by 2.5, beside a shared
    # expert; untied.
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            COMMON,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
        None,
    ),
    # Moonlight's kind: no query latent, no YaRN (base 50,000), 4 experts of 16 without
    # groups, top-2 scaled by 2.446, two shared experts, ε 1e-5.
    "moonlight": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            COMMON,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=2,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0),
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        ),
        None,
    ),
}


def main(out: Path, only: list) -> None:
    for seed, (name, (config_class, model_class, kwargs, shard)) in enumerate(MODELS.items()):
        if only and name not in only:
            continue
        torch.manual_seed(1000 + seed)
        config = config_class(**kwargs)
        model = model_class(config).to(torch.float32).eval()
        # Norm weights and biases away from their initial ones and zeros, so that a mapping
        # that loses them shows.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
            # DeepSeek's routing correction bias is a buffer: away from zero too.
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn_like(b))
        target = out / name
        target.mkdir(parents=True, exist_ok=True)
        if shard:
            model.save_pretrained(target, max_shard_size=shard)
        else:
            model.save_pretrained(target)
        tokens = torch.tensor([TOKENS])
        with torch.no_grad():
            logits = model(tokens).logits[0].to(torch.float32)
            prompt = tokens[:, : len(TOKENS) // 2]
            # Every prompt token attended: without the mask, generate would take the pad id's
            # tokens for padding.
            generated = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, prompt.shape[1] :]
        (target / "reference.json").write_text(
            json.dumps(
                {
                    "transformers": transformers.__version__,
                    "tokens": TOKENS,
                    "logits": logits.tolist(),
                    "prompt": prompt[0].tolist(),
                    "greedy": generated.tolist(),
                }
            )
        )
        print(name, [p.name for p in sorted(target.iterdir())])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
