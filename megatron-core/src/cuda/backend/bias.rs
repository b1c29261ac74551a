//! [`BiasOps`] on a GPU.

use crate::backend::BiasOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::elementwise;
use crate::cuda::kernels::operand::with_out;
use crate::error::Result;
use crate::ops::matmul_into;
use crate::tensor::{DType, Tensor};

impl BiasOps for Gpu {
    fn bias_add_in_place(&self, y: &Tensor, bias: &Tensor) -> Result<()> {
        let cols = bias.numel();
        elementwise::bias_add_forward(
            self,
            &mut y.device_write::<f32>()?.view_mut(),
            &bias.device_read::<f32>()?.view(),
            y.numel() / cols,
            cols,
        )?;
        Ok(())
    }

    /// One pass: the sum written in `dtype`.
    fn bias_add_cast(&self, y: &Tensor, bias: &Tensor, dtype: DType) -> Result<Tensor> {
        let cols = bias.numel();
        let out = Tensor::empty_near(y.shape().clone(), dtype, y)?;
        with_out(&out, |o| {
            Ok(elementwise::bias_add_cast(
                self,
                &y.device_read::<f32>()?.view(),
                &bias.device_read::<f32>()?.view(),
                o,
                y.numel().checked_div(cols).unwrap_or(0),
                cols,
            )?)
        })?;
        Ok(out)
    }

    /// A product with a row of ones, accumulated by cuBLAS into the gradient in place (the
    /// CPU's `+=`).
    fn accumulate_bias_grad(
        &self,
        dy: &Tensor,
        rows: usize,
        _out: usize,
        grad: &Tensor,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let ones = Tensor::empty_near([1, rows], DType::F32, dy)?;
        ones.fill(1.0)?;
        let grad_row = grad.reshape([1, grad.numel()])?;
        matmul_into(1.0, &ones, dy, 1.0, &grad_row)?;
        Ok(())
    }
}
