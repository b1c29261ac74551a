//! The module system the `#[megatron::module]` macros generate code against.
//!
//! A model is a tree of modules (structs with `#[megatron::module]`) whose leaves are layers
//! ([`Linear`](crate::tensor_parallel::Linear), [`LayerNorm`](crate::tensor_parallel::LayerNorm),
//! embeddings) and parameterless ops ([`Op`]). The field attributes choose how a layer is split
//! over tensor parallelism ([`ColumnParallel`], [`RowParallel`], [`VocabParallel`]; no attribute
//! means replicated: [`Layer`], [`Lookup`]). Every forward returns its output and a typed "saved"
//! value holding exactly what its backward needs; every backward consumes it, accumulates
//! parameter gradients, and returns the input gradient. Collectives are not inside the layers:
//! the generated code calls them, where Megatron-LM puts them, in plain sight.

mod param;
pub mod recompute;
mod site;
pub mod weight_grad;

use std::fmt;

pub use param::{
    Builder, Init, Param, ParamSpec, PartIndex, Run, Split, assemble_logical, initial_values,
};
pub use recompute::{Recompute, StackSaved, stack_backward, stack_forward};
pub use site::Site;
pub use weight_grad::{DeferredWeights, WeightGrad};

use crate::comm::{Communicator, ParallelState};
use crate::context_parallel::{CpChunks, CpGroups};
use crate::cuda_graphs::GraphRuntime;
use crate::documents::Documents;
use crate::error::Result;
use crate::inference::KvCache;
use crate::invalid;
use crate::moe::RoutingLog;
use crate::ops::AuxLossLog;
use crate::parallel::GroupKind;
use crate::rng::DropoutStream;
use crate::tensor::Tensor;

/// A tensor of token ids (i64). In a module's `forward` signature it marks an input that has no
/// gradient.
pub type Ids = Tensor;

/// What a forward or backward pass runs in: the rank's communicators and the random stream keys.
pub struct Cx<'a> {
    parallel: &'a ParallelState,
    seed: u64,
    step: u64,
    microbatch: u64,
    training: bool,
    recompute: Recompute,
    /// The backward scale of the routers' auxiliary losses.
    aux_loss_scale: f32,
    /// With `--calculate-per-token-loss`, the backward scale of [`crate::ops::aux_loss`]'s
    /// losses for this micro-batch (`None`: `aux_loss_scale`).
    token_share_scale: Option<f32>,
    /// Where MoE layers report their routing, when someone listens.
    routing_log: Option<&'a RoutingLog>,
    /// Where auxiliary losses (multi-token prediction's) report their values.
    aux_loss_log: Option<&'a AuxLossLog>,
    /// The graph scopes' runtime, when the run selected any.
    graphs: Option<&'a GraphRuntime>,
    /// The in-flight slot of this microbatch (its graphs and static buffers).
    graph_slot: usize,
    /// Generation's keys and values so far, when decoding with a cache.
    kv_cache: Option<&'a KvCache>,
    /// Where a split backward puts its weight gradients off to (a zero-bubble schedule's
    /// backward pass); `None`: they run at once.
    deferred_weights: Option<&'a DeferredWeights>,
    /// The microbatch's packed documents, when the run resets positions or attention at them.
    documents: Option<&'a Documents>,
    /// The microbatch's loss mask (`[s, b]`, 0/1 f32 on the host), with masked data.
    loss_mask: Option<&'a Tensor>,
    /// Where the passes' times go, when a step is traced.
    trace: Option<&'a crate::trace::Trace>,
    /// The gatherer of sharded parameters' units (`optim_grads_params`), when they are.
    units: Option<&'a crate::distributed::ParamUnits>,
}

impl<'a> Cx<'a> {
    /// A training context at step 0, microbatch 0.
    pub fn new(parallel: &'a ParallelState, seed: u64) -> Self {
        Cx {
            parallel,
            seed,
            step: 0,
            microbatch: 0,
            training: true,
            recompute: Recompute::Off,
            aux_loss_scale: 1.0,
            token_share_scale: None,
            routing_log: None,
            aux_loss_log: None,
            graphs: None,
            graph_slot: 0,
            kv_cache: None,
            deferred_weights: None,
            documents: None,
            loss_mask: None,
            trace: None,
            units: None,
        }
    }

