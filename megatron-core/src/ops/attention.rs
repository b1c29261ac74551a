//! Attention as a general piece: [`DotProductAttention`] (Megatron-LM's name for the core of
//! attention) over queries, keys and values given separately, each with its own head size (the
//! queries' and keys' `d_qk`, the values' `d_v`: DeepSeek's latent attention uses different
//! ones), grouped heads (each group of consecutive query heads shares a key and value head),
//! and the library's masks (causal, sliding window); and [`rope`], rotary position embeddings on
//! any tensor of heads (the part of a head that carries positions, or one rotary key shared by
//! every head).
//!
//! Both run on the device that holds the tensors, on whatever heads the inputs hold (with
//! tensor parallelism, this rank's). The attention is one engine with `CausalSelfAttention`'s:
//! the queries, keys and values are packed as its grouped projection (each group's query
//! heads, then its key and its value; every head zero-padded to the larger of the two head
//! sizes, whose products are zeros and whose gradients are dropped) and run by the same code:
//! on the whole sequence the groups expanded and the attention kernels (the flash kernels on a
//! GPU that multiplies in bf16), under context parallelism (a `#[context_parallel]` field) the
//! blocks of [`crate::context_parallel`] on the rank's two chunks, in any `--cp-comm-type`. The
//! scores are scaled as the op says. `rope` turns each chunk at its global positions.

use std::ops::Range;

use crate::backend::attention::{AttentionKept, AttentionShape, attend, attend_backward};
use crate::backend::{self, with_last_dim};
use crate::context_parallel::{self, ContextParallelMulti, CpAttentionSaved, CpLayer};
use crate::documents::map_runs;
use crate::error::{Error, Result};
use crate::invalid;
use crate::kernels::heads::GroupedHeads;
use crate::module::{Cx, MultiOp, Recompute, Sharding, Site};
use crate::ops::{ShapeOp, shape};
use crate::tensor::{DType, Tensor};
use crate::tensor_parallel::Rotary;

/// Causal dot-product attention of separate queries `[s, b, heads·d_qk]`, keys
/// `[s, b, kv_heads·d_qk]` and values `[s, b, kv_heads·d_v]`: the context
/// `[s, b, heads·d_v]`. The heads are counted from the widths and `qk_head_dim`; the weights
/// have no dropout (models that train attention with dropout use `CausalSelfAttention`).
/// A field called with three tensors, `self.core(q, k, v)`: `#[context_parallel]` (any
/// context-parallel size) or `#[op]` (context-parallel size 1).
#[derive(Debug, Clone, PartialEq)]
pub struct DotProductAttention {
    /// Elements per head of the queries and keys.
    pub qk_head_dim: usize,
    /// Sliding window: each query sees itself and at most this many keys before it.
    pub window: Option<usize>,
    /// The scores' scale (default `1/√qk_head_dim`).
    pub scale: Option<f32>,
}

impl DotProductAttention {
    /// Causal attention with queries and keys of `qk_head_dim` per head, scaled by
    /// `1/√qk_head_dim`.
    pub fn new(qk_head_dim: usize) -> Self {
        DotProductAttention {
            qk_head_dim,
            window: None,
            scale: None,
        }
    }

    /// With a sliding window of `window` keys before each query.
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// With the scores scaled by `scale` (DeepSeek scales by the whole query head's size).
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    seq: usize,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    d_qk: usize,
    d_v: usize,
}

impl Sizes {
    /// The packed heads' size: the larger of the two.
    fn padded(&self) -> usize {
        self.d_qk.max(self.d_v)
    }

    /// The packed projection's layout: the key/value groups, their query heads, heads of `d`.
    fn grouped(&self, d: usize) -> GroupedHeads {
        GroupedHeads {
            rows: self.seq * self.batch,
            groups: self.kv_heads,
            per_group: self.heads / self.kv_heads,
            head_dim: d,
        }
    }
}

/// What [`DotProductAttention`]'s backward reads: what the kernels kept of the packed
/// projection, and the sizes.
#[derive(Debug, Clone)]
pub struct DotProductSaved {
    kept: Kept,
    sizes: Sizes,
}

/// The whole sequence's kernels' (with their shape), or the context-parallel blocks'.
#[derive(Debug, Clone)]
enum Kept {
    Whole(Box<(AttentionKept, AttentionShape)>),
    Chunks(Box<CpAttentionSaved>),
}

