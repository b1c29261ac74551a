//! `megatron convert` as a user meets it (issue 45, classes 1 and 2): a checkpoint trained with
//! any of the Llama family's flags is exported as the Hugging Face architecture that holds it
//! exactly (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE), and imported back to the
//! same model, whose logits are bit for bit the trained model's; a model no architecture holds
//! is refused naming its features, with nothing written. Hugging Face configs and files are
//! read with the command line's bounds, each refusal naming the config's field; the index of
//! a sharded model decides which shard holds a tensor.
//!
//! That transformers runs each export as megatron-rs does (the same greedy tokens) is checked
//! by `tools/golden/hf_export.py`, which needs torch; the golden tests of `tests/hf_llama.rs`
//! hold the import side against transformers in CI.

mod support;

use std::path::Path;

use megatron::checkpoint::{load_params, open_checkpoint};
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module as _};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use serde_json::{Value, json};
use support::{TempDir, megatron, small_checkpoint};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The Llama family's flags on gpt-tiny.
const LLAMA: [&str; 6] = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--position-embedding-type",
    "rope",
];

/// A checkpoint's model config.
fn config_of(ckpt: &str) -> GptConfig {
    let meta = megatron::checkpoint::read_meta(Path::new(ckpt)).unwrap();
    serde_json::from_value(meta.model).unwrap()
}

/// The logits `[s, vocab]` of checkpoint `ckpt` for fixed tokens, on one rank.
fn logits(ckpt: &str) -> Vec<f32> {
    let config = config_of(ckpt);
    let vocab = config.vocab_size as i64;
    let tokens: Vec<i64> = (0..12).map(|i| (i * 37 + 5) % vocab).collect();
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<Vec<f32>> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(9, ps.groups()))?;
        load_params(&model, &open_checkpoint(&ps, Path::new(ckpt))?)?;
        let cx = Cx::new(&ps, 0).eval();
        let tokens = Tensor::from_slice(&tokens, [tokens.len(), 1])?;
        Ok(megatron::generate::logits(&model, &cx, &tokens)?.to_vec::<f32>()?)
    })
    .unwrap()
    .remove(0)
}

fn read_json(path: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_checkpoint_is_exported_as_the_architecture_that_holds_it_and_comes_back_the_same() {
    let dir = TempDir::new("cli-convert-export");
    let llama = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut flags = LLAMA.to_vec();
        flags.extend(extra);
        flags
    };
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("gpt2", vec![], "GPT2LMHeadModel"),
        (
            "gpt2-untied",
            vec!["--untie-embeddings-and-output-weights"],
            "GPT2LMHeadModel",
        ),
        (
            "llama",
            llama(&[
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--kv-channels",
                "16",
                "--untie-embeddings-and-output-weights",
            ]),
            "LlamaForCausalLM",
        ),
        ("qwen3", llama(&["--qk-layernorm"]), "Qwen3ForCausalLM"),
        ("qwen2", llama(&["--add-qkv-bias"]), "Qwen2ForCausalLM"),
        (
            "mistral",
            llama(&["--window-size", "5,0"]),
            "MistralForCausalLM",
        ),
        (
            "qwen3-window",
            llama(&[
                "--qk-layernorm",
                "--num-layers",
                "2",
                "--window-size",
                "5,0",
                "--window-attn-skip-freq",
                "2",
            ]),
            "Qwen3ForCausalLM",
        ),
        (
            "mixtral",
            vec!["--model", "mixtral-tiny"],
            "MixtralForCausalLM",
        ),
        (
            "qwen3-moe",
            vec![
                "--model",
                "mixtral-tiny",
                "--qk-layernorm",
                "--num-layers",
                "2",
                "--moe-layer-freq",
                "[0,1]",
            ],
            "Qwen3MoeForCausalLM",
        ),
    ];
    for (name, flags, want) in cases {
        let ckpt = dir.join(name);
        small_checkpoint(&ckpt, 1, &flags);
        let hf = dir.join(&format!("{name}-hf"));
        let (ok, stdout, stderr) = megatron(&["convert", "--from", &ckpt, "--to", "hf", &hf]);
        assert!(ok, "{name}: {stderr}");
        assert!(stdout.contains(want), "{name}: {stdout}");
        let config = read_json(&format!("{hf}/config.json"));
        assert_eq!(config["architectures"], json!([want]), "{name}");
        // The byte tokenizer's end-of-text id (256) is no token of a 256-token model.
        assert_eq!(config["eos_token_id"], Value::Null, "{name}");
        let back = dir.join(&format!("{name}-back"));
        let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &back]);
        assert!(ok, "{name}: {stderr}");
        let (a, b) = (config_of(&ckpt), config_of(&back));
        assert_eq!(
            (
                a.untie_embeddings_and_output_weights,
                a.qk_layernorm,
                a.add_qkv_bias
            ),
            (
                b.untie_embeddings_and_output_weights,
                b.qk_layernorm,
                b.add_qkv_bias
            ),
            "{name}"
        );
        assert_eq!(
            (a.window_size, &a.window_layers),
            (b.window_size, &b.window_layers)
        );
        assert_eq!(
            (a.head_dim(), a.query_groups()),
            (b.head_dim(), b.query_groups())
        );
        let (want_logits, got) = (logits(&ckpt), logits(&back));
        assert!(
            want_logits
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: the exported model computes other logits"
        );
    }
}