    /// The same context gathering the sharded parameters' units through `units`
    /// (`optim_grads_params`: [`Cx::unit`]).
    pub fn with_units(self, units: &'a crate::distributed::ParamUnits) -> Cx<'a> {
        Cx {
            units: Some(units),
            ..self
        }
    }

    /// Gathers the unit of module `i` of a stack, `modules`, until the guard is dropped, and
    /// starts module `next`'s gather meanwhile (with `--overlap-param-gather`): with sharded
    /// parameters (`optim_grads_params`) each module of a stack is a unit of gathering, and
    /// generated code calls this around each module's forward and backward. Without, nothing.
    pub fn unit<M: Module>(
        &self,
        modules: &[M],
        i: usize,
        next: Option<usize>,
    ) -> Result<crate::distributed::Gathered<'a>> {
        match (self.units, modules.get(i)) {
            (Some(units), Some(module)) => {
                units.gather_module(module, next.and_then(|n| modules.get(n)))
            }
            _ => Ok(crate::distributed::Gathered::none()),
        }
    }

    /// The same context putting the weight gradients of its backward off to `deferred` (the
    /// backward pass of a zero-bubble schedule, whose weight-gradient pass runs them).
    pub fn deferring_weights<'b>(&self, deferred: &'b DeferredWeights) -> Cx<'b>
    where
        'a: 'b,
    {
        Cx {
            deferred_weights: Some(deferred),
            ..*self
        }
    }

    /// Runs a layer's weight gradients `w`: at once, or in a zero-bubble schedule's backward
    /// put off to its weight-gradient pass. Generated code calls it right after each linear
    /// layer's input gradient (`W` after `B`).
    pub fn weight_gradient(&self, w: WeightGrad) -> Result<()> {
        match self.deferred_weights {
            Some(deferred) => {
                deferred.defer(w);
                Ok(())
            }
            None => w.run(),
        }
    }

    /// The same context running a microbatch of packed `documents`: attention and positions
    /// follow them as they say ([`Documents::separates_attention`],
    /// [`Documents::resets_positions`]).
    pub fn with_documents<'b>(&self, documents: &'b Documents) -> Cx<'b>
    where
        'a: 'b,
    {
        Cx {
            documents: Some(documents),
            ..*self
        }
    }

    /// The microbatch's packed documents, if the run keeps them apart.
    pub fn documents(&self) -> Option<&'a Documents> {
        self.documents
    }

    /// The same context with the microbatch's loss mask (the data's 0/1 weights of its
    /// targets, `[s, b]`).
    pub fn with_loss_mask<'b>(&self, mask: &'b Tensor) -> Cx<'b>
    where
        'a: 'b,
    {
        Cx {
            loss_mask: Some(mask),
            ..*self
        }
    }

    /// The microbatch's loss mask, with masked data (`None`: every target counts).
    pub fn loss_mask(&self) -> Option<&'a Tensor> {
        self.loss_mask
    }

    /// The same context decoding with `cache`: the forward's tokens run at positions
    /// [`KvCache::offset`] on, and attention appends their keys and values to the cache and
    /// attends to every cached position (an evaluation context: no dropout, no backward).
    pub fn with_kv_cache(&self, cache: &'a KvCache) -> Cx<'a> {
        Cx {
            kv_cache: Some(cache),
            training: false,
            ..*self
        }
    }

    /// The KV cache a decoding forward runs with, if any.
    pub fn kv_cache(&self) -> Option<&'a KvCache> {
        self.kv_cache
    }

    /// The position of this forward's first token: the cached positions when decoding, else 0.
    pub fn position_offset(&self) -> usize {
        self.kv_cache.map_or(0, KvCache::offset)
    }

    /// Where this rank's positions of a local sequence of `local` positions (its sequence, or
    /// with context parallelism its two chunks) lie in the whole sequence: with sequence
    /// parallelism only its shard of them; one run of positions per chunk they touch (from
    /// [`Cx::position_offset`] on without context parallelism).
    pub fn position_runs(&self, local: usize) -> Result<Vec<std::ops::Range<usize>>> {
        self.runs_of_positions(local, self.sequence_parallel())
    }

    /// [`Cx::position_runs`] of a value that holds the whole local sequence with sequence
    /// parallelism too (inside the tensor-parallel region: a column-parallel layer's gathered
    /// input, a row-parallel layer's input).
    pub fn whole_position_runs(&self, local: usize) -> Result<Vec<std::ops::Range<usize>>> {
        self.runs_of_positions(local, false)
    }

    /// [`Cx::position_runs`], this rank's sequence shard alone when `sharded`.
    fn runs_of_positions(
        &self,
        local: usize,
        sharded: bool,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        let rows = match sharded {
            true => {
                let tp = self.tp_size();
                if !local.is_multiple_of(tp) {
                    return invalid!(
                        "sequence parallelism splits the sequence of {local} positions over tp = \
                         {tp}: it does not divide"
                    );
                }
                self.tp_rank() * local / tp..(self.tp_rank() + 1) * local / tp
            }
            false => 0..local,
        };
        Ok(match self.cp_chunks(local)? {
            Some(chunks) => chunks.runs(rows),
            None => {
                let offset = self.position_offset();
                std::iter::once(offset + rows.start..offset + rows.end).collect()
            }
        })
    }

    /// The same context with `#[graph_scope(..)]` fields going through `graphs`.
    pub fn with_graphs(&self, graphs: &'a GraphRuntime) -> Cx<'a> {
        Cx {
            graphs: Some(graphs),
            ..*self
        }
    }

    /// The graph scopes' runtime, if any.
    pub fn graphs(&self) -> Option<&'a GraphRuntime> {
        self.graphs
    }

    /// The same context for a microbatch in in-flight slot `slot` (a pipeline's forward takes
    /// the lowest free slot of its chunk; its backward frees it).
    pub fn in_slot(&self, slot: usize) -> Cx<'a> {
        Cx {
            graph_slot: slot,
            ..*self
        }
    }

    /// This microbatch's in-flight slot.
    pub fn graph_slot(&self) -> usize {
        self.graph_slot
    }

    /// The same context with the routers' auxiliary losses (load balancing, z loss) entering
    /// the backward times `scale`: Megatron-LM's `MoEAuxLossAutoScaler` scale, the main loss's
    /// backward scale per micro-batch (loss scale / micro-batches of the global batch).
    pub fn with_aux_loss_scale(&self, scale: f32) -> Cx<'a> {
        Cx {
            aux_loss_scale: scale,
            ..*self
        }
    }

    /// The same context recording its passes into `trace` ([`crate::trace`]).
    pub fn with_trace(&self, trace: &'a crate::trace::Trace) -> Cx<'a> {
        Cx {
            trace: Some(trace),
            ..*self
        }
    }

    /// The trace the passes go to, if any.
    pub fn trace(&self) -> Option<&'a crate::trace::Trace> {
        self.trace
    }

    /// The backward scale of the routers' auxiliary losses (1 unless set).
    pub fn aux_loss_scale(&self) -> f32 {
        self.aux_loss_scale
    }

    /// The same context scaling [`crate::ops::aux_loss`]'s backward by `scale` for this
    /// micro-batch: with `--calculate-per-token-loss`, the loss scale times the micro-batch's
    /// counted tokens over the step's (Megatron-LM multiplies multi-token prediction's mean by
    /// the micro-batch's counted tokens, and divides every gradient by the step's).
    pub fn with_token_share_scale(&self, scale: f32) -> Cx<'a> {
        Cx {
            token_share_scale: Some(scale),
            ..*self
        }
    }

    /// The backward scale of [`crate::ops::aux_loss`]'s losses: the micro-batch's share of the
    /// step's counted tokens with `--calculate-per-token-loss`, else [`Cx::aux_loss_scale`].
    pub fn token_loss_scale(&self) -> f32 {
        self.token_share_scale.unwrap_or(self.aux_loss_scale)
    }

    /// The same context with MoE layers reporting their routing to `log`.
    pub fn with_routing_log(&self, log: &'a RoutingLog) -> Cx<'a> {
        Cx {
            routing_log: Some(log),
            ..*self
        }
    }

    /// Where MoE layers report their routing, if anywhere.
    pub fn routing_log(&self) -> Option<&'a RoutingLog> {
        self.routing_log
    }

    /// The same context with auxiliary losses ([`crate::ops::aux_loss`]) reporting to `log`.
    pub fn with_aux_loss_log(&self, log: &'a AuxLossLog) -> Cx<'a> {
        Cx {
            aux_loss_log: Some(log),
            ..*self
        }
    }

    /// Where auxiliary losses report their values, if anywhere.
    pub fn aux_loss_log(&self) -> Option<&'a AuxLossLog> {
        self.aux_loss_log
    }

    /// The expert-parallel communicator (the MoE dispatcher's all-to-alls).
    pub fn ep(&self) -> &'a dyn Communicator {
        self.parallel.comm(GroupKind::Ep)
    }

    /// The expert-tensor-parallel communicator (the experts' rows gathered and their partial
    /// outputs reduce-scattered).
    pub fn etp(&self) -> &'a dyn Communicator {
        self.parallel.comm(GroupKind::Etp)
    }

    /// The same context recomputing the activations `recompute` names in the backward.
    pub fn with_recompute(&self, recompute: Recompute) -> Cx<'a> {
        Cx { recompute, ..*self }
    }

    /// Which activations the backward recomputes.
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// The same context at another step and microbatch (dropout masks change with both).
    pub fn at(&self, step: u64, microbatch: u64) -> Cx<'a> {
        Cx {
            step,
            microbatch,
            ..*self
        }
    }

    /// The same context without dropout (evaluation, generation).
    pub fn eval(&self) -> Cx<'a> {
        Cx {
            training: false,
            ..*self
        }
    }

    /// Whether dropout is active.
    pub fn training(&self) -> bool {
        self.training
    }

    /// The rank's parallel state.
    pub fn parallel(&self) -> &'a ParallelState {
        self.parallel
    }

    /// The communicator of a group family.
    pub fn comm(&self, kind: GroupKind) -> &'a dyn Communicator {
        self.parallel.comm(kind)
    }

    /// The groups context-parallel attention exchanges keys and values over; `None` without
    /// context parallelism.
    pub fn cp_groups(&self) -> Option<&'a CpGroups> {
        self.parallel.context_parallel()
    }

    /// The tensor-parallel communicator.
    pub fn tp(&self) -> &'a dyn Communicator {
        self.parallel.tp()
    }

    /// This rank's tensor-parallel rank.
    pub fn tp_rank(&self) -> usize {
        self.parallel.groups().tp_rank()
    }

    /// The tensor-parallel size.
    pub fn tp_size(&self) -> usize {
        self.parallel.groups().config().tp
    }

    /// The context-parallel size (1 without context parallelism).
    pub fn cp_size(&self) -> usize {
        self.parallel.groups().config().cp
    }

    /// With context parallelism, where this rank's `local` positions lie in the sequence (its
    /// two chunks, or of every packed document: [`CpChunks::of_microbatch`]); `None` without
    /// it.
    pub fn cp_chunks(&self, local: usize) -> Result<Option<CpChunks>> {
        match self.cp_size() {
            1 => Ok(None),
            cp => Ok(Some(CpChunks::of_microbatch(
                local * cp,
                cp,
                self.parallel.groups().cp_rank(),
                self.documents,
            )?)),
        }
    }

    /// Whether sequence parallelism is on (`--sequence-parallel` with more than one
    /// tensor-parallel rank): outside the tensor-parallel regions this rank holds its shard of
    /// the sequence, `[s / tp, b, h]`.
    pub fn sequence_parallel(&self) -> bool {
        self.parallel.sequence_parallel()
    }

    /// The random stream of the dropout at `site` for this step and microbatch.
    pub fn dropout_stream(&self, site: Site) -> DropoutStream {
        if let Some(graphs) = self.graphs {
            graphs.note_random_draw(site);
        }
        DropoutStream::new(self.seed, &[self.step, self.microbatch, site.0])
    }
}

