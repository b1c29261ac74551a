//! [`NormOps`] on a GPU: the CUDA kernels on the device tensors, parameters included.

use crate::backend::NormOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::layer_norm as ln;
use crate::cuda::kernels::operand::with_out;
use crate::error::Result;
use crate::ops::operand_dtype;
use crate::tensor::{DType, Tensor};

impl NormOps for Gpu {
    fn layer_norm(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        rows: usize,
        h: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let y = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        let mean = Tensor::empty_near([rows], DType::F32, x)?;
        let rstd = Tensor::empty_near([rows], DType::F32, x)?;
        with_out(&y, |out| {
            Ok(ln::layer_norm_forward(
                self,
                &x.device_read::<f32>()?.view(),
                &gamma.device_read::<f32>()?.view(),
                &beta.device_read::<f32>()?.view(),
                rows,
                h,
                eps,
                out,
                &mut mean.device_write::<f32>()?.view_mut(),
                &mut rstd.device_write::<f32>()?.view_mut(),
            )?)
        })?;
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
        let plus = plus.map(|p| p.device_read::<f32>()).transpose()?;
        let (x, mean) = (x.device_read::<f32>()?, mean.device_read::<f32>()?);
        let (rstd, g) = (rstd.device_read::<f32>()?, gamma.device_read::<f32>()?);
        ln::layer_norm_backward_plus(
            self,
            &dy.device_read::<f32>()?.view(),
            (&x.view(), &mean.view(), &rstd.view(), &g.view()),
            rows,
            h,
            plus.as_ref().map(|p| p.view()).as_ref(),
            &mut dx.device_write::<f32>()?.view_mut(),
            &mut dgamma.device_write::<f32>()?.view_mut(),
            &mut dbeta.device_write::<f32>()?.view_mut(),
        )?;
        Ok(())
    }
}
