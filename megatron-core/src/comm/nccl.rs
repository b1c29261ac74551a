//! The NCCL backend (features `cuda` and `mpi`): one process per GPU, started by `mpirun` or
//! `srun`, device tensors moved by NCCL.
//!
//! - Bootstrapped over MPI, the way clusters launch: ranks, local ranks and the world size come
//!   from MPI, each process takes GPU `local_rank % device_count`, and every group's NCCL unique
//!   id is made by its first member and broadcast over the group's MPI communicator (no
//!   rendezvous server of our own).
//! - The same [`Communicator`] contract as the other backends: before each NCCL call the members
//!   exchange what they are about to call over MPI (a few bytes), so a mismatch is a
//!   [`CommError::Mismatch`] on every rank and a rank that never comes a [`CommError::Timeout`]
//!   naming it, instead of a hang inside NCCL. After the call the rank waits for it with the
//!   same deadline, polling NCCL's asynchronous error; a call that does not finish aborts the
//!   NCCL communicator and is a timeout.
//! - All-to-all with uneven splits is grouped send/recv (NCCL has no all-to-all).
//! - A send does not wait for its receive, as the other backends' do not: NCCL's send does, so
//!   a send is held (its header already sent) and launched together with this process's next
//!   receive in one NCCL group, or alone before its next other call or at [`Communicator::flush`].
//!   A receive launches its group before it reads the sender's header (the sender may be
//!   waiting for one of the held sends), and aborts the communicator when the header disagrees.
//!   [`Communicator::exchange`] launches its sends and receives in one NCCL group the same way
//!   (the pipeline's batches, as Megatron-LM's `batch_isend_irecv`).
//! - NCCL reduces in its own order (rings, trees), so sums equal the host backends' within
//!   rounding, not bit for bit.
//! - A started collective ([`Communicator::start_all_reduce`], ...) runs on the handle's
//!   progress thread ([`super::progress`]) and on a communication stream of its own: the start
//!   records an event on the rank's stream, the progress thread verifies the call with the
//!   members, makes the communication stream wait for that event (so NCCL reads the buffers as
//!   the rank's kernels left them at the start) and launches the call there, and polls it to
//!   completion with the deadline. The rank's stream goes on with its kernels meanwhile; the
//!   wait returns once the host has seen the call complete, so whatever the rank enqueues after
//!   it runs after the call. A blocking call on the group first waits for the started ones.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUresult, cuStreamQuery};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys::{
    ncclComm_t, ncclCommGetAsyncError, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};
use parking_lot::Mutex;

use super::checks::Checks;
use super::mpi::{MpiComm, MpiWorld};
use super::progress::Progress;
use super::stats::Counters;
use super::stream_start::{self, StreamStart};
use super::{
    CallDesc, CommError, CommStats, Communicator, OpKind, Pending, ReduceOp, Result, World,
};
use crate::cuda::Gpu;
use crate::tensor::{DType, Tensor};

/// A group's key: its family name and its members.
type GroupKey = (String, Vec<usize>);

/// One process's entry into an NCCL world: its MPI world and its GPU.
pub struct NcclWorld {
    mpi: MpiWorld,
    gpu: Gpu,
    timeout: Duration,
    groups: Mutex<HashMap<GroupKey, Arc<NcclComm>>>,
    held: Arc<HeldSends>,
}

/// A send posted but not launched yet (see the module documentation).
struct HeldSend {
    /// The communicator's handle (a held send is launched before any call that could abort it).
    comm: ncclComm_t,
    data: *const c_void,
    count: usize,
    dtype: DType,
    peer: usize,
    /// Keeps the tensor's memory until the send is done.
    _keep: Tensor,
}

/// The sends a process holds, over all its communicators, in the order they were posted.
#[derive(Default)]
struct HeldSends(Mutex<Vec<HeldSend>>);

// SAFETY: the handles and pointers are used by the process's one rank, one call at a time,
// under the mutex.
unsafe impl Send for HeldSends {}
unsafe impl Sync for HeldSends {}

