//! Training with 16-bit parameters (Megatron-LM's `--bf16`, `--fp16`): the buffers hold 16-bit
//! values (and 16-bit or f32 gradients), the optimizer f32 main parameters that the values are
//! rounded from after every update; fp16 scales the loss, dynamically as Megatron-LM's
//! `DynamicGradScaler` does, skipping the updates of steps whose gradients overflow. Checked
//! against the f32 run (close, not equal), the plain optimizer (the distributed one gives the
//! same run), the seed's bytes-per-parameter table, and a checkpoint's resume (bit for bit).

mod support;

use half::{bf16, f16};
use megatron::checkpoint::SaveInfo;
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module};
use megatron::optimizer::{Precision, PrecisionFlags};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::DType;
use megatron::training::{
    BatchPlan, DecayStyle, LrSchedule, Sampler, StateMemory, TokenStream, TrainConfig, Trainer,
};
use support::TempDir;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// One logged step: loss, gradient norm, skipped, loss scale.
type Step = (f64, f64, bool, Option<f64>);

/// What one run gives: its steps, rank 0's values (as f32) at the end, whether every value is
/// its main parameter rounded (checked on every rank after every step), and rank 0's state.
struct Outcome {
    steps: Vec<Step>,
    params: Vec<f32>,
    param_dtype: DType,
    grad_dtype: DType,
    state: StateMemory,
}

fn precision(flags: PrecisionFlags) -> Precision {
    Precision::from_flags(&flags).unwrap()
}

fn bf16() -> PrecisionFlags {
    PrecisionFlags {
        bf16: true,
        ..PrecisionFlags::default()
    }
}

fn fp16() -> PrecisionFlags {
    PrecisionFlags {
        fp16: true,
        ..PrecisionFlags::default()
    }
}

/// A run's settings.
#[derive(Clone)]
struct Run {
    hidden: usize,
    tp: usize,
    dp: usize,
    distopt: bool,
    precision: Precision,
    steps: u64,
    /// Save after this many steps into the directory, then load it into a fresh trainer and
    /// go on.
    resume: Option<(u64, std::path::PathBuf)>,
}

impl Run {
    fn new(tp: usize, dp: usize, distopt: bool, precision: Precision) -> Run {
        Run {
            hidden: 32,
            tp,
            dp,
            distopt,
            precision,
            steps: 5,
            resume: None,
        }
    }
}

/// Every value of the buffers equals the f32 main parameter it is rounded from.
fn assert_values_follow_main<M: megatron::training::LanguageModel>(trainer: &Trainer<M>) {
    let buffers = trainer.buffers();
    let values = buffers.values().to_vec_f32().unwrap();
    let Some(main) = trainer.optimizer().main_params() else {
        return;
    };
    let main = main.to_vec::<f32>().unwrap();
    let round = |x: f32| match buffers.values().dtype() {
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    };
    match trainer.optimizer().shard() {
        // The main parameters are laid out like the buffers.
        None => {
            for slot in buffers.slots() {
                for i in slot.range() {
                    assert_eq!(values[i], round(main[i]), "{} at {i}", slot.spec.name);
                }
            }
        }
        // Laid out like this rank's shards, one after the other.
        Some(rank) => {
            let mut at = 0;
            for (world, parts) in buffers.shards(rank) {
                for part in parts {
                    for i in part.range {
                        assert_eq!(values[i], round(main[at + i - world.start]), "at {i}");
                    }
                }
                at += world.len();
            }
        }
    }
}

fn train(run: &Run) -> Outcome {
    let (tp, dp) = (run.tp, run.dp);
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp)).unwrap();
    let mut config = GptConfig::new(2, run.hidden, 4, 256, 32);
    config.hidden_dropout = 0.1;
    config.attention_dropout = 0.1;
    let spec = config.spec();
    let text = "Mixed precision keeps f32 main parameters next to 16-bit ones. ".repeat(20);
    let mut out = launch(tp * dp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let make = || -> R<Trainer<Gpt>> {
            let model = Gpt::build(&spec, &mut Builder::for_rank(4, ps.groups()))?;
            let sampler = Sampler::windows(
                TokenStream::from_bytes(text.as_bytes()),
                BatchPlan {
                    seq_length: 16,
                    micro_batch: 1,
                    global_batch: 8,
                    dp,
                },
                5,
            )?;
            let train = TrainConfig {
                clip_grad: 0.5,
                distributed_optimizer: run.distopt,
                precision: run.precision,
                check_for_nan: false,
                ..support::train_config(
                    LrSchedule {
                        max_lr: 3e-3,
                        min_lr: 3e-4,
                        warmup_steps: 1,
                        decay_steps: run.steps,
                        style: DecayStyle::Cosine,
                    },
                    9,
                    3000,
                )
            };
            Ok(Trainer::new(model, &ps, sampler, train)?)
        };
        let mut trainer = make()?;
        let mut steps = Vec::new();
        for s in 0..run.steps {
            if let Some((at, dir)) = &run.resume
                && s == *at
            {
                let info = SaveInfo {
                    model: serde_json::json!({}),
                    run: serde_json::json!({}),
                    files: Default::default(),
                    base: None,
                };
                trainer.save_checkpoint(&ps, dir, s, &info)?;
                ps.comm(megatron::parallel::GroupKind::World).barrier()?;
                trainer = make()?;
                trainer.load_checkpoint(&ps, &dir.join(format!("iter_{s:07}")))?;
            }
            let before = trainer.buffers().values().to_vec_f32()?;
            let adam_steps = trainer.optimizer().steps();
            let m = trainer.step(&ps, s)?;
            if m.skipped {
                // A skipped step changes no parameter and no optimizer state.
                assert_eq!(trainer.buffers().values().to_vec_f32()?, before, "step {s}");
                assert_eq!(trainer.optimizer().steps(), adam_steps);
            }
            assert_values_follow_main(&trainer);
            steps.push((m.loss, m.grad_norm, m.skipped, m.loss_scale));
        }
        let mut params = Vec::new();
        trainer
            .model()
            .visit_params(&mut |p| params.extend(p.value().to_vec_f32().unwrap()));
        Ok(Outcome {
            steps,
            params,
            param_dtype: trainer.buffers().values().dtype(),
            grad_dtype: trainer.buffers().grads().dtype(),
            state: trainer.state_memory(),
        })
    })
    .unwrap();
    out.remove(0)
}

