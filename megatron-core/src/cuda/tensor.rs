//! Tensors in GPU memory (feature `cuda`): allocation on a rank's [`Gpu`] and copies between
//! host and device. A device tensor has the same views (narrow, reshape, transpose) as a host
//! tensor; host code that reads elements refuses it with [`TensorError::Device`].

use std::sync::Arc;

use cudarc::driver::result::{memcpy_dtoh_async, memcpy_htod_async};

use crate::backend::MemoryOps;
use crate::cuda::{CudaError, Gpu};
use crate::error::Result;
use crate::tensor::DType;
use crate::tensor::{Device, Layout, RawBorrow, Shape, Tensor, TensorError, gpu_error};

impl Tensor {
    /// A contiguous copy of this host tensor in `gpu`'s memory (returns when the copy is done).
    pub fn to_gpu(&self, gpu: &Gpu) -> Result<Tensor> {
        let host = self.contiguous()?;
        let out = Tensor::zeros_on(self.shape().clone(), self.dtype(), gpu)?;
        let bytes = self.numel() * self.dtype().size();
        if bytes == 0 {
            return Ok(out);
        }
        let src = host.raw_read("to_gpu")?;
        let dst = out.raw_device_write("to_gpu")?;
        // SAFETY: `src` borrows `bytes` bytes of host memory and `dst` as many of device memory;
        // the stream is synchronised before either borrow ends.
        unsafe {
            let src = std::slice::from_raw_parts(src.addr() as *const u8, bytes);
            memcpy_htod_async(dst.addr() as u64, src, gpu.stream().cu_stream())
                .map_err(|e| CudaError::driver(format!("cuMemcpyHtoDAsync({bytes} bytes)"), e))?;
        }
        gpu.synchronize()?;
        drop((src, dst));
        Ok(out)
    }

    /// A host copy of this contiguous device tensor, after the work queued on its stream.
    pub fn to_host(&self) -> Result<Tensor> {
        let Some(gpu) = self.gpu() else {
            return Ok(self.clone());
        };
        let out = Tensor::zeros(self.shape().clone(), self.dtype());
        let bytes = self.numel() * self.dtype().size();
        if bytes == 0 {
            return Ok(out);
        }
        let src = self.raw_device_read("to_host")?;
        let dst = out.raw_write("to_host")?;
        // SAFETY: as in `to_gpu`, the other way.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(dst.addr() as *mut u8, bytes);
            memcpy_dtoh_async(dst, src.addr() as u64, gpu.stream().cu_stream())
                .map_err(|e| CudaError::driver(format!("cuMemcpyDtoHAsync({bytes} bytes)"), e))?;
        }
        gpu.synchronize()?;
        drop((src, dst));
        Ok(out)
    }
}

/// A contiguous device tensor's elements presented to cudarc as a slice it does not own: the
/// typed views the CUDA kernels take. Holds the tensor's borrow (read or write) while it lives.
pub struct DeviceSlice<'a, T> {
    slice: std::mem::ManuallyDrop<crate::cuda::CudaSlice<T>>,
    _borrow: crate::tensor::RawBorrow<'a>,
}

impl<T> DeviceSlice<'_, T> {
    /// The elements, for reading.
    pub fn view(&self) -> crate::cuda::CudaView<'_, T> {
        self.slice.as_view()
    }

    /// The elements, for writing (only from [`Tensor::device_write`]).
    pub fn view_mut(&mut self) -> crate::cuda::CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }
}

impl<T> Drop for DeviceSlice<'_, T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `leak` hands the memory back without freeing it (the
        // tensor's storage owns it).
        let slice = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
        slice.leak();
    }
}

impl std::fmt::Debug for DeviceSlice<'_, f32> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSlice({} elements)", self.slice.len())
    }
}

