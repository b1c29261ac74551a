//! `ParamBuffers`: every parameter and gradient of a model as views into two flat buffers, laid
//! out as Megatron-LM lays them out ([`crate::optimizer::layout()`]).

use std::ops::Range;
use std::sync::Arc;

use crate::comm::{Communicator, ParallelState};
use crate::error::Result;
use crate::invalid;
use crate::module::{Module, ParamSpec};
use crate::optimizer::{BufferLayout, LayoutConfig, ParamInfo, layout};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};

/// Replaces every frozen parameter's values of `model` by `f` of them (another dtype, a device).
fn rebind_frozen<M: Module>(model: &mut M, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
    let mut failure = None;
    model.visit_params_mut(&mut |p| {
        if failure.is_none() && p.is_frozen() {
            let moved = f(p.value()).and_then(|v| p.rebind_frozen(v));
            failure = moved.err();
        }
    });
    failure.map_or(Ok(()), Err)
}

/// Runs `f` on every trainable parameter of `model` with its slot in the buffers packed from it
/// (the visit order), checking that the model has the buffers' `slots` parameters; `what` names
/// the caller in the error.
pub(crate) fn for_each_slot<M: Module>(
    model: &mut M,
    slots: usize,
    what: &str,
    mut f: impl FnMut(&mut crate::module::Param, usize),
) -> Result<()> {
    let mut slot = 0;
    model.visit_params_mut(&mut |p| {
        if !p.is_frozen() {
            f(p, slot);
            slot += 1;
        }
    });
    if slot != slots {
        return invalid!(
            "{what}: the model has {slot} trainable parameters but its buffers {slots}"
        );
    }
    Ok(())
}

/// Where one parameter lives in the flat buffers.
#[derive(Debug, Clone)]
pub struct ParamSlot {
    /// First element in the flat buffers.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// The parameter's name, shapes and split.
    pub spec: ParamSpec,
    /// A copy of a parameter another pipeline stage holds too (the tied embedding on the last
    /// stage): trained alike, but counted once in the gradient norm (on the first stage).
    pub shared_copy: bool,
}

impl ParamSlot {
    /// The slot's elements in the flat buffers.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// One bucket of the buffers: the unit of the data-parallel gradient reduction (and, with the
/// distributed optimizer, of its sharding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Its elements in the flat buffers, padding included.
    pub range: Range<usize>,
    /// The equal shards it is cut into (the data-parallel ranks), with the distributed
    /// optimizer.
    pub shards: Option<usize>,
    /// The slots of its parameters, in buffer order.
    pub slots: Vec<usize>,
    /// Whether it holds experts' parameters: reduced (and sharded) over the expert
    /// data-parallel group instead of the data-parallel one.
    pub expert: bool,
    /// Where it comes from: its buffer's layout (Megatron-LM's, `optimizer::layout`), placed at
    /// an offset of the flat buffers, and its index there.
    source: LayoutBucket,
}

/// A bucket of a [`BufferLayout`] placed in the flat buffers: the layout, where the buffer
/// starts, the slot of the layout's first parameter, the bucket's index, and the model chunk
/// whose buffer it is.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LayoutBucket {
    layout: Arc<BufferLayout>,
    base: usize,
    first_slot: usize,
    index: usize,
    chunk: usize,
}

/// A rank's index in the groups the buckets are sharded over: data parallelism for dense
/// buckets, expert data parallelism for the experts' buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRanks {
    /// The data-parallel rank.
    pub dense: usize,
    /// The expert data-parallel rank.
    pub expert: usize,
}

impl ShardRanks {
    /// The rank whose shard of `bucket` this rank holds.
    pub fn of(&self, bucket: &Bucket) -> usize {
        if bucket.expert {
            self.expert
        } else {
            self.dense
        }
    }
}

