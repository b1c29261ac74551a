//! Rank-order reductions of several device buffers into one (the device-local communicator's
//! all-reduce): in f32, in the order given, rounded once, as `comm::reduce` on the host.

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, PushKernelArg};
use half::bf16;

use super::{check_len, cover, launch};
use crate::comm::ReduceOp;
use crate::cuda::{Gpu, Result};

/// The kernel's code for `op`.
fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    }
}

/// An element type with a fold kernel.
pub trait Foldable: cudarc::driver::DeviceRepr {
    /// The kernel's name.
    const KERNEL: &'static str;
}

impl Foldable for f32 {
    const KERNEL: &'static str = "fold_f32";
}

impl Foldable for bf16 {
    const KERNEL: &'static str = "fold_bf16";
}

/// `out = srcs[0] op srcs[1] op …`, element-wise, in f32 and in order (at least one source).
/// `out` may not be one of the sources' memory.
pub fn fold<T: Foldable>(
    gpu: &Gpu,
    srcs: &[CudaView<T>],
    out: &mut CudaViewMut<T>,
    op: ReduceOp,
) -> Result<()> {
    let n = out.len();
    for s in srcs {
        check_len(T::KERNEL, "source", s.len(), n, || format!("elements {n}"))?;
    }
    if srcs.is_empty() {
        return Err(crate::kernels::KernelError::Invalid {
            kernel: T::KERNEL,
            message: "no source to reduce".to_string(),
        }
        .into());
    }
    let stream = gpu.stream();
    let pointers: Vec<_> = srcs.iter().map(|s| s.device_ptr(stream)).collect();
    let addresses: Vec<u64> = pointers.iter().map(|(p, _)| *p).collect();
    let table = gpu.upload(&addresses)?;
    let (k, n64, code) = (srcs.len() as i32, n as u64, op_code(op));
    let f = gpu.kernels().get(T::KERNEL)?;
    let mut args = stream.launch_builder(f);
    args.arg(&table).arg(&k).arg(out).arg(&n64).arg(&code);
    launch(T::KERNEL, args, cover(n))?;
    // The sources' sync guards (in `pointers`) record the kernel's use of them when dropped.
    drop(pointers);
    Ok(())
}

/// The fold kernel for `dtype`, if there is one (f16 reductions are not on the GPU yet).
pub fn fold_kernel(dtype: crate::tensor::DType) -> Option<&'static str> {
    use crate::tensor::DType;
    match dtype {
        DType::F32 => Some("fold_f32"),
        DType::BF16 => Some("fold_bf16"),
        DType::I64 => Some("fold_i64"),
        DType::F16 => None,
    }
}

/// [`fold`] on raw device addresses of `n` elements each (the device-local communicator's
/// buffers belong to several ranks' tensors).
///
/// # Safety
/// Every address must point to `n` elements of the kernel's type in this device's memory that
/// stay allocated until the stream has run the kernel; `out` must not overlap a source.
pub unsafe fn fold_raw(
    gpu: &Gpu,
    kernel: &'static str,
    srcs: &[u64],
    out: u64,
    n: usize,
    op: ReduceOp,
) -> Result<()> {
    if srcs.is_empty() || n == 0 {
        return Ok(());
    }
    let table = gpu.upload(srcs)?;
    let (k, n64, code) = (srcs.len() as i32, n as u64, op_code(op));
    let f = gpu.kernels().get(kernel)?;
    let mut args = gpu.stream().launch_builder(f);
    args.arg(&table).arg(&k).arg(&out).arg(&n64).arg(&code);
    launch(kernel, args, cover(n))
}
