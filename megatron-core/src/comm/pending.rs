//! A collective started without waiting for it ([`Communicator::start_all_reduce`] and the
//! other `start_` calls): [`Pending::wait`] returns once it has run, with its error if it
//! failed. What ran it and when it ran (its interval on the clock of the host) go to the hooks
//! the caller added ([`Pending::then`]: a trace records the interval).
//!
//! [`Communicator::start_all_reduce`]: super::Communicator::start_all_reduce

use std::sync::mpsc::Receiver;
use std::time::Instant;

use super::{CommError, Result};

/// When a collective ran: from its start to its end.
pub type Ran = (Instant, Instant);

/// A hook called with the interval a collective ran in, once it has.
type Hook = Box<dyn FnOnce(Ran) + Send>;

/// A step the waiting thread takes once the collective has run, whose error is the wait's.
type After = Box<dyn FnOnce() -> Result<()> + Send>;

/// A started collective; it is complete once [`Pending::wait`] returns.
#[must_use = "a started collective owns its tensors until it is waited for"]
pub struct Pending {
    state: State,
    hooks: Vec<Hook>,
    after: Option<After>,
}

enum State {
    /// It ran already, in this interval (a backend that runs collectives at once).
    Ran(Result<()>, Ran),
    /// It runs elsewhere (a progress thread): the outcome comes on the channel.
    Running {
        outcome: Receiver<(Result<()>, Ran)>,
        /// The group and the call, for the error if the runner goes away.
        group: String,
        call: String,
    },
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.state {
            State::Ran(r, _) => write!(f, "Pending::Ran({r:?})"),
            State::Running { group, call, .. } => write!(f, "Pending::Running({group}: {call})"),
        }
    }
}

impl Pending {
    /// A collective that ran already, from `start` to now, with `outcome`.
    pub fn ran(outcome: Result<()>, start: Instant) -> Pending {
        Pending {
            state: State::Ran(outcome, (start, Instant::now())),
            hooks: Vec::new(),
            after: None,
        }
    }

    /// A collective running elsewhere: `outcome` receives its result and interval once it has
    /// run. `group` and `call` name it if the runner goes away without saying.
    pub(crate) fn running(
        outcome: Receiver<(Result<()>, Ran)>,
        group: &str,
        call: String,
    ) -> Pending {
        Pending {
            state: State::Running {
                outcome,
                group: group.to_string(),
                call,
            },
            hooks: Vec::new(),
            after: None,
        }
    }

    /// The same collective, `after` run by the waiting thread once it has run without error
    /// (a device backend orders the rank's stream after the collective's stream there).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn after(mut self, after: impl FnOnce() -> Result<()> + Send + 'static) -> Pending {
        self.after = Some(Box::new(after));
        self
    }

    /// The same collective, `hook` called with the interval it ran in when it is waited for.
    pub fn then(mut self, hook: impl FnOnce(Ran) + Send + 'static) -> Pending {
        self.hooks.push(Box::new(hook));
        self
    }

    /// Returns once the collective has run: `Ok`, or its error (a mismatch, a timeout, a
    /// failed peer), naming the collective and the group.
    pub fn wait(self) -> Result<()> {
        let (outcome, ran) = match self.state {
            State::Ran(outcome, ran) => (outcome, ran),
            State::Running {
                outcome,
                group,
                call,
            } => outcome.recv().unwrap_or_else(|_| {
                let now = Instant::now();
                let lost = CommError::Backend {
                    group,
                    library: "megatron-rs",
                    call: "wait",
                    message: format!("the thread running {call} stopped without its result"),
                };
                (Err(lost), (now, now))
            }),
        };
        for hook in self.hooks {
            hook(ran);
        }
        match (outcome, self.after) {
            (Ok(()), Some(after)) => after(),
            (outcome, _) => outcome,
        }
    }
}
