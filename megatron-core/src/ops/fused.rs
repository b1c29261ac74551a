//! Fused element-wise kernels: what `#[megatron::module]` generates for each chain of
//! element-wise operations in a forward (`relu(h) * relu(h)`, `x * sigmoid(g)`, `a - b / 2.0`).
//!
//! The macros write, at compile time, one [`Fused`] per chain: a forward kernel that reads the
//! chain's tensor inputs and writes its output in one pass, and a backward kernel, derived from
//! each function's derivative rule, that reads what the forward kept and the output's gradient
//! and writes every input's gradient in one pass. Each kernel comes twice: a host loop over
//! slices (a Rust function calling [`crate::kernels::pointwise`]) and the CUDA C of the same
//! loop, compiled by NVRTC at its first use on a GPU and cached like the library's own kernels
//! (`cuda::programs`). [`fused`] and [`fused_backward`] run them on the device that holds the
//! tensors; nothing here knows what a chain computes.

use crate::backend;
use crate::error::Result;
use crate::invalid;
use crate::module::{Cx, Site};
use crate::tensor::Tensor;

/// A generated loop's host version: `inputs` and `outputs` are equally long slices (one part
/// of the tensors), `scalars` the chain's scalar operands in order.
pub type HostLoop = fn(inputs: &[&[f32]], scalars: &[f32], outputs: &mut [&mut [f32]]);

/// One generated kernel: a loop over equally shaped f32 tensors.
#[derive(Debug)]
pub struct FusedKernel {
    /// The CUDA kernel's name, unique in the process (it ends with a hash of the source).
    pub name: &'static str,
    /// What it computes, as the forward wrote it (for messages).
    pub formula: &'static str,
    /// Tensors it reads.
    pub inputs: usize,
    /// Scalars it takes (after the tensors in the CUDA signature).
    pub scalars: usize,
    /// Tensors it writes, of the inputs' shape.
    pub outputs: usize,
    /// The loop on the host.
    pub host: HostLoop,
    /// The CUDA C of the `extern "C" __global__` kernel `name`: for each input a pointer and
    /// its bf16 flag, for each output the same, then the scalars (`float`) and the element count
    /// (`u64`); it calls `cuda/cu/pointwise.cuh`'s functions.
    pub cuda: &'static str,
}

/// What a chain's backward reads besides the output's gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// The chain's inputs (the backward recomputes what it needs of the chain).
    Inputs,
    /// The chain's output (one function whose derivative is cheaper from its output, such as
    /// `sigmoid`; the next layer usually keeps the same tensor).
    Output,
}

/// A fused chain: its forward, its backward and what the backward reads.
#[derive(Debug)]
pub struct Fused {
    /// Reads the chain's inputs, writes its output.
    pub forward: FusedKernel,
    /// Reads the kept tensors then the output's gradient, writes each input's gradient.
    pub backward: FusedKernel,
    /// What [`fused`] keeps for [`fused_backward`].
    pub keep: Keep,
}

/// What [`fused`] keeps: the tensors its [`Keep`] names and the scalars.
#[derive(Debug, Clone)]
pub struct FusedSaved {
    kept: Vec<Tensor>,
    scalars: Vec<f32>,
}

/// Runs one generated kernel on the device of its inputs (all of one shape); returns its
/// outputs.
pub fn run_kernel(
    kernel: &'static FusedKernel,
    inputs: &[&Tensor],
    scalars: &[f32],
) -> Result<Vec<Tensor>> {
    if inputs.len() != kernel.inputs || scalars.len() != kernel.scalars {
        return invalid!(
            "fused kernel `{}` ({}) takes {} tensors and {} scalars, given {} and {}",
            kernel.name,
            kernel.formula,
            kernel.inputs,
            kernel.scalars,
            inputs.len(),
            scalars.len()
        );
    }
    let Some(first) = inputs.first() else {
        return invalid!(
            "fused kernel `{}` ({}) has no tensor input",
            kernel.name,
            kernel.formula
        );
    };
    if let Some(other) = inputs.iter().find(|t| t.shape() != first.shape()) {
        return invalid!(
            "`{}`: element-wise operations need tensors of one shape, but {} meets {} (a \
             broadcast is written as a scalar: a literal, a #[config] value or a constant)",
            kernel.formula,
            first.shape(),
            other.shape()
        );
    }
    backend::of_any(inputs).fused(kernel, inputs, scalars)
}

/// The forward of a fused chain: its output, and what its backward needs.
pub fn fused(
    _cx: &Cx,
    _site: Site,
    chain: &'static Fused,
    inputs: &[&Tensor],
    scalars: &[f32],
) -> Result<(Tensor, FusedSaved)> {
    let mut out = run_kernel(&chain.forward, inputs, scalars)?;
    let y = out.pop().ok_or_else(|| {
        crate::error::Error::Invalid(format!("`{}` wrote no output", chain.forward.formula))
    })?;
    let kept = match chain.keep {
        Keep::Inputs => inputs.iter().map(|&t| t.clone()).collect(),
        Keep::Output => vec![y.clone()],
    };
    let saved = FusedSaved {
        kept,
        scalars: scalars.to_vec(),
    };
    Ok((y, saved))
}

/// The backward of a fused chain: the gradient of each of its `N` inputs, in order.
pub fn fused_backward<const N: usize>(
    _cx: &Cx,
    _site: Site,
    chain: &'static Fused,
    saved: FusedSaved,
    dy: &Tensor,
) -> Result<[Tensor; N]> {
    let mut reads: Vec<&Tensor> = saved.kept.iter().collect();
    reads.push(dy);
    let grads = run_kernel(&chain.backward, &reads, &saved.scalars)?;
    crate::module::gradients(chain.forward.formula, grads)
}

/// A scalar operand of element-wise math in forward (`x * 2.0`, `x / self.temperature`), as the
/// fused kernels take it: an `f32`.
pub trait IntoScalar {
    /// The value as an `f32` (rounded to nearest).
    fn into_scalar(self) -> f32;
}

macro_rules! into_scalar {
    ($($t:ty),*) => {
        $(
            impl IntoScalar for $t {
                #[allow(clippy::cast_lossless, clippy::unnecessary_cast)]
                fn into_scalar(self) -> f32 {
                    self as f32
                }
            }
        )*
    };
}

into_scalar!(f32, f64, i8, i16, i32, i64, isize, u8, u16, u32, u64, usize);
