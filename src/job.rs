//! A training run from start to end: the model, its parallel layout and data, the steps,
//! evaluations and checkpoints, with observers for what it reports (progress, logs, plots).
//!
//! The command line fills a [`TrainJob`]; [`TrainJob::run`] launches the thread ranks (or
//! [`TrainJob::run_on`] runs this process's rank of a multi-process world) and calls the
//! observers on global rank 0.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::SaveInfo;
use megatron_core::comm::threads::launch;
use megatron_core::comm::{CommStats, ParallelState, ReduceOp, World};
use megatron_core::distributed::ShardingStrategy;
use megatron_core::module::{Builder, Module};
use megatron_core::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron_core::pipeline_parallel::{
    PipelineLayout, Schedule, ScheduleConfig, ScheduleKind, StageLayoutError,
};
use megatron_core::tensor::{DType, Tensor};
use megatron_core::trace::{Span, Trace, TracingWorld};
use megatron_core::training::{BatchPlan, Sampler, StepMetrics, TrainConfig, Trainer};
use megatron_models::GptConfig;
use megatron_models::gpt::Gpt;

/// Everything a training run needs.
#[derive(Debug, Clone)]
pub struct TrainJob {
    /// The model's registered name (for reports).
    pub model_name: String,
    /// Its architecture.
    pub model: GptConfig,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Sequence parallelism (`--sequence-parallel`): outside the tensor-parallel regions each
    /// tensor-parallel rank holds its shard of the sequence.
    pub sequence_parallel: bool,
    /// Context-parallel size: each rank of a context-parallel group holds two chunks of every
    /// sequence (see `megatron_core::context_parallel`).
    pub cp: usize,
    /// How context-parallel attention exchanges keys and values (`--cp-comm-type`).
    pub cp_comm_type: megatron_core::context_parallel::CpCommType,
    /// Expert-parallel size (folded into tp × dp, as Megatron-LM folds it).
    pub ep: usize,
    /// Expert tensor-parallel size.
    pub etp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Pipeline parallelism: stages, virtual stages, how the layers are cut.
    pub pipeline: PipelineSettings,
    /// Optimizer steps to reach (counted from 0, including steps a loaded checkpoint did).
    pub steps: u64,
    /// Training samples.
    pub train_data: Sampler,
    /// Validation samples, with evaluation every `eval_interval` steps over `eval_iters`
    /// global batches (and at the end).
    pub eval: Option<Eval>,
    /// Optimizer, schedule, clipping, seed.
    pub train: TrainConfig,
    /// Where to save checkpoints and how often (and at the end).
    pub save: Option<(PathBuf, u64)>,
    /// A checkpoint to start from.
    pub load: Option<PathBuf>,
    /// Facts about the run recorded in checkpoints.
    pub run_info: serde_json::Value,
    /// Files saved into every checkpoint beside the tensors (the tokenizer's `tokenizer.json`).
    pub files: megatron_core::checkpoint::Files,
    /// Where the ranks compute.
    pub device: Placement,
    /// The graph scopes captured (`--cuda-graph-scope`); none: everything eager.
    pub cuda_graph_scope: megatron_core::cuda_graphs::ScopeSet,
    /// What data parallelism overlaps with compute (`--overlap-grad-reduce`).
    pub ddp: megatron_core::distributed::DdpConfig,
    /// Asks the run to stop early (a signal handler sets it): see [`StopRequest`].
    pub stop: Option<StopRequest>,
    /// Where every rank of this process (thread ranks) also records its steps' metrics, by
    /// world rank (`megatron bench` reads each pipeline rank's bubble and memory from it).
    pub rank_steps: Option<RankSteps>,
    /// Write the last step's timeline, every rank's passes, phases and collectives, to this
    /// file as a Chrome trace (`--trace`; see `megatron_core::trace`).
    pub trace: Option<PathBuf>,
}

/// Every rank's step metrics, by world rank: see [`TrainJob::rank_steps`].
pub type RankSteps = Arc<std::sync::Mutex<Vec<(usize, megatron_core::training::StepMetrics)>>>;

/// A request to stop a run before its last step (Megatron-LM's `--exit-signal-handler`), set
/// from anywhere, e.g. a signal handler. After each step the ranks agree (one all-reduce of a
/// flag over the world, so every rank stops after the same step, whichever saw the request);
/// they then save a checkpoint when the run saves checkpoints, the observers finish, and the
/// summary says where the run stopped.
#[derive(Debug, Clone, Default)]
pub struct StopRequest(Arc<AtomicUsize>);