#[test]
fn sixteen_bit_parameters_train_close_to_f32_and_are_stored_in_16_bits() {
    let f32_run = train(&Run::new(1, 2, false, Precision::FP32));
    let cases = [
        ("bf16", precision(bf16()), DType::BF16, DType::F32),
        (
            "bf16 with bf16 gradients",
            precision(PrecisionFlags {
                grad_reduce_in_bf16: true,
                ..bf16()
            }),
            DType::BF16,
            DType::BF16,
        ),
        (
            "fp16 with a static scale",
            precision(PrecisionFlags {
                loss_scale: Some(1024.0),
                ..fp16()
            }),
            DType::F16,
            DType::F16,
        ),
    ];
    for (what, p, params, grads) in cases {
        let run = train(&Run::new(1, 2, false, p));
        assert_eq!((run.param_dtype, run.grad_dtype), (params, grads), "{what}");
        assert!(run.steps.iter().all(|s| !s.2), "{what}: {:?}", run.steps);
        // The first loss comes from the rounded initial parameters: close, not equal.
        for (i, (a, b)) in run.steps.iter().zip(&f32_run.steps).enumerate() {
            assert!(
                (a.0 - b.0).abs() < 0.02,
                "{what} step {i}: {} vs {}",
                a.0,
                b.0
            );
            assert!(
                (a.1 - b.1).abs() < 0.05 * b.1,
                "{what} step {i}: norm {} vs {}",
                a.1,
                b.1
            );
        }
        assert_ne!(run.params, f32_run.params, "{what}");
        // Every value is a 16-bit number.
        let exact = |x: &f32| match params {
            DType::BF16 => bf16::from_f32(*x).to_f32() == *x,
            _ => f16::from_f32(*x).to_f32() == *x,
        };
        assert!(run.params.iter().all(exact), "{what}");
    }
}

#[test]
fn the_distributed_optimizer_gives_the_same_16_bit_run() {
    let precisions = [
        precision(bf16()),
        precision(PrecisionFlags {
            grad_reduce_in_bf16: true,
            ..bf16()
        }),
        precision(PrecisionFlags {
            initial_loss_scale: Some(4096.0),
            ..fp16()
        }),
    ];
    for p in precisions {
        for (tp, dp) in [(1, 2), (2, 2)] {
            let plain = train(&Run::new(tp, dp, false, p));
            let sharded = train(&Run::new(tp, dp, true, p));
            let what = format!("{:?} tp {tp} dp {dp}", p.params);
            for (i, (a, b)) in sharded.steps.iter().zip(&plain.steps).enumerate() {
                assert_eq!((a.2, a.3), (b.2, b.3), "{what} step {i}");
                assert!((a.0 - b.0).abs() <= 1e-6 * b.0.abs(), "{what} step {i}");
                assert!((a.1 - b.1).abs() <= 1e-5 * b.1.abs(), "{what} step {i}");
            }
            // The norm's f32 partial sums add in another order, so a main parameter may
            // differ in its last bit and round to the neighbouring 16-bit value: one unit in
            // the last place at most (near zero, 1e-6 as the f32 test allows), and rarely.
            let ulp = if p.params == DType::BF16 {
                2f32.powi(-7)
            } else {
                2f32.powi(-10)
            };
            let mut differ = 0;
            for (a, b) in sharded.params.iter().zip(&plain.params) {
                if a != b {
                    differ += 1;
                    let bound = ulp * b.abs().max(a.abs()) + 1e-6;
                    assert!((a - b).abs() <= bound, "{what}: {a} vs {b}");
                }
            }
            assert!(
                differ * 100 <= plain.params.len(),
                "{what}: {differ} differ"
            );
        }
    }
}

