//! `ParamBuffers`: every parameter and gradient of a model as views into two flat buffers.

use super::{Module, ParamSpec};
use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

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

/// One flat value buffer and one flat f32 gradient buffer holding every parameter of a model.
///
/// Parameters are laid out in reverse order of the model's visit order, as Megatron-LM does: the
/// backward produces the last layers' gradients first, so the front of the gradient buffer is
/// complete first and data-parallel buckets can be reduced while the backward goes on. The total
/// is padded to a multiple of `pad_to` (the data-parallel size) so that it cuts into equal shards.
#[derive(Debug, Clone)]
pub struct ParamBuffers {
    values: Tensor,
    grads: Tensor,
    /// Lower-precision copies of `values` that products read, when kept (mixed precision).
    compute: Option<Tensor>,
    slots: Vec<ParamSlot>,
    used: usize,
}

impl ParamBuffers {
    /// Moves every parameter of `model` into the flat buffers (values copied once) and rebinds
    /// the model's parameters to views of them.
    pub fn pack<M: Module>(model: &mut M, pad_to: usize) -> Result<ParamBuffers> {
        let mut params: Vec<(ParamSpec, Tensor)> = Vec::new();
        model.visit_params(&mut |p| params.push((p.spec().clone(), p.value().clone())));
        let dtype = params.first().map_or(DType::F32, |(_, v)| v.dtype());
        if let Some((spec, v)) = params.iter().find(|(_, v)| v.dtype() != dtype) {
            return invalid!(
                "parameter {} is {} but the others are {dtype}",
                spec.name,
                v.dtype()
            );
        }
        let mut slots = vec![None; params.len()];
        let mut offset = 0;
        for (i, (spec, _)) in params.iter().enumerate().rev() {
            let len = spec.local.numel();
            slots[i] = Some(ParamSlot {
                offset,
                len,
                spec: spec.clone(),
                shared_copy: false,
            });
            offset += len;
        }
        let used = offset;
        let pad_to = pad_to.max(1);
        let total = used.div_ceil(pad_to) * pad_to;
        let values = Tensor::zeros([total], dtype);
        let grads = Tensor::zeros([total], DType::F32);
        let slots: Vec<ParamSlot> = slots
            .into_iter()
            .map(|s| s.expect("every slot is set"))
            .collect();
        for (slot, (_, value)) in slots.iter().zip(&params) {
            values
                .narrow(0, slot.offset, slot.len)?
                .copy_from(&value.reshape([slot.len])?.contiguous()?)?;
        }
        let buffers = ParamBuffers {
            values,
            grads,
            compute: None,
            slots,
            used,
        };
        buffers.bind(model)?;
        Ok(buffers)
    }

    /// Rebinds every parameter of `model` (the model these buffers were packed from) to views
    /// of the flat buffers, its compute copy included.
    fn bind<M: Module>(&self, model: &mut M) -> Result<()> {
        let mut i = 0;
        let mut failure = None;
        model.visit_params_mut(&mut |p| {
            if failure.is_some() {
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
            let bound = (|| {
                let compute = self.compute.as_ref().map(view).transpose()?;
                p.rebind(view(&self.values)?, view(&self.grads)?, compute)
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
    #[cfg(feature = "cuda")]
    pub fn to_gpu<M: Module>(&mut self, model: &mut M, gpu: &crate::cuda::Gpu) -> Result<()> {
        self.values = self.values.to_gpu(gpu)?;
        self.grads = Tensor::zeros_on(self.grads.shape().clone(), DType::F32, gpu)?;
        if let Some(compute) = &self.compute {
            self.compute = Some(Tensor::empty_on(
                compute.shape().clone(),
                compute.dtype(),
                gpu,
            )?);
            self.refresh_compute_copies()?;
        }
        self.bind(model)
    }

    /// Keeps a `dtype` copy of every parameter that products read (Megatron-LM's bf16 model
    /// weights next to the f32 main values the optimizer updates): one flat buffer beside the
    /// values, filled now and refreshed by [`ParamBuffers::refresh_compute_copies`] after every
    /// change of the values (the trainer does it after each optimizer step).
    pub fn keep_compute_copies<M: Module>(&mut self, model: &mut M, dtype: DType) -> Result<()> {
        if dtype == self.values.dtype() {
            return invalid!("compute copies must differ from the {dtype} values");
        }
        self.compute = Some(Tensor::empty_near(
            self.values.shape().clone(),
            dtype,
            &self.values,
        )?);
        self.refresh_compute_copies()?;
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

    /// The flat f32 gradients.
    pub fn grads(&self) -> &Tensor {
        &self.grads
    }

    /// Every parameter's place, in the model's visit order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
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

    /// Elements used by parameters (the buffers may be padded beyond).
    pub fn used(&self) -> usize {
        self.used
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.grads.gpu().is_some() {
            return Ok(self.grads.fill(0.0)?);
        }
        crate::kernels::elementwise::fill(&mut self.grads.write::<f32>()?, 0.0);
        Ok(())
    }
}