impl DotProductAttention {
    fn sizes(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Sizes> {
        let (Ok([s, b, wq]), Ok([sk, bk, wk]), Ok([sv, bv, wv])) = (
            <[usize; 3]>::try_from(q.dims()),
            <[usize; 3]>::try_from(k.dims()),
            <[usize; 3]>::try_from(v.dims()),
        ) else {
            return invalid!(
                "attention: queries, keys and values are [sequence, batch, features]; got {}, {} \
                 and {}",
                q.shape(),
                k.shape(),
                v.shape()
            );
        };
        if (s, b) != (sk, bk) || (s, b) != (sv, bv) {
            return invalid!(
                "attention: queries {}, keys {} and values {} differ in sequence or batch",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        let d_qk = self.qk_head_dim;
        if d_qk == 0 || !wq.is_multiple_of(d_qk) || !wk.is_multiple_of(d_qk) || wk == 0 {
            return invalid!(
                "attention: queries of {wq} and keys of {wk} features are not whole heads of \
                 {d_qk} (qk_head_dim)"
            );
        }
        let (heads, kv_heads) = (wq / d_qk, wk / d_qk);
        if !heads.is_multiple_of(kv_heads) || !wv.is_multiple_of(kv_heads) {
            return invalid!(
                "attention: {heads} query heads cannot share {kv_heads} key heads, or {wv} value \
                 features are not {kv_heads} heads"
            );
        }
        Ok(Sizes {
            seq: s,
            batch: b,
            heads,
            kv_heads,
            d_qk,
            d_v: wv / kv_heads,
        })
    }

    fn scale(&self) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.qk_head_dim as f32).sqrt())
    }
}

/// `q`, `k` and `v` as `CausalSelfAttention`'s grouped projection, `[s, b, kv_heads ·
/// (per_group + 2) · d]` (each group's query heads, then its key and its value), every head
/// padded with zeros to `d`.
fn pack(cx: &Cx, [q, k, v]: [&Tensor; 3], sz: Sizes, d: usize) -> Result<Tensor> {
    let per_group = sz.heads / sz.kv_heads;
    let parts = [
        pad_heads(cx, q, sz.d_qk, d)?,
        pad_heads(cx, k, sz.d_qk, d)?,
        pad_heads(cx, v, sz.d_v, d)?,
    ];
    let op = ShapeOp::CatHeads {
        sizes: vec![per_group * d, d, d],
    };
    Ok(shape(cx, Site::ROOT, op, &[&parts[0], &parts[1], &parts[2]])?.0)
}

/// The gradients of [`pack`]'s inputs from the projection's, the padding's dropped.
fn unpack(cx: &Cx, d_fused: &Tensor, sz: Sizes, d: usize) -> Result<Vec<Tensor>> {
    let per_group = sz.heads / sz.kv_heads;
    // Converted once for the three cuts.
    let d_fused = d_fused.to_f32_contiguous()?;
    let mut grads = Vec::with_capacity(3);
    for (part, width) in [(0, sz.d_qk), (1, sz.d_qk), (2, sz.d_v)] {
        let op = ShapeOp::HeadPart {
            sizes: vec![per_group * d, d, d],
            part,
        };
        let (g, _) = shape(cx, Site::ROOT, op, &[&d_fused])?;
        grads.push(unpad_heads(cx, &g, width, d)?);
    }
    Ok(grads)
}

/// `x`'s heads of `width` padded with zeros to `d` (itself when `width == d`).
fn pad_heads(cx: &Cx, x: &Tensor, width: usize, d: usize) -> Result<Tensor> {
    if width == d {
        return Ok(x.clone());
    }
    let heads = heads_of(x, width)?;
    let zeros = Tensor::zeros_near(with_last_dim(x, heads * (d - width)), DType::F32, x)?;
    let op = ShapeOp::CatHeads {
        sizes: vec![width, d - width],
    };
    Ok(shape(cx, Site::ROOT, op, &[x, &zeros])?.0)
}

/// `x`'s heads of `d` cut to their first `width` (itself when `width == d`).
fn unpad_heads(cx: &Cx, x: &Tensor, width: usize, d: usize) -> Result<Tensor> {
    if width == d {
        return Ok(x.clone());
    }
    let op = ShapeOp::HeadPart {
        sizes: vec![width, d - width],
        part: 0,
    };
    Ok(shape(cx, Site::ROOT, op, &[x])?.0)
}

/// The heads of `width` in `x`'s last dimension.
fn heads_of(x: &Tensor, width: usize) -> Result<usize> {
    let w = x.last_dim();
    if width == 0 || !w.is_multiple_of(width) {
        return invalid!("attention: {w} features are not heads of {width}");
    }
    Ok(w / width)
}