impl fmt::Debug for Cx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cx")
            .field("rank", &self.parallel.groups().rank())
            .field("seed", &self.seed)
            .field("step", &self.step)
            .field("microbatch", &self.microbatch)
            .field("training", &self.training)
            .finish()
    }
}

/// Marks the replicated parameters of `module`, a field that runs whole on every rank, as
/// living in the sequence-parallel region: with sequence parallelism it reads this rank's
/// shard of the sequence, so each rank's gradient is partial and is summed over tp (Megatron-LM's
/// `param.sequence_parallel`). Parameters whose gradient is whole on every rank (a row-parallel
/// bias, the expert bias), this rank's part (`#[local]`) or split are left as they are, so
/// that marking a whole sub-module again is harmless. The generated `build` of
/// `#[megatron::module]` calls it on every field without a split attribute: no such field can
/// train different weights on different ranks, whatever kind of layer it is.
pub fn sequence_parallel_region<M: Module>(module: &mut M) {
    module.visit_params_mut(&mut |p| p.mark_sequence_parallel_region());
}

/// Builds a field that runs whole on every rank (no split attribute): `M::build`, then its
/// parameters marked by [`sequence_parallel_region`].
pub fn build_whole<M: Module>(spec: &M::Spec, b: &mut Builder) -> Result<M> {
    let mut module = M::build(spec, b)?;
    sequence_parallel_region(&mut module);
    Ok(module)
}

