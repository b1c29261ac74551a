//! The data movement of the in-process backend: reductions and copies over raw buffers of all
//! members of a group, cut into chunks that the members claim.
//!
//! Once every member of a group has arrived, its buffers stay borrowed (and their owners waiting)
//! until every chunk is done, so the raw addresses below stay valid, and no two workers touch the
//! same element: each chunk is claimed once.

use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};

use crate::comm::ReduceOp;
use crate::comm::reduce::{BLOCK, Widen, fold_float, fold_i64};
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

/// Chunks start at multiples of this many elements (whole cache lines for every dtype).
const ALIGN: usize = 64;
/// Smallest chunk a member claims: below it, claiming costs more than moving.
const MIN_CHUNK: usize = 16 * 1024;
/// Largest chunk: keeps several chunks per worker on large buffers.
const MAX_CHUNK: usize = 256 * 1024;

/// One output of a reduction: the sources, reduced in order, and where the result goes.
#[derive(Debug, Clone)]
pub(crate) struct ReduceSegment {
    /// One run per member, all of the segment's length, reduced in this order.
    pub sources: Vec<RawBuf>,
    /// Runs that receive the result.
    pub dests: Vec<RawBuf>,
}

impl ReduceSegment {
    /// Elements of the segment.
    fn len(&self) -> usize {
        self.dests.first().map_or(0, |d| d.len)
    }
}

