//! The whole pipeline of a schedule, simulated: every rank walks its order (through the
//! [`executor`](super::executor), on a recording stage), activations and gradients go between
//! adjacent virtual stages, and each pass waits for its input. This checks that a schedule is a
//! valid pipeline (each rank receives what it waits for, in the order it is sent, and no rank
//! waits forever) and times it with given pass costs: the timeline, its length and its bubble.
//!
//! Virtual stage `s` is a chunk of a rank as the schedule's [`StageMap`] places it (`chunk·pp +
//! rank` in Megatron-LM's loop); stage `s` receives activations from `s − 1` and gradients from
//! `s + 1` (from the same rank where the V turns). Sends never wait; a receive waits for its
//! message. A weight-gradient pass waits for nothing but its own backward, earlier in its
//! order. (With sends that wait for their receive, sending and receiving one message at a time
//! deadlocks some of these orders: [`plan`](fn@super::plan) batches them.)

use std::collections::HashMap;

use thiserror::Error;

use super::executor::{Pass, RecordingStage, ScheduledPass, WalkError, WalkStats, walk};
use super::schedule::{Schedule, ScheduleConfig};

/// What each pass costs in a simulation, in time units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Costs {
    /// A forward (`T_F`).
    pub forward: u64,
    /// A backward's input gradient (`T_B`).
    pub backward: u64,
    /// A backward's weight gradients (`T_W`): a pass of their own in a zero-bubble schedule,
    /// part of the backward otherwise.
    pub weight: u64,
}

impl Costs {
    /// Every pass one unit, a backward without weight-gradient passes as well (the plan's time
    /// steps).
    pub const STEPS: Costs = Costs {
        forward: 1,
        backward: 1,
        weight: 0,
    };

    /// A forward of 1, an input gradient of 1 and weight gradients of 1 (a backward computes two
    /// products for each of the forward's one): the zero-bubble papers' equal times.
    pub const EQUAL: Costs = Costs {
        forward: 1,
        backward: 1,
        weight: 1,
    };

    /// The costs as `[F, B, W]` times, for [`theory`].
    pub fn times(&self) -> [f64; 3] {
        [self.forward, self.backward, self.weight].map(|c| c as f64)
    }

    /// What `pass` costs in a schedule that `splits` its backwards (a weight-gradient pass at
    /// least one unit: each pass of a rank has a time of its own).
    pub fn of(&self, pass: Pass, splits: bool) -> u64 {
        match pass {
            Pass::Forward => self.forward,
            Pass::Backward if splits => self.backward,
            Pass::Backward => self.backward + self.weight,
            Pass::Weight => self.weight.max(1),
        }
    }
}

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
    /// Time each rank computes in the step.
    pub busy_per_rank: Vec<u64>,
}

impl Timeline {
    /// The bubble: idle time over compute time (rank 0's), `(makespan − busy) / busy`;
    /// Megatron-LM's theory gives (pp − 1)/M for 1F1B and (pp − 1)/(V·M) for the interleaved
    /// schedule (the zero-bubble schedules' in [`super::zero_bubble`]).
    pub fn bubble(&self) -> f64 {
        let busy = self.busy_per_rank.first().copied().unwrap_or(0);
        (self.makespan - busy) as f64 / busy.max(1) as f64
    }

    /// Each rank's bubble, `(makespan − its busy time) / its busy time`, averaged over the ranks
    /// (with ranks of unequal costs, the lighter ones idle more).
    pub fn mean_rank_bubble(&self) -> f64 {
        let n = self.busy_per_rank.len().max(1) as f64;
        self.busy_per_rank
            .iter()
            .map(|&busy| (self.makespan - busy) as f64 / busy.max(1) as f64)
            .sum::<f64>()
            / n
    }

