//! Causal self-attention over heads, as an [`Op`]: on a tensor-parallel rank it sees only its
//! whole heads (the fused QKV projection is column-parallel), so it needs no communication.

use crate::backend::attention::{AttentionKept, AttentionShape, attend, attend_backward};
use crate::backend::{self, DropoutMask};
use crate::context_parallel::{self, ContextParallel, CpChunks, CpDropout, CpLayer};
use crate::documents::map_runs;
use crate::error::Result;
use crate::inference::decode_attention;
use crate::invalid;
use crate::kernels::dropout::{self as dk, LogicalIndex};
use crate::kernels::heads::GroupedHeads;
use crate::module::{Cx, Op, Recompute, Site};
use crate::tensor::Tensor;
use crate::tensor_parallel::Rotary;

/// Multi-head causal self-attention with scaled dot products and attention dropout.
///
/// Input: the fused projection `[s, b, 3·h_local]` laid out per head as `[q | k | v]` of
/// `head_dim` each (Megatron-LM's layout, so a column-parallel split gives each rank whole
/// heads). Output: `[s, b, h_local]`, heads in order.
///
/// With grouped-query attention (`query_groups` below `heads`) the projection is laid out per
/// group, `[q … q | k | v]` with `heads / query_groups` queries (Megatron-LM's), the split
/// gives each rank whole groups (with more ranks than groups, its share of one group's queries
/// and the group's key and value), and each query attends with its group's key and value.
///
/// With rotary position embeddings the queries and keys are turned by their positions
/// before the scores (and the gradient turned back after the backward).
///
/// With a sliding window (`--window-size`) each query sees itself and at most `window` keys
/// before it.
#[derive(Debug, Clone, PartialEq)]
pub struct CausalSelfAttention {
    /// Attention heads of the whole layer (all tensor-parallel ranks together).
    pub heads: usize,
    /// Dropout probability on the attention weights.
    pub dropout: f32,
    /// Rotary position embeddings (`--position-embedding-type rope`), if any.
    pub rotary: Option<Rotary>,
    /// Key/value heads (`--num-query-groups`): `heads` for multi-head attention.
    pub query_groups: usize,
    /// The keys before each query it sees (`--window-size`'s left part); `None`: all of them.
    pub window: Option<usize>,
}

impl CausalSelfAttention {
    /// `heads` heads with attention dropout `dropout`.
    pub fn new(heads: usize, dropout: f32) -> Self {
        CausalSelfAttention {
            heads,
            dropout,
            rotary: None,
            query_groups: heads,
            window: None,
        }
    }

    /// The same with a sliding window of `window` keys before each query (none: `None`).
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// The same with `groups` key/value heads (grouped-query attention).
    pub fn with_query_groups(mut self, groups: usize) -> Self {
        self.query_groups = groups;
        self
    }

    /// The same with rotary position embeddings `rotary` (none: `None`).
    pub fn with_rotary(mut self, rotary: Option<Rotary>) -> Self {
        self.rotary = rotary;
        self
    }

    /// `qkv` (grouped) with its queries and keys turned by their positions, from `offset` on
    /// (`inverse`: the gradient turned back).
    fn turned(
        &self,
        qkv: &Tensor,
        g: GroupedHeads,
        offset: usize,
        inverse: bool,
    ) -> Result<Option<Tensor>> {
        let blocks = (g.groups, g.per_group + 2, g.per_group + 1);
        self.rotary
            .as_ref()
            .map(|r| r.apply(qkv, blocks, g.head_dim, offset, inverse))
            .transpose()
    }

