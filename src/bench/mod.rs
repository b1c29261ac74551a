//! Benchmarks behind `megatron bench`: each measures the machine's own limit in the same run and
//! reports the result as a fraction of it.

pub mod activations;
pub mod allreduce;
pub mod attention;
pub mod elementwise;
pub mod gemm;
pub mod generate;
pub mod grouped_gemm;
pub mod machine;

/// The dense bf16 peak MFU is measured against: an H100 SXM's 989 TFLOP/s.
pub fn gpu_peak_tflops() -> f64 {
    989.0
}