impl StopRequest {
    /// No stop requested yet.
    pub fn new() -> Self {
        StopRequest::default()
    }

    /// The counter a signal handler sets to its signal number (0: no request).
    pub fn signal_slot(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.0)
    }

    /// Requests the stop, for `reason` (e.g. a signal number; not 0).
    pub fn request(&self, reason: usize) {
        self.0.store(reason.max(1), Ordering::SeqCst);
    }

    /// The reason given, if a stop was requested.
    pub fn requested(&self) -> Option<usize> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            why => Some(why),
        }
    }
}

/// How a job cuts its model into pipeline stages (Megatron-LM's pipeline flags); a
/// checkpoint records it (`megatron train` resumes with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PipelineSettings {
    /// Pipeline stages (`--pipeline-model-parallel-size`).
    pub pp: usize,
    /// Model chunks (virtual stages) per stage; 1 is the non-interleaved 1F1B schedule.
    pub vpp: usize,
    /// Contiguous microbatches per virtual stage (`--microbatch-group-size-per-virtual-pipeline-stage`;
    /// `None`: pp).
    pub group_size: Option<usize>,
    /// Layers of the first stage when uneven (`--decoder-first-pipeline-num-layers`).
    pub first_stage_layers: Option<usize>,
    /// Layers of the last stage when uneven (`--decoder-last-pipeline-num-layers`).
    pub last_stage_layers: Option<usize>,
    /// The schedule (`--pipeline-schedule`); `None`: Megatron-LM's by `vpp` (1F1B, or
    /// interleaved).
    #[serde(default)]
    pub schedule: Option<ScheduleKind>,
    /// The embedding counted as a layer of the split
    /// (`--account-for-embedding-in-pipeline-split`).
    #[serde(default)]
    pub account_for_embedding: bool,
    /// The loss counted as a layer of the split (`--account-for-loss-in-pipeline-split`).
    #[serde(default)]
    pub account_for_loss: bool,
}

impl Default for PipelineSettings {
    fn default() -> Self {
        PipelineSettings {
            pp: 1,
            vpp: 1,
            group_size: None,
            first_stage_layers: None,
            last_stage_layers: None,
            schedule: None,
            account_for_embedding: false,
            account_for_loss: false,
        }
    }
}

impl PipelineSettings {
    /// Whether the model runs as one stage.
    pub fn is_single_stage(&self) -> bool {
        self.pp == 1 && self.vpp == 1
    }

    /// The schedule run: as given, else Megatron-LM's by `vpp`.
    pub fn kind(&self) -> ScheduleKind {
        self.schedule
            .unwrap_or_else(|| ScheduleKind::default_for(self.vpp))
    }

    /// The layers of a model of `layers` laid over the stages (Megatron-LM's checks), placed
    /// as the schedule places its stages.
    pub fn layout(&self, layers: usize) -> Result<PipelineLayout> {
        let uneven = self.first_stage_layers.is_some() || self.last_stage_layers.is_some();
        let counted = self.account_for_embedding || self.account_for_loss;
        let v = matches!(self.kind(), ScheduleKind::Zbv | ScheduleKind::DualPipeV);
        let layout = match (uneven, counted) {
            (true, true) => return Err(StageLayoutError::CountedEndsWithUneven.into()),
            (false, true) => PipelineLayout::with_ends_counted(
                layers,
                self.pp,
                self.vpp,
                self.account_for_embedding,
                self.account_for_loss,
            )?,
            _ => PipelineLayout::new(
                layers,
                self.pp,
                self.vpp,
                self.first_stage_layers,
                self.last_stage_layers,
            )
            .map_err(|e| match v {
                // The chunks a V runs are the schedule's, not a flag's.
                true => anyhow::anyhow!(
                    "--pipeline-schedule {} runs 2 model chunks per rank (its V), {} virtual \
                     stages over --pipeline-model-parallel-size {}: {e}",
                    self.kind(),
                    2 * self.pp,
                    self.pp
                ),
                false => e.into(),
            })?,
        };
        Ok(layout.placed(self.kind().placement())?)
    }

