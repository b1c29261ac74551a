//! Training through a pipeline: a rank holds one model chunk per virtual stage and runs its
//! schedule's [plan](crate::pipeline_parallel::plan): its passes in Megatron-LM's order, each
//! taking its input from the previous stage and giving its output to the next (the gradients
//! the other way round), and between them the batched exchanges that move those values. The
//! last stage computes the losses.

use std::collections::HashMap;

use super::{LanguageModel, Sampler, Trainer};
use crate::comm::{ParallelState, ReduceOp};
use crate::cuda_graphs::SlotAllocator;
use crate::error::{Error, Result};
use crate::invalid;
use crate::module::{Builder, Cx, Ids, Module, Param, Pipelined};
use crate::parallel::GroupKind;
use crate::pipeline_parallel::{
    Action, Delivery, Pass, Schedule, ScheduleConfig, Stage, Transfer, execute, plan,
};
use crate::tensor::{DType, Tensor};

/// A language model that pipeline parallelism cuts into stages (its layers a `#[pipeline]`
/// stack): the first stage embeds the token ids, every stage runs its layers, the last computes
/// the per-token losses. The `#[pipeline]` expansion generates the parts; a model implements
/// this trait by calling them.
pub trait PipelinedLanguageModel: LanguageModel + Pipelined {
    /// What the first stage's part keeps.
    type FirstSaved;
    /// What a stage's layers keep.
    type LayersSaved;
    /// What the last stage's part keeps.
    type LastSaved;

    /// The width of the value that goes from stage to stage (`[s, b, width]`).
    fn carried_width(&self) -> usize;

    /// The first stage's part: token ids `[s, b]` to the value the layers start from.
    fn first_forward(&self, cx: &Cx, tokens: &Ids) -> Result<(Tensor, Self::FirstSaved)>;

    /// The first stage part's backward, from the gradient of its output.
    fn first_backward(&self, cx: &Cx, saved: Self::FirstSaved, d_out: &Tensor) -> Result<()>;

    /// This stage's layers.
    fn layers_forward(&self, cx: &Cx, h: &Tensor) -> Result<(Tensor, Self::LayersSaved)>;

    /// The layers' backward: the gradient of their input.
    fn layers_backward(&self, cx: &Cx, saved: Self::LayersSaved, d_out: &Tensor) -> Result<Tensor>;

    /// The last stage's part: the layers' output and the targets `[s, b]` to per-token losses.
    fn last_forward(&self, cx: &Cx, h: &Tensor, targets: &Ids)
    -> Result<(Tensor, Self::LastSaved)>;

    /// The last stage part's backward, from the losses' gradient: the gradient of its input.
    fn last_backward(&self, cx: &Cx, saved: Self::LastSaved, dlosses: &Tensor) -> Result<Tensor>;
}

/// A rank's model chunks, one per virtual stage, as one module (their parameters in chunk
/// order): what the trainer packs into its flat buffers.
#[derive(Debug)]
pub struct Chunks<M>(pub Vec<M>);

impl<M: Module> Module for Chunks<M> {
    type Spec = Vec<M::Spec>;
    type Saved = ();

    fn build(spec: &Self::Spec, b: &mut Builder) -> Result<Self> {
        spec.iter()
            .map(|s| M::build(s, b))
            .collect::<Result<_>>()
            .map(Chunks)
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        for m in &self.0 {
            m.visit_params(f);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        for m in &mut self.0 {
            m.visit_params_mut(f);
        }
    }
}

/// How a pipelined trainer runs its microbatches.
pub(super) struct Pipeline<M: LanguageModel> {
    /// This rank's pipeline rank, and the training and evaluation schedules.
    pub rank: usize,
    pub schedules: [Schedule; 2],
    /// The training schedule's plan of this rank, and the evaluation one's.
    pub plan: Vec<Action>,
    pub eval_plan: Vec<Action>,
    /// Runs one batch's microbatches through a plan (generic over the model's pipelined
    /// parts, which the trainer's own impl cannot name).
    pub run: RunFn<M>,
    /// Sum the tied copies' gradients over the embedding group (off only to show it is needed).
    pub sync_shared: bool,
}

/// Runs batch `batch` of `data` through a plan: the sum of the per-token losses this rank
/// computed (the last stage's; 0 elsewhere) and the seconds it waited for other stages.
pub(super) type RunFn<M> =
    fn(&Trainer<M>, &ParallelState, &Sampler, u64, &[Action], Mode) -> Result<(f64, f64)>;

/// What a walk is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Forward and backward, at this step (dropout as training).
    Train { step: u64 },
    /// Forwards only, nothing kept, no dropout.
    Eval,
}

