//! `MpiComm`: the [`Communicator`] of one process on one group, over an MPI communicator.
//!
//! Every call starts with the handshake (see [`super::handshake`]): members exchange what they
//! are about to call, polling with a deadline, so mismatches and absent ranks are errors on
//! every member. Once all have announced the same call, all are inside it, and the data moves
//! with MPI's non-blocking collectives, tested until they complete.
//!
//! No thread waits for another rank while it holds the process's MPI lock: the lock is taken
//! for each MPI call (a start, a test, a probe) and let go between tests. That is what lets a
//! second thread per group, the progress thread ([`crate::comm::progress`]), run the
//! collectives a rank starts ([`Communicator::start_all_reduce`], ...) while the rank's own
//! thread computes or waits in another group's call: the progress thread's tests drive MPI's
//! progress engine, so the data moves during the rank's compute. (Holding the lock through a
//! wait would let two processes' threads each wait for the other's lock: a deadlock.)
//!
//! Reductions do not use MPI's reduction operators: an all-reduce is an all-to-all that gives
//! each member one part of every rank's buffer, a reduction of that part in group-rank order
//! (the same code as the thread backend, so results are bit-identical to it), and an all-gather
//! of the reduced parts. That moves the same bytes as a ring all-reduce.

use std::ffi::c_int;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::topology::SimpleCommunicator;
use parking_lot::Mutex;

use super::handshake::{self, Announce};
use super::raw::{self, RawComm, RawRequest, Site};
use super::{Runtime, reduce_bytes};
use crate::comm::checks::Checks;
use crate::comm::progress::Progress;
use crate::comm::stats::Counters;
use crate::comm::{
    CallDesc, CommError, CommStats, Communicator, OpKind, Pending, ReduceOp, Result,
};
use crate::tensor::{DType, Tensor};

/// Tag of handshake messages.
const TAG_ANNOUNCE: c_int = 1;
/// Tag of point-to-point messages.
const TAG_P2P: c_int = 2;
/// Words of a point-to-point message's header: dtype, count, payload bytes.
const P2P_HEADER: usize = 3;

/// A send that MPI may still be reading: the request and the words it reads.
struct Outgoing {
    requests: Vec<RawRequest>,
    words: Box<[u64]>,
}

/// The parts of a communicator that calls change (shared by a rank's handle and its progress
/// thread's, which never call at once: the handle drains the progress thread first).
struct State {
    /// Freed under the MPI lock when the state is dropped.
    comm: ManuallyDrop<SimpleCommunicator>,
    /// Collectives called so far.
    seq: u64,
    /// Sends not yet known to be complete.
    outgoing: Vec<Outgoing>,
    /// Scratch for reductions and messages (u64 words, so every element type is aligned).
    scratch: Vec<u64>,
    /// Set once a call timed out: MPI may still be moving data for it, so the group is unusable.
    broken: Option<CommError>,
    /// The library, for the lock the drop takes.
    runtime: Arc<Runtime>,
}

// SAFETY: the MPI handles in `State` are only used under the runtime's MPI lock (the library
// runs at MPI_THREAD_SERIALIZED), so moving or sharing them between threads is sound.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        let runtime = Arc::clone(&self.runtime);
        let _mpi = runtime.lock();
        // SAFETY: dropped once, here, and never used after.
        unsafe { ManuallyDrop::drop(&mut self.comm) };
        for out in self.outgoing.drain(..) {
            let mut out = out;
            for r in &mut out.requests {
                raw::release(r);
            }
            // MPI may still read these words: they must outlive the program.
            Box::leak(out.words);
        }
    }
}