    /// The training schedule for `microbatches` per step (Megatron-LM's checks, and the
    /// schedule's own).
    pub fn schedule(&self, microbatches: usize) -> Result<Schedule> {
        Ok(Schedule::new(ScheduleConfig {
            group_size: self.group_size,
            ..ScheduleConfig::named(self.kind(), self.pp, Some(self.vpp), microbatches)?
        })?)
    }
}

/// Where a job's ranks compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// On the CPU (the default).
    #[default]
    Cpu,
    /// On CUDA GPUs (feature `cuda`): thread ranks share GPU 0 through the device-local
    /// communicator; under `--backend nccl` each process takes its own GPU.
    Cuda {
        /// Matrix products in bf16 with f32 accumulation (mixed precision) instead of f32.
        bf16: bool,
        /// Attention as tiled flash kernels where it can (bf16 products, a built head size).
        flash_attention: bool,
    },
}

/// Periodic evaluation.
#[derive(Debug, Clone)]
pub struct Eval {
    /// Validation samples.
    pub data: Sampler,
    /// Steps between evaluations; 0: the job only evaluates, once, after loading (`megatron
    /// eval`), and trains nothing.
    pub interval: u64,
    /// Global batches per evaluation.
    pub iters: u64,
}

/// One training step as global rank 0 reports it.
#[derive(Debug, Clone)]
pub struct StepRecord {
    /// The step's metrics.
    pub metrics: StepMetrics,
    /// Tokens consumed including this step.
    pub tokens: u64,
}

/// One evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalRecord {
    /// Steps completed when it ran.
    pub step: u64,
    /// Tokens consumed by then.
    pub tokens: u64,
    /// Mean validation loss per counted token.
    pub loss: f64,
    /// The targets counted (all of the batches' tokens unless masks leave some out).
    pub counted: u64,
}

impl EvalRecord {
    /// Validation perplexity, e^loss.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Something told about the run as it goes (on global rank 0's thread).
pub trait Observer: Send {
    /// Training starts at `first_step` (later than 0 after loading a checkpoint).
    fn start(&mut self, _job: &TrainJob, _first_step: u64) -> Result<()> {
        Ok(())
    }
    /// A training step finished.
    fn step(&mut self, record: &StepRecord) -> Result<()>;
    /// An evaluation finished.
    fn eval(&mut self, _record: &EvalRecord) -> Result<()> {
        Ok(())
    }
    /// A checkpoint was saved.
    fn saved(&mut self, _step: u64, _dir: &std::path::Path) -> Result<()> {
        Ok(())
    }
    /// The run ended (not called when it failed).
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// What a finished run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Step the run started at.
    pub first_step: u64,
    /// Per step: loss, tokens, seconds.
    pub steps: Vec<(f64, usize, f64)>,
    /// Evaluations.
    pub evals: Vec<EvalRecord>,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// Set when a [`StopRequest`] ended the run early: the steps completed by then.
    pub stopped_after: Option<u64>,
    /// Global rank 0's training state in bytes.
    pub state: megatron_core::training::StateMemory,
}

impl Summary {
    /// Tokens/s of the median step (the first steps also fill the allocation pool).
    pub fn median_tokens_per_s(&self) -> Option<f64> {
        let mut s: Vec<(f64, usize)> = self.steps.iter().map(|h| (h.2, h.1)).collect();
        s.sort_by(|a, b| a.0.total_cmp(&b.0));
        s.get(s.len() / 2)
            .map(|&(secs, tokens)| tokens as f64 / secs)
    }
}

/// Moves a rank's trainer to its device (nothing on the CPU).
pub(crate) type Placer<'a> = dyn Fn(&mut Trainer<Gpt>) -> Result<()> + Sync + 'a;

/// What every rank of a run shares: the layout, the observers (called on global rank 0) and the
/// summary rank 0 fills.
pub(crate) struct RunContext<'a> {
    layout: ParallelLayout,
    observers: Mutex<&'a mut [Box<dyn Observer>]>,
    summary: Mutex<Summary>,
    info: SaveInfo,
    /// The trace this process's ranks record the last step into, with `--trace`.
    trace: Option<Arc<Trace>>,
}

