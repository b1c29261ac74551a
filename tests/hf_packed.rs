//! Packed documents against Hugging Face transformers (`tools/golden/hf_packed.py`,
//! `tests/data/hf/*/packed.json`): the tiny random Llama and Qwen3 of tests/data/hf, imported,
//! run three documents packed into one sequence with their positions and attention reset at
//! each (`--reset-position-ids --reset-attention-mask`), and give each document the logits
//! transformers computes for it alone; the loss masked as the golden file says is transformers'
//! loss with labels −100 on the uncounted targets. At tp 1 and tp 2 with sequence parallelism.

mod support;

use std::path::Path;

use megatron::checkpoint::{load_params, open_checkpoint};
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::convert::hf_llama;
use megatron::documents::Documents;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module as _};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use megatron::training::LanguageModel;
use serde_json::Value;
use support::TempDir;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Logits `[s, vocab]` and per-token losses of the packed sequence, on a tp-way world.
fn packed(
    ckpt: &Path,
    config: &GptConfig,
    (tokens, targets): (&[i64], &[i64]),
    starts: &[usize],
    (tp, sp): (usize, bool),
) -> (Vec<f32>, Vec<f32>) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    launch(tp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(77, ps.groups()))?;
        load_params(&model, &open_checkpoint(&ps, ckpt)?)?;
        let docs = Documents::from_starts(tokens.len(), vec![starts.to_vec()], true, true)?;
        let cx = Cx::new(&ps, 0).eval();
        let cx = cx.with_documents(&docs);
        let ids = Tensor::from_slice(tokens, [tokens.len(), 1])?;
        let logits = megatron::generate::logits(&model, &cx, &ids)?.to_vec::<f32>()?;
        let targets = Tensor::from_slice(targets, [targets.len(), 1])?;
        let (losses, _) = model.losses(&cx, &ids, &targets)?;
        Ok((logits, losses.to_vec_f32()?))
    })
    .unwrap()
    .remove(0)
}

fn numbers(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(numbers).collect(),
        v => vec![v.as_f64().unwrap()],
    }
}

#[test]
fn packed_documents_give_transformers_logits_and_masked_loss_for_each_alone() {
    let dir = TempDir::new("hf-packed");
    for name in ["llama", "qwen3"] {
        let hf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/hf")
            .join(name);
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(hf.join("packed.json")).unwrap())
                .unwrap();
        let ckpt = dir.path().join(name);
        let config = hf_llama::import(&hf, &ckpt).unwrap().config;
        let docs: Vec<Vec<i64>> = golden["documents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                d.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_i64().unwrap())
                    .collect()
            })
            .collect();
        let counted: Vec<Vec<bool>> = golden["counted"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                d.as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c.as_u64() == Some(1))
                    .collect()
            })
            .collect();
        let tokens: Vec<i64> = docs.concat();
        // The target of each position is the next token of the packed sequence (the next
        // document's first, after a document's last: never counted).
        let mut targets: Vec<i64> = tokens[1..].to_vec();
        targets.push(0);
        let mut starts = Vec::new();
        let mut at = 0;
        for d in &docs[..docs.len() - 1] {
            at += d.len();
            starts.push(at);
        }
        let want_logits = numbers(&golden["logits"]);
        let scale = want_logits.iter().fold(0f64, |m, v| m.max(v.abs()));
        let mask: Vec<bool> = counted.concat();
        for layout in [(1, false), (2, false), (2, true)] {
            let (logits, losses) = packed(&ckpt, &config, (&tokens, &targets), &starts, layout);
            assert_eq!(logits.len(), want_logits.len(), "{name}");
            for (i, (got, want)) in logits.iter().zip(&want_logits).enumerate() {
                assert!(
                    (f64::from(*got) - want).abs() <= 1e-5 * scale,
                    "{name} {layout:?} logit {i}: {got} vs {want}"
                );
            }
            let (sum, n) = losses
                .iter()
                .zip(&mask)
                .filter(|(_, m)| **m)
                .fold((0f64, 0usize), |(s, n), (l, _)| (s + f64::from(*l), n + 1));
            let want = golden["masked_mean_loss"].as_f64().unwrap();
            assert!(
                (sum / n as f64 - want).abs() <= 1e-5 * want,
                "{name} {layout:?}: masked loss {} vs transformers' {want}",
                sum / n as f64
            );
        }
    }
}
