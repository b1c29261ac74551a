//! LoRA on an imported model, end to end on the CPU: a tiny random Llama that Hugging Face
//! transformers made (tests/data/hf/llama: grouped-query attention, Llama 3.1's RoPE, untied)
//! is imported; rank-8 adapters are trained beside its linear_qkv, linear_proj, linear_fc1 and
//! linear_fc2 with the base frozen, on one rank and at tensor parallelism 2 with sequence
//! parallelism (the adapters split as Megatron-Bridge splits them: docs/expanded-lora.md), step
//! by step alike; the state each rank holds is reported (the frozen base: its values alone);
//! the adapters are written as PEFT's adapter for the transformers base, and merged into the
//! weights as a plain Hugging Face model.
//!
//! ```sh
//! cargo run --release --example lora
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use megatron::convert::{self, ExportOptions};
use megatron::data::{
    Blend, DType, GptDatasetConfig, IndexedDataset, IndexedDatasetBuilder, Split, build_gpt_dataset,
};
use megatron::job::{PipelineSettings, Placement, Summary, TrainJob};
use megatron::models::GptConfig;
use megatron::optimizer::AdamWConfig;
use megatron::tensor_parallel::lora::LoraConfig;
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TrainConfig};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const SEQ: usize = 32;
const STEPS: u64 = 60;

/// Documents of a few phrases over the model's 64 tokens, for the adapters to learn.
fn dataset(prefix: &Path) -> R<()> {
    let mut b = IndexedDatasetBuilder::create(prefix, DType::U16)?;
    for d in 0..256u32 {
        let tokens: Vec<u32> = (0..128u32)
            .map(|j| (d % 8 * 7 + (j % 12) * 5) % 64)
            .collect();
        b.add_document(&tokens, &[tokens.len()])?;
    }
    b.finish()?;
    Ok(())
}

/// `STEPS` steps of LoRA on `config` loaded from `base` at `tp` (with sequence parallelism
/// above 1), saved into `save`.
fn fine_tune(
    config: &GptConfig,
    base: &Path,
    data: &Sampler,
    tp: usize,
    save: &Path,
) -> R<Summary> {
    let job = TrainJob {
        model_name: "llama (transformers) + LoRA".into(),
        model: config.clone(),
        tp,
        sequence_parallel: tp > 1,
        cp: 1,
        cp_comm_type: Default::default(),
        ep: 1,
        etp: 1,
        dp: 1,
        pipeline: PipelineSettings::default(),
        steps: STEPS,
        train_data: data.clone(),
        eval: None,
        train: TrainConfig {
            schedule: LrSchedule {
                max_lr: 1e-2,
                min_lr: 1e-3,
                warmup_steps: 5,
                decay_steps: STEPS,
                style: DecayStyle::Cosine,
            },
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            seed: 1234,
            bucket_elements: 1 << 20,
            distributed_optimizer: false,
            recompute: megatron::module::Recompute::Off,
            precision: megatron::optimizer::Precision::FP32,
            check_for_nan: true,
        },
        save: Some((save.to_path_buf(), STEPS)),
        load: Some(base.to_path_buf()),
        run_info: serde_json::json!({}),
        files: Vec::new(),
        device: Placement::Cpu,
        cuda_graph_scope: megatron::cuda_graphs::ScopeSet::NONE,
        ddp: Default::default(),
        stop: None,
        rank_steps: None,
        trace: None,
    };
    Ok(job.run(&mut [])?)
}

fn main() -> R<()> {
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf/llama");
    let dir: PathBuf = std::env::temp_dir().join(format!("megatron-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;

    let base = dir.join("base");
    let mut config = convert::import_hf(&hf, &base, false)?.config;
    println!(
        "imported {}: {} layers, hidden {}, {} heads in {} groups, vocabulary {}",
        hf.display(),
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.query_groups(),
        config.vocab_size
    );
    config.lora = Some(LoraConfig {
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
        targets: ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
            .map(String::from)
            .to_vec(),
    });

    dataset(&dir.join("tokens"))?;
    let plan = BatchPlan {
        seq_length: SEQ,
        micro_batch: 2,
        global_batch: 8,
        dp: 1,
    };
    let set = build_gpt_dataset(
        &Blend::single(Arc::new(IndexedDataset::open(dir.join("tokens"))?)),
        &GptDatasetConfig::new(SEQ, 1234),
        Split::Train,
        Some(STEPS * plan.global_batch as u64),
    )?
    .ok_or("the training split is empty")?;
    let data = Sampler::new(set, plan)?;

    let one = fine_tune(&config, &base, &data, 1, &dir.join("lora-tp1"))?;
    let two = fine_tune(&config, &base, &data, 2, &dir.join("lora-tp2"))?;
    let mut worst = 0f64;
    for (a, b) in one.steps.iter().zip(&two.steps) {
        worst = worst.max((a.0 - b.0).abs() / a.0);
    }
    println!(
        "LoRA rank 8 (α 16), {STEPS} steps: loss {:.3} → {:.3} on one rank; at TP 2 + SP \
         {:.3} → {:.3}, every step within {worst:.1e} of one rank's",
        one.steps[0].0,
        one.steps[one.steps.len() - 1].0,
        two.steps[0].0,
        two.steps[two.steps.len() - 1].0
    );
    if worst > 1e-4 || one.steps[one.steps.len() - 1].0 >= one.steps[0].0 {
        return Err("TP 2 did not follow one rank, or the loss did not fall".into());
    }
    for (tp, run) in [(1, &one), (2, &two)] {
        let s = run.state;
        println!(
            "  TP {tp}, rank 0: {} parameters, {} frozen at {:.1} bytes each; the {} adapter \
             parameters at {:.1} bytes each (values, gradients, Adam's moments)",
            s.params,
            s.frozen_params,
            s.frozen as f64 / s.frozen_params.max(1) as f64,
            s.params - s.frozen_params,
            (s.total() - s.frozen) as f64 / (s.params - s.frozen_params).max(1) as f64
        );
    }

    let peft = dir.join("peft");
    let (_, n) = convert::peft::export(&dir.join("lora-tp2"), &peft, &ExportOptions::default())?;
    println!(
        "wrote {} ({n} tensors): PEFT's adapter_config.json and adapter_model.safetensors, for \
         `PeftModel.from_pretrained` on {}",
        peft.display(),
        hf.display()
    );
    let merged = dir.join("merged");
    let options = ExportOptions {
        merge_lora: true,
        ..ExportOptions::default()
    };
    let done = convert::export_hf(&dir.join("lora-tp2"), &merged, false, &options)?;
    println!(
        "wrote {} as a Hugging Face {} with the adapters merged (W + (α/r)·B·A)",
        merged.display(),
        done.arch
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