impl TrainJob {
    /// With LoRA, the checkpoint that holds the frozen base: the one `--load` names as its
    /// base, or `--load`'s itself (its iteration directory, absolute). The run's saves hold
    /// the adapters and name it. `None` without LoRA or without `--load`: saves hold it all.
    fn lora_base(&self) -> anyhow::Result<Option<PathBuf>> {
        let (Some(_), Some(load)) = (&self.model.lora, &self.load) else {
            return Ok(None);
        };
        if let Some(base) = megatron_core::checkpoint::read_meta(load)?.base {
            return Ok(Some(base));
        }
        let dir = megatron_core::checkpoint::resolve(load)?;
        Ok(Some(std::fs::canonicalize(&dir).with_context(|| {
            format!("--load {}: the base of the LoRA run", dir.display())
        })?))
    }

    /// Checks `--cuda-graph-scope` against the model (Megatron-LM's rules: MoE scopes need MoE
    /// layers, `mlp` dense ones, `moe_preprocess` the router's; no full recompute).
    fn check_graph_scopes(&self) -> Result<()> {
        let full = matches!(
            self.train.recompute,
            megatron_core::module::Recompute::Uniform(_)
                | megatron_core::module::Recompute::Block(_)
        );
        self.cuda_graph_scope
            .validate(&self.model.scoped_model(full)?)?;
        Ok(())
    }

    /// Runs the job on tp × dp thread ranks of this process (sharing GPU 0 when the job is
    /// placed on CUDA).
    pub fn run(&self, observers: &mut [Box<dyn Observer>]) -> Result<Summary> {
        let start = Instant::now();
        let context = self.context(observers)?;
        match self.device {
            Placement::Cpu => launch(self.world_size(), |w| {
                self.run_rank(&w, &context, &|_| Ok(()))
            })
            .map_err(anyhow::Error::msg)?,
            Placement::Cuda { .. } => crate::gpu::run_threads(self, &context)?,
        };
        Ok(context.finish(start))
    }

    /// Runs this process's rank of the job in `world` (e.g. an MPI world of tp × dp processes,
    /// each calling this). Observers are called on global rank 0; the summary is rank 0's.
    pub fn run_on(
        &self,
        world: &dyn World,
        observers: &mut [Box<dyn Observer>],
    ) -> Result<Summary> {
        let start = Instant::now();
        self.check_world(world.size())?;
        if self.device != Placement::Cpu {
            bail!("a GPU job in a multi-process world runs with --backend nccl");
        }
        let context = self.context(observers)?;
        self.run_rank(world, &context, &|_| Ok(()))?;
        Ok(context.finish(start))
    }

    /// A world of `size` processes has the job's tp × pp × dp ranks.
    pub(crate) fn check_world(&self, size: usize) -> Result<()> {
        if size != self.world_size() {
            bail!(
                "{} needs {} ranks, the world has {size} (start as many processes)",
                self.layout_name(),
                self.world_size(),
            );
        }
        Ok(())
    }

    /// What context parallelism needs and does not build yet, each an error naming it.
    fn check_context_parallel(&self, seq: usize) -> Result<()> {
        let cp = self.cp;
        if !seq.is_multiple_of(2 * cp) {
            bail!(
                "--context-parallel-size {cp} cuts each sequence into 2·cp = {} chunks: \
                 --seq-length {seq} is not divisible by it",
                2 * cp
            );
        }
        self.cp_comm_type.check_heads(
            self.model.num_attention_heads,
            self.model.query_groups(),
            self.tp,
            cp,
        )?;
        let not_yet = |what: &str| -> Result<()> {
            bail!("context parallelism with {what} is not built yet (--context-parallel-size {cp})")
        };
        // The blocks of context-parallel attention run on the host: no graph captures them
        // and no flash kernel runs them.
        if self
            .cuda_graph_scope
            .contains(megatron_core::cuda_graphs::GraphScope::Attn)
        {
            return not_yet("CUDA graphs of attention (--cuda-graph-scope attn)");
        }
        if matches!(
            self.device,
            Placement::Cuda {
                flash_attention: true,
                ..
            }
        ) {
            return not_yet("flash attention kernels");
        }
        if matches!(self.device, Placement::Cuda { .. }) {
            tracing::warn!(
                "context-parallel attention computes its blocks on the host: the device's fused \
                 projection is read back and the output written back each layer (GPU kernels for \
                 the blocks are not written yet)"
            );
        }
        if self.sequence_parallel && self.tp > 1 {
            let tp = self.tp;
            if !(seq / cp).is_multiple_of(tp) || !tp.is_multiple_of(2) {
                bail!(
                    "--sequence-parallel with --context-parallel-size {cp}: each \
                     tensor-parallel rank holds its s / (cp·tp) positions within one of its two \
                     chunks, so tp must be even and divide s / cp = {}: got \
                     --tensor-model-parallel-size {tp}",
                    seq / cp
                );
            }
        }
        Ok(())
    }