/// The groups the gradient buckets are reduced over (Megatron-LM's data-parallel and expert
/// data-parallel groups, or with several distributed-optimizer instances their parts within the
/// rank's instance, and the groups across instances).
#[derive(Clone, Copy)]
pub struct ReduceGroups<'a> {
    /// Data parallelism: the dense buckets (sharded over it).
    pub dense: &'a dyn Communicator,
    /// Expert data parallelism: the experts' buckets (sharded over it).
    pub expert: &'a dyn Communicator,
    /// With several distributed-optimizer instances, the dense and expert groups across them:
    /// each shard, reduce-scattered within the instance, is then all-reduced over these.
    pub across: Option<[&'a dyn Communicator; 2]>,
}

impl<'a> ReduceGroups<'a> {
    /// The rank's data-parallel and expert data-parallel groups (within its instance, with
    /// several distributed-optimizer instances).
    pub fn of(parallel: &'a ParallelState) -> Self {
        match parallel.optimizer_instances() {
            Some(instances) => ReduceGroups {
                dense: instances.within[0].as_ref(),
                expert: instances.within[1].as_ref(),
                across: Some([instances.across[0].as_ref(), instances.across[1].as_ref()]),
            },
            None => ReduceGroups {
                dense: parallel.dp(),
                expert: parallel.comm(GroupKind::Edp),
                across: None,
            },
        }
    }

    /// The group across distributed-optimizer instances `bucket`'s shard is all-reduced over
    /// after its reduce-scatter, if there are several instances.
    pub fn across_bucket(&self, bucket: &Bucket) -> Option<&'a dyn Communicator> {
        self.across
            .map(|[dense, expert]| if bucket.expert { expert } else { dense })
            .filter(|g| g.size() > 1)
    }

    /// The groups across distributed-optimizer instances, shared (as [`ReduceGroups::shared`]).
    pub fn shared_across(parallel: &ParallelState) -> Option<[Arc<dyn Communicator>; 2]> {
        parallel.optimizer_instances().map(|i| i.across.clone())
    }

    /// The rank's data-parallel group (with context parallelism, the one over dp × cp) and its
    /// expert data-parallel group (within its instance, with several distributed-optimizer
    /// instances), shared, for collectives started now and finished later
    /// ([`super::GradSync`], [`super::ParamGather`]).
    pub fn shared(parallel: &ParallelState) -> [Arc<dyn Communicator>; 2] {
        if let Some(instances) = parallel.optimizer_instances() {
            return instances.within.clone();
        }
        let dense = match parallel.groups().config().cp {
            1 => GroupKind::Dp,
            _ => GroupKind::DpCp,
        };
        [dense, GroupKind::Edp].map(|kind| {
            parallel
                .get(kind)
                .cloned()
                .unwrap_or_else(|| panic!("rank {} has no {kind} group", parallel.groups().rank()))
        })
    }

    /// The group `bucket` is reduced over.
    pub fn of_bucket(&self, bucket: &Bucket) -> &'a dyn Communicator {
        if bucket.expert {
            self.expert
        } else {
            self.dense
        }
    }

    /// The rank's index in each group.
    pub fn ranks(&self) -> ShardRanks {
        ShardRanks {
            dense: self.dense.index(),
            expert: self.expert.index(),
        }
    }
}

/// One parameter's part in a rank's shard of a bucket, in the flat buffers (the layout's
/// [`crate::optimizer::ShardPart`] placed there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPart {
    /// The parameter's slot.
    pub slot: usize,
    /// The part's elements in the flat buffers.
    pub range: Range<usize>,
}

impl Bucket {
    /// The model chunk (virtual pipeline stage) whose buffer holds it.
    pub fn chunk(&self) -> usize {
        self.source.chunk
    }

