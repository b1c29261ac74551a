//! [`NormOps`] on the host.

use super::Cpu;
use crate::backend::NormOps;
use crate::error::Result;
use crate::kernels::layer_norm as ln;
use crate::tensor::{DType, Tensor};

impl NormOps for Cpu {
    /// `y` in f32.
    fn layer_norm(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        rows: usize,
        h: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        let mean = Tensor::empty([rows], DType::F32);
        let rstd = Tensor::empty([rows], DType::F32);
        ln::layer_norm_forward(
            &x.read::<f32>()?,
            &gamma.read::<f32>()?,
            &beta.read::<f32>()?,
            rows,
            h,
            eps,
            &mut y.write::<f32>()?,
            &mut mean.write::<f32>()?,
            &mut rstd.write::<f32>()?,
        )?;
        Ok((y, mean, rstd))
    }

    fn layer_norm_backward(
        &self,
        dy: &Tensor,
        (x, mean, rstd, gamma): (&Tensor, &Tensor, &Tensor, &Tensor),
        plus: Option<&Tensor>,
        rows: usize,
        h: usize,
        (dx, dgamma, dbeta): (&Tensor, &Tensor, &Tensor),
    ) -> Result<()> {
        let plus = plus.map(|p| p.read::<f32>()).transpose()?;
        ln::layer_norm_backward_plus(
            &dy.read::<f32>()?,
            (
                &x.read::<f32>()?,
                &mean.read::<f32>()?,
                &rstd.read::<f32>()?,
                &gamma.read::<f32>()?,
            ),
            rows,
            h,
            plus.as_deref(),
            &mut dx.write::<f32>()?,
            &mut dgamma.write::<f32>()?,
            &mut dbeta.write::<f32>()?,
        )?;
        Ok(())
    }
}
