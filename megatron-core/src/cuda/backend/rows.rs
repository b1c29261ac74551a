//! [`RowOps`] on a GPU: the rows and their index tables stay on the device (the tables computed
//! there from the routing's map and the exchanged counts); nothing is read back.

use super::{ids_on_gpu, on_gpu};
use crate::backend::RowOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::moe::{self, SlotDims};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `t` on `gpu` as contiguous f32.
fn device_f32(gpu: &Gpu, t: &Tensor) -> Result<Tensor> {
    Ok(on_gpu(gpu, t)?.to_f32_contiguous()?)
}

/// `[tokens, k]` of a slot table whose rows are `k` long.
fn slot_dims(slots: &Tensor, hidden: usize) -> SlotDims {
    let (tokens, k) = match slots.dims() {
        [tokens, k] => (*tokens, *k),
        _ => (slots.numel(), 1),
    };
    SlotDims { tokens, k, hidden }
}

/// An empty i64 table of `shape` on `gpu`.
fn new_table(gpu: &Gpu, shape: &[usize]) -> Result<Tensor> {
    Tensor::empty_on(shape.to_vec(), DType::I64, gpu)
}

impl RowOps for Gpu {
    fn gather_rows(&self, rows: &Tensor, hidden: usize, index: &Tensor) -> Result<Tensor> {
        let rows = device_f32(self, rows)?;
        let index = ids_on_gpu(index, self)?;
        let out = Tensor::empty_on([index.numel(), hidden], DType::F32, self)?;
        moe::gather_rows(
            self,
            &rows.device_read::<f32>()?.view(),
            &index.device_read::<i64>()?.view(),
            hidden,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    fn sum_rows(
        &self,
        rows: &Tensor,
        hidden: usize,
        slots: &Tensor,
        weights: Option<&Tensor>,
    ) -> Result<Tensor> {
        let dims = slot_dims(slots, hidden);
        let rows = device_f32(self, rows)?;
        let slots = ids_on_gpu(slots, self)?;
        let weights = weights.map(|w| device_f32(self, w)).transpose()?;
        let out = Tensor::empty_on([dims.tokens, hidden], DType::F32, self)?;
        let weights = weights
            .as_ref()
            .map(|w| w.device_read::<f32>())
            .transpose()?;
        moe::slot_sum(
            self,
            &rows.device_read::<f32>()?.view(),
            &slots.device_read::<i64>()?.view(),
            weights.as_ref().map(|w| w.view()).as_ref(),
            dims,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    fn row_dots(&self, d: &Tensor, rows: &Tensor, hidden: usize, slots: &Tensor) -> Result<Tensor> {
        let dims = slot_dims(slots, hidden);
        let (d, rows) = (device_f32(self, d)?, device_f32(self, rows)?);
        let slots = ids_on_gpu(slots, self)?;
        let dots = Tensor::empty_on([dims.tokens, dims.k], DType::F32, self)?;
        moe::slot_dots(
            self,
            &d.device_read::<f32>()?.view(),
            &rows.device_read::<f32>()?.view(),
            &slots.device_read::<i64>()?.view(),
            dims,
            &mut dots.device_write::<f32>()?.view_mut(),
        )?;
        Ok(dots)
    }

    fn scale_rows(
        &self,
        d: &Tensor,
        hidden: usize,
        slots: &Tensor,
        weights: &Tensor,
        rows: usize,
    ) -> Result<Tensor> {
        let dims = slot_dims(slots, hidden);
        let (d, weights) = (device_f32(self, d)?, device_f32(self, weights)?);
        let slots = ids_on_gpu(slots, self)?;
        let out = Tensor::zeros_on([rows, hidden], DType::F32, self)?;
        moe::slot_scale(
            self,
            &d.device_read::<f32>()?.view(),
            &slots.device_read::<i64>()?.view(),
            &weights.device_read::<f32>()?.view(),
            dims,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    fn expert_slots(
        &self,
        map: &Tensor,
        experts: std::ops::Range<usize>,
        rows: usize,
    ) -> Result<(Tensor, Tensor)> {
        let SlotDims { tokens, k: all, .. } = slot_dims(map, 0);
        let map = ids_on_gpu(map, self)?;
        let (slots, source) = (new_table(self, &[tokens, all])?, new_table(self, &[rows])?);
        moe::expert_slots(
            self,
            &map.device_read::<i64>()?.view(),
            (tokens, all),
            experts,
            &mut slots.device_write::<i64>()?.view_mut(),
            &mut source.device_write::<i64>()?.view_mut(),
        )?;
        Ok((slots, source))
    }

    fn column_counts(&self, map: &Tensor, experts: std::ops::Range<usize>) -> Result<Tensor> {
        let SlotDims { tokens, k: all, .. } = slot_dims(map, 0);
        let map = ids_on_gpu(map, self)?;
        let counts = new_table(self, &[experts.len()])?;
        moe::column_counts(
            self,
            &map.device_read::<i64>()?.view(),
            (tokens, all),
            experts,
            &mut counts.device_write::<i64>()?.view_mut(),
        )?;
        Ok(counts)
    }

    fn chunk_order(
        &self,
        counts: &Tensor,
        local: usize,
        rows: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        let counts = ids_on_gpu(counts, self)?;
        let ranks = counts.numel() / local.max(1);
        let index = new_table(self, &[rows])?;
        moe::chunk_order(
            self,
            &counts.device_read::<i64>()?.view(),
            (ranks, local),
            inverse,
            &mut index.device_write::<i64>()?.view_mut(),
        )?;
        Ok(index)
    }

    fn affine_index(&self, n: usize, mab: (usize, usize, usize)) -> Result<Tensor> {
        let index = new_table(self, &[n])?;
        moe::affine_index(self, mab, &mut index.device_write::<i64>()?.view_mut())?;
        Ok(index)
    }
}
