//! Training: the [`Trainer`] of one rank and its step. The step engine (`engine.rs`) walks the
//! rank's plan of the schedule (every microbatch forward and backward, gradients accumulating;
//! through the pipeline when there is one, `pipeline.rs`); then the step reduces the gradients
//! over data parallelism ([`crate::distributed`]), sums the loss, lets the MoE layers update
//! their expert bias ([`crate::moe::step`]), checks for inf, clips and updates
//! ([`crate::optimizer`]) and gathers the parameters. Also here: the data sampler and the
//! learning-rate schedule.

mod data;
mod engine;
mod lr_schedule;
mod masks;
mod pipeline;

use std::time::Instant;

pub use data::{BatchPlan, Sampler, TokenStream, Windows};
use engine::Mode;
pub use lr_schedule::{DecayStyle, LrSchedule};
pub use masks::{MaskFlags, Microbatch, eod_loss_mask, token_weight};
pub use pipeline::{CarriedWidth, Chunks, PipelinedLanguageModel};

use crate::comm::{CommStats, ParallelState, ReduceOp};
use crate::cuda_graphs::{GraphRuntime, GraphStats, ScopeSet};
use crate::distributed::{
    Bucket, DdpConfig, GradSync, PackLayout, ParamBuffers, ParamGather, ParamUnits, ReduceGroups,
    ShardingStrategy, gather_parameters, reduce_gradients,
};
use crate::error::{Error, Result};
use crate::invalid;
use crate::module::{Cx, Ids, Module};
use crate::moe::{RoutingLog, RoutingTotals};
use crate::ops::AuxLossLog;
use crate::optimizer::{
    AdamW, AdamWConfig, GradScaler, LayoutConfig, Precision, clip_coefficient, grad_norm,
};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};

/// A model that maps token ids to per-token losses (a language model with its loss).
pub trait LanguageModel: Module {
    /// Per-token losses `[s, b]` of predicting `targets` from `tokens` (both `[s, b]`).
    fn losses(&self, cx: &Cx, tokens: &Ids, targets: &Ids) -> Result<(Tensor, Self::Saved)>;
    /// Accumulates parameter gradients from the losses' gradient.
    fn backward_losses(&self, cx: &Cx, saved: Self::Saved, dlosses: &Tensor) -> Result<()>;
}

/// Megatron-LM's default data-parallel bucket: max(40M, 1M × dp) elements.
pub fn default_bucket_elements(dp: usize) -> usize {
    40_000_000usize.max(1_000_000 * dp)
}

/// Settings of a training run besides the model and the data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    /// Learning rate over the steps.
    pub schedule: LrSchedule,
    /// AdamW's hyper-parameters.
    pub adam: AdamWConfig,
    /// Global gradient-norm clipping threshold (0 disables it).
    pub clip_grad: f64,
    /// Seed of dropout masks (parameters and data have their own seeds).
    pub seed: u64,
    /// Elements after which a bucket of the gradient buffer closes (Megatron-LM's
    /// `--ddp-bucket-size`; the first model chunk of the first pipeline stage only, as there).
    pub bucket_elements: usize,
    /// Megatron-LM's distributed optimizer (ZeRO-1, `--use-distributed-optimizer`): gradients
    /// reduce-scattered per bucket, each data-parallel rank updating its shard of every bucket
    /// with its shard of the optimizer state, parameters all-gathered.
    pub distributed_optimizer: bool,
    /// Which activations the backward recomputes instead of keeping them (Megatron-LM's
    /// `--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`).
    pub recompute: crate::module::Recompute,
    /// Stop with [`Error::NotFinite`] before the update of a step whose loss or gradient norm is
    /// NaN or infinite (Megatron-LM's `--check-for-nan-in-loss-and-grad`, on by default there).
    pub check_for_nan: bool,
    /// The parameters' and gradients' dtypes and the loss scaling (`--bf16`, `--fp16`, ...).
    pub precision: Precision,
}

/// What one step did, as seen by one rank.
#[derive(Debug, Clone)]
pub struct StepMetrics {
    /// 0-based step.
    pub step: u64,
    /// Mean loss per token over the whole global batch.
    pub loss: f64,
    /// Learning rate of the update.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch.
    pub tokens: usize,
    /// Of which the targets that counted in the loss, with masked data (`None`: all).
    pub counted_tokens: Option<usize>,
    /// Microbatches whose losses this rank computed that counted no target (they add nothing
    /// to the loss or the gradients).
    pub empty_microbatches: usize,
    /// Wall time of the step.
    pub seconds: f64,
    /// Of which the time this rank waited for other pipeline stages (its receives): the
    /// pipeline's bubble as this rank sees it (0 without a pipeline).
    pub pipeline_wait: f64,
    /// The most bytes the weight gradients a zero-bubble schedule's backwards put off held at
    /// once until their weight-gradient passes (their layers' kept inputs and output gradients;
    /// 0 for schedules that do not split the backward).
    pub deferred_weight_bytes: u64,
    /// Seconds this rank spent in forwards, backwards and weight-gradient passes (on a GPU, the
    /// host's time to launch them).
    pub pass_seconds: [f64; 3],
    /// Seconds of this rank's walk of the step's passes and exchanges (the step before the
    /// gradient reduction and the update).
    pub walk_seconds: f64,
    /// The most host bytes this rank allocated during the step's walk beyond what was alive at
    /// its start: its activations, messages and gradient temporaries at their peak (host
    /// tensors only).
    pub activation_peak_bytes: u64,
    /// This rank's communication during the step, per group.
    pub comm: Vec<(GroupKind, CommStats)>,
    /// The loss scale the step's backward ran with (`None` without loss scaling).
    pub loss_scale: Option<f64>,
    /// The step found inf or NaN in its scaled gradients and skipped its update (Megatron-LM's
    /// skipped iteration; the gradient norm is then NaN and the scale moves).
    pub skipped: bool,
    /// What the MoE layers' routers did, summed over the step's micro-batches, layers and
    /// data-parallel ranks (with [`Trainer::log_routing`]).
    pub routing: Option<RoutingTotals>,
    /// What this rank's graph scopes captured and replayed so far, when the run selected any
    /// (`--cuda-graph-scope`; each pipeline rank has its own counts).
    pub graphs: Option<GraphStats>,
    /// The auxiliary losses the model reported ([`crate::ops::aux_loss`]; multi-token
    /// prediction's `mtp_1`, `mtp_2`, ...), each the mean of the global batch's micro-batch
    /// means, in the order [`Trainer::log_aux_losses`] named them (empty unless named).
    pub aux_losses: Vec<(String, f64)>,
    /// With `--overlap-grad-reduce`: of this rank's gradient buckets, how many started their
    /// reduction during the walk, and how many there are (none at the first step, which learns
    /// when each gradient is final).
    pub overlapped_buckets: Option<(usize, usize)>,
    /// With sharded gradients (`optim_grads`): the most bytes of whole gradient buckets this
    /// rank held at once during the step (each bucket's from its first write in a micro-batch
    /// to its reduce-scatter; every bucket at once at the first step, which learns the writes).
    pub gradient_buckets_peak_bytes: Option<usize>,
    /// With sharded parameters (`optim_grads_params`), the most bytes of whole parameter
    /// values (and compute copies) this rank held gathered at once during the step's walk.
    pub gathered_params_peak_bytes: Option<usize>,
}

