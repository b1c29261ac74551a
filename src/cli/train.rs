//! `megatron train`: trains a registered model with tensor × data parallelism on thread ranks
//! or, under `mpirun`/`srun`, on one process per rank.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::ProgressBar;
use megatron::context_parallel::CpCommType;
use megatron::cuda_graphs::ScopeSet;
use megatron::data::{
    Blend, GptDatasetConfig, SampleSource, Split as DataSplit, SplitVector, build_gpt_dataset,
};
use megatron::distributed::{DdpConfig, ShardingStrategy};
use megatron::job::{Eval, Observer, PipelineSettings, Placement, StopRequest, TrainJob};
pub(super) use megatron::launch::{Report, Runner};
use megatron::models::GptConfig;
use megatron::moe::DispatcherKind;
use megatron::optimizer::AdamWConfig;
use megatron::optimizer::{LossScaling, Precision, PrecisionFlags};
use megatron::pipeline_parallel::ScheduleKind;
use megatron::report::plot::Curves;
use megatron::tokenizer::Tokenizer;
use megatron::training::{
    BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Windows,
    default_bucket_elements,
};

use super::mask_args::{MaskArgs, unused_flags_note};
use super::model_args::ArchitectureArgs;
use super::observers::{JsonLog, Plot, Progress, TensorBoard};
use super::output::note;
use super::resume::{self, ContextParallelSettings, Recorded};
use super::values;

/// A source of training or validation samples.
type Source = Arc<dyn SampleSource>;

