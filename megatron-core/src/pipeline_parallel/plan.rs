//! Each rank's walk as a plan: its passes in its order and, between them, the exchanges of
//! activations and gradients with the other stages.
//!
//! The schedule is simulated with every pass taking one time step; a rank runs its pass of
//! step `t` (if it has one), then exchanges, in one batch, the messages of step `t` it sends or
//! receives. A message is sent at the step of the pass that produces it. Where it is received
//! depends on the backend's [`Delivery`]:
//!
//! - where sends never wait for their receive (thread, MPI and device-local communicators), at
//!   the step before the pass that needs it: the plan runs as the bare order would, each pass
//!   waiting for its input only. A communicator delivers a pair of ranks' messages in the order
//!   they are sent, so a message is received no later than the ones sent after it on its pair
//!   (in a V, and in the interleaved schedule on 2 ranks, activations and gradients share a
//!   pair's wire, and a later message can be needed first);
//! - where a send waits for its receive (NCCL), sending and receiving one message at a time
//!   deadlocks some schedules (in the interleaved schedule two ranks can each wait in a send
//!   for the other's receive). Megatron-LM batches each iteration's sends and receives
//!   (`batch_isend_irecv`) and receives a message in the iteration its sender sends it,
//!   queueing it until its pass; the plan does the same by time step, which is deadlock-free for
//!   every valid order: a batch of step `t` holds only messages of step `t`, whose other ends
//!   are in the peers' batches of step `t`, and a rank reaches its batch of step `t` once its
//!   batches of earlier steps are done, so by induction on `t` every batch completes.
//!
//! A message between two stages of one rank (where a V turns) is no exchange: the plan hands it
//! over right after the pass that produces it ([`Action::HandOver`]). A weight-gradient pass
//! sends nothing.
//!
//! [`check`] verifies a plan under either delivery.

use std::collections::{BTreeMap, HashMap, HashSet};

use thiserror::Error;

use super::executor::{Pass, ScheduledPass};
use super::schedule::{Schedule, StageMap};
use super::simulate::{Costs, PipelineError, neighbours, simulate};

/// How a backend delivers a send, which decides where a plan exchanges each message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Delivery {
    /// A send never waits for its receive: it is received when its pass needs it.
    Buffered,
    /// A send completes only together with its receive: it is received when it is sent.
    Rendezvous,
}

/// One message of an exchange, as one end sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Activations (a forward's output) or gradients (a backward's input gradient).
    pub pass: Pass,
    /// The local chunk whose pass produced the message (a send) or will consume it (a receive).
    pub chunk: usize,
    /// The microbatch.
    pub microbatch: usize,
    /// The pipeline rank at the other end.
    pub peer: usize,
}

/// One step of a rank's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run a pass.
    Run(ScheduledPass),
    /// Send and receive the messages of time step `step`, in one batch.
    Exchange {
        /// The time step.
        step: u64,
        /// The messages this rank sends.
        sends: Vec<Transfer>,
        /// The messages this rank receives.
        recvs: Vec<Transfer>,
    },
    /// Hand the output of a pass from one local chunk to another (two stages of a V on one
    /// rank): no message.
    HandOver {
        /// Activations or gradients.
        pass: Pass,
        /// The chunk that produced them.
        from: usize,
        /// The chunk that takes them.
        to: usize,
        /// The microbatch.
        microbatch: usize,
    },
}

/// One pipeline rank's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// The pipeline rank.
    pub rank: usize,
    /// Its passes (in its order) and its exchanges.
    pub actions: Vec<Action>,
}

/// Why a plan does not run.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// The schedule is not a valid pipeline.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A pass runs before the message it needs was received.
    #[error("pipeline rank {rank}: {op:?} runs before its input arrives")]
    Early {
        /// The rank.
        rank: usize,
        /// The pass.
        op: ScheduledPass,
    },
    /// A message is sent and never received, or received and never sent.
    #[error(
        "a message of {pass:?} of virtual stage {stage} microbatch {microbatch} has one end only"
    )]
    Unmatched {
        /// Activations or gradients.
        pass: Pass,
        /// The sending virtual stage.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// A rank receives a peer's messages in another order than the peer sends them (a
    /// communicator delivers a pair's messages in order).
    #[error(
        "rank {to} receives rank {from}'s messages as {received:?}, sent as {sent:?} (pass, \
         sending stage, microbatch)"
    )]
    WireOrder {
        /// The sending rank.
        from: usize,
        /// The receiving rank.
        to: usize,
        /// The messages in the order sent.
        sent: Vec<Message>,
        /// The messages in the order received.
        received: Vec<Message>,
    },
    /// Every unfinished rank waits in an exchange for a peer that never joins it.
    #[error("deadlock: ranks blocked in the exchanges of steps {0:?} (rank, step)")]
    Deadlock(Vec<(usize, u64)>),
}