/// Builds a `#[local]` field, a layer that runs on this rank's part of values split over tensor
/// parallelism: `M::build`, then every parameter marked as computing this rank's part of its
/// gradient ([`Param::mark_tensor_parallel_partial`]), to be summed over tp. A layer whose
/// parameters are split over tp cannot be local: its build fails naming the parameter.
pub fn build_local<M: Module>(spec: &M::Spec, b: &mut Builder) -> Result<M> {
    let mut module = M::build(spec, b)?;
    let mut failure = None;
    module.visit_params_mut(&mut |p| {
        if failure.is_none()
            && let Err(e) = p.mark_tensor_parallel_partial()
        {
            failure = Some(e);
        }
    });
    failure.map_or(Ok(module), |e| {
        Err(crate::Error::Invalid(format!(
            "#[local] runs on this rank's part of a split value: {e}"
        )))
    })
}

/// Anything with parameters that is built from a spec: layers and `#[megatron::module]` structs.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a module: a field without an attribute is built and run whole on \
               every rank",
    label = "neither a layer nor a `#[megatron::module]` struct",
    note = "mark a parameterless op (an `Op`, such as `CausalSelfAttention`) #[op], plain data \
            #[config], a layer split over tensor parallelism #[column_parallel] or \
            #[row_parallel]; a struct of your own becomes a module with #[megatron::module]"
)]
pub trait Module: Sized {
    /// The logical description (sizes, options) the module is built from.
    type Spec: Clone + fmt::Debug;
    /// What a forward keeps for its backward.
    type Saved;