/// Arguments of `megatron train`, named as Megatron-LM's. With `--load`, the parallel layout,
/// batch, data, tokenizer and seed a flag leaves out are the checkpoint's (printed at the start).
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    arch: ArchitectureArgs,
    #[command(flatten)]
    masks: MaskArgs,
    #[command(flatten)]
    lora: super::lora_args::LoraArgs,
    /// Tensor-parallel size [default: 1, or the loaded checkpoint's].
    #[arg(long = "tensor-model-parallel-size", visible_alias = "tp", value_parser = values::ranks)]
    tp: Option<usize>,
    /// Sequence parallelism: outside the tensor-parallel regions (norms, dropouts, residuals)
    /// each tensor-parallel rank holds its shard of the sequence; the tensor-parallel
    /// all-reduces become all-gathers and reduce-scatters (Megatron-LM's `--sequence-parallel`;
    /// nothing with tensor-parallel size 1).
    #[arg(long)]
    sequence_parallel: bool,
    /// Context-parallel size: every sequence is cut into 2·cp chunks and each rank of a
    /// context-parallel group holds two (Megatron-LM's load balance), attention exchanging
    /// keys and values over the group as --cp-comm-type says; the world is tp × cp × pp × dp
    /// ranks [default: 1].
    #[arg(long = "context-parallel-size", visible_alias = "cp", value_parser = values::ranks)]
    cp: Option<usize>,
    /// How context-parallel attention exchanges keys and values: p2p (a ring), all_gather,
    /// a2a (heads traded for sequence by all-to-all), a2a+p2p (all-to-all inside groups of
    /// --hierarchical-context-parallel-sizes, a ring across them) [default: all_gather, or the
    /// loaded checkpoint's].
    #[arg(long)]
    cp_comm_type: Option<String>,
    /// With --cp-comm-type a2a+p2p: the all-to-all groups' size and the ring's, whose product
    /// is the context-parallel size (e.g. `2 4`).
    #[arg(long, num_args = 1.., value_parser = values::ranks)]
    hierarchical_context_parallel_sizes: Vec<usize>,
    /// Data-parallel size (the world is tp × cp × pp × dp ranks) [default: 1, or the loaded
    /// checkpoint's].
    #[arg(long = "data-parallel-size", visible_alias = "dp", value_parser = values::ranks)]
    dp: Option<usize>,
    /// Pipeline stages: the layers are cut into this many stages, one per rank of a pipeline
    /// group, trained with Megatron-LM's 1F1B schedule [default: 1, or the loaded checkpoint's].
    #[arg(
        long = "pipeline-model-parallel-size",
        visible_alias = "pp",
        value_parser = values::ranks
    )]
    pp: Option<usize>,
    /// Expert-parallel size: each MoE layer's experts are split over this many ranks, which
    /// exchange tokens by all-to-all (Megatron-LM's MoE folding: ep divides tp × dp) [default: 1].
    #[arg(long = "expert-model-parallel-size", visible_alias = "ep", value_parser = values::ranks)]
    ep: Option<usize>,
    /// Expert tensor-parallel size: each expert's linears split over this many ranks
    /// [default: 1].
    #[arg(
        long = "expert-tensor-parallel-size",
        visible_alias = "etp",
        value_parser = values::ranks
    )]
    etp: Option<usize>,
    /// How tokens reach their experts [default: alltoall, or the loaded checkpoint's].
    #[arg(long, value_enum)]
    moe_token_dispatcher_type: Option<Dispatcher>,
    /// The pipeline schedule: 1f1b, interleaved, zb-h1, zb-h2, zbv or dualpipev (the
    /// zero-bubble ones split each backward and defer its weight gradients) [default: 1f1b, or
    /// interleaved with --virtual-pipeline-model-parallel-size above 1].
    #[arg(long, value_parser = values::schedule)]
    pipeline_schedule: Option<megatron::pipeline_parallel::ScheduleKind>,
    /// Model chunks (virtual stages) per pipeline stage: the interleaved 1F1B schedule
    /// [default: 1; 2 for zbv and dualpipev].
    #[arg(
        long = "virtual-pipeline-model-parallel-size",
        visible_aliases = ["vpp", "num-virtual-stages-per-pipeline-rank"],
        value_parser = values::ranks
    )]
    vpp: Option<usize>,
    /// Layers per virtual pipeline stage (the interleaved schedule, the number of chunks
    /// derived: layers / pp / this).
    #[arg(long, value_parser = values::layers)]
    num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Contiguous microbatches each virtual stage runs (interleaved schedule) [default: pp].
    #[arg(
        long = "microbatch-group-size-per-virtual-pipeline-stage",
        visible_alias = "microbatch-group-size-per-vp-stage",
        value_parser = values::microbatches
    )]
    microbatch_group_size_per_vp_stage: Option<usize>,
    /// Layers of the first pipeline stage, the others sharing the rest evenly.
    #[arg(long, value_parser = values::layers)]
    decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers of the last pipeline stage, the others sharing the rest evenly.
    #[arg(long, value_parser = values::layers)]
    decoder_last_pipeline_num_layers: Option<usize>,
    /// Count the embedding as a layer of the pipeline split: the first virtual stage builds one
    /// transformer layer fewer.
    #[arg(long)]
    account_for_embedding_in_pipeline_split: bool,
    /// Count the loss (with the output layer) as a layer of the pipeline split: the last
    /// virtual stage builds one transformer layer fewer.
    #[arg(long)]
    account_for_loss_in_pipeline_split: bool,
    /// Tokens per sample [default: 128, or the loaded checkpoint's].
    #[arg(long, value_parser = values::batch)]
    seq_length: Option<usize>,
    /// Samples per microbatch on one rank [default: 4, or the loaded checkpoint's].
    #[arg(long, value_parser = values::batch)]
    micro_batch_size: Option<usize>,
    /// Samples per step over all data-parallel ranks [default: micro batch × dp, or the loaded
    /// checkpoint's].
    #[arg(long, value_parser = values::batch)]
    global_batch_size: Option<usize>,
    /// Optimizer steps to reach (a resumed run continues up to this step).
    #[arg(
        long = "train-iters",
        visible_alias = "steps",
        default_value_t = 100,
        value_parser = values::steps
    )]
    train_iters: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3, value_parser = values::non_negative)]
    lr: f64,
    /// Learning rate at the end of the decay [default: lr / 10].
    #[arg(long, value_parser = values::non_negative)]
    min_lr: Option<f64>,
    /// Steps of linear warmup.
    #[arg(long, default_value_t = 0, value_parser = values::steps_or_none)]
    lr_warmup_iters: u64,
    /// Step at which the decay ends [default: train-iters].
    #[arg(long, value_parser = values::steps)]
    lr_decay_iters: Option<u64>,
    /// Decay shape: constant, linear or cosine.
    #[arg(long, default_value = "cosine")]
    lr_decay_style: DecayStyle,
    /// Decoupled weight decay (not on biases and norms).
    #[arg(long, default_value_t = 0.01, value_parser = values::non_negative)]
    weight_decay: f64,
    /// Global gradient-norm clipping (0 disables).
    #[arg(long, default_value_t = 1.0, value_parser = values::non_negative)]
    clip_grad: f64,
    /// Adam β₁.
    #[arg(long, default_value_t = 0.9, value_parser = values::fraction)]
    adam_beta1: f64,
    /// Adam β₂.
    #[arg(long, default_value_t = 0.95, value_parser = values::fraction)]
    adam_beta2: f64,
    /// Adam ε.
    #[arg(long, default_value_t = 1e-8, value_parser = values::positive)]
    adam_eps: f64,
    /// Seed of parameters, data order and dropout [default: 1234, or the loaded checkpoint's].
    #[arg(long)]
    seed: Option<u64>,
    /// Training data: Megatron-LM indexed datasets as `PREFIX` or weighted `W1,PREFIX1,W2,PREFIX2`
    /// (also space-separated, as Megatron's `--data-path`), or one text file read as bytes
    /// [default: the loaded checkpoint's, else megatron-rs's own sources and docs, as bytes].
    #[arg(long, visible_alias = "data-path", num_args = 1..)]
    data: Vec<String>,
    /// The tokenizer the data was made with (`byte` or a tokenizer.json): sets the model's
    /// vocabulary; checkpoints carry a copy for `megatron generate` [default: the loaded
    /// checkpoint's, else byte].
    #[arg(long)]
    tokenizer: Option<String>,
    /// Fractions of the data for training, validation and test (Megatron's `--split`)
    /// [default: 969,30,1, or the loaded checkpoint's].
    #[arg(long, value_parser = values::split)]
    split: Option<String>,
    /// Evaluate on the validation split every N steps (and at the end) [default: never].
    #[arg(long, value_parser = values::steps)]
    eval_interval: Option<u64>,
    /// Global batches per evaluation (with --eval-interval) [default: 10].
    #[arg(long, value_parser = values::steps)]
    eval_iters: Option<u64>,
    /// Save checkpoints into this directory (every --save-interval steps, at the end, and when
    /// SIGINT or SIGTERM stops the run).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Steps between checkpoints [default: only at the end].
    #[arg(long, value_parser = values::steps)]
    save_interval: Option<u64>,
    /// Let this run replace the iterations in --save after the step it starts from (a run
    /// resumed from an earlier iteration, or a new run saving where another saved); without it
    /// such a run is refused before its first step.
    #[arg(long)]
    overwrite_checkpoints: bool,
    /// Start from this checkpoint (a save directory or an iteration directory): parameters,
    /// optimizer state and step; its architecture, and the settings other flags leave out.
    #[arg(long)]
    load: Option<PathBuf>,
    /// Write one JSON object per step and evaluation to this file (flushed every step), and
    /// the loss plot next to it.
    #[arg(long)]
    log_json: Option<PathBuf>,
    /// Add each step's communication on global rank 0 (per group and operation) to the log.
    #[arg(long)]
    comm_report: bool,
    /// Write the last step's timeline to this file as a Chrome trace (chrome://tracing,
    /// ui.perfetto.dev): every rank's forwards and backwards, the step's phases and each
    /// collective of each group, on the host's clock.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write TensorBoard scalars into this directory (flushed every step).
    #[arg(long)]
    tensorboard_dir: Option<PathBuf>,
    /// Elements after which a gradient bucket closes (in the first model chunk of the first
    /// pipeline stage, as Megatron-LM) [default: max(40M, 1M × dp)].
    #[arg(long, value_parser = values::elements)]
    ddp_bucket_size: Option<usize>,
    /// Megatron-LM's distributed optimizer (ZeRO-1): gradients reduce-scattered per bucket,
    /// each data-parallel rank updating its shard of the parameters with its shard of the
    /// optimizer state, then the parameters all-gathered.
    #[arg(long)]
    use_distributed_optimizer: bool,
    /// What data parallelism shards (Megatron-FSDP's --data-parallel-sharding-strategy):
    /// `no_shard`; `optim`, the optimizer state (as --use-distributed-optimizer); `optim_grads`,
    /// also the gradients: each bucket is reduce-scattered every micro-batch and its whole
    /// gradients freed, the rank keeping its shard (ZeRO-2); `optim_grads_params`, also the
    /// parameters: each module of a stack gathered around its forward and its backward, the
    /// rest of the model for each step's walk (ZeRO-3; --overlap-param-gather prefetches the
    /// next module). [default: optim with --use-distributed-optimizer, else no_shard]
    #[arg(long, value_parser = values::sharding_strategy, value_name = "STRATEGY")]
    data_parallel_sharding_strategy: Option<ShardingStrategy>,
    /// Start each gradient bucket's data-parallel reduction during the backward, as soon as
    /// every gradient in it is final (Megatron-LM's --overlap-grad-reduce): the same
    /// reductions, so the same run bit for bit. Not with --cuda-graph-scope.
    #[arg(long)]
    overlap_grad_reduce: bool,
    /// With --use-distributed-optimizer and --overlap-grad-reduce: start each bucket's
    /// all-gather of the updated parameters after the optimizer step, and wait for it at the
    /// next step's first read of the bucket (Megatron-LM's --overlap-param-gather). With
    /// optim_grads_params: each unit's gather starts the next unit's.
    #[arg(long)]
    overlap_param_gather: bool,
    /// With --overlap-param-gather and interleaved pipeline parallelism: update the first
    /// model chunk first and start its all-gathers during the others' update (Megatron-LM's
    /// --overlap-param-gather-with-optimizer-step). Each model chunk is then one bucket, as
    /// there: not with --ddp-bucket-size.
    #[arg(long)]
    overlap_param_gather_with_optimizer_step: bool,
    /// With --use-distributed-optimizer: shard the optimizer state within this many parts of
    /// the data-parallel group and replicate it across them (Megatron-LM's
    /// --num-distributed-optimizer-instances, HSDP): gradients are reduce-scattered within a
    /// part and the shards all-reduced across parts. It must divide dp × cp and the expert
    /// data-parallel size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    num_distributed_optimizer_instances: u64,
    /// Graph scopes to capture as CUDA graphs (Megatron-LM's --cuda-graph-scope): attn, mlp
    /// (dense layers), moe_router, moe_preprocess. Each is run eagerly once per in-flight
    /// slot, captured, then replayed; on the CPU the scopes are counted and run eagerly.
    /// Without it everything runs eagerly.
    #[arg(long = "cuda-graph-scope", num_args = 1.., value_name = "SCOPE")]
    cuda_graph_scope: Vec<String>,
    /// Activation recompute: `full` (whole transformer layers, with --recompute-method and
    /// --recompute-num-layers) or `selective` (the core attention's weights).
    #[arg(long)]
    recompute_granularity: Option<String>,
    /// With `full`: `uniform` (every layer, in groups of --recompute-num-layers keeping only
    /// their input) or `block` (the first --recompute-num-layers layers of each pipeline stage).
    #[arg(long)]
    recompute_method: Option<String>,
    /// With `full`: the layers per group (`uniform`) or per stage (`block`).
    #[arg(long, value_parser = values::layers)]
    recompute_num_layers: Option<usize>,
    /// Train on when a step's loss or gradient norm is NaN or infinite (by default the run
    /// stops with an error naming the step, before its update, as Megatron-LM does; off with
    /// --fp16's dynamic loss scaling, where an overflow skips the step instead).
    #[arg(long)]
    no_check_for_nan_in_loss_and_grad: bool,
    /// Mixed precision with bf16 parameters (stored and communicated in 16 bits), matrix
    /// products of bf16 operands summed in f32 (on the CPU as on a GPU), f32 gradients unless
    /// --grad-reduce-in-bf16, f32 main parameters and Adam state in the optimizer.
    #[arg(long)]
    bf16: bool,
    /// Mixed precision with fp16 parameters and gradients (f32 gradients with
    /// --accumulate-allreduce-grads-in-fp32) and dynamic loss scaling (or --loss-scale).
    #[arg(long)]
    fp16: bool,
    /// A static loss scale (with --fp16 or --bf16); without it --fp16 scales dynamically.
    #[arg(long, value_parser = values::loss_scale)]
    loss_scale: Option<f64>,
    /// The dynamic loss scale's start [default: 2^32].
    #[arg(long, value_parser = values::loss_scale)]
    initial_loss_scale: Option<f64>,
    /// The dynamic loss scale's floor [default: 1].
    #[arg(long, value_parser = values::loss_scale)]
    min_loss_scale: Option<f64>,
    /// Steps without inf/NaN gradients after which the dynamic loss scale doubles
    /// [default: 1000].
    #[arg(long, value_parser = values::steps)]
    loss_scale_window: Option<u64>,
    /// Steps with inf/NaN gradients (since the last growth) before each halving of the dynamic
    /// loss scale [default: 2].
    #[arg(long, value_parser = values::steps)]
    hysteresis: Option<u64>,
    /// Accumulate and reduce gradients in f32 (with --fp16; --bf16 does by default).
    #[arg(long)]
    accumulate_allreduce_grads_in_fp32: bool,
    /// The same as --accumulate-allreduce-grads-in-fp32 (Megatron-LM's DDP setting's name).
    #[arg(long)]
    grad_reduce_in_fp32: bool,
    /// With --bf16, accumulate and reduce gradients in bf16 instead of f32.
    #[arg(long)]
    grad_reduce_in_bf16: bool,
    /// No progress bar (the summary and the log are still written).
    #[arg(long)]
    quiet: bool,
    /// Where the ranks run: `threads` in this process, or `mpi`, one process per rank started
    /// by `mpirun -np N` / `srun` (N = tp × cp × pp × dp).
    #[arg(long, value_enum, default_value_t = Backend::Threads)]
    backend: Backend,
    /// `cpu`, or `cuda` (build with `--features cuda`): with the threads backend every rank
    /// shares GPU 0 through the device-local communicator; with `nccl`, one GPU per process.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// On a GPU, multiply in f32 instead of bf16 with f32 accumulation.
    #[arg(long)]
    fp32_products: bool,
    /// On a GPU, how attention runs: `unfused` (batched products and fused softmax/dropout
    /// kernels), `flash` (tiled kernels on the tensor cores, no s × s tensor kept; head sizes
    /// 32, 64, 96, 128 with bf16 products, other layers stay unfused), or `auto`: flash with
    /// bf16 products (on an H100, gpt-1.2b's step 32% faster in 31% less memory), else unfused
    /// (and with --context-parallel-size above 1, whose attention computes its own blocks).
    #[arg(long, value_enum, default_value_t = AttentionBackend::Auto)]
    attention_backend: AttentionBackend,
}