    /// Rank `rank`'s shard: its elements in the flat buffers and the parameters' parts in it
    /// (`None` without shards), as [`BufferLayout::shard`] cuts it.
    pub fn shard(&self, rank: usize) -> Option<(Range<usize>, Vec<SlotPart>)> {
        let LayoutBucket {
            layout,
            base,
            first_slot,
            index,
            ..
        } = &self.source;
        let shard = layout.shard(rank, *index)?;
        let placed = |r: &Range<usize>| base + r.start..base + r.end;
        let parts = shard
            .parts
            .iter()
            .map(|p| SlotPart {
                slot: first_slot + p.param,
                range: placed(&p.gbuf_world),
            })
            .collect();
        Some((placed(&shard.world), parts))
    }
}

/// How [`ParamBuffers::pack`] lays out a model's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct PackLayout {
    /// Each model chunk's parameter count (in visit order; a count past the parameters left
    /// takes them all) and layout: Megatron-LM gives every model chunk its own buffer, placed
    /// here one after the other.
    pub chunks: Vec<(usize, LayoutConfig)>,
    /// Visit positions of the parameters the first and the last pipeline stage both hold (the
    /// tied embedding): alone in their bucket with the distributed optimizer.
    pub shared_embedding: Vec<usize>,
    /// The dtype the values are kept in (`--bf16`, `--fp16`: converted once, here); `None`
    /// keeps the model's. The gradients' dtype is the layout's (`grad_reduce_in_fp32`).
    pub param_dtype: Option<DType>,
}

impl PackLayout {
    /// Every parameter in one buffer laid out by `config`.
    pub fn single(config: LayoutConfig) -> Self {
        PackLayout {
            chunks: vec![(usize::MAX, config)],
            shared_embedding: Vec::new(),
            param_dtype: None,
        }
    }

    /// One buffer, unpadded, one bucket (a model outside data parallelism).
    pub fn plain() -> Self {
        PackLayout::single(LayoutConfig {
            distributed_optimizer: false,
            ..LayoutConfig::new(1)
        })
    }
}

/// One flat value buffer and one flat gradient buffer holding every parameter of a model (f32,
/// or with mixed precision 16-bit values and 16-bit or f32 gradients).
///
/// Parameters are laid out in reverse order of the model's visit order, as Megatron-LM does: the
/// backward produces the last layers' gradients first, so the front of the gradient buffer is
/// complete first and data-parallel buckets can be reduced while the backward goes on. With the
/// distributed optimizer, starts are aligned and bucket ends padded so that every bucket cuts
/// into equal shards (see [`crate::optimizer::layout()`]).
#[derive(Debug, Clone)]
pub struct ParamBuffers {
    values: Tensor,
    /// The flat gradients (empty when each bucket has its own, `bucket_grads`).
    grads: Tensor,
    /// With sharded gradients (`optim_grads`, ZeRO-2): each bucket's whole gradients in a
    /// storage of its own, released after each reduction ([`ParamBuffers::shard_gradients`]).
    bucket_grads: Option<Vec<Tensor>>,
    /// Lower-precision copies of `values` that products read, when kept (mixed precision).
    compute: Option<Tensor>,
    /// With sharded parameters (`optim_grads_params`, ZeRO-3): the rank's shards, and each
    /// bucket's whole values in a storage of its own ([`ParamBuffers::shard_values`]).
    sharded_values: Option<ShardedValues>,
    slots: Vec<ParamSlot>,
    buckets: Vec<Bucket>,
    used: usize,
    /// The flat layout's elements (the values' length before they are sharded).
    len: usize,
}

/// A model's values sharded over data parallelism (`optim_grads_params`): the rank's shard of
/// every bucket, kept, and every bucket's whole values (and compute copies), given back
/// between the gathers that fill them ([`super::ParamUnits`]).
#[derive(Debug, Clone)]
pub struct ShardedValues {
    /// The rank's shards of the buckets one after the other, in bucket order (the layout of
    /// the optimizer's moments), in the values' dtype.
    pub shards: Tensor,
    /// Per bucket: its shard's elements in the flat layout, and where the shard starts in
    /// `shards`.
    pub at: Vec<(Range<usize>, usize)>,
    /// Per bucket: its whole values, evicted until gathered.
    pub whole: Vec<Tensor>,
    /// Per bucket: its whole compute copies, when kept, evicted until gathered.
    pub compute: Option<Vec<Tensor>>,
}

