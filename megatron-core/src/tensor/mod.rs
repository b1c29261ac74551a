//! `Tensor`: a typed view (shape, strides, offset) of shared storage, the unit kernels and
//! collectives work on.
//!
//! A tensor's shape is its *local* shape: on a tensor-parallel rank, a column-parallel weight's
//! tensor holds only that rank's rows. Views (`narrow`, `transpose`, `reshape`) share storage and
//! copy nothing; GEMM reads transposed views in place.

mod dtype;
pub mod host_memory;
mod layout;
mod pool;
mod storage;

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use thiserror::Error;

pub use dtype::{DType, Element};
pub use layout::{Layout, Shape};
pub(crate) use storage::RawBorrow;
pub use storage::{CpuBuffer, Device, Storage};

use crate::backend::MemoryOps;
use crate::kernels::KernelError;

/// A tensor operation was given tensors it cannot work on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TensorError {
    /// Shapes do not fit the operation.
    #[error("{op}: {message}")]
    Shape {
        /// The operation, e.g. `matmul`.
        op: &'static str,
        /// What does not fit, with the shapes.
        message: String,
    },
    /// A tensor has the wrong element type.
    #[error("{op}: expected {expected} elements, got {actual}")]
    DType {
        /// The operation.
        op: &'static str,
        /// The type the operation needs.
        expected: DType,
        /// The type it got.
        actual: DType,
    },
    /// The operation needs a contiguous tensor; call `.contiguous()` first.
    #[error("{op}: the tensor of shape {shape} is not contiguous (strides {strides:?})")]
    NotContiguous {
        /// The operation.
        op: &'static str,
        /// The tensor's shape.
        shape: Shape,
        /// Its strides.
        strides: Vec<usize>,
    },
    /// The storage is borrowed in a conflicting way, e.g. an output aliases an input.
    #[error("{op}: the tensor's storage is already borrowed{}", if *.write { " (a write needs it alone: does an output alias an input?)" } else { " for writing" })]
    Borrowed {
        /// The operation.
        op: &'static str,
        /// Whether the failed borrow was a write.
        write: bool,
    },
    /// The operation cannot use memory of this device (host code given a GPU tensor, or a GPU
    /// collective given a host tensor).
    #[error(
        "{op}: the tensor is on {actual}, this needs it on {expected} (copy it with to_host() or to_gpu())"
    )]
    Device {
        /// The operation.
        op: &'static str,
        /// Where the operation needs the tensor.
        expected: &'static str,
        /// Where it is.
        actual: Device,
    },
    /// The GPU failed to run a tensor operation (driver, kernel launch).
    #[error("{op} on the GPU: {message}")]
    Gpu {
        /// The operation.
        op: &'static str,
        /// The backend's error.
        message: String,
    },
    /// The tensor's memory was given back until a gather brings it again: a sharded
    /// parameter (`optim_grads_params`) read outside its unit of gathering.
    #[error(
        "{op}: the tensor's memory is given back (a parameter sharded by optim_grads_params, read \
         while its unit of gathering is not gathered: `cx.unit` gathers a stack's modules, the \
         trainer the rest of the model)"
    )]
    Evicted {
        /// The operation.
        op: &'static str,
    },
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// The error of a failed borrow for `op`.
pub(crate) fn borrow_failed(e: storage::BorrowError, op: &'static str, write: bool) -> TensorError {
    match e {
        storage::BorrowError::Conflict => TensorError::Borrowed { op, write },
        storage::BorrowError::Device(e) => TensorError::Gpu {
            op,
            message: format!("allocating released memory again: {e}"),
        },
        storage::BorrowError::Evicted => TensorError::Evicted { op },
    }
}

/// Shorthand for results of tensor operations.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;

/// A typed view of shared storage.
#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Arc<Storage>,
    layout: Layout,
}

