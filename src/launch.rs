//! Where a job's ranks run beyond this process's threads: the processes of an MPI launch (and,
//! in `gpu`, of an NCCL world). Rank 0 runs the job with its observers and reports; the other
//! processes run it without; a process whose rank fails prints its error and aborts the launch.

use anyhow::Result;

use crate::job::{Observer, Summary, TrainJob};

/// What rank 0 does: given a runner of the job and the number of GPUs the ranks run on, runs
/// it with its observers and reports.
pub type Report<'a> = dyn FnMut(&mut Runner<'_>, usize) -> Result<()> + 'a;

/// Runs a job on some ranks with the observers given, returning rank 0's summary.
pub type Runner<'a> = dyn FnMut(&TrainJob, &mut [Box<dyn Observer>]) -> Result<Summary> + 'a;

/// Runs `job` as one process of an MPI launch, on the CPU.
#[cfg(feature = "mpi")]
pub fn on_mpi_ranks(job: &TrainJob, report: &mut Report<'_>) -> Result<()> {
    use anyhow::Context as _;
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
        report_rank_error(rank, world.size(), &err);
        world.abort(1);
    }
    Ok(())
}

/// Without the `mpi` feature, `--backend mpi` explains how to get it.
#[cfg(not(feature = "mpi"))]
pub fn on_mpi_ranks(_job: &TrainJob, _report: &mut Report<'_>) -> Result<()> {
    anyhow::bail!("--backend mpi needs a build with MPI: cargo build --release --features mpi")
}

/// Prints a process's failure as one line, written in one piece: the processes of a launch
/// share the terminal, and a line written in parts interleaves with the others' lines.
#[cfg(feature = "mpi")]
pub(crate) fn report_rank_error(rank: usize, size: usize, err: &anyhow::Error) {
    use std::io::Write as _;
    let line = format!("error: rank {rank} of {size}: {err:#}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
