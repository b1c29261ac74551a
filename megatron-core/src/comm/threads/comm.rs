//! `ThreadComm`: the [`Communicator`] of one rank on one group of an in-process world.

use std::sync::Arc;
use std::time::Instant;

use super::exec::RawBuf;
use super::group::{Arrival, GroupShared, Payload};
use super::world::WorldShared;
use crate::backend::MemoryOps;
use crate::comm::checks::Checks;
use crate::comm::progress::Progress;
use crate::comm::stats::Counters;
use crate::comm::{CallDesc, CommStats, Communicator, OpKind, Pending, ReduceOp, Result};
use crate::tensor::Tensor;

/// One rank's handle on a group of an in-process world.
///
/// Started collectives ([`Communicator::start_all_reduce`], ...) run on a progress thread of
/// the handle's own, spawned at the first: it takes the rank's place in the group's
/// rendezvous, one collective at a time in the order they were started, while the rank
/// computes. A collective the rank calls and waits for first waits for the started ones, so
/// that the group sees the rank's calls in its order. (Device tensors, which a thread world
/// moves through host copies, are moved at once.)
#[derive(Debug)]
pub struct ThreadComm {
    group: Arc<GroupShared>,
    world: Arc<WorldShared>,
    index: usize,
    counters: Arc<Counters>,
    /// The thread started collectives run on (the runner handle's is never started).
    progress: Progress<ThreadComm>,
}

impl ThreadComm {
    pub(crate) fn new(group: Arc<GroupShared>, world: Arc<WorldShared>, index: usize) -> Self {
        ThreadComm {
            group,
            world,
            index,
            counters: Arc::default(),
            progress: Progress::default(),
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
        call: impl FnOnce(&ThreadComm) -> Result<()> + Send + 'static,
    ) -> Result<Pending> {
        let runner = || {
            let runner = ThreadComm {
                group: self.group.clone(),
                world: self.world.clone(),
                index: self.index,
                counters: self.counters.clone(),
                progress: Progress::default(),
            };
            (runner, format!("comm-{}-{}", self.group.name, self.index))
        };
        self.progress.start(&self.group.name, desc, runner, call)
    }

    fn checks(&self) -> Checks<'_> {
        Checks {
            group: &self.group.name,
            ranks: &self.group.ranks,
            index: self.index,
        }
    }

    fn arrive(&self, desc: CallDesc, input: RawBuf, output: RawBuf) -> Result<()> {
        let arrival = Arrival {
            desc,
            input,
            output,
            send_splits: Vec::new(),
            recv_splits: Vec::new(),
        };
        self.group.collective(&self.world, self.index, arrival)
    }

    /// Runs a collective that reads `input` and writes `output`, where `input` may be the slot
    /// `index()` of `output` (`input_is_slot_of_output`) or `output` the slot of `input`.
    fn two_buffer(
        &self,
        op: &'static str,
        desc: CallDesc,
        input: &Tensor,
        output: &Tensor,
        slot_len: usize,
        output_is_slot: bool,
    ) -> Result<()> {
        input.contiguous_for(op)?;
        output.contiguous_for(op)?;
        let size = input.dtype().size();
        if input.same_storage(output) {
            // In place: one exclusive borrow covers both.
            let (whole, part) = if output_is_slot {
                (input, output)
            } else {
                (output, input)
            };
            let names = if output_is_slot {
                ("input", "output")
            } else {
                ("output", "input")
            };
            self.checks().slot(op, whole, part, slot_len, names)?;
            let borrow = whole.raw_write(op)?;
            let whole_buf = RawBuf {
                addr: borrow.addr(),
                len: whole.numel(),
            };
            let part_buf = whole_buf.slice(self.index * slot_len, slot_len, size);
            let (i, o) = if output_is_slot {
                (whole_buf, part_buf)
            } else {
                (part_buf, whole_buf)
            };
            self.arrive(desc, i, o)
        } else {
            let in_borrow = input.raw_read(op)?;
            let out_borrow = output.raw_write(op)?;
            let i = RawBuf {
                addr: in_borrow.addr(),
                len: input.numel(),
            };
            let o = RawBuf {
                addr: out_borrow.addr(),
                len: output.numel(),
            };
            self.arrive(desc, i, o)
        }
    }
}

impl Communicator for ThreadComm {
    fn name(&self) -> &str {
        &self.group.name
    }

    fn ranks(&self) -> &[usize] {
        &self.group.ranks
    }

