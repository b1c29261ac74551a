//! `megatron inspect`: a model's padded vocabulary, every parameter's logical and local shape and
//! split, and the collectives of one transformer layer, measured.

use std::fmt::Write as _;

use anyhow::{Result, bail};
use clap::Args;
use megatron::comm::threads::launch;
use megatron::comm::{CommStats, ParallelState};
use megatron::context_parallel::CpCommType;
use megatron::distributed::ShardingStrategy;
use megatron::models::gpt::{Block, Gpt};
use megatron::models::{GptConfig, PositionEmbeddingType};
use megatron::module::{Builder, Cx, Module, ParamSpec, Site, Split};
use megatron::optimizer::{Precision, PrecisionFlags};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::tensor::{DType, Tensor};
use serde_json::{Value, json};

use super::inspect_cp;
use super::model_args::ArchitectureArgs;
use super::output::{self, say};
use super::values;

/// Arguments of `megatron inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    arch: ArchitectureArgs,
    /// Tensor-parallel size.
    #[arg(
        long = "tensor-model-parallel-size",
        visible_alias = "tp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    tp: usize,
    /// Pipeline stages: show which layers each stage and chunk holds, and what goes between
    /// them.
    #[arg(
        long = "pipeline-model-parallel-size",
        visible_alias = "pp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    pp: usize,
    /// Model chunks (virtual stages) per pipeline stage.
    #[arg(
        long = "virtual-pipeline-model-parallel-size",
        visible_alias = "vpp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    vpp: usize,
    /// Layers of the first pipeline stage, the others sharing the rest evenly.
    #[arg(long, value_parser = values::layers)]
    decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers of the last pipeline stage, the others sharing the rest evenly.
    #[arg(long, value_parser = values::layers)]
    decoder_last_pipeline_num_layers: Option<usize>,
    /// Data-parallel ranks: the bytes of each rank's parameters, gradients and optimizer state.
    #[arg(
        long = "data-parallel-size",
        visible_alias = "dp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    dp: usize,
    /// Expert-parallel ranks (MoE models): each holds its share of every MoE layer's experts.
    #[arg(
        long = "expert-model-parallel-size",
        visible_alias = "ep",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    ep: usize,
    /// Expert tensor-parallel ranks (MoE models): each holds a slice of every local expert.
    #[arg(
        long = "expert-tensor-parallel-size",
        visible_alias = "etp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    etp: usize,
    /// With Megatron-LM's distributed optimizer (the optimizer state split over the
    /// data-parallel ranks).
    #[arg(long)]
    use_distributed_optimizer: bool,
    /// What data parallelism shards (Megatron-FSDP's names): no_shard, optim (as
    /// --use-distributed-optimizer), optim_grads (also the gradients) [default: optim with
    /// --use-distributed-optimizer, else no_shard]. Every strategy's state is printed beside.
    #[arg(long, value_parser = values::sharding_strategy, value_name = "STRATEGY")]
    data_parallel_sharding_strategy: Option<ShardingStrategy>,
    /// With --use-distributed-optimizer: the optimizer state sharded within this many parts of
    /// the data-parallel ranks and replicated across them (Megatron-LM's HSDP).
    #[arg(long, default_value_t = 1, value_parser = values::ranks)]
    num_distributed_optimizer_instances: usize,
    /// bf16 parameters (f32 gradients unless --grad-reduce-in-bf16) with f32 main parameters.
    #[arg(long)]
    bf16: bool,
    /// fp16 parameters and gradients (f32 gradients with --accumulate-allreduce-grads-in-fp32).
    #[arg(long)]
    fp16: bool,
    /// f32 gradients under --fp16.
    #[arg(long, visible_alias = "grad-reduce-in-fp32")]
    accumulate_allreduce_grads_in_fp32: bool,
    /// bf16 gradients under --bf16.
    #[arg(long)]
    grad_reduce_in_bf16: bool,
    /// Sequence parallelism: show the layer's collectives and activation memory with it
    /// (beside those without) and the pipeline's exchanges of the sequence shards.
    #[arg(long)]
    sequence_parallel: bool,
    /// Context-parallel size: show what attention sends per layer and what a rank keeps, with
    /// each rank holding 2 of the sequence's 2·cp chunks.
    #[arg(long = "context-parallel-size", visible_alias = "cp", default_value_t = 1, value_parser = values::ranks)]
    cp: usize,
    /// How context-parallel attention exchanges keys and values: p2p, all_gather, a2a, a2a+p2p
    /// [default: all_gather].
    #[arg(long)]
    cp_comm_type: Option<String>,
    /// With --cp-comm-type a2a+p2p: the all-to-all groups' size and the ring's.
    #[arg(long, num_args = 1.., value_parser = values::ranks)]
    hierarchical_context_parallel_sizes: Vec<usize>,
    /// Sequence length of the measured activation memory of one layer.
    #[arg(long, default_value_t = 256, value_parser = values::batch)]
    seq_length: usize,
    /// Micro-batch size of the measured activation memory of one layer.
    #[arg(long, default_value_t = 1, value_parser = values::batch)]
    micro_batch_size: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Bytes per parameter of a rank's training state.
