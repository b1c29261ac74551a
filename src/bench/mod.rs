//! Benchmarks behind `megatron bench`: each measures the machine's own limit in the same run and
//! reports the result as a fraction of it.

pub mod allreduce;
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod gpu_gemm;
pub mod machine;
