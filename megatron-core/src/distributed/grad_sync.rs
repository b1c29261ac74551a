//! `--overlap-grad-reduce`: each bucket's data-parallel reduction started as soon as every
//! gradient in it is final, while the backward goes on (Megatron-LM's
//! `_ParamAndGradBucketGroup.register_grad_ready` and `start_grad_sync`, in
//! `param_and_grad_buffer.py`), and waited for after the walk (`finish_grad_sync`).
//!
//! **When a gradient is final.** Every write of a parameter's gradient goes through
//! [`crate::module::Param::accumulate_grad`] (or the MoE kernels' host path), which tells the
//! [`GradSync`] its parameter is bound to. A parameter may be written several times in a step:
//! once per micro-batch, twice when a table is tied at both ends or shared by multi-token
//! prediction's depths, in a W pass of a zero-bubble schedule after its B pass. The first step
//! learns how many writes each parameter gets (Megatron-LM's `golden_per_param_grad_ready_counts`)
//! and reduces at the end, as without overlap; from the second on, a parameter's gradient is
//! final at its learned count of writes, and a bucket once all of its parameters' are. This
//! covers pipelines (the last micro-batch's backward of each chunk) and the zero-bubble
//! schedules (the bucket's last W pass) without asking the schedule. A write past the learned
//! count is an error naming the parameter, never a reduction of a gradient still changing.
//!
//! **The same reductions in the same order.** A bucket is reduced exactly as
//! [`super::reduce_gradients`] reduces it (an all-reduce, or the distributed optimizer's
//! reduce-scatter, over dp or edp), so the sums are bit for bit those of a run without overlap.
//! Every rank of a group must start the group's collectives in one order: the dense buckets
//! start in a fixed order over the data-parallel group and the experts' over the expert
//! data-parallel group, the model chunks last to first (the backward's order) and each chunk's
//! buckets in buffer order (the front holds the last layers); a bucket whose gradients are final
//! before those ahead of it waits for them. The buckets holding the parameters both ends of a
//! pipeline share (the tied embedding) start only after the walk, once their gradients were
//! summed over the embedding group ([`super::sum_shared_gradients`]), as without overlap.
//!
//! **Sharded gradients** (`optim_grads`, Megatron-FSDP's ZeRO-2: [`GradSync::sharded`]). Each
//! bucket's whole gradients live in a storage of their own
//! ([`ParamBuffers::shard_gradients`]) and are reduce-scattered once per micro-batch, as
//! Megatron-FSDP does, into the rank's shard of the f32 main gradients (the first reduction of
//! a step copied there, the later ones added), then released: the next micro-batch's first
//! write allocates them again, zeroed. A bucket's reductions go in rounds, one per micro-batch:
//! the bucket at the head of its group's fixed order is reduced for round `k` once each of its
//! parameters has had `k` micro-batches' writes (its learned writes per step over the
//! micro-batches), and the order goes round again. The first step learns and reduces each
//! bucket once, after the walk. With `--overlap-grad-reduce` a reduction runs while the
//! backward goes on (at most [`IN_FLIGHT`] at once) and is waited for before the bucket's next
//! write; without, at once. The sums are the same as without sharding up to their order: the
//! same bit for bit at one micro-batch.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Bucket, ParamBuffers, ReduceGroups};
use crate::comm::{Communicator, ParallelState, Pending, ReduceOp};
use crate::error::Result;
use crate::invalid;
use crate::module::Module;
use crate::tensor::Tensor;

