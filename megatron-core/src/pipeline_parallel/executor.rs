//! The schedule executor: walks one rank's order, or runs its [plan](fn@super::plan), over a
//! [`Stage`], and nothing else.
//!
//! The walk is pure: the order says which chunk runs a forward, a backward or a weight-gradient
//! pass next, and the j-th pass of each kind through a chunk is its j-th microbatch, as every
//! chunk takes the microbatches in order. What a pass does (compute, take its input, keep its
//! output) and what an exchange does (send and receive) is the stage's: the same walk drives a
//! model's stage and a [`RecordingStage`] that only notes the passes.

use thiserror::Error;

use super::plan::{Action, Transfer};

/// A forward, a backward or a weight-gradient pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward (`F`).
    Forward,
    /// Backward (`B`): the input gradient, which the previous stage waits for, and, unless the
    /// schedule has [`Pass::Weight`] passes, the weight gradients too.
    Backward,
    /// The weight gradients a split backward left for later (`W`): the local products of the
    /// linear layers from what their [`Pass::Backward`] kept; no message leaves the rank.
    Weight,
}

impl Pass {
    /// The letter the zero-bubble papers give it: `F`, `B` or `W`.
    pub fn letter(self) -> &'static str {
        match self {
            Pass::Forward => "F",
            Pass::Backward => "B",
            Pass::Weight => "W",
        }
    }
}

/// One entry of a rank's order: a pass through a local chunk (the microbatch is implied: the
/// chunk's next one for that pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Forward, backward or weight gradients.
    pub pass: Pass,
    /// The local chunk, 0-based.
    pub chunk: usize,
}

impl Slot {
    /// The forward of `chunk`.
    pub fn forward(chunk: usize) -> Slot {
        Slot {
            pass: Pass::Forward,
            chunk,
        }
    }

    /// The backward of `chunk`.
    pub fn backward(chunk: usize) -> Slot {
        Slot {
            pass: Pass::Backward,
            chunk,
        }
    }

    /// The weight-gradient pass of `chunk`.
    pub fn weight(chunk: usize) -> Slot {
        Slot {
            pass: Pass::Weight,
            chunk,
        }
    }

    /// Megatron-LM's order entry (`+k` forward, `−k` backward of chunk `k − 1`) as a slot; 0
    /// names no chunk.
    pub fn from_megatron(entry: i32) -> Option<Slot> {
        let chunk = (entry.unsigned_abs() as usize).checked_sub(1)?;
        Some(match entry > 0 {
            true => Slot::forward(chunk),
            false => Slot::backward(chunk),
        })
    }

    /// The slot as Megatron-LM's order entry; a weight-gradient pass has none.
    pub fn megatron(self) -> Option<i32> {
        let k = self.chunk as i32 + 1;
        match self.pass {
            Pass::Forward => Some(k),
            Pass::Backward => Some(-k),
            Pass::Weight => None,
        }
    }
}

/// One pass of one microbatch through one local chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScheduledPass {
    /// Forward, backward or weight gradients.
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

    /// Runs `microbatch` backward through local chunk `chunk`: its input gradient, and its
    /// weight gradients unless the order has weight-gradient passes.
    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<(), Self::Error>;

    /// Runs the weight gradients `microbatch`'s backward through `chunk` left (orders with
    /// [`Pass::Weight`] passes only).
    fn weight(&mut self, chunk: usize, microbatch: usize) -> Result<(), Self::Error>;

    /// Hands `microbatch`'s output of `pass` from local chunk `from` to local chunk `to` (the
    /// two stages of a V next to each other on one rank): no message.
    fn hand_over(
        &mut self,
        pass: Pass,
        from: usize,
        to: usize,
        microbatch: usize,
    ) -> Result<(), Self::Error> {
        let _ = (pass, from, to, microbatch);
        Ok(())
    }

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
    /// An entry names a chunk the rank does not have.
    #[error(
        "order entry {pass:?} of chunk {chunk} at position {position}: the rank has chunks \
         0..{chunks}"
    )]
    BadEntry {
        /// The entry's pass.
        pass: Pass,
        /// The chunk it names (0-based).
        chunk: usize,
        /// Its position in the order.
        position: usize,
        /// Chunks of the rank.
        chunks: usize,
    },
    /// A chunk is asked for more passes than it has microbatches, for a backward before the
    /// forward of the same microbatch, or for a weight-gradient pass before its backward.
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
    /// Weight-gradient passes run.
    pub weights: usize,
    /// The most microbatches whose activations were held at once (forward done, its last
    /// backward pass not yet: the weight-gradient pass where the order has them): what a
    /// rank's activation memory is proportional to.
    pub max_live: usize,
}

