//! Dropout on the device with the CPU's masks: the same Philox words for the same (seed,
//! stream, logical index), so a GPU run drops exactly the elements a CPU run drops.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, cover, launch};
use crate::cuda::{Gpu, Result};
use crate::kernels::dropout::{LogicalIndex, keep_scale, keep_threshold};
use crate::rng::DropoutStream;

/// Queues `dropout_apply` on one or two buffers.
fn apply(
    gpu: &Gpu,
    kernel: &'static str,
    (x, y): (&CudaView<f32>, &mut CudaViewMut<f32>),
    b: Option<(&CudaView<f32>, &mut CudaViewMut<f32>)>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    let threshold = keep_threshold(p)?;
    let n = index.check(kernel)?;
    let dims = || format!("outer {} × inner {}", index.outer, index.inner);
    check_len(kernel, "x", x.len(), n, dims)?;
    check_len(kernel, "y", y.len(), n, dims)?;
    if let Some((xb, yb)) = &b {
        check_len(kernel, "x_b", xb.len(), n, dims)?;
        check_len(kernel, "y_b", yb.len(), n, dims)?;
    }
    if n == 0 {
        return Ok(());
    }
    let scale = keep_scale(p);
    let (n64, inner) = (n as u64, index.inner.max(1) as u64);
    let (stride, first) = (index.logical_stride, index.logical_start);
    let (key_lo, key_hi, id) = (stream.key[0], stream.key[1], stream.stream);
    let null: u64 = 0;
    // Aligned runs take one Philox block (4 elements) per thread (see the kernel).
    let blocks = inner % 4 == 0 && stride % 4 == 0 && first % 4 == 0 && n % 4 == 0;
    let threads = if blocks { n / 4 } else { n };
    let f = gpu.kernels().get("dropout_apply")?;
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x).arg(y);
    match b {
        Some((xb, yb)) => {
            args.arg(xb).arg(yb);
            args.arg(&n64).arg(&inner).arg(&stride).arg(&first);
            args.arg(&key_lo)
                .arg(&key_hi)
                .arg(&id)
                .arg(&threshold)
                .arg(&scale);
            launch(kernel, args, cover(threads))
        }
        None => {
            args.arg(&null).arg(&null);
            args.arg(&n64).arg(&inner).arg(&stride).arg(&first);
            args.arg(&key_lo)
                .arg(&key_hi)
                .arg(&id)
                .arg(&threshold)
                .arg(&scale);
            launch(kernel, args, cover(threads))
        }
    }
}

/// `y = x/(1 − p)` where kept, 0 where dropped, as [`crate::kernels::dropout::dropout_forward`].
pub fn dropout_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    y: &mut CudaViewMut<f32>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    apply(gpu, "dropout_forward", (x, y), None, p, stream, index)
}

/// The gradient: the same mask regenerated, `dx = mask(dy)/(1 − p)`.
pub fn dropout_backward(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    dx: &mut CudaViewMut<f32>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    apply(gpu, "dropout_backward", (dy, dx), None, p, stream, index)
}

/// One mask on two buffers, as [`crate::kernels::dropout::dropout_pair`].
#[allow(clippy::too_many_arguments)]
pub fn dropout_pair(
    gpu: &Gpu,
    x_a: &CudaView<f32>,
    y_a: &mut CudaViewMut<f32>,
    x_b: &CudaView<f32>,
    y_b: &mut CudaViewMut<f32>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    apply(
        gpu,
        "dropout_pair",
        (x_a, y_a),
        Some((x_b, y_b)),
        p,
        stream,
        index,
    )
}

/// The Philox words of logical elements `first .. first + n` of `stream` (for tests).
pub fn philox_words(
    gpu: &Gpu,
    stream: &DropoutStream,
    first: u64,
    n: usize,
) -> Result<CudaSlice<u32>> {
    const K: &str = "philox_words";
    let mut out = gpu.zeros::<u32>(n)?;
    let (n64, key_lo, key_hi, id) = (n as u64, stream.key[0], stream.key[1], stream.stream);
    let f = gpu.kernels().get(K)?;
    let mut args = gpu.stream().launch_builder(f);
    args.arg(&mut out)
        .arg(&first)
        .arg(&n64)
        .arg(&key_lo)
        .arg(&key_hi)
        .arg(&id);
    launch(K, args, cover(n))?;
    Ok(out)
}
