//! Dropout on the device with the CPU's masks: the same Philox words for the same (seed,
//! stream, logical index), so a GPU run drops exactly the elements a CPU run drops.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, PushKernelArg};

use super::operand::Out;
use super::{check_len, cover, launch, launch_args};
use crate::cuda::{Gpu, Result};
use crate::kernels::dropout::{LogicalIndex, keep_scale, keep_threshold};
use crate::rng::{DropoutStream, PHILOX_W32};

/// A dropout mask as the kernels take it (`make_mask` in `common.cuh`): where the buffer's
/// elements sit logically, the Philox key and stream, the keep threshold and the kept factor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MaskArgs {
    inner: u64,
    stride: u64,
    start: u64,
    key_lo: u32,
    key_hi: u32,
    stream: u64,
    threshold: u32,
    scale: f32,
}

impl MaskArgs {
    /// Drop probability `p` of `stream` over the buffer `index` describes; also returns that
    /// buffer's element count (all checked as the CPU kernels check them).
    pub(crate) fn new(
        kernel: &'static str,
        p: f32,
        stream: &DropoutStream,
        index: LogicalIndex,
    ) -> Result<(MaskArgs, usize)> {
        let threshold = keep_threshold(p)?;
        let n = index.check(kernel)?;
        let args = MaskArgs {
            inner: index.inner.max(1) as u64,
            stride: index.logical_stride,
            start: index.logical_start,
            key_lo: stream.key[0],
            key_hi: stream.key[1],
            stream: stream.stream,
            threshold,
            scale: keep_scale(p),
        };
        Ok((args, n))
    }

    /// No dropout: every element kept, unscaled (no random words drawn).
    pub(crate) fn keep_all() -> MaskArgs {
        MaskArgs {
            inner: 1,
            stride: 1,
            start: 0,
            key_lo: 0,
            key_hi: 0,
            stream: 0,
            threshold: 0,
            scale: 1.0,
        }
    }

    /// Whether runs, their starts and their stride are multiples of 4 elements, so that every
    /// aligned group of 4 local elements is one Philox block.
    fn blocks(&self) -> bool {
        self.inner.is_multiple_of(4)
            && self.stride.is_multiple_of(4)
            && self.start.is_multiple_of(4)
    }

    /// The Philox round keys of the mask's key, for kernels that take them as a parameter.
    pub(crate) fn round_keys(&self) -> RoundKeys {
        let mut keys = RoundKeys {
            x: [0; 10],
            y: [0; 10],
        };
        for r in 0..10u32 {
            keys.x[r as usize] = self.key_lo.wrapping_add(r.wrapping_mul(PHILOX_W32[0]));
            keys.y[r as usize] = self.key_hi.wrapping_add(r.wrapping_mul(PHILOX_W32[1]));
        }
        keys
    }

    /// Pushes the mask's kernel parameters, in `make_mask`'s order.
    pub(crate) fn push<'a>(&'a self, args: &mut LaunchArgs<'a>) {
        args.arg(&self.inner)
            .arg(&self.stride)
            .arg(&self.start)
            .arg(&self.key_lo)
            .arg(&self.key_hi)
            .arg(&self.stream)
            .arg(&self.threshold)
            .arg(&self.scale);
    }
}

/// Philox4x32-10's round keys (`PhiloxKeys` in `common.cuh`): round r adds r·(W0, W1) to the
/// key, wrapping. Kernels drawing many blocks per thread take them as a parameter, so that the
/// rounds read them from the constant bank instead of recomputing them.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoundKeys {
    x: [u32; 10],
    y: [u32; 10],
}

// SAFETY: plain integers with `PhiloxKeys`'s C layout; any bits are a valid value.
unsafe impl DeviceRepr for RoundKeys {}