    fn index(&self) -> usize {
        self.index
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.drain();
        if tensor.gpu().is_some() {
            if self.size() == 1 {
                // The reduction of one value is itself: nothing to move.
                tensor.contiguous_for("all_reduce")?;
                self.counters
                    .record(OpKind::AllReduce, tensor.numel() * tensor.dtype().size());
                return Ok(());
            }
            let host = staged(tensor)?;
            self.all_reduce(&host, op)?;
            return unstage(tensor, &host);
        }
        tensor.contiguous_for("all_reduce")?;
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        let borrow = tensor.raw_write("all_reduce")?;
        let buf = RawBuf {
            addr: borrow.addr(),
            len: tensor.numel(),
        };
        self.arrive(desc, buf, buf)?;
        self.counters
            .record(OpKind::AllReduce, tensor.numel() * tensor.dtype().size());
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.drain();
        if input.gpu().is_some() || output.gpu().is_some() {
            let (host_in, host_out) = staged_pair(input, output)?;
            self.all_gather(&host_in, &host_out)?;
            return unstage(output, &host_out);
        }
        self.checks().all_gather(input, output)?;
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        self.two_buffer("all_gather", desc, input, output, input.numel(), false)?;
        self.counters
            .record(OpKind::AllGather, input.numel() * input.dtype().size());
        Ok(())
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.drain();
        if input.gpu().is_some() || output.gpu().is_some() {
            let (host_out, host_in) = staged_pair(output, input)?;
            self.reduce_scatter(&host_in, &host_out, op)?;
            return unstage(output, &host_out);
        }
        self.checks().reduce_scatter(input, output)?;
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        self.two_buffer("reduce_scatter", desc, input, output, output.numel(), true)?;
        self.counters.record(
            OpKind::ReduceScatter,
            output.numel() * output.dtype().size(),
        );
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.drain();
        if tensor.gpu().is_some() {
            let host = staged(tensor)?;
            self.broadcast(&host, root)?;
            return unstage(tensor, &host);
        }
        self.checks().peer("broadcast root", root)?;
        tensor.contiguous_for("broadcast")?;
        let desc = CallDesc::of(OpKind::Broadcast, tensor, None, Some(root));
        let borrow = tensor.raw_write("broadcast")?;
        let buf = RawBuf {
            addr: borrow.addr(),
            len: tensor.numel(),
        };
        self.arrive(desc, buf, buf)?;
        self.counters
            .record(OpKind::Broadcast, tensor.numel() * tensor.dtype().size());
        Ok(())
    }

    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()> {
        self.drain();
        if input.gpu().is_some() || output.gpu().is_some() {
            let (host_in, host_out) = (staged(input)?, staged(output)?);
            self.all_to_all(&host_in, send_splits, &host_out, recv_splits)?;
            return unstage(output, &host_out);
        }
        self.checks()
            .all_to_all(input, send_splits, output, recv_splits)?;
        input.contiguous_for("all_to_all")?;
        output.contiguous_for("all_to_all")?;
        let desc = CallDesc::of(OpKind::AllToAll, input, None, None);
        let in_borrow = input.raw_read("all_to_all")?;
        let out_borrow = output.raw_write("all_to_all")?;
        let arrival = Arrival {
            desc,
            input: RawBuf {
                addr: in_borrow.addr(),
                len: input.numel(),
            },
            output: RawBuf {
                addr: out_borrow.addr(),
                len: output.numel(),
            },
            send_splits: send_splits.to_vec(),
            recv_splits: recv_splits.to_vec(),
        };
        self.group.collective(&self.world, self.index, arrival)?;
        self.counters
            .record(OpKind::AllToAll, input.numel() * input.dtype().size());
        Ok(())
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.drain();
        if tensor.gpu().is_some() {
            return self.send(&staged(tensor)?, dst);
        }
        self.checks().destination(dst)?;
        tensor.contiguous_for("send")?;
        let nbytes = tensor.numel() * tensor.dtype().size();
        let bytes = {
            let borrow = tensor.raw_read("send")?;
            // SAFETY: the shared borrow keeps the contiguous view's bytes alive and unwritten.
            unsafe { std::slice::from_raw_parts(borrow.addr() as *const u8, nbytes) }.to_vec()
        };
        self.group.post(
            self.index,
            dst,
            CallDesc::of(OpKind::Send, tensor, None, Some(dst)),
            Payload::Bytes(bytes),
        );
        self.counters.record(OpKind::Send, nbytes);
        Ok(())
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.drain();
        if tensor.gpu().is_some() {
            let host = staged(tensor)?;
            self.recv(&host, src)?;
            return unstage(tensor, &host);
        }
        self.checks().source(src)?;
        tensor.contiguous_for("recv")?;
        let desc = CallDesc::of(OpKind::Recv, tensor, None, Some(src));
        self.group
            .take(&self.world, src, self.index, &desc, |_, bytes| {
                fill(tensor, bytes)
            })?;
        self.counters
            .record(OpKind::Recv, tensor.numel() * tensor.dtype().size());
        Ok(())
    }

