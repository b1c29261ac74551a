//! AdamW over the flat parameter buffers (all of them, or with the distributed optimizer this
//! rank's shard of every bucket), with Megatron-LM's global gradient-norm clipping.

use std::ops::Range;

use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::invalid;
use crate::kernels::adam::{AdamConfig, adam_step};
use crate::kernels::elementwise::sum_of_squares;
use crate::module::{ParamBuffers, ParamSlot, Split};
use crate::parallel::GroupKind;
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
/// (with the distributed optimizer) like the rank's shards of the buckets, one after the other.
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    steps: u64,
    runs: Vec<Run>,
    /// The data-parallel rank whose shards these are (distributed optimizer).
    shard: Option<usize>,
}

impl AdamW {
    /// Zero moments for every element of `buffers`, or with `shard = Some(dp_rank)` and sharded
    /// buffers (the distributed optimizer), for that rank's shard of every bucket.
    pub fn new(buffers: &ParamBuffers, config: AdamWConfig, shard: Option<usize>) -> Result<AdamW> {
        if buffers.values().dtype() != DType::F32 {
            return invalid!(
                "AdamW updates f32 parameters; the buffers hold {}",
                buffers.values().dtype()
            );
        }
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
            Some(rank) => {
                let mut moments = 0;
                for (world, parts) in buffers.shards(rank) {
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
        Ok(AdamW {
            config,
            exp_avg: Tensor::zeros_near([n], DType::F32, buffers.values())?,
            exp_avg_sq: Tensor::zeros_near([n], DType::F32, buffers.values())?,
            steps: 0,
            runs,
            shard,
        })
    }

    /// The data-parallel rank whose shards the moments are (the distributed optimizer), or
    /// `None` when they cover the whole buffers.
    pub fn shard(&self) -> Option<usize> {
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
        let Some(rank) = self.shard else {
            return Vec::new();
        };
        let mut at = 0;
        buffers
            .shards(rank)
            .into_iter()
            .map(|(world, _)| {
                let start = at;
                at += world.len();
                (world, start)
            })
            .collect()
    }

    /// The moments laid out like the whole buffers: themselves, or with the distributed
    /// optimizer every rank's shards all-gathered over `dp` (a collective of the group).
    pub fn whole_moments(
        &self,
        buffers: &ParamBuffers,
        dp: &dyn Communicator,
    ) -> Result<(Tensor, Tensor)> {
        if self.shard.is_none() {
            return Ok((self.exp_avg.clone(), self.exp_avg_sq.clone()));
        }
        let n = buffers.values().numel();
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
                dp.all_gather(
                    &mine.narrow(0, at, world.len())?,
                    &all.narrow(0, bucket.range.start, bucket.range.len())?,
                )?;
            }
        }
        Ok(whole)
    }

