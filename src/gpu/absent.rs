//! The GPU side of the jobs and the benchmarks, in a build without the `cuda` feature: the
//! same items as `cuda.rs`, each saying how to get a build that has them.

use anyhow::{Result, bail};

use crate::bench::attention::{AttentionBench, AttentionReport};
use crate::job::{RunContext, TrainJob};

/// What every GPU entry point of this build says.
const NO_CUDA: &str =
    "--device cuda needs a build with CUDA: cargo build --release --features cuda";

/// `megatron bench gemm --device cuda`'s report, in a build that cannot make one.
#[derive(Debug, serde::Serialize)]
pub enum GemmReport {}

impl std::fmt::Display for GemmReport {
    fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {}
    }
}

/// Fails: this build has no GPU to run a job's ranks on.
pub(crate) fn run_threads(_job: &TrainJob, _context: &RunContext<'_>) -> Result<Vec<()>> {
    bail!("this build has no GPU support: cargo build --release --features cuda")
}

/// Fails: `--backend nccl` needs MPI and CUDA.
pub fn on_nccl_ranks(_job: &TrainJob, _report: &mut crate::launch::Report<'_>) -> Result<()> {
    bail!(
        "--backend nccl needs a build with MPI and CUDA: cargo build --release --features mpi,cuda"
    )
}

/// Fails: this build has no CUDA.
pub fn gemm_bench(_repeats: usize) -> Result<GemmReport> {
    bail!(NO_CUDA)
}

/// Fails: this build has no CUDA.
pub fn attention_bench(_b: AttentionBench) -> Result<AttentionReport> {
    bail!(NO_CUDA)
}

/// GPU memory in use, in a build with no GPU: never any.
pub struct Memory;

impl Memory {
    /// Nothing to open.
    pub fn open(_on_gpu: bool) -> Result<Memory> {
        Ok(Memory)
    }

    /// None: no GPU held any memory.
    pub fn peak_gib(&self) -> Result<Option<f64>> {
        Ok(None)
    }
}

/// Nothing to time.
pub fn start_profile() {}

/// Fails: there is nothing to profile (`--profile` was refused before the run).
pub fn finish_profile(_steps: u64) -> Result<(String, serde_json::Value)> {
    bail!("--profile needs a build with CUDA: cargo build --release --features cuda")
}
