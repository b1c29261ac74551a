//! The step engine: every training step and every evaluation walks one rank's
//! [plan](crate::pipeline_parallel::plan) of Megatron-LM's schedule. Without a pipeline the plan
//! is a one-stage schedule's (each microbatch forward, then backward: gradient accumulation);
//! with one, the rank's passes in the schedule's order with the batched exchanges between
//! them; an evaluation is the forward-only schedule's plan. One walker runs them all, so the
//! loss sum, the microbatch contexts and the data are written once.
//!
//! What differs is how a chunk runs a microbatch's passes ([`Passes`]): the whole model
//! ([`Whole`]: a [`LanguageModel`]'s losses and their backward), or a pipeline stage's parts
//! (`pipeline::Stages`).
//!
//! A zero-bubble schedule's backward pass runs with the weight gradients put off
//! ([`Cx::deferring_weights`]): the walker keeps each (chunk, microbatch)'s until the plan's
//! weight-gradient pass runs them, counts the bytes they hold meanwhile, and refuses to end a
//! walk (and so to reach the optimizer step) with any left.

use std::collections::HashMap;
use std::sync::Arc;

use super::masks::{Microbatch, token_weight};
use super::{LanguageModel, Sampler};
use crate::comm::ParallelState;
use crate::context_parallel::CpChunks;
use crate::cuda_graphs::SlotAllocator;
use crate::documents::Documents;
use crate::error::{Error, Result};
use crate::invalid;
use crate::module::{Cx, DeferredWeights, Ids, WeightGrad};
use crate::pipeline_parallel::{
    Action, Delivery, Pass, Schedule, ScheduleConfig, Stage, Transfer, execute, plan,
};
use crate::tensor::{DType, Shape, Tensor};

/// What a walk is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Forward and backward, at this step (dropout as training).
    Train { step: u64 },
    /// Forwards only, nothing kept, no dropout.
    Eval,
}

/// How one chunk runs a microbatch's passes.
pub(super) trait Passes<M> {
    /// What a microbatch's forward through a chunk keeps for its backward.
    type Kept;

    /// Whether `model` holds the first stage's part (it reads token ids) and the last's (it
    /// computes the losses).
    fn ends(model: &M) -> (bool, bool);

    /// The width of the value a stage passes to the next (`[s, b, width]`; unused with one
    /// stage).
    fn carried_width(model: &M) -> usize;

    /// Runs the forward from `tokens` (the first stage) or `h` (the previous stage's value) to
    /// the per-token losses when `targets` are given (the last stage), else to the value for
    /// the next stage.
    fn forward(
        model: &M,
        cx: &Cx,
        tokens: Option<&Ids>,
        h: Option<Tensor>,
        targets: Option<&Ids>,
    ) -> Result<(Tensor, Self::Kept)>;

    /// Runs the backward from `d`, the gradient of what the forward returned: the gradient of
    /// the stage's input for the previous stage, or `None` on the first.
    fn backward(model: &M, cx: &Cx, kept: Self::Kept, d: &Tensor) -> Result<Option<Tensor>>;

    /// After a training walk: sums what the chunks' stages share (the tied embedding's two
    /// copies), when `shared` says to.
    fn after_backward(chunks: &[M], parallel: &ParallelState, shared: bool) -> Result<()>;
}

/// The whole model as one stage: its losses, and their backward.
pub(super) struct Whole;

impl<M: LanguageModel> Passes<M> for Whole {
    type Kept = M::Saved;

    fn ends(_: &M) -> (bool, bool) {
        (true, true)
    }

    fn carried_width(_: &M) -> usize {
        0
    }

    fn forward(
        model: &M,
        cx: &Cx,
        tokens: Option<&Ids>,
        _h: Option<Tensor>,
        targets: Option<&Ids>,
    ) -> Result<(Tensor, M::Saved)> {
        match (tokens, targets) {
            (Some(tokens), Some(targets)) => model.losses(cx, tokens, targets),
            _ => invalid!("a one-stage walk reads its tokens and targets"),
        }
    }

    fn backward(model: &M, cx: &Cx, kept: M::Saved, d: &Tensor) -> Result<Option<Tensor>> {
        model.backward_losses(cx, kept, d)?;
        Ok(None)
    }

    fn after_backward(_: &[M], _: &ParallelState, _: bool) -> Result<()> {
        Ok(())
    }
}

