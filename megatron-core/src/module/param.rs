//! Parameters: local shards of logical tensors, their gradients, and how they were split.

use std::sync::Arc;

use rayon::prelude::*;

use crate::distributed::{GradSync, ParamGather, ParamUnits};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::LogicalIndex;
use crate::kernels::parallel;
use crate::parallel::GroupKind;
use crate::pipeline_parallel::StagePart;
use crate::rng::{philox4x32_10, stream_id};
use crate::tensor::{DType, Shape, Tensor};

/// How a parameter's logical tensor is divided over a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Dimension `dim` is cut into equal consecutive parts, one per rank of `group`.
    Dim {
        /// The split dimension.
        dim: usize,
        /// The group whose ranks hold the parts.
        group: GroupKind,
    },
    /// Dimension `dim` holds `blocks` equal blocks side by side (a gated MLP's first layer:
    /// the gate's rows, then the up projection's), and each block is cut into equal
    /// consecutive parts over `group`: a rank holds its part of every block, in block order
    /// (Megatron-LM's `stride`, its `linear_fc1` with `--swiglu`).
    Strided {
        /// The split dimension.
        dim: usize,
        /// The group whose ranks hold the parts.
        group: GroupKind,
        /// The blocks along `dim`.
        blocks: usize,
    },
    /// Experts' weights `[experts, ..]`: dimension 0 (the expert) cut over expert parallelism
    /// and, in each expert, dimension `dim` over expert tensor parallelism (the expert's
    /// column- or row-parallel split), as `blocks` blocks each cut as [`Split::Strided`]'s
    /// (gated experts' fc1: 2). Part `ep_rank · etp + etp_rank` of `ep · etp`: the rank's
    /// index in the expert model-parallel group.
    Experts {
        /// The dimension split over expert tensor parallelism (at least 1).
        dim: usize,
        /// The blocks along `dim` (1: one consecutive part per rank).
        blocks: usize,
    },
    /// A fused QKV projection's rows (dimension 0: `groups` blocks of `per_group` query heads,
    /// a key and a value, `head_dim` rows each) over tensor parallelism of more ranks than
    /// key/value groups: each rank holds its share of one group's queries, then that group's
    /// key and value, which the tp / groups ranks of the group each hold (their gradients
    /// summed over them, the copy written by the group's first rank).
    QueryGroups {
        /// Key/value groups.
        groups: usize,
        /// Query heads per group.
        per_group: usize,
        /// Rows per head.
        head_dim: usize,
    },
}

impl Split {
    /// The group whose ranks hold the parts (`None` when replicated; experts' weights: the
    /// expert model-parallel group, whose index is the part's).
    pub fn group(&self) -> Option<GroupKind> {
        match *self {
            Split::Replicated => None,
            Split::Dim { group, .. } | Split::Strided { group, .. } => Some(group),
            Split::Experts { .. } => Some(GroupKind::EtpEp),
            Split::QueryGroups { .. } => Some(GroupKind::Tp),
        }
    }
}

/// One run of a rank's part of a parameter: `len` local elements from `local` on hold the
/// logical elements from `logical` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// The first local element.
    pub local: usize,
    /// Its logical element.
    pub logical: u64,
    /// Elements.
    pub len: usize,
    /// Whether this rank writes the run to checkpoints (not a copy another rank writes: a
    /// query group's key and value on its other ranks).
    pub owned: bool,
}

/// Where a rank's part of a parameter lies in the logical tensor: consecutive pieces of its
/// local elements, each laid out as a [`LogicalIndex`] says.
#[derive(Debug, Clone)]
pub struct PartIndex {
    pieces: Vec<(LogicalIndex, bool)>,
}

impl PartIndex {
    /// One piece, owned.
    fn affine(index: LogicalIndex) -> PartIndex {
        PartIndex {
            pieces: vec![(index, true)],
        }
    }

    /// Local elements.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|(i, _)| i.outer * i.inner).sum()
    }

    /// Whether the part is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The runs of logical elements that local elements `range` hold, in local order.
    pub fn runs(&self, range: std::ops::Range<usize>) -> Vec<Run> {
        let mut out = Vec::new();
        let mut base = 0;
        for &(index, owned) in &self.pieces {
            let inner = index.inner.max(1);
            let end = base + index.outer * index.inner;
            let mut k = range.start.max(base);
            while k < range.end.min(end) {
                let (o, i) = ((k - base) / inner, (k - base) % inner);
                let len = (inner - i).min(range.end.min(end) - k);
                out.push(Run {
                    local: k,
                    logical: index.logical(o, i),
                    len,
                    owned,
                });
                k += len;
            }
            base = end;
        }
        out
    }

    /// The runs of every local element.
    pub fn all_runs(&self) -> Vec<Run> {
        self.runs(0..self.len())
    }
}

/// How a parameter's logical values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// Every element this value.
    Constant(f32),
}

impl Init {
    /// All zeros.
    pub const ZEROS: Init = Init::Constant(0.0);
    /// All ones.
    pub const ONES: Init = Init::Constant(1.0);
}

/// Everything known about one parameter: its name, logical and local shapes and its split.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Dotted name, e.g. `blocks.3.mlp.fc1.weight`.
    pub name: String,
    /// Shape of the whole (unsharded) tensor.
    pub logical: Shape,
    /// Shape of this rank's part.
    pub local: Shape,
    /// How the logical tensor is divided.
    pub split: Split,
    /// This rank's index among the parts (0 when replicated).
    pub part: usize,
    /// Number of parts (1 when replicated).
    pub parts: usize,
    /// How the logical values are drawn.
    pub init: Init,
    /// Whether weight decay applies (not to biases and norms).
    pub weight_decay: bool,
    /// For a padded vocabulary: the rows of dimension 0 that hold real values (the rest are
    /// padding, never used, and not saved).
    pub real_rows: Option<usize>,
    /// Whether the parameter lives in the sequence-parallel region (Megatron-LM's
    /// `param.sequence_parallel`: norms, and the layers that read the activations' sequence
    /// shards): replicated over tp, but with sequence parallelism each rank's gradient comes
    /// from its shard of the sequence, so the gradients are summed over tp.
    pub sequence_parallel: bool,
    /// Whether each tensor-parallel rank's gradient comes from its own heads (a `#[local]`
    /// layer's replicated parameters: the qk-layernorm): summed over tp, with or without
    /// sequence parallelism.
    pub tensor_parallel_partial: bool,
    /// Whether each tensor-parallel rank's gradient is already the whole one, with sequence
    /// parallelism too (a row-parallel layer's bias, from the gathered output gradient; a
    /// value no gradient trains, such as the MoE expert bias): never summed over tp, nor marked
    /// as living in the sequence-parallel region by [`crate::module::sequence_parallel_region`].
    pub gradient_whole_over_tp: bool,
    /// Whether the parameter is frozen (a fine-tuning's base weights): it has no gradient, no
    /// optimizer state and no place in the data-parallel reduction or the gradient norm, and
    /// the layers that own it skip its weight-gradient pass (the input gradient still flows).
    pub frozen: bool,
}