    /// Number of ranks the job runs on.
    pub fn world_size(&self) -> usize {
        self.tp * self.cp * self.pipeline.pp * self.dp
    }

    /// The parallel layout as `TP=2 × PP=2 × DP=1` (PP left out without a pipeline, and the
    /// virtual stages shown when there are some).
    pub fn layout_name(&self) -> String {
        let p = &self.pipeline;
        let pp = match (p.pp, p.vpp) {
            (1, 1) => String::new(),
            (pp, 1) => format!(" × PP={pp}"),
            (pp, v) => format!(" × PP={pp} (V={v})"),
        };
        let sharded = match (self.train.distributed_optimizer, self.ddp.sharding) {
            (_, ShardingStrategy::OptimGrads) => " (gradients and optimizer state sharded)",
            (true, _) => " (distributed optimizer)",
            (false, _) => "",
        };
        let ep = match (self.ep, self.etp) {
            (1, 1) => String::new(),
            (ep, 1) => format!(" (EP={ep})"),
            (ep, etp) => format!(" (EP={ep}, ETP={etp})"),
        };
        let cp = match self.cp {
            1 => String::new(),
            cp => format!(" × CP={cp}"),
        };
        format!("TP={}{cp}{pp} × DP={}{ep}{sharded}", self.tp, self.dp)
    }

    /// The run's parallel layout: which world ranks form each group.
    pub fn parallel_layout(&self) -> Result<ParallelLayout> {
        if self.tp == 0 || self.dp == 0 || self.pipeline.pp == 0 {
            bail!(
                "--tensor-model-parallel-size, --pipeline-model-parallel-size and \
                 --data-parallel-size must be at least 1"
            );
        }
        Ok(ParallelLayout::new(
            &ParallelConfig::new(self.world_size())
                .with_tp(self.tp)
                .with_cp(self.cp)
                .with_pp(self.pipeline.pp)
                .with_ep(self.ep)
                .with_etp(self.etp),
        )?)
    }