/// One batch's walk: the rank's chunks, the data, and the context its microbatches run in.
pub(super) struct Walk<'a, M> {
    pub chunks: &'a [M],
    pub parallel: &'a ParallelState,
    pub data: &'a Sampler,
    pub batch: u64,
    pub mode: Mode,
    /// The context every microbatch's is made from (placed at its step and microbatch).
    pub cx: Cx<'a>,
    /// The loss the backward starts from is the mean loss times this.
    pub loss_scale: f32,
    /// A tensor on the rank's device, where the walk's buffers go.
    pub like: &'a Tensor,
    /// Sum the tied copies' gradients over the embedding group.
    pub sync_shared: bool,
}

/// What a walk did: the sum of the per-token losses this rank computed (the last stage's; 0
/// elsewhere), read once at the end, the seconds it waited for other stages, and the most bytes
/// its put-off weight gradients held at once.
pub(super) struct Walked {
    pub loss_sum: f64,
    pub waited: f64,
    pub deferred_peak: u64,
    /// Seconds in forwards, backwards and weight-gradient passes, and in the whole walk.
    pub pass_seconds: [f64; 3],
    pub seconds: f64,
    /// The most host bytes this rank allocated during the walk beyond what was alive at its
    /// start (activations, messages, gradient temporaries).
    pub activation_peak: u64,
    /// The microbatches whose losses this rank computed that counted no target (masked data:
    /// they add nothing to the loss or the gradients).
    pub empty_microbatches: usize,
    /// The targets counted in the walk's global batch (masked data; `None`: every target).
    pub counted: Option<usize>,
}

/// Runs a walk of `actions` with chunks run by `P`.
pub(super) type RunFn<M> = fn(Walk<'_, M>, &[Action]) -> Result<Walked>;

/// How a trainer runs its batches: its plans, and how its chunks run.
pub(super) struct Engine<M> {
    /// This rank's pipeline rank, and the training and evaluation schedules.
    rank: usize,
    schedules: [Schedule; 2],
    /// The training schedule's plan of this rank, and the evaluation one's.
    pub plan: Vec<Action>,
    pub eval_plan: Vec<Action>,
    /// Walks a plan with the chunks' passes (the whole model, or a stage's parts).
    pub run: RunFn<M>,
    /// Whether the rank is a stage of a pipeline (its losses and the reported loss reduce over
    /// the pipeline group).
    pub pipelined: bool,
    /// Sum the tied copies' gradients over the embedding group (off only to show it is needed).
    pub sync_shared: bool,
}

impl<M> Engine<M> {
    /// The engine of pipeline rank `rank` of `config`'s schedules, its chunks run by `P`.
    pub fn new<P: Passes<M>>(
        config: ScheduleConfig,
        rank: usize,
        delivery: Delivery,
        pipelined: bool,
    ) -> Result<Self> {
        let train = Schedule::new(config)?;
        let eval = Schedule::new(ScheduleConfig {
            forward_only: true,
            ..config
        })?;
        let mut engine = Engine {
            rank,
            schedules: [train, eval],
            plan: Vec::new(),
            eval_plan: Vec::new(),
            run: walk::<M, P>,
            pipelined,
            sync_shared: true,
        };
        engine.replan(delivery)?;
        Ok(engine)
    }

    /// Makes this rank's plans for a backend of `delivery`.
    pub fn replan(&mut self, delivery: Delivery) -> Result<()> {
        let [train, eval] = &self.schedules;
        self.plan = plan(train, delivery)?.swap_remove(self.rank).actions;
        self.eval_plan = plan(eval, delivery)?.swap_remove(self.rank).actions;
        Ok(())
    }
}

/// One rank's walk of one batch: its chunks' passes, with the activations and gradients they
/// exchange with the neighbouring stages.
struct Walker<'a, M, P: Passes<M>> {
    walk: Walk<'a, M>,
    /// What each (chunk, microbatch)'s forward kept, and its losses' when it computed them
    /// (the last stage).
    kept: HashMap<(usize, usize), (P::Kept, Option<LossesKept>)>,
    /// Values received and not used yet, and values produced and not sent yet, by (pass, local
    /// chunk, microbatch): activations (forward) and gradients (backward).
    inbox: HashMap<(Pass, usize, usize), Tensor>,
    outbox: HashMap<(Pass, usize, usize), Tensor>,
    /// The losses computed, in order, and which of them count (masked data), read once after
    /// the walk.
    losses: Vec<(Tensor, Option<Vec<f32>>)>,
    /// The targets counted in the whole global batch of the walk (masked data).
    step_counted: Option<usize>,
    /// Each microbatch's documents, read once (its first forward on this rank) for every
    /// chunk's forward and backward.
    documents: HashMap<usize, Arc<Documents>>,
    /// Microbatches of this rank's losses that counted nothing.
    empty_microbatches: usize,
    /// Time spent in exchanges.
    waited: std::time::Duration,
    /// The shape of the value between stages, `[s, b, width]` (`[s / tp, b, width]` with
    /// sequence parallelism).
    carried: [usize; 3],
    /// The microbatches' in-flight slots (their graph scopes' graphs and static buffers).
    slots: SlotAllocator,
    /// Whether the plan has weight-gradient passes: its backwards put them off.
    split: bool,
    /// The weight gradients each (chunk, microbatch)'s backward put off, and the bytes they
    /// hold now and at most.
    deferred: HashMap<(usize, usize), Vec<WeightGrad>>,
    held: u64,
    held_peak: u64,
    /// Time in forwards, backwards and weight-gradient passes.
    pass_time: [std::time::Duration; 3],
}

