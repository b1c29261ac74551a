//! Products whose epilogue adds a bias, on cuBLASLt: `C = op(A)·op(B) + bias` in one kernel,
//! the f32 accumulator plus the f32 bias rounded once to C's type. A linear layer's forward
//! then writes its output once, where a product and a bias kernel write it, read it and write
//! it again (in f32, then in the output's type).
//!
//! cuBLASLt picks an algorithm per problem (`cublasLtMatmulAlgoGetHeuristic`); this keeps its
//! answer per shape, types and operand alignment. Where it has none, [`BlasLt::plan`] says so
//! and the caller adds the bias itself.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtEpilogue_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t as Desc,
    cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t, cublasStatus_t, cudaDataType,
};

use super::blas::Operand;
use super::error::{CudaError, Result};

/// An element type of a cuBLASLt product: f32 or bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LtType {
    /// `CUDA_R_32F`.
    F32,
    /// `CUDA_R_16BF`.
    Bf16,
}

impl LtType {
    fn data_type(self) -> cudaDataType {
        match self {
            LtType::F32 => cudaDataType::CUDA_R_32F,
            LtType::Bf16 => cudaDataType::CUDA_R_16BF,
        }
    }
}

/// What decides cuBLASLt's algorithm for a product: sizes, types, layouts and the alignment of
/// each address (cuBLASLt's A, B, C/D, then the bias).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Problem {
    types: (LtType, LtType),
    mnk: (usize, usize, usize),
    trans: (bool, bool),
    ld: (usize, usize, usize),
    align: [u32; 4],
}

/// The largest power of two up to 256 that divides `addr`: the alignment the heuristic is told
/// (it assumes 256 bytes unless told less, and may pick an algorithm that needs them).
fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

/// A cuBLASLt handle on one stream, sharing the cuBLAS handle's workspace.
#[derive(Debug)]
pub struct BlasLt {
    handle: cublasLtHandle_t,
    workspace: (u64, usize),
    /// The heuristic's algorithm per problem (`None`: it had none).
    algos: Mutex<HashMap<Problem, Option<cublasLtMatmulAlgo_t>>>,
}

// SAFETY: the handle is only used through `&self` methods that run on the owning stream; the
// algorithm cache is behind a mutex.
unsafe impl Send for BlasLt {}
// SAFETY: as above.
unsafe impl Sync for BlasLt {}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn failed(call: impl Into<String>, e: lt::CublasError) -> CudaError {
    CudaError::Blas {
        call: call.into(),
        message: format!("{e:?}"),
    }
}

/// Owns a cuBLASLt descriptor and destroys it with `destroy`.
struct Owned<T: Copy> {
    raw: T,
    destroy: unsafe fn(T) -> std::result::Result<(), lt::CublasError>,
}

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: `raw` was created by the matching create call and is destroyed once.
        let _ = unsafe { (self.destroy)(self.raw) };
    }
}

/// The descriptors of one product.
struct Descriptors {
    desc: Owned<cublasLtMatmulDesc_t>,
    layouts: [Owned<cublasLtMatrixLayout_t>; 3],
}

/// A product with a bias epilogue, ready to queue ([`BlasLt::plan`], [`BlasLt::run`]).
pub struct LtPlan {
    descriptors: Descriptors,
    algo: cublasLtMatmulAlgo_t,
    mnk: (usize, usize, usize),
}

