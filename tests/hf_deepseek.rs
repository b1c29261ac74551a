//! Hugging Face's `DeepseekV3ForCausalLM` against transformers itself: a tiny random DeepSeek-V3
//! (a query latent, YaRN with the scores scaled, interleaved rotary pairs, a dense first layer,
//! group-limited sigmoid routing with the correction bias, scaled, beside a shared expert) and
//! a Moonlight-shaped one (no query latent, no YaRN, two shared experts, no groups), made and
//! saved by transformers 5.24 (`tools/golden/hf_llama.py`, `tests/data/hf/`). Each is
//! imported, gives transformers' logits at tp 1 and tp 2, continues a prompt greedily as
//! transformers does (with MLA's compressed cache), trains, and exports back to the same
//! tensors bit for bit and a config transformers reads as the same model; what the converter
//! cannot honour is refused by name.

mod support;

use megatron::convert::hf_deepseek;
use support::hf::{
    assert_exported_tensors, assert_greedy, assert_transformers_logits, golden, tensors,
};
use support::{TempDir, megatron, token_dataset};

#[test]
fn imported_deepseek_v3_and_moonlight_give_transformers_logits_and_export_back() {
    let dir = TempDir::new("hf-deepseek");
    for name in ["deepseek_v3", "moonlight"] {
        let hf = golden(name);
        let ckpt = dir.path().join(format!("{name}-ckpt"));
        let done = hf_deepseek::import(&hf, &ckpt).unwrap();
        // transformers saves no multi-token prediction layer, whatever the config declares.
        if name == "deepseek_v3" {
            assert!(
                done.skipped
                    .iter()
                    .any(|s| s.contains("declares 1 depth(s)")),
                "{:?}",
                done.skipped
            );
        }
        let config = done.config;
        assert_eq!(config.mtp, None, "{name}");
        assert!(config.mla.is_some() && config.rotary.interleaved, "{name}");
        assert_transformers_logits(name, &ckpt, &config);
        // Greedy generation with the compressed cache (the latents and rotary keys, the
        // absorbed up-projection) continues the prompt as transformers' generate does.
        assert_greedy(name, &ckpt);
        // Back to Hugging Face: the same tensors, bit for bit.
        let out = dir.path().join(format!("{name}-hf"));
        let arch = hf_deepseek::export(&ckpt, &out, &Default::default())
            .unwrap()
            .arch;
        assert_eq!(arch, "DeepseekV3ForCausalLM");
        assert_exported_tensors(name, &out);
        let config_out: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let same = hf_deepseek::config_from_hf(&config_out).unwrap();
        assert_eq!(same, config, "{name}");
    }
}

/// The golden DeepSeek-V3 with the multi-token prediction layer DeepSeek ships after the
/// layers (`model.layers.2.*`: its norms, `eh_proj`, a layer like the last with other values,
/// `shared_head.norm`, and copies of the embedding and the output layer), written to `dir`.
fn with_mtp_layer(dir: &std::path::Path) {
    use safetensors::tensor::TensorView;
    let golden = golden("deepseek_v3");
    std::fs::create_dir_all(dir).unwrap();
    for file in ["config.json", "generation_config.json"] {
        std::fs::copy(golden.join(file), dir.join(file)).unwrap();
    }
    let bytes = std::fs::read(golden.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut added: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(rest) = name.strip_prefix("model.layers.1.") {
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| 0.5 * f32::from_le_bytes([b[0], b[1], b[2], b[3]]) + 0.01)
                .collect();
            added.push((
                format!("model.layers.2.{rest}"),
                view.shape().to_vec(),
                f32s(values),
            ));
        }
    }
    let h = 32;
    for (name, shape, salt) in [
        ("enorm.weight", vec![h], 1),
        ("hnorm.weight", vec![h], 2),
        ("eh_proj.weight", vec![h, 2 * h], 3),
        ("shared_head.norm.weight", vec![h], 4),
    ] {
        let n = shape.iter().product();
        added.push((
            format!("model.layers.2.{name}"),
            shape,
            f32s(support::values(n, salt, 0.1)),
        ));
    }
    for (copy, of) in [
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("shared_head.head.weight", "lm_head.weight"),
    ] {
        let view = st.tensor(of).unwrap();
        added.push((
            format!("model.layers.2.{copy}"),
            view.shape().to_vec(),
            view.data().to_vec(),
        ));
    }
    let mut views: Vec<(String, TensorView)> = st.tensors();
    for (name, shape, data) in &added {
        views.push((
            name.clone(),
            TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap(),
        ));
    }
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

