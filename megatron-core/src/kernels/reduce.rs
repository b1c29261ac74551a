//! Deterministic, auto-vectorisable row reductions shared by the kernels.
//!
//! Each reduction keeps [`LANES`] independent f32 partial sums over consecutive chunks, adds the
//! tail to lane 0, and combines the lanes in a fixed order, so the result depends only on the
//! input values, never on threads or timing (nor on the instruction set a kernel was compiled
//! for: they are `#[inline(always)]`, so each version of a kernel gets its own copy, with the
//! same operations in the same order).

/// Number of independent partial sums (one AVX-256 register of f32).
pub(crate) const LANES: usize = 8;

/// Combines lane partial sums in a fixed order.
#[inline(always)]
pub(crate) fn combine(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Sum of `xs`.
#[inline(always)]
pub(crate) fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    for &x in tail {
        acc[0] += x;
    }
    combine(acc)
}

/// Dot product of `a` and `b` over their common length.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    for (&x, &y) in ta.iter().zip(tb) {
        acc[0] += x * y;
    }
    combine(acc)
}

/// Sum of `(x - shift)^2` over `xs` (the second pass of a two-pass variance).
#[inline(always)]
pub(crate) fn sum_sq_dev(xs: &[f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            let d = x - shift;
            *a += d * d;
        }
    }
    for &x in tail {
        let d = x - shift;
        acc[0] += d * d;
    }
    combine(acc)
}

/// Largest element of `xs` (NaNs are skipped), or negative infinity when `xs` is empty.
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x);
        }
    }
    for &x in tail {
        acc[0] = acc[0].max(x);
    }
    acc.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Column block width of [`add_column_sums`]: its f64 scratch lives on the stack.
const COL_BLOCK: usize = 64;

/// Adds the column sums of a row-major `[rows, cols]` matrix into `out[cols]`, in f64, rows in order.
///
/// Element `(r, c)` of the matrix is `row(r)(a[r, c], b[r, c])`: `row` is called once per row and
/// returns the element function for that row (so per-row values such as a mean are hoisted out of
/// the inner loop). `a` and `b` must both have `rows * cols` elements and `out` must have `cols`
/// (checked by the caller). Columns are processed in blocks of [`COL_BLOCK`] so the partial sums
/// fit on the stack.
#[inline(always)]
pub(crate) fn add_column_sums<G>(
    a: &[f32],
    b: &[f32],
    cols: usize,
    out: &mut [f32],
    row: impl Fn(usize) -> G,
) where
    G: Fn(f32, f32) -> f64,
{
    if cols == 0 {
        return;
    }
    for (block, out_block) in out.chunks_mut(COL_BLOCK).enumerate() {
        let c0 = block * COL_BLOCK;
        let width = out_block.len();
        let mut acc = [0.0f64; COL_BLOCK];
        for (r, (ra, rb)) in a.chunks_exact(cols).zip(b.chunks_exact(cols)).enumerate() {
            let f = row(r);
            let (ra, rb) = (&ra[c0..c0 + width], &rb[c0..c0 + width]);
            for ((s, &x), &y) in acc.iter_mut().zip(ra).zip(rb) {
                *s += f(x, y);
            }
        }
        for (o, &s) in out_block.iter_mut().zip(&acc) {
            *o += s as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_match_naive() {
        for n in [0usize, 1, 7, 8, 9, 33] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let s: f32 = a.iter().sum();
            let d: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let q: f32 = a.iter().map(|x| (x - 0.5) * (x - 0.5)).sum();
            assert!((sum(&a) - s).abs() < 1e-4);
            assert!((dot(&a, &b) - d).abs() < 1e-4);
            assert!((sum_sq_dev(&a, 0.5) - q).abs() < 1e-3);
            let m = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&a), m);
        }
    }

    #[test]
    fn column_sums_accumulate() {
        let (rows, cols) = (5, 70);
        let a: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let b = vec![2.0f32; rows * cols];
        let mut out = vec![1.0f32; cols];
        add_column_sums(&a, &b, cols, &mut out, |_| |x, y| x as f64 * y as f64);
        for (c, &o) in out.iter().enumerate() {
            let want: f64 = 1.0 + (0..rows).map(|r| 2.0 * (r * cols + c) as f64).sum::<f64>();
            assert_eq!(o as f64, want);
        }
    }
}
