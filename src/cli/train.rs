//! `megatron train`: trains a registered model with tensor × data parallelism on thread ranks
//! or, under `mpirun`/`srun`, on one process per rank.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::ProgressBar;
use megatron::data::{
    Blend, GptDatasetConfig, SampleSource, Split as DataSplit, SplitVector, build_gpt_dataset,
};
use megatron::job::{Eval, Observer, Placement, Summary, TrainJob};
use megatron::models::GptConfig;
use megatron::report::plot::Curves;
use megatron::tokenizer::Tokenizer;
use megatron::training::{
    AdamWConfig, BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Windows,
    default_bucket_elements,
};

use super::model_args::ArchitectureArgs;
use super::observers::{JsonLog, Plot, Progress, TensorBoard};

/// A source of training or validation samples.
type Source = Arc<dyn SampleSource>;

/// Arguments of `megatron train`, named as Megatron-LM's.
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    arch: ArchitectureArgs,
    /// Tensor-parallel size.
    #[arg(
        long = "tensor-model-parallel-size",
        visible_alias = "tp",
        default_value_t = 1
    )]
    tp: usize,
    /// Data-parallel size (the world is tp × dp thread ranks).
    #[arg(long = "data-parallel-size", visible_alias = "dp", default_value_t = 1)]
    dp: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 128)]
    seq_length: usize,
    /// Samples per microbatch on one rank.
    #[arg(long, default_value_t = 4)]
    micro_batch_size: usize,
    /// Samples per step over all data-parallel ranks [default: micro batch × dp].
    #[arg(long)]
    global_batch_size: Option<usize>,
    /// Optimizer steps to reach (a resumed run continues up to this step).
    #[arg(long = "train-iters", visible_alias = "steps", default_value_t = 100)]
    train_iters: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Learning rate at the end of the decay [default: lr / 10].
    #[arg(long)]
    min_lr: Option<f64>,
    /// Steps of linear warmup.
    #[arg(long, default_value_t = 0)]
    lr_warmup_iters: u64,
    /// Step at which the decay ends [default: train-iters].
    #[arg(long)]
    lr_decay_iters: Option<u64>,
    /// Decay shape: constant, linear or cosine.
    #[arg(long, default_value = "cosine")]
    lr_decay_style: DecayStyle,
    /// Decoupled weight decay (not on biases and norms).
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Global gradient-norm clipping (0 disables).
    #[arg(long, default_value_t = 1.0)]
    clip_grad: f64,
    /// Adam β₁.
    #[arg(long, default_value_t = 0.9)]
    adam_beta1: f64,
    /// Adam β₂.
    #[arg(long, default_value_t = 0.95)]
    adam_beta2: f64,
    /// Adam ε.
    #[arg(long, default_value_t = 1e-8)]
    adam_eps: f64,
    /// Seed of parameters, data order and dropout.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Training data: Megatron-LM indexed datasets as `PREFIX` or weighted `W1,PREFIX1,W2,PREFIX2`
    /// (also space-separated, as Megatron's `--data-path`), or one text file read as bytes
    /// [default: megatron-rs's own sources and docs, as bytes].
    #[arg(long, visible_alias = "data-path", num_args = 1..)]
    data: Vec<String>,
    /// The tokenizer the data was made with (`byte` or a tokenizer.json): sets the model's
    /// vocabulary and is recorded in checkpoints for `megatron generate`.
    #[arg(long)]
    tokenizer: Option<String>,
    /// Fractions of the data for training, validation and test (Megatron's `--split`).
    #[arg(long, default_value = "969,30,1")]
    split: String,
    /// Evaluate on the validation split every N steps (and at the end) [default: never].
    #[arg(long)]
    eval_interval: Option<u64>,
    /// Global batches per evaluation.
    #[arg(long, default_value_t = 10)]
    eval_iters: u64,
    /// Save checkpoints into this directory (every --save-interval steps and at the end).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Steps between checkpoints [default: only at the end].
    #[arg(long)]
    save_interval: Option<u64>,
    /// Start from this checkpoint (a save directory or an iteration directory): parameters,
    /// optimizer state and step; the architecture is the checkpoint's unless flags override it.
    #[arg(long)]
    load: Option<PathBuf>,
    /// Write one JSON object per step and evaluation to this file, and the loss plot next to it.
    #[arg(long)]
    log_json: Option<PathBuf>,
    /// Add each step's communication on global rank 0 (per group and operation) to the log.
    #[arg(long)]
    comm_report: bool,
    /// Write TensorBoard scalars into this directory.
    #[arg(long)]
    tensorboard_dir: Option<PathBuf>,
    /// Elements per data-parallel gradient all-reduce [default: max(40M, 1M × dp)].
    #[arg(long)]
    ddp_bucket_size: Option<usize>,
    /// No progress bar (the summary and the log are still written).
    #[arg(long)]
    quiet: bool,
    /// Where the ranks run: `threads` in this process, or `mpi`, one process per rank started
    /// by `mpirun -np N` / `srun` (N = tp × dp).
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
    /// kernels) or `flash` (tiled kernels on the tensor cores, no s × s tensor kept; head sizes
    /// 32, 64, 96, 128 with bf16 products, other layers stay unfused).
    #[arg(long, value_enum, default_value_t = AttentionBackend::Unfused)]
    attention_backend: AttentionBackend,
}