    /// The idle time inside each rank's span (from its first pass's start to its last pass's
    /// end) over its compute time, averaged over the ranks: the bubble of steps run back to back
    /// with the start-up ramp of one filled by the end of the one before (Qi et al.'s
    /// "optimizer post-validation"), which the zero-bubble papers' formulas count.
    pub fn bubble_within_ranks(&self) -> f64 {
        let n = self.ranks.len().max(1) as f64;
        self.ranks
            .iter()
            .zip(&self.busy_per_rank)
            .map(|(passes, &busy)| match (passes.first(), passes.last()) {
                (Some(first), Some(last)) => {
                    (last.end - first.start - busy) as f64 / busy.max(1) as f64
                }
                _ => 0.0,
            })
            .sum::<f64>()
            / n
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
        // After its own backward, which its order runs first.
        Pass::Weight => Some((Pass::Backward, stage, op.microbatch)),
    }
}

/// The stage a pass's output goes to and the stage its input comes from, if any: activations
/// go up the stages, gradients down; weight gradients go nowhere.
pub(super) fn neighbours(
    pass: Pass,
    stage: usize,
    stages: usize,
) -> (Option<usize>, Option<usize>) {
    let up = (stage + 1 < stages).then(|| stage + 1);
    let down = stage.checked_sub(1);
    match pass {
        Pass::Forward => (up, down),
        Pass::Backward => (down, up),
        Pass::Weight => (None, None),
    }
}

