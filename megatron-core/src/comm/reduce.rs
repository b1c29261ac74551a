//! Element-wise reductions every backend shares, so that all of them combine ranks' values the
//! same way: in f32, in group-rank order, rounded once to the element type. The same inputs
//! therefore give bit-identical results on the thread, MPI and device backends.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::ReduceOp;

/// Elements reduced in one pass of an accumulator (16 KiB of f32: stays in L1).
pub(crate) const BLOCK: usize = 4096;

/// `acc = acc op x`, element-wise.
fn combine_f32(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum => acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
        ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.min(*b)),
    }
}

/// A float element type that reductions widen to f32.
pub(crate) trait Widen: Copy {
    /// `dst = src` in f32.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `dst = src` rounded to the element type.
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `acc = acc op src`, using `tmp` for the widened values if needed.
    fn combine(acc: &mut [f32], src: &[Self], tmp: &mut [f32], op: ReduceOp) {
        Self::widen(src, tmp);
        combine_f32(acc, tmp, op);
    }
    /// `acc = a op b`.
    fn combine2(acc: &mut [f32], a: &[Self], b: &[Self], tmp: &mut [f32], op: ReduceOp) {
        Self::widen(a, acc);
        Self::combine(acc, b, tmp, op);
    }
}

impl Widen for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn combine(acc: &mut [f32], src: &[f32], _tmp: &mut [f32], op: ReduceOp) {
        combine_f32(acc, src, op);
    }
    fn combine2(acc: &mut [f32], a: &[f32], b: &[f32], _tmp: &mut [f32], op: ReduceOp) {
        let pairs = acc.iter_mut().zip(a.iter().zip(b));
        match op {
            ReduceOp::Sum => pairs.for_each(|(o, (x, y))| *o = x + y),
            ReduceOp::Max => pairs.for_each(|(o, (x, y))| *o = x.max(*y)),
            ReduceOp::Min => pairs.for_each(|(o, (x, y))| *o = x.min(*y)),
        }
    }
}

impl Widen for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Widen for f16 {
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// Reduces equal-length `sources` in order into `acc` (f32, of their length), with `tmp` as
/// scratch of the same length; returns false (leaving `acc` alone) when there is no source.
pub(crate) fn fold_float<T: Widen>(
    sources: &[&[T]],
    acc: &mut [f32],
    tmp: &mut [f32],
    op: ReduceOp,
) -> bool {
    match sources {
        [] => return false,
        [only] => T::widen(only, acc),
        [first, second, rest @ ..] => {
            T::combine2(acc, first, second, tmp, op);
            for src in rest {
                T::combine(acc, src, tmp, op);
            }
        }
    }
    true
}

/// Reduces equal-length i64 `sources` in order into `acc` (exact, wrapping sums).
pub(crate) fn fold_i64(sources: &[&[i64]], acc: &mut Vec<i64>, op: ReduceOp) {
    acc.clear();
    let mut sources = sources.iter();
    if let Some(first) = sources.next() {
        acc.extend_from_slice(first);
    }
    for s in sources {
        match op {
            ReduceOp::Sum => acc
                .iter_mut()
                .zip(s.iter())
                .for_each(|(a, b)| *a = a.wrapping_add(*b)),
            ReduceOp::Max => acc
                .iter_mut()
                .zip(s.iter())
                .for_each(|(a, b)| *a = (*a).max(*b)),
            ReduceOp::Min => acc
                .iter_mut()
                .zip(s.iter())
                .for_each(|(a, b)| *a = (*a).min(*b)),
        }
    }
}
