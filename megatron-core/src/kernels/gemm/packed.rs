//! The blocked product of one block of C: Goto's loops around a register tile of `micro.rs`.
//!
//! ```text
//! for jc in steps of NC columns          B block (KC × NC) packed once, in L3
//!   for pc in steps of KC = 256          chunk of k: the unit of the sums' order
//!     pack B[pc.., jc..] into NR-wide panels
//!     for ic in steps of MC rows         A block (MC × KC) packed, in L2
//!       pack A[ic.., pc..] into MR-wide panels
//!       for jr, ir over panels           one tile each: B panel reused down the MR panels
//! ```
//!
//! `KC` is fixed at 256 for the results' sake, not the caches': each element of C sums its
//! products in chunks of 256 (see `micro.rs`), the order matrixmultiply's kernels, which earlier
//! runs used, kept; so a run's f32 bits are those it had before this kernel existed. `MC` and
//! `NC` only move work between caches.
//!
//! The packing buffers are each thread's own, kept between calls.

use std::cell::RefCell;

use super::micro::{Out, Tile};

/// Steps of k summed in one chain before joining C.
pub(super) const KC: usize = 256;
/// Columns of B packed at once (256 × 4096 × 4 B = 4 MiB, in the last-level cache).
const NC: usize = 4096;
/// Rows of A packed at once, in tiles (24 · 14 rows × 256 × 4 B = 336 KiB on AVX-512, in L2).
const MC_TILES: usize = 24;

/// A buffer of f32 whose start is aligned to a cache line.
#[derive(Default)]
struct Aligned {
    raw: Vec<f32>,
}

impl Aligned {
    /// At least `len` elements, the first at a 64-byte boundary.
    fn get(&mut self, len: usize) -> &mut [f32] {
        if self.raw.len() < len + 16 {
            self.raw = vec![0.0; len + 16];
        }
        let skip = self.raw.as_ptr().align_offset(64).min(15);
        &mut self.raw[skip..skip + len]
    }
}

thread_local! {
    /// This thread's packed A block and B block.
    static PACKS: RefCell<(Aligned, Aligned)> = RefCell::default();
}

/// A strided read-only matrix by raw parts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Raw {
    /// Element (0, 0).
    pub ptr: *const f32,
    /// Row stride.
    pub rs: isize,
    /// Column stride.
    pub cs: isize,
}

/// `C = α·A·B + β·C` for `A` `m × k`, `B` `k × n` (k > 0) with `tile`.
///
/// # Safety
/// Every element of the three matrices is in bounds; only this call accesses those of C, and
/// they do not overlap; the CPU supports the tile's instruction set.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn sgemm(
    tile: &Tile,
    (m, k, n): (usize, usize, usize),
    alpha: f32,
    a: Raw,
    b: Raw,
    beta: f32,
    c: *mut f32,
    (rsc, csc): (isize, isize),
) {
    let (mr, nr) = (tile.mr, tile.nr);
    let mc = MC_TILES * mr;
    let run = |apack: &mut Aligned, bpack: &mut Aligned| {
        let bpack = bpack.get(KC * NC.min(n).next_multiple_of(nr));
        let apack = apack.get(KC * mc.min(m).next_multiple_of(mr));
        for jc in (0..n).step_by(NC) {
            let nb = NC.min(n - jc);
            for (chunk, pc) in (0..k).step_by(KC).enumerate() {
                let kb = KC.min(k - pc);
                // SAFETY: the blocks lie inside A, B and C (the caller's contract).
                unsafe {
                    pack_b(bpack, at(b, pc, jc), kb, nb, nr);
                    for ic in (0..m).step_by(mc) {
                        let mb = mc.min(m - ic);
                        pack_a(apack, at(a, ic, pc), mb, kb, mr);
                        for jr in (0..nb).step_by(nr) {
                            for ir in (0..mb).step_by(mr) {
                                let out = Out {
                                    c: c.offset(
                                        (ic + ir) as isize * rsc + (jc + jr) as isize * csc,
                                    ),
                                    rsc,
                                    csc,
                                    rows: mr.min(mb - ir),
                                    cols: nr.min(nb - jr),
                                    alpha,
                                    beta: if chunk == 0 { beta } else { 1.0 },
                                };
                                (tile.run)(
                                    kb,
                                    apack.as_ptr().add(ir * kb),
                                    bpack.as_ptr().add(jr * kb),
                                    &out,
                                );
                            }
                        }
                    }
                }
            }
        }
    };
    PACKS.with(|packs| match packs.try_borrow_mut() {
        Ok(mut packs) => {
            let (apack, bpack) = &mut *packs;
            run(apack, bpack);
        }
        // A product inside a product on one thread (never today): buffers of its own.
        Err(_) => run(&mut Aligned::default(), &mut Aligned::default()),
    });
}