/// The pipeline schedule's flags (Megatron-LM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct ScheduleFlags {
    /// `--pipeline-schedule`.
    schedule: Option<megatron::pipeline_parallel::ScheduleKind>,
    /// `--virtual-pipeline-model-parallel-size`.
    vpp: Option<usize>,
    /// `--num-layers-per-virtual-pipeline-stage`.
    layers_per_virtual_stage: Option<usize>,
    /// `--microbatch-group-size-per-virtual-pipeline-stage`.
    group_size: Option<usize>,
    /// `--decoder-first-pipeline-num-layers`.
    first_stage_layers: Option<usize>,
    /// `--decoder-last-pipeline-num-layers`.
    last_stage_layers: Option<usize>,
    /// `--account-for-embedding-in-pipeline-split`, `--account-for-loss-in-pipeline-split`.
    account_for_embedding: bool,
    account_for_loss: bool,
}

/// How tokens reach their experts (Megatron-LM's `--moe-token-dispatcher-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Dispatcher {
    /// Permute, exchange the per-expert counts, one all-to-all with uneven splits, and back.
    Alltoall,
    /// All-gather every rank's tokens over the expert-parallel group, reduce-scatter back.
    Allgather,
}

/// How attention runs on a GPU (Megatron-LM's `--attention-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AttentionBackend {
    /// Batched products with fused softmax and dropout kernels between them.
    Unfused,
    /// Tiled flash kernels (FlashAttention-2's algorithm).
    Flash,
    /// Flash on a GPU with bf16 products, unfused otherwise.
    Auto,
}

/// Where the ranks of a training run live and how they communicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Backend {
    /// Thread ranks in this process.
    Threads,
    /// One CPU process per rank, launched by `mpirun`/`srun` (build with `--features mpi`).
    Mpi,
    /// One GPU process per rank with NCCL (build with `--features cuda`).
    Nccl,
}

/// The training and validation fractions of a `--split` such as `969,30,1` (Megatron-LM's
/// split vector, normalized).
fn valid_fraction(split: &str) -> Result<(f64, f64)> {
    let shares = split
        .parse::<SplitVector>()
        .with_context(|| format!("--split {split}"))?
        .shares();
    Ok((shares[0], shares[1]))
}

/// The note `--sequence-parallel` at tensor-parallel size 1 gets (train and inspect).
pub const SEQUENCE_PARALLEL_AT_TP1: &str = "note: --sequence-parallel with tensor-parallel size 1 \
     does nothing (there is no sequence to split): it is off, as Megatron-LM turns it off";

/// The split used when neither `--split` nor a loaded checkpoint gives one.
const DEFAULT_SPLIT: &str = "969,30,1";

/// The run's settings once `--load` is read: each as a flag gives it, else as the checkpoint
/// recorded it, else the default.
struct Settings {
    /// The model's preset name (for reports and checkpoints).
    model_name: String,
    /// The architecture.
    model: GptConfig,
    tp: usize,
    cp: usize,
    /// How context-parallel attention exchanges keys and values.
    cp_comm_type: CpCommType,
    ep: usize,
    etp: usize,
    dp: usize,
    pp: usize,
    /// The pipeline schedule's flags.
    schedule: ScheduleFlags,
    /// The mixed-precision flags.
    precision: PrecisionFlags,
    /// The MoE token dispatcher.
    dispatcher: Dispatcher,
    seq_length: usize,
    micro_batch: usize,
    global_batch: usize,
    seed: u64,
    /// `--data` values, dataset prefixes and files made absolute (empty: the built-in corpus).
    data: Vec<String>,
    split: String,
    tokenizer: Tokenizer,
    /// What was taken from the checkpoint, as the flags that would give it.
    taken: Vec<String>,
    /// The step the run starts from: the loaded checkpoint's iteration, else 0.
    start_step: u64,
}

/// `--data` values with every path made absolute (weights stay as they are), so that a
/// checkpoint's record of them holds wherever the run resumes.
fn absolute_data(values: &[String]) -> Result<Vec<String>> {
    values
        .iter()
        .map(|v| {
            if v.trim().parse::<f64>().is_ok() {
                return Ok(v.trim().to_string());
            }
            let path = std::path::absolute(v.trim())
                .with_context(|| format!("--data {v}: cannot make the path absolute"))?;
            Ok(path.display().to_string())
        })
        .collect()
}

impl TrainArgs {
    /// The model's name.
    pub(crate) fn model_name(&self) -> &str {
        self.arch.model_name()
    }

