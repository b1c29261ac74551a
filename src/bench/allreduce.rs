//! `megatron bench allreduce`: the in-process all-reduce against the machine's memory bandwidth.
//!
//! An in-place all-reduce of n buffers must at least read every element of every buffer once and
//! write it once: 2·n·size bytes of memory traffic. The floor is the time this machine takes for
//! exactly that traffic (one read-write pass over n buffers of the same size, on as many threads
//! as the collective uses), measured in the same run.

use std::sync::Mutex;
use std::time::Instant;

use megatron_core::comm::threads::{LaunchOptions, launch_with};
use megatron_core::comm::{ReduceOp, World};
use megatron_core::tensor::Tensor;

use super::machine::{read_write_pass, shares};

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AllReduceReport {
    /// Ranks (threads) in the group.
    pub ranks: usize,
    /// f32 elements per rank.
    pub elements: usize,
    /// Threads that move data (at most the cores).
    pub workers: usize,
    /// Median time of one all-reduce, in milliseconds.
    pub time_ms: f64,
    /// Fastest all-reduce, in milliseconds.
    pub best_ms: f64,
    /// Buffer bytes per rank over the median time, in GB/s (NCCL's "algbw").
    pub algbw_gbs: f64,
    /// Memory traffic (2·n·size) over the median time, in GB/s.
    pub traffic_gbs: f64,
    /// Median time of the read-write pass with the same traffic, in milliseconds: the floor.
    pub floor_ms: f64,
    /// Memory bandwidth that pass reached, in GB/s.
    pub machine_gbs: f64,
    /// Median time over the floor.
    pub ratio: f64,
}

/// Times `iters` all-reduces of `elements` f32 per rank among `ranks` thread-ranks, each after a
/// read-write pass of the same traffic (the floor), so machine noise hits both alike; reports
/// medians.
pub fn run(ranks: usize, elements: usize, iters: usize) -> anyhow::Result<AllReduceReport> {
    let options = LaunchOptions::default();
    let workers = ranks.min(options.comm_workers).max(1);
    let iters = iters.max(1);
    let mut floor_buffers: Vec<Vec<f32>> = (0..ranks).map(|r| vec![r as f32; elements]).collect();
    // Worker rank w makes the floor pass over its share of every buffer, as in the collective.
    let floor_shares: Vec<Mutex<Vec<&mut [f32]>>> = shares(&mut floor_buffers, workers)
        .into_iter()
        .map(Mutex::new)
        .collect();
    let times = launch_with(ranks, &options, |w| -> anyhow::Result<Vec<(f64, f64)>> {
        let all: Vec<usize> = (0..w.size()).collect();
        let comm = w.communicator("world", &all)?;
        let t = Tensor::from_vec(vec![1e-3f32 * w.rank() as f32; elements], [elements])?;
        comm.all_reduce(&t, ReduceOp::Sum)?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            // The floor: the same traffic by the same threads between two barriers.
            comm.barrier()?;
            let start = Instant::now();
            if let Some(share) = floor_shares.get(w.rank()) {
                let mut share = share
                    .lock()
                    .map_err(|_| anyhow::anyhow!("a worker panicked"))?;
                read_write_pass(&mut share);
            }
            comm.barrier()?;
            let floor = start.elapsed().as_secs_f64();
            let start = Instant::now();
            comm.all_reduce(&t, ReduceOp::Sum)?;
            times.push((start.elapsed().as_secs_f64(), floor));
        }
        Ok(times)
    })
    .map_err(anyhow::Error::msg)?;
    // The collective ends when its slowest rank leaves it.
    let slowest = |pick: fn(&(f64, f64)) -> f64| -> Vec<f64> {
        let mut v: Vec<f64> = (0..iters)
            .map(|i| times.iter().map(|t| pick(&t[i])).fold(0.0, f64::max))
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let per_call = slowest(|t| t.0);
    let floors = slowest(|t| t.1);
    let median = per_call[iters / 2];
    let floor = floors[iters / 2];
    let bytes = (elements * 4) as f64;
    let traffic = 2.0 * ranks as f64 * bytes;
    Ok(AllReduceReport {
        ranks,
        elements,
        workers,
        time_ms: median * 1e3,
        best_ms: per_call[0] * 1e3,
        algbw_gbs: bytes / median / 1e9,
        traffic_gbs: traffic / median / 1e9,
        floor_ms: floor * 1e3,
        machine_gbs: traffic / floor / 1e9,
        ratio: median / floor,
    })
}

impl std::fmt::Display for AllReduceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "all-reduce (sum, f32) of {} elements ({:.1} MB) per rank among {} thread-ranks, {} worker(s)",
            self.elements,
            self.elements as f64 * 4.0 / 1e6,
            self.ranks,
            self.workers
        )?;
        writeln!(
            f,
            "  time      {:>8.3} ms median, {:.3} ms best   (algbw {:.1} GB/s, memory traffic {:.1} GB/s)",
            self.time_ms, self.best_ms, self.algbw_gbs, self.traffic_gbs
        )?;
        writeln!(
            f,
            "  floor     {:>8.3} ms median (one read-write pass by the same threads over {} buffers of that size: {:.1} GB/s)",
            self.floor_ms, self.ranks, self.machine_gbs
        )?;
        write!(f, "  ratio     {:>8.2} × floor", self.ratio)
    }
}
