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
        if let Some(enter) = tile.enter {
            // SAFETY: the tile's instruction set is the CPU's (the caller's contract).
            unsafe { enter() };
        }
        let bpack = bpack.get(KC * NC.min(n).next_multiple_of(nr));
        let apack = apack.get(KC * mc.min(m).next_multiple_of(mr));
        for jc in (0..n).step_by(NC) {
            let nb = NC.min(n - jc);
            for (chunk, pc) in (0..k).step_by(KC).enumerate() {
                let kb = KC.min(k - pc);
                // Steps of the tile: bf16 panels hold two steps of k in each element, and a
                // tile may take its steps in groups (zeros past k).
                let steps = kb_steps(kb, tile.pairs).next_multiple_of(tile.k_multiple);
                // SAFETY: the blocks lie inside A, B and C (the caller's contract).
                unsafe {
                    pack_b(bpack, at(b, pc, jc), (kb, steps), nb, nr, tile.pairs);
                    for ic in (0..m).step_by(mc) {
                        let mb = mc.min(m - ic);
                        pack_a(apack, at(a, ic, pc), mb, (kb, steps), tile);
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
                                    steps,
                                    apack.as_ptr().add(ir * steps),
                                    bpack.as_ptr().add(jr * steps),
                                    &out,
                                );
                            }
                        }
                    }
                }
            }
        }
        if let Some(release) = tile.release {
            // SAFETY: the tile's instruction set is the CPU's (the caller's contract).
            unsafe { release() };
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

/// Packs the `mb × kb` block of A at `a` into panels of the tile's `mr` rows, `steps` steps each:
/// panel `t` holds, for each step, rows `t·mr ..` side by side (`dst[t·mr·steps + p·mr + i]`),
/// or with [`Tile::a_rows`] each row's steps one after another (`dst[t·mr·steps + i·steps + p]`);
/// rows past the block and steps past k are zero. With [`Tile::pairs`], each element holds two
/// steps of k as bf16 ([`gather_pairs`]).
///
/// # Safety
/// The block lies inside A; `dst` holds `mb` rounded up to `mr`, times `steps`; the CPU has AVX2
/// (and AVX-512 for pairs).
unsafe fn pack_a(dst: &mut [f32], a: Raw, mb: usize, (kb, steps): (usize, usize), tile: &Tile) {
    let mr = tile.mr;
    for (t, r0) in (0..mb).step_by(mr).enumerate() {
        let panel = &mut dst[t * mr * steps..(t + 1) * mr * steps];
        let rows = at(a, r0, 0);
        let lines = mr.min(mb - r0);
        // SAFETY: rows r0.. of the block are inside A.
        unsafe {
            match (tile.pairs, tile.a_rows) {
                (true, true) => pair_rows(panel, rows, lines, kb, steps),
                (true, false) => gather_pairs(panel, rows, lines, kb, mr),
                (false, _) => gather(panel, rows, lines, kb, mr),
            }
        }
        if !tile.a_rows {
            panel[kb_steps(kb, tile.pairs) * mr..].fill(0.0);
        }
    }
}

/// Packs the `kb × nb` block of B at `b` into panels of `nr` columns, `steps` steps each
/// (`dst[t·nr·steps + p·nr + j]`), columns past the block and steps past k zero; with `pairs`,
/// as bf16 pairs ([`pack_a`]).
///
/// # Safety
/// The block lies inside B; `dst` holds `nb` rounded up to `nr`, times `steps`; the CPU has AVX2
/// (and AVX-512 for pairs).
unsafe fn pack_b(
    dst: &mut [f32],
    b: Raw,
    (kb, steps): (usize, usize),
    nb: usize,
    nr: usize,
    pairs: bool,
) {
    for (t, c0) in (0..nb).step_by(nr).enumerate() {
        let panel = &mut dst[t * nr * steps..(t + 1) * nr * steps];
        let columns = Raw {
            ptr: at(b, 0, c0).ptr,
            rs: b.cs,
            cs: b.rs,
        };
        // SAFETY: columns c0.. of the block are inside B (read as the rows of Bᵀ).
        unsafe {
            if pairs {
                gather_pairs(panel, columns, nr.min(nb - c0), kb, nr);
            } else {
                gather(panel, columns, nr.min(nb - c0), kb, nr);
            }
        }
        panel[kb_steps(kb, pairs) * nr..].fill(0.0);
    }
}

/// The steps `kb` steps of k take in a panel: `kb / 2` rounded up in bf16 pairs.
fn kb_steps(kb: usize, pairs: bool) -> usize {
    if pairs { kb.div_ceil(2) } else { kb }
}

/// Packs `lines` rows of `x` (`kb` steps each) as bf16 pairs ([`gather_pairs`]'s pairing), one
/// row after another, `steps` elements apart: `panel[i·steps + p]`; the rest of `panel` zero.
///
/// # Safety
/// Rows `0..lines`, columns `0..kb` of `x` are in bounds; `panel` holds `steps` times the panel's
/// rows, and `steps ≥ kb / 2` rounded up.
unsafe fn pair_rows(panel: &mut [f32], x: Raw, lines: usize, kb: usize, steps: usize) {
    panel.fill(0.0);
    for i in 0..lines {
        let line = at(x, i, 0);
        for p in 0..kb.div_ceil(2) {
            // SAFETY: steps 2p and 2p + 1 (when below kb) of row i are inside x.
            let (hi, lo) = unsafe {
                let hi = *line.ptr.offset(2 * p as isize * x.cs);
                let lo = match 2 * p + 1 < kb {
                    true => *line.ptr.offset((2 * p + 1) as isize * x.cs),
                    false => 0.0,
                };
                (hi, lo)
            };
            panel[i * steps + p] = bf16_pair(hi, lo);
        }
    }
}

/// The widest panel a tile reads (its NR), and so the most lines [`gather_pairs`] takes.
const MAX_LINES: usize = 32;

/// As [`gather`], with the lines' elements rounded to bf16 and paired: element `p` of line `i` in
/// `panel[p·w + i]` holds steps `2p` (the high half) and `2p + 1` (the low half, zero past `kb`),
/// the order `vdpbf16ps` adds them in (see `micro.rs`). Rounding is to nearest, ties to even, as
/// `half::bf16::from_f32` rounds (a NaN stays a quiet NaN).
///
/// # Safety
/// As [`gather`], with `panel` holding `kb / 2` (rounded up) times `w`, `w ≤ 32`, and the CPU
/// having AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn gather_pairs(panel: &mut [f32], x: Raw, lines: usize, kb: usize, w: usize) {
    use std::arch::x86_64::*;
    debug_assert!(w <= MAX_LINES && kb <= KC && lines <= w);
    let steps = kb.div_ceil(2);
    if lines < w {
        panel.fill(0.0);
    }
    // SAFETY: every read is of lines 0..lines, steps 0..kb of x; every write inside `panel`
    // or `paired`.
    unsafe {
        if x.rs == 1 {
            // The lines' elements of one step are adjacent (B row-major, or A transposed):
            // 16 lines of steps 2p and 2p + 1 at once.
            for p in 0..steps {
                let hi_at = x.ptr.offset(2 * p as isize * x.cs);
                let lo_at = x.ptr.offset((2 * p + 1) as isize * x.cs);
                for i0 in (0..lines).step_by(16) {
                    let mask: __mmask16 = ((1u32 << (lines - i0).min(16)) - 1) as __mmask16;
                    let hi = rounded(_mm512_maskz_loadu_ps(mask, hi_at.add(i0)));
                    let lo = if 2 * p + 1 < kb {
                        rounded(_mm512_maskz_loadu_ps(mask, lo_at.add(i0)))
                    } else {
                        _mm512_setzero_si512()
                    };
                    let pair = _mm512_or_si512(
                        _mm512_and_si512(hi, _mm512_set1_epi32(0xffff_0000_u32 as i32)),
                        _mm512_srli_epi32::<16>(lo),
                    );
                    let dst = panel.as_mut_ptr().add(p * w + i0);
                    _mm512_mask_storeu_ps(dst, mask, _mm512_castsi512_ps(pair));
                }
            }
            return;
        }
        // The lines' pairs, one line after another, then laid side by side as f32 bit patterns.
        let mut paired = [0.0f32; MAX_LINES * KC / 2];
        let full = if x.cs == 1 { kb / 16 * 16 } else { 0 };
        for i in 0..lines {
            let line = at(x, i, 0);
            // Contiguous steps: 16 (8 pairs) at a time, each 64-bit lane one pair.
            for p0 in (0..full).step_by(16) {
                let r = rounded(_mm512_loadu_ps(line.ptr.add(p0)));
                // The even step's bf16 stays in bits 16..32, the odd one's comes down from 48..64.
                let pair = _mm512_or_si512(
                    _mm512_and_si512(r, _mm512_set1_epi64(0xffff_0000)),
                    _mm512_srli_epi64::<48>(r),
                );
                let dst = paired.as_mut_ptr().add(i * steps + p0 / 2);
                _mm256_storeu_si256(dst.cast(), _mm512_cvtepi64_epi32(pair));
            }
            for p in full / 2..steps {
                let hi = *line.ptr.offset(2 * p as isize * x.cs);
                let lo = if 2 * p + 1 < kb {
                    *line.ptr.offset((2 * p + 1) as isize * x.cs)
                } else {
                    0.0
                };
                paired[i * steps + p] = bf16_pair(hi, lo);
            }
        }
        let rows = Raw {
            ptr: paired.as_ptr(),
            rs: steps as isize,
            cs: 1,
        };
        gather(panel, rows, lines, steps, w);
    }
}