    /// `--data` split into its values (commas and spaces separate them).
    fn data_values(&self) -> Vec<String> {
        self.data
            .iter()
            .flat_map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
            })
            .collect()
    }

    /// Reads `--load`'s checkpoint (if any) and settles every setting: a flag wins, then the
    /// checkpoint's record, then the default. A flag that contradicts the checkpoint's model is
    /// an error.
    fn settings(&self) -> Result<Settings> {
        let meta = match &self.load {
            Some(path) => {
                // A save killed while replacing the iteration to load left it aside: put it back
                // (and remove what killed saves left) before reading it.
                if let Some(save) = megatron::checkpoint::save_dir_of(path) {
                    megatron::checkpoint::remove_interrupted_saves(&save);
                }
                Some(megatron::checkpoint::read_meta(path).context("--load")?)
            }
            None => None,
        };
        let run = meta.as_ref().map(|m| &m.run);
        let recorded_usize = |key: &str| run.and_then(|r| r[key].as_u64()).map(|v| v as usize);
        let mut taken = Vec::new();
        let mut pick = |flag: &str,
                        given: Option<usize>,
                        recorded: Option<usize>,
                        default: usize| match (given, recorded) {
            (Some(v), _) => v,
            (None, Some(v)) => {
                taken.push(format!("--{flag} {v}"));
                v
            }
            (None, None) => default,
        };
        let tp = pick("tp", self.tp, meta.as_ref().map(|m| m.saved_tp), 1);
        let dp = pick("dp", self.dp, meta.as_ref().map(|m| m.saved_dp), 1);
        let pp = pick("pp", self.pp, meta.as_ref().map(|m| m.saved_pp), 1);
        if tp == 0 || dp == 0 || pp == 0 {
            bail!(
                "--tensor-model-parallel-size, --pipeline-model-parallel-size and \
                 --data-parallel-size must be at least 1"
            );
        }
        // Checkpoints hold logical experts: a run resumes at any expert-parallel size.
        let recorded = meta
            .as_ref()
            .map(|m| Recorded::from_run(&m.run))
            .unwrap_or_default();
        let ep = pick("ep", self.ep, recorded.ep, 1);
        let etp = pick("etp", self.etp, recorded.etp, 1);
        let recorded_cp = recorded.context_parallel.clone();
        let cp = pick("cp", self.cp, recorded_cp.as_ref().map(|c| c.cp), 1);
        let seq_length = pick(
            "seq-length",
            self.seq_length,
            recorded_usize("seq_length"),
            128,
        );
        let micro_batch = pick(
            "micro-batch-size",
            self.micro_batch_size,
            recorded_usize("micro_batch_size"),
            4,
        );
        let global_batch = pick(
            "global-batch-size",
            self.global_batch_size,
            recorded_usize("global_batch_size"),
            micro_batch * dp,
        );
        let cp_comm_type = self.cp_comm_type(cp, recorded_cp, &mut taken)?;
        let seed = match (self.seed, &meta) {
            (Some(seed), _) => seed,
            (None, Some(m)) => {
                taken.push(format!("--seed {}", m.seed));
                m.seed
            }
            (None, None) => 1234,
        };
        let recorded_data: Option<Vec<String>> = run.and_then(|r| {
            r["data"].as_array().map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
        });
        let data = match (self.data_values(), recorded_data) {
            (given, _) if !given.is_empty() => absolute_data(&given)?,
            (_, Some(recorded)) => {
                taken.push(if recorded.is_empty() {
                    "--data (the built-in corpus)".to_string()
                } else {
                    format!("--data {}", recorded.join(" "))
                });
                recorded
            }
            _ => Vec::new(),
        };
        let split = match (&self.split, run.and_then(|r| r["split"].as_str())) {
            (Some(split), _) => split.clone(),
            (None, Some(split)) => {
                taken.push(format!("--split {split}"));
                split.to_string()
            }
            (None, None) => DEFAULT_SPLIT.to_string(),
        };
        let tokenizer_spec = match (&self.tokenizer, &self.load) {
            (Some(spec), _) => spec.clone(),
            (None, Some(load)) => match megatron::tokenizer::checkpoint_tokenizer(load)? {
                Some(spec) => {
                    taken.push(format!("--tokenizer {spec}"));
                    spec
                }
                None => "byte".to_string(),
            },
            (None, None) => "byte".to_string(),
        };
        let tokenizer = Tokenizer::from_spec(&tokenizer_spec)
            .with_context(|| format!("--tokenizer {tokenizer_spec}"))?;
        let precision = match &meta {
            Some(m) => resume::precision(
                self.precision_flags(),
                recorded.precision,
                m.grad_scaler.is_some(),
                &mut taken,
            )?,
            None => self.precision_flags(),
        };
        let dispatcher = match (
            self.moe_token_dispatcher_type,
            &recorded.moe_token_dispatcher_type,
        ) {
            (Some(d), _) => d,
            (None, Some(name)) => {
                let d = Dispatcher::from_str(name, true).map_err(anyhow::Error::msg)?;
                taken.push(format!("--moe-token-dispatcher-type {name}"));
                d
            }
            (None, None) => Dispatcher::Alltoall,
        };
        let schedule = self.schedule_flags(pp, recorded.pipeline, &mut taken);
        let (model_name, model) = match &meta {
            Some(m) => {
                let path = self.load.as_deref().unwrap_or(Path::new(""));
                let saved: GptConfig =
                    serde_json::from_value(m.model.clone()).with_context(|| {
                        format!("{}: the checkpoint's model config", path.display())
                    })?;
                let saved_name = m.run["model"].as_str();
                self.arch.check_against(&saved, saved_name)?;
                if let Some(spec) = &self.tokenizer
                    && saved.vocab_size != tokenizer.vocab_size()
                {
                    bail!(
                        "--tokenizer {spec} has {} tokens, the checkpoint's model {}",
                        tokenizer.vocab_size(),
                        saved.vocab_size
                    );
                }
                // An imported checkpoint records no preset.
                let name = saved_name
                    .or(self.arch.model())
                    .unwrap_or("the checkpoint's model")
                    .to_string();
                (
                    name,
                    self.arch.apply(saved, tp, ep, self.sequence_parallel)?,
                )
            }
            None => {
                let mut model = self.arch.config(tp, ep, self.sequence_parallel)?;
                if let Some(spec) = &self.tokenizer {
                    if let Some(given) = self.arch.vocab_size()
                        && given != tokenizer.vocab_size()
                    {
                        bail!(
                            "--vocab-size {given} contradicts --tokenizer {spec}, which has {} \
                             tokens: drop --vocab-size (the tokenizer sets it)",
                            tokenizer.vocab_size()
                        );
                    }
                    model.vocab_size = tokenizer.vocab_size();
                    model.validate_parallel(tp, ep, self.sequence_parallel)?;
                } else if model.vocab_size < 256 {
                    // Without --tokenizer the data is bytes: ids up to 255.
                    bail!(
                        "--vocab-size {} is smaller than the 256 byte values of the data (read \
                         as bytes without --tokenizer): its token ids would fall outside the \
                         vocabulary",
                        model.vocab_size
                    );
                }
                (self.arch.model_name().to_string(), model)
            }
        };
        let mut model = model;
        let saved_lora = model.lora.take();
        model.lora = self.lora.config(&model, saved_lora.as_ref(), &mut taken)?;
        if seq_length > model.max_position_embeddings {
            bail!(
                "--seq-length {seq_length} exceeds --max-position-embeddings {}",
                model.max_position_embeddings
            );
        }
        Ok(Settings {
            model_name,
            model,
            tp,
            cp,
            cp_comm_type,
            ep,
            etp,
            dp,
            pp,
            schedule,
            precision,
            dispatcher,
            seq_length,
            micro_batch,
            global_batch,
            seed,
            data,
            split,
            tokenizer,
            taken,
            start_step: meta.as_ref().map_or(0, |m| m.iteration),
        })
    }

    /// How context-parallel attention exchanges at `cp`: the flags as given; when none is and
    /// the run keeps the checkpoint's `cp`, the checkpoint's (each setting taken added to
    /// `taken`); else all_gather. The flags are refused at `cp` 1, where they do nothing.
    fn cp_comm_type(
        &self,
        cp: usize,
        recorded: Option<ContextParallelSettings>,
        taken: &mut Vec<String>,
    ) -> Result<CpCommType> {
        let hierarchical = &self.hierarchical_context_parallel_sizes;
        let (name, sizes) = match (&self.cp_comm_type, recorded) {
            (None, Some(r)) if r.cp == cp && cp > 1 && hierarchical.is_empty() => {
                taken.push(format!("--cp-comm-type {}", r.comm_type));
                if !r.hierarchical.is_empty() {
                    let sizes: Vec<String> = r.hierarchical.iter().map(usize::to_string).collect();
                    taken.push(format!(
                        "--hierarchical-context-parallel-sizes {}",
                        sizes.join(" ")
                    ));
                }
                (Some(r.comm_type), r.hierarchical)
            }
            (given, _) => (given.clone(), hierarchical.clone()),
        };
        Ok(CpCommType::from_flags(name.as_deref(), &sizes, cp)?)
    }

    /// The schedule's flags as given; when none is and the run keeps the checkpoint's `pp`,
    /// the checkpoint's schedule (each setting taken added to `taken`).
    fn schedule_flags(
        &self,
        pp: usize,
        recorded: Option<PipelineSettings>,
        taken: &mut Vec<String>,
    ) -> ScheduleFlags {
        let given = ScheduleFlags {
            schedule: self.pipeline_schedule,
            vpp: self.vpp,
            layers_per_virtual_stage: self.num_layers_per_virtual_pipeline_stage,
            group_size: self.microbatch_group_size_per_vp_stage,
            first_stage_layers: self.decoder_first_pipeline_num_layers,
            last_stage_layers: self.decoder_last_pipeline_num_layers,
            account_for_embedding: self.account_for_embedding_in_pipeline_split,
            account_for_loss: self.account_for_loss_in_pipeline_split,
        };
        match recorded {
            Some(r) if given == ScheduleFlags::default() && r.pp == pp => {
                if let Some(kind) = r.schedule {
                    taken.push(format!("--pipeline-schedule {kind}"));
                }
                for (flag, value) in [
                    ("vpp", (r.vpp > 1).then_some(r.vpp)),
                    (
                        "microbatch-group-size-per-virtual-pipeline-stage",
                        r.group_size,
                    ),
                    ("decoder-first-pipeline-num-layers", r.first_stage_layers),
                    ("decoder-last-pipeline-num-layers", r.last_stage_layers),
                ] {
                    if let Some(v) = value {
                        taken.push(format!("--{flag} {v}"));
                    }
                }
                for (flag, on) in [
                    (
                        "account-for-embedding-in-pipeline-split",
                        r.account_for_embedding,
                    ),
                    ("account-for-loss-in-pipeline-split", r.account_for_loss),
                ] {
                    if on {
                        taken.push(format!("--{flag}"));
                    }
                }
                ScheduleFlags {
                    schedule: r.schedule,
                    vpp: Some(r.vpp),
                    layers_per_virtual_stage: None,
                    group_size: r.group_size,
                    first_stage_layers: r.first_stage_layers,
                    last_stage_layers: r.last_stage_layers,
                    account_for_embedding: r.account_for_embedding,
                    account_for_loss: r.account_for_loss,
                }
            }
            _ => given,
        }
    }

    /// The pipeline settings of a model of `layers` layers on `pp` stages, with Megatron-LM's
    /// checks of the layer assignment and of the schedule of `microbatches` per step.
    fn pipeline(
        f: &ScheduleFlags,
        pp: usize,
        layers: usize,
        microbatches: usize,
    ) -> Result<PipelineSettings> {
        let uneven = f.first_stage_layers.is_some() || f.last_stage_layers.is_some();
        let vpp = match (f.vpp, f.layers_per_virtual_stage) {
            (Some(_), Some(_)) => bail!(
                "give one of --virtual-pipeline-model-parallel-size and \
                 --num-layers-per-virtual-pipeline-stage, not both"
            ),
            (Some(v), None) => v,
            (None, Some(_)) if uneven => bail!(
                "with uneven first or last stages, give the virtual stages with \
                 --virtual-pipeline-model-parallel-size (--num-virtual-stages-per-pipeline-rank), \
                 not --num-layers-per-virtual-pipeline-stage"
            ),
            (None, Some(0)) => bail!("--num-layers-per-virtual-pipeline-stage must be at least 1"),
            (None, Some(per_stage)) => {
                if !layers.is_multiple_of(pp) || !(layers / pp).is_multiple_of(per_stage) {
                    bail!(
                        "--num-layers-per-virtual-pipeline-stage {per_stage}: the {layers} layers \
                         over pp = {pp} stages ({} each) must divide into virtual stages of \
                         {per_stage}",
                        layers as f64 / pp as f64
                    );
                }
                layers / pp / per_stage
            }
            (None, None) => match f.schedule {
                Some(kind) => kind.chunks(None)?,
                None => 1,
            },
        };
        let settings = PipelineSettings {
            pp,
            vpp,
            group_size: f.group_size,
            first_stage_layers: f.first_stage_layers,
            last_stage_layers: f.last_stage_layers,
            schedule: f.schedule,
            account_for_embedding: f.account_for_embedding,
            account_for_loss: f.account_for_loss,
        };
        if pp == 1 && (f.account_for_embedding || f.account_for_loss) {
            bail!(
                "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split \
                 count the ends in a pipeline's split: add --pp, or drop them"
            );
        }
        if pp == 1 && f.schedule.is_some_and(|k| k != ScheduleKind::OneFOneB) {
            bail!(
                "--pipeline-schedule {} needs a pipeline (a single stage runs each microbatch's \
                 forward, then its backward): add --pp, or drop it",
                settings.kind()
            );
        }
        if uneven && pp == 1 {
            bail!("--decoder-first/last-pipeline-num-layers need a pipeline: add --pp");
        }
        // Megatron-LM ignores a group size without virtual stages; the command line says so.
        megatron::pipeline_parallel::ScheduleConfig {
            group_size: settings.group_size,
            ..megatron::pipeline_parallel::ScheduleConfig::named(
                settings.kind(),
                pp,
                Some(settings.vpp),
                microbatches,
            )?
        }
        .check_group_used()?;
        settings.schedule(microbatches)?;
        settings.layout(layers)?;
        Ok(settings)
    }

    /// What data parallelism shards: `--data-parallel-sharding-strategy`, or `optim` with
    /// `--use-distributed-optimizer`.
    fn sharding(&self) -> Result<ShardingStrategy> {
        values::chosen_sharding(
            self.data_parallel_sharding_strategy,
            self.use_distributed_optimizer,
        )
    }

    /// Checks the flags that need no data or checkpoint to check (each value alone was
    /// checked as it was parsed, by [`values`]).
    fn check_flags(&self) -> Result<()> {
        // Flags that do nothing in the combination given (Megatron-LM ignores most of them).
        for (flag, given, needs, present) in [
            (
                "--save-interval",
                self.save_interval.is_some(),
                "--save",
                self.save.is_some(),
            ),
            (
                "--eval-iters",
                self.eval_iters.is_some(),
                "--eval-interval",
                self.eval_interval.is_some(),
            ),
            (
                "--comm-report",
                self.comm_report,
                "--log-json",
                self.log_json.is_some(),
            ),
        ] {
            if given && !present {
                bail!("{flag} does nothing without {needs}: add {needs} or drop {flag}");
            }
        }
        if let Some(path) = &self.trace {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            if path.is_dir() || !dir.is_dir() {
                bail!(
                    "--trace {}: the trace is a file, written at the end of the run, in a \
                     directory that exists",
                    path.display()
                );
            }
        }
        let sharding = self.sharding()?;
        if self.overlap_param_gather && !sharding.shards_optimizer() {
            bail!(
                "--overlap-param-gather overlaps the distributed optimizer's all-gather of the \
                 parameters: add --use-distributed-optimizer"
            );
        }
        if self.overlap_param_gather && !self.overlap_grad_reduce {
            bail!("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM): add it");
        }
        if self.overlap_param_gather_with_optimizer_step && !self.overlap_param_gather {
            bail!(
                "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather (as in \
                 Megatron-LM): add it"
            );
        }
        if self.num_distributed_optimizer_instances > 1 && !sharding.shards_optimizer() {
            bail!(
                "--num-distributed-optimizer-instances {} shards the distributed optimizer's \
                 state: add --use-distributed-optimizer",
                self.num_distributed_optimizer_instances
            );
        }
        if self.overlap_param_gather_with_optimizer_step && self.ddp_bucket_size.is_some() {
            bail!(
                "--ddp-bucket-size with --overlap-param-gather-with-optimizer-step: Megatron-LM \
                 keeps each model chunk in one bucket with it; drop --ddp-bucket-size"
            );
        }
        if sharding.shards_gradients() && !self.cuda_graph_scope.is_empty() {
            bail!(
                "--data-parallel-sharding-strategy {} with --cuda-graph-scope: a replayed graph's \
                 backward writes gradients without telling their buckets, and the buckets' \
                 storage is freed and allocated again every micro-batch where a graph keeps the \
                 addresses it captured; drop one of them",
                sharding.name()
            );
        }
        if self.overlap_grad_reduce && !self.cuda_graph_scope.is_empty() {
            bail!(
                "--overlap-grad-reduce with --cuda-graph-scope: a replayed graph's backward \
                 writes gradients without telling their buckets, and a bucket completed in a \
                 capture would start its reduction inside the graph; drop one of them"
            );
        }
        if let Some(kind) = self.pipeline_schedule
            && !self.cuda_graph_scope.is_empty()
        {
            megatron::cuda_graphs::check_schedule(kind)?;
        }
        if self.fp32_products && self.device == "cpu" {
            bail!(
                "--fp32-products chooses a GPU's products (the CPU multiplies in f32, or in bf16 \
                 with --bf16): drop it or add --device cuda"
            );
        }
        if self.lr_decay_style == DecayStyle::Constant {
            for (flag, given) in [
                ("--min-lr", self.min_lr.is_some()),
                ("--lr-decay-iters", self.lr_decay_iters.is_some()),
            ] {
                if given {
                    bail!(
                        "{flag} does nothing with --lr-decay-style constant (the rate never \
                         decays): drop it or choose linear or cosine"
                    );
                }
            }
        }
        // Megatron-LM's OptimizerParamScheduler: the warm-up ends before the decay does.
        let decay = self.lr_decay_iters.unwrap_or(self.train_iters);
        if self.lr_warmup_iters >= decay && self.lr_warmup_iters > 0 {
            bail!(
                "--lr-warmup-iters {} must be less than --lr-decay-iters {decay} (which is \
                 --train-iters when not given): the warm-up would never end",
                self.lr_warmup_iters
            );
        }
        if let Some(min_lr) = self.min_lr
            && min_lr > self.lr
        {
            bail!(
                "--min-lr {min_lr} must be between 0 and --lr {} (the decay ends at it)",
                self.lr
            );
        }
        Ok(())
    }

    /// Global batches per evaluation: --eval-iters, else 10.
    fn eval_iters(&self) -> u64 {
        self.eval_iters.unwrap_or(10)
    }

    /// Refuses to save over iterations of --save after `start` (the step the run starts
    /// from) unless --overwrite-checkpoints says to.
    fn check_later_checkpoints(&self, start: u64) -> Result<()> {
        let Some(save) = &self.save else {
            return Ok(());
        };
        let later: Vec<String> = megatron::checkpoint::saved_iterations(save)
            .into_iter()
            .filter(|&i| i > start)
            .map(|i| i.to_string())
            .collect();
        if !later.is_empty() && !self.overwrite_checkpoints {
            bail!(
                "--save {} holds iteration{} {} after step {start}, where this run starts: its \
                 saves would replace them; add --overwrite-checkpoints to allow it, or give \
                 another --save",
                save.display(),
                if later.len() == 1 { "" } else { "s" },
                later.join(", ")
            );
        }
        Ok(())
    }

    /// Training and validation samples: Megatron indexed datasets (blended, split by documents
    /// as Megatron splits them, every index checked first), or a text file or the default
    /// corpus as bytes (split by position).
    fn data_sources(&self, s: &Settings, plan: BatchPlan) -> Result<(Source, Option<Source>)> {
        let values = &s.data;
        let text = match values.as_slice() {
            [] => Some(megatron::data::default_corpus().to_vec()),
            [one] if Path::new(one).is_file() && !Path::new(&format!("{one}.idx")).exists() => {
                Some(std::fs::read(one).with_context(|| format!("reading --data {one}"))?)
            }
            _ => None,
        };
        if let Some(bytes) = text {
            let (train_fraction, valid_fraction) = valid_fraction(&s.split)?;
            let stream = TokenStream::from_bytes(&bytes);
            let (train, rest) = stream.split(train_fraction);
            let (valid, _test) =
                rest.split(valid_fraction / (1.0 - train_fraction).max(f64::MIN_POSITIVE));
            let train: Arc<dyn SampleSource> =
                Arc::new(Windows::new(train, plan.seq_length, s.seed)?);
            let valid = Windows::new(valid, plan.seq_length, s.seed ^ 0x0076_616c_6964)
                .ok()
                .map(|w| Arc::new(w) as Arc<dyn SampleSource>);
            return Ok((train, valid));
        }
        let blend = Blend::open(values).context("--data")?;
        blend.validate().context("--data")?;
        self.check_document_ends(&blend, s)?;
        let split: SplitVector = s.split.parse()?;
        let config = GptDatasetConfig {
            seq_length: plan.seq_length,
            seed: s.seed as u32,
            split,
        };
        let global = plan.global_batch as u64;
        let train_samples = self.train_iters * global;
        let evals = self
            .eval_interval
            .map_or(0, |i| self.train_iters / i.max(1) + 1);
        let valid_samples = evals * self.eval_iters() * global;
        let Some(train) =
            build_gpt_dataset(&blend, &config, DataSplit::Train, Some(train_samples))?
        else {
            bail!("--split {} leaves no training data", s.split);
        };
        let valid = if valid_samples > 0 {
            build_gpt_dataset(&blend, &config, DataSplit::Valid, Some(valid_samples))?
        } else {
            None
        };
        Ok((train, valid))
    }

    /// Refuses datasets whose first documents end with a token the model's vocabulary lacks
    /// (an end-of-document token the preprocessing appended: the byte tokenizer's is 256, one
    /// past a 256-token model), naming the way out; the rest of the tokens are checked as
    /// they are read.
    fn check_document_ends(&self, blend: &Blend, s: &Settings) -> Result<()> {
        let vocab = s.model.vocab_size;
        for dataset in &blend.datasets {
            for d in 0..dataset.documents().min(8) {
                let Some(&last) = dataset.document(d)?.last() else {
                    continue;
                };
                if (last as u64) < vocab as u64 {
                    continue;
                }
                let eod = s.tokenizer.eod().map(i64::from) == Some(last);
                let hint = match (eod, self.tokenizer.is_some()) {
                    (true, false) => format!(
                        ": it is the byte tokenizer's end-of-document token (the data was \
                         preprocessed with --append-eod); give --tokenizer byte, whose {} \
                         tokens the model then has, or --vocab-size {}",
                        s.tokenizer.vocab_size(),
                        s.tokenizer.vocab_size()
                    ),
                    (true, true) => format!(
                        ": it is the tokenizer's end-of-document token; the model needs at \
                         least {} tokens",
                        last + 1
                    ),
                    _ => String::new(),
                };
                bail!(
                    "--data {}: document {d} ends with token {last}, outside the model's \
                     vocabulary of {vocab}{hint}",
                    dataset.prefix().display()
                );
            }
        }
        Ok(())
    }

    /// The training job these arguments describe.
    pub(crate) fn job(&self) -> Result<TrainJob> {
        self.job_and_notes().map(|(job, _)| job)
    }

    /// [`TrainArgs::job`], with what was taken from the loaded checkpoint (as the flags that
    /// would give it) for the run to print.
    fn job_and_notes(&self) -> Result<(TrainJob, Vec<String>)> {
        self.check_flags()?;
        let mut s = self.settings()?;
        self.check_later_checkpoints(s.start_step)?;
        let plan = BatchPlan {
            seq_length: s.seq_length,
            micro_batch: s.micro_batch,
            global_batch: s.global_batch,
            dp: s.dp,
        };
        plan.validate()?;
        let pipeline = Self::pipeline(&s.schedule, s.pp, s.model.num_layers, plan.microbatches())?;
        // Each stack of layers a recompute setting applies to: a pipeline stage's chunk.
        let stages = pipeline.layout(s.model.num_layers)?;
        let per_stack = (0..pipeline.pp)
            .flat_map(|r| (0..pipeline.vpp).map(move |c| (r, c)))
            .map(|(r, c)| stages.part(r, c).layers.len())
            .min()
            .unwrap_or(s.model.num_layers);
        let recompute = megatron::module::Recompute::from_flags(
            self.recompute_granularity.as_deref(),
            self.recompute_method.as_deref(),
            self.recompute_num_layers,
            per_stack,
            pipeline.vpp > 1,
        )?;
        let precision = Precision::from_flags(&s.precision)?;
        let (train_data, valid_data) = self.data_sources(&s, plan)?;
        let masks = self.masks.flags(s.tokenizer.eod());
        if masks.reads_documents() && !self.cuda_graph_scope.is_empty() {
            bail!(
                "--cuda-graph-scope with {}: each microbatch's documents have their own \
                 lengths, which a captured graph cannot follow; drop one of them",
                self.masks.given().join(" ")
            );
        }
        let train_data = Sampler::new(train_data, plan)?.with_masks(masks)?;
        let eval = match self.eval_interval {
            Some(interval) => {
                let Some(valid) = valid_data else {
                    bail!(
                        "--eval-interval needs a validation split, but --split {} gives it nothing",
                        s.split
                    );
                };
                Some(Eval {
                    data: Sampler::new(valid, plan)?.with_masks(masks)?,
                    interval,
                    iters: self.eval_iters(),
                })
            }
            None => None,
        };
        let train = TrainConfig {
            schedule: LrSchedule {
                max_lr: self.lr,
                min_lr: self.min_lr.unwrap_or(self.lr / 10.0),
                warmup_steps: self.lr_warmup_iters,
                decay_steps: self.lr_decay_iters.unwrap_or(self.train_iters),
                style: self.lr_decay_style,
            },
            adam: AdamWConfig {
                beta1: self.adam_beta1,
                beta2: self.adam_beta2,
                eps: self.adam_eps,
                weight_decay: self.weight_decay,
            },
            clip_grad: self.clip_grad,
            seed: s.seed,
            // One bucket per model chunk with the first chunk's gather overlapped with the
            // optimizer step, as Megatron-LM disables bucketing then.
            bucket_elements: match self.overlap_param_gather_with_optimizer_step {
                true => usize::MAX,
                false => self
                    .ddp_bucket_size
                    .unwrap_or_else(|| default_bucket_elements(s.dp)),
            },
            // Megatron-LM turns the check off under dynamic loss scaling: an overflow there
            // is the scaler's signal, and the step is skipped instead.
            check_for_nan: !self.no_check_for_nan_in_loss_and_grad
                && !matches!(precision.scaling, LossScaling::Dynamic { .. }),
            distributed_optimizer: self.sharding()?.shards_optimizer(),
            recompute,
            precision,
        };
        let (tokenizer, mut files) = megatron::tokenizer::checkpoint_record(&s.tokenizer)?;
        // What an import carried from Hugging Face (the original config, generation settings,
        // tokenizer files) goes on into this run's saves, for their export.
        if let Some(load) = &self.load {
            files.extend(megatron::convert::hf_files::carried_in(load).context("--load")?);
        }
        let etp = s.etp;
        match (&s.model.moe, s.ep, etp) {
            (None, ep, etp) if ep > 1 || etp > 1 => bail!(
                "--expert-model-parallel-size {ep} and --expert-tensor-parallel-size {etp} split \
                 experts, but the model has none: add --num-experts (or --model gpt-moe-tiny)"
            ),
            (_, 0, _) | (_, _, 0) => bail!(
                "--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1"
            ),
            _ => {}
        }
        if s.model.moe.is_none()
            && let Some(kind) = self.moe_token_dispatcher_type
        {
            bail!(
                "--moe-token-dispatcher-type {} does nothing without MoE layers: add \
                 --num-experts or drop it",
                kind.to_possible_value()
                    .map_or(String::new(), |v| v.get_name().to_string())
            );
        }
        if let Some(moe) = &mut s.model.moe {
            moe.dispatcher = match s.dispatcher {
                Dispatcher::Alltoall => DispatcherKind::AllToAll,
                Dispatcher::Allgather => DispatcherKind::AllGather,
            };
        }
        let dispatcher_name = s.model.moe.as_ref().map(|_| {
            s.dispatcher
                .to_possible_value()
                .map_or(String::new(), |v| v.get_name().to_string())
        });
        if self.sequence_parallel && s.tp == 1 {
            super::output::error_line(SEQUENCE_PARALLEL_AT_TP1);
        }
        let job = TrainJob {
            model_name: s.model_name.clone(),
            model: s.model,
            tp: s.tp,
            sequence_parallel: self.sequence_parallel && s.tp > 1,
            cp: s.cp,
            cp_comm_type: s.cp_comm_type,
            ep: s.ep,
            etp,
            dp: s.dp,
            pipeline,
            steps: self.train_iters,
            train_data,
            eval,
            train,
            save: self
                .save
                .clone()
                .map(|dir| (dir, self.save_interval.unwrap_or(self.train_iters))),
            load: self.load.clone(),
            run_info: serde_json::json!({
                "model": s.model_name,
                "seq_length": s.seq_length,
                "micro_batch_size": s.micro_batch,
                "global_batch_size": s.global_batch,
                "data": s.data,
                "split": s.split,
                "tokenizer": tokenizer,
                "training": Recorded {
                    precision: Some(s.precision),
                    ep: Some(s.ep),
                    etp: Some(etp),
                    moe_token_dispatcher_type: dispatcher_name,
                    pipeline: Some(pipeline),
                    context_parallel: Some(ContextParallelSettings::new(s.cp, s.cp_comm_type)),
                }
                .to_value(),
            }),
            files,
            device: match self.device.as_str() {
                "cpu" if self.attention_backend == AttentionBackend::Flash => {
                    bail!("--attention-backend flash runs on a GPU: add --device cuda")
                }
                "cuda"
                    if self.attention_backend == AttentionBackend::Flash && self.fp32_products =>
                {
                    bail!("--attention-backend flash multiplies in bf16: drop --fp32-products")
                }
                "cpu" => Placement::Cpu,
                "cuda" => Placement::Cuda {
                    bf16: !self.fp32_products,
                    flash_attention: match self.attention_backend {
                        AttentionBackend::Flash => true,
                        AttentionBackend::Unfused => false,
                        // Context-parallel attention runs its own blocks.
                        AttentionBackend::Auto => !self.fp32_products && s.cp == 1,
                    },
                },
                other => bail!("--device must be cpu or cuda, got {other:?}"),
            },
            stop: None,
            rank_steps: None,
            trace: self.trace.clone(),
            cuda_graph_scope: ScopeSet::parse(&self.cuda_graph_scope)
                .context("--cuda-graph-scope")?,
            ddp: DdpConfig {
                overlap_grad_reduce: self.overlap_grad_reduce,
                overlap_param_gather: self.overlap_param_gather,
                overlap_param_gather_with_optimizer_step: self
                    .overlap_param_gather_with_optimizer_step,
                num_distributed_optimizer_instances: usize::try_from(
                    self.num_distributed_optimizer_instances,
                )
                .context("--num-distributed-optimizer-instances")?,
                sharding: self.sharding()?,
            },
        };
        Ok((job, s.taken))
    }

    /// The mixed-precision flags as given.
    fn precision_flags(&self) -> PrecisionFlags {
        PrecisionFlags {
            bf16: self.bf16,
            fp16: self.fp16,
            loss_scale: self.loss_scale,
            initial_loss_scale: self.initial_loss_scale,
            min_loss_scale: self.min_loss_scale,
            loss_scale_window: self.loss_scale_window,
            hysteresis: self.hysteresis,
            grads_in_fp32: self.accumulate_allreduce_grads_in_fp32 || self.grad_reduce_in_fp32,
            grad_reduce_in_bf16: self.grad_reduce_in_bf16,
        }
    }

    /// Where the ranks run.
    pub(super) fn backend(&self) -> Backend {
        self.backend
    }
}

