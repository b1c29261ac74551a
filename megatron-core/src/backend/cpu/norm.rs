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
        beta: Option<&Tensor>,
        rows: usize,
        h: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        let mean = Tensor::empty([rows], DType::F32);
        let rstd = Tensor::empty([rows], DType::F32);
        {
            let (x, gamma) = (x.read::<f32>()?, gamma.read::<f32>()?);
            let (mut yw, mut mw, mut rw) = (
                y.write::<f32>()?,
                mean.write::<f32>()?,
                rstd.write::<f32>()?,
            );
            match beta {
                Some(beta) => {
                    let beta = beta.read::<f32>()?;
                    ln::layer_norm_forward(
                        &x, &gamma, &beta, rows, h, eps, &mut yw, &mut mw, &mut rw,
                    )?
                }
                None => ln::rms_norm_forward(&x, &gamma, rows, h, eps, &mut yw, &mut mw, &mut rw)?,
            }
        }
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
        let plus = plus.map(|p| p.read::<f32>()).transpose()?;
        let (x, mean) = (x.read::<f32>()?, mean.read::<f32>()?);
        let (rstd, gamma) = (rstd.read::<f32>()?, gamma.read::<f32>()?);
        let kept = (&x[..], &mean[..], &rstd[..], &gamma[..]);
        let (dy, mut dx, mut dgamma) = (
            dy.read::<f32>()?,
            dx.write::<f32>()?,
            dgamma.write::<f32>()?,
        );
        match dbeta {
            Some(dbeta) => ln::layer_norm_backward_plus(
                &dy,
                kept,
                rows,
                h,
                plus.as_deref(),
                &mut dx,
                &mut dgamma,
                &mut dbeta.write::<f32>()?,
            )?,
            None => ln::rms_norm_backward_plus(
                &dy,
                kept,
                rows,
                h,
                plus.as_deref(),
                &mut dx,
                &mut dgamma,
            )?,
        }
        Ok(())
    }
}