impl ParamSpec {
    /// Whether this is an expert's parameter (split over expert parallelism): its gradient is
    /// reduced over the expert data-parallel group, in buffers of its own.
    pub fn is_expert(&self) -> bool {
        matches!(
            self.split,
            Split::Experts { .. }
                | Split::Dim {
                    group: GroupKind::Ep | GroupKind::Etp | GroupKind::EtpEp,
                    ..
                }
                | Split::Strided {
                    group: GroupKind::Ep | GroupKind::Etp | GroupKind::EtpEp,
                    ..
                }
        )
    }

    /// The local elements that copy what another rank holds and counts (written to
    /// checkpoints, in the gradient norm) instead of this one: a query group's key and value on
    /// every rank of the group but the first ([`Split::QueryGroups`]); empty for other splits.
    pub fn copied(&self) -> std::ops::Range<usize> {
        let n = self.local.numel();
        if !matches!(self.split, Split::QueryGroups { .. }) {
            return n..n;
        }
        self.part_index()
            .all_runs()
            .into_iter()
            .find(|r| !r.owned)
            .map_or(n..n, |r| r.local..r.local + r.len)
    }

    /// Where this rank's part lies in the logical tensor.
    pub fn part_index(&self) -> PartIndex {
        if let Split::QueryGroups {
            groups,
            per_group,
            head_dim,
        } = self.split
        {
            // Rank r of the tp ranks holds group r / R's queries j·q .. (j + 1)·q (j = r % R,
            // R = tp / groups, q = per_group / R), then the group's key and value.
            let ranks = (self.parts / groups.max(1)).max(1);
            let (group, j) = (self.part / ranks, self.part % ranks);
            let inner: usize = self.logical.dims()[1..].iter().product();
            let queries = per_group / ranks;
            let block = group * (per_group + 2) * head_dim;
            return PartIndex {
                pieces: vec![
                    (
                        LogicalIndex::range(
                            ((block + j * queries * head_dim) * inner) as u64,
                            queries * head_dim * inner,
                        ),
                        true,
                    ),
                    (
                        LogicalIndex::range(
                            ((block + per_group * head_dim) * inner) as u64,
                            2 * head_dim * inner,
                        ),
                        j == 0,
                    ),
                ],
            };
        }
        PartIndex::affine(self.logical_index())
    }

    /// Where this rank's part lies in the logical tensor, element by element, for the splits of
    /// one affine piece (every split but [`Split::QueryGroups`], whose [`ParamSpec::part_index`]
    /// has two).
    fn logical_index(&self) -> LogicalIndex {
        let dims = self.logical.dims();
        match self.split {
            Split::Replicated => LogicalIndex::contiguous(self.local.numel()),
            Split::Dim { dim, .. } => {
                let inner: usize = dims[dim + 1..].iter().product();
                let local_dim = self.local.dims()[dim];
                LogicalIndex {
                    outer: dims[..dim].iter().product(),
                    inner: local_dim * inner,
                    logical_stride: (dims[dim] * inner) as u64,
                    logical_start: (self.part * local_dim * inner) as u64,
                }
            }
            Split::Strided { dim, blocks, .. } => {
                // Dimension `dim` seen as [blocks, block]: the block index joins the outer
                // loop, and the rank's part sits at the same place in every block.
                let inner: usize = dims[dim + 1..].iter().product();
                let local_block = self.local.dims()[dim] / blocks;
                LogicalIndex {
                    outer: dims[..dim].iter().product::<usize>() * blocks,
                    inner: local_block * inner,
                    logical_stride: (dims[dim] / blocks * inner) as u64,
                    logical_start: (self.part * local_block * inner) as u64,
                }
            }
            Split::Experts { dim, blocks } => {
                // The expert-parallel part offsets whole experts; the expert-tensor-parallel
                // part, dimension `dim` inside each, seen as [blocks, block] (the block index
                // joins the outer loop, the rank's part sits at the same place in each).
                let local = self.local.dims();
                let blocks = blocks.max(1);
                let etp = dims[dim] / local[dim].max(1);
                let (ep_part, etp_part) = (self.part / etp.max(1), self.part % etp.max(1));
                let inner: usize = dims[dim + 1..].iter().product();
                let expert: usize = dims[1..].iter().product();
                let local_block = local[dim] / blocks;
                LogicalIndex {
                    outer: local[..dim].iter().product::<usize>() * blocks,
                    inner: local_block * inner,
                    logical_stride: (dims[dim] / blocks * inner) as u64,
                    logical_start: (ep_part * local[0] * expert + etp_part * local_block * inner)
                        as u64,
                }
            }
            Split::QueryGroups { .. } => LogicalIndex::contiguous(0),
        }
    }
}

/// A parameter: this rank's part of its values and of its gradient.
///
/// Both are tensors that may view flat buffers shared by all parameters (see
/// [`crate::distributed::ParamBuffers`]); gradients accumulate (`+=`) until the optimizer zeroes them.
#[derive(Debug, Clone)]
pub struct Param {
    value: Tensor,
    grad: Tensor,
    /// A lower-precision copy of `value` that products read (bf16 weights next to f32 master
    /// values), kept current by whoever owns the flat buffers (see
    /// [`crate::distributed::ParamBuffers::keep_compute_copies`]).
    compute: Option<Tensor>,
    spec: Arc<ParamSpec>,
    /// Where each write of the gradient is reported, with the parameter's slot there
    /// (`--overlap-grad-reduce`, [`GradSync`]).
    reports_to: Option<(Arc<GradSync>, usize)>,
    /// What each read of the values waits for first, with the parameter's slot there
    /// (`--overlap-param-gather`, [`ParamGather`]).
    read_after: Option<(Arc<ParamGather>, usize)>,
    /// The gatherer of the sharded values' units holding it, with the parameter's slot there
    /// (`optim_grads_params`, [`ParamUnits`]).
    unit: Option<(Arc<ParamUnits>, usize)>,
}