/// Starts each gradient bucket's reduction once its gradients are final (see the module's
/// documentation); the trainer begins and finishes it around every step's walk.
pub struct GradSync {
    /// The flat gradients the buckets cut.
    grads: Tensor,
    buckets: Vec<Bucket>,
    /// The data-parallel group (dense buckets) and the expert data-parallel one.
    groups: [Arc<dyn Communicator>; 2],
    /// With several distributed-optimizer instances, the dense and expert groups across them.
    across: Option<[Arc<dyn Communicator>; 2]>,
    /// Each parameter slot's bucket.
    bucket_of: Vec<usize>,
    /// Each parameter slot's name, for errors.
    names: Vec<String>,
    /// Per group (dense, expert): the buckets started during the backward, in start order.
    order: [Vec<usize>; 2],
    /// Per group: the buckets of shared parameters, started after the walk, in order.
    held: [Vec<usize>; 2],
    /// With sharded gradients, where each bucket's reductions go.
    sharded: Option<Sharded>,
    state: Mutex<State>,
}

/// The reductions started ahead of the backward that may be in flight at once with sharded
/// gradients and `--overlap-grad-reduce` (each holds its bucket's whole gradients).
pub const IN_FLIGHT: usize = 2;

/// With sharded gradients (`optim_grads`): each bucket's whole gradients, reduced once per
/// micro-batch into the rank's shard of the f32 main gradients and released after.
struct Sharded {
    /// Each bucket's whole gradients, in a storage of its own.
    whole: Vec<Tensor>,
    /// The f32 main gradients, laid out like the optimizer's moments.
    main: Tensor,
    /// Each bucket's shard in `main`.
    in_main: Vec<Range<usize>>,
    /// The micro-batches of a step: how often a step reduces each bucket.
    microbatches: u32,
    /// Whether a reduction runs while the backward goes on (`--overlap-grad-reduce`).
    overlap: bool,
}

/// A started reduction of a bucket's whole gradients into a shard-sized tensor.
struct InFlight {
    bucket: usize,
    pending: Pending,
    shard: Tensor,
}

/// What changes within a step.
struct State {
    /// Between [`GradSync::begin_step`] and [`GradSync::finish`].
    active: bool,
    /// Writes per slot a step makes, learned at the first step.
    learned: Option<Vec<u32>>,
    /// Writes per slot so far this step.
    writes: Vec<u32>,
    /// Per bucket: its slots whose gradients are not final yet.
    left: Vec<usize>,
    /// Per group: the position in `order` of the next bucket to start.
    next: [usize; 2],
    /// Per bucket: its reduction was started.
    started: Vec<bool>,
    /// The started reductions, in start order.
    pending: Vec<Pending>,
    /// Sharded gradients: the writes per micro-batch of each slot, known from the second step.
    per_microbatch: Option<Vec<u32>>,
    /// Sharded gradients: each bucket's reductions started this step.
    rounds: Vec<u32>,
    /// Sharded gradients: per group, the round its order is in.
    round: [u32; 2],
    /// Sharded gradients: whether each bucket's shard of the main gradients was written this
    /// step (the first reduction copies, the later ones add).
    landed: Vec<bool>,
    /// Sharded gradients: the reductions started and not yet waited for, in start order.
    in_flight: Vec<InFlight>,
    /// Sharded gradients: the buckets whose whole gradients are allocated now, their bytes,
    /// and the most bytes at once this step.
    resident: Vec<bool>,
    resident_bytes: usize,
    peak_bytes: usize,
}

impl std::fmt::Debug for GradSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GradSync({} buckets)", self.buckets.len())
    }
}

