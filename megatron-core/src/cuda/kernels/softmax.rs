//! Scaled, optionally causal softmax over the last dimension of `[batches, sq, sk]` on the
//! device, as [`crate::kernels::softmax`]: the same causal mask (query `i` sees keys
//! `j ≤ i + sk − sq`), exact zeros where masked, the same −∞/NaN rules and argument checks.
//!
//! Attention's dropout and the bf16 rounding of its products' operands are fused in:
//! [`softmax_dropout_forward`] also writes the dropped probabilities and
//! [`dropout_softmax_backward`] takes their gradient, each in one pass over the scores with the
//! CPU's dropout masks. One block per row (grid-stride beyond 2²⁰ rows): max, Σexp, normalise.

use cudarc::driver::{CudaView, CudaViewMut, LaunchArgs, PushKernelArg};
use half::bf16;

use super::dropout::MaskArgs;
use super::layer_norm::row_threads;
use super::{launch, per_row};
use crate::cuda::{Gpu, Result};
use crate::kernels::dropout::LogicalIndex;
use crate::kernels::softmax::check_buffers;
use crate::rng::DropoutStream;

/// Most blocks of a row launch; the kernels stride over further rows.
const MAX_BLOCKS: usize = 1 << 20;

/// An output of the fused kernels, in f32 or rounded to bf16 (to nearest even).
pub enum Out<'a, 'b> {
    /// Written as f32.
    F32(&'a mut CudaViewMut<'b, f32>),
    /// Rounded to bf16, for bf16 products.
    Bf16(&'a mut CudaViewMut<'b, bf16>),
}

impl<'a> Out<'a, '_> {
    fn len(&self) -> usize {
        match self {
            Out::F32(v) => v.len(),
            Out::Bf16(v) => v.len(),
        }
    }

    /// Pushes the buffer and its `bf16` flag (an `int` after the pointer).
    fn push(self, args: &mut LaunchArgs<'a>, flag: &'a i32) {
        match self {
            Out::F32(v) => args.arg(v),
            Out::Bf16(v) => args.arg(v),
        };
        args.arg(flag);
    }
}

/// The dropout of a fused kernel: drop probability, the stream, and where the
/// `[batches, sq, sk]` buffer's elements sit among the logical tensor's.
pub type Dropout<'a> = (f32, &'a DropoutStream, LogicalIndex);

/// The mask arguments of `dropout` over `n` elements (none: everything kept).
fn mask(kernel: &'static str, dropout: Option<Dropout<'_>>, n: usize) -> Result<MaskArgs> {
    let Some((p, stream, index)) = dropout else {
        return Ok(MaskArgs::keep_all());
    };
    let (args, len) = MaskArgs::new(kernel, p, stream, index)?;
    super::check_len(kernel, "dropout mask", len, n, || {
        format!("logical index {index:?}")
    })?;
    Ok(args)
}

/// The `bf16` flag of an optional output, and its length for the checks.
fn flag_and_len(out: &Option<Out<'_, '_>>) -> (i32, Option<usize>) {
    match out {
        None => (0, None),
        Some(o) => (i32::from(matches!(o, Out::Bf16(_))), Some(o.len())),
    }
}

/// `y = softmax(scale·x)` over the last dimension of `x[batches, sq, sk]`, causally masked if
/// asked, as [`crate::kernels::softmax::softmax_forward`].
#[allow(clippy::too_many_arguments)]
pub fn softmax_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    causal: bool,
    y: &mut CudaViewMut<f32>,
) -> Result<()> {
    softmax_dropout_forward(gpu, x, batches, sq, sk, scale, causal, y, None, None)
}