impl std::fmt::Debug for NcclWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclWorld")
            .field("rank", &self.mpi.rank())
            .field("size", &self.mpi.size())
            .field("gpu", &self.gpu.ordinal())
            .finish()
    }
}

fn world_error(call: &'static str, message: impl std::fmt::Display) -> CommError {
    CommError::Backend {
        group: "world".to_string(),
        library: "NCCL",
        call,
        message: message.to_string(),
    }
}

impl NcclWorld {
    /// Opens this process's GPU (local rank modulo the devices of the node) on top of `mpi`.
    pub fn init(mpi: MpiWorld) -> Result<NcclWorld> {
        crate::cuda::require_nccl().map_err(|e| world_error("dlopen", e))?;
        crate::cuda::require_driver().map_err(|e| world_error("dlopen", e))?;
        let devices = cudarc::driver::CudaContext::device_count()
            .map_err(|e| world_error("cuDeviceGetCount", format!("{e:?}")))?;
        if devices < 1 {
            return Err(world_error(
                "cuDeviceGetCount",
                "this node has no CUDA device",
            ));
        }
        let ordinal = mpi.local_rank() % devices as usize;
        let gpu = Gpu::new(ordinal).map_err(|e| world_error("opening the GPU", e))?;
        Ok(NcclWorld {
            timeout: mpi.timeout(),
            mpi,
            gpu,
            groups: Mutex::new(HashMap::new()),
            held: Arc::new(HeldSends::default()),
        })
    }

    /// This process's GPU: allocate its tensors with it.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The MPI world under it (e.g. to abort every process).
    pub fn mpi(&self) -> &MpiWorld {
        &self.mpi
    }
}

impl World for NcclWorld {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn size(&self) -> usize {
        self.mpi.size()
    }

    /// The NCCL communicator of a group, created by its members together (they must ask for
    /// their groups in the same order, as with MPI).
    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>> {
        let key = (name.to_string(), ranks.to_vec());
        if let Some(comm) = self.groups.lock().get(&key) {
            return Ok(Arc::clone(comm) as Arc<dyn Communicator>);
        }
        let host = self.mpi.mpi_communicator(name, ranks)?;
        let comm = Arc::new(NcclComm::create(
            host,
            self.gpu.clone(),
            self.timeout,
            Arc::clone(&self.held),
        )?);
        self.groups.lock().insert(key, Arc::clone(&comm));
        Ok(comm)
    }
}

/// An NCCL communicator handle, destroyed with its owner.
struct RawComm(ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread, one call at a time; `NcclComm`
// serialises its calls with a mutex.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is not used after this.
        unsafe {
            let _ = nccl::comm_destroy(self.0);
        }
    }
}

/// One rank's handle on a group's NCCL communicator.
pub struct NcclComm {
    host: Arc<MpiComm>,
    comm: Arc<Mutex<Option<RawComm>>>,
    gpu: Gpu,
    timeout: Duration,
    counters: Arc<Counters>,
    /// The process's held sends, shared with its other communicators.
    held: Arc<HeldSends>,
    /// The device with the communication stream started collectives run on (the runner's own
    /// stream).
    comm_gpu: Gpu,
    /// The thread started collectives run on (a runner handle's is never started).
    progress: Progress<NcclComm>,
    /// This handle is the progress thread's: it leaves the process's held sends to the rank's
    /// own calls (they belong to the rank's stream).
    runner: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("group", &self.host.name())
            .field("ranks", &self.host.ranks())
            .field("index", &self.host.index())
            .finish()
    }
}

/// NCCL's type of `dtype`.
fn nccl_type(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::I64 => ncclDataType_t::ncclInt64,
    }
}

/// NCCL's reduction of `op`.
fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