/// The bytes of one rank's training state, measured from its allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateMemory {
    /// The rank's parameters (elements, padding excluded).
    pub params: usize,
    /// Bytes of the parameter values (padding included).
    pub values: usize,
    /// Bytes of their lower-precision copies, when kept.
    pub copies: usize,
    /// Bytes of the gradients.
    pub grads: usize,
    /// Bytes of the optimizer's state: Adam's moments and, with 16-bit parameters, the f32
    /// main parameters (and main gradients); with the distributed optimizer, the rank's shards.
    pub optimizer: usize,
    /// The rank's frozen parameters (elements; counted in `params` too).
    pub frozen_params: usize,
    /// Bytes of their values (no gradient, no optimizer state).
    pub frozen: usize,
}

impl StateMemory {
    /// All of it.
    pub fn total(&self) -> usize {
        self.values + self.copies + self.grads + self.optimizer + self.frozen
    }

    /// `bytes` per parameter of the rank.
    pub fn per_param(&self, bytes: usize) -> f64 {
        bytes as f64 / self.params.max(1) as f64
    }
}

/// One rank's training state: its model shard (a chunk per virtual pipeline stage), flat
/// buffers and optimizer state.
pub struct Trainer<M: LanguageModel> {
    pub(crate) chunks: Chunks<M>,
    pub(crate) buffers: ParamBuffers,
    pub(crate) optimizer: AdamW,
    pub(crate) sampler: Sampler,
    pub(crate) config: TrainConfig,
    /// How the microbatches go through the rank's plan (a one-stage plan without a pipeline).
    engine: engine::Engine<M>,
    /// The loss scale and its trackers, with loss scaling.
    pub(crate) scaler: Option<GradScaler>,
    /// Where the MoE layers' routers report.
    routing_log: RoutingLog,
    /// Where auxiliary losses report, and the names every rank reduces.
    aux_loss_log: AuxLossLog,
    aux_loss_names: Vec<String>,
    /// The experts per MoE layer whose routing statistics each step reports (0: none).
    routing_experts: usize,
    /// Whether some pipeline stage of the model holds experts: the same on every rank, so that a
    /// stage of dense layers only (DeepSeek's first layers) makes the experts' collectives of
    /// the gradient norm with the others (learned at the first step, where the buffers live).
    model_has_experts: Option<bool>,
    /// The graph scopes the run captures (`--cuda-graph-scope`) and what they captured.
    graphs: GraphRuntime,
    /// Where the step's phases and passes go when it is traced ([`crate::trace`]).
    trace: Option<std::sync::Arc<crate::trace::Trace>>,
    /// What data parallelism overlaps (`--overlap-grad-reduce`).
    ddp: DdpConfig,
    /// The reducer the parameters report their gradient writes to, made at the first step
    /// with overlap (and again after a rebinding of the buffers).
    grad_sync: Option<std::sync::Arc<GradSync>>,
    /// The gatherer the parameters' reads wait on, made at the first step with
    /// `--overlap-param-gather` (and again after a rebinding of the buffers).
    param_gather: Option<std::sync::Arc<ParamGather>>,
    /// The gatherer of the sharded parameters' units (`optim_grads_params`).
    units: Option<std::sync::Arc<ParamUnits>>,
    /// How the buffers were laid out.
    plan: PackLayout,
    /// Visit positions of the parameters both ends of the pipeline hold (the tied embedding).
    shared_positions: Vec<usize>,
}

impl<M: LanguageModel> Trainer<M> {
    /// Moves `model`'s parameters into flat buffers (padded to the data-parallel size). Without
    /// a pipeline; a rank of a pipeline is built with [`Trainer::pipelined`].
    pub fn new(
        model: M,
        parallel: &ParallelState,
        sampler: Sampler,
        config: TrainConfig,
    ) -> Result<Self> {
        let pp = parallel.groups().config().pp;
        if pp > 1 {
            return invalid!(
                "a rank of a pipeline of {pp} stages trains its stage's chunks: build it with \
                 Trainer::pipelined"
            );
        }
        let microbatches = sampler.plan().microbatches();
        let engine = engine::Engine::new::<engine::Whole>(
            crate::pipeline_parallel::ScheduleConfig::new(1, 1, microbatches),
            0,
            crate::pipeline_parallel::Delivery::Buffered,
            false,
        )?;
        Trainer::build(
            Chunks(vec![model]),
            parallel,
            sampler,
            config,
            Vec::new(),
            engine,
        )
    }

