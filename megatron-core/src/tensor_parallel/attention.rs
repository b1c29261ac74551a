//! Causal self-attention over heads, as an [`Op`]: on a tensor-parallel rank it sees only its
//! whole heads (the fused QKV projection is column-parallel), so it needs no communication.

use crate::backend::attention::{AttentionKept, AttentionShape};
use crate::backend::{self, DropoutMask};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::{self as dk, LogicalIndex};
use crate::module::{Cx, Op, Recompute, Site};
use crate::tensor::Tensor;
use crate::tensor_parallel::Rotary;

/// Multi-head causal self-attention with scaled dot products and attention dropout.
///
/// Input: the fused projection `[s, b, 3·h_local]` laid out per head as `[q | k | v]` of
/// `head_dim` each (Megatron-LM's layout, so a column-parallel split gives each rank whole
/// heads). Output: `[s, b, h_local]`, heads in order.
///
/// With rotary position embeddings the queries and keys are turned by their positions
/// before the scores (and the gradient turned back after the backward).
#[derive(Debug, Clone, PartialEq)]
pub struct CausalSelfAttention {
    /// Attention heads of the whole layer (all tensor-parallel ranks together).
    pub heads: usize,
    /// Dropout probability on the attention weights.
    pub dropout: f32,
    /// Rotary position embeddings (`--position-embedding-type rope`), if any.
    pub rotary: Option<Rotary>,
}

impl CausalSelfAttention {
    /// `heads` heads with attention dropout `dropout`.
    pub fn new(heads: usize, dropout: f32) -> Self {
        CausalSelfAttention {
            heads,
            dropout,
            rotary: None,
        }
    }

    /// The same with rotary position embeddings `rotary` (none: `None`).
    pub fn with_rotary(mut self, rotary: Option<Rotary>) -> Self {
        self.rotary = rotary;
        self
    }

    /// `qkv` with its queries and keys turned (`inverse`: the gradient turned back).
    fn turned(&self, qkv: &Tensor, sh: AttentionShape, inverse: bool) -> Result<Option<Tensor>> {
        self.rotary
            .as_ref()
            .map(|r| r.apply(qkv, (sh.heads, 3, 2), sh.head_dim, 0, inverse))
            .transpose()
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
        let turned = self.turned(qkv, sh, false)?;
        let qkv = turned.as_ref().unwrap_or(qkv);
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
        let d_qkv =
            backend::of(d_out).attention_backward(&saved.kept, &saved.dropout, sh, d_out)?;
        Ok(self.turned(&d_qkv, sh, true)?.unwrap_or(d_qkv))
    }
}
