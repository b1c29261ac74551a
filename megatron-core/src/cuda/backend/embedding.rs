//! [`EmbeddingOps`] and [`PlaceOps`] on a GPU: lookups and gradients bit for bit the CPU's.

use super::{ids_on_gpu, on_gpu};
use crate::backend::{EmbeddingOps, PlaceOps};
use crate::cuda::Gpu;
use crate::cuda::kernels::{embedding as gek, vocab_parallel as gvp};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

impl PlaceOps for Gpu {
    fn place(&self, t: &Tensor) -> Result<Tensor> {
        on_gpu(self, t)
    }
}

/// Position ids `t / batch` made on the device for `seq × batch` tokens.
fn positions(gpu: &Gpu, seq: usize, batch: usize) -> Result<Tensor> {
    let ids = Tensor::zeros_on([seq * batch], DType::I64, gpu)?;
    gvp::position_ids(gpu, &mut ids.device_write::<i64>()?.view_mut(), batch)?;
    Ok(ids)
}

impl EmbeddingOps for Gpu {
    /// Host ids are uploaded (queued, not waited for).
    fn embedding_lookup(
        &self,
        ids: &Tensor,
        table: &Tensor,
        (vocab_start, local_rows): (usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let ids = ids_on_gpu(ids, self)?;
        let h = table.dims()[1];
        let mut dims = ids.dims().to_vec();
        dims.push(h);
        let out = Tensor::empty_on(dims, DType::F32, self)?;
        gek::embedding_forward(
            self,
            &ids.device_read::<i64>()?.view(),
            &table.device_read::<f32>()?.view(),
            vocab_start,
            local_rows,
            h,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok((out, ids))
    }

    fn embedding_lookup_backward(
        &self,
        ids: &Tensor,
        dy: &Tensor,
        (vocab_start, local_rows): (usize, usize),
        grad: &Tensor,
    ) -> Result<()> {
        let dy = on_gpu(self, dy)?.to_f32_contiguous()?;
        let ids = on_gpu(self, ids)?;
        let h = grad.dims()[1];
        Ok(gek::embedding_backward(
            self,
            &ids.device_read::<i64>()?.view(),
            &dy.device_read::<f32>()?.view(),
            vocab_start,
            local_rows,
            h,
            &mut grad.device_write::<f32>()?.view_mut(),
        )?)
    }

    /// A gather by position ids made on the device.
    fn positions_forward(&self, table: &Tensor, seq: usize, batch: usize) -> Result<Tensor> {
        let (max, h) = (table.dims()[0], table.dims()[1]);
        let out = Tensor::empty_on([seq, batch, h], DType::F32, self)?;
        gek::embedding_forward(
            self,
            &positions(self, seq, batch)?.device_read::<i64>()?.view(),
            &table.device_read::<f32>()?.view(),
            0,
            max,
            h,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    fn positions_backward(
        &self,
        dy: &Tensor,
        seq: usize,
        batch: usize,
        grad: &Tensor,
    ) -> Result<()> {
        let (max, h) = (grad.dims()[0], grad.dims()[1]);
        let dy = on_gpu(self, dy)?.to_f32_contiguous()?;
        let positions = positions(self, seq, batch)?;
        Ok(gek::embedding_backward(
            self,
            &positions.device_read::<i64>()?.view(),
            &dy.device_read::<f32>()?.view(),
            0,
            max,
            h,
            &mut grad.device_write::<f32>()?.view_mut(),
        )?)
    }

    fn mask_columns(&self, x: &Tensor, cols: usize, from: usize) -> Result<()> {
        gvp::mask_columns(
            self,
            &mut x.device_write::<f32>()?.view_mut(),
            x.numel() / cols,
            cols,
            from,
        )?;
        Ok(())
    }
}
