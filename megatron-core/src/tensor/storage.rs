//! Storage: one reference-counted buffer that many tensors view, with borrows tracked by range.
//!
//! Several tensors may view one storage (every parameter inside the flat parameter buffer, a
//! transposed view, a shard of a gradient bucket). A read borrows a range of elements shared, a
//! write borrows it exclusively; borrows of disjoint ranges never conflict, so two parameters'
//! gradients in one flat buffer can be written at once. A conflicting borrow (an output that
//! aliases an input) is an error, not a wait and not a data race.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use parking_lot::Mutex;

use super::dtype::DType;
use super::pool;
use crate::cuda::{DeviceMemory, Gpu, Result as CudaResult};

/// Host memory of one dtype, as handed to a new storage.
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
}

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory; kernels run on the CPU.
    Cpu,
    /// Memory of CUDA device `ordinal` (feature `cuda`).
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// One outstanding borrow of a range of elements.
#[derive(Debug, Clone, Copy)]
struct Borrow {
    id: u64,
    start: usize,
    end: usize,
    write: bool,
}

/// The memory behind one or more tensors: an allocation owned through a raw pointer, so that
/// disjoint ranges can be lent out mutably at the same time.
#[derive(Debug)]
pub struct Storage {
    dtype: DType,
    len: usize,
    cap: usize,
    ptr: NonNull<u8>,
    borrows: Mutex<Vec<Borrow>>,
    next_id: AtomicU64,
    /// Set for device storage (whose `ptr` is dangling: the elements live on the device).
    device: Option<DeviceMemory>,
    /// The host memory account of the thread that allocated it (host storage only).
    account: Option<Arc<super::host_memory::ThreadAccount>>,
}

// SAFETY: elements are only reached through `RawBorrow`s, which the borrow list keeps from
// overlapping unless all are reads; the allocation itself is never resized while shared.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

macro_rules! each_dtype {
    ($buffer:expr, $v:ident => $body:expr) => {
        match $buffer {
            CpuBuffer::F32($v) => $body,
            CpuBuffer::BF16($v) => $body,
            CpuBuffer::F16($v) => $body,
            CpuBuffer::I64($v) => $body,
        }
    };
}

impl Storage {
    /// Storage for `len` elements of `dtype`, recycled from a freed storage of the same size when
    /// there is one; zero-filled when `zeroed`, else holding unspecified (old) values.
    pub(crate) fn alloc(dtype: DType, len: usize, zeroed: bool) -> Self {
        match pool::take(dtype, len) {
            Some(block) => {
                if zeroed {
                    // SAFETY: the block holds at least `len` elements of `dtype`; all-zero bytes
                    // are a valid value of every dtype.
                    unsafe { std::ptr::write_bytes(block.ptr.as_ptr(), 0, len * dtype.size()) };
                }
                Storage::from_parts(dtype, block.ptr, len, block.cap)
            }
            None => Storage::new(CpuBuffer::zeros(dtype, len)),
        }
    }

    fn from_parts(dtype: DType, ptr: NonNull<u8>, len: usize, cap: usize) -> Self {
        let account = super::host_memory::allocated(cap * dtype.size());
        Storage {
            dtype,
            len,
            cap,
            ptr,
            borrows: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            device: None,
            account: Some(account),
        }
    }

    /// `len` elements of `dtype` in `gpu`'s device memory (allocated on its stream), zeroed when
    /// `zeroed`.
    pub(crate) fn on_gpu(gpu: &Gpu, dtype: DType, len: usize, zeroed: bool) -> CudaResult<Self> {
        // At least one byte, so that every storage has an address.
        let memory = DeviceMemory::alloc(gpu, (len * dtype.size()).max(1), zeroed)?;
        Ok(Storage {
            dtype,
            len,
            cap: 0,
            ptr: NonNull::dangling(),
            borrows: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            device: Some(memory),
            account: None,
        })
    }

    /// The GPU handle of device storage (`None` on the host).
    pub(crate) fn gpu(&self) -> Option<&Gpu> {
        self.device.as_ref().map(DeviceMemory::gpu)
    }

    /// Takes ownership of a buffer.
    pub fn new(buffer: CpuBuffer) -> Self {
        let dtype = buffer.dtype();
        let (ptr, len, cap) = each_dtype!(buffer, v => {
            let mut v = std::mem::ManuallyDrop::new(v);
            (v.as_mut_ptr() as *mut u8, v.len(), v.capacity())
        });
        let account = super::host_memory::allocated(cap * dtype.size());
        Storage {
            dtype,
            len,
            cap,
            ptr: NonNull::new(ptr).expect("a Vec's pointer is never null"),
            borrows: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            device: None,
            account: Some(account),
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
        match self.gpu() {
            Some(gpu) => Device::Cuda(gpu.ordinal()),
            None => Device::Cpu,
        }
    }

    /// Borrows elements `start..end` for reading (shared) or writing (exclusive); `None` if the
    /// range overlaps a borrow it conflicts with.
    pub(crate) fn borrow(&self, start: usize, end: usize, write: bool) -> Option<RawBorrow<'_>> {
        assert!(
            start <= end && end <= self.len,
            "borrow {start}..{end} of a storage of {}",
            self.len
        );
        let mut borrows = self.borrows.lock();
        let conflict = borrows
            .iter()
            .any(|b| (write || b.write) && b.start < end && start < b.end && start < end);
        if conflict {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        borrows.push(Borrow {
            id,
            start,
            end,
            write,
        });
        Some(RawBorrow {
            storage: self,
            id,
            start,
            end,
        })
    }

    fn release(&self, id: u64) {
        let mut borrows = self.borrows.lock();
        if let Some(i) = borrows.iter().position(|b| b.id == id) {
            borrows.swap_remove(i);
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if self.device.is_some() {
            // The device allocation frees itself, ordered on its stream.
            return;
        }
        if let Some(account) = &self.account {
            super::host_memory::freed(self.cap * self.dtype.size(), account);
        }
        let Some(block) = pool::give(
            self.dtype,
            self.len,
            pool::Block {
                ptr: self.ptr,
                cap: self.cap,
            },
        ) else {
            return;
        };
        let (ptr, len, cap) = (block.ptr.as_ptr(), self.len, block.cap);
        // SAFETY: the parts came from a Vec of this dtype in `new` and nothing borrows them now.
        unsafe {
            match self.dtype {
                DType::F32 => drop(Vec::from_raw_parts(ptr as *mut f32, len, cap)),
                DType::BF16 => drop(Vec::from_raw_parts(ptr as *mut bf16, len, cap)),
                DType::F16 => drop(Vec::from_raw_parts(ptr as *mut f16, len, cap)),
                DType::I64 => drop(Vec::from_raw_parts(ptr as *mut i64, len, cap)),
            }
        }
    }
}

/// A registered borrow of a range of a storage's elements; released on drop.
#[derive(Debug)]
pub(crate) struct RawBorrow<'a> {
    storage: &'a Storage,
    id: u64,
    start: usize,
    end: usize,
}

impl RawBorrow<'_> {
    /// Address of the first borrowed element (a device address for device storage).
    pub fn addr(&self) -> usize {
        let offset = self.start * self.storage.dtype.size();
        if let Some(d) = &self.storage.device {
            return d.base() as usize + offset;
        }
        self.storage.ptr.as_ptr() as usize + offset
    }

    /// Number of borrowed elements.
    pub fn len(&self) -> usize {
        self.end - self.start
    }
}

impl Drop for RawBorrow<'_> {
    fn drop(&mut self) {
        self.storage.release(self.id);
    }
}
