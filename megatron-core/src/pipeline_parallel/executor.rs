//! The schedule executor: walks one rank's order, or runs its [plan](fn@super::plan), over a
//! [`Stage`], and nothing else.
//!
//! The walk is pure: the order says which chunk runs a forward or a backward next, and the j-th
//! forward (or backward) of a chunk is its j-th microbatch, as every chunk takes the microbatches
//! in order. What a pass does (compute, take its input, keep its output) and what an exchange
//! does (send and receive) is the stage's: the same walk drives a model's stage and a
//! [`RecordingStage`] that only notes the passes.

use thiserror::Error;

use super::plan::{Action, Transfer};

/// A forward or a backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
}

/// One pass of one microbatch through one local chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScheduledPass {
    /// Forward or backward.
    pub pass: Pass,
    /// The local chunk, 0-based.
    pub chunk: usize,
    /// The microbatch, 0-based.
    pub microbatch: usize,
}

/// What runs the passes of one pipeline rank.
pub trait Stage {
    /// What a pass can fail with.
    type Error: From<WalkError>;

    /// Runs `microbatch` forward through local chunk `chunk`.
    fn forward(&mut self, chunk: usize, microbatch: usize) -> Result<(), Self::Error>;

    /// Runs `microbatch` backward through local chunk `chunk`.
    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<(), Self::Error>;

    /// Sends the outputs `sends` name and receives the inputs `recvs` name, in one batch (see
    /// [`plan`](fn@super::plan)). A stage that moves nothing between ranks keeps this default.
    fn exchange(&mut self, sends: &[Transfer], recvs: &[Transfer]) -> Result<(), Self::Error> {
        let _ = (sends, recvs);
        Ok(())
    }
}

/// An order the executor cannot walk.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WalkError {
    /// An entry names a chunk the rank does not have, or is 0.
    #[error("order entry {entry} at position {position}: the rank has chunks 1..={chunks}")]
    BadEntry {
        /// The entry.
        entry: i32,
        /// Its position in the order.
        position: usize,
        /// Chunks of the rank.
        chunks: usize,
    },
    /// A chunk is asked for more passes than it has microbatches, or for a backward before the
    /// forward of the same microbatch.
    #[error("order position {position}: {pass:?} of chunk {chunk} microbatch {microbatch} {why}")]
    OutOfOrder {
        /// Its position in the order.
        position: usize,
        /// The pass.
        pass: Pass,
        /// The chunk (0-based).
        chunk: usize,
        /// The microbatch it would be.
        microbatch: usize,
        /// What is wrong.
        why: &'static str,
    },
}

/// What a walk measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WalkStats {
    /// Forwards run.
    pub forwards: usize,
    /// Backwards run.
    pub backwards: usize,
    /// The most microbatches whose activations were held at once (forward done, backward
    /// not yet): what a rank's activation memory is proportional to.
    pub max_live: usize,
}

/// Runs `order` (`+k` forward, `−k` backward of chunk `k − 1`) for a rank of `chunks` chunks
/// and `microbatches` microbatches over `stage`. With `forward_only`, nothing is held for a
/// backward (evaluation).
pub fn walk<S: Stage>(
    order: &[i32],
    chunks: usize,
    microbatches: usize,
    forward_only: bool,
    stage: &mut S,
) -> Result<WalkStats, S::Error> {
    let mut next_forward = vec![0usize; chunks];
    let mut next_backward = vec![0usize; chunks];
    let mut stats = WalkStats::default();
    let mut live = 0usize;
    for (position, &entry) in order.iter().enumerate() {
        let k = entry.unsigned_abs() as usize;
        if k == 0 || k > chunks {
            return Err(WalkError::BadEntry {
                entry,
                position,
                chunks,
            }
            .into());
        }
        let chunk = k - 1;
        if entry > 0 {
            let microbatch = next_forward[chunk];
            if microbatch >= microbatches {
                return Err(WalkError::OutOfOrder {
                    position,
                    pass: Pass::Forward,
                    chunk,
                    microbatch,
                    why: "is past the last microbatch",
                }
                .into());
            }
            stage.forward(chunk, microbatch)?;
            next_forward[chunk] += 1;
            stats.forwards += 1;
            if !forward_only {
                live += 1;
                stats.max_live = stats.max_live.max(live);
            }
        } else {
            let microbatch = next_backward[chunk];
            let why = if forward_only {
                Some("in a forward-only schedule")
            } else if microbatch >= next_forward[chunk] {
                Some("comes before its forward")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(WalkError::OutOfOrder {
                    position,
                    pass: Pass::Backward,
                    chunk,
                    microbatch,
                    why,
                }
                .into());
            }
            stage.backward(chunk, microbatch)?;
            next_backward[chunk] += 1;
            stats.backwards += 1;
            live -= 1;
        }
    }
    Ok(stats)
}

/// Runs a rank's plan (its passes, checked by [`walk`] when the plan was made, and its
/// exchanges) over `stage`.
pub fn execute<S: Stage>(actions: &[Action], stage: &mut S) -> Result<WalkStats, S::Error> {
    let mut stats = WalkStats::default();
    let mut live = 0usize;
    for action in actions {
        match action {
            Action::Run(op) if op.pass == Pass::Forward => {
                stage.forward(op.chunk, op.microbatch)?;
                stats.forwards += 1;
                live += 1;
            }
            Action::Run(op) => {
                stage.backward(op.chunk, op.microbatch)?;
                stats.backwards += 1;
                live = live.saturating_sub(1);
            }
            Action::Exchange { sends, recvs, .. } => stage.exchange(sends, recvs)?,
        }
        stats.max_live = stats.max_live.max(live);
    }
    if stats.backwards == 0 {
        // Forwards only (evaluation): nothing is held for a backward.
        stats.max_live = 0;
    }
    Ok(stats)
}

/// A stage that runs nothing and notes every pass, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordingStage {
    /// The passes, in the order they ran.
    pub ops: Vec<ScheduledPass>,
}

impl Stage for RecordingStage {
    type Error = WalkError;

    fn forward(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.ops.push(ScheduledPass {
            pass: Pass::Forward,
            chunk,
            microbatch,
        });
        Ok(())
    }

    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.ops.push(ScheduledPass {
            pass: Pass::Backward,
            chunk,
            microbatch,
        });
        Ok(())
    }
}
