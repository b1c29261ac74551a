//! The GPU side of the jobs and the benchmarks, in a build with the `cuda` feature.
//!
//! `src/lib.rs` picks this file or `absent.rs` (the same items, each saying how to get a CUDA
//! build); nothing else in the crate names the feature, so the code that runs a job or a
//! benchmark reads the same in both builds.

pub mod gemm;

use anyhow::Result;
use megatron_core::comm::gpu_local::LocalGpu;
use megatron_core::cuda::Gpu;
use megatron_core::cuda::kernels::flash_attention::HEAD_DIMS;
use megatron_core::tensor::{DType, Tensor};

use crate::bench::attention::{self, AttentionBench, AttentionReport};
use crate::job::{Placement, RunContext, TrainJob};

/// `megatron bench gemm --device cuda`'s report.
pub type GemmReport = gemm::GpuGemmReport;

impl Placement {
    /// Sets a rank's GPU handle to compute as this placement says.
    pub(crate) fn configure(&self, gpu: &Gpu) {
        if let Placement::Cuda {
            bf16,
            flash_attention,
        } = *self
        {
            gpu.set_bf16_products(bf16);
            gpu.set_flash_attention(flash_attention);
        }
    }
}

/// Runs `job`'s thread ranks on GPU 0, communicating with the device-local communicator.
pub(crate) fn run_threads(job: &TrainJob, context: &RunContext<'_>) -> Result<Vec<()>> {
    let gpu = Gpu::new(0)?;
    let shared = LocalGpu::new(&gpu);
    megatron_core::comm::threads::launch(job.world_size(), |w| -> Result<()> {
        let world = shared.world(std::sync::Arc::new(w))?;
        let gpu = world.gpu().clone();
        job.device.configure(&gpu);
        job.run_rank(&world, context, &|trainer| Ok(trainer.to_gpu(&gpu)?))
    })
    .map_err(anyhow::Error::msg)
}

/// This process's part of an NCCL world bootstrapped over MPI, one GPU per process.
#[cfg(feature = "mpi")]
mod nccl {
    use std::time::Instant;

    use anyhow::{Context as _, Result, bail};
    use megatron_core::comm::World;
    use megatron_core::comm::mpi::MpiWorld;
    use megatron_core::comm::nccl::NcclWorld;

    use crate::job::{Observer, Placement, Summary, TrainJob};
    use crate::launch::{Report, report_rank_error};

    impl TrainJob {
        /// Runs this process's rank of an NCCL world (one GPU per process): parameters,
        /// gradients and optimizer state on the process's GPU.
        pub fn run_on_nccl(
            &self,
            world: &NcclWorld,
            observers: &mut [Box<dyn Observer>],
        ) -> Result<Summary> {
            let start = Instant::now();
            self.check_world(world.size())?;
            let gpu = world.gpu().clone();
            self.device.configure(&gpu);
            let context = self.context(observers)?;
            self.run_rank(world, &context, &|trainer| Ok(trainer.to_gpu(&gpu)?))?;
            Ok(context.finish(start))
        }
    }

    /// Runs `job` as one process of an NCCL world: rank 0 calls `report` with a runner of the
    /// job and the number of GPUs; a process whose rank fails prints its error and aborts the
    /// launch.
    pub fn on_nccl_ranks(job: &TrainJob, report: &mut Report<'_>) -> Result<()> {
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
            report_rank_error(rank, world.size(), &err);
            world.mpi().abort(1);
        }
        Ok(())
    }
}

#[cfg(feature = "mpi")]
pub use nccl::on_nccl_ranks;

/// Without the `mpi` feature, `--backend nccl` explains how to get it.
#[cfg(not(feature = "mpi"))]
pub fn on_nccl_ranks(_job: &TrainJob, _report: &mut crate::launch::Report<'_>) -> Result<()> {
    anyhow::bail!(
        "--backend nccl needs a build with MPI and CUDA: cargo build --release --features mpi,cuda"
    )
}

/// `megatron bench gemm --device cuda`: cuBLAS products on GPU 0.
pub fn gemm_bench(repeats: usize) -> Result<GemmReport> {
    gemm::run(repeats)
}

/// `megatron bench attention --device cuda`: the layer on GPU 0, unfused and (for a head size
/// they are built for) flash, with bf16 products and bf16 inputs.
pub fn attention_bench(b: AttentionBench) -> Result<AttentionReport> {
    b.check()?;
    let gpu = Gpu::new(0)?;
    gpu.set_bf16_products(true);
    let device = gpu
        .context()
        .name()
        .unwrap_or_else(|_| "CUDA device 0".to_string());
    let (qkv, dy) = attention::inputs(&b)?;
    // In the products' dtype, as the model hands them over (the fused projection and the output
    // projection's input gradient are bf16 there): the times are the layer's, no conversion.
    let on_gpu = |t: &Tensor| -> Result<Tensor> { Ok(t.to_gpu(&gpu)?.to_contiguous(DType::BF16)?) };
    let (qkv, dy) = (on_gpu(&qkv)?, on_gpu(&dy)?);
    let sync = || Ok(gpu.synchronize()?);
    let mut results = Vec::new();
    // The flash kernels only where they are built for the head size.
    let flash_too = HEAD_DIMS.contains(&b.head_dim);
    for flash in [false, true].into_iter().filter(|&f| !f || flash_too) {
        gpu.set_flash_attention(flash);
        let backend = if flash { "cuda flash" } else { "cuda unfused" };
        results.extend(attention::measure(&b, backend, (&qkv, &dy), &sync)?);
    }
    Ok(AttentionReport {
        bench: b,
        device,
        results,
    })
}

/// GPU 0's peak memory in use over a run (nothing when the run is on the CPU).
pub struct Memory {
    gpu: Option<Gpu>,
}

impl Memory {
    /// Opens GPU 0 when the run is on it: a handle held for the whole run keeps its memory
    /// pool's high-water mark readable.
    pub fn open(on_gpu: bool) -> Result<Memory> {
        Ok(Memory {
            gpu: on_gpu.then(|| Gpu::new(0)).transpose()?,
        })
    }

    /// The most memory the run's tensors held at once, in GiB.
    pub fn peak_gib(&self) -> Result<Option<f64>> {
        match &self.gpu {
            Some(gpu) => Ok(Some(gpu.peak_memory()? as f64 / f64::from(1u32 << 30))),
            None => Ok(None),
        }
    }
}

/// Starts timing every GPU kernel and product.
pub fn start_profile() {
    megatron_core::cuda::profile::start();
}

/// Stops timing: the largest rows of the GPU time of `steps` steps, as a table to print and as
/// JSON.
pub fn finish_profile(steps: u64) -> Result<(String, serde_json::Value)> {
    let top = megatron_core::cuda::profile::stop()?.top(40);
    let table = format!("GPU time of the {steps} timed steps, by kernel and product shape:\n{top}");
    Ok((table, serde_json::to_value(&top)?))
}
