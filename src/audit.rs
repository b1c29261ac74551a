//! What one training step communicates: every collective of every rank, in order, with its
//! group, its size in bytes and the source line that calls the communicator.
//!
//! The step is a real one: a [`TrainJob`] of a small MoE GPT runs on thread ranks whose world
//! is wrapped in a [`RecordingWorld`], and the log is cleared once the trainer is built, so what
//! is printed is what one step ran (the communicators' methods are `#[track_caller]`, so each
//! call carries its line). `docs/collectives.md` is [`markdown`] of the default
//! [`AuditLayout`] (`tests/audit_collectives.rs` checks it); `examples/audit.rs` prints it for
//! any layout.

use std::fmt::Write as _;

use anyhow::{Result, bail};
use megatron_core::comm::recording::{Call, RecordingWorld};
use megatron_core::comm::threads::launch;
use megatron_core::comm::{OpKind, World};
use megatron_core::moe::RouterConfig;
use megatron_core::optimizer::AdamWConfig;
use megatron_core::optimizer::{Precision, PrecisionFlags};
use megatron_core::training::{
    BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig,
};
use megatron_models::{GptConfig, MoeConfig, MoeLayerFreq};

use crate::job::{PipelineSettings, Placement, TrainJob};

/// The parallel layout of the audited step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditLayout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Sequence parallelism (`--sequence-parallel`).
    pub sequence_parallel: bool,
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Expert-parallel size (carved out of dp × tp, as Megatron-LM does).
    pub ep: usize,
    /// Expert-tensor-parallel size.
    pub etp: usize,
    /// Adam's state sharded over data parallelism (`--use-distributed-optimizer`).
    pub distributed_optimizer: bool,
    /// Microbatches per data-parallel rank in the step.
    pub microbatches: usize,
}

impl Default for AuditLayout {
    /// The layout of docs/collectives.md: tp 2 · pp 2 · dp 2 · ep 2 with sequence parallelism
    /// (Megatron-LM's MoE layers need it with tp > 1), distributed optimizer.
    fn default() -> Self {
        AuditLayout {
            tp: 2,
            sequence_parallel: true,
            pp: 2,
            dp: 2,
            ep: 2,
            etp: 1,
            distributed_optimizer: true,
            microbatches: 2,
        }
    }
}

impl std::fmt::Display for AuditLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tp {} · pp {} · dp {} · ep {} · etp {}",
            self.tp, self.pp, self.dp, self.ep, self.etp
        )?;
        if self.sequence_parallel {
            f.write_str(", sequence parallel")?;
        }
        if self.distributed_optimizer {
            f.write_str(", distributed optimizer")?;
        }
        write!(f, ", {} microbatches per step", self.microbatches)
    }
}

/// The audited model: two blocks per pipeline stage, the second of each a MoE block (4
/// experts per expert-parallel rank, top-2), hidden 32, 4 heads, byte vocabulary, 16 tokens.
pub fn model(layout: &AuditLayout) -> GptConfig {
    let mut config = GptConfig::new(2 * layout.pp, 32, 4, 256, 16);
    config.ffn_hidden_size = 64;
    config.with_moe(MoeConfig {
        router: RouterConfig {
            aux_loss_coeff: 0.01,
            ..RouterConfig::new(4 * layout.ep, 2)
        },
        ffn_hidden_size: 64,
        layer_freq: MoeLayerFreq::Every(2),
        shared_expert_ffn: None,
        dispatcher: Default::default(),
    })
}

/// A one-step job of [`model`] on `layout`, on the CPU, in fp16 with a static loss scale.
pub fn job(layout: &AuditLayout) -> Result<TrainJob> {
    if [
        layout.tp,
        layout.pp,
        layout.dp,
        layout.ep,
        layout.etp,
        layout.microbatches,
    ]
    .contains(&0)
    {
        bail!("every size of the audited layout must be at least 1: {layout}");
    }
    let plan = BatchPlan {
        seq_length: 16,
        micro_batch: 1,
        global_batch: layout.dp * layout.microbatches,
        dp: layout.dp,
    };
    let text = "Every collective of one step, in order, with its group and its bytes. ".repeat(8);
    let train_data = Sampler::windows(TokenStream::from_bytes(text.as_bytes()), plan, 1)?;
    Ok(TrainJob {
        model_name: "audit".to_string(),
        model: model(layout),
        tp: layout.tp,
        sequence_parallel: layout.sequence_parallel,
        cp: 1,
        cp_comm_type: Default::default(),
        ep: layout.ep,
        etp: layout.etp,
        dp: layout.dp,
        pipeline: PipelineSettings {
            pp: layout.pp,
            ..Default::default()
        },
        steps: 1,
        train_data,
        eval: None,
        train: TrainConfig {
            schedule: LrSchedule {
                max_lr: 1e-3,
                min_lr: 1e-4,
                warmup_steps: 1,
                decay_steps: 1,
                style: DecayStyle::Cosine,
            },
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            seed: 1,
            bucket_elements: 1 << 20,
            distributed_optimizer: layout.distributed_optimizer,
            recompute: megatron_core::module::Recompute::Off,
            // fp16 with a static loss scale (no overflow to skip the step): the step's found-inf
            // check shows.
            precision: Precision::from_flags(&PrecisionFlags {
                fp16: true,
                loss_scale: Some(128.0),
                ..Default::default()
            })?,
            check_for_nan: true,
        },
        save: None,
        load: None,
        run_info: serde_json::json!({}),
        files: Vec::new(),
        device: Placement::Cpu,
        cuda_graph_scope: megatron_core::cuda_graphs::ScopeSet::NONE,
        ddp: Default::default(),
        stop: None,
        rank_steps: None,
        trace: None,
    })
}

