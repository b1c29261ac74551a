//! The CUDA backend in a build without the `cuda` feature: types with no values, so that the
//! code above the device seam compiles as it is and every path to a GPU is unreachable by type.
//! The one way in, [`Gpu::new`], says that the build has no CUDA.

use super::error::{CudaError, Result};
use crate::tensor::Tensor;

/// A GPU handle, in a build that has none: it cannot be made ([`Gpu::new`] fails).
#[derive(Debug, Clone)]
pub enum Gpu {}

impl Gpu {
    /// Fails: this build has no CUDA support.
    pub fn new(_ordinal: usize) -> Result<Gpu> {
        Err(CudaError::NotBuilt)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        match *self {}
    }

    /// Whether products round their f32 operands to bf16.
    pub fn bf16_products(&self) -> bool {
        match *self {}
    }

    /// Waits for the stream's work.
    pub fn synchronize(&self) -> Result<()> {
        match *self {}
    }
}

impl crate::backend::Backend for Gpu {}

/// A routing computed on a GPU, in a build that has none: never made (no GPU routes), so its
/// methods only say that the build has no CUDA.
#[derive(Debug, Clone)]
pub struct DeviceRouting {
    _never: (),
}

impl DeviceRouting {
    /// None: no GPU laid tokens out.
    pub fn permuted(&self) -> Option<&Tensor> {
        None
    }

    /// Fails: this build has no CUDA support.
    pub fn placed(&self) -> crate::Result<crate::moe::PlacedRouting> {
        Err(CudaError::NotBuilt.into())
    }

    /// Fails: this build has no CUDA support.
    pub fn read_back(&self) -> crate::Result<crate::moe::Routing> {
        Err(CudaError::NotBuilt.into())
    }

    /// Fails: this build has no CUDA support.
    pub fn backward(
        &self,
        _logits: &Tensor,
        _dprobs: &Tensor,
        _loss_scale: &Tensor,
    ) -> crate::Result<Tensor> {
        Err(CudaError::NotBuilt.into())
    }
}

/// CUDA graphs, in a build that has none.
pub mod graph {
    use super::{CudaError, Gpu};

    /// A captured CUDA graph, in a build that has none: never made.
    #[derive(Debug)]
    pub struct Graph {
        _never: (),
    }

    impl Graph {
        /// Unreachable: no [`Gpu`] exists.
        pub fn capture<E>(
            gpu: &Gpu,
            _label: &'static str,
            _region: impl FnOnce() -> std::result::Result<(), E>,
        ) -> std::result::Result<Graph, E>
        where
            E: From<CudaError>,
        {
            match *gpu {}
        }

        /// Fails: this build has no CUDA support.
        pub fn replay(&self) -> super::Result<()> {
            Err(CudaError::NotBuilt)
        }
    }
}

/// Device memory, in a build that has none.
#[derive(Debug)]
pub(crate) enum DeviceMemory {}

impl DeviceMemory {
    /// Unreachable: no [`Gpu`] exists.
    pub(crate) fn alloc(gpu: &Gpu, _bytes: usize, _zeroed: bool) -> Result<DeviceMemory> {
        match *gpu {}
    }

    /// Unreachable: no device memory exists.
    pub(crate) fn base(&self) -> u64 {
        match *self {}
    }
}

impl Tensor {
    /// Unreachable: no [`Gpu`] exists.
    pub fn to_gpu(&self, gpu: &Gpu) -> crate::Result<Tensor> {
        match *gpu {}
    }

    /// The tensor itself: every tensor of this build is on the host.
    pub fn to_host(&self) -> crate::Result<Tensor> {
        Ok(self.clone())
    }
}
