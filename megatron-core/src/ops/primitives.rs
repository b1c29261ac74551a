//! The builtin functions of a module's forward (`gelu`, `swiglu`, `dropout`, `cross_entropy`, `+`, and
//! `a + dropout(b, p)` fused), each a forward that returns what its backward needs and that
//! backward.

use std::ops::Range;

use crate::backend::{self, DropoutMask};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout as dk;
use crate::module::{Cx, Sharding, Site};
use crate::tensor::{DType, Tensor};

/// Element-wise `a + b` (residual connections); both must have the same shape.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return invalid!("add: shapes {} and {} differ", a.shape(), b.shape());
    }
    backend::of_any(&[a, b]).add(a, b)
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
    let (y, x) = backend::of(x).gelu(x)?;
    Ok((y, GeluSaved { x }))
}

/// Gradient of [`gelu`] (on a GPU that multiplies in bf16, bf16: the gradient goes to the
/// products of the layer before).
pub fn gelu_backward(_cx: &Cx, _site: Site, saved: GeluSaved, dy: &Tensor) -> Result<Tensor> {
    backend::of(&saved.x).gelu_backward(&saved.x, dy)
}

/// What [`swiglu`] keeps: its input.
#[derive(Debug, Clone)]
pub struct SwigluSaved {
    x: Tensor,
}

/// SwiGLU, the gated MLP's activation (Megatron-LM's `--swiglu`): the last dimension of `x`
/// holds the gate, then the up projection, `[.., 2·f]`; the output is `silu(gate) · up`,
/// `[.., f]`. A column-parallel `fc1` built with `LinearSpec::gated` gives each tensor-parallel
/// rank its own gate and up rows, so that the rank's halves pair up.
///
/// On a GPU that multiplies in bf16 the output is bf16, as [`gelu`]'s.
pub fn swiglu(_cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, SwigluSaved)> {
    let width = x.dims().last().copied().unwrap_or(0);
    if width == 0 || !width.is_multiple_of(2) {
        return invalid!(
            "swiglu: the input's last dimension ({width}, shape {}) is not the gate and the up \
             projection side by side (an even width)",
            x.shape()
        );
    }
    let (y, x) = backend::of(x).swiglu(x, width / 2)?;
    Ok((y, SwigluSaved { x }))
}

/// Gradient of [`swiglu`] (in the products' dtype on a GPU, as [`gelu_backward`]'s).
pub fn swiglu_backward(_cx: &Cx, _site: Site, saved: SwigluSaved, dy: &Tensor) -> Result<Tensor> {
    let ffn = saved.x.dims().last().copied().unwrap_or(0) / 2;
    backend::of(&saved.x).swiglu_backward(&saved.x, dy, ffn)
}

/// What [`dropout`] keeps: the mask's key (the mask itself is regenerated).
#[derive(Debug, Clone)]
pub struct DropoutSaved {
    /// `None` when dropout was the identity (evaluation or p = 0).
    mask: Option<RowMasks>,
}

/// A tensor's dropout mask by runs of its rows (its first dimension): one run of all of them
/// where their logical elements are one [`dk::LogicalIndex`], else a run per range of positions
/// (a context-parallel rank's chunks of packed documents).
#[derive(Debug, Clone)]
struct RowMasks(Vec<(Range<usize>, DropoutMask)>);

impl RowMasks {
    /// The masks of `x`'s rows with probability `p` from `stream`, where they lie in the
    /// logical tensor.
    fn of(
        cx: &Cx,
        x: &Tensor,
        sharding: Sharding,
        p: f32,
        stream: crate::rng::DropoutStream,
    ) -> Result<RowMasks> {
        let runs = logical_runs(cx, x, sharding)?;
        Ok(RowMasks(
            runs.into_iter()
                .map(|(rows, index)| (rows, (p, stream, index)))
                .collect(),
        ))
    }

    /// `f` of each run of `xs`' rows (tensors of the same first dimension) with its mask,
    /// written into one tensor; `f` itself on the whole tensors where one run covers them.
    fn apply(
        &self,
        xs: &[&Tensor],
        f: impl Fn(&[Tensor], &DropoutMask) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let rows = xs[0].dims().first().copied().unwrap_or(0);
        if let [(whole, mask)] = self.0.as_slice()
            && *whole == (0..rows)
        {
            let owned: Vec<Tensor> = xs.iter().map(|&x| x.clone()).collect();
            return f(&owned, mask);
        }
        let mut out: Option<Tensor> = None;
        for (run, mask) in &self.0 {
            let parts = xs
                .iter()
                .map(|x| Ok(x.narrow(0, run.start, run.len())?.contiguous()?))
                .collect::<Result<Vec<_>>>()?;
            let y = f(&parts, mask)?;
            let out = match &mut out {
                Some(out) => out,
                None => out.insert(Tensor::empty_near(xs[0].dims().to_vec(), y.dtype(), xs[0])?),
            };
            out.narrow(0, run.start, run.len())?.copy_from(&y)?;
        }
        match out {
            Some(out) => Ok(out),
            None => invalid!("dropout: a tensor of no rows"),
        }
    }
}

/// Where this rank's elements of `x` lie in the logical (unsharded) tensor. With sequence
/// parallelism a value outside the tensor-parallel regions is this rank's shard of the
/// sequence: the rank-th run of `x.numel()` elements of `[s, b, h]` (its first dimension split),
/// so that the mask is drawn per global position. With context parallelism `x` (`[s, b, h]`)
/// holds the rank's chunks: one index over two runs of its elements where the chunks lie, or
/// with packed documents cut one by one a run of rows per chunk, each with its own index.
fn logical_runs(
    cx: &Cx,
    x: &Tensor,
    sharding: Sharding,
) -> Result<Vec<(Range<usize>, dk::LogicalIndex)>> {
    let rows = x.dims().first().copied().unwrap_or(0);
    if cx.cp_size() > 1 {
        return cp_logical_runs(cx, x, sharding);
    }
    Ok(vec![(0..rows, logical_index(cx, x, sharding))])
}

