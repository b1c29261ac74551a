//! Matrix products of tensors, reading transposed and sliced views in place.

use crate::backend;
use crate::kernels::gemm::MatRef;
use crate::tensor::{DType, Result, Tensor, TensorError};

/// A tensor seen as `batch` matrices of `rows × cols` with the given strides.
pub(crate) struct Batched {
    pub(crate) batch: usize,
    pub(crate) batch_stride: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
    pub(crate) offset: usize,
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

    pub(crate) fn matrix<'a, T: Copy>(&self, data: &'a [T], i: usize) -> Result<MatRef<'a, T>> {
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
pub(crate) struct Product {
    pub(crate) a: Batched,
    pub(crate) b: Batched,
    pub(crate) c: Batched,
    /// `b` is one matrix for every batch.
    pub(crate) shared_b: bool,
    pub(crate) batch: usize,
    pub(crate) m: usize,
    pub(crate) n: usize,
}

impl Product {
    /// The product's matrices, checked to fit one another.
    pub(crate) fn of(a: &Tensor, b: &Tensor, c: &Tensor) -> Result<Product> {
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
    backend::of(t).products_dtype()
}

/// `t` contiguous and in the dtype [`matmul`] multiplies it in ([`operand_dtype`]): a tensor
/// that several products read is then rounded once, not once per product.
pub fn as_operand(t: &Tensor) -> Result<Tensor> {
    t.to_contiguous(operand_dtype(t))
}

/// While the returned guard lives, this thread's products on the CPU take their operands rounded
/// to bf16 (to nearest, ties to even) and sum them in f32, as a GPU's bf16 products with f32
/// accumulation do (`megatron::kernels::gemm::gemm_bf16`); with `on` false, in f32. What
/// `--bf16` runs on the CPU. Dropping the guard restores the thread's previous setting.
pub fn cpu_bf16_products(on: bool) -> CpuProducts {
    CpuProducts {
        previous: backend::set_cpu_bf16_products(on),
    }
}

/// The setting of [`cpu_bf16_products`], restored when dropped.
#[derive(Debug)]
#[must_use = "the setting lasts as long as the guard"]
pub struct CpuProducts {
    previous: bool,
}

impl Drop for CpuProducts {
    fn drop(&mut self) {
        backend::set_cpu_bf16_products(self.previous);
    }
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
    backend::of_any(&[c, a, b]).matmul_into(alpha, a, b, beta, c)
}

/// `c = a @ b + bias` (`bias` f32, one value per column of `c`, added to every row) as one
/// cuBLASLt product whose epilogue adds the bias, the f32 sum rounded once to `c`'s dtype; for
/// one (unbatched) matrix product on a GPU with bias epilogues on (`Gpu::set_bias_epilogues`).
/// Returns `false`, having done nothing, anywhere else (the CPU, a batch, a transposed `c`, a
/// problem cuBLASLt has no algorithm for): the caller then multiplies and adds the bias itself.
pub fn matmul_bias_into(a: &Tensor, b: &Tensor, bias: &Tensor, c: &Tensor) -> Result<bool> {
    backend::of(c).matmul_bias_into(a, b, bias, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(data: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(data, shape).unwrap()
    }

    #[test]
    fn cpu_bf16_products_multiply_the_rounded_operands_while_the_guard_lives() {
        let (m, k, n) = (20, 45, 33);
        let data = |len: usize, s: f32| -> Vec<f32> {
            (0..len).map(|i| (i as f32 * s).sin() * 3.1).collect()
        };
        let a = t(&data(m * k, 0.7), &[m, k]);
        let w = t(&data(n * k, 1.3), &[n, k]);
        let rounded = |x: &Tensor| {
            x.to_dtype(DType::BF16)
                .and_then(|x| x.to_dtype(DType::F32))
                .unwrap()
        };
        let f32_product = matmul(&a, &w.t().unwrap()).unwrap();
        let want = matmul(&rounded(&a), &rounded(&w).t().unwrap()).unwrap();
        assert_ne!(
            f32_product.to_vec::<f32>().unwrap(),
            want.to_vec::<f32>().unwrap()
        );
        {
            let _bf16 = cpu_bf16_products(true);
            let got = matmul(&a, &w.t().unwrap()).unwrap();
            let (got, want) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
            if crate::kernels::isa::Isa::detected().amx() {
                // AMX sums the rounded operands' products in an order of its own
                // (`kernels/gemm/amx.rs`): the same values to f32's precision.
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
                }
            } else {
                assert_eq!(got, want);
            }
            // Another thread keeps its own setting.
            let other = std::thread::scope(|s| {
                s.spawn(|| {
                    matmul(&a, &w.t().unwrap())
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap()
                })
                .join()
                .unwrap()
            });
            assert_eq!(other, f32_product.to_vec::<f32>().unwrap());
        }
        let after = matmul(&a, &w.t().unwrap()).unwrap();
        assert_eq!(
            after.to_vec::<f32>().unwrap(),
            f32_product.to_vec::<f32>().unwrap()
        );
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
        // Views read in place, as a weight is (`W.t()`), batched ones too: the same products as
        // of their f32 values.
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let w = t(&x, &[2, 3, 4]).to_dtype(DType::BF16).unwrap();
        let w32 = w.to_dtype(DType::F32).unwrap();
        for (view, want) in [
            (w.transpose(1, 2).unwrap(), w32.transpose(1, 2).unwrap()),
            (w.clone(), w32.clone()),
        ] {
            let k = view.dims()[1];
            let lhs = t(&x[..2 * 2 * k], &[2, 2, k]);
            assert_eq!(
                matmul(&lhs, &view).unwrap().to_vec::<f32>().unwrap(),
                matmul(&lhs, &want).unwrap().to_vec::<f32>().unwrap()
            );
        }
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