/// `[q, k, v]` of a call, or an error naming the count.
fn three<'t>(xs: &[&'t Tensor]) -> Result<[&'t Tensor; 3]> {
    match xs {
        [q, k, v] => Ok([*q, *k, *v]),
        _ => invalid!(
            "attention takes queries, keys and values: `self.core(q, k, v)`, not {} tensors",
            xs.len()
        ),
    }
}

impl MultiOp for DotProductAttention {
    type Saved = DotProductSaved;

    /// The forward over the whole sequence; with context parallelism an error: the attention
    /// runs on a rank's chunks only as a `#[context_parallel]` field.
    fn forward(&self, cx: &Cx, site: Site, xs: &[&Tensor]) -> Result<(Tensor, DotProductSaved)> {
        if cx.cp_size() > 1 {
            return invalid!(
                "attention at context-parallel size {} runs on the rank's chunks of the \
                 sequence: declare its field #[context_parallel] (an #[op] sees the whole \
                 sequence)",
                cx.cp_size()
            );
        }
        self.forward_chunks(cx, site, xs)
    }

    fn backward(
        &self,
        cx: &Cx,
        site: Site,
        saved: DotProductSaved,
        dy: &Tensor,
    ) -> Result<Vec<Tensor>> {
        self.backward_chunks(cx, site, saved, dy)
    }
}

impl ContextParallelMulti for DotProductAttention {
    /// The three packed as the grouped projection; on the whole sequence each query head given
    /// its group's key and value and run by the attention kernels (the flash kernels on a GPU
    /// that has them), under context parallelism by the blocks; the context cut back to the
    /// values' head size.
    fn forward_chunks(
        &self,
        cx: &Cx,
        _site: Site,
        xs: &[&Tensor],
    ) -> Result<(Tensor, DotProductSaved)> {
        let [q, k, v] = three(xs)?;
        if cx.kv_cache().is_some() {
            return invalid!(
                "DotProductAttention keeps no KV cache yet: generate without one (or with \
                 CausalSelfAttention's fused projection)"
            );
        }
        let sz = self.sizes(q, k, v)?;
        let d = sz.padded();
        let grouped = sz.grouped(d);
        let fused = pack(cx, [q, k, v], sz, d)?;
        let (out, kept) = match cx.cp_chunks(sz.seq)? {
            None => {
                let expanded = match grouped.per_group {
                    1 => fused,
                    _ => backend::of(&fused).expand_groups(&fused, grouped)?,
                };
                let shape = AttentionShape {
                    seq: sz.seq,
                    batch: sz.batch,
                    heads: sz.heads,
                    head_dim: d,
                    window: self.window,
                    scale: self.scale(),
                };
                // `--recompute-granularity selective`: the weights recomputed in the backward.
                let keep_inputs = cx.recompute() == Recompute::Selective && cx.training();
                let (out, kept) = attend(&expanded, shape, &None, keep_inputs, cx.documents())?;
                (out, Kept::Whole(Box::new((kept, shape))))
            }
            Some(chunks) => {
                let layer = CpLayer {
                    documents: CpLayer::documents_of(cx),
                    groups: grouped.groups,
                    per_group: grouped.per_group,
                    scale: self.scale(),
                    window: self.window,
                    dropout: None,
                };
                let groups = cp_groups(cx)?;
                let (out, blocks) =
                    context_parallel::attention_forward(groups, chunks, &fused, layer)?;
                (out, Kept::Chunks(Box::new(blocks)))
            }
        };
        let out = unpad_heads(cx, &out, sz.d_v, d)?;
        Ok((out, DotProductSaved { kept, sizes: sz }))
    }

    fn backward_chunks(
        &self,
        cx: &Cx,
        _site: Site,
        saved: DotProductSaved,
        dy: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let DotProductSaved { kept, sizes } = saved;
        let d = sizes.padded();
        let grouped = sizes.grouped(d);
        let d_out = pad_heads(cx, dy, sizes.d_v, d)?;
        let d_fused = match kept {
            Kept::Whole(whole) => {
                let (kept, shape) = *whole;
                let d_qkv = attend_backward(&kept, &None, shape, &d_out)?;
                match grouped.per_group {
                    1 => d_qkv,
                    _ => backend::of(&d_qkv).reduce_groups(&d_qkv, grouped)?,
                }
            }
            Kept::Chunks(blocks) => {
                context_parallel::attention_backward(cp_groups(cx)?, &blocks, &d_out)?
            }
        };
        unpack(cx, &d_fused, sizes, d)
    }
}