impl<M: PipelinedLanguageModel> Trainer<M> {
    /// A trainer of one rank of a pipeline: `chunks` are its model chunks, one per virtual
    /// stage (each built with [`Builder::with_stage`] for its part of the layers), run in the
    /// order of Megatron-LM's schedule over `parallel`'s pipeline group with
    /// `microbatch_group_size` (`None`: pp) contiguous microbatches per virtual stage.
    pub fn pipelined(
        chunks: Vec<M>,
        parallel: &ParallelState,
        sampler: Sampler,
        config: super::TrainConfig,
        microbatch_group_size: Option<usize>,
    ) -> Result<Self> {
        let pp = parallel.pp();
        let (rank, size) = (pp.index(), pp.size());
        let delivery = if pp.rendezvous() {
            Delivery::Rendezvous
        } else {
            Delivery::Buffered
        };
        if chunks.is_empty() {
            return invalid!("a pipeline rank needs at least one model chunk");
        }
        let microbatches = sampler.plan().microbatches();
        let schedule_config = ScheduleConfig {
            group_size: microbatch_group_size,
            ..ScheduleConfig::new(size, chunks.len(), microbatches)
        };
        let schedule = Schedule::new(schedule_config)?;
        let eval = Schedule::new(ScheduleConfig {
            forward_only: true,
            ..schedule_config
        })?;
        // The parameters the first and the last stage both hold (the tied embedding): alone in
        // their bucket (distributed optimizer), and the last stage's copy counted once.
        let (mut shared, mut copies) = (Vec::new(), Vec::new());
        let mut position = 0;
        for chunk in &chunks {
            let part = chunk.stage();
            let mut names = Vec::new();
            chunk.visit_shared_params(&mut |p| names.push(p.spec().name.clone()));
            chunk.visit_params(&mut |p| {
                if part.first != part.last && names.contains(&p.spec().name) {
                    shared.push(position);
                    if part.last {
                        copies.push(position);
                    }
                }
                position += 1;
            });
        }
        let mut trainer = Trainer::build(Chunks(chunks), parallel, sampler, config, shared)?;
        trainer.buffers.mark_shared_copies(&copies);
        let mut pipeline = Pipeline {
            rank,
            schedules: [schedule, eval],
            plan: Vec::new(),
            eval_plan: Vec::new(),
            run: run_walk::<M>,
            sync_shared: true,
        };
        pipeline.replan(delivery)?;
        trainer.pipeline = Some(pipeline);
        Ok(trainer)
    }
}

impl<M: LanguageModel> Pipeline<M> {
    /// Makes this rank's plans for a backend of `delivery`.
    fn replan(&mut self, delivery: Delivery) -> Result<()> {
        let [train, eval] = &self.schedules;
        self.plan = plan(train, delivery)?.swap_remove(self.rank).actions;
        self.eval_plan = plan(eval, delivery)?.swap_remove(self.rank).actions;
        Ok(())
    }
}

impl<M: LanguageModel> Trainer<M> {
    /// Leaves the tied copies' gradients unsummed over the embedding group: the first and the
    /// last stage's copies then drift apart (for the test that shows the sum is needed).
    #[doc(hidden)]
    pub fn skip_shared_gradient_sum(&mut self) {
        if let Some(p) = &mut self.pipeline {
            p.sync_shared = false;
        }
    }

