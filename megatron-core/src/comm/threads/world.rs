//! The in-process world: ranks as OS threads, `launch`, and failure propagation.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use thiserror::Error;

use super::affinity;
use super::comm::ThreadComm;
use super::group::GroupShared;
use crate::comm::{CommError, Communicator, Result, World};

/// Settings of an in-process world.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// How long a rank waits for the others at a collective before failing with
    /// [`CommError::Timeout`]. Default: 600 s, or `MEGATRON_COMM_TIMEOUT_SECS`.
    pub timeout: Duration,
    /// Most ranks of a group that move data in one collective. Default: the number of cores
    /// (more threads than cores only compete for them).
    pub comm_workers: usize,
    /// Whether rank r's thread is pinned to the r-th allowed CPU (round robin). Default: true.
    pub pin_threads: bool,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            timeout: crate::comm::default_timeout(),
            comm_workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            pin_threads: true,
        }
    }
}

impl LaunchOptions {
    /// Sets the collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets whether rank threads are pinned to cores.
    pub fn with_pinning(mut self, pin: bool) -> Self {
        self.pin_threads = pin;
        self
    }

    /// Sets the number of data-moving workers per collective.
    pub fn with_comm_workers(mut self, workers: usize) -> Self {
        self.comm_workers = workers.max(1);
        self
    }
}

/// A launched world did not complete: the first rank to fail, and why.
#[derive(Debug, Clone, Error)]
pub enum LaunchError {
    /// A rank returned an error (or panicked); every other rank was stopped.
    #[error("rank {rank} {}: {message}", if *.panicked { "panicked" } else { "failed" })]
    Rank {
        /// Global rank that failed first.
        rank: usize,
        /// Its error or panic message.
        message: String,
        /// Whether it panicked rather than returned an error.
        panicked: bool,
    },
    /// A world needs at least one rank.
    #[error("a world needs at least one rank, got 0")]
    EmptyWorld,
    /// More thread ranks than one process runs ([`crate::limits::MAX_THREAD_RANKS`]).
    #[error(
        "{ranks} thread ranks are more than one process runs (at most {max}): run more ranks as \
         processes (--backend mpi)"
    )]
    TooManyRanks {
        /// The ranks asked for.
        ranks: usize,
        /// The most one process runs.
        max: usize,
    },
    /// The operating system refused a rank's thread; the ranks started before it were stopped.
    #[error(
        "the operating system refused thread rank {rank} of {ranks}: {message} (fewer ranks, or \
         run them as processes: --backend mpi)"
    )]
    Spawn {
        /// The rank whose thread could not start.
        rank: usize,
        /// The ranks asked for.
        ranks: usize,
        /// The operating system's words.
        message: String,
    },
}

/// A group's identity: its family name and members.
type GroupKey = (String, Vec<usize>);

/// State shared by every rank of one in-process world.
#[derive(Debug)]
pub(crate) struct WorldShared {
    pub size: usize,
    pub timeout: Duration,
    pub workers: usize,
    /// The CPU each rank's thread is pinned to (`None` when not pinned).
    pub cpus: Vec<Option<usize>>,
    failed: AtomicBool,
    failure: Mutex<Option<(usize, Arc<str>, bool)>>,
    groups: Mutex<HashMap<GroupKey, Arc<GroupShared>>>,
}

