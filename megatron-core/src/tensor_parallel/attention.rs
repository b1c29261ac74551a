//! Causal self-attention over heads, as an [`Op`]: on a tensor-parallel rank it sees only its
//! whole heads (the fused QKV projection is column-parallel), so it needs no communication.

use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::{self as dk, LogicalIndex};
use crate::kernels::softmax;
use crate::module::{Cx, Op, Site};
use crate::ops::matmul;
use crate::rng::DropoutStream;
use crate::tensor::{DType, Tensor};

/// Multi-head causal self-attention with scaled dot products and attention dropout.
///
/// Input: the fused projection `[s, b, 3·h_local]` laid out per head as `[q | k | v]` of
/// `head_dim` each (Megatron-LM's layout, so a column-parallel split gives each rank whole
/// heads). Output: `[s, b, h_local]`, heads in order.
#[derive(Debug, Clone, PartialEq)]
pub struct CausalSelfAttention {
    /// Attention heads of the whole layer (all tensor-parallel ranks together).
    pub heads: usize,
    /// Dropout probability on the attention weights.
    pub dropout: f32,
}

impl CausalSelfAttention {
    /// `heads` heads with attention dropout `dropout`.
    pub fn new(heads: usize, dropout: f32) -> Self {
        CausalSelfAttention { heads, dropout }
    }
}

/// What attention keeps: queries, keys, values and the attention weights before dropout.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    dropout: Option<(f32, DropoutStream, LogicalIndex)>,
    shape: Shape,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Shape {
    seq: usize,
    batch: usize,
    heads: usize,
    head_dim: usize,
}

impl Shape {
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// `[s, b, heads·3·d]` (per head q|k|v) → three `[b·heads, s, d]` tensors.
fn split_heads(qkv: &Tensor, sh: Shape) -> Result<[Tensor; 3]> {
    let Shape {
        seq,
        batch,
        heads,
        head_dim: d,
    } = sh;
    let src = qkv.read::<f32>()?;
    let outs = [0, 1, 2].map(|_| Tensor::empty([batch * heads, seq, d], DType::F32));
    {
        let mut w: Vec<_> = outs
            .iter()
            .map(|t| t.write::<f32>())
            .collect::<Result<_, _>>()?;
        for s in 0..seq {
            for b in 0..batch {
                for n in 0..heads {
                    let from = ((s * batch + b) * heads + n) * 3 * d;
                    let to = ((b * heads + n) * seq + s) * d;
                    for (part, out) in w.iter_mut().enumerate() {
                        out[to..to + d]
                            .copy_from_slice(&src[from + part * d..from + (part + 1) * d]);
                    }
                }
            }
        }
    }
    Ok(outs)
}

/// `[b·heads, s, d]` → `[s, b, heads·d]`.
fn merge_heads(x: &Tensor, sh: Shape) -> Result<Tensor> {
    let Shape {
        seq,
        batch,
        heads,
        head_dim: d,
    } = sh;
    let out = Tensor::empty([seq, batch, heads * d], DType::F32);
    {
        let src = x.read::<f32>()?;
        let mut o = out.write::<f32>()?;
        for b in 0..batch {
            for n in 0..heads {
                for s in 0..seq {
                    let from = ((b * heads + n) * seq + s) * d;
                    let to = ((s * batch + b) * heads + n) * d;
                    o[to..to + d].copy_from_slice(&src[from..from + d]);
                }
            }
        }
    }
    Ok(out)
}

/// `[s, b, heads·d]` → `[b·heads, s, d]` (inverse of [`merge_heads`]).
fn unmerge_heads(x: &Tensor, sh: Shape) -> Result<Tensor> {
    let Shape {
        seq,
        batch,
        heads,
        head_dim: d,
    } = sh;
    let out = Tensor::empty([batch * heads, seq, d], DType::F32);
    {
        let src = x.read::<f32>()?;
        let mut o = out.write::<f32>()?;
        for s in 0..seq {
            for b in 0..batch {
                for n in 0..heads {
                    let from = ((s * batch + b) * heads + n) * d;
                    let to = ((b * heads + n) * seq + s) * d;
                    o[to..to + d].copy_from_slice(&src[from..from + d]);
                }
            }
        }
    }
    Ok(out)
}

/// Three `[b·heads, s, d]` gradients → `[s, b, heads·3·d]` (inverse of [`split_heads`]).
fn join_heads(parts: [&Tensor; 3], sh: Shape) -> Result<Tensor> {
    let Shape {
        seq,
        batch,
        heads,
        head_dim: d,
    } = sh;
    let out = Tensor::empty([seq, batch, heads * 3 * d], DType::F32);
    {
        let srcs: Vec<_> = parts
            .iter()
            .map(|t| t.read::<f32>())
            .collect::<Result<_, _>>()?;
        let mut o = out.write::<f32>()?;
        for s in 0..seq {
            for b in 0..batch {
                for n in 0..heads {
                    let to = ((s * batch + b) * heads + n) * 3 * d;
                    let from = ((b * heads + n) * seq + s) * d;
                    for (part, src) in srcs.iter().enumerate() {
                        o[to + part * d..to + (part + 1) * d].copy_from_slice(&src[from..from + d]);
                    }
                }
            }
        }
    }
    Ok(out)
}

impl CausalSelfAttention {
    fn shape(&self, cx: &Cx, qkv: &Tensor) -> Result<Shape> {
        let tp = cx.tp_size();
        if self.heads == 0 || !self.heads.is_multiple_of(tp) {
            return invalid!(
                "{} attention heads cannot be split over tp = {tp}",
                self.heads
            );
        }
        let heads = self.heads / tp;
        let [seq, batch, width] = qkv.dims() else {
            return invalid!(
                "attention: fused QKV must be [sequence, batch, 3·hidden/tp], got {}",
                qkv.shape()
            );
        };
        if width % (3 * heads) != 0 {
            return invalid!(
                "attention: QKV width {width} is not 3 × {heads} local heads × a head size"
            );
        }
        Ok(Shape {
            seq: *seq,
            batch: *batch,
            heads,
            head_dim: width / (3 * heads),
        })
    }

