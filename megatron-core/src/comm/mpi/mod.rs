//! The MPI backend: one rank per process, several processes on one or many nodes, started by
//! `mpirun`/`srun`; the same [`Communicator`] contract as the thread backend.
//!
//! - Deterministic and backend-independent: reductions combine ranks' values in f32 in group-rank
//!   order, exactly as the thread backend does, so a run under `mpirun` gives bit-identical
//!   results to the same run with thread ranks.
//! - Safe: before moving data, members exchange what they are about to call (see
//!   `handshake`), so a mismatch is a [`CommError::Mismatch`] on every rank and a rank that
//!   never comes a [`CommError::Timeout`] naming it. A process that fails should call
//!   [`MpiWorld::abort`] so that every other process stops with it (`mpirun` then reports it).
//! - Counted like every backend, per group and operation.
//!
//! MPI is initialised (at `MPI_THREAD_SERIALIZED`) by [`MpiWorld::init`] and finalised when the
//! world and every communicator of it are dropped; a process holds one world in its life.

mod comm;
mod handshake;
mod raw;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use mpi::environment::Universe;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, Group as _};
use parking_lot::{Mutex, MutexGuard};

pub use comm::MpiComm;

use crate::comm::reduce::{BLOCK, Widen, fold_float, fold_i64};
use crate::comm::{CommError, Communicator, ReduceOp, Result, World};
use crate::tensor::DType;

/// The initialised library: the lock that serialises calls into it, and the universe whose
/// drop finalises it (after every communicator, which all hold this runtime).
pub(crate) struct Runtime {
    lock: Mutex<()>,
    _universe: Universe,
}

// SAFETY: the universe is only dropped (finalising MPI) and never used otherwise; calls into MPI
// are serialised by `lock`.
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

impl Runtime {
    /// Holds the MPI lock: every MPI call is made under it.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock()
    }
}

/// Settings of an MPI world.
#[derive(Debug, Clone)]
pub struct MpiOptions {
    /// How long a rank waits for the others at a collective before failing with
    /// [`CommError::Timeout`]. Default: [`crate::comm::default_timeout`].
    pub timeout: Duration,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions {
            timeout: crate::comm::default_timeout(),
        }
    }
}

/// The world communicator, usable from any thread under the MPI lock.
struct WorldComm(SimpleCommunicator);

// SAFETY: only used under the runtime's MPI lock.
unsafe impl Send for WorldComm {}
unsafe impl Sync for WorldComm {}

/// A group's identity: its family name and members.
type GroupKey = (String, Vec<usize>);

/// This process's entry into an MPI world.
pub struct MpiWorld {
    groups: Mutex<HashMap<GroupKey, Arc<MpiComm>>>,
    world: WorldComm,
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    timeout: Duration,
    runtime: Arc<Runtime>,
}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiWorld")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .finish_non_exhaustive()
    }
}

fn world_error(message: String) -> CommError {
    CommError::Invalid {
        group: "world".to_string(),
        message,
    }
}

impl MpiWorld {
    /// Initialises MPI with default options.
    pub fn init() -> Result<MpiWorld> {
        MpiWorld::init_with(&MpiOptions::default())
    }

    /// Initialises MPI: ranks and world size come from the launcher (`mpirun`, `srun`); a
    /// process started alone is a world of one. The calling thread's kernels get the cores of
    /// this node divided among its ranks.
    pub fn init_with(options: &MpiOptions) -> Result<MpiWorld> {
        if mpi::environment::is_initialized() {
            return Err(world_error(
                "MPI is already initialised in this process (a process holds one MpiWorld)"
                    .to_string(),
            ));
        }
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| world_error("MPI could not be initialised".to_string()))?;
        if !matches!(
            threading,
            mpi::Threading::Serialized | mpi::Threading::Multiple
        ) {
            return Err(world_error(format!(
                "the MPI library offers thread support {threading:?}; megatron-rs needs Serialized"
            )));
        }
        let world = universe.world();
        raw::errors_return(world.as_raw());
        let local = world.split_shared(0);
        let to_usize = |r: i32| usize::try_from(r).unwrap_or(0);
        let mpi_world = MpiWorld {
            groups: Mutex::new(HashMap::new()),
            rank: to_usize(world.rank()),
            size: to_usize(world.size()),
            local_rank: to_usize(local.rank()),
            local_size: to_usize(local.size()),
            world: WorldComm(world),
            timeout: options.timeout,
            runtime: Arc::new(Runtime {
                lock: Mutex::new(()),
                _universe: universe,
            }),
        };
        drop(local);
        crate::kernels::parallel::set_threads(crate::kernels::parallel::threads_per_rank(
            mpi_world.local_size,
        ));
        Ok(mpi_world)
    }

    /// How long a rank waits at a collective before failing.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// This process's rank among the processes of its node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of processes of the world on this node.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// Stops every process of the world with exit code `code` (after a rank failed: the others
    /// may be waiting in a collective for it).
    pub fn abort(&self, code: i32) -> ! {
        let _mpi = self.runtime.lock();
        self.world.0.abort(code)
    }
}

