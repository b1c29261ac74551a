//! One group of the in-process world: the rendezvous that matches the members' calls, checks
//! them against each other, and lets a few members move everyone's data.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::exec::{Plan, RawBuf, ReduceSegment, Work};
use super::world::WorldShared;
use crate::comm::{CallDesc, CommError, OpKind, Result};
use crate::tensor::Tensor;

/// How long a waiter spins before parking, when ranks have a core each.
const SPIN: Duration = Duration::from_micros(200);

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
    /// Everyone arrived; members move data; they leave once all of it is moved.
    Working,
}

#[derive(Debug)]
struct Slot {
    phase: Phase,
    arrivals: Vec<Option<Arrival>>,
    arrived: usize,
    work: Option<Arc<Work>>,
    left: usize,
    /// A failure of the group; every later call returns it.
    poisoned: Option<CommError>,
}

/// A message in flight between two members.
#[derive(Debug)]
struct Message {
    desc: CallDesc,
    payload: Payload,
}

/// What a message carries: a copy of the sender's bytes, or the sender's tensor itself (given
/// up by a sender that was its only holder).
#[derive(Debug)]
pub(crate) enum Payload {
    /// The bytes.
    Bytes(Vec<u8>),
    /// The tensor, contiguous, on the host, held by nothing else.
    Tensor(Tensor),
}

/// The shared state of one group.
#[derive(Debug)]
pub(crate) struct GroupShared {
    pub name: String,
    pub ranks: Vec<usize>,
    /// Members that move data in each collective: at most the cores, and when members are
    /// pinned, at most the distinct cores they are pinned to.
    workers: usize,
    /// The CPU each member is pinned to, if known.
    cpus: Vec<Option<usize>>,
    slot: Mutex<Slot>,
    /// One per member, so a collective can wake exactly the members it wants.
    cvs: Vec<Condvar>,
    /// Bumped (under the slot lock) at every change a waiter may wait for.
    epoch: AtomicU64,
    /// Whether waiters spin briefly before parking (ranks have a core each).
    spin: bool,
    /// Queues indexed `src * size + dst`.
    mail: Mutex<Vec<VecDeque<Message>>>,
    mail_cv: Condvar,
}

impl GroupShared {
    pub fn new(
        name: &str,
        ranks: &[usize],
        max_workers: usize,
        spin: bool,
        cpus: Vec<Option<usize>>,
    ) -> Self {
        let n = ranks.len();
        let mut workers = n.min(max_workers);
        if cpus.iter().all(Option::is_some) {
            let mut distinct: Vec<usize> = cpus.iter().flatten().copied().collect();
            distinct.sort_unstable();
            distinct.dedup();
            workers = workers.min(distinct.len());
        }
        GroupShared {
            name: name.to_string(),
            ranks: ranks.to_vec(),
            workers: workers.max(1),
            cpus,
            slot: Mutex::new(Slot {
                phase: Phase::Gathering,
                arrivals: vec![None; n],
                arrived: 0,
                work: None,
                left: 0,
                poisoned: None,
            }),
            cvs: (0..n).map(|_| Condvar::new()).collect(),
            epoch: AtomicU64::new(0),
            spin,
            mail: Mutex::new((0..n * n).map(|_| VecDeque::new()).collect()),
            mail_cv: Condvar::new(),
        }
    }

    /// Wakes every waiter so it can notice a world failure.
    pub fn wake_all(&self) {
        let slot = self.slot.lock();
        self.changed();
        drop(slot);
        let _mail = self.mail.lock();
        self.mail_cv.notify_all();
    }

