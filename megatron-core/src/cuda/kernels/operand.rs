//! The buffers a kernel reads or writes as f32 or bf16 (the `bf16` flag after the pointer in
//! the CUDA signatures), and device tensors handed to a kernel as such.

use cudarc::driver::{CudaView, CudaViewMut, LaunchArgs, PushKernelArg};
use half::bf16;

use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// An input, f32 or bf16.
#[derive(Clone, Copy)]
pub enum In<'a, 'b> {
    /// f32 values.
    F32(&'a CudaView<'b, f32>),
    /// bf16 values (widened to f32 in the kernel).
    Bf16(&'a CudaView<'b, bf16>),
}

impl<'a> In<'a, '_> {
    /// Elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            In::F32(v) => v.len(),
            In::Bf16(v) => v.len(),
        }
    }

    /// The `bf16` flag the kernels take after the buffer.
    pub(crate) fn flag(&self) -> i32 {
        i32::from(matches!(self, In::Bf16(_)))
    }

    /// Pushes the buffer and its `bf16` flag.
    pub(crate) fn push(self, args: &mut LaunchArgs<'a>, flag: &'a i32) {
        match self {
            In::F32(v) => args.arg(v),
            In::Bf16(v) => args.arg(v),
        };
        args.arg(flag);
    }
}

/// An output, in f32 or rounded to bf16 (to nearest even).
pub enum Out<'a, 'b> {
    /// Written as f32.
    F32(&'a mut CudaViewMut<'b, f32>),
    /// Rounded to bf16, for bf16 products.
    Bf16(&'a mut CudaViewMut<'b, bf16>),
}

impl<'a> Out<'a, '_> {
    /// Elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            Out::F32(v) => v.len(),
            Out::Bf16(v) => v.len(),
        }
    }

    /// The `bf16` flag the kernels take after the buffer.
    pub(crate) fn flag(&self) -> i32 {
        i32::from(matches!(self, Out::Bf16(_)))
    }

    /// Pushes the buffer and its `bf16` flag (an `int` after the pointer).
    pub(crate) fn push(self, args: &mut LaunchArgs<'a>, flag: &'a i32) {
        match self {
            Out::F32(v) => args.arg(v),
            Out::Bf16(v) => args.arg(v),
        };
        args.arg(flag);
    }
}

/// `t` contiguous for a kernel that reads f32 or bf16: bf16 kept, every other dtype as f32.
pub(crate) fn contiguous_input(t: &Tensor) -> Result<Tensor> {
    let dtype = if t.dtype() == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    Ok(t.to_contiguous(dtype)?)
}

/// Runs `f` with the device tensor `t` (f32, or else bf16) as a kernel's input.
pub(crate) fn with_in<R>(t: &Tensor, f: impl FnOnce(In<'_, '_>) -> Result<R>) -> Result<R> {
    if t.dtype() == DType::BF16 {
        f(In::Bf16(&t.device_read::<bf16>()?.view()))
    } else {
        f(In::F32(&t.device_read::<f32>()?.view()))
    }
}

/// Runs `f` with the device tensor `t` (f32, or else bf16) as a kernel's output.
pub(crate) fn with_out<R>(t: &Tensor, f: impl FnOnce(Out<'_, '_>) -> Result<R>) -> Result<R> {
    if t.dtype() == DType::BF16 {
        f(Out::Bf16(&mut t.device_write::<bf16>()?.view_mut()))
    } else {
        f(Out::F32(&mut t.device_write::<f32>()?.view_mut()))
    }
}

/// Runs `f` with `t`, if any, as a kernel's optional output.
pub(crate) fn with_optional_out<R>(
    t: Option<&Tensor>,
    f: impl FnOnce(Option<Out<'_, '_>>) -> Result<R>,
) -> Result<R> {
    match t {
        Some(t) => with_out(t, |out| f(Some(out))),
        None => f(None),
    }
}
