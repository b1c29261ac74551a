//! Communication: the [`Communicator`] trait over one process group, and its backends.
//!
//! Every collective of megatron-rs goes through a communicator of a named group (tp, dp, pp, ...),
//! so mismatch checks, timeouts and byte counters live in one place. Backends: [`threads`] (ranks
//! as OS threads of one process, the default on CPU and what tests use) and, with the `mpi`
//! feature, `mpi` (one rank per process under `mpirun`, CPU ranks on one or many nodes).
//! [`recording`] wraps any of them to log each call in order.

mod bytes;
mod checks;
mod error;
#[cfg(feature = "cuda")]
pub mod gpu_local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(all(feature = "cuda", feature = "mpi"))]
pub mod nccl;
mod pending;
mod progress;
pub mod recording;
mod reduce;
mod stats;
#[cfg(feature = "cuda")]
mod stream_start;
pub mod threads;

use std::fmt;
use std::sync::Arc;

pub use bytes::all_gather_bytes;
pub use error::CommError;
pub use pending::{Pending, Ran};
pub use stats::{CommStats, OpStats};

use crate::context_parallel::{CpCommType, CpGroups};
use crate::parallel::{GroupKind, ParallelLayout, RankGroups};
use crate::tensor::{DType, Tensor};

/// Shorthand for results of communication.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// How an all-reduce or reduce-scatter combines values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum (floats accumulate in f32, in rank order).
    Sum,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceOp {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// The kinds of operation a communicator performs (the keys of its counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// Broadcast.
    Broadcast,
    /// All-to-all with per-rank splits.
    AllToAll,
    /// Point-to-point send.
    Send,
    /// Point-to-point receive.
    Recv,
    /// Barrier.
    Barrier,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Barrier,
    ];

    /// Snake-case name as in logs and reports, e.g. `all_reduce`.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one rank asked a group to do; ranks of a group must agree on it (splits excepted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallDesc {
    /// The operation.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Elements this rank passes (NCCL's count: the input of all-gather, the output of
    /// reduce-scatter, the send buffer of all-to-all).
    pub count: usize,
    /// Reduction, for all-reduce and reduce-scatter.
    pub op: Option<ReduceOp>,
    /// Root (group index), for broadcast; peer for send and recv.
    pub peer: Option<usize>,
}

impl fmt::Display for CallDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.kind)?;
        if let Some(op) = self.op {
            write!(f, "{}, ", op.name())?;
        }
        match self.kind {
            OpKind::Broadcast => write!(f, "root {}, ", self.peer.unwrap_or(0))?,
            OpKind::Send => write!(f, "to {}, ", self.peer.unwrap_or(0))?,
            OpKind::Recv => write!(f, "from {}, ", self.peer.unwrap_or(0))?,
            _ => {}
        }
        write!(f, "{} × {})", self.dtype, self.count)
    }
}

/// One rank's handle on one process group: the collectives Megatron-LM uses.
///
/// Ranks of the group must call the same collectives in the same order with matching arguments;
/// a disagreement is a [`CommError::Mismatch`] on every rank, a rank that never arrives a
/// [`CommError::Timeout`], and a failed rank a [`CommError::PeerFailed`]: never a hang. Ranks are
/// group ranks (indices into the group's member list), as in `torch.distributed` groups.
///
/// The calls are `#[track_caller]`: a [`recording`] world logs the source line that made each
/// (docs/collectives.md).
pub trait Communicator: Send + Sync {
    /// The group's family name (e.g. `tp`), for errors and reports.
    fn name(&self) -> &str;

    /// Global ranks of the members, in group-rank order.
    fn ranks(&self) -> &[usize];

    /// This rank's index in the group.
    fn index(&self) -> usize;

    /// Number of members.
    fn size(&self) -> usize {
        self.ranks().len()
    }

