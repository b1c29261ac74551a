//! `megatron bench`: GEMM and all-reduce benchmarks against this machine's limits.

use anyhow::Result;
use clap::{Args, Subcommand};
use megatron::bench;
use megatron::kernels::parallel;

/// Arguments of `megatron bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Debug, Subcommand)]
enum Which {
    /// GFLOP/s of a training step's GEMM shapes next to the FMA peak measured in the same run.
    Gemm {
        /// Threads for the GEMMs and the peak (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        /// Timed runs per shape (the median is reported).
        #[arg(long, default_value_t = 7)]
        repeats: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// `cpu`, or `cuda`: cuBLAS bf16 products of a GPT-1.2B step on GPU 0 against the
        /// H100's dense bf16 peak (build with `--features cuda`).
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Time of an in-process all-reduce next to the memory-bandwidth floor measured in the same run.
    Allreduce {
        /// Thread-ranks in the group.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// f32 elements per rank (default 4096 × 768, one GPT-2-small activation of 4096 tokens).
        #[arg(long, default_value_t = 4096 * 768)]
        elements: usize,
        /// Timed all-reduces (the median is reported).
        #[arg(long, default_value_t = 30)]
        iters: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `megatron bench`.
pub fn run(args: &BenchArgs) -> Result<()> {
    match &args.which {
        Which::Gemm {
            threads,
            repeats,
            json,
            device,
        } => {
            match device.as_str() {
                "cpu" => {}
                "cuda" => return gpu_gemm(*repeats, *json),
                other => anyhow::bail!("--device must be cpu or cuda, got {other:?}"),
            }
            let report = bench::gemm::run(threads.unwrap_or_else(parallel::cores), *repeats)?;
            print(&report, *json)
        }
        Which::Allreduce {
            ranks,
            elements,
            iters,
            json,
        } => {
            if *ranks == 0 || *elements == 0 {
                anyhow::bail!(
                    "--ranks and --elements must be at least 1 (got {ranks} and {elements})"
                );
            }
            let report = bench::allreduce::run(*ranks, *elements, *iters)?;
            print(&report, *json)
        }
    }
}

/// `bench gemm --device cuda`.
#[cfg(feature = "cuda")]
fn gpu_gemm(repeats: usize, json: bool) -> Result<()> {
    print(&bench::gpu_gemm::run(repeats)?, json)
}

/// Without the `cuda` feature, says how to get it.
#[cfg(not(feature = "cuda"))]
fn gpu_gemm(_repeats: usize, _json: bool) -> Result<()> {
    anyhow::bail!("--device cuda needs a build with CUDA: cargo build --release --features cuda")
}

fn print<T: serde::Serialize + std::fmt::Display>(report: &T, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}
