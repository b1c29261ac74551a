//! Tensor-level operations: shape checks, dtype conversion at the boundary, then the kernels.
//!
//! [`matmul`] and [`matmul_into`] multiply (transposed) views; the primitives (`add`, `gelu`, `swiglu`,
//! `dropout`, `cross_entropy`, and `dropout_add` for `a + dropout(b, p)`) are the builtin
//! functions of a `#[megatron::module]` forward. [`shift_left`] and [`aux_loss`] are what
//! multi-token prediction adds: the next position's ids and mask, and a loss beside the model's.

pub mod attention;
pub mod aux_loss;
pub mod fused;
pub(crate) mod matmul;
mod primitives;
pub mod shape;
pub mod shift;

pub use attention::{DotProductAttention, Rope, RopeSaved, rope, rope_backward};
pub use aux_loss::{AuxLossLog, AuxLossSaved, aux_loss, aux_loss_backward};
pub use fused::{
    Fused, FusedKernel, FusedSaved, HostLoop, IntoScalar, Keep, fused, fused_backward,
};
pub use matmul::{
    CpuProducts, as_operand, cpu_bf16_products, matmul, matmul_bias_into, matmul_into,
    operand_dtype,
};
pub use primitives::{
    CrossEntropySaved, DropoutSaved, GeluSaved, SwigluSaved, add, cross_entropy,
    cross_entropy_backward, dropout, dropout_add, dropout_add_backward, dropout_backward, gelu,
    gelu_backward, swiglu, swiglu_backward,
};
pub use shape::{ShapeOp, ShapeSaved, shape, shape_backward};
pub use shift::{loss_mask, shift_left};
