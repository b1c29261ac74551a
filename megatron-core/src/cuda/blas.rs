//! Matrix products on cuBLAS: row-major operands, bf16 or f32 inputs, f32 accumulation and an
//! f32 result (the product the optimizer's f32 master weights and the f32 activations need).

use std::ffi::c_int;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result::gemm_strided_batched_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::blas_lt::{BlasLt, LtType};
use super::error::{CudaError, Result};
use super::{Gpu, library, profile};
use crate::kernels::KernelError;

/// An element type cuBLAS multiplies with f32 accumulation.
pub trait GemmInput: DeviceRepr {
    /// cuBLAS's name for it.
    const DATA_TYPE: cudaDataType;
}

impl GemmInput for f32 {
    const DATA_TYPE: cudaDataType = cudaDataType::CUDA_R_32F;
}

impl GemmInput for bf16 {
    const DATA_TYPE: cudaDataType = cudaDataType::CUDA_R_16BF;
}

/// One product `C = alpha·op(A)·op(B) + beta·C` of row-major matrices, `batch` times.
///
/// `op(A)` is `[m, k]` (A stored `[k, m]` when `trans_a`), `op(B)` is `[k, n]` (B stored
/// `[n, k]` when `trans_b`), C is `[m, n]`; consecutive batch entries are `m·k`, `k·n` and `m·n`
/// elements apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulShape {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Number of independent products.
    pub batch: usize,
    /// A is stored transposed.
    pub trans_a: bool,
    /// B is stored transposed.
    pub trans_b: bool,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C's old value (0 overwrites).
    pub beta: f32,
}

impl MatmulShape {
    /// `C = A·B` for `[m, k] × [k, n]`.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        MatmulShape {
            m,
            n,
            k,
            batch: 1,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
        }
    }
}

/// Bytes of the workspace each handle owns (cuBLAS's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One operand of [`Blas::matmul_raw`]: a row-major matrix, or the transpose of one, at a
/// device address, with its row stride (`ld`) and the distance between batch entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// Device address of the first element.
    pub addr: u64,
    /// Stored as the transpose of the matrix the product reads.
    pub trans: bool,
    /// Elements between the starts of consecutive stored rows.
    pub ld: usize,
    /// Elements between consecutive batch entries.
    pub batch_stride: usize,
}

/// A cuBLAS handle on one rank's stream, with its own workspace so that its products can be
/// captured into CUDA graphs (cuBLAS may not allocate during a capture).
#[derive(Debug)]
pub struct Blas {
    handle: CudaBlas,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    workspace: cudarc::driver::CudaSlice<u8>,
    /// cuBLASLt on the same stream and workspace, for products with a bias epilogue: made on
    /// first use, `None` where the library is missing.
    lt: std::sync::OnceLock<Option<BlasLt>>,
}

/// `input→output` as the profile names a product's types (whether each is bf16, else f32).
fn type_names((input, output): (bool, bool)) -> String {
    let name = |bf16: bool| if bf16 { "bf16" } else { "f32" };
    format!("{}→{}", name(input), name(output))
}

