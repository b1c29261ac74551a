//! [`MatmulOps`] on a GPU: cuBLAS reads the same views as the CPU GEMM (row-major or
//! transposed matrices, folded batches) in place; cuBLASLt adds a bias in its epilogue.

use crate::backend::MatmulOps;
use crate::cuda::Gpu;
use crate::cuda::blas::Operand;
use crate::ops::matmul::{Batched, Product};
use crate::tensor::{DType, Result, Tensor, TensorError};
use cudarc::cublas::sys::cudaDataType;

fn err(message: String) -> TensorError {
    TensorError::Shape {
        op: "matmul",
        message,
    }
}

/// How cuBLAS reads a view of `rows × cols` matrices: row-major (unit column stride) or
/// the transpose of a row-major matrix (unit row stride).
fn operand(v: &Batched, base: u64, size: usize, what: &str) -> Result<Operand> {
    let addr = base + (v.offset * size) as u64;
    let batch_stride = if v.batch > 1 { v.batch_stride } else { 0 };
    if v.col_stride == 1 || v.cols == 1 {
        let ld = if v.rows == 1 { v.cols } else { v.row_stride };
        Ok(Operand {
            addr,
            trans: false,
            ld: ld.max(v.cols),
            batch_stride,
        })
    } else if v.row_stride == 1 || v.rows == 1 {
        let ld = if v.cols == 1 { v.rows } else { v.col_stride };
        Ok(Operand {
            addr,
            trans: true,
            ld: ld.max(v.rows),
            batch_stride,
        })
    } else {
        Err(err(format!(
            "{what} has strides ({}, {}): cuBLAS needs a unit stride in one dimension; call .contiguous()",
            v.row_stride, v.col_stride
        )))
    }
}

/// A bf16 copy of the storage span `t` views, with `t`'s layout relative to it.
fn to_bf16(t: &Tensor, gpu: &crate::cuda::Gpu) -> crate::Result<Tensor> {
    let (start, end) = (t.layout().offset, t.layout().end());
    let span = t.span_view(start, end - start)?;
    let out = Tensor::empty_on([end - start], DType::BF16, gpu)?;
    crate::cuda::kernels::elementwise::f32_to_bf16(
        gpu,
        &span.device_read::<f32>()?.view(),
        &mut out.device_write::<half::bf16>()?.view_mut(),
    )?;
    Ok(out.relayout(t.layout(), start)?)
}

/// A product's operands as cuBLAS takes them: both f32, or both bf16 (rounded copies of
/// f32 operands when the handle multiplies in bf16), on the output's GPU.
struct Prepared {
    gpu: crate::cuda::Gpu,
    a: Tensor,
    b: Tensor,
    bf16: bool,
    output: cudaDataType,
    /// How the product reads `a`, `b` and the output.
    product: Product,
}

fn wrap(e: crate::Error) -> TensorError {
    match e {
        crate::Error::Tensor(t) => t,
        other => err(other.to_string()),
    }
}

fn prepare(a: &Tensor, b: &Tensor, c: &Tensor) -> Result<Prepared> {
    let gpu = c.gpu().cloned().ok_or_else(|| TensorError::Device {
        op: "matmul",
        expected: "a CUDA device",
        actual: c.device(),
    })?;
    for (t, name) in [(a, "a"), (b, "b")] {
        if t.device() != c.device() {
            return Err(TensorError::Device {
                op: "matmul",
                expected: "the output's device",
                actual: t.device(),
            })
            .map_err(|e| err(format!("{name}: {e}")));
        }
    }
    // The output: f32, or bf16 (the f32 accumulator rounded once) from bf16 operands.
    let output = match c.dtype() {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        other => {
            return Err(TensorError::DType {
                op: "matmul",
                expected: DType::F32,
                actual: other,
            });
        }
    };
    let bf16 = gpu.bf16_products() || [a.dtype(), b.dtype(), c.dtype()].contains(&DType::BF16);
    let cast = |t: &Tensor| -> Result<Tensor> {
        match (bf16, t.dtype()) {
            (true, DType::BF16) | (false, DType::F32) => Ok(t.clone()),
            (true, DType::F32) => to_bf16(t, &gpu).map_err(wrap),
            // fp16 weights (--fp16): a converted copy in the products' type.
            (true, DType::F16) => t.to_dtype(DType::BF16),
            (false, DType::F16) => t.to_dtype(DType::F32),
            (_, other) => Err(TensorError::DType {
                op: "matmul",
                expected: DType::F32,
                actual: other,
            }),
        }
    };
    let (a, b) = (cast(a)?, cast(b)?);
    let product = Product::of(&a, &b, c)?;
    Ok(Prepared {
        a,
        b,
        bf16,
        output,
        gpu,
        product,
    })
}

