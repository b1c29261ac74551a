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
//! the queries, keys and values are packed per head as its fused projection `[q | k | v]`
//! (each head zero-padded to the larger of the two head sizes, the scores scaled as asked) and
//! run by the same kernels, the flash kernels included on a GPU that multiplies in bf16. Under
//! context
//! parallelism (a `#[context_parallel]` field) the attention runs on the rank's two chunks of
//! the sequence through the blocks of [`crate::context_parallel`], in any `--cp-comm-type`: the
//! three inputs packed into the grouped projection those blocks read, each head padded with
//! zeros to the larger of the two head sizes (the padding's products are zeros, and its
//! gradients are dropped); `rope` turns each chunk at its global positions.

use std::ops::Range;

use crate::backend;
use crate::backend::attention::{AttentionKept, AttentionShape};
use crate::context_parallel::{self, ContextParallelMulti, CpAttentionSaved, CpLayer};
use crate::error::{Error, Result};
use crate::invalid;
use crate::module::{Cx, MultiOp, Sharding, Site};
use crate::ops::{ShapeOp, ShapeSaved, shape, shape_backward};
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

/// What [`DotProductAttention`]'s backward reads.
#[derive(Debug, Clone)]
pub struct DotProductSaved {
    kept: Kept,
}

/// The whole sequence's tensors, or the context-parallel blocks'.
#[derive(Debug, Clone)]
enum Kept {
    Whole(Box<WholeSaved>),
    Chunks(Box<ChunksSaved>),
}

/// Under context parallelism: the blocks' saved values, the sizes and the padded head size.
#[derive(Debug, Clone)]
struct ChunksSaved {
    blocks: CpAttentionSaved,
    sizes: Sizes,
    d: usize,
}

/// On the whole sequence: what the attention kernels keep (of the packed projection), their
/// shape, the sizes, the padded head size and the keys' and values' expansion to every query
/// head.
#[derive(Debug, Clone)]
struct WholeSaved {
    kept: AttentionKept,
    shape: AttentionShape,
    sizes: Sizes,
    d: usize,
    expanded: Option<(ShapeSaved, ShapeSaved)>,
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

/// `x` (`[s, b, kv·d]`) with each head repeated `group` times: `[s, b, kv·group·d]`.
fn repeat_heads(
    cx: &Cx,
    x: &Tensor,
    (s, b, kv, d): (usize, usize, usize, usize),
    group: usize,
) -> Result<(Tensor, ShapeSaved)> {
    let heads = x.contiguous()?.reshape([s, b, kv, d])?;
    let (y, saved) = shape(
        cx,
        Site::ROOT,
        ShapeOp::BroadcastHeads { heads: group },
        &[&heads],
    )?;
    Ok((y.reshape([s, b, kv * group * d])?, saved))
}

impl DotProductAttention {
    /// Attention over the whole sequence (context-parallel size 1): the queries, keys and
    /// values packed per head as the fused projection `[q | k | v]` (keys and values repeated
    /// for each query head of their group, every head padded with zeros to `d`, the larger
    /// head size), run by the kernels `CausalSelfAttention` runs (the flash kernels on a GPU
    /// that has them), the context cut back to the values' head size.
    fn forward_whole(
        &self,
        cx: &Cx,
        [q, k, v]: [&Tensor; 3],
        sz: Sizes,
    ) -> Result<(Tensor, WholeSaved)> {
        let (s, b, h) = (sz.seq, sz.batch, sz.heads);
        let group = sz.heads / sz.kv_heads;
        let (k, v, expanded) = if group > 1 {
            let (k, ks) = repeat_heads(cx, k, (s, b, sz.kv_heads, sz.d_qk), group)?;
            let (v, vs) = repeat_heads(cx, v, (s, b, sz.kv_heads, sz.d_v), group)?;
            (k, v, Some((ks, vs)))
        } else {
            (k.clone(), v.clone(), None)
        };
        let d = sz.d_qk.max(sz.d_v);
        let parts = [
            pad_heads(cx, q, sz.d_qk, d)?,
            pad_heads(cx, &k, sz.d_qk, d)?,
            pad_heads(cx, &v, sz.d_v, d)?,
        ];
        let op = ShapeOp::CatHeads {
            sizes: vec![d, d, d],
        };
        let (qkv, _) = shape(cx, Site::ROOT, op, &[&parts[0], &parts[1], &parts[2]])?;
        let shape = AttentionShape {
            seq: s,
            batch: b,
            heads: h,
            head_dim: d,
            window: self.window,
            scale: self.scale(),
        };
        let (out, kept) = backend::of(&qkv).attention_forward(&qkv, shape, &None, false)?;
        let out = unpad_heads(cx, &out, sz.d_v, d)?;
        let saved = WholeSaved {
            kept,
            shape,
            sizes: sz,
            d,
            expanded,
        };
        Ok((out, saved))
    }