    /// Whether backward reads its output gradient only as a product's operand (a linear layer,
    /// or a module whose output is one's), so that a caller may hand that gradient over in the
    /// products' dtype ([`crate::ops::operand_dtype`]). Generated modules derive it from their
    /// forward: true when the output is a linear layer's (or such a module's) with one use.
    const GRADIENT_FEEDS_PRODUCTS: bool = false;

    /// Whether a `#[graph_scope]` may capture the module whole: false when it holds a
    /// collective whose sizes are known only at run time or reads values back to the host (an
    /// `#[expert_parallel]` layer's dispatch). Generated modules derive it from their fields.
    const CAPTURABLE: bool = true;

    /// Builds the module unsharded (replicated), naming its parameters under `b`'s scope.
    fn build(spec: &Self::Spec, b: &mut Builder) -> Result<Self>;

    /// Calls `f` on every parameter, in a fixed order.
    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param));

    /// Calls `f` on every parameter, mutably, in the same order.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param));

    /// Calls `f` on every parameter that trains (not frozen), in visit order: those the flat
    /// buffers, the optimizer and the gradient reductions hold.
    fn visit_trainable_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        self.visit_params(&mut |p| {
            if !p.is_frozen() {
                f(p)
            }
        });
    }

    /// Calls `f` on every parameter held by a module of a stack (a `Vec` field the forward
    /// loops over), in visit order, with the number of its module: the units of gathering of
    /// sharded parameters ([`crate::distributed::ParamUnits`]; the other parameters are the
    /// root unit's). The modules are numbered in visit order from `*units + 1` on, `*units`
    /// left at the last. A module without stacks visits none (the default).
    fn visit_stacked_params<'s>(
        &'s self,
        _units: &mut usize,
        _f: &mut dyn FnMut(&'s Param, usize),
    ) {
    }

    /// Calls `f` on every frozen parameter, in visit order.
    fn visit_frozen_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        self.visit_params(&mut |p| {
            if p.is_frozen() {
                f(p)
            }
        });
    }

    /// Freezes every parameter whose spec `which` picks (see [`ParamSpec::frozen`]); returns
    /// how many it froze.
    fn freeze(&mut self, which: &dyn Fn(&ParamSpec) -> bool) -> usize {
        let mut frozen = 0;
        self.visit_params_mut(&mut |p| {
            if !p.is_frozen() && which(p.spec()) {
                p.freeze();
                frozen += 1;
            }
        });
        frozen
    }

    /// Calls `f` on the parameters that a pipeline's first and last stages both hold and keep
    /// equal when the module is used before and after the stack (a tied embedding's table):
    /// all of them unless the module says otherwise (an untied embedding: none, each stage
    /// holding its own table).
    fn visit_tied_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        self.visit_params(f);
    }
}

/// A module whose forward runs a `#[pipeline]` stack, built for one pipeline stage (or whole):
/// `#[megatron::module]` implements it, with the parts of the forward a stage runs
/// (`forward_pre`, `forward_layers`, `forward_post` and their backwards).
pub trait Pipelined: Module {
    /// What this instance holds: its run of the stack, and whether it is the first or the last
    /// virtual stage.
    fn stage(&self) -> &crate::pipeline_parallel::StagePart;

    /// Calls `f` on the parameters both the first and the last stage hold (the fields used before
    /// and after the stack: a tied embedding). Their gradients are summed over the embedding
    /// group (the two stages) every step, so that the copies stay equal.
    fn visit_shared_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param));
}

/// Moves every parameter of `model` to `gpu`: values copied, gradients zeroed, each in its own
/// device tensor (a model packed into flat buffers moves with [`crate::distributed::ParamBuffers::to_gpu`] instead).
pub fn params_to_gpu<M: Module>(model: &mut M, gpu: &crate::cuda::Gpu) -> Result<()> {
    params_to_gpu_with_copies(model, gpu, None)
}

