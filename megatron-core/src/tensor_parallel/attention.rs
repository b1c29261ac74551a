//! Causal self-attention over heads, as an [`Op`]: on a tensor-parallel rank it sees only its
//! whole heads (the fused QKV projection is column-parallel), so it needs no communication.

use crate::backend::attention::{AttentionKept, AttentionShape};
use crate::backend::{self, DropoutMask};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::{self as dk, LogicalIndex};
use crate::module::{Cx, Op, Recompute, Site};
use crate::tensor::Tensor;

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

/// What attention keeps for its backward, and its dropout mask.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    kept: AttentionKept,
    dropout: Option<DropoutMask>,
    shape: AttentionShape,
}

impl CausalSelfAttention {
    fn shape(&self, cx: &Cx, qkv: &Tensor) -> Result<AttentionShape> {
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
        Ok(AttentionShape {
            seq: *seq,
            batch: *batch,
            heads,
            head_dim: width / (3 * heads),
        })
    }

    /// Where this rank's attention weights `[b, local heads, s, s]` lie among all heads'.
    fn logical_index(&self, cx: &Cx, sh: AttentionShape) -> LogicalIndex {
        LogicalIndex::heads(
            sh.batch,
            sh.seq * sh.seq,
            sh.heads,
            self.heads,
            cx.tp_rank() * sh.heads,
        )
    }
}

impl CausalSelfAttention {
    /// The attention dropout of this call: none when evaluating or with no dropout.
    fn mask(&self, cx: &Cx, site: Site, sh: AttentionShape) -> Option<DropoutMask> {
        (cx.training() && self.dropout > 0.0).then(|| {
            (
                self.dropout,
                cx.dropout_stream(site),
                self.logical_index(cx, sh),
            )
        })
    }
}

impl Op for CausalSelfAttention {
    type Saved = AttentionSaved;

    fn forward(&self, cx: &Cx, site: Site, qkv: &Tensor) -> Result<(Tensor, AttentionSaved)> {
        dk::keep_threshold(self.dropout)?;
        let sh = self.shape(cx, qkv)?;
        let mask = self.mask(cx, site, sh);
        let keep_inputs = cx.recompute() == Recompute::Selective && cx.training();
        let (out, kept) = backend::of(qkv).attention_forward(qkv, sh, &mask, keep_inputs)?;
        Ok((
            out,
            AttentionSaved {
                kept,
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
        if d_out.numel() != sh.dims(1).iter().product::<usize>() {
            return invalid!(
                "attention: output gradient {} does not fit the forward's output",
                d_out.shape()
            );
        }
        backend::of(d_out).attention_backward(&saved.kept, &saved.dropout, sh, d_out)
    }
}