/// Runs `megatron train` on the chosen backend.
pub fn run(args: &TrainArgs) -> Result<()> {
    let (mut job, taken) = args.job_and_notes()?;
    check_machine(args.backend, &job)?;
    let stop = StopRequest::new();
    on_signals(&stop)?;
    job.stop = Some(stop.clone());
    on_ranks(args.backend, &job, &mut |runner, _| {
        run_job(args, &job, &taken, runner)
    })
}

/// Refuses a job this process cannot hold: more thread ranks than it can run, or more memory
/// for the parameters, gradients and Adam's state of its ranks than the machine has.
fn check_machine(backend: Backend, job: &TrainJob) -> Result<()> {
    let world = job.world_size();
    if backend != Backend::Threads {
        return Ok(());
    }
    megatron::limits::check(
        format!("the thread ranks of {}:", job.layout_name()),
        world as u128,
        megatron::limits::MAX_THREAD_RANKS,
        "thread ranks of one process: run more as processes, --backend mpi",
    )?;
    if job.device != Placement::Cpu {
        return Ok(());
    }
    let params = job.model.num_params(job.tp);
    let plan = job.train_data.plan();
    megatron::limits::check_memory(
        &format!(
            "{} ({} parameters, --seq-length {}, --micro-batch-size {}) at data-parallel size {} \
             and context-parallel size {} in this process",
            job.model_name, params, plan.seq_length, plan.micro_batch, job.dp, job.cp
        ),
        job_bytes(
            &job.model,
            job.tp,
            (plan.seq_length, plan.micro_batch),
            (job.cp, job.dp),
        ),
    )?;
    Ok(())
}