/// Element (i, j) of `x`.
fn at(x: Raw, i: usize, j: usize) -> Raw {
    Raw {
        ptr: x.ptr.wrapping_offset(i as isize * x.rs + j as isize * x.cs),
        ..x
    }
}

/// Packs the `mb × kb` block of A at `a` into panels of `mr` rows: panel `t` holds, for each k,
/// rows `t·mr ..` side by side (`dst[t·mr·kb + p·mr + i]`), rows past the block zero.
///
/// # Safety
/// The block lies inside A; `dst` holds `mb` rounded up to `mr`, times `kb`; the CPU has AVX2.
unsafe fn pack_a(dst: &mut [f32], a: Raw, mb: usize, kb: usize, mr: usize) {
    for (t, r0) in (0..mb).step_by(mr).enumerate() {
        let panel = &mut dst[t * mr * kb..(t + 1) * mr * kb];
        // SAFETY: rows r0.. of the block are inside A.
        unsafe { gather(panel, at(a, r0, 0), mr.min(mb - r0), kb, mr) };
    }
}

/// Packs the `kb × nb` block of B at `b` into panels of `nr` columns (`dst[t·nr·kb + p·nr + j]`),
/// columns past the block zero.
///
/// # Safety
/// The block lies inside B; `dst` holds `nb` rounded up to `nr`, times `kb`; the CPU has AVX2.
unsafe fn pack_b(dst: &mut [f32], b: Raw, kb: usize, nb: usize, nr: usize) {
    for (t, c0) in (0..nb).step_by(nr).enumerate() {
        let panel = &mut dst[t * nr * kb..(t + 1) * nr * kb];
        let columns = Raw {
            ptr: at(b, 0, c0).ptr,
            rs: b.cs,
            cs: b.rs,
        };
        // SAFETY: columns c0.. of the block are inside B (read as the rows of Bᵀ).
        unsafe { gather(panel, columns, nr.min(nb - c0), kb, nr) };
    }
}

/// Lays `lines` rows of `x` (`kb` elements each) side by side in `panel`, `w` wide: element p of
/// row i at `panel[p·w + i]`, the rows from `lines` to `w` zero.
///
/// # Safety
/// Rows `0..lines`, columns `0..kb` of `x` are in bounds; `panel` holds `kb · w`; `lines ≤ w`;
/// the CPU has AVX2.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2"))]
unsafe fn gather(panel: &mut [f32], x: Raw, lines: usize, kb: usize, w: usize) {
    debug_assert!(lines <= w && panel.len() >= kb * w);
    if lines < w {
        panel.fill(0.0);
    }
    // SAFETY: every read is of rows 0..lines, columns 0..kb of x; every write inside `panel`.
    unsafe {
        if x.rs == 1 {
            // The lines' elements p are adjacent (x is a transposed view): one copy per p.
            for p in 0..kb {
                let src = std::slice::from_raw_parts(x.ptr.offset(p as isize * x.cs), lines);
                panel[p * w..p * w + lines].copy_from_slice(src);
            }
            return;
        }
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if x.cs == 1 {
            // Contiguous rows: 8 × 8 blocks transposed in registers.
            done = kb / 8 * 8;
            for p0 in (0..done).step_by(8) {
                for i0 in (0..lines).step_by(8) {
                    transpose_8(
                        x.ptr.offset(i0 as isize * x.rs + p0 as isize),
                        x.rs,
                        (lines - i0).min(8),
                        panel.as_mut_ptr().add(p0 * w + i0),
                        w,
                    );
                }
            }
        }
        for i in 0..lines {
            let row = x.ptr.offset(i as isize * x.rs);
            for p in done..kb {
                panel[p * w + i] = *row.offset(p as isize * x.cs);
            }
        }
    }
}

/// Transposes `lines` (≤ 8) rows of 8 elements at `src` (rows `src_stride` apart) into 8 rows of
/// `lines` elements at `dst` (`dst_stride` apart): `dst[q·dst_stride + i] = src[i·src_stride + q]`.
///
/// # Safety
/// The `lines × 8` elements read and `8 × lines` written are in bounds; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_8(
    src: *const f32,
    src_stride: isize,
    lines: usize,
    dst: *mut f32,
    dst_stride: usize,
) {
    use std::arch::x86_64::*;
    let mut r = [_mm256_setzero_ps(); 8];
    // SAFETY: the caller's contract.
    unsafe {
        for (i, row) in r.iter_mut().enumerate().take(lines) {
            *row = _mm256_loadu_ps(src.offset(i as isize * src_stride));
        }
        // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let columns = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        if lines == 8 {
            for (q, column) in columns.into_iter().enumerate() {
                _mm256_storeu_ps(dst.add(q * dst_stride), column);
            }
        } else {
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(lines as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            for (q, column) in columns.into_iter().enumerate() {
                _mm256_maskstore_ps(dst.add(q * dst_stride), mask, column);
            }
        }
    }
}
