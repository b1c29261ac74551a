//! The CUDA libraries are loaded at run time; this checks that one is there before the first
//! call into it, so that a machine without it gets an error instead of a panic.

use super::error::{CudaError, Result};

/// `present` tells whether `library` (needed for `hint`) can be opened.
fn require(present: unsafe fn() -> bool, library: &'static str, hint: &'static str) -> Result<()> {
    // SAFETY: the probes only try to open the library.
    if unsafe { present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable { library, hint })
    }
}

/// The driver (`libcuda.so`, installed with the NVIDIA driver).
pub fn require_driver() -> Result<()> {
    require(
        cudarc::driver::sys::is_culib_present,
        "libcuda (the NVIDIA driver)",
        "a GPU and its driver are needed",
    )
}

/// NVRTC (`libnvrtc.so`, in the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel).
pub fn require_nvrtc() -> Result<()> {
    require(
        cudarc::nvrtc::sys::is_culib_present,
        "libnvrtc",
        "kernels are compiled at run time by NVRTC",
    )
}

/// cuBLAS (`libcublas.so`).
pub fn require_cublas() -> Result<()> {
    require(
        cudarc::cublas::sys::is_culib_present,
        "libcublas",
        "matrix products run on cuBLAS",
    )
}

/// NCCL (`libnccl.so`).
pub fn require_nccl() -> Result<()> {
    require(
        cudarc::nccl::sys::is_culib_present,
        "libnccl",
        "the nccl backend communicates through NCCL",
    )
}
