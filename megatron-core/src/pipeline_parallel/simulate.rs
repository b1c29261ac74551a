//! The whole pipeline of a schedule, simulated: every rank walks its order (through the
//! [`executor`](super::executor), on a recording stage), activations and gradients go between
//! adjacent virtual stages, and each pass waits for its input. This checks that a schedule is a
//! valid pipeline (each rank receives what it waits for, in the order it is sent, and no rank
//! waits forever) and times it with given pass costs: the timeline, its length and its bubble.
//!
//! Virtual stage `s = chunk·pp + rank` holds chunk `chunk` of pipeline rank `rank`; stage `s`
//! receives activations from `s − 1` and gradients from `s + 1`. Sends never wait; a receive
//! waits for its message. (With sends that wait for their receive, sending and receiving one
//! message at a time deadlocks some of these orders: [`plan`](fn@super::plan) batches them.)

use std::collections::HashMap;

use thiserror::Error;

use super::executor::{Pass, RecordingStage, ScheduledPass, WalkError, WalkStats, walk};
use super::schedule::Schedule;

/// Why a schedule is not a valid pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PipelineError {
    /// A rank's order cannot be walked.
    #[error("pipeline rank {rank}: {source}")]
    Walk {
        /// The rank.
        rank: usize,
        /// Why.
        source: WalkError,
    },
    /// A channel between two ranks delivers messages in another order than they are awaited.
    #[error(
        "{pass:?} messages from rank {from} to rank {to}: sent as {sent:?}, awaited as {awaited:?} \
         (virtual stage, microbatch)"
    )]
    ChannelOrder {
        /// Activations (forward) or gradients (backward).
        pass: Pass,
        /// The sending rank.
        from: usize,
        /// The receiving rank.
        to: usize,
        /// What the sender sends, in its order.
        sent: Vec<(usize, usize)>,
        /// What the receiver waits for, in its order.
        awaited: Vec<(usize, usize)>,
    },
    /// Every unfinished rank waits for a message that never comes.
    #[error("deadlock: {}", describe_waits(.waiting))]
    Deadlock {
        /// Each blocked rank, the pass it cannot start and the pass whose output it waits for.
        waiting: Vec<(usize, ScheduledPass, Pass, usize, usize)>,
    },
}

