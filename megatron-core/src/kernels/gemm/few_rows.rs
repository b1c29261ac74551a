//! Products of a few rows against a large B: a decoding step's, one token's row (or a few)
//! against each weight. Each element of B is used once per row of A, so the product is bound by
//! the memory bandwidth of reading B, not by arithmetic: B is streamed once, unpacked, by every
//! thread of the rank, each thread a contiguous range of C's columns.
//!
//! Two layouts of B are read in place:
//! - **columns** (`Bᵀ` rows contiguous, a weight `[out, in]` read transposed, as every linear
//!   layer's forward is): each element of C is a dot product of a row of A and a column of B,
//!   the columns taken one after another so that each thread reads one sequential stream, which
//!   the hardware prefetchers follow; each sum keeps 16 lanes (the products of k ≡ l mod 16 in lane l, by fused multiply-adds in
//!   ascending k) joined by a fixed tree at the end;
//! - **rows** (B's rows contiguous): each element's products are fused multiply-adds in
//!   ascending k, 64 columns of C at a time.
//!
//! The order is the same on every instruction set with FMA (AVX2 keeps a lane's sum exactly as
//! AVX-512 does) and for every number of threads, so a decoding step's bits depend on neither;
//! they differ from a packed product's of the same matrices (another order of the sums). CPUs
//! without FMA keep the earlier loops (`reduce::dot`).

use super::super::isa::{Isa, Level, versioned};
use super::super::{KernelError, parallel, reduce};
use super::{MatMut, MatRef, RawC};

/// Rows of A up to which a large product takes this path.
pub(super) const FEW_ROWS: usize = 4;
/// The least `k × n` of B for which it does: below it packing costs little.
const MIN_B: usize = 1 << 15;
/// Elements of B a thread streams at least (smaller products use fewer threads).
const MIN_B_PER_THREAD: usize = 1 << 16;
/// Lanes of a column sum.
const LANES: usize = 16;
/// Columns of C computed together from the rows layout.
const ROW_BLOCK: usize = 64;

/// Whether [`few_rows`] computes an `m × k` by `k × n` product (few rows of A, a large B) whose
/// B has contiguous rows or columns.
pub(super) fn applies((m, k, n): (usize, usize, usize), b_contiguous: bool) -> bool {
    m <= FEW_ROWS && k.saturating_mul(n) >= MIN_B && b_contiguous
}

/// `C = α·A·B + β·C` for an A of at most [`FEW_ROWS`] rows and a large B; `None` for the
/// products it does not take (the packed kernel's).
pub(super) fn few_rows(
    isa: Isa,
    fma: bool,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: &mut MatMut<'_>,
) -> Option<Result<(), KernelError>> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let columns = b.row_stride == 1;
    if !applies((m, k, n), columns || b.col_stride == 1) {
        return None;
    }
    let rows = rows_of(&a, |x| x);
    stream(alpha, (m, k, n), beta, c, |j0, sums| match (fma, columns) {
        (true, true) => dot_columns(isa, &rows, m, k, b.data, b.col_stride, j0, sums),
        (true, false) => axpy_rows(isa, &rows, m, k, b.data, b.row_stride, j0, sums),
        (false, _) => plain(&rows, m, k, &b, j0, sums),
    });
    Some(Ok(()))
}

/// `C = α·bf16(A)·B + β·C` for a B of bf16 values (a bf16 weight) read transposed, its columns
/// contiguous, streamed as they are stored (half the bytes of f32) and widened in registers:
/// the bits of [`few_rows`] on the operands rounded to bf16 (a bf16 denormal reads as zero, as
/// `gemm_bf16` reads it). `false` for the products it does not take: another layout of B, too
/// few rows or too small a B, or a CPU without FMA (`fma`, as [`few_rows`] takes it).
#[cfg(target_arch = "x86_64")]
pub(super) fn few_rows_bf16(
    isa: Isa,
    fma: bool,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_, half::bf16>,
    beta: f32,
    c: &mut MatMut<'_>,
) -> bool {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if !(fma && applies((m, k, n), b.row_stride == 1)) {
        return false;
    }
    let rows = rows_of(&a, super::to_bf16);
    stream(alpha, (m, k, n), beta, c, |j0, sums| {
        dot_columns(isa, &rows, m, k, b.data, b.col_stride, j0, sums)
    });
    true
}