/// How attention runs on a GPU (Megatron-LM's `--attention-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AttentionBackend {
    /// Batched products with fused softmax and dropout kernels between them.
    Unfused,
    /// Tiled flash kernels (FlashAttention-2's algorithm).
    Flash,
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

/// The validation fraction of a `--split` such as `969,30,1`.
fn valid_fraction(split: &str) -> Result<(f64, f64)> {
    let parts: Vec<f64> = split
        .split(',')
        .map(|p| p.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| {
            format!("--split `{split}`: expected comma-separated numbers like 969,30,1")
        })?;
    let total: f64 = parts.iter().sum();
    if parts.is_empty() || parts.len() > 3 || parts.iter().any(|p| *p < 0.0) || total <= 0.0 {
        bail!("--split `{split}`: expected up to three non-negative weights, not all zero");
    }
    let train = parts[0] / total;
    let valid = parts.get(1).copied().unwrap_or(0.0) / total;
    Ok((train, valid))
}

impl TrainArgs {
    /// The model's name.
    pub(crate) fn model_name(&self) -> &str {
        &self.arch.model
    }

    /// Training and validation samples: Megatron indexed datasets (blended, split by documents
    /// as Megatron splits them), or a text file or the default corpus as bytes (split by
    /// position).
    fn data_sources(&self, plan: BatchPlan) -> Result<(Source, Option<Source>)> {
        let values: Vec<String> = self
            .data
            .iter()
            .flat_map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
            })
            .collect();
        let text = match values.as_slice() {
            [] => Some(megatron::data::default_corpus().to_vec()),
            [one] if Path::new(one).is_file() && !Path::new(&format!("{one}.idx")).exists() => {
                Some(std::fs::read(one).with_context(|| format!("reading --data {one}"))?)
            }
            _ => None,
        };
        if let Some(bytes) = text {
            let (train_fraction, valid_fraction) = valid_fraction(&self.split)?;
            let stream = TokenStream::from_bytes(&bytes);
            let (train, rest) = stream.split(train_fraction);
            let (valid, _test) =
                rest.split(valid_fraction / (1.0 - train_fraction).max(f64::MIN_POSITIVE));
            let train: Arc<dyn SampleSource> =
                Arc::new(Windows::new(train, plan.seq_length, self.seed)?);
            let valid = Windows::new(valid, plan.seq_length, self.seed ^ 0x0076_616c_6964)
                .ok()
                .map(|w| Arc::new(w) as Arc<dyn SampleSource>);
            return Ok((train, valid));
        }
        let blend = Blend::open(&values)?;
        let split: SplitVector = self.split.parse()?;
        let config = GptDatasetConfig {
            seq_length: plan.seq_length,
            seed: self.seed as u32,
            split,
        };
        let global = plan.global_batch as u64;
        let train_samples = self.train_iters * global;
        let evals = self
            .eval_interval
            .map_or(0, |i| self.train_iters / i.max(1) + 1);
        let valid_samples = evals * self.eval_iters * global;
        let Some(train) =
            build_gpt_dataset(&blend, &config, DataSplit::Train, Some(train_samples))?
        else {
            bail!("--split {} leaves no training data", self.split);
        };
        let valid = if valid_samples > 0 {
            build_gpt_dataset(&blend, &config, DataSplit::Valid, Some(valid_samples))?
        } else {
            None
        };
        Ok((train, valid))
    }

    /// The architecture: the loaded checkpoint's or the preset's, then explicit flags.
    fn model_config(&self) -> Result<GptConfig> {
        let c = match &self.load {
            Some(path) => {
                let meta = megatron::checkpoint::read_meta(path)?;
                let base: GptConfig = serde_json::from_value(meta.model).with_context(|| {
                    format!("{}: the checkpoint's model config", path.display())
                })?;
                self.arch.apply(base, self.tp)?
            }
            None => self.arch.config(self.tp)?,
        };
        if self.seq_length > c.max_position_embeddings {
            bail!(
                "--seq-length {} exceeds --max-position-embeddings {}",
                self.seq_length,
                c.max_position_embeddings
            );
        }
        Ok(c)
    }

    /// The training job these arguments describe.
    pub(crate) fn job(&self) -> Result<TrainJob> {
        if self.tp == 0 || self.dp == 0 {
            bail!("--tensor-model-parallel-size and --data-parallel-size must be at least 1");
        }
        let mut model = self.model_config()?;
        let tokenizer = match &self.tokenizer {
            Some(spec) => {
                let t = Tokenizer::from_spec(spec)?;
                if self.load.is_none() {
                    model.vocab_size = t.vocab_size();
                    model.validate(self.tp)?;
                } else if model.vocab_size != t.vocab_size() {
                    bail!(
                        "--tokenizer {spec} has {} tokens, the checkpoint's model {}",
                        t.vocab_size(),
                        model.vocab_size
                    );
                }
                spec.clone()
            }
            None => "byte".to_string(),
        };
        let plan = BatchPlan {
            seq_length: self.seq_length,
            micro_batch: self.micro_batch_size,
            global_batch: self
                .global_batch_size
                .unwrap_or(self.micro_batch_size * self.dp),
            dp: self.dp,
        };
        plan.validate()?;
        let (train_data, valid_data) = self.data_sources(plan)?;
        let train_data = Sampler::new(train_data, plan)?;
        let eval = match self.eval_interval {
            Some(interval) => {
                let Some(valid) = valid_data else {
                    bail!(
                        "--eval-interval needs a validation split, but --split {} gives it nothing",
                        self.split
                    );
                };
                Some(Eval {
                    data: Sampler::new(valid, plan)?,
                    interval,
                    iters: self.eval_iters,
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
            seed: self.seed,
            bucket_elements: self
                .ddp_bucket_size
                .unwrap_or_else(|| default_bucket_elements(self.dp)),
        };
        Ok(TrainJob {
            model_name: self.arch.model.clone(),
            model,
            tp: self.tp,
            dp: self.dp,
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
                "seq_length": self.seq_length,
                "micro_batch_size": self.micro_batch_size,
                "global_batch_size": plan.global_batch,
                "tokenizer": tokenizer,
            }),
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
                    flash_attention: self.attention_backend == AttentionBackend::Flash,
                },
                other => bail!("--device must be cpu or cuda, got {other:?}"),
            },
        })
    }

    /// Where the ranks run.
    pub(super) fn backend(&self) -> Backend {
        self.backend
    }
}