#[derive(Debug, Clone, Copy)]
struct StateBytes {
    values: f64,
    grads: f64,
    optimizer: f64,
}

impl StateBytes {
    fn total(&self) -> f64 {
        self.values + self.grads + self.optimizer
    }
}

/// Bytes per parameter of a rank holding `specs` (pp = 1) under `strategy`: values and
/// gradients over the buffers the trainer lays out, and Adam's two f32 moments (with 16-bit
/// parameters the f32 main parameters, with 16-bit gradients their f32 main copies), each
/// buffer's split over its `ranks` (dp for the dense parameters, edp for the experts') from
/// `optim` on; with `optim_grads` the gradients are the rank's f32 shard of them.
fn state_bytes(
    specs: &[ParamSpec],
    (dp, edp): (usize, usize),
    strategy: ShardingStrategy,
    precision: &Precision,
) -> Result<StateBytes> {
    use megatron::optimizer::{LayoutConfig, ParamInfo, layout};
    let params: Vec<ParamInfo> = specs
        .iter()
        .map(|s| ParamInfo {
            name: s.name.clone(),
            numel: s.local.numel(),
            dtype: precision.params,
            shared_embedding: false,
            expert: s.is_expert(),
            unit: 0,
        })
        .collect();
    let config = LayoutConfig {
        bucket_size: Some(megatron::training::default_bucket_elements(dp)),
        distributed_optimizer: strategy.shards_optimizer(),
        grad_reduce_in_fp32: precision.grads == DType::F32,
        edp,
        ..LayoutConfig::new(dp)
    };
    let buffers = layout(&params, &config)?;
    let buffer: usize = buffers.iter().map(|b| b.numel()).sum();
    let state: usize = buffers
        .iter()
        .map(|b| b.numel() / b.shards.unwrap_or(1))
        .sum();
    let per =
        |bytes: usize| bytes as f64 / params.iter().map(|p| p.numel).sum::<usize>().max(1) as f64;
    let main_params = usize::from(precision.params != DType::F32);
    let main_grads = usize::from(precision.grads != DType::F32);
    // Sharded parameters keep the rank's shard of the values; whole ones only while gathered.
    let values = match strategy {
        ShardingStrategy::OptimGradsParams => state,
        _ => buffer,
    };
    Ok(match strategy.shards_gradients() {
        false => StateBytes {
            values: per(precision.params.size() * values),
            grads: per(precision.grads.size() * buffer),
            optimizer: per(4 * (2 + main_params + main_grads) * state),
        },
        true => StateBytes {
            values: per(precision.params.size() * values),
            grads: per(4 * state),
            optimizer: per(4 * (2 + main_params) * state),
        },
    })
}

/// The most whole parameter values a rank holds at once, in bytes per parameter, without and
/// with the next unit prefetched: every value for the strategies that keep them whole; with
/// `optim_grads_params` the root unit (what no stack holds) and the largest module of a stack
/// (and the second largest, prefetched), padding aside.
fn gathered_peak(
    specs: &[ParamSpec],
    strategy: ShardingStrategy,
    precision: &Precision,
) -> (f64, f64) {
    let total: usize = specs.iter().map(|s| s.local.numel()).sum();
    let v = precision.params.size() as f64;
    if strategy != ShardingStrategy::OptimGradsParams {
        return (v, v);
    }
    let mut units: std::collections::BTreeMap<String, usize> = Default::default();
    let mut root = 0;
    for spec in specs {
        let mut parts = spec.name.split('.');
        match (parts.next(), parts.next()) {
            (Some(list @ ("blocks" | "mtp")), Some(i)) if i.parse::<usize>().is_ok() => {
                *units.entry(format!("{list}.{i}")).or_default() += spec.local.numel();
            }
            _ => root += spec.local.numel(),
        }
    }
    let mut sizes: Vec<usize> = units.into_values().collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let held = |n: usize| {
        let bytes = v * (root + sizes.iter().take(n).sum::<usize>()) as f64;
        bytes / total.max(1) as f64
    };
    (held(1), held(2))
}

/// The bytes per parameter `strategy` keeps in theory, as `whole + sharded / n` over the `n`
/// ranks a shard is cut for (padding aside).
fn state_formula(strategy: ShardingStrategy, precision: &Precision) -> (usize, usize) {
    let (v, g) = (precision.params.size(), precision.grads.size());
    let main_params = 4 * usize::from(precision.params != DType::F32);
    let main_grads = 4 * usize::from(precision.grads != DType::F32);
    match strategy {
        ShardingStrategy::NoShard => (v + g + 8 + main_params + main_grads, 0),
        ShardingStrategy::Optim => (v + g, 8 + main_params + main_grads),
        ShardingStrategy::OptimGrads => (v, 4 + 8 + main_params),
        ShardingStrategy::OptimGradsParams => (0, v + 4 + 8 + main_params),
    }
}

