//! Fine-tuning an imported model on chat data, end to end on the CPU: a tiny random Llama that
//! Hugging Face transformers made (tests/data/chat/llama3: config.json, model.safetensors, and
//! Llama 3's chat template over a small stand-in tokenizer) is imported; conversations are
//! rendered with its chat template, only the assistant's answers counting, and packed whole into
//! sequences; the held-out loss is measured, the model fine-tuned at TP 2 with the per-token
//! loss, the held-out loss measured again (it falls), and the model asked a question in the
//! chat format (it answers, and stops at the end of its turn).
//!
//! ```sh
//! cargo run --release --example finetune_chat
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use megatron::chat::pack::Overlong;
use megatron::chat::prepare::{PrepareOptions, open_tokenizer, prepare};
use megatron::convert::hf_llama;
use megatron::data::{
    Blend, GptDatasetConfig, IndexedDataset, PackedDataset, SampleSource, Split, build_gpt_dataset,
};
use megatron::generate::{Sampling, generate};
use megatron::job::{Eval, PipelineSettings, Placement, TrainJob};
use megatron::models::GptConfig;
use megatron::optimizer::AdamWConfig;
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, MaskFlags, Sampler, TrainConfig};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const SEQ: usize = 64;
const STEPS: u64 = 120;

/// Questions (each asked in several wordings) and the answers the model is taught.
const FACTS: [(&str, &str); 4] = [
    ("what is two plus two", "four"),
    ("name a colour", "blue"),
    ("count to three", "one two three"),
    ("hello", "hi how can i help"),
];

