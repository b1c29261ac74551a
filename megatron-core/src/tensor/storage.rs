//! Storage: one reference-counted, lock-guarded buffer that tensors view.
//!
//! Several tensors may view one storage (a parameter inside the flat parameter buffer, a
//! transposed view, a shard of a gradient bucket). Reads take a shared borrow and writes an
//! exclusive one; a conflicting borrow is an error (aliasing an output with an input), not a wait.

use half::{bf16, f16};
use parking_lot::RwLock;

use super::dtype::DType;

/// Host memory of one dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuBuffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
    /// i64 elements.
    I64(Vec<i64>),
}

impl CpuBuffer {
    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => CpuBuffer::F32(vec![0.0; len]),
            DType::BF16 => CpuBuffer::BF16(vec![bf16::ZERO; len]),
            DType::F16 => CpuBuffer::F16(vec![f16::ZERO; len]),
            DType::I64 => CpuBuffer::I64(vec![0; len]),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CpuBuffer::F32(_) => DType::F32,
            CpuBuffer::BF16(_) => DType::BF16,
            CpuBuffer::F16(_) => DType::F16,
            CpuBuffer::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuBuffer::F32(v) => v.len(),
            CpuBuffer::BF16(v) => v.len(),
            CpuBuffer::F16(v) => v.len(),
            CpuBuffer::I64(v) => v.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Address of the first element, for reading through raw pointers.
    pub(crate) fn base_addr(&self) -> usize {
        match self {
            CpuBuffer::F32(v) => v.as_ptr() as usize,
            CpuBuffer::BF16(v) => v.as_ptr() as usize,
            CpuBuffer::F16(v) => v.as_ptr() as usize,
            CpuBuffer::I64(v) => v.as_ptr() as usize,
        }
    }

    /// Address of the first element, derived from a unique borrow, for writing through raw
    /// pointers while that borrow is held.
    pub(crate) fn base_addr_mut(&mut self) -> usize {
        match self {
            CpuBuffer::F32(v) => v.as_mut_ptr() as usize,
            CpuBuffer::BF16(v) => v.as_mut_ptr() as usize,
            CpuBuffer::F16(v) => v.as_mut_ptr() as usize,
            CpuBuffer::I64(v) => v.as_mut_ptr() as usize,
        }
    }
}

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory; kernels run on the CPU.
    Cpu,
}

/// The shared, lock-guarded memory behind one or more tensors.
#[derive(Debug)]
pub struct Storage {
    dtype: DType,
    len: usize,
    data: RwLock<CpuBuffer>,
}

impl Storage {
    /// Wraps a buffer.
    pub fn new(buffer: CpuBuffer) -> Self {
        Storage {
            dtype: buffer.dtype(),
            len: buffer.len(),
            data: RwLock::new(buffer),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the storage has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device holding the memory.
    pub fn device(&self) -> Device {
        Device::Cpu
    }

    pub(crate) fn lock(&self) -> &RwLock<CpuBuffer> {
        &self.data
    }
}
