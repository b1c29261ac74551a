//! Moving tensors between "whole on every rank" and "split by the last dimension": Megatron-LM's
//! gather and scatter regions.

use crate::error::Result;
use crate::invalid;
use crate::module::Cx;
use crate::tensor::{DType, Tensor};

/// All-gathers every rank's slice of the last dimension into the whole tensor (rank order).
pub fn gather_last_dim(cx: &Cx, local: &Tensor) -> Result<Tensor> {
    let tp = cx.tp_size();
    let local = local.to_f32_contiguous()?;
    if tp == 1 {
        return Ok(local);
    }
    let cols = local.last_dim();
    let rows = local.numel().checked_div(cols).unwrap_or(0);
    let parts = Tensor::empty_near([tp, rows, cols], DType::F32, &local)?;
    cx.tp().all_gather(&local, &parts)?;
    let mut dims = local.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = cols * tp;
    }
    if parts.gpu().is_some() {
        // [tp, rows, cols] → [rows, tp, cols]: one strided copy on the device.
        return Ok(parts.transpose(0, 1)?.contiguous()?.reshape(dims)?);
    }
    let whole = Tensor::empty(dims, DType::F32);
    {
        let p = parts.read::<f32>()?;
        let mut w = whole.write::<f32>()?;
        for r in 0..tp {
            for i in 0..rows {
                let src = &p[(r * rows + i) * cols..(r * rows + i + 1) * cols];
                w[i * cols * tp + r * cols..i * cols * tp + (r + 1) * cols].copy_from_slice(src);
            }
        }
    }
    Ok(whole)
}

/// This rank's slice of the last dimension of a whole tensor, contiguous and in the tensor's
/// dtype (a bf16 output gradient on its way to a column-parallel product stays bf16).
pub fn split_last_dim(cx: &Cx, whole: &Tensor) -> Result<Tensor> {
    let tp = cx.tp_size();
    let last = whole.dims().len().saturating_sub(1);
    let cols = whole.last_dim();
    if !cols.is_multiple_of(tp) {
        return invalid!(
            "cannot split the last dimension of {} over tp = {tp}",
            whole.shape()
        );
    }
    Ok(whole
        .chunk(tp, cx.tp_rank(), last)?
        .to_contiguous(whole.dtype())?)
}
