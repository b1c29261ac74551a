//! The GPU's side of the device seam (`crate::backend`): each backend trait implemented for
//! [`Gpu`] with the CUDA kernels and cuBLAS, one file per trait. Outputs are allocated on the
//! device; host operands (targets from the data loader) are uploaded.

mod attention;
mod bias;
mod elementwise;
mod embedding;
mod experts;
mod fused;
mod heads;
mod matmul;
mod norm;
mod optimizer;
mod rotary;
pub(crate) mod router;
mod rows;
mod vocab_loss;

use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

use super::{CudaError, Gpu};

impl crate::backend::Backend for Gpu {}

/// `t` on `gpu`: itself, or an upload of a host tensor (the upload waits for the stream).
pub(crate) fn on_gpu(gpu: &Gpu, t: &Tensor) -> Result<Tensor> {
    if t.gpu().is_some() {
        Ok(t.clone())
    } else {
        t.to_gpu(gpu)
    }
}

/// Contiguous i64 ids (tokens, targets) on `gpu`: device ids as they are, host ids queued for
/// upload on `gpu`'s stream without waiting for it (the caller checks host ids first).
pub(crate) fn ids_on_gpu(ids: &Tensor, gpu: &Gpu) -> Result<Tensor> {
    if ids.dtype() != DType::I64 {
        return invalid!("token ids must be i64, got {}", ids.dtype());
    }
    if ids.gpu().is_some() {
        return Ok(ids.contiguous()?);
    }
    let host = ids.contiguous()?;
    let out = Tensor::zeros_on(host.shape().clone(), DType::I64, gpu)?;
    if host.numel() == 0 {
        return Ok(out);
    }
    let src = host.read::<i64>()?;
    let mut dst = out.device_write::<i64>()?;
    // The driver stages a pageable source before the call returns.
    gpu.stream()
        .memcpy_htod(&*src, &mut dst.view_mut())
        .map_err(|e| CudaError::driver(format!("cuMemcpyHtoDAsync({} ids)", src.len()), e))?;
    drop(dst);
    Ok(out)
}
