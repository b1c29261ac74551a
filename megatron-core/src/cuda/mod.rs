//! The CUDA backend (feature `cuda`): NVIDIA GPUs through cudarc.
//!
//! - [`Gpu`]: one rank's device, stream and kernels. Several ranks (threads) can share one
//!   device, each on its own stream.
//! - [`kernels`]: every CPU kernel of [`crate::kernels`] as CUDA C ([`programs`]), compiled at
//!   run time by NVRTC for the device's architecture (once per process) and launched with the
//!   CPU kernels' argument checks; each gives the CPU result within f32 tolerance, and dropout
//!   draws bit-identical masks from the same Philox streams.
//! - [`blas`]: matrix products on cuBLAS: bf16 or f32 inputs, f32 accumulation; [`blas_lt`]:
//!   products whose cuBLASLt epilogue adds a bias.
//! - [`graph`]: capture a region of a stream into a CUDA graph and replay it.
//! - [`profile`]: the GPU time of every kernel and product, summed by name.
//!
//! The CUDA libraries (driver, NVRTC, cuBLAS, NCCL) are loaded when first used, so this builds
//! and lints on a machine without CUDA; using it there is a [`CudaError::Unavailable`].

pub mod blas;
pub mod blas_lt;
mod device;
mod error;
pub mod graph;
pub mod kernels;
mod library;
pub mod profile;
pub mod programs;

pub use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
pub use device::Gpu;
pub use error::{CudaError, Result};
pub use library::{require_cublas, require_driver, require_nccl, require_nvrtc};