impl ParamBuffers {
    /// Moves every parameter of `model` into the flat buffers (values copied once), laid out
    /// by `plan`, and rebinds the model's parameters to views of them.
    pub fn pack<M: Module>(model: &mut M, plan: &PackLayout) -> Result<ParamBuffers> {
        let mut params: Vec<(ParamSpec, Tensor)> = Vec::new();
        model.visit_trainable_params(&mut |p| params.push((p.spec().clone(), p.value().clone())));
        // Each parameter's unit of gathering (a stack's module; 0: the rest), for buckets cut
        // at them.
        let mut unit_of = std::collections::HashMap::new();
        model.visit_stacked_params(&mut 0, &mut |p, unit| {
            unit_of.insert(std::ptr::from_ref(p), unit);
        });
        let mut units = Vec::with_capacity(params.len());
        model.visit_trainable_params(&mut |p| {
            units.push(unit_of.get(&std::ptr::from_ref(p)).copied().unwrap_or(0))
        });
        let model_dtype = params.first().map_or(DType::F32, |(_, v)| v.dtype());
        if let Some((spec, v)) = params.iter().find(|(_, v)| v.dtype() != model_dtype) {
            return invalid!(
                "parameter {} is {} but the others are {model_dtype}",
                spec.name,
                v.dtype()
            );
        }
        let dtype = plan.param_dtype.unwrap_or(model_dtype);
        // Frozen parameters stay in tensors of their own, in the values' dtype: no gradient,
        // no optimizer state.
        rebind_frozen(model, |v| Ok(v.to_dtype(dtype)?))?;
        let mut grad_dtype = DType::F32;
        let mut offsets = vec![0usize; params.len()];
        let mut buckets = Vec::new();
        let (mut first, mut base) = (0usize, 0usize);
        for (chunk, &(count, config)) in plan.chunks.iter().enumerate() {
            let members = first..first.saturating_add(count).min(params.len());
            let infos: Vec<ParamInfo> = members
                .clone()
                .map(|i| ParamInfo {
                    name: params[i].0.name.clone(),
                    numel: params[i].0.local.numel(),
                    dtype,
                    shared_embedding: plan.shared_embedding.contains(&i),
                    expert: params[i].0.is_expert(),
                    unit: units[i],
                })
                .collect();
            let buffers = layout(&infos, &config)?;
            // One dtype: at most two buffers per chunk, the dense one and the experts'.
            for buffer in buffers.into_iter().map(Arc::new) {
                grad_dtype = buffer.key.grad_dtype;
                for p in &buffer.placements {
                    offsets[first + p.param] = base + p.range.start;
                }
                for (b, range) in buffer.buckets.iter().enumerate() {
                    buckets.push(Bucket {
                        range: base + range.start..base + range.end,
                        shards: buffer.shards,
                        slots: buffer
                            .placements
                            .iter()
                            .filter(|p| p.bucket == b)
                            .map(|p| first + p.param)
                            .collect(),
                        expert: buffer.key.expert,
                        source: LayoutBucket {
                            layout: Arc::clone(&buffer),
                            base,
                            first_slot: first,
                            index: b,
                            chunk,
                        },
                    });
                }
                base += buffer.numel();
            }
            first = members.end;
        }
        if first != params.len() {
            return invalid!(
                "the pack layout's chunks hold {first} of the model's {} parameters",
                params.len()
            );
        }
        let total = base;
        let slots: Vec<ParamSlot> = params
            .iter()
            .zip(&offsets)
            .map(|((spec, _), &offset)| ParamSlot {
                offset,
                len: spec.local.numel(),
                spec: spec.clone(),
                shared_copy: false,
            })
            .collect();
        let used = slots.iter().map(|s| s.len).sum();
        let values = Tensor::zeros([total], dtype);
        let grads = Tensor::zeros([total], grad_dtype);
        for (slot, (_, value)) in slots.iter().zip(&params) {
            values
                .narrow(0, slot.offset, slot.len)?
                .copy_from(&value.reshape([slot.len])?.contiguous()?)?;
        }
        let buffers = ParamBuffers {
            values,
            grads,
            bucket_grads: None,
            compute: None,
            sharded_values: None,
            slots,
            buckets,
            used,
            len: total,
        };
        buffers.bind(model)?;
        Ok(buffers)
    }

