//! [`AttentionOps`] on the host: the heads copied to head-major tensors, the products on the
//! CPU GEMM, the causal softmax and the dropout masks of [`crate::kernels`].

use super::Cpu;
use crate::backend::DropoutMask;
use crate::backend::attention::{AttentionKept, AttentionOps, AttentionShape};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout as dk;
use crate::kernels::softmax;
use crate::ops::matmul;
use crate::tensor::{DType, Tensor};

impl AttentionOps for Cpu {
    /// The host attends packed documents a document at a time.
    fn attention_forward_packed(
        &self,
        _: &Tensor,
        _: AttentionShape,
        _: &crate::documents::Documents,
    ) -> Result<Option<(Tensor, AttentionKept)>> {
        Ok(None)
    }

    fn attention_forward(
        &self,
        qkv: &Tensor,
        sh: AttentionShape,
        mask: &Option<DropoutMask>,
        keep_inputs: bool,
    ) -> Result<(Tensor, AttentionKept)> {
        let qkv = qkv.to_f32_contiguous()?;
        let Ok([q, k, v]) = <[Tensor; 3]>::try_from(to_heads(&qkv, sh, 3)?) else {
            unreachable!("to_heads returns one tensor per part")
        };
        let probs = weights(&q, &k, sh)?;
        let ctx = matmul(&masked(&probs, mask)?, &v)?;
        let out = from_heads(&[&ctx], sh)?;
        let kept = if keep_inputs {
            AttentionKept::Inputs { q, k, v }
        } else {
            AttentionKept::Weights { q, k, v, probs }
        };
        Ok((out, kept))
    }

    fn attention_backward(
        &self,
        kept: &AttentionKept,
        mask: &Option<DropoutMask>,
        sh: AttentionShape,
        d_out: &Tensor,
    ) -> Result<Tensor> {
        let d_out = d_out.to_f32_contiguous()?;
        let recomputed;
        let (q, k, v, probs) = match kept {
            AttentionKept::Weights { q, k, v, probs } => (q, k, v, probs),
            AttentionKept::Inputs { q, k, v } => {
                recomputed = weights(q, k, sh)?;
                (q, k, v, &recomputed)
            }
            AttentionKept::Flash { .. } => {
                return invalid!(
                    "attention: the forward ran on the GPU, the output gradient is on the host"
                );
            }
            AttentionKept::ContextParallel(_) => {
                return invalid!("attention: context parallelism runs its own backward");
            }
            AttentionKept::Documents(_) => {
                return invalid!("attention: packed documents' backward is attend_backward's");
            }
            AttentionKept::Decoded => {
                return invalid!("attention: a decoding forward with a KV cache has no backward");
            }
        };
        let d_ctx = to_heads(&d_out, sh, 1)?.remove(0);
        let d_dropped = matmul(&d_ctx, &v.transpose(1, 2)?)?;
        // The forward's dropped probabilities and the gradient through the dropout: one mask.
        let (dropped, d_probs) = masked_pair(probs, &d_dropped, mask)?;
        let dv = matmul(&dropped.transpose(1, 2)?, &d_ctx)?;
        let d_scores = Tensor::empty(d_probs.shape().clone(), DType::F32);
        softmax::softmax_backward(
            &probs.read::<f32>()?,
            &d_probs.read::<f32>()?,
            sh.batch * sh.heads,
            sh.seq,
            sh.seq,
            sh.scale(),
            &mut d_scores.write::<f32>()?,
        )?;
        let dq = matmul(&d_scores, k)?;
        let dk = matmul(&d_scores.transpose(1, 2)?, q)?;
        from_heads(&[&dq, &dk, &dv], sh)
    }
}

