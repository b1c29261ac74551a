//! Moving tensors between "whole on every rank" and "split by the last dimension", and with
//! sequence parallelism between "whole" and "split along the sequence" (the first dimension of
//! `[s, b, h]`): Megatron-LM's gather, scatter and reduce-scatter regions (`mappings.py`).

use crate::comm::ReduceOp;
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

/// The sum over the tensor-parallel group of every rank's `x` (f32), in place: an all-reduce
/// over tp (a LoRA adapter's partial down-projection, or its rank's input gradient).
#[track_caller]
pub fn all_reduce_tp(cx: &Cx, x: &Tensor) -> Result<()> {
    if cx.tp_size() > 1 {
        cx.tp().all_reduce(x, ReduceOp::Sum)?;
    }
    Ok(())
}

/// The dims of `x` (`[s / tp, ..]`) with the first times `tp`.
fn gathered_dims(x: &Tensor, tp: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    if let Some(first) = dims.first_mut() {
        *first *= tp;
    }
    dims
}

/// With sequence parallelism, the whole sequence from every tensor-parallel rank's shard
/// (`[s / tp, b, h]` → `[s, b, h]`, rank order; Megatron-LM's
/// `gather_from_sequence_parallel_region`): an all-gather over tp, in `x`'s dtype. Its backward
/// is [`reduce_scatter_sequence`].
#[track_caller]
pub fn all_gather_sequence(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    let tp = cx.tp_size();
    let x = x.contiguous()?;
    if x.dims().is_empty() {
        return invalid!("cannot gather a scalar along the sequence");
    }
    let whole = Tensor::empty_near(gathered_dims(&x, tp), x.dtype(), &x)?;
    cx.tp().all_gather(&x, &whole)?;
    Ok(whole)
}

/// With sequence parallelism, the sum over the tensor-parallel group of every rank's whole
/// `x` (`[s, b, h]`, f32), each rank keeping its shard of the sequence (`[s / tp, b, h]`;
/// Megatron-LM's `reduce_scatter_to_sequence_parallel_region`): a reduce-scatter over tp. Its
/// backward is [`all_gather_sequence`].
#[track_caller]
pub fn reduce_scatter_sequence(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    let tp = cx.tp_size();
    let x = x.to_f32_contiguous()?;
    let mut dims = x.dims().to_vec();
    match dims.first_mut() {
        Some(first) if first.is_multiple_of(tp) => *first /= tp,
        _ => {
            return invalid!(
                "sequence parallelism splits the first dimension of {} over tp = {tp}: \
                 it does not divide",
                x.shape()
            );
        }
    }
    let shard = Tensor::empty_near(dims, DType::F32, &x)?;
    cx.tp().reduce_scatter(&x, &shard, ReduceOp::Sum)?;
    Ok(shard)
}

/// This rank's shard of the sequence of a whole tensor, as a tensor of its own (a contiguous
/// copy, so that the whole one can be freed): what a column-parallel layer keeps of its
/// gathered input with sequence parallelism, in the input's dtype.
pub fn keep_sequence_shard(cx: &Cx, whole: &Tensor) -> Result<Tensor> {
    let shard = split_sequence(cx, whole)?;
    Ok(shard.deep_clone()?)
}

/// This rank's shard of the sequence of a whole tensor (`[s, b, h]` → `[s / tp, b, h]`, a view;
/// Megatron-LM's `scatter_to_sequence_parallel_region`), no communication.
pub fn split_sequence(cx: &Cx, whole: &Tensor) -> Result<Tensor> {
    let tp = cx.tp_size();
    match whole.dims().first() {
        Some(s) if s.is_multiple_of(tp) => Ok(whole.chunk(tp, cx.tp_rank(), 0)?),
        _ => invalid!(
            "sequence parallelism splits the first dimension of {} over tp = {tp}: it does \
             not divide",
            whole.shape()
        ),
    }
}
