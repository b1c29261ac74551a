//! AdamW over the flat parameter buffers (all of them, or with the distributed optimizer this
//! rank's shard of every bucket); the update takes Megatron-LM's clipping coefficient
//! ([`super::clip`]). With 16-bit
//! parameters the optimizer keeps f32 main parameters (and, for 16-bit gradients, f32 main
//! gradients) laid out like its moments, as Megatron-LM's mixed-precision optimizers do.

use std::ops::Range;

use crate::backend;
use crate::distributed::{ParamBuffers, ParamSlot, ReduceGroups, ShardRanks};
use crate::error::Result;
use crate::invalid;
use crate::kernels::adam::AdamConfig;
use crate::tensor::{DType, Tensor};

/// Hyper-parameters of AdamW (Megatron-LM's names and GPT defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay (not applied to biases and norms).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// A stretch of the buffers that one update covers: its elements, where its moments start,
/// and whether weight decay applies (parameters with the same decay merged).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    range: Range<usize>,
    moments: usize,
    decay: bool,
}

/// AdamW state for one rank's parameters: first and second moments, flat like the buffers, or
/// (with the distributed optimizer) like the rank's shards of the buckets, one after the other;
/// with 16-bit parameters, f32 main parameters (and main gradients) laid out alike.
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// f32 main parameters, when the buffers' values are 16-bit.
    main: Option<Tensor>,
    /// f32 main gradients, when the buffers' gradients are 16-bit or sharded.
    main_grads: Option<Tensor>,
    /// Whether the main gradients are the data-parallel reduction's output itself (sharded
    /// gradients, `optim_grads`) rather than a copy of the buffers' gradients.
    grads_sharded: bool,
    steps: u64,
    runs: Vec<Run>,
    /// The data-parallel ranks whose shards these are (distributed optimizer).
    shard: Option<ShardRanks>,
}

impl AdamW {
    /// Zero moments for every element of `buffers`, or with `shard = Some(ranks)` and sharded
    /// buffers (the distributed optimizer), for that rank's shard of every bucket.
    /// With 16-bit values the main parameters start as the values widened (Megatron-LM's
    /// `param.detach().clone().float()`).
    pub fn new(
        buffers: &ParamBuffers,
        config: AdamWConfig,
        shard: Option<ShardRanks>,
    ) -> Result<AdamW> {
        let shard = shard.filter(|_| buffers.sharded());
        let mut runs: Vec<Run> = Vec::new();
        let mut push = |range: Range<usize>, moments: usize, decay: bool| match runs.last_mut() {
            Some(last)
                if last.decay == decay
                    && last.range.end == range.start
                    && last.moments + last.range.len() == moments =>
            {
                last.range.end = range.end
            }
            _ => runs.push(Run {
                range,
                moments,
                decay,
            }),
        };
        let slots = buffers.slots();
        let n = match shard {
            Some(ranks) => {
                let mut moments = 0;
                for (world, parts) in buffers.shards(ranks) {
                    for part in parts {
                        let at = moments + part.range.start - world.start;
                        push(part.range, at, slots[part.slot].spec.weight_decay);
                    }
                    moments += world.len();
                }
                moments
            }
            None => {
                let mut order: Vec<&ParamSlot> = slots.iter().collect();
                order.sort_by_key(|s| s.offset);
                for slot in order {
                    push(slot.range(), slot.offset, slot.spec.weight_decay);
                }
                buffers.values().numel()
            }
        };
        let f32_unless = |dtype: DType| -> Result<Option<Tensor>> {
            (dtype != DType::F32)
                .then(|| Tensor::zeros_near([n], DType::F32, buffers.values()))
                .transpose()
        };
        let adam = AdamW {
            config,
            exp_avg: Tensor::zeros_near([n], DType::F32, buffers.values())?,
            exp_avg_sq: Tensor::zeros_near([n], DType::F32, buffers.values())?,
            main: f32_unless(buffers.values().dtype())?,
            main_grads: f32_unless(buffers.grads().dtype())?,
            grads_sharded: false,
            steps: 0,
            runs,
            shard,
        };
        if let Some(main) = &adam.main {
            let mut main = main.write::<f32>()?;
            for run in &adam.runs {
                let to = &mut main[run.moments..run.moments + run.range.len()];
                widen_into(buffers.values(), run.range.clone(), to)?;
            }
        }
        Ok(adam)
    }

