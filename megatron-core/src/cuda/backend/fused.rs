//! [`FusedOps`] on a GPU: the generated CUDA C, compiled by NVRTC at its first use.

use super::on_gpu;
use crate::backend::FusedOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::fused;
use crate::error::Result;
use crate::ops::FusedKernel;
use crate::tensor::{DType, Tensor};

impl FusedOps for Gpu {
    fn fused(
        &self,
        kernel: &'static FusedKernel,
        inputs: &[&Tensor],
        scalars: &[f32],
    ) -> Result<Vec<Tensor>> {
        let inputs = inputs
            .iter()
            .map(|t| on_gpu(self, t)?.to_f32_contiguous().map_err(Into::into))
            .collect::<Result<Vec<_>>>()?;
        let outputs = (0..kernel.outputs)
            .map(|_| Tensor::empty_near(inputs[0].shape().clone(), DType::F32, &inputs[0]))
            .collect::<Result<Vec<_>>>()?;
        fused::run(self, kernel, &inputs, scalars, &outputs)?;
        Ok(outputs)
    }
}