/// The message's identity: its pass, its sending virtual stage and its microbatch.
pub type Message = (Pass, usize, usize);

/// The plans of every rank of `schedule` for a backend of `delivery`, by rank.
pub fn plan(schedule: &Schedule, delivery: Delivery) -> Result<Vec<RankPlan>, PlanError> {
    let timeline = simulate(schedule, Costs::STEPS)?;
    let map = schedule.config.stage_map();
    let (pp, stages) = (map.pp, map.stages());
    type Batch = (Vec<Transfer>, Vec<Transfer>);
    let mut batches: Vec<BTreeMap<u64, Batch>> = vec![BTreeMap::new(); pp];
    // The hand-overs between a rank's own chunks, by the producing pass's (chunk, pass,
    // microbatch).
    let mut local: Vec<HashMap<ScheduledPass, Action>> = vec![HashMap::new(); pp];
    // When each pass starts, by (pass, virtual stage, microbatch).
    let starts: HashMap<Message, u64> = timeline
        .ranks
        .iter()
        .enumerate()
        .flat_map(|(rank, passes)| {
            passes.iter().map(move |t| {
                let stage = map.stage(rank, t.op.chunk);
                ((t.op.pass, stage, t.op.microbatch), t.start)
            })
        })
        .collect();
    // Each pair of ranks' messages in the order they are sent: (send step, the step before the
    // pass that needs it, the send, the receive).
    type Wire = Vec<(u64, u64, Transfer, Transfer)>;
    let mut wires: BTreeMap<(usize, usize), Wire> = BTreeMap::new();
    for (rank, passes) in timeline.ranks.iter().enumerate() {
        for timed in passes {
            let ScheduledPass {
                pass,
                chunk,
                microbatch,
            } = timed.op;
            let Some(to) = neighbours(pass, map.stage(rank, chunk), stages).0 else {
                continue;
            };
            let (peer, to_chunk) = map.locate(to);
            if peer == rank {
                let hand_over = Action::HandOver {
                    pass,
                    from: chunk,
                    to: to_chunk,
                    microbatch,
                };
                local[rank].insert(timed.op, hand_over);
                continue;
            }
            let needed = starts[&(pass, to, microbatch)] - 1;
            let send = Transfer {
                pass,
                chunk,
                microbatch,
                peer,
            };
            let recv = Transfer {
                pass,
                chunk: to_chunk,
                microbatch,
                peer: rank,
            };
            wires
                .entry((rank, peer))
                .or_default()
                .push((timed.start, needed, send, recv));
        }
    }
    for ((rank, peer), wire) in wires {
        // Sent at once; received at once too, or at the step just before the pass that needs
        // it (the producer's step or later) or before a message sent after it on the pair is.
        let mut by = u64::MAX;
        let mut recv_steps = vec![0; wire.len()];
        for (i, &(sent, needed, ..)) in wire.iter().enumerate().rev() {
            by = by.min(needed);
            recv_steps[i] = match delivery {
                Delivery::Buffered => by,
                Delivery::Rendezvous => sent,
            };
        }
        for ((sent, _, send, recv), recv_step) in wire.into_iter().zip(recv_steps) {
            batches[rank].entry(sent).or_default().0.push(send);
            batches[peer].entry(recv_step).or_default().1.push(recv);
        }
    }
    let plans = timeline
        .ranks
        .iter()
        .zip(batches)
        .zip(local)
        .enumerate()
        .map(|(rank, ((passes, mut batches), mut local))| {
            let mut actions = Vec::new();
            let mut passes = passes.iter().peekable();
            loop {
                let next_pass = passes.peek().map(|t| t.start);
                let next_batch = batches.keys().next().copied();
                match (next_pass, next_batch) {
                    (None, None) => break,
                    // A step's pass comes before its exchange.
                    (Some(p), b) if b.is_none_or(|b| p <= b) => {
                        let op = passes.next().expect("peeked").op;
                        actions.push(Action::Run(op));
                        actions.extend(local.remove(&op));
                    }
                    (_, Some(step)) => {
                        let (sends, recvs) = batches.remove(&step).expect("a key");
                        actions.push(Action::Exchange { step, sends, recvs });
                    }
                    (Some(_), None) => unreachable!("matched by the arm above"),
                }
            }
            RankPlan { rank, actions }
        })
        .collect();
    Ok(plans)
}

