//! Matrix products of tensors, reading transposed and sliced views in place.

use crate::kernels::gemm::{MatMut, MatRef, gemm};
use crate::tensor::{DType, Result, Tensor, TensorError};

/// A tensor seen as `batch` matrices of `rows × cols` with the given strides.
struct Batched {
    batch: usize,
    batch_stride: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    offset: usize,
}

impl Batched {
    /// Views a tensor of rank ≥ 2; leading dimensions must fold into one batch dimension.
    fn of(t: &Tensor, what: &str) -> Result<Batched> {
        let dims = t.dims();
        let strides = &t.layout().strides;
        let r = dims.len();
        if r < 2 {
            return Err(TensorError::Shape {
                op: "matmul",
                message: format!(
                    "{what} needs at least 2 dimensions, got shape {}",
                    t.shape()
                ),
            });
        }
        let (batch, batch_stride) = fold(&dims[..r - 2], &strides[..r - 2]).ok_or_else(|| TensorError::Shape {
            op: "matmul",
            message: format!(
                "{what}'s batch dimensions of shape {} (strides {:?}) do not fold into one; call .contiguous()",
                t.shape(),
                strides
            ),
        })?;
        Ok(Batched {
            batch,
            batch_stride,
            rows: dims[r - 2],
            cols: dims[r - 1],
            row_stride: strides[r - 2],
            col_stride: strides[r - 1],
            offset: t.layout().offset,
        })
    }

    fn matrix<'a>(&self, data: &'a [f32], i: usize) -> Result<MatRef<'a>> {
        let start = self.offset + i * self.batch_stride;
        Ok(MatRef::new(
            &data[start.min(data.len())..],
            self.rows,
            self.cols,
            self.row_stride,
            self.col_stride,
        )?)
    }
}

/// `a @ b → c` as batched matrices: `batch` products of `[m, k]·[k, n]`, `a`'s batches folded
/// into its rows when `b` is one shared matrix and `a`'s rows are row-major.
struct Product {
    a: Batched,
    b: Batched,
    c: Batched,
    /// `b` is one matrix for every batch.
    shared_b: bool,
    batch: usize,
    m: usize,
    n: usize,
}

impl Product {
    /// The product's matrices, checked to fit one another.
    fn of(a: &Tensor, b: &Tensor, c: &Tensor) -> Result<Product> {
        let mut av = Batched::of(a, "a")?;
        let bv = Batched::of(b, "b")?;
        let cv = Batched::of(c, "c")?;
        let shared_b = b.dims().len() == 2;
        if shared_b
            && av.row_stride == av.cols * av.col_stride
            && av.batch_stride == av.rows * av.row_stride
        {
            // [.., m, k] @ [k, n] with row-major rows: one matrix of (batch·m) rows.
            av.rows *= av.batch;
            av.batch = 1;
        }
        let (batch, m, k, n) = (av.batch, av.rows, av.cols, bv.cols);
        let c_fits = if batch == 1 {
            cv.batch * cv.rows == m
        } else {
            cv.batch == batch && cv.rows == m
        };
        if bv.rows != k || (!shared_b && bv.batch != batch) || cv.cols != n || !c_fits {
            return Err(TensorError::Shape {
                op: "matmul",
                message: format!(
                    "cannot multiply {} by {} into {}",
                    a.shape(),
                    b.shape(),
                    c.shape()
                ),
            });
        }
        // C seen as one m × n matrix: its batch dimensions must fold onto its rows.
        if batch == 1 && cv.batch > 1 && cv.batch_stride != cv.rows * cv.row_stride {
            return Err(TensorError::Shape {
                op: "matmul",
                message: format!(
                    "output {} cannot be written as {m} rows; make it contiguous",
                    c.shape()
                ),
            });
        }
        Ok(Product {
            a: av,
            b: bv,
            c: cv,
            shared_b,
            batch,
            m,
            n,
        })
    }
}

/// Folds dimensions into one `(count, stride)` if they are evenly strided (outer = inner · size).
fn fold(dims: &[usize], strides: &[usize]) -> Option<(usize, usize)> {
    let mut count = 1;
    let mut stride = 0;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d == 1 {
            continue;
        }
        if count > 1 && s != stride * count {
            return None;
        }
        if count == 1 {
            stride = s;
        }
        count *= d;
    }
    Some((count, stride))
}

/// `a @ b` as a new f32 tensor: `[.., m, k] @ [.., k, n] → [.., m, n]`, or `[.., m, k] @ [k, n]`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let ad = a.dims();
    let bd = b.dims();
    if ad.len() < 2 || bd.len() < 2 {
        return Err(TensorError::Shape {
            op: "matmul",
            message: format!("needs matrices, got shapes {} and {}", a.shape(), b.shape()),
        });
    }
    let mut dims = ad[..ad.len() - 1].to_vec();
    dims.push(bd[bd.len() - 1]);
    let c = near(dims, a)?;
    matmul_into(1.0, a, b, 0.0, &c)?;
    Ok(c)
}

