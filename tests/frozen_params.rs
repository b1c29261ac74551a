//! Frozen parameters (issue 48): a frozen parameter has no gradient, no optimizer state and no
//! part in the reductions or the gradient norm, and keeps its values; the trainable ones get
//! exactly the gradients they get when nothing is frozen (the input gradients still flow
//! through the frozen layers), at every layout as on one rank; a checkpoint holds both and
//! loads them back at another layout.

mod support;

use std::collections::BTreeMap;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module, ParamSpec};
use megatron::optimizer::Precision;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, Trainer};
use support::{TempDir, llama_like, train_config};

/// The parameters these tests freeze: the embedding and every attention layer.
fn frozen(spec: &ParamSpec) -> bool {
    spec.name.starts_with("wte.weight") || spec.name.contains(".attn.")
}

/// What a run saw: each step's loss and gradient norm, the first step's gradients by
/// parameter name (rank 0's local parts), the frozen parameters' local values before and
/// after, and the state's bytes.
#[derive(Debug, Clone, Default)]
struct Run {
    curve: Vec<(f64, f64)>,
    first_grads: BTreeMap<String, Vec<f32>>,
    frozen_before: BTreeMap<String, Vec<f32>>,
    frozen_after: BTreeMap<String, Vec<f32>>,
    frozen_bytes: usize,
    grad_bytes: usize,
}

fn run(
    (tp, dp): (usize, usize),
    sequence_parallel: bool,
    distributed_optimizer: bool,
    freeze: bool,
    save: Option<&str>,
) -> Run {
    run_in(
        (tp, dp),
        sequence_parallel,
        distributed_optimizer,
        freeze,
        save,
        Precision::FP32,
    )
}

fn run_in(
    (tp, dp): (usize, usize),
    sequence_parallel: bool,
    distributed_optimizer: bool,
    freeze: bool,
    save: Option<&str>,
    precision: Precision,
) -> Run {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp)).unwrap();
    let text = "Megatron-LM splits each transformer layer over tensor-parallel ranks. ".repeat(30);
    type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
    launch(tp * dp, |w| -> R<Run> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sequence_parallel);
        let mut model = Gpt::build(
            &llama_like(0.0).spec(),
            &mut Builder::for_rank(17, ps.groups()),
        )?;
        let mut out = Run::default();
        if freeze {
            assert!(model.freeze(&frozen) > 0);
        }
        model.visit_frozen_params(&mut |p| {
            out.frozen_before
                .insert(p.spec().name.clone(), p.value().to_vec_f32().unwrap());
        });
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: 16,
                micro_batch: 2,
                global_batch: 8,
                dp,
            },
            3,
        )?;
        let schedule = LrSchedule {
            max_lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 1,
            decay_steps: 3,
            style: DecayStyle::Cosine,
        };
        let config = megatron::training::TrainConfig {
            clip_grad: 0.0,
            distributed_optimizer,
            precision,
            ..train_config(schedule, 9, 10_000)
        };
        let mut trainer = Trainer::new(model, &ps, sampler, config)?;
        for s in 0..3 {
            let m = trainer.step(&ps, s)?;
            out.curve.push((m.loss, m.grad_norm));
            if s == 0 {
                let grads = trainer.buffers().grads();
                for slot in trainer.buffers().slots() {
                    let g = grads.narrow(0, slot.offset, slot.len)?.to_vec_f32()?;
                    out.first_grads.insert(slot.spec.name.clone(), g);
                }
            }
        }
        trainer.model().visit_frozen_params(&mut |p| {
            out.frozen_after
                .insert(p.spec().name.clone(), p.value().to_vec_f32().unwrap());
        });
        let state = trainer.state_memory();
        (out.frozen_bytes, out.grad_bytes) = (state.frozen, state.grads);
        if let Some(save) = save {
            let info = megatron::checkpoint::SaveInfo {
                model: serde_json::to_value(llama_like(0.0))?,
                run: serde_json::json!({}),
                files: Vec::new(),
                base: None,
            };
            trainer.save_checkpoint(&ps, std::path::Path::new(save), 3, &info)?;
        }
        Ok(out)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn frozen_parameters_keep_their_values_and_the_others_train_as_without_them() {
    let full = run((1, 1), false, false, false, None);
    let one = run((1, 1), false, false, true, None);
    // The trainable parameters' first gradients are the full model's, bit for bit: freezing
    // skips the frozen weights' gradient passes, not the input gradients through them.
    assert!(!one.first_grads.is_empty());
    let mut norm = 0f64;
    for (name, g) in &one.first_grads {
        assert!(
            !name.contains(".attn.") && name != "wte.weight",
            "{name} has a gradient"
        );
        assert_eq!(g, &full.first_grads[name], "{name}");
        norm += g.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
    }
    // The norm counts the trainable parameters alone.
    let (loss, grad_norm) = one.curve[0];
    assert_eq!(loss, full.curve[0].0);
    assert!(
        (grad_norm - norm.sqrt()).abs() <= 1e-6 * grad_norm,
        "{grad_norm} vs {}",
        norm.sqrt()
    );
    assert!(grad_norm < full.curve[0].1);
    // Frozen values never move; no gradient is kept for them.
    assert!(!one.frozen_before.is_empty());
    assert_eq!(one.frozen_before, one.frozen_after);
    let frozen_elements: usize = one.frozen_before.values().map(Vec::len).sum();
    assert_eq!(one.frozen_bytes, 4 * frozen_elements);
    assert!(one.grad_bytes < full.grad_bytes);
    // Every layout trains as one rank.
    let dir = TempDir::new("frozen-params");
    let save = dir.join("ckpt");
    for ((tp, dp), sp, dist) in [
        ((2, 1), true, false),
        ((1, 2), false, true),
        ((2, 2), true, true),
    ] {
        let here = ((tp, dp) == (2, 2)).then_some(save.as_str());
        let got = run((tp, dp), sp, dist, true, here);
        for (step, (g, w)) in got.curve.iter().zip(&one.curve).enumerate() {
            let what = format!("tp {tp} dp {dp} step {step}: {g:?} vs {w:?}");
            assert!((g.0 - w.0).abs() <= 1e-5 * w.0, "{what}");
            assert!((g.1 - w.1).abs() <= 1e-4 * w.1, "{what}");
        }
        assert_eq!(got.frozen_before, got.frozen_after, "tp {tp} dp {dp}");
    }
    // In bf16 a frozen parameter is its bf16 value alone: 2 bytes.
    let flags = megatron::optimizer::PrecisionFlags {
        bf16: true,
        ..Default::default()
    };
    let bf16 = run_in(
        (1, 2),
        false,
        true,
        true,
        None,
        Precision::from_flags(&flags).unwrap(),
    );
    assert_eq!(bf16.frozen_bytes, 2 * frozen_elements);
    // The checkpoint holds the frozen parameters, whole (the layout-invariant initial values).
    let loaded = megatron::checkpoint::open(std::path::Path::new(&save)).unwrap();
    for (name, values) in &one.frozen_before {
        assert_eq!(&loaded.model_tensor(name).unwrap().data, values, "{name}");
    }
}
