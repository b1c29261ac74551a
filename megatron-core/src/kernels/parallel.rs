//! How many cores one rank's kernels may use, and the pool they run on.
//!
//! Ranks of an in-process world share the machine's cores: `launch` gives each rank thread
//! `cores / ranks` compute threads (at least 1). Parallel kernels split their work into that many
//! parts and run them on one process-wide pool with one thread per core, so the process never
//! runs more compute threads than the machine has cores.

use std::cell::Cell;
use std::sync::OnceLock;

thread_local! {
    static THREADS: Cell<usize> = Cell::new(cores());
}

/// Number of cores available to this process.
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Compute threads the calling thread's kernels may use.
pub fn threads() -> usize {
    THREADS.with(Cell::get)
}

/// Sets the compute threads of the calling thread's kernels (at least 1).
pub fn set_threads(threads: usize) {
    THREADS.with(|t| t.set(threads.max(1)));
}

/// The compute threads each of `ranks` in-process ranks gets.
pub fn threads_per_rank(ranks: usize) -> usize {
    (cores() / ranks.max(1)).max(1)
}

/// The process-wide pool parallel kernels run on (one thread per core).
pub(crate) fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores())
            .thread_name(|i| format!("compute-{i}"))
            .build()
            .expect("building the compute pool")
    })
}