impl Tensor {
    /// Borrows a contiguous device view's elements (device addresses) for reading.
    pub(crate) fn raw_device_read(&self, op: &'static str) -> crate::tensor::Result<RawBorrow<'_>> {
        self.require_gpu(op)?;
        self.raw_borrow(op, false)
    }

    /// Borrows a contiguous device view's elements (device addresses) for writing.
    pub(crate) fn raw_device_write(
        &self,
        op: &'static str,
    ) -> crate::tensor::Result<RawBorrow<'_>> {
        self.require_gpu(op)?;
        self.raw_borrow(op, true)
    }

    /// Checks that the elements are in device memory, naming `op` otherwise.
    fn require_gpu(&self, op: &'static str) -> crate::tensor::Result<()> {
        match self.device() {
            Device::Cuda(_) => Ok(()),
            actual => Err(TensorError::Device {
                op,
                expected: "a CUDA device",
                actual,
            }),
        }
    }

    /// Borrows a contiguous device tensor of element type `T` for reading by a kernel.
    pub fn device_read<T: crate::tensor::Element>(
        &self,
    ) -> crate::tensor::Result<DeviceSlice<'_, T>> {
        self.device_slice("device_read", false)
    }

    /// Borrows a contiguous device tensor of element type `T` for writing by a kernel.
    pub fn device_write<T: crate::tensor::Element>(
        &self,
    ) -> crate::tensor::Result<DeviceSlice<'_, T>> {
        self.device_slice("device_write", true)
    }

    fn device_slice<T: crate::tensor::Element>(
        &self,
        op: &'static str,
        write: bool,
    ) -> crate::tensor::Result<DeviceSlice<'_, T>> {
        if self.dtype() != T::DTYPE {
            return Err(crate::tensor::TensorError::DType {
                op,
                expected: T::DTYPE,
                actual: self.dtype(),
            });
        }
        let borrow = if write {
            self.raw_device_write(op)?
        } else {
            self.raw_device_read(op)?
        };
        let gpu = self.gpu().ok_or(crate::tensor::TensorError::Device {
            op,
            expected: "a CUDA device",
            actual: self.device(),
        })?;
        // SAFETY: the borrow covers `numel` elements of `T` at this address for the guard's
        // life; the slice is leaked (never freed) when the guard drops.
        let slice = unsafe {
            gpu.stream()
                .upgrade_device_ptr::<T>(borrow.addr() as u64, self.numel())
        };
        Ok(DeviceSlice {
            slice: std::mem::ManuallyDrop::new(slice),
            _borrow: borrow,
        })
    }
}

impl Tensor {
    /// A 1-D view of `len` storage elements from `start`, whatever this view's layout.
    pub(crate) fn span_view(&self, start: usize, len: usize) -> crate::tensor::Result<Tensor> {
        Ok(Tensor::from_storage(
            Arc::clone(self.storage()),
            Layout::contiguous(Shape::from(vec![len]), start),
        ))
    }

    /// This (new, contiguous 1-D) tensor's storage viewed with `layout` shifted down by `start`:
    /// the copy of another tensor's span keeps that tensor's strides.
    pub(crate) fn relayout(&self, layout: &Layout, start: usize) -> crate::tensor::Result<Tensor> {
        let mut l = layout.clone();
        l.offset -= start;
        Ok(Tensor::from_storage(Arc::clone(self.storage()), l))
    }

    /// Borrows the storage span a device view touches; returns the address of the storage's
    /// element 0 (so that `layout.offset` and strides address elements) and the borrow.
    pub(crate) fn raw_device_span_read(
        &self,
        op: &'static str,
    ) -> crate::tensor::Result<(u64, crate::tensor::RawBorrow<'_>)> {
        self.device_span(op, false)
    }

    /// [`Tensor::raw_device_span_read`] for writing.
    pub(crate) fn raw_device_span_write(
        &self,
        op: &'static str,
    ) -> crate::tensor::Result<(u64, crate::tensor::RawBorrow<'_>)> {
        self.device_span(op, true)
    }

