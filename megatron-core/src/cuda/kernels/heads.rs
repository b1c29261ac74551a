//! Grouped-query attention's head layouts on the device, as [`crate::kernels::heads`]: the
//! same layouts, order of sums and checks.

use cudarc::driver::PushKernelArg;

use super::operand::{In, Out};
use super::{cover, launch, launch_args};
use crate::cuda::{CudaError, Gpu, Result};
use crate::kernels::heads::GroupedHeads;

/// Queues `kernel` (`expand_groups` or `reduce_groups`) from `x` into `y` of `sh`, after the
/// checks (`grouped`, `per_head`: which buffer has which layout).
fn queue(
    gpu: &Gpu,
    kernel: &'static str,
    x: In<'_, '_>,
    y: Out<'_, '_>,
    sh: GroupedHeads,
    expand: bool,
) -> Result<()> {
    let (grouped, per_head) = match expand {
        true => (("x", x.len()), ("y", y.len())),
        false => (("dx", y.len()), ("dy", x.len())),
    };
    sh.check(kernel, grouped, per_head)
        .map_err(CudaError::from)?;
    let dims = [sh.rows, sh.groups, sh.per_group, sh.head_dim].map(|d| d as u64);
    let n = y.len();
    let flags = [x.flag(), y.flag()];
    let mut args = launch_args(gpu, kernel)?;
    x.push(&mut args, &flags[0]);
    y.push(&mut args, &flags[1]);
    for d in &dims {
        args.arg(d);
    }
    launch(kernel, args, cover(n))
}

/// Each query head of `x` (grouped) with its group's key and value into `y` (per head).
pub fn expand_groups(gpu: &Gpu, x: In<'_, '_>, y: Out<'_, '_>, sh: GroupedHeads) -> Result<()> {
    queue(gpu, "expand_groups", x, y, sh, true)
}

/// The backward of [`expand_groups`]: `dx` (grouped) from `dy` (per head).
pub fn reduce_groups(gpu: &Gpu, dy: In<'_, '_>, dx: Out<'_, '_>, sh: GroupedHeads) -> Result<()> {
    queue(gpu, "reduce_groups", dy, dx, sh, false)
}