    /// Plans the pipeline's exchanges for `delivery` rather than the pipeline communicator's
    /// own (to run the plan of a backend whose sends wait on one whose sends do not).
    #[doc(hidden)]
    pub fn plan_pipeline_for(&mut self, delivery: Delivery) -> Result<()> {
        match &mut self.pipeline {
            Some(p) => p.replan(delivery),
            None => Ok(()),
        }
    }
}

/// Sums the gradients of the parameters the first and the last stage both hold over the
/// embedding group (a collective of the two stages' ranks, in visit order).
fn sum_shared_gradients<M: Pipelined>(chunks: &[M], parallel: &ParallelState) -> Result<()> {
    let Some(group) = parallel.get(GroupKind::Embedding) else {
        return Ok(());
    };
    if group.size() < 2 {
        return Ok(());
    }
    let mut grads = Vec::new();
    for chunk in chunks {
        chunk.visit_shared_params(&mut |p| grads.push(p.grad().clone()));
    }
    for g in &grads {
        group.all_reduce(g, ReduceOp::Sum)?;
    }
    Ok(())
}

/// What a microbatch's passes through one chunk keep for its backward.
struct Kept<M: PipelinedLanguageModel> {
    first: Option<M::FirstSaved>,
    layers: M::LayersSaved,
    last: Option<(M::LastSaved, crate::tensor::Shape)>,
}

/// One rank's stage of the pipeline for one batch: its chunks' passes, with the activations
/// and gradients they exchange with the neighbouring stages.
struct Walker<'a, M: PipelinedLanguageModel> {
    trainer: &'a Trainer<M>,
    parallel: &'a ParallelState,
    data: &'a Sampler,
    batch: u64,
    mode: Mode,
    kept: HashMap<(usize, usize), Kept<M>>,
    /// Values received and not used yet, and values produced and not sent yet, by (pass, local
    /// chunk, microbatch): activations (forward) and gradients (backward).
    inbox: HashMap<(Pass, usize, usize), Tensor>,
    outbox: HashMap<(Pass, usize, usize), Tensor>,
    loss_sum: f64,
    /// Time spent in exchanges.
    waited: std::time::Duration,
    /// The shape of the value between stages, `[s, b, width]`.
    carried: [usize; 3],
    /// The microbatches' in-flight slots (their graph scopes' graphs and static buffers).
    slots: SlotAllocator,
}

fn run_walk<M: PipelinedLanguageModel>(
    trainer: &Trainer<M>,
    parallel: &ParallelState,
    data: &Sampler,
    batch: u64,
    actions: &[Action],
    mode: Mode,
) -> Result<(f64, f64)> {
    let plan = *data.plan();
    let chunks = &trainer.chunks.0;
    let mut walker = Walker {
        trainer,
        parallel,
        data,
        batch,
        mode,
        kept: HashMap::new(),
        inbox: HashMap::new(),
        outbox: HashMap::new(),
        loss_sum: 0.0,
        waited: std::time::Duration::ZERO,
        carried: [plan.seq_length, plan.micro_batch, chunks[0].carried_width()],
        slots: SlotAllocator::new(),
    };
    execute(actions, &mut walker)?;
    if !(walker.inbox.is_empty() && walker.outbox.is_empty()) {
        return invalid!(
            "the pipeline's plan left {} values unused and {} unsent",
            walker.inbox.len(),
            walker.outbox.len()
        );
    }
    // The tied embedding's two copies (first and last stage) get one gradient.
    let sync = trainer.pipeline.as_ref().is_some_and(|p| p.sync_shared);
    if mode != Mode::Eval && sync {
        sum_shared_gradients(chunks, parallel)?;
    }
    Ok((walker.loss_sum, walker.waited.as_secs_f64()))
}

