//! The builtin functions of a module's forward (`gelu`, `dropout`, `cross_entropy`, `+`, and
//! `a + dropout(b, p)` fused), each a forward that returns what its backward needs and that
//! backward.

use crate::error::Result;
use crate::invalid;
use crate::kernels::{cross_entropy as ce, dropout as dk, elementwise};
use crate::module::{Cx, Sharding, Site};
use crate::rng::DropoutStream;
use crate::tensor::{DType, Tensor};

/// The last dimension of a tensor (1 for a scalar).
fn last_dim(t: &Tensor) -> usize {
    t.dims().last().copied().unwrap_or(1)
}

/// Element-wise `a + b` (residual connections); both must have the same shape.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return invalid!("add: shapes {} and {} differ", a.shape(), b.shape());
    }
    #[cfg(feature = "cuda")]
    if let Some(gpu) = a.gpu().or(b.gpu()) {
        return device::add(gpu, a, b);
    }
    let (a, b) = (a.to_f32_contiguous()?, b.to_f32_contiguous()?);
    let out = Tensor::empty(a.shape().clone(), DType::F32);
    elementwise::add(
        &a.read::<f32>()?,
        &b.read::<f32>()?,
        &mut out.write::<f32>()?,
    )?;
    Ok(out)
}

/// What [`gelu`] keeps: its input.
#[derive(Debug, Clone)]
pub struct GeluSaved {
    x: Tensor,
}

/// GeLU with GPT-2's tanh approximation.
///
/// On a GPU that multiplies in bf16 the output is bf16 (the next product's operand, rounded
/// once), and a bf16 input is read as it is and kept so for the backward.
pub fn gelu(_cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, GeluSaved)> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = x.gpu() {
        let x = crate::cuda::kernels::operand::contiguous_input(x)?;
        let y = device::gelu(gpu, &x)?;
        return Ok((y, GeluSaved { x }));
    }
    let x = x.to_f32_contiguous()?;
    let y = Tensor::empty(x.shape().clone(), DType::F32);
    elementwise::gelu_forward(&x.read::<f32>()?, &mut y.write::<f32>()?)?;
    Ok((y, GeluSaved { x }))
}

/// Gradient of [`gelu`] (on a GPU that multiplies in bf16, bf16: the gradient goes to the
/// products of the layer before).
pub fn gelu_backward(_cx: &Cx, _site: Site, saved: GeluSaved, dy: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = saved.x.gpu() {
        let dy = crate::cuda::kernels::operand::contiguous_input(dy)?;
        return device::gelu_backward(gpu, &saved.x, &dy);
    }
    let dy = dy.to_f32_contiguous()?;
    let dx = Tensor::empty(saved.x.shape().clone(), DType::F32);
    elementwise::gelu_backward(
        &saved.x.read::<f32>()?,
        &dy.read::<f32>()?,
        &mut dx.write::<f32>()?,
    )?;
    Ok(dx)
}

/// What [`dropout`] keeps: the mask's key (the mask itself is regenerated).
#[derive(Debug, Clone)]
pub struct DropoutSaved {
    /// `None` when dropout was the identity (evaluation or p = 0).
    mask: Option<(f32, DropoutStream, dk::LogicalIndex)>,
}

/// Where this rank's elements of `x` lie in the logical (unsharded) tensor.
fn logical_index(cx: &Cx, x: &Tensor, sharding: Sharding) -> dk::LogicalIndex {
    match sharding {
        Sharding::Replicated => dk::LogicalIndex::contiguous(x.numel()),
        Sharding::SplitLastDim => {
            let cols = last_dim(x);
            let rows = x.numel().checked_div(cols).unwrap_or(0);
            dk::LogicalIndex::columns(rows, cols, cols * cx.tp_size(), cols * cx.tp_rank())
        }
    }
}

