//! Rank-order reductions of several device buffers into one (the device-local communicator's
//! all-reduce): in f32, in the order given, rounded once, as `comm::reduce` on the host.

use cudarc::driver::PushKernelArg;

use super::{cover, launch, launch_args};
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

/// The fold kernel for `dtype`, if there is one (f16 reductions are not on the GPU yet).
pub fn fold_kernel(dtype: crate::tensor::DType) -> Option<&'static str> {
    use crate::tensor::DType;
    match dtype {
        DType::F32 => Some("fold_f32"),
        DType::BF16 => Some("fold_bf16"),
        DType::I64 => Some("fold_i64"),
        DType::F16 => Some("fold_f16"),
    }
}

/// `out = srcs[0] op srcs[1] op …` element-wise, in f32 (exact in i64) and in order, on raw
/// device addresses of `n` elements each (the device-local communicator's buffers belong to
/// several ranks' tensors).
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
    let mut args = launch_args(gpu, kernel)?;
    args.arg(&table).arg(&k).arg(&out).arg(&n64).arg(&code);
    launch(kernel, args, cover(n))
}
