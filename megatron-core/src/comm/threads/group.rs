//! One group of the in-process world: the rendezvous that matches the members' calls, checks
//! them against each other, and lets a few members move everyone's data.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::exec::{Plan, RawBuf, ReduceSegment};
use super::world::WorldShared;
use crate::comm::{CallDesc, CommError, OpKind, Result};

/// One member's arrival at a collective.
#[derive(Debug, Clone)]
pub(crate) struct Arrival {
    pub desc: CallDesc,
    /// The buffer read (in-place collectives: the buffer itself).
    pub input: RawBuf,
    /// The buffer written (in-place collectives: the buffer itself).
    pub output: RawBuf,
    /// All-to-all only: elements sent to each member.
    pub send_splits: Vec<usize>,
    /// All-to-all only: elements received from each member.
    pub recv_splits: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Members are arriving.
    Gathering,
    /// Everyone arrived; workers move data; members leave once all workers are done.
    Working,
}

#[derive(Debug)]
struct Slot {
    phase: Phase,
    arrivals: Vec<Option<Arrival>>,
    arrived: usize,
    plan: Option<Arc<Plan>>,
    done: usize,
    left: usize,
    /// A failure of the group; every later call returns it.
    poisoned: Option<CommError>,
}

/// A message in flight between two members.
#[derive(Debug)]
struct Message {
    desc: CallDesc,
    bytes: Vec<u8>,
}

/// The shared state of one group.
#[derive(Debug)]
pub(crate) struct GroupShared {
    pub name: String,
    pub ranks: Vec<usize>,
    /// Members that move data in each collective (at most the number of cores).
    workers: usize,
    slot: Mutex<Slot>,
    cv: Condvar,
    /// Queues indexed `src * size + dst`.
    mail: Mutex<Vec<VecDeque<Message>>>,
    mail_cv: Condvar,
}

impl GroupShared {
    pub fn new(name: &str, ranks: &[usize], max_workers: usize) -> Self {
        let n = ranks.len();
        GroupShared {
            name: name.to_string(),
            ranks: ranks.to_vec(),
            workers: n.min(max_workers).max(1),
            slot: Mutex::new(Slot {
                phase: Phase::Gathering,
                arrivals: vec![None; n],
                arrived: 0,
                plan: None,
                done: 0,
                left: 0,
                poisoned: None,
            }),
            cv: Condvar::new(),
            mail: Mutex::new((0..n * n).map(|_| VecDeque::new()).collect()),
            mail_cv: Condvar::new(),
        }
    }

    /// Wakes every waiter so it can notice a world failure.
    pub fn wake_all(&self) {
        let _slot = self.slot.lock();
        self.cv.notify_all();
        drop(_slot);
        let _mail = self.mail.lock();
        self.mail_cv.notify_all();
    }

    /// Runs one collective for member `me`: waits for every member, checks the calls agree,
    /// does this member's share of the data movement and returns once all shares are done.
    pub fn collective(&self, world: &WorldShared, me: usize, arrival: Arrival) -> Result<()> {
        let n = self.ranks.len();
        let deadline = Instant::now() + world.timeout;
        let call = arrival.desc.to_string();
        let mut slot = self.slot.lock();
        // The previous collective may still be draining; it never waits on anything but work.
        while slot.phase != Phase::Gathering && slot.poisoned.is_none() {
            self.cv.wait(&mut slot);
        }
        if let Some(err) = &slot.poisoned {
            return Err(err.clone());
        }
        if let Some(err) = world.failure() {
            return Err(self.poison(&mut slot, err));
        }
        slot.arrivals[me] = Some(arrival);
        slot.arrived += 1;
        if slot.arrived == n {
            let arrivals: Vec<&Arrival> = slot.arrivals.iter().flatten().collect();
            match self.plan(&arrivals) {
                Ok(plan) => {
                    slot.plan = Some(Arc::new(plan));
                    slot.phase = Phase::Working;
                    self.cv.notify_all();
                }
                Err(err) => return Err(self.poison(&mut slot, err)),
            }
        } else {
            while slot.phase != Phase::Working {
                if let Some(err) = &slot.poisoned {
                    return Err(err.clone());
                }
                if let Some(err) = world.failure() {
                    return Err(self.poison(&mut slot, err));
                }
                if self.cv.wait_until(&mut slot, deadline).timed_out()
                    && slot.phase != Phase::Working
                {
                    let missing = (0..n)
                        .filter(|&i| slot.arrivals[i].is_none())
                        .map(|i| self.ranks[i])
                        .collect();
                    let err = CommError::Timeout {
                        group: self.name.clone(),
                        call,
                        waited: world.timeout,
                        missing,
                    };
                    return Err(self.poison(&mut slot, err));
                }
            }
        }
        let plan = Arc::clone(slot.plan.as_ref().expect("a working slot has a plan"));
        drop(slot);
        if me < self.workers {
            // SAFETY: every member's buffers stay borrowed by their owners, who wait below until
            // all workers are done; `plan` validated sizes and in-place aliasing.
            unsafe { plan.execute(me, self.workers) };
        }
        let mut slot = self.slot.lock();
        if me < self.workers {
            slot.done += 1;
            if slot.done == self.workers {
                self.cv.notify_all();
            }
        }
        while slot.done < self.workers {
            self.cv.wait(&mut slot);
        }
        slot.left += 1;
        if slot.left == n {
            slot.arrivals.iter_mut().for_each(|a| *a = None);
            slot.arrived = 0;
            slot.done = 0;
            slot.left = 0;
            slot.plan = None;
            slot.phase = Phase::Gathering;
            self.cv.notify_all();
        }
        Ok(())
    }

