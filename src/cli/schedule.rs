//! `megatron schedule`: a pipeline schedule as Megatron-LM computes it (the schedule table, each
//! rank's counts and order), or a zero-bubble one with its weight-gradient passes, as the
//! executor walks it, with the simulated timeline and the bubble its paper predicts.

use super::output::{self, say};
use super::values;
use anyhow::Result;
use clap::Args;
use megatron::pipeline_parallel::{
    Costs, Schedule, ScheduleConfig, ScheduleKind, draw, simulate, theory, traces,
};
use serde_json::{Value, json};

/// The schedule's sizes, as `schedule` and `graphs` take them.
#[derive(Debug, Args)]
pub struct ScheduleShape {
    /// The schedule: 1f1b, interleaved, zb-h1, zb-h2, zbv or dualpipev [default: 1f1b, or
    /// interleaved with --vpp above 1].
    #[arg(
        long = "schedule",
        visible_alias = "pipeline-schedule",
        value_parser = values::schedule
    )]
    schedule: Option<ScheduleKind>,
    /// Pipeline stages (Megatron's --pipeline-model-parallel-size).
    #[arg(
        long = "pp",
        visible_alias = "pipeline-model-parallel-size",
        value_parser = values::ranks
    )]
    pp: usize,
    /// Model chunks per rank (virtual pipeline stages) [default: 1; 2 for zbv and dualpipev].
    #[arg(
        long = "vpp",
        visible_alias = "virtual-pipeline-model-parallel-size",
        value_parser = values::ranks
    )]
    vpp: Option<usize>,
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
        let kind = self
            .schedule
            .unwrap_or_else(|| ScheduleKind::default_for(self.vpp.unwrap_or(1)));
        let config = ScheduleConfig {
            group_size: self.group_size,
            ..ScheduleConfig::named(kind, self.pp, self.vpp, self.microbatches)?
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
    if config.overlap_moe_comm && (!config.interleaved() || config.forward_only) {
        anyhow::bail!(
            "--overlap-moe-expert-parallel-comm adds a warm-up forward to the interleaved \
             schedule's training steps only: with --pipeline-schedule {}{} it does nothing \
             (drop it)",
            config.kind,
            if config.forward_only {
                " and --forward-only"
            } else {
                ""
            }
        );
    }
    let schedule = Schedule::new(config)?;
    let walked = traces(&schedule)?;
    // A forward of a chunk costs 1, its input gradient 1 and its weight gradients 1 (a backward
    // computes two products for each of the forward's one).
    let costs = Costs::EQUAL;
    let timeline = simulate(&schedule, costs)?;
    let theory = theory(&config, costs.times());
    if args.json {
        let per_rank: Vec<Value> = schedule
            .ranks
            .iter()
            .zip(&walked)
            .map(|(r, (ops, stats))| {
                let trace: Vec<Value> = ops
                    .iter()
                    .map(|op| json!([op.pass.letter(), op.chunk, op.microbatch]))
                    .collect();
                json!({
                    "pp_rank": r.rank,
                    "total_num_microbatches": r.counts.total,
                    "num_warmup_microbatches": r.counts.warmup,
                    "num_microbatches_remaining": r.counts.remaining,
                    "are_all_microbatches_in_warmup": r.counts.all_in_warmup,
                    "order": r.megatron_order(),
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
            "schedule": config.kind.name(),
            "splits_backward": config.kind.splits_backward(),
            "pp": config.pp,
            "vpp": config.vpp,
            "num_microbatches": config.microbatches,
            "group_size": config.group(),
            "forward_only": config.forward_only,
            "schedule_table": table,
            "per_rank": per_rank,
            "simulated": {
                "forward_time": costs.forward,
                "backward_time": costs.backward,
                "weight_time": costs.weight,
                "makespan": timeline.makespan,
                "bubble": timeline.bubble(),
                "bubble_within_ranks": timeline.bubble_within_ranks(),
                "theory": theory.bubble,
                "theory_within_ranks": theory.within_ranks,
                "formula": theory.formula,
                "formula_holds_from_microbatches": theory.min_microbatches,
            },
        });
        say!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    let kind = match config.forward_only {
        true => "forward-only",
        false => config.kind.name(),
    };
    say!(
        "{kind} schedule: pp {}, {} chunk{} per rank{}, {} microbatches{}",
        config.pp,
        config.vpp,
        if config.vpp == 1 { "" } else { "s" },
        match config.kind.placement() {
            megatron::pipeline_parallel::Placement::Vee => " in a V",
            megatron::pipeline_parallel::Placement::Looped => "",
        },
        config.microbatches,
        match config.interleaved() {
            true => format!(", group size {}", config.group()),
            false => String::new(),
        }
    )?;
    // Megatron-LM's order entries (`+k`, `−k`: chunk k's forward, backward); with weight
    // gradient passes, the pass's letter before the 1-based chunk.
    say!(
        "{:<6} {:>7} {:>7} {:>9} {:>9}  {}",
        "rank",
        "passes",
        "warm-up",
        "remaining",
        "max live",
        match config.kind.splits_backward() {
            true => "order (F, B, W of chunk k)",
            false => "order",
        }
    )?;
    for (r, (_, stats)) in schedule.ranks.iter().zip(&walked) {
        let order: Vec<String> = match r.megatron_order() {
            Some(order) => order.iter().map(i32::to_string).collect(),
            None => r
                .order
                .iter()
                .map(|s| format!("{}{}", s.pass.letter(), s.chunk + 1))
                .collect(),
        };
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
        "\ntimeline (a forward takes 1 unit, an input gradient 1, weight gradients 1; {}: \
         microbatch, ' backward, \" weight gradients, . idle):",
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
    say!(
        "\n{} units; bubble {:.3} of the compute time (theory: {} = {:.3}{})",
        timeline.makespan,
        timeline.bubble(),
        theory.formula,
        theory.bubble,
        match config.microbatches < theory.min_microbatches {
            true => format!(
                "; it holds from {} microbatches, the pipeline is not filled",
                theory.min_microbatches
            ),
            false => String::new(),
        }
    )?;
    if let Some(within) = theory.within_ranks {
        say!(
            "inside the ranks' spans (steps back to back, the ramp filled): {:.3} (the paper: {within:.3})",
            timeline.bubble_within_ranks()
        )?;
    }
    Ok(())
}
