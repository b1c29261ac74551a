//! Attention's math on one rank's heads, below the tensor-parallel layer
//! (`tensor_parallel::attention`, which owns the shapes, the dropout mask and the recompute
//! policy): the sizes, what the backward keeps, and [`AttentionOps`].

use std::ops::Range;

use super::DropoutMask;
use crate::backend;
use crate::documents::{Documents, map_runs};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::LogicalIndex;
use crate::tensor::Tensor;

/// Sizes of one attention call on this rank.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    /// Sequence length.
    pub(crate) seq: usize,
    /// Batch entries.
    pub(crate) batch: usize,
    /// This rank's heads.
    pub(crate) heads: usize,
    /// Elements per head.
    pub(crate) head_dim: usize,
    /// Sliding-window attention: each query sees itself and at most this many keys before it
    /// (`None`: every earlier key).
    pub(crate) window: Option<usize>,
    /// The scores' scale: 1/√d for `CausalSelfAttention`, what `DotProductAttention` says
    /// for the general attention (whose heads may be padded beyond the queries' size).
    pub(crate) scale: f32,
}

impl AttentionShape {
    /// The keys each query sees: causal, within the window if there is one.
    pub(crate) fn key_mask(&self) -> crate::kernels::softmax::KeyMask {
        crate::kernels::softmax::KeyMask::causal_window(true, self.window)
    }

    /// The scores' scale.
    pub(crate) fn scale(&self) -> f32 {
        self.scale
    }

    /// The sequence-first layout `[s, b, heads·parts·d]` with `parts` blocks of `d` per head
    /// (1: the context, 3: the fused q/k/v projection).
    pub(crate) fn dims(&self, parts: usize) -> [usize; 3] {
        [self.seq, self.batch, self.heads * parts * self.head_dim]
    }
}

/// The tensors attention's backward reads.
#[derive(Debug, Clone)]
pub(crate) enum AttentionKept {
    /// Queries, keys and values (`[b·heads, s, d]`, or views of the fused projection) and the
    /// attention weights before dropout.
    Weights {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        probs: Tensor,
    },
    /// Queries, keys and values only: the weights are recomputed in the backward (selective
    /// activation recompute, on the CPU).
    Inputs { q: Tensor, k: Tensor, v: Tensor },
    /// The flash kernels': the fused projection in bf16, the output and the log-sum-exp of
    /// every row's scaled scores (the weights are recomputed from them), with dropout the
    /// bits of the elements it kept (64-bit words, as I64), and with packed documents their
    /// table on the device (`flash_attention::Documents`).
    #[allow(
        dead_code,
        reason = "made by the GPU backend only, which a build without CUDA lacks"
    )]
    Flash {
        qkv: Tensor,
        out: Tensor,
        lse: Tensor,
        keep: Option<Tensor>,
        documents: Option<Tensor>,
    },
    /// Nothing: a decoding forward with a KV cache, which has no backward.
    Decoded,
    /// Context parallelism's own (its backward exchanges over the context-parallel group, not
    /// a device's kernels).
    ContextParallel(Box<crate::context_parallel::CpAttentionSaved>),
    /// Packed documents attended apart: each document's own ([`attend`]).
    Documents(Vec<DocumentKept>),
}

/// What one document of a packed sample kept: its sample, its rows, its attention's kept
/// values and its dropout.
#[derive(Debug, Clone)]
pub(crate) struct DocumentKept {
    sample: usize,
    rows: Range<usize>,
    kept: AttentionKept,
    dropout: Option<DropoutMask>,
}