/// A's `m` rows of `k`, contiguous, each element mapped by `f`.
fn rows_of(a: &MatRef<'_>, f: impl Fn(f32) -> f32) -> Vec<f32> {
    let k = a.cols;
    (0..a.rows * k)
        .map(|e| f(a.data[(e / k) * a.row_stride + (e % k) * a.col_stride]))
        .collect()
}

/// `C = α·S + β·C` for the `m × n` sums S that `sums(j0, out)` computes, C's columns cut into
/// one contiguous range a thread: `out[i·w + jj]` (w = `out.len() / m`) is S's element
/// (i, j0 + jj).
fn stream(
    alpha: f32,
    (m, k, n): (usize, usize, usize),
    beta: f32,
    c: &mut MatMut<'_>,
    sums: impl Fn(usize, &mut [f32]) + Sync,
) {
    let raw = RawC {
        ptr: c.data.as_mut_ptr(),
        row_stride: c.row_stride as isize,
        col_stride: c.col_stride as isize,
    };
    let parts = parallel::threads()
        .min(k.saturating_mul(n) / MIN_B_PER_THREAD)
        .clamp(1, n);
    let run = |part: usize| {
        let raw: RawC = raw;
        let (j0, j1) = (n * part / parts, n * (part + 1) / parts);
        let width = j1 - j0;
        let mut out = vec![0.0f32; m * width];
        sums(j0, &mut out);
        for i in 0..m {
            for (jj, &sum) in out[i * width..(i + 1) * width].iter().enumerate() {
                // SAFETY: (i, j0 + jj) is inside C, and only this part writes column j0 + jj.
                unsafe {
                    let e = raw
                        .ptr
                        .offset(i as isize * raw.row_stride + (j0 + jj) as isize * raw.col_stride);
                    let old = if beta == 0.0 { 0.0 } else { beta * *e };
                    *e = alpha * sum + old;
                }
            }
        }
    };
    // The calling thread reads part 0 itself rather than waiting for a pool thread to wake.
    parallel::run_parts(parts, true, run);
}

