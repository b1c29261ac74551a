//! Scaled, optionally causal softmax over the last dimension of `[batches, sq, sk]` on the
//! device, as [`crate::kernels::softmax`]: the same causal mask (query `i` sees keys
//! `j ≤ i + sk − sq`), exact zeros where masked, the same −∞/NaN rules and argument checks.
//!
//! Attention's dropout and the bf16 rounding of its products' operands are fused in:
//! [`softmax_dropout_forward`] also writes the dropped probabilities and
//! [`dropout_softmax_backward`] takes their gradient, each in one pass over the scores with the
//! CPU's dropout masks. One block per row (grid-stride beyond 2²⁰ rows): max, Σexp, normalise.

use cudarc::driver::{CudaView, CudaViewMut, LaunchArgs, PushKernelArg};

use super::dropout::MaskArgs;
use super::layer_norm::row_threads;
use super::operand::{In, Out};
use super::{NULL, launch, launch_args, per_row};
use crate::cuda::{Gpu, Result};
use crate::kernels::dropout::LogicalIndex;
use crate::kernels::softmax::{KeyMask, check_buffers};
use crate::rng::DropoutStream;

/// Most blocks of a row launch; the kernels stride over further rows.
const MAX_BLOCKS: usize = 1 << 20;

/// Threads per row: about one float4 each for short rows, at most 4 warps. Long rows take
/// several float4 per thread: on an H100, GPT-1.2B's attention (rows of 2048 keys) ran 20%
/// faster forward and backward with 128 threads per row than with 512 (`megatron bench
/// attention --device cuda`, BENCHMARKS.md).
fn softmax_threads(sk: usize) -> u32 {
    row_threads(sk).min(128)
}

/// The dropout of a fused kernel: drop probability, the stream, and where the
/// `[batches, sq, sk]` buffer's elements sit among the logical tensor's.
pub type Dropout<'a> = (f32, &'a DropoutStream, LogicalIndex);

/// The mask arguments of `dropout` over `n` elements (none: everything kept).
pub(crate) fn mask(
    kernel: &'static str,
    dropout: Option<Dropout<'_>>,
    n: usize,
) -> Result<MaskArgs> {
    let Some((p, stream, index)) = dropout else {
        return Ok(MaskArgs::keep_all());
    };
    let (args, len) = MaskArgs::new(kernel, p, stream, index)?;
    super::check_len(kernel, "dropout mask", len, n, || {
        format!("logical index {index:?}")
    })?;
    Ok(args)
}

/// Pushes an optional output and its flag (a null pointer without one).
fn push_optional<'a>(out: Option<Out<'a, '_>>, args: &mut LaunchArgs<'a>, flag: &'a i32) {
    match out {
        Some(out) => out.push(args, flag),
        None => {
            args.arg(&NULL).arg(flag);
        }
    }
}

/// `y = softmax(scale·x)` over the last dimension of `x[batches, sq, sk]`, masked as `mask`
/// says (a [`KeyMask`], or `true` for causal), as [`crate::kernels::softmax::softmax_forward`].
#[allow(clippy::too_many_arguments)]
pub fn softmax_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    mask: impl Into<KeyMask>,
    y: &mut CudaViewMut<f32>,
) -> Result<()> {
    softmax_dropout_forward(
        gpu,
        In::F32(x),
        batches,
        sq,
        sk,
        scale,
        mask.into(),
        Out::F32(y),
        None,
        None,
    )
}