/// The strategies `megatron inspect` compares.
const COMPARED: [ShardingStrategy; 4] = [
    ShardingStrategy::NoShard,
    ShardingStrategy::Optim,
    ShardingStrategy::OptimGrads,
    ShardingStrategy::OptimGradsParams,
];

/// One pipeline chunk: its rank, chunk, virtual stage, layers and ends.
struct StageRow {
    rank: usize,
    chunk: usize,
    stage: usize,
    layers: std::ops::Range<usize>,
    first: bool,
    last: bool,
}

/// The chunks of every pipeline rank, in rank then chunk order.
fn stage_rows(args: &InspectArgs, layers: usize) -> Result<Vec<StageRow>> {
    if args.vpp > 1 && args.pp < 2 {
        bail!(
            "--virtual-pipeline-model-parallel-size {} needs a pipeline of at least 2 stages, got \
             --pipeline-model-parallel-size {}",
            args.vpp,
            args.pp
        );
    }
    let layout = PipelineLayout::new(
        layers,
        args.pp,
        args.vpp,
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
    )?;
    Ok((0..args.pp)
        .flat_map(|rank| (0..args.vpp).map(move |chunk| (rank, chunk)))
        .map(|(rank, chunk)| {
            let part = layout.part(rank, chunk);
            StageRow {
                rank,
                chunk,
                stage: layout.virtual_stage(rank, chunk),
                layers: part.layers,
                first: part.first,
                last: part.last,
            }
        })
        .collect())
}

/// Micro batch and sequence length of the measured layer (any values work; the report divides them out).
const B: usize = 2;
const S: usize = 3;

/// One collective of a phase: group, operation, calls and elements per call (`None`: sizes the
/// routing sets at run time, the MoE dispatcher's all-to-alls).
struct Collective {
    group: &'static str,
    op: &'static str,
    calls: u64,
    elements_per_call: Option<u64>,
}

/// The collectives in `stats` (f32 payloads: bytes / 4 elements).
fn collectives(stats: &[(GroupKind, CommStats)]) -> Vec<Collective> {
    stats
        .iter()
        .flat_map(|(kind, s)| {
            s.ops.iter().map(move |(op, o)| Collective {
                group: kind.name(),
                op: op.name(),
                calls: o.calls,
                elements_per_call: (*op != megatron::comm::OpKind::AllToAll)
                    .then(|| o.bytes / 4 / o.calls.max(1)),
            })
        })
        .collect()
}

/// The sizes a layer's collectives were measured at: the hidden size, the sequence length and
/// the tensor-parallel size.
#[derive(Debug, Clone, Copy)]
struct Measured {
    h: usize,
    s: usize,
    tp: usize,
}

/// `elements` as a multiple of b·s·h (the layer's activation size), or of a sequence shard
/// b·s·h/tp, when it is one.
fn in_bsh(elements: Option<u64>, m: Measured) -> String {
    let Some(elements) = elements else {
        return "sizes the routing sets at run time".to_string();
    };
    let bsh = (B * m.s * m.h) as u64;
    if elements.is_multiple_of(bsh) {
        match elements / bsh {
            1 => "b·s·h".to_string(),
            k => format!("{k}·b·s·h"),
        }
    } else if m.tp > 1 && elements * m.tp as u64 == bsh {
        "b·s·h/tp".to_string()
    } else {
        format!("{elements} elements at b = {B}, s = {}", m.s)
    }
}

fn split_name(spec: &ParamSpec) -> String {
    match spec.split {
        Split::Replicated => "replicated".to_string(),
        Split::Dim { dim, group } => format!("dim {dim} over {group} ({} parts)", spec.parts),
        Split::Strided { dim, group, blocks } => format!(
            "dim {dim}, each of its {blocks} blocks over {group} ({} parts)",
            spec.parts
        ),
        Split::Experts { dim, blocks: 1 } => {
            format!("dim 0 over ep, dim {dim} over etp ({} parts)", spec.parts)
        }
        Split::Experts { dim, blocks } => format!(
            "dim 0 over ep, each of dim {dim}'s {blocks} blocks over etp ({} parts)",
            spec.parts
        ),
        Split::QueryGroups { groups, .. } => format!(
            "dim 0 over tp ({} parts), each of the {groups} key/value heads on {} ranks",
            spec.parts,
            spec.parts / groups.max(1)
        ),
    }
}

/// The most ranks the layer's collectives are measured on: from 2 ranks on, a layer makes the
/// same calls of the same activation-sized payloads at any tensor-parallel size.
const MEASURED_TP: usize = 8;