    /// Rebinds every parameter of `model` (the model these buffers were packed from) to views
    /// of the flat buffers, its compute copy included.
    fn bind<M: Module>(&self, model: &mut M) -> Result<()> {
        let mut i = 0;
        let mut failure = None;
        let bucket_of = self.bucket_of_slots();
        model.visit_params_mut(&mut |p| {
            if failure.is_some() || p.is_frozen() {
                return;
            }
            let Some(slot) = self.slots.get(i) else {
                failure = Some(crate::Error::Invalid(
                    "the model has more parameters than its buffers".to_string(),
                ));
                return;
            };
            let view = |t: &Tensor| -> Result<Tensor> {
                Ok(t.narrow(0, slot.offset, slot.len)?
                    .reshape(slot.spec.local.clone())?)
            };
            let grad = || -> Result<Tensor> {
                let Some(buckets) = &self.bucket_grads else {
                    return view(&self.grads);
                };
                let b = bucket_of[i];
                let at = slot.offset - self.buckets[b].range.start;
                Ok(buckets[b]
                    .narrow(0, at, slot.len)?
                    .reshape(slot.spec.local.clone())?)
            };
            let in_bucket = |whole: &Tensor| -> Result<Tensor> {
                let at = slot.offset - self.buckets[bucket_of[i]].range.start;
                Ok(whole
                    .narrow(0, at, slot.len)?
                    .reshape(slot.spec.local.clone())?)
            };
            let bound = (|| match &self.sharded_values {
                Some(sharded) => {
                    let b = bucket_of[i];
                    let compute = sharded
                        .compute
                        .as_ref()
                        .map(|c| in_bucket(&c[b]))
                        .transpose()?;
                    p.rebind(in_bucket(&sharded.whole[b])?, grad()?, compute)
                }
                None => {
                    let compute = self.compute.as_ref().map(view).transpose()?;
                    p.rebind(view(&self.values)?, grad()?, compute)
                }
            })();
            if let Err(e) = bound {
                failure = Some(e);
            }
            i += 1;
        });
        if let Some(e) = failure {
            return Err(e);
        }
        if i != self.slots.len() {
            return invalid!(
                "the model has {} parameters but its buffers {}",
                i,
                self.slots.len()
            );
        }
        Ok(())
    }

    /// Moves the flat buffers (and compute copies) to `gpu` and rebinds every parameter of
    /// `model` (the model these buffers were packed from) to views of the device buffers.
    pub fn to_gpu<M: Module>(&mut self, model: &mut M, gpu: &crate::cuda::Gpu) -> Result<()> {
        rebind_frozen(model, |v| v.to_gpu(gpu))?;
        self.values = self.values.to_gpu(gpu)?;
        self.grads = Tensor::zeros_on(self.grads.shape().clone(), self.grads.dtype(), gpu)?;
        if let Some(buckets) = &mut self.bucket_grads {
            for whole in buckets.iter_mut() {
                *whole = Tensor::zeros_on(whole.shape().clone(), whole.dtype(), gpu)?;
                whole.storage().release();
            }
        }
        if let Some(compute) = &self.compute {
            self.compute = Some(Tensor::empty_on(
                compute.shape().clone(),
                compute.dtype(),
                gpu,
            )?);
            self.refresh_compute_copies()?;
        }
        if let Some(sharded) = &mut self.sharded_values {
            sharded.shards = sharded.shards.to_gpu(gpu)?;
            let evicted_on_gpu = |wholes: &mut Vec<Tensor>| -> Result<()> {
                for whole in wholes.iter_mut() {
                    *whole = Tensor::zeros_on(whole.shape().clone(), whole.dtype(), gpu)?;
                    whole.storage().evict();
                }
                Ok(())
            };
            evicted_on_gpu(&mut sharded.whole)?;
            if let Some(compute) = &mut sharded.compute {
                evicted_on_gpu(compute)?;
            }
        }
        self.bind(model)
    }