/// [`params_to_gpu`], each parameter also given a compute copy in `compute` when it is given
/// (the bf16 copies products read in mixed-precision training).
pub fn params_to_gpu_with_copies<M: Module>(
    model: &mut M,
    gpu: &crate::cuda::Gpu,
    compute: Option<crate::tensor::DType>,
) -> Result<()> {
    let mut failure = None;
    model.visit_params_mut(&mut |p| {
        if failure.is_some() {
            return;
        }
        let moved = (|| -> Result<()> {
            let value = p.value().to_gpu(gpu)?;
            if p.is_frozen() {
                let value = compute.map_or(Ok(value.clone()), |dtype| value.to_dtype(dtype))?;
                return p.rebind_frozen(value);
            }
            let grad = Tensor::zeros_on(p.grad().shape().clone(), p.grad().dtype(), gpu)?;
            let copy = compute.map(|dtype| value.to_dtype(dtype)).transpose()?;
            p.rebind(value, grad, copy)
        })();
        if let Err(e) = moved {
            failure = Some(e);
        }
    });
    failure.map_or(Ok(()), Err)
}

/// A layer used whole on every tensor-parallel rank, one tensor in and one out (norms, plain linears).
pub trait Layer: Module {
    /// Computes the output and what the backward needs.
    fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, Self::Saved)>;
    /// Accumulates parameter gradients and returns the input gradient.
    fn backward(&self, cx: &Cx, site: Site, saved: Self::Saved, dy: &Tensor) -> Result<Tensor>;
    /// [`Layer::backward`] plus `plus`, the gradient the input already has from another use:
    /// `plus + dx`, which generated code computes this way when the layer's input has several
    /// uses and this one is the first (a pre-norm block's input: the norm and the residual;
    /// with more uses, `plus` is the others' gradients summed). Layers whose input
    /// gradient kernel can add it in its own pass override this; the result must equal the
    /// default's.
    fn backward_plus(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
        plus: &Tensor,
    ) -> Result<Tensor> {
        let dx = self.backward(cx, site, saved, dy)?;
        crate::ops::add(plus, &dx)
    }
}

/// A layer whose input is token ids (no input gradient), used whole on every rank.
pub trait Lookup: Module {
    /// Computes the output and what the backward needs.
    fn forward(&self, cx: &Cx, site: Site, ids: &Ids) -> Result<(Tensor, Self::Saved)>;
    /// Accumulates parameter gradients.
    fn backward(&self, cx: &Cx, site: Site, saved: Self::Saved, dy: &Tensor) -> Result<()>;
}

/// A layer whose output features are split over the tensor-parallel group (`#[column_parallel]`).
///
/// Generated code surrounds it with Megatron's f operator: identity in forward, all-reduce of the
/// input gradient in backward; with `gather_output`, an all-gather of the output follows.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be split by #[column_parallel]",
    label = "not a layer with output features to split",
    note = "#[column_parallel] applies to layers such as `Linear`; modules split their own layers"
)]
pub trait ColumnParallel: Module {
    /// Builds this rank's part: output features `rank·n/tp .. (rank+1)·n/tp`.
    fn build_column(spec: &Self::Spec, b: &mut Builder) -> Result<Self>;
    /// The LoRA adapter beside this layer, when it carries one
    /// ([`crate::tensor_parallel::lora`]); the generated code runs it, with its collectives.
    fn lora(&self) -> Option<&crate::tensor_parallel::lora::LoraAdapter> {
        None
    }
    /// What forward kept, with the adapter's whole down-projection `a` kept too (B's gradient
    /// reads it).
    fn keep_lora(saved: Self::Saved, _a: Tensor) -> Self::Saved {
        saved
    }
    /// The input the adapter's A read (as the layer keeps it) and the kept down-projection,
    /// when forward kept them.
    fn lora_kept(_saved: &Self::Saved) -> Option<(&Tensor, &Tensor)> {
        None
    }

