//! `--overlap-param-gather`: with the distributed optimizer, each bucket's all-gather of the
//! updated parameters starts after the optimizer step without waiting, and the next step waits
//! for a bucket only when it first reads one of its parameters (Megatron-LM's
//! `start_param_sync` after the step and the forward pre-hook's `finish_param_sync`, in
//! `distributed_data_parallel.py` and `param_and_grad_buffer.py`).
//!
//! Every read of a parameter's values goes through [`crate::module::Param::value`] or
//! [`crate::module::Param::compute_value`], which asks the [`ParamGather`] it is bound to; the
//! first read of a bucket waits for its all-gather and then converts the bucket's part of the
//! lower-precision compute copies (what [`super::gather_parameters`] does for the whole buffer).
//! The all-gathers are those [`super::gather_parameters`] runs, in the same order, so the values
//! are the same bits. The trainer waits for any bucket not read by the walk's end, and before a
//! checkpoint reads the buffers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Bucket, ParamBuffers, ReduceGroups};
use crate::comm::{Communicator, ParallelState, Pending};
use crate::error::{Error, Result};
use crate::module::Module;
use crate::tensor::Tensor;

/// Gathers each bucket's parameters after the optimizer step and lets the next step's first
/// read of a bucket wait for it (see the module's documentation).
pub struct ParamGather {
    values: Tensor,
    /// The lower-precision copies products read, when kept.
    compute: Option<Tensor>,
    buckets: Vec<Bucket>,
    /// The data-parallel group (dense buckets) and the expert data-parallel one.
    groups: [Arc<dyn Communicator>; 2],
    /// Each parameter slot's bucket.
    bucket_of: Vec<usize>,
    /// No gather is in flight: reads need not lock.
    settled: AtomicBool,
    state: Mutex<State>,
}

/// The gathers in flight.
struct State {
    /// Per bucket: its all-gather, until a read or the trainer waits for it.
    pending: Vec<Option<Pending>>,
    /// The first failed gather, reported by the trainer's next wait.
    failed: Option<Error>,
}

impl std::fmt::Debug for ParamGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParamGather({} buckets)", self.buckets.len())
    }
}

impl ParamGather {
    /// Gathers `buffers`' buckets over `parallel`'s data-parallel groups.
    pub fn new(buffers: &ParamBuffers, parallel: &ParallelState) -> Arc<ParamGather> {
        let buckets = buffers.buckets().to_vec();
        let bucket_of = buffers.bucket_of_slots();
        Arc::new(ParamGather {
            values: buffers.values().clone(),
            compute: buffers.compute_copies().cloned(),
            state: Mutex::new(State {
                pending: (0..buckets.len()).map(|_| None).collect(),
                failed: None,
            }),
            buckets,
            groups: ReduceGroups::shared(parallel),
            bucket_of,
            settled: AtomicBool::new(true),
        })
    }

    /// Binds every trainable parameter of `model` (packed into the buffers, in visit order):
    /// their reads ask here first.
    pub fn attach<M: Module>(self: &Arc<Self>, model: &mut M) -> Result<()> {
        let what = "overlapped parameter gather";
        super::buffers::for_each_slot(model, self.bucket_of.len(), what, |p, slot| {
            p.read_after(Arc::clone(self), slot)
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After the optimizer step: starts every bucket's all-gather of the shards the ranks
    /// updated, in buffer order, without waiting.
    pub fn start(&self) -> Result<()> {
        self.start_where(|_| true)
    }

    /// Starts the all-gathers of the buckets `chosen` picks, in buffer order, without waiting:
    /// once the ranks have updated their shards of them (the first model chunk's, with
    /// `--overlap-param-gather-with-optimizer-step`, before the others are).
    pub fn start_where(&self, chosen: impl Fn(&Bucket) -> bool) -> Result<()> {
        let mut state = self.state();
        for (b, bucket) in self.buckets.iter().enumerate() {
            if !chosen(bucket) {
                continue;
            }
            let group = self.groups[usize::from(bucket.expert)].as_ref();
            match bucket.shard(group.index()) {
                Some((shard, _)) if group.size() > 1 => {
                    let whole = self
                        .values
                        .narrow(0, bucket.range.start, bucket.range.len())?;
                    let mine = self.values.narrow(0, shard.start, shard.len())?;
                    state.pending[b] = Some(group.start_all_gather(&mine, &whole)?);
                    self.settled.store(false, Ordering::Release);
                }
                _ => self.refresh(b)?,
            }
        }
        Ok(())
    }

    /// Converts bucket `b`'s values into its part of the compute copies, if kept.
    fn refresh(&self, b: usize) -> Result<()> {
        if let Some(compute) = &self.compute {
            let range = &self.buckets[b].range;
            compute
                .narrow(0, range.start, range.len())?
                .copy_from(&self.values.narrow(0, range.start, range.len())?)?;
        }
        Ok(())
    }

    /// Waits for bucket `b`'s gather if it is in flight, and refreshes its compute copies.
    fn settle(&self, state: &mut State, b: usize) {
        let Some(pending) = state.pending[b].take() else {
            return;
        };
        let outcome = pending
            .wait()
            .map_err(Error::from)
            .and_then(|()| self.refresh(b));
        if let Err(e) = outcome {
            state.failed.get_or_insert(e);
        }
        if state.pending.iter().all(Option::is_none) {
            self.settled.store(true, Ordering::Release);
        }
    }

    /// Parameter `slot` is about to be read: its bucket's gather, if in flight, is waited for
    /// (a failure is kept for [`ParamGather::finish`]).
    pub(crate) fn before_read(&self, slot: usize) {
        if self.settled.load(Ordering::Acquire) {
            return;
        }
        let mut state = self.state();
        self.settle(&mut state, self.bucket_of[slot]);
    }

    /// Waits for every gather still in flight (in start order) and returns the first failure.
    pub fn finish(&self) -> Result<()> {
        let mut state = self.state();
        for b in 0..self.buckets.len() {
            self.settle(&mut state, b);
        }
        state.failed.take().map_or(Ok(()), Err)
    }
}

impl Drop for ParamGather {
    /// Waits for the gathers still in flight (the last step's, at the end of a run): a
    /// collective's tensors must outlive it, and on a GPU their memory is freed on the rank's
    /// stream, which only the wait orders after the collective.
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
