//! The device-local communicator (feature `cuda`): several ranks, as threads, sharing one GPU,
//! each with its own stream, so that tensor and data parallelism run and are tested on a
//! single-GPU machine.
//!
//! Collectives move device tensors with device copies and the rank-order reduction kernels of
//! [`crate::cuda::kernels::reduce`], so results are bit-identical to the host backends'. The host
//! side rides on an in-process thread world: its barriers give the timeouts and the failure
//! propagation, and a mailbox per group carries each rank's call (tensor, description, and an
//! event marking when its data is ready). A collective is two rounds:
//!
//! 1. every rank posts its call and an event recorded after its pending work; after the first
//!    barrier all ranks check the calls agree (a mismatch is the same error on every rank), make
//!    their streams wait for the others' events, and queue their reads of the others' buffers;
//! 2. every rank records a second event after those reads; after the second barrier each waits
//!    for the others' second events before the collective returns, so no rank overwrites a
//!    buffer another rank still reads.
//!
//! Point-to-point sends snapshot the data into a new device tensor handed to the receiver
//! through the mailbox, so a send never waits for its receive.
//!
//! Started collectives ([`Communicator::start_all_reduce`], `start_reduce_scatter`,
//! `start_all_gather`) run on the handle's progress thread ([`super::progress`]) and on a
//! communication stream of its own, made at the first start: the start records an event on
//! the rank's stream, the progress thread makes the communication stream wait for it and runs
//! the two rounds there (its barriers meet the other members' progress threads), and the wait
//! orders the rank's stream after an event recorded behind the call. The call's tensors are
//! dropped only then, their memory being freed on the rank's stream. A blocking call on the
//! group first drains the started ones, so the group sees every rank's calls in its order.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::CudaEvent;
use cudarc::driver::result::memcpy_dtod_async;
use cudarc::driver::sys::CUevent_flags;
use parking_lot::Mutex;

use super::checks::Checks;
use super::progress::Progress;
use super::stats::Counters;
use super::stream_start::{self, StreamStart};
use super::{
    CallDesc, CommError, CommStats, Communicator, OpKind, Pending, ReduceOp, Result, World,
};
use crate::cuda::{CudaError, Gpu, kernels};
use crate::tensor::{DType, Tensor};

/// A group's key: its family name and its members.
type GroupKey = (String, Vec<usize>);

/// What every rank of one process shares: the device and the mailboxes of the groups.
#[derive(Debug)]
pub struct LocalGpu {
    gpu: Gpu,
    groups: Mutex<HashMap<GroupKey, Arc<Mailbox>>>,
}

impl LocalGpu {
    /// Ranks of one process on `gpu`'s device.
    pub fn new(gpu: &Gpu) -> Arc<LocalGpu> {
        Arc::new(LocalGpu {
            gpu: gpu.clone(),
            groups: Mutex::new(HashMap::new()),
        })
    }

    /// One rank's world: communicators over `host`'s groups, moving device tensors on a new
    /// stream of this device. Call it on every rank of `host` (e.g. inside `threads::launch`).
    pub fn world(self: &Arc<Self>, host: Arc<dyn World>) -> Result<LocalGpuWorld> {
        let gpu = self
            .gpu
            .with_new_stream()
            .map_err(|e| backend("world", "cuStreamCreate", e))?;
        Ok(LocalGpuWorld {
            host,
            gpu,
            shared: self.clone(),
        })
    }

    fn mailbox(&self, name: &str, ranks: &[usize]) -> Arc<Mailbox> {
        self.groups
            .lock()
            .entry((name.to_string(), ranks.to_vec()))
            .or_insert_with(|| {
                Arc::new(Mailbox {
                    posts: Mutex::new(vec![None; ranks.len()]),
                    done: Mutex::new(vec![None; ranks.len()]),
                    messages: Mutex::new(HashMap::new()),
                })
            })
            .clone()
    }
}

/// One rank of a [`LocalGpu`]: its host world, its stream.
pub struct LocalGpuWorld {
    host: Arc<dyn World>,
    gpu: Gpu,
    shared: Arc<LocalGpu>,
}

