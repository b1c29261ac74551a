//! Causal self-attention over heads, as an [`Op`]: on a tensor-parallel rank it sees only its
//! whole heads (the fused QKV projection is column-parallel), so it needs no communication.

use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::{self as dk, LogicalIndex};
use crate::kernels::softmax;
use crate::module::{Cx, Op, Recompute, Site};
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

/// What attention keeps for its backward, and its dropout mask.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    kept: Kept,
    dropout: Option<(f32, DropoutStream, LogicalIndex)>,
    shape: Shape,
}

/// The tensors the backward reads.
#[derive(Debug, Clone)]
enum Kept {
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
    #[cfg(feature = "cuda")]
    Flash {
        qkv: Tensor,
        out: Tensor,
        lse: Tensor,
        keep: Option<Tensor>,
    },
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

    /// The sequence-first layout `[s, b, heads·parts·d]` with `parts` blocks of `d` per head
    /// (1: the context, 3: the fused q/k/v projection).
    fn dims(&self, parts: usize) -> [usize; 3] {
        [self.seq, self.batch, self.heads * parts * self.head_dim]
    }
}

/// Every `d`-element block of the two layouts attention moves between: yields, for each
/// position, batch entry, head and part, the block's offset in the sequence-first layout
/// `[s, b, heads, parts, d]` (how layers hold activations), the part, and its offset in a
/// head-major `[b·heads, s, d]` tensor (how the batched attention products want it).
fn blocks(sh: Shape, parts: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let Shape {
        seq,
        batch,
        heads,
        head_dim: d,
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
fn to_heads(x: &Tensor, sh: Shape, parts: usize) -> Result<Vec<Tensor>> {
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
fn from_heads(xs: &[&Tensor], sh: Shape) -> Result<Tensor> {
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
    fn mask(&self, cx: &Cx, site: Site, sh: Shape) -> Option<(f32, DropoutStream, LogicalIndex)> {
        (cx.training() && self.dropout > 0.0).then(|| {
            (
                self.dropout,
                cx.dropout_stream(site),
                self.logical_index(cx, sh),
            )
        })
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

/// The attention weights of queries `q` and keys `k` (`[b·heads, s, d]`): the causal softmax
/// of their scaled products.
fn weights(q: &Tensor, k: &Tensor, sh: Shape) -> Result<Tensor> {
    let scores = matmul(q, &k.transpose(1, 2)?)?;
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
    Ok(probs)
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
        #[cfg(feature = "cuda")]
        if let Some(gpu) = qkv.gpu() {
            return self.forward_gpu(cx, site, qkv, sh, gpu);
        }
        let qkv = qkv.to_f32_contiguous()?;
        let Ok([q, k, v]) = <[Tensor; 3]>::try_from(to_heads(&qkv, sh, 3)?) else {
            unreachable!("to_heads returns one tensor per part")
        };
        let probs = weights(&q, &k, sh)?;
        let mask = self.mask(cx, site, sh);
        let ctx = matmul(&masked(&probs, &mask)?, &v)?;
        let out = from_heads(&[&ctx], sh)?;
        let kept = if cx.recompute() == Recompute::Selective && cx.training() {
            Kept::Inputs { q, k, v }
        } else {
            Kept::Weights { q, k, v, probs }
        };
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
        #[cfg(feature = "cuda")]
        if let Some(gpu) = d_out.gpu() {
            return device::backward(saved, d_out, gpu);
        }
        let d_out = d_out.to_f32_contiguous()?;
        let recomputed;
        let (q, k, v, probs) = match &saved.kept {
            Kept::Weights { q, k, v, probs } => (q, k, v, probs),
            Kept::Inputs { q, k, v } => {
                recomputed = weights(q, k, sh)?;
                (q, k, v, &recomputed)
            }
            #[cfg(feature = "cuda")]
            Kept::Flash { .. } => {
                return invalid!(
                    "attention: the forward ran on the GPU, the output gradient is on the host"
                );
            }
        };
        let d_ctx = to_heads(&d_out, sh, 1)?.remove(0);
        let d_dropped = matmul(&d_ctx, &v.transpose(1, 2)?)?;
        // The forward's dropped probabilities and the gradient through the dropout: one mask.
        let (dropped, d_probs) = masked_pair(probs, &d_dropped, &saved.dropout)?;
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

/// Attention on the GPU (feature `cuda`), when the fused QKV is a device tensor. The batched
/// products read and write the heads in place through strided views of the sequence-first
/// activations (`[b, heads, s, d]` views of `[s, b, heads·parts·d]`), so no layout copies run.
/// Softmax, dropout and the rounding of the products' operands are one fused kernel each way
/// (with the CPU's masks). With bf16 products every `s × s` tensor is bf16, as in Megatron-LM's
/// bf16 training: the scores and their gradients leave cuBLAS rounded once, and the saved
/// probabilities take half the memory.
#[cfg(feature = "cuda")]
mod device {
    use super::{AttentionSaved, CausalSelfAttention, Kept, Shape};
    use crate::cuda::Gpu;
    use crate::cuda::kernels::flash_attention::{
        FlashShape, SCORE_GRADIENT_BUDGET, flash_attention_backward, flash_attention_forward,
    };
    use crate::cuda::kernels::operand::{contiguous_input, with_in, with_optional_out, with_out};
    use crate::cuda::kernels::softmax as gsm;
    use crate::error::Result;
    use crate::kernels::dropout::LogicalIndex;
    use crate::module::{Cx, Site};
    use crate::ops::{as_operand, matmul_into, operand_dtype};
    use crate::rng::DropoutStream;
    use crate::tensor::{DType, Tensor};

    /// Part `part` of `parts` per head of a contiguous `[s, b, heads·parts·d]` tensor, viewed as
    /// `[b, heads, s, d]` (no copy; the batch and head dimensions fold into one batch).
    fn heads_view(x: &Tensor, sh: Shape, parts: usize, part: usize) -> Result<Tensor> {
        let d = sh.head_dim;
        Ok(x.reshape([sh.seq, sh.batch, sh.heads, parts * d])?
            .narrow(3, part * d, d)?
            .transpose(0, 1)?
            .transpose(1, 2)?)
    }

    /// The flash kernels' view of the sizes.
    fn flash_shape(sh: Shape) -> FlashShape {
        FlashShape {
            seq: sh.seq,
            batch: sh.batch,
            heads: sh.heads,
            head_dim: sh.head_dim,
        }
    }

    /// The mask as the fused kernels take it.
    fn dropout_of(mask: &Option<(f32, DropoutStream, LogicalIndex)>) -> Option<gsm::Dropout<'_>> {
        mask.as_ref().map(|(p, stream, index)| (*p, stream, *index))
    }

    impl CausalSelfAttention {
        pub(super) fn forward_gpu(
            &self,
            cx: &Cx,
            site: Site,
            qkv: &Tensor,
            sh: Shape,
            gpu: &Gpu,
        ) -> Result<(Tensor, AttentionSaved)> {
            let dtype = operand_dtype(qkv);
            if gpu.flash_attention() && dtype == DType::BF16 && flash_shape(sh).supported() {
                return self.forward_flash(cx, site, qkv, sh, gpu);
            }
            if cx.recompute() == crate::module::Recompute::Selective && cx.training() {
                return crate::invalid!(
                    "selective activation recompute on the GPU runs with the flash attention \
                     kernels (bf16 products), which keep no weights; this attention (head \
                     dimension {}) runs the unfused kernels, which would keep them",
                    sh.head_dim
                );
            }
            // q, k and v in the products' dtype (bf16: rounded once), kept for the backward.
            let qkv = as_operand(qkv)?;
            let q = heads_view(&qkv, sh, 3, 0)?;
            let k = heads_view(&qkv, sh, 3, 1)?;
            let v = heads_view(&qkv, sh, 3, 2)?;
            let square = [sh.batch, sh.heads, sh.seq, sh.seq];
            let scores = Tensor::empty_on(square, dtype, gpu)?;
            matmul_into(1.0, &q, &k.t()?, 0.0, &scores)?;
            let mask = self.mask(cx, site, sh);
            let probs = Tensor::empty_on(square, dtype, gpu)?;
            // What the value product reads: the dropped probabilities, or without dropout the
            // probabilities themselves.
            let dropped = mask
                .is_some()
                .then(|| Tensor::empty_on(square, dtype, gpu))
                .transpose()?;
            with_in(&scores, |x| {
                with_out(&probs, |y| {
                    with_optional_out(dropped.as_ref(), |d| {
                        gsm::softmax_dropout_forward(
                            gpu,
                            x,
                            sh.batch * sh.heads,
                            sh.seq,
                            sh.seq,
                            sh.scale(),
                            true,
                            y,
                            d,
                            dropout_of(&mask),
                        )?;
                        Ok(())
                    })
                })
            })?;
            drop(scores);
            // The context is the output projection's operand: written in its dtype.
            let out = Tensor::empty_on(sh.dims(1), dtype, gpu)?;
            matmul_into(
                1.0,
                dropped.as_ref().unwrap_or(&probs),
                &v,
                0.0,
                &heads_view(&out, sh, 1, 0)?,
            )?;
            Ok((
                out,
                AttentionSaved {
                    kept: Kept::Weights { q, k, v, probs },
                    dropout: mask,
                    shape: sh,
                },
            ))
        }

        /// The forward as tiled flash kernels: no `s × s` tensor kept; the backward recomputes the
        /// weights from the fused projection (rounded to bf16 once) and the rows' log-sum-exp.
        fn forward_flash(
            &self,
            cx: &Cx,
            site: Site,
            qkv: &Tensor,
            sh: Shape,
            gpu: &Gpu,
        ) -> Result<(Tensor, AttentionSaved)> {
            let qkv = qkv.to_contiguous(DType::BF16)?;
            let mask = self.mask(cx, site, sh);
            let fsh = flash_shape(sh);
            // bf16: the output projection's operand (flash runs with bf16 products).
            let out = Tensor::empty_on(sh.dims(1), DType::BF16, gpu)?;
            let lse = Tensor::empty_on([fsh.rows()], DType::F32, gpu)?;
            let keep = mask
                .is_some()
                .then(|| Tensor::empty_on([fsh.keep_words()], DType::I64, gpu))
                .transpose()?;
            // The kept-element bits, written by the forward while borrowed here.
            {
                let mut keep_write = keep.as_ref().map(|k| k.device_write::<i64>()).transpose()?;
                let mut keep_view = keep_write.as_mut().map(|k| k.view_mut());
                flash_attention_forward(
                    gpu,
                    &qkv.device_read::<half::bf16>()?.view(),
                    fsh,
                    sh.scale(),
                    dropout_of(&mask).zip(keep_view.as_mut()),
                    &mut out.device_write::<half::bf16>()?.view_mut(),
                    &mut lse.device_write::<f32>()?.view_mut(),
                )?;
            }
            Ok((
                out.clone(),
                AttentionSaved {
                    kept: Kept::Flash {
                        qkv,
                        out,
                        lse,
                        keep,
                    },
                    dropout: mask,
                    shape: sh,
                },
            ))
        }
    }

    /// The flash backward: the fused projection's gradient from the output's.
    fn backward_flash(
        saved: &AttentionSaved,
        (qkv, out, lse, keep): (&Tensor, &Tensor, &Tensor, Option<&Tensor>),
        d_out: &Tensor,
        gpu: &Gpu,
    ) -> Result<Tensor> {
        let sh = saved.shape;
        // bf16: the fused projection's backward multiplies by it.
        let dqkv = Tensor::empty_on(sh.dims(3), DType::BF16, gpu)?;
        // The output gradient as it comes (bf16 from a row-parallel projection), read once.
        let d_out = contiguous_input(d_out)?;
        let keep_read = keep.map(|k| k.device_read::<i64>()).transpose()?;
        let keep_view = keep_read.as_ref().map(|k| k.view());
        let dropout = saved
            .dropout
            .as_ref()
            .map(|(p, ..)| *p)
            .zip(keep_view.as_ref());
        with_in(&d_out, |d_out| {
            Ok(flash_attention_backward(
                gpu,
                &qkv.device_read::<half::bf16>()?.view(),
                &out.device_read::<half::bf16>()?.view(),
                &lse.device_read::<f32>()?.view(),
                d_out,
                flash_shape(sh),
                sh.scale(),
                dropout,
                &mut dqkv.device_write::<half::bf16>()?.view_mut(),
                SCORE_GRADIENT_BUDGET,
            )?)
        })?;
        Ok(dqkv)
    }

    /// The backward (the output gradient's size checked by the caller, its dtype and layout
    /// any), writing dq, dk and dv straight into their places in the fused gradient.
    pub(super) fn backward(saved: AttentionSaved, d_out: &Tensor, gpu: &Gpu) -> Result<Tensor> {
        let (q, k, v, probs) = match &saved.kept {
            Kept::Weights { q, k, v, probs } => (q, k, v, probs),
            Kept::Inputs { .. } => {
                return crate::invalid!(
                    "attention: the forward ran on the host, the output gradient is on the GPU"
                );
            }
            Kept::Flash {
                qkv,
                out,
                lse,
                keep,
            } => {
                return backward_flash(&saved, (qkv, out, lse, keep.as_ref()), d_out, gpu);
            }
        };
        let sh = saved.shape;
        let dtype = operand_dtype(d_out);
        // Both products that read the context gradient take it converted once.
        let d_ctx = heads_view(&as_operand(d_out)?, sh, 1, 0)?;
        let square = probs.shape().clone();
        let d_dropped = Tensor::empty_on(square.clone(), dtype, gpu)?;
        matmul_into(1.0, &d_ctx, &v.t()?, 0.0, &d_dropped)?;
        let d_scores = Tensor::empty_on(square.clone(), dtype, gpu)?;
        let dropped = saved
            .dropout
            .is_some()
            .then(|| Tensor::empty_on(square, dtype, gpu))
            .transpose()?;
        with_in(probs, |y| {
            with_in(&d_dropped, |dy| {
                with_out(&d_scores, |dx| {
                    with_optional_out(dropped.as_ref(), |d| {
                        gsm::dropout_softmax_backward(
                            gpu,
                            y,
                            dy,
                            sh.batch * sh.heads,
                            sh.seq,
                            sh.seq,
                            sh.scale(),
                            true,
                            dx,
                            d,
                            dropout_of(&saved.dropout),
                        )?;
                        Ok(())
                    })
                })
            })
        })?;
        drop(d_dropped);
        // The fused projection's gradient goes to its products: written in their dtype.
        let dqkv = Tensor::empty_on(sh.dims(3), dtype, gpu)?;
        let dropped = dropped.as_ref().unwrap_or(probs);
        matmul_into(
            1.0,
            &dropped.t()?,
            &d_ctx,
            0.0,
            &heads_view(&dqkv, sh, 3, 2)?,
        )?;
        matmul_into(1.0, &d_scores, k, 0.0, &heads_view(&dqkv, sh, 3, 0)?)?;
        matmul_into(1.0, &d_scores.t()?, q, 0.0, &heads_view(&dqkv, sh, 3, 1)?)?;
        Ok(dqkv)
    }
}