/// Checks that on every channel (a rank to a neighbour, activations or gradients) the messages
/// are awaited in the order they are sent: a communicator delivers a pair's messages in order.
fn check_channels(
    schedule: &Schedule,
    traces: &[(Vec<ScheduledPass>, WalkStats)],
) -> Result<(), PipelineError> {
    let map = schedule.config.stage_map();
    let stages = map.stages();
    type Channel = (Pass, usize, usize);
    let mut sent: HashMap<Channel, Vec<(usize, usize)>> = HashMap::new();
    let mut awaited: HashMap<Channel, Vec<(usize, usize)>> = HashMap::new();
    for (rank, (ops, _)) in traces.iter().enumerate() {
        for op in ops {
            let s = map.stage(rank, op.chunk);
            let (to, from) = neighbours(op.pass, s, stages);
            if let Some(to) = to {
                sent.entry((op.pass, rank, map.locate(to).0))
                    .or_default()
                    .push((s, op.microbatch));
            }
            if let Some(from) = from {
                awaited
                    .entry((op.pass, map.locate(from).0, rank))
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

/// Simulates one step of `schedule` with its passes through a chunk taking `costs`: checks the
/// channels, finds deadlocks, and times every pass.
pub fn simulate(schedule: &Schedule, costs: Costs) -> Result<Timeline, PipelineError> {
    simulate_ranks(schedule, &vec![costs; schedule.config.pp])
}

/// [`simulate`] with each rank's passes costing its own `costs[rank]` (stages of unequal work,
/// e.g. pass times measured per rank).
pub fn simulate_ranks(schedule: &Schedule, costs: &[Costs]) -> Result<Timeline, PipelineError> {
    let traces = traces(schedule)?;
    check_channels(schedule, &traces)?;
    let pp = schedule.config.pp;
    let map = schedule.config.stage_map();
    let stages = map.stages();
    let splits = schedule.config.kind.splits_backward();
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
            let stage = map.stage(rank, op.chunk);
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
            let cost = costs.get(rank).unwrap_or(&Costs::STEPS);
            let end = start + cost.of(op.pass, splits);
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
                let (pass, stage, mb) = dependency(op, map.stage(rank, op.chunk), stages)?;
                Some((rank, *op, pass, stage, mb))
            })
            .collect();
        return Err(PipelineError::Deadlock { waiting });
    }
    let makespan = free.iter().copied().max().unwrap_or(0);
    let busy_per_rank: Vec<u64> = timed
        .iter()
        .map(|passes| passes.iter().map(|t| t.end - t.start).sum())
        .collect();
    Ok(Timeline {
        ranks: timed,
        walks: traces.iter().map(|(_, stats)| *stats).collect(),
        makespan,
        busy_per_rank,
    })
}

/// The timeline as text, a row per rank and a column per time unit: a forward shows its
/// microbatch (1-based), a backward the same with `'`, a weight-gradient pass with `"`; with
/// several chunks each pass is prefixed by its chunk's letter (`a` the first); `.` is idle.
pub fn draw(timeline: &Timeline, chunks: usize) -> String {
    let label = |t: &Timed| {
        let chunk = if chunks > 1 {
            char::from(b'a' + (t.op.chunk % 26) as u8).to_string()
        } else {
            String::new()
        };
        let tick = match t.op.pass {
            Pass::Forward => "",
            Pass::Backward => "'",
            Pass::Weight => "\"",
        };
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

/// A schedule's bubble as its paper states it, for comparison with a simulated or measured
/// one: idle time over compute time per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Theory {
    /// The bubble of one step ([`Timeline::bubble`]).
    pub bubble: f64,
    /// The paper's formula (`p` ranks, `m` microbatches, `V` chunks, a chunk's pass times `F`,
    /// `B`, `W`), and with the start-up ramp `(p − 1)F` added where the paper counts only the
    /// idle time inside the ranks' spans ([`Timeline::bubble_within_ranks`]).
    pub formula: &'static str,
    /// The bubble inside the ranks' spans, where the paper's formula counts that (ZB-H2, ZB-V).
    pub within_ranks: Option<f64>,
    /// The fewest microbatches that fill the pipeline, from which on the formula holds (with
    /// fewer, the warm-up never reaches its steady phase).
    pub min_microbatches: usize,
}

/// The bubble `config`'s schedule has in theory with a chunk's forward, input gradient and
/// weight gradients taking `times` (`[F, B, W]`, in any unit: [`Costs::times`], or measured),
/// for enough microbatches to fill the pipeline ([`Theory::min_microbatches`]): Megatron-LM's
/// for 1F1B and interleaved, Qi et al.'s for ZB-H1, ZB-H2 and ZB-V, DeepSeek's for DualPipeV
/// with its overlapped forward-and-backward taking `F + B + W` (run one after the other).
pub fn theory(config: &ScheduleConfig, [f, b, w]: [f64; 3]) -> Theory {
    use super::schedule::ScheduleKind as K;
    let (p, m, v) = (
        config.pp as f64 - 1.0,
        config.microbatches as f64,
        config.vpp as f64,
    );
    let busy = v * m * (f + b + w);
    // The paper's idle time, and the start-up ramp where the paper leaves it out.
    let (idle, ramp, formula) = match config.kind {
        K::OneFOneB => (p * (f + b + w), 0.0, "(p − 1)(F + B + W) / m(F + B + W)"),
        K::Interleaved => (p * (f + b + w), 0.0, "(p − 1)(F + B + W) / V·m(F + B + W)"),
        K::ZbH1 => (p * (f + b - w), 0.0, "(p − 1)(F + B − W) / m(F + B + W)"),
        K::ZbH2 => (
            p * (f + b - 2.0 * w),
            p * f,
            "[(p − 1)(F + B − 2W) + ramp (p − 1)F] / m(F + B + W)",
        ),
        K::Zbv => (
            p * (f + b - 2.0 * w),
            p * f,
            "[(p − 1)(F + B − 2W) + ramp (p − 1)F] / 2m(F + B + W)",
        ),
        K::DualPipeV => (
            p * ((f + b + w) + b - 3.0 * w),
            0.0,
            "(p − 1)(F&B + B − 3W) / 2m(F + B + W), F&B = F + B + W",
        ),
    };
    let idle = idle.max(0.0);
    let pp = config.pp;
    let min_microbatches = match config.kind {
        K::OneFOneB => 1,
        K::Interleaved | K::ZbH1 => pp,
        K::ZbH2 => 2 * pp - 1,
        K::Zbv | K::DualPipeV => 2 * pp,
    };
    let over_busy = |t: f64| if busy > 0.0 { t / busy } else { 0.0 };
    Theory {
        bubble: over_busy(idle + ramp),
        formula,
        within_ranks: (ramp > 0.0).then(|| over_busy(idle)),
        min_microbatches,
    }
}
