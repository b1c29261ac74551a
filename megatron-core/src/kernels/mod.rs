//! CPU kernels on plain slices: every forward a GPT training step needs, each with its backward.
//!
//! Kernels take explicit output buffers and never allocate, so that later graph scopes can run
//! them on static buffers. Compute is f32; other dtypes are converted at the tensor layer.
//! Every kernel checks that its slices have the lengths its dimensions imply and returns a
//! [`KernelError`] otherwise: a wrong shape is an error that names the numbers, never a panic.
//!
//! The hot loops are compiled for AVX-512, AVX2 + FMA and the baseline and dispatched at run
//! time ([`isa`]); every version returns the same bits. Transcendental functions come from
//! [`math`] (vectorisable, no libm calls).

pub mod parallel;

use thiserror::Error;

pub mod adam;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod heads;
pub mod isa;
pub mod layer_norm;
pub mod math;
pub mod pointwise;
pub mod rotary;
pub mod softmax;

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx_emulator;
mod reduce;
mod shape;
#[cfg(test)]
mod test_util;

/// A kernel was called with buffers that do not fit its dimensions.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KernelError {
    /// A buffer has a different number of elements than the dimensions require.
    #[error("{kernel}: `{buffer}` has {actual} elements, expected {expected} ({dims})")]
    Length {
        /// Kernel name, e.g. `layer_norm_forward`.
        kernel: &'static str,
        /// Argument name, e.g. `gamma`.
        buffer: &'static str,
        /// Elements the dimensions require.
        expected: usize,
        /// Elements the caller passed.
        actual: usize,
        /// The dimensions, spelled out, e.g. `rows 8 × hidden 64`.
        dims: String,
    },
    /// An argument is out of its valid range (a probability above 1, an index past the vocabulary...).
    #[error("{kernel}: {message}")]
    Invalid {
        /// Kernel name.
        kernel: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
}

/// Checks that `buf` has `expected` elements; `dims` is only formatted on failure.
pub(crate) fn check_len(
    kernel: &'static str,
    buffer: &'static str,
    actual: usize,
    expected: usize,
    dims: impl FnOnce() -> String,
) -> Result<(), KernelError> {
    if actual == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            kernel,
            buffer,
            expected,
            actual,
            dims: dims(),
        })
    }
}
