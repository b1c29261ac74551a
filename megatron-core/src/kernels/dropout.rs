//! Layout-invariant dropout: the keep/drop decision of an element depends only on its logical index.
//!
//! The random word of logical element `i` is word `i % 4` of the Philox block `i / 4` of a
//! [`DropoutStream`] (see [`crate::rng`]). An element is kept when `word >= threshold`, where
//! `threshold` is the `u32` nearest `p·2³²` ([`keep_threshold`]), and kept values are multiplied by
//! `1/(1 − p)` ([`keep_scale`]). No mask is stored: the backward regenerates it. A local buffer
//! maps to logical indices through a [`LogicalIndex`], so a tensor-parallel shard draws exactly the
//! decisions the unsharded tensor would draw for the same elements. The words are generated
//! [`PHILOX_BATCH`] blocks at a time ([`DropoutStream::words`], vectorised);
//! [`dropout_pair`] applies one mask to two buffers while generating it once, and
//! [`dropout_add_forward`] adds the dropped values to a residual in the same pass.

use rayon::prelude::*;

use super::isa::{Isa, versioned};
use super::parallel;
use super::shape::numel;
use super::{KernelError, check_len};
use crate::rng::{DropoutStream, PHILOX_BATCH};

/// Where a local buffer of `outer × inner` elements sits in its logical (unsharded) tensor.
///
/// Local element `(o, k)` (row-major, `k < inner`) has logical index
/// `o·logical_stride + logical_start + k`. Examples: a replicated activation is
/// [`LogicalIndex::contiguous`]; a column shard of a `[rows, cols]` matrix is
/// [`LogicalIndex::columns`]; head-split attention probabilities `[b, heads, sq, sk]` holding heads
/// `h0 .. h0 + local_heads` are `outer = b`, `inner = local_heads·sq·sk`,
/// `logical_stride = heads·sq·sk`, `logical_start = h0·sq·sk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogicalIndex {
    /// Number of local runs of contiguous logical indices.
    pub outer: usize,
    /// Length of each run.
    pub inner: usize,
    /// Logical distance between the starts of consecutive runs.
    pub logical_stride: u64,
    /// Logical index of the first element of run 0.
    pub logical_start: u64,
}

impl LogicalIndex {
    /// A buffer whose local and logical indices coincide (a replicated or unsharded tensor).
    pub fn contiguous(len: usize) -> Self {
        LogicalIndex {
            outer: 1,
            inner: len,
            logical_stride: len as u64,
            logical_start: 0,
        }
    }

    /// The `len` logical elements from `logical_start` on (e.g. a sequence-parallel shard of rows).
    pub fn range(logical_start: u64, len: usize) -> Self {
        LogicalIndex {
            outer: 1,
            inner: len,
            logical_stride: len as u64,
            logical_start,
        }
    }

    /// Columns `first_col .. first_col + local_cols` of a row-major `[rows, logical_cols]` tensor.
    pub fn columns(rows: usize, local_cols: usize, logical_cols: usize, first_col: usize) -> Self {
        LogicalIndex {
            outer: rows,
            inner: local_cols,
            logical_stride: logical_cols as u64,
            logical_start: first_col as u64,
        }
    }

    /// Heads `first_head .. first_head + local_heads` of a `[batch, all_heads, per_head]` tensor
    /// (e.g. a tensor-parallel rank's attention weights, `per_head` = sq·sk).
    pub fn heads(
        batch: usize,
        per_head: usize,
        local_heads: usize,
        all_heads: usize,
        first_head: usize,
    ) -> Self {
        Self::columns(
            batch,
            local_heads * per_head,
            all_heads * per_head,
            first_head * per_head,
        )
    }

    /// Logical index of local element `(o, k)` (wrapping; kernels check the range first).
    #[inline]
    pub fn logical(&self, o: usize, k: usize) -> u64 {
        (o as u64)
            .wrapping_mul(self.logical_stride)
            .wrapping_add(self.logical_start)
            .wrapping_add(k as u64)
    }

