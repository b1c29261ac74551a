//! [`GroupedHeadOps`] on the host.

use super::Cpu;
use crate::backend::{GroupedHeadOps, with_last_dim};
use crate::error::Result;
use crate::kernels::heads::{self, GroupedHeads};
use crate::tensor::{DType, Tensor};

impl GroupedHeadOps for Cpu {
    fn expand_groups(&self, qkv: &Tensor, sh: GroupedHeads) -> Result<Tensor> {
        let x = qkv.to_f32_contiguous()?;
        let y = Tensor::empty(with_last_dim(&x, sh.per_head()), DType::F32);
        heads::expand_groups(&x.read::<f32>()?, &mut y.write::<f32>()?, sh)?;
        Ok(y)
    }

    fn reduce_groups(&self, d_qkv: &Tensor, sh: GroupedHeads) -> Result<Tensor> {
        let dy = d_qkv.to_f32_contiguous()?;
        let dx = Tensor::empty(with_last_dim(&dy, sh.grouped()), DType::F32);
        heads::reduce_groups(&dy.read::<f32>()?, &mut dx.write::<f32>()?, sh)?;
        Ok(dx)
    }
}