/// Runs `megatron train` on the chosen backend.
pub fn run(args: &TrainArgs) -> Result<()> {
    let job = args.job()?;
    on_ranks(args.backend, &job, &mut |runner, _| {
        run_job(args, &job, runner)
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
        Backend::Mpi => on_mpi_ranks(job, report),
        Backend::Nccl => on_nccl_ranks(job, report),
    }
}

/// [`on_ranks`] of one process of an MPI launch.
#[cfg(feature = "mpi")]
fn on_mpi_ranks(job: &TrainJob, report: &mut Report<'_>) -> Result<()> {
    use megatron_core::comm::World;
    use megatron_core::comm::mpi::MpiWorld;

    let world = MpiWorld::init().context("starting MPI")?;
    let rank = world.rank();
    let result = if rank == 0 {
        report(&mut |job, observers| job.run_on(&world, observers), 1)
    } else {
        job.run_on(&world, &mut []).map(drop)
    };
    if let Err(err) = result {
        eprintln!("error: rank {rank} of {}: {err:#}", world.size());
        world.abort(1);
    }
    Ok(())
}

/// [`on_ranks`] of one process of an NCCL world bootstrapped over MPI, on its GPU.
#[cfg(all(feature = "mpi", feature = "cuda"))]
fn on_nccl_ranks(job: &TrainJob, report: &mut Report<'_>) -> Result<()> {
    use megatron_core::comm::World;
    use megatron_core::comm::mpi::MpiWorld;
    use megatron_core::comm::nccl::NcclWorld;

    if job.device == Placement::Cpu {
        bail!("--backend nccl trains on GPUs: add --device cuda");
    }
    let world =
        NcclWorld::init(MpiWorld::init().context("starting MPI")?).context("starting NCCL")?;
    let rank = world.rank();
    let result = if rank == 0 {
        report(
            &mut |job, observers| job.run_on_nccl(&world, observers),
            world.size(),
        )
    } else {
        job.run_on_nccl(&world, &mut []).map(drop)
    };
    if let Err(err) = result {
        eprintln!("error: rank {rank} of {}: {err:#}", world.size());
        world.mpi().abort(1);
    }
    Ok(())
}

/// Without the `mpi` and `cuda` features, `--backend nccl` explains how to get them.
#[cfg(not(all(feature = "mpi", feature = "cuda")))]
fn on_nccl_ranks(_job: &TrainJob, _report: &mut Report<'_>) -> Result<()> {
    bail!(
        "--backend nccl needs a build with MPI and CUDA: cargo build --release --features mpi,cuda"
    )
}

/// Without the `mpi` feature, `--backend mpi` explains how to get it.
#[cfg(not(feature = "mpi"))]
fn on_mpi_ranks(_job: &TrainJob, _report: &mut Report<'_>) -> Result<()> {
    bail!("--backend mpi needs a build with MPI: cargo build --release --features mpi")
}

/// What rank 0 of [`on_ranks`] does: given a runner of the job and the number of GPUs the ranks
/// run on, runs it with its observers and reports.
pub(super) type Report<'a> = dyn FnMut(&mut Runner<'_>, usize) -> Result<()> + 'a;

