//! [`OptimizerOps`] on a GPU: one kernel per run, results read back once per pass.

use crate::backend::OptimizerOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::{adam, elementwise};
use crate::error::Result;
use crate::kernels::adam::AdamConfig;
use crate::tensor::Tensor;

impl OptimizerOps for Gpu {
    fn unscale_and_check(&self, parts: &[Tensor], scale: f32) -> Result<bool> {
        let mut writes = parts
            .iter()
            .map(|p| p.device_write::<f32>())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut views: Vec<_> = writes.iter_mut().map(|w| w.view_mut()).collect();
        Ok(elementwise::unscale_and_check(self, &mut views, scale)?)
    }

    fn adam_step(
        &self,
        (params, grads, exp_avg, exp_avg_sq): (&Tensor, &Tensor, &Tensor, &Tensor),
        copy: Option<&Tensor>,
        config: &AdamConfig,
    ) -> Result<()> {
        let (mut values, grads) = (params.device_write::<f32>()?, grads.device_read::<f32>()?);
        let (mut m, mut v) = (
            exp_avg.device_write::<f32>()?,
            exp_avg_sq.device_write::<f32>()?,
        );
        let mut copy = copy.map(|c| c.device_write::<half::bf16>()).transpose()?;
        let mut copy_view = copy.as_mut().map(|c| c.view_mut());
        adam::adam_step(
            self,
            &mut values.view_mut(),
            &grads.view(),
            &mut m.view_mut(),
            &mut v.view_mut(),
            copy_view.as_mut(),
            config,
        )?;
        Ok(())
    }

    /// Read back once: a host wait per part would leave the GPU idle that many times a step.
    fn sum_of_squares(&self, parts: &[Tensor]) -> Result<f64> {
        let reads = parts
            .iter()
            .map(|p| p.device_read::<f32>())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let views: Vec<_> = reads.iter().map(|r| r.view()).collect();
        Ok(elementwise::sum_of_squares_of(self, &views)?)
    }
}