impl Param {
    /// A parameter with the given values and a zero gradient of the same shape.
    pub fn new(spec: ParamSpec, value: Tensor) -> Result<Param> {
        if value.shape() != &spec.local {
            return invalid!(
                "parameter {}: values of shape {} but local shape {}",
                spec.name,
                value.shape(),
                spec.local
            );
        }
        let grad = Tensor::zeros(spec.local.clone(), DType::F32);
        Ok(Param {
            value,
            grad,
            compute: None,
            spec: Arc::new(spec),
            reports_to: None,
            read_after: None,
            unit: None,
        })
    }

    /// A parameter that holds its spec and no values (empty value and gradient tensors), for
    /// listing a model's parameters without their memory ([`Builder::specs_only`]).
    fn spec_only(spec: ParamSpec, dtype: DType) -> Param {
        Param {
            value: Tensor::zeros([0], dtype),
            grad: Tensor::zeros([0], DType::F32),
            compute: None,
            spec: Arc::new(spec),
            reports_to: None,
            read_after: None,
            unit: None,
        }
    }

    /// This rank's values (once the data-parallel gather of their bucket, if one is in flight,
    /// has arrived: see [`Param::read_after`]).
    pub fn value(&self) -> &Tensor {
        if let Some((gather, slot)) = &self.read_after {
            gather.before_read(*slot);
        }
        &self.value
    }

    /// What products read for this parameter: its compute copy (e.g. bf16 weights of a
    /// mixed-precision run, see [`crate::distributed::ParamBuffers::keep_compute_copies`]) when it
    /// has one, else its values.
    pub fn compute_value(&self) -> &Tensor {
        match &self.compute {
            Some(compute) => {
                if let Some((gather, slot)) = &self.read_after {
                    gather.before_read(*slot);
                }
                compute
            }
            None => self.value(),
        }
    }

    /// Copies `values` into this rank's values and into the compute copy, if any.
    pub fn set_values(&self, values: &Tensor) -> Result<()> {
        self.value.copy_from(values)?;
        if let Some(compute) = &self.compute {
            compute.copy_from(values)?;
        }
        Ok(())
    }

    /// This rank's gradient (f32, or 16-bit with mixed precision), accumulated by backward
    /// passes.
    pub fn grad(&self) -> &Tensor {
        &self.grad
    }

    /// Runs `f` on the gradient as an f32 tensor, for kernels that accumulate in f32: the
    /// gradient itself, or for a 16-bit gradient a widened copy that is rounded back after
    /// (Megatron-LM's 16-bit `main_grad` accumulation, computed in f32 on the CPU). A frozen
    /// parameter has no gradient: `f` is not run, and neither is the product it would compute.
    pub fn accumulate_grad(&self, f: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
        if self.spec.frozen {
            return Ok(());
        }
        self.gradient_to_be_written()?;
        if self.grad.dtype() == DType::F32 {
            f(&self.grad)?;
        } else {
            let wide = self.grad.to_dtype(DType::F32)?;
            f(&wide)?;
            self.grad.copy_from(&wide)?;
        }
        self.gradient_written()
    }

    /// Reports a write of the gradient to the reducer the parameter is bound to, if any (see
    /// [`Param::report_writes_to`]); every writer of a gradient calls it once per write.
    pub(crate) fn gradient_written(&self) -> Result<()> {
        match &self.reports_to {
            Some((sync, slot)) => sync.written(*slot),
            None => Ok(()),
        }
    }

    /// Tells the reducer the parameter is bound to, if any, that its gradient is about to be
    /// written: with sharded gradients, a reduction of its bucket still in flight is waited
    /// for first. Every writer of a gradient calls it once before each write.
    pub(crate) fn gradient_to_be_written(&self) -> Result<()> {
        match &self.reports_to {
            Some((sync, slot)) => sync.before_write(*slot),
            None => Ok(()),
        }
    }

    /// From now on reports each write of the gradient to `sync` as slot `slot`, for the
    /// overlapped reduction of its bucket ([`GradSync`]); a rebinding ends it.
    pub fn report_writes_to(&mut self, sync: Arc<GradSync>, slot: usize) {
        self.reports_to = Some((sync, slot));
    }

    /// From now on each read of the values first waits, through `gather`, for the data-parallel
    /// all-gather of the bucket holding slot `slot` (`--overlap-param-gather`,
    /// [`ParamGather`]); a rebinding ends it.
    pub fn read_after(&mut self, gather: Arc<ParamGather>, slot: usize) {
        self.read_after = Some((gather, slot));
    }

    /// From now on the parameter's values are sharded and gathered by `units`' units, where
    /// it is slot `slot` (`optim_grads_params`, [`ParamUnits`]); a rebinding ends it.
    pub fn gathered_by(&mut self, units: Arc<ParamUnits>, slot: usize) {
        self.unit = Some((units, slot));
    }

    /// The parameter's slot in `units`, when they gather it.
    pub fn unit_slot(&self, units: &ParamUnits) -> Option<usize> {
        self.unit
            .as_ref()
            .filter(|(u, _)| std::ptr::eq(Arc::as_ptr(u), units))
            .map(|(_, slot)| *slot)
    }

    /// Runs `f` on the gradient as [`Param::accumulate_grad`] does, or for a frozen parameter
    /// on a zeroed scratch of its local shape, dropped after: for kernels that compute the
    /// input gradient in the same pass as the weight's (the norms), which must still run.
    pub fn accumulate_grad_or_scratch(&self, f: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
        if !self.spec.frozen {
            return self.accumulate_grad(f);
        }
        let scratch = Tensor::empty_near(self.spec.local.clone(), DType::F32, &self.value)?;
        scratch.fill(0.0)?;
        f(&scratch)
    }