/// What the backward of a microbatch's losses needs: their shape, and each one's weight in
/// the backward (masked data; `None`: every token alike).
struct LossesKept {
    shape: Shape,
    weights: Option<Vec<f32>>,
    /// With `--calculate-per-token-loss`, the backward scale of the model's auxiliary losses
    /// ([`Cx::with_token_share_scale`]).
    token_share: Option<f32>,
}

/// Walks `actions` with `walk`'s chunks run by `P`.
fn walk<M, P: Passes<M>>(walk: Walk<'_, M>, actions: &[Action]) -> Result<Walked> {
    let plan = *walk.data.plan();
    let Some(first) = walk.chunks.first() else {
        return invalid!("a rank needs at least one model chunk");
    };
    // With context parallelism the stages exchange their chunks of the sequence, with
    // sequence parallelism their shards of those.
    let local = plan.seq_length / walk.parallel.groups().config().cp;
    let seq = match walk.parallel.sequence_parallel() {
        true => {
            let tp = walk.parallel.groups().config().tp;
            if !local.is_multiple_of(tp) {
                return invalid!(
                    "sequence parallelism splits the sequence length {local} over tp = {tp}: \
                     it does not divide"
                );
            }
            local / tp
        }
        false => local,
    };
    let carried = [seq, plan.micro_batch, P::carried_width(first)];
    let split = actions
        .iter()
        .any(|a| matches!(a, Action::Run(op) if op.pass == Pass::Weight));
    if split && walk.cx.graphs().is_some() {
        // A captured backward's static buffers are overwritten by its next replay: the
        // weight gradients put off would read another microbatch's values.
        return invalid!(
            "--cuda-graph-scope cannot run with a zero-bubble --pipeline-schedule (its weight \
             gradients, put off past the backward, would read the captured graphs' buffers after \
             later replays overwrote them): drop one of them"
        );
    }
    let started = std::time::Instant::now();
    let account = crate::tensor::host_memory::this_thread();
    let alive_at_start = account.live_bytes();
    account.reset_peak();
    let step_counted = walk.data.step_counted(walk.batch)?;
    let mut walker = Walker::<M, P> {
        walk,
        kept: HashMap::new(),
        inbox: HashMap::new(),
        outbox: HashMap::new(),
        losses: Vec::new(),
        step_counted,
        documents: HashMap::new(),
        empty_microbatches: 0,
        waited: std::time::Duration::ZERO,
        carried,
        slots: SlotAllocator::new(),
        split,
        deferred: HashMap::new(),
        held: 0,
        held_peak: 0,
        pass_time: [std::time::Duration::ZERO; 3],
    };
    execute(actions, &mut walker)?;
    if let Some(&(chunk, microbatch)) = walker.deferred.keys().min() {
        return invalid!(
            "the pipeline's plan ended with the weight gradients of {} backwards not computed \
             (chunk {chunk} microbatch {microbatch} the first): the optimizer step would miss them",
            walker.deferred.len()
        );
    }
    if !(walker.inbox.is_empty() && walker.outbox.is_empty()) {
        return invalid!(
            "the pipeline's plan left {} values unused and {} unsent",
            walker.inbox.len(),
            walker.outbox.len()
        );
    }
    let w = &walker.walk;
    if w.mode != Mode::Eval {
        P::after_backward(w.chunks, w.parallel, w.sync_shared)?;
    }
    let mut loss_sum = 0.0f64;
    for (losses, counted) in &walker.losses {
        let losses = losses.to_vec_f32()?;
        loss_sum += match counted {
            Some(mask) => losses
                .iter()
                .zip(mask)
                .map(|(&l, &m)| f64::from(l) * f64::from(m))
                .sum::<f64>(),
            None => losses.iter().map(|&l| f64::from(l)).sum::<f64>(),
        };
    }
    Ok(Walked {
        loss_sum,
        waited: walker.waited.as_secs_f64(),
        deferred_peak: walker.held_peak,
        pass_seconds: walker.pass_time.map(|t| t.as_secs_f64()),
        seconds: started.elapsed().as_secs_f64(),
        activation_peak: account.peak_bytes().saturating_sub(alive_at_start) as u64,
        empty_microbatches: walker.empty_microbatches,
        counted: walker.step_counted,
    })
}

