//! `megatron train`: trains a registered model with tensor × data parallelism on thread ranks.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use megatron::comm::threads::launch;
use megatron::comm::{CommStats, ParallelState};
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;

use super::model_args::ArchitectureArgs;
use megatron::module::{Builder, Module};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::training::{
    AdamWConfig, BatchPlan, DecayStyle, LrSchedule, Sampler, StepMetrics, TokenStream, TrainConfig,
    Trainer, default_bucket_elements,
};
use serde_json::{Map, Value, json};

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
    /// Optimizer steps.
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
    /// A text file to train on, read as bytes [default: megatron-rs's own sources and docs].
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write one JSON object per step to this file.
    #[arg(long)]
    log_json: Option<PathBuf>,
    /// Add each step's communication on global rank 0 (per group and operation) to the log.
    #[arg(long)]
    comm_report: bool,
    /// Elements per data-parallel gradient all-reduce [default: max(40M, 1M × dp)].
    #[arg(long)]
    ddp_bucket_size: Option<usize>,
    /// No progress bar (the summary and the log are still written).
    #[arg(long)]
    quiet: bool,
}

impl TrainArgs {
    /// The architecture, checked against the tensor-parallel size and the sequence length.
    fn model_config(&self) -> Result<GptConfig> {
        let c = self.arch.config(self.tp)?;
        if self.seq_length > c.max_position_embeddings {
            bail!(
                "--seq-length {} exceeds --max-position-embeddings {}",
                self.seq_length,
                c.max_position_embeddings
            );
        }
        Ok(c)
    }
}

/// One JSON log line of a step.
fn log_line(m: &StepMetrics, comm_report: bool) -> Value {
    let mut line = json!({
        "step": m.step,
        "loss": m.loss,
        "lr": m.lr,
        "grad_norm": m.grad_norm,
        "tokens_per_s": m.tokens as f64 / m.seconds,
    });
    if comm_report {
        line["comm"] = comm_json(&m.comm);
    }
    line
}

/// `{GROUP: {OP: {"calls": N, "bytes": N}}}`.
fn comm_json(comm: &[(GroupKind, CommStats)]) -> Value {
    let groups: Map<String, Value> = comm
        .iter()
        .map(|(kind, stats)| {
            let ops: Map<String, Value> = stats
                .ops
                .iter()
                .map(|(op, s)| {
                    (
                        op.name().to_string(),
                        json!({ "calls": s.calls, "bytes": s.bytes }),
                    )
                })
                .collect();
            (kind.name().to_string(), Value::Object(ops))
        })
        .collect();
    Value::Object(groups)
}

/// Runs `megatron train`.
pub fn run(args: &TrainArgs) -> Result<()> {
    if args.tp == 0 || args.dp == 0 {
        bail!("--tensor-model-parallel-size and --data-parallel-size must be at least 1");
    }
    let config = args.model_config()?;
    let world = args.tp * args.dp;
    let layout = ParallelLayout::new(&ParallelConfig::new(world).with_tp(args.tp))?;
    let plan = BatchPlan {
        seq_length: args.seq_length,
        micro_batch: args.micro_batch_size,
        global_batch: args
            .global_batch_size
            .unwrap_or(args.micro_batch_size * args.dp),
        dp: args.dp,
    };
    plan.validate()?;
    let stream = match &args.data {
        Some(path) => TokenStream::from_bytes(
            &std::fs::read(path).with_context(|| format!("reading --data {}", path.display()))?,
        ),
        None => TokenStream::from_bytes(megatron::data::default_corpus()),
    };
    let sampler = Sampler::new(stream, plan, args.seed)?;
    let train = TrainConfig {
        schedule: LrSchedule {
            max_lr: args.lr,
            min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
            warmup_steps: args.lr_warmup_iters,
            decay_steps: args.lr_decay_iters.unwrap_or(args.train_iters),
            style: args.lr_decay_style,
        },
        adam: AdamWConfig {
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_eps,
            weight_decay: args.weight_decay,
        },
        clip_grad: args.clip_grad,
        seed: args.seed,
        bucket_elements: args
            .ddp_bucket_size
            .unwrap_or_else(|| default_bucket_elements(args.dp)),
    };
    let log = match &args.log_json {
        Some(path) => {
            Some(BufWriter::new(File::create(path).with_context(|| {
                format!("creating --log-json {}", path.display())
            })?))
        }
        None => None,
    };
    let params = config.num_params(args.tp);
    let flops_per_token = config.flops_per_token(args.seq_length, args.tp);
    println!(
        "training {} ({:.2}M parameters) with TP={} × DP={} on {world} thread ranks: {} steps of {} tokens ({} microbatches of {} per rank)",
        args.arch.model,
        params as f64 / 1e6,
        args.tp,
        args.dp,
        args.train_iters,
        plan.global_batch * plan.seq_length,
        plan.microbatches(),
        plan.micro_batch
    );
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.train_iters)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid progress template"),
    );
    let history = Mutex::new(Vec::new());
    let log = Mutex::new(log);
    let log_error = Mutex::new(None);
    let start = Instant::now();
    let spec = config.spec();
    launch(world, |w| -> Result<()> {
        let parallel = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&spec, &mut Builder::for_rank(args.seed, parallel.groups()))?;
        let mut trainer = Trainer::new(model, &parallel, sampler.clone(), train)?;
        for step in 0..args.train_iters {
            let m = trainer.step(&parallel, step)?;
            if parallel.groups().rank() == 0 {
                bar.set_message(format!(
                    "loss {:.4} | {:.0} tok/s",
                    m.loss,
                    m.tokens as f64 / m.seconds
                ));
                bar.inc(1);
                if let Some(out) = log.lock().expect("log lock").as_mut()
                    && let Err(e) = writeln!(out, "{}", log_line(&m, args.comm_report))
                {
                    *log_error.lock().expect("log lock") = Some(e);
                }
                history
                    .lock()
                    .expect("history lock")
                    .push((m.loss, m.tokens, m.seconds));
            }
        }
        Ok(())
    })
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    if let Some(e) = log_error.into_inner().expect("log lock") {
        return Err(e).context("writing the --log-json file");
    }
    if let Some(mut out) = log.into_inner().expect("log lock") {
        out.flush().context("writing the --log-json file")?;
    }
    let history = history.into_inner().expect("history lock");
    let (Some(first), Some(last)) = (history.first(), history.last()) else {
        println!("no steps run");
        return Ok(());
    };
    // Throughput of the median step (the first steps also fill the allocation pool).
    let mut steps: Vec<(f64, usize)> = history.iter().map(|h| (h.2, h.1)).collect();
    steps.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (median_seconds, median_tokens) = steps[steps.len() / 2];
    let tokens_per_s = median_tokens as f64 / median_seconds;
    println!(
        "loss {:.4} → {:.4} over {} steps in {:.1} s; median step {:.1} ms: {:.0} tokens/s, {:.1} GFLOP/s of model FLOPs",
        first.0,
        last.0,
        history.len(),
        start.elapsed().as_secs_f64(),
        median_seconds * 1e3,
        tokens_per_s,
        tokens_per_s * flops_per_token / 1e9
    );
    Ok(())
}