/// A column sum's 16 lanes joined by halves: lane l + 8 onto l, then + 4, + 2, + 1.
#[inline(always)]
fn join(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// Defines `$name::<M>(x, k, w)`: `M` rows of A (`x`, `M × k` contiguous) dotted with one
/// column of B (`w`, k contiguous elements of `$wty`, loaded into f32 vectors by `$wload` and
/// one at a time by `$widen`), 16 lanes a sum, on AVX-512 (`avx512`) or AVX2 (`avx2`) vectors.
#[cfg(target_arch = "x86_64")]
macro_rules! dot_column {
    ($name:ident, avx512, $wty:ty, $wload:path, $widen:path) => {
        dot_column!(@ $name, "avx512f,fma", __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
            _mm512_storeu_ps, _mm512_fmadd_ps, $wty, $wload, $widen);
    };
    ($name:ident, avx2, $wty:ty, $wload:path, $widen:path) => {
        dot_column!(@ $name, "avx2,fma", __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps,
            _mm256_storeu_ps, _mm256_fmadd_ps, $wty, $wload, $widen);
    };
    (@ $name:ident, $features:literal, $vec:ty, $width:literal, $zero:ident, $load:ident,
     $store:ident, $fmadd:ident, $wty:ty, $wload:path, $widen:path) => {
        /// # Safety
        /// `x` holds `M · k` elements and `w` k; the CPU has the instruction set.
        #[target_feature(enable = $features)]
        unsafe fn $name<const M: usize>(x: *const f32, k: usize, w: *const $wty) -> [f32; M] {
            use std::arch::x86_64::*;
            const NV: usize = LANES / $width;
            let mut acc = [[$zero(); NV]; M];
            let full = k / LANES * LANES;
            // SAFETY: every read is below `k` in its row or column (the caller's contract).
            unsafe {
                for p in (0..full).step_by(LANES) {
                    for v in 0..NV {
                        let wv = $wload(w.add(p + v * $width));
                        for r in 0..M {
                            let xv = $load(x.add(r * k + p + v * $width));
                            acc[r][v] = $fmadd(xv, wv, acc[r][v]);
                        }
                    }
                }
                std::array::from_fn(|r| {
                    let mut lanes = [0.0f32; LANES];
                    for v in 0..NV {
                        $store(lanes.as_mut_ptr().add(v * $width), acc[r][v]);
                    }
                    for p in full..k {
                        lanes[p - full] =
                            (*x.add(r * k + p)).mul_add($widen(*w.add(p)), lanes[p - full]);
                    }
                    join(lanes)
                })
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
dot_column!(
    dot_avx512,
    avx512,
    f32,
    _mm512_loadu_ps,
    std::convert::identity
);
#[cfg(target_arch = "x86_64")]
dot_column!(dot_avx2, avx2, f32, _mm256_loadu_ps, std::convert::identity);
#[cfg(target_arch = "x86_64")]
dot_column!(dot_bf16_avx512, avx512, half::bf16, widen_16, widen);
#[cfg(target_arch = "x86_64")]
dot_column!(dot_bf16_avx2, avx2, half::bf16, widen_8, widen);

/// A bf16 value in f32 (exact), a denormal read as zero of its sign.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn widen(x: half::bf16) -> f32 {
    let bits = u32::from(x.to_bits());
    let bits = if bits & 0x7f80 == 0 {
        bits & 0x8000
    } else {
        bits
    };
    f32::from_bits(bits << 16)
}

/// The 16 bf16 values at `p` in f32, as [`widen`] widens each.
///
/// # Safety
/// `p` holds 16 values; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn widen_16(p: *const half::bf16) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: 32 bytes at `p` (the caller's contract).
    let v = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(unsafe {
        _mm256_loadu_si256(p.cast())
    }));
    let normal = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x7f80_0000));
    let signs = _mm512_and_si512(v, _mm512_set1_epi32(i32::MIN));
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(signs, normal, v))
}

/// The 8 bf16 values at `p` in f32, as [`widen`] widens each.
///
/// # Safety
/// `p` holds 8 values; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn widen_8(p: *const half::bf16) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: 16 bytes at `p` (the caller's contract).
    let v = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast()) }));
    let exponent = _mm256_and_si256(v, _mm256_set1_epi32(0x7f80_0000));
    let denormal = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
    // Where the exponent is zero, keep the sign bit alone.
    let drop = _mm256_andnot_si256(_mm256_set1_epi32(i32::MIN), denormal);
    _mm256_castsi256_ps(_mm256_andnot_si256(drop, v))
}

/// An element type whose columns [`dot_columns`] streams: f32, or bf16 widened as it is read.
#[cfg(target_arch = "x86_64")]
trait Streamed: Copy {
    /// `M` rows of `x` (`M × k`) dotted with the column of k elements at `w`, on AVX-512
    /// (`wide`) or AVX2.
    ///
    /// # Safety
    /// `x` holds `M · k` elements and `w` k; the CPU has FMA and the instruction set.
    unsafe fn dot<const M: usize>(wide: bool, x: *const f32, k: usize, w: *const Self) -> [f32; M];
}

