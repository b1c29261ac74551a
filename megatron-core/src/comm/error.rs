//! `CommError`: why a collective failed, naming the group, the ranks and the calls.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::tensor::TensorError;

/// A collective or point-to-point operation failed.
#[derive(Debug, Clone, Error)]
pub enum CommError {
    /// Ranks of a group called different collectives or passed different sizes.
    #[error(
        "collective mismatch in group {group}: rank {rank_a} called {call_a}, rank {rank_b} called {call_b}"
    )]
    Mismatch {
        /// The group's name.
        group: String,
        /// Global rank of the first caller.
        rank_a: usize,
        /// Its call.
        call_a: String,
        /// Global rank of a disagreeing caller.
        rank_b: usize,
        /// Its call.
        call_b: String,
    },
    /// Some ranks of the group did not arrive in time.
    #[error(
        "timeout after {waited:?} in group {group} waiting for {call}: {}",
        describe_missing(.missing)
    )]
    Timeout {
        /// The group's name.
        group: String,
        /// The call that waited.
        call: String,
        /// How long it waited.
        waited: Duration,
        /// Global ranks that never arrived.
        missing: Vec<usize>,
    },
    /// Another rank failed; every rank stops with its error.
    #[error("rank {rank} failed: {message}")]
    PeerFailed {
        /// Global rank that failed first.
        rank: usize,
        /// Its error.
        message: Arc<str>,
    },
    /// The arguments are invalid on their own (a root outside the group, splits that do not add up).
    #[error("group {group}: {message}")]
    Invalid {
        /// The group's name.
        group: String,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// The communication library (MPI, NCCL, CUDA) reported an error.
    #[error("group {group}: {library} error in {call}: {message}")]
    Backend {
        /// The group's name.
        group: String,
        /// The library, e.g. `MPI`.
        library: &'static str,
        /// The library call that failed.
        call: &'static str,
        /// The library's description of the error.
        message: String,
    },
    /// A tensor could not be used (not contiguous, borrowed, wrong dtype).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Which ranks a timed-out call waited for: none known means the library's call never finished.
fn describe_missing(missing: &[usize]) -> String {
    if missing.is_empty() {
        "the call never finished (a peer did not join it)".to_string()
    } else {
        format!("global ranks {missing:?} never arrived")
    }
}