    /// Packs `chunks` into flat buffers, one Megatron-LM buffer per chunk (`shared_embedding`:
    /// visit positions of parameters the first and the last pipeline stage both hold), and
    /// makes the optimizer; `engine` runs the batches.
    fn build(
        mut chunks: Chunks<M>,
        parallel: &ParallelState,
        sampler: Sampler,
        config: TrainConfig,
        shared_embedding: Vec<usize>,
        engine: engine::Engine<M>,
    ) -> Result<Self> {
        let groups = ReduceGroups::of(parallel);
        if let Some(i) = parallel
            .optimizer_instances()
            .filter(|_| !config.distributed_optimizer)
        {
            return invalid!(
                "{} distributed-optimizer instances shard the distributed optimizer's state: \
                 add --use-distributed-optimizer",
                i.instances
            );
        }
        let first_stage = parallel.pp().index() == 0;
        let plan = PackLayout {
            chunks: chunks
                .0
                .iter()
                .enumerate()
                .map(|(k, chunk)| {
                    let mut params = 0;
                    chunk.visit_trainable_params(&mut |_| params += 1);
                    let layout = LayoutConfig {
                        bucket_size: (k == 0 && first_stage).then_some(config.bucket_elements),
                        distributed_optimizer: config.distributed_optimizer,
                        grad_reduce_in_fp32: config.precision.grads == DType::F32,
                        edp: groups.expert.size(),
                        ..LayoutConfig::new(groups.dense.size())
                    };
                    (params, layout)
                })
                .collect(),
            shared_embedding: shared_embedding.clone(),
            param_dtype: Some(config.precision.params),
        };
        let buffers = ParamBuffers::pack(&mut chunks, &plan)?;
        let shard = config.distributed_optimizer.then(|| groups.ranks());
        let optimizer = AdamW::new(&buffers, config.adam, shard)?;
        Ok(Trainer {
            chunks,
            buffers,
            plan,
            optimizer,
            sampler,
            config,
            engine,
            scaler: config.precision.grad_scaler(),
            routing_log: RoutingLog::default(),
            aux_loss_log: AuxLossLog::default(),
            aux_loss_names: Vec::new(),
            routing_experts: 0,
            model_has_experts: None,
            graphs: GraphRuntime::new(ScopeSet::NONE),
            trace: None,
            ddp: DdpConfig::default(),
            grad_sync: None,
            param_gather: None,
            units: None,
            shared_positions: shared_embedding,
        })
    }

    /// Moves the model's parameters, gradients and optimizer state to `gpu`: every step then
    /// runs there (the world's communicators must move device tensors: a device-local or NCCL
    /// world).
    /// When `gpu` multiplies in bf16, products read bf16 copies of the weights, converted once
    /// per step (see [`Trainer::keep_compute_copies`]).
    pub fn to_gpu(&mut self, gpu: &crate::cuda::Gpu) -> Result<()> {
        self.settle_parameters()?;
        (self.grad_sync, self.param_gather) = (None, None);
        self.buffers.to_gpu(&mut self.chunks, gpu)?;
        self.optimizer.to_gpu(gpu)?;
        self.rebind_units()?;
        // 16-bit values are what products read already.
        if gpu.bf16_products()
            && self.buffers.compute_copies().is_none()
            && self.buffers.values().dtype() == DType::F32
        {
            self.keep_compute_copies(DType::BF16)?;
        }
        Ok(())
    }

    /// Lets products read `dtype` copies of the parameters (Megatron-LM's bf16 weights): the
    /// optimizer still updates the values, and the copies are converted from them after every
    /// step. On the CPU this emulates bf16 weights (the products widen them back to f32).
    pub fn keep_compute_copies(&mut self, dtype: DType) -> Result<()> {
        self.settle_parameters()?;
        (self.grad_sync, self.param_gather) = (None, None);
        self.buffers.keep_compute_copies(&mut self.chunks, dtype)?;
        self.rebind_units()
    }

    /// After the buffers were rebound (moved, or given compute copies): a new gatherer of the
    /// sharded parameters' units over the same groups, the parameters bound to it.
    fn rebind_units(&mut self) -> Result<()> {
        if let Some(units) = self.units.take() {
            let units = std::sync::Arc::new(units.rebound(&self.buffers)?);
            ParamUnits::attach(&units, &mut self.chunks.0)?;
            self.units = Some(units);
        }
        Ok(())
    }

    /// Reports the MoE routers' statistics (over `experts` experts per layer) in every step's
    /// metrics ([`StepMetrics::routing`]): every rank of the run must say the same.
    pub fn log_routing(&mut self, experts: usize) {
        self.routing_experts = experts;
    }

    /// The model (the first chunk on a pipeline rank).
    pub fn model(&self) -> &M {
        &self.chunks.0[0]
    }

    /// The model chunks of this rank, one per virtual pipeline stage (one without a pipeline).
    pub fn chunks(&self) -> &[M] {
        &self.chunks.0
    }

    /// The flat parameter and gradient buffers.
    pub fn buffers(&self) -> &ParamBuffers {
        &self.buffers
    }