    /// Checks that every logical index fits in a `u64`; returns the local element count.
    pub(crate) fn check(&self, kernel: &'static str) -> Result<usize, KernelError> {
        let n = numel(kernel, &[self.outer, self.inner])?;
        if n > 0 {
            let last = (self.outer as u64 - 1)
                .checked_mul(self.logical_stride)
                .and_then(|v| v.checked_add(self.logical_start))
                .and_then(|v| v.checked_add(self.inner as u64 - 1));
            if last.is_none() {
                return Err(KernelError::Invalid {
                    kernel,
                    message: format!("logical indices of {self:?} overflow u64"),
                });
            }
        }
        Ok(n)
    }
}

/// The keep threshold for drop probability `p`: the `u32` nearest `p·2³²` (`0 ≤ p < 1`).
pub fn keep_threshold(p: f32) -> Result<u32, KernelError> {
    check_p("keep_threshold", p)?;
    Ok(threshold(p))
}

/// The factor `1/(1 − p)` applied to kept elements, computed in f64 and rounded to f32.
pub fn keep_scale(p: f32) -> f32 {
    (1.0 / (1.0 - f64::from(p))) as f32
}

/// [`keep_threshold`] without the range check (the caller has checked `p`).
fn threshold(p: f32) -> u32 {
    // For f32 p < 1, p·2³² ≤ 2³² − 2⁸, so the rounded value always fits.
    (f64::from(p) * 4_294_967_296.0)
        .round()
        .min(f64::from(u32::MAX)) as u32
}

/// Rejects drop probabilities outside `[0, 1)` (and NaN).
fn check_p(kernel: &'static str, p: f32) -> Result<(), KernelError> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(KernelError::Invalid {
            kernel,
            message: format!("drop probability must be in [0, 1), got {p}"),
        })
    }
}

/// Random words per [`DropoutStream::words`] call.
const BATCH_WORDS: usize = 4 * PHILOX_BATCH;

/// `ys[k] = xs[k]·scale` where `words[k] >= threshold`, else 0.
#[inline(always)]
fn select(xs: &[f32], ys: &mut [f32], words: &[u32], threshold: u32, scale: f32) {
    for ((y, &x), &w) in ys.iter_mut().zip(xs).zip(words) {
        *y = if w >= threshold { x * scale } else { 0.0 };
    }
}

/// `ys[k] = rs[k] + (xs[k]·scale` where `words[k] >= threshold`, else 0): the sum `+` computes
/// from a residual and [`select`]'s value, bit for bit.
#[inline(always)]
fn select_add(rs: &[f32], xs: &[f32], ys: &mut [f32], words: &[u32], threshold: u32, scale: f32) {
    for (((y, &r), &x), &w) in ys.iter_mut().zip(rs).zip(xs).zip(words) {
        *y = r + if w >= threshold { x * scale } else { 0.0 };
    }
}

versioned! {
    /// One run of logical elements `base, base + 1, ..`: `ya[k] = xa[k]·scale` where the word of
    /// logical element `base + k` is `>= threshold`, else 0, plus `r[k]` unless `r` is empty; the
    /// same mask takes `xb` to `yb` unless they are empty. The words come [`PHILOX_BATCH`] blocks
    /// at a time.
    fn apply_run(
        r: &[f32],
        xa: &[f32],
        ya: &mut [f32],
        xb: &[f32],
        yb: &mut [f32],
        base: u64,
        threshold: u32,
        scale: f32,
        stream: &DropoutStream,
    ) {
        let n = xa.len();
        let two = !xb.is_empty();
        // The batch holding `base` starts at its block; a run starting mid-block skips words.
        let mut block = base / 4;
        let mut skip = (base % 4) as usize;
        let mut done = 0;
        while done < n {
            let words = stream.words(block);
            let take = (BATCH_WORDS - skip).min(n - done);
            let w = &words[skip..skip + take];
            let run = done..done + take;
            if r.is_empty() {
                select(&xa[run.clone()], &mut ya[run.clone()], w, threshold, scale);
            } else {
                let (rs, xs) = (&r[run.clone()], &xa[run.clone()]);
                select_add(rs, xs, &mut ya[run.clone()], w, threshold, scale);
            }
            if two {
                select(&xb[run.clone()], &mut yb[run], w, threshold, scale);
            }
            done += take;
            // At most 2⁶² + 2⁴: no overflow.
            block += PHILOX_BATCH as u64;
            skip = 0;
        }
    }
}

