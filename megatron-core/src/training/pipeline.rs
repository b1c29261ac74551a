//! Training through a pipeline: a rank holds one model chunk per virtual stage, and the step
//! engine ([`super::engine`]) walks its plan with each chunk running its stage's parts
//! ([`Stages`]): the first stage embeds the token ids, every stage runs its layers, the last
//! computes the losses. The tied embedding's two copies get one gradient.

use super::engine::{Engine, Passes};
use super::{LanguageModel, Sampler, Trainer};
use crate::comm::ParallelState;
use crate::error::Result;
use crate::invalid;
use crate::module::{Builder, Cx, Ids, Module, Param, Pipelined, Site};
use crate::pipeline_parallel::{Delivery, ScheduleConfig, ScheduleKind};
use crate::tensor::Tensor;

/// A language model that pipeline parallelism cuts into stages (its layers a `#[pipeline]`
/// stack): the first stage embeds the token ids, every stage runs its layers, the last computes
/// the per-token losses. `#[megatron::module]` implements it, with [`LanguageModel`], for a
/// `#[pipeline]` module whose forward takes `(tokens: Ids, targets: Ids)`: the methods are the
/// parts it generates (docs/expanded-pipeline.md).
pub trait PipelinedLanguageModel: LanguageModel + Pipelined + CarriedWidth {
    /// What the first stage's part keeps.
    type PreSaved;
    /// What a stage's layers keep.
    type LayersSaved;
    /// What the last stage's part keeps.
    type PostSaved;

    /// The first stage's part: token ids `[s, b]` to the value the layers start from.
    fn forward_pre(&self, cx: &Cx, site: Site, tokens: &Ids) -> Result<(Tensor, Self::PreSaved)>;

    /// The first stage part's backward, from the gradient of its output.
    fn backward_pre(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::PreSaved,
        d_out: &Tensor,
    ) -> Result<()>;

    /// This stage's layers.
    fn forward_layers(
        &self,
        cx: &Cx,
        site: Site,
        h: &Tensor,
    ) -> Result<(Tensor, Self::LayersSaved)>;

    /// The layers' backward: the gradient of their input.
    fn backward_layers(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::LayersSaved,
        d_out: &Tensor,
    ) -> Result<Tensor>;

    /// The last stage's part: the layers' output, the tokens and the targets `[s, b]` to
    /// per-token losses (the tokens read again by a part that embeds them there: multi-token
    /// prediction's depths).
    fn forward_post(
        &self,
        cx: &Cx,
        site: Site,
        h: &Tensor,
        tokens: &Ids,
        targets: &Ids,
    ) -> Result<(Tensor, Self::PostSaved)>;

    /// The last stage part's backward, from the losses' gradient: the gradients of its inputs
    /// (the layers' output, and `()` for the targets).
    fn backward_post(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::PostSaved,
        dlosses: &Tensor,
    ) -> Result<(Tensor, ())>;
}

/// The width of the value a pipelined model's stages pass on (`[s, b, width]`): a fact of the
/// model that a stage needs before anything arrives, to receive it (Megatron-LM's hidden size).
pub trait CarriedWidth {
    /// The last dimension of the value between stages.
    fn carried_width(&self) -> usize;
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

    fn visit_stacked_params<'s>(&'s self, units: &mut usize, f: &mut dyn FnMut(&'s Param, usize)) {
        for m in &self.0 {
            m.visit_stacked_params(units, f);
        }
    }
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
        let kind = ScheduleKind::default_for(chunks.len());
        Self::pipelined_as(
            chunks,
            parallel,
            sampler,
            config,
            kind,
            microbatch_group_size,
        )
    }

    /// [`Trainer::pipelined`] running schedule `kind` (the chunks built for its placement:
    /// [`crate::pipeline_parallel::PipelineLayout::placed`]).
    pub fn pipelined_as(
        chunks: Vec<M>,
        parallel: &ParallelState,
        sampler: Sampler,
        config: super::TrainConfig,
        kind: ScheduleKind,
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
            ..ScheduleConfig::named(kind, size, Some(chunks.len()), microbatches)?
        };
        let engine = Engine::new::<Stages>(schedule_config, rank, delivery, true)?;
        // The parameters the first and the last stage both hold (the tied embedding): alone in
        // their bucket (distributed optimizer), and the last stage's copy counted once.
        let (mut shared, mut copies) = (Vec::new(), Vec::new());
        let mut position = 0;
        for chunk in &chunks {
            let part = chunk.stage();
            let mut names = Vec::new();
            chunk.visit_shared_params(&mut |p| names.push(p.spec().name.clone()));
            chunk.visit_trainable_params(&mut |p| {
                if part.first != part.last && names.contains(&p.spec().name) {
                    shared.push(position);
                    if part.last {
                        copies.push(position);
                    }
                }
                position += 1;
            });
        }
        let mut trainer =
            Trainer::build(Chunks(chunks), parallel, sampler, config, shared, engine)?;
        trainer.buffers.mark_shared_copies(&copies);
        Ok(trainer)
    }
}