    pub(crate) fn context<'a>(
        &self,
        observers: &'a mut [Box<dyn Observer>],
    ) -> Result<RunContext<'a>> {
        let layout = self.parallel_layout()?;
        self.check_graph_scopes()?;
        self.model
            .validate_parallel(self.tp, self.ep, self.sequence_parallel)?;
        let plan: BatchPlan = *self.train_data.plan();
        if self.sequence_parallel && self.tp > 1 && !plan.seq_length.is_multiple_of(self.tp) {
            bail!(
                "--sequence-parallel splits the sequence over the tensor-parallel ranks: \
                 --seq-length {} is not divisible by --tensor-model-parallel-size {}",
                plan.seq_length,
                self.tp
            );
        }
        if self.cp > 1 {
            self.check_context_parallel(plan.seq_length)?;
        }
        if plan.dp != self.dp {
            bail!(
                "the data plan is cut for dp {}, the job runs dp {}",
                plan.dp,
                self.dp
            );
        }
        Ok(RunContext {
            layout,
            trace: self.trace.as_ref().map(|_| Trace::new()),
            observers: Mutex::new(observers),
            summary: Mutex::new(Summary::default()),
            info: SaveInfo {
                model: serde_json::to_value(&self.model).context("serialising the model config")?,
                run: self.run_info.clone(),
                files: self.files.clone(),
                base: self.lora_base()?,
            },
        })
    }

    /// One rank's whole run: build, load, place (on its device), train, evaluate, save.
    pub(crate) fn run_rank(
        &self,
        w: &dyn World,
        cx: &RunContext<'_>,
        place: &Placer<'_>,
    ) -> Result<()> {
        // A bf16 run multiplies in bf16 on the CPU too, its sums in f32 (as a GPU's products).
        let _products = megatron_core::ops::cpu_bf16_products(
            self.device == Placement::Cpu && self.train.precision.params == DType::BF16,
        );
        let plan: BatchPlan = *self.train_data.plan();
        let tokens_per_step = (plan.global_batch * plan.seq_length) as u64;
        // With --trace, every collective of the rank's communicators is timed into the trace.
        let traced = cx.trace.as_ref().map(|t| TracingWorld::new(w, t.clone()));
        let w: &dyn World = match &traced {
            Some(t) => t,
            None => w,
        };
        let parallel = ParallelState::new(w, &cx.layout)?
            .with_sequence_parallel(self.sequence_parallel)
            .with_cp_comm_type(w, self.cp_comm_type)?
            .with_optimizer_instances(w, self.ddp.num_distributed_optimizer_instances)?;
        let rank0 = parallel.groups().rank() == 0;
        let report = |f: &mut dyn FnMut(&mut Box<dyn Observer>) -> Result<()>| -> Result<()> {
            if rank0 {
                for o in cx.observers.lock().expect("observer lock").iter_mut() {
                    f(o)?;
                }
            }
            Ok(())
        };
        let summary = |f: &mut dyn FnMut(&mut Summary)| {
            if rank0 {
                f(&mut cx.summary.lock().expect("summary lock"));
            }
        };
        let spec = self.model.spec();
        let mut trainer = if self.pipeline.is_single_stage() {
            let mut model = Gpt::build(
                &spec,
                &mut self
                    .model
                    .adapters(Builder::for_rank(self.train.seed, parallel.groups())),
            )?;
            self.model.freeze_base(&mut model);
            Trainer::new(model, &parallel, self.train_data.clone(), self.train)?
        } else {
            // This rank's chunk of each virtual stage it holds.
            let layout = self.pipeline.layout(self.model.num_layers)?;
            let pp_rank = parallel.pp().index();
            let chunks = (0..self.pipeline.vpp)
                .map(|chunk| {
                    let mut b = self
                        .model
                        .adapters(Builder::for_rank(self.train.seed, parallel.groups()))
                        .with_stage(layout.part(pp_rank, chunk));
                    let mut model = Gpt::build(&spec, &mut b)?;
                    self.model.freeze_base(&mut model);
                    Ok(model)
                })
                .collect::<megatron_core::Result<Vec<_>>>()?;
            Trainer::pipelined_as(
                chunks,
                &parallel,
                self.train_data.clone(),
                self.train,
                self.pipeline.kind(),
                self.pipeline.group_size,
            )?
        };
        if let Some(moe) = &self.model.moe {
            trainer.log_routing(moe.router.num_experts);
        }
        trainer.set_trace(cx.trace.clone());
        // Megatron-LM's `mtp_1 loss` ... `mtp_D loss`.
        let depths = self.model.mtp_depths();
        if depths > 0 {
            trainer.log_aux_losses((1..=depths).map(|k| format!("mtp_{k}")).collect());
        }
        if !self.cuda_graph_scope.is_empty() {
            trainer.set_graph_scopes(self.cuda_graph_scope);
        }
        trainer.set_ddp(&parallel, self.ddp)?;
        let first = match &self.load {
            Some(path) => trainer.load_checkpoint(&parallel, path)?.iteration,
            None => 0,
        };
        place(&mut trainer)?;
        let state = trainer.state_memory();
        summary(&mut |s| {
            s.first_step = first;
            s.state = state;
        });
        report(&mut |o| o.start(self, first))?;
        if let Some(eval) = self.eval.as_ref().filter(|e| e.interval == 0) {
            let (loss, counted) = trainer.evaluate_counted(&parallel, &eval.data, eval.iters)?;
            let record = EvalRecord {
                step: first,
                tokens: 0,
                loss,
                counted: counted as u64,
            };
            summary(&mut |s| s.evals.push(record));
            report(&mut |o| o.eval(&record))?;
            return report(&mut |o| o.finish());
        }
        for step in first..self.steps {
            // The traced step starts on every rank together.
            let traced_step = cx.trace.as_ref().filter(|_| step + 1 == self.steps);
            let rank = parallel.groups().rank();
            if let Some(trace) = traced_step {
                parallel.comm(GroupKind::World).barrier()?;
                trace.start(rank);
            }
            let metrics = trainer.step(&parallel, step);
            if let Some(trace) = traced_step {
                trace.stop(rank);
            }
            let metrics = metrics?;
            if let Some(sink) = &self.rank_steps
                && let Ok(mut steps) = sink.lock()
            {
                steps.push((parallel.groups().rank(), metrics.clone()));
            }
            let done = step + 1;
            let tokens = done * tokens_per_step;
            summary(&mut |s| {
                s.steps
                    .push((metrics.loss, metrics.tokens, metrics.seconds))
            });
            report(&mut |o| {
                o.step(&StepRecord {
                    metrics: metrics.clone(),
                    tokens,
                })
            })?;
            let last = done == self.steps;
            if let Some(eval) = &self.eval
                && (done % eval.interval.max(1) == 0 || last)
            {
                let (loss, counted) =
                    trainer.evaluate_counted(&parallel, &eval.data, eval.iters)?;
                let record = EvalRecord {
                    step: done,
                    tokens,
                    loss,
                    counted: counted as u64,
                };
                summary(&mut |s| s.evals.push(record));
                report(&mut |o| o.eval(&record))?;
            }
            let mut saved = false;
            if let Some((dir, interval)) = &self.save
                && (done % (*interval).max(1) == 0 || last)
            {
                trainer.save_checkpoint(&parallel, dir, done, &cx.info)?;
                report(&mut |o| o.saved(done, dir))?;
                saved = true;
            }
            if let Some(stop) = &self.stop
                && !last
                && any_rank_asks(&parallel, trainer.buffers().grads(), stop.requested())?
            {
                if let Some((dir, _)) = &self.save
                    && !saved
                {
                    trainer.save_checkpoint(&parallel, dir, done, &cx.info)?;
                    report(&mut |o| o.saved(done, dir))?;
                }
                summary(&mut |s| s.stopped_after = Some(done));
                break;
            }
        }
        if let (Some(trace), Some(path)) = (&cx.trace, &self.trace) {
            write_trace(&parallel, trace, path)?;
        }
        report(&mut |o| o.finish())
    }
}

