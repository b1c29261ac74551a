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
///
/// The memory can be given back while the storage lives ([`Storage::release`], torch's
/// `storage.resize_(0)` in FSDP): the elements then read as zeros, and the next borrow
/// allocates them again, zeroed. The memory and the borrows of it share one lock, and the
/// memory changes only while nothing borrows it.
#[derive(Debug)]
pub struct Storage {
    dtype: DType,
    len: usize,
    /// The GPU whose memory holds the elements (device storage).
    gpu: Option<Gpu>,
    state: Mutex<State>,
    next_id: AtomicU64,
}

/// A storage's memory and the outstanding borrows of it.
#[derive(Debug)]
struct State {
    borrows: Vec<Borrow>,
    memory: Memory,
}

/// Where a storage's elements are now.
#[derive(Debug)]
enum Memory {
    /// Host memory: the allocation's parts, and the account of the thread that allocated it.
    Host {
        ptr: NonNull<u8>,
        cap: usize,
        account: Arc<super::host_memory::ThreadAccount>,
    },
    /// Device memory (freed on its stream when dropped).
    Device(DeviceMemory),
    /// Given back ([`Storage::release`]): the elements are zeros, allocated at the next borrow.
    Released,
    /// Given back until restored ([`Storage::evict`]): a borrow is an error.
    Evicted,
}

