//! Rotary position embeddings on the device, as [`crate::kernels::rotary`]: the same layout,
//! angles and checks; the frequencies travel by value in the launch (graph-safe, no upload).

use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::operand::{In, Out};
use super::{cover, launch, launch_args};
use crate::cuda::{CudaError, Gpu, Result};
use crate::kernels::rotary::RopeLayout;

/// The most frequencies one launch takes (`ROPE_MAX_FREQS` in `rotary.cu`).
pub const MAX_FREQS: usize = 128;

/// `RopeFreqs` of `rotary.cu`: the frequencies, zero-padded.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RopeFreqs {
    f: [f32; MAX_FREQS],
}

// SAFETY: plain floats with `RopeFreqs`'s C layout; any bits are a valid value.
unsafe impl DeviceRepr for RopeFreqs {}

/// `y` = `x` with RoPE applied (`inverse`: turned back), as [`crate::kernels::rotary::rope`];
/// `x` and `y` each f32 or bf16.
pub fn rope(
    gpu: &Gpu,
    x: In<'_, '_>,
    y: Out<'_, '_>,
    layout: RopeLayout,
    inv_freq: &[f32],
    inverse: bool,
) -> Result<()> {
    const K: &str = "rope";
    layout
        .check(K, inv_freq.len(), &[("x", x.len()), ("y", y.len())])
        .map_err(CudaError::from)?;
    if inv_freq.len() > MAX_FREQS {
        return Err(CudaError::Driver {
            call: format!("launching {K}"),
            message: format!(
                "{} rotary frequencies, more than the {MAX_FREQS} a launch takes",
                inv_freq.len()
            ),
        });
    }
    let mut freqs = RopeFreqs {
        f: [0.0; MAX_FREQS],
    };
    freqs.f[..inv_freq.len()].copy_from_slice(inv_freq);
    let dims = [
        layout.seq,
        layout.batch,
        layout.groups,
        layout.parts,
        layout.rotated,
        layout.head_dim,
        layout.rot,
    ]
    .map(|d| d as u64);
    let (interleaved, offset, inverse) = (
        i32::from(layout.interleaved),
        layout.offset as u64,
        i32::from(inverse),
    );
    let flags = [x.flag(), y.flag()];
    let mut args = launch_args(gpu, K)?;
    x.push(&mut args, &flags[0]);
    y.push(&mut args, &flags[1]);
    for d in &dims {
        args.arg(d);
    }
    args.arg(&interleaved)
        .arg(&offset)
        .arg(&inverse)
        .arg(&layout.amplitude)
        .arg(&freqs);
    launch(K, args, cover(x.len()))
}
