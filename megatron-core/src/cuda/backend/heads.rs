//! [`GroupedHeadOps`] on a GPU: the CUDA kernels on the device tensors, in their dtype.

use crate::backend::{GroupedHeadOps, with_last_dim};
use crate::cuda::Gpu;
use crate::cuda::kernels::heads;
use crate::cuda::kernels::operand::{contiguous_input, with_in, with_out};
use crate::error::Result;
use crate::kernels::heads::GroupedHeads;
use crate::tensor::Tensor;

impl GroupedHeadOps for Gpu {
    fn expand_groups(&self, qkv: &Tensor, sh: GroupedHeads) -> Result<Tensor> {
        let x = contiguous_input(qkv)?;
        let y = Tensor::empty_near(with_last_dim(&x, sh.per_head()), x.dtype(), &x)?;
        with_in(&x, |x| {
            with_out(&y, |y| Ok(heads::expand_groups(self, x, y, sh)?))
        })?;
        Ok(y)
    }

    fn reduce_groups(&self, d_qkv: &Tensor, sh: GroupedHeads) -> Result<Tensor> {
        let dy = contiguous_input(d_qkv)?;
        let dx = Tensor::empty_near(with_last_dim(&dy, sh.grouped()), dy.dtype(), &dy)?;
        with_in(&dy, |dy| {
            with_out(&dx, |dx| Ok(heads::reduce_groups(self, dy, dx, sh)?))
        })?;
        Ok(dx)
    }
}
