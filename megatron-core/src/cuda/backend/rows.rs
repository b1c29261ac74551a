//! [`RowOps`] on a GPU: the rows stay on the device; only the index lists (and the routing
//! weights) go up, and only the routing weights' gradients come back.

use super::{ids_on_gpu, on_gpu};
use crate::backend::RowOps;
use crate::cuda::Gpu;
use crate::cuda::kernels::moe;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `values` as i64 on `gpu` (queued, not waited for).
fn indices(gpu: &Gpu, values: impl Iterator<Item = usize>) -> Result<Tensor> {
    let values: Vec<i64> = values.map(|v| v as i64).collect();
    let n = values.len();
    ids_on_gpu(&Tensor::from_vec(values, [n])?, gpu)
}

/// `values` on `gpu`.
fn floats(gpu: &Gpu, values: Vec<f32>) -> Result<Tensor> {
    let n = values.len();
    Tensor::from_vec(values, [n])?.to_gpu(gpu)
}

/// `t` on `gpu` as contiguous f32.
fn device_f32(gpu: &Gpu, t: &Tensor) -> Result<Tensor> {
    Ok(on_gpu(gpu, t)?.to_f32_contiguous()?)
}

impl RowOps for Gpu {
    fn gather_rows(&self, rows: &Tensor, hidden: usize, index: &[usize]) -> Result<Tensor> {
        let rows = device_f32(self, rows)?;
        let source = indices(self, index.iter().copied())?;
        let out = Tensor::empty_on([index.len(), hidden], DType::F32, self)?;
        moe::gather_rows(
            self,
            &rows.device_read::<f32>()?.view(),
            &source.device_read::<i64>()?.view(),
            hidden,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    /// Each token's entries in row order (a counting sort by token), summed by one thread per
    /// output element.
    fn sum_rows(
        &self,
        rows: &Tensor,
        hidden: usize,
        entries: &[(usize, f32)],
        tokens: usize,
    ) -> Result<Tensor> {
        let rows = device_f32(self, rows)?;
        let mut start = vec![0usize; tokens + 1];
        for &(t, _) in entries {
            start[t + 1] += 1;
        }
        for t in 0..tokens {
            start[t + 1] += start[t];
        }
        let mut at = start.clone();
        let mut row = vec![0usize; entries.len()];
        let mut weight = vec![0.0f32; entries.len()];
        for (i, &(t, p)) in entries.iter().enumerate() {
            row[at[t]] = i;
            weight[at[t]] = p;
            at[t] += 1;
        }
        let (start, row) = (
            indices(self, start.into_iter())?,
            indices(self, row.into_iter())?,
        );
        let weight = floats(self, weight)?;
        let out = Tensor::empty_on([tokens, hidden], DType::F32, self)?;
        moe::combine_rows(
            self,
            &rows.device_read::<f32>()?.view(),
            (
                &start.device_read::<i64>()?.view(),
                &row.device_read::<i64>()?.view(),
                &weight.device_read::<f32>()?.view(),
            ),
            hidden,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    fn row_dots(
        &self,
        d: &Tensor,
        rows: &Tensor,
        hidden: usize,
        token: &[usize],
    ) -> Result<Vec<f32>> {
        let (d, rows) = (device_f32(self, d)?, device_f32(self, rows)?);
        let token = indices(self, token.iter().copied())?;
        let dots = Tensor::empty_on([token.numel()], DType::F32, self)?;
        moe::row_dots(
            self,
            &d.device_read::<f32>()?.view(),
            &rows.device_read::<f32>()?.view(),
            &token.device_read::<i64>()?.view(),
            hidden,
            &mut dots.device_write::<f32>()?.view_mut(),
        )?;
        Ok(dots.to_vec::<f32>()?)
    }

    fn scale_rows(&self, d: &Tensor, hidden: usize, entries: &[(usize, f32)]) -> Result<Tensor> {
        let d = device_f32(self, d)?;
        let token = indices(self, entries.iter().map(|&(t, _)| t))?;
        let weight = floats(self, entries.iter().map(|&(_, p)| p).collect())?;
        let out = Tensor::empty_on([entries.len(), hidden], DType::F32, self)?;
        moe::scale_rows(
            self,
            &d.device_read::<f32>()?.view(),
            &token.device_read::<i64>()?.view(),
            &weight.device_read::<f32>()?.view(),
            hidden,
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }
}