impl<M: LanguageModel> Trainer<M> {
    /// Leaves the tied copies' gradients unsummed over the embedding group: the first and the
    /// last stage's copies then drift apart (for the test that shows the sum is needed).
    #[doc(hidden)]
    pub fn skip_shared_gradient_sum(&mut self) {
        self.engine.sync_shared = false;
    }

    /// Plans the pipeline's exchanges for `delivery` rather than the pipeline communicator's
    /// own (to run the plan of a backend whose sends wait on one whose sends do not).
    #[doc(hidden)]
    pub fn plan_pipeline_for(&mut self, delivery: Delivery) -> Result<()> {
        self.engine.replan(delivery)
    }

    /// Drops the last weight-gradient pass from this rank's plan, as if it ran after the
    /// optimizer step (for the test that shows the step refuses to start without it).
    #[doc(hidden)]
    pub fn drop_last_weight_pass(&mut self) {
        use crate::pipeline_parallel::{Action, Pass};
        let plan = &mut self.engine.plan;
        if let Some(i) = plan
            .iter()
            .rposition(|a| matches!(a, Action::Run(op) if op.pass == Pass::Weight))
        {
            plan.remove(i);
        }
    }
}

/// What a microbatch's passes through one chunk keep for its backward.
pub(super) struct Kept<M: PipelinedLanguageModel> {
    first: Option<M::PreSaved>,
    layers: M::LayersSaved,
    last: Option<M::PostSaved>,
}

/// A pipeline stage's parts: the first stage's (from token ids), the layers the chunk holds,
/// the last stage's (to the losses).
pub(super) struct Stages;

impl<M: PipelinedLanguageModel> Passes<M> for Stages {
    type Kept = Kept<M>;

    fn ends(model: &M) -> (bool, bool) {
        let part = model.stage();
        (part.first, part.last)
    }

    fn carried_width(model: &M) -> usize {
        model.carried_width()
    }

    fn forward(
        model: &M,
        cx: &Cx,
        tokens: Option<&Ids>,
        h: Option<Tensor>,
        targets: Option<&Ids>,
    ) -> Result<(Tensor, Kept<M>)> {
        let (h, first) = match (model.stage().first, tokens, h) {
            (true, Some(tokens), _) => {
                let (h, saved) = model.forward_pre(cx, Site::ROOT, tokens)?;
                (h, Some(saved))
            }
            (false, _, Some(h)) => (h, None),
            _ => return invalid!("a stage's forward needs tokens or an input"),
        };
        let (out, layers) = model.forward_layers(cx, Site::ROOT, &h)?;
        match (tokens, targets) {
            (Some(tokens), Some(targets)) => {
                let (losses, saved) = model.forward_post(cx, Site::ROOT, &out, tokens, targets)?;
                let kept = Kept {
                    first,
                    layers,
                    last: Some(saved),
                };
                Ok((losses, kept))
            }
            _ => {
                let kept = Kept {
                    first,
                    layers,
                    last: None,
                };
                Ok((out, kept))
            }
        }
    }

    fn backward(model: &M, cx: &Cx, kept: Kept<M>, d: &Tensor) -> Result<Option<Tensor>> {
        let from_losses;
        let d = match kept.last {
            Some(saved) => {
                from_losses = model.backward_post(cx, Site::ROOT, saved, d)?.0;
                &from_losses
            }
            None => d,
        };
        let d = model.backward_layers(cx, Site::ROOT, kept.layers, d)?;
        match kept.first {
            Some(saved) => {
                model.backward_pre(cx, Site::ROOT, saved, &d)?;
                Ok(None)
            }
            None => Ok(Some(d)),
        }
    }

    fn after_backward(chunks: &[M], parallel: &ParallelState, shared: bool) -> Result<()> {
        if shared {
            crate::distributed::sum_shared_gradients(chunks, parallel)?;
        }
        Ok(())
    }
}