/// The context-parallel groups attention exchanges keys and values over, or an error.
fn cp_groups<'a>(cx: &Cx<'a>) -> Result<&'a context_parallel::CpGroups> {
    cx.cp_groups().ok_or_else(|| {
        Error::Invalid(format!(
            "attention at context-parallel size {} has no context-parallel groups to exchange \
             keys and values over",
            cx.cp_size()
        ))
    })
}

/// Rotary position embeddings on every head of a tensor: the settings (base, interleaving,
/// Llama 3.1's scaling; `percent` is the part of each head turned) and the head size. The
/// `rope(x, cfg)` builtin of forward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The frequencies and pairing.
    pub rotary: Rotary,
    /// Elements per head of the tensors it turns.
    pub head_dim: usize,
}

impl Rope {
    /// Rotate-half RoPE of base 10000 on heads of `head_dim`.
    pub fn new(head_dim: usize) -> Self {
        Rope {
            rotary: Rotary::default(),
            head_dim,
        }
    }

    /// With other rotary settings.
    pub fn with_rotary(mut self, rotary: Rotary) -> Self {
        self.rotary = rotary;
        self
    }
}

/// What [`rope`]'s backward needs: where the rows lie in the sequence.
#[derive(Debug, Clone)]
pub struct RopeSaved {
    runs: Vec<Range<usize>>,
}

/// Where `x`'s rows (`[rows, b, ..]`, in order) lie in the sequence, one run of positions
/// each: with sequence parallelism a replicated value is this rank's shard, a split one the
/// whole (local) sequence; with context parallelism that sequence is the rank's two chunks.
fn position_runs(cx: &Cx, x: &Tensor, sharding: Sharding) -> Result<Vec<Range<usize>>> {
    let rows = x.dims().first().copied().unwrap_or(0);
    if sharding == Sharding::Replicated && cx.sequence_parallel() {
        return cx.position_runs(rows * cx.tp_size());
    }
    Ok(match cx.cp_chunks(rows)? {
        Some(chunks) => chunks.runs(0..rows),
        None => std::iter::once(0..rows).collect(),
    })
}

/// `x` with each run of rows turned at its positions (`inverse`: turned back); a packed
/// microbatch's documents restarting them, from each document's start.
fn turn(cx: &Cx, x: &Tensor, cfg: &Rope, runs: &[Range<usize>], inverse: bool) -> Result<Tensor> {
    let heads = heads_in(x, cfg)?;
    let x = x.to_f32_contiguous()?;
    if let Some(docs) = cx.documents().filter(|d| d.resets_positions()) {
        return map_runs(
            &x,
            |j| docs.local_runs(j, runs),
            |part, _, first| {
                cfg.rotary
                    .apply(part, (heads, 1, 1), cfg.head_dim, first, inverse)
            },
        );
    }
    if let [run] = runs {
        let y = cfg
            .rotary
            .apply(&x, (heads, 1, 1), cfg.head_dim, run.start, inverse)?;
        return Ok(y.to_f32_contiguous()?);
    }
    let out = Tensor::empty_near(x.dims().to_vec(), DType::F32, &x)?;
    let mut at = 0;
    for run in runs {
        let part = x.narrow(0, at, run.len())?.contiguous()?;
        let y = cfg
            .rotary
            .apply(&part, (heads, 1, 1), cfg.head_dim, run.start, inverse)?;
        out.narrow(0, at, run.len())?.copy_from(&y)?;
        at += run.len();
    }
    Ok(out)
}

/// `x` (`[s, b, heads·head_dim]`) with rotary embeddings applied to each head at its rows'
/// positions in the sequence.
pub fn rope(
    cx: &Cx,
    _site: Site,
    x: &Tensor,
    cfg: &Rope,
    sharding: Sharding,
) -> Result<(Tensor, RopeSaved)> {
    let runs = position_runs(cx, x, sharding)?;
    Ok((turn(cx, x, cfg, &runs, false)?, RopeSaved { runs }))
}

/// The backward of [`rope`]: the gradient turned back.
pub fn rope_backward(
    cx: &Cx,
    _site: Site,
    cfg: &Rope,
    saved: RopeSaved,
    dy: &Tensor,
) -> Result<Tensor> {
    turn(cx, dy, cfg, &saved.runs, true)
}

fn heads_in(x: &Tensor, cfg: &Rope) -> Result<usize> {
    let w = x.last_dim();
    if cfg.head_dim == 0 || !w.is_multiple_of(cfg.head_dim) {
        return Err(Error::Invalid(format!(
            "rope: {w} features are not whole heads of {} ({})",
            cfg.head_dim,
            x.shape()
        )));
    }
    Ok(w / cfg.head_dim)
}
