//! Helpers shared by the GPU test files: the device, deterministic inputs, and device buffers
//! placed after padding (an offset of one element breaks the 16-byte alignment, so that the
//! kernels' scalar paths run too). Each file uses some of them.
#![allow(dead_code)]

use megatron_core::cuda::{CudaSlice, Gpu};
use megatron_core::tensor::Tensor;

#[path = "../emulated/device.rs"]
pub mod device;

/// GPU 0 (the emulated GPU with `MEGATRON_EMULATED_GPU=1`, see [`device`]).
pub fn gpu() -> Gpu {
    device::install_if_requested(std::path::Path::new(env!("CARGO_MANIFEST_DIR")));
    Gpu::new(0).expect("a CUDA device with the driver and NVRTC on the library path")
}

/// Deterministic values in (−1, 1).
pub fn det(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

/// A host tensor of `data` in `shape`.
pub fn tensor(data: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(data, shape).unwrap()
}

/// `host` on the device after `offset` leading NaNs.
pub fn upload_at(gpu: &Gpu, host: &[f32], offset: usize) -> CudaSlice<f32> {
    let mut padded = vec![f32::NAN; offset];
    padded.extend_from_slice(host);
    gpu.upload(&padded).unwrap()
}

/// The elements of `dev` after its first `offset`.
pub fn download_at(gpu: &Gpu, dev: &CudaSlice<f32>, offset: usize) -> Vec<f32> {
    gpu.download(dev).unwrap()[offset..].to_vec()
}

/// Asserts that `got` (the device's) and `want` (the host's) have the same length and agree to
/// `rel` relative to `want`, or absolutely where `|want|` is below 1, naming `what` and the first
/// element that does not.
pub fn assert_close_rel(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: GPU {g} vs host {w} (tolerance {tol})"
        );
    }
}