    /// `tensor` where this communicator moves tensors: on its GPU for a device backend, on the
    /// host otherwise (itself when it is there already, else a copy). For small values built
    /// on the host (token ids at a chunk's edge, a count) that a collective must carry.
    fn place(&self, tensor: &Tensor) -> Result<Tensor> {
        match tensor.gpu() {
            Some(_) => tensor.to_host().map_err(|e| CommError::Backend {
                group: self.name().to_string(),
                library: "CUDA",
                call: "copy to the host",
                message: e.to_string(),
            }),
            None => Ok(tensor.clone()),
        }
    }

    /// Reduces `tensor` across the group in place: every rank ends with the same result.
    #[track_caller]
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;

    /// Starts [`Communicator::all_reduce`] of `tensor` and returns, where the backend can,
    /// before it has run: it runs while the rank computes, and [`Pending::wait`] returns once
    /// it has (with its error, if any). Until then the tensor is the collective's: reading or
    /// writing it is an error of the tensor's borrows while the collective holds them, and
    /// reads the values before the reduction until it does. A rank's collectives on one group,
    /// started or not, run in the order it calls them. The default runs it at once.
    #[track_caller]
    fn start_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending> {
        let start = std::time::Instant::now();
        Ok(Pending::ran(self.all_reduce(tensor, op), start))
    }

    /// Starts [`Communicator::reduce_scatter`], as [`Communicator::start_all_reduce`] starts
    /// an all-reduce.
    #[track_caller]
    fn start_reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending> {
        let start = std::time::Instant::now();
        Ok(Pending::ran(self.reduce_scatter(input, output, op), start))
    }

    /// Starts [`Communicator::all_gather`], as [`Communicator::start_all_reduce`] starts an
    /// all-reduce.
    #[track_caller]
    fn start_all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Pending> {
        let start = std::time::Instant::now();
        Ok(Pending::ran(self.all_gather(input, output), start))
    }

    /// Concatenates every rank's `input` along the first axis of `output` (size × input's
    /// elements), in group-rank order. `input` may be this rank's slot of `output` (in place).
    #[track_caller]
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()>;

    /// Reduces every rank's `input` and leaves slot `index()` (of size elements / size) in
    /// `output`. `output` may be this rank's slot of `input` (in place).
    #[track_caller]
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()>;

    /// Copies group rank `root`'s `tensor` into every other rank's `tensor`.
    #[track_caller]
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()>;

    /// Sends `send_splits[j]` consecutive elements of `input` to rank j and receives
    /// `recv_splits[i]` elements from rank i into `output`, in rank order (uneven splits allowed;
    /// rank i's `send_splits[j]` must equal rank j's `recv_splits[i]`).
    #[track_caller]
    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()>;

    /// Sends `tensor` to group rank `dst`; returns once the data is handed over.
    #[track_caller]
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()>;

    /// Receives into `tensor` the next message from group rank `src` (same dtype and size).
    #[track_caller]
    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()>;

    /// Sends each `(tensor, dst)` of `sends` and receives each `(tensor, src)` of `recvs` as
    /// one batch, in which no call waits for another (Megatron-LM's `batch_isend_irecv`):
    /// returns once all are done. A rank receives a peer's messages in the order the peer sent
    /// them; where sends wait for their receives ([`Communicator::rendezvous`]) a batch holds at
    /// most one message to and one from each peer. This default suits backends whose sends
    /// never wait.
    #[track_caller]
    fn exchange(&self, sends: &[(&Tensor, usize)], recvs: &[(&Tensor, usize)]) -> Result<()> {
        for &(tensor, dst) in sends {
            self.send(tensor, dst)?;
        }
        for &(tensor, src) in recvs {
            self.recv(tensor, src)?;
        }
        Ok(())
    }

