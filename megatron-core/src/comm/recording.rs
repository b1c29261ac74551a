//! A world that records every call its communicators make, in order, for auditing what a model's
//! generated code communicates (`examples/audit.rs`) and for tests that check a call sequence.
//!
//! [`RecordingWorld`] wraps any [`World`]: its communicators are the inner world's, each call
//! logged (group name and [`CallDesc`]) before it runs. Nothing about the calls changes.

use std::panic::Location;
use std::sync::{Arc, Mutex};

use super::{CallDesc, CommStats, Communicator, OpKind, Pending, ReduceOp, Result, World};
use crate::tensor::Tensor;

/// One recorded call: the group family it went to, what was asked of it, and the source line
/// that called the communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The group's family name, e.g. `tp`.
    pub group: String,
    /// The call.
    pub desc: CallDesc,
    /// The line that made the call (the communicator's methods are `#[track_caller]`).
    pub caller: &'static Location<'static>,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.group, self.desc)
    }
}

/// The calls of one rank so far, shared by its communicators.
#[derive(Debug, Clone, Default)]
pub struct CallLog(Arc<Mutex<Vec<Call>>>);

impl CallLog {
    /// Takes the calls recorded so far, leaving the log empty.
    pub fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn push(&self, group: &str, desc: CallDesc, caller: &'static Location<'static>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(Call {
            group: group.to_string(),
            desc,
            caller,
        });
    }
}

/// A world whose communicators record their calls into one [`CallLog`].
pub struct RecordingWorld<'a> {
    inner: &'a dyn World,
    log: CallLog,
}

impl<'a> RecordingWorld<'a> {
    /// Wraps `inner`; the calls of every communicator it hands out go to [`Self::log`].
    pub fn new(inner: &'a dyn World) -> Self {
        RecordingWorld {
            inner,
            log: CallLog::default(),
        }
    }

    /// The log of this rank's calls.
    pub fn log(&self) -> &CallLog {
        &self.log
    }
}

impl World for RecordingWorld<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(Recording {
            inner: self.inner.communicator(name, ranks)?,
            log: self.log.clone(),
        }))
    }
}

/// A communicator that logs each call, then makes it.
struct Recording {
    inner: Arc<dyn Communicator>,
    log: CallLog,
}

impl Recording {
    #[track_caller]
    fn record(&self, kind: OpKind, t: &Tensor, op: Option<ReduceOp>, peer: Option<usize>) {
        self.log.push(
            self.inner.name(),
            CallDesc::of(kind, t, op, peer),
            Location::caller(),
        );
    }
}

impl Communicator for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn ranks(&self) -> &[usize] {
        self.inner.ranks()
    }

    fn index(&self) -> usize {
        self.inner.index()
    }

    fn place(&self, tensor: &Tensor) -> Result<Tensor> {
        self.inner.place(tensor)
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.record(OpKind::AllReduce, tensor, Some(op), None);
        self.inner.all_reduce(tensor, op)
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.record(OpKind::AllGather, input, None, None);
        self.inner.all_gather(input, output)
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.record(OpKind::ReduceScatter, output, Some(op), None);
        self.inner.reduce_scatter(input, output, op)
    }

    fn start_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending> {
        self.record(OpKind::AllReduce, tensor, Some(op), None);
        self.inner.start_all_reduce(tensor, op)
    }

    fn start_all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Pending> {
        self.record(OpKind::AllGather, input, None, None);
        self.inner.start_all_gather(input, output)
    }

    fn start_reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending> {
        self.record(OpKind::ReduceScatter, output, Some(op), None);
        self.inner.start_reduce_scatter(input, output, op)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.record(OpKind::Broadcast, tensor, None, Some(root));
        self.inner.broadcast(tensor, root)
    }

    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()> {
        self.record(OpKind::AllToAll, input, None, None);
        self.inner
            .all_to_all(input, send_splits, output, recv_splits)
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.record(OpKind::Send, tensor, None, Some(dst));
        self.inner.send(tensor, dst)
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.record(OpKind::Recv, tensor, None, Some(src));
        self.inner.recv(tensor, src)
    }

    fn exchange(&self, sends: &[(&Tensor, usize)], recvs: &[(&Tensor, usize)]) -> Result<()> {
        for &(tensor, dst) in sends {
            self.record(OpKind::Send, tensor, None, Some(dst));
        }
        for &(tensor, src) in recvs {
            self.record(OpKind::Recv, tensor, None, Some(src));
        }
        self.inner.exchange(sends, recvs)
    }

    fn rendezvous(&self) -> bool {
        self.inner.rendezvous()
    }

    fn barrier(&self) -> Result<()> {
        self.log
            .push(self.inner.name(), CallDesc::barrier(), Location::caller());
        self.inner.barrier()
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
}
