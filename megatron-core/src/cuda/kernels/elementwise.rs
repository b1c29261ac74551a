//! GeLU, SwiGLU, add, fill, bias, casts and Σx² on the device.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::operand::{In, Out};
use super::{THREADS, check_len, cover, launch, launch_args, product};
use crate::cuda::{CudaError, Gpu, Result};
use crate::kernels::elementwise::check_swiglu;

/// `y = gelu(x)` (GPT-2's tanh form), as [`crate::kernels::elementwise::gelu_forward`]; `x` and
/// `y` each f32 or bf16 (`y` rounded once).
pub fn gelu_forward(gpu: &Gpu, x: In<'_, '_>, y: Out<'_, '_>) -> Result<()> {
    const K: &str = "gelu_forward";
    let n = x.len();
    check_len(K, "y", y.len(), n, || format!("elements {n}"))?;
    let n64 = n as u64;
    let flags = [x.flag(), y.flag()];
    let mut args = launch_args(gpu, K)?;
    x.push(&mut args, &flags[0]);
    y.push(&mut args, &flags[1]);
    args.arg(&n64);
    launch(K, args, cover(n.div_ceil(4)))
}

/// `dx = dy · gelu'(x)`, each buffer f32 or bf16.
pub fn gelu_backward(gpu: &Gpu, x: In<'_, '_>, dy: In<'_, '_>, dx: Out<'_, '_>) -> Result<()> {
    const K: &str = "gelu_backward";
    let n = x.len();
    check_len(K, "dy", dy.len(), n, || format!("elements {n}"))?;
    check_len(K, "dx", dx.len(), n, || format!("elements {n}"))?;
    let n64 = n as u64;
    let flags = [x.flag(), dy.flag(), dx.flag()];
    let mut args = launch_args(gpu, K)?;
    x.push(&mut args, &flags[0]);
    dy.push(&mut args, &flags[1]);
    dx.push(&mut args, &flags[2]);
    args.arg(&n64);
    launch(K, args, cover(n.div_ceil(4)))
}

/// `y = silu(gate)·up` of each row of `x[rows, 2·ffn]` (gate, then up), as
/// [`crate::kernels::elementwise::swiglu_forward`]; `x` and `y` each f32 or bf16.
pub fn swiglu_forward(gpu: &Gpu, x: In<'_, '_>, ffn: usize, y: Out<'_, '_>) -> Result<()> {
    const K: &str = "swiglu_forward";
    let rows = check_swiglu(K, x.len(), ffn, &[("y", y.len(), ffn)]).map_err(CudaError::from)?;
    let (rows64, ffn64) = (rows as u64, ffn as u64);
    let flags = [x.flag(), y.flag()];
    let mut args = launch_args(gpu, K)?;
    x.push(&mut args, &flags[0]);
    y.push(&mut args, &flags[1]);
    args.arg(&rows64).arg(&ffn64);
    launch(K, args, cover(rows * ffn))
}

/// Gradient of [`swiglu_forward`]: `dx[rows, 2·ffn]` from `dy[rows, ffn]` and the kept `x`,
/// each buffer f32 or bf16.
pub fn swiglu_backward(
    gpu: &Gpu,
    x: In<'_, '_>,
    dy: In<'_, '_>,
    ffn: usize,
    dx: Out<'_, '_>,
) -> Result<()> {
    const K: &str = "swiglu_backward";
    let others = [("dy", dy.len(), ffn), ("dx", dx.len(), 2 * ffn)];
    let rows = check_swiglu(K, x.len(), ffn, &others).map_err(CudaError::from)?;
    let (rows64, ffn64) = (rows as u64, ffn as u64);
    let flags = [x.flag(), dy.flag(), dx.flag()];
    let mut args = launch_args(gpu, K)?;
    x.push(&mut args, &flags[0]);
    dy.push(&mut args, &flags[1]);
    dx.push(&mut args, &flags[2]);
    args.arg(&rows64).arg(&ffn64);
    launch(K, args, cover(rows * ffn))
}