    /// [`exchange`](Communicator::exchange) giving the sent tensors up and returning the
    /// received ones: each of `recvs`' buffers filled, or the sender's tensor itself. A backend
    /// that can hand a storage over (thread ranks) passes a sent tensor that nothing else holds
    /// to its receiver as it is, without a copy; this default copies, as `exchange` does.
    #[track_caller]
    fn exchange_owned(
        &self,
        sends: Vec<(Tensor, usize)>,
        recvs: Vec<(Tensor, usize)>,
    ) -> Result<Vec<Tensor>> {
        let outgoing: Vec<(&Tensor, usize)> = sends.iter().map(|(t, peer)| (t, *peer)).collect();
        let incoming: Vec<(&Tensor, usize)> = recvs.iter().map(|(t, src)| (t, *src)).collect();
        self.exchange(&outgoing, &incoming)?;
        Ok(recvs.into_iter().map(|(t, _)| t).collect())
    }

    /// Whether an [`exchange`](Communicator::exchange)'s sends complete only together with
    /// their receives (NCCL's do), so that peers must exchange both ends of a message in one
    /// call each; other backends deliver a send at once.
    fn rendezvous(&self) -> bool {
        false
    }

    /// Returns once every rank of the group has called it.
    #[track_caller]
    fn barrier(&self) -> Result<()>;

    /// Completes the sends this rank has posted. Sends never wait for their receive; a backend
    /// whose library's sends do (NCCL) holds them until this rank's next receive or other call,
    /// so a rank that sends last calls this (a checkpoint's gather does).
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// Calls and bytes so far, per operation kind, as seen by this rank.
    fn stats(&self) -> CommStats;
}

/// One rank's entry into a world of ranks: its rank, and communicators for any group of it.
pub trait World: Send + Sync {
    /// This rank's global rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn size(&self) -> usize;

    /// A communicator over `ranks` (global ranks, which must include this rank) named `name`.
    /// Every member must ask for the same group; asking twice returns the same group.
    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>>;
}