    /// Whether the parameter is frozen ([`ParamSpec::frozen`]).
    pub fn is_frozen(&self) -> bool {
        self.spec.frozen
    }

    /// Freezes the parameter: its gradient is dropped and never accumulated again; its values
    /// stay as they are (see [`ParamSpec::frozen`]).
    pub fn freeze(&mut self) {
        if !self.spec.frozen {
            Arc::make_mut(&mut self.spec).frozen = true;
            self.grad = Tensor::zeros([0], DType::F32);
        }
    }

    /// Replaces a frozen parameter's values (e.g. by a 16-bit copy, or the same values on a
    /// device): it has no gradient and reads no compute copy.
    pub fn rebind_frozen(&mut self, value: Tensor) -> Result<()> {
        if !self.spec.frozen || value.shape() != &self.spec.local {
            return invalid!(
                "parameter {}: rebinding a frozen parameter's values needs a frozen parameter \
                 and its local shape {} (got {}, frozen: {})",
                self.spec.name,
                self.spec.local,
                value.shape(),
                self.spec.frozen
            );
        }
        self.value = value;
        self.compute = None;
        Ok(())
    }

    /// Name, shapes, split and init.
    pub fn spec(&self) -> &ParamSpec {
        &self.spec
    }

    /// Marks the parameter's gradient as this tensor-parallel rank's part (see
    /// [`ParamSpec::tensor_parallel_partial`]), replacing a sequence-parallel mark (the sum over
    /// tp covers both).
    pub fn mark_tensor_parallel_partial(&mut self) -> Result<()> {
        if self.spec.split != Split::Replicated {
            return invalid!(
                "parameter {}: only a replicated parameter has partial gradients over tp, it is \
                 split {:?}",
                self.spec.name,
                self.spec.split
            );
        }
        let spec = std::sync::Arc::make_mut(&mut self.spec);
        spec.tensor_parallel_partial = true;
        spec.sequence_parallel = false;
        Ok(())
    }

    /// The same parameter marked as computing its whole gradient on every tensor-parallel rank
    /// (see [`ParamSpec::gradient_whole_over_tp`]).
    pub fn with_gradient_whole_over_tp(mut self) -> Param {
        let spec = std::sync::Arc::make_mut(&mut self.spec);
        spec.gradient_whole_over_tp = true;
        spec.sequence_parallel = false;
        self
    }

    /// Marks a replicated parameter as living in the sequence-parallel region (see
    /// [`ParamSpec::sequence_parallel`]) unless its gradient is whole on every rank or this
    /// rank's part; split parameters are left as they are. What
    /// [`crate::module::sequence_parallel_region`] does to each parameter of a layer.
    pub fn mark_sequence_parallel_region(&mut self) {
        let spec = &self.spec;
        if spec.split == Split::Replicated
            && !spec.gradient_whole_over_tp
            && !spec.tensor_parallel_partial
            && !spec.sequence_parallel
        {
            std::sync::Arc::make_mut(&mut self.spec).sequence_parallel = true;
        }
    }

    /// The same parameter marked as living in the sequence-parallel region (see
    /// [`ParamSpec::sequence_parallel`]): what norms and the layers reading the activations'
    /// sequence shards call on their replicated parameters when they build them.
    pub fn in_sequence_parallel_region(mut self) -> Result<Param> {
        if self.spec.split != Split::Replicated {
            return invalid!(
                "parameter {}: only a replicated parameter lives in the sequence-parallel \
                 region, it is split {:?}",
                self.spec.name,
                self.spec.split
            );
        }
        std::sync::Arc::make_mut(&mut self.spec).sequence_parallel = true;
        Ok(self)
    }

    /// Replaces the value and gradient tensors (e.g. by views of flat buffers) with the same
    /// shapes, and the compute copy by `compute` (none: products read the values); the
    /// gradient's writes are no longer reported (the reducer cut the old buffers).
    pub fn rebind(&mut self, value: Tensor, grad: Tensor, compute: Option<Tensor>) -> Result<()> {
        let compute_shape = compute.as_ref().map(|c| c.shape());
        if value.shape() != &self.spec.local
            || grad.shape() != &self.spec.local
            || compute_shape.is_some_and(|c| c != &self.spec.local)
        {
            return invalid!(
                "parameter {}: rebinding to shapes {}, {} and {:?}, local shape is {}",
                self.spec.name,
                value.shape(),
                grad.shape(),
                compute_shape.map(|c| c.to_string()),
                self.spec.local
            );
        }
        self.value = value;
        self.grad = grad;
        self.compute = compute;
        self.reports_to = None;
        self.read_after = None;
        self.unit = None;
        Ok(())
    }
}

/// Creates parameters with their names, local shapes and layout-invariant initial values.
///
/// A parameter's logical values depend only on the seed and its name: a rank draws exactly the
/// elements of its part, from a counter-based generator indexed by the logical element.
#[derive(Debug, Clone)]
pub struct Builder {
    seed: u64,
    prefix: Vec<String>,
    groups: Vec<(GroupKind, usize, usize)>,
    dtype: DType,
    /// Shapes only: parameters are zeros that are never written (untouched pages cost no memory).
    meta: bool,
    /// Specs only: parameters hold no values at all ([`Builder::specs_only`]).
    specs_only: bool,
    /// The pipeline stage being built (what a `#[pipeline]` stack and the parts around it hold);
    /// `None` builds the whole model.
    stage: Option<StagePart>,
    /// The LoRA adapters to build beside the linear layers it targets, if any.
    lora: Option<Arc<crate::tensor_parallel::lora::LoraConfig>>,
    /// The field being built is called on both ends of a pipeline ([`Builder::called_at_both_ends`]).
    both_ends: bool,
}

impl Builder {
    /// A builder for a rank with every group of size 1.
    pub fn new(seed: u64) -> Self {
        Builder {
            seed,
            prefix: Vec::new(),
            groups: Vec::new(),
            dtype: DType::F32,
            meta: false,
            specs_only: false,
            stage: None,
            lora: None,
            both_ends: false,
        }
    }