/// The bytes a job of `model` at `tp`, sequences of `seq` in microbatches of `batch`, on `cp`
/// context-parallel and `dp` data-parallel ranks, holds in one process at most.
fn job_bytes(
    model: &GptConfig,
    tp: usize,
    (seq, batch): (usize, usize),
    (cp, dp): (usize, usize),
) -> u128 {
    // Each context-parallel rank of a data-parallel replica holds the model once over its
    // tp × pp ranks: values, gradients and two Adam moments in f32 at most, plus f32 main
    // values with 16 bits.
    let state = model.num_params(tp) as u128 * 20 * cp as u128;
    // The activations a microbatch keeps for its backward, after Megatron-LM's estimate
    // (s·b·h·(34 + 5·a·s/h) bytes a layer in 16 bits; twice that in f32), for the
    // microbatches a pipeline keeps in flight (one a stage's layers, up to pp of them). With
    // context parallelism the cp ranks share the s positions, and the blockwise attention
    // keeps no s × s weights: each rank computes one pair of chunks' scores at a time
    // ((s/2cp)² a head), a log-sum-exp per position kept.
    let (s, b, h, a, layers) = (
        seq as u128,
        batch as u128,
        model.hidden_size as u128,
        model.num_attention_heads as u128,
        model.num_layers as u128,
    );
    let attention = match cp as u128 {
        1 => layers * 10 * a * s * s * b,
        cp => layers * 8 * a * s * b + 2 * a * b * s * s / cp,
    };
    let activations = layers * 68 * s * b * h + attention;
    (state + activations) * dp as u128
}