/// Queues `dropout_apply` on one or two buffers, adding `residual` to the first when given.
#[allow(clippy::too_many_arguments)]
fn apply(
    gpu: &Gpu,
    kernel: &'static str,
    residual: Option<&CudaView<f32>>,
    (x, y): (&CudaView<f32>, Out<'_, '_>),
    b: Option<(&CudaView<f32>, &mut CudaViewMut<f32>)>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    let (mask, n) = MaskArgs::new(kernel, p, stream, index)?;
    let dims = || format!("outer {} × inner {}", index.outer, index.inner);
    if let Some(r) = residual {
        check_len(kernel, "residual", r.len(), n, dims)?;
    }
    check_len(kernel, "x", x.len(), n, dims)?;
    check_len(kernel, "y", y.len(), n, dims)?;
    if let Some((xb, yb)) = &b {
        check_len(kernel, "x_b", xb.len(), n, dims)?;
        check_len(kernel, "y_b", yb.len(), n, dims)?;
    }
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let null: u64 = 0;
    // Aligned runs take one Philox block (4 elements) per thread (see the kernel).
    let threads = if mask.blocks() && n.is_multiple_of(4) {
        n / 4
    } else {
        n
    };
    let y_flag = y.flag();
    let mut args = launch_args(gpu, "dropout_apply")?;
    args.arg(x);
    y.push(&mut args, &y_flag);
    match b {
        Some((xb, yb)) => args.arg(xb).arg(yb),
        None => args.arg(&null).arg(&null),
    };
    match residual {
        Some(r) => args.arg(r),
        None => args.arg(&null),
    };
    args.arg(&n64);
    mask.push(&mut args);
    launch(kernel, args, cover(threads))
}

/// `y = x/(1 − p)` where kept, 0 where dropped, as [`crate::kernels::dropout::dropout_forward`]
/// (in f32, or rounded to bf16).
pub fn dropout_forward(
    gpu: &Gpu,
    x: &CudaView<f32>,
    y: Out<'_, '_>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    apply(gpu, "dropout_forward", None, (x, y), None, p, stream, index)
}

/// `y = residual + x/(1 − p)` where kept, `residual` where dropped, in one pass, as
/// [`crate::kernels::dropout::dropout_add_forward`] (bit for bit: the sum is not contracted
/// with the product).
pub fn dropout_add_forward(
    gpu: &Gpu,
    residual: &CudaView<f32>,
    x: &CudaView<f32>,
    y: &mut CudaViewMut<f32>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    let pair = (x, Out::F32(y));
    apply(
        gpu,
        "dropout_add_forward",
        Some(residual),
        pair,
        None,
        p,
        stream,
        index,
    )
}

/// The gradient: the same mask regenerated, `dx = mask(dy)/(1 − p)`, in f32 or rounded to bf16
/// (for a gradient that only bf16 products read).
pub fn dropout_backward(
    gpu: &Gpu,
    dy: &CudaView<f32>,
    dx: Out<'_, '_>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<()> {
    apply(
        gpu,
        "dropout_backward",
        None,
        (dy, dx),
        None,
        p,
        stream,
        index,
    )
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
        None,
        (x_a, Out::F32(y_a)),
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
    let mut args = launch_args(gpu, K)?;
    args.arg(&mut out)
        .arg(&first)
        .arg(&n64)
        .arg(&key_lo)
        .arg(&key_hi)
        .arg(&id);
    launch(K, args, cover(n))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_keys_are_the_keys_philox_bumps_between_rounds() {
        // Keys near 2^32, so that the bumps wrap.
        let mask = MaskArgs {
            key_lo: 0xFFFF_FFF0,
            key_hi: 0x8000_0001,
            ..MaskArgs::keep_all()
        };
        let keys = mask.round_keys();
        let mut k = [mask.key_lo, mask.key_hi];
        for r in 0..10 {
            assert_eq!([keys.x[r], keys.y[r]], k, "round {r}");
            k = [
                k[0].wrapping_add(PHILOX_W32[0]),
                k[1].wrapping_add(PHILOX_W32[1]),
            ];
        }
    }
}
