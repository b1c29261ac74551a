//! Vocab-parallel cross-entropy, fused as Megatron-LM does: each rank holds the logits of its
//! vocabulary slice, and only three b·s-sized all-reduces cross the group, never the b·s·v logits.

use crate::backend;
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
    let local = logits.last_dim();
    let rows = targets.numel();
    if logits.numel() != rows * local || targets.dtype() != DType::I64 {
        return invalid!(
            "vocab-parallel cross-entropy: logits {} do not fit targets {} ({})",
            logits.shape(),
            targets.shape(),
            targets.dtype()
        );
    }
    let start = cx.tp_rank() * local;
    let total = local * cx.tp_size();
    let ops = backend::of(logits);
    let logits = logits.to_f32_contiguous()?;
    let (targets, max, target_logit) = ops.vocab_ce_local(&logits, targets, start, total)?;
    let tp = cx.tp();
    tp.all_reduce(&max, ReduceOp::Max)?;
    let sum = ops.vocab_ce_sum_exp(&logits, &max)?;
    tp.all_reduce(&sum, ReduceOp::Sum)?;
    tp.all_reduce(&target_logit, ReduceOp::Sum)?;
    let (losses, logsumexp) = ops.vocab_ce_finish((&max, &sum, &target_logit), &targets, total)?;
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
    let local = saved.logits.last_dim();
    let start = cx.tp_rank() * local;
    let dloss = dloss.to_f32_contiguous()?;
    if dloss.numel() != saved.targets.numel() {
        return invalid!(
            "vocab-parallel cross-entropy: loss gradient {} does not fit targets {}",
            dloss.shape(),
            saved.targets.shape()
        );
    }
    let dtype = if to_products {
        crate::ops::operand_dtype(&saved.logits)
    } else {
        DType::F32
    };
    let kept = (&saved.logits, &saved.targets, &saved.logsumexp);
    let dlogits = backend::of(&saved.logits).vocab_ce_backward(kept, &dloss, start, dtype)?;
    Ok(dlogits)
}