/// SIGINT and SIGTERM ask the run to stop after the current step (Megatron-LM's
/// `--exit-signal-handler`): `stop` records the signal. A second signal exits at once, with
/// status 128 + its number, as a shell reports a process killed by it, after one line on
/// standard error that says what was lost.
fn on_signals(stop: &StopRequest) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let first_seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        let seen = first_seen.clone();
        let message: &'static [u8] = if signal == SIGINT {
            b"error: a second SIGINT: stopped at once, without finishing the step or saving it; \
              the checkpoints saved before stay\n"
        } else {
            b"error: a second SIGTERM: stopped at once, without finishing the step or saving \
              it; the checkpoints saved before stay\n"
        };
        // Registered first, so it runs first: on the second signal, the flag is already set.
        // SAFETY: the handler only loads an atomic, writes a static buffer with write(2) and
        // exits with _exit(2), all async-signal-safe.
        unsafe {
            signal_hook::low_level::register(signal, move || {
                if seen.load(std::sync::atomic::Ordering::SeqCst) {
                    let _ = libc::write(2, message.as_ptr().cast(), message.len());
                    signal_hook::low_level::exit(128 + signal);
                }
            })
        }
        .context("installing the signal handler")?;
        signal_hook::flag::register(signal, first_seen.clone())
            .context("installing the signal handler")?;
        signal_hook::flag::register_usize(signal, stop.signal_slot(), signal as usize)
            .context("installing the signal handler")?;
    }
    Ok(())
}