impl<'a, M: PipelinedLanguageModel> Walker<'a, M> {
    fn cx(&self, microbatch: usize) -> Cx<'a> {
        let cx = self.trainer.train_cx(self.parallel);
        match self.mode {
            Mode::Train { step } => {
                let plan = self.data.plan();
                let dp_rank = self.parallel.groups().dp_rank();
                cx.at(step, plan.global_microbatch(dp_rank, microbatch) as u64)
            }
            Mode::Eval => cx.eval(),
        }
    }

    /// A buffer for the value (or its gradient) another stage sends.
    fn carried_buffer(&self) -> Result<Tensor> {
        Tensor::empty_near(self.carried, DType::F32, self.trainer.buffers.grads())
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

impl<M: PipelinedLanguageModel> Stage for Walker<'_, M> {
    type Error = Error;

    fn forward(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        let model = &self.trainer.chunks.0[chunk];
        let part = model.stage().clone();
        let slot = self.slots.take(chunk, microbatch);
        let cx = self.cx(microbatch).in_slot(slot);
        let dp_rank = self.parallel.groups().dp_rank();
        let data = if part.first || part.last {
            Some(self.data.microbatch(self.batch, dp_rank, microbatch)?)
        } else {
            None
        };
        let (h, first) = match (&data, part.first) {
            (Some((tokens, _)), true) => {
                let (h, saved) = model.first_forward(&cx, tokens)?;
                (h, Some(saved))
            }
            _ => (self.take_input(Pass::Forward, chunk, microbatch)?, None),
        };
        let (out, layers) = model.layers_forward(&cx, &h)?;
        let last = match (&data, part.last) {
            (Some((_, targets)), true) => {
                let (losses, saved) = model.last_forward(&cx, &out, targets)?;
                self.loss_sum += losses
                    .to_vec_f32()?
                    .iter()
                    .map(|&l| f64::from(l))
                    .sum::<f64>();
                Some((saved, losses.shape().clone()))
            }
            _ => {
                self.check_carried(&out, "activations")?;
                self.outbox.insert((Pass::Forward, chunk, microbatch), out);
                None
            }
        };
        if matches!(self.mode, Mode::Train { .. }) {
            self.kept.insert(
                (chunk, microbatch),
                Kept {
                    first,
                    layers,
                    last,
                },
            );
        }
        Ok(())
    }

    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<()> {
        let Some(kept) = self.kept.remove(&(chunk, microbatch)) else {
            return invalid!(
                "backward of chunk {chunk} microbatch {microbatch} before its forward"
            );
        };
        let model = &self.trainer.chunks.0[chunk];
        let slot = self.slots.free(chunk, microbatch);
        let cx = self.cx(microbatch).in_slot(slot);
        let d = match kept.last {
            Some((saved, shape)) => {
                let plan = self.data.plan();
                let tokens = plan.global_batch * plan.seq_length;
                // d(scaled mean loss over the global batch) / d(each token's loss).
                let dlosses = Tensor::zeros_near(shape, DType::F32, self.trainer.buffers.grads())?;
                dlosses.fill(self.trainer.loss_scale() / tokens as f32)?;
                model.last_backward(&cx, saved, &dlosses)?
            }
            None => self.take_input(Pass::Backward, chunk, microbatch)?,
        };
        let d = model.layers_backward(&cx, kept.layers, &d)?;
        match kept.first {
            Some(saved) => model.first_backward(&cx, saved, &d)?,
            None => {
                self.check_carried(&d, "gradients")?;
                self.outbox.insert((Pass::Backward, chunk, microbatch), d);
            }
        }
        Ok(())
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
        let start = std::time::Instant::now();
        self.parallel.pp().exchange(
            &outgoing.iter().map(|(v, p)| (v, *p)).collect::<Vec<_>>(),
            &incoming.iter().map(|(v, p)| (v, *p)).collect::<Vec<_>>(),
        )?;
        self.waited += start.elapsed();
        for (t, (v, _)) in recvs.iter().zip(incoming) {
            self.inbox.insert(key(t), v);
        }
        Ok(())
    }
}