impl GradSync {
    /// Reduces `buffers`' buckets over `parallel`'s data-parallel groups; `held` are the slots
    /// of parameters both ends of a pipeline hold, whose buckets start after the walk.
    pub fn new(buffers: &ParamBuffers, parallel: &ParallelState, held: &[usize]) -> Arc<GradSync> {
        let buckets = buffers.buckets().to_vec();
        let slots = buffers.slots().len();
        let bucket_of = buffers.bucket_of_slots();
        let names = buffers
            .slots()
            .iter()
            .map(|s| s.spec.name.clone())
            .collect();
        let groups = ReduceGroups::shared(parallel);
        let across = ReduceGroups::shared_across(parallel);
        // Chunks last to first, each chunk's buckets in buffer order.
        let mut by_chunk: Vec<(usize, usize)> = buckets
            .iter()
            .enumerate()
            .map(|(b, bucket)| (bucket.chunk(), b))
            .collect();
        by_chunk.sort_by_key(|&(chunk, b)| (std::cmp::Reverse(chunk), b));
        let is_held = |b: usize| buckets[b].slots.iter().any(|s| held.contains(s));
        let (mut order, mut held_order): ([Vec<usize>; 2], [Vec<usize>; 2]) = Default::default();
        for (_, b) in by_chunk {
            let g = usize::from(buckets[b].expert);
            match is_held(b) {
                true => held_order[g].push(b),
                false => order[g].push(b),
            }
        }
        Arc::new(GradSync {
            grads: buffers.grads().clone(),
            state: Mutex::new(State {
                active: false,
                learned: None,
                writes: vec![0; slots],
                left: vec![0; buckets.len()],
                next: [0; 2],
                started: vec![false; buckets.len()],
                pending: Vec::new(),
                per_microbatch: None,
                rounds: vec![0; buckets.len()],
                round: [0; 2],
                landed: vec![false; buckets.len()],
                in_flight: Vec::new(),
                resident: vec![false; buckets.len()],
                resident_bytes: 0,
                peak_bytes: 0,
            }),
            buckets,
            groups,
            across,
            bucket_of,
            names,
            order,
            held: held_order,
            sharded: None,
        })
    }