impl std::fmt::Debug for LocalGpuWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGpuWorld")
            .field("rank", &self.host.rank())
            .field("size", &self.host.size())
            .field("gpu", &self.gpu.ordinal())
            .finish()
    }
}

impl LocalGpuWorld {
    /// This rank's GPU handle (its own stream): allocate its tensors with it.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl World for LocalGpuWorld {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>> {
        let host = self.host.communicator(name, ranks)?;
        Ok(Arc::new(LocalGpuComm {
            index: host.index(),
            mailbox: self.shared.mailbox(name, ranks),
            host,
            gpu: self.gpu.clone(),
            counters: Arc::default(),
            comm_gpu: OnceLock::new(),
            progress: Progress::default(),
        }))
    }
}

/// One rank's call, as posted for the others.
#[derive(Debug, Clone)]
struct Post {
    desc: CallDesc,
    input: Tensor,
    splits: Option<(Vec<usize>, Vec<usize>)>,
    ready: Arc<CudaEvent>,
}

/// A point-to-point message: a snapshot of the sent tensor.
#[derive(Debug)]
struct Message {
    data: Tensor,
    ready: CudaEvent,
}

/// The shared slots of one group.
#[derive(Debug)]
struct Mailbox {
    posts: Mutex<Vec<Option<Post>>>,
    done: Mutex<Vec<Option<Arc<CudaEvent>>>>,
    messages: Mutex<HashMap<(usize, usize), VecDeque<Message>>>,
}

/// One rank's handle on a group of ranks sharing a GPU.
pub struct LocalGpuComm {
    host: Arc<dyn Communicator>,
    gpu: Gpu,
    index: usize,
    mailbox: Arc<Mailbox>,
    counters: Arc<Counters>,
    /// The communication stream started collectives run on, made at the first start (the
    /// runner handle's `gpu`).
    comm_gpu: OnceLock<Gpu>,
    /// The thread started collectives run on (a runner handle's is never started).
    progress: Progress<LocalGpuComm>,
}

impl std::fmt::Debug for LocalGpuComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGpuComm")
            .field("group", &self.host.name())
            .field("ranks", &self.host.ranks())
            .field("index", &self.index)
            .finish()
    }
}

fn backend(group: &str, call: &'static str, e: impl std::fmt::Display) -> CommError {
    CommError::Backend {
        group: group.to_string(),
        library: "CUDA",
        call,
        message: e.to_string(),
    }
}

impl LocalGpuComm {
    fn cuda(&self, call: &'static str, e: impl std::fmt::Display) -> CommError {
        backend(self.name(), call, e)
    }

    /// Waits until every collective this rank started on the group has run.
    fn drain(&self) {
        self.progress.drain();
    }

