//! [`OptimizerOps`] on the host.

use super::Cpu;
use crate::backend::OptimizerOps;
use crate::error::Result;
use crate::invalid;
use crate::kernels::adam::{AdamConfig, adam_step};
use crate::kernels::elementwise::sum_of_squares;
use crate::tensor::{DType, Tensor};

impl OptimizerOps for Cpu {
    fn unscale_and_check(&self, parts: &[Tensor], scale: f32) -> Result<bool> {
        let mut found = false;
        for part in parts {
            for x in part.write::<f32>()?.iter_mut() {
                *x *= scale;
                found |= !x.is_finite();
            }
        }
        Ok(found)
    }

    fn adam_step(
        &self,
        (params, grads, exp_avg, exp_avg_sq): (&Tensor, &Tensor, &Tensor, &Tensor),
        copy: Option<&Tensor>,
        config: &AdamConfig,
    ) -> Result<()> {
        adam_step(
            &mut params.write::<f32>()?,
            &grads.read::<f32>()?,
            &mut exp_avg.write::<f32>()?,
            &mut exp_avg_sq.write::<f32>()?,
            config,
        )?;
        if let Some(copy) = copy {
            if copy.dtype() != DType::BF16 {
                return invalid!("adam_step: the compute copy is {}, not bf16", copy.dtype());
            }
            copy.copy_from(params)?;
        }
        Ok(())
    }

    fn sum_of_squares(&self, parts: &[Tensor]) -> Result<f64> {
        parts
            .iter()
            .map(|p| Ok(sum_of_squares(&p.read::<f32>()?)))
            .sum()
    }
}
