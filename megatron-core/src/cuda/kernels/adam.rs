//! Adam and AdamW steps on the device, as [`crate::kernels::adam::adam_step`], with the same f32
//! scalars (rounded once per step from the f64 hyper-parameters on the host) and the same
//! rounding of every operation, so a GPU step gives the CPU's bits.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{NULL, check_len, cover, launch, launch_args};
use crate::cuda::{Gpu, Result};
use crate::kernels::adam::{AdamConfig, AdamScalars, check_step};

/// One Adam/AdamW step in place on `param`, `exp_avg` and `exp_avg_sq` from `grad` (all the same
/// length), as [`crate::kernels::adam::adam_step`]; with `copy`, the new parameters are also
/// written there rounded to bf16 (the products' weight copies, refreshed in the same pass).
pub fn adam_step(
    gpu: &Gpu,
    param: &mut CudaViewMut<f32>,
    grad: &CudaView<f32>,
    exp_avg: &mut CudaViewMut<f32>,
    exp_avg_sq: &mut CudaViewMut<f32>,
    copy: Option<&mut CudaViewMut<bf16>>,
    config: &AdamConfig,
) -> Result<()> {
    const K: &str = "adam_step";
    let n = param.len();
    check_step(config, n, [grad.len(), exp_avg.len(), exp_avg_sq.len()])?;
    if let Some(copy) = &copy {
        check_len(K, "copy", copy.len(), n, || format!("elements {n}"))?;
    }
    if n == 0 {
        return Ok(());
    }
    let c = AdamScalars::of(config);
    let n64 = n as u64;
    let mut args = launch_args(gpu, K)?;
    args.arg(param).arg(grad).arg(exp_avg).arg(exp_avg_sq);
    match copy {
        Some(copy) => args.arg(copy),
        None => args.arg(&NULL),
    };
    args.arg(&n64).arg(&c.grad_scale);
    args.arg(&c.b1)
        .arg(&c.b2)
        .arg(&c.omb1)
        .arg(&c.omb2)
        .arg(&c.eps);
    args.arg(&c.step_size)
        .arg(&c.inv_sqrt_bc2)
        .arg(&c.decay)
        .arg(&c.l2);
    launch(K, args, cover(n.div_ceil(4)))
}
