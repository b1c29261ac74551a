//! The launcher of the element-wise kernels `#[megatron::module]` generates (`ops::fused`).

use cudarc::driver::PushKernelArg;

use super::{check_len, cover, launch};
use crate::cuda::Gpu;
use crate::cuda::programs::generated_function;
use crate::ops::FusedKernel;
use crate::tensor::Tensor;

/// Runs `kernel` over the contiguous f32 device tensors `inputs` (one length `n`) into
/// `outputs` (each `n` elements) with `scalars`.
pub fn run(
    gpu: &Gpu,
    kernel: &'static FusedKernel,
    inputs: &[Tensor],
    scalars: &[f32],
    outputs: &[Tensor],
) -> crate::error::Result<()> {
    let n = inputs.first().map_or(0, Tensor::numel);
    for t in inputs.iter().chain(outputs) {
        check_len(kernel.name, "a tensor", t.numel(), n, || {
            format!("elements {n}")
        })?;
    }
    let f = generated_function(gpu.context(), kernel.name, kernel.cuda)?;
    let reads = inputs
        .iter()
        .map(|t| t.device_read::<f32>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut writes = outputs
        .iter()
        .map(|t| t.device_write::<f32>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let in_views: Vec<_> = reads.iter().map(|r| r.view()).collect();
    let mut out_views: Vec<_> = writes.iter_mut().map(|w| w.view_mut()).collect();
    let (f32_flag, n64) = (0i32, n as u64);
    let mut args = gpu.stream().launch_builder(&f);
    for v in &in_views {
        args.arg(v).arg(&f32_flag);
    }
    for v in &mut out_views {
        args.arg(v).arg(&f32_flag);
    }
    for s in scalars {
        args.arg(s);
    }
    args.arg(&n64);
    Ok(launch(kernel.name, args, cover(n))?)
}