// SAFETY: elements are only reached through `RawBorrow`s, which the borrow list keeps from
// overlapping unless all are reads; the memory is replaced only under the lock, while nothing
// borrows it.
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
        Storage::with_memory(dtype, len, None, host_memory(dtype, len, zeroed))
    }

    fn with_memory(dtype: DType, len: usize, gpu: Option<Gpu>, memory: Memory) -> Self {
        Storage {
            dtype,
            len,
            gpu,
            state: Mutex::new(State {
                borrows: Vec::new(),
                memory,
            }),
            next_id: AtomicU64::new(0),
        }
    }

    /// `len` elements of `dtype` in `gpu`'s device memory (allocated on its stream), zeroed when
    /// `zeroed`.
    #[cfg_attr(not(feature = "cuda"), allow(unreachable_code, unused_variables))]
    pub(crate) fn on_gpu(gpu: &Gpu, dtype: DType, len: usize, zeroed: bool) -> CudaResult<Self> {
        let memory = device_memory(gpu, dtype, len, zeroed)?;
        Ok(Storage::with_memory(
            dtype,
            len,
            Some(gpu.clone()),
            Memory::Device(memory),
        ))
    }

    /// The GPU handle of device storage (`None` on the host).
    pub(crate) fn gpu(&self) -> Option<&Gpu> {
        self.gpu.as_ref()
    }

    /// Takes ownership of a buffer.
    pub fn new(buffer: CpuBuffer) -> Self {
        let dtype = buffer.dtype();
        let (ptr, len, cap) = each_dtype!(buffer, v => {
            let mut v = std::mem::ManuallyDrop::new(v);
            (v.as_mut_ptr() as *mut u8, v.len(), v.capacity())
        });
        let memory = Memory::Host {
            ptr: NonNull::new(ptr).expect("a Vec's pointer is never null"),
            cap,
            account: super::host_memory::allocated(cap * dtype.size()),
        };
        Storage::with_memory(dtype, len, None, memory)
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

    /// Gives the memory back (to the pool of host blocks, or freed on the device's stream)
    /// while the storage lives on: its elements read as zeros from now on, and the next borrow
    /// allocates them again, zeroed. Returns `false`, giving nothing back, while a borrow of it
    /// is outstanding.
    pub fn release(&self) -> bool {
        self.give_back(Memory::Released)
    }

    /// Gives the memory back as [`Storage::release`] does, but until [`Storage::restore`]: a
    /// borrow before then is an error ([`BorrowError::Evicted`]), not zeros (a sharded
    /// parameter's whole values, which only a gather may bring back). Returns `false`, giving
    /// nothing back, while a borrow of it is outstanding.
    pub fn evict(&self) -> bool {
        self.give_back(Memory::Evicted)
    }

    /// Frees the memory, leaving `gone` (released or evicted) in its place, unless a borrow
    /// of it is outstanding (`false`).
    fn give_back(&self, gone: Memory) -> bool {
        let mut state = self.state.lock();
        if !state.borrows.is_empty() {
            return false;
        }
        let memory = std::mem::replace(&mut state.memory, gone);
        drop(state);
        self.free(memory);
        true
    }

    /// Allocates an evicted storage's memory again (zeroed), for what will fill it; nothing
    /// when it holds memory.
    pub(crate) fn restore(&self) -> Result<(), BorrowError> {
        let mut state = self.state.lock();
        if matches!(state.memory, Memory::Evicted) {
            state.memory = Memory::Released;
            self.allocate(&mut state)?;
        }
        Ok(())
    }

    /// Allocates released memory (zeroed) in `state`; nothing when it holds memory.
    fn allocate(&self, state: &mut State) -> Result<(), BorrowError> {
        if matches!(state.memory, Memory::Released) {
            state.memory = match &self.gpu {
                Some(gpu) => Memory::Device(
                    device_memory(gpu, self.dtype, self.len, true).map_err(BorrowError::Device)?,
                ),
                None => host_memory(self.dtype, self.len, true),
            };
        }
        Ok(())
    }

    /// Whether the storage holds memory now (not given back by [`Storage::release`] or
    /// [`Storage::evict`] since it was last borrowed or restored).
    pub fn is_resident(&self) -> bool {
        !matches!(self.state.lock().memory, Memory::Released | Memory::Evicted)
    }

    /// Borrows elements `start..end` for reading (shared) or writing (exclusive), allocating
    /// them again (zeroed) when they were released; a conflict with an outstanding borrow is
    /// [`BorrowError::Conflict`].
    pub(crate) fn borrow(
        &self,
        start: usize,
        end: usize,
        write: bool,
    ) -> Result<RawBorrow<'_>, BorrowError> {
        assert!(
            start <= end && end <= self.len,
            "borrow {start}..{end} of a storage of {}",
            self.len
        );
        let mut state = self.state.lock();
        let conflict = state
            .borrows
            .iter()
            .any(|b| (write || b.write) && b.start < end && start < b.end && start < end);
        if conflict {
            return Err(BorrowError::Conflict);
        }
        if matches!(state.memory, Memory::Evicted) {
            return Err(BorrowError::Evicted);
        }
        self.allocate(&mut state)?;
        let base = match &state.memory {
            Memory::Host { ptr, .. } => ptr.as_ptr() as usize,
            Memory::Device(d) => d.base() as usize,
            Memory::Released | Memory::Evicted => unreachable!("allocated above"),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        state.borrows.push(Borrow {
            id,
            start,
            end,
            write,
        });
        Ok(RawBorrow {
            storage: self,
            id,
            base,
            start,
            end,
        })
    }

    fn end_borrow(&self, id: u64) {
        let mut state = self.state.lock();
        if let Some(i) = state.borrows.iter().position(|b| b.id == id) {
            state.borrows.swap_remove(i);
        }
    }

    /// Frees `memory`, this storage's until now.
    fn free(&self, memory: Memory) {
        let Memory::Host { ptr, cap, account } = memory else {
            // Device memory frees itself, ordered on its stream; released memory is gone.
            return;
        };
        super::host_memory::freed(cap * self.dtype.size(), &account);
        let Some(block) = pool::give(self.dtype, self.len, pool::Block { ptr, cap }) else {
            return;
        };
        let (ptr, len, cap) = (block.ptr.as_ptr(), self.len, block.cap);
        // SAFETY: the parts came from a Vec of this dtype and nothing borrows them now.
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

/// Why a storage could not be borrowed.
#[derive(Debug)]
pub(crate) enum BorrowError {
    /// The range overlaps a borrow it conflicts with.
    Conflict,
    /// Released device memory could not be allocated again.
    Device(crate::cuda::CudaError),
    /// The memory was given back until restored ([`Storage::evict`]).
    Evicted,
}

/// Host memory for `len` elements of `dtype`, recycled from the pool when it has a block of
/// that size; zero-filled when `zeroed`.
fn host_memory(dtype: DType, len: usize, zeroed: bool) -> Memory {
    let (ptr, cap) = match pool::take(dtype, len) {
        Some(block) => {
            if zeroed {
                // SAFETY: the block holds at least `len` elements of `dtype`; all-zero bytes are
                // a valid value of every dtype.
                unsafe { std::ptr::write_bytes(block.ptr.as_ptr(), 0, len * dtype.size()) };
            }
            (block.ptr, block.cap)
        }
        None => {
            let fresh = CpuBuffer::zeros(dtype, len);
            let (ptr, cap) = each_dtype!(fresh, v => {
                let mut v = std::mem::ManuallyDrop::new(v);
                (v.as_mut_ptr() as *mut u8, v.capacity())
            });
            (
                NonNull::new(ptr).expect("a Vec's pointer is never null"),
                cap,
            )
        }
    };
    Memory::Host {
        ptr,
        cap,
        account: super::host_memory::allocated(cap * dtype.size()),
    }
}

/// `len` elements of `dtype` on `gpu` (at least one byte, so that every storage has an address).
fn device_memory(gpu: &Gpu, dtype: DType, len: usize, zeroed: bool) -> CudaResult<DeviceMemory> {
    DeviceMemory::alloc(gpu, (len * dtype.size()).max(1), zeroed)
}

impl Drop for Storage {
    fn drop(&mut self) {
        let memory = std::mem::replace(&mut self.state.get_mut().memory, Memory::Released);
        self.free(memory);
    }
}

/// A registered borrow of a range of a storage's elements; released on drop.
#[derive(Debug)]
pub(crate) struct RawBorrow<'a> {
    storage: &'a Storage,
    id: u64,
    /// The address of the storage's first element while the borrow lasts.
    base: usize,
    start: usize,
    end: usize,
}

impl RawBorrow<'_> {
    /// Address of the first borrowed element (a device address for device storage).
    pub fn addr(&self) -> usize {
        self.base + self.start * self.storage.dtype.size()
    }

    /// Number of borrowed elements.
    pub fn len(&self) -> usize {
        self.end - self.start
    }
}

impl Drop for RawBorrow<'_> {
    fn drop(&mut self) {
        self.storage.end_borrow(self.id);
    }
}