/// DeepSeek-V3's multi-token prediction layer imports as the model's depth (its norms, its
/// projection, its layer, its final norm), trains, and exports back to the same tensors bit
/// for bit, copies of the embedding and output layer included; copies that are not the
/// model's are refused by name.
#[test]
fn deepseek_v3s_multi_token_prediction_layer_imports_as_a_depth_and_exports_back() {
    let dir = TempDir::new("hf-deepseek-mtp");
    let hf = dir.path().join("hf");
    with_mtp_layer(&hf);
    let ckpt = dir.path().join("ckpt");
    let done = hf_deepseek::import(&hf, &ckpt).unwrap();
    assert_eq!(done.config.mtp_depths(), 1);
    assert!(done.skipped.is_empty(), "{:?}", done.skipped);
    let out = dir.path().join("out");
    hf_deepseek::export(&ckpt, &out, &Default::default()).unwrap();
    let (before, after) = (tensors(&hf), tensors(&out));
    assert_eq!(before.len(), after.len());
    for (name, value) in &before {
        assert_eq!(after.get(name), Some(value), "{name}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_nextn_predict_layers"], 1);
    // The depth trains with the imported model, its loss reported.
    let log = dir.join("log.jsonl");
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        ckpt.to_str().unwrap(),
        "--data",
        &token_dataset(&dir, 16, 64),
        "--train-iters",
        "1",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--dp",
        "2",
        "--ep",
        "2",
        "--log-json",
        &log,
    ]);
    assert!(ok, "{stderr}");
    let line = &support::log_lines(&log)[0];
    assert!(
        line["aux_losses"]["mtp_1"].as_f64().unwrap() > 0.0,
        "{line}"
    );
    // A depth with an embedding of its own cannot be held.
    support::edit_tensor(
        &hf.join("model.safetensors"),
        "model.layers.2.embed_tokens.weight",
        |mut b| {
            b[0] ^= 1;
            (safetensors::Dtype::F32, b)
        },
    );
    let err = hf_deepseek::import(&hf, &dir.path().join("ckpt2")).unwrap_err();
    assert!(
        format!("{err:#}").contains(
            "`model.layers.2.embed_tokens.weight` differs from model.embed_tokens.weight"
        ),
        "{err:#}"
    );
}

#[test]
fn an_imported_deepseek_v3_fine_tunes_at_tp_2_with_experts_split_and_exports() {
    let dir = TempDir::new("hf-deepseek-train");
    let ckpt = dir.join("ckpt");
    let trained = dir.join("trained");
    let out = dir.join("hf");
    let (ok, stdout, stderr) = megatron(&[
        "convert",
        "--from",
        "hf",
        golden("deepseek_v3").to_str().unwrap(),
        "--to",
        &ckpt,
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("DeepseekV3ForCausalLM"), "{stdout}");
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &ckpt,
        "--save",
        &trained,
        "--data",
        &token_dataset(&dir, 16, 64),
        "--train-iters",
        "3",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--tp",
        "2",
        "--sequence-parallel",
        "--ep",
        "2",
    ]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = megatron(&["convert", "--from", &trained, "--to", "hf", &out]);
    assert!(ok, "{stderr}");
    let before = tensors(&golden("deepseek_v3"));
    let after = tensors(std::path::Path::new(&out));
    assert_eq!(before.len(), after.len());
    let moved = before
        .iter()
        .filter(|(name, value)| after.get(*name) != Some(*value))
        .count();
    assert!(
        moved > before.len() / 2,
        "{moved} of {} moved",
        before.len()
    );
}

#[test]
fn what_the_converter_cannot_honour_is_refused_by_name() {
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden("deepseek_v3").join("config.json")).unwrap(),
    )
    .unwrap();
    for (key, value, message) in [
        (
            "quantization_config",
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
            "`quantization_config` (DeepSeek's FP8 release",
        ),
        (
            "num_key_value_heads",
            serde_json::json!(2),
            "`num_key_value_heads` 2 is not `num_attention_heads` 4",
        ),
        (
            "num_experts_per_tok",
            serde_json::json!(2),
            "transformers ranks each group by its best 2 scores",
        ),
        (
            "norm_topk_prob",
            serde_json::json!(false),
            "`norm_topk_prob` = false",
        ),
        (
            "qk_rope_head_dim",
            serde_json::json!(3),
            "`qk_rope_head_dim` 3: rotary embeddings turn pairs",
        ),
        (
            "attention_dropout",
            serde_json::json!(0.1),
            "`attention_dropout` 0.1",
        ),
        (
            "scoring_func",
            serde_json::json!("softmax"),
            "`scoring_func` softmax",
        ),
    ] {
        let mut config = base.clone();
        config[key] = value;
        let err = hf_deepseek::config_from_hf(&config)
            .unwrap_err()
            .to_string();
        assert!(err.contains(message), "{key}: {err}");
    }
    // A model the architecture cannot hold is not exported as one.
    let dir = TempDir::new("hf-deepseek-refuse");
    let ckpt = dir.join("ckpt");
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--model",
        "deepseek-v3-tiny",
        "--train-iters",
        "1",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--moe-expert-capacity-factor",
        "1.5",
        "--save",
        &ckpt,
    ]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = megatron(&["convert", "--from", &ckpt, "--to", "hf", &dir.join("hf")]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "DeepseekV3ForCausalLM cannot hold: an expert capacity (--moe-expert-capacity-factor"
        ),
        "{stderr}"
    );
}