/// Without x86-64 there is no bf16 tile to pack for.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn gather_pairs(_panel: &mut [f32], _x: Raw, _lines: usize, _kb: usize, _w: usize) {
    unreachable!("bf16 panels are packed for the AVX512_BF16 tile only")
}

/// Each lane of `x` rounded to bf16 (to nearest, ties to even), in the lane's high 16 bits (the
/// low 16 are not zero): `bits + 0x7fff + lsb`, the carry rounding up; a NaN keeps its high
/// half with the quiet bit set.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn rounded(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let bits = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_mov_epi32(
        up,
        nan,
        _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000)),
    )
}

/// `hi` and `lo` rounded to bf16 (to nearest, ties to even) in one 32-bit pattern, `hi` in the
/// high half.
#[inline(always)]
fn bf16_pair(hi: f32, lo: f32) -> f32 {
    let bits = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
    f32::from_bits((bits(hi) << 16) | bits(lo))
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn vector_rounding_is_halfs_rounding_to_bf16() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("no AVX-512 on this CPU: the bf16 panels are never packed");
            return;
        }
        // Ties both ways, values that round up into the next binade or to infinity, NaNs whose
        // payload lies in the low half only, denormals, and a spread of other patterns.
        let mut bits = vec![
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0x7f80_0001,
            0xffc0_0000,
            0x7fbf_ffff,
            0x0000_0001,
            0x8000_8000,
            0x0000_0000,
            0x8000_0000,
        ];
        let mut h: u32 = 0x1234_5678;
        while bits.len() % 16 != 0 || bits.len() < 4096 {
            h = h.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            bits.push(h);
        }
        for chunk in bits.chunks(16) {
            let xs: Vec<f32> = chunk.iter().map(|&b| f32::from_bits(b)).collect();
            let mut out = [0u32; 16];
            // SAFETY: AVX-512 F was detected; `xs` and `out` hold 16 lanes.
            unsafe {
                use std::arch::x86_64::*;
                let r = rounded(_mm512_loadu_ps(xs.as_ptr()));
                _mm512_storeu_si512(out.as_mut_ptr().cast(), r);
            }
            for (x, r) in xs.iter().zip(out) {
                assert_eq!(
                    (r >> 16) as u16,
                    half::bf16::from_f32(*x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
    }
}
