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
    POOL.get_or_init(|| build_pool(cores()))
}

/// A pool of `threads` compute workers that may run on every CPU of the process: the pool is
/// built by its first user, often a rank thread pinned to one CPU, whose set its workers would
/// otherwise inherit (and a rank's parallel kernels would then share that one core).
fn build_pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("compute-{i}"))
        .start_handler(|_| {
            crate::comm::threads::affinity::unpin_current_thread();
        })
        .build()
        .expect("building the compute pool")
}

/// Runs `run(0)`, …, `run(parts − 1)` at once on the compute pool (part 0 on the calling thread
/// when `in_place`, else on a pool worker), returning when all are done; one part runs inline.
pub(crate) fn run_parts<F: Fn(usize) + Sync>(parts: usize, in_place: bool, run: F) {
    fn spawn_rest<'s, F: Fn(usize) + Sync>(s: &rayon::Scope<'s>, parts: usize, run: &'s F) {
        for part in 1..parts {
            s.spawn(move |_| run(part));
        }
        run(0);
    }
    if parts <= 1 {
        run(0);
    } else if in_place {
        pool().in_place_scope(|s| spawn_rest(s, parts, &run));
    } else {
        pool().scope(|s| spawn_rest(s, parts, &run));
    }
}

/// Elements below which a parallel split costs more than it saves (one pool round trip is a
/// few microseconds; this much element-wise work takes tens).
pub(crate) const MIN_PARALLEL: usize = 1 << 15;

/// The part length to split `n` elements into for the calling thread's compute threads (a
/// multiple of 64, so parts start on cache lines), or `None` when one part is better.
pub(crate) fn part_len(n: usize) -> Option<usize> {
    let t = threads();
    if t < 2 || n < 2 * MIN_PARALLEL {
        return None;
    }
    let parts = t.min(n / MIN_PARALLEL);
    Some(n.div_ceil(parts).div_ceil(64) * 64)
}

/// Like [`part_len`] for `units` independent units of `unit` elements each: the number of
/// whole units per part, or `None`.
pub(crate) fn part_units(units: usize, unit: usize) -> Option<usize> {
    let t = threads();
    let n = units.saturating_mul(unit);
    if t < 2 || units < 2 || n < 2 * MIN_PARALLEL {
        return None;
    }
    let parts = t.min(units).min(n / MIN_PARALLEL);
    Some(units.div_ceil(parts))
}

/// Runs `f` on the compute pool (parallel iterators inside use its threads).
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    pool().install(f)
}

#[cfg(test)]
mod tests {
    use super::super::dropout::{LogicalIndex, dropout_forward};
    use crate::comm::threads::affinity::{allowed_cpus, pin_current_thread};

    #[test]
    fn a_pool_built_by_a_pinned_thread_runs_on_every_cpu_of_the_process() {
        let process = allowed_cpus();
        if process.len() < 2 {
            eprintln!("one CPU: nothing to spread over");
            return;
        }
        let seen = std::thread::spawn(move || {
            assert!(pin_current_thread(process[0]));
            assert_eq!(allowed_cpus(), [process[0]]);
            let pool = build_pool(2);
            pool.broadcast(|_| allowed_cpus())
        })
        .join()
        .unwrap();
        for worker in seen {
            assert_eq!(
                worker,
                allowed_cpus(),
                "a worker kept its builder's one CPU"
            );
        }
    }

    use super::super::elementwise::{gelu_backward, gelu_forward, sum_of_squares};
    use super::super::softmax::softmax_forward;
    use super::*;
    use crate::rng::DropoutStream;

    /// Runs `f` with 1 and then 2 compute threads and checks that the outputs are bit-identical.
    fn same_bits_on_1_and_2_threads(f: impl Fn() -> Vec<f32>) {
        set_threads(1);
        let one = f();
        set_threads(2);
        let two = f();
        set_threads(cores());
        assert_eq!(
            one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            two.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn parallel_kernels_give_the_serial_bits() {
        let n = 5 * MIN_PARALLEL + 17;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        same_bits_on_1_and_2_threads(|| {
            let mut y = vec![0.0; n];
            gelu_forward(&x, &mut y).unwrap();
            let mut dx = vec![0.0; n];
            gelu_backward(&x, &y, &mut dx).unwrap();
            y.extend(dx);
            y
        });
        same_bits_on_1_and_2_threads(|| {
            let mut y = vec![0.0; n];
            let index = LogicalIndex {
                outer: 1,
                inner: n,
                logical_stride: n as u64,
                logical_start: 3,
            };
            dropout_forward(&x, &mut y, 0.3, &DropoutStream::new(1, &[2]), index).unwrap();
            y
        });
        same_bits_on_1_and_2_threads(|| {
            let (batches, s) = (8, 128);
            let mut y = vec![0.0; batches * s * s];
            softmax_forward(&x[..batches * s * s], batches, s, s, 0.125, true, &mut y).unwrap();
            y
        });
        same_bits_on_1_and_2_threads(|| vec![sum_of_squares(&x) as f32]);
    }
}