/// Every rank's calls of `job`'s first step, by global rank (the setup's calls left out).
pub fn record_step(job: &TrainJob) -> Result<Vec<Vec<Call>>> {
    if job.steps != 1 || job.eval.is_some() || job.save.is_some() {
        bail!("an audited job runs one step, without evaluation or saving");
    }
    let mut observers = Vec::new();
    let context = job.context(&mut observers)?;
    launch(job.world_size(), |w| -> Result<Vec<Call>> {
        let recording = RecordingWorld::new(&w);
        let log = recording.log().clone();
        // Built and placed: what follows is the step.
        job.run_rank(&recording as &dyn World, &context, &|_| {
            log.take();
            Ok(())
        })?;
        Ok(log.take())
    })
    .map_err(anyhow::Error::msg)
}

/// Whether a call's size depends on the routing: the dispatcher's all-to-alls of tokens (its
/// exchange of counts, integers, has a fixed size). Their sizes are printed as `routed`, so
/// that the document does not depend on the last bits of the router's arithmetic.
fn routed(call: &Call) -> bool {
    call.desc.kind == OpKind::AllToAll && call.desc.dtype.is_float()
}

/// A call's bytes on this rank (NCCL's count: the input of all-gather, the output of
/// reduce-scatter, the send buffer of all-to-all); `None` when the routing decides it.
fn bytes(call: &Call) -> Option<usize> {
    (!routed(call)).then(|| call.desc.count * call.desc.dtype.size())
}

/// The call as printed: `kind(op, peer, dtype × count)`, the count `routed` where the routing
/// decides it.
fn shown(call: &Call) -> String {
    if routed(call) {
        format!("{}({} × routed)", call.desc.kind, call.desc.dtype)
    } else {
        call.desc.to_string()
    }
}

/// Bytes as printed.
fn shown_bytes(bytes: Option<usize>) -> String {
    bytes.map_or_else(|| "routed".to_string(), |b| b.to_string())
}

/// The calls of one rank as a Markdown table, consecutive equal calls (same group, call, bytes
/// and line) on one row with their count.
pub fn table(calls: &[Call]) -> String {
    let mut out = String::from("| # | group | call | bytes | called at |\n|---|---|---|---|---|\n");
    let mut i = 0;
    let mut row = 0;
    while i < calls.len() {
        let same = calls[i..]
            .iter()
            .take_while(|c| {
                c.group == calls[i].group
                    && shown(c) == shown(&calls[i])
                    && c.caller == calls[i].caller
            })
            .count();
        row += 1;
        let times = if same > 1 {
            format!(" ×{same}")
        } else {
            String::new()
        };
        let c = &calls[i];
        let _ = writeln!(
            out,
            "| {row} | {} | `{}`{times} | {} | {}:{} |",
            c.group,
            shown(c),
            shown_bytes(bytes(c)),
            c.caller.file(),
            c.caller.line()
        );
        i += same;
    }
    out
}

/// Totals per group and operation over one rank's calls.
fn totals(calls: &[Call]) -> String {
    let mut sums: Vec<(String, String, usize, Option<usize>)> = Vec::new();
    for c in calls {
        let op = c.desc.kind.to_string();
        match sums
            .iter_mut()
            .find(|(g, o, _, _)| *g == c.group && *o == op)
        {
            Some(entry) => {
                entry.2 += 1;
                entry.3 = entry.3.zip(bytes(c)).map(|(a, b)| a + b);
            }
            None => sums.push((c.group.clone(), op, 1, bytes(c))),
        }
    }
    let mut out = String::from("| group | operation | calls | bytes |\n|---|---|---|---|\n");
    for (group, op, n, b) in sums {
        let _ = writeln!(out, "| {group} | {op} | {n} | {} |", shown_bytes(b));
    }
    out
}