    /// The backward of [`DotProductAttention::forward_whole`].
    fn backward_whole(&self, cx: &Cx, saved: WholeSaved, dy: &Tensor) -> Result<Vec<Tensor>> {
        let WholeSaved {
            kept,
            shape: sh,
            sizes: sz,
            d,
            expanded,
        } = saved;
        let (s, b, h) = (sz.seq, sz.batch, sz.heads);
        let d_out = pad_heads(cx, dy, sz.d_v, d)?;
        let d_qkv = backend::of(&d_out).attention_backward(&kept, &None, sh, &d_out)?;
        let split = |part| ShapeOp::HeadPart {
            sizes: vec![d, d, d],
            part,
        };
        let mut grads = Vec::with_capacity(3);
        for (part, width) in [(0, sz.d_qk), (1, sz.d_qk), (2, sz.d_v)] {
            let (g, _) = shape(cx, Site::ROOT, split(part), &[&d_qkv])?;
            grads.push(unpad_heads(cx, &g, width, d)?);
        }
        let [dq, mut dk, mut dv] = <[Tensor; 3]>::try_from(grads)
            .map_err(|_| Error::Invalid("attention: three gradients".into()))?;
        if let Some((ks, vs)) = expanded {
            let kv = sz.kv_heads;
            let [gk] = shape_backward::<1>(
                cx,
                Site::ROOT,
                ks,
                &dk.reshape([s, b, kv, (h / kv) * sz.d_qk])?,
            )?;
            let [gv] = shape_backward::<1>(
                cx,
                Site::ROOT,
                vs,
                &dv.reshape([s, b, kv, (h / kv) * sz.d_v])?,
            )?;
            dk = gk.reshape([s, b, kv * sz.d_qk])?;
            dv = gv.reshape([s, b, kv * sz.d_v])?;
        }
        Ok(vec![dq, dk, dv])
    }
}

/// `x`'s heads of `width` padded with zeros to `d` (itself when `width == d`).
fn pad_heads(cx: &Cx, x: &Tensor, width: usize, d: usize) -> Result<Tensor> {
    if width == d {
        return Ok(x.clone());
    }
    let heads = heads_of(x, width)?;
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = heads * (d - width);
    }
    let zeros = Tensor::zeros_near(dims, DType::F32, x)?;
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
        let Some(chunks) = cx.cp_chunks(sz.seq)? else {
            let (out, whole) = self.forward_whole(cx, [q, k, v], sz)?;
            let kept = Kept::Whole(Box::new(whole));
            return Ok((out, DotProductSaved { kept }));
        };
        let Some(groups) = cx.cp_groups() else {
            return invalid!(
                "attention at context-parallel size {} has no context-parallel groups to \
                 exchange keys and values over",
                cx.cp_size()
            );
        };
        let d = sz.d_qk.max(sz.d_v);
        let layer = CpLayer {
            groups: sz.kv_heads,
            per_group: sz.heads / sz.kv_heads,
            scale: self.scale(),
            window: self.window,
            dropout: None,
        };
        let dims = [sz.seq, sz.batch, sz.kv_heads * (layer.per_group + 2) * d];
        let fused = context_parallel::near(pack(q, k, v, sz, d)?, dims, DType::F32, q)?;
        let (out, blocks) = context_parallel::attention_forward(groups, chunks, &fused, layer)?;
        let out = reheads(&out, sz, (d, sz.d_v))?;
        let kept = Kept::Chunks(Box::new(ChunksSaved {
            blocks,
            sizes: sz,
            d,
        }));
        Ok((out, DotProductSaved { kept }))
    }

    fn backward_chunks(
        &self,
        cx: &Cx,
        _site: Site,
        saved: DotProductSaved,
        dy: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let chunked = match saved.kept {
            Kept::Whole(whole) => return self.backward_whole(cx, *whole, dy),
            Kept::Chunks(c) => c,
        };
        let ChunksSaved { blocks, sizes, d } = *chunked;
        let Some(groups) = cx.cp_groups() else {
            return invalid!("attention's backward on chunks runs under context parallelism");
        };
        let d_out = reheads(dy, sizes, (sizes.d_v, d))?;
        let d_fused = context_parallel::attention_backward(groups, &blocks, &d_out)?;
        unpack(&d_fused, sizes, d, dy)
    }
}