#[test]
fn a_model_no_architecture_holds_is_refused_by_its_features_with_nothing_written() {
    let dir = TempDir::new("cli-convert-refused");
    let swiglu = dir.join("swiglu");
    small_checkpoint(&swiglu, 1, &["--swiglu"]);
    let out = dir.join("swiglu-hf");
    let (ok, _, stderr) = megatron(&["convert", "--from", &swiglu, "--to", "hf", &out]);
    assert!(!ok);
    assert!(
        stderr.contains("no Hugging Face architecture holds this model"),
        "{stderr}"
    );
    assert!(stderr.contains("a SwiGLU MLP (--swiglu"), "{stderr}");
    assert!(
        stderr.contains("LayerNorm (the Llama family's norms are RMSNorm"),
        "{stderr}"
    );
    assert!(!Path::new(&out).exists(), "a refused export wrote {out}");
    // GPT-2 alone, asked of a Llama: the features named, and where it belongs.
    let llama = dir.join("llama");
    small_checkpoint(&llama, 1, &LLAMA);
    let (ok, _, stderr) = megatron(&["convert", "--from", &llama, "--to", "hf-gpt2", &out]);
    assert!(!ok);
    assert!(stderr.contains("the model is not a GPT-2"), "{stderr}");
    assert!(
        stderr.contains("RMSNorm (--normalization RMSNorm"),
        "{stderr}"
    );
    assert!(
        stderr.contains("it is a LlamaForCausalLM: convert with --to hf"),
        "{stderr}"
    );
    assert!(!Path::new(&out).exists());
    // Grouped-query attention and other head sizes on a GPT-2: named, not a panic.
    let gqa = dir.join("gqa");
    small_checkpoint(
        &gqa,
        1,
        &[
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--kv-channels",
            "16",
        ],
    );
    let (ok, _, stderr) = megatron(&["convert", "--from", &gqa, "--to", "hf", &out]);
    assert!(!ok);
    assert!(
        stderr.contains("grouped-query attention (2 key/value heads for 4"),
        "{stderr}"
    );
    assert!(
        stderr.contains("heads of 16 channels (--kv-channels"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A copy of golden model `name`'s directory in `dir`, with `edit` applied to its config.
fn edited(dir: &TempDir, name: &str, out: &str, edit: impl FnOnce(&mut Value)) -> String {
    let src = format!("{}/tests/data/hf/{name}", env!("CARGO_MANIFEST_DIR"));
    let dst = dir.join(out);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), Path::new(&dst).join(entry.file_name())).unwrap();
    }
    let path = format!("{dst}/config.json");
    let mut config = read_json(&path);
    edit(&mut config);
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    dst
}

/// An edit of a config.
type Edit = Box<dyn FnOnce(&mut Value)>;

