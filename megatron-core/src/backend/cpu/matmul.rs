//! [`MatmulOps`] on the host: the views of `crate::ops::matmul` multiplied by the CPU GEMM.

use super::Cpu;
use crate::backend::MatmulOps;
use std::cell::Cell;

use crate::kernels::gemm::{
    Group, MatMut, MatRef, gemm, gemm_bf16, gemm_bf16_b, grouped_gemm, grouped_gemm_bf16,
};
use crate::ops::matmul::Product;
use crate::tensor::Element;
use crate::tensor::{DType, Result, Tensor, TensorError};

/// `x` in f32 (exactly: every bf16/f16 value is an f32), laid out as `x` is where that is a
/// plain or transposed matrix: a weight read transposed (`W.t()`) is widened in its own
/// contiguous order, one pass, not gathered column by column.
fn widened(x: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::F32 {
        return Ok(x.clone());
    }
    let rank = x.dims().len();
    if rank >= 2 && !x.is_contiguous() {
        let back = x.transpose(rank - 2, rank - 1)?;
        if back.is_contiguous() {
            return back.to_dtype(DType::F32)?.transpose(rank - 2, rank - 1);
        }
    }
    x.to_dtype(DType::F32)
}

thread_local! {
    /// Whether this thread's products round their operands to bf16 ([`set_bf16_products`]).
    static BF16_PRODUCTS: Cell<bool> = const { Cell::new(false) };
}

/// Sets whether this thread's host products round their operands to bf16 and sum in f32
/// ([`gemm_bf16`]) rather than multiply in f32; returns the previous setting.
pub(crate) fn set_bf16_products(on: bool) -> bool {
    BF16_PRODUCTS.replace(on)
}

/// Whether this thread's host products round their operands to bf16 ([`set_bf16_products`]).
pub(crate) fn bf16_products() -> bool {
    BF16_PRODUCTS.get()
}

/// Every group's `C = α·A·B + β·C` as one grouped GEMM (a MoE layer's experts), in the thread's
/// precision as [`product`] chooses it.
pub(crate) fn grouped_product(
    alpha: f32,
    groups: Vec<Group<'_>>,
    beta: f32,
) -> Result<(), crate::kernels::KernelError> {
    if bf16_products() {
        grouped_gemm_bf16(alpha, groups, beta)
    } else {
        grouped_gemm(alpha, groups, beta)
    }
}

/// `C = α·A·B + β·C` in f32, or of the operands rounded to bf16 when this thread says so
/// ([`set_bf16_products`]): the host's products in the run's precision.
pub(crate) fn product(
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) -> Result<(), crate::kernels::KernelError> {
    if bf16_products() {
        gemm_bf16(alpha, a, b, beta, c)
    } else {
        gemm(alpha, a, b, beta, c)
    }
}

/// Each of the batched products `a @ b → c` (`crate::ops::matmul`'s views) by `product`, B's
/// elements read as `T`.
fn each_product<T: Element + Copy>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    product: impl Fn(MatRef<'_>, MatRef<'_, T>, MatMut<'_>) -> Result<(), crate::kernels::KernelError>,
) -> Result<()> {
    let Product {
        a: mut av,
        b: mut bv,
        c: mut cv,
        shared_b,
        batch,
        m,
        n,
    } = Product::of(a, b, c)?;
    // Borrow the spans the views touch; offsets below are relative to each span.
    let (a_data, a_base) = a.read_span::<f32>()?;
    let (b_data, b_base) = b.read_span::<T>()?;
    let (mut c_data, c_base) = c.write_span::<f32>()?;
    av.offset -= a_base;
    bv.offset -= b_base;
    cv.offset -= c_base;
    for i in 0..batch {
        let start = cv.offset + i * cv.batch_stride;
        let out = MatMut::new(&mut c_data[start..], m, n, cv.row_stride, cv.col_stride)?;
        let bi = if shared_b { 0 } else { i };
        product(av.matrix(&a_data, i)?, bv.matrix(&b_data, bi)?, out)?;
    }
    Ok(())
}

impl MatmulOps for Cpu {
    /// f32 products, or bf16 ones with f32 sums ([`set_bf16_products`]); a bf16 B of a bf16
    /// product is read as it is stored (a decoding step streams bf16 weights), other bf16/f16
    /// operands are converted to f32 first.
    fn matmul_into(&self, alpha: f32, a: &Tensor, b: &Tensor, beta: f32, c: &Tensor) -> Result<()> {
        if c.dtype() != DType::F32 {
            return Err(TensorError::DType {
                op: "matmul",
                expected: DType::F32,
                actual: c.dtype(),
            });
        }
        if bf16_products() && b.dtype() == DType::BF16 {
            return each_product::<half::bf16>(&widened(a)?, b, c, |a, b, c| {
                gemm_bf16_b(alpha, a, b, beta, c)
            });
        }
        if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
            return self.matmul_into(alpha, &widened(a)?, &widened(b)?, beta, c);
        }
        each_product::<f32>(a, b, c, |a, b, c| product(alpha, a, b, beta, c))
    }

    /// Never fused on the host: the caller multiplies and adds the bias itself.
    fn matmul_bias_into(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        _bias: &Tensor,
        _c: &Tensor,
    ) -> Result<bool> {
        Ok(false)
    }

    fn products_dtype(&self) -> DType {
        DType::F32
    }

    fn may_fuse_bias(&self) -> bool {
        false
    }
}