    fn checks(&self) -> Checks<'_> {
        Checks {
            group: self.host.name(),
            ranks: self.host.ranks(),
            index: self.index,
        }
    }

    /// Checks that `t` is a contiguous tensor on this rank's device.
    fn check_tensor(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.checks().not_in_capture(op, &self.gpu)?;
        self.checks().on_gpu(op, t, self.gpu.ordinal())
    }

    /// The device address of `t`'s first element.
    fn addr(&self, op: &'static str, t: &Tensor) -> Result<u64> {
        Ok(t.raw_device_read(op)?.addr() as u64)
    }

    /// An event after everything queued so far on this rank's stream.
    fn record(&self) -> Result<CudaEvent> {
        self.gpu
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| self.cuda("cuEventRecord", format!("{e:?}")))
    }

    fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.gpu
            .stream()
            .wait(event)
            .map_err(|e| self.cuda("cuStreamWaitEvent", format!("{e:?}")))
    }

    /// `bytes` bytes from device address `src` to `dst`, on this rank's stream.
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: callers pass addresses of live device tensors of at least `bytes` bytes
        // (checked against the posted descriptions), kept alive by the posts until the second
        // round has ordered every rank's later work after these copies.
        unsafe { memcpy_dtod_async(dst, src, bytes, self.gpu.stream().cu_stream()) }
            .map_err(|e| self.cuda("cuMemcpyDtoDAsync", format!("{e:?}")))
    }

    /// Round 1: posts this rank's call, waits for every member's, checks they agree and orders
    /// this stream after the others' pending work. Returns every member's post.
    fn exchange(
        &self,
        desc: CallDesc,
        input: &Tensor,
        splits: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<Vec<Post>> {
        let ready = Arc::new(self.record()?);
        self.mailbox.posts.lock()[self.index] = Some(Post {
            desc,
            input: input.clone(),
            splits,
            ready,
        });
        self.host.barrier()?;
        let posts: Vec<Post> = self
            .mailbox
            .posts
            .lock()
            .iter()
            .flatten()
            .cloned()
            .collect();
        let checked = if posts.len() != self.size() {
            Err(self
                .checks()
                .invalid("a member's call was not posted".to_string()))
        } else {
            self.verify(&posts)
        };
        if let Err(e) = checked {
            // Every member read the same posts and returns the same error; none may post its
            // next call (overwriting its post here) before all have read these.
            self.host.barrier()?;
            return Err(e);
        }
        for (j, p) in posts.iter().enumerate() {
            if j != self.index {
                self.wait(&p.ready)?;
            }
        }
        Ok(posts)
    }

    /// Every rank sees the same posts, so every rank reports the same mismatch.
    fn verify(&self, posts: &[Post]) -> Result<()> {
        let first = &posts[0].desc;
        for (j, p) in posts.iter().enumerate().skip(1) {
            if p.desc != *first {
                return Err(CommError::Mismatch {
                    group: self.name().to_string(),
                    rank_a: self.ranks()[0],
                    call_a: first.to_string(),
                    rank_b: self.ranks()[j],
                    call_b: p.desc.to_string(),
                });
            }
        }
        if first.kind == OpKind::AllToAll {
            for (i, pi) in posts.iter().enumerate() {
                for (j, pj) in posts.iter().enumerate() {
                    let send = pi.splits.as_ref().map_or(0, |s| s.0[j]);
                    let recv = pj.splits.as_ref().map_or(0, |s| s.1[i]);
                    if send != recv {
                        return Err(self.checks().invalid(format!(
                            "all_to_all: rank {} sends {send} elements to rank {} but it expects {recv}",
                            self.ranks()[i],
                            self.ranks()[j]
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Round 2: no member goes on before every member's reads of this round are done.
    fn finish(&self) -> Result<()> {
        let done = Arc::new(self.record()?);
        self.mailbox.done.lock()[self.index] = Some(done);
        self.host.barrier()?;
        let events: Vec<Arc<CudaEvent>> =
            self.mailbox.done.lock().iter().flatten().cloned().collect();
        for (j, e) in events.iter().enumerate() {
            if j != self.index {
                self.wait(e)?;
            }
        }
        Ok(())
    }

    /// Folds `out`'s length of elements at byte offset `offset` of every member's `input` into
    /// `out`.
    fn fold_into(
        &self,
        op_name: &'static str,
        posts: &[Post],
        offset: usize,
        out: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let (dtype, count) = (out.dtype(), out.numel());
        let kernel = kernels::reduce::fold_kernel(dtype).ok_or_else(|| {
            self.checks().invalid(format!(
                "{op_name}: {dtype} reductions are not on the GPU yet"
            ))
        })?;
        let srcs = posts
            .iter()
            .map(|p| Ok(self.addr(op_name, &p.input)? + offset as u64))
            .collect::<Result<Vec<u64>>>()?;
        let dst = out.raw_device_write(op_name)?.addr() as u64;
        // SAFETY: every source holds `count` elements past `offset` (the posts agree on the
        // count) and stays alive in the mailbox; `out` is this rank's own scratch.
        unsafe { kernels::reduce::fold_raw(&self.gpu, kernel, &srcs, dst, count, op) }
            .map_err(|e: CudaError| self.cuda("fold", e))
    }
}

impl StreamStart for LocalGpuComm {
    fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn group(&self) -> &str {
        self.host.name()
    }

    fn check_started(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.check_tensor(op, t)
    }

    /// On the progress thread and the group's communication stream, made at the first start
    /// (a group of one runs `call` at once: it meets no one).
    fn start(
        &self,
        desc: &CallDesc,
        keep: Vec<Tensor>,
        call: impl FnOnce(&Self) -> Result<()> + Send + 'static,
    ) -> Result<Pending> {
        if self.size() == 1 {
            let start = Instant::now();
            return Ok(Pending::ran(call(self), start));
        }
        let comm_gpu = match self.comm_gpu.get() {
            Some(gpu) => gpu.clone(),
            None => {
                let made = self
                    .gpu
                    .with_new_stream()
                    .map_err(|e| self.cuda("cuStreamCreate", e))?;
                self.comm_gpu.get_or_init(|| made).clone()
            }
        };
        let runner = || {
            let runner = LocalGpuComm {
                host: Arc::clone(&self.host),
                gpu: comm_gpu,
                index: self.index,
                mailbox: Arc::clone(&self.mailbox),
                counters: Arc::clone(&self.counters),
                comm_gpu: OnceLock::new(),
                progress: Progress::default(),
            };
            let name = format!("gpu-local-{}-{}", self.name(), self.ranks()[self.index]);
            (runner, name)
        };
        let group = (&self.gpu, self.name());
        stream_start::on_comm_stream(&self.progress, group, desc, runner, keep, call)
    }
}

impl Communicator for LocalGpuComm {
    fn name(&self) -> &str {
        self.host.name()
    }

    fn place(&self, tensor: &Tensor) -> Result<Tensor> {
        match tensor.device() == crate::tensor::Device::Cuda(self.gpu.ordinal()) {
            true => Ok(tensor.clone()),
            false => tensor
                .to_gpu(&self.gpu)
                .map_err(|e| self.cuda("copy to the device", e)),
        }
    }

    fn ranks(&self) -> &[usize] {
        self.host.ranks()
    }

    fn index(&self) -> usize {
        self.index
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        self.drain();
        self.check_tensor(OP, tensor)?;
        let desc = CallDesc::of(OpKind::AllReduce, tensor, Some(op), None);
        let (dtype, count) = (tensor.dtype(), tensor.numel());
        if self.size() == 1 {
            // A group of one: the reduction of one value is itself.
            self.counters
                .record(OpKind::AllReduce, count * dtype.size());
            return Ok(());
        }
        let posts = self.exchange(desc, tensor, None)?;
        let scratch =
            Tensor::zeros_on([count], dtype, &self.gpu).map_err(|e| self.cuda("alloc", e))?;
        self.fold_into(OP, &posts, 0, &scratch, op)?;
        self.finish()?;
        let dst = tensor.raw_device_write(OP)?.addr() as u64;
        self.copy(dst, self.addr(OP, &scratch)?, count * dtype.size())?;
        self.counters
            .record(OpKind::AllReduce, count * dtype.size());
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        const OP: &str = "all_gather";
        self.drain();
        self.check_tensor(OP, input)?;
        self.check_tensor(OP, output)?;
        let (n, count, dtype) = (
            self.size(),
            self.checks().all_gather(input, output)?,
            input.dtype(),
        );
        if input.same_storage(output) {
            self.checks()
                .slot(OP, output, input, count, ("output", "input"))?;
        }
        if n == 1 {
            if !input.same_storage(output) || input.layout().offset != output.layout().offset {
                output.copy_from(&input.reshape(output.shape().clone())?)?;
            }
            self.counters
                .record(OpKind::AllGather, count * dtype.size());
            return Ok(());
        }
        let desc = CallDesc::of(OpKind::AllGather, input, None, None);
        let posts = self.exchange(desc, input, None)?;
        let bytes = count * dtype.size();
        // In place, the other members read this rank's slot of `output` while it would write
        // the other slots: the slots are gathered into scratch first, and `output` written once
        // every member's reads are done.
        let scratch = if input.same_storage(output) {
            Some(
                Tensor::empty_on([n * count], dtype, &self.gpu)
                    .map_err(|e| self.cuda("alloc", e))?,
            )
        } else {
            None
        };
        // In place, `output` is not even borrowed before then: the other members borrow this
        // rank's input (the same storage) to read it.
        let gather = match &scratch {
            Some(s) => self.addr(OP, s)?,
            None => output.raw_device_write(OP)?.addr() as u64,
        };
        for (j, p) in posts.iter().enumerate() {
            self.copy(gather + (j * bytes) as u64, self.addr(OP, &p.input)?, bytes)?;
        }
        self.finish()?;
        if scratch.is_some() {
            let out = output.raw_device_write(OP)?.addr() as u64;
            self.copy(out, gather, n * bytes)?;
        }
        self.counters.record(OpKind::AllGather, bytes);
        Ok(())
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.drain();
        self.check_tensor(OP, input)?;
        self.check_tensor(OP, output)?;
        let (n, count, dtype) = (
            self.size(),
            self.checks().reduce_scatter(input, output)?,
            output.dtype(),
        );
        if input.same_storage(output) {
            self.checks()
                .slot(OP, input, output, count, ("input", "output"))?;
        }
        if n == 1 {
            if !input.same_storage(output) || input.layout().offset != output.layout().offset {
                output.copy_from(&input.reshape(output.shape().clone())?)?;
            }
            self.counters
                .record(OpKind::ReduceScatter, count * dtype.size());
            return Ok(());
        }
        let desc = CallDesc::of(OpKind::ReduceScatter, output, Some(op), None);
        let posts = self.exchange(desc, input, None)?;
        let bytes = count * dtype.size();
        let scratch =
            Tensor::zeros_on([count], dtype, &self.gpu).map_err(|e| self.cuda("alloc", e))?;
        self.fold_into(OP, &posts, self.index * bytes, &scratch, op)?;
        self.finish()?;
        let dst = output.raw_device_write(OP)?.addr() as u64;
        self.copy(dst, self.addr(OP, &scratch)?, bytes)?;
        self.counters.record(OpKind::ReduceScatter, bytes);
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.drain();
        self.check_tensor(OP, tensor)?;
        self.checks().peer("broadcast root", root)?;
        if self.size() == 1 {
            self.counters
                .record(OpKind::Broadcast, tensor.numel() * tensor.dtype().size());
            return Ok(());
        }
        let desc = CallDesc::of(OpKind::Broadcast, tensor, None, Some(root));
        let posts = self.exchange(desc, tensor, None)?;
        let bytes = tensor.numel() * tensor.dtype().size();
        if self.index != root {
            let dst = tensor.raw_device_write(OP)?.addr() as u64;
            self.copy(dst, self.addr(OP, &posts[root].input)?, bytes)?;
        }
        self.finish()?;
        self.counters.record(OpKind::Broadcast, bytes);
        Ok(())
    }

    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        self.drain();
        self.check_tensor(OP, input)?;
        self.check_tensor(OP, output)?;
        self.checks()
            .all_to_all(input, send_splits, output, recv_splits)?;
        let sent = input.numel();
        let desc = CallDesc {
            kind: OpKind::AllToAll,
            dtype: input.dtype(),
            count: 0,
            op: None,
            peer: None,
        };
        let splits = Some((send_splits.to_vec(), recv_splits.to_vec()));
        let posts = self.exchange(desc, input, splits)?;
        let size = input.dtype().size();
        let out = output.raw_device_write(OP)?.addr() as u64;
        let mut at = 0;
        for (j, p) in posts.iter().enumerate() {
            let sends = p.splits.as_ref().map(|s| &s.0[..]).unwrap_or(&[]);
            let offset: usize = sends[..self.index].iter().sum();
            let len = recv_splits[j];
            self.copy(
                out + (at * size) as u64,
                self.addr(OP, &p.input)? + (offset * size) as u64,
                len * size,
            )?;
            at += len;
        }
        self.finish()?;
        self.counters.record(OpKind::AllToAll, sent * size);
        Ok(())
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        const OP: &str = "send";
        self.drain();
        self.check_tensor(OP, tensor)?;
        self.checks().destination(dst)?;
        let bytes = tensor.numel() * tensor.dtype().size();
        let data = Tensor::zeros_on(tensor.shape().clone(), tensor.dtype(), &self.gpu)
            .map_err(|e| self.cuda("alloc", e))?;
        let to = data.raw_device_write(OP)?.addr() as u64;
        self.copy(to, self.addr(OP, tensor)?, bytes)?;
        let ready = self.record()?;
        self.mailbox
            .messages
            .lock()
            .entry((self.index, dst))
            .or_default()
            .push_back(Message { data, ready });
        // The host message orders the receive after the post and carries the description.
        let header =
            Tensor::from_vec(vec![tensor.numel() as i64, dtype_code(tensor.dtype())], [2])?;
        self.host.send(&header, dst)?;
        self.counters.record(OpKind::Send, bytes);
        Ok(())
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        const OP: &str = "recv";
        self.drain();
        self.check_tensor(OP, tensor)?;
        self.checks().source(src)?;
        let header = Tensor::zeros([2], DType::I64);
        self.host.recv(&header, src)?;
        let Some(message) = self
            .mailbox
            .messages
            .lock()
            .get_mut(&(src, self.index))
            .and_then(VecDeque::pop_front)
        else {
            return Err(self
                .checks()
                .invalid(format!("recv: no message from {src} in the mailbox")));
        };
        if message.data.numel() != tensor.numel() || message.data.dtype() != tensor.dtype() {
            return Err(CommError::Mismatch {
                group: self.name().to_string(),
                rank_a: self.ranks()[src],
                call_a: format!("send({} × {})", message.data.dtype(), message.data.numel()),
                rank_b: self.ranks()[self.index],
                call_b: format!("recv({} × {})", tensor.dtype(), tensor.numel()),
            });
        }
        self.wait(&message.ready)?;
        let bytes = tensor.numel() * tensor.dtype().size();
        let dst = tensor.raw_device_write(OP)?.addr() as u64;
        self.copy(dst, self.addr(OP, &message.data)?, bytes)?;
        // The snapshot is freed on the sender's stream: make that wait for this copy.
        let copied = self.record()?;
        if let Some(owner) = message.data.gpu() {
            owner
                .stream()
                .wait(&copied)
                .map_err(|e| self.cuda("cuStreamWaitEvent", format!("{e:?}")))?;
        }
        self.counters.record(OpKind::Recv, bytes);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.drain();
        let dummy =
            Tensor::zeros_on([0], DType::F32, &self.gpu).map_err(|e| self.cuda("alloc", e))?;
        let desc = CallDesc::barrier();
        self.exchange(desc, &dummy, None)?;
        self.finish()?;
        self.counters.record(OpKind::Barrier, 0);
        Ok(())
    }

    fn start_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending> {
        self.start_all_reduce_with(tensor, op, Self::all_reduce)
    }

    fn start_reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending> {
        self.start_reduce_scatter_with((input, output), op, Self::reduce_scatter)
    }

    fn start_all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Pending> {
        self.start_all_gather_with((input, output), Self::all_gather)
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

/// A dtype's code in a point-to-point header.
fn dtype_code(dtype: DType) -> i64 {
    DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0) as i64
}

/// The device backends' own checks (this one's and NCCL's).
impl super::checks::Checks<'_> {
    /// `t` is a contiguous tensor on CUDA device `ordinal` (the device backends' buffers).
    pub(crate) fn on_gpu(&self, op: &'static str, t: &Tensor, ordinal: usize) -> Result<()> {
        t.contiguous_for(op)?;
        let here = crate::tensor::Device::Cuda(ordinal);
        if t.device() != here {
            return Err(self.invalid(format!(
                "{op}: the tensor is on {}, this communicator moves tensors on {here}",
                t.device()
            )));
        }
        Ok(())
    }

    /// Refuses `op` of a group of more than one rank inside a graph capture: for a backend
    /// whose collectives meet the other ranks on the host, which a replayed graph would skip.
    pub(crate) fn not_in_capture(&self, op: &'static str, gpu: &crate::cuda::Gpu) -> Result<()> {
        if self.ranks.len() > 1
            && let Some(scope) = gpu.capturing()
        {
            return Err(self.invalid(format!(
                "{op} inside the capture of graph scope {scope}: the device-local communicator \
                 meets the other ranks on the host, which a replayed graph would skip (leave \
                 {scope} out of --cuda-graph-scope with more than one rank in this group, or \
                 run one process per GPU with --backend nccl, whose calls are captured)"
            )));
        }
        Ok(())
    }
}
