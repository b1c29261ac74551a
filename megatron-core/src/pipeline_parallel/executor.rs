//! The schedule executor: walks one rank's order over a [`Stage`], and nothing else.
//!
//! The walk is pure: the order says which chunk runs a forward or a backward next, and the j-th
//! forward (or backward) of a chunk is its j-th microbatch, as every chunk takes the microbatches
//! in order. What a pass does (receive its input, compute, send its output) is the stage's: the
//! same walk drives a model's stage and a [`RecordingStage`] that only notes the passes.

use thiserror::Error;

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
pub struct Op {
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

/// A stage that runs nothing and notes every pass, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordingStage {
    /// The passes, in the order they ran.
    pub ops: Vec<Op>,
}

impl Stage for RecordingStage {
    type Error = WalkError;

    fn forward(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.ops.push(Op {
            pass: Pass::Forward,
            chunk,
            microbatch,
        });
        Ok(())
    }

    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.ops.push(Op {
            pass: Pass::Backward,
            chunk,
            microbatch,
        });
        Ok(())
    }
}
