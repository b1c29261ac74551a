//! Hugging Face golden directories (`tests/data/hf/`, made by transformers through
//! `tools/golden/`) and what the tests read of them: a checkpoint's logits on thread ranks, and
//! every tensor of a directory as bits.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use megatron::checkpoint::{load_params, open_checkpoint};
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module as _};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use safetensors::SafeTensors;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The golden directory `name`.
pub fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf")
        .join(name)
}

/// Logits `[s, vocab]` of the checkpoint for one sequence on a tp-way world.
pub fn our_logits(ckpt: &Path, config: &GptConfig, tokens: &[i64], tp: usize) -> Vec<f32> {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    launch(tp, |w| -> R<Vec<f32>> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(77, ps.groups()))?;
        load_params(&model, &open_checkpoint(&ps, ckpt)?)?;
        let cx = Cx::new(&ps, 0).eval();
        let tokens = Tensor::from_slice(tokens, [tokens.len(), 1])?;
        Ok(megatron::generate::logits(&model, &cx, &tokens)?.to_vec::<f32>()?)
    })
    .unwrap()
    .remove(0)
}

/// Every tensor of a Hugging Face directory (its shards too), as f32 bits.
pub fn tensors(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<u32>)> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let bits = view
                .data()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            out.insert(name.to_string(), (view.shape().to_vec(), bits));
        }
    }
    out
}

/// Golden `name`'s `reference.json`: transformers' tokens, logits and greedy continuation.
pub fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(golden(name).join("reference.json")).unwrap())
        .unwrap()
}

/// The token ids of `reference[key]`.
fn ids(reference: &serde_json::Value, key: &str) -> Vec<u32> {
    reference[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Asserts that checkpoint `ckpt` (model `config`) gives golden `name`'s logits at tp 1 and 2:
/// f32 both sides in other orders of sums (and transformers' rsqrt), to 1e-5 of the largest.
pub fn assert_transformers_logits(name: &str, ckpt: &Path, config: &GptConfig) {
    let reference = reference(name);
    let tokens: Vec<i64> = ids(&reference, "tokens")
        .iter()
        .map(|&t| t.into())
        .collect();
    let want: Vec<f64> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    for tp in [1, 2] {
        let ours = our_logits(ckpt, config, &tokens, tp);
        assert_eq!(ours.len(), want.len(), "{name}");
        let mut worst = 0f64;
        for (i, (got, w)) in ours.iter().zip(&want).enumerate() {
            let err = (f64::from(*got) - w).abs();
            assert!(
                err <= 1e-5 * scale,
                "{name} tp {tp} [{i}]: {got} vs {w} (scale {scale})"
            );
            worst = worst.max(err);
        }
        eprintln!("{name} tp {tp}: largest logit {scale:.3}, largest difference {worst:.2e}");
    }
}

/// Asserts that greedy generation from `ckpt` at tp 1 and 2 continues golden `name`'s prompt
/// as transformers' generate did (its KV cache against ours).
pub fn assert_greedy(name: &str, ckpt: &Path) {
    let reference = reference(name);
    let greedy = megatron::generate::Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let want = ids(&reference, "greedy");
    for tp in [1, 2] {
        let got = megatron::generate::generate(
            ckpt,
            tp,
            &ids(&reference, "prompt"),
            want.len(),
            greedy,
            None,
        )
        .unwrap();
        assert_eq!(got, want, "{name} greedy at tp {tp}");
    }
}

/// Asserts that the export `out` holds golden `name`'s tensors bit for bit (its `lm_head`
/// left out when its config ties it to the embedding), and nothing else.
pub fn assert_exported_tensors(name: &str, out: &Path) {
    let hf = golden(name);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    let written = tensors(out);
    let mut original = tensors(&hf);
    if config["tie_word_embeddings"].as_bool() == Some(true) {
        original.remove("lm_head.weight");
    }
    assert_eq!(written.len(), original.len(), "{name}");
    for (tensor, value) in &original {
        assert!(written.get(tensor) == Some(value), "{name}: {tensor}");
    }
}