    /// Keeps a `dtype` copy of every parameter that products read (Megatron-LM's bf16 model
    /// weights next to the f32 main values the optimizer updates): one flat buffer beside the
    /// values, filled now and refreshed by [`ParamBuffers::refresh_compute_copies`] after every
    /// change of the values (the trainer does it after each optimizer step).
    pub fn keep_compute_copies<M: Module>(&mut self, model: &mut M, dtype: DType) -> Result<()> {
        if self.values.dtype() != DType::F32 {
            return invalid!(
                "compute copies are kept beside f32 values; these are {} already",
                self.values.dtype()
            );
        }
        if dtype == self.values.dtype() {
            return invalid!("compute copies must differ from the {dtype} values");
        }
        if let Some(sharded) = &mut self.sharded_values {
            // Each bucket's copies are converted when it is gathered.
            let compute = sharded
                .whole
                .iter()
                .map(|whole| {
                    let copy = Tensor::zeros_near(whole.shape().clone(), dtype, whole)?;
                    copy.storage().evict();
                    Ok(copy)
                })
                .collect::<Result<Vec<_>>>()?;
            sharded.compute = Some(compute);
            rebind_frozen(model, |v| Ok(v.to_dtype(dtype)?))?;
            return self.bind(model);
        }
        self.compute = Some(Tensor::empty_near(
            self.values.shape().clone(),
            dtype,
            &self.values,
        )?);
        self.refresh_compute_copies()?;
        // A frozen parameter is read, never updated: it needs only the copy products read.
        rebind_frozen(model, |v| Ok(v.to_dtype(dtype)?))?;
        self.bind(model)
    }

    /// Converts the values into the compute copies (nothing without copies).
    pub fn refresh_compute_copies(&self) -> Result<()> {
        if let Some(compute) = &self.compute {
            compute.copy_from(&self.values)?;
        }
        Ok(())
    }

    /// The flat compute copies, when kept.
    pub fn compute_copies(&self) -> Option<&Tensor> {
        self.compute.as_ref()
    }

    /// The flat values.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// The flat gradients (f32, or 16-bit with mixed precision); empty when each bucket has
    /// its own ([`ParamBuffers::bucket_grads`]), but of the gradients' dtype and device.
    pub fn grads(&self) -> &Tensor {
        &self.grads
    }

    /// With sharded gradients, each bucket's whole gradients (released between its
    /// reductions: see [`ParamBuffers::shard_gradients`]).
    pub fn bucket_grads(&self) -> Option<&[Tensor]> {
        self.bucket_grads.as_deref()
    }

    /// Gives each bucket its own gradient storage in place of the flat gradient buffer and
    /// rebinds `model`'s gradients to views of them (Megatron-FSDP's `optim_grads`, ZeRO-2):
    /// the storages start released, are allocated (zeroed) by the first write of a
    /// gradient in them, and are released again after each reduction of the bucket, whose
    /// shard the optimizer keeps ([`crate::optimizer::AdamW::keep_sharded_grads`]). The
    /// buckets must be sharded (the distributed optimizer's layout).
    pub fn shard_gradients<M: Module>(&mut self, model: &mut M) -> Result<()> {
        if !self.sharded() {
            return invalid!(
                "sharded gradients (optim_grads) keep each rank's shard of every bucket: the \
                 buffers must be laid out for the distributed optimizer"
            );
        }
        if self.bucket_grads.is_some() {
            return Ok(());
        }
        let dtype = self.grads.dtype();
        let buckets = self
            .buckets
            .iter()
            .map(|b| {
                let whole = Tensor::zeros_near([b.range.len()], dtype, &self.grads)?;
                whole.storage().release();
                Ok(whole)
            })
            .collect::<Result<Vec<_>>>()?;
        self.grads = Tensor::zeros_near([0], dtype, &self.grads)?;
        self.bucket_grads = Some(buckets);
        self.bind(model)
    }