    /// The f32 main parameters (laid out like the moments), when the values are 16-bit.
    pub fn main_params(&self) -> Option<&Tensor> {
        self.main.as_ref()
    }

    /// The f32 main gradients (laid out like the moments), when the gradients are 16-bit or
    /// sharded.
    pub fn main_grads(&self) -> Option<&Tensor> {
        self.main_grads.as_ref()
    }

    /// Keeps the rank's shard of the reduced gradients in f32 main gradients laid out like the
    /// moments, which the data-parallel reduction fills and the update reads (Megatron-FSDP's
    /// `optim_grads`: [`ParamBuffers::shard_gradients`]); with the distributed optimizer only.
    pub fn keep_sharded_grads(&mut self) -> Result<()> {
        if self.shard.is_none() {
            return invalid!(
                "sharded gradients (optim_grads) keep the shards the distributed optimizer \
                 updates: it needs --use-distributed-optimizer"
            );
        }
        if self.main_grads.is_none() {
            let n = self.exp_avg.numel();
            self.main_grads = Some(Tensor::zeros_near([n], DType::F32, &self.exp_avg)?);
        }
        self.grads_sharded = true;
        Ok(())
    }

    /// Gives back the memory of the moments, main parameters and main gradients (they then
    /// read as zeros): for an optimizer about to be replaced, before its replacement is made.
    pub(crate) fn release_state(&self) {
        let kept = [self.main.as_ref(), self.main_grads.as_ref()];
        for t in [&self.exp_avg, &self.exp_avg_sq]
            .into_iter()
            .chain(kept.into_iter().flatten())
        {
            t.storage().release();
        }
    }

    /// Whether the main gradients are the reduction's output (sharded gradients).
    pub fn grads_sharded(&self) -> bool {
        self.grads_sharded
    }

    /// Where the elements `range` of the buffers (inside one of this rank's parts) lie in the
    /// moments.
    pub(crate) fn to_moments(&self, buffers: &ParamBuffers, range: &Range<usize>) -> Range<usize> {
        let start = match self.shard {
            None => range.start,
            Some(_) => self
                .shard_offsets(buffers)
                .into_iter()
                .find(|(world, _)| world.contains(&range.start))
                .map_or(range.start, |(world, at)| at + range.start - world.start),
        };
        start..start + range.len()
    }

    /// Makes the gradients the update reads: with 16-bit gradients their f32 main copies, and
    /// with loss scaling (`inv_scale`) unscaled in place, checking as it goes for inf and NaN
    /// (Megatron-LM's `_unscale_main_grads_and_check_for_nan`). Returns whether one was found
    /// on this rank (`false` without scaling: nothing is checked).
    pub fn prepare_grads(&self, buffers: &ParamBuffers, inv_scale: Option<f32>) -> Result<bool> {
        if self.main_grads.is_none() && inv_scale.is_none() {
            return Ok(false);
        }
        let parts = self
            .runs
            .iter()
            .map(|run| {
                let len = run.range.len();
                Ok(match &self.main_grads {
                    Some(main) => {
                        let main = main.narrow(0, run.moments, len)?;
                        if !self.grads_sharded {
                            main.copy_from(&buffers.grads().narrow(0, run.range.start, len)?)?;
                        }
                        main
                    }
                    None => buffers.grads().narrow(0, run.range.start, len)?,
                })
            })
            .collect::<Result<Vec<Tensor>>>()?;
        let Some(scale) = inv_scale else {
            return Ok(false);
        };
        backend::of(buffers.values()).unscale_and_check(&parts, scale)
    }

    /// The data-parallel rank whose shards the moments are (the distributed optimizer), or
    /// `None` when they cover the whole buffers.
    pub fn shard(&self) -> Option<ShardRanks> {
        self.shard
    }