/// Gathers every rank's spans of `trace` to global rank 0, which writes them to `path` as a
/// Chrome trace (a collective over the world: the ranks of other processes send theirs).
fn write_trace(parallel: &ParallelState, trace: &Trace, path: &Path) -> Result<()> {
    let rank = parallel.groups().rank();
    let mine = serde_json::to_vec(&trace.spans_of(rank)).context("the trace's spans")?;
    let all = megatron_core::comm::all_gather_bytes(parallel.comm(GroupKind::World), mine)?;
    if rank != 0 {
        return Ok(());
    }
    let mut spans: Vec<Span> = Vec::new();
    for (r, bytes) in all.iter().enumerate() {
        let theirs: Vec<Span> =
            serde_json::from_slice(bytes).with_context(|| format!("rank {r}'s trace"))?;
        spans.extend(theirs);
    }
    let json = serde_json::to_vec(&megatron_core::trace::chrome(&spans))?;
    megatron_core::files::write_atomically(path, &json)
        .map_err(|(p, e)| anyhow::anyhow!("--trace: writing {}: {e}", p.display()))
}

/// Whether any rank of the world has a stop request (a collective: every rank calls it after
/// the same step; one 4-byte all-reduce beside `like`, on its device).
fn any_rank_asks(parallel: &ParallelState, like: &Tensor, request: Option<usize>) -> Result<bool> {
    let flag = Tensor::zeros_near([1], DType::F32, like)?;
    if request.is_some() {
        flag.fill(1.0)?;
    }
    parallel
        .comm(GroupKind::World)
        .all_reduce(&flag, ReduceOp::Max)?;
    Ok(flag.to_vec::<f32>()?[0] > 0.0)
}

impl RunContext<'_> {
    pub(crate) fn finish(self, start: Instant) -> Summary {
        let mut summary = self.summary.into_inner().expect("summary lock");
        summary.seconds = start.elapsed().as_secs_f64();
        summary
    }
}

/// `{GROUP: {OP: {"calls": N, "bytes": N}}}` of one step's communication.
pub fn comm_json(comm: &[(GroupKind, CommStats)]) -> serde_json::Value {
    let groups: serde_json::Map<String, serde_json::Value> = comm
        .iter()
        .map(|(kind, stats)| {
            let ops: serde_json::Map<String, serde_json::Value> = stats
                .ops
                .iter()
                .map(|(op, s)| {
                    (
                        op.name().to_string(),
                        serde_json::json!({ "calls": s.calls, "bytes": s.bytes }),
                    )
                })
                .collect();
            (kind.name().to_string(), serde_json::Value::Object(ops))
        })
        .collect();
    serde_json::Value::Object(groups)
}
