//! The CUDA libraries are loaded at run time; this checks that one is there before the first
//! call into it, so that a machine without it gets an error instead of a panic.

use super::error::{CudaError, Result};

/// The driver (`libcuda.so`, installed with the NVIDIA driver).
pub fn require_driver() -> Result<()> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable {
            library: "libcuda (the NVIDIA driver)",
            hint: "a GPU and its driver are needed",
        })
    }
}

/// NVRTC (`libnvrtc.so`, in the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel).
pub fn require_nvrtc() -> Result<()> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable {
            library: "libnvrtc",
            hint: "kernels are compiled at run time by NVRTC",
        })
    }
}

/// cuBLAS (`libcublas.so`).
pub fn require_cublas() -> Result<()> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable {
            library: "libcublas",
            hint: "matrix products run on cuBLAS",
        })
    }
}

/// NCCL (`libnccl.so`).
pub fn require_nccl() -> Result<()> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable {
            library: "libnccl",
            hint: "the nccl backend communicates through NCCL",
        })
    }
}
