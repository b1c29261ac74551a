//! [`RotaryOps`] on a GPU: the CUDA kernel on the device tensor, in its dtype.

use crate::backend::RotaryOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::operand::{contiguous_input, with_in, with_out};
use crate::cuda::kernels::rotary;
use crate::error::Result;
use crate::kernels::rotary::RopeLayout;
use crate::tensor::Tensor;

impl RotaryOps for Gpu {
    fn rope(
        &self,
        x: &Tensor,
        layout: RopeLayout,
        inv_freq: &[f32],
        inverse: bool,
    ) -> Result<Tensor> {
        let x = contiguous_input(x)?;
        let y = Tensor::empty_near(x.shape().clone(), x.dtype(), &x)?;
        with_in(&x, |x| {
            with_out(&y, |y| {
                Ok(rotary::rope(self, x, y, layout, inv_freq, inverse)?)
            })
        })?;
        Ok(y)
    }
}
