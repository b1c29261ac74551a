//! Layer normalisation on the device, as [`crate::kernels::layer_norm`]: the same two-pass
//! statistics, saved `mean`/`rstd`, gradient formulas and argument checks.
//!
//! The row kernels run one block per row; `dgamma`/`dbeta` are f64 partial column sums over
//! fixed chunks of rows, added in order by a second kernel (deterministic, no atomics).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::operand::Out;
use super::{check_len, cover, launch, launch_args, per_row};
use crate::cuda::{CudaError, Gpu, Result};
use crate::kernels::layer_norm::{check_backward, check_forward};

/// Most threads of a row block (the kernels' `__launch_bounds__`).
const MAX_THREADS: usize = 512;
/// Most blocks of a row launch; the kernels stride over further rows.
const MAX_BLOCKS: usize = 1 << 20;
/// Columns × row lanes of a partial column-sum block (`LN_COLS`, `LN_ROW_LANES` in the source).
const COLS: u32 = 32;
const ROW_LANES: u32 = 8;
/// Most chunks of rows of the partial sums, and fewest rows per chunk.
const MAX_CHUNKS: usize = 64;
const MIN_CHUNK_ROWS: usize = 32;

/// Threads for a row of `len` floats: about one float4 each, whole warps, at most 512.
pub(crate) fn row_threads(len: usize) -> u32 {
    (len.div_ceil(4).div_ceil(32) * 32).clamp(32, MAX_THREADS) as u32
}

/// `y = (x − mean)·rstd·gamma + beta` per row of `x[rows, hidden]`, saving `mean[rows]` and
/// `rstd[rows]`, as [`crate::kernels::layer_norm::layer_norm_forward`]; `y` f32 or bf16 (rounded
/// once, for bf16 products).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    gamma: &CudaView<f32>,
    beta: &CudaView<f32>,
    rows: usize,
    hidden: usize,
    eps: f32,
    y: Out<'_, '_>,
    mean: &mut CudaViewMut<f32>,
    rstd: &mut CudaViewMut<f32>,
) -> Result<()> {
    norm_forward(gpu, x, gamma, Some(beta), rows, hidden, eps, y, mean, rstd)
}

/// RMSNorm, `y = x·rstd·gamma` per row with `rstd = 1/√(mean(x²) + eps)`, as
/// [`crate::kernels::layer_norm::rms_norm_forward`] (`mean` written 0).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    gamma: &CudaView<f32>,
    rows: usize,
    hidden: usize,
    eps: f32,
    y: Out<'_, '_>,
    mean: &mut CudaViewMut<f32>,
    rstd: &mut CudaViewMut<f32>,
) -> Result<()> {
    norm_forward(gpu, x, gamma, None, rows, hidden, eps, y, mean, rstd)
}

/// A layer norm's forward, or without `beta` an RMSNorm's.
#[allow(clippy::too_many_arguments)]
fn norm_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    gamma: &CudaView<f32>,
    beta: Option<&CudaView<f32>>,
    rows: usize,
    hidden: usize,
    eps: f32,
    y: Out<'_, '_>,
    mean: &mut CudaViewMut<f32>,
    rstd: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "layer_norm_forward";
    check_forward(
        rows,
        hidden,
        eps,
        [
            x.len(),
            gamma.len(),
            beta.map_or(hidden, |b| b.len()),
            y.len(),
            mean.len(),
            rstd.len(),
        ],
    )?;
    if rows == 0 {
        return Ok(());
    }
    let (rows64, hidden64) = (rows as u64, hidden as u64);
    let flag = y.flag();
    let null: u64 = 0;
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(gamma);
    match beta {
        Some(b) => args.arg(b),
        None => args.arg(&null),
    };
    y.push(&mut args, &flag);
    args.arg(mean)
        .arg(rstd)
        .arg(&rows64)
        .arg(&hidden64)
        .arg(&eps);
    launch(
        K,
        args,
        per_row(rows.min(MAX_BLOCKS), row_threads(hidden), 0)?,
    )
}

/// Gradients of [`layer_norm_forward`]: overwrites `dx[rows, hidden]`, accumulates `dgamma` and
/// `dbeta` (`+=`), as [`crate::kernels::layer_norm::layer_norm_backward`].
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    x: &CudaView<f32>,
    mean: &CudaView<f32>,
    rstd: &CudaView<f32>,
    gamma: &CudaView<f32>,
    rows: usize,
    hidden: usize,
    dx: &mut CudaViewMut<f32>,
    dgamma: &mut CudaViewMut<f32>,
    dbeta: &mut CudaViewMut<f32>,
) -> Result<()> {
    let saved = (x, mean, rstd, gamma);
    layer_norm_backward_plus(gpu, dy, saved, rows, hidden, None, dx, dgamma, dbeta)
}

