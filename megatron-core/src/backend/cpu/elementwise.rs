//! [`ElementwiseOps`] on the host.

use super::Cpu;
use crate::backend::{DropoutMask, ElementwiseOps, with_last_dim};
use crate::error::Result;
use crate::kernels::{cross_entropy as ce, dropout as dk, elementwise};
use crate::tensor::{DType, Tensor};

impl ElementwiseOps for Cpu {
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = (a.to_f32_contiguous()?, b.to_f32_contiguous()?);
        let out = Tensor::empty(a.shape().clone(), DType::F32);
        elementwise::add(
            &a.read::<f32>()?,
            &b.read::<f32>()?,
            &mut out.write::<f32>()?,
        )?;
        Ok(out)
    }

    fn gelu(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let x = x.to_f32_contiguous()?;
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        elementwise::gelu_forward(&x.read::<f32>()?, &mut y.write::<f32>()?)?;
        Ok((y, x))
    }

    fn gelu_backward(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let dy = dy.to_f32_contiguous()?;
        let dx = Tensor::empty(x.shape().clone(), DType::F32);
        elementwise::gelu_backward(
            &x.read::<f32>()?,
            &dy.read::<f32>()?,
            &mut dx.write::<f32>()?,
        )?;
        Ok(dx)
    }

    fn swiglu(&self, x: &Tensor, ffn: usize) -> Result<(Tensor, Tensor)> {
        let x = x.to_f32_contiguous()?;
        let y = Tensor::empty(with_last_dim(&x, ffn), DType::F32);
        elementwise::swiglu_forward(&x.read::<f32>()?, ffn, &mut y.write::<f32>()?)?;
        Ok((y, x))
    }

    fn swiglu_backward(&self, x: &Tensor, dy: &Tensor, ffn: usize) -> Result<Tensor> {
        let dy = dy.to_f32_contiguous()?;
        let dx = Tensor::empty(x.shape().clone(), DType::F32);
        elementwise::swiglu_backward(
            &x.read::<f32>()?,
            &dy.read::<f32>()?,
            ffn,
            &mut dx.write::<f32>()?,
        )?;
        Ok(dx)
    }

    /// Always written in f32 on the host.
    fn dropout(
        &self,
        x: &Tensor,
        (p, stream, index): &DropoutMask,
        _dtype: DType,
        backward: bool,
    ) -> Result<Tensor> {
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        let kernel = if backward {
            dk::dropout_backward
        } else {
            dk::dropout_forward
        };
        kernel(
            &x.read::<f32>()?,
            &mut y.write::<f32>()?,
            *p,
            stream,
            *index,
        )?;
        Ok(y)
    }

    fn dropout_add(
        &self,
        residual: &Tensor,
        x: &Tensor,
        (p, stream, index): &DropoutMask,
    ) -> Result<Tensor> {
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        let (r, xs) = (residual.read::<f32>()?, x.read::<f32>()?);
        dk::dropout_add_forward(&r, &xs, &mut y.write::<f32>()?, *p, stream, *index)?;
        Ok(y)
    }

    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        rows: usize,
        vocab: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let losses = Tensor::empty(targets.shape().clone(), DType::F32);
        let logsumexp = Tensor::empty([rows], DType::F32);
        ce::cross_entropy_forward(
            &logits.read::<f32>()?,
            &targets.read::<i64>()?,
            rows,
            vocab,
            &mut losses.write::<f32>()?,
            &mut logsumexp.write::<f32>()?,
        )?;
        Ok((losses, logsumexp, targets.clone()))
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
        let dlogits = Tensor::empty(logits.shape().clone(), DType::F32);
        ce::cross_entropy_backward(
            &logits.read::<f32>()?,
            &targets.read::<i64>()?,
            &logsumexp.read::<f32>()?,
            &dloss.read::<f32>()?,
            rows,
            vocab,
            &mut dlogits.write::<f32>()?,
        )?;
        Ok(dlogits)
    }
}
