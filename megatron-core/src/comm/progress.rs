//! The progress thread of one rank's handle on a group: collectives the rank starts
//! ([`Communicator::start_all_reduce`], ...) run there, one at a time in the order they were
//! started, while the rank computes. The thread runs them through a second handle on the same
//! group (the `runner`, made at the first start), which takes the rank's place in the group.
//!
//! A rank's calls on one group must reach the group in the order it makes them, started or
//! not: a collective the rank calls and waits for first [`Progress::drain`]s the started ones.
//!
//! Once a started collective fails, the group's members no longer agree on what comes next:
//! the collectives started after it are not run, and each fails at once with the first error
//! named, so that the rank reaches its wait, fails and stops the others (instead of waiting
//! out the deadline in the next collective, for peers stuck in the failed one).
//!
//! [`Communicator::start_all_reduce`]: super::Communicator::start_all_reduce

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use super::{CallDesc, CommError, Pending, Result};

/// A work item: a collective run on the runner handle.
type Job<C> = Box<dyn FnOnce(&C) + Send>;

/// The queue of a running progress thread, the count of collectives not yet run, and the
/// thread.
struct Queue<C> {
    jobs: Mutex<Sender<Job<C>>>,
    in_flight: Arc<(Mutex<usize>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A handle's progress thread, spawned at the first [`Progress::start`] with the runner handle
/// `C` it runs collectives on.
pub(crate) struct Progress<C> {
    queue: OnceLock<Queue<C>>,
    /// The first started collective that failed, if one did.
    failed: Arc<Mutex<Option<CommError>>>,
    /// Whether dropping it waits for the thread to end (its runner dropped).
    join: bool,
}

impl<C> std::fmt::Debug for Progress<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("started", &self.queue.get().is_some())
            .finish()
    }
}

impl<C> Default for Progress<C> {
    /// A progress thread left to end on its own once its handle is gone.
    fn default() -> Self {
        Progress {
            queue: OnceLock::new(),
            failed: Arc::default(),
            join: false,
        }
    }
}

impl<C> Progress<C> {
    /// A progress thread whose end (its runner's drop) its handle's drop waits for: MPI's
    /// handles must all be gone, on the thread that finalises it, before it is finalised.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn joined() -> Self {
        Progress {
            queue: OnceLock::new(),
            failed: Arc::default(),
            join: true,
        }
    }
}

impl<C> Drop for Progress<C> {
    fn drop(&mut self) {
        if let Some(mut queue) = self.queue.take() {
            let thread = queue.thread.take();
            // Closing the queue ends the thread once it has run what it holds.
            drop(queue);
            if let Some(thread) = thread.filter(|_| self.join) {
                let _ = thread.join();
            }
        }
    }
}

impl<C: Send + 'static> Progress<C> {
    /// Waits until every collective started here has run (at once when none was started: a
    /// runner's own `Progress` never is).
    pub(crate) fn drain(&self) {
        if let Some(q) = self.queue.get() {
            let (count, idle) = &*q.in_flight;
            let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
            while *n > 0 {
                n = idle.wait(n).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// Starts `call` (described as `desc`, on group `group`) on the progress thread, spawned
    /// now as `thread` with the handle and thread name `runner()` gives if this is the
    /// first start; the returned
    /// [`Pending`] says when it has run and how.
    pub(crate) fn start(
        &self,
        group: &str,
        desc: &CallDesc,
        runner: impl FnOnce() -> (C, String),
        call: impl FnOnce(&C) -> Result<()> + Send + 'static,
    ) -> Result<Pending> {
        let (tx, rx) = channel();
        let (failed, what, name) = (
            Arc::clone(&self.failed),
            desc.to_string(),
            group.to_string(),
        );
        self.submit(
            group,
            runner,
            Box::new(move |c: &C| {
                let start = Instant::now();
                let earlier = failed.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let outcome = match earlier {
                    Some(e) => Err(CommError::Backend {
                        group: name,
                        library: "megatron-rs",
                        call: "start",
                        message: format!(
                            "{what} was not run: an earlier started collective failed: {e}"
                        ),
                    }),
                    None => call(c),
                };
                if let Err(e) = &outcome {
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert_with(|| e.clone());
                }
                let _ = tx.send((outcome, (start, Instant::now())));
            }),
        )?;
        Ok(Pending::running(rx, group, desc.to_string()))
    }

    fn submit(&self, group: &str, runner: impl FnOnce() -> (C, String), job: Job<C>) -> Result<()> {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = channel::<Job<C>>();
            let (runner, thread) = runner();
            let in_flight: Arc<(Mutex<usize>, Condvar)> = Arc::default();
            let done = in_flight.clone();
            let spawned = std::thread::Builder::new().name(thread).spawn(move || {
                for job in rx {
                    job(&runner);
                    let (count, idle) = &*done;
                    let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
                    *n -= 1;
                    idle.notify_all();
                }
            });
            // A thread that could not start leaves the queue without a reader: the send below
            // fails and says so.
            Queue {
                jobs: Mutex::new(tx),
                in_flight,
                thread: spawned.ok(),
            }
        });
        let (count, idle) = &*queue.in_flight;
        *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let sent = queue
            .jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job);
        if sent.is_err() {
            *count.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
            idle.notify_all();
            return Err(CommError::Backend {
                group: group.to_string(),
                library: "megatron-rs",
                call: "start",
                message: "the group's progress thread is not running".into(),
            });
        }
        Ok(())
    }
}
