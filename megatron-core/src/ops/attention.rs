//! Attention as a general piece: [`DotProductAttention`] (Megatron-LM's name for the core of
//! attention) over queries, keys and values given separately, each with its own head size (the
//! queries' and keys' `d_qk`, the values' `d_v`: DeepSeek's latent attention uses different
//! ones), grouped heads (each group of consecutive query heads shares a key and value head),
//! and the library's masks (causal, sliding window); and [`rope`], rotary position embeddings on
//! any tensor of heads (the part of a head that carries positions, or one rotary key shared by
//! every head).
//!
//! Both run on the device that holds the tensors: the products are the tensors' batched
//! products over strided views of the heads, the masked softmax is the device's kernel. They
//! work on whatever heads the inputs hold: with tensor parallelism, this rank's.

use crate::backend;
use crate::error::{Error, Result};
use crate::invalid;
use crate::kernels::softmax::KeyMask;
use crate::module::{Cx, MultiOp, Sharding, Site};
use crate::ops::{ShapeOp, ShapeSaved, matmul, shape, shape_backward};
use crate::tensor::Tensor;
use crate::tensor_parallel::Rotary;

/// Causal dot-product attention of separate queries `[s, b, heads·d_qk]`, keys
/// `[s, b, kv_heads·d_qk]` and values `[s, b, kv_heads·d_v]`: the context
/// `[s, b, heads·d_v]`. The heads are counted from the widths and `qk_head_dim`; the weights
/// have no dropout (models that train attention with dropout use `CausalSelfAttention`).
/// An `#[op]` called with three tensors: `self.core(q, k, v)`.
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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    sizes: Sizes,
    /// The keys' and values' expansion to every query head, with grouped heads.
    expanded: Option<(ShapeSaved, ShapeSaved)>,
}

/// `x` (`[s, b, heads·d]`) viewed as `[b, heads, s, d]` (no copy).
fn heads_view(x: &Tensor, (s, b, heads, d): (usize, usize, usize, usize)) -> Result<Tensor> {
    Ok(x.contiguous()?
        .reshape([s, b, heads, d])?
        .transpose(0, 1)?
        .transpose(1, 2)?)
}

/// `[b, heads, s, d]` back to `[s, b, heads·d]`.
fn from_heads(x: &Tensor, (s, b, heads, d): (usize, usize, usize, usize)) -> Result<Tensor> {
    Ok(x.transpose(1, 2)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape([s, b, heads * d])?)
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

    fn keys(&self) -> KeyMask {
        KeyMask::causal_window(true, self.window)
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

impl MultiOp for DotProductAttention {
    type Saved = DotProductSaved;

    fn forward(&self, cx: &Cx, _site: Site, xs: &[&Tensor]) -> Result<(Tensor, DotProductSaved)> {
        let [q, k, v] = xs else {
            return invalid!(
                "attention takes queries, keys and values: `self.core(q, k, v)`, not {} tensors",
                xs.len()
            );
        };
        if cx.cp_size() > 1 {
            return invalid!(
                "DotProductAttention does not run under context parallelism yet (its blocks \
                 are CausalSelfAttention's, over a fused projection): run with \
                 --context-parallel-size 1"
            );
        }
        let sz = self.sizes(q, k, v)?;
        let (s, b, h) = (sz.seq, sz.batch, sz.heads);
        let group = sz.heads / sz.kv_heads;
        let (k, v, expanded) = if group > 1 {
            let (k, ks) = repeat_heads(cx, k, (s, b, sz.kv_heads, sz.d_qk), group)?;
            let (v, vs) = repeat_heads(cx, v, (s, b, sz.kv_heads, sz.d_v), group)?;
            (k, v, Some((ks, vs)))
        } else {
            ((*k).clone(), (*v).clone(), None)
        };
        let qh = heads_view(q, (s, b, h, sz.d_qk))?;
        let kh = heads_view(&k, (s, b, h, sz.d_qk))?;
        let vh = heads_view(&v, (s, b, h, sz.d_v))?;
        let scores = matmul(&qh, &kh.t()?)?;
        let (probs, _) = backend::of(&scores).masked_softmax(
            &scores,
            (b * h, s, s),
            self.scale(),
            self.keys(),
            &None,
        )?;
        let ctx = matmul(&probs, &vh)?;
        let out = from_heads(&ctx, (s, b, h, sz.d_v))?;
        let saved = DotProductSaved {
            q: (*q).clone(),
            k,
            v,
            probs,
            sizes: sz,
            expanded,
        };
        Ok((out, saved))
    }

    fn backward(
        &self,
        cx: &Cx,
        _site: Site,
        saved: DotProductSaved,
        dy: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let DotProductSaved {
            q,
            k,
            v,
            probs,
            sizes: sz,
            expanded,
        } = saved;
        let (s, b, h) = (sz.seq, sz.batch, sz.heads);
        let qh = heads_view(&q, (s, b, h, sz.d_qk))?;
        let kh = heads_view(&k, (s, b, h, sz.d_qk))?;
        let vh = heads_view(&v, (s, b, h, sz.d_v))?;
        let d_ctx = heads_view(&dy.to_f32_contiguous()?, (s, b, h, sz.d_v))?;
        let d_probs = matmul(&d_ctx, &vh.t()?)?;
        let dv = matmul(&probs.t()?, &d_ctx)?;
        let d_scores = backend::of(&probs).masked_softmax_backward(
            &probs,
            &d_probs,
            (b * h, s, s),
            self.scale(),
            self.keys(),
            &None,
        )?;
        let dq = matmul(&d_scores, &kh)?;
        let dk = matmul(&d_scores.t()?, &qh)?;
        let dq = from_heads(&dq, (s, b, h, sz.d_qk))?;
        let mut dk = from_heads(&dk, (s, b, h, sz.d_qk))?;
        let mut dv = from_heads(&dv, (s, b, h, sz.d_v))?;
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

/// What [`rope`]'s backward needs: where the rows start in the sequence.
#[derive(Debug, Clone)]
pub struct RopeSaved {
    offset: usize,
}

/// The position of `x`'s first row in the sequence: with sequence parallelism a replicated
/// value is this rank's shard of the sequence, a split one the whole sequence.
fn first_position(cx: &Cx, x: &Tensor, sharding: Sharding) -> Result<usize> {
    if cx.cp_size() > 1 {
        return invalid!(
            "rope does not run under context parallelism yet (a rank's two chunks of the \
             sequence are not one run of positions): run with --context-parallel-size 1"
        );
    }
    let rows = x.dims().first().copied().unwrap_or(0);
    Ok(match sharding {
        Sharding::Replicated if cx.sequence_parallel() => rows * cx.tp_rank(),
        _ => 0,
    })
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
    let offset = first_position(cx, x, sharding)?;
    let heads = heads_in(x, cfg)?;
    let y = cfg
        .rotary
        .apply(x, (heads, 1, 1), cfg.head_dim, offset, false)?;
    Ok((y.to_f32_contiguous()?, RopeSaved { offset }))
}

/// The backward of [`rope`]: the gradient turned back.
pub fn rope_backward(
    _cx: &Cx,
    _site: Site,
    cfg: &Rope,
    saved: RopeSaved,
    dy: &Tensor,
) -> Result<Tensor> {
    let heads = heads_in(dy, cfg)?;
    let d = cfg.rotary.apply(
        &dy.to_f32_contiguous()?,
        (heads, 1, 1),
        cfg.head_dim,
        saved.offset,
        true,
    )?;
    Ok(d.to_f32_contiguous()?)
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