#[test]
fn bytes_per_parameter_follow_the_seeds_table() {
    // The seed's table: per parameter, 16-bit values and gradients 20 → 4 + 16/d; 16-bit
    // values with f32 gradients 18 → 6 + 12/d; f32 16 → 8 + 8/d (up to the buckets' padding).
    let cases = [
        (Precision::FP32, 8.0, 8.0),
        (precision(bf16()), 6.0, 12.0),
        (
            precision(PrecisionFlags {
                grad_reduce_in_bf16: true,
                ..bf16()
            }),
            4.0,
            16.0,
        ),
    ];
    // Wide enough that the alignment of every parameter to 64 elements is small beside it.
    let wide = |dp, distopt, p| Run {
        steps: 1,
        hidden: 128,
        ..Run::new(1, dp, distopt, p)
    };
    for (p, fixed, sharded) in cases {
        let plain = train(&wide(2, false, p));
        let total = plain.state.per_param(plain.state.total());
        assert!((total - (fixed + sharded)).abs() < 0.1, "{p:?}: {total}");
        for dp in [1, 2, 4] {
            let run = train(&wide(dp, true, p));
            let total = run.state.per_param(run.state.total());
            let want = fixed + sharded / dp as f64;
            assert!(
                (total - want).abs() < 0.1,
                "{p:?} dp {dp}: {total} vs {want}"
            );
        }
    }
}

#[test]
fn fp16_loss_scaling_skips_overflowing_steps_as_megatron_does() {
    // Megatron-LM's defaults start at 2^32: the fp16 gradients overflow, the first step is
    // skipped, the second too and halves the scale (hysteresis 2), then every overflow halves
    // it until the gradients fit; a window of 3 clean steps doubles it again.
    let p = precision(PrecisionFlags {
        loss_scale_window: Some(3),
        ..fp16()
    });
    let run = train(&Run {
        steps: 24,
        ..Run::new(1, 2, false, p)
    });
    let scales: Vec<f64> = run.steps.iter().map(|s| s.3.unwrap()).collect();
    let skipped: Vec<bool> = run.steps.iter().map(|s| s.2).collect();
    assert!(skipped[0] && skipped[1], "{skipped:?}");
    assert_eq!(
        (scales[0], scales[1], scales[2]),
        (2f64.powi(32), 2f64.powi(32), 2f64.powi(31))
    );
    let first_clean = skipped.iter().position(|s| !s).expect("a step fits");
    // Every step before it overflowed and (from the second on) halved the scale.
    for i in 2..first_clean {
        assert_eq!(scales[i], scales[i - 1] / 2.0, "step {i}: {scales:?}");
    }
    // fp16's largest value is 65504: a scale that far above 1 overflows whatever the gradient.
    assert!(scales[first_clean] < 2f64.powi(24), "{scales:?}");
    // A skipped step reports no gradient norm; a clean one does.
    assert!(run.steps[0].1.is_nan() && run.steps[first_clean].1.is_finite());
    // After the window's clean steps the scale doubles, as Megatron-LM's scaler does, unless
    // an overflow came first (then it halves and the count restarts).
    let mut clean = 0;
    for i in first_clean + 1..skipped.len() {
        clean = if skipped[i - 1] { 0 } else { clean + 1 };
        if clean == 3 {
            assert_eq!(scales[i], scales[i - 1] * 2.0, "step {i}: {scales:?}");
            clean = 0;
        } else if !skipped[i - 1] {
            assert_eq!(scales[i], scales[i - 1], "step {i}: {scales:?}");
        }
    }
    // Once steps update, the loss falls.
    let last = run.steps.last().unwrap().0;
    assert!(last < run.steps[first_clean].0, "{:?}", run.steps);
}

#[test]
fn a_16_bit_run_resumes_from_its_checkpoint_bit_for_bit() {
    let dir = TempDir::new("mixed-resume");
    let cases = [
        (precision(bf16()), true),
        (
            precision(PrecisionFlags {
                initial_loss_scale: Some(2f64.powi(24)),
                loss_scale_window: Some(2),
                ..fp16()
            }),
            true,
        ),
        (precision(fp16()), false),
    ];
    for (i, (p, distopt)) in cases.into_iter().enumerate() {
        let whole = train(&Run {
            steps: 6,
            ..Run::new(1, 2, distopt, p)
        });
        let save = dir.path().join(format!("case{i}"));
        let resumed = train(&Run {
            steps: 6,
            resume: Some((3, save)),
            ..Run::new(1, 2, distopt, p)
        });
        // Loss, norm, skips and the loss scale go on as if never stopped: the f32 main
        // parameters and the scaler's state were saved.
        for (s, (a, b)) in resumed.steps.iter().zip(&whole.steps).enumerate() {
            assert_eq!(a.0, b.0, "case {i} step {s}");
            assert!(
                a.1 == b.1 || (a.1.is_nan() && b.1.is_nan()),
                "case {i} step {s}"
            );
            assert_eq!((a.2, a.3), (b.2, b.3), "case {i} step {s}");
        }
        assert_eq!(resumed.params, whole.params, "case {i}");
    }
}
