//! Pipeline-parallel training of the DSL's GPT on thread ranks against the same run without a
//! pipeline: pp ∈ {2, 4} × V ∈ {1, 2}, with tensor and data parallelism, give the same losses and
//! gradient norms (to 1e-5 of their size: only the order of f32 sums differs), also with the
//! exchanges planned as NCCL needs them, and the tied embedding's gradient sum over the
//! embedding group is what keeps them so.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::{PipelineLayout, Placement, ScheduleKind};
use megatron::training::{
    BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const LAYERS: usize = 8;
const STEPS: u64 = 6;

fn config() -> GptConfig {
    let mut c = GptConfig::new(LAYERS, 32, 4, 256, 32);
    c.hidden_dropout = 0.1;
    c.attention_dropout = 0.1;
    c
}

/// A run's layout.
#[derive(Debug, Clone, Copy)]
struct Run {
    tp: usize,
    pp: usize,
    dp: usize,
    vpp: usize,
    /// Sum the tied embedding's gradients over the embedding group.
    sync: bool,
    /// The exchanges planned for a backend whose sends wait for their receive (NCCL's).
    rendezvous: bool,
    /// Megatron-LM's distributed optimizer.
    distopt: bool,
    /// The schedule (`None`: Megatron-LM's by `vpp`) and the interleaved schedule's group size.
    kind: Option<ScheduleKind>,
    group: Option<usize>,
    /// Drop each rank's last weight-gradient pass (as if it ran after the optimizer step).
    drop_weight_pass: bool,
}

impl Run {
    fn new(tp: usize, pp: usize, dp: usize, vpp: usize) -> Run {
        Run {
            tp,
            pp,
            dp,
            vpp,
            sync: true,
            rendezvous: false,
            distopt: false,
            kind: None,
            group: None,
            drop_weight_pass: false,
        }
    }

    /// The same run with schedule `kind`.
    fn with(self, kind: ScheduleKind) -> Run {
        Run {
            kind: Some(kind),
            ..self
        }
    }
}

/// Loss and gradient norm of every step, rank 0's tied embedding, the last stage's copy.
type Trained = (Vec<(f64, f64)>, Vec<f32>, Vec<f32>);

/// Loss and gradient norm of every step (rank 0's, which every rank agrees with), and rank 0's
/// embedding values after the last step with the last stage's copy of them.
fn train(run: Run) -> Trained {
    try_train(run).unwrap()
}

/// [`train`], or the first rank's error.
fn try_train(run: Run) -> R<Trained> {
    let Run {
        tp,
        pp,
        dp,
        vpp,
        sync,
        rendezvous,
        distopt,
        kind,
        group,
        drop_weight_pass,
    } = run;
    let kind = kind.unwrap_or_else(|| ScheduleKind::default_for(vpp));
    let world = tp * pp * dp;
    let layout = ParallelLayout::new(&ParallelConfig::new(world).with_tp(tp).with_pp(pp)).unwrap();
    let stages = PipelineLayout::new(LAYERS, pp, vpp, None, None)
        .unwrap()
        .placed(kind.placement())
        .unwrap();
    let text =
        "Megatron-LM pipelines the layers over stages and interleaves their chunks. ".repeat(30);
    let spec = config().spec();
    let mut ranks = launch(world, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: 16,
                micro_batch: 1,
                global_batch: 8,
                dp,
            },
            3,
        )?;
        let train = TrainConfig {
            distributed_optimizer: distopt,
            ..support::train_config(
                LrSchedule {
                    max_lr: 2e-3,
                    min_lr: 2e-4,
                    warmup_steps: 2,
                    decay_steps: STEPS,
                    style: DecayStyle::Cosine,
                },
                9,
                10_000,
            )
        };
        let pp_rank = ps.pp().index();
        let mut trainer = if pp == 1 {
            let model = Gpt::build(&spec, &mut Builder::for_rank(17, ps.groups()))?;
            Trainer::new(model, &ps, sampler, train)?
        } else {
            let chunks = (0..vpp)
                .map(|c| {
                    let b = Builder::for_rank(17, ps.groups()).with_stage(stages.part(pp_rank, c));
                    Gpt::build(&spec, &mut { b })
                })
                .collect::<megatron::Result<Vec<_>>>()?;
            Trainer::pipelined_as(chunks, &ps, sampler, train, kind, group)?
        };
        if drop_weight_pass {
            trainer.drop_last_weight_pass();
        }
        if !sync {
            trainer.skip_shared_gradient_sum();
        }
        if rendezvous {
            trainer.plan_pipeline_for(megatron::pipeline_parallel::Delivery::Rendezvous)?;
        }
        let curve = (0..STEPS)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.grad_norm))
            })
            .collect::<R<Vec<_>>>()?;
        // Every copy of the tied embedding this rank holds, in chunk order.
        let mut wte = Vec::new();
        for chunk in trainer.chunks() {
            chunk.visit_params(&mut |p| {
                if p.spec().name == "wte.weight" {
                    wte.push(p.value().to_vec::<f32>().unwrap());
                }
            });
        }
        Ok((curve, wte))
    })?;
    // The last pipeline stage's rank with the same tp and dp coordinates as rank 0 (in a V,
    // rank 0 itself), and its last copy.
    let last = match kind.placement() {
        Placement::Vee => 0,
        Placement::Looped => layout.groups(megatron::parallel::GroupKind::Pp)[0][pp - 1],
    };
    let last_wte = ranks[last].1.last().cloned().unwrap_or_default();
    let (curve, wte) = ranks.remove(0);
    Ok((curve, wte[0].clone(), last_wte))
}