/// The message `t` carries, seen from rank `rank` (its receiver when `received`).
fn message(t: &Transfer, rank: usize, map: &StageMap, received: bool) -> Message {
    let stage = map.stage(rank, t.chunk);
    let from = match received {
        false => Some(stage),
        true => neighbours(t.pass, stage, map.stages()).1,
    };
    (t.pass, from.unwrap_or(usize::MAX), t.microbatch)
}

/// Checks `plans` on a backend of `delivery` (with [`Delivery::Rendezvous`], a batch completes
/// only once every peer has posted the other ends of its messages; with
/// [`Delivery::Buffered`], once its messages' senders have): no rank runs a pass before its
/// input is received, every message has both ends, and no rank waits forever.
pub fn check(plans: &[RankPlan], map: &StageMap, delivery: Delivery) -> Result<(), PlanError> {
    let stages = map.stages();
    // Which rank's which action holds each message's send and receive.
    let mut sent: HashMap<Message, (usize, usize)> = HashMap::new();
    let mut received: HashMap<Message, (usize, usize)> = HashMap::new();
    // Each pair of ranks' messages in the order sent and in the order received.
    let mut wire_sent: BTreeMap<(usize, usize), Vec<Message>> = BTreeMap::new();
    let mut wire_received: BTreeMap<(usize, usize), Vec<Message>> = BTreeMap::new();
    for plan in plans {
        let mut inbox = HashSet::new();
        for (i, action) in plan.actions.iter().enumerate() {
            match action {
                Action::Run(op) => {
                    let stage = map.stage(plan.rank, op.chunk);
                    if let Some(from) = neighbours(op.pass, stage, stages).1
                        && !inbox.remove(&(op.pass, from, op.microbatch))
                    {
                        return Err(PlanError::Early {
                            rank: plan.rank,
                            op: *op,
                        });
                    }
                }
                Action::Exchange { sends, recvs, .. } => {
                    for t in sends {
                        let m = message(t, plan.rank, map, false);
                        sent.insert(m, (plan.rank, i));
                        wire_sent.entry((plan.rank, t.peer)).or_default().push(m);
                    }
                    for t in recvs {
                        let m = message(t, plan.rank, map, true);
                        received.insert(m, (plan.rank, i));
                        wire_received
                            .entry((t.peer, plan.rank))
                            .or_default()
                            .push(m);
                        inbox.insert(m);
                    }
                }
                Action::HandOver {
                    pass,
                    from,
                    microbatch,
                    ..
                } => {
                    inbox.insert((*pass, map.stage(plan.rank, *from), *microbatch));
                }
            }
        }
    }
    for m in sent.keys().chain(received.keys()) {
        if !(sent.contains_key(m) && received.contains_key(m)) {
            let (pass, stage, microbatch) = *m;
            return Err(PlanError::Unmatched {
                pass,
                stage,
                microbatch,
            });
        }
    }
    for (&(from, to), order) in &wire_sent {
        let got = wire_received.get(&(from, to)).cloned().unwrap_or_default();
        if &got != order {
            return Err(PlanError::WireOrder {
                from,
                to,
                sent: order.clone(),
                received: got,
            });
        }
    }
    // Every rank advances through its actions (passes never block); a batch completes once
    // the peer of each of its messages (each it receives, without a rendezvous) has reached
    // the batch holding the other end.
    let mut at = vec![0usize; plans.len()];
    loop {
        let mut progress = false;
        for plan in plans {
            let r = plan.rank;
            while let Some(action) = plan.actions.get(at[r]) {
                if let Action::Exchange { sends, recvs, .. } = action {
                    let reached = |&(peer, i): &(usize, usize)| at[peer] >= i;
                    let ready = (delivery == Delivery::Buffered
                        || sends
                            .iter()
                            .all(|t| reached(&received[&message(t, r, map, false)])))
                        && recvs
                            .iter()
                            .all(|t| reached(&sent[&message(t, r, map, true)]));
                    if !ready {
                        break;
                    }
                }
                at[r] += 1;
                progress = true;
            }
        }
        if plans.iter().all(|p| at[p.rank] == p.actions.len()) {
            return Ok(());
        }
        if !progress {
            let blocked = plans
                .iter()
                .filter_map(|p| match p.actions.get(at[p.rank]) {
                    Some(Action::Exchange { step, .. }) => Some((p.rank, *step)),
                    _ => None,
                })
                .collect();
            return Err(PlanError::Deadlock(blocked));
        }
    }
}