/// The forward's kept `(x, mean, rstd, gamma)`.
pub type NormKept<'a, 'b> = (
    &'a CudaView<'b, f32>,
    &'a CudaView<'b, f32>,
    &'a CudaView<'b, f32>,
    &'a CudaView<'b, f32>,
);

/// [`layer_norm_backward`] with `plus`, another gradient of the same input, added to `dx` in
/// the same pass, as [`crate::kernels::layer_norm::layer_norm_backward_plus`].
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_plus(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    kept: NormKept<'_, '_>,
    rows: usize,
    hidden: usize,
    plus: Option<&CudaView<f32>>,
    dx: &mut CudaViewMut<f32>,
    dgamma: &mut CudaViewMut<f32>,
    dbeta: &mut CudaViewMut<f32>,
) -> Result<()> {
    norm_backward_plus(gpu, dy, kept, rows, hidden, plus, dx, dgamma, Some(dbeta))
}

/// Gradients of [`rms_norm_forward`], with `plus` as [`layer_norm_backward_plus`], as
/// [`crate::kernels::layer_norm::rms_norm_backward_plus`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward_plus(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    kept: NormKept<'_, '_>,
    rows: usize,
    hidden: usize,
    plus: Option<&CudaView<f32>>,
    dx: &mut CudaViewMut<f32>,
    dgamma: &mut CudaViewMut<f32>,
) -> Result<()> {
    norm_backward_plus(gpu, dy, kept, rows, hidden, plus, dx, dgamma, None)
}

/// A layer norm's backward, or without `dbeta` an RMSNorm's.
#[allow(clippy::too_many_arguments)]
fn norm_backward_plus(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    (x, mean, rstd, gamma): NormKept<'_, '_>,
    rows: usize,
    hidden: usize,
    plus: Option<&CudaView<f32>>,
    dx: &mut CudaViewMut<f32>,
    dgamma: &mut CudaViewMut<f32>,
    dbeta: Option<&mut CudaViewMut<f32>>,
) -> Result<()> {
    const K: &str = "layer_norm_backward";
    let n = check_backward(
        rows,
        hidden,
        [
            dy.len(),
            x.len(),
            mean.len(),
            rstd.len(),
            gamma.len(),
            dx.len(),
            dgamma.len(),
            dbeta.as_ref().map_or(hidden, |b| b.len()),
        ],
    )?;
    if let Some(p) = plus {
        let dims = || format!("rows {rows} × hidden {hidden}");
        check_len(K, "plus", p.len(), n, dims)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let (rows64, hidden64) = (rows as u64, hidden as u64);
    let centered = i32::from(dbeta.is_some());

    // dx: one block per row.
    const DX: &str = "layer_norm_backward_dx";
    let mut args = launch_args(gpu, DX)?;
    args.arg(dy).arg(x).arg(mean).arg(rstd).arg(gamma);
    let null: u64 = 0;
    match plus {
        Some(p) => args.arg(p),
        None => args.arg(&null),
    };
    args.arg(dx).arg(&rows64).arg(&hidden64).arg(&centered);
    launch(
        DX,
        args,
        per_row(rows.min(MAX_BLOCKS), row_threads(hidden), 0)?,
    )?;

    // dgamma, dbeta: f64 partial column sums per chunk of rows, then the chunks in order.
    let rows_per_chunk = rows.div_ceil(MAX_CHUNKS).max(MIN_CHUNK_ROWS);
    let chunks = rows.div_ceil(rows_per_chunk);
    let tiles = u32::try_from(hidden.div_ceil(COLS as usize)).map_err(|_| CudaError::Driver {
        call: format!("launching {K}"),
        message: format!("hidden {hidden} exceeds one grid dimension"),
    })?;
    let mut partials = gpu.zeros::<f64>(2 * chunks * hidden)?;
    const PARTIALS: &str = "layer_norm_backward_partials";
    let chunk_rows64 = rows_per_chunk as u64;
    let mut args = launch_args(gpu, PARTIALS)?;
    args.arg(dy)
        .arg(x)
        .arg(mean)
        .arg(rstd)
        .arg(&mut partials)
        .arg(&rows64)
        .arg(&hidden64)
        .arg(&chunk_rows64);
    let cfg = LaunchConfig {
        // chunks ≤ MAX_CHUNKS, so it fits the grid's y dimension.
        grid_dim: (tiles, chunks as u32, 1),
        block_dim: (COLS, ROW_LANES, 1),
        shared_mem_bytes: 0,
    };
    launch(PARTIALS, args, cfg)?;

    const FINALIZE: &str = "layer_norm_backward_finalize";
    let chunks64 = chunks as u64;
    let mut args = launch_args(gpu, FINALIZE)?;
    args.arg(&partials).arg(dgamma);
    match dbeta {
        Some(b) => args.arg(b),
        None => args.arg(&null),
    };
    args.arg(&chunks64).arg(&hidden64);
    launch(FINALIZE, args, cover(hidden))
}
