//! [`RotaryOps`] on the host.

use super::Cpu;
use crate::backend::RotaryOps;
use crate::error::Result;
use crate::kernels::rotary::{self, RopeLayout};
use crate::tensor::{DType, Tensor};

impl RotaryOps for Cpu {
    fn rope(
        &self,
        x: &Tensor,
        layout: RopeLayout,
        inv_freq: &[f32],
        inverse: bool,
    ) -> Result<Tensor> {
        let x = x.to_f32_contiguous()?;
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        rotary::rope(
            &x.read::<f32>()?,
            &mut y.write::<f32>()?,
            layout,
            inv_freq,
            inverse,
        )?;
        Ok(y)
    }
}