/// How long a rank waits at a collective before failing with [`CommError::Timeout`]: 600 s, or
/// `MEGATRON_COMM_TIMEOUT_SECS` when set to a positive number.
pub fn default_timeout() -> std::time::Duration {
    let secs = std::env::var("MEGATRON_COMM_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(600.0);
    std::time::Duration::from_secs_f64(secs)
}

/// Checks a group asked of a world (members inside the world, none repeated, `rank` among them)
/// and returns `rank`'s index in it.
pub(crate) fn member_index(
    name: &str,
    ranks: &[usize],
    rank: usize,
    world_size: usize,
) -> Result<usize> {
    let invalid = |message: String| CommError::Invalid {
        group: name.to_string(),
        message,
    };
    let Some(index) = ranks.iter().position(|&r| r == rank) else {
        return Err(invalid(format!("rank {rank} is not a member of {ranks:?}")));
    };
    if let Some(&bad) = ranks.iter().find(|&&r| r >= world_size) {
        return Err(invalid(format!(
            "rank {bad} is outside the world of {world_size} ranks"
        )));
    }
    let mut seen = ranks.to_vec();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != ranks.len() {
        return Err(invalid(format!("ranks {ranks:?} repeat a member")));
    }
    Ok(index)
}

/// The parallel state of one rank: its groups and a communicator for each (Megatron's `mpu`),
/// and whether the run splits the activations outside the tensor-parallel regions along the
/// sequence (`--sequence-parallel`).
pub struct ParallelState {
    groups: RankGroups,
    comms: Vec<(GroupKind, Arc<dyn Communicator>)>,
    sequence_parallel: bool,
    context_parallel: Option<CpGroups>,
    optimizer_instances: Option<OptimizerInstances>,
}

/// The groups of several distributed-optimizer instances (Megatron-LM's
/// `--num-distributed-optimizer-instances`, sharding within a group and replicating across:
/// HSDP). The data-parallel group (dp × cp) and the expert data-parallel group are each cut into
/// `instances` runs of consecutive members: a rank's instance is its run, and the ranks at its
/// place in every run are its replicas. Gradients are reduce-scattered within the instance and
/// the shards then all-reduced across instances; parameters are gathered within the instance.
#[derive(Clone)]
pub struct OptimizerInstances {
    /// How many.
    pub instances: usize,
    /// Within the rank's instance: the dense group's part and the expert one's.
    pub within: [Arc<dyn Communicator>; 2],
    /// Across instances, the ranks at this rank's place in each: dense and expert.
    pub across: [Arc<dyn Communicator>; 2],
}

impl ParallelState {
    /// Builds a communicator for every group family this rank belongs to.
    pub fn new(world: &dyn World, layout: &ParallelLayout) -> Result<ParallelState> {
        let expected = layout.config().world_size;
        if world.size() != expected {
            return Err(CommError::Invalid {
                group: "world".into(),
                message: format!(
                    "the parallel layout needs {expected} ranks, the world has {}",
                    world.size()
                ),
            });
        }
        let groups = layout.rank(world.rank()).map_err(|e| CommError::Invalid {
            group: "world".into(),
            message: e.to_string(),
        })?;
        let comms = groups
            .iter()
            .map(|g| Ok((g.kind, world.communicator(g.kind.name(), &g.ranks)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut state = ParallelState {
            groups,
            comms,
            sequence_parallel: false,
            context_parallel: None,
            optimizer_instances: None,
        };
        state.context_parallel = state.cp_groups(world, CpCommType::default())?;
        Ok(state)
    }

    /// The same state with context-parallel attention exchanging keys and values as `kind`
    /// says (`--cp-comm-type`; all_gather by default), its groups made on `world`.
    pub fn with_cp_comm_type(mut self, world: &dyn World, kind: CpCommType) -> Result<Self> {
        self.context_parallel = self.cp_groups(world, kind)?;
        Ok(self)
    }

    /// The same state with `instances` distributed-optimizer instances ([`OptimizerInstances`],
    /// their groups made on `world`); 1 is one instance over the whole data-parallel group, as
    /// without. The data-parallel and expert data-parallel sizes must be multiples of it.
    pub fn with_optimizer_instances(mut self, world: &dyn World, instances: usize) -> Result<Self> {
        if instances <= 1 {
            self.optimizer_instances = None;
            return Ok(self);
        }
        let dense = match self.groups.config().cp {
            1 => GroupKind::Dp,
            _ => GroupKind::DpCp,
        };
        let mut within = Vec::new();
        let mut across = Vec::new();
        for kind in [dense, GroupKind::Edp] {
            let group = self.groups.group(kind);
            let n = group.size();
            if !n.is_multiple_of(instances) {
                return Err(CommError::Invalid {
                    group: kind.name().into(),
                    message: format!(
                        "--num-distributed-optimizer-instances {instances} must divide the {} \
                         group's {n} ranks",
                        kind.name()
                    ),
                });
            }
            let size = n / instances;
            let (instance, place) = (group.index / size, group.index % size);
            let mine = group.ranks[instance * size..(instance + 1) * size].to_vec();
            let replicas: Vec<usize> = (0..instances)
                .map(|k| group.ranks[k * size + place])
                .collect();
            within.push(world.communicator(&format!("{}-instance", kind.name()), &mine)?);
            across.push(world.communicator(&format!("{}-replicas", kind.name()), &replicas)?);
        }
        let pair = |v: Vec<Arc<dyn Communicator>>| -> [Arc<dyn Communicator>; 2] {
            let mut v = v.into_iter();
            let (Some(a), Some(b)) = (v.next(), v.next()) else {
                unreachable!("one group each for dense and expert parameters")
            };
            [a, b]
        };
        self.optimizer_instances = Some(OptimizerInstances {
            instances,
            within: pair(within),
            across: pair(across),
        });
        Ok(self)
    }

    /// The distributed optimizer's instances, when there are several.
    pub fn optimizer_instances(&self) -> Option<&OptimizerInstances> {
        self.optimizer_instances.as_ref()
    }

    /// The context-parallel attention groups of `kind`; `None` without context parallelism.
    fn cp_groups(&self, world: &dyn World, kind: CpCommType) -> Result<Option<CpGroups>> {
        let Some(cp) = self.get(GroupKind::Cp).filter(|c| c.size() > 1) else {
            return Ok(None);
        };
        CpGroups::new(world, cp, kind)
            .map(Some)
            .map_err(|e| CommError::Invalid {
                group: "cp".into(),
                message: e.to_string(),
            })
    }

    /// The group whose ranks each hold a part of the same sequences' tokens: tensor-parallel
    /// with sequence parallelism, context-parallel with context parallelism, tensor×context
    /// with both (Megatron-LM's `tp_cp_group` of the routers' load counts); `None` when every
    /// token of a sequence is here.
    pub fn token_split(&self) -> Option<&dyn Communicator> {
        let cp = self.groups.config().cp > 1;
        match (self.sequence_parallel, cp) {
            (false, false) => None,
            (true, false) => Some(self.tp()),
            (false, true) => Some(self.comm(GroupKind::Cp)),
            (true, true) => Some(self.comm(GroupKind::TpCp)),
        }
    }

    /// The groups context-parallel attention exchanges keys and values over; `None` without
    /// context parallelism.
    pub fn context_parallel(&self) -> Option<&CpGroups> {
        self.context_parallel.as_ref()
    }

    /// The same state with sequence parallelism on or off (Megatron-LM's `--sequence-parallel`).
    /// With one tensor-parallel rank there is nothing to split: it stays off, as Megatron-LM
    /// turns it off.
    pub fn with_sequence_parallel(mut self, on: bool) -> ParallelState {
        self.sequence_parallel = on && self.groups.config().tp > 1;
        self
    }

    /// Whether the activations outside the tensor-parallel regions are split along the sequence
    /// over the tensor-parallel group (each rank holds `s / tp` positions of `[s, b, h]`).
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// The parallel state of a single rank (every group of size 1), for single-process use.
    pub fn solo() -> ParallelState {
        let layout = ParallelLayout::new(&crate::parallel::ParallelConfig::new(1))
            .expect("a world of one rank is a valid layout");
        ParallelState::new(&threads::ThreadWorld::solo(), &layout)
            .expect("a world of one rank has every group")
    }

    /// This rank's groups and coordinates.
    pub fn groups(&self) -> &RankGroups {
        &self.groups
    }

    /// The communicator of a family; `None` only for the embedding group of a middle stage.
    pub fn get(&self, kind: GroupKind) -> Option<&Arc<dyn Communicator>> {
        self.comms.iter().find(|(k, _)| *k == kind).map(|(_, c)| c)
    }

    /// The communicator of a family every rank belongs to (all but the embedding group).
    pub fn comm(&self, kind: GroupKind) -> &dyn Communicator {
        self.get(kind)
            .unwrap_or_else(|| panic!("rank {} has no {kind} group", self.groups.rank()))
            .as_ref()
    }

    /// The tensor-parallel communicator.
    pub fn tp(&self) -> &dyn Communicator {
        self.comm(GroupKind::Tp)
    }

    /// The data-parallel communicator: the group the dense gradients and the loss are summed
    /// over and the distributed optimizer shards over; with context parallelism the
    /// data×context-parallel group (Megatron-LM's `dp-cp`: its ranks hold the same parameters).
    pub fn dp(&self) -> &dyn Communicator {
        match self.groups.config().cp {
            1 => self.comm(GroupKind::Dp),
            _ => self.comm(GroupKind::DpCp),
        }
    }

    /// The pipeline communicator (activations and gradients between stages).
    pub fn pp(&self) -> &dyn Communicator {
        self.comm(GroupKind::Pp)
    }

    /// Counters of every group, by family name.
    pub fn stats(&self) -> Vec<(GroupKind, CommStats)> {
        self.comms.iter().map(|(k, c)| (*k, c.stats())).collect()
    }
}
