//! `optim_grads_params` (Megatron-FSDP's strategy of that name, ZeRO-3): each rank keeps only
//! its shard of every bucket's values ([`ParamBuffers::shard_values`]), and a bucket's whole
//! values exist only while a unit of gathering that reads them is gathered.
//!
//! The units are the model's own boundaries, in the code the macros generate: each module of a
//! stack (a `Vec` field the forward loops over, a transformer layer) is one, gathered by
//! `cx.unit(&self.blocks, i, next)` before its forward and again before its backward (and its
//! recomputed forward), and released when the guard it returns is dropped; `next` is the module
//! whose gather starts meanwhile (with `--overlap-param-gather`: the next module of the forward,
//! the previous one of the backward). Every other parameter (the embeddings, the final norm,
//! the output layer) is the model's root unit, which the trainer gathers for each walk of the
//! micro-batches ([`ParamUnits::gather_root`]), as FSDP2 keeps its root module gathered.
//!
//! A bucket is gathered (an all-gather of the ranks' shards over its group, then its compute
//! copies converted) when the first unit holding one of its parameters needs it, and evicted
//! when the last such unit is released: units that share a bucket count it. A read of a value
//! whose bucket is evicted is an error ([`crate::tensor::TensorError::Evicted`]), never zeros.
//! Every rank runs the same model code, so every rank of a group makes the same gathers in the
//! same order.

use std::sync::{Arc, Mutex, MutexGuard};

use super::{Bucket, ParamBuffers, ReduceGroups};
use crate::comm::{Communicator, ParallelState, Pending};
use crate::error::{Error, Result};
use crate::invalid;
use crate::module::{Module, Param};
use crate::tensor::Tensor;

/// The gatherer of sharded parameters' units (see the module's documentation).
pub struct ParamUnits {
    /// The rank's shards, laid out like the optimizer's moments.
    shards: Tensor,
    /// Per bucket: where its shard starts in `shards`, and its length.
    shard_at: Vec<(usize, usize)>,
    whole: Vec<Tensor>,
    compute: Option<Vec<Tensor>>,
    buckets: Vec<Bucket>,
    /// The data-parallel group (dense buckets) and the expert data-parallel one.
    groups: [Arc<dyn Communicator>; 2],
    /// Each parameter slot's bucket.
    bucket_of: Vec<usize>,
    /// Whether a unit's gather starts the next unit's (`--overlap-param-gather`).
    prefetch: bool,
    state: Mutex<State>,
}

/// The buckets' gathers.
struct State {
    /// The buckets holding a parameter outside every stack: the root unit.
    root: Vec<usize>,
    /// Per bucket: how many gathered units hold it.
    held: Vec<usize>,
    /// Per bucket: its prefetched all-gather, until a unit needs it.
    pending: Vec<Option<Pending>>,
    /// Bytes of whole values (and compute copies) resident now, and the most since the last
    /// [`ParamUnits::take_peak`].
    resident: usize,
    peak: usize,
}

impl std::fmt::Debug for ParamUnits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParamUnits({} buckets)", self.buckets.len())
    }
}

/// A gathered unit: its buckets are released when it is dropped.
#[must_use = "a unit stays gathered while its guard lives"]
pub struct Gathered<'a> {
    units: Option<&'a ParamUnits>,
    buckets: Vec<usize>,
}

impl Gathered<'_> {
    /// A guard holding nothing (parameters not sharded).
    pub fn none() -> Self {
        Gathered {
            units: None,
            buckets: Vec::new(),
        }
    }
}

impl Drop for Gathered<'_> {
    fn drop(&mut self) {
        if let Some(units) = self.units {
            units.release(&self.buckets);
        }
    }
}

impl ParamUnits {
    /// The gatherer of `buffers`' sharded values over `parallel`'s data-parallel groups;
    /// `prefetch`: a unit's gather starts the next one's.
    pub fn new(buffers: &ParamBuffers, parallel: &ParallelState, prefetch: bool) -> Result<Self> {
        Self::over(buffers, ReduceGroups::shared(parallel), prefetch)
    }