/// `out = a + b`.
pub fn add(
    gpu: &Gpu,
    a: &CudaView<f32>,
    b: &CudaView<f32>,
    out: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "add";
    let n = a.len();
    check_len(K, "b", b.len(), n, || format!("elements {n}"))?;
    check_len(K, "out", out.len(), n, || format!("elements {n}"))?;
    let n64 = n as u64;
    let mut args = launch_args(gpu, K)?;
    args.arg(a).arg(b).arg(out).arg(&n64);
    launch(K, args, cover(n.div_ceil(4)))
}

/// `acc += x`.
pub fn add_assign(gpu: &Gpu, acc: &mut CudaViewMut<f32>, x: &CudaView<f32>) -> Result<()> {
    const K: &str = "add_assign";
    let n = acc.len();
    check_len(K, "x", x.len(), n, || format!("elements {n}"))?;
    let n64 = n as u64;
    let mut args = launch_args(gpu, K)?;
    args.arg(acc).arg(x).arg(&n64);
    launch(K, args, cover(n))
}

/// `x = value` everywhere.
pub fn fill(gpu: &Gpu, x: &mut CudaViewMut<f32>, value: f32) -> Result<()> {
    const K: &str = "fill";
    let n = x.len();
    let n64 = n as u64;
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(&value).arg(&n64);
    launch(K, args, cover(n))
}