impl<'a, M, P: Passes<M>> Walker<'a, M, P> {
    /// The context of `microbatch`.
    fn cx(&self, microbatch: usize) -> Cx<'a> {
        let w = &self.walk;
        match w.mode {
            Mode::Train { step } => {
                let dp_rank = w.parallel.groups().dp_rank();
                w.cx.at(
                    step,
                    w.data.plan().global_microbatch(dp_rank, microbatch) as u64,
                )
            }
            Mode::Eval => w.cx.eval(),
        }
    }

    /// A buffer for the value (or its gradient) another stage sends.
    fn carried_buffer(&self) -> Result<Tensor> {
        Tensor::empty_near(self.carried, DType::F32, self.walk.like)
    }

    /// The value `pass` of `microbatch` brought for local chunk `chunk`.
    fn take_input(&mut self, pass: Pass, chunk: usize, microbatch: usize) -> Result<Tensor> {
        match self.inbox.remove(&(pass, chunk, microbatch)) {
            Some(t) => Ok(t),
            None => invalid!(
                "the {pass:?} input of chunk {chunk} microbatch {microbatch} was not received \
                 before its pass"
            ),
        }
    }

    fn check_carried(&self, t: &Tensor, what: &str) -> Result<()> {
        if t.dims() != self.carried || t.dtype() != DType::F32 {
            return invalid!(
                "the pipeline sends {what} of shape {:?} and dtype f32 between stages, but this \
                 stage produced {:?} {}",
                self.carried,
                t.dims(),
                t.dtype()
            );
        }
        Ok(())
    }
}

impl<M, P: Passes<M>> Stage for Walker<'_, M, P> {
    type Error = Error;

    fn forward(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        self.timed(0, (chunk, microbatch), |w| w.run_forward(chunk, microbatch))
    }

    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        self.timed(1, (chunk, microbatch), |w| {
            w.run_backward(chunk, microbatch)
        })
    }

    fn weight(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        self.timed(2, (chunk, microbatch), |w| w.run_weight(chunk, microbatch))
    }

    fn hand_over(&mut self, pass: Pass, from: usize, to: usize, microbatch: usize) -> Result<()> {
        match self.outbox.remove(&(pass, from, microbatch)) {
            Some(v) => {
                self.inbox.insert((pass, to, microbatch), v);
                Ok(())
            }
            None => invalid!(
                "{pass:?} output of chunk {from} microbatch {microbatch} is handed to chunk {to} \
                 before it is computed"
            ),
        }
    }

    fn exchange(&mut self, sends: &[Transfer], recvs: &[Transfer]) -> Result<()> {
        let key = |t: &Transfer| (t.pass, t.chunk, t.microbatch);
        let outgoing = sends
            .iter()
            .map(|t| match self.outbox.remove(&key(t)) {
                Some(v) => Ok((v, t.peer)),
                None => invalid!(
                    "{:?} output of chunk {} microbatch {} is sent before it is computed",
                    t.pass,
                    t.chunk,
                    t.microbatch
                ),
            })
            .collect::<Result<Vec<_>>>()?;
        let incoming = recvs
            .iter()
            .map(|t| Ok((self.carried_buffer()?, t.peer)))
            .collect::<Result<Vec<_>>>()?;
        // The values go as they are where the backend can hand them over (thread ranks): the
        // walker holds nothing else of them once they are sent.
        let start = std::time::Instant::now();
        let received = self.walk.parallel.pp().exchange_owned(outgoing, incoming)?;
        self.waited += start.elapsed();
        for (t, v) in recvs.iter().zip(received) {
            self.inbox.insert(key(t), v);
        }
        Ok(())
    }
}