    /// The gatherer of `buffers`' sharded values over `groups` (dense, expert).
    fn over(
        buffers: &ParamBuffers,
        groups: [Arc<dyn Communicator>; 2],
        prefetch: bool,
    ) -> Result<Self> {
        let Some(sharded) = buffers.sharded_values() else {
            return invalid!("a gatherer of sharded parameters needs sharded values");
        };
        let n = buffers.buckets().len();
        Ok(ParamUnits {
            shards: sharded.shards.clone(),
            shard_at: sharded.at.iter().map(|(w, at)| (*at, w.len())).collect(),
            whole: sharded.whole.clone(),
            compute: sharded.compute.clone(),
            buckets: buffers.buckets().to_vec(),
            groups,
            bucket_of: buffers.bucket_of_slots(),
            prefetch,
            state: Mutex::new(State {
                root: Vec::new(),
                held: vec![0; n],
                pending: (0..n).map(|_| None).collect(),
                resident: 0,
                peak: 0,
            }),
        })
    }

    /// A gatherer of `buffers`' sharded values (rebound: moved, or given compute copies) over
    /// the same groups as this one.
    pub fn rebound(&self, buffers: &ParamBuffers) -> Result<ParamUnits> {
        Self::over(buffers, self.groups.clone(), self.prefetch)
    }

    /// Binds every trainable parameter of `chunks` (packed into the buffers, in visit order)
    /// to `units`, and finds the root unit: the buckets holding a parameter no stack holds.
    pub fn attach<M: Module>(units: &Arc<ParamUnits>, chunks: &mut [M]) -> Result<()> {
        let slots = units.bucket_of.len();
        let mut slot = 0;
        for chunk in chunks.iter_mut() {
            chunk.visit_params_mut(&mut |p| {
                if !p.is_frozen() {
                    p.gathered_by(Arc::clone(units), slot);
                    slot += 1;
                }
            });
        }
        if slot != slots {
            return invalid!(
                "sharded parameters: the model has {slot} trainable parameters but its buffers \
                 {slots}"
            );
        }
        let mut stacked = vec![false; slots];
        let mut numbered = 0;
        for chunk in chunks.iter() {
            chunk.visit_stacked_params(&mut numbered, &mut |p, _| {
                if let Some(s) = p.unit_slot(units) {
                    stacked[s] = true;
                }
            });
        }
        let mut root: Vec<usize> = (0..slots)
            .filter(|&s| !stacked[s])
            .map(|s| units.bucket_of[s])
            .collect();
        root.sort_unstable();
        root.dedup();
        units.state().root = root;
        Ok(())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The buckets holding the parameters `visit` visits (bound here), in bucket order.
    fn buckets_of(&self, visit: impl FnOnce(&mut dyn FnMut(&Param))) -> Vec<usize> {
        let mut buckets = Vec::new();
        visit(&mut |p| {
            if let Some(slot) = p.unit_slot(self) {
                buckets.push(self.bucket_of[slot]);
            }
        });
        buckets.sort_unstable();
        buckets.dedup();
        buckets
    }

    /// The root unit: every bucket holding a parameter outside the stacks, gathered until the
    /// guard is dropped (a walk of the micro-batches).
    pub fn gather_root(&self) -> Result<Gathered<'_>> {
        let root = self.state().root.clone();
        self.gather(root)
    }

