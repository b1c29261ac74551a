//! Scaled, optionally causal softmax over the last dimension of `[batches, sq, sk]` on the
//! device, as [`crate::kernels::softmax`]: the same causal mask (query `i` sees keys
//! `j ≤ i + sk − sq`), exact zeros where masked, the same −∞/NaN rules and argument checks.
//!
//! One block per row (grid-stride beyond 2²⁰ rows): max, Σexp, normalise.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::layer_norm::row_threads;
use super::{launch, per_row};
use crate::cuda::{Gpu, Result};
use crate::kernels::softmax::check_buffers;

/// Most blocks of a row launch; the kernels stride over further rows.
const MAX_BLOCKS: usize = 1 << 20;

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
    const K: &str = "softmax_forward";
    let n = check_buffers(K, batches, sq, sk, scale, &[("x", x.len()), ("y", y.len())])?;
    if n == 0 {
        return Ok(());
    }
    let rows = batches * sq;
    let f = gpu.kernels().get(K)?;
    let (rows64, sq64, sk64) = (rows as u64, sq as u64, sk as u64);
    let causal32 = i32::from(causal);
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x)
        .arg(y)
        .arg(&rows64)
        .arg(&sq64)
        .arg(&sk64)
        .arg(&scale)
        .arg(&causal32);
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
    const K: &str = "softmax_backward";
    let n = check_buffers(
        K,
        batches,
        sq,
        sk,
        scale,
        &[("y", y.len()), ("dy", dy.len()), ("dx", dx.len())],
    )?;
    if n == 0 {
        return Ok(());
    }
    let rows = batches * sq;
    let f = gpu.kernels().get(K)?;
    let (rows64, sk64) = (rows as u64, sk as u64);
    let mut args = gpu.stream().launch_builder(f);
    args.arg(y)
        .arg(dy)
        .arg(dx)
        .arg(&rows64)
        .arg(&sk64)
        .arg(&scale);
    launch(K, args, per_row(rows.min(MAX_BLOCKS), row_threads(sk), 0)?)
}