    /// Runs one collective for member `me`: waits for every member, checks the calls agree,
    /// helps move the data and returns once all of it is moved.
    pub fn collective(&self, world: &WorldShared, me: usize, arrival: Arrival) -> Result<()> {
        let n = self.ranks.len();
        let deadline = Instant::now() + world.timeout;
        let call = arrival.desc.to_string();
        let mut slot = self.slot.lock();
        // The previous collective may still be draining; it never waits on anything but work.
        while slot.phase != Phase::Gathering && slot.poisoned.is_none() {
            self.wait(&mut slot, me, None);
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
                    let work = Work::new(plan, self.workers);
                    let nothing_to_move = work.is_done();
                    slot.work = Some(Arc::new(work));
                    slot.phase = Phase::Working;
                    if nothing_to_move {
                        self.changed();
                    } else {
                        self.wake_helpers(me);
                    }
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
                if self.wait(&mut slot, me, Some(deadline)) && slot.phase != Phase::Working {
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
        let work = Arc::clone(slot.work.as_ref().expect("a working slot has work"));
        drop(slot);
        // SAFETY: every member's buffers stay borrowed by their owners, who wait below until
        // all of the work is done; `plan` validated sizes and in-place aliasing.
        let moved_last = unsafe { work.help() };
        let mut slot = self.slot.lock();
        if moved_last {
            self.changed();
        }
        while !work.is_done() {
            self.wait(&mut slot, me, None);
        }
        slot.left += 1;
        if slot.left == n {
            slot.arrivals.iter_mut().for_each(|a| *a = None);
            slot.arrived = 0;
            slot.left = 0;
            slot.work = None;
            slot.phase = Phase::Gathering;
            self.changed();
        }
        Ok(())
    }

    /// Records a change of the slot (the lock is held) and wakes its waiters.
    fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
        for cv in &self.cvs {
            cv.notify_one();
        }
    }

    /// Starts the work of a collective that member `me` completed (the lock is held): `me` helps
    /// at once, and only as many others as may help are woken, preferring members pinned to
    /// other cores than `me` and than each other. The rest sleep until the work is done: with
    /// more ranks than cores, every needless wake-up takes a core from the helpers.
    fn wake_helpers(&self, me: usize) {
        self.epoch.fetch_add(1, Ordering::Release);
        let n = self.ranks.len();
        let mut chosen = vec![me];
        let mut busy: Vec<usize> = self.cpus[me].into_iter().collect();
        for i in 0..n {
            if chosen.len() >= self.workers {
                break;
            }
            if let Some(cpu) = self.cpus[i]
                && !busy.contains(&cpu)
            {
                busy.push(cpu);
                chosen.push(i);
            }
        }
        for i in 0..n {
            if chosen.len() >= self.workers {
                break;
            }
            if !chosen.contains(&i) {
                chosen.push(i);
            }
        }
        for &i in &chosen[1..] {
            self.cvs[i].notify_one();
        }
    }

    /// Waits for the next change of the slot, or until `deadline`; returns whether it timed out.
    ///
    /// When every rank has a core of its own, a change usually comes within microseconds, and
    /// parking costs a futex wake-up (tens of microseconds in a VM), so the waiter first spins on
    /// the epoch for up to [`SPIN`] with the lock released.
    fn wait(&self, slot: &mut MutexGuard<'_, Slot>, me: usize, deadline: Option<Instant>) -> bool {
        if self.spin {
            let seen = self.epoch.load(Ordering::Acquire);
            let start = Instant::now();
            let changed = MutexGuard::unlocked(slot, || {
                for i in 1u32.. {
                    if self.epoch.load(Ordering::Acquire) != seen {
                        return true;
                    }
                    std::hint::spin_loop();
                    if i % 64 == 0 && start.elapsed() > SPIN {
                        return false;
                    }
                }
                false
            });
            // Re-checked under the lock: a change between the spin and the park is not lost.
            if changed || self.epoch.load(Ordering::Acquire) != seen {
                return false;
            }
        }
        match deadline {
            Some(deadline) => self.cvs[me].wait_until(slot, deadline).timed_out(),
            None => {
                self.cvs[me].wait(slot);
                false
            }
        }
    }

    /// Marks the group failed with `err`, wakes everyone, and returns `err`.
    fn poison(&self, slot: &mut Slot, err: CommError) -> CommError {
        slot.poisoned.get_or_insert(err.clone());
        self.changed();
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

    /// Queues `payload` from member `src` to member `dst`.
    pub fn post(&self, src: usize, dst: usize, desc: CallDesc, payload: Payload) {
        let n = self.ranks.len();
        self.mail.lock()[src * n + dst].push_back(Message { desc, payload });
        self.mail_cv.notify_all();
    }

    /// Takes the next message from `src` to `dst` and hands its bytes to `deliver` with the
    /// sender's call.
    pub fn take(
        &self,
        world: &WorldShared,
        src: usize,
        dst: usize,
        call: &CallDesc,
        deliver: impl FnOnce(&CallDesc, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let (desc, payload) = self.take_payload(world, src, dst, call)?;
        match payload {
            Payload::Bytes(bytes) => deliver(&desc, &bytes),
            Payload::Tensor(t) => {
                let nbytes = t.numel() * t.dtype().size();
                let borrow = t.raw_read("recv")?;
                // SAFETY: the shared borrow keeps the contiguous tensor's bytes alive and
                // unwritten.
                let bytes =
                    unsafe { std::slice::from_raw_parts(borrow.addr() as *const u8, nbytes) };
                deliver(&desc, bytes)
            }
        }
    }

    /// Takes the next message from `src` to `dst`, its size checked against `call`.
    pub fn take_payload(
        &self,
        world: &WorldShared,
        src: usize,
        dst: usize,
        call: &CallDesc,
    ) -> Result<(CallDesc, Payload)> {
        let n = self.ranks.len();
        let deadline = Instant::now() + world.timeout;
        let mut mail = self.mail.lock();
        loop {
            if let Some(msg) = mail[src * n + dst].pop_front() {
                drop(mail);
                if msg.desc.dtype != call.dtype || msg.desc.count != call.count {
                    return Err(self.mismatch(src, &msg.desc, dst, call));
                }
                return Ok((msg.desc, msg.payload));
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