    fn device_span(
        &self,
        op: &'static str,
        write: bool,
    ) -> crate::tensor::Result<(u64, crate::tensor::RawBorrow<'_>)> {
        if self.gpu().is_none() {
            return Err(crate::tensor::TensorError::Device {
                op,
                expected: "a CUDA device",
                actual: self.device(),
            });
        }
        let (start, end) = (self.layout().offset, self.layout().end());
        let borrow = self
            .storage()
            .borrow(start, end.max(start), write)
            .map_err(|e| crate::tensor::borrow_failed(e, op, write))?;
        let base = borrow.addr() as u64 - (start * self.dtype().size()) as u64;
        Ok((base, borrow))
    }
}

/// Dimensions and strides of a view of up to 8 dimensions, passed to `copy_strided` and
/// `copy_to_strided` by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct View8 {
    dims: [i64; 8],
    strides: [i64; 8],
}

// SAFETY: plain integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for View8 {}

impl View8 {
    /// The view of merged (size, stride) pairs (at most 8), padded with dimensions of size 1.
    fn of(merged: &[(usize, usize)]) -> View8 {
        let mut view = View8 {
            dims: [1; 8],
            strides: [0; 8],
        };
        for (d, &(size, stride)) in merged.iter().enumerate() {
            view.dims[d] = size as i64;
            view.strides[d] = stride as i64;
        }
        view
    }
}

/// A view's (size, stride) pairs with the dimensions of size 1 dropped and each dimension
/// merged into the one before it where the two walk memory as one (outer stride = inner size ×
/// inner stride): a contiguous view becomes one dimension of stride 1, and a strided copy does
/// the least index arithmetic per element.
fn merged_view(dims: &[usize], strides: &[usize]) -> Vec<(usize, usize)> {
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(dims.len());
    for (&size, &stride) in dims.iter().zip(strides) {
        if size == 1 {
            continue;
        }
        match merged.last_mut() {
            Some(last) if last.1 == size * stride => *last = (last.0 * size, stride),
            _ => merged.push((size, stride)),
        }
    }
    if merged.is_empty() {
        merged.push((1, 1));
    }
    merged
}

/// The kernels' code of an element type.
fn type_code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        DType::I64 => Some(3),
    }
}

impl Tensor {
    /// A contiguous host copy (a download for device tensors).
    pub(crate) fn to_host_contiguous(&self) -> crate::tensor::Result<Tensor> {
        let dense = self.contiguous()?;
        dense.to_host().map_err(gpu_error("to_host"))
    }