    /// The bytes this rank's parameters, gradients and optimizer state take.
    pub fn state_memory(&self) -> StateMemory {
        let bytes = |t: &Tensor| t.numel() * t.dtype().size();
        let (m, v) = self.optimizer.moments();
        let main = self.optimizer.main_params().map_or(0, bytes);
        let main_grads = self.optimizer.main_grads().map_or(0, bytes);
        // Sharded gradients are the main gradients' shards; the buckets' whole gradients are
        // released between steps.
        let (grads, main_grads) = match self.optimizer.grads_sharded() {
            true => (main_grads, 0),
            false => (bytes(self.buffers.grads()), main_grads),
        };
        let (mut frozen_params, mut frozen) = (0, 0);
        for chunk in &self.chunks.0 {
            chunk.visit_frozen_params(&mut |p| {
                frozen_params += p.spec().local.numel();
                frozen += bytes(p.value());
            });
        }
        StateMemory {
            params: self.buffers.used() + frozen_params,
            frozen_params,
            frozen,
            // Sharded parameters keep the rank's shards; whole values live only while gathered
            // (`StepMetrics::gathered_params_peak_bytes`).
            values: match self.buffers.sharded_values() {
                Some(sharded) => bytes(&sharded.shards),
                None => bytes(self.buffers.values()),
            },
            copies: self.buffers.compute_copies().map_or(0, bytes),
            grads,
            optimizer: bytes(m) + bytes(v) + main + main_grads,
        }
    }

    /// The optimizer and its state (with the distributed optimizer, this rank's shards).
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// The loss scaler and its state, with loss scaling.
    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    /// The loss the backward starts from is the mean loss times this.
    fn loss_scale(&self) -> f32 {
        self.scaler.map_or(1.0, |s| s.scale)
    }

    /// The context a training micro-batch runs in: the run's seed and recompute setting, the
    /// routers' auxiliary losses entering the backward with the loss scale over the global
    /// batch's micro-batches (each micro-batch's losses weigh as its share of the mean loss),
    /// and their routings logged.
    fn train_cx<'p>(&'p self, parallel: &'p ParallelState) -> Cx<'p> {
        let plan = self.sampler.plan();
        let microbatches = (plan.microbatches() * plan.dp).max(1);
        let cx = Cx::new(parallel, self.config.seed)
            .with_recompute(self.config.recompute)
            .with_aux_loss_scale(self.loss_scale() / microbatches as f32)
            .with_routing_log(&self.routing_log)
            .with_aux_loss_log(&self.aux_loss_log);
        let cx = match &self.trace {
            Some(trace) => cx.with_trace(trace),
            None => cx,
        };
        if self.graphs.scopes().is_empty() {
            cx
        } else {
            cx.with_graphs(&self.graphs)
        }
    }

    /// Records the steps' phases (the walk, the gradient reduction, the norm, the optimizer,
    /// the parameters' gather) and passes into `trace` while it records; `None`: none.
    pub fn set_trace(&mut self, trace: Option<std::sync::Arc<crate::trace::Trace>>) {
        self.trace = trace;
    }

    /// Records phase `name` of the step, from `start` to now, when a trace records.
    fn phase(&self, parallel: &ParallelState, name: &str, start: Instant) {
        if let Some(trace) = &self.trace {
            let rank = parallel.groups().rank();
            trace.record(
                rank,
                "step",
                name.to_string(),
                (start, Instant::now()),
                Default::default(),
            );
        }
    }

    /// Overlaps data parallelism's communication as `ddp` says. With `overlap_grad_reduce`
    /// each gradient bucket's reduction starts during the backward, as soon as every gradient
    /// in it is final ([`GradSync`]): the same reductions as without, so the same step bit for
    /// bit. The first step learns how often each gradient is written and reduces after its walk.
    /// With `overlap_param_gather` (the distributed optimizer and `overlap_grad_reduce` needed,
    /// as Megatron-LM asks) each bucket's all-gather starts after the optimizer step and the
    /// next step's first read of the bucket waits for it ([`ParamGather`]).
    pub fn set_ddp(&mut self, parallel: &ParallelState, ddp: DdpConfig) -> Result<()> {
        if ddp.overlap_param_gather && !self.config.distributed_optimizer {
            return invalid!(
                "--overlap-param-gather overlaps the distributed optimizer's all-gather of the \
                 parameters: add --use-distributed-optimizer"
            );
        }
        if ddp.overlap_param_gather && !ddp.overlap_grad_reduce {
            return invalid!(
                "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM): add it"
            );
        }
        if ddp.overlap_param_gather_with_optimizer_step {
            self.check_gather_with_optimizer_step(ddp)?;
        }
        self.set_sharding(parallel, ddp)?;
        self.ddp = ddp;
        Ok(())
    }

    /// Shards what `strategy` says beyond the optimizer state, which the distributed
    /// optimizer's layout shards already (`TrainConfig::distributed_optimizer`, needed from
    /// `optim` on): with `optim_grads`, each gradient bucket gets its own storage, released
    /// after each of its reduce-scatters (once per micro-batch), and the optimizer keeps the
    /// rank's shard of the reduced gradients ([`ParamBuffers::shard_gradients`],
    /// [`GradSync::sharded`]); with `optim_grads_params`, also only the rank's shard of the
    /// values, each unit of the model gathered around its passes ([`ParamBuffers::shard_values`],
    /// [`ParamUnits`]; with `overlap_param_gather`, the next unit's gather started meanwhile).
    fn set_sharding(&mut self, parallel: &ParallelState, ddp: DdpConfig) -> Result<()> {
        let strategy = ddp.sharding;
        let name = strategy.name();
        if strategy.shards_optimizer() && !self.config.distributed_optimizer {
            return invalid!(
                "--data-parallel-sharding-strategy {name} shards the optimizer state as the \
                 distributed optimizer does: the buffers need its layout \
                 (TrainConfig::distributed_optimizer; the CLI sets it)"
            );
        }
        let shards_params = strategy == ShardingStrategy::OptimGradsParams;
        if shards_params {
            self.check_sharded_params(ddp)?;
        }
        if shards_params && self.units.is_none() {
            self.cut_buckets_at_units()?;
        }
        if strategy.shards_gradients() && self.buffers.bucket_grads().is_none() {
            self.settle_parameters()?;
            (self.grad_sync, self.param_gather) = (None, None);
            self.buffers.shard_gradients(&mut self.chunks)?;
            self.optimizer.keep_sharded_grads()?;
        }
        if shards_params && self.units.is_none() {
            let Some(ranks) = self.optimizer.shard() else {
                return invalid!("optim_grads_params keeps the distributed optimizer's shards");
            };
            self.buffers.shard_values(&mut self.chunks, ranks)?;
            let units = std::sync::Arc::new(ParamUnits::new(
                &self.buffers,
                parallel,
                ddp.overlap_param_gather,
            )?);
            ParamUnits::attach(&units, &mut self.chunks.0)?;
            self.units = Some(units);
        }
        Ok(())
    }