/// Where the query head `h`'s, key head `g`'s and value head `g`'s `d` elements of row `r`
/// lie in the grouped projection `[rows, kv_heads, per_group + 2, d]` the context-parallel
/// blocks read (each group's query heads, then its key and its value).
fn slots(sz: Sizes, d: usize) -> impl Fn(usize, usize, usize) -> usize {
    let per_group = sz.heads / sz.kv_heads;
    move |r, g, slot| ((r * sz.kv_heads + g) * (per_group + 2) + slot) * d
}

/// The queries, keys and values packed as the grouped projection, each head zero-padded to `d`.
fn pack(q: &Tensor, k: &Tensor, v: &Tensor, sz: Sizes, d: usize) -> Result<Vec<f32>> {
    let (q, k, v) = (q.to_vec_f32()?, k.to_vec_f32()?, v.to_vec_f32()?);
    let (rows, per_group) = (sz.seq * sz.batch, sz.heads / sz.kv_heads);
    let at = slots(sz, d);
    let mut x = vec![0.0f32; rows * sz.kv_heads * (per_group + 2) * d];
    let (dq, dv) = (sz.d_qk, sz.d_v);
    for r in 0..rows {
        for g in 0..sz.kv_heads {
            for j in 0..per_group {
                let h = g * per_group + j;
                x[at(r, g, j)..][..dq].copy_from_slice(&q[(r * sz.heads + h) * dq..][..dq]);
            }
            let kv = r * sz.kv_heads + g;
            x[at(r, g, per_group)..][..dq].copy_from_slice(&k[kv * dq..][..dq]);
            x[at(r, g, per_group + 1)..][..dv].copy_from_slice(&v[kv * dv..][..dv]);
        }
    }
    Ok(x)
}

/// The gradients of [`pack`]'s inputs from the projection's, the padding's dropped.
fn unpack(d_fused: &Tensor, sz: Sizes, d: usize, like: &Tensor) -> Result<Vec<Tensor>> {
    let x = d_fused.to_vec_f32()?;
    let (rows, per_group) = (sz.seq * sz.batch, sz.heads / sz.kv_heads);
    let at = slots(sz, d);
    let (dq, dv) = (sz.d_qk, sz.d_v);
    let mut q = vec![0.0f32; rows * sz.heads * dq];
    let mut k = vec![0.0f32; rows * sz.kv_heads * dq];
    let mut v = vec![0.0f32; rows * sz.kv_heads * dv];
    for r in 0..rows {
        for g in 0..sz.kv_heads {
            for j in 0..per_group {
                let h = g * per_group + j;
                q[(r * sz.heads + h) * dq..][..dq].copy_from_slice(&x[at(r, g, j)..][..dq]);
            }
            let kv = r * sz.kv_heads + g;
            k[kv * dq..][..dq].copy_from_slice(&x[at(r, g, per_group)..][..dq]);
            v[kv * dv..][..dv].copy_from_slice(&x[at(r, g, per_group + 1)..][..dv]);
        }
    }
    let (s, b) = (sz.seq, sz.batch);
    Ok(vec![
        context_parallel::near(q, [s, b, sz.heads * dq], DType::F32, like)?,
        context_parallel::near(k, [s, b, sz.kv_heads * dq], DType::F32, like)?,
        context_parallel::near(v, [s, b, sz.kv_heads * dv], DType::F32, like)?,
    ])
}

/// Rows of `from`-element heads as rows of `to`-element heads: cut, or padded with zeros.
fn reheads(x: &Tensor, sz: Sizes, (from, to): (usize, usize)) -> Result<Tensor> {
    let (s, b, h) = (sz.seq, sz.batch, sz.heads);
    if from == to {
        return Ok(x.to_f32_contiguous()?);
    }
    let keep = from.min(to);
    let mut out = vec![0.0f32; s * b * h * to];
    for (i, head) in x.to_vec_f32()?.chunks_exact(from).enumerate() {
        out[i * to..][..keep].copy_from_slice(&head[..keep]);
    }
    context_parallel::near(out, [s, b, h * to], DType::F32, x)
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

/// `x` with each run of rows turned at its positions (`inverse`: turned back).
fn turn(x: &Tensor, cfg: &Rope, runs: &[Range<usize>], inverse: bool) -> Result<Tensor> {
    let heads = heads_in(x, cfg)?;
    let x = x.to_f32_contiguous()?;
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
    Ok((turn(x, cfg, &runs, false)?, RopeSaved { runs }))
}

/// The backward of [`rope`]: the gradient turned back.
pub fn rope_backward(
    _cx: &Cx,
    _site: Site,
    cfg: &Rope,
    saved: RopeSaved,
    dy: &Tensor,
) -> Result<Tensor> {
    turn(dy, cfg, &saved.runs, true)
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