    /// A builder that gives every column- and row-parallel linear layer `lora` targets a LoRA
    /// adapter ([`crate::tensor_parallel::lora`]); `None` builds none.
    pub fn with_lora(mut self, lora: Option<crate::tensor_parallel::lora::LoraConfig>) -> Self {
        self.lora = lora.map(Arc::new);
        self
    }

    /// The LoRA adapters to build, if any.
    pub fn lora(&self) -> Option<&crate::tensor_parallel::lora::LoraConfig> {
        self.lora.as_deref()
    }

    /// The dotted name of the current scope (the layer being built).
    pub fn scope_name(&self) -> String {
        self.prefix.join(".")
    }

    /// A builder of one pipeline stage's part of a model (see [`StagePart`]): a `#[pipeline]`
    /// stack builds the stage's layers, under their global indices, and the fields used only
    /// before (after) the stack are built only on the first (last) stage.
    pub fn with_stage(mut self, stage: StagePart) -> Self {
        self.stage = Some(stage);
        self
    }

    /// The pipeline stage being built, if the builder builds one.
    pub fn stage(&self) -> Option<&StagePart> {
        self.stage.as_ref()
    }

    /// Runs `f` building a field that the stages on both ends of a pipeline call, not only
    /// read (an untied embedding that multi-token prediction looks up after the stack: the
    /// last stage holds the input table too, and its gradient is summed with the first's).
    pub fn called_at_both_ends<T>(
        &mut self,
        f: impl FnOnce(&mut Builder) -> Result<T>,
    ) -> Result<T> {
        let both = std::mem::replace(&mut self.both_ends, true);
        let out = f(self);
        self.both_ends = both;
        out
    }

    /// Whether the field being built is called on both ends of a pipeline (see
    /// [`Builder::called_at_both_ends`]).
    pub fn is_called_at_both_ends(&self) -> bool {
        self.both_ends
    }

    /// Runs `f` building shapes only (see [`Builder::meta`]): for a field that another pipeline
    /// stage holds, which this stage keeps only as a placeholder (never visited, trained or
    /// saved).
    pub fn placeholder<T>(&mut self, f: impl FnOnce(&mut Builder) -> Result<T>) -> Result<T> {
        let meta = std::mem::replace(&mut self.meta, true);
        let out = f(self);
        self.meta = meta;
        out
    }

    /// A builder that skips initial values: every parameter is zeros, allocated but never
    /// written, so a model's shapes and names can be listed without the memory of its values.
    pub fn meta(mut self) -> Self {
        self.meta = true;
        self
    }

    /// A builder that allocates nothing: every parameter has its spec (name, logical and local
    /// shapes, split) and empty values, so that a model of any size can be listed (`megatron
    /// inspect`, `megatron layout`). Such a model is only for reading specs: it cannot run.
    pub fn specs_only(mut self) -> Self {
        self.meta = true;
        self.specs_only = true;
        self
    }

    /// Sets this rank's index and the size of a group parameters may be split over.
    pub fn with_group(mut self, kind: GroupKind, rank: usize, size: usize) -> Self {
        self.groups.retain(|(k, _, _)| *k != kind);
        self.groups.push((kind, rank, size));
        self
    }

    /// A builder for one rank of a parallel layout (its tp, ep and etp groups).
    pub fn for_rank(seed: u64, groups: &crate::parallel::RankGroups) -> Self {
        let mut b = Builder::new(seed);
        for kind in [GroupKind::Tp, GroupKind::Ep, GroupKind::Etp] {
            if let Some(g) = groups.get(kind) {
                b = b.with_group(kind, g.index, g.size());
            }
        }
        b
    }

    /// The element type of new parameters (f32 by default).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// This rank's index in `kind` and the group's size (0 of 1 if unknown).
    pub fn group(&self, kind: GroupKind) -> (usize, usize) {
        self.groups
            .iter()
            .find(|(k, _, _)| *k == kind)
            .map_or((0, 1), |&(_, r, s)| (r, s))
    }

    /// Tensor-parallel rank and size.
    pub fn tp(&self) -> (usize, usize) {
        self.group(GroupKind::Tp)
    }