    /// Sets the moments (on the host) from values laid out like the whole buffers, keeping this
    /// rank's shards with the distributed optimizer.
    pub fn set_whole_moments(
        &mut self,
        buffers: &ParamBuffers,
        m: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let n = buffers.values().numel();
        if m.len() != n || v.len() != n {
            return invalid!(
                "moments of {} and {} elements for buffers of {n}",
                m.len(),
                v.len()
            );
        }
        let pieces = match self.shard {
            None => vec![(0..n, 0)],
            Some(_) => self.shard_offsets(buffers),
        };
        let mut exp_avg = self.exp_avg.write::<f32>()?;
        let mut exp_avg_sq = self.exp_avg_sq.write::<f32>()?;
        for (world, at) in pieces {
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
    #[cfg(feature = "cuda")]
    pub fn to_gpu(&mut self, gpu: &crate::cuda::Gpu) -> Result<()> {
        self.exp_avg = self.exp_avg.to_gpu(gpu)?;
        self.exp_avg_sq = self.exp_avg_sq.to_gpu(gpu)?;
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
    /// multiplied by `grad_scale` (gradient clipping's coefficient, see [`clip_coefficient`];
    /// the gradients themselves are left as they are), then the refresh of the compute copies.
    /// On a GPU with bf16 copies the scale, the update and the refresh are one pass.
    pub fn step(&mut self, buffers: &ParamBuffers, lr: f64, grad_scale: f64) -> Result<()> {
        self.steps += 1;
        #[cfg(feature = "cuda")]
        if let Some(gpu) = buffers.values().gpu() {
            return self.step_on_gpu(gpu, buffers, lr, grad_scale);
        }
        {
            let mut values = buffers.values().write::<f32>()?;
            let grads = buffers.grads().read::<f32>()?;
            let mut m = self.exp_avg.write::<f32>()?;
            let mut v = self.exp_avg_sq.write::<f32>()?;
            for run in &self.runs {
                let r = run.range.clone();
                let mr = run.moments..run.moments + r.len();
                let cfg = self.config_for(lr, run.decay, grad_scale);
                adam_step(
                    &mut values[r.clone()],
                    &grads[r],
                    &mut m[mr.clone()],
                    &mut v[mr],
                    &cfg,
                )?;
            }
        }
        // Sharded, the copies are refreshed once the parameters are all-gathered.
        if self.shard.is_none() {
            buffers.refresh_compute_copies()?;
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl AdamW {
    fn step_on_gpu(
        &self,
        gpu: &crate::cuda::Gpu,
        buffers: &ParamBuffers,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        use crate::cuda::kernels::adam::adam_step as gpu_adam;
        // bf16 compute copies are written by the update itself; others are refreshed after.
        let copies = buffers
            .compute_copies()
            .filter(|c| c.dtype() == DType::BF16);
        for run in &self.runs {
            let (offset, len) = (run.range.start, run.range.len());
            let part = |t: &Tensor| t.narrow(0, offset, len);
            let moments = |t: &Tensor| t.narrow(0, run.moments, len);
            let (values, grads) = (part(buffers.values())?, part(buffers.grads())?);
            let (m, v) = (moments(&self.exp_avg)?, moments(&self.exp_avg_sq)?);
            let (mut values, grads) = (values.device_write::<f32>()?, grads.device_read::<f32>()?);
            let (mut m, mut v) = (m.device_write::<f32>()?, v.device_write::<f32>()?);
            let copy = copies.map(part).transpose()?;
            let mut copy = copy
                .as_ref()
                .map(|c| c.device_write::<half::bf16>())
                .transpose()?;
            let mut copy_view = copy.as_mut().map(|c| c.view_mut());
            gpu_adam(
                gpu,
                &mut values.view_mut(),
                &grads.view(),
                &mut m.view_mut(),
                &mut v.view_mut(),
                copy_view.as_mut(),
                &self.config_for(lr, run.decay, grad_scale),
            )?;
        }
        if copies.is_none() && self.shard.is_none() {
            buffers.refresh_compute_copies()?;
        }
        Ok(())
    }
}

/// A one-element f32 tensor on `like`'s device (scalars reduced across ranks).
pub(crate) fn scalar_near(value: f32, like: &Tensor) -> Result<Tensor> {
    let t = Tensor::zeros_near([1], DType::F32, like)?;
    t.fill(value)?;
    Ok(t)
}

/// The ranges of the gradient buffer this rank counts in the norm, merged: each parameter
/// once over the model-parallel group (tensor-parallel parts by every rank, replicated
/// parameters by tensor-parallel rank 0, a copy another pipeline stage holds too nowhere), and
/// with `shard = Some(dp_rank)` only the parts in that rank's shards.
fn counted_ranges(
    buffers: &ParamBuffers,
    tp_rank: usize,
    shard: Option<usize>,
) -> Vec<Range<usize>> {
    let counted = |slot: &ParamSlot| {
        !slot.shared_copy
            && match slot.spec.split {
                Split::Dim {
                    group: GroupKind::Tp,
                    ..
                } => true,
                _ => tp_rank == 0,
            }
    };
    let slots = buffers.slots();
    let mut ranges: Vec<Range<usize>> = match shard {
        Some(rank) => buffers
            .shards(rank)
            .into_iter()
            .flat_map(|(_, parts)| parts)
            .filter(|part| counted(&slots[part.slot]))
            .map(|part| part.range)
            .collect(),
        None => slots
            .iter()
            .filter(|s| counted(s))
            .map(|s| s.range())
            .collect(),
    };
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => merged.push(r),
        }
    }
    merged
}

/// Σx² of `grads` over `ranges`, read back once on a GPU (a host wait per range would leave it
/// idle that many times a step).
fn sum_of_squares_over(grads: &Tensor, ranges: &[Range<usize>]) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = grads.gpu() {
        let parts = ranges
            .iter()
            .map(|r| grads.narrow(0, r.start, r.len()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let reads = parts
            .iter()
            .map(|p| p.device_read::<f32>())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let views: Vec<_> = reads.iter().map(|r| r.view()).collect();
        return Ok(crate::cuda::kernels::elementwise::sum_of_squares_of(
            gpu, &views,
        )?);
    }
    let grads = grads.read::<f32>()?;
    Ok(ranges
        .iter()
        .map(|r| sum_of_squares(&grads[r.clone()]))
        .sum())
}

/// The global L2 norm of the gradients, each parameter counted once: summed over this rank's
/// parameters (see [`counted_ranges`]), then over the model-parallel group, and with the
/// distributed optimizer (`dp` given and the buffers sharded) first over the data-parallel
/// group, each rank having summed its shards only.
pub fn grad_norm(
    buffers: &ParamBuffers,
    tp_rank: usize,
    model_parallel: &dyn Communicator,
    dp: Option<&dyn Communicator>,
) -> Result<f64> {
    let dp = dp.filter(|_| buffers.sharded());
    let ranges = counted_ranges(buffers, tp_rank, dp.map(|c| c.index()));
    let sum = sum_of_squares_over(buffers.grads(), &ranges)?;
    // f32 carries the partial sums across ranks, as Megatron-LM does.
    let total = scalar_near(sum as f32, buffers.grads())?;
    if let Some(dp) = dp {
        dp.all_reduce(&total, ReduceOp::Sum)?;
    }
    model_parallel.all_reduce(&total, ReduceOp::Sum)?;
    Ok(f64::from(total.to_vec::<f32>()?[0]).sqrt())
}

/// Megatron-LM's gradient clipping coefficient: `max_norm / (norm + 1e-6)` when that is below
/// 1 (and clipping is on, `max_norm > 0`), else 1. [`AdamW::step`] multiplies the gradients by it.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    let coeff = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coeff < 1.0 {
        coeff
    } else {
        1.0
    }
}
