//! Hugging Face's Llama-family decoders against transformers itself: tiny random Llama (Llama
//! 3.1's scaled RoPE, grouped-query attention, untied, saved in four shards with their index),
//! Mistral (without and with a sliding window of 4), Qwen2 (QKV bias, tied; also with a window
//! of 3 in its second layer) and Qwen3 (heads of 16 over hidden 32, query and key norms),
//! Mixtral and Qwen3-MoE (SwiGLU experts)
//! made and saved by transformers 5.24 (`tools/golden/hf_llama.py`, `tests/data/hf/`), with the
//! logits and greedy continuation transformers computed. Each is imported, gives those logits
//! and that continuation at tp 1 and tp 2, and exports back to the same tensors and a config
//! transformers reads as the same model.

mod support;

use megatron::convert::hf_llama;
use support::TempDir;
use support::hf::{assert_exported_tensors, assert_greedy, assert_transformers_logits, golden};

#[test]
fn imported_llama_mistral_and_qwen_give_transformers_logits_and_export_back() {
    let dir = TempDir::new("hf-llama");
    for name in [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen3_moe",
        "mistral_window",
        "qwen2_window",
    ] {
        let hf = golden(name);
        let ckpt = dir.path().join(format!("{name}-ckpt"));
        let config = hf_llama::import(&hf, &ckpt).unwrap().config;
        assert_transformers_logits(name, &ckpt, &config);
        // Greedy generation continues the prompt as transformers' generate does (its KV cache
        // against this full recompute of every position).
        assert_greedy(name, &ckpt);
        // Back to Hugging Face: the same tensors, bit for bit, in one file.
        let out = dir.path().join(format!("{name}-hf"));
        let arch = hf_llama::export(&ckpt, &out, &Default::default())
            .unwrap()
            .arch;
        assert_exported_tensors(name, &out);
        // The config says the same model (Mistral without a window is a Llama).
        let config_out: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let same = hf_llama::config_from_hf(&config_out).unwrap();
        assert_eq!(same, config, "{name} as {arch}");
    }
}

#[test]
fn what_the_importer_cannot_honour_is_refused_by_name() {
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden("mistral").join("config.json")).unwrap(),
    )
    .unwrap();
    let with = |key: &str, value: serde_json::Value| {
        let mut c = base.clone();
        c[key] = value;
        hf_llama::config_from_hf(&c).unwrap_err().to_string()
    };
    // Sliding windows: W positions are the query and W − 1 keys before it; none of 0.
    let c = hf_llama::config_from_hf(&{
        let mut c = base.clone();
        c["sliding_window"] = 4096.into();
        c
    })
    .unwrap();
    assert_eq!((c.window_size, c.window_layers), (Some(4095), None));
    assert!(with("sliding_window", 0.into()).contains("`sliding_window` 0 is not a window"));
    let types = serde_json::json!(["full_attention", "chunked_attention"]);
    assert!(with("layer_types", types).contains("\"chunked_attention\" layers"));
    assert!(with("hidden_act", "gelu".into()).contains("`hidden_act` gelu"));
    assert!(with("attention_bias", true.into()).contains("`attention_bias` = true"));
    let rope = serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0});
    assert!(with("rope_parameters", rope).contains("rope type `yarn`"));
    // The mixtures of experts: what their routing cannot be is refused, and a missing count
    // named.
    let mut mixtral = base.clone();
    mixtral["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    mixtral["model_type"] = "mixtral".into();
    let err = hf_llama::config_from_hf(&mixtral).unwrap_err().to_string();
    assert!(err.contains("`num_local_experts` is missing"), "{err}");
    let moe: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden("qwen3_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let moe_with = |key: &str, value: serde_json::Value| {
        let mut c = moe.clone();
        c[key] = value;
        hf_llama::config_from_hf(&c)
    };
    let err = moe_with("router_jitter_noise", 0.01.into()).unwrap_err();
    assert!(
        err.to_string().contains("`router_jitter_noise` 0.01"),
        "{err}"
    );
    let err = moe_with("shared_expert_intermediate_size", 64.into()).unwrap_err();
    assert!(
        err.to_string()
            .contains("`shared_expert_intermediate_size`"),
        "{err}"
    );
    // Older Qwen3-MoE files count the experts in `num_experts`; `decoder_sparse_step` 2 and
    // `mlp_only_layers` [1] leave layer 0 dense too (layer i is routed when (i + 1) % step is
    // 0), and `norm_topk_prob` renormalises (Megatron-LM's softmax over the top-k).
    let mut older = moe.clone();
    let experts = older.as_object_mut().unwrap().remove("num_local_experts");
    older["num_experts"] = experts.unwrap();
    older["num_hidden_layers"] = 4.into();
    older["decoder_sparse_step"] = 2.into();
    older["norm_topk_prob"] = true.into();
    let c = hf_llama::config_from_hf(&older).unwrap();
    assert_eq!(c.moe_layers().unwrap(), [false, false, false, true]);
    let moe = c.moe.unwrap();
    assert_eq!((moe.router.num_experts, moe.router.topk), (4, 2));
    assert!(!moe.router.pre_softmax);
    // The older form of the RoPE settings: top-level rope_theta and rope_scaling with `type`.
    let mut old = base.clone();
    old.as_object_mut().unwrap().remove("rope_parameters");
    old["rope_theta"] = 500000.0.into();
    old["rope_scaling"] = serde_json::json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let c = hf_llama::config_from_hf(&old).unwrap();
    assert_eq!(c.rotary.base, 500000.0);
    assert_eq!(c.rotary.scaling.unwrap().factor, 8.0);
}