/// Dropout with drop probability `p` during training (identity in evaluation).
///
/// The mask of an element depends only on (seed, step, microbatch, site, logical index), so a
/// tensor-parallel shard drops exactly the elements the unsharded tensor would.
pub fn dropout(
    cx: &Cx,
    site: Site,
    x: &Tensor,
    p: f32,
    sharding: Sharding,
) -> Result<(Tensor, DropoutSaved)> {
    dk::keep_threshold(p)?;
    if !cx.training() || p == 0.0 {
        return Ok((x.clone(), DropoutSaved { mask: None }));
    }
    let x = x.to_f32_contiguous()?;
    let stream = cx.dropout_stream(site);
    let index = logical_index(cx, &x, sharding);
    let mask = (p, stream, index);
    #[cfg(feature = "cuda")]
    if let Some(gpu) = x.gpu() {
        let y = device::dropout(gpu, &x, &mask, DType::F32, false)?;
        let mask = Some(mask);
        return Ok((y, DropoutSaved { mask }));
    }
    let y = Tensor::empty(x.shape().clone(), DType::F32);
    dk::dropout_forward(&x.read::<f32>()?, &mut y.write::<f32>()?, p, &mask.1, index)?;
    let mask = Some(mask);
    Ok((y, DropoutSaved { mask }))
}

/// Gradient of [`dropout`]: the same mask applied to `dy`.
pub fn dropout_backward(_cx: &Cx, _site: Site, saved: DropoutSaved, dy: &Tensor) -> Result<Tensor> {
    masked_gradient(saved, dy, DType::F32)
}

/// [`dropout_backward`] written in `dtype` (f32, or on a GPU bf16: rounded once, as a
/// conversion of the f32 gradient would round it).
fn masked_gradient(saved: DropoutSaved, dy: &Tensor, dtype: DType) -> Result<Tensor> {
    let Some(mask) = saved.mask else {
        return Ok(dy.clone());
    };
    let dy = dy.to_f32_contiguous()?;
    #[cfg(feature = "cuda")]
    if let Some(gpu) = dy.gpu() {
        return device::dropout(gpu, &dy, &mask, dtype, true);
    }
    let _ = dtype;
    let (p, stream, index) = mask;
    let dx = Tensor::empty(dy.shape().clone(), DType::F32);
    dk::dropout_backward(
        &dy.read::<f32>()?,
        &mut dx.write::<f32>()?,
        p,
        &stream,
        index,
    )?;
    Ok(dx)
}

/// Dropout on a residual branch and the residual connection in one pass:
/// `residual + dropout(x, p)`, bit for bit what [`dropout`] then [`add`] give, with the same
/// mask at the same `site` (Megatron-LM's bias-dropout-add fusion; a row-parallel layer's bias
/// is added by the layer). It reads `residual` and `x` and writes the sum, where the two calls
/// wrote and read the dropped branch in between. The macros emit it for `a + dropout(b, p)` and
/// `dropout(b, p) + a`.
pub fn dropout_add(
    cx: &Cx,
    site: Site,
    residual: &Tensor,
    x: &Tensor,
    p: f32,
    sharding: Sharding,
) -> Result<(Tensor, DropoutSaved)> {
    dk::keep_threshold(p)?;
    if residual.shape() != x.shape() {
        return invalid!(
            "dropout_add: the residual's shape {} differs from the branch's {}",
            residual.shape(),
            x.shape()
        );
    }
    if !cx.training() || p == 0.0 {
        return Ok((add(residual, x)?, DropoutSaved { mask: None }));
    }
    let (residual, x) = (residual.to_f32_contiguous()?, x.to_f32_contiguous()?);
    let mask = (p, cx.dropout_stream(site), logical_index(cx, &x, sharding));
    #[cfg(feature = "cuda")]
    if let Some(gpu) = x.gpu().or(residual.gpu()) {
        let y = device::dropout_add(gpu, &residual, &x, &mask)?;
        let mask = Some(mask);
        return Ok((y, DropoutSaved { mask }));
    }
    let y = Tensor::empty(x.shape().clone(), DType::F32);
    let (r, xs) = (residual.read::<f32>()?, x.read::<f32>()?);
    dk::dropout_add_forward(&r, &xs, &mut y.write::<f32>()?, p, &mask.1, mask.2)?;
    drop((r, xs));
    let mask = Some(mask);
    Ok((y, DropoutSaved { mask }))
}

/// Gradients of [`dropout_add`]: `(d_residual, d_x)`, `dy` itself and the mask applied to it.
///
/// `to_products`: the branch's backward reads its gradient only as a product's operand (its
/// last layer is a linear one), so on a GPU that multiplies in bf16 `d_x` is written in bf16,
/// the same bits as the product's own conversion of the f32 gradient, one pass fewer.
pub fn dropout_add_backward(
    _cx: &Cx,
    _site: Site,
    saved: DropoutSaved,
    dy: &Tensor,
    to_products: bool,
) -> Result<(Tensor, Tensor)> {
    let dtype = if to_products {
        crate::ops::operand_dtype(dy)
    } else {
        DType::F32
    };
    let d_x = masked_gradient(saved, dy, dtype)?;
    Ok((dy.clone(), d_x))
}