/// Shared body of every dropout: `y = mask(x)·1/(1 − p)`, plus `residual` unless it is `None`,
/// and `y_b = mask(x_b)·1/(1 − p)` with the same mask when `b` is given.
#[allow(clippy::too_many_arguments)]
fn apply(
    kernel: &'static str,
    names: [&'static str; 2],
    residual: Option<&[f32]>,
    (x, y): (&[f32], &mut [f32]),
    b: Option<(&[f32], &mut [f32])>,
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<(), KernelError> {
    check_p(kernel, p)?;
    let n = index.check(kernel)?;
    let dims = || format!("outer {} × inner {}", index.outer, index.inner);
    if let Some(r) = residual {
        check_len(kernel, "residual", r.len(), n, dims)?;
    }
    check_len(kernel, names[0], x.len(), n, dims)?;
    check_len(kernel, names[1], y.len(), n, dims)?;
    let r = residual.unwrap_or(&[]);
    let (xb, yb): (&[f32], &mut [f32]) = match b {
        Some((xb, yb)) => {
            check_len(kernel, "x_b", xb.len(), n, dims)?;
            check_len(kernel, "y_b", yb.len(), n, dims)?;
            (xb, yb)
        }
        None => (&[], &mut []),
    };
    if p == 0.0 {
        if r.is_empty() {
            y.copy_from_slice(x);
        } else {
            for ((y, &r), &x) in y.iter_mut().zip(r).zip(x) {
                *y = r + x;
            }
        }
        yb.copy_from_slice(xb);
        return Ok(());
    }
    if n == 0 {
        return Ok(());
    }
    let (t, s) = (threshold(p), keep_scale(p));
    let isa = Isa::detected();
    // Local elements `[start, start + len)`, cut at row boundaries into runs of consecutive
    // logical indices. Every element's mask depends only on its logical index, so any cut
    // gives the same result.
    let range = |start: usize, x: &[f32], y: &mut [f32], xb: &[f32], yb: &mut [f32]| {
        let mut pos = 0;
        while pos < x.len() {
            let (o, k) = ((start + pos) / index.inner, (start + pos) % index.inner);
            let take = (index.inner - k).min(x.len() - pos);
            let run = pos..pos + take;
            let (xbr, ybr): (&[f32], &mut [f32]) = if xb.is_empty() {
                (&[], &mut [])
            } else {
                (&xb[run.clone()], &mut yb[run.clone()])
            };
            let rr: &[f32] = if r.is_empty() {
                &[]
            } else {
                &r[start + run.start..start + run.end]
            };
            apply_run(
                isa,
                rr,
                &x[run.clone()],
                &mut y[run],
                xbr,
                ybr,
                index.logical(o, k),
                t,
                s,
                stream,
            );
            pos += take;
        }
    };
    match parallel::part_len(n) {
        None => range(0, x, y, xb, yb),
        Some(part) if xb.is_empty() => parallel::on_pool(|| {
            y.par_chunks_mut(part)
                .zip(x.par_chunks(part))
                .enumerate()
                .for_each(|(i, (y, x))| range(i * part, x, y, &[], &mut []))
        }),
        Some(part) => parallel::on_pool(|| {
            y.par_chunks_mut(part)
                .zip(x.par_chunks(part))
                .zip(yb.par_chunks_mut(part).zip(xb.par_chunks(part)))
                .enumerate()
                .for_each(|(i, ((y, x), (yb, xb)))| range(i * part, x, y, xb, yb))
        }),
    }
    Ok(())
}

/// Dropout with drop probability `p`: `y = x/(1 − p)` where kept, 0 where dropped (`p = 0` copies).
pub fn dropout_forward(
    x: &[f32],
    y: &mut [f32],
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<(), KernelError> {
    apply(
        "dropout_forward",
        ["x", "y"],
        None,
        (x, y),
        None,
        p,
        stream,
        index,
    )
}

/// Gradient of [`dropout_forward`] with the same `p`, stream and index: regenerates the mask, `dx = mask(dy)/(1 − p)`.
pub fn dropout_backward(
    dy: &[f32],
    dx: &mut [f32],
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<(), KernelError> {
    apply(
        "dropout_backward",
        ["dy", "dx"],
        None,
        (dy, dx),
        None,
        p,
        stream,
        index,
    )
}

/// Dropout and a residual connection in one pass: `y = residual + mask(x)/(1 − p)`, bit for bit
/// what [`dropout_forward`] followed by an element-wise sum gives (Megatron-LM's
/// bias-dropout-add fusion, the bias aside). Its gradient is `dy` for the residual and
/// [`dropout_backward`]'s for `x`.
pub fn dropout_add_forward(
    residual: &[f32],
    x: &[f32],
    y: &mut [f32],
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<(), KernelError> {
    apply(
        "dropout_add_forward",
        ["x", "y"],
        Some(residual),
        (x, y),
        None,
        p,
        stream,
        index,
    )
}

/// One mask, two buffers, one pass: `y_a = mask(x_a)/(1 − p)` and `y_b = mask(x_b)/(1 − p)`.
///
/// The mask is the one [`dropout_forward`] and [`dropout_backward`] draw for the same `p`, stream
/// and index, generated once; the results are bit-identical to two separate calls. Attention's
/// backward uses it to redo the forward's dropout of the probabilities and to take the gradient
/// through it.
#[allow(clippy::too_many_arguments)]
pub fn dropout_pair(
    x_a: &[f32],
    y_a: &mut [f32],
    x_b: &[f32],
    y_b: &mut [f32],
    p: f32,
    stream: &DropoutStream,
    index: LogicalIndex,
) -> Result<(), KernelError> {
    apply(
        "dropout_pair",
        ["x_a", "y_a"],
        None,
        (x_a, y_a),
        Some((x_b, y_b)),
        p,
        stream,
        index,
    )
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Rng, check_directional, weighted_sum};
    use super::*;

    fn stream() -> DropoutStream {
        DropoutStream::new(1234, &[3, 0, 7, 1])
    }

    /// The mask of a buffer: forward applied to ones.
    fn mask(p: f32, s: &DropoutStream, index: LogicalIndex) -> Vec<f32> {
        let n = index.outer * index.inner;
        let mut y = vec![f32::NAN; n];
        dropout_forward(&vec![1.0; n], &mut y, p, s, index).unwrap();
        y
    }

    #[test]
    fn thresholds_and_scales() {
        assert_eq!(keep_threshold(0.0), Ok(0));
        assert_eq!(keep_threshold(0.5), Ok(1 << 31));
        assert_eq!(keep_threshold(0.1), Ok(429_496_736)); // 0.1f32 = 13421773·2⁻²⁷ exactly
        assert_eq!(keep_threshold(1.0 - f32::EPSILON / 2.0), Ok(u32::MAX - 255));
        assert_eq!(keep_scale(0.5), 2.0);
        assert_eq!(keep_scale(0.0), 1.0);
        for p in [-0.1, 1.0, 1.5, f32::NAN, f32::INFINITY] {
            assert!(
                matches!(keep_threshold(p), Err(KernelError::Invalid { .. })),
                "{p}"
            );
        }
    }

    #[test]
    fn forward_matches_reference_decisions() {
        let s = stream();
        let p = 0.3;
        let n = 103;
        let mut rng = Rng::new(50);
        let x = rng.vec(n, -1.0, 1.0);
        let mut y = vec![f32::NAN; n];
        dropout_forward(&x, &mut y, p, &s, LogicalIndex::contiguous(n)).unwrap();
        let t = (p as f64 * 2f64.powi(32)).round() as u64;
        let scale = (1.0 / (1.0 - p as f64)) as f32;
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let keep = s.word(i as u64) as u64 >= t;
            assert_eq!(b, if keep { a * scale } else { 0.0 }, "element {i}");
        }
        // Pinned: the first mask bits of this stream, computed by an independent Python
        // Philox4x32-10; they must never change between versions (nor on the GPU).
        let bits: String = y[..32]
            .iter()
            .map(|&v| if v == 0.0 { '0' } else { '1' })
            .collect();
        assert_eq!(bits, "10111110110110101001110111011110");
    }

    #[test]
    fn sharded_masks_equal_the_unsharded_mask() {
        let s = stream();
        let p = 0.25;
        let (rows, cols) = (7, 40);
        let full = mask(p, &s, LogicalIndex::contiguous(rows * cols));
        assert_eq!(
            full,
            mask(p, &s, LogicalIndex::columns(rows, cols, cols, 0))
        );
        for tp in [2, 4, 8] {
            let local = cols / tp;
            for rank in 0..tp {
                let shard = mask(
                    p,
                    &s,
                    LogicalIndex::columns(rows, local, cols, rank * local),
                );
                for r in 0..rows {
                    assert_eq!(
                        &shard[r * local..(r + 1) * local],
                        &full[r * cols + rank * local..r * cols + (rank + 1) * local],
                        "tp {tp} rank {rank} row {r}"
                    );
                }
            }
        }
        // Head-split attention probabilities [b, heads, sq, sk] split over 2 ranks.
        let (b, heads, sq, sk) = (3, 4, 5, 6);
        let per_head = sq * sk;
        let full = mask(p, &s, LogicalIndex::contiguous(b * heads * per_head));
        for rank in 0..2 {
            let local_heads = heads / 2;
            let index = LogicalIndex::heads(b, per_head, local_heads, heads, rank * local_heads);
            let shard = mask(p, &s, index);
            for bi in 0..b {
                let inner = local_heads * per_head;
                let start = bi * heads * per_head + rank * inner;
                assert_eq!(
                    &shard[bi * inner..(bi + 1) * inner],
                    &full[start..start + inner]
                );
            }
        }
    }

    #[test]
    fn keep_rate_matches_probability() {
        let s = stream();
        for (p, n) in [(0.1f32, 100_000usize), (0.5, 40_000), (0.9, 40_000)] {
            let m = mask(
                p,
                &s,
                LogicalIndex {
                    outer: 1,
                    inner: n,
                    logical_stride: 0,
                    logical_start: 3,
                },
            );
            let kept = m.iter().filter(|&&v| v != 0.0).count() as f64;
            let q = 1.0 - p as f64;
            let sd = (q * (1.0 - q) / n as f64).sqrt();
            let rate = kept / n as f64;
            assert!(
                (rate - q).abs() < 5.0 * sd,
                "p {p}: keep rate {rate}, expected {q} ± {sd}"
            );
            assert!(m.iter().all(|&v| v == 0.0 || v == keep_scale(p)));
        }
    }

    #[test]
    fn different_streams_give_different_masks_and_p0_is_identity() {
        let n = 256;
        let a = mask(
            0.5,
            &DropoutStream::new(1, &[0]),
            LogicalIndex::contiguous(n),
        );
        let b = mask(
            0.5,
            &DropoutStream::new(1, &[1]),
            LogicalIndex::contiguous(n),
        );
        let c = mask(
            0.5,
            &DropoutStream::new(2, &[0]),
            LogicalIndex::contiguous(n),
        );
        assert_ne!(a, b);
        assert_ne!(a, c);
        let mut rng = Rng::new(51);
        let x = rng.vec(n, -1.0, 1.0);
        let mut y = vec![0.0; n];
        dropout_forward(&x, &mut y, 0.0, &stream(), LogicalIndex::contiguous(n)).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn backward_regenerates_the_mask() {
        let s = stream();
        let p = 0.4;
        let (rows, cols) = (5, 24);
        let index = LogicalIndex::columns(rows, 12, cols, 6);
        let n = rows * 12;
        let mut rng = Rng::new(52);
        let (x, w, d) = (
            rng.vec(n, -1.0, 1.0),
            rng.vec(n, -1.0, 1.0),
            rng.vec(n, -1.0, 1.0),
        );
        let mut dx = vec![f32::NAN; n];
        dropout_backward(&w, &mut dx, p, &s, index).unwrap();
        let m = mask(p, &s, index);
        for ((&g, &wi), &mi) in dx.iter().zip(&w).zip(&m) {
            assert_eq!(g, wi * mi);
        }
        check_directional("dropout dx", &x, &d, 1e-2, &dx, 1e-4, |x| {
            let mut y = vec![0.0; n];
            dropout_forward(x, &mut y, p, &s, index).unwrap();
            weighted_sum(&w, &y)
        });
    }

    #[test]
    fn row_ranges_and_the_end_of_the_index_space() {
        let s = stream();
        let p = 0.5;
        let full = mask(p, &s, LogicalIndex::contiguous(60));
        // Sequence-parallel style row shards of a [6, 10] tensor: rows 0..1, 1..4, 4..6.
        for (r0, r1) in [(0, 1), (1, 4), (4, 6)] {
            let shard = mask(p, &s, LogicalIndex::range(r0 as u64 * 10, (r1 - r0) * 10));
            assert_eq!(shard, &full[r0 * 10..r1 * 10]);
        }
        // The last logical indices of the u64 range, starting mid-block.
        for len in 1..=3 {
            let start = u64::MAX - len as u64 + 1;
            let m = mask(p, &s, LogicalIndex::range(start, len));
            let t = keep_threshold(p).unwrap();
            for (k, &v) in m.iter().enumerate() {
                assert_eq!(v != 0.0, s.word(start + k as u64) >= t);
            }
        }
    }

    #[test]
    fn runs_of_every_offset_and_length_follow_the_words() {
        let s = stream();
        let p = 0.3;
        let t = keep_threshold(p).unwrap();
        let mut rng = Rng::new(53);
        let x = rng.vec(300, -1.0, 1.0);
        for start in [
            0u64,
            1,
            2,
            3,
            61,
            64,
            65,
            127,
            (1 << 32) * 4 - 70,
            u64::MAX - 299,
        ] {
            for len in [1usize, 3, 4, 5, 63, 64, 65, 130, 300] {
                let mut y = vec![f32::NAN; len];
                let index = LogicalIndex::range(start, len);
                let Ok(()) = dropout_forward(&x[..len], &mut y, p, &s, index) else {
                    continue; // past the end of the index space
                };
                for (k, (&a, &b)) in x.iter().zip(&y).enumerate() {
                    let keep = s.word(start + k as u64) >= t;
                    assert_eq!(
                        b,
                        if keep { a * keep_scale(p) } else { 0.0 },
                        "{start} + {k}"
                    );
                }
                // Every compiled version draws the same, and adds a residual as `+` does.
                let r: Vec<f32> = (0..len).map(|i| i as f32 * 0.37 - 5.0).collect();
                let summed: Vec<f32> = r.iter().zip(&y).map(|(r, y)| r + y).collect();
                for isa in Isa::supported() {
                    for (residual, want) in [(&[][..], &y), (&r[..], &summed)] {
                        let mut z = vec![f32::NAN; len];
                        let (xs, scale) = (&x[..len], keep_scale(p));
                        apply_run(isa, residual, xs, &mut z, &[], &mut [], start, t, scale, &s);
                        let with = if residual.is_empty() {
                            ""
                        } else {
                            " with a residual"
                        };
                        assert_eq!(want, &z, "{}{with}", isa.name());
                    }
                }
            }
        }
    }

    #[test]
    fn pair_equals_two_calls() {
        let s = stream();
        let mut rng = Rng::new(54);
        let (b, inner, stride) = (3, 70, 150);
        let index = LogicalIndex {
            outer: b,
            inner,
            logical_stride: stride,
            logical_start: 37,
        };
        let n = b * inner;
        let (xa, xb) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
        for p in [0.0, 0.1, 0.5] {
            let (mut ya, mut yb) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            dropout_pair(&xa, &mut ya, &xb, &mut yb, p, &s, index).unwrap();
            let (mut wa, mut wb) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            dropout_forward(&xa, &mut wa, p, &s, index).unwrap();
            dropout_backward(&xb, &mut wb, p, &s, index).unwrap();
            assert_eq!(ya, wa, "p {p}");
            assert_eq!(yb, wb, "p {p}");
        }
        let mut y = vec![0.0; n];
        let e = dropout_pair(&xa, &mut y.clone(), &xb[1..], &mut y, 0.1, &s, index).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "x_b", .. }));
    }

    #[test]
    fn dropout_add_is_dropout_then_the_sum_bit_for_bit() {
        let s = stream();
        let mut rng = Rng::new(77);
        // A column shard (runs of 70 of 150) and a replicated buffer long enough to be cut into
        // parts across threads.
        let shard = LogicalIndex::columns(3, 70, 150, 37);
        for index in [shard, LogicalIndex::contiguous(1 << 17)] {
            let n = index.outer * index.inner;
            let (r, x) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
            for p in [0.0, 0.1, 0.5] {
                let mut got = vec![f32::NAN; n];
                dropout_add_forward(&r, &x, &mut got, p, &s, index).unwrap();
                let mut dropped = vec![f32::NAN; n];
                dropout_forward(&x, &mut dropped, p, &s, index).unwrap();
                let want: Vec<f32> = r.iter().zip(&dropped).map(|(a, b)| a + b).collect();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{index:?} p {p}");
            }
        }
        let mut y = vec![0.0; 8];
        let idx = LogicalIndex::contiguous(8);
        let e = dropout_add_forward(&[0.0; 7], &[0.0; 8], &mut y, 0.1, &s, idx).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                kernel: "dropout_add_forward",
                buffer: "residual",
                expected: 8,
                actual: 7,
                ..
            }
        ));
    }

    #[test]
    fn errors() {
        let s = stream();
        let idx = LogicalIndex::contiguous(8);
        let mut y = [0.0; 8];
        for p in [-0.5, 1.0, f32::NAN] {
            let e = dropout_forward(&[0.0; 8], &mut y, p, &s, idx).unwrap_err();
            assert!(matches!(
                e,
                KernelError::Invalid {
                    kernel: "dropout_forward",
                    ..
                }
            ));
        }
        let e = dropout_forward(&[0.0; 7], &mut y, 0.1, &s, idx).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "x",
                expected: 8,
                actual: 7,
                ..
            }
        ));
        let e = dropout_backward(&[0.0; 8], &mut y[..4], 0.1, &s, idx).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dx", .. }));
        let huge = LogicalIndex {
            outer: 3,
            inner: 1,
            logical_stride: u64::MAX / 2 + 1,
            logical_start: 0,
        };
        let e = dropout_forward(&[0.0; 3], &mut y[..3], 0.1, &s, huge).unwrap_err();
        assert!(matches!(e, KernelError::Invalid { .. }));
    }
}