impl WorldShared {
    fn new(size: usize, options: &LaunchOptions) -> Self {
        let allowed = if options.pin_threads {
            affinity::allowed_cpus()
        } else {
            Vec::new()
        };
        let cpus = (0..size)
            .map(|r| (!allowed.is_empty()).then(|| allowed[r % allowed.len()]))
            .collect();
        WorldShared {
            size,
            timeout: options.timeout,
            workers: options.comm_workers.max(1),
            cpus,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// The first failure of the world, as the error other ranks see.
    pub fn failure(&self) -> Option<CommError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let failure = self.failure.lock();
        failure
            .as_ref()
            .map(|(rank, message, _)| CommError::PeerFailed {
                rank: *rank,
                message: Arc::clone(message),
            })
    }

    /// Records a rank's failure (the first one wins) and wakes every waiting rank.
    fn fail(&self, rank: usize, message: String, panicked: bool) {
        {
            let mut failure = self.failure.lock();
            if failure.is_none() {
                *failure = Some((rank, message.into(), panicked));
            }
        }
        self.failed.store(true, Ordering::Release);
        let groups: Vec<Arc<GroupShared>> = self.groups.lock().values().cloned().collect();
        for group in groups {
            group.wake_all();
        }
    }

    fn group(&self, name: &str, ranks: &[usize]) -> Arc<GroupShared> {
        let mut groups = self.groups.lock();
        let key = (name.to_string(), ranks.to_vec());
        // Spinning only pays when no rank waits for a core that another rank spins on.
        let spin = self.size <= crate::kernels::parallel::cores();
        let cpus = ranks.iter().map(|&r| self.cpus[r]).collect();
        let group = groups
            .entry(key)
            .or_insert_with(|| Arc::new(GroupShared::new(name, ranks, self.workers, spin, cpus)));
        Arc::clone(group)
    }
}

/// One rank's handle on an in-process world.
#[derive(Debug, Clone)]
pub struct ThreadWorld {
    rank: usize,
    shared: Arc<WorldShared>,
}

impl ThreadWorld {
    /// The only rank of a world of one, on the calling thread (no threads are started).
    pub fn solo() -> ThreadWorld {
        let options = LaunchOptions::default().with_pinning(false);
        ThreadWorld {
            rank: 0,
            shared: Arc::new(WorldShared::new(1, &options)),
        }
    }
}

impl World for ThreadWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>> {
        let index = crate::comm::member_index(name, ranks, self.rank, self.shared.size)?;
        let group = self.shared.group(name, ranks);
        Ok(Arc::new(ThreadComm::new(
            group,
            Arc::clone(&self.shared),
            index,
        )))
    }
}

/// Runs `f` on `world_size` ranks, each an OS thread of this process, with default options.
///
/// Returns every rank's value in rank order, or the first rank's failure: when a rank returns an
/// error or panics, every rank waiting in a collective stops with [`CommError::PeerFailed`].
pub fn launch<T, E, F>(world_size: usize, f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(ThreadWorld) -> Result<T, E> + Sync,
{
    launch_with(world_size, &LaunchOptions::default(), f)
}

/// [`launch`] with explicit options.
pub fn launch_with<T, E, F>(
    world_size: usize,
    options: &LaunchOptions,
    f: F,
) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(ThreadWorld) -> Result<T, E> + Sync,
{
    if world_size == 0 {
        return Err(LaunchError::EmptyWorld);
    }
    if world_size > crate::limits::MAX_THREAD_RANKS {
        return Err(LaunchError::TooManyRanks {
            ranks: world_size,
            max: crate::limits::MAX_THREAD_RANKS,
        });
    }
    let shared = Arc::new(WorldShared::new(world_size, options));
    let compute_threads = crate::kernels::parallel::threads_per_rank(world_size);
    let (results, refused): (Vec<Option<T>>, _) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let world = ThreadWorld {
                    rank,
                    shared: Arc::clone(&shared),
                };
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .stack_size(16 << 20)
                    .spawn_scoped(scope, move || {
                        if let Some(cpu) = world.shared.cpus[rank] {
                            affinity::pin_current_thread(cpu);
                        }
                        crate::kernels::parallel::set_threads(compute_threads);
                        let shared = Arc::clone(&world.shared);
                        match catch_unwind(AssertUnwindSafe(|| f(world))) {
                            Ok(Ok(value)) => Some(value),
                            Ok(Err(err)) => {
                                // `{:#}` keeps an error's chain of causes (anyhow's
                                // contexts down to the OS's own words).
                                shared.fail(rank, format!("{err:#}"), false);
                                None
                            }
                            Err(panic) => {
                                shared.fail(rank, panic_message(panic.as_ref()), true);
                                None
                            }
                        }
                    })
            })
            .collect();
        // A thread the OS refused: the ranks started stop at their next collective (the
        // failure is recorded before any of them could wait for the missing rank forever).
        let refused = handles
            .iter()
            .enumerate()
            .find_map(|(rank, h)| h.as_ref().err().map(|e| (rank, e.to_string())));
        if let Some((rank, err)) = &refused {
            shared.fail(*rank, err.clone(), false);
        }
        let results = handles
            .into_iter()
            .map(|h| h.ok().and_then(|h| h.join().unwrap_or(None)))
            .collect();
        (results, refused)
    });
    if let Some((rank, message)) = refused {
        return Err(LaunchError::Spawn {
            rank,
            ranks: world_size,
            message,
        });
    }
    if let Some((rank, message, panicked)) = shared.failure.lock().take() {
        return Err(LaunchError::Rank {
            rank,
            message: message.to_string(),
            panicked,
        });
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("a rank without failure returned a value"))
        .collect())
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}
