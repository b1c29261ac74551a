//! `Gpu`: one rank's handle on a device: the context, its own stream, the kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::blas::Blas;
use super::error::{CudaError, Result};
use super::library;
use super::programs::Kernels;

/// The default memory pool of `ctx`'s device (the stream-ordered allocator's).
fn default_pool(ctx: &CudaContext) -> Result<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys::{CUresult, cuDeviceGetDefaultMemPool};
    let mut pool = std::ptr::null_mut();
    // SAFETY: a valid device and out-pointer.
    match unsafe { cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) } {
        CUresult::CUDA_SUCCESS => Ok(pool),
        other => Err(CudaError::driver("cuDeviceGetDefaultMemPool", other)),
    }
}

/// Makes the device's stream-ordered allocator keep freed memory instead of returning it at
/// every synchronisation: a training step frees and reallocates the same activation sizes, and
/// giving memory back to the driver each time costs more than the step's kernels.
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys::{CUmemPool_attribute, CUresult, cuMemPoolSetAttribute};
    let pool = default_pool(ctx)?;
    let mut threshold = u64::MAX;
    // SAFETY: a valid pool; the attribute takes a u64.
    let status = unsafe {
        cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold) as *mut u64 as *mut std::ffi::c_void,
        )
    };
    match status {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(CudaError::driver(
            "cuMemPoolSetAttribute(release threshold)",
            other,
        )),
    }
}

/// A device and a stream of this rank on it. Several ranks (threads) may share one device, each
/// with its own stream, as the device-local communicator does.
///
/// Everything queued through one handle runs in order on its stream. Buffers are not tracked
/// across streams: a buffer used on another stream must be ordered with events (as the
/// device-local communicator does), and freed only after that use.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Arc<Kernels>,
    /// The cuBLAS handle of this stream, made on first use.
    blas: Arc<OnceLock<Blas>>,
    /// Whether f32 matrix products round their operands to bf16 (f32 accumulation).
    bf16_products: Arc<AtomicBool>,
    /// Whether attention runs as tiled (flash) kernels where it can.
    flash_attention: Arc<AtomicBool>,
    /// Whether products followed by a bias add it in cuBLASLt's epilogue.
    bias_epilogues: Arc<AtomicBool>,
    /// What the stream is being captured into now, if anything ([`Graph::capture`]'s label):
    /// the stream's own state, shared by the handle's clones.
    ///
    /// [`Graph::capture`]: super::graph::Graph::capture
    capture: Arc<parking_lot::Mutex<Option<&'static str>>>,
}