/// [`logical_runs`] without context parallelism: one index of all of `x`.
fn logical_index(cx: &Cx, x: &Tensor, sharding: Sharding) -> dk::LogicalIndex {
    match sharding {
        Sharding::Replicated if cx.sequence_parallel() => {
            dk::LogicalIndex::range((x.numel() * cx.tp_rank()) as u64, x.numel())
        }
        Sharding::Replicated | Sharding::Gathered => dk::LogicalIndex::contiguous(x.numel()),
        Sharding::SplitLastDim => {
            let cols = x.last_dim();
            let rows = x.numel().checked_div(cols).unwrap_or(0);
            dk::LogicalIndex::columns(rows, cols, cols * cx.tp_size(), cols * cx.tp_rank())
        }
    }
}

/// [`logical_runs`] with context parallelism: this rank's rows (all of its chunks, or with
/// sequence parallelism outside the tensor-parallel region its shard of them) as one run of
/// positions per chunk they touch: one index where there are at most two runs of one length,
/// else one per run; a value split by its last dimension gets one index of its columns per run.
fn cp_logical_runs(
    cx: &Cx,
    x: &Tensor,
    sharding: Sharding,
) -> Result<Vec<(Range<usize>, dk::LogicalIndex)>> {
    let rows = x.dims().first().copied().unwrap_or(0);
    let per_position = x.numel().checked_div(rows).unwrap_or(0);
    let runs = match sharding {
        // With sequence parallelism `x` is this rank's shard of its chunks' positions.
        Sharding::Replicated if cx.sequence_parallel() => cx.position_runs(rows * cx.tp_size())?,
        Sharding::Replicated => cx.position_runs(rows)?,
        Sharding::Gathered | Sharding::SplitLastDim => cx.whole_position_runs(rows)?,
    };
    if sharding == Sharding::SplitLastDim {
        // Each position's `per_position` local elements are rows of the rank's columns.
        let cols = x.last_dim();
        let (logical_cols, first_col) = (cols * cx.tp_size(), cols * cx.tp_rank());
        let per_position_rows = per_position.checked_div(cols).unwrap_or(0);
        let mut at = 0;
        return Ok(runs
            .into_iter()
            .map(|run| {
                let local = at..at + run.len();
                at = local.end;
                let index = dk::LogicalIndex {
                    outer: run.len() * per_position_rows,
                    inner: cols,
                    logical_stride: logical_cols as u64,
                    logical_start: (run.start * per_position_rows * logical_cols + first_col)
                        as u64,
                };
                (local, index)
            })
            .collect());
    }
    let whole = match runs.as_slice() {
        [a] => Some(dk::LogicalIndex::range(
            (a.start * per_position) as u64,
            x.numel(),
        )),
        [a, b] if a.len() == b.len() && a.start <= b.start => Some(dk::LogicalIndex {
            outer: 2,
            inner: a.len() * per_position,
            logical_stride: ((b.start - a.start) * per_position) as u64,
            logical_start: (a.start * per_position) as u64,
        }),
        _ => None,
    };
    if let Some(index) = whole {
        return Ok(vec![(0..rows, index)]);
    }
    let mut at = 0;
    Ok(runs
        .into_iter()
        .map(|run| {
            let local = at..at + run.len();
            at = local.end;
            let index = dk::LogicalIndex::range(
                (run.start * per_position) as u64,
                run.len() * per_position,
            );
            (local, index)
        })
        .collect())
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
    let masks = RowMasks::of(cx, &x, sharding, p, cx.dropout_stream(site))?;
    let y = masks.apply(&[&x], |x, mask| {
        backend::of(&x[0]).dropout(&x[0], mask, DType::F32, false)
    })?;
    Ok((y, DropoutSaved { mask: Some(masks) }))
}

/// Gradient of [`dropout`]: the same mask applied to `dy`.
pub fn dropout_backward(_cx: &Cx, _site: Site, saved: DropoutSaved, dy: &Tensor) -> Result<Tensor> {
    masked_gradient(saved, dy, DType::F32)
}

/// [`dropout_backward`] written in `dtype` (f32, or on a GPU bf16: rounded once, as a
/// conversion of the f32 gradient would round it).
fn masked_gradient(saved: DropoutSaved, dy: &Tensor, dtype: DType) -> Result<Tensor> {
    let Some(masks) = saved.mask else {
        return Ok(dy.clone());
    };
    let dy = dy.to_f32_contiguous()?;
    masks.apply(&[&dy], |dy, mask| {
        backend::of(&dy[0]).dropout(&dy[0], mask, dtype, true)
    })
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
    let masks = RowMasks::of(cx, &x, sharding, p, cx.dropout_stream(site))?;
    let y = masks.apply(&[&residual, &x], |t, mask| {
        backend::of_any(&[&t[1], &t[0]]).dropout_add(&t[0], &t[1], mask)
    })?;
    Ok((y, DropoutSaved { mask: Some(masks) }))
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
    let vocab = logits.last_dim();
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
    let (losses, logsumexp, targets) =
        backend::of(&logits).cross_entropy(&logits, &targets, rows, vocab)?;
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
    let vocab = saved.logits.last_dim();
    let rows = saved.targets.numel();
    let dloss = dloss.to_f32_contiguous()?;
    backend::of(&saved.logits).cross_entropy_backward(
        &saved.logits,
        &saved.targets,
        &saved.logsumexp,
        &dloss,
        rows,
        vocab,
    )
}
