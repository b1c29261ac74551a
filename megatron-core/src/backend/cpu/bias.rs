//! [`BiasOps`] on the host.

use super::Cpu;
use crate::backend::BiasOps;
use crate::error::Result;
use crate::kernels::elementwise;
use crate::tensor::{DType, Tensor};

impl BiasOps for Cpu {
    fn bias_add_in_place(&self, y: &Tensor, bias: &Tensor) -> Result<()> {
        let cols = bias.numel();
        elementwise::bias_add_forward(
            &mut y.write::<f32>()?,
            &bias.read::<f32>()?,
            y.numel() / cols,
            cols,
        )?;
        Ok(())
    }

    /// The sum in f32 in place, then converted.
    fn bias_add_cast(&self, y: &Tensor, bias: &Tensor, dtype: DType) -> Result<Tensor> {
        self.bias_add_in_place(y, bias)?;
        Ok(y.to_contiguous(dtype)?)
    }

    fn accumulate_bias_grad(
        &self,
        dy: &Tensor,
        rows: usize,
        out: usize,
        grad: &Tensor,
    ) -> Result<()> {
        Ok(elementwise::bias_add_backward(
            &dy.read::<f32>()?,
            rows,
            out,
            &mut grad.write::<f32>()?,
        )?)
    }
}