/// [`support::assert_curves_close`] to 1e-5 of the reference's values.
fn assert_close(a: &[(f64, f64)], b: &[(f64, f64)], what: &str) {
    support::assert_curves_close(a, b, 1e-5, 0.0, what);
}

#[test]
fn pipelines_train_as_one_stage_does() {
    let (reference, _, _) = train(Run::new(1, 1, 1, 1));
    assert!(
        reference[STEPS as usize - 1].0 < reference[0].0,
        "{reference:?}"
    );
    for run in [
        Run::new(1, 2, 1, 1),
        Run::new(1, 4, 1, 1),
        Run::new(1, 2, 1, 2),
        Run::new(1, 4, 1, 2),
        Run::new(2, 2, 1, 2),
        Run::new(1, 2, 2, 1),
        Run::new(2, 2, 2, 2),
        Run {
            rendezvous: true,
            ..Run::new(1, 4, 1, 2)
        },
        // The distributed optimizer, the tied embedding alone in its bucket on both ends.
        Run {
            distopt: true,
            ..Run::new(1, 2, 2, 1)
        },
        Run {
            distopt: true,
            ..Run::new(2, 2, 2, 2)
        },
        // A group of all 8 microbatches: the two ranks' activations and gradients share both
        // wires, and a later message is needed first (received in the order sent).
        Run {
            group: Some(8),
            ..Run::new(1, 2, 1, 2)
        },
    ] {
        let (curve, wte, last_wte) = train(run);
        assert_close(&curve, &reference, &format!("{run:?}"));
        // The first and the last stage's copies of the tied embedding stay equal.
        assert_eq!(wte, last_wte, "{run:?}");
    }
}