impl Gpu {
    /// Device `ordinal` with a new stream; compiles (first time in the process) and loads the
    /// kernels.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        library::require_driver()?;
        let count =
            CudaContext::device_count().map_err(|e| CudaError::driver("cuDeviceGetCount", e))?;
        if ordinal >= count as usize {
            return Err(CudaError::Driver {
                call: format!("opening cuda:{ordinal}"),
                message: format!("this machine has {count} CUDA device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::driver(format!("cuDevicePrimaryCtxRetain({ordinal})"), e))?;
        // Ordering is explicit: a rank's work runs on its stream, and the device-local
        // communicator orders other streams' uses of its buffers with events. cudarc's
        // automatic per-buffer events would also make graph capture fail (a capture may not
        // wait on events recorded outside it).
        // SAFETY: set before this context allocates anything through this handle; see above
        // for the synchronisation that replaces the tracking.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let kernels = Kernels::for_context(&ctx)?;
        Ok(Gpu {
            ctx,
            stream,
            kernels,
            blas: Arc::new(OnceLock::new()),
            bf16_products: Arc::new(AtomicBool::new(false)),
            flash_attention: Arc::new(AtomicBool::new(false)),
            bias_epilogues: Arc::new(AtomicBool::new(true)),
            capture: Arc::default(),
        })
    }

    /// The same device and kernels with another new stream (for another rank or a side stream).
    pub fn with_new_stream(&self) -> Result<Gpu> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        Ok(Gpu {
            ctx: self.ctx.clone(),
            stream,
            kernels: self.kernels.clone(),
            blas: Arc::new(OnceLock::new()),
            bf16_products: Arc::new(AtomicBool::new(self.bf16_products())),
            flash_attention: Arc::new(AtomicBool::new(self.flash_attention())),
            bias_epilogues: Arc::new(AtomicBool::new(self.bias_epilogues())),
            capture: Arc::default(),
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// What this handle's stream is being captured into now (the label given to
    /// [`Graph::capture`](super::graph::Graph::capture)), if anything: a communicator asks it
    /// before a call that cannot be captured, or that must not wait on the stream.
    pub fn capturing(&self) -> Option<&'static str> {
        *self.capture.lock()
    }

    /// Marks the stream as captured into `label` (or no longer captured).
    pub(crate) fn set_capturing(&self, label: Option<&'static str>) {
        *self.capture.lock() = label;
    }

    /// This rank's stream: every kernel of this handle runs on it, in order.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cuBLAS handle on this stream (created on first use).
    pub fn blas(&self) -> Result<&Blas> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let made = Blas::new(self)?;
        Ok(self.blas.get_or_init(|| made))
    }

    /// Makes f32 matrix products round their operands to bf16 and multiply them on the tensor
    /// cores with f32 accumulation (mixed precision, as Megatron-LM trains); off by default,
    /// when products are f32 as on the CPU.
    pub fn set_bf16_products(&self, on: bool) {
        self.bf16_products.store(on, Ordering::Relaxed);
    }

    /// Whether f32 products run in bf16 (see [`Gpu::set_bf16_products`]).
    pub fn bf16_products(&self) -> bool {
        self.bf16_products.load(Ordering::Relaxed)
    }

    /// Makes causal self-attention run as tiled kernels on the tensor cores (FlashAttention-2's
    /// algorithm, [`crate::cuda::kernels::flash_attention`]) where it can: bf16 products and a
    /// head size the kernels are built for; elsewhere attention keeps its unfused kernels. Off
    /// by default.
    pub fn set_flash_attention(&self, on: bool) {
        self.flash_attention.store(on, Ordering::Relaxed);
    }

    /// Whether attention may run as flash kernels (see [`Gpu::set_flash_attention`]).
    pub fn flash_attention(&self) -> bool {
        self.flash_attention.load(Ordering::Relaxed)
    }

    /// Makes a layer's product and bias one cuBLASLt call whose epilogue adds the bias (the
    /// f32 sum rounded once to the output's dtype), where cuBLASLt has an algorithm for it; off,
    /// a product then a bias kernel. On by default.
    pub fn set_bias_epilogues(&self, on: bool) {
        self.bias_epilogues.store(on, Ordering::Relaxed);
    }

    /// Whether biases go in the products' epilogues (see [`Gpu::set_bias_epilogues`]).
    pub fn bias_epilogues(&self) -> bool {
        self.bias_epilogues.load(Ordering::Relaxed)
    }

    /// The loaded kernels.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// `len` zeros on the device.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(len)
            .map_err(|e| CudaError::driver(format!("cuMemAllocAsync({len} elements)"), e))
    }

    /// `len` elements on the device with unspecified contents (for outputs written in full).
    pub fn uninit<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: callers write every element before reading it (see `Tensor::empty_on`); the
        // bytes are never read as `T` before that.
        unsafe { self.stream.alloc(len) }
            .map_err(|e| CudaError::driver(format!("cuMemAllocAsync({len} elements)"), e))
    }

    /// A copy of `host` on the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(|e| {
            CudaError::driver(format!("cuMemcpyHtoDAsync({} elements)", host.len()), e)
        })
    }

    /// A host copy of `dev` (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(dev)
            .map_err(|e| CudaError::driver(format!("cuMemcpyDtoHAsync({} elements)", dev.len()), e))
    }

    /// The most bytes the device's stream-ordered allocations (every tensor of this process on
    /// it) have held at once: the default pool's high-water mark of memory in use.
    pub fn peak_memory(&self) -> Result<u64> {
        use cudarc::driver::sys::{CUmemPool_attribute, CUresult, cuMemPoolGetAttribute};
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        let pool = default_pool(&self.ctx)?;
        let mut bytes = 0u64;
        // SAFETY: a valid pool; the attribute is a u64.
        let status = unsafe {
            cuMemPoolGetAttribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut bytes) as *mut u64 as *mut std::ffi::c_void,
            )
        };
        match status {
            CUresult::CUDA_SUCCESS => Ok(bytes),
            other => Err(CudaError::driver(
                "cuMemPoolGetAttribute(used memory high-water mark)",
                other,
            )),
        }
    }

    /// Waits until everything queued on this rank's stream has run.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }
}

/// Device memory behind a tensor's storage: the allocation (freed on the stream it was
/// allocated on) and its address.
#[derive(Debug)]
pub(crate) struct DeviceMemory {
    _slice: CudaSlice<u8>,
    base: u64,
}

impl DeviceMemory {
    /// `bytes` bytes on `gpu`'s stream, zeroed when `zeroed`.
    pub(crate) fn alloc(gpu: &Gpu, bytes: usize, zeroed: bool) -> Result<DeviceMemory> {
        use cudarc::driver::DevicePtr;
        let slice = if zeroed {
            gpu.zeros::<u8>(bytes)?
        } else {
            gpu.uninit::<u8>(bytes)?
        };
        let base = {
            let (base, _sync) = slice.device_ptr(gpu.stream());
            base
        };
        Ok(DeviceMemory {
            base,
            _slice: slice,
        })
    }

    /// The device address of the first byte.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }
}