    /// Runs `f` with `name` appended to the parameter-name prefix.
    pub fn scoped<T>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Builder) -> Result<T>,
    ) -> Result<T> {
        self.prefix.push(name.to_string());
        let out = f(self);
        self.prefix.pop();
        out
    }

    /// The full name of a parameter `name` in the current scope.
    pub fn name(&self, name: &str) -> String {
        let mut parts = self.prefix.clone();
        parts.push(name.to_string());
        parts.join(".")
    }

    /// Creates this rank's part of the parameter `name` of logical shape `logical`.
    pub fn param(
        &mut self,
        name: &str,
        logical: impl Into<Shape>,
        split: Split,
        init: Init,
        weight_decay: bool,
    ) -> Result<Param> {
        self.make(name, logical.into(), split, init, weight_decay, None)
    }

    /// Like [`Builder::param`] for a parameter whose dimension 0 is padded (a vocabulary padded
    /// to a multiple of the tensor-parallel size): only its first `real_rows` rows hold values
    /// that matter, and only those are saved in checkpoints.
    pub fn padded_param(
        &mut self,
        name: &str,
        logical: impl Into<Shape>,
        split: Split,
        init: Init,
        weight_decay: bool,
        real_rows: usize,
    ) -> Result<Param> {
        self.make(
            name,
            logical.into(),
            split,
            init,
            weight_decay,
            Some(real_rows),
        )
    }

    fn make(
        &mut self,
        name: &str,
        logical: Shape,
        split: Split,
        init: Init,
        weight_decay: bool,
        real_rows: Option<usize>,
    ) -> Result<Param> {
        let name = self.name(name);
        let (part, parts, local) = match split {
            Split::Replicated => (0, 1, logical.clone()),
            Split::Dim { dim, group } => {
                let (rank, size) = self.group(group);
                let Some(&d) = logical.dims().get(dim) else {
                    return invalid!(
                        "parameter {name}: shape {logical} has no dimension {dim} to split"
                    );
                };
                if d % size != 0 {
                    return invalid!(
                        "parameter {name}: dimension {dim} of {logical} ({d}) is not divisible by {group} = {size}"
                    );
                }
                let mut local = logical.clone();
                local.0[dim] = d / size;
                (rank, size, local)
            }
            Split::Strided { dim, group, blocks } => {
                let (rank, size) = self.group(group);
                let Some(&d) = logical.dims().get(dim) else {
                    return invalid!(
                        "parameter {name}: shape {logical} has no dimension {dim} to split"
                    );
                };
                if blocks == 0 || d % (blocks * size) != 0 {
                    return invalid!(
                        "parameter {name}: dimension {dim} of {logical} ({d}) is not {blocks} \
                         blocks each divisible by {group} = {size}"
                    );
                }
                let mut local = logical.clone();
                local.0[dim] = d / size;
                (rank, size, local)
            }
            Split::Experts { dim, blocks } => {
                let (ep, eps) = self.group(GroupKind::Ep);
                let (etp, etps) = self.group(GroupKind::Etp);
                let dims = logical.dims();
                if dim == 0 || dim >= dims.len() {
                    return invalid!(
                        "parameter {name}: experts' shape {logical} has no dimension {dim} to split \
                         over expert tensor parallelism"
                    );
                }
                if blocks == 0
                    || !dims[0].is_multiple_of(eps)
                    || !dims[dim].is_multiple_of(blocks * etps)
                {
                    return invalid!(
                        "parameter {name}: {logical} does not split into {eps} expert-parallel \
                         parts of dimension 0 and {etps} expert-tensor-parallel parts of each of \
                         the {blocks} blocks of dimension {dim}"
                    );
                }
                let mut local = logical.clone();
                local.0[0] = dims[0] / eps;
                local.0[dim] = dims[dim] / etps;
                (ep * etps + etp, eps * etps, local)
            }
            Split::QueryGroups {
                groups,
                per_group,
                head_dim,
            } => {
                let (rank, size) = self.group(GroupKind::Tp);
                let rows = groups * (per_group + 2) * head_dim;
                if logical.dims().first() != Some(&rows) {
                    return invalid!(
                        "parameter {name}: shape {logical} is not {groups} query groups of \
                         {per_group} queries, a key and a value of {head_dim} rows"
                    );
                }
                if groups == 0
                    || !size.is_multiple_of(groups)
                    || !per_group.is_multiple_of(size / groups)
                {
                    return invalid!(
                        "parameter {name}: {groups} query groups of {per_group} queries do not \
                         split over tp = {size} (tp a multiple of the groups, and the groups' \
                         queries of the ranks sharing one)"
                    );
                }
                let mut local = logical.clone();
                local.0[0] = (per_group / (size / groups) + 2) * head_dim;
                (rank, size, local)
            }
        };
        if let Some(rows) = real_rows
            && logical.dims().first().is_none_or(|&d| rows > d)
        {
            return invalid!("parameter {name}: {rows} real rows do not fit in shape {logical}");
        }
        let spec = ParamSpec {
            name,
            logical,
            local,
            split,
            part,
            parts,
            init,
            weight_decay,
            real_rows,
            sequence_parallel: false,
            tensor_parallel_partial: false,
            gradient_whole_over_tp: false,
            frozen: false,
        };
        if self.specs_only {
            return Ok(Param::spec_only(spec, self.dtype));
        }
        if self.meta {
            return Param::new(spec.clone(), Tensor::zeros(spec.local, self.dtype));
        }
        let values = initial_values(self.seed, &spec);
        let value = Tensor::from_vec(values, spec.local.clone())?;
        let value = if self.dtype == DType::F32 {
            value
        } else {
            value.to_dtype(self.dtype)?
        };
        Param::new(spec, value)
    }
}

/// This rank's part of a parameter's logical initial values, in local row-major order.
pub fn initial_values(seed: u64, spec: &ParamSpec) -> Vec<f32> {
    let n = spec.local.numel();
    match spec.init {
        Init::Constant(c) => vec![c; n],
        Init::Normal { std } => {
            let key = [seed as u32, (seed >> 32) as u32];
            let stream = stream_id(&[name_hash(&spec.name)]);
            let index = spec.part_index();
            let mut out = vec![0.0f32; n];
            // Each value depends only on its logical index, so parts of the buffer fill
            // independently (the same bits however the work is split).
            let fill = |start: usize, part: &mut [f32]| {
                for run in index.runs(start..start + part.len()) {
                    let at = run.local - start;
                    normals_into(&mut part[at..at + run.len], run.logical, key, stream, std);
                }
            };
            match parallel::part_len(n) {
                None => fill(0, &mut out),
                Some(len) => parallel::on_pool(|| {
                    out.par_chunks_mut(len)
                        .enumerate()
                        .for_each(|(c, part)| fill(c * len, part))
                }),
            }
            out
        }
    }
}