/// A signal's name, for messages.
fn signal_name(signal: usize) -> String {
    match signal as i32 {
        signal_hook::consts::SIGINT => "SIGINT".to_string(),
        signal_hook::consts::SIGTERM => "SIGTERM".to_string(),
        other => format!("signal {other}"),
    }
}

/// Makes sure `dir` can take a checkpoint before the first step (a save that fails after the
/// whole run would lose it): creates it and writes and removes a probe file.
fn check_writable_dir(dir: &Path, flag: &str) -> Result<()> {
    megatron::checkpoint::create_dir(dir)
        .with_context(|| format!("{flag} {}: cannot create the directory", dir.display()))?;
    let probe = dir.join(format!(".megatron-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("{flag} {}: cannot write into the directory", dir.display()))?;
    std::fs::remove_file(&probe).with_context(|| {
        format!(
            "{flag} {}: cannot remove {}",
            dir.display(),
            probe.display()
        )
    })
}

/// Runs `job` on this process's ranks of `backend`. Rank 0 (every thread rank of one process,
/// or process 0 of an `mpirun`/`srun` launch) calls `report` with a runner of the job (which
/// it may run with its observers, and prints) and the number of GPUs the ranks run on (one per
/// process with NCCL, else 1); the other processes run `job` without observers. A process whose
/// rank fails prints its error and aborts every process of the launch.
pub(super) fn on_ranks(backend: Backend, job: &TrainJob, report: &mut Report<'_>) -> Result<()> {
    match backend {
        Backend::Threads => report(&mut |job, observers| job.run(observers), 1),
        Backend::Mpi => megatron::launch::on_mpi_ranks(job, report),
        Backend::Nccl => megatron::gpu::on_nccl_ranks(job, report),
    }
}

/// Runs the job with `run` on the chosen ranks, printing the plan, progress and the summary.
fn run_job(args: &TrainArgs, job: &TrainJob, taken: &[String], run: &mut Runner<'_>) -> Result<()> {
    if let Some(load) = &args.load
        && !taken.is_empty()
    {
        note!(
            "from the checkpoint {}: {}",
            load.display(),
            taken.join(" ")
        );
    }
    let _lock = match &job.save {
        Some((dir, _)) => {
            check_writable_dir(dir, "--save")?;
            let lock = megatron::checkpoint::SaveLock::acquire(dir)?;
            if let Some(pid) = lock.took_over() {
                note!(
                    "--save {}: process {pid}, which saved here, ended without releasing the \
                     directory; this run takes it over",
                    dir.display()
                );
            }
            Some(lock)
        }
        None => None,
    };
    if let Some(line) = unused_flags_note(job.train_data.masks(), job.train_data.source().as_ref())
    {
        note!("{line}");
    }
    let plan = *job.train_data.plan();
    let params = job.model.num_params(job.tp);
    let flops_per_token = job.model.flops_per_token(plan.seq_length, job.tp);
    note!(
        "training {} ({:.2}M parameters) with {} on {} {}: {} steps of {} tokens ({} microbatches of {} per rank)",
        job.model_name,
        params as f64 / 1e6,
        job.layout_name(),
        job.world_size(),
        match (args.backend, job.device) {
            (Backend::Threads, Placement::Cpu) => "thread ranks",
            (Backend::Threads, Placement::Cuda { .. }) => "thread ranks sharing GPU 0",
            (Backend::Mpi, _) => "MPI processes",
            (Backend::Nccl, _) => "GPUs",
        },
        job.steps,
        plan.global_batch * plan.seq_length,
        plan.microbatches(),
        plan.micro_batch
    );
    if job.device == Placement::Cpu
        && job.train.precision.params == megatron_core::tensor::DType::BF16
    {
        use megatron_core::kernels::isa::{Isa, amx_in_hardware};
        let emulated = Isa::detected().amx() && !amx_in_hardware();
        note!(
            "bf16 products on {}{}",
            megatron_core::kernels::gemm::bf16_kernel_name(),
            if emulated {
                " (AMX emulated in software: MEGATRON_EMULATE_AMX=1)"
            } else {
                ""
            }
        );
    }
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(job.steps)
    };
    let _logging = super::logging::init(bar.clone());
    let mut observers: Vec<Box<dyn Observer>> = vec![Box::new(Progress::new(bar))];
    if let Some(path) = &args.log_json {
        // Only a regular file is read back (a resumed run's earlier steps) and drawn beside;
        // a device or a pipe that something reads takes the lines as they come.
        let regular = path.is_file() || !path.exists();
        let resuming = args.load.is_some() && path.is_file();
        let earlier = if resuming {
            Curves::from_log(
                &std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?,
            )?
        } else {
            Curves::default()
        };
        observers.push(Box::new(JsonLog::create(path, args.comm_report, resuming)?));
        if regular {
            let png = path.with_extension("png");
            observers.push(Box::new(Plot::new(
                png,
                format!("{} ({})", job.model_name, job.layout_name()),
                earlier,
            )));
        }
    }
    if let Some(dir) = &args.tensorboard_dir {
        observers.push(Box::new(TensorBoard::create(dir)?));
    }
    let summary = run(job, &mut observers)?;
    let (Some(first), Some(last)) = (summary.steps.first(), summary.steps.last()) else {
        note!(
            "no steps run (the checkpoint is at step {} of {})",
            summary.first_step,
            job.steps
        );
        return Ok(());
    };
    let tokens_per_s = summary.median_tokens_per_s().unwrap_or(0.0);
    let median_ms = plan.global_batch as f64 * plan.seq_length as f64
        / tokens_per_s.max(f64::MIN_POSITIVE)
        * 1e3;
    note!(
        "loss {:.4} → {:.4} over {} steps in {:.1} s; median step {:.1} ms: {:.0} tokens/s, {:.1} GFLOP/s of model FLOPs",
        first.0,
        last.0,
        summary.steps.len(),
        summary.seconds,
        median_ms,
        tokens_per_s,
        tokens_per_s * flops_per_token / 1e9
    );
    let state = summary.state;
    note!(
        "rank 0's state: {:.1} bytes per parameter (values {:.1}, gradients {:.1}{}, optimizer \
         {:.1}{})",
        state.per_param(state.total()),
        state.per_param(state.values),
        state.per_param(state.grads),
        if state.copies > 0 {
            format!(", copies {:.1}", state.per_param(state.copies))
        } else {
            String::new()
        },
        state.per_param(state.optimizer),
        if state.frozen > 0 {
            format!(", frozen values {:.1}", state.per_param(state.frozen))
        } else {
            String::new()
        },
    );
    if state.frozen_params > 0 {
        note!(
            "{} of rank 0's parameters frozen: {:.1} bytes each (values alone); the {} that \
             train: {:.1} bytes each",
            state.frozen_params,
            state.frozen as f64 / state.frozen_params as f64,
            state.params - state.frozen_params,
            (state.total() - state.frozen) as f64
                / (state.params - state.frozen_params).max(1) as f64
        );
    }
    if let Some(e) = summary.evals.last() {
        note!(
            "validation loss {:.4}, perplexity {:.2} at step {}",
            e.loss,
            e.perplexity(),
            e.step
        );
    }
    if let Some(done) = summary.stopped_after {
        let why = job
            .stop
            .as_ref()
            .and_then(StopRequest::requested)
            .map_or("a stop request".to_string(), signal_name);
        let saved = match &job.save {
            Some((dir, _)) => format!("the checkpoint of step {done} is in {}", dir.display()),
            None => "no checkpoint saved (no --save)".to_string(),
        };
        bail!(
            "stopped by {why} after step {done} of {}: {saved}; the logs hold every step",
            job.steps
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_parallel_jobs_are_estimated_without_the_attention_weights_they_do_not_keep() {
        let tiny = megatron::models::preset("gpt-tiny")
            .map(|p| (p.config)())
            .unwrap();
        let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
        // The README's 16,384 positions at cp 4: bench measured 0.55 GiB of tensors; the
        // estimate is a bound, 1.1 GiB.
        let cp4 = gib(job_bytes(&tiny, 1, (16384, 1), (4, 1)));
        assert!(cp4 < 2.0, "{cp4} GiB");
        // At cp 1 the unfused attention keeps every head's s × s weights: 40 GiB.
        let cp1 = gib(job_bytes(&tiny, 1, (16384, 1), (1, 1)));
        assert!(cp1 > 40.0, "{cp1} GiB");
    }
}