    /// Packs the buffers again with a bucket closing where the unit of gathering changes
    /// (Megatron-FSDP's buckets per unit), so that a unit's gather brings its parameters alone;
    /// before the first step only (the optimizer's state is made again, as at the start).
    fn cut_buckets_at_units(&mut self) -> Result<()> {
        if self.optimizer.steps() > 0 || self.buffers.bucket_grads().is_some() {
            return invalid!(
                "optim_grads_params lays the buffers out per unit of gathering: choose it before \
                 the first step"
            );
        }
        self.settle_parameters()?;
        (self.grad_sync, self.param_gather) = (None, None);
        for (_, config) in &mut self.plan.chunks {
            config.unit_buckets = true;
        }
        let copies: Vec<usize> = (self.buffers.slots().iter().enumerate())
            .filter(|(_, s)| s.shared_copy)
            .map(|(i, _)| i)
            .collect();
        let compute = self.buffers.compute_copies().map(Tensor::dtype);
        // Nothing of the old layout but the values is read again: given back first, so that
        // the new buffers take the place of the old state (zero gradients and moments).
        self.buffers.grads().storage().release();
        if let Some(copies) = self.buffers.compute_copies() {
            copies.storage().release();
        }
        self.optimizer.release_state();
        self.buffers = ParamBuffers::pack(&mut self.chunks, &self.plan)?;
        self.buffers.mark_shared_copies(&copies);
        if let Some(dtype) = compute {
            self.buffers.keep_compute_copies(&mut self.chunks, dtype)?;
        }
        let steps = self.optimizer.steps();
        self.optimizer = AdamW::new(&self.buffers, self.config.adam, self.optimizer.shard())?;
        self.optimizer.set_steps(steps);
        Ok(())
    }

    /// The flags `optim_grads_params` cannot serve, refused with the reason.
    fn check_sharded_params(&self, ddp: DdpConfig) -> Result<()> {
        const STRATEGY: &str = "--data-parallel-sharding-strategy optim_grads_params";
        if !self.graphs.scopes().is_empty() {
            return invalid!(
                "{STRATEGY} with --cuda-graph-scope: the parameters' whole values are allocated \
                 and given back around every unit's pass, where a graph keeps the addresses it \
                 captured; use one or the other"
            );
        }
        if ddp.overlap_param_gather_with_optimizer_step {
            return invalid!(
                "{STRATEGY} with --overlap-param-gather-with-optimizer-step: sharded parameters \
                 are gathered by the next step's units, not after the optimizer step; drop the \
                 flag (--overlap-param-gather prefetches the next unit)"
            );
        }
        Ok(())
    }

    /// `--overlap-param-gather-with-optimizer-step` as Megatron-LM admits it: with
    /// `--overlap-param-gather`, interleaved chunks, and every chunk in one bucket (the tied
    /// embedding's aside).
    fn check_gather_with_optimizer_step(&self, ddp: DdpConfig) -> Result<()> {
        const FLAG: &str = "--overlap-param-gather-with-optimizer-step";
        if !ddp.overlap_param_gather {
            return invalid!("{FLAG} needs --overlap-param-gather (as in Megatron-LM): add it");
        }
        let chunks = self.chunks.0.len();
        if chunks < 2 {
            return invalid!(
                "{FLAG} overlaps the first model chunk's gather with the others' update, and \
                 this rank holds {chunks} chunk: it needs interleaved pipeline parallelism \
                 (--virtual-pipeline-model-parallel-size above 1, as in Megatron-LM)"
            );
        }
        let shared = |b: &Bucket| b.slots.iter().any(|s| self.shared_positions.contains(s));
        for chunk in 0..chunks {
            for expert in [false, true] {
                let n = self
                    .buffers
                    .buckets()
                    .iter()
                    .filter(|b| b.chunk() == chunk && b.expert == expert && !shared(b))
                    .count();
                if n > 1 {
                    return invalid!(
                        "{FLAG}: model chunk {chunk} is cut into {n} buckets; Megatron-LM keeps \
                         each chunk in one bucket with it (TrainConfig::bucket_elements = \
                         usize::MAX; the CLI does it)"
                    );
                }
            }
        }
        Ok(())
    }

    /// The gatherer of an overlapped step, made (and the parameters bound to it) at the first.
    fn param_gather(&mut self, parallel: &ParallelState) -> Result<std::sync::Arc<ParamGather>> {
        if let Some(gather) = &self.param_gather {
            return Ok(gather.clone());
        }
        let gather = ParamGather::new(&self.buffers, parallel);
        gather.attach(&mut self.chunks)?;
        self.param_gather = Some(gather.clone());
        Ok(gather)
    }

    /// Waits for the parameters' all-gathers still in flight (`--overlap-param-gather`), with
    /// the first failure: before anything reads the buffers whole (a checkpoint, a move).
    pub(crate) fn settle_parameters(&self) -> Result<()> {
        if let Some(units) = &self.units {
            units.finish()?;
        }
        match &self.param_gather {
            Some(gather) => gather.finish(),
            None => Ok(()),
        }
    }