#[test]
fn zero_bubble_schedules_train_as_one_stage_does() {
    use ScheduleKind::{DualPipeV, ZbH1, ZbH2, Zbv};
    // Only the sums' order moves (the weight gradients of a microbatch run later, each
    // parameter's still summed over the microbatches in order): 1e-5 of the reference, as the
    // other pipelines.
    let (reference, _, _) = train(Run::new(1, 1, 1, 1));
    for run in [
        Run::new(1, 2, 1, 1).with(ZbH1),
        Run::new(1, 4, 1, 1).with(ZbH1),
        Run::new(1, 2, 1, 1).with(ZbH2),
        Run::new(1, 4, 1, 1).with(ZbH2),
        Run::new(1, 2, 1, 2).with(Zbv),
        Run::new(1, 4, 1, 2).with(Zbv),
        Run::new(1, 2, 1, 2).with(DualPipeV),
        Run::new(1, 4, 1, 2).with(DualPipeV),
        Run::new(2, 2, 1, 1).with(ZbH1),
        Run::new(2, 2, 1, 2).with(Zbv),
        Run {
            distopt: true,
            ..Run::new(1, 2, 2, 1).with(ZbH2)
        },
        Run {
            distopt: true,
            ..Run::new(2, 2, 2, 2).with(DualPipeV)
        },
        Run {
            rendezvous: true,
            ..Run::new(1, 4, 1, 2).with(Zbv)
        },
        Run {
            rendezvous: true,
            ..Run::new(1, 4, 1, 1).with(ZbH1)
        },
    ] {
        let (curve, wte, last_wte) = train(run);
        assert_close(&curve, &reference, &format!("{run:?}"));
        // The tied embedding's copies (in a V both on the first rank) stay equal.
        assert_eq!(wte, last_wte, "{run:?}");
    }
}

#[test]
fn a_weight_gradient_pass_left_past_the_optimizer_step_is_refused() {
    let err = try_train(Run {
        drop_weight_pass: true,
        ..Run::new(1, 2, 1, 1).with(ScheduleKind::ZbH1)
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("weight gradients of 1 backwards not computed")
            && err.contains("the optimizer step would miss them"),
        "{err}"
    );
}

#[test]
fn without_the_embedding_groups_sum_the_tied_copies_drift_apart() {
    let (reference, _, _) = train(Run::new(1, 1, 1, 1));
    let (curve, wte, last_wte) = train(Run {
        sync: false,
        ..Run::new(1, 2, 1, 1)
    });
    assert_ne!(wte, last_wte);
    let drift = curve
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a.0 - b.0).abs() / b.0)
        .fold(0.0, f64::max);
    assert!(drift > 1e-4, "the losses should differ: {drift}");
}

/// A stage of 1F1B that exchanges small tensors as its plan says and fails at its
/// `fail_at`-th forward.
struct Relay<'a> {
    parallel: &'a ParallelState,
    forwards: usize,
    fail_at: Option<usize>,
}

impl megatron::pipeline_parallel::Stage for Relay<'_> {
    type Error = megatron::Error;

    fn forward(&mut self, _chunk: usize, microbatch: usize) -> megatron::Result<()> {
        self.forwards += 1;
        if Some(self.forwards) == self.fail_at {
            let rank = self.parallel.pp().index();
            return megatron::invalid!("rank {rank} fails at microbatch {microbatch}");
        }
        Ok(())
    }

    fn backward(&mut self, _chunk: usize, _microbatch: usize) -> megatron::Result<()> {
        Ok(())
    }

    fn weight(&mut self, _chunk: usize, _microbatch: usize) -> megatron::Result<()> {
        Ok(())
    }

    fn exchange(
        &mut self,
        sends: &[megatron::pipeline_parallel::Transfer],
        recvs: &[megatron::pipeline_parallel::Transfer],
    ) -> megatron::Result<()> {
        use megatron::tensor::{DType, Tensor};
        let outgoing: Vec<_> = sends
            .iter()
            .map(|t| (Tensor::zeros([4], DType::F32), t.peer))
            .collect();
        let incoming: Vec<_> = recvs
            .iter()
            .map(|t| (Tensor::zeros([4], DType::F32), t.peer))
            .collect();
        fn pairs(v: &[(Tensor, usize)]) -> Vec<(&Tensor, usize)> {
            v.iter().map(|(t, p)| (t, *p)).collect()
        }
        self.parallel
            .pp()
            .exchange(&pairs(&outgoing), &pairs(&incoming))?;
        Ok(())
    }
}