    /// Computes this rank's output features from the whole input.
    fn forward_column(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, Self::Saved)>;
    /// The split backward: this rank's partial input gradient, and the weight gradients to run
    /// now or later ([`Cx::weight_gradient`]).
    fn backward_column_input(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)>;
    /// Accumulates this rank's parameter gradients (through [`Cx::weight_gradient`]) and returns
    /// its partial input gradient.
    fn backward_column(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let (dx, w) = self.backward_column_input(cx, site, saved, dy)?;
        cx.weight_gradient(w)?;
        Ok(dx)
    }
    /// What `forward_column` kept with its kept input (the whole input, read by the weight's
    /// gradient) replaced by `f` of it: with sequence parallelism the generated code keeps this
    /// rank's shard of the sequence instead of the gathered whole, and gathers it again before
    /// `backward_column`, as Megatron-LM's column-parallel layer does.
    fn map_kept_input(
        saved: Self::Saved,
        f: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Self::Saved>;
}

/// A layer whose input features are split over the tensor-parallel group (`#[row_parallel]`).
///
/// Generated code follows its partial output with Megatron's g operator (all-reduce in forward,
/// identity in backward), then adds the replicated bias.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be split by #[row_parallel]",
    label = "not a layer with input features to split",
    note = "#[row_parallel] applies to layers such as `Linear`; modules split their own layers"
)]
pub trait RowParallel: Module {
    /// Builds this rank's part: input features `rank·n/tp .. (rank+1)·n/tp`; the bias is whole.
    fn build_row(spec: &Self::Spec, b: &mut Builder) -> Result<Self>;
    /// The LoRA adapter beside this layer, when it carries one
    /// ([`crate::tensor_parallel::lora`]); the generated code runs it, with its collectives.
    fn lora(&self) -> Option<&crate::tensor_parallel::lora::LoraAdapter> {
        None
    }
    /// What forward kept, with the adapter's whole down-projection `a` kept too (B's gradient
    /// reads it).
    fn keep_lora(saved: Self::Saved, _a: Tensor) -> Self::Saved {
        saved
    }
    /// The input the adapter's A read (as the layer keeps it) and the kept down-projection,
    /// when forward kept them.
    fn lora_kept(_saved: &Self::Saved) -> Option<(&Tensor, &Tensor)> {
        None
    }

    /// Computes this rank's partial output (no bias) from its slice of the input features;
    /// with one tensor-parallel rank, whose output is whole, it may add the bias itself (in the
    /// product's epilogue on a GPU), and then [`RowParallel::add_bias`] adds nothing.
    fn forward_row(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, Self::Saved)>;
    /// Adds the bias, in place, to the all-reduced output, unless `forward_row` added it.
    fn add_bias(&self, cx: &Cx, y: &Tensor) -> Result<()>;
    /// The split backward: the gradient of this rank's input slice, and the weight gradients to
    /// run now or later ([`Cx::weight_gradient`]).
    fn backward_row_input(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)>;
    /// Accumulates parameter gradients (through [`Cx::weight_gradient`]) and returns the
    /// gradient of this rank's input slice.
    fn backward_row(&self, cx: &Cx, site: Site, saved: Self::Saved, dy: &Tensor) -> Result<Tensor> {
        let (dx, w) = self.backward_row_input(cx, site, saved, dy)?;
        cx.weight_gradient(w)?;
        Ok(dx)
    }
}

/// A module whose output is a row-parallel layer's (`#[partial_output]` in its caller):
/// `#[megatron::module]` implements it for a module whose forward returns a `#[row_parallel]`
/// layer's output, used once. The caller sums its partial output with the other partial
/// outputs it is added to and reduces them once (Megatron-LM's g: all-reduce, or with sequence
/// parallelism reduce-scatter), then adds each one's bias; in backward it gathers the output
/// gradient once for all of them.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be #[partial_output]: its forward does not end in a row-parallel layer",
    label = "its output is not a #[row_parallel] layer's",
    note = "a module is #[partial_output] when its forward returns the output of a #[row_parallel] \
            layer (with its input split), used nowhere else, from one `Tensor` input"
)]
pub trait PartialOutput: Module {
    /// The forward with its last layer's partial output unreduced and without its bias.
    fn forward_partial(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, Self::Saved)>;
    /// Adds the last layer's bias, in place, to the reduced output.
    fn add_output_bias(&self, cx: &Cx, y: &Tensor) -> Result<()>;
    /// The backward of [`PartialOutput::forward_partial`] from the whole output gradient (with
    /// sequence parallelism, gathered): returns the input's gradient.
    fn backward_partial(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
    ) -> Result<Tensor>;
}