    /// The fused projection `qkv` of a local sequence of `seq` rows turned at its positions
    /// (`inverse`: turned back): from the cached length on when decoding, at a
    /// context-parallel rank's chunks' positions, and from each document's start when the
    /// microbatch's packed documents restart them; `None` without rotary embeddings.
    fn turned_in(
        &self,
        cx: &Cx,
        qkv: &Tensor,
        g: GroupedHeads,
        seq: usize,
        inverse: bool,
    ) -> Result<Option<Tensor>> {
        let chunks = cx.cp_chunks(seq)?;
        let Some(docs) = cx.documents().filter(|d| d.resets_positions()) else {
            return match chunks {
                Some(chunks) => self.turned_chunks(qkv, g, chunks, inverse),
                None => self.turned(qkv, g, cx.position_offset(), inverse),
            };
        };
        if self.rotary.is_none() {
            return Ok(None);
        }
        let runs = match chunks {
            Some(chunks) => chunks.ranges(),
            None => std::iter::once(0..seq).collect(),
        };
        let turned = map_runs(
            qkv,
            |j| docs.local_runs(j, &runs),
            |part, _, first| {
                let rows = GroupedHeads {
                    rows: part.dims()[0],
                    ..g
                };
                match self.turned(part, rows, first, inverse)? {
                    Some(t) => Ok(t),
                    None => Ok(part.clone()),
                }
            },
        )?;
        Ok(Some(turned))
    }

    /// [`Self::turned`] of a context-parallel rank's rows: each of its chunks from its own
    /// position in the sequence.
    fn turned_chunks(
        &self,
        qkv: &Tensor,
        g: GroupedHeads,
        chunks: CpChunks,
        inverse: bool,
    ) -> Result<Option<Tensor>> {
        if self.rotary.is_none() {
            return Ok(None);
        }
        let out = Tensor::empty_near(qkv.dims().to_vec(), qkv.dtype(), qkv)?;
        let mut at = 0;
        for r in chunks.ranges() {
            let part = qkv.narrow(0, at, r.len())?.contiguous()?;
            let rows = GroupedHeads {
                rows: g.rows * r.len() / chunks.local(),
                ..g
            };
            if let Some(t) = self.turned(&part, rows, r.start, inverse)? {
                out.narrow(0, at, r.len())?.copy_from(&t)?;
            }
            at += r.len();
        }
        Ok(Some(out))
    }
}

/// What attention keeps for its backward, and its dropout mask.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    kept: AttentionKept,
    dropout: Option<DropoutMask>,
    shape: AttentionShape,
    grouped: GroupedHeads,
}

