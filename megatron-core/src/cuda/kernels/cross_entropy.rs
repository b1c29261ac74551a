//! Softmax cross-entropy over the rows of `logits[rows, vocab]` on the device, as
//! [`crate::kernels::cross_entropy`]: one block per row, float4 loads where the row allows.
//!
//! Targets outside `[0, vocab)` are an error, as on the CPU, with the CPU's message naming the
//! first such row. The targets live on the device, so a small kernel checks them first and
//! records the first bad row in a flag the compute kernel reads (it then leaves the outputs
//! untouched, as the CPU does); the launcher reads the flag back, which waits for the stream.
//! The forward keeps a running maximum and rescaled f64 sum per thread, so it reads the logits
//! once (the CPU reads them twice); results agree with the CPU's to f32 rounding.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{check_len, cover, launch, launch_args, per_row, product};
use crate::cuda::{CudaError, Gpu, Result};
use crate::kernels::KernelError;

/// Most threads per row; rows narrower than that get fewer (a multiple of 32).
const MAX_ROW_THREADS: usize = 512;

/// The "no bad row" value of the target flag.
const NO_BAD_ROW: u64 = u64::MAX;

/// One block per row, with threads for the row's float4s (32 to [`MAX_ROW_THREADS`]).
fn row_launch(rows: usize, vocab: usize) -> Result<LaunchConfig> {
    let threads = vocab
        .div_ceil(4)
        .next_multiple_of(32)
        .clamp(32, MAX_ROW_THREADS);
    per_row(rows, threads as u32, 0)
}

/// Queues the target check of `rows` targets against `vocab`; returns the flag it writes.
fn check_targets(
    gpu: &Gpu,
    targets: &CudaView<i64>,
    rows: usize,
    vocab: usize,
) -> Result<CudaSlice<u64>> {
    const K: &str = "cross_entropy_check_targets";
    let mut flag = gpu.upload(&[NO_BAD_ROW])?;
    let (rows64, vocab64) = (rows as u64, vocab as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(targets).arg(&rows64).arg(&vocab64).arg(&mut flag);
    launch(K, args, cover(rows))?;
    Ok(flag)
}

/// Reads the flag back (waiting for the stream): the CPU's error for the first bad target, if any.
fn report_targets(
    gpu: &Gpu,
    kernel: &'static str,
    flag: &CudaSlice<u64>,
    targets: &CudaView<i64>,
    vocab: usize,
) -> Result<()> {
    let bad = gpu.download(flag)?[0];
    if bad == NO_BAD_ROW {
        return Ok(());
    }
    let r = bad as usize;
    let t = gpu
        .stream()
        .clone_dtoh(&targets.slice(r..r + 1))
        .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync(1 target)", e))?[0];
    Err(KernelError::Invalid {
        kernel,
        message: format!("row {r}: target {t} is outside the vocabulary [0, {vocab})"),
    }
    .into())
}

/// Per-row loss `logsumexp(logits[r]) − logits[r, targets[r]]`, saving `logsumexp[rows]`, as
/// [`crate::kernels::cross_entropy::cross_entropy_forward`] (reads a flag back: waits for the
/// stream).
pub fn cross_entropy_forward(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    targets: &CudaView<i64>,
    rows: usize,
    vocab: usize,
    losses: &mut CudaViewMut<f32>,
    logsumexp: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "cross_entropy_forward";
    let n = product(K, &[rows, vocab])?;
    let dims = || format!("rows {rows} × vocab {vocab}");
    check_len(K, "logits", logits.len(), n, dims)?;
    check_len(K, "targets", targets.len(), rows, dims)?;
    check_len(K, "losses", losses.len(), rows, dims)?;
    check_len(K, "logsumexp", logsumexp.len(), rows, dims)?;
    if rows == 0 {
        return Ok(());
    }
    let flag = check_targets(gpu, targets, rows, vocab)?;
    if vocab > 0 {
        let vocab64 = vocab as u64;
        let mut args = launch_args(gpu, K)?;
        args.arg(logits).arg(targets).arg(&flag).arg(&vocab64);
        args.arg(losses).arg(logsumexp);
        launch(K, args, row_launch(rows, vocab)?)?;
    }
    report_targets(gpu, K, &flag, targets, vocab)
}

/// Gradient of [`cross_entropy_forward`]: `dlogits[r] = (softmax(logits[r]) −
/// onehot(targets[r]))·dloss[r]` (overwrites), as
/// [`crate::kernels::cross_entropy::cross_entropy_backward`] (reads a flag back: waits for the
/// stream).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    targets: &CudaView<i64>,
    logsumexp: &CudaView<f32>,
    dloss: &CudaView<f32>,
    rows: usize,
    vocab: usize,
    dlogits: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "cross_entropy_backward";
    let n = product(K, &[rows, vocab])?;
    let dims = || format!("rows {rows} × vocab {vocab}");
    check_len(K, "logits", logits.len(), n, dims)?;
    check_len(K, "targets", targets.len(), rows, dims)?;
    check_len(K, "logsumexp", logsumexp.len(), rows, dims)?;
    check_len(K, "dloss", dloss.len(), rows, dims)?;
    check_len(K, "dlogits", dlogits.len(), n, dims)?;
    if rows == 0 {
        return Ok(());
    }
    let flag = check_targets(gpu, targets, rows, vocab)?;
    if vocab > 0 {
        let vocab64 = vocab as u64;
        let mut args = launch_args(gpu, K)?;
        args.arg(logits).arg(targets).arg(logsumexp).arg(dloss);
        args.arg(&flag).arg(&vocab64).arg(dlogits);
        launch(K, args, row_launch(rows, vocab)?)?;
    }
    report_targets(gpu, K, &flag, targets, vocab)
}