impl Tensor {
    /// A contiguous tensor owning `data`, which must have `shape`'s number of elements.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(TensorError::Shape {
                op: "from_vec",
                message: format!("{} elements do not fill shape {shape}", data.len()),
            });
        }
        Ok(Tensor::from_buffer(T::into_buffer(data), shape))
    }

    /// A contiguous tensor copying `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        let shape = shape.into();
        let storage = Storage::alloc(dtype, shape.numel(), true);
        Tensor {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape, 0),
        }
    }

    /// A tensor whose contents are unspecified (zeros, or values a freed tensor left): for
    /// outputs that are written in full before they are read. Recycled memory is not cleared.
    pub fn empty(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        let shape = shape.into();
        let storage = Storage::alloc(dtype, shape.numel(), false);
        Tensor {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape, 0),
        }
    }

    /// A new tensor on the same device as `near` (host or the same GPU handle), for outputs
    /// that are written in full before they are read.
    pub fn empty_near(
        shape: impl Into<Shape>,
        dtype: DType,
        near: &Tensor,
    ) -> crate::error::Result<Tensor> {
        Tensor::alloc_near(shape.into(), dtype, near, false)
    }

    /// Zeros on the same device as `near`.
    pub fn zeros_near(
        shape: impl Into<Shape>,
        dtype: DType,
        near: &Tensor,
    ) -> crate::error::Result<Tensor> {
        Tensor::alloc_near(shape.into(), dtype, near, true)
    }

    /// A one-element f32 tensor holding `value` on the same device as `near` (a scalar reduced
    /// across ranks: a loss sum, a norm's partial sum, a flag).
    pub fn scalar_near(value: f32, near: &Tensor) -> crate::error::Result<Tensor> {
        let t = Tensor::zeros_near([1], DType::F32, near)?;
        t.fill(value)?;
        Ok(t)
    }

    fn alloc_near(
        shape: Shape,
        dtype: DType,
        near: &Tensor,
        zeroed: bool,
    ) -> crate::error::Result<Tensor> {
        if let Some(gpu) = near.gpu() {
            return if zeroed {
                Tensor::zeros_on(shape, dtype, gpu)
            } else {
                Tensor::empty_on(shape, dtype, gpu)
            };
        }
        Ok(Tensor {
            storage: Arc::new(Storage::alloc(dtype, shape.numel(), zeroed)),
            layout: Layout::contiguous(shape, 0),
        })
    }

    /// A tensor with every element `value` (converted to `dtype`).
    pub fn full(shape: impl Into<Shape>, value: f32, dtype: DType) -> Tensor {
        let t = Tensor::zeros(shape, dtype);
        t.fill(value)
            .expect("a new tensor is contiguous and not borrowed");
        t
    }

    /// A tensor of zeros in `gpu`'s memory.
    pub fn zeros_on(
        shape: impl Into<Shape>,
        dtype: DType,
        gpu: &crate::cuda::Gpu,
    ) -> crate::error::Result<Tensor> {
        Tensor::on_gpu(shape.into(), dtype, gpu, true)
    }

    /// A tensor in `gpu`'s memory with unspecified contents, for outputs written in full before
    /// they are read (no memset).
    pub fn empty_on(
        shape: impl Into<Shape>,
        dtype: DType,
        gpu: &crate::cuda::Gpu,
    ) -> crate::error::Result<Tensor> {
        Tensor::on_gpu(shape.into(), dtype, gpu, false)
    }

    fn on_gpu(
        shape: Shape,
        dtype: DType,
        gpu: &crate::cuda::Gpu,
        zeroed: bool,
    ) -> crate::error::Result<Tensor> {
        let storage = Storage::on_gpu(gpu, dtype, shape.numel(), zeroed)?;
        Ok(Tensor::from_storage(
            Arc::new(storage),
            Layout::contiguous(shape, 0),
        ))
    }

    /// A view of `storage` through `layout` (the GPU backend's allocations).
    pub(crate) fn from_storage(storage: Arc<Storage>, layout: Layout) -> Tensor {
        Tensor { storage, layout }
    }

    fn from_buffer(buffer: CpuBuffer, shape: Shape) -> Tensor {
        Tensor {
            storage: Arc::new(Storage::new(buffer)),
            layout: Layout::contiguous(shape, 0),
        }
    }

    /// The local shape.
    pub fn shape(&self) -> &Shape {
        &self.layout.shape
    }

    /// The local dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.layout.shape.0
    }

    /// Size of dimension `dim`.
    pub fn dim(&self, dim: usize) -> Result<usize> {
        self.dims()
            .get(dim)
            .copied()
            .ok_or_else(|| TensorError::Shape {
                op: "dim",
                message: format!("dimension {dim} of a tensor of shape {}", self.shape()),
            })
    }

    /// The last dimension's size (1 for a scalar): a row's length.
    pub fn last_dim(&self) -> usize {
        self.dims().last().copied().unwrap_or(1)
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.shape.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// The view's layout over its storage.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether the view is dense and row-major.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The shared storage.
    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// Whether this view is the only holder of its storage and covers all of it, densely: it
    /// can be handed to another thread as it is, nobody else seeing it change.
    pub fn is_sole_owner(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
            && self.is_contiguous()
            && self.layout.offset == 0
            && self.numel() == self.storage.len()
    }

    /// Whether both tensors view the same storage.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    fn view(&self, layout: Layout) -> Tensor {
        Tensor {
            storage: Arc::clone(&self.storage),
            layout,
        }
    }

    /// The view of `len` indices of dimension `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let size = self.dim(dim)?;
        if start + len > size {
            return Err(TensorError::Shape {
                op: "narrow",
                message: format!(
                    "range {start}..{} of dimension {dim} exceeds its size {size} (shape {})",
                    start + len,
                    self.shape()
                ),
            });
        }
        let mut layout = self.layout.clone();
        layout.offset += start * layout.strides[dim];
        layout.shape.0[dim] = len;
        Ok(self.view(layout))
    }

    /// The `index`-th of `parts` equal slices along `dim` (a tensor-parallel shard).
    pub fn chunk(&self, parts: usize, index: usize, dim: usize) -> Result<Tensor> {
        let size = self.dim(dim)?;
        if parts == 0 || size % parts != 0 || index >= parts {
            return Err(TensorError::Shape {
                op: "chunk",
                message: format!(
                    "dimension {dim} of size {size} cannot give chunk {index} of {parts} equal parts"
                ),
            });
        }
        let len = size / parts;
        self.narrow(dim, index * len, len)
    }

    /// The view with dimensions `a` and `b` swapped (no copy).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        let rank = self.layout.shape.rank();
        if a >= rank || b >= rank {
            return Err(TensorError::Shape {
                op: "transpose",
                message: format!(
                    "dimensions {a} and {b} of a tensor of shape {}",
                    self.shape()
                ),
            });
        }
        let mut layout = self.layout.clone();
        layout.shape.0.swap(a, b);
        layout.strides.swap(a, b);
        Ok(self.view(layout))
    }

    /// The view with the last two dimensions swapped.
    pub fn t(&self) -> Result<Tensor> {
        let rank = self.layout.shape.rank();
        if rank < 2 {
            return Err(TensorError::Shape {
                op: "t",
                message: format!("needs at least 2 dimensions, shape is {}", self.shape()),
            });
        }
        self.transpose(rank - 2, rank - 1)
    }

    /// The same elements under another shape; the tensor must be contiguous.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(TensorError::Shape {
                op: "reshape",
                message: format!(
                    "cannot view {} elements of shape {} as {shape}",
                    self.numel(),
                    self.shape()
                ),
            });
        }
        self.require_contiguous("reshape")?;
        Ok(self.view(Layout::contiguous(shape, self.layout.offset)))
    }

    fn require_contiguous(&self, op: &'static str) -> Result<()> {
        if self.is_contiguous() {
            Ok(())
        } else {
            Err(TensorError::NotContiguous {
                op,
                shape: self.shape().clone(),
                strides: self.layout.strides.clone(),
            })
        }
    }

    /// Checks that the elements are in host memory, naming `op` otherwise.
    fn require_host(&self, op: &'static str) -> Result<()> {
        match self.device() {
            Device::Cpu => Ok(()),
            actual => Err(TensorError::Device {
                op,
                expected: "the host",
                actual,
            }),
        }
    }

    fn require_dtype(&self, op: &'static str, expected: DType) -> Result<()> {
        if self.dtype() == expected {
            Ok(())
        } else {
            Err(TensorError::DType {
                op,
                expected,
                actual: self.dtype(),
            })
        }
    }

    /// Borrows the elements of a contiguous tensor for reading.
    pub fn read<T: Element>(&self) -> Result<TensorRead<'_, T>> {
        self.require_host("read")?;
        self.require_contiguous("read")?;
        self.require_dtype("read", T::DTYPE)?;
        let borrow = self.raw_read("read")?;
        // SAFETY: the borrow covers exactly these elements of type T and is shared-only.
        let slice = unsafe { std::slice::from_raw_parts(borrow.addr() as *const T, borrow.len()) };
        Ok(TensorRead {
            slice,
            _borrow: borrow,
        })
    }

    /// Borrows the elements of a contiguous tensor for writing.
    pub fn write<T: Element>(&self) -> Result<TensorWrite<'_, T>> {
        self.require_host("write")?;
        self.require_contiguous("write")?;
        self.require_dtype("write", T::DTYPE)?;
        let borrow = self.raw_write("write")?;
        // SAFETY: the borrow covers exactly these elements of type T, exclusively.
        let slice =
            unsafe { std::slice::from_raw_parts_mut(borrow.addr() as *mut T, borrow.len()) };
        Ok(TensorWrite {
            slice,
            _borrow: borrow,
        })
    }

    /// Borrows the span of storage a (possibly strided) view touches, for reading; returns it
    /// with the storage index of its first element.
    pub(crate) fn read_span<T: Element>(&self) -> Result<(TensorRead<'_, T>, usize)> {
        self.require_host("read")?;
        self.require_dtype("read", T::DTYPE)?;
        let (start, end) = (self.layout().offset, self.layout().end());
        let borrow = self
            .storage
            .borrow(start, end, false)
            .map_err(|e| borrow_failed(e, "read", false))?;
        // SAFETY: as in `read`, for the span.
        let slice = unsafe { std::slice::from_raw_parts(borrow.addr() as *const T, borrow.len()) };
        Ok((
            TensorRead {
                slice,
                _borrow: borrow,
            },
            start,
        ))
    }

    /// Borrows the span of storage a (possibly strided) view touches, for writing.
    pub(crate) fn write_span<T: Element>(&self) -> Result<(TensorWrite<'_, T>, usize)> {
        self.require_host("write")?;
        self.require_dtype("write", T::DTYPE)?;
        let (start, end) = (self.layout().offset, self.layout().end());
        let borrow = self
            .storage
            .borrow(start, end, true)
            .map_err(|e| borrow_failed(e, "write", true))?;
        // SAFETY: as in `write`, for the span.
        let slice =
            unsafe { std::slice::from_raw_parts_mut(borrow.addr() as *mut T, borrow.len()) };
        Ok((
            TensorWrite {
                slice,
                _borrow: borrow,
            },
            start,
        ))
    }

    /// Borrows a contiguous host view's elements for reading through raw pointers.
    pub(crate) fn raw_read(&self, op: &'static str) -> Result<RawBorrow<'_>> {
        self.require_host(op)?;
        self.raw_borrow(op, false)
    }

    /// Borrows a contiguous host view's elements for writing through raw pointers.
    pub(crate) fn raw_write(&self, op: &'static str) -> Result<RawBorrow<'_>> {
        self.require_host(op)?;
        self.raw_borrow(op, true)
    }

    /// Borrows a contiguous view's elements, wherever they live, naming `op` if it cannot.
    pub(crate) fn raw_borrow(&self, op: &'static str, write: bool) -> Result<RawBorrow<'_>> {
        self.require_contiguous(op)?;
        let start = self.layout.offset;
        self.storage
            .borrow(start, start + self.numel(), write)
            .map_err(|e| borrow_failed(e, op, write))
    }

    /// The GPU handle that owns a device tensor's memory (`None` on the host).
    pub fn gpu(&self) -> Option<&crate::cuda::Gpu> {
        self.storage.gpu()
    }

    /// Checks that the tensor is contiguous, naming `op` otherwise.
    pub(crate) fn contiguous_for(&self, op: &'static str) -> Result<()> {
        self.require_contiguous(op)
    }

    /// The elements in row-major order, of exactly type `T`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if let Some(gpu) = self.gpu() {
            return gpu.download_tensor(self)?.to_vec();
        }
        let (span, base) = self.read_span::<T>()?;
        let mut out = Vec::with_capacity(self.numel());
        for_each_offset(&self.layout, |i| out.push(span[i - base]));
        Ok(out)
    }

    /// The elements in row-major order converted to f32, whatever the element type.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match self.dtype() {
            DType::F32 => self.to_vec::<f32>(),
            DType::BF16 => Ok(self
                .to_vec::<half::bf16>()?
                .into_iter()
                .map(f32::from)
                .collect()),
            DType::F16 => Ok(self
                .to_vec::<half::f16>()?
                .into_iter()
                .map(f32::from)
                .collect()),
            DType::I64 => Ok(self
                .to_vec::<i64>()?
                .into_iter()
                .map(|x| x as f32)
                .collect()),
        }
    }

    /// This tensor if contiguous, else a contiguous copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        if self.gpu().is_some() {
            return self.to_dtype(self.dtype());
        }
        let buffer = match self.dtype() {
            DType::F32 => CpuBuffer::F32(self.to_vec()?),
            DType::BF16 => CpuBuffer::BF16(self.to_vec()?),
            DType::F16 => CpuBuffer::F16(self.to_vec()?),
            DType::I64 => CpuBuffer::I64(self.to_vec()?),
        };
        Ok(Tensor::from_buffer(buffer, self.shape().clone()))
    }

    /// A contiguous copy converted to `dtype` (float types round to nearest).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if let Some(gpu) = self.gpu() {
            // Every element is written by the copy.
            let out = Tensor::empty_on(self.shape().clone(), dtype, gpu)
                .map_err(gpu_error("to_dtype"))?;
            out.copy_from(self)?;
            return Ok(out);
        }
        let out = Tensor::zeros(self.shape().clone(), dtype);
        out.copy_from(self)?;
        Ok(out)
    }

    /// This tensor as contiguous f32: itself when it already is, else a converted copy.
    pub fn to_f32_contiguous(&self) -> Result<Tensor> {
        self.to_contiguous(DType::F32)
    }

    /// This tensor as contiguous `dtype`: itself when it already is, else a converted copy.
    pub fn to_contiguous(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype && self.is_contiguous() {
            Ok(self.clone())
        } else {
            self.to_dtype(dtype)
        }
    }

    /// A contiguous copy with its own storage.
    pub fn deep_clone(&self) -> Result<Tensor> {
        self.to_dtype(self.dtype())
    }

    /// Copies `src` (same shape, any layout, any dtype: converted) into this tensor, contiguous or
    /// a view into a wider one.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(TensorError::Shape {
                op: "copy_from",
                message: format!(
                    "source shape {} ≠ destination shape {}",
                    src.shape(),
                    self.shape()
                ),
            });
        }
        if self.same_storage(src) {
            // Copying a view onto an overlapping view needs a temporary.
            return self.copy_from(&src.deep_clone()?);
        }
        if let Some(gpu) = self.gpu().or(src.gpu()) {
            return gpu.copy_tensor(self, src);
        }
        if !self.is_contiguous() {
            // A strided destination (a view into a wider tensor): the source's elements in
            // order, then written at the view's offsets.
            let dense = src.to_dtype(self.dtype())?;
            macro_rules! scatter {
                ($t:ty) => {{
                    let values = dense.read::<$t>()?;
                    let (mut dst, base) = self.write_span::<$t>()?;
                    let mut k = 0;
                    for_each_offset(&self.layout, |i| {
                        dst[i - base] = values[k];
                        k += 1;
                    });
                }};
            }
            match self.dtype() {
                DType::F32 => scatter!(f32),
                DType::BF16 => scatter!(half::bf16),
                DType::F16 => scatter!(half::f16),
                DType::I64 => scatter!(i64),
            }
            return Ok(());
        }
        macro_rules! copy_typed {
            ($dst:ty) => {{
                let mut dst = self.write::<$dst>()?;
                let mut k = 0;
                macro_rules! from {
                    ($src:ty) => {{
                        let (s, base) = src.read_span::<$src>()?;
                        if src.is_contiguous() {
                            // One pass over two slices, which the compiler vectorises.
                            let start = src.layout.offset - base;
                            let s = &s[start..start + dst.len()];
                            for (d, v) in dst.iter_mut().zip(s) {
                                *d = <$dst as Element>::from_f32(v.to_f32());
                            }
                        } else {
                            for_each_offset(&src.layout, |i| {
                                dst[k] = <$dst as Element>::from_f32(s[i - base].to_f32());
                                k += 1;
                            });
                        }
                    }};
                }
                match src.dtype() {
                    DType::F32 => from!(f32),
                    DType::BF16 => from!(half::bf16),
                    DType::F16 => from!(half::f16),
                    DType::I64 => {
                        let (s, base) = src.read_span::<i64>()?;
                        for_each_offset(&src.layout, |i| {
                            dst[k] = <$dst as FromI64>::from_i64(s[i - base]);
                            k += 1;
                        });
                    }
                }
            }};
        }
        match self.dtype() {
            DType::F32 => copy_typed!(f32),
            DType::BF16 => copy_typed!(half::bf16),
            DType::F16 => copy_typed!(half::f16),
            DType::I64 => copy_typed!(i64),
        }
        Ok(())
    }

    /// Sets every element to `value` (converted to the element type); the tensor must be contiguous.
    pub fn fill(&self, value: f32) -> Result<()> {
        if let Some(gpu) = self.gpu() {
            return gpu.fill_tensor(self, value);
        }
        match self.dtype() {
            DType::F32 => self.write::<f32>()?.fill(value),
            DType::BF16 => self
                .write::<half::bf16>()?
                .fill(half::bf16::from_f32(value)),
            DType::F16 => self.write::<half::f16>()?.fill(half::f16::from_f32(value)),
            DType::I64 => self.write::<i64>()?.fill(value as i64),
        }
        Ok(())
    }
}