/// Attention of `qkv` on its device, with each document of a packed microbatch attended as a
/// sequence of its own when `documents` keep them apart (FlashAttention's variable-length
/// form: the pairs of two documents are never computed): in one pass where the device's
/// kernels take the documents (the GPU's flash kernels, without dropout), else a pass per
/// document. A document's dropout draws from a
/// stream of its own ([`DropoutStream::part`](crate::rng::DropoutStream::part)), the same on every tensor-parallel layout.
pub(crate) fn attend(
    qkv: &Tensor,
    sh: AttentionShape,
    mask: &Option<DropoutMask>,
    keep_inputs: bool,
    documents: Option<&Documents>,
) -> Result<(Tensor, AttentionKept)> {
    let Some(docs) = documents.filter(|d| d.separates_attention()) else {
        return backend::of(qkv).attention_forward(qkv, sh, mask, keep_inputs);
    };
    if (docs.seq(), docs.batch()) != (sh.seq, sh.batch) {
        return invalid!(
            "attention: the microbatch's documents are {} positions × {} samples, the attention \
             runs on {} × {}",
            docs.seq(),
            docs.batch(),
            sh.seq,
            sh.batch
        );
    }
    // One pass where the device's kernels take the documents themselves (a dropout draws each
    // document from its own stream: a pass per document).
    if mask.is_none()
        && let Some(done) = backend::of(qkv).attention_forward_packed(qkv, sh, docs)?
    {
        return Ok(done);
    }
    let segments = |j: usize| docs.segments(j).into_iter().map(|r| (r.clone(), r.start));
    let mut parts = Vec::new();
    let out = map_runs(
        qkv,
        |j| segments(j).collect(),
        |part, sample, start| {
            let len = part.dims()[0];
            let one = AttentionShape {
                seq: len,
                batch: 1,
                ..sh
            };
            let dropout = mask
                .as_ref()
                .map(|m| document_dropout(m, sh.seq, sample, start, len));
            let (out, kept) =
                backend::of(part).attention_forward(part, one, &dropout, keep_inputs)?;
            parts.push(DocumentKept {
                sample,
                rows: start..start + len,
                kept,
                dropout,
            });
            Ok(out)
        },
    )?;
    Ok((out, AttentionKept::Documents(parts)))
}

/// The backward of [`attend`]: the gradient of `qkv` from the output's, `d_out`
/// (`[s, b, heads·d]`).
pub(crate) fn attend_backward(
    kept: &AttentionKept,
    mask: &Option<DropoutMask>,
    sh: AttentionShape,
    d_out: &Tensor,
) -> Result<Tensor> {
    let AttentionKept::Documents(parts) = kept else {
        return backend::of(d_out).attention_backward(kept, mask, sh, d_out);
    };
    let d_out = d_out.reshape(sh.dims(1))?;
    let mut next = parts.iter();
    map_runs(
        &d_out,
        |j| {
            parts
                .iter()
                .filter(|p| p.sample == j)
                .map(|p| (p.rows.clone(), p.rows.start))
                .collect()
        },
        |d_part, _, _| {
            let Some(p) = next.next() else {
                return invalid!("attention: more documents in the backward than the forward");
            };
            let one = AttentionShape {
                seq: p.rows.len(),
                batch: 1,
                ..sh
            };
            backend::of(d_part).attention_backward(&p.kept, &p.dropout, one, d_part)
        },
    )
}

/// The dropout of the document at rows `start .. start + len` of sample `sample` of attention
/// whose whole dropout is `mask` (over `[b, all heads, s, s]`, this rank's heads): its own
/// stream, and this rank's heads of the document's `[all heads, len, len]`.
fn document_dropout(
    mask: &DropoutMask,
    seq: usize,
    sample: usize,
    start: usize,
    len: usize,
) -> DropoutMask {
    let (p, stream, whole) = mask;
    let per_head = (seq * seq).max(1) as u64;
    let index = LogicalIndex::heads(
        1,
        len * len,
        whole.inner / per_head as usize,
        (whole.logical_stride / per_head) as usize,
        (whole.logical_start / per_head) as usize,
    );
    (*p, stream.part(&[sample as u64, start as u64]), index)
}

device_ops! {
    /// Causal self-attention of a fused `[s, b, heads·3·d]` projection (`[q | k | v]` per head).
    pub(crate) trait AttentionOps {
        /// The context `[s, b, heads·d]` and what the backward keeps (with `keep_inputs`, the
        /// inputs only: selective recompute), with the dropout `mask` on the weights.
        fn attention_forward(&self, qkv: &Tensor, sh: AttentionShape, mask: &Option<DropoutMask>, keep_inputs: bool) -> Result<(Tensor, AttentionKept)>;
        /// The fused projection's gradient from the context's (its size checked by the caller).
        fn attention_backward(&self, kept: &AttentionKept, mask: &Option<DropoutMask>, sh: AttentionShape, d_out: &Tensor) -> Result<Tensor>;
        /// The context of a packed microbatch without dropout in one pass, each query seeing
        /// only its own document, where the device's kernels take the documents (`None`:
        /// [`attend`] runs a pass per document).
        fn attention_forward_packed(&self, qkv: &Tensor, sh: AttentionShape, documents: &Documents) -> Result<Option<(Tensor, AttentionKept)>>;
    }
}
