//! The CUDA backend (feature `cuda`): NVIDIA GPUs through cudarc.
//!
//! - [`Gpu`]: one rank's device, stream and kernels. Several ranks (threads) can share one
//!   device, each on its own stream.
//! - `kernels`: every CPU kernel of [`crate::kernels`] as CUDA C (`programs`), compiled at
//!   run time by NVRTC for the device's architecture (once per process) and launched with the
//!   CPU kernels' argument checks; each gives the CPU result within f32 tolerance, and dropout
//!   draws bit-identical masks from the same Philox streams.
//! - `blas`: matrix products on cuBLAS: bf16 or f32 inputs, f32 accumulation; `blas_lt`:
//!   products whose cuBLASLt epilogue adds a bias.
//! - [`graph`]: capture a region of a stream into a CUDA graph and replay it.
//! - `profile`: the GPU time of every kernel and product, summed by name.
//!
//! - `backend`: the device side of the seam (`crate::backend`): every operation whose code
//!   differs by device, implemented for [`Gpu`].
//!
//! The CUDA libraries (driver, NVRTC, cuBLAS, NCCL) are loaded when first used, so this builds
//! and lints on a machine without CUDA; using it there is a [`CudaError::Unavailable`].
//!
//! Without the `cuda` feature this module is a stand-in (`stand_in.rs`, as candle's
//! `dummy_cuda_backend`): [`Gpu`] is a type with no values whose constructor says the build has
//! no CUDA, so the code above the seam compiles unchanged and never carries a `cfg`. This module
//! is the one place that tells the two builds apart.

#[cfg(feature = "cuda")]
pub(crate) mod backend;
#[cfg(feature = "cuda")]
pub mod blas;
#[cfg(feature = "cuda")]
pub mod blas_lt;
#[cfg(feature = "cuda")]
mod device;
mod error;
#[cfg(feature = "cuda")]
pub mod graph;
#[cfg(not(feature = "cuda"))]
pub use stand_in::graph;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
mod library;
#[cfg(feature = "cuda")]
pub mod profile;
#[cfg(feature = "cuda")]
pub mod programs;
#[cfg(not(feature = "cuda"))]
mod stand_in;
#[cfg(feature = "cuda")]
mod tensor;

#[cfg(feature = "cuda")]
pub use backend::router::DeviceRouting;
#[cfg(feature = "cuda")]
pub use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
#[cfg(feature = "cuda")]
pub(crate) use device::DeviceMemory;
#[cfg(feature = "cuda")]
pub use device::Gpu;
pub use error::{CudaError, Result};
#[cfg(feature = "cuda")]
pub use library::{require_cublas, require_driver, require_nccl, require_nvrtc};
#[cfg(not(feature = "cuda"))]
pub(crate) use stand_in::DeviceMemory;
#[cfg(not(feature = "cuda"))]
pub use stand_in::DeviceRouting;
#[cfg(not(feature = "cuda"))]
pub use stand_in::Gpu;
#[cfg(feature = "cuda")]
pub use tensor::DeviceSlice;