/// Runs one forward and one backward of a stand-in for a transformer layer on `min(tp, 8)`
/// ranks; returns rank 0's communication in each, and the stand-in's hidden size (the unit
/// of its payloads). The stand-in has the layer's kind (dense or the first MoE layer, with
/// its top-k) and structure at the smallest sizes tp divides (a head and 2 hidden units a
/// rank, MLPs and experts of 1 unit a rank, top-k experts): the same collectives, without a
/// model's worth of weights.
fn layer_collectives(
    config: &GptConfig,
    tp: usize,
    sequence_parallel: bool,
) -> Result<(Vec<Collective>, Vec<Collective>, Measured)> {
    let tp = tp.min(MEASURED_TP);
    // With sequence parallelism each rank takes a shard of S positions of a sequence of S·tp.
    let (s, shard) = if sequence_parallel && tp > 1 {
        (S * tp, S)
    } else {
        (S, S)
    };
    // The stand-in has no expert parallelism: its experts whole on each rank.
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp).with_etp(1))?;
    let mut config = config.clone();
    config.num_layers = 1;
    config.num_attention_heads = tp;
    config.num_query_groups = config.num_query_groups.map(|_| tp);
    config.kv_channels = None;
    config.hidden_size = 2 * tp;
    config.ffn_hidden_size = tp;
    if let Some(moe) = &mut config.moe {
        moe.ffn_hidden_size = 1;
        moe.router.num_experts = moe.router.topk;
        // Groups choose among the experts; the stand-in's are all chosen.
        moe.router.group_limited = None;
        moe.shared_expert_ffn = moe.shared_expert_ffn.map(|_| tp);
        moe.layer_freq = megatron::models::MoeLayerFreq::Every(1);
    }
    let spec = config.spec().blocks.remove(0);
    let h = config.hidden_size;
    let out = launch(tp, |w| -> Result<_> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sequence_parallel);
        let block = Block::build(&spec, &mut Builder::for_rank(0, ps.groups()).meta())?;
        let cx = Cx::new(&ps, 0).eval();
        let x = Tensor::zeros([shard, B, h], DType::F32);
        let before = ps.stats();
        let (y, saved) = block.forward(&cx, Site::ROOT, &x)?;
        let middle = ps.stats();
        block.backward(&cx, Site::ROOT, saved, &y)?;
        let after = ps.stats();
        let diff = |a: &[(GroupKind, CommStats)],
                    b: &[(GroupKind, CommStats)]|
         -> Vec<(GroupKind, CommStats)> {
            b.iter()
                .zip(a)
                .map(|((k, n), (_, o))| (*k, n.since(o)))
                .filter(|(_, s)| !s.ops.is_empty())
                .collect()
        };
        Ok((diff(&before, &middle), diff(&middle, &after)))
    })
    .map_err(anyhow::Error::msg)?;
    let (fwd, bwd) = out.into_iter().next().expect("at least one rank");
    Ok((collectives(&fwd), collectives(&bwd), Measured { h, s, tp }))
}

/// The bytes one rank keeps from a dense layer's forward at `args`' sizes, without and (with
/// `sequence_parallel`) with sequence parallelism; `None` for a MoE model (its first layer is
/// not measured) or when the layer's weights and activations would not fit this machine's
/// memory.
fn layer_activations(
    config: &GptConfig,
    args: &InspectArgs,
    sequence_parallel: bool,
) -> Result<Option<(usize, Option<usize>)>> {
    let (s, b, tp) = (args.seq_length, args.micro_batch_size, args.tp);
    if config.moe.is_some() || !layer_fits(config, args) {
        return Ok(None);
    }
    let without = megatron::bench::activations::layer_bytes(config, (s, b), tp, false)?;
    let with = if sequence_parallel {
        Some(megatron::bench::activations::layer_bytes(
            config,
            (s, b),
            tp,
            true,
        )?)
    } else {
        None
    };
    Ok(Some((without, with)))
}

/// Whether one layer's weights and activations at `args`' sizes fit this machine's memory.
fn layer_fits(config: &GptConfig, args: &InspectArgs) -> bool {
    let (s, b, tp) = (args.seq_length, args.micro_batch_size, args.tp);
    let mut one = config.clone();
    one.num_layers = 1;
    let weights = one.num_params(tp) as u128;
    let (h, heads) = (
        config.hidden_size as u128,
        config.num_attention_heads as u128,
    );
    // The layer's f32 weights on every rank (each builds its part), a generous bound on its
    // activations (the paper's 34·sbh plus 5 attention maps, at 4 bytes) and their gradients.
    let tokens = (s * b) as u128;
    let need = 4 * weights + 2 * 4 * (34 * tokens * h + 5 * heads * tokens * s as u128);
    megatron::limits::check_memory("one layer's activations", need).is_ok()
}