/// A prepared product's operands as cuBLAS reads them, with their storage borrowed
/// (read, read, write) for as long as this lives.
struct Operands<'t> {
    a: Operand,
    b: Operand,
    c: Operand,
    _spans: [crate::tensor::RawBorrow<'t>; 3],
}

fn operands<'t>(p: &'t Prepared, c: &'t Tensor) -> Result<Operands<'t>> {
    let size = p.a.dtype().size();
    let (a_addr, a_span) = p.a.raw_device_span_read("matmul")?;
    let (b_addr, b_span) = p.b.raw_device_span_read("matmul")?;
    let (c_addr, c_span) = c.raw_device_span_write("matmul")?;
    let mut ao = operand(&p.product.a, a_addr, size, "a")?;
    let mut bo = operand(&p.product.b, b_addr, size, "b")?;
    let mut co = operand(&p.product.c, c_addr, c.dtype().size(), "c")?;
    if co.trans {
        return Err(err(format!(
            "the output {} must have unit column stride",
            c.shape()
        )));
    }
    if p.product.batch == 1 {
        ao.batch_stride = 0;
        bo.batch_stride = 0;
        co.batch_stride = 0;
    } else if p.product.shared_b {
        bo.batch_stride = 0;
    }
    Ok(Operands {
        a: ao,
        b: bo,
        c: co,
        _spans: [a_span, b_span, c_span],
    })
}

/// `c = a @ b + bias` in one cuBLASLt product where it can (see
/// [`crate::ops::matmul_bias_into`]); `false`, with nothing queued, where it cannot.
fn matmul_bias_into(a: &Tensor, b: &Tensor, bias: &Tensor, c: &Tensor) -> Result<bool> {
    use crate::cuda::blas_lt::LtType;
    if c.gpu().is_none_or(|gpu| !gpu.bias_epilogues())
        || bias.device() != c.device()
        || bias.dtype() != DType::F32
        || !bias.is_contiguous()
    {
        return Ok(false);
    }
    let p = prepare(a, b, c)?;
    let (m, n, k) = (p.product.m, p.product.n, p.product.a.cols);
    if bias.numel() != n {
        return Err(err(format!(
            "the bias has {} elements, the product {} has {n} columns",
            bias.numel(),
            c.shape()
        )));
    }
    if p.product.batch != 1 || p.product.c.col_stride != 1 {
        return Ok(false);
    }
    let o = operands(&p, c)?;
    let (bias_base, bias_span) = bias.raw_device_span_read("matmul")?;
    let bias_addr = bias_base + (bias.layout().offset * 4) as u64;
    let lt_type = |bf16: bool| if bf16 { LtType::Bf16 } else { LtType::F32 };
    let types = (
        lt_type(p.bf16),
        lt_type(p.output == cudaDataType::CUDA_R_16BF),
    );
    let blas = p.gpu.blas().map_err(|e| err(e.to_string()))?;
    // SAFETY: the operands and the bias are borrowed for the call and cover every element
    // the views reach, the bias is `n` contiguous f32 values; the stream orders later frees
    // after the product.
    let fused = unsafe { blas.matmul_bias_raw(types, (m, n, k), (o.a, o.b, o.c), bias_addr) }
        .map_err(|e| err(e.to_string()))?;
    drop((o, bias_span));
    Ok(fused)
}

fn matmul_into(alpha: f32, a: &Tensor, b: &Tensor, beta: f32, c: &Tensor) -> Result<()> {
    let p = prepare(a, b, c)?;
    let o = operands(&p, c)?;
    let input = if p.bf16 {
        cudaDataType::CUDA_R_16BF
    } else {
        cudaDataType::CUDA_R_32F
    };
    let Product { m, n, batch, .. } = p.product;
    let k = p.product.a.cols;
    let blas = p.gpu.blas().map_err(|e| err(e.to_string()))?;
    // SAFETY: the operands are borrowed (read, read, write) for the call and cover every
    // element the views reach; the stream orders later frees after the product.
    unsafe {
        blas.matmul_raw(
            (input, p.output),
            (m, n, k, batch),
            o.a,
            o.b,
            o.c,
            alpha,
            beta,
        )
    }
    .map_err(|e| err(e.to_string()))?;
    drop(o);
    Ok(())
}

impl MatmulOps for Gpu {
    fn matmul_into(&self, alpha: f32, a: &Tensor, b: &Tensor, beta: f32, c: &Tensor) -> Result<()> {
        matmul_into(alpha, a, b, beta, c)
    }

    fn matmul_bias_into(&self, a: &Tensor, b: &Tensor, bias: &Tensor, c: &Tensor) -> Result<bool> {
        matmul_bias_into(a, b, bias, c)
    }

    /// bf16 when the handle multiplies in bf16 (`Gpu::set_bf16_products`), else f32.
    fn products_dtype(&self) -> DType {
        if self.bf16_products() {
            DType::BF16
        } else {
            DType::F32
        }
    }

    fn may_fuse_bias(&self) -> bool {
        true
    }
}
