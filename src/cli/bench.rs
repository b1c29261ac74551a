//! `megatron bench`: GEMM and all-reduce benchmarks against this machine's limits.

use super::output::say;
use super::values;
use anyhow::Result;
use clap::{Args, Subcommand};
use megatron::bench;
use megatron::kernels::parallel;
use megatron::limits;

/// Arguments of `megatron bench`: a subcommand, or a model's training step (`megatron bench
/// --model gpt-1.2b --seq-length 2048 --micro-batch-size 1 --device cuda`) with `megatron
/// train`'s flags.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Option<Which>,
    #[command(flatten)]
    step: Box<super::train::TrainArgs>,
    /// Steps run before timing starts (the timed steps are --train-iters).
    #[arg(long, default_value_t = 2, value_parser = values::steps_or_none)]
    warmup: u64,
    /// Peak of the device in TFLOP/s for the MFU [default: 989, an H100 SXM's dense bf16 peak,
    /// on cuda; none on the CPU].
    #[arg(long, value_parser = values::positive)]
    peak_tflops: Option<f64>,
    /// With --device cuda: also time every kernel and product of the timed steps and report
    /// where the GPU time goes (the `profile` table on stderr, its rows in the JSON).
    #[arg(long)]
    profile: bool,
}

#[derive(Debug, Subcommand)]
enum Which {
    /// GFLOP/s of a training step's GEMM shapes next to the FMA peak measured in the same run.
    Gemm {
        /// Threads for the GEMMs and the peak (default: every core).
        #[arg(long, value_parser = values::threads)]
        threads: Option<usize>,
        /// Timed runs per shape (the median is reported).
        #[arg(long, default_value_t = 7, value_parser = values::count)]
        repeats: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// `cpu`, or `cuda`: cuBLAS bf16 products of a GPT-1.2B step on GPU 0 against the
        /// H100's dense bf16 peak (build with `--features cuda`).
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// GFLOP/s of the MoE experts' grouped product (8 experts, uneven rows) next to a loop of
    /// one product per expert and one dense product of the same size, with the FMA peak.
    GroupedGemm {
        /// Threads for the products and the peak (default: every core).
        #[arg(long, value_parser = values::threads)]
        threads: Option<usize>,
        /// Timed runs per variant (the median is reported).
        #[arg(long, default_value_t = 7, value_parser = values::count)]
        repeats: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Time and TFLOP/s of one causal self-attention layer, forward and backward: the CPU
    /// kernels, or on a GPU the unfused and the flash kernels side by side (defaults: a
    /// GPT-1.2B layer at sequence 2048).
    Attention {
        /// Sequence length.
        #[arg(long, default_value_t = 2048, value_parser = values::batch)]
        seq_length: usize,
        /// Batch entries.
        #[arg(long, default_value_t = 1, value_parser = values::batch)]
        micro_batch_size: usize,
        /// Attention heads.
        #[arg(long, default_value_t = 16, value_parser = values::dim)]
        heads: usize,
        /// Elements per head.
        #[arg(long, default_value_t = 96, value_parser = values::dim)]
        head_dim: usize,
        /// Attention dropout.
        #[arg(long, default_value_t = 0.1, value_parser = values::dropout)]
        dropout: f32,
        /// Packed documents per sequence, attended apart (equal lengths; 1: one document).
        #[arg(long, default_value_t = 1, value_parser = values::count)]
        documents: usize,
        /// Timed runs (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = values::count)]
        repeats: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// `cpu`, or `cuda` (build with `--features cuda`).
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Greedy generation from a checkpoint with the KV cache: the prefill's time and new
    /// tokens per second after it (next to transformers' generate on the same weights:
    /// tools/bench/hf_generate.py).
    Generate {
        /// The checkpoint.
        #[arg(long)]
        load: std::path::PathBuf,
        /// Prompt tokens (deterministic ids over the vocabulary).
        #[arg(long, default_value_t = 32, value_parser = values::batch)]
        prompt_tokens: usize,
        /// New tokens of the timed run.
        #[arg(long, default_value_t = 64, value_parser = values::batch)]
        new_tokens: usize,
        /// Tensor-parallel thread ranks.
        #[arg(long, default_value_t = 1, value_parser = values::threads)]
        tp: usize,
        /// Compute threads of the kernels (default: every core).
        #[arg(long, value_parser = values::threads)]
        threads: Option<usize>,
        /// Decode with bf16 weights and bf16 products summed in f32 (`megatron generate
        /// --bf16`).
        #[arg(long)]
        bf16: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Element-wise chains fused by `#[megatron::module]` into one generated kernel each way,
    /// against the same operations one kernel each, forward and backward on the host, next to
    /// the memory bandwidth measured in the same run.
    Elementwise {
        /// f32 elements of the chains' input (default 4096 × 3072, a GPT-1.2B MLP activation
        /// of 4096 tokens).
        #[arg(long, default_value_t = 4096 * 3072, value_parser = values::elements)]
        elements: usize,
        /// Compute threads (default: every core).
        #[arg(long, value_parser = values::threads)]
        threads: Option<usize>,
        /// Timed runs per chain (the median is reported).
        #[arg(long, default_value_t = 7, value_parser = values::count)]
        repeats: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Time of an in-process all-reduce next to the memory-bandwidth floor measured in the same run.
    Allreduce {
        /// Thread-ranks in the group.
        #[arg(long, default_value_t = 2, value_parser = values::threads)]
        ranks: usize,
        /// f32 elements per rank (default 4096 × 768, one GPT-2-small activation of 4096 tokens).
        #[arg(long, default_value_t = 4096 * 768, value_parser = values::elements)]
        elements: usize,
        /// Timed all-reduces (the median is reported).
        #[arg(long, default_value_t = 30, value_parser = values::count)]
        iters: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `megatron bench`.
pub fn run(args: &BenchArgs) -> Result<()> {
    let Some(which) = &args.which else {
        return model_step(args);
    };
    match which {
        Which::Gemm {
            threads,
            repeats,
            json,
            device,
        } => {
            match device.as_str() {
                "cpu" => {}
                "cuda" => return print(&megatron::gpu::gemm_bench(*repeats)?, *json),
                other => anyhow::bail!("--device must be cpu or cuda, got {other:?}"),
            }
            let report = bench::gemm::run(threads.unwrap_or_else(parallel::cores), *repeats)?;
            print(&report, *json)
        }
        Which::GroupedGemm {
            threads,
            repeats,
            json,
        } => {
            let report =
                bench::grouped_gemm::run(threads.unwrap_or_else(parallel::cores), *repeats)?;
            print(&report, *json)
        }
        Which::Attention {
            seq_length,
            micro_batch_size,
            heads,
            head_dim,
            dropout,
            documents,
            repeats,
            json,
            device,
        } => {
            // Scores, probabilities and their gradients (b·heads·s² each), the inputs, outputs
            // and their gradients (b·s·heads·d each), in f32.
            let scores = limits::product(&[*micro_batch_size, *heads, *seq_length, *seq_length]);
            let rows = limits::product(&[*micro_batch_size, *seq_length, *heads, *head_dim]);
            limits::check_memory(
                &format!(
                    "an attention layer of --seq-length {seq_length}, --micro-batch-size \
                     {micro_batch_size}, --heads {heads}, --head-dim {head_dim}"
                ),
                4 * (4 * scores + 8 * rows),
            )?;
            let b = bench::attention::AttentionBench {
                seq: *seq_length,
                batch: *micro_batch_size,
                heads: *heads,
                head_dim: *head_dim,
                dropout: *dropout,
                documents: *documents,
                repeats: *repeats,
            };
            let report = match device.as_str() {
                "cpu" => bench::attention::run_cpu(b)?,
                "cuda" => megatron::gpu::attention_bench(b)?,
                other => anyhow::bail!("--device must be cpu or cuda, got {other:?}"),
            };
            print(&report, *json)
        }
        Which::Generate {
            load,
            prompt_tokens,
            new_tokens,
            tp,
            threads,
            bf16,
            json,
        } => {
            let threads = threads.unwrap_or_else(parallel::cores);
            parallel::set_threads(threads);
            let compute = megatron::generate::Compute {
                tp: *tp,
                bf16: *bf16,
            };
            let report = bench::generate::run(load, compute, *prompt_tokens, *new_tokens, threads)?;
            print(&report, *json)
        }
        Which::Elementwise {
            elements,
            threads,
            repeats,
            json,
        } => {
            // The input, the output and the gradients of the unfused chain's steps.
            limits::check_memory(
                &format!("element-wise chains of --elements {elements}"),
                4 * 12 * *elements as u128,
            )?;
            let threads = threads.unwrap_or_else(parallel::cores);
            let report = bench::elementwise::run(*elements, threads, *repeats)?;
            print(&report, *json)
        }
        Which::Allreduce {
            ranks,
            elements,
            iters,
            json,
        } => {
            limits::check(
                "--ranks",
                *ranks as u128,
                limits::MAX_THREAD_RANKS,
                "thread ranks of one process",
            )?;
            limits::check_memory(
                &format!("an all-reduce of --elements {elements} on --ranks {ranks}"),
                3 * 4 * limits::product(&[*ranks, *elements]),
            )?;
            let report = bench::allreduce::run(*ranks, *elements, *iters)?;
            print(&report, *json)
        }
    }
}

/// Times training steps of a model: tokens/s, model FLOP/s and MFU against the peak.
fn model_step(args: &BenchArgs) -> Result<()> {
    use megatron::job::Placement;

    let mut job = args.step.job()?;
    if args.profile && !matches!(job.device, Placement::Cuda { .. }) {
        anyhow::bail!("--profile times GPU kernels: add --device cuda");
    }
    job.steps += args.warmup;
    job.rank_steps = Some(Default::default());
    let plan = *job.train_data.plan();
    let flops_per_token = job.model.flops_per_token(plan.seq_length, job.tp);
    let peak = match (args.peak_tflops, job.device) {
        (Some(p), _) => Some(p),
        (None, Placement::Cuda { .. }) => Some(bench::gpu_peak_tflops()),
        (None, Placement::Cpu) => None,
    };
    // Every rank runs the job; rank 0 (of a multi-process launch) times it and reports.
    super::train::on_ranks(args.step.backend(), &job, &mut |runner, gpus| {
        report_steps(args, &job, runner, gpus, flops_per_token, peak)
    })
}

/// Runs `job` with `runner` on the ranks it runs on (`gpus` GPUs, or the CPU), timing its steps,
/// and prints the report: tokens/s, model FLOP/s and MFU per GPU.
fn report_steps(
    args: &BenchArgs,
    job: &megatron::job::TrainJob,
    runner: &mut super::train::Runner<'_>,
    gpus: usize,
    flops_per_token: f64,
    peak: Option<f64>,
) -> Result<()> {
    use megatron::job::{Observer, Placement, StepRecord};
    use std::sync::{Arc, Mutex};

    /// Collects step times, and starts the profile once `profile_from` steps have run.
    struct Times {
        times: Arc<Mutex<Vec<(f64, usize, f64)>>>,
        profile_from: Option<u64>,
    }
    impl Observer for Times {
        fn step(&mut self, record: &StepRecord) -> Result<()> {
            if let Ok(mut t) = self.times.lock() {
                let m = &record.metrics;
                t.push((m.seconds, m.tokens, m.pipeline_wait));
            }
            if self.profile_from == Some(record.metrics.step + 1) {
                megatron::gpu::start_profile();
            }
            Ok(())
        }
    }

    let plan = *job.train_data.plan();
    let times = Arc::new(Mutex::new(Vec::new()));
    let profile_from = args.profile.then_some(args.warmup);
    if profile_from == Some(0) {
        megatron::gpu::start_profile();
    }
    let mut observers: Vec<Box<dyn Observer>> = vec![Box::new(Times {
        times: times.clone(),
        profile_from,
    })];
    // A handle on GPU 0 for the whole run keeps its memory pool's high-water mark readable
    // (this process's GPU: with NCCL, rank 0's).
    let memory = megatron::gpu::Memory::open(matches!(job.device, Placement::Cuda { .. }))?;
    megatron::tensor::host_memory::reset_peak();
    let summary = runner(job, &mut observers)?;
    let peak_host = megatron::tensor::host_memory::peak_bytes();
    let state = summary.state;
    let peak_memory_gib = memory.peak_gib()?;
    let timed = job.steps - args.warmup;
    let kernels = match args.profile {
        true => {
            let (table, json) = megatron::gpu::finish_profile(timed)?;
            super::output::error_line(&table);
            Some(json)
        }
        false => None,
    };
    let times = times
        .lock()
        .map_err(|_| anyhow::anyhow!("a rank panicked"))?
        .clone();
    let mut rates: Vec<f64> = times
        .iter()
        .skip(args.warmup as usize)
        .map(|&(s, tokens, _)| tokens as f64 / s)
        .collect();
    let pipelined = !job.pipeline.is_single_stage();
    let ranks = pipeline_ranks(job, args.warmup, pipelined)?;
    // Each rank's idle time in the pipeline's span (the slowest rank's walk) over the time it
    // computed its passes (the median over the steps), averaged over the pipeline's ranks: the
    // bubble the schedule leaves as the theory counts it ((makespan − busy)/busy), next to the
    // theory at the pass times the ranks measured. Exchanges, thread wake-ups and uneven stages
    // count as idle.
    let bubble = (pipelined && !ranks.is_empty())
        .then(|| ranks.iter().map(|r| r.bubble).sum::<f64>() / ranks.len() as f64);
    let schedule = job.pipeline.schedule(plan.microbatches())?;
    let passes = (plan.microbatches() * job.pipeline.vpp).max(1) as f64;
    let times = ranks
        .iter()
        .fold([0.0; 3], |acc, r| {
            std::array::from_fn(|i| acc[i] + r.pass_seconds[i])
        })
        .map(|t| t / (passes * ranks.len().max(1) as f64));
    let theory = pipelined.then(|| megatron::pipeline_parallel::theory(&schedule.config, times));
    // The schedule simulated with each rank's passes taking what they took (in microseconds):
    // the bubble of these stages, uneven as they are, with exchanges that take no time.
    let simulated = match pipelined && ranks.len() == job.pipeline.pp {
        true => {
            let costs: Vec<megatron::pipeline_parallel::Costs> = ranks
                .iter()
                .map(|r| {
                    let [f, b, w] = r.pass_seconds.map(|t| (t / passes * 1e6).round() as u64);
                    megatron::pipeline_parallel::Costs {
                        forward: f.max(1),
                        backward: b.max(1),
                        weight: w,
                    }
                })
                .collect();
            Some(megatron::pipeline_parallel::simulate_ranks(&schedule, &costs)?.mean_rank_bubble())
        }
        false => None,
    };
    if rates.is_empty() {
        anyhow::bail!("no timed steps: --train-iters must be at least 1");
    }
    rates.sort_by(f64::total_cmp);
    let tokens_per_s = rates[rates.len() / 2];
    // The model's FLOPs per token (whole model), at the global token rate, over the GPUs the
    // ranks run on (thread ranks share one device: GPU 0 or this CPU).
    let tflops = tokens_per_s * flops_per_token / 1e12;
    let report = serde_json::json!({
        "model": args.step.model_name(),
        "tp": job.tp,
        "pp": job.pipeline.pp,
        "vpp": job.pipeline.vpp,
        "dp": job.dp,
        "cp": job.cp,
        "cp_comm_type": job.cp_comm_type.name(),
        "ep": job.ep,
        "distributed_optimizer": job.train.distributed_optimizer,
        "state_bytes_per_param": {
            "total": state.per_param(state.total()),
            "values": state.per_param(state.values),
            "copies": state.per_param(state.copies),
            "grads": state.per_param(state.grads),
            "optimizer": state.per_param(state.optimizer),
        },
        "pipeline_schedule": pipelined.then(|| job.pipeline.kind().name()),
        "pipeline_bubble": bubble,
        "theoretical_bubble": theory.map(|t| t.bubble),
        "theoretical_bubble_formula": theory.map(|t| t.formula),
        "bubble_measured_over_theory": bubble.zip(theory).map(|(b, t)| b / t.bubble),
        "simulated_bubble_at_measured_times": simulated,
        "bubble_measured_over_simulated": bubble.zip(simulated).map(|(b, s)| b / s),
        "pass_seconds": {
            "forward": times[0],
            "backward": times[1],
            "weight": times[2],
        },
        "pipeline_ranks": pipelined.then(|| ranks.iter().map(RankReport::json).collect::<Vec<_>>()),
        "seq_length": plan.seq_length,
        "micro_batch": plan.micro_batch,
        "global_batch": plan.global_batch,
        "device": format!("{:?}", job.device),
        "timed_steps": rates.len(),
        "tokens_per_s": tokens_per_s,
        "gpus": matches!(job.device, Placement::Cuda { .. }).then_some(gpus),
        "model_tflops": tflops,
        "peak_tflops": peak,
        "mfu": peak.map(|p| tflops / (p * gpus as f64)),
        "peak_gpu_memory_gib": peak_memory_gib,
        // Every host tensor of the process (all thread ranks), at its most during the run.
        "peak_host_tensor_memory_gib": peak_host as f64 / f64::from(1u32 << 30),
        "state_bytes_rank0": state.total(),
        "recompute": format!("{:?}", job.train.recompute),
        "param_dtype": job.train.precision.params.name(),
        "grad_dtype": job.train.precision.grads.name(),
        "profile": kernels,
    });
    say!("{}", serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

/// What one rank of a pipeline measured over the timed steps (each the median, bytes the most).
struct RankReport {
    rank: usize,
    bubble: f64,
    /// Its seconds per step in forwards, backwards and weight-gradient passes.
    pass_seconds: [f64; 3],
    activation_peak_bytes: u64,
    deferred_weight_bytes: u64,
}

impl RankReport {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "rank": self.rank,
            "bubble": self.bubble,
            "pass_seconds": self.pass_seconds,
            "peak_activation_bytes": self.activation_peak_bytes,
            "deferred_weight_bytes": self.deferred_weight_bytes,
        })
    }
}

/// The median of `values` (0 when empty).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Each pipeline rank of tensor- and data-parallel rank 0 that ran in this process, from the
/// steps after the first `warmup`.
fn pipeline_ranks(
    job: &megatron::job::TrainJob,
    warmup: u64,
    pipelined: bool,
) -> Result<Vec<RankReport>> {
    let Some(sink) = &job.rank_steps else {
        return Ok(Vec::new());
    };
    let steps = sink
        .lock()
        .map_err(|_| anyhow::anyhow!("a rank panicked"))?;
    let layout = job.parallel_layout()?;
    let mut firsts: Vec<usize> = match pipelined {
        true => layout.groups(megatron::parallel::GroupKind::Pp)[0].clone(),
        false => vec![0],
    };
    firsts.sort();
    // Each step's pipeline span: its slowest rank's walk (the ranks start a step's walk together,
    // after the last step's collectives).
    let mut span: std::collections::HashMap<u64, f64> = std::collections::HashMap::new();
    for (rank, m) in steps.iter() {
        if firsts.contains(rank) {
            let s = span.entry(m.step).or_default();
            *s = s.max(m.walk_seconds);
        }
    }
    Ok(firsts
        .into_iter()
        .filter_map(|rank| {
            let mine: Vec<_> = steps
                .iter()
                .filter(|(r, m)| *r == rank && m.step >= warmup)
                .map(|(_, m)| m)
                .collect();
            (!mine.is_empty()).then(|| RankReport {
                rank,
                bubble: median(
                    mine.iter()
                        .map(|m| {
                            let compute: f64 = m.pass_seconds.iter().sum();
                            span[&m.step] / compute.max(f64::MIN_POSITIVE) - 1.0
                        })
                        .collect(),
                ),
                pass_seconds: std::array::from_fn(|i| {
                    median(mine.iter().map(|m| m.pass_seconds[i]).collect())
                }),
                activation_peak_bytes: mine
                    .iter()
                    .map(|m| m.activation_peak_bytes)
                    .max()
                    .unwrap_or(0),
                deferred_weight_bytes: mine
                    .iter()
                    .map(|m| m.deferred_weight_bytes)
                    .max()
                    .unwrap_or(0),
            })
        })
        .collect())
}

fn print<T: serde::Serialize + std::fmt::Display>(report: &T, json: bool) -> Result<()> {
    if json {
        say!("{}", serde_json::to_string(report)?)?;
    } else {
        say!("{report}")?;
    }
    Ok(())
}