    /// [`Tensor::copy_from`] where either side is on a GPU (same shape, checked by the caller).
    pub(crate) fn copy_from_device(&self, src: &Tensor) -> crate::tensor::Result<()> {
        use cudarc::driver::PushKernelArg;
        const OP: &str = "copy_from";
        let Some(gpu) = self.gpu().cloned() else {
            // Device to host: download, then copy on the host.
            return self.copy_from(&src.to_host_contiguous()?);
        };
        let src = if src.gpu().is_none() {
            src.to_gpu(&gpu).map_err(crate::tensor::gpu_error(OP))?
        } else {
            src.clone()
        };
        if src.device() != self.device() {
            return Err(crate::tensor::TensorError::Device {
                op: OP,
                expected: "the destination's device",
                actual: src.device(),
            });
        }
        let n = self.numel();
        if n == 0 {
            return Ok(());
        }
        let (Some(st), Some(dt)) = (type_code(src.dtype()), type_code(self.dtype())) else {
            return Err(crate::tensor::TensorError::Gpu {
                op: OP,
                message: format!(
                    "{} → {} copies are not on the GPU yet",
                    src.dtype(),
                    self.dtype()
                ),
            });
        };
        if !self.is_contiguous() {
            return self.scatter_from_device(&src.contiguous()?, &gpu, (st, dt));
        }
        let merged = merged_view(src.dims(), &src.layout().strides);
        if merged.len() > 8 {
            return Err(crate::tensor::TensorError::Gpu {
                op: OP,
                message: format!(
                    "views of {} dimensions that do not merge (at most 8 on the GPU)",
                    merged.len()
                ),
            });
        }
        let dense = matches!(merged[..], [(_, 1)]);
        if !dense && u32::try_from(n).is_err() {
            return Err(crate::tensor::TensorError::Gpu {
                op: OP,
                message: format!("strided views of {n} elements (at most 2³² − 1 on the GPU)"),
            });
        }
        let (src_base, src_borrow) = src.raw_device_span_read(OP)?;
        let dst = self.raw_device_write(OP)?;
        let dst_addr = dst.addr() as u64;
        let bytes = self.dtype().size() as i32;
        let offset = src.layout().offset as i64;
        let kernel = if dense { "copy_dense" } else { "copy_strided" };
        // Under the profiler, copies are told apart by their types and view.
        let label: std::borrow::Cow<'static, str> = if crate::cuda::profile::enabled() {
            let view = if dense {
                "contiguous".to_string()
            } else {
                format!("{merged:?}")
            };
            format!("{kernel} {}→{} {view}", src.dtype(), self.dtype()).into()
        } else {
            kernel.into()
        };
        let f = gpu
            .kernels()
            .get(kernel)
            .map_err(crate::tensor::gpu_error(OP))?;
        let mut args = gpu.stream().launch_builder(f);
        let n64 = n as u64;
        let src_first = src_base + (offset as u64) * (src.dtype().size() as u64);
        let view = View8::of(&merged);
        let nd = merged.len() as i32;
        if dense {
            args.arg(&src_first)
                .arg(&st)
                .arg(&dst_addr)
                .arg(&dt)
                .arg(&n64)
                .arg(&bytes);
        } else {
            args.arg(&src_base)
                .arg(&st)
                .arg(&dst_addr)
                .arg(&dt)
                .arg(&n64)
                .arg(&nd)
                .arg(&offset)
                .arg(&view)
                .arg(&bytes);
        }
        crate::cuda::kernels::launch(&label, args, crate::cuda::kernels::cover(n))
            .map_err(crate::tensor::gpu_error(OP))?;
        drop((src_borrow, dst));
        Ok(())
    }

    /// [`Tensor::copy_from`] into a strided view of device memory (a part of a wider tensor)
    /// from a contiguous device tensor `src`: one launch writing each element where the view
    /// puts it. `types` are the source's and the destination's type codes.
    fn scatter_from_device(
        &self,
        src: &Tensor,
        gpu: &crate::cuda::Gpu,
        types: (i32, i32),
    ) -> crate::tensor::Result<()> {
        use cudarc::driver::PushKernelArg;
        const OP: &str = "copy_from";
        let n = self.numel();
        let merged = merged_view(self.dims(), &self.layout().strides);
        if merged.len() > 8 || u32::try_from(n).is_err() {
            return Err(crate::tensor::TensorError::Gpu {
                op: OP,
                message: format!(
                    "a strided destination of {n} elements in {} dimensions that do not merge (at \
                     most 2³² − 1 elements and 8 dimensions on the GPU)",
                    merged.len()
                ),
            });
        }
        let view = View8::of(&merged);
        let source = src.raw_device_read(OP)?;
        let src_addr = source.addr() as u64;
        let (dst_base, dst) = self.raw_device_span_write(OP)?;
        let f = gpu
            .kernels()
            .get("copy_to_strided")
            .map_err(crate::tensor::gpu_error(OP))?;
        let (st, dt) = types;
        let (n64, nd) = (n as u64, merged.len() as i32);
        let offset = self.layout().offset as i64;
        let bytes = self.dtype().size() as i32;
        let mut args = gpu.stream().launch_builder(f);
        args.arg(&src_addr)
            .arg(&st)
            .arg(&dst_base)
            .arg(&dt)
            .arg(&n64)
            .arg(&nd)
            .arg(&offset)
            .arg(&view)
            .arg(&bytes);
        let label: std::borrow::Cow<'static, str> = if crate::cuda::profile::enabled() {
            format!(
                "copy_to_strided {}→{} {merged:?}",
                src.dtype(),
                self.dtype()
            )
            .into()
        } else {
            "copy_to_strided".into()
        };
        crate::cuda::kernels::launch(&label, args, crate::cuda::kernels::cover(n))
            .map_err(crate::tensor::gpu_error(OP))?;
        drop((source, dst));
        Ok(())
    }

    /// [`Tensor::fill`] on the GPU.
    pub(crate) fn fill_device(&self, value: f32) -> crate::tensor::Result<()> {
        use cudarc::driver::PushKernelArg;
        const OP: &str = "fill";
        let Some(gpu) = self.gpu().cloned() else {
            return self.fill(value);
        };
        let bits: u64 = match self.dtype() {
            DType::F32 => u64::from(value.to_bits()),
            DType::BF16 => u64::from(half::bf16::from_f32(value).to_bits()),
            DType::F16 => u64::from(half::f16::from_f32(value).to_bits()),
            DType::I64 => value as i64 as u64,
        };
        let n = self.numel();
        if n == 0 {
            return Ok(());
        }
        let buf = self.raw_device_write(OP)?;
        let (addr, size, n64) = (buf.addr() as u64, self.dtype().size() as i32, n as u64);
        let f = gpu
            .kernels()
            .get("fill_bits")
            .map_err(crate::tensor::gpu_error(OP))?;
        let mut args = gpu.stream().launch_builder(f);
        args.arg(&addr).arg(&bits).arg(&size).arg(&n64);
        crate::cuda::kernels::launch("fill_bits", args, crate::cuda::kernels::cover(n))
            .map_err(crate::tensor::gpu_error(OP))?;
        drop(buf);
        Ok(())
    }
}