#[cfg(target_arch = "x86_64")]
impl Streamed for f32 {
    unsafe fn dot<const M: usize>(wide: bool, x: *const f32, k: usize, w: *const f32) -> [f32; M] {
        // SAFETY: the caller's contract.
        unsafe {
            match wide {
                true => dot_avx512::<M>(x, k, w),
                false => dot_avx2::<M>(x, k, w),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Streamed for half::bf16 {
    unsafe fn dot<const M: usize>(
        wide: bool,
        x: *const f32,
        k: usize,
        w: *const half::bf16,
    ) -> [f32; M] {
        // SAFETY: the caller's contract.
        unsafe {
            match wide {
                true => dot_bf16_avx512::<M>(x, k, w),
                false => dot_bf16_avx2::<M>(x, k, w),
            }
        }
    }
}

/// The columns layout: `sums[i·w + jj]` (w = `sums.len() / m`) is row i of A dotted with
/// column `j0 + jj` of B, whose k elements start at `(j0 + jj)·cs`. The CPU has FMA and `isa`
/// (AVX2 or AVX-512).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn dot_columns<T: Streamed>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    b: &[T],
    cs: usize,
    j0: usize,
    sums: &mut [f32],
) {
    let width = sums.len() / m;
    /// Each column's `M` sums into `sums`, one column after another (one stream of B).
    ///
    /// # Safety
    /// As `dot_columns`'s contract.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn each<const M: usize, T: Streamed>(
        wide: bool,
        x: &[f32],
        k: usize,
        b: &[T],
        cs: usize,
        j0: usize,
        width: usize,
        sums: &mut [f32],
    ) {
        debug_assert!(x.len() >= M * k);
        for jj in 0..width {
            let at = (j0 + jj) * cs;
            let w = b[at..at + k].as_ptr();
            // SAFETY: `x` holds M rows of k, `w` k elements (sliced above); the caller vouches
            // for the instruction set.
            let got: [f32; M] = unsafe { T::dot::<M>(wide, x.as_ptr(), k, w) };
            for (r, sum) in got.into_iter().enumerate() {
                sums[r * width + jj] = sum;
            }
        }
    }
    let wide = isa.level() != Level::Avx2;
    // SAFETY: `few_rows` takes this path only with FMA and AVX2 or AVX-512.
    unsafe {
        match m {
            1 => each::<1, T>(wide, x, k, b, cs, j0, width, sums),
            2 => each::<2, T>(wide, x, k, b, cs, j0, width, sums),
            3 => each::<3, T>(wide, x, k, b, cs, j0, width, sums),
            _ => each::<4, T>(wide, x, k, b, cs, j0, width, sums),
        }
    }
}

/// The columns layout, without x86's vectors: each sum by `reduce::dot`.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
fn dot_columns(
    _isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    cs: usize,
    j0: usize,
    sums: &mut [f32],
) {
    let width = sums.len() / m;
    for jj in 0..width {
        let col = &b[(j0 + jj) * cs..(j0 + jj) * cs + k];
        for r in 0..m {
            sums[r * width + jj] = reduce::dot(&x[r * k..(r + 1) * k], col);
        }
    }
}

versioned! {
    /// The rows layout: `sums[i·w + jj]` is row i of A times column `j0 + jj` of B, whose row p
    /// starts at `p·rs`; each sum by fused multiply-adds in ascending k.
    fn axpy_rows(x: &[f32], m: usize, k: usize, b: &[f32], rs: usize, j0: usize, sums: &mut [f32]) {
        let width = sums.len() / m;
        for c0 in (0..width).step_by(ROW_BLOCK) {
            let cols = ROW_BLOCK.min(width - c0);
            let mut acc = [[0.0f32; ROW_BLOCK]; FEW_ROWS];
            for p in 0..k {
                let row = &b[p * rs + j0 + c0..p * rs + j0 + c0 + cols];
                for r in 0..m {
                    let xr = x[r * k + p];
                    for (s, &y) in acc[r].iter_mut().zip(row) {
                        *s = xr.mul_add(y, *s);
                    }
                }
            }
            for r in 0..m {
                sums[r * width + c0..r * width + c0 + cols].copy_from_slice(&acc[r][..cols]);
            }
        }
    }
}

/// Without FMA: 8-lane dot products (`reduce::dot`) or plain multiply-adds down B's rows.
fn plain(x: &[f32], m: usize, k: usize, b: &MatRef<'_>, j0: usize, sums: &mut [f32]) {
    let width = sums.len() / m;
    for jj in 0..width {
        let j = j0 + jj;
        for r in 0..m {
            let row = &x[r * k..(r + 1) * k];
            sums[r * width + jj] = if b.row_stride == 1 {
                reduce::dot(row, &b.data[j * b.col_stride..j * b.col_stride + k])
            } else {
                (0..k).fold(0.0, |s, p| s + row[p] * b.data[p * b.row_stride + j])
            };
        }
    }
}
