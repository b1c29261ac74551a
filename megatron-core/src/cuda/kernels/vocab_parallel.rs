//! The vocab-parallel layers' kernels (`cu/vocab_parallel.cu`): the pieces of the fused
//! vocab-parallel cross-entropy that run between its all-reduces and its backward, as
//! [`crate::tensor_parallel::vocab_parallel_cross_entropy`] computes them on the host; the tied
//! output layer's −∞ mask of the padding rows; the position embedding's position ids.
//!
//! A rank holds the logits of vocabulary entries `start .. start + local` as `logits[rows,
//! local]`. Nothing is read back: targets are not validated here (a target the slice does not hold
//! contributes nothing to it, and [`cross_entropy_finish`] gives a NaN loss for a target outside
//! the whole vocabulary).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::operand::Out;
use super::{check_len, cover, launch, launch_args, per_row, product};
use crate::cuda::{Gpu, Result};

/// Most threads per row.
const MAX_ROW_THREADS: usize = 512;

/// Most blocks of a row launch; the kernels stride over further rows.
const MAX_BLOCKS: usize = 1 << 20;

/// One block per row (up to [`MAX_BLOCKS`]), with threads for the row's `local` entries.
fn row_launch(rows: usize, local: usize) -> Result<LaunchConfig> {
    let threads = local.next_multiple_of(32).clamp(32, MAX_ROW_THREADS);
    per_row(rows.min(MAX_BLOCKS), threads as u32, 0)
}

/// Before the max all-reduce: each row's maximum `max[rows]`, and the logit of its target
/// `target_logit[rows]` where this slice holds the target (0 elsewhere).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_local(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    targets: &CudaView<i64>,
    rows: usize,
    local: usize,
    start: usize,
    max: &mut CudaViewMut<f32>,
    target_logit: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "vocab_parallel_ce_local";
    let dims = || format!("rows {rows} × local vocabulary {local} from {start}");
    check_len(K, "logits", logits.len(), product(K, &[rows, local])?, dims)?;
    check_len(K, "targets", targets.len(), rows, dims)?;
    check_len(K, "max", max.len(), rows, dims)?;
    check_len(K, "target_logit", target_logit.len(), rows, dims)?;
    if rows == 0 {
        return Ok(());
    }
    let (rows64, local64, start64) = (rows as u64, local as u64, start as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(logits).arg(targets);
    args.arg(&rows64).arg(&local64).arg(&start64);
    args.arg(max).arg(target_logit);
    launch(K, args, row_launch(rows, local)?)
}

/// Between the max and the sum all-reduces: `sum[r] = Σ exp(logits[r] − max[r])` over the slice
/// (f32 exponentials, f64 sum).
pub fn cross_entropy_sum_exp(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    max: &CudaView<f32>,
    rows: usize,
    local: usize,
    sum: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "vocab_parallel_ce_sum_exp";
    let dims = || format!("rows {rows} × local vocabulary {local}");
    check_len(K, "logits", logits.len(), product(K, &[rows, local])?, dims)?;
    check_len(K, "max", max.len(), rows, dims)?;
    check_len(K, "sum", sum.len(), rows, dims)?;
    if rows == 0 {
        return Ok(());
    }
    let (rows64, local64) = (rows as u64, local as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(logits)
        .arg(max)
        .arg(&rows64)
        .arg(&local64)
        .arg(sum);
    launch(K, args, row_launch(rows, local)?)
}

/// After the all-reduces: `logsumexp = max + ln(sum)` and `losses = logsumexp − target_logit`
/// per row; a NaN loss where the target is outside `[0, total)`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_finish(
    gpu: &Gpu,
    max: &CudaView<f32>,
    sum: &CudaView<f32>,
    target_logit: &CudaView<f32>,
    targets: &CudaView<i64>,
    total: usize,
    losses: &mut CudaViewMut<f32>,
    logsumexp: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "vocab_parallel_ce_finish";
    let rows = targets.len();
    let dims = || format!("rows {rows}, vocabulary {total}");
    check_len(K, "max", max.len(), rows, dims)?;
    check_len(K, "sum", sum.len(), rows, dims)?;
    check_len(K, "target_logit", target_logit.len(), rows, dims)?;
    check_len(K, "losses", losses.len(), rows, dims)?;
    check_len(K, "logsumexp", logsumexp.len(), rows, dims)?;
    if rows == 0 {
        return Ok(());
    }
    let (rows64, total64) = (rows as u64, total as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(max).arg(sum).arg(target_logit).arg(targets);
    args.arg(&rows64).arg(&total64);
    args.arg(losses).arg(logsumexp);
    launch(K, args, cover(rows))
}

/// The gradient of this slice's logits: `dlogits[r] = exp(logits[r] − logsumexp[r])·dloss[r]`,
/// minus `dloss[r]` at the target where this slice holds it (overwrites `dlogits`, f32 or rounded
/// to bf16).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward(
    gpu: &Gpu,
    logits: &CudaView<f32>,
    targets: &CudaView<i64>,
    logsumexp: &CudaView<f32>,
    dloss: &CudaView<f32>,
    local: usize,
    start: usize,
    dlogits: Out<'_, '_>,
) -> Result<()> {
    const K: &str = "vocab_parallel_ce_backward";
    let rows = targets.len();
    let n = product(K, &[rows, local])?;
    let dims = || format!("rows {rows} × local vocabulary {local} from {start}");
    check_len(K, "logits", logits.len(), n, dims)?;
    check_len(K, "logsumexp", logsumexp.len(), rows, dims)?;
    check_len(K, "dloss", dloss.len(), rows, dims)?;
    check_len(K, "dlogits", dlogits.len(), n, dims)?;
    if n == 0 {
        return Ok(());
    }
    let (rows64, local64, start64) = (rows as u64, local as u64, start as u64);
    let flag = dlogits.flag();
    let mut args = launch_args(gpu, K)?;
    args.arg(logits).arg(targets).arg(logsumexp).arg(dloss);
    args.arg(&rows64).arg(&local64).arg(&start64);
    dlogits.push(&mut args, &flag);
    launch(K, args, row_launch(rows, local)?)
}

/// Sets the columns `from..cols` of every row of `x[rows, cols]` to −∞ (the padding rows of the
/// vocabulary in the tied output layer's logits).
pub fn mask_columns(
    gpu: &Gpu,
    x: &mut CudaViewMut<f32>,
    rows: usize,
    cols: usize,
    from: usize,
) -> Result<()> {
    const K: &str = "vocab_parallel_mask_columns";
    let dims = || format!("rows {rows} × cols {cols}, masked from column {from}");
    check_len(K, "x", x.len(), product(K, &[rows, cols])?, dims)?;
    if from >= cols || rows == 0 {
        return Ok(());
    }
    let (rows64, cols64, from64) = (rows as u64, cols as u64, from as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(&rows64).arg(&cols64).arg(&from64);
    launch(K, args, cover(rows * (cols - from)))
}

/// `ids[t] = t / batch`: the positions of the tokens of a sequence-first `[seq, batch]` layout.
pub fn position_ids(gpu: &Gpu, ids: &mut CudaViewMut<i64>, batch: usize) -> Result<()> {
    const K: &str = "position_ids";
    let n = ids.len();
    if n == 0 {
        return Ok(());
    }
    let (n64, batch64) = (n as u64, batch.max(1) as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(ids).arg(&n64).arg(&batch64);
    launch(K, args, cover(n))
}