    /// Marks the group failed with `err`, wakes everyone, and returns `err`.
    fn poison(&self, slot: &mut Slot, err: CommError) -> CommError {
        slot.poisoned.get_or_insert(err.clone());
        self.cv.notify_all();
        err
    }

    fn mismatch(&self, a: usize, call_a: &CallDesc, b: usize, call_b: &CallDesc) -> CommError {
        CommError::Mismatch {
            group: self.name.clone(),
            rank_a: self.ranks[a],
            call_a: call_a.to_string(),
            rank_b: self.ranks[b],
            call_b: call_b.to_string(),
        }
    }

    /// Checks that the members' calls agree and turns them into data movement.
    fn plan(&self, arrivals: &[&Arrival]) -> Result<Plan> {
        let n = arrivals.len();
        let first = &arrivals[0].desc;
        for (i, a) in arrivals.iter().enumerate().skip(1) {
            let d = &a.desc;
            let same = if first.kind == OpKind::AllToAll {
                d.kind == first.kind && d.dtype == first.dtype
            } else {
                d == first
            };
            if !same {
                return Err(self.mismatch(0, first, i, d));
            }
        }
        let dtype = first.dtype;
        let size = dtype.size();
        let count = first.count;
        Ok(match first.kind {
            OpKind::Barrier => Plan::Nothing,
            OpKind::AllReduce => {
                let bufs: Vec<RawBuf> = arrivals.iter().map(|a| a.input).collect();
                let op = first.op.expect("all-reduce has an op");
                Plan::Reduce {
                    dtype,
                    op,
                    segments: vec![ReduceSegment {
                        sources: bufs.clone(),
                        dests: bufs,
                    }],
                }
            }
            OpKind::ReduceScatter => {
                let op = first.op.expect("reduce-scatter has an op");
                let segments = (0..n)
                    .map(|r| ReduceSegment {
                        sources: arrivals
                            .iter()
                            .map(|a| a.input.slice(r * count, count, size))
                            .collect(),
                        dests: vec![arrivals[r].output],
                    })
                    .collect();
                Plan::Reduce {
                    dtype,
                    op,
                    segments,
                }
            }
            OpKind::AllGather => {
                let mut jobs = Vec::with_capacity(n * n);
                for (j, src) in arrivals.iter().enumerate() {
                    for dst in arrivals {
                        jobs.push((src.input, dst.output.slice(j * count, count, size)));
                    }
                }
                Plan::Copy { dtype, jobs }
            }
            OpKind::Broadcast => {
                let root = first.peer.expect("broadcast has a root");
                let src = arrivals[root].input;
                let jobs = arrivals
                    .iter()
                    .enumerate()
                    .filter(|(r, _)| *r != root)
                    .map(|(_, a)| (src, a.output))
                    .collect();
                Plan::Copy { dtype, jobs }
            }
            OpKind::AllToAll => {
                for (i, a) in arrivals.iter().enumerate() {
                    for (j, b) in arrivals.iter().enumerate() {
                        if a.send_splits[j] != b.recv_splits[i] {
                            return Err(CommError::Mismatch {
                                group: self.name.clone(),
                                rank_a: self.ranks[i],
                                call_a: format!(
                                    "{} sending {} elements to rank {}",
                                    a.desc, a.send_splits[j], self.ranks[j]
                                ),
                                rank_b: self.ranks[j],
                                call_b: format!(
                                    "{} expecting {} elements from rank {}",
                                    b.desc, b.recv_splits[i], self.ranks[i]
                                ),
                            });
                        }
                    }
                }
                let mut jobs = Vec::with_capacity(n * n);
                for (i, a) in arrivals.iter().enumerate() {
                    let mut send_off = 0;
                    for (j, b) in arrivals.iter().enumerate() {
                        let len = a.send_splits[j];
                        let recv_off: usize = b.recv_splits[..i].iter().sum();
                        jobs.push((
                            a.input.slice(send_off, len, size),
                            b.output.slice(recv_off, len, size),
                        ));
                        send_off += len;
                    }
                }
                Plan::Copy { dtype, jobs }
            }
            OpKind::Send | OpKind::Recv => unreachable!("point-to-point does not use the slot"),
        })
    }

    /// Queues a copy of `bytes` from member `src` to member `dst`.
    pub fn post(&self, src: usize, dst: usize, desc: CallDesc, bytes: Vec<u8>) {
        let n = self.ranks.len();
        self.mail.lock()[src * n + dst].push_back(Message { desc, bytes });
        self.mail_cv.notify_all();
    }

    /// Takes the next message from `src` to `dst` and hands it to `deliver` with the sender's call.
    pub fn take(
        &self,
        world: &WorldShared,
        src: usize,
        dst: usize,
        call: &CallDesc,
        deliver: impl FnOnce(&CallDesc, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let n = self.ranks.len();
        let deadline = Instant::now() + world.timeout;
        let mut mail = self.mail.lock();
        loop {
            if let Some(msg) = mail[src * n + dst].pop_front() {
                drop(mail);
                if msg.desc.dtype != call.dtype || msg.desc.count != call.count {
                    return Err(self.mismatch(src, &msg.desc, dst, call));
                }
                return deliver(&msg.desc, &msg.bytes);
            }
            if let Some(err) = world.failure() {
                return Err(err);
            }
            if self.mail_cv.wait_until(&mut mail, deadline).timed_out()
                && mail[src * n + dst].is_empty()
            {
                return Err(CommError::Timeout {
                    group: self.name.clone(),
                    call: call.to_string(),
                    waited: world.timeout,
                    missing: vec![self.ranks[src]],
                });
            }
        }
    }
}
