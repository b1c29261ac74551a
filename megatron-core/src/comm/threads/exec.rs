//! The data movement of the in-process backend: reductions and copies over raw buffers of all
//! members, split among a few worker ranks.
//!
//! Once every member of a group has arrived, its buffers stay borrowed (and their owners waiting)
//! until every worker has finished, so the raw addresses below stay valid and no two workers touch
//! the same element: workers take disjoint element ranges of one plan.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::comm::ReduceOp;
use crate::tensor::DType;

/// A contiguous run of elements in some rank's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawBuf {
    /// Address of the first element.
    pub addr: usize,
    /// Number of elements.
    pub len: usize,
}

impl RawBuf {
    /// The sub-run of `len` elements starting `start` elements in, for elements of `size` bytes.
    pub fn slice(self, start: usize, len: usize, size: usize) -> RawBuf {
        debug_assert!(start + len <= self.len);
        RawBuf {
            addr: self.addr + start * size,
            len,
        }
    }
}

/// Elements reduced in one pass of a worker's accumulator (16 KiB of f32: stays in L1).
const BLOCK: usize = 4096;
/// Worker shares start at multiples of this many elements (whole cache lines for every dtype).
const ALIGN: usize = 64;

/// One output of a reduction: the sources, reduced in order, and where the result goes.
#[derive(Debug, Clone)]
pub(crate) struct ReduceSegment {
    /// One run per member, all of the segment's length, reduced in this order.
    pub sources: Vec<RawBuf>,
    /// Runs that receive the result.
    pub dests: Vec<RawBuf>,
}

/// The work of one collective, shared by its workers.
#[derive(Debug, Clone)]
pub(crate) enum Plan {
    /// Nothing to move (barrier, empty buffers).
    Nothing,
    /// Element-wise reductions.
    Reduce {
        dtype: DType,
        op: ReduceOp,
        segments: Vec<ReduceSegment>,
    },
    /// Copies `(source, destination)`; identical runs are skipped.
    Copy {
        dtype: DType,
        jobs: Vec<(RawBuf, RawBuf)>,
    },
}

impl Plan {
    /// Runs worker `worker`'s share of `workers` equal shares.
    ///
    /// # Safety
    /// Every run must be valid for the plan's dtype for the whole call, sources must not be
    /// written by anyone, destinations must be written only through this plan, and a destination
    /// may overlap a source only as the identical run (in-place).
    pub unsafe fn execute(&self, worker: usize, workers: usize) {
        match self {
            Plan::Nothing => {}
            Plan::Reduce {
                dtype,
                op,
                segments,
            } => {
                let total: usize = segments
                    .iter()
                    .map(|s| s.dests.first().map_or(0, |d| d.len))
                    .sum();
                let (start, end) = share(total, worker, workers);
                let mut acc = vec![0f32; BLOCK];
                let mut tmp = vec![0f32; BLOCK];
                let mut acc_i = Vec::new();
                let mut base = 0;
                for seg in segments {
                    let len = seg.dests.first().map_or(0, |d| d.len);
                    let (lo, hi) = (start.max(base), end.min(base + len));
                    let mut at = lo;
                    while at < hi {
                        let n = BLOCK.min(hi - at);
                        let off = at - base;
                        // SAFETY: forwarded from the caller; [off, off + n) lies in every run.
                        unsafe {
                            match dtype {
                                DType::F32 => {
                                    reduce_float::<f32>(seg, off, n, *op, &mut acc, &mut tmp)
                                }
                                DType::BF16 => {
                                    reduce_float::<bf16>(seg, off, n, *op, &mut acc, &mut tmp)
                                }
                                DType::F16 => {
                                    reduce_float::<f16>(seg, off, n, *op, &mut acc, &mut tmp)
                                }
                                DType::I64 => reduce_i64(seg, off, n, *op, &mut acc_i),
                            }
                        }
                        at += n;
                    }
                    base += len;
                }
            }
            Plan::Copy { dtype, jobs } => {
                let size = dtype.size();
                let total: usize = jobs.iter().map(|(s, _)| s.len).sum();
                let (start, end) = share(total, worker, workers);
                let mut base = 0;
                for &(src, dst) in jobs {
                    let (lo, hi) = (start.max(base), end.min(base + src.len));
                    if lo < hi && src.addr != dst.addr {
                        let off = (lo - base) * size;
                        // SAFETY: forwarded from the caller; distinct runs do not overlap.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                (src.addr + off) as *const u8,
                                (dst.addr + off) as *mut u8,
                                (hi - lo) * size,
                            );
                        }
                    }
                    base += src.len;
                }
            }
        }
    }
}