    /// Updates made so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The first and second moments, flat like the parameter buffers (or their shards).
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.exp_avg, &self.exp_avg_sq)
    }

    /// Each bucket's shard of the moments: (the shard's range in the buffers, where it starts in
    /// the moments), in bucket order (empty when the moments cover the whole buffers).
    fn shard_offsets(&self, buffers: &ParamBuffers) -> Vec<(Range<usize>, usize)> {
        let Some(ranks) = self.shard else {
            return Vec::new();
        };
        let mut at = 0;
        buffers
            .shards(ranks)
            .into_iter()
            .map(|(world, _)| {
                let start = at;
                at += world.len();
                (world, start)
            })
            .collect()
    }

    /// The moments laid out like the whole buffers: themselves, or with the distributed
    /// optimizer every rank's shards all-gathered over each bucket's group (a collective).
    pub fn whole_moments(
        &self,
        buffers: &ParamBuffers,
        groups: ReduceGroups<'_>,
    ) -> Result<(Tensor, Tensor)> {
        if self.shard.is_none() {
            return Ok((self.exp_avg.clone(), self.exp_avg_sq.clone()));
        }
        let n = buffers.len();
        let whole = (
            Tensor::zeros_near([n], DType::F32, buffers.values())?,
            Tensor::zeros_near([n], DType::F32, buffers.values())?,
        );
        for ((world, at), bucket) in self
            .shard_offsets(buffers)
            .into_iter()
            .zip(buffers.buckets())
        {
            for (mine, all) in [(&self.exp_avg, &whole.0), (&self.exp_avg_sq, &whole.1)] {
                groups.of_bucket(bucket).all_gather(
                    &mine.narrow(0, at, world.len())?,
                    &all.narrow(0, bucket.range.start, bucket.range.len())?,
                )?;
            }
        }
        Ok(whole)
    }

    /// The f32 parameter values laid out like the whole buffers: the values themselves, or
    /// with 16-bit values the main parameters (with the distributed optimizer every rank's
    /// shards all-gathered over each bucket's group, a collective).
    pub fn whole_main_params(
        &self,
        buffers: &ParamBuffers,
        groups: ReduceGroups<'_>,
    ) -> Result<Tensor> {
        let shards = match (&self.main, buffers.sharded_values()) {
            (Some(main), _) => main,
            (None, Some(sharded)) => &sharded.shards,
            (None, None) => return Ok(buffers.values().clone()),
        };
        if self.shard.is_none() {
            return Ok(shards.clone());
        }
        let whole = Tensor::zeros_near([buffers.len()], DType::F32, &self.exp_avg)?;
        for ((world, at), bucket) in self
            .shard_offsets(buffers)
            .into_iter()
            .zip(buffers.buckets())
        {
            groups.of_bucket(bucket).all_gather(
                &shards.narrow(0, at, world.len())?,
                &whole.narrow(0, bucket.range.start, bucket.range.len())?,
            )?;
        }
        Ok(whole)
    }

    /// Sets the parameter values from f32 values laid out like the whole buffers: the buffers'
    /// values (rounded when 16-bit) and the main parameters (this rank's shards of them with the
    /// distributed optimizer).
    pub fn set_whole_main_params(&mut self, buffers: &ParamBuffers, values: &[f32]) -> Result<()> {
        let n = buffers.len();
        if values.len() != n {
            return invalid!("values of {} elements for buffers of {n}", values.len());
        }
        match buffers.sharded_values() {
            // Sharded parameters keep the rank's shards alone (rounded when 16-bit).
            Some(sharded) => {
                for (world, at) in &sharded.at {
                    let src = Tensor::from_slice(&values[world.clone()], [world.len()])?;
                    let src = crate::moe::dispatcher::placed(src, &sharded.shards)?;
                    sharded
                        .shards
                        .narrow(0, *at, world.len())?
                        .copy_from(&src)?;
                }
            }
            None => buffers
                .values()
                .copy_from(&Tensor::from_slice(values, [n])?)?,
        }
        if let Some(main) = &self.main {
            let mut main = main.write::<f32>()?;
            for (world, at) in self.pieces(buffers) {
                main[at..at + world.len()].copy_from_slice(&values[world]);
            }
        }
        buffers.refresh_compute_copies()
    }

    /// Overwrites the parameter values in `range` of the buffers (a value the optimizer does
    /// not move, such as an expert bias) with `values`: the buffers' values (rounded when
    /// 16-bit), their compute copies, and this rank's main parameters there.
    pub fn set_values(
        &self,
        buffers: &ParamBuffers,
        range: Range<usize>,
        values: &[f32],
    ) -> Result<()> {
        if values.len() != range.len() {
            return invalid!(
                "{} values for the {} elements at {range:?}",
                values.len(),
                range.len()
            );
        }
        let write = |to: &Tensor, at: usize, from: &[f32]| -> Result<()> {
            let dst = to.narrow(0, at, from.len())?;
            let src = crate::moe::dispatcher::placed(Tensor::from_slice(from, [from.len()])?, to)?;
            Ok(dst.copy_from(&src)?)
        };
        let mut targets: Vec<&Tensor> = self.main.iter().collect();
        match buffers.sharded_values() {
            Some(sharded) => targets.push(&sharded.shards),
            None => {
                write(buffers.values(), range.start, values)?;
                if let Some(compute) = buffers.compute_copies() {
                    write(compute, range.start, values)?;
                }
            }
        }
        for main in targets {
            for (world, at) in self.pieces(buffers) {
                let (start, end) = (world.start.max(range.start), world.end.min(range.end));
                if start < end {
                    write(
                        main,
                        at + start - world.start,
                        &values[start - range.start..end - range.start],
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The stretches of the whole buffers the moments hold, with where each starts in them.
    fn pieces(&self, buffers: &ParamBuffers) -> Vec<(Range<usize>, usize)> {
        match self.shard {
            None => vec![(0..buffers.len(), 0)],
            Some(_) => self.shard_offsets(buffers),
        }
    }

    /// Sets the moments (on the host) from values laid out like the whole buffers, keeping this
    /// rank's shards with the distributed optimizer.
    pub fn set_whole_moments(
        &mut self,
        buffers: &ParamBuffers,
        m: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let n = buffers.len();
        if m.len() != n || v.len() != n {
            return invalid!(
                "moments of {} and {} elements for buffers of {n}",
                m.len(),
                v.len()
            );
        }
        let mut exp_avg = self.exp_avg.write::<f32>()?;
        let mut exp_avg_sq = self.exp_avg_sq.write::<f32>()?;
        for (world, at) in self.pieces(buffers) {
            let to = at..at + world.len();
            exp_avg[to.clone()].copy_from_slice(&m[world.clone()]);
            exp_avg_sq[to].copy_from_slice(&v[world]);
        }
        Ok(())
    }

    /// Sets the number of updates made (restoring a checkpoint).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Moves the moments to `gpu` (with the parameter buffers, see `Trainer::to_gpu`).
    pub fn to_gpu(&mut self, gpu: &crate::cuda::Gpu) -> Result<()> {
        self.exp_avg = self.exp_avg.to_gpu(gpu)?;
        self.exp_avg_sq = self.exp_avg_sq.to_gpu(gpu)?;
        self.main = self.main.as_ref().map(|t| t.to_gpu(gpu)).transpose()?;
        self.main_grads = self
            .main_grads
            .as_ref()
            .map(|t| t.to_gpu(gpu))
            .transpose()?;
        Ok(())
    }

    /// The hyper-parameters of one parameter's update.
    fn config_for(&self, lr: f64, weight_decay: bool, grad_scale: f64) -> AdamConfig {
        AdamConfig {
            lr,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: if weight_decay {
                self.config.weight_decay
            } else {
                0.0
            },
            step: self.steps,
            decoupled: true,
            grad_scale,
        }
    }

    /// One update of every parameter with learning rate `lr`, from the gradients in `buffers`
    /// multiplied by `grad_scale` (gradient clipping's coefficient, see [`super::clip_coefficient`];
    /// the gradients themselves are left as they are), then the refresh of the compute copies.
    /// On a GPU with bf16 copies the scale, the update and the refresh are one pass.
    pub fn step(&mut self, buffers: &ParamBuffers, lr: f64, grad_scale: f64) -> Result<()> {
        self.step_first(buffers, lr, grad_scale, 0..0, || Ok(()))
    }

    /// [`AdamW::step`] in two parts: first the parameters inside `first` (elements of the flat
    /// buffers), then `between`, then the others. Each element's update is the same as in one
    /// part (Adam is element-wise), so the values are too.
    pub fn step_first(
        &mut self,
        buffers: &ParamBuffers,
        lr: f64,
        grad_scale: f64,
        first: Range<usize>,
        between: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.steps += 1;
        let inside = |r: &Range<usize>| first.start <= r.start && r.end <= first.end;
        self.update(buffers, lr, grad_scale, |r| inside(r))?;
        between()?;
        self.update(buffers, lr, grad_scale, |r| !inside(r))?;
        if self.shard.is_none() && !self.writes_copies(buffers) {
            buffers.refresh_compute_copies()?;
        }
        Ok(())
    }

    /// The bf16 copies the update writes itself, if any: the compute copies, or with f32 main
    /// parameters the bf16 values themselves. (With sharded parameters the compute copies are
    /// converted at each gather instead.)
    fn writes_copies(&self, buffers: &ParamBuffers) -> bool {
        match &self.main {
            Some(_) => buffers.values().dtype() == DType::BF16,
            // fp16 values are rounded from the main parameters after the update.
            None => {
                buffers.sharded_values().is_none()
                    && buffers
                        .compute_copies()
                        .is_some_and(|c| c.dtype() == DType::BF16)
            }
        }
    }

    /// The bf16 copy of `run` the update writes, when it writes one ([`AdamW::writes_copies`]).
    fn copy_of(&self, buffers: &ParamBuffers, run: &Run) -> Result<Option<Tensor>> {
        if !self.writes_copies(buffers) {
            return Ok(None);
        }
        Ok(Some(match (&self.main, buffers.compute_copies()) {
            (None, Some(compute)) => compute.narrow(0, run.range.start, run.range.len())?,
            _ => buffers.value_part(&run.range, run.moments)?,
        }))
    }

    /// Updates the runs whose elements `chosen` accepts (the step counted already), and their
    /// fp16 values from the main parameters.
    fn update(
        &self,
        buffers: &ParamBuffers,
        lr: f64,
        grad_scale: f64,
        chosen: impl Fn(&Range<usize>) -> bool,
    ) -> Result<()> {
        let ops = backend::of(&self.exp_avg);
        let runs = || self.runs.iter().filter(|run| chosen(&run.range));
        for run in runs() {
            let (offset, len) = (run.range.start, run.range.len());
            let moments = |t: &Tensor| t.narrow(0, run.moments, len);
            // Adam updates the main parameters from the main gradients when kept.
            let values = match &self.main {
                Some(main) => moments(main)?,
                None => buffers.value_part(&run.range, run.moments)?,
            };
            let grads = match &self.main_grads {
                Some(main_grads) => moments(main_grads)?,
                None => buffers.grads().narrow(0, offset, len)?,
            };
            let (m, v) = (moments(&self.exp_avg)?, moments(&self.exp_avg_sq)?);
            let copy = self.copy_of(buffers, run)?;
            let cfg = self.config_for(lr, run.decay, grad_scale);
            ops.adam_step((&values, &grads, &m, &v), copy.as_ref(), &cfg)?;
        }
        if let (Some(main), false) = (&self.main, self.writes_copies(buffers)) {
            for run in runs() {
                let len = run.range.len();
                buffers
                    .value_part(&run.range, run.moments)?
                    .copy_from(&main.narrow(0, run.moments, len)?)?;
            }
        }
        Ok(())
    }
}

/// `to = from[range]` widened to f32, for a host tensor of f32, bf16 or fp16 (no copy of the
/// tensor: the main parameters start this way).
fn widen_into(from: &Tensor, range: Range<usize>, to: &mut [f32]) -> Result<()> {
    use half::slice::HalfFloatSliceExt;
    match from.dtype() {
        DType::F32 => to.copy_from_slice(&from.read::<f32>()?[range]),
        DType::BF16 => from.read::<half::bf16>()?[range].convert_to_f32_slice(to),
        DType::F16 => from.read::<half::f16>()?[range].convert_to_f32_slice(to),
        other => return invalid!("{other} parameters or gradients cannot be widened to f32"),
    }
    Ok(())
}
