//! Tensor-level operations: shape checks, dtype conversion at the boundary, then the kernels.

mod matmul;

pub use matmul::{matmul, matmul_into};