    /// Hands each sent host tensor that nothing else holds to its receiver as it is (a move, no
    /// copy); copies the others. A received message that came as a tensor is returned as it is,
    /// in place of its buffer.
    fn exchange_owned(
        &self,
        sends: Vec<(Tensor, usize)>,
        recvs: Vec<(Tensor, usize)>,
    ) -> Result<Vec<Tensor>> {
        self.drain();
        for (tensor, dst) in sends {
            if tensor.gpu().is_some() || !tensor.is_sole_owner() {
                self.send(&tensor, dst)?;
                continue;
            }
            self.checks().destination(dst)?;
            let desc = CallDesc::of(OpKind::Send, &tensor, None, Some(dst));
            self.counters
                .record(OpKind::Send, tensor.numel() * tensor.dtype().size());
            self.group
                .post(self.index, dst, desc, Payload::Tensor(tensor));
        }
        let mut received = Vec::with_capacity(recvs.len());
        for (buffer, src) in recvs {
            if buffer.gpu().is_some() {
                self.recv(&buffer, src)?;
                received.push(buffer);
                continue;
            }
            self.checks().source(src)?;
            buffer.contiguous_for("recv")?;
            let desc = CallDesc::of(OpKind::Recv, &buffer, None, Some(src));
            let nbytes = buffer.numel() * buffer.dtype().size();
            let (_, payload) = self
                .group
                .take_payload(&self.world, src, self.index, &desc)?;
            let t = match payload {
                Payload::Tensor(t) => t.reshape(buffer.shape().clone())?,
                Payload::Bytes(bytes) => {
                    fill(&buffer, &bytes)?;
                    buffer
                }
            };
            self.counters.record(OpKind::Recv, nbytes);
            received.push(t);
        }
        Ok(received)
    }

    fn barrier(&self) -> Result<()> {
        self.drain();
        let desc = CallDesc::barrier();
        let empty = RawBuf { addr: 0, len: 0 };
        self.arrive(desc, empty, empty)?;
        self.counters.record(OpKind::Barrier, 0);
        Ok(())
    }

    fn start_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending> {
        if tensor.gpu().is_some() {
            let start = Instant::now();
            return Ok(Pending::ran(self.all_reduce(tensor, op), start));
        }
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
        if input.gpu().is_some() || output.gpu().is_some() {
            let start = Instant::now();
            return Ok(Pending::ran(self.reduce_scatter(input, output, op), start));
        }
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        let (i, o) = (input.clone(), output.clone());
        self.start(&desc, move |c| c.reduce_scatter(&i, &o, op))
    }

    fn start_all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Pending> {
        if input.gpu().is_some() || output.gpu().is_some() {
            let start = Instant::now();
            return Ok(Pending::ran(self.all_gather(input, output), start));
        }
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        let (i, o) = (input.clone(), output.clone());
        self.start(&desc, move |c| c.all_gather(&i, &o))
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

/// A host copy of a device tensor, for a thread world moving device tensors through host
/// memory (correct, not fast: device worlds move them on the device).
/// Copies a message's `bytes` into the contiguous host tensor `t` (their sizes matched against
/// the sender's call).
fn fill(t: &Tensor, bytes: &[u8]) -> Result<()> {
    let nbytes = t.numel() * t.dtype().size();
    let borrow = t.raw_write("recv")?;
    // SAFETY: the exclusive borrow is held for the copy; `bytes` holds the sender's `nbytes`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), borrow.addr() as *mut u8, nbytes) };
    Ok(())
}

fn staged(t: &Tensor) -> Result<Tensor> {
    Ok(match t.gpu() {
        Some(gpu) => gpu.download_tensor(t)?,
        None => t.contiguous()?,
    })
}

/// Host copies of `whole` and `part` where `part` may be a slot of `whole` (in-place
/// all-gather or reduce-scatter): the slot stays a slot of the copy.
fn staged_pair(part: &Tensor, whole: &Tensor) -> Result<(Tensor, Tensor)> {
    let host_whole = staged(whole)?;
    let host_part = if part.same_storage(whole) {
        let offset = part.layout().offset - whole.layout().offset;
        host_whole
            .reshape([whole.numel()])?
            .narrow(0, offset, part.numel())?
            .reshape(part.shape().clone())?
    } else {
        staged(part)?
    };
    Ok((host_part, host_whole))
}

/// Copies a staged result back to the device tensor.
fn unstage(t: &Tensor, host: &Tensor) -> Result<()> {
    Ok(t.copy_from(host)?)
}
