//! The in-process backend: a world of ranks as OS threads sharing memory.
//!
//! Collectives rendezvous in shared memory: every member publishes its buffers, the last to
//! arrive checks that all calls agree, and at most as many members as there are cores move the
//! data, each over a disjoint range, reading every input once and writing every output once.
//! Reductions run in rank order, so results are bit-identical from run to run.
//!
//! ```
//! use megatron_core::comm::threads::launch;
//! use megatron_core::comm::{ReduceOp, World};
//! use megatron_core::tensor::Tensor;
//!
//! let sums = launch(4, |world| {
//!     let all = world.communicator("world", &[0, 1, 2, 3])?;
//!     let t = Tensor::from_vec(vec![world.rank() as f32; 3], [3])?;
//!     all.all_reduce(&t, ReduceOp::Sum)?;
//!     Ok::<_, megatron_core::comm::CommError>(t.to_vec::<f32>()?)
//! })?;
//! assert_eq!(sums[2], vec![6.0; 3]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub(crate) mod affinity;
mod comm;
mod exec;
mod group;
mod world;

pub use comm::ThreadComm;
pub use world::{LaunchError, LaunchOptions, ThreadWorld, launch, launch_with};