impl CausalSelfAttention {
    /// The multi-head shape attention runs at, and the grouped layout of the projection.
    fn shape(&self, cx: &Cx, qkv: &Tensor) -> Result<(AttentionShape, GroupedHeads)> {
        let tp = cx.tp_size();
        let (heads, groups) = (self.heads, self.query_groups);
        if heads == 0 || !heads.is_multiple_of(tp) {
            return invalid!("{heads} attention heads cannot be split over tp = {tp}");
        }
        if groups == 0 || !heads.is_multiple_of(groups) {
            return invalid!(
                "--num-attention-heads {heads} is not divisible by --num-query-groups {groups}"
            );
        }
        if !groups.is_multiple_of(tp) && !tp.is_multiple_of(groups) {
            return invalid!(
                "--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must \
                 divide the other"
            );
        }
        // More ranks than groups: each rank holds its share of one group's queries, and the
        // group's key and value.
        let (local_groups, per_group) = match groups >= tp {
            true => (groups / tp, heads / groups),
            false => (1, heads / tp),
        };
        let [seq, batch, width] = qkv.dims() else {
            return invalid!(
                "attention: fused QKV must be [sequence, batch, 3·hidden/tp], got {}",
                qkv.shape()
            );
        };
        let parts = local_groups * (per_group + 2);
        if width % parts != 0 {
            return invalid!(
                "attention: QKV width {width} is not {local_groups} local groups × ({per_group} \
                 queries + a key + a value) × a head size"
            );
        }
        let head_dim = width / parts;
        let grouped = GroupedHeads {
            rows: seq * batch,
            groups: local_groups,
            per_group,
            head_dim,
        };
        let sh = AttentionShape {
            seq: *seq,
            batch: *batch,
            heads: heads / tp,
            head_dim,
            window: self.window,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        Ok((sh, grouped))
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

    /// The forward over the whole sequence; with context parallelism an error: a model's
    /// attention runs on a rank's chunks only as a `#[context_parallel]` field.
    fn forward(&self, cx: &Cx, site: Site, qkv: &Tensor) -> Result<(Tensor, AttentionSaved)> {
        if cx.cp_size() > 1 {
            return invalid!(
                "attention at context-parallel size {} runs on the rank's chunks of the \
                 sequence: declare its field #[context_parallel] (an #[op] sees the whole \
                 sequence)",
                cx.cp_size()
            );
        }
        self.forward_chunks(cx, site, qkv)
    }

    fn backward(
        &self,
        cx: &Cx,
        site: Site,
        saved: AttentionSaved,
        d_out: &Tensor,
    ) -> Result<Tensor> {
        self.backward_chunks(cx, site, saved, d_out)
    }
}

impl ContextParallel for CausalSelfAttention {
    fn forward_chunks(
        &self,
        cx: &Cx,
        site: Site,
        qkv: &Tensor,
    ) -> Result<(Tensor, AttentionSaved)> {
        dk::keep_threshold(self.dropout)?;
        let (sh, grouped) = self.shape(cx, qkv)?;
        let mask = self.mask(cx, site, sh);
        let keep_inputs = cx.recompute() == Recompute::Selective && cx.training();
        let cp = cx.cp_chunks(sh.seq)?;
        let turned = self.turned_in(cx, qkv, grouped, sh.seq, false)?;
        let qkv = turned.as_ref().unwrap_or(qkv);
        if let Some(cache) = cx.kv_cache() {
            // Decoding: the new positions against every cached one, no backward.
            let out = decode_attention(cache, site, qkv, grouped, self.window)?;
            let saved = AttentionSaved {
                kept: AttentionKept::Decoded,
                dropout: None,
                shape: sh,
                grouped,
            };
            return Ok((out, saved));
        }
        if let (Some(chunks), Some(groups)) = (cp, cx.cp_groups()) {
            // The grouped projection as it is: the forms move keys and values per group.
            let layer = CpLayer {
                documents: CpLayer::documents_of(cx),
                groups: grouped.groups,
                per_group: grouped.per_group,
                scale: sh.scale(),
                window: self.window,
                dropout: mask.as_ref().map(|(p, stream, _)| CpDropout {
                    p: *p,
                    stream: *stream,
                    all_heads: self.heads,
                    first_head: cx.tp_rank() * sh.heads,
                }),
            };
            let (out, saved) = context_parallel::attention_forward(groups, chunks, qkv, layer)?;
            let saved = AttentionSaved {
                kept: AttentionKept::ContextParallel(Box::new(saved)),
                dropout: None,
                shape: sh,
                grouped,
            };
            return Ok((out, saved));
        }
        // Grouped: each query head beside its group's key and value.
        let expanded = match grouped.per_group {
            1 => None,
            _ => Some(backend::of(qkv).expand_groups(qkv, grouped)?),
        };
        let qkv = expanded.as_ref().unwrap_or(qkv);
        let (out, kept) = attend(qkv, sh, &mask, keep_inputs, cx.documents())?;
        Ok((
            out,
            AttentionSaved {
                kept,
                dropout: mask,
                shape: sh,
                grouped,
            },
        ))
    }

    fn backward_chunks(
        &self,
        cx: &Cx,
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
        let d_qkv = match (&saved.kept, cx.cp_groups()) {
            // Already grouped.
            (AttentionKept::ContextParallel(kept), Some(groups)) => {
                context_parallel::attention_backward(groups, kept, d_out)?
            }
            (AttentionKept::ContextParallel(_), None) => {
                return invalid!("attention: a context-parallel forward without its groups");
            }
            (kept, _) => {
                let d_qkv = attend_backward(kept, &saved.dropout, sh, d_out)?;
                match saved.grouped.per_group {
                    1 => d_qkv,
                    _ => backend::of(&d_qkv).reduce_groups(&d_qkv, saved.grouped)?,
                }
            }
        };
        let turned = self.turned_in(cx, &d_qkv, saved.grouped, sh.seq, true)?;
        Ok(turned.unwrap_or(d_qkv))
    }
}