/// The data movement of one collective.
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
    /// Elements the plan moves, numbered over its segments or jobs in order.
    pub fn total(&self) -> usize {
        match self {
            Plan::Nothing => 0,
            Plan::Reduce { segments, .. } => segments.iter().map(ReduceSegment::len).sum(),
            Plan::Copy { jobs, .. } => jobs.iter().map(|(s, _)| s.len).sum(),
        }
    }

    /// Moves elements `[start, end)` of the plan.
    ///
    /// # Safety
    /// Every run must be valid for the plan's dtype for the whole call, sources must not be
    /// written by anyone, destinations must be written only through this plan, a destination
    /// may overlap a source only as the identical run (in place), and no two calls may cover
    /// the same elements at the same time.
    unsafe fn execute(&self, start: usize, end: usize, scratch: &mut Scratch) {
        match self {
            Plan::Nothing => {}
            Plan::Reduce {
                dtype,
                op,
                segments,
            } => {
                let mut base = 0;
                for seg in segments {
                    let len = seg.len();
                    let (lo, hi) = (start.max(base), end.min(base + len));
                    let mut at = lo;
                    while at < hi {
                        let n = BLOCK.min(hi - at);
                        let off = at - base;
                        // SAFETY: forwarded from the caller; [off, off + n) lies in every run.
                        unsafe {
                            match dtype {
                                DType::F32 => reduce_float::<f32>(seg, off, n, *op, scratch),
                                DType::BF16 => reduce_float::<bf16>(seg, off, n, *op, scratch),
                                DType::F16 => reduce_float::<f16>(seg, off, n, *op, scratch),
                                DType::I64 => reduce_i64(seg, off, n, *op, &mut scratch.acc_i),
                            }
                        }
                        at += n;
                    }
                    base += len;
                }
            }
            Plan::Copy { dtype, jobs } => {
                let size = dtype.size();
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

/// A worker's accumulators.
#[derive(Debug)]
struct Scratch {
    acc: Vec<f32>,
    tmp: Vec<f32>,
    acc_i: Vec<i64>,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            acc: vec![0.0; BLOCK],
            tmp: vec![0.0; BLOCK],
            acc_i: Vec::with_capacity(BLOCK),
        }
    }
}

/// A plan cut into chunks that members claim as they come: whoever is awake works, so the
/// member that arrived last (and is surely running) starts at once, and at most `max_helpers`
/// members work at a time (no more than the cores).
#[derive(Debug)]
pub(crate) struct Work {
    plan: Plan,
    total: usize,
    chunk: usize,
    chunks: usize,
    next: AtomicUsize,
    finished: AtomicUsize,
    helpers: AtomicUsize,
    max_helpers: usize,
}

impl Work {
    /// Cuts `plan` into chunks for at most `max_helpers` workers.
    pub fn new(plan: Plan, max_helpers: usize) -> Self {
        let total = plan.total();
        let max_helpers = max_helpers.max(1);
        // A few chunks per worker balance the load; small collectives stay one chunk.
        let chunk = (total / (max_helpers * 8))
            .clamp(MIN_CHUNK, MAX_CHUNK)
            .div_ceil(ALIGN)
            * ALIGN;
        Work {
            plan,
            total,
            chunk,
            chunks: total.div_ceil(chunk),
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            helpers: AtomicUsize::new(0),
            max_helpers,
        }
    }

    /// Whether every chunk has been moved.
    pub fn is_done(&self) -> bool {
        self.finished.load(Ordering::Acquire) == self.chunks
    }

    /// Claims and moves chunks until none is left, unless `max_helpers` members already help;
    /// returns whether this call moved the last chunk.
    ///
    /// # Safety
    /// As [`Plan::execute`] for the whole plan, until [`Work::is_done`].
    pub unsafe fn help(&self) -> bool {
        if self.chunks == 0 || self.helpers.fetch_add(1, Ordering::AcqRel) >= self.max_helpers {
            return false;
        }
        let mut scratch = Scratch::new();
        let mut last = false;
        loop {
            let c = self.next.fetch_add(1, Ordering::AcqRel);
            if c >= self.chunks {
                return last;
            }
            let start = c * self.chunk;
            // SAFETY: each chunk is claimed once, so calls cover disjoint elements.
            unsafe {
                self.plan
                    .execute(start, (start + self.chunk).min(self.total), &mut scratch)
            };
            last = self.finished.fetch_add(1, Ordering::AcqRel) + 1 == self.chunks;
        }
    }
}

/// Reduces elements `[off, off + n)` of every source, in order, in f32, and stores the result,
/// rounded once, into every destination.
///
/// # Safety
/// As [`Plan::execute`].
unsafe fn reduce_float<T: Widen>(
    seg: &ReduceSegment,
    off: usize,
    n: usize,
    op: ReduceOp,
    scratch: &mut Scratch,
) {
    let size = size_of::<T>();
    let sources: Vec<&[T]> = seg
        .sources
        .iter()
        .map(|b| {
            // SAFETY: the caller guarantees the run is valid and not written during the call.
            unsafe { std::slice::from_raw_parts((b.addr + off * size) as *const T, n) }
        })
        .collect();
    let acc = &mut scratch.acc[..n];
    if !fold_float(&sources, acc, &mut scratch.tmp[..n], op) {
        return;
    }
    for &dst in &seg.dests {
        // SAFETY: destinations are written only here, in this chunk, after every source
        // element of the chunk has been read.
        let out = unsafe { std::slice::from_raw_parts_mut((dst.addr + off * size) as *mut T, n) };
        T::narrow(acc, out);
    }
}

/// As [`reduce_float`] for i64 (exact, wrapping sums).
///
/// # Safety
/// As [`Plan::execute`].
unsafe fn reduce_i64(seg: &ReduceSegment, off: usize, n: usize, op: ReduceOp, acc: &mut Vec<i64>) {
    let sources: Vec<&[i64]> = seg
        .sources
        .iter()
        .map(|b| {
            // SAFETY: the caller guarantees the run is valid and not written during the call.
            unsafe { std::slice::from_raw_parts((b.addr + off * 8) as *const i64, n) }
        })
        .collect();
    fold_i64(&sources, acc, op);
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
    fn chunks_cover_the_plan_once() {
        for total in [1, 63, 64, 65, 20_000, 1_000_000] {
            let src = vec![1.0f32; total];
            let mut dst = vec![0.0f32; total];
            let job = (
                RawBuf {
                    addr: src.as_ptr() as usize,
                    len: total,
                },
                RawBuf {
                    addr: dst.as_mut_ptr() as usize,
                    len: total,
                },
            );
            let work = Work::new(
                Plan::Copy {
                    dtype: DType::F32,
                    jobs: vec![job],
                },
                3,
            );
            // SAFETY: the buffers outlive the work and nothing else touches them.
            assert!(unsafe { work.help() });
            assert!(work.is_done());
            assert!(!unsafe { work.help() });
            assert!(dst.iter().all(|&x| x == 1.0));
        }
    }
}