    /// The reducer of an overlapped step, made (and the parameters bound to it) at the first.
    fn grad_sync(&mut self, parallel: &ParallelState) -> Result<Option<std::sync::Arc<GradSync>>> {
        if self.buffers.bucket_grads().is_some() {
            return self.sharded_grad_sync(parallel).map(Some);
        }
        if !self.ddp.overlap_grad_reduce {
            return Ok(None);
        }
        if !self.graphs.scopes().is_empty() {
            return invalid!(
                "--overlap-grad-reduce with --cuda-graph-scope: a replayed graph's backward writes \
                 the gradients without telling their buckets, and a bucket completed during a \
                 capture would start its reduction inside the graph; use one or the other"
            );
        }
        if self.grad_sync.is_none() {
            let sync = GradSync::new(&self.buffers, parallel, &self.shared_positions);
            sync.attach(&mut self.chunks)?;
            self.grad_sync = Some(sync);
        }
        Ok(self.grad_sync.clone())
    }

    /// The reducer of sharded gradients (`optim_grads`), made (and the parameters bound to
    /// it) at the first step: it reduces every micro-batch, overlapped or not.
    fn sharded_grad_sync(&mut self, parallel: &ParallelState) -> Result<std::sync::Arc<GradSync>> {
        if !self.graphs.scopes().is_empty() {
            return invalid!(
                "--data-parallel-sharding-strategy optim_grads with --cuda-graph-scope: a \
                 replayed graph's backward writes the gradients without telling their buckets, \
                 and the buckets' storage is allocated and released every micro-batch, where a \
                 graph keeps the addresses it captured; use one or the other"
            );
        }
        if let Some(sync) = &self.grad_sync {
            return Ok(sync.clone());
        }
        let sync = GradSync::sharded(
            &self.buffers,
            &self.optimizer,
            parallel,
            &self.shared_positions,
            self.sampler.plan().microbatches(),
            self.ddp.overlap_grad_reduce,
        )?;
        sync.attach(&mut self.chunks)?;
        self.grad_sync = Some(sync.clone());
        Ok(sync)
    }

    /// Captures `scopes` from now on (Megatron-LM's `--cuda-graph-scope`): each scoped call
    /// runs eagerly the first time in its slot, is captured the second time and replayed after
    /// (on the CPU, counted and run eagerly). Whatever was captured before is dropped.
    pub fn set_graph_scopes(&mut self, scopes: ScopeSet) {
        self.graphs = GraphRuntime::new(scopes);
    }

    /// Reports the auxiliary losses called `names` in every step's metrics
    /// ([`StepMetrics::aux_losses`]; multi-token prediction's `mtp_1` to `mtp_D`, Megatron-LM's
    /// `mtp_k loss`): every rank of the run must name the same, also the stages that compute
    /// none. A step whose model reports a loss not named is an error.
    pub fn log_aux_losses(&mut self, names: Vec<String>) {
        self.aux_loss_names = names;
    }

    /// Whether some stage of the model holds experts, agreed once by the stages of the pipeline
    /// (one all-reduce over the pipeline group at the first step, near the gradients: on the
    /// device of a GPU run).
    fn model_has_experts(&mut self, parallel: &ParallelState) -> Result<bool> {
        if let Some(known) = self.model_has_experts {
            return Ok(known);
        }
        let mut experts = self.buffers.has_experts();
        if parallel.groups().config().pp > 1 {
            let flag = Tensor::scalar_near(f32::from(u8::from(experts)), self.buffers.grads())?;
            parallel.pp().all_reduce(&flag, ReduceOp::Max)?;
            experts = flag.to_vec::<f32>()?[0] > 0.0;
        }
        self.model_has_experts = Some(experts);
        Ok(experts)
    }

