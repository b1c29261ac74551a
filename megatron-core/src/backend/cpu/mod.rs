//! The host's side of the device seam: each backend trait implemented with the CPU kernels of
//! [`crate::kernels`], one file per trait.

mod attention;
mod bias;
mod elementwise;
mod embedding;
mod experts;
mod fused;
mod heads;
mod matmul;
mod norm;
mod optimizer;
mod rotary;
mod router;
mod rows;
mod vocab_loss;

pub(crate) use matmul::{bf16_products, grouped_product, product, set_bf16_products};

/// The host backend: tensors in host memory, the CPU kernels.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Cpu;

impl super::Backend for Cpu {}