/// What [`cross_entropy`] keeps.
#[derive(Debug, Clone)]
pub struct CrossEntropySaved {
    logits: Tensor,
    targets: Tensor,
    logsumexp: Tensor,
}

/// Per-token cross-entropy of replicated `logits [.., V]` against `targets [..]` (i64): a tensor
/// of the targets' shape.
pub fn cross_entropy(
    _cx: &Cx,
    _site: Site,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, CrossEntropySaved)> {
    let vocab = last_dim(logits);
    let rows = targets.numel();
    if logits.numel() != rows * vocab || targets.dtype() != DType::I64 {
        return invalid!(
            "cross_entropy: logits {} ({}) do not fit targets {} ({}; expected i64)",
            logits.shape(),
            logits.dtype(),
            targets.shape(),
            targets.dtype()
        );
    }
    let logits = logits.to_f32_contiguous()?;
    let targets = targets.contiguous()?;
    #[cfg(feature = "cuda")]
    if let Some(gpu) = logits.gpu() {
        let targets = device::on_gpu(gpu, &targets)?;
        let (losses, logsumexp) = device::cross_entropy(gpu, &logits, &targets, rows, vocab)?;
        return Ok((
            losses,
            CrossEntropySaved {
                logits,
                targets,
                logsumexp,
            },
        ));
    }
    let losses = Tensor::empty(targets.shape().clone(), DType::F32);
    let logsumexp = Tensor::empty([rows], DType::F32);
    ce::cross_entropy_forward(
        &logits.read::<f32>()?,
        &targets.read::<i64>()?,
        rows,
        vocab,
        &mut losses.write::<f32>()?,
        &mut logsumexp.write::<f32>()?,
    )?;
    Ok((
        losses,
        CrossEntropySaved {
            logits,
            targets,
            logsumexp,
        },
    ))
}

/// Gradient of [`cross_entropy`] with respect to the logits.
pub fn cross_entropy_backward(
    _cx: &Cx,
    _site: Site,
    saved: CrossEntropySaved,
    dloss: &Tensor,
) -> Result<Tensor> {
    let vocab = last_dim(&saved.logits);
    let rows = saved.targets.numel();
    let dloss = dloss.to_f32_contiguous()?;
    #[cfg(feature = "cuda")]
    if let Some(gpu) = saved.logits.gpu() {
        return device::cross_entropy_backward(gpu, &saved, &dloss, rows, vocab);
    }
    let dlogits = Tensor::empty(saved.logits.shape().clone(), DType::F32);
    ce::cross_entropy_backward(
        &saved.logits.read::<f32>()?,
        &saved.targets.read::<i64>()?,
        &saved.logsumexp.read::<f32>()?,
        &dloss.read::<f32>()?,
        rows,
        vocab,
        &mut dlogits.write::<f32>()?,
    )?;
    Ok(dlogits)
}

/// The primitives on a GPU: the same arguments, the CUDA kernels on the tensors' memory, outputs
/// allocated on the device (nothing read back but cross-entropy's target check).
#[cfg(feature = "cuda")]
mod device {
    use super::{CrossEntropySaved, DType, Result, Tensor, dk};
    use crate::cuda::Gpu;
    use crate::cuda::kernels::operand::{with_in, with_out};
    use crate::cuda::kernels::{cross_entropy as ce, dropout as gdk, elementwise};
    use crate::ops::operand_dtype;
    use crate::rng::DropoutStream;

    /// `a + b` (same shape, checked by the caller).
    pub(super) fn add(gpu: &Gpu, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = (a.to_f32_contiguous()?, b.to_f32_contiguous()?);
        let out = Tensor::empty_near(a.shape().clone(), DType::F32, &a)?;
        elementwise::add(
            gpu,
            &a.device_read::<f32>()?.view(),
            &b.device_read::<f32>()?.view(),
            &mut out.device_write::<f32>()?.view_mut(),
        )?;
        Ok(out)
    }

    /// `gelu(x)` of a contiguous f32 or bf16 `x`, in the products' dtype.
    pub(super) fn gelu(gpu: &Gpu, x: &Tensor) -> Result<Tensor> {
        let y = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        with_in(x, |x| {
            with_out(&y, |y| Ok(elementwise::gelu_forward(gpu, x, y)?))
        })?;
        Ok(y)
    }