impl<M, P: Passes<M>> Walker<'_, M, P> {
    /// Runs `f`, the pass of `chunk` and `microbatch`, adding its time to pass kind `kind`'s
    /// (forward, backward, weight gradients) and to the trace when one records.
    fn timed(
        &mut self,
        kind: usize,
        (chunk, microbatch): (usize, usize),
        f: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let start = std::time::Instant::now();
        let done = f(self);
        let end = std::time::Instant::now();
        self.pass_time[kind] += end - start;
        let rank = self.walk.parallel.groups().rank();
        if let Some(trace) = self.walk.cx.trace().filter(|t| t.recording(rank)) {
            let name = ["forward", "backward", "weight gradients"][kind];
            let args = [
                ("chunk".to_string(), serde_json::json!(chunk)),
                ("microbatch".to_string(), serde_json::json!(microbatch)),
            ];
            trace.record(
                rank,
                "compute",
                format!("{name} {microbatch}"),
                (start, end),
                args.into_iter().collect(),
            );
        }
        done
    }

    fn run_forward(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        let model = &self.walk.chunks[chunk];
        let (first, last) = P::ends(model);
        let slot = self.slots.take(chunk, microbatch);
        let groups = self.walk.parallel.groups();
        let masks = *self.walk.data.masks();
        let known = self.documents.get(&microbatch).cloned();
        let unknown = self.walk.data.reads_documents() && known.is_none();
        let batch = match first || last || unknown {
            true => Some(self.microbatch(microbatch)?),
            false => None,
        };
        let counted = batch.as_ref().map_or(0, Microbatch::counted);
        let (data, documents) = match batch {
            Some(batch) => {
                // With context parallelism, this rank's two chunks of every sequence (or of
                // every packed document, as the layers cut them).
                let chunks = match groups.config().cp {
                    1 => None,
                    cp => {
                        let seq = batch.tokens.dims().first().copied().unwrap_or(0);
                        let docs = batch.documents.as_ref();
                        Some(CpChunks::of_microbatch(seq, cp, groups.cp_rank(), docs)?)
                    }
                };
                let local = |t: Tensor| match &chunks {
                    Some(c) => c.take_local(&t),
                    None => Ok(t),
                };
                let mask = match batch.loss_mask {
                    Some(mask) => {
                        let whole = Tensor::from_vec(mask, batch.targets.dims().to_vec())?;
                        Some(local(whole)?.to_vec::<f32>()?)
                    }
                    None => None,
                };
                let data = (local(batch.tokens)?, local(batch.targets)?, mask);
                (Some(data), batch.documents)
            }
            None => (None, None),
        };
        let documents = match (known, documents) {
            (Some(known), _) => Some(known),
            (None, Some(read)) => {
                let read = Arc::new(read);
                self.documents.insert(microbatch, Arc::clone(&read));
                Some(read)
            }
            (None, None) => None,
        };
        let cx = self.cx(microbatch).in_slot(slot);
        let cx = match &documents {
            Some(d) => cx.with_documents(d),
            None => cx,
        };
        let h = match first {
            true => None,
            false => Some(self.take_input(Pass::Forward, chunk, microbatch)?),
        };
        // The first stage embeds the tokens; the last may read them again (multi-token
        // prediction's depths).
        let tokens = data.as_ref().filter(|_| first || last).map(|(t, _, _)| t);
        let targets = data.as_ref().filter(|_| last).map(|(_, t, _)| t);
        // The data's loss mask, for the model's own masked losses (`loss_mask(targets)`).
        let loss_mask = match (targets, data.as_ref().and_then(|(_, _, m)| m.as_ref())) {
            (Some(t), Some(m)) => Some(Tensor::from_vec(m.clone(), t.dims().to_vec())?),
            _ => None,
        };
        let cx = match &loss_mask {
            Some(m) => cx.with_loss_mask(m),
            None => cx,
        };
        let (out, kept) = P::forward(model, &cx, tokens, h, targets)?;
        let losses = if last {
            let shape = out.shape().clone();
            let mask = data.and_then(|(_, _, mask)| mask);
            // Megatron-LM's multi-token prediction with per-token losses: each depth's mean
            // times the micro-batch's counted tokens, every gradient over the step's.
            let token_share = match (masks.calculate_per_token_loss, self.step_counted) {
                (true, Some(step)) if step > 0 => {
                    Some(self.walk.loss_scale * counted as f32 / step as f32)
                }
                _ => None,
            };
            let weights = match (&mask, self.step_counted) {
                (Some(mask), Some(step_counted)) => {
                    let plan = self.walk.data.plan();
                    let weight = token_weight(
                        &masks,
                        self.walk.loss_scale,
                        counted,
                        step_counted,
                        plan.microbatches() * plan.dp,
                    );
                    if weight.is_none() {
                        self.empty_microbatches += 1;
                    }
                    let w = weight.unwrap_or(0.0);
                    Some(mask.iter().map(|&m| m * w).collect())
                }
                _ => None,
            };
            self.losses.push((out, mask));
            Some(LossesKept {
                shape,
                weights,
                token_share,
            })
        } else {
            self.check_carried(&out, "activations")?;
            self.outbox.insert((Pass::Forward, chunk, microbatch), out);
            None
        };
        if matches!(self.walk.mode, Mode::Train { .. }) {
            self.kept.insert((chunk, microbatch), (kept, losses));
        }
        Ok(())
    }

    /// This rank's data-parallel share of microbatch `microbatch` of the walk's batch.
    fn microbatch(&self, microbatch: usize) -> Result<Microbatch> {
        let dp_rank = self.walk.parallel.groups().dp_rank();
        self.walk.data.batch(self.walk.batch, dp_rank, microbatch)
    }

    fn run_backward(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        let Some((kept, losses)) = self.kept.remove(&(chunk, microbatch)) else {
            return invalid!(
                "backward of chunk {chunk} microbatch {microbatch} before its forward"
            );
        };
        let model = &self.walk.chunks[chunk];
        let slot = self.slots.free(chunk, microbatch);
        let deferred = DeferredWeights::default();
        // The backward (and what it recomputes) sees the forward's documents.
        let documents = self.documents.get(&microbatch).cloned();
        let cx = self.cx(microbatch).in_slot(slot);
        let cx = match &documents {
            Some(d) => cx.with_documents(d),
            None => cx,
        };
        let cx = match self.split {
            true => cx.deferring_weights(&deferred),
            false => cx,
        };
        let cx = match losses.as_ref().and_then(|l| l.token_share) {
            Some(scale) => cx.with_token_share_scale(scale),
            None => cx,
        };
        let d = match losses {
            Some(LossesKept {
                shape,
                weights: Some(weights),
                ..
            }) => {
                // d(scaled loss of the step) / d(each token's loss): its microbatch's weight
                // where it counts, 0 where it does not.
                let dlosses = Tensor::empty_near(shape.clone(), DType::F32, self.walk.like)?;
                dlosses.copy_from(&Tensor::from_vec(weights, shape)?)?;
                dlosses
            }
            Some(LossesKept {
                shape,
                weights: None,
                ..
            }) => {
                let plan = self.walk.data.plan();
                let tokens = plan.global_batch * plan.seq_length;
                // d(scaled mean loss over the global batch) / d(each token's loss).
                let dlosses = Tensor::zeros_near(shape, DType::F32, self.walk.like)?;
                dlosses.fill(self.walk.loss_scale / tokens as f32)?;
                dlosses
            }
            None => self.take_input(Pass::Backward, chunk, microbatch)?,
        };
        if let Some(d_in) = P::backward(model, &cx, kept, &d)? {
            self.check_carried(&d_in, "gradients")?;
            self.outbox
                .insert((Pass::Backward, chunk, microbatch), d_in);
        }
        let put_off = deferred.take();
        if self.split {
            self.held += put_off.iter().map(WeightGrad::held_bytes).sum::<u64>();
            self.held_peak = self.held_peak.max(self.held);
            self.deferred.insert((chunk, microbatch), put_off);
        }
        Ok(())
    }

    fn run_weight(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        let Some(put_off) = self.deferred.remove(&(chunk, microbatch)) else {
            return invalid!(
                "weight gradients of chunk {chunk} microbatch {microbatch} before its backward"
            );
        };
        for w in put_off {
            self.held -= w.held_bytes();
            w.run()?;
        }
        Ok(())
    }
}
