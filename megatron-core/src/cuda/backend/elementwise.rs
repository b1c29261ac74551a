//! [`ElementwiseOps`] on a GPU: the same arguments as on the host, the CUDA kernels on the
//! tensors' memory (nothing read back but cross-entropy's target check).

use super::on_gpu;
use crate::backend::{DropoutMask, ElementwiseOps, with_last_dim};
use crate::cuda::Gpu;
use crate::cuda::kernels::operand::{contiguous_input, with_in, with_out};
use crate::cuda::kernels::{cross_entropy as ce, dropout as gdk, elementwise};
use crate::error::Result;
use crate::ops::operand_dtype;
use crate::tensor::{DType, Tensor};

impl ElementwiseOps for Gpu {
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = (a.to_f32_contiguous()?, b.to_f32_contiguous()?);
        let out = Tensor::empty_near(a.shape().clone(), DType::F32, &a)?;
        elementwise::add(
            self,
            &a.device_read::<f32>()?.view(),
            &b.device_read::<f32>()?.view(),
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    /// In the products' dtype: on a GPU that multiplies in bf16 the output is bf16 (the next
    /// product's operand, rounded once), and a bf16 input is read as it is and kept so.
    fn gelu(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let x = contiguous_input(x)?;
        let y = Tensor::empty_near(x.shape().clone(), operand_dtype(&x), &x)?;
        with_in(&x, |x| {
            with_out(&y, |y| Ok(elementwise::gelu_forward(self, x, y)?))
        })?;
        Ok((y, x))
    }

    fn gelu_backward(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let dy = contiguous_input(dy)?;
        let dx = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        with_in(x, |x| {
            with_in(&dy, |dy| {
                with_out(&dx, |dx| Ok(elementwise::gelu_backward(self, x, dy, dx)?))
            })
        })?;
        Ok(dx)
    }

    /// In the products' dtype, as [`ElementwiseOps::gelu`]'s.
    fn swiglu(&self, x: &Tensor, ffn: usize) -> Result<(Tensor, Tensor)> {
        let x = contiguous_input(x)?;
        let y = Tensor::empty_near(with_last_dim(&x, ffn), operand_dtype(&x), &x)?;
        with_in(&x, |x| {
            with_out(&y, |y| Ok(elementwise::swiglu_forward(self, x, ffn, y)?))
        })?;
        Ok((y, x))
    }

    fn swiglu_backward(&self, x: &Tensor, dy: &Tensor, ffn: usize) -> Result<Tensor> {
        let dy = contiguous_input(dy)?;
        let dx = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        with_in(x, |x| {
            with_in(&dy, |dy| {
                with_out(&dx, |dx| {
                    Ok(elementwise::swiglu_backward(self, x, dy, ffn, dx)?)
                })
            })
        })?;
        Ok(dx)
    }

    fn dropout(
        &self,
        x: &Tensor,
        (p, stream, index): &DropoutMask,
        dtype: DType,
        backward: bool,
    ) -> Result<Tensor> {
        let y = Tensor::empty_near(x.shape().clone(), dtype, x)?;
        let xv = x.device_read::<f32>()?;
        let kernel = if backward {
            gdk::dropout_backward
        } else {
            gdk::dropout_forward
        };
        with_out(&y, |out| {
            Ok(kernel(self, &xv.view(), out, *p, stream, *index)?)
        })?;
        drop(xv);
        Ok(y)
    }

    fn dropout_add(
        &self,
        residual: &Tensor,
        x: &Tensor,
        (p, stream, index): &DropoutMask,
    ) -> Result<Tensor> {
        let (residual, x) = (on_gpu(self, residual)?, on_gpu(self, x)?);
        let y = Tensor::empty_near(x.shape().clone(), DType::F32, &x)?;
        gdk::dropout_add_forward(
            self,
            &residual.device_read::<f32>()?.view(),
            &x.device_read::<f32>()?.view(),
            &mut y.device_write::<f32>()?.view_mut(),
            *p,
            stream,
            *index,
        )?;
        Ok(y)
    }

    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        rows: usize,
        vocab: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let targets = on_gpu(self, targets)?;
        let losses = Tensor::empty_near(targets.shape().clone(), DType::F32, logits)?;
        let logsumexp = Tensor::empty_near([rows], DType::F32, logits)?;
        ce::cross_entropy_forward(
            self,
            &logits.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            rows,
            vocab,
            &mut losses.device_write::<f32>()?.view_mut(),
            &mut logsumexp.device_write::<f32>()?.view_mut(),
        )?;
        Ok((losses, logsumexp, targets))
    }

    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        logsumexp: &Tensor,
        dloss: &Tensor,
        rows: usize,
        vocab: usize,
    ) -> Result<Tensor> {
        let dloss = on_gpu(self, dloss)?;
        let dlogits = Tensor::empty_near(logits.shape().clone(), DType::F32, logits)?;
        ce::cross_entropy_backward(
            self,
            &logits.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            &logsumexp.device_read::<f32>()?.view(),
            &dloss.device_read::<f32>()?.view(),
            rows,
            vocab,
            &mut dlogits.device_write::<f32>()?.view_mut(),
        )?;
        Ok(dlogits)
    }
}
