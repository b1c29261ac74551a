//! AdamW over the flat parameter buffers, with Megatron-LM's global gradient-norm clipping.

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

/// AdamW state for one rank's parameters: first and second moments, flat like the buffers.
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    steps: u64,
}

impl AdamW {
    /// Zero moments for every element of `buffers`.
    pub fn new(buffers: &ParamBuffers, config: AdamWConfig) -> Result<AdamW> {
        if buffers.values().dtype() != DType::F32 {
            return invalid!(
                "AdamW updates f32 parameters; the buffers hold {}",
                buffers.values().dtype()
            );
        }
        let n = buffers.values().numel();
        Ok(AdamW {
            config,
            exp_avg: Tensor::zeros_near([n], DType::F32, buffers.values())?,
            exp_avg_sq: Tensor::zeros_near([n], DType::F32, buffers.values())?,
            steps: 0,
        })
    }

    /// Updates made so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The first and second moments, flat like the parameter buffers.
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.exp_avg, &self.exp_avg_sq)
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
            for slot in buffers.slots() {
                let r = slot.offset..slot.offset + slot.len;
                let cfg = self.config_for(lr, slot.spec.weight_decay, grad_scale);
                adam_step(
                    &mut values[r.clone()],
                    &grads[r.clone()],
                    &mut m[r.clone()],
                    &mut v[r],
                    &cfg,
                )?;
            }
        }
        buffers.refresh_compute_copies()
    }
}

/// Consecutive runs of `(offset, len)` over the slots `keep` selects, adjacent slots merged
/// (the device updates a run with one launch).
#[cfg(feature = "cuda")]
fn runs<K: PartialEq + Copy>(
    buffers: &ParamBuffers,
    key: impl Fn(&crate::module::ParamSlot) -> Option<K>,
) -> Vec<(K, usize, usize)> {
    let mut slots: Vec<_> = buffers
        .slots()
        .iter()
        .filter_map(|s| key(s).map(|k| (k, s.offset, s.len)))
        .collect();
    slots.sort_by_key(|s| s.1);
    let mut out: Vec<(K, usize, usize)> = Vec::new();
    for (k, offset, len) in slots {
        match out.last_mut() {
            Some(last) if last.0 == k && last.1 + last.2 == offset => last.2 += len,
            _ => out.push((k, offset, len)),
        }
    }
    out
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
        for (decay, offset, len) in runs(buffers, |s| Some(s.spec.weight_decay)) {
            let part = |t: &Tensor| t.narrow(0, offset, len);
            let (values, grads) = (part(buffers.values())?, part(buffers.grads())?);
            let (m, v) = (part(&self.exp_avg)?, part(&self.exp_avg_sq)?);
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
                &self.config_for(lr, decay, grad_scale),
            )?;
        }
        if copies.is_none() {
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

/// The global L2 norm of the gradients over the model-parallel group, each parameter counted
/// once: tensor-parallel parts by every rank, replicated parameters by tensor-parallel rank 0.
pub fn grad_norm(
    buffers: &ParamBuffers,
    tp_rank: usize,
    model_parallel: &dyn Communicator,
) -> Result<f64> {
    // Split parameters on every tensor-parallel rank, the others on the first; a copy another
    // pipeline stage holds too (the tied embedding of the last stage) nowhere.
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
    #[cfg(feature = "cuda")]
    if let Some(gpu) = buffers.grads().gpu() {
        // One read back for every run of counted parameters: a host wait per run would leave
        // the GPU idle that many times a step on tensor-parallel ranks past the first, where
        // replicated parameters split the runs.
        let parts = runs(buffers, |s| counted(s).then_some(()))
            .into_iter()
            .map(|((), offset, len)| buffers.grads().narrow(0, offset, len))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let reads = parts
            .iter()
            .map(|p| p.device_read::<f32>())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let views: Vec<_> = reads.iter().map(|r| r.view()).collect();
        let sum = crate::cuda::kernels::elementwise::sum_of_squares_of(gpu, &views)?;
        drop(views);
        drop(reads);
        let total = scalar_near(sum as f32, buffers.grads())?;
        model_parallel.all_reduce(&total, ReduceOp::Sum)?;
        return Ok(f64::from(total.to_vec::<f32>()?[0]).sqrt());
    }
    let grads = buffers.grads().read::<f32>()?;
    let mut sum = 0.0f64;
    for slot in buffers.slots() {
        if counted(slot) {
            sum += sum_of_squares(&grads[slot.offset..slot.offset + slot.len]);
        }
    }
    drop(grads);
    // f32 carries the partial sums across ranks, as Megatron-LM does.
    let total = Tensor::from_vec(vec![sum as f32], [1])?;
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
