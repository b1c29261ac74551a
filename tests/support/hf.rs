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
