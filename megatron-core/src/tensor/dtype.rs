//! Element types: f32 for compute, bf16/f16 for storage and communication, i64 for indices.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use super::storage::CpuBuffer;

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision: the compute type.
    F32,
    /// bfloat16: storage and communication.
    BF16,
    /// IEEE half precision: storage and communication.
    F16,
    /// Signed 64-bit integers: token ids, counts, indices.
    I64,
}

impl DType {
    /// Every element type.
    pub const ALL: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::I64];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }

    /// The lower-case name, as in `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for i64 {}
}

/// A Rust type that can be a tensor element.
pub trait Element:
    Copy + Default + PartialEq + PartialOrd + fmt::Debug + Send + Sync + 'static + sealed::Sealed
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Converts to f32 (exact for every float type; rounds for large i64).
    fn to_f32(self) -> f32;
    /// Converts from f32, rounding to nearest.
    fn from_f32(value: f32) -> Self;
    /// The buffer's elements if it holds this type.
    fn slice(buffer: &CpuBuffer) -> Option<&[Self]>;
    /// The buffer's elements, mutably, if it holds this type.
    fn slice_mut(buffer: &mut CpuBuffer) -> Option<&mut [Self]>;
    /// Wraps a vector as a buffer.
    fn into_buffer(data: Vec<Self>) -> CpuBuffer;
}

macro_rules! element {
    ($ty:ty, $dtype:ident, $to:expr, $from:expr) => {
        impl Element for $ty {
            const DTYPE: DType = DType::$dtype;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to(self)
            }
            #[inline(always)]
            fn from_f32(value: f32) -> Self {
                $from(value)
            }
            fn slice(buffer: &CpuBuffer) -> Option<&[Self]> {
                match buffer {
                    CpuBuffer::$dtype(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(buffer: &mut CpuBuffer) -> Option<&mut [Self]> {
                match buffer {
                    CpuBuffer::$dtype(v) => Some(v),
                    _ => None,
                }
            }
            fn into_buffer(data: Vec<Self>) -> CpuBuffer {
                CpuBuffer::$dtype(data)
            }
        }
    };
}

element!(f32, F32, |x: f32| x, |x: f32| x);
element!(bf16, BF16, bf16::to_f32, bf16::from_f32);
element!(f16, F16, f16::to_f32, f16::from_f32);
element!(i64, I64, |x: i64| x as f32, |x: f32| x as i64);