/// The audit as Markdown: for the first rank of each pipeline stage (tensor-, data- and
/// expert-parallel peers make the same calls on their own groups), its calls in order and
/// their totals.
pub fn markdown(layout: &AuditLayout, ranks: &[Vec<Call>]) -> String {
    let mut out = String::new();
    let stage_ranks = ranks.len() / layout.pp.max(1);
    for stage in 0..layout.pp {
        let rank = stage * stage_ranks;
        let Some(calls) = ranks.get(rank) else {
            continue;
        };
        let _ = writeln!(
            out,
            "### Pipeline stage {stage} (global rank {rank}): {} calls\n",
            calls.len()
        );
        out.push_str(&table(calls));
        out.push_str("\nTotals:\n\n");
        out.push_str(&totals(calls));
        out.push('\n');
    }
    out
}

/// docs/collectives.md: what the audit is, how to make it again, and [`markdown`] of `ranks`.
pub fn document(layout: &AuditLayout, ranks: &[Vec<Call>]) -> String {
    let config = model(layout);
    let mut out = String::from("# The collectives of one training step\n\n");
    let _ = write!(
        out,
        "Every collective that one training step of a MoE GPT calls, in order, recorded from a \
         real step at **{layout}** on {} CPU thread ranks, with the group it goes to, its size \
         and the source line that calls the communicator. The model: {} layers (every second \
         one a MoE layer of {} experts, top-{}), hidden {}, {} heads, a byte vocabulary, {} \
         tokens per sequence, fp16 with a static loss scale of 128.\n\n",
        ranks.len(),
        config.num_layers,
        config.moe.as_ref().map_or(0, |m| m.router.num_experts),
        config.moe.as_ref().map_or(0, |m| m.router.topk),
        config.hidden_size,
        config.num_attention_heads,
        config.max_position_embeddings,
    );
    out.push_str(
        "This file is generated (`megatron::audit`): `tests/audit_collectives.rs` records the \
         step again and fails when the file differs; `MEGATRON_BLESS=1 cargo test --test \
         audit_collectives` rewrites it. `cargo run --release --example audit -- --tp 2 --pp 2 \
         --dp 2 --ep 2` prints the same for any layout.\n\n\
         How it is recorded: the ranks' world is wrapped in a `RecordingWorld` \
         (`megatron-core/src/comm/recording.rs`) and the log is cleared once the trainer is \
         built, so the rows are one step and nothing else. The communicators' methods are \
         `#[track_caller]`, so each row names the line that made the call. For the generated \
         code that is the line of the model's `forward` whose collective it is \
         (`megatron-models/src/gpt.rs`): in forward the g of a row-parallel layer and the \
         all-reduce of the vocab-parallel embedding's partial lookups, in backward the f of a \
         column-parallel layer (the all-reduce of its input gradient). With sequence \
         parallelism each of those is a reduce-scatter to the sequence shards or an all-gather \
         of them (before a column-parallel layer and the tied output layer in forward, before \
         a row-parallel layer's backward), and the MoE router sums its load-balancing counts \
         over `tp` (each rank routes its shard). GPT's blocks add each row-parallel output to \
         the residual on its own; a block that sums two (GPT-J's and PaLM's parallel block) \
         reduces their sum once, and gathers an input shared by two column-parallel layers \
         once: [collectives-parallel-block.md](collectives-parallel-block.md) records one.\n\n\
         The groups are Megatron-LM's: `tp` tensor-parallel, `pp` the stages of one pipeline, \
         `dp` data-parallel, `ep` expert-parallel (the dispatcher's all-to-alls), `edp` the \
         expert parameters' data-parallel group, `etp-ep` the expert model-parallel group, \
         `embedding` the first and last stages (the tied embedding's gradient), `world` every \
         rank. The step: the \
         1F1B schedule's forwards and backwards with the stage exchanges over `pp`; then the \
         tied embedding's gradient sum; the gradients' reduce-scatter per bucket (the \
         distributed optimizer; an all-reduce without it) over `dp`, and `edp` for the \
         experts; the loss and MoE routing totals; the found-inf flag's maximum over the world \
         (loss scaling: a step with an inf or NaN gradient on any rank is skipped by all); the \
         gradient norm's sums of squares, one per group its shards span; Adam's update of each rank's shard and the parameters' \
         all-gather. Sizes are this rank's (the input of an all-gather, the output of a \
         reduce-scatter, the send buffer of an all-to-all); the dispatcher's token all-to-alls \
         depend on the routing and show `routed`. Consecutive equal calls share a row (×n). \
         Tensor-, data- and expert-parallel peers make the same calls on their own groups, so \
         one rank per pipeline stage is shown.\n\n",
    );
    out.push_str(&markdown(layout, ranks));
    out
}