/// [`softmax_forward`] into `probs` that also writes `dropped`, the probabilities with
/// `dropout` applied (the CPU's mask of element `r·sk + j` for row `r`, key `j`) or, without
/// one, a copy, in f32 or rounded to bf16: attention's forward in one pass over the scores.
#[allow(clippy::too_many_arguments)]
pub fn softmax_dropout_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    causal: bool,
    probs: &mut CudaViewMut<f32>,
    dropped: Option<Out<'_, '_>>,
    dropout: Option<Dropout<'_>>,
) -> Result<()> {
    const K: &str = "softmax_forward";
    let (dropped_bf16, dropped_len) = flag_and_len(&dropped);
    let mut lens = vec![("x", x.len()), ("y", probs.len())];
    lens.extend(dropped_len.map(|n| ("dropped", n)));
    let n = check_buffers(K, batches, sq, sk, scale, &lens)?;
    let mask = mask(K, dropout, n)?;
    if n == 0 {
        return Ok(());
    }
    let rows = batches * sq;
    let f = gpu.kernels().get(K)?;
    let (rows64, sq64, sk64) = (rows as u64, sq as u64, sk as u64);
    let (causal32, null) = (i32::from(causal), 0u64);
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x).arg(probs);
    match dropped {
        Some(out) => out.push(&mut args, &dropped_bf16),
        None => {
            args.arg(&null).arg(&dropped_bf16);
        }
    }
    args.arg(&rows64)
        .arg(&sq64)
        .arg(&sk64)
        .arg(&scale)
        .arg(&causal32);
    mask.push(&mut args);
    launch(K, args, per_row(rows.min(MAX_BLOCKS), row_threads(sk), 0)?)
}

/// Gradient of [`softmax_forward`] from its output, `dx = scale · y ⊙ (dy − Σ_j dy·y)`
/// (overwrites `dx`), as [`crate::kernels::softmax::softmax_backward`].
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward(
    gpu: &Gpu,
    y: &CudaView<f32>,
    dy: &CudaView<f32>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    dx: &mut CudaViewMut<f32>,
) -> Result<()> {
    dropout_softmax_backward(gpu, y, dy, batches, sq, sk, scale, Out::F32(dx), None, None)
}

/// The gradient of [`softmax_dropout_forward`] from the saved probabilities `y` and the
/// gradient `dy` of the dropped ones: `g = mask(dy)`, `dx = scale · y ⊙ (g − Σ_j g·y)`, in f32
/// or rounded to bf16; with `dropped`, also the forward's dropped probabilities again (for the
/// values' gradient), so that nothing between the two products makes another pass.
#[allow(clippy::too_many_arguments)]
pub fn dropout_softmax_backward(
    gpu: &Gpu,
    y: &CudaView<f32>,
    dy: &CudaView<f32>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    dx: Out<'_, '_>,
    dropped: Option<Out<'_, '_>>,
    dropout: Option<Dropout<'_>>,
) -> Result<()> {
    const K: &str = "softmax_backward";
    let dx_bf16 = i32::from(matches!(dx, Out::Bf16(_)));
    let (dropped_bf16, dropped_len) = flag_and_len(&dropped);
    let mut lens = vec![("y", y.len()), ("dy", dy.len()), ("dx", dx.len())];
    lens.extend(dropped_len.map(|n| ("dropped", n)));
    let n = check_buffers(K, batches, sq, sk, scale, &lens)?;
    let mask = mask(K, dropout, n)?;
    if n == 0 {
        return Ok(());
    }
    let rows = batches * sq;
    let f = gpu.kernels().get(K)?;
    let (rows64, sk64, null) = (rows as u64, sk as u64, 0u64);
    let mut args = gpu.stream().launch_builder(f);
    args.arg(y).arg(dy);
    dx.push(&mut args, &dx_bf16);
    match dropped {
        Some(out) => out.push(&mut args, &dropped_bf16),
        None => {
            args.arg(&null).arg(&dropped_bf16);
        }
    }
    args.arg(&rows64).arg(&sk64).arg(&scale);
    mask.push(&mut args);
    launch(K, args, per_row(rows.min(MAX_BLOCKS), row_threads(sk), 0)?)
}