/// Maps a backend error of a tensor operation to [`TensorError::Gpu`].
pub(crate) fn gpu_error<E: std::fmt::Display>(op: &'static str) -> impl Fn(E) -> TensorError {
    move |e| TensorError::Gpu {
        op,
        message: e.to_string(),
    }
}

/// Exact conversion from i64 where the target can hold it (floats round).
trait FromI64 {
    fn from_i64(value: i64) -> Self;
}

impl FromI64 for f32 {
    fn from_i64(value: i64) -> Self {
        value as f32
    }
}

impl FromI64 for half::bf16 {
    fn from_i64(value: i64) -> Self {
        half::bf16::from_f32(value as f32)
    }
}

impl FromI64 for half::f16 {
    fn from_i64(value: i64) -> Self {
        half::f16::from_f32(value as f32)
    }
}

impl FromI64 for i64 {
    fn from_i64(value: i64) -> Self {
        value
    }
}

/// Calls `f` with the storage index of every element of `layout`, in row-major order.
pub(crate) fn for_each_offset(layout: &Layout, mut f: impl FnMut(usize)) {
    let dims = layout.shape.dims();
    if layout.shape.numel() == 0 {
        return;
    }
    if layout.is_contiguous() {
        (layout.offset..layout.offset + layout.shape.numel()).for_each(f);
        return;
    }
    let rank = dims.len();
    let mut index = vec![0usize; rank];
    let mut offset = layout.offset;
    loop {
        f(offset);
        let mut d = rank;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            offset += layout.strides[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= layout.strides[d] * dims[d];
            index[d] = 0;
        }
    }
}

/// A shared borrow of a tensor's elements.
pub struct TensorRead<'a, T> {
    slice: &'a [T],
    _borrow: RawBorrow<'a>,
}

impl<T> Deref for TensorRead<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

/// An exclusive borrow of a tensor's elements.
pub struct TensorWrite<'a, T> {
    slice: &'a mut [T],
    _borrow: RawBorrow<'a>,
}

impl<T> Deref for TensorWrite<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T> DerefMut for TensorWrite<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.slice
    }
}

#[cfg(test)]
mod tests;