    /// The named auxiliary losses of the step: the sums of micro-batch means and their counts
    /// summed over every rank (the tensor- and context-parallel ranks' equal means weigh alike,
    /// so the mean is the data-parallel ranks' micro-batches' mean), one all-reduce.
    fn reduce_aux_losses(&self, parallel: &ParallelState) -> Result<Vec<(String, f64)>> {
        let logged = self.aux_loss_log.take();
        if self.aux_loss_names.is_empty() && logged.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(name) = logged.keys().find(|n| !self.aux_loss_names.contains(n)) {
            return invalid!(
                "the model reported the auxiliary loss `{name}`, which the trainer was not told \
                 of (Trainer::log_aux_losses names {:?})",
                self.aux_loss_names
            );
        }
        let k = self.aux_loss_names.len();
        let mut values = vec![0.0f32; 2 * k];
        for (i, name) in self.aux_loss_names.iter().enumerate() {
            if let Some(&(sum, count)) = logged.get(name) {
                values[i] = sum as f32;
                values[k + i] = count as f32;
            }
        }
        let values = Tensor::from_vec(values, [2 * k])?;
        let values = crate::backend::of(self.buffers.grads()).place(&values)?;
        parallel
            .comm(GroupKind::World)
            .all_reduce(&values, ReduceOp::Sum)?;
        let values = values.to_vec::<f32>()?;
        Ok(self
            .aux_loss_names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mean = match values[k + i] {
                    0.0 => f64::NAN,
                    count => f64::from(values[i]) / f64::from(count),
                };
                (name.clone(), mean)
            })
            .collect())
    }

    /// What the graph scopes captured and replayed so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }

    fn graph_stats_if_any(&self) -> Option<GraphStats> {
        (!self.graphs.scopes().is_empty()).then(|| self.graphs.stats())
    }

    /// Runs step `step`: the rank's plan (every microbatch forward and backward, through the
    /// pipeline when there is one), the gradient reduction over the data-parallel groups,
    /// clipping and the optimizer update.
    pub fn step(&mut self, parallel: &ParallelState, step: u64) -> Result<StepMetrics> {
        let experts = self.model_has_experts(parallel)?;
        let start = Instant::now();
        let before = parallel.stats();
        let plan = *self.sampler.plan();
        let tokens = plan.global_batch * plan.seq_length;
        let grad_sync = self.grad_sync(parallel)?;
        self.buffers.zero_grads()?;
        if let Some(sync) = &grad_sync {
            sync.begin_step()?;
        }
        if let Some(units) = &self.units {
            units.take_peak();
        }
        let walked = self.walk(parallel, &self.sampler, step, Mode::Train { step })?;
        let gathered_params_peak_bytes = self.units.as_ref().map(|u| u.take_peak());
        // The walk read every parameter it needed; any bucket it did not is waited for here.
        self.settle_parameters()?;
        self.phase(parallel, "forward and backward", start);
        let counted = walked.counted;
        let empty_microbatches = walked.empty_microbatches;
        let (loss_sum, pipeline_wait) = (walked.loss_sum, walked.waited);
        let deferred_weight_bytes = walked.deferred_peak;
        let (pass_seconds, activation_peak_bytes) = (walked.pass_seconds, walked.activation_peak);
        let walk_seconds = walked.seconds;
        let reduction = Instant::now();
        let overlapped_buckets = match &grad_sync {
            Some(sync) => Some(sync.finish()?),
            None => {
                reduce_gradients(&self.buffers, ReduceGroups::of(parallel))?;
                None
            }
        };
        let gradient_buckets_peak_bytes = grad_sync
            .as_ref()
            .filter(|_| self.optimizer.grads_sharded())
            .map(|sync| sync.peak_whole_bytes());
        match self.optimizer.grads_sharded() {
            true => crate::distributed::sum_sequence_parallel_shards(
                &self.buffers,
                &self.optimizer,
                parallel,
            )?,
            false => crate::distributed::sum_sequence_parallel_gradients(&self.chunks.0, parallel)?,
        }
        self.phase(parallel, "reduce gradients", reduction);
        // The mean over the counted targets (none counted: 0, said in the metrics).
        let loss = self.reduce_loss(parallel, loss_sum)? / counted.unwrap_or(tokens).max(1) as f64;
        let like = self.buffers.grads();
        let routing = self
            .routing_log
            .totals(parallel, self.routing_experts, like)?;
        let aux_losses = self.reduce_aux_losses(parallel)?;
        for (range, bias) in self
            .routing_log
            .expert_bias_updates(parallel, &self.buffers)?
        {
            self.optimizer.set_values(&self.buffers, range, &bias)?;
        }
        // With loss scaling the gradients are unscaled, and a step with inf or NaN in them on
        // any rank is skipped by all (Megatron-LM reduces the flag over every rank that holds
        // gradients: the whole world here).
        let loss_scale = self.scaler.map(|s| f64::from(s.scale));
        let found_inf = self
            .optimizer
            .prepare_grads(&self.buffers, self.scaler.map(|s| s.inv_scale()))?;
        if let Some(scaler) = &mut self.scaler {
            let flag = Tensor::scalar_near(f32::from(u8::from(found_inf)), self.buffers.grads())?;
            parallel
                .comm(GroupKind::World)
                .all_reduce(&flag, ReduceOp::Max)?;
            let found_inf = flag.to_vec::<f32>()?[0] > 0.0;
            scaler.update(found_inf);
            if found_inf {
                let mut metrics = self
                    .metrics(parallel, &before, start, step, loss, f64::NAN, tokens)
                    .skipped(loss_scale, pipeline_wait);
                metrics.routing = routing;
                metrics.aux_losses = aux_losses;
                metrics.overlapped_buckets = overlapped_buckets;
                metrics.gradient_buckets_peak_bytes = gradient_buckets_peak_bytes;
                metrics.gathered_params_peak_bytes = gathered_params_peak_bytes;
                metrics.graphs = self.graph_stats_if_any();
                metrics.counted_tokens = counted;
                metrics.empty_microbatches = empty_microbatches;
                metrics.deferred_weight_bytes = deferred_weight_bytes;
                metrics.pass_seconds = pass_seconds;
                metrics.walk_seconds = walk_seconds;
                metrics.activation_peak_bytes = activation_peak_bytes;
                return Ok(metrics);
            }
        }
        let norming = Instant::now();
        let norm = grad_norm(&self.buffers, &self.optimizer, parallel, experts)?;
        self.phase(parallel, "gradient norm", norming);
        // Every rank holds the same loss and norm (reduced over dp and the model-parallel
        // group), so every rank stops at the same step.
        if self.config.check_for_nan && !(loss.is_finite() && norm.is_finite()) {
            return Err(Error::NotFinite {
                step,
                loss,
                grad_norm: norm,
            });
        }
        // Clipping is the update's gradient scale: the gradients are read once.
        let grad_scale = clip_coefficient(norm, self.config.clip_grad);
        let lr = self.config.schedule.lr(step);
        let update = Instant::now();
        let gather = match self.ddp.overlap_param_gather_with_optimizer_step {
            // The first chunk's buckets are updated first and their gathers started before the
            // others are updated.
            true => {
                let gather = self.param_gather(parallel)?;
                let first = self.buffers.chunk_range(0);
                let first_chunk = || gather.start_where(|b| b.chunk() == 0);
                self.optimizer
                    .step_first(&self.buffers, lr, grad_scale, first, first_chunk)?;
                Some(gather)
            }
            false => {
                self.optimizer.step(&self.buffers, lr, grad_scale)?;
                None
            }
        };
        self.phase(parallel, "optimizer step", update);
        let gathering = Instant::now();
        match (gather, self.ddp.overlap_param_gather) {
            // Sharded parameters are gathered by the next walk's units.
            _ if self.units.is_some() => {}
            (Some(gather), _) => gather.start_where(|b| b.chunk() != 0)?,
            (None, true) => self.param_gather(parallel)?.start()?,
            (None, false) => gather_parameters(&self.buffers, ReduceGroups::of(parallel))?,
        }
        self.phase(parallel, "gather parameters", gathering);
        let mut metrics = self.metrics(parallel, &before, start, step, loss, norm, tokens);
        metrics.lr = lr;
        metrics.counted_tokens = counted;
        metrics.empty_microbatches = empty_microbatches;
        metrics.pipeline_wait = pipeline_wait;
        metrics.deferred_weight_bytes = deferred_weight_bytes;
        metrics.pass_seconds = pass_seconds;
        metrics.walk_seconds = walk_seconds;
        metrics.activation_peak_bytes = activation_peak_bytes;
        metrics.loss_scale = loss_scale;
        metrics.routing = routing;
        metrics.aux_losses = aux_losses;
        metrics.overlapped_buckets = overlapped_buckets;
        metrics.gradient_buckets_peak_bytes = gradient_buckets_peak_bytes;
        metrics.gathered_params_peak_bytes = gathered_params_peak_bytes;
        metrics.graphs = self.graph_stats_if_any();
        Ok(metrics)
    }

    /// What step `step` did so far: its communication since `before`, its time since `start`.
    #[allow(clippy::too_many_arguments)]
    fn metrics(
        &self,
        parallel: &ParallelState,
        before: &[(GroupKind, CommStats)],
        start: Instant,
        step: u64,
        loss: f64,
        grad_norm: f64,
        tokens: usize,
    ) -> StepMetrics {
        let after = parallel.stats();
        let comm = after
            .iter()
            .zip(before)
            .map(|((kind, now), (_, then))| (*kind, now.since(then)))
            .filter(|(_, s)| !s.ops.is_empty())
            .collect();
        StepMetrics {
            step,
            loss,
            lr: self.config.schedule.lr(step),
            grad_norm,
            tokens,
            counted_tokens: None,
            empty_microbatches: 0,
            seconds: start.elapsed().as_secs_f64(),
            pipeline_wait: 0.0,
            deferred_weight_bytes: 0,
            pass_seconds: [0.0; 3],
            walk_seconds: 0.0,
            activation_peak_bytes: 0,
            comm,
            loss_scale: None,
            skipped: false,
            routing: None,
            graphs: None,
            aux_losses: Vec::new(),
            overlapped_buckets: None,
            gradient_buckets_peak_bytes: None,
            gathered_params_peak_bytes: None,
        }
    }
}

