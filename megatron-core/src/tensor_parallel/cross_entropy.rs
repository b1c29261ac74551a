//! Vocab-parallel cross-entropy, fused as Megatron-LM does: each rank holds the logits of its
//! vocabulary slice, and only three b·s-sized all-reduces cross the group, never the b·s·v logits.

use crate::comm::ReduceOp;
use crate::error::Result;
use crate::invalid;
use crate::module::{Cx, Site};
use crate::tensor::{DType, Tensor};

/// What the vocab-parallel cross-entropy keeps for its backward.
#[derive(Debug, Clone)]
pub struct VocabParallelCrossEntropySaved {
    logits: Tensor,
    targets: Tensor,
    /// Global log-sum-exp per row.
    logsumexp: Tensor,
}

impl VocabParallelCrossEntropySaved {
    /// This rank's logits slice `[.., V/tp]` that the loss was computed from.
    pub fn logits(&self) -> &Tensor {
        &self.logits
    }
}

/// Per-token losses from this rank's logits slice `[.., V/tp]` and the targets `[..]` (i64).
///
/// 1. local row maxima, all-reduced (max);
/// 2. local sums of exp(logit − max), all-reduced (sum);
/// 3. the target's logit, taken by the rank whose slice holds it, all-reduced (sum).
///
/// Then loss = ln(sum) + max − target logit.
pub fn vocab_parallel_cross_entropy(
    cx: &Cx,
    _site: Site,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, VocabParallelCrossEntropySaved)> {
    let local = logits.dims().last().copied().unwrap_or(1);
    let rows = targets.numel();
    if logits.numel() != rows * local || targets.dtype() != DType::I64 {
        return invalid!(
            "vocab-parallel cross-entropy: logits {} do not fit targets {} ({})",
            logits.shape(),
            targets.shape(),
            targets.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    if let Some(gpu) = logits.gpu() {
        return device::forward(cx, gpu, logits, targets);
    }
    let start = cx.tp_rank() * local;
    let total = local * cx.tp_size();
    let logits = logits.to_f32_contiguous()?;
    let targets = targets.contiguous()?;
    let max = Tensor::empty([rows], DType::F32);
    let sum = Tensor::empty([rows], DType::F32);
    let target_logit = Tensor::zeros([rows], DType::F32);
    {
        let l = logits.read::<f32>()?;
        let t = targets.read::<i64>()?;
        check_targets(&t, total)?;
        let mut m = max.write::<f32>()?;
        let mut tl = target_logit.write::<f32>()?;
        for (i, row) in l.chunks_exact(local).enumerate() {
            m[i] = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let target = t[i] as usize;
            if (start..start + local).contains(&target) {
                tl[i] = row[target - start];
            }
        }
    }
    let tp = cx.tp();
    tp.all_reduce(&max, ReduceOp::Max)?;
    {
        let l = logits.read::<f32>()?;
        let m = max.read::<f32>()?;
        let mut s = sum.write::<f32>()?;
        for (i, row) in l.chunks_exact(local).enumerate() {
            s[i] = row
                .iter()
                .map(|&x| f64::from((x - m[i]).exp()))
                .sum::<f64>() as f32;
        }
    }
    tp.all_reduce(&sum, ReduceOp::Sum)?;
    tp.all_reduce(&target_logit, ReduceOp::Sum)?;
    let losses = Tensor::empty(targets.shape().clone(), DType::F32);
    let logsumexp = Tensor::empty([rows], DType::F32);
    {
        let (m, s, tl) = (
            max.read::<f32>()?,
            sum.read::<f32>()?,
            target_logit.read::<f32>()?,
        );
        let mut out = losses.write::<f32>()?;
        let mut lse = logsumexp.write::<f32>()?;
        for i in 0..rows {
            lse[i] = m[i] + s[i].ln();
            out[i] = lse[i] - tl[i];
        }
    }
    Ok((
        losses,
        VocabParallelCrossEntropySaved {
            logits,
            targets,
            logsumexp,
        },
    ))
}

/// Gradient of the logits slice: `(softmax − onehot) · dloss`, with no communication.
pub fn vocab_parallel_cross_entropy_backward(
    cx: &Cx,
    site: Site,
    saved: VocabParallelCrossEntropySaved,
    dloss: &Tensor,
) -> Result<Tensor> {
    vocab_parallel_cross_entropy_backward_to(cx, site, saved, dloss, false)
}

/// [`vocab_parallel_cross_entropy_backward`] for logits whose layer reads their gradient only
/// as a product's operand (`to_products`, the tied output layer's
/// `VocabParallel::LOGITS_GRADIENT_FEEDS_PRODUCTS`): on a GPU that multiplies in bf16 the
/// gradient is then written in bf16, the bits that layer's own conversion gave, one pass and
/// half the memory fewer (the logits' gradient is the step's largest tensor).
pub fn vocab_parallel_cross_entropy_backward_to(
    cx: &Cx,
    _site: Site,
    saved: VocabParallelCrossEntropySaved,
    dloss: &Tensor,
    to_products: bool,
) -> Result<Tensor> {
    let local = saved.logits.dims().last().copied().unwrap_or(1);
    let start = cx.tp_rank() * local;
    let dloss = dloss.to_f32_contiguous()?;
    if dloss.numel() != saved.targets.numel() {
        return invalid!(
            "vocab-parallel cross-entropy: loss gradient {} does not fit targets {}",
            dloss.shape(),
            saved.targets.shape()
        );
    }
    #[cfg(feature = "cuda")]
    if let Some(gpu) = saved.logits.gpu().cloned() {
        let dtype = if to_products {
            crate::ops::operand_dtype(&saved.logits)
        } else {
            DType::F32
        };
        return device::backward(cx, &gpu, saved, &dloss, dtype);
    }
    let _ = to_products;
    let dlogits = Tensor::empty(saved.logits.shape().clone(), DType::F32);
    {
        let l = saved.logits.read::<f32>()?;
        let t = saved.targets.read::<i64>()?;
        let lse = saved.logsumexp.read::<f32>()?;
        let g = dloss.read::<f32>()?;
        let mut d = dlogits.write::<f32>()?;
        for (i, (row, drow)) in l
            .chunks_exact(local)
            .zip(d.chunks_exact_mut(local))
            .enumerate()
        {
            for (x, dx) in row.iter().zip(drow.iter_mut()) {
                *dx = (x - lse[i]).exp() * g[i];
            }
            let target = t[i] as usize;
            if (start..start + local).contains(&target) {
                drow[target - start] -= g[i];
            }
        }
    }
    Ok(dlogits)
}

/// The fused vocab-parallel cross-entropy on the GPU (feature `cuda`), when the logits are a
/// device tensor: the same steps and all-reduces, each local step one kernel of
/// [`crate::cuda::kernels::vocab_parallel`], nothing read back.
/// Every target lies in the (padded) vocabulary of `total` entries.
fn check_targets(targets: &[i64], total: usize) -> Result<()> {
    if let Some((row, &bad)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t < 0 || t as usize >= total)
    {
        return invalid!("target {bad} of row {row} is outside the (padded) vocabulary of {total}");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod device {
    use super::VocabParallelCrossEntropySaved;
    use crate::comm::ReduceOp;
    use crate::cuda::Gpu;
    use crate::cuda::kernels::operand::with_out;
    use crate::cuda::kernels::vocab_parallel as gvp;
    use crate::error::Result;
    use crate::module::Cx;
    use crate::tensor::{DType, Tensor};
    use crate::tensor_parallel::embedding::ids_on_gpu;

    /// The forward (shapes and dtypes checked by the caller). Host targets are checked as on the
    /// CPU and uploaded; device targets are not checked (that would read them back): a target
    /// outside the vocabulary gives a NaN loss.
    pub(super) fn forward(
        cx: &Cx,
        gpu: &Gpu,
        logits: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, VocabParallelCrossEntropySaved)> {
        let local = logits.dims().last().copied().unwrap_or(1);
        let rows = targets.numel();
        let start = cx.tp_rank() * local;
        let total = local * cx.tp_size();
        let logits = logits.to_f32_contiguous()?;
        if targets.gpu().is_none() {
            super::check_targets(&targets.contiguous()?.read::<i64>()?, total)?;
        }
        let targets = ids_on_gpu(targets, gpu)?;
        let max = Tensor::zeros_on([rows], DType::F32, gpu)?;
        let sum = Tensor::zeros_on([rows], DType::F32, gpu)?;
        let target_logit = Tensor::zeros_on([rows], DType::F32, gpu)?;
        gvp::cross_entropy_local(
            gpu,
            &logits.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            rows,
            local,
            start,
            &mut max.device_write::<f32>()?.view_mut(),
            &mut target_logit.device_write::<f32>()?.view_mut(),
        )?;
        cx.tp().all_reduce(&max, ReduceOp::Max)?;
        gvp::cross_entropy_sum_exp(
            gpu,
            &logits.device_read::<f32>()?.view(),
            &max.device_read::<f32>()?.view(),
            rows,
            local,
            &mut sum.device_write::<f32>()?.view_mut(),
        )?;
        cx.tp().all_reduce(&sum, ReduceOp::Sum)?;
        cx.tp().all_reduce(&target_logit, ReduceOp::Sum)?;
        let losses = Tensor::zeros_on(targets.shape().clone(), DType::F32, gpu)?;
        let logsumexp = Tensor::zeros_on([rows], DType::F32, gpu)?;
        gvp::cross_entropy_finish(
            gpu,
            &max.device_read::<f32>()?.view(),
            &sum.device_read::<f32>()?.view(),
            &target_logit.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            total,
            &mut losses.device_write::<f32>()?.view_mut(),
            &mut logsumexp.device_write::<f32>()?.view_mut(),
        )?;
        Ok((
            losses,
            VocabParallelCrossEntropySaved {
                logits,
                targets,
                logsumexp,
            },
        ))
    }

    /// The backward (the loss gradient's size checked by the caller): one kernel, no
    /// communication.
    pub(super) fn backward(
        cx: &Cx,
        gpu: &Gpu,
        saved: VocabParallelCrossEntropySaved,
        dloss: &Tensor,
        dtype: DType,
    ) -> Result<Tensor> {
        let local = saved.logits.dims().last().copied().unwrap_or(1);
        let start = cx.tp_rank() * local;
        let dloss = if dloss.gpu().is_some() {
            dloss.clone()
        } else {
            dloss.to_gpu(gpu)?
        };
        let dlogits = Tensor::empty_on(saved.logits.shape().clone(), dtype, gpu)?;
        let (logits, targets) = (
            saved.logits.device_read::<f32>()?,
            saved.targets.device_read::<i64>()?,
        );
        let (lse, dloss) = (
            saved.logsumexp.device_read::<f32>()?,
            dloss.device_read::<f32>()?,
        );
        with_out(&dlogits, |out| {
            let (l, t, s, d) = (logits.view(), targets.view(), lse.view(), dloss.view());
            Ok(gvp::cross_entropy_backward(
                gpu, &l, &t, &s, &d, local, start, out,
            )?)
        })?;
        drop((logits, targets, lse, dloss));
        Ok(dlogits)
    }
}