/// One process's handle on a group of an MPI world.
///
/// Started collectives run on the handle's progress thread, spawned at the first, through a
/// second handle on the same MPI communicator and state (see the module's header).
pub struct MpiComm {
    state: Arc<Mutex<State>>,
    name: String,
    ranks: Vec<usize>,
    index: usize,
    timeout: Duration,
    counters: Arc<Counters>,
    runtime: Arc<Runtime>,
    /// The thread started collectives run on (a runner handle's is never started).
    progress: Progress<MpiComm>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("name", &self.name)
            .field("ranks", &self.ranks)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// Element offsets and lengths of `count` elements cut into `n` near-equal parts.
fn parts(count: usize, n: usize) -> (Vec<usize>, Vec<usize>) {
    let (base, extra) = (count / n, count % n);
    let lens: Vec<usize> = (0..n).map(|j| base + usize::from(j < extra)).collect();
    let offsets = lens
        .iter()
        .scan(0, |at, &len| {
            let start = *at;
            *at += len;
            Some(start)
        })
        .collect();
    (offsets, lens)
}

/// Waits a little longer each round, so that a rank polling for late peers leaves the core to
/// them when processes outnumber cores.
fn backoff(round: &mut u32) {
    *round += 1;
    if *round < 64 {
        std::hint::spin_loop();
    } else if *round < 1024 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl MpiComm {
    pub(super) fn new(
        comm: SimpleCommunicator,
        name: &str,
        ranks: &[usize],
        index: usize,
        timeout: Duration,
        runtime: Arc<Runtime>,
    ) -> MpiComm {
        MpiComm {
            state: Arc::new(Mutex::new(State {
                comm: ManuallyDrop::new(comm),
                seq: 0,
                outgoing: Vec::new(),
                scratch: Vec::new(),
                broken: None,
                runtime: Arc::clone(&runtime),
            })),
            name: name.to_string(),
            ranks: ranks.to_vec(),
            index,
            timeout,
            counters: Arc::default(),
            runtime,
            progress: Progress::joined(),
        }
    }

    /// Waits until every collective this rank started on the group has run.
    fn drain(&self) {
        self.progress.drain();
    }

    /// Starts `call` (described as `desc`) on the progress thread.
    fn start(
        &self,
        desc: &CallDesc,
        call: impl FnOnce(&MpiComm) -> Result<()> + Send + 'static,
    ) -> Result<Pending> {
        let runner = || {
            let runner = MpiComm {
                state: Arc::clone(&self.state),
                name: self.name.clone(),
                ranks: self.ranks.clone(),
                index: self.index,
                timeout: self.timeout,
                counters: Arc::clone(&self.counters),
                runtime: Arc::clone(&self.runtime),
                progress: Progress::default(),
            };
            (
                runner,
                format!("comm-{}-{}", self.name, self.ranks[self.index]),
            )
        };
        self.progress.start(&self.name, desc, runner, call)
    }

    /// Runs `f` (MPI calls that return without waiting for other ranks) under the MPI lock.
    fn mpi<T>(&self, f: impl FnOnce() -> T) -> T {
        let _mpi = self.runtime.lock();
        f()
    }

    /// Tests `started` until it completes, taking the MPI lock for each test only.
    fn finish(&self, call: &'static str, mut started: raw::Started) -> Result<()> {
        let mut round = 0;
        while !self.mpi(|| raw::test(self.site(call), &mut started.request))? {
            backoff(&mut round);
        }
        Ok(())
    }

    fn site(&self, call: &'static str) -> Site<'_> {
        Site {
            group: &self.name,
            call,
        }
    }

    fn checks(&self) -> Checks<'_> {
        Checks {
            group: &self.name,
            ranks: &self.ranks,
            index: self.index,
        }
    }

    /// Runs `body` with this group's state, once the group is known usable (after the
    /// collectives the rank started on it: the group sees its calls in order).
    fn with_state<T>(&self, body: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        self.drain();
        let mut state = self.state.lock();
        if let Some(err) = &state.broken {
            return Err(err.clone());
        }
        self.reap(&mut state)?;
        let result = body(&mut state);
        if let Err(e @ CommError::Timeout { .. }) = &result {
            state.broken = Some(e.clone());
        }
        result
    }

    /// Frees the sends MPI has finished with.
    fn reap(&self, state: &mut State) -> Result<()> {
        let site = self.site("MPI_Test");
        let _mpi = self.runtime.lock();
        let mut i = 0;
        while i < state.outgoing.len() {
            let out = &mut state.outgoing[i];
            let mut done = true;
            for r in &mut out.requests {
                done &= raw::test(site, r)?;
            }
            if done {
                state.outgoing.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Starts sending `words` to each of `dests` (group ranks) with `tag`.
    fn post(&self, state: &mut State, words: Vec<u64>, dests: &[usize], tag: c_int) -> Result<()> {
        let words = words.into_boxed_slice();
        let raw_comm = raw_comm(&state.comm);
        let mut out = Outgoing {
            requests: Vec::with_capacity(dests.len()),
            words,
        };
        let _mpi = self.runtime.lock();
        for &d in dests {
            // SAFETY: the words live in `out`, which stays in `outgoing` (or is leaked) until
            // every request completes.
            let r = unsafe { raw::isend(self.site("MPI_Isend"), raw_comm, &out.words, d, tag)? };
            out.requests.push(r);
        }
        state.outgoing.push(out);
        Ok(())
    }

    /// Waits for the next message from each member of `sources` with `tag`, until the
    /// deadline; a member whose message never comes is named in the timeout.
    fn collect(
        &self,
        state: &mut State,
        sources: &[usize],
        tag: c_int,
        call: &CallDesc,
    ) -> Result<Vec<Vec<u64>>> {
        let raw_comm = raw_comm(&state.comm);
        let start = Instant::now();
        let mut got: Vec<Option<Vec<u64>>> = vec![None; sources.len()];
        let mut round = 0;
        loop {
            for (slot, &src) in got.iter_mut().zip(sources) {
                if slot.is_some() {
                    continue;
                }
                let probe = || raw::probe_words(self.site("MPI_Iprobe"), raw_comm, src, tag);
                if let Some(len) = self.mpi(probe)? {
                    let mut words = vec![0u64; len];
                    // SAFETY: `words` is neither moved nor touched until the receive completes.
                    let request = self.mpi(|| unsafe {
                        raw::irecv_words(self.site("MPI_Irecv"), raw_comm, &mut words, src, tag)
                    })?;
                    let started = raw::Started::of(request);
                    self.finish("MPI_Irecv", started)?;
                    *slot = Some(words);
                }
            }
            if got.iter().all(Option::is_some) {
                return Ok(got.into_iter().flatten().collect());
            }
            let waited = start.elapsed();
            if waited > self.timeout {
                return Err(CommError::Timeout {
                    group: self.name.clone(),
                    call: call.to_string(),
                    waited,
                    missing: got
                        .iter()
                        .zip(sources)
                        .filter(|(g, _)| g.is_none())
                        .map(|(_, &s)| self.ranks[s])
                        .collect(),
                });
            }
            backoff(&mut round);
        }
    }

    /// Tells every other member what this rank calls and checks that all agree.
    fn handshake(
        &self,
        state: &mut State,
        desc: CallDesc,
        splits: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<()> {
        let n = self.size();
        let mine = Announce {
            seq: state.seq,
            desc,
            splits,
        };
        state.seq += 1;
        if n == 1 {
            return handshake::verify(&self.name, &self.ranks, &[mine]);
        }
        let others: Vec<usize> = (0..n).filter(|&j| j != self.index).collect();
        self.post(state, mine.encode(), &others, TAG_ANNOUNCE)?;
        let received = self.collect(state, &others, TAG_ANNOUNCE, &mine.desc)?;
        let mut all = Vec::with_capacity(n);
        let mut received = received.into_iter();
        for j in 0..n {
            if j == self.index {
                all.push(mine.clone());
                continue;
            }
            let words = received.next().unwrap_or_default();
            let theirs = Announce::decode(&words, n).ok_or_else(|| {
                self.checks().invalid(format!(
                    "rank {} sent a malformed call description ({} words)",
                    self.ranks[j],
                    words.len()
                ))
            })?;
            all.push(theirs);
        }
        handshake::verify(&self.name, &self.ranks, &all)
    }

    /// Checks with every member that they make the same call (and, for all-to-all, matching
    /// splits), moving no data: the NCCL backend verifies its calls with it.
    #[cfg(feature = "cuda")]
    pub(crate) fn verify_call(
        &self,
        desc: CallDesc,
        splits: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<()> {
        self.with_state(|state| self.handshake(state, desc, splits))
    }

    /// Scratch of at least `bytes` bytes, 8-byte aligned.
    fn scratch(state: &mut State, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8);
        if state.scratch.len() < words {
            state.scratch.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut state.scratch[..words])[..bytes]
    }

    /// All-to-all of `count` elements cut into `n` parts, then each member's part of every rank
    /// reduced in rank order into `out` (this member's part, `lens[index]` elements).
    ///
    /// # Safety
    /// `input` must hold `count` elements of `dtype`, readable for the call; `out` must hold
    /// `lens[index]` elements and may overlap `input` (it is written after `input` is read).
    #[allow(clippy::too_many_arguments)]
    unsafe fn scatter_reduce(
        &self,
        state: &mut State,
        dtype: DType,
        input: *const u8,
        offsets: &[usize],
        lens: &[usize],
        out: *mut u8,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, size) = (self.size(), dtype.size());
        let mine = lens[self.index];
        let raw_comm = raw_comm(&state.comm);
        let stage = Self::scratch(state, n * mine * size);
        let recv_counts = vec![mine; n];
        let recv_displs: Vec<usize> = (0..n).map(|j| j * mine).collect();
        let stage_ptr = stage.as_mut_ptr();
        // SAFETY: `input` holds the parts (caller), `stage` room for n parts of this member;
        // both are left alone until the collective completes.
        let started = self.mpi(|| unsafe {
            raw::ialltoallv(
                self.site("MPI_Ialltoallv"),
                raw_comm,
                size,
                input,
                lens,
                offsets,
                stage_ptr,
                &recv_counts,
                &recv_displs,
            )
        })?;
        self.finish("MPI_Ialltoallv", started)?;
        let stage = &Self::scratch(state, n * mine * size)[..];
        let bytes = mine * size;
        let sources: Vec<&[u8]> = stage.chunks_exact(bytes.max(1)).take(n).collect();
        // SAFETY: `out` holds this member's part (caller); `input` is no longer read.
        let out = unsafe { std::slice::from_raw_parts_mut(out, bytes) };
        if bytes > 0 {
            reduce_bytes(dtype, &sources, out, op);
        }
        Ok(())
    }
}

/// The raw handle of a communicator.
fn raw_comm(comm: &SimpleCommunicator) -> RawComm {
    use mpi::raw::AsRaw;
    comm.as_raw()
}

impl Communicator for MpiComm {
    fn name(&self) -> &str {
        &self.name
    }

    fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn index(&self) -> usize {
        self.index
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        tensor.contiguous_for("all_reduce")?;
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        let (dtype, count, n) = (tensor.dtype(), tensor.numel(), self.size());
        let borrow = tensor.raw_write("all_reduce")?;
        let data = borrow.addr() as *mut u8;
        self.with_state(|state| {
            self.handshake(state, desc, None)?;
            if n == 1 || count == 0 {
                return Ok(());
            }
            let (offsets, lens) = parts(count, n);
            let size = dtype.size();
            let mine = lens[self.index];
            // The reduced part goes to its own buffer: MPI's all-gather must not read the
            // buffer it writes.
            let mut reduced = vec![0u64; (mine * size).div_ceil(8)];
            let reduced_ptr = reduced.as_mut_ptr().cast::<u8>();
            // SAFETY: `data` is the exclusively borrowed tensor of `count` elements;
            // `reduced` holds this member's part.
            unsafe { self.scatter_reduce(state, dtype, data, &offsets, &lens, reduced_ptr, op)? };
            let rc = raw_comm(&state.comm);
            // SAFETY: as above; both stay borrowed until the collective completes.
            let started = self.mpi(|| unsafe {
                raw::iallgatherv(
                    self.site("MPI_Iallgatherv"),
                    rc,
                    size,
                    reduced_ptr,
                    mine,
                    data,
                    &lens,
                    &offsets,
                )
            })?;
            self.finish("MPI_Iallgatherv", started)
        })?;
        self.counters
            .record(OpKind::AllReduce, count * dtype.size());
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let count = self.checks().all_gather(input, output)?;
        let n = self.size();
        input.contiguous_for("all_gather")?;
        output.contiguous_for("all_gather")?;
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        let size = input.dtype().size();
        let in_place = input.same_storage(output);
        if in_place {
            self.checks()
                .slot("all_gather", output, input, count, ("output", "input"))?;
        }
        let out_borrow = output.raw_write("all_gather")?;
        // In place, the input is read through the output's borrow.
        let in_borrow = if in_place {
            None
        } else {
            Some(input.raw_read("all_gather")?)
        };
        let out_ptr = out_borrow.addr() as *mut u8;
        let in_ptr = in_borrow
            .as_ref()
            .map_or(out_ptr.wrapping_add(self.index * count * size), |b| {
                b.addr() as *mut u8
            });
        self.with_state(|state| {
            self.handshake(state, desc, None)?;
            let rc = raw_comm(&state.comm);
            let counts = vec![count; n];
            let displs: Vec<usize> = (0..n).map(|j| j * count).collect();
            let send = if in_place {
                // MPI may not read and write one buffer: send a copy of this rank's slot.
                let copy = Self::scratch(state, count * size);
                // SAFETY: the slot lies in the borrowed output; `copy` is separate scratch.
                unsafe { std::ptr::copy_nonoverlapping(in_ptr, copy.as_mut_ptr(), count * size) };
                copy.as_ptr()
            } else {
                in_ptr.cast_const()
            };
            // SAFETY: `send` holds `count` elements, `out_ptr` n × count, both borrowed until
            // the collective completes.
            let started = self.mpi(|| unsafe {
                raw::iallgatherv(
                    self.site("MPI_Iallgatherv"),
                    rc,
                    size,
                    send,
                    count,
                    out_ptr,
                    &counts,
                    &displs,
                )
            })?;
            self.finish("MPI_Iallgatherv", started)
        })?;
        self.counters.record(OpKind::AllGather, count * size);
        Ok(())
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let count = self.checks().reduce_scatter(input, output)?;
        let n = self.size();
        input.contiguous_for("reduce_scatter")?;
        output.contiguous_for("reduce_scatter")?;
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        let (dtype, size) = (input.dtype(), input.dtype().size());
        let in_place = input.same_storage(output);
        if in_place {
            self.checks()
                .slot("reduce_scatter", input, output, count, ("input", "output"))?;
        }
        // In place, one exclusive borrow of the input covers the output slot.
        let in_borrow = if in_place {
            input.raw_write("reduce_scatter")?
        } else {
            input.raw_read("reduce_scatter")?
        };
        let out_borrow = if in_place {
            None
        } else {
            Some(output.raw_write("reduce_scatter")?)
        };
        let in_ptr = in_borrow.addr() as *mut u8;
        let out_ptr = out_borrow
            .as_ref()
            .map_or(in_ptr.wrapping_add(self.index * count * size), |b| {
                b.addr() as *mut u8
            });
        self.with_state(|state| {
            self.handshake(state, desc, None)?;
            let lens = vec![count; n];
            let offsets: Vec<usize> = (0..n).map(|j| j * count).collect();
            // SAFETY: both buffers are borrowed for the call; the output slot is written only
            // after the input has been read.
            unsafe { self.scatter_reduce(state, dtype, in_ptr, &offsets, &lens, out_ptr, op) }
        })?;
        self.counters.record(OpKind::ReduceScatter, count * size);
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.checks().peer("broadcast root", root)?;
        tensor.contiguous_for("broadcast")?;
        let desc = CallDesc::of(OpKind::Broadcast, tensor, None, Some(root));
        let (count, size) = (tensor.numel(), tensor.dtype().size());
        let borrow = tensor.raw_write("broadcast")?;
        let data = borrow.addr() as *mut u8;
        self.with_state(|state| {
            self.handshake(state, desc, None)?;
            if self.size() == 1 || count == 0 {
                return Ok(());
            }
            let rc = raw_comm(&state.comm);
            // SAFETY: the tensor is exclusively borrowed, until the collective completes, and
            // holds `count` elements.
            let started = self.mpi(|| unsafe {
                raw::ibcast(self.site("MPI_Ibcast"), rc, size, data, count, root)
            })?;
            self.finish("MPI_Ibcast", started)
        })?;
        self.counters.record(OpKind::Broadcast, count * size);
        Ok(())
    }

    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()> {
        self.checks()
            .all_to_all(input, send_splits, output, recv_splits)?;
        input.contiguous_for("all_to_all")?;
        output.contiguous_for("all_to_all")?;
        let desc = CallDesc::of(OpKind::AllToAll, input, None, None);
        let size = input.dtype().size();
        let in_borrow = input.raw_read("all_to_all")?;
        let out_borrow = output.raw_write("all_to_all")?;
        let displs = |splits: &[usize]| -> Vec<usize> {
            splits
                .iter()
                .scan(0, |at, &len| {
                    let start = *at;
                    *at += len;
                    Some(start)
                })
                .collect()
        };
        self.with_state(|state| {
            self.handshake(
                state,
                desc,
                Some((send_splits.to_vec(), recv_splits.to_vec())),
            )?;
            let rc = raw_comm(&state.comm);
            let (send_displs, recv_displs) = (displs(send_splits), displs(recv_splits));
            // SAFETY: both tensors are borrowed until the collective completes; the splits add
            // up to their sizes (checked).
            let started = self.mpi(|| unsafe {
                raw::ialltoallv(
                    self.site("MPI_Ialltoallv"),
                    rc,
                    size,
                    in_borrow.addr() as *const u8,
                    send_splits,
                    &send_displs,
                    out_borrow.addr() as *mut u8,
                    recv_splits,
                    &recv_displs,
                )
            })?;
            self.finish("MPI_Ialltoallv", started)
        })?;
        self.counters.record(OpKind::AllToAll, input.numel() * size);
        Ok(())
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.checks().destination(dst)?;
        tensor.contiguous_for("send")?;
        let nbytes = tensor.numel() * tensor.dtype().size();
        let mut words = vec![0u64; P2P_HEADER + nbytes.div_ceil(8)];
        words[0] = handshake::dtype_code(tensor.dtype());
        words[1] = tensor.numel() as u64;
        words[2] = nbytes as u64;
        {
            let borrow = tensor.raw_read("send")?;
            let payload: &mut [u8] = bytemuck::cast_slice_mut(&mut words[P2P_HEADER..]);
            // SAFETY: the shared borrow keeps the contiguous view's bytes alive and unwritten.
            let src = unsafe { std::slice::from_raw_parts(borrow.addr() as *const u8, nbytes) };
            payload[..nbytes].copy_from_slice(src);
        }
        // Like the thread backend, a send is buffered: it returns once the data is handed to
        // MPI, whether or not the receiver has arrived.
        self.with_state(|state| self.post(state, words, &[dst], TAG_P2P))?;
        self.counters.record(OpKind::Send, nbytes);
        Ok(())
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.checks().source(src)?;
        tensor.contiguous_for("recv")?;
        let desc = CallDesc::of(OpKind::Recv, tensor, None, Some(src));
        let nbytes = tensor.numel() * tensor.dtype().size();
        let borrow = tensor.raw_write("recv")?;
        self.with_state(|state| {
            let words = self
                .collect(state, &[src], TAG_P2P, &desc)?
                .pop()
                .unwrap_or_default();
            let sent = (words.len() >= P2P_HEADER)
                .then(|| {
                    let dtype = handshake::dtype_of(words[0])?;
                    Some((dtype, usize::try_from(words[1]).ok()?))
                })
                .flatten();
            let matches = sent == Some((tensor.dtype(), tensor.numel()))
                && words.len() >= P2P_HEADER + nbytes.div_ceil(8);
            if !matches {
                let theirs = sent.map_or_else(
                    || "a malformed message".to_string(),
                    |(dtype, count)| {
                        CallDesc {
                            kind: OpKind::Send,
                            dtype,
                            count,
                            op: None,
                            peer: Some(self.index),
                        }
                        .to_string()
                    },
                );
                return Err(CommError::Mismatch {
                    group: self.name.clone(),
                    rank_a: self.ranks[src],
                    call_a: theirs,
                    rank_b: self.ranks[self.index],
                    call_b: desc.to_string(),
                });
            }
            let payload: &[u8] = bytemuck::cast_slice(&words[P2P_HEADER..]);
            // SAFETY: the exclusive borrow covers `nbytes` bytes of the contiguous view.
            unsafe {
                std::ptr::copy_nonoverlapping(payload.as_ptr(), borrow.addr() as *mut u8, nbytes)
            };
            Ok(())
        })?;
        self.counters.record(OpKind::Recv, nbytes);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let desc = CallDesc::barrier();
        // The handshake is a barrier: it returns once every member's announcement arrived.
        self.with_state(|state| self.handshake(state, desc, None))?;
        self.counters.record(OpKind::Barrier, 0);
        Ok(())
    }

    fn start_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending> {
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        let t = tensor.clone();
        self.start(&desc, move |c| c.all_reduce(&t, op))
    }

    fn start_reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending> {
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        let (i, o) = (input.clone(), output.clone());
        self.start(&desc, move |c| c.reduce_scatter(&i, &o, op))
    }

    fn start_all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Pending> {
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        let (i, o) = (input.clone(), output.clone());
        self.start(&desc, move |c| c.all_gather(&i, &o))
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::parts;

    #[test]
    fn parts_cover_the_buffer_in_order() {
        assert_eq!(parts(10, 4), (vec![0, 3, 6, 8], vec![3, 3, 2, 2]));
        assert_eq!(parts(2, 4), (vec![0, 1, 2, 2], vec![1, 1, 0, 0]));
    }
}