impl BlasLt {
    /// A handle whose products use `workspace` (device address and bytes), which must outlive
    /// it and be used by nothing else on another stream.
    pub fn new(workspace: (u64, usize)) -> Result<BlasLt> {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(CudaError::Unavailable {
                library: "libcublasLt",
                hint: "products with a bias epilogue run on cuBLASLt",
            });
        }
        let handle = lt::create_handle().map_err(|e| failed("cublasLtCreate", e))?;
        Ok(BlasLt {
            handle,
            workspace,
            algos: Mutex::new(HashMap::new()),
        })
    }

    /// The plan of `C = op(A)·op(B) + bias` for row-major `[m, k]·[k, n] → [m, n]` (the
    /// layout of [`super::blas::Blas::matmul_raw`], one matrix), `bias` an f32 vector of `n` at
    /// a device address: its descriptors and cuBLASLt's algorithm, or `None` when cuBLASLt has
    /// no algorithm for it.
    pub fn plan(
        &self,
        (input, output): (LtType, LtType),
        (m, n, k): (usize, usize, usize),
        (a, b, c): (Operand, Operand, Operand),
        bias: u64,
    ) -> Result<Option<LtPlan>> {
        let problem = Problem {
            types: (input, output),
            mnk: (m, n, k),
            trans: (a.trans, b.trans),
            ld: (a.ld, b.ld, c.ld),
            align: [b.addr, a.addr, c.addr, bias].map(alignment),
        };
        let descriptors = self.descriptors(problem, bias)?;
        let mut algos = self.algos.lock().unwrap_or_else(|p| p.into_inner());
        let algo = match algos.get(&problem) {
            Some(known) => *known,
            None => {
                let found = self.heuristic(&descriptors, problem.align)?;
                algos.insert(problem, found);
                found
            }
        };
        Ok(algo.map(|algo| LtPlan {
            descriptors,
            algo,
            mnk: (m, n, k),
        }))
    }

    /// Queues the product `plan` describes on `stream`, with the operands it was planned for.
    ///
    /// # Safety
    /// Every operand and the plan's bias must lie in live device memory for all the elements
    /// their shapes and leading dimensions reach, until the stream has run the product.
    pub unsafe fn run(
        &self,
        plan: &LtPlan,
        (a, b, c): (Operand, Operand, Operand),
        stream: *mut c_void,
    ) -> Result<()> {
        let (m, n, k) = plan.mnk;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [a_layout, b_layout, c_layout] = &plan.descriptors.layouts;
        // SAFETY: the caller vouches for the operands and the bias; the descriptors describe
        // them (cuBLASLt reads Bᵀ·Aᵀ = Cᵀ column-major, as the cuBLAS path), the workspace is
        // this handle's, and beta = 0 leaves C unread.
        unsafe {
            lt::matmul(
                self.handle,
                plan.descriptors.desc.raw,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                b.addr as *const c_void,
                a_layout.raw,
                a.addr as *const c_void,
                b_layout.raw,
                c.addr as *const c_void,
                c_layout.raw,
                c.addr as *mut c_void,
                c_layout.raw,
                &plan.algo,
                self.workspace.0 as *mut c_void,
                self.workspace.1,
                stream as _,
            )
        }
        .map_err(|e| failed(format!("cublasLtMatmul([{m}, {k}] · [{k}, {n}] + bias)"), e))
    }

    /// The descriptors of `p` (cuBLASLt's A is our B, its B our A: it multiplies Cᵀ = Bᵀ·Aᵀ).
    fn descriptors(&self, p: Problem, bias: u64) -> Result<Descriptors> {
        let (m, n, k) = p.mnk;
        let call = |what: &str| format!("{what} ([{m}, {k}] · [{k}, {n}] + bias)");
        let desc = Owned {
            raw: lt::create_matmul_desc(
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cudaDataType::CUDA_R_32F,
            )
            .map_err(|e| failed(call("cublasLtMatmulDescCreate"), e))?,
            destroy: lt::destroy_matmul_desc,
        };
        // cublasOperation_t as the attribute's int32: CUBLAS_OP_N or CUBLAS_OP_T.
        let op = |t: bool| i32::from(t);
        let set = |attr: Desc, value: *const c_void, size: usize| {
            // SAFETY: `value` points at `size` bytes of the attribute's type, alive for the call.
            unsafe { lt::set_matmul_desc_attribute(desc.raw, attr, value, size) }.map_err(|e| {
                failed(
                    call(&format!("cublasLtMatmulDescSetAttribute({attr:?})")),
                    e,
                )
            })
        };
        let (trans_lt_a, trans_lt_b) = (op(p.trans.1), op(p.trans.0));
        let epilogue = cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        let bias_type = cudaDataType::CUDA_R_32F;
        set(
            Desc::CUBLASLT_MATMUL_DESC_TRANSA,
            ptr(&trans_lt_a),
            size(&trans_lt_a),
        )?;
        set(
            Desc::CUBLASLT_MATMUL_DESC_TRANSB,
            ptr(&trans_lt_b),
            size(&trans_lt_b),
        )?;
        set(
            Desc::CUBLASLT_MATMUL_DESC_EPILOGUE,
            ptr(&epilogue),
            size(&epilogue),
        )?;
        set(
            Desc::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            ptr(&bias),
            size(&bias),
        )?;
        set(
            Desc::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
            ptr(&bias_type),
            size(&bias_type),
        )?;
        let layout = |ty: LtType, rows: usize, cols: usize, ld: usize| -> Result<Owned<_>> {
            Ok(Owned {
                raw: lt::create_matrix_layout(ty.data_type(), rows as u64, cols as u64, ld as i64)
                    .map_err(|e| failed(call("cublasLtMatrixLayoutCreate"), e))?,
                destroy: lt::destroy_matrix_layout,
            })
        };
        let (input, output) = p.types;
        let (ld_a, ld_b, ld_c) = p.ld;
        // Column-major views: our row-major B `[k, n]` is an `n × k` matrix (stored `k × n`
        // when B is stored transposed), our A `[m, k]` a `k × m` one, C an `n × m` one.
        let (b_rows, b_cols) = if p.trans.1 { (k, n) } else { (n, k) };
        let (a_rows, a_cols) = if p.trans.0 { (m, k) } else { (k, m) };
        Ok(Descriptors {
            desc,
            layouts: [
                layout(input, b_rows, b_cols, ld_b.max(1))?,
                layout(input, a_rows, a_cols, ld_a.max(1))?,
                layout(output, n, m, ld_c.max(1))?,
            ],
        })
    }

    /// cuBLASLt's best algorithm for the product the descriptors describe, with its A, B and
    /// C/D addresses aligned to `align` bytes, or `None`.
    fn heuristic(&self, d: &Descriptors, align: [u32; 4]) -> Result<Option<cublasLtMatmulAlgo_t>> {
        use cublasLtMatmulPreferenceAttributes_t as Pref;
        let pref = Owned {
            raw: lt::create_matmul_pref()
                .map_err(|e| failed("cublasLtMatmulPreferenceCreate", e))?,
            destroy: lt::destroy_matmul_pref,
        };
        let set = |attr: Pref, value: *const c_void, size: usize| {
            // SAFETY: `value` points at `size` bytes of the attribute's type, alive for the call.
            unsafe { lt::set_matmul_pref_attribute(pref.raw, attr, value, size) }
                .map_err(|e| failed(format!("cublasLtMatmulPreferenceSetAttribute({attr:?})"), e))
        };
        let bytes = self.workspace.1;
        set(
            Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            ptr(&bytes),
            size(&bytes),
        )?;
        let [a_align, b_align, c_align, _] = align;
        for (attr, value) in [
            (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_align),
            (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_align),
            (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c_align),
            (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c_align),
        ] {
            set(attr, ptr(&value), size(&value))?;
        }
        let [a, b, c] = &d.layouts;
        // SAFETY: every descriptor is live (owned by `d` and `pref`).
        let found = unsafe {
            lt::get_matmul_algo_heuristic(
                self.handle,
                d.desc.raw,
                a.raw,
                b.raw,
                c.raw,
                c.raw,
                pref.raw,
            )
        };
        match found {
            Ok(h) => Ok(Some(h.algo)),
            // No algorithm for this problem (type, epilogue or alignment): not an error.
            Err(lt::CublasError(
                cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                | cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE,
            )) => Ok(None),
            Err(e) => Err(failed("cublasLtMatmulAlgoGetHeuristic", e)),
        }
    }
}

fn ptr<T>(v: &T) -> *const c_void {
    v as *const T as *const c_void
}

fn size<T>(v: &T) -> usize {
    std::mem::size_of_val(v)
}