/// Runs a job on some ranks with the observers given, returning rank 0's summary.
pub(super) type Runner<'a> = dyn FnMut(&TrainJob, &mut [Box<dyn Observer>]) -> Result<Summary> + 'a;

/// Runs the job with `run` on the chosen ranks, printing the plan, progress and the summary.
fn run_job(args: &TrainArgs, job: &TrainJob, run: &mut Runner<'_>) -> Result<()> {
    let plan = *job.train_data.plan();
    let params = job.model.num_params(job.tp);
    let flops_per_token = job.model.flops_per_token(plan.seq_length, job.tp);
    println!(
        "training {} ({:.2}M parameters) with TP={} × DP={} on {} {}: {} steps of {} tokens ({} microbatches of {} per rank)",
        job.model_name,
        params as f64 / 1e6,
        job.tp,
        job.dp,
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
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(job.steps)
    };
    let _logging = super::logging::init(bar.clone());
    let mut observers: Vec<Box<dyn Observer>> = vec![Box::new(Progress::new(bar))];
    if let Some(path) = &args.log_json {
        let resuming = args.load.is_some() && path.exists();
        let earlier = if resuming {
            Curves::from_log(
                &std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?,
            )?
        } else {
            Curves::default()
        };
        observers.push(Box::new(JsonLog::create(path, args.comm_report, resuming)?));
        let png = path.with_extension("png");
        observers.push(Box::new(Plot::new(
            png,
            format!("{} (TP={} × DP={})", job.model_name, job.tp, job.dp),
            earlier,
        )));
    }
    if let Some(dir) = &args.tensorboard_dir {
        observers.push(Box::new(TensorBoard::create(dir)?));
    }
    let summary = run(job, &mut observers)?;
    let (Some(first), Some(last)) = (summary.steps.first(), summary.steps.last()) else {
        println!(
            "no steps run (the checkpoint is at step {} of {})",
            summary.first_step, job.steps
        );
        return Ok(());
    };
    let tokens_per_s = summary.median_tokens_per_s().unwrap_or(0.0);
    let median_ms = plan.global_batch as f64 * plan.seq_length as f64
        / tokens_per_s.max(f64::MIN_POSITIVE)
        * 1e3;
    println!(
        "loss {:.4} → {:.4} over {} steps in {:.1} s; median step {:.1} ms: {:.0} tokens/s, {:.1} GFLOP/s of model FLOPs",
        first.0,
        last.0,
        summary.steps.len(),
        summary.seconds,
        median_ms,
        tokens_per_s,
        tokens_per_s * flops_per_token / 1e9
    );
    if let Some(e) = summary.evals.last() {
        println!(
            "validation loss {:.4}, perplexity {:.2} at step {}",
            e.loss,
            e.perplexity(),
            e.step
        );
    }
    Ok(())
}