/// The dtype [`matmul`] multiplies `t` in: bf16 for a device tensor on a GPU that multiplies
/// in bf16 (see `Gpu::set_bf16_products`), else f32.
pub fn operand_dtype(t: &Tensor) -> DType {
    #[cfg(feature = "cuda")]
    if t.gpu().is_some_and(|gpu| gpu.bf16_products()) {
        return DType::BF16;
    }
    let _ = t;
    DType::F32
}

/// `t` contiguous and in the dtype [`matmul`] multiplies it in ([`operand_dtype`]): a tensor
/// that several products read is then rounded once, not once per product.
pub fn as_operand(t: &Tensor) -> Result<Tensor> {
    t.to_contiguous(operand_dtype(t))
}

/// A new f32 output on `a`'s device.
fn near(dims: Vec<usize>, a: &Tensor) -> Result<Tensor> {
    Tensor::empty_near(dims, DType::F32, a).map_err(|e| match e {
        crate::Error::Tensor(t) => t,
        other => TensorError::Shape {
            op: "matmul",
            message: other.to_string(),
        },
    })
}

/// `c = α·(a @ b) + β·c` for an f32 `c` (with β = 0 its contents are ignored); on a GPU `c`
/// may also be bf16 (bf16 products, the f32 accumulator rounded once).
///
/// `a` and `b` may be any views (a transposed weight is read in place); bf16/f16 operands are
/// converted to f32 first. `b` is either batched like `a` or one matrix shared by every batch.
pub fn matmul_into(alpha: f32, a: &Tensor, b: &Tensor, beta: f32, c: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if c.gpu().is_some() || a.gpu().is_some() || b.gpu().is_some() {
        return device::matmul_into(alpha, a, b, beta, c);
    }
    if c.dtype() != DType::F32 {
        return Err(TensorError::DType {
            op: "matmul",
            expected: DType::F32,
            actual: c.dtype(),
        });
    }
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        let a32 = if a.dtype() == DType::F32 {
            a.clone()
        } else {
            a.to_dtype(DType::F32)?
        };
        let b32 = if b.dtype() == DType::F32 {
            b.clone()
        } else {
            b.to_dtype(DType::F32)?
        };
        return matmul_into(alpha, &a32, &b32, beta, c);
    }
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
    let (b_data, b_base) = b.read_span::<f32>()?;
    let (mut c_data, c_base) = c.write_span::<f32>()?;
    av.offset -= a_base;
    bv.offset -= b_base;
    cv.offset -= c_base;
    if batch == 1 {
        let out = MatMut::new(&mut c_data[cv.offset..], m, n, cv.row_stride, cv.col_stride)?;
        gemm(
            alpha,
            av.matrix(&a_data, 0)?,
            bv.matrix(&b_data, 0)?,
            beta,
            out,
        )?;
        return Ok(());
    }
    for i in 0..batch {
        let start = cv.offset + i * cv.batch_stride;
        let out = MatMut::new(&mut c_data[start..], m, n, cv.row_stride, cv.col_stride)?;
        let bi = if shared_b { 0 } else { i };
        gemm(
            alpha,
            av.matrix(&a_data, i)?,
            bv.matrix(&b_data, bi)?,
            beta,
            out,
        )?;
    }
    Ok(())
}

/// `c = a @ b + bias` (`bias` f32, one value per column of `c`, added to every row) as one
/// cuBLASLt product whose epilogue adds the bias, the f32 sum rounded once to `c`'s dtype; for
/// one (unbatched) matrix product on a GPU with bias epilogues on (`Gpu::set_bias_epilogues`).
/// Returns `false`, having done nothing, anywhere else (the CPU, a batch, a transposed `c`, a
/// problem cuBLASLt has no algorithm for): the caller then multiplies and adds the bias itself.
pub fn matmul_bias_into(a: &Tensor, b: &Tensor, bias: &Tensor, c: &Tensor) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if c.gpu().is_some() {
        return device::matmul_bias_into(a, b, bias, c);
    }
    let _ = (a, b, bias, c);
    Ok(false)
}

/// The product on the GPU: cuBLAS reads the same views (row-major or transposed matrices,
/// folded batches) in place.
#[cfg(feature = "cuda")]
mod device {
    use super::{Batched, DType, Product, Result, Tensor, TensorError};
    use crate::cuda::blas::Operand;
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
    /// [`super::matmul_bias_into`]); `false`, with nothing queued, where it cannot.
    pub(super) fn matmul_bias_into(
        a: &Tensor,
        b: &Tensor,
        bias: &Tensor,
        c: &Tensor,
    ) -> Result<bool> {
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

    pub(super) fn matmul_into(
        alpha: f32,
        a: &Tensor,
        b: &Tensor,
        beta: f32,
        c: &Tensor,
    ) -> Result<()> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(data: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(data, shape).unwrap()
    }

    #[test]
    fn transposed_views_need_no_copy() {
        let a = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
        let w = t(&[1., 0., 1., 0., 1., 1.], &[2, 3]); // weight [out 2, in 3]
        let y = matmul(&a, &w.t().unwrap()).unwrap();
        assert_eq!(y.dims(), &[2, 2]);
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![4., 5., 10., 11.]);
        // dW = dYᵀ · X with dY = ones: column sums of X per output.
        let dy = Tensor::full([2, 2], 1.0, DType::F32);
        let dw = matmul(&dy.t().unwrap(), &a).unwrap();
        assert_eq!(dw.to_vec::<f32>().unwrap(), vec![5., 7., 9., 5., 7., 9.]);
    }