    /// `dy · gelu'(x)` of contiguous f32 or bf16 tensors, in the products' dtype.
    pub(super) fn gelu_backward(gpu: &Gpu, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let dx = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        with_in(x, |x| {
            with_in(dy, |dy| {
                with_out(&dx, |dx| Ok(elementwise::gelu_backward(gpu, x, dy, dx)?))
            })
        })?;
        Ok(dx)
    }

    /// The dropout mask `(p, stream, index)` applied to a contiguous f32 `x`, written in
    /// `dtype` (f32 or bf16): the forward, or the backward (the same mask regenerated).
    pub(super) fn dropout(
        gpu: &Gpu,
        x: &Tensor,
        (p, stream, index): &(f32, DropoutStream, dk::LogicalIndex),
        dtype: DType,
        backward: bool,
    ) -> Result<Tensor> {
        let y = Tensor::empty_near(x.shape().clone(), dtype, x)?;
        let xv = x.device_read::<f32>()?;
        let kernel = if backward {
            gdk::dropout_backward
        } else {
            gdk::dropout_forward
        };
        with_out(&y, |out| {
            Ok(kernel(gpu, &xv.view(), out, *p, stream, *index)?)
        })?;
        drop(xv);
        Ok(y)
    }

    /// `residual + mask(x)` of contiguous f32 tensors, one kernel (shapes checked by the caller;
    /// a host operand is uploaded).
    pub(super) fn dropout_add(
        gpu: &Gpu,
        residual: &Tensor,
        x: &Tensor,
        (p, stream, index): &(f32, DropoutStream, dk::LogicalIndex),
    ) -> Result<Tensor> {
        let (residual, x) = (on_gpu(gpu, residual)?, on_gpu(gpu, x)?);
        let y = Tensor::empty_near(x.shape().clone(), DType::F32, &x)?;
        gdk::dropout_add_forward(
            gpu,
            &residual.device_read::<f32>()?.view(),
            &x.device_read::<f32>()?.view(),
            &mut y.device_write::<f32>()?.view_mut(),
            *p,
            stream,
            *index,
        )?;
        Ok(y)
    }

    /// Per-row losses (the targets' shape) and `logsumexp[rows]` of contiguous f32 `logits` and
    /// i64 `targets` on the device (shapes checked by the caller).
    pub(super) fn cross_entropy(
        gpu: &Gpu,
        logits: &Tensor,
        targets: &Tensor,
        rows: usize,
        vocab: usize,
    ) -> Result<(Tensor, Tensor)> {
        let losses = Tensor::empty_near(targets.shape().clone(), DType::F32, logits)?;
        let logsumexp = Tensor::empty_near([rows], DType::F32, logits)?;
        ce::cross_entropy_forward(
            gpu,
            &logits.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            rows,
            vocab,
            &mut losses.device_write::<f32>()?.view_mut(),
            &mut logsumexp.device_write::<f32>()?.view_mut(),
        )?;
        Ok((losses, logsumexp))
    }

    /// Gradient of [`cross_entropy`] with respect to the logits.
    pub(super) fn cross_entropy_backward(
        gpu: &Gpu,
        saved: &CrossEntropySaved,
        dloss: &Tensor,
        rows: usize,
        vocab: usize,
    ) -> Result<Tensor> {
        let dloss = on_gpu(gpu, dloss)?;
        let dlogits = Tensor::empty_near(saved.logits.shape().clone(), DType::F32, &saved.logits)?;
        ce::cross_entropy_backward(
            gpu,
            &saved.logits.device_read::<f32>()?.view(),
            &saved.targets.device_read::<i64>()?.view(),
            &saved.logsumexp.device_read::<f32>()?.view(),
            &dloss.device_read::<f32>()?.view(),
            rows,
            vocab,
            &mut dlogits.device_write::<f32>()?.view_mut(),
        )?;
        Ok(dlogits)
    }

    /// `t` on the device: itself, or an upload of a host tensor (targets from the host data
    /// loader; the upload waits for the stream).
    pub(super) fn on_gpu(gpu: &Gpu, t: &Tensor) -> Result<Tensor> {
        if t.gpu().is_some() {
            Ok(t.clone())
        } else {
            t.to_gpu(gpu)
        }
    }
}
