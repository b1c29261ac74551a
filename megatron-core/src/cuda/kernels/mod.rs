//! Typed launchers of the CUDA kernels: the same arguments and checks as the CPU kernels of
//! [`crate::kernels`], on device buffers, queued on the rank's stream.
//!
//! Each launcher checks lengths with the CPU kernel's rules (a [`KernelError`] naming the
//! numbers, never a fault on the device) and then queues the kernel; results are ready when
//! the stream reaches them (the next download or synchronisation).

pub mod adam;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod flash_attention;
pub mod fused;
pub mod heads;
pub mod layer_norm;
pub mod moe;
pub mod operand;
pub mod reduce;
pub mod rotary;
pub mod softmax;
pub mod vocab_parallel;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{LaunchArgs, LaunchConfig};

use super::Gpu;
use super::error::{CudaError, Result};
use super::profile;
use crate::kernels::KernelError;

/// Threads per block of the element-wise kernels.
pub(crate) const THREADS: u32 = 256;

/// A null device pointer: pushed where a kernel's optional buffer is absent.
pub(crate) const NULL: u64 = 0;

/// A 1-D launch covering `n` items with `THREADS`-thread blocks (grid-stride beyond 2²⁰ blocks).
pub(crate) fn cover(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` threads per row, for `rows` rows.
pub(crate) fn per_row(rows: usize, threads: u32, shared_mem_bytes: u32) -> Result<LaunchConfig> {
    let grid = u32::try_from(rows.max(1)).map_err(|_| CudaError::Driver {
        call: "launch".to_string(),
        message: format!("{rows} rows exceed one grid dimension"),
    })?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    })
}

/// The argument builder of kernel `name` on `gpu`'s stream.
pub(crate) fn launch_args<'a>(gpu: &'a Gpu, name: &str) -> Result<LaunchArgs<'a>> {
    Ok(gpu.stream().launch_builder(gpu.kernels().get(name)?))
}

/// Queues a built launch, naming the kernel if the driver refuses it (and timing it while
/// [`crate::cuda::profile`] is on).
pub(crate) fn launch(name: &str, mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    let profiled = profile::enabled();
    if profiled {
        args.record_kernel_launch(CUevent_flags::CU_EVENT_DEFAULT);
    }
    // SAFETY: every launcher passes the kernel's parameters in its C signature's order and
    // types, with device buffers whose lengths it checked against the sizes it passes.
    let events = unsafe { args.launch(cfg) }
        .map_err(|e| CudaError::driver(format!("launching {name}"), e))?;
    if let (true, Some(events)) = (profiled, events) {
        profile::record(name, 0.0, events);
    }
    Ok(())
}

/// Checks that a device buffer has `expected` elements, as the CPU kernels' `check_len`.
pub(crate) fn check_len(
    kernel: &'static str,
    buffer: &'static str,
    actual: usize,
    expected: usize,
    dims: impl FnOnce() -> String,
) -> Result<()> {
    crate::kernels::check_len(kernel, buffer, actual, expected, dims).map_err(CudaError::from)
}

/// `rows × cols` without overflow.
pub(crate) fn product(kernel: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            CudaError::Kernel(KernelError::Invalid {
                kernel,
                message: format!("dimensions {dims:?} overflow usize"),
            })
        })
}