impl World for MpiWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    /// A communicator over `ranks`, created collectively by its members only
    /// (`MPI_Comm_create_group`): members must ask for their groups in the same order.
    fn communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<dyn Communicator>> {
        Ok(self.mpi_communicator(name, ranks)? as Arc<dyn Communicator>)
    }
}

impl MpiWorld {
    /// [`World::communicator`] with the concrete type (other backends build on its handshake).
    pub(crate) fn mpi_communicator(&self, name: &str, ranks: &[usize]) -> Result<Arc<MpiComm>> {
        let index = crate::comm::member_index(name, ranks, self.rank, self.size)?;
        let key = (name.to_string(), ranks.to_vec());
        let mut groups = self.groups.lock();
        if let Some(comm) = groups.get(&key) {
            return Ok(Arc::clone(comm));
        }
        let members: Vec<i32> = ranks
            .iter()
            .map(|&r| {
                i32::try_from(r).map_err(|_| world_error(format!("rank {r} exceeds MPI's ranks")))
            })
            .collect::<Result<_>>()?;
        let comm = {
            let _mpi = self.runtime.lock();
            let group = self.world.0.group().include(&members);
            self.world.0.split_by_subgroup(&group)
        }
        .ok_or_else(|| {
            world_error(format!(
                "MPI did not create group {name} {ranks:?} for rank {}",
                self.rank
            ))
        })?;
        if usize::try_from(comm.rank()).ok() != Some(index) {
            return Err(world_error(format!(
                "MPI placed rank {} at index {} of group {name}, expected {index}",
                self.rank,
                comm.rank()
            )));
        }
        let comm = Arc::new(MpiComm::new(
            comm,
            name,
            ranks,
            index,
            self.timeout,
            Arc::clone(&self.runtime),
        ));
        groups.insert(key, Arc::clone(&comm));
        Ok(comm)
    }
}

/// Reduces equal-length byte images of `dtype` elements (`sources`, one per rank, in rank
/// order) into `out`, exactly as the thread backend reduces.
fn reduce_bytes(dtype: DType, sources: &[&[u8]], out: &mut [u8], op: ReduceOp) {
    fn float<T: Widen + bytemuck::Pod>(sources: &[&[u8]], out: &mut [u8], op: ReduceOp) {
        let srcs: Vec<&[T]> = sources.iter().map(|b| bytemuck::cast_slice(b)).collect();
        let out: &mut [T] = bytemuck::cast_slice_mut(out);
        let (mut acc, mut tmp) = (vec![0f32; BLOCK], vec![0f32; BLOCK]);
        for at in (0..out.len()).step_by(BLOCK) {
            let n = BLOCK.min(out.len() - at);
            let block: Vec<&[T]> = srcs.iter().map(|s| &s[at..at + n]).collect();
            if fold_float(&block, &mut acc[..n], &mut tmp[..n], op) {
                T::narrow(&acc[..n], &mut out[at..at + n]);
            }
        }
    }
    match dtype {
        DType::F32 => float::<f32>(sources, out, op),
        DType::BF16 => float::<half::bf16>(sources, out, op),
        DType::F16 => float::<half::f16>(sources, out, op),
        DType::I64 => {
            let srcs: Vec<&[i64]> = sources.iter().map(|b| bytemuck::cast_slice(b)).collect();
            let out: &mut [i64] = bytemuck::cast_slice_mut(out);
            let mut acc = Vec::with_capacity(BLOCK);
            for at in (0..out.len()).step_by(BLOCK) {
                let n = BLOCK.min(out.len() - at);
                let block: Vec<&[i64]> = srcs.iter().map(|s| &s[at..at + n]).collect();
                fold_i64(&block, &mut acc, op);
                if acc.len() == n {
                    out[at..at + n].copy_from_slice(&acc);
                }
            }
        }
    }
}
