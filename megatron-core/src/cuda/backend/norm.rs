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
        beta: Option<&Tensor>,
        rows: usize,
        h: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let y = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        let mean = Tensor::empty_near([rows], DType::F32, x)?;
        let rstd = Tensor::empty_near([rows], DType::F32, x)?;
        with_out(&y, |out| {
            let (x, gamma) = (x.device_read::<f32>()?, gamma.device_read::<f32>()?);
            let (mut mean, mut rstd) = (mean.device_write::<f32>()?, rstd.device_write::<f32>()?);
            let (mean, rstd) = (&mut mean.view_mut(), &mut rstd.view_mut());
            match beta {
                Some(beta) => Ok(ln::layer_norm_forward(
                    self,
                    &x.view(),
                    &gamma.view(),
                    &beta.device_read::<f32>()?.view(),
                    rows,
                    h,
                    eps,
                    out,
                    mean,
                    rstd,
                )?),
                None => Ok(ln::rms_norm_forward(
                    self,
                    &x.view(),
                    &gamma.view(),
                    rows,
                    h,
                    eps,
                    out,
                    mean,
                    rstd,
                )?),
            }
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
        (dx, dgamma, dbeta): (&Tensor, &Tensor, Option<&Tensor>),
    ) -> Result<()> {
        let plus = plus.map(|p| p.device_read::<f32>()).transpose()?;
        let (x, mean) = (x.device_read::<f32>()?, mean.device_read::<f32>()?);
        let (rstd, g) = (rstd.device_read::<f32>()?, gamma.device_read::<f32>()?);
        let kept = (&x.view(), &mean.view(), &rstd.view(), &g.view());
        let dy = dy.device_read::<f32>()?;
        let plus = plus.as_ref().map(|p| p.view());
        let (mut dx, mut dgamma) = (dx.device_write::<f32>()?, dgamma.device_write::<f32>()?);
        let (dx, dgamma) = (&mut dx.view_mut(), &mut dgamma.view_mut());
        match dbeta {
            Some(dbeta) => ln::layer_norm_backward_plus(
                self,
                &dy.view(),
                kept,
                rows,
                h,
                plus.as_ref(),
                dx,
                dgamma,
                &mut dbeta.device_write::<f32>()?.view_mut(),
            )?,
            None => ln::rms_norm_backward_plus(
                self,
                &dy.view(),
                kept,
                rows,
                h,
                plus.as_ref(),
                dx,
                dgamma,
            )?,
        }
        Ok(())
    }
}
