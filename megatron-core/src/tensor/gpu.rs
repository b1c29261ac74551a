//! Tensors in GPU memory (feature `cuda`): allocation on a rank's [`Gpu`] and copies between
//! host and device. A device tensor has the same views (narrow, reshape, transpose) as a host
//! tensor; host code that reads elements refuses it with [`TensorError::Device`].

use std::sync::Arc;

use cudarc::driver::result::{memcpy_dtoh_async, memcpy_htod_async};

use super::{Layout, Shape, Storage, Tensor};
use crate::cuda::{CudaError, Gpu};
use crate::error::Result;
use crate::tensor::DType;

impl Tensor {
    /// A tensor of zeros in `gpu`'s memory.
    pub fn zeros_on(shape: impl Into<Shape>, dtype: DType, gpu: &Gpu) -> Result<Tensor> {
        let shape = shape.into();
        let storage = Storage::on_gpu(gpu, dtype, shape.numel())?;
        Ok(Tensor {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape, 0),
        })
    }

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