/// Writes `n` conversations (the `k`-th wording of each question from `first` on).
fn conversations(path: &Path, n: usize, first: usize) -> R<()> {
    let wordings = ["", " please", " the quick brown fox", " now"];
    let lines: String = (0..n)
        .map(|i| {
            let (q, a) = FACTS[i % FACTS.len()];
            let w = wordings[(first + i / FACTS.len()) % wordings.len()];
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("{q}{w}")},
                {"role": "assistant", "content": a},
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(path, lines)?;
    Ok(())
}

/// A run of `config` loaded from `load`: training on `train` (or only evaluating) at `tp`, the
/// held-out set `held` evaluated whole at the end.
fn job(
    config: &GptConfig,
    load: &Path,
    train: Sampler,
    held: Sampler,
    steps: u64,
    tp: usize,
) -> TrainJob {
    TrainJob {
        model_name: "llama (transformers)".into(),
        model: config.clone(),
        tp,
        sequence_parallel: tp > 1,
        cp: 1,
        cp_comm_type: Default::default(),
        ep: 1,
        etp: 1,
        dp: 1,
        pipeline: PipelineSettings::default(),
        steps,
        train_data: train,
        eval: Some(Eval {
            iters: (held.source().len() / held.plan().global_batch) as u64,
            data: held,
            interval: if steps == 0 { 0 } else { steps },
        }),
        train: TrainConfig {
            schedule: LrSchedule {
                max_lr: 3e-3,
                min_lr: 3e-4,
                warmup_steps: 10,
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
        save: None,
        load: Some(load.to_path_buf()),
        run_info: serde_json::json!({}),
        files: Vec::new(),
        device: Placement::Cpu,
        cuda_graph_scope: megatron::cuda_graphs::ScopeSet::NONE,
        ddp: Default::default(),
        stop: None,
        rank_steps: None,
        trace: None,
    }
}

fn main() -> R<()> {
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat/llama3");
    let dir: PathBuf =
        std::env::temp_dir().join(format!("megatron-finetune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;

    // Import, and prepare the conversations with the model's own chat template.
    let base = dir.join("base");
    let config = hf_llama::import(&hf, &base)?.config;
    println!(
        "imported {}: {} layers, hidden {}, {} heads in {} groups, vocabulary {}",
        hf.display(),
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.query_groups(),
        config.vocab_size
    );
    let options = PrepareOptions {
        seq_length: SEQ,
        answer_only: true,
        add_generation_prompt: false,
        overlong: Overlong::Error,
        pack: true,
        pad_to_multiple_of: 1,
        workers: 2,
    };
    conversations(&dir.join("train.jsonl"), 240, 0)?;
    conversations(&dir.join("held.jsonl"), 24, 3)?;
    for name in ["train", "held"] {
        let done = prepare(
            &dir.join(format!("{name}.jsonl")),
            &hf,
            &dir.join(name),
            options,
        )?;
        println!(
            "{name}: {} conversations packed into {} sequences of {} tokens ({:.0}% filled), {} \
             tokens counted (the answers)",
            done.conversations,
            done.packing.bins.len(),
            done.capacity,
            100.0 * done.packing.fill(done.capacity),
            done.counted
        );
    }

    // The samples: packed sequences with their masks and documents; the per-token loss.
    let plan = BatchPlan {
        seq_length: SEQ,
        micro_batch: 2,
        global_batch: 8,
        dp: 1,
    };
    let masks = MaskFlags {
        calculate_per_token_loss: true,
        ..MaskFlags::default()
    };
    let train_set = build_gpt_dataset(
        &Blend::single(Arc::new(IndexedDataset::open(dir.join("train"))?)),
        &GptDatasetConfig::new(SEQ, 1234),
        Split::Train,
        Some(STEPS * plan.global_batch as u64),
    )?
    .ok_or("the training split is empty")?;
    let held: Arc<dyn SampleSource> = Arc::new(PackedDataset::in_order(
        Arc::new(IndexedDataset::open(dir.join("held"))?),
        SEQ,
        plan.global_batch,
    )?);
    let train = Sampler::new(train_set, plan)?.with_masks(masks)?;
    let held = Sampler::new(held, plan)?.with_masks(masks)?;

    let before = job(&config, &base, train.clone(), held.clone(), 0, 1).run(&mut [])?;
    let before = before.evals[0];
    println!(
        "before: held-out loss {:.3} over {} counted tokens (perplexity {:.1})",
        before.loss,
        before.counted,
        before.perplexity()
    );

    let mut tuning = job(&config, &base, train, held, STEPS, 2);
    let tuned = dir.join("tuned");
    tuning.save = Some((tuned.clone(), STEPS));
    let done = tuning.run(&mut [])?;
    let after = done.evals[0];
    println!(
        "fine-tuned {STEPS} steps at TP 2 + SP (loss {:.3} → {:.3}); held-out loss {:.3} \
         (perplexity {:.1})",
        done.steps.first().map_or(f64::NAN, |s| s.0),
        done.steps.last().map_or(f64::NAN, |s| s.0),
        after.loss,
        after.perplexity()
    );
    if after.loss >= before.loss {
        return Err(format!(
            "the held-out loss did not fall: {:.3} → {:.3}",
            before.loss, after.loss
        )
        .into());
    }

    // Ask in the chat format: the question as a user turn with the generation prompt; the
    // answer ends at the template's end-of-turn token.
    let (tokenizer, template) = open_tokenizer(&hf)?;
    let end = template
        .special_token("eos_token")
        .and_then(|t| tokenizer.token_id(t));
    let greedy = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let mut right = 0;
    for (q, a) in FACTS {
        let turn = serde_json::json!({"role": "user", "content": q});
        let prompt = tokenizer.encode(&template.render(&[turn], None, true)?)?;
        let reply = generate(&tuned, 1, &prompt, 12, greedy, end)?;
        let ended = reply.last().copied() == end && end.is_some();
        let text = tokenizer.decode(
            reply
                .strip_suffix(&[end.unwrap_or(u32::MAX)])
                .unwrap_or(&reply),
        )?;
        println!(
            "  user: {q:<22} assistant: {text:?}{}",
            if ended { " ⏎ (end of turn)" } else { "" }
        );
        right += usize::from(text.trim() == a && ended);
    }
    println!(
        "{right} of {} answers as taught, each ending its turn",
        FACTS.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
