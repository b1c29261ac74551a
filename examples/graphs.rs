//! Partial CUDA graphs for a pipelined MoE GPT: how many graphs and static buffers each
//! pipeline rank captures with `--cuda-graph-scope attn moe_router moe_preprocess` as the
//! microbatches grow from 8 to 64 (bounded by the schedule's in-flight microbatches; one graph
//! per microbatch, as the seed counts Megatron-LM today, beside it), then a short run on CPU
//! thread ranks whose scopes capture exactly that plan. `cargo run --release --example graphs`.

use anyhow::{Result, ensure};
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::cuda_graphs::{BufferBytes, GraphScope, ScopeSet, plan_graphs};
use megatron::models::gpt::Gpt;
use megatron::models::preset;
use megatron::module::{Builder, Module};
use megatron::optimizer::AdamWConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::{PipelineLayout, Schedule, ScheduleConfig};
use megatron::training::{
    BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

const PP: usize = 2;
const VPP: usize = 2;
const SEQ: usize = 32;

fn main() -> Result<()> {
    let mut model = (preset("gpt-moe-tiny").expect("registered").config)();
    model.hidden_dropout = 0.0;
    model.attention_dropout = 0.0;
    let scopes = ScopeSet::of(&[
        GraphScope::Attn,
        GraphScope::MoeRouter,
        GraphScope::MoePreprocess,
    ]);
    scopes.validate(&model.scoped_model(false)?)?;
    let moe = model.moe_layers()?;
    let layout = PipelineLayout::new(model.num_layers, PP, VPP, None, None)?;
    let experts = model.moe.as_ref().map_or(0, |m| m.router.num_experts);
    let bytes = BufferBytes {
        activation: (SEQ * model.hidden_size * 4) as u64,
        probs: (SEQ * experts * 4) as u64,
    };
    println!(
        "gpt-moe-tiny, {} layers, pp {PP} × vpp {VPP}, scopes {scopes}",
        model.num_layers
    );
    println!("  M   rank  slots  graphs  static buffers (KiB)  one graph per microbatch");
    let mut first = None;
    for m in [8, 16, 32, 64] {
        let schedule = Schedule::new(ScheduleConfig::new(PP, VPP, m))?;
        let ranks = plan_graphs(&schedule, &layout, scopes, &|l| moe[l], bytes)?;
        for r in &ranks {
            let slots: Vec<String> = r.slots.iter().map(usize::to_string).collect();
            println!(
                "{m:>3}   {:>4}  {:>5}  {:>6}  {:>6} ({:>6.0})  {:>24}",
                r.pp_rank,
                slots.join("+"),
                r.graphs(),
                r.static_inputs + r.static_grads,
                r.static_bytes as f64 / 1024.0,
                r.graphs_per_microbatch
            );
        }
        let counts: Vec<usize> = ranks.iter().map(|r| r.graphs()).collect();
        ensure!(
            *first.get_or_insert(counts.clone()) == counts,
            "the graph counts changed with the microbatches: {counts:?}"
        );
    }

    // Two steps on thread ranks (pp 2 × vpp 2): the scopes run eagerly on the CPU and count what
    // a GPU captures.
    let m = 8;
    let plan = plan_graphs(
        &Schedule::new(ScheduleConfig::new(PP, VPP, m))?,
        &layout,
        scopes,
        &|l| moe[l],
        bytes,
    )?;
    let spec = model.spec();
    let world = ParallelLayout::new(&ParallelConfig::new(PP).with_pp(PP))?;
    let text = "Graphs replay what their capture recorded, on the same buffers. ".repeat(50);
    let stats = launch(PP, |w| -> megatron::Result<_> {
        let ps = ParallelState::new(&w, &world)?;
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: SEQ,
                micro_batch: 1,
                global_batch: m,
                dp: 1,
            },
            1,
        )?;
        let chunks = (0..VPP)
            .map(|c| {
                let mut b =
                    Builder::for_rank(1, ps.groups()).with_stage(layout.part(ps.pp().index(), c));
                Gpt::build(&spec, &mut b)
            })
            .collect::<megatron::Result<Vec<_>>>()?;
        let train = TrainConfig {
            schedule: LrSchedule {
                max_lr: 1e-3,
                min_lr: 1e-4,
                warmup_steps: 1,
                decay_steps: 2,
                style: DecayStyle::Cosine,
            },
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            seed: 1,
            bucket_elements: 1 << 20,
            distributed_optimizer: false,
            recompute: megatron::module::Recompute::Off,
            precision: megatron::optimizer::Precision::FP32,
            check_for_nan: true,
        };
        let mut trainer = Trainer::pipelined(chunks, &ps, sampler, train, None)?;
        trainer.set_graph_scopes(scopes);
        for step in 0..2 {
            trainer.step(&ps, step)?;
        }
        Ok((ps.pp().index(), trainer.graph_stats()))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("\na run of 2 steps at M = {m}:");
    for (rank, s) in stats {
        println!(
            "  rank {rank}: {} graphs captured ({} planned), {} replays, {} static buffers",
            s.graphs(),
            plan[rank].graphs(),
            s.replays,
            s.static_inputs + s.static_grads
        );
        ensure!(
            s.graphs() == plan[rank].graphs(),
            "rank {rank} captured otherwise than planned"
        );
    }
    Ok(())
}