impl Blas {
    /// A handle whose products run on `gpu`'s stream.
    pub fn new(gpu: &Gpu) -> Result<Blas> {
        library::require_cublas()?;
        let handle = CudaBlas::new(gpu.stream().clone()).map_err(|e| CudaError::Blas {
            call: "cublasCreate".to_string(),
            message: format!("{e:?}"),
        })?;
        let workspace = gpu.zeros::<u8>(WORKSPACE_BYTES)?;
        {
            let (ptr, _sync) = workspace.device_ptr(gpu.stream());
            // SAFETY: the workspace lives as long as the handle (both in `Blas`).
            let status = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *handle.handle(),
                    ptr as *mut std::ffi::c_void,
                    WORKSPACE_BYTES,
                )
            };
            if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(CudaError::Blas {
                    call: format!("cublasSetWorkspace({WORKSPACE_BYTES} bytes)"),
                    message: format!("{status:?}"),
                });
            }
        }
        Ok(Blas {
            handle,
            stream: gpu.stream().clone(),
            workspace,
            lt: std::sync::OnceLock::new(),
        })
    }

    /// Records the product `what` (`flops` floating-point operations) that `run` queues in the
    /// profile, when profiling is on.
    fn timed<R>(
        &self,
        what: impl FnOnce() -> String,
        flops: f64,
        run: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let event = || {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| CudaError::driver("timing a product", e))
        };
        let start = profile::enabled().then(event).transpose()?;
        let out = run()?;
        if let Some(start) = start {
            profile::record(what(), flops, (start, event()?));
        }
        Ok(out)
    }

    /// `C = op(A)·op(B) + bias` on raw operands, one row-major `[m, k]·[k, n] → [m, n]`
    /// product (operands as [`Blas::matmul_raw`]'s), `bias` an f32 vector of `n` added to
    /// every row: one cuBLASLt kernel, the f32 sum rounded once to `output`. Returns `false`,
    /// having queued nothing, where cuBLASLt cannot (no library, or no algorithm for the
    /// problem): the caller then adds the bias itself.
    ///
    /// # Safety
    /// As [`Blas::matmul_raw`]; the bias must hold `n` f32 values.
    pub unsafe fn matmul_bias_raw(
        &self,
        (input, output): (LtType, LtType),
        (m, n, k): (usize, usize, usize),
        (a, b, c): (Operand, Operand, Operand),
        bias: u64,
    ) -> Result<bool> {
        if m == 0 || n == 0 {
            return Ok(true);
        }
        let lt = match self.lt.get() {
            Some(lt) => lt,
            None => {
                let (ptr, _sync) = self.workspace.device_ptr(&self.stream);
                let made = match BlasLt::new((ptr, WORKSPACE_BYTES)) {
                    Ok(lt) => Some(lt),
                    Err(CudaError::Unavailable { .. }) => None,
                    Err(e) => return Err(e),
                };
                self.lt.get_or_init(|| made)
            }
        };
        let Some(lt) = lt else {
            return Ok(false);
        };
        let Some(plan) = lt.plan((input, output), (m, n, k), (a, b, c), bias)? else {
            return Ok(false);
        };
        let bf16 = (input == LtType::Bf16, output == LtType::Bf16);
        let stream = self.stream.cu_stream() as *mut std::ffi::c_void;
        self.timed(
            || format!("gemm+bias {m}×{n}×{k} {}", type_names(bf16)),
            2.0 * (m * n * k) as f64,
            // SAFETY: the caller vouches for the operands and the bias (the plan's).
            || unsafe { lt.run(&plan, (a, b, c), stream) },
        )?;
        Ok(true)
    }

    /// `C = alpha·op(A)·op(B) + beta·C` on raw operands: `[m, k]·[k, n] → [m, n]`, `batch`
    /// times, with elements of the `input` type (`CUDA_R_32F` or `CUDA_R_16BF`), accumulated in
    /// f32 and stored as the `output` type (`CUDA_R_32F`, or `CUDA_R_16BF` rounded once) in a
    /// `c` that must not be transposed.
    ///
    /// # Safety
    /// Every operand must lie in live device memory of this context for all the elements its
    /// shape, leading dimension and batch stride reach, until the stream has run the product.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_raw(
        &self,
        (input, output): (cudaDataType, cudaDataType),
        (m, n, k, batch): (usize, usize, usize, usize),
        a: Operand,
        b: Operand,
        c: Operand,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        let dims = || format!("batch {batch} × [{m}, {k}] · [{k}, {n}]");
        let int = |v: usize| {
            c_int::try_from(v).map_err(|_| KernelError::Invalid {
                kernel: "matmul",
                message: format!("{} exceeds cuBLAS's 32-bit sizes", dims()),
            })
        };
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        self.timed(
            || {
                let bf16 = |t| t == cudaDataType::CUDA_R_16BF;
                format!(
                    "gemm {m}×{n}×{k}×{batch} {}",
                    type_names((bf16(input), bf16(output)))
                )
            },
            2.0 * (m * n * k * batch) as f64,
            || {
                // SAFETY: the caller vouches for the operands; cuBLAS reads Bᵀ·Aᵀ = Cᵀ
                // column-major.
                unsafe {
                    gemm_strided_batched_ex(
                        *self.handle.handle(),
                        op(b.trans),
                        op(a.trans),
                        int(n)?,
                        int(m)?,
                        int(k)?,
                        (&alpha) as *const f32 as *const _,
                        b.addr as *const _,
                        input,
                        int(b.ld.max(1))?,
                        b.batch_stride as i64,
                        a.addr as *const _,
                        input,
                        int(a.ld.max(1))?,
                        a.batch_stride as i64,
                        (&beta) as *const f32 as *const _,
                        c.addr as *mut _,
                        output,
                        int(c.ld.max(1))?,
                        c.batch_stride as i64,
                        int(batch)?,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| CudaError::Blas {
                    call: format!("cublasGemmStridedBatchedEx({})", dims()),
                    message: format!("{e:?}"),
                })
            },
        )?;
        Ok(())
    }

    /// `C = alpha·op(A)·op(B) + beta·C` (see [`MatmulShape`]), accumulating in f32.
    pub fn matmul<T: GemmInput>(
        &self,
        shape: MatmulShape,
        a: &CudaView<T>,
        b: &CudaView<T>,
        c: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        const K: &str = "matmul";
        let MatmulShape {
            m,
            n,
            k,
            batch,
            trans_a,
            trans_b,
            alpha,
            beta,
        } = shape;
        let dims = || format!("batch {batch} × [{m}, {k}] · [{k}, {n}]");
        let elems = |x: usize, y: usize| {
            x.checked_mul(y)
                .and_then(|v| v.checked_mul(batch))
                .ok_or_else(|| KernelError::Invalid {
                    kernel: K,
                    message: format!("{} overflows", dims()),
                })
        };
        super::kernels::check_len(K, "a", a.len(), elems(m, k)?, dims)?;
        super::kernels::check_len(K, "b", b.len(), elems(k, n)?, dims)?;
        super::kernels::check_len(K, "c", c.len(), elems(m, n)?, dims)?;
        let operand = |addr: u64, trans: bool, rows: usize, cols: usize| Operand {
            addr,
            trans,
            // Stored rows are `cols` long, or `rows` long for a stored transpose.
            ld: if trans { rows } else { cols },
            batch_stride: rows * cols,
        };
        let stream = &self.stream;
        let (a_ptr, _a_sync) = a.device_ptr(stream);
        let (b_ptr, _b_sync) = b.device_ptr(stream);
        let (c_ptr, _c_sync) = c.device_ptr_mut(stream);
        // SAFETY: the lengths of A, B and C were checked against the shape above, and the
        // pointers stay valid while the stream runs the product (the views outlive the call and
        // their sync guards order later frees after it).
        unsafe {
            self.matmul_raw(
                (T::DATA_TYPE, cudaDataType::CUDA_R_32F),
                (m, n, k, batch),
                operand(a_ptr, trans_a, m, k),
                operand(b_ptr, trans_b, k, n),
                operand(c_ptr, false, m, n),
                alpha,
                beta,
            )
        }
    }
}