impl StepMetrics {
    /// Marks the step skipped (inf or NaN in its gradients under loss scale `loss_scale`).
    fn skipped(mut self, loss_scale: Option<f64>, pipeline_wait: f64) -> StepMetrics {
        self.skipped = true;
        self.loss_scale = loss_scale;
        self.pipeline_wait = pipeline_wait;
        self
    }
}

impl<M: LanguageModel> Trainer<M> {
    /// Mean loss per counted token over `iters` global batches of `data` (batch `i` of the
    /// run's validation data is the `i`-th), without dropout and without touching gradients.
    pub fn evaluate(&self, parallel: &ParallelState, data: &Sampler, iters: u64) -> Result<f64> {
        Ok(self.evaluate_counted(parallel, data, iters)?.0)
    }

    /// [`Trainer::evaluate`], with the number of targets counted.
    pub fn evaluate_counted(
        &self,
        parallel: &ParallelState,
        data: &Sampler,
        iters: u64,
    ) -> Result<(f64, usize)> {
        self.settle_parameters()?;
        let plan = *data.plan();
        let mut loss_sum = 0.0f64;
        let mut counted = 0;
        for i in 0..iters {
            let walked = self.walk(parallel, data, i, Mode::Eval)?;
            loss_sum += walked.loss_sum;
            counted += walked
                .counted
                .unwrap_or(plan.global_batch * plan.seq_length);
        }
        let loss = self.reduce_loss(parallel, loss_sum)? / counted.max(1) as f64;
        Ok((loss, counted))
    }

    /// Walks batch `batch` of `data` through the rank's plan: the training plan, or with
    /// [`Mode::Eval`] the forward-only one, in an evaluation context (no dropout, no graph
    /// capture, nothing logged).
    fn walk(
        &self,
        parallel: &ParallelState,
        data: &Sampler,
        batch: u64,
        mode: Mode,
    ) -> Result<engine::Walked> {
        let (cx, actions) = match mode {
            Mode::Train { .. } => (self.train_cx(parallel), &self.engine.plan),
            Mode::Eval => (
                Cx::new(parallel, self.config.seed).eval(),
                &self.engine.eval_plan,
            ),
        };
        // With sharded parameters the stacks' modules gather their own units; the rest of the
        // model, the root unit, is gathered for the whole walk.
        let (cx, root) = match &self.units {
            Some(units) => (cx.with_units(units), Some(units.gather_root()?)),
            None => (cx, None),
        };
        let walk = engine::Walk {
            chunks: &self.chunks.0,
            parallel,
            data,
            batch,
            mode,
            cx,
            loss_scale: self.loss_scale(),
            like: self.buffers.grads(),
            sync_shared: self.engine.sync_shared,
        };
        let walked = (self.engine.run)(walk, actions);
        drop(root);
        if let Some(units) = &self.units {
            units.finish()?;
        }
        walked
    }

    /// The sum of every rank's `loss_sum`: one more (4-byte) all-reduce over data parallel, as
    /// Megatron-LM's loss averaging does (and, with a pipeline, over it: only the last stage
    /// has losses).
    fn reduce_loss(&self, parallel: &ParallelState, loss_sum: f64) -> Result<f64> {
        let total = Tensor::scalar_near(loss_sum as f32, self.buffers.grads())?;
        if self.engine.pipelined {
            parallel.pp().all_reduce(&total, ReduceOp::Sum)?;
        }
        parallel.dp().all_reduce(&total, ReduceOp::Sum)?;
        Ok(f64::from(total.to_vec::<f32>()?[0]))
    }
}
