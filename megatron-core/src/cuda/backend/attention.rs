//! Attention on the GPU (feature `cuda`), when the fused QKV is a device tensor. The batched
//! products read and write the heads in place through strided views of the sequence-first
//! activations (`[b, heads, s, d]` views of `[s, b, heads·parts·d]`), so no layout copies run.
//! Softmax, dropout and the rounding of the products' operands are one fused kernel each way
//! (with the CPU's masks). With bf16 products every `s × s` tensor is bf16, as in Megatron-LM's
//! bf16 training: the scores and their gradients leave cuBLAS rounded once, and the saved
//! probabilities take half the memory.

use crate::backend::DropoutMask;
use crate::backend::attention::{AttentionKept, AttentionOps, AttentionShape};
use crate::cuda::Gpu;
use crate::cuda::kernels::flash_attention::{
    self as fa, FlashShape, SCORE_GRADIENT_BUDGET, flash_attention_backward,
    flash_attention_forward,
};
use crate::cuda::kernels::operand::{contiguous_input, with_in, with_optional_out, with_out};
use crate::cuda::kernels::softmax as gsm;
use crate::documents::Documents;
use crate::error::Result;
use crate::ops::{as_operand, matmul_into, operand_dtype};
use crate::tensor::{DType, Tensor};

/// Part `part` of `parts` per head of a contiguous `[s, b, heads·parts·d]` tensor, viewed as
/// `[b, heads, s, d]` (no copy; the batch and head dimensions fold into one batch).
fn heads_view(x: &Tensor, sh: AttentionShape, parts: usize, part: usize) -> Result<Tensor> {
    let d = sh.head_dim;
    Ok(x.reshape([sh.seq, sh.batch, sh.heads, parts * d])?
        .narrow(3, part * d, d)?
        .transpose(0, 1)?
        .transpose(1, 2)?)
}

/// The flash kernels' view of the sizes.
fn flash_shape(sh: AttentionShape) -> FlashShape {
    FlashShape {
        seq: sh.seq,
        batch: sh.batch,
        heads: sh.heads,
        head_dim: sh.head_dim,
        window: sh.window,
    }
}

/// The mask as the fused kernels take it.
fn dropout_of(mask: &Option<DropoutMask>) -> Option<gsm::Dropout<'_>> {
    mask.as_ref().map(|(p, stream, index)| (*p, stream, *index))
}

impl AttentionOps for Gpu {
    fn attention_forward(
        &self,
        qkv: &Tensor,
        sh: AttentionShape,
        mask: &Option<DropoutMask>,
        keep_inputs: bool,
    ) -> Result<(Tensor, AttentionKept)> {
        let gpu = self;
        if flash_runs(gpu, qkv, sh) {
            return forward_flash(gpu, qkv, sh, mask, None);
        }
        let dtype = operand_dtype(qkv);
        if keep_inputs {
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
        let probs = Tensor::empty_on(square, dtype, gpu)?;
        // What the value product reads: the dropped probabilities, or without dropout the
        // probabilities themselves.
        let dropped = mask
            .is_some()
            .then(|| Tensor::empty_on(square, dtype, gpu))
            .transpose()?;
        let sizes = (sh.batch * sh.heads, sh.seq, sh.seq);
        softmax_into(
            gpu,
            &scores,
            (&probs, dropped.as_ref()),
            sizes,
            (sh.scale(), sh.key_mask()),
            mask,
        )?;
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
        Ok((out, AttentionKept::Weights { q, k, v, probs }))
    }

    /// The flash kernels take the documents' spans in a device table (one launch each way);
    /// the unfused kernels run a document at a time.
    fn attention_forward_packed(
        &self,
        qkv: &Tensor,
        sh: AttentionShape,
        documents: &Documents,
    ) -> Result<Option<(Tensor, AttentionKept)>> {
        if !flash_runs(self, qkv, sh) {
            return Ok(None);
        }
        let words = fa::Documents::words(documents.spans());
        let table = Tensor::from_vec(words, [sh.batch * sh.seq])?.to_gpu(self)?;
        forward_flash(self, qkv, sh, &None, Some(table)).map(Some)
    }

    /// Writes dq, dk and dv straight into their places in the fused gradient (the output
    /// gradient's dtype and layout any).
    fn attention_backward(
        &self,
        kept: &AttentionKept,
        mask: &Option<DropoutMask>,
        sh: AttentionShape,
        d_out: &Tensor,
    ) -> Result<Tensor> {
        backward(kept, mask, sh, d_out, self)
    }
}

/// Whether attention runs in the flash kernels: turned on, bf16 products, a head size they
/// are built for.
fn flash_runs(gpu: &Gpu, qkv: &Tensor, sh: AttentionShape) -> bool {
    gpu.flash_attention() && operand_dtype(qkv) == DType::BF16 && flash_shape(sh).supported()
}

/// The forward as tiled flash kernels: no `s × s` tensor kept; the backward recomputes the
/// weights from the fused projection (rounded to bf16 once) and the rows' log-sum-exp. With
/// `documents` (their table, `flash_attention::Documents`), each query sees only its own.
fn forward_flash(
    gpu: &Gpu,
    qkv: &Tensor,
    sh: AttentionShape,
    mask: &Option<DropoutMask>,
    documents: Option<Tensor>,
) -> Result<(Tensor, AttentionKept)> {
    let qkv = qkv.to_contiguous(DType::BF16)?;
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
        let table = documents
            .as_ref()
            .map(|t| t.device_read::<i64>())
            .transpose()?;
        let table_view = table.as_ref().map(|t| t.view());
        flash_attention_forward(
            gpu,
            &qkv.device_read::<half::bf16>()?.view(),
            fsh,
            sh.scale(),
            dropout_of(mask).zip(keep_view.as_mut()),
            table_view.as_ref().map(fa::Documents),
            &mut out.device_write::<half::bf16>()?.view_mut(),
            &mut lse.device_write::<f32>()?.view_mut(),
        )?;
    }
    Ok((
        out.clone(),
        AttentionKept::Flash {
            qkv,
            out,
            lse,
            keep,
            documents,
        },
    ))
}