/// An embedding whose vocabulary rows are split over the tensor-parallel group (`#[vocab_parallel]`).
///
/// Generated code all-reduces the lookup's partial output; `self.field.logits(h)` is the tied
/// output layer (f before it), whose output stays split by vocabulary for the fused cross-entropy.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be split by #[vocab_parallel]",
    label = "not an embedding with vocabulary rows to split"
)]
pub trait VocabParallel: Module {
    /// What the tied output layer keeps for its backward.
    type LogitsSaved;
    /// Whether `logits_backward` reads the logits' gradient only as a product's operand, so
    /// that the cross-entropy may write it in the products' dtype.
    const LOGITS_GRADIENT_FEEDS_PRODUCTS: bool = false;
    /// Builds this rank's rows of the padded vocabulary.
    fn build_vocab(spec: &Self::Spec, b: &mut Builder) -> Result<Self>;
    /// Looks up ids in this rank's rows (zeros for other ranks' ids): a partial output.
    fn forward_vocab(&self, cx: &Cx, site: Site, ids: &Ids) -> Result<(Tensor, Self::Saved)>;
    /// Accumulates the gradient of this rank's rows.
    fn backward_vocab(&self, cx: &Cx, site: Site, saved: Self::Saved, dy: &Tensor) -> Result<()>;
    /// Logits of this rank's vocabulary slice (padding rows masked to −∞) from the whole input.
    fn logits_forward(
        &self,
        cx: &Cx,
        site: Site,
        h: &Tensor,
    ) -> Result<(Tensor, Self::LogitsSaved)>;
    /// The split backward of the tied output layer: its partial input gradient, and the row
    /// gradients to run now or later ([`Cx::weight_gradient`]).
    fn logits_backward_input(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::LogitsSaved,
        dlogits: &Tensor,
    ) -> Result<(Tensor, WeightGrad)>;
    /// Accumulates this rank's row gradients (through [`Cx::weight_gradient`]) and returns its
    /// partial input gradient.
    fn logits_backward(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::LogitsSaved,
        dlogits: &Tensor,
    ) -> Result<Tensor> {
        let (dx, w) = self.logits_backward_input(cx, site, saved, dlogits)?;
        cx.weight_gradient(w)?;
        Ok(dx)
    }
    /// What `logits_forward` kept with its kept input replaced by `f` of it: with sequence
    /// parallelism the generated code keeps this rank's shard of the sequence and gathers it
    /// again before `logits_backward` (as [`ColumnParallel::map_kept_input`]).
    fn map_kept_logits_input(
        saved: Self::LogitsSaved,
        f: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Self::LogitsSaved>;
}

/// A parameterless operation with a hand-written forward and backward (`#[op]` fields): the
/// escape hatch for anything the DSL's primitives do not cover, e.g. attention over heads.
///
/// An op works on whatever this rank holds: given tensor-parallel (split) input it returns split
/// output.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an op",
    label = "#[op] fields must implement `megatron::module::Op`"
)]
pub trait Op: Clone + fmt::Debug {
    /// What the forward keeps for the backward.
    type Saved;
    /// Computes the output.
    fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, Self::Saved)>;
    /// Returns the input gradient.
    fn backward(&self, cx: &Cx, site: Site, saved: Self::Saved, dy: &Tensor) -> Result<Tensor>;
}

/// An op of several tensors: an `#[op]` field called with two or more arguments
/// (`self.attend(q, k, v)`). Its inputs must be sharded alike (all replicated, or all split over
/// tensor parallelism: it works on each rank's part), and so is its output.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is called with several tensors but takes one",
    label = "not an op of several inputs (`MultiOp`)",
    note = "call it with one tensor, or implement `megatron::module::MultiOp` for an op of several"
)]
pub trait MultiOp: Clone + fmt::Debug {
    /// What the forward keeps for the backward.
    type Saved;
    /// Computes the output from the inputs, in the order of the call.
    fn forward(&self, cx: &Cx, site: Site, xs: &[&Tensor]) -> Result<(Tensor, Self::Saved)>;
    /// Returns each input's gradient, in order.
    fn backward(&self, cx: &Cx, site: Site, saved: Self::Saved, dy: &Tensor)
    -> Result<Vec<Tensor>>;
}

/// The `N` gradients an op's backward returned, or an error naming the op and the counts.
pub fn gradients<const N: usize>(op: &str, grads: Vec<Tensor>) -> Result<[Tensor; N]> {
    let got = grads.len();
    grads.try_into().map_err(|_| {
        crate::error::Error::Invalid(format!(
            "the backward of `{op}` returned {got} gradients for its {N} inputs"
        ))
    })
}

/// How a tensor is held across the tensor-parallel group (what generated code tells primitives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Every rank holds the whole tensor (outside the tensor-parallel region: with sequence
    /// parallelism, its shard of the sequence).
    Replicated,
    /// Each rank holds its consecutive slice of the last dimension (inside the region: the
    /// whole sequence).
    SplitLastDim,
    /// Every rank holds the whole tensor and the whole sequence, with sequence parallelism too
    /// (inside the region: a column-parallel layer's gathered input).
    Gathered,
}
