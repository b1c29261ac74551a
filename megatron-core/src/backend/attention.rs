//! Attention's math on one rank's heads, below the tensor-parallel layer
//! (`tensor_parallel::attention`, which owns the shapes, the dropout mask and the recompute
//! policy): the sizes, what the backward keeps, and [`AttentionOps`].

use super::DropoutMask;
use crate::error::Result;
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
    /// every row's scaled scores (the weights are recomputed from them), and with dropout the
    /// bits of the elements it kept (64-bit words, as I64).
    #[allow(
        dead_code,
        reason = "made by the GPU backend only, which a build without CUDA lacks"
    )]
    Flash {
        qkv: Tensor,
        out: Tensor,
        lse: Tensor,
        keep: Option<Tensor>,
    },
    /// Nothing: a decoding forward with a KV cache, which has no backward.
    Decoded,
    /// Context parallelism's own (its backward exchanges over the context-parallel group, not
    /// a device's kernels).
    ContextParallel(Box<crate::context_parallel::CpAttentionSaved>),
}

device_ops! {
    /// Causal self-attention of a fused `[s, b, heads·3·d]` projection (`[q | k | v]` per head).
    pub(crate) trait AttentionOps {
        /// The context `[s, b, heads·d]` and what the backward keeps (with `keep_inputs`, the
        /// inputs only: selective recompute), with the dropout `mask` on the weights.
        fn attention_forward(&self, qkv: &Tensor, sh: AttentionShape, mask: &Option<DropoutMask>, keep_inputs: bool) -> Result<(Tensor, AttentionKept)>;
        /// The fused projection's gradient from the context's (its size checked by the caller).
        fn attention_backward(&self, kept: &AttentionKept, mask: &Option<DropoutMask>, sh: AttentionShape, d_out: &Tensor) -> Result<Tensor>;
    }
}