/// Worker `w`'s element range of `total`, cut at multiples of [`ALIGN`].
fn share(total: usize, w: usize, workers: usize) -> (usize, usize) {
    let cut = |i: usize| {
        if i >= workers {
            total
        } else {
            (total * i / workers) / ALIGN * ALIGN
        }
    };
    (cut(w), cut(w + 1))
}

/// A float type that reductions widen to f32.
trait Widen: Copy {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Widen for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
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

/// Reduces elements `[off, off + n)` of every source into f32 and stores them, rounded once,
/// into every destination.
///
/// # Safety
/// As [`Plan::execute`].
unsafe fn reduce_float<T: Widen>(
    seg: &ReduceSegment,
    off: usize,
    n: usize,
    op: ReduceOp,
    acc: &mut [f32],
    tmp: &mut [f32],
) {
    let size = size_of::<T>();
    let view = |b: RawBuf| -> &[T] {
        // SAFETY: the caller guarantees the run is valid and not written during the call.
        unsafe { std::slice::from_raw_parts((b.addr + off * size) as *const T, n) }
    };
    let (acc, tmp) = (&mut acc[..n], &mut tmp[..n]);
    let mut sources = seg.sources.iter();
    if let Some(&first) = sources.next() {
        T::widen(view(first), acc);
    }
    for &src in sources {
        T::widen(view(src), tmp);
        match op {
            ReduceOp::Sum => acc.iter_mut().zip(tmp.iter()).for_each(|(a, b)| *a += *b),
            ReduceOp::Max => acc
                .iter_mut()
                .zip(tmp.iter())
                .for_each(|(a, b)| *a = a.max(*b)),
            ReduceOp::Min => acc
                .iter_mut()
                .zip(tmp.iter())
                .for_each(|(a, b)| *a = a.min(*b)),
        }
    }
    for &dst in &seg.dests {
        // SAFETY: destinations are written only here, in this worker's disjoint range, after
        // every source element of the range has been read.
        let out = unsafe { std::slice::from_raw_parts_mut((dst.addr + off * size) as *mut T, n) };
        T::narrow(acc, out);
    }
}

/// As [`reduce_float`] for i64 (exact, wrapping sums).
///
/// # Safety
/// As [`Plan::execute`].
unsafe fn reduce_i64(seg: &ReduceSegment, off: usize, n: usize, op: ReduceOp, acc: &mut Vec<i64>) {
    let view = |b: RawBuf| -> &[i64] {
        // SAFETY: the caller guarantees the run is valid and not written during the call.
        unsafe { std::slice::from_raw_parts((b.addr + off * 8) as *const i64, n) }
    };
    acc.clear();
    let mut sources = seg.sources.iter();
    if let Some(&first) = sources.next() {
        acc.extend_from_slice(view(first));
    }
    for &src in sources {
        let s = view(src);
        match op {
            ReduceOp::Sum => acc
                .iter_mut()
                .zip(s)
                .for_each(|(a, b)| *a = a.wrapping_add(*b)),
            ReduceOp::Max => acc.iter_mut().zip(s).for_each(|(a, b)| *a = (*a).max(*b)),
            ReduceOp::Min => acc.iter_mut().zip(s).for_each(|(a, b)| *a = (*a).min(*b)),
        }
    }
    for &dst in &seg.dests {
        // SAFETY: as in `reduce_float`.
        let out = unsafe { std::slice::from_raw_parts_mut((dst.addr + off * 8) as *mut i64, n) };
        out.copy_from_slice(acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_range_once() {
        for total in [0, 1, 63, 64, 65, 1000, 4097] {
            for workers in 1..=5 {
                let mut next = 0;
                for w in 0..workers {
                    let (s, e) = share(total, w, workers);
                    assert_eq!(s, next);
                    assert!(e >= s);
                    next = e;
                }
                assert_eq!(next, total);
            }
        }
    }
}
