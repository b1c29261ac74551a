//! `CudaError`: what can go wrong on a GPU, each naming the call and the numbers.

use thiserror::Error;

use crate::kernels::KernelError;

/// An error of the CUDA backend.
#[derive(Debug, Clone, Error)]
pub enum CudaError {
    /// This build has no CUDA support (the `cuda` feature is off).
    #[error("this build has no CUDA support: build with --features cuda")]
    NotBuilt,
    /// A CUDA library could not be loaded (no driver, no toolkit on the library path).
    #[error(
        "{library} could not be loaded: {hint} (set LD_LIBRARY_PATH to the CUDA libraries, e.g. /usr/local/cuda/lib64)"
    )]
    Unavailable {
        /// The library, e.g. `libcuda` or `libnvrtc`.
        library: &'static str,
        /// What it is needed for.
        hint: &'static str,
    },
    /// A driver call failed.
    #[error("CUDA driver: {call} failed: {message}")]
    Driver {
        /// What was being done, e.g. `cuMemAlloc` or `launch layer_norm_forward`.
        call: String,
        /// The driver's error.
        message: String,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile {program}.cu for {arch}:\n{log}")]
    Compile {
        /// The program (source file) name.
        program: &'static str,
        /// The target architecture, e.g. `sm_90`.
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// cuBLAS or cuBLASLt failed.
    #[error("cuBLAS: {call} failed: {message}")]
    Blas {
        /// The call and its sizes.
        call: String,
        /// The library's error.
        message: String,
    },
    /// NCCL failed.
    #[error("NCCL: {call} failed: {message}")]
    Nccl {
        /// The call.
        call: String,
        /// The library's error.
        message: String,
    },
    /// A tensor cannot be used as asked (device, layout, borrow).
    #[error(transparent)]
    Tensor(#[from] crate::tensor::TensorError),
    /// Arguments that do not fit the kernel (lengths, ranges), as on the CPU.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl CudaError {
    /// A driver error of `call`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn driver(call: impl Into<String>, err: impl std::fmt::Debug) -> CudaError {
        CudaError::Driver {
            call: call.into(),
            message: format!("{err:?}"),
        }
    }
}

/// Shorthand for results of the CUDA backend.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;