/// Reassembles a parameter's logical values from every rank's part (in any order); each part is
/// its spec and its local values in row-major order. Replicated parameters take the first part.
pub fn assemble_logical(parts: &[(&ParamSpec, &[f32])]) -> Result<Vec<f32>> {
    let Some((first, _)) = parts.first() else {
        return invalid!("no parts to assemble");
    };
    let mut out = vec![f32::NAN; first.logical.numel()];
    let mut seen = vec![false; first.parts];
    for (spec, values) in parts {
        if spec.name != first.name || spec.logical != first.logical || spec.parts != first.parts {
            return invalid!(
                "parts of {} and {} do not belong together",
                first.name,
                spec.name
            );
        }
        if values.len() != spec.local.numel() {
            return invalid!(
                "part {} of {} has {} values, expected {}",
                spec.part,
                spec.name,
                values.len(),
                spec.local.numel()
            );
        }
        seen[spec.part] = true;
        for run in spec.part_index().all_runs() {
            let at = run.logical as usize;
            out[at..at + run.len].copy_from_slice(&values[run.local..run.local + run.len]);
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return invalid!("part {missing} of {} is missing", first.name);
    }
    Ok(out)
}

/// 64-bit FNV-1a of a parameter name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Philox block `block` of `stream` under `key`: the words of logical elements 4·block .. + 4.
fn normal_block(block: u64, key: [u32; 2], stream: u64) -> [u32; 4] {
    philox4x32_10(
        [
            block as u32,
            (block >> 32) as u32,
            stream as u32,
            (stream >> 32) as u32,
        ],
        key,
    )
}

/// `std ×` the standard normal samples of the consecutive logical elements `first ..` into
/// `out`: [`normal`] of each, with one Philox block per four elements.
fn normals_into(out: &mut [f32], first: u64, key: [u32; 2], stream: u64, std: f32) {
    let mut j = 0;
    while j < out.len() {
        let i = first.wrapping_add(j as u64);
        let w = normal_block(i / 4, key, stream);
        let len = ((4 - i % 4) as usize).min(out.len() - j);
        for (t, v) in out[j..j + len].iter_mut().enumerate() {
            *v = std * normal_of(&w, i + t as u64);
        }
        j += len;
    }
}

/// The standard normal sample of logical element `i`: Box–Muller on words of Philox block i / 4.
#[cfg(test)]
fn normal(i: u64, key: [u32; 2], stream: u64) -> f32 {
    normal_of(&normal_block(i / 4, key, stream), i)
}

/// Element `i`'s sample from its block's words `w`: words 2·pair and 2·pair + 1 (pair = which
/// half of the block) give one Box–Muller pair, the cosine for even `i`, the sine for odd.
fn normal_of(w: &[u32; 4], i: u64) -> f32 {
    let pair = (i % 4) as usize / 2;
    let unit = |x: u32| (f64::from(x) + 0.5) / 4_294_967_296.0;
    let (u1, u2) = (unit(w[2 * pair]), unit(w[2 * pair + 1]));
    let r = (-2.0 * u1.ln()).sqrt();
    let theta = std::f64::consts::TAU * u2;
    (if i.is_multiple_of(2) {
        r * theta.cos()
    } else {
        r * theta.sin()
    }) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logical_values(b: &mut Builder, split: Split, shape: [usize; 2]) -> Vec<f32> {
        b.param("w", shape, split, Init::Normal { std: 0.02 }, true)
            .unwrap()
            .value()
            .to_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn initial_values_are_each_elements_sample_however_the_work_is_split() {
        // Parts of rows that start mid-block (odd widths and shard offsets), a parameter large
        // enough to be filled in parallel, on one compute thread and on three.
        let cases: [([usize; 2], Split, usize, usize); 3] = [
            ([7, 9], Split::Replicated, 0, 1),
            (
                [5, 15],
                Split::Dim {
                    dim: 1,
                    group: GroupKind::Tp,
                },
                1,
                3,
            ),
            (
                [331, 2409],
                Split::Dim {
                    dim: 1,
                    group: GroupKind::Tp,
                },
                2,
                11,
            ),
        ];
        for threads in [1, 3] {
            parallel::set_threads(threads);
            for (logical, split, part, parts) in cases {
                let local = match split {
                    Split::Replicated => logical,
                    _ => [logical[0], logical[1] / parts],
                };
                let spec = ParamSpec {
                    name: "blocks.0.w".to_string(),
                    logical: Shape::from(logical),
                    local: Shape::from(local),
                    split,
                    part,
                    parts,
                    init: Init::Normal { std: 0.5 },
                    weight_decay: true,
                    real_rows: None,
                    sequence_parallel: false,
                    tensor_parallel_partial: false,
                    gradient_whole_over_tp: false,
                    frozen: false,
                };
                let got = initial_values(9, &spec);
                let key = [9, 0];
                let stream = stream_id(&[name_hash(&spec.name)]);
                let want: Vec<f32> = spec
                    .part_index()
                    .all_runs()
                    .into_iter()
                    .flat_map(|r| r.logical..r.logical + r.len as u64)
                    .map(|i| 0.5 * normal(i, key, stream))
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&got) == bits(&want),
                    "{logical:?} part {part}, {threads} threads"
                );
            }
        }
        parallel::set_threads(parallel::cores());
    }

    /// A gated MLP's fc1 `[gate; up]` of 2 × 6 rows over tp 3: rank r holds gate rows
    /// 2r, 2r + 1 then up rows 6 + 2r, 6 + 2r + 1, as Megatron-LM's `linear_fc1`; the parts
    /// assemble into the logical tensor, and a block that does not divide is refused by name.
    #[test]
    fn strided_parts_hold_their_rows_of_every_block() {
        let full = logical_values(&mut Builder::new(5), Split::Replicated, [12, 3]);
        let split = Split::Strided {
            dim: 0,
            group: GroupKind::Tp,
            blocks: 2,
        };
        let mut parts = Vec::new();
        for rank in 0..3 {
            let mut b = Builder::new(5).with_group(GroupKind::Tp, rank, 3);
            let p = b
                .param("w", [12, 3], split, Init::Normal { std: 0.02 }, true)
                .unwrap();
            let got = p.value().to_vec::<f32>().unwrap();
            let rows = [2 * rank, 2 * rank + 1, 6 + 2 * rank, 6 + 2 * rank + 1];
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|&r| full[3 * r..3 * r + 3].to_vec())
                .collect();
            assert_eq!(got, want, "rank {rank}");
            parts.push((p.spec().clone(), got));
        }
        let views: Vec<(&ParamSpec, &[f32])> =
            parts.iter().map(|(s, v)| (s, v.as_slice())).collect();
        assert_eq!(assemble_logical(&views).unwrap(), full);
        let err = Builder::new(5)
            .with_group(GroupKind::Tp, 0, 4)
            .param("w", [12, 3], split, Init::ZEROS, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("(12) is not 2 blocks each divisible by tp = 4"),
            "{err}"
        );
    }

    #[test]
    fn shards_hold_exactly_their_part_of_the_logical_values() {
        let full = logical_values(&mut Builder::new(7), Split::Replicated, [6, 4]);
        for tp in [2, 3] {
            let mut rows = Vec::new();
            let mut cols = vec![Vec::new(); 6];
            for rank in 0..tp {
                let mut b = Builder::new(7).with_group(GroupKind::Tp, rank, tp);
                rows.extend(logical_values(
                    &mut b,
                    Split::Dim {
                        dim: 0,
                        group: GroupKind::Tp,
                    },
                    [6, 4],
                ));
                if 4 % tp == 0 {
                    let part = logical_values(
                        &mut b,
                        Split::Dim {
                            dim: 1,
                            group: GroupKind::Tp,
                        },
                        [6, 4],
                    );
                    for (r, chunk) in part.chunks(4 / tp).enumerate() {
                        cols[r].extend_from_slice(chunk);
                    }
                }
            }
            assert_eq!(rows, full, "rows over tp {tp}");
            if 4 % tp == 0 {
                assert_eq!(cols.concat(), full, "columns over tp {tp}");
            }
        }
    }

    #[test]
    fn values_depend_on_seed_and_name_and_look_normal() {
        let mut b = Builder::new(1);
        let a = b
            .param(
                "a",
                [1000],
                Split::Replicated,
                Init::Normal { std: 1.0 },
                true,
            )
            .unwrap();
        let a2 = b
            .param(
                "b",
                [1000],
                Split::Replicated,
                Init::Normal { std: 1.0 },
                true,
            )
            .unwrap();
        let a3 = Builder::new(2)
            .param(
                "a",
                [1000],
                Split::Replicated,
                Init::Normal { std: 1.0 },
                true,
            )
            .unwrap();
        let v = a.value().to_vec::<f32>().unwrap();
        assert_ne!(v, a2.value().to_vec::<f32>().unwrap());
        assert_ne!(v, a3.value().to_vec::<f32>().unwrap());
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / 1000.0;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / 1000.0;
        assert!(
            mean.abs() < 0.12 && (var - 1.0).abs() < 0.15,
            "mean {mean} var {var}"
        );
    }

    #[test]
    fn assembling_parts_gives_the_logical_tensor() {
        let full = logical_values(&mut Builder::new(3), Split::Replicated, [4, 6]);
        for dim in [0, 1] {
            let parts: Vec<(ParamSpec, Vec<f32>)> = (0..2)
                .map(|rank| {
                    let mut b = Builder::new(3).with_group(GroupKind::Tp, rank, 2);
                    let p = b
                        .param(
                            "w",
                            [4, 6],
                            Split::Dim {
                                dim,
                                group: GroupKind::Tp,
                            },
                            Init::Normal { std: 0.02 },
                            true,
                        )
                        .unwrap();
                    (p.spec().clone(), p.value().to_vec::<f32>().unwrap())
                })
                .collect();
            let refs: Vec<(&ParamSpec, &[f32])> =
                parts.iter().rev().map(|(s, v)| (s, v.as_slice())).collect();
            assert_eq!(assemble_logical(&refs).unwrap(), full, "split dim {dim}");
            assert!(
                assemble_logical(&refs[..1])
                    .unwrap_err()
                    .to_string()
                    .contains("is missing")
            );
        }
    }

    /// (local expert, block, row in the rank's part of the block, column) of a `[2, 2·2·2, 3]`
    /// local part of gated experts.
    fn gated_part_indices() -> impl Iterator<Item = (usize, usize, usize, usize)> {
        (0..2).flat_map(|e| {
            (0..2).flat_map(move |k| (0..2).flat_map(move |j| (0..3).map(move |c| (e, k, j, c))))
        })
    }

    #[test]
    fn experts_split_over_ep_and_etp_assemble_to_the_logical_tensor() {
        for (shape, dim, blocks) in [
            ([4usize, 6, 3], 1usize, 1),
            ([4, 3, 6], 2, 1),
            ([4, 8, 3], 1, 2),
        ] {
            let full = Builder::new(7)
                .param(
                    "e",
                    shape,
                    Split::Replicated,
                    Init::Normal { std: 0.1 },
                    true,
                )
                .unwrap()
                .value()
                .to_vec::<f32>()
                .unwrap();
            let parts: Vec<(ParamSpec, Vec<f32>)> = (0..2)
                .flat_map(|ep| (0..2).map(move |etp| (ep, etp)))
                .map(|(ep, etp)| {
                    let mut b = Builder::new(7).with_group(GroupKind::Ep, ep, 2).with_group(
                        GroupKind::Etp,
                        etp,
                        2,
                    );
                    let p = b
                        .param(
                            "e",
                            shape,
                            Split::Experts { dim, blocks },
                            Init::Normal { std: 0.1 },
                            true,
                        )
                        .unwrap();
                    let mut local = shape;
                    local[0] /= 2;
                    local[dim] /= 2;
                    assert_eq!(p.spec().local.dims(), local);
                    if blocks == 2 {
                        // Local expert e's row j of block k is logical row k·4 + etp·2 + j of
                        // expert 2·ep + e (each block of 4 rows split in 2).
                        let values = p.value().to_vec::<f32>().unwrap();
                        for (e, k, j, c) in gated_part_indices() {
                            let got = values[((e * 4) + k * 2 + j) * 3 + c];
                            let row = k * 4 + etp * 2 + j;
                            let want = full[((2 * ep + e) * 8 + row) * 3 + c];
                            assert_eq!(got, want, "ep {ep} etp {etp} e {e} block {k} row {j}");
                        }
                    }
                    assert_eq!((p.spec().part, p.spec().parts), (2 * ep + etp, 4));
                    assert!(p.spec().is_expert());
                    (p.spec().clone(), p.value().to_vec::<f32>().unwrap())
                })
                .collect();
            let refs: Vec<(&ParamSpec, &[f32])> =
                parts.iter().map(|(s, v)| (s, v.as_slice())).collect();
            assert_eq!(assemble_logical(&refs).unwrap(), full, "dim {dim}");
        }
        let err = Builder::new(0)
            .with_group(GroupKind::Etp, 0, 4)
            .param(
                "e",
                [2, 6, 3],
                Split::Experts { dim: 1, blocks: 1 },
                Init::ZEROS,
                true,
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("4 expert-tensor-parallel parts"),
            "{err}"
        );
    }

    #[test]
    fn scoped_names_and_bad_splits() {
        let mut b = Builder::new(0).with_group(GroupKind::Tp, 0, 4);
        let p = b
            .scoped("blocks", |b| {
                b.scoped("0", |b| {
                    b.param("w", [8, 6], Split::Replicated, Init::ZEROS, false)
                })
            })
            .unwrap();
        assert_eq!(p.spec().name, "blocks.0.w");
        let err = b
            .param(
                "w",
                [8, 6],
                Split::Dim {
                    dim: 1,
                    group: GroupKind::Tp,
                },
                Init::ZEROS,
                true,
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "parameter w: dimension 1 of [8, 6] (6) is not divisible by tp = 4"
        );
    }
}