/// The grid of the bias kernels: columns (four per thread) along x, rows along y; both kernels
/// stride over what the grid does not cover.
fn bias_grid(rows: usize, cols: usize) -> LaunchConfig {
    let blocks_x = cols
        .div_ceil(4)
        .div_ceil(THREADS as usize)
        .clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks_x, rows.clamp(1, 65_535) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks the bias kernels' lengths: `rows × cols` elements and a bias of `cols`.
fn check_bias(k: &'static str, len: usize, bias: usize, rows: usize, cols: usize) -> Result<()> {
    let n = product(k, &[rows, cols])?;
    check_len(k, "x", len, n, || format!("rows {rows} × cols {cols}"))?;
    check_len(k, "bias", bias, cols, || format!("cols {cols}"))
}

/// `x[r, c] += bias[c]` for a row-major `[rows, cols]` matrix.
pub fn bias_add_forward(
    gpu: &Gpu,
    x: &mut CudaViewMut<f32>,
    bias: &CudaView<f32>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const K: &str = "bias_add_forward";
    check_bias(K, x.len(), bias.len(), rows, cols)?;
    let (rows64, cols64) = (rows as u64, cols as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(bias).arg(&rows64).arg(&cols64);
    launch(K, args, bias_grid(rows, cols))
}

/// `y[r, c] = x[r, c] + bias[c]` for a row-major `[rows, cols]` matrix, `y` f32 or bf16 (the
/// f32 sum rounded once: a biased product handed to the next products in their dtype).
pub fn bias_add_cast(
    gpu: &Gpu,
    x: &CudaView<f32>,
    bias: &CudaView<f32>,
    y: Out<'_, '_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const K: &str = "bias_add_cast";
    check_bias(K, x.len(), bias.len(), rows, cols)?;
    check_len(K, "y", y.len(), x.len(), || {
        format!("rows {rows} × cols {cols}")
    })?;
    let (rows64, cols64) = (rows as u64, cols as u64);
    let flag = y.flag();
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(bias);
    y.push(&mut args, &flag);
    args.arg(&rows64).arg(&cols64);
    launch(K, args, bias_grid(rows, cols))
}

/// `dbias[c] += Σ_r dy[r, c]` (rows added in order in f64), as the CPU kernel.
pub fn bias_add_backward(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    rows: usize,
    cols: usize,
    dbias: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "bias_add_backward";
    let n = product(K, &[rows, cols])?;
    check_len(K, "dy", dy.len(), n, || {
        format!("rows {rows} × cols {cols}")
    })?;
    check_len(K, "dbias", dbias.len(), cols, || format!("cols {cols}"))?;
    let (rows64, cols64) = (rows as u64, cols as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(dy).arg(dbias).arg(&rows64).arg(&cols64);
    launch(K, args, cover(cols))
}

/// `y = x` rounded to bf16 (nearest even, as `half::bf16::from_f32`).
pub fn f32_to_bf16(gpu: &Gpu, x: &CudaView<f32>, y: &mut CudaViewMut<bf16>) -> Result<()> {
    const K: &str = "f32_to_bf16";
    let n = x.len();
    check_len(K, "y", y.len(), n, || format!("elements {n}"))?;
    let n64 = n as u64;
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(y).arg(&n64);
    launch(K, args, cover(n))
}

/// `y = x` widened to f32.
pub fn bf16_to_f32(gpu: &Gpu, x: &CudaView<bf16>, y: &mut CudaViewMut<f32>) -> Result<()> {
    const K: &str = "bf16_to_f32";
    let n = x.len();
    check_len(K, "y", y.len(), n, || format!("elements {n}"))?;
    let n64 = n as u64;
    let mut args = launch_args(gpu, K)?;
    args.arg(x).arg(y).arg(&n64);
    launch(K, args, cover(n))
}

/// Elements per partial of [`sum_of_squares`], as the CPU's fixed blocks.
const SQUARES_BLOCK: usize = 1 << 16;

/// Σx² in f64 over fixed blocks added in order on the host (gradient norms).
pub fn sum_of_squares(gpu: &Gpu, x: &CudaView<f32>) -> Result<f64> {
    sum_of_squares_of(gpu, std::slice::from_ref(x))
}

/// Σx² over every part, each part's fixed blocks added in order, then the parts in order: the
/// sum of [`sum_of_squares`] of each part, with one read back (one wait for the stream) for all
/// of them.
pub fn sum_of_squares_of(gpu: &Gpu, parts: &[CudaView<f32>]) -> Result<f64> {
    const K: &str = "sum_squares_partials";
    let blocks: Vec<usize> = parts
        .iter()
        .map(|x| x.len().div_ceil(SQUARES_BLOCK).max(1))
        .collect();
    let mut partials = gpu.zeros::<f64>(blocks.iter().sum::<usize>().max(1))?;
    let block_len = SQUARES_BLOCK as u64;
    let mut start = 0;
    for (x, &n_blocks) in parts.iter().zip(&blocks) {
        let n64 = x.len() as u64;
        let mut out = partials.slice_mut(start..start + n_blocks);
        let mut args = launch_args(gpu, K)?;
        args.arg(x).arg(&n64).arg(&block_len).arg(&mut out);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (n_blocks as u32, 1, 1),
            block_dim: (THREADS * 2, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(K, args, cfg)?;
        start += n_blocks;
    }
    let host = gpu.download(&partials)?;
    let mut sum = 0.0;
    let mut start = 0;
    for n_blocks in blocks {
        sum += host[start..start + n_blocks].iter().sum::<f64>();
        start += n_blocks;
    }
    Ok(sum)
}

/// Multiplies every part by `scale` (the loss scale's inverse) in place; returns whether an
/// element is then infinite or NaN, with one read back for all parts (Megatron-LM's unscale of
/// the main gradients and its check).
pub fn unscale_and_check(gpu: &Gpu, parts: &mut [CudaViewMut<f32>], scale: f32) -> Result<bool> {
    const K: &str = "unscale_and_check";
    let mut found = gpu.zeros::<f32>(1)?;
    for x in parts.iter_mut() {
        let n = x.len();
        if n == 0 {
            continue;
        }
        let n64 = n as u64;
        let mut args = launch_args(gpu, K)?;
        args.arg(x).arg(&n64).arg(&scale).arg(&mut found);
        launch(K, args, cover(n))?;
    }
    Ok(gpu.download(&found)?[0] != 0.0)
}