/// The flash backward: the fused projection's gradient from the output's.
fn backward_flash(
    (qkv, out, lse, keep, documents): (&Tensor, &Tensor, &Tensor, Option<&Tensor>, Option<&Tensor>),
    mask: &Option<DropoutMask>,
    sh: AttentionShape,
    d_out: &Tensor,
    gpu: &Gpu,
) -> Result<Tensor> {
    // bf16: the fused projection's backward multiplies by it.
    let dqkv = Tensor::empty_on(sh.dims(3), DType::BF16, gpu)?;
    // The output gradient as it comes (bf16 from a row-parallel projection), read once.
    let d_out = contiguous_input(d_out)?;
    let keep_read = keep.map(|k| k.device_read::<i64>()).transpose()?;
    let keep_view = keep_read.as_ref().map(|k| k.view());
    let dropout = mask.as_ref().map(|(p, ..)| *p).zip(keep_view.as_ref());
    let table = documents.map(|t| t.device_read::<i64>()).transpose()?;
    let table_view = table.as_ref().map(|t| t.view());
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
            table_view.as_ref().map(fa::Documents),
            &mut dqkv.device_write::<half::bf16>()?.view_mut(),
            SCORE_GRADIENT_BUDGET,
        )?)
    })?;
    Ok(dqkv)
}

/// The backward of the unfused kernels, or of the flash ones.
fn backward(
    kept: &AttentionKept,
    mask: &Option<DropoutMask>,
    sh: AttentionShape,
    d_out: &Tensor,
    gpu: &Gpu,
) -> Result<Tensor> {
    let (q, k, v, probs) = match kept {
        AttentionKept::Weights { q, k, v, probs } => (q, k, v, probs),
        AttentionKept::Inputs { .. } => {
            return crate::invalid!(
                "attention: the forward ran on the host, the output gradient is on the GPU"
            );
        }
        AttentionKept::ContextParallel(_) => {
            return crate::invalid!("attention: context parallelism runs its own backward");
        }
        AttentionKept::Documents(_) => {
            return crate::invalid!("attention: packed documents' backward is attend_backward's");
        }
        AttentionKept::Decoded => {
            return crate::invalid!(
                "attention: a decoding forward with a KV cache has no backward"
            );
        }
        AttentionKept::Flash {
            qkv,
            out,
            lse,
            keep,
            documents,
        } => {
            let kept = (qkv, out, lse, keep.as_ref(), documents.as_ref());
            return backward_flash(kept, mask, sh, d_out, gpu);
        }
    };
    let dtype = operand_dtype(d_out);
    // Both products that read the context gradient take it converted once.
    let d_ctx = heads_view(&as_operand(d_out)?, sh, 1, 0)?;
    let square = probs.shape().clone();
    let d_dropped = Tensor::empty_on(square.clone(), dtype, gpu)?;
    matmul_into(1.0, &d_ctx, &v.t()?, 0.0, &d_dropped)?;
    let d_scores = Tensor::empty_on(square.clone(), dtype, gpu)?;
    let dropped = mask
        .is_some()
        .then(|| Tensor::empty_on(square, dtype, gpu))
        .transpose()?;
    let sizes = (sh.batch * sh.heads, sh.seq, sh.seq);
    softmax_backward_into(
        gpu,
        (probs, &d_dropped),
        (&d_scores, dropped.as_ref()),
        sizes,
        (sh.scale(), sh.key_mask()),
        mask,
    )?;
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

/// The fused masked softmax of `scores` (`rows` blocks of `sq × sk`) into `probs`, and with a
/// dropout mask the dropped weights into `dropped`.
fn softmax_into(
    gpu: &Gpu,
    scores: &Tensor,
    (probs, dropped): (&Tensor, Option<&Tensor>),
    (rows, sq, sk): (usize, usize, usize),
    (scale, keys): (f32, crate::kernels::softmax::KeyMask),
    mask: &Option<DropoutMask>,
) -> Result<()> {
    with_in(scores, |x| {
        with_out(probs, |y| {
            with_optional_out(dropped, |d| {
                gsm::softmax_dropout_forward(
                    gpu,
                    x,
                    rows,
                    sq,
                    sk,
                    scale,
                    keys,
                    y,
                    d,
                    dropout_of(mask),
                )?;
                Ok(())
            })
        })
    })
}

/// The backward of [`softmax_into`]: the scores' gradient into `d_scores` from the weights and
/// the dropped weights' gradient (and the dropped weights again into `dropped`).
fn softmax_backward_into(
    gpu: &Gpu,
    (probs, d_dropped): (&Tensor, &Tensor),
    (d_scores, dropped): (&Tensor, Option<&Tensor>),
    (rows, sq, sk): (usize, usize, usize),
    (scale, keys): (f32, crate::kernels::softmax::KeyMask),
    mask: &Option<DropoutMask>,
) -> Result<()> {
    with_in(probs, |y| {
        with_in(d_dropped, |dy| {
            with_out(d_scores, |dx| {
                with_optional_out(dropped, |d| {
                    gsm::dropout_softmax_backward(
                        gpu,
                        y,
                        dy,
                        rows,
                        sq,
                        sk,
                        scale,
                        keys,
                        dx,
                        d,
                        dropout_of(mask),
                    )?;
                    Ok(())
                })
            })
        })
    })
}