    /// Gathers `module`'s unit (its parameters' buckets) until the guard is dropped, and with
    /// prefetch starts `next`'s gather.
    pub fn gather_module<M: Module>(&self, module: &M, next: Option<&M>) -> Result<Gathered<'_>> {
        let gathered = self.gather(self.buckets_of(|f| module.visit_params(f)))?;
        if let Some(next) = next.filter(|_| self.prefetch) {
            self.prefetch(&self.buckets_of(|f| next.visit_params(f)))?;
        }
        Ok(gathered)
    }

    /// Gathers `buckets` (waiting for those prefetched) and holds them.
    fn gather(&self, buckets: Vec<usize>) -> Result<Gathered<'_>> {
        let mut state = self.state();
        for (k, &b) in buckets.iter().enumerate() {
            // A bucket no unit holds is evicted, or its prefetched gather is in flight.
            let outcome = match state.held[b] {
                0 => match state.pending[b].take() {
                    Some(pending) => pending.wait().map_err(Error::from),
                    None => self.all_gather(&mut state, b),
                }
                .and_then(|()| self.convert(b)),
                _ => Ok(()),
            };
            if let Err(e) = outcome {
                drop(state);
                self.release(&buckets[..k]);
                return Err(e);
            }
            state.held[b] += 1;
        }
        Ok(Gathered {
            units: Some(self),
            buckets,
        })
    }

    /// Starts the all-gathers of the `buckets` neither held nor in flight, without waiting.
    fn prefetch(&self, buckets: &[usize]) -> Result<()> {
        let mut state = self.state();
        for &b in buckets {
            if state.held[b] > 0 || state.pending[b].is_some() {
                continue;
            }
            let (mine, whole) = self.restored(&mut state, b)?;
            let group = self.group(b);
            if group.size() > 1 {
                state.pending[b] = Some(group.start_all_gather(&mine, &whole)?);
            } else {
                whole.copy_from(&mine)?;
            }
        }
        Ok(())
    }

    /// Bucket `b`'s group: data parallelism, or expert data parallelism for experts.
    fn group(&self, b: usize) -> &dyn Communicator {
        self.groups[usize::from(self.buckets[b].expert)].as_ref()
    }

    /// Restores bucket `b`'s whole values (and compute copies): the rank's shard and the whole.
    fn restored(&self, state: &mut State, b: usize) -> Result<(Tensor, Tensor)> {
        let whole = &self.whole[b];
        let restore = |t: &Tensor, state: &mut State| -> Result<()> {
            if !t.storage().is_resident() {
                t.storage()
                    .restore()
                    .map_err(|e| crate::tensor::borrow_failed(e, "gather", true))?;
                state.resident += t.numel() * t.dtype().size();
                state.peak = state.peak.max(state.resident);
            }
            Ok(())
        };
        restore(whole, state)?;
        if let Some(compute) = &self.compute {
            restore(&compute[b], state)?;
        }
        let (at, len) = self.shard_at[b];
        Ok((self.shards.narrow(0, at, len)?, whole.clone()))
    }

    /// Gathers bucket `b` now: the ranks' shards all-gathered into its whole values.
    fn all_gather(&self, state: &mut State, b: usize) -> Result<()> {
        let (mine, whole) = self.restored(state, b)?;
        let group = self.group(b);
        if group.size() > 1 {
            group.all_gather(&mine, &whole)?;
        } else {
            whole.copy_from(&mine)?;
        }
        Ok(())
    }

    /// Converts bucket `b`'s whole values into its compute copies, when kept.
    fn convert(&self, b: usize) -> Result<()> {
        if let Some(compute) = &self.compute {
            compute[b].copy_from(&self.whole[b])?;
        }
        Ok(())
    }

    /// Releases one hold of each of `buckets`; a bucket no unit holds is evicted.
    fn release(&self, buckets: &[usize]) {
        let mut state = self.state();
        for &b in buckets {
            state.held[b] = state.held[b].saturating_sub(1);
            if state.held[b] == 0 {
                self.evict(&mut state, b);
            }
        }
    }

    /// Gives bucket `b`'s whole values (and compute copies) back.
    fn evict(&self, state: &mut State, b: usize) {
        let mut freed = 0;
        let mut evict = |t: &Tensor| {
            if t.storage().is_resident() && t.storage().evict() {
                freed += t.numel() * t.dtype().size();
            }
        };
        evict(&self.whole[b]);
        if let Some(compute) = &self.compute {
            evict(&compute[b]);
        }
        state.resident -= freed.min(state.resident);
    }

    /// The most bytes of whole values (and compute copies) resident at once since the last
    /// call; the count starts again from what is resident now.
    pub fn take_peak(&self) -> usize {
        let mut state = self.state();
        let peak = state.peak;
        state.peak = state.resident;
        peak
    }

    /// Waits for the prefetched gathers no unit took (a walk's last prefetch) and evicts
    /// their buckets, with the first failure.
    pub fn finish(&self) -> Result<()> {
        let mut failed = None;
        let mut state = self.state();
        for b in 0..self.buckets.len() {
            if let Some(pending) = state.pending[b].take() {
                if let Err(e) = pending.wait() {
                    failed.get_or_insert(Error::from(e));
                }
                if state.held[b] == 0 {
                    self.evict(&mut state, b);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

impl Drop for ParamUnits {
    /// Waits for prefetched gathers still in flight: a collective's tensors must outlive it.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for pending in state.pending.iter_mut() {
            if let Some(p) = pending.take() {
                let _ = p.wait();
            }
        }
    }
}