    /// Where this rank's attention weights `[b, local heads, s, s]` lie among all heads'.
    fn logical_index(&self, cx: &Cx, sh: Shape) -> LogicalIndex {
        let per_head = sh.seq * sh.seq;
        LogicalIndex {
            outer: sh.batch,
            inner: sh.heads * per_head,
            logical_stride: (self.heads * per_head) as u64,
            logical_start: (cx.tp_rank() * sh.heads * per_head) as u64,
        }
    }
}

/// Applies the dropout mask of `mask` to `x` (or returns `x` unchanged without one).
fn masked(x: &Tensor, mask: &Option<(f32, DropoutStream, LogicalIndex)>) -> Result<Tensor> {
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

/// [`masked`] of two tensors with one mask, generated once: the forward's dropout of `a` and
/// the backward's of `b` (or both unchanged without a mask).
fn masked_pair(
    a: &Tensor,
    b: &Tensor,
    mask: &Option<(f32, DropoutStream, LogicalIndex)>,
) -> Result<(Tensor, Tensor)> {
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

impl Op for CausalSelfAttention {
    type Saved = AttentionSaved;

    fn forward(&self, cx: &Cx, site: Site, qkv: &Tensor) -> Result<(Tensor, AttentionSaved)> {
        dk::keep_threshold(self.dropout)?;
        let sh = self.shape(cx, qkv)?;
        let qkv = qkv.to_f32_contiguous()?;
        let [q, k, v] = split_heads(&qkv, sh)?;
        let scores = matmul(&q, &k.transpose(1, 2)?)?;
        let probs = Tensor::empty(scores.shape().clone(), DType::F32);
        softmax::softmax_forward(
            &scores.read::<f32>()?,
            sh.batch * sh.heads,
            sh.seq,
            sh.seq,
            sh.scale(),
            true,
            &mut probs.write::<f32>()?,
        )?;
        let mask = (cx.training() && self.dropout > 0.0).then(|| {
            (
                self.dropout,
                cx.dropout_stream(site),
                self.logical_index(cx, sh),
            )
        });
        let ctx = matmul(&masked(&probs, &mask)?, &v)?;
        let out = merge_heads(&ctx, sh)?;
        Ok((
            out,
            AttentionSaved {
                q,
                k,
                v,
                probs,
                dropout: mask,
                shape: sh,
            },
        ))
    }

    fn backward(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: AttentionSaved,
        d_out: &Tensor,
    ) -> Result<Tensor> {
        let sh = saved.shape;
        let d_out = d_out.to_f32_contiguous()?;
        if d_out.numel() != sh.seq * sh.batch * sh.heads * sh.head_dim {
            return invalid!(
                "attention: output gradient {} does not fit the forward's output",
                d_out.shape()
            );
        }
        let d_ctx = unmerge_heads(&d_out, sh)?;
        let d_dropped = matmul(&d_ctx, &saved.v.transpose(1, 2)?)?;
        // The forward's dropped probabilities and the gradient through the dropout: one mask.
        let (dropped, d_probs) = masked_pair(&saved.probs, &d_dropped, &saved.dropout)?;
        let dv = matmul(&dropped.transpose(1, 2)?, &d_ctx)?;
        let d_scores = Tensor::empty(d_probs.shape().clone(), DType::F32);
        softmax::softmax_backward(
            &saved.probs.read::<f32>()?,
            &d_probs.read::<f32>()?,
            sh.batch * sh.heads,
            sh.seq,
            sh.seq,
            sh.scale(),
            &mut d_scores.write::<f32>()?,
        )?;
        let dq = matmul(&d_scores, &saved.k)?;
        let dk = matmul(&d_scores.transpose(1, 2)?, &saved.q)?;
        join_heads([&dq, &dk, &dv], sh)
    }
}