impl MemoryOps for Gpu {
    fn download_tensor(&self, t: &Tensor) -> crate::tensor::Result<Tensor> {
        t.to_host_contiguous()
    }

    fn copy_tensor(&self, dst: &Tensor, src: &Tensor) -> crate::tensor::Result<()> {
        dst.copy_from_device(src)
    }

    fn fill_tensor(&self, t: &Tensor, value: f32) -> crate::tensor::Result<()> {
        t.fill_device(value)
    }
}

#[cfg(test)]
mod tests {
    use super::merged_view;

    #[test]
    fn views_merge_into_the_fewest_dimensions_that_walk_memory_alike() {
        // Contiguous: one dimension of stride 1, size-1 dimensions dropped.
        assert_eq!(merged_view(&[2, 1, 3, 4], &[12, 99, 4, 1]), vec![(24, 1)]);
        // A scalar.
        assert_eq!(merged_view(&[], &[]), vec![(1, 1)]);
        // A transpose does not merge.
        assert_eq!(merged_view(&[4, 6], &[1, 4]), vec![(4, 1), (6, 4)]);
        // Rows narrowed out of a wider matrix: the rows stay apart, the leading batch merges.
        assert_eq!(merged_view(&[2, 3, 5], &[30, 10, 1]), vec![(6, 10), (5, 1)]);
        // Every other element.
        assert_eq!(merged_view(&[3, 4], &[8, 2]), vec![(12, 2)]);
        // Overlapping unit strides stay two dimensions (not a contiguous run of 12).
        assert_eq!(merged_view(&[3, 4], &[1, 1]), vec![(3, 1), (4, 1)]);
        // Broadcast dimensions merge with each other only.
        assert_eq!(merged_view(&[2, 3, 4], &[0, 0, 1]), vec![(6, 0), (4, 1)]);
    }
}