fn describe_waits(waiting: &[(usize, ScheduledPass, Pass, usize, usize)]) -> String {
    waiting
        .iter()
        .map(|(rank, op, pass, stage, mb)| {
            format!(
                "rank {rank} at {:?} of chunk {} microbatch {} waits for the {pass:?} of virtual stage {stage} microbatch {mb}",
                op.pass, op.chunk, op.microbatch
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One pass in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timed {
    /// The pass.
    pub op: ScheduledPass,
    /// When it starts.
    pub start: u64,
    /// When it ends.
    pub end: u64,
}

/// A simulated step of the pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Each rank's passes in time, by rank.
    pub ranks: Vec<Vec<Timed>>,
    /// Each rank's walk: passes and the most activations held at once.
    pub walks: Vec<WalkStats>,
    /// When the last pass ends.
    pub makespan: u64,
    /// Time a rank computes in the step (the same for every rank).
    pub busy: u64,
}

impl Timeline {
    /// The bubble: idle time over compute time, `(makespan − busy) / busy`; Megatron-LM's
    /// theory gives (pp − 1)/M for 1F1B and (pp − 1)/(V·M) for the interleaved schedule.
    pub fn bubble(&self) -> f64 {
        (self.makespan - self.busy) as f64 / self.busy.max(1) as f64
    }
}

/// Each rank's passes as the executor runs its order, and what the walk measured.
pub fn traces(schedule: &Schedule) -> Result<Vec<(Vec<ScheduledPass>, WalkStats)>, PipelineError> {
    let c = &schedule.config;
    schedule
        .ranks
        .iter()
        .map(|r| {
            let mut stage = RecordingStage::default();
            let stats = walk(&r.order, c.vpp, c.microbatches, c.forward_only, &mut stage).map_err(
                |source| PipelineError::Walk {
                    rank: r.rank,
                    source,
                },
            )?;
            Ok((stage.ops, stats))
        })
        .collect()
}

/// The pass an op waits for: (pass, virtual stage, microbatch), if any.
fn dependency(op: &ScheduledPass, stage: usize, stages: usize) -> Option<(Pass, usize, usize)> {
    match op.pass {
        Pass::Forward => (stage > 0).then(|| (Pass::Forward, stage - 1, op.microbatch)),
        Pass::Backward if stage + 1 < stages => Some((Pass::Backward, stage + 1, op.microbatch)),
        // The last stage's backward starts from its own forward's loss.
        Pass::Backward => Some((Pass::Forward, stage, op.microbatch)),
    }
}

/// Checks that on every channel (a rank to a neighbour, activations or gradients) the messages
/// are awaited in the order they are sent: a communicator delivers a pair's messages in order.
fn check_channels(
    schedule: &Schedule,
    traces: &[(Vec<ScheduledPass>, WalkStats)],
) -> Result<(), PipelineError> {
    let pp = schedule.config.pp;
    let stages = pp * schedule.config.vpp;
    type Channel = (Pass, usize, usize);
    let mut sent: HashMap<Channel, Vec<(usize, usize)>> = HashMap::new();
    let mut awaited: HashMap<Channel, Vec<(usize, usize)>> = HashMap::new();
    for (rank, (ops, _)) in traces.iter().enumerate() {
        for op in ops {
            let s = op.chunk * pp + rank;
            let (to, from) = match op.pass {
                Pass::Forward => ((s + 1 < stages).then(|| s + 1), s.checked_sub(1)),
                Pass::Backward => (s.checked_sub(1), (s + 1 < stages).then(|| s + 1)),
            };
            if let Some(to) = to {
                sent.entry((op.pass, rank, to % pp))
                    .or_default()
                    .push((s, op.microbatch));
            }
            if let Some(from) = from {
                awaited
                    .entry((op.pass, from % pp, rank))
                    .or_default()
                    .push((from, op.microbatch));
            }
        }
    }
    let mut channels: Vec<&Channel> = sent.keys().chain(awaited.keys()).collect();
    channels.sort_by_key(|(pass, from, to)| (*pass == Pass::Backward, *from, *to));
    channels.dedup();
    for channel in channels {
        let s = sent.get(channel).cloned().unwrap_or_default();
        let a = awaited.get(channel).cloned().unwrap_or_default();
        if s != a {
            let (pass, from, to) = *channel;
            return Err(PipelineError::ChannelOrder {
                pass,
                from,
                to,
                sent: s,
                awaited: a,
            });
        }
    }
    Ok(())
}

/// Simulates one step of `schedule` with a forward of a chunk taking `forward` time units and a
/// backward `backward`: checks the channels, finds deadlocks, and times every pass.
pub fn simulate(
    schedule: &Schedule,
    forward: u64,
    backward: u64,
) -> Result<Timeline, PipelineError> {
    let traces = traces(schedule)?;
    check_channels(schedule, &traces)?;
    let pp = schedule.config.pp;
    let stages = pp * schedule.config.vpp;
    let mut done: HashMap<(Pass, usize, usize), u64> = HashMap::new();
    // The ranks blocked on each pass not yet done; a rank runs again once its pass is done, so
    // every pass is timed once: linear in the schedule's length.
    let mut blocked: HashMap<(Pass, usize, usize), Vec<usize>> = HashMap::new();
    let mut runnable: Vec<usize> = (0..pp).rev().collect();
    let mut next = vec![0usize; pp];
    let mut free = vec![0u64; pp];
    let mut timed: Vec<Vec<Timed>> = vec![Vec::new(); pp];
    while let Some(rank) = runnable.pop() {
        let ops = &traces[rank].0;
        while let Some(op) = ops.get(next[rank]) {
            let stage = op.chunk * pp + rank;
            let ready = match dependency(op, stage, stages) {
                None => 0,
                Some(dep) => match done.get(&dep) {
                    Some(&end) => end,
                    None => {
                        blocked.entry(dep).or_default().push(rank);
                        break;
                    }
                },
            };
            let start = ready.max(free[rank]);
            let cost = match op.pass {
                Pass::Forward => forward,
                Pass::Backward => backward,
            };
            let end = start + cost;
            let key = (op.pass, stage, op.microbatch);
            done.insert(key, end);
            if let Some(ranks) = blocked.remove(&key) {
                runnable.extend(ranks);
            }
            timed[rank].push(Timed {
                op: *op,
                start,
                end,
            });
            free[rank] = end;
            next[rank] += 1;
        }
    }
    if (0..pp).any(|r| next[r] < traces[r].0.len()) {
        let waiting = (0..pp)
            .filter_map(|rank| {
                let op = traces[rank].0.get(next[rank])?;
                let (pass, stage, mb) = dependency(op, op.chunk * pp + rank, stages)?;
                Some((rank, *op, pass, stage, mb))
            })
            .collect();
        return Err(PipelineError::Deadlock { waiting });
    }
    let makespan = free.iter().copied().max().unwrap_or(0);
    let busy = timed[0].iter().map(|t| t.end - t.start).sum();
    Ok(Timeline {
        ranks: timed,
        walks: traces.iter().map(|(_, stats)| *stats).collect(),
        makespan,
        busy,
    })
}

/// The timeline as text, a row per rank and a column per time unit: a forward shows its
/// microbatch (1-based), a backward the same with `'`; with several chunks each pass is
/// prefixed by its chunk's letter (`a` the first); `.` is idle.
pub fn draw(timeline: &Timeline, chunks: usize) -> String {
    let label = |t: &Timed| {
        let chunk = if chunks > 1 {
            char::from(b'a' + (t.op.chunk % 26) as u8).to_string()
        } else {
            String::new()
        };
        let tick = if t.op.pass == Pass::Backward { "'" } else { "" };
        format!("{chunk}{}{tick}", t.op.microbatch + 1)
    };
    let width = timeline
        .ranks
        .iter()
        .flatten()
        .map(|t| label(t).len())
        .max()
        .unwrap_or(1)
        + 1;
    let mut out = String::new();
    for (rank, passes) in timeline.ranks.iter().enumerate() {
        let mut cells = vec![".".to_string(); timeline.makespan as usize];
        for t in passes {
            for cell in &mut cells[t.start as usize..t.end as usize] {
                *cell = label(t);
            }
        }
        out.push_str(&format!("rank {rank:<2}|"));
        for cell in cells {
            out.push_str(&format!("{cell:>width$}"));
        }
        out.push('\n');
    }
    out
}