    /// Keeps only the rank's shard of every bucket's values (Megatron-FSDP's
    /// `optim_grads_params`, ZeRO-3): the shards in one tensor laid out like the optimizer's
    /// moments (which the update writes, [`ParamBuffers::value_part`]), and each bucket's whole
    /// values in a storage of its own, evicted until a gather fills it ([`super::ParamUnits`]);
    /// `model`'s parameters are rebound to views of those. The gradients must be sharded
    /// first ([`ParamBuffers::shard_gradients`]); `ranks` are the optimizer's.
    pub fn shard_values<M: Module>(&mut self, model: &mut M, ranks: ShardRanks) -> Result<()> {
        if self.bucket_grads.is_none() {
            return invalid!(
                "sharded parameters (optim_grads_params) shard the gradients too: shard them \
                 first (optim_grads)"
            );
        }
        if self.sharded_values.is_some() {
            return Ok(());
        }
        let mut at = Vec::with_capacity(self.buckets.len());
        let mut n = 0;
        for bucket in &self.buckets {
            let Some((world, _)) = bucket.shard(ranks.of(bucket)) else {
                return invalid!("sharded parameters need every bucket cut into shards");
            };
            at.push((world.clone(), n));
            n += world.len();
        }
        let shards = Tensor::zeros_near([n], self.values.dtype(), &self.values)?;
        for (world, start) in &at {
            shards
                .narrow(0, *start, world.len())?
                .copy_from(&self.values.narrow(0, world.start, world.len())?)?;
        }
        let evicted = |len: usize, dtype: DType| -> Result<Tensor> {
            let whole = Tensor::zeros_near([len], dtype, &self.values)?;
            whole.storage().evict();
            Ok(whole)
        };
        let lens: Vec<usize> = self.buckets.iter().map(|b| b.range.len()).collect();
        let whole = lens
            .iter()
            .map(|&len| evicted(len, self.values.dtype()))
            .collect::<Result<Vec<_>>>()?;
        let compute = self
            .compute
            .as_ref()
            .map(|c| {
                lens.iter()
                    .map(|&len| evicted(len, c.dtype()))
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        self.values = Tensor::zeros_near([0], self.values.dtype(), &self.values)?;
        self.compute = None;
        self.sharded_values = Some(ShardedValues {
            shards,
            at,
            whole,
            compute,
        });
        self.bind(model)
    }

    /// The sharded values, with sharded parameters.
    pub fn sharded_values(&self) -> Option<&ShardedValues> {
        self.sharded_values.as_ref()
    }

    /// The values of the elements `range` of the flat layout, inside one of the rank's
    /// shards starting at `at` in the moments' layout: a view of the flat values, or with
    /// sharded parameters of the rank's shards.
    pub fn value_part(&self, range: &Range<usize>, at: usize) -> Result<Tensor> {
        Ok(match &self.sharded_values {
            Some(sharded) => sharded.shards.narrow(0, at, range.len())?,
            None => self.values.narrow(0, range.start, range.len())?,
        })
    }

    /// The values of the elements `range` of the flat layout, in a tensor of their own (host
    /// or device, the values' dtype): a copy of the flat values, or with sharded parameters
    /// gathered from the ranks' shards of the buckets it meets (collectives over `groups`,
    /// which every rank of them makes alike).
    pub fn gathered_values(&self, range: Range<usize>, groups: ReduceGroups<'_>) -> Result<Tensor> {
        let Some(sharded) = &self.sharded_values else {
            return Ok(self
                .values
                .narrow(0, range.start, range.len())?
                .contiguous()?);
        };
        let out = Tensor::zeros_near([range.len()], self.values.dtype(), &sharded.shards)?;
        for (bucket, (world, at)) in self.buckets.iter().zip(&sharded.at) {
            let (start, end) = (
                bucket.range.start.max(range.start),
                bucket.range.end.min(range.end),
            );
            if start >= end {
                continue;
            }
            let whole = Tensor::zeros_near([bucket.range.len()], self.values.dtype(), &out)?;
            groups
                .of_bucket(bucket)
                .all_gather(&sharded.shards.narrow(0, *at, world.len())?, &whole)?;
            out.narrow(0, start - range.start, end - start)?
                .copy_from(&whole.narrow(0, start - bucket.range.start, end - start)?)?;
        }
        Ok(out)
    }

    /// The flat layout's length: the values' (before they are sharded) and the gradients'.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every parameter's place, in the model's visit order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The buckets, in buffer order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The elements of model chunk `chunk`'s buffers (empty if it has none): a chunk's buffers
    /// lie one after the other.
    pub fn chunk_range(&self, chunk: usize) -> Range<usize> {
        let mut ranges = self.buckets.iter().filter(|b| b.chunk() == chunk);
        let Some(first) = ranges.next() else {
            return 0..0;
        };
        let start = first.range.start;
        let end = ranges.fold(first.range.end, |end, b| end.max(b.range.end));
        start..end
    }

    /// Each parameter slot's bucket, in the model's visit order.
    pub fn bucket_of_slots(&self) -> Vec<usize> {
        let mut bucket_of = vec![0; self.slots.len()];
        for (b, bucket) in self.buckets.iter().enumerate() {
            for &s in &bucket.slots {
                bucket_of[s] = b;
            }
        }
        bucket_of
    }

    /// Whether the buckets are cut into shards (the distributed optimizer's layout).
    pub fn sharded(&self) -> bool {
        self.buckets.iter().any(|b| b.shards.is_some())
    }

    /// The shard of every bucket a rank at `ranks` holds: its range and its parameters' parts
    /// (empty without the distributed optimizer).
    pub fn shards(&self, ranks: ShardRanks) -> Vec<(Range<usize>, Vec<SlotPart>)> {
        self.buckets
            .iter()
            .filter_map(|b| b.shard(ranks.of(b)))
            .collect()
    }

    /// Whether some parameters are experts' (in buckets of their own).
    pub fn has_experts(&self) -> bool {
        self.buckets.iter().any(|b| b.expert)
    }

    /// Marks the parameters at these visit positions as copies another pipeline stage holds
    /// too ([`ParamSlot::shared_copy`]).
    pub fn mark_shared_copies(&mut self, positions: &[usize]) {
        for &i in positions {
            if let Some(slot) = self.slots.get_mut(i) {
                slot.shared_copy = true;
            }
        }
    }

    /// Elements used by parameters (the buffers are padded beyond, with the distributed
    /// optimizer).
    pub fn used(&self) -> usize {
        self.used
    }

    /// Sets every gradient to zero (with sharded gradients, releases every bucket's storage).
    pub fn zero_grads(&self) -> Result<()> {
        if let Some(buckets) = &self.bucket_grads {
            for (b, whole) in buckets.iter().enumerate() {
                if !whole.storage().release() {
                    return invalid!(
                        "the gradients of bucket {b} are still borrowed when the step zeroes them"
                    );
                }
            }
            return Ok(());
        }
        if self.grads.gpu().is_some() || self.grads.dtype() != DType::F32 {
            return Ok(self.grads.fill(0.0)?);
        }
        crate::kernels::elementwise::fill(&mut self.grads.write::<f32>()?, 0.0);
        Ok(())
    }
}