    /// Reduces `buffers`' buckets with sharded gradients (`optim_grads`: see the module's
    /// documentation): each bucket once per micro-batch of a step of `microbatches`, into its
    /// shard of `optimizer`'s main gradients, overlapped with the backward when `overlap`.
    /// The buffers must have given each bucket its own gradients
    /// ([`ParamBuffers::shard_gradients`]) and the optimizer must keep the shards
    /// ([`crate::optimizer::AdamW::keep_sharded_grads`]).
    pub fn sharded(
        buffers: &ParamBuffers,
        optimizer: &crate::optimizer::AdamW,
        parallel: &ParallelState,
        held: &[usize],
        microbatches: usize,
        overlap: bool,
    ) -> Result<Arc<GradSync>> {
        let (Some(whole), Some(main), true) = (
            buffers.bucket_grads(),
            optimizer.main_grads(),
            optimizer.grads_sharded(),
        ) else {
            return invalid!(
                "sharded gradients need the buckets' own gradients and the optimizer's shards \
                 of them (ParamBuffers::shard_gradients, AdamW::keep_sharded_grads)"
            );
        };
        let groups = ReduceGroups::shared(parallel);
        let in_main = buffers
            .buckets()
            .iter()
            .map(|bucket| {
                let group = &groups[usize::from(bucket.expert)];
                match bucket.shard(group.index()) {
                    Some((shard, _)) => Ok(optimizer.to_moments(buffers, &shard)),
                    None => invalid!("sharded gradients: a bucket without shards"),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let mut sync = Arc::into_inner(GradSync::new(buffers, parallel, held))
            .expect("a reducer just made has one owner");
        sync.sharded = Some(Sharded {
            whole: whole.to_vec(),
            main: main.clone(),
            in_main,
            microbatches: u32::try_from(microbatches.max(1)).unwrap_or(u32::MAX),
            overlap,
        });
        Ok(Arc::new(sync))
    }

    /// Binds every trainable parameter of `chunks` (the model the buffers were packed from, in
    /// the same visit order) to this reducer: their gradient writes report here.
    pub fn attach<M: Module>(self: &Arc<Self>, chunks: &mut M) -> Result<()> {
        let what = "overlapped gradient reduction";
        super::buffers::for_each_slot(chunks, self.names.len(), what, |p, slot| {
            p.report_writes_to(Arc::clone(self), slot)
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts counting a step's gradient writes (the gradients are zero): from the second step
    /// on, buckets start as their gradients become final.
    pub fn begin_step(&self) -> Result<()> {
        let mut state = self.state();
        if state.active || !state.pending.is_empty() {
            return invalid!(
                "overlapped gradient reduction: a step began before the last finished"
            );
        }
        state.active = true;
        state.writes.fill(0);
        state.started.fill(false);
        state.next = [0; 2];
        state.left.fill(0);
        if self.sharded.is_some() {
            if !state.in_flight.is_empty() {
                return invalid!(
                    "sharded gradients: a step began with reductions of the last in flight"
                );
            }
            state.rounds.fill(0);
            state.round = [0; 2];
            state.landed.fill(false);
            state.peak_bytes = state.resident_bytes;
            return self.advance(&mut state, false);
        }
        if let Some(learned) = state.learned.clone() {
            for (slot, &n) in learned.iter().enumerate() {
                if n > 0 {
                    state.left[self.bucket_of[slot]] += 1;
                }
            }
            // Buckets no parameter of which is written this step are final already.
            self.start_ready(&mut state)?;
        }
        Ok(())
    }

    /// Parameter `slot`'s gradient was written once more.
    pub(crate) fn written(&self, slot: usize) -> Result<()> {
        let mut state = self.state();
        if !state.active {
            return Ok(());
        }
        state.writes[slot] += 1;
        if let Some(sharded) = &self.sharded {
            let b = self.bucket_of[slot];
            if !state.resident[b] {
                state.resident[b] = true;
                state.resident_bytes += byte_size(&sharded.whole[b]);
                state.peak_bytes = state.peak_bytes.max(state.resident_bytes);
            }
        }
        let Some(learned) = &state.learned else {
            return Ok(());
        };
        let (n, expected) = (state.writes[slot], learned[slot]);
        if n > expected {
            return invalid!(
                "overlapped gradient reduction: the gradient of {} was written {n} times this \
                 step, but {expected} times in the first; its bucket's reduction may have started \
                 (a model whose writes per step change cannot overlap its reduction: drop \
                 --overlap-grad-reduce)",
                self.names[slot]
            );
        }
        if self.sharded.is_some() {
            return self.advance(&mut state, false);
        }
        if n == expected {
            let b = self.bucket_of[slot];
            state.left[b] -= 1;
            if state.left[b] == 0 {
                self.start_ready(&mut state)?;
            }
        }
        Ok(())
    }

    /// Starts, per group and in order, the buckets whose gradients are all final.
    fn start_ready(&self, state: &mut State) -> Result<()> {
        for g in 0..2 {
            while let Some(&b) = self.order[g].get(state.next[g]) {
                if state.left[b] > 0 {
                    break;
                }
                self.start(state, b)?;
                state.next[g] += 1;
            }
        }
        Ok(())
    }

    /// Starts bucket `b`'s reduction as [`super::reduce_gradients`] runs it.
    fn start(&self, state: &mut State, b: usize) -> Result<()> {
        let bucket = &self.buckets[b];
        state.started[b] = true;
        let group = self.groups[usize::from(bucket.expert)].as_ref();
        if group.size() == 1 {
            return Ok(());
        }
        let whole = self
            .grads
            .narrow(0, bucket.range.start, bucket.range.len())?;
        let pending = match bucket.shard(group.index()) {
            Some((shard, _)) => {
                let mine = self.grads.narrow(0, shard.start, shard.len())?;
                group.start_reduce_scatter(&whole, &mine, ReduceOp::Sum)?
            }
            None => group.start_all_reduce(&whole, ReduceOp::Sum)?,
        };
        state.pending.push(pending);
        Ok(())
    }

    /// With several distributed-optimizer instances: all-reduces each bucket's shard, reduced
    /// within the instance, across the instances (`shard_of(g, b)`: bucket `b` of group `g`'s
    /// shard, if it has one). Started per group in the group's start order (the same on every
    /// rank) and then waited for, so the dense and expert groups' calls never wait for each
    /// other.
    fn reduce_across(
        &self,
        shard_of: impl Fn(usize, usize) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        let Some(across) = &self.across else {
            return Ok(());
        };
        let mut pending = Vec::new();
        for g in 0..2 {
            let across = across[g].as_ref();
            if across.size() == 1 {
                continue;
            }
            for &b in self.order[g].iter().chain(&self.held[g]) {
                if let Some(mine) = shard_of(g, b)? {
                    pending.push(across.start_all_reduce(&mine, ReduceOp::Sum)?);
                }
            }
        }
        let mut first_error = None;
        for p in pending {
            if let Err(e) = p.wait() {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), |e| Err(e.into()))
    }

    /// After the walk (and the shared parameters' sum): starts what has not started, in order
    /// (every bucket at the first step, which learns the writes per parameter), then the
    /// shared parameters' buckets, and waits for every reduction. Returns how many buckets had
    /// started during the walk, and of how many.
    pub fn finish(&self) -> Result<(usize, usize)> {
        if let Some(sharded) = &self.sharded {
            return self.finish_sharded(sharded);
        }
        let mut state = self.state();
        state.active = false;
        let early = state.started.iter().filter(|&&s| s).count();
        if state.learned.is_none() {
            state.learned = Some(state.writes.clone());
        }
        for g in 0..2 {
            let rest = self.order[g][state.next[g]..].iter();
            for &b in rest.chain(&self.held[g]) {
                self.start(&mut state, b)?;
            }
        }
        let mut first_error = None;
        for pending in std::mem::take(&mut state.pending) {
            if let Err(e) = pending.wait() {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e.into());
        }
        self.reduce_across(|g, b| {
            let within = self.groups[g].index();
            self.buckets[b]
                .shard(within)
                .map(|(shard, _)| Ok(self.grads.narrow(0, shard.start, shard.len())?))
                .transpose()
        })?;
        Ok((early, self.buckets.len()))
    }
}

impl Drop for GradSync {
    /// Waits for the reductions still in flight (a step that failed midway leaves some): a
    /// collective's tensors must outlive it, and on a GPU their memory is freed on the rank's
    /// stream, which only the wait orders after the collective.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for pending in state.pending.drain(..) {
            let _ = pending.wait();
        }
        for in_flight in state.in_flight.drain(..) {
            let _ = in_flight.pending.wait();
        }
    }
}

/// The bytes of `t`'s elements.
fn byte_size(t: &Tensor) -> usize {
    t.numel() * t.dtype().size()
}

/// Sharded gradients (`optim_grads`).
impl GradSync {
    /// Before a write of parameter `slot`'s gradient: waits for a reduction of its bucket
    /// still in flight (it reads the whole gradients the write would change), and for those
    /// started before it.
    pub(crate) fn before_write(&self, slot: usize) -> Result<()> {
        let Some(sharded) = &self.sharded else {
            return Ok(());
        };
        let mut state = self.state();
        let b = self.bucket_of[slot];
        if let Some(i) = state.in_flight.iter().position(|f| f.bucket == b) {
            self.settle(sharded, &mut state, i + 1)?;
        }
        Ok(())
    }

    /// The most bytes of whole bucket gradients allocated at once in the last step (or this
    /// one so far), with sharded gradients.
    pub fn peak_whole_bytes(&self) -> usize {
        self.state().peak_bytes
    }

    /// Whether bucket `b`'s next reduction may start: each of its parameters has had as many
    /// micro-batches' writes as the bucket will have had reductions.
    fn ready(&self, state: &State, b: usize) -> bool {
        let Some(per_microbatch) = &state.per_microbatch else {
            return false;
        };
        let k = state.rounds[b] + 1;
        self.buckets[b]
            .slots
            .iter()
            .all(|&s| state.writes[s] >= k.saturating_mul(per_microbatch[s]))
    }

    /// Starts, per group, the reductions due in the group's order and round: those whose
    /// gradients are ready, or (`all`, after the walk) every one left in the step's rounds.
    fn advance(&self, state: &mut State, all: bool) -> Result<()> {
        let Some(sharded) = &self.sharded else {
            return Ok(());
        };
        for g in 0..2 {
            while state.round[g] < sharded.microbatches {
                let Some(&b) = self.order[g].get(state.next[g]) else {
                    break;
                };
                if !all && !self.ready(state, b) {
                    break;
                }
                self.start_shard(sharded, state, b)?;
                self.next_in_order(state, g);
            }
        }
        Ok(())
    }

    /// Moves group `g`'s place in its order on, to the next round after its last bucket.
    fn next_in_order(&self, state: &mut State, g: usize) {
        state.next[g] += 1;
        if state.next[g] == self.order[g].len() {
            state.next[g] = 0;
            state.round[g] += 1;
        }
    }

    /// Starts bucket `b`'s reduce-scatter into a shard-sized tensor (a copy when its group
    /// has one rank), after any of its reductions still in flight; during the walk, waits for
    /// it at once without overlap, else for the oldest beyond [`IN_FLIGHT`].
    fn start_shard(&self, sharded: &Sharded, state: &mut State, b: usize) -> Result<()> {
        if let Some(i) = state.in_flight.iter().position(|f| f.bucket == b) {
            self.settle(sharded, state, i + 1)?;
        }
        let group = self.groups[usize::from(self.buckets[b].expert)].as_ref();
        let whole = &sharded.whole[b];
        let shard = Tensor::empty_near([sharded.in_main[b].len()], whole.dtype(), whole)?;
        let pending = match group.size() {
            1 => {
                let begun = std::time::Instant::now();
                Pending::ran(Ok(shard.copy_from(whole)?), begun)
            }
            _ => group.start_reduce_scatter(whole, &shard, ReduceOp::Sum)?,
        };
        state.rounds[b] += 1;
        state.started[b] = true;
        state.in_flight.push(InFlight {
            bucket: b,
            pending,
            shard,
        });
        // After the walk nothing is left to overlap: every reduction may be in flight.
        let keep = match (state.active, sharded.overlap) {
            (false, _) => usize::MAX,
            (true, true) => IN_FLIGHT,
            (true, false) => 0,
        };
        let over = state.in_flight.len().saturating_sub(keep);
        self.settle(sharded, state, over)
    }

    /// Waits for the first `count` reductions in flight, in start order: adds each shard into
    /// the main gradients (copies it, at the bucket's first of the step) and releases the
    /// bucket's whole gradients. Every one is waited for, the first error returned.
    fn settle(&self, sharded: &Sharded, state: &mut State, count: usize) -> Result<()> {
        let mut first_error = None;
        for InFlight {
            bucket,
            pending,
            shard,
        } in state.in_flight.drain(..count).collect::<Vec<_>>()
        {
            let landed = (|| -> Result<()> {
                pending.wait()?;
                let range = &sharded.in_main[bucket];
                let main = sharded.main.narrow(0, range.start, range.len())?;
                if state.landed[bucket] {
                    let shard = shard.to_dtype(main.dtype())?;
                    main.copy_from(&crate::ops::add(&main, &shard)?)?;
                } else {
                    main.copy_from(&shard)?;
                }
                state.landed[bucket] = true;
                if !sharded.whole[bucket].storage().release() {
                    return invalid!(
                        "sharded gradients: bucket {bucket}'s whole gradients are still borrowed \
                         after its reduction"
                    );
                }
                if std::mem::take(&mut state.resident[bucket]) {
                    state.resident_bytes -= byte_size(&sharded.whole[bucket]);
                }
                Ok(())
            })();
            if let Err(e) = landed {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// [`GradSync::finish`] with sharded gradients: the rounds left (at the first step, one
    /// reduction of every bucket, after which the writes per micro-batch are known), the shared
    /// parameters' buckets, every reduction waited for, then the shards all-reduced across
    /// distributed-optimizer instances.
    fn finish_sharded(&self, sharded: &Sharded) -> Result<(usize, usize)> {
        let mut state = self.state();
        state.active = false;
        let early = state.started.iter().filter(|&&s| s).count();
        let learning = state.learned.is_none();
        let mut outcome = (|| -> Result<()> {
            if learning {
                for g in 0..2 {
                    for &b in &self.order[g] {
                        self.start_shard(sharded, &mut state, b)?;
                    }
                }
            } else {
                self.advance(&mut state, true)?;
            }
            for g in 0..2 {
                for &b in &self.held[g] {
                    self.start_shard(sharded, &mut state, b)?;
                }
            }
            Ok(())
        })();
        let all = state.in_flight.len();
        if let Err(e) = self.settle(sharded, &mut state, all)
            && outcome.is_ok()
        {
            outcome = Err(e);
        }
        outcome?;
        if learning {
            let writes = state.writes.clone();
            state.per_microbatch = Some(self.per_microbatch(&writes, sharded.microbatches)?);
            state.learned = Some(writes);
        }
        self.reduce_across(|_, b| {
            let range = &sharded.in_main[b];
            Ok(Some(sharded.main.narrow(0, range.start, range.len())?))
        })?;
        Ok((early, self.buckets.len()))
    }

    /// Each slot's writes per micro-batch from its writes in a step of `microbatches`: a
    /// parameter written a number of times that does not divide into them is named.
    fn per_microbatch(&self, writes: &[u32], microbatches: u32) -> Result<Vec<u32>> {
        writes
            .iter()
            .enumerate()
            .map(|(slot, &n)| match n % microbatches {
                0 => Ok(n / microbatches),
                _ => invalid!(
                    "sharded gradients (optim_grads) reduce each micro-batch's gradients: the \
                     gradient of {} was written {n} times in a step of {microbatches} \
                     micro-batches, not the same number of times in each",
                    self.names[slot]
                ),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::PackLayout;
    use crate::module::{Builder, Param};
    use crate::tensor_parallel::{Linear, LinearSpec};

    /// Writes `param`'s gradient once (adding nothing).
    fn write(param: &Param) -> Result<()> {
        param.accumulate_grad(|_| Ok(()))
    }

    #[test]
    fn a_bucket_starts_at_its_last_learned_write_and_an_extra_write_is_named() -> Result<()> {
        let mut linear = Linear::build(&LinearSpec::new(4, 3), &mut Builder::new(1))?;
        let buffers = ParamBuffers::pack(&mut linear, &PackLayout::plain())?;
        let sync = GradSync::new(&buffers, &ParallelState::solo(), &[]);
        sync.attach(&mut linear)?;
        let mut params = Vec::new();
        linear.visit_params(&mut |p| params.push(p.clone()));
        let [weight, bias] = &params[..] else {
            panic!("a linear layer's weight and bias: {params:?}")
        };
        // The first step learns: the weight written twice, the bias once; it reduces after.
        sync.begin_step()?;
        for p in [weight, weight, bias] {
            write(p)?;
        }
        assert_eq!(sync.finish()?, (0, 1));
        // The second starts the one bucket at the last of those writes, whatever their order.
        sync.begin_step()?;
        for p in [weight, bias] {
            write(p)?;
        }
        assert!(!sync.state().started[0]);
        write(weight)?;
        assert!(sync.state().started[0]);
        assert_eq!(sync.finish()?, (1, 1));
        // A write past the learned count is an error naming the parameter.
        sync.begin_step()?;
        write(weight)?;
        write(weight)?;
        let err = write(weight).unwrap_err().to_string();
        assert!(err.contains(&weight.spec().name), "{err}");
        assert!(
            err.contains("written 3 times this step, but 2 times"),
            "{err}"
        );
        Ok(())
    }
}
