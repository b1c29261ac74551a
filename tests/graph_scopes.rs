//! `#[graph_scope]` on the CPU: GPT's scopes (attention, the dense MLP, the MoE router) are
//! boundaries that count what a GPU captures and replays and run eagerly. Training with
//! `--cuda-graph-scope` gives the eager run's losses and gradient norms bit for bit, and each
//! pipeline rank captures exactly the graphs and static buffers `plan_graphs` (what
//! `megatron graphs` prints) says: one per scoped part, slot and direction, with slots bounded
//! by the schedule, the same at 8 and 16 microbatches.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::cuda_graphs::{BufferBytes, GraphScope, GraphStats, ScopeSet, plan_graphs};
use megatron::models::gpt::Gpt;
use megatron::models::{GptConfig, MoeConfig, MoeLayerFreq};
use megatron::module::{Builder, Module};
use megatron::moe::RouterConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::{PipelineLayout, Schedule, ScheduleConfig};
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, Trainer};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const LAYERS: usize = 4;
const STEPS: u64 = 3;
const SEQ: usize = 16;
const HIDDEN: usize = 32;

fn dense() -> GptConfig {
    GptConfig::new(LAYERS, HIDDEN, 4, 256, 32)
}

/// Layers 1 and 3 MoE (4 experts, top-2), 0 and 2 dense.
fn moe() -> GptConfig {
    dense().with_moe(MoeConfig {
        router: RouterConfig {
            aux_loss_coeff: 0.01,
            ..RouterConfig::new(4, 2)
        },
        ffn_hidden_size: 48,
        layer_freq: MoeLayerFreq::parse("[0,1,0,1]").unwrap(),
        shared_expert_ffn: None,
        dispatcher: Default::default(),
    })
}

/// Every step's loss and gradient norm.
type Curve = Vec<(f64, f64)>;

/// Every step's loss and gradient norm, and each rank's pipeline rank and graph counts.
fn train(
    config: &GptConfig,
    pp: usize,
    vpp: usize,
    ep: usize,
    microbatches: usize,
    scopes: ScopeSet,
) -> (Curve, Vec<(usize, GraphStats)>) {
    let world = pp * ep;
    let layout = ParallelLayout::new(&ParallelConfig::new(world).with_pp(pp).with_ep(ep)).unwrap();
    let stages = PipelineLayout::new(LAYERS, pp, vpp, None, None).unwrap();
    let text = "A graph replays the kernels its capture recorded, on the same buffers. ".repeat(40);
    let spec = config.spec();
    let mut ranks = launch(world, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: SEQ,
                micro_batch: 1,
                global_batch: microbatches * ep,
                dp: ep,
            },
            3,
        )?;
        let train = support::train_config(
            LrSchedule {
                max_lr: 2e-3,
                min_lr: 2e-4,
                warmup_steps: 1,
                decay_steps: STEPS,
                style: DecayStyle::Cosine,
            },
            5,
            10_000,
        );
        let pp_rank = ps.pp().index();
        let mut trainer = if pp == 1 {
            let model = Gpt::build(&spec, &mut Builder::for_rank(3, ps.groups()))?;
            Trainer::new(model, &ps, sampler, train)?
        } else {
            let chunks = (0..vpp)
                .map(|c| {
                    let b = Builder::for_rank(3, ps.groups()).with_stage(stages.part(pp_rank, c));
                    Gpt::build(&spec, &mut { b })
                })
                .collect::<megatron::Result<Vec<_>>>()?;
            Trainer::pipelined(chunks, &ps, sampler, train, None)?
        };
        trainer.set_graph_scopes(scopes);
        let curve = (0..STEPS)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.grad_norm))
            })
            .collect::<R<Vec<_>>>()?;
        Ok((curve, (pp_rank, trainer.graph_stats())))
    })
    .unwrap();
    let stats = ranks.iter().map(|r| r.1).collect();
    (ranks.remove(0).0, stats)
}

/// Checks a run's captures against the plan, and that the scoped run equals the eager one.
fn check(config: &GptConfig, pp: usize, vpp: usize, ep: usize, m: usize, scopes: &[GraphScope]) {
    let scopes = ScopeSet::of(scopes);
    scopes
        .validate(&config.scoped_model(false).unwrap())
        .unwrap();
    let (eager, none) = train(config, pp, vpp, ep, m, ScopeSet::NONE);
    assert!(none.iter().all(|(_, s)| *s == GraphStats::default()));
    let (scoped, stats) = train(config, pp, vpp, ep, m, scopes);
    let bits = |c: &[(f64, f64)]| -> Vec<(u64, u64)> {
        c.iter().map(|(l, n)| (l.to_bits(), n.to_bits())).collect()
    };
    assert_eq!(
        bits(&scoped),
        bits(&eager),
        "pp {pp} vpp {vpp} ep {ep} M {m}"
    );

    let schedule = Schedule::new(ScheduleConfig::new(pp, vpp, m)).unwrap();
    let layout = PipelineLayout::new(LAYERS, pp, vpp, None, None).unwrap();
    let is_moe = config.moe_layers().unwrap();
    let bytes = BufferBytes {
        activation: (SEQ * HIDDEN * 4) as u64,
        probs: (SEQ * config.moe.as_ref().map_or(0, |m| m.router.num_experts) * 4) as u64,
    };
    let plan = plan_graphs(&schedule, &layout, scopes, &|l| is_moe[l], bytes).unwrap();
    for (pp_rank, s) in stats {
        let p = &plan[pp_rank];
        let what = format!("pp {pp} vpp {vpp} M {m}, pp rank {pp_rank}");
        assert_eq!(s.forward_captures, p.forward_graphs, "{what}");
        assert_eq!(s.backward_captures, p.backward_graphs, "{what}");
        assert_eq!(s.static_inputs, p.static_inputs, "{what}");
        assert_eq!(s.static_grads, p.static_grads, "{what}");
        assert_eq!(s.static_bytes, p.static_bytes, "{what}");
        // Every slot ran once eagerly, was captured once, and replayed the rest of the time:
        // each scoped part runs forward and backward for every microbatch of every step.
        let calls = 2 * p.scoped_parts.iter().sum::<usize>() * m * STEPS as usize;
        assert_eq!(s.warmups, p.graphs(), "{what}");
        assert_eq!(s.replays, calls - 2 * p.graphs(), "{what}");
    }
}

#[test]
fn dense_scopes_without_a_pipeline_capture_one_graph_per_layer_each_way() {
    check(&dense(), 1, 1, 1, 4, &[GraphScope::Attn]);
    check(&dense(), 1, 1, 1, 4, &[GraphScope::Attn, GraphScope::Mlp]);
}

#[test]
fn pipelined_scopes_capture_per_in_flight_slot_whatever_the_microbatches() {
    for m in [8, 16] {
        check(&dense(), 2, 1, 1, m, &[GraphScope::Attn, GraphScope::Mlp]);
        check(&dense(), 2, 2, 1, m, &[GraphScope::Attn]);
    }
}

#[test]
fn moe_router_scopes_with_expert_parallelism_follow_the_plan() {
    let scopes = [
        GraphScope::Attn,
        GraphScope::Mlp,
        GraphScope::MoeRouter,
        GraphScope::MoePreprocess,
    ];
    check(&moe(), 2, 1, 2, 4, &scopes);
}