/// [`softmax_forward`] from f32 or bf16 scores into `probs` that also writes `dropped`, the
/// probabilities with `dropout` applied (the CPU's mask of element `r·sk + j` for row `r`, key
/// `j`) or, without one, a copy, each output in f32 or rounded to bf16: attention's forward in
/// one pass over the scores.
#[allow(clippy::too_many_arguments)]
pub fn softmax_dropout_forward(
    gpu: &Gpu,
    x: In<'_, '_>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    keys: impl Into<KeyMask>,
    probs: Out<'_, '_>,
    dropped: Option<Out<'_, '_>>,
    dropout: Option<Dropout<'_>>,
) -> Result<()> {
    const K: &str = "softmax_forward";
    let mut lens = vec![("x", x.len()), ("y", probs.len())];
    lens.extend(dropped.as_ref().map(|d| ("dropped", d.len())));
    let n = check_buffers(K, batches, sq, sk, scale, &lens)?;
    let mask = mask(K, dropout, n)?;
    if n == 0 {
        return Ok(());
    }
    let rows = batches * sq;
    let flags = [
        x.flag(),
        probs.flag(),
        dropped.as_ref().map_or(0, Out::flag),
    ];
    let (rows64, sq64, sk64) = (rows as u64, sq as u64, sk as u64);
    let (causal32, window64) = key_args(keys.into());
    let mut args = launch_args(gpu, K)?;
    x.push(&mut args, &flags[0]);
    probs.push(&mut args, &flags[1]);
    push_optional(dropped, &mut args, &flags[2]);
    args.arg(&rows64)
        .arg(&sq64)
        .arg(&sk64)
        .arg(&scale)
        .arg(&causal32)
        .arg(&window64);
    mask.push(&mut args);
    launch(
        K,
        args,
        per_row(rows.min(MAX_BLOCKS), softmax_threads(sk), 0)?,
    )
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
    dropout_softmax_backward(
        gpu,
        In::F32(y),
        In::F32(dy),
        batches,
        sq,
        sk,
        scale,
        KeyMask::All,
        Out::F32(dx),
        None,
        None,
    )
}

/// The kernels' `causal` flag and `window` (the keys before a query it sees; u64 max: all).
fn key_args(keys: KeyMask) -> (i32, u64) {
    match keys {
        KeyMask::All => (0, u64::MAX),
        KeyMask::Causal => (1, u64::MAX),
        KeyMask::Window(w) => (1, w as u64),
    }
}

/// The gradient of [`softmax_dropout_forward`] from the saved probabilities `y` and the
/// gradient `dy` of the dropped ones (each f32 or bf16): `g = mask(dy)`,
/// `dx = scale · y ⊙ (g − Σ_j g·y)`, in f32 or rounded to bf16; with `dropped`, also the
/// forward's dropped probabilities again (for the values' gradient), so that nothing between the
/// two products makes another pass. With the forward's causal `keys` (and window), the keys a
/// query does not see are neither read nor masked: they get 0 (their probability is 0).
#[allow(clippy::too_many_arguments)]
pub fn dropout_softmax_backward(
    gpu: &Gpu,
    y: In<'_, '_>,
    dy: In<'_, '_>,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    keys: impl Into<KeyMask>,
    dx: Out<'_, '_>,
    dropped: Option<Out<'_, '_>>,
    dropout: Option<Dropout<'_>>,
) -> Result<()> {
    const K: &str = "softmax_backward";
    let mut lens = vec![("y", y.len()), ("dy", dy.len()), ("dx", dx.len())];
    lens.extend(dropped.as_ref().map(|d| ("dropped", d.len())));
    let n = check_buffers(K, batches, sq, sk, scale, &lens)?;
    let mask = mask(K, dropout, n)?;
    if n == 0 {
        return Ok(());
    }
    let rows = batches * sq;
    let flags = [
        y.flag(),
        dy.flag(),
        dx.flag(),
        dropped.as_ref().map_or(0, Out::flag),
    ];
    let (rows64, sq64, sk64) = (rows as u64, sq as u64, sk as u64);
    let (causal32, window64) = key_args(keys.into());
    let mut args = launch_args(gpu, K)?;
    y.push(&mut args, &flags[0]);
    dy.push(&mut args, &flags[1]);
    dx.push(&mut args, &flags[2]);
    push_optional(dropped, &mut args, &flags[3]);
    args.arg(&rows64)
        .arg(&sq64)
        .arg(&sk64)
        .arg(&scale)
        .arg(&causal32)
        .arg(&window64);
    mask.push(&mut args);
    launch(
        K,
        args,
        per_row(rows.min(MAX_BLOCKS), softmax_threads(sk), 0)?,
    )
}