    #[test]
    fn batched_and_shared_weight_products() {
        let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let a = t(&x, &[2, 3, 4]);
        let w = t(&(0..8).map(|i| (i % 3) as f32).collect::<Vec<_>>(), &[4, 2]);
        let y = matmul(&a, &w).unwrap();
        assert_eq!(y.dims(), &[2, 3, 2]);
        let flat = matmul(&a.reshape([6, 4]).unwrap(), &w).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), flat.to_vec::<f32>().unwrap());
        // Attention-like: [b, s, d] @ [b, d, s] via a transposed view of the keys.
        let k = t(&x, &[2, 3, 4]);
        let scores = matmul(&a, &k.transpose(1, 2).unwrap()).unwrap();
        assert_eq!(scores.dims(), &[2, 3, 3]);
        let s = scores.to_vec::<f32>().unwrap();
        let dot = |b: usize, i: usize, j: usize| {
            (0..4)
                .map(|p| x[b * 12 + i * 4 + p] * x[b * 12 + j * 4 + p])
                .sum::<f32>()
        };
        assert_eq!(s[9 + 3 + 2], dot(1, 1, 2));
        // Accumulate into a gradient: β = 1.
        let c = Tensor::full([2, 3, 2], 1.0, DType::F32);
        matmul_into(2.0, &a, &w, 1.0, &c).unwrap();
        let yv = y.to_vec::<f32>().unwrap();
        assert_eq!(
            c.to_vec::<f32>().unwrap(),
            yv.iter().map(|v| 2.0 * v + 1.0).collect::<Vec<_>>()
        );
    }

    #[test]
    fn linear_backward_products_match_finite_differences() {
        // Y = X·Wᵀ, L = Σ G⊙Y; the backward products are dX = G·W and dW = Gᵀ·X.
        let (n, i, o) = (5, 4, 3);
        let val = |k: usize, s: usize| ((k * 31 + s * 17) % 23) as f32 / 23.0 - 0.5;
        let x: Vec<f32> = (0..n * i).map(|k| val(k, 1)).collect();
        let w: Vec<f32> = (0..o * i).map(|k| val(k, 2)).collect();
        let g: Vec<f32> = (0..n * o).map(|k| val(k, 3)).collect();
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            let y = matmul(&t(x, &[n, i]), &t(w, &[o, i]).t().unwrap()).unwrap();
            y.to_vec::<f32>()
                .unwrap()
                .iter()
                .zip(&g)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum()
        };
        let dx = matmul(&t(&g, &[n, o]), &t(&w, &[o, i]))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let dw = matmul(&t(&g, &[n, o]).t().unwrap(), &t(&x, &[n, i]))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let h = 1e-2f32;
        for (grad, which) in [(&dx, 0), (&dw, 1)] {
            let base = if which == 0 { &x } else { &w };
            let dir: Vec<f32> = (0..base.len()).map(|k| val(k, 4 + which)).collect();
            let shifted = |sign: f32| -> Vec<f32> {
                base.iter()
                    .zip(&dir)
                    .map(|(b, d)| b + sign * h * d)
                    .collect()
            };
            let (plus, minus) = (shifted(1.0), shifted(-1.0));
            let fd = if which == 0 {
                (loss(&plus, &w) - loss(&minus, &w)) / (2.0 * h as f64)
            } else {
                (loss(&x, &plus) - loss(&x, &minus)) / (2.0 * h as f64)
            };
            let analytic: f64 = grad
                .iter()
                .zip(&dir)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum();
            assert!(
                (fd - analytic).abs() <= 1e-3 * (1.0 + analytic.abs()),
                "{which}: {fd} vs {analytic}"
            );
        }
    }

    #[test]
    fn bf16_operands_are_widened() {
        let a = t(&[1., 2., 3., 4.], &[2, 2]).to_dtype(DType::BF16).unwrap();
        let b = t(&[1., 1., 1., 1.], &[2, 2]);
        assert_eq!(
            matmul(&a, &b).unwrap().to_vec::<f32>().unwrap(),
            vec![3., 3., 7., 7.]
        );
    }

    #[test]
    fn errors_name_the_shapes() {
        let a = Tensor::zeros([2, 3], DType::F32);
        let err = matmul(&a, &a).unwrap_err().to_string();
        assert_eq!(err, "matmul: cannot multiply [2, 3] by [2, 3] into [2, 3]");
        let c = Tensor::zeros([2, 2], DType::F32);
        let err = matmul_into(1.0, &c, &c, 0.0, &c).unwrap_err();
        assert!(matches!(err, TensorError::Borrowed { .. }), "{err}");
    }
}