/// Every `d`-element block of the two layouts attention moves between: yields, for each
/// position, batch entry, head and part, the block's offset in the sequence-first layout
/// `[s, b, heads, parts, d]` (how layers hold activations), the part, and its offset in a
/// head-major `[b·heads, s, d]` tensor (how the batched attention products want it).
fn blocks(sh: AttentionShape, parts: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let AttentionShape {
        seq,
        batch,
        heads,
        head_dim: d,
        ..
    } = sh;
    (0..seq).flat_map(move |s| {
        (0..batch).flat_map(move |b| {
            (0..heads).flat_map(move |n| {
                let seq_first = ((s * batch + b) * heads + n) * parts * d;
                let head_major = ((b * heads + n) * seq + s) * d;
                (0..parts).map(move |part| (seq_first + part * d, part, head_major))
            })
        })
    })
}

/// `[s, b, heads·parts·d]` → `parts` tensors `[b·heads, s, d]` (the fused QKV into q, k, v with
/// 3 parts; the output gradient into heads with 1).
fn to_heads(x: &Tensor, sh: AttentionShape, parts: usize) -> Result<Vec<Tensor>> {
    let d = sh.head_dim;
    let outs: Vec<Tensor> = (0..parts)
        .map(|_| Tensor::empty([sh.batch * sh.heads, sh.seq, d], DType::F32))
        .collect();
    {
        let src = x.read::<f32>()?;
        let mut dst: Vec<_> = outs
            .iter()
            .map(|t| t.write::<f32>())
            .collect::<Result<_, _>>()?;
        for (from, part, to) in blocks(sh, parts) {
            dst[part][to..to + d].copy_from_slice(&src[from..from + d]);
        }
    }
    Ok(outs)
}

/// The inverse of [`to_heads`]: `parts` tensors `[b·heads, s, d]` → `[s, b, heads·parts·d]`.
fn from_heads(xs: &[&Tensor], sh: AttentionShape) -> Result<Tensor> {
    let d = sh.head_dim;
    let out = Tensor::empty(sh.dims(xs.len()), DType::F32);
    {
        let srcs: Vec<_> = xs
            .iter()
            .map(|t| t.read::<f32>())
            .collect::<Result<_, _>>()?;
        let mut dst = out.write::<f32>()?;
        for (to, part, from) in blocks(sh, xs.len()) {
            dst[to..to + d].copy_from_slice(&srcs[part][from..from + d]);
        }
    }
    Ok(out)
}

/// Applies the dropout mask of `mask` to `x` (or returns `x` unchanged without one).
fn masked(x: &Tensor, mask: &Option<DropoutMask>) -> Result<Tensor> {
    let Some((p, stream, index)) = mask else {
        return Ok(x.clone());
    };
    let y = Tensor::empty(x.shape().clone(), DType::F32);
    dk::dropout_forward(
        &x.read::<f32>()?,
        &mut y.write::<f32>()?,
        *p,
        stream,
        *index,
    )?;
    Ok(y)
}

/// The attention weights of queries `q` and keys `k` (`[b·heads, s, d]`): the causal softmax
/// of their scaled products (within the sliding window, with one).
fn weights(q: &Tensor, k: &Tensor, sh: AttentionShape) -> Result<Tensor> {
    let scores = matmul(q, &k.transpose(1, 2)?)?;
    let probs = Tensor::empty(scores.shape().clone(), DType::F32);
    softmax::softmax_forward(
        &scores.read::<f32>()?,
        sh.batch * sh.heads,
        sh.seq,
        sh.seq,
        sh.scale(),
        sh.key_mask(),
        &mut probs.write::<f32>()?,
    )?;
    Ok(probs)
}

/// [`masked`] of two tensors with one mask, generated once: the forward's dropout of `a` and
/// the backward's of `b` (or both unchanged without a mask).
fn masked_pair(a: &Tensor, b: &Tensor, mask: &Option<DropoutMask>) -> Result<(Tensor, Tensor)> {
    let Some((p, stream, index)) = mask else {
        return Ok((a.clone(), b.clone()));
    };
    let ya = Tensor::empty(a.shape().clone(), DType::F32);
    let yb = Tensor::empty(b.shape().clone(), DType::F32);
    dk::dropout_pair(
        &a.read::<f32>()?,
        &mut ya.write::<f32>()?,
        &b.read::<f32>()?,
        &mut yb.write::<f32>()?,
        *p,
        stream,
        *index,
    )?;
    Ok((ya, yb))
}
