//! `megatron graphs`: the CUDA graphs and static buffers a run with `--cuda-graph-scope`
//! captures, per pipeline rank: one graph each way per scoped part of a layer and in-flight
//! slot, the slots bounded by the schedule, so the counts stay put as the microbatches grow.

use anyhow::{Context, Result};
use clap::Args;
use megatron::cuda_graphs::{BufferBytes, ScopeSet, plan_graphs};
use megatron::pipeline_parallel::{PipelineLayout, Schedule};
use serde_json::json;

use super::model_args::ArchitectureArgs;
use super::output::say;
use super::schedule::ScheduleShape;
use super::values;

/// Arguments of `megatron graphs`.
#[derive(Debug, Args)]
pub struct GraphsArgs {
    #[command(flatten)]
    arch: ArchitectureArgs,
    #[command(flatten)]
    shape: ScheduleShape,
    /// The scopes captured: attn, mlp, moe_router, moe_preprocess.
    #[arg(long = "cuda-graph-scope", num_args = 1.., value_name = "SCOPE", required = true)]
    cuda_graph_scope: Vec<String>,
    /// Tokens per sequence (the static buffers' size).
    #[arg(long, default_value_t = 128, value_parser = values::batch)]
    seq_length: usize,
    /// Sequences per microbatch (the static buffers' size).
    #[arg(long, default_value_t = 1, value_parser = values::batch)]
    micro_batch_size: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs `megatron graphs`.
pub fn run(args: &GraphsArgs) -> Result<()> {
    let config = args.arch.config(1, 1, false)?;
    let scopes = ScopeSet::parse(&args.cuda_graph_scope).context("--cuda-graph-scope")?;
    scopes.validate(&config.scoped_model(false)?)?;
    let schedule = Schedule::new(args.shape.config()?)?;
    megatron::cuda_graphs::check_schedule(schedule.config.kind)?;
    let sizes = schedule.config;
    let layout = PipelineLayout::new(config.num_layers, sizes.pp, sizes.vpp, None, None)?;
    let moe = config.moe_layers()?;
    // Each static buffer is a [seq, micro-batch, hidden] f32 activation or gradient.
    let tokens = args.seq_length * args.micro_batch_size;
    let bytes = BufferBytes {
        activation: (tokens * config.hidden_size * 4) as u64,
        probs: (tokens * config.moe.as_ref().map_or(0, |m| m.router.num_experts) * 4) as u64,
    };
    let ranks = plan_graphs(&schedule, &layout, scopes, &|l| moe[l], bytes)?;
    if args.json {
        let per_rank: Vec<_> = ranks
            .iter()
            .map(|r| {
                json!({
                    "pp_rank": r.pp_rank,
                    "layers": r.layers,
                    "scoped_parts_per_chunk": r.scoped_parts,
                    "slots_per_chunk": r.slots,
                    "max_in_flight": r.max_live,
                    "graphs": r.graphs(),
                    "forward_graphs": r.forward_graphs,
                    "backward_graphs": r.backward_graphs,
                    "static_input_buffers": r.static_inputs,
                    "static_grad_buffers": r.static_grads,
                    "static_buffer_bytes": r.static_bytes,
                    "graphs_one_per_microbatch": r.graphs_per_microbatch,
                })
            })
            .collect();
        let out = json!({
            "model": args.arch.model_name(),
            "num_layers": config.num_layers,
            "moe_layers": moe.iter().filter(|&&m| m).count(),
            "pp": sizes.pp,
            "vpp": sizes.vpp,
            "num_microbatches": sizes.microbatches,
            "cuda_graph_scope": scopes.iter().map(|s| s.name()).collect::<Vec<_>>(),
            "per_rank": per_rank,
        });
        say!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    say!(
        "{}: {} layers ({} MoE), pp {}, vpp {}, {} microbatches, scopes {scopes}",
        args.arch.model_name(),
        config.num_layers,
        moe.iter().filter(|&&m| m).count(),
        sizes.pp,
        sizes.vpp,
        sizes.microbatches
    )?;
    say!(
        "{:<5} {:>6} {:>8} {:>9} {:>7} {:>14} {:>8} {:>18}",
        "rank",
        "layers",
        "slots",
        "in flight",
        "graphs",
        "static buffers",
        "MiB",
        "one per microbatch"
    )?;
    for r in &ranks {
        let slots: Vec<String> = r.slots.iter().map(usize::to_string).collect();
        say!(
            "{:<5} {:>6} {:>8} {:>9} {:>7} {:>14} {:>8.2} {:>18}",
            r.pp_rank,
            r.layers,
            slots.join("+"),
            r.max_live,
            r.graphs(),
            r.static_inputs + r.static_grads,
            r.static_bytes as f64 / (1 << 20) as f64,
            r.graphs_per_microbatch
        )?;
    }
    Ok(())
}