impl NcclComm {
    /// Creates the group's communicator: member 0 makes the unique id, MPI broadcasts it, every
    /// member joins with its index.
    fn create(
        host: Arc<MpiComm>,
        gpu: Gpu,
        timeout: Duration,
        held: Arc<HeldSends>,
    ) -> Result<NcclComm> {
        let backend = |call, e: String| CommError::Backend {
            group: host.name().to_string(),
            library: "NCCL",
            call,
            message: e,
        };
        let id_words = if host.index() == 0 {
            let id =
                nccl::get_uniqueid().map_err(|e| backend("ncclGetUniqueId", format!("{e:?}")))?;
            id_to_words(&id)
        } else {
            vec![0i64; 16]
        };
        let id_tensor = Tensor::from_vec(id_words, [16])?;
        host.broadcast(&id_tensor, 0)?;
        let id = words_to_id(&id_tensor.to_vec::<i64>()?);
        let (n, index) = (host.size() as i32, host.index() as i32);
        gpu.context()
            .bind_to_thread()
            .map_err(|e| backend("cuCtxSetCurrent", format!("{e:?}")))?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` receives the new handle; every member calls this with the same id.
        unsafe { nccl::comm_init_rank(&mut comm, n, id, index) }
            .map_err(|e| backend("ncclCommInitRank", format!("{e:?}")))?;
        let comm_gpu = gpu
            .with_new_stream()
            .map_err(|e| backend("cuStreamCreate", e.to_string()))?;
        Ok(NcclComm {
            host,
            comm: Arc::new(Mutex::new(Some(RawComm(comm)))),
            gpu,
            timeout,
            counters: Arc::default(),
            held,
            comm_gpu,
            progress: Progress::joined(),
            runner: false,
        })
    }

    /// Waits until every collective this rank started on the group has run.
    fn drain(&self) {
        self.progress.drain();
    }

    /// Launches the process's held sends and `then` (with this communicator's handle) in one
    /// NCCL group, runs `meanwhile` on the host, and waits for the group. An error of
    /// `meanwhile` aborts the communicator: the group may never finish.
    fn launch_held(
        &self,
        what: &str,
        then: Option<&dyn Fn(ncclComm_t, cudarc::driver::sys::CUstream) -> Result<()>>,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let held = match self.runner {
            true => Vec::new(),
            false => std::mem::take(&mut *self.held.0.lock()),
        };
        if held.is_empty() && then.is_none() {
            return meanwhile();
        }
        let guard = self.comm.lock();
        let Some(comm) = guard.as_ref().map(|c| c.0) else {
            return Err(self.backend("use", "the communicator was aborted after a timeout"));
        };
        let stream = self.gpu.stream().cu_stream();
        let enqueued = (|| {
            self.status("ncclGroupStart", nccl::group_start())?;
            let mut result = Ok(());
            for h in &held {
                if result.is_ok() {
                    // SAFETY: the held tensor's `count` elements, kept alive by `_keep`.
                    result = self.status("ncclSend", unsafe {
                        nccl::send(
                            h.data,
                            h.count,
                            nccl_type(h.dtype),
                            h.peer as i32,
                            h.comm,
                            stream as _,
                        )
                    });
                }
            }
            if let (Some(call), true) = (then, result.is_ok()) {
                result = call(comm, stream);
            }
            self.status("ncclGroupEnd", nccl::group_end())?;
            result
        })();
        drop(guard);
        enqueued?;
        if let Err(e) = meanwhile() {
            if let Some(comm) = self.comm.lock().take() {
                // SAFETY: the handle is not used after the abort (it was taken out).
                unsafe {
                    let _ = nccl::comm_abort(comm.0);
                }
                std::mem::forget(comm);
            }
            return Err(e);
        }
        self.wait(what)
    }

    /// Reads the header of the next message from `src` and checks it against a receive of
    /// `count` elements of `dtype`.
    fn check_header(&self, src: usize, count: usize, dtype: DType) -> Result<()> {
        let header = Tensor::zeros([2], DType::I64);
        self.host.recv(&header, src)?;
        let sent = header.to_vec::<i64>()?;
        if sent != [count as i64, dtype as i64] {
            return Err(CommError::Mismatch {
                group: self.name().to_string(),
                rank_a: self.ranks()[src],
                call_a: format!("send({} elements, dtype #{})", sent[0], sent[1]),
                rank_b: self.ranks()[self.index()],
                call_b: format!("recv({dtype} × {count})"),
            });
        }
        Ok(())
    }

    /// Launches the held sends before a call that is not a receive.
    fn flush_held(&self) -> Result<()> {
        self.launch_held("held sends", None, &mut || Ok(()))
    }

    fn backend(&self, call: &'static str, message: impl std::fmt::Display) -> CommError {
        CommError::Backend {
            group: self.name().to_string(),
            library: "NCCL",
            call,
            message: message.to_string(),
        }
    }

    fn checks(&self) -> Checks<'_> {
        Checks {
            group: self.host.name(),
            ranks: self.host.ranks(),
            index: self.host.index(),
        }
    }

    fn check_tensor(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.checks().on_gpu(op, t, self.gpu.ordinal())
    }

    /// Verifies the call with every member over MPI, runs `call` with the NCCL handle and this
    /// rank's stream, and waits for it (see the module documentation).
    fn run(
        &self,
        desc: CallDesc,
        splits: Option<(Vec<usize>, Vec<usize>)>,
        call: impl FnOnce(ncclComm_t, cudarc::driver::sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        let what = desc.to_string();
        self.flush_held()?;
        self.host.verify_call(desc, splits)?;
        self.launch(&what, call)
    }

    /// Runs `call` with the NCCL handle and this rank's stream, and waits for it.
    fn launch(
        &self,
        what: &str,
        call: impl FnOnce(ncclComm_t, cudarc::driver::sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        let guard = self.comm.lock();
        let Some(comm) = guard.as_ref().map(|c| c.0) else {
            return Err(self.backend("use", "the communicator was aborted after a timeout"));
        };
        call(comm, self.gpu.stream().cu_stream())?;
        drop(guard);
        if self.gpu.capturing().is_some() {
            // Recorded into the graph being captured: it runs when the graph is replayed, and
            // a wait on a capturing stream is not allowed.
            return Ok(());
        }
        self.wait(what)
    }

    /// Polls the stream and NCCL's asynchronous error until the call is done or the deadline.
    fn wait(&self, what: &str) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: the stream belongs to this rank's live context.
            match unsafe { cuStreamQuery(self.gpu.stream().cu_stream()) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.backend("cuStreamQuery", format!("{other:?}"))),
            }
            if let Some(comm) = self.comm.lock().as_ref() {
                let mut state = ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator and a valid out-pointer.
                unsafe { ncclCommGetAsyncError(comm.0, &mut state) };
                if state != ncclResult_t::ncclSuccess && state != ncclResult_t::ncclInProgress {
                    return Err(
                        self.backend("ncclCommGetAsyncError", format!("{state:?} during {what}"))
                    );
                }
            }
            let waited = start.elapsed();
            if waited > self.timeout {
                if let Some(comm) = self.comm.lock().take() {
                    // SAFETY: the handle is not used after the abort (it was taken out).
                    unsafe {
                        let _ = nccl::comm_abort(comm.0);
                    }
                    std::mem::forget(comm);
                }
                return Err(CommError::Timeout {
                    group: self.name().to_string(),
                    call: what.to_string(),
                    waited,
                    missing: Vec::new(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn status(
        &self,
        call: &'static str,
        r: std::result::Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<()> {
        r.map(drop)
            .map_err(|e| self.backend(call, format!("{e:?}")))
    }
}

impl StreamStart for NcclComm {
    fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn group(&self) -> &str {
        self.name()
    }

    fn check_started(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.check_tensor(op, t)
    }

    /// On the progress thread and the group's communication stream, after the rank's held
    /// sends (on its own stream); at once while the rank's stream is captured (a started call
    /// cannot be part of a graph).
    fn start(
        &self,
        desc: &CallDesc,
        keep: Vec<Tensor>,
        call: impl FnOnce(&Self) -> Result<()> + Send + 'static,
    ) -> Result<Pending> {
        if self.gpu.capturing().is_some() {
            let start = Instant::now();
            return Ok(Pending::ran(
                self.flush_held().and_then(|()| call(self)),
                start,
            ));
        }
        self.flush_held()?;
        let runner = || {
            let runner = NcclComm {
                host: Arc::clone(&self.host),
                comm: Arc::clone(&self.comm),
                gpu: self.comm_gpu.clone(),
                timeout: self.timeout,
                counters: Arc::clone(&self.counters),
                held: Arc::clone(&self.held),
                comm_gpu: self.comm_gpu.clone(),
                progress: Progress::default(),
                runner: true,
            };
            let name = format!("nccl-{}-{}", self.name(), self.ranks()[self.index()]);
            (runner, name)
        };
        let group = (&self.gpu, self.name());
        stream_start::on_comm_stream(&self.progress, group, desc, runner, keep, call)
    }
}

impl Communicator for NcclComm {
    fn name(&self) -> &str {
        self.host.name()
    }

    fn place(&self, tensor: &Tensor) -> Result<Tensor> {
        match tensor.device() == crate::tensor::Device::Cuda(self.gpu.ordinal()) {
            true => Ok(tensor.clone()),
            false => tensor
                .to_gpu(&self.gpu)
                .map_err(|e| self.backend("copy to the device", e)),
        }
    }

    fn ranks(&self) -> &[usize] {
        self.host.ranks()
    }

    fn index(&self) -> usize {
        self.host.index()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.drain();
        const OP: &str = "all_reduce";
        self.check_tensor(OP, tensor)?;
        let (count, dtype) = (tensor.numel(), tensor.dtype());
        let buf = tensor.raw_device_write(OP)?;
        let ptr = buf.addr() as *mut c_void;
        self.run(
            CallDesc::of(OpKind::AllReduce, tensor, Some(op), None),
            None,
            |comm, stream| {
                // SAFETY: `ptr` is the borrowed tensor of `count` elements of `dtype`, in place.
                self.status("ncclAllReduce", unsafe {
                    nccl::all_reduce(
                        ptr,
                        ptr,
                        count,
                        nccl_type(dtype),
                        nccl_op(op),
                        comm,
                        stream as _,
                    )
                })
            },
        )?;
        self.counters
            .record(OpKind::AllReduce, count * dtype.size());
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.drain();
        const OP: &str = "all_gather";
        self.check_tensor(OP, input)?;
        self.check_tensor(OP, output)?;
        let (count, dtype) = (self.checks().all_gather(input, output)?, input.dtype());
        let out = output.raw_device_write(OP)?;
        let recv = out.addr() as *mut c_void;
        // In place (the input is this rank's slot of the output), NCCL reads the slot itself.
        let send = if input.same_storage(output) {
            self.checks()
                .slot(OP, output, input, count, ("output", "input"))?;
            (out.addr() + self.index() * count * dtype.size()) as *const c_void
        } else {
            input.raw_device_read(OP)?.addr() as *const c_void
        };
        self.run(
            CallDesc::of(OpKind::AllGather, input, None, None),
            None,
            |comm, stream| {
                // SAFETY: `send` holds `count` elements and `recv` n × count, on this device.
                self.status("ncclAllGather", unsafe {
                    nccl::all_gather(send, recv, count, nccl_type(dtype), comm, stream as _)
                })
            },
        )?;
        self.counters
            .record(OpKind::AllGather, count * dtype.size());
        Ok(())
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.drain();
        const OP: &str = "reduce_scatter";
        self.check_tensor(OP, input)?;
        self.check_tensor(OP, output)?;
        let (count, dtype) = (self.checks().reduce_scatter(input, output)?, output.dtype());
        let whole = input.raw_device_write(OP)?;
        let send = whole.addr() as *const c_void;
        let recv = if input.same_storage(output) {
            self.checks()
                .slot(OP, input, output, count, ("input", "output"))?;
            (whole.addr() + self.index() * count * dtype.size()) as *mut c_void
        } else {
            output.raw_device_write(OP)?.addr() as *mut c_void
        };
        self.run(
            CallDesc::of(OpKind::ReduceScatter, output, Some(op), None),
            None,
            |comm, stream| {
                // SAFETY: `send` holds n × count elements and `recv` count, on this device.
                self.status("ncclReduceScatter", unsafe {
                    nccl::reduce_scatter(
                        send,
                        recv,
                        count,
                        nccl_type(dtype),
                        nccl_op(op),
                        comm,
                        stream as _,
                    )
                })
            },
        )?;
        self.counters
            .record(OpKind::ReduceScatter, count * dtype.size());
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.drain();
        const OP: &str = "broadcast";
        self.check_tensor(OP, tensor)?;
        self.checks().peer("broadcast root", root)?;
        let (count, dtype) = (tensor.numel(), tensor.dtype());
        let buf = tensor.raw_device_write(OP)?;
        let ptr = buf.addr() as *mut c_void;
        self.run(
            CallDesc::of(OpKind::Broadcast, tensor, None, Some(root)),
            None,
            |comm, stream| {
                // SAFETY: the borrowed tensor, in place.
                self.status("ncclBroadcast", unsafe {
                    nccl::broadcast(
                        ptr,
                        ptr,
                        count,
                        nccl_type(dtype),
                        root as i32,
                        comm,
                        stream as _,
                    )
                })
            },
        )?;
        self.counters
            .record(OpKind::Broadcast, count * dtype.size());
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
        const OP: &str = "all_to_all";
        self.check_tensor(OP, input)?;
        self.check_tensor(OP, output)?;
        self.checks()
            .all_to_all(input, send_splits, output, recv_splits)?;
        let (n, sent) = (self.size(), input.numel());
        let dtype = input.dtype();
        let size = dtype.size();
        let src = input.raw_device_read(OP)?.addr();
        let dst = output.raw_device_write(OP)?;
        let dst = dst.addr();
        let desc = CallDesc {
            kind: OpKind::AllToAll,
            dtype,
            count: 0,
            op: None,
            peer: None,
        };
        let splits = Some((send_splits.to_vec(), recv_splits.to_vec()));
        self.run(desc, splits, |comm, stream| {
            self.status("ncclGroupStart", nccl::group_start())?;
            let (mut s_at, mut r_at) = (0, 0);
            let mut result = Ok(());
            for peer in 0..n {
                let (s, r) = (send_splits[peer], recv_splits[peer]);
                // SAFETY: the offsets stay inside the input and output (the splits add up to
                // their lengths, checked above).
                if s > 0 && result.is_ok() {
                    result = self.status("ncclSend", unsafe {
                        nccl::send(
                            (src + s_at * size) as *const c_void,
                            s,
                            nccl_type(dtype),
                            peer as i32,
                            comm,
                            stream as _,
                        )
                    });
                }
                if r > 0 && result.is_ok() {
                    result = self.status("ncclRecv", unsafe {
                        nccl::recv(
                            (dst + r_at * size) as *mut c_void,
                            r,
                            nccl_type(dtype),
                            peer as i32,
                            comm,
                            stream as _,
                        )
                    });
                }
                s_at += s;
                r_at += r;
            }
            self.status("ncclGroupEnd", nccl::group_end())?;
            result
        })?;
        self.counters.record(OpKind::AllToAll, sent * size);
        Ok(())
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.drain();
        const OP: &str = "send";
        self.check_tensor(OP, tensor)?;
        self.checks().destination(dst)?;
        let (count, dtype) = (tensor.numel(), tensor.dtype());
        let data = tensor.raw_device_read(OP)?.addr() as *const c_void;
        // Point-to-point calls are checked by the receiver (the header below) rather than by a
        // handshake of the whole group.
        let header = Tensor::from_vec(vec![count as i64, dtype as i64], [2])?;
        self.host.send(&header, dst)?;
        let comm = match self.comm.lock().as_ref() {
            Some(c) => c.0,
            None => return Err(self.backend("use", "the communicator was aborted after a timeout")),
        };
        // Held until this process's next receive or other call (see the module documentation).
        self.held.0.lock().push(HeldSend {
            comm,
            data,
            count,
            dtype,
            peer: dst,
            _keep: tensor.clone(),
        });
        self.counters.record(OpKind::Send, count * dtype.size());
        Ok(())
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.drain();
        const OP: &str = "recv";
        self.check_tensor(OP, tensor)?;
        self.checks().source(src)?;
        let (count, dtype) = (tensor.numel(), tensor.dtype());
        let dst = tensor.raw_device_write(OP)?.addr() as *mut c_void;
        // The held sends go in the same NCCL group, so neither waits for the other; they go
        // before the sender's header is read, since the sender may wait for one of them first.
        let receive = |comm: ncclComm_t, stream: cudarc::driver::sys::CUstream| {
            // SAFETY: the borrowed tensor's `count` elements.
            self.status("ncclRecv", unsafe {
                nccl::recv(dst, count, nccl_type(dtype), src as i32, comm, stream as _)
            })
        };
        let mut check_header = || self.check_header(src, count, dtype);
        self.launch_held("recv", Some(&receive), &mut check_header)?;
        self.counters.record(OpKind::Recv, count * dtype.size());
        Ok(())
    }

    fn exchange(&self, sends: &[(&Tensor, usize)], recvs: &[(&Tensor, usize)]) -> Result<()> {
        self.drain();
        const OP: &str = "exchange";
        let mut outgoing = Vec::with_capacity(sends.len());
        for &(tensor, dst) in sends {
            self.check_tensor(OP, tensor)?;
            self.checks().destination(dst)?;
            let data = tensor.raw_device_read(OP)?.addr() as *const c_void;
            outgoing.push((data, tensor.numel(), tensor.dtype(), dst));
        }
        let mut incoming = Vec::with_capacity(recvs.len());
        for &(tensor, src) in recvs {
            self.check_tensor(OP, tensor)?;
            self.checks().source(src)?;
            let data = tensor.raw_device_write(OP)?.addr() as *mut c_void;
            incoming.push((data, tensor.numel(), tensor.dtype(), src));
        }
        // Each send's header goes ahead over MPI, as a single send's does.
        for &(_, count, dtype, dst) in &outgoing {
            let header = Tensor::from_vec(vec![count as i64, dtype as i64], [2])?;
            self.host.send(&header, dst)?;
        }
        // Every send and receive in one NCCL group (with any held sends), so none waits for
        // another; the headers are read once the group is launched.
        let batch = |comm: ncclComm_t, stream: cudarc::driver::sys::CUstream| {
            for &(data, count, dtype, dst) in &outgoing {
                // SAFETY: the borrowed tensor's `count` elements.
                self.status("ncclSend", unsafe {
                    nccl::send(data, count, nccl_type(dtype), dst as i32, comm, stream as _)
                })?;
            }
            for &(data, count, dtype, src) in &incoming {
                // SAFETY: the borrowed tensor's `count` elements.
                self.status("ncclRecv", unsafe {
                    nccl::recv(data, count, nccl_type(dtype), src as i32, comm, stream as _)
                })?;
            }
            Ok(())
        };
        let mut check_headers = || {
            for &(_, count, dtype, src) in &incoming {
                self.check_header(src, count, dtype)?;
            }
            Ok(())
        };
        self.launch_held("exchange", Some(&batch), &mut check_headers)?;
        for &(_, count, dtype, _) in &outgoing {
            self.counters.record(OpKind::Send, count * dtype.size());
        }
        for &(_, count, dtype, _) in &incoming {
            self.counters.record(OpKind::Recv, count * dtype.size());
        }
        Ok(())
    }

    fn rendezvous(&self) -> bool {
        true
    }

    fn barrier(&self) -> Result<()> {
        self.drain();
        self.flush_held()?;
        self.gpu
            .synchronize()
            .map_err(|e| self.backend("cuStreamSynchronize", e))?;
        self.host.barrier()?;
        self.counters.record(OpKind::Barrier, 0);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.drain();
        self.flush_held()
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

/// The 128 bytes of a unique id as 16 words (to broadcast as a tensor).
fn id_to_words(id: &ncclUniqueId) -> Vec<i64> {
    let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

/// The inverse of [`id_to_words`].
fn words_to_id(words: &[i64]) -> ncclUniqueId {
    let mut id = ncclUniqueId { internal: [0; 128] };
    for (i, b) in words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .enumerate()
        .take(128)
    {
        id.internal[i] = b as _;
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_survive_the_round_trip_through_words() {
        let mut id = ncclUniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = (i as i32 * 37 - 100) as _;
        }
        let back = words_to_id(&id_to_words(&id));
        assert_eq!(back.internal, id.internal);
    }
}
