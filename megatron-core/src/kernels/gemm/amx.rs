//! The AMX tile of bf16 products: a 32 × 32 block of C in four accumulator tiles, fed 32 steps of
//! k at a time by two tiles of A and two of B (Sapphire Rapids and later).
//!
//! ```text
//!            B₀ (tmm6) B₁ (tmm7)      16 pairs of k × 16 columns each, rows 128 bytes apart
//! A₀ (tmm4)  C₀₀ tmm0  C₀₁ tmm1       16 rows × 16 pairs each, rows `steps` pairs apart
//! A₁ (tmm5)  C₁₀ tmm2  C₁₁ tmm3       16 × 16 f32 sums each
//! ```
//!
//! The panels are `packed.rs`'s bf16 pairs (the earlier step of k in the high half), with two
//! differences the tile asks for: A's panel is laid out by rows (row i's pairs contiguous,
//! [`super::micro::Tile::a_rows`]), and both panels hold a multiple of 16 pairs, zero past k.
//!
//! # The arithmetic
//!
//! `tdpbf16ps` does not add the products in k's order. For each element of C and each
//! instruction (16 pairs, 32 steps of k), it sums the high halves' products (the even steps) and
//! the low halves' (the odd steps) apart, each from +0 in fused multiply-adds, then adds the two
//! sums, then that to the accumulator; denormal inputs read as zero and denormal results flush to
//! zero (Intel's Software Developer's Manual). So an element of C is, per chunk of 256 steps of k
//! (`packed.rs`), the accumulator's sum over the chunk's blocks of 32 steps of `even + odd`,
//! written with the epilogue of `micro.rs`. Like the other tiles', an element's bits depend on
//! neither its place in the tile, nor the blocking, nor the threads; unlike theirs, they are not
//! the f32 product's of the rounded operands, whose sums run in k's order: the two differ as two
//! f32 orders of summation do. The zero pairs past k add a zero (of either sign) to a sum that is
//! never −0, and change nothing.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::micro::{Out, Tile};

/// Pairs of k one `tdpbf16ps` takes (a tile row of 64 bytes).
pub(super) const PAIRS: usize = 16;

/// The tile configuration `ldtilecfg` reads: palette 1, tiles 0–7 each of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1;
    let mut t = 0;
    while t < 8 {
        bytes[16 + 2 * t] = 64;
        bytes[48 + t] = 16;
        t += 1;
    }
    Config(bytes)
};

/// C's 32 × 32 sums, row-major, as the tiles store them.
#[repr(C, align(64))]
struct Sums([f32; 32 * 32]);

/// Computes `kc` pairs (a multiple of [`PAIRS`]) of the packed panels into the tile of C `out`
/// names: A's panel row-major (`a[i·kc + p]`, 32 rows), B's by steps (`b[p·32 + j]`).
///
/// # Safety
/// As [`Tile::run`]; the CPU runs AMX-TILE and AMX-BF16 (or the emulator is installed), the
/// process holds the tiles' permission, and this thread's tiles are configured ([`enter`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn amx_32x32(kc: usize, a: *const f32, b: *const f32, out: &Out) {
    debug_assert!(kc.is_multiple_of(PAIRS));
    let a_stride = kc * 4;
    let b_stride: usize = 32 * 4;
    let mut sums = Sums([0.0; 32 * 32]);
    // SAFETY: the panels hold 32 rows of `kc` pairs (A) and `kc` rows of 32 pairs (B), so each
    // load reads 16 rows of 64 bytes inside them; the stores write 16 rows of 64 bytes inside
    // `sums`. The tile registers are no Rust value's: the statements keep their order (none is
    // `pure`), and [`enter`] loaded the configuration before any tile is touched.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        for p0 in (0..kc).step_by(PAIRS) {
            let a0 = a.add(p0);
            let a1 = a.add(16 * kc + p0);
            let b0 = b.add(p0 * 32);
            let b1 = b0.add(16);
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                b0 = in(reg) b0,
                b1 = in(reg) b1,
                sa = in(reg) a_stride,
                sb = in(reg) b_stride,
                options(nostack, readonly)
            );
        }
        let s = sums.0.as_mut_ptr();
        asm!(
            "tilestored [{c00} + {stride}*1], tmm0",
            "tilestored [{c01} + {stride}*1], tmm1",
            "tilestored [{c10} + {stride}*1], tmm2",
            "tilestored [{c11} + {stride}*1], tmm3",
            c00 = in(reg) s,
            c01 = in(reg) s.add(16),
            c10 = in(reg) s.add(16 * 32),
            c11 = in(reg) s.add(16 * 32 + 16),
            stride = in(reg) b_stride,
            options(nostack)
        );
        write(&sums.0, out);
    }
}

/// Writes the sums into the tile's part of C with the chunk's epilogue (`micro.rs`): a whole
/// tile of a row-major C 16 lanes at a time, any other part element by element, with the same
/// two roundings.
///
/// # Safety
/// As [`Tile::run`]; the CPU has AVX-512 F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn write(sums: &[f32; 32 * 32], out: &Out) {
    // SAFETY: the caller's contract: the tile of C is in bounds and this call's alone.
    unsafe {
        if out.rows == 32 && out.cols == 32 && out.csc == 1 {
            let alpha = _mm512_set1_ps(out.alpha);
            for i in 0..32 {
                let row = out.c.offset(i as isize * out.rsc);
                for v in 0..2 {
                    let e = row.add(16 * v);
                    let acc = _mm512_loadu_ps(sums.as_ptr().add(32 * i + 16 * v));
                    let sum = if out.beta == 0.0 {
                        _mm512_mul_ps(alpha, acc)
                    } else if out.beta == 1.0 {
                        _mm512_fmadd_ps(alpha, acc, _mm512_loadu_ps(e))
                    } else {
                        let old = _mm512_mul_ps(_mm512_loadu_ps(e), _mm512_set1_ps(out.beta));
                        _mm512_fmadd_ps(alpha, acc, old)
                    };
                    _mm512_storeu_ps(e, sum);
                }
            }
        } else {
            super::micro::write_scalar(sums, 32, out);
        }
    }
}

/// Configures this thread's tiles ([`CONFIG`]), once before a thread's blocks of a product
/// rather than at every tile: the configuration holds until [`release`].
///
/// # Safety
/// The CPU runs AMX-TILE (or the emulator is installed) and the process holds the tiles'
/// permission.
#[cfg(target_arch = "x86_64")]
unsafe fn enter() {
    // SAFETY: the caller's contract; CONFIG is 64 readable bytes.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
}

/// Returns the tiles to their initial state, so that the OS need not save them.
///
/// # Safety
/// The CPU runs AMX-TILE (or the emulator is installed).
#[cfg(target_arch = "x86_64")]
unsafe fn release() {
    // SAFETY: the caller's contract.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The AMX tile of bf16 products.
#[cfg(target_arch = "x86_64")]
pub(super) const AMX_BF16: Tile = Tile {
    mr: 32,
    nr: 32,
    name: "amx 32×32",
    pairs: true,
    a_rows: true,
    k_multiple: PAIRS,
    enter: Some(enter),
    release: Some(release),
    run: amx_32x32,
};