#[test]
fn hugging_face_configs_are_bounded_as_the_command_line_and_name_their_fields() {
    let dir = TempDir::new("cli-convert-configs");
    let cases: Vec<(&str, &str, Edit, &str)> = vec![
        (
            "qwen3",
            "eps",
            Box::new(|c| c["rms_norm_eps"] = json!(-1.0)),
            "`rms_norm_eps` -1 must be more than 0",
        ),
        (
            "qwen3",
            "eps-string",
            Box::new(|c| c["rms_norm_eps"] = json!("1e-5")),
            "`rms_norm_eps` is the string \"1e-5\", not a number",
        ),
        (
            "qwen3_moe",
            "topk0",
            Box::new(|c| c["num_experts_per_tok"] = json!(0)),
            "`num_experts_per_tok` 0 must be at least 1",
        ),
        (
            "qwen3_moe",
            "topk-above",
            Box::new(|c| c["num_experts_per_tok"] = json!(5)),
            "`num_experts_per_tok` 5 is more than the 4 experts",
        ),
        (
            "llama",
            "rope-factor",
            Box::new(|c| c["rope_parameters"]["factor"] = json!(-8.0)),
            "rope `factor` -8 must be more than 0",
        ),
        (
            "qwen3",
            "positions",
            Box::new(|c| c["max_position_embeddings"] = json!((1 << 24) + 1)),
            "`max_position_embeddings` 16777217 is more than megatron-rs accepts (at most \
             16777216",
        ),
        (
            "qwen3",
            "layers",
            Box::new(|c| c["num_hidden_layers"] = json!(1_000_000_000_000u64)),
            "`num_hidden_layers` 1000000000000 is more than megatron-rs accepts",
        ),
        (
            "qwen3",
            "kv-heads",
            Box::new(|c| c["num_key_value_heads"] = json!(0)),
            "`num_key_value_heads` 0 must be at least 1",
        ),
        (
            "qwen3",
            "head-dim",
            Box::new(|c| c["head_dim"] = json!(0)),
            "`head_dim` 0 must be at least 1",
        ),
        (
            "llama",
            "two-architectures",
            Box::new(|c| c["model_type"] = json!("gpt2")),
            "`model_type` \"gpt2\" is not LlamaForCausalLM's",
        ),
        (
            "llama",
            "no-architecture",
            Box::new(|c| {
                let c = c.as_object_mut().unwrap();
                c.remove("architectures");
                c.remove("model_type");
            }),
            "names no architecture",
        ),
    ];
    for (golden, name, edit, want) in cases {
        let hf = edited(&dir, golden, name, edit);
        let out = dir.join(&format!("{name}-ckpt"));
        let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &out]);
        assert!(!ok, "{name} was accepted");
        assert!(stderr.contains(want), "{name}: {stderr}");
        // The refusal names the file's field, never a flag the user did not give.
        let reason = &stderr[stderr.find("config.json").unwrap_or(0)..];
        assert!(!reason.contains(" --"), "{name} names a flag: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("memory allocation"));
        assert!(!Path::new(&out).exists(), "{name}: wrote {out}");
    }
    // Without `architectures`, `model_type` names the architecture (not GPT-2 by default).
    let hf = edited(&dir, "qwen3", "model-type-only", |c| {
        c.as_object_mut().unwrap().remove("architectures");
    });
    let out = dir.join("model-type-only-ckpt");
    let (ok, stdout, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &out]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("Qwen3ForCausalLM"), "{stdout}");
}

#[test]
fn the_index_decides_which_shard_holds_a_tensor_and_a_tensor_twice_is_refused() {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = TempDir::new("cli-convert-shards");
    // A stray copy of a tensor in a later shard, which the index does not name there: the
    // index's copy is the model's (as transformers loads it).
    let hf = edited(&dir, "llama", "stray", |_| {});
    let index = read_json(&format!("{hf}/model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let (name, shard) = map
        .iter()
        .find(|(_, s)| s.as_str() == Some("model-00001-of-00004.safetensors"))
        .unwrap();
    let last = "model-00004-of-00004.safetensors";
    assert_ne!(shard.as_str(), Some(last));
    let (shape, len) = {
        let first = std::fs::read(format!("{hf}/{}", shard.as_str().unwrap())).unwrap();
        let first = safetensors::SafeTensors::deserialize(&first).unwrap();
        let t = first.tensor(name).unwrap();
        (t.shape().to_vec(), t.data().len())
    };
    let zeros = vec![0u8; len];
    let path = format!("{hf}/{last}");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView)> = st.tensors();
    tensors.push((
        name.clone(),
        TensorView::new(Dtype::F32, shape, &zeros).unwrap(),
    ));
    std::fs::write(&path, safetensors::serialize(tensors, None).unwrap()).unwrap();
    let ckpt = dir.join("stray-ckpt");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &ckpt]);
    assert!(ok, "{stderr}");
    let clean = dir.join("clean-ckpt");
    let golden = format!("{}/tests/data/hf/llama", env!("CARGO_MANIFEST_DIR"));
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &golden, "--to", &clean]);
    assert!(ok, "{stderr}");
    assert!(
        logits(&ckpt)
            .iter()
            .zip(logits(&clean))
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the stray copy replaced the index's"
    );
    // A GPT-2 file holding a tensor under both of its names.
    let gpt2 = dir.join("gpt2-ckpt");
    small_checkpoint(&gpt2, 1, &[]);
    let hf = dir.join("gpt2-hf");
    let (ok, _, stderr) = megatron(&["convert", "--from", &gpt2, "--to", "hf", &hf]);
    assert!(ok, "{stderr}");
    let path = format!("{hf}/model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView)> = st.tensors();
    let wte = st.tensor("transformer.wte.weight").unwrap();
    tensors.push(("wte.weight".to_string(), wte));
    std::fs::write(&path, safetensors::serialize(tensors, None).unwrap()).unwrap();
    let out = dir.join("twice-ckpt");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &out]);
    assert!(!ok);
    assert!(stderr.contains("are both `wte.weight`"), "{stderr}");
}
