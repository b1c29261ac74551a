//! `megatron schedule`: a pipeline schedule as Megatron-LM computes it (the schedule table, each
//! rank's counts and order) and as the executor walks it, with the simulated timeline.

use super::output::{self, say};
use super::values;
use anyhow::Result;
use clap::Args;
use megatron::pipeline_parallel::{Pass, Schedule, ScheduleConfig, draw, simulate, traces};
use serde_json::{Value, json};

/// The schedule's sizes, as `schedule` and `graphs` take them.
#[derive(Debug, Args)]
pub struct ScheduleShape {
    /// Pipeline stages (Megatron's --pipeline-model-parallel-size).
    #[arg(
        long = "pp",
        visible_alias = "pipeline-model-parallel-size",
        value_parser = values::ranks
    )]
    pp: usize,
    /// Model chunks per rank (virtual pipeline stages); 1 is the non-interleaved 1F1B schedule.
    #[arg(
        long = "vpp",
        visible_alias = "virtual-pipeline-model-parallel-size",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    vpp: usize,
    /// Microbatches per step.
    #[arg(
        long = "microbatches",
        visible_alias = "num-microbatches",
        value_parser = values::microbatches
    )]
    microbatches: usize,
    /// Contiguous microbatches per virtual stage (Megatron's
    /// --microbatch-group-size-per-virtual-pipeline-stage) [default: pp].
    #[arg(
        long = "group-size",
        visible_aliases = [
            "microbatch-group-size-per-virtual-pipeline-stage",
            "microbatch-group-size-per-vp-stage"
        ],
        value_parser = values::microbatches
    )]
    group_size: Option<usize>,
}

impl ScheduleShape {
    /// The training schedule of these sizes (a group size without virtual stages refused).
    pub fn config(&self) -> Result<ScheduleConfig> {
        let config = ScheduleConfig {
            group_size: self.group_size,
            ..ScheduleConfig::new(self.pp, self.vpp, self.microbatches)
        };
        config.check_group_used()?;
        Ok(config)
    }
}

/// The largest timeline drawn, in cells (ranks × time units): a few megabytes of text.
const MAX_DRAWN_CELLS: u64 = 1 << 20;

/// Arguments of `megatron schedule`.
#[derive(Debug, Args)]
pub struct ScheduleArgs {
    #[command(flatten)]
    shape: ScheduleShape,
    /// Evaluation: forwards only.
    #[arg(long)]
    forward_only: bool,
    /// Megatron's --overlap-moe-expert-parallel-comm: one more warm-up forward (interleaved).
    #[arg(long)]
    overlap_moe_expert_parallel_comm: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs `megatron schedule`.
pub fn run(args: &ScheduleArgs) -> Result<()> {
    let config = ScheduleConfig {
        forward_only: args.forward_only,
        overlap_moe_comm: args.overlap_moe_expert_parallel_comm,
        ..args.shape.config()?
    };
    let schedule = Schedule::new(config)?;
    let walked = traces(&schedule)?;
    // A forward of a chunk costs 1, its backward 2 (a backward computes two products for each
    // of the forward's one).
    let timeline = simulate(&schedule, 1, 2)?;
    if args.json {
        let per_rank: Vec<Value> = schedule
            .ranks
            .iter()
            .zip(&walked)
            .map(|(r, (ops, stats))| {
                let trace: Vec<Value> = ops
                    .iter()
                    .map(|op| {
                        let pass = if op.pass == Pass::Forward { "F" } else { "B" };
                        json!([pass, op.chunk, op.microbatch])
                    })
                    .collect();
                json!({
                    "pp_rank": r.rank,
                    "total_num_microbatches": r.counts.total,
                    "num_warmup_microbatches": r.counts.warmup,
                    "num_microbatches_remaining": r.counts.remaining,
                    "are_all_microbatches_in_warmup": r.counts.all_in_warmup,
                    "order": r.order,
                    "trace": trace,
                    "max_live_activations": stats.max_live,
                })
            })
            .collect();
        let table: Vec<Value> = schedule
            .table
            .iter()
            .map(|s| json!([s.microbatch, s.chunk]))
            .collect();
        let out = json!({
            "pp": config.pp,
            "vpp": config.vpp,
            "num_microbatches": config.microbatches,
            "group_size": config.group(),
            "forward_only": config.forward_only,
            "schedule_table": table,
            "per_rank": per_rank,
            "simulated": {
                "forward_time": 1,
                "backward_time": 2,
                "makespan": timeline.makespan,
                "bubble": timeline.bubble(),
            },
        });
        say!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    let kind = match (config.forward_only, config.interleaved()) {
        (true, _) => "forward-only",
        (false, false) => "1F1B",
        (false, true) => "interleaved 1F1B",
    };
    say!(
        "{kind} schedule: pp {}, {} chunk{} per rank, {} microbatches, group size {}",
        config.pp,
        config.vpp,
        if config.vpp == 1 { "" } else { "s" },
        config.microbatches,
        config.group()
    )?;
    say!(
        "{:<6} {:>7} {:>7} {:>9} {:>9}  order",
        "rank",
        "passes",
        "warm-up",
        "remaining",
        "max live"
    )?;
    for (r, (_, stats)) in schedule.ranks.iter().zip(&walked) {
        let order: Vec<String> = r.order.iter().map(i32::to_string).collect();
        say!(
            "{:<6} {:>7} {:>7} {:>9} {:>9}  {}",
            r.rank,
            r.counts.total,
            r.counts.warmup,
            r.counts.remaining,
            stats.max_live,
            order.join(" ")
        )?;
    }
    say!(
        "\ntimeline (a forward takes 1 unit, a backward 2; {}: microbatch, ' backward, . idle):",
        if config.vpp > 1 {
            "letter: chunk"
        } else {
            "number"
        }
    )?;
    let cells = timeline.makespan.saturating_mul(config.pp as u64);
    if cells <= MAX_DRAWN_CELLS {
        output::text(&draw(&timeline, config.vpp))?;
    } else {
        say!(
            "(not drawn: {} ranks × {} units is more than {MAX_DRAWN_CELLS} cells)",
            config.pp,
            timeline.makespan
        )?;
    }
    let theory = (config.pp - 1) as f64 / (config.vpp * config.microbatches) as f64;
    say!(
        "\n{} units; bubble {:.3} of the compute time (Megatron-LM's theory: (pp − 1)/(V·M) = {theory:.3})",
        timeline.makespan,
        timeline.bubble()
    )?;
    Ok(())
}