#[test]
fn a_rank_failing_mid_pipeline_stops_every_rank_with_its_error() {
    use megatron::pipeline_parallel::{Delivery, Schedule, ScheduleConfig, execute, plan};
    let layout = ParallelLayout::new(&ParallelConfig::new(4).with_pp(4)).unwrap();
    let schedule = Schedule::new(ScheduleConfig::new(4, 1, 8)).unwrap();
    let plans = plan(&schedule, Delivery::Rendezvous).unwrap();
    let start = std::time::Instant::now();
    let result = launch(4, |w| -> megatron::Result<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let rank = ps.pp().index();
        let mut stage = Relay {
            parallel: &ps,
            forwards: 0,
            // Rank 2 fails at its fourth forward, in the middle of the steady phase.
            fail_at: (rank == 2).then_some(4),
        };
        execute(&plans[rank].actions, &mut stage)?;
        Ok(())
    });
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("rank 2") && err.contains("fails at microbatch"),
        "{err}"
    );
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "stopped at once"
    );
    // Without the failure the same walk completes on every rank.
    launch(4, |w| -> megatron::Result<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let rank = ps.pp().index();
        let mut stage = Relay {
            parallel: &ps,
            forwards: 0,
            fail_at: None,
        };
        let stats = execute(&plans[rank].actions, &mut stage)?;
        assert_eq!(stats.max_live, schedule.ranks[rank].counts.warmup + 1);
        Ok(())
    })
    .unwrap();
}

/// Loss and gradient norm of each of 3 steps of deepseek-v3-tiny with its first two of four
/// layers dense, at `tp × pp` (pp = 2: the first stage holds no expert; sequence parallelism
/// when `sp`), on rank 0. The trainer is not told that the model has experts
/// ([`Trainer::log_routing`] is not called).
fn deepseek_dense_first_stage(tp: usize, pp: usize, sp: bool) -> R<Vec<(f64, f64)>> {
    use megatron::models::MoeLayerFreq;
    let mut config = (megatron::models::preset("deepseek-v3-tiny")
        .ok_or("no preset")?
        .config)();
    if let Some(moe) = config.moe.as_mut() {
        moe.layer_freq = MoeLayerFreq::Pattern(vec![0, 0, 1, 1]);
    }
    let spec = config.spec();
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * pp).with_tp(tp).with_pp(pp))?;
    let stages = PipelineLayout::new(4, pp, 1, None, None)?;
    let text = "DeepSeek-V3 starts with dense layers before its experts. ".repeat(20);
    let mut ranks = launch(tp * pp, |w| -> R<Vec<(f64, f64)>> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let plan = BatchPlan {
            seq_length: 16,
            micro_batch: 1,
            global_batch: 4,
            dp: 1,
        };
        let sampler = Sampler::windows(TokenStream::from_bytes(text.as_bytes()), plan, 3)?;
        let schedule = LrSchedule {
            max_lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 1,
            decay_steps: 3,
            style: DecayStyle::Cosine,
        };
        let train = support::train_config(schedule, 9, 10_000);
        let b = Builder::for_rank(17, ps.groups()).with_stage(stages.part(ps.pp().index(), 0));
        let model = Gpt::build(&spec, &mut { b })?;
        let mut trainer = Trainer::pipelined(vec![model], &ps, sampler, train, None)?;
        (0..3)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.grad_norm))
            })
            .collect()
    })?;
    Ok(ranks.remove(0))
}

/// A stage that holds no expert makes the gradient norm's collectives the experts' stages make
/// (it hung until the trainer was told of the experts, the command line's way), and MoE at
/// tensor-parallel size 2 without sequence parallelism is refused, as Megatron-LM refuses it
/// (its expert and router gradients would not be one rank's: the gradient norm was 7% off).
#[test]
fn a_stage_of_dense_layers_agrees_with_the_experts_stages_on_the_gradient_norm() {
    let reference = deepseek_dense_first_stage(1, 1, false).unwrap();
    for (tp, sp) in [(1, false), (2, true)] {
        let piped = deepseek_dense_first_stage(tp, 2, sp).unwrap();
        assert_close(
            &piped,
            &reference,
            &format!("tp {tp} × pp 2, the first stage dense"),
        );
    }
    let refused = deepseek_dense_first_stage(2, 1, false)
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("MoE layers with tensor-parallel size 2 need sequence parallelism"),
        "{refused}"
    );
}