/// Runs `megatron inspect`.
pub fn run(args: &InspectArgs) -> Result<()> {
    if args.tp == 0 {
        bail!("--tensor-model-parallel-size must be at least 1");
    }
    if args.dp == 0 || args.ep == 0 || args.etp == 0 {
        bail!(
            "--data-parallel-size, --expert-model-parallel-size and \
             --expert-tensor-parallel-size must be at least 1"
        );
    }
    // The expert layout folds a pipeline stage's tp·cp·dp ranks as etp·ep·edp (Megatron-LM's
    // second RankGenerator, without cp).
    let folded = args.tp * args.cp * args.dp;
    if !folded.is_multiple_of(args.ep * args.etp) {
        bail!(
            "--expert-tensor-parallel-size {} × --expert-model-parallel-size {} does not divide \
             --tensor-model-parallel-size {} × --context-parallel-size {} × \
             --data-parallel-size {} (the expert layout folds the same ranks as etp × ep × edp)",
            args.etp,
            args.ep,
            args.tp,
            args.cp,
            args.dp
        );
    }
    let edp = folded / (args.ep * args.etp);
    let config = args.arch.config(args.tp, args.ep, args.sequence_parallel)?;
    if args.sequence_parallel && args.tp == 1 {
        output::error_line(super::train::SEQUENCE_PARALLEL_AT_TP1);
    }
    let kind = CpCommType::from_flags(
        args.cp_comm_type.as_deref(),
        &args.hierarchical_context_parallel_sizes,
        args.cp,
    )?;
    let context_parallel = match args.cp {
        1 => None,
        cp => Some(inspect_cp::report(
            &config,
            (args.tp, args.sequence_parallel && args.tp > 1),
            (cp, kind),
            (args.seq_length, args.micro_batch_size),
            layer_fits(&config, args),
        )?),
    };
    let model = Gpt::build(
        &config.spec(),
        &mut Builder::new(0)
            .with_group(GroupKind::Tp, 0, args.tp)
            .with_group(GroupKind::Ep, 0, args.ep)
            .with_group(GroupKind::Etp, 0, args.etp)
            .specs_only(),
    )?;
    let mut specs = Vec::new();
    model.visit_params(&mut |p| specs.push(p.spec().clone()));
    drop(model);
    let total: usize = specs.iter().map(|s| s.logical.numel()).sum();
    let local: usize = specs.iter().map(|s| s.local.numel()).sum();
    let (fwd, bwd, measured) = layer_collectives(&config, args.tp, false)?;
    let sequence_parallel = args.sequence_parallel && args.tp > 1;
    // The bytes a rank keeps from one layer's forward, measured on the layer itself (its
    // weights built for real), without and with sequence parallelism.
    let activations = layer_activations(&config, args, sequence_parallel)?;
    // What crosses a pipeline boundary: the activation, or with sequence parallelism its shard.
    let carried = if sequence_parallel {
        "b·s·h/tp"
    } else {
        "b·s·h"
    };
    let sp = if sequence_parallel {
        Some(layer_collectives(&config, args.tp, true)?)
    } else {
        None
    };
    let padded = config.padded_vocab_size(args.tp);
    let stages = stage_rows(args, config.num_layers)?;
    let balance = (args.pp > 1)
        .then(|| {
            super::inspect_balance::balance(
                &config,
                (args.pp, args.vpp),
                args.seq_length,
                (
                    args.decoder_first_pipeline_num_layers,
                    args.decoder_last_pipeline_num_layers,
                ),
            )
        })
        .transpose()?;
    // Each boundary between virtual stages carries a b·s·h f32 activation forward and its
    // gradient back, per microbatch.
    let boundaries = args.pp * args.vpp - 1;
    let precision = Precision::from_flags(&PrecisionFlags {
        bf16: args.bf16,
        fp16: args.fp16,
        grads_in_fp32: args.accumulate_allreduce_grads_in_fp32,
        grad_reduce_in_bf16: args.grad_reduce_in_bf16,
        ..PrecisionFlags::default()
    })?;
    let instances = args.num_distributed_optimizer_instances;
    for (group, ranks) in [
        ("dp × cp", args.dp * args.cp),
        ("expert data-parallel", edp),
    ] {
        if ranks % instances != 0 {
            bail!(
                "--num-distributed-optimizer-instances {instances} must divide the {group} \
                 ranks ({ranks})"
            );
        }
    }
    let strategy = values::chosen_sharding(
        args.data_parallel_sharding_strategy,
        args.use_distributed_optimizer,
    )?;
    if instances > 1 && !strategy.shards_optimizer() {
        bail!(
            "--num-distributed-optimizer-instances {instances} shards the distributed \
             optimizer's state: add --use-distributed-optimizer"
        );
    }
    // With context parallelism the dense parameters' ranks are dp·cp (Megatron-LM's dp-cp
    // group): the distributed optimizer shards over them, or over each instance's part.
    let shard_ranks = (args.dp * args.cp / instances, edp / instances);
    let by_strategy = COMPARED
        .iter()
        .map(|&s| Ok((s, state_bytes(&specs, shard_ranks, s, &precision)?)))
        .collect::<Result<Vec<_>>>()?;
    let chosen = state_bytes(&specs, shard_ranks, strategy, &precision)?;
    let (state_total, state_values, state_grads, state_optimizer) = (
        chosen.total(),
        chosen.values,
        chosen.grads,
        chosen.optimizer,
    );
    let active = config.active_params(args.tp);
    if args.json {
        let params: Vec<Value> = specs
            .iter()
            .map(|s| json!({ "name": s.name, "logical": s.logical.dims(), "local": s.local.dims(), "split": split_name(s) }))
            .collect();
        let phase = |cs: &[Collective], m: Measured| -> Vec<Value> {
            cs.iter()
                .map(|c| json!({ "group": c.group, "op": c.op, "calls": c.calls, "elements_per_call": in_bsh(c.elements_per_call, m) }))
                .collect()
        };
        let out = json!({
            "model": args.arch.model_name(),
            "tp": args.tp,
            "vocab_size": config.vocab_size,
            "padded_vocab_size": padded,
            "parameters_total": total,
            "parameters_per_rank": local,
            "parameters_active_per_token": active,
            "mtp": config.mtp.map(|m| json!({
                "num_layers": m.num_layers,
                "loss_scaling_factor": m.loss_scaling_factor,
                "parameters": config.mtp_params(args.tp, false),
                "parameters_active_per_token": config.mtp_params(args.tp, true),
            })),
            "moe": config.moe.as_ref().map(|m| json!({
                "num_experts": m.router.num_experts,
                "topk": m.router.topk,
                "ffn_hidden_size": m.ffn_hidden_size,
                "moe_layers": config.moe_layers().unwrap_or_default().iter().filter(|&&b| b).count(),
                "ep": args.ep,
                "etp": args.etp,
                "edp": edp,
            })),
            "parameters": params,
            "state_bytes_per_param": {
                "dp": args.dp,
                "distributed_optimizer": strategy.shards_optimizer(),
                "sharding_strategy": strategy.name(),
                "distributed_optimizer_instances": instances,
                "param_dtype": precision.params.name(),
                "grad_dtype": precision.grads.name(),
                "total": state_total,
                "values": state_values,
                "grads": state_grads,
                "optimizer": state_optimizer,
                "by_strategy": by_strategy.iter().map(|(s, b)| {
                    let (whole, sharded) = state_formula(*s, &precision);
                    json!({
                        "strategy": s.name(),
                        "total": b.total(),
                        "values": b.values,
                        "grads": b.grads,
                        "optimizer": b.optimizer,
                        "gathered_peak": gathered_peak(&specs, *s, &precision).0,
                        "gathered_peak_with_prefetch": gathered_peak(&specs, *s, &precision).1,
                        "formula": { "whole": whole, "sharded": sharded, "ranks": shard_ranks.0 },
                    })
                }).collect::<Vec<_>>(),
            },
            "layer_collectives": { "forward": phase(&fwd, measured), "backward": phase(&bwd, measured) },
            "sequence_parallel_layer_collectives": sp.as_ref().map(|(f, b, m)| json!({ "forward": phase(f, *m), "backward": phase(b, *m) })),
            "context_parallel": context_parallel.as_ref().map(|r| r.json()),
            "kv_cache_values_per_token": config.kv_cache_values_per_token(),
            "layer_activation_bytes": activations.as_ref().map(|(without, with)| json!({
                "seq_length": args.seq_length,
                "micro_batch_size": args.micro_batch_size,
                "per_rank": without,
                "per_rank_sequence_parallel": with,
            })),
            "pipeline": {
                "pp": args.pp,
                "vpp": args.vpp,
                "stages": stages.iter().map(|r| json!({
                    "pp_rank": r.rank,
                    "chunk": r.chunk,
                    "virtual_stage": r.stage,
                    "layers": [r.layers.start, r.layers.end],
                    "embedding": r.first,
                    "head": r.last,
                })).collect::<Vec<_>>(),
                "p2p_per_microbatch": {
                    "boundaries": boundaries,
                    "forward_elements": carried,
                    "backward_elements": carried,
                    "bytes_per_boundary": format!("2·4·{carried}"),
                },
                "balance": balance.as_ref().map(|b| b.json()),
            },
        });
        say!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} at tensor-parallel size {}",
        args.arch.model_name(),
        args.tp
    );
    let _ = writeln!(
        out,
        "vocabulary {} padded to {padded} (a multiple of {} × {})",
        config.vocab_size, config.make_vocab_size_divisible_by, args.tp
    );
    let _ = writeln!(
        out,
        "parameters: {:.2}M in total, {:.2}M on each rank",
        total as f64 / 1e6,
        local as f64 / 1e6
    );
    if let Some(mtp) = &config.mtp {
        let _ = writeln!(
            out,
            "multi-token prediction: {} depth{} on the last pipeline stage, {:.2}M of the \
             parameters ({:.2}M active per token; the embedding and the output layer are the \
             model's), losses weighted {} / {}",
            mtp.num_layers,
            if mtp.num_layers == 1 { "" } else { "s" },
            config.mtp_params(args.tp, false) as f64 / 1e6,
            config.mtp_params(args.tp, true) as f64 / 1e6,
            mtp.loss_scaling_factor,
            mtp.num_layers
        );
    }
    if let Some(moe) = &config.moe {
        let layers = config.moe_layers()?;
        let _ = writeln!(
            out,
            "mixture of experts: {} of {} layers, {} experts of ffn {} each, top-{}; {:.2}M \
             parameters active per token; experts split over ep {}, each over etp {} (edp \
             {edp})",
            layers.iter().filter(|&&b| b).count(),
            layers.len(),
            moe.router.num_experts,
            moe.ffn_hidden_size,
            moe.router.topk,
            active as f64 / 1e6,
            args.ep,
            args.etp
        );
    }
    let cached = config.kv_cache_values_per_token();
    match &config.mla {
        Some(mla) => {
            let expanded = config.num_layers
                * config.num_attention_heads
                * (mla.q_head_dim() + mla.v_head_dim);
            // Llama 3's grouped-query attention at the same depth: 8 key/value heads of 128.
            let gqa = config.num_layers * 2 * 8 * 128;
            let _ = writeln!(
                out,
                "KV cache per token in generation: {cached} values ({} KiB in f32), MLA's latent \
                 and rotary key per layer; its expanded keys and values would be {expanded} \
                 ({:.0}×), a Llama of {} layers with 8 key/value heads of 128 caches {gqa} \
                 ({:.1}×)",
                cached * 4 / 1024,
                expanded as f64 / cached as f64,
                config.num_layers,
                gqa as f64 / cached as f64
            );
        }
        None => {
            let _ = writeln!(
                out,
                "KV cache per token in generation: {cached} values ({} KiB in f32), keys and \
                 values of {} key/value heads per layer",
                cached * 4 / 1024,
                config.query_groups()
            );
        }
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "state of a rank at dp {}{}, {} parameters and {} gradients: {state_total:.1} bytes per \
         parameter (values {state_values:.1}, gradients {state_grads:.1}, optimizer \
         {state_optimizer:.1})\n",
        args.dp,
        match (strategy, instances) {
            (ShardingStrategy::NoShard, _) => String::new(),
            (ShardingStrategy::Optim, 1) => " with the distributed optimizer".to_string(),
            (ShardingStrategy::Optim, k) => {
                format!(" with the distributed optimizer in {k} instances")
            }
            (s, 1) => format!(" under {}", s.name()),
            (s, k) => format!(" under {} in {k} instances", s.name()),
        },
        precision.params,
        precision.grads
    );
    let _ = writeln!(
        out,
        "bytes per parameter by --data-parallel-sharding-strategy, a shard cut for n = {} ranks:",
        shard_ranks.0
    );
    let _ = writeln!(
        out,
        "  {:<20} {:>7} {:>7} {:>10} {:>10} {:>9}   formula",
        "strategy", "total", "values", "gradients", "optimizer", "gathered"
    );
    for (s, b) in &by_strategy {
        let formula = match state_formula(*s, &precision) {
            (whole, 0) => format!("{whole}"),
            (0, sharded) => format!("{sharded}/n"),
            (whole, sharded) => format!("{whole} + {sharded}/n"),
        };
        let _ = writeln!(
            out,
            "  {:<20} {:>7.1} {:>7.1} {:>10.1} {:>10.1} {:>9.2}   {formula}",
            s.name(),
            b.total(),
            b.values,
            b.grads,
            b.optimizer,
            gathered_peak(&specs, *s, &precision).0,
        );
    }
    let _ = writeln!(
        out,
        "  (gathered: the most whole values held at once, bytes per parameter; optim_grads_params \
         gathers the root unit and a stack's modules one at a time, and with \
         --overlap-param-gather the next one too. \
         optim_grads and optim_grads_params also hold each bucket's whole gradients from a \
         micro-batch's first write in it to its reduce-scatter)\n"
    );
    let _ = writeln!(
        out,
        "{:<28} {:<16} {:<16} split",
        "parameter", "logical", "local"
    );
    // The first dense block and the first MoE block stand for the others.
    let layers = config.moe_layers()?;
    let shown: Vec<String> = [false, true]
        .iter()
        .filter_map(|kind| layers.iter().position(|b| b == kind))
        .map(|i| format!("blocks.{i}."))
        .collect();
    for s in &specs {
        if s.name.starts_with("blocks.") && !shown.iter().any(|b| s.name.starts_with(b)) {
            continue;
        }
        let _ = writeln!(
            out,
            "{:<28} {:<16} {:<16} {}",
            s.name,
            s.logical.to_string(),
            s.local.to_string(),
            split_name(s)
        );
    }
    if config.num_layers > shown.len() {
        let _ = writeln!(
            out,
            "(the other blocks as the one shown of their kind{})",
            if config.moe.is_some() {
                ": dense or MoE"
            } else {
                ""
            }
        );
    }
    let mut tables = vec![("", &fwd, &bwd, measured)];
    if let Some((f, b, m)) = &sp {
        tables.push((", with sequence parallelism", f, b, *m));
    }
    for (with, fwd, bwd, m) in tables {
        let _ = writeln!(
            out,
            "\ncollectives of one transformer layer{with} (b: micro batch, s: sequence length, h: \
             hidden size, tp: tensor-parallel size):"
        );
        for (name, cs) in [("forward", fwd), ("backward", bwd)] {
            if cs.is_empty() {
                let _ = writeln!(out, "  {name:<9} none");
            }
            for c in cs.iter() {
                let size = match c.elements_per_call {
                    Some(_) => format!("of {} f32", in_bsh(c.elements_per_call, m)),
                    // The MoE dispatcher: the per-expert counts, then the rows of h values.
                    None => "(rows of h f32, in forward after the per-expert counts: sizes the routing sets at run time)"
                        .into(),
                };
                let _ = writeln!(out, "  {name:<9} {} {} × {} {size}", c.group, c.op, c.calls);
            }
        }
    }
    match &activations {
        Some((without, with)) => {
            let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
            let _ = writeln!(
                out,
                "\nactivation memory of one transformer layer (what its forward keeps for \
                 backward, per rank, s = {}, b = {}, measured): {:.1} MiB{}",
                args.seq_length,
                args.micro_batch_size,
                mib(*without),
                with.map_or(String::new(), |w| format!(
                    "; with sequence parallelism {:.1} MiB",
                    mib(w)
                ))
            );
        }
        None => {
            let _ = writeln!(
                out,
                "\nactivation memory of one transformer layer: not measured ({})",
                if config.moe.is_some() {
                    "MoE layers are not measured yet".to_string()
                } else {
                    format!(
                        "the layer does not fit this machine's memory at s = {}, b = {}: lower \
                         --seq-length",
                        args.seq_length, args.micro_batch_size
                    )
                }
            );
        }
    }
    if let Some(report) = &context_parallel {
        report.text(&mut out);
    }
    if args.pp > 1 {
        let _ = writeln!(
            out,
            "\npipeline: {} stages × {} chunk{} (chunk k of rank r is virtual stage k·pp + r)",
            args.pp,
            args.vpp,
            if args.vpp == 1 { "" } else { "s" }
        );
        let untied = config.untie_embeddings_and_output_weights;
        let learned = config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute;
        let depths = config.mtp_depths();
        let mtp = match depths {
            0 => String::new(),
            1 => ", the depth of multi-token prediction (mtp.0)".to_string(),
            d => format!(", {d} depths of multi-token prediction (mtp.0..{d})"),
        };
        for r in &stages {
            let ends = match (r.first, r.last) {
                (true, _) if learned => " + embedding (wte, wpe)".to_string(),
                (true, _) => " + embedding (wte)".to_string(),
                (_, true) if untied && depths > 0 => format!(
                    " + ln_f{mtp}, the input table again for the depths (wte), the output \
                     layer (wte.output_weight) and loss"
                ),
                (_, true) if untied => {
                    format!(" + ln_f{mtp}, output layer (wte.output_weight) and loss")
                }
                (_, true) => format!(" + ln_f{mtp}, tied output layer (wte) and loss"),
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "  rank {} chunk {} (virtual stage {}): blocks {}..{}{ends}",
                r.rank, r.chunk, r.stage, r.layers.start, r.layers.end
            );
        }
        let _ = writeln!(
            out,
            "p2p per microbatch: {boundaries} stage boundar{}, each an f32 activation of \
             {carried} forward and its gradient back (2·4·{carried} bytes{}); {}",
            if boundaries == 1 { "y" } else { "ies" },
            if sequence_parallel {
                ": with sequence parallelism each stage sends its shard of the sequence"
            } else {
                ""
            },
            if untied && depths > 0 {
                "the input table is the first and the last stage's (the depths look the next \
                 tokens up), its gradient all-reduced over the embedding group once a step; the \
                 output table is the last stage's own"
            } else if untied {
                "the input and output tables are the first and the last stage's own: nothing \
                 is shared between them"
            } else {
                "the tied embedding's gradient all-reduced over the embedding group (first and \
                 last stage) once a step"
            }
        );
        if let Some(balance) = &balance {
            balance.text(&mut out);
        }
    }
    output::text(&out)?;
    Ok(())
}