/// Runs `order` for a rank of `chunks` chunks and `microbatches` microbatches over `stage`.
/// With `forward_only`, nothing is held for a backward (evaluation). An order with
/// weight-gradient passes must run one after each backward, and every one before it ends (the
/// optimizer step reads the gradients).
pub fn walk<S: Stage>(
    order: &[Slot],
    chunks: usize,
    microbatches: usize,
    forward_only: bool,
    stage: &mut S,
) -> Result<WalkStats, S::Error> {
    // The next microbatch of each pass, per chunk: forward, backward, weight.
    let mut next = vec![[0usize; 3]; chunks];
    let split = order.iter().any(|s| s.pass == Pass::Weight);
    let mut stats = WalkStats::default();
    let mut live = 0usize;
    let out_of_order = |position, pass, chunk, microbatch, why| WalkError::OutOfOrder {
        position,
        pass,
        chunk,
        microbatch,
        why,
    };
    for (position, &Slot { pass, chunk }) in order.iter().enumerate() {
        if chunk >= chunks {
            return Err(WalkError::BadEntry {
                pass,
                chunk,
                position,
                chunks,
            }
            .into());
        }
        let [forwards, backwards, weights] = next[chunk];
        match pass {
            Pass::Forward => {
                if forwards >= microbatches {
                    let why = "is past the last microbatch";
                    return Err(out_of_order(position, pass, chunk, forwards, why).into());
                }
                stage.forward(chunk, forwards)?;
                next[chunk][0] += 1;
                stats.forwards += 1;
                if !forward_only {
                    live += 1;
                    stats.max_live = stats.max_live.max(live);
                }
            }
            Pass::Backward => {
                let why = if forward_only {
                    Some("in a forward-only schedule")
                } else if backwards >= forwards {
                    Some("comes before its forward")
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(out_of_order(position, pass, chunk, backwards, why).into());
                }
                stage.backward(chunk, backwards)?;
                next[chunk][1] += 1;
                stats.backwards += 1;
                if !split {
                    live -= 1;
                }
            }
            Pass::Weight => {
                if weights >= backwards {
                    let why = "comes before its backward";
                    return Err(out_of_order(position, pass, chunk, weights, why).into());
                }
                stage.weight(chunk, weights)?;
                next[chunk][2] += 1;
                stats.weights += 1;
                live -= 1;
            }
        }
    }
    if split && let Some(chunk) = (0..chunks).find(|&c| next[c][2] < next[c][1]) {
        let why = "never runs: the order ends (and the optimizer steps) before it";
        return Err(out_of_order(order.len(), Pass::Weight, chunk, next[chunk][2], why).into());
    }
    Ok(stats)
}

/// Runs a rank's plan (its passes, checked by [`walk`] when the plan was made, and its
/// exchanges) over `stage`.
pub fn execute<S: Stage>(actions: &[Action], stage: &mut S) -> Result<WalkStats, S::Error> {
    let mut stats = WalkStats::default();
    let mut live = 0usize;
    let split = actions
        .iter()
        .any(|a| matches!(a, Action::Run(op) if op.pass == Pass::Weight));
    for action in actions {
        match action {
            Action::Run(op) => match op.pass {
                Pass::Forward => {
                    stage.forward(op.chunk, op.microbatch)?;
                    stats.forwards += 1;
                    live += 1;
                }
                Pass::Backward => {
                    stage.backward(op.chunk, op.microbatch)?;
                    stats.backwards += 1;
                    if !split {
                        live = live.saturating_sub(1);
                    }
                }
                Pass::Weight => {
                    stage.weight(op.chunk, op.microbatch)?;
                    stats.weights += 1;
                    live = live.saturating_sub(1);
                }
            },
            Action::Exchange { sends, recvs, .. } => stage.exchange(sends, recvs)?,
            Action::HandOver {
                pass,
                from,
                to,
                microbatch,
            } => stage.hand_over(*pass, *from, *to, *microbatch)?,
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

    fn weight(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.ops.push(ScheduledPass {
            pass: Pass::Weight,
            chunk,
            microbatch,
        });
        Ok(())
    }
}
